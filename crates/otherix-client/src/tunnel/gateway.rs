//! The gateway transport: TLS to the endpoint the broker named (verified
//! as the gateway of the node it names, by a certificate the control plane
//! stands behind), `GET /v1/connect` with `Upgrade: otherix-tcp` and the
//! credential, then raw bytes both ways after `101 Switching Protocols`.

use std::time::Duration;

use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

use super::http1::{self, Answer, Upgraded};
use super::{tls_connect, ConnectError, GatewayPin, Peer};

/// The upgrade token of the raw TCP tunnel.
pub const UPGRADE: &str = "otherix-tcp";
const TIMEOUT: Duration = Duration::from_secs(15);

/// A gateway tunnel: after the upgrade, bytes written reach the guest port.
pub type Tunnel = Upgraded<TlsStream<TcpStream>>;

/// Opens a tunnel through the gateway at `endpoint` (`https://host:port`),
/// trusting only the cluster CA `ca_pem`, and a certificate for the
/// endpoint's address — any such certificate, revoked or not: for a gateway
/// reached without a broker's answer (the gateway's own tests). A broker's
/// answer goes through [`open_gateway`] (or [`super::open_brokered`]).
pub async fn open(endpoint: &str, ca_pem: &str, credential: &str) -> Result<Tunnel, ConnectError> {
    with_timeout(endpoint, open_inner(endpoint, None, ca_pem, credential)).await
}

/// Opens a tunnel through node `pin.node`'s gateway at `endpoint`: its
/// certificate must be that node's gateway certificate
/// (`NODE.gateway.otherix`) from the cluster CA `ca_pem`, and one of
/// `pin.certs` — the ones the control plane stands behind for the node.
/// Any other is refused before the credential is sent.
pub async fn open_gateway(
    endpoint: &str,
    pin: GatewayPin<'_>,
    ca_pem: &str,
    credential: &str,
) -> Result<Tunnel, ConnectError> {
    with_timeout(endpoint, open_inner(endpoint, Some(pin), ca_pem, credential)).await
}

async fn with_timeout<T>(
    endpoint: &str,
    f: impl std::future::Future<Output = Result<T, ConnectError>>,
) -> Result<T, ConnectError> {
    match tokio::time::timeout(TIMEOUT, f).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Timeout {
            endpoint: endpoint.to_string(),
        }),
    }
}

async fn open_inner(
    endpoint: &str,
    pin: Option<GatewayPin<'_>>,
    ca_pem: &str,
    credential: &str,
) -> Result<Tunnel, ConnectError> {
    Warm::connect_inner(endpoint, pin, ca_pem)
        .await?
        .upgrade_inner(credential)
        .await
}

/// A TLS connection to a gateway, verified, with no request sent yet: the
/// handshake paid ahead of the connection that will use it (`otherix
/// forward` keeps one ready). A gateway closes a connection whose request
/// head has not come within its request timeout (10 s by default), so a
/// warm connection is for the next few seconds only.
#[derive(Debug)]
pub struct Warm {
    endpoint: String,
    host: String,
    port: u16,
    stream: TlsStream<TcpStream>,
}

impl Warm {
    /// TLS to node `pin.node`'s gateway at `endpoint`, its certificate
    /// checked as [`open_gateway`] does.
    pub async fn connect(endpoint: &str, pin: GatewayPin<'_>, ca_pem: &str) -> Result<Warm, ConnectError> {
        with_timeout(endpoint, Warm::connect_inner(endpoint, Some(pin), ca_pem)).await
    }

    async fn connect_inner(
        endpoint: &str,
        pin: Option<GatewayPin<'_>>,
        ca_pem: &str,
    ) -> Result<Warm, ConnectError> {
        let (ep, stream) = tls_connect(endpoint, ca_pem, Peer::Gateway(pin)).await?;
        Ok(Warm {
            endpoint: endpoint.to_string(),
            host: ep.host,
            port: ep.port,
            stream,
        })
    }

    /// The gateway's URL.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Presents `credential` on this connection: the tunnel, or the refusal
    /// (a gateway that closed the connection meanwhile is a `Protocol` or
    /// `Connect` error).
    pub async fn upgrade(self, credential: &str) -> Result<Tunnel, ConnectError> {
        let endpoint = self.endpoint.clone();
        match tokio::time::timeout(TIMEOUT, self.upgrade_inner(credential)).await {
            Ok(r) => r,
            Err(_) => Err(ConnectError::Timeout { endpoint }),
        }
    }

    async fn upgrade_inner(self, credential: &str) -> Result<Tunnel, ConnectError> {
        let request = format!(
            "GET /v1/connect HTTP/1.1\r\nHost: {}:{}\r\nAuthorization: Bearer {credential}\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE}\r\n\r\n",
            self.host, self.port
        );
        match http1::upgrade(self.stream, &self.endpoint, &request).await? {
            Answer::Upgraded(_, tunnel) => Ok(tunnel),
            Answer::Refused(e) => Err(e),
        }
    }
}
