//! Counters (std atomics): refusals per reason, accepted sessions, bytes,
//! open connections, and open sessions per overlay network — which the agent
//! reports in its heartbeat so the CP keeps this gateway on an overlay until
//! its sessions drain.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::refused::REFUSAL_CODES;
use crate::listener::Refusals;
use otherix_core::conns::ConnectionCaps;

/// A snapshot of the gateway's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Counters {
    /// Sessions that passed every check and were spliced.
    pub accepted: u64,
    /// Refusals by reason code, every code of [`crate::REFUSAL_CODES`] present.
    pub refused: BTreeMap<&'static str, u64>,
    /// Connections that failed or timed out in the TLS handshake (no HTTP
    /// response is possible there).
    pub tls_handshake_failures: u64,
    /// Connections the client closed before its request head was complete.
    pub closed_before_head: u64,
    /// Payload bytes spliced from clients to guests (counted as sessions end).
    pub bytes_to_guest: u64,
    /// Payload bytes spliced from guests to clients (counted as sessions end).
    pub bytes_from_guest: u64,
    /// Connections open now, in any stage.
    pub open_connections: u64,
    /// Connections in their TLS handshake now (at most a quarter of the
    /// slots: past that the busiest source's oldest is cut).
    pub handshakes_pending: u64,
    /// Connections closed before any answer, by reason (every reason of
    /// [`crate::listener::CONNECTION_REFUSALS`] present): a source over its
    /// share, a handshake past its deadline.
    pub connections_refused: BTreeMap<&'static str, u64>,
    /// Session start/end reports dropped because the queue for the control
    /// plane was full (it was unreachable for a long time).
    pub session_reports_dropped: u64,
}

impl Counters {
    /// Refusals counted under `code` (0 for an unknown code).
    pub fn refused(&self, code: &str) -> u64 {
        self.refused.get(code).copied().unwrap_or(0)
    }
}

pub(crate) struct Metrics {
    refusals: Vec<AtomicU64>,
    accepted: AtomicU64,
    tls_failures: AtomicU64,
    closed_before_head: AtomicU64,
    bytes_to_guest: AtomicU64,
    bytes_from_guest: AtomicU64,
    /// The gateway's connection caps, read for the open-connections gauge.
    connections: Arc<ConnectionCaps>,
    /// Connections closed before any answer.
    closed: Arc<Refusals>,
    sessions: Mutex<HashMap<String, u32>>,
    reports_dropped: AtomicU64,
}

impl Metrics {
    pub(crate) fn new(connections: Arc<ConnectionCaps>, closed: Arc<Refusals>) -> Metrics {
        Metrics {
            refusals: REFUSAL_CODES.iter().map(|_| AtomicU64::new(0)).collect(),
            accepted: AtomicU64::new(0),
            tls_failures: AtomicU64::new(0),
            closed_before_head: AtomicU64::new(0),
            bytes_to_guest: AtomicU64::new(0),
            bytes_from_guest: AtomicU64::new(0),
            connections,
            closed,
            sessions: Mutex::new(HashMap::new()),
            reports_dropped: AtomicU64::new(0),
        }
    }

    pub(crate) fn refused(&self, code: &str) {
        let index = REFUSAL_CODES
            .iter()
            .position(|c| *c == code)
            .unwrap_or(REFUSAL_CODES.len() - 1);
        self.refusals[index].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn accepted(&self) {
        self.accepted.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn tls_failed(&self) {
        self.tls_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn closed_before_head(&self) {
        self.closed_before_head.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn reports_dropped(&self, n: u64) {
        self.reports_dropped.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn bytes(&self, to_guest: u64, from_guest: u64) {
        self.bytes_to_guest.fetch_add(to_guest, Ordering::Relaxed);
        self.bytes_from_guest.fetch_add(from_guest, Ordering::Relaxed);
    }

    /// Counts a session open on `network` until the guard drops.
    pub(crate) fn open_session(&self, network: &str) -> SessionSlot<'_> {
        let mut sessions = lock(&self.sessions);
        *sessions.entry(network.to_string()).or_insert(0) += 1;
        SessionSlot {
            metrics: self,
            network: network.to_string(),
        }
    }

    pub(crate) fn sessions(&self) -> BTreeMap<String, u32> {
        lock(&self.sessions)
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect()
    }

    pub(crate) fn snapshot(&self) -> Counters {
        Counters {
            accepted: self.accepted.load(Ordering::Relaxed),
            refused: REFUSAL_CODES
                .iter()
                .zip(&self.refusals)
                .map(|(code, n)| (*code, n.load(Ordering::Relaxed)))
                .collect(),
            tls_handshake_failures: self.tls_failures.load(Ordering::Relaxed),
            closed_before_head: self.closed_before_head.load(Ordering::Relaxed),
            bytes_to_guest: self.bytes_to_guest.load(Ordering::Relaxed),
            bytes_from_guest: self.bytes_from_guest.load(Ordering::Relaxed),
            open_connections: self.connections.open() as u64,
            handshakes_pending: self.connections.handshakes_pending() as u64,
            connections_refused: self.closed.snapshot(),
            session_reports_dropped: self.reports_dropped.load(Ordering::Relaxed),
        }
    }

    /// The Prometheus text exposition format (version 0.0.4).
    pub(crate) fn text(&self) -> String {
        let c = self.snapshot();
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, u64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        metric(
            "otherix_gateway_sessions_accepted_total",
            "counter",
            "Sessions that passed every check and were spliced to a guest.",
            &[(String::new(), c.accepted)],
        );
        let refused: Vec<_> = c
            .refused
            .iter()
            .map(|(code, n)| (format!("{{reason=\"{code}\"}}"), *n))
            .collect();
        metric(
            "otherix_gateway_refusals_total",
            "counter",
            "Connections refused with an HTTP status, by reason.",
            &refused,
        );
        metric(
            "otherix_gateway_tls_handshake_failures_total",
            "counter",
            "Connections that failed or timed out in the TLS handshake.",
            &[(String::new(), c.tls_handshake_failures)],
        );
        let closed: Vec<_> = c
            .connections_refused
            .iter()
            .map(|(reason, n)| (format!("{{server=\"gateway\",reason=\"{reason}\"}}"), *n))
            .collect();
        metric(
            "otherix_ingress_connections_refused_total",
            "counter",
            "Connections closed before any answer, by reason.",
            &closed,
        );
        metric(
            "otherix_gateway_closed_before_head_total",
            "counter",
            "Connections closed by the client before its request head was complete.",
            &[(String::new(), c.closed_before_head)],
        );
        metric(
            "otherix_gateway_bytes_total",
            "counter",
            "Payload bytes spliced, by direction (counted as sessions end).",
            &[
                ("{direction=\"to_guest\"}".into(), c.bytes_to_guest),
                ("{direction=\"from_guest\"}".into(), c.bytes_from_guest),
            ],
        );
        metric(
            "otherix_gateway_session_reports_dropped_total",
            "counter",
            "Session start/end reports dropped: the queue for the control plane was full.",
            &[(String::new(), c.session_reports_dropped)],
        );
        metric(
            "otherix_gateway_connections_open",
            "gauge",
            "Connections open now, in any stage.",
            &[(String::new(), c.open_connections)],
        );
        metric(
            "otherix_gateway_handshakes_pending",
            "gauge",
            "Connections in their TLS handshake now; past a quarter of the slots the busiest source's oldest is cut.",
            &[(String::new(), c.handshakes_pending)],
        );
        let sessions: Vec<_> = self
            .sessions()
            .into_iter()
            .map(|(network, n)| {
                (
                    format!("{{network=\"{}\"}}", escape_label(&network)),
                    u64::from(n),
                )
            })
            .collect();
        metric(
            "otherix_gateway_sessions_open",
            "gauge",
            "Sessions open now, by overlay network.",
            &sessions,
        );
        out
    }
}

/// An open session on one network, uncounted on drop.
pub(crate) struct SessionSlot<'a> {
    metrics: &'a Metrics,
    network: String,
}

impl Drop for SessionSlot<'_> {
    fn drop(&mut self) {
        let mut sessions = lock(&self.metrics.sessions);
        if let Some(n) = sessions.get_mut(&self.network) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                sessions.remove(&self.network);
            }
        }
    }
}

/// Locks, going on after a panic elsewhere: the data are plain counters
/// that no half-finished update can leave inconsistent.
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_counted_per_network_and_vanish_at_zero() {
        let m = Metrics::new(ConnectionCaps::new(1, 1), Arc::new(Refusals::new("gateway")));
        let a = m.open_session("ov1");
        let b = m.open_session("ov1");
        let c = m.open_session("ov2");
        assert_eq!(
            m.sessions(),
            BTreeMap::from([("ov1".into(), 2), ("ov2".into(), 1)])
        );
        drop(a);
        drop(c);
        assert_eq!(m.sessions(), BTreeMap::from([("ov1".into(), 1)]));
        drop(b);
        assert!(m.sessions().is_empty());
    }

    #[test]
    fn refusals_are_counted_by_code_and_unknown_codes_as_other() {
        let m = Metrics::new(ConnectionCaps::new(1, 1), Arc::new(Refusals::new("gateway")));
        m.refused("expired");
        m.refused("expired");
        m.refused("something_new");
        let c = m.snapshot();
        assert_eq!(c.refused("expired"), 2);
        assert_eq!(c.refused("other"), 1);
        assert_eq!(c.refused("replayed"), 0);
    }

    #[test]
    fn text_is_prometheus_exposition_format() {
        let m = Metrics::new(ConnectionCaps::new(1, 1), Arc::new(Refusals::new("gateway")));
        m.accepted();
        m.refused("replayed");
        let _s = m.open_session("ov1");
        let text = m.text();
        assert!(
            text.contains("# TYPE otherix_gateway_refusals_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("otherix_gateway_refusals_total{reason=\"replayed\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("otherix_gateway_sessions_accepted_total 1\n"),
            "{text}"
        );
        assert!(
            text.contains("otherix_gateway_sessions_open{network=\"ov1\"} 1\n"),
            "{text}"
        );
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = line.rsplit_once(' ').unwrap();
            value.parse::<u64>().unwrap();
        }
    }
}
