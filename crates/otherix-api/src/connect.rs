//! The client side of the gateway protocol (DESIGN §6): TLS to the endpoint
//! the broker named, `GET /v1/connect` with `Upgrade: otherix-tcp` and the
//! credential, then raw bytes both ways after `101 Switching Protocols`.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use crate::client::Endpoint;
use crate::tls;

/// The upgrade token of the raw TCP tunnel.
pub const UPGRADE: &str = "otherix-tcp";
/// Longest response head the client reads.
const MAX_HEAD: usize = 8 * 1024;
const TIMEOUT: Duration = Duration::from_secs(15);

/// A tunnel: after the upgrade, bytes written reach the guest port.
pub type Tunnel = TlsStream<TcpStream>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The gateway refused the credential or could not reach the target.
    #[error("gateway refused ({status}): {reason}")]
    Refused { status: u16, reason: String },
    #[error("cannot connect to gateway {endpoint}: {source}")]
    Connect {
        endpoint: String,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS with gateway {endpoint} failed: {reason}")]
    Tls { endpoint: String, reason: String },
    #[error("gateway {endpoint} timed out")]
    Timeout { endpoint: String },
    #[error("unexpected answer from gateway {endpoint}: {reason}")]
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

/// Opens a tunnel through the gateway at `endpoint` (`https://host:port`),
/// trusting only the cluster CA `ca_pem`.
pub async fn open(endpoint: &str, ca_pem: &str, credential: &str) -> Result<Tunnel, ConnectError> {
    match tokio::time::timeout(TIMEOUT, open_inner(endpoint, ca_pem, credential)).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Timeout {
            endpoint: endpoint.to_string(),
        }),
    }
}

async fn open_inner(endpoint: &str, ca_pem: &str, credential: &str) -> Result<Tunnel, ConnectError> {
    let ep = Endpoint::parse(endpoint).map_err(|e| ConnectError::Protocol {
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
    let mut stream = TlsConnector::from(Arc::new(config))
        .connect(ep.server_name.clone(), tcp)
        .await
        .map_err(|e| tls_err(e.to_string()))?;
    let request = format!(
        "GET /v1/connect HTTP/1.1\r\nHost: {}:{}\r\nAuthorization: Bearer {credential}\r\nConnection: Upgrade\r\nUpgrade: {UPGRADE}\r\n\r\n",
        ep.host, ep.port
    );
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| ConnectError::Protocol {
            endpoint: endpoint.to_string(),
            reason: e.to_string(),
        })?;
    stream.flush().await.ok();

    // Read the response head one byte at a time: nothing after the blank
    // line may be consumed, it is the guest's first bytes.
    let mut head = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if head.len() >= MAX_HEAD {
            return Err(ConnectError::Protocol {
                endpoint: endpoint.to_string(),
                reason: "response head too long".into(),
            });
        }
        let n = stream.read(&mut byte).await.map_err(|e| ConnectError::Protocol {
            endpoint: endpoint.to_string(),
            reason: e.to_string(),
        })?;
        if n == 0 {
            return Err(ConnectError::Protocol {
                endpoint: endpoint.to_string(),
                reason: "connection closed before the gateway answered".into(),
            });
        }
        head.push(byte[0]);
    }
    let text = String::from_utf8_lossy(&head);
    let status_line = text.lines().next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if status == 101 {
        return Ok(stream);
    }
    // A refusal: the body is one line saying why.
    let mut body = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut body)).await;
    let reason = String::from_utf8_lossy(&body).trim().to_string();
    Err(ConnectError::Refused {
        status,
        reason: if reason.is_empty() {
            status_line.to_string()
        } else {
            reason
        },
    })
}
