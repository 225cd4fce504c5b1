//! The web console's browser terminal: `GET /ui/api/vms/{name}/console`
//! upgrades to a WebSocket carrying a QEMU guest's serial console, as
//! `otherix console` gets it through `/v1/relay` — but a browser cannot send
//! `Authorization` on a WebSocket, so the console's sign-in authorizes it.
//!
//! A page of any site may open a WebSocket to us and the browser sends our
//! cookie along (`SameSite` is about sites, and WebSockets get no CORS), so
//! before the cookie is even looked at the handshake's `Origin` must be the
//! console's own ([`session::own_origin`]); then the session's CSRF token
//! must come in `Sec-WebSocket-Protocol` (below). What follows is exactly
//! the console's: the broker's decision and its audit record
//! (`api::broker::console_for_terminal`, as `POST /v1/vms/{name}/console`),
//! then the relay's own session (`relay::open_session`: admission,
//! revocations, limits, audit start and end with bytes). The session also
//! ends once the sign-in that opened it no longer stands (signed out,
//! expired, its token revoked).

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::HeaderMap;
use otherix_core::credential::Claims;
use serde::Serialize;
use time::OffsetDateTime;

use super::session;
use crate::api::ApiPath;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::state::AppState;

/// The subprotocol the terminal speaks: the relay's framing (binary frames
/// of bytes each way; see `otherix_proto::relay`), selected in the answer.
pub const PROTOCOL: &str = "otherix.console.v1";
/// The CSRF token rides as a second offered subprotocol, `otherix.csrf.`
/// followed by the token (hex), never selected. Why there: the browser's
/// WebSocket API sets no other header, and a query parameter would put the
/// token into URLs — access logs, proxies' logs, the request span — where
/// a header is not written. A cross-site page cannot learn the token, so it
/// cannot offer it; the `Origin` check before it does not depend on that.
pub const CSRF_PROTOCOL_PREFIX: &str = "otherix.csrf.";

/// Why a terminal is refused before its upgrade. This enum alone says which
/// status and code each gets (the console's pages read the JSON error; the
/// counter `otherix_console_terminal_refused_total` its `reason`).
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("the console's terminal expects a WebSocket upgrade")]
    NotWebSocket,
    /// The handshake came from another site's page (or said nothing).
    #[error("cross-site WebSocket refused (Origin {0}): the terminal opens from the console's own pages")]
    WrongOrigin(String),
    /// No console session, or one that no longer stands.
    #[error("{0}")]
    NoSession(ApiError),
    #[error("the terminal speaks the WebSocket subprotocol {PROTOCOL}")]
    Protocol,
    #[error(
        "missing or wrong CSRF token (Sec-WebSocket-Protocol {CSRF_PROTOCOL_PREFIX}...); reload the console"
    )]
    Csrf,
    /// The console's own decision: a viewer, a grant, no rule, a netns VM, ...
    #[error("{0}")]
    Decision(ApiError),
}

impl Refused {
    fn reason(&self) -> &'static str {
        match self {
            Refused::NotWebSocket => "not_websocket",
            Refused::WrongOrigin(_) => "cross_site",
            Refused::NoSession(_) => "no_session",
            Refused::Protocol => "protocol",
            Refused::Csrf => "csrf",
            Refused::Decision(e) => e.code(),
        }
    }

    fn response(self) -> Response {
        let reason = self.reason();
        metrics::counter!("otherix_console_terminal_refused_total", "reason" => reason).increment(1);
        tracing::info!(reason, refusal = %self, "console terminal refused");
        let message = self.to_string();
        match self {
            Refused::NotWebSocket | Refused::Protocol => ApiError::Invalid(message),
            Refused::WrongOrigin(_) | Refused::Csrf => ApiError::Denied {
                code: reason,
                message,
            },
            Refused::NoSession(e) | Refused::Decision(e) => e,
        }
        .into_response()
    }
}

/// `GET /ui/api/vms/{name}/console`: see the module documentation.
pub(super) async fn terminal(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiPath(name): ApiPath<String>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match authorized(&state, &headers, &name, ws).await {
        Ok(a) => {
            let ends = Box::pin(signed_out(state.clone(), a.cookie));
            crate::relay::open_session(
                &state,
                a.ws.protocols([PROTOCOL]),
                a.claims,
                a.now,
                false,
                Some(ends),
            )
            .await
        }
        Err(refused) => refused.response(),
    }
}

/// A terminal allowed to open.
struct Authorized {
    ws: WebSocketUpgrade,
    /// The console's claims, as a ticket would carry them.
    claims: Claims,
    /// The console session's cookie, watched for its sign-out.
    cookie: String,
    /// When it was decided.
    now: OffsetDateTime,
}

/// The checks in the order they cost: the handshake, where it comes from
/// (before the session is looked up, so that another site's page does not
/// even keep it alive), the session, its CSRF token, then the decision.
async fn authorized(
    state: &AppState,
    headers: &HeaderMap,
    name: &str,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Authorized, Refused> {
    let ws = ws.map_err(|_| Refused::NotWebSocket)?;
    session::own_origin(headers).map_err(Refused::WrongOrigin)?;
    let cookie = session::cookie_value(headers).ok_or_else(|| {
        Refused::NoSession(ApiError::Unauthenticated(
            "no console session; sign in first".into(),
        ))
    })?;
    let (found, caller) = super::session_caller(state, cookie)
        .await
        .map_err(Refused::NoSession)?;
    let offered = offered_protocols(headers);
    if !offered.contains(&PROTOCOL) {
        return Err(Refused::Protocol);
    }
    let csrf = offered.iter().find_map(|p| p.strip_prefix(CSRF_PROTOCOL_PREFIX));
    if !state.console.csrf_matches(&found.id, csrf) {
        return Err(Refused::Csrf);
    }
    let now = OffsetDateTime::now_utc();
    let claims = crate::api::broker::console_for_terminal(state, &caller, name, now)
        .await
        .map_err(Refused::Decision)?;
    Ok(Authorized {
        ws,
        claims,
        cookie: cookie.to_string(),
        now,
    })
}

/// The subprotocols a handshake offers, in its order.
fn offered_protocols(headers: &HeaderMap) -> Vec<&str> {
    headers
        .get_all(http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect()
}

/// Completes once the console session `cookie` names no longer stands:
/// checked when any session is closed (a sign-out ends the terminal at
/// once) and every few seconds (expiry, a revoked token, a deleted user).
async fn signed_out(state: AppState, cookie: String) {
    let mut closings = state.console.closings();
    let mut recheck = tokio::time::interval(super::RECHECK);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            Ok(()) = closings.changed() => {}
            _ = recheck.tick() => {}
        }
        if super::session_caller(&state, &cookie).await.is_err() {
            return;
        }
    }
}

/// `GET /ui/api/vms/{name}/console/access`: whether the caller may open the
/// VM's terminal, decided as the terminal decides it (nothing recorded, no
/// rate limit spent): the page shows the terminal only to those it opens for.
#[derive(Debug, Serialize)]
pub(super) struct Access {
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

pub(super) async fn access(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> Json<Access> {
    let decided = crate::api::broker::console_allowed(&state, &caller, &name);
    Json(Access {
        allowed: decided.is_ok(),
        reason: decided.err().map(|e| e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_csrf_token_is_found_among_the_offered_subprotocols() {
        let mut h = HeaderMap::new();
        h.append(
            http::header::SEC_WEBSOCKET_PROTOCOL,
            "otherix.console.v1, otherix.csrf.abc".parse().unwrap(),
        );
        h.append(http::header::SEC_WEBSOCKET_PROTOCOL, "x".parse().unwrap());
        assert_eq!(
            offered_protocols(&h),
            ["otherix.console.v1", "otherix.csrf.abc", "x"]
        );
        assert!(offered_protocols(&HeaderMap::new()).is_empty());
    }

    #[test]
    fn every_refusal_has_a_reason_of_its_own() {
        let refusals = [
            Refused::NotWebSocket,
            Refused::WrongOrigin("https://evil.example".into()),
            Refused::NoSession(ApiError::Unauthenticated("x".into())),
            Refused::Protocol,
            Refused::Csrf,
        ];
        let reasons: std::collections::BTreeSet<_> = refusals.iter().map(Refused::reason).collect();
        assert_eq!(reasons.len(), refusals.len());
        let status = |r: Refused| r.response().status().as_u16();
        assert_eq!(status(Refused::NotWebSocket), 400);
        assert_eq!(status(Refused::WrongOrigin("null".into())), 403);
        assert_eq!(status(Refused::Csrf), 403);
        assert_eq!(
            status(Refused::NoSession(ApiError::Unauthenticated("x".into()))),
            401
        );
    }
}
