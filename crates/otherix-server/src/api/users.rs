//! Users, API tokens and access rules. All of it is admin-only.

use std::collections::BTreeSet;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use otherix_core::names::validate_name;
use otherix_core::selector::Selector;
use otherix_proto::{
    AllowRequest, CreateTokenRequest, CreateUserRequest, CreatedToken, ErrorBody, Role, User,
};
use time::OffsetDateTime;

use super::{ApiPath, Body};
use crate::auth::Principal;
use crate::authorize::Rule;
use crate::error::ApiError;
use crate::state::AppState;
use crate::tokens::new_token;

#[utoipa::path(get, path = "/v1/users", operation_id = "listUsers", tag = "users", security(("bearer" = [])),
    responses((status = 200, body = Vec<User>), (status = 403, body = ErrorBody)))]
pub async fn list(State(state): State<AppState>, p: Principal) -> Result<Json<Vec<User>>, ApiError> {
    p.require_admin("list users")?;
    Ok(Json(
        state.store.users().await?.into_iter().map(flagged).collect(),
    ))
}

#[utoipa::path(post, path = "/v1/users", operation_id = "createUser", tag = "users", security(("bearer" = [])), request_body = CreateUserRequest,
    responses((status = 201, body = User), (status = 409, body = ErrorBody)))]
pub async fn create(
    State(state): State<AppState>,
    p: Principal,
    body: Body<CreateUserRequest>,
) -> Result<(StatusCode, Json<User>), ApiError> {
    p.require_admin("create users")?;
    let req = body.read()?;
    validate_name(&req.name).map_err(|e| ApiError::Invalid(format!("invalid user name: {e}")))?;
    let user = state
        .store
        .create_user(&req.name, req.role, OffsetDateTime::now_utc())
        .await?;
    tracing::info!(user = %user.name, role = %user.role, by = %p.name, "user created");
    Ok((StatusCode::CREATED, Json(user)))
}

#[utoipa::path(get, path = "/v1/users/{name}", operation_id = "getUser", tag = "users", security(("bearer" = [])),
    responses((status = 200, body = User), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<User>, ApiError> {
    p.require_admin("read users")?;
    Ok(Json(flagged(state.store.user(&name).await?)))
}

#[utoipa::path(delete, path = "/v1/users/{name}", operation_id = "deleteUser", tag = "users", security(("bearer" = [])),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("delete users")?;
    let before = crate::revoke::stamp(OffsetDateTime::now_utc());
    let principal = format!("user:{name}");
    let revoked = [crate::revoke::all_of(principal.clone(), before)];
    state
        .store
        .delete_user(&name, crate::revoke::recording(&state, &revoked, before))
        .await?;
    crate::revoke::enforce(&state, p.id(), "user deleted", &principal, &revoked).await;
    Ok(StatusCode::NO_CONTENT)
}

/// Mints an API token, living `ttl_seconds` or the server's `--token-ttl`.
/// The secret is in this answer only.
#[utoipa::path(post, path = "/v1/users/{name}/tokens", operation_id = "createUserToken", tag = "users", security(("bearer" = [])),
    request_body = CreateTokenRequest,
    responses((status = 201, body = CreatedToken), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn create_token(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    body: Body<CreateTokenRequest>,
) -> Result<(StatusCode, Json<CreatedToken>), ApiError> {
    p.require_admin("create tokens")?;
    let req = body.read()?;
    let ttl = match req.ttl_seconds {
        None => state.settings.token_ttl,
        Some(s) => i64::try_from(s)
            .ok()
            .map(time::Duration::seconds)
            .filter(|d| d.is_positive() && *d <= crate::state::MAX_TOKEN_TTL)
            .ok_or_else(|| {
                ApiError::Invalid(format!(
                    "ttl_seconds must be 1 to {} (ten years)",
                    crate::state::MAX_TOKEN_TTL.whole_seconds()
                ))
            })?,
    };
    let now = OffsetDateTime::now_utc();
    let expires_at = now + ttl;
    let t = new_token();
    state
        .store
        .create_token(&name, &t.id, &t.secret_hash, now, Some(expires_at))
        .await?;
    tracing::info!(user = %name, token_id = %t.id, by = %p.name, %expires_at, "token created");
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            id: t.id,
            user: name,
            token: t.token,
            expires_at: Some(expires_at),
        }),
    ))
}

#[utoipa::path(delete, path = "/v1/users/{name}/tokens/{id}", operation_id = "revokeUserToken", tag = "users", security(("bearer" = [])),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn revoke_token(
    State(state): State<AppState>,
    p: Principal,
    ApiPath((name, id)): ApiPath<(String, String)>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("revoke tokens")?;
    let before = crate::revoke::stamp(OffsetDateTime::now_utc());
    let revoked = [crate::revoke::token_of(&name, &id, before)];
    state
        .store
        .revoke_token(&name, &id, crate::revoke::recording(&state, &revoked, before))
        .await?;
    let subject = format!("user:{name} token {id}");
    crate::revoke::enforce(&state, p.id(), "token revoked", &subject, &revoked).await;
    Ok(StatusCode::NO_CONTENT)
}

/// `user` with each rule that allows nothing flagged, with why
/// ([`Rule::why_inert`]): so that an admin sees which stored rules to
/// replace.
fn flagged(mut user: User) -> User {
    for rule in &mut user.rules {
        rule.inert = Rule::why_inert(rule);
    }
    user
}

/// Adds an access rule: the user may broker to VMs matching the selector, on
/// these ports. The selector must require a label (`k=v`, `k in (...)`,
/// `k`): one made only of `!=`, `notin` and `!k` (or empty) would admit
/// every VM created without labels.
#[utoipa::path(post, path = "/v1/users/{name}/rules", operation_id = "addUserRule", tag = "users", security(("bearer" = [])), request_body = AllowRequest,
    responses((status = 201, body = User), (status = 400, body = ErrorBody)))]
pub async fn allow(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    body: Body<AllowRequest>,
) -> Result<(StatusCode, Json<User>), ApiError> {
    p.require_admin("change access rules")?;
    let req = body.read()?;
    let selector: Selector = req
        .selector
        .parse()
        .map_err(|e| ApiError::Invalid(format!("{e}")))?;
    if let Err(e) = selector.require_label() {
        metrics::counter!("otherix_access_rules_refused_total", "reason" => "requires_no_label").increment(1);
        return Err(ApiError::Rejected {
            code: "rule_requires_no_label",
            message: format!(
                "a rule must require at least one label: {e}; add a label the VMs must carry, \
                 e.g. `team=web{}`",
                if selector.is_empty() {
                    String::new()
                } else {
                    format!(",{selector}")
                }
            ),
        });
    }
    if req.ports.is_empty() {
        return Err(ApiError::Invalid("an access rule needs at least one port".into()));
    }
    let ports: Vec<u16> = req
        .ports
        .iter()
        .copied()
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let user = state.store.user(&name).await?;
    if user.role != Role::User {
        return Err(ApiError::Invalid(format!(
            "access rules apply to role user; {name:?} has role {}",
            user.role
        )));
    }
    let user = state
        .store
        .add_rule(&name, &selector.to_string(), &ports, OffsetDateTime::now_utc())
        .await?;
    tracing::info!(user = %name, selector = %selector, ?ports, by = %p.name, "access rule added");
    Ok((StatusCode::CREATED, Json(flagged(user))))
}

#[utoipa::path(delete, path = "/v1/users/{name}/rules/{id}", operation_id = "removeUserRule", tag = "users", security(("bearer" = [])),
    params(("name" = String, Path, description = "The user's name."), ("id" = i64, Path, description = "The rule's id (`user get`).")),
    responses((status = 204), (status = 404, body = ErrorBody)))]
pub async fn disallow(
    State(state): State<AppState>,
    p: Principal,
    ApiPath((name, id)): ApiPath<(String, String)>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("change access rules")?;
    // Read after the role check, as bodies are: a viewer is told it may not.
    let id: i64 = id
        .parse()
        .map_err(|_| ApiError::Invalid(format!("invalid rule id {id:?}: expected an integer")))?;
    let before = crate::revoke::stamp(OffsetDateTime::now_utc());
    let rules = state.store.rules(&name).await?;
    let Some(removed) = rules.iter().find(|r| r.id == id) else {
        return Err(otherix_store::StoreError::NotFound {
            kind: "rule",
            name: id.to_string(),
        }
        .into());
    };
    let remaining: Vec<_> = rules.iter().filter(|r| r.id != id).cloned().collect();
    let vms = state.store.vms().await?;
    let revoked = crate::revoke::rule_removal(&name, removed, &remaining, &vms, before);
    state
        .store
        .remove_rule(&name, id, crate::revoke::recording(&state, &revoked, before))
        .await?;
    let subject = format!(
        "user:{name} rule {id} ({} on {:?})",
        removed.selector, removed.ports
    );
    crate::revoke::enforce(&state, p.id(), "access rule removed", &subject, &revoked).await;
    Ok(StatusCode::NO_CONTENT)
}
