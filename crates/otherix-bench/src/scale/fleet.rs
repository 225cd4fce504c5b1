//! The simulated nodes of a scale row, all in the bench's one tokio runtime:
//! each enrolls with a join token bound to its name, roles and VTEP (key
//! and CSR made here, `otherix_testbed::fake_node`), then runs the agent's
//! heartbeat loop over mutual TLS — the same cadence and the same wake as
//! `otherix-agent`'s daemon (whose loop is private to it), with
//! [`Reporter`] standing in for the node's kernel state:
//!
//! - the next heartbeat starts an interval after the previous one was
//!   answered; one without an answer within [`HEARTBEAT_TIMEOUT`] failed,
//!   and failures back off from 1 s, doubling, to 10 s;
//! - between heartbeats a `GET /v1/agent/desired/wait?version=V` is held
//!   open; when it answers "changed" (and no heartbeat is in flight) the
//!   next heartbeat starts at once, no sooner than [`MIN_SPACING`] after the
//!   previous one;
//! - the first heartbeats are spread evenly over one interval.
//!
//! Every heartbeat is recorded ([`Beat`]), with its time to answer.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use otherix_client::{Client, ClientError};
use otherix_proto::agent::CreateJoinTokenRequest;
use otherix_testbed::fake_node;
use time::OffsetDateTime;

use super::figures::{Beat, Outcome, Rng};
use super::load::{bounded, Batch, Guard};
use super::node::{Desired, Reporter};
use super::plan::NodeSpec;

/// The agent's: a heartbeat without an answer this long has failed.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// The agent's: a woken heartbeat starts at least this long after the last.
const MIN_SPACING: Duration = Duration::from_millis(50);
/// The agent's guard on a wait the CP should answer within 25 s.
const WAIT_HOLD: Duration = Duration::from_secs(45);
const RETRY_FIRST: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(10);
/// Enrollments in flight at once.
const ENROLL_CONCURRENCY: usize = 8;

/// What every node's loop records, shared.
#[derive(Debug, Default)]
pub struct Tally {
    beats: Mutex<Vec<Beat>>,
    first_error: Mutex<Option<String>>,
    pub wakes_changed: AtomicU64,
    pub wakes_unchanged: AtomicU64,
    pub wakes_failed: AtomicU64,
    /// Per node: guests in its last desired state (placed there).
    placed: Vec<AtomicUsize>,
    /// Per node: guests its last answered heartbeat reported running.
    running: Vec<AtomicUsize>,
    /// Per node: health checks in its last desired state.
    checks: Vec<AtomicUsize>,
    /// Per node: health checks whose verdict the CP acknowledged.
    verdicts: Vec<AtomicUsize>,
}

impl Tally {
    fn new(nodes: usize) -> Tally {
        let zeros = || (0..nodes).map(|_| AtomicUsize::new(0)).collect();
        Tally {
            placed: zeros(),
            running: zeros(),
            checks: zeros(),
            verdicts: zeros(),
            ..Tally::default()
        }
    }

    /// Every heartbeat so far.
    pub fn beats(&self) -> Vec<Beat> {
        self.beats.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn first_error(&self) -> Option<String> {
        self.first_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn sum(v: &[AtomicUsize]) -> usize {
        v.iter().map(|n| n.load(Ordering::Relaxed)).sum()
    }

    /// VMs placed on some node, as the nodes' last desired states say.
    pub fn placed(&self) -> usize {
        Tally::sum(&self.placed)
    }

    /// VMs the CP was told are running, by the last answered heartbeats.
    pub fn running(&self) -> usize {
        Tally::sum(&self.running)
    }

    /// Health checks handed out.
    pub fn checks(&self) -> usize {
        Tally::sum(&self.checks)
    }

    /// Health checks whose first verdict the CP has acknowledged.
    pub fn verdicts(&self) -> usize {
        Tally::sum(&self.verdicts)
    }

    fn record(&self, beat: Beat, error: Option<String>) {
        self.beats.lock().unwrap_or_else(|p| p.into_inner()).push(beat);
        if let Some(e) = error {
            self.first_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
        }
    }
}

/// An enrolled node: its spec and its mutual-TLS client.
pub struct Enrolled {
    pub spec: NodeSpec,
    pub client: Client,
}

/// Enrolls every node of `specs` (join token, key, CSR, enrollment), a few
/// at a time, until done or `deadline`. Returns the nodes enrolled so far,
/// in the order of `specs`.
/// Each node's client knows every URL of `servers` (the replicas), node
/// `i` starting at replica `i % servers.len()`: the nodes spread over them.
pub async fn enroll_all(
    admin: &Client,
    anonymous: &Client,
    servers: &[String],
    ca_pem: &str,
    specs: &[NodeSpec],
    deadline: Instant,
    guard: &Arc<Guard>,
) -> (Vec<Enrolled>, Batch) {
    let slots: Arc<Mutex<Vec<Option<Client>>>> = Arc::new(Mutex::new(vec![None; specs.len()]));
    let specs_arc: Arc<Vec<NodeSpec>> = Arc::new(specs.to_vec());
    let (admin, anonymous, servers, ca_pem) = (
        admin.clone(),
        anonymous.clone(),
        servers.to_vec(),
        ca_pem.to_string(),
    );
    let batch = {
        let slots = slots.clone();
        bounded(
            "nodes",
            specs.len(),
            ENROLL_CONCURRENCY,
            deadline,
            guard,
            move |i| {
                let mut rotated = servers.clone();
                rotated.rotate_left(i % servers.len().max(1));
                let (admin, anonymous, ca_pem) = (admin.clone(), anonymous.clone(), ca_pem.clone());
                let (spec, slots) = (specs_arc[i].clone(), slots.clone());
                async move {
                    let client = enroll_one(&admin, &anonymous, &rotated, &ca_pem, &spec)
                        .await
                        .map_err(|e| format!("{}: {e:#}", spec.name))?;
                    slots.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(client);
                    Ok(())
                }
            },
        )
        .await
    };
    let slots = std::mem::take(&mut *slots.lock().unwrap_or_else(|p| p.into_inner()));
    let enrolled = specs
        .iter()
        .zip(slots)
        .filter_map(|(spec, client)| {
            client.map(|client| Enrolled {
                spec: spec.clone(),
                client,
            })
        })
        .collect();
    (enrolled, batch)
}

async fn enroll_one(
    admin: &Client,
    anonymous: &Client,
    servers: &[String],
    ca_pem: &str,
    spec: &NodeSpec,
) -> anyhow::Result<Client> {
    let token = admin
        .create_join_token(&CreateJoinTokenRequest {
            node: spec.name.parse().expect("the bench makes DNS-label names"),
            ttl_seconds: Some(3_600),
            hypervisor: !spec.gateway,
            gateway: spec.gateway_endpoint(),
            relay: None,
            vtep: Some(spec.vtep.to_string()),
            replace: false,
        })
        .await
        .context("join token")?;
    let key = fake_node::node_key(&spec.name).context("key and CSR")?;
    let identity = fake_node::enroll(anonymous, &token.token, &spec.name, key)
        .await
        .context("enrollment")?;
    Ok(identity.client(servers, ca_pem)?)
}

/// The running heartbeat loops; they stop when this drops.
pub struct Fleet {
    pub tally: Arc<Tally>,
    pub specs: Vec<NodeSpec>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Fleet {
    /// Starts every node's loop on the current runtime, first heartbeats
    /// spread over one `interval`.
    /// `whole_state_every`: nodes that ignore digests and take the whole
    /// state this often.
    pub fn start(nodes: Vec<Enrolled>, interval: Duration, whole_state_every: Option<Duration>) -> Fleet {
        let tally = Arc::new(Tally::new(nodes.len()));
        let start = Instant::now();
        let n = nodes.len().max(1);
        let mut specs = Vec::new();
        let mut tasks = Vec::new();
        let mut rng = Rng::new(u64::from(std::process::id()));
        for (i, node) in nodes.into_iter().enumerate() {
            specs.push(node.spec.clone());
            let first = start + interval.mul_f64(i as f64 / n as f64);
            let mut reporter = Reporter::new(node.spec, rng.next_u64());
            if let Some(every) = whole_state_every {
                reporter.ignore_digests(every);
            }
            tasks.push(tokio::spawn(run(
                i as u32,
                node.client,
                reporter,
                first,
                interval,
                tally.clone(),
            )));
        }
        Fleet { tally, specs, tasks }
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    /// Nodes whose loop has had an answer at least once.
    pub fn answered_nodes(&self) -> usize {
        let mut seen = vec![false; self.len()];
        for b in self.tally.beats() {
            if b.outcome == Outcome::Answered {
                if let Some(s) = seen.get_mut(b.node as usize) {
                    *s = true;
                }
            }
        }
        seen.iter().filter(|s| **s).count()
    }
}

type Pending<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A heartbeat's end: when it started, whether a wake sent it, and what came back.
struct Answer {
    started: Instant,
    woken: bool,
    result: Result<Desired, String>,
    outcome: Outcome,
}

/// One node's loop: the agent's, see the module's docs.
async fn run(
    node: u32,
    client: Client,
    mut reporter: Reporter,
    first: Instant,
    interval: Duration,
    tally: Arc<Tally>,
) {
    let mut next = first;
    let mut last_beat = first;
    let mut woken = false;
    let mut failures: u32 = 0;
    let mut inflight: Option<Pending<Answer>> = None;
    let mut waiting: Option<Pending<Result<bool, ClientError>>> = None;
    let mut waiting_on: Option<u64> = None;
    let mut wait_off = false;
    loop {
        tokio::select! {
            Answer { started, woken: was_woken, result, outcome } = async { inflight.as_mut().expect("guarded by is_some").await }, if inflight.is_some() => {
                inflight = None;
                let took = started.elapsed();
                let idx = node as usize;
                match result {
                    Ok(desired) => {
                        failures = 0;
                        tally.running[idx].store(reporter.guests(), Ordering::Relaxed);
                        let version = desired.version;
                        reporter.accept(desired, OffsetDateTime::now_utc());
                        tally.placed[idx].store(reporter.guests(), Ordering::Relaxed);
                        tally.checks[idx].store(reporter.checks(), Ordering::Relaxed);
                        tally.verdicts[idx].store(reporter.acked_checks(), Ordering::Relaxed);
                        tally.record(Beat { node, started, took, outcome, woken: was_woken }, None);
                        if !wait_off && (waiting_on != Some(version) || waiting.is_none()) {
                            waiting_on = Some(version);
                            waiting = Some(wait(client.clone(), version));
                        }
                        next = Instant::now() + interval;
                    }
                    Err(e) => {
                        failures = failures.saturating_add(1);
                        tally.record(Beat { node, started, took, outcome, woken: was_woken }, Some(e));
                        next = Instant::now() + retry_delay(failures);
                    }
                }
            }
            result = async { waiting.as_mut().expect("guarded by is_some").await }, if waiting.is_some() => {
                waiting = None;
                match result {
                    Ok(true) => {
                        tally.wakes_changed.fetch_add(1, Ordering::Relaxed);
                        if inflight.is_none() {
                            next = Instant::now().max(last_beat + MIN_SPACING);
                            woken = true;
                        }
                    }
                    Ok(false) => {
                        tally.wakes_unchanged.fetch_add(1, Ordering::Relaxed);
                        if let Some(v) = waiting_on {
                            waiting = Some(wait(client.clone(), v));
                        }
                    }
                    Err(ClientError::Api { status: 404, .. }) => wait_off = true,
                    // Tried again after the next answered heartbeat.
                    Err(_) => {
                        tally.wakes_failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            () = tokio::time::sleep_until(next.into()), if inflight.is_none() => {
                last_beat = Instant::now();
                let hb = reporter.heartbeat(OffsetDateTime::now_utc());
                let client = client.clone();
                let was_woken = std::mem::take(&mut woken);
                inflight = Some(Box::pin(async move {
                    let started = Instant::now();
                    let answer = tokio::time::timeout(
                        HEARTBEAT_TIMEOUT,
                        client.post::<_, Desired>("/v1/agent/heartbeat", &hb),
                    )
                    .await;
                    let (result, outcome) = match answer {
                        Ok(Ok(d)) => (Ok(d), Outcome::Answered),
                        Ok(Err(e)) => (Err(e.to_string()), Outcome::Failed),
                        Err(_) => (Err(format!("no answer within {HEARTBEAT_TIMEOUT:?}")), Outcome::TimedOut),
                    };
                    Answer { started, woken: was_woken, result, outcome }
                }));
            }
        }
    }
}

fn wait(client: Client, version: u64) -> Pending<Result<bool, ClientError>> {
    Box::pin(async move {
        match tokio::time::timeout(WAIT_HOLD, client.wait_desired(version)).await {
            Ok(r) => r.map(|w| w.changed),
            Err(_) => Ok(false),
        }
    })
}

/// The agent's backoff: 1 s after the first failure, doubling, at most 10 s.
fn retry_delay(failures: u32) -> Duration {
    let doublings = failures.saturating_sub(1).min(31);
    RETRY_FIRST.saturating_mul(1u32 << doublings).min(RETRY_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_heartbeats_back_off_like_the_agents() {
        assert_eq!(retry_delay(1), Duration::from_secs(1));
        assert_eq!(retry_delay(2), Duration::from_secs(2));
        assert_eq!(retry_delay(4), Duration::from_secs(8));
        assert_eq!(retry_delay(5), Duration::from_secs(10));
        assert_eq!(retry_delay(40), Duration::from_secs(10));
    }
}
