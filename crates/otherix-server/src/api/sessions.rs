//! `GET /v1/sessions`: sessions open now, through gateways and the relay.
//! Admins and viewers see every session; a user sees their own.
//! `POST /v1/sessions/{id}/end` (admins): ends one.

use axum::extract::State;
use axum::Json;
use otherix_proto::{ErrorBody, OpenSession, Role};
use otherix_store::SessionFilter;
use serde::Deserialize;

use super::{ApiPath, ApiQuery};
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
    let principal = match (p.role, q.principal) {
        // A user sees their own sessions: asking for another's is asking
        // for none of them.
        (Role::User, Some(other)) if other != p.id() => return Ok(Json(Vec::new())),
        (Role::User, _) => Some(p.id()),
        (_, asked) => asked,
    };
    let filter = SessionFilter {
        principal,
        target: q.target,
        node: q.node,
    };
    Ok(Json(state.store.open_sessions_matching(&filter).await?))
}

/// Ends one open session and no other: its credential alone is revoked (a
/// revocation naming the session's `jti`), so the gateway carrying it ends
/// it within a heartbeat (the relay at once, also one waiting for a
/// resume), reason `ended by an admin`. The principal's other sessions, to
/// the same VM and port too, go on, and it may connect again at once.
/// The entry also names the principal, VM and port: a gateway older than
/// per-session revocations ends every session of those with it (as this
/// call did before), never fewer or more. Audited as a revocation by the
/// admin.
#[utoipa::path(post, path = "/v1/sessions/{id}/end", operation_id = "endSession", tag = "audit", security(("bearer" = [])),
    params(("id" = String, Path, description = "The session's id (`session list -o wide`).")),
    responses((status = 200, body = OpenSession), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn end(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<OpenSession>, ApiError> {
    p.require_admin("end sessions")?;
    let session =
        state.store.open_session(&id).await?.ok_or_else(|| {
            ApiError::NotFound(format!("no open session {id:?}; it may have ended already"))
        })?;
    // A credential names the VM by id: the one the session's target is now
    // (a VM deleted meanwhile took its sessions with it).
    let vm_id = state
        .catalog
        .read()
        .vm_by_name(&session.target)
        .map(|vm| vm.id.clone())
        .ok_or_else(|| ApiError::NotFound(format!("VM {:?} of session {id:?} is gone", session.target)))?;
    let before = crate::revoke::stamp(time::OffsetDateTime::now_utc());
    let entries = [otherix_proto::agent::Revocation {
        principal: session.principal.clone(),
        token: None,
        vm_id: Some(vm_id),
        port: Some(session.port),
        session: Some(session.id.clone()),
        before,
    }];
    state
        .store
        .restamp_revocations(&[], crate::revoke::recording(&state, &entries, before))
        .await?;
    let subject = format!(
        "{} → {}:{} session {}",
        session.principal, session.target, session.port, session.id
    );
    crate::revoke::enforce(&state, p.id(), "session ended", &subject, &entries).await;
    Ok(Json(session))
}
