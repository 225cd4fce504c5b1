//! `GET /v1/sessions`: sessions open now, through gateways and the relay.
//! Admins and viewers see every session; a user sees their own.

use axum::extract::State;
use axum::Json;
use otherix_proto::{ErrorBody, OpenSession, Role};
use serde::Deserialize;

use super::ApiQuery;
use crate::auth::Principal;
use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct SessionQuery {
    /// Only this principal (`user:NAME`, `grant:NAME`).
    principal: Option<String>,
    /// Only sessions to this VM.
    target: Option<String>,
    /// Only sessions through this node.
    node: Option<String>,
}

#[utoipa::path(get, path = "/v1/sessions", operation_id = "listSessions", tag = "audit", security(("bearer" = [])), params(SessionQuery),
    responses((status = 200, body = Vec<OpenSession>), (status = 401, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    p: Principal,
    ApiQuery(q): ApiQuery<SessionQuery>,
) -> Result<Json<Vec<OpenSession>>, ApiError> {
    let own = (p.role == Role::User).then(|| p.id());
    let sessions = state.store.open_sessions().await?;
    Ok(Json(
        sessions
            .into_iter()
            .filter(|s| own.as_ref().is_none_or(|me| &s.principal == me))
            .filter(|s| q.principal.as_ref().is_none_or(|p| &s.principal == p))
            .filter(|s| q.target.as_ref().is_none_or(|t| &s.target == t))
            .filter(|s| q.node.as_ref().is_none_or(|n| &s.node == n))
            .collect(),
    ))
}
