//! Who is calling: the bearer token of a request, authenticated into a
//! [`Principal`] (a user) or a [`Caller`] (a user or an external grant).

use axum::extract::FromRequestParts;
use http::request::Parts;
use otherix_proto::Role;
use time::OffsetDateTime;

use crate::error::ApiError;
use crate::state::AppState;
use crate::tokens::{secret_matches, split_token, split_token_with, GRANT_PREFIX};

/// Who is calling: authenticated from the bearer token.
#[derive(Debug, Clone)]
pub struct Principal {
    pub name: String,
    pub role: Role,
    /// The id of the API token presented (public): the broker writes it into
    /// credentials, so that revoking the token revokes them.
    pub token_id: String,
}

impl Principal {
    /// `user:<name>`, as written into audit records and credentials.
    pub fn id(&self) -> String {
        format!("user:{}", self.name)
    }

    /// Refuses unless the caller is an admin; `action` completes
    /// "role viewer may not ...".
    pub fn require_admin(&self, action: &str) -> Result<(), ApiError> {
        if self.role == Role::Admin {
            Ok(())
        } else {
            Err(ApiError::Forbidden(format!(
                "role {} may not {action}; ask an admin",
                self.role
            )))
        }
    }
}

/// How often `last_used_at` is written: once a minute is plenty for people,
/// and keeps reads from turning into writes.
const TOUCH_EVERY: time::Duration = time::Duration::seconds(60);

/// A grant holder: may broker to exactly the grant's targets, nothing else.
#[derive(Debug, Clone)]
pub struct GrantCaller {
    pub id: String,
    pub name: String,
    /// No credential minted for the grant outlives it.
    pub expires_at: OffsetDateTime,
    /// Its connection budget, if it has one (`--max-connections`).
    pub max_connections: Option<u32>,
}

/// Whoever presented a valid bearer secret: a user (API token) or a grant.
#[derive(Debug, Clone)]
pub enum Caller {
    User(Principal),
    Grant(GrantCaller),
}

impl Caller {
    /// `user:NAME` or `grant:NAME`, as audited and written into credentials.
    pub fn id(&self) -> String {
        match self {
            Caller::User(p) => p.id(),
            Caller::Grant(g) => format!("grant:{}", g.name),
        }
    }
}

fn bearer(parts: &Parts) -> Result<&str, ApiError> {
    bearer_of(&parts.headers)
}

fn bearer_of(headers: &http::HeaderMap) -> Result<&str, ApiError> {
    let header = headers.get(http::header::AUTHORIZATION).ok_or_else(|| {
        ApiError::Unauthenticated("missing bearer token (Authorization: Bearer ...)".into())
    })?;
    let value = header
        .to_str()
        .map_err(|_| ApiError::Unauthenticated("malformed Authorization header".into()))?;
    Ok(value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .ok_or_else(|| ApiError::Unauthenticated("the Authorization header must be `Bearer <token>`".into()))?
        .trim())
}

/// The user whose API token `token` is (the secret checked).
pub(crate) async fn authenticate_user(state: &AppState, token: &str) -> Result<Principal, ApiError> {
    let invalid = || ApiError::Unauthenticated("invalid or revoked API token".into());
    let (id, secret) = split_token(token).ok_or_else(invalid)?;
    let record = token_record(state, id).await.ok_or_else(invalid)?;
    if !secret_matches(secret, &record.secret_hash) {
        return Err(invalid());
    }
    user_of(state, record).await
}

/// The user of the API token with this id, if it is still valid: what a
/// web console session (opened with the token's secret) is, request by
/// request. A revoked token is gone from the catalog, so its sessions are.
pub(crate) async fn user_by_token_id(state: &AppState, id: &str) -> Result<Principal, ApiError> {
    let record = token_record(state, id).await.ok_or_else(|| {
        ApiError::Unauthenticated(
            "the API token this console session was opened with is revoked; sign in again".into(),
        )
    })?;
    user_of(state, record).await
}

async fn token_record(state: &AppState, id: &str) -> Option<otherix_store::TokenRecord> {
    let found = state.catalog.read().token(id).cloned();
    match found {
        Some(record) => Some(record),
        None => {
            // Made through another replica a moment ago?
            state.catalog.caught_up_since(std::time::Instant::now()).await;
            state.catalog.read().token(id).cloned()
        }
    }
}

/// The user a valid token stands for: refused once it has expired.
async fn user_of(state: &AppState, record: otherix_store::TokenRecord) -> Result<Principal, ApiError> {
    let id = record.id.as_str();
    let now = OffsetDateTime::now_utc();
    // Said only to the holder of the secret: a stranger learns nothing.
    if let Some(expired) = record.expires_at.filter(|at| *at <= now) {
        return Err(ApiError::CredentialRefused {
            code: "token_expired",
            message: format!("API token {id} of user {:?} expired at {expired}", record.user),
        });
    }
    if record.last_used_at.is_none_or(|t| now - t > TOUCH_EVERY) {
        // Bookkeeping only: a failure here must not refuse the request.
        if let Err(e) = state.store.touch_token(id, now).await {
            tracing::warn!(token_id = id, error = %e, "could not record token use");
        }
        // Not in the change log: the catalog keeps it as this process saw it.
        state.catalog.token_used(id, now);
    }
    Ok(Principal {
        name: record.user,
        role: record.role,
        token_id: record.id,
    })
}

/// The grant `token` is (the secret checked).
pub(crate) async fn authenticate_grant(state: &AppState, token: &str) -> Result<GrantCaller, ApiError> {
    let invalid = || ApiError::Unauthenticated("invalid grant token".into());
    let (id, secret) = split_token_with(GRANT_PREFIX, token).ok_or_else(invalid)?;
    let grant = grant_record(state, id).await.ok_or_else(invalid)?;
    if !secret_matches(secret, &grant.secret_hash) {
        return Err(invalid());
    }
    grant_of(grant)
}

/// The grant with this id, if it is still valid (a console session's).
pub(crate) async fn grant_by_id(state: &AppState, id: &str) -> Result<GrantCaller, ApiError> {
    let grant = grant_record(state, id)
        .await
        .ok_or_else(|| ApiError::Unauthenticated("invalid grant".into()))?;
    grant_of(grant)
}

async fn grant_record(state: &AppState, id: &str) -> Option<otherix_store::GrantRecord> {
    let found = state.catalog.read().grant(id).cloned();
    match found {
        Some(grant) => Some(grant),
        None => {
            state.catalog.caught_up_since(std::time::Instant::now()).await;
            state.catalog.read().grant(id).cloned()
        }
    }
}

/// The caller a grant stands for: refused once revoked or expired.
fn grant_of(grant: otherix_store::GrantRecord) -> Result<GrantCaller, ApiError> {
    if grant.revoked_at.is_some() {
        return Err(ApiError::CredentialRefused {
            code: "grant_revoked",
            message: format!("grant {:?} was revoked", grant.name),
        });
    }
    if grant.expires_at <= OffsetDateTime::now_utc() {
        return Err(ApiError::CredentialRefused {
            code: "grant_expired",
            message: format!("grant {:?} has expired", grant.name),
        });
    }
    Ok(GrantCaller {
        id: grant.id,
        name: grant.name,
        expires_at: grant.expires_at,
        max_connections: grant.max_connections,
    })
}

impl Caller {
    /// The caller of a request with `headers`: its bearer token, a user's
    /// API token or a grant's, authenticated (as every endpoint does).
    pub async fn of_headers(state: &AppState, headers: &http::HeaderMap) -> Result<Caller, ApiError> {
        let token = bearer_of(headers)?;
        if token.starts_with(GRANT_PREFIX) {
            Ok(Caller::Grant(authenticate_grant(state, token).await?))
        } else {
            Ok(Caller::User(authenticate_user(state, token).await?))
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        // A browser's web console session, when no bearer token is sent.
        if parts.headers.get(http::header::AUTHORIZATION).is_none() {
            if let Some(cookie) = crate::console::session::cookie_value(&parts.headers) {
                return crate::console::caller_of_cookie(parts, state, cookie).await;
            }
        }
        bearer(parts)?;
        Caller::of_headers(state, &parts.headers).await
    }
}

/// Every endpoint but brokering takes a user; a grant is refused there.
impl FromRequestParts<AppState> for Principal {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        match Caller::from_request_parts(parts, state).await? {
            Caller::User(p) => Ok(p),
            Caller::Grant(g) => Err(ApiError::Forbidden(format!(
                "grant {:?} may only broker connections to its targets",
                g.name
            ))),
        }
    }
}
