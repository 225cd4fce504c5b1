//! The HTTPS listener: TLS with the cluster-CA-signed serving certificate,
//! HTTP/1.1, timeouts against slow clients, and graceful shutdown.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use otherix_core::conns::{Capped, ConnectionCaps, ConnectionSlot, Throttle};
use otherix_tls::handshakes::HandshakePool;
use rustls::pki_types::CertificateDer;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::pki::ServingIdentity;

/// A client has this long to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// ...and this long to send a request's headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections still open this long after shutdown began are dropped.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Who is at the other end of a connection: the `sha256:` fingerprint of
/// the verified client certificate, if it presented one (nodes are
/// recognized by it), and the address the connection comes from (a node's
/// VTEP, unless an admin set one).
#[derive(Debug, Clone)]
pub struct PeerCert {
    pub fingerprint: Option<Arc<str>>,
    pub addr: SocketAddr,
}

/// TLS for the API. Client certificates are optional (people use bearer
/// tokens), but one that is presented must chain to the cluster CA.
pub fn tls_acceptor(identity: ServingIdentity, ca: CertificateDer<'static>) -> anyhow::Result<TlsAcceptor> {
    let provider = otherix_tls::provider();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).context("cluster CA")?;
    let client_verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .allow_unauthenticated()
            .build()
            .context("client certificate verifier")?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS protocol versions")?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(identity.chain, identity.key)
        .context("loading the serving certificate")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Caps on open connections: in all, and from one source address, so
/// that one client's flood of (slow) connections cannot take every
/// descriptor and starve nodes' heartbeats and other clients. A connection
/// past a cap is closed at once, counted, and logged (at most once a
/// second).
///
/// Past `max`, `node_reserve` more connections are kept for nodes: such a
/// connection must finish its TLS handshake within [`RESERVE_HANDSHAKE`]
/// presenting a client certificate of the cluster CA (which only nodes and
/// the CP hold), or it is closed; one source address gets at most
/// [`RESERVE_PER_IP`] of them. So a flood that fills the public slots
/// leaves heartbeats answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    pub max: usize,
    pub per_ip: usize,
    pub node_reserve: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max: 10_000,
            per_ip: 1_000,
            node_reserve: 1_000,
        }
    }
}

/// Addresses nodes have called from (authenticated by their certificate):
/// only these may take a connection from the nodes' reserve, so strangers
/// flooding the public slots cannot hold the reserve too, whatever their
/// number of source addresses. Bounded: past [`MAX_NODE_SOURCES`] the set
/// starts over (nodes calling again refill it within a heartbeat).
#[derive(Debug, Default)]
pub struct NodeSources(std::sync::RwLock<HashSet<IpAddr>>);

/// Most node addresses remembered.
pub const MAX_NODE_SOURCES: usize = 100_000;

impl NodeSources {
    pub fn insert(&self, ip: IpAddr) {
        if self.contains(ip) {
            return;
        }
        let mut set = self.0.write().unwrap_or_else(|p| p.into_inner());
        if set.len() >= MAX_NODE_SOURCES {
            set.clear();
        }
        set.insert(ip);
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        self.0.read().unwrap_or_else(|p| p.into_inner()).contains(&ip)
    }
}

/// Descriptors kept for what is not a client connection: the store's
/// connections, listeners, files, the metrics endpoint.
pub const FIXED_DESCRIPTORS: u64 = 256;

impl ConnLimits {
    /// These caps fitted to `nofile` open files: every connection holds a
    /// descriptor and a relay session a second (its node's), so the caps
    /// together take at most half of what is left after
    /// [`FIXED_DESCRIPTORS`]. Caps the limit can carry are kept; otherwise
    /// the nodes' reserve keeps a tenth and the public slots the rest. Past
    /// a cap a connection is refused at once, where past the descriptors
    /// every accept would fail and the reserve could not help.
    pub fn fit_to_descriptors(self, nofile: u64) -> ConnLimits {
        let usable = usize::try_from(nofile.saturating_sub(FIXED_DESCRIPTORS) / 2).unwrap_or(usize::MAX);
        if self.max.saturating_add(self.node_reserve) <= usable {
            return self;
        }
        let node_reserve = self.node_reserve.min(usable / 10).max(1);
        let max = usable.saturating_sub(node_reserve).max(1);
        ConnLimits {
            max,
            per_ip: self.per_ip.min(max),
            node_reserve,
        }
    }
}

/// A reserved connection's handshake must be done this soon (a node's takes
/// milliseconds).
pub const RESERVE_HANDSHAKE: Duration = Duration::from_secs(2);
/// Reserved connections one source address may hold (a node needs a few:
/// heartbeat, desired-state wait, certificate renewal).
pub const RESERVE_PER_IP: usize = 8;

/// A connection's place: held for its life, given back when dropped.
struct Slot {
    /// From the nodes' reserve rather than the public slots.
    reserved: bool,
    conn: ConnectionSlot,
}

impl Slot {
    fn new(reserved: bool, slot: ConnectionSlot) -> Slot {
        open_gauge(reserved).increment(1.0);
        Slot { reserved, conn: slot }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        open_gauge(self.reserved).decrement(1.0);
    }
}

/// Connections open now, by the slots they hold.
fn open_gauge(reserved: bool) -> metrics::Gauge {
    let slots = if reserved { "reserved" } else { "public" };
    metrics::gauge!("otherix_connections_open", "slots" => slots)
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains.
pub async fn serve(
    listener: TcpListener,
    acceptor: TlsAcceptor,
    app: Router,
    limits: ConnLimits,
    node_sources: Arc<NodeSources>,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    // The public slots, and the nodes' reserve past them (the caps gateways
    // and relay endpoints keep too: `otherix_core::conns`).
    let public = ConnectionCaps::new(limits.max, limits.per_ip);
    let reserve = (limits.node_reserve > 0).then(|| ConnectionCaps::new(limits.node_reserve, RESERVE_PER_IP));
    let refusals_logged = Throttle::new(Duration::from_secs(1));
    let accept_failures_logged = Throttle::new(Duration::from_secs(1));
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(64 * 1024);
    let builder = Arc::new(builder.http1_only());
    // Handshakes run on their own, lower-priority threads; requests on this
    // runtime (see `otherix_tls::handshakes`).
    let handshakes = Arc::new(HandshakePool::start().context("handshake threads")?);
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(x) => x,
                Err(e) => {
                    // Out of file descriptors and the like: back off, keep
                    // serving; said once a second, with how many since.
                    metrics::counter!("otherix_accept_failures_total").increment(1);
                    if let Some(failures) = accept_failures_logged.event(std::time::Instant::now()) {
                        tracing::warn!(error = %e, failures, "accept failed");
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let capped = |reason: &'static str| {
            metrics::counter!("otherix_connections_refused_total", "reason" => reason).increment(1);
            if let Some(refused) = refusals_logged.event(std::time::Instant::now()) {
                tracing::warn!(%peer, reason, refused, "connection refused: over a connection cap");
            }
        };
        let slot = match public.try_open(peer.ip()) {
            Ok(slot) => Slot::new(false, slot),
            Err(Capped::PerSource) => {
                capped("max_connections_per_ip");
                continue;
            }
            Err(_) => {
                // Past the cap: only a node may have one of the reserved,
                // from an address a node has called from.
                let reserved = reserve
                    .as_ref()
                    .filter(|_| node_sources.contains(peer.ip()))
                    .and_then(|reserve| reserve.try_open(peer.ip()).ok());
                match reserved {
                    Some(slot) => Slot::new(true, slot),
                    None => {
                        capped("max_connections");
                        continue;
                    }
                }
            }
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        let builder = builder.clone();
        let watcher = graceful.watcher();
        let handshakes = handshakes.clone();
        tokio::spawn(async move {
            let reserved = slot.reserved;
            // Held for the connection's life.
            let mut slot = slot;
            let handshake = if reserved {
                RESERVE_HANDSHAKE
            } else {
                HANDSHAKE_TIMEOUT
            };
            // Cut when the handshakes are at their budget and this is the
            // busiest source's oldest (`otherix_core::conns`).
            let cut = slot.conn.cut();
            let handshake = async move {
                tokio::select! {
                    done = tokio::time::timeout(handshake, acceptor.accept(tcp)) => Some(done),
                    () = cut => None,
                }
            };
            let tls = match handshakes.run(handshake).await {
                None => return,
                Some(None) => {
                    metrics::counter!("otherix_connections_refused_total", "reason" => "handshake_cut")
                        .increment(1);
                    tracing::debug!(%peer, "TLS handshake cut for a newcomer");
                    return;
                }
                Some(Some(Ok(Ok(tls)))) => {
                    slot.conn.established();
                    tls
                }
                Some(Some(Ok(Err(e)))) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Some(Some(Err(_))) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            let peer_cert = PeerCert {
                fingerprint: tls
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|c| c.first())
                    .map(|c| Arc::from(otherix_tls::fingerprint(c.as_ref()))),
                addr: peer,
            };
            if reserved && peer_cert.fingerprint.is_none() {
                metrics::counter!("otherix_connections_refused_total", "reason" => "reserved_for_nodes")
                    .increment(1);
                tracing::debug!(%peer, "over the connection cap without a node certificate; closed");
                return;
            }
            if reserved {
                metrics::counter!("otherix_connections_reserved_total").increment(1);
            }
            let app = app.map_request(move |mut req: http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(peer_cert.clone());
                req
            });
            let service = TowerToHyperService::new(app);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
            if let Err(e) = watcher.watch(conn.into_owned()).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    // Handshakes still under way end with the pool (its last reference may
    // be a connection's).
    drop(handshakes);
    tokio::select! {
        _ = graceful.shutdown() => tracing::info!("all connections drained"),
        _ = tokio::time::sleep(DRAIN_TIMEOUT) => tracing::warn!("drain timed out; closing remaining connections"),
    }
    Ok(())
}

pub async fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

#[cfg(test)]
mod tests {
    use super::ConnLimits;

    #[test]
    fn caps_are_fitted_to_the_descriptors_and_kept_when_they_fit() {
        let asked = ConnLimits::default();
        assert_eq!(
            asked.fit_to_descriptors(1 << 20),
            asked,
            "a high limit carries them"
        );
        let fitted = asked.fit_to_descriptors(1024);
        // (1024 - 256) / 2 = 384: a tenth for nodes, the rest public.
        assert_eq!((fitted.max, fitted.node_reserve, fitted.per_ip), (346, 38, 346));
        assert!(fitted.max + fitted.node_reserve <= 384);
        let tiny = asked.fit_to_descriptors(100);
        assert!(tiny.max >= 1 && tiny.node_reserve >= 1);
    }
}
