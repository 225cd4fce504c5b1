//! `ApiError`: every refusal the API makes, and its HTTP status. Handlers
//! return it; this file alone decides what the client sees.

use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use otherix_proto::{ErrorBody, ErrorDetail};
use otherix_store::StoreError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// No, or a bad, credential: the caller must authenticate.
    #[error("{0}")]
    Unauthenticated(String),
    /// A credential that was good and no longer is, with why (`code`):
    /// a grant revoked or past its time. 401 as well; the client's hint
    /// follows the code (no use logging in again).
    #[error("{message}")]
    CredentialRefused { code: &'static str, message: String },
    /// Authenticated, but not allowed to do this.
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    /// The request conflicts with the current state (`code` says how).
    #[error("{message}")]
    Conflict { code: &'static str, message: String },
    /// Nothing can serve the request right now (retry may help).
    #[error("{message}")]
    Unavailable { code: &'static str, message: String },
    /// The caller sent something malformed or invalid.
    #[error("{0}")]
    Invalid(String),
    /// The caller sent something well-formed that the API refuses for a
    /// reason of its own (`code`), e.g. an access rule that requires no label.
    #[error("{message}")]
    Rejected { code: &'static str, message: String },
    /// Authenticated and allowed to ask, but refused for a reason of its own
    /// (`code`), e.g. a grant whose VM was replaced.
    #[error("{message}")]
    Denied { code: &'static str, message: String },
    /// The caller is over a rate limit: retry after `retry_after`.
    #[error("{message}")]
    TooManyRequests {
        /// `rate_limited` or `session_cap`.
        code: &'static str,
        message: String,
        retry_after: std::time::Duration,
    },
    #[error("request body is larger than {0} bytes")]
    PayloadTooLarge(usize),
    /// The client did not send its request in time.
    #[error("{0}")]
    RequestTimeout(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    /// Our fault; details go to the log, not to the client.
    #[error("internal error")]
    Internal(String),
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Unauthenticated(_) | ApiError::CredentialRefused { .. } => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden(_) | ApiError::Denied { .. } => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::AlreadyExists(_) | ApiError::Conflict { .. } => StatusCode::CONFLICT,
            ApiError::Invalid(_) | ApiError::Rejected { .. } => StatusCode::BAD_REQUEST,
            ApiError::TooManyRequests { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::RequestTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ApiError::MethodNotAllowed(_) => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(&self) -> &'static str {
        match self {
            ApiError::Unauthenticated(_) => "unauthenticated",
            ApiError::Forbidden(_) => "forbidden",
            ApiError::NotFound(_) => "not_found",
            ApiError::AlreadyExists(_) => "already_exists",
            ApiError::Conflict { code, .. }
            | ApiError::CredentialRefused { code, .. }
            | ApiError::Unavailable { code, .. }
            | ApiError::Rejected { code, .. }
            | ApiError::Denied { code, .. } => code,
            ApiError::Invalid(_) => "invalid_request",
            ApiError::TooManyRequests { code, .. } => code,
            ApiError::PayloadTooLarge(_) => "payload_too_large",
            ApiError::RequestTimeout(_) => "request_timeout",
            ApiError::UnsupportedMediaType(_) => "unsupported_media_type",
            ApiError::MethodNotAllowed(_) => "method_not_allowed",
            ApiError::Internal(_) => "internal",
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::NotFound { .. } => ApiError::NotFound(e.to_string()),
            StoreError::AlreadyExists { .. } => ApiError::AlreadyExists(e.to_string()),
            StoreError::Conflict(message) => ApiError::Conflict {
                code: "conflict",
                message,
            },
            StoreError::Exhausted(e) => ApiError::Conflict {
                code: "subnet_exhausted",
                message: e.to_string(),
            },
            StoreError::Invalid(m) => ApiError::Invalid(m),
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        if let ApiError::Internal(detail) = &self {
            tracing::error!(error = %detail, "internal error");
        } else {
            tracing::debug!(status = status.as_u16(), code = self.code(), message = %self, "refused");
        }
        let mut resp = (
            status,
            Json(ErrorBody {
                error: ErrorDetail {
                    code: self.code().to_string(),
                    message: self.to_string(),
                },
            }),
        )
            .into_response();
        if let ApiError::TooManyRequests { retry_after, .. } = &self {
            // Whole seconds, rounded up: never earlier than the bucket allows.
            let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
            if let Ok(v) = http::HeaderValue::from_str(&secs.max(1).to_string()) {
                resp.headers_mut().insert(http::header::RETRY_AFTER, v);
            }
        }
        if status == StatusCode::UNAUTHORIZED {
            resp.headers_mut().insert(
                http::header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer"),
            );
        }
        resp
    }
}

pub async fn not_found(uri: http::Uri) -> ApiError {
    ApiError::NotFound(format!("no such endpoint: {}", uri.path()))
}

pub async fn method_not_allowed(method: http::Method, uri: http::Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("{method} is not allowed on {}", uri.path()))
}
