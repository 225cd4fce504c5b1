//! Extractors whose rejections speak the API's JSON error format.

use axum::extract::{FromRequest, FromRequestParts, Request};
use http::request::Parts;
use http::StatusCode;
use serde::de::DeserializeOwned;

use super::MAX_BODY;
use crate::error::ApiError;

/// `axum::Json`, with refusals as `ApiError`: malformed JSON, unknown fields
/// (request types deny them), a missing content type, an oversized body.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

/// A request body must arrive within this long of its headers.
pub const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let limit = req
            .extensions()
            .get::<super::BodyLimit>()
            .map_or(MAX_BODY, |l| l.0);
        // A slow client (a byte now and then) would hold the connection, and
        // its memory, for as long as it likes: the body has a deadline.
        let read = tokio::time::timeout(BODY_TIMEOUT, axum::Json::<T>::from_request(req, state));
        let Ok(read) = read.await else {
            return Err(ApiError::RequestTimeout(format!(
                "request body not received within {}s",
                BODY_TIMEOUT.as_secs()
            )));
        };
        match read {
            Ok(axum::Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => Err(match rejection.status() {
                StatusCode::PAYLOAD_TOO_LARGE => ApiError::PayloadTooLarge(limit),
                StatusCode::UNSUPPORTED_MEDIA_TYPE => {
                    ApiError::UnsupportedMediaType("expected Content-Type: application/json".into())
                }
                _ => ApiError::Invalid(one_line(&rejection.body_text())),
            }),
        }
    }
}

/// `axum::extract::Query`, with refusals as `ApiError`.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(rejection) => Err(ApiError::Invalid(format!(
                "invalid query string: {}",
                one_line(&rejection.body_text())
            ))),
        }
    }
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `axum::extract::Path`, with refusals as `ApiError`.
#[derive(Debug)]
pub struct ApiPath<T>(pub T);

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            Err(rejection) => Err(ApiError::Invalid(format!(
                "invalid path: {}",
                one_line(&rejection.body_text())
            ))),
        }
    }
}
