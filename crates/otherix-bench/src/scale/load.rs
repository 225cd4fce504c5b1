//! The calls a scale row makes besides the nodes' own: networks, VMs and
//! LBs created through the API a few at a time, concurrent broker calls,
//! and `GET /v1/nodes` watched for NotReady nodes — each bounded by a
//! deadline, so a control plane that cannot keep up ends the phase with
//! what was reached rather than hanging the bench. A [`Guard`] stops every
//! phase when the control plane exits or outgrows its memory bound.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use otherix_client::Client;
use otherix_proto::agent::NodeStatus;
use otherix_proto::{CreateLbRequest, CreateNetworkRequest, CreateVmRequest, NetworkType};

use super::figures::Rng;
use super::plan::Plan;
use crate::broker::broker_for;
use crate::procfs;
use crate::setup::Latencies;

/// One API call of a batch may take this long before it counts as failed.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Creations in flight at once (VMs, LBs, networks).
pub const CREATE_CONCURRENCY: usize = 8;
/// The port brokered (any port: the admin may reach every one).
const BROKER_PORT: u16 = 22;

/// Stops the row's phases when the control plane is gone or its RSS passes
/// a bound (this machine is shared: a row must not take all its memory).
#[derive(Debug)]
pub struct Guard {
    pid: u32,
    max_rss: u64,
    tripped: OnceLock<String>,
    peak_rss: AtomicU64,
}

impl Guard {
    pub fn new(pid: u32, max_rss: u64) -> Arc<Guard> {
        Arc::new(Guard {
            pid,
            max_rss,
            tripped: OnceLock::new(),
            peak_rss: AtomicU64::new(0),
        })
    }

    /// Why the row must stop, if it must.
    pub fn tripped(&self) -> Option<&str> {
        self.tripped.get().map(String::as_str)
    }

    /// The largest RSS seen by [`Guard::watch`].
    pub fn peak_rss(&self) -> u64 {
        self.peak_rss.load(Ordering::Relaxed)
    }

    /// Checks the control plane twice a second until the row ends.
    pub async fn watch(self: Arc<Guard>) {
        loop {
            match procfs::rss_bytes(self.pid) {
                Ok(rss) => {
                    self.peak_rss.fetch_max(rss, Ordering::Relaxed);
                    if rss > self.max_rss {
                        let _ = self.tripped.set(format!(
                            "control plane RSS passed {} MiB; row stopped",
                            self.max_rss >> 20
                        ));
                    }
                }
                Err(_) => {
                    let _ = self.tripped.set("the control plane exited".into());
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// What a bounded batch of calls did.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub requested: usize,
    pub done: usize,
    pub failed: usize,
    pub first_error: Option<String>,
    pub elapsed: Duration,
    /// Why it stopped before every call was made, if it did.
    pub cut_short: Option<String>,
}

impl Batch {
    pub fn per_second(&self) -> f64 {
        if self.elapsed.is_zero() {
            0.0
        } else {
            self.done as f64 / self.elapsed.as_secs_f64()
        }
    }

    pub fn complete(&self) -> bool {
        self.done == self.requested
    }
}

/// How often a long batch says how far it got.
const PROGRESS_EVERY: Duration = Duration::from_secs(30);

/// Runs `job(i)` for every `i` in `0..n`, `concurrency` at a time, until
/// all are done, `deadline` passes, or `guard` trips; says how far it got
/// every [`PROGRESS_EVERY`] (`what`: "VMs").
pub async fn bounded<F, Fut>(
    what: &str,
    n: usize,
    concurrency: usize,
    deadline: Instant,
    guard: &Arc<Guard>,
    job: F,
) -> Batch
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), String>> + Send + 'static,
{
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let failed = Arc::new(AtomicUsize::new(0));
    let first_error: Arc<Mutex<Option<String>>> = Arc::default();
    let job = Arc::new(job);
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency.min(n).max(1) {
        let (next, done, failed, first_error, job, guard) = (
            next.clone(),
            done.clone(),
            failed.clone(),
            first_error.clone(),
            job.clone(),
            guard.clone(),
        );
        workers.spawn(async move {
            while Instant::now() < deadline && guard.tripped().is_none() {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let result = match tokio::time::timeout(CALL_TIMEOUT, job(i)).await {
                    Ok(r) => r,
                    Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
                };
                match result {
                    Ok(()) => done.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        first_error
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(e);
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
            }
        });
    }
    let mut ticker = tokio::time::interval_at((started + PROGRESS_EVERY).into(), PROGRESS_EVERY);
    loop {
        tokio::select! {
            joined = workers.join_next() => if joined.is_none() { break },
            _ = ticker.tick() => crate::progress(&format!(
                "    {} of {n} {what} after {:.0} s",
                done.load(Ordering::Relaxed),
                started.elapsed().as_secs_f64()
            )),
        }
    }
    let done = done.load(Ordering::Relaxed);
    let failed = failed.load(Ordering::Relaxed);
    let cut_short = if done + failed >= n {
        None
    } else if let Some(why) = guard.tripped() {
        Some(why.to_string())
    } else {
        Some(format!(
            "{:.0} s bound reached",
            (deadline - started).as_secs_f64()
        ))
    };
    let first_error = first_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    Batch {
        requested: n,
        done,
        failed,
        first_error,
        elapsed: started.elapsed(),
        cut_short,
    }
}

/// The row's overlays, one per `vms_per_network` VMs, each a /16.
pub async fn networks(admin: &Client, plan: &Plan, deadline: Instant, guard: &Arc<Guard>) -> Batch {
    let admin = admin.clone();
    bounded(
        "networks",
        plan.networks(),
        CREATE_CONCURRENCY,
        deadline,
        guard,
        move |i| {
            let admin = admin.clone();
            async move {
                admin
                    .create_network(&CreateNetworkRequest {
                        name: Plan::network_name(i)
                            .parse()
                            .expect("the bench makes DNS-label names"),
                        kind: NetworkType::Overlay,
                        subnet: Plan::subnet(i),
                        node: None,
                        nodes: Vec::new(),
                    })
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        },
    )
    .await
}

/// The row's VM `i`: its name, network and labels, on `node` if given.
fn vm_request(plan: &Plan, i: usize, node: Option<String>) -> CreateVmRequest {
    CreateVmRequest {
        runtime: Default::default(),
        ssh_keys: Vec::new(),
        cpus: None,
        image: None,
        memory_mib: None,
        name: Plan::vm_name(i).parse().expect("the bench makes DNS-label names"),
        network: plan
            .vm_network(i)
            .parse()
            .expect("the bench makes DNS-label names"),
        labels: plan.vm_labels(i),
        node: node.map(|n| n.parse().expect("the bench makes DNS-label names")),
        exec: None,
    }
}

/// VMs `range`, spread over the networks, with their labels, `in_flight`
/// requests at once; on the nodes of `pin` in turn when given (`vm create
/// --node`), else where the scheduler puts them.
pub async fn vms(
    admin: &Client,
    plan: &Plan,
    range: std::ops::Range<usize>,
    pin: Option<Vec<String>>,
    in_flight: usize,
    deadline: Instant,
    guard: &Arc<Guard>,
) -> Batch {
    let (admin, plan) = (admin.clone(), Arc::new(plan.clone()));
    let pin = Arc::new(pin.filter(|p| !p.is_empty()));
    let first = range.start;
    bounded("VMs", range.len(), in_flight, deadline, guard, move |k| {
        let (admin, plan) = (admin.clone(), plan.clone());
        let i = first + k;
        let node = pin.as_ref().as_ref().map(|p| p[i % p.len()].clone());
        async move {
            admin
                .create_vm(&vm_request(&plan, i, node))
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        }
    })
    .await
}

/// VMs `range` as [`vms`] makes them (placed by the scheduler), `per`
/// to a request (`POST /v1/vm-batches`), `in_flight` requests at once.
/// `done` counts VMs.
pub async fn vm_batches(
    admin: &Client,
    plan: &Plan,
    range: std::ops::Range<usize>,
    per: usize,
    in_flight: usize,
    deadline: Instant,
    guard: &Arc<Guard>,
) -> Batch {
    let (admin, plan) = (admin.clone(), Arc::new(plan.clone()));
    let created = Arc::new(AtomicUsize::new(0));
    let (first, end) = (range.start, range.end);
    let requests = range.len().div_ceil(per);
    let counted = created.clone();
    let mut batch = bounded("VM batches", requests, in_flight, deadline, guard, move |k| {
        let (admin, plan, counted) = (admin.clone(), plan.clone(), counted.clone());
        let ids = (first + k * per)..(first + (k + 1) * per).min(end);
        async move {
            let vms: Vec<CreateVmRequest> = ids.map(|i| vm_request(&plan, i, None)).collect();
            let n = vms.len();
            admin
                .create_vm_batch(&otherix_proto::CreateVmBatchRequest { vms })
                .await
                .map(|_| {
                    counted.fetch_add(n, Ordering::Relaxed);
                })
                .map_err(|e| e.to_string())
        }
    })
    .await;
    let vms = created.load(Ordering::Relaxed);
    batch.requested = end - first;
    batch.failed = batch.requested - vms;
    batch.done = vms;
    batch
}

/// The row's LBs, each selecting its share of the VMs, TCP health checks
/// at the defaults.
pub async fn lbs(admin: &Client, plan: &Plan, deadline: Instant, guard: &Arc<Guard>) -> Batch {
    let admin = admin.clone();
    bounded(
        "LBs",
        plan.row.lbs,
        CREATE_CONCURRENCY,
        deadline,
        guard,
        move |j| {
            let admin = admin.clone();
            async move {
                admin
                    .create_lb(&CreateLbRequest {
                        name: Plan::lb_name(j).parse().expect("the bench makes DNS-label names"),
                        port: 80,
                        selector: Plan::lb_selector(j),
                        health: None,
                        health_port: None,
                        interval_ms: None,
                        timeout_ms: None,
                        rise: None,
                        fall: None,
                    })
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        },
    )
    .await
}

/// What the broker did in its phase.
#[derive(Debug, Clone, Default)]
pub struct BrokerLoad {
    pub credentials: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub elapsed: Duration,
    pub concurrency: usize,
    /// Time to answer of the calls that got a credential.
    pub latencies: Latencies,
}

/// `concurrency` callers brokering random VMs of `0..vms` for `time`
/// (calls in flight at the end are waited for, at most [`CALL_TIMEOUT`]),
/// caller `c` through `admins[c % admins.len()]` (one per replica).
pub async fn broker(
    admins: &[Client],
    vms: usize,
    concurrency: usize,
    time: Duration,
    guard: &Arc<Guard>,
) -> BrokerLoad {
    let started = Instant::now();
    let deadline = started + time;
    let errors = Arc::new(AtomicU64::new(0));
    let first_error: Arc<Mutex<Option<String>>> = Arc::default();
    let mut callers = tokio::task::JoinSet::new();
    for c in 0..concurrency {
        let (admin, errors, first_error, guard) = (
            admins[c % admins.len()].clone(),
            errors.clone(),
            first_error.clone(),
            guard.clone(),
        );
        callers.spawn(async move {
            let mut rng = Rng::new(0x5ca1e ^ c as u64);
            call_until(
                &admin,
                &mut rng,
                vms,
                deadline,
                || guard.tripped().is_some(),
                &errors,
                &first_error,
            )
            .await
        });
    }
    let mut took = Vec::new();
    while let Some(t) = callers.join_next().await {
        took.extend(t.unwrap_or_default());
    }
    let first_error = first_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    BrokerLoad {
        credentials: took.len() as u64,
        errors: errors.load(Ordering::Relaxed),
        first_error,
        elapsed: started.elapsed(),
        concurrency,
        latencies: Latencies::new(took),
    }
}

/// Hidden subcommand: one broker caller process (see [`broker_from_processes`]).
pub const PROBE_BROKER: &str = "__probe-broker";
/// The control plane's URL, CA and admin token for a caller process: in
/// its environment, never on its command line.
const PROBE_URL: &str = "OTHERIX_BENCH_BROKER_URL";
const PROBE_CA: &str = "OTHERIX_BENCH_BROKER_CA";
const PROBE_TOKEN: &str = "OTHERIX_BENCH_BROKER_TOKEN";

/// `concurrency` callers spread over `processes` processes of this binary
/// (each its own runtime on one thread), brokering random VMs of `0..vms`
/// for `time` through `server`: callers in one process saturate before
/// the control plane does (the bench's own process also runs every
/// simulated node). Their CPU is this process's children's.
pub async fn broker_from_processes(
    server: &super::server::Server,
    vms: usize,
    concurrency: usize,
    processes: usize,
    time: Duration,
) -> BrokerLoad {
    let started = Instant::now();
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return failed_load(concurrency, started, format!("cannot find this binary: {e}")),
    };
    let mut children = Vec::new();
    for p in 0..processes {
        // Callers dealt out as evenly as they go.
        let callers = concurrency / processes + usize::from(p < concurrency % processes);
        let child = tokio::process::Command::new(&exe)
            .args([
                PROBE_BROKER,
                &vms.to_string(),
                &callers.to_string(),
                &time.as_millis().to_string(),
                &p.to_string(),
            ])
            .env(PROBE_URL, &server.url)
            .env(PROBE_CA, &server.ca_pem)
            .env(PROBE_TOKEN, server.admin_token())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn();
        match child {
            // Each read as it comes: a caller blocked on a full pipe would
            // stretch the phase.
            Ok(c) => children.push(tokio::spawn(c.wait_with_output())),
            Err(e) => {
                return failed_load(
                    concurrency,
                    started,
                    format!("cannot start a caller process: {e}"),
                )
            }
        }
    }
    let mut load = BrokerLoad {
        concurrency,
        ..BrokerLoad::default()
    };
    let mut took = Vec::new();
    let mut elapsed = Duration::ZERO;
    for child in children {
        match child.await.map_err(std::io::Error::other).and_then(|r| r) {
            Ok(out) if out.status.success() => {
                let text = String::from_utf8_lossy(&out.stdout);
                let mut lines = text.lines();
                // `ELAPSED_NS ERRORS`, then the first error (or empty),
                // then one nanosecond figure a line per credential.
                let head: Vec<u64> = lines
                    .next()
                    .unwrap_or_default()
                    .split_whitespace()
                    .filter_map(|n| n.parse().ok())
                    .collect();
                if let [ns, errors] = head[..] {
                    elapsed = elapsed.max(Duration::from_nanos(ns));
                    load.errors += errors;
                }
                if let Some(first) = lines.next().filter(|l| !l.is_empty()) {
                    load.first_error.get_or_insert_with(|| first.to_string());
                }
                took.extend(
                    lines
                        .filter_map(|l| l.trim().parse::<u64>().ok())
                        .map(Duration::from_nanos),
                );
            }
            Ok(out) => {
                load.errors += 1;
                load.first_error.get_or_insert_with(|| {
                    format!(
                        "a caller process failed ({}): {}",
                        out.status,
                        String::from_utf8_lossy(&out.stderr).trim()
                    )
                });
            }
            Err(e) => {
                load.errors += 1;
                load.first_error
                    .get_or_insert_with(|| format!("a caller process: {e}"));
            }
        }
    }
    load.credentials = took.len() as u64;
    // The callers' own time, from their first call to their last answer:
    // starting the processes and reading their figures is not the phase.
    load.elapsed = if elapsed.is_zero() {
        started.elapsed()
    } else {
        elapsed
    };
    load.latencies = Latencies::new(took);
    load
}

fn failed_load(concurrency: usize, started: Instant, why: String) -> BrokerLoad {
    BrokerLoad {
        errors: 1,
        first_error: Some(why),
        elapsed: started.elapsed(),
        concurrency,
        ..BrokerLoad::default()
    }
}

/// A caller process's side: `callers` callers brokering random VMs of
/// `0..vms` for `millis`, through the control plane its environment names;
/// prints the errors, the first error and each credential's time.
pub fn probe_broker(vms: usize, callers: usize, millis: u64, seed: u64) -> anyhow::Result<()> {
    use anyhow::Context as _;
    use std::io::Write as _;
    let env = |k: &str| std::env::var(k).with_context(|| format!("{k} is not set"));
    let client = Client::new(&env(PROBE_URL)?, &env(PROBE_CA)?, Some(env(PROBE_TOKEN)?))?;
    // One thread: a process's callers use a fraction of a core, and a
    // second worker would only add wakeups across threads to what the
    // machine spends calling, beside the control plane it measures.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let started = Instant::now();
    let deadline = started + Duration::from_millis(millis);
    let (took, errors, first_error, elapsed) = rt.block_on(async {
        let errors = Arc::new(AtomicU64::new(0));
        let first_error: Arc<Mutex<Option<String>>> = Arc::default();
        let mut tasks = tokio::task::JoinSet::new();
        for c in 0..callers {
            let (client, errors, first_error) = (client.clone(), errors.clone(), first_error.clone());
            tasks.spawn(async move {
                let mut rng = Rng::new(0x5ca1e ^ (seed << 32) ^ c as u64);
                call_until(&client, &mut rng, vms, deadline, || false, &errors, &first_error).await
            });
        }
        let mut took = Vec::new();
        while let Some(t) = tasks.join_next().await {
            took.extend(t.unwrap_or_default());
        }
        let first = first_error.lock().unwrap_or_else(|p| p.into_inner()).take();
        (took, errors.load(Ordering::Relaxed), first, started.elapsed())
    });
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    writeln!(out, "{} {errors}", elapsed.as_nanos())?;
    writeln!(out, "{}", first_error.unwrap_or_default().replace('\n', " "))?;
    for t in took {
        writeln!(out, "{}", t.as_nanos())?;
    }
    out.flush()?;
    Ok(())
}

/// One caller's loop: random VMs of `0..vms` until `deadline` or `stop`;
/// the time of each call that got a credential.
async fn call_until(
    admin: &Client,
    rng: &mut Rng,
    vms: usize,
    deadline: Instant,
    stop: impl Fn() -> bool,
    errors: &AtomicU64,
    first_error: &Mutex<Option<String>>,
) -> Vec<Duration> {
    let mut took = Vec::new();
    while Instant::now() < deadline && !stop() {
        let vm = Plan::vm_name(rng.below(vms));
        let t = Instant::now();
        match tokio::time::timeout(CALL_TIMEOUT, broker_for(admin, &vm, BROKER_PORT)).await {
            Ok(Ok(_)) => took.push(t.elapsed()),
            Ok(Err(e)) => {
                errors.fetch_add(1, Ordering::Relaxed);
                first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(|| format!("{vm}: {e}"));
            }
            Err(_) => {
                errors.fetch_add(1, Ordering::Relaxed);
                first_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(|| format!("no answer within {CALL_TIMEOUT:?}"));
            }
        }
    }
    took
}

/// What `GET /v1/nodes` showed while it was watched.
#[derive(Debug, Clone, Default)]
pub struct NodeWatch {
    pub checks: usize,
    pub failed: usize,
    /// Every answer: when it was asked for, and the nodes it showed NotReady.
    pub answers: Vec<(Instant, Vec<String>)>,
    /// How long each answered `GET /v1/nodes` took.
    pub took: Latencies,
}

impl NodeWatch {
    /// The nodes seen NotReady at least once in answers asked for in
    /// `from..to` (every answer with `None`), and the most in one answer.
    pub fn not_ready(&self, within: Option<(Instant, Instant)>) -> (BTreeSet<String>, usize) {
        let mut seen = BTreeSet::new();
        let mut most = 0;
        for (at, down) in &self.answers {
            if within.is_none_or(|(from, to)| (from..to).contains(at)) {
                most = most.max(down.len());
                seen.extend(down.iter().cloned());
            }
        }
        (seen, most)
    }
}

/// `GET /v1/nodes`, one after the other with `pause` between, until `stop`
/// is set (the call in flight is finished).
pub async fn watch_nodes(
    admin: Client,
    pause: Duration,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> NodeWatch {
    let mut w = NodeWatch::default();
    let mut took = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        w.checks += 1;
        let t = Instant::now();
        match tokio::time::timeout(CALL_TIMEOUT, admin.list_nodes()).await {
            Ok(Ok(nodes)) => {
                took.push(t.elapsed());
                let down: Vec<String> = nodes
                    .into_iter()
                    .filter(|n| n.status != NodeStatus::Ready)
                    .map(|n| n.name)
                    .collect();
                w.answers.push((t, down));
            }
            _ => w.failed += 1,
        }
        let until = Instant::now() + pause;
        while Instant::now() < until && !stop.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    w.took = Latencies::new(took);
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_ready_nodes_are_counted_once_within_a_span() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let w = NodeWatch {
            answers: vec![
                (at(0), vec!["a".into(), "b".into(), "c".into()]),
                (at(10), vec!["b".into()]),
                (at(12), vec!["b".into(), "d".into()]),
            ],
            ..NodeWatch::default()
        };
        let (all, most) = w.not_ready(None);
        assert_eq!((all.len(), most), (4, 3));
        let (later, most) = w.not_ready(Some((at(5), at(20))));
        assert_eq!(later.into_iter().collect::<Vec<_>>(), vec!["b", "d"]);
        assert_eq!(most, 2);
    }
}
