//! The one HTTP/1 upgrade both tunnels make: write a request, read the
//! response head (`101`, or a refusal with a one-line body), and hand on the
//! bytes that arrived after the head — they are the tunnel's first bytes
//! (an SSH banner, a WebSocket frame) and must not be lost.
//!
//! The head parser ([`parse_head`]) is pure over the bytes read so far, built
//! on `httparse`, and total (fuzzed: `crates/otherix-client/fuzz`, target
//! `response_head`); [`Upgraded`] replays what was read past the head
//! before reading the stream again.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

use super::ConnectError;

/// Longest response head the client reads, its blank line included.
pub const MAX_HEAD: usize = 8 * 1024;
/// Longest refusal body the client reads (a refusal is one line).
pub const MAX_REFUSAL: usize = 8 * 1024;
/// Most header lines a head may have.
const MAX_HEADERS: usize = 32;

/// Where reading a head stands, given every byte read so far.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    /// The head is complete: it is the first `len` bytes.
    Complete { head: ResponseHead, len: usize },
    /// Read more.
    Incomplete,
    /// [`MAX_HEAD`] bytes and no end of the head: not an answer we read.
    TooLong,
    /// Not an HTTP/1 response head.
    Malformed(String),
}

/// Parses the response head at the start of `read`.
pub fn parse_head(read: &[u8]) -> Parsed {
    let window = &read[..read.len().min(MAX_HEAD)];
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    match response.parse(window) {
        Ok(httparse::Status::Complete(len)) => {
            let head = ResponseHead {
                status: response.code.unwrap_or(0),
                reason: response.reason.unwrap_or("").to_string(),
                headers: response
                    .headers
                    .iter()
                    .map(|h| {
                        (
                            h.name.to_ascii_lowercase(),
                            String::from_utf8_lossy(h.value).trim().to_string(),
                        )
                    })
                    .collect(),
            };
            Parsed::Complete { head, len }
        }
        Ok(httparse::Status::Partial) if window.len() >= MAX_HEAD => Parsed::TooLong,
        Ok(httparse::Status::Partial) => Parsed::Incomplete,
        Err(e) => Parsed::Malformed(format!("not an HTTP/1.1 response head: {e}")),
    }
}

/// A response head: the status and the header fields. It only decides
/// between "upgraded" and "refused, and why": the caller accepts exactly
/// `101` (and, for the relay, the right `Sec-WebSocket-Accept`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseHead {
    status: u16,
    reason: String,
    /// Names in lower case, values trimmed, in order.
    headers: Vec<(String, String)>,
}

impl ResponseHead {
    /// The status code.
    pub fn status(&self) -> u16 {
        self.status
    }

    /// `HTTP/1.1 STATUS REASON`, for messages.
    pub fn status_line(&self) -> String {
        format!("HTTP/1.1 {} {}", self.status, self.reason)
            .trim_end()
            .to_string()
    }

    /// The value of header `name` (case-insensitive): the first one.
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    /// How many body bytes to read for a refusal: its `Content-Length` (the
    /// CP's HTTP server may keep the connection open, so it says where the
    /// body ends; a gateway closes after a refusal), at most [`MAX_REFUSAL`].
    pub fn refusal_length(&self) -> u64 {
        self.header("content-length")
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(MAX_REFUSAL as u64, |n| n.min(MAX_REFUSAL as u64))
    }

    /// Why a refusal with this head and `body` refused: the body is one line
    /// (from a gateway), or the API's JSON error whose message says it (from
    /// the CP); the status line when the body is empty.
    pub fn refusal_reason(&self, body: &[u8]) -> String {
        let text = String::from_utf8_lossy(body).trim().to_string();
        let reason = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
            .unwrap_or(text);
        if reason.is_empty() {
            self.status_line()
        } else {
            reason
        }
    }
}

/// A stream whose first bytes were read with the response head: reads
/// return them first, then read the stream. Writes go straight through.
#[derive(Debug)]
pub struct Upgraded<S> {
    early: Vec<u8>,
    /// How much of `early` has been read.
    taken: usize,
    inner: S,
}

impl<S> Upgraded<S> {
    /// `inner`, of which `early` was already read.
    pub fn new(inner: S, early: Vec<u8>) -> Upgraded<S> {
        Upgraded {
            early,
            taken: 0,
            inner,
        }
    }

    /// The stream underneath (its TLS session, say).
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The stream underneath and what of `early` has not been read yet
    /// (the peer's first bytes, to be delivered before the stream's).
    pub fn into_parts(mut self) -> (S, Vec<u8>) {
        let early = self.early.split_off(self.taken);
        (self.inner, early)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Upgraded<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.taken < this.early.len() {
            let rest = &this.early[this.taken..];
            let n = rest.len().min(buf.remaining());
            buf.put_slice(&rest[..n]);
            this.taken += n;
            if this.taken == this.early.len() {
                this.early = Vec::new();
                this.taken = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Upgraded<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// What answered an upgrade request.
#[derive(Debug)]
pub enum Answer<S> {
    /// `101`: the tunnel, and the head (a caller may check its headers).
    Upgraded(ResponseHead, Upgraded<S>),
    /// Anything else: refused, with the status and the reason given.
    Refused(ConnectError),
}

/// Writes `request` on `stream` and reads the answer's head; on a `101` the
/// bytes read past the head stay with the tunnel, on anything else the
/// refusal's body (bounded, 2 s) gives the reason.
pub async fn upgrade<S>(mut stream: S, endpoint: &str, request: &str) -> Result<Answer<S>, ConnectError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let protocol = |reason: String| ConnectError::Protocol {
        endpoint: endpoint.to_string(),
        reason,
    };
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| protocol(e.to_string()))?;
    stream.flush().await.map_err(|e| protocol(e.to_string()))?;
    let mut read = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    let (head, len) = loop {
        match parse_head(&read) {
            Parsed::Complete { head, len } => break (head, len),
            Parsed::TooLong => return Err(protocol("response head too long".into())),
            Parsed::Malformed(reason) => return Err(protocol(reason)),
            Parsed::Incomplete => {}
        }
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| protocol(e.to_string()))?;
        if n == 0 {
            return Err(protocol("connection closed before an answer".into()));
        }
        read.extend_from_slice(&chunk[..n]);
    };
    let early = read.split_off(len);
    if head.status() == 101 {
        return Ok(Answer::Upgraded(head, Upgraded::new(stream, early)));
    }
    // A refusal: its body is one line saying why (or, from the CP's API, a
    // JSON error whose message says it).
    let want = head.refusal_length() as usize;
    let mut body = early;
    body.truncate(want);
    if body.len() < want {
        let rest = want - body.len();
        let _ = tokio::time::timeout(
            Duration::from_secs(2),
            (&mut stream).take(rest as u64).read_to_end(&mut body),
        )
        .await;
    }
    Ok(Answer::Refused(ConnectError::Refused {
        status: head.status(),
        reason: head.refusal_reason(&body),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn complete(bytes: &[u8]) -> (ResponseHead, usize) {
        match parse_head(bytes) {
            Parsed::Complete { head, len } => (head, len),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_gateway_refusal_reads_as_its_status_and_one_line() {
        let (head, len) = complete(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 31\r\n\r\ncredential");
        assert_eq!(len, 46);
        assert_eq!(head.status(), 403);
        assert_eq!(head.status_line(), "HTTP/1.1 403 Forbidden");
        assert_eq!(head.refusal_length(), 31);
        assert_eq!(
            head.refusal_reason(b"credential is for gateway gw2\n"),
            "credential is for gateway gw2"
        );
        assert_eq!(head.refusal_reason(b""), "HTTP/1.1 403 Forbidden");
    }

    #[test]
    fn a_json_error_reads_as_its_message() {
        let (head, _) = complete(b"HTTP/1.1 401 Unauthorized\r\n\r\n");
        assert_eq!(
            head.refusal_length(),
            MAX_REFUSAL as u64,
            "no length: read to the bound"
        );
        assert_eq!(
            head.refusal_reason(br#"{"error":{"code":"x","message":"ticket replayed"}}"#),
            "ticket replayed"
        );
    }

    #[test]
    fn headers_are_found_case_insensitively_and_trimmed() {
        let (head, _) = complete(
            b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nSEC-WEBSOCKET-ACCEPT:  abc= \r\n\r\n",
        );
        assert_eq!(head.status(), 101);
        assert_eq!(head.header("Sec-WebSocket-Accept"), Some("abc="));
        assert_eq!(head.header("content-length"), None);
    }

    #[test]
    fn garbage_is_malformed_and_lengths_are_bounded() {
        for junk in [
            &b"HTTP/1.1\r\n\r\n"[..],
            b"HTTP/1.1 99999 x\r\n\r\n",
            b"\xff\xfe x\r\n\r\n",
        ] {
            assert!(matches!(parse_head(junk), Parsed::Malformed(_)), "{junk:?}");
        }
        // Blank lines before the status line are skipped, as RFC 9112
        // allows; the head limit bounds them.
        assert_eq!(parse_head(b"\r\n\r\n"), Parsed::Incomplete);
        assert_eq!(parse_head(&b"\r\n".repeat(MAX_HEAD / 2)), Parsed::TooLong);
        let (huge, _) = complete(b"HTTP/1.1 400 x\r\nContent-Length: 99999999999\r\n\r\n");
        assert_eq!(huge.refusal_length(), MAX_REFUSAL as u64);
    }

    #[test]
    fn reading_stops_at_the_blank_line_or_the_limit() {
        assert_eq!(parse_head(b""), Parsed::Incomplete);
        assert_eq!(parse_head(b"HTTP/1.1 101 x\r\n"), Parsed::Incomplete);
        assert!(matches!(
            parse_head(b"HTTP/1.1 101 x\r\n\r\n"),
            Parsed::Complete { len: 18, .. }
        ));
        let mut long = b"HTTP/1.1 101 x\r\nX: ".to_vec();
        long.resize(MAX_HEAD, b'a');
        assert_eq!(parse_head(&long), Parsed::TooLong);
        long.truncate(MAX_HEAD - 1);
        assert_eq!(parse_head(&long), Parsed::Incomplete);
    }

    #[tokio::test]
    async fn bytes_after_the_101_are_the_tunnels_first_bytes() {
        let (client, mut server) = tokio::io::duplex(4096);
        let serve = tokio::spawn(async move {
            let mut req = [0u8; 64];
            let n = server.read(&mut req).await.unwrap();
            assert_eq!(&req[..n], b"GET / HTTP/1.1\r\n\r\n");
            // The head and the guest's banner in one write, as a busy
            // gateway may send them.
            server
                .write_all(b"HTTP/1.1 101 Switching Protocols\r\n\r\nSSH-2.0-banner\r\n")
                .await
                .unwrap();
            server.write_all(b"later").await.unwrap();
            server
        });
        let Answer::Upgraded(head, mut tunnel) =
            upgrade(client, "gw", "GET / HTTP/1.1\r\n\r\n").await.unwrap()
        else {
            panic!("refused")
        };
        assert_eq!(head.status(), 101);
        let _server = serve.await.unwrap();
        let mut got = vec![0u8; 21];
        tunnel.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"SSH-2.0-banner\r\nlater");
    }

    #[tokio::test]
    async fn a_refusal_body_is_read_from_what_came_with_the_head_and_after() {
        let (client, mut server) = tokio::io::duplex(4096);
        tokio::spawn(async move {
            let mut req = [0u8; 64];
            let _ = server.read(&mut req).await.unwrap();
            server
                .write_all(b"HTTP/1.1 409 Conflict\r\nContent-Length: 27\r\n\r\ncredential was")
                .await
                .unwrap();
            server.write_all(b" already used").await.unwrap();
            // Held open: the length says where the body ends.
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        let Answer::Refused(e) = upgrade(client, "gw", "GET / HTTP/1.1\r\n\r\n").await.unwrap() else {
            panic!("upgraded")
        };
        assert_eq!(e.to_string(), "refused (409): credential was already used");
    }
}
