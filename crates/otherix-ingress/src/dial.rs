//! Connecting to a guest from one of this node's own addresses, as both
//! servers do: the gateway from its lease on the credential's overlay (and
//! through that overlay's device only), the relay endpoint from its address
//! on the guest's bridge.

use std::ffi::OsString;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Connects to `addr` from `source` within `timeout`; with `device`, only
/// through that interface (`SO_BINDTODEVICE`): the route lookup is confined
/// to it, so a route added elsewhere (a more specific one through another
/// interface) cannot carry the dial to another host than the guest on that
/// device's network. With `rto_min`, the connection's retransmission timeout
/// has that floor ([`Limits::guest_rto_min`](crate::Limits::guest_rto_min)).
pub(crate) async fn dial_from(
    source: Ipv4Addr,
    device: Option<&str>,
    addr: SocketAddrV4,
    timeout: Duration,
    rto_min: Option<Duration>,
) -> Result<TcpStream, DialError> {
    let socket = TcpSocket::new_v4()?;
    if let Some(floor) = rto_min {
        lower_rto_min(&socket, floor);
    }
    if let Some(device) = device {
        nix::sys::socket::setsockopt(
            &socket,
            nix::sys::socket::sockopt::BindToDevice,
            &OsString::from(device),
        )
        .map_err(|e| io::Error::new(io::Error::from(e).kind(), format!("bind to device {device}: {e}")))?;
    }
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

/// Whether a kernel without `TCP_RTO_MIN_US` (before 6.15) was logged: once
/// per process, not once per dial.
static RTO_MIN_REFUSED: AtomicBool = AtomicBool::new(false);

/// Gives `socket` the retransmission floor `floor`; a kernel that refuses
/// keeps its own (200 ms), which costs a migration's lost segments a longer
/// wait and nothing else.
fn lower_rto_min(socket: &TcpSocket, floor: Duration) {
    if let Err(e) = otherix_repair::set_rto_min(socket, floor) {
        if !RTO_MIN_REFUSED.swap(true, Ordering::Relaxed) {
            tracing::warn!(error = %e, floor_ms = floor.as_millis() as u64, "the kernel keeps its own retransmission floor for connections to guests (TCP_RTO_MIN_US needs Linux 6.15)");
        }
    }
}
