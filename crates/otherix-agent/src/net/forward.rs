//! Frames for guests that just left this node, sent on towards where they are now.
//!
//! Between a guest's handover and the moment every member of its overlay has
//! repointed its FDB entry, frames for the guest still arrive here, on the
//! overlay's VXLAN device. A traffic-control rule on that device's ingress sends
//! each one whose destination is such a guest's MAC back out of the same device
//! (`u32 match ether dst MAC action mirred egress redirect`); the device's FDB
//! (the control plane's: the guest's MAC at its new host's VTEP) or, before that
//! entry is in, its flood list (which holds the new host, a member) takes it
//! there. Without it they are lost and wait for TCP's retransmission.
//!
//! The rules live in the device's `clsact` qdisc, which this module owns: its
//! filters are replaced whole when the set of MACs changes, it is deleted when the
//! set is empty, and it goes with the device when the overlay is left.
//!
//! Everything goes through the agent's own netlink socket (no `tc` process), so a
//! handover can put the rule in the instant the guest's veth has left:
//! [`Forwarder::arm`] makes the qdisc and builds the filter before the move (an
//! empty `clsact` changes nothing for a guest still here: a rule in place while
//! the guest is local would send its frames away from it), and [`Armed::fire`]
//! sends the one message that adds the filter right after it.
//!
//! A QEMU guest leaves at its switchover, which a task of its own follows
//! while the agent's rounds go on: it [`Forwarder::pin`]s the guest's MAC,
//! which every convergence keeps until the round that sees the migration
//! end unpins it. The forwarder's clones share one gate, so a pin never lands
//! in the middle of a convergence that would replace it.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use netlink_packet_route::tc::{
    TcAction, TcActionAttribute, TcActionGeneric, TcActionMirror, TcActionMirrorOption, TcActionOption,
    TcActionType, TcAttribute, TcFilterU32, TcFilterU32Option, TcHandle, TcMessage, TcMirror,
    TcMirrorActionType, TcOption, TcU32Key, TcU32Selector, TcU32SelectorFlags,
};
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST};

use super::{errno, fmt_mac, validate_ifname, NetError, Netlink};

/// The `pref` of every forwarding filter (they share one `u32` instance).
pub const FILTER_PREF: u16 = 1;

/// Why the forwarding rules of a device were not converged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ForwardError {
    /// The node's kernel lacks a part the rule needs (a module not built or not
    /// loadable): nothing the agent can fix, so it forwards nothing there.
    #[error(
        "the kernel of this node has no {what} ({source}): frames for guests that left are not forwarded"
    )]
    Unsupported {
        what: &'static str,
        #[source]
        source: rtnetlink::Error,
    },
    /// The kernel refused a request for another reason.
    #[error("the kernel refused to {op} on {device}: {source}")]
    Refused {
        op: &'static str,
        device: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// The device to forward on is not there (a caller asking for MACs on it).
    #[error("interface {0} not found")]
    NoDevice(String),
    #[error(transparent)]
    Net(#[from] NetError),
}

/// Installs and removes the forwarding rules through one namespace's netlink
/// socket (the node's). Clones share what they hold: the gate that orders
/// their changes to the kernel, and the pinned MACs.
#[derive(Debug, Clone)]
pub struct Forwarder {
    nl: Netlink,
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    /// Held across every change to the kernel's rules: a forward put in
    /// from another task (a QEMU guest's switchover) never lands in the
    /// middle of a [`Forwarder::converge`] that would replace it.
    gate: tokio::sync::Mutex<()>,
    book: Mutex<Book>,
}

#[derive(Debug, Default)]
struct Book {
    /// Per device, the MACs forwarded by [`Forwarder::pin`] until
    /// [`Forwarder::unpin`]: every convergence keeps them, whatever it was
    /// asked for.
    pinned: BTreeMap<String, BTreeSet<[u8; 6]>>,
    /// Devices whose rules may differ from what was last converged (a pin
    /// that failed may still have reached the kernel): converged again.
    unsure: BTreeSet<String>,
}

/// A forwarding rule made ready before a guest's veth moves: the device's
/// `clsact` qdisc is in place and the filter's message is built, so
/// [`Armed::fire`] is one netlink request.
#[derive(Debug, Clone)]
pub struct Armed {
    nl: Netlink,
    device: String,
    mac: [u8; 6],
    filter: Request,
}

impl Forwarder {
    pub fn new(nl: Netlink) -> Self {
        Self {
            nl,
            shared: Arc::default(),
        }
    }

    /// The MACs pinned on `device`.
    pub fn pinned(&self, device: &str) -> BTreeSet<[u8; 6]> {
        self.book().pinned.get(device).cloned().unwrap_or_default()
    }

    fn book(&self) -> std::sync::MutexGuard<'_, Book> {
        self.shared.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forwards `mac` on `device` now, and keeps it forwarded through every
    /// convergence until [`Forwarder::unpin`]: for a guest that left while
    /// its node's rounds went on (a QEMU guest's switchover, which a task of
    /// its own follows).
    pub async fn pin(&self, device: &str, mac: [u8; 6]) -> Result<(), ForwardError> {
        let _gate = self.shared.gate.lock().await;
        let fired = async { self.arm_ungated(device, mac).await?.fire().await }.await;
        let mut book = self.book();
        if fired.is_err() {
            book.unsure.insert(device.to_owned());
        }
        fired?;
        book.pinned.entry(device.to_owned()).or_default().insert(mac);
        Ok(())
    }

    /// Whether `device`'s rules may differ from what was last converged
    /// there: its next convergence must go to the kernel.
    pub fn unsure(&self, device: &str) -> bool {
        self.book().unsure.contains(device)
    }

    /// Lets the next convergence of `device` decide on `mac` again. Whether
    /// it was pinned.
    pub fn unpin(&self, device: &str, mac: [u8; 6]) -> bool {
        let mut book = self.book();
        let Some(macs) = book.pinned.get_mut(device) else {
            return false;
        };
        let was = macs.remove(&mac);
        if macs.is_empty() {
            book.pinned.remove(device);
        }
        was
    }

    /// Makes `device`'s ingress forward frames for exactly `macs` and the
    /// MACs pinned there back out of it; with neither, takes the rules (and
    /// the `clsact` qdisc) away. A device that does not exist has nothing to
    /// take away. Returns the MACs it forwards now.
    pub async fn converge(
        &self,
        device: &str,
        macs: &BTreeSet<[u8; 6]>,
    ) -> Result<BTreeSet<[u8; 6]>, ForwardError> {
        validate_ifname(device)?;
        let _gate = self.shared.gate.lock().await;
        let mut macs = macs.clone();
        macs.extend(self.pinned(device));
        self.converge_ungated(device, &macs).await?;
        self.book().unsure.remove(device);
        Ok(macs)
    }

    async fn converge_ungated(&self, device: &str, macs: &BTreeSet<[u8; 6]>) -> Result<(), ForwardError> {
        let Some(index) = self.index(device).await? else {
            return if macs.is_empty() {
                Ok(())
            } else {
                Err(ForwardError::NoDevice(self.nl.at(device)))
            };
        };
        if macs.is_empty() {
            return match self
                .send(device, "delete the clsact qdisc", del_qdisc(index))
                .await
            {
                Err(ForwardError::Refused { source, .. }) if absent(&source) => Ok(()),
                other => other,
            };
        }
        self.ensure_qdisc(device, index).await?;
        match self
            .send(device, "delete the ingress filters", del_filters(index))
            .await
        {
            Err(ForwardError::Refused { source, .. }) if absent(&source) => {}
            other => other?,
        }
        for mac in macs {
            self.send(device, "add a redirect filter", add_filter(index, mac))
                .await?;
        }
        Ok(())
    }

    /// Gets `device` ready to forward `mac` (its `clsact` qdisc, which alone
    /// changes nothing) without forwarding it yet.
    pub async fn arm(&self, device: &str, mac: [u8; 6]) -> Result<Armed, ForwardError> {
        let _gate = self.shared.gate.lock().await;
        self.arm_ungated(device, mac).await
    }

    async fn arm_ungated(&self, device: &str, mac: [u8; 6]) -> Result<Armed, ForwardError> {
        validate_ifname(device)?;
        let index = self
            .index(device)
            .await?
            .ok_or_else(|| ForwardError::NoDevice(self.nl.at(device)))?;
        self.ensure_qdisc(device, index).await?;
        Ok(Armed {
            nl: self.nl.clone(),
            device: device.to_owned(),
            mac,
            filter: add_filter(index, &mac),
        })
    }

    async fn ensure_qdisc(&self, device: &str, index: u32) -> Result<(), ForwardError> {
        self.send(device, "add a clsact qdisc", new_qdisc(index)).await
    }

    async fn index(&self, device: &str) -> Result<Option<u32>, ForwardError> {
        Ok(self.nl.link(device).await?.map(|l| l.index))
    }

    async fn send(&self, device: &str, op: &'static str, req: Request) -> Result<(), ForwardError> {
        send(&self.nl, device, op, req).await
    }
}

impl Armed {
    /// Adds the filter: from here on, frames for the MAC that reach the device
    /// go back out of it.
    pub async fn fire(&self) -> Result<(), ForwardError> {
        send(
            &self.nl,
            &self.device,
            "add a redirect filter",
            self.filter.clone(),
        )
        .await
    }

    pub fn device(&self) -> &str {
        &self.device
    }

    pub fn mac(&self) -> [u8; 6] {
        self.mac
    }
}

async fn send(nl: &Netlink, device: &str, op: &'static str, req: Request) -> Result<(), ForwardError> {
    nl.ack_request(req.message, req.flags)
        .await
        .map_err(|source| match (unsupported(&source), req.what) {
            (true, Some(what)) => ForwardError::Unsupported { what, source },
            _ => ForwardError::Refused {
                op,
                device: nl.at(device),
                source,
            },
        })
}

/// One request: the message, its flags, and the kernel part it needs (named in
/// the error when the kernel has no such thing).
#[derive(Debug, Clone)]
struct Request {
    message: RouteNetlinkMessage,
    flags: u16,
    what: Option<&'static str>,
}

const NEW_FLAGS: u16 = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL;

/// The head of a message about `index`'s `clsact` qdisc (handle ffff:).
fn clsact(index: u32) -> TcMessage {
    let mut msg = TcMessage::with_index(index as i32);
    msg.header.parent = TcHandle::CLSACT;
    msg.header.handle = TcHandle {
        major: 0xffff,
        minor: 0,
    };
    msg
}

/// `tc qdisc replace dev DEV clsact`: created when missing, left as it is
/// (filters included) when there.
fn new_qdisc(index: u32) -> Request {
    let mut msg = clsact(index);
    msg.attributes.push(TcAttribute::Kind("clsact".into()));
    Request {
        message: RouteNetlinkMessage::NewQueueDiscipline(msg),
        flags: NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        what: Some("clsact qdisc (sch_ingress)"),
    }
}

/// `tc qdisc del dev DEV clsact`: the qdisc and every filter in it.
fn del_qdisc(index: u32) -> Request {
    let msg = clsact(index);
    Request {
        message: RouteNetlinkMessage::DelQueueDiscipline(msg),
        flags: NLM_F_REQUEST | NLM_F_ACK,
        what: None,
    }
}

/// `tc filter del dev DEV ingress`: every filter on the ingress hook.
fn del_filters(index: u32) -> Request {
    let mut msg = TcMessage::with_index(index as i32);
    msg.header.parent = ingress();
    Request {
        message: RouteNetlinkMessage::DelTrafficFilter(msg),
        flags: NLM_F_REQUEST | NLM_F_ACK,
        what: None,
    }
}

/// `tc filter add dev DEV ingress protocol all pref 1 u32 match ether dst MAC
/// action mirred egress redirect dev DEV`, field for field as `tc` sends it.
fn add_filter(index: u32, mac: &[u8; 6]) -> Request {
    Request {
        message: RouteNetlinkMessage::NewTrafficFilter(filter_message(index, mac)),
        flags: NEW_FLAGS,
        what: Some("u32 classifier or mirred action (cls_u32, act_mirred)"),
    }
}

fn filter_message(index: u32, mac: &[u8; 6]) -> TcMessage {
    let mut msg = TcMessage::with_index(index as i32);
    msg.header.parent = ingress();
    // tcm_info: the preference above the protocol, which is in network order.
    msg.header.info = (u32::from(FILTER_PREF) << 16) | u32::from(ETH_P_ALL.to_be());
    msg.attributes.push(TcAttribute::Kind(TcFilterU32::KIND.into()));
    msg.attributes.push(TcAttribute::Options(vec![
        TcOption::U32(TcFilterU32Option::Selector(dst_selector(mac))),
        TcOption::U32(TcFilterU32Option::Action(vec![redirect(index)])),
    ]));
    msg
}

const ETH_P_ALL: u16 = 0x0003;

fn ingress() -> TcHandle {
    TcHandle {
        major: 0xffff,
        minor: TcHandle::MIN_INGRESS,
    }
}

/// The destination MAC as `u32` keys, relative to the network header (the
/// Ethernet header starts 14 bytes before it), aligned to 32 bits as `tc`
/// packs them: the MAC's first two bytes in the low half of the word at -16,
/// its last four in the word at -12.
fn dst_selector(mac: &[u8; 6]) -> TcU32Selector {
    let mut first = TcU32Key::default();
    first.mask = 0x0000_ffff;
    first.val = u32::from_be_bytes([0, 0, mac[0], mac[1]]);
    first.off = -16;
    let mut rest = TcU32Key::default();
    rest.mask = 0xffff_ffff;
    rest.val = u32::from_be_bytes([mac[2], mac[3], mac[4], mac[5]]);
    rest.off = -12;
    let mut sel = TcU32Selector::default();
    sel.flags = TcU32SelectorFlags::Terminal;
    sel.keys = vec![first, rest];
    sel.nkeys = 2;
    sel
}

/// `mirred egress redirect dev INDEX`: the frame is taken (`stolen`) and sent
/// out of the device.
fn redirect(index: u32) -> TcAction {
    let mut parms = TcMirror::default();
    parms.generic = TcActionGeneric::default();
    parms.generic.action = TcActionType::Stolen;
    parms.eaction = TcMirrorActionType::EgressRedir;
    parms.ifindex = index;
    let mut action = TcAction::default();
    action.attributes = vec![
        TcActionAttribute::Kind(TcActionMirror::KIND.into()),
        TcActionAttribute::Options(vec![TcActionOption::Mirror(TcActionMirrorOption::Parms(parms))]),
    ];
    action
}

/// Whether a delete found nothing to delete.
fn absent(e: &rtnetlink::Error) -> bool {
    matches!(
        errno(e),
        Some(nix::libc::ENOENT) | Some(nix::libc::ENODEV) | Some(nix::libc::EINVAL)
    )
}

/// Whether the kernel says it has no such qdisc, classifier or action kind.
fn unsupported(e: &rtnetlink::Error) -> bool {
    matches!(errno(e), Some(nix::libc::ENOENT) | Some(nix::libc::EOPNOTSUPP))
}

/// The MACs as `tc` prints them, for logs.
pub fn fmt_macs(macs: &BTreeSet<[u8; 6]>) -> String {
    macs.iter().map(fmt_mac).collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rtnetlink::packet_core::{self as netlink_packet_core, NetlinkMessage};

    fn bytes(req: &Request) -> Vec<u8> {
        let mut m = NetlinkMessage::from(req.message.clone());
        m.header.flags = req.flags;
        m.finalize();
        let mut buf = vec![0; m.buffer_len()];
        m.serialize(&mut buf);
        buf
    }

    #[test]
    fn the_destination_is_matched_as_tc_packs_it() {
        let sel = dst_selector(&[0x02, 0x11, 0x22, 0x33, 0x44, 0x55]);
        assert_eq!(sel.nkeys, 2);
        assert_eq!(sel.flags, TcU32SelectorFlags::Terminal);
        let keys: Vec<(u32, u32, i32)> = sel.keys.iter().map(|k| (k.val, k.mask, k.off)).collect();
        // What `tc filter show` prints for `match ether dst 02:11:22:33:44:55`.
        assert_eq!(
            keys,
            vec![(0x0000_0211, 0x0000_ffff, -16), (0x2233_4455, 0xffff_ffff, -12)]
        );
    }

    #[test]
    fn the_filter_redirects_to_its_own_device_on_ingress_for_every_protocol() {
        let msg = filter_message(7, &[2, 0, 0, 0, 0, 1]);
        assert_eq!(msg.header.index, 7);
        assert_eq!(msg.header.parent, TcHandle::from(0xffff_fff2));
        assert_eq!(msg.header.info >> 16, 1, "pref 1");
        assert_eq!(
            ((msg.header.info & 0xffff) as u16).to_ne_bytes(),
            [0x00, 0x03],
            "ETH_P_ALL in network order"
        );
        assert!(msg.attributes.contains(&TcAttribute::Kind("u32".into())));
        let Some(TcAttribute::Options(opts)) = msg
            .attributes
            .iter()
            .find(|a| matches!(a, TcAttribute::Options(_)))
        else {
            panic!("no options: {msg:?}");
        };
        let Some(TcOption::U32(TcFilterU32Option::Action(actions))) = opts
            .iter()
            .find(|o| matches!(o, TcOption::U32(TcFilterU32Option::Action(_))))
        else {
            panic!("no action: {opts:?}");
        };
        assert_eq!(actions.len(), 1);
        assert!(actions[0]
            .attributes
            .contains(&TcActionAttribute::Kind("mirred".into())));
        let parms = actions[0]
            .attributes
            .iter()
            .find_map(|a| match a {
                TcActionAttribute::Options(o) => o.iter().find_map(|o| match o {
                    TcActionOption::Mirror(TcActionMirrorOption::Parms(p)) => Some(p.clone()),
                    _ => None,
                }),
                _ => None,
            })
            .expect("mirred parameters");
        assert_eq!(parms.ifindex, 7);
        assert_eq!(parms.eaction, TcMirrorActionType::EgressRedir);
        assert_eq!(parms.generic.action, TcActionType::Stolen);
    }

    #[test]
    fn a_new_filter_never_replaces_one_and_a_qdisc_is_replaced_in_place() {
        let f = add_filter(3, &[2, 0, 0, 0, 0, 1]);
        assert_eq!(f.flags & NLM_F_EXCL, NLM_F_EXCL);
        assert_eq!(f.flags & NLM_F_REPLACE, 0);
        let q = new_qdisc(3);
        assert_eq!(q.flags & NLM_F_REPLACE, NLM_F_REPLACE);
        let RouteNetlinkMessage::NewQueueDiscipline(m) = &q.message else {
            panic!("{q:?}");
        };
        assert_eq!(m.header.parent, TcHandle::from(0xffff_fff1));
        assert_eq!(m.header.handle, TcHandle::from(0xffff_0000));
        assert_eq!(m.attributes, vec![TcAttribute::Kind("clsact".into())]);
    }

    #[test]
    fn the_messages_survive_a_round_trip_through_their_wire_form() {
        for req in [
            add_filter(9, &[2, 1, 2, 3, 4, 5]),
            new_qdisc(9),
            del_qdisc(9),
            del_filters(9),
        ] {
            let buf = bytes(&req);
            let back = NetlinkMessage::<RouteNetlinkMessage>::deserialize(&buf).expect("parses");
            assert_eq!(back.header.flags, req.flags);
            assert_eq!(
                format!("{:?}", back.payload),
                format!(
                    "{:?}",
                    netlink_packet_core::NetlinkPayload::InnerMessage(req.message.clone())
                ),
            );
        }
    }

    #[test]
    fn nothing_to_delete_is_not_an_error_and_a_missing_kind_is_unsupported() {
        let e = |code: i32| {
            let mut m = netlink_packet_core::ErrorMessage::default();
            m.code = std::num::NonZeroI32::new(-code);
            rtnetlink::Error::NetlinkError(m)
        };
        assert!(absent(&e(nix::libc::ENOENT)));
        assert!(!absent(&e(nix::libc::EPERM)));
        assert!(unsupported(&e(nix::libc::ENOENT)));
        assert!(unsupported(&e(nix::libc::EOPNOTSUPP)));
        assert!(!unsupported(&e(nix::libc::EEXIST)));
        let msg = ForwardError::Unsupported {
            what: "clsact qdisc (sch_ingress)",
            source: e(nix::libc::ENOENT),
        }
        .to_string();
        assert!(msg.contains("has no clsact qdisc"), "{msg}");
    }
}
