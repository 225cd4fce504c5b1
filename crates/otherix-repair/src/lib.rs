//! Checkpoint and restore of an established IPv4 TCP connection with Linux
//! TCP repair (`TCP_REPAIR`), the mechanism CRIU's libsoccr uses.
//!
//! The agent holds a TCP connection to a guest, dialed from the node's address
//! on the guest's bridge. When the guest live-migrates, every node of the
//! network has the same bridge address and MAC, so the connection can be
//! recreated in the target node's namespace: [`checkpoint`] freezes the socket
//! and reads its sequence numbers, queues, options and window; [`restore`]
//! builds a socket carrying that state, and the peer never notices.
//!
//! What the caller must know:
//! - Repair needs `CAP_NET_ADMIN` in the socket's network namespace; check
//!   with [`available`].
//! - Repair mode alone does not silence a socket: its timers still send — a
//!   loss probe forces one segment of *new* data out, past what the
//!   application's view calls sent. Bytes the peer got that the [`TcpState`]
//!   calls unsent leave the restored socket behind the peer, which then
//!   acknowledges data "from the future": the restored socket drops those
//!   segments (a challenge ACK each) and the connection stalls both ways.
//!   [`checkpoint`] closes the frozen socket's send window before it reads
//!   anything (the state keeps the real one), so from then on it sends
//!   nothing new; what it still sends (a retransmission, a window probe, an
//!   ACK) is within the state. Closing a frozen socket sends no FIN or RST.
//! - The kernel still *receives* on a frozen socket: bytes the peer sends
//!   after [`checkpoint`] returns are acknowledged by it and are not in the
//!   [`TcpState`] (and an acknowledgement opening the window would let it
//!   send again). Keep the peer's segments from the old socket first
//!   ([`deafen`]; CRIU uses a firewall rule, its network lock), or
//!   checkpoint when the peer cannot send.
//! - Only the old socket or the new one may exist in a namespace with the
//!   same four-tuple: drop the frozen socket before restoring in the same
//!   namespace.

mod sys;
#[cfg(test)]
mod tests;

use std::io;
use std::net::{SocketAddrV4, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

/// Everything needed to recreate an established TCP connection elsewhere.
///
/// Its `Debug` shows the queues' lengths, not their bytes: they are the
/// user's traffic, and can be megabytes.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TcpState {
    pub local: SocketAddrV4,
    pub remote: SocketAddrV4,
    /// `TCP_QUEUE_SEQ` of the send queue: the sequence number after the last
    /// byte written by the application (`write_seq`).
    pub send_seq: u32,
    /// `TCP_QUEUE_SEQ` of the receive queue: the next sequence number expected
    /// from the peer (`rcv_nxt`).
    pub recv_seq: u32,
    /// Bytes written but not acknowledged by the peer: the sent part first,
    /// then the `unsent` part.
    pub send_queue: Vec<u8>,
    /// How many bytes at the end of `send_queue` were never sent
    /// (`SIOCOUTQNSD`): they are restored by an ordinary write, the sent ones in
    /// repair mode so the kernel expects their acknowledgement.
    pub unsent: u32,
    /// Bytes received and acknowledged but not yet read by the application.
    pub recv_queue: Vec<u8>,
    /// `TCP_MAXSEG`.
    pub mss: u32,
    pub snd_wscale: u8,
    pub rcv_wscale: u8,
    /// `TCP_TIMESTAMP`: the connection's timestamp clock, so the peer's PAWS
    /// check accepts the restored socket's segments.
    pub timestamp: u32,
    /// Options negotiated in the handshake (`tcpi_options`).
    pub sack: bool,
    pub tstamp_ok: bool,
    pub wscale_ok: bool,
    /// `TCP_REPAIR_WINDOW`; `None` if the kernel lacks it (before 4.8), in
    /// which case the restored socket starts from a closed send window and
    /// learns the peer's from its next segment.
    pub window: Option<RepairWindow>,
}

impl std::fmt::Debug for TcpState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        struct Len(usize);
        impl std::fmt::Debug for Len {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "<{} bytes>", self.0)
            }
        }
        f.debug_struct("TcpState")
            .field("local", &self.local)
            .field("remote", &self.remote)
            .field("send_seq", &self.send_seq)
            .field("recv_seq", &self.recv_seq)
            .field("send_queue", &Len(self.send_queue.len()))
            .field("unsent", &self.unsent)
            .field("recv_queue", &Len(self.recv_queue.len()))
            .field("mss", &self.mss)
            .field("snd_wscale", &self.snd_wscale)
            .field("rcv_wscale", &self.rcv_wscale)
            .field("timestamp", &self.timestamp)
            .field("sack", &self.sack)
            .field("tstamp_ok", &self.tstamp_ok)
            .field("wscale_ok", &self.wscale_ok)
            .field("window", &self.window)
            .finish()
    }
}

/// `struct tcp_repair_window`: both directions' windows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RepairWindow {
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
}

/// Why a checkpoint or restore failed: the step and the OS error, one line.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RepairError {
    /// This process may not repair sockets here (no `CAP_NET_ADMIN`) or the
    /// kernel has no TCP repair. Nothing was changed.
    #[error("TCP repair unavailable: {step}: {source}")]
    Unavailable { step: &'static str, source: io::Error },
    /// The caller handed `checkpoint` a socket repair cannot carry (not IPv4
    /// TCP, not established). The socket was left as it was.
    #[error("cannot checkpoint this socket: {0}")]
    Unsupported(String),
    /// The state handed to `restore` contradicts itself.
    #[error("invalid TCP state: {0}")]
    InvalidState(String),
    /// A step of `checkpoint` failed after the socket was frozen; it was
    /// thawed again unless an earlier checkpoint had frozen it.
    #[error("TCP checkpoint failed: {step}: {source}")]
    Checkpoint { step: String, source: io::Error },
    /// A step of `restore` failed; the half-built socket was closed without a
    /// trace on the wire.
    #[error("TCP restore failed: {step}: {source}")]
    Restore { step: String, source: io::Error },
}

/// How many times `checkpoint` rereads the queues when segments arriving
/// meanwhile change them.
const CHECKPOINT_TRIES: usize = 8;

/// The largest piece of a queue written in one `send` while restoring: the
/// kernel builds one buffer per call in repair mode and refuses large ones.
const RESTORE_CHUNK: usize = 64 * 1024;

/// Forgets what this network namespace's connection tracker knows of the
/// connection between `local` and `remote` (both directions): a connection
/// restored on a node it once left would otherwise meet the entry of its
/// earlier stay, whose sequence window is long past, and a firewall
/// accepting only established connections would drop it as invalid.
/// Whether an entry was there; a namespace without connection tracking has
/// none.
pub fn forget_conntrack(local: SocketAddrV4, remote: SocketAddrV4) -> Result<bool, RepairError> {
    let mut found = false;
    for (src, dst) in [(local, remote), (remote, local)] {
        match sys::conntrack_delete(src, dst) {
            Ok(()) => found = true,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
            // No connection tracking here (the module absent, or this
            // namespace without it): nothing to forget.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EPROTONOSUPPORT | libc::EAFNOSUPPORT | libc::EOPNOTSUPP)
                ) =>
            {
                return Ok(false)
            }
            Err(source) => {
                return Err(RepairError::Restore {
                    step: "conntrack delete".into(),
                    source,
                })
            }
        }
    }
    Ok(found)
}

/// Has `socket` (restored, live) send a window probe now: repair mode on
/// and off again, which the kernel leaves with a probe. A connection
/// restored before its peer could reach it (the guest still on the node it
/// leaves) told that peer nothing it could hear — not even that its window
/// opened, and a peer waiting on a closed window probes again only after
/// its backed-off persist timer (up to two minutes): nudged once the peer
/// can hear, both ends learn at once where the other is.
pub fn nudge(socket: &impl AsRawFd) -> Result<(), RepairError> {
    let fd = socket.as_raw_fd();
    sys::setsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR, sys::TCP_REPAIR_ON).map_err(|source| {
        RepairError::Restore {
            step: "setsockopt(TCP_REPAIR, on) to probe".into(),
            source,
        }
    })?;
    sys::setsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR, sys::TCP_REPAIR_OFF).map_err(|source| {
        RepairError::Restore {
            step: "setsockopt(TCP_REPAIR, off) to probe".into(),
            source,
        }
    })
}

/// Sets the floor of `socket`'s retransmission timeout (`TCP_RTO_MIN_US`,
/// Linux 6.15 on; the kernel's own floor is 200 ms). A node's connection to
/// a guest crosses one overlay of the cluster, a round trip well under a
/// millisecond; when a live migration loses what was in flight, the lowest
/// floor Linux's 200 ms allows makes the first retransmission come after
/// tens of milliseconds, not 200. The kernel rounds `floor` up to whole
/// ticks and refuses fewer than two (a value of up to 4 ms at 250 Hz, 1 ms
/// at 1,000) or more than 200 ms with `EINVAL`, and an older kernel the
/// option with `ENOPROTOOPT`: the socket is unchanged then.
/// Only this socket changes, never the namespace's other sockets (the
/// `tcp_rto_min_us` sysctl) nor the peer's.
pub fn set_rto_min(socket: &impl AsRawFd, floor: std::time::Duration) -> io::Result<()> {
    let us = libc::c_int::try_from(floor.as_micros()).unwrap_or(libc::c_int::MAX);
    sys::setsockopt_int(socket.as_raw_fd(), libc::SOL_TCP, sys::TCP_RTO_MIN_US, us)
}

/// The floor of `socket`'s retransmission timeout as the kernel holds it
/// (whole ticks), see [`set_rto_min`].
pub fn rto_min(socket: &impl AsRawFd) -> io::Result<std::time::Duration> {
    let us = sys::getsockopt_int(socket.as_raw_fd(), libc::SOL_TCP, sys::TCP_RTO_MIN_US)?;
    Ok(std::time::Duration::from_micros(u64::try_from(us).unwrap_or(0)))
}

/// Makes `socket` deaf: from now on every segment the peer sends it is
/// dropped before TCP sees it, so nothing more is received — or
/// acknowledged. A frozen socket ([`checkpoint`]) still takes in and
/// acknowledges what arrives; deafen it first when the connection moves
/// elsewhere, and the peer sends those bytes again to wherever it is
/// restored.
pub fn deafen(socket: &impl AsRawFd) -> Result<(), RepairError> {
    sys::drop_all_incoming(socket.as_raw_fd()).map_err(|source| RepairError::Checkpoint {
        step: "setsockopt(SO_ATTACH_FILTER)".into(),
        source,
    })
}

/// Freezes `socket` (`TCP_REPAIR` on, its send window closed: from now on it
/// sends no new data, and closing it sends no FIN or RST) and reads its
/// state. The socket stays in repair mode; the caller drops it once the
/// state is safe elsewhere.
///
/// Nothing else may read or write the socket from now on: in repair mode a
/// write goes straight into one of its queues. Calling `checkpoint` again on
/// the frozen socket is fine and returns the newer state (see the crate
/// documentation on what a frozen socket still receives), with the send
/// window the first call closed: a socket restored from it learns the
/// peer's window from the peer's next segment.
///
/// On an error the socket is as it was: refused before freezing, or thawed
/// again (repair off) if this call froze it, so the caller can keep using it
/// or close it normally, which the peer sees.
pub fn checkpoint(socket: &impl AsRawFd) -> Result<TcpState, RepairError> {
    let fd = socket.as_raw_fd();
    let unsupported = |e: io::Error, what: &str| RepairError::Unsupported(format!("{what}: {e}"));

    // Refuse before freezing whatever repair cannot carry, leaving it untouched.
    let local = sys::address(fd, false)
        .map_err(|e| unsupported(e, "getsockname"))?
        .ok_or_else(|| RepairError::Unsupported("not an IPv4 socket".into()))?;
    let info = sys::tcp_info(fd).map_err(|e| unsupported(e, "not a TCP socket"))?;
    if info.tcpi_state != sys::TCP_ESTABLISHED {
        return Err(RepairError::Unsupported(format!(
            "not an established connection (TCP state {})",
            state_name(info.tcpi_state)
        )));
    }
    let remote = sys::address(fd, true)
        .map_err(|e| unsupported(e, "getpeername"))?
        .ok_or_else(|| RepairError::Unsupported("not an IPv4 socket".into()))?;

    // A socket a previous call froze stays frozen whatever happens here.
    let was_frozen = matches!(sys::getsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR), Ok(v) if v != 0);
    sys::setsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR, sys::TCP_REPAIR_ON).map_err(|source| {
        RepairError::Unavailable {
            step: "setsockopt(TCP_REPAIR)",
            source,
        }
    })?;
    let window = match mute(fd) {
        Ok(window) => window,
        Err(e) => {
            if !was_frozen {
                let _ = sys::setsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR, sys::TCP_REPAIR_OFF);
            }
            return Err(e);
        }
    };
    let state = read_frozen(fd, local, remote, window);
    if state.is_err() && !was_frozen {
        // Best effort: if even this fails the socket stays frozen, which the
        // error already tells the caller to expect.
        if let Some(w) = window {
            let _ = sys::set_repair_window(fd, &raw_window(w));
        }
        let _ = sys::setsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR, sys::TCP_REPAIR_OFF);
    }
    state
}

/// Closes a frozen socket's send window (`TCP_REPAIR_WINDOW` with
/// `snd_wnd` 0) so none of its timers sends new data (see the crate
/// documentation); returns the windows as they were. `None` on a kernel
/// without `TCP_REPAIR_WINDOW` (before 4.8), which cannot close it: there a
/// loss probe may still send a segment past the state.
fn mute(fd: RawFd) -> Result<Option<RepairWindow>, RepairError> {
    let ck = |step: &str| {
        let step = step.to_string();
        move |source| RepairError::Checkpoint { step, source }
    };
    let w = match sys::repair_window(fd) {
        Ok(w) => w,
        Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => return Ok(None),
        Err(e) => return Err(ck("getsockopt(TCP_REPAIR_WINDOW)")(e)),
    };
    let closed = sys::TcpRepairWindow { snd_wnd: 0, ..w };
    sys::set_repair_window(fd, &closed)
        .map_err(ck("setsockopt(TCP_REPAIR_WINDOW) to close the send window"))?;
    Ok(Some(RepairWindow {
        snd_wl1: w.snd_wl1,
        snd_wnd: w.snd_wnd,
        max_window: w.max_window,
        rcv_wnd: w.rcv_wnd,
        rcv_wup: w.rcv_wup,
    }))
}

fn raw_window(w: RepairWindow) -> sys::TcpRepairWindow {
    sys::TcpRepairWindow {
        snd_wl1: w.snd_wl1,
        snd_wnd: w.snd_wnd,
        max_window: w.max_window,
        rcv_wnd: w.rcv_wnd,
        rcv_wup: w.rcv_wup,
    }
}

/// The state of a frozen socket.
/// `window` is what [`mute`] found before it closed the send window.
fn read_frozen(
    fd: RawFd,
    local: SocketAddrV4,
    remote: SocketAddrV4,
    window: Option<RepairWindow>,
) -> Result<TcpState, RepairError> {
    let ck = |step: &str| {
        let step = step.to_string();
        move |source| RepairError::Checkpoint { step, source }
    };
    let queues = read_queues(fd)?;
    let info = sys::tcp_info(fd).map_err(ck("getsockopt(TCP_INFO)"))?;
    let mss =
        sys::getsockopt_u32(fd, libc::SOL_TCP, libc::TCP_MAXSEG).map_err(ck("getsockopt(TCP_MAXSEG)"))?;
    let timestamp = sys::getsockopt_u32(fd, libc::SOL_TCP, libc::TCP_TIMESTAMP)
        .map_err(ck("getsockopt(TCP_TIMESTAMP)"))?;
    // The receive side as it is now (what arrived while reading moved it);
    // the send side as it was before `mute` closed it.
    let window = match window {
        Some(before) => {
            let now = sys::repair_window(fd).map_err(ck("getsockopt(TCP_REPAIR_WINDOW)"))?;
            Some(RepairWindow {
                rcv_wnd: now.rcv_wnd,
                rcv_wup: now.rcv_wup,
                ..before
            })
        }
        None => None,
    };
    Ok(TcpState {
        local,
        remote,
        send_seq: queues.send_seq,
        recv_seq: queues.recv_seq,
        send_queue: queues.send_queue,
        unsent: queues.unsent,
        recv_queue: queues.recv_queue,
        mss,
        // Two 4-bit fields, `tcpi_snd_wscale` in the low nibble.
        snd_wscale: info.tcpi_snd_rcv_wscale & 0x0f,
        rcv_wscale: info.tcpi_snd_rcv_wscale >> 4,
        timestamp,
        sack: info.tcpi_options & sys::TCPI_OPT_SACK != 0,
        tstamp_ok: info.tcpi_options & sys::TCPI_OPT_TIMESTAMPS != 0,
        wscale_ok: info.tcpi_options & sys::TCPI_OPT_WSCALE != 0,
        window,
    })
}

struct Queues {
    send_seq: u32,
    recv_seq: u32,
    send_queue: Vec<u8>,
    unsent: u32,
    recv_queue: Vec<u8>,
}

/// Reads both queues of a frozen socket, again until two reads agree: the
/// frozen socket still processes the peer's ACKs (shrinking the send queue)
/// and data (growing the receive queue) while we read.
fn read_queues(fd: RawFd) -> Result<Queues, RepairError> {
    let ck = |step: &'static str| {
        move |source| RepairError::Checkpoint {
            step: step.into(),
            source,
        }
    };
    let mut last = None;
    for _ in 0..CHECKPOINT_TRIES {
        let info = sys::tcp_info(fd).map_err(ck("getsockopt(TCP_INFO)"))?;
        if info.tcpi_state != sys::TCP_ESTABLISHED {
            return Err(RepairError::Checkpoint {
                step: "getsockopt(TCP_INFO)".into(),
                source: io::Error::other(format!(
                    "connection left ESTABLISHED while freezing (TCP state {})",
                    state_name(info.tcpi_state)
                )),
            });
        }
        let outq = ioctl_len(fd, sys::SIOCOUTQ).map_err(ck("ioctl(SIOCOUTQ)"))?;
        let unsent = ioctl_len(fd, sys::SIOCOUTQNSD).map_err(ck("ioctl(SIOCOUTQNSD)"))?;
        let inq = ioctl_len(fd, sys::SIOCINQ).map_err(ck("ioctl(SIOCINQ)"))?;

        set_queue(fd, sys::TCP_SEND_QUEUE).map_err(ck("setsockopt(TCP_REPAIR_QUEUE, send)"))?;
        let send_seq = queue_seq(fd).map_err(ck("getsockopt(TCP_QUEUE_SEQ, send)"))?;
        // The peek copies whole buffers from the oldest unacknowledged one, which
        // may start before the first unacknowledged byte; the queue is its last
        // `outq` bytes (it ends at `send_seq`). The send buffer bounds it.
        let sndbuf = sys::getsockopt_int(fd, libc::SOL_SOCKET, libc::SO_SNDBUF)
            .map_err(ck("getsockopt(SO_SNDBUF)"))?;
        let room = outq + usize::try_from(sndbuf).unwrap_or(0) + 64 * 1024;
        let mut send_queue = sys::peek(fd, room).map_err(ck("recv(MSG_PEEK, send queue)"))?;
        if send_queue.len() < outq || send_queue.len() == room {
            last = Some(format!(
                "send queue: {} bytes read, {outq} queued",
                send_queue.len()
            ));
            continue;
        }
        send_queue.drain(..send_queue.len() - outq);

        set_queue(fd, sys::TCP_RECV_QUEUE).map_err(ck("setsockopt(TCP_REPAIR_QUEUE, receive)"))?;
        let recv_seq = queue_seq(fd).map_err(ck("getsockopt(TCP_QUEUE_SEQ, receive)"))?;
        let recv_queue = if inq == 0 {
            Vec::new()
        } else {
            sys::peek(fd, inq).map_err(ck("recv(MSG_PEEK, receive queue)"))?
        };

        // Nothing moved while we read: the snapshot is consistent.
        let again = (
            ioctl_len(fd, sys::SIOCOUTQ).map_err(ck("ioctl(SIOCOUTQ)"))?,
            ioctl_len(fd, sys::SIOCINQ).map_err(ck("ioctl(SIOCINQ)"))?,
            queue_seq(fd).map_err(ck("getsockopt(TCP_QUEUE_SEQ, receive)"))?,
        );
        if again != (outq, inq, recv_seq) || recv_queue.len() != inq || unsent > outq {
            last = Some(format!(
                "queues changed while reading (send {outq} -> {}, receive {inq} -> {})",
                again.0, again.1
            ));
            continue;
        }
        return Ok(Queues {
            send_seq,
            recv_seq,
            send_queue,
            unsent: unsent as u32,
            recv_queue,
        });
    }
    Err(RepairError::Checkpoint {
        step: format!("reading the queues {CHECKPOINT_TRIES} times"),
        source: io::Error::other(last.unwrap_or_default()),
    })
}

fn ioctl_len(fd: RawFd, request: libc::Ioctl) -> io::Result<usize> {
    let n = sys::ioctl_int(fd, request)?;
    usize::try_from(n).map_err(|_| io::Error::other(format!("negative length {n}")))
}

fn set_queue(fd: RawFd, queue: libc::c_int) -> io::Result<()> {
    sys::setsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR_QUEUE, queue)
}

fn queue_seq(fd: RawFd) -> io::Result<u32> {
    sys::getsockopt_u32(fd, libc::SOL_TCP, libc::TCP_QUEUE_SEQ)
}

/// A new socket in the calling thread's network namespace carrying `state`,
/// in blocking mode (the caller sets non-blocking and its own options such
/// as `TCP_NODELAY`, which the state does not carry).
///
/// The namespace needs `state.local`'s address up and a route to
/// `state.remote`: without either, `connect` fails with "Network is
/// unreachable" (the socket binds with `IP_FREEBIND`, so it is `connect`
/// that says so, naming the peer).
///
/// The steps follow libsoccr: bind and set both queues' sequence numbers in
/// repair mode, `connect` (which in repair mode sends nothing and just makes
/// the socket ESTABLISHED), the negotiated options and timestamp clock, the
/// receive queue, the sent part of the send queue (in repair mode, so the
/// kernel waits for its acknowledgement and retransmits it), the windows; then
/// repair off without a window probe, and the never-sent part written as
/// ordinary data.
///
/// Where the queues are larger than the new socket's default buffers, the
/// buffers are raised (`SO_SNDBUFFORCE`/`SO_RCVBUFFORCE`), which fixes their
/// size from then on as `SO_SNDBUF` would.
pub fn restore(state: &TcpState) -> Result<TcpStream, RepairError> {
    let unsent = state.unsent as usize;
    if unsent > state.send_queue.len() {
        return Err(RepairError::InvalidState(format!(
            "{unsent} unsent bytes in a send queue of {}",
            state.send_queue.len()
        )));
    }
    let (snd_len, rcv_len) = (queue_len(&state.send_queue)?, queue_len(&state.recv_queue)?);
    if state.snd_wscale > 14 || state.rcv_wscale > 14 {
        return Err(RepairError::InvalidState(format!(
            "window scale {}/{} above 14",
            state.snd_wscale, state.rcv_wscale
        )));
    }

    let rs = |step: &str| {
        let step = step.to_string();
        move |source| RepairError::Restore { step, source }
    };
    let sock = sys::tcp4_socket().map_err(rs("socket"))?;
    let fd = sock.as_raw_fd();
    sys::setsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR, sys::TCP_REPAIR_ON).map_err(|source| {
        RepairError::Unavailable {
            step: "setsockopt(TCP_REPAIR)",
            source,
        }
    })?;
    sys::setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)
        .map_err(rs("setsockopt(SO_REUSEADDR)"))?;
    // So that a missing local address is reported by `connect`, with the
    // route lookup's error, rather than as "cannot assign requested address".
    sys::setsockopt_int(fd, libc::SOL_IP, libc::IP_FREEBIND, 1).map_err(rs("setsockopt(IP_FREEBIND)"))?;
    ensure_buffer(fd, libc::SO_SNDBUF, sys::SO_SNDBUFFORCE, state.send_queue.len())
        .map_err(rs("setsockopt(SO_SNDBUFFORCE)"))?;
    ensure_buffer(fd, libc::SO_RCVBUF, sys::SO_RCVBUFFORCE, state.recv_queue.len())
        .map_err(rs("setsockopt(SO_RCVBUFFORCE)"))?;
    sys::bind(fd, state.local).map_err(rs(&format!("bind({})", state.local)))?;

    set_queue(fd, sys::TCP_RECV_QUEUE).map_err(rs("setsockopt(TCP_REPAIR_QUEUE, receive)"))?;
    sys::setsockopt_u32(
        fd,
        libc::SOL_TCP,
        libc::TCP_QUEUE_SEQ,
        state.recv_seq.wrapping_sub(rcv_len),
    )
    .map_err(rs("setsockopt(TCP_QUEUE_SEQ, receive)"))?;
    set_queue(fd, sys::TCP_SEND_QUEUE).map_err(rs("setsockopt(TCP_REPAIR_QUEUE, send)"))?;
    sys::setsockopt_u32(
        fd,
        libc::SOL_TCP,
        libc::TCP_QUEUE_SEQ,
        state.send_seq.wrapping_sub(snd_len),
    )
    .map_err(rs("setsockopt(TCP_QUEUE_SEQ, send)"))?;

    sys::connect(fd, state.remote).map_err(rs(&format!("connect({})", state.remote)))?;

    let mut opts = Vec::with_capacity(4);
    if state.sack {
        opts.push(sys::TcpRepairOpt {
            opt_code: sys::TCPOPT_SACK_PERM,
            opt_val: 0,
        });
    }
    if state.wscale_ok {
        opts.push(sys::TcpRepairOpt {
            opt_code: sys::TCPOPT_WINDOW,
            opt_val: u32::from(state.snd_wscale) | (u32::from(state.rcv_wscale) << 16),
        });
    }
    if state.tstamp_ok {
        opts.push(sys::TcpRepairOpt {
            opt_code: sys::TCPOPT_TIMESTAMP,
            opt_val: 0,
        });
    }
    opts.push(sys::TcpRepairOpt {
        opt_code: sys::TCPOPT_MSS,
        opt_val: state.mss,
    });
    sys::set_repair_options(fd, &opts).map_err(rs("setsockopt(TCP_REPAIR_OPTIONS)"))?;
    if state.tstamp_ok {
        sys::setsockopt_u32(fd, libc::SOL_TCP, libc::TCP_TIMESTAMP, state.timestamp)
            .map_err(rs("setsockopt(TCP_TIMESTAMP)"))?;
    }

    if !state.recv_queue.is_empty() {
        set_queue(fd, sys::TCP_RECV_QUEUE).map_err(rs("setsockopt(TCP_REPAIR_QUEUE, receive)"))?;
        send_all(fd, &state.recv_queue).map_err(rs("send(receive queue)"))?;
    }
    let (sent, unsent) = state.send_queue.split_at(state.send_queue.len() - unsent);
    if !sent.is_empty() {
        set_queue(fd, sys::TCP_SEND_QUEUE).map_err(rs("setsockopt(TCP_REPAIR_QUEUE, send)"))?;
        send_all(fd, sent).map_err(rs("send(send queue, sent part)"))?;
    }
    // After the receive queue: the kernel checks the window against `rcv_nxt`.
    if let Some(w) = state.window {
        sys::set_repair_window(fd, &raw_window(w)).map_err(rs("setsockopt(TCP_REPAIR_WINDOW)"))?;
    }

    // With a window probe: the restored socket speaks at once (its peer
    // answers as soon as it can hear it, and a connection tracker on the
    // way takes it up from this side) rather than after its retransmission
    // timer.
    sys::setsockopt_int(fd, libc::SOL_TCP, libc::TCP_REPAIR, sys::TCP_REPAIR_OFF)
        .map_err(rs("setsockopt(TCP_REPAIR, off)"))?;

    // Never on the wire, so ordinary data; the buffer was sized to take it all
    // without waiting for the peer.
    if !unsent.is_empty() {
        send_all(fd, unsent).map_err(rs("send(send queue, unsent part)"))?;
    }
    Ok(TcpStream::from(sock))
}

fn queue_len(queue: &[u8]) -> Result<u32, RepairError> {
    u32::try_from(queue.len())
        .map_err(|_| RepairError::InvalidState(format!("a queue of {} bytes", queue.len())))
}

/// Raises the socket's `SO_SNDBUF`/`SO_RCVBUF` so `len` queued bytes fit with
/// the kernel's per-buffer overhead, if the default is smaller. Only then,
/// since a set size turns off the kernel's buffer autotuning.
fn ensure_buffer(fd: RawFd, get: libc::c_int, force: libc::c_int, len: usize) -> io::Result<()> {
    // The kernel doubles what is set, for its bookkeeping; half of the buffer
    // for data is ample for queues built of 64 KiB buffers.
    let want = len.saturating_mul(2).saturating_add(128 * 1024);
    let have = usize::try_from(sys::getsockopt_int(fd, libc::SOL_SOCKET, get)?).unwrap_or(0);
    if len == 0 || have >= want {
        return Ok(());
    }
    let set = libc::c_int::try_from(want / 2).map_err(|_| io::Error::other("queue too large"))?;
    sys::setsockopt_int(fd, libc::SOL_SOCKET, force, set)
}

/// Writes all of `buf` without blocking, in pieces the kernel accepts: in
/// repair mode it builds one buffer per call and refuses large ones with
/// `ENOMEM`, so a refused piece is halved (as libsoccr does) down to 1 KiB.
fn send_all(fd: RawFd, mut buf: &[u8]) -> io::Result<()> {
    let mut chunk = RESTORE_CHUNK;
    while !buf.is_empty() {
        let n = buf.len().min(chunk);
        match sys::send(fd, &buf[..n]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "kernel took no bytes")),
            Ok(sent) => buf = &buf[sent..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if chunk > 1024 && e.raw_os_error() == Some(libc::ENOMEM) => chunk /= 2,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether this process may repair TCP sockets in the calling thread's
/// network namespace: `CAP_NET_ADMIN` there and a kernel with `TCP_REPAIR`.
/// Tried on a throwaway socket.
pub fn available() -> Result<(), RepairError> {
    let sock = sys::tcp4_socket().map_err(|source| RepairError::Unavailable {
        step: "socket",
        source,
    })?;
    sys::setsockopt_int(
        sock.as_raw_fd(),
        libc::SOL_TCP,
        libc::TCP_REPAIR,
        sys::TCP_REPAIR_ON,
    )
    .map_err(|source| RepairError::Unavailable {
        step: "setsockopt(TCP_REPAIR)",
        source,
    })
}

/// `include/net/tcp_states.h`, for error messages.
fn state_name(state: u8) -> &'static str {
    match state {
        1 => "ESTABLISHED",
        2 => "SYN_SENT",
        3 => "SYN_RECV",
        4 => "FIN_WAIT1",
        5 => "FIN_WAIT2",
        6 => "TIME_WAIT",
        7 => "CLOSE",
        8 => "CLOSE_WAIT",
        9 => "LAST_ACK",
        10 => "LISTEN",
        11 => "CLOSING",
        _ => "unknown",
    }
}
