//! Every node's desired state, kept as parts (DESIGN §6a): one **section**
//! per overlay — its FDB and neighbor entries, computed once and shared by
//! every member — and each node's **own part**, everything else, computed
//! only when something it holds changed. A node's version is a hash of its
//! own part and its sections' hashes: recomposing it when a section changes
//! costs a hash, not the node's whole state. An own part is kept guest by
//! guest as a section is entry by entry: a VM created, deleted, moved or
//! matched by an LB updates only its own guest and health checks there,
//! and the own part's hash is a sum over them ([`desired::own_hash`]).
//!
//! Sections keep a short log of what changed, revision by revision, and
//! nodes the versions they had lately with what they were made of, so a
//! node behind gets a delta ([`DesiredDelta`]) — the entries added and
//! removed since the version it applied, and its own part only if that
//! changed (only the guests that changed, for an agent that takes them) —
//! instead of its whole state (about 1 MiB at 10,000 VMs). Besides the
//! last few versions, a node keeps, however far back, the one it says it
//! applied and the one it was last sent (which it says it applied at its
//! next heartbeat): a node woken many times while it converges is not sent
//! its whole state again. A section whose log no longer reaches back goes
//! whole in the delta, as does the own part; a delta in which all would go
//! whole is sent as the whole state, the smaller. Pure: the catalog holds
//! it under its lock and serializes the answers ([`Reply::json`]) after
//! letting go.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::Ipv4Addr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use otherix_core::MacAddr;
use otherix_proto::agent::{DesiredDelta, DesiredState, FdbEntry, GuestChange, NeighborEntry, OverlayChange};
use otherix_proto::NetworkType;

use super::model::{Model, Touched};
use crate::desired::json::{self, SectionJson};
use crate::desired::{
    self, keep_fdb, keeps_neighbor, Common, Entries, GuestPart, Section, SectionDiff, Source,
};

/// Versions a node keeps by count to answer with a delta against (the
/// one it applied and the one it was last sent are kept besides, however
/// far back: [`NodeState::applied`], [`NodeState::sent`]).
const HISTORY: usize = 8;
/// Revisions of its own part a node's log keeps (each version makes at
/// most one, so this covers every version kept).
const OWN_LOG: usize = 2 * HISTORY;
/// Revisions a section's log keeps at most.
const LOG_REVISIONS: usize = 256;
/// Entries a section's log keeps at least; beyond this, at most as many as
/// the section holds (past that, the whole section is the smaller answer).
const LOG_ENTRIES: usize = 1_024;
/// Revisions a section's JSON is carried through without a whole answer
/// reading it before it is let go (and written again when one does).
const JSON_IDLE: u32 = 256;

#[derive(Debug)]
struct SectionState {
    /// Distinguishes a section from an earlier one under the same name.
    generation: u64,
    revision: u64,
    hash: u64,
    data: Arc<Section>,
    /// `(revision, what changed from the one before)`, oldest first.
    log: VecDeque<(u64, Arc<SectionDiff>)>,
    logged: usize,
    /// Where the entries come from, to keep them from the guests that
    /// changed rather than recompute them all.
    counts: Counts,
    /// `data` as JSON, for the whole answers: written by the first one
    /// after a while without, then carried from revision to revision (the
    /// entries kept copied, the added ones written).
    json: Arc<JsonCell>,
    /// Revisions since a whole answer last read the JSON.
    json_idle: u32,
}

/// A section's JSON at one revision, written when first read.
#[derive(Debug, Default)]
pub struct JsonCell {
    json: OnceLock<SectionJson>,
    read: AtomicBool,
}

impl JsonCell {
    /// The JSON of `data` (the section at this cell's revision).
    fn get(&self, data: &Section) -> &SectionJson {
        if !self.read.load(Ordering::Relaxed) {
            self.read.store(true, Ordering::Relaxed);
        }
        self.json.get_or_init(|| SectionJson::of(data))
    }
}

/// A section's entries by source: what each guest and each member's lease
/// puts in, and how many sources give each entry — an entry leaves the
/// section only when no other source gives it too.
#[derive(Debug, Default)]
struct Counts {
    sources: HashMap<Source, Entries>,
    fdb: HashMap<FdbEntry, u32>,
    neighbors: HashMap<NeighborEntry, u32>,
    /// The sum of the entries' hashes (see [`Section::hash`]).
    hash_sum: u64,
    /// The sum of the FDB entries' hashes by VTEP: what the member there
    /// does not install ([`SectionState::view_hash`]).
    fdb_at: HashMap<Ipv4Addr, u64>,
}

impl Counts {
    fn of(sources: &desired::Sources) -> Counts {
        let mut c = Counts::default();
        for (id, e) in &sources.guests {
            c.add(e, &mut Touches::default());
            c.sources.insert(Source::Guest(id.clone()), *e);
        }
        for (node, e) in &sources.leases {
            c.add(e, &mut Touches::default());
            c.sources.insert(Source::Lease(node.clone()), *e);
        }
        c
    }

    fn add(&mut self, e: &Entries, t: &mut Touches) {
        t.neighbors
            .entry(e.neighbor)
            .or_insert_with(|| self.neighbors.contains_key(&e.neighbor));
        let n = self.neighbors.entry(e.neighbor).or_default();
        *n += 1;
        if *n == 1 {
            self.hash_sum = self.hash_sum.wrapping_add(desired::neighbor_hash(&e.neighbor));
        }
        if let Some(f) = e.fdb {
            t.fdb.entry(f).or_insert_with(|| self.fdb.contains_key(&f));
            let n = self.fdb.entry(f).or_default();
            *n += 1;
            if *n == 1 {
                let h = desired::fdb_hash(&f);
                self.hash_sum = self.hash_sum.wrapping_add(h);
                let at = self.fdb_at.entry(f.vtep).or_default();
                *at = at.wrapping_add(h);
            }
        }
    }

    fn remove(&mut self, e: &Entries, t: &mut Touches) {
        t.neighbors
            .entry(e.neighbor)
            .or_insert_with(|| self.neighbors.contains_key(&e.neighbor));
        if let Some(n) = self.neighbors.get_mut(&e.neighbor) {
            *n -= 1;
            if *n == 0 {
                self.neighbors.remove(&e.neighbor);
                self.hash_sum = self.hash_sum.wrapping_sub(desired::neighbor_hash(&e.neighbor));
            }
        }
        if let Some(f) = e.fdb {
            t.fdb.entry(f).or_insert_with(|| self.fdb.contains_key(&f));
            if let Some(n) = self.fdb.get_mut(&f) {
                *n -= 1;
                if *n == 0 {
                    self.fdb.remove(&f);
                    let h = desired::fdb_hash(&f);
                    self.hash_sum = self.hash_sum.wrapping_sub(h);
                    if let Some(at) = self.fdb_at.get_mut(&f.vtep) {
                        *at = at.wrapping_sub(h);
                        if *at == 0 {
                            self.fdb_at.remove(&f.vtep);
                        }
                    }
                }
            }
        }
    }
}

/// The entries a round of guest changes touched, each with whether the
/// section held it before.
#[derive(Debug, Default)]
struct Touches {
    fdb: BTreeMap<FdbEntry, bool>,
    neighbors: BTreeMap<NeighborEntry, bool>,
}

/// One overlay in a node's state: which section content it was given, and
/// with which lease (its view of the section depends on it).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Part {
    network: String,
    generation: u64,
    revision: u64,
    lease: (Ipv4Addr, MacAddr),
    /// The section's hash at that revision, and the member's view of it
    /// ([`SectionState::view_hash`] with the lease and [`Made::vtep`]):
    /// what follows from the fields above, kept so that a refresh that
    /// finds them unchanged does not look them up again.
    hash: u64,
    view: u64,
}

/// What a version of a node's state was made of.
#[derive(Debug, Clone)]
struct Made {
    version: u64,
    /// What the node holds once it has taken this version: see
    /// [`DesiredState::digest`].
    digest: u64,
    own_hash: u64,
    /// The own part's revision ([`Own::revision`]).
    own_revision: u64,
    vtep: Option<Ipv4Addr>,
    parts: Vec<Part>,
}

#[derive(Debug)]
struct NodeState {
    own: Own,
    now: Arc<Made>,
    /// Earlier versions, newest last.
    history: VecDeque<Arc<Made>>,
    /// The version the node last said it applied, while it says so
    /// ([`States::applied`]): a node woken often while it converges falls
    /// past the [`HISTORY`] kept by count, and is still answered with a
    /// delta against what it holds rather than its whole state again.
    applied: Option<Arc<Made>>,
    /// The version the node was last answered with: what it says it
    /// applied at its next heartbeat, however many versions were made
    /// meanwhile.
    sent: Option<Arc<Made>>,
}

impl NodeState {
    /// What version `version` of the node's state was made of, if kept.
    fn made(&self, version: u64) -> Option<&Arc<Made>> {
        if self.now.version == version {
            return Some(&self.now);
        }
        self.history
            .iter()
            .rev()
            .chain(&self.sent)
            .chain(&self.applied)
            .find(|h| h.version == version)
    }
}

/// A node's own part, kept by VM: what each guest puts in it, so a change
/// to one VM costs that VM's guest and checks, not the node's hundred.
#[derive(Debug)]
struct Own {
    state: Arc<DesiredState>,
    vtep: Option<Ipv4Addr>,
    /// [`desired::head_hash`] of the state and the VTEP.
    head_hash: u64,
    /// Each VM's non-empty part, with its hash.
    parts: HashMap<String, (GuestPart, u64)>,
    /// The sum of the parts' hashes.
    sum: u64,
    /// Bumped whenever the own part changes.
    revision: u64,
    /// `(revision, what changed)`, oldest first: the VMs whose parts
    /// changed, or `None` when anything else did.
    log: VecDeque<(u64, Option<BTreeSet<String>>)>,
}

impl Own {
    /// Computed whole from the model.
    fn new(m: &Model, common: &Common<'_>, node: &str) -> Own {
        let head = desired::own_head(m, common, node);
        let vtep = desired::node_vtep(m, node);
        let head_hash = desired::head_hash(&head, vtep);
        let parts: HashMap<String, (GuestPart, u64)> = desired::guest_parts(m, common, node, &head.overlays)
            .into_iter()
            .map(|(id, p)| {
                let h = p.hash();
                (id, (p, h))
            })
            .collect();
        let sum = parts.values().map(|(_, h)| *h).fold(0u64, u64::wrapping_add);
        let state = desired::assemble(head, parts.values().map(|(p, _)| p));
        Own {
            state: Arc::new(state),
            vtep,
            head_hash,
            parts,
            sum,
            revision: 0,
            log: VecDeque::new(),
        }
    }

    fn hash(&self) -> u64 {
        self.head_hash.wrapping_add(self.sum) & desired::HASH_BITS
    }

    /// Computed whole again; logged as a change of anything when it changed.
    fn rebuild(&mut self, m: &Model, common: &Common<'_>, node: &str) {
        let next = Own::new(m, common, node);
        if next.hash() == self.hash() && next.vtep == self.vtep && *next.state == *self.state {
            return;
        }
        // Only guests changed: logged as such, so a delta carries them alone.
        let what = (next.head_hash == self.head_hash && next.vtep == self.vtep).then(|| {
            let ids: BTreeSet<&String> = self.parts.keys().chain(next.parts.keys()).collect();
            ids.into_iter()
                .filter(|id| self.parts.get(*id).map(|p| &p.0) != next.parts.get(*id).map(|p| &p.0))
                .cloned()
                .collect()
        });
        let (revision, log) = (self.revision, std::mem::take(&mut self.log));
        *self = Own {
            revision,
            log,
            ..next
        };
        self.record(what);
    }

    /// Brings the head (all but the guests and health checks) up to date
    /// from the model; the guests' parts stay (a change to the head that
    /// changes one of them marks it too). Logged as a change of anything
    /// when it changed.
    fn update_head(&mut self, m: &Model, common: &Common<'_>, node: &str) {
        let mut head = desired::own_head(m, common, node);
        let vtep = desired::node_vtep(m, node);
        let head_hash = desired::head_hash(&head, vtep);
        let state = Arc::make_mut(&mut self.state);
        head.version = state.version;
        // The guests move from the state kept to the new head, unchanged;
        // the heads are compared without them.
        let guests = std::mem::take(&mut state.guests);
        let checks = std::mem::take(&mut state.health_checks);
        let same = head == *state && vtep == self.vtep;
        head.guests = guests;
        head.health_checks = checks;
        *state = head;
        if same {
            return;
        }
        self.vtep = vtep;
        self.head_hash = head_hash;
        self.record(None);
    }

    /// Brings the parts of VMs `ids` up to date from the model.
    fn update(&mut self, m: &Model, common: &Common<'_>, node: &str, ids: &BTreeSet<String>) {
        let mut changed = BTreeSet::new();
        for id in ids {
            let now = desired::guest_part_of(m, common, node, &self.state.overlays, id);
            let before = self.parts.get(id).map(|(p, _)| p);
            if before == Some(&now) || (before.is_none() && now.is_empty()) {
                continue;
            }
            let state = Arc::make_mut(&mut self.state);
            if let Some((p, h)) = self.parts.remove(id) {
                self.sum = self.sum.wrapping_sub(h);
                if let Some(g) = &p.guest {
                    if let Ok(i) = state.guests.binary_search_by(|x| x.vm_id.cmp(&g.vm_id)) {
                        state.guests.remove(i);
                    }
                }
                for c in &p.health_checks {
                    if let Ok(i) = state.health_checks.binary_search(c) {
                        state.health_checks.remove(i);
                    }
                }
            }
            if !now.is_empty() {
                if let Some(g) = &now.guest {
                    let i = state.guests.partition_point(|x| x.vm_id < g.vm_id);
                    state.guests.insert(i, g.clone());
                }
                for c in &now.health_checks {
                    let i = state.health_checks.partition_point(|x| x < c);
                    state.health_checks.insert(i, c.clone());
                }
                let h = now.hash();
                self.sum = self.sum.wrapping_add(h);
                self.parts.insert(id.clone(), (now, h));
            }
            changed.insert(id.clone());
        }
        if !changed.is_empty() {
            self.record(Some(changed));
        }
    }

    fn record(&mut self, what: Option<BTreeSet<String>>) {
        self.revision += 1;
        self.log.push_back((self.revision, what));
        while self.log.len() > OWN_LOG {
            self.log.pop_front();
        }
    }

    /// The VMs whose parts changed in revisions `(from, now]`; `None` when
    /// anything else changed, or the log no longer reaches back.
    fn guests_since(&self, from: u64) -> Option<BTreeSet<&String>> {
        if from >= self.revision {
            return Some(BTreeSet::new());
        }
        if self.log.front().is_none_or(|(r, _)| *r > from + 1) {
            return None;
        }
        let mut ids = BTreeSet::new();
        for (_, what) in self.log.iter().filter(|(r, _)| *r > from) {
            ids.extend(what.as_ref()?.iter());
        }
        Some(ids)
    }

    /// What VM `id` puts in the own part now, as a delta says it.
    fn change_of(&self, id: &str) -> GuestChange {
        let part = self.parts.get(id).map(|(p, _)| p);
        GuestChange {
            vm_id: id.to_string(),
            guest: part.and_then(|p| p.guest.clone()),
            health_checks: part.map(|p| p.health_checks.clone()).unwrap_or_default(),
        }
    }
}

/// See the module documentation.
#[derive(Debug, Default)]
pub struct States {
    sections: HashMap<String, SectionState>,
    nodes: HashMap<String, NodeState>,
    /// Nodes whose own part may have changed, to recompute whole.
    own_dirty: BTreeSet<String>,
    /// Nodes whose own part's head may have changed, its guests not (but
    /// those in `own_guests_dirty`).
    own_heads_dirty: BTreeSet<String>,
    /// Nodes → the VMs whose parts in their own part may have changed
    /// (nothing else of it): only those are looked at again.
    own_guests_dirty: BTreeMap<String, BTreeSet<String>>,
    /// Nodes → the VMs whose health checks alone may have changed: looked
    /// at again as those of `own_guests_dirty` are, but the node is woken
    /// at the lower rate ([`Due::lazy`]).
    own_health_dirty: BTreeMap<String, BTreeSet<String>>,
    /// Nodes one of whose sections changed (own part unchanged).
    recompose: BTreeSet<String>,
    /// Nodes one of whose sections only gained entries (a guest placed, a
    /// member joined): woken at a lower rate (see [`Due`]), brought up to
    /// date at their next heartbeat either way. As bits of [`NodeIds`]: a
    /// create marks every member of its overlay (hundreds of nodes at a
    /// thousand) with a few words' OR, not a lookup and insert each.
    recompose_lazy: Bits,
    node_ids: NodeIds,
    /// Overlay → its members as bits, and the membership stamp they were
    /// read at ([`Model::member_stamp`]).
    members: HashMap<String, (u64, Bits)>,
    /// Sections to recompute whole (the network changed).
    sections_dirty: BTreeSet<String>,
    /// Sections to bring up to date from the sources (guests, members'
    /// leases) that changed.
    sources_dirty: BTreeMap<String, BTreeSet<Source>>,
    /// Every gateway's own part may have changed.
    gateways_dirty: bool,
    generations: u64,
}

/// Node names as small numbers, for sets of nodes kept as bits. A name
/// keeps its number for the life of the process (a deleted node's name,
/// enrolled again, gets it back).
#[derive(Debug, Default)]
struct NodeIds {
    ids: HashMap<String, u32>,
    names: Vec<String>,
}

impl NodeIds {
    /// `name`'s number, given now if it has none.
    fn id(&mut self, name: &str) -> u32 {
        if let Some(&i) = self.ids.get(name) {
            return i;
        }
        let i = u32::try_from(self.names.len()).expect("fewer than 2^32 node names");
        self.names.push(name.to_string());
        self.ids.insert(name.to_string(), i);
        i
    }

    fn get(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    fn name(&self, i: u32) -> &str {
        &self.names[i as usize]
    }
}

/// A set of [`NodeIds`] numbers, one bit each.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Bits(Vec<u64>);

impl Bits {
    fn insert(&mut self, i: u32) {
        let (w, b) = (i as usize / 64, i % 64);
        if self.0.len() <= w {
            self.0.resize(w + 1, 0);
        }
        self.0[w] |= 1 << b;
    }

    fn remove(&mut self, i: u32) {
        if let Some(w) = self.0.get_mut(i as usize / 64) {
            *w &= !(1 << (i % 64));
        }
    }

    fn contains(&self, i: u32) -> bool {
        self.0
            .get(i as usize / 64)
            .is_some_and(|w| w & (1 << (i % 64)) != 0)
    }

    fn union_with(&mut self, other: &Bits) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (w, o) in self.0.iter_mut().zip(&other.0) {
            *w |= o;
        }
    }

    /// The numbers in the set, lowest first.
    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().enumerate().flat_map(|(w, &word)| {
            let mut rest = word;
            std::iter::from_fn(move || {
                if rest == 0 {
                    return None;
                }
                let b = rest.trailing_zeros();
                rest &= rest - 1;
                Some(w as u32 * 64 + b)
            })
        })
    }
}

/// Nodes whose version may be out of date ([`States::due`]).
#[derive(Debug, Default)]
pub struct Due {
    /// To wake at once (within the node's budget of wakes).
    pub now: BTreeSet<String>,
    /// To wake at the lower rate: a section of theirs only gained entries,
    /// or only health checks of their guests changed (a load balancer
    /// created, changed or deleted: its backends are served before any
    /// verdict, so the probes may start at the node's next heartbeat).
    /// In turn ([`States::due_in_turn`]), none of them in `now`.
    pub lazy: Vec<String>,
}

/// How a section changed.
enum Changed {
    No,
    /// Entries added, none removed or changed.
    AddedOnly,
    /// Anything else (or a section new to the CP).
    Removed,
}

/// A heartbeat's answer, to be serialized without the lock ([`Reply::json`]).
#[derive(Debug)]
pub enum Reply {
    Full {
        why: Whole,
        version: u64,
        digest: u64,
        own: Arc<DesiredState>,
        vtep: Option<Ipv4Addr>,
        /// Each overlay's section, with its JSON.
        sections: Vec<Option<(Arc<Section>, Arc<JsonCell>)>>,
    },
    Delta {
        version: u64,
        digest: u64,
        node: String,
        base: u64,
        own: OwnDelta,
        vtep: Option<Ipv4Addr>,
        changes: Vec<Change>,
    },
}

/// Why a node is answered with its whole state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Whole {
    /// It gave no version it applied (or does not take deltas).
    NoBase,
    /// The version it applied is no longer known.
    UnknownBase,
    /// A delta would have its own part and every section whole: no smaller.
    Smaller,
}

impl Whole {
    /// As a metric's label says it.
    pub fn as_label(self) -> &'static str {
        match self {
            Whole::NoBase => "no_base",
            Whole::UnknownBase => "unknown_base",
            Whole::Smaller => "smaller",
        }
    }
}

/// How a node's own part reaches it in a delta.
#[derive(Debug)]
pub enum OwnDelta {
    Unchanged,
    Whole(Arc<DesiredState>),
    /// Only these VMs' guests and health checks changed.
    Guests(Vec<GuestChange>),
}

/// How one overlay's entries reach a node in a delta.
#[derive(Debug)]
pub struct Change {
    network: String,
    /// The node's lease there, address and MAC (its view leaves it out).
    lease: (Ipv4Addr, MacAddr),
    what: ChangeOf,
}

#[derive(Debug)]
enum ChangeOf {
    /// The revisions since the node's, in order.
    Diffs(Vec<Arc<SectionDiff>>),
    /// The section, with its JSON.
    Whole(Arc<Section>, Arc<JsonCell>),
}

impl States {
    /// Notes what a change may have changed.
    pub fn mark(&mut self, t: &Touched) {
        self.own_dirty.extend(t.nodes.iter().cloned());
        self.own_heads_dirty.extend(t.heads.iter().cloned());
        for (node, ids) in &t.own_guests {
            self.own_guests_dirty
                .entry(node.clone())
                .or_default()
                .extend(ids.iter().cloned());
        }
        for (node, ids) in &t.health {
            self.own_health_dirty
                .entry(node.clone())
                .or_default()
                .extend(ids.iter().cloned());
        }
        self.sections_dirty.extend(t.sections.iter().cloned());
        for (net, ids) in &t.guests {
            self.sources_dirty
                .entry(net.clone())
                .or_default()
                .extend(ids.iter().cloned().map(Source::Guest));
        }
        for (net, nodes) in &t.leases {
            self.sources_dirty
                .entry(net.clone())
                .or_default()
                .extend(nodes.iter().cloned().map(Source::Lease));
        }
        self.gateways_dirty |= t.gateways;
    }

    /// Whether `node`'s version may be out of date (gateways resolved
    /// against `m`).
    pub fn is_dirty(&self, m: &Model, node: &str) -> bool {
        !self.nodes.contains_key(node)
            || self.own_dirty.contains(node)
            || self.own_heads_dirty.contains(node)
            || self.own_guests_dirty.contains_key(node)
            || self.own_health_dirty.contains_key(node)
            || self.recompose.contains(node)
            || self
                .node_ids
                .get(node)
                .is_some_and(|i| self.recompose_lazy.contains(i))
            || (self.gateways_dirty && m.node(node).is_some_and(|n| n.gateway.is_some()))
            || ((!self.sections_dirty.is_empty() || !self.sources_dirty.is_empty())
                && m.leased_network_names(node)
                    .any(|n| self.sections_dirty.contains(n) || self.sources_dirty.contains_key(n)))
    }

    /// Nodes whose version may be out of date: the sections are brought up
    /// to date first, which is what tells which members they concern.
    pub fn due(&mut self, m: &Model) -> Due {
        self.due_in_turn(m, "", usize::MAX, |_| true)
    }

    /// [`States::due`], of the nodes to wake lazily only the first
    /// `at_most` that `wanted` keeps, in turn: by name, those after
    /// `after` first (where the last round stopped), then the others. A
    /// round names as many as it may wake, not every member a burst of
    /// creates left dirty (a thousand, each round, at 1,000 nodes).
    pub fn due_in_turn(
        &mut self,
        m: &Model,
        after: &str,
        at_most: usize,
        mut wanted: impl FnMut(&str) -> bool,
    ) -> Due {
        // Deleted nodes are forgotten (a heartbeat of theirs is refused).
        // A node deleted is marked whole (`Touched::nodes`), so only those
        // marked are looked at, not every node each round; a model loaded
        // again whole marks the nodes it has, so fewer of them than states
        // kept is what says one went then.
        let gone: Vec<String> = self
            .own_dirty
            .iter()
            .filter(|n| m.node(n).is_none())
            .cloned()
            .collect();
        for n in &gone {
            self.nodes.remove(n);
            self.own_dirty.remove(n);
        }
        if self.nodes.len() > m.node_count() {
            self.nodes.retain(|n, _| m.node(n).is_some());
        }
        self.refresh_sections(m);
        self.resolve_gateways(m);
        let mut now: BTreeSet<String> = self.own_dirty.union(&self.recompose).cloned().collect();
        now.extend(self.own_heads_dirty.iter().cloned());
        now.extend(self.own_guests_dirty.keys().cloned());
        let mut lazy: Vec<&str> = self
            .recompose_lazy
            .iter()
            .map(|i| self.node_ids.name(i))
            .chain(self.own_health_dirty.keys().map(String::as_str))
            .filter(|n| !now.contains(*n))
            .collect();
        lazy.sort_unstable();
        lazy.dedup();
        let turn = lazy.partition_point(|n| *n <= after);
        lazy.rotate_left(turn);
        let lazy = lazy
            .into_iter()
            .filter(|n| wanted(n))
            .take(at_most)
            .map(str::to_string)
            .collect();
        Due { now, lazy }
    }

    fn resolve_gateways(&mut self, m: &Model) {
        if std::mem::take(&mut self.gateways_dirty) {
            self.own_dirty.extend(m.gateways().map(|n| n.name.clone()));
        }
    }

    fn refresh_sections(&mut self, m: &Model) {
        let mut sources = std::mem::take(&mut self.sources_dirty);
        for net in std::mem::take(&mut self.sections_dirty) {
            // Computed whole from the model as it is: the sources' changes are in.
            sources.remove(&net);
            // Its members too (a model loaded again stamps anew).
            self.members.remove(&net);
            self.refresh_section(m, &net);
        }
        for (net, ids) in sources {
            self.update_section(m, &net, &ids);
        }
    }

    /// Brings overlay `net`'s section up to date from the sources `ids`
    /// that changed (guests, members' leases): their entries as the model
    /// has them now against what they put in before. Costs what they
    /// changed, not what the overlay holds; a section not held yet, or
    /// whose network changed, is computed whole.
    fn update_section(&mut self, m: &Model, net: &str, ids: &BTreeSet<Source>) {
        let same_network = |s: &SectionState| {
            m.network_ref(net)
                .is_some_and(|n| n.kind == NetworkType::Overlay && n.id == s.data.network_id)
        };
        let Some(s) = self.sections.get_mut(net).filter(|s| same_network(s)) else {
            self.refresh_section(m, net);
            return;
        };
        let mut t = Touches::default();
        for id in ids {
            let now = desired::source_entries(m, net, id);
            let before = s.counts.sources.get(id).copied();
            if now == before {
                continue;
            }
            if let Some(e) = before {
                s.counts.remove(&e, &mut t);
                s.counts.sources.remove(id);
            }
            if let Some(e) = now {
                s.counts.add(&e, &mut t);
                s.counts.sources.insert(id.clone(), e);
            }
        }
        let mut diff = SectionDiff::default();
        for (e, was) in t.fdb {
            match (was, s.counts.fdb.contains_key(&e)) {
                (false, true) => diff.fdb_added.push(e),
                (true, false) => diff.fdb_removed.push(e),
                _ => {}
            }
        }
        for (e, was) in t.neighbors {
            match (was, s.counts.neighbors.contains_key(&e)) {
                (false, true) => diff.neighbors_added.push(e),
                (true, false) => diff.neighbors_removed.push(e),
                _ => {}
            }
        }
        if diff.is_empty() {
            return;
        }
        s.json = s.json_after(&diff);
        let data = Arc::make_mut(&mut s.data);
        sorted_apply(&mut data.fdb, &diff.fdb_added, &diff.fdb_removed);
        sorted_apply(
            &mut data.neighbors,
            &diff.neighbors_added,
            &diff.neighbors_removed,
        );
        s.hash = s.counts.hash_sum & desired::HASH_BITS;
        let changed = s.record(diff);
        self.wake_members(m, net, changed);
    }

    /// Recomputes overlay `net`'s section; when it changed, its members
    /// are recomposed.
    fn refresh_section(&mut self, m: &Model, net: &str) {
        let Some(sources) = desired::sources(m, net) else {
            self.sections.remove(net);
            return;
        };
        let next = desired::section_of(&sources);
        let counts = Counts::of(&sources);
        let changed = match self.sections.get_mut(net) {
            Some(s) if s.data.network_id == next.network_id => {
                s.counts = counts;
                if *s.data == next {
                    Changed::No
                } else {
                    let diff = s.data.diff(&next);
                    s.hash = s.counts.hash_sum & desired::HASH_BITS;
                    s.json = s.json_after(&diff);
                    s.data = Arc::new(next);
                    s.record(diff)
                }
            }
            _ => {
                self.generations += 1;
                let state = SectionState {
                    generation: self.generations,
                    revision: 1,
                    hash: counts.hash_sum & desired::HASH_BITS,
                    data: Arc::new(next),
                    log: VecDeque::new(),
                    logged: 0,
                    counts,
                    json: Arc::default(),
                    json_idle: 0,
                };
                self.sections.insert(net.to_string(), state);
                Changed::Removed
            }
        };
        self.wake_members(m, net, changed);
    }

    /// Marks `net`'s members for recomposing as its section `changed`.
    fn wake_members(&mut self, m: &Model, net: &str, changed: Changed) {
        match changed {
            Changed::No => {}
            Changed::Removed => self.recompose.extend(m.members(net).map(str::to_string)),
            // A guest placed or a member joined: the host and the gateways
            // (whose own parts change with it, and who dial guests) are
            // woken at once; the other members learn the new entries at a
            // lower rate, or at their next heartbeat.
            // A gateway is in both sets: `due` wakes it at once, not lazily.
            // Members already marked (a burst of creates) cost a lookup,
            // not a copy of their name.
            Changed::AddedOnly => {
                for g in m.gateways_on(net) {
                    if !self.recompose.contains(&g.name) {
                        self.recompose.insert(g.name.clone());
                    }
                }
                self.wake_lazily(m, net);
            }
        }
    }

    /// Marks `net`'s members to wake lazily. Its members as bits, as of
    /// the model's membership stamp: kept from the last call, moved by the
    /// membership changes since
    /// ([`Model::members_since`]: while a thousand nodes start, each joins
    /// ~98 overlays, and a walk of each overlay's members at each of them
    /// was thousands of names hashed per section changed), or walked when
    /// those are no longer kept.
    fn wake_lazily(&mut self, m: &Model, net: &str) {
        let stamp = m.member_stamp(net);
        let (ids, members) = (&mut self.node_ids, &mut self.members);
        let kept = members.get_mut(net).and_then(|(since, bits)| {
            if *since != stamp {
                for (node, member) in m.members_since(net, *since)? {
                    if member {
                        bits.insert(ids.id(node));
                    } else if let Some(i) = ids.get(node) {
                        bits.remove(i);
                    }
                }
                *since = stamp;
            }
            Some(())
        });
        if kept.is_none() {
            let mut bits = Bits::default();
            for n in m.members(net) {
                bits.insert(ids.id(n));
            }
            members.insert(net.to_string(), (stamp, bits));
        }
        let bits = &members[net].1;
        debug_assert!(
            {
                let walked: Option<Vec<u32>> = m.members(net).map(|n| ids.get(n)).collect();
                walked.is_some_and(|mut w| {
                    w.sort_unstable();
                    bits.iter().eq(w)
                })
            },
            "{net}'s members kept are not its members"
        );
        self.recompose_lazy.union_with(bits);
    }

    /// Brings `node`'s version up to date; returns it.
    pub fn refresh(&mut self, m: &Model, common: &Common<'_>, node: &str) -> u64 {
        self.refresh_sections(m);
        self.resolve_gateways(m);
        let whole = self.own_dirty.remove(node);
        let head = self.own_heads_dirty.remove(node);
        let guests = match (
            self.own_guests_dirty.remove(node),
            self.own_health_dirty.remove(node),
        ) {
            (Some(mut ids), Some(health)) => {
                ids.extend(health);
                Some(ids)
            }
            (ids, health) => ids.or(health),
        };
        self.recompose.remove(node);
        if let Some(i) = self.node_ids.get(node) {
            self.recompose_lazy.remove(i);
        }
        let fresh = match self.nodes.get_mut(node) {
            Some(n) => {
                if whole {
                    n.own.rebuild(m, common, node);
                } else {
                    // The head first: whether a guest is plugged in depends
                    // on the overlays it lists.
                    if head {
                        n.own.update_head(m, common, node);
                    }
                    if let Some(ids) = &guests {
                        n.own.update(m, common, node, ids);
                    }
                }
                None
            }
            None => Some(Own::new(m, common, node)),
        };
        let own = fresh.as_ref().or(self.nodes.get(node).map(|n| &n.own));
        let Some(own) = own else {
            return 0;
        };
        let (own_hash, own_revision, vtep) = (own.hash(), own.revision, own.vtep);
        let overlays: Vec<(String, (Ipv4Addr, MacAddr))> = own
            .state
            .overlays
            .iter()
            .map(|o| (o.network.clone(), (o.address.addr(), o.mac)))
            .collect();
        // The version this one follows: a part whose section has not moved
        // since (a lazily woken member's sections but one) keeps its hash
        // and view, not looked up again in the section's counts.
        let before = match &fresh {
            None => self.nodes.get(node).map(|n| n.now.clone()),
            Some(_) => None,
        };
        let before = before.filter(|b| b.vtep == vtep);
        let mut kept = 0;
        let mut at = 0;
        let mut parts = Vec::with_capacity(overlays.len());
        for (network, lease) in overlays {
            if !self.sections.contains_key(&network) {
                self.refresh_section(m, &network);
            }
            let s = self.sections.get(&network);
            let (generation, revision) = s.map_or((0, 0), |s| (s.generation, s.revision));
            // Both lists follow the node's overlays in name order.
            let was = before.as_ref().and_then(|b| {
                while b.parts.get(at).is_some_and(|p| p.network < network) {
                    at += 1;
                }
                b.parts
                    .get(at)
                    .filter(|p| p.network == network && p.generation == generation && p.lease == lease)
            });
            let (hash, view) = match (was, s) {
                (Some(p), _) if p.revision == revision => {
                    kept += 1;
                    (p.hash, p.view)
                }
                // Moved since (at 1,000 nodes and a hundred creates a
                // second, nearly every section of every member between
                // two of its heartbeats): the view follows the diffs.
                (Some(p), Some(s)) => match s.view_since(p.revision, (p.hash, p.view), vtep, lease) {
                    Some(view) => (s.hash, view),
                    None => (s.hash, s.view_hash(vtep, lease)),
                },
                (None, Some(s)) => (s.hash, s.view_hash(vtep, lease)),
                (_, None) => (0, 0),
            };
            parts.push(Part {
                network,
                generation,
                revision,
                lease,
                hash,
                view,
            });
        }
        let (version, digest) = match before
            .as_ref()
            .filter(|b| b.own_hash == own_hash && kept == parts.len() && kept == b.parts.len())
        {
            // Every part as before, and the own part: the same version.
            Some(b) => (b.version, b.digest),
            None => {
                let named: Vec<(&str, u64)> = parts.iter().map(|p| (p.network.as_str(), p.hash)).collect();
                let viewed: Vec<(&str, u64)> = parts.iter().map(|p| (p.network.as_str(), p.view)).collect();
                (
                    desired::version(own_hash, &named),
                    desired::version(own_hash, &viewed),
                )
            }
        };
        let made = Made {
            version,
            digest,
            own_hash,
            own_revision,
            vtep,
            parts,
        };
        let version = made.version;
        match fresh {
            Some(own) => {
                self.nodes.insert(
                    node.to_string(),
                    NodeState {
                        own,
                        now: Arc::new(made),
                        history: VecDeque::new(),
                        applied: None,
                        sent: None,
                    },
                );
            }
            None => {
                if let Some(n) = self.nodes.get_mut(node) {
                    if n.now.parts != made.parts || n.now.own_hash != made.own_hash || n.now.vtep != made.vtep
                    {
                        let old = std::mem::replace(&mut n.now, Arc::new(made));
                        n.history.push_back(old);
                        if n.history.len() > HISTORY {
                            n.history.pop_front();
                        }
                    } else {
                        // A pin sharing it keeps the revision it was sent at.
                        Arc::make_mut(&mut n.now).own_revision = made.own_revision;
                    }
                }
            }
        }
        version
    }

    /// `node`'s own part as kept.
    #[cfg(test)]
    pub fn own(&self, node: &str) -> Option<&DesiredState> {
        Some(&self.nodes.get(node)?.own.state)
    }

    /// Overlay `net`'s section as last brought up to date.
    #[cfg(test)]
    pub fn section(&self, net: &str) -> Option<&Section> {
        Some(&self.sections.get(net)?.data)
    }

    /// `node`'s version as last refreshed.
    pub fn version(&self, node: &str) -> Option<u64> {
        Some(self.nodes.get(node)?.now.version)
    }

    /// Notes that `node` says it applied version `applied` (`None`:
    /// nothing yet): that version is kept to answer with a delta against
    /// for as long as the node says so, whatever it is made of since; the
    /// one kept before goes. To be called at each heartbeat before the
    /// state is refreshed (which may let the version leave the history).
    /// Costs a look through the versions the node keeps, not the cluster.
    pub fn applied(&mut self, node: &str, applied: Option<u64>) {
        let Some(n) = self.nodes.get_mut(node) else {
            return;
        };
        if n.applied.as_ref().map(|m| m.version) == applied {
            return;
        }
        n.applied = applied.and_then(|v| n.made(v)).cloned();
    }

    /// The answer for `node` (refreshed): a delta against `base` when
    /// `base` is given, still known (kept by count, or as the version the
    /// node applied or was last sent) and the delta is the smaller answer,
    /// the whole state otherwise. With `guest_changes`, a delta carries
    /// only the guests of the own part that changed when nothing else of
    /// it did. The version answered is kept as the one sent.
    pub fn reply(&mut self, node: &str, base: Option<u64>, guest_changes: bool) -> Option<Reply> {
        let reply = self.answer(node, base, guest_changes)?;
        if let Some(n) = self.nodes.get_mut(node) {
            n.sent = Some(n.now.clone());
        }
        Some(reply)
    }

    fn answer(&self, node: &str, base: Option<u64>, guest_changes: bool) -> Option<Reply> {
        let n = self.nodes.get(node)?;
        let why = match base {
            None => Whole::NoBase,
            Some(b) => match self.delta(node, n, b, guest_changes) {
                Ok(reply) => return Some(reply),
                Err(why) => why,
            },
        };
        Some(Reply::Full {
            why,
            version: n.now.version,
            digest: n.now.digest,
            own: n.own.state.clone(),
            vtep: n.now.vtep,
            sections: n
                .now
                .parts
                .iter()
                .map(|p| {
                    self.sections
                        .get(&p.network)
                        .filter(|s| s.generation == p.generation)
                        .map(|s| (s.data.clone(), s.json.clone()))
                })
                .collect(),
        })
    }

    fn delta(&self, node: &str, n: &NodeState, base: u64, guest_changes: bool) -> Result<Reply, Whole> {
        let past = n.made(base).ok_or(Whole::UnknownBase)?;
        let vtep_same = past.vtep == n.now.vtep;
        let mut changes = Vec::new();
        let mut at = 0;
        for part in &n.now.parts {
            let s = self.sections.get(&part.network).ok_or(Whole::UnknownBase)?;
            if s.generation != part.generation {
                return Err(Whole::UnknownBase);
            }
            // Both lists follow the node's overlays in name order: the one
            // before is found where the last search stopped, not by a walk
            // from the start for each overlay (a thousand compares a reply
            // at 63 overlays); out of order, by the walk.
            while past.parts.get(at).is_some_and(|p| p.network < part.network) {
                at += 1;
            }
            let before = match past.parts.get(at) {
                Some(p) if p.network == part.network => Some(p),
                _ => past.parts.iter().find(|p| p.network == part.network),
            };
            let what = match before {
                Some(b) if vtep_same && b.generation == part.generation && b.lease == part.lease => {
                    if b.revision == part.revision {
                        continue;
                    }
                    match diffs_between(s, b.revision, part.revision) {
                        Some(d) => ChangeOf::Diffs(d),
                        None => ChangeOf::Whole(s.data.clone(), s.json.clone()),
                    }
                }
                _ => ChangeOf::Whole(s.data.clone(), s.json.clone()),
            };
            changes.push(Change {
                network: part.network.clone(),
                lease: part.lease,
                what,
            });
        }
        let own = if past.own_hash == n.now.own_hash {
            OwnDelta::Unchanged
        } else {
            match n.own.guests_since(past.own_revision).filter(|_| guest_changes) {
                Some(ids) => OwnDelta::Guests(ids.into_iter().map(|id| n.own.change_of(id)).collect()),
                None => OwnDelta::Whole(n.own.state.clone()),
            }
        };
        // Own part and every section whole: the delta holds all the whole
        // state does, and the overlays twice (in the own part and in the
        // changes) — the whole state is the smaller answer. Any section
        // left out, or the own part, makes the delta the smaller.
        let all_whole = changes.len() == n.now.parts.len()
            && changes.iter().all(|c| matches!(c.what, ChangeOf::Whole(..)));
        if all_whole && matches!(own, OwnDelta::Whole(_)) {
            return Err(Whole::Smaller);
        }
        Ok(Reply::Delta {
            version: n.now.version,
            digest: n.now.digest,
            node: node.to_string(),
            base,
            own,
            vtep: n.now.vtep,
            changes,
        })
    }
}

impl SectionState {
    /// The hash of the entries the member at `vtep` with `lease` (its
    /// address and MAC on the overlay) installs ([`Section::view`]): the
    /// section's less the FDB entries at its VTEP and its own neighbor
    /// entry. A lookup or two, not a pass over the entries.
    fn view_hash(&self, vtep: Option<Ipv4Addr>, (ip, mac): (Ipv4Addr, MacAddr)) -> u64 {
        let c = &self.counts;
        let at_vtep = vtep.and_then(|v| c.fdb_at.get(&v)).copied().unwrap_or(0);
        let own = NeighborEntry { ip, mac };
        let own_neighbor = if c.neighbors.contains_key(&own) {
            desired::neighbor_hash(&own)
        } else {
            0
        };
        c.hash_sum.wrapping_sub(at_vtep).wrapping_sub(own_neighbor) & desired::HASH_BITS
    }
    /// The diffs of the revisions after `from`, if the log still holds
    /// them all: it holds consecutive revisions up to the current one, so
    /// the first is found by its number, not by a walk of the log (up to
    /// [`LOG_REVISIONS`] for each section of each answer).
    fn log_since(&self, from: u64) -> Option<std::collections::vec_deque::Iter<'_, (u64, Arc<SectionDiff>)>> {
        if from > self.revision {
            return None;
        }
        let first = self.log.front()?.0;
        if first > from + 1 {
            return None;
        }
        let skip = usize::try_from(from + 1 - first).ok()?;
        debug_assert!(self.log.get(skip).is_none_or(|(r, _)| *r == from + 1));
        Some(self.log.range(skip..))
    }

    /// [`SectionState::view_hash`] from the view of revision `revision`
    /// (whose section hash was `hash`, and the member's view `view`): what
    /// the member leaves out moves only with the diffs since that name its
    /// VTEP's FDB entries or its own neighbor entry, a few entries rather
    /// than two lookups in the section's large maps. `None` when the log
    /// no longer holds them.
    fn view_since(
        &self,
        revision: u64,
        (hash, view): (u64, u64),
        vtep: Option<Ipv4Addr>,
        (ip, mac): (Ipv4Addr, MacAddr),
    ) -> Option<u64> {
        let own = NeighborEntry { ip, mac };
        let mut left_out = hash.wrapping_sub(view);
        for (_, d) in self.log_since(revision)? {
            if let Some(v) = vtep {
                for e in d.fdb_added.iter().filter(|e| e.vtep == v) {
                    left_out = left_out.wrapping_add(desired::fdb_hash(e));
                }
                for e in d.fdb_removed.iter().filter(|e| e.vtep == v) {
                    left_out = left_out.wrapping_sub(desired::fdb_hash(e));
                }
            }
            if d.neighbors_added.contains(&own) {
                left_out = left_out.wrapping_add(desired::neighbor_hash(&own));
            }
            if d.neighbors_removed.contains(&own) {
                left_out = left_out.wrapping_sub(desired::neighbor_hash(&own));
            }
        }
        let view = self.hash.wrapping_sub(left_out) & desired::HASH_BITS;
        debug_assert_eq!(view, self.view_hash(vtep, (ip, mac)));
        Some(view)
    }

    /// The JSON cell for the revision `diff` makes of `data` (not yet
    /// changed): the JSON carried through it when a whole answer read it
    /// lately, else left to be written when one does.
    fn json_after(&mut self, diff: &SectionDiff) -> Arc<JsonCell> {
        if self.json.read.load(Ordering::Relaxed) {
            self.json_idle = 0;
        } else {
            self.json_idle = self.json_idle.saturating_add(1);
        }
        let json = match self.json.json.get() {
            Some(j) if self.json_idle <= JSON_IDLE => OnceLock::from(j.updated(&self.data, diff)),
            _ => OnceLock::new(),
        };
        Arc::new(JsonCell {
            json,
            read: AtomicBool::new(false),
        })
    }

    /// Logs `diff` (the data already changed) as the next revision.
    fn record(&mut self, diff: SectionDiff) -> Changed {
        let added_only = diff.fdb_removed.is_empty() && diff.neighbors_removed.is_empty();
        self.revision += 1;
        self.logged += diff.len();
        self.log.push_back((self.revision, Arc::new(diff)));
        let keep = LOG_ENTRIES.max(self.data.len());
        while self.log.len() > LOG_REVISIONS || (self.logged > keep && self.log.len() > 1) {
            if let Some((_, d)) = self.log.pop_front() {
                self.logged -= d.len();
            }
        }
        if added_only {
            Changed::AddedOnly
        } else {
            Changed::Removed
        }
    }
}

/// Adds `added` to and takes `removed` from the sorted `v` (each sorted,
/// `added` absent from `v` and `removed` present).
fn sorted_apply<T: Ord + Copy>(v: &mut Vec<T>, added: &[T], removed: &[T]) {
    for e in removed {
        if let Ok(i) = v.binary_search(e) {
            v.remove(i);
        }
    }
    for e in added {
        if let Err(i) = v.binary_search(e) {
            v.insert(i, *e);
        }
    }
}

/// The diffs of revisions `(from, to]`, if the log still holds them all
/// and `to` is the section's current revision.
fn diffs_between(s: &SectionState, from: u64, to: u64) -> Option<Vec<Arc<SectionDiff>>> {
    if to != s.revision || from > to {
        return None;
    }
    Some(s.log_since(from)?.map(|(_, d)| d.clone()).collect())
}

impl Reply {
    pub fn version(&self) -> u64 {
        match self {
            Reply::Full { version, .. } | Reply::Delta { version, .. } => *version,
        }
    }

    pub fn is_delta(&self) -> bool {
        matches!(self, Reply::Delta { .. })
    }

    /// Why the whole state, for a whole state.
    pub fn whole_why(&self) -> Option<Whole> {
        match self {
            Reply::Full { why, .. } => Some(*why),
            Reply::Delta { .. } => None,
        }
    }

    /// The answer as the agent reads it.
    pub fn state(&self) -> DesiredState {
        self.state_with(None)
    }

    /// [`Reply::state`], a delta's overlay changes replaced by `overlays`
    /// when given.
    fn state_with(&self, overlays: Option<Vec<OverlayChange>>) -> DesiredState {
        match self {
            Reply::Full {
                version,
                digest,
                own,
                vtep,
                sections,
                ..
            } => desired::compose(own, *vtep, *version, Some(*digest), |i| {
                sections.get(i).and_then(|s| s.as_ref()).map(|(s, _)| &**s)
            }),
            Reply::Delta {
                version,
                digest,
                node,
                base,
                own,
                vtep,
                changes,
            } => DesiredState {
                version: *version,
                digest: Some(*digest),
                node: node.clone(),
                delta: Some(DesiredDelta {
                    base: *base,
                    own: match own {
                        OwnDelta::Whole(o) => Some(Box::new((**o).clone())),
                        _ => None,
                    },
                    guests: match own {
                        OwnDelta::Guests(g) => g.clone(),
                        _ => Vec::new(),
                    },
                    overlays: overlays.unwrap_or_else(|| Self::overlay_changes(changes, *vtep)),
                }),
                ..Default::default()
            },
        }
    }

    fn overlay_changes(changes: &[Change], vtep: Option<Ipv4Addr>) -> Vec<OverlayChange> {
        changes
            .iter()
            .map(|c| c.overlay_change(vtep))
            .filter(|c| !c.is_empty())
            .collect()
    }

    /// A delta as JSON: the state through serde with one stand-in overlay
    /// change, whose bytes are then replaced by the changes written
    /// straight ([`desired::overlay_changes_json`]). The stand-in's name
    /// holds NULs, which no name can (a network's is validated), so its
    /// bytes are found once; were they not, the delta goes through serde.
    fn delta_json(&self, vtep: Option<Ipv4Addr>, changes: &[Change]) -> Vec<u8> {
        const STAND_IN: &str = "\0otherix-overlay-changes\0";
        const STAND_IN_JSON: &[u8] = br#"[{"network":"\u0000otherix-overlay-changes\u0000"}]"#;
        // The changes first (each written from its diffs where it can be),
        // to know whether there are any.
        let mut list = Vec::with_capacity(64 * changes.len());
        list.push(b'[');
        let mut any = false;
        for c in changes {
            any |= c.write_json(&mut list, vtep, !any);
        }
        list.push(b']');
        if !any {
            return serde_json::to_vec(&self.state_with(Some(Vec::new()))).unwrap_or_default();
        }
        let stand_in = vec![OverlayChange {
            network: STAND_IN.to_string(),
            ..Default::default()
        }];
        let Ok(bytes) = serde_json::to_vec(&self.state_with(Some(stand_in))) else {
            return Vec::new();
        };
        // The delta is the state's last field, its overlays near its end.
        let at = memchr::memmem::rfind(&bytes, STAND_IN_JSON);
        let Some(at) = at.filter(|at| memchr::memmem::find(&bytes, STAND_IN_JSON) == Some(*at)) else {
            debug_assert!(false, "the stand-in overlay change is not found once");
            let overlays = Self::overlay_changes(changes, vtep);
            return serde_json::to_vec(&self.state_with(Some(overlays))).unwrap_or_default();
        };
        let mut out = Vec::with_capacity(bytes.len() + list.len());
        out.extend_from_slice(&bytes[..at]);
        out.extend_from_slice(&list);
        out.extend_from_slice(&bytes[at + STAND_IN_JSON.len()..]);
        out
    }

    /// [`Reply::state`] as JSON (a whole state written straight from its
    /// sections: [`desired::compose_json`]; a delta's entries likewise:
    /// [`Reply::delta_json`]).
    pub fn json(&self) -> Vec<u8> {
        match self {
            Reply::Full {
                version,
                digest,
                own,
                vtep,
                sections,
                ..
            } => desired::compose_json(own, *vtep, *version, Some(*digest), |i| {
                let (s, json) = sections.get(i)?.as_ref()?;
                Some((&**s, json.get(s)))
            }),
            Reply::Delta { vtep, changes, .. } => self.delta_json(*vtep, changes),
        }
    }
}

impl Change {
    /// Writes [`Change::overlay_change`] as JSON after a comma unless
    /// `first`, when it is not empty; whether it wrote. The entries come
    /// from JSON written once for every member: a whole section's
    /// ([`JsonCell`]) less the member's own entries, or the entries the
    /// revisions since added ([`SectionDiff::added_json`]: a member's usual
    /// share of a burst of creates, at 1,000 nodes nearly every section of
    /// every heartbeat), merged in order. A change that removed entries is
    /// folded and written entry by entry.
    fn write_json(&self, out: &mut Vec<u8>, vtep: Option<Ipv4Addr>, first: bool) -> bool {
        let mark = out.len();
        let begin = |out: &mut Vec<u8>, whole: bool| {
            if !first {
                out.push(b',');
            }
            out.extend_from_slice(br#"{"network":"#);
            // A name is validated (no escapes), but written as serde would anyway.
            if serde_json::to_writer(&mut *out, &self.network).is_err() {
                out.extend_from_slice(b"\"\"");
            }
            if whole {
                out.extend_from_slice(br#","whole":true"#);
            }
            out.len()
        };
        match &self.what {
            ChangeOf::Whole(s, cell) => {
                let j = cell.get(s);
                begin(out, true);
                j.fdb
                    .write_field_except(out, b"fdb_added", &json::fdb_skips(&s.fdb, vtep));
                let own = json::neighbor_skip(&s.neighbors, self.lease);
                j.neighbors.write_field_except(out, b"neighbors_added", &own);
                out.push(b'}');
                true
            }
            ChangeOf::Diffs(diffs) if diffs.iter().all(|d| d.only_adds()) => {
                let head = begin(out, false);
                let lists: Vec<_> = diffs
                    .iter()
                    .map(|d| (d.fdb_added.as_slice(), &d.added_json().fdb))
                    .collect();
                json::write_merged(out, b"fdb_added", &lists, |e| keep_fdb(e, vtep));
                let lists: Vec<_> = diffs
                    .iter()
                    .map(|d| (d.neighbors_added.as_slice(), &d.added_json().neighbors))
                    .collect();
                json::write_merged(out, b"neighbors_added", &lists, |e| keeps_neighbor(e, self.lease));
                if out.len() == head {
                    // Nothing of it is the member's to install.
                    out.truncate(mark);
                    return false;
                }
                out.push(b'}');
                true
            }
            ChangeOf::Diffs(_) => {
                let change = self.overlay_change(vtep);
                if change.is_empty() {
                    return false;
                }
                if !first {
                    out.push(b',');
                }
                desired::overlay_change_json(out, &change);
                true
            }
        }
    }

    fn overlay_change(&self, vtep: Option<Ipv4Addr>) -> OverlayChange {
        let mut out = OverlayChange {
            network: self.network.clone(),
            ..Default::default()
        };
        match &self.what {
            ChangeOf::Whole(s, _) => {
                (out.fdb_added, out.neighbors_added) = s.view_at(vtep, self.lease);
                out.whole = true;
            }
            // Only entries added since (a burst of creates, members
            // joining): their union, sorted as the fold below gives it,
            // without a map per answer.
            ChangeOf::Diffs(diffs)
                if diffs
                    .iter()
                    .all(|d| d.fdb_removed.is_empty() && d.neighbors_removed.is_empty()) =>
            {
                out.fdb_added = diffs
                    .iter()
                    .flat_map(|d| d.fdb_added.iter().copied())
                    .filter(|e| keep_fdb(e, vtep))
                    .collect();
                out.fdb_added.sort_unstable();
                out.fdb_added.dedup();
                out.neighbors_added = diffs
                    .iter()
                    .flat_map(|d| d.neighbors_added.iter().copied())
                    .filter(|e| keeps_neighbor(e, self.lease))
                    .collect();
                out.neighbors_added.sort_unstable();
                out.neighbors_added.dedup();
            }
            ChangeOf::Diffs(diffs) => {
                // Net of every revision: an entry added then removed is not sent.
                let mut fdb: BTreeMap<FdbEntry, bool> = BTreeMap::new();
                let mut nbs: BTreeMap<NeighborEntry, bool> = BTreeMap::new();
                for d in diffs {
                    net(&mut fdb, &d.fdb_added, &d.fdb_removed);
                    net(&mut nbs, &d.neighbors_added, &d.neighbors_removed);
                }
                for (e, added) in fdb.into_iter().filter(|(e, _)| keep_fdb(e, vtep)) {
                    if added {
                        out.fdb_added.push(e);
                    } else {
                        out.fdb_removed.push(e);
                    }
                }
                for (e, added) in nbs.into_iter().filter(|(e, _)| keeps_neighbor(e, self.lease)) {
                    if added {
                        out.neighbors_added.push(e);
                    } else {
                        out.neighbors_removed.push(e);
                    }
                }
            }
        }
        out
    }
}

/// Folds one revision's changes into the net change so far (`true`: added).
fn net<T: Ord + Copy>(acc: &mut BTreeMap<T, bool>, added: &[T], removed: &[T]) {
    for e in removed {
        if acc.remove(e) != Some(true) {
            acc.insert(*e, false);
        }
    }
    for e in added {
        if acc.remove(e) != Some(false) {
            acc.insert(*e, true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Bits hold what a set of numbers holds: inserts, removes and
        /// unions, listed lowest first.
        #[test]
        fn bits_are_a_set_of_numbers(
            ops in proptest::collection::vec((0u8..3, 0u32..300), 0..200),
            other in proptest::collection::btree_set(0u32..300, 0..50),
        ) {
            let mut bits = Bits::default();
            let mut set = BTreeSet::new();
            for (op, i) in ops {
                match op {
                    0 => { bits.insert(i); set.insert(i); }
                    1 => { bits.remove(i); set.remove(&i); }
                    _ => prop_assert_eq!(bits.contains(i), set.contains(&i)),
                }
            }
            let mut o = Bits::default();
            for &i in &other {
                o.insert(i);
            }
            bits.union_with(&o);
            set.extend(other);
            prop_assert_eq!(bits.iter().collect::<Vec<_>>(), set.iter().copied().collect::<Vec<_>>());
            for i in 0..300 {
                prop_assert_eq!(bits.contains(i), set.contains(&i));
            }
        }
    }

    #[test]
    fn a_node_keeps_its_number() {
        let mut ids = NodeIds::default();
        let a = ids.id("n1");
        let b = ids.id("n2");
        assert_ne!(a, b);
        assert_eq!(ids.id("n1"), a);
        assert_eq!(ids.get("n2"), Some(b));
        assert_eq!(ids.get("n3"), None);
        assert_eq!(ids.name(b), "n2");
    }
}
