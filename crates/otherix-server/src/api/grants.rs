//! External grants (admin): one bearer token for a fixed list of targets,
//! shown once, stored hashed, never widened. A VM target is bound to the
//! VM's id at creation, so the grant never reaches another VM created later
//! under the same name.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use otherix_core::names::validate_name;
use otherix_proto::{CreateGrantRequest, CreatedGrant, ErrorBody, Grant, GrantState};
use otherix_store::{GrantRecord, NewGrant};
use time::{Duration, OffsetDateTime};

use super::{ApiPath, Body};
use crate::auth::Principal;
use crate::error::ApiError;
use crate::state::AppState;
use crate::tokens::{new_token_with, GRANT_PREFIX};

const MAX_TARGETS: usize = 64;
const MAX_TTL: Duration = Duration::days(366);

fn to_api(g: GrantRecord, now: OffsetDateTime) -> Grant {
    let state = if g.revoked_at.is_some() {
        GrantState::Revoked
    } else if g.expires_at <= now {
        GrantState::Expired
    } else if g.max_connections.is_some_and(|m| g.connections >= m) {
        GrantState::Exhausted
    } else {
        GrantState::Active
    };
    Grant {
        name: g.name,
        id: g.id,
        targets: g.targets,
        created_by: g.created_by,
        created_at: g.created_at,
        expires_at: g.expires_at,
        last_used_at: g.last_used_at,
        max_connections: g.max_connections,
        connections: g.connections,
        state,
    }
}

#[utoipa::path(post, path = "/v1/grants", operation_id = "createGrant", tag = "grants", security(("bearer" = [])), request_body = CreateGrantRequest,
    responses((status = 201, body = CreatedGrant), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    p: Principal,
    body: Body<CreateGrantRequest>,
) -> Result<(StatusCode, Json<CreatedGrant>), ApiError> {
    p.require_admin("create grants")?;
    let req = body.read()?;
    if req.targets.is_empty() {
        return Err(ApiError::Invalid(
            "a grant needs at least one target (--target VM:PORT)".into(),
        ));
    }
    if req.targets.len() > MAX_TARGETS {
        return Err(ApiError::Invalid(format!(
            "at most {MAX_TARGETS} targets per grant"
        )));
    }
    let mut targets = req.targets.clone();
    for t in &mut targets {
        if t.port == 0 {
            return Err(ApiError::Invalid(format!(
                "target {t}: port 0 is not a valid port"
            )));
        }
        match t.target.strip_prefix("lb/") {
            Some(lb) => {
                validate_name(lb).map_err(|e| ApiError::Invalid(format!("target {t}: {e}")))?;
                // An LB's pool is whatever its selector matches now, by design.
                if t.vm_id.is_some() {
                    return Err(ApiError::Invalid(format!(
                        "target {t}: a load balancer target takes no vm_id"
                    )));
                }
            }
            None => {
                validate_name(&t.target).map_err(|e| ApiError::Invalid(format!("target {t}: {e}")))?;
                // Catches typos now rather than at the third party's first
                // try, and binds the target to this VM: one deleted and
                // re-created under the name later is not reached.
                let vm = state.store.vm(&t.target).await?;
                if let Some(pinned) = t.vm_id.as_deref().filter(|id| *id != vm.id) {
                    return Err(ApiError::Conflict {
                        code: "vm_replaced",
                        message: format!("target {t}: {} is VM {} now, not {pinned}", vm.name, vm.id),
                    });
                }
                t.vm_id = Some(vm.id);
            }
        }
    }
    if req.ttl_seconds == 0 {
        return Err(ApiError::Invalid("ttl must be positive".into()));
    }
    let ttl = Duration::seconds(
        i64::try_from(req.ttl_seconds)
            .unwrap_or(i64::MAX)
            .min(MAX_TTL.whole_seconds()),
    );
    if req.max_connections == Some(0) {
        return Err(ApiError::Invalid("max connections must be at least 1".into()));
    }
    let now = OffsetDateTime::now_utc();
    let t = new_token_with(GRANT_PREFIX);
    targets.sort_by(|a, b| (&a.target, a.port).cmp(&(&b.target, b.port)));
    targets.dedup();
    let record = state
        .store
        .create_grant(
            &NewGrant {
                id: t.id.clone(),
                name: req.name.to_string(),
                targets,
                created_by: p.id(),
                expires_at: now + ttl,
                max_connections: req.max_connections,
            },
            &t.secret_hash,
            now,
        )
        .await?;
    tracing::info!(grant = %record.name, by = %p.name, targets = record.targets.len(), "grant created");
    Ok((
        StatusCode::CREATED,
        Json(CreatedGrant {
            grant: to_api(record, now),
            token: t.token,
        }),
    ))
}

#[utoipa::path(get, path = "/v1/grants", operation_id = "listGrants", tag = "grants", security(("bearer" = [])),
    responses((status = 200, body = Vec<Grant>)))]
pub async fn list(State(state): State<AppState>, p: Principal) -> Result<Json<Vec<Grant>>, ApiError> {
    p.require_admin("list grants")?;
    let now = OffsetDateTime::now_utc();
    Ok(Json(
        state
            .store
            .grants()
            .await?
            .into_iter()
            .map(|g| to_api(g, now))
            .collect(),
    ))
}

#[utoipa::path(get, path = "/v1/grants/{name}", operation_id = "getGrant", tag = "grants", security(("bearer" = [])),
    responses((status = 200, body = Grant), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Grant>, ApiError> {
    p.require_admin("read grants")?;
    Ok(Json(to_api(
        state.store.grant(&name).await?,
        OffsetDateTime::now_utc(),
    )))
}

/// Revokes a grant: new connections are refused at once, and its open
/// sessions end (reason `revoked`) within a heartbeat. Kept for the audit trail.
#[utoipa::path(post, path = "/v1/grants/{name}/revoke", operation_id = "revokeGrant", tag = "grants", security(("bearer" = [])),
    responses((status = 200, body = Grant), (status = 404, body = ErrorBody)))]
pub async fn revoke(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Grant>, ApiError> {
    p.require_admin("revoke grants")?;
    let now = OffsetDateTime::now_utc();
    let before = crate::revoke::stamp(now);
    let principal = format!("grant:{name}");
    let revoked = [crate::revoke::all_of(principal.clone(), before)];
    let g = state
        .store
        .revoke_grant(&name, now, crate::revoke::recording(&state, &revoked, before))
        .await?;
    crate::revoke::enforce(&state, p.id(), "grant revoked", &principal, &revoked).await;
    Ok(Json(to_api(g, now)))
}
