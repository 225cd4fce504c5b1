//! The relay endpoint (DESIGN §6), run while the node has one granted (by
//! default port 7444 on a hypervisor's VTEP; `otherix node update --relay`):
//! how the control plane reaches guests on this node's host-local bridges,
//! which no gateway shares an L2 with.
//!
//! ```text
//! CP ──mutual TLS──▶ accept: the client certificate chains to the cluster CA
//!                    and names exactly `control-plane.otherix` (a node's does not)
//!    ──"RELAY <vm_id> <port>\n"──▶ vm_id → lease IP of a guest on a bridge of this
//!                    node, from the desired state (never an address from the wire)
//!    ◀──"OK\n" | "ERR <reason>\n"── dial ip:port from the bridge's address
//!    ◀══ splice, half-close both ways (TLS close_notify ⇄ TCP FIN) ══▶ guest
//! ```
//!
//! The request line must arrive within [`Limits::request_timeout`] of the TCP
//! accept (TLS handshake included) and be at most `otherix_proto::relay::MAX_LINE`
//! bytes. The serving certificate is the relay's own (serverAuth only,
//! `NODE.relay.otherix` and the granted address, from [`super::serving`]): the
//! CP dials by that name and checks that it issued the certificate to the
//! VM's node and has not revoked it.
//!
//! [`RelayRole`] runs it in the agent: the targets come from every desired state
//! (also the saved one, so a restarted agent relays before its first heartbeat),
//! and the listener is (re)bound after every heartbeat attempt — on the granted
//! address, or where `--relay-listen` says.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use otherix_client::Client;
use otherix_core::ipam::Ipv4Cidr;
use otherix_proto::agent::{CertPurpose, DesiredState};
use otherix_proto::relay;
use otherix_tls as tls;
use otherix_tls::san::CertInfo;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn, Instrument};

use super::identity::Identity;
use super::serving::{CertSlot, Served, ServingCert, Validity};

/// The relay port when `--relay-listen` names none.
pub use otherix_proto::relay::DEFAULT_PORT;

// ------------------------------------------------------------------ config

/// Where the relay endpoint listens (`--relay-listen`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelayListen {
    /// No relay: this node hosts no bridge guests.
    Off,
    /// This port on the node's VTEP address (the default, port 7444).
    Vtep(u16),
    /// Exactly this address, advertised as is.
    Addr(SocketAddr),
}

impl FromStr for RelayListen {
    type Err = String;

    /// `off`, `:PORT` (the VTEP address) or `IP:PORT`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "off" {
            return Ok(RelayListen::Off);
        }
        if let Some(port) = s.strip_prefix(':') {
            return port
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .map(RelayListen::Vtep)
                .ok_or_else(|| format!("invalid relay port in {s:?}"));
        }
        s.parse::<SocketAddr>()
            .ok()
            .filter(|a| a.port() != 0)
            .map(RelayListen::Addr)
            .ok_or_else(|| format!("invalid --relay-listen {s:?}: expected IP:PORT, :PORT or off"))
    }
}

impl RelayListen {
    /// The address to bind and advertise, once the VTEP is known.
    pub fn address(self, vtep: Option<Ipv4Addr>) -> Option<SocketAddr> {
        match self {
            RelayListen::Off => None,
            RelayListen::Vtep(port) => vtep.map(|ip| SocketAddr::from((ip, port))),
            RelayListen::Addr(a) => Some(a),
        }
    }
}

/// Timeouts and bounds of the endpoint.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// From TCP accept to the end of the request line (TLS handshake included).
    pub request_timeout: Duration,
    /// Dialing the guest.
    pub dial_timeout: Duration,
    /// A session with no byte either way for this long is closed.
    pub idle_timeout: Duration,
    /// A session is closed this long after it opened, busy or not.
    pub max_session: Duration,
    /// Connections beyond this many are closed at once.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            request_timeout: Duration::from_secs(10),
            dial_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(3600),
            max_session: otherix_ingress::DEFAULT_MAX_SESSION,
            max_connections: 10_000,
        }
    }
}

// ----------------------------------------------------------------- targets

/// A guest the relay may dial: its lease IP, and this node's address on its
/// bridge (the dial's source).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub ip: Ipv4Addr,
    pub source: Ipv4Addr,
}

/// VM id → target.
pub type Targets = BTreeMap<String, Target>;

/// The guests of `desired` that sit on a bridge this node hosts, with a lease
/// inside that bridge's subnet. Overlay guests are the gateways' business. A
/// guest being handed over to another node is none: its sessions end here, and
/// new ones reach it on its new node.
pub fn targets(desired: &DesiredState) -> Targets {
    let bridges: BTreeMap<&str, Ipv4Cidr> = desired
        .bridges
        .iter()
        .map(|b| (b.network.as_str(), b.address))
        .collect();
    desired
        .guests
        .iter()
        .filter(|g| g.migrate_to.is_none())
        .filter_map(|g| {
            let bridge = bridges.get(g.network.as_str())?;
            let (ip, source) = (g.address.addr(), bridge.addr());
            (bridge.contains(ip) && ip != source).then(|| (g.vm_id.clone(), Target { ip, source }))
        })
        .collect()
}

// --------------------------------------------------------------------- TLS

/// Accepts a client certificate only if it chains to the cluster CA and its
/// DNS names are exactly [`relay::CP_CLIENT_NAME`]: node certificates chain
/// to the same CA, so the chain alone would let any node in.
#[derive(Debug)]
struct ControlPlaneOnly {
    inner: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for ControlPlaneOnly {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner.verify_client_cert(end_entity, intermediates, now)?;
        match CertInfo::parse(end_entity.as_ref()).map(|c| c.dns_names) {
            Ok(names) if names == [relay::CP_CLIENT_NAME] => Ok(ClientCertVerified::assertion()),
            Ok(names) => {
                info!(
                    ?names,
                    "relay refused a client certificate that is not the control plane's"
                );
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName,
                ))
            }
            Err(reason) => Err(rustls::Error::General(reason)),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The endpoint's TLS with a fixed certificate and key: [`server_config_with`].
pub fn server_config(cert_pem: &str, key_pem: &str, ca_pem: &str) -> Result<rustls::ServerConfig, String> {
    let fixed = Validity {
        not_before: 0,
        not_after: 0,
    };
    let served = Served::parse(cert_pem, key_pem, ca_pem, fixed)?;
    server_config_with(CertSlot::new(served.certified()?), ca_pem)
}

/// The endpoint's TLS: the relay serving certificate (and the CA) that
/// `resolver` holds, the control plane's client certificate required.
pub fn server_config_with(
    resolver: Arc<dyn rustls::server::ResolvesServerCert>,
    ca_pem: &str,
) -> Result<rustls::ServerConfig, String> {
    let provider = tls::provider();
    let ca = tls::cert_from_pem(ca_pem)?;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca.clone())
        .map_err(|e| format!("cluster CA certificate is unusable: {e}"))?;
    let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| format!("client certificate verifier: {e}"))?;
    Ok(rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(Arc::new(ControlPlaneOnly { inner }))
        .with_cert_resolver(resolver))
}

// ---------------------------------------------------------------- endpoint

/// The endpoint: who may call it, where each VM id leads.
pub struct Relay {
    acceptor: TlsAcceptor,
    /// Watched by every session: one whose guest is no longer a target here
    /// (migrated away, deleted) ends at once.
    targets: watch::Sender<Targets>,
    limits: Limits,
    slots: Arc<Semaphore>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// Why a request gets `ERR`: the reason line the CP passes on.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("malformed request")]
    Malformed,
    #[error("vm {0} is not a guest on a bridge of this node")]
    UnknownVm(String),
    #[error("cannot reach {0}: {1}")]
    Unreachable(SocketAddr, String),
}

impl Relay {
    pub fn new(config: rustls::ServerConfig, limits: Limits) -> Relay {
        Relay {
            acceptor: TlsAcceptor::from(Arc::new(config)),
            targets: watch::Sender::new(Targets::new()),
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
        }
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
        tokio::pin!(shutdown);
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(x) => x,
                    Err(e) => {
                        warn!(error = %e, "relay accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = &mut shutdown => return,
            };
            let Ok(slot) = self.slots.clone().try_acquire_owned() else {
                warn!(%peer, max = self.limits.max_connections, "relay at its connection limit; closing");
                continue;
            };
            let relay = self.clone();
            let span = tracing::info_span!("relay", %peer);
            tokio::spawn(
                async move {
                    relay.connection(tcp).await;
                    drop(slot);
                }
                .instrument(span),
            );
        }
    }

    /// One connection from accept to the end of its session.
    async fn connection(&self, tcp: TcpStream) {
        let _ = tcp.set_nodelay(true);
        let started = Instant::now();
        let opened = tokio::time::timeout(self.limits.request_timeout, async {
            let tls = self.acceptor.accept(tcp).await?;
            let line = read_line(tls).await?;
            Ok::<_, std::io::Error>(line)
        })
        .await;
        let (mut tls, line) = match opened {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => {
                // A client without the CP's certificate ends here.
                info!(error = %e, "relay connection refused");
                return;
            }
            Err(_) => {
                info!("relay request not complete in time");
                return;
            }
        };
        let (vm_id, port) = match line.as_deref().and_then(relay::parse_request_line) {
            Some(x) => x,
            None => return answer_err(&mut tls, Refusal::Malformed).await,
        };
        let span = tracing::info_span!("session", vm_id = %vm_id, port);
        let dialed = async {
            let target = self
                .target(vm_id)
                .ok_or_else(|| Refusal::UnknownVm(vm_id.to_owned()))?;
            let addr = SocketAddr::from((target.ip, port));
            let dial = async {
                let socket = TcpSocket::new_v4()?;
                socket.bind(SocketAddr::from((target.source, 0)))?;
                socket.connect(addr).await
            };
            match tokio::time::timeout(self.limits.dial_timeout, dial).await {
                Ok(Ok(guest)) => Ok((guest, addr, target)),
                Ok(Err(e)) => Err(Refusal::Unreachable(addr, e.to_string())),
                Err(_) => Err(Refusal::Unreachable(addr, "timed out".into())),
            }
        }
        .instrument(span.clone())
        .await;
        let (mut guest, addr, target) = match dialed {
            Ok(x) => x,
            Err(r) => return answer_err(&mut tls, r).instrument(span).await,
        };
        let gone = self.gone(vm_id, target);
        async {
            let _ = guest.set_nodelay(true);
            if tls.write_all(b"OK\n").await.is_err() || tls.flush().await.is_err() {
                return;
            }
            info!(%addr, setup_ms = started.elapsed().as_millis() as u64, "relay session open");
            let splice = otherix_ingress::splice(
                &mut tls,
                &mut guest,
                64 * 1024,
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
}

/// Reads the request line (without its `\n`), one byte at a time so that
/// nothing after it is consumed; `None` when it is too long or not UTF-8.
async fn read_line<S: tokio::io::AsyncRead + Unpin>(mut stream: S) -> std::io::Result<(S, Option<String>)> {
    let mut line = Vec::with_capacity(64);
    let mut byte = [0u8; 1];
    loop {
        if stream.read(&mut byte).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if byte[0] == b'\n' {
            return Ok((stream, String::from_utf8(line).ok()));
        }
        if line.len() >= relay::MAX_LINE {
            return Ok((stream, None));
        }
        line.push(byte[0]);
    }
}

async fn answer_err<S: tokio::io::AsyncWrite + Unpin>(stream: &mut S, refusal: Refusal) {
    info!(reason = %refusal, "relay request refused");
    let line = format!("ERR {refusal}\n");
    let _ = stream.write_all(line.as_bytes()).await;
    let _ = stream.shutdown().await;
}

// -------------------------------------------------------------------- role

/// The running listener.
struct Listening {
    addr: SocketAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// The relay role of this agent, run while the node has a relay endpoint
/// granted: its serving certificate, the endpoint and its listener.
pub(super) struct RelayRole {
    /// Where to listen instead of the granted address (`--relay-listen`).
    listen: Option<RelayListen>,
    /// The endpoint the control plane dials (granted).
    granted: SocketAddr,
    ca_pem: String,
    cert: ServingCert,
    /// The endpoint, once there is a certificate to serve.
    relay: Option<Arc<Relay>>,
    limits: Limits,
    targets: Targets,
    listening: Option<Listening>,
    /// A failure to bind was logged at warn; quieter until it clears.
    bind_trouble: bool,
}

impl RelayRole {
    /// The relay for the granted endpoint `granted`, knowing the guests of
    /// the saved desired state at once, and serving at once when the saved
    /// certificate still fits.
    pub(super) fn start(
        listen: Option<RelayListen>,
        granted: SocketAddr,
        identity: &Identity,
        dir: &std::path::Path,
        desired: Option<&DesiredState>,
        limits: Limits,
    ) -> RelayRole {
        let mut role = RelayRole {
            listen,
            granted,
            ca_pem: identity.ca_pem.clone(),
            cert: ServingCert::load(
                CertPurpose::Relay,
                &identity.node,
                granted.ip(),
                dir,
                &identity.ca_pem,
            ),
            relay: None,
            limits,
            targets: Targets::new(),
            listening: None,
            bind_trouble: false,
        };
        role.update(desired);
        role.build();
        role
    }

    /// The endpoint the control plane dials.
    pub(super) fn granted(&self) -> SocketAddr {
        self.granted
    }

    /// Takes in a desired state: the guests it may relay to.
    pub(super) fn update(&mut self, desired: Option<&DesiredState>) {
        if let Some(d) = desired {
            self.targets = targets(d);
            if let Some(r) = &self.relay {
                r.set_targets(self.targets.clone());
            }
        }
    }

    /// After a heartbeat: a certificate if there is none yet or renewal is
    /// due (`client`: the heartbeat was answered), then bind (or rebind,
    /// when the address moved) and serve; called after every heartbeat
    /// attempt, successful or not.
    pub(super) async fn after_heartbeat(&mut self, client: Option<&Client>, vtep: Option<Ipv4Addr>) {
        if let Some(client) = client {
            self.cert.refresh(client).await;
            self.build();
        }
        let addr = match self.listen {
            Some(l) => l.address(vtep),
            None => Some(self.granted),
        };
        let (Some(addr), Some(relay)) = (addr, self.relay.clone()) else {
            return;
        };
        if let Some(l) = &self.listening {
            if l.addr == addr && !l.task.is_finished() {
                return;
            }
        }
        if let Some(old) = self.listening.take() {
            let _ = old.stop.send(());
        }
        let listener = match TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) if !self.bind_trouble => {
                self.bind_trouble = true;
                warn!(%addr, error = %e, "cannot listen for relay connections; retrying after each heartbeat");
                return;
            }
            Err(e) => {
                debug!(%addr, error = %e, "still cannot listen for relay connections");
                return;
            }
        };
        self.bind_trouble = false;
        info!(%addr, granted = %self.granted, "relay listening");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            relay
                .run(listener, async {
                    let _ = stopped.await;
                })
                .await;
        });
        self.listening = Some(Listening { addr, stop, task });
    }

    /// The endpoint, once the certificate is there.
    fn build(&mut self) {
        if self.relay.is_some() {
            return;
        }
        let Some(slot) = self.cert.slot() else {
            return;
        };
        match server_config_with(slot, &self.ca_pem) {
            Ok(config) => {
                let relay = Arc::new(Relay::new(config, self.limits));
                relay.set_targets(self.targets.clone());
                self.relay = Some(relay);
            }
            Err(e) => warn!(error = %e, "cannot build the relay's TLS configuration"),
        }
    }

    /// Stops accepting. Open sessions end with the agent process.
    pub(super) async fn stop(mut self) {
        if let Some(l) = self.listening.take() {
            let _ = l.stop.send(());
            let _ = l.task.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use otherix_proto::agent::{BridgeState, GuestState, OverlayState};
    use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::AsyncBufReadExt;
    use tokio_rustls::TlsConnector;

    use super::*;

    fn guest(vm_id: &str, network: &str, address: &str) -> GuestState {
        GuestState {
            vm_id: vm_id.into(),
            name: format!("vm-{vm_id}"),
            network: network.into(),
            network_id: format!("id-{network}"),
            mac: "02:00:00:00:00:09".parse().unwrap(),
            address: address.parse().unwrap(),
            gateway: Ipv4Addr::UNSPECIFIED,
            exec: None,
            migrate_to: None,
        }
    }

    #[test]
    fn only_guests_on_bridges_of_this_node_are_targets() {
        let desired = DesiredState {
            bridges: vec![BridgeState {
                network: "lab".into(),
                network_id: "id-lab".into(),
                subnet: "10.214.1.0/24".parse().unwrap(),
                address: "10.214.1.1/24".parse().unwrap(),
            }],
            overlays: vec![OverlayState {
                network: "ov".into(),
                network_id: "id-ov".into(),
                vni: 100,
                subnet: "10.100.0.0/24".parse().unwrap(),
                address: "10.100.0.2/24".parse().unwrap(),
                mac: "02:00:00:00:00:01".parse().unwrap(),
                fdb: vec![],
                neighbors: vec![],
            }],
            guests: vec![
                guest("aa01", "lab", "10.214.1.5/24"),
                guest("aa02", "ov", "10.100.0.7/24"),
                guest("aa03", "lab", "10.99.0.5/24"),
                guest("aa04", "lab", "10.214.1.1/24"),
                guest("aa05", "gone", "10.214.1.6/24"),
                GuestState {
                    migrate_to: Some(otherix_proto::agent::MigrateTo {
                        node: "node2".into(),
                        netns: "ns-node2".into(),
                        bridge: "oxlid-lab".into(),
                    }),
                    ..guest("aa06", "lab", "10.214.1.7/24")
                },
            ],
            ..Default::default()
        };
        let t = targets(&desired);
        assert_eq!(
            t,
            Targets::from([(
                "aa01".to_string(),
                Target {
                    ip: Ipv4Addr::new(10, 214, 1, 5),
                    source: Ipv4Addr::new(10, 214, 1, 1)
                }
            )]),
            "overlay guests, leases outside the subnet, the node's own address, unknown bridges \
             and guests being handed over are left out"
        );
    }

    #[test]
    fn relay_listen_parses_off_port_and_address() {
        assert_eq!("off".parse(), Ok(RelayListen::Off));
        assert_eq!(":7444".parse(), Ok(RelayListen::Vtep(7444)));
        assert_eq!(
            "10.0.0.1:9".parse(),
            Ok(RelayListen::Addr("10.0.0.1:9".parse().unwrap()))
        );
        for bad in [":0", ":x", "host:7444", "10.0.0.1", "10.0.0.1:0", ""] {
            assert!(bad.parse::<RelayListen>().is_err(), "{bad}");
        }
        assert_eq!(RelayListen::Vtep(7444).address(None), None);
        assert_eq!(
            RelayListen::Vtep(7444).address(Some(Ipv4Addr::new(10, 0, 0, 2))),
            Some("10.0.0.2:7444".parse().unwrap())
        );
    }

    // ------------------------------------------------------- in-process endpoint

    /// A cluster CA and certificates it signs, as the CP's PKI makes them.
    struct Pki {
        ca_pem: String,
        issuer: Issuer<'static, KeyPair>,
    }

    impl Pki {
        fn new(name: &str) -> Pki {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            let ca = params.self_signed(&key).unwrap();
            Pki {
                ca_pem: ca.pem(),
                issuer: Issuer::new(params, key),
            }
        }

        /// (cert, key) for `name` with the given usages.
        fn issue(&self, name: &str, usages: Vec<ExtendedKeyUsagePurpose>) -> (String, String) {
            let key = KeyPair::generate().unwrap();
            let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
            params.extended_key_usages = usages;
            let cert = params.signed_by(&key, &self.issuer).unwrap();
            (cert.pem(), key.serialize_pem())
        }

        fn node(&self, name: &str) -> (String, String) {
            self.issue(
                name,
                vec![
                    ExtendedKeyUsagePurpose::ClientAuth,
                    ExtendedKeyUsagePurpose::ServerAuth,
                ],
            )
        }

        fn control_plane(&self) -> (String, String) {
            self.issue(relay::CP_CLIENT_NAME, vec![ExtendedKeyUsagePurpose::ClientAuth])
        }
    }

    /// An echo guest on 127.0.0.1 that counts the connections it accepts.
    async fn echo_guest() -> (SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        let seen = count.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                seen.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        (addr, count)
    }

    const VM: &str = "abc123";

    /// node1's relay endpoint on 127.0.0.1, with VM [`VM`] at 127.0.0.1.
    async fn endpoint(pki: &Pki, limits: Limits) -> SocketAddr {
        endpoint_and_relay(pki, limits).await.0
    }

    async fn endpoint_and_relay(pki: &Pki, limits: Limits) -> (SocketAddr, Arc<Relay>) {
        let (cert, key) = pki.node("node1");
        let relay = Arc::new(Relay::new(
            server_config(&cert, &key, &pki.ca_pem).unwrap(),
            limits,
        ));
        relay.set_targets(Targets::from([(
            VM.to_string(),
            Target {
                ip: Ipv4Addr::LOCALHOST,
                source: Ipv4Addr::LOCALHOST,
            },
        )]));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(relay.clone().run(listener, std::future::pending()));
        (addr, relay)
    }

    /// A TLS client of the endpoint, presenting `identity` (or nothing),
    /// trusting `ca_pem`, expecting the server to be `node1`.
    async fn call(
        addr: SocketAddr,
        ca_pem: &str,
        identity: Option<&(String, String)>,
        line: &str,
    ) -> std::io::Result<(String, tokio_rustls::client::TlsStream<TcpStream>)> {
        let ca = tls::cert_from_pem(ca_pem).unwrap();
        let config = match identity {
            Some((cert, key)) => tls::pinned_client_config_with_identity(ca, cert, key).unwrap(),
            None => tls::pinned_client_config(ca).unwrap(),
        };
        let tcp = TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from("node1").unwrap();
        let mut tls = TlsConnector::from(Arc::new(config)).connect(name, tcp).await?;
        tls.write_all(line.as_bytes()).await?;
        tls.flush().await?;
        let mut reader = tokio::io::BufReader::new(tls);
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut answer))
            .await
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
        if answer.is_empty() {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        assert!(reader.buffer().is_empty());
        Ok((answer, reader.into_inner()))
    }

    #[tokio::test]
    async fn the_control_plane_is_relayed_to_the_guest_with_half_close() {
        let pki = Pki::new("cluster CA");
        let (guest, accepted) = echo_guest().await;
        let addr = endpoint(&pki, Limits::default()).await;
        let cp = pki.control_plane();
        let (answer, mut tls) = call(
            addr,
            &pki.ca_pem,
            Some(&cp),
            &relay::request_line(VM, guest.port()),
        )
        .await
        .unwrap();
        assert_eq!(answer, "OK\n");
        tls.write_all(b"ping through the relay").await.unwrap();
        tls.shutdown().await.unwrap();
        let mut back = Vec::new();
        tls.read_to_end(&mut back).await.unwrap();
        assert_eq!(
            back, b"ping through the relay",
            "the echo came back after our half-close"
        );
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_session_ends_at_once_when_its_guest_leaves_the_node() {
        let pki = Pki::new("cluster CA");
        let (guest, _) = echo_guest().await;
        let (addr, relay) = endpoint_and_relay(&pki, Limits::default()).await;
        let line = relay::request_line(VM, guest.port());
        let (answer, mut tls) = call(addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
            .await
            .unwrap();
        assert_eq!(answer, "OK\n");
        tls.write_all(b"before").await.unwrap();
        let mut buf = [0u8; 6];
        tls.read_exact(&mut buf).await.unwrap();
        // Handed over to another node: no longer a target here.
        relay.set_targets(Targets::new());
        let mut rest = Vec::new();
        let end = tokio::time::timeout(Duration::from_secs(2), tls.read_to_end(&mut rest))
            .await
            .expect("the session ends at once, not at its idle timeout");
        assert_eq!(
            end.unwrap_err().kind(),
            std::io::ErrorKind::UnexpectedEof,
            "ended without close_notify, so the CP reports it rather than a clean end"
        );
        let (answer, _) = call(addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
            .await
            .unwrap();
        assert_eq!(
            answer,
            format!("ERR vm {VM} is not a guest on a bridge of this node\n")
        );
    }

    #[tokio::test]
    async fn a_node_certificate_is_refused_and_nothing_is_dialed() {
        let pki = Pki::new("cluster CA");
        let (guest, accepted) = echo_guest().await;
        let addr = endpoint(&pki, Limits::default()).await;
        let line = relay::request_line(VM, guest.port());
        // Another node's certificate: same CA, ClientAuth, but not the CP.
        let node2 = pki.node("node2");
        let err = call(addr, &pki.ca_pem, Some(&node2), &line).await.unwrap_err();
        debug!(%err, "node certificate");
        // A certificate naming the CP, from another CA.
        let other = Pki::new("another CA");
        let forged = other.control_plane();
        assert!(call(addr, &pki.ca_pem, Some(&forged), &line).await.is_err());
        // No certificate at all.
        assert!(call(addr, &pki.ca_pem, None, &line).await.is_err());
        // A certificate naming the CP and more.
        let key = KeyPair::generate().unwrap();
        let mut params =
            CertificateParams::new(vec![relay::CP_CLIENT_NAME.to_string(), "node2".into()]).unwrap();
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let both = (
            params.signed_by(&key, &pki.issuer).unwrap().pem(),
            key.serialize_pem(),
        );
        assert!(call(addr, &pki.ca_pem, Some(&both), &line).await.is_err());

        assert_eq!(
            accepted.load(Ordering::SeqCst),
            0,
            "a refused caller reached the guest"
        );
        // The CP's own certificate still works.
        let (answer, _) = call(addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
            .await
            .unwrap();
        assert_eq!(answer, "OK\n");
    }

    #[tokio::test]
    async fn unknown_vms_and_addresses_on_the_wire_get_err_without_a_dial() {
        let pki = Pki::new("cluster CA");
        let (guest, accepted) = echo_guest().await;
        let addr = endpoint(&pki, Limits::default()).await;
        let cp = pki.control_plane();
        let port = guest.port();
        for (line, want) in [
            (
                relay::request_line("ffff", port),
                "ERR vm ffff is not a guest on a bridge of this node\n",
            ),
            (format!("RELAY 127.0.0.1 {port}\n"), "ERR malformed request\n"),
            (
                format!("RELAY {VM} {port} 127.0.0.1\n"),
                "ERR malformed request\n",
            ),
            (format!("CONNECT 127.0.0.1:{port}\n"), "ERR malformed request\n"),
            (
                format!("RELAY {VM} {}\n", "9".repeat(600)),
                "ERR malformed request\n",
            ),
        ] {
            let (answer, _) = call(addr, &pki.ca_pem, Some(&cp), &line).await.unwrap();
            assert_eq!(answer, want, "{line}");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 0);
        // A known VM on a closed port: ERR with the reason, not a hang.
        let closed = TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let (answer, _) = call(addr, &pki.ca_pem, Some(&cp), &relay::request_line(VM, closed))
            .await
            .unwrap();
        assert!(answer.starts_with("ERR cannot reach 127.0.0.1:"), "{answer}");
    }

    #[tokio::test]
    async fn a_caller_that_never_sends_its_request_is_dropped_in_time() {
        let pki = Pki::new("cluster CA");
        let limits = Limits {
            request_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        let addr = endpoint(&pki, limits).await;
        let cp = pki.control_plane();
        let ca = tls::cert_from_pem(&pki.ca_pem).unwrap();
        let config = tls::pinned_client_config_with_identity(ca, &cp.0, &cp.1).unwrap();
        let tcp = TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("node1").unwrap();
        let mut tls = TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .unwrap();
        tls.write_all(b"RELAY abc").await.unwrap();
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest)).await;
        assert!(read.is_ok(), "closed by the endpoint, not left hanging");
        assert!(rest.is_empty());
    }
}
