//! The only place that calls into libc: thin, safe wrappers over the socket
//! calls TCP repair needs, each returning `io::Error` from `errno`.
//!
//! Every wrapper takes a raw fd the caller owns for the duration of the call;
//! an fd that is not open makes the kernel answer `EBADF`, never undefined
//! behaviour, so the wrappers are sound for any `RawFd`.
#![allow(unsafe_code)]

use std::io;
use std::mem::{size_of, MaybeUninit};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// `enum { TCP_NO_QUEUE, TCP_RECV_QUEUE, TCP_SEND_QUEUE }` in
/// `include/uapi/linux/tcp.h`; not in the libc crate.
pub const TCP_RECV_QUEUE: libc::c_int = 1;
/// See [`TCP_RECV_QUEUE`].
pub const TCP_SEND_QUEUE: libc::c_int = 2;

/// `TCP_REPAIR_ON`, `TCP_REPAIR_OFF` in `include/uapi/linux/tcp.h`.
pub const TCP_REPAIR_ON: libc::c_int = 1;
pub const TCP_REPAIR_OFF: libc::c_int = 0;

/// TCP option kinds for `TCP_REPAIR_OPTIONS` (`include/net/tcp.h`).
pub const TCPOPT_MSS: u32 = 2;
pub const TCPOPT_WINDOW: u32 = 3;
pub const TCPOPT_SACK_PERM: u32 = 4;
pub const TCPOPT_TIMESTAMP: u32 = 8;

/// `tcpi_options` bits (`include/uapi/linux/tcp.h`).
pub const TCPI_OPT_TIMESTAMPS: u8 = 1;
pub const TCPI_OPT_SACK: u8 = 2;
pub const TCPI_OPT_WSCALE: u8 = 4;

/// `TCP_RTO_MIN_US` in `include/uapi/linux/tcp.h` (Linux 6.15 on): the
/// socket's floor for its retransmission timeout, in microseconds; not in
/// the libc crate.
pub const TCP_RTO_MIN_US: libc::c_int = 45;

/// `TCP_ESTABLISHED` in `include/net/tcp_states.h`.
pub const TCP_ESTABLISHED: u8 = 1;

/// `SIOCINQ` / `SIOCOUTQ` (`include/uapi/linux/sockios.h`) are `FIONREAD` /
/// `TIOCOUTQ`; `SIOCOUTQNSD` is in libc.
pub const SIOCINQ: libc::Ioctl = libc::FIONREAD;
pub const SIOCOUTQ: libc::Ioctl = libc::TIOCOUTQ;
pub const SIOCOUTQNSD: libc::Ioctl = libc::SIOCOUTQNSD as libc::Ioctl;

/// `SO_SNDBUFFORCE` / `SO_RCVBUFFORCE` in `include/uapi/asm-generic/socket.h`
/// (the values on x86, arm and riscv); not in the libc crate for these targets.
pub const SO_SNDBUFFORCE: libc::c_int = 32;
pub const SO_RCVBUFFORCE: libc::c_int = 33;

/// `struct tcp_repair_opt` in `include/uapi/linux/tcp.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpRepairOpt {
    pub opt_code: u32,
    pub opt_val: u32,
}

/// `struct tcp_repair_window` in `include/uapi/linux/tcp.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct TcpRepairWindow {
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
}

fn check(ret: libc::c_int) -> io::Result<libc::c_int> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// A new blocking IPv4 TCP socket, close-on-exec.
pub fn tcp4_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket(2) takes no pointers.
    let fd = check(unsafe {
        libc::socket(
            libc::AF_INET,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            libc::IPPROTO_TCP,
        )
    })?;
    // SAFETY: `fd` was just returned by socket(2), is open, and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// setsockopt(2) with a plain-old-data value (`T` is `repr(C)` with no padding
/// the kernel would read: an int, or one of the structs above).
fn setsockopt_raw<T: Copy>(fd: RawFd, level: libc::c_int, name: libc::c_int, val: &[T]) -> io::Result<()> {
    let len = std::mem::size_of_val(val);
    // SAFETY: `val` points to `len` initialized bytes that live across the call;
    // the kernel only reads them.
    check(unsafe { libc::setsockopt(fd, level, name, val.as_ptr().cast(), len as libc::socklen_t) })?;
    Ok(())
}

pub fn setsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int, val: libc::c_int) -> io::Result<()> {
    setsockopt_raw(fd, level, name, &[val])
}

pub fn setsockopt_u32(fd: RawFd, level: libc::c_int, name: libc::c_int, val: u32) -> io::Result<()> {
    setsockopt_raw(fd, level, name, &[val])
}

pub fn set_repair_options(fd: RawFd, opts: &[TcpRepairOpt]) -> io::Result<()> {
    setsockopt_raw(fd, libc::SOL_TCP, libc::TCP_REPAIR_OPTIONS, opts)
}

pub fn set_repair_window(fd: RawFd, window: &TcpRepairWindow) -> io::Result<()> {
    setsockopt_raw(
        fd,
        libc::SOL_TCP,
        libc::TCP_REPAIR_WINDOW,
        std::slice::from_ref(window),
    )
}

/// getsockopt(2) into a `T` that every bit pattern is valid for (integers and
/// structs of integers). Returns the value and the length the kernel wrote;
/// bytes the kernel did not write stay zero.
fn getsockopt_raw<T: Copy>(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<(T, usize)> {
    let mut val = MaybeUninit::<T>::zeroed();
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `val` is writable for `len` bytes and `len` is a valid in/out length.
    check(unsafe { libc::getsockopt(fd, level, name, val.as_mut_ptr().cast(), &mut len) })?;
    // SAFETY: `val` was zeroed, and zero (like any bit pattern the kernel
    // writes) is a valid value of the integer-only types used here.
    Ok((unsafe { val.assume_init() }, len as usize))
}

pub fn getsockopt_int(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<libc::c_int> {
    Ok(getsockopt_raw::<libc::c_int>(fd, level, name)?.0)
}

pub fn getsockopt_u32(fd: RawFd, level: libc::c_int, name: libc::c_int) -> io::Result<u32> {
    Ok(getsockopt_raw::<u32>(fd, level, name)?.0)
}

pub fn tcp_info(fd: RawFd) -> io::Result<libc::tcp_info> {
    Ok(getsockopt_raw::<libc::tcp_info>(fd, libc::SOL_TCP, libc::TCP_INFO)?.0)
}

pub fn repair_window(fd: RawFd) -> io::Result<TcpRepairWindow> {
    let (w, len) = getsockopt_raw::<TcpRepairWindow>(fd, libc::SOL_TCP, libc::TCP_REPAIR_WINDOW)?;
    if len != size_of::<TcpRepairWindow>() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "kernel returned {len} bytes, expected {}",
                size_of::<TcpRepairWindow>()
            ),
        ));
    }
    Ok(w)
}

/// An ioctl(2) that answers one int (`SIOCINQ`, `SIOCOUTQ`, `SIOCOUTQNSD`).
pub fn ioctl_int(fd: RawFd, request: libc::Ioctl) -> io::Result<libc::c_int> {
    let mut val: libc::c_int = 0;
    // SAFETY: these requests write exactly one int through the pointer.
    check(unsafe { libc::ioctl(fd, request, &mut val as *mut libc::c_int) })?;
    Ok(val)
}

/// recv(2) with `MSG_PEEK | MSG_DONTWAIT` into a new buffer of `len` bytes;
/// returns what the kernel copied.
pub fn peek(fd: RawFd, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0u8; len];
    // SAFETY: `buf` is writable for `len` bytes for the duration of the call.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            len,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

/// send(2) with `MSG_DONTWAIT`; returns how many bytes the kernel took.
pub fn send(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    // SAFETY: `buf` is readable for `buf.len()` bytes for the duration of the call.
    let n = unsafe {
        libc::send(
            fd,
            buf.as_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

fn to_sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

pub fn bind(fd: RawFd, addr: SocketAddrV4) -> io::Result<()> {
    let sa = to_sockaddr(addr);
    // SAFETY: `sa` is a valid sockaddr_in of the length passed.
    check(unsafe {
        libc::bind(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

pub fn connect(fd: RawFd, addr: SocketAddrV4) -> io::Result<()> {
    let sa = to_sockaddr(addr);
    // SAFETY: `sa` is a valid sockaddr_in of the length passed.
    check(unsafe {
        libc::connect(
            fd,
            (&sa as *const libc::sockaddr_in).cast(),
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// The socket's local (`peer == false`) or remote address, if it is IPv4.
pub fn address(fd: RawFd, peer: bool) -> io::Result<Option<SocketAddrV4>> {
    let mut ss = MaybeUninit::<libc::sockaddr_storage>::zeroed();
    let mut len = size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let f = if peer {
        libc::getpeername
    } else {
        libc::getsockname
    };
    // SAFETY: `ss` is writable for `len` bytes, `len` is a valid in/out length.
    check(unsafe { f(fd, ss.as_mut_ptr().cast(), &mut len) })?;
    // SAFETY: zeroed storage is a valid sockaddr_storage; the kernel filled a prefix.
    let ss = unsafe { ss.assume_init() };
    if ss.ss_family != libc::AF_INET as libc::sa_family_t || (len as usize) < size_of::<libc::sockaddr_in>() {
        return Ok(None);
    }
    // SAFETY: the family says the storage holds a sockaddr_in, which is smaller
    // than sockaddr_storage and has no stricter alignment.
    let sin = unsafe { *(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
    Ok(Some(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
        u16::from_be(sin.sin_port),
    )))
}

/// Moves the calling thread into the network namespace `ns` refers to (a
/// `/run/netns/NAME` file); used by the tests to restore in another namespace.
#[cfg(test)]
pub fn enter_netns(ns: &impl std::os::fd::AsRawFd) -> io::Result<()> {
    // SAFETY: setns(2) takes no pointers; it affects only the calling thread.
    check(unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) })?;
    Ok(())
}

/// `struct sock_filter` / `struct sock_fprog` in `include/uapi/linux/filter.h`.
#[repr(C)]
#[derive(Clone, Copy)]
struct SockFilter {
    code: u16,
    jt: u8,
    jf: u8,
    k: u32,
}

#[repr(C)]
struct SockFprog {
    len: libc::c_ushort,
    filter: *const SockFilter,
}

/// `BPF_RET | BPF_K` (`include/uapi/linux/bpf_common.h`).
const BPF_RET_K: u16 = 0x06;

/// Attaches a classic BPF socket filter that accepts nothing: the kernel
/// drops every segment for the socket before TCP sees it (`tcp_filter`), so
/// nothing more is received or acknowledged.
pub fn drop_all_incoming(fd: RawFd) -> io::Result<()> {
    let program = [SockFilter {
        code: BPF_RET_K,
        jt: 0,
        jf: 0,
        k: 0,
    }];
    let prog = SockFprog {
        len: program.len() as libc::c_ushort,
        filter: program.as_ptr(),
    };
    // SAFETY: `prog` and the program it points to live across the call; the
    // kernel copies the program and only reads both.
    check(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&prog as *const SockFprog).cast(),
            size_of::<SockFprog>() as libc::socklen_t,
        )
    })?;
    Ok(())
}

/// `NETLINK_NETFILTER`, `NFNL_SUBSYS_CTNETLINK`, `IPCTNL_MSG_CT_DELETE`
/// (`include/uapi/linux/netfilter/nfnetlink.h`, `nfnetlink_conntrack.h`).
const NETLINK_NETFILTER: libc::c_int = 12;
const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
/// `CTA_TUPLE_ORIG`, `CTA_TUPLE_IP`, `CTA_TUPLE_PROTO`, `CTA_IP_V4_SRC`,
/// `CTA_IP_V4_DST`, `CTA_PROTO_NUM`, `CTA_PROTO_SRC_PORT`, `CTA_PROTO_DST_PORT`.
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_SRC_PORT: u16 = 2;
const CTA_PROTO_DST_PORT: u16 = 3;
const NLA_F_NESTED: u16 = 0x8000;

/// Appends a netlink attribute (padded to 4 bytes).
fn nla(out: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = 4 + payload.len();
    out.extend_from_slice(&(len as u16).to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(payload);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

/// The ctnetlink request deleting the TCP conntrack entry whose original
/// direction is `src` → `dst`.
fn conntrack_delete_request(src: SocketAddrV4, dst: SocketAddrV4, seq: u32) -> Vec<u8> {
    let mut ip = Vec::new();
    nla(&mut ip, CTA_IP_V4_SRC, &src.ip().octets());
    nla(&mut ip, CTA_IP_V4_DST, &dst.ip().octets());
    let mut proto = Vec::new();
    nla(&mut proto, CTA_PROTO_NUM, &[libc::IPPROTO_TCP as u8]);
    nla(&mut proto, CTA_PROTO_SRC_PORT, &src.port().to_be_bytes());
    nla(&mut proto, CTA_PROTO_DST_PORT, &dst.port().to_be_bytes());
    let mut tuple = Vec::new();
    nla(&mut tuple, CTA_TUPLE_IP | NLA_F_NESTED, &ip);
    nla(&mut tuple, CTA_TUPLE_PROTO | NLA_F_NESTED, &proto);
    let mut body = vec![libc::AF_INET as u8, 0, 0, 0]; // struct nfgenmsg: family, version 0, res_id 0
    nla(&mut body, CTA_TUPLE_ORIG | NLA_F_NESTED, &tuple);
    let mut msg = Vec::with_capacity(16 + body.len());
    msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
    msg.extend_from_slice(&((NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE).to_ne_bytes());
    msg.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16).to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes());
    msg.extend_from_slice(&body);
    msg
}

/// Deletes the TCP conntrack entry whose original direction is `src` →
/// `dst` in the calling thread's network namespace; the kernel's answer as
/// an error (`ENOENT`: there was none).
pub fn conntrack_delete(src: SocketAddrV4, dst: SocketAddrV4) -> io::Result<()> {
    // SAFETY: plain socket(2); the fd is owned at once.
    let fd = check(unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_NETFILTER,
        )
    })?;
    // SAFETY: `fd` was just returned by socket(2) and is owned by nobody else.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let msg = conntrack_delete_request(src, dst, 1);
    // SAFETY: the kernel is the destination (zeroed sockaddr_nl, family set).
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `msg` and `kernel` live across the call and are only read.
    let sent = unsafe {
        libc::sendto(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            msg.as_ptr().cast(),
            msg.len(),
            0,
            (&kernel as *const libc::sockaddr_nl).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut answer = [0u8; 512];
    // SAFETY: `answer` is writable for its length.
    let got = unsafe {
        libc::recv(
            std::os::fd::AsRawFd::as_raw_fd(&sock),
            answer.as_mut_ptr().cast(),
            answer.len(),
            0,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    // The answer is an NLMSG_ERROR: its error code right after the header
    // (0: done, a negative errno otherwise).
    let got = got as usize;
    if got >= 20 && u16::from_ne_bytes([answer[4], answer[5]]) == libc::NLMSG_ERROR as u16 {
        let code = i32::from_ne_bytes([answer[16], answer[17], answer[18], answer[19]]);
        return if code == 0 {
            Ok(())
        } else {
            Err(io::Error::from_raw_os_error(-code))
        };
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidData,
        "unexpected ctnetlink answer",
    ))
}
