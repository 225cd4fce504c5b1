//! Connections to nodes' relay endpoints made ready ahead of the next
//! relay session: mutual TLS done, no request sent. A relay session's setup
//! is otherwise mostly this handshake (the control plane's and the agent's
//! signatures, the chain checks); with one ready, a session to a node that
//! had one a moment ago costs its request line and the agent's dial.
//!
//! Pure bookkeeping, time passed in; `relay.rs` makes and uses the
//! connections. At most one is kept per node, only for a node a session
//! went to within its keep (`--relay-ready-keep`, default [`KEEP`]), so an idle relay holds none and the set grows
//! with the nodes in use, not with the cluster. A connection is kept with
//! the address it was made to and the fingerprint of the certificate the
//! node presented, which are checked again when it is taken (a node whose
//! endpoint moved, or whose certificate was revoked meanwhile, gets a new
//! one).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How long a ready connection is kept unused. The agent closes one whose
/// request has not come within its request timeout (10 s by default).
pub const KEEP: Duration = Duration::from_secs(5);
/// The longest keep `--relay-ready-keep` takes: below the agent's request
/// timeout, so a ready connection is dropped before the agent closes it.
pub const MAX_KEEP: Duration = Duration::from_secs(9);

/// A connection made ready: what it is to, and when.
#[derive(Debug)]
pub struct Ready<T> {
    pub conn: T,
    /// The node's relay endpoint it was made to.
    pub addr: SocketAddr,
    /// SHA-256 fingerprint of the certificate the node presented.
    pub fingerprint: String,
    made: Instant,
}

/// Per node, at most one ready connection and whether one is being made.
#[derive(Debug)]
pub struct ReadySet<T> {
    keep: Duration,
    nodes: HashMap<String, Slot<T>>,
}

#[derive(Debug)]
struct Slot<T> {
    ready: Option<Ready<T>>,
    making: bool,
}

impl<T> Default for ReadySet<T> {
    fn default() -> Self {
        ReadySet::new(KEEP)
    }
}

impl<T> ReadySet<T> {
    pub fn new(keep: Duration) -> Self {
        ReadySet {
            keep,
            nodes: HashMap::new(),
        }
    }

    /// The ready connection to `node` at `addr`, if one is within its keep
    /// at `now`. Taken out: each carries one session. One to another address
    /// or past its keep is dropped.
    pub fn take(&mut self, node: &str, addr: SocketAddr, now: Instant) -> Option<Ready<T>> {
        let slot = self.nodes.get_mut(node)?;
        let ready = slot.ready.take()?;
        let fresh = now.saturating_duration_since(ready.made) < self.keep && ready.addr == addr;
        if !slot.making {
            self.nodes.remove(node);
        }
        fresh.then_some(ready)
    }

    /// Whether a connection to `node` should be made now: none is ready or
    /// being made. Says so once: the caller makes it, then calls
    /// [`ReadySet::made`] (or [`ReadySet::failed`]).
    pub fn start_making(&mut self, node: &str) -> bool {
        let slot = self.nodes.entry(node.to_string()).or_insert(Slot {
            ready: None,
            making: false,
        });
        if slot.making || slot.ready.is_some() {
            return false;
        }
        slot.making = true;
        true
    }

    /// The connection [`ReadySet::start_making`] asked for, made at `now`.
    pub fn made(&mut self, node: &str, conn: T, addr: SocketAddr, fingerprint: String, now: Instant) {
        let slot = self.nodes.entry(node.to_string()).or_insert(Slot {
            ready: None,
            making: false,
        });
        slot.making = false;
        slot.ready = Some(Ready {
            conn,
            addr,
            fingerprint,
            made: now,
        });
    }

    /// The connection [`ReadySet::start_making`] asked for could not be made.
    pub fn failed(&mut self, node: &str) {
        if let Some(slot) = self.nodes.get_mut(node) {
            slot.making = false;
            if slot.ready.is_none() {
                self.nodes.remove(node);
            }
        }
    }

    /// Drops `node`'s ready connection if it is past its keep at `now` (each
    /// one made has a timer that calls this at its keep's end); returns
    /// whether it did.
    pub fn expire(&mut self, node: &str, now: Instant) -> bool {
        let Some(slot) = self.nodes.get_mut(node) else {
            return false;
        };
        let old = slot
            .ready
            .as_ref()
            .is_some_and(|r| now.saturating_duration_since(r.made) >= self.keep);
        if old {
            slot.ready = None;
        }
        if !slot.making && slot.ready.is_none() {
            self.nodes.remove(node);
        }
        old
    }

    /// Ready connections held now.
    pub fn len(&self) -> usize {
        self.nodes.values().filter(|s| s.ready.is_some()).count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How long a connection made now is kept.
    pub fn keep(&self) -> Duration {
        self.keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, 1], port))
    }

    #[test]
    fn a_ready_connection_carries_one_session_within_its_keep() {
        let t0 = Instant::now();
        let mut set = ReadySet::new(Duration::from_secs(5));
        assert!(set.start_making("node1"));
        assert!(!set.start_making("node1"), "one at a time per node");
        set.made("node1", "c1", addr(7444), "fp".into(), t0);
        assert!(!set.start_making("node1"), "one is ready already");
        let got = set
            .take("node1", addr(7444), t0 + Duration::from_secs(4))
            .unwrap();
        assert_eq!((got.conn, got.fingerprint.as_str()), ("c1", "fp"));
        assert!(
            set.take("node1", addr(7444), t0 + Duration::from_secs(4))
                .is_none(),
            "taken out: never used twice"
        );
        assert!(set.is_empty());
        // Another node's, or none made: nothing.
        assert!(set.take("node2", addr(7444), t0).is_none());
        assert!(set.start_making("node1"), "the next one may be made");
    }

    #[test]
    fn one_past_its_keep_or_to_another_address_is_dropped_not_used() {
        let t0 = Instant::now();
        let mut set = ReadySet::new(Duration::from_secs(5));
        assert!(set.start_making("node1"));
        set.made("node1", 1, addr(7444), "fp".into(), t0);
        assert!(set
            .take("node1", addr(7444), t0 + Duration::from_secs(5))
            .is_none());
        assert!(set.is_empty(), "dropped");

        assert!(set.start_making("node1"));
        set.made("node1", 2, addr(7444), "fp".into(), t0);
        assert!(
            set.take("node1", addr(7445), t0).is_none(),
            "the node's endpoint moved"
        );
        assert!(set.is_empty());
    }

    #[test]
    fn expiry_drops_old_ones_and_forgets_idle_nodes() {
        let t0 = Instant::now();
        let mut set = ReadySet::new(Duration::from_secs(5));
        for (i, (node, at)) in [("a", 0), ("b", 1), ("c", 6)].into_iter().enumerate() {
            assert!(set.start_making(node));
            set.made(node, i, addr(7444), "fp".into(), t0 + Duration::from_secs(at));
        }
        assert!(set.start_making("d"), "d is being made");
        let dropped: Vec<_> = ["a", "b", "c", "d"]
            .into_iter()
            .filter(|n| set.expire(n, t0 + Duration::from_secs(6)))
            .collect();
        assert_eq!(dropped, ["a", "b"]);
        assert_eq!(set.len(), 1);
        assert!(set.take("c", addr(7444), t0 + Duration::from_secs(7)).is_some());
        // A failed make leaves nothing behind.
        set.failed("d");
        assert!(set.nodes.is_empty());
    }
}
