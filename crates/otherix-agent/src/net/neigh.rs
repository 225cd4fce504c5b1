//! Permanent neighbor (ARP) entries on a bridge: which MAC holds an overlay IP.
//!
//! The control plane is the source of truth for IP → MAC. We program those bindings
//! as `NUD_PERMANENT` entries (`ip neigh replace IP lladdr MAC dev BR nud permanent`),
//! so this node never ARPs for a guest and the gateway's anti-SSRF check
//! ([`Netlink::neighbor_mac`]) reads exactly what the control plane said.
//!
//! The kernel flushes a link's neighbor table, permanent entries included, when the
//! link goes down or changes MAC. Bridges therefore get a pinned MAC (see
//! `ensure_bridge`), and any other flush is repaired by the next reconcile.
//!
//! Only permanent entries are ours. Dynamic ones (learned from ARP) are the kernel's:
//! reconcile leaves them alone, and `neighbor_mac` ignores them, because a guest can
//! make the kernel learn any IP it answers ARP for.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};

use futures::{StreamExt, TryStreamExt};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_REQUEST};
use tracing::info;

use super::{errno, fmt_mac, names::mac_from, Change, NetError, Netlink};

/// `ip` is held by the NIC with MAC `mac`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NeighborEntry {
    pub ip: Ipv4Addr,
    pub mac: [u8; 6],
}

impl NeighborEntry {
    pub fn new(ip: Ipv4Addr, mac: [u8; 6]) -> Self {
        Self { ip, mac }
    }
}

/// Reads `(ip, mac, state)` out of an `AF_INET` neighbor message.
fn parse(msg: &NeighbourMessage) -> Option<(Ipv4Addr, Option<[u8; 6]>, NeighbourState)> {
    let ip = msg.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)) => Some(*ip),
        _ => None,
    })?;
    let mac = msg.attributes.iter().find_map(|a| match a {
        NeighbourAttribute::LinkLayerAddress(m) => mac_from(m),
        _ => None,
    });
    Some((ip, mac, msg.header.state))
}

impl Netlink {
    /// The permanent IPv4 neighbor entries on `link`.
    pub async fn neighbors(&self, link: &str) -> Result<Vec<NeighborEntry>, NetError> {
        let index = self.require_index(link).await?;
        let msgs: Vec<NeighbourMessage> = self
            .handle
            .neighbours()
            .get()
            .set_address_family(AddressFamily::Inet)
            .execute()
            .try_collect()
            .await
            .map_err(|e| self.err("dump neighbors", link, e))?;
        let mut out: Vec<NeighborEntry> = msgs
            .iter()
            .filter(|m| m.header.ifindex == index)
            .filter_map(parse)
            .filter(|(_, _, state)| *state == NeighbourState::Permanent)
            .filter_map(|(ip, mac, _)| Some(NeighborEntry { ip, mac: mac? }))
            .collect();
        out.sort();
        Ok(out)
    }

    /// Sets a permanent entry (`ip neigh replace ... nud permanent`), overriding any
    /// entry for that IP, learned or not.
    pub async fn set_neighbor(&self, link: &str, entry: NeighborEntry) -> Result<(), NetError> {
        let index = self.require_index(link).await?;
        self.handle
            .neighbours()
            .add(index, IpAddr::V4(entry.ip))
            .link_layer_address(&entry.mac)
            .state(NeighbourState::Permanent)
            .replace()
            .execute()
            .await
            .map_err(|e| self.err("set neighbor", link, e))
    }

    /// Removes the entry for `ip` on `link`. No error if absent.
    pub async fn remove_neighbor(&self, link: &str, ip: Ipv4Addr) -> Result<(), NetError> {
        let index = self.require_index(link).await?;
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.ifindex = index;
        msg.attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        match self.handle.neighbours().del(msg).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(nix::libc::ENOENT) => Ok(()),
            Err(e) => Err(self.err("remove neighbor", link, e)),
        }
    }

    /// Makes the permanent entries on `link` exactly `desired`. Two entries for one IP
    /// with different MACs is a caller error.
    pub async fn reconcile_neighbors(
        &self,
        link: &str,
        desired: &[NeighborEntry],
    ) -> Result<Vec<Change>, NetError> {
        let mut want: BTreeMap<Ipv4Addr, [u8; 6]> = BTreeMap::new();
        for e in desired {
            if let Some(other) = want.insert(e.ip, e.mac) {
                if other != e.mac {
                    return Err(NetError::InvalidSpec(format!(
                        "neighbor {} on {link} given two MACs, {} and {}",
                        e.ip,
                        fmt_mac(&other),
                        fmt_mac(&e.mac)
                    )));
                }
            }
        }
        let have: BTreeMap<Ipv4Addr, [u8; 6]> = self
            .neighbors(link)
            .await?
            .into_iter()
            .map(|e| (e.ip, e.mac))
            .collect();
        let mut changes = Vec::new();
        for (&ip, &mac) in &want {
            if have.get(&ip) != Some(&mac) {
                let entry = NeighborEntry { ip, mac };
                self.set_neighbor(link, entry).await?;
                info!(link = %self.at(link), %ip, mac = %fmt_mac(&mac), "neighbor set");
                changes.push(Change::NeighborSet {
                    link: self.at(link),
                    entry,
                });
            }
        }
        for (&ip, &mac) in &have {
            if !want.contains_key(&ip) {
                self.remove_neighbor(link, ip).await?;
                info!(link = %self.at(link), %ip, mac = %fmt_mac(&mac), "neighbor removed");
                changes.push(Change::NeighborRemoved {
                    link: self.at(link),
                    entry: NeighborEntry { ip, mac },
                });
            }
        }
        Ok(changes)
    }

    /// The MAC the kernel's neighbor table binds to `ip` on `link`, counting only
    /// permanent (control-plane-programmed) entries. `None` if there is no such entry.
    ///
    /// This is the gateway's anti-SSRF check: a credential names `(ip, mac)`, and the
    /// gateway dials only if this returns that `mac`. It is one `RTM_GETNEIGH`
    /// request for one entry (not a table dump), cheap enough per connection.
    pub async fn neighbor_mac(&self, link: &str, ip: Ipv4Addr) -> Result<Option<[u8; 6]>, NetError> {
        let index = self.require_index(link).await?;
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Inet;
        msg.header.ifindex = index;
        msg.attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::Inet(ip)));
        let mut req = NetlinkMessage::from(RouteNetlinkMessage::GetNeighbour(msg));
        req.header.flags = NLM_F_REQUEST;
        let mut handle = self.handle.clone();
        let mut responses = handle
            .request(req)
            .map_err(|e| self.err("get neighbor", link, e))?;
        let mut found = None;
        while let Some(resp) = responses.next().await {
            match resp.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewNeighbour(n))
                    if n.header.ifindex == index =>
                {
                    if let Some((got, mac, NeighbourState::Permanent)) = parse(&n) {
                        if got == ip {
                            found = mac;
                        }
                    }
                }
                NetlinkPayload::Error(e) if e.code.is_some() => {
                    let e = rtnetlink::Error::NetlinkError(e);
                    if errno(&e) == Some(nix::libc::ENOENT) {
                        return Ok(None);
                    }
                    return Err(self.err("get neighbor", link, e));
                }
                _ => {}
            }
        }
        Ok(found)
    }
}
