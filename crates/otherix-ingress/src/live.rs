//! Sessions open now, by credential: what revocations end and what the
//! per-principal session limit counts. The gateway and the control plane's
//! relay each keep one.
//!
//! A session registers after its credential is verified and before the
//! guest is dialed. Registration and [`Live::set_revocations`] take the same
//! lock, and the revocations are replaced before the sessions are scanned,
//! so a session is either refused at registration or found by the scan:
//! none slips between the two.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use otherix_core::credential::Claims;
use tokio::sync::oneshot;

use otherix_proto::agent::Revocation;

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

/// The registry.
#[derive(Debug, Default)]
pub struct Live {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// By `jti`.
    sessions: HashMap<String, Session>,
    /// Open sessions per principal.
    per_principal: HashMap<String, usize>,
    revocations: Arc<Vec<Revocation>>,
}

#[derive(Debug)]
struct Session {
    claims: Claims,
    /// Taken (and fired) once, when a revocation covers the session.
    revoke: Option<oneshot::Sender<()>>,
}

/// A registered session; leaving the registry when dropped.
#[derive(Debug)]
pub struct Registration {
    live: Arc<Live>,
    jti: String,
    principal: String,
    /// Completes when a revocation covers the session.
    pub revoked: oneshot::Receiver<()>,
}

impl Live {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update below leaves the maps consistent before it can panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers the session of `claims`, unless a revocation covers them or
    /// the principal already has `limit` sessions open.
    pub fn register(self: &Arc<Self>, claims: &Claims, limit: usize) -> Result<Registration, NotAdmitted> {
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
        if inner.sessions.contains_key(&claims.jti) {
            // Single use is the replay cache's to enforce; a second
            // registration of one jti is a replay all the same.
            return Err(NotAdmitted::Duplicate);
        }
        let (tx, rx) = oneshot::channel();
        inner.sessions.insert(
            claims.jti.clone(),
            Session {
                claims: claims.clone(),
                revoke: Some(tx),
            },
        );
        *inner.per_principal.entry(claims.sub.clone()).or_default() += 1;
        Ok(Registration {
            live: Arc::clone(self),
            jti: claims.jti.clone(),
            principal: claims.sub.clone(),
            revoked: rx,
        })
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
        if s.revoke.is_some() && revocations.iter().any(|r| r.covers(&s.claims)) {
            if let Some(tx) = s.revoke.take() {
                let _ = tx.send(());
                ended += 1;
            }
        }
    }
    ended
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut inner = self.live.lock();
        inner.sessions.remove(&self.jti);
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
            before: OffsetDateTime::now_utc(),
        }
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
