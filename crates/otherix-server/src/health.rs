//! Liveness, readiness and the gauges read from state, for operators: the
//! public `/healthz` and `/readyz`, and the same plus `/metrics` on
//! `--metrics-listen` (`otherix-telemetry`).

use std::collections::BTreeMap;

use futures_util::future::BoxFuture;
use otherix_proto::agent::NodeStatus;
use otherix_proto::Transport;
use time::OffsetDateTime;

use crate::desired;
use crate::state::AppState;

/// Why the control plane cannot broker now. Shown to anyone who asks
/// (`/readyz` needs no token), so it names the cause and nothing more: the
/// store's own error (addresses, users, the driver's text) is logged by
/// [`readiness`], never answered.
#[derive(Debug, thiserror::Error)]
pub enum NotReady {
    #[error("store unavailable")]
    Store,
    #[error("no session signing key loaded yet")]
    NoKey,
    #[error("the catalog has not caught up with the store")]
    CatalogStale,
}

/// Ready: the store answers, a session key is loaded and the catalog
/// follows the store (the broker can mint credentials).
pub async fn readiness(state: &AppState) -> Result<(), NotReady> {
    if let Err(e) = state.store.ping().await {
        tracing::warn!(error = %e, "not ready: the store does not answer");
        return Err(NotReady::Store);
    }
    if state.keys.current(OffsetDateTime::now_utc()).is_none() {
        return Err(NotReady::NoKey);
    }
    if !state.catalog.fresh() {
        return Err(NotReady::CatalogStale);
    }
    Ok(())
}

/// Makes the control plane's metrics exist from the start (at zero), so a
/// scrape shows every name before the first event of its kind.
pub fn register() {
    metrics::counter!("otherix_broker_decisions_total", "outcome" => "allowed", "reason" => "").absolute(0);
    metrics::counter!("otherix_credentials_minted_total", "transport" => "gateway").absolute(0);
    metrics::counter!("otherix_credentials_minted_total", "transport" => "relay").absolute(0);
    metrics::counter!("otherix_heartbeats_total", "result" => "ok").absolute(0);
    metrics::counter!("otherix_relay_bytes_total", "direction" => "up").absolute(0);
    metrics::counter!("otherix_relay_bytes_total", "direction" => "down").absolute(0);
}

/// The control plane's [`otherix_telemetry::Probe`].
pub struct CpProbe(pub AppState);

impl otherix_telemetry::Probe for CpProbe {
    fn ready(&self) -> BoxFuture<'_, Result<(), otherix_telemetry::NotReady>> {
        Box::pin(async move { Ok(readiness(&self.0).await?) })
    }

    /// Nodes by status and open sessions by transport, read at scrape time
    /// (never on a request path). The nodes are counted in the catalog, as
    /// `node list` shows them: its heartbeat times are the ones answered
    /// (on PostgreSQL, other replicas' too), where the store's rows are
    /// written only every few seconds, and a count of the catalog's is a
    /// walk in memory where a read of every row with its JSON took about
    /// 9 % of the CP's CPU at 1,000 nodes scraped once a second.
    fn refresh(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let state = &self.0;
            let now = OffsetDateTime::now_utc();
            // As of now, not as of the catalog's last round (which may be stuck).
            metrics::gauge!("otherix_catalog_lag_seconds").set(state.catalog.lag().as_secs_f64());
            let (mut ready, mut not_ready) = (0usize, 0usize);
            for n in state.catalog.read().nodes() {
                if desired::is_ready(n, now, state.settings.node_timeout) {
                    ready += 1;
                } else {
                    not_ready += 1;
                }
            }
            metrics::gauge!("otherix_nodes", "status" => NodeStatus::Ready.to_string()).set(ready as f64);
            metrics::gauge!("otherix_nodes", "status" => NodeStatus::NotReady.to_string())
                .set(not_ready as f64);
            if let Ok(open) = state.store.open_sessions_by_transport(None).await {
                let mut by: BTreeMap<Transport, u64> = Transport::ALL.iter().map(|t| (*t, 0)).collect();
                by.extend(open);
                for (transport, n) in by {
                    metrics::gauge!("otherix_sessions_open", "transport" => transport.as_str()).set(n as f64);
                }
            }
        })
    }
}
