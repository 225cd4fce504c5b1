//! Health probing of LB backends (DESIGN §7): the agent probes the guests it
//! hosts that load balancers point at, and reports its verdicts in its heartbeat.
//!
//! ```text
//! heartbeat answer ──▶ update(desired) ──▶ plan(): start / retime / restart / stop
//!                                           │ one task per (lb, vm) check
//!   first probe at a random point in the interval, then every interval ± 10 %
//!   probe: bind to this node's address on the guest's network ──▶ TCP connect
//!          (or HTTP GET path, 2xx) within the timeout ──▶ Probe ──▶ HealthState::observe
//! heartbeat out    ◀── reports(): every verdict with its probe time, last change, reason
//!                      Acked: only those changed since the last answered heartbeat
//!                      (the whole set first and every WHOLE_SET_EVERY)
//! ```
//!
//! The probe leaves from the node's own address on the guest's network — its lease on
//! an overlay, the node address of a bridge network — the way the gateway's dials do.
//! A probe that cannot run for a reason on this node's side (no address on that
//! network yet, the bind fails, no route) is [`Probe::Inconclusive`]: the backend is
//! `unknown`, which is served, never `unhealthy`. Only what the backend does —
//! refusing, not answering in time, resetting, a non-2xx status — counts against it.
//!
//! Checks that leave the desired state stop at once; a check whose target (network,
//! IP, port, kind, path) changed starts over from `unknown`; one whose timing or
//! thresholds changed keeps its verdict and is rescheduled in the new interval.
//!
//! The pure parts — the plan, the schedule, the status-line parser, the mapping of a
//! probe's result to a [`Probe`], reports — are unit-tested here; probing itself is
//! tested end to end (`crates/otherix/tests/lb_e2e.rs`).

use std::collections::BTreeMap;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use otherix_core::lb::{first_probe_delay, next_probe_delay, HealthState, Probe, Thresholds};
use otherix_proto::agent::{DesiredState, HealthCheck, HealthReport};
use otherix_proto::ProbeKind;
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpSocket;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{debug, info, Instrument};

/// A check is one backend (VM id) of one LB.
pub type Key = (String, String);

/// Longest HTTP status line read before the answer counts as malformed.
const MAX_STATUS_LINE: usize = 1024;

// ------------------------------------------------------------------ the plan

/// What to do with one check after a new desired state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// New: probe from `unknown`.
    Start(HealthCheck),
    /// Same target, new timing or thresholds: keep the verdict, reschedule.
    Retime(HealthCheck),
    /// The target changed (network, IP, port, kind or path): the old verdict says
    /// nothing about the new target, so start over from `unknown`.
    Restart(HealthCheck),
    /// No longer in the desired state.
    Stop(Key),
}

pub fn key(c: &HealthCheck) -> Key {
    (c.lb.clone(), c.vm_id.clone())
}

fn same_target(a: &HealthCheck, b: &HealthCheck) -> bool {
    (&a.network, &a.ip, a.port, &a.kind, &a.path) == (&b.network, &b.ip, b.port, &b.kind, &b.path)
}

/// The changes that turn the running checks into the desired ones. Unchanged
/// checks are left alone: their schedule and verdict go on.
pub fn plan(running: &BTreeMap<Key, HealthCheck>, desired: &[HealthCheck]) -> Vec<Change> {
    let wanted: BTreeMap<Key, &HealthCheck> = desired.iter().map(|c| (key(c), c)).collect();
    let mut out: Vec<Change> = running
        .keys()
        .filter(|k| !wanted.contains_key(*k))
        .map(|k| Change::Stop(k.clone()))
        .collect();
    for (k, c) in wanted {
        match running.get(&k) {
            None => out.push(Change::Start(c.clone())),
            Some(old) if old == c => {}
            Some(old) if same_target(old, c) => out.push(Change::Retime(c.clone())),
            Some(_) => out.push(Change::Restart(c.clone())),
        }
    }
    out
}

// -------------------------------------------------------------- the schedule

/// Longest interval honoured: keeps the schedule's arithmetic far from overflow.
const MAX_INTERVAL_MS: u64 = 365 * 24 * 3600 * 1000;

fn interval(c: &HealthCheck) -> time::Duration {
    // The CP refuses intervals below its minimum; 1 ms keeps a zero from spinning.
    time::Duration::milliseconds(c.interval_ms.clamp(1, MAX_INTERVAL_MS) as i64)
}

/// Delay to a new check's first probe: a random point in the interval (`r` in
/// [0, 1)), so that checks created together do not probe in lockstep.
pub fn first_delay(c: &HealthCheck, r: f64) -> Duration {
    first_probe_delay(interval(c), r).unsigned_abs()
}

/// Delay from one probe's start to the next: the interval ± 10 %.
pub fn next_delay(c: &HealthCheck, r: f64) -> Duration {
    next_probe_delay(interval(c), r).unsigned_abs()
}

/// Uniform in [0, 1).
fn random_unit() -> f64 {
    let bits = getrandom::u64().unwrap_or_else(|_| {
        // No OS randomness: jitter only spreads probes, so the clock will do.
        OffsetDateTime::now_utc().unix_timestamp_nanos() as u64
    });
    (bits >> 11) as f64 / (1u64 << 53) as f64
}

// ------------------------------------------------------- results → verdicts

/// Why a probe did not succeed. The variants say whose side failed: this node's
/// (→ [`Probe::Inconclusive`]) or the backend's (→ [`Probe::Failure`]).
#[derive(Debug)]
#[non_exhaustive]
pub enum ProbeError {
    /// Node: no address on the guest's network yet (not reconciled, or not a member).
    NoAddress { network: String },
    /// Node: the check itself cannot be run (unknown kind, a path that cannot be sent).
    Unsupported(String),
    /// Node: the socket could not be made or bound to the node's address.
    Socket(io::Error),
    /// Connecting failed: the backend's fault unless the error is a local one.
    Connect(io::Error),
    /// Backend: no connection (or no answer) within the timeout.
    TimedOut(Duration),
    /// Backend: the connection broke during the HTTP exchange.
    Exchange(io::Error),
    /// Backend: an HTTP status outside 2xx.
    Status(u16),
    /// Backend: the answer is not an HTTP/1.x status line.
    Malformed,
}

/// Connect errors that come from this node (its addresses, routes, filters), not
/// from the backend.
fn local_connect_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::AddrNotAvailable
            | io::ErrorKind::AddrInUse
            | io::ErrorKind::PermissionDenied
            | io::ErrorKind::InvalidInput
    )
}

/// What a probe's result says about the backend.
pub fn to_probe(result: Result<(), ProbeError>) -> Probe {
    use ProbeError::*;
    let err = match result {
        Ok(()) => return Probe::Success,
        Err(e) => e,
    };
    match err {
        NoAddress { network } => {
            Probe::Inconclusive(format!("this node has no address on network {network} yet"))
        }
        Unsupported(why) => Probe::Inconclusive(why),
        Socket(e) => Probe::Inconclusive(format!("cannot bind the probe socket: {e}")),
        Connect(e) if local_connect_error(&e) => {
            Probe::Inconclusive(format!("cannot connect from this node: {e}"))
        }
        Connect(e) => Probe::Failure(format!("connect: {e}")),
        TimedOut(t) => Probe::Failure(format!("no answer within {}ms", t.as_millis())),
        Exchange(e) => Probe::Failure(format!("HTTP exchange: {e}")),
        Status(code) => Probe::Failure(format!("HTTP status {code}")),
        Malformed => Probe::Failure("not an HTTP/1.x response".into()),
    }
}

/// The status line of an HTTP/1.x answer, parsed from its first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusLine {
    /// Need more bytes.
    Incomplete,
    Status(u16),
    Malformed,
}

/// Parses `HTTP/1.x NNN [reason]\r\n` at the start of `buf`.
pub fn parse_status_line(buf: &[u8]) -> StatusLine {
    const PREFIX: &[u8] = b"HTTP/1.";
    let n = buf.len().min(PREFIX.len());
    if buf[..n] != PREFIX[..n] {
        return StatusLine::Malformed;
    }
    let Some(end) = buf.iter().position(|b| *b == b'\n') else {
        return if buf.len() >= MAX_STATUS_LINE {
            StatusLine::Malformed
        } else {
            StatusLine::Incomplete
        };
    };
    let line = buf[..end].strip_suffix(b"\r").unwrap_or(&buf[..end]);
    // "HTTP/1.x" SP 3DIGIT [SP reason]
    let ok = line.len() >= 12
        && line[7].is_ascii_digit()
        && line[8] == b' '
        && line[9..12].iter().all(u8::is_ascii_digit)
        && (line.len() == 12 || line[12] == b' ');
    if !ok {
        return StatusLine::Malformed;
    }
    let code = line[9..12]
        .iter()
        .fold(0u16, |acc, d| acc * 10 + u16::from(d - b'0'));
    StatusLine::Status(code)
}

/// The HTTP probe's request. `None` if the path could smuggle bytes into the head.
pub fn http_request(path: &str, ip: Ipv4Addr, port: u16) -> Option<String> {
    let clean = path.starts_with('/') && path.bytes().all(|b| b.is_ascii_graphic());
    let host = if port == 80 {
        ip.to_string()
    } else {
        format!("{ip}:{port}")
    };
    clean.then(|| {
        format!(
            "GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: otherix-health\r\nConnection: close\r\n\r\n"
        )
    })
}

/// The verdict as the heartbeat carries it; `None` before the first probe.
pub fn report(key: &Key, s: &HealthState) -> Option<HealthReport> {
    Some(HealthReport {
        lb: key.0.clone(),
        vm_id: key.1.clone(),
        health: s.health,
        probed_at: s.last_probe?,
        changed_at: s.last_change,
        reason: s.reason.clone(),
        successes: s.successes,
        failures: s.failures,
    })
}

/// This node's address on each network it has one on: its lease on overlays, the
/// node address of bridge networks. Keyed by network name (what checks carry).
pub fn sources(desired: &DesiredState) -> BTreeMap<String, Ipv4Addr> {
    let overlays = desired
        .overlays
        .iter()
        .map(|o| (o.network.clone(), o.address.addr()));
    let bridges = desired
        .bridges
        .iter()
        .map(|b| (b.network.clone(), b.address.addr()));
    overlays.chain(bridges).collect()
}

// ------------------------------------------------------------------ probing

/// One probe of `c` from `source`, within the check's timeout.
async fn probe(c: &HealthCheck, source: Option<Ipv4Addr>) -> Result<(), ProbeError> {
    let source = source.ok_or_else(|| ProbeError::NoAddress {
        network: c.network.clone(),
    })?;
    let ip = c.ip;
    let request = match (c.kind, c.path.as_deref()) {
        (ProbeKind::Tcp, _) => None,
        (ProbeKind::Http, path) => Some(
            http_request(path.unwrap_or("/"), ip, c.port)
                .ok_or_else(|| ProbeError::Unsupported(format!("unusable HTTP path {path:?}")))?,
        ),
    };
    let timeout = Duration::from_millis(c.timeout_ms.max(1));
    let socket = TcpSocket::new_v4().map_err(ProbeError::Socket)?;
    socket
        .bind(SocketAddr::from((source, 0)))
        .map_err(ProbeError::Socket)?;
    let exchange = async {
        let mut stream = socket
            .connect(SocketAddr::V4(SocketAddrV4::new(ip, c.port)))
            .await
            .map_err(ProbeError::Connect)?;
        let Some(request) = request else {
            return Ok(());
        };
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(ProbeError::Exchange)?;
        let mut buf = Vec::with_capacity(256);
        let mut chunk = [0u8; 512];
        loop {
            match parse_status_line(&buf) {
                StatusLine::Status(code) if (200..300).contains(&code) => return Ok(()),
                StatusLine::Status(code) => return Err(ProbeError::Status(code)),
                StatusLine::Malformed => return Err(ProbeError::Malformed),
                StatusLine::Incomplete => {}
            }
            let n = stream.read(&mut chunk).await.map_err(ProbeError::Exchange)?;
            if n == 0 {
                return Err(ProbeError::Exchange(io::ErrorKind::UnexpectedEof.into()));
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| ProbeError::TimedOut(timeout))?
}

/// Addresses the probes leave from, replaced after every desired state.
type Sources = Arc<RwLock<BTreeMap<String, Ipv4Addr>>>;

/// Probes one check until aborted.
async fn run_check(c: HealthCheck, state: Arc<Mutex<HealthState>>, sources: Sources) {
    let thresholds = Thresholds {
        rise: c.rise,
        fall: c.fall,
    };
    let mut due = Instant::now() + first_delay(&c, random_unit());
    loop {
        tokio::time::sleep_until(due).await;
        let started = Instant::now();
        let source = sources
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&c.network)
            .copied();
        let result = to_probe(probe(&c, source).await);
        debug!(?result, "probed");
        let outcome = match &result {
            Probe::Success => "success",
            Probe::Failure(_) => "failure",
            Probe::Inconclusive(_) => "inconclusive",
        };
        metrics::counter!("otherix_agent_health_probes_total", "result" => outcome).increment(1);
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        let before = s.health;
        s.observe(result, &thresholds, OffsetDateTime::now_utc());
        if s.health != before {
            info!(
                from = %before,
                to = %s.health,
                reason = s.reason.as_deref().unwrap_or("-"),
                successes = s.successes,
                failures = s.failures,
                "backend health changed"
            );
        }
        drop(s);
        // Start to start, so a slow probe does not stretch the interval.
        due = started + next_delay(&c, random_unit());
    }
}

/// One running check.
#[derive(Debug)]
struct Running {
    check: HealthCheck,
    state: Arc<Mutex<HealthState>>,
    task: JoinHandle<()>,
}

/// The checks this node runs. Dropping it stops them all.
#[derive(Debug, Default)]
pub struct Prober {
    sources: Sources,
    running: BTreeMap<Key, Running>,
}

impl Prober {
    pub fn new() -> Prober {
        Prober::default()
    }

    /// Converges to the checks (and source addresses) of `desired`. Call it after
    /// the reconciler ran, so the addresses probes bind to exist. Needs a tokio
    /// runtime.
    pub fn update(&mut self, desired: Option<&DesiredState>) {
        let Some(desired) = desired else {
            return;
        };
        *self.sources.write().unwrap_or_else(|p| p.into_inner()) = sources(desired);
        let current: BTreeMap<Key, HealthCheck> = self
            .running
            .iter()
            .map(|(k, r)| (k.clone(), r.check.clone()))
            .collect();
        for change in plan(&current, &desired.health_checks) {
            match change {
                Change::Stop(k) => {
                    if let Some(r) = self.running.remove(&k) {
                        r.task.abort();
                        info!(lb = %k.0, vm_id = %k.1, "health check stopped");
                    }
                }
                Change::Start(c) => self.spawn(c, Arc::default(), "health check started"),
                Change::Restart(c) => {
                    if let Some(r) = self.running.remove(&key(&c)) {
                        r.task.abort();
                    }
                    self.spawn(c, Arc::default(), "health check target changed; starting over");
                }
                Change::Retime(c) => {
                    let state = match self.running.remove(&key(&c)) {
                        Some(r) => {
                            r.task.abort();
                            r.state
                        }
                        None => Arc::default(),
                    };
                    self.spawn(c, state, "health check timing changed");
                }
            }
        }
    }

    fn spawn(&mut self, c: HealthCheck, state: Arc<Mutex<HealthState>>, what: &str) {
        let span = tracing::info_span!("health", lb = %c.lb, vm_id = %c.vm_id, ip = %c.ip, port = c.port);
        span.in_scope(|| {
            info!(
                kind = %c.kind,
                path = c.path.as_deref().unwrap_or("-"),
                interval_ms = c.interval_ms,
                timeout_ms = c.timeout_ms,
                "{what}"
            )
        });
        let task = tokio::spawn(run_check(c.clone(), state.clone(), self.sources.clone()).instrument(span));
        self.running.insert(
            key(&c),
            Running {
                check: c,
                state,
                task,
            },
        );
    }

    /// Every current verdict (checks not probed yet have none).
    pub fn reports(&self) -> Vec<HealthReport> {
        self.running
            .iter()
            .filter_map(|(k, r)| report(k, &r.state.lock().unwrap_or_else(|p| p.into_inner())))
            .collect()
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        for r in self.running.values() {
            r.task.abort();
        }
    }
}

// ------------------------------------------------------------- what the CP holds

/// How often a heartbeat carries every verdict rather than the changes.
pub const WHOLE_SET_EVERY: Duration = otherix_proto::agent::HEALTH_WHOLE_SET_EVERY;

/// Probe counts up to this are news at every probe: the approach to a
/// `rise` or `fall` threshold shows probe by probe in `lb get`.
pub const COUNTS_WINDOW: u32 = 10;

/// Past [`COUNTS_WINDOW`], counts that moved are sent again at most this
/// often: `lb get`'s OK/FAIL keep moving without a verdict a heartbeat.
pub const COUNTS_EVERY: Duration = Duration::from_secs(60);

/// What a verdict says, as far as the CP is concerned: probe times move
/// with every probe and are not news; counts are, as [`news`] says.
type Said = (otherix_core::lb::Health, Option<String>, Option<OffsetDateTime>);

fn said(r: &HealthReport) -> Said {
    (r.health, r.reason.clone(), r.changed_at)
}

/// One verdict as the CP last acknowledged it.
#[derive(Debug, Clone)]
struct Held {
    said: Said,
    counts: (u32, u32),
    sent: Instant,
}

/// Is `r` worth sending, given what the CP holds: a new verdict or reason,
/// or counts that moved — each probe while the count is small (near a
/// threshold), every [`COUNTS_EVERY`] past that. Between two sends the
/// outcome of every probe was the same: a new outcome resets a count or
/// changes the reason, which is news at once.
fn news(held: Option<&Held>, r: &HealthReport, now: Instant) -> bool {
    let Some(h) = held else {
        return true;
    };
    if h.said != said(r) {
        return true;
    }
    let counts = (r.successes, r.failures);
    if counts == h.counts {
        return false;
    }
    let reset = counts.0 < h.counts.0 || counts.1 < h.counts.1;
    let moving = counts.0.max(counts.1);
    reset || moving <= COUNTS_WINDOW || now.duration_since(h.sent) >= COUNTS_EVERY
}

/// The verdicts the CP acknowledged (in an answered heartbeat), so a
/// heartbeat carries only what changed since: at 1,000 LBs a node's whole
/// set is megabytes, its changes a few reports.
#[derive(Debug, Default)]
pub struct Acked {
    held: BTreeMap<Key, Held>,
    last_whole: Option<Instant>,
}

/// The verdicts one heartbeat carries.
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    /// Every verdict (the CP forgets none it is not told about, but takes
    /// each as news).
    pub whole: bool,
    pub reports: Vec<HealthReport>,
}

impl Acked {
    /// What to send now, from every current verdict: all of them at the
    /// first heartbeat and every [`WHOLE_SET_EVERY`], else the [`news`].
    pub fn outgoing(&self, reports: Vec<HealthReport>, now: Instant) -> Outgoing {
        let whole = self
            .last_whole
            .is_none_or(|t| now.duration_since(t) >= WHOLE_SET_EVERY);
        if whole {
            return Outgoing { whole, reports };
        }
        let reports = reports
            .into_iter()
            .filter(|r| news(self.held.get(&(r.lb.clone(), r.vm_id.clone())), r, now))
            .collect();
        Outgoing { whole, reports }
    }

    /// The heartbeat that carried `sent` was answered.
    pub fn answered(&mut self, sent: Outgoing, now: Instant) {
        if sent.whole {
            self.held.clear();
            self.last_whole = Some(now);
        }
        for r in &sent.reports {
            self.held.insert(
                (r.lb.clone(), r.vm_id.clone()),
                Held {
                    said: said(r),
                    counts: (r.successes, r.failures),
                    sent: now,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use otherix_core::lb::Health;
    use otherix_proto::agent::{BridgeState, OverlayState};

    fn check(lb: &str, vm: &str) -> HealthCheck {
        HealthCheck {
            lb: lb.into(),
            vm_id: vm.into(),
            network: "ov".into(),
            ip: "10.0.0.5".parse().unwrap(),
            port: 8080,
            kind: ProbeKind::Tcp,
            path: None,
            interval_ms: 1000,
            timeout_ms: 500,
            rise: 2,
            fall: 3,
        }
    }

    fn running<'a>(checks: impl IntoIterator<Item = &'a HealthCheck>) -> BTreeMap<Key, HealthCheck> {
        checks.into_iter().map(|c| (key(c), c.clone())).collect()
    }

    fn verdict(lb: &str, vm: &str, health: Health, reason: Option<&str>) -> HealthReport {
        HealthReport {
            lb: lb.into(),
            vm_id: vm.into(),
            health,
            probed_at: OffsetDateTime::UNIX_EPOCH,
            changed_at: Some(OffsetDateTime::UNIX_EPOCH),
            reason: reason.map(Into::into),
            successes: 1,
            failures: 0,
        }
    }

    #[test]
    fn heartbeats_carry_the_whole_set_first_then_changes_then_the_whole_set_again() {
        let t0 = Instant::now();
        let mut acked = Acked::default();
        let a = verdict("web", "vm1", Health::Healthy, None);
        let b = verdict("web", "vm2", Health::Healthy, None);
        let first = acked.outgoing(vec![a.clone(), b.clone()], t0);
        assert!(first.whole);
        assert_eq!(first.reports.len(), 2);
        acked.answered(first, t0);

        // Nothing new: nothing sent (a new probe time is not news).
        let mut probed_again = a.clone();
        probed_again.probed_at += time::Duration::seconds(2);
        let quiet = acked.outgoing(vec![probed_again, b.clone()], t0 + Duration::from_secs(2));
        assert!(!quiet.whole);
        assert!(quiet.reports.is_empty(), "{:?}", quiet.reports);

        // vm2 failed: only it goes, until a heartbeat carrying it is answered.
        let down = verdict("web", "vm2", Health::Unhealthy, Some("connect: refused"));
        let change = acked.outgoing(vec![a.clone(), down.clone()], t0 + Duration::from_secs(4));
        assert_eq!(change.reports, vec![down.clone()]);
        let again = acked.outgoing(vec![a.clone(), down.clone()], t0 + Duration::from_secs(6));
        assert_eq!(
            again.reports,
            vec![down.clone()],
            "an unanswered change goes again"
        );
        acked.answered(again, t0 + Duration::from_secs(6));
        assert!(acked
            .outgoing(vec![a.clone(), down.clone()], t0 + Duration::from_secs(8))
            .reports
            .is_empty());

        // Now and then, everything again.
        let later = acked.outgoing(vec![a, down], t0 + WHOLE_SET_EVERY + Duration::from_secs(1));
        assert!(later.whole);
        assert_eq!(later.reports.len(), 2);
    }

    #[test]
    fn counts_are_news_probe_by_probe_near_a_threshold_and_now_and_then_past_it() {
        let t0 = Instant::now();
        let at = |s| t0 + Duration::from_secs(s);
        let mut acked = Acked::default();
        let mut a = verdict("web", "vm1", Health::Healthy, None);
        let first = acked.outgoing(vec![a.clone()], t0);
        acked.answered(first, t0);
        // Every success up to the window is sent.
        for n in 2..=COUNTS_WINDOW {
            a.successes = n;
            let out = acked.outgoing(vec![a.clone()], at(u64::from(n)));
            assert_eq!(out.reports.len(), 1, "success {n}");
            acked.answered(out, at(u64::from(n)));
        }
        // Past it: not at every probe, but once COUNTS_EVERY has passed.
        a.successes = COUNTS_WINDOW + 1;
        assert!(acked.outgoing(vec![a.clone()], at(11)).reports.is_empty());
        a.successes = COUNTS_WINDOW + 5;
        let sent_at = at(u64::from(COUNTS_WINDOW)) + COUNTS_EVERY;
        let out = acked.outgoing(vec![a.clone()], sent_at);
        assert_eq!(out.reports[0].successes, COUNTS_WINDOW + 5);
        acked.answered(out, sent_at);
        // Unmoved counts are never news.
        assert!(acked
            .outgoing(vec![a.clone()], sent_at + COUNTS_EVERY * 2)
            .reports
            .is_empty());
        // One failure below `fall` (healthy still): a reset, and a reason, at once.
        let mut failed = a.clone();
        failed.successes = 0;
        failed.failures = 1;
        failed.reason = Some("connect: refused".into());
        assert_eq!(
            acked.outgoing(vec![failed.clone()], sent_at).reports,
            vec![failed]
        );
        // A reset alone (the reason unchanged) is news too.
        let mut fewer = a.clone();
        fewer.successes = 1;
        assert_eq!(acked.outgoing(vec![fewer.clone()], sent_at).reports, vec![fewer]);
    }

    #[test]
    fn new_checks_start_and_vanished_ones_stop() {
        let a = check("web", "vm1");
        let b = check("web", "vm2");
        let changes = plan(&running([&a]), std::slice::from_ref(&b));
        assert_eq!(changes, vec![Change::Stop(key(&a)), Change::Start(b)]);
        assert_eq!(plan(&running([&a]), &[]), vec![Change::Stop(key(&a))]);
    }

    #[test]
    fn unchanged_checks_are_left_alone() {
        let a = check("web", "vm1");
        assert!(plan(&running([&a]), std::slice::from_ref(&a)).is_empty());
    }

    #[test]
    fn one_vm_behind_two_lbs_is_two_checks() {
        let a = check("web", "vm1");
        let b = check("api", "vm1");
        let changes = plan(&BTreeMap::new(), &[a.clone(), b.clone()]);
        assert_eq!(changes, vec![Change::Start(b), Change::Start(a)]);
    }

    #[test]
    fn new_timing_keeps_the_verdict_and_a_new_target_starts_over() {
        let a = check("web", "vm1");
        let mut slower = a.clone();
        slower.interval_ms = 10_000;
        slower.fall = 5;
        assert_eq!(
            plan(&running([&a]), std::slice::from_ref(&slower)),
            vec![Change::Retime(slower)]
        );

        let mutations: [fn(&mut HealthCheck); 5] = [
            |c| c.ip = "10.0.0.9".parse().unwrap(),
            |c| c.port = 9090,
            |c| c.network = "other".into(),
            |c| c.kind = ProbeKind::Http,
            |c| c.path = Some("/healthz".into()),
        ];
        for m in mutations {
            let mut moved = a.clone();
            m(&mut moved);
            assert_eq!(
                plan(&running([&a]), std::slice::from_ref(&moved)),
                vec![Change::Restart(moved)]
            );
        }
    }

    #[test]
    fn the_first_probe_falls_inside_the_interval_and_later_ones_within_ten_percent() {
        let c = check("web", "vm1");
        for i in 0..=100 {
            let r = f64::from(i) / 100.0;
            let first = first_delay(&c, r);
            assert!(first < Duration::from_millis(1000), "{first:?}");
            let next = next_delay(&c, r);
            assert!(
                next >= Duration::from_millis(900) && next <= Duration::from_millis(1100),
                "{next:?}"
            );
        }
        assert_eq!(first_delay(&c, 0.0), Duration::ZERO);
        assert_eq!(next_delay(&c, 0.5), Duration::from_millis(1000));
    }

    #[test]
    fn random_draws_stay_in_the_unit_interval_and_differ() {
        let draws: Vec<f64> = (0..64).map(|_| random_unit()).collect();
        assert!(draws.iter().all(|r| (0.0..1.0).contains(r)));
        assert!(draws.windows(2).any(|w| w[0] != w[1]));
    }

    #[test]
    fn failures_on_this_nodes_side_are_inconclusive() {
        let local = [
            ProbeError::NoAddress { network: "ov".into() },
            ProbeError::Unsupported("unknown check kind \"udp\"".into()),
            ProbeError::Socket(io::ErrorKind::AddrNotAvailable.into()),
            ProbeError::Connect(io::ErrorKind::NetworkUnreachable.into()),
            ProbeError::Connect(io::ErrorKind::AddrNotAvailable.into()),
        ];
        for e in local {
            let what = format!("{e:?}");
            assert!(matches!(to_probe(Err(e)), Probe::Inconclusive(_)), "{what}");
        }
        let p = to_probe(Err(ProbeError::NoAddress { network: "ov".into() }));
        assert_eq!(
            p,
            Probe::Inconclusive("this node has no address on network ov yet".into())
        );
    }

    #[test]
    fn failures_of_the_backend_count_against_it() {
        let backend = [
            ProbeError::Connect(io::ErrorKind::ConnectionRefused.into()),
            ProbeError::Connect(io::ErrorKind::HostUnreachable.into()),
            ProbeError::Connect(io::ErrorKind::ConnectionReset.into()),
            ProbeError::TimedOut(Duration::from_millis(500)),
            ProbeError::Exchange(io::ErrorKind::UnexpectedEof.into()),
            ProbeError::Status(503),
            ProbeError::Malformed,
        ];
        for e in backend {
            let what = format!("{e:?}");
            assert!(matches!(to_probe(Err(e)), Probe::Failure(_)), "{what}");
        }
        assert_eq!(
            to_probe(Err(ProbeError::TimedOut(Duration::from_millis(500)))),
            Probe::Failure("no answer within 500ms".into())
        );
        assert_eq!(
            to_probe(Err(ProbeError::Status(404))),
            Probe::Failure("HTTP status 404".into())
        );
        assert_eq!(to_probe(Ok(())), Probe::Success);
    }

    #[test]
    fn an_inconclusive_probe_never_makes_a_backend_unhealthy() {
        let t = Thresholds { rise: 2, fall: 1 };
        let mut s = HealthState::default();
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        for _ in 0..10 {
            s.observe(
                to_probe(Err(ProbeError::Socket(io::ErrorKind::AddrNotAvailable.into()))),
                &t,
                now,
            );
        }
        assert_eq!(s.health, Health::Unknown);
        s.observe(
            to_probe(Err(ProbeError::Connect(io::ErrorKind::ConnectionRefused.into()))),
            &t,
            now,
        );
        assert_eq!(s.health, Health::Unhealthy);
    }

    #[test]
    fn status_lines_parse_incrementally() {
        assert_eq!(parse_status_line(b""), StatusLine::Incomplete);
        assert_eq!(parse_status_line(b"HTT"), StatusLine::Incomplete);
        assert_eq!(parse_status_line(b"HTTP/1.1 200 O"), StatusLine::Incomplete);
        assert_eq!(parse_status_line(b"HTTP/1.1 200 OK\r\n"), StatusLine::Status(200));
        assert_eq!(parse_status_line(b"HTTP/1.0 204\r\n"), StatusLine::Status(204));
        assert_eq!(parse_status_line(b"HTTP/1.1 503 Busy\n"), StatusLine::Status(503));
        assert_eq!(
            parse_status_line(b"HTTP/1.1 301 Moved\r\nLocation: /x\r\n\r\n"),
            StatusLine::Status(301)
        );
    }

    #[test]
    fn what_is_not_an_http_status_line_is_malformed() {
        for bad in [
            &b"SSH-2.0-OpenSSH\r\n"[..],
            b"hello",
            b"HTTP/2 200\r\n",
            b"HTTP/1.1 20 OK\r\n",
            b"HTTP/1.1 2000 OK\r\n",
            b"HTTP/1.1  200 OK\r\n",
            b"HTTP/1.x 200 OK\r\n",
        ] {
            assert_eq!(
                parse_status_line(bad),
                StatusLine::Malformed,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        let endless = [b"HTTP/1.1 200 ".as_slice(), &[b'x'; MAX_STATUS_LINE]].concat();
        assert_eq!(parse_status_line(&endless), StatusLine::Malformed);
    }

    #[test]
    fn the_http_request_is_minimal_and_refuses_smuggled_bytes() {
        assert_eq!(
            http_request("/healthz", Ipv4Addr::new(10, 0, 0, 5), 8080).unwrap(),
            "GET /healthz HTTP/1.1\r\nHost: 10.0.0.5:8080\r\nUser-Agent: otherix-health\r\nConnection: close\r\n\r\n"
        );
        assert!(http_request("/a b", Ipv4Addr::new(10, 0, 0, 5), 80).is_none());
        assert!(http_request("/a\r\nX: y", Ipv4Addr::new(10, 0, 0, 5), 80).is_none());
        assert!(http_request("healthz", Ipv4Addr::new(10, 0, 0, 5), 80).is_none());
        assert!(http_request("/", Ipv4Addr::new(10, 0, 0, 5), 80)
            .unwrap()
            .contains("Host: 10.0.0.5\r\n"));
    }

    #[test]
    fn verdicts_are_reported_only_once_probed() {
        let k: Key = ("web".into(), "vm1".into());
        assert!(report(&k, &HealthState::default()).is_none());
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let mut s = HealthState::default();
        s.observe(
            Probe::Failure("connect: refused".into()),
            &Thresholds { rise: 2, fall: 1 },
            now,
        );
        let r = report(&k, &s).unwrap();
        assert_eq!((r.lb.as_str(), r.vm_id.as_str()), ("web", "vm1"));
        assert_eq!(r.health, otherix_core::lb::Health::Unhealthy);
        assert_eq!(r.probed_at, now);
        assert_eq!(r.changed_at, Some(now));
        assert_eq!(r.reason.as_deref(), Some("connect: refused"));
        assert_eq!((r.successes, r.failures), (0, 1));
    }

    #[test]
    fn probes_leave_from_the_overlay_lease_or_the_bridge_address() {
        let desired = DesiredState {
            overlays: vec![OverlayState {
                network: "ov".into(),
                network_id: "n1".into(),
                vni: 100,
                subnet: "10.0.0.0/24".parse().unwrap(),
                address: "10.0.0.7/24".parse().unwrap(),
                mac: "02:00:00:00:00:07".parse().unwrap(),
                fdb: vec![],
                neighbors: vec![],
            }],
            bridges: vec![BridgeState {
                network: "br".into(),
                network_id: "n2".into(),
                subnet: "10.1.0.0/24".parse().unwrap(),
                address: "10.1.0.1/24".parse().unwrap(),
            }],
            ..Default::default()
        };
        let s = sources(&desired);
        assert_eq!(s.get("ov"), Some(&Ipv4Addr::new(10, 0, 0, 7)));
        assert_eq!(s.get("br"), Some(&Ipv4Addr::new(10, 1, 0, 1)));
        assert_eq!(s.len(), 2);
    }

    /// The probe against real sockets on loopback: a listener is healthy, a closed
    /// port is a failure, no address is inconclusive, HTTP statuses count.
    #[tokio::test]
    async fn probes_against_loopback() {
        let lo = Some(Ipv4Addr::LOCALHOST);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut c = check("web", "vm1");
        c.ip = "127.0.0.1".parse().unwrap();
        c.port = port;
        assert_eq!(to_probe(probe(&c, lo).await), Probe::Success);
        assert!(matches!(to_probe(probe(&c, None).await), Probe::Inconclusive(_)));
        // A source address this host does not have.
        assert!(matches!(
            to_probe(probe(&c, Some(Ipv4Addr::new(192, 0, 2, 1))).await),
            Probe::Inconclusive(_)
        ));

        // HTTP, on a fresh listener (the TCP probes left connections in the backlog):
        // one answer per accepted connection.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        c.port = listener.local_addr().unwrap().port();
        let serve = |status: &'static str| {
            let listener = &listener;
            async move {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let n = s.read(&mut buf).await.unwrap();
                assert!(buf[..n].starts_with(b"GET /healthz HTTP/1.1\r\n"));
                s.write_all(status.as_bytes()).await.unwrap();
            }
        };
        c.kind = ProbeKind::Http;
        c.path = Some("/healthz".into());
        let (p, ()) = tokio::join!(probe(&c, lo), serve("HTTP/1.1 204 No Content\r\n\r\n"));
        assert_eq!(to_probe(p), Probe::Success);
        let (p, ()) = tokio::join!(probe(&c, lo), serve("HTTP/1.1 503 Service Unavailable\r\n\r\n"));
        assert_eq!(to_probe(p), Probe::Failure("HTTP status 503".into()));
        // Accepts but never answers: the timeout.
        c.timeout_ms = 100;
        let (p, _held) = tokio::join!(probe(&c, lo), listener.accept());
        assert_eq!(to_probe(p), Probe::Failure("no answer within 100ms".into()));

        drop(listener);
        c.kind = ProbeKind::Tcp;
        assert!(matches!(to_probe(probe(&c, lo).await), Probe::Failure(r) if r.starts_with("connect:")));
    }
}
