//! The soak: a quiet phase, then one phase per attack, each measured the
//! same way while the attack runs:
//!
//! - heartbeats: the probe node's, timed by the bench (see [`crate::probe`]),
//!   and the agents' own, from their `otherix_agent_heartbeat_duration_seconds`
//!   histograms (the difference of two scrapes of their `/metrics`);
//! - connection setup to the guests' echo servers, as the Setup part times
//!   it: through the gateway with a credential brokered beforehand;
//!   counting the broker call on a kept-alive connection to the CP;
//!   counting a broker call on a new connection to the CP (TCP and TLS too:
//!   what a CLI run pays); and through the CP's relay to the bridge guest,
//!   broker call included — taken in turn, one every [`PACE`];
//! - every node's status, by `otherix node list -o json` every two seconds;
//! - open file descriptors, RSS and CPU of the control plane and each agent;
//! - what the attacker got: the servers' refusal counters, and its own tally.
//!
//! The attacks ([`Attack`]): slow clients against the CP's API port and the
//! gateway's port ([`crate::flood`]); half-open TLS handshakes against the
//! gateway (the same clients, of kinds `tcp` and `hello`); one enrolled node
//! looping its agent calls ([`crate::node_flood`]); one principal filling
//! the relay's replay cache ([`crate::relay_fill`]).
//!
//! The bed runs with the CP's and the gateway's default limits
//! ([`crate::bed::Purpose::Soak`]).

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use otherix_client::Client;
use otherix_testbed::cluster::{CP_PORT, GATEWAY_PORT};
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use crate::bed::{Bed, METRICS_PORT, RELAY_VM, VM};
use crate::flood::{Flood, Plan, Sources, Tally, Target};
use crate::node_flood::{NodeFlood, FLOOD_NODE};
use crate::options::{Attack, Options, SlowKind};
use crate::outcomes::Outcomes;
use crate::probe::Probe;
use crate::prom::{Histogram, Scrape};
use crate::relay_fill::{RelayFill, OPENED, REFUSED_429};
use crate::setup::{otherix_once, Latencies};
use crate::{procfs, progress, tools};

/// One connection setup every this long, the three kinds in turn.
pub const PACE: Duration = Duration::from_millis(50);
/// A setup taking longer than this failed.
const SETUP_TIMEOUT: Duration = Duration::from_secs(15);
/// The slow clients start spread over this long...
pub const RAMP: Duration = Duration::from_secs(10);
/// ...and the measuring starts this long after the last one started: past
/// the servers' 10 s deadlines, so that cuts and comebacks are under way.
pub const SETTLE: Duration = Duration::from_secs(15);
/// The half-open flood is measured this long after its last client
/// started: twice the gateway's 5 s handshake deadline.
pub const HALF_OPEN_SETTLE: Duration = Duration::from_secs(10);
/// The node flood is measured this long after it started: its burst is
/// spent by then (60 heartbeats, 30 waits, 10 certificates).
pub const NODE_FLOOD_SETTLE: Duration = Duration::from_secs(5);
/// The relay fill is measured once its principal's tickets are refused
/// (its share of the replay cache is full), or after this long anyway. A
/// used ticket is remembered for its 300 s life and 30 s of skew: a
/// principal that cannot fill its share in less never will.
pub const FILL_BUDGET: Duration = Duration::from_secs(240);
/// Time after the flood stopped before the processes are read again.
pub const AFTER: Duration = Duration::from_secs(15);
const NODE_CHECK_EVERY: Duration = Duration::from_secs(2);

/// The three ways a connection setup is timed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetupKind {
    /// Credential brokered before the timer starts.
    Gateway,
    /// Broker call on the bench's kept-alive connection to the CP.
    Broker,
    /// Broker call on a new connection to the CP.
    BrokerNewConnection,
    /// Through the CP's relay to the bridge guest, broker call (kept-alive
    /// connection) included.
    Relay,
}

impl SetupKind {
    pub const ALL: [SetupKind; 4] = [
        SetupKind::Gateway,
        SetupKind::Broker,
        SetupKind::BrokerNewConnection,
        SetupKind::Relay,
    ];
}

/// One process's figures over a phase.
#[derive(Debug, Clone, Default)]
pub struct ProcFigures {
    pub name: String,
    pub fds_end: u64,
    pub fds_max: u64,
    pub rss_end: u64,
    pub rss_max: u64,
    /// CPU time over the phase / wall time (1.0 = one core).
    pub cpu: f64,
    pub nofile_soft: u64,
}

/// Everything measured in one phase.
#[derive(Debug, Clone, Default)]
pub struct Phase {
    pub elapsed: Duration,
    /// The 1-minute load average at the phase's start and end: the
    /// machine is shared, and other builds show in the p99s.
    pub load: (String, String),
    pub probe: Latencies,
    pub probe_failed: usize,
    pub probe_first_error: Option<String>,
    /// The agents' heartbeats (all agents), from their histograms.
    pub agents: Histogram,
    pub agents_failed: u64,
    /// The CP's handler time of every node's heartbeats.
    pub cp_handler: Histogram,
    pub setup: Vec<(SetupKind, Latencies)>,
    pub setup_failed: Vec<(SetupKind, usize)>,
    pub setup_first_error: Option<String>,
    pub node_checks: usize,
    pub node_check_errors: usize,
    /// `(seconds into the phase, node)` for every NotReady seen.
    pub not_ready: Vec<(u64, String)>,
    pub procs: Vec<ProcFigures>,
    /// What the slow clients saw over the phase, per target and kind.
    pub flood: Vec<(&'static str, SlowKind, Tally)>,
    /// Slow-client connections open, per target: min, mean, max of
    /// once-a-second readings.
    pub flood_open: Vec<(&'static str, i64, f64, i64)>,
    /// The CP's refusals of connections over its caps, by reason.
    pub cp_refused: Vec<(String, f64)>,
    /// The gateway's refusals, by code (its answers, and the connections it
    /// closed before the handshake was done).
    pub gateway_refused: Vec<(String, f64)>,
    /// The CP's refusals of nodes' calls over their rate, by call.
    pub node_limited: Vec<(String, f64)>,
    /// The relay's refusals of tickets and sessions, by reason.
    pub relay_refused: Vec<(String, f64)>,
    /// The broker's refusals, by reason.
    pub broker_refused: Vec<(String, f64)>,
    /// What the node flood or the relay fill got, by outcome.
    pub attacker: BTreeMap<String, u64>,
}

impl Phase {
    pub fn setup(&self, kind: SetupKind) -> Latencies {
        self.setup
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, l)| l.clone())
            .unwrap_or_default()
    }

    pub fn failed(&self, kind: SetupKind) -> usize {
        self.setup_failed
            .iter()
            .find(|(k, _)| *k == kind)
            .map_or(0, |(_, n)| *n)
    }
}

#[derive(Debug, Clone)]
pub struct Soak {
    pub clients_per_target: usize,
    pub sources: usize,
    pub kinds: Vec<SlowKind>,
    pub interval: Duration,
    pub half_open_clients: usize,
    pub half_open_sources: usize,
    pub without: Phase,
    /// One per attack, in the order they ran.
    pub attacks: Vec<Attacked>,
    /// The control plane's command line (no cap flags: its defaults).
    pub cp_args: String,
}

/// One attack's phase and what followed it.
#[derive(Debug, Clone)]
pub struct Attacked {
    pub attack: Attack,
    /// How long the attack ran before the measuring started.
    pub lead: Duration,
    /// What the lead reached (the relay fill: when its share was full).
    pub lead_note: Option<String>,
    pub phase: Phase,
    /// The processes [`AFTER`] the attack stopped.
    pub after: Vec<ProcFigures>,
    /// Nodes not Ready once the attack stopped and [`AFTER`] passed.
    pub not_ready_after: Vec<String>,
}

/// An attack under way.
enum Running {
    /// Slow or half-open clients, from their source addresses.
    Flood(Flood, Sources),
    Node(NodeFlood),
    Relay(RelayFill),
}

impl Running {
    fn flood(&self) -> Option<&Flood> {
        match self {
            Running::Flood(f, _) => Some(f),
            _ => None,
        }
    }

    fn outcomes(&self) -> Option<&Outcomes> {
        match self {
            Running::Flood(..) => None,
            Running::Node(n) => Some(&n.outcomes),
            Running::Relay(r) => Some(&r.outcomes),
        }
    }

    fn stop(self) {
        match self {
            Running::Flood(f, sources) => {
                f.stop();
                drop(sources);
            }
            Running::Node(n) => n.stop(),
            Running::Relay(r) => r.stop(),
        }
    }
}

/// The processes watched: name and pid.
fn processes(bed: &Bed) -> Vec<(String, u32)> {
    vec![
        ("control plane".into(), bed.cp_pid),
        ("gw1 agent (gateway)".into(), bed.agent_pid),
        ("node1 agent".into(), bed.node_agent_pid),
        ("bench (slow clients, probes)".into(), std::process::id()),
    ]
}

pub fn run(bed: &Bed, rt: &tokio::runtime::Runtime, opts: &Options) -> anyhow::Result<Soak> {
    let world = bed.world();
    let probe = rt.block_on(Probe::start(bed, world.host_ip()))?;
    let token = std::fs::read_to_string(bed.cluster.cp_dir().join("admin.token"))?;
    let token = token.trim().to_string();
    bed.cluster
        .wait_ready(Duration::from_secs(60))
        .context("nodes not Ready before the soak")?;
    // Warm-up: the probe's and the setups' first calls build lazy state.
    rt.block_on(async {
        for kind in SetupKind::ALL {
            for _ in 0..5 {
                let _ = setup_once(bed, &token, kind).await;
            }
        }
    });

    progress(&format!("  measuring {} s quiet", opts.soak_time.as_secs()));
    let without = phase(bed, rt, opts, &probe, &token, None)?;

    let mut attacks = Vec::new();
    for attack in &opts.soak_attacks {
        let started = Instant::now();
        let (running, lead_note) = start_attack(bed, opts, *attack)?;
        let lead = started.elapsed();
        progress(&format!(
            "  measuring {} s under the {}{}",
            opts.soak_time.as_secs(),
            attack.title(),
            running
                .flood()
                .map(|f| format!(
                    " (open now: {})",
                    f.open()
                        .iter()
                        .map(|(t, n)| format!("{t} {n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
                .unwrap_or_default()
        ));
        let phase = phase(bed, rt, opts, &probe, &token, Some(&running))?;
        running.stop();
        if *attack == Attack::NodeFlood {
            // Gone, or it would be seen NotReady from now on.
            bed.cluster
                .cli_ok(&["node", "delete", FLOOD_NODE, "--force"])
                .context("deleting the flooding node")?;
        }
        progress(&format!(
            "  the {} stopped; reading the processes again",
            attack.title()
        ));
        std::thread::sleep(AFTER);
        attacks.push(Attacked {
            attack: *attack,
            lead,
            lead_note,
            phase,
            after: after_figures(bed),
            not_ready_after: bed
                .cluster
                .cli_json(&["node", "list"])
                .map(|nodes| not_ready(&nodes))
                .unwrap_or_else(|e| vec![format!("(node list failed: {e})")]),
        });
    }
    drop(probe);
    Ok(Soak {
        clients_per_target: opts.slow_clients,
        sources: opts.slow_sources,
        kinds: opts.slow_kinds.clone(),
        interval: opts.slow_interval,
        half_open_clients: opts.half_open_clients,
        half_open_sources: opts.half_open_sources,
        without,
        attacks,
        cp_args: std::fs::read(format!("/proc/{}/cmdline", bed.cp_pid))
            .map(|b| {
                b.split(|c| *c == 0)
                    .map(|a| String::from_utf8_lossy(a).into_owned())
                    .collect::<Vec<_>>()
                    .join(" ")
                    .trim()
                    .to_string()
            })
            .unwrap_or_default(),
    })
}

/// Starts `attack` and waits until it is in its stride: the running attack,
/// and what the wait reached when that is worth saying.
fn start_attack(bed: &Bed, opts: &Options, attack: Attack) -> anyhow::Result<(Running, Option<String>)> {
    let world = bed.world();
    match attack {
        Attack::SlowClients | Attack::HalfOpen => {
            let n = if attack == Attack::SlowClients {
                opts.slow_sources
            } else {
                opts.half_open_sources
            };
            let sources = Sources::add(&world.host_link(), world.subnet(), n)?;
            let (targets, plan, settle) = if attack == Attack::SlowClients {
                (
                    targets(bed),
                    Plan {
                        clients_per_target: opts.slow_clients,
                        kinds: opts.slow_kinds.clone(),
                        interval: opts.slow_interval,
                        ramp: RAMP,
                    },
                    SETTLE,
                )
            } else {
                (
                    targets(bed).into_iter().filter(|t| t.name == "gateway").collect(),
                    Plan {
                        clients_per_target: opts.half_open_clients,
                        kinds: vec![SlowKind::Tcp, SlowKind::Hello],
                        interval: opts.slow_interval,
                        ramp: RAMP,
                    },
                    HALF_OPEN_SETTLE,
                )
            };
            progress(&format!(
                "  starting the {}: {} clients against {}, from {} addresses",
                attack.title(),
                plan.clients_per_target,
                targets.iter().map(|t| t.name).collect::<Vec<_>>().join(" and "),
                n
            ));
            let flood = Flood::start(&targets, &plan, &sources.addrs, tls_connector(bed)?)?;
            std::thread::sleep(RAMP + settle);
            Ok((Running::Flood(flood, sources), None))
        }
        Attack::NodeFlood => {
            progress(&format!(
                "  starting the {}: node {FLOOD_NODE} enrolled, looping its calls",
                attack.title()
            ));
            let flood = NodeFlood::start(bed, world.host_ip())?;
            std::thread::sleep(NODE_FLOOD_SETTLE);
            Ok((Running::Node(flood), None))
        }
        Attack::RelayFill => {
            progress(&format!(
                "  starting the {}: user {} brokering and spending relay tickets, until the relay refuses them (at most {} s)",
                attack.title(),
                crate::relay_fill::FLOOD_USER,
                FILL_BUDGET.as_secs()
            ));
            let fill = RelayFill::start(bed)?;
            let started = Instant::now();
            while fill.outcomes.count(REFUSED_429) == 0 && started.elapsed() < FILL_BUDGET {
                std::thread::sleep(Duration::from_millis(200));
            }
            let spent = fill.outcomes.count(OPENED);
            let note = if fill.outcomes.count(REFUSED_429) > 0 {
                format!(
                    "its first relay refusal (429) came {:.0} s in, after {spent} tickets spent",
                    started.elapsed().as_secs_f64()
                )
            } else {
                format!(
                    "no relay refusal within {} s ({spent} tickets spent): measured before its share was full",
                    FILL_BUDGET.as_secs()
                )
            };
            progress(&format!("  {note}"));
            Ok((Running::Relay(fill), Some(note)))
        }
    }
}

/// The watched processes' descriptors and memory now.
fn after_figures(bed: &Bed) -> Vec<ProcFigures> {
    processes(bed)
        .into_iter()
        .map(|(name, pid)| ProcFigures {
            fds_end: tools::open_files(pid).unwrap_or(0),
            rss_end: procfs::rss_bytes(pid).unwrap_or(0),
            name,
            ..ProcFigures::default()
        })
        .collect()
}

/// The CP's API port and the gateway's port.
fn targets(bed: &Bed) -> Vec<Target> {
    let cp_ip = bed.cluster.cp_ns().ip();
    let gw_ip = bed.gw.ip();
    vec![
        Target {
            name: "control plane",
            addr: SocketAddr::V4(SocketAddrV4::new(cp_ip, CP_PORT)),
            server_name: otherix_tls::cp_server_name(),
            request_line: "POST /v1/agent/heartbeat",
            reads_bodies: true,
        },
        Target {
            name: "gateway",
            addr: SocketAddr::V4(SocketAddrV4::new(gw_ip, GATEWAY_PORT)),
            server_name: ServerName::IpAddress(std::net::IpAddr::V4(gw_ip).into()),
            request_line: "GET /v1/connect",
            reads_bodies: false,
        },
    ]
}

fn tls_connector(bed: &Bed) -> anyhow::Result<TlsConnector> {
    let ca = otherix_tls::cert_from_pem(&bed.ca_pem).map_err(anyhow::Error::msg)?;
    let config = otherix_tls::pinned_client_config(ca).map_err(anyhow::Error::msg)?;
    Ok(TlsConnector::from(Arc::new(config)))
}

async fn setup_once(bed: &Bed, token: &str, kind: SetupKind) -> anyhow::Result<Duration> {
    match kind {
        SetupKind::Gateway => otherix_once(bed, &bed.client, VM, false).await,
        SetupKind::Broker => otherix_once(bed, &bed.client, VM, true).await,
        SetupKind::BrokerNewConnection => {
            // A client with no kept-alive connection: the broker call opens one.
            let fresh = Client::new(&bed.cluster.url, &bed.ca_pem, Some(token.to_string()))?;
            otherix_once(bed, &fresh, VM, true).await
        }
        SetupKind::Relay => otherix_once(bed, &bed.client, RELAY_VM, true).await,
    }
}

/// The metrics addresses: the CP's and each agent's, by name.
fn metrics_addrs(bed: &Bed) -> (SocketAddr, Vec<(String, SocketAddr)>) {
    let at = |ip: Ipv4Addr| SocketAddr::V4(SocketAddrV4::new(ip, METRICS_PORT));
    (
        at(bed.cluster.cp_ns().ip()),
        bed.cluster
            .nodes
            .iter()
            .map(|n| (n.name.clone(), at(n.ns.ip())))
            .collect(),
    )
}

/// Scrapes of the CP and of every agent.
struct Scrapes {
    cp: Scrape,
    agents: Vec<Scrape>,
}

fn scrape_all(bed: &Bed) -> anyhow::Result<Scrapes> {
    let (cp, agents) = metrics_addrs(bed);
    Ok(Scrapes {
        cp: scrape(cp).context("the control plane's /metrics")?,
        agents: agents
            .iter()
            .map(|(name, addr)| scrape(*addr).with_context(|| format!("{name}'s /metrics")))
            .collect::<anyhow::Result<_>>()?,
    })
}

/// `GET /metrics` over plain HTTP/1.0 (the server closes after answering).
fn scrape(addr: SocketAddr) -> anyhow::Result<Scrape> {
    use std::io::{Read, Write};
    let mut tcp = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    tcp.write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())?;
    let mut text = String::new();
    tcp.read_to_string(&mut text)?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .context("no HTTP answer")?;
    Ok(Scrape::parse(body))
}

/// The 1-minute load average, as `/proc/loadavg` shows it.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// Every node in `nodes` (`node list -o json`) whose status is not Ready.
fn not_ready(nodes: &serde_json::Value) -> Vec<String> {
    nodes
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|n| n["status"] != "Ready")
                .map(|n| n["name"].as_str().unwrap_or("?").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// What the watcher thread saw.
#[derive(Default)]
struct Watched {
    fds_max: Vec<u64>,
    rss_max: Vec<u64>,
    node_checks: usize,
    node_check_errors: usize,
    not_ready: Vec<(u64, String)>,
    open: Vec<Vec<(&'static str, i64)>>,
}

/// One phase: at least `opts.soak_time` of setups, with the probe beating,
/// the nodes and processes watched, and the metrics scraped at both ends.
fn phase(
    bed: &Bed,
    rt: &tokio::runtime::Runtime,
    opts: &Options,
    probe: &Probe,
    token: &str,
    running: Option<&Running>,
) -> anyhow::Result<Phase> {
    let flood = running.and_then(Running::flood);
    let attacker = running.and_then(Running::outcomes);
    let procs = processes(bed);
    let before = scrape_all(bed)?;
    let flood_before = flood.map(Flood::tally).unwrap_or_default();
    let attacker_before = attacker.map(Outcomes::snapshot).unwrap_or_default();
    let cpu_before: Vec<f64> = procs
        .iter()
        .map(|(_, pid)| procfs::cpu_seconds(*pid, false).unwrap_or(0.0))
        .collect();
    let load_before = load_average();
    let started = Instant::now();
    let stop = AtomicBool::new(false);

    let (timed, watched) = std::thread::scope(|s| {
        let watcher = s.spawn(|| watch(bed, &procs, flood, &stop, started));
        let timed = rt.block_on(setups(bed, token, opts.soak_time));
        stop.store(true, Ordering::Relaxed);
        let watched = watcher.join().unwrap_or_default();
        (timed, watched)
    });
    let ended = Instant::now();
    let elapsed = ended - started;
    let after = scrape_all(bed)?;
    let attacker = attacker
        .map(|a| crate::outcomes::since(&a.snapshot(), &attacker_before))
        .unwrap_or_default();

    let beats = probe.between(started, ended);
    let probe_ok: Vec<Duration> = beats
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok().copied())
        .collect();
    let probe_first_error = beats.iter().find_map(|(_, r)| r.as_ref().err().cloned());

    let agents_hist = |s: &Scrapes| {
        s.agents
            .iter()
            .map(|a| a.histogram("otherix_agent_heartbeat_duration_seconds"))
            .collect::<Vec<_>>()
    };
    let agents = merge(
        agents_hist(&after)
            .iter()
            .zip(agents_hist(&before).iter())
            .map(|(a, b)| a.since(b)),
    );
    let failed = |s: &Scrapes| -> f64 {
        s.agents
            .iter()
            .map(|a| a.sum("otherix_agent_heartbeats_total", &[r#"result="failed""#]))
            .sum()
    };
    let delta_by = |name: &str, key: &str, a: &Scrape, b: &Scrape| delta_where(name, key, &[], a, b);
    let gw_index = bed
        .cluster
        .nodes
        .iter()
        .position(|n| n.name == "gw1")
        .context("no gw1")?;

    let procs = procs
        .iter()
        .enumerate()
        .map(|(i, (name, pid))| ProcFigures {
            name: name.clone(),
            fds_end: tools::open_files(*pid).unwrap_or(0),
            fds_max: watched.fds_max.get(i).copied().unwrap_or(0),
            rss_end: procfs::rss_bytes(*pid).unwrap_or(0),
            rss_max: watched.rss_max.get(i).copied().unwrap_or(0),
            cpu: (procfs::cpu_seconds(*pid, false).unwrap_or(0.0) - cpu_before[i]) / elapsed.as_secs_f64(),
            nofile_soft: tools::nofile_limits(*pid).map_or(0, |(soft, _)| soft),
        })
        .collect();

    let flood_tally = flood
        .map(|f| {
            f.tally()
                .into_iter()
                .map(|(t, k, now)| {
                    let was = flood_before
                        .iter()
                        .find(|(bt, bk, _)| *bt == t && *bk == k)
                        .map(|(_, _, b)| b.clone())
                        .unwrap_or_default();
                    (t, k, now.since(&was))
                })
                .collect()
        })
        .unwrap_or_default();
    let flood_open = open_summary(&watched.open);

    let (setup, setup_failed, setup_first_error) = timed;
    Ok(Phase {
        elapsed,
        load: (load_before, load_average()),
        probe_failed: beats.len() - probe_ok.len(),
        probe: Latencies::new(probe_ok),
        probe_first_error,
        agents,
        agents_failed: (failed(&after) - failed(&before)).max(0.0) as u64,
        cp_handler: after
            .cp
            .histogram("otherix_heartbeat_duration_seconds")
            .since(&before.cp.histogram("otherix_heartbeat_duration_seconds")),
        setup,
        setup_failed,
        setup_first_error,
        node_checks: watched.node_checks,
        node_check_errors: watched.node_check_errors,
        not_ready: watched.not_ready,
        procs,
        flood: flood_tally,
        flood_open,
        cp_refused: delta_by(
            "otherix_connections_refused_total",
            "reason",
            &after.cp,
            &before.cp,
        ),
        gateway_refused: {
            let (a, b) = (&after.agents[gw_index], &before.agents[gw_index]);
            let mut refused = delta_by("otherix_gateway_refused_total", "reason", a, b);
            refused.extend(delta_where(
                "otherix_ingress_connections_refused_total",
                "reason",
                &[r#"server="gateway""#],
                a,
                b,
            ));
            let tls = "otherix_gateway_tls_handshake_failures_total";
            let failed = a.sum(tls, &[]) - b.sum(tls, &[]);
            if failed > 0.0 {
                refused.push(("tls_handshake_failed".into(), failed));
            }
            refused
        },
        node_limited: delta_by("otherix_node_calls_limited_total", "call", &after.cp, &before.cp),
        relay_refused: delta_by("otherix_relay_refused_total", "reason", &after.cp, &before.cp),
        broker_refused: delta_where(
            "otherix_broker_decisions_total",
            "reason",
            &[r#"outcome="refused""#],
            &after.cp,
            &before.cp,
        ),
        attacker,
    })
}

/// Per value of label `key`, how much `name` (over the series having every
/// one of `having`) grew from scrape `b` to scrape `a`; values that did not
/// grow are left out.
fn delta_where(name: &str, key: &str, having: &[&str], a: &Scrape, b: &Scrape) -> Vec<(String, f64)> {
    let was = b.by_label_where(name, key, having);
    a.by_label_where(name, key, having)
        .into_iter()
        .map(|(k, v)| {
            let before = was.iter().find(|(bk, _)| *bk == k).map_or(0.0, |(_, bv)| *bv);
            (k, v - before)
        })
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

type SetupResults = (
    Vec<(SetupKind, Latencies)>,
    Vec<(SetupKind, usize)>,
    Option<String>,
);

/// Connection setups, the kinds in turn, one per [`PACE`], for `time`;
/// failures counted, not fatal.
async fn setups(bed: &Bed, token: &str, time: Duration) -> SetupResults {
    let deadline = Instant::now() + time;
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); SetupKind::ALL.len()];
    let mut failed = vec![0usize; SetupKind::ALL.len()];
    let mut first_error = None;
    let mut i = 0;
    while Instant::now() < deadline {
        let k = i % SetupKind::ALL.len();
        let next = Instant::now() + PACE;
        match tokio::time::timeout(SETUP_TIMEOUT, setup_once(bed, token, SetupKind::ALL[k])).await {
            Ok(Ok(took)) => samples[k].push(took),
            Ok(Err(e)) => {
                failed[k] += 1;
                first_error.get_or_insert_with(|| format!("{e:#}"));
            }
            Err(_) => {
                failed[k] += 1;
                first_error.get_or_insert_with(|| format!("no setup within {SETUP_TIMEOUT:?}"));
            }
        }
        tokio::time::sleep_until(next.max(Instant::now()).into()).await;
        i += 1;
    }
    (
        SetupKind::ALL
            .iter()
            .zip(samples)
            .map(|(k, s)| (*k, Latencies::new(s)))
            .collect(),
        SetupKind::ALL.iter().copied().zip(failed).collect(),
        first_error,
    )
}

/// Once a second: the processes' descriptors and memory and the flood's
/// open connections; every [`NODE_CHECK_EVERY`], `otherix node list`.
fn watch(
    bed: &Bed,
    procs: &[(String, u32)],
    flood: Option<&Flood>,
    stop: &AtomicBool,
    started: Instant,
) -> Watched {
    let mut w = Watched {
        fds_max: vec![0; procs.len()],
        rss_max: vec![0; procs.len()],
        ..Watched::default()
    };
    let mut next_check = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for (i, (_, pid)) in procs.iter().enumerate() {
            w.fds_max[i] = w.fds_max[i].max(tools::open_files(*pid).unwrap_or(0));
            w.rss_max[i] = w.rss_max[i].max(procfs::rss_bytes(*pid).unwrap_or(0));
        }
        if let Some(f) = flood {
            w.open.push(f.open());
        }
        if Instant::now() >= next_check {
            next_check += NODE_CHECK_EVERY;
            w.node_checks += 1;
            match bed.cluster.cli_json(&["node", "list"]) {
                Ok(nodes) => {
                    let at = started.elapsed().as_secs();
                    // The flooding node is the attacker, not a victim.
                    w.not_ready.extend(
                        not_ready(&nodes)
                            .into_iter()
                            .filter(|n| n != FLOOD_NODE)
                            .map(|n| (at, n)),
                    );
                }
                Err(_) => w.node_check_errors += 1,
            }
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    w
}

/// Per target: min, mean and max of the readings.
fn open_summary(readings: &[Vec<(&'static str, i64)>]) -> Vec<(&'static str, i64, f64, i64)> {
    let mut out: Vec<(&'static str, Vec<i64>)> = Vec::new();
    for reading in readings {
        for (t, n) in reading {
            match out.iter_mut().find(|(name, _)| name == t) {
                Some((_, v)) => v.push(*n),
                None => out.push((t, vec![*n])),
            }
        }
    }
    out.into_iter()
        .map(|(t, v)| {
            let min = v.iter().copied().min().unwrap_or(0);
            let max = v.iter().copied().max().unwrap_or(0);
            let mean = v.iter().sum::<i64>() as f64 / v.len().max(1) as f64;
            (t, min, mean, max)
        })
        .collect()
}

/// One histogram of several with the same buckets.
fn merge(hists: impl Iterator<Item = Histogram>) -> Histogram {
    hists.fold(Histogram::default(), |acc, h| acc.plus(&h))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_other_than_ready_are_named() {
        let nodes = serde_json::json!([
            {"name": "node1", "status": "Ready"},
            {"name": "gw1", "status": "NotReady"},
        ]);
        assert_eq!(not_ready(&nodes), vec!["gw1".to_string()]);
        assert!(not_ready(&serde_json::json!({"error": {}})).is_empty());
    }

    #[test]
    fn open_connections_are_summarized_per_target() {
        let readings = vec![
            vec![("control plane", 10), ("gateway", 4)],
            vec![("control plane", 20), ("gateway", 6)],
        ];
        assert_eq!(
            open_summary(&readings),
            vec![("control plane", 10, 15.0, 20), ("gateway", 4, 5.0, 6)]
        );
    }
}
