//! Throughput with 1 and 8 streams, and CPU per GB moved: iperf3's server
//! runs in the guest; its client goes through each path (`-c 127.0.0.1 -p
//! LOCALPORT` against `otherix forward` or socat; for the direct row, from
//! the gateway node's namespace to the guest). The paths take turns, round
//! after round, so a neighbour's load on this shared machine falls on all of
//! them; the best round of each is kept. CPU is read from `/proc` before and
//! after every run: the gateway agent, nginx (master and workers), and the
//! client-side wrapper (`otherix forward`; socat and the children it forked).
//! For the bridge guest's paths, the server side is everything between the
//! client wrapper and the guest: the CP and `node1`'s agent for the relay;
//! the WebSocket server and the node's socat (with their children) for
//! websocat and websockify, plus the CP-side socat for websockify; their
//! client is websocat.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::bed::{Bed, IPERF_PORT};
use crate::options::Options;
use crate::procfs;
use crate::tunnels::Kind;

/// iperf3 may take this long beyond `--seconds` (connect, exchange results).
const IPERF_SLACK: Duration = Duration::from_secs(20);
/// Time for socat's per-connection children to exit and be reaped (their
/// CPU reaches the parent's `cutime` only then).
const SETTLE: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Direct,
    Otherix,
    Nginx,
    DirectBridge,
    Relay,
    Websocat,
    Websockify,
}

impl Path {
    const ALL: [Path; 7] = [
        Path::Direct,
        Path::Otherix,
        Path::Nginx,
        Path::DirectBridge,
        Path::Relay,
        Path::Websocat,
        Path::Websockify,
    ];
}

/// One iperf3 run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Transfer {
    pub bits_per_second: f64,
    pub bytes: u64,
    pub server_cpu: f64,
    pub client_cpu: f64,
    /// The part of `server_cpu` spent on the node that owns the bridge
    /// (relay: `node1`'s agent; websocat, websockify: the node's socat).
    pub node_cpu: f64,
}

/// A path's results: the best run with 1 and with 8 streams, and CPU over all its runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct PathThroughput {
    pub one: Transfer,
    pub eight: Transfer,
    pub bytes: u64,
    pub server_cpu: f64,
    pub client_cpu: f64,
    pub node_cpu: f64,
}

impl PathThroughput {
    fn add(&mut self, streams: usize, t: Transfer) {
        let best = if streams == 1 {
            &mut self.one
        } else {
            &mut self.eight
        };
        if t.bits_per_second > best.bits_per_second {
            *best = t;
        }
        self.bytes += t.bytes;
        self.server_cpu += t.server_cpu;
        self.client_cpu += t.client_cpu;
        self.node_cpu += t.node_cpu;
    }

    /// CPU seconds per GB of the node-side part of the server.
    pub fn node_cpu_per_gb(&self) -> f64 {
        let gb = self.bytes as f64 / 1e9;
        if gb == 0.0 {
            0.0
        } else {
            self.node_cpu / gb
        }
    }

    /// CPU seconds per GB (10^9 bytes) moved, server and client side.
    pub fn cpu_per_gb(&self) -> (f64, f64) {
        let gb = self.bytes as f64 / 1e9;
        if gb == 0.0 {
            return (0.0, 0.0);
        }
        (self.server_cpu / gb, self.client_cpu / gb)
    }
}

#[derive(Debug, Clone, Default)]
pub struct Throughput {
    pub direct: PathThroughput,
    pub otherix: PathThroughput,
    pub nginx: PathThroughput,
    pub direct_bridge: PathThroughput,
    pub relay: PathThroughput,
    pub websocat: PathThroughput,
    pub websockify: PathThroughput,
    pub seconds: u64,
    pub rounds: usize,
}

impl Throughput {
    fn path_mut(&mut self, path: Path) -> &mut PathThroughput {
        match path {
            Path::Direct => &mut self.direct,
            Path::Otherix => &mut self.otherix,
            Path::Nginx => &mut self.nginx,
            Path::DirectBridge => &mut self.direct_bridge,
            Path::Relay => &mut self.relay,
            Path::Websocat => &mut self.websocat,
            Path::Websockify => &mut self.websockify,
        }
    }
}

pub fn measure(bed: &Bed, opts: &Options) -> anyhow::Result<Throughput> {
    let mut t = Throughput {
        seconds: opts.seconds,
        rounds: opts.rounds,
        ..Throughput::default()
    };
    for round in 0..opts.rounds {
        for streams in [1, 8] {
            for path in Path::ALL {
                eprintln!(
                    "otherix-bench:   round {}/{}: {path:?}, {streams} stream(s)",
                    round + 1,
                    opts.rounds
                );
                let run = run(bed, path, streams, opts.seconds)
                    .with_context(|| format!("iperf3 through {path:?} with {streams} stream(s)"))?;
                t.path_mut(path).add(streams, run);
            }
        }
    }
    Ok(t)
}

/// CPU seconds of the server and client side of `path` now, and of the
/// server side's part on the bridge's node.
fn cpu(bed: &Bed, path: Path) -> anyhow::Result<(f64, f64, f64)> {
    let others = bed.others()?;
    Ok(match path {
        Path::Direct | Path::DirectBridge => (0.0, 0.0, 0.0),
        Path::Otherix => (
            procfs::cpu_seconds(bed.agent_pid, false)?,
            procfs::cpu_seconds(others.forward.0.pid(), false)?,
            0.0,
        ),
        Path::Nginx => (
            others.nginx.cpu_seconds(),
            procfs::cpu_seconds(others.socat.0.pid(), true)?,
            0.0,
        ),
        Path::Relay => {
            let node = procfs::cpu_seconds(bed.node_agent_pid, false)?;
            (
                procfs::cpu_seconds(bed.cp_pid, false)? + node,
                procfs::cpu_seconds(others.relay_forward.0.pid(), false)?,
                node,
            )
        }
        Path::Websocat | Path::Websockify => {
            let ws = others.tunnels.path(match path {
                Path::Websocat => Kind::Websocat,
                _ => Kind::Websockify,
            });
            let node = others.tunnels.node_leg_cpu();
            // Only websockify's path goes through the CP-side socat.
            let cp_leg = if path == Path::Websockify {
                others.tunnels.cp_leg_cpu()
            } else {
                0.0
            };
            (ws.server_cpu() + cp_leg + node, ws.client_cpu(), node)
        }
    })
}

fn run(bed: &Bed, path: Path, streams: usize, seconds: u64) -> anyhow::Result<Transfer> {
    let others = bed.others()?;
    let local = |addr: std::net::SocketAddr| ("127.0.0.1".to_string(), addr.port());
    let (host, port) = match path {
        Path::Direct => (bed.guest_ip.to_string(), IPERF_PORT),
        Path::DirectBridge => (bed.relay_guest_ip.to_string(), IPERF_PORT),
        Path::Otherix => local(others.forward.1),
        Path::Nginx => local(others.socat.1),
        Path::Relay => local(others.relay_forward.1),
        Path::Websocat => local(others.tunnels.websocat.iperf),
        Path::Websockify => local(others.tunnels.websockify.iperf),
    };
    let port = port.to_string();
    let secs = seconds.to_string();
    let parallel = streams.to_string();
    let iperf = [
        "iperf3",
        "-c",
        &host,
        "-p",
        &port,
        "-t",
        &secs,
        "-P",
        &parallel,
        "-J",
        "--connect-timeout",
        "5000",
    ];
    let mut cmd = match path {
        Path::Direct | Path::DirectBridge => {
            let ns = if path == Path::Direct { &bed.gw } else { &bed.node };
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns.name()]).args(iperf);
            c
        }
        _ => {
            let mut c = Command::new(iperf[0]);
            c.args(&iperf[1..]);
            c
        }
    };
    let before = cpu(bed, path)?;
    let out = run_bounded(&mut cmd, Duration::from_secs(seconds) + IPERF_SLACK)?;
    std::thread::sleep(SETTLE);
    let after = cpu(bed, path)?;
    let (bits_per_second, bytes) = parse_iperf(&out)?;
    Ok(Transfer {
        bits_per_second,
        bytes,
        server_cpu: after.0 - before.0,
        client_cpu: after.1 - before.1,
        node_cpu: after.2 - before.2,
    })
}

/// Runs `cmd` to completion, killing it after `limit`; returns its stdout.
pub(crate) fn run_bounded(cmd: &mut Command, limit: Duration) -> anyhow::Result<String> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    let deadline = Instant::now() + limit;
    // Read stdout on a thread so a full pipe cannot stall the child.
    let mut stdout = child.stdout.take().context("no stdout")?;
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut stdout, &mut s);
        s
    });
    loop {
        if let Some(status) = child.try_wait()? {
            let out = reader.join().unwrap_or_default();
            if !status.success() && parse_iperf(&out).is_err() {
                let mut err = String::new();
                if let Some(mut e) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                bail!("{cmd:?} failed ({status}): {}{}", err.trim(), iperf_error(&out));
            }
            return Ok(out);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{cmd:?} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Receiver-side rate and bytes from iperf3's `-J` output.
pub(crate) fn parse_iperf(json: &str) -> anyhow::Result<(f64, u64)> {
    let v: serde_json::Value = serde_json::from_str(json).context("iperf3 printed no JSON")?;
    if let Some(e) = v["error"].as_str() {
        bail!("iperf3: {e}");
    }
    let sum = &v["end"]["sum_received"];
    let bps = sum["bits_per_second"]
        .as_f64()
        .context("no end.sum_received in iperf3's JSON")?;
    let bytes = sum["bytes"]
        .as_u64()
        .context("no end.sum_received.bytes in iperf3's JSON")?;
    Ok((bps, bytes))
}

fn iperf_error(json: &str) -> String {
    serde_json::from_str::<serde_json::Value>(json)
        .ok()
        .and_then(|v| v["error"].as_str().map(|e| format!(" iperf3: {e}")))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iperf_json_gives_the_receiver_side() {
        let json = r#"{"end":{"sum_sent":{"bytes":10,"bits_per_second":1.0},
                       "sum_received":{"bytes":5000000000,"bits_per_second":8e9}}}"#;
        assert_eq!(parse_iperf(json).unwrap(), (8e9, 5_000_000_000));
        assert!(parse_iperf(r#"{"error":"unable to connect"}"#)
            .unwrap_err()
            .to_string()
            .contains("unable to connect"));
        assert!(parse_iperf("not json").is_err());
    }

    #[test]
    fn the_best_round_is_kept_and_cpu_sums_over_all() {
        let mut p = PathThroughput::default();
        let run = |bps: f64| Transfer {
            bits_per_second: bps,
            bytes: 1_000_000_000,
            server_cpu: 0.5,
            client_cpu: 0.25,
            node_cpu: 0.125,
        };
        p.add(1, run(2e9));
        p.add(1, run(3e9));
        p.add(8, run(1e9));
        assert_eq!(p.one.bits_per_second, 3e9);
        assert_eq!(p.eight.bits_per_second, 1e9);
        assert_eq!(p.cpu_per_gb(), (0.5, 0.25));
        assert_eq!(p.node_cpu_per_gb(), 0.125);
    }
}
