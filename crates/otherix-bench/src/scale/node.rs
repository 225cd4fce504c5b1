//! What one simulated node reports, as a pure state machine: it takes each
//! desired state the control plane answers and makes the next heartbeat
//! from it, the way an agent that realized everything would — every guest
//! it was given `running` (sent, as the agent sends guest states, when new
//! to the CP, and all of them at the first heartbeat and every minute),
//! `applied_version` the version it was given,
//! every network it holds in `ready_overlays`, and a `healthy` verdict for
//! every health check it was given (probed at each heartbeat; sent, as the
//! agent sends them, when new to the CP, and all of them at the first
//! heartbeat and every 5 minutes). A gateway
//! also reports its run's session epoch and no open sessions. Time comes in
//! as `now`.

use std::collections::BTreeMap;

use otherix_proto::agent::{HealthReport, Heartbeat};
use otherix_proto::Health;
use otherix_testbed::fake_node;
use serde::Deserialize;
use time::OffsetDateTime;

use super::plan::NodeSpec;

/// The parts of a desired state a simulated node acts on. The answer is
/// parsed into this rather than the whole `DesiredState`: unknown fields
/// are skipped, so the bench does not spend its share of the two cores
/// building FDB and neighbor tables it would throw away.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Desired {
    pub version: u64,
    #[serde(default)]
    pub overlays: Vec<Network>,
    #[serde(default)]
    pub bridges: Vec<Network>,
    #[serde(default)]
    pub guests: Vec<Guest>,
    #[serde(default)]
    pub health_checks: Vec<Check>,
    /// The version alone: what the node holds is current.
    #[serde(default)]
    pub unchanged: bool,
    /// A change against the version the node applied.
    #[serde(default)]
    pub delta: Option<Delta>,
    /// The digest of the state the node is to hold (the agent checks what
    /// it built against it).
    #[serde(default)]
    pub digest: Option<u64>,
}

/// The part of a delta a simulated node acts on: its own part, whole when
/// it changed, or the guests of it that changed (the overlays' entries,
/// which it does not keep, are left).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Delta {
    #[serde(default)]
    pub own: Option<Box<Desired>>,
    #[serde(default)]
    pub guests: Vec<GuestChange>,
}

/// What one VM puts in the node's own part now.
#[derive(Debug, Clone, Deserialize)]
pub struct GuestChange {
    pub vm_id: String,
    #[serde(default)]
    pub guest: Option<Guest>,
    #[serde(default)]
    pub health_checks: Vec<Check>,
}

impl Desired {
    /// The answer's size class, for the tally.
    pub fn kind(&self) -> AnswerKind {
        if self.unchanged {
            AnswerKind::Unchanged
        } else if self.delta.is_some() {
            AnswerKind::Delta
        } else {
            AnswerKind::Whole
        }
    }
}

/// What a heartbeat was answered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AnswerKind {
    Whole,
    Delta,
    Unchanged,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Network {
    pub network: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Guest {
    pub vm_id: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Check {
    pub lb: String,
    pub vm_id: String,
}

/// A health check's verdict so far: healthy since it first appeared.
#[derive(Debug, Clone, Copy)]
struct Verdict {
    since: OffsetDateTime,
    successes: u32,
    /// The CP answered a heartbeat that carried it.
    acked: bool,
}

/// As the agent does.
const WHOLE_SET_EVERY: std::time::Duration = otherix_proto::agent::HEALTH_WHOLE_SET_EVERY;
const WHOLE_STATE_EVERY: std::time::Duration = otherix_proto::agent::WHOLE_STATE_EVERY;
const GUESTS_WHOLE_SET_EVERY: std::time::Duration = otherix_proto::agent::GUESTS_WHOLE_SET_EVERY;

/// One node's reporting state between heartbeats.
#[derive(Debug, Clone)]
pub struct Reporter {
    spec: NodeSpec,
    /// A gateway's run id (the agent's `session_epoch`).
    epoch: Option<String>,
    applied: Option<u64>,
    /// The guests given, each with whether the CP acknowledged its state.
    guests: BTreeMap<String, bool>,
    /// When a heartbeat carrying every guest's state was last answered.
    guests_whole: Option<OffsetDateTime>,
    networks: Vec<String>,
    verdicts: BTreeMap<(String, String), Verdict>,
    /// When a heartbeat carrying every verdict was last answered.
    last_whole: Option<OffsetDateTime>,
    /// When the last whole desired state came (as the agent, it takes one
    /// every [`WHOLE_STATE_EVERY`] while what it holds is not verified).
    state_whole_at: Option<OffsetDateTime>,
    /// What it holds is verified: its answers named a digest. A simulated
    /// node keeps no entries to compute its own from; it stands for an
    /// agent whose check succeeds, which then takes changes for as long
    /// as they keep coming with digests.
    verified: bool,
    /// How often it takes the whole state while not verified; with
    /// `ignore_digests`, it never is.
    whole_every: std::time::Duration,
    ignore_digests: bool,
    /// What the heartbeat in flight carries: whether all, and which.
    sent: (bool, Vec<(String, String)>),
    /// The guest states it carries: whether all, and which.
    sent_guests: (bool, Vec<String>),
}

impl Reporter {
    pub fn new(spec: NodeSpec, epoch: u64) -> Reporter {
        Reporter {
            epoch: spec.gateway.then(|| format!("{epoch:016x}")),
            spec,
            applied: None,
            guests: BTreeMap::new(),
            guests_whole: None,
            networks: Vec::new(),
            verdicts: BTreeMap::new(),
            last_whole: None,
            state_whole_at: None,
            verified: false,
            whole_every: WHOLE_STATE_EVERY,
            ignore_digests: false,
            sent: (false, Vec::new()),
            sent_guests: (false, Vec::new()),
        }
    }

    /// As an agent that predates digests: the whole state every `every`
    /// its state changes, whatever the answers name.
    pub fn ignore_digests(&mut self, every: std::time::Duration) {
        self.ignore_digests = true;
        self.whole_every = every;
    }

    /// An answered heartbeat: the node now runs exactly what `desired` lists.
    pub fn accept(&mut self, desired: Desired, now: OffsetDateTime) {
        let kind = desired.kind();
        if kind == AnswerKind::Unchanged && self.applied != Some(desired.version) {
            // As the agent: ask for the whole state next.
            self.state_whole_at = None;
            return;
        }
        self.applied = Some(desired.version);
        let (whole, sent) = std::mem::take(&mut self.sent);
        if whole {
            self.last_whole = Some(now);
        }
        for key in sent {
            if let Some(v) = self.verdicts.get_mut(&key) {
                v.acked = true;
            }
        }
        let (whole, sent) = std::mem::take(&mut self.sent_guests);
        if whole {
            self.guests_whole = Some(now);
        }
        for id in sent {
            if let Some(acked) = self.guests.get_mut(&id) {
                *acked = true;
            }
        }
        if kind != AnswerKind::Unchanged {
            self.verified = desired.digest.is_some() && !self.ignore_digests;
        }
        let desired = match kind {
            AnswerKind::Whole => {
                self.state_whole_at = Some(now);
                desired
            }
            // Its own part changed: that is what a node acts on.
            AnswerKind::Delta => match desired.delta {
                Some(Delta { own: Some(own), .. }) => *own,
                Some(Delta { own: None, guests }) => {
                    self.apply_guests(guests, now);
                    return;
                }
                None => return,
            },
            AnswerKind::Unchanged => return,
        };
        let mut guests = BTreeMap::new();
        for g in desired.guests {
            let acked = self.guests.remove(&g.vm_id).unwrap_or(false);
            guests.insert(g.vm_id, acked);
        }
        self.guests = guests;
        self.networks = desired
            .overlays
            .into_iter()
            .chain(desired.bridges)
            .map(|n| n.network)
            .collect();
        let mut verdicts = BTreeMap::new();
        for c in desired.health_checks {
            let key = (c.lb, c.vm_id);
            let v = self.verdicts.remove(&key).unwrap_or(Verdict {
                since: now,
                successes: 0,
                acked: false,
            });
            verdicts.insert(key, v);
        }
        self.verdicts = verdicts;
    }

    /// The guests of the own part that changed: each one's guest and
    /// checks replace what the node held for it.
    fn apply_guests(&mut self, changes: Vec<GuestChange>, now: OffsetDateTime) {
        for c in changes {
            match c.guest {
                Some(_) => {
                    self.guests.entry(c.vm_id.clone()).or_insert(false);
                }
                None => {
                    self.guests.remove(&c.vm_id);
                }
            }
            let mut kept: BTreeMap<(String, String), Verdict> = BTreeMap::new();
            for h in c.health_checks {
                let key = (h.lb, h.vm_id);
                let v = self.verdicts.remove(&key).unwrap_or(Verdict {
                    since: now,
                    successes: 0,
                    acked: false,
                });
                kept.insert(key, v);
            }
            self.verdicts.retain(|(_, vm), _| *vm != c.vm_id);
            self.verdicts.extend(kept);
        }
    }

    /// The next heartbeat, probing every health check once more.
    pub fn heartbeat(&mut self, now: OffsetDateTime) -> Heartbeat {
        let whole = self.last_whole.is_none_or(|t| now - t >= WHOLE_SET_EVERY);
        let mut sent = Vec::new();
        let health = self
            .verdicts
            .iter_mut()
            .filter_map(|((lb, vm_id), v)| {
                v.successes = v.successes.saturating_add(1);
                if !whole && v.acked {
                    return None;
                }
                sent.push((lb.clone(), vm_id.clone()));
                Some(HealthReport {
                    lb: lb.clone(),
                    vm_id: vm_id.clone(),
                    health: Health::Healthy,
                    probed_at: now,
                    changed_at: Some(v.since),
                    reason: None,
                    successes: v.successes,
                    failures: 0,
                })
            })
            .collect();
        self.sent = (whole, sent);
        // As the agent: a guest's state when the CP has not acknowledged it.
        let guests_whole = self
            .guests_whole
            .is_none_or(|t| now - t >= GUESTS_WHOLE_SET_EVERY);
        let running: Vec<&String> = self
            .guests
            .iter()
            .filter(|(_, acked)| guests_whole || !**acked)
            .map(|(id, _)| id)
            .collect();
        self.sent_guests = (guests_whole, running.iter().map(|id| (*id).clone()).collect());
        // As the agent: the short answers when it holds what it applied.
        let current = self.applied.is_some() && self.state_whole_at.is_some();
        Heartbeat {
            accepts_unchanged: current,
            accepts_delta: current
                && (self.verified || self.state_whole_at.is_some_and(|t| now - t < self.whole_every)),
            accepts_guest_changes: true,
            reads_one_session_revocations: true,
            applied_version: self.applied,
            guests: fake_node::running(running),
            health,
            health_changes_only: !whole,
            ready_overlays: self.networks.clone(),
            session_epoch: self.epoch.clone(),
            version: concat!("otherix-bench/", env!("CARGO_PKG_VERSION")).into(),
            ..fake_node::empty_heartbeat(&self.spec.name, &self.spec.vtep.to_string())
        }
    }

    /// Guests in the last desired state (placed here, as the CP sees it).
    pub fn guests(&self) -> usize {
        self.guests.len()
    }

    /// Health checks in the last desired state.
    pub fn checks(&self) -> usize {
        self.verdicts.len()
    }

    /// Health checks whose verdict the CP has acknowledged (an answered
    /// heartbeat carried it).
    pub fn acked_checks(&self) -> usize {
        self.verdicts.values().filter(|v| v.acked).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use otherix_proto::VmState;

    fn spec(gateway: bool) -> NodeSpec {
        NodeSpec {
            name: "hv-0001".into(),
            vtep: "10.50.0.2".parse().unwrap(),
            gateway,
        }
    }

    fn desired(version: u64, guests: &[&str], checks: &[(&str, &str)]) -> Desired {
        serde_json::from_value(serde_json::json!({
            "version": version,
            "node": "hv-0001",
            "mtu": 1450,
            "overlays": [{"network": "scale-net-000", "vni": 7, "fdb": [], "neighbors": []}],
            "bridges": [],
            "guests": guests.iter().map(|g| serde_json::json!({"vm_id": g, "name": "x"})).collect::<Vec<_>>(),
            "health_checks": checks.iter().map(|(lb, vm)| serde_json::json!({"lb": lb, "vm_id": vm, "port": 80})).collect::<Vec<_>>(),
        }))
        .unwrap()
    }

    #[test]
    fn a_fresh_node_reports_nothing_applied() {
        let mut r = Reporter::new(spec(false), 1);
        let hb = r.heartbeat(OffsetDateTime::UNIX_EPOCH);
        assert_eq!((hb.node.as_str(), hb.vtep.as_str()), ("hv-0001", "10.50.0.2"));
        assert!(hb.applied_version.is_none() && hb.guests.is_empty() && hb.roles.is_none());
        assert!(hb.session_epoch.is_none(), "only gateways have a session epoch");
    }

    #[test]
    fn every_guest_given_is_reported_running_with_the_version_applied() {
        let mut r = Reporter::new(spec(false), 1);
        r.accept(desired(42, &["a", "b"], &[]), OffsetDateTime::UNIX_EPOCH);
        let hb = r.heartbeat(OffsetDateTime::UNIX_EPOCH);
        assert_eq!(hb.applied_version, Some(42));
        assert_eq!(
            hb.guests
                .iter()
                .map(|g| (g.vm_id.as_str(), g.state))
                .collect::<Vec<_>>(),
            vec![("a", VmState::Running), ("b", VmState::Running)]
        );
        assert_eq!(hb.ready_overlays, vec!["scale-net-000".to_string()]);
        assert_eq!(r.guests(), 2);
        // A guest taken away is no longer reported; one acknowledged is
        // not reported again, a new one is.
        r.accept(desired(43, &["b", "c"], &[]), OffsetDateTime::UNIX_EPOCH);
        assert_eq!(r.guests(), 2);
        let hb = r.heartbeat(OffsetDateTime::UNIX_EPOCH);
        assert_eq!(
            hb.guests.iter().map(|g| g.vm_id.as_str()).collect::<Vec<_>>(),
            ["c"]
        );
        // Every guest's state again a minute later.
        r.accept(desired(43, &["b", "c"], &[]), OffsetDateTime::UNIX_EPOCH);
        let later = OffsetDateTime::UNIX_EPOCH + GUESTS_WHOLE_SET_EVERY;
        assert_eq!(r.heartbeat(later).guests.len(), 2);
    }

    #[test]
    fn checks_are_healthy_since_they_appeared_and_sent_when_new_or_all_every_five_minutes() {
        let t0 = OffsetDateTime::UNIX_EPOCH;
        let t1 = t0 + time::Duration::seconds(2);
        let t2 = t1 + time::Duration::seconds(2);
        let mut r = Reporter::new(spec(false), 1);
        r.accept(desired(1, &["a"], &[("lb-1", "a")]), t0);
        let hb = r.heartbeat(t1);
        assert_eq!(hb.health.len(), 1);
        let v = &hb.health[0];
        assert_eq!(
            (v.health, v.probed_at, v.changed_at, v.successes),
            (Health::Healthy, t1, Some(t0), 1)
        );
        assert!(!hb.health_changes_only, "the first heartbeat carries them all");
        r.accept(desired(2, &["a", "b"], &[("lb-1", "a"), ("lb-1", "b")]), t1);
        // The CP holds a's verdict now: only b, new, goes.
        let hb = r.heartbeat(t2);
        assert!(hb.health_changes_only);
        let by_vm: BTreeMap<&str, &HealthReport> = hb.health.iter().map(|h| (h.vm_id.as_str(), h)).collect();
        assert!(!by_vm.contains_key("a"));
        assert_eq!((by_vm["b"].changed_at, by_vm["b"].successes), (Some(t1), 1));
        // Every five minutes, all of them.
        r.accept(desired(2, &["a", "b"], &[("lb-1", "a"), ("lb-1", "b")]), t2);
        let later = t2 + WHOLE_SET_EVERY;
        let hb = r.heartbeat(later);
        assert!(!hb.health_changes_only);
        let by_vm: BTreeMap<&str, &HealthReport> = hb.health.iter().map(|h| (h.vm_id.as_str(), h)).collect();
        assert_eq!((by_vm["a"].changed_at, by_vm["a"].successes), (Some(t0), 3));
        r.accept(desired(3, &[], &[]), t2);
        assert!(r.heartbeat(t2).health.is_empty());
    }

    #[test]
    fn a_delta_of_guests_changes_only_those_guests_and_their_checks() {
        let t0 = OffsetDateTime::UNIX_EPOCH;
        let mut r = Reporter::new(spec(false), 1);
        r.accept(desired(1, &["a", "b"], &[("lb-1", "a")]), t0);
        r.heartbeat(t0);
        let delta: Desired = serde_json::from_value(serde_json::json!({
            "version": 2,
            "node": "hv-0001",
            "delta": {"base": 1, "guests": [
                {"vm_id": "c", "guest": {"vm_id": "c"}, "health_checks": [{"lb": "lb-1", "vm_id": "c"}]},
                {"vm_id": "a"},
            ]},
        }))
        .unwrap();
        r.accept(delta, t0);
        assert_eq!(r.guests(), 2, "b and c");
        assert_eq!(r.checks(), 1, "c's");
        let hb = r.heartbeat(t0);
        assert_eq!(hb.applied_version, Some(2));
        assert_eq!(
            hb.guests.iter().map(|g| g.vm_id.as_str()).collect::<Vec<_>>(),
            ["c"]
        );
    }

    #[test]
    fn as_the_agent_the_whole_state_every_five_minutes_only_without_digests() {
        let later = OffsetDateTime::UNIX_EPOCH + WHOLE_STATE_EVERY + time::Duration::SECOND;
        let mut r = Reporter::new(spec(false), 1);
        r.accept(desired(42, &["a"], &[]), OffsetDateTime::UNIX_EPOCH);
        assert!(r.heartbeat(OffsetDateTime::UNIX_EPOCH).accepts_delta);
        assert!(
            !r.heartbeat(later).accepts_delta,
            "no digest: the whole state is due"
        );
        let mut with_digest = desired(43, &["a"], &[]);
        with_digest.digest = Some(7);
        r.accept(with_digest.clone(), OffsetDateTime::UNIX_EPOCH);
        assert!(r.heartbeat(later).accepts_delta, "verified: changes go on");
        // As an agent that predates digests, at a period of its own.
        let mut old = Reporter::new(spec(false), 1);
        old.ignore_digests(std::time::Duration::from_secs(60));
        old.accept(with_digest, OffsetDateTime::UNIX_EPOCH);
        assert!(old.heartbeat(OffsetDateTime::UNIX_EPOCH).accepts_delta);
        assert!(
            !old.heartbeat(OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(61))
                .accepts_delta
        );
    }

    #[test]
    fn a_gateway_reports_its_session_epoch() {
        let mut r = Reporter::new(spec(true), 0xabc);
        let hb = r.heartbeat(OffsetDateTime::UNIX_EPOCH);
        assert_eq!(hb.session_epoch.as_deref(), Some("0000000000000abc"));
        assert!(hb.sessions.is_empty() && hb.session_events.is_empty());
    }
}
