//! The live-migration state machine on the control plane (see "Live
//! migration" in `docs/architecture.md`), pure: state and `now` in, what to
//! do out. The handlers only read the store, ask here, and apply.
//!
//! A migration is `running` → `migrating` (the VM names its target; the
//! target joins the VM's network) → handed over by the source (`moved`: the
//! VM is placed on the target) or rolled back (the source failed, or the
//! target turned NotReady meanwhile).

use otherix_proto::agent::{MigrationOutcome, MigrationReport};
use otherix_proto::{Network, Vm, VmState};
use otherix_store::NodeRecord;
use time::{Duration, OffsetDateTime};

use crate::desired::{can_host, is_ready};

/// Why a migration cannot start (409 `cannot_migrate` at the API).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("vm {vm:?} is not placed on a node yet")]
    NotPlaced { vm: String },
    #[error("vm {vm:?} already runs on {node}")]
    AlreadyThere { vm: String, node: String },
    #[error("node {node:?} is NotReady")]
    NotReady { node: String },
    #[error("node {node:?} is not a hypervisor")]
    NotHypervisor { node: String },
    #[error(
        "vm {vm:?} is on bridge network {network:?}, which node {node:?} does not have (it exists on {on}); \
         add it there first (otherix network node add {network} {node})"
    )]
    NetworkNotThere {
        vm: String,
        network: String,
        node: String,
        on: String,
    },
    #[error("node {node:?} runs no netns guest runtime a guest could be handed to")]
    NoRuntime { node: String },
    #[error("vm {vm:?} is {state}, not running")]
    NotRunning { vm: String, state: VmState },
}

/// Checks that `vm` (on network `net`) may start migrating to `target`;
/// returns the node it leaves.
pub fn start(
    vm: &Vm,
    net: &Network,
    target: &NodeRecord,
    now: OffsetDateTime,
    node_timeout: Duration,
) -> Result<String, Refused> {
    let from = vm
        .node
        .clone()
        .ok_or_else(|| Refused::NotPlaced { vm: vm.name.clone() })?;
    let to = &target.name;
    if &from == to {
        return Err(Refused::AlreadyThere {
            vm: vm.name.clone(),
            node: from,
        });
    }
    if !is_ready(target, now, node_timeout) {
        return Err(Refused::NotReady { node: to.clone() });
    }
    if !target.hypervisor {
        return Err(Refused::NotHypervisor { node: to.clone() });
    }
    // A bridge network is a segment per node: the guest can only land on
    // another node that has one.
    if !can_host(net, to) {
        return Err(Refused::NetworkNotThere {
            vm: vm.name.clone(),
            network: net.name.clone(),
            node: to.clone(),
            on: net.nodes.join(", "),
        });
    }
    if target.netns.is_none() {
        return Err(Refused::NoRuntime { node: to.clone() });
    }
    if vm.state != VmState::Running {
        return Err(Refused::NotRunning {
            vm: vm.name.clone(),
            state: vm.state,
        });
    }
    Ok(from)
}

/// What to do about one migration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The source handed the guest over: place it on `to`.
    Complete { vm_id: String, vm: String, to: String },
    /// Give up: the VM stays on its source, `reason` says why.
    RollBack {
        vm_id: String,
        vm: String,
        reason: String,
    },
}

/// The steps a heartbeat from `node` leads to: its reports about the guests
/// it is handing over, then every migration away from it whose target is
/// no longer Ready. Reports about VMs that are not migrating away from
/// `node` are ignored (a node speaks only for its own guests).
pub fn steps(
    node: &str,
    vms: &[Vm],
    nodes: &[NodeRecord],
    reports: &[MigrationReport],
    now: OffsetDateTime,
    node_timeout: Duration,
) -> Vec<Step> {
    let leaving = |vm: &&Vm| vm.node.as_deref() == Some(node) && vm.migrate_to.is_some();
    let mut steps = Vec::new();
    let mut decided = std::collections::BTreeSet::new();
    for m in reports {
        let Some(vm) = vms.iter().filter(leaving).find(|vm| vm.id == m.vm_id) else {
            continue;
        };
        if !decided.insert(vm.id.as_str()) {
            continue;
        }
        let to = vm.migrate_to.clone().unwrap_or_default();
        steps.push(match m.outcome {
            MigrationOutcome::Moved => Step::Complete {
                vm_id: vm.id.clone(),
                vm: vm.name.clone(),
                to,
            },
            MigrationOutcome::Failed => Step::RollBack {
                vm_id: vm.id.clone(),
                vm: vm.name.clone(),
                reason: format!(
                    "migration to {to} rolled back: {}",
                    m.reason.as_deref().unwrap_or("the source node failed")
                ),
            },
        });
    }
    for vm in vms.iter().filter(leaving) {
        if decided.contains(vm.id.as_str()) {
            continue;
        }
        let Some(to) = &vm.migrate_to else { continue };
        let ready = nodes
            .iter()
            .any(|n| &n.name == to && is_ready(n, now, node_timeout));
        if !ready {
            steps.push(Step::RollBack {
                vm_id: vm.id.clone(),
                vm: vm.name.clone(),
                reason: format!("migration to {to} rolled back: {to} is NotReady"),
            });
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;
    use otherix_proto::NetworkType;

    const TIMEOUT: Duration = Duration::seconds(10);

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn node(name: &str, ready: bool) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            hypervisor: true,
            netns: Some(format!("ox-{name}")),
            last_heartbeat: ready.then(now),
            ..NodeRecord::new(name, now())
        }
    }

    fn vm(name: &str, on: &str, to: Option<&str>) -> Vm {
        Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: name.into(),
            id: format!("id-{name}"),
            network: "ov".into(),
            node: Some(on.into()),
            labels: Default::default(),
            mac: "02:00:00:00:00:01".parse().unwrap(),
            ip: "10.100.0.2".parse().unwrap(),
            state: if to.is_some() {
                VmState::Migrating
            } else {
                VmState::Running
            },
            reason: None,
            exec: None,
            migrate_to: to.map(Into::into),
            created_at: now(),
        }
    }

    fn network(kind: NetworkType, nodes: &[&str]) -> Network {
        Network {
            name: "ov".into(),
            id: "net".into(),
            kind,
            subnet: "10.100.0.0/24".parse().unwrap(),
            vni: Some(100),
            node: nodes.first().map(|n| n.to_string()),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            node_address: "10.100.0.1".parse().unwrap(),
            vms: 1,
            created_at: now(),
        }
    }

    fn report(vm: &str, outcome: MigrationOutcome) -> MigrationReport {
        MigrationReport {
            vm_id: format!("id-{vm}"),
            outcome,
            reason: Some("veth busy".into()),
        }
    }

    #[test]
    fn a_migration_starts_only_to_a_ready_hypervisor_that_can_take_the_guest() {
        let overlay = network(NetworkType::Overlay, &[]);
        let web = vm("web01", "n1", None);
        assert_eq!(
            start(&web, &overlay, &node("n2", true), now(), TIMEOUT),
            Ok("n1".into())
        );
        let refused =
            |target: NodeRecord, vm: &Vm, net: &Network| start(vm, net, &target, now(), TIMEOUT).unwrap_err();
        assert!(matches!(
            refused(node("n1", true), &web, &overlay),
            Refused::AlreadyThere { .. }
        ));
        assert!(matches!(
            refused(node("n2", false), &web, &overlay),
            Refused::NotReady { .. }
        ));
        let gateway_only = NodeRecord {
            hypervisor: false,
            ..node("gw", true)
        };
        assert!(matches!(
            refused(gateway_only, &web, &overlay),
            Refused::NotHypervisor { .. }
        ));
        let no_runtime = NodeRecord {
            netns: None,
            ..node("n2", true)
        };
        assert!(matches!(
            refused(no_runtime, &web, &overlay),
            Refused::NoRuntime { .. }
        ));
        let lan = network(NetworkType::Bridge, &["n1", "n3"]);
        assert_eq!(
            refused(node("n2", true), &web, &lan).to_string(),
            "vm \"web01\" is on bridge network \"ov\", which node \"n2\" does not have (it exists on n1, n3); \
             add it there first (otherix network node add ov n2)"
        );
        assert!(start(&web, &lan, &node("n3", true), now(), TIMEOUT).is_ok());
        let moving = vm("web01", "n1", Some("n3"));
        assert!(matches!(
            refused(node("n2", true), &moving, &overlay),
            Refused::NotRunning { .. }
        ));
        let unplaced = Vm {
            node: None,
            ..vm("web01", "n1", None)
        };
        assert!(matches!(
            refused(node("n2", true), &unplaced, &overlay),
            Refused::NotPlaced { .. }
        ));
    }

    #[test]
    fn the_source_s_word_completes_or_rolls_back_its_own_migrations_only() {
        let vms = [
            vm("a", "n1", Some("n2")),
            vm("b", "n1", Some("n2")),
            vm("c", "n3", Some("n2")),
        ];
        let nodes = [node("n1", true), node("n2", true), node("n3", true)];
        let reports = [
            report("a", MigrationOutcome::Moved),
            report("b", MigrationOutcome::Failed),
            // n1 cannot speak for a guest it does not hold.
            report("c", MigrationOutcome::Moved),
        ];
        let got = steps("n1", &vms, &nodes, &reports, now(), TIMEOUT);
        assert_eq!(
            got,
            [
                Step::Complete {
                    vm_id: "id-a".into(),
                    vm: "a".into(),
                    to: "n2".into()
                },
                Step::RollBack {
                    vm_id: "id-b".into(),
                    vm: "b".into(),
                    reason: "migration to n2 rolled back: veth busy".into()
                },
            ]
        );
        assert!(
            steps("n1", &vms, &nodes, &[], now(), TIMEOUT).is_empty(),
            "nothing said, nothing done"
        );
    }

    #[test]
    fn a_target_that_turned_not_ready_rolls_its_migrations_back() {
        let vms = [vm("a", "n1", Some("n2")), vm("b", "n1", None)];
        let nodes = [node("n1", true), node("n2", false)];
        assert_eq!(
            steps("n1", &vms, &nodes, &[], now(), TIMEOUT),
            [Step::RollBack {
                vm_id: "id-a".into(),
                vm: "a".into(),
                reason: "migration to n2 rolled back: n2 is NotReady".into()
            }]
        );
        // A handover reported in the same heartbeat wins over the rollback.
        let moved = [report("a", MigrationOutcome::Moved)];
        assert!(matches!(
            steps("n1", &vms, &nodes, &moved, now(), TIMEOUT)[..],
            [Step::Complete { .. }]
        ));
    }
}
