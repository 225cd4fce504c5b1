//! `GET /v1/audit`: the audit trail (admins and viewers).

use axum::extract::State;
use axum::Json;
use otherix_api::{AuditRecord, ErrorBody, Role};
use serde::Deserialize;
use time::{Duration, OffsetDateTime};

use super::{ApiError, ApiQuery, AppState};
use crate::auth::Principal;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only events of the last N seconds (default: one day).
    since_seconds: Option<u64>,
    /// Only this principal (`user:NAME`, `grant:NAME`).
    principal: Option<String>,
    /// Only this target.
    target: Option<String>,
}

#[utoipa::path(get, path = "/v1/audit", tag = "audit", security(("bearer" = [])), params(AuditQuery),
    responses((status = 200, body = Vec<AuditRecord>), (status = 403, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    p: Principal,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> Result<Json<Vec<AuditRecord>>, ApiError> {
    if p.role == Role::User {
        return Err(ApiError::Forbidden(
            "role user may not read the audit trail; ask an admin".into(),
        ));
    }
    let since = Duration::seconds(i64::try_from(q.since_seconds.unwrap_or(86_400)).unwrap_or(i64::MAX / 2));
    let now = OffsetDateTime::now_utc();
    let from = now.checked_sub(since).unwrap_or(OffsetDateTime::UNIX_EPOCH);
    let events = state.store.audit_events(from).await?;
    Ok(Json(
        events
            .into_iter()
            .filter(|e| q.principal.as_ref().is_none_or(|p| &e.principal == p))
            .filter(|e| q.target.as_ref().is_none_or(|t| e.target.as_ref() == Some(t)))
            .collect(),
    ))
}
