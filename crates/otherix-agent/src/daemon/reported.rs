//! Which guest states the control plane holds, so a heartbeat carries only
//! those that changed (`Heartbeat::guests`): at a hundred guests a node's
//! whole list is most of its heartbeat, and the CP parsed every entry of it
//! on every beat to find none changed. Every state goes at the first
//! heartbeat and every [`WHOLE_SET_EVERY`]; between those, a guest's state
//! goes again when it changed since the CP last acknowledged it (an
//! answered heartbeat), or when the guest's desired entry did — the CP
//! ignores states while it owns them (a migration under way), and once it
//! no longer does (the migration done or rolled back, which changes the
//! entry) it hears the state again. Pure: time comes in as `now`.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use otherix_proto::agent::{DesiredState, GuestState, GuestStatus};

/// How often a heartbeat carries every guest's state.
pub const WHOLE_SET_EVERY: Duration = otherix_proto::agent::GUESTS_WHOLE_SET_EVERY;

/// The guest states the CP acknowledged, each with the desired entry the
/// guest had when it was sent.
#[derive(Debug, Default)]
pub struct Acked {
    held: HashMap<String, (GuestStatus, Option<GuestState>)>,
    last_whole: Option<Instant>,
}

/// The guest states one heartbeat carries.
#[derive(Debug, Clone, Default)]
pub struct Outgoing {
    /// Every guest's state.
    pub whole: bool,
    pub statuses: Vec<GuestStatus>,
    /// Each one's desired entry as it was sent.
    entries: Vec<Option<GuestState>>,
}

impl Acked {
    /// What to send now, from every guest's state and the desired state
    /// held: all of them at first and every [`WHOLE_SET_EVERY`], else those
    /// whose state or desired entry changed since acknowledged.
    pub fn outgoing(
        &self,
        statuses: Vec<GuestStatus>,
        desired: Option<&DesiredState>,
        now: Instant,
    ) -> Outgoing {
        let entries: HashMap<&str, &GuestState> = desired
            .map(|d| d.guests.iter().map(|g| (g.vm_id.as_str(), g)).collect())
            .unwrap_or_default();
        let whole = self
            .last_whole
            .is_none_or(|t| now.duration_since(t) >= WHOLE_SET_EVERY);
        let mut out = Outgoing {
            whole,
            ..Default::default()
        };
        for s in statuses {
            let entry = entries.get(s.vm_id.as_str()).map(|g| (*g).clone());
            let news = whole
                || self
                    .held
                    .get(&s.vm_id)
                    .is_none_or(|(held, held_entry)| *held != s || *held_entry != entry);
            if news {
                out.entries.push(entry);
                out.statuses.push(s);
            }
        }
        out
    }

    /// The heartbeat that carried `sent` was answered.
    pub fn answered(&mut self, sent: Outgoing, now: Instant) {
        if sent.whole {
            self.held.clear();
            self.last_whole = Some(now);
        }
        for (s, entry) in sent.statuses.into_iter().zip(sent.entries) {
            self.held.insert(s.vm_id.clone(), (s, entry));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use otherix_proto::agent::MigrateTo;
    use otherix_proto::VmState;

    fn status(id: &str, state: VmState) -> GuestStatus {
        GuestStatus {
            vm_id: id.into(),
            state,
            reason: None,
            accelerator: None,
        }
    }

    fn desired(ids: &[&str]) -> DesiredState {
        DesiredState {
            guests: ids
                .iter()
                .map(|id| GuestState {
                    vm_id: id.to_string(),
                    name: id.to_string(),
                    network: "ov".into(),
                    network_id: "id-ov".into(),
                    mac: "02:00:00:00:00:01".parse().unwrap(),
                    address: "10.0.0.2/24".parse().unwrap(),
                    gateway: "10.0.0.1".parse().unwrap(),
                    exec: None,
                    machine: None,
                    incoming: None,
                    migrate_to: None,
                })
                .collect(),
            ..Default::default()
        }
    }

    fn ids(out: &Outgoing) -> Vec<&str> {
        out.statuses.iter().map(|s| s.vm_id.as_str()).collect()
    }

    #[test]
    fn only_states_the_control_plane_has_not_acknowledged_go_between_whole_sets() {
        let t0 = Instant::now();
        let d = desired(&["a", "b"]);
        let all = || vec![status("a", VmState::Running), status("b", VmState::Pending)];
        let mut acked = Acked::default();
        let first = acked.outgoing(all(), Some(&d), t0);
        assert!(first.whole && ids(&first) == ["a", "b"], "every state at first");
        // Not answered: sent again, whole.
        let again = acked.outgoing(all(), Some(&d), t0);
        assert!(again.whole);
        acked.answered(again, t0);
        let quiet = acked.outgoing(all(), Some(&d), t0 + Duration::from_secs(1));
        assert!(!quiet.whole && quiet.statuses.is_empty(), "nothing changed");
        let t1 = t0 + Duration::from_secs(2);
        let b_up = vec![status("a", VmState::Running), status("b", VmState::Running)];
        let out = acked.outgoing(b_up.clone(), Some(&d), t1);
        assert_eq!(ids(&out), ["b"]);
        acked.answered(out, t1);
        assert!(acked.outgoing(b_up.clone(), Some(&d), t1).statuses.is_empty());
        // A new guest goes at once.
        let d2 = desired(&["a", "b", "c"]);
        let mut three = b_up.clone();
        three.push(status("c", VmState::Pending));
        assert_eq!(ids(&acked.outgoing(three.clone(), Some(&d2), t1)), ["c"]);
        // Every state again after WHOLE_SET_EVERY.
        let late = acked.outgoing(three, Some(&d2), t0 + WHOLE_SET_EVERY);
        assert!(late.whole && late.statuses.len() == 3);
    }

    #[test]
    fn a_guest_whose_desired_entry_changed_reports_its_state_again() {
        // The CP ignored the state while the guest migrated; the migration
        // ended (its entry changed) and the state, unchanged, goes again.
        let t0 = Instant::now();
        let mut d = desired(&["a"]);
        d.guests[0].migrate_to = Some(MigrateTo {
            node: "n2".into(),
            netns: "ns".into(),
            bridge: "oxb1".into(),
            qemu: None,
        });
        let running = || vec![status("a", VmState::Running)];
        let mut acked = Acked::default();
        let out = acked.outgoing(running(), Some(&d), t0);
        acked.answered(out, t0);
        assert!(acked.outgoing(running(), Some(&d), t0).statuses.is_empty());
        let rolled_back = desired(&["a"]);
        assert_eq!(ids(&acked.outgoing(running(), Some(&rolled_back), t0)), ["a"]);
    }
}
