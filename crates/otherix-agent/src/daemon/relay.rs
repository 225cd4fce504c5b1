//! The relay role (DESIGN §6), run while the node has a relay endpoint
//! granted (by default port 7444 on a hypervisor's VTEP; `otherix node
//! update --relay`): the agent runs an [`otherix_ingress::relay::Relay`]
//! and feeds it.
//!
//! ```text
//! start            saved desired ──▶ targets      relay.crt still fits? ──▶ serve at once
//! heartbeat back   desired ──▶ targets (guests on this node's bridges; sessions to
//!                  guests no longer here end)
//!                  no certificate yet, or due for renewal? ──▶ [`serving`] ──▶ serve
//! every attempt    (re)bind: on the granted address, or where `--relay-listen` says
//!                  (the VTEP can move); resolve the control planes (`--server`) again
//!                  every 30 s: connections from elsewhere (and not `--relay-allow-from`)
//!                  are closed before their TLS handshake
//! ```
//!
//! The endpoint itself — who may call it, the request line, the dial, the
//! splice — is the ingress library's; this module only decides where it
//! listens, with which certificate and limits, and hands it the targets.
//!
//! [`serving`]: super::serving

use std::net::{Ipv4Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use otherix_client::Client;
use otherix_ingress::listener::Rebinding;
use otherix_ingress::relay::{self, Consoles, ControlPlanes, Relay, SourceNet, Targets};
use otherix_ingress::Limits;
use otherix_proto::agent::{CertPurpose, DesiredState};
use tracing::{info, warn};

use super::host;
use super::identity::Identity;
use super::serving::ServingCert;

// ------------------------------------------------------------------ where

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

/// `--relay-listen` is not `off`, `:PORT` or `IP:PORT` (the operator's fault).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RelayListenError {
    /// `:PORT` with no port, or port 0.
    #[error("invalid relay port in {0:?}")]
    Port(String),
    /// Neither `off`, `:PORT` nor an `IP:PORT` with a port.
    #[error("invalid --relay-listen {0:?}: expected IP:PORT, :PORT or off")]
    Address(String),
}

impl FromStr for RelayListen {
    type Err = RelayListenError;

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
                .ok_or_else(|| RelayListenError::Port(s.to_owned()));
        }
        s.parse::<SocketAddr>()
            .ok()
            .filter(|a| a.port() != 0)
            .map(RelayListen::Addr)
            .ok_or_else(|| RelayListenError::Address(s.to_owned()))
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

// -------------------------------------------------------------------- role

/// The QEMU guests of `desired` that run on this node (not those still
/// arriving), with their serial console sockets under `qemu_dir` (the QEMU
/// runtime's layout: `{qemu_dir}/{vm_id}/console.sock`).
fn consoles(desired: &DesiredState, qemu_dir: &std::path::Path) -> Consoles {
    desired
        .guests
        .iter()
        .filter(|g| g.machine.is_some() && g.incoming.is_none())
        .map(|g| (g.vm_id.clone(), qemu_dir.join(&g.vm_id).join("console.sock")))
        .collect()
}

/// How often the control planes' names are resolved again (an IP literal
/// costs nothing; a name may move).
const RESOLVE_EVERY: Duration = Duration::from_secs(30);

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
    /// The resumable sessions, shared with the reconciler (which moves a
    /// guest to another node only once its sessions went ahead of it).
    sessions: Arc<relay::RelaySessions>,
    /// QEMU guests running here and their console sockets.
    consoles: Consoles,
    /// The QEMU runtime's directory (`{data_dir}/qemu`).
    qemu_dir: std::path::PathBuf,
    listener: Rebinding,
    /// The control planes' URLs (`--server`): who may connect.
    servers: Vec<String>,
    /// Networks allowed besides them (`--relay-allow-from`).
    allow_from: Vec<SourceNet>,
    /// Who may connect, as last resolved, and when.
    control_planes: ControlPlanes,
    resolved_at: Option<Instant>,
}

impl RelayRole {
    /// The relay for the granted endpoint `granted`, knowing the guests of
    /// the saved desired state at once, and serving at once when the saved
    /// certificate still fits.
    #[allow(clippy::too_many_arguments)] // each is one setting of the agent's
    pub(super) fn start(
        listen: Option<RelayListen>,
        granted: SocketAddr,
        identity: &Identity,
        dir: &std::path::Path,
        desired: Option<&DesiredState>,
        limits: Limits,
        servers: &[String],
        allow_from: Vec<SourceNet>,
        sessions: Arc<relay::RelaySessions>,
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
            sessions,
            consoles: Consoles::new(),
            qemu_dir: std::path::PathBuf::new(),
            listener: Rebinding::new("relay"),
            servers: servers.to_vec(),
            control_planes: ControlPlanes::new([], &allow_from),
            allow_from,
            resolved_at: None,
        };
        role.qemu_dir = dir.join("qemu");
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
            self.targets = relay::targets(d);
            self.consoles = consoles(d, &self.qemu_dir);
            if let Some(r) = &self.relay {
                r.set_targets(self.targets.clone());
                r.set_consoles(self.consoles.clone());
            }
        }
    }

    /// After a heartbeat: a certificate if there is none yet or renewal is
    /// due (`client`: the heartbeat was answered), then bind (or rebind,
    /// when the address moved) and serve; called after every heartbeat
    /// attempt, successful or not.
    pub(super) async fn after_heartbeat(&mut self, client: Option<&Client>, vtep: Option<Ipv4Addr>) {
        self.resolve().await;
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
        if self
            .listener
            .ensure(addr, |l, shutdown| relay.run(l, shutdown))
            .await
        {
            info!(%addr, granted = %self.granted, "relay listening");
        }
    }

    /// Resolves the control planes again when due, and tells the endpoint.
    /// While none resolves, the last addresses found stay.
    async fn resolve(&mut self) {
        if self.resolved_at.is_some_and(|t| t.elapsed() < RESOLVE_EVERY) {
            return;
        }
        self.resolved_at = Some(Instant::now());
        let addrs = host::control_plane_addresses(&self.servers).await;
        if addrs.is_empty() {
            warn!(servers = ?self.servers, "no control plane address resolves; the relay keeps the ones it had");
            return;
        }
        self.control_planes = ControlPlanes::new(addrs, &self.allow_from);
        if let Some(r) = &self.relay {
            r.set_control_planes(self.control_planes.clone());
        }
    }

    /// The endpoint, once the certificate is there.
    fn build(&mut self) {
        if self.relay.is_some() {
            return;
        }
        let Some(slot) = self.cert.slot() else {
            return;
        };
        let config = match relay::server_config(slot, &self.ca_pem) {
            Ok(config) => config,
            Err(e) => {
                warn!(error = %e, "cannot build the relay's TLS configuration");
                return;
            }
        };
        match Relay::new(config, self.limits, self.control_planes.clone()) {
            Ok(relay) => {
                let relay = relay.with_sessions(self.sessions.clone());
                relay.set_targets(self.targets.clone());
                relay.set_consoles(self.consoles.clone());
                self.relay = Some(Arc::new(relay));
            }
            Err(e) => warn!(error = %e, "cannot build the relay endpoint"),
        }
    }

    /// Stops accepting. Open sessions end with the agent process.
    pub(super) async fn stop(mut self) {
        self.listener.stop().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(
            ":0".parse::<RelayListen>().unwrap_err().to_string(),
            "invalid relay port in \":0\""
        );
        assert_eq!(RelayListen::Vtep(7444).address(None), None);
        assert_eq!(
            RelayListen::Vtep(7444).address(Some(Ipv4Addr::new(10, 0, 0, 2))),
            Some("10.0.0.2:7444".parse().unwrap())
        );
    }
}
