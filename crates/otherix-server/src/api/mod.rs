//! The HTTP API under `/v1/`: routing, shared state, and the one place where
//! errors become HTTP statuses.

mod audit;
mod broker;
mod error;
mod extract;
mod grants;
mod info;
mod lbs;
mod networks;
mod nodes;
pub mod openapi;
mod sessions;
mod users;
mod vms;
pub mod wake;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, Request};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{delete, get, patch, post};
use axum::Router;
use otherix_proto::ServerInfo;
use otherix_store::Store;

use crate::keys::SessionKeys;
use crate::pki::ClusterCa;
use tracing::Instrument;

pub use error::ApiError;
pub use extract::{ApiJson, ApiPath, ApiQuery};

/// Largest request body the API reads; everything it takes is small JSON.
pub const MAX_BODY: usize = 64 * 1024;
/// Largest heartbeat body: up to `MAX_SESSION_EVENTS` session reports.
pub const HEARTBEAT_MAX_BODY: usize = 2 * 1024 * 1024;

/// What every handler can reach.
#[derive(Clone, Debug)]
pub struct AppState {
    pub store: Store,
    pub info: Arc<ServerInfo>,
    pub ca: Arc<ClusterCa>,
    pub settings: Arc<Settings>,
    pub keys: Arc<SessionKeys>,
    /// Recent connections per LB backend, for power-of-two choices.
    pub recent: Arc<crate::lb::RecentConnections>,
    pub relay: Arc<crate::relay::RelayState>,
    /// Wakes agents waiting for their desired state to change.
    pub wake: Arc<wake::Wake>,
    /// Per-principal broker rate limits.
    pub limits: Arc<crate::limits::BrokerLimits>,
}

/// Tunables of the control plane, validated once at start.
#[derive(Clone, Debug)]
pub struct Settings {
    /// A node whose last heartbeat is older than this is NotReady.
    pub node_timeout: time::Duration,
    /// MTU of guest and overlay interfaces: the underlay's minus VXLAN's 50.
    pub mtu: u32,
    /// Session signing keys rotate this often.
    pub key_rotation: time::Duration,
    /// Credentials live this long.
    pub credential_ttl: time::Duration,
    /// Audit events are kept this long.
    pub audit_retention: time::Duration,
    /// Node, gateway and relay certificates are valid this long; agents
    /// renew them at two thirds.
    pub node_cert_validity: time::Duration,
    /// A gateway keeps an overlay its coverage no longer needs at most
    /// this long while its sessions there drain.
    pub max_drain: time::Duration,
    /// Broker calls per second each principal may make (0: no limit), and
    /// the burst above it.
    pub broker_rate: f64,
    pub broker_burst: f64,
    /// Relay sessions end this long after they opened, busy or not.
    pub max_session: std::time::Duration,
    /// Most sessions one principal may have open (gateways' and the
    /// relay's); the broker refuses past it, the relay too. 0: no limit.
    pub max_sessions_per_principal: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            node_timeout: time::Duration::seconds(10),
            mtu: 1450,
            key_rotation: time::Duration::hours(1),
            credential_ttl: otherix_core::credential::DEFAULT_TTL,
            audit_retention: time::Duration::days(90),
            node_cert_validity: crate::pki::NODE_CERT_VALIDITY,
            max_drain: time::Duration::hours(12),
            broker_rate: 500.0,
            broker_burst: 1000.0,
            max_session: std::time::Duration::from_secs(12 * 3600),
            max_sessions_per_principal: 1000,
        }
    }
}

/// The whole API as a router, so tests can drive it without a socket.
pub fn router(state: AppState) -> Router {
    let writes = middleware::from_fn_with_state(state.clone(), wake::note_writes);
    Router::new()
        .route("/v1/info", get(info::info))
        .route("/healthz", get(info::healthz))
        .route("/readyz", get(info::readyz))
        .route("/v1/openapi.json", get(openapi::document))
        .route("/v1/whoami", get(info::whoami))
        .route("/v1/users", get(users::list).post(users::create))
        .route("/v1/users/{name}", get(users::get).delete(users::delete))
        .route("/v1/users/{name}/tokens", post(users::create_token))
        .route("/v1/users/{name}/tokens/{id}", delete(users::revoke_token))
        .route("/v1/users/{name}/rules", post(users::allow))
        .route("/v1/users/{name}/rules/{id}", delete(users::disallow))
        .route("/v1/networks", get(networks::list).post(networks::create))
        .route("/v1/networks/{name}", get(networks::get).delete(networks::delete))
        .route("/v1/networks/{name}/nodes", post(networks::add_node))
        .route("/v1/networks/{name}/nodes/{node}", delete(networks::remove_node))
        .route("/v1/vms", get(vms::list).post(vms::create))
        .route("/v1/vms/{name}", get(vms::get).delete(vms::delete))
        .route("/v1/vms/{name}/labels", patch(vms::label))
        .route("/v1/vms/{name}/migrate", post(vms::migrate))
        .route("/v1/broker", post(broker::broker))
        .route(otherix_proto::relay::PATH, get(crate::relay::relay))
        .route("/v1/grants", get(grants::list).post(grants::create))
        .route("/v1/grants/{name}", get(grants::get))
        .route("/v1/grants/{name}/revoke", post(grants::revoke))
        .route("/v1/audit", get(audit::list))
        .route("/v1/sessions", get(sessions::list))
        .route("/v1/lbs", get(lbs::list).post(lbs::create))
        .route(
            "/v1/lbs/{name}",
            get(lbs::get).patch(lbs::update).delete(lbs::delete),
        )
        .route("/v1/join-tokens", post(nodes::create_join_token))
        .route("/v1/agent/enroll", post(nodes::enroll))
        // Heartbeats carry a gateway's session reports: more than a request.
        .route(
            "/v1/agent/heartbeat",
            post(nodes::heartbeat).layer(DefaultBodyLimit::max(HEARTBEAT_MAX_BODY)),
        )
        .route("/v1/agent/certificate", post(nodes::certificate))
        .route("/v1/agent/desired/wait", get(wake::wait))
        .route("/v1/nodes", get(nodes::list))
        .route(
            "/v1/nodes/{name}",
            get(nodes::get).patch(nodes::update).delete(nodes::delete),
        )
        .fallback(error::not_found)
        .method_not_allowed_fallback(error::method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(writes)
        .layer(middleware::from_fn(trace_request))
        .with_state(state)
}

/// One span per request, and one line when it is answered.
async fn trace_request(req: Request, next: Next) -> Response {
    let span = tracing::info_span!("request", method = %req.method(), path = %req.uri().path());
    async move {
        let start = Instant::now();
        let resp = next.run(req).await;
        tracing::info!(
            status = resp.status().as_u16(),
            elapsed_ms = start.elapsed().as_millis() as u64,
            "answered"
        );
        resp
    }
    .instrument(span)
    .await
}
