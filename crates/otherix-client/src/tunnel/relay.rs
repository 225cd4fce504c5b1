//! The client side of the relay (DESIGN §6): TLS to the control plane (the
//! pinned cluster CA), a WebSocket upgrade of `GET /v1/relay` carrying the
//! ticket, then a byte stream in binary frames — [`RelayTunnel`], an
//! `AsyncRead + AsyncWrite` like the gateway's tunnel, so `connect`,
//! `forward` and `ssh` cannot tell the transports apart.
//!
//! Framing (see [`otherix_proto::relay`]): a non-empty binary frame carries bytes;
//! an empty one ends that direction (half-close, like a TCP FIN) — a
//! WebSocket Close cannot, because neither side may send data after
//! receiving one. The control plane sends Close once both directions have
//! ended (code 1000), or earlier with another code and a reason when the
//! session failed; that is a read error here, never a silent end.
//!
//! Liveness: the control plane pings every 20 s and the tunnel answers (the
//! protocol queues the pong, the next read sends it); a read fails when
//! nothing at all arrived for [`RelayOptions::silence`], so a control plane
//! that vanished without closing the TCP connection is reported, not waited
//! for. The tunnel sends no pings of its own: the read side must never
//! register for write readiness, or it would steal the wake-up of a writer
//! on another task (`tokio::io::split`) and stall it.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tokio_rustls::client::TlsStream;
use tokio_tungstenite::tungstenite::error::ProtocolError;
use tokio_tungstenite::tungstenite::handshake::client::generate_key;
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{Role, WebSocketConfig};
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_tungstenite::WebSocketStream;

use otherix_proto::relay;

use super::http1::{self, Answer, ResponseHead, Upgraded};
use super::{tls_connect, ConnectError, Peer};
use crate::client::Endpoint;

/// How long the upgrade may take, TCP connect to `101`.
const OPEN_TIMEOUT: Duration = Duration::from_secs(15);

/// Liveness and framing of a relay tunnel.
#[derive(Debug, Clone, Copy)]
pub struct RelayOptions {
    /// A read fails after this long with no frame at all from the relay.
    pub silence: Duration,
    /// Largest frame one write sends.
    pub max_frame: usize,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            // The CP pings every 20 s: two missed beats and some slack.
            silence: Duration::from_secs(45),
            max_frame: relay::MAX_FRAME,
        }
    }
}

/// Opens a relay tunnel through the control plane at `cp_url`
/// (`https://host:port`, the client's configured CP) with `ticket`.
/// Refusals before the upgrade are [`ConnectError::Refused`] with the
/// status and the reason the control plane gave.
pub async fn open(cp_url: &str, ca_pem: &str, ticket: &str) -> Result<RelayTunnel, ConnectError> {
    open_with(cp_url, ca_pem, ticket, RelayOptions::default()).await
}

/// [`open`] with explicit keepalive and framing.
pub async fn open_with(
    cp_url: &str,
    ca_pem: &str,
    ticket: &str,
    options: RelayOptions,
) -> Result<RelayTunnel, ConnectError> {
    match tokio::time::timeout(OPEN_TIMEOUT, upgrade(cp_url, ca_pem, ticket, options)).await {
        Ok(r) => r,
        Err(_) => Err(ConnectError::Timeout {
            endpoint: cp_url.to_string(),
        }),
    }
}

async fn upgrade(
    cp_url: &str,
    ca_pem: &str,
    ticket: &str,
    options: RelayOptions,
) -> Result<RelayTunnel, ConnectError> {
    let (ep, stream) = tls_connect(cp_url, ca_pem, Peer::ControlPlane).await?;
    upgrade_on(cp_url, ep, stream, ticket, options).await
}

/// A TLS connection to the control plane made ahead of need, handshake
/// done and no request sent: [`Warm::upgrade`] presents a ticket on it, as
/// [`open`] does on a connection of its own. The control plane closes a
/// connection that sends no request for 10 s: use or drop one before.
#[derive(Debug)]
pub struct Warm {
    cp_url: String,
    ep: Endpoint,
    stream: TlsStream<TcpStream>,
}

impl Warm {
    /// TLS to the control plane at `cp_url`, verified as [`open`] does.
    pub async fn connect(cp_url: &str, ca_pem: &str) -> Result<Warm, ConnectError> {
        match tokio::time::timeout(OPEN_TIMEOUT, tls_connect(cp_url, ca_pem, Peer::ControlPlane)).await {
            Ok(r) => r.map(|(ep, stream)| Warm {
                cp_url: cp_url.to_string(),
                ep,
                stream,
            }),
            Err(_) => Err(ConnectError::Timeout {
                endpoint: cp_url.to_string(),
            }),
        }
    }

    /// Presents `ticket` on this connection: the tunnel, or the refusal (a
    /// control plane that closed the connection meanwhile is a `Protocol`
    /// or `Connect` error).
    pub async fn upgrade(self, ticket: &str, options: RelayOptions) -> Result<RelayTunnel, ConnectError> {
        let Warm { cp_url, ep, stream } = self;
        match tokio::time::timeout(OPEN_TIMEOUT, upgrade_on(&cp_url, ep, stream, ticket, options)).await {
            Ok(r) => r,
            Err(_) => Err(ConnectError::Timeout { endpoint: cp_url }),
        }
    }
}

impl Warm {
    /// The connection's parts: the control plane's URL, its endpoint, the
    /// TLS stream (for the resumable open, [`super::resumable`]).
    pub(crate) fn into_parts(self) -> (String, Endpoint, TlsStream<TcpStream>) {
        (self.cp_url, self.ep, self.stream)
    }
}

/// The WebSocket upgrade carrying `ticket` on `stream`, TLS to the control
/// plane at `cp_url` (`ep`).
async fn upgrade_on(
    cp_url: &str,
    ep: Endpoint,
    stream: TlsStream<TcpStream>,
    ticket: &str,
    options: RelayOptions,
) -> Result<RelayTunnel, ConnectError> {
    let (_, stream) = websocket_upgrade(cp_url, &ep, stream, ticket, "").await?;
    let mut tunnel = over_upgraded(stream, options).await;
    tunnel.peer = Some(ep.url);
    Ok(tunnel)
}

/// The WebSocket upgrade of `GET /v1/relay` on `stream` (TLS to the control
/// plane at `cp_url`, `ep`) with `bearer` and the `extra` header lines
/// (each ending in CRLF): the `101`'s head and the upgraded stream, or the
/// refusal. Both the relay's open and a resumable session's resume make it.
pub(crate) async fn websocket_upgrade(
    cp_url: &str,
    ep: &Endpoint,
    stream: TlsStream<TcpStream>,
    bearer: &str,
    extra: &str,
) -> Result<(ResponseHead, Upgraded<TlsStream<TcpStream>>), ConnectError> {
    // A line break in a value would be a header of its own.
    if bearer.contains(['\r', '\n']) {
        return Err(ConnectError::Protocol {
            endpoint: cp_url.to_string(),
            reason: "the credential contains a line break".into(),
        });
    }
    let key = generate_key();
    let request = format!(
        "GET {} HTTP/1.1\r\nHost: {}:{}\r\nAuthorization: Bearer {bearer}\r\nConnection: Upgrade\r\n\
         Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {key}\r\n{extra}\r\n",
        relay::PATH,
        ep.host,
        ep.port
    );
    let (head, stream) = match http1::upgrade(stream, cp_url, &request).await? {
        Answer::Upgraded(head, stream) => (head, stream),
        Answer::Refused(e) => return Err(e),
    };
    // The server must prove it read our key: a 101 from something that is
    // not a WebSocket server is not a tunnel.
    if head.header("sec-websocket-accept") != Some(derive_accept_key(key.as_bytes()).as_str()) {
        return Err(ConnectError::Protocol {
            endpoint: cp_url.to_string(),
            reason: "the WebSocket upgrade answer has a wrong Sec-WebSocket-Accept".into(),
        });
    }
    Ok((head, stream))
}

/// The tunnel over `stream`, whose WebSocket upgrade has succeeded: the
/// client's frame limits, then the framing of the module documentation.
/// [`open`] runs it after its upgrade; the fuzz target
/// (`crates/otherix-client/fuzz`, `relay_frames`) over bytes it makes up.
pub async fn over_upgraded<S: AsyncRead + AsyncWrite + Unpin>(
    stream: S,
    options: RelayOptions,
) -> RelayTunnel<S> {
    let config = WebSocketConfig::default()
        .read_buffer_size(64 * 1024)
        // Every write goes out as its own frame at once: no batching delay.
        .write_buffer_size(0)
        .max_frame_size(Some(relay::MAX_FRAME * 2))
        .max_message_size(Some(relay::MAX_FRAME * 2));
    let ws = WebSocketStream::from_raw_socket(stream, Role::Client, Some(config)).await;
    RelayTunnel::new(ws, options)
}

/// The read side.
#[derive(Debug)]
enum Reading {
    Open,
    /// The relay ended its direction (empty frame, or Close 1000).
    Ended,
    /// The session failed; every later read repeats why.
    Failed(io::ErrorKind, String),
}

/// The write side.
#[derive(Debug, PartialEq, Eq)]
enum Writing {
    Open,
    /// Our end-of-stream frame is queued; flushing it finishes the shutdown.
    Ending,
    Ended,
    /// The relay sent Close: nothing may be sent any more.
    Closed,
}

/// A byte stream through the relay; see the module documentation. Generic
/// over the transport only so that tests can run it in memory.
pub struct RelayTunnel<S = Upgraded<TlsStream<TcpStream>>> {
    ws: WebSocketStream<S>,
    /// Bytes of the last data frame not read yet.
    pending: Bytes,
    reading: Reading,
    writing: Writing,
    options: RelayOptions,
    /// When the relay counts as gone if nothing arrives before.
    silence: Pin<Box<Sleep>>,
    /// The control plane's URL, for messages.
    peer: Option<String>,
}

impl<S> std::fmt::Debug for RelayTunnel<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayTunnel")
            .field("reading", &self.reading)
            .field("writing", &self.writing)
            .finish_non_exhaustive()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> RelayTunnel<S> {
    fn new(ws: WebSocketStream<S>, options: RelayOptions) -> RelayTunnel<S> {
        let now = Instant::now();
        RelayTunnel {
            ws,
            pending: Bytes::new(),
            peer: None,
            reading: Reading::Open,
            writing: Writing::Open,
            options,
            silence: Box::pin(tokio::time::sleep_until(now + options.silence)),
        }
    }

    /// Names the control plane in messages.
    pub(crate) fn set_peer(&mut self, url: String) {
        self.peer = Some(url);
    }

    fn fail(&mut self, kind: io::ErrorKind, reason: String) -> io::Error {
        self.reading = Reading::Failed(kind, reason.clone());
        if self.writing != Writing::Ended {
            self.writing = Writing::Closed;
        }
        io::Error::new(kind, reason)
    }

    /// " to URL", naming the control plane when it is known.
    fn to_peer(&self) -> String {
        self.peer
            .as_deref()
            .map(|p| format!(" to {p}"))
            .unwrap_or_default()
    }

    /// One frame from the relay, or the end of the read side.
    fn poll_frame(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            match Pin::new(&mut self.ws).poll_next(cx) {
                Poll::Ready(Some(Ok(msg))) => {
                    let deadline = Instant::now() + self.options.silence;
                    self.silence.as_mut().reset(deadline);
                    match msg {
                        Message::Binary(b) if b.is_empty() => {
                            self.reading = Reading::Ended;
                            return Poll::Ready(Ok(()));
                        }
                        Message::Binary(b) => {
                            self.pending = b;
                            return Poll::Ready(Ok(()));
                        }
                        // Pongs to the relay's pings are queued by the
                        // protocol and sent with the next read.
                        Message::Ping(_) | Message::Pong(_) | Message::Frame(_) => {}
                        Message::Text(_) => {
                            let e =
                                self.fail(io::ErrorKind::InvalidData, "the relay sent a text frame".into());
                            return Poll::Ready(Err(e));
                        }
                        Message::Close(frame) => {
                            // Our reply is queued: a later read, or shutdown,
                            // sends it (not here: see the module docs on wakers).
                            let (code, reason) = frame
                                .map(|f| (f.code, f.reason.to_string()))
                                .unwrap_or((CloseCode::Status, String::new()));
                            if code == CloseCode::Normal {
                                self.reading = Reading::Ended;
                                if self.writing != Writing::Ended {
                                    self.writing = Writing::Closed;
                                }
                                return Poll::Ready(Ok(()));
                            }
                            let reason = if reason.is_empty() {
                                format!("close code {}", u16::from(code))
                            } else {
                                reason
                            };
                            let e = self.fail(
                                io::ErrorKind::ConnectionAborted,
                                format!("relay session ended: {reason}"),
                            );
                            return Poll::Ready(Err(e));
                        }
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let cut = matches!(&e, WsError::Protocol(ProtocolError::ResetWithoutClosingHandshake))
                        || matches!(
                            &e,
                            WsError::Io(io) if matches!(
                                io.kind(),
                                io::ErrorKind::UnexpectedEof
                                    | io::ErrorKind::ConnectionReset
                                    | io::ErrorKind::ConnectionAborted
                                    | io::ErrorKind::BrokenPipe
                            )
                        );
                    let e = if cut {
                        let msg = format!(
                            "the relay connection{} was cut without a close (the control plane stopped or is unreachable); connect again",
                            self.to_peer()
                        );
                        self.fail(io::ErrorKind::ConnectionAborted, msg)
                    } else {
                        let e = to_io(e);
                        self.fail(e.kind(), format!("relay connection failed: {e}"))
                    };
                    return Poll::Ready(Err(e));
                }
                Poll::Ready(None) => {
                    let msg = format!(
                        "the relay connection{} ended without a close (the control plane stopped or is unreachable); connect again",
                        self.to_peer()
                    );
                    let e = self.fail(io::ErrorKind::ConnectionAborted, msg);
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => {
                    if self.silence.as_mut().poll(cx).is_ready() {
                        let e = self.fail(
                            io::ErrorKind::TimedOut,
                            format!(
                                "no sign of life from the relay for {:?} (control plane unreachable?)",
                                self.options.silence
                            ),
                        );
                        return Poll::Ready(Err(e));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RelayTunnel<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.pending.is_empty() {
                let n = this.pending.len().min(buf.remaining());
                buf.put_slice(&this.pending.split_to(n));
                return Poll::Ready(Ok(()));
            }
            match &this.reading {
                Reading::Ended => return Poll::Ready(Ok(())),
                Reading::Failed(kind, reason) => {
                    return Poll::Ready(Err(io::Error::new(*kind, reason.clone())))
                }
                Reading::Open => {}
            }
            ready!(this.poll_frame(cx))?;
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RelayTunnel<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Reading::Failed(kind, reason) = &this.reading {
            return Poll::Ready(Err(io::Error::new(*kind, reason.clone())));
        }
        match this.writing {
            Writing::Open => {}
            Writing::Closed => {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "the relay closed the session",
                )))
            }
            Writing::Ending | Writing::Ended => {
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "write after shutdown",
                )))
            }
        }
        if buf.is_empty() {
            // An empty frame would end the stream.
            return Poll::Ready(Ok(0));
        }
        let mut ws = Pin::new(&mut this.ws);
        ready!(ws.as_mut().poll_ready(cx)).map_err(to_io)?;
        let n = buf.len().min(this.options.max_frame);
        ws.as_mut()
            .start_send(Message::Binary(Bytes::copy_from_slice(&buf[..n])))
            .map_err(to_io)?;
        // Accepted; push it towards the socket now, the rest on flush.
        if let Poll::Ready(Err(e)) = ws.poll_flush(cx) {
            return Poll::Ready(Err(to_io(e)));
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().ws).poll_flush(cx).map_err(to_io)
    }

    /// Ends our direction (an empty frame), leaving the other one open: the
    /// guest still answers. When that direction has ended too, waits for the
    /// relay's Close so the session ends cleanly.
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            match this.writing {
                Writing::Open => {
                    let mut ws = Pin::new(&mut this.ws);
                    ready!(ws.as_mut().poll_ready(cx)).map_err(to_io)?;
                    ws.start_send(Message::Binary(Bytes::new())).map_err(to_io)?;
                    this.writing = Writing::Ending;
                }
                Writing::Ending => {
                    ready!(Pin::new(&mut this.ws).poll_flush(cx)).map_err(to_io)?;
                    this.writing = Writing::Ended;
                }
                Writing::Ended => {
                    // Both directions done: the relay's Close follows.
                    if matches!(this.reading, Reading::Ended) && this.pending.is_empty() {
                        return this.poll_close_handshake(cx);
                    }
                    return Poll::Ready(Ok(()));
                }
                Writing::Closed => {
                    // Our reply to the relay's Close may still be queued.
                    return match ready!(Pin::new(&mut this.ws).poll_flush(cx)) {
                        Ok(()) | Err(WsError::ConnectionClosed | WsError::AlreadyClosed) => {
                            Poll::Ready(Ok(()))
                        }
                        Err(e) => Poll::Ready(Err(to_io(e))),
                    };
                }
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> RelayTunnel<S> {
    /// After both directions ended: reads until the relay's Close (or the
    /// connection's end), answering it. Bounded by the silence timer.
    fn poll_close_handshake(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        loop {
            match Pin::new(&mut self.ws).poll_next(cx) {
                Poll::Ready(Some(Ok(Message::Close(_)))) => {
                    self.writing = Writing::Closed;
                    let _ = ready!(Pin::new(&mut self.ws).poll_flush(cx));
                    return Poll::Ready(Ok(()));
                }
                Poll::Ready(Some(Ok(Message::Binary(b)))) if !b.is_empty() => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "the relay sent data after the end of its stream",
                    )));
                }
                Poll::Ready(Some(Ok(_))) => {}
                Poll::Ready(Some(Err(_))) | Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => {
                    if self.silence.as_mut().poll(cx).is_ready() {
                        return Poll::Ready(Ok(()));
                    }
                    return Poll::Pending;
                }
            }
        }
    }
}

fn to_io(e: WsError) -> io::Error {
    match e {
        WsError::Io(e) => e,
        WsError::ConnectionClosed | WsError::AlreadyClosed => {
            io::Error::new(io::ErrorKind::BrokenPipe, "the relay session is closed")
        }
        other => io::Error::new(io::ErrorKind::InvalidData, other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use futures_util::{SinkExt, StreamExt};
    use tokio::io::{duplex, AsyncReadExt, AsyncWriteExt, DuplexStream};
    use tokio_tungstenite::tungstenite::protocol::CloseFrame;

    use super::*;

    type Server = WebSocketStream<DuplexStream>;

    /// A tunnel and the relay's end of it, in memory.
    async fn pair(options: RelayOptions) -> (RelayTunnel<DuplexStream>, Server) {
        let (client, server) = duplex(256 * 1024);
        let client = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        let server = WebSocketStream::from_raw_socket(server, Role::Server, None).await;
        (RelayTunnel::new(client, options), server)
    }

    fn quick() -> RelayOptions {
        RelayOptions {
            silence: Duration::from_millis(400),
            max_frame: 8,
        }
    }

    #[tokio::test]
    async fn writes_become_bounded_frames_and_shutdown_is_an_empty_one() {
        let (mut t, mut server) = pair(quick()).await;
        t.write_all(b"hello relay!").await.unwrap();
        t.flush().await.unwrap();
        t.shutdown().await.unwrap();
        let mut frames = vec![];
        while let Some(Ok(m)) = server.next().await {
            match m {
                Message::Binary(b) if b.is_empty() => break,
                Message::Binary(b) => frames.push(b),
                _ => {}
            }
        }
        assert_eq!(
            frames,
            [&b"hello re"[..], b"lay!"],
            "one frame per write, at most max_frame"
        );
        // Half-close: the other direction still flows.
        server
            .send(Message::Binary(Bytes::from_static(b"answer")))
            .await
            .unwrap();
        server.send(Message::Binary(Bytes::new())).await.unwrap();
        let mut got = Vec::new();
        t.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"answer");
        assert!(t.write_all(b"late").await.is_err(), "no write after shutdown");
    }

    #[tokio::test]
    async fn a_normal_close_after_both_ends_is_a_clean_end() {
        let (mut t, mut server) = pair(quick()).await;
        server
            .send(Message::Binary(Bytes::from_static(b"bye")))
            .await
            .unwrap();
        server.send(Message::Binary(Bytes::new())).await.unwrap();
        let mut got = Vec::new();
        t.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"bye");
        let relay = tokio::spawn(async move {
            // The relay sees our end of stream, then closes and gets the reply.
            loop {
                match server.next().await {
                    Some(Ok(Message::Binary(b))) if b.is_empty() => break,
                    Some(Ok(_)) => {}
                    other => panic!("{other:?}"),
                }
            }
            server
                .send(Message::Close(Some(CloseFrame {
                    code: CloseCode::Normal,
                    reason: "done".into(),
                })))
                .await
                .unwrap();
            loop {
                match server.next().await {
                    Some(Ok(Message::Close(_))) | None => return,
                    Some(Ok(_)) => {}
                    Some(Err(e)) => panic!("{e}"),
                }
            }
        });
        tokio::time::timeout(Duration::from_secs(5), t.shutdown())
            .await
            .expect("shutdown waits for the relay's close, not longer")
            .unwrap();
        relay.await.unwrap();
    }

    #[tokio::test]
    async fn a_failure_close_is_a_read_error_with_the_reason() {
        let (mut t, mut server) = pair(quick()).await;
        server
            .send(Message::Close(Some(CloseFrame {
                code: CloseCode::Error,
                reason: "connection to node node1 lost".into(),
            })))
            .await
            .unwrap();
        let mut buf = [0u8; 16];
        let err = t.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionAborted);
        assert!(err.to_string().contains("node node1 lost"), "{err}");
        assert!(t.write_all(b"x").await.is_err());
    }

    #[tokio::test]
    async fn a_vanished_relay_is_an_error_not_a_hang() {
        let (mut t, server) = pair(quick()).await;
        drop(server);
        let mut buf = [0u8; 16];
        let err = t.read(&mut buf).await.unwrap_err();
        assert!(err.to_string().contains("relay connection"), "{err}");
    }

    #[tokio::test]
    async fn a_silent_relay_times_out_but_pings_keep_a_live_one_open() {
        // Live: the relay pings more often than the silence limit, then
        // sends data long after that limit has passed.
        let (mut t, mut server) = pair(quick()).await;
        let relay = tokio::spawn(async move {
            for _ in 0..8 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                server.send(Message::Ping(Bytes::new())).await.unwrap();
            }
            server
                .send(Message::Binary(Bytes::from_static(b"!")))
                .await
                .unwrap();
            // The tunnel answered every ping.
            let mut pongs = 0;
            while let Some(Ok(m)) = server.next().await {
                if matches!(m, Message::Pong(_)) {
                    pongs += 1;
                }
            }
            pongs
        });
        let mut buf = [0u8; 1];
        tokio::time::timeout(Duration::from_secs(5), t.read_exact(&mut buf))
            .await
            .unwrap()
            .expect("pings count as signs of life");
        assert_eq!(&buf, b"!");
        // One more read flushes the last pong; then the relay sees the end.
        let _ = tokio::time::timeout(Duration::from_millis(50), t.read(&mut buf)).await;
        drop(t);
        assert!(relay.await.unwrap() >= 7, "pongs answered the pings");

        // Silent: no frame at all for longer than the limit.
        let (mut t, _server) = pair(quick()).await;
        let started = Instant::now();
        let err = t.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    #[tokio::test]
    async fn a_reader_waiting_on_another_task_never_stalls_a_blocked_writer() {
        // A tiny pipe: the writer blocks on a full transport while the reader
        // (split onto another task) receives pings and data.
        let (client, server) = duplex(1024);
        let client = WebSocketStream::from_raw_socket(client, Role::Client, None).await;
        let mut server = WebSocketStream::from_raw_socket(server, Role::Server, None).await;
        let t = RelayTunnel::new(client, quick());
        let (mut rd, mut wr) = tokio::io::split(t);
        let writer = tokio::spawn(async move {
            for _ in 0..64 {
                wr.write_all(&[7u8; 4096]).await.unwrap();
            }
            wr.shutdown().await.unwrap();
        });
        let reader = tokio::spawn(async move {
            let mut got = Vec::new();
            rd.read_to_end(&mut got).await.map(|_| got)
        });
        // The relay is slow to read at first, and pings meanwhile.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            server.send(Message::Ping(Bytes::new())).await.unwrap();
        }
        let mut received = 0;
        loop {
            match tokio::time::timeout(Duration::from_secs(5), server.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) if b.is_empty() => break,
                Ok(Some(Ok(Message::Binary(b)))) => received += b.len(),
                Ok(Some(Ok(_))) => {}
                other => panic!("the writer stalled after {received} bytes: {other:?}"),
            }
        }
        assert_eq!(received, 64 * 4096);
        writer.await.unwrap();
        server.send(Message::Binary(Bytes::new())).await.unwrap();
        assert!(reader.await.unwrap().unwrap().is_empty());
    }
}
