//! A gateway tunnel carried on a thread of its own, as `socat` carries a
//! connection: one `poll(2)` over the local connection and the TLS
//! connection to the gateway, then read, encrypt or decrypt, write — all on
//! the thread that was woken.
//!
//! `otherix forward` hands each connection to a gateway VM here once its
//! tunnel is open. Carried by tokio instead, a round trip woke the runtime's
//! I/O driver, which handed the task to a worker thread: a futex wake and a
//! context switch more for each direction, the most of what the forward
//! added to a round trip over what `socat` adds in front of nginx (see
//! `docs/benchmarks.md`, "Latency"). A thread per connection is what a
//! forward of a handful of connections can afford; its stack is small and
//! its two buffers are 64 KiB each.
//!
//! The bytes and the ends are what `tokio::io::copy_bidirectional` gives:
//! each direction ends on its own — the local side's end sends TLS
//! `close_notify` and shuts the gateway connection's write side; the
//! gateway's `close_notify` shuts the local connection's write side — and
//! the splice returns when both have ended, with the bytes carried each
//! way. A gateway that closes without `close_notify` (a truncation), a reset
//! or a TLS error ends it with that error.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;

use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use rustls::ClientConnection;

use super::Tunnel;

/// Bytes read from either side at a time.
const BUF: usize = 64 << 10;
/// The thread's stack: the buffers are on the heap.
const STACK: usize = 256 << 10;

/// Carries `conn` and `tunnel` both ways on a thread of their own until
/// both directions have ended; the bytes carried up (conn → tunnel) and
/// down. Must be called within a tokio runtime (the sockets leave it).
pub async fn splice(conn: tokio::net::TcpStream, tunnel: Tunnel) -> io::Result<(u64, u64)> {
    let conn = conn.into_std()?;
    let (tls, early) = tunnel.into_parts();
    let (tcp, session) = tls.into_inner();
    let tcp = tcp.into_std()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("otherix-splice".into())
        .stack_size(STACK)
        .spawn(move || {
            let _ = tx.send(Splice::new(conn, tcp, session, early).run());
        })?;
    rx.await.unwrap_or_else(|_| {
        Err(io::Error::other(
            "the connection's thread ended without an answer",
        ))
    })
}

/// One connection's state on its thread.
struct Splice {
    /// The local connection (plain bytes).
    conn: TcpStream,
    /// The connection to the gateway, and its TLS session.
    tcp: TcpStream,
    tls: ClientConnection,
    /// Read from `conn`, handed to the session at once.
    up_buf: Box<[u8]>,
    /// Decrypted, not yet all written to `conn`: `down_buf[down_at..down_len]`.
    down_buf: Box<[u8]>,
    down_at: usize,
    down_len: usize,
    /// The local side ended (`close_notify` queued) ...
    up_eof: bool,
    /// ... and the gateway connection's write side is shut.
    up_shut: bool,
    /// The gateway sent `close_notify` ...
    down_eof: bool,
    /// ... and, all before it delivered, `conn`'s write side is shut.
    down_shut: bool,
    /// The gateway connection's read side reached its end.
    tcp_eof: bool,
    /// Why the gateway's stream ended early (a truncation, a TLS error),
    /// said once what was decrypted before it is delivered.
    down_err: Option<io::Error>,
    /// The last read of each side filled its buffer: read again before
    /// waiting (a bulk transfer then costs no `poll` per read).
    up_hot: bool,
    down_hot: bool,
    up: u64,
    down: u64,
}

impl Splice {
    fn new(conn: TcpStream, tcp: TcpStream, mut tls: ClientConnection, early: Vec<u8>) -> Splice {
        // The splice reads locally only when the session has sent all it
        // holds: that, not the session's own limit, bounds what it buffers.
        tls.set_buffer_limit(None);
        let mut down_buf = vec![0u8; BUF.max(early.len())].into_boxed_slice();
        down_buf[..early.len()].copy_from_slice(&early);
        Splice {
            conn,
            tcp,
            tls,
            up_buf: vec![0u8; BUF].into_boxed_slice(),
            down_len: early.len(),
            down_buf,
            down_at: 0,
            up_eof: false,
            up_shut: false,
            down_eof: false,
            down_shut: false,
            tcp_eof: false,
            down_err: None,
            up_hot: false,
            down_hot: false,
            up: 0,
            down: 0,
        }
    }

    fn run(mut self) -> io::Result<(u64, u64)> {
        loop {
            self.flush_up()?;
            self.flush_down()?;
            if self.up_shut && self.down_shut {
                return Ok((self.up, self.down));
            }
            let (read_up, read_down) = self.room();
            if read_up && self.up_hot {
                self.read_up()?;
            } else if read_down && self.down_hot {
                self.read_down()?;
            } else {
                self.wait_and_read()?;
            }
        }
    }

    /// Whether each side may be read now: the local one only when the
    /// session has sent all it holds, the gateway's only when what it sent
    /// has been delivered — so each side's flow control reaches the other.
    fn room(&self) -> (bool, bool) {
        let read_up = !self.up_eof && !self.tls.wants_write();
        let read_down =
            !self.tcp_eof && !self.down_eof && self.down_err.is_none() && self.down_at == self.down_len;
        (read_up, read_down)
    }

    /// Everything the session has encrypted goes to the gateway, as far as
    /// its socket takes it; once the local side has ended and all is sent,
    /// the write side is shut.
    fn flush_up(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.tcp) {
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.up_eof && !self.up_shut {
            // The peer may already be gone: its own end is what counts.
            let _ = self.tcp.shutdown(Shutdown::Write);
            self.up_shut = true;
        }
        Ok(())
    }

    /// What is decrypted goes to the local connection, as far as it takes
    /// it; then the gateway's end, if it came, is passed on.
    fn flush_down(&mut self) -> io::Result<()> {
        while self.down_at < self.down_len {
            match self.conn.write(&self.down_buf[self.down_at..self.down_len]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => {
                    self.down_at += n;
                    self.down += n as u64;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        self.down_at = 0;
        self.down_len = 0;
        // What the session decrypted while the buffer was full.
        self.decrypt();
        if self.down_len > 0 {
            return self.flush_down();
        }
        if let Some(e) = self.down_err.take() {
            return Err(e);
        }
        if self.down_eof && !self.down_shut {
            let _ = self.conn.shutdown(Shutdown::Write);
            self.down_shut = true;
        }
        Ok(())
    }

    /// Moves what the session has decrypted into the free end of `down_buf`.
    fn decrypt(&mut self) {
        while !self.down_eof && self.down_err.is_none() && self.down_len < self.down_buf.len() {
            match self.tls.reader().read(&mut self.down_buf[self.down_len..]) {
                Ok(0) => self.down_eof = true,
                Ok(n) => self.down_len += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // The connection ended without `close_notify`.
                Err(e) => self.down_err = Some(e),
            }
        }
    }

    /// Waits until a side this splice has room for can be read or a side it
    /// has bytes for can be written, then reads what came.
    fn wait_and_read(&mut self) -> io::Result<()> {
        let (read_up, read_down) = self.room();
        let conn_events = flags(read_up, self.down_at < self.down_len);
        let tcp_events = flags(read_down, self.tls.wants_write());
        if conn_events.is_empty() && tcp_events.is_empty() {
            // Cannot happen while a direction is open (each waits on a read
            // or a write); said rather than waited on forever.
            return Err(io::Error::other("the splice has nothing to wait for"));
        }
        // Only the sides with an interest are polled (one polled with none
        // would still report a hang-up, and the loop would spin on it); no
        // allocation per wait.
        let mut fds = [
            PollFd::new(self.conn.as_fd(), conn_events),
            PollFd::new(self.tcp.as_fd(), tcp_events),
        ];
        let polled = match (conn_events.is_empty(), tcp_events.is_empty()) {
            (false, false) => &mut fds[..],
            (false, true) => &mut fds[..1],
            (true, _) => &mut fds[1..],
        };
        loop {
            match poll(polled, PollTimeout::NONE) {
                Ok(_) => break,
                Err(Errno::EINTR) => continue,
                Err(e) => return Err(e.into()),
            }
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let (conn_ready, tcp_ready) = (ready(&fds[0]), ready(&fds[1]));
        // Writes are retried by the flushes at the top of the loop (a
        // hang-up or error shows there); only reads are done here.
        if conn_ready && read_up {
            self.read_up()?;
        }
        if tcp_ready && read_down {
            self.read_down()?;
        }
        Ok(())
    }

    /// Reads the local connection into the session.
    fn read_up(&mut self) -> io::Result<()> {
        self.up_hot = false;
        match self.conn.read(&mut self.up_buf) {
            Ok(0) => {
                self.up_eof = true;
                self.tls.send_close_notify();
            }
            Ok(n) => {
                self.tls.writer().write_all(&self.up_buf[..n])?;
                self.up += n as u64;
                self.up_hot = n == self.up_buf.len();
            }
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted) => {}
            Err(e) => return Err(e),
        }
        Ok(())
    }

    /// Reads the gateway connection into the session and decrypts it, until
    /// its socket is drained or the decrypted bytes fill `down_buf` (the
    /// session takes at most a few KiB per read).
    fn read_down(&mut self) -> io::Result<()> {
        self.down_hot = false;
        loop {
            match self.tls.read_tls(&mut self.tcp) {
                Ok(0) => self.tcp_eof = true,
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
            if let Err(e) = self.tls.process_new_packets() {
                // The alert the session queued goes out before the error ends it.
                let _ = self.tls.write_tls(&mut self.tcp);
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
            self.decrypt();
            if self.tcp_eof || self.down_eof || self.down_err.is_some() {
                return Ok(());
            }
            if self.down_len == self.down_buf.len() {
                self.down_hot = true;
                return Ok(());
            }
        }
    }
}

fn flags(read: bool, write: bool) -> PollFlags {
    let mut f = PollFlags::empty();
    if read {
        f |= PollFlags::POLLIN;
    }
    if write {
        f |= PollFlags::POLLOUT;
    }
    f
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;
    use std::sync::Arc;

    use sha2::{Digest, Sha256};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::tunnel::http1::Upgraded;

    /// A TLS server on loopback with a certificate from a CA of its own,
    /// and a client configuration that trusts that CA.
    fn tls_pair() -> (tokio_rustls::TlsAcceptor, tokio_rustls::TlsConnector) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = rcgen::Issuer::from_ca_cert_pem(&ca.pem(), ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        let server = rustls::ServerConfig::builder_with_provider(otherix_tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            )
            .unwrap();
        let client = otherix_tls::pinned_client_config(ca.der().clone()).unwrap();
        (
            tokio_rustls::TlsAcceptor::from(Arc::new(server)),
            tokio_rustls::TlsConnector::from(Arc::new(client)),
        )
    }

    /// A gateway stand-in running `serve` on its one TLS connection, a
    /// tunnel to it whose peer already sent `early`, and a local connection
    /// pair: the user's end, and the end the splice carries.
    async fn world<F, Fut>(
        early: &[u8],
        serve: F,
    ) -> (
        tokio::net::TcpStream,
        tokio::task::JoinHandle<io::Result<(u64, u64)>>,
    )
    where
        F: FnOnce(tokio_rustls::server::TlsStream<tokio::net::TcpStream>) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send,
    {
        let (acceptor, connector) = tls_pair();
        let gateway = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let gateway_addr = gateway.local_addr().unwrap();
        tokio::spawn(async move {
            let (tcp, _) = gateway.accept().await.unwrap();
            serve(acceptor.accept(tcp).await.unwrap()).await;
        });
        let tcp = tokio::net::TcpStream::connect(gateway_addr).await.unwrap();
        let name = rustls::pki_types::ServerName::IpAddress(gateway_addr.ip().into());
        let tunnel = Upgraded::new(connector.connect(name, tcp).await.unwrap(), early.to_vec());
        let local = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let local_addr: SocketAddr = local.local_addr().unwrap();
        let user = tokio::net::TcpStream::connect(local_addr).await.unwrap();
        let (conn, _) = local.accept().await.unwrap();
        (user, tokio::spawn(splice(conn, tunnel)))
    }

    /// `len` bytes that differ from offset to offset (a lost or repeated
    /// block changes the hash).
    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u32).wrapping_mul(2654435761).to_le_bytes()[0] ^ seed)
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn carries_both_ways_byte_exact_with_the_early_bytes_first_and_passes_each_end_on() {
        const LEN: usize = 8 << 20;
        // The gateway echoes, then ends its side once the user's has ended.
        let (user, spliced) = world(b"early bytes;", |tls| async move {
            let (mut rd, mut wr) = tokio::io::split(tls);
            tokio::io::copy(&mut rd, &mut wr).await.unwrap();
            wr.shutdown().await.unwrap();
        })
        .await;
        let (mut rd, mut wr) = user.into_split();
        let sent = pattern(LEN, 7);
        let want = {
            let mut h = Sha256::new();
            h.update(b"early bytes;");
            h.update(&sent);
            h.finalize()
        };
        let writer = tokio::spawn(async move {
            // Writes of every size, so reads of every size meet the splice.
            let mut at = 0;
            for size in [1, 100, 4096, 16 << 10, 64 << 10, 200_000].iter().cycle() {
                let end = (at + size).min(sent.len());
                wr.write_all(&sent[at..end]).await.unwrap();
                at = end;
                if at == sent.len() {
                    break;
                }
            }
            wr.shutdown().await.unwrap();
        });
        let mut got = Sha256::new();
        let mut total = 0;
        let mut buf = vec![0u8; 50_000];
        loop {
            let n = rd.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            got.update(&buf[..n]);
            total += n;
        }
        writer.await.unwrap();
        assert_eq!(total, LEN + 12);
        assert_eq!(got.finalize(), want, "the bytes back differ from the bytes sent");
        let (up, down) = spliced.await.unwrap().unwrap();
        assert_eq!((up, down), (LEN as u64, LEN as u64 + 12));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_answer_after_the_users_end_still_arrives() {
        // A request read to its end, then an answer: the user's end must
        // reach the gateway as an end (close_notify), and its answer come back.
        let (mut user, spliced) = world(b"", |mut tls| async move {
            let mut request = Vec::new();
            tls.read_to_end(&mut request).await.unwrap();
            let answer = pattern(3 << 20, request.len() as u8);
            tls.write_all(&answer).await.unwrap();
            tls.shutdown().await.unwrap();
        })
        .await;
        user.write_all(&[1; 5]).await.unwrap();
        user.shutdown().await.unwrap();
        let mut answer = Vec::new();
        user.read_to_end(&mut answer).await.unwrap();
        assert!(
            answer == pattern(3 << 20, 5),
            "the answer differs ({} bytes)",
            answer.len()
        );
        assert_eq!(spliced.await.unwrap().unwrap(), (5, 3 << 20));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_gateway_gone_without_close_notify_is_an_error_after_what_it_sent() {
        let (mut user, spliced) = world(b"", |mut tls| async move {
            tls.write_all(b"partial answer").await.unwrap();
            tls.flush().await.unwrap();
            // The TCP connection closed under the session: a truncation.
            let (tcp, _) = tls.into_inner();
            drop(tcp);
        })
        .await;
        let mut got = Vec::new();
        user.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"partial answer");
        let err = spliced.await.unwrap().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_user_who_stops_reading_holds_the_gateway_back_and_loses_nothing() {
        // More than every socket buffer on the way can hold (a few MiB each).
        const LEN: usize = 48 << 20;
        let progress = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let written = progress.clone();
        let (mut user, spliced) = world(b"", move |mut tls| async move {
            let data = pattern(LEN, 3);
            for chunk in data.chunks(256 << 10) {
                tls.write_all(chunk).await.unwrap();
                written.fetch_add(chunk.len(), std::sync::atomic::Ordering::SeqCst);
            }
            tls.shutdown().await.unwrap();
        })
        .await;
        // The user reads nothing until the gateway's writes stop advancing
        // (or all were taken, which fails below): what holds it back is
        // the user's window, reached through the splice.
        let mut last = usize::MAX;
        let mut still = 0;
        while still < 6 {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            let now = progress.load(std::sync::atomic::Ordering::SeqCst);
            if now == LEN {
                break;
            }
            still = if now == last { still + 1 } else { 0 };
            last = now;
        }
        let held_at = progress.load(std::sync::atomic::Ordering::SeqCst);
        assert!(
            held_at < LEN,
            "the gateway wrote all {LEN} bytes with no reader: nothing held it back"
        );
        let mut got = Vec::new();
        user.read_to_end(&mut got).await.unwrap();
        assert!(
            got == pattern(LEN, 3),
            "the bytes differ ({} of {LEN})",
            got.len()
        );
        user.shutdown().await.unwrap();
        assert_eq!(spliced.await.unwrap().unwrap(), (0, LEN as u64));
    }
}
