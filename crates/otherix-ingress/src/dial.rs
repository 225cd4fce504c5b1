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

/// Whether a refused floor was logged: once per process, not once per dial.
static RTO_MIN_REFUSED: AtomicBool = AtomicBool::new(false);

/// Gives `socket` the retransmission floor `floor`, or the least the
/// kernel takes above it: a floor under two of its ticks (say 5 ms on a
/// 100 Hz kernel) is refused, and doubled until it is not, up to 200 ms. A
/// kernel without the option (before 6.15) keeps its own 200 ms, which costs
/// a migration's lost segments a longer wait and nothing else.
pub(crate) fn lower_rto_min(socket: &impl std::os::fd::AsRawFd, floor: Duration) {
    let mut tried = floor;
    let refused = loop {
        match otherix_repair::set_rto_min(socket, tried) {
            Ok(()) if tried == floor => return,
            Ok(()) => break None,
            Err(e)
                if e.raw_os_error() == Some(nix::errno::Errno::EINVAL as i32)
                    && tried < Duration::from_millis(100) =>
            {
                tried *= 2
            }
            Err(e) => break Some(e),
        }
    };
    if !RTO_MIN_REFUSED.swap(true, Ordering::Relaxed) {
        match refused {
            None => tracing::info!(
                asked_ms = floor.as_millis() as u64,
                floor_ms = tried.as_millis() as u64,
                "connections to guests get the least retransmission floor the kernel takes"
            ),
            Some(e) => {
                tracing::warn!(error = %e, floor_ms = floor.as_millis() as u64, "the kernel keeps its own retransmission floor for connections to guests (TCP_RTO_MIN_US needs Linux 6.15)")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_floor_under_what_the_kernel_takes_is_raised_to_it_not_dropped() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let SocketAddr::V4(addr) = listener.local_addr().unwrap() else {
            unreachable!("bound to an IPv4 address")
        };
        let floor = Duration::from_millis(1);
        let guest = dial_from(
            Ipv4Addr::LOCALHOST,
            None,
            addr,
            Duration::from_secs(5),
            Some(floor),
        )
        .await
        .unwrap();
        let held = match otherix_repair::rto_min(&guest) {
            // A kernel before 6.15: nothing to hold.
            Err(e) if e.raw_os_error() == Some(nix::errno::Errno::ENOPROTOOPT as i32) => return,
            r => r.unwrap(),
        };
        // One tick is 1 ms at 1,000 Hz (taken as it is when two are), 4 ms at 250 Hz.
        assert!((floor..Duration::from_millis(20)).contains(&held), "{held:?}");
    }
}
