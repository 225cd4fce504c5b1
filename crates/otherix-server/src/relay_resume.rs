//! Resumable relay sessions at the control plane (`otherix_proto::resume`).
//! The control plane carries a session's frames between the client's
//! WebSocket and the agent's TLS connection and keeps none of its bytes:
//! the client and the agent number and keep what they sent, so a session
//! goes on byte-exact over new connections, through any replica.
//!
//! - **Open** ([`open`]): a client that offers [`resume::PROTOCOL`] gets a
//!   session id (the ticket's `jti`), a resume secret (its SHA-256 stored
//!   beside the open session, with the ticket's claims and the node) and
//!   the grace period in the 101's headers; the agent was asked
//!   `RESUMABLE ...` instead of `RELAY ...`. A browser (the web console's
//!   terminal, [`Browser`]) reads no response header: it hears them in a
//!   first text message, and resumes through the terminal's own URL.
//! - **Carry** ([`carry`]): frames both ways; data counted for the audit
//!   trail. A client connection lost (or this control plane stopping, or
//!   cut off from the store) leaves the agent's session waiting: the store
//!   records since when (`detach_session`), and the client resumes. An end
//!   decided here (revoked, grant expired, lifetime, the client's Close)
//!   tells the agent to end it for good (a `Close` frame).
//! - **Resume** ([`resume`]): the principal's own bearer token (not the
//!   single-use ticket), the session id, the secret, what the client
//!   received. The session must be the caller's (else 404, as if it did not
//!   exist), the secret right (compared hashed, in constant time; else 403),
//!   access not revoked meanwhile (else 403, and the agent's session ends
//!   at once), within its grace (else 410 with how it ended). The agent is
//!   asked `RESUME <id> <received>` and answers what it received; the 101
//!   says so, and both ends send again from there.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes};
use futures_util::{FutureExt, SinkExt, StreamExt};
use http::{HeaderMap, HeaderValue, StatusCode};
use otherix_core::credential::Claims;
use otherix_ingress::live::{Ending, Registration};
use otherix_proto::resume::{self, Frame, Pieces, WireReader, T_ACK, T_CLOSE, T_DATA, T_END, T_MOVE};
use otherix_proto::{relay, AuditAction, OpenSession, Transport};
use otherix_store::{AuditEvent, ResumeRecord, Store};
use time::OffsetDateTime;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tracing::Instrument;

use crate::relay::{left_node, limit_or_none, Left, Upstream, Watched, CHUNK, IDLE, PING_EVERY};
use crate::state::AppState;

/// Most bytes of the client's frames gathered into one write to the agent.
const TO_AGENT_BATCH: usize = 256 * 1024;

/// Whether the upgrade request offers the resumable stream.
pub(crate) fn offered(headers: &HeaderMap) -> bool {
    headers
        .get_all(http::header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|p| p.trim() == resume::PROTOCOL)
}

/// What one connection carrying a session needs to know about it.
struct Carried {
    claims: Claims,
    node: String,
    /// What the agent and the client had received when this connection
    /// took the session on (0, 0 for the first).
    base_up: u64,
    base_down: u64,
    /// When the session started (its lifetime and duration count from it).
    started_at: OffsetDateTime,
    /// Which of the session's connections this is (0 for the first; see
    /// `Store::claim_leg`): only the last one detaches or ends it.
    leg: u64,
    /// The first message to the client, a text one: what the 101's headers
    /// say, for a browser, whose WebSocket cannot read them (see
    /// [`Browser`]). `None` for every other client.
    hello: Option<String>,
}

/// A session of the web console's terminal: its client is a browser, whose
/// WebSocket reads no response header, so what a 101 says (the session, its
/// secret, the grace, what the agent received) comes in a first text
/// message instead — never in a URL, never logged; and the console's
/// sign-in that opened it ends it, on every connection that carries it and
/// while it waits for a resume ([`Watched::ends`]).
pub(crate) struct Browser {
    /// The VM whose console the page resumes: the session must be that
    /// console's (port 0), else it is "not yours".
    pub(crate) vm: String,
    pub(crate) ends: crate::relay::Ends,
}

/// What a browser's first message says: on open the session, its secret
/// and grace; on a resume what the agent received (the browser rewinds its
/// outbox to it). A text message: the stream's frames are binary.
fn hello(session: &str, secret: Option<&str>, grace: Duration, received: u64) -> String {
    let mut said = serde_json::json!({
        "session": session,
        "grace_ms": grace.as_millis() as u64,
        "received": received,
    });
    if let Some(secret) = secret {
        said["secret"] = secret.into();
    }
    said.to_string()
}

/// The upgrade of a new resumable session whose agent answered `OK` on
/// `upstream`: the session's id, secret and grace in the answer's headers.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn open(
    state: &AppState,
    ws: WebSocketUpgrade,
    upstream: Upstream,
    claims: Claims,
    node: String,
    watched: Watched,
    live: Registration,
    span: tracing::Span,
) -> Response {
    let secret = hex::encode(crate::random::bytes::<32>());
    let now = OffsetDateTime::now_utc();
    let grace = state.settings.relay_resume_grace;
    let record = ResumeRecord {
        session: claims.jti.clone(),
        secret_hash: hex::encode(crate::tokens::hash_secret(&secret)),
        claims: serde_json::to_string(&claims).unwrap_or_default(),
        node: node.clone(),
        grace_ms: grace.as_millis() as u64,
        detached_at: None,
    };
    let open = OpenSession {
        id: claims.jti.clone(),
        principal: claims.sub.clone(),
        target: claims.vm.clone(),
        port: claims.port,
        transport: Transport::Relay,
        node: node.clone(),
        replica: Some(watched.replica.clone()),
        started_at: now,
        bytes_up: 0,
        bytes_down: 0,
        bytes_at: None,
    };
    // Recorded before the answer: a session any replica must be able to
    // resume is in the store before the client relies on it (a replica
    // killed a moment later must not take the record with it).
    if let Err(e) = state.store.start_resumable_session(&open, &record).await {
        tracing::error!(error = %e, "cannot record a relay session; refusing it");
        return crate::relay::Refused::Unavailable(
            "the control plane cannot record the session now; try again".into(),
        )
        .response();
    }
    let session = claims.jti.clone();
    // A browser's session: something else ends it (its sign-in), and it
    // reads no header (see [`Browser`]).
    let in_band = watched.ends.is_some();
    let carried = Carried {
        claims,
        node,
        base_up: 0,
        base_down: 0,
        started_at: now,
        leg: 0,
        hello: in_band.then(|| hello(&session, Some(&secret), grace, 0)),
    };
    let app = state.clone();
    let mut response = upgrade(ws)
        .on_upgrade(move |socket| carry(app, socket, upstream, carried, watched, live).instrument(span));
    if in_band {
        return response;
    }
    let headers = response.headers_mut();
    for (name, value) in [
        (resume::HEADER_SESSION, session),
        (resume::HEADER_SECRET, secret),
        (resume::HEADER_GRACE, grace.as_millis().to_string()),
    ] {
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(name, v);
        }
    }
    response
}

/// The upgrade with the resumable protocol selected and the frame limits.
fn upgrade(ws: WebSocketUpgrade) -> WebSocketUpgrade {
    ws.protocols([resume::PROTOCOL])
        .max_frame_size(CHUNK * 2 + 1)
        .max_message_size(CHUNK * 2 + 1)
}

/// Every refusal of a resume. The answer is the status and one line.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("{0}")]
    Malformed(String),
    #[error("{0}")]
    Unauthenticated(String),
    /// Not the caller's session, or none by that id: the same to a stranger.
    #[error("no relay session {0} of yours to resume")]
    NotYours(String),
    #[error("wrong resume secret for relay session {0}")]
    Secret(String),
    #[error("relay session {0} has ended: {1}")]
    Ended(String, String),
    #[error("access revoked by an admin; relay session {0} ended")]
    Revoked(String),
    #[error("the grant expired; relay session {0} ended")]
    GrantExpired(String),
    #[error("{0}")]
    Limit(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Node(String),
}

impl Refused {
    fn status(&self) -> StatusCode {
        match self {
            Refused::Malformed(_) => StatusCode::BAD_REQUEST,
            Refused::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Refused::NotYours(_) => StatusCode::NOT_FOUND,
            Refused::Secret(_) | Refused::Revoked(_) | Refused::GrantExpired(_) => StatusCode::FORBIDDEN,
            Refused::Ended(..) => StatusCode::GONE,
            Refused::Limit(_) => StatusCode::TOO_MANY_REQUESTS,
            Refused::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Refused::Node(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// The reason label of `otherix_relay_resume_refused_total`.
    fn code(&self) -> &'static str {
        match self {
            Refused::Malformed(_) => "malformed",
            Refused::Unauthenticated(_) => "unauthenticated",
            Refused::NotYours(_) => "not_yours",
            Refused::Secret(_) => "wrong_secret",
            Refused::Ended(..) => "ended",
            Refused::Revoked(_) => "revoked",
            Refused::GrantExpired(_) => "grant_expired",
            Refused::Limit(_) => "principal_session_cap",
            Refused::Unavailable(_) => "unavailable",
            Refused::Node(_) => "node",
        }
    }

    fn response(&self) -> Response {
        let status = self.status();
        metrics::counter!("otherix_relay_resume_refused_total", "reason" => self.code()).increment(1);
        tracing::info!(status = status.as_u16(), reason = %self, "relay resume refused");
        (status, format!("{self}\n")).into_response()
    }
}

fn header<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).and_then(|v| v.to_str().ok()).map(str::trim)
}

/// What a client asks to resume: the session, its secret, what it
/// received, and why it reconnects (for the audit trail, cleaned).
pub(crate) struct Ask {
    pub(crate) id: String,
    pub(crate) secret: String,
    pub(crate) received: u64,
    pub(crate) cause: String,
}

impl Ask {
    /// The ask of a `/v1/relay` resume, in its headers.
    fn of_headers(headers: &HeaderMap) -> Result<Ask, Refused> {
        let id = header(headers, resume::HEADER_RESUME)
            .filter(|id| resume::valid_session_id(id))
            .ok_or_else(|| Refused::Malformed(format!("malformed {} header", resume::HEADER_RESUME)))?;
        let secret = header(headers, resume::HEADER_SECRET)
            .ok_or_else(|| Refused::Malformed(format!("missing {} header", resume::HEADER_SECRET)))?;
        let received: u64 = header(headers, resume::HEADER_RECEIVED)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                Refused::Malformed(format!("missing or malformed {} header", resume::HEADER_RECEIVED))
            })?;
        Ok(Ask {
            id: id.to_owned(),
            secret: secret.to_owned(),
            received,
            cause: resume::clean_cause(header(headers, resume::HEADER_CAUSE).unwrap_or_default()),
        })
    }
}

/// `GET /v1/relay` with [`resume::HEADER_RESUME`]: a client resuming its
/// session on a new connection (see the module documentation).
pub(crate) async fn resume(state: AppState, headers: HeaderMap, ws: WebSocketUpgrade) -> Response {
    let caller = match crate::auth::Caller::of_headers(&state, &headers).await {
        Ok(caller) => caller,
        Err(e) => return Refused::Unauthenticated(e.to_string()).response(),
    };
    match Ask::of_headers(&headers) {
        Ok(ask) => resume_session(&state, ws, &caller.id(), ask, None).await,
        Err(refused) => refused.response(),
    }
}

/// Resumes session `ask.id` of `principal` on `ws`, checked as every resume
/// is (the module documentation): through `/v1/relay` with a bearer token,
/// or through the web console's terminal ([`Browser`]), whose handshake
/// the console's sign-in authorized.
pub(crate) async fn resume_session(
    state: &AppState,
    ws: WebSocketUpgrade,
    principal: &str,
    ask: Ask,
    browser: Option<Browser>,
) -> Response {
    let (vm, ends) = match browser {
        Some(b) => (Some(b.vm), Some(b.ends)),
        None => (None, None),
    };
    match resumed(state, principal, &ask, vm.as_deref()).await {
        Ok((upstream, carried, received)) => {
            let in_band = ends.is_some();
            let watched = Watched {
                store: state.store.clone(),
                stopping: state.relay.stopping.subscribe(),
                cut: state.relay.cut.subscribe(),
                replica: state.relay.replica.clone(),
                max_session: state.settings.max_session,
                ends,
            };
            let (mut carried, live) = carried;
            if in_band {
                let grace = state.settings.relay_resume_grace;
                carried.hello = Some(hello(&carried.claims.jti, None, grace, received));
            }
            let app = state.clone();
            let span = tracing::info_span!("relay", vm = %carried.claims.vm, port = carried.claims.port, principal = %carried.claims.sub, session = %carried.claims.jti);
            let mut response = upgrade(ws).on_upgrade(move |socket| {
                carry(app, socket, upstream, carried, watched, live).instrument(span)
            });
            if let Ok(v) = HeaderValue::from_str(&received.to_string()) {
                response.headers_mut().insert(resume::HEADER_RECEIVED, v);
            }
            response
        }
        Err(refused) => refused.response(),
    }
}

/// The checks of a resume and the agent's answer: the connection to it,
/// what this connection carries, and what the agent received. `console_of`:
/// the session must be the serial console of that VM (a browser's resume).
async fn resumed(
    state: &AppState,
    principal: &str,
    ask: &Ask,
    console_of: Option<&str>,
) -> Result<(Upstream, (Carried, Registration), u64), Refused> {
    let Ask {
        id,
        secret,
        received,
        cause,
    } = ask;
    let (id, received) = (id.clone(), *received);
    let store_failed = |e: otherix_store::StoreError| {
        tracing::error!(error = %e, "cannot read a resumable session");
        Refused::Unavailable("the control plane cannot read the session now; try again".into())
    };
    let Some((open, record)) = state.store.resumable_session(&id).await.map_err(store_failed)? else {
        // Ended (said only to its own principal), or never was.
        return match state.store.session_end(&id).await.map_err(store_failed)? {
            Some((who, reason)) if who == principal => Err(Refused::Ended(id, reason)),
            _ => Err(Refused::NotYours(id)),
        };
    };
    let elsewhere = console_of.is_some_and(|vm| open.target != vm || open.port != relay::CONSOLE_PORT);
    if open.principal != principal || elsewhere {
        return Err(Refused::NotYours(id));
    }
    let hash = hex::decode(&record.secret_hash).unwrap_or_default();
    if !crate::tokens::secret_matches(secret, &hash) {
        return Err(Refused::Secret(id));
    }
    let claims: Claims = serde_json::from_str(&record.claims).map_err(|_| {
        Refused::Unavailable(format!(
            "relay session {id} cannot be resumed: its record is damaged"
        ))
    })?;
    let now = OffsetDateTime::now_utc();
    // A revocation that landed while it waited, or its grant ran out: it
    // ends now, on the agent too.
    let revoked = otherix_ingress::live::ending(state.catalog.read().revocations(), &claims);
    let expired = claims.until.is_some_and(|until| until <= now);
    if revoked.is_some() || expired {
        let reason = match revoked {
            Some(Ending::Revoked) => "revoked",
            Some(Ending::EndedByAdmin) => "ended by an admin",
            None => "grant expired",
        };
        abort_on_node(state, &record.node, &id).await;
        end_record(&state.store, &open, reason, None, None).await;
        return Err(if revoked.is_some() {
            Refused::Revoked(id)
        } else {
            Refused::GrantExpired(id)
        });
    }
    if let Some(at) = record.detached_at {
        let grace = time::Duration::milliseconds(record.grace_ms as i64);
        if now - at > grace + time::Duration::milliseconds(otherix_store::ABANDON_SLACK_MS) {
            let reason = format!("not resumed within the grace period ({}s)", grace.whole_seconds());
            end_record(&state.store, &open, &reason, None, None).await;
            return Err(Refused::Ended(id, reason));
        }
    }
    // Counted among the principal's sessions on this replica, under a key
    // of its own: the connection it replaces may not have noticed yet.
    let key = format!("{}.{}", claims.jti, crate::random::short_id());
    let live = state
        .relay
        .admit_as(
            &key,
            &claims,
            limit_or_none(state.settings.max_sessions_per_principal),
        )
        .map_err(|e| match e {
            otherix_ingress::live::NotAdmitted::Revoked => Refused::Revoked(id.clone()),
            other => Refused::Limit(other.to_string()),
        })?;
    // From here on this resume carries the session: the connection it
    // replaces may see the node cut its side (below) before it sees its
    // client gone, and must not take that for the session's end.
    let leg = match state.store.claim_leg(&id).await.map_err(store_failed)? {
        Some(leg) => leg,
        None => {
            let reason = state
                .store
                .session_end(&id)
                .await
                .map_err(store_failed)?
                .map(|(_, reason)| reason)
                .unwrap_or_else(|| "ended".into());
            return Err(Refused::Ended(id, reason));
        }
    };
    let (upstream, agent_received) = match ask_node(state, &record.node, &id, received).await {
        Ok(x) => x,
        Err(Refused::Ended(id, reason)) => {
            // The agent no longer holds it (its grace passed, the count
            // asked for is no longer kept, the agent restarted): it has
            // ended, whatever the store thought.
            end_record(&state.store, &open, &reason, None, None).await;
            return Err(Refused::Ended(id, reason));
        }
        Err(other) => return Err(other),
    };
    let replica = state.relay.replica.clone();
    let event = AuditEvent {
        id: 0,
        at: now,
        principal: open.principal.clone(),
        action: AuditAction::SessionResume,
        target: Some(open.target.clone()),
        port: Some(open.port),
        transport: Some(Transport::Relay),
        node: Some(record.node.clone()),
        allowed: true,
        reason: Some(if cause.is_empty() {
            format!("resumed on replica {replica}")
        } else {
            format!("resumed on replica {replica} after: {cause}")
        }),
        bytes_up: Some(agent_received),
        bytes_down: Some(received),
        duration_ms: Some((now - open.started_at).whole_milliseconds().max(0) as u64),
        session: Some(id.clone()),
    };
    if let Err(e) = state.store.resume_session(&replica, &event).await {
        tracing::error!(error = %e, "audit write failed");
    }
    metrics::counter!("otherix_relay_resumed_total").increment(1);
    tracing::info!(session = %id, received, agent_received, %cause, "relay session resumed");
    Ok((
        upstream,
        (
            Carried {
                claims,
                node: record.node,
                base_up: agent_received,
                base_down: received,
                started_at: open.started_at,
                leg,
                hello: None,
            },
            live,
        ),
        agent_received,
    ))
}

/// Asks node `node` to go on with session `id` from `received`: the
/// connection, and what the agent received.
async fn ask_node(state: &AppState, node: &str, id: &str, received: u64) -> Result<(Upstream, u64), Refused> {
    let addr = node_endpoint(state, node)?;
    let ask = async {
        let (mut tls, _) = crate::relay::connect_node(state, node, addr)
            .await
            .map_err(|e| Refused::Node(e.to_string()))?;
        tls.write_all(resume::resume_line(id, received).as_bytes())
            .await
            .map_err(|e| Refused::Node(format!("node {node}: {e}")))?;
        let mut reader = tokio::io::BufReader::new(tls);
        let mut line = String::new();
        (&mut reader)
            .take(relay::MAX_LINE as u64)
            .read_line(&mut line)
            .await
            .map_err(|e| Refused::Node(format!("node {node}: {e}")))?;
        match resume::parse_resumed(&line) {
            Some(n) => Ok((reader, n)),
            None => {
                let reason = line.trim_end();
                let reason = reason.strip_prefix("ERR ").unwrap_or(reason).to_owned();
                Err(Refused::Ended(id.to_owned(), reason))
            }
        }
    };
    tokio::time::timeout(crate::relay::DIAL_TIMEOUT, ask)
        .await
        .map_err(|_| {
            Refused::Node(format!(
                "node {node} did not answer within {:?}",
                crate::relay::DIAL_TIMEOUT
            ))
        })?
}

/// Node `node`'s relay endpoint, from the catalog.
fn node_endpoint(state: &AppState, node: &str) -> Result<std::net::SocketAddr, Refused> {
    let found = state.catalog.read().node(node).cloned();
    let node_record = found.ok_or_else(|| Refused::Unavailable(format!("node {node} is gone")))?;
    node_record
        .relay_endpoint()
        .ok_or_else(|| Refused::Unavailable(format!("node {node} has no relay endpoint")))
}

/// Hands session `id`, whose guest (VM `vm_id`) is leaving node `from`,
/// to the node it moves to (`ADOPT`): the node's name once it took it in.
async fn adopt_at_target(
    state: &AppState,
    vm_id: &str,
    id: &str,
    from: &str,
    blob: Bytes,
) -> Result<String, String> {
    let vm = state
        .catalog
        .read()
        .vm(vm_id)
        .cloned()
        .ok_or("the vm was deleted")?;
    let to = vm
        .migrate_to
        .clone()
        .or(vm.node.clone())
        .filter(|n| n != from)
        .ok_or("it is not moving to another node")?;
    let addr = node_endpoint(state, &to).map_err(|e| e.to_string())?;
    let adopt = async {
        let (mut tls, _) = crate::relay::connect_node(state, &to, addr)
            .await
            .map_err(|e| e.to_string())?;
        tls.write_all(resume::adopt_line(id, blob.len()).as_bytes())
            .await
            .map_err(|e| format!("node {to}: {e}"))?;
        tls.write_all(&blob)
            .await
            .map_err(|e| format!("node {to}: {e}"))?;
        tls.flush().await.map_err(|e| format!("node {to}: {e}"))?;
        let mut reader = tokio::io::BufReader::new(tls);
        let mut line = String::new();
        (&mut reader)
            .take(relay::MAX_LINE as u64)
            .read_line(&mut line)
            .await
            .map_err(|e| format!("node {to}: {e}"))?;
        match relay::parse_answer_line(&line) {
            relay::Answer::Ok => Ok(()),
            relay::Answer::Err(reason) => Err(format!("node {to}: {reason}")),
        }
    };
    tokio::time::timeout(Duration::from_secs(30), adopt)
        .await
        .map_err(|_| format!("node {to} did not take the session in time"))??;
    if let Err(e) = state.store.move_session(id, &to).await {
        tracing::error!(error = %e, "cannot record where a relay session moved");
        return Err("the control plane cannot record where it moved".into());
    }
    metrics::counter!("otherix_relay_sessions_moved_total").increment(1);
    tracing::info!(session = %id, %from, %to, bytes = blob.len(), "relay session followed its guest");
    Ok(to)
}

/// Tells node `node` to end its session `id` for good (`ABORT`). Best
/// effort: a node that cannot be reached ends it at its grace period.
pub(crate) async fn abort_on_node(state: &AppState, node: &str, id: &str) {
    let Ok(addr) = node_endpoint(state, node) else {
        return;
    };
    let abort = async {
        let (mut tls, _) = crate::relay::connect_node(state, node, addr).await.ok()?;
        tls.write_all(resume::abort_line(id).as_bytes()).await.ok()?;
        let mut line = String::new();
        let mut reader = tokio::io::BufReader::new(tls);
        (&mut reader)
            .take(relay::MAX_LINE as u64)
            .read_line(&mut line)
            .await
            .ok()?;
        Some(())
    };
    if tokio::time::timeout(crate::relay::DIAL_TIMEOUT, abort)
        .await
        .ok()
        .flatten()
        .is_none()
    {
        tracing::warn!(%node, session = %id, "could not tell the node to end a revoked relay session; it ends at its grace period");
    }
}

/// Ends the resumable sessions waiting for a resume that `revocations`
/// cover: on their nodes (`ABORT`) and in the store. Those carried by a
/// replica end there (its registry of open sessions); a resume of one that
/// slips between is refused by the same check.
pub(crate) fn end_revoked_waiting(state: &AppState, revocations: &[otherix_proto::agent::Revocation]) {
    if revocations.is_empty() {
        return;
    }
    let (state, revocations) = (state.clone(), revocations.to_vec());
    tokio::spawn(async move {
        let waiting = match state.store.waiting_sessions().await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot list the relay sessions waiting for a resume; revoked ones end at their grace period");
                return;
            }
        };
        for (open, record) in waiting {
            let Ok(claims) = serde_json::from_str::<Claims>(&record.claims) else {
                continue;
            };
            if let Some(why) = otherix_ingress::live::ending(&revocations, &claims) {
                let reason = match why {
                    Ending::Revoked => "revoked",
                    Ending::EndedByAdmin => "ended by an admin",
                };
                abort_on_node(&state, &record.node, &open.id).await;
                end_record(
                    &state.store,
                    &open,
                    reason,
                    Some(open.bytes_up),
                    Some(open.bytes_down),
                )
                .await;
                tracing::info!(session = %open.id, reason, "a relay session waiting for a resume ended");
            }
        }
    });
}

/// Records, every 2 s, the resumable sessions nobody resumed within their
/// grace period as ended (their agents ended them then). Every replica
/// looks; the end is recorded once.
pub(crate) fn spawn_sweeper(store: Store) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(2));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            match store.end_abandoned_sessions(OffsetDateTime::now_utc()).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    sessions = n,
                    "relay sessions not resumed within their grace period recorded as ended"
                ),
                Err(e) => tracing::warn!(error = %e, "cannot look for relay sessions past their grace"),
            }
        }
    });
}

/// Records session `open` as ended with `reason`.
async fn end_record(store: &Store, open: &OpenSession, reason: &str, up: Option<u64>, down: Option<u64>) {
    if let Err(e) = store.end_session(&end_event(open, reason, up, down)).await {
        tracing::error!(error = %e, "audit write failed");
    }
}

/// The `session_end` record of `open`, now.
fn end_event(open: &OpenSession, reason: &str, up: Option<u64>, down: Option<u64>) -> AuditEvent {
    let now = OffsetDateTime::now_utc();
    AuditEvent {
        id: 0,
        at: now,
        principal: open.principal.clone(),
        action: AuditAction::SessionEnd,
        target: Some(open.target.clone()),
        port: Some(open.port),
        transport: Some(Transport::Relay),
        node: Some(open.node.clone()),
        allowed: true,
        reason: Some(reason.into()),
        bytes_up: up,
        bytes_down: down,
        duration_ms: Some((now - open.started_at).whole_milliseconds().max(0) as u64),
        session: Some(open.id.clone()),
    }
}

/// How one connection's carrying of a session ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ended {
    /// The agent ended the session: both directions done (1000), or why not.
    Agent(u16, String),
    /// The agent handed the session to another connection.
    TakenOver,
    /// The guest is moving: the agent sent the session's handover.
    Moved(Bytes),
    /// The node the guest moved to took the session in; it waits there
    /// for the client's resume.
    Followed(String),
    /// The agent's connection ended without a `Close`.
    NodeLost(String),
    /// The client's connection failed: the session waits for a resume.
    ClientLost(String),
    /// The client sent Close: it abandons the session.
    ClientClosed,
    /// The client broke the framing.
    ClientViolation,
    /// This control plane is stopping: the client resumes elsewhere.
    Stopping,
    /// This replica lost the store; the others took it for stopped.
    Cut,
    Revoked,
    /// An admin ended this one session.
    ByAdmin,
    GrantExpired,
    /// The web console's sign-in that opened it no longer stands.
    SignedOut,
    MaxLifetime,
    Idle,
}

/// What an end means for the session: over for good (and why, for the
/// audit trail), waiting for a resume, or carried on elsewhere.
enum Fate {
    Over(String),
    Waits,
    Elsewhere,
}

impl Ended {
    fn fate(&self) -> Fate {
        match self {
            Ended::Agent(relay::CLOSE_DONE, _) => Fate::Over("closed".into()),
            Ended::Agent(_, reason) => Fate::Over(reason.clone()),
            Ended::TakenOver => Fate::Elsewhere,
            Ended::Followed(_) => Fate::Waits,
            Ended::Moved(_) => Fate::Over("the guest moved and its handover was not taken".into()),
            Ended::NodeLost(reason) => Fate::Over(reason.clone()),
            Ended::ClientLost(_) | Ended::Stopping | Ended::Cut => Fate::Waits,
            Ended::ClientClosed => Fate::Over("client closed".into()),
            Ended::ClientViolation => Fate::Over("client broke the relay framing".into()),
            Ended::Revoked => Fate::Over("revoked".into()),
            Ended::ByAdmin => Fate::Over("ended by an admin".into()),
            Ended::GrantExpired => Fate::Over("grant expired".into()),
            Ended::SignedOut => Fate::Over("console signed out".into()),
            Ended::MaxLifetime => Fate::Over("max_lifetime".into()),
            Ended::Idle => Fate::Over("idle timeout".into()),
        }
    }

    /// Whether the agent must be told to end the session (it would wait
    /// for a resume otherwise).
    fn aborts_agent(&self) -> bool {
        matches!(
            self,
            Ended::ClientClosed
                | Ended::ClientViolation
                | Ended::Revoked
                | Ended::ByAdmin
                | Ended::GrantExpired
                | Ended::SignedOut
                | Ended::MaxLifetime
                | Ended::Idle
        )
    }
}

/// Carries frames between the client's WebSocket and the agent until this
/// connection's part ends; then tells whoever must know.
async fn carry(
    state: AppState,
    socket: WebSocket,
    upstream: Upstream,
    carried: Carried,
    watched: Watched,
    mut live: Registration,
) {
    let Watched {
        store,
        mut stopping,
        mut cut,
        replica: _,
        max_session,
        mut ends,
    } = watched;
    let Carried {
        claims,
        node,
        base_up,
        base_down,
        started_at,
        leg,
        hello,
    } = carried;
    let app = state.clone();
    let leg_started = Instant::now();
    let (mut ws_tx, mut ws_rx) = socket.split();
    if let Some(hello) = hello {
        if ws_tx.send(Message::Text(hello.into())).await.is_err() {
            // Lost before it began: it waits, as for any lost connection.
            let _ = store
                .detach_session(&claims.jti, leg, OffsetDateTime::now_utc())
                .await;
            if let Some(ends) = ends {
                end_when_signed_out(app, claims.jti.clone(), ends);
            }
            return;
        }
    }
    let (mut up_rd, up_wr) = tokio::io::split(upstream);
    let up_wr = Arc::new(tokio::sync::Mutex::new(up_wr));
    let last_activity = Arc::new(Mutex::new(Instant::now()));
    // Counted on the registration from where the session was (the relay
    // reports open sessions' bytes), so this leg's are the rest.
    let meter = live.meter.clone();
    meter.up(base_up);
    meter.down(base_down);

    // Client → agent: the frames that arrived together (up to
    // `TO_AGENT_BATCH`) written as one, each with its length: one TLS
    // record and one write for many frames, rather than two for each.
    // Written from where they arrived (a vectored write: TLS copies them
    // once, into its records), not copied into a batch first.
    let to_agent = {
        let (up_wr, bytes, activity) = (up_wr.clone(), meter.clone(), last_activity.clone());
        let node = node.clone();
        async move {
            let mut out = Pieces::default();
            loop {
                let mut next = ws_rx.next().await;
                let ended = loop {
                    let msg = match next {
                        Some(Ok(Message::Binary(b))) => b,
                        Some(Ok(Message::Ping(_) | Message::Pong(_))) => Bytes::new(),
                        Some(Ok(Message::Close(_))) => break Some(Ended::ClientClosed),
                        Some(Ok(Message::Text(_))) => break Some(Ended::ClientViolation),
                        Some(Err(e)) => break Some(Ended::ClientLost(e.to_string())),
                        None => break Some(Ended::ClientLost("the connection closed".into())),
                    };
                    match (msg.first(), msg.len()) {
                        (None, _) => {}
                        (Some(&T_DATA), n) if n > 1 => {
                            bytes.up(n as u64 - 1);
                        }
                        (Some(&T_ACK), 9) | (Some(&T_END), 1) => {}
                        // A client has no Close frame to send, nor anything else.
                        _ => break Some(Ended::ClientViolation),
                    }
                    if !msg.is_empty() {
                        out.push(Bytes::copy_from_slice(&(msg.len() as u32).to_be_bytes()));
                        out.push(msg);
                    }
                    if out.remaining() >= TO_AGENT_BATCH {
                        break None;
                    }
                    // More that already arrived goes in the same write.
                    match ws_rx.next().now_or_never() {
                        Some(more) => next = more,
                        None => break None,
                    }
                };
                // What arrived before an end still goes to the agent.
                if out.has_remaining() {
                    let mut wr = up_wr.lock().await;
                    if wr.write_all_buf(&mut out).await.is_err() {
                        return Ended::NodeLost(format!("connection to node {node} failed"));
                    }
                    drop(wr);
                    if let Ok(mut t) = activity.lock() {
                        *t = Instant::now();
                    }
                }
                if let Some(end) = ended {
                    return end;
                }
            }
        }
    };

    // Agent → client, with pings, the watchers and the timeouts; the client
    // hears how its connection's part ended.
    let access_left = claims.access_left(OffsetDateTime::now_utc());
    let elapsed = (OffsetDateTime::now_utc() - started_at).unsigned_abs();
    let lifetime_left = max_session.saturating_sub(elapsed);
    let node_name = node.clone();
    let (vm_store, vm_name, vm_id) = (store.clone(), claims.vm.clone(), claims.vm_id.clone());
    let claims_jti = claims.jti.clone();
    // Borrowed, not moved: a session that goes on waiting still ends with
    // the sign-in (below).
    let ends_here = &mut ends;
    let to_client = {
        let (bytes, activity) = (meter.clone(), last_activity.clone());
        let source = up_wr.clone();
        async move {
            let mut reader = WireReader::default();
            let mut ping = tokio::time::interval(PING_EVERY);
            ping.tick().await;
            let lifetime = tokio::time::sleep(lifetime_left);
            tokio::pin!(lifetime);
            let expired = async {
                match access_left {
                    Some(left) => tokio::time::sleep(left).await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(expired);
            let signed_out = async {
                match ends_here {
                    Some(ends) => ends.await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(signed_out);
            let mut handover: Vec<u8> = Vec::new();
            let mut fed = false;
            let end = 'carry: loop {
                while let Some(raw) = reader.next_raw() {
                    let Ok(raw) = raw else {
                        break 'carry Ended::Agent(
                            relay::CLOSE_FAILED,
                            format!("node {node_name} broke the relay framing"),
                        );
                    };
                    match raw.first() {
                        Some(&T_CLOSE) => match Frame::decode(raw) {
                            Ok(Frame::Close { code, .. }) if code == resume::CLOSE_TAKEN_OVER => {
                                break 'carry Ended::TakenOver
                            }
                            Ok(Frame::Close { code, reason }) => break 'carry Ended::Agent(code, reason),
                            _ => {
                                break 'carry Ended::Agent(
                                    relay::CLOSE_FAILED,
                                    format!("node {node_name} broke the relay framing"),
                                )
                            }
                        },
                        // A handover goes to the guest's next node, never to the client.
                        Some(&T_MOVE) if raw.len() == 1 => {
                            break 'carry Ended::Moved(Bytes::from(std::mem::take(&mut handover)))
                        }
                        Some(&T_MOVE) => {
                            if handover.len() + raw.len() > resume::MAX_HANDOVER {
                                break 'carry Ended::Agent(
                                    relay::CLOSE_FAILED,
                                    format!("node {node_name} sent a handover over the limit"),
                                );
                            }
                            handover.extend_from_slice(&raw[1..]);
                            continue;
                        }
                        Some(&T_DATA) => {
                            bytes.down(raw.len() as u64 - 1);
                            if let Ok(mut t) = activity.lock() {
                                *t = Instant::now();
                            }
                        }
                        _ => {}
                    }
                    // Queued: the frames read together go out in one flush.
                    if let Err(e) = ws_tx.feed(Message::Binary(raw)).await {
                        break 'carry Ended::ClientLost(e.to_string());
                    }
                    fed = true;
                }
                if std::mem::take(&mut fed) {
                    if let Err(e) = ws_tx.flush().await {
                        break 'carry Ended::ClientLost(e.to_string());
                    }
                }
                tokio::select! {
                    () = &mut lifetime => break Ended::MaxLifetime,
                    r = up_rd.read_buf(reader.buffer()) => match r {
                        Ok(0) => break Ended::NodeLost(format!("connection to node {node_name} lost (agent restarted?)")),
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ended::NodeLost(format!("connection to node {node_name} lost (agent restarted?)")),
                        Err(_) => break Ended::NodeLost(format!("connection to node {node_name} failed")),
                        Ok(_) => {}
                    },
                    _ = async { stopping.wait_for(|s| *s).await.is_ok() } => break Ended::Stopping,
                    Ok(why) = &mut live.revoked => break match why {
                        Ending::Revoked => Ended::Revoked,
                        Ending::EndedByAdmin => Ended::ByAdmin,
                    },
                    () = &mut expired => break Ended::GrantExpired,
                    () = &mut signed_out => break Ended::SignedOut,
                    Ok(()) = cut.changed() => break Ended::Cut,
                    _ = ping.tick() => {
                        let idle = activity.lock().map(|t| t.elapsed()).unwrap_or_default();
                        if idle > IDLE {
                            break Ended::Idle;
                        }
                        if let Err(e) = ws_tx.send(Message::Ping(Bytes::new())).await {
                            break Ended::ClientLost(e.to_string());
                        }
                    }
                }
            };
            // The guest moves: the session goes to its next node, and the
            // client resumes it there.
            let end = match end {
                Ended::Moved(blob) => {
                    let adopted = adopt_at_target(&state, &vm_id, &claims_jti, &node_name, blob).await;
                    // The node the guest leaves moves it once it hears the
                    // next one holds the session (or that it cannot).
                    let word = match &adopted {
                        Ok(to) => Frame::Close {
                            code: resume::CLOSE_TAKEN_OVER,
                            reason: format!("adopted by node {to}"),
                        },
                        Err(reason) => Frame::Close {
                            code: relay::CLOSE_FAILED,
                            reason: reason.clone(),
                        },
                    };
                    let mut out = Vec::new();
                    word.encode_wire(&mut out);
                    let mut wr = source.lock().await;
                    let _ = tokio::time::timeout(Duration::from_secs(5), async {
                        wr.write_all(&out).await?;
                        wr.flush().await
                    })
                    .await;
                    drop(wr);
                    match adopted {
                        Ok(to) => Ended::Followed(to),
                        Err(reason) => Ended::Agent(
                            relay::CLOSE_MOVED,
                            format!("vm {vm_name} moved to another node; the session could not follow it ({reason}); connect again"),
                        ),
                    }
                }
                other => other,
            };
            // The agent's end without a Close: the VM may have left the
            // node (a session does not follow a migration yet), or gone.
            let end = match end {
                Ended::NodeLost(reason) => match left_node(&vm_store, &vm_name, &vm_id, &node_name).await {
                    Some(Left::Moved(to)) => Ended::Agent(
                        relay::CLOSE_MOVED,
                        format!("vm {vm_name} moved to another node ({to}); connect again"),
                    ),
                    Some(Left::Deleted) => {
                        Ended::Agent(relay::CLOSE_FAILED, format!("vm {vm_name} was deleted"))
                    }
                    None => Ended::NodeLost(reason),
                },
                other => other,
            };
            let close = match &end {
                Ended::ClientLost(_) | Ended::ClientClosed | Ended::ClientViolation => None,
                Ended::Agent(code, reason) => Some((*code, reason.clone())),
                Ended::TakenOver => Some((
                    resume::CLOSE_TAKEN_OVER,
                    "resumed on another connection".to_string(),
                )),
                Ended::Followed(to) => Some((
                    resume::CLOSE_RESUME,
                    format!("vm {vm_name} moved to node {to}; resume"),
                )),
                Ended::Moved(_) => None,
                Ended::NodeLost(reason) => Some((relay::CLOSE_FAILED, reason.clone())),
                Ended::Stopping => Some((
                    resume::CLOSE_RESUME,
                    "control plane shutting down; resume".to_string(),
                )),
                Ended::Cut => Some((
                    resume::CLOSE_RESUME,
                    "the control plane replica carrying it lost its database; resume".to_string(),
                )),
                Ended::Revoked => Some((
                    relay::CLOSE_FAILED,
                    "access revoked by an admin; the session ended".to_string(),
                )),
                Ended::ByAdmin => Some((relay::CLOSE_FAILED, "an admin ended this session".to_string())),
                Ended::GrantExpired => Some((
                    relay::CLOSE_FAILED,
                    "the grant expired; the session ended".to_string(),
                )),
                Ended::SignedOut => Some((relay::CLOSE_FAILED, crate::relay::SIGNED_OUT.to_string())),
                Ended::MaxLifetime => Some((
                    relay::CLOSE_IDLE,
                    format!(
                        "session reached its maximum lifetime ({}s); connect again",
                        max_session.as_secs()
                    ),
                )),
                Ended::Idle => Some((relay::CLOSE_IDLE, "idle timeout".to_string())),
            };
            if let Some((code, reason)) = close {
                let _ = ws_tx
                    .send(Message::Close(Some(CloseFrame {
                        code,
                        reason: reason.into(),
                    })))
                    .await;
            }
            end
        }
    };

    let end = {
        tokio::pin!(to_agent);
        tokio::pin!(to_client);
        tokio::select! {
            biased;
            e = &mut to_client => e,
            e = &mut to_agent => e,
        }
    };
    if end.aborts_agent() {
        let mut wr = up_wr.lock().await;
        let mut out = Vec::new();
        Frame::Close {
            code: relay::CLOSE_FAILED,
            reason: end_reason(&end),
        }
        .encode_wire(&mut out);
        let _ = tokio::time::timeout(Duration::from_secs(2), async {
            wr.write_all(&out).await?;
            wr.shutdown().await
        })
        .await;
    }
    // Whatever else: the agent's connection is dropped without a TLS
    // close_notify (when this function returns), and the agent waits for a
    // resume.
    let (up, down) = meter.totals();
    let carried_for = leg_started.elapsed();
    metrics::counter!("otherix_relay_bytes_total", "direction" => "up").increment(up.saturating_sub(base_up));
    metrics::counter!("otherix_relay_bytes_total", "direction" => "down")
        .increment(down.saturating_sub(base_down));
    let session = claims.jti.clone();
    match end.fate() {
        Fate::Over(reason) => {
            let duration = (OffsetDateTime::now_utc() - started_at).unsigned_abs();
            let open = OpenSession {
                id: session,
                principal: claims.sub.clone(),
                target: claims.vm.clone(),
                port: claims.port,
                transport: Transport::Relay,
                node,
                replica: None,
                started_at,
                bytes_up: 0,
                bytes_down: 0,
                bytes_at: None,
            };
            // Only while no resume has taken the session on: a leg whose
            // node side the takeover cut ends here with "connection to
            // node failed" though the session goes on elsewhere.
            match store
                .end_leg(leg, &end_event(&open, &reason, Some(up), Some(down)))
                .await
            {
                Ok(true) => {
                    metrics::histogram!("otherix_relay_session_duration_seconds")
                        .record(duration.as_secs_f64());
                    tracing::info!(session = %open.id, node = %open.node, bytes_up = up, bytes_down = down, duration_ms = duration.as_millis() as u64, reason, "relay session closed");
                }
                Ok(false) => tracing::info!(
                    session = %open.id,
                    ended = reason,
                    "relay session resumed on another connection; this one's end is not the session's"
                ),
                Err(e) => tracing::error!(error = %e, "audit write failed"),
            }
        }
        Fate::Waits => match store
            .detach_session(&session, leg, OffsetDateTime::now_utc())
            .await
        {
            Ok(true) => {
                tracing::info!(%session, %node, leg_ms = carried_for.as_millis() as u64, reason = ?end, "relay session waits for a resume");
                if let Some(ends) = ends {
                    end_when_signed_out(app, session, ends);
                }
            }
            // A resume took it on before this connection noticed its end.
            Ok(false) => tracing::info!(
                %session,
                ended = ?end,
                "relay session resumed on another connection; this one's end is not the session's"
            ),
            Err(e) => {
                tracing::warn!(error = %e, "cannot record that the session waits for a resume");
                if let Some(ends) = ends {
                    end_when_signed_out(app, session, ends);
                }
            }
        },
        Fate::Elsewhere => tracing::info!(%session, "relay session resumed on another connection"),
    }
}

/// A browser's session waiting for a resume still ends with the console
/// sign-in that opened it (signed out, expired, its token revoked): at
/// once, on its node and in the store — unless a connection carries it
/// again by then (that connection watches the sign-in itself). Watched no
/// longer than the session may wait.
fn end_when_signed_out(state: AppState, id: String, ends: crate::relay::Ends) {
    let grace =
        state.settings.relay_resume_grace + Duration::from_millis(otherix_store::ABANDON_SLACK_MS as u64);
    tokio::spawn(async move {
        if tokio::time::timeout(grace, ends).await.is_err() {
            return;
        }
        let waiting = match state.store.resumable_session(&id).await {
            Ok(Some((open, record))) if record.detached_at.is_some() => (open, record),
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, session = %id, "cannot read a signed-out terminal's session; it ends at its grace period");
                return;
            }
        };
        let (open, record) = waiting;
        abort_on_node(&state, &record.node, &id).await;
        end_record(&state.store, &open, "console signed out", None, None).await;
        tracing::info!(session = %id, "a relay session waiting for a resume ended: its console was signed out");
    });
}

/// The reason an end gives the agent.
fn end_reason(end: &Ended) -> String {
    match end.fate() {
        Fate::Over(reason) => reason,
        _ => format!("{end:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protocol_is_offered_only_by_name_among_others() {
        let mut h = HeaderMap::new();
        assert!(!offered(&h));
        h.insert(
            http::header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("chat, otherix.relay.resumable.v1"),
        );
        assert!(offered(&h));
        h.insert(
            http::header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("otherix.relay.resumable.v10"),
        );
        assert!(!offered(&h));
    }

    #[test]
    fn only_ends_decided_here_end_the_agents_session_and_only_lost_connections_wait() {
        for end in [Ended::ClientLost("reset".into()), Ended::Stopping, Ended::Cut] {
            assert!(matches!(end.fate(), Fate::Waits), "{end:?}");
            assert!(!end.aborts_agent(), "{end:?}");
        }
        for end in [
            Ended::Revoked,
            Ended::GrantExpired,
            Ended::SignedOut,
            Ended::ClientClosed,
            Ended::MaxLifetime,
        ] {
            assert!(matches!(end.fate(), Fate::Over(_)), "{end:?}");
            assert!(end.aborts_agent(), "{end:?}");
        }
        assert!(matches!(Ended::TakenOver.fate(), Fate::Elsewhere));
        assert!(!Ended::Agent(1000, String::new()).aborts_agent());
    }
}
