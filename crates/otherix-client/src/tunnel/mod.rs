//! The client side of both transports (DESIGN §6), which `connect`,
//! `forward` and `ssh` cannot tell apart: [`gateway`] (TLS to the endpoint
//! the broker named, `GET /v1/connect` with `Upgrade: otherix-tcp`, then raw
//! bytes) and [`relay`] (a WebSocket to the control plane, for bridge VMs),
//! both over the one upgrade of [`http1`]. [`open_brokered`] picks by the
//! broker's answer; [`open_brokered_resumable`] also asks the relay for a
//! session that survives a lost connection ([`resumable`], #31).

pub mod gateway;
pub mod http1;
pub mod relay;
pub mod resumable;
pub mod splice;

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use otherix_proto::{BrokerResponse, Transport};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::client::Endpoint;
pub use gateway::{open, open_gateway, Tunnel};
pub use relay::RelayTunnel;
pub use resumable::{ResumableTunnel, Resume, ResumeEvent, ResumeOptions};

/// What the client connects to, and who refused if it refuses. The same
/// variants serve both transports; `endpoint` is the gateway's URL or, for
/// the relay, the control plane's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The gateway or the relay refused the credential, or could not reach
    /// the target: a status and the one-line reason it gave.
    #[error("refused ({status}): {reason}")]
    Refused { status: u16, reason: String },
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS with {endpoint} failed: {reason}")]
    Tls { endpoint: String, reason: String },
    #[error("{endpoint} did not answer in time")]
    Timeout { endpoint: String },
    #[error("unexpected answer from {endpoint}: {reason}")]
    Protocol { endpoint: String, reason: String },
    /// The broker's answer does not say which certificates the gateway may
    /// present (a control plane older than this client): refused before
    /// connecting, since the name and the CA alone let a replaced or
    /// deleted machine's old certificate pass.
    #[error("the control plane did not say which certificate gateway {endpoint} must present (it is older than this client); upgrade the control plane. Nothing was sent to the gateway")]
    Unpinned { endpoint: String },
    /// The control plane stands behind no gateway certificate of the node
    /// yet: it has not been issued one, so its gateway cannot be serving.
    #[error("gateway node {node} at {endpoint} has no certificate the control plane stands behind yet; retry shortly. Nothing was sent to the gateway")]
    NoGatewayCertificate { endpoint: String, node: String },
    /// The gateway presented a certificate of the cluster CA with the
    /// node's gateway name, but not one the control plane stands behind
    /// for that node now: the node was replaced or deleted and this is the
    /// old machine (or whoever has its key). The credential was not sent.
    #[error("gateway {endpoint} presented a certificate ({fingerprint}) that the control plane no longer stands behind for node {node} (the node was replaced or deleted, or this is not its machine); the credential was not sent")]
    RevokedGatewayCertificate {
        endpoint: String,
        node: String,
        fingerprint: String,
    },
}

impl ConnectError {
    /// Whether brokering again (a new credential, maybe another backend) may help.
    pub fn retryable(&self) -> bool {
        match self {
            ConnectError::Refused { status, .. } => matches!(status, 502 | 503),
            ConnectError::Connect { .. } | ConnectError::Timeout { .. } => true,
            _ => false,
        }
    }
}

/// A tunnel over either transport, as the broker chose it.
// One per connection, made once: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum AnyTunnel {
    Gateway(Tunnel),
    Relay(RelayTunnel),
    /// A resumable relay session (#31): it reconnects by itself.
    Resumable(ResumableTunnel),
}

impl AnyTunnel {
    /// For a resumable relay session, what resolves once it has finished
    /// after the tunnel is dropped ([`ResumableTunnel::finished`]); a
    /// command about to exit awaits it briefly.
    pub fn finished(&self) -> Option<impl std::future::Future<Output = ()> + Send + 'static> {
        match self {
            AnyTunnel::Resumable(t) => Some(t.finished()),
            _ => None,
        }
    }
}

/// Opens the tunnel a broker answer describes: through its gateway, or,
/// for `transport: "relay"`, through the relay of the control plane at
/// `cp_url` — the URL this client is configured with; the answer's
/// `wss://` endpoint is informational.
pub async fn open_brokered(
    grant: &BrokerResponse,
    cp_url: &str,
    ca_pem: &str,
) -> Result<AnyTunnel, ConnectError> {
    match grant.transport {
        Transport::Relay => relay::open(cp_url, ca_pem, &grant.credential)
            .await
            .map(AnyTunnel::Relay),
        Transport::Gateway => {
            open_gateway(&grant.endpoint, GatewayPin::of(grant)?, ca_pem, &grant.credential)
                .await
                .map(AnyTunnel::Gateway)
        }
    }
}

/// [`open_brokered`], with relay sessions resumable: a relay tunnel asks
/// the control plane for a resumable session and, when it offers one (an
/// older one does not: the plain relay then), reconnects through `resume`
/// when its connection is lost. Gateway tunnels are as [`open_brokered`]'s.
pub async fn open_brokered_resumable(
    grant: &BrokerResponse,
    cp_url: &str,
    ca_pem: &str,
    resume: &Resume,
) -> Result<AnyTunnel, ConnectError> {
    match grant.transport {
        Transport::Relay => resumable::open(cp_url, &grant.credential, resume).await,
        Transport::Gateway => open_brokered(grant, cp_url, ca_pem).await,
    }
}

/// The gateway a broker answer sends the client to: the node whose gateway
/// certificate (`NODE.gateway.otherix`, from the cluster CA) it must
/// present, and the fingerprints of the ones the control plane stands
/// behind for that node now. The name and the CA alone are not enough: a
/// replaced or deleted node's old machine keeps a certificate with that
/// name, valid for weeks, and may still answer at the address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatewayPin<'a> {
    pub node: &'a str,
    /// `sha256:HEX` of each certificate accepted.
    pub certs: &'a [String],
}

impl<'a> GatewayPin<'a> {
    /// The pin of a gateway answer. An answer without the node or the
    /// certificates — from a control plane older than this client — is
    /// refused rather than trusted by name (fail closed: the control plane
    /// is upgraded before its clients, and until then connecting fails
    /// loudly instead of handing a credential to whoever holds an old
    /// certificate). So is an empty set, before anything is dialed.
    pub fn of(grant: &'a BrokerResponse) -> Result<GatewayPin<'a>, ConnectError> {
        let (Some(node), Some(certs)) = (grant.node.as_deref(), grant.gateway_certs.as_deref()) else {
            return Err(ConnectError::Unpinned {
                endpoint: grant.endpoint.clone(),
            });
        };
        if certs.is_empty() {
            return Err(ConnectError::NoGatewayCertificate {
                endpoint: grant.endpoint.clone(),
                node: node.to_string(),
            });
        }
        Ok(GatewayPin { node, certs })
    }

    /// Whether the certificate with fingerprint `presented` is one of them.
    pub fn accepts(&self, presented: &str) -> bool {
        self.certs.iter().any(|c| c == presented)
    }
}

/// A connection made ready ahead of need: a broker answer whose credential
/// is unused and, for the gateway transport, a TLS connection to its
/// gateway with the handshake done ([`gateway::Warm`]). One is consumed by
/// exactly one connection ([`Ready::open`]).
#[derive(Debug)]
pub struct Ready {
    pub grant: BrokerResponse,
    warm: Warm,
    made: std::time::Instant,
    /// How long its credential had left when it was made ready, less
    /// [`EXPIRY_MARGIN`]: past that it is never presented.
    life: std::time::Duration,
}

/// The TLS connection a ready credential is presented on: to its gateway,
/// or for the relay to the control plane.
#[derive(Debug)]
enum Warm {
    Gateway(gateway::Warm),
    Relay(relay::Warm),
}

/// A ready credential is given up this long before its `exp`, so that one
/// presented never arrives at the gateway expired (a slow network, the
/// clocks' small difference). Credentials live minutes; this matters for
/// those a grant's end cuts short.
pub const EXPIRY_MARGIN: std::time::Duration = std::time::Duration::from_secs(2);

/// How long a credential expiring at `expires_at` may be kept ready, as
/// seen at `now`: the time it has left less [`EXPIRY_MARGIN`] (zero when it
/// has less than that left).
pub fn ready_life(expires_at: time::OffsetDateTime, now: time::OffsetDateTime) -> std::time::Duration {
    std::time::Duration::try_from(expires_at - now)
        .unwrap_or_default()
        .saturating_sub(EXPIRY_MARGIN)
}

/// How long the credential of `grant`, just received, may be kept ready:
/// by the life the control plane gave it (`expires_in_ms`, counted on the
/// client's monotonic clock, so the two clocks' difference does not
/// matter), or by `expires_at` against the client's clock at `now` from a
/// control plane that does not say.
pub fn grant_ready_life(grant: &BrokerResponse, now: time::OffsetDateTime) -> std::time::Duration {
    match grant.expires_in_ms {
        Some(ms) => std::time::Duration::from_millis(ms).saturating_sub(EXPIRY_MARGIN),
        None => ready_life(grant.expires_at, now),
    }
}

/// Whether a connection made ready `age` ago, whose credential had `life`
/// ([`ready_life`]) then, may still carry a connection kept at most `keep`.
pub fn usable(age: std::time::Duration, keep: std::time::Duration, life: std::time::Duration) -> bool {
    age < keep.min(life)
}

impl Ready {
    /// Makes `grant` ready: TLS to its gateway or, for the relay, to the
    /// control plane at `cp_url` (the WebSocket upgrade, which has the
    /// control plane dial the node, waits for the connection that uses
    /// it). A failure here is the gateway's or the control plane's; the
    /// grant is then worth nothing to a later connection either.
    pub async fn prepare(grant: BrokerResponse, cp_url: &str, ca_pem: &str) -> Result<Ready, ConnectError> {
        // Its age counts from the answer's arrival, before the handshake:
        // the credential's life and the gateway's request timeout both
        // run already.
        let made = std::time::Instant::now();
        let life = grant_ready_life(&grant, time::OffsetDateTime::now_utc());
        let warm = match grant.transport {
            Transport::Gateway => {
                Warm::Gateway(gateway::Warm::connect(&grant.endpoint, GatewayPin::of(&grant)?, ca_pem).await?)
            }
            Transport::Relay => Warm::Relay(relay::Warm::connect(cp_url, ca_pem).await?),
        };
        Ok(Ready {
            grant,
            warm,
            made,
            life,
        })
    }

    /// How long since the grant was brokered and the connection made.
    pub fn age(&self) -> std::time::Duration {
        self.made.elapsed()
    }

    /// Whether it may still carry a connection, kept at most `keep`: within
    /// its keep and well before its credential expires.
    pub fn is_usable(&self, keep: std::time::Duration) -> bool {
        usable(self.age(), keep, self.life)
    }

    /// How long from now until it is no longer usable, kept at most `keep`.
    pub fn usable_for(&self, keep: std::time::Duration) -> std::time::Duration {
        keep.min(self.life).saturating_sub(self.age())
    }

    /// Opens the tunnel on the connection made ready: presents the
    /// credential (the gateway's upgrade, or the relay's WebSocket upgrade).
    pub async fn open(self) -> Result<AnyTunnel, ConnectError> {
        match self.warm {
            Warm::Gateway(warm) => warm.upgrade(&self.grant.credential).await.map(AnyTunnel::Gateway),
            Warm::Relay(warm) => warm
                .upgrade(&self.grant.credential, relay::RelayOptions::default())
                .await
                .map(AnyTunnel::Relay),
        }
    }

    /// [`Ready::open`], with a relay session resumable through `resume`
    /// (see [`open_brokered_resumable`]).
    pub async fn open_resumable(self, resume: &Resume) -> Result<AnyTunnel, ConnectError> {
        match self.warm {
            Warm::Relay(warm) => resumable::open_warm(warm, &self.grant.credential, resume).await,
            Warm::Gateway(_) => self.open().await,
        }
    }
}

macro_rules! delegate {
    ($self:ident, $t:ident => $e:expr) => {
        match $self.get_mut() {
            AnyTunnel::Gateway($t) => {
                let $t = Pin::new($t);
                $e
            }
            AnyTunnel::Relay($t) => {
                let $t = Pin::new($t);
                $e
            }
            AnyTunnel::Resumable($t) => {
                let $t = Pin::new($t);
                $e
            }
        }
    };
}

impl AsyncRead for AnyTunnel {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        delegate!(self, t => t.poll_read(cx, buf))
    }
}

impl AsyncWrite for AnyTunnel {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        delegate!(self, t => t.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, t => t.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        delegate!(self, t => t.poll_shutdown(cx))
    }
}

/// Whom a tunnel's TLS connection must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer<'a> {
    /// A gateway: its certificate must name `NODE.gateway.otherix` for the
    /// node the broker named and be one the control plane stands behind
    /// for it, or — without a broker's answer ([`gateway::open`]) — name
    /// the endpoint's address.
    Gateway(Option<GatewayPin<'a>>),
    /// The control plane, verified by [`otherix_tls::CP_NAME`].
    ControlPlane,
}

/// TLS (ALPN `http/1.1`) to `endpoint` (`https://host:port`), trusting only
/// the cluster CA `ca_pem`.
pub(crate) async fn tls_connect(
    endpoint: &str,
    ca_pem: &str,
    peer: Peer<'_>,
) -> Result<(Endpoint, TlsStream<TcpStream>), ConnectError> {
    let parsed = match peer {
        Peer::Gateway(None) => Endpoint::parse(endpoint),
        Peer::Gateway(Some(GatewayPin { node, .. })) => Endpoint::parse(endpoint).and_then(|ep| {
            let name = otherix_tls::gateway_cert_name(node);
            let server_name =
                rustls::pki_types::ServerName::try_from(name).map_err(|_| crate::ClientError::BadUrl {
                    url: endpoint.to_string(),
                    reason: format!("invalid gateway node name {node:?}"),
                })?;
            Ok(Endpoint { server_name, ..ep })
        }),
        Peer::ControlPlane => Endpoint::control_plane(endpoint),
    };
    let ep = parsed.map_err(|e| ConnectError::Protocol {
        endpoint: endpoint.to_string(),
        reason: e.to_string(),
    })?;
    let tls_err = |reason: String| ConnectError::Tls {
        endpoint: endpoint.to_string(),
        reason,
    };
    let ca = otherix_tls::cert_from_pem(ca_pem).map_err(|e| tls_err(e.to_string()))?;
    let mut config = otherix_tls::pinned_client_config(ca).map_err(|e| tls_err(e.to_string()))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let tcp = TcpStream::connect((ep.host.as_str(), ep.port))
        .await
        .map_err(|source| ConnectError::Connect {
            endpoint: endpoint.to_string(),
            source,
        })?;
    let _ = tcp.set_nodelay(true);
    let stream = TlsConnector::from(Arc::new(config))
        .connect(ep.server_name.clone(), tcp)
        .await
        .map_err(|e| tls_err(e.to_string()))?;
    // The chain and the name are verified; now whether this is the very
    // certificate the control plane stands behind — before any byte of a
    // request (the credential) is written.
    if let Peer::Gateway(Some(pin)) = peer {
        let presented = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| otherix_tls::fingerprint(c.as_ref()))
            .unwrap_or_default();
        if !pin.accepts(&presented) {
            tracing::info!(%endpoint, node = pin.node, fingerprint = %presented, "gateway certificate is not one the control plane stands behind; credential not sent");
            return Err(ConnectError::RevokedGatewayCertificate {
                endpoint: endpoint.to_string(),
                node: pin.node.to_string(),
                fingerprint: presented,
            });
        }
    }
    Ok((ep, stream))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use time::OffsetDateTime;

    use super::*;

    #[test]
    fn a_ready_credential_is_given_up_before_it_expires() {
        let now = OffsetDateTime::now_utc();
        // A credential's usual five minutes: the keep decides.
        let life = ready_life(now + Duration::from_secs(300), now);
        assert_eq!(life, Duration::from_secs(298));
        assert!(usable(Duration::from_secs(7), Duration::from_secs(8), life));
        assert!(!usable(Duration::from_secs(8), Duration::from_secs(8), life));
        // A grant ending in 5 s cut the credential short: usable for 3 s
        // whatever the keep.
        let short = ready_life(now + Duration::from_secs(5), now);
        assert_eq!(short, Duration::from_secs(3));
        assert!(usable(
            Duration::from_millis(2_900),
            Duration::from_secs(8),
            short
        ));
        assert!(!usable(Duration::from_secs(3), Duration::from_secs(8), short));
        // Less than the margin left, or expired already: never usable.
        for left in [Duration::from_secs(2), Duration::from_millis(500), Duration::ZERO] {
            let life = ready_life(now + left, now);
            assert!(!usable(Duration::ZERO, Duration::from_secs(8), life), "{left:?}");
        }
        let past = ready_life(now - Duration::from_secs(60), now);
        assert!(!usable(Duration::ZERO, Duration::from_secs(8), past));
    }

    #[test]
    fn the_life_the_control_plane_gave_a_credential_beats_a_skewed_client_clock() {
        let now = OffsetDateTime::now_utc();
        let grant = |expires_at, expires_in_ms| BrokerResponse {
            transport: Transport::Gateway,
            endpoint: "https://10.0.0.1:8443".into(),
            credential: "v4.public.x".into(),
            expires_at,
            vm: "web01".into(),
            port: 80,
            node: Some("gw1".into()),
            expires_in_ms,
            budgeted: false,
            gateway_certs: Some(vec!["sha256:aa".into()]),
        };
        // The CP says 5 s; the client's clock runs 30 s behind (it thinks
        // 35 s are left) or 30 s ahead (expired already): 3 s either way.
        for skew in [-30i64, 30] {
            let expires_at = now + time::Duration::seconds(5 - skew);
            assert_eq!(
                grant_ready_life(&grant(expires_at, Some(5_000)), now),
                Duration::from_secs(3),
                "skew {skew} s"
            );
        }
        // A CP that does not say: the wall clocks decide.
        let expires_at = now + time::Duration::seconds(35);
        assert_eq!(
            grant_ready_life(&grant(expires_at, None), now),
            Duration::from_secs(33)
        );
    }

    #[test]
    fn a_gateway_answer_without_the_certificates_the_control_plane_stands_behind_is_refused() {
        let grant = |node: Option<&str>, certs: Option<Vec<&str>>| BrokerResponse {
            transport: Transport::Gateway,
            endpoint: "https://10.0.0.1:8443".into(),
            credential: "v4.public.x".into(),
            expires_at: OffsetDateTime::now_utc(),
            vm: "web01".into(),
            port: 80,
            node: node.map(Into::into),
            expires_in_ms: Some(300_000),
            gateway_certs: certs.map(|c| c.into_iter().map(Into::into).collect()),
            budgeted: false,
        };
        // An older control plane: no certificates, or not even the node.
        for g in [
            grant(Some("gw1"), None),
            grant(None, Some(vec!["sha256:aa"])),
            grant(None, None),
        ] {
            let err = GatewayPin::of(&g).unwrap_err();
            assert!(matches!(err, ConnectError::Unpinned { .. }), "{err}");
            assert!(err.to_string().contains("upgrade the control plane"), "{err}");
        }
        // A node never issued one: refused before anything is dialed.
        let g = grant(Some("gw1"), Some(vec![]));
        let err = GatewayPin::of(&g).unwrap_err();
        assert!(matches!(err, ConnectError::NoGatewayCertificate { .. }), "{err}");
        assert!(!err.retryable());
        // A renewal under way: either certificate, nothing else.
        let g = grant(Some("gw1"), Some(vec!["sha256:aa", "sha256:bb"]));
        let pin = GatewayPin::of(&g).unwrap();
        assert_eq!(pin.node, "gw1");
        assert!(pin.accepts("sha256:aa") && pin.accepts("sha256:bb"));
        assert!(!pin.accepts("sha256:cc") && !pin.accepts(""));
    }
}
