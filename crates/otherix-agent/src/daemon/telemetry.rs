//! The agent's operator endpoints (`--metrics-listen`): readiness (enrolled,
//! and a heartbeat answered recently) and the gauges and counters read at
//! scrape time from the gateway role, if it runs. Everything else the agent
//! records where it happens (`metrics` macros).

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use otherix_ingress::Gateway;

use super::gateway::NetlinkOverlay;
use super::serving::unix_now;

/// What `/readyz` and `/metrics` read from the running agent.
pub struct AgentProbe {
    /// Unix seconds of the last answered heartbeat (0: none yet).
    last_answered: AtomicI64,
    /// Not ready once no heartbeat was answered for this long.
    stale_after: Duration,
    gateway: Mutex<Option<Arc<Gateway<NetlinkOverlay>>>>,
}

impl AgentProbe {
    /// An enrolled agent's probe; its heartbeats go every `interval`.
    pub fn new(interval: Duration) -> Arc<AgentProbe> {
        Arc::new(AgentProbe {
            last_answered: AtomicI64::new(0),
            stale_after: (interval * 3).max(Duration::from_secs(10)),
            gateway: Mutex::new(None),
        })
    }

    /// A heartbeat was answered now.
    pub fn answered(&self) {
        self.last_answered.store(unix_now(), Ordering::Relaxed);
    }

    /// The gateway role's gateway, while it runs.
    pub fn set_gateway(&self, gateway: Option<Arc<Gateway<NetlinkOverlay>>>) {
        *self.gateway.lock().unwrap_or_else(|p| p.into_inner()) = gateway;
    }

    /// Ready: a heartbeat was answered within `stale_after`.
    pub fn readiness(&self, now: i64) -> Result<(), NotReady> {
        let last = self.last_answered.load(Ordering::Relaxed);
        if last == 0 {
            return Err(NotReady::NeverAnswered);
        }
        let age = now - last;
        if age > self.stale_after.as_secs() as i64 {
            return Err(NotReady::Stale { age_secs: age });
        }
        Ok(())
    }
}

/// Why `/readyz` says not ready: the control plane has not answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    #[error("no heartbeat answered yet")]
    NeverAnswered,
    #[error("no heartbeat answered for {age_secs}s")]
    Stale { age_secs: i64 },
}

impl otherix_telemetry::Probe for AgentProbe {
    fn ready(&self) -> BoxFuture<'_, Result<(), otherix_telemetry::NotReady>> {
        Box::pin(async move { Ok(self.readiness(unix_now())?) })
    }

    fn refresh(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let Some(gw) = self.gateway.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
                return;
            };
            let c = gw.counters();
            metrics::counter!("otherix_gateway_accepted_total").absolute(c.accepted);
            for (code, n) in &c.refused {
                metrics::counter!("otherix_gateway_refused_total", "reason" => *code).absolute(*n);
            }
            metrics::counter!("otherix_gateway_tls_handshake_failures_total")
                .absolute(c.tls_handshake_failures);
            metrics::counter!("otherix_gateway_bytes_total", "direction" => "to_guest")
                .absolute(c.bytes_to_guest);
            metrics::counter!("otherix_gateway_bytes_total", "direction" => "from_guest")
                .absolute(c.bytes_from_guest);
            metrics::counter!("otherix_gateway_session_reports_dropped_total")
                .absolute(c.session_reports_dropped);
            metrics::gauge!("otherix_gateway_open_connections").set(c.open_connections as f64);
            metrics::gauge!("otherix_gateway_handshakes_pending").set(c.handshakes_pending as f64);
            metrics::gauge!("otherix_gateway_replay_cache_entries").set(gw.replay_cache_len() as f64);
            let open: u32 = gw.sessions().values().sum();
            metrics::gauge!("otherix_sessions_open", "transport" => "gateway").set(f64::from(open));
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_while_heartbeats_are_answered() {
        let p = AgentProbe::new(Duration::from_secs(2));
        assert_eq!(p.readiness(unix_now()), Err(NotReady::NeverAnswered));
        p.answered();
        p.readiness(unix_now()).unwrap();
        let err = p.readiness(unix_now() + 11).unwrap_err();
        assert!(
            matches!(err, NotReady::Stale { age_secs } if age_secs >= 11),
            "{err}"
        );
        assert!(err.to_string().starts_with("no heartbeat answered for"), "{err}");
    }
}
