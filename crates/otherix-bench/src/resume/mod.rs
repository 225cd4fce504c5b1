//! Resumable relay sessions beside plain ones (issue #31), on a testbed of
//! their own: two control-plane replicas on PostgreSQL, `node1` and
//! `node2` with a bridge network on both, one guest on `node1` running an
//! echo server and iperf3. Every client is an `otherix forward` in the host
//! namespace, one with `OTHERIX_RELAY_RESUME=off` (the plain relay) and one
//! resumable (the default). Measured: one-stream throughput each way; the
//! CP's and the node agent's memory per idle session; and the resume gap —
//! the longest time without an echoed byte of a steady small-message stream
//! — when the client's connections are killed, when the replica carrying
//! the session is killed, and when the guest migrates.

pub mod stream;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use otherix_testbed::cluster::{Cluster, ClusterSpec, CP_PORT};
use otherix_testbed::{wait_until, Proc, World};

use self::stream::EchoStream;
use crate::bed::{ECHO_PORT, IPERF_PORT};
use crate::options::Options;
use crate::{procfs, progress, throughput};

const VM: &str = "resume-echo";
const NETWORK: &str = "resume-lab";
const SUBNET: &str = "10.152.0.0/24";
const WAIT: Duration = Duration::from_secs(60);
/// iperf3 may take this long beyond `--seconds`.
const IPERF_SLACK: Duration = Duration::from_secs(20);
/// Time for the servers to settle before their memory is read.
const SETTLE: Duration = Duration::from_secs(2);
/// Idle sessions are opened this many at a time.
const OPENERS: usize = 8;
/// Steady streaming between two tries, and after a try's backlog came back
/// before its window closes.
const BETWEEN: Duration = Duration::from_millis(500);
const TAIL: Duration = Duration::from_millis(200);
/// How long a plain stream is given to show whether it survived.
const PLAIN_VERDICT: Duration = Duration::from_secs(10);

/// A relay session's kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Plain,
    Resumable,
}

/// What happens to a session while its stream runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The client's TCP connections to the CP killed with `ss -K`.
    Dropped,
    /// The replica carrying the session killed with SIGKILL (then started again).
    Failover,
    /// The guest migrated to the other node.
    Migration,
}

impl Event {
    pub const ALL: [Event; 3] = [Event::Dropped, Event::Failover, Event::Migration];

    pub fn title(self) -> &'static str {
        match self {
            Event::Dropped => "client connection dropped (ss -K)",
            Event::Failover => "replica failover (kill -9)",
            Event::Migration => "VM migration (node1 <-> node2)",
        }
    }
}

/// Everything the part measured.
#[derive(Debug, Clone)]
pub struct Figures {
    /// Upload (client to guest), then download (`iperf3 -R`).
    pub throughput: Vec<Way>,
    pub rounds: usize,
    pub seconds: u64,
    /// Plain, then resumable.
    pub memory: Vec<SessionMemory>,
    pub events: Vec<EventFigures>,
    pub tries: usize,
    /// `/proc/loadavg` when the part began and when it ended.
    pub load: (String, String),
}

/// One direction's one-stream rates (bits/s) on each path, round by round.
#[derive(Debug, Clone, Default)]
pub struct Way {
    pub name: &'static str,
    pub rounds: Vec<Round>,
    /// Runs that failed, and why.
    pub failures: Vec<String>,
}

/// One round of one direction: each path once, plain and resumable one
/// right after the other (their order alternates from round to round), so
/// the two meet the same machine.
#[derive(Debug, Clone, Copy, Default)]
pub struct Round {
    pub direct: Option<f64>,
    pub plain: Option<f64>,
    pub resumable: Option<f64>,
}

impl Round {
    /// Resumable over plain, within this round.
    pub fn ratio(&self) -> Option<f64> {
        Some(self.resumable? / self.plain?).filter(|r| r.is_finite())
    }
}

impl Way {
    /// The rates one path reached, one per round that measured it.
    pub fn rates(&self, path: fn(&Round) -> Option<f64>) -> Vec<f64> {
        self.rounds.iter().filter_map(path).collect()
    }

    /// Resumable over plain in each round that measured both.
    pub fn ratios(&self) -> Vec<f64> {
        self.rounds.iter().filter_map(Round::ratio).collect()
    }

    /// The median of the rounds' own ratios: each compares two runs that
    /// met the same machine, so a slow spell of the machine (which moved
    /// the plain relay alone by a fifth between runs of a few seconds)
    /// moves both sides of a ratio, not one.
    pub fn ratio(&self) -> Option<f64> {
        median(self.ratios())
    }
}

/// The middle value (the mean of the two middle ones for an even count).
pub fn median(mut xs: Vec<f64>) -> Option<f64> {
    xs.retain(|x| x.is_finite());
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(xs[n / 2]),
        _ => Some((xs[n / 2 - 1] + xs[n / 2]) / 2.0),
    }
}

/// Idle sessions of one kind and what they cost.
#[derive(Debug, Clone)]
pub struct SessionMemory {
    pub kind: Kind,
    pub requested: usize,
    pub opened: usize,
    pub first_error: Option<String>,
    /// The replica that carried them (`cp`, `cp2`).
    pub replica: String,
    /// Resident-set growth with the sessions open, in bytes.
    pub cp_growth: i64,
    pub agent_growth: i64,
}

impl SessionMemory {
    pub fn cp_per_session(&self) -> Option<f64> {
        (self.opened > 0).then(|| self.cp_growth as f64 / self.opened as f64)
    }

    pub fn agent_per_session(&self) -> Option<f64> {
        (self.opened > 0).then(|| self.agent_growth as f64 / self.opened as f64)
    }
}

/// The tries of one event.
#[derive(Debug, Clone)]
pub struct EventFigures {
    pub event: Event,
    /// The stream's longest silence around each try that completed.
    pub gaps: Vec<Duration>,
    /// Tries that failed, and why.
    pub failures: Vec<String>,
    /// What became of a plain relay stream during the first try.
    pub plain: String,
    /// Every byte the resumable stream brought back was the one sent there.
    pub exact: bool,
}

/// An `otherix forward` to the guest and its local address.
struct Forward {
    proc: Proc,
    addr: SocketAddr,
}

/// Builds the testbed and measures.
pub fn run(bin: &Path, opts: &Options) -> anyhow::Result<Figures> {
    let load_before = loadavg();
    progress("building the testbed (two control-plane replicas on PostgreSQL, node1, node2)");
    let world = World::new("otherix-bench-resume").context("cannot make a testbed world (run as root)")?;
    let mut spec = ClusterSpec::new(bin);
    spec.hypervisors = 2;
    spec.gateways = 0;
    spec.replicas = 2;
    spec.postgres = true;
    // Production cadence, as the speed testbed has: on this shared machine
    // 1 s heartbeats against a 5 s timeout made nodes NotReady under load,
    // and migrations to them were refused.
    spec.heartbeat = Duration::from_secs(2);
    spec.node_timeout = Duration::from_secs(10);
    // Hundreds of sessions from one principal and one address, brokered as
    // fast as the client asks.
    spec.extra_server_args = [
        "--broker-rate",
        "0",
        "--max-connections-per-ip",
        "100000",
        "--max-connections",
        "100000",
        "--max-sessions-per-principal",
        "0",
    ]
    .map(String::from)
    .to_vec();
    let mut cluster = Cluster::start(world, spec).context("cannot start the cluster")?;
    cluster.cli_ok(&[
        "network", "create", NETWORK, "--type", "bridge", "--subnet", SUBNET, "--node", "node1", "--node",
        "node2",
    ])?;
    let (guest_ip, _, iperf_server) = crate::bed::guest(&cluster, VM, NETWORK, "bench=resume", true)?;
    let node1 = cluster.node("node1")?;
    let node1_ns = node1.ns.name().to_string();
    let agent_pid = node1.agent.as_ref().context("node1 has no agent")?.pid();

    let plain_echo = forward(&cluster, ECHO_PORT, Kind::Plain)?;
    let resumable_echo = forward(&cluster, ECHO_PORT, Kind::Resumable)?;
    progress("waiting until the guest answers through the relay");
    for f in [&plain_echo, &resumable_echo] {
        wait_until("the guest's echo to answer through the forward", WAIT, || {
            echo_once(f.addr).ok()
        })?;
    }

    progress("moving bytes with iperf3 (one stream, direct, plain and resumable)");
    let throughput = {
        let plain = forward(&cluster, IPERF_PORT, Kind::Plain)?;
        let resumable = forward(&cluster, IPERF_PORT, Kind::Resumable)?;
        let mut ways = vec![
            Way {
                name: "up (client to guest)",
                ..Way::default()
            },
            Way {
                name: "down (guest to client)",
                ..Way::default()
            },
        ];
        for round in 0..opts.resume_rounds {
            for (way, reverse) in ways.iter_mut().zip([false, true]) {
                let mut this = Round::default();
                for path in order(round) {
                    eprintln!(
                        "otherix-bench:   round {}/{}: {path}, {}",
                        round + 1,
                        opts.resume_rounds,
                        way.name
                    );
                    let (target, slot) = match path {
                        "direct" => (
                            (guest_ip.to_string(), IPERF_PORT, Some(node1_ns.as_str())),
                            &mut this.direct,
                        ),
                        "plain" => (("127.0.0.1".into(), plain.addr.port(), None), &mut this.plain),
                        _ => (
                            ("127.0.0.1".into(), resumable.addr.port(), None),
                            &mut this.resumable,
                        ),
                    };
                    match iperf(&target.0, target.1, target.2, reverse, opts.seconds) {
                        Ok(bps) => *slot = Some(bps),
                        Err(e) => way.failures.push(format!("round {}, {path}: {e:#}", round + 1)),
                    }
                }
                way.rounds.push(this);
            }
        }
        ways
    };
    // The guest migrates below: iperf3 ran beside its workload, unmanaged.
    drop(iperf_server);

    let mut memory = Vec::new();
    for (kind, fwd) in [(Kind::Plain, &plain_echo), (Kind::Resumable, &resumable_echo)] {
        progress(&format!(
            "opening {} idle {} relay sessions",
            opts.resume_sessions,
            name(kind)
        ));
        memory.push(idle_sessions(
            &cluster,
            fwd,
            kind,
            agent_pid,
            opts.resume_sessions,
        )?);
    }

    let mut events = Vec::new();
    let mut stream = EchoStream::start(resumable_echo.addr)?;
    for event in Event::ALL {
        progress(&format!(
            "resume gap: {}, {} tries",
            event.title(),
            opts.resume_tries
        ));
        let mut fig = EventFigures {
            event,
            gaps: Vec::new(),
            failures: Vec::new(),
            plain: "not measured".into(),
            exact: true,
        };
        let plain = EchoStream::start(plain_echo.addr);
        for i in 0..opts.resume_tries {
            let plain_on = plain.as_ref().ok().map(|p| (p, plain_echo.proc.pid()));
            let (result, plain_verdict) = try_once(
                &mut cluster,
                &stream,
                &resumable_echo,
                event,
                plain_on.filter(|_| i == 0),
            );
            if let Some(v) = plain_verdict {
                fig.plain = v;
            }
            match result {
                Ok(gap) => fig.gaps.push(gap),
                Err(e) => {
                    eprintln!("otherix-bench:   try {} failed: {e:#}", i + 1);
                    fig.failures.push(format!("try {}: {e:#}", i + 1));
                }
            }
            if let Some(why) = stream.broke() {
                fig.exact &= stream.exact();
                fig.failures.push(format!(
                    "the stream broke ({why}); the forward said: {}; a new stream goes on",
                    last_words(&resumable_echo)
                ));
                stream = EchoStream::start(resumable_echo.addr)?;
            }
            std::thread::sleep(BETWEEN);
        }
        if let Err(e) = &plain {
            fig.plain = format!("not measured: {e:#}");
        }
        fig.exact &= stream.exact();
        events.push(fig);
    }
    drop(stream);
    Ok(Figures {
        throughput,
        rounds: opts.resume_rounds,
        seconds: opts.seconds,
        memory,
        events,
        tries: opts.resume_tries,
        load: (load_before, loadavg()),
    })
}

/// The paths of one round in the order they run: direct first, then plain
/// and resumable, which of the two goes first alternating by round (a path
/// that always ran second would always meet what the first left behind).
fn order(round: usize) -> [&'static str; 3] {
    if round.is_multiple_of(2) {
        ["direct", "plain", "resumable"]
    } else {
        ["direct", "resumable", "plain"]
    }
}

fn name(kind: Kind) -> &'static str {
    match kind {
        Kind::Plain => "plain",
        Kind::Resumable => "resumable",
    }
}

/// `otherix forward VM PORT` in the host namespace, plain or resumable.
fn forward(cluster: &Cluster, port: u16, kind: Kind) -> anyhow::Result<Forward> {
    let config = cluster.config.to_string_lossy().into_owned();
    let port = port.to_string();
    let mut env = vec![("OTHERIX_CONFIG", config.as_str()), ("RUST_LOG", "info")];
    if kind == Kind::Plain {
        env.push(("OTHERIX_RELAY_RESUME", "off"));
    }
    let proc = cluster
        .world
        .spawn(None, &cluster.spec.bin, ["forward", VM, &port], &env)?;
    proc.wait_for_log("Forwarding", WAIT)?;
    let addr = proc
        .log()
        .lines()
        .find_map(|l| l.trim().parse::<SocketAddr>().ok())
        .with_context(|| format!("otherix forward {VM} {port} printed no local address"))?;
    Ok(Forward { proc, addr })
}

/// A connection through the forward that has echoed one byte.
fn echo_once(addr: SocketAddr) -> anyhow::Result<TcpStream> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(20)))?;
    s.write_all(b"x")?;
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    if &b != b"x" {
        bail!("the echo answered {b:?}");
    }
    Ok(s)
}

/// iperf3's one-stream receiver-side rate to `host:port` (from the
/// namespace `ns`, or the host's), `-R` with `reverse`.
fn iperf(host: &str, port: u16, ns: Option<&str>, reverse: bool, seconds: u64) -> anyhow::Result<f64> {
    let (port, secs) = (port.to_string(), seconds.to_string());
    let mut args = vec![
        "iperf3",
        "-c",
        host,
        "-p",
        &port,
        "-t",
        &secs,
        "-J",
        "--connect-timeout",
        "5000",
    ];
    if reverse {
        args.push("-R");
    }
    let mut cmd = match ns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).args(&args);
            c
        }
        None => {
            let mut c = Command::new(args[0]);
            c.args(&args[1..]);
            c
        }
    };
    let out = throughput::run_bounded(&mut cmd, Duration::from_secs(seconds) + IPERF_SLACK)?;
    Ok(throughput::parse_iperf(&out)?.0)
}

/// Opens `n` sessions through `fwd`, reads the memory of the replica that
/// carries them and of `node1`'s agent, closes them.
fn idle_sessions(
    cluster: &Cluster,
    fwd: &Forward,
    kind: Kind,
    agent_pid: u32,
    n: usize,
) -> anyhow::Result<SessionMemory> {
    // Warm-up: the first sessions build lazily made state.
    drop(open_idle(fwd.addr, 16));
    std::thread::sleep(SETTLE);
    let cp_rss = |cluster: &Cluster| -> Vec<u64> {
        cluster
            .cps
            .iter()
            .map(|c| {
                c.proc
                    .as_ref()
                    .and_then(|p| procfs::rss_bytes(p.pid()).ok())
                    .unwrap_or(0)
            })
            .collect()
    };
    let cp_before = cp_rss(cluster);
    let agent_before = procfs::rss_bytes(agent_pid)?;
    let (conns, first_error) = open_idle(fwd.addr, n);
    std::thread::sleep(SETTLE);
    let cp_idle = cp_rss(cluster);
    let agent_idle = procfs::rss_bytes(agent_pid)?;
    let replica = carrier(cluster, fwd.proc.pid()).unwrap_or(0);
    let opened = conns.len();
    drop(conns);
    std::thread::sleep(SETTLE);
    Ok(SessionMemory {
        kind,
        requested: n,
        opened,
        first_error,
        replica: cluster.cps[replica].name.clone(),
        cp_growth: cp_idle[replica] as i64 - cp_before[replica] as i64,
        agent_growth: agent_idle as i64 - agent_before as i64,
    })
}

/// Up to `n` connections through the forward at `addr`, each having echoed
/// a byte, opened [`OPENERS`] at a time; and the first failure's reason.
fn open_idle(addr: SocketAddr, n: usize) -> (Vec<TcpStream>, Option<String>) {
    let results: Vec<anyhow::Result<TcpStream>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..OPENERS)
            .map(|w| {
                s.spawn(move || {
                    (w..n)
                        .step_by(OPENERS)
                        .map(|_| echo_once(addr))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap_or_default())
            .collect()
    });
    let mut first_error = None;
    let conns = results
        .into_iter()
        .filter_map(|r| {
            r.map_err(|e| first_error.get_or_insert(format!("{e:#}")).clone())
                .ok()
        })
        .collect();
    (conns, first_error)
}

/// The replica (index into `cluster.cps`) the process `pid` in the host
/// namespace holds the most connections to.
fn carrier(cluster: &Cluster, pid: u32) -> Option<usize> {
    let out = Command::new("ss")
        .args(["-tnpH", "state", "established"])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let owner = format!("pid={pid},");
    let counts: Vec<usize> = cluster
        .cps
        .iter()
        .map(|cp| {
            let peer = format!("{}:{CP_PORT}", cp.ns.ip());
            text.lines()
                .filter(|l| l.contains(&owner) && l.split_whitespace().nth(3) == Some(peer.as_str()))
                .count()
        })
        .collect();
    let (best, most) = counts.iter().enumerate().max_by_key(|(_, c)| **c)?;
    (*most > 0).then_some(best)
}

/// The client's resumes so far, by its words on stderr.
fn resumes(fwd: &Forward) -> usize {
    fwd.proc.log().matches("relay: resumed").count()
}

/// One try of `event` under the running `stream` through `fwd`: the
/// stream's longest silence from the event until its backlog came back.
/// With `plain` (a plain stream and its forward's pid), also what became
/// of that stream.
fn try_once(
    cluster: &mut Cluster,
    stream: &EchoStream,
    fwd: &Forward,
    event: Event,
    plain: Option<(&EchoStream, u32)>,
) -> (anyhow::Result<Duration>, Option<String>) {
    let mut killed = None;
    let mut plain_verdict = None;
    let result = (|| -> anyhow::Result<Duration> {
        stream.drain(WAIT).context("before the event")?;
        let before = resumes(fwd);
        let from = Instant::now();
        match event {
            Event::Dropped => {
                // Once in a while `ss -K` finds none of the forward's
                // connections (seen on the first try after the idle
                // sessions closed): again until it has killed one.
                let mut killed = 0;
                for _ in 0..20 {
                    killed = kill_client_connections(cluster, fwd.proc.pid())?;
                    if killed > 0 {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                if killed == 0 {
                    bail!("ss -K found no connection of the forward to a replica");
                }
            }
            Event::Failover => {
                let r = carrier(cluster, fwd.proc.pid())
                    .context("the forward holds no connection to a replica")?;
                if let Some((_, pid)) = plain {
                    if carrier(cluster, pid) != Some(r) {
                        plain_verdict = Some("not measured: not on the killed replica".to_string());
                    }
                }
                cluster.kill_replica(r)?;
                killed = Some(r);
            }
            Event::Migration => {
                // To the other node, wherever the last try left it.
                let on = cluster.cli_json(&["vm", "get", VM])?["node"].clone();
                let to = if on == "node1" { "node2" } else { "node1" };
                cluster.cli_ok(&["vm", "migrate", VM, "--to", to])?;
                wait_until(&format!("{VM} to run on {to}"), WAIT, || {
                    let vm = cluster.cli_json(&["vm", "get", VM]).ok()?;
                    (vm["node"] == to && vm["state"] == "running").then_some(())
                })?;
            }
        }
        let deadline = Instant::now() + WAIT;
        while resumes(fwd) <= before {
            if let Some(why) = stream.broke() {
                bail!("the stream broke: {why}");
            }
            if Instant::now() > deadline {
                bail!(
                    "the client did not resume within {WAIT:?}; the forward's last words: {}",
                    recent(fwd, 8)
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        stream.drain(WAIT).context("after the event")?;
        std::thread::sleep(TAIL);
        Ok(stream.take_gap(from, Instant::now()))
    })();
    if let (Some((p, _)), None) = (plain, &plain_verdict) {
        plain_verdict = Some(plain_fate(p));
    }
    if let Some(r) = killed {
        if let Err(e) = cluster.start_replica(r) {
            let why = format!("{r}: cannot start the replica again: {e}");
            return (Err(anyhow::anyhow!(why)), plain_verdict);
        }
    }
    (result, plain_verdict)
}

/// Whether a plain stream went on after the event.
fn plain_fate(p: &EchoStream) -> String {
    match p.drain(PLAIN_VERDICT) {
        Ok(()) => "survived".into(),
        Err(_) => match p.broke() {
            Some(why) => format!("ended ({why})"),
            None => format!("stalled (nothing came back for {}s)", PLAIN_VERDICT.as_secs()),
        },
    }
}

/// `ss -K` in the host namespace (where the forwards run): every TCP
/// connection to any replica's API port. How many of them were `pid`'s.
fn kill_client_connections(cluster: &Cluster, pid: u32) -> anyhow::Result<usize> {
    let owner = format!("pid={pid},");
    let mut killed = 0;
    for cp in &cluster.cps {
        let ip = cp.ns.ip().to_string();
        let port = CP_PORT.to_string();
        let out = Command::new("ss")
            .args(["-K", "-H", "-t", "-p", "dst", &ip, "dport", "=", &port])
            .output()
            .context("cannot run ss")?;
        if !out.status.success() {
            bail!("ss -K: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        killed += String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains(&owner))
            .count();
    }
    Ok(killed)
}

/// The forward's last `n` lines, one line.
fn recent(fwd: &Forward, n: usize) -> String {
    let log = fwd.proc.log();
    let lines: Vec<&str> = log.lines().collect();
    let last = lines[lines.len().saturating_sub(n)..].join(" | ");
    last.chars().take(1500).collect()
}

/// The forward's last lines about relay sessions ending or failing: why a
/// stream broke, in the report (the world's logs go with it).
fn last_words(fwd: &Forward) -> String {
    let log = fwd.proc.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| {
            ["relay session ended", "not resumed", "WARN", "ERROR"]
                .iter()
                .any(|w| l.contains(w))
                || l.starts_with("error")
        })
        .collect();
    let last = lines[lines.len().saturating_sub(2)..].join(" | ");
    if last.is_empty() {
        "nothing".into()
    } else {
        last.chars().take(600).collect()
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round(plain: f64, resumable: f64) -> Round {
        Round {
            direct: None,
            plain: Some(plain),
            resumable: Some(resumable),
        }
    }

    #[test]
    fn the_ratio_is_the_median_of_each_rounds_own_ratio() {
        // A slow spell in round 2 moved both paths: its ratio is 0.9 like
        // the others', where the best of each path would give 4.0 / 4.4.
        let way = Way {
            name: "up",
            rounds: vec![round(4.4, 3.96), round(3.0, 2.7), round(4.0, 3.6)],
            failures: vec![],
        };
        let r = way.ratio().unwrap();
        assert!((r - 0.9).abs() < 1e-9, "{r}");
        assert_eq!(way.rates(|r| r.plain), vec![4.4, 3.0, 4.0]);
    }

    #[test]
    fn a_round_missing_either_path_has_no_ratio_and_none_at_all_is_none() {
        let mut way = Way {
            name: "down",
            rounds: vec![
                Round {
                    plain: Some(4.0),
                    ..Round::default()
                },
                round(4.0, 3.0),
                round(4.0, 4.0),
            ],
            failures: vec![],
        };
        assert_eq!(way.ratios(), vec![0.75, 1.0]);
        assert_eq!(way.ratio(), Some(0.875));
        way.rounds.truncate(1);
        assert_eq!(way.ratio(), None);
    }

    #[test]
    fn median_of_odd_even_and_no_samples() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![f64::NAN]), None);
    }

    #[test]
    fn plain_and_resumable_take_turns_going_first() {
        assert_eq!(order(0), ["direct", "plain", "resumable"]);
        assert_eq!(order(1), ["direct", "resumable", "plain"]);
        assert_eq!(order(2), order(0));
    }
}
