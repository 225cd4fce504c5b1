//! Caps on open connections, shared by every server that accepts from the
//! network (the control plane's listener, the gateway, the agent's relay
//! endpoint): at most `max` in all and `per_source` from one source address,
//! counted from the TCP accept — TLS handshake included — until the
//! connection's [`ConnectionSlot`] drops. So one host holding half-open
//! handshakes cannot take every slot from the others.
//!
//! Pure: no sockets, no clock. [`Throttle`] (a log line at most once per
//! interval) takes `now` from the caller.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Why a connection gets no slot: whose cap it met.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Capped {
    /// Every slot is taken (the server is full).
    #[error("at the connection cap")]
    Total,
    /// Its source address holds its share already (the peer is flooding).
    #[error("at the per-source connection cap")]
    PerSource,
}

impl Capped {
    /// Stable code for metrics labels and logs.
    pub fn code(self) -> &'static str {
        match self {
            Capped::Total => "max_connections",
            Capped::PerSource => "max_connections_per_source",
        }
    }
}

/// Connections open now, in all and per source address, and the caps.
#[derive(Debug)]
pub struct ConnectionCaps {
    max: usize,
    per_source: usize,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    /// Only sources with at least one open connection: the map grows with
    /// the connections, never with the addresses seen.
    by_source: HashMap<IpAddr, usize>,
}

impl ConnectionCaps {
    /// At most `max` connections, `per_source` of them from one address
    /// (both at least 1; `per_source` above `max` is `max`).
    pub fn new(max: usize, per_source: usize) -> Arc<ConnectionCaps> {
        let max = max.max(1);
        Arc::new(ConnectionCaps {
            max,
            per_source: per_source.clamp(1, max),
            open: Mutex::default(),
        })
    }

    /// A slot for a connection from `source`, given back when it drops.
    /// IPv4-mapped IPv6 sources count as the IPv4 address they carry.
    pub fn try_open(self: &Arc<Self>, source: IpAddr) -> Result<ConnectionSlot, Capped> {
        let source = source.to_canonical();
        let mut open = self.lock();
        // Full is full, whoever asks (the control plane then looks at its
        // nodes' reserve; a gateway answers 503).
        if open.total >= self.max {
            return Err(Capped::Total);
        }
        let from_source = open.by_source.get(&source).copied().unwrap_or(0);
        if from_source >= self.per_source {
            return Err(Capped::PerSource);
        }
        open.total += 1;
        *open.by_source.entry(source).or_default() += 1;
        Ok(ConnectionSlot {
            caps: Arc::clone(self),
            source,
        })
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.lock().total
    }

    /// Connections open now from `source`.
    pub fn open_from(&self, source: IpAddr) -> usize {
        self.lock()
            .by_source
            .get(&source.to_canonical())
            .copied()
            .unwrap_or(0)
    }

    /// The most open at once.
    pub fn max(&self) -> usize {
        self.max
    }

    /// The most open at once from one source address.
    pub fn per_source(&self) -> usize {
        self.per_source
    }

    fn lock(&self) -> MutexGuard<'_, Open> {
        // Counts are updated whole under the lock; a panic elsewhere cannot
        // leave them half-changed.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One connection's place under the caps, given back on drop.
#[derive(Debug)]
pub struct ConnectionSlot {
    caps: Arc<ConnectionCaps>,
    source: IpAddr,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut open = self.caps.lock();
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                open.by_source.remove(&self.source);
            }
        }
    }
}

/// Says "now" at most once per `every`, and how many events were held back
/// since: a refusal under a flood is logged once a second, not once per
/// connection.
#[derive(Debug)]
pub struct Throttle {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub fn new(every: Duration) -> Throttle {
        Throttle {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts an event at `now`; `Some(n)` when it should be logged, with
    /// `n` the events since the last one logged (this one included).
    pub fn event(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (last, held) = &mut *state;
        *held += 1;
        if last.is_some_and(|t| now.saturating_duration_since(t) < self.every) {
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn one_source_at_its_share_leaves_the_other_slots_to_others() {
        let caps = ConnectionCaps::new(4, 2);
        let a1 = caps.try_open(ip("10.0.0.1")).unwrap();
        let _a2 = caps.try_open(ip("10.0.0.1")).unwrap();
        assert_eq!(caps.try_open(ip("10.0.0.1")).unwrap_err(), Capped::PerSource);
        let _b1 = caps.try_open(ip("10.0.0.2")).unwrap();
        let _b2 = caps.try_open(ip("10.0.0.2")).unwrap();
        assert_eq!(caps.try_open(ip("10.0.0.3")).unwrap_err(), Capped::Total);
        assert_eq!((caps.open(), caps.open_from(ip("10.0.0.1"))), (4, 2));
        drop(a1);
        assert_eq!(caps.open_from(ip("10.0.0.1")), 1);
        caps.try_open(ip("10.0.0.3")).unwrap();
    }

    #[test]
    fn a_mapped_ipv6_source_counts_as_its_ipv4_address() {
        let caps = ConnectionCaps::new(10, 1);
        let _v4 = caps.try_open(ip("10.0.0.1")).unwrap();
        assert_eq!(
            caps.try_open(ip("::ffff:10.0.0.1")).unwrap_err(),
            Capped::PerSource
        );
    }

    #[test]
    fn slots_given_back_leave_no_entry_behind() {
        let caps = ConnectionCaps::new(1000, 1000);
        let slots: Vec<_> = (0..=255u8)
            .map(|i| caps.try_open(IpAddr::from([10, 0, 0, i])).unwrap())
            .collect();
        assert_eq!(caps.open(), 256);
        drop(slots);
        assert_eq!(caps.open(), 0);
        assert!(caps.lock().by_source.is_empty());
    }

    #[test]
    fn caps_are_at_least_one_and_the_share_at_most_the_whole() {
        let caps = ConnectionCaps::new(0, 0);
        assert_eq!((caps.max(), caps.per_source()), (1, 1));
        assert_eq!(ConnectionCaps::new(5, 50).per_source(), 5);
    }

    #[test]
    fn a_throttle_says_once_per_interval_with_what_it_held_back() {
        let t = Throttle::new(Duration::from_secs(1));
        let start = Instant::now();
        assert_eq!(t.event(start), Some(1));
        assert_eq!(t.event(start + Duration::from_millis(10)), None);
        assert_eq!(t.event(start + Duration::from_millis(20)), None);
        assert_eq!(t.event(start + Duration::from_secs(1)), Some(3));
        assert_eq!(t.event(start + Duration::from_secs(1)), None);
    }
}
