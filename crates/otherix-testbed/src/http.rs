//! A plain-HTTP GET for the tests that read `/metrics`, `/healthz` and
//! `/readyz`: one request, `Connection: close`, the status and the body.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

/// `GET path` from `addr`; `None` if it did not answer with HTTP.
pub fn get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.get(9..12)?.parse().ok()?;
    Some((
        status,
        out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string(),
    ))
}

/// [`get`] of a URL `http://IP:PORT/PATH`.
pub fn get_url(url: &str) -> Option<(u16, String)> {
    let rest = url.strip_prefix("http://")?;
    let (addr, path) = rest.split_once('/')?;
    get(addr.parse().ok()?, &format!("/{path}"))
}
