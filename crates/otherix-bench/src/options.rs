//! Command-line options (a handful of flags, parsed by hand) and where the
//! `otherix` binary under test is found.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};

pub const HELP: &str = "\
otherix-bench: direct dial vs the Otherix gateway vs nginx stream+TLS, and the
Otherix relay vs websocat and websockify, on a testbed cluster

Usage: otherix-bench [OPTIONS]          (as root: it builds network namespaces)

Builds a control plane, one hypervisor and one gateway node in network namespaces,
two guests running an echo server and iperf3 (one on an overlay, reached through
the gateway; one on a bridge, reached through the control plane's relay), and
prints one table (stdout) with the goals under it, then the latency table:
64-byte round trips and new connections per second on every path, and
`pgbench -S` against PostgreSQL in the overlay guest directly, through
`otherix forward` and through nginx (needs the postgresql package; the row
says why when it cannot run). Progress goes to stderr. Takes about ten
minutes.

Options:
  --otherix PATH         the otherix binary [default: next to this one]
  --only PARTS           comma-separated subset:
                         broker,setup,throughput,memory,latency [default: all
                         five], or `soak`, `scale`, `qemu` or `resume`
                         (each alone; see below)
  --sessions N           idle gateway sessions for the memory figure [default: 10000]
  --relay-sessions N     idle relay sessions for the CP memory figure [default: 1000]
  --websocat PATH        the websocat binary [default: on PATH, else in
                         $CARGO_HOME/bin, ~/.cargo/bin or /root/.cargo/bin]
  --samples N            connection setups timed per path [default: 500]
  --seconds N            seconds per iperf3 run and per pgbench run [default: 5]
  --rounds N             iperf3 rounds per path and stream count, best kept [default: 2]
  --broker-seconds N     seconds of concurrent broker calls [default: 5]
  --broker-concurrency N broker calls in flight [default: 32]
  --broker-processes N   scale rows: caller processes the calls in flight are
                         spread over (0: in the bench's own process, beside
                         the simulated nodes) [default: 2]
  --hold N               keep the testbed up N seconds after measuring (to attach
                         a profiler or look around; with --only scale, each
                         row's control plane and nodes) [default: 0]

Soak (`--only soak`; not run by default: it needs the control plane with its
default connection caps, which the other parts lift; about ten minutes): a
quiet phase, then one phase per attack, while the agents heartbeat and
connections are brokered and set up through the gateway and the relay;
heartbeat and setup p50/p99, file descriptors and RSS of the control plane
and each agent, quiet and under each attack, side by side. The attacks:
slow clients held against the control plane's API port and the gateway's
port; half-open TLS handshakes against the gateway; one enrolled node
looping heartbeats, waits and certificate calls; one principal brokering
and spending relay tickets to fill the relay's replay cache.
  --soak-attacks LIST    comma-separated, run in this order: slow, half-open,
                         node-flood, relay-fill [default: all four]
  --slow-clients N       slow clients against each of the CP and the gateway
                         [default: 5000]
  --slow-sources N       source addresses they come from (added to the host's
                         leg of the testbed; the CP caps connections per
                         address at 1,000) [default: 8]
  --slow-kinds KINDS     comma-separated mix, dealt out in turn: tcp (connects,
                         never starts TLS), head (TLS, then a request head one
                         byte per interval), body (TLS, a heartbeat POST with
                         Content-Length: 2000000, then one body byte per
                         interval; the gateway reads no body: head there),
                         hello (the first bytes of a TLS ClientHello, never
                         the rest) [default: tcp,head,body]
  --slow-interval N      seconds between a slow client's bytes, and before it
                         comes back when the server turned it away (one the
                         server held and then cut comes back at once)
                         [default: 5]
  --half-open-clients N  half-open connections against the gateway, tcp and
                         hello in turn [default: 12000]
  --half-open-sources N  source addresses they come from (the gateway caps
                         connections per address at 1,000) [default: 8]
  --soak-seconds N       seconds measured per phase [default: 60]
The soak builds the cluster and its guests only (no nginx, websocat,
websockify or iperf3) and adds the source addresses 10.213.N.200 and up to
the testbed's host leg.

Scale (`--only scale`; alone, not run by default; needs neither root nor any
tool but the otherix binary): per row, a fresh `otherix server` on 127.0.0.1
and that many simulated nodes in this process, each enrolled with its own
join token and heartbeating over mutual TLS as an agent does (the wait for
desired-state changes too), reporting every guest it is given as running;
overlays, VMs (most before the nodes enroll, the rest while they heartbeat:
the VM create rate) and LBs through the API; then a steady-state window and
broker calls while the heartbeats go on. Prints per row: CP CPU per
heartbeat and overall (its own CPU-seconds), heartbeats served, heartbeat
p50/p99, credentials/s and CP CPU per credential, VM create rate, `vm list`
time, CP RSS, nodes seen NotReady. Every phase is bounded; a row that cannot
keep up says what it reached. The default rows take about an hour with the
current code (10,000 VMs and 1,000 LBs are created at a few per second);
1000x100000x10000 is the stretch row (name it to run it).
  --scale-rows ROWS      comma-separated NODESxVMS[xLBS]
                         [default: 10x200,100x2000,100x10000,100x10000x1000]
  --scale-interval D     the nodes' heartbeat interval, e.g. 2s, 500ms [default: 2s]
  --scale-window N       seconds of steady state measured [default: 30]
  --scale-settle N       seconds between the last VM running and the window [default: 10]
  --scale-budget N       seconds any one phase (creating, enrolling, placing)
                         may take before the row goes on with what it reached
                         [default: 900]
  --scale-gateways N     nodes of each row that are gateways (the broker needs
                         one), the others hypervisors [default: 1]
  --scale-live-vms N     VMs created while the nodes heartbeat [default: 2 %
                         of the row, 20 to 200]
  --scale-live-batch N   create the live VMs N to a request (POST
                         /v1/vm-batches, all or none), 8 requests in flight,
                         instead of one by one [default: 1]
  --scale-live-in-flight N  requests in flight while creating the live VMs
                         (one client's pipelined rate at the default; more
                         to find the control plane's ceiling) [default: 8]
  --scale-vms-per-network N  VMs per overlay (each a /16) [default: 1000]
  --scale-whole-state-every N  the simulated nodes ignore the digests the
                         CP names and take the whole desired state every N
                         seconds its state changes, as an agent that predates
                         digests does every 300 [default: as the agent: they
                         take changes while the digests are named]
  --scale-max-rss MIB    stop a row whose control plane grows past this
                         [default: 8192]
  --scale-postgres       keep each row's store in a PostgreSQL server the
                         bench starts (otherix server --database), not SQLite
  --scale-replicas N     run N control-plane replicas per row on that
                         PostgreSQL (implies --scale-postgres), the nodes
                         spread over them: brokers through one replica and
                         through all, then kill -9 one and time its nodes'
                         failover [default: 1]
  (--broker-seconds and --broker-concurrency set the broker phase.)

QEMU (`--only qemu`; alone, not run by default; needs root and
qemu-system-x86_64; about ten minutes under TCG): the QEMU guest runtime
beside the namespace runtime on one testbed of its own (a control plane,
node1, node2 and a gateway gw1). The guest image is built on the host first
(`otherix image build`, cached). For each runtime in turn: guests created on
node1, each timed from `vm create` to its first HTTP 200 from port 80
through the gateway (the client library, a new try every 100 ms), and its
resident memory read 2 s later (the QEMU process's; for a namespace guest,
its workload's processes: an HTTP and an echo server, what the QEMU image
serves); then the last one migrated node1 → node2 → node1 ... with an echo
stream (port 7, through the gateway, about 100 KB/s) running across all the
migrations. Per migration: the wall clock of `otherix vm migrate`, the
stream's longest silence (from the migration's start to the next one's), and
for QEMU the downtime, total time and bytes QEMU reports, read from the
source agent's `QEMU migration completed` log line. After them: bytes lost
(count and SHA-256 of what was sent and what came back), failed migrations,
and whether the guest restarted (its uptime for QEMU, its processes for a
namespace guest; and for QEMU the boots and kernel oopses its serial console
shows). Prints both runtimes side by side with p50 / p99 and the range.
  --migrations N         migrations per runtime [default: 20]
  --qemu-boots N         guests booted (and timed) per runtime [default: 3]
  --qemu-logs DIR        where the agents' logs and the QEMU guest's console
                         log are kept, under the world's prefix
                         [default: /tmp/otherix-bench-qemu]
  --qemu-downtime MS     the agents' QEMU downtime limit, in milliseconds
                         (their --qemu-migration-downtime; 1 to 10000)
                         [default: the agent's own, 50]

Resumable relay sessions (`--only resume`; alone, not run by default; needs
root, PostgreSQL's server binaries and iperf3; about seven minutes; issue #31):
a testbed of its own (two control-plane replicas on PostgreSQL, node1 and
node2, a bridge network on both, one guest on node1 running an echo server
and iperf3), every client an `otherix forward` in the host namespace, one
with OTHERIX_RELAY_RESUME=off (the plain relay) and one resumable. Prints:
one-stream iperf3 throughput each way, direct (from node1's namespace),
plain and resumable, over --resume-rounds rounds (each runs plain and
resumable back to back, taking turns at going first), and the ratio: the
median of each round's own resumable / plain (goal: at least 0.90); the CP's (the replica carrying the sessions) and
node1's agent's resident memory per idle session, plain and resumable; and
the resume gap, p50 / p99 (min – max) over --resume-tries tries each, of a
64-byte echo message every millisecond (the longest time between two
arrivals around the event) when the client's connections to the CP are
killed (`ss -K`), when the replica carrying the session is killed (SIGKILL,
then started again), and when the guest migrates (node1 → node2 → node1 ...);
and whether a plain relay stream survived the first try of each.
  --resume-sessions N    idle sessions of each kind [default: 200]
  --resume-tries N       tries of each event [default: 20]
  --resume-rounds N      iperf3 rounds of --seconds each way [default: 10]
  -h, --help             this text

Needs: nginx with its stream module, socat, iperf3, websockify, openssl
(apt-get install nginx libnginx-mod-stream socat iperf3 websockify openssl)
and websocat (cargo install websocat); the soak and the QEMU comparison need
none of them.
";

/// The parts of the benchmark, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Broker,
    Setup,
    Throughput,
    Memory,
    Latency,
    Soak,
    Scale,
    Qemu,
    Resume,
}

impl Part {
    /// Parts that run only when asked for, and then alone: the soak needs
    /// the CP's default caps, which the others lift; the scale rows start
    /// their own control planes, not the testbed; the QEMU comparison
    /// needs two hypervisors and wants the CPU to itself (TCG guests).
    fn alone(self) -> bool {
        matches!(self, Part::Soak | Part::Scale | Part::Qemu | Part::Resume)
    }

    pub fn name(self) -> &'static str {
        match self {
            Part::Broker => "broker",
            Part::Setup => "setup",
            Part::Throughput => "throughput",
            Part::Memory => "memory",
            Part::Latency => "latency",
            Part::Soak => "soak",
            Part::Scale => "scale",
            Part::Qemu => "qemu",
            Part::Resume => "resume",
        }
    }

    fn parse(s: &str) -> anyhow::Result<Part> {
        Ok(match s {
            "broker" => Part::Broker,
            "setup" => Part::Setup,
            "throughput" => Part::Throughput,
            "memory" => Part::Memory,
            "latency" => Part::Latency,
            "soak" => Part::Soak,
            "scale" => Part::Scale,
            "qemu" => Part::Qemu,
            "resume" => Part::Resume,
            other => {
                bail!("unknown part {other:?}; the parts are broker, setup, throughput, memory, latency, soak, scale, qemu, resume")
            }
        })
    }
}

#[derive(Debug, Clone)]
pub struct Options {
    pub otherix: Option<PathBuf>,
    pub only: Option<Vec<Part>>,
    pub sessions: usize,
    pub relay_sessions: usize,
    pub websocat: Option<PathBuf>,
    pub samples: usize,
    pub seconds: u64,
    pub rounds: usize,
    pub broker_time: Duration,
    pub broker_concurrency: usize,
    /// Scale rows: caller processes the broker calls are spread over (0: in
    /// this process).
    pub broker_processes: usize,
    pub hold: Duration,
    pub slow_clients: usize,
    pub slow_sources: usize,
    pub slow_kinds: Vec<SlowKind>,
    pub slow_interval: Duration,
    pub soak_attacks: Vec<Attack>,
    pub half_open_clients: usize,
    pub half_open_sources: usize,
    pub soak_time: Duration,
    pub scale_rows: Vec<crate::scale::plan::Row>,
    pub scale_interval: Duration,
    pub scale_window: Duration,
    pub scale_settle: Duration,
    pub scale_budget: Duration,
    pub scale_gateways: usize,
    pub scale_vms_per_network: usize,
    pub scale_live_vms: Option<usize>,
    /// Simulated nodes that take the whole state this often, ignoring
    /// digests (`None`: as the agent).
    pub scale_whole_state_every: Option<Duration>,
    /// VMs per request when creating the live VMs (1: one by one).
    pub scale_live_batch: usize,
    /// Requests in flight while creating the live VMs.
    pub scale_live_in_flight: usize,
    pub scale_max_rss_mib: u64,
    pub scale_postgres: bool,
    /// Control-plane replicas per scale row (more than one: on PostgreSQL).
    pub scale_replicas: usize,
    /// Migrations per runtime in the QEMU comparison.
    pub migrations: usize,
    /// Guests booted per runtime in the QEMU comparison.
    pub qemu_boots: usize,
    /// Where the QEMU comparison keeps its logs.
    pub qemu_logs: PathBuf,
    /// The agents' QEMU downtime limit in the QEMU comparison (`None`: the
    /// agent's default).
    pub qemu_downtime: Option<Duration>,
    /// Idle relay sessions of each kind (plain, resumable) for the
    /// resumable-sessions memory figure.
    pub resume_sessions: usize,
    /// Tries of each event (dropped connection, failover, migration) for
    /// the resume gap.
    pub resume_tries: usize,
    /// iperf3 rounds of the resume part (each: direct, plain, resumable).
    pub resume_rounds: usize,
    /// The command line as given, for the report.
    pub command_line: String,
}

impl Options {
    /// Whether `part` runs: the soak and the scale rows only when asked for.
    pub fn runs(&self, part: Part) -> bool {
        match &self.only {
            Some(parts) => parts.contains(&part),
            None => !part.alone(),
        }
    }
}

/// Most source addresses the slow clients may come from (host numbers
/// 200..=249 of the testbed's /24, which its few namespaces never reach).
pub const MAX_SLOW_SOURCES: usize = 50;

/// What a slow client of the soak does once connected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlowKind {
    /// Connects and never starts TLS.
    Tcp,
    /// Completes TLS, then sends a request head one byte per interval.
    Head,
    /// Completes TLS, sends a heartbeat POST's head with a 2 MB
    /// Content-Length, then one body byte per interval.
    Body,
    /// Sends the first bytes of a TLS ClientHello and never the rest: a
    /// handshake begun and left half-open.
    Hello,
}

impl SlowKind {
    fn parse(s: &str) -> anyhow::Result<SlowKind> {
        Ok(match s {
            "tcp" => SlowKind::Tcp,
            "head" => SlowKind::Head,
            "body" => SlowKind::Body,
            "hello" => SlowKind::Hello,
            other => bail!("unknown slow-client kind {other:?}; the kinds are tcp, head, body, hello"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            SlowKind::Tcp => "tcp",
            SlowKind::Head => "head",
            SlowKind::Body => "body",
            SlowKind::Hello => "hello",
        }
    }
}

/// What the soak does to the cluster in one of its phases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attack {
    /// Slow clients against the CP's API port and the gateway's port.
    SlowClients,
    /// TCP connections to the gateway that never finish the TLS handshake.
    HalfOpen,
    /// One enrolled node looping heartbeats, waits and certificate calls.
    NodeFlood,
    /// One principal brokering and spending relay tickets as fast as it can.
    RelayFill,
}

impl Attack {
    pub const ALL: [Attack; 4] = [
        Attack::SlowClients,
        Attack::HalfOpen,
        Attack::NodeFlood,
        Attack::RelayFill,
    ];

    fn parse(s: &str) -> anyhow::Result<Attack> {
        Attack::ALL.into_iter().find(|a| a.name() == s).with_context(|| {
            format!("unknown attack {s:?}; the attacks are slow, half-open, node-flood, relay-fill")
        })
    }

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Attack::SlowClients => "slow",
            Attack::HalfOpen => "half-open",
            Attack::NodeFlood => "node-flood",
            Attack::RelayFill => "relay-fill",
        }
    }

    /// What it is, for the report.
    pub fn title(self) -> &'static str {
        match self {
            Attack::SlowClients => "slow clients",
            Attack::HalfOpen => "half-open flood (gateway)",
            Attack::NodeFlood => "node flood",
            Attack::RelayFill => "relay cache fill",
        }
    }
}

#[derive(Debug)]
pub enum Command {
    Run(Box<Options>),
    Help,
    /// Internal: run inside the gateway node's namespace (re-executed there)
    /// to time plain TCP dials to the guest.
    ProbeDirect {
        addr: SocketAddr,
        count: usize,
    },
    /// Internal: round trips of 64-byte messages over one connection, from
    /// inside a node's namespace.
    ProbePingpong {
        addr: SocketAddr,
        count: usize,
    },
    /// Internal: new connections per second with a byte echoed, from inside
    /// a node's namespace.
    ProbeConnections {
        addr: SocketAddr,
        millis: u64,
        concurrency: usize,
    },
    /// Internal: one of the scale rows' broker caller processes.
    ProbeBroker {
        vms: usize,
        callers: usize,
        millis: u64,
        seed: u64,
    },
}

/// Hidden subcommand name for [`Command::ProbeDirect`].
pub const PROBE_DIRECT: &str = "__probe-direct";
/// Hidden subcommand name for [`Command::ProbePingpong`].
pub const PROBE_PINGPONG: &str = "__probe-pingpong";
/// Hidden subcommand name for [`Command::ProbeConnections`].
pub const PROBE_CONNECTIONS: &str = "__probe-connections";

pub fn parse(args: impl Iterator<Item = String>) -> anyhow::Result<Command> {
    let args: Vec<String> = args.collect();
    if args.first().map(String::as_str) == Some(PROBE_DIRECT) {
        let addr = args.get(1).context("missing address")?.parse()?;
        let count = args.get(2).context("missing count")?.parse()?;
        return Ok(Command::ProbeDirect { addr, count });
    }
    if args.first().map(String::as_str) == Some(PROBE_PINGPONG) {
        let addr = args.get(1).context("missing address")?.parse()?;
        let count = args.get(2).context("missing count")?.parse()?;
        return Ok(Command::ProbePingpong { addr, count });
    }
    if args.first().map(String::as_str) == Some(PROBE_CONNECTIONS) {
        let addr = args.get(1).context("missing address")?.parse()?;
        let millis = args.get(2).context("missing duration")?.parse()?;
        let concurrency = args.get(3).context("missing concurrency")?.parse()?;
        return Ok(Command::ProbeConnections {
            addr,
            millis,
            concurrency,
        });
    }
    if args.first().map(String::as_str) == Some(crate::scale::load::PROBE_BROKER) {
        let field = |i: usize, what: &str| -> anyhow::Result<u64> {
            Ok(args.get(i).with_context(|| format!("missing {what}"))?.parse()?)
        };
        return Ok(Command::ProbeBroker {
            vms: field(1, "VM count")? as usize,
            callers: field(2, "caller count")? as usize,
            millis: field(3, "duration")?,
            seed: field(4, "seed")?,
        });
    }
    let mut opts = Options {
        otherix: None,
        only: None,
        sessions: 10_000,
        relay_sessions: 1_000,
        websocat: None,
        samples: 500,
        seconds: 5,
        rounds: 2,
        broker_time: Duration::from_secs(5),
        broker_concurrency: 32,
        broker_processes: 2,
        hold: Duration::ZERO,
        slow_clients: 5_000,
        slow_sources: 8,
        slow_kinds: vec![SlowKind::Tcp, SlowKind::Head, SlowKind::Body],
        slow_interval: Duration::from_secs(5),
        soak_attacks: Attack::ALL.to_vec(),
        half_open_clients: 12_000,
        half_open_sources: 8,
        soak_time: Duration::from_secs(60),
        scale_rows: crate::scale::plan::Row::defaults(),
        scale_interval: Duration::from_secs(2),
        scale_window: Duration::from_secs(30),
        scale_settle: Duration::from_secs(10),
        scale_budget: Duration::from_secs(900),
        scale_gateways: 1,
        scale_vms_per_network: 1_000,
        scale_live_vms: None,
        scale_whole_state_every: None,
        scale_live_batch: 1,
        scale_live_in_flight: crate::scale::load::CREATE_CONCURRENCY,
        scale_max_rss_mib: 8_192,
        scale_postgres: false,
        scale_replicas: 1,
        migrations: 20,
        qemu_boots: 3,
        qemu_logs: PathBuf::from("/tmp/otherix-bench-qemu"),
        qemu_downtime: None,
        resume_sessions: 200,
        resume_tries: 20,
        resume_rounds: 10,
        command_line: std::iter::once("otherix-bench".to_string())
            .chain(args.iter().cloned())
            .collect::<Vec<_>>()
            .join(" "),
    };
    let mut it = args.into_iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "--otherix" => opts.otherix = Some(PathBuf::from(value()?)),
            "--only" => {
                opts.only = Some(
                    value()?
                        .split(',')
                        .map(Part::parse)
                        .collect::<anyhow::Result<_>>()?,
                )
            }
            "--sessions" => opts.sessions = number(&flag, &value()?, 1)?,
            "--relay-sessions" => opts.relay_sessions = number(&flag, &value()?, 1)?,
            "--websocat" => opts.websocat = Some(PathBuf::from(value()?)),
            "--samples" => opts.samples = number(&flag, &value()?, 10)?,
            "--seconds" => opts.seconds = number(&flag, &value()?, 1)? as u64,
            "--rounds" => opts.rounds = number(&flag, &value()?, 1)?,
            "--broker-seconds" => opts.broker_time = Duration::from_secs(number(&flag, &value()?, 1)? as u64),
            "--broker-concurrency" => opts.broker_concurrency = number(&flag, &value()?, 1)?,
            "--broker-processes" => opts.broker_processes = number(&flag, &value()?, 0)?,
            "--hold" => opts.hold = Duration::from_secs(number(&flag, &value()?, 0)? as u64),
            "--slow-clients" => opts.slow_clients = number(&flag, &value()?, 1)?,
            "--slow-sources" => {
                opts.slow_sources = number(&flag, &value()?, 1)?;
                if opts.slow_sources > MAX_SLOW_SOURCES {
                    bail!("--slow-sources must be at most {MAX_SLOW_SOURCES}");
                }
            }
            "--slow-kinds" => {
                opts.slow_kinds = value()?
                    .split(',')
                    .map(SlowKind::parse)
                    .collect::<anyhow::Result<_>>()?
            }
            "--slow-interval" => {
                opts.slow_interval = Duration::from_secs(number(&flag, &value()?, 1)? as u64)
            }
            "--soak-attacks" => {
                opts.soak_attacks = value()?
                    .split(',')
                    .map(Attack::parse)
                    .collect::<anyhow::Result<_>>()?
            }
            "--half-open-clients" => opts.half_open_clients = number(&flag, &value()?, 1)?,
            "--half-open-sources" => {
                opts.half_open_sources = number(&flag, &value()?, 1)?;
                if opts.half_open_sources > MAX_SLOW_SOURCES {
                    bail!("--half-open-sources must be at most {MAX_SLOW_SOURCES}");
                }
            }
            "--soak-seconds" => opts.soak_time = Duration::from_secs(number(&flag, &value()?, 10)? as u64),
            "--scale-rows" => opts.scale_rows = crate::scale::plan::Row::parse_list(&value()?)?,
            "--scale-interval" => opts.scale_interval = interval(&flag, &value()?)?,
            "--scale-window" => opts.scale_window = Duration::from_secs(number(&flag, &value()?, 5)? as u64),
            "--scale-settle" => opts.scale_settle = Duration::from_secs(number(&flag, &value()?, 0)? as u64),
            "--scale-budget" => opts.scale_budget = Duration::from_secs(number(&flag, &value()?, 10)? as u64),
            "--scale-gateways" => opts.scale_gateways = number(&flag, &value()?, 1)?,
            "--scale-vms-per-network" => opts.scale_vms_per_network = number(&flag, &value()?, 1)?,
            "--scale-live-vms" => opts.scale_live_vms = Some(number(&flag, &value()?, 0)?),
            "--scale-whole-state-every" => {
                opts.scale_whole_state_every = Some(Duration::from_secs(number(&flag, &value()?, 1)? as u64))
            }
            "--scale-live-batch" => {
                opts.scale_live_batch = number(&flag, &value()?, 1)?;
                if opts.scale_live_batch > 1000 {
                    bail!("--scale-live-batch must be at most 1000 (the API's batch)");
                }
            }
            "--scale-live-in-flight" => {
                opts.scale_live_in_flight = number(&flag, &value()?, 1)?;
                if opts.scale_live_in_flight > 1024 {
                    bail!("--scale-live-in-flight must be at most 1024");
                }
            }
            "--scale-max-rss" => opts.scale_max_rss_mib = number(&flag, &value()?, 64)? as u64,
            "--scale-postgres" => opts.scale_postgres = true,
            "--scale-replicas" => {
                opts.scale_replicas = number(&flag, &value()?, 1)?;
                if opts.scale_replicas > 1 {
                    opts.scale_postgres = true;
                }
            }
            "--migrations" => opts.migrations = number(&flag, &value()?, 1)?,
            "--qemu-boots" => opts.qemu_boots = number(&flag, &value()?, 1)?,
            "--qemu-logs" => opts.qemu_logs = PathBuf::from(value()?),
            "--qemu-downtime" => {
                let ms = number(&flag, &value()?, 1)?;
                if ms > 10_000 {
                    bail!("--qemu-downtime must be between 1 and 10000 (milliseconds)");
                }
                opts.qemu_downtime = Some(Duration::from_millis(ms as u64));
            }
            "--resume-sessions" => opts.resume_sessions = number(&flag, &value()?, 1)?,
            "--resume-tries" => opts.resume_tries = number(&flag, &value()?, 1)?,
            "--resume-rounds" => opts.resume_rounds = number(&flag, &value()?, 1)?,
            other => bail!("unknown argument {other:?}"),
        }
    }
    if let Some(parts) = &opts.only {
        for alone in [Part::Soak, Part::Scale, Part::Qemu, Part::Resume] {
            if parts.contains(&alone) && parts.iter().any(|p| *p != alone) {
                bail!(
                    "{} runs alone: {}\nhint: --only {}",
                    alone.name(),
                    match alone {
                        Part::Soak =>
                            "it needs the control plane's default connection caps, which the other parts lift",
                        Part::Qemu | Part::Resume => "it builds a testbed of its own, with two hypervisors",
                        _ => "it starts control planes of its own, not the testbed",
                    },
                    alone.name()
                );
            }
        }
    }
    Ok(Command::Run(Box::new(opts)))
}

/// A heartbeat interval: `2s`, `500ms`, or seconds (`2`); 100 ms to 60 s.
fn interval(flag: &str, text: &str) -> anyhow::Result<Duration> {
    let t = text.trim();
    let d = if let Some(ms) = t.strip_suffix("ms") {
        ms.trim().parse::<u64>().ok().map(Duration::from_millis)
    } else {
        t.strip_suffix('s')
            .unwrap_or(t)
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64)
    }
    .with_context(|| format!("{flag}: {text:?} is not a duration (2s, 500ms)"))?;
    if !(Duration::from_millis(100)..=Duration::from_secs(60)).contains(&d) {
        bail!("{flag} must be between 100ms and 60s");
    }
    Ok(d)
}

/// A count of at least `min`, and not absurd (every loop stays bounded).
fn number(flag: &str, text: &str, min: usize) -> anyhow::Result<usize> {
    let n: usize = text
        .parse()
        .with_context(|| format!("{flag}: {text:?} is not a number"))?;
    if !(min..=100_000).contains(&n) {
        bail!("{flag} must be between {min} and 100000");
    }
    Ok(n)
}

/// `--otherix`, or `otherix` in this binary's directory (`target/release`).
/// Under `cargo run`, that one is first brought up to date (`cargo build -p
/// otherix` with this binary's profile), so the bench never measures a
/// stale build.
pub fn otherix_binary(opts: &Options) -> anyhow::Result<PathBuf> {
    let path = match &opts.otherix {
        Some(p) => p.clone(),
        None => {
            let dir = std::env::current_exe()
                .context("cannot locate this binary")?
                .parent()
                .context("this binary has no directory")?
                .to_path_buf();
            build_otherix_under_cargo(&dir)?;
            dir.join("otherix")
        }
    };
    if !path.is_file() {
        bail!(
            "no otherix binary at {}\nhint: cargo build --release -p otherix (or pass --otherix PATH)",
            path.display()
        );
    }
    Ok(path)
}

/// With `cargo run` (which sets `CARGO` and `CARGO_MANIFEST_PATH`), builds
/// the `otherix` binary into `dir` with the profile `dir` is named after.
fn build_otherix_under_cargo(dir: &std::path::Path) -> anyhow::Result<()> {
    let (Some(cargo), Some(manifest)) = (std::env::var_os("CARGO"), std::env::var_os("CARGO_MANIFEST_PATH"))
    else {
        return Ok(());
    };
    let profile = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let profile = if profile == "debug" {
        "dev".to_string()
    } else {
        profile
    };
    eprintln!("otherix-bench: building otherix ({profile} profile)...");
    let status = std::process::Command::new(cargo)
        .arg("build")
        .arg("--manifest-path")
        .arg(manifest)
        .args(["-p", "otherix", "--profile", &profile])
        .status()
        .context("cannot run cargo")?;
    if !status.success() {
        bail!("cargo build -p otherix failed ({status})");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_run(args: &[&str]) -> Options {
        match parse(args.iter().map(|s| s.to_string())).unwrap() {
            Command::Run(o) => *o,
            other => panic!("expected a run, got {other:?}"),
        }
    }

    #[test]
    fn defaults_measure_everything_with_ten_thousand_sessions() {
        let o = parse_run(&[]);
        assert_eq!(o.sessions, 10_000);
        assert!(o.runs(Part::Broker) && o.runs(Part::Memory));
    }

    #[test]
    fn only_restricts_the_parts() {
        let o = parse_run(&["--only", "broker,memory", "--sessions", "500"]);
        assert!(o.runs(Part::Broker) && o.runs(Part::Memory));
        assert!(!o.runs(Part::Setup) && !o.runs(Part::Throughput));
        assert_eq!(o.sessions, 500);
        assert_eq!(
            o.command_line,
            "otherix-bench --only broker,memory --sessions 500"
        );
    }

    #[test]
    fn broker_callers_run_in_two_processes_unless_told_otherwise() {
        assert_eq!(parse_run(&[]).broker_processes, 2);
        assert_eq!(parse_run(&["--broker-processes", "0"]).broker_processes, 0);
        let probe = parse(
            [crate::scale::load::PROBE_BROKER, "10000", "128", "15000", "1"]
                .iter()
                .map(|s| s.to_string()),
        )
        .unwrap();
        assert!(matches!(
            probe,
            Command::ProbeBroker {
                vms: 10_000,
                callers: 128,
                millis: 15_000,
                seed: 1
            }
        ));
        assert!(parse(
            [crate::scale::load::PROBE_BROKER, "10"]
                .iter()
                .map(|s| s.to_string())
        )
        .is_err());
    }

    #[test]
    fn relay_sessions_and_websocat_are_options() {
        let o = parse_run(&[]);
        assert_eq!((o.relay_sessions, o.websocat), (1_000, None));
        let o = parse_run(&["--relay-sessions", "200", "--websocat", "/opt/websocat"]);
        assert_eq!(o.relay_sessions, 200);
        assert_eq!(o.websocat, Some(PathBuf::from("/opt/websocat")));
        assert!(parse(["--relay-sessions", "0"].iter().map(|s| s.to_string())).is_err());
        assert!(parse(["--websocat"].iter().map(|s| s.to_string())).is_err());
    }

    #[test]
    fn the_soak_runs_every_attack_unless_told_which() {
        let o = parse_run(&["--only", "soak"]);
        assert_eq!(o.soak_attacks, Attack::ALL.to_vec());
        assert_eq!((o.half_open_clients, o.half_open_sources), (12_000, 8));
        let o = parse_run(&[
            "--only",
            "soak",
            "--soak-attacks",
            "relay-fill,half-open",
            "--half-open-clients",
            "800",
            "--half-open-sources",
            "2",
            "--slow-kinds",
            "hello",
        ]);
        assert_eq!(o.soak_attacks, vec![Attack::RelayFill, Attack::HalfOpen]);
        assert_eq!((o.half_open_clients, o.half_open_sources), (800, 2));
        assert_eq!(o.slow_kinds, vec![SlowKind::Hello]);
        let err = parse(["--soak-attacks", "ddos"].iter().map(|s| s.to_string())).unwrap_err();
        assert!(
            err.to_string().contains("the attacks are slow, half-open"),
            "{err}"
        );
    }

    #[test]
    fn the_soak_runs_only_when_asked_for_and_alone() {
        let o = parse_run(&[]);
        assert!(!o.runs(Part::Soak));
        assert_eq!((o.slow_clients, o.slow_sources), (5_000, 8));
        assert_eq!(o.slow_kinds, vec![SlowKind::Tcp, SlowKind::Head, SlowKind::Body]);
        let o = parse_run(&[
            "--only",
            "soak",
            "--slow-clients",
            "300",
            "--slow-kinds",
            "tcp,head",
            "--soak-seconds",
            "20",
        ]);
        assert!(o.runs(Part::Soak) && !o.runs(Part::Setup));
        assert_eq!(o.slow_clients, 300);
        assert_eq!(o.slow_kinds, vec![SlowKind::Tcp, SlowKind::Head]);
        assert_eq!(o.soak_time, Duration::from_secs(20));
        let refused = |args: &[&str]| parse(args.iter().map(|s| s.to_string())).is_err();
        assert!(refused(&["--only", "soak,setup"]));
        assert!(refused(&["--slow-kinds", "tcp,loris"]));
        assert!(refused(&["--slow-sources", "51"]));
    }

    #[test]
    fn the_scale_rows_run_only_when_asked_for_and_alone() {
        let o = parse_run(&[]);
        assert!(!o.runs(Part::Scale));
        assert_eq!(o.scale_rows.len(), 4);
        assert_eq!(
            (o.scale_interval, o.scale_window),
            (Duration::from_secs(2), Duration::from_secs(30))
        );
        let o = parse_run(&[
            "--only",
            "scale",
            "--scale-rows",
            "10x200,1000x100000x10000",
            "--scale-interval",
            "500ms",
            "--scale-live-vms",
            "0",
            "--scale-live-in-flight",
            "32",
        ]);
        assert!(o.runs(Part::Scale) && !o.runs(Part::Broker) && !o.runs(Part::Soak));
        assert_eq!(o.scale_rows[1].lbs, 10_000);
        assert_eq!(o.scale_interval, Duration::from_millis(500));
        assert_eq!(o.scale_live_vms, Some(0));
        assert_eq!(o.scale_live_in_flight, 32);
        assert_eq!(
            parse_run(&["--only", "scale"]).scale_live_in_flight,
            8,
            "one client's pipeline"
        );
        let refused = |args: &[&str]| parse(args.iter().map(|s| s.to_string())).is_err();
        assert!(refused(&["--only", "scale,broker"]));
        assert!(refused(&["--only", "scale,soak"]));
        assert!(refused(&["--scale-rows", "10by200"]));
        assert!(refused(&["--scale-live-in-flight", "0"]));
        assert!(refused(&["--scale-live-in-flight", "1025"]));
        assert!(refused(&["--scale-interval", "10ms"]));
        assert!(refused(&["--scale-interval", "soon"]));
    }

    #[test]
    fn the_qemu_comparison_runs_only_when_asked_for_and_alone() {
        let o = parse_run(&[]);
        assert!(!o.runs(Part::Qemu));
        assert_eq!((o.migrations, o.qemu_boots), (20, 3));
        let o = parse_run(&[
            "--only",
            "qemu",
            "--migrations",
            "4",
            "--qemu-boots",
            "1",
            "--qemu-logs",
            "/var/tmp/q",
            "--qemu-downtime",
            "10",
        ]);
        assert!(o.runs(Part::Qemu) && !o.runs(Part::Broker));
        assert_eq!((o.migrations, o.qemu_boots), (4, 1));
        assert_eq!(o.qemu_logs, PathBuf::from("/var/tmp/q"));
        assert_eq!(o.qemu_downtime, Some(Duration::from_millis(10)));
        assert_eq!(parse_run(&[]).qemu_downtime, None);
        for bad in ["0", "10001", "10ms"] {
            assert!(
                parse(["--qemu-downtime", bad].iter().map(|s| s.to_string())).is_err(),
                "{bad}"
            );
        }
        let err = parse(["--only", "qemu,broker"].iter().map(|s| s.to_string())).unwrap_err();
        assert!(err.to_string().contains("hint: --only qemu"), "{err}");
        assert!(parse(["--migrations", "0"].iter().map(|s| s.to_string())).is_err());
    }

    #[test]
    fn the_help_documents_the_qemu_comparison_and_its_options() {
        for text in [
            "--only qemu",
            "--migrations N",
            "--qemu-boots N",
            "--qemu-logs DIR",
            "--qemu-downtime MS",
        ] {
            assert!(HELP.contains(text), "{text}");
        }
    }

    #[test]
    fn the_resume_part_runs_only_when_asked_for_and_alone() {
        let o = parse_run(&[]);
        assert!(!o.runs(Part::Resume));
        assert_eq!(
            (o.resume_sessions, o.resume_tries, o.resume_rounds),
            (200, 20, 10)
        );
        let o = parse_run(&[
            "--only",
            "resume",
            "--resume-sessions",
            "50",
            "--resume-tries",
            "3",
            "--resume-rounds",
            "7",
        ]);
        assert!(o.runs(Part::Resume) && !o.runs(Part::Throughput));
        assert_eq!((o.resume_sessions, o.resume_tries, o.resume_rounds), (50, 3, 7));
        let err = parse(["--only", "resume,memory"].iter().map(|s| s.to_string())).unwrap_err();
        assert!(err.to_string().contains("hint: --only resume"), "{err}");
        assert!(parse(["--resume-tries", "0"].iter().map(|s| s.to_string())).is_err());
        assert!(parse(["--resume-rounds", "0"].iter().map(|s| s.to_string())).is_err());
        for text in [
            "--only resume",
            "--resume-sessions N",
            "--resume-tries N",
            "--resume-rounds N",
        ] {
            assert!(HELP.contains(text), "{text}");
        }
    }

    #[test]
    fn intervals_take_seconds_or_milliseconds() {
        assert_eq!(interval("f", "2s").unwrap(), Duration::from_secs(2));
        assert_eq!(interval("f", "2").unwrap(), Duration::from_secs(2));
        assert_eq!(interval("f", "1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(interval("f", "250ms").unwrap(), Duration::from_millis(250));
        assert!(interval("f", "61s").is_err());
        assert!(interval("f", "-1s").is_err());
        assert!(interval("f", "ms").is_err());
    }

    #[test]
    fn nonsense_is_refused() {
        assert!(parse(["--only", "speed"].iter().map(|s| s.to_string())).is_err());
        assert!(parse(["--sessions", "0"].iter().map(|s| s.to_string())).is_err());
        assert!(parse(["--seconds"].iter().map(|s| s.to_string())).is_err());
        assert!(parse(["--frobnicate"].iter().map(|s| s.to_string())).is_err());
    }
}
