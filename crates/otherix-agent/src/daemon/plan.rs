//! Desired state → kernel specs: the pure half of reconciliation.
//!
//! [`plan`] turns the control plane's [`DesiredState`] (strings, ids) into the
//! netlink layer's [`OverlaySpec`]/[`BridgeSpec`] and the runtime's [`GuestSpec`]
//! (interface names, parsed addresses and MACs). It does no IO, so every mapping rule
//! — names, MTU, which bridge a guest plugs into, which links to keep — is unit-tested
//! here. A malformed object fails alone, with a reason; the others are still planned.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::sync::Arc;

use otherix_core::ipam::Ipv4Cidr;
use otherix_proto::agent::{BridgeState, DesiredState, GuestState, OverlayState};

use super::host::UnderlayError;
use super::names;
use crate::filter::HostRules;
use crate::net::{BridgeSpec, FdbEntry, IfAddr, NeighborEntry, OverlaySpec, VXLAN_PORT};
use crate::runtime::{GuestSpec, QemuSpec, RuntimeError};

/// MTU used when the desired state carries none (1500-byte underlay minus VXLAN's 50).
pub const DEFAULT_MTU: u32 = 1450;

/// Where this node's VXLAN packets leave: its VTEP address and the interface holding it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Underlay {
    pub vtep: Ipv4Addr,
    pub device: String,
}

/// Why an object of the desired state cannot be converged on this node. It
/// fails alone; the others are still planned, and the reason is what the
/// guest's status reports.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// This node's fault (or its operator's): no underlay for the overlay's
    /// VXLAN device this round.
    #[error("no underlay for VXLAN: {0}")]
    NoUnderlay(#[source] UnderlayError),
    /// The control plane placed a guest on a network this node does not
    /// have (yet).
    #[error("network {0} is not realized on this node")]
    NetworkNotRealized(String),
    /// Two guest ids share the prefix short names are cut from: the
    /// second is refused rather than given the first one's interfaces.
    #[error("short name {short} is already used by guest {other}")]
    NameTaken { short: String, other: String },
    /// The control plane's guest is not realizable as given (a multicast
    /// MAC, a bad prefix).
    #[error(transparent)]
    InvalidGuest(Arc<RuntimeError>),
}

/// One network (overlay or bridge) to converge, or why it cannot be.
#[derive(Clone, Debug)]
pub struct NetworkPlan<T> {
    /// The network's name, for logs.
    pub network: String,
    pub spec: Result<T, PlanError>,
}

/// One guest to converge, or why it cannot be.
#[derive(Clone, Debug)]
pub struct GuestPlan {
    pub vm_id: String,
    /// The VM's name (given to its workload as `OTHERIX_VM_NAME`).
    pub name: String,
    pub spec: Result<GuestSpec, PlanError>,
}

/// Everything one reconcile round does, in order.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    pub overlays: Vec<NetworkPlan<OverlaySpec>>,
    pub bridges: Vec<NetworkPlan<BridgeSpec>>,
    pub guests: Vec<GuestPlan>,
    /// Every link the desired state names, whether or not its spec is valid: links
    /// with our prefixes that are not in here are stale and get deleted.
    pub keep_links: BTreeSet<String>,
    /// The node's packet filter: VXLAN from the overlays' VTEPs only, guests kept
    /// from the node's services and from other networks.
    pub host_rules: HostRules,
}

impl Plan {
    /// Ids of the guests the desired state names.
    pub fn guest_ids(&self) -> BTreeSet<&str> {
        self.guests.iter().map(|g| g.vm_id.as_str()).collect()
    }

    /// Whether the desired state puts anything on the node (a network or a
    /// guest): then the host rules are wanted.
    pub fn is_empty(&self) -> bool {
        self.overlays.is_empty() && self.bridges.is_empty() && self.guests.is_empty()
    }
}

/// Per overlay VXLAN device of `desired` (every one, so that a device that
/// forwarded and no longer does is cleared), the MACs of guests that left
/// this node whose frames it sends on ([`crate::net::forward`]): those the
/// control plane lists in `forwards`, and those of `handed_over` (guests
/// whose handover finished here while the desired state still asks for it:
/// the control plane has not placed them on their target yet). A group
/// MAC is never forwarded.
pub fn forwards(
    desired: &DesiredState,
    handed_over: &BTreeSet<String>,
) -> BTreeMap<String, BTreeSet<[u8; 6]>> {
    let mut out: BTreeMap<String, BTreeSet<[u8; 6]>> = BTreeMap::new();
    let mut device_of: BTreeMap<&str, String> = BTreeMap::new();
    for o in &desired.overlays {
        let vxlan = names::vxlan(o.vni);
        out.entry(vxlan.clone()).or_default();
        device_of.insert(&o.network, vxlan);
    }
    let left = desired
        .forwards
        .iter()
        .map(|f| (f.network.as_str(), f.mac.0))
        .chain(
            desired
                .guests
                .iter()
                .filter(|g| g.migrate_to.is_some() && handed_over.contains(&g.vm_id))
                .map(|g| (g.network.as_str(), g.mac.0)),
        );
    for (network, mac) in left {
        if mac[0] & 1 == 1 {
            continue;
        }
        if let Some(set) = device_of.get(network).and_then(|d| out.get_mut(d)) {
            set.insert(mac);
        }
    }
    out
}

/// The overlay VXLAN device and MAC through which this node would forward
/// the guest `vm_id` once it has left (as [`forwards`] lists it after its
/// handover): `None` for a guest not in `desired`, on a network that is not
/// an overlay here, or with a group MAC.
pub fn forward_of(desired: &DesiredState, vm_id: &str) -> Option<(String, [u8; 6])> {
    let g = desired.guests.iter().find(|g| g.vm_id == vm_id)?;
    if g.mac.0[0] & 1 == 1 {
        return None;
    }
    let o = desired.overlays.iter().find(|o| o.network == g.network)?;
    Some((names::vxlan(o.vni), g.mac.0))
}

/// Where guest `vm_id` runs by its overlay's FDB (the control plane's
/// record): on a migration's target, the source's VTEP, the one address the
/// stream may come from. `None` off an overlay, or with no entry.
pub fn source_vtep(desired: &DesiredState, vm_id: &str) -> Option<std::net::Ipv4Addr> {
    let g = desired.guests.iter().find(|g| g.vm_id == vm_id)?;
    let o = desired.overlays.iter().find(|o| o.network == g.network)?;
    o.fdb.iter().find(|e| e.mac == g.mac).map(|e| e.vtep)
}

/// Maps `desired` to specs. `underlay` is needed by overlays only: when it is unknown,
/// each overlay fails with its reason. Guest namespaces are named `netns_prefix...`.
pub fn plan(desired: &DesiredState, underlay: &Result<Underlay, UnderlayError>, netns_prefix: &str) -> Plan {
    let mtu = if desired.mtu == 0 {
        DEFAULT_MTU
    } else {
        desired.mtu
    };
    let mut keep_links = BTreeSet::new();
    // network_id → the bridge its guests plug into.
    let mut bridge_of: BTreeMap<&str, String> = BTreeMap::new();

    let overlays = desired
        .overlays
        .iter()
        .map(|o| {
            let (bridge, vxlan) = (names::overlay_bridge(o.vni), names::vxlan(o.vni));
            keep_links.insert(bridge.clone());
            keep_links.insert(vxlan);
            bridge_of.insert(&o.network_id, bridge);
            NetworkPlan {
                network: o.network.clone(),
                spec: overlay_spec(o, mtu, underlay),
            }
        })
        .collect();

    let bridges = desired
        .bridges
        .iter()
        .map(|b| {
            let bridge = names::bridge_network(&b.network_id);
            keep_links.insert(bridge.clone());
            bridge_of.insert(&b.network_id, bridge);
            let guests = desired.guests.iter().filter(|g| g.network_id == b.network_id);
            NetworkPlan {
                network: b.network.clone(),
                spec: bridge_spec(b, mtu, guests),
            }
        })
        .collect();

    // Short names are truncated ids: refuse the rare guest whose name another took.
    let mut taken: BTreeMap<String, &str> = BTreeMap::new();
    let guests = desired
        .guests
        .iter()
        .map(|g| {
            let host_veth = names::host_veth(&g.vm_id);
            let netns = names::guest_netns(netns_prefix, &g.vm_id);
            keep_links.insert(host_veth.clone());
            let mut spec = match bridge_of.get(g.network_id.as_str()) {
                Some(bridge) => guest_spec(g, bridge, host_veth, netns, mtu),
                None => Err(PlanError::NetworkNotRealized(g.network.clone())),
            };
            let clash = spec.as_ref().ok().and_then(|s| {
                [&s.host_veth, &s.netns].into_iter().find_map(|short| {
                    taken
                        .insert(short.clone(), &g.vm_id)
                        .map(|other| PlanError::NameTaken {
                            short: short.clone(),
                            other: other.to_owned(),
                        })
                })
            });
            if let Some(reason) = clash {
                spec = Err(reason);
            }
            GuestPlan {
                vm_id: g.vm_id.clone(),
                name: g.name.clone(),
                spec,
            }
        })
        .collect();

    Plan {
        overlays,
        bridges,
        guests,
        keep_links,
        host_rules: host_rules(desired, underlay),
    }
}

/// The host rules `desired` asks for: VXLAN from every remote VTEP of this node's
/// overlays (their FDB entries name every member and every guest's host), and
/// each guest-facing bridge with this node's address on it.
fn host_rules(desired: &DesiredState, underlay: &Result<Underlay, UnderlayError>) -> HostRules {
    let local = underlay.as_ref().ok().map(|u| u.vtep);
    let vteps = desired
        .overlays
        .iter()
        .flat_map(|o| o.fdb.iter().map(|e| e.vtep))
        .filter(|vtep| Some(*vtep) != local)
        .collect();
    let overlays = desired
        .overlays
        .iter()
        .map(|o| (names::overlay_bridge(o.vni), Some(o.address.addr())));
    let bridges = desired
        .bridges
        .iter()
        .map(|b| (names::bridge_network(&b.network_id), Some(b.address.addr())));
    HostRules {
        vxlan_port: VXLAN_PORT,
        vteps,
        bridges: overlays.chain(bridges).collect(),
    }
}

fn overlay_spec(
    o: &OverlayState,
    mtu: u32,
    underlay: &Result<Underlay, UnderlayError>,
) -> Result<OverlaySpec, PlanError> {
    let underlay = underlay
        .as_ref()
        .map_err(|reason| PlanError::NoUnderlay(reason.clone()))?;
    let fdb = o.fdb.iter().map(|e| FdbEntry::new(e.mac.0, e.vtep)).collect();
    let neighbors = o
        .neighbors
        .iter()
        .map(|n| NeighborEntry::new(n.ip, n.mac.0))
        .collect();
    Ok(OverlaySpec {
        bridge: names::overlay_bridge(o.vni),
        vxlan: names::vxlan(o.vni),
        vni: o.vni,
        local_vtep: underlay.vtep,
        underlay: underlay.device.clone(),
        mtu,
        address: Some(if_addr(o.address)),
        mac: Some(o.mac.0),
        fdb,
        neighbors,
    })
}

fn bridge_spec<'a>(
    b: &BridgeState,
    mtu: u32,
    guests: impl Iterator<Item = &'a GuestState>,
) -> Result<BridgeSpec, PlanError> {
    // The guests' IP → MAC as permanent entries, so the node (and a gateway on it)
    // never learns a guest's address from ARP.
    let neighbors = guests
        .map(|g| NeighborEntry::new(g.address.addr(), g.mac.0))
        .collect();
    Ok(BridgeSpec {
        bridge: names::bridge_network(&b.network_id),
        mtu,
        address: Some(if_addr(b.address)),
        // One MAC for the node-side address on every node of the network.
        mac: Some(names::bridge_network_mac(&b.network_id)),
        neighbors,
    })
}

fn guest_spec(
    g: &GuestState,
    bridge: &str,
    host_veth: String,
    netns: String,
    mtu: u32,
) -> Result<GuestSpec, PlanError> {
    let spec = GuestSpec {
        id: g.vm_id.clone(),
        netns,
        host_veth,
        bridge: bridge.to_owned(),
        mac: g.mac.0,
        ip: g.address.addr(),
        prefix: g.address.prefix(),
        gateway: g.gateway,
        mtu,
        command: workload_command(g.exec.as_deref()),
        qemu: g.machine.as_ref().map(|m| QemuSpec {
            hostname: g.name.clone(),
            memory_mib: m.memory_mib,
            cpus: m.cpus,
            image: m.image.clone(),
            ssh_keys: m.ssh_keys.clone(),
        }),
    };
    spec.validate()
        .map_err(|e| PlanError::InvalidGuest(Arc::new(e)))?;
    Ok(spec)
}

/// The argv of a guest's workload: its `exec` line, run by `sh -c`.
pub fn workload_command(exec: Option<&str>) -> Option<Vec<String>> {
    let exec = exec?.trim();
    (!exec.is_empty()).then(|| vec!["sh".into(), "-c".into(), exec.into()])
}

/// The netlink address of an interface address.
fn if_addr(c: Ipv4Cidr) -> IfAddr {
    IfAddr::new(c.addr(), c.prefix())
}

#[cfg(test)]
mod tests {
    use otherix_proto::agent::{FdbEntry as ApiFdb, NeighborEntry as ApiNeighbor};

    use super::*;

    const VM1: &str = "aaaaaaaaaaaa00000000000000000001";
    const VM2: &str = "bbbbbbbbbbbb00000000000000000002";

    fn underlay() -> Result<Underlay, UnderlayError> {
        Ok(Underlay {
            vtep: Ipv4Addr::new(10, 213, 0, 1),
            device: "eth0".into(),
        })
    }

    fn desired() -> DesiredState {
        DesiredState {
            version: 7,
            node: "n1".into(),
            mtu: 1400,
            overlays: vec![OverlayState {
                network: "web".into(),
                network_id: "0123456789abcdef".into(),
                vni: 100,
                subnet: "10.100.0.0/24".parse().unwrap(),
                address: "10.100.0.4/24".parse().unwrap(),
                mac: "02:00:00:00:01:01".parse().unwrap(),
                fdb: vec![ApiFdb {
                    mac: "02:00:00:00:00:0b".parse().unwrap(),
                    vtep: "10.213.0.2".parse().unwrap(),
                }],
                neighbors: vec![ApiNeighbor {
                    ip: "10.100.0.3".parse().unwrap(),
                    mac: "02:00:00:00:00:0b".parse().unwrap(),
                }],
            }],
            bridges: vec![BridgeState {
                network: "lab".into(),
                network_id: "fedcba9876543210".into(),
                subnet: "10.101.0.0/24".parse().unwrap(),
                address: "10.101.0.1/24".parse().unwrap(),
            }],
            guests: vec![
                GuestState {
                    incoming: Default::default(),
                    machine: None,
                    vm_id: VM1.into(),
                    name: "web01".into(),
                    network: "web".into(),
                    network_id: "0123456789abcdef".into(),
                    mac: "02:00:00:00:00:0a".parse().unwrap(),
                    address: "10.100.0.2/24".parse().unwrap(),
                    gateway: "10.100.0.1".parse().unwrap(),
                    exec: Some("otherix guest http".into()),
                    migrate_to: None,
                },
                GuestState {
                    incoming: Default::default(),
                    machine: None,
                    vm_id: VM2.into(),
                    name: "lab01".into(),
                    network: "lab".into(),
                    network_id: "fedcba9876543210".into(),
                    mac: "02:00:00:00:00:0c".parse().unwrap(),
                    address: "10.101.0.2/24".parse().unwrap(),
                    gateway: "10.101.0.1".parse().unwrap(),
                    exec: None,
                    migrate_to: None,
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn forwards_are_the_control_planes_and_the_guests_just_handed_over_on_their_overlay_device() {
        let mut d = desired();
        let none = BTreeSet::new();
        assert_eq!(
            forwards(&d, &none),
            BTreeMap::from([("oxv100".to_string(), BTreeSet::new())]),
            "every overlay device listed, so one that forwarded is cleared"
        );
        d.forwards = vec![
            otherix_proto::agent::Forward {
                network: "web".into(),
                mac: "02:00:00:00:00:0d".parse().unwrap(),
                vtep: "10.213.0.2".parse().unwrap(),
            },
            // A group MAC, and a network that is not an overlay here: skipped.
            otherix_proto::agent::Forward {
                network: "web".into(),
                mac: "03:00:00:00:00:0e".parse().unwrap(),
                vtep: "10.213.0.2".parse().unwrap(),
            },
            otherix_proto::agent::Forward {
                network: "lab".into(),
                mac: "02:00:00:00:00:0f".parse().unwrap(),
                vtep: "10.213.0.2".parse().unwrap(),
            },
        ];
        // VM1 is being handed over: forwarded once its handover is done here.
        d.guests[0].migrate_to = Some(otherix_proto::agent::MigrateTo {
            node: "n2".into(),
            netns: "n2".into(),
            bridge: "oxb100".into(),
            qemu: None,
        });
        assert_eq!(
            forwards(&d, &none)["oxv100"],
            BTreeSet::from([[2, 0, 0, 0, 0, 0x0d]])
        );
        let done = BTreeSet::from([VM1.to_string(), VM2.to_string()]);
        assert_eq!(
            forwards(&d, &done)["oxv100"],
            BTreeSet::from([[2, 0, 0, 0, 0, 0x0a], [2, 0, 0, 0, 0, 0x0d]]),
            "VM2 is asked for no handover"
        );
    }

    #[test]
    fn a_guest_is_forwarded_through_its_overlays_device_and_only_there() {
        let mut d = desired();
        assert_eq!(
            forward_of(&d, VM1),
            Some(("oxv100".to_string(), [2, 0, 0, 0, 0, 0x0a]))
        );
        assert_eq!(
            forward_of(&d, VM2),
            None,
            "a bridge network has no overlay device"
        );
        assert_eq!(forward_of(&d, "no-such-vm"), None);
        d.guests[0].mac = "03:00:00:00:00:0a".parse().unwrap();
        assert_eq!(forward_of(&d, VM1), None, "a group MAC is never forwarded");
    }

    #[test]
    fn overlay_gets_lease_mac_address_mtu_and_local_underlay() {
        let p = plan(&desired(), &underlay(), "oxg");
        let o = p.overlays[0].spec.as_ref().unwrap();
        assert_eq!(
            (o.bridge.as_str(), o.vxlan.as_str(), o.vni),
            ("oxb100", "oxv100", 100)
        );
        assert_eq!(o.mac, Some([2, 0, 0, 0, 1, 1]));
        assert_eq!(o.address, Some(IfAddr::new(Ipv4Addr::new(10, 100, 0, 4), 24)));
        assert_eq!(o.mtu, 1400);
        assert_eq!(
            (o.local_vtep, o.underlay.as_str()),
            (Ipv4Addr::new(10, 213, 0, 1), "eth0")
        );
        assert_eq!(
            o.fdb,
            vec![FdbEntry::new([2, 0, 0, 0, 0, 0x0b], Ipv4Addr::new(10, 213, 0, 2))]
        );
        assert_eq!(
            o.neighbors,
            vec![NeighborEntry::new(
                Ipv4Addr::new(10, 100, 0, 3),
                [2, 0, 0, 0, 0, 0x0b]
            )]
        );
    }

    #[test]
    fn guests_plug_into_their_networks_bridge_with_derived_names() {
        let p = plan(&desired(), &underlay(), "oxg");
        let g1 = p.guests[0].spec.as_ref().unwrap();
        assert_eq!(g1.bridge, "oxb100");
        assert_eq!(g1.host_veth, "oxhaaaaaaaaaa");
        assert_eq!(g1.netns, "oxgaaaaaaaaaaaa");
        assert_eq!((g1.ip, g1.prefix), (Ipv4Addr::new(10, 100, 0, 2), 24));
        assert_eq!(g1.gateway, Ipv4Addr::new(10, 100, 0, 1));
        assert_eq!(g1.mtu, 1400);
        assert_eq!(
            g1.command,
            Some(vec!["sh".into(), "-c".into(), "otherix guest http".into()])
        );
        let g2 = p.guests[1].spec.as_ref().unwrap();
        assert_eq!(g2.bridge, "oxlfedcba98");
        assert_eq!(g2.command, None);
    }

    #[test]
    fn bridge_network_carries_its_guests_as_permanent_neighbors() {
        let p = plan(&desired(), &underlay(), "oxg");
        let b = p.bridges[0].spec.as_ref().unwrap();
        assert_eq!(b.bridge, "oxlfedcba98");
        assert_eq!(b.address, Some(IfAddr::new(Ipv4Addr::new(10, 101, 0, 1), 24)));
        assert_eq!(
            b.mac,
            Some([0x0a, 0xfe, 0xdc, 0xba, 0x98, 0x76]),
            "the network's, on every node"
        );
        assert_eq!(
            b.neighbors,
            vec![NeighborEntry::new(
                Ipv4Addr::new(10, 101, 0, 2),
                [2, 0, 0, 0, 0, 0x0c]
            )]
        );
    }

    #[test]
    fn keep_list_names_every_desired_link() {
        let p = plan(&desired(), &underlay(), "oxg");
        let keep: Vec<&str> = p.keep_links.iter().map(String::as_str).collect();
        assert_eq!(
            keep,
            [
                "oxb100",
                "oxhaaaaaaaaaa",
                "oxhbbbbbbbbbb",
                "oxlfedcba98",
                "oxv100"
            ]
        );
    }

    #[test]
    fn unknown_underlay_fails_overlays_only_and_keeps_their_links() {
        let vtep = Ipv4Addr::new(10, 9, 9, 9);
        let p = plan(&desired(), &Err(UnderlayError::NotFound(vtep)), "oxg");
        let err = p.overlays[0].spec.as_ref().unwrap_err();
        assert!(
            matches!(err, PlanError::NoUnderlay(UnderlayError::NotFound(ip)) if *ip == vtep),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "no underlay for VXLAN: no interface in the agent's namespace holds the VTEP address 10.9.9.9"
        );
        assert!(p.bridges[0].spec.is_ok());
        assert!(p.keep_links.contains("oxb100") && p.keep_links.contains("oxv100"));
        // The overlay guest is still planned: its bridge may already exist.
        assert!(p.guests[0].spec.is_ok());
    }

    #[test]
    fn a_malformed_guest_fails_alone() {
        let mut d = desired();
        // A multicast MAC: the kernel would refuse it.
        d.guests[0].mac = "01:00:5e:00:00:01".parse().unwrap();
        let p = plan(&d, &underlay(), "oxg");
        let err = p.guests[0].spec.as_ref().unwrap_err();
        assert!(matches!(err, PlanError::InvalidGuest(_)), "{err}");
        assert!(err.to_string().contains("unicast"), "{err}");
        assert!(p.guests[1].spec.is_ok());
        assert!(
            p.keep_links.contains("oxhaaaaaaaaaa"),
            "its veth must not be deleted meanwhile"
        );
    }

    #[test]
    fn guest_on_a_network_this_node_lacks_fails_with_the_network_name() {
        let mut d = desired();
        d.guests[1].network_id = "nope".into();
        d.guests[1].network = "elsewhere".into();
        let p = plan(&d, &underlay(), "oxg");
        let err = p.guests[1].spec.as_ref().unwrap_err();
        assert!(
            matches!(err, PlanError::NetworkNotRealized(n) if n == "elsewhere"),
            "{err}"
        );
        assert_eq!(err.to_string(), "network elsewhere is not realized on this node");
    }

    #[test]
    fn colliding_short_names_fail_the_second_guest() {
        let mut d = desired();
        d.guests[1].vm_id = format!("{}ffff", &VM1[..12]);
        d.guests[1].network_id = d.guests[0].network_id.clone();
        d.guests[1].address = "10.100.0.5/24".parse().unwrap();
        d.guests[1].gateway = "10.100.0.1".parse().unwrap();
        let p = plan(&d, &underlay(), "oxg");
        assert!(p.guests[0].spec.is_ok());
        let err = p.guests[1].spec.as_ref().unwrap_err();
        assert!(
            matches!(err, PlanError::NameTaken { other, .. } if other == VM1),
            "{err}"
        );
    }

    #[test]
    fn host_rules_take_every_remote_vtep_and_every_guest_facing_bridge_with_our_address() {
        let mut d = desired();
        d.overlays[0].fdb.push(ApiFdb {
            mac: "02:00:00:00:00:0d".parse().unwrap(),
            vtep: "10.213.0.1".parse().unwrap(),
        });
        let p = plan(&d, &underlay(), "oxg");
        let r = &p.host_rules;
        assert_eq!(r.vxlan_port, 4789);
        assert_eq!(
            r.vteps.iter().copied().collect::<Vec<_>>(),
            [Ipv4Addr::new(10, 213, 0, 2)],
            "never our own VTEP"
        );
        assert_eq!(
            r.bridges.iter().collect::<Vec<_>>(),
            [
                (&"oxb100".to_owned(), &Some(Ipv4Addr::new(10, 100, 0, 4))),
                (&"oxlfedcba98".to_owned(), &Some(Ipv4Addr::new(10, 101, 0, 1)))
            ]
        );
        assert!(!p.is_empty());
        let empty = plan(&DesiredState::default(), &underlay(), "oxg");
        assert!(empty.is_empty() && empty.host_rules.vteps.is_empty() && empty.host_rules.bridges.is_empty());
    }

    #[test]
    fn missing_mtu_falls_back_and_blank_exec_means_no_workload() {
        let mut d = desired();
        d.mtu = 0;
        d.guests[0].exec = Some("  ".into());
        let p = plan(&d, &underlay(), "oxg");
        assert_eq!(p.overlays[0].spec.as_ref().unwrap().mtu, DEFAULT_MTU);
        assert_eq!(p.guests[0].spec.as_ref().unwrap().command, None);
    }
}
