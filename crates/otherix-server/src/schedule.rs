//! Where unplaced VMs run, pure: the candidate nodes in the order of
//! their guests, the networks and VMs in, the placements out. A VM goes
//! to a Ready hypervisor that can host its network — any for an overlay,
//! only the network's own nodes for a bridge network — with the fewest
//! guests (ties by name, for determinism). Each placement counts towards
//! the next, so a burst of creates spreads. The candidates come fewest
//! guests first (`catalog::Model::hosts_by_load` keeps that order), so a
//! choice stops at the first node that can take the VM rather than
//! walking every node of the cluster.

use std::collections::{BTreeMap, HashMap};

use otherix_proto::{Network, Vm};
use otherix_store::NodeRecord;
use time::{Duration, OffsetDateTime};

use crate::desired::{can_host, is_ready};

/// One VM to place on one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub vm_id: String,
    pub node: String,
}

/// Guests per node, as placed.
pub fn load<'a>(vms: impl IntoIterator<Item = &'a Vm>) -> BTreeMap<String, usize> {
    let mut load = BTreeMap::new();
    for vm in vms {
        if let Some(n) = &vm.node {
            *load.entry(n.clone()).or_default() += 1;
        }
    }
    load
}

/// Candidate nodes with their guests, fewest first, ties by name.
pub type Hosts<'a> = Box<dyn Iterator<Item = (usize, &'a NodeRecord)> + 'a>;

/// The node for a VM on `net` among `hosts` (its candidates with their
/// guests, in the order of (guests, name)), counting `added` guests more
/// on the nodes this pass already chose; `None` while no node can take it
/// (a bridge VM waits for one of its network's nodes). The Ready
/// hypervisor with the fewest guests, ties by name: the walk stops once
/// no later candidate can beat the best so far (a candidate's guests only
/// grow by what was `added`).
pub fn choose_node<'a>(
    hosts: impl Iterator<Item = (usize, &'a NodeRecord)>,
    net: &Network,
    added: &HashMap<String, usize>,
    now: OffsetDateTime,
    timeout: Duration,
) -> Option<&'a NodeRecord> {
    let mut best: Option<(usize, &'a NodeRecord)> = None;
    for (load, n) in hosts {
        if best.is_some_and(|(b, bn)| (load, n.name.as_str()) > (b, bn.name.as_str())) {
            break;
        }
        if !(n.hypervisor && is_ready(n, now, timeout) && can_host(net, &n.name)) {
            continue;
        }
        let load = load + added.get(&n.name).copied().unwrap_or(0);
        if best.is_none_or(|(b, bn)| (load, n.name.as_str()) < (b, bn.name.as_str())) {
            best = Some((load, n));
        }
    }
    best.map(|(_, n)| n)
}

/// A placement for every unplaced VM of `vms` that some node can take now,
/// each choice counting towards the next; `hosts` gives a network's
/// candidates as [`choose_node`] takes them, `added` the guests each node
/// has beyond them (written, not yet in the catalog).
pub fn placements<'a>(
    hosts: impl Fn(&'a Network) -> Hosts<'a>,
    networks: &BTreeMap<&str, &'a Network>,
    vms: &[&Vm],
    mut added: HashMap<String, usize>,
    now: OffsetDateTime,
    timeout: Duration,
) -> Vec<Placement> {
    let mut out = Vec::new();
    for vm in vms.iter().filter(|vm| vm.node.is_none()) {
        let Some(net) = networks.get(vm.network.as_str()) else {
            continue;
        };
        let Some(node) = choose_node(hosts(net), net, &added, now, timeout) else {
            continue;
        };
        *added.entry(node.name.clone()).or_default() += 1;
        out.push(Placement {
            vm_id: vm.id.clone(),
            node: node.name.clone(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use otherix_proto::{NetworkType, VmState};

    const TIMEOUT: Duration = Duration::seconds(10);

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn node(name: &str, hypervisor: bool, ready: bool) -> NodeRecord {
        NodeRecord {
            hypervisor,
            last_heartbeat: ready.then(now),
            ..NodeRecord::new(name, now())
        }
    }

    fn network(name: &str, kind: NetworkType, nodes: &[&str]) -> Network {
        Network {
            name: name.into(),
            id: format!("id-{name}"),
            kind,
            subnet: "10.100.0.0/24".parse().unwrap(),
            vni: None,
            node: nodes.first().map(|n| n.to_string()),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            node_address: "10.100.0.1".parse().unwrap(),
            vms: 0,
            created_at: now(),
        }
    }

    fn vm(name: &str, network: &str, on: Option<&str>) -> Vm {
        Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: name.into(),
            id: format!("id-{name}"),
            network: network.into(),
            node: on.map(Into::into),
            labels: Default::default(),
            mac: "02:00:00:00:00:01".parse().unwrap(),
            ip: "10.100.0.2".parse().unwrap(),
            state: VmState::Pending,
            reason: None,
            exec: None,
            migrate_to: None,
            created_at: now(),
        }
    }

    /// [`placements`] over rows, with the load they make, every node a
    /// candidate in the order of (guests, name).
    fn place(nodes: &[NodeRecord], nets: &[Network], vms: &[Vm]) -> Vec<Placement> {
        let load = load(vms);
        let mut order: Vec<(usize, &NodeRecord)> = nodes
            .iter()
            .map(|n| (load.get(&n.name).copied().unwrap_or(0), n))
            .collect();
        order.sort_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
        let nets: BTreeMap<&str, &Network> = nets.iter().map(|n| (n.name.as_str(), n)).collect();
        let vms: Vec<&Vm> = vms.iter().collect();
        placements(
            |_| Box::new(order.clone().into_iter()),
            &nets,
            &vms,
            HashMap::new(),
            now(),
            TIMEOUT,
        )
    }

    proptest::proptest! {
        /// The walk that stops early chooses what the whole walk would: the
        /// Ready hypervisor that can host the network with the fewest
        /// guests counting those added, ties by name.
        #[test]
        fn stopping_early_chooses_what_walking_every_node_would(
            nodes in proptest::collection::vec((0usize..4, proptest::bool::ANY, proptest::bool::ANY, 0usize..3), 1..12),
            bridge in proptest::bool::ANY,
        ) {
            let records: Vec<NodeRecord> = nodes
                .iter()
                .enumerate()
                .map(|(i, (_, hv, ready, _))| node(&format!("n{i:02}"), *hv, *ready))
                .collect();
            let load: BTreeMap<String, usize> =
                nodes.iter().enumerate().map(|(i, n)| (format!("n{i:02}"), n.0)).collect();
            let added: HashMap<String, usize> =
                nodes.iter().enumerate().map(|(i, n)| (format!("n{i:02}"), n.3)).collect();
            let net = if bridge {
                network("lan", NetworkType::Bridge, &["n01", "n03", "n04"])
            } else {
                network("ov", NetworkType::Overlay, &[])
            };
            let mut order: Vec<(usize, &NodeRecord)> = records.iter().map(|n| (load[&n.name], n)).collect();
            order.sort_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
            let chosen = choose_node(order.into_iter(), &net, &added, now(), TIMEOUT).map(|n| n.name.clone());
            let every = records
                .iter()
                .filter(|n| n.hypervisor && is_ready(n, now(), TIMEOUT) && can_host(&net, &n.name))
                .min_by_key(|n| (load[&n.name] + added[&n.name], n.name.clone()))
                .map(|n| n.name.clone());
            proptest::prop_assert_eq!(chosen, every);
        }
    }

    fn placed(p: &[Placement]) -> Vec<(&str, &str)> {
        p.iter().map(|p| (p.vm_id.as_str(), p.node.as_str())).collect()
    }

    #[test]
    fn the_least_loaded_ready_hypervisor_gets_the_vm() {
        let nets = [network("ov", NetworkType::Overlay, &[])];
        let mut nodes = vec![
            node("n1", true, true),
            node("n2", true, true),
            node("gw", false, true),
        ];
        let vms = [vm("a", "ov", Some("n1")), vm("b", "ov", None)];
        assert_eq!(placed(&place(&nodes, &nets, &vms)), [("id-b", "n2")]);
        nodes[1].last_heartbeat = Some(now() - Duration::seconds(60));
        assert_eq!(
            placed(&place(&nodes, &nets, &vms)),
            [("id-b", "n1")],
            "NotReady nodes are skipped"
        );
        nodes[0].hypervisor = false;
        assert!(
            place(&nodes, &nets, &vms).is_empty(),
            "gateways do not host guests"
        );
    }

    #[test]
    fn a_burst_of_new_vms_spreads_over_the_nodes() {
        let nets = [network("ov", NetworkType::Overlay, &[])];
        let nodes = [node("n1", true, true), node("n2", true, true)];
        let vms: Vec<Vm> = (0..4).map(|i| vm(&format!("v{i}"), "ov", None)).collect();
        assert_eq!(
            placed(&place(&nodes, &nets, &vms)),
            [("id-v0", "n1"), ("id-v1", "n2"), ("id-v2", "n1"), ("id-v3", "n2")]
        );
    }

    #[test]
    fn a_bridge_vm_goes_only_to_its_networks_nodes() {
        let nets = [network("lan", NetworkType::Bridge, &["n1", "n2"])];
        let mut nodes = vec![
            node("n1", true, true),
            node("n2", true, true),
            node("n3", true, true),
        ];
        let vms = [vm("l", "lan", Some("n1")), vm("m", "lan", None)];
        // n3 is the least loaded, but has no bridge for lan.
        assert_eq!(placed(&place(&nodes, &nets, &vms)), [("id-m", "n2")]);
        nodes[1].last_heartbeat = None;
        assert_eq!(placed(&place(&nodes, &nets, &vms)), [("id-m", "n1")]);
        nodes[0].last_heartbeat = None;
        assert!(
            place(&nodes, &nets, &vms).is_empty(),
            "waits for one of its nodes"
        );
    }
}
