//! Declarative entry points: converge a node's overlay or bridge network to a spec.
//!
//! The agent's sync loop calls these with the desired state from the control plane
//! on every heartbeat. They are level-triggered: each run reads the kernel, does what
//! differs, and returns the changes, so a run after a crash, a manual `bridge fdb
//! del`, or a VNI change all converge the same way.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use tracing::{info, info_span, Instrument};

use super::{
    fmt_mac, validate_ifname, Change, FdbEntry, IfAddr, NeighborEntry, NetError, Netlink, VxlanSpec,
    FLOOD_MAC,
};

/// The IANA VXLAN port; every overlay uses it.
pub const VXLAN_PORT: u16 = 4789;

/// This node's view of one overlay network (DESIGN.md §3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverlaySpec {
    /// The Linux bridge that guests' host veths and the VXLAN device plug into.
    pub bridge: String,
    /// The VXLAN device.
    pub vxlan: String,
    pub vni: u32,
    /// This node's VTEP address on the underlay.
    pub local_vtep: Ipv4Addr,
    /// The underlay device that carries the VXLAN UDP packets.
    pub underlay: String,
    /// MTU of the bridge and the VXLAN device: the underlay MTU minus 50 (VXLAN
    /// overhead). Guests on this overlay must use the same MTU.
    pub mtu: u32,
    /// This node's own address on the overlay (its member lease), put on the bridge.
    /// Any other address on the bridge is removed.
    pub address: Option<IfAddr>,
    /// This node's own MAC on the overlay (its member lease), set on the bridge.
    pub mac: Option<[u8; 6]>,
    /// Where every remote MAC lives. Entries pointing at `local_vtep` are skipped:
    /// local guests are reached through the bridge, not the tunnel. Broadcast (ARP)
    /// is replicated to every distinct remote VTEP named here.
    pub fdb: Vec<FdbEntry>,
    /// IP → MAC for every guest and member on the overlay, as permanent entries on
    /// the bridge.
    pub neighbors: Vec<NeighborEntry>,
}

/// A host-local bridge network (DESIGN.md §3, kind `bridge`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BridgeSpec {
    pub bridge: String,
    pub mtu: u32,
    /// This node's address on the network; any other address is removed.
    pub address: Option<IfAddr>,
    pub mac: Option<[u8; 6]>,
    /// IP → MAC of the guests, as permanent entries (for the gateway's check).
    pub neighbors: Vec<NeighborEntry>,
}

fn validate_mtu(mtu: u32, what: &str) -> Result<(), NetError> {
    if (68..=65535).contains(&mtu) {
        Ok(())
    } else {
        Err(NetError::InvalidSpec(format!(
            "MTU {mtu} of {what} is outside 68..=65535"
        )))
    }
}

fn validate_addr(addr: Option<IfAddr>, what: &str) -> Result<(), NetError> {
    match addr {
        Some(a) if a.prefix > 32 => Err(NetError::InvalidSpec(format!(
            "prefix of {a} on {what} is over 32"
        ))),
        _ => Ok(()),
    }
}

impl OverlaySpec {
    /// Checks everything that can be checked without the kernel.
    pub fn validate(&self) -> Result<(), NetError> {
        validate_ifname(&self.bridge)?;
        validate_ifname(&self.vxlan)?;
        validate_ifname(&self.underlay)?;
        if self.bridge == self.vxlan {
            return Err(NetError::InvalidSpec(format!(
                "bridge and vxlan device are both named {}",
                self.bridge
            )));
        }
        if self.vni == 0 || self.vni > 0x00ff_ffff {
            return Err(NetError::InvalidSpec(format!(
                "VNI {} is outside 1..=16777215",
                self.vni
            )));
        }
        validate_mtu(self.mtu, &self.bridge)?;
        validate_addr(self.address, &self.bridge)?;
        let mut owner: BTreeMap<[u8; 6], Ipv4Addr> = BTreeMap::new();
        for e in &self.fdb {
            if e.mac == FLOOD_MAC {
                return Err(NetError::InvalidSpec(
                    "the all-zeros MAC is derived from the FDB's VTEPs, not given".into(),
                ));
            }
            if let Some(other) = owner.insert(e.mac, e.vtep) {
                if other != e.vtep {
                    return Err(NetError::InvalidSpec(format!(
                        "MAC {} given two VTEPs, {other} and {}",
                        fmt_mac(&e.mac),
                        e.vtep
                    )));
                }
            }
        }
        Ok(())
    }

    /// The exact FDB the VXLAN device should hold: remote unicast entries plus one
    /// flood entry per remote VTEP, sorted.
    pub fn desired_fdb(&self) -> Vec<FdbEntry> {
        let remote: BTreeSet<FdbEntry> = self
            .fdb
            .iter()
            .filter(|e| e.vtep != self.local_vtep)
            .copied()
            .collect();
        let vteps: BTreeSet<Ipv4Addr> = remote.iter().map(|e| e.vtep).collect();
        let all: BTreeSet<FdbEntry> = remote
            .into_iter()
            .chain(vteps.into_iter().map(|vtep| FdbEntry { mac: FLOOD_MAC, vtep }))
            .collect();
        all.into_iter().collect()
    }
}

impl BridgeSpec {
    pub fn validate(&self) -> Result<(), NetError> {
        validate_ifname(&self.bridge)?;
        validate_mtu(self.mtu, &self.bridge)?;
        validate_addr(self.address, &self.bridge)
    }
}

impl Netlink {
    /// Converges one overlay: bridge (MTU, MAC, up), the node's address on it, the
    /// VXLAN device (recreated if its identity changed), the exact FDB, the exact set
    /// of permanent neighbors. Returns what changed; empty when already converged.
    pub async fn reconcile_overlay(&self, spec: &OverlaySpec) -> Result<Vec<Change>, NetError> {
        spec.validate()?;
        let span = info_span!("reconcile_overlay", bridge = %spec.bridge, vni = spec.vni);
        async {
            let mut changes = self.ensure_bridge(&spec.bridge, spec.mtu, spec.mac).await?;
            changes.extend(self.ensure_address(&spec.bridge, spec.address, true).await?);
            let vxlan = VxlanSpec {
                name: spec.vxlan.clone(),
                vni: spec.vni,
                local: spec.local_vtep,
                underlay: spec.underlay.clone(),
                mtu: spec.mtu,
                bridge: spec.bridge.clone(),
            };
            changes.extend(self.ensure_vxlan(&vxlan).await?);
            changes.extend(self.reconcile_fdb(&spec.vxlan, &spec.desired_fdb()).await?);
            changes.extend(self.reconcile_neighbors(&spec.bridge, &spec.neighbors).await?);
            if !changes.is_empty() {
                info!(changes = changes.len(), "overlay reconciled");
            }
            Ok(changes)
        }
        .instrument(span)
        .await
    }

    /// Converges one host-local bridge network: bridge, address, permanent neighbors.
    pub async fn reconcile_bridge_network(&self, spec: &BridgeSpec) -> Result<Vec<Change>, NetError> {
        spec.validate()?;
        let span = info_span!("reconcile_bridge_network", bridge = %spec.bridge);
        async {
            let mut changes = self.ensure_bridge(&spec.bridge, spec.mtu, spec.mac).await?;
            changes.extend(self.ensure_address(&spec.bridge, spec.address, true).await?);
            changes.extend(self.reconcile_neighbors(&spec.bridge, &spec.neighbors).await?);
            Ok(changes)
        }
        .instrument(span)
        .await
    }

    /// Deletes every link whose name starts with `prefix` and is not in `keep`:
    /// bridges and VXLAN devices of networks this node no longer belongs to.
    ///
    /// Any kind of link matches, so give each kind of link its own prefix. An empty
    /// prefix is refused: it would match every link, `lo` included.
    pub async fn remove_stale(&self, prefix: &str, keep: &[&str]) -> Result<Vec<Change>, NetError> {
        if prefix.is_empty() {
            return Err(NetError::InvalidSpec(
                "remove_stale needs a non-empty prefix: an empty one matches every link".into(),
            ));
        }
        let mut changes = Vec::new();
        for link in self.links_with_prefix(prefix).await? {
            if keep.contains(&link.name.as_str()) {
                continue;
            }
            if self.delete_link(&link.name).await? {
                changes.push(Change::LinkDeleted {
                    link: self.at(&link.name),
                });
            }
        }
        Ok(changes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> OverlaySpec {
        OverlaySpec {
            bridge: "br0".into(),
            vxlan: "vx0".into(),
            vni: 100,
            local_vtep: Ipv4Addr::new(10, 213, 0, 1),
            underlay: "fab0".into(),
            mtu: 1450,
            address: Some(IfAddr::new(Ipv4Addr::new(10, 214, 0, 1), 24)),
            mac: None,
            fdb: vec![
                FdbEntry::new([2, 0, 0, 0, 0, 1], Ipv4Addr::new(10, 213, 0, 1)),
                FdbEntry::new([2, 0, 0, 0, 0, 2], Ipv4Addr::new(10, 213, 0, 2)),
                FdbEntry::new([2, 0, 0, 0, 0, 3], Ipv4Addr::new(10, 213, 0, 2)),
                FdbEntry::new([2, 0, 0, 0, 0, 4], Ipv4Addr::new(10, 213, 0, 3)),
            ],
            neighbors: vec![],
        }
    }

    #[test]
    fn desired_fdb_skips_local_vtep_and_floods_to_each_remote_vtep_once() {
        let fdb = spec().desired_fdb();
        assert_eq!(
            fdb,
            vec![
                FdbEntry::new(FLOOD_MAC, Ipv4Addr::new(10, 213, 0, 2)),
                FdbEntry::new(FLOOD_MAC, Ipv4Addr::new(10, 213, 0, 3)),
                FdbEntry::new([2, 0, 0, 0, 0, 2], Ipv4Addr::new(10, 213, 0, 2)),
                FdbEntry::new([2, 0, 0, 0, 0, 3], Ipv4Addr::new(10, 213, 0, 2)),
                FdbEntry::new([2, 0, 0, 0, 0, 4], Ipv4Addr::new(10, 213, 0, 3)),
            ]
        );
    }

    #[test]
    fn a_mac_with_two_vteps_is_refused() {
        let mut s = spec();
        s.fdb
            .push(FdbEntry::new([2, 0, 0, 0, 0, 2], Ipv4Addr::new(10, 213, 0, 9)));
        assert!(matches!(s.validate(), Err(NetError::InvalidSpec(_))));
    }

    #[test]
    fn long_interface_names_and_bad_vnis_are_refused_before_any_netlink() {
        let mut s = spec();
        s.vxlan = "a-very-long-vxlan-name".into();
        assert!(matches!(s.validate(), Err(NetError::InvalidName { .. })));
        let mut s = spec();
        s.vni = 1 << 24;
        assert!(matches!(s.validate(), Err(NetError::InvalidSpec(_))));
    }
}
