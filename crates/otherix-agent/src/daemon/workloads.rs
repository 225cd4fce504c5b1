//! Guest workloads: started under the [`Supervisor`], or adopted after an agent restart.
//!
//! A workload runs `sh -c EXEC` inside its guest's namespace, in its own process group,
//! with `OTHERIX_VM_NAME`, `OTHERIX_VM_ID` and a `PATH` that starts with the agent's
//! own directory (so `otherix guest http` needs nothing installed in the guest).
//!
//! Workloads outlive the agent. When a restarted agent meets a guest whose namespace
//! already has processes, it *adopts* them instead of starting a second copy: it
//! remembers their pids and polls them; only once they are all gone is the workload
//! started again, under the supervisor, after the usual backoff. The command a
//! workload was started with is recorded next to its log, so an adopted workload whose
//! `exec` changed meanwhile is replaced rather than kept.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use tracing::{info, warn};

use super::files;
use super::status::{CrashCounter, WorkloadView};
use crate::net::{netns, Netns};
use crate::runtime::{Backoff, Launcher, Supervisor, SupervisorEvent, Workload, WorkloadState};

/// Starts workloads in their guest's namespace with the agent's environment additions.
#[derive(Clone, Debug)]
pub struct GuestLauncher {
    /// `PATH` for workloads.
    path: OsString,
    /// VM name per guest id, for `OTHERIX_VM_NAME` (VM names never change).
    names: Arc<Mutex<BTreeMap<String, String>>>,
}

impl GuestLauncher {
    /// Workloads get `PATH=path_dir:$PATH` (or a standard `PATH` if the agent has none).
    pub fn new(path_dir: Option<&Path>) -> Self {
        let base = std::env::var_os("PATH")
            .unwrap_or_else(|| "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
        let path = match path_dir {
            Some(dir) => {
                let mut p = dir.as_os_str().to_owned();
                p.push(":");
                p.push(&base);
                p
            }
            None => base,
        };
        Self {
            path,
            names: Arc::default(),
        }
    }

    fn set_name(&self, id: &str, name: &str) {
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        if names.get(id).map(String::as_str) != Some(name) {
            names.insert(id.to_owned(), name.to_owned());
        }
    }

    fn forget(&self, id: &str) {
        self.names.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
    }

    fn name_of(&self, id: &str) -> String {
        let names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        names.get(id).cloned().unwrap_or_else(|| id.to_owned())
    }
}

impl Launcher for GuestLauncher {
    fn launch(&self, w: &Workload) -> io::Result<Child> {
        let (program, args) = w
            .command
            .split_first()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "empty command"))?;
        if let Some(dir) = w.log_path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .open(&w.log_path)?;
        let log2 = log.try_clone()?;
        // Record the command before starting it: a restarted agent compares it with the
        // desired one before adopting the process.
        let record = serde_json::to_vec(&w.command).map_err(io::Error::other)?;
        files::write_atomic(&record_path(&w.log_path), &record, 0o600).map_err(io::Error::other)?;

        let mut cmd = Command::new(program);
        cmd.args(args)
            .env("PATH", &self.path)
            .env("OTHERIX_VM_ID", &w.id)
            .env("OTHERIX_VM_NAME", self.name_of(&w.id))
            .current_dir("/")
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log2)
            // Its own group: a Ctrl-C or SIGTERM aimed at the agent never reaches it,
            // and stopping it stops what it forked.
            .process_group(0);
        // Forked from a thread inside the guest's namespace, so it starts there.
        let ns = Netns::open(&w.netns).map_err(io::Error::other)?;
        let child = ns.run(move || cmd.spawn()).map_err(io::Error::other)??;
        info!(vm_id = %w.id, netns = %w.netns, pid = child.id(), "workload started");
        Ok(child)
    }
}

/// Where the command a workload was started with is recorded.
fn record_path(log_path: &Path) -> PathBuf {
    log_path.with_extension("exec")
}

fn recorded_command(log_path: &Path) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(record_path(log_path)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Processes found running in a guest's namespace when the agent (re)started.
#[derive(Debug)]
struct Adopted {
    workload: Workload,
    pids: Vec<i32>,
    /// When they were all found gone.
    gone_since: Option<Instant>,
}

/// What to do with processes already running in a guest the supervisor does not know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Adoption {
    /// Nothing runs: start the workload.
    Start,
    /// Keep what runs, and watch it.
    Adopt,
    /// It runs another command than the desired one: kill it, start the desired one.
    Replace,
}

/// Decides what to do with a guest's running processes (`pids`) given the command it
/// was last started with (`recorded`, if known) and the desired one.
pub(crate) fn adoption(pids: &[i32], recorded: Option<&[String]>, desired: &[String]) -> Adoption {
    match (pids.is_empty(), recorded) {
        (true, _) => Adoption::Start,
        // Unknown provenance: do not disturb a running guest on a guess.
        (false, None) => Adoption::Adopt,
        (false, Some(r)) if r == desired => Adoption::Adopt,
        (false, Some(_)) => Adoption::Replace,
    }
}

/// All workloads of the node.
pub struct Workloads {
    sup: Supervisor<GuestLauncher>,
    launcher: GuestLauncher,
    backoff: Backoff,
    adopted: BTreeMap<String, Adopted>,
    crashes: BTreeMap<String, CrashCounter>,
}

impl Workloads {
    pub fn new(launcher: GuestLauncher, backoff: Backoff) -> Self {
        Self {
            sup: Supervisor::new(launcher.clone(), backoff),
            launcher,
            backoff,
            adopted: BTreeMap::new(),
            crashes: BTreeMap::new(),
        }
    }

    /// Makes `w` run. `running` are the processes now in the guest's namespace: the
    /// first time a guest is seen they are adopted rather than doubled.
    pub fn ensure(&mut self, w: Workload, vm_name: &str, running: &[i32], now: Instant) {
        self.launcher.set_name(&w.id, vm_name);
        if self.sup.state(&w.id).is_some() {
            let events = blocking(|| self.sup.ensure(w, now));
            self.record(&events, now);
            return;
        }
        if let Some(a) = self.adopted.get(&w.id) {
            if a.workload.command == w.command {
                return;
            }
            info!(vm_id = %w.id, "workload command changed; replacing the adopted processes");
            let a = self.adopted.remove(&w.id).expect("present: checked above");
            kill_groups(&a.pids);
        } else {
            match adoption(running, recorded_command(&w.log_path).as_deref(), &w.command) {
                Adoption::Adopt => {
                    info!(vm_id = %w.id, pids = ?running, "adopted running workload");
                    self.adopted.insert(
                        w.id.clone(),
                        Adopted {
                            workload: w,
                            pids: running.to_vec(),
                            gone_since: None,
                        },
                    );
                    return;
                }
                Adoption::Replace => {
                    info!(vm_id = %w.id, pids = ?running, "running workload has another command; replacing it");
                    kill_groups(running);
                }
                Adoption::Start => {}
            }
        }
        let events = blocking(|| self.sup.ensure(w, now));
        self.record(&events, now);
    }

    /// Reaps, restarts after backoff, and checks on adopted processes.
    pub fn tick(&mut self, now: Instant) {
        let events = self.sup.tick(now);
        self.record(&events, now);

        let mut restart = Vec::new();
        for (id, a) in &mut self.adopted {
            let alive: Vec<i32> = match netns::pids(&a.workload.netns) {
                Ok(now_in_ns) => a.pids.iter().copied().filter(|p| now_in_ns.contains(p)).collect(),
                Err(_) => Vec::new(),
            };
            a.pids = alive;
            if !a.pids.is_empty() {
                continue;
            }
            match a.gone_since {
                None => {
                    warn!(vm_id = %id, "adopted workload exited; will restart");
                    a.gone_since = Some(now);
                }
                Some(t) if now.saturating_duration_since(t) >= self.backoff.initial => {
                    restart.push(id.clone())
                }
                Some(_) => {}
            }
        }
        for id in restart {
            if let Some(a) = self.adopted.remove(&id) {
                self.crashes.entry(id).or_default().exited(now);
                let events = self.sup.ensure(a.workload, now);
                self.record(&events, now);
            }
        }
    }

    /// Stops every workload whose id is not in `keep`.
    pub fn retain(&mut self, keep: &BTreeSet<&str>) {
        let supervised: Vec<String> = self.sup.ids().map(str::to_owned).collect();
        for id in supervised.iter().filter(|id| !keep.contains(id.as_str())) {
            blocking(|| self.sup.stop(id));
            info!(vm_id = %id, "workload stopped");
        }
        let adopted: Vec<String> = self.adopted.keys().cloned().collect();
        for id in adopted.iter().filter(|id| !keep.contains(id.as_str())) {
            if let Some(a) = self.adopted.remove(id) {
                kill_groups(&a.pids);
                info!(vm_id = %id, pids = ?a.pids, "adopted workload stopped");
            }
        }
        self.crashes.retain(|id, _| keep.contains(id.as_str()));
        let forget: Vec<String> = supervised.into_iter().chain(adopted).collect();
        for id in forget.iter().filter(|id| !keep.contains(id.as_str())) {
            self.launcher.forget(id);
        }
    }

    /// Stops supervising the workload of guest `id` and leaves its processes running:
    /// the guest has been handed over to another node, whose agent adopts them.
    pub fn release(&mut self, id: &str) {
        let supervised = self.sup.release(id);
        let adopted = self.adopted.remove(id).is_some();
        self.crashes.remove(id);
        self.launcher.forget(id);
        if supervised || adopted {
            info!(vm_id = %id, "workload released (handed over); left running");
        }
    }

    /// What the workload of guest `id` is doing.
    pub fn view(&self, id: &str) -> WorkloadView {
        if let Some(a) = self.adopted.get(id) {
            return if a.pids.is_empty() {
                WorkloadView::Restarting {
                    last: "exited while adopted".into(),
                }
            } else {
                WorkloadView::Running
            };
        }
        let crashing = self.crashes.get(id).is_some_and(CrashCounter::is_crashing);
        match self.sup.state(id) {
            Some(WorkloadState::Running { .. }) => WorkloadView::Running,
            Some(WorkloadState::Waiting { last, .. }) if crashing => WorkloadView::Crashing { last },
            Some(WorkloadState::Waiting { last, .. }) => WorkloadView::Restarting { last },
            None => WorkloadView::Restarting {
                last: "not started yet".into(),
            },
        }
    }

    /// Pids of the workload of guest `id`: the supervised process, or the adopted ones.
    pub fn pids(&self, id: &str) -> Vec<i32> {
        if let Some(a) = self.adopted.get(id) {
            return a.pids.clone();
        }
        match self.sup.state(id) {
            Some(WorkloadState::Running { pid, .. }) => i32::try_from(pid).into_iter().collect(),
            _ => Vec::new(),
        }
    }

    fn record(&mut self, events: &[SupervisorEvent], now: Instant) {
        for e in events {
            match e {
                SupervisorEvent::Started { id, .. } => {
                    self.crashes.entry(id.clone()).or_default().started(now)
                }
                SupervisorEvent::Exited { id, .. } | SupervisorEvent::LaunchFailed { id, .. } => {
                    self.crashes.entry(id.clone()).or_default().exited(now)
                }
            }
        }
    }
}

/// SIGKILLs the process groups of `pids` (workloads lead their own groups), and each
/// pid itself in case one does not lead a group.
fn kill_groups(pids: &[i32]) {
    for &pid in pids {
        let pid = Pid::from_raw(pid);
        let _ = killpg(pid, Signal::SIGKILL);
        let _ = kill(pid, Signal::SIGKILL);
    }
}

/// Runs `f`, which may block for a stop's grace period, without stalling the other
/// tasks of a multi-threaded runtime.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cmd(s: &str) -> Vec<String> {
        vec!["sh".into(), "-c".into(), s.into()]
    }

    #[test]
    fn nothing_running_means_start() {
        assert_eq!(adoption(&[], Some(&cmd("a")), &cmd("a")), Adoption::Start);
        assert_eq!(adoption(&[], None, &cmd("a")), Adoption::Start);
    }

    #[test]
    fn a_running_workload_with_the_desired_command_is_adopted_not_doubled() {
        assert_eq!(adoption(&[42], Some(&cmd("a")), &cmd("a")), Adoption::Adopt);
    }

    #[test]
    fn processes_of_unknown_provenance_are_left_alone() {
        assert_eq!(adoption(&[42], None, &cmd("a")), Adoption::Adopt);
    }

    #[test]
    fn a_running_workload_with_a_stale_command_is_replaced() {
        assert_eq!(adoption(&[42], Some(&cmd("old")), &cmd("new")), Adoption::Replace);
    }

    #[test]
    fn workload_path_starts_with_the_agents_directory() {
        let l = GuestLauncher::new(Some(Path::new("/opt/otherix/bin")));
        assert!(
            l.path.to_string_lossy().starts_with("/opt/otherix/bin:"),
            "{:?}",
            l.path
        );
    }
}
