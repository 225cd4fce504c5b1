//! Strangers for the ingress isolation tests: extra source addresses on the
//! host's leg of a testbed world (the test owns them; they go with the
//! world's link, and on drop), half-open connections held from one of them,
//! and the counters a daemon's `/metrics` shows.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;

use otherix_testbed::World;

/// An address `{world subnet}.{octet}/32` on the host's leg, removed on drop.
pub struct HostAddr {
    link: String,
    pub ip: Ipv4Addr,
}

impl HostAddr {
    /// Adds `{subnet}.{octet}` (pick one far above the namespaces', e.g. 200).
    pub fn add(world: &World, octet: u8) -> HostAddr {
        let [a, b, c, _] = world.subnet().octets();
        let ip = Ipv4Addr::new(a, b, c, octet);
        let link = world.host_link();
        let out = Command::new("ip")
            .args(["addr", "add", &format!("{ip}/32"), "dev", &link])
            .output()
            .expect("ip runs");
        assert!(
            out.status.success(),
            "ip addr add {ip}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        HostAddr { link, ip }
    }
}

impl Drop for HostAddr {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["addr", "del", &format!("{}/32", self.ip), "dev", &self.link])
            .output();
    }
}

/// `n` TCP connections to `to` from `source`, each sending the first bytes
/// of a TLS ClientHello and nothing more: half-open handshakes, held until
/// dropped. Connections the server refuses at once are kept too (closed).
pub fn half_open(source: Ipv4Addr, to: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|_| {
            let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
            s.bind(&SocketAddr::from((source, 0)).into()).unwrap();
            s.connect_timeout(&to.into(), Duration::from_secs(10))
                .unwrap_or_else(|e| panic!("connect {to} from {source}: {e}"));
            let mut s: TcpStream = s.into();
            // A refused one may be reset already: the write may fail.
            let _ = s.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]);
            s
        })
        .collect()
}

/// Whether the server closed `s` without sending a byte (waits up to 10 s).
pub fn closed_unanswered(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

/// The `/metrics` text of a daemon's `--metrics-listen` address, if it answers.
pub fn scrape(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.starts_with("HTTP/1.1 200").then_some(out)
}

/// The value of `series` (the exact text before the value) in `metrics`, 0 if absent.
pub fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// `otherix_ingress_connections_refused_total` of `server` for `reason`.
pub fn ingress_refused(metrics: &str, server: &str, reason: &str) -> f64 {
    sample(
        metrics,
        &format!("otherix_ingress_connections_refused_total{{server=\"{server}\",reason=\"{reason}\"}}"),
    )
}
