//! `GET /v1/audit`: the audit trail (admins and viewers), a page at a time.

use axum::extract::State;
use axum::Json;
use otherix_proto::{AuditCursor, AuditPage, ErrorBody, Role};
use otherix_store::AuditFilter;
use serde::Deserialize;
use time::{Duration, OffsetDateTime};

use super::ApiQuery;
use crate::auth::Principal;
use crate::error::ApiError;
use crate::state::AppState;

/// Events in a page when the caller does not say.
pub const DEFAULT_LIMIT: u32 = 500;
/// Most events in a page.
pub const MAX_LIMIT: u32 = 5000;
/// The longest window asked for: 100 years, far past any audit trail, and
/// well inside the arithmetic of time (the document says so).
const MAX_SINCE_SECONDS: u64 = 3_153_600_000;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Only events of the last N seconds (default: one day; at most 100 years).
    #[param(minimum = 0, maximum = 3153600000.0)]
    since_seconds: Option<u64>,
    /// Only this principal (`user:NAME`, `grant:NAME`).
    principal: Option<String>,
    /// Only this target.
    target: Option<String>,
    /// Events in this page: 1 to 5000 (default 500).
    #[param(minimum = 1, maximum = 5000)]
    limit: Option<u32>,
    /// The `next` of the previous page: events after it.
    #[param(pattern = r"^[0-9]{1,15}\.[0-9]{1,19}$")]
    after: Option<String>,
}

#[utoipa::path(get, path = "/v1/audit", operation_id = "listAudit", tag = "audit", security(("bearer" = [])), params(AuditQuery),
    responses((status = 200, body = AuditPage), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    p: Principal,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> Result<Json<AuditPage>, ApiError> {
    if p.role == Role::User {
        return Err(ApiError::Forbidden(
            "role user may not read the audit trail; ask an admin".into(),
        ));
    }
    let limit = q.limit.unwrap_or(DEFAULT_LIMIT);
    if !(1..=MAX_LIMIT).contains(&limit) {
        return Err(ApiError::Invalid(format!(
            "limit {limit} is out of range: 1 to {MAX_LIMIT} events a page"
        )));
    }
    let after = q
        .after
        .as_deref()
        .map(str::parse::<AuditCursor>)
        .transpose()
        .map_err(|e| ApiError::Invalid(e.to_string()))?;
    let since_seconds = q.since_seconds.unwrap_or(86_400);
    if since_seconds > MAX_SINCE_SECONDS {
        return Err(ApiError::Invalid(format!(
            "since_seconds {since_seconds} is out of range: at most {MAX_SINCE_SECONDS} (100 years)"
        )));
    }
    // In range of i64 by the check above.
    let since = Duration::seconds(since_seconds as i64);
    let now = OffsetDateTime::now_utc();
    let since = AuditCursor::at_or_after(now.checked_sub(since).unwrap_or(OffsetDateTime::UNIX_EPOCH));
    // Whichever is later: the window, or where the previous page ended.
    let from = after.map_or(since, |a| a.max(since));
    let filter = AuditFilter {
        principal: q.principal.as_deref(),
        target: q.target.as_deref(),
    };
    let (events, next) = state.store.audit_page(from, &filter, limit).await?;
    Ok(Json(AuditPage {
        events,
        next: next.map(|c| c.to_string()),
    }))
}
