//! What the agent reports about each guest: `running`, `pending` or `failed` with a
//! one-line reason. Pure: the reconciler feeds in what it saw, `now` is an argument.

use std::time::{Duration, Instant};

use otherix_proto::agent::GuestStatus;
use otherix_proto::VmState;

use crate::runtime::qemu::QemuView;

/// The outcome of the last `ensure` of a guest's network (namespace, veth, address).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetView {
    /// Not attempted yet.
    Pending,
    Ready,
    Failed(String),
}

/// What a guest's workload is doing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkloadView {
    /// The guest has no workload.
    None,
    Running,
    /// Not running, to be (re)started soon; `last` says why it is down.
    Restarting {
        last: String,
    },
    /// Exited quickly several times in a row.
    Crashing {
        last: String,
    },
}

/// The status to report for one guest.
pub fn guest_status(vm_id: &str, net: &NetView, workload: &WorkloadView) -> GuestStatus {
    let (state, reason) = match (net, workload) {
        (NetView::Failed(reason), _) => (VmState::Failed, Some(reason.clone())),
        (NetView::Pending, _) => (VmState::Pending, Some("network not set up yet".to_owned())),
        (NetView::Ready, WorkloadView::None | WorkloadView::Running) => (VmState::Running, None),
        (NetView::Ready, WorkloadView::Restarting { last }) => {
            (VmState::Pending, Some(format!("workload restarting ({last})")))
        }
        (NetView::Ready, WorkloadView::Crashing { last }) => {
            (VmState::Failed, Some(format!("workload keeps exiting ({last})")))
        }
    };
    GuestStatus {
        vm_id: vm_id.to_owned(),
        state,
        reason,
        accelerator: None,
    }
}

/// The status to report for one QEMU guest.
pub fn qemu_status(vm_id: &str, net: &NetView, view: &QemuView) -> GuestStatus {
    let (state, reason, accelerator) = match (net, view) {
        (NetView::Failed(reason), _) => (VmState::Failed, Some(reason.clone()), None),
        (_, QemuView::Running { accelerator }) => (VmState::Running, None, Some(*accelerator)),
        (_, QemuView::Starting(why)) => (VmState::Pending, Some(why.clone()), None),
        (_, QemuView::Crashing(last)) => (VmState::Failed, Some(format!("QEMU keeps ending ({last})")), None),
    };
    GuestStatus {
        vm_id: vm_id.to_owned(),
        state,
        reason,
        accelerator,
    }
}

/// Counts a workload's consecutive quick exits, to tell a crash loop from a restart.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CrashCounter {
    started: Option<Instant>,
    streak: u32,
}

impl CrashCounter {
    /// Exits in a row that make a workload "crashing".
    pub const CRASHING_AFTER: u32 = 3;
    /// A run this long is healthy: the next exit starts a new streak.
    pub const HEALTHY_RUN: Duration = Duration::from_secs(10);

    pub fn started(&mut self, now: Instant) {
        self.started = Some(now);
    }

    /// An exit (or a failed launch) at `now`.
    pub fn exited(&mut self, now: Instant) {
        let healthy = self
            .started
            .take()
            .is_some_and(|t| now.saturating_duration_since(t) >= Self::HEALTHY_RUN);
        self.streak = if healthy { 1 } else { self.streak.saturating_add(1) };
    }

    pub fn is_crashing(&self) -> bool {
        self.streak >= Self::CRASHING_AFTER
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ready_guest_with_a_running_or_no_workload_is_running() {
        for w in [WorkloadView::None, WorkloadView::Running] {
            let s = guest_status("g", &NetView::Ready, &w);
            assert_eq!((s.state, s.reason), (VmState::Running, None));
        }
    }

    #[test]
    fn a_failed_network_fails_the_guest_whatever_the_workload_does() {
        let s = guest_status(
            "g",
            &NetView::Failed("interface oxb100 not found".into()),
            &WorkloadView::Running,
        );
        assert_eq!(s.state, VmState::Failed);
        assert_eq!(s.reason.as_deref(), Some("interface oxb100 not found"));
    }

    #[test]
    fn a_restarting_workload_is_pending_and_a_crash_loop_is_failed() {
        let s = guest_status(
            "g",
            &NetView::Ready,
            &WorkloadView::Restarting {
                last: "exit code 1".into(),
            },
        );
        assert_eq!(s.state, VmState::Pending);
        let s = guest_status(
            "g",
            &NetView::Ready,
            &WorkloadView::Crashing {
                last: "exit code 1".into(),
            },
        );
        assert_eq!(s.state, VmState::Failed);
        assert_eq!(s.reason.as_deref(), Some("workload keeps exiting (exit code 1)"));
    }

    #[test]
    fn an_unattempted_guest_is_pending() {
        assert_eq!(
            guest_status("g", &NetView::Pending, &WorkloadView::None).state,
            VmState::Pending
        );
    }

    #[test]
    fn quick_exits_in_a_row_are_a_crash_loop_and_a_long_run_forgives_them() {
        let t0 = Instant::now();
        let mut c = CrashCounter::default();
        for i in 0..CrashCounter::CRASHING_AFTER {
            assert!(!c.is_crashing(), "after {i} exits");
            c.started(t0);
            c.exited(t0 + Duration::from_secs(1));
        }
        assert!(c.is_crashing());
        c.started(t0);
        c.exited(t0 + CrashCounter::HEALTHY_RUN);
        assert!(!c.is_crashing(), "a healthy run resets the streak");
    }

    #[test]
    fn failed_launches_count_as_quick_exits() {
        let now = Instant::now();
        let mut c = CrashCounter::default();
        for _ in 0..CrashCounter::CRASHING_AFTER {
            c.exited(now);
        }
        assert!(c.is_crashing());
    }
}
