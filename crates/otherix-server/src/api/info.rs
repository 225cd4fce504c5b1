//! Who the server is, and who the caller is.

use axum::extract::State;
use axum::Json;
use otherix_proto::{ServerInfo, WhoAmI};

use crate::auth::Caller;
use crate::state::AppState;

/// Cluster identity and CA fingerprint. No authentication: a client needs it
/// before it has anything to authenticate with.
#[utoipa::path(get, path = "/v1/info", operation_id = "getInfo", tag = "meta", responses((status = 200, body = ServerInfo)))]
pub async fn info(State(state): State<AppState>) -> Json<ServerInfo> {
    Json((*state.info).clone())
}

/// Liveness: the process answers. No authentication.
#[utoipa::path(get, path = "/healthz", operation_id = "healthz", tag = "meta", responses((status = 200, body = String)))]
pub async fn healthz() -> &'static str {
    "ok\n"
}

/// Readiness: the store answers and a session key is loaded. No
/// authentication; the reason, when not ready, is one line.
#[utoipa::path(get, path = "/readyz", operation_id = "readyz", tag = "meta", responses((status = 200, body = String), (status = 503, body = String)))]
pub async fn readyz(State(state): State<AppState>) -> (axum::http::StatusCode, String) {
    match crate::health::readiness(&state).await {
        Ok(()) => (axum::http::StatusCode::OK, "ready\n".into()),
        Err(reason) => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: {reason}\n"),
        ),
    }
}

#[utoipa::path(get, path = "/v1/whoami", operation_id = "whoami", tag = "meta", security(("bearer" = [])),
    responses((status = 200, body = WhoAmI), (status = 401, body = otherix_proto::ErrorBody)))]
pub async fn whoami(caller: Caller) -> Json<WhoAmI> {
    Json(match caller {
        Caller::User(p) => WhoAmI {
            principal: p.id(),
            name: p.name,
            role: Some(p.role),
            max_connections: None,
        },
        Caller::Grant(g) => WhoAmI {
            principal: format!("grant:{}", g.name),
            name: g.name,
            role: None,
            max_connections: g.max_connections,
        },
    })
}
