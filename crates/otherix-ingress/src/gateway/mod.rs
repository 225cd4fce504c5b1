//! The ingress gateway (DESIGN §5, §6): its state (config, trusted keys,
//! replay guard, counters), and how it serves — the shared accept loop and
//! connection caps (`crate::listener`): a source at its share closed at once,
//! `503` over the limit — and draining open sessions at shutdown.
//!
//! Files, in the order a connection meets them: this one (accept, limits,
//! shutdown), `connection` (the checks, the dial, the session), then
//! `refused` (the one place refusals become HTTP responses), `replay`
//! (single use across restarts), `reports` (session starts and ends for the
//! control plane), `metrics`, `config`, `overlay` (what the gateway needs
//! from the node's overlays).

mod config;
mod connection;
mod metrics;
mod overlay;
mod refused;
mod replay;
mod reports;

pub use config::GatewayConfig;
pub use metrics::Counters;
pub use overlay::{DialSource, Overlay};
pub use refused::{credential_status, Fault, Refused, REFUSAL_CODES};

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use crate::live::Live;
use otherix_core::credential::{self, Claims, Expected, KeySet, Refusal};
use otherix_proto::agent::SessionEvent;

use crate::config::ConfigError;
use otherix_tls::handshakes::HandshakePool;
use time::OffsetDateTime;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tracing::Instrument;

use crate::listener::{self, Refusals};
use metrics::Metrics;
use otherix_core::conns::{Capped, ConnectionCaps, ConnectionSlot};
use replay::ReplayGuard;
use reports::Reports;

/// Connections over the limit that may be answered `503` at once; beyond
/// this they are closed without an answer (each answer costs a handshake).
const OVERLOAD_RESPONDERS: usize = 64;
/// Longest time spent answering a connection over the limit.
const OVERLOAD_ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause after a failed `accept` (such as EMFILE) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The gateway could not be built (the caller's fault or the file system's).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// A configuration field is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The replay file cannot be read or rewritten.
    #[error("replay file {path}: {source}")]
    ReplayFile {
        /// The configured path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The threads for TLS handshakes cannot be started.
    #[error("cannot start the TLS handshake threads: {0}")]
    Handshakes(#[source] io::Error),
}

/// An ingress gateway. Build it with [`Gateway::new`], give it keys with
/// [`Gateway::set_keys`] (until then every credential is refused as signed
/// by an unknown key), and serve with [`Gateway::run`].
pub struct Gateway<O> {
    pub(crate) config: GatewayConfig,
    pub(crate) overlay: O,
    keys: RwLock<Arc<KeySet>>,
    /// The `iss` credentials must carry, once known.
    issuer: RwLock<Option<Arc<str>>>,
    /// [`GatewayConfig::max_credential_lifetime`], as credentials count time.
    max_lifetime: time::Duration,
    replay: Mutex<ReplayGuard>,
    /// Sessions open now, and the revocations that end them.
    pub(crate) live: Arc<Live>,
    /// Connections open now, in any stage, under `limits.max_connections`
    /// and `limits.max_connections_per_source`.
    connections: Arc<ConnectionCaps>,
    /// Connections closed before any answer (a source over its share, a
    /// handshake past its deadline).
    pub(crate) closed: Arc<Refusals>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) reports: Reports,
    /// Where clients' TLS handshakes run: lower-priority threads, so a flood
    /// of them does not delay sessions' bytes (or, on a shared machine, the
    /// CP's heartbeats).
    pub(crate) handshakes: HandshakePool,
}

impl<O> std::fmt::Debug for Gateway<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("node", &self.config.node)
            .field("listen", &self.config.listen)
            .finish_non_exhaustive()
    }
}

impl<O: Overlay> Gateway<O> {
    /// Validates `config` and reloads the replay file, if one is configured.
    pub fn new(config: GatewayConfig, overlay: O) -> Result<Gateway<O>, GatewayError> {
        config.validate()?;
        let max_lifetime = time::Duration::try_from(config.max_credential_lifetime)
            .map_err(|_| ConfigError::new("gateway", "max_credential_lifetime", "is out of range"))?;
        let replay = ReplayGuard::open(
            config.replay_capacity,
            config.replay_file.as_deref(),
            OffsetDateTime::now_utc(),
        )
        .map_err(|source| GatewayError::ReplayFile {
            path: config.replay_file.clone().unwrap_or_default(),
            source,
        })?;
        let connections = ConnectionCaps::new(
            config.limits.max_connections,
            config.limits.max_connections_per_source,
        );
        let closed = Arc::new(Refusals::new("gateway"));
        Ok(Gateway {
            issuer: RwLock::new(config.issuer.as_deref().map(Arc::from)),
            max_lifetime,
            config,
            overlay,
            keys: RwLock::new(Arc::new(KeySet::new())),
            replay: Mutex::new(replay),
            live: Arc::default(),
            metrics: Arc::new(Metrics::new(connections.clone(), closed.clone())),
            connections,
            closed,
            reports: Reports::new(reports::CAPACITY),
            handshakes: HandshakePool::start().map_err(GatewayError::Handshakes)?,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    /// Replaces the trusted session public keys (the agent calls this after
    /// each heartbeat with the current and previous keys). Connections
    /// already verifying keep the set they started with.
    pub fn set_keys(&self, keys: KeySet) {
        tracing::debug!(kids = ?keys, "session keys replaced");
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
    }

    /// The trusted session public keys now.
    pub fn keys(&self) -> Arc<KeySet> {
        self.keys.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Sets the cluster id credentials must carry as `iss` (the agent calls
    /// this once it learns it from the control plane); `None` stops checking.
    pub fn set_issuer(&self, issuer: Option<&str>) {
        tracing::debug!(issuer, "credential issuer set");
        *self.issuer.write().unwrap_or_else(|p| p.into_inner()) = issuer.map(Arc::from);
    }

    /// The cluster id credentials must carry now, if one is known.
    pub fn issuer(&self) -> Option<Arc<str>> {
        self.issuer.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the revocations in force (the agent calls this after each
    /// heartbeat with the control plane's list): credentials they cover are
    /// refused from now on, and the sessions opened with them end at once
    /// with reason `revoked`.
    pub fn set_revocations(&self, revocations: Vec<otherix_proto::agent::Revocation>) {
        let entries = revocations.len();
        let ended = self.live.set_revocations(revocations);
        if ended > 0 {
            ::metrics::counter!("otherix_gateway_sessions_revoked_total").increment(ended as u64);
            tracing::info!(
                sessions = ended,
                revocations = entries,
                "revoked access ends open sessions"
            );
        }
    }

    /// The revocations in force.
    pub fn revocations(&self) -> Arc<Vec<otherix_proto::agent::Revocation>> {
        self.live.revocations()
    }

    /// Verifies `token` against the keys, issuer and limits in force now.
    pub(crate) fn verify(&self, token: &str, now: OffsetDateTime) -> Result<Claims, Refusal> {
        let issuer = self.issuer();
        let expected = Expected {
            audience: &self.config.node,
            issuer: issuer.as_deref(),
            max_lifetime: self.max_lifetime,
        };
        credential::verify(token, &self.keys(), &expected, now)
    }

    /// Sessions open now, by overlay network. The agent reports this in its
    /// heartbeat so the CP keeps this gateway on an overlay until they drain.
    pub fn sessions(&self) -> BTreeMap<String, u32> {
        self.metrics.sessions()
    }

    /// Takes the oldest `max` session reports (starts and ends) for the
    /// control plane. Give them back with [`Gateway::give_back_reports`] if
    /// they could not be delivered.
    pub fn take_reports(&self, max: usize) -> Vec<SessionEvent> {
        self.reports.take(max)
    }

    /// Returns undelivered reports to the front of the queue.
    pub fn give_back_reports(&self, events: Vec<SessionEvent>) {
        self.reports.give_back(events, &self.metrics);
    }

    /// The byte counts of at most `max` open sessions that moved since
    /// their last report (the longest unreported first), for the control
    /// plane's live view. Give them back with
    /// [`Gateway::give_back_session_bytes`] if they could not be delivered.
    pub fn take_session_bytes(&self, max: usize) -> Vec<otherix_proto::agent::SessionBytes> {
        self.live.moved_bytes(max).into_iter().map(|m| m.bytes).collect()
    }

    /// Undelivered byte counts: those sessions go with the next report.
    pub fn give_back_session_bytes(&self, bytes: &[otherix_proto::agent::SessionBytes]) {
        self.live.unreport_sessions(bytes);
    }

    /// A snapshot of the counters.
    pub fn counters(&self) -> Counters {
        self.metrics.snapshot()
    }

    /// Credentials in the replay cache now (used ones, until they expire).
    pub fn replay_cache_len(&self) -> usize {
        self.replay().len()
    }

    /// The counters in the Prometheus text exposition format.
    pub fn metrics_text(&self) -> String {
        self.metrics.text()
    }

    pub(crate) fn replay(&self) -> MutexGuard<'_, ReplayGuard> {
        // A panic while holding the guard cannot leave it half-updated in a
        // way that admits a replay: entries are only ever added.
        self.replay.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Binds [`GatewayConfig::listen`] and runs until `shutdown` completes.
    pub async fn serve(
        self: Arc<Self>,
        tls: Arc<rustls::ServerConfig>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        let listener = TcpListener::bind(self.config.listen).await?;
        self.run(listener, tls, shutdown).await
    }

    /// Serves connections from `listener` with `tls` until `shutdown`
    /// completes; then stops accepting and lets open sessions go on until
    /// they end or [`GatewayConfig::drain_timeout`] passes, and returns.
    ///
    /// `tls` is used with ALPN `http/1.1` (set here if it says otherwise);
    /// [`crate::server_config`] builds one.
    pub async fn run(
        self: Arc<Self>,
        listener: TcpListener,
        tls: Arc<rustls::ServerConfig>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> io::Result<()> {
        let acceptor = TlsAcceptor::from(crate::tls::with_http11_alpn(tls));
        let overload = Arc::new(Semaphore::new(OVERLOAD_RESPONDERS));
        tracing::info!(
            addr = %listener.local_addr()?,
            node = %self.config.node,
            "gateway listening"
        );
        let mut tasks = listener::accept_until(
            listener,
            shutdown,
            ACCEPT_BACKOFF,
            |tcp, peer, tasks| self.dispatch(tcp, peer, &acceptor, &overload, tasks),
            |e| tracing::warn!(error = %e, "accept failed"),
        )
        .await;
        tracing::info!(open = tasks.len(), "gateway stopped accepting; draining sessions");
        let drain = async {
            while let Some(joined) = tasks.join_next().await {
                listener::log_join(joined);
            }
        };
        if tokio::time::timeout(self.config.drain_timeout, drain)
            .await
            .is_err()
        {
            tracing::warn!(
                left = tasks.len(),
                "drain timeout passed; closing the remaining sessions"
            );
            tasks.shutdown().await;
        }
        tracing::info!("gateway stopped");
        Ok(())
    }

    /// Hands an accepted connection to its own task; from a source at its
    /// share of the connections, closes it at once; over the connection
    /// limit, hands it to a task that answers `503`.
    fn dispatch(
        self: &Arc<Self>,
        tcp: TcpStream,
        peer: SocketAddr,
        acceptor: &TlsAcceptor,
        overload: &Arc<Semaphore>,
        tasks: &mut JoinSet<()>,
    ) {
        let span = tracing::info_span!(
            "connection",
            %peer,
            vm = tracing::field::Empty,
            port = tracing::field::Empty,
            net = tracing::field::Empty,
            sub = tracing::field::Empty,
            jti = tracing::field::Empty,
        );
        let gateway = Arc::clone(self);
        let acceptor = acceptor.clone();
        match self.connections.try_open(peer.ip()) {
            Ok(slot) => {
                tasks.spawn(gateway.connection(tcp, peer, acceptor, slot).instrument(span));
            }
            // One host flooding: an answer would cost a handshake it could
            // hold open too.
            Err(Capped::PerSource) => self.closed.refused("max_connections_per_source", peer),
            Err(_) => match Arc::clone(overload).try_acquire_owned() {
                Ok(permit) => {
                    tasks.spawn(gateway.turn_away(tcp, acceptor, permit).instrument(span));
                }
                Err(_) => {
                    self.metrics.refused(Refused::TooManyConnections.code());
                    tracing::debug!(%peer, "over the connection limit; closed without an answer");
                }
            },
        }
    }

    /// Answers `503` to a connection over the limit.
    async fn turn_away(
        self: Arc<Self>,
        tcp: TcpStream,
        acceptor: TlsAcceptor,
        _permit: OwnedSemaphorePermit,
    ) {
        let deadline = self.config.limits.handshake_timeout.min(OVERLOAD_ANSWER_TIMEOUT);
        let handshake = tokio::time::timeout(deadline, acceptor.accept(tcp));
        match self.handshakes.run(handshake).await {
            Some(Ok(Ok(mut tls))) => self.refuse(&mut tls, &Refused::TooManyConnections).await,
            _ => self.metrics.refused(Refused::TooManyConnections.code()),
        }
    }

    /// Keeps a connection slot for the life of one connection.
    async fn connection(
        self: Arc<Self>,
        tcp: TcpStream,
        peer: SocketAddr,
        acceptor: TlsAcceptor,
        mut slot: ConnectionSlot,
    ) {
        self.handle(tcp, peer, acceptor, &mut slot).await;
    }
}
