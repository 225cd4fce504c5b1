//! The gateway role (`otherix agent --gateway ADDR:PORT`, DESIGN §4–§6): the agent
//! runs an [`otherix_gateway::Gateway`] beside its sync loop and feeds it.
//!
//! ```text
//! start            session-keys.json ──▶ set_keys        saved desired ──▶ overlay view, issuer
//!                  gateway.crt still fits --gateway? ──▶ bind, serve (before any heartbeat)
//! heartbeat out    sessions ◀── gateway.sessions()
//! heartbeat back   overlays ──▶ overlay view      session_keys ──▶ set_keys (+ saved when changed)
//!                  cluster_id ──▶ set_issuer (credentials must carry it as `iss`)
//!                  no certificate yet, or due for renewal? ──▶ key, CSR, POST /v1/agent/gateway-cert
//!                  ──▶ saved ──▶ serve (or swapped in under the running listener)
//! shutdown         stop accepting; open sessions drain (at most the gateway's drain_timeout)
//! ```
//!
//! While the control plane is unreachable nothing is withdrawn: the trusted keys stay
//! (credentials minted before the outage are accepted until they expire), the overlay
//! view stays, open sessions flow, and a restarted agent serves again from its data
//! directory (certificate, keys, replay file, desired state) without the control plane.
//!
//! The gateway library does the per-connection work; this module only wires it: the
//! [`Overlay`] implementation over netlink, files, and the serving certificate.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use otherix_api::agent::{
    DesiredState, GatewayCertRequest, SessionEvent, SessionPublicKey, MAX_SESSION_EVENTS,
};
use otherix_api::{tls, Client};
use otherix_core::credential::KeySet;
use otherix_gateway::{Gateway, GatewayConfig, Overlay};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

use super::error::one_line;
use super::files::{self, GATEWAY_CERT_FILE, GATEWAY_KEY_FILE, REPLAY_FILE, SESSION_KEYS_FILE};
use super::names::overlay_bridge;
use super::DaemonError;
use crate::net::Netlink;

/// A serving certificate is renewed when it has less than this left (the CP issues
/// them for a year).
const RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// Longest wait for the control plane to sign a serving certificate.
const CERT_TIMEOUT: Duration = Duration::from_secs(10);

// ------------------------------------------------------------------ the overlay

/// This node's membership of one overlay, as the gateway needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Member {
    /// The overlay's VNI: its bridge is `oxb{vni}`.
    pub vni: u32,
    /// This node's own lease on the overlay: dials to guests leave from it.
    pub address: Ipv4Addr,
}

/// Overlay network name → this node's membership.
pub type OverlayView = BTreeMap<String, Member>;

/// The `iss` credentials must carry, once the control plane has said it (a
/// desired state saved by an older agent or from an older CP has none: not
/// checked until the next heartbeat answer brings it).
pub fn issuer(desired: &DesiredState) -> Option<&str> {
    Some(desired.cluster_id.as_str()).filter(|c| !c.is_empty())
}

/// The overlays of a desired state, by network name (the credential's `net`).
/// An overlay whose address does not parse is left out (the reconciler reports it).
pub fn overlay_view(desired: &DesiredState) -> OverlayView {
    desired
        .overlays
        .iter()
        .filter_map(|o| {
            let ip = o.address.split_once('/').map_or(o.address.as_str(), |(ip, _)| ip);
            let address = ip.parse().ok()?;
            Some((o.network.clone(), Member { vni: o.vni, address }))
        })
        .collect()
}

/// [`Overlay`] over the kernel: the neighbor table of the overlay's bridge (the
/// static entries the reconciler programs from the control plane's leases), and
/// this node's lease address from the last desired state.
#[derive(Clone, Debug)]
pub struct NetlinkOverlay {
    nl: Netlink,
    view: Arc<RwLock<OverlayView>>,
}

impl NetlinkOverlay {
    pub fn new(nl: Netlink) -> NetlinkOverlay {
        NetlinkOverlay {
            nl,
            view: Arc::default(),
        }
    }

    /// Replaces the view (after each heartbeat answer).
    pub fn set_view(&self, view: OverlayView) {
        let mut current = self.view.write().unwrap_or_else(|p| p.into_inner());
        if *current != view {
            debug!(overlays = ?view.keys().collect::<Vec<_>>(), "gateway overlay view updated");
            *current = view;
        }
    }

    fn member(&self, network: &str) -> Option<Member> {
        self.view
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(network)
            .copied()
    }
}

impl Overlay for NetlinkOverlay {
    fn neighbor_mac(
        &self,
        network: &str,
        ip: Ipv4Addr,
    ) -> impl std::future::Future<Output = Result<Option<[u8; 6]>, String>> + Send {
        let bridge = self.member(network).map(|m| overlay_bridge(m.vni));
        let nl = self.nl.clone();
        async move {
            // Not a member of that overlay: there is no entry to match.
            let Some(bridge) = bridge else {
                return Ok(None);
            };
            nl.neighbor_mac(&bridge, ip).await.map_err(|e| one_line(&e))
        }
    }

    fn source_address(&self, network: &str) -> Option<Ipv4Addr> {
        self.member(network).map(|m| m.address)
    }
}

// ---------------------------------------------------------------- session keys

/// The control plane's public session keys as a [`KeySet`]; a malformed entry is
/// skipped (and named in the second value) rather than costing the others.
pub fn keyset(keys: &[SessionPublicKey]) -> (KeySet, Vec<String>) {
    let mut set = KeySet::new();
    let mut bad = Vec::new();
    for k in keys {
        let ok = hex::decode(&k.public)
            .ok()
            .is_some_and(|public| set.insert(k.kid.clone(), &public).is_ok());
        if !ok {
            bad.push(k.kid.clone());
        }
    }
    (set, bad)
}

/// The keys saved by the last run, if any (an unreadable file counts as none).
fn load_keys(dir: &Path) -> Option<Vec<SessionPublicKey>> {
    let path = dir.join(SESSION_KEYS_FILE);
    let text = match files::read_optional(&path) {
        Ok(text) => text?,
        Err(e) => {
            warn!(error = %e, "ignoring unreadable saved session keys");
            return None;
        }
    };
    serde_json::from_str(&text)
        .inspect_err(|e| warn!(path = %path.display(), error = %e, "ignoring unreadable saved session keys"))
        .ok()
}

fn save_keys(dir: &Path, keys: &[SessionPublicKey]) -> Result<(), DaemonError> {
    let path = dir.join(SESSION_KEYS_FILE);
    let bytes = serde_json::to_vec_pretty(keys).map_err(|e| DaemonError::io("encode", &path, e.into()))?;
    // Public halves: nothing secret, but nobody else's to change.
    files::write_atomic(&path, &bytes, 0o644)
}

// ---------------------------------------------------------- serving certificate

/// Whether a gateway certificate serves `ip` for `node`: issued by the cluster CA
/// `ca_pem`, naming both, and valid at `now` (unix seconds). Returns its expiry.
pub fn check_cert(cert_pem: &str, ca_pem: &str, node: &str, ip: IpAddr, now: i64) -> Result<i64, String> {
    use x509_parser::extensions::GeneralName;
    let der = tls::cert_from_pem(cert_pem)?;
    let ca_der = tls::cert_from_pem(ca_pem)?;
    let (_, cert) =
        x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| format!("unreadable: {e}"))?;
    let (_, ca) =
        x509_parser::parse_x509_certificate(ca_der.as_ref()).map_err(|e| format!("unreadable CA: {e}"))?;
    if cert.issuer().as_raw() != ca.subject().as_raw() {
        return Err("not issued by the cluster CA".into());
    }
    let names: Vec<GeneralName<'_>> = cert
        .subject_alternative_name()
        .map_err(|e| format!("unreadable SAN: {e}"))?
        .map(|ext| ext.value.general_names.clone())
        .unwrap_or_default();
    let ip_bytes: Vec<u8> = match ip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    if !names
        .iter()
        .any(|n| matches!(n, GeneralName::IPAddress(b) if *b == ip_bytes.as_slice()))
    {
        return Err(format!("does not name {ip}"));
    }
    if !names
        .iter()
        .any(|n| matches!(n, GeneralName::DNSName(d) if *d == node))
    {
        return Err(format!("does not name node {node}"));
    }
    let validity = cert.validity();
    if now < validity.not_before.timestamp() {
        return Err("not valid yet".into());
    }
    let not_after = validity.not_after.timestamp();
    if now >= not_after {
        return Err("expired".into());
    }
    Ok(not_after)
}

/// The serving certificate in force. The listener's TLS configuration resolves
/// through it, so a renewed certificate is swapped in without closing anything.
#[derive(Debug)]
struct CertSlot(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

/// A certificate and key ready to serve.
struct Served {
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    not_after: i64,
}

impl Served {
    fn parse(cert_pem: &str, key_pem: &str, ca_pem: &str, not_after: i64) -> Result<Served, String> {
        let leaf = tls::cert_from_pem(cert_pem)?;
        let ca = tls::cert_from_pem(ca_pem)?;
        let key = rcgen::KeyPair::from_pem(key_pem).map_err(|e| format!("unreadable key: {e}"))?;
        Ok(Served {
            chain: vec![leaf, ca],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
            not_after,
        })
    }

    fn certified(&self) -> Result<Arc<CertifiedKey>, String> {
        let signer = rustls::crypto::ring::sign::any_supported_type(&self.key).map_err(|e| e.to_string())?;
        let certified = CertifiedKey::new(self.chain.clone(), signer);
        certified
            .keys_match()
            .map_err(|e| format!("key does not match the certificate: {e}"))?;
        Ok(Arc::new(certified))
    }
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

// -------------------------------------------------------------------- the role

/// What the listener serves with.
struct Tls {
    /// The certificate in force, swapped on renewal.
    slot: Arc<CertSlot>,
    config: Arc<rustls::ServerConfig>,
    /// Its expiry, unix seconds.
    not_after: i64,
}

/// The running listener.
struct Listening {
    stop: oneshot::Sender<()>,
    task: JoinHandle<()>,
}

/// The gateway role of this agent: the gateway, what it serves with, its listener.
pub(super) struct GatewayRole {
    listen: SocketAddr,
    node: String,
    dir: PathBuf,
    ca_pem: String,
    overlay: NetlinkOverlay,
    gateway: Arc<Gateway<NetlinkOverlay>>,
    /// This run of the gateway, in every heartbeat: a new value tells the
    /// CP that sessions of the previous run are over.
    epoch: String,
    /// The keys last handed to the gateway, as the control plane sent them.
    keys: Option<Vec<SessionPublicKey>>,
    /// The serving certificate, once there is one.
    tls: Option<Tls>,
    listening: Option<Listening>,
    /// A failure to get a certificate or to bind was logged at warn; quieter until it clears.
    cert_trouble: bool,
    bind_trouble: bool,
}

impl GatewayRole {
    /// Builds the gateway from what the data directory holds (replay file, keys,
    /// certificate) and `desired` (the saved desired state), and starts serving at
    /// once if the saved certificate still fits `listen`.
    pub(super) async fn start(
        listen: SocketAddr,
        node: &str,
        dir: &Path,
        ca_pem: &str,
        nl: Netlink,
        desired: Option<&DesiredState>,
        max_credential_lifetime: Duration,
    ) -> Result<GatewayRole, DaemonError> {
        let overlay = NetlinkOverlay::new(nl);
        if let Some(d) = desired {
            overlay.set_view(overlay_view(d));
        }
        let mut config = GatewayConfig::new(listen, node);
        config.replay_file = Some(dir.join(REPLAY_FILE));
        config.issuer = desired.and_then(issuer).map(str::to_owned);
        config.max_credential_lifetime = max_credential_lifetime;
        let gateway = Gateway::new(config, overlay.clone())
            .map_err(|e| DaemonError::Config(format!("gateway: {}", one_line(&e))))?;
        let mut role = GatewayRole {
            listen,
            node: node.to_owned(),
            dir: dir.to_owned(),
            ca_pem: ca_pem.to_owned(),
            overlay,
            gateway: Arc::new(gateway),
            epoch: new_epoch(),
            keys: None,
            tls: None,
            listening: None,
            cert_trouble: false,
            bind_trouble: false,
        };
        if let Some(keys) = load_keys(dir) {
            info!(
                keys = keys.len(),
                "trusting the saved session keys until the control plane answers"
            );
            role.set_keys(keys, false);
        }
        match role.load_cert() {
            Ok(Some(served)) => role.install(served),
            Ok(None) => {}
            Err(reason) => {
                info!(%reason, "the saved gateway certificate does not fit; a new one is asked for after the first heartbeat")
            }
        }
        role.listen().await;
        Ok(role)
    }

    /// Open sessions per overlay network, for the heartbeat.
    pub(super) fn sessions(&self) -> BTreeMap<String, u32> {
        self.gateway.sessions()
    }

    /// This run's id, for the heartbeat.
    pub(super) fn epoch(&self) -> &str {
        &self.epoch
    }

    /// Session starts and ends for the next heartbeat, oldest first.
    pub(super) fn take_reports(&self) -> Vec<SessionEvent> {
        self.gateway.take_reports(MAX_SESSION_EVENTS)
    }

    /// Reports a heartbeat failed to deliver: they go with the next one.
    pub(super) fn give_back_reports(&self, events: Vec<SessionEvent>) {
        self.gateway.give_back_reports(events);
    }

    /// Takes in a heartbeat answer: the overlay view and the trusted keys; gets a
    /// serving certificate if there is none yet (or it is due for renewal) and
    /// makes sure the listener runs.
    pub(super) async fn after_heartbeat(&mut self, desired: &DesiredState, client: &Client) {
        self.overlay.set_view(overlay_view(desired));
        if self.keys.as_deref() != Some(desired.session_keys.as_slice()) {
            self.set_keys(desired.session_keys.clone(), true);
        }
        if let Some(cluster) = issuer(desired) {
            if self.gateway.issuer().as_deref() != Some(cluster) {
                info!(cluster, "gateway accepts credentials of this cluster only");
                self.gateway.set_issuer(Some(cluster));
            }
        }
        let due = self
            .tls
            .as_ref()
            .is_none_or(|t| t.not_after - unix_now() < RENEW_BEFORE.as_secs() as i64);
        if due {
            match self.request_cert(client).await {
                Ok(served) => {
                    self.cert_trouble = false;
                    self.install(served);
                }
                Err(reason) if !self.cert_trouble => {
                    self.cert_trouble = true;
                    warn!(%reason, "cannot get a gateway serving certificate; retrying after each heartbeat");
                }
                Err(reason) => debug!(%reason, "gateway certificate still unavailable"),
            }
        }
        self.listen().await;
    }

    /// Stops accepting and waits for open sessions to end (or the drain timeout).
    pub(super) async fn stop(&mut self) {
        if let Some(l) = self.listening.take() {
            let _ = l.stop.send(());
            if let Err(e) = l.task.await {
                warn!(error = %e, "the gateway task failed");
            }
        }
    }

    fn set_keys(&mut self, keys: Vec<SessionPublicKey>, save: bool) {
        let (set, bad) = keyset(&keys);
        if !bad.is_empty() {
            warn!(kids = ?bad, "ignoring malformed session keys");
        }
        info!(kids = ?set, "gateway session keys");
        self.gateway.set_keys(set);
        if save {
            if let Err(e) = save_keys(&self.dir, &keys) {
                warn!(error = %e, "cannot save the session keys; a restart while the control plane is down would refuse every credential");
            }
        }
        self.keys = Some(keys);
    }

    /// The saved certificate and key, if both exist and still serve `listen`. One
    /// due for renewal is used too: the first heartbeat answer renews it.
    fn load_cert(&self) -> Result<Option<Served>, String> {
        let read = |name: &str| files::read_optional(&self.dir.join(name)).map_err(|e| e.to_string());
        let (Some(cert_pem), Some(key_pem)) = (read(GATEWAY_CERT_FILE)?, read(GATEWAY_KEY_FILE)?) else {
            return Ok(None);
        };
        let not_after = check_cert(&cert_pem, &self.ca_pem, &self.node, self.listen.ip(), unix_now())?;
        let served = Served::parse(&cert_pem, &key_pem, &self.ca_pem, not_after)?;
        served.certified()?;
        info!(file = %self.dir.join(GATEWAY_CERT_FILE).display(), "reusing the saved gateway certificate");
        Ok(Some(served))
    }

    /// A new key, signed by the control plane for this node's gateway endpoint
    /// (whose IP it takes from our heartbeat), saved key first, certificate last.
    async fn request_cert(&self, client: &Client) -> Result<Served, String> {
        let key = rcgen::KeyPair::generate().map_err(|e| format!("generating a key: {e}"))?;
        let csr_pem = rcgen::CertificateParams::new(vec![self.node.clone()])
            .and_then(|p| p.serialize_request(&key))
            .and_then(|csr| csr.pem())
            .map_err(|e| format!("building the CSR: {e}"))?;
        let req = GatewayCertRequest { csr_pem };
        let resp = tokio::time::timeout(CERT_TIMEOUT, client.gateway_cert(&req))
            .await
            .map_err(|_| format!("no answer within {CERT_TIMEOUT:?}"))?
            .map_err(|e| e.to_string())?;
        let not_after = check_cert(
            &resp.cert_pem,
            &self.ca_pem,
            &self.node,
            self.listen.ip(),
            unix_now(),
        )
        .map_err(|reason| format!("the control plane's certificate is unusable: {reason}"))?;
        let key_pem = key.serialize_pem();
        let served = Served::parse(&resp.cert_pem, &key_pem, &self.ca_pem, not_after)?;
        served.certified()?;
        let save = || -> Result<(), DaemonError> {
            files::write_atomic(&self.dir.join(GATEWAY_KEY_FILE), key_pem.as_bytes(), 0o600)?;
            files::write_atomic(&self.dir.join(GATEWAY_CERT_FILE), resp.cert_pem.as_bytes(), 0o644)
        };
        if let Err(e) = save() {
            // Serve anyway; a restart asks again.
            warn!(error = %e, "cannot save the gateway certificate");
        }
        info!(ip = %self.listen.ip(), "gateway serving certificate issued by the control plane");
        Ok(served)
    }

    /// Serves with `served`: the first time builds the TLS configuration, later
    /// swaps the certificate under the running listener.
    fn install(&mut self, served: Served) {
        let certified = match served.certified() {
            Ok(c) => c,
            Err(reason) => {
                warn!(%reason, "unusable gateway certificate");
                return;
            }
        };
        if let Some(tls) = &mut self.tls {
            *tls.slot.0.write().unwrap_or_else(|p| p.into_inner()) = certified;
            tls.not_after = served.not_after;
            info!("gateway serving certificate renewed");
            return;
        }
        // The library's configuration (ring, safe versions, ALPN http/1.1), with the
        // certificate behind our resolver so that renewal needs no new listener.
        let mut config = match otherix_gateway::server_config(served.chain, served.key) {
            Ok(c) => c,
            Err(e) => {
                warn!(error = %e, "unusable gateway certificate");
                return;
            }
        };
        let slot = Arc::new(CertSlot(RwLock::new(certified)));
        config.cert_resolver = slot.clone();
        self.tls = Some(Tls {
            slot,
            config: Arc::new(config),
            not_after: served.not_after,
        });
    }

    /// Binds and starts serving, once there is a certificate and unless it already
    /// does; called after every heartbeat, successful or not.
    pub(super) async fn listen(&mut self) {
        if self.listening.as_ref().is_some_and(|l| !l.task.is_finished()) {
            return;
        }
        let Some(tls) = &self.tls else {
            return;
        };
        let listener = match TcpListener::bind(self.listen).await {
            Ok(l) => l,
            Err(e) if !self.bind_trouble => {
                self.bind_trouble = true;
                warn!(addr = %self.listen, error = %e, "cannot listen for gateway connections; retrying after each heartbeat");
                return;
            }
            Err(e) => {
                debug!(addr = %self.listen, error = %e, "still cannot listen for gateway connections");
                return;
            }
        };
        self.bind_trouble = false;
        let (stop, stopped) = oneshot::channel::<()>();
        let gateway = self.gateway.clone();
        let tls = tls.config.clone();
        let task = tokio::spawn(async move {
            // A dropped sender (the agent going away) stops the gateway too.
            let shutdown = async {
                let _ = stopped.await;
            };
            if let Err(e) = gateway.run(listener, tls, shutdown).await {
                warn!(error = %e, "the gateway stopped");
            }
        });
        self.listening = Some(Listening { stop, task });
    }
}

/// A random id for this run of the gateway.
fn new_epoch() -> String {
    let mut bytes = [0u8; 8];
    // Without randomness, the clock still tells runs apart.
    if getrandom::fill(&mut bytes).is_err() {
        bytes = (unix_now() as u64).to_be_bytes();
    }
    hex::encode(bytes)
}

#[cfg(test)]
mod tests {
    use otherix_api::agent::OverlayState;

    use super::*;

    fn overlay(network: &str, vni: u32, address: &str) -> OverlayState {
        OverlayState {
            network: network.into(),
            network_id: format!("id-{network}"),
            vni,
            subnet: "10.100.0.0/24".into(),
            address: address.into(),
            mac: "02:00:00:00:00:01".into(),
            fdb: vec![],
            neighbors: vec![],
        }
    }

    #[test]
    fn the_overlay_view_maps_network_names_to_vni_and_own_lease() {
        let desired = DesiredState {
            overlays: vec![
                overlay("ov", 100, "10.100.0.2/24"),
                overlay("broken", 101, "not-an-ip/24"),
            ],
            ..Default::default()
        };
        let view = overlay_view(&desired);
        assert_eq!(
            view,
            BTreeMap::from([(
                "ov".to_string(),
                Member {
                    vni: 100,
                    address: Ipv4Addr::new(10, 100, 0, 2)
                }
            )])
        );
    }

    #[test]
    fn the_issuer_is_checked_once_the_control_plane_names_its_cluster() {
        let saved_before: DesiredState = serde_json::from_str(
            r#"{"version":1,"node":"gw","mtu":1450,"overlays":[],"bridges":[],"guests":[]}"#,
        )
        .unwrap();
        assert_eq!(
            issuer(&saved_before),
            None,
            "an older desired.json: not checked yet"
        );
        let desired = DesiredState {
            cluster_id: "c0ffee".into(),
            ..Default::default()
        };
        assert_eq!(issuer(&desired), Some("c0ffee"));
    }

    #[test]
    fn a_malformed_session_key_is_skipped_and_the_rest_trusted() {
        let good = hex::encode([7u8; 32]);
        let keys = vec![
            SessionPublicKey {
                kid: "a".into(),
                public: good.clone(),
            },
            SessionPublicKey {
                kid: "b".into(),
                public: "zz".into(),
            },
            SessionPublicKey {
                kid: "c".into(),
                public: hex::encode([1u8; 5]),
            },
        ];
        let (set, bad) = keyset(&keys);
        assert_eq!(set.kids().collect::<Vec<_>>(), ["a"]);
        assert_eq!(bad, ["b", "c"]);
    }

    #[test]
    fn session_keys_survive_a_restart_through_the_data_dir() {
        let dir = std::env::temp_dir().join(format!("otherix-agent-gwkeys-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        files::ensure_dir(&dir).unwrap();
        assert_eq!(load_keys(&dir), None);
        let keys = vec![SessionPublicKey {
            kid: "k1".into(),
            public: hex::encode([9u8; 32]),
        }];
        save_keys(&dir, &keys).unwrap();
        assert_eq!(load_keys(&dir), Some(keys));
        std::fs::write(dir.join(SESSION_KEYS_FILE), "{oops").unwrap();
        assert_eq!(load_keys(&dir), None, "a corrupt file is ignored, never fatal");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A CA named `ca_name` and a gateway certificate it signs for `sans`.
    fn issue(ca_name: &str, sans: &[&str]) -> (String, String, String) {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, ca_name);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem(), ca.pem())
    }

    #[test]
    fn a_saved_certificate_is_reused_only_for_the_same_endpoint_and_ca() {
        let (cert, key, ca) = issue("CA one", &["gw1", "10.213.1.5"]);
        let ip: IpAddr = "10.213.1.5".parse().unwrap();
        let now = unix_now();
        let not_after = check_cert(&cert, &ca, "gw1", ip, now).expect("fits");
        assert!(not_after > now);
        Served::parse(&cert, &key, &ca, not_after)
            .unwrap()
            .certified()
            .expect("key and certificate match");

        let err = check_cert(&cert, &ca, "gw1", "10.213.1.6".parse().unwrap(), now).unwrap_err();
        assert!(err.contains("does not name 10.213.1.6"), "{err}");
        let err = check_cert(&cert, &ca, "gw2", ip, now).unwrap_err();
        assert!(err.contains("node gw2"), "{err}");
        let (_, _, other_ca) = issue("CA two", &["x"]);
        let err = check_cert(&cert, &other_ca, "gw1", ip, now).unwrap_err();
        assert!(err.contains("cluster CA"), "{err}");
        let err = check_cert(&cert, &ca, "gw1", ip, not_after + 1).unwrap_err();
        assert!(err.contains("expired"), "{err}");

        let (_, other_key, _) = issue("CA one", &["gw1", "10.213.1.5"]);
        let err = Served::parse(&cert, &other_key, &ca, not_after)
            .unwrap()
            .certified()
            .map(|_| ())
            .unwrap_err();
        assert!(err.contains("does not match"), "{err}");
    }
}
