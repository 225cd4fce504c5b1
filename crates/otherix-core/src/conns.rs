//! Caps on open connections, shared by every server that accepts from the
//! network (the control plane's listener, the gateway, the agent's relay
//! endpoint): at most `max` in all and `per_source` from one source address,
//! counted from the TCP accept — TLS handshake included — until the
//! connection's [`ConnectionSlot`] drops. So one host holding half-open
//! handshakes cannot take every slot from the others.
//!
//! Many hosts together could still hold every slot with handshakes they
//! never finish (a handful fill a gateway: a per-source share only raises
//! the number of hosts needed). So at most a quarter of the slots
//! ([`HANDSHAKE_SHARE_DIVISOR`]) may be in their handshake at once; a
//! connection leaves that budget when its server calls
//! [`ConnectionSlot::established`]. A newcomer finding the budget full is
//! not refused: the oldest unfinished handshake of the source holding the
//! most is cut ([`ConnectionSlot::cut`] completes, the server closes it) and
//! the newcomer takes its place. A legitimate handshake is done in
//! milliseconds, a held one is old, so a flood must out-churn real clients'
//! handshakes, not just hold slots.
//!
//! ```text
//! try_open(source) ── total full? ──▶ Capped::Total
//!                  ── source at its share? ──▶ Capped::PerSource
//!                  ── handshakes at their budget? ──▶ cut the busiest source's oldest
//!                  ──▶ slot (pending) ── established() ──▶ slot (open) ── drop ──▶ given back
//! ```
//!
//! Pure: no sockets, no clock. [`Throttle`] (a log line at most once per
//! interval) takes `now` from the caller.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// The share of the slots that may be in their handshake at once: one in
/// this many (at least one slot).
pub const HANDSHAKE_SHARE_DIVISOR: usize = 4;

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
    /// Slots that may be in their handshake at once.
    handshakes: usize,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    /// Only sources with at least one open connection: the map grows with
    /// the connections, never with the addresses seen.
    by_source: HashMap<IpAddr, usize>,
    /// Handshakes not done yet, by source, oldest first (by the order they
    /// were opened in); only sources with one.
    pending: HashMap<IpAddr, BTreeMap<u64, Arc<CutSignal>>>,
    /// Every source in `pending`, keyed so that the last is the one to cut
    /// from: the most pending, then the oldest pending handshake.
    busiest: BTreeSet<(usize, Reverse<u64>, IpAddr)>,
    pending_total: usize,
    next_seq: u64,
    /// Handshakes cut to make room for a newcomer, ever.
    cut: u64,
}

impl Open {
    /// `source`'s key in `busiest` (`None` with nothing pending).
    fn busiest_key(&self, source: IpAddr) -> Option<(usize, Reverse<u64>, IpAddr)> {
        let queue = self.pending.get(&source)?;
        let (&oldest, _) = queue.first_key_value()?;
        Some((queue.len(), Reverse(oldest), source))
    }

    /// Changes `source`'s pending handshakes with `change`, keeping
    /// `busiest` and the total in step.
    fn with_pending<T>(
        &mut self,
        source: IpAddr,
        change: impl FnOnce(&mut BTreeMap<u64, Arc<CutSignal>>) -> T,
    ) -> T {
        if let Some(key) = self.busiest_key(source) {
            self.busiest.remove(&key);
        }
        let queue = self.pending.entry(source).or_default();
        let before = queue.len();
        let out = change(queue);
        let after = queue.len();
        if after == 0 {
            self.pending.remove(&source);
        }
        self.pending_total = self.pending_total + after - before;
        if let Some(key) = self.busiest_key(source) {
            self.busiest.insert(key);
        }
        out
    }

    /// Takes the handshake to cut out of the pending ones: the oldest of
    /// the source with the most.
    fn take_victim(&mut self) -> Option<Arc<CutSignal>> {
        let &(_, _, source) = self.busiest.last()?;
        self.with_pending(source, |queue| queue.pop_first().map(|(_, signal)| signal))
    }
}

impl ConnectionCaps {
    /// At most `max` connections, `per_source` of them from one address
    /// (both at least 1; `per_source` above `max` is `max`).
    pub fn new(max: usize, per_source: usize) -> Arc<ConnectionCaps> {
        let max = max.max(1);
        Arc::new(ConnectionCaps {
            max,
            per_source: per_source.clamp(1, max),
            handshakes: (max / HANDSHAKE_SHARE_DIVISOR).max(1),
            open: Mutex::default(),
        })
    }

    /// A slot for a connection from `source`, given back when it drops; it
    /// is in its handshake until [`ConnectionSlot::established`]. With the
    /// handshakes at their budget, the oldest handshake of the source
    /// holding the most is cut to make room. IPv4-mapped IPv6 sources count
    /// as the IPv4 address they carry.
    pub fn try_open(self: &Arc<Self>, source: IpAddr) -> Result<ConnectionSlot, Capped> {
        let source = source.to_canonical();
        let signal = Arc::new(CutSignal::default());
        let (seq, victim) = {
            let mut open = self.lock();
            // Full is full, whoever asks (the control plane then looks at
            // its nodes' reserve; a gateway answers 503).
            if open.total >= self.max {
                return Err(Capped::Total);
            }
            let from_source = open.by_source.get(&source).copied().unwrap_or(0);
            if from_source >= self.per_source {
                return Err(Capped::PerSource);
            }
            // The victim keeps its slot until its server closes it; the
            // total is under the cap, so the newcomer fits beside it.
            let victim = if open.pending_total >= self.handshakes {
                let victim = open.take_victim();
                open.cut += u64::from(victim.is_some());
                victim
            } else {
                None
            };
            open.total += 1;
            *open.by_source.entry(source).or_default() += 1;
            let seq = open.next_seq;
            open.next_seq += 1;
            let queued = Arc::clone(&signal);
            open.with_pending(source, |queue| queue.insert(seq, queued));
            (seq, victim)
        };
        // Woken outside the lock: its task gives the slot back under it.
        if let Some(victim) = victim {
            victim.fire();
        }
        Ok(ConnectionSlot {
            caps: Arc::clone(self),
            source,
            seq,
            signal,
            pending: true,
        })
    }

    /// Handshakes not done yet.
    pub fn handshakes_pending(&self) -> usize {
        self.lock().pending_total
    }

    /// Handshakes cut to make room for newcomers, ever.
    pub fn handshakes_cut(&self) -> u64 {
        self.lock().cut
    }

    /// The most handshakes at once before the oldest is cut.
    pub fn handshake_budget(&self) -> usize {
        self.handshakes
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
    /// Its place among its source's pending handshakes.
    seq: u64,
    signal: Arc<CutSignal>,
    /// Still counted among the handshakes (not established, not cut).
    pending: bool,
}

impl ConnectionSlot {
    /// Its handshake is done: it no longer counts against the handshakes'
    /// budget and can no longer be cut. Calling it again does nothing.
    pub fn established(&mut self) {
        if std::mem::take(&mut self.pending) {
            let seq = self.seq;
            self.caps
                .lock()
                .with_pending(self.source, |queue| queue.remove(&seq));
        }
    }

    /// Completes when its handshake was cut to make room for a newcomer
    /// (never once [`established`](Self::established)): the server closes
    /// the connection.
    pub fn cut(&self) -> Cut {
        Cut(Arc::clone(&self.signal))
    }

    /// Whether its handshake was cut.
    pub fn was_cut(&self) -> bool {
        self.signal.cut.load(Ordering::Acquire)
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut open = self.caps.lock();
        if self.pending {
            let seq = self.seq;
            open.with_pending(self.source, |queue| queue.remove(&seq));
        }
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                open.by_source.remove(&self.source);
            }
        }
    }
}

/// A handshake's cut, set once by [`ConnectionCaps::try_open`] for a
/// newcomer; wakes the task waiting on [`Cut`].
#[derive(Debug, Default)]
struct CutSignal {
    cut: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl CutSignal {
    fn fire(&self) {
        self.cut.store(true, Ordering::Release);
        let waker = self.waker.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// Completes when a slot's handshake is cut ([`ConnectionSlot::cut`]).
#[derive(Debug, Clone)]
pub struct Cut(Arc<CutSignal>);

impl Future for Cut {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let signal = &self.0;
        if signal.cut.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        *signal.waker.lock().unwrap_or_else(|p| p.into_inner()) = Some(cx.waker().clone());
        // Set between the first look and the waker's store: seen now.
        if signal.cut.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        Poll::Pending
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

    /// Polls `cut` once: whether it completed.
    fn is_cut(cut: Cut) -> bool {
        let mut cut = std::pin::pin!(cut);
        let mut cx = Context::from_waker(Waker::noop());
        cut.as_mut().poll(&mut cx).is_ready()
    }

    #[test]
    fn past_the_handshake_budget_the_busiest_sources_oldest_handshake_is_cut() {
        // 8 slots: 2 may be in their handshake.
        let caps = ConnectionCaps::new(8, 8);
        assert_eq!(caps.handshake_budget(), 2);
        let flood1 = caps.try_open(ip("10.0.0.9")).unwrap();
        let flood2 = caps.try_open(ip("10.0.0.9")).unwrap();
        assert_eq!(caps.handshakes_pending(), 2);
        // A client's handshake takes the place of the flood's oldest.
        let mut client = caps.try_open(ip("10.0.0.1")).unwrap();
        assert!(is_cut(flood1.cut()) && flood1.was_cut());
        assert!(!is_cut(flood2.cut()) && !is_cut(client.cut()));
        assert_eq!((caps.handshakes_pending(), caps.handshakes_cut()), (2, 1));
        // The cut one keeps its slot until its server drops it.
        assert_eq!(caps.open(), 3);
        drop(flood1);
        assert_eq!((caps.open(), caps.handshakes_pending()), (2, 2));
        // Done: out of the budget, never cut.
        client.established();
        client.established();
        assert_eq!(caps.handshakes_pending(), 1);
        let _flood3 = caps.try_open(ip("10.0.0.9")).unwrap();
        let _flood4 = caps.try_open(ip("10.0.0.9")).unwrap();
        assert!(is_cut(flood2.cut()), "the flood's own newcomers cut its oldest");
        assert!(!is_cut(client.cut()));
        drop(client);
        drop(flood2);
        assert_eq!((caps.open(), caps.handshakes_pending()), (2, 2));
    }

    #[test]
    fn between_sources_with_as_many_handshakes_the_older_one_is_cut() {
        let caps = ConnectionCaps::new(8, 8);
        let a = caps.try_open(ip("10.0.0.2")).unwrap();
        let b = caps.try_open(ip("10.0.0.1")).unwrap();
        let _c = caps.try_open(ip("10.0.0.3")).unwrap();
        assert!(is_cut(a.cut()) && !is_cut(b.cut()));
        let _d = caps.try_open(ip("10.0.0.4")).unwrap();
        assert!(is_cut(b.cut()));
        drop((a, b));
        let open = caps.lock();
        assert_eq!(open.pending_total, 2);
        assert_eq!(open.busiest.len(), open.pending.len());
    }

    #[test]
    fn a_waker_is_woken_when_its_handshake_is_cut() {
        struct Flag(AtomicBool);
        impl std::task::Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let caps = ConnectionCaps::new(4, 4);
        let held = caps.try_open(ip("10.0.0.9")).unwrap();
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(Arc::clone(&flag));
        let mut cut = std::pin::pin!(held.cut());
        assert!(cut.as_mut().poll(&mut Context::from_waker(&waker)).is_pending());
        let _newcomer = caps.try_open(ip("10.0.0.1")).unwrap();
        assert!(flag.0.load(Ordering::SeqCst));
        assert!(cut.as_mut().poll(&mut Context::from_waker(&waker)).is_ready());
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
