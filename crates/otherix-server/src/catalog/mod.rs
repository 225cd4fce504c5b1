//! The control plane's read model (DESIGN §6a): every object the broker,
//! authentication, the relay and desired-state computation read, in memory,
//! kept current from the store's change log — and every node's desired
//! state, computed only when something it holds changed.
//!
//! - **Loading**: [`Catalog::load`] reads the log's revision, then every
//!   row. Changes committed meanwhile are applied again later, which is
//!   harmless: applying a change re-reads its object whole.
//! - **Following**: [`Catalog::sync`] reads the changes after the last one
//!   applied, re-reads each object they name once, and applies it
//!   ([`model`]). API writes call it before they answer (a client reads its
//!   own writes); a background task polls every second for writes from
//!   elsewhere (the key rotation, and other processes on the same store).
//!   A log pruned past the last applied revision means a full load.
//! - **Desired states** ([`states`]): each applied change says whose own
//!   part and which overlays' shared sections it may have changed; those are
//!   marked dirty and recomputed — by the node's next heartbeat, or by the
//!   background task within [`COALESCE`] when an agent waits for a change —
//!   and only a node whose version changed is woken. A burst of writes
//!   costs one recomputation per affected part, not one per write; a
//!   section is computed once for all its members, and a node a few
//!   changes behind is answered with what changed.
//! - **Staleness**: if the catalog has not caught up with the store for
//!   [`MAX_LAG`], the broker refuses (503) rather than mint from stale state.

pub mod model;
mod relisten;
pub mod states;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use otherix_store::{ChangeKind, Store, StoreError};
use time::OffsetDateTime;
use tokio::sync::{watch, Notify};

pub use model::{LbEntry, Model, Moved, Snapshot, Touched, UserEntry, Verdict};
use states::States;

use crate::desired::Common;
use crate::keys::SessionKeys;

/// Dirty desired states are recomputed this long after the first change,
/// so a burst of writes folds into one round.
pub const COALESCE: Duration = Duration::from_millis(20);
/// The broker refuses when the catalog has not caught up for this long.
pub const MAX_LAG: Duration = Duration::from_secs(10);
/// On PostgreSQL, where other replicas write, the broker mints only from a
/// catalog holding every change committed until this long before it reads:
/// older, it catches up first (or refuses). A revocation therefore reaches
/// every replica's minting within this bound, and [`crate::revoke`] covers
/// what a replica may issue meanwhile.
pub const MINT_LAG: Duration = Duration::from_secs(2);
/// Catch-ups a follower of [`Catalog::applied`] may fall behind.
pub const APPLIED_BACKLOG: usize = 64;
/// Changes read per round trip to the store.
const BATCH: u32 = 5_000;
/// The background poll for changes made by other writers.
const POLL: Duration = Duration::from_secs(1);
/// At most one catch-up forced by an unknown credential this often.
const FORCED_CATCH_UP: Duration = Duration::from_millis(20);
/// Heartbeats written this long ago or less are read by
/// [`Catalog::follow_liveness`]: a few write intervals, and the clock
/// skew between replicas' hosts it tolerates.
const LIVENESS_WINDOW: time::Duration = time::Duration::seconds(20);

/// A heartbeat's answer.
#[derive(Debug, Clone)]
pub enum Answer {
    /// The agent holds the current version.
    Unchanged(u64),
    /// What changed since the version the agent applied (JSON).
    Delta(u64, Bytes),
    /// The whole state (JSON).
    Full(u64, Bytes),
}

#[derive(Debug, Default)]
struct Desired {
    states: States,
    /// Per node: the version published to its waiters.
    versions: HashMap<String, watch::Sender<u64>>,
}

/// See the module documentation.
#[derive(Debug)]
pub struct Catalog {
    store: Store,
    keys: Arc<SessionKeys>,
    cluster_id: String,
    mtu: u32,
    model: RwLock<Model>,
    revision: Mutex<i64>,
    /// Serializes catching up; readers never wait for it. Held through a
    /// [`CatchUp`], whose end tells [`Catalog::sync`]'s waiters (`rounds`).
    syncing: tokio::sync::Mutex<()>,
    /// Bumped whenever a catch-up ends, however it ended (served, failed,
    /// or its caller gone): the calls waiting for it look again, all at
    /// once, instead of taking the lock one behind the other.
    rounds: watch::Sender<u64>,
    /// Calls of [`Catalog::sync`] so far, and how many of the first of
    /// them a completed catch-up served (it began after they were made).
    syncs_asked: AtomicU64,
    syncs_served: AtomicU64,
    synced_at: Mutex<Instant>,
    /// When the last completed catch-up began: it holds every change
    /// committed before then.
    caught_up_to: Mutex<Instant>,
    /// When [`Catalog::caught_up_since`] last forced a catch-up.
    last_forced: Mutex<Instant>,
    desired: Mutex<Desired>,
    recompute: Notify,
    /// The next recompute skips [`COALESCE`]: a guest just switched nodes,
    /// and frames for it go to the old one until its peers hear.
    urgent: std::sync::atomic::AtomicBool,
    /// Ends a [`COALESCE`] wait early once an urgent change is in.
    hurry: Notify,
    /// When each node's heartbeat was last written to the store.
    written: Mutex<HashMap<String, Instant>>,
    /// Bumped when the revocations changed, whoever wrote them: the relay
    /// ends the sessions they cover on every replica.
    revoked: watch::Sender<u64>,
    /// Per node, the `vouched_at` of its heartbeats last applied from the
    /// store (see [`Catalog::follow_liveness`]).
    vouched: Mutex<HashMap<String, time::OffsetDateTime>>,
    /// What QEMU migrations' stream keys are derived from (see
    /// `desired::migration_key`); unset, QEMU guests are not handed over.
    migration_secret: std::sync::OnceLock<[u8; 32]>,
    /// The kinds of change each catch-up applied (all of them after a full
    /// load): what the web console's live updates follow.
    applied: tokio::sync::broadcast::Sender<Arc<BTreeSet<ChangeKind>>>,
}

impl Catalog {
    /// Loads everything from the store.
    pub async fn load(
        store: Store,
        keys: Arc<SessionKeys>,
        cluster_id: String,
        mtu: u32,
    ) -> Result<Arc<Catalog>, StoreError> {
        let (revision, model) = full_load(&store).await?;
        Ok(Arc::new(Catalog {
            store,
            keys,
            cluster_id,
            mtu,
            model: RwLock::new(model),
            revision: Mutex::new(revision),
            syncing: tokio::sync::Mutex::new(()),
            rounds: watch::channel(0).0,
            syncs_asked: AtomicU64::new(0),
            syncs_served: AtomicU64::new(0),
            synced_at: Mutex::new(Instant::now()),
            caught_up_to: Mutex::new(Instant::now()),
            last_forced: Mutex::new(Instant::now()),
            desired: Mutex::new(Desired::default()),
            recompute: Notify::new(),
            urgent: std::sync::atomic::AtomicBool::new(false),
            hurry: Notify::new(),
            written: Mutex::new(HashMap::new()),
            revoked: watch::channel(0).0,
            vouched: Mutex::new(HashMap::new()),
            migration_secret: std::sync::OnceLock::new(),
            applied: tokio::sync::broadcast::channel(APPLIED_BACKLOG).0,
        }))
    }

    /// Sets the secret QEMU migrations' stream keys are derived from (once).
    pub fn set_migration_secret(&self, secret: [u8; 32]) {
        let _ = self.migration_secret.set(secret);
    }

    /// The model, to read. Hold it briefly: changes wait for it.
    pub fn read(&self) -> RwLockReadGuard<'_, Model> {
        // A panic while the model was written leaves it as consistent as
        // the step that panicked; readers go on.
        self.model.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, Model> {
        self.model.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The last revision applied.
    pub fn revision(&self) -> i64 {
        *lock(&self.revision)
    }

    /// Whether the catalog has caught up with the store within [`MAX_LAG`].
    pub fn fresh(&self) -> bool {
        lock(&self.synced_at).elapsed() < MAX_LAG
    }

    /// Whether the catalog may mint now: on SQLite (this process is the
    /// only writer, and every write catches up before it answers) always;
    /// on PostgreSQL once it holds every change committed until
    /// [`MINT_LAG`] ago — catching up first when the background poll is
    /// behind. `false`: the store cannot be followed; refuse.
    pub async fn ready_to_mint(&self) -> bool {
        if self.store.dialect() == otherix_store::Dialect::Sqlite {
            return true;
        }
        if lock(&self.caught_up_to).elapsed() < MINT_LAG {
            return true;
        }
        self.caught_up_since(Instant::now() - MINT_LAG / 2).await;
        lock(&self.caught_up_to).elapsed() < MINT_LAG
    }

    /// Applies every change committed before the call. Callers that
    /// arrive while a catch-up runs share the next one: a catch-up serves
    /// every call made before it began, so a thousand heartbeats a second
    /// (each syncs after its own write) do not queue a thousand reads of
    /// the change log one behind the other, and a create waiting behind
    /// them is served by the first catch-up that begins after it asked.
    ///
    /// A call that finds a catch-up running does not queue for the lock:
    /// it waits for that catch-up's end with every other such call, then
    /// looks again — served, or one of them runs the next catch-up. Under
    /// load (a heartbeat, a create group each call this), a queue on the
    /// lock cost each waiter a turn on the runtime in a row before the
    /// next could even look.
    pub async fn sync(&self) -> Result<(), StoreError> {
        let ticket = self.syncs_asked.fetch_add(1, Ordering::SeqCst) + 1;
        let mut rounds = self.rounds.subscribe();
        loop {
            // Marked seen before looking: a catch-up that ends after this
            // line wakes the wait below.
            rounds.borrow_and_update();
            if self.syncs_served.load(Ordering::SeqCst) >= ticket {
                metrics::counter!("otherix_catalog_syncs_shared_total").increment(1);
                return Ok(());
            }
            let Ok(one) = self.syncing.try_lock() else {
                // One runs; it may have begun before this call. The sender
                // lives as long as the catalog.
                let _ = rounds.changed().await;
                continue;
            };
            let _one = CatchUp::new(one, &self.rounds);
            // Read before the catch-up reads the log: it holds every change
            // committed before each of these calls.
            let serves = self.syncs_asked.load(Ordering::SeqCst);
            self.sync_locked().await?;
            self.syncs_served.fetch_max(serves, Ordering::SeqCst);
            return Ok(());
        }
    }

    /// The catch-up lock, for a catch-up of the caller's own.
    async fn one_catch_up(&self) -> CatchUp<'_> {
        CatchUp::new(self.syncing.lock().await, &self.rounds)
    }

    /// Makes sure the catalog holds every change committed before `since`
    /// — on PostgreSQL, where other control planes write: a token, grant
    /// or node certificate made through another replica a moment ago is
    /// found rather than refused. Anyone can present an unknown token, so
    /// the cost is bounded: one catch-up at a time, at most one forced
    /// every [`FORCED_CATCH_UP`] (callers in between wait for the next,
    /// and share it), each one `changes_since` query when nothing changed.
    /// On SQLite this process is the only writer, and every write caught
    /// up already.
    pub async fn caught_up_since(&self, since: Instant) {
        if self.store.dialect() == otherix_store::Dialect::Sqlite || *lock(&self.caught_up_to) > since {
            return;
        }
        let wait = FORCED_CATCH_UP.saturating_sub(lock(&self.last_forced).elapsed());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let _one = self.one_catch_up().await;
        if *lock(&self.caught_up_to) > since {
            return;
        }
        *lock(&self.last_forced) = Instant::now();
        if let Err(e) = self.sync_locked().await {
            tracing::warn!(error = %e, "the catalog could not catch up");
        }
    }

    async fn sync_locked(&self) -> Result<Touched, StoreError> {
        let began = Instant::now();
        let mut touched = Touched::default();
        let mut keys_changed = false;
        let mut revoked = false;
        let mut kinds = BTreeSet::new();
        loop {
            let from = self.revision();
            // The VMs they name come with them (one round trip).
            let (changes, mut vms) = self.store.changes_and_vms_since(from, BATCH).await?;
            if changes.is_empty() {
                break;
            }
            // Pruned past where we were: start over from everything. Only a
            // gap after `from` can mean that (one extra read, not one per batch).
            let gap = changes.first().is_some_and(|c| c.revision > from + 1);
            if gap && from > 0 && self.store.oldest_revision().await? > from + 1 {
                tracing::warn!(
                    from,
                    "the change log was pruned past the catalog; loading everything again"
                );
                let (revision, model) = full_load(&self.store).await?;
                *self.write() = model;
                *lock(&self.revision) = revision;
                touched.gateways = true;
                kinds.extend(ChangeKind::ALL);
                // Whatever the pruned changes were, keys and revocations among them.
                keys_changed = true;
                revoked = true;
                let m = self.read();
                touched.nodes.extend(m.nodes().map(|n| n.name.clone()));
                touched.sections.extend(m.network_refs().map(|n| n.name.clone()));
                continue;
            }
            let last = changes.last().map_or(from, |c| c.revision);
            // A short batch read everything committed when it was read:
            // asking again would only find it empty (one more hand-over
            // to the store's thread per catch-up).
            let whole = changes.len() < BATCH as usize;
            let keys: BTreeSet<(ChangeKind, String)> = changes.into_iter().map(|c| (c.kind, c.key)).collect();
            let mut fetched = Vec::with_capacity(keys.len());
            // VMs came with the log (a group of creates changes many at
            // once), the rest are read one by one; applied in the log's
            // order of kinds.
            // Verdicts likewise (a new LB's backends are probed together).
            let pairs: Vec<(&str, &str)> = keys
                .iter()
                .filter(|(kind, _)| *kind == ChangeKind::Verdict)
                .filter_map(|(_, key)| key.split_once(' '))
                .collect();
            let mut verdicts: HashMap<(String, String), otherix_store::VerdictRecord> = if pairs.len() < 2 {
                HashMap::new()
            } else {
                self.store
                    .verdicts_of(&pairs)
                    .await?
                    .into_iter()
                    .map(|v| ((v.lb.clone(), v.vm_id.clone()), v))
                    .collect()
            };
            let batched_verdicts = pairs.len() >= 2;
            for (kind, key) in keys {
                keys_changed |= kind == ChangeKind::SessionKeys;
                revoked |= kind == ChangeKind::Revocations;
                kinds.insert(kind);
                fetched.push(match kind {
                    ChangeKind::Vm => {
                        let vm = vms.remove(&key);
                        Fetched::Vm(key, vm)
                    }
                    ChangeKind::Verdict if batched_verdicts => {
                        let (lb, vm) = key
                            .split_once(' ')
                            .map(|(a, b)| (a.to_string(), b.to_string()))
                            .unwrap_or_default();
                        let v = verdicts.remove(&(lb.clone(), vm.clone()));
                        Fetched::Verdict(lb, vm, v)
                    }
                    _ => fetch(&self.store, kind, &key).await?,
                });
            }
            {
                let mut model = self.write();
                for f in fetched {
                    touched.merge(apply(&mut model, f));
                }
            }
            *lock(&self.revision) = last;
            if whole {
                break;
            }
        }
        if keys_changed {
            self.keys_changed().await;
        }
        if revoked {
            self.revoked.send_modify(|n| *n += 1);
        }
        *lock(&self.synced_at) = Instant::now();
        *lock(&self.caught_up_to) = began;
        if !touched.is_empty() {
            self.mark_dirty(&touched);
        }
        if !kinds.is_empty() {
            // Nobody listening (no console open) is not an error.
            let _ = self.applied.send(Arc::new(kinds));
        }
        Ok(touched)
    }

    /// Heartbeats other control planes answered (PostgreSQL): what a
    /// heartbeat refreshes is soft state, not in the change log, so a
    /// replica would take nodes that heartbeat elsewhere for NotReady and
    /// their verdicts for stale. Every node's heartbeat is written every
    /// few seconds; this reads those written lately (one bounded query)
    /// and applies them: the last heartbeat, agent and applied version,
    /// never older than what this catalog saw itself, and — when it moved
    /// — the time the node last vouched for its verdicts (a heartbeat that
    /// listed only changes; a whole set vouches for nothing it left out).
    /// No desired state is touched.
    pub async fn follow_liveness(&self) -> Result<(), StoreError> {
        let since = time::OffsetDateTime::now_utc() - LIVENESS_WINDOW;
        let rows = self.store.liveness_since(since).await?;
        let mut vouched = lock(&self.vouched);
        let mut m = self.write();
        for (name, alive) in rows {
            if m.node(&name)
                .is_some_and(|n| n.last_heartbeat.is_none_or(|t| t < alive.at))
            {
                m.heartbeat(&name, alive.at, &alive.agent_version, alive.applied_version);
            }
            if let Some(at) = alive.vouched_at {
                let seen = vouched
                    .entry(name.clone())
                    .or_insert(time::OffsetDateTime::UNIX_EPOCH);
                if at > *seen {
                    *seen = at;
                    m.vouch(&name, at);
                }
            }
        }
        vouched.retain(|node, _| m.node(node).is_some());
        Ok(())
    }

    /// The kinds of change each catch-up applies from now on; a receiver
    /// that falls [`APPLIED_BACKLOG`] catch-ups behind is told it lagged.
    pub fn applied(&self) -> tokio::sync::broadcast::Receiver<Arc<BTreeSet<ChangeKind>>> {
        self.applied.subscribe()
    }

    /// Changes whenever the revocations did (see [`Model::revocations`]).
    pub fn revocations_changed(&self) -> watch::Receiver<u64> {
        self.revoked.subscribe()
    }

    /// Session keys changed (rotation): reload them and mark gateways dirty.
    async fn keys_changed(&self) {
        if let Err(e) = self.keys.rotate_if_due(OffsetDateTime::now_utc()).await {
            tracing::warn!(error = %e, "cannot reload session keys");
        }
    }

    fn mark_dirty(&self, touched: &Touched) {
        lock(&self.desired).states.mark(touched);
        self.recompute.notify_one();
        if self.urgent.load(std::sync::atomic::Ordering::Relaxed) {
            self.hurry.notify_one();
        }
    }

    /// The soft state of a heartbeat, straight into the model.
    pub fn heartbeat(&self, node: &str, at: OffsetDateTime, agent_version: &str, applied: Option<u64>) {
        self.write().heartbeat(node, at, agent_version, applied);
    }

    /// Whether `node`'s heartbeat was last written to the store longer
    /// than `every` ago (or never, by this process).
    pub fn heartbeat_write_due(&self, node: &str, every: time::Duration) -> bool {
        let every = Duration::try_from(every).unwrap_or_default();
        lock(&self.written).get(node).is_none_or(|t| t.elapsed() >= every)
    }

    /// The next recompute (the one the next catch-up wakes, or the one
    /// waiting out its [`COALESCE`]) runs as soon as that catch-up is in: for a change every waiting peer must hear at
    /// once (a guest handed over to another node: until its overlay's
    /// members repoint their FDB entries, frames for it reach the node it
    /// left).
    pub fn urgent(&self) {
        self.urgent.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// `node`'s heartbeat was written to the store now.
    pub fn heartbeat_written(&self, node: &str) {
        lock(&self.written).insert(node.to_string(), Instant::now());
    }

    /// A token's last use (soft state).
    pub fn token_used(&self, id: &str, at: OffsetDateTime) {
        self.write().token_used(id, at);
    }

    /// Refreshed probe times of verdicts that did not change (soft state).
    pub fn probed(&self, reports: &[(String, String, OffsetDateTime, u32, u32)]) {
        let mut m = self.write();
        for (lb, vm, at, ok, bad) in reports {
            m.verdict_probed(lb, vm, *at, *ok, *bad);
        }
    }

    /// VM `id` was just handed over from `from`: it forwards frames still
    /// arriving for the guest until `until` at the latest (soft state; see
    /// `desired::forwards`).
    pub fn moved(&self, id: &str, from: &str, until: time::OffsetDateTime) {
        let t = self.write().set_moved(id, from, until);
        self.mark_dirty(&t);
    }

    /// The forwarding for these VMs ends.
    pub fn end_moved(&self, ids: &[String]) {
        let mut t = Touched::default();
        {
            let mut m = self.write();
            for id in ids {
                t.merge(m.end_moved(id));
            }
        }
        if !t.is_empty() {
            self.mark_dirty(&t);
        }
    }

    /// Whether every one of `nodes` has applied its current desired state
    /// (brought up to date first): what it was told includes every change
    /// committed before now.
    pub fn applied_current(&self, nodes: &[String]) -> bool {
        let applied: Vec<Option<u64>> = {
            let m = self.read();
            nodes
                .iter()
                .map(|n| m.node(n).and_then(|r| r.applied_version))
                .collect()
        };
        let mut d = lock(&self.desired);
        nodes
            .iter()
            .zip(applied)
            .all(|(n, applied)| applied == Some(self.refresh_locked(&mut d, n)))
    }

    /// See [`Model::vouch`].
    pub fn vouch(&self, node: &str, at: OffsetDateTime) {
        self.write().vouch(node, at);
    }

    /// The answer to a heartbeat of `node` that applied `applied`: the
    /// version alone when that is current and the agent `unchanged_ok`, a
    /// delta when the agent `delta_ok` and the version it applied is still
    /// known — kept for as long as the node says it applied it — (with
    /// only the guests of its own part that changed when `guests_ok`), the
    /// whole state otherwise. The state is brought up to
    /// date first if something it holds changed.
    pub fn answer(
        &self,
        node: &str,
        applied: Option<u64>,
        unchanged_ok: bool,
        delta_ok: bool,
        guests_ok: bool,
    ) -> Answer {
        let reply = {
            let mut d = lock(&self.desired);
            // Before the refresh, which may make the version applied leave
            // the ones kept by count.
            d.states.applied(node, applied);
            let version = self.refresh_locked(&mut d, node);
            if unchanged_ok && applied == Some(version) {
                return Answer::Unchanged(version);
            }
            d.states.reply(node, applied.filter(|_| delta_ok), guests_ok)
        };
        // Serialized without the lock: a whole state is about 1 MiB at 10,000 VMs.
        let Some(reply) = reply else {
            return Answer::Full(0, Bytes::new());
        };
        if let Some(why) = reply.whole_why() {
            metrics::counter!("otherix_desired_whole_total", "reason" => why.as_label()).increment(1);
        }
        let version = reply.version();
        let json = Bytes::from(reply.json());
        if reply.is_delta() {
            Answer::Delta(version, json)
        } else {
            Answer::Full(version, json)
        }
    }

    /// Brings `node`'s state up to date if it may be stale, and tells its
    /// waiters when the version changed. Returns the version.
    fn refresh_locked(&self, d: &mut Desired, node: &str) -> u64 {
        let m = self.read();
        if !d.states.is_dirty(&m, node) {
            if let Some(v) = d.states.version(node) {
                return v;
            }
        }
        let published = self.keys.published_loaded(OffsetDateTime::now_utc());
        let common = Common {
            mtu: self.mtu,
            session_keys: &published,
            cluster_id: &self.cluster_id,
            migration_secret: self.migration_secret.get(),
        };
        let started = Instant::now();
        let version = d.states.refresh(&m, &common, node);
        drop(m);
        metrics::histogram!("otherix_desired_state_duration_seconds").record(started.elapsed().as_secs_f64());
        match d.versions.get(node) {
            Some(tx) => {
                tx.send_if_modified(|v| std::mem::replace(v, version) != version);
            }
            None => {
                d.versions.insert(node.to_string(), watch::channel(version).0);
            }
        }
        version
    }

    /// Ready gateways (heartbeat within `node_timeout`) that have not yet
    /// applied their current desired state — what a revocation waits for.
    /// A version is a hash of what the state holds, so one applied through
    /// another replica (learnt from the store's liveness rows) compares too.
    pub fn gateways_behind(&self, now: OffsetDateTime, node_timeout: time::Duration) -> Vec<String> {
        let ready: Vec<(String, Option<u64>)> = self
            .read()
            .gateways()
            .filter(|n| crate::desired::is_ready(n, now, node_timeout))
            .map(|n| (n.name.clone(), n.applied_version))
            .collect();
        let mut d = lock(&self.desired);
        ready
            .into_iter()
            .filter(|(name, applied)| *applied != Some(self.refresh_locked(&mut d, name)))
            .map(|(name, _)| name)
            .collect()
    }

    /// Waits for `node`'s desired version to differ from `version`, for at
    /// most `hold`. Returns the version then.
    pub async fn wait(&self, node: &str, version: u64, hold: Duration) -> u64 {
        let mut rx = {
            let mut d = lock(&self.desired);
            match d.versions.get(node) {
                Some(tx) => tx.subscribe(),
                None => {
                    // The node's own version, never the caller's: seeded
                    // with the caller's, a version the node never had (from
                    // before a restart, or made up) was held as current,
                    // and later waiters were told of a change to it.
                    let current = self.refresh_locked(&mut d, node);
                    d.versions
                        .entry(node.to_string())
                        .or_insert_with(|| watch::channel(current).0)
                        .subscribe()
                }
            }
        };
        // A dirty node has a waiter now: have it recomputed.
        self.recompute.notify_one();
        let changed = async {
            loop {
                let now = *rx.borrow_and_update();
                if now != version {
                    return now;
                }
                if rx.changed().await.is_err() {
                    return version;
                }
            }
        };
        tokio::time::timeout(hold, changed).await.unwrap_or(version)
    }

    /// Answers every held wait at once (shutdown): each gets its own
    /// version back, `changed: false`.
    pub fn close(&self) {
        lock(&self.desired).versions.clear();
    }

    /// Recomputes dirty nodes that have waiters, [`COALESCE`] after the
    /// first change of a burst, until the process ends; follows other
    /// writers' changes when the store says they committed (PostgreSQL) and
    /// every [`POLL`].
    pub fn spawn(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            let mut budget = WakeBudget::new(WAKE_BURST, WAKE_RATE);
            let mut lazy_budget = WakeBudget::new(LAZY_WAKE_BURST, LAZY_WAKE_RATE);
            // One bucket for the whole cluster (one key), and where the
            // last round's lazy wakes stopped, so that every node has its
            // turn rather than the first names each time.
            let mut lazy_total = WakeBudget::new(LAZY_WAKES_ALL_BURST, LAZY_WAKES_ALL_RATE);
            let mut lazy_after = String::new();
            let mut deferred: Option<Instant> = None;
            loop {
                match deferred.take() {
                    Some(at) => {
                        let at = tokio::time::Instant::from_std(at);
                        tokio::select! {
                            () = me.recompute.notified() => {}
                            () = tokio::time::sleep_until(at) => {}
                        }
                    }
                    None => me.recompute.notified().await,
                }
                // An urgent change cuts the wait short (or skips it), once
                // the catch-up that brings it has marked what it touched.
                if !me.urgent.swap(false, std::sync::atomic::Ordering::Relaxed) {
                    tokio::select! {
                        () = tokio::time::sleep(COALESCE) => {}
                        () = me.hurry.notified() => {
                            me.urgent.store(false, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
                let now = Instant::now();
                let due = {
                    let mut d = lock(&me.desired);
                    let d = &mut *d;
                    // Nodes nobody waits for are brought up to date at their next heartbeat.
                    let versions = &d.versions;
                    let waiting = |n: &str| versions.get(n).is_some_and(|tx| tx.receiver_count() > 0);
                    // As many lazy ones as the cluster's bucket lets this
                    // round wake, and a few for those their own bucket
                    // holds back; the others wait for their turn.
                    let at_most = lazy_total.tokens(ALL_NODES, now) as usize + LAZY_SLACK;
                    let due = d.states.due_in_turn(&me.read(), &lazy_after, at_most, waiting);
                    let now = due.now.into_iter().filter(|n| waiting(n)).map(|n| (n, false));
                    now.chain(due.lazy.into_iter().map(|n| (n, true)))
                        .collect::<Vec<_>>()
                };
                // One at a time: heartbeats are answered in between.
                for (node, lazy) in due {
                    // The lazy wakes come last and share one bucket: once it
                    // is empty, so it is for every lazy node left (none is
                    // looked at in vain, a thousand a round at 1,000 nodes).
                    if lazy {
                        if let Err(at) = lazy_total.check(ALL_NODES, now) {
                            deferred = Some(deferred.map_or(at, |d| d.min(at)));
                            break;
                        }
                    }
                    // Out of wakes for now (a burst of changes): it stays
                    // dirty, and is woken when its budget allows, with
                    // everything that changed meanwhile. A node only a
                    // section's new entries concern has the lower budget too.
                    let allowed = budget.check(&node, now).and_then(|()| {
                        if lazy {
                            lazy_budget
                                .check(&node, now)
                                .and_then(|()| lazy_total.check(ALL_NODES, now))
                        } else {
                            Ok(())
                        }
                    });
                    if let Err(at) = allowed {
                        deferred = Some(deferred.map_or(at, |d| d.min(at)));
                        continue;
                    }
                    let mut d = lock(&me.desired);
                    let before = d.states.version(&node);
                    if Some(me.refresh_locked(&mut d, &node)) != before {
                        budget.spend(&node, now);
                        if lazy {
                            lazy_budget.spend(&node, now);
                            lazy_total.spend(ALL_NODES, now);
                            lazy_after.clone_from(&node);
                        }
                    }
                }
                budget.forget_idle(now);
                lazy_budget.forget_idle(now);
            }
        });
        let me = self.clone();
        tokio::spawn(async move { me.follow().await });
    }

    /// Follows other writers' changes until the process ends: at once when
    /// the change listener says one committed (PostgreSQL), and every
    /// [`POLL`]. A lost listener is made again with backoff
    /// ([`relisten`]) while the poll carries on; the outage is logged when
    /// it starts and when it ends, and `otherix_store_listener_up`,
    /// `otherix_store_listener_reconnects_total` and
    /// `otherix_catalog_lag_seconds` show it.
    async fn follow(self: Arc<Self>) {
        // On PostgreSQL other control planes write too: their commits
        // wake this one at once; the poll stays as the safety net (a
        // notification lost with a connection).
        let mut liveness_at = Instant::now();
        let on_postgres = self.store.dialect() == otherix_store::Dialect::Postgres;
        let mut outage = relisten::Outage::default();
        let mut listener = match self.store.change_listener().await {
            Ok(l) => l,
            Err(e) => {
                outage.lost(Instant::now());
                tracing::warn!(error = %e, "cannot listen for other control planes' changes; polling every {POLL:?} and trying again");
                None
            }
        };
        let up_gauge = metrics::gauge!("otherix_store_listener_up");
        if on_postgres {
            up_gauge.set(if listener.is_some() { 1.0 } else { 0.0 });
        }
        let random = || u64::from_le_bytes(crate::random::bytes::<8>());
        let mut retry_at = outage
            .is_down()
            .then(|| Instant::now() + outage.next_delay(random()));
        loop {
            // Until the next poll, or the next attempt at a lost listener.
            let wait = retry_at.map_or(POLL, |at| at.saturating_duration_since(Instant::now()).min(POLL));
            let (mut trigger, lost) = match listener.as_mut() {
                Some(l) => tokio::select! {
                    () = tokio::time::sleep(wait) => ("poll", None),
                    woke = l.next() => match woke {
                        Ok(()) => ("notification", None),
                        Err(e) => ("lost", Some(e)),
                    },
                },
                None => {
                    tokio::time::sleep(wait).await;
                    ("poll", None)
                }
            };
            if let Some(e) = lost {
                listener = None;
                up_gauge.set(0.0);
                if outage.lost(Instant::now()) {
                    tracing::warn!(error = %e, "lost the change listener; polling every {POLL:?} and making it again");
                }
                retry_at = Some(Instant::now() + outage.next_delay(random()));
            }
            if retry_at.is_some_and(|at| at <= Instant::now()) {
                match self.store.change_listener().await {
                    Ok(l) => {
                        listener = l;
                        retry_at = None;
                        up_gauge.set(1.0);
                        metrics::counter!("otherix_store_listener_reconnects_total").increment(1);
                        trigger = "relisten";
                        if let Some((lasted, failed)) = outage.ended(Instant::now()) {
                            tracing::info!(
                                after_ms = lasted.as_millis() as u64,
                                failed_attempts = failed,
                                "change listener back; following other control planes at once again"
                            );
                        }
                    }
                    Err(e) => {
                        outage.failed();
                        tracing::debug!(error = %e, "the change listener cannot be made yet");
                        retry_at = Some(Instant::now() + outage.next_delay(random()));
                    }
                }
            }
            // A wake, a poll, or a listener made again (what it missed).
            metrics::counter!("otherix_catalog_syncs_total", "trigger" => trigger).increment(1);
            if let Err(e) = self.sync().await {
                tracing::warn!(error = %e, "catalog cannot follow the store");
            }
            metrics::gauge!("otherix_catalog_lag_seconds").set(self.lag().as_secs_f64());
            // Other replicas' heartbeats, once a poll interval (not at
            // every wake: writes come in bursts).
            if on_postgres && liveness_at.elapsed() >= POLL {
                liveness_at = Instant::now();
                if let Err(e) = self.follow_liveness().await {
                    tracing::warn!(error = %e, "catalog cannot follow other replicas' heartbeats");
                }
            }
        }
    }

    /// How far behind the store the catalog may be: it holds every change
    /// committed more than this long ago (the time since the start of its
    /// last complete catch-up).
    pub fn lag(&self) -> Duration {
        lock(&self.caught_up_to).elapsed()
    }
}

/// Wakes a node may get at once ...
const WAKE_BURST: f64 = 4.0;
/// ... and per second after that: a burst of changes (thousands of VMs
/// created) wakes each node a few times a second with everything changed
/// since, not at every round; a few changes in a row (a migration's steps)
/// still reach it at once.
const WAKE_RATE: f64 = 4.0;

/// Wakes a node may get at once, and per second after that, when all that
/// changed for it is new entries in a section of its (a guest placed on
/// another node, a member joined) or its guests' health checks (a load
/// balancer created, changed or deleted): a burst of creates wakes each member
/// about once a second instead of four times (the creates' hosts and the
/// gateways are woken at the full rate); the rest reaches it at its next
/// heartbeat anyway.
const LAZY_WAKE_BURST: f64 = 1.0;
const LAZY_WAKE_RATE: f64 = 1.0;

/// Such wakes in the whole cluster at once, and per second after that: up
/// to a hundred nodes each is woken about once a second as above; past
/// that, a burst of creates does not make every member of a large overlay
/// heartbeat once a second (a thousand nodes, a thousand extra heartbeats
/// a second, all for entries they take at their next heartbeat anyway):
/// the wakes go round the nodes at this rate.
const LAZY_WAKES_ALL_BURST: f64 = 100.0;
const LAZY_WAKES_ALL_RATE: f64 = 100.0;
/// The key of [`LAZY_WAKES_ALL_RATE`]'s one bucket.
const ALL_NODES: &str = "";

/// Lazy wakes a round names beyond what the cluster's bucket allows: for
/// those a node's own bucket holds back (woken less than a second ago).
const LAZY_SLACK: usize = 8;

/// Per node, a token bucket of wakes.
#[derive(Debug)]
struct WakeBudget {
    burst: f64,
    rate: f64,
    nodes: HashMap<String, (f64, Instant)>,
}

impl WakeBudget {
    fn new(burst: f64, rate: f64) -> WakeBudget {
        WakeBudget {
            burst,
            rate,
            nodes: HashMap::new(),
        }
    }

    fn tokens(&self, node: &str, now: Instant) -> f64 {
        self.nodes.get(node).map_or(self.burst, |(tokens, at)| {
            (tokens + now.saturating_duration_since(*at).as_secs_f64() * self.rate).min(self.burst)
        })
    }

    /// `Ok` when `node` may be woken now; otherwise when it may.
    fn check(&self, node: &str, now: Instant) -> Result<(), Instant> {
        let tokens = self.tokens(node, now);
        if tokens >= 1.0 {
            return Ok(());
        }
        Err(now + Duration::from_secs_f64((1.0 - tokens) / self.rate))
    }

    fn spend(&mut self, node: &str, now: Instant) {
        let tokens = self.tokens(node, now) - 1.0;
        self.nodes.insert(node.to_string(), (tokens, now));
    }

    /// Nodes whose bucket is full again need no entry.
    fn forget_idle(&mut self, now: Instant) {
        let (rate, burst) = (self.rate, self.burst);
        self.nodes.retain(|_, (tokens, at)| {
            *tokens + now.saturating_duration_since(*at).as_secs_f64() * rate < burst
        });
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section leaves its data consistent before it can panic.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The revision, then every row: changes after the revision are applied again.
async fn full_load(store: &Store) -> Result<(i64, Model), StoreError> {
    let revision = store.revision().await?;
    let now = OffsetDateTime::now_utc();
    let snap = Snapshot {
        nodes: store.nodes().await?,
        networks: store.networks().await?,
        vms: store.vms().await?,
        node_leases: store.node_leases().await?,
        lbs: store.lbs().await?,
        verdicts: store.verdicts().await?,
        revocations: store.revocations(now).await?,
        users: store.users().await?,
        tokens: store.tokens(None).await?,
        grants: store.grants().await?,
        certs: store.node_certs(None).await?,
        open_sessions: store.open_session_counts().await?,
    };
    Ok((revision, Model::build(snap)))
}

/// One object re-read after a change.
#[derive(Debug)]
enum Fetched {
    User(
        String,
        Option<(otherix_proto::User, Vec<otherix_store::TokenRecord>)>,
    ),
    Grant(String, Option<otherix_store::GrantRecord>),
    Network(String, Option<otherix_proto::Network>),
    Vm(String, Option<otherix_proto::Vm>),
    NodeLease(String, String, Option<otherix_store::NodeLease>),
    Node(String, Option<otherix_store::NodeRecord>),
    NodeCerts(String, Vec<otherix_store::NodeCertRecord>),
    Lb(String, Option<otherix_store::LbRecord>),
    Verdict(String, String, Option<otherix_store::VerdictRecord>),
    SessionKeys,
    Revocations(Vec<otherix_proto::agent::Revocation>),
    OpenSessions(String, Vec<(String, u64)>),
    /// Byte counts moved: the model holds none (the consoles are told).
    SessionBytes,
}

fn missing<T>(r: Result<T, StoreError>) -> Result<Option<T>, StoreError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(StoreError::NotFound { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

async fn fetch(store: &Store, kind: ChangeKind, key: &str) -> Result<Fetched, StoreError> {
    let pair = || {
        key.split_once(' ')
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .unwrap_or_default()
    };
    Ok(match kind {
        ChangeKind::User => {
            let user = missing(store.user(key).await)?;
            let found = match user {
                Some(u) => Some((u, store.tokens(Some(key)).await?)),
                None => None,
            };
            Fetched::User(key.to_string(), found)
        }
        ChangeKind::Grant => Fetched::Grant(key.to_string(), store.grant_by_id(key).await?),
        ChangeKind::Network => Fetched::Network(key.to_string(), missing(store.network(key).await)?),
        ChangeKind::Vm => Fetched::Vm(key.to_string(), store.vm_by_id(key).await?),
        ChangeKind::NodeLease => {
            let (network, node) = pair();
            let lease = store.node_lease(&network, &node).await?;
            Fetched::NodeLease(network, node, lease)
        }
        ChangeKind::Node => Fetched::Node(key.to_string(), missing(store.node(key).await)?),
        ChangeKind::NodeCert => Fetched::NodeCerts(key.to_string(), store.node_certs(Some(key)).await?),
        ChangeKind::Lb => Fetched::Lb(key.to_string(), missing(store.lb(key).await)?),
        ChangeKind::Verdict => {
            let (lb, vm) = pair();
            let v = store.verdict(&lb, &vm).await?;
            Fetched::Verdict(lb, vm, v)
        }
        ChangeKind::SessionKeys => Fetched::SessionKeys,
        ChangeKind::Revocations => Fetched::Revocations(store.revocations(OffsetDateTime::now_utc()).await?),
        ChangeKind::OpenSessions => {
            let n = store.open_session_count(key).await?;
            Fetched::OpenSessions(key.to_string(), n)
        }
        ChangeKind::SessionBytes => Fetched::SessionBytes,
    })
}

/// The catch-up lock held: when it goes (the catch-up done, failed, or
/// its caller gone), the lock is let go first and then every call of
/// [`Catalog::sync`] waiting on `rounds` is woken to look again.
struct CatchUp<'a> {
    one: Option<tokio::sync::MutexGuard<'a, ()>>,
    rounds: &'a watch::Sender<u64>,
}

impl<'a> CatchUp<'a> {
    fn new(one: tokio::sync::MutexGuard<'a, ()>, rounds: &'a watch::Sender<u64>) -> Self {
        CatchUp {
            one: Some(one),
            rounds,
        }
    }
}

impl Drop for CatchUp<'_> {
    fn drop(&mut self) {
        // Unlocked before the wake: a waiter woken while it is still held
        // would find it taken and wait for a wake that never comes.
        drop(self.one.take());
        self.rounds.send_modify(|n| *n = n.wrapping_add(1));
    }
}

fn apply(m: &mut Model, f: Fetched) -> Touched {
    match f {
        Fetched::User(name, u) => {
            m.set_user(&name, u);
            Touched::default()
        }
        Fetched::Grant(id, g) => {
            m.set_grant(&id, g);
            Touched::default()
        }
        Fetched::Network(name, n) => m.set_network(&name, n),
        Fetched::Vm(id, vm) => m.set_vm(&id, vm),
        Fetched::NodeLease(network, node, l) => m.set_node_lease(&network, &node, l),
        Fetched::Node(name, n) => m.set_node(&name, n),
        Fetched::NodeCerts(node, c) => {
            m.set_node_certs(&node, c);
            Touched::default()
        }
        Fetched::Lb(name, lb) => m.set_lb(&name, lb),
        Fetched::Verdict(lb, vm, v) => {
            m.set_verdict(&lb, &vm, v);
            Touched::default()
        }
        // The keys live in `SessionKeys`; gateways publish them.
        Fetched::SessionKeys => Touched {
            gateways: true,
            ..Default::default()
        },
        Fetched::Revocations(r) => m.set_revocations(r),
        Fetched::OpenSessions(p, n) => {
            m.set_open_sessions(&p, n);
            Touched::default()
        }
        Fetched::SessionBytes => Touched::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_is_woken_a_few_times_at_once_then_a_few_times_a_second() {
        let mut b = WakeBudget::new(WAKE_BURST, WAKE_RATE);
        let t0 = Instant::now();
        for _ in 0..4 {
            assert!(b.check("n1", t0).is_ok());
            b.spend("n1", t0);
        }
        let at = b.check("n1", t0).expect_err("the burst is spent");
        assert!(at > t0 && at <= t0 + Duration::from_millis(250), "{:?}", at - t0);
        assert!(b.check("n2", t0).is_ok(), "other nodes have their own");
        assert!(b.check("n1", at).is_ok(), "one more when the deferral ends");
        b.spend("n1", at);
        assert!(b.check("n1", at).is_err());
        // A second later the bucket is full again and forgotten.
        let later = at + Duration::from_secs(1);
        b.forget_idle(later);
        assert!(b.nodes.is_empty());
        assert!(b.check("n1", later).is_ok());
    }

    #[test]
    fn the_clusters_bucket_of_lazy_wakes_gives_a_hundred_at_once_then_a_hundred_a_second() {
        // The cluster's one bucket: a hundred at once, then a hundred a second.
        let mut all = WakeBudget::new(LAZY_WAKES_ALL_BURST, LAZY_WAKES_ALL_RATE);
        let t0 = Instant::now();
        for _ in 0..100 {
            all.check(ALL_NODES, t0).unwrap();
            all.spend(ALL_NODES, t0);
        }
        let at = all.check(ALL_NODES, t0).expect_err("spent");
        assert!(at - t0 <= Duration::from_millis(10), "{:?}", at - t0);
    }
}

#[cfg(test)]
mod sync_tests {
    use super::*;
    use otherix_proto::NetworkType;

    /// A catalog on a store of its own, in memory.
    async fn catalog() -> (Store, Arc<Catalog>) {
        let store = Store::open_in_memory().await.unwrap();
        let keys = Arc::new(SessionKeys::new(
            store.clone(),
            None,
            time::Duration::hours(1),
            time::Duration::minutes(5),
        ));
        let catalog = Catalog::load(store.clone(), keys, "cluster".into(), 1450)
            .await
            .unwrap();
        (store, catalog)
    }

    /// Many writers at once, each syncing after its own write as the API
    /// does: whether a call runs its own catch-up or is served by one that
    /// began after it asked, its write is in the catalog when it returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_sync_shared_with_other_callers_still_holds_the_callers_own_write() {
        let (store, catalog) = catalog().await;
        let mut tasks = Vec::new();
        for i in 0..64u32 {
            let (store, catalog) = (store.clone(), catalog.clone());
            tasks.push(tokio::spawn(async move {
                let name = format!("net{i}");
                store
                    .create_network(
                        &otherix_store::NewNetwork {
                            name: name.clone(),
                            id: format!("id{i}"),
                            kind: NetworkType::Overlay,
                            subnet: format!("10.{}.{}.0/24", 100 + i / 200, i % 200).parse().unwrap(),
                            nodes: vec![],
                        },
                        time::OffsetDateTime::now_utc(),
                    )
                    .await
                    .unwrap();
                catalog.sync().await.unwrap();
                assert!(
                    catalog.read().network_ref(&name).is_some(),
                    "{name} missing after its sync"
                );
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(catalog.read().network_refs().count(), 64);
        assert!(catalog.syncs_served.load(Ordering::SeqCst) >= 64);
    }

    /// Calls waiting while a catch-up runs are served together by the next
    /// one, which begins after all of them asked.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_waiting_behind_a_catch_up_share_the_next_one() {
        let (store, catalog) = catalog().await;
        // As if a catch-up were running.
        let running = catalog.one_catch_up().await;
        let waiting: Vec<_> = (0..10)
            .map(|_| {
                let catalog = catalog.clone();
                tokio::spawn(async move { catalog.sync().await })
            })
            .collect();
        while catalog.syncs_asked.load(Ordering::SeqCst) < 10 {
            tokio::task::yield_now().await;
        }
        drop(running);
        for w in waiting {
            w.await.unwrap().unwrap();
        }
        // The first to get the lock served all ten, the others returned.
        assert_eq!(catalog.syncs_served.load(Ordering::SeqCst), 10);
        // A call made after that is not served by it.
        store
            .create_network(
                &otherix_store::NewNetwork {
                    name: "late".into(),
                    id: "late".into(),
                    kind: NetworkType::Overlay,
                    subnet: "10.200.0.0/24".parse().unwrap(),
                    nodes: vec![],
                },
                time::OffsetDateTime::now_utc(),
            )
            .await
            .unwrap();
        catalog.sync().await.unwrap();
        assert!(catalog.read().network_ref("late").is_some());
        assert_eq!(catalog.syncs_served.load(Ordering::SeqCst), 11);
    }
}
