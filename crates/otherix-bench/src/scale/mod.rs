//! The scale benchmark (issue #14): a real `otherix server` on 127.0.0.1
//! and, per row, hundreds of simulated nodes in this process speaking the
//! real enrollment and mutual-TLS heartbeat protocol, with thousands of
//! VMs and LBs. Per row, in order, each phase bounded:
//!
//! 1. a fresh control plane (own data directory, `--broker-rate 0`, the
//!    connection caps lifted: every node connects from 127.0.0.1);
//! 2. the overlays; every node enrolls with its own bound join token; then
//!    most of the VMs, each on a hypervisor named in turn (`vm create
//!    --node`), before any node heartbeats (created with the nodes live,
//!    10,000 VMs would take the current code hours; left to the scheduler,
//!    they would go to the first few nodes to heartbeat);
//! 3. every node starts the agent's heartbeat loop ([`fleet`]); the bench
//!    waits until every VM is reported running;
//! 4. the LBs (the LB create rate; then the wait until their health
//!    checks are at every node), then the rest of the VMs while every node
//!    heartbeats: the VM create rate;
//! 5. a settle time, then the steady-state window: the CP's own CPU-seconds
//!    (`/proc/PID/stat`) over the heartbeats answered in it;
//! 6. concurrent broker calls for random VMs while the heartbeats go on;
//! 7. one `GET /v1/vms` (`vm list`), the CP's RSS, and `GET /v1/nodes` as
//!    watched from step 4 on (NotReady nodes).
//!
//! The CP's CPU is its own CPU-seconds, not the machine's: the machine is
//! shared, and the simulated nodes run on the same two cores.

pub mod figures;
pub mod fleet;
pub mod load;
pub mod node;
pub mod plan;
pub mod server;

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use otherix_client::Client;
use otherix_proto::agent::Heartbeat;
use otherix_testbed::fake_node;

use crate::options::Options;
use crate::progress;
use crate::{procfs, tools};
use figures::{core_share, net_of, per_event, summarize, BeatSummary};
use fleet::{Fleet, HEARTBEAT_TIMEOUT};
use load::{Batch, BrokerLoad, Guard, NodeWatch};
use plan::{thousands, NodeSpec, Plan, Row};
use server::Server;

/// The CP's `--node-timeout`: a node silent this long is NotReady.
pub const NODE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time between two `GET /v1/nodes` of the NotReady watch.
const NODE_WATCH_PAUSE: Duration = Duration::from_secs(2);

/// What the scale part is told (from the command line).
#[derive(Debug, Clone)]
pub struct Settings {
    pub rows: Vec<Row>,
    /// Simulated nodes that ignore digests and take the whole state this
    /// often (`None`: as the agent).
    pub whole_state_every: Option<Duration>,
    pub interval: Duration,
    pub window: Duration,
    pub settle: Duration,
    /// Longest any one phase (creating, enrolling, placing) may take.
    pub budget: Duration,
    pub gateways: usize,
    pub vms_per_network: usize,
    pub live_vms: Option<usize>,
    /// VMs per request for the live creates (1: one by one).
    pub live_batch: usize,
    /// Requests in flight for the live creates.
    pub live_in_flight: usize,
    pub max_rss: u64,
    pub broker_time: Duration,
    pub broker_concurrency: usize,
    /// Caller processes the broker calls are spread over (0: this process).
    pub broker_processes: usize,
    /// Keep each row's control plane and nodes going this long after it is
    /// measured (to attach a profiler).
    pub hold: Duration,
    /// The store on PostgreSQL (a server of the bench's own), not SQLite.
    pub postgres: bool,
    /// Control-plane replicas on that PostgreSQL (1: one control plane).
    pub replicas: usize,
}

/// The steady-state window of a row.
#[derive(Debug, Clone, Default)]
pub struct Steady {
    pub elapsed: Duration,
    /// The CP's CPU-seconds in the window.
    pub cp_cpu: f64,
    /// This process's (the simulated nodes') CPU-seconds in the window.
    pub bench_cpu: f64,
    pub beats: BeatSummary,
    /// Heartbeats per second the nodes would make with instant answers.
    pub expected_rate: f64,
    /// Nodes that had no answer for longer than the CP's node timeout at
    /// some moment of the window (as the nodes saw it).
    pub silent: usize,
}

impl Steady {
    pub fn cpu_per_heartbeat(&self) -> Option<Duration> {
        per_event(self.cp_cpu, self.beats.answered)
    }

    pub fn cp_share(&self) -> f64 {
        core_share(self.cp_cpu, self.elapsed)
    }

    pub fn served_rate(&self) -> f64 {
        if self.elapsed.is_zero() {
            0.0
        } else {
            self.beats.answered as f64 / self.elapsed.as_secs_f64()
        }
    }
}

/// The broker phase of a row.
#[derive(Debug, Clone, Default)]
pub struct Brokered {
    pub load: BrokerLoad,
    /// The CP's CPU-seconds over the phase (heartbeats went on meanwhile).
    pub cp_cpu: f64,
    /// The same less what the heartbeats answered meanwhile cost at the
    /// steady state's CPU per heartbeat.
    pub cp_cpu_net: f64,
    /// The bench's CPU-seconds over the phase: the nodes, and the callers
    /// in this process or in caller processes.
    pub bench_cpu: f64,
    /// The heartbeats that ran meanwhile.
    pub beats: BeatSummary,
}

impl Brokered {
    pub fn per_second(&self) -> f64 {
        if self.load.elapsed.is_zero() {
            0.0
        } else {
            self.load.credentials as f64 / self.load.elapsed.as_secs_f64()
        }
    }
}

/// `kill -9` of one replica: how long its nodes went without an answer.
#[derive(Debug, Clone, Default)]
pub struct Failover {
    /// Nodes that heartbeat to the killed replica.
    pub nodes: usize,
    /// Per node that heartbeat elsewhere: from the kill to the end of its
    /// first answered heartbeat begun after it.
    /// (Nodes without one are not in it: none within [`FAILOVER_BOUND`].)
    pub gaps: crate::setup::Latencies,
}

/// How long the bench waits for the killed replica's nodes to be answered elsewhere.
pub const FAILOVER_BOUND: Duration = Duration::from_secs(60);

/// Everything one row measured, and how far it got.
#[derive(Debug, Clone, Default)]
pub struct RowResult {
    pub row: Row,
    /// Set when the row could not be measured at all.
    pub error: Option<String>,
    pub networks: Batch,
    /// VMs created on named hypervisors before any node heartbeated.
    pub bulk: Batch,
    pub enroll: Batch,
    /// From the fleet's start until every node had an answer and every
    /// VM was placed and reported running (or the bound).
    pub placing: Duration,
    /// LBs created while every node heartbeats: the LB create rate.
    pub lbs: Batch,
    /// VMs created while every node heartbeats: the VM create rate.
    pub live: Batch,
    /// From the last LB create's answer until every VM created so far had
    /// its health check at its node (`None`: no LBs, or not within the
    /// phase's budget). The VM creates begin after it, so that what the
    /// LBs left to deliver is not counted against them.
    pub lb_checks: Option<Duration>,
    /// From the last LB create's answer until every one of those checks'
    /// first verdicts was acknowledged by the CP (the node's heartbeat
    /// that carried it answered). The VM creates begin after this.
    pub lb_verdicts: Option<Duration>,
    /// The CP's CPU-seconds over the live LB creates (until their health
    /// checks were at every node and their first verdicts written) and
    /// over the live VM creates (heartbeats answered meanwhile included).
    pub lbs_cpu: f64,
    pub live_cpu: f64,
    /// VMs placed / reported running when the measuring began.
    pub placed: usize,
    pub running: usize,
    /// Health checks handed out to the nodes when the measuring began.
    pub checks: usize,
    pub steady: Option<Steady>,
    /// Through one control plane (the first replica, when there are several).
    pub broker: Option<Brokered>,
    /// With replicas: the same load through every replica at once.
    pub broker_all: Option<Brokered>,
    /// With replicas: the first one killed at the end.
    pub failover: Option<Failover>,
    /// Control-plane replicas of the row.
    pub replicas: usize,
    /// `GET /v1/vms`: how long, and how many VMs it listed.
    pub vm_list: Option<Result<(Duration, usize), String>>,
    pub nodes_watch: NodeWatch,
    /// From the settle time's start to the broker phase's end: what the
    /// table's NotReady column counts (the watch began earlier, when the
    /// first VMs ran).
    pub measured: Option<(Instant, Instant)>,
    pub rss_end: u64,
    pub rss_peak: u64,
    /// Bytes of one desired state (re-serialized): a hypervisor's and a gateway's.
    pub desired_bytes: (Option<usize>, Option<usize>),
    pub wakes: (u64, u64, u64),
    pub first_heartbeat_error: Option<String>,
    /// Audit writes the CP logged as failed, by the end (its shutdown too).
    pub audit_failures: usize,
    pub load: (String, String),
    pub elapsed: Duration,
    /// What the row did not reach, for the table's last column.
    pub shortfalls: Vec<String>,
}

impl RowResult {
    /// VMs the CP holds: the bulk and live ones created.
    pub fn vms_created(&self) -> usize {
        self.bulk.done + self.live.done
    }
}

impl Settings {
    pub fn from_options(opts: &Options) -> Settings {
        Settings {
            rows: opts.scale_rows.clone(),
            interval: opts.scale_interval,
            window: opts.scale_window,
            settle: opts.scale_settle,
            budget: opts.scale_budget,
            gateways: opts.scale_gateways,
            vms_per_network: opts.scale_vms_per_network,
            live_vms: opts.scale_live_vms,
            whole_state_every: opts.scale_whole_state_every,
            live_batch: opts.scale_live_batch.max(1),
            live_in_flight: opts.scale_live_in_flight.max(1),
            max_rss: opts.scale_max_rss_mib << 20,
            broker_time: opts.broker_time,
            broker_concurrency: opts.broker_concurrency,
            broker_processes: opts.broker_processes,
            hold: opts.hold,
            postgres: opts.scale_postgres || opts.scale_replicas > 1,
            replicas: opts.scale_replicas.max(1),
        }
    }
}

/// What the scale part measured: its settings and every row.
#[derive(Debug, Clone)]
pub struct Scale {
    pub settings: Settings,
    pub rows: Vec<RowResult>,
}

/// Every row in turn, each against its own control plane.
pub fn run(bin: &Path, opts: &Options) -> anyhow::Result<Scale> {
    let settings = Settings::from_options(opts);
    // Checked before anything starts: a bad layout fails at once.
    let plans: Vec<Plan> = settings
        .rows
        .iter()
        .map(|row| {
            Plan::new(
                *row,
                settings.gateways,
                settings.vms_per_network,
                settings.live_vms,
            )
        })
        .collect::<anyhow::Result<_>>()?;
    // Two connections per node (heartbeat, wait), all from 127.0.0.1.
    tools::raise_nofile_limit(tools::NOFILE);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let mut results = Vec::new();
    for (i, plan) in plans.iter().enumerate() {
        progress(&format!(
            "scale row {} of {}: {} nodes, {} VMs, {} LBs",
            i + 1,
            plans.len(),
            thousands(plan.row.nodes as u64),
            thousands(plan.row.vms as u64),
            thousands(plan.row.lbs as u64)
        ));
        let started = Instant::now();
        let mut r = rt.block_on(row(bin, plan, &settings));
        r.elapsed = started.elapsed();
        progress(&format!(
            "  row done in {:.0} s: {}",
            r.elapsed.as_secs_f64(),
            if r.shortfalls.is_empty() {
                "every phase complete".to_string()
            } else {
                r.shortfalls.join("; ")
            }
        ));
        results.push(r);
    }
    Ok(Scale {
        settings,
        rows: results,
    })
}

/// The control plane's flags: no per-principal broker limit, and room for
/// every node's two connections from one address.
fn server_args() -> Vec<String> {
    [
        "--node-timeout",
        "10s",
        "--broker-rate",
        "0",
        "--max-sessions-per-principal",
        "0",
        "--max-connections",
        "100000",
        "--max-connections-per-ip",
        "100000",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

async fn row(bin: &Path, plan: &Plan, s: &Settings) -> RowResult {
    let mut r = RowResult {
        row: plan.row,
        load: (load_average(), String::new()),
        ..RowResult::default()
    };
    // PostgreSQL's own CPU and memory are not the CP's: they are not in
    // the row's CP figures.
    let mut args = server_args();
    let database = match s.postgres {
        false => None,
        true => match tokio::task::spawn_blocking(|| -> otherix_testbed::Result<_> {
            let pg = otherix_testbed::postgres::Postgres::start_temporary()?;
            let url = pg.create_database("otherix")?;
            Ok((pg, url))
        })
        .await
        {
            Ok(Ok((pg, url))) => {
                args.extend(["--database".to_string(), url]);
                Some(pg)
            }
            Ok(Err(e)) => {
                r.error = Some(format!("{e:#}"));
                r.shortfalls.push("PostgreSQL did not start".into());
                return r;
            }
            Err(e) => {
                r.error = Some(format!("{e:#}"));
                return r;
            }
        },
    };
    let mut servers: Vec<Server> = Vec::new();
    for i in 0..s.replicas {
        let mut args = args.clone();
        if i > 0 {
            // Every replica holds the first one's secret key.
            let key = servers[0].data_dir().join("secret.key");
            args.extend([
                "--secret-key-file".to_string(),
                key.to_string_lossy().into_owned(),
            ]);
        }
        match Server::start(bin, &args).await {
            Ok(mut server) => {
                if let Some(first) = servers.first() {
                    server.set_admin_token(first.admin_token());
                }
                servers.push(server)
            }
            Err(e) => {
                r.error = Some(format!("{e:#}"));
                r.shortfalls
                    .push(format!("control plane {} did not start", i + 1));
                return r;
            }
        }
    }
    r.replicas = servers.len();
    let result = measure(&mut servers, plan, s, &mut r).await;
    if let Err(e) = result {
        r.error = Some(format!("{e:#}"));
        r.shortfalls.push(format!("stopped: {e}"));
    }
    for server in &mut servers {
        server.stop();
        r.audit_failures += server.log_count("audit write failed");
    }
    r.load.1 = load_average();
    drop(servers);
    drop(database);
    r
}

/// The CPU-seconds of every control plane of the row.
fn cp_cpu(servers: &[Server]) -> anyhow::Result<f64> {
    Ok(servers
        .iter()
        .map(|s| procfs::cpu_seconds(s.pid, false))
        .sum::<std::io::Result<f64>>()?)
}

async fn measure(servers: &mut [Server], plan: &Plan, s: &Settings, r: &mut RowResult) -> anyhow::Result<()> {
    for server in servers.iter() {
        progress(&format!("  control plane pid {} at {}", server.pid, server.url));
    }
    let urls: Vec<String> = servers.iter().map(|s| s.url.clone()).collect();
    let server = &servers[0];
    let guard = Guard::new(server.pid, s.max_rss);
    let watchdog = AbortOnDrop(tokio::spawn(guard.clone().watch()));
    let admin = server.admin()?;
    let budget = || Instant::now() + s.budget;
    let row = plan.row;

    progress(&format!("  creating {} networks", plan.networks()));
    r.networks = load::networks(&admin, plan, budget(), &guard).await;
    if !r.networks.complete() {
        anyhow::bail!(
            "created {} of {} networks: {}",
            r.networks.done,
            r.networks.requested,
            r.networks.first_error.clone().unwrap_or_default()
        );
    }

    progress(&format!("  enrolling {} nodes", row.nodes));
    let specs = plan.nodes();
    let anonymous = server.anonymous()?;
    let (nodes, enroll) = fleet::enroll_all(
        &admin,
        &anonymous,
        &urls,
        &server.ca_pem,
        &specs,
        budget(),
        &guard,
    )
    .await;
    r.enroll = enroll;
    shortfall(r, "enrolled", "nodes", &r.enroll.clone());
    if nodes.is_empty() {
        anyhow::bail!(
            "no node enrolled: {}",
            r.enroll.first_error.clone().unwrap_or_default()
        );
    }

    // Spread evenly, as `vm create --node` places them: left to the
    // scheduler, they would all go to the first few nodes to heartbeat.
    let hypervisors: Vec<String> = nodes
        .iter()
        .filter(|n| !n.spec.gateway)
        .map(|n| n.spec.name.clone())
        .collect();
    progress(&format!(
        "  creating {} VMs on the {} hypervisors before they heartbeat",
        thousands(plan.bulk_vms() as u64),
        hypervisors.len()
    ));
    r.bulk = load::vms(
        &admin,
        plan,
        0..plan.bulk_vms(),
        Some(hypervisors),
        load::CREATE_CONCURRENCY,
        budget(),
        &guard,
    )
    .await;
    shortfall(r, "created", "VMs before the heartbeats", &r.bulk.clone());

    // Kept for the desired-state sizes at the end.
    let samples: Vec<(NodeSpec, Client)> = sample_nodes(&nodes);
    let fleet = Fleet::start(nodes, s.interval, s.whole_state_every);
    let tally = fleet.tally.clone();

    progress(&format!(
        "  {} nodes heartbeating every {:?}; waiting until every VM is placed and running",
        fleet.len(),
        s.interval
    ));
    let started = Instant::now();
    let want = r.bulk.done;
    let all_answered = until_saying(
        budget(),
        &guard,
        || fleet.answered_nodes() == fleet.len() && tally.running() >= want,
        || {
            Some(format!(
                "{} of {} VMs placed, {} running, {} of {} nodes answered",
                tally.placed(),
                want,
                tally.running(),
                fleet.answered_nodes(),
                fleet.len()
            ))
        },
    )
    .await;
    r.placing = started.elapsed();
    if !all_answered {
        r.shortfalls.push(format!(
            "placed {} of {} and {} running, {} of {} nodes answered, in {:.0} s",
            thousands(tally.placed() as u64),
            thousands(want as u64),
            thousands(tally.running() as u64),
            fleet.answered_nodes(),
            fleet.len(),
            r.placing.as_secs_f64()
        ));
    }

    // From here on: what an operator's `node list` shows.
    let stop_watch = Arc::new(AtomicBool::new(false));
    let watch = AbortOnDrop(tokio::spawn(load::watch_nodes(
        admin.clone(),
        NODE_WATCH_PAUSE,
        stop_watch.clone(),
    )));

    if row.lbs > 0 {
        progress(&format!("  creating {} LBs", thousands(row.lbs as u64)));
        let cpu0 = cp_cpu(servers)?;
        r.lbs = load::lbs(&admin, plan, budget(), &guard).await;
        // Every VM so far is in an LB: its check reaches its node with
        // the node's next heartbeat, or a wake.
        let (created, want) = (Instant::now(), r.bulk.done);
        r.lb_checks = reached(
            r,
            budget(),
            &guard,
            created,
            want,
            "health checks handed out",
            || tally.checks(),
        )
        .await;
        // Then each check's first verdict reported and written (a node
        // sends it at its next heartbeat): part of what an LB create costs,
        // not of the VM creates that follow.
        r.lb_verdicts = reached(
            r,
            budget(),
            &guard,
            created,
            want,
            "health checks' verdicts acknowledged",
            || tally.verdicts(),
        )
        .await;
        r.lbs_cpu = cp_cpu(servers)? - cpu0;
        shortfall(r, "created", "LBs", &r.lbs.clone());
    }
    progress(&format!(
        "  creating {} VMs while every node heartbeats",
        thousands(plan.live_vms as u64)
    ));
    let cpu0 = cp_cpu(servers)?;
    let live = plan.bulk_vms()..row.vms;
    r.live = match s.live_batch {
        1 => load::vms(&admin, plan, live, None, s.live_in_flight, budget(), &guard).await,
        n => load::vm_batches(&admin, plan, live, n, s.live_in_flight, budget(), &guard).await,
    };
    r.live_cpu = cp_cpu(servers)? - cpu0;
    shortfall(r, "created", "VMs with the nodes live", &r.live.clone());
    let want = r.vms_created();
    // Every VM in an LB gets a health check once its LBs are in desired states.
    let want_checks = if r.lbs.done > 0 { want } else { 0 };
    if !until(budget(), &guard, || {
        tally.running() >= want && tally.checks() >= want_checks
    })
    .await
    {
        r.shortfalls.push(format!(
            "{} of {} VMs running, {} of {} health checks handed out, after the live creates",
            thousands(tally.running() as u64),
            thousands(want as u64),
            thousands(tally.checks() as u64),
            thousands(want_checks as u64)
        ));
    }

    progress(&format!(
        "  settling {} s, then measuring {} s of steady state",
        s.settle.as_secs(),
        s.window.as_secs()
    ));
    let settle_from = Instant::now();
    sleep_guarded(s.settle, &guard).await;
    r.placed = tally.placed();
    r.running = tally.running();
    r.checks = tally.checks();
    let me = std::process::id();
    let (cp0, bench0, t0) = (cp_cpu(servers)?, procfs::cpu_seconds(me, false)?, Instant::now());
    sleep_guarded(s.window, &guard).await;
    let (cp1, bench1, t1) = (cp_cpu(servers)?, procfs::cpu_seconds(me, false)?, Instant::now());

    progress(&format!(
        "  brokering for {} s ({} calls in flight{}) while the nodes heartbeat",
        s.broker_time.as_secs(),
        s.broker_concurrency,
        match s.broker_processes {
            0 => " in this process".to_string(),
            n => format!(" from {n} caller processes"),
        }
    ));
    // The caller processes' CPU is counted once they have been waited for.
    let cpu_b0 = cp_cpu(servers)?;
    let bench_b0 = procfs::cpu_seconds(me, true)?;
    let b0 = Instant::now();
    let brokered = match s.broker_processes {
        0 => {
            load::broker(
                std::slice::from_ref(&admin),
                r.vms_created(),
                s.broker_concurrency,
                s.broker_time,
                &guard,
            )
            .await
        }
        n => {
            load::broker_from_processes(server, r.vms_created(), s.broker_concurrency, n, s.broker_time).await
        }
    };
    let b1 = Instant::now();
    let cpu_b = cp_cpu(servers)? - cpu_b0;
    let bench_b = procfs::cpu_seconds(me, true)? - bench_b0;
    // With replicas, the same load once more through every one of them.
    let all = if servers.len() > 1 {
        progress(&format!(
            "  brokering for {} s through all {} replicas",
            s.broker_time.as_secs(),
            servers.len()
        ));
        let admins = servers
            .iter()
            .map(Server::admin)
            .collect::<anyhow::Result<Vec<_>>>()?;
        let (cpu0, bench0, t0) = (cp_cpu(servers)?, procfs::cpu_seconds(me, false)?, Instant::now());
        let load = load::broker(
            &admins,
            r.vms_created(),
            s.broker_concurrency,
            s.broker_time,
            &guard,
        )
        .await;
        let t1 = Instant::now();
        Some((
            load,
            cp_cpu(servers)? - cpu0,
            procfs::cpu_seconds(me, false)? - bench0,
            t0,
            t1,
        ))
    } else {
        None
    };
    let measured_end = all.as_ref().map_or(b1, |a| a.4);
    r.measured = Some((settle_from, measured_end));
    stop_watch.store(true, std::sync::atomic::Ordering::Relaxed);

    progress("  timing `vm list`");
    let t = Instant::now();
    r.vm_list = Some(
        match tokio::time::timeout(Duration::from_secs(120), admin.list_vms(None)).await {
            Ok(Ok(vms)) => Ok((t.elapsed(), vms.len())),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("no answer within 120 s".into()),
        },
    );
    r.rss_end = procfs::rss_bytes(server.pid).unwrap_or(0);
    r.rss_peak = guard.peak_rss().max(peak_rss(server.pid).unwrap_or(0));
    if let Some(why) = guard.tripped() {
        r.shortfalls.push(why.to_string());
    }
    r.nodes_watch = tokio::time::timeout(Duration::from_secs(130), watch.take())
        .await
        .ok()
        .and_then(Result::ok)
        .unwrap_or_default();

    // Heartbeats started in the windows have ended (or timed out) by now.
    until(measured_end + HEARTBEAT_TIMEOUT, &guard, || false).await;
    let beats = tally.beats();
    let steady = Steady {
        elapsed: t1 - t0,
        cp_cpu: cp1 - cp0,
        bench_cpu: bench1 - bench0,
        beats: summarize(&beats, t0, t1),
        expected_rate: figures::expected_rate(fleet.len(), s.interval),
        silent: figures::silent_nodes(&beats, fleet.len(), NODE_TIMEOUT, t0, t1).len(),
    };
    judge(r, &steady);
    if let Some((load, cpu, bench, t0, t1)) = all {
        let beats = summarize(&beats, t0, t1);
        r.broker_all = Some(Brokered {
            cp_cpu: cpu,
            cp_cpu_net: net_of(cpu, steady.cpu_per_heartbeat(), beats.answered),
            bench_cpu: bench,
            beats,
            load,
        });
    }
    let beats_b = summarize(&beats, b0, b1);
    r.broker = Some(Brokered {
        cp_cpu: cpu_b,
        cp_cpu_net: net_of(cpu_b, steady.cpu_per_heartbeat(), beats_b.answered),
        bench_cpu: bench_b,
        beats: beats_b,
        load: brokered,
    });
    if let Some(b) = &r.broker_all {
        if b.load.errors > 0 {
            r.shortfalls.push(format!(
                "{} broker calls through all replicas failed, first: {}",
                thousands(b.load.errors),
                b.load.first_error.clone().unwrap_or_default()
            ));
        }
    }
    if let Some(b) = &r.broker {
        if b.load.credentials == 0 {
            r.shortfalls.push(format!(
                "no credential brokered ({} errors)",
                thousands(b.load.errors)
            ));
        } else if b.load.errors > 0 {
            r.shortfalls
                .push(format!("{} broker calls failed", thousands(b.load.errors)));
        }
    }
    let (down, _) = r.nodes_watch.not_ready(r.measured);
    if !down.is_empty() {
        r.shortfalls
            .push(format!("{} of {} nodes seen NotReady", down.len(), fleet.len()));
    }
    r.steady = Some(steady);
    r.wakes = (
        tally.wakes_changed.load(std::sync::atomic::Ordering::Relaxed),
        tally.wakes_unchanged.load(std::sync::atomic::Ordering::Relaxed),
        tally.wakes_failed.load(std::sync::atomic::Ordering::Relaxed),
    );
    r.first_heartbeat_error = tally.first_error();
    if !s.hold.is_zero() {
        progress(&format!(
            "  holding the row for {} s, the nodes heartbeating (control plane pid {})",
            s.hold.as_secs(),
            server.pid
        ));
        sleep_guarded(s.hold, &guard).await;
    }
    drop(watchdog);
    if servers.len() > 1 {
        r.failover = Some(failover(servers, &fleet).await);
    }
    drop(fleet);
    r.desired_bytes = desired_sizes(&samples).await;
    Ok(())
}

/// `kill -9` of the first replica; then, for each node that heartbeat to
/// it (node `i` started on replica `i % replicas` and had no reason to
/// leave it), the time until its first heartbeat begun after the kill was
/// answered — by another replica, through the same failover as the agent's
/// client.
async fn failover(servers: &mut [Server], fleet: &Fleet) -> Failover {
    progress("  kill -9 of the first replica; timing its nodes' first heartbeat elsewhere");
    let replicas = servers.len();
    let on_killed: Vec<u32> = (0..fleet.len())
        .filter(|i| i % replicas == 0)
        .map(|i| i as u32)
        .collect();
    let killed = Instant::now();
    servers[0].kill();
    let first_answer = |beats: &[figures::Beat], node: u32| {
        beats
            .iter()
            .filter(|b| b.node == node && b.started >= killed && b.outcome == figures::Outcome::Answered)
            .map(|b| b.started + b.took - killed)
            .min()
    };
    let deadline = killed + FAILOVER_BOUND;
    while Instant::now() < deadline {
        let beats = fleet.tally.beats();
        if on_killed.iter().all(|n| first_answer(&beats, *n).is_some()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let beats = fleet.tally.beats();
    let gaps: Vec<Duration> = on_killed
        .iter()
        .filter_map(|n| first_answer(&beats, *n))
        .collect();
    Failover {
        nodes: on_killed.len(),
        gaps: crate::setup::Latencies::new(gaps),
    }
}

/// The table's verdict on the steady state.
fn judge(r: &mut RowResult, steady: &Steady) {
    let b = &steady.beats;
    if b.timed_out > 0 {
        r.shortfalls
            .push(format!("{} heartbeats timed out", thousands(b.timed_out)));
    }
    if b.failed > 0 {
        r.shortfalls
            .push(format!("{} heartbeats failed", thousands(b.failed)));
    }
    if steady.served_rate() < 0.9 * steady.expected_rate {
        r.shortfalls.push(format!(
            "only {:.1} of {:.1} heartbeats/s served",
            steady.served_rate(),
            steady.expected_rate
        ));
    }
}

/// Notes a batch that did not do everything it was asked.
fn shortfall(r: &mut RowResult, verb: &str, what: &str, b: &Batch) {
    if b.complete() {
        return;
    }
    let mut line = format!(
        "{verb} {} of {} {what} in {:.0} s",
        thousands(b.done as u64),
        thousands(b.requested as u64),
        b.elapsed.as_secs_f64()
    );
    if let Some(why) = &b.cut_short {
        line.push_str(&format!(" ({why})"));
    }
    if let Some(e) = &b.first_error {
        line.push_str(&format!(", first error: {e}"));
    }
    r.shortfalls.push(line);
}

/// The first gateway's and the first hypervisor's clients.
fn sample_nodes(nodes: &[fleet::Enrolled]) -> Vec<(NodeSpec, Client)> {
    let first = |gateway: bool| {
        nodes
            .iter()
            .find(|n| n.spec.gateway == gateway)
            .map(|n| (n.spec.clone(), n.client.clone()))
    };
    [first(false), first(true)].into_iter().flatten().collect()
}

/// One heartbeat of a hypervisor and of a gateway (reporting nothing, which
/// changes nothing they hold), their answers re-serialized: about what
/// every heartbeat answer weighs on the wire.
async fn desired_sizes(samples: &[(NodeSpec, Client)]) -> (Option<usize>, Option<usize>) {
    let mut out = (None, None);
    for (spec, client) in samples {
        let hb: Heartbeat = fake_node::empty_heartbeat(&spec.name, &spec.vtep.to_string());
        let answer = tokio::time::timeout(
            Duration::from_secs(30),
            client.post::<_, serde_json::Value>("/v1/agent/heartbeat", &hb),
        )
        .await;
        let size = match answer {
            Ok(Ok(v)) => serde_json::to_vec(&v).ok().map(|b| b.len()),
            _ => None,
        };
        if spec.gateway {
            out.1 = size;
        } else {
            out.0 = size;
        }
    }
    out
}

/// Waits until `count()` reaches `want` ([`until`]): how long after `from`
/// it did, or `None` with a shortfall naming `what` after the LB creates.
async fn reached(
    r: &mut RowResult,
    deadline: Instant,
    guard: &Guard,
    from: Instant,
    want: usize,
    what: &str,
    count: impl Fn() -> usize,
) -> Option<Duration> {
    if until(deadline, guard, || count() >= want).await {
        return Some(from.elapsed());
    }
    r.shortfalls.push(format!(
        "{} of {} {what} after the LB creates",
        thousands(count() as u64),
        thousands(want as u64)
    ));
    None
}

/// Polls `done` twice a second until it holds (true), or `deadline` passes
/// or `guard` trips (false).
async fn until(deadline: Instant, guard: &Guard, done: impl FnMut() -> bool) -> bool {
    until_saying(deadline, guard, done, || None).await
}

/// [`until`], printing what `say` says every 30 s.
async fn until_saying(
    deadline: Instant,
    guard: &Guard,
    mut done: impl FnMut() -> bool,
    mut say: impl FnMut() -> Option<String>,
) -> bool {
    let started = Instant::now();
    let mut next_say = started + Duration::from_secs(30);
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= next_say {
            next_say += Duration::from_secs(30);
            if let Some(line) = say() {
                progress(&format!(
                    "    {line} after {:.0} s",
                    started.elapsed().as_secs_f64()
                ));
            }
        }
        if Instant::now() >= deadline || guard.tripped().is_some() {
            return false;
        }
        tokio::time::sleep(
            Duration::from_millis(500).min(deadline.saturating_duration_since(Instant::now())),
        )
        .await;
    }
}

/// Sleeps `time`, or less when `guard` trips.
async fn sleep_guarded(time: Duration, guard: &Guard) {
    until(Instant::now() + time, guard, || false).await;
}

/// `VmHWM`: the peak RSS of `pid`.
fn peak_rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
}

/// The 1-minute load average.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

/// A task aborted when this drops (a phase that returns early leaves
/// nothing running behind it).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    /// The task's result, waiting for it.
    async fn take(mut self) -> Result<T, tokio::task::JoinError> {
        (&mut self.0).await
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
