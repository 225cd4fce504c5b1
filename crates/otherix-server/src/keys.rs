//! Session signing keys: Ed25519 keys the CP creates and rotates, signs
//! credentials with, and publishes (public halves) to gateways in heartbeat
//! answers — from a lead time before it first signs with one until every
//! credential signed by it is dead.
//!
//! Gateways learn keys only from heartbeat answers, so a key that signed the
//! moment it was made would have its first credentials refused `unknown_key`
//! until each gateway's next heartbeat. Instead a key is made [`publish_lead`]
//! before it takes over:
//!
//! ```text
//! key 1  made, signs ────────────────────────┬─ retired ─ ttl + skew ─┐ expires (not_after)
//! key 2          made, published ─── lead ───┴─ signs ──────────────────────── …
//!        (key 2 is made `rotation` after key 1; a brand-new cluster's first
//!         key signs at once: there is no gateway yet that could miss it)
//! ```
//!
//! Each key is published with its expiry once a newer key exists, and
//! gateways refuse its credentials after it on their own. An admin's
//! rotation ([`SessionKeys::rotate_now`]) makes a key that signs
//! [`ROTATE_LEAD`] after it is made, taking over from the current key (and
//! from a scheduled one not signing yet).
//!
//! Which key signs, which are published and when each expires is a pure
//! function of when each key was made and signs from, and `now`
//! ([`Schedule`]), so the whole timeline is unit-tested without sleeping.

use std::sync::{Arc, Mutex, RwLock};

use otherix_core::credential::{SigningKey, CLOCK_SKEW};
use otherix_proto::agent::SessionPublicKey;
use otherix_store::{SessionKeyRecord, Store, StoreError};
use time::{Duration, OffsetDateTime};

use crate::random;
use crate::secrets::SecretKey;

/// How long a new key is published before it signs: many heartbeats (every
/// 2 s by default, 10 s at most while the CP is unreachable) for every
/// gateway to learn it.
pub const PUBLISH_LEAD: Duration = Duration::seconds(60);

/// Keys stay in the store this long after their last credential died (they
/// are no longer published), in case a clock steps back.
const PRUNE_MARGIN: Duration = Duration::hours(1);

/// The lead for keys rotated every `rotation`: [`PUBLISH_LEAD`], or half the
/// rotation when that is shorter (test clusters rotating every few seconds),
/// so a key always signs longer than it waits.
pub fn publish_lead(rotation: Duration) -> Duration {
    PUBLISH_LEAD.min(rotation / 2).max(Duration::ZERO)
}

/// How soon a key made by `otherix keys rotate` signs: long enough for the
/// gateways the change wakes to fetch it (a round trip; a few heartbeats
/// for one that missed the wake), short enough that the admin waits for it.
pub const ROTATE_LEAD: Duration = Duration::seconds(5);

/// One stored key's times, as the [`Schedule`] reads them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Times {
    pub made: OffsetDateTime,
    /// When it signs from, as stored; `None` on keys stored before this was
    /// recorded (see [`Schedule::start`]).
    pub signs_from: Option<OffsetDateTime>,
}

/// Where a key is in its life at a given instant (`otherix keys list`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Published, signs from its start.
    Next,
    /// Signs what the broker mints now.
    Current,
    /// A newer key took over; credentials it signed may still be live.
    Previous,
    /// Past its expiry: no credential it signed is valid; withdrawn.
    Retired,
}

/// When keys are made, sign and are withdrawn. Pure: every method takes the
/// stored keys' [`Times`], oldest made first, and `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedule {
    /// A new key is made when the newest is this old.
    pub rotation: Duration,
    /// A key the schedule makes signs once it is this old (except a
    /// brand-new cluster's first).
    pub lead: Duration,
    /// How long after a key stops signing its credentials may still be
    /// accepted: credential TTL plus clock skew.
    pub live: Duration,
}

impl Schedule {
    /// Whether a new key must be made now: there is none, or the newest is
    /// `rotation` old (so it is published `lead` before the current one's
    /// rotation ends).
    pub fn due(&self, keys: &[Times], now: OffsetDateTime) -> bool {
        keys.last()
            .is_none_or(|newest| newest.made + self.rotation <= now)
    }

    /// When a new key made at `now` by the schedule signs from: at once in
    /// a brand-new cluster (no gateway can have missed it), else `lead` on.
    pub fn new_start(&self, keys: &[Times], now: OffsetDateTime) -> OffsetDateTime {
        if keys.is_empty() {
            now
        } else {
            now + self.lead
        }
    }

    /// When key `i` signs from: as stored, or — a key stored before that
    /// was recorded — the first at once and the others `lead` after made.
    pub fn start(&self, keys: &[Times], i: usize) -> OffsetDateTime {
        let k = keys[i];
        k.signs_from
            .unwrap_or(if i == 0 { k.made } else { k.made + self.lead })
    }

    /// The index of the key that signs at `now`: the newest made whose start
    /// has come. Newest made, not latest start: a key an admin rotated to
    /// takes over from one the schedule made just before it.
    pub fn signer(&self, keys: &[Times], now: OffsetDateTime) -> Option<usize> {
        let known = keys.partition_point(|k| k.made <= now);
        (0..known).rev().find(|&i| self.start(keys, i) <= now)
    }

    /// When key `i` stops signing: the earliest start of a newer key. `None`
    /// while none is made.
    pub fn stops(&self, keys: &[Times], i: usize) -> Option<OffsetDateTime> {
        (i + 1..keys.len()).map(|j| self.start(keys, j)).min()
    }

    /// After when no credential key `i` signed can be valid: it stopped,
    /// then a credential's life and the clock skew passed. `None` while no
    /// newer key is made. Gateways refuse its credentials from then on.
    pub fn not_after(&self, keys: &[Times], i: usize) -> Option<OffsetDateTime> {
        self.stops(keys, i).map(|stop| stop + self.live)
    }

    /// Whether key `i` is published at `now`: it exists and is not past its
    /// expiry — so it covers both the keys that will sign soon and every key
    /// that may still have live credentials.
    pub fn published(&self, keys: &[Times], i: usize, now: OffsetDateTime) -> bool {
        keys[i].made <= now && self.not_after(keys, i).is_none_or(|t| now < t)
    }

    /// Key `i`'s phase at `now`.
    pub fn phase(&self, keys: &[Times], i: usize, now: OffsetDateTime) -> Phase {
        if self.signer(keys, now) == Some(i) {
            Phase::Current
        } else if self.not_after(keys, i).is_some_and(|t| t <= now) {
            Phase::Retired
        } else if self.start(keys, i) > now && self.stops(keys, i).is_none_or(|s| s > self.start(keys, i)) {
            Phase::Next
        } else {
            Phase::Previous
        }
    }

    /// Keys made before the returned time can be deleted: past their expiry
    /// for [`PRUNE_MARGIN`] already. `None`: keep them all.
    pub fn prune_before(&self, keys: &[Times], now: OffsetDateTime) -> Option<OffsetDateTime> {
        let keep =
            (0..keys.len()).find(|&i| self.not_after(keys, i).is_none_or(|t| t + PRUNE_MARGIN > now))?;
        (keep > 0).then(|| keys[keep].made)
    }
}

/// The stored keys as last loaded, oldest first.
#[derive(Debug, Default)]
struct Loaded {
    times: Vec<Times>,
    keys: Vec<Arc<SigningKey>>,
}

/// One stored key as `otherix keys list` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyStatus {
    pub kid: String,
    pub made: OffsetDateTime,
    pub signs_from: OffsetDateTime,
    pub phase: Phase,
    pub not_after: Option<OffsetDateTime>,
}

#[derive(Debug)]
pub struct SessionKeys {
    store: Store,
    /// Seals seeds before they are stored, when the control plane was
    /// given a secret key (always, on PostgreSQL).
    sealer: Option<Arc<SecretKey>>,
    schedule: Schedule,
    /// Credential lifetime.
    ttl: Duration,
    loaded: RwLock<Loaded>,
    /// The kid that signed at the last `rotate_if_due`, to log hand-overs.
    last_signer: Mutex<Option<String>>,
}

impl SessionKeys {
    /// Keys rotated every `rotation`, each published [`publish_lead`] before
    /// it signs, signing credentials that live `ttl`.
    /// With `sealer`, seeds are stored sealed (see [`crate::secrets`]).
    pub fn new(
        store: Store,
        sealer: Option<Arc<SecretKey>>,
        rotation: Duration,
        ttl: Duration,
    ) -> SessionKeys {
        SessionKeys {
            store,
            sealer,
            schedule: Schedule {
                rotation,
                lead: publish_lead(rotation),
                live: ttl + CLOCK_SKEW,
            },
            ttl,
            loaded: RwLock::new(Loaded::default()),
            last_signer: Mutex::new(None),
        }
    }

    /// Makes a key if one is due, deletes keys long expired, and loads the
    /// rest for signing. Idempotent; called at start, periodically, and
    /// whenever the change log says the keys changed.
    pub async fn rotate_if_due(&self, now: OffsetDateTime) -> Result<(), StoreError> {
        let mut records = self.all_keys().await?;
        let times = times_of(&records);
        if self.schedule.due(&times, now) {
            let signs_from = self.schedule.new_start(&times, now);
            let (record, seed) = new_key(now, signs_from, self.sealer.as_deref())?;
            // Only if no other replica made one meanwhile: its rotation came
            // due at the same moment, and one new key is enough.
            if self
                .store
                .add_session_key_if_due(&record, now - self.schedule.rotation)
                .await?
            {
                tracing::info!(kid = %record.kid, %signs_from, "session signing key made and published");
                records.push(SessionKeyRecord {
                    seed: seed.to_vec(),
                    ..record
                });
            } else {
                records = self.all_keys().await?;
            }
        }
        self.load(records, now).await
    }

    /// Makes a key at once (`otherix keys rotate`): published now — the
    /// change log carries it to every replica, which wakes its gateways —
    /// and signing [`ROTATE_LEAD`] later (or the schedule's lead, when that
    /// is shorter), from when the key that signed before stops signing and
    /// is retired its credentials' life later. Returns the new key's status.
    pub async fn rotate_now(&self, now: OffsetDateTime) -> Result<KeyStatus, StoreError> {
        let signs_from = now + ROTATE_LEAD.min(self.schedule.lead);
        let (record, _) = new_key(now, signs_from, self.sealer.as_deref())?;
        self.store.add_session_key(&record).await?;
        tracing::info!(kid = %record.kid, %signs_from, "session signing key rotated by request");
        let kid = record.kid.clone();
        let records = self.all_keys().await?;
        self.load(records, now).await?;
        self.status(now)
            .into_iter()
            .find(|k| k.kid == kid)
            .ok_or_else(|| StoreError::Corrupt(format!("session key {kid} vanished after it was stored")))
    }

    /// Every stored key's status at `now`, as last loaded, newest first.
    pub fn status(&self, now: OffsetDateTime) -> Vec<KeyStatus> {
        let Ok(loaded) = self.loaded.read() else {
            return Vec::new();
        };
        let t = &loaded.times;
        let mut out: Vec<KeyStatus> = loaded
            .keys
            .iter()
            .enumerate()
            .map(|(i, k)| KeyStatus {
                kid: k.kid().to_string(),
                made: t[i].made,
                signs_from: self.schedule.start(t, i),
                phase: self.schedule.phase(t, i, now),
                not_after: self.schedule.not_after(t, i),
            })
            .collect();
        out.reverse();
        out
    }

    /// Deletes keys long expired and loads `records` (every stored key,
    /// oldest first) for signing.
    async fn load(&self, mut records: Vec<SessionKeyRecord>, now: OffsetDateTime) -> Result<(), StoreError> {
        let times = times_of(&records);
        if let Some(before) = self.schedule.prune_before(&times, now) {
            self.store.prune_session_keys(before).await?;
            records.retain(|r| r.created_at >= before);
        }
        let mut loaded = Loaded::default();
        for r in &records {
            let seed = self.seed(r)?;
            let key =
                SigningKey::from_seed(r.kid.clone(), seed).map_err(|e| StoreError::Corrupt(e.to_string()))?;
            loaded.times.push(Times {
                made: r.created_at,
                signs_from: r.signs_from,
            });
            loaded.keys.push(Arc::new(key));
        }
        let signer = self
            .schedule
            .signer(&loaded.times, now)
            .map(|i| loaded.keys[i].kid().to_string());
        if let Ok(mut cur) = self.loaded.write() {
            *cur = loaded;
        }
        if let Ok(mut last) = self.last_signer.lock() {
            if *last != signer {
                if let Some(kid) = &signer {
                    tracing::info!(%kid, "signing credentials with session key");
                }
                *last = signer;
            }
        }
        Ok(())
    }

    /// The key to sign with at `now`.
    pub fn current(&self, now: OffsetDateTime) -> Option<Arc<SigningKey>> {
        let loaded = self.loaded.read().ok()?;
        let i = self.schedule.signer(&loaded.times, now)?;
        loaded.keys.get(i).cloned()
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Public halves of every key that will sign soon or may still have live
    /// credentials, newest first, each with its expiry once it has one.
    pub async fn published(&self, now: OffsetDateTime) -> Result<Vec<SessionPublicKey>, StoreError> {
        let records = self.all_keys().await?;
        let times = times_of(&records);
        let mut published: Vec<SessionPublicKey> = records
            .into_iter()
            .enumerate()
            .filter(|(i, _)| self.schedule.published(&times, *i, now))
            .map(|(i, r)| SessionPublicKey {
                kid: r.kid,
                public: hex::encode(r.public),
                not_after: self.schedule.not_after(&times, i),
            })
            .collect();
        published.reverse();
        Ok(published)
    }

    /// [`SessionKeys::published`] from the keys as last loaded: no store
    /// read (the catalog calls it for every desired state it computes).
    pub fn published_loaded(&self, now: OffsetDateTime) -> Vec<SessionPublicKey> {
        let Ok(loaded) = self.loaded.read() else {
            return Vec::new();
        };
        let mut published: Vec<SessionPublicKey> = loaded
            .keys
            .iter()
            .enumerate()
            .filter(|(i, _)| self.schedule.published(&loaded.times, *i, now))
            .map(|(i, k)| SessionPublicKey {
                kid: k.kid().to_string(),
                public: hex::encode(k.public_key()),
                not_after: self.schedule.not_after(&loaded.times, i),
            })
            .collect();
        published.reverse();
        published
    }

    /// The keys of [`SessionKeys::published_loaded`], ready to verify with.
    pub fn verifying(&self, now: OffsetDateTime) -> otherix_core::credential::KeySet {
        let mut keys = otherix_core::credential::KeySet::new();
        for k in self.published_loaded(now) {
            if let Ok(bytes) = hex::decode(&k.public) {
                // A key that does not decode verifies nothing: left out.
                let _ = keys.insert_until(k.kid, &bytes, k.not_after);
            }
        }
        keys
    }

    /// Rotates in the background until the process ends.
    pub fn spawn_rotation(self: Arc<Self>) {
        let every: Duration =
            (self.schedule.rotation / 10_i32).clamp(Duration::seconds(1), Duration::seconds(60));
        let every = std::time::Duration::try_from(every).unwrap_or(std::time::Duration::from_secs(60));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = self.rotate_if_due(OffsetDateTime::now_utc()).await {
                    tracing::error!(error = %e, "session key rotation failed");
                }
            }
        });
    }

    /// Every stored key, oldest first (pruning keeps them few).
    async fn all_keys(&self) -> Result<Vec<SessionKeyRecord>, StoreError> {
        let mut records = self.store.session_keys_since(OffsetDateTime::UNIX_EPOCH).await?;
        records.reverse();
        Ok(records)
    }
}

fn times_of(records: &[SessionKeyRecord]) -> Vec<Times> {
    records
        .iter()
        .map(|r| Times {
            made: r.created_at,
            signs_from: r.signs_from,
        })
        .collect()
}

/// A fresh key, made at `now`.
impl SessionKeys {
    /// A stored key's seed: opened when it was sealed, as is when it was
    /// stored plain (SQLite without a secret key, or from before sealing).
    fn seed(&self, r: &SessionKeyRecord) -> Result<[u8; 32], StoreError> {
        if let Ok(plain) = <[u8; 32]>::try_from(r.seed.as_slice()) {
            return Ok(plain);
        }
        let Some(sealer) = &self.sealer else {
            return Err(StoreError::Corrupt(format!(
                "session key {} is sealed, and this control plane has no secret key (--secret-key-file)",
                r.kid
            )));
        };
        let opened = sealer
            .open(&seed_name(&r.kid), &r.seed)
            .map_err(|e| StoreError::Corrupt(e.to_string()))?;
        opened
            .as_slice()
            .try_into()
            .map_err(|_| StoreError::Corrupt(format!("session key {} has a bad seed", r.kid)))
    }
}

/// The name a seed is sealed under: binds it to its key's row.
fn seed_name(kid: &str) -> String {
    format!("session_key:{kid}")
}

/// A new key made at `now` and signing from `signs_from`, as it is stored
/// (its seed sealed, with a sealer), and its seed.
fn new_key(
    now: OffsetDateTime,
    signs_from: OffsetDateTime,
    sealer: Option<&SecretKey>,
) -> Result<(SessionKeyRecord, [u8; 32]), StoreError> {
    let seed = random::bytes::<32>();
    let kid = random::short_id();
    let key = SigningKey::from_seed(kid.clone(), seed).map_err(|e| StoreError::Invalid(e.to_string()))?;
    let stored = match sealer {
        Some(sealer) => sealer.seal(&seed_name(&kid), &seed),
        None => seed.to_vec(),
    };
    Ok((
        SessionKeyRecord {
            kid,
            seed: stored,
            public: key.public_key().to_vec(),
            created_at: now,
            signs_from: Some(signs_from),
        },
        seed,
    ))
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    const ROTATION: Duration = Duration::hours(1);
    const TTL: Duration = Duration::minutes(5);
    const STEP: Duration = Duration::seconds(10);

    fn t0() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    async fn keys() -> SessionKeys {
        SessionKeys::new(Store::open_in_memory().await.unwrap(), None, ROTATION, TTL)
    }

    async fn published(keys: &SessionKeys, now: OffsetDateTime) -> BTreeSet<String> {
        keys.published(now)
            .await
            .unwrap()
            .into_iter()
            .map(|k| k.kid)
            .collect()
    }

    /// What the CP would do and show over `hours`, rotating every STEP:
    /// for each instant, the signing kid and the published kids.
    async fn run(
        keys: &SessionKeys,
        from: OffsetDateTime,
        hours: i64,
    ) -> BTreeMap<OffsetDateTime, (String, BTreeSet<String>)> {
        let mut seen = BTreeMap::new();
        let mut t = from;
        while t <= from + Duration::hours(hours) {
            keys.rotate_if_due(t).await.unwrap();
            let signer = keys.current(t).unwrap().kid().to_string();
            seen.insert(t, (signer, published(keys, t).await));
            t += STEP;
        }
        seen
    }

    #[test]
    fn the_lead_is_a_minute_or_half_a_short_rotation() {
        assert_eq!(publish_lead(Duration::hours(1)), Duration::seconds(60));
        assert_eq!(publish_lead(Duration::seconds(10)), Duration::seconds(5));
        assert_eq!(publish_lead(Duration::ZERO), Duration::ZERO);
    }

    #[tokio::test]
    async fn replicas_rotating_at_the_same_moment_make_one_key_and_sign_with_it() {
        let store = Store::open_in_memory().await.unwrap();
        let sealer = Arc::new(SecretKey::generate());
        let a = SessionKeys::new(store.clone(), Some(sealer.clone()), ROTATION, TTL);
        let b = SessionKeys::new(store.clone(), Some(sealer), ROTATION, TTL);
        let t = t0();
        a.rotate_if_due(t).await.unwrap();
        b.rotate_if_due(t).await.unwrap();
        assert_eq!(
            store
                .session_keys_since(OffsetDateTime::UNIX_EPOCH)
                .await
                .unwrap()
                .len(),
            1
        );
        // An hour on, both find the rotation due; one key more, not two.
        let later = t + ROTATION;
        a.rotate_if_due(later).await.unwrap();
        b.rotate_if_due(later).await.unwrap();
        assert_eq!(
            store
                .session_keys_since(OffsetDateTime::UNIX_EPOCH)
                .await
                .unwrap()
                .len(),
            2
        );
        let after_lead = later + publish_lead(ROTATION);
        a.rotate_if_due(after_lead).await.unwrap();
        b.rotate_if_due(after_lead).await.unwrap();
        assert_eq!(
            a.current(after_lead).unwrap().kid(),
            b.current(after_lead).unwrap().kid()
        );
    }

    #[tokio::test]
    async fn seeds_are_stored_sealed_and_open_only_with_the_secret_key() {
        let store = Store::open_in_memory().await.unwrap();
        let sealer = Arc::new(SecretKey::generate());
        let keys = SessionKeys::new(store.clone(), Some(sealer.clone()), ROTATION, TTL);
        keys.rotate_if_due(t0()).await.unwrap();
        let stored = &store
            .session_keys_since(OffsetDateTime::UNIX_EPOCH)
            .await
            .unwrap()[0];
        assert_ne!(stored.seed.len(), 32, "not the plain seed");
        let signer = keys.current(t0()).unwrap();
        // Another replica with the same secret key signs as this one would.
        let same = SessionKeys::new(store.clone(), Some(sealer), ROTATION, TTL);
        same.rotate_if_due(t0()).await.unwrap();
        assert_eq!(same.current(t0()).unwrap().public_key(), signer.public_key());
        // Without it, or with another key, the seed does not open.
        let none = SessionKeys::new(store.clone(), None, ROTATION, TTL);
        assert!(none.rotate_if_due(t0()).await.is_err());
        let other = SessionKeys::new(store, Some(Arc::new(SecretKey::generate())), ROTATION, TTL);
        assert!(other.rotate_if_due(t0()).await.is_err());
    }

    #[tokio::test]
    async fn a_fresh_cluster_signs_at_once_with_its_first_key() {
        let keys = keys().await;
        assert!(keys.current(t0()).is_none(), "nothing loaded yet");
        keys.rotate_if_due(t0()).await.unwrap();
        let first = keys.current(t0()).expect("signs at once").kid().to_string();
        assert_eq!(published(&keys, t0()).await, BTreeSet::from([first.clone()]));
        keys.rotate_if_due(t0() + Duration::minutes(30)).await.unwrap();
        assert_eq!(
            keys.current(t0() + Duration::minutes(30)).unwrap().kid(),
            first,
            "not due yet"
        );
    }

    #[tokio::test]
    async fn a_signing_key_was_published_a_lead_time_before_it_signed() {
        let keys = keys().await;
        let lead = keys.schedule.lead;
        assert_eq!(lead, PUBLISH_LEAD);
        let seen = run(&keys, t0(), 4).await;
        let signers: BTreeSet<&String> = seen.values().map(|(s, _)| s).collect();
        assert!(signers.len() >= 4, "rotated hourly: {signers:?}");
        let first = &seen[&t0()].0;
        for (t, (signer, _)) in &seen {
            if *t - lead < t0() {
                assert_eq!(signer, first, "the first key signs from the start");
                continue;
            }
            let (_, earlier) = &seen[&(*t - lead)];
            assert!(
                earlier.contains(signer),
                "at {t}, {signer} signs but was not published {lead} earlier: {earlier:?}"
            );
        }
    }

    #[tokio::test]
    async fn rotation_keeps_the_previous_key_published_until_its_credentials_die() {
        let keys = keys().await;
        let live = TTL + CLOCK_SKEW;
        let seen = run(&keys, t0(), 4).await;
        // The last instant each key signed.
        let mut last_signed: BTreeMap<&String, OffsetDateTime> = BTreeMap::new();
        for (t, (signer, published)) in &seen {
            last_signed.insert(signer, *t);
            for (kid, last) in &last_signed {
                // A credential signed at `last` is accepted until last + ttl + skew.
                if *t < *last + live {
                    assert!(
                        published.contains(*kid),
                        "at {t}, {kid} signed at {last} but is withdrawn: {published:?}"
                    );
                }
            }
            assert!(
                published.len() <= 3,
                "no more than pending, current and retired: {published:?}"
            );
        }
        let first = &seen[&t0()].0;
        let end = t0() + Duration::hours(4);
        assert!(
            !seen[&end].1.contains(first),
            "a key whose credentials are all dead is withdrawn"
        );
        let stored = keys.all_keys().await.unwrap();
        assert!(
            stored.iter().all(|r| &r.kid != first),
            "and deleted an hour later"
        );
    }

    #[tokio::test]
    async fn after_a_long_outage_the_old_key_signs_until_the_new_one_is_published() {
        let keys = keys().await;
        keys.rotate_if_due(t0()).await.unwrap();
        let old = keys.current(t0()).unwrap().kid().to_string();
        // The CP was down for a day: gateways still trust only `old`.
        let back = t0() + Duration::days(1);
        keys.rotate_if_due(back).await.unwrap();
        assert_eq!(
            keys.current(back).unwrap().kid(),
            old,
            "gateways do not know the new key yet"
        );
        let both = published(&keys, back).await;
        assert_eq!(both.len(), 2, "the new key is published: {both:?}");
        assert!(both.contains(&old));
        let later = back + keys.schedule.lead;
        keys.rotate_if_due(later).await.unwrap();
        assert_ne!(keys.current(later).unwrap().kid(), old, "the new key takes over");
        assert!(
            published(&keys, later).await.contains(&old),
            "old credentials still live"
        );
    }

    #[test]
    fn the_schedule_alone() {
        let s = Schedule {
            rotation: Duration::hours(1),
            lead: Duration::minutes(1),
            live: Duration::minutes(5),
        };
        let m = |mins: i64| t0() + Duration::minutes(mins);
        // Keys stored before their start was recorded: computed.
        let legacy = |mins: i64| Times {
            made: m(mins),
            signs_from: None,
        };
        let made = [legacy(0), legacy(60), legacy(120)];
        assert_eq!(s.signer(&made, m(0)), Some(0));
        assert_eq!(s.signer(&made, m(60)), Some(0), "key 2 is not a lead old yet");
        assert_eq!(s.signer(&made, m(61)), Some(1));
        assert_eq!(s.signer(&made, m(121)), Some(2));
        assert_eq!(s.signer(&[], m(0)), None);
        assert!(s.published(&made, 0, m(65)), "until key 2 signed for ttl + skew");
        assert!(!s.published(&made, 0, m(66)));
        assert_eq!(s.not_after(&made, 0), Some(m(66)));
        assert_eq!(s.not_after(&made, 2), None, "still signing: no expiry yet");
        assert!(!s.published(&made, 2, m(119)), "not made yet");
        assert!(s.due(&made, m(180)));
        assert!(!s.due(&made, m(179)));
        assert_eq!(
            s.prune_before(&made, m(125)),
            None,
            "key 1 expired less than an hour ago"
        );
        assert_eq!(s.prune_before(&made, m(127)), Some(m(60)));
    }

    #[test]
    fn a_key_goes_from_next_to_current_to_previous_to_retired() {
        let s = Schedule {
            rotation: Duration::hours(1),
            lead: Duration::minutes(1),
            live: Duration::minutes(5),
        };
        let m = |mins: i64| t0() + Duration::minutes(mins);
        let keys = [
            Times {
                made: m(0),
                signs_from: Some(m(0)),
            },
            Times {
                made: m(60),
                signs_from: Some(m(61)),
            },
        ];
        assert_eq!(s.phase(&keys, 0, m(60)), Phase::Current);
        assert_eq!(s.phase(&keys, 1, m(60)), Phase::Next);
        assert_eq!(s.phase(&keys, 0, m(61)), Phase::Previous);
        assert_eq!(s.phase(&keys, 1, m(61)), Phase::Current);
        assert_eq!(s.not_after(&keys, 0), Some(m(66)), "stopped at 61, + ttl + skew");
        assert_eq!(s.phase(&keys, 0, m(65)), Phase::Previous);
        assert_eq!(s.phase(&keys, 0, m(66)), Phase::Retired);
        assert!(!s.published(&keys, 0, m(66)));
    }

    #[test]
    fn a_key_rotated_to_takes_over_from_one_the_schedule_made_just_before() {
        let s = Schedule {
            rotation: Duration::hours(1),
            lead: Duration::minutes(1),
            live: Duration::minutes(5),
        };
        let at = |secs: i64| t0() + Duration::seconds(secs);
        // Key 1 due at 3600 signs from 3660; an admin rotates at 3610, the
        // new key signing from 3615.
        let keys = [
            Times {
                made: at(0),
                signs_from: Some(at(0)),
            },
            Times {
                made: at(3600),
                signs_from: Some(at(3660)),
            },
            Times {
                made: at(3610),
                signs_from: Some(at(3615)),
            },
        ];
        assert_eq!(s.signer(&keys, at(3614)), Some(0));
        assert_eq!(s.signer(&keys, at(3615)), Some(2));
        assert_eq!(
            s.signer(&keys, at(3700)),
            Some(2),
            "the scheduled key never signs"
        );
        assert_eq!(s.stops(&keys, 0), Some(at(3615)));
        assert_eq!(s.not_after(&keys, 0), Some(at(3615 + 300)));
        assert_eq!(s.not_after(&keys, 1), Some(at(3615 + 300)));
        assert_eq!(
            s.phase(&keys, 1, at(3612)),
            Phase::Previous,
            "superseded before it signed"
        );
        assert!(
            !s.due(&keys, at(3610 + 3599)),
            "the next rotation counts from the newest"
        );
        assert!(s.due(&keys, at(3610 + 3600)));
    }

    #[tokio::test]
    async fn rotating_on_request_signs_within_seconds_and_retires_the_old_key_a_credential_life_later() {
        let keys = keys().await;
        keys.rotate_if_due(t0()).await.unwrap();
        let old = keys.current(t0()).unwrap().kid().to_string();
        let t = t0() + Duration::minutes(10);
        let new = keys.rotate_now(t).await.unwrap();
        assert_ne!(new.kid, old);
        assert_eq!(new.phase, Phase::Next);
        assert_eq!(new.signs_from, t + ROTATE_LEAD);
        assert_eq!(new.not_after, None);
        // Published at once, the old key with its expiry.
        let both = keys.published(t).await.unwrap();
        assert_eq!(both.len(), 2, "{both:?}");
        assert_eq!(both[0].kid, new.kid, "newest first");
        assert_eq!(both[0].not_after, None);
        let expires = t + ROTATE_LEAD + TTL + CLOCK_SKEW;
        assert_eq!(both[1].kid, old);
        assert_eq!(both[1].not_after, Some(expires));
        assert_eq!(keys.published_loaded(t), both, "the catalog's copy says the same");
        // The old key signs until the new one's start, then the new one does.
        assert_eq!(keys.current(t + ROTATE_LEAD - STEP / 10).unwrap().kid(), old);
        assert_eq!(keys.current(t + ROTATE_LEAD).unwrap().kid(), new.kid);
        let listed = keys.status(t + ROTATE_LEAD);
        assert_eq!(
            listed
                .iter()
                .map(|k| (k.kid.as_str(), k.phase))
                .collect::<Vec<_>>(),
            [
                (new.kid.as_str(), Phase::Current),
                (old.as_str(), Phase::Previous)
            ]
        );
        // Withdrawn once its last credential is dead, and listed retired.
        assert!(published(&keys, expires - Duration::seconds(1))
            .await
            .contains(&old));
        assert!(!published(&keys, expires).await.contains(&old));
        assert_eq!(keys.status(expires)[1].phase, Phase::Retired);
        // The schedule's next rotation counts from the key rotated to.
        keys.rotate_if_due(t + ROTATION - STEP).await.unwrap();
        assert_eq!(keys.status(t + ROTATION - STEP).len(), 2, "none due yet");
        keys.rotate_if_due(t + ROTATION).await.unwrap();
        assert_eq!(keys.status(t + ROTATION).len(), 3);
    }
}
