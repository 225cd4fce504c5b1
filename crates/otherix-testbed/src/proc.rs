//! A process a world spawned: its log, its lifetime, and waiting for it.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{sys, Error, Result, POLL_INTERVAL};

/// Pids (= process group ids) of a world's live processes, shared with its [`Proc`]s so
/// the world can kill the ones still running when it drops first.
pub(crate) type Registry = Arc<Mutex<HashSet<u32>>>;

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of our locks leaves consistent data (plain sets and
    // counters), and teardown must run anyway: ignore poisoning.
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A process spawned by [`crate::World::spawn`], leader of its own process group.
///
/// Dropping it (or its world) SIGKILLs the whole group. Its stdout and stderr go to
/// [`Proc::log_path`].
pub struct Proc {
    name: String,
    pid: u32,
    log_path: PathBuf,
    child: Mutex<Child>,
    registry: Registry,
}

impl std::fmt::Debug for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proc")
            .field("name", &self.name)
            .field("pid", &self.pid)
            .finish()
    }
}

impl Proc {
    pub(crate) fn new(name: String, child: Child, log_path: PathBuf, registry: Registry) -> Proc {
        let pid = child.id();
        lock(&registry).insert(pid);
        Proc {
            name,
            pid,
            log_path,
            child: Mutex::new(child),
            registry,
        }
    }

    /// A label for messages: the log file's name without `.log` (`ROLE-PROGRAM`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pid of the program (also its process group id).
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The file its stdout and stderr are appended to.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything it logged so far (lossily decoded; empty if the file is unreadable).
    pub fn log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Whether the program has not exited yet.
    pub fn is_running(&self) -> bool {
        self.exit_status().is_none()
    }

    /// Its exit status if it has exited.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        // `Child` caches the status once reaped, so an error here is not "gone": say running.
        lock(&self.child).try_wait().ok().flatten()
    }

    /// SIGKILLs its whole process group, reaps it, and returns once no member is alive.
    pub fn kill(&self) -> Result<ExitStatus> {
        let mut child = lock(&self.child);
        // Until reaped, the leader (running or a zombie) keeps its pid, so the group id is
        // ours. Once reaped, the id stays ours while any member lives; only if none does
        // could the kernel have handed it out again, after a full turn of the pid space.
        sys::signal_group(self.pid, "KILL");
        let status = child
            .wait()
            .map_err(Error::io(format!("could not reap {}", self.name)));
        // Return only once the rest of the group is gone too.
        sys::kill_group(self.pid);
        lock(&self.registry).remove(&self.pid);
        status
    }

    /// Sends SIGTERM to the program (not its group, as a service manager would) and waits
    /// up to `timeout` for it to exit; whatever remains of its group is SIGKILLed then.
    /// If it does not exit in time it is SIGKILLed and this returns [`Error::Timeout`].
    pub fn terminate(&self, timeout: Duration) -> Result<ExitStatus> {
        sys::signal_pids(&[self.pid], "TERM");
        match self.wait(timeout) {
            Ok(status) => {
                sys::kill_group(self.pid);
                Ok(status)
            }
            Err(err) => {
                let _ = self.kill();
                Err(err)
            }
        }
    }

    /// Waits up to `timeout` for the program to exit on its own.
    pub fn wait(&self, timeout: Duration) -> Result<ExitStatus> {
        let what = format!("{} (pid {}) to exit", self.name, self.pid);
        crate::wait_until(&what, timeout, || self.exit_status()).map_err(|err| self.with_log_tail(err))
    }

    /// Waits until its log contains `needle`. Fails early with [`Error::Exited`] if the
    /// program exits first, and with [`Error::Timeout`] (showing the log's last lines)
    /// after `timeout`.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.log().contains(needle) {
                return Ok(());
            }
            if let Some(status) = self.exit_status() {
                // It may have logged the line just before exiting.
                let log = self.log();
                if log.contains(needle) {
                    return Ok(());
                }
                return Err(Error::Exited {
                    proc: format!("{} (pid {})", self.name, self.pid),
                    status,
                    waiting_for: format!("logging {needle:?}"),
                    log_tail: tail(&log),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                let what = format!("{} (pid {}) to log {needle:?}", self.name, self.pid);
                return Err(self.with_log_tail(Error::Timeout {
                    what,
                    after: timeout,
                    detail: String::new(),
                }));
            }
            std::thread::sleep(POLL_INTERVAL.min(deadline - now));
        }
    }

    fn with_log_tail(&self, err: Error) -> Error {
        match err {
            Error::Timeout { what, after, .. } => {
                let detail = format!(
                    "; last lines of {}:\n{}",
                    self.log_path.display(),
                    tail(&self.log())
                );
                Error::Timeout { what, after, detail }
            }
            other => other,
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// The last lines of a log, for error messages.
fn tail(log: &str) -> String {
    const LINES: usize = 20;
    let lines: Vec<&str> = log.lines().collect();
    let start = lines.len().saturating_sub(LINES);
    if lines.is_empty() {
        "(empty)".to_owned()
    } else {
        lines[start..].join("\n")
    }
}
