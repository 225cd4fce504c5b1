//! The client side of both transports (DESIGN §6), which `connect`,
//! `forward` and `ssh` cannot tell apart: [`gateway`] (TLS to the endpoint
//! the broker named, `GET /v1/connect` with `Upgrade: otherix-tcp`, then raw
//! bytes) and [`relay`] (a WebSocket to the control plane, for bridge VMs),
//! both over the one upgrade of [`http1`]. [`open_brokered`] picks by the
//! broker's answer.

pub mod gateway;
pub mod http1;
pub mod relay;

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
        Transport::Gateway => open_gateway(&grant.endpoint, grant.node.as_deref(), ca_pem, &grant.credential)
            .await
            .map(AnyTunnel::Gateway),
    }
}

/// A connection made ready ahead of need: a broker answer whose credential
/// is unused and, for the gateway transport, a TLS connection to its
/// gateway with the handshake done ([`gateway::Warm`]). One is consumed by
/// exactly one connection ([`Ready::open`]).
#[derive(Debug)]
pub struct Ready {
    pub grant: BrokerResponse,
    warm: Option<gateway::Warm>,
    made: std::time::Instant,
}

impl Ready {
    /// Makes `grant` ready: connects to its gateway (the relay's WebSocket
    /// to the CP is opened when used). A failure here is the gateway's;
    /// the grant is then worth nothing to a later connection either.
    pub async fn prepare(grant: BrokerResponse, ca_pem: &str) -> Result<Ready, ConnectError> {
        let warm = match grant.transport {
            Transport::Gateway => {
                Some(gateway::Warm::connect(&grant.endpoint, grant.node.as_deref(), ca_pem).await?)
            }
            Transport::Relay => None,
        };
        Ok(Ready {
            grant,
            warm,
            made: std::time::Instant::now(),
        })
    }

    /// How long since the grant was brokered and the connection made.
    pub fn age(&self) -> std::time::Duration {
        self.made.elapsed()
    }

    /// Opens the tunnel with what was made ready; for the relay, as
    /// [`open_brokered`] does.
    pub async fn open(self, cp_url: &str, ca_pem: &str) -> Result<AnyTunnel, ConnectError> {
        match self.warm {
            Some(warm) => warm.upgrade(&self.grant.credential).await.map(AnyTunnel::Gateway),
            None => open_brokered(&self.grant, cp_url, ca_pem).await,
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
    /// node the broker named, or — from a broker that names none — the
    /// endpoint's address.
    Gateway(Option<&'a str>),
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
        Peer::Gateway(Some(node)) => Endpoint::parse(endpoint).and_then(|ep| {
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
    Ok((ep, stream))
}
