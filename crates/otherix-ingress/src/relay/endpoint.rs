//! The relay endpoint: accepts the control plane's mutual-TLS connections,
//! reads its request line, dials the named guest from this node's address
//! on the guest's bridge and splices, until the session ends or the guest
//! is no longer a target here.

use std::net::{SocketAddr, SocketAddrV4};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use otherix_proto::relay;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn, Instrument};

use super::request::{answer_err, read_line, Refusal};
use super::resumable::{self, Sessions};
use super::sources::ControlPlanes;
use super::targets::{Target, Targets};
use crate::config::{ConfigError, Limits};
use crate::dial::dial_from;
use crate::listener::{self, handshake_within, Refusals};
use otherix_core::conns::{ConnectionCaps, ConnectionSlot};
use otherix_proto::resume;

/// Pause after a failed `accept` (such as EMFILE) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// The endpoint: who may call it (its source address, then its TLS), where
/// each VM id leads.
pub struct Relay {
    /// The sources connections may come from: the control plane's.
    control_planes: RwLock<Arc<ControlPlanes>>,
    acceptor: TlsAcceptor,
    /// Watched by every session: one whose guest is no longer a target here
    /// (migrated away, deleted) ends at once.
    targets: watch::Sender<Targets>,
    /// QEMU guests running here, by VM id, with their serial console socket.
    consoles: watch::Sender<Consoles>,
    limits: Limits,
    connections: Arc<ConnectionCaps>,
    /// Connections closed before their request: not from a control plane,
    /// over a cap, a handshake past its deadline.
    closed: Refusals,
    /// Resumable sessions held here, connected or waiting for a resume
    /// (shared with the agent's reconciler: [`Relay::with_sessions`]).
    sessions: Arc<Sessions>,
}

/// VM id → the serial console socket of a QEMU guest running on this node.
pub type Consoles = std::collections::BTreeMap<String, std::path::PathBuf>;

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// An endpoint serving with `tls` ([`super::server_config`] builds it)
    /// within `limits`, which are validated here, to connections from
    /// `control_planes`. It has no targets until [`Relay::set_targets`].
    pub fn new(
        tls: rustls::ServerConfig,
        limits: Limits,
        control_planes: ControlPlanes,
    ) -> Result<Relay, ConfigError> {
        limits.validate("relay")?;
        Ok(Relay {
            control_planes: RwLock::new(Arc::new(control_planes)),
            acceptor: TlsAcceptor::from(Arc::new(tls)),
            targets: watch::Sender::new(Targets::new()),
            consoles: watch::Sender::new(Consoles::new()),
            connections: ConnectionCaps::new(limits.max_connections, limits.max_connections_per_source),
            closed: Refusals::new("relay"),
            sessions: Arc::default(),
            limits,
        })
    }

    /// Replaces the sources connections may come from (the agent resolves
    /// its control planes again from time to time).
    pub fn set_control_planes(&self, control_planes: ControlPlanes) {
        let mut current = self.control_planes.write().unwrap_or_else(|p| p.into_inner());
        if **current != control_planes {
            info!(control_planes = %control_planes, "relay accepts connections from");
            *current = Arc::new(control_planes);
        }
    }

    /// The sources connections may come from now.
    pub fn control_planes(&self) -> Arc<ControlPlanes> {
        self.control_planes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Connections closed before their request for `reason` (one of
    /// [`crate::listener::CONNECTION_REFUSALS`]), so far.
    pub fn refused(&self, reason: &str) -> u64 {
        self.closed.count(reason)
    }

    /// Resumable sessions held now, connected or waiting for a resume.
    pub fn resumable_sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Connections open now, in any stage.
    pub fn open_connections(&self) -> usize {
        self.connections.open()
    }

    /// Replaces the targets (after each desired state). Sessions to a guest
    /// that is no longer one, or now elsewhere, end.
    pub fn set_targets(&self, targets: Targets) {
        self.targets.send_if_modified(|current| {
            if *current == targets {
                return false;
            }
            debug!(vms = targets.len(), "relay targets updated");
            *current = targets;
            true
        });
    }

    /// This endpoint with `sessions` as its registry of resumable sessions:
    /// the agent shares it with its reconciler (which hands guests over to
    /// other nodes, and moves one only once its sessions went ahead).
    pub fn with_sessions(mut self, sessions: Arc<Sessions>) -> Relay {
        self.sessions = sessions;
        self
    }

    /// Resolves once `vm_id` is a target here (its guest arrived).
    fn arrives(&self, vm_id: &str) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut targets = self.targets.subscribe();
        let vm_id = vm_id.to_owned();
        async move {
            if targets.wait_for(|t| t.contains_key(&vm_id)).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Resolves once `vm_id` is a target here and then no longer leads to
    /// the same one: for a session adopted before its guest arrived.
    fn arrives_then_goes(&self, vm_id: &str) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut targets = self.targets.subscribe();
        let vm_id = vm_id.to_owned();
        async move {
            let arrived = match targets.wait_for(|t| t.contains_key(&vm_id)).await {
                Ok(t) => t.get(&vm_id).copied(),
                Err(_) => None,
            };
            let Some(target) = arrived else {
                return std::future::pending::<()>().await;
            };
            if targets
                .wait_for(|t| t.get(&vm_id) != Some(&target))
                .await
                .is_err()
            {
                std::future::pending::<()>().await;
            }
        }
    }

    /// Replaces the consoles (after each desired state): a console session
    /// of a guest that left ends.
    pub fn set_consoles(&self, consoles: Consoles) {
        self.consoles.send_if_modified(|current| {
            if *current == consoles {
                return false;
            }
            *current = consoles;
            true
        });
    }

    fn target(&self, vm_id: &str) -> Option<Target> {
        self.targets.borrow().get(vm_id).copied()
    }

    /// Resolves once `vm_id` no longer leads to `target` here: the guest was
    /// handed over to another node (or deleted), and the session's guest
    /// connection leads nowhere any more.
    fn gone(&self, vm_id: &str, target: Target) -> impl std::future::Future<Output = ()> + 'static {
        let mut targets = self.targets.subscribe();
        let vm_id = vm_id.to_owned();
        async move {
            if targets
                .wait_for(|t| t.get(&vm_id) != Some(&target))
                .await
                .is_err()
            {
                // The relay itself is gone; the session ends with the process.
                std::future::pending::<()>().await;
            }
        }
    }

    /// Serves `listener` until `shutdown`; open sessions go on until they end.
    pub async fn run(
        self: Arc<Self>,
        listener: TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut tasks = listener::accept_until(
            listener,
            shutdown,
            ACCEPT_BACKOFF,
            |tcp, peer, tasks| self.dispatch(tcp, peer, tasks),
            |e| warn!(error = %e, "relay accept failed"),
        )
        .await;
        // Sessions are not drained: they end with the agent process.
        tasks.detach_all();
    }

    /// Hands an accepted connection to its own task — from a control plane,
    /// within the caps — or closes it at once: before a slot or a
    /// handshake is spent on it.
    fn dispatch(self: &Arc<Self>, tcp: TcpStream, peer: SocketAddr, tasks: &mut JoinSet<()>) {
        if !self.control_planes().allows(peer.ip()) {
            return self.closed.refused("not_control_plane", peer);
        }
        let slot = match self.connections.try_open(peer.ip()) {
            Ok(slot) => slot,
            Err(capped) => return self.closed.refused(capped.code(), peer),
        };
        let relay = Arc::clone(self);
        let span = tracing::info_span!("relay", %peer);
        tasks.spawn(relay.connection(tcp, peer, slot).instrument(span));
    }

    /// One connection from accept to the end of its session.
    async fn connection(self: Arc<Self>, tcp: TcpStream, peer: SocketAddr, mut slot: ConnectionSlot) {
        let _ = tcp.set_nodelay(true);
        // The handshake within its own, shorter deadline; the request line
        // within the request's, both from the accept.
        let opened = tokio::time::timeout(self.limits.request_timeout, async {
            let handshake = self.acceptor.accept(tcp);
            let within = self.limits.handshake_timeout.min(self.limits.request_timeout);
            let tls = handshake_within(within, slot.cut(), &self.closed, peer, handshake)
                .await
                .ok_or(None)?
                .map_err(|e| Some((false, e)))?;
            slot.established();
            read_line(tls).await.map_err(|e| Some((true, e)))
        })
        .await;
        // A session's setup counts from its request: the control plane
        // makes connections ready ahead of their sessions.
        let started = Instant::now();
        let (mut tls, line) = match opened {
            Ok(Ok(x)) => x,
            // Cut at the handshake deadline or for a newcomer (counted and
            // logged there).
            Ok(Err(None)) => return,
            // The control plane keeps a connection ready for the next
            // session and closes it unused after a while: not a refusal.
            Ok(Err(Some((true, e)))) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                debug!("relay connection closed before its request");
                return;
            }
            Ok(Err(Some((_, e)))) => {
                // A client without the CP's certificate ends here.
                info!(error = %e, "relay connection refused");
                return;
            }
            Err(_) => {
                info!("relay request not complete in time");
                return;
            }
        };
        if let Some(vm_id) = line.as_deref().and_then(relay::parse_console_line) {
            let span = tracing::info_span!("console", vm_id = %vm_id);
            return self
                .console(tls, vm_id.to_owned(), started)
                .instrument(span)
                .await;
        }
        if let Some((session, from)) = line.as_deref().and_then(resume::parse_resume_line) {
            let span = tracing::info_span!("resume", %session);
            return async {
                if let Err(mut tls) = self.sessions.attach(session, Box::new(tls), from).await {
                    let why = self.sessions.why_not(session);
                    answer_err(&mut tls, Refusal::NotResumable(why)).await;
                }
            }
            .instrument(span)
            .await;
        }
        if let Some((session, len)) = line.as_deref().and_then(resume::parse_adopt_line) {
            let span = tracing::info_span!("adopt", %session);
            return self.adopt(tls, session.to_owned(), len).instrument(span).await;
        }
        if let Some(session) = line.as_deref().and_then(resume::parse_abort_line) {
            let held = self.sessions.abort(session).await;
            info!(%session, held, "relay session aborted by the control plane");
            let _ = tls.write_all(b"OK\n").await;
            let _ = tls.shutdown().await;
            return;
        }
        let resumable = line.as_deref().and_then(resume::parse_open_line);
        if let Some(req) = resumable.as_ref().filter(|r| r.port == relay::CONSOLE_PORT) {
            let span = tracing::info_span!("console", vm_id = %req.vm_id, session = %req.session);
            return self.console_resumable(tls, req, started).instrument(span).await;
        }
        let request = match &resumable {
            Some(r) => Some((r.vm_id, r.port)),
            None => line.as_deref().and_then(relay::parse_request_line),
        };
        let (vm_id, port) = match request {
            Some(x) => x,
            None => return answer_err(&mut tls, Refusal::Malformed).await,
        };
        let span = tracing::info_span!("session", vm_id = %vm_id, port);
        let dialed = async {
            let target = self
                .target(vm_id)
                .ok_or_else(|| Refusal::UnknownVm(vm_id.to_owned()))?;
            let addr = SocketAddrV4::new(target.ip, port);
            match dial_from(
                target.source,
                None,
                addr,
                self.limits.dial_timeout,
                self.limits.guest_rto_min,
            )
            .await
            {
                Ok(guest) => Ok((guest, addr, target)),
                Err(e) => Err(Refusal::Unreachable(addr, e)),
            }
        }
        .instrument(span.clone())
        .await;
        let (mut guest, addr, target) = match dialed {
            Ok(x) => x,
            Err(r) => return answer_err(&mut tls, r).instrument(span).await,
        };
        let gone = self.gone(vm_id, target);
        if let Some(req) = resumable {
            return async {
                let _ = guest.set_nodelay(true);
                if tls.write_all(b"OK\n").await.is_err() || tls.flush().await.is_err() {
                    return;
                }
                info!(%addr, session = %req.session, setup_ms = started.elapsed().as_millis() as u64, "relay session open (resumable)");
                resumable::run(
                    self.sessions.clone(),
                    resumable::Start::new(&req, guest, Box::new(tls)),
                    gone,
                    self.limits.max_session,
                )
                .await;
            }
            .instrument(span)
            .await;
        }
        async {
            let _ = guest.set_nodelay(true);
            if tls.write_all(b"OK\n").await.is_err() || tls.flush().await.is_err() {
                return;
            }
            info!(%addr, setup_ms = started.elapsed().as_millis() as u64, "relay session open");
            let splice = crate::splice::splice(
                &mut tls,
                &mut guest,
                self.limits.splice_buffer,
                self.limits.idle_timeout,
                self.limits.max_session,
                // Revocation ends relay sessions at the CP, which holds them.
                std::future::pending(),
            );
            tokio::select! {
                outcome = splice => {
                    let (to_guest, from_guest) = (outcome.to_guest, outcome.from_guest);
                    match outcome.end {
                        Ok(end) => info!(to_guest, from_guest, end = end.as_str(), "relay session closed"),
                        // Dropped without close_notify: the CP tells the client it failed.
                        Err(e) => info!(to_guest, from_guest, error = %e, "relay session failed"),
                    }
                }
                // Dropped without close_notify as well: the CP finds the VM
                // migrating or moved and tells the client to connect again.
                () = gone => info!("relay session ended: the guest left this node"),
            }
        }
        .instrument(span)
        .await;
    }

    /// `ADOPT <session> <len>`: a session handed over by the node its guest
    /// left, `len` bytes that follow; answered `OK` once its guest
    /// connection is restored here and it waits for its resume.
    async fn adopt<S>(&self, mut tls: S, session: String, len: usize)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        use tokio::io::AsyncReadExt;
        let mut blob = vec![0u8; len];
        let read = tokio::time::timeout(Duration::from_secs(30), tls.read_exact(&mut blob)).await;
        if !matches!(read, Ok(Ok(_))) {
            info!("handover not received in time");
            return;
        }
        let blob = bytes::Bytes::from(blob);
        // The VM id is in the handover; its target here is watched once the
        // guest arrives.
        let vm_id = match resumable::handover_vm(&blob) {
            Some(v) => v,
            None => return answer_err(&mut tls, Refusal::NotResumable("malformed handover".into())).await,
        };
        let gone = self.arrives_then_goes(&vm_id);
        let arrived = self.arrives(&vm_id);
        match resumable::adopt(
            self.sessions.clone(),
            blob,
            arrived,
            gone,
            self.limits.max_session,
            self.limits.guest_rto_min,
        ) {
            Ok(id) if id == session => {
                let _ = tls.write_all(b"OK\n").await;
                let _ = tls.shutdown().await;
            }
            Ok(id) => {
                info!(%id, "a handover named another session than its request");
                let _ = self.sessions.abort(&id).await;
                answer_err(
                    &mut tls,
                    Refusal::NotResumable("the handover names another session".into()),
                )
                .await
            }
            Err(reason) => {
                answer_err(
                    &mut tls,
                    Refusal::NotResumable(format!("cannot adopt the session: {reason}")),
                )
                .await
            }
        }
    }

    /// Connects to the serial console socket of QEMU guest `vm_id` here;
    /// with a future that resolves once the guest left this node (or its
    /// QEMU was replaced).
    async fn open_console(
        &self,
        vm_id: &str,
    ) -> Result<
        (
            tokio::net::UnixStream,
            impl std::future::Future<Output = ()> + Send + 'static,
        ),
        Refusal,
    > {
        let path = self.consoles.borrow().get(vm_id).cloned();
        let Some(path) = path else {
            return Err(Refusal::NoConsole(vm_id.to_owned()));
        };
        let console = tokio::net::UnixStream::connect(&path)
            .await
            .map_err(|e| Refusal::ConsoleBusy(vm_id.to_owned(), e.kind()))?;
        let mut consoles = self.consoles.subscribe();
        let vm_id = vm_id.to_owned();
        let gone = async move {
            if consoles.wait_for(|c| c.get(&vm_id) != Some(&path)).await.is_err() {
                // The relay itself is gone; the session ends with the process.
                std::future::pending::<()>().await;
            }
        };
        Ok((console, gone))
    }

    /// A resumable serial console session (`RESUMABLE <vm_id> 0 ...`): as
    /// [`Relay::console`], its stream outliving the control plane's
    /// connection like any resumable session's. It ends when the guest
    /// leaves this node: the console is QEMU's, here.
    async fn console_resumable<S>(&self, mut tls: S, req: &resume::OpenRequest<'_>, started: Instant)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let (console, gone) = match self.open_console(req.vm_id).await {
            Ok(c) => c,
            Err(r) => return answer_err(&mut tls, r).await,
        };
        if tls.write_all(b"OK\n").await.is_err() || tls.flush().await.is_err() {
            return;
        }
        info!(session = %req.session, setup_ms = started.elapsed().as_millis() as u64, "console session open (resumable)");
        resumable::run(
            self.sessions.clone(),
            resumable::Start::new(req, resumable::Guest::Console(console), Box::new(tls)),
            gone,
            self.limits.max_session,
        )
        .await;
    }

    /// A serial console session: the guest's console socket, spliced with
    /// the control plane's connection until either ends, or the guest
    /// leaves this node.
    async fn console<S>(&self, mut tls: S, vm_id: String, started: Instant)
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let (mut console, gone) = match self.open_console(&vm_id).await {
            Ok(c) => c,
            Err(r) => return answer_err(&mut tls, r).await,
        };
        if tls.write_all(b"OK\n").await.is_err() || tls.flush().await.is_err() {
            return;
        }
        info!(
            setup_ms = started.elapsed().as_millis() as u64,
            "console session open"
        );
        let splice = crate::splice::splice(
            &mut tls,
            &mut console,
            self.limits.splice_buffer,
            // A console sits idle for long stretches: only the session's
            // lifetime bounds it.
            self.limits.max_session,
            self.limits.max_session,
            std::future::pending(),
        );
        tokio::select! {
            outcome = splice => info!(to_guest = outcome.to_guest, from_guest = outcome.from_guest, "console session closed"),
            () = gone => info!("console session ended: the guest left this node"),
        }
    }
}
