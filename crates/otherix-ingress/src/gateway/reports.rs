//! Session reports: every session's start and end, queued for the control
//! plane's audit trail. The agent takes them for each heartbeat and gives
//! them back when the heartbeat fails, so a CP outage loses none until the
//! queue is full; then the oldest go first, counted.
//!
//! Reporting never waits: a session pushes into memory and moves on.

use std::collections::VecDeque;
use std::sync::Mutex;

use otherix_proto::agent::SessionEvent;

use super::metrics::Metrics;

/// Reports kept while the CP cannot take them (about 300 bytes each).
pub(crate) const CAPACITY: usize = 100_000;

pub(crate) struct Reports {
    queue: Mutex<VecDeque<SessionEvent>>,
    capacity: usize,
}

impl Reports {
    pub(crate) fn new(capacity: usize) -> Reports {
        Reports {
            queue: Mutex::new(VecDeque::new()),
            capacity,
        }
    }

    pub(crate) fn push(&self, event: SessionEvent, metrics: &Metrics) {
        let mut q = self.lock();
        q.push_back(event);
        self.trim(&mut q, metrics);
    }

    /// The oldest `max` reports.
    pub(crate) fn take(&self, max: usize) -> Vec<SessionEvent> {
        let mut q = self.lock();
        let n = max.min(q.len());
        q.drain(..n).collect()
    }

    /// Puts reports taken earlier back in front, in their order.
    pub(crate) fn give_back(&self, events: Vec<SessionEvent>, metrics: &Metrics) {
        let mut q = self.lock();
        for event in events.into_iter().rev() {
            q.push_front(event);
        }
        self.trim(&mut q, metrics);
    }

    fn trim(&self, q: &mut VecDeque<SessionEvent>, metrics: &Metrics) {
        let over = q.len().saturating_sub(self.capacity);
        if over > 0 {
            q.drain(..over);
            metrics.reports_dropped(over as u64);
            tracing::warn!(
                dropped = over,
                "session reports dropped: the control plane has not taken them for too long"
            );
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<SessionEvent>> {
        // Reports are whole values: a panic elsewhere cannot leave one half-made.
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::OffsetDateTime;

    fn start(id: &str) -> SessionEvent {
        SessionEvent::Start {
            session: id.into(),
            at: OffsetDateTime::UNIX_EPOCH,
            principal: "user:a".into(),
            vm: "web01".into(),
            port: 22,
            network: "ov".into(),
            credential: None,
        }
    }

    fn ids(events: &[SessionEvent]) -> Vec<&str> {
        events.iter().map(|e| e.session()).collect()
    }

    #[test]
    fn reports_come_out_oldest_first_and_given_back_ones_come_first_again() {
        let (r, m) = (
            Reports::new(10),
            Metrics::new(
                otherix_core::conns::ConnectionCaps::new(1, 1),
                std::sync::Arc::new(crate::listener::Refusals::new("gateway")),
            ),
        );
        for id in ["a", "b", "c"] {
            r.push(start(id), &m);
        }
        let taken = r.take(2);
        assert_eq!(ids(&taken), ["a", "b"]);
        r.push(start("d"), &m);
        r.give_back(taken, &m);
        assert_eq!(ids(&r.take(10)), ["a", "b", "c", "d"]);
        assert!(r.take(10).is_empty());
    }

    #[test]
    fn a_full_queue_drops_the_oldest_and_counts_them() {
        let (r, m) = (
            Reports::new(2),
            Metrics::new(
                otherix_core::conns::ConnectionCaps::new(1, 1),
                std::sync::Arc::new(crate::listener::Refusals::new("gateway")),
            ),
        );
        for id in ["a", "b", "c"] {
            r.push(start(id), &m);
        }
        let taken = r.take(1);
        r.push(start("d"), &m);
        r.push(start("e"), &m);
        r.give_back(taken, &m);
        assert_eq!(ids(&r.take(10)), ["d", "e"]);
        assert_eq!(m.snapshot().session_reports_dropped, 3);
    }
}
