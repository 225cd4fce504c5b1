//! Latency (issue #17): what a user feels per round trip and per new
//! connection, on the same testbed and the same guest echo servers as the
//! setup times, path by path:
//!
//! - **round trip**: one connection kept open, [`MESSAGE`]-byte messages
//!   sent and read back one at a time (a keystroke, a small query); p50 and
//!   p99 of each round trip, timed in [`ROUNDS`] rounds with every path in
//!   turn, each after a warm-up;
//! - **new connections per second**: [`CONCURRENCY`] loops for
//!   [`CONNECT_TIME`], each connecting, sending one byte, reading it back
//!   and closing — what a client pool that reconnects sees.
//!
//! The paths: direct (this binary re-executed in `gw1`'s namespace, or
//! `node1`'s for the bridge guest); `otherix forward` to the gateway VM (a
//! local port in the host namespace, connections kept ready, its default);
//! the client library to the gateway (`tunnel::open_brokered`; per new
//! connection a broker call, TCP, TLS and the upgrade); nginx stream+TLS
//! (rustls to nginx on `gw1`); nginx with `socat` in front as the TLS
//! client on a local port (the peer of `otherix forward`: one process and
//! a loopback hop more than nginx alone); the relay through the client library; and
//! websocat in front of the bridge guest. `pgbench` follows in
//! [`crate::pgbench`].

use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::TlsConnector;

use crate::bed::{Bed, ECHO_PORT, RELAY_VM, VM};
use crate::broker::broker_for;
use crate::options::{Options, PROBE_CONNECTIONS, PROBE_PINGPONG};
use crate::pgbench::Pgbench;
use crate::setup::Latencies;

/// Bytes per message of the ping-pong.
pub const MESSAGE: usize = 64;
/// Round trips timed per path (after [`WARM_UP`]).
pub const ROUND_TRIPS: usize = 5_000;
pub const WARM_UP: usize = 200;
/// How long the new-connection loops run per path ...
pub const CONNECT_TIME: Duration = Duration::from_secs(3);
/// ... and how many run at once.
pub const CONCURRENCY: usize = 4;
const TIMEOUT: Duration = Duration::from_secs(5);

/// The rows of the latency table, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Direct,
    Forward,
    Gateway,
    Nginx,
    NginxSocat,
    DirectBridge,
    Relay,
    Websocat,
}

impl Path {
    pub const ALL: [Path; 8] = [
        Path::Direct,
        Path::Forward,
        Path::Gateway,
        Path::Nginx,
        Path::NginxSocat,
        Path::DirectBridge,
        Path::Relay,
        Path::Websocat,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Path::Direct => "direct",
            Path::Forward => "otherix forward (gateway)",
            Path::Gateway => "otherix gateway (library)",
            Path::Nginx => "nginx stream+TLS",
            Path::NginxSocat => "nginx stream+TLS via socat",
            Path::DirectBridge => "direct (bridge)",
            Path::Relay => "otherix relay (library)",
            Path::Websocat => "websocat (wss)",
        }
    }

    /// The direct path the same guest is compared with.
    pub fn baseline(self) -> Path {
        match self {
            Path::Direct | Path::Forward | Path::Gateway | Path::Nginx | Path::NginxSocat => Path::Direct,
            Path::DirectBridge | Path::Relay | Path::Websocat => Path::DirectBridge,
        }
    }
}

/// One path's figures.
#[derive(Debug, Clone)]
pub struct PathLatency {
    pub path: Path,
    pub round_trip: Latencies,
    /// New connections per second, each with one byte echoed.
    pub connections: f64,
}

#[derive(Debug)]
pub struct Latency {
    pub paths: Vec<PathLatency>,
    /// `pgbench -S` through each way in; why not, when it could not run.
    pub pgbench: Result<Pgbench, String>,
}

impl Latency {
    pub fn path(&self, path: Path) -> Option<&PathLatency> {
        self.paths.iter().find(|p| p.path == path)
    }
}

pub fn measure(
    bed: &Bed,
    rt: &tokio::runtime::Runtime,
    opts: &Options,
    bin: &std::path::Path,
) -> anyhow::Result<Latency> {
    // Round trips in rounds, every path in turn in each: what the machine
    // does meanwhile (frequency, idle states, other load) falls on every
    // path alike, not on whichever ran when it happened.
    crate::progress(&format!(
        "  round trips: {ROUNDS} rounds of {} on each path",
        ROUND_TRIPS / ROUNDS
    ));
    let mut open: Vec<(Path, Box<dyn Stream>)> = Vec::new();
    for path in Path::ALL.into_iter().filter(|p| !is_direct(*p)) {
        open.push((path, rt.block_on(connect(bed, path))?));
    }
    let mut samples: Vec<(Path, Vec<Duration>)> = Path::ALL.iter().map(|p| (*p, Vec::new())).collect();
    for _ in 0..ROUNDS {
        for (path, out) in samples.iter_mut() {
            let got = match *path {
                Path::Direct => direct_round_trips(bed, &bed.gw, bed.guest_echo())?,
                Path::DirectBridge => direct_round_trips(bed, &bed.node, bed.relay_guest_echo())?,
                other => {
                    let (_, conn) = open
                        .iter_mut()
                        .find(|(p, _)| *p == other)
                        .context("the path's connection")?;
                    rt.block_on(pingpong(conn, ROUND_TRIPS / ROUNDS))?
                }
            };
            out.extend(got);
        }
    }
    drop(open);
    let mut paths = Vec::new();
    for (path, rtts) in samples {
        crate::progress(&format!("  new connections: {}", path.name()));
        let connections = match path {
            Path::Direct => direct_connections(bed, &bed.gw, bed.guest_echo())?,
            Path::DirectBridge => direct_connections(bed, &bed.node, bed.relay_guest_echo())?,
            _ => rt.block_on(through(bed, path))?,
        };
        paths.push(PathLatency {
            path,
            round_trip: Latencies::new(rtts),
            connections,
        });
    }
    crate::progress("  pgbench -S");
    let pgbench = crate::pgbench::run(bed, opts, bin).map_err(|e| format!("{e:#}"));
    Ok(Latency { paths, pgbench })
}

/// Rounds the round trips are timed in, all paths in turn in each.
pub const ROUNDS: usize = 5;

fn is_direct(path: Path) -> bool {
    path.baseline() == path
}

/// What each way in is, once connected.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

/// One connection to the path's echo server, kept for the round trips.
async fn connect(bed: &Bed, path: Path) -> anyhow::Result<Box<dyn Stream>> {
    Ok(match path {
        Path::Forward => Box::new(connect_local(bed.others()?.echo_forward.1).await?),
        Path::Websocat => Box::new(connect_local(bed.others()?.tunnels.websocat.echo).await?),
        Path::Nginx => Box::new(connect_nginx(bed).await?),
        Path::NginxSocat => Box::new(connect_local(bed.others()?.echo_socat.1).await?),
        Path::Gateway => Box::new(open(bed, VM).await?),
        Path::Relay => Box::new(open(bed, RELAY_VM).await?),
        Path::Direct | Path::DirectBridge => bail!("a direct path is timed from its namespace"),
    })
}

/// One round of round trips from inside `ns` (this binary re-executed there).
fn direct_round_trips(
    bed: &Bed,
    ns: &otherix_testbed::Ns,
    addr: SocketAddr,
) -> anyhow::Result<Vec<Duration>> {
    let exe = std::env::current_exe()?;
    let exe = exe.to_string_lossy();
    let count = (ROUND_TRIPS / ROUNDS).to_string();
    let out = bed
        .world()
        .exec_ok(ns, &[exe.as_ref(), PROBE_PINGPONG, &addr.to_string(), &count])?;
    out.lines()
        .map(|l| l.trim().parse::<u64>().map(Duration::from_nanos))
        .collect::<Result<Vec<_>, _>>()
        .context("odd output from the ping-pong probe")
}

/// New connections per second from inside `ns`.
fn direct_connections(bed: &Bed, ns: &otherix_testbed::Ns, addr: SocketAddr) -> anyhow::Result<f64> {
    let exe = std::env::current_exe()?;
    let exe = exe.to_string_lossy();
    let out = bed.world().exec_ok(
        ns,
        &[
            exe.as_ref(),
            PROBE_CONNECTIONS,
            &addr.to_string(),
            &CONNECT_TIME.as_millis().to_string(),
            &CONCURRENCY.to_string(),
        ],
    )?;
    out.trim().parse().context("odd output from the connection probe")
}

/// The probe's side of the round trips: `count` (after a warm-up) over one
/// connection to `addr`, one nanosecond figure a line.
pub fn probe_pingpong(addr: SocketAddr, count: usize) -> anyhow::Result<()> {
    let mut tcp = TcpStream::connect_timeout(&addr, TIMEOUT)?;
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(TIMEOUT))?;
    let msg = message();
    let mut back = [0u8; MESSAGE];
    let mut samples = Vec::with_capacity(count);
    for i in 0..WARM_UP + count {
        let started = Instant::now();
        tcp.write_all(&msg)?;
        tcp.read_exact(&mut back)?;
        if i >= WARM_UP {
            samples.push(started.elapsed());
        }
        if back != msg {
            bail!("the echo server sent other bytes back");
        }
    }
    let mut out = std::io::stdout().lock();
    for s in samples {
        writeln!(out, "{}", s.as_nanos())?;
    }
    Ok(())
}

/// The probe's side of the new connections: `concurrency` threads for
/// `millis`, each connecting, echoing one byte, closing; prints the rate.
pub fn probe_connections(addr: SocketAddr, millis: u64, concurrency: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_millis(millis);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let threads: Vec<_> = (0..concurrency)
        .map(|_| {
            let done = done.clone();
            std::thread::spawn(move || -> anyhow::Result<()> {
                while Instant::now() < deadline {
                    let mut tcp = TcpStream::connect_timeout(&addr, TIMEOUT)?;
                    tcp.set_nodelay(true)?;
                    tcp.set_read_timeout(Some(TIMEOUT))?;
                    tcp.write_all(&[0x5a])?;
                    let mut back = [0u8; 1];
                    tcp.read_exact(&mut back)?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join()
            .map_err(|_| anyhow::anyhow!("a probe thread panicked"))??;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64();
    println!("{rate:.1}");
    Ok(())
}

/// New connections per second through a way in other than a direct dial.
async fn through(bed: &Bed, path: Path) -> anyhow::Result<f64> {
    connections(|| async move {
        match path {
            Path::Forward => echo_one(&mut connect_local(bed.others()?.echo_forward.1).await?).await,
            Path::Websocat => echo_one(&mut connect_local(bed.others()?.tunnels.websocat.echo).await?).await,
            Path::Nginx => echo_one(&mut connect_nginx(bed).await?).await,
            Path::NginxSocat => echo_one(&mut connect_local(bed.others()?.echo_socat.1).await?).await,
            Path::Gateway => echo_one(&mut open(bed, VM).await?).await,
            Path::Relay => echo_one(&mut open(bed, RELAY_VM).await?).await,
            Path::Direct | Path::DirectBridge => bail!("a direct path is timed from its namespace"),
        }
    })
    .await
}

async fn connect_local(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpStream> {
    let tcp = tokio::time::timeout(TIMEOUT, tokio::net::TcpStream::connect(addr)).await??;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

async fn connect_nginx(bed: &Bed) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let ca = otherix_tls::cert_from_pem(&bed.ca_pem).map_err(anyhow::Error::msg)?;
    let config = otherix_tls::pinned_client_config(ca).map_err(anyhow::Error::msg)?;
    let connector = TlsConnector::from(Arc::new(config));
    let addr = bed.others()?.nginx.echo_addr();
    let tcp = connect_local(addr).await?;
    Ok(connector
        .connect(ServerName::IpAddress(addr.ip().into()), tcp)
        .await?)
}

/// A broker call and a tunnel to `vm`'s echo port, as the library opens it.
async fn open(bed: &Bed, vm: &str) -> anyhow::Result<otherix_client::tunnel::AnyTunnel> {
    let grant = broker_for(&bed.client, vm, ECHO_PORT).await?;
    Ok(otherix_client::tunnel::open_brokered(&grant, &bed.cluster.url, &bed.ca_pem).await?)
}

fn message() -> [u8; MESSAGE] {
    std::array::from_fn(|i| i as u8)
}

/// `count` round trips of [`MESSAGE`] bytes over `s`, after a warm-up.
async fn pingpong<S: AsyncRead + AsyncWrite + Unpin + ?Sized>(
    s: &mut S,
    count: usize,
) -> anyhow::Result<Vec<Duration>> {
    let msg = message();
    let mut back = [0u8; MESSAGE];
    let mut samples = Vec::with_capacity(count);
    for i in 0..WARM_UP + count {
        let started = Instant::now();
        s.write_all(&msg).await?;
        s.flush().await?;
        tokio::time::timeout(TIMEOUT, s.read_exact(&mut back)).await??;
        if i >= WARM_UP {
            samples.push(started.elapsed());
        }
        if back != msg {
            bail!("the echo server sent other bytes back");
        }
    }
    Ok(samples)
}

/// One byte there and back, then the connection closes.
async fn echo_one<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> anyhow::Result<()> {
    s.write_all(&[0x5a]).await?;
    s.flush().await?;
    let mut back = [0u8; 1];
    tokio::time::timeout(TIMEOUT, s.read_exact(&mut back)).await??;
    let _ = s.shutdown().await;
    Ok(())
}

/// New connections per second: [`CONCURRENCY`] loops of `once` for
/// [`CONNECT_TIME`].
async fn connections<F, Fut>(once: F) -> anyhow::Result<f64>
where
    F: Fn() -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    for _ in 0..5 {
        once().await?;
    }
    let started = Instant::now();
    let deadline = started + CONNECT_TIME;
    let once = &once;
    let loops = (0..CONCURRENCY).map(|_| async move {
        let mut n = 0u64;
        while Instant::now() < deadline {
            tokio::time::timeout(TIMEOUT * 2, once()).await??;
            n += 1;
        }
        anyhow::Ok(n)
    });
    let counts = join_all(loops.collect()).await?;
    Ok(counts.iter().sum::<u64>() as f64 / started.elapsed().as_secs_f64())
}

/// Every future of `futs` to completion, polled together; the first error ends it.
async fn join_all<F: Future<Output = anyhow::Result<u64>>>(futs: Vec<F>) -> anyhow::Result<Vec<u64>> {
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<u64>> = vec![None; futs.len()];
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futs.iter_mut().zip(out.iter_mut()) {
            if o.is_some() {
                continue;
            }
            match f.as_mut().poll(cx) {
                Poll::Ready(Ok(n)) => *o = Some(n),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => pending = true,
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    })
    .await?;
    Ok(out.into_iter().flatten().collect())
}
