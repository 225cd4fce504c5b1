//! Test harness: a real `otherix server` process on 127.0.0.1 with its own
//! temporary data directory, and the real CLI binary pointed at it through
//! its own client config. Everything is removed on drop.

#![allow(dead_code)]

pub mod browser;
pub mod fake_node;
pub mod flood;
pub mod qemu;
pub mod tunnels;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_otherix");

/// A scratch directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "otherix-test-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // Keep what a failed test left (logs, data) for whoever reads the failure.
        if std::thread::panicking() {
            eprintln!("kept {} for inspection", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// Whether this run's control planes are on PostgreSQL
/// ([`otherix_testbed::STORE_ENV`]): every [`Cp`] then keeps its store in a
/// PostgreSQL server of its own instead of SQLite in its data directory.
pub fn on_postgres() -> bool {
    otherix_testbed::store_on_postgres()
}

/// A running control plane.
pub struct Cp {
    pub dir: TempDir,
    /// More arguments for `otherix server`.
    pub args: Vec<String>,
    pub child: Option<Child>,
    pub url: String,
    pub fingerprint: String,
    pub banner: Vec<String>,
    /// The store's server, on a PostgreSQL run (dropped after the CP).
    pub postgres: Option<otherix_testbed::postgres::Postgres>,
    /// Started under this open-files limit (soft and hard), if set.
    pub nofile: Option<u64>,
}

impl Cp {
    pub fn start() -> Cp {
        Cp::start_in(TempDir::new("cp"))
    }

    pub fn start_in(dir: TempDir) -> Cp {
        Cp::start_with(dir, &[])
    }

    /// A CP with more `otherix server` arguments (e.g. `--node-cert-validity 12s`),
    /// on the store of this run (see [`on_postgres`]) unless they name one.
    pub fn start_with(dir: TempDir, args: &[&str]) -> Cp {
        let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let postgres = (on_postgres() && !args.iter().any(|a| a == "--database")).then(|| {
            let pg = otherix_testbed::postgres::Postgres::start_temporary().expect("a PostgreSQL server");
            let url = pg.create_database("otherix").expect("a database");
            args.extend(["--database".to_string(), url]);
            pg
        });
        Cp::boot_new(dir, args, postgres, None)
    }

    /// A CP started under an open-files limit of `nofile` (soft and hard).
    pub fn start_with_nofile(dir: TempDir, nofile: u64) -> Cp {
        let mut args = Vec::new();
        let postgres = on_postgres().then(|| {
            let pg = otherix_testbed::postgres::Postgres::start_temporary().expect("a PostgreSQL server");
            let url = pg.create_database("otherix").expect("a database");
            args.extend(["--database".to_string(), url]);
            pg
        });
        Cp::boot_new(dir, args, postgres, Some(nofile))
    }

    /// A CP on the embedded SQLite store whatever this run's store: for
    /// tests of the data directory's own files (the CA key, the database).
    pub fn start_embedded(dir: TempDir, args: &[&str]) -> Cp {
        Cp::boot_new(dir, args.iter().map(|a| a.to_string()).collect(), None, None)
    }

    fn boot_new(
        dir: TempDir,
        args: Vec<String>,
        postgres: Option<otherix_testbed::postgres::Postgres>,
        nofile: Option<u64>,
    ) -> Cp {
        let mut cp = Cp {
            dir,
            args,
            child: None,
            url: String::new(),
            fingerprint: String::new(),
            banner: vec![],
            postgres,
            nofile,
        };
        cp.boot();
        cp
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    pub fn admin_token_file(&self) -> PathBuf {
        self.data_dir().join("admin.token")
    }

    /// Starts the server process and waits until it prints its banner.
    pub fn boot(&mut self) {
        let mut command = match self.nofile {
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        let mut child = command
            .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
            .arg(self.data_dir())
            .args(&self.args)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.dir.path().join("server.log"))
                    .unwrap(),
            ))
            .spawn()
            .expect("spawn otherix server");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let mut banner = vec![];
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            match lines.next() {
                Some(Ok(line)) => {
                    let done = line.starts_with("log in with");
                    banner.push(line);
                    if done {
                        break;
                    }
                }
                _ => break,
            }
        }
        let field = |prefix: &str| {
            banner
                .iter()
                .find_map(|l| l.strip_prefix(prefix).map(|v| v.trim().to_string()))
                .unwrap_or_else(|| panic!("server banner lacks {prefix:?}: {banner:?}"))
        };
        self.url = field("listening on");
        self.fingerprint = field("CA fingerprint");
        self.banner = banner;
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        self.child = Some(child);
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM, and the exit status once it is gone.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("server running");
        Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "server did not stop within 20 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// A CLI whose config file lives in this CP's temp dir under `name`.
    pub fn cli(&self, name: &str) -> Cli {
        Cli {
            config: self.dir.path().join(format!("{name}.toml")),
            token: None,
        }
    }

    /// A CLI logged in as the bootstrap admin.
    pub fn admin(&self) -> Cli {
        let cli = self.cli("admin");
        cli.ok(&[
            "login",
            "--server",
            &self.url,
            "--token-file",
            self.admin_token_file().to_str().unwrap(),
            "--ca-fingerprint",
            &self.fingerprint,
        ]);
        cli
    }

    pub fn ca_pem(&self) -> String {
        std::fs::read_to_string(self.data_dir().join("ca.crt")).unwrap()
    }
}

impl Drop for Cp {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The real CLI with its own config file (and optionally a token override).
#[derive(Clone)]
pub struct Cli {
    pub config: PathBuf,
    pub token: Option<String>,
}

impl Cli {
    pub fn with_token(&self, token: &str) -> Cli {
        Cli {
            config: self.config.clone(),
            token: Some(token.to_string()),
        }
    }

    pub fn run(&self, args: &[&str]) -> Output {
        let mut cmd = Command::new(BIN);
        cmd.args(args)
            .env("OTHERIX_CONFIG", &self.config)
            .env_remove("OTHERIX_CONTEXT")
            .env_remove("OTHERIX_TOKEN")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null());
        if let Some(t) = &self.token {
            cmd.env("OTHERIX_TOKEN", t);
        }
        cmd.output().expect("run otherix")
    }

    /// Runs and asserts success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "otherix {args:?} failed ({}):\nstdout: {}\nstderr: {}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Runs and asserts failure with exit code 1 and a one-line `error:`;
    /// returns stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.run(args);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(
            out.status.code(),
            Some(1),
            "otherix {args:?} should fail with exit 1; stdout: {} stderr: {stderr}",
            String::from_utf8_lossy(&out.stdout)
        );
        let first = stderr.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("error: "),
            "first stderr line is not an error: {stderr}"
        );
        assert!(
            out.stdout.is_empty(),
            "a failed command printed to stdout: {:?}",
            out.stdout
        );
        stderr
    }

    /// Runs and asserts a usage error: exit 2 (as for any bad argument),
    /// an `error:` first line, nothing sent or printed; returns stderr.
    pub fn misused(&self, args: &[&str]) -> String {
        let out = self.run(args);
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(
            out.status.code(),
            Some(2),
            "otherix {args:?} should be a usage error: {stderr}"
        );
        assert!(stderr.starts_with("error: "), "{stderr}");
        assert!(out.stdout.is_empty(), "{:?}", out.stdout);
        stderr
    }

    /// Runs with `-o json` and parses stdout.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all: Vec<&str> = args.to_vec();
        all.extend(["-o", "json"]);
        serde_json::from_str(&self.ok(&all)).expect("valid JSON on stdout")
    }
}

/// `curl` against the CP, trusting its CA; returns (status, body).
pub fn curl(cp: &Cp, args: &[&str]) -> (u16, String) {
    let ca = cp.dir.path().join("ca-for-curl.pem");
    std::fs::write(&ca, cp.ca_pem()).unwrap();
    otherix_testbed::tools::require_programs(&["curl"]);
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", "--cacert"])
        .arg(&ca)
        .args(["-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl is installed");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// One plain-HTTP GET (e.g. of `--metrics-listen`); (status, body).
#[allow(dead_code)]
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out[9..12].parse().unwrap();
    (
        status,
        out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string(),
    )
}

/// The value of the sample `name{labels}` (exact text before the value).
#[allow(dead_code)]
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A loopback port free now (for `--metrics-listen` and the like).
#[allow(dead_code)]
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn admin_token(cp: &Cp) -> String {
    std::fs::read_to_string(cp.admin_token_file())
        .unwrap()
        .trim()
        .to_string()
}

/// Polls `f` (every 50 ms, up to 20 s) until it returns `Some`.
pub fn wait_for<T>(mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Kills the host namespace's TCP connections to the control plane at
/// `cp` (`https://IP:PORT`) with `ss -K`: a client's connections (the CLI
/// runs in the host namespace); only that world's address matches.
pub fn kill_client_connections(cp: &str) {
    let addr: std::net::SocketAddr = cp.trim_start_matches("https://").parse().unwrap();
    let out = Command::new("ss")
        .args([
            "-K",
            "-t",
            "dst",
            &addr.ip().to_string(),
            "dport",
            "=",
            &addr.port().to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    assert!(out.status.success(), "ss -K: {out:?}");
}
