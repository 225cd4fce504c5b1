//! Which guests the relay endpoint may dial, and from where: the guests of
//! the desired state on a bridge this node hosts, by VM id. An address on
//! the wire is never one; the lease IP comes only from here.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use otherix_core::ipam::Ipv4Cidr;
use otherix_proto::agent::DesiredState;

/// A guest the relay may dial: its lease IP, and this node's address on its
/// bridge (the dial's source).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub ip: Ipv4Addr,
    pub source: Ipv4Addr,
}

/// VM id → target.
pub type Targets = BTreeMap<String, Target>;

/// The guests of `desired` that sit on a bridge this node hosts, with a lease
/// inside that bridge's subnet. Overlay guests are the gateways' business. A
/// guest being handed over to another node is none: its sessions end here, and
/// new ones reach it on its new node.
pub fn targets(desired: &DesiredState) -> Targets {
    let bridges: BTreeMap<&str, Ipv4Cidr> = desired
        .bridges
        .iter()
        .map(|b| (b.network.as_str(), b.address))
        .collect();
    desired
        .guests
        .iter()
        .filter(|g| g.migrate_to.is_none())
        .filter_map(|g| {
            let bridge = bridges.get(g.network.as_str())?;
            let (ip, source) = (g.address.addr(), bridge.addr());
            (bridge.contains(ip) && ip != source).then(|| (g.vm_id.clone(), Target { ip, source }))
        })
        .collect()
}

/// The guests of `desired` being handed over to another node (their
/// `migrate_to`): a resumable relay session to one follows it.
pub fn handovers(desired: &DesiredState) -> super::Handovers {
    desired
        .guests
        .iter()
        .filter(|g| g.migrate_to.is_some())
        .map(|g| g.vm_id.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use otherix_proto::agent::{BridgeState, GuestState, MigrateTo, OverlayState};

    use super::*;

    fn guest(vm_id: &str, network: &str, address: &str) -> GuestState {
        GuestState {
            incoming: Default::default(),
            machine: None,
            vm_id: vm_id.into(),
            name: format!("vm-{vm_id}"),
            network: network.into(),
            network_id: format!("id-{network}"),
            mac: "02:00:00:00:00:09".parse().unwrap(),
            address: address.parse().unwrap(),
            gateway: Ipv4Addr::UNSPECIFIED,
            exec: None,
            migrate_to: None,
        }
    }

    #[test]
    fn only_guests_on_bridges_of_this_node_are_targets() {
        let desired = DesiredState {
            bridges: vec![BridgeState {
                network: "lab".into(),
                network_id: "id-lab".into(),
                subnet: "10.214.1.0/24".parse().unwrap(),
                address: "10.214.1.1/24".parse().unwrap(),
            }],
            overlays: vec![OverlayState {
                network: "ov".into(),
                network_id: "id-ov".into(),
                vni: 100,
                subnet: "10.100.0.0/24".parse().unwrap(),
                address: "10.100.0.2/24".parse().unwrap(),
                mac: "02:00:00:00:00:01".parse().unwrap(),
                fdb: vec![],
                neighbors: vec![],
            }],
            guests: vec![
                guest("aa01", "lab", "10.214.1.5/24"),
                guest("aa02", "ov", "10.100.0.7/24"),
                guest("aa03", "lab", "10.99.0.5/24"),
                guest("aa04", "lab", "10.214.1.1/24"),
                guest("aa05", "gone", "10.214.1.6/24"),
                GuestState {
                    migrate_to: Some(MigrateTo {
                        qemu: None,
                        node: "node2".into(),
                        netns: "ns-node2".into(),
                        bridge: "oxlid-lab".into(),
                    }),
                    ..guest("aa06", "lab", "10.214.1.7/24")
                },
            ],
            ..Default::default()
        };
        let t = targets(&desired);
        assert_eq!(
            t,
            Targets::from([(
                "aa01".to_string(),
                Target {
                    ip: Ipv4Addr::new(10, 214, 1, 5),
                    source: Ipv4Addr::new(10, 214, 1, 1)
                }
            )]),
            "overlay guests, leases outside the subnet, the node's own address, unknown bridges \
             and guests being handed over are left out"
        );
    }
}
