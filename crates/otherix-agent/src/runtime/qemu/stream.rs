//! The migration stream's connection, made by the agents and handed to QEMU.
//!
//! QEMU decides when to switch over from what it has sent and how fast it
//! sends: it pauses the guest once what is left fits in the downtime limit.
//! Bytes in the kernel's socket buffers count as sent. Left to themselves
//! those buffers grow to megabytes (Linux autotunes them; a target whose
//! QEMU reads slower than the source writes fills its receive buffer), and
//! after the switchover the target still has all of them to read before the
//! guest runs again: measured on the project's testbed, up to 14 MB queued,
//! 100 ms of standstill that QEMU's downtime figure never showed.
//!
//! So the agents make the connection themselves, with both buffers bounded
//! to [`SOCKET_BUFFER`], and give QEMU the descriptor over QMP (`getfd`, the
//! descriptor sent with the command): the source connects and asks QEMU to
//! `migrate` to `fd:NAME`; the target listens, and hands QEMU the first
//! connection it accepts with `migrate-incoming` from `fd:NAME`. The stream
//! is QEMU's as before (TLS with the migration's key; anything else that
//! connects fails its handshake, as it did on QEMU's own listener).

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use socket2::{Domain, Protocol, Socket, Type};
use tracing::{info, warn};

use super::qmp::Qmp;
use crate::net::Netns;

/// Bytes asked for each end's kernel buffer of the migration connection
/// (Linux doubles it for its own bookkeeping). Enough for the window a
/// datacenter path needs (256 KiB over a 1 ms round trip is 256 MB/s), and
/// a few milliseconds of QEMU's stream: what can be in flight when the
/// guest pauses.
pub const SOCKET_BUFFER: usize = 256 << 10;

/// Longest the source waits for the target's listener to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Name of the descriptor handed to the source QEMU.
pub const OUT_FD: &str = "migout-sock";
/// Name of the descriptor handed to the target QEMU.
pub const IN_FD: &str = "migin-sock";

/// Runs `f` in the node's network namespace (`None`: the agent's own), on a
/// blocking thread.
async fn in_netns<T, F>(netns: Option<String>, f: F) -> std::io::Result<T>
where
    F: FnOnce() -> std::io::Result<T> + Send + 'static,
    T: Send + 'static,
{
    tokio::task::spawn_blocking(move || match netns {
        Some(ns) => Netns::open(&ns)
            .and_then(|n| n.run(f))
            .map_err(std::io::Error::other)?,
        None => f(),
    })
    .await
    .map_err(std::io::Error::other)?
}

/// The source's end: a connection from `local` (this node's VTEP: the one
/// address the target takes the stream from; `None`: the kernel's choice)
/// to the target's listener at `address`, its send buffer bounded.
pub async fn connect(
    netns: Option<String>,
    local: Option<Ipv4Addr>,
    address: SocketAddr,
) -> std::io::Result<OwnedFd> {
    in_netns(netns, move || {
        let socket = Socket::new(Domain::for_address(address), Type::STREAM, Some(Protocol::TCP))?;
        socket.set_send_buffer_size(SOCKET_BUFFER)?;
        socket.set_recv_buffer_size(SOCKET_BUFFER)?;
        if let Some(local) = local {
            socket
                .bind(&SocketAddr::V4(SocketAddrV4::new(local, 0)).into())
                .map_err(|e| {
                    std::io::Error::new(e.kind(), format!("bind to this node's VTEP {local}: {e}"))
                })?;
        }
        socket
            .connect_timeout(&address.into(), CONNECT_TIMEOUT)
            .map_err(|e| std::io::Error::new(e.kind(), format!("connect to {address}: {e}")))?;
        Ok(OwnedFd::from(socket))
    })
    .await
}

/// The target's listener on `vtep`, on `port` (0: any); its receive buffer
/// (which the connections it accepts take, and which sets the window the
/// target offers) bounded. Nonblocking, for tokio.
pub async fn listen(
    netns: Option<String>,
    vtep: Ipv4Addr,
    port: u16,
) -> std::io::Result<std::net::TcpListener> {
    in_netns(netns, move || {
        let socket = Socket::new(Domain::IPV4, Type::STREAM, Some(Protocol::TCP))?;
        socket.set_reuse_address(true)?;
        socket.set_recv_buffer_size(SOCKET_BUFFER)?;
        socket.set_send_buffer_size(SOCKET_BUFFER)?;
        socket.bind(&SocketAddr::V4(SocketAddrV4::new(vtep, port)).into())?;
        socket.listen(1)?;
        socket.set_nonblocking(true)?;
        Ok(std::net::TcpListener::from(socket))
    })
    .await
}

/// The target's wait: accepts the first connection from `from` (the
/// source's VTEP) on `listener` and hands it to the incoming QEMU behind
/// `qmp` (`getfd`, then `migrate-incoming`), then sets `handed`. Anything
/// else that connects is closed (QEMU takes one stream, and one that fails
/// its handshake would leave it waiting for good). Ends without one once
/// `alive` says the QEMU is gone.
/// A hand-over that failed leaves QEMU waiting with no listener: the next
/// round listens again ([`super::QemuRuntime::ensure_incoming`]).
pub async fn hand_over(
    id: String,
    listener: std::net::TcpListener,
    from: Ipv4Addr,
    qmp: PathBuf,
    alive: impl Fn() -> bool + Send + 'static,
    handed: Arc<AtomicBool>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            warn!(vm_id = %id, error = %e, "cannot wait for the migration stream");
            return;
        }
    };
    let (stream, peer) = loop {
        match tokio::time::timeout(Duration::from_secs(1), listener.accept()).await {
            Ok(Ok((stream, peer))) if peer.ip() == std::net::IpAddr::V4(from) => break (stream, peer),
            Ok(Ok((stream, peer))) => {
                metrics::counter!("otherix_agent_qemu_migration_streams_total", "result" => "refused")
                    .increment(1);
                warn!(vm_id = %id, from = %peer, source = %from, "a connection to the migration's port not from its source; closed");
                drop(stream);
            }
            Ok(Err(e)) => {
                warn!(vm_id = %id, error = %e, "accepting the migration stream failed; waiting on");
                if !alive() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_) if !alive() => return,
            Err(_) => {}
        }
    };
    drop(listener);
    let conn = match stream.into_std() {
        Ok(s) => s,
        Err(e) => {
            warn!(vm_id = %id, error = %e, "cannot take the migration stream's connection");
            return;
        }
    };
    let hand = async {
        let mut qmp = Qmp::connect(&qmp).await?;
        qmp.send_fd(IN_FD, &conn).await?;
        qmp.execute("migrate-incoming", Some(json!({ "uri": format!("fd:{IN_FD}") })))
            .await
    };
    match hand.await {
        Ok(_) => {
            handed.store(true, Ordering::Release);
            metrics::counter!("otherix_agent_qemu_migration_streams_total", "result" => "handed")
                .increment(1);
            info!(vm_id = %id, from = %peer, "migration stream accepted; the incoming QEMU reads it");
        }
        Err(e) => {
            // QEMU may hold a copy: shut the connection itself, so the
            // source learns at once (and the next round listens again).
            let _ = conn.shutdown(std::net::Shutdown::Both);
            metrics::counter!("otherix_agent_qemu_migration_streams_total", "result" => "failed")
                .increment(1);
            warn!(vm_id = %id, from = %peer, error = %e, "could not hand the migration stream to QEMU");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wait for a stream from 127.0.0.1 on a loopback port, handed to the
    /// QMP peer at `sock`: (the port, whether it was handed, the task).
    async fn wait_on_loopback(sock: &std::path::Path) -> (u16, Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
        let listener = listen(None, Ipv4Addr::LOCALHOST, 0).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let handed = Arc::new(AtomicBool::new(false));
        let wait = tokio::spawn(hand_over(
            "vm".into(),
            listener,
            Ipv4Addr::LOCALHOST,
            sock.to_path_buf(),
            || true,
            handed.clone(),
        ));
        (port, handed, wait)
    }

    /// Linux reports twice what was asked (its bookkeeping), and the
    /// accepted socket takes the listener's receive buffer.
    #[tokio::test]
    async fn both_ends_of_the_stream_have_bounded_buffers() {
        let listener = listen(None, Ipv4Addr::LOCALHOST, 0).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let out = connect(None, None, SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
            .await
            .unwrap();
        let out = Socket::from(out);
        assert_eq!(out.send_buffer_size().unwrap(), 2 * SOCKET_BUFFER);
        listener.set_nonblocking(false).unwrap();
        let (accepted, _) = listener.accept().unwrap();
        let accepted = Socket::from(accepted);
        assert_eq!(accepted.recv_buffer_size().unwrap(), 2 * SOCKET_BUFFER);
    }

    #[tokio::test]
    async fn a_listener_can_take_its_port_again_once_it_is_gone() {
        let first = listen(None, Ipv4Addr::LOCALHOST, 0).await.unwrap();
        let port = first.local_addr().unwrap().port();
        drop(first);
        let again = listen(None, Ipv4Addr::LOCALHOST, port).await.unwrap();
        assert_eq!(again.local_addr().unwrap().port(), port);
    }

    #[tokio::test]
    async fn the_wait_ends_without_a_connection_once_qemu_is_gone() {
        let listener = listen(None, Ipv4Addr::LOCALHOST, 0).await.unwrap();
        let gone = tokio::time::timeout(
            Duration::from_secs(10),
            hand_over(
                "vm".into(),
                listener,
                Ipv4Addr::LOCALHOST,
                PathBuf::from("/nonexistent/qmp.sock"),
                || false,
                Arc::new(AtomicBool::new(false)),
            ),
        )
        .await;
        assert!(gone.is_ok(), "the wait went on for a QEMU that is gone");
    }

    /// Only the source's connection reaches QEMU: one from another address
    /// is closed, and the wait goes on. QEMU here is a scripted QMP peer
    /// that answers every command.
    #[tokio::test]
    async fn only_a_connection_from_the_source_is_handed_to_qemu() {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
        let dir = std::env::temp_dir().join(format!("otherix-stream-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&sock);
        let qemu = tokio::net::UnixListener::bind(&sock).unwrap();
        let commands = tokio::spawn(async move {
            let (s, _) = qemu.accept().await.unwrap();
            let (r, mut w) = s.into_split();
            w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .await
                .unwrap();
            let mut lines = BufReader::new(r).lines();
            let mut seen = Vec::new();
            while let Ok(Some(line)) = lines.next_line().await {
                seen.push(line);
                w.write_all(b"{\"return\": {}}\n").await.unwrap();
            }
            seen
        });

        let (port, handed, wait) = wait_on_loopback(&sock).await;
        let target = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let stranger = std::net::TcpStream::from(
            connect(None, Some(Ipv4Addr::new(127, 0, 0, 2)), target)
                .await
                .unwrap(),
        );
        stranger.set_nonblocking(true).unwrap();
        let mut stranger = tokio::net::TcpStream::from_std(stranger).unwrap();
        let mut buf = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(10), stranger.read(&mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
            "the stranger's connection was not closed: {closed:?}"
        );
        assert!(
            !handed.load(Ordering::Acquire) && !wait.is_finished(),
            "the wait went on"
        );

        let _source = connect(None, Some(Ipv4Addr::LOCALHOST), target).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap()
            .unwrap();
        assert!(
            handed.load(Ordering::Acquire),
            "the source's connection was handed over"
        );
        let seen = commands.await.unwrap();
        assert!(
            seen[1].contains("\"getfd\"") && seen[1].contains(IN_FD),
            "{seen:?}"
        );
        assert!(
            seen[2].contains("\"migrate-incoming\"") && seen[2].contains("fd:migin-sock"),
            "{seen:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// QEMU refusing the stream (here `migrate-incoming` answers an error,
    /// after `getfd` took a copy it keeps open, as QEMU does) shuts the
    /// connection itself: the source sees it end at once, not when its
    /// handshake times out.
    #[tokio::test]
    async fn a_stream_qemu_refused_is_shut_for_the_source() {
        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
        use std::io::{IoSliceMut, Write};
        use std::os::fd::{AsRawFd, RawFd};
        use tokio::io::AsyncReadExt;
        let dir = std::env::temp_dir().join(format!("otherix-stream-refused-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("qmp.sock");
        let _ = std::fs::remove_file(&sock);
        let qemu = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        // A QMP peer that keeps every descriptor it is given.
        let peer = std::thread::spawn(move || {
            let (mut s, _) = qemu.accept().unwrap();
            s.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .unwrap();
            let (mut held, mut pending): (Vec<RawFd>, String) = (Vec::new(), String::new());
            loop {
                let mut buf = [0u8; 512];
                let mut space = nix::cmsg_space!([RawFd; 4]);
                let n = {
                    let mut iov = [IoSliceMut::new(&mut buf)];
                    let msg =
                        recvmsg::<()>(s.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty()).unwrap();
                    for c in msg.cmsgs().unwrap() {
                        if let ControlMessageOwned::ScmRights(fds) = c {
                            held.extend(fds);
                        }
                    }
                    msg.bytes
                };
                if n == 0 {
                    return held;
                }
                pending.push_str(&String::from_utf8_lossy(&buf[..n]));
                while let Some(i) = pending.find('\n') {
                    let line: String = pending.drain(..=i).collect();
                    let answer: &[u8] = if line.contains("migrate-incoming") {
                        b"{\"error\": {\"class\": \"GenericError\", \"desc\": \"no\"}}\n"
                    } else {
                        b"{\"return\": {}}\n"
                    };
                    s.write_all(answer).unwrap();
                }
            }
        });
        let (port, handed, wait) = wait_on_loopback(&sock).await;
        let source = std::net::TcpStream::from(
            connect(
                None,
                Some(Ipv4Addr::LOCALHOST),
                SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            )
            .await
            .unwrap(),
        );
        source.set_nonblocking(true).unwrap();
        let mut source = tokio::net::TcpStream::from_std(source).unwrap();
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap()
            .unwrap();
        assert!(!handed.load(Ordering::Acquire));
        let held = peer.join().unwrap();
        assert_eq!(held.len(), 1, "QEMU's copy of the connection");
        let mut buf = [0u8; 1];
        let ended = tokio::time::timeout(Duration::from_secs(5), source.read(&mut buf)).await;
        assert!(
            matches!(ended, Ok(Ok(0)) | Ok(Err(_))),
            "the source's connection stayed open: {ended:?}"
        );
        for fd in held {
            let _ = nix::unistd::close(fd);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
