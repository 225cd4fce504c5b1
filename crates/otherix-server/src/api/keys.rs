//! Session signing keys: list them (admin, viewer) and rotate now (admin).
//! The schedule, signing and publishing are [`crate::keys`]; this only
//! answers and audits.

use axum::extract::State;
use axum::Json;
use otherix_proto::{AuditAction, ErrorBody, KeyRotation, KeyState, Role, SessionKeyInfo};
use otherix_store::AuditEvent;
use time::OffsetDateTime;

use crate::auth::Principal;
use crate::error::ApiError;
use crate::keys::{KeyStatus, Phase};
use crate::state::AppState;

fn to_api(k: KeyStatus) -> SessionKeyInfo {
    SessionKeyInfo {
        kid: k.kid,
        created_at: k.made,
        signs_from: k.signs_from,
        state: match k.phase {
            Phase::Next => KeyState::Next,
            Phase::Current => KeyState::Current,
            Phase::Previous => KeyState::Previous,
            Phase::Retired => KeyState::Retired,
        },
        expires_at: k.not_after,
    }
}

/// Every stored key, newest first: public facts only.
#[utoipa::path(get, path = "/v1/keys", operation_id = "listKeys", tag = "keys", security(("bearer" = [])),
    responses((status = 200, body = Vec<SessionKeyInfo>), (status = 403, body = ErrorBody)))]
pub async fn list(
    State(state): State<AppState>,
    p: Principal,
) -> Result<Json<Vec<SessionKeyInfo>>, ApiError> {
    if p.role == Role::User {
        return Err(ApiError::Forbidden(
            "role user may not list session keys; ask an admin".into(),
        ));
    }
    let now = OffsetDateTime::now_utc();
    Ok(Json(state.keys.status(now).into_iter().map(to_api).collect()))
}

/// Makes a new session signing key now: published at once (every replica
/// reloads it from the change log and wakes its gateways), it signs a few
/// seconds later, and the answer comes once it does. The key that signed
/// before is retired when its last credential has expired.
#[utoipa::path(post, path = "/v1/keys/rotate", operation_id = "rotateKeys", tag = "keys", security(("bearer" = [])),
    responses((status = 200, body = KeyRotation), (status = 403, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn rotate(State(state): State<AppState>, p: Principal) -> Result<Json<KeyRotation>, ApiError> {
    p.require_admin("rotate session keys")?;
    let now = OffsetDateTime::now_utc();
    let new = state.keys.rotate_now(now).await?;
    // This replica's gateways are woken now rather than at the next change
    // notification; the other replicas' when they read the change log.
    if let Err(e) = state.catalog.sync().await {
        tracing::warn!(error = %e, "catalog did not catch up after a key rotation");
    }
    let retiring: Vec<SessionKeyInfo> = state
        .keys
        .status(new.signs_from)
        .into_iter()
        .filter(|k| k.phase == Phase::Previous)
        .map(to_api)
        .collect();
    tracing::info!(by = %p.name, kid = %new.kid, signs_from = %new.signs_from, "session key rotated");
    audit(&state, p.id(), &new, &retiring).await;
    // Answer once the broker signs with it: "rotated" means it is in use.
    let wait = std::time::Duration::try_from(new.signs_from - OffsetDateTime::now_utc()).unwrap_or_default();
    tokio::time::sleep(wait).await;
    let key = state
        .keys
        .status(OffsetDateTime::now_utc())
        .into_iter()
        .find(|k| k.kid == new.kid)
        .map(to_api)
        .ok_or_else(|| ApiError::Internal(format!("session key {} is gone", new.kid)))?;
    Ok(Json(KeyRotation { key, retiring }))
}

async fn audit(state: &AppState, by: String, new: &KeyStatus, retiring: &[SessionKeyInfo]) {
    let mut detail = format!("signs from {}", rfc3339(new.signs_from));
    for k in retiring {
        if let Some(at) = k.expires_at {
            detail.push_str(&format!("; {} retires at {}", k.kid, rfc3339(at)));
        }
    }
    let event = AuditEvent {
        id: 0,
        at: OffsetDateTime::now_utc(),
        principal: by,
        action: AuditAction::KeyRotate,
        target: Some(new.kid.clone()),
        port: None,
        transport: None,
        node: None,
        allowed: true,
        reason: Some(detail),
        bytes_up: None,
        bytes_down: None,
        duration_ms: None,
        session: None,
    };
    if let Err(e) = state.audit.write(event).await {
        tracing::error!(error = %e, "audit write failed");
    }
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}
