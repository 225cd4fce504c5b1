//! The QEMU guest runtime beside the namespace runtime, on one testbed
//! (issue #28): a control plane, `node1`, `node2` and a gateway `gw1`; for
//! each runtime in turn, guests booted on `node1` and timed from `vm create`
//! to their first HTTP 200 through the gateway, their resident memory, and
//! then one guest migrated node1 → node2 → node1 … while an echo stream
//! through the gateway runs across every migration. For QEMU guests, QEMU's
//! own downtime, total time and bytes sent, read from the source agent's
//! `QEMU migration completed` line. Each runtime's guests are deleted before
//! the next runtime starts, so the two never share the CPU.

pub mod figures;
mod stream;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use otherix_client::Client;
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use self::figures::QemuMigration;
use self::stream::{EchoStream, Tally};
use crate::broker::broker_for;
use crate::options::Options;
use crate::procfs;
use crate::progress;

/// The overlay every guest of this part joins.
const NETWORK: &str = "bq-net";
const SUBNET: &str = "10.150.0.0/24";
const HTTP_PORT: u16 = 80;
const ECHO_PORT: u16 = 7;
/// What a namespace guest runs: the same two servers a QEMU guest's image has.
const NETNS_WORKLOAD: &str = "otherix guest http --port 80 & exec otherix guest echo --port 7";
const QEMU_MEMORY: &str = "256M";
/// Generous: a TCG boot takes seconds, but other builds share this machine.
const BOOT_WAIT: Duration = Duration::from_secs(240);
const WAIT: Duration = Duration::from_secs(60);
/// A new HTTP attempt this often while a guest boots (each on its own
/// connection, several in flight: one that reached the gateway before the
/// guest could answer may wait out a dial timeout): the boot figure's
/// resolution.
const HTTP_TRY_EVERY: Duration = Duration::from_millis(100);
const HTTP_ATTEMPT: Duration = Duration::from_secs(10);
/// After the first answer, before the resident memory is read: the guest's
/// services have started and settled.
const RSS_SETTLE: Duration = Duration::from_secs(2);
/// Between migrations: the stream runs steadily before the next one, so one
/// migration's gap never runs into the next's window.
const BETWEEN: Duration = Duration::from_secs(2);
/// Migrations that fail one after another before the part gives up.
const MAX_FAILED_IN_A_ROW: usize = 3;

/// A guest runtime.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Netns,
    Qemu,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Netns => "netns",
            Kind::Qemu => "qemu",
        }
    }
}

/// Both runtimes' figures, and where the logs were kept.
#[derive(Debug)]
pub struct Comparison {
    pub netns: Figures,
    pub qemu: Figures,
    /// Migrations asked for, per runtime.
    pub migrations: usize,
    /// The agents' logs and the QEMU guest's console, kept after the world.
    pub logs: PathBuf,
    /// The agents' QEMU downtime limit, if the bench set one.
    pub downtime_limit: Option<Duration>,
}

/// One runtime's figures.
#[derive(Debug)]
pub struct Figures {
    pub kind: Kind,
    /// What `vm get` says the QEMU guest runs on (`tcg`, `kvm`).
    pub accelerator: Option<String>,
    /// From `vm create` to the first HTTP 200 through the gateway, per boot.
    pub boots: Vec<Duration>,
    /// The guest's resident memory shortly after its first answer, per boot.
    pub rss_after_boot: Vec<u64>,
    /// The migrated guest's, after its last migration.
    pub rss_after_migrations: Option<u64>,
    pub migrations: Vec<Migration>,
    /// The echo stream across the migrations.
    pub stream: Option<StreamFigures>,
    /// Whether the guest restarted during the migrations, and how that was
    /// told: the guest's uptime (QEMU) or its workload's processes (netns).
    pub restarted: Option<bool>,
    /// Boots the guest's console shows (QEMU: 1 if it never rebooted; the
    /// console misses what a guest prints between the bench's last read on a
    /// node and its leaving it).
    pub console_boots: Option<usize>,
    /// The agents' restarts of the guest's QEMU after it ended on its own.
    pub qemu_restarts: Option<usize>,
    /// Console lines of kernel trouble (oops, BUG, panic, call traces).
    pub trouble: Vec<String>,
}

/// One `otherix vm migrate`.
#[derive(Debug, Clone)]
pub struct Migration {
    pub from: String,
    pub to: String,
    /// The command's wall clock.
    pub wall: Duration,
    /// Why it failed (the command's error, or where `vm get` found the guest).
    pub failed: Option<String>,
    /// QEMU's own figures (QEMU guests that moved).
    pub qemu: Option<QemuMigration>,
    /// The stream's longest silence around it; `None` when the stream had
    /// broken before it began.
    pub gap: Option<Duration>,
}

#[derive(Debug, Clone)]
pub struct StreamFigures {
    pub sent: u64,
    pub received: u64,
    pub exact: bool,
    pub lost: u64,
    pub broke: Option<String>,
}

/// Builds the testbed and measures both runtimes.
pub fn run(bin: &Path, opts: &Options) -> anyhow::Result<Comparison> {
    preflight(bin)?;
    progress("building the testbed (control plane, node1, node2, gw1)");
    let world = World::new("otherix-bench-qemu").context("cannot make a testbed world (run as root)")?;
    let logs = opts.qemu_logs.join(world.prefix());
    world.keep_logs_in(&logs);
    let mut spec = ClusterSpec::new(bin);
    spec.hypervisors = 2;
    spec.gateways = 1;
    // The boot figure tries HTTP every 100 ms: no broker rate limit in its way.
    spec.extra_server_args = vec!["--broker-rate".into(), "0".into()];
    if let Some(limit) = opts.qemu_downtime {
        spec.extra_agent_args = vec![
            "--qemu-migration-downtime".into(),
            format!("{}ms", limit.as_millis()),
        ];
    }
    let cluster = Cluster::start(world, spec).context("cannot start the cluster")?;
    cluster.cli_ok(&[
        "network", "create", NETWORK, "--type", "overlay", "--subnet", SUBNET,
    ])?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let bed = QBed::new(&cluster, &rt, &logs)?;
    let netns = bed.measure(Kind::Netns, opts)?;
    let qemu = bed.measure(Kind::Qemu, opts)?;
    Ok(Comparison {
        netns,
        qemu,
        migrations: opts.migrations,
        logs,
        downtime_limit: opts.qemu_downtime,
    })
}

/// QEMU must be installed, and the guest image built on the host: the
/// agents in their namespaces have no route to Debian's mirror.
fn preflight(bin: &Path) -> anyhow::Result<()> {
    let qemu = Command::new("qemu-system-x86_64").arg("--version").output();
    if !qemu.is_ok_and(|o| o.status.success()) {
        bail!("qemu-system-x86_64 is not installed\nhint: apt-get install qemu-system-x86");
    }
    progress("building the guest image if it is not cached (otherix image build)");
    let out = Command::new(bin)
        .args(["image", "build", "-o", "json"])
        .output()
        .context("cannot run otherix image build")?;
    if !out.status.success() {
        bail!(
            "otherix image build failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// The testbed as this part uses it.
struct QBed<'a> {
    cluster: &'a Cluster,
    rt: &'a tokio::runtime::Runtime,
    client: Arc<Client>,
    ca_pem: Arc<String>,
    logs: &'a Path,
}

impl<'a> QBed<'a> {
    fn new(
        cluster: &'a Cluster,
        rt: &'a tokio::runtime::Runtime,
        logs: &'a Path,
    ) -> anyhow::Result<QBed<'a>> {
        let ca_pem = std::fs::read_to_string(cluster.ca_file())?;
        let token = std::fs::read_to_string(cluster.cp_dir().join("admin.token"))?;
        let client = Client::new(&cluster.url, &ca_pem, Some(token.trim().to_string()))?;
        Ok(QBed {
            cluster,
            rt,
            client: Arc::new(client),
            ca_pem: Arc::new(ca_pem),
            logs,
        })
    }

    /// Boots, then migrates, guests of one runtime; deletes them after.
    fn measure(&self, kind: Kind, opts: &Options) -> anyhow::Result<Figures> {
        let mut figures = Figures {
            kind,
            accelerator: None,
            boots: Vec::new(),
            rss_after_boot: Vec::new(),
            rss_after_migrations: None,
            migrations: Vec::new(),
            stream: None,
            restarted: None,
            console_boots: None,
            qemu_restarts: None,
            trouble: Vec::new(),
        };
        let mut guest = None;
        for k in 1..=opts.qemu_boots {
            progress(&format!(
                "{}: booting guest {k} of {}",
                kind.name(),
                opts.qemu_boots
            ));
            let name = format!("bq-{}-{k}", kind.name());
            let (took, vm) = self.boot(kind, &name)?;
            figures.boots.push(took);
            std::thread::sleep(RSS_SETTLE);
            let id = field(&vm, "id")?;
            figures.rss_after_boot.push(self.rss(kind, &id)?);
            figures.accelerator = vm["accelerator"].as_str().map(str::to_string);
            if let Some((previous, previous_id)) = guest.replace((name, id)) {
                self.delete(kind, &previous, &previous_id)?;
            }
        }
        let (name, id) = guest.context("no guest booted")?;
        self.migrate_under_stream(kind, &name, &id, opts, &mut figures)?;
        figures.rss_after_migrations = self.rss(kind, &id).ok();
        self.delete(kind, &name, &id)?;
        Ok(figures)
    }

    /// `vm create` on node1, timed until the guest's first HTTP 200 through
    /// the gateway; the VM as `vm get` shows it then.
    fn boot(&self, kind: Kind, name: &str) -> anyhow::Result<(Duration, Value)> {
        let mut args = vec!["vm", "create", name, "--network", NETWORK, "--node", "node1"];
        match kind {
            Kind::Netns => args.extend(["--exec", NETNS_WORKLOAD]),
            Kind::Qemu => args.extend(["--runtime", "qemu", "--memory", QEMU_MEMORY, "--cpus", "1"]),
        }
        let started = Instant::now();
        self.cluster.cli_ok(&args)?;
        let answered = self
            .rt
            .block_on(first_http_200(
                self.client.clone(),
                self.cluster.url.clone(),
                self.ca_pem.clone(),
                name.to_string(),
                started + BOOT_WAIT,
            ))
            .with_context(|| format!("{name} never answered HTTP"))?;
        let vm = self.cluster.cli_json(&["vm", "get", name])?;
        Ok((answered - started, vm))
    }

    /// The guest's resident memory: its QEMU's, or the sum of its
    /// workload's processes (every process in its namespace).
    fn rss(&self, kind: Kind, id: &str) -> anyhow::Result<u64> {
        let pids = self.guest_pids(kind, id);
        if pids.is_empty() {
            bail!("no process runs guest {id}");
        }
        pids.iter()
            .map(|p| procfs::rss_bytes(*p).map_err(anyhow::Error::from))
            .sum()
    }

    fn guest_pids(&self, kind: Kind, id: &str) -> Vec<u32> {
        match kind {
            Kind::Qemu => otherix_testbed::tools::qemu_pids(id),
            Kind::Netns => {
                let netns = format!(
                    "{}{}",
                    self.cluster.world.guest_netns_prefix(),
                    &id[..id.len().min(12)]
                );
                Command::new("ip")
                    .args(["netns", "pids", &netns])
                    .output()
                    .map(|o| {
                        String::from_utf8_lossy(&o.stdout)
                            .split_whitespace()
                            .filter_map(|p| p.parse().ok())
                            .collect()
                    })
                    .unwrap_or_default()
            }
        }
    }

    fn delete(&self, kind: Kind, name: &str, id: &str) -> anyhow::Result<()> {
        self.cluster.cli_ok(&["vm", "delete", name])?;
        wait_until(&format!("{name}'s processes to end"), WAIT, || {
            self.guest_pids(kind, id).is_empty().then_some(())
        })?;
        Ok(())
    }

    /// `--migrations` migrations of guest `name`, alternating between the
    /// two nodes, with an echo stream through the gateway across them all.
    fn migrate_under_stream(
        &self,
        kind: Kind,
        name: &str,
        id: &str,
        opts: &Options,
        figures: &mut Figures,
    ) -> anyhow::Result<()> {
        let alive_before = self.alive(kind, name, id)?;
        let grant = self.rt.block_on(broker_for(&self.client, name, ECHO_PORT))?;
        let tunnel = self
            .rt
            .block_on(otherix_client::tunnel::open_brokered(
                &grant,
                &self.cluster.url,
                &self.ca_pem,
            ))
            .context("cannot open the echo stream")?;
        let stream = EchoStream::start(self.rt, tunnel);
        std::thread::sleep(BETWEEN);

        // The console of each stay on a node, read before the guest leaves it
        // (its directory there goes with it); read again while it stays.
        let mut stays: Vec<String> = Vec::new();
        let mut stay = String::new();
        let mut starts = Vec::new();
        let mut failed_in_a_row = 0;
        for i in 1..=opts.migrations {
            let vm = self.cluster.cli_json(&["vm", "get", name])?;
            let from = field(&vm, "node")?;
            let to = if from == "node1" { "node2" } else { "node1" };
            progress(&format!(
                "{}: migration {i} of {}, {from} → {to}",
                kind.name(),
                opts.migrations
            ));
            if kind == Kind::Qemu {
                stay = self.console(&from, id, i);
            }
            let agent_log = |node: &str| -> String {
                self.cluster
                    .node(node)
                    .ok()
                    .and_then(|n| n.agent.as_ref())
                    .map(|a| a.log())
                    .unwrap_or_default()
            };
            let completed_before = figures::completed_migrations(&agent_log(&from), id).len();
            let started = Instant::now();
            let out = self.cluster.cli(&["vm", "migrate", name, "--to", to])?;
            let wall = started.elapsed();
            starts.push(started);
            let now = self.cluster.cli_json(&["vm", "get", name]).unwrap_or_default();
            let failed = if !out.status.success() {
                Some(format!(
                    "otherix vm migrate: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ))
            } else if now["node"] != to || now["state"] != "running" {
                Some(format!(
                    "vm get shows it {} on {} ({})",
                    now["state"], now["node"], now["reason"]
                ))
            } else {
                None
            };
            let qemu = match (kind, &failed) {
                (Kind::Qemu, None) => wait_until("QEMU's figures in the source agent's log", WAIT, || {
                    let all = figures::completed_migrations(&agent_log(&from), id);
                    (all.len() > completed_before)
                        .then(|| all.last().copied())
                        .flatten()
                })
                .ok(),
                _ => None,
            };
            if let Some(why) = &failed {
                progress(&format!("migration {i} failed: {why}"));
                failed_in_a_row += 1;
            } else {
                failed_in_a_row = 0;
                stays.push(std::mem::take(&mut stay));
            }
            figures.migrations.push(Migration {
                from,
                to: to.to_string(),
                wall,
                failed,
                qemu,
                gap: None,
            });
            std::thread::sleep(BETWEEN);
            if failed_in_a_row >= MAX_FAILED_IN_A_ROW {
                progress(&format!(
                    "{}: giving up after {MAX_FAILED_IN_A_ROW} failed migrations in a row",
                    kind.name()
                ));
                break;
            }
        }
        let tally = stream.finish(self.rt)?;
        let ended = Instant::now();
        for (i, m) in figures.migrations.iter_mut().enumerate() {
            let until = starts.get(i + 1).copied().unwrap_or(ended);
            if tally.broke_after.is_none_or(|b| starts[i] <= b) {
                m.gap = Some(figures::longest_silence(&tally.silences, starts[i], until));
            }
        }
        figures.stream = Some(stream_figures(&tally));
        figures.restarted = Some(match (alive_before, self.alive(kind, name, id)?) {
            (Alive::Uptime(before, at), Alive::Uptime(after, _)) => {
                // A reboot starts the uptime again; allow for a guest clock
                // that ran slow under TCG or stood still in downtimes.
                after < before + at.elapsed().as_secs_f64() / 2.0
            }
            (Alive::Pids(before), Alive::Pids(after)) => before != after,
            _ => true,
        });
        if kind == Kind::Qemu {
            let vm = self.cluster.cli_json(&["vm", "get", name])?;
            stays.push(self.console(&field(&vm, "node")?, id, opts.migrations + 1));
            let consoles = stays.concat();
            std::fs::create_dir_all(self.logs)?;
            let kept = self.logs.join(format!("{name}-console.log"));
            std::fs::write(&kept, &consoles).with_context(|| format!("cannot keep {}", kept.display()))?;
            figures.console_boots = Some(figures::boots(&consoles));
            figures.qemu_restarts = Some(
                ["node1", "node2"]
                    .iter()
                    .filter_map(|n| self.cluster.node(n).ok()?.agent.as_ref())
                    .map(|a| figures::restarts(&a.log(), id))
                    .sum(),
            );
            figures.trouble = figures::kernel_trouble(&consoles);
        }
        Ok(())
    }

    /// The QEMU guest's console log on `node` so far, headed with where it
    /// came from (a node's log goes when the guest leaves it).
    fn console(&self, node: &str, id: &str, read_before_migration: usize) -> String {
        let Ok(n) = self.cluster.node(node) else {
            return String::new();
        };
        let path = n.data_dir.join("qemu").join(id).join("console.log");
        let mut text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| format!("({}: {e})", path.display()));
        if !text.ends_with('\n') {
            text.push('\n');
        }
        format!(
            "==== {node}, read before migration {read_before_migration}: {}\n{text}",
            path.display()
        )
    }

    /// What tells the guest never restarted.
    fn alive(&self, kind: Kind, name: &str, id: &str) -> anyhow::Result<Alive> {
        Ok(match kind {
            Kind::Netns => Alive::Pids({
                let mut p = self.guest_pids(kind, id);
                p.sort();
                p
            }),
            Kind::Qemu => {
                let at = Instant::now();
                let uptime = self.rt.block_on(guest_uptime(
                    self.client.clone(),
                    self.cluster.url.clone(),
                    self.ca_pem.clone(),
                    name.to_string(),
                ))?;
                Alive::Uptime(uptime, at)
            }
        })
    }
}

enum Alive {
    /// The guest's own uptime in seconds (`/cgi-bin/uptime`), and when read.
    Uptime(f64, Instant),
    /// The workload's processes.
    Pids(Vec<u32>),
}

fn stream_figures(t: &Tally) -> StreamFigures {
    StreamFigures {
        sent: t.sent,
        received: t.received,
        exact: t.exact(),
        lost: t.lost(),
        broke: t.broke.clone(),
    }
}

fn field(vm: &Value, name: &str) -> anyhow::Result<String> {
    vm[name]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("the VM has no {name}: {vm}"))
}

/// Tries `GET /` on `vm`'s port 80 through the broker and the gateway every
/// [`HTTP_TRY_EVERY`], several tries in flight, until one is answered 200:
/// when.
async fn first_http_200(
    client: Arc<Client>,
    url: String,
    ca: Arc<String>,
    vm: String,
    deadline: Instant,
) -> anyhow::Result<Instant> {
    let mut tries = tokio::task::JoinSet::new();
    let mut tick = tokio::time::interval(HTTP_TRY_EVERY);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if Instant::now() > deadline {
                    bail!("no HTTP 200 within {}s", BOOT_WAIT.as_secs());
                }
                if tries.len() < 50 {
                    let (client, url, ca, vm) = (client.clone(), url.clone(), ca.clone(), vm.clone());
                    tries.spawn(async move {
                        let answer = http_get(&client, &url, &ca, &vm, "/").await?;
                        is_200(&answer).then(Instant::now)
                    });
                }
            }
            Some(done) = tries.join_next(), if !tries.is_empty() => {
                if let Ok(Some(at)) = done {
                    return Ok(at);
                }
            }
        }
    }
}

/// The guest's uptime in seconds, from its own `/cgi-bin/uptime`.
async fn guest_uptime(client: Arc<Client>, url: String, ca: Arc<String>, vm: String) -> anyhow::Result<f64> {
    let text = http_get(&client, &url, &ca, &vm, "/cgi-bin/uptime")
        .await
        .context("the guest's uptime did not answer")?;
    // The CGI's own header ends with a bare newline: the uptime is the last line.
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .with_context(|| format!("no uptime in {text:?}"))
}

/// One brokered HTTP/1.0 GET through the gateway: the whole answer.
async fn http_get(client: &Client, url: &str, ca: &str, vm: &str, path: &str) -> Option<String> {
    let attempt = async {
        let grant = broker_for(client, vm, HTTP_PORT).await.ok()?;
        let mut t = otherix_client::tunnel::open_brokered(&grant, url, ca)
            .await
            .ok()?;
        t.write_all(format!("GET {path} HTTP/1.0\r\nHost: guest\r\n\r\n").as_bytes())
            .await
            .ok()?;
        let mut out = Vec::new();
        t.read_to_end(&mut out).await.ok()?;
        Some(String::from_utf8_lossy(&out).into_owned())
    };
    tokio::time::timeout(HTTP_ATTEMPT, attempt).await.ok().flatten()
}

fn is_200(answer: &str) -> bool {
    answer
        .split_whitespace()
        .nth(1)
        .is_some_and(|code| answer.starts_with("HTTP/1.") && code == "200")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_200_status_line_is_an_answer() {
        assert!(is_200("HTTP/1.1 200 OK\r\n\r\nhello from bq-qemu-1\n"));
        assert!(is_200("HTTP/1.0 200 OK\r\n\r\n"));
        assert!(!is_200("HTTP/1.1 404 Not Found\r\n\r\n"));
        assert!(!is_200(""));
        assert!(!is_200("200 HTTP/1.1"));
    }
}
