//! Extractors whose rejections speak the API's JSON error format.

use std::marker::PhantomData;

mod objects;
#[cfg(test)]
mod tests;

use axum::extract::{FromRequest, FromRequestParts, Request};
use bytes::Bytes;
use http::request::Parts;
use serde::de::DeserializeOwned;

use super::MAX_BODY;
use crate::error::ApiError;

/// A JSON request body, read before the handler runs: for the calls whose
/// body is itself the credential (an enrollment's join token) or that any
/// authenticated caller may make. Calls that check a role take [`Body`],
/// which is read only once the role allows the call.
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

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        read_object(req).await.map(ApiJson)
    }
}

/// A JSON request body not parsed yet: the handler checks who may make the
/// call first, then [`Body::read`]s it, so that a viewer's malformed write
/// is told it may not write (403) rather than how the body is wrong (400).
/// The bytes are received before the handler runs (a body over the limit
/// is 413, a slow one 408, for anyone): answering before the client has
/// sent them all would cut its connection mid-request.
#[derive(Debug)]
pub struct Body<T> {
    content_type_json: bool,
    bytes: Bytes,
    _body: PhantomData<fn() -> T>,
}

impl<S, T> FromRequest<S> for Body<T>
where
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Body {
            content_type_json: json_content_type(req.headers()),
            bytes: receive(req).await?,
            _body: PhantomData,
        })
    }
}

impl<T: DeserializeOwned> Body<T> {
    /// Checks and parses the body, with the same refusals as [`ApiJson`].
    pub fn read(self) -> Result<T, ApiError> {
        if !self.content_type_json {
            return Err(unsupported_media_type());
        }
        parse_object(&self.bytes)
    }
}

/// Reads a request body that must be one JSON object of type `T`. Refused:
/// a content type other than JSON (415), a body over the limit (413) or
/// slower than [`BODY_TIMEOUT`] (408), malformed JSON, unknown fields (the
/// request types deny them), and anything but an object where `T` has a
/// struct, at any depth (400).
async fn read_object<T: DeserializeOwned>(req: Request) -> Result<T, ApiError> {
    if !json_content_type(req.headers()) {
        return Err(unsupported_media_type());
    }
    parse_object(&receive(req).await?)
}

fn unsupported_media_type() -> ApiError {
    ApiError::UnsupportedMediaType("expected Content-Type: application/json".into())
}

/// How much of a body past its limit is still read (and dropped) before
/// the 413 goes out: the connection closes after it, and a client still
/// writing when it does gets a reset instead of the answer. A body declared
/// or found larger than this is cut at once.
fn drain_cap(limit: usize) -> usize {
    limit.saturating_mul(4).max(1 << 20)
}

/// The body's bytes, within the limit and the deadline.
async fn receive(req: Request) -> Result<Bytes, ApiError> {
    use futures_util::StreamExt;
    let limit = req
        .extensions()
        .get::<super::BodyLimit>()
        .map_or(MAX_BODY, |l| l.0);
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > drain_cap(limit) as u64) {
        return Err(ApiError::PayloadTooLarge(limit));
    }
    let mut body = req.into_body().into_data_stream();
    let read = async {
        let mut kept = bytes::BytesMut::new();
        let mut seen = 0usize;
        while let Some(data) = body.next().await {
            let data = data.map_err(|e| ApiError::Invalid(format!("reading the request body: {e}")))?;
            seen = seen.saturating_add(data.len());
            if seen <= limit {
                kept.extend_from_slice(&data);
            } else if seen > drain_cap(limit) {
                break;
            }
        }
        if seen > limit {
            return Err(ApiError::PayloadTooLarge(limit));
        }
        Ok(kept.freeze())
    };
    // A slow client (a byte now and then) would hold the connection, and
    // its memory, for as long as it likes: the body has a deadline.
    tokio::time::timeout(BODY_TIMEOUT, read)
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::RequestTimeout(format!(
                "request body not received within {}s",
                BODY_TIMEOUT.as_secs()
            )))
        })
}

/// Parses one JSON object of type `T`, in one pass. Serde reads a struct
/// from a sequence too, positionally (`["arr2","admin"]` would be a
/// `CreateUserRequest`): that is refused wherever `T` has a struct, as it
/// is read ([`objects::Objects`]).
fn parse_object<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(ApiError::Invalid("the request body must be a JSON object".into()));
    }
    // Nothing is recorded on the way: a good body (nearly every one, and a
    // heartbeat's is large) costs its reading alone.
    let found = objects::Found::default();
    let mut de = serde_json::Deserializer::from_slice(bytes);
    if let Ok(value) = T::deserialize(objects::Objects::new(&mut de, &found)) {
        if de.end().is_ok() {
            return Ok(value);
        }
    }
    Err(refusal::<T>(bytes))
}

/// Why `bytes` is not a `T`: read again, this time tracking the path of
/// every value (`serde_path_to_error`, as axum's `Json` reads), so that
/// the message names the field at fault, in axum's words
/// (`role: unknown variant ...`) or as `targets[0]: expected a JSON
/// object, found an array`.
#[cold]
fn refusal<T: DeserializeOwned>(bytes: &[u8]) -> ApiError {
    use serde_json::error::Category;
    let found = objects::Found::default();
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let err = match serde_path_to_error::deserialize::<_, T>(objects::Objects::new(&mut de, &found)) {
        Err(err) => err,
        Ok(_) => {
            return match de.end() {
                Err(e) => ApiError::Invalid(one_line(&format!(
                    "Failed to parse the request body as JSON: {e}"
                ))),
                // The same reading of the same bytes failed a moment ago.
                Ok(()) => ApiError::Internal("a request body read twice, differently".into()),
            };
        }
    };
    if found.get() {
        let path = err.path();
        let at = if path.iter().next().is_none() {
            "body".to_string()
        } else {
            path.to_string()
        };
        return ApiError::Invalid(format!("{at}: {}", objects::ARRAY_FOR_OBJECT));
    }
    let what = match err.inner().classify() {
        Category::Data => "Failed to deserialize the JSON body into the target type",
        Category::Syntax | Category::Eof | Category::Io => "Failed to parse the request body as JSON",
    };
    ApiError::Invalid(one_line(&format!("{what}: {err}")))
}

/// `application/json`, or a `+json` type, as axum's `Json` takes.
fn json_content_type(headers: &http::HeaderMap) -> bool {
    let Some(value) = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind == "application" && (subtype == "json" || subtype.ends_with("+json"))
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

/// The request's `Host` header, if it is text: read without copying every
/// header, as axum's `HeaderMap` extractor would for each call.
#[derive(Debug)]
pub struct Host(pub Option<String>);

impl<S: Send + Sync> FromRequestParts<S> for Host {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        Ok(Host(
            parts
                .headers
                .get(http::header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string),
        ))
    }
}
