//! The HTTP API under `/v1/`: routing, shared state, and the one place where
//! errors become HTTP statuses.

mod audit;
pub(crate) mod broker;
mod drain;
mod extract;
mod grants;
mod info;
mod keys;
mod lbs;
mod networks;
pub(crate) mod nodes;
pub mod openapi;
mod sessions;
mod users;
mod vms;
pub mod wake;

use std::time::Instant;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, patch, post};
use axum::Router;
use tracing::Instrument;

pub use extract::{ApiJson, ApiPath, ApiQuery, Body};

/// Largest request body the API reads; everything it takes is small JSON.
pub const MAX_BODY: usize = 64 * 1024;
/// Largest heartbeat body: up to `MAX_SESSION_EVENTS` session reports, and
/// the whole set of a node's LB verdicts when it sends them all (about
/// 200 bytes each). Read only from a caller holding a node certificate.
pub const HEARTBEAT_MAX_BODY: usize = 8 * 1024 * 1024;
/// Largest VM batch body: 1,000 creates of about 2 KiB at most each (an
/// admin's, read after the token is checked).
pub const VM_BATCH_MAX_BODY: usize = 2 * 1024 * 1024;

/// The body limit in force for a request, as its 413 answer names it.
#[derive(Debug, Clone, Copy)]
pub struct BodyLimit(pub usize);

/// The whole API as a router, so tests can drive it without a socket.
pub fn router(state: crate::state::AppState) -> Router {
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
        // A batch body is larger than other requests: up to 1,000 VMs.
        .route(
            "/v1/vm-batches",
            post(vms::create_batch)
                .layer::<_, std::convert::Infallible>(DefaultBodyLimit::max(VM_BATCH_MAX_BODY))
                .layer::<_, std::convert::Infallible>(axum::Extension(BodyLimit(VM_BATCH_MAX_BODY))),
        )
        .route("/v1/vms/{name}", get(vms::get).delete(vms::delete))
        .route("/v1/vms/{name}/labels", patch(vms::label))
        .route("/v1/vms/{name}/migrate", post(vms::migrate))
        .route("/v1/vms/{name}/console", post(broker::console))
        .route("/v1/broker", post(broker::broker))
        .route(otherix_proto::relay::PATH, get(crate::relay::relay))
        .route("/v1/grants", get(grants::list).post(grants::create))
        .route("/v1/grants/{name}", get(grants::get))
        .route("/v1/grants/{name}/revoke", post(grants::revoke))
        .route("/v1/audit", get(audit::list))
        .route("/v1/keys", get(keys::list))
        .route("/v1/keys/rotate", post(keys::rotate))
        .route("/v1/sessions", get(sessions::list))
        .route("/v1/sessions/{id}/end", post(sessions::end))
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
            post(nodes::heartbeat)
                .layer::<_, std::convert::Infallible>(DefaultBodyLimit::max(HEARTBEAT_MAX_BODY))
                .layer::<_, std::convert::Infallible>(axum::Extension(BodyLimit(HEARTBEAT_MAX_BODY))),
        )
        .route("/v1/agent/certificate", post(nodes::certificate))
        .route("/v1/agent/desired/wait", get(wake::wait))
        .route("/v1/nodes", get(nodes::list))
        .route(
            "/v1/nodes/{name}",
            get(nodes::get).patch(nodes::update).delete(nodes::delete),
        )
        .merge(crate::console::router())
        .fallback(crate::error::not_found)
        .method_not_allowed_fallback(crate::error::method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::Extension(BodyLimit(MAX_BODY)))
        .layer(middleware::from_fn_with_state(state.clone(), around))
        .with_state(state)
}

/// What every request goes through, outermost first, in one layer (four
/// layers of their own cost each request a boxed service clone, a boxed
/// future and its moves: ~5 % of the broker's CPU per credential):
///
/// 1. one span per request, and one line when it is answered ([`answered`]);
/// 2. a body left unread is drained before the answer goes out
///    ([`drain`]), so that a refusal reaches a client still sending;
/// 3. while this replica is fenced, everything but the health endpoints is
///    refused ([`fenced`]);
/// 4. a write that may have changed the store catches the catalog up
///    before it is answered ([`wake::catch_up_after`]).
async fn around(State(state): State<crate::state::AppState>, req: Request, next: Next) -> Response {
    let broker = req.uri().path() == "/v1/broker";
    // The broker's span is at debug: at info, making it (its fields
    // formatted into a string, whether or not a line is written in it) cost
    // ~1.5 % of the CP's CPU per credential, and the broker's own lines at
    // info (a refusal, a load balancer's pick) and the `answered` line of a
    // refusal name what the span would.
    let span = if broker {
        tracing::debug_span!("request", method = %req.method(), path = %req.uri().path())
    } else {
        tracing::info_span!("request", method = %req.method(), path = %req.uri().path())
    };
    async move {
        let start = Instant::now();
        let (req, returned) = drain::returning(req);
        let resp = match fenced(&state, &req) {
            Some(refused) => {
                drop(req);
                refused
            }
            None => {
                let writes = wake::may_change_catalog(req.method(), req.uri().path());
                let resp = next.run(req).await;
                wake::catch_up_after(&state, writes, resp.status()).await;
                resp
            }
        };
        drain::drain_unread(returned).await;
        answered(broker, resp.status(), start.elapsed());
        resp
    }
    .instrument(span)
    .await
}

/// While this replica is fenced (cut off from its store long enough that
/// the others took it for stopped), every call but the health endpoints
/// is answered 503 `replica_unavailable` before anything is done: clients
/// and agents that know other replicas send it there instead.
fn fenced(state: &crate::state::AppState, req: &Request) -> Option<Response> {
    let health = matches!(req.uri().path(), "/healthz" | "/readyz");
    if state.fenced.load(std::sync::atomic::Ordering::Relaxed) && !health {
        return Some(
            crate::error::ApiError::Unavailable {
                code: otherix_proto::REPLICA_UNAVAILABLE,
                message: "this control plane replica has lost its database; use another replica".into(),
            }
            .into_response(),
        );
    }
    None
}

/// The request's line when it is answered, at info; at debug for a
/// credential brokered, which its audit row records (and the info log
/// counts, see [`crate::brokered`]) — two lines per credential were ~2.5 %
/// of the broker's CPU. A broker call's span is at debug, so its refusal's
/// line names the path itself.
fn answered(broker: bool, status: http::StatusCode, elapsed: std::time::Duration) {
    let elapsed_ms = elapsed.as_millis() as u64;
    if broker && status.is_success() {
        tracing::debug!(status = status.as_u16(), elapsed_ms, "answered");
    } else if broker {
        tracing::info!(
            path = %"/v1/broker",
            status = status.as_u16(),
            elapsed_ms,
            "answered"
        );
    } else {
        tracing::info!(status = status.as_u16(), elapsed_ms, "answered");
    }
}
