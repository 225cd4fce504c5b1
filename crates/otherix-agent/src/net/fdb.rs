//! Static FDB entries on a VXLAN device: which remote VTEP owns a MAC.
//!
//! An entry is what `bridge fdb append MAC dev VX dst IP self permanent` makes: an
//! `RTM_NEWNEIGH` in the `AF_BRIDGE` family, flagged `NTF_SELF` (the VXLAN device's
//! own table, not the bridge's) and `NUD_PERMANENT`. rtnetlink has no FDB helper and
//! fixes its neighbor flags to `EXCL`/`REPLACE`, so we build the message ourselves
//! and send it with `NLM_F_CREATE | NLM_F_APPEND`.
//!
//! Why append: a MAC may have several destinations. The all-zeros MAC
//! ([`FLOOD_MAC`]) is the VXLAN device's default destination list, where broadcast
//! and unknown unicast (ARP requests above all) go; one entry per remote VTEP gives
//! head-end replication without multicast in the underlay.
//!
//! Only that list, and multicast MACs, take several destinations: the kernel
//! ignores `NLM_F_APPEND` for a unicast MAC that already has one, without an error.
//! So a guest's MAC that moves to another VTEP (a live migration) is repointed with
//! `NLM_F_REPLACE`, in one step; appending the new destination and deleting the old
//! one, as for the flood list, would leave the MAC with none until the next round.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use futures::TryStreamExt;
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_APPEND, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST};
use tracing::info;

use super::{errno, names::mac_from, Change, NetError, Netlink};

/// The MAC of a VXLAN device's default (flood) destinations.
pub const FLOOD_MAC: [u8; 6] = [0; 6];

/// `mac` lives behind the VXLAN tunnel endpoint `vtep`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FdbEntry {
    pub mac: [u8; 6],
    pub vtep: Ipv4Addr,
}

impl FdbEntry {
    pub fn new(mac: [u8; 6], vtep: Ipv4Addr) -> Self {
        Self { mac, vtep }
    }

    /// Whether the kernel keeps one destination only for this MAC: a unicast
    /// MAC, not the flood list (all zeros) or a multicast group.
    fn single_destination(&self) -> bool {
        self.mac != FLOOD_MAC && self.mac[0] & 1 == 0
    }

    fn message(&self, index: u32) -> NeighbourMessage {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Bridge;
        msg.header.ifindex = index;
        msg.header.state = NeighbourState::Permanent;
        msg.header.flags = NeighbourFlags::Own;
        msg.attributes
            .push(NeighbourAttribute::LinkLayerAddress(self.mac.to_vec()));
        msg.attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(self.vtep)));
        msg
    }
}

impl Netlink {
    /// The FDB entries of the VXLAN device `vxlan` (its own, `NTF_SELF`, table).
    pub async fn fdb(&self, vxlan: &str) -> Result<Vec<FdbEntry>, NetError> {
        let index = self.require_index(vxlan).await?;
        let msgs: Vec<NeighbourMessage> = self
            .handle
            .neighbours()
            .get()
            .set_address_family(AddressFamily::Bridge)
            .execute()
            .try_collect()
            .await
            .map_err(|e| self.err("dump fdb", vxlan, e))?;
        let mut out = Vec::new();
        for msg in msgs {
            if msg.header.ifindex != index || !msg.header.flags.contains(NeighbourFlags::Own) {
                continue;
            }
            let mac = msg.attributes.iter().find_map(|a| match a {
                NeighbourAttribute::LinkLayerAddress(m) => mac_from(m),
                _ => None,
            });
            // In the AF_BRIDGE family the destination is not parsed as an IP; it is
            // 4 raw bytes for an IPv4 VTEP.
            let vtep = msg.attributes.iter().find_map(|a| match a {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => Some(*ip),
                NeighbourAttribute::Destination(NeighbourAddress::Other(b)) => {
                    <[u8; 4]>::try_from(b.as_slice()).ok().map(Ipv4Addr::from)
                }
                _ => None,
            });
            if let (Some(mac), Some(vtep)) = (mac, vtep) {
                out.push(FdbEntry { mac, vtep });
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Adds `entry` (`bridge fdb append ... self permanent`). No error if present.
    pub async fn add_fdb(&self, vxlan: &str, entry: FdbEntry) -> Result<(), NetError> {
        let index = self.require_index(vxlan).await?;
        let msg = RouteNetlinkMessage::NewNeighbour(entry.message(index));
        match self
            .ack_request(msg, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_APPEND)
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(nix::libc::EEXIST) => Ok(()),
            Err(e) => Err(self.err("add fdb entry", vxlan, e)),
        }
    }

    /// Points a unicast MAC at `entry.vtep` in place of whatever destination it
    /// had (`bridge fdb replace ... self permanent`).
    pub async fn replace_fdb(&self, vxlan: &str, entry: FdbEntry) -> Result<(), NetError> {
        let index = self.require_index(vxlan).await?;
        let msg = RouteNetlinkMessage::NewNeighbour(entry.message(index));
        self.ack_request(msg, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE)
            .await
            .map_err(|e| self.err("replace fdb entry", vxlan, e))
    }

    /// Removes exactly `entry` (that MAC towards that VTEP). No error if absent.
    pub async fn remove_fdb(&self, vxlan: &str, entry: FdbEntry) -> Result<(), NetError> {
        let index = self.require_index(vxlan).await?;
        let msg = RouteNetlinkMessage::DelNeighbour(entry.message(index));
        match self.ack_request(msg, NLM_F_REQUEST | NLM_F_ACK).await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(nix::libc::ENOENT) => Ok(()),
            Err(e) => Err(self.err("remove fdb entry", vxlan, e)),
        }
    }

    /// Repoints, before anything else, each unicast MAC of `desired` the
    /// device sends elsewhere: a guest that moved to another node (a live
    /// migration), whose frames go to the node it left until this is done.
    /// Nothing else is added or removed; no device, nothing to do.
    pub async fn repoint_fdb(&self, vxlan: &str, desired: &[FdbEntry]) -> Result<Vec<Change>, NetError> {
        if self.link(vxlan).await?.is_none() {
            return Ok(Vec::new());
        }
        let current = self.fdb(vxlan).await?;
        let mut changes = Vec::new();
        for entry in desired.iter().filter(|e| e.single_destination()) {
            let moved = current.iter().any(|c| c.mac == entry.mac && c.vtep != entry.vtep);
            if moved {
                self.replace_fdb(vxlan, *entry).await?;
                info!(link = %self.at(vxlan), mac = %super::fmt_mac(&entry.mac), vtep = %entry.vtep, "fdb entry moved");
                changes.push(Change::FdbAdded {
                    link: self.at(vxlan),
                    entry: *entry,
                });
            }
        }
        Ok(changes)
    }

    /// Makes the device's FDB exactly `desired`.
    ///
    /// Missing entries are added before extra ones are removed, so the flood list
    /// never runs empty while it changes; a unicast MAC that moves to another VTEP (a
    /// migration) is repointed in place, so it never has no destination either.
    pub async fn reconcile_fdb(&self, vxlan: &str, desired: &[FdbEntry]) -> Result<Vec<Change>, NetError> {
        let desired: BTreeSet<FdbEntry> = desired.iter().copied().collect();
        let current: BTreeSet<FdbEntry> = self.fdb(vxlan).await?.into_iter().collect();
        let has_mac = |set: &BTreeSet<FdbEntry>, e: &FdbEntry| set.iter().any(|x| x.mac == e.mac);
        let mut changes = Vec::new();
        for entry in desired.difference(&current) {
            if entry.single_destination() && has_mac(&current, entry) {
                self.replace_fdb(vxlan, *entry).await?;
                info!(link = %self.at(vxlan), mac = %super::fmt_mac(&entry.mac), vtep = %entry.vtep, "fdb entry moved");
            } else {
                self.add_fdb(vxlan, *entry).await?;
                info!(link = %self.at(vxlan), mac = %super::fmt_mac(&entry.mac), vtep = %entry.vtep, "fdb entry added");
            }
            changes.push(Change::FdbAdded {
                link: self.at(vxlan),
                entry: *entry,
            });
        }
        for entry in current.difference(&desired) {
            // Replaced above: its old destination is gone with it.
            if entry.single_destination() && has_mac(&desired, entry) {
                changes.push(Change::FdbRemoved {
                    link: self.at(vxlan),
                    entry: *entry,
                });
                continue;
            }
            self.remove_fdb(vxlan, *entry).await?;
            info!(link = %self.at(vxlan), mac = %super::fmt_mac(&entry.mac), vtep = %entry.vtep, "fdb entry removed");
            changes.push(Change::FdbRemoved {
                link: self.at(vxlan),
                entry: *entry,
            });
        }
        Ok(changes)
    }
}
