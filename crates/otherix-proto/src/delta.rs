//! A heartbeat answered with what changed: the desired state as a change
//! against the version the agent applied, instead of the whole of it.
//!
//! At 10,000 VMs a node's whole state is about 1 MiB, nearly all of it the
//! overlays' FDB and neighbor entries, which every member shares; one VM
//! created changes two entries of one overlay. An agent that says
//! [`accepts_delta`](crate::agent::Heartbeat::accepts_delta) gets a
//! [`DesiredDelta`] against its `applied_version` when the control plane
//! still knows that version: the node's own part whole when it changed, and
//! per overlay the entries added and removed (or all of them, `whole`).
//! An agent that also says
//! [`accepts_guest_changes`](crate::agent::Heartbeat::accepts_guest_changes)
//! gets, when only guests and health checks of its own part changed, those
//! guests alone ([`GuestChange`]) rather than the own part whole: one VM
//! created changes one guest of a host running a hundred.
//!
//! [`DesiredState::apply`] is strict: a delta for another base, an overlay
//! the state does not hold, an entry removed that is not there or added
//! that already is — each is an error, and the agent asks for the whole
//! state rather than guess.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::agent::{DesiredState, FdbEntry, GuestState, HealthCheck, NeighborEntry, OverlayState};

/// What changed since `base`. See the module documentation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DesiredDelta {
    /// The version this applies to: the agent's `applied_version`.
    pub base: u64,
    /// Everything but the overlays' `fdb` and `neighbors` (empty here),
    /// whole, when any of it changed since `base`; absent, it stands. An
    /// overlay it no longer lists is left; one new to it starts empty and
    /// gets its entries in `overlays` (`whole`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(no_recursion)]
    pub own: Option<Box<DesiredState>>,
    /// The overlays whose entries changed; the others kept theirs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overlays: Vec<OverlayChange>,
    /// The VMs whose guest or health checks in the own part changed, when
    /// nothing else of it did (`own` absent), for an agent that
    /// [`accepts_guest_changes`](crate::agent::Heartbeat::accepts_guest_changes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub guests: Vec<GuestChange>,
}

/// What one VM puts in a node's own part now, replacing what the state
/// held for it: the guest (absent: none any more) and the health checks of
/// its LBs (every one of them; none: none any more).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct GuestChange {
    pub vm_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub guest: Option<GuestState>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub health_checks: Vec<HealthCheck>,
}

/// One overlay's FDB and neighbor entries: added and removed since the
/// base, or with `whole` all of them (in `fdb_added` and `neighbors_added`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct OverlayChange {
    pub network: String,
    /// The entries added replace the overlay's: the base is too far behind
    /// (or new to it) for a change.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub whole: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fdb_added: Vec<FdbEntry>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fdb_removed: Vec<FdbEntry>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub neighbors_added: Vec<NeighborEntry>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub neighbors_removed: Vec<NeighborEntry>,
}

impl OverlayChange {
    pub fn is_empty(&self) -> bool {
        !self.whole
            && self.fdb_added.is_empty()
            && self.fdb_removed.is_empty()
            && self.neighbors_added.is_empty()
            && self.neighbors_removed.is_empty()
    }
}

/// Why a delta does not apply to the state held: ask for the whole state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeltaError {
    /// The answer carries no delta.
    NotADelta,
    /// The delta is against another version than the one held.
    OtherBase { base: u64, held: u64 },
    /// A change names an overlay the state does not hold.
    UnknownOverlay(String),
    /// An entry removed is not there, or one added already is.
    Mismatch { network: String, what: &'static str },
    /// A guest change carries a guest or health check of another VM.
    OtherGuest { vm_id: String },
}

impl std::fmt::Display for DeltaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeltaError::NotADelta => write!(f, "the answer is not a delta"),
            DeltaError::OtherBase { base, held } => {
                write!(
                    f,
                    "the delta is against version {base}, but version {held} is held"
                )
            }
            DeltaError::UnknownOverlay(n) => write!(f, "the delta changes overlay {n:?}, which is not held"),
            DeltaError::Mismatch { network, what } => {
                write!(
                    f,
                    "the delta does not match the {what} held for overlay {network:?}"
                )
            }
            DeltaError::OtherGuest { vm_id } => {
                write!(
                    f,
                    "the delta's change of guest {vm_id:?} carries another VM's guest or health check"
                )
            }
        }
    }
}

impl std::error::Error for DeltaError {}

impl DesiredState {
    /// The state `answer` (a delta against this one) describes.
    pub fn apply(&self, answer: &DesiredState) -> Result<DesiredState, DeltaError> {
        let delta = answer.delta.as_ref().ok_or(DeltaError::NotADelta)?;
        if delta.base != self.version {
            return Err(DeltaError::OtherBase {
                base: delta.base,
                held: self.version,
            });
        }
        let mut next = match &delta.own {
            Some(own) => {
                let mut next = (**own).clone();
                for o in &mut next.overlays {
                    // Entries carry over from the same overlay (a recreated
                    // one comes `whole`).
                    if let Some(held) = self.overlays.iter().find(|h| h.network == o.network) {
                        o.fdb.clone_from(&held.fdb);
                        o.neighbors.clone_from(&held.neighbors);
                    } else {
                        o.fdb.clear();
                        o.neighbors.clear();
                    }
                }
                next
            }
            None => self.clone(),
        };
        for change in &delta.overlays {
            let o = next
                .overlays
                .iter_mut()
                .find(|o| o.network == change.network)
                .ok_or_else(|| DeltaError::UnknownOverlay(change.network.clone()))?;
            apply_overlay(o, change)?;
        }
        for change in &delta.guests {
            apply_guest(&mut next, change)?;
        }
        next.version = answer.version;
        next.node.clone_from(&answer.node);
        next.delta = None;
        next.unchanged = false;
        next.digest = answer.digest;
        Ok(next)
    }
}

/// Replaces what `state` holds for `c.vm_id` (its guest, its health
/// checks) with `c`; the lists stay sorted (guests by VM id).
fn apply_guest(state: &mut DesiredState, c: &GuestChange) -> Result<(), DeltaError> {
    let other = c.guest.as_ref().is_some_and(|g| g.vm_id != c.vm_id)
        || c.health_checks.iter().any(|h| h.vm_id != c.vm_id);
    if other {
        return Err(DeltaError::OtherGuest {
            vm_id: c.vm_id.clone(),
        });
    }
    state.guests.retain(|g| g.vm_id != c.vm_id);
    if let Some(g) = &c.guest {
        let at = state.guests.partition_point(|h| h.vm_id <= g.vm_id);
        state.guests.insert(at, g.clone());
    }
    state.health_checks.retain(|h| h.vm_id != c.vm_id);
    for h in &c.health_checks {
        let at = state.health_checks.partition_point(|x| x <= h);
        state.health_checks.insert(at, h.clone());
    }
    Ok(())
}

fn apply_overlay(o: &mut OverlayState, c: &OverlayChange) -> Result<(), DeltaError> {
    let mismatch = |what| DeltaError::Mismatch {
        network: o.network.clone(),
        what,
    };
    if c.whole {
        let mut fdb = c.fdb_added.clone();
        fdb.sort_unstable();
        fdb.dedup();
        let mut neighbors = c.neighbors_added.clone();
        neighbors.sort_unstable();
        neighbors.dedup();
        o.fdb = fdb;
        o.neighbors = neighbors;
        return Ok(());
    }
    merge(&mut o.fdb, &c.fdb_added, &c.fdb_removed).map_err(|()| mismatch("FDB entries"))?;
    merge(&mut o.neighbors, &c.neighbors_added, &c.neighbors_removed)
        .map_err(|()| mismatch("neighbor entries"))?;
    Ok(())
}

/// `held` (sorted, without repeats) less `removed`, plus `added`; each
/// removed entry must be there and each added one must not (one removed
/// and added back stays). The entries between two changes are copied in
/// one piece, each change found by a binary search: an agent at 1,000
/// nodes holds thousands of entries an overlay and takes changes of a few
/// at every heartbeat of a burst, so a set of the whole section built for
/// each change cost far more than the change.
fn merge<T: Ord + Clone>(held: &mut Vec<T>, added: &[T], removed: &[T]) -> Result<(), ()> {
    if added.is_empty() && removed.is_empty() {
        return Ok(());
    }
    if !held.is_sorted_by(|a, b| a < b) {
        held.sort_unstable();
        held.dedup();
    }
    let added = sorted_once(added)?;
    let removed = sorted_once(removed)?;
    let mut out = Vec::with_capacity(held.len() + added.len());
    // `held[from..]` is not yet copied; the runs between two changes are
    // copied whole.
    let (mut from, mut a, mut r) = (0, 0, 0);
    loop {
        let next = match (added.get(a), removed.get(r)) {
            (None, None) => break,
            (Some(x), Some(y)) => x.min(y),
            (Some(x), None) => x,
            (None, Some(y)) => y,
        };
        let at = from + held[from..].partition_point(|e| e < next);
        out.extend_from_slice(&held[from..at]);
        from = at;
        let is_held = held.get(at) == Some(next);
        let add = added.get(a) == Some(next);
        if removed.get(r) == Some(next) {
            if !is_held {
                // Removed, but not held.
                return Err(());
            }
            r += 1;
            from = at + 1;
        } else if add && is_held {
            // Added, but held already.
            return Err(());
        }
        if add {
            out.push(next.clone());
            a += 1;
        }
    }
    out.extend_from_slice(&held[from..]);
    *held = out;
    Ok(())
}

/// `v` sorted (as the control plane sends it, borrowed; in any other
/// order, sorted here); an entry listed twice is an error.
fn sorted_once<T: Ord + Clone>(v: &[T]) -> Result<std::borrow::Cow<'_, [T]>, ()> {
    if v.is_sorted_by(|a, b| a < b) {
        return Ok(std::borrow::Cow::Borrowed(v));
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    if s.windows(2).any(|w| w[0] == w[1]) {
        return Err(());
    }
    Ok(std::borrow::Cow::Owned(s))
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use otherix_core::{Ipv4Cidr, MacAddr};

    use super::*;

    fn mac(n: u8) -> MacAddr {
        MacAddr([2, 0, 0, 0, 0, n])
    }

    fn fdb(n: u8, vtep: u8) -> FdbEntry {
        FdbEntry {
            mac: mac(n),
            vtep: Ipv4Addr::new(192, 168, 0, vtep),
        }
    }

    fn nb(n: u8) -> NeighborEntry {
        NeighborEntry {
            ip: Ipv4Addr::new(10, 0, 0, n),
            mac: mac(n),
        }
    }

    fn overlay(name: &str, fdb: Vec<FdbEntry>, neighbors: Vec<NeighborEntry>) -> OverlayState {
        OverlayState {
            network: name.into(),
            network_id: format!("id-{name}"),
            vni: 7,
            subnet: "10.0.0.0/24".parse().unwrap(),
            address: Ipv4Cidr::on(&"10.0.0.0/24".parse().unwrap(), Ipv4Addr::new(10, 0, 0, 250)),
            mac: mac(250),
            fdb,
            neighbors,
        }
    }

    fn held() -> DesiredState {
        DesiredState {
            version: 1,
            node: "n1".into(),
            mtu: 1450,
            overlays: vec![
                overlay("a", vec![fdb(1, 1), fdb(2, 2)], vec![nb(1), nb(2)]),
                overlay("b", vec![fdb(3, 1)], vec![nb(3)]),
            ],
            ..Default::default()
        }
    }

    fn answer(delta: DesiredDelta) -> DesiredState {
        DesiredState {
            version: 2,
            node: "n1".into(),
            delta: Some(delta),
            ..Default::default()
        }
    }

    #[test]
    fn entries_added_and_removed_keep_the_lists_sorted_and_the_rest_stands() {
        let next = held()
            .apply(&answer(DesiredDelta {
                base: 1,
                own: None,
                guests: vec![],
                overlays: vec![OverlayChange {
                    network: "a".into(),
                    fdb_added: vec![fdb(0, 3)],
                    fdb_removed: vec![fdb(2, 2)],
                    neighbors_added: vec![nb(0)],
                    neighbors_removed: vec![nb(2)],
                    ..Default::default()
                }],
            }))
            .unwrap();
        assert_eq!(next.version, 2);
        assert_eq!(next.overlays[0].fdb, vec![fdb(0, 3), fdb(1, 1)]);
        assert_eq!(next.overlays[0].neighbors, vec![nb(0), nb(1)]);
        assert_eq!(next.overlays[1], held().overlays[1]);
        assert_eq!(next.mtu, 1450);
        assert!(next.delta.is_none());
    }

    #[test]
    fn a_new_own_part_keeps_the_entries_of_the_overlays_it_still_lists() {
        let mut own = held();
        own.version = 0;
        own.mtu = 1400;
        own.overlays = vec![overlay("b", vec![], vec![]), overlay("c", vec![], vec![])];
        let next = held()
            .apply(&answer(DesiredDelta {
                base: 1,
                own: Some(Box::new(own)),
                guests: vec![],
                overlays: vec![OverlayChange {
                    network: "c".into(),
                    whole: true,
                    fdb_added: vec![fdb(9, 1), fdb(8, 1)],
                    neighbors_added: vec![nb(9)],
                    ..Default::default()
                }],
            }))
            .unwrap();
        assert_eq!(next.mtu, 1400);
        let names: Vec<&str> = next.overlays.iter().map(|o| o.network.as_str()).collect();
        assert_eq!(names, ["b", "c"]);
        assert_eq!(next.overlays[0].fdb, held().overlays[1].fdb);
        assert_eq!(next.overlays[1].fdb, vec![fdb(8, 1), fdb(9, 1)]);
    }

    fn guest(id: &str, exec: Option<&str>) -> GuestState {
        GuestState {
            vm_id: id.into(),
            name: format!("name-{id}"),
            network: "a".into(),
            network_id: "id-a".into(),
            mac: mac(9),
            address: Ipv4Cidr::on(&"10.0.0.0/24".parse().unwrap(), Ipv4Addr::new(10, 0, 0, 9)),
            gateway: Ipv4Addr::new(10, 0, 0, 1),
            exec: exec.map(Into::into),
            machine: None,
            incoming: None,
            migrate_to: None,
        }
    }

    fn check(lb: &str, vm: &str) -> HealthCheck {
        HealthCheck {
            lb: lb.into(),
            vm_id: vm.into(),
            network: "a".into(),
            ip: Ipv4Addr::new(10, 0, 0, 9),
            port: 80,
            kind: crate::api::ProbeKind::Tcp,
            path: None,
            interval_ms: 1000,
            timeout_ms: 500,
            rise: 1,
            fall: 1,
        }
    }

    #[test]
    fn guest_changes_replace_what_each_vm_put_in_and_keep_the_lists_sorted() {
        let mut base = held();
        base.guests = vec![guest("a", None), guest("c", None)];
        base.health_checks = vec![check("lb1", "a"), check("lb1", "c"), check("lb2", "a")];
        let change = |vm_id: &str, g: Option<GuestState>, checks: Vec<HealthCheck>| GuestChange {
            vm_id: vm_id.into(),
            guest: g,
            health_checks: checks,
        };
        let next = base
            .apply(&answer(DesiredDelta {
                base: 1,
                guests: vec![
                    // New, between the two held.
                    change("b", Some(guest("b", None)), vec![check("lb0", "b")]),
                    // Changed, one check fewer.
                    change("a", Some(guest("a", Some("x"))), vec![check("lb2", "a")]),
                    // Gone.
                    change("c", None, vec![]),
                ],
                ..Default::default()
            }))
            .unwrap();
        let ids: Vec<&str> = next.guests.iter().map(|g| g.vm_id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(next.guests[0].exec.as_deref(), Some("x"));
        assert_eq!(next.health_checks, vec![check("lb0", "b"), check("lb2", "a")]);
        assert_eq!(next.overlays, base.overlays, "the rest stands");
        assert_eq!(next.version, 2);
        // A change carrying another VM's guest or check is refused.
        let wrong = base.apply(&answer(DesiredDelta {
            base: 1,
            guests: vec![change("a", Some(guest("b", None)), vec![])],
            ..Default::default()
        }));
        assert!(matches!(wrong, Err(DeltaError::OtherGuest { .. })), "{wrong:?}");
        let wrong = base.apply(&answer(DesiredDelta {
            base: 1,
            guests: vec![change("a", None, vec![check("lb1", "c")])],
            ..Default::default()
        }));
        assert!(matches!(wrong, Err(DeltaError::OtherGuest { .. })), "{wrong:?}");
    }

    /// The merge as a set: each removed entry taken out (it must be
    /// there), then each added one put in (it must not be).
    fn merge_as_a_set(held: &[u8], added: &[u8], removed: &[u8]) -> Result<Vec<u8>, ()> {
        let mut set: std::collections::BTreeSet<u8> = held.iter().copied().collect();
        for r in removed {
            if !set.remove(r) {
                return Err(());
            }
        }
        for a in added {
            if !set.insert(*a) {
                return Err(());
            }
        }
        Ok(set.into_iter().collect())
    }

    proptest::proptest! {
        /// The merge in one pass does what the set did: the same entries,
        /// sorted, and the same refusals (an entry removed that is not
        /// held, added that is, or listed twice), whatever the order of
        /// the lists it is given.
        #[test]
        fn a_merge_in_one_pass_is_the_merge_as_a_set(
            held in proptest::collection::btree_set(0u8..40, 0..30),
            added in proptest::collection::vec(0u8..40, 0..8),
            removed in proptest::collection::vec(0u8..40, 0..8),
            from_held in proptest::collection::vec(proptest::prelude::any::<proptest::sample::Index>(), 0..6),
        ) {
            let held: Vec<u8> = held.into_iter().collect();
            // Mostly entries that are held, as a real change removes.
            let mut removed = removed;
            if !held.is_empty() {
                removed.extend(from_held.iter().map(|i| held[i.index(held.len())]));
            }
            let mut merged = held.clone();
            let got = merge(&mut merged, &added, &removed).map(|()| merged);
            proptest::prop_assert_eq!(got, merge_as_a_set(&held, &added, &removed));
        }
    }

    #[test]
    fn a_delta_that_does_not_fit_the_state_held_is_refused() {
        let other_base = DesiredDelta {
            base: 5,
            ..Default::default()
        };
        assert_eq!(
            held().apply(&answer(other_base)),
            Err(DeltaError::OtherBase { base: 5, held: 1 })
        );
        let change = |c: OverlayChange| DesiredDelta {
            base: 1,
            own: None,
            overlays: vec![c],
            guests: vec![],
        };
        let unknown = change(OverlayChange {
            network: "zz".into(),
            ..Default::default()
        });
        assert!(matches!(
            held().apply(&answer(unknown)),
            Err(DeltaError::UnknownOverlay(_))
        ));
        let absent = change(OverlayChange {
            network: "a".into(),
            fdb_removed: vec![fdb(7, 7)],
            ..Default::default()
        });
        assert!(matches!(
            held().apply(&answer(absent)),
            Err(DeltaError::Mismatch { .. })
        ));
        let present = change(OverlayChange {
            network: "b".into(),
            neighbors_added: vec![nb(3)],
            ..Default::default()
        });
        let e = held().apply(&answer(present)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the delta does not match the neighbor entries held for overlay \"b\""
        );
        assert_eq!(held().apply(&held()), Err(DeltaError::NotADelta));
    }
}
