//! `pgbench -S` (select only: a round trip per query) against a real
//! PostgreSQL in the overlay guest, the workload the latency issue was
//! found with, side by side:
//!
//! - direct: pgbench in `gw1`'s namespace to the guest;
//! - `otherix forward bench 5432` in the host namespace (its defaults:
//!   connections kept ready), pgbench to its local port;
//! - nginx stream+TLS on `gw1` in front of the guest's port, with `socat`
//!   as the TLS client on a local port (libpq's own TLS starts inside the
//!   PostgreSQL protocol, which nginx's stream TLS does not speak).
//!
//! Each with persistent connections and with `-C` (a new connection per
//! transaction). PostgreSQL comes from the Debian packages
//! (`/usr/lib/postgresql/N/bin`): `initdb` into a directory of this run,
//! `postgres` started as the `postgres` user inside the guest's network
//! namespace, trusting the testbed's addresses; removed at the end.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};
use otherix_testbed::Proc;

use crate::bed::{self, Bed, VM};
use crate::options::Options;

/// PostgreSQL's port in the guest.
pub const PG_PORT: u16 = 5432;
const CLIENTS: &str = "4";
const THREADS: &str = "2";
const WAIT: Duration = Duration::from_secs(60);

/// One run's figures.
#[derive(Debug, Clone, Copy, Default)]
pub struct Run {
    pub tps: f64,
    pub latency_ms: f64,
}

/// One way in: persistent connections and one per transaction.
#[derive(Debug, Clone)]
pub struct PgRow {
    pub path: &'static str,
    pub persistent: Run,
    pub per_connection: Run,
}

#[derive(Debug, Clone)]
pub struct Pgbench {
    pub version: String,
    pub seconds: u64,
    pub rows: Vec<PgRow>,
}

impl Pgbench {
    pub fn row(&self, path: &str) -> Option<&PgRow> {
        self.rows.iter().find(|r| r.path == path)
    }
}

pub const DIRECT: &str = "direct";
pub const FORWARD: &str = "otherix forward";
pub const NGINX: &str = "nginx stream+TLS (socat client)";

/// The data directory, removed when dropped (after the server it holds).
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The newest PostgreSQL server binaries installed, with pgbench among them.
fn bin_dir() -> anyhow::Result<(PathBuf, String)> {
    let (bin, version) = otherix_testbed::postgres::server_binaries()?;
    for tool in ["initdb", "pgbench"] {
        if !bin.join(tool).exists() {
            bail!("{} is missing", bin.join(tool).display());
        }
    }
    Ok((bin, version.to_string()))
}

pub fn run(bed: &Bed, opts: &Options, otherix: &Path) -> anyhow::Result<Pgbench> {
    let (bin, version) = bin_dir()?;
    let scratch = Scratch(std::env::temp_dir().join(format!("otherix-bench-pg-{}", std::process::id())));
    let data = scratch.0.join("data");
    std::fs::create_dir_all(&data)?;
    let owned = Command::new("chown")
        .args(["-R", "postgres:postgres"])
        .arg(&scratch.0)
        .status()?;
    if !owned.success() {
        bail!("cannot hand {} to the postgres user", scratch.0.display());
    }
    let as_postgres = |program: &Path| {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    };
    let out = as_postgres(&bin.join("initdb"))
        .args(["--auth=trust", "--no-sync", "-U", "postgres", "-D"])
        .arg(&data)
        .output()?;
    if !out.status.success() {
        bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    // The testbed's addresses only reach the guest from inside the world.
    let hba = data.join("pg_hba.conf");
    let mut conf = std::fs::read_to_string(&hba)?;
    conf.push_str("host all all 0.0.0.0/0 trust\n");
    std::fs::write(&hba, conf)?;

    let server = start(bed, &bin, &data, &scratch.0)?;
    let guest = SocketAddr::new(bed.guest_ip.into(), PG_PORT);
    let pgbench = bin.join("pgbench");
    let program = pgbench.to_string_lossy().into_owned();
    let mut init = vec![program.as_str(), "-i", "-q", "-s", "1"];
    let to = Target::of(guest);
    init.extend(to.args());
    init.push("postgres");
    bed.world().exec_ok(&bed.gw, &init).context("pgbench -i")?;

    let forward = bed::forward(&bed.cluster, otherix, VM, PG_PORT, &[])?;
    let socat = bed::start_socat(
        &bed.cluster,
        bed.others()?.nginx.pg_addr(),
        &bed.cluster.ca_file(),
    )?;
    let seconds = opts.seconds.max(3);
    let mut rows = Vec::new();
    for (path, addr) in [(DIRECT, guest), (FORWARD, forward.1), (NGINX, socat.1)] {
        crate::progress(&format!("    pgbench -S through {path}"));
        let mut runs = [Run::default(); 2];
        for (i, reconnect) in [false, true].into_iter().enumerate() {
            let text = pgbench_run(bed, &pgbench, path == DIRECT, addr, seconds, reconnect)?;
            runs[i] = parse(&text).with_context(|| format!("pgbench through {path} printed:\n{text}"))?;
        }
        rows.push(PgRow {
            path,
            persistent: runs[0],
            per_connection: runs[1],
        });
    }
    drop((forward, socat, server));
    Ok(Pgbench {
        version,
        seconds,
        rows,
    })
}

/// `postgres` as the `postgres` user in the guest's network namespace.
fn start(bed: &Bed, bin: &Path, data: &Path, dir: &Path) -> anyhow::Result<Proc> {
    let postgres = bin.join("postgres");
    let data = data.to_string_lossy();
    let socket = format!("unix_socket_directories={}", dir.display());
    let server = bed.world().spawn(
        None,
        "ip",
        [
            "netns",
            "exec",
            bed.guest_netns.as_str(),
            "runuser",
            "-u",
            "postgres",
            "--",
            postgres.to_string_lossy().as_ref(),
            "-D",
            data.as_ref(),
            "-p",
            &PG_PORT.to_string(),
            "-c",
            "listen_addresses=*",
            "-c",
            &socket,
            "-c",
            "max_connections=200",
        ],
        &[],
    )?;
    server
        .wait_for_log("database system is ready to accept connections", WAIT)
        .with_context(|| format!("postgres did not start:\n{}", server.log()))?;
    Ok(server)
}

/// One `pgbench -S` run to `addr`: from `gw1`'s namespace when `direct`,
/// else from the host's; `-C` when `reconnect`.
fn pgbench_run(
    bed: &Bed,
    pgbench: &Path,
    direct: bool,
    addr: SocketAddr,
    seconds: u64,
    reconnect: bool,
) -> anyhow::Result<String> {
    let (to, secs) = (Target::of(addr), seconds.to_string());
    let program = pgbench.to_string_lossy().into_owned();
    let mut args: Vec<&str> = vec![
        program.as_str(),
        "-S",
        "-n",
        "-c",
        CLIENTS,
        "-j",
        THREADS,
        "-T",
        &secs,
    ];
    args.extend(to.args());
    if reconnect {
        args.push("-C");
    }
    args.push("postgres");
    if direct {
        return Ok(bed.world().exec_ok(&bed.gw, &args)?);
    }
    let out = Command::new(args[0]).args(&args[1..]).output()?;
    if !out.status.success() {
        bail!("pgbench failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Where pgbench connects, as its `-h`, `-p` and `-U` arguments.
struct Target {
    host: String,
    port: String,
}

impl Target {
    fn of(addr: SocketAddr) -> Target {
        Target {
            host: addr.ip().to_string(),
            port: addr.port().to_string(),
        }
    }

    fn args(&self) -> [&str; 6] {
        ["-h", &self.host, "-p", &self.port, "-U", "postgres"]
    }
}

/// `tps = N (...)` and `latency average = N ms` of pgbench's report.
pub fn parse(text: &str) -> anyhow::Result<Run> {
    let number = |prefix: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|n| n.parse().ok())
    };
    Ok(Run {
        tps: number("tps = ").context("no tps")?,
        latency_ms: number("latency average = ").context("no latency average")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pgbench_reports_are_read_with_and_without_reconnections() {
        let persistent =
            "pgbench (15.10 (Debian 15.10-0+deb12u1))\ntransaction type: <builtin: select only>\n\
            number of transactions actually processed: 68000\nlatency average = 0.291 ms\n\
            initial connection time = 5.123 ms\ntps = 13745.654321 (without initial connection time)\n";
        let r = parse(persistent).unwrap();
        assert_eq!((r.tps, r.latency_ms), (13745.654321, 0.291));
        let reconnect = "latency average = 16.312 ms\naverage connection time = 15.9 ms\n\
            tps = 245.2 (including reconnection times)\n";
        let r = parse(reconnect).unwrap();
        assert_eq!((r.tps, r.latency_ms), (245.2, 16.312));
        assert!(parse("pgbench: error: connection refused").is_err());
    }
}
