//! A PostgreSQL server of one's own, from the Debian package's binaries
//! (`/usr/lib/postgresql/N/bin`): `initdb` into a directory, `postgres`
//! listening only on a Unix socket in that directory (no TCP port to collide
//! with or to reach from elsewhere), trust authentication for the one local
//! user. For the store's tests on PostgreSQL and for `otherix dev` with
//! replicas.
//!
//! ```no_run
//! # fn main() -> otherix_testbed::Result<()> {
//! let pg = otherix_testbed::postgres::Postgres::start_temporary()?;
//! let url = pg.create_database("t1")?; // postgres://otherix@localhost/t1?host=<its directory>
//! # let _ = url;
//! # Ok(())
//! # } // `pg` drops: the server stops and its directory is removed.
//! ```
//!
//! As root, the server runs as the `postgres` user the package creates
//! (PostgreSQL refuses to run as root) and the directory is handed to it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The user the databases belong to (initdb's superuser).
pub const USER: &str = "otherix";

const HINT: &str = "install PostgreSQL's server: apt-get install postgresql";

/// A running server; stopped (and a temporary directory removed) on drop.
#[derive(Debug)]
pub struct Postgres {
    dir: PathBuf,
    child: Child,
    bin: PathBuf,
    temporary: bool,
}

impl Postgres {
    /// A server in a fresh directory under the system's temporary
    /// directory, removed when it drops.
    pub fn start_temporary() -> Result<Postgres> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "otherix-pg-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let mut pg = Postgres::start(&dir)?;
        pg.temporary = true;
        Ok(pg)
    }

    /// A server whose data lives in `dir` (made with `initdb` the first
    /// time; kept across runs). Returns once it accepts connections.
    pub fn start(dir: &Path) -> Result<Postgres> {
        Postgres::start_with_env(dir, &[])
    }

    /// [`Postgres::start`], the server's processes carrying `envs` (a
    /// world's marker, so that cleaning up after a killed test finds them).
    pub fn start_with_env(dir: &Path, envs: &[(&str, &str)]) -> Result<Postgres> {
        let (bin, _) = server_binaries()?;
        let data = dir.join("data");
        std::fs::create_dir_all(dir).map_err(Error::io(format!("creating {}", dir.display())))?;
        if as_root() {
            run(Command::new("chown").args(["postgres:postgres"]).arg(dir))?;
        }
        if !data.join("PG_VERSION").exists() {
            run(as_owner(&bin.join("initdb"))
                .args(["--auth=trust", "--no-sync", "--encoding=UTF8", "-U", USER, "-D"])
                .arg(&data))?;
        }
        let _ = std::fs::remove_file(dir.join("log"));
        let log = std::fs::File::create(dir.join("log")).map_err(Error::io("creating the server log"))?;
        let err = log.try_clone().map_err(Error::io("creating the server log"))?;
        if as_root() {
            run(Command::new("chown")
                .args(["postgres:postgres"])
                .arg(dir.join("log")))?;
        }
        let child = as_owner(&bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .args(["-c", "listen_addresses=", "-c"])
            .arg(format!("unix_socket_directories={}", dir.display()))
            .args([
                "-c",
                "max_connections=300",
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
            ])
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|source| Error::MissingTool {
                tool: "postgres",
                hint: HINT,
                source,
            })?;
        let mut pg = Postgres {
            dir: dir.to_path_buf(),
            child,
            bin,
            temporary: false,
        };
        pg.wait_ready(Duration::from_secs(30))?;
        Ok(pg)
    }

    /// The URL of database `name` on this server.
    pub fn url(&self, name: &str) -> String {
        format!("postgres://{USER}@localhost/{name}?host={}", self.dir.display())
    }

    /// Creates database `name` and returns its URL.
    pub fn create_database(&self, name: &str) -> Result<String> {
        run(Command::new(self.bin.join("createdb"))
            .arg("-h")
            .arg(&self.dir)
            .args(["-U", USER, name]))?;
        Ok(self.url(name))
    }

    /// Runs `sql` in database `name` with `psql` and returns what it
    /// printed, rows unaligned with `|` between columns.
    pub fn query(&self, name: &str, sql: &str) -> Result<String> {
        let command = format!("psql {name} -c {sql:?}");
        let out = Command::new(self.bin.join("psql"))
            .arg("-h")
            .arg(&self.dir)
            .args(["-U", USER, "-X", "-A", "-t", "-c", sql, name])
            .stdin(Stdio::null())
            .output()
            .map_err(Error::io(format!("running {command}")))?;
        if !out.status.success() {
            return Err(Error::Command {
                command,
                status: out.status,
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log")).unwrap_or_default()
    }

    fn wait_ready(&mut self, within: Duration) -> Result<()> {
        let started = Instant::now();
        // postmaster.pid's last line says "ready" once connections are
        // accepted (PostgreSQL 10 and later).
        let pid_file = self.dir.join("data").join("postmaster.pid");
        loop {
            if let Ok(text) = std::fs::read_to_string(&pid_file) {
                if text.lines().nth(7).is_some_and(|l| l.trim() == "ready") {
                    return Ok(());
                }
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(Error::Exited {
                    proc: "postgres".into(),
                    status,
                    waiting_for: "it to accept connections".into(),
                    log_tail: self.log(),
                });
            }
            if started.elapsed() > within {
                return Err(Error::Timeout {
                    what: "postgres to accept connections".into(),
                    after: within,
                    detail: format!("; its log:\n{}", self.log()),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server process itself (under `runuser` when run as root).
    fn postmaster(&self) -> Option<u32> {
        std::fs::read_to_string(self.dir.join("data").join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        // SIGINT: PostgreSQL's fast shutdown (sessions ended, no wait).
        if let Some(pid) = self.postmaster() {
            crate::sys::signal_pids(&[pid], "INT");
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Ok(None) = self.child.try_wait() {
            if let Some(pid) = self.postmaster() {
                crate::sys::signal_pids(&[pid], "KILL");
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if self.temporary {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The newest installed server's binaries and its major version.
pub fn server_binaries() -> Result<(PathBuf, u32)> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .filter_map(std::result::Result::ok)
        .filter_map(|e| {
            let version: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("postgres").exists().then_some((version, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(version, bin)| (bin, version))
        .ok_or_else(|| Error::MissingTool {
            tool: "postgres",
            hint: HINT,
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no PostgreSQL server under /usr/lib/postgresql",
            ),
        })
}

/// Whether the server can keep its data in `dir` or below: as root the server
/// runs as `postgres`, which must enter `dir` and every directory above it
/// (a `dir` yet to be made: the nearest that exists). `Err` names the first
/// directory it cannot enter. Said before a world is built, rather than as
/// `initdb`'s "could not change directory" once it is.
pub fn check_reachable(dir: &Path) -> std::result::Result<(), PathBuf> {
    if !as_root() {
        return Ok(());
    }
    let Ok(dir) = std::path::absolute(dir) else {
        return Ok(());
    };
    let Some(existing) = dir.ancestors().find(|p| p.exists()) else {
        return Ok(());
    };
    if enters(existing) {
        return Ok(());
    }
    // The first directory down from `/` that stops it, for the hint.
    let mut chain: Vec<&Path> = existing.ancestors().collect();
    chain.reverse();
    let blocked = chain.into_iter().find(|p| !enters(p)).unwrap_or(existing);
    Err(blocked.to_path_buf())
}

/// Whether `postgres` can enter `dir`, asked as `postgres` itself (modes,
/// groups and ACLs all count). A host where the question cannot be asked
/// (no such user) answers yes: starting the server says what is wrong then.
fn enters(dir: &Path) -> bool {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--", "test", "-x"])
        .arg(dir)
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(out) => out.status.success() || !out.stderr.is_empty(),
        Err(_) => true,
    }
}

fn as_root() -> bool {
    crate::sys::effective_uid().as_deref() == Some("0")
}

/// `program` as the `postgres` user when this process is root, else as is.
fn as_owner(program: &Path) -> Command {
    if as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

fn run(cmd: &mut Command) -> Result<()> {
    let command = format!("{cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .map_err(Error::io(format!("running {command}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Command {
            command,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }
}
