//! Connection setup time: one connection at a time, from the start of the
//! dial until one byte has gone to the guest's echo server and come back —
//! the same end point on every path, so the figures compare:
//!
//! - direct: TCP connect from the gateway node's namespace to the guest
//!   (this binary re-executed there, plain blocking sockets);
//! - otherix: `connect::open` (TCP, TLS, connect request, the gateway's
//!   checks and its dial of the guest, `101`), without and with the broker
//!   call before it;
//! - nginx: TCP connect and TLS handshake with the same client TLS stack;
//!   nginx dials the guest after the handshake, so the echoed byte waits
//!   for that dial too;
//! - direct (bridge): TCP connect from the hypervisor's namespace to the
//!   bridge guest;
//! - relay: `connect::open_brokered` with a relay ticket (TCP, TLS and the
//!   WebSocket upgrade to the CP, which first dials the agent over mutual
//!   TLS and waits for its `OK`), without and with the broker call;
//! - `otherix forward`: TCP connect to its local port (the host namespace)
//!   until the byte is back, with connections kept ready (its default) and
//!   with `--ready 0` (the broker call and the gateway's TLS handshake on
//!   each connection);
//! - websocat, websockify: TCP connect to websocat's local listener, which
//!   opens TLS and WebSocket to the server in the CP's namespace, which
//!   dials the node leg (see `tunnels`) — the byte echoed needs all of it.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::TlsConnector;

use otherix_testbed::Ns;

use crate::bed::{Bed, ECHO_PORT, RELAY_VM, VM};
use crate::broker::broker_for;
use crate::options::{Options, PROBE_DIRECT};

/// Longest time spent sampling one path.
const PATH_BUDGET: Duration = Duration::from_secs(30);
const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// The byte echoed on every new connection.
const PING: u8 = 0x5a;

/// Setup times of one path, sorted.
#[derive(Debug, Clone, Default)]
pub struct Latencies(Vec<Duration>);

impl Latencies {
    pub fn new(mut samples: Vec<Duration>) -> Latencies {
        samples.sort();
        Latencies(samples)
    }

    /// Nearest-rank percentile, `q` in (0, 1].
    pub fn percentile(&self, q: f64) -> Duration {
        if self.0.is_empty() {
            return Duration::ZERO;
        }
        let rank = (q * self.0.len() as f64).ceil() as usize;
        self.0[rank.clamp(1, self.0.len()) - 1]
    }

    pub fn p50(&self) -> Duration {
        self.percentile(0.50)
    }

    pub fn p99(&self) -> Duration {
        self.percentile(0.99)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }
}

#[derive(Debug, Clone)]
pub struct Setup {
    pub direct: Latencies,
    pub otherix: Latencies,
    pub otherix_with_broker: Latencies,
    pub nginx: Latencies,
    pub direct_bridge: Latencies,
    pub relay: Latencies,
    pub relay_with_broker: Latencies,
    pub websocat: Latencies,
    pub websockify: Latencies,
    /// Through `otherix forward` to the gateway VM's echo port, as it runs
    /// by default (connections kept ready): connect to its local port, one
    /// byte echoed — all a new connection of an application costs.
    pub forward_ready: Latencies,
    /// The same with `--ready 0`: the broker call and the TLS handshake to
    /// the gateway on every connection.
    pub forward_cold: Latencies,
    /// Through `otherix forward` to the relay VM's echo port, connections
    /// kept ready (a ticket and TLS to the control plane)...
    pub relay_forward_ready: Latencies,
    /// ...and with `--ready 0`.
    pub relay_forward_cold: Latencies,
}

pub fn measure(bed: &Bed, rt: &tokio::runtime::Runtime, opts: &Options) -> anyhow::Result<Setup> {
    let n = opts.samples;
    Ok(Setup {
        direct: direct(bed, &bed.gw, bed.guest_echo(), n)?,
        nginx: rt.block_on(nginx(bed, n))?,
        otherix: rt.block_on(otherix(bed, VM, n, false))?,
        otherix_with_broker: rt.block_on(otherix(bed, VM, n, true))?,
        direct_bridge: direct(bed, &bed.node, bed.relay_guest_echo(), n)?,
        relay: rt.block_on(otherix(bed, RELAY_VM, n, false))?,
        relay_with_broker: rt.block_on(otherix(bed, RELAY_VM, n, true))?,
        websocat: rt.block_on(local(bed.others()?.tunnels.websocat.echo, n))?,
        websockify: rt.block_on(local(bed.others()?.tunnels.websockify.echo, n))?,
        forward_ready: rt.block_on(local(bed.others()?.echo_forward.1, n))?,
        forward_cold: rt.block_on(local(bed.others()?.echo_forward_cold.1, n))?,
        relay_forward_ready: rt.block_on(local(bed.others()?.relay_echo_forward.1, n))?,
        relay_forward_cold: rt.block_on(local(bed.others()?.relay_echo_forward_cold.1, n))?,
    })
}

/// Re-executes this binary inside `ns` to dial `addr`.
fn direct(bed: &Bed, ns: &Ns, addr: SocketAddr, n: usize) -> anyhow::Result<Latencies> {
    let exe = std::env::current_exe()?;
    let out = bed.world().exec_ok(
        ns,
        &[
            exe.to_string_lossy().as_ref(),
            PROBE_DIRECT,
            &addr.to_string(),
            &n.to_string(),
        ],
    )?;
    let samples = out
        .lines()
        .map(|l| l.trim().parse::<u64>().map(Duration::from_nanos))
        .collect::<Result<Vec<_>, _>>()
        .context("odd output from the direct probe")?;
    Ok(Latencies::new(samples))
}

/// The probe's side: `count` dials of `addr`, one nanosecond figure a line.
pub fn probe_direct(addr: SocketAddr, count: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + PATH_BUDGET;
    let mut out = std::io::stdout().lock();
    for _ in 0..count {
        if Instant::now() > deadline {
            break;
        }
        let started = Instant::now();
        let mut tcp = TcpStream::connect_timeout(&addr, DIAL_TIMEOUT)?;
        tcp.set_nodelay(true)?;
        tcp.set_read_timeout(Some(DIAL_TIMEOUT))?;
        tcp.write_all(&[PING])?;
        let mut back = [0u8; 1];
        tcp.read_exact(&mut back)?;
        let took = started.elapsed();
        if back[0] != PING {
            bail!("the echo server sent {back:?}");
        }
        writeln!(out, "{}", took.as_nanos())?;
    }
    Ok(())
}

async fn nginx(bed: &Bed, n: usize) -> anyhow::Result<Latencies> {
    let ca = otherix_tls::cert_from_pem(&bed.ca_pem).map_err(anyhow::Error::msg)?;
    let config = otherix_tls::pinned_client_config(ca).map_err(anyhow::Error::msg)?;
    let connector = TlsConnector::from(Arc::new(config));
    let addr = bed.others()?.nginx.echo_addr();
    let name = ServerName::IpAddress(addr.ip().into());
    let (connector, name) = (&connector, &name);
    sample(n, || async move {
        let started = Instant::now();
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let mut tls = connector.connect(name.clone(), tcp).await?;
        ping(&mut tls).await?;
        Ok(started.elapsed())
    })
    .await
}

/// Through the gateway or the relay, as the broker answers for `vm`.
async fn otherix(bed: &Bed, vm: &str, n: usize, with_broker: bool) -> anyhow::Result<Latencies> {
    sample(n, || otherix_once(bed, &bed.client, vm, with_broker)).await
}

/// One connection to `vm`'s echo server as the broker answers `client`,
/// timed from the broker call (`with_broker`) or from the dial on.
pub(crate) async fn otherix_once(
    bed: &Bed,
    client: &otherix_client::Client,
    vm: &str,
    with_broker: bool,
) -> anyhow::Result<Duration> {
    let mut started = Instant::now();
    let grant = broker_for(client, vm, ECHO_PORT).await?;
    if !with_broker {
        started = Instant::now();
    }
    let mut tunnel = otherix_client::tunnel::open_brokered(&grant, &bed.cluster.url, &bed.ca_pem).await?;
    ping(&mut tunnel).await?;
    Ok(started.elapsed())
}

/// Through a local listener (websocat's) that tunnels each connection.
async fn local(addr: SocketAddr, n: usize) -> anyhow::Result<Latencies> {
    sample(n, || async move {
        let started = Instant::now();
        let mut tcp = tokio::net::TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        ping(&mut tcp).await?;
        Ok(started.elapsed())
    })
    .await
}

/// Up to `n` sequential samples of `once`, within [`PATH_BUDGET`].
async fn sample<F, Fut>(n: usize, mut once: F) -> anyhow::Result<Latencies>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Duration>>,
{
    // Warm-up: lazily built state on both ends, ARP and neighbor caches.
    for _ in 0..5 {
        once().await?;
    }
    let deadline = Instant::now() + PATH_BUDGET;
    let mut samples = Vec::with_capacity(n);
    while samples.len() < n && Instant::now() < deadline {
        samples.push(tokio::time::timeout(DIAL_TIMEOUT * 3, once()).await??);
    }
    Ok(Latencies::new(samples))
}

/// One byte to the echo server and back.
async fn ping<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S) -> anyhow::Result<()> {
    s.write_all(&[PING]).await?;
    s.flush().await?;
    let mut back = [0u8; 1];
    tokio::time::timeout(DIAL_TIMEOUT, s.read_exact(&mut back)).await??;
    if back[0] != PING {
        bail!("the echo server sent {back:?}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let l = Latencies::new((1..=100).rev().map(Duration::from_millis).collect());
        assert_eq!(l.p50(), Duration::from_millis(50));
        assert_eq!(l.p99(), Duration::from_millis(99));
        assert_eq!(l.percentile(1.0), Duration::from_millis(100));
        assert_eq!(Latencies::new(vec![]).p50(), Duration::ZERO);
        let one = Latencies::new(vec![Duration::from_millis(7)]);
        assert_eq!(
            (one.p50(), one.p99()),
            (Duration::from_millis(7), Duration::from_millis(7))
        );
    }
}
