//! Who the server is, and who the caller is.

use axum::extract::State;
use axum::Json;
use otherix_api::{ServerInfo, WhoAmI};

use super::AppState;
use crate::auth::Caller;

/// Cluster identity and CA fingerprint. No authentication: a client needs it
/// before it has anything to authenticate with.
#[utoipa::path(get, path = "/v1/info", tag = "meta", responses((status = 200, body = ServerInfo)))]
pub async fn info(State(state): State<AppState>) -> Json<ServerInfo> {
    Json((*state.info).clone())
}

#[utoipa::path(get, path = "/v1/whoami", tag = "meta", security(("bearer" = [])),
    responses((status = 200, body = WhoAmI), (status = 401, body = otherix_api::ErrorBody)))]
pub async fn whoami(caller: Caller) -> Json<WhoAmI> {
    Json(match caller {
        Caller::User(p) => WhoAmI {
            principal: p.id(),
            name: p.name,
            role: Some(p.role),
        },
        Caller::Grant(g) => WhoAmI {
            principal: format!("grant:{}", g.name),
            name: g.name,
            role: None,
        },
    })
}
