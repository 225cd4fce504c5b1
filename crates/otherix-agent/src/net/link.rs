//! Links: look-up, bridges, VXLAN devices, veth pairs, and "make this link look like
//! that" (MTU, MAC, controller, up, alias).

use std::net::Ipv4Addr;
use std::os::fd::RawFd;

use futures::TryStreamExt;
use rtnetlink::packet_route::link::{
    InfoBridgePort, InfoData, InfoKind, InfoPortData, InfoVeth, InfoVxlan, LinkAttribute, LinkFlags,
    LinkInfo, LinkMessage,
};
use rtnetlink::{LinkBridge, LinkBridgePort, LinkMessageBuilder, LinkUnspec, LinkVeth, LinkVxlan};
use tracing::{debug, info, warn};

use super::{errno, fmt_mac, names::mac_from, validate_ifname, Change, NetError, Netlink, Netns};
use crate::net::VXLAN_PORT;

/// What the kernel says about one link.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Link {
    pub index: u32,
    pub name: String,
    /// `bridge`, `vxlan`, `veth`, ... (`None` for kindless links such as `lo`).
    pub kind: Option<String>,
    /// Administratively up (`IFF_UP`).
    pub up: bool,
    pub mtu: Option<u32>,
    pub mac: Option<[u8; 6]>,
    /// Index of the bridge this link is enslaved to.
    pub controller: Option<u32>,
    /// `IFLA_LINK`: for a veth, the peer's index (in the peer's namespace).
    pub peer_index: Option<u32>,
    pub alias: Option<String>,
    pub vxlan: Option<VxlanInfo>,
    /// For a bridge port: whether the bridge learns source MACs on it.
    pub port_learning: Option<bool>,
}

/// VXLAN parameters of an existing device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VxlanInfo {
    pub vni: Option<u32>,
    pub local: Option<Ipv4Addr>,
    pub underlay: Option<u32>,
    pub port: Option<u16>,
    pub learning: Option<bool>,
}

impl Link {
    fn from_message(msg: LinkMessage) -> Self {
        let mut link = Link {
            index: msg.header.index,
            name: String::new(),
            kind: None,
            up: msg.header.flags.contains(LinkFlags::Up),
            mtu: None,
            mac: None,
            controller: None,
            peer_index: None,
            alias: None,
            vxlan: None,
            port_learning: None,
        };
        for attr in msg.attributes {
            match attr {
                LinkAttribute::IfName(n) => link.name = n,
                LinkAttribute::Mtu(m) => link.mtu = Some(m),
                LinkAttribute::Address(a) => link.mac = mac_from(&a),
                LinkAttribute::Controller(c) if c != 0 => link.controller = Some(c),
                LinkAttribute::Link(l) if l != 0 => link.peer_index = Some(l),
                LinkAttribute::IfAlias(a) if !a.is_empty() => link.alias = Some(a),
                LinkAttribute::LinkInfo(infos) => {
                    for info in infos {
                        match info {
                            LinkInfo::Kind(k) => link.kind = Some(k.to_string()),
                            LinkInfo::Data(InfoData::Vxlan(data)) => {
                                let mut vx = VxlanInfo::default();
                                for d in data {
                                    match d {
                                        InfoVxlan::Id(v) => vx.vni = Some(v),
                                        InfoVxlan::Local(ip) => vx.local = Some(ip),
                                        InfoVxlan::Link(i) => vx.underlay = Some(i),
                                        InfoVxlan::Port(p) => vx.port = Some(p),
                                        InfoVxlan::Learning(l) => vx.learning = Some(l),
                                        _ => {}
                                    }
                                }
                                link.vxlan = Some(vx);
                            }
                            LinkInfo::PortData(InfoPortData::BridgePort(port)) => {
                                for p in port {
                                    if let InfoBridgePort::Learning(l) = p {
                                        link.port_learning = Some(l);
                                    }
                                }
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        link
    }

    fn is_kind(&self, kind: &str) -> bool {
        self.kind.as_deref() == Some(kind)
    }
}

/// The mutable properties a link should have; `None` means "leave as is".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LinkWant {
    pub mtu: Option<u32>,
    pub mac: Option<[u8; 6]>,
    /// Name of the bridge the link must be enslaved to.
    pub controller: Option<String>,
    pub up: bool,
    pub alias: Option<String>,
}

/// A VXLAN device, in the shape `ip link add NAME type vxlan id VNI local IP dev
/// UNDERLAY dstport 4789 nolearning` followed by `master BRIDGE mtu MTU up`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VxlanSpec {
    pub name: String,
    pub vni: u32,
    pub local: Ipv4Addr,
    pub underlay: String,
    pub mtu: u32,
    pub bridge: String,
}

impl Netlink {
    /// The link called `name`, or `None` if there is none.
    pub async fn link(&self, name: &str) -> Result<Option<Link>, NetError> {
        validate_ifname(name)?;
        let mut stream = self.handle.link().get().match_name(name).execute();
        match stream.try_next().await {
            Ok(Some(msg)) => Ok(Some(Link::from_message(msg))),
            Ok(None) => Ok(None),
            Err(e) if errno(&e) == Some(nix::libc::ENODEV) => Ok(None),
            Err(e) => Err(self.err("get link", name, e)),
        }
    }

    /// The link with index `index`, or `None`.
    pub async fn link_by_index(&self, index: u32) -> Result<Option<Link>, NetError> {
        let mut stream = self.handle.link().get().match_index(index).execute();
        match stream.try_next().await {
            Ok(Some(msg)) => Ok(Some(Link::from_message(msg))),
            Ok(None) => Ok(None),
            Err(e) if errno(&e) == Some(nix::libc::ENODEV) => Ok(None),
            Err(e) => Err(self.err("get link", &format!("#{index}"), e)),
        }
    }

    /// All links whose names start with `prefix`.
    pub async fn links_with_prefix(&self, prefix: &str) -> Result<Vec<Link>, NetError> {
        let links: Vec<LinkMessage> = self
            .handle
            .link()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(|e| self.err("dump links", prefix, e))?;
        let mut out: Vec<Link> = links
            .into_iter()
            .map(Link::from_message)
            .filter(|l| l.name.starts_with(prefix))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Deletes the link called `name`. Returns `false` if there was none.
    pub async fn delete_link(&self, name: &str) -> Result<bool, NetError> {
        let Some(link) = self.link(name).await? else {
            return Ok(false);
        };
        match self.handle.link().del(link.index).execute().await {
            Ok(()) => {
                info!(link = %self.at(name), "deleted link");
                Ok(true)
            }
            // Raced with someone else deleting it: the desired state holds.
            Err(e) if errno(&e) == Some(nix::libc::ENODEV) => Ok(false),
            Err(e) => Err(self.err("delete link", name, e)),
        }
    }

    /// Index of a link that must exist (an underlay, a bridge).
    pub(crate) async fn require_index(&self, name: &str) -> Result<u32, NetError> {
        match self.link(name).await? {
            Some(l) => Ok(l.index),
            None => Err(NetError::LinkNotFound { link: self.at(name) }),
        }
    }

    /// Ensures a Linux bridge `name` exists, is up, and has this MTU (and MAC, if given).
    ///
    /// A non-bridge link of that name is an error, never deleted: it is not ours.
    pub async fn ensure_bridge(
        &self,
        name: &str,
        mtu: u32,
        mac: Option<[u8; 6]>,
    ) -> Result<Vec<Change>, NetError> {
        validate_ifname(name)?;
        let mut changes = Vec::new();
        match self.link(name).await? {
            Some(l) if !l.is_kind("bridge") => {
                return Err(NetError::WrongKind {
                    link: self.at(name),
                    expected: "bridge",
                    found: l.kind.unwrap_or_else(|| "kindless link".into()),
                })
            }
            Some(_) => {}
            None => {
                let mut b = LinkBridge::new(name).mtu(mtu);
                if let Some(mac) = mac {
                    b = b.address(mac.to_vec());
                }
                self.add_link(name, b.build()).await?;
                changes.push(Change::LinkCreated { link: self.at(name) });
                if mac.is_none() {
                    self.pin_mac(name).await?;
                }
            }
        }
        let want = LinkWant {
            mtu: Some(mtu),
            mac,
            up: true,
            ..LinkWant::default()
        };
        changes.extend(self.ensure_link(name, &want).await?);
        Ok(changes)
    }

    /// Re-sets a bridge's MAC to its current value, which marks it as chosen by the
    /// user (`NET_ADDR_SET`). Otherwise the bridge adopts the lowest port MAC each time
    /// ports come and go, and every MAC change makes the kernel flush the bridge's
    /// neighbor table, permanent entries included.
    async fn pin_mac(&self, name: &str) -> Result<(), NetError> {
        let link = self
            .link(name)
            .await?
            .ok_or_else(|| NetError::LinkNotFound { link: self.at(name) })?;
        if let Some(mac) = link.mac {
            self.change(
                name,
                LinkUnspec::new_with_index(link.index)
                    .address(mac.to_vec())
                    .build(),
            )
            .await?;
        }
        Ok(())
    }

    /// Ensures the VXLAN device exists with exactly these parameters, is enslaved to
    /// `spec.bridge` and is up. A device whose VNI, local address, underlay, port or
    /// learning flag differs is deleted and recreated: the kernel cannot change those
    /// on a live device. Its FDB goes with it; the overlay reconcile re-adds it.
    pub async fn ensure_vxlan(&self, spec: &VxlanSpec) -> Result<Vec<Change>, NetError> {
        validate_ifname(&spec.name)?;
        validate_ifname(&spec.underlay)?;
        validate_ifname(&spec.bridge)?;
        if spec.vni == 0 || spec.vni > 0x00ff_ffff {
            return Err(NetError::InvalidSpec(format!(
                "VNI {} of {} is outside 1..=16777215",
                spec.vni, spec.name
            )));
        }
        let underlay = self.require_index(&spec.underlay).await?;
        let bridge = self.require_index(&spec.bridge).await?;
        let mut changes = Vec::new();
        let mut recreated: Option<String> = None;
        if let Some(l) = self.link(&spec.name).await? {
            if !l.is_kind("vxlan") {
                return Err(NetError::WrongKind {
                    link: self.at(&spec.name),
                    expected: "vxlan",
                    found: l.kind.unwrap_or_else(|| "kindless link".into()),
                });
            }
            let vx = l.vxlan.unwrap_or_default();
            let mismatch = if vx.vni != Some(spec.vni) {
                Some(format!("vni {:?} != {}", vx.vni, spec.vni))
            } else if vx.local != Some(spec.local) {
                Some(format!("local {:?} != {}", vx.local, spec.local))
            } else if vx.underlay != Some(underlay) {
                Some(format!(
                    "underlay #{:?} != {} (#{underlay})",
                    vx.underlay, spec.underlay
                ))
            } else if vx.port != Some(VXLAN_PORT) {
                Some(format!("dstport {:?} != {VXLAN_PORT}", vx.port))
            } else if vx.learning != Some(false) {
                Some("learning is on".to_owned())
            } else {
                None
            };
            let Some(reason) = mismatch else {
                // Present and right: only the mutable properties may need work.
                return self.ensure_vxlan_mutable(spec).await;
            };
            info!(link = %self.at(&spec.name), %reason, "recreating vxlan device");
            self.handle
                .link()
                .del(l.index)
                .execute()
                .await
                .map_err(|e| self.err("delete vxlan", &spec.name, e))?;
            recreated = Some(reason);
        }
        let msg = LinkVxlan::new(&spec.name, spec.vni)
            .dev(underlay)
            .local(spec.local)
            .port(VXLAN_PORT)
            .learning(false)
            .mtu(spec.mtu)
            .controller(bridge)
            .up()
            .build();
        self.add_link(&spec.name, msg).await?;
        changes.push(match recreated {
            Some(reason) => Change::LinkRecreated {
                link: self.at(&spec.name),
                reason,
            },
            None => Change::LinkCreated {
                link: self.at(&spec.name),
            },
        });
        changes.extend(self.ensure_vxlan_mutable(spec).await?);
        Ok(changes)
    }

    async fn ensure_vxlan_mutable(&self, spec: &VxlanSpec) -> Result<Vec<Change>, NetError> {
        let want = LinkWant {
            mtu: Some(spec.mtu),
            controller: Some(spec.bridge.clone()),
            up: true,
            ..LinkWant::default()
        };
        let mut changes = self.ensure_link(&spec.name, &want).await?;
        changes.extend(self.ensure_port_learning_off(&spec.name).await?);
        Ok(changes)
    }

    /// Turns off source-MAC learning on the bridge port `name` and flushes what it
    /// learned. On the VXLAN port, where remote MACs would be learned, the control
    /// plane's static FDB is the only truth (no flood-and-learn): a learned entry would
    /// outlive a deleted or migrated guest and keep steering its frames to the tunnel.
    async fn ensure_port_learning_off(&self, name: &str) -> Result<Vec<Change>, NetError> {
        let Some(link) = self.link(name).await? else {
            return Err(NetError::LinkNotFound { link: self.at(name) });
        };
        if link.controller.is_none() || link.port_learning == Some(false) {
            return Ok(Vec::new());
        }
        let msg = LinkBridgePort::new(link.index)
            .learning(false)
            .fdb_flush()
            .build();
        self.handle
            .link()
            .set_port(msg)
            .execute()
            .await
            .map_err(|e| self.err("set bridge port learning off", name, e))?;
        info!(link = %self.at(name), "bridge port learning off");
        Ok(vec![Change::LinkUpdated {
            link: self.at(name),
            what: "port learning",
        }])
    }

    /// Makes an existing link match `want`, changing only what differs.
    pub async fn ensure_link(&self, name: &str, want: &LinkWant) -> Result<Vec<Change>, NetError> {
        let Some(link) = self.link(name).await? else {
            return Err(NetError::LinkNotFound { link: self.at(name) });
        };
        let mut changes = Vec::new();
        let at = self.at(name);

        if let Some(mac) = want.mac {
            if link.mac != Some(mac) {
                let msg = LinkUnspec::new_with_index(link.index)
                    .address(mac.to_vec())
                    .build();
                match self.handle.link().change(msg).execute().await {
                    Ok(()) => {}
                    // Some drivers refuse a MAC change while up: take it down briefly.
                    Err(e) if errno(&e) == Some(nix::libc::EBUSY) => {
                        debug!(link = %at, "MAC change needs the link down");
                        self.change(name, LinkUnspec::new_with_index(link.index).down().build())
                            .await?;
                        self.change(
                            name,
                            LinkUnspec::new_with_index(link.index)
                                .address(mac.to_vec())
                                .build(),
                        )
                        .await?;
                    }
                    Err(e) => return Err(self.err("set mac", name, e)),
                }
                info!(link = %at, mac = %fmt_mac(&mac), "set mac");
                changes.push(Change::LinkUpdated {
                    link: at.clone(),
                    what: "mac",
                });
            }
        }
        if let Some(mtu) = want.mtu {
            if link.mtu != Some(mtu) {
                self.change(name, LinkUnspec::new_with_index(link.index).mtu(mtu).build())
                    .await?;
                info!(link = %at, mtu, "set mtu");
                changes.push(Change::LinkUpdated {
                    link: at.clone(),
                    what: "mtu",
                });
            }
        }
        if let Some(controller) = &want.controller {
            let bridge = self.require_index(controller).await?;
            if link.controller != Some(bridge) {
                self.change(
                    name,
                    LinkUnspec::new_with_index(link.index).controller(bridge).build(),
                )
                .await?;
                info!(link = %at, bridge = %controller, "enslaved");
                changes.push(Change::LinkUpdated {
                    link: at.clone(),
                    what: "controller",
                });
            }
        }
        if let Some(alias) = &want.alias {
            if link.alias.as_deref() != Some(alias.as_str()) {
                self.change(
                    name,
                    LinkUnspec::new_with_index(link.index)
                        .alias(alias.clone())
                        .build(),
                )
                .await?;
                changes.push(Change::LinkUpdated {
                    link: at.clone(),
                    what: "alias",
                });
            }
        }
        // Re-read "up" after the MAC dance, which may have taken the link down.
        let is_up = if changes
            .iter()
            .any(|c| matches!(c, Change::LinkUpdated { what: "mac", .. }))
        {
            self.link(name).await?.is_some_and(|l| l.up)
        } else {
            link.up
        };
        if want.up && !is_up {
            self.change(name, LinkUnspec::new_with_index(link.index).up().build())
                .await?;
            info!(link = %at, "set up");
            changes.push(Change::LinkUpdated { link: at, what: "up" });
        }
        Ok(changes)
    }

    /// Creates a veth pair whose host end `host` lives in this handle's namespace and
    /// whose peer is created directly inside `peer_ns` as `peer_name`, with `peer_mac`.
    ///
    /// Creating the peer in place (`IFLA_NET_NS_FD` in the peer's message) avoids a
    /// temporary name in our namespace and a rename afterwards.
    pub async fn create_veth_into(
        &self,
        host: &str,
        peer_ns: &Netns,
        peer_name: &str,
        peer_mac: [u8; 6],
        mtu: u32,
    ) -> Result<(), NetError> {
        validate_ifname(host)?;
        validate_ifname(peer_name)?;
        let peer = LinkUnspec::new_with_name(peer_name)
            .setns_by_fd(peer_ns.as_raw_fd())
            .address(peer_mac.to_vec())
            .mtu(mtu)
            .build();
        let msg = LinkMessageBuilder::<LinkVeth>::new_with_info_kind(InfoKind::Veth)
            .name(host)
            .mtu(mtu)
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
            .build();
        self.add_link(host, msg).await
    }

    /// Moves the link `name` from this handle's namespace into `to`, enslaves it to the
    /// bridge with index `bridge` there, sets its MTU and brings it up, all in one
    /// request: the kernel's `do_setlink` moves the device first and applies the
    /// message's MTU, flags and `IFLA_MASTER` after, in the new namespace (where
    /// `bridge` is looked up). The link is down and out of any bridge only while that
    /// one request runs, instead of for three round trips; the move itself (RCU waits
    /// under the RTNL) is most of that, tens of milliseconds on a busy machine.
    /// `bridge` is an index in `to`, read by the caller.
    ///
    /// If the kernel moved the link but refused the rest, this returns `Ok` as long
    /// as the link did leave: the caller makes it look right in `to` afterwards.
    pub async fn move_link_onto(
        &self,
        name: &str,
        to: &Netns,
        bridge: u32,
        mtu: u32,
    ) -> Result<(), NetError> {
        let Some(link) = self.link(name).await? else {
            return Err(NetError::LinkNotFound { link: self.at(name) });
        };
        match self
            .change(name, move_onto_message(link.index, to.as_raw_fd(), bridge, mtu))
            .await
        {
            Ok(()) => {
                info!(link = %self.at(name), to = to.name(), bridge, "moved link onto its bridge");
                Ok(())
            }
            Err(e) if self.link(name).await?.is_none() => {
                warn!(link = %self.at(name), to = to.name(), error = %e, "moved link; its bridge, MTU or up refused in the same request");
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    async fn add_link(&self, name: &str, msg: LinkMessage) -> Result<(), NetError> {
        self.handle
            .link()
            .add(msg)
            .execute()
            .await
            .map_err(|e| self.err("create link", name, e))?;
        info!(link = %self.at(name), "created link");
        Ok(())
    }

    async fn change(&self, name: &str, msg: LinkMessage) -> Result<(), NetError> {
        self.handle
            .link()
            .change(msg)
            .execute()
            .await
            .map_err(|e| self.err("set link", name, e))
    }
}

/// The one `RTM_NEWLINK` of [`Netlink::move_link_onto`]: link `index` into the
/// namespace whose descriptor is `to`, onto the bridge with index `bridge` there,
/// with `mtu`, up.
fn move_onto_message(index: u32, to: RawFd, bridge: u32, mtu: u32) -> LinkMessage {
    LinkUnspec::new_with_index(index)
        .setns_by_fd(to)
        .controller(bridge)
        .mtu(mtu)
        .up()
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_move_onto_a_bridge_is_one_message_with_the_namespace_bridge_mtu_and_up() {
        let msg = move_onto_message(7, 42, 3, 1450);
        assert_eq!(msg.header.index, 7);
        assert!(msg.header.flags.contains(LinkFlags::Up));
        assert!(msg.header.change_mask.contains(LinkFlags::Up));
        let attrs = &msg.attributes;
        assert!(attrs.contains(&LinkAttribute::NetNsFd(42)));
        assert!(attrs.contains(&LinkAttribute::Controller(3)));
        assert!(attrs.contains(&LinkAttribute::Mtu(1450)));
    }
}
