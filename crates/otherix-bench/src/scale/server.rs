//! The control plane a scale row measures: a real `otherix server` process
//! on 127.0.0.1 (a port the kernel picks) with a temporary data directory,
//! no namespaces. Its banner says where it listens; the admin token and the
//! cluster CA are read from the data directory. Stopped with SIGTERM (and
//! SIGKILL if it does not exit) and its directory removed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use otherix_client::Client;

/// How long the server may take to print its banner and then to answer.
const START: Duration = Duration::from_secs(30);
/// How long it may take to exit after SIGTERM.
const STOP: Duration = Duration::from_secs(15);

#[derive(Debug)]
pub struct Server {
    child: Child,
    pub pid: u32,
    pub url: String,
    pub ca_pem: String,
    token: String,
    dir: PathBuf,
}

impl Server {
    /// Starts `bin server` with `args` after the data directory and listen
    /// address, and waits until it answers `GET /v1/info`.
    pub async fn start(bin: &Path, args: &[String]) -> anyhow::Result<Server> {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "otherix-bench-scale-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot make {}", dir.display()))?;
        let data = dir.join("data");
        let out = std::fs::File::create(dir.join("server.out"))?;
        let log = std::fs::File::create(dir.join("server.log"))?;
        let child = Command::new(bin)
            .arg("server")
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            // What an operator runs; the log goes to a file in the directory.
            .env("RUST_LOG", "info")
            .env_remove("OTHERIX_SERVER_CONFIG")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot run {}", bin.display()))?;
        let pid = child.id();
        let mut server = Server {
            child,
            pid,
            url: String::new(),
            ca_pem: String::new(),
            token: String::new(),
            dir,
        };
        server.url = server.wait_for_banner()?;
        server.ca_pem = std::fs::read_to_string(data.join("ca.crt")).context("the cluster CA")?;
        // A replica after the first has none: it is given the first one's.
        server.token = std::fs::read_to_string(data.join("admin.token"))
            .map(|t| t.trim().to_string())
            .unwrap_or_default();
        let admin = server.admin()?;
        let deadline = Instant::now() + START;
        loop {
            match admin.info().await {
                Ok(_) => break,
                Err(e) if Instant::now() >= deadline => {
                    bail!("the control plane does not answer: {e}\n{}", server.log_tail())
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
        Ok(server)
    }

    /// The URL from the `listening on` line, once the `log in with` line is out.
    fn wait_for_banner(&mut self) -> anyhow::Result<String> {
        let deadline = Instant::now() + START;
        loop {
            let out = std::fs::read_to_string(self.dir.join("server.out")).unwrap_or_default();
            if out.contains("log in with") {
                return banner_url(&out).context("no `listening on` line in the server's banner");
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "otherix server exited ({status}) before it listened\n{}",
                    self.log_tail()
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "otherix server printed no banner within {START:?}\n{}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The admin token (the first replica's, for the others).
    pub fn admin_token(&self) -> &str {
        &self.token
    }

    /// Another replica's admin token: the first admin exists once.
    pub fn set_admin_token(&mut self, token: &str) {
        self.token = token.to_string();
    }

    /// An API client with the admin token.
    pub fn admin(&self) -> anyhow::Result<Client> {
        Ok(Client::new(&self.url, &self.ca_pem, Some(self.token.clone()))?)
    }

    /// A client without credentials (enrollment).
    pub fn anonymous(&self) -> anyhow::Result<Client> {
        Ok(Client::new(&self.url, &self.ca_pem, None)?)
    }

    /// The last lines of the server's log, for an error message.
    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = &lines[lines.len().saturating_sub(20)..];
        format!("the server's log ends:\n{}", tail.join("\n"))
    }

    /// Lines of the server's log that contain `needle`.
    pub fn log_count(&self, needle: &str) -> usize {
        std::fs::read_to_string(self.dir.join("server.log"))
            .map(|l| l.lines().filter(|line| line.contains(needle)).count())
            .unwrap_or(0)
    }

    /// Its data directory.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// SIGKILL, at once: a replica that dies.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM, as systemd stops it; SIGKILL after [`STOP`].
    pub fn stop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid.to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + STOP;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("otherix-bench: the control plane did not exit within {STOP:?} of SIGTERM; killing it");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `https://...` from the banner's `listening on     URL` line.
fn banner_url(out: &str) -> Option<String> {
    out.lines()
        .find_map(|l| l.strip_prefix("listening on"))
        .map(|u| u.trim().to_string())
        .filter(|u| u.starts_with("https://"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_url_comes_from_the_banner() {
        let banner = "otherix control plane 0.1.0 (cluster c1)\nlistening on     https://127.0.0.1:40123\nCA fingerprint   sha256:ab\n";
        assert_eq!(banner_url(banner).as_deref(), Some("https://127.0.0.1:40123"));
        assert_eq!(banner_url("nothing here"), None);
    }
}
