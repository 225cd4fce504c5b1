//! Keeps guests' workloads running: start, notice exits, restart with backoff, stop.
//!
//! The supervisor is a plain state machine with no clock and no tasks of its own: the
//! agent passes `now` into [`Supervisor::ensure`] and [`Supervisor::tick`] (every sync
//! loop round), and processes are checked with non-blocking `try_wait`. That keeps the
//! backoff rules testable without sleeping through them, and keeps the launcher
//! swappable ([`Launcher`]) so tests run without namespaces.
//!
//! Workloads outlive the supervisor: dropping it (an agent restart) leaves them
//! running; the runtime's `list` finds them again and `remove` stops them.

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;
use tracing::{info, warn};

use super::GuestSpec;

/// A process to keep running inside a guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    pub id: String,
    pub netns: String,
    /// argv; `command[0]` is looked up in `PATH`.
    pub command: Vec<String>,
    /// Where stdout and stderr are appended.
    pub log_path: PathBuf,
}

impl Workload {
    /// The workload of `guest`, if it has a command.
    pub fn for_guest(guest: &GuestSpec, log_path: impl Into<PathBuf>) -> Option<Self> {
        let command = guest.command.clone()?;
        Some(Self {
            id: guest.id.clone(),
            netns: guest.netns.clone(),
            command,
            log_path: log_path.into(),
        })
    }
}

/// Starts a workload's process. The child must lead its own process group (so
/// stopping it also stops what it spawned).
pub trait Launcher {
    fn launch(&self, workload: &Workload) -> io::Result<Child>;
}

/// Restart policy: exponential backoff between restarts, forgiven after a good run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Delay before the first restart.
    pub initial: Duration,
    /// Longest delay between restarts.
    pub max: Duration,
    /// A run at least this long resets the backoff to `initial`.
    pub reset_after: Duration,
    /// How long [`Supervisor::stop`] waits after SIGTERM before SIGKILL.
    pub stop_grace: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(30),
            reset_after: Duration::from_secs(10),
            stop_grace: Duration::from_secs(2),
        }
    }
}

impl Backoff {
    /// Delay after `failures` consecutive failures (1 for the first): `initial`,
    /// doubling each time, capped at `max`.
    pub fn delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.initial.saturating_mul(1u32 << doublings).min(self.max)
    }
}

/// What a workload is doing now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkloadState {
    Running {
        pid: u32,
        since: Instant,
        restarts: u32,
    },
    /// Not running; will be (re)started at `until`. `last` says why it is not running.
    Waiting {
        until: Instant,
        restarts: u32,
        last: String,
    },
}

/// Something the supervisor did, for logs and tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SupervisorEvent {
    Started { id: String, pid: u32 },
    Exited { id: String, status: String },
    LaunchFailed { id: String, error: String },
}

enum Proc {
    Running { child: Child, since: Instant },
    Waiting { until: Instant, last: String },
}

struct Entry {
    workload: Workload,
    proc: Proc,
    /// Consecutive failures, for the backoff.
    failures: u32,
    restarts: u32,
}

/// Supervises one workload per guest id.
pub struct Supervisor<L> {
    launcher: L,
    backoff: Backoff,
    entries: BTreeMap<String, Entry>,
}

impl<L: Launcher> Supervisor<L> {
    pub fn new(launcher: L, backoff: Backoff) -> Self {
        Self {
            launcher,
            backoff,
            entries: BTreeMap::new(),
        }
    }

    /// Makes `workload` supervised. A new one starts now; one whose definition
    /// changed (command, namespace, log) is stopped and started again; an unchanged
    /// one is left alone.
    pub fn ensure(&mut self, workload: Workload, now: Instant) -> Vec<SupervisorEvent> {
        if let Some(e) = self.entries.get(&workload.id) {
            if e.workload == workload {
                return Vec::new();
            }
            info!(id = %workload.id, "workload definition changed; restarting");
            self.stop(&workload.id);
        }
        let mut events = Vec::new();
        let id = workload.id.clone();
        let proc = self.launch(&workload, now, &mut events, 0);
        let failures = u32::from(matches!(proc, Proc::Waiting { .. }));
        self.entries.insert(
            id,
            Entry {
                workload,
                proc,
                failures,
                restarts: 0,
            },
        );
        events
    }

    /// Reaps exited workloads and restarts those whose backoff has elapsed.
    pub fn tick(&mut self, now: Instant) -> Vec<SupervisorEvent> {
        let mut events = Vec::new();
        let ids: Vec<String> = self.entries.keys().cloned().collect();
        for id in ids {
            let Some(mut e) = self.entries.remove(&id) else {
                continue;
            };
            match &mut e.proc {
                Proc::Running { child, since } => {
                    let exited = match child.try_wait() {
                        Ok(Some(status)) => Some(describe(status)),
                        Ok(None) => None,
                        Err(err) => Some(format!("wait failed: {err}")),
                    };
                    if let Some(status) = exited {
                        let ran = now.saturating_duration_since(*since);
                        e.failures = if ran >= self.backoff.reset_after {
                            1
                        } else {
                            e.failures.saturating_add(1)
                        };
                        let delay = self.backoff.delay(e.failures);
                        warn!(%id, %status, ?ran, ?delay, "workload exited; will restart");
                        events.push(SupervisorEvent::Exited {
                            id: id.clone(),
                            status: status.clone(),
                        });
                        e.proc = Proc::Waiting {
                            until: now + delay,
                            last: status,
                        };
                    }
                }
                Proc::Waiting { until, .. } => {
                    if now >= *until {
                        e.restarts = e.restarts.saturating_add(1);
                        e.proc = self.launch(&e.workload, now, &mut events, e.failures);
                        if matches!(e.proc, Proc::Waiting { .. }) {
                            e.failures = e.failures.saturating_add(1);
                        }
                    }
                }
            }
            self.entries.insert(id, e);
        }
        events
    }

    /// Stops and forgets the workload: SIGTERM to its process group, SIGKILL after
    /// the grace period. Blocks for at most the grace period (call it from a blocking
    /// context). Returns the exit status if it was running.
    pub fn stop(&mut self, id: &str) -> Option<ExitStatus> {
        let entry = self.entries.remove(id)?;
        let Proc::Running { mut child, .. } = entry.proc else {
            return None;
        };
        let pid = i32::try_from(child.id()).ok().map(Pid::from_raw)?;
        signal_group(pid, Signal::SIGTERM);
        let deadline = Instant::now() + self.backoff.stop_grace;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => {
                    // The leader is gone; make sure nothing it forked lingers.
                    signal_group(pid, Signal::SIGKILL);
                    info!(%id, status = %describe(status), "workload stopped");
                    return Some(status);
                }
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
                _ => break,
            }
        }
        signal_group(pid, Signal::SIGKILL);
        let status = child.wait().ok();
        info!(%id, "workload killed after the grace period");
        status
    }

    /// Forgets the workload without signalling it (live migration: another node's
    /// agent adopts it). A still-running child is reaped on a thread of its own so it
    /// does not linger as a zombie once it exits. Returns whether `id` was supervised.
    pub fn release(&mut self, id: &str) -> bool {
        let Some(entry) = self.entries.remove(id) else {
            return false;
        };
        if let Proc::Running { mut child, .. } = entry.proc {
            std::thread::spawn(move || {
                let _ = child.wait();
            });
        }
        true
    }

    /// What the workload `id` is doing, if supervised.
    pub fn state(&self, id: &str) -> Option<WorkloadState> {
        let e = self.entries.get(id)?;
        Some(match &e.proc {
            Proc::Running { child, since } => WorkloadState::Running {
                pid: child.id(),
                since: *since,
                restarts: e.restarts,
            },
            Proc::Waiting { until, last } => WorkloadState::Waiting {
                until: *until,
                restarts: e.restarts,
                last: last.clone(),
            },
        })
    }

    /// Whether the workload was running at the last `ensure`/`tick`.
    pub fn is_running(&self, id: &str) -> bool {
        matches!(self.state(id), Some(WorkloadState::Running { .. }))
    }

    /// Ids of the supervised workloads.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    fn launch(&self, w: &Workload, now: Instant, events: &mut Vec<SupervisorEvent>, failures: u32) -> Proc {
        match self.launcher.launch(w) {
            Ok(child) => {
                events.push(SupervisorEvent::Started {
                    id: w.id.clone(),
                    pid: child.id(),
                });
                Proc::Running { child, since: now }
            }
            Err(err) => {
                let delay = self.backoff.delay(failures.saturating_add(1));
                warn!(id = %w.id, %err, ?delay, "workload failed to start");
                events.push(SupervisorEvent::LaunchFailed {
                    id: w.id.clone(),
                    error: err.to_string(),
                });
                Proc::Waiting {
                    until: now + delay,
                    last: format!("launch failed: {err}"),
                }
            }
        }
    }
}

/// Signals the process group led by `pid`, falling back to the process alone if the
/// launcher did not make it a group leader.
fn signal_group(pid: Pid, sig: Signal) {
    if killpg(pid, sig).is_err() {
        let _ = kill(pid, sig);
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => status.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;
    use std::process::{Command, Stdio};

    use super::*;

    /// Runs workloads in the current namespace: the supervisor's logic does not care.
    struct Local;

    impl Launcher for Local {
        fn launch(&self, w: &Workload) -> io::Result<Child> {
            Command::new(&w.command[0])
                .args(&w.command[1..])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
        }
    }

    struct Failing;

    impl Launcher for Failing {
        fn launch(&self, _: &Workload) -> io::Result<Child> {
            Err(io::Error::new(io::ErrorKind::NotFound, "no such program"))
        }
    }

    fn workload(cmd: &str) -> Workload {
        Workload {
            id: "g1".into(),
            netns: "unused".into(),
            command: vec!["sh".into(), "-c".into(), cmd.into()],
            log_path: PathBuf::from("/dev/null"),
        }
    }

    fn policy() -> Backoff {
        Backoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(8),
            reset_after: Duration::from_secs(60),
            stop_grace: Duration::from_secs(2),
        }
    }

    /// Ticks with the real clock until the workload has exited; returns that instant.
    fn tick_until_exited(sup: &mut Supervisor<Local>) -> Instant {
        let give_up = Instant::now() + Duration::from_secs(10);
        loop {
            let now = Instant::now();
            let events = sup.tick(now);
            if events.iter().any(|e| matches!(e, SupervisorEvent::Exited { .. })) {
                return now;
            }
            assert!(now < give_up, "workload did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let b = policy();
        let secs: Vec<u64> = (1..=6).map(|f| b.delay(f).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 8, 8]);
        assert_eq!(b.delay(u32::MAX), b.max);
    }

    #[test]
    fn exited_workload_is_restarted_only_after_its_backoff() {
        let mut sup = Supervisor::new(Local, policy());
        let events = sup.ensure(workload("exit 3"), Instant::now());
        assert!(matches!(events[..], [SupervisorEvent::Started { .. }]));

        let exited_at = tick_until_exited(&mut sup);
        let Some(WorkloadState::Waiting { until, last, .. }) = sup.state("g1") else {
            panic!("not waiting: {:?}", sup.state("g1"));
        };
        assert_eq!(last, "exit code 3");
        assert_eq!(until - exited_at, Duration::from_secs(1));

        assert!(sup.tick(until - Duration::from_millis(1)).is_empty());
        let events = sup.tick(until);
        assert!(
            matches!(events[..], [SupervisorEvent::Started { .. }]),
            "{events:?}"
        );
        assert!(matches!(
            sup.state("g1"),
            Some(WorkloadState::Running { restarts: 1, .. })
        ));

        // It crashes again quickly: the next delay doubles.
        let exited_again = tick_until_exited(&mut sup);
        let Some(WorkloadState::Waiting { until, .. }) = sup.state("g1") else {
            panic!("not waiting");
        };
        assert!(until - exited_again == Duration::from_secs(2));
    }

    #[test]
    fn long_run_resets_the_backoff() {
        let mut sup = Supervisor::new(Local, policy());
        let start = Instant::now();
        sup.ensure(workload("exit 0"), start);
        // Pretend the exit was noticed after a long healthy run.
        let give_up = Instant::now() + Duration::from_secs(10);
        let later = loop {
            let later = Instant::now() + Duration::from_secs(120);
            if !sup.tick(later).is_empty() {
                break later;
            }
            assert!(Instant::now() < give_up);
            std::thread::sleep(Duration::from_millis(5));
        };
        let Some(WorkloadState::Waiting { until, .. }) = sup.state("g1") else {
            panic!("not waiting");
        };
        assert_eq!(until - later, Duration::from_secs(1));
    }

    #[test]
    fn failed_launch_is_retried_with_backoff() {
        let mut sup = Supervisor::new(Failing, policy());
        let t0 = Instant::now();
        let events = sup.ensure(workload("true"), t0);
        assert!(matches!(events[..], [SupervisorEvent::LaunchFailed { .. }]));
        let Some(WorkloadState::Waiting { until, .. }) = sup.state("g1") else {
            panic!("not waiting");
        };
        assert_eq!(until - t0, Duration::from_secs(1));
        let events = sup.tick(until);
        assert!(matches!(events[..], [SupervisorEvent::LaunchFailed { .. }]));
        let Some(WorkloadState::Waiting { until: next, .. }) = sup.state("g1") else {
            panic!("not waiting");
        };
        assert_eq!(next - until, Duration::from_secs(2));
    }

    #[test]
    fn stop_kills_the_whole_process_group() {
        let mut sup = Supervisor::new(Local, policy());
        // A shell that ignores SIGTERM, with a child: both must go.
        sup.ensure(workload("trap '' TERM; sleep 60 & wait"), Instant::now());
        let Some(WorkloadState::Running { pid, .. }) = sup.state("g1") else {
            panic!("not running");
        };
        std::thread::sleep(Duration::from_millis(100));
        let mut quick = sup;
        quick.backoff.stop_grace = Duration::from_millis(200);
        assert!(quick.stop("g1").is_some());
        // Orphans are reparented to init, which may leave them as zombies for a
        // while: count only members of the group that are still alive.
        let gone = (0..100).any(|_| {
            std::thread::sleep(Duration::from_millis(10));
            live_group_members(pid as i32) == 0
        });
        assert!(gone, "process group {pid} survived stop");
        assert!(quick.state("g1").is_none());
    }

    /// Processes in process group `pgid` that are not zombies.
    fn live_group_members(pgid: i32) -> usize {
        std::fs::read_dir("/proc")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter_map(|e| std::fs::read_to_string(e.path().join("stat")).ok())
            .filter(|stat| {
                // "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after ')'.
                let Some((_, rest)) = stat.rsplit_once(')') else {
                    return false;
                };
                let fields: Vec<&str> = rest.split_whitespace().collect();
                fields.len() > 2 && fields[0] != "Z" && fields[2] == pgid.to_string()
            })
            .count()
    }

    #[test]
    fn unchanged_workload_is_left_alone_and_changed_one_restarts() {
        let mut sup = Supervisor::new(Local, policy());
        let now = Instant::now();
        sup.ensure(workload("sleep 60"), now);
        assert!(sup.ensure(workload("sleep 60"), now).is_empty());
        let events = sup.ensure(workload("sleep 61"), now);
        assert!(matches!(events[..], [SupervisorEvent::Started { .. }]));
        sup.stop("g1");
    }
}
