//! `otherix guest http|echo`: built-in guest workloads, so a guest needs nothing
//! installed to be reachable (`otherix vm create web01 --exec 'otherix guest http'`).
//!
//! Both listen on 0.0.0.0 and serve every connection in its own task until killed.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::cli::GuestCommand;

/// Largest request head (request line + headers) the HTTP server reads.
const MAX_HEAD: usize = 16 * 1024;
/// How long a client may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(10);

pub async fn run(cmd: GuestCommand) -> anyhow::Result<()> {
    match cmd {
        GuestCommand::Http { port, name } => http(port, name.unwrap_or_else(default_name)).await,
        GuestCommand::Echo { port, banner } => echo(port, banner).await,
    }
}

async fn listen(port: u16) -> anyhow::Result<TcpListener> {
    let addr = SocketAddr::from((Ipv4Addr::UNSPECIFIED, port));
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))
}

/// Without `--name` or `OTHERIX_VM_NAME`: the host name.
fn default_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "otherix-guest".into())
}

// --- http ---

async fn http(port: u16, name: String) -> anyhow::Result<()> {
    let listener = listen(port).await?;
    println!("serving {name} over HTTP on {}", listener.local_addr()?);
    let body: std::sync::Arc<str> = format!("{name}\n").into();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let body = body.clone();
        tokio::spawn(async move {
            match serve_http(stream, &body).await {
                // A connect-and-close (a TCP health probe) is not an error.
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
                Err(e) => eprintln!("{peer}: {e}"),
                Ok(()) => {}
            }
        });
    }
}

/// Reads one request head and answers it; the connection then closes.
async fn serve_http(mut stream: TcpStream, body: &str) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(1024);
    let head = tokio::time::timeout(HEAD_TIMEOUT, async {
        let mut chunk = [0u8; 2048];
        loop {
            if let Some(end) = head_end(&buf) {
                return Ok(Some(end));
            }
            if buf.len() >= MAX_HEAD {
                return Ok(None);
            }
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "closed before the end of the request head",
                ));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request head timed out"))??;

    let response = match head {
        Some(end) => {
            let is_head = buf[..end].starts_with(b"HEAD ");
            response("200 OK", body, is_head)
        }
        None => response(
            "431 Request Header Fields Too Large",
            "request head too large\n",
            false,
        ),
    };
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

/// The length of the request head in `buf` (through its blank line), or `None` if
/// the blank line has not arrived yet. Bare `\n` line ends are accepted, as most
/// servers do.
fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn response(status: &str, body: &str, head_only: bool) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        body.len(),
        if head_only { "" } else { body }
    )
}

// --- echo ---

async fn echo(port: u16, banner: Option<String>) -> anyhow::Result<()> {
    let listener = listen(port).await?;
    println!("echoing on {}", listener.local_addr()?);
    loop {
        let (mut stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!("accept: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let banner = banner.clone();
        tokio::spawn(async move {
            // Echo until the client half-closes, then half-close back: the client
            // receives everything it sent (after the banner, if any), then EOF.
            let (mut r, mut w) = stream.split();
            let done = async {
                if let Some(banner) = &banner {
                    w.write_all(format!("{banner}\n").as_bytes()).await?;
                }
                tokio::io::copy(&mut r, &mut w).await?;
                w.shutdown().await
            };
            if let Err(e) = done.await {
                eprintln!("{peer}: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_ends_at_the_first_blank_line() {
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nbody"), Some(27));
        assert_eq!(head_end(b"GET / HTTP/1.0\n\n"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n"), None);
        assert_eq!(head_end(b""), None);
    }

    #[test]
    fn response_carries_the_length_and_closes() {
        let r = response("200 OK", "web01\n", false);
        assert!(r.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(r.contains("Content-Length: 6\r\n"));
        assert!(r.contains("Connection: close\r\n"));
        assert!(r.ends_with("\r\n\r\nweb01\n"));
        assert!(response("200 OK", "web01\n", true).ends_with("\r\n\r\n"));
    }

    #[tokio::test]
    async fn http_answers_curl_like_requests_with_the_name() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            serve_http(s, "web01\n").await.unwrap();
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nUser-Agent: curl\r\nAccept: */*\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        assert!(out.ends_with("\r\n\r\nweb01\n"), "{out}");
    }

    #[tokio::test]
    async fn an_oversized_head_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let _ = serve_http(s, "web01\n").await;
        });
        let mut c = TcpStream::connect(addr).await.unwrap();
        let mut req = b"GET / HTTP/1.1\r\n".to_vec();
        // Exactly the limit, so the server has read everything when it answers (unread
        // bytes would turn its close into a reset that could eat the answer).
        req.extend(std::iter::repeat_n(b'a', MAX_HEAD - req.len()));
        c.write_all(&req).await.unwrap();
        let mut out = String::new();
        c.read_to_string(&mut out).await.unwrap();
        assert!(out.starts_with("HTTP/1.1 431"), "{out}");
    }
}
