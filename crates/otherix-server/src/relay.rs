//! The relay for bridge VMs (DESIGN §6): `GET /v1/relay` upgrades to a
//! WebSocket after the ticket is verified and the owning agent dialed over
//! mutual TLS; then binary frames and TCP bytes are pumped both ways, never
//! inspected, one frame at a time (a slow reader slows the writer). An empty
//! frame ends a direction, as TLS `close_notify` does towards the agent; see
//! `otherix_proto::relay` for the framing and close codes.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, StatusCode};
use otherix_core::credential::{
    verify, Claims, Expected, Refusal, ReplayCache, DEFAULT_MAX_LIFETIME, REPLAY_CAPACITY, SHARE_DIVISOR,
};
use otherix_ingress::live::{Ending, Live, NotAdmitted, Registration};
use otherix_proto::agent::Revocation;
use otherix_proto::{relay, resume, AuditAction, OpenSession, Transport};
use otherix_store::{AuditEvent, Store};
use rustls::pki_types::ServerName;
use time::OffsetDateTime;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;
use tracing::Instrument;

use crate::relay_ready::ReadySet;
use crate::state::AppState;

/// How long the CP waits to reach an agent and hear its answer.
pub(crate) const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// Ping the client this often; a session silent for `IDLE` is closed.
pub(crate) const PING_EVERY: Duration = Duration::from_secs(20);
pub(crate) const IDLE: Duration = Duration::from_secs(3600);
pub(crate) const CHUNK: usize = relay::MAX_FRAME;
/// Most used tickets one principal may hold in this replica's replay cache
/// (a twentieth of it): past it `429 principal_replay_share`, as at a
/// gateway, while others' tickets still pass.
const RELAY_REPLAY_SHARE: usize = REPLAY_CAPACITY / SHARE_DIVISOR;

/// What the relay needs besides the API state.
pub struct RelayState {
    /// Used tickets, each counted against its principal's share
    /// ([`RELAY_REPLAY_SHARE`]), so one principal's flood cannot fill the
    /// cache and refuse every ticket on this replica.
    replay: Mutex<ReplayCache>,
    /// Sessions open now: revocations end them; each principal has at most
    /// `Settings::max_sessions_per_principal` of them.
    pub(crate) live: Arc<Live>,
    pub(crate) connector: TlsConnector,
    /// Set when the CP shuts down: open sessions close with a reason.
    pub(crate) stopping: tokio::sync::watch::Sender<bool>,
    /// Bumped when the other replicas recorded this one's sessions as ended
    /// (it was cut off from the database for too long): the sessions open
    /// then end too, so the audit trail tells the truth.
    pub(crate) cut: tokio::sync::watch::Sender<u64>,
    /// This control plane's replica id, recorded with each session.
    pub(crate) replica: String,
    /// Connections to nodes' relay endpoints made ready for their next
    /// session (`relay_ready`).
    ready: Mutex<ReadySet<TlsStream<TcpStream>>>,
}

impl std::fmt::Debug for RelayState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayState").finish_non_exhaustive()
    }
}

impl RelayState {
    /// Records the ticket's `jti` as used in this replica's cache, against
    /// its principal's share: replayed, or the principal at its share
    /// (`principal_replay_share`), or the cache full.
    fn remember_used(&self, claims: &Claims, now: OffsetDateTime) -> Result<(), Refusal> {
        self.replay
            .lock()
            .map_err(|_| Refusal::ReplayCacheFull)?
            .check_and_insert_owned(&claims.jti, &claims.sub, RELAY_REPLAY_SHARE, claims.exp, now)
    }

    /// `client` is the CP's own client identity (name
    /// [`relay::CP_CLIENT_NAME`]), presented to agents; `ca` the cluster CA
    /// their certificates must chain to.
    /// `replica` is this control plane's id among its replicas;
    /// `ready_keep` how long a connection to a node is kept ready for its
    /// next session (zero: none are).
    pub fn new(
        client: crate::pki::ServingIdentity,
        ca: rustls::pki_types::CertificateDer<'static>,
        replica: String,
        ready_keep: Duration,
    ) -> anyhow::Result<Self> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ca)?;
        let config = rustls::ClientConfig::builder_with_provider(otherix_tls::provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_client_auth_cert(client.chain, client.key)?;
        Ok(RelayState {
            replay: Mutex::new(ReplayCache::new(REPLAY_CAPACITY)),
            live: Arc::default(),
            connector: TlsConnector::from(Arc::new(config)),
            stopping: tokio::sync::watch::channel(false).0,
            cut: tokio::sync::watch::channel(0).0,
            replica,
            ready: Mutex::new(ReadySet::new(ready_keep)),
        })
    }

    fn lock_ready(&self) -> std::sync::MutexGuard<'_, ReadySet<TlsStream<TcpStream>>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Revocations this replica just wrote, before its catalog has them:
    /// they join the list new sessions are checked against, and the open
    /// sessions they cover end (Close with "access revoked"; audited with
    /// reason `revoked`). Returns how many ended.
    pub fn revoke(&self, revocations: &[Revocation]) -> usize {
        self.live.add_revocations(revocations)
    }

    /// The revocations in force, as the catalog has them (written through
    /// any replica): new sessions are checked against them and the open
    /// sessions they cover end. Returns how many ended.
    pub fn set_revocations(&self, revocations: Vec<Revocation>) -> usize {
        self.live.set_revocations(revocations)
    }

    /// Registers the session of `claims` among the open ones, unless the
    /// revocations in force cover it or its principal has `limit` open.
    /// The check and the registration take the lock revocations take: a
    /// revocation landing at the same moment refuses the session here or
    /// ends it once registered (before, the check read the catalog and the
    /// registry had no list, so one landing in between ended nothing).
    pub(crate) fn admit(&self, claims: &Claims, limit: usize) -> Result<Registration, NotAdmitted> {
        self.live.register(claims, limit)
    }

    /// [`RelayState::admit`] under its own registration `key` (a resumed
    /// session's new connection, while the one it replaces may still be
    /// registered); revocations match `claims` all the same.
    pub(crate) fn admit_as(
        &self,
        key: &str,
        claims: &Claims,
        limit: usize,
    ) -> Result<Registration, NotAdmitted> {
        self.live.register_as(key, claims, limit)
    }

    /// Relay sessions `principal` has open here.
    pub fn open_for(&self, principal: &str) -> usize {
        self.live.open_for(principal)
    }

    /// Closes every open session (Close 1001, "control plane shutting
    /// down") so clients learn why rather than see a dropped connection.
    pub fn stop(&self) {
        self.stopping.send_replace(true);
    }

    /// Ends every session open now (new ones go on): the other replicas
    /// have recorded them as ended.
    pub fn cut_all(&self) {
        self.cut.send_modify(|n| *n += 1);
    }

    /// Sessions open here now.
    pub fn open(&self) -> usize {
        self.live.open()
    }
}

/// What a session watches besides its two connections.
pub(crate) struct Watched {
    pub(crate) store: Store,
    pub(crate) stopping: tokio::sync::watch::Receiver<bool>,
    pub(crate) cut: tokio::sync::watch::Receiver<u64>,
    pub(crate) replica: String,
    pub(crate) max_session: Duration,
    /// Ends the session when it completes, besides all the above.
    pub(crate) ends: Option<Ends>,
}

/// What a session's client hears when the web console's sign-in that
/// opened it no longer stands.
pub(crate) const SIGNED_OUT: &str =
    "the console was signed out (or its sign-in expired or was revoked); the session ended";

/// Something else that ends a session, and why (see [`End::SignedOut`]).
pub(crate) type Ends = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// A limit where 0 means none.
pub(crate) fn limit_or_none(limit: usize) -> usize {
    if limit == 0 {
        usize::MAX
    } else {
        limit
    }
}

/// Every refusal the relay sends before the upgrade. This enum alone says
/// which status each gets; the answer is the status and one line.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refused {
    #[error("the relay expects a WebSocket upgrade")]
    NotWebSocket,
    #[error("missing relay ticket (Authorization: Bearer ...)")]
    NoTicket,
    /// The ticket itself: bad, expired, not for here, replayed, ...
    #[error("{0}")]
    Ticket(Refusal),
    #[error("{0}")]
    NotAdmitted(NotAdmitted),
    /// The VM or its node is gone, or the VM is not placed: stale ticket.
    #[error("{0}")]
    Gone(String),
    /// Retry shortly: migrating, no relay endpoint yet.
    #[error("{0}")]
    Unavailable(String),
    /// The node refused, failed TLS, or could not reach the guest.
    #[error("{0}")]
    Node(String),
}

impl Refused {
    fn status(&self) -> StatusCode {
        match self {
            Refused::NotWebSocket => StatusCode::BAD_REQUEST,
            Refused::NoTicket => StatusCode::UNAUTHORIZED,
            Refused::Ticket(r) => StatusCode::from_u16(otherix_ingress::credential_status(r))
                .unwrap_or(StatusCode::UNAUTHORIZED),
            Refused::NotAdmitted(NotAdmitted::Revoked) => StatusCode::FORBIDDEN,
            Refused::NotAdmitted(NotAdmitted::Duplicate) => StatusCode::CONFLICT,
            Refused::NotAdmitted(NotAdmitted::AtLimit { .. }) => StatusCode::TOO_MANY_REQUESTS,
            Refused::Gone(_) => StatusCode::CONFLICT,
            Refused::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            Refused::Node(_) => StatusCode::BAD_GATEWAY,
        }
    }

    /// The reason label of `otherix_relay_refused_total`, for refusals of
    /// the ticket and of admission.
    fn code(&self) -> Option<&'static str> {
        match self {
            Refused::Ticket(r) => Some(r.code()),
            Refused::NotAdmitted(NotAdmitted::Revoked) => Some("revoked"),
            Refused::NotAdmitted(NotAdmitted::Duplicate) => Some("replayed"),
            Refused::NotAdmitted(NotAdmitted::AtLimit { .. }) => Some("principal_session_cap"),
            _ => None,
        }
    }

    pub(crate) fn response(&self) -> Response {
        let status = self.status();
        if let Some(code) = self.code() {
            metrics::counter!("otherix_relay_refused_total", "reason" => code).increment(1);
        }
        tracing::info!(status = status.as_u16(), reason = %self, "relay refused");
        (status, format!("{self}\n")).into_response()
    }
}

pub async fn relay(
    State(state): State<AppState>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let Ok(ws) = ws else {
        return Refused::NotWebSocket.response();
    };
    if headers.contains_key(resume::HEADER_RESUME) {
        return crate::relay_resume::resume(state, headers, ws).await;
    }
    let token = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    let Some(token) = token else {
        return Refused::NoTicket.response();
    };
    let now = OffsetDateTime::now_utc();
    let claims = match check_ticket(&state, token, now) {
        Ok(c) => c,
        Err(r) => return Refused::Ticket(r).response(),
    };
    // A client that speaks the resumable stream gets it (a serial console
    // session too), unless resumes are off here.
    let resumable = !state.settings.relay_resume_grace.is_zero() && crate::relay_resume::offered(&headers);
    open_session(&state, ws, claims, now, resumable, None).await
}

/// Opens the session of `claims` (a ticket checked, or a console decided
/// by the web console's terminal): registered among the open ones, its
/// ticket spent, the owning node dialed, and `ws` upgraded to carry it.
/// `ends` ends it besides everything that ends a relay session (the web
/// console's sign-in that opened it signed out) — a resumable one also
/// while it waits for a resume, and its client, a browser, hears what the
/// 101 would say in a first message (`relay_resume::Browser`).
pub(crate) async fn open_session(
    state: &AppState,
    ws: WebSocketUpgrade,
    claims: Claims,
    now: OffsetDateTime,
    resumable: bool,
    ends: Option<Ends>,
) -> Response {
    // Registered before the ticket is spent, as at a gateway: revoked, or
    // the principal at its limit (counted here, where the relay's sessions
    // are), and the ticket is refused without taking a place among the used.
    let mut live = match state
        .relay
        .admit(&claims, limit_or_none(state.settings.max_sessions_per_principal))
    {
        Ok(live) => live,
        Err(e) => return Refused::NotAdmitted(e).response(),
    };
    if let Err(r) = spend_ticket(state, &claims, now).await {
        return Refused::Ticket(r).response();
    }
    let span = tracing::info_span!("relay", vm = %claims.vm, port = claims.port, principal = %claims.sub);
    let line = if resumable {
        resume::open_line(
            &claims.vm_id,
            claims.port,
            &claims.jti,
            state.settings.relay_resume_grace,
            state.settings.relay_resume_buffer,
        )
    } else {
        relay::request_line(&claims.vm_id, claims.port)
    };
    let (upstream, node, ready) = match dial_owner(state, &claims, &line).instrument(span.clone()).await {
        Ok(s) => s,
        Err(refused) => return refused.response(),
    };
    // A revocation that came while the node was dialed: refused now rather
    // than upgraded to end at once (the node's connection is dropped).
    if live.revoked.try_recv().is_ok() {
        return Refused::NotAdmitted(NotAdmitted::Revoked).response();
    }
    span.in_scope(|| tracing::info!(%node, ready, "relay session open"));
    let watched = Watched {
        store: state.store.clone(),
        stopping: state.relay.stopping.subscribe(),
        cut: state.relay.cut.subscribe(),
        replica: state.relay.replica.clone(),
        max_session: state.settings.max_session,
        ends,
    };
    if resumable {
        return crate::relay_resume::open(state, ws, upstream, claims, node, watched, live, span).await;
    }
    ws.max_frame_size(CHUNK * 2)
        .max_message_size(CHUNK * 2)
        .on_upgrade(move |socket| session(socket, upstream, claims, node, watched, live).instrument(span))
}

/// Signature, issuer (this cluster), audience (the CP), lifetime, time
/// window (DESIGN §5), and not revoked as far as the catalog knows; single
/// use is [`spend_ticket`]'s, once the session is registered.
///
/// The keys are the ones already loaded (kept current by rotation and the
/// change log), not read from the store: a caller with no valid ticket
/// costs no store read, however many requests it makes.
fn check_ticket(state: &AppState, token: &str, now: OffsetDateTime) -> Result<Claims, Refusal> {
    let keys = state.keys.verifying(now);
    let expected = Expected {
        audience: relay::AUDIENCE,
        issuer: Some(&state.info.cluster_id),
        // Our own tickets live `credential_ttl`; the default maximum as well,
        // so tickets minted before a restart with a shorter TTL still pass.
        max_lifetime: state.settings.credential_ttl.max(DEFAULT_MAX_LIFETIME),
    };
    let claims = verify(token, &keys, &expected, now)?;
    // Access taken away after the ticket was minted. A catalog that lost
    // track of the store cannot say: refuse (fail closed).
    if !state.catalog.fresh() {
        tracing::error!("the catalog has not caught up with the store; refusing the ticket");
        return Err(Refusal::ReplayCacheFull);
    }
    if state
        .catalog
        .read()
        .revocations()
        .iter()
        .any(|r| r.covers(&claims))
    {
        return Err(Refusal::Revoked);
    }
    Ok(claims)
}

/// Single use: the ticket's `jti` in this process's replay cache, and in
/// the store so that it stays used across restarts and replicas.
async fn spend_ticket(state: &AppState, claims: &Claims, now: OffsetDateTime) -> Result<(), Refusal> {
    state.relay.remember_used(claims, now)?;
    // And across restarts: the store remembers it until it expires. A
    // store that cannot say refuses (fail closed).
    match state.store.use_ticket(&claims.jti, claims.exp).await {
        Ok(true) => Ok(()),
        Ok(false) => Err(Refusal::Replayed),
        Err(e) => {
            tracing::error!(error = %e, "cannot record a relay ticket's use; refusing it");
            Err(Refusal::ReplayCacheFull)
        }
    }
}

/// Finds the VM's owning node and dials its granted relay endpoint over
/// mutual TLS, checking that its certificate names that node's relay
/// (`NODE.relay.otherix`) and is one the CP issued to it and has not revoked;
/// asks it for the target. A connection made ready for the node's next
/// session (`relay_ready`) is used first: the stream, the node, and whether
/// it was a ready one.
pub(crate) async fn dial_owner(
    state: &AppState,
    claims: &Claims,
    line: &str,
) -> Result<(Upstream, String, bool), Refused> {
    let bad_gateway = Refused::Node;
    let vm = state
        .catalog
        .read()
        .vm(&claims.vm_id)
        .cloned()
        .ok_or_else(|| Refused::Gone(format!("vm {} no longer exists", claims.vm)))?;
    // Its guest is about to leave the node (or is leaving): a session
    // opened there now would end in a moment.
    if let Some(to) = &vm.migrate_to {
        return Err(Refused::Unavailable(format!(
            "vm {} is migrating to node {to}; connect again once it runs there",
            vm.name
        )));
    }
    let node_name = vm
        .node
        .clone()
        .ok_or_else(|| Refused::Gone(format!("vm {} is not placed on a node", vm.name)))?;
    let node = state
        .catalog
        .read()
        .node(&node_name)
        .cloned()
        .ok_or_else(|| Refused::Gone(format!("node {node_name} is gone")))?;
    let addr: SocketAddr = node
        .relay_endpoint()
        .ok_or_else(|| Refused::Unavailable(format!("node {node_name} has no relay endpoint")))?;
    let dial = async {
        let ready = state
            .relay
            .lock_ready()
            .take(&node_name, addr, std::time::Instant::now());
        let (upstream, from_ready) = match ready.and_then(|r| usable(state, r, &node_name)) {
            Some(conn) => match ask(conn, claims, line, &node_name).await {
                Ok(upstream) => (upstream, true),
                // The request has gone out: whatever became of it, it is
                // never sent again (the node may have dialed the guest).
                Err(refused) => {
                    make_ready(state, &node_name, addr);
                    return Err(refused);
                }
            },
            None => {
                let (tls, _) = connect_node(state, &node_name, addr).await?;
                (ask(tls, claims, line, &node_name).await?, false)
            }
        };
        // The next session to this node finds one ready.
        make_ready(state, &node_name, addr);
        Ok((upstream, node_name.clone(), from_ready))
    };
    tokio::time::timeout(DIAL_TIMEOUT, dial)
        .await
        .map_err(|_| bad_gateway(format!("node {node_name} did not answer within {DIAL_TIMEOUT:?}")))?
}

/// Mutual TLS to node `node_name`'s relay endpoint at `addr`, its
/// certificate checked (see [`relay_cert_valid`]); the connection and that
/// certificate's fingerprint.
pub(crate) async fn connect_node(
    state: &AppState,
    node_name: &str,
    addr: SocketAddr,
) -> Result<(TlsStream<TcpStream>, String), Refused> {
    let bad_gateway = Refused::Node;
    let server_name = ServerName::try_from(otherix_tls::relay_cert_name(node_name))
        .map_err(|_| bad_gateway(format!("node name {node_name} is not a valid TLS name")))?;
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|e| bad_gateway(format!("cannot reach node {node_name} at {addr}: {e}")))?;
    let _ = tcp.set_nodelay(true);
    let tls = state
        .relay
        .connector
        .connect(server_name, tcp)
        .await
        .map_err(|e| bad_gateway(format!("node {node_name} failed TLS: {e}")))?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| otherix_tls::fingerprint(c.as_ref()))
        .unwrap_or_default();
    if !relay_cert_valid(state, &leaf, node_name) {
        tracing::warn!(node = %node_name, %addr, "relay endpoint presented a certificate that is not (or no longer) this node's");
        return Err(bad_gateway(format!(
            "node {node_name} failed TLS: its relay certificate is revoked or was not issued to it"
        )));
    }
    Ok((tls, leaf))
}

/// Revocation: a certificate of a deleted or replaced node still chains to
/// the CA; only the store (the catalog) knows whether the one with
/// `fingerprint` is node `node_name`'s relay certificate, and still valid.
pub(crate) fn relay_cert_valid(state: &AppState, fingerprint: &str, node_name: &str) -> bool {
    let now = OffsetDateTime::now_utc();
    state
        .catalog
        .read()
        .cert(fingerprint)
        .is_some_and(|c| c.node == node_name && c.purpose == "relay" && c.not_after >= now)
}

/// A ready connection to node `node_name`, if it may carry a session: its
/// certificate is still the node's and not revoked (a node deleted or
/// replaced since it was made), and it is still open — checked without
/// waiting, before anything is written, so that one the agent closed
/// meanwhile (it restarted) is dialed anew with nothing asked of it.
fn usable(
    state: &AppState,
    ready: crate::relay_ready::Ready<TlsStream<TcpStream>>,
    node_name: &str,
) -> Option<TlsStream<TcpStream>> {
    if !relay_cert_valid(state, &ready.fingerprint, node_name) {
        tracing::info!(node = %node_name, "a ready relay connection's certificate is no longer the node's; dialing anew");
        return None;
    }
    let mut conn = ready.conn;
    match still_open(&mut conn) {
        Ok(()) => Some(conn),
        Err(e) => {
            tracing::info!(node = %node_name, error = %e, "a ready relay connection was closed; dialing anew");
            None
        }
    }
}

/// Whether `conn`, on which the node sends nothing before a request, is
/// still open: a read that would wait says so; the end of the stream, an
/// error or unexpected data say it is not. (TLS messages that are not data,
/// such as session tickets, are taken in by rustls on the way.)
fn still_open(conn: &mut TlsStream<TcpStream>) -> std::io::Result<()> {
    use std::task::{Context, Poll, Waker};
    use tokio::io::{AsyncRead, ReadBuf};
    let mut cx = Context::from_waker(Waker::noop());
    let mut byte = [0u8; 1];
    let mut buf = ReadBuf::new(&mut byte);
    match std::pin::Pin::new(conn).poll_read(&mut cx, &mut buf) {
        Poll::Pending => Ok(()),
        Poll::Ready(Ok(())) if buf.filled().is_empty() => Err(std::io::ErrorKind::UnexpectedEof.into()),
        Poll::Ready(Ok(())) => Err(std::io::Error::other("the node sent data before a request")),
        Poll::Ready(Err(e)) => Err(e),
    }
}

/// The stream to the guest through its node: the TLS connection, read
/// through the buffer that read the node's answer.
pub(crate) type Upstream = BufReader<TlsStream<TcpStream>>;

/// Asks the node on `tls` for the session's target (`RELAY <vm_id> <port>`)
/// and reads its `OK` or `ERR`.
async fn ask(
    mut tls: TlsStream<TcpStream>,
    claims: &Claims,
    line: &str,
    node_name: &str,
) -> Result<Upstream, Refused> {
    let bad_gateway = Refused::Node;
    tls.write_all(line.as_bytes())
        .await
        .map_err(|e| bad_gateway(format!("node {node_name}: {e}")))?;
    let mut reader = BufReader::new(tls);
    let mut line = String::new();
    (&mut reader)
        .take(relay::MAX_LINE as u64)
        .read_line(&mut line)
        .await
        .map_err(|e| bad_gateway(format!("node {node_name}: {e}")))?;
    match relay::parse_answer_line(&line) {
        // The reader's buffer may already hold the guest's first bytes (a
        // guest that speaks first — an SSH or SMTP banner — can have them
        // in the same TLS record as the OK): the session reads through it,
        // so they reach the client first.
        relay::Answer::Ok => Ok(reader),
        relay::Answer::Err(reason) => Err(bad_gateway(format!(
            "node {node_name} could not reach {}:{}: {reason}",
            claims.vm, claims.port,
        ))),
    }
}

/// Has a connection to node `node_name`'s relay endpoint made ready for
/// its next session, unless one is ready or being made; it is dropped
/// unused after `--relay-ready-keep`.
fn make_ready(state: &AppState, node_name: &str, addr: SocketAddr) {
    let mut ready = state.relay.lock_ready();
    if ready.keep().is_zero() || !ready.start_making(node_name) {
        return;
    }
    drop(ready);
    let (state, node) = (state.clone(), node_name.to_string());
    tokio::spawn(async move {
        // Its age counts from before the TCP connect: the agent's request
        // timeout runs from its accept.
        let started = std::time::Instant::now();
        let made = tokio::time::timeout(DIAL_TIMEOUT, connect_node(&state, &node, addr)).await;
        match made {
            Ok(Ok((tls, fingerprint))) => {
                let keep = {
                    let mut ready = state.relay.lock_ready();
                    ready.made(&node, tls, addr, fingerprint, started);
                    ready.keep()
                };
                tracing::info!(%node, "relay connection to the node made ready");
                tokio::time::sleep(keep).await;
                state.relay.lock_ready().expire(&node, std::time::Instant::now());
            }
            Ok(Err(e)) => {
                tracing::debug!(%node, error = ?e, "no ready relay connection");
                state.relay.lock_ready().failed(&node);
            }
            Err(_) => state.relay.lock_ready().failed(&node),
        }
    });
}

/// How a session ended, for the log, the audit trail and the client's Close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Both directions ended (each with its end-of-stream).
    Done,
    /// The client sent Close: it abandons the session.
    ClientClosed,
    ClientFailed,
    /// The client broke the framing (text frame, data after its end).
    ClientViolation,
    /// The connection to the node ended without `close_notify`: agent gone.
    NodeLost,
    NodeFailed,
    Idle,
    /// The CP is shutting down.
    Stopping,
    /// The node ended it because the VM left it (migrating or migrated).
    VmMoved,
    /// The node ended it because the VM was deleted.
    VmDeleted,
    /// It reached `--max-session`, busy or not.
    MaxLifetime,
    /// An admin took the access away (grant, token, user or rule).
    Revoked,
    /// An admin ended this one session.
    EndedByAdmin,
    /// The grant the ticket was brokered for expired (its `until`).
    GrantExpired,
    /// The other replicas recorded it as ended: this one had lost the
    /// database for too long.
    Cut,
    /// The web console sign-in that opened it was signed out, expired, or
    /// its credential revoked ([`Watched::ends`]).
    SignedOut,
}

impl End {
    fn as_str(self) -> &'static str {
        match self {
            End::Done => "closed",
            End::ClientClosed => "client closed",
            End::ClientFailed => "client connection failed",
            End::ClientViolation => "client broke the relay framing",
            End::NodeLost => "connection to the node lost",
            End::NodeFailed => "connection to the node failed",
            End::Idle => "idle timeout",
            End::MaxLifetime => "max_lifetime",
            End::Revoked => "revoked",
            End::EndedByAdmin => "ended by an admin",
            End::GrantExpired => "grant expired",
            End::Stopping => "control plane shutting down",
            End::VmMoved => "vm moved to another node",
            End::VmDeleted => "vm deleted",
            End::Cut => "control plane replica cut off from the database",
            End::SignedOut => "console signed out",
        }
    }
}

/// Where the VM went, when it is no longer only on the node a session reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Left {
    /// Migrating or migrated to this node.
    Moved(String),
    Deleted,
}

/// Whether VM `name` (id `id`) has left `node`: it is migrating away, runs
/// elsewhere now, or is gone. `None` while it is still there (or the store
/// cannot say): then the node's end was a plain failure.
pub(crate) async fn left_node(store: &Store, name: &str, id: &str, node: &str) -> Option<Left> {
    match store.vm(name).await {
        Ok(vm) => left(Some(&vm), id, node),
        Err(otherix_store::StoreError::NotFound { .. }) => left(None, id, node),
        Err(_) => None,
    }
}

/// [`left_node`]'s decision, given the VM now under that name (if any).
fn left(vm: Option<&otherix_proto::Vm>, id: &str, node: &str) -> Option<Left> {
    let Some(vm) = vm.filter(|vm| vm.id == id) else {
        // Gone, or the name now belongs to another VM.
        return Some(Left::Deleted);
    };
    match (&vm.migrate_to, &vm.node) {
        (Some(to), _) => Some(Left::Moved(to.clone())),
        (None, Some(now)) if now != node => Some(Left::Moved(now.clone())),
        _ => None,
    }
}

/// How often the relay records the byte counts of its open sessions that
/// moved: one batch (one transaction) for them all, never a write per chunk.
pub(crate) const BYTES_EVERY: Duration = Duration::from_secs(3);
/// Most sessions one batch records; the longest unrecorded go first.
const BYTES_BATCH: usize = 2_000;

/// Records, every [`BYTES_EVERY`], the byte counts of this replica's open
/// relay sessions (plain and resumable) that moved, for the live sessions
/// list. A batch the store refuses goes again with the next.
pub(crate) fn spawn_bytes(relay: Arc<RelayState>, store: Store) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(BYTES_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let moved = relay.live.moved_bytes(BYTES_BATCH);
            if moved.is_empty() {
                continue;
            }
            let bytes: Vec<_> = moved.iter().map(|m| m.bytes.clone()).collect();
            if let Err(e) = store
                .record_session_bytes(otherix_store::BytesFrom::Relay, &bytes, OffsetDateTime::now_utc())
                .await
            {
                relay.live.unreport(&moved);
                tracing::warn!(error = %e, sessions = moved.len(), "cannot record relay sessions' byte counts; they go with the next batch");
            }
        }
    });
}

/// Pumps bytes until both directions are done, then audits the session.
///
/// Framing (`otherix_proto::relay`): an empty binary frame ends a direction
/// (half-close); the CP sends Close when both have ended, or at once with a
/// failure code and reason. Each direction runs on its own so a slow reader
/// on one side never stalls the other.
async fn session(
    socket: WebSocket,
    upstream: Upstream,
    claims: Claims,
    node: String,
    watched: Watched,
    mut live: Registration,
) {
    let Watched {
        store,
        mut stopping,
        mut cut,
        replica,
        max_session,
        ends,
    } = watched;
    let started = Instant::now();
    let at = OffsetDateTime::now_utc();
    // Recorded on the side: the audit write never holds up the session.
    let open = OpenSession {
        id: claims.jti.clone(),
        principal: claims.sub.clone(),
        target: claims.vm.clone(),
        port: claims.port,
        transport: Transport::Relay,
        node: node.clone(),
        replica: Some(replica),
        started_at: at,
        bytes_up: 0,
        bytes_down: 0,
        bytes_at: None,
    };
    let recorded = {
        let store = store.clone();
        tokio::spawn(async move {
            if let Err(e) = store.start_session(&open).await {
                tracing::error!(error = %e, "audit write failed");
            }
        })
    };
    let (mut ws_tx, mut ws_rx) = socket.split();
    let (mut up_rd, mut up_wr) = tokio::io::split(upstream);
    let last_activity = Arc::new(Mutex::new(Instant::now()));
    // Counted on the registration: the relay reports open sessions' bytes.
    let meter = live.meter.clone();
    // Set when the client has ended its direction.
    let (client_done_tx, mut client_done) = tokio::sync::watch::channel(false);

    // Client → guest: each binary frame is written before the next is read.
    let activity = last_activity.clone();
    let bytes = meter.clone();
    let to_guest = async move {
        let mut ended = false;
        loop {
            let end = match ws_rx.next().await {
                Some(Ok(Message::Binary(b))) if b.is_empty() => {
                    if !ended {
                        ended = true;
                        // Half-close toward the guest; its answer keeps flowing.
                        let _ = up_wr.shutdown().await;
                        let _ = client_done_tx.send(true);
                    }
                    continue;
                }
                Some(Ok(Message::Binary(_))) if ended => End::ClientViolation,
                Some(Ok(Message::Binary(b))) => {
                    if up_wr.write_all(&b).await.is_err() {
                        End::NodeFailed
                    } else {
                        bytes.up(b.len() as u64);
                        if let Ok(mut t) = activity.lock() {
                            *t = Instant::now();
                        }
                        continue;
                    }
                }
                Some(Ok(Message::Close(_))) => End::ClientClosed,
                Some(Ok(Message::Ping(_))) | Some(Ok(Message::Pong(_))) => continue,
                Some(Ok(Message::Text(_))) => End::ClientViolation,
                Some(Err(_)) | None => End::ClientFailed,
            };
            break end;
        }
    };

    // Guest → client, with pings and the idle timeout; closes the session
    // once both directions have ended.
    let activity = last_activity.clone();
    let bytes = meter.clone();
    let node_name = node.clone();
    let (vm_store, vm_name, vm_id) = (store.clone(), claims.vm.clone(), claims.vm_id.clone());
    // A grant's ticket says when its access ends: the session ends then,
    // as on a revocation, whatever `--max-session` allows.
    let access_left = claims.access_left(OffsetDateTime::now_utc());
    let to_client = async move {
        let mut buf = vec![0u8; CHUNK];
        let mut ping = tokio::time::interval(PING_EVERY);
        ping.tick().await;
        let lifetime = tokio::time::sleep(max_session);
        tokio::pin!(lifetime);
        let expired = async {
            match access_left {
                Some(left) => tokio::time::sleep(left).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expired);
        let signed_out = async {
            match ends {
                Some(ends) => ends.await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(signed_out);
        let mut guest_open = true;
        let end = loop {
            tokio::select! {
                () = &mut lifetime => break End::MaxLifetime,
                n = up_rd.read(&mut buf), if guest_open => match n {
                    Ok(0) => {
                        // The node ended the guest's direction (close_notify).
                        guest_open = false;
                        if ws_tx.send(Message::Binary(Bytes::new())).await.is_err() {
                            break End::ClientFailed;
                        }
                    }
                    Ok(n) => {
                        if ws_tx.send(Message::Binary(Bytes::copy_from_slice(&buf[..n]))).await.is_err() {
                            break End::ClientFailed;
                        }
                        bytes.down(n as u64);
                        if let Ok(mut t) = activity.lock() {
                            *t = Instant::now();
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break End::NodeLost,
                    Err(_) => break End::NodeFailed,
                },
                // (The guard `wait_for` returns must not live across an await.)
                done = async { client_done.wait_for(|done| *done).await.is_ok() }, if !guest_open => {
                    break if done { End::Done } else { End::ClientClosed };
                }
                _ = async { stopping.wait_for(|s| *s).await.is_ok() } => break End::Stopping,
                Ok(why) = &mut live.revoked => break match why {
                    Ending::Revoked => End::Revoked,
                    Ending::EndedByAdmin => End::EndedByAdmin,
                },
                () = &mut expired => break End::GrantExpired,
                () = &mut signed_out => break End::SignedOut,
                Ok(()) = cut.changed() => break End::Cut,
                _ = ping.tick() => {
                    let idle = activity.lock().map(|t| t.elapsed()).unwrap_or_default();
                    if idle > IDLE {
                        break End::Idle;
                    }
                    if ws_tx.send(Message::Ping(Bytes::new())).await.is_err() {
                        break End::ClientFailed;
                    }
                }
            }
        };
        // A node ends a session without close_notify also when the guest
        // has left it (v1: relay sessions do not follow a migration); the
        // store says which it was, so the client learns to connect again.
        let (end, moved_to) = match end {
            End::NodeLost | End::NodeFailed => match left_node(&vm_store, &vm_name, &vm_id, &node_name).await
            {
                Some(Left::Moved(to)) => (End::VmMoved, Some(to)),
                Some(Left::Deleted) => (End::VmDeleted, None),
                None => (end, None),
            },
            other => (other, None),
        };
        if end != End::ClientFailed {
            let (code, reason) = match end {
                End::VmMoved => (
                    relay::CLOSE_MOVED,
                    format!(
                        "vm {vm_name} moved to another node ({}); connect again",
                        moved_to.as_deref().unwrap_or("-")
                    ),
                ),
                End::VmDeleted => (relay::CLOSE_FAILED, format!("vm {vm_name} was deleted")),
                End::Done => (relay::CLOSE_DONE, end.as_str().to_string()),
                End::Idle | End::Stopping => (relay::CLOSE_IDLE, end.as_str().to_string()),
                End::Revoked => (
                    relay::CLOSE_FAILED,
                    "access revoked by an admin; the session ended".to_string(),
                ),
                End::EndedByAdmin => (relay::CLOSE_FAILED, "an admin ended this session".to_string()),
                End::GrantExpired => (
                    relay::CLOSE_FAILED,
                    "the grant expired; the session ended".to_string(),
                ),
                End::SignedOut => (relay::CLOSE_FAILED, SIGNED_OUT.to_string()),
                End::Cut => (
                    relay::CLOSE_FAILED,
                    "the control plane replica carrying it lost its database; connect again".to_string(),
                ),
                End::MaxLifetime => (
                    relay::CLOSE_IDLE,
                    format!(
                        "session reached its maximum lifetime ({}s); connect again",
                        max_session.as_secs()
                    ),
                ),
                End::NodeLost => (
                    relay::CLOSE_FAILED,
                    format!("connection to node {node_name} lost (agent restarted?)"),
                ),
                End::NodeFailed => (
                    relay::CLOSE_FAILED,
                    format!("connection to node {node_name} failed"),
                ),
                _ => (relay::CLOSE_FAILED, end.as_str().to_string()),
            };
            let _ = ws_tx
                .send(Message::Close(Some(CloseFrame {
                    code,
                    reason: reason.into(),
                })))
                .await;
        }
        end
    };

    // The client's side ending first (Close, failure) ends the session; the
    // guest's side ending first gives the client a few seconds to answer
    // the Close.
    tokio::pin!(to_guest);
    tokio::pin!(to_client);
    let end = tokio::select! {
        biased;
        c = &mut to_client => {
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut to_guest).await;
            c
        }
        g = &mut to_guest => g,
    };
    let (up, down) = meter.totals();
    let reason = end.as_str();
    let duration = started.elapsed();
    metrics::counter!("otherix_relay_bytes_total", "direction" => "up").increment(up);
    metrics::counter!("otherix_relay_bytes_total", "direction" => "down").increment(down);
    metrics::histogram!("otherix_relay_session_duration_seconds").record(duration.as_secs_f64());
    tracing::info!(
        principal = %claims.sub,
        vm = %claims.vm,
        port = claims.port,
        %node,
        bytes_up = up,
        bytes_down = down,
        duration_ms = duration.as_millis() as u64,
        reason,
        "relay session closed"
    );
    let event = AuditEvent {
        id: 0,
        at: OffsetDateTime::now_utc(),
        principal: claims.sub.clone(),
        action: AuditAction::SessionEnd,
        target: Some(claims.vm.clone()),
        port: Some(claims.port),
        transport: Some(Transport::Relay),
        node: Some(node),
        allowed: true,
        reason: Some(reason.into()),
        bytes_up: Some(up),
        bytes_down: Some(down),
        duration_ms: Some(duration.as_millis() as u64),
        session: Some(claims.jti.clone()),
    };
    // After the start record, so the session is not listed open again.
    let _ = recorded.await;
    if let Err(e) = store.end_session(&event).await {
        tracing::error!(error = %e, "audit write failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vm(id: &str, node: &str, migrate_to: Option<&str>) -> otherix_proto::Vm {
        otherix_proto::Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: "web01".into(),
            id: id.into(),
            network: "lan".into(),
            node: Some(node.into()),
            labels: Default::default(),
            mac: "02:00:00:00:00:01".parse().unwrap(),
            ip: "10.101.0.2".parse().unwrap(),
            state: otherix_proto::VmState::Running,
            reason: None,
            exec: None,
            migrate_to: migrate_to.map(Into::into),
            created_at: OffsetDateTime::now_utc(),
        }
    }

    fn relay_state() -> RelayState {
        let ca = crate::pki::ClusterCa::generate("c1").unwrap();
        RelayState::new(
            ca.issue_client(relay::CP_CLIENT_NAME).unwrap(),
            ca.cert_der().clone(),
            "r1".into(),
            Duration::ZERO,
        )
        .unwrap()
    }

    /// A ticket of `sub`, issued a second ago.
    fn ticket(jti: &str, sub: &str) -> Claims {
        let iat = OffsetDateTime::now_utc() - time::Duration::seconds(1);
        Claims {
            iss: "c1".into(),
            aud: relay::AUDIENCE.into(),
            sub: sub.into(),
            tok: None,
            jti: jti.into(),
            iat,
            nbf: iat,
            exp: iat + time::Duration::minutes(5),
            vm: "web01".into(),
            vm_id: "a1".into(),
            net: "lab".into(),
            mac: None,
            ip: "10.101.0.2".into(),
            port: 22,
            until: None,
        }
    }

    #[test]
    fn a_principal_at_its_replay_share_is_refused_while_another_principals_ticket_passes() {
        let relay = relay_state();
        let now = OffsetDateTime::now_utc();
        for i in 0..RELAY_REPLAY_SHARE {
            relay
                .remember_used(&ticket(&format!("f{i}"), "grant:flood"), now)
                .unwrap();
        }
        let refusal = relay
            .remember_used(&ticket("f-more", "grant:flood"), now)
            .unwrap_err();
        assert_eq!(refusal, Refusal::ReplayShareFull { limit: 5_000 });
        let refused = Refused::Ticket(refusal);
        assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.code(), Some("principal_replay_share"));
        // The cache is far from full: another principal's ticket passes,
        // and a replay is still a replay.
        relay.remember_used(&ticket("b1", "user:bob"), now).unwrap();
        assert_eq!(
            relay.remember_used(&ticket("b1", "user:bob"), now),
            Err(Refusal::Replayed)
        );
    }

    #[test]
    fn a_revocation_landing_between_the_ticket_check_and_the_registration_still_refuses_the_session() {
        let relay = relay_state();
        // A ticket checked against the catalog just before the revocation
        // was written here: registering after it is refused (the registry
        // used to get no list, so only sessions open already were ended).
        relay.revoke(&[crate::revoke::all_of(
            "grant:acme".into(),
            OffsetDateTime::now_utc(),
        )]);
        assert_eq!(
            relay.admit(&ticket("j1", "grant:acme"), 10).unwrap_err(),
            NotAdmitted::Revoked
        );
        // Registered just before it: ended by it.
        let mut open = relay.admit(&ticket("j2", "user:bob"), 10).unwrap();
        assert_eq!(
            relay.revoke(&[crate::revoke::all_of(
                "user:bob".into(),
                OffsetDateTime::now_utc()
            )]),
            1
        );
        assert!(open.revoked.try_recv().is_ok());
        // Written through another replica, learnt from the catalog: the
        // same, and the full list keeps what was added here.
        let mut carol = relay.admit(&ticket("j3", "user:carol"), 10).unwrap();
        let mut list = relay.live.revocations().to_vec();
        list.push(crate::revoke::all_of(
            "user:carol".into(),
            OffsetDateTime::now_utc(),
        ));
        assert_eq!(relay.set_revocations(list), 1);
        assert!(carol.revoked.try_recv().is_ok());
        for (jti, who) in [("j4", "user:carol"), ("j5", "grant:acme"), ("j6", "user:bob")] {
            assert_eq!(
                relay.admit(&ticket(jti, who), 10).unwrap_err(),
                NotAdmitted::Revoked,
                "{who}"
            );
        }
        // Someone else still gets in.
        relay.admit(&ticket("j7", "user:dave"), 10).unwrap();
    }

    #[test]
    fn a_node_ending_a_session_is_told_apart_from_the_vm_leaving_it() {
        let here = vm("a1", "node1", None);
        assert_eq!(
            left(Some(&here), "a1", "node1"),
            None,
            "still there: a plain failure"
        );
        let leaving = vm("a1", "node1", Some("node2"));
        assert_eq!(
            left(Some(&leaving), "a1", "node1"),
            Some(Left::Moved("node2".into()))
        );
        let moved = vm("a1", "node2", None);
        assert_eq!(
            left(Some(&moved), "a1", "node1"),
            Some(Left::Moved("node2".into()))
        );
        assert_eq!(left(None, "a1", "node1"), Some(Left::Deleted));
        let namesake = vm("b2", "node1", None);
        assert_eq!(left(Some(&namesake), "a1", "node1"), Some(Left::Deleted));
    }
}
