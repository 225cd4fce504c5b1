//! Slow clients for the soak: thousands of connections to one server port
//! that do as little as they can, as slowly as they can — plain TCP that
//! never starts TLS, a TLS handshake begun and never finished, a request
//! head one byte per interval, or a request body one byte per interval —
//! each coming back at once when the server
//! cut it after holding it (to keep its slot, as a slowloris does), and one
//! interval later when it was turned away. They come from several source
//! addresses added to the host's leg of the testbed ([`Sources`]), and run
//! on a runtime of their own (one thread, at nice 19), so that the bench's
//! measuring tasks never wait behind them and the servers get the CPU first.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::TlsConnector;

use crate::options::SlowKind;

/// A connection closed by the server sooner than this after it connected
/// was turned away (a cap, a refusal), not held.
const HELD_AT_LEAST: Duration = Duration::from_secs(1);
/// Longest wait for the TCP connect and for the TLS handshake.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// The body a `body` client announces and never sends.
const BODY_LENGTH: usize = 2_000_000;
/// What a `hello` client sends: a TLS handshake record announcing 512
/// bytes, the header of a ClientHello of 508 and its version — and nothing
/// more, so the server's TLS has begun and waits for the rest.
const HELLO_START: &[u8] = &[0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03];

/// A server port the slow clients go to.
#[derive(Debug, Clone)]
pub struct Target {
    /// For the report: "control plane", "gateway".
    pub name: &'static str,
    pub addr: SocketAddr,
    /// The name its certificate is checked against.
    pub server_name: ServerName<'static>,
    /// The request line of `head` and `body` clients (`POST /v1/agent/heartbeat`).
    pub request_line: &'static str,
    /// Whether the server reads request bodies (the gateway does not:
    /// `body` clients send it a slow head instead).
    pub reads_bodies: bool,
}

/// What the clients of one kind at one target saw; counters only grow,
/// `open` is the number open now.
#[derive(Debug, Default)]
pub struct Counters {
    attempts: AtomicU64,
    connect_failed: AtomicU64,
    /// TCP connected but TLS did not complete (closed or timed out).
    tls_failed: AtomicU64,
    tls_done: AtomicU64,
    open: AtomicI64,
    peak: AtomicI64,
    /// Closed by the server within [`HELD_AT_LEAST`].
    turned_away: AtomicU64,
    /// Closed by the server later, and for how long they were held in all.
    cut: AtomicU64,
    held_ms: AtomicU64,
    /// First line of what the server answered before closing, by status.
    answers: Mutex<BTreeMap<String, u64>>,
}

/// A copy of [`Counters`] at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    pub attempts: u64,
    pub connect_failed: u64,
    pub tls_failed: u64,
    pub tls_done: u64,
    pub open: i64,
    pub peak: i64,
    pub turned_away: u64,
    pub cut: u64,
    pub held_ms: u64,
    pub answers: BTreeMap<String, u64>,
}

impl Counters {
    fn tally(&self) -> Tally {
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Tally {
            attempts: n(&self.attempts),
            connect_failed: n(&self.connect_failed),
            tls_failed: n(&self.tls_failed),
            tls_done: n(&self.tls_done),
            open: self.open.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
            turned_away: n(&self.turned_away),
            cut: n(&self.cut),
            held_ms: n(&self.held_ms),
            answers: self.answers.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }
    }

    fn opened(&self) {
        let now = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
}

impl Tally {
    /// What happened between `earlier` and this one (`open` and `peak` as now).
    pub fn since(&self, earlier: &Tally) -> Tally {
        let answers = self
            .answers
            .iter()
            .map(|(k, v)| (k.clone(), v - earlier.answers.get(k).copied().unwrap_or(0)))
            .filter(|(_, v)| *v > 0)
            .collect();
        Tally {
            attempts: self.attempts - earlier.attempts,
            connect_failed: self.connect_failed - earlier.connect_failed,
            tls_failed: self.tls_failed - earlier.tls_failed,
            tls_done: self.tls_done - earlier.tls_done,
            open: self.open,
            peak: self.peak,
            turned_away: self.turned_away - earlier.turned_away,
            cut: self.cut - earlier.cut,
            held_ms: self.held_ms - earlier.held_ms,
            answers,
        }
    }

    /// Mean time a connection the server cut had been held.
    pub fn mean_hold(&self) -> Duration {
        Duration::from_millis(self.held_ms / self.cut.max(1))
    }
}

/// The slow clients of every target, running until [`Flood::stop`].
pub struct Flood {
    rt: tokio::runtime::Runtime,
    /// Per target, per kind.
    counters: Vec<(Target, SlowKind, Arc<Counters>)>,
    pub clients_per_target: usize,
}

impl std::fmt::Debug for Flood {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flood")
            .field("clients_per_target", &self.clients_per_target)
            .finish()
    }
}

/// How the clients behave.
#[derive(Debug, Clone)]
pub struct Plan {
    pub clients_per_target: usize,
    pub kinds: Vec<SlowKind>,
    pub interval: Duration,
    /// Clients start evenly spread over this long.
    pub ramp: Duration,
}

impl Flood {
    /// Starts `plan.clients_per_target` clients against each target, the
    /// kinds dealt out in turn, source addresses round-robin.
    pub fn start(
        targets: &[Target],
        plan: &Plan,
        sources: &[Ipv4Addr],
        tls: TlsConnector,
    ) -> anyhow::Result<Flood> {
        if sources.is_empty() || plan.kinds.is_empty() {
            bail!("slow clients need a source address and a kind");
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("slow-clients")
            .on_thread_start(nice_this_thread)
            .enable_all()
            .build()?;
        let mut counters = Vec::new();
        for target in targets {
            let kinds: Vec<SlowKind> = plan
                .kinds
                .iter()
                .map(|k| match k {
                    SlowKind::Body if !target.reads_bodies => SlowKind::Head,
                    k => *k,
                })
                .collect();
            let mut mine: Vec<(SlowKind, Arc<Counters>)> = Vec::new();
            for k in &kinds {
                if !mine.iter().any(|(m, _)| m == k) {
                    mine.push((*k, Arc::default()));
                }
            }
            for i in 0..plan.clients_per_target {
                let kind = kinds[i % kinds.len()];
                let c = mine.iter().find(|(k, _)| *k == kind).map(|(_, c)| c.clone());
                let client = Client {
                    target: target.clone(),
                    kind,
                    source: sources[i % sources.len()],
                    interval: plan.interval,
                    tls: tls.clone(),
                    counters: c.context("a kind without counters")?,
                    seed: (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                };
                let start = plan.ramp.mul_f64(i as f64 / plan.clients_per_target as f64);
                rt.spawn(client.run(start));
            }
            counters.extend(mine.into_iter().map(|(k, c)| (target.clone(), k, c)));
        }
        Ok(Flood {
            rt,
            counters,
            clients_per_target: plan.clients_per_target,
        })
    }

    /// Per target and kind, what the clients saw so far.
    pub fn tally(&self) -> Vec<(&'static str, SlowKind, Tally)> {
        self.counters
            .iter()
            .map(|(t, k, c)| (t.name, *k, c.tally()))
            .collect()
    }

    /// Connections open now, per target.
    pub fn open(&self) -> Vec<(&'static str, i64)> {
        let mut out: Vec<(&'static str, i64)> = Vec::new();
        for (t, _, c) in &self.counters {
            let n = c.open.load(Ordering::Relaxed);
            match out.iter_mut().find(|(name, _)| *name == t.name) {
                Some((_, sum)) => *sum += n,
                None => out.push((t.name, n)),
            }
        }
        out
    }

    /// Closes every connection and stops the clients.
    pub fn stop(self) {
        self.rt.shutdown_timeout(Duration::from_secs(5));
    }
}

struct Client {
    target: Target,
    kind: SlowKind,
    source: Ipv4Addr,
    interval: Duration,
    tls: TlsConnector,
    counters: Arc<Counters>,
    /// xorshift state for the jitter of the comeback.
    seed: u64,
}

/// How a connection ended.
enum End {
    ConnectFailed,
    TlsFailed,
    /// The server closed it (after answering this first line, if it did).
    Closed(Option<String>),
}

impl Client {
    async fn run(mut self, start: Duration) {
        tokio::time::sleep(start).await;
        loop {
            self.counters.attempts.fetch_add(1, Ordering::Relaxed);
            let began = Instant::now();
            match self.once().await {
                End::ConnectFailed => {
                    self.counters.connect_failed.fetch_add(1, Ordering::Relaxed);
                }
                End::TlsFailed => {
                    self.counters.tls_failed.fetch_add(1, Ordering::Relaxed);
                    self.closed(began, None);
                }
                End::Closed(answer) => self.closed(began, answer),
            }
            // A connection the server held is taken again at once (within
            // a tenth of an interval), to keep its slot; one turned away or
            // never made comes back one interval later, give or take a quarter.
            let held = began.elapsed() >= HELD_AT_LEAST;
            let wait = if held {
                0.1 * self.random()
            } else {
                0.75 + 0.5 * self.random()
            };
            tokio::time::sleep(self.interval.mul_f64(wait)).await;
        }
    }

    /// Connects, holds the connection as its kind does, and says how it ended.
    async fn once(&self) -> End {
        let Ok(Ok(tcp)) = tokio::time::timeout(CONNECT_TIMEOUT, connect(self.source, self.target.addr)).await
        else {
            return End::ConnectFailed;
        };
        self.counters.opened();
        let end = self.hold(tcp).await;
        self.counters.open.fetch_sub(1, Ordering::Relaxed);
        end
    }

    async fn hold(&self, mut tcp: TcpStream) -> End {
        let (prefix, dribble) = match self.kind {
            SlowKind::Tcp => return End::Closed(read_answer(&mut tcp).await),
            SlowKind::Hello => {
                if write_flush(&mut tcp, HELLO_START).await.is_err() {
                    return End::Closed(None);
                }
                return End::Closed(read_answer(&mut tcp).await);
            }
            SlowKind::Head => (
                format!(
                    "{} HTTP/1.1\r\nHost: {}\r\nUser-Agent: slow\r\nX-Slow: ",
                    self.target.request_line, self.target.addr
                ),
                b'a',
            ),
            SlowKind::Body => (
                format!(
                    "{} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {BODY_LENGTH}\r\n\r\n{{",
                    self.target.request_line, self.target.addr
                ),
                b' ',
            ),
        };
        let handshake = self.tls.connect(self.target.server_name.clone(), tcp);
        let mut tls = match tokio::time::timeout(CONNECT_TIMEOUT, handshake).await {
            Ok(Ok(tls)) => tls,
            _ => return End::TlsFailed,
        };
        self.counters.tls_done.fetch_add(1, Ordering::Relaxed);
        if write_flush(&mut tls, prefix.as_bytes()).await.is_err() {
            return End::Closed(None);
        }
        let (mut rd, mut wr) = tokio::io::split(tls);
        let reader = read_answer(&mut rd);
        tokio::pin!(reader);
        loop {
            tokio::select! {
                answer = &mut reader => return End::Closed(answer),
                () = tokio::time::sleep(self.interval) => {
                    if write_flush(&mut wr, &[dribble]).await.is_err() {
                        break;
                    }
                }
            }
        }
        // The server closed; what it said, if anything, is still to be read.
        let answer = tokio::time::timeout(Duration::from_secs(1), reader)
            .await
            .ok()
            .flatten();
        End::Closed(answer)
    }

    fn closed(&self, began: Instant, answer: Option<String>) {
        let held = began.elapsed();
        if held < HELD_AT_LEAST {
            self.counters.turned_away.fetch_add(1, Ordering::Relaxed);
        } else {
            self.counters.cut.fetch_add(1, Ordering::Relaxed);
            self.counters
                .held_ms
                .fetch_add(held.as_millis() as u64, Ordering::Relaxed);
        }
        let key = answer.unwrap_or_else(|| "(closed without an answer)".into());
        *self
            .counters
            .answers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_default() += 1;
    }

    /// Uniform in [0, 1).
    fn random(&mut self) -> f64 {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        (self.seed >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Lowest CPU priority for the calling thread (`renice` on its thread id):
/// a real attacker does not share the servers' cores, so the slow clients
/// here take only what the servers and the measuring leave.
pub(crate) fn nice_this_thread() {
    let Some(tid) = std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name().map(|t| t.to_string_lossy().into_owned()))
    else {
        return;
    };
    let _ = Command::new("renice")
        .args(["-n", "19", "-p", &tid])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status();
}

async fn connect(source: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(IpAddr::V4(source), 0))?;
    socket.connect(to).await
}

async fn write_flush<W: AsyncWrite + Unpin>(w: &mut W, bytes: &[u8]) -> std::io::Result<()> {
    w.write_all(bytes).await?;
    w.flush().await
}

/// Reads until the server closes; the status line it answered (`HTTP/1.1
/// 401 Unauthorized` → `401 Unauthorized`), if any.
async fn read_answer<R: AsyncRead + Unpin>(r: &mut R) -> Option<String> {
    let mut first = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match r.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if first.len() < 256 {
                    first.extend_from_slice(&buf[..n]);
                }
            }
        }
    }
    status_of(&first)
}

/// `401 Unauthorized` from `HTTP/1.1 401 Unauthorized\r\n...`.
fn status_of(answer: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(answer);
    let line = text.lines().next()?.trim();
    let status = line.split_once(' ').map(|(_, s)| s)?;
    (!status.is_empty()).then(|| status.to_string())
}

/// Extra addresses on the host's leg of the testbed for the slow clients
/// to come from; removed when dropped (and gone with the leg anyway).
#[derive(Debug)]
pub struct Sources {
    link: String,
    pub addrs: Vec<Ipv4Addr>,
}

impl Sources {
    /// `n` addresses `subnet.200`, `subnet.201`, ... on `link`.
    pub fn add(link: &str, subnet: Ipv4Addr, n: usize) -> anyhow::Result<Sources> {
        let [a, b, c, _] = subnet.octets();
        let mut sources = Sources {
            link: link.to_string(),
            addrs: Vec::new(),
        };
        for i in 0..n {
            let addr = Ipv4Addr::new(a, b, c, 200 + i as u8);
            ip(&["addr", "add", &format!("{addr}/32"), "dev", link])?;
            sources.addrs.push(addr);
        }
        Ok(sources)
    }
}

impl Drop for Sources {
    fn drop(&mut self) {
        for addr in &self.addrs {
            let _ = ip(&["addr", "del", &format!("{addr}/32"), "dev", &self.link]);
        }
    }
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().context("cannot run ip")?;
    if !out.status.success() {
        bail!(
            "ip {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_is_the_status_line_without_the_version() {
        assert_eq!(
            status_of(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n").as_deref(),
            Some("401 Unauthorized")
        );
        assert_eq!(status_of(b""), None);
        assert_eq!(status_of(b"\x15\x03\x03"), None);
    }

    #[test]
    fn a_tally_since_an_earlier_one_counts_what_happened_between() {
        let earlier = Tally {
            attempts: 10,
            cut: 2,
            held_ms: 20_000,
            answers: BTreeMap::from([("408 Request Timeout".to_string(), 2)]),
            ..Tally::default()
        };
        let later = Tally {
            attempts: 15,
            cut: 5,
            held_ms: 50_000,
            open: 7,
            answers: BTreeMap::from([
                ("408 Request Timeout".to_string(), 2),
                ("401 Unauthorized".to_string(), 1),
            ]),
            ..Tally::default()
        };
        let d = later.since(&earlier);
        assert_eq!((d.attempts, d.cut, d.open), (5, 3, 7));
        assert_eq!(d.mean_hold(), Duration::from_secs(10));
        assert_eq!(d.answers, BTreeMap::from([("401 Unauthorized".to_string(), 1)]));
    }
}
