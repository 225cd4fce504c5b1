//! Connecting to a guest from one of this node's own addresses, as both
//! servers do: the gateway from its lease on the credential's overlay, the
//! relay endpoint from its address on the guest's bridge.

use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::time::Duration;

use tokio::net::{TcpSocket, TcpStream};

/// Why a dial did not connect: the target's side (refused, unreachable) or
/// its silence.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    /// The socket could not be made or bound, or the connect failed.
    #[error("{0}")]
    Failed(#[from] io::Error),
    /// No answer within the dial timeout.
    #[error("timed out")]
    TimedOut,
}

/// Connects to `addr` from `source` within `timeout`.
pub(crate) async fn dial_from(
    source: Ipv4Addr,
    addr: SocketAddrV4,
    timeout: Duration,
) -> Result<TcpStream, DialError> {
    let socket = TcpSocket::new_v4()?;
    // Pick the source port at connect time, by 4-tuple, rather than
    // reserving one per dial at bind: many sessions from one source
    // address would otherwise exhaust the ephemeral range.
    let _ = nix::sys::socket::setsockopt(&socket, nix::sys::socket::sockopt::IpBindAddressNoPort, &true);
    socket.bind(SocketAddr::from((source, 0)))?;
    match tokio::time::timeout(timeout, socket.connect(SocketAddr::V4(addr))).await {
        Ok(connected) => Ok(connected?),
        Err(_) => Err(DialError::TimedOut),
    }
}
