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
prints one table (stdout) with the goals under it. Progress goes to stderr.
Takes about eight minutes.

Options:
  --otherix PATH         the otherix binary [default: next to this one]
  --only PARTS           comma-separated subset: broker,setup,throughput,memory
                         [default: all four], or `soak` (alone; see below)
  --sessions N           idle gateway sessions for the memory figure [default: 10000]
  --relay-sessions N     idle relay sessions for the CP memory figure [default: 1000]
  --websocat PATH        the websocat binary [default: on PATH, else in
                         $CARGO_HOME/bin, ~/.cargo/bin or /root/.cargo/bin]
  --samples N            connection setups timed per path [default: 500]
  --seconds N            seconds per iperf3 run [default: 5]
  --rounds N             iperf3 rounds per path and stream count, best kept [default: 2]
  --broker-seconds N     seconds of concurrent broker calls [default: 5]
  --broker-concurrency N broker calls in flight [default: 32]
  --hold N               keep the testbed up N seconds after measuring (to attach
                         a profiler or look around) [default: 0]

Soak (`--only soak`; not run by default: it needs the control plane with its
default connection caps, which the other parts lift; about three minutes):
slow clients held against the control plane's API port and against the
gateway's port, while the agents heartbeat and connections are brokered and
set up; heartbeat and setup p50/p99, file descriptors and RSS of the control
plane and each agent, without and with the flood, side by side.
  --slow-clients N       slow clients against each of the CP and the gateway
                         [default: 5000]
  --slow-sources N       source addresses they come from (added to the host's
                         leg of the testbed; the CP caps connections per
                         address at 1,000) [default: 8]
  --slow-kinds KINDS     comma-separated mix, dealt out in turn: tcp (connects,
                         never starts TLS), head (TLS, then a request head one
                         byte per interval), body (TLS, a heartbeat POST with
                         Content-Length: 2000000, then one body byte per
                         interval; the gateway reads no body: head there)
                         [default: tcp,head,body]
  --slow-interval N      seconds between a slow client's bytes, and before it
                         comes back when the server turned it away (one the
                         server held and then cut comes back at once)
                         [default: 5]
  --soak-seconds N       seconds measured per phase [default: 60]
The soak builds the cluster and its guests only (no nginx, websocat,
websockify or iperf3) and adds the source addresses 10.213.N.200 and up to
the testbed's host leg.
  -h, --help             this text

Needs: nginx with its stream module, socat, iperf3, websockify, openssl
(apt-get install nginx libnginx-mod-stream socat iperf3 websockify openssl)
and websocat (cargo install websocat); the soak needs none of them.
";

/// The parts of the benchmark, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Broker,
    Setup,
    Throughput,
    Memory,
    Soak,
}

impl Part {
    fn parse(s: &str) -> anyhow::Result<Part> {
        Ok(match s {
            "broker" => Part::Broker,
            "setup" => Part::Setup,
            "throughput" => Part::Throughput,
            "memory" => Part::Memory,
            "soak" => Part::Soak,
            other => bail!("unknown part {other:?}; the parts are broker, setup, throughput, memory, soak"),
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
    pub hold: Duration,
    pub slow_clients: usize,
    pub slow_sources: usize,
    pub slow_kinds: Vec<SlowKind>,
    pub slow_interval: Duration,
    pub soak_time: Duration,
    /// The command line as given, for the report.
    pub command_line: String,
}

impl Options {
    /// Whether `part` runs: the soak only when asked for.
    pub fn runs(&self, part: Part) -> bool {
        match &self.only {
            Some(parts) => parts.contains(&part),
            None => part != Part::Soak,
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
}

impl SlowKind {
    fn parse(s: &str) -> anyhow::Result<SlowKind> {
        Ok(match s {
            "tcp" => SlowKind::Tcp,
            "head" => SlowKind::Head,
            "body" => SlowKind::Body,
            other => bail!("unknown slow-client kind {other:?}; the kinds are tcp, head, body"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            SlowKind::Tcp => "tcp",
            SlowKind::Head => "head",
            SlowKind::Body => "body",
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
}

/// Hidden subcommand name for [`Command::ProbeDirect`].
pub const PROBE_DIRECT: &str = "__probe-direct";

pub fn parse(args: impl Iterator<Item = String>) -> anyhow::Result<Command> {
    let args: Vec<String> = args.collect();
    if args.first().map(String::as_str) == Some(PROBE_DIRECT) {
        let addr = args.get(1).context("missing address")?.parse()?;
        let count = args.get(2).context("missing count")?.parse()?;
        return Ok(Command::ProbeDirect { addr, count });
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
        hold: Duration::ZERO,
        slow_clients: 5_000,
        slow_sources: 8,
        slow_kinds: vec![SlowKind::Tcp, SlowKind::Head, SlowKind::Body],
        slow_interval: Duration::from_secs(5),
        soak_time: Duration::from_secs(60),
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
            "--soak-seconds" => opts.soak_time = Duration::from_secs(number(&flag, &value()?, 10)? as u64),
            other => bail!("unknown argument {other:?}"),
        }
    }
    if opts.runs(Part::Soak)
        && opts
            .only
            .as_ref()
            .is_some_and(|p| p.iter().any(|p| *p != Part::Soak))
    {
        bail!("soak runs alone: it needs the control plane's default connection caps, which the other parts lift\nhint: --only soak");
    }
    Ok(Command::Run(Box::new(opts)))
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
    fn nonsense_is_refused() {
        assert!(parse(["--only", "speed"].iter().map(|s| s.to_string())).is_err());
        assert!(parse(["--sessions", "0"].iter().map(|s| s.to_string())).is_err());
        assert!(parse(["--seconds"].iter().map(|s| s.to_string())).is_err());
        assert!(parse(["--frobnicate"].iter().map(|s| s.to_string())).is_err());
    }
}
