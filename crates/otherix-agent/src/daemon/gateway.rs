//! The gateway role (DESIGN §4–§6), run while an admin grants it (the join
//! token's or `otherix node update`'s `--gateway IP:PORT`): the agent runs an
//! [`otherix_ingress::Gateway`] beside its sync loop and feeds it.
//!
//! ```text
//! start            session-keys.json ──▶ set_keys        saved desired ──▶ overlay view
//!                  ca.crt (pinned at enrollment) names the cluster ──▶ issuer (`iss` checked at once)
//!                  gateway.crt still fits the address? ──▶ bind, serve (before any heartbeat)
//! heartbeat out    sessions ◀── gateway.sessions()
//! heartbeat back   overlays ──▶ overlay view      session_keys ──▶ set_keys (+ saved when changed)
//!                  cluster_id ──▶ set_issuer, if the CA did not name the cluster
//!                  revocations ──▶ set_revocations (covered sessions end, reason `revoked`)
//!                  no certificate yet, or due for renewal? ──▶ [`serving`] ──▶ serve
//!                  (or swapped in under the running listener)
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
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use otherix_client::Client;
use otherix_core::credential::KeySet;
use otherix_ingress::listener::Rebinding;
use otherix_ingress::{DialSource, Gateway, GatewayConfig, Overlay};
use otherix_proto::agent::{CertPurpose, DesiredState, SessionEvent, SessionPublicKey, MAX_SESSION_EVENTS};
use tracing::{debug, info, warn};

use super::files::{self, REPLAY_FILE, SESSION_KEYS_FILE};
use super::names::overlay_bridge;
use super::serving::{unix_now, ServingCert};
use super::DaemonError;
use crate::net::{NetError, Netlink};

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

/// The cluster this node enrolled in, as the cluster CA it pinned then names
/// it: known before the control plane has answered once, so the gateway
/// checks `iss` from its first connection. `None` for a CA that does not
/// name its cluster (then the desired state's id is the one, see [`issuer`]).
pub fn enrolled_cluster(ca_pem: &str) -> Option<String> {
    let der = otherix_tls::cert_from_pem(ca_pem).ok()?;
    otherix_tls::san::CertInfo::cluster_of_ca(der.as_ref())
        .ok()
        .flatten()
}

/// The overlays of a desired state, by network name (the credential's `net`).
pub fn overlay_view(desired: &DesiredState) -> OverlayView {
    desired
        .overlays
        .iter()
        .map(|o| {
            let member = Member {
                vni: o.vni,
                address: o.address.addr(),
            };
            (o.network.clone(), member)
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
    type Error = NetError;

    fn neighbor_mac(
        &self,
        network: &str,
        ip: Ipv4Addr,
    ) -> impl std::future::Future<Output = Result<Option<[u8; 6]>, NetError>> + Send {
        let bridge = self.member(network).map(|m| overlay_bridge(m.vni));
        let nl = self.nl.clone();
        async move {
            // Not a member of that overlay: there is no entry to match.
            let Some(bridge) = bridge else {
                return Ok(None);
            };
            nl.neighbor_mac(&bridge, ip).await
        }
    }

    fn dial_source(&self, network: &str) -> Option<DialSource> {
        self.member(network).map(|m| DialSource {
            address: m.address,
            device: overlay_bridge(m.vni),
        })
    }
}

// ---------------------------------------------------------------- session keys

/// The control plane's public session keys as a [`KeySet`], each trusted until
/// its `not_after` (so a retired key stops being trusted on time even while the
/// control plane is unreachable); a malformed entry is skipped (and named in
/// the second value) rather than costing the others.
pub fn keyset(keys: &[SessionPublicKey]) -> (KeySet, Vec<String>) {
    let mut set = KeySet::new();
    let mut bad = Vec::new();
    for k in keys {
        let ok = hex::decode(&k.public)
            .ok()
            .is_some_and(|public| set.insert_until(k.kid.clone(), &public, k.not_after).is_ok());
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

// -------------------------------------------------------------------- the role

/// The gateway role of this agent: the gateway, what it serves with, its listener.
pub(super) struct GatewayRole {
    listen: SocketAddr,
    dir: PathBuf,
    overlay: NetlinkOverlay,
    gateway: Arc<Gateway<NetlinkOverlay>>,
    /// This run of the gateway, in every heartbeat: a new value tells the
    /// CP that sessions of the previous run are over.
    epoch: String,
    /// The keys last handed to the gateway, as the control plane sent them.
    keys: Option<Vec<SessionPublicKey>>,
    /// The cluster the pinned CA names: the issuer, whatever a desired
    /// state says (see [`enrolled_cluster`]).
    enrolled: Option<String>,
    /// The serving certificate (for the granted address).
    cert: ServingCert,
    /// What the listener serves with, once there is a certificate.
    tls: Option<Arc<rustls::ServerConfig>>,
    listener: Rebinding,
}

impl GatewayRole {
    /// Builds the gateway from what the data directory holds (replay file, keys,
    /// certificate) and `desired` (the saved desired state), and starts serving at
    /// once if the saved certificate still fits `listen`, the granted address.
    /// The node, data directory and session limits come from the agent's
    /// `agent` configuration.
    pub(super) async fn start(
        listen: SocketAddr,
        agent: &super::Config,
        ca_pem: &str,
        nl: Netlink,
        desired: Option<&DesiredState>,
    ) -> Result<GatewayRole, DaemonError> {
        let (node, dir) = (agent.node.as_str(), agent.data_dir.as_path());
        let overlay = NetlinkOverlay::new(nl);
        if let Some(d) = desired {
            overlay.set_view(overlay_view(d));
        }
        let mut config = GatewayConfig::new(listen, node);
        config.replay_file = Some(dir.join(REPLAY_FILE));
        let enrolled = enrolled_cluster(ca_pem);
        config.issuer = enrolled
            .clone()
            .or_else(|| desired.and_then(issuer).map(str::to_owned));
        match &config.issuer {
            Some(cluster) => info!(cluster, "gateway accepts credentials of this cluster only"),
            None => warn!("the cluster id is not known yet; credentials' issuer is not checked until the control plane names it"),
        }
        config.max_credential_lifetime = agent.max_credential_lifetime;
        config.limits = agent.gateway_limits();
        config.max_sessions_per_principal = agent.gateway_max_sessions_per_principal;
        config.replay_share_per_principal = agent
            .gateway_max_sessions_per_principal
            .saturating_mul(10)
            .min(config.replay_capacity);
        let gateway = Gateway::new(config, overlay.clone())?;
        // Access taken away before a restart stays taken away until the
        // control plane answers.
        if let Some(d) = desired {
            gateway.set_revocations(d.revocations.clone());
        }
        let mut role = GatewayRole {
            listen,
            dir: dir.to_owned(),
            overlay,
            gateway: Arc::new(gateway),
            epoch: new_epoch(),
            keys: None,
            enrolled,
            cert: ServingCert::load(CertPurpose::Gateway, node, listen.ip(), dir, ca_pem),
            tls: None,
            listener: Rebinding::new("gateway"),
        };
        if let Some(keys) = load_keys(dir) {
            info!(
                keys = keys.len(),
                "trusting the saved session keys until the control plane answers"
            );
            role.set_keys(keys, false);
        }
        role.build_tls();
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

    /// Byte counts of open sessions that moved, for the next heartbeat.
    pub(super) fn take_session_bytes(&self) -> Vec<otherix_proto::agent::SessionBytes> {
        self.gateway
            .take_session_bytes(otherix_proto::agent::MAX_SESSION_BYTES)
    }

    /// Byte counts a heartbeat failed to deliver: they go with the next one.
    pub(super) fn give_back_session_bytes(&self, bytes: &[otherix_proto::agent::SessionBytes]) {
        self.gateway.give_back_session_bytes(bytes);
    }

    /// Takes in a heartbeat answer: the overlay view and the trusted keys; gets a
    /// serving certificate if there is none yet (or it is due for renewal) and
    /// makes sure the listener runs.
    pub(super) async fn after_heartbeat(&mut self, desired: &DesiredState, client: &Client) {
        self.overlay.set_view(overlay_view(desired));
        self.gateway.set_revocations(desired.revocations.clone());
        if self.keys.as_deref() != Some(desired.session_keys.as_slice()) {
            self.set_keys(desired.session_keys.clone(), true);
        }
        match (issuer(desired), &self.enrolled) {
            (Some(said), Some(enrolled)) if said != enrolled => {
                warn!(said, enrolled = %enrolled, "the control plane names another cluster than the CA this node enrolled with; still accepting only the enrolled one's credentials");
            }
            (Some(cluster), None) if self.gateway.issuer().as_deref() != Some(cluster) => {
                info!(cluster, "gateway accepts credentials of this cluster only");
                self.gateway.set_issuer(Some(cluster));
            }
            _ => {}
        }
        self.cert.refresh(client).await;
        self.build_tls();
        self.listen().await;
    }

    /// The gateway itself (its counters, for `/metrics`).
    pub(super) fn gateway(&self) -> Arc<Gateway<NetlinkOverlay>> {
        self.gateway.clone()
    }

    /// The address it serves (the granted one).
    pub(super) fn address(&self) -> SocketAddr {
        self.listen
    }

    /// Stops accepting and waits for open sessions to end (or the drain timeout).
    pub(super) async fn stop(&mut self) {
        self.listener.stop().await;
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

    /// The listener's TLS configuration, once there is a certificate (the
    /// library's ring, safe versions and ALPN http/1.1, the certificate
    /// resolved through the slot so that renewal needs no new listener).
    fn build_tls(&mut self) {
        if self.tls.is_some() {
            return;
        }
        let Some(slot) = self.cert.slot() else {
            return;
        };
        match otherix_ingress::server_config_with_resolver(slot) {
            Ok(config) => self.tls = Some(Arc::new(config)),
            Err(e) => warn!(error = %e, "cannot build the gateway's TLS configuration"),
        }
    }

    /// Binds and starts serving, once there is a certificate and unless it already
    /// does; called after every heartbeat, successful or not.
    pub(super) async fn listen(&mut self) {
        let Some(tls) = self.tls.clone() else {
            return;
        };
        let gateway = self.gateway.clone();
        self.listener
            .ensure(self.listen, |listener, shutdown| async move {
                if let Err(e) = gateway.run(listener, tls, shutdown).await {
                    warn!(error = %e, "the gateway stopped");
                }
            })
            .await;
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
    use otherix_proto::agent::OverlayState;

    use super::*;

    fn overlay(network: &str, vni: u32, address: &str) -> OverlayState {
        OverlayState {
            network: network.into(),
            network_id: format!("id-{network}"),
            vni,
            subnet: "10.100.0.0/24".parse().unwrap(),
            address: address.parse().unwrap(),
            mac: "02:00:00:00:00:01".parse().unwrap(),
            fdb: vec![],
            neighbors: vec![],
        }
    }

    #[test]
    fn the_overlay_view_maps_network_names_to_vni_and_own_lease() {
        let desired = DesiredState {
            overlays: vec![overlay("ov", 100, "10.100.0.2/24")],
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
    fn the_cluster_is_known_from_the_ca_pinned_at_enrollment() {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            format!("{}c0ffee", otherix_tls::CA_COMMON_NAME_PREFIX),
        );
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&key).unwrap().pem();
        assert_eq!(enrolled_cluster(&ca).as_deref(), Some("c0ffee"));
        assert_eq!(enrolled_cluster("not a certificate"), None);
    }

    #[test]
    fn a_malformed_session_key_is_skipped_and_the_rest_trusted() {
        let good = hex::encode([7u8; 32]);
        let keys = vec![
            SessionPublicKey {
                kid: "a".into(),
                public: good.clone(),
                not_after: None,
            },
            SessionPublicKey {
                kid: "b".into(),
                public: "zz".into(),
                not_after: None,
            },
            SessionPublicKey {
                kid: "c".into(),
                public: hex::encode([1u8; 5]),
                not_after: None,
            },
        ];
        let (set, bad) = keyset(&keys);
        assert_eq!(set.kids().collect::<Vec<_>>(), ["a"]);
        assert_eq!(bad, ["b", "c"]);
    }

    #[test]
    fn a_retired_key_is_trusted_only_until_its_expiry() {
        let not_after = time::OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let keys = vec![
            SessionPublicKey {
                kid: "old".into(),
                public: hex::encode([7u8; 32]),
                not_after: Some(not_after),
            },
            SessionPublicKey {
                kid: "new".into(),
                public: hex::encode([8u8; 32]),
                not_after: None,
            },
        ];
        let (set, bad) = keyset(&keys);
        assert!(bad.is_empty());
        assert_eq!(set.not_after("old"), Some(not_after));
        assert_eq!(set.not_after("new"), None);
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
            not_after: Some(time::OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()),
        }];
        save_keys(&dir, &keys).unwrap();
        assert_eq!(load_keys(&dir), Some(keys));
        std::fs::write(dir.join(SESSION_KEYS_FILE), "{oops").unwrap();
        assert_eq!(load_keys(&dir), None, "a corrupt file is ignored, never fatal");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
