//! Sessions open now, by credential: what revocations end and what the
//! per-principal session limit counts. The gateway and the control plane's
//! relay each keep one.
//!
//! A session registers after its credential is verified and before the
//! guest is dialed. Registration and [`Live::set_revocations`] take the same
//! lock, and the revocations are replaced before the sessions are scanned,
//! so a session is either refused at registration or found by the scan:
//! none slips between the two.
//!
//! Each session also has a [`Meter`]: its byte counts so far, which the
//! holder reports while it is open ([`Live::moved_bytes`]) — the sessions
//! that moved since their last report, the longest unreported first.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};

use otherix_core::credential::Claims;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::oneshot;

use otherix_proto::agent::{Revocation, SessionBytes};

/// Why a session may not register.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotAdmitted {
    /// A revocation covers its credential.
    #[error("access was revoked after this credential was issued")]
    Revoked,
    /// Its principal already has `limit` sessions open here.
    #[error("{principal} has {limit} sessions open here, its most; close some and retry")]
    AtLimit { principal: String, limit: usize },
    /// A session of this credential is open already (a replay).
    #[error("credential was already used")]
    Duplicate,
}

/// Why a revocation ends a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Access was taken away (a grant, token, user or rule).
    Revoked,
    /// An admin ended this one session (an entry naming it alone).
    EndedByAdmin,
}

/// The registry.
#[derive(Debug, Default)]
pub struct Live {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// By registration key (the `jti`, unless registered under another).
    sessions: HashMap<String, Session>,
    /// Open sessions per principal.
    per_principal: HashMap<String, usize>,
    revocations: Arc<Vec<Revocation>>,
    /// Counts byte reports taken, so the longest unreported go first.
    reports: u64,
}

#[derive(Debug)]
struct Session {
    claims: Claims,
    /// Taken (and fired) once, when a revocation covers the session.
    revoke: Option<oneshot::Sender<Ending>>,
    meter: Arc<Meter>,
    /// The counts last taken for a report, and when (`Inner::reports`).
    reported: (u64, u64),
    reported_at: u64,
}

/// A registered session; leaving the registry when dropped.
#[derive(Debug)]
pub struct Registration {
    live: Arc<Live>,
    key: String,
    principal: String,
    /// Completes when a revocation covers the session, saying why.
    pub revoked: oneshot::Receiver<Ending>,
    /// Count the session's bytes here: its holder reports them live.
    pub meter: Arc<Meter>,
}

/// A session's byte counts so far.
#[derive(Debug, Default)]
pub struct Meter {
    up: AtomicU64,
    down: AtomicU64,
}

impl Meter {
    /// Client → guest.
    pub fn up(&self, n: u64) {
        self.up.fetch_add(n, Ordering::Relaxed);
    }

    /// Guest → client.
    pub fn down(&self, n: u64) {
        self.down.fetch_add(n, Ordering::Relaxed);
    }

    /// (up, down) so far.
    pub fn totals(&self) -> (u64, u64) {
        (self.up.load(Ordering::Relaxed), self.down.load(Ordering::Relaxed))
    }
}

/// A client stream whose reads count as bytes up and writes as bytes down
/// on a [`Meter`] (two relaxed atomic adds per read or write).
pub struct Metered<'a, S> {
    inner: &'a mut S,
    meter: &'a Meter,
}

impl<'a, S> Metered<'a, S> {
    pub fn new(inner: &'a mut S, meter: &'a Meter) -> Self {
        Metered { inner, meter }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Metered<'_, S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let r = Pin::new(&mut *this.inner).poll_read(cx, buf);
        this.meter.up((buf.filled().len() - before) as u64);
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Metered<'_, S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = &r {
            this.meter.down(*n as u64);
        }
        r
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        let r = Pin::new(&mut *this.inner).poll_write_vectored(cx, bufs);
        if let Poll::Ready(Ok(n)) = &r {
            this.meter.down(*n as u64);
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.get_mut().inner).poll_shutdown(cx)
    }
}

/// Byte counts taken for a report, by registration key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    key: String,
    pub bytes: SessionBytes,
}

impl Live {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update below leaves the maps consistent before it can panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers the session of `claims`, unless a revocation covers them or
    /// the principal already has `limit` sessions open.
    pub fn register(self: &Arc<Self>, claims: &Claims, limit: usize) -> Result<Registration, NotAdmitted> {
        self.register_as(&claims.jti, claims, limit)
    }

    /// [`Live::register`] under `key` rather than the `jti`: a resumed
    /// relay session's new connection, while the one it replaces may still
    /// be registered. Revocations match the claims (the `jti` included) all
    /// the same.
    pub fn register_as(
        self: &Arc<Self>,
        key: &str,
        claims: &Claims,
        limit: usize,
    ) -> Result<Registration, NotAdmitted> {
        let mut inner = self.lock();
        if inner.revocations.iter().any(|r| r.covers(claims)) {
            return Err(NotAdmitted::Revoked);
        }
        let open = inner.per_principal.get(&claims.sub).copied().unwrap_or(0);
        if open >= limit {
            return Err(NotAdmitted::AtLimit {
                principal: claims.sub.clone(),
                limit,
            });
        }
        if inner.sessions.contains_key(key) {
            // Single use is the replay cache's to enforce; a second
            // registration of one jti is a replay all the same.
            return Err(NotAdmitted::Duplicate);
        }
        let (tx, rx) = oneshot::channel();
        let meter = Arc::new(Meter::default());
        inner.sessions.insert(
            key.to_owned(),
            Session {
                claims: claims.clone(),
                revoke: Some(tx),
                meter: meter.clone(),
                reported: (0, 0),
                reported_at: 0,
            },
        );
        *inner.per_principal.entry(claims.sub.clone()).or_default() += 1;
        Ok(Registration {
            live: Arc::clone(self),
            key: key.to_owned(),
            principal: claims.sub.clone(),
            revoked: rx,
            meter,
        })
    }

    /// The byte counts of at most `max` open sessions that moved since
    /// their last report, the longest unreported first, marked reported.
    /// Work: one pass over the sessions open here, none per byte.
    pub fn moved_bytes(&self, max: usize) -> Vec<Moved> {
        let mut inner = self.lock();
        let mut moved: Vec<(u64, &String, (u64, u64))> = inner
            .sessions
            .iter()
            .filter_map(|(key, s)| {
                let now = s.meter.totals();
                (now != s.reported).then_some((s.reported_at, key, now))
            })
            .collect();
        moved.sort_unstable();
        moved.truncate(max);
        let moved: Vec<(String, (u64, u64))> = moved.into_iter().map(|(_, k, n)| (k.clone(), n)).collect();
        inner.reports += 1;
        let at = inner.reports;
        let mut out = Vec::with_capacity(moved.len());
        for (key, (up, down)) in moved {
            if let Some(s) = inner.sessions.get_mut(&key) {
                s.reported = (up, down);
                s.reported_at = at;
                out.push(Moved {
                    bytes: SessionBytes {
                        session: s.claims.jti.clone(),
                        bytes_up: up,
                        bytes_down: down,
                    },
                    key,
                });
            }
        }
        out
    }

    /// [`Live::unreport`] for sessions registered under their `jti`.
    pub fn unreport_sessions(&self, bytes: &[SessionBytes]) {
        let moved: Vec<Moved> = bytes
            .iter()
            .map(|b| Moved {
                key: b.session.clone(),
                bytes: b.clone(),
            })
            .collect();
        self.unreport(&moved);
    }

    /// Reports taken with [`Live::moved_bytes`] that were not delivered:
    /// those sessions count as unreported again (unless a later report of
    /// theirs was taken meanwhile).
    pub fn unreport(&self, moved: &[Moved]) {
        let mut inner = self.lock();
        for m in moved {
            if let Some(s) = inner.sessions.get_mut(&m.key) {
                if s.reported == (m.bytes.bytes_up, m.bytes.bytes_down) {
                    s.reported = (u64::MAX, u64::MAX);
                    s.reported_at = 0;
                }
            }
        }
    }

    /// Replaces the revocations in force and ends every open session they
    /// cover. Returns how many sessions it ended.
    pub fn set_revocations(&self, revocations: Vec<Revocation>) -> usize {
        let mut inner = self.lock();
        if *inner.revocations == revocations {
            return 0;
        }
        inner.revocations = Arc::new(revocations);
        let revocations = inner.revocations.clone();
        end_in(&mut inner, &revocations)
    }

    /// The revocations in force.
    pub fn revocations(&self) -> Arc<Vec<Revocation>> {
        self.lock().revocations.clone()
    }

    /// Adds `revocations` to those in force, until the next
    /// [`Live::set_revocations`] replaces the list, and ends every open
    /// session they cover — under the one lock, as `set_revocations`: a
    /// session registering at the same moment is refused or ended. For a
    /// holder that learns of a revocation before its full list has caught
    /// up (the control plane that wrote it). Returns how many sessions it
    /// ended.
    pub fn add_revocations(&self, revocations: &[Revocation]) -> usize {
        let mut inner = self.lock();
        let added: Vec<Revocation> = revocations
            .iter()
            .filter(|r| !inner.revocations.contains(r))
            .cloned()
            .collect();
        if !added.is_empty() {
            let mut all = (*inner.revocations).clone();
            all.extend(added);
            inner.revocations = Arc::new(all);
        }
        end_in(&mut inner, revocations)
    }

    /// Sessions `principal` has open.
    pub fn open_for(&self, principal: &str) -> usize {
        self.lock().per_principal.get(principal).copied().unwrap_or(0)
    }

    /// Sessions open.
    pub fn open(&self) -> usize {
        self.lock().sessions.len()
    }
}

/// Fires the end of every session `revocations` cover (once each).
fn end_in(inner: &mut Inner, revocations: &[Revocation]) -> usize {
    let mut ended = 0;
    for s in inner.sessions.values_mut() {
        if s.revoke.is_none() {
            continue;
        }
        if let Some(why) = ending(revocations, &s.claims) {
            if let Some(tx) = s.revoke.take() {
                let _ = tx.send(why);
                ended += 1;
            }
        }
    }
    ended
}

/// Whether `revocations` end the session of `claims`, and why: an admin
/// ended it when only entries naming it alone cover it.
pub fn ending(revocations: &[Revocation], claims: &Claims) -> Option<Ending> {
    let mut covering = revocations.iter().filter(|r| r.covers(claims)).peekable();
    covering.peek()?;
    Some(if covering.all(Revocation::is_one_session) {
        Ending::EndedByAdmin
    } else {
        Ending::Revoked
    })
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut inner = self.live.lock();
        inner.sessions.remove(&self.key);
        if let Some(n) = inner.per_principal.get_mut(&self.principal) {
            *n -= 1;
            if *n == 0 {
                inner.per_principal.remove(&self.principal);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use time::{Duration, OffsetDateTime};

    use super::*;

    fn claims(jti: &str, sub: &str) -> Claims {
        let now = OffsetDateTime::now_utc() - Duration::seconds(1);
        Claims {
            iss: "c".into(),
            aud: "gw1".into(),
            sub: sub.into(),
            tok: None,
            jti: jti.into(),
            iat: now,
            nbf: now,
            exp: now + Duration::minutes(5),
            vm: "web01".into(),
            vm_id: "vm1".into(),
            net: "ov".into(),
            mac: None,
            ip: "10.0.0.2".into(),
            port: 22,
            until: None,
        }
    }

    fn revoke(principal: &str) -> Revocation {
        Revocation {
            principal: principal.into(),
            token: None,
            vm_id: None,
            port: None,
            session: None,
            before: OffsetDateTime::now_utc(),
        }
    }

    /// What an admin's "end session" writes: the session, and its target.
    fn end_one(principal: &str, jti: &str) -> Revocation {
        Revocation {
            vm_id: Some("vm1".into()),
            port: Some(22),
            session: Some(jti.into()),
            ..revoke(principal)
        }
    }

    #[test]
    fn ending_one_session_ends_only_it_saying_an_admin_did() {
        let live = Arc::new(Live::default());
        let mut one = live.register(&claims("j1", "user:alice"), 10).unwrap();
        let mut sibling = live.register(&claims("j2", "user:alice"), 10).unwrap();
        // A resumed connection registers under a key of its own; the
        // revocation still finds it by its credential.
        let mut resumed = live.register_as("j3.x", &claims("j3", "user:alice"), 10).unwrap();
        assert_eq!(
            live.set_revocations(vec![end_one("user:alice", "j1"), end_one("user:alice", "j3")]),
            2
        );
        assert_eq!(one.revoked.try_recv(), Ok(Ending::EndedByAdmin));
        assert_eq!(resumed.revoked.try_recv(), Ok(Ending::EndedByAdmin));
        assert!(sibling.revoked.try_recv().is_err(), "the other session goes on");
        // New credentials of the principal, to the same target, register.
        live.register(&claims("j4", "user:alice"), 10).unwrap();
        // A session covered by a whole revocation too was revoked.
        let both = [end_one("user:alice", "j2"), revoke("user:alice")];
        assert_eq!(ending(&both, &claims("j2", "user:alice")), Some(Ending::Revoked));
        assert_eq!(ending(&both[..1], &claims("j5", "user:alice")), None);
    }

    #[test]
    fn moved_bytes_are_those_that_moved_at_most_max_the_longest_unreported_first() {
        let live = Arc::new(Live::default());
        let regs: Vec<Registration> = (0..3)
            .map(|i| {
                live.register(&claims(&format!("j{i}"), "user:alice"), 10)
                    .unwrap()
            })
            .collect();
        assert!(live.moved_bytes(10).is_empty(), "nothing moved yet");
        for r in &regs {
            r.meter.up(10);
        }
        regs[0].meter.down(5);
        let first = live.moved_bytes(2);
        assert_eq!(first.len(), 2, "bounded");
        let second = live.moved_bytes(2);
        assert_eq!(
            second.len(),
            1,
            "the one left over, and only it: the others did not move"
        );
        let all: std::collections::BTreeSet<_> = first
            .iter()
            .chain(&second)
            .map(|m| m.bytes.session.clone())
            .collect();
        assert_eq!(all.len(), 3);
        let j0 = first
            .iter()
            .chain(&second)
            .find(|m| m.bytes.session == "j0")
            .unwrap();
        assert_eq!((j0.bytes.bytes_up, j0.bytes.bytes_down), (10, 5));
        assert!(live.moved_bytes(10).is_empty(), "reported, unchanged since");
        // Every session moves again: the one reported longest ago goes first.
        for r in &regs {
            r.meter.down(1);
        }
        let oldest = &first[0].bytes.session;
        assert_eq!(&live.moved_bytes(1)[0].bytes.session, oldest);
        // A report that was not delivered is taken again, once.
        let undelivered = live.moved_bytes(10);
        assert_eq!(undelivered.len(), 2);
        live.unreport(&undelivered);
        assert_eq!(live.moved_bytes(10).len(), 2);
        assert!(live.moved_bytes(10).is_empty());
        live.unreport_sessions(&[undelivered[0].bytes.clone()]);
        assert_eq!(live.moved_bytes(10), vec![undelivered[0].clone()]);
    }

    #[tokio::test]
    async fn a_metered_stream_counts_what_it_reads_as_up_and_writes_as_down() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut near, mut far) = tokio::io::duplex(64);
        let meter = Meter::default();
        far.write_all(b"hello").await.unwrap();
        let mut metered = Metered::new(&mut near, &meter);
        let mut buf = [0u8; 5];
        metered.read_exact(&mut buf).await.unwrap();
        metered.write_all(b"ok").await.unwrap();
        assert_eq!(meter.totals(), (5, 2));
    }

    #[test]
    fn a_revocation_ends_the_sessions_it_covers_and_refuses_their_like() {
        let live = Arc::new(Live::default());
        let mut a = live.register(&claims("j1", "grant:acme"), 10).unwrap();
        let mut b = live.register(&claims("j2", "user:alice"), 10).unwrap();
        assert_eq!(live.set_revocations(vec![revoke("grant:acme")]), 1);
        assert!(a.revoked.try_recv().is_ok(), "acme's session is told to end");
        assert!(b.revoked.try_recv().is_err(), "alice's is not");
        // The same list again ends nothing more.
        assert_eq!(live.set_revocations(vec![revoke("grant:acme")]), 0);
        let refused = live.register(&claims("j3", "grant:acme"), 10).unwrap_err();
        assert_eq!(refused, NotAdmitted::Revoked);
        drop(a);
        assert_eq!(live.open_for("grant:acme"), 0);
        assert_eq!(live.open_for("user:alice"), 1);
    }

    #[test]
    fn a_revocation_added_refuses_later_registrations_until_a_full_list_replaces_it() {
        let live = Arc::new(Live::default());
        let mut open = live.register(&claims("j1", "grant:acme"), 10).unwrap();
        let acme = revoke("grant:acme");
        assert_eq!(live.add_revocations(std::slice::from_ref(&acme)), 1);
        assert!(open.revoked.try_recv().is_ok(), "the open session is told to end");
        // Registering after it (a ticket checked before the revocation, say)
        // is refused: the list is kept, not only scanned.
        assert_eq!(
            live.register(&claims("j2", "grant:acme"), 10).unwrap_err(),
            NotAdmitted::Revoked
        );
        // Adding it again adds nothing; the full list, once it has it,
        // replaces the list.
        assert_eq!(live.add_revocations(&[acme]), 0);
        assert_eq!(live.revocations().len(), 1);
        live.set_revocations(vec![revoke("user:bob")]);
        assert_eq!(live.revocations().len(), 1);
        live.register(&claims("j3", "grant:acme"), 10).unwrap();
    }

    #[test]
    fn one_principal_at_its_limit_leaves_room_for_others() {
        let live = Arc::new(Live::default());
        let first = live.register(&claims("j1", "grant:flood"), 2).unwrap();
        let _second = live.register(&claims("j2", "grant:flood"), 2).unwrap();
        let refused = live.register(&claims("j3", "grant:flood"), 2).unwrap_err();
        assert_eq!(
            refused,
            NotAdmitted::AtLimit {
                principal: "grant:flood".into(),
                limit: 2
            }
        );
        let _other = live.register(&claims("j4", "user:alice"), 2).unwrap();
        drop(first);
        live.register(&claims("j3", "grant:flood"), 2).unwrap();
    }
}
