//! The client side of both transports (DESIGN §6). Gateway: TLS to the
//! endpoint the broker named, `GET /v1/connect` with `Upgrade: otherix-tcp`
//! and the credential, then raw bytes both ways after `101 Switching
//! Protocols`. Relay (bridge VMs): a WebSocket to the control plane, see
//! [`crate::relay_tunnel`]. [`open_brokered`] picks by the broker's answer.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::client::Endpoint;
use crate::relay_tunnel::RelayTunnel;
use crate::response_head::{progress, Progress, ResponseHead};
use crate::tls;
use crate::BrokerResponse;

/// The upgrade token of the raw TCP tunnel.
pub const UPGRADE: &str = "otherix-tcp";
const TIMEOUT: Duration = Duration::from_secs(15);

/// A gateway tunnel: after the upgrade, bytes written reach the guest port.
pub type Tunnel = TlsStream<TcpStream>;

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
    match grant.transport.as_str() {
        "relay" => crate::relay_tunnel::open(cp_url, ca_pem, &grant.credential)
            .await
            .map(AnyTunnel::Relay),
        "gateway" => open_gateway(&grant.endpoint, grant.node.as_deref(), ca_pem, &grant.credential)
            .await
            .map(AnyTunnel::Gateway),
        other => Err(ConnectError::Protocol {
            endpoint: grant.endpoint.clone(),
            reason: format!(
                "the control plane offers transport {other:?}, which this client does not speak; upgrade otherix"
            ),
        }),
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

/// Opens a tunnel through the gateway at `endpoint` (`https://host:port`),
/// trusting only the cluster CA `ca_pem`, and a certificate for the
/// endpoint's address.
pub async fn open(endpoint: &str, ca_pem: &str, credential: &str) -> Result<Tunnel, ConnectError> {
    open_gateway(endpoint, None, ca_pem, credential).await
}

/// Opens a tunnel through node `node`'s gateway at `endpoint`: its
/// certificate must be that node's gateway certificate
/// (`NODE.gateway.otherix`), from the cluster CA `ca_pem`. With no node,
/// like [`open`].
pub async fn open_gateway(
    endpoint: &str,
    node: Option<&str>,
    ca_pem: &str,
    credential: &str,
) -> Result<Tunnel, ConnectError> {
    match tokio::time::timeout(TIMEOUT, open_inner(endpoint, node, ca_pem, credential)).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Timeout {
            endpoint: endpoint.to_string(),
        }),
    }
}

async fn open_inner(
    endpoint: &str,
    node: Option<&str>,
    ca_pem: &str,
    credential: &str,
) -> Result<Tunnel, ConnectError> {
    let (ep, mut stream) = tls_connect(endpoint, ca_pem, Peer::Gateway(node)).await?;
    let request = format!(
        "GET /v1/connect HTTP/1.1\r\nHost: {}:{}\r\nAuthorization: Bearer {credential}\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE}\r\n\r\n",
        ep.host, ep.port
    );
    let head = send_and_read_head(&mut stream, endpoint, &request).await?;
    if head.status() == 101 {
        return Ok(stream);
    }
    Err(read_refusal(&mut stream, &head).await)
}

/// Whom a tunnel's TLS connection must reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer<'a> {
    /// A gateway: its certificate must name `NODE.gateway.otherix` for the
    /// node the broker named, or — from a broker that names none — the
    /// endpoint's address.
    Gateway(Option<&'a str>),
    /// The control plane, verified by [`tls::CP_NAME`].
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
            let name = tls::gateway_cert_name(node);
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
    let ca = tls::cert_from_pem(ca_pem).map_err(tls_err)?;
    let mut config = tls::pinned_client_config(ca).map_err(tls_err)?;
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

/// Writes `request` and reads the response head, one byte at a time: nothing
/// after the blank line may be consumed, it belongs to the tunnel.
pub(crate) async fn send_and_read_head(
    stream: &mut TlsStream<TcpStream>,
    endpoint: &str,
    request: &str,
) -> Result<ResponseHead, ConnectError> {
    let protocol = |reason: String| ConnectError::Protocol {
        endpoint: endpoint.to_string(),
        reason,
    };
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| protocol(e.to_string()))?;
    stream.flush().await.ok();
    let mut head = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    loop {
        match progress(&head) {
            Progress::Complete => return Ok(ResponseHead::parse(&head)),
            Progress::TooLong => return Err(protocol("response head too long".into())),
            Progress::Incomplete => {}
        }
        let n = stream
            .read(&mut byte)
            .await
            .map_err(|e| protocol(e.to_string()))?;
        if n == 0 {
            return Err(protocol("connection closed before an answer".into()));
        }
        head.push(byte[0]);
    }
}

/// A refusal: the body is one line saying why (or, from the CP's API, a
/// JSON error whose message says it).
pub(crate) async fn read_refusal(stream: &mut TlsStream<TcpStream>, head: &ResponseHead) -> ConnectError {
    let mut body = Vec::new();
    let _ = tokio::time::timeout(
        Duration::from_secs(2),
        (&mut *stream).take(head.refusal_length()).read_to_end(&mut body),
    )
    .await;
    ConnectError::Refused {
        status: head.status(),
        reason: head.refusal_reason(&body),
    }
}
