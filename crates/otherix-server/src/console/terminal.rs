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
//!
//! A page that offers the resumable stream ([`resume::PROTOCOL`]) gets a
//! resumable session, whose id, secret and grace come in its first (text)
//! message, and reconnects to the same URL after a lost connection with
//! the `otherix.resume.*` subprotocols below: checked as the open is
//! (origin, session, CSRF token), then as every resume is
//! (`relay_resume::resume_session`), without a new console decision — a
//! resume goes on with what was decided, as `/v1/relay`'s does.

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::HeaderMap;
use otherix_proto::resume;
use serde::Serialize;
use time::OffsetDateTime;

use super::session;
use crate::api::ApiPath;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::relay_resume::{Ask, Browser};
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
/// A resume rides as offered subprotocols too (never selected; same reason
/// as the CSRF token — and the secret must not reach a URL): the session,
/// its secret, what the page received, and, optionally, why it reconnects
/// (for the audit trail: `[A-Za-z0-9.-]` and the like, a subprotocol is a
/// token).
pub const RESUME_PROTOCOL_PREFIX: &str = "otherix.resume.";
pub const SECRET_PROTOCOL_PREFIX: &str = "otherix.resume-secret.";
pub const RECEIVED_PROTOCOL_PREFIX: &str = "otherix.received.";
pub const CAUSE_PROTOCOL_PREFIX: &str = "otherix.cause.";

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
    #[error("a resume offers {RESUME_PROTOCOL_PREFIX}ID, {SECRET_PROTOCOL_PREFIX}SECRET and {RECEIVED_PROTOCOL_PREFIX}N with the resumable protocol")]
    Resume,
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
            Refused::Resume => "malformed_resume",
            Refused::Decision(e) => e.code(),
        }
    }

    fn response(self) -> Response {
        let reason = self.reason();
        metrics::counter!("otherix_console_terminal_refused_total", "reason" => reason).increment(1);
        tracing::info!(reason, refusal = %self, "console terminal refused");
        let message = self.to_string();
        match self {
            Refused::NotWebSocket | Refused::Protocol | Refused::Resume => ApiError::Invalid(message),
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
    let signed_in = match signed_in(&state, &headers, ws).await {
        Ok(s) => s,
        Err(refused) => return refused.response(),
    };
    let ends = Box::pin(signed_out(state.clone(), signed_in.cookie));
    let offered = offered_protocols(&headers);
    if let Some(ask) = resume_asked(&offered) {
        let Some(ask) = ask.filter(|_| signed_in.resumable) else {
            return Refused::Resume.response();
        };
        let browser = Browser { vm: name, ends };
        return crate::relay_resume::resume_session(
            &state,
            signed_in.ws,
            &signed_in.caller.id(),
            ask,
            Some(browser),
        )
        .await;
    }
    let now = OffsetDateTime::now_utc();
    match crate::api::broker::console_for_terminal(&state, &signed_in.caller, &name, now).await {
        Ok(claims) => {
            crate::relay::open_session(
                &state,
                signed_in.ws.protocols([PROTOCOL]),
                claims,
                now,
                signed_in.resumable,
                Some(ends),
            )
            .await
        }
        Err(e) => Refused::Decision(e).response(),
    }
}

/// A terminal handshake from the console's own page and sign-in.
struct SignedIn {
    ws: WebSocketUpgrade,
    caller: Caller,
    /// The console session's cookie, watched for its sign-out.
    cookie: String,
    /// The page offers the resumable stream, and resumes are on here.
    resumable: bool,
}

/// The checks in the order they cost: the handshake, where it comes from
/// (before the session is looked up, so that another site's page does not
/// even keep it alive), the session, its CSRF token. Then comes the
/// decision (a new terminal) or the resume's checks.
async fn signed_in(
    state: &AppState,
    headers: &HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<SignedIn, Refused> {
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
    let resumable = !state.settings.relay_resume_grace.is_zero() && crate::relay_resume::offered(headers);
    Ok(SignedIn {
        ws,
        caller,
        cookie: cookie.to_string(),
        resumable,
    })
}

/// The resume a handshake asks for, if it offers any of its subprotocols:
/// `None` inside when it is malformed (a part missing, a bad id or count).
fn resume_asked(offered: &[&str]) -> Option<Option<Ask>> {
    let find = |prefix: &str| offered.iter().find_map(|p| p.strip_prefix(prefix));
    let id = find(RESUME_PROTOCOL_PREFIX);
    let secret = find(SECRET_PROTOCOL_PREFIX);
    let received = find(RECEIVED_PROTOCOL_PREFIX);
    if id.is_none() && secret.is_none() && received.is_none() {
        return None;
    }
    let ask = (|| {
        Some(Ask {
            id: id.filter(|id| resume::valid_session_id(id))?.to_owned(),
            secret: secret?.to_owned(),
            received: received?.parse().ok()?,
            cause: resume::clean_cause(find(CAUSE_PROTOCOL_PREFIX).unwrap_or_default()),
        })
    })();
    Some(ask)
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
    fn a_resume_is_asked_with_all_its_parts_or_is_malformed() {
        let id = "0123456789abcdef0123456789abcdef";
        let whole = [
            "otherix.console.v1",
            "otherix.resume.0123456789abcdef0123456789abcdef",
            "otherix.resume-secret.s3cr3t",
            "otherix.received.42",
            "otherix.cause.connection-lost-1006",
        ];
        let ask = resume_asked(&whole).unwrap().unwrap();
        assert_eq!(
            (
                ask.id.as_str(),
                ask.secret.as_str(),
                ask.received,
                ask.cause.as_str()
            ),
            (id, "s3cr3t", 42, "connection-lost-1006")
        );
        // No part at all: a new terminal, not a resume.
        assert!(resume_asked(&whole[..1]).is_none());
        // A part missing, a bad count or id: malformed.
        for without in 1..4 {
            let mut parts = whole.to_vec();
            parts.remove(without);
            assert!(resume_asked(&parts).unwrap().is_none(), "{parts:?}");
        }
        assert!(resume_asked(&[whole[1], whole[2], "otherix.received.-1"])
            .unwrap()
            .is_none());
        assert!(resume_asked(&["otherix.resume.a/b", whole[2], whole[3]])
            .unwrap()
            .is_none());
    }

    #[test]
    fn every_refusal_has_a_reason_of_its_own() {
        let refusals = [
            Refused::NotWebSocket,
            Refused::WrongOrigin("https://evil.example".into()),
            Refused::NoSession(ApiError::Unauthenticated("x".into())),
            Refused::Protocol,
            Refused::Csrf,
            Refused::Resume,
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
