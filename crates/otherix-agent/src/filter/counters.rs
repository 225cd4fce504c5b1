//! The table's drop counters, read from the kernel over nftables' own netlink
//! interface: one dump of the table's counter objects (`NFT_MSG_GETOBJ`).
//!
//! Every round reads them, so they cost what a round can afford: one message
//! each way on a socket kept open, where running `nft -j list counters` cost a
//! fork of the agent and a program that loads its cache (5–10 ms of CPU each
//! time, measured while a QEMU guest's live migration wanted the same cores).
//! Writing the table stays `nft -f`'s (one transaction of a whole script).
//!
//! The socket is made in the filter's namespace (a named one is entered the way
//! [`Netns::run`] enters it) and belongs to it from then on; it is dropped and
//! made again after any error.

use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{
    bind, recv, send, setsockopt, socket, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag,
    SockProtocol, SockType,
};
use nix::sys::time::TimeVal;

use super::rules::{Counters, TABLE_NAME};
use super::NftError;
use crate::net::Netns;

/// netfilter's subsystem number of nf_tables (`NFNL_SUBSYS_NFTABLES`).
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// `NFT_MSG_NEWOBJ` / `NFT_MSG_GETOBJ`: an object, and the request for them.
const NFT_MSG_NEWOBJ: u16 = 18;
const NFT_MSG_GETOBJ: u16 = 19;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
/// `NFPROTO_INET`: the table's family.
const NFPROTO_INET: u8 = 1;
/// `NFTA_OBJ_*` attributes.
const NFTA_OBJ_TABLE: u16 = 1;
const NFTA_OBJ_NAME: u16 = 2;
const NFTA_OBJ_TYPE: u16 = 3;
const NFTA_OBJ_DATA: u16 = 4;
/// `NFT_OBJECT_COUNTER`.
const NFT_OBJECT_COUNTER: u32 = 1;
/// `NFTA_COUNTER_PACKETS` inside `NFTA_OBJ_DATA`.
const NFTA_COUNTER_PACKETS: u16 = 2;
/// An attribute's type without its flags (`NLA_TYPE_MASK`).
const NLA_TYPE_MASK: u16 = 0x3fff;
const HEADER: usize = 16;
/// `struct nfgenmsg`.
const NFGENMSG: usize = 4;
/// Longest a read waits for the kernel's answer.
const ANSWER_WITHIN: Duration = Duration::from_secs(2);
/// Room for one `recv`: the kernel fills a dump's part up to a page or so.
const RECV_BUFFER: usize = 64 * 1024;

/// A kept socket to the kernel's nftables, in one namespace.
#[derive(Debug)]
pub struct CounterReader {
    netns: Option<String>,
    socket: Option<OwnedFd>,
    seq: u32,
}

impl CounterReader {
    /// The reader of namespace `netns` (`None`: the caller's own).
    pub fn new(netns: Option<String>) -> CounterReader {
        CounterReader {
            netns,
            socket: None,
            seq: 0,
        }
    }

    /// The table's counters, or `None` when it holds no counter object (it is
    /// not there: ours always has them).
    pub async fn read(&mut self) -> Result<Option<Counters>, NftError> {
        self.seq = self.seq.wrapping_add(1);
        let (seq, netns, socket) = (self.seq, self.netns.clone(), self.socket.take());
        let (socket, result) = tokio::task::spawn_blocking(move || {
            let socket = match socket {
                Some(s) => s,
                None => match open(netns.as_deref()) {
                    Ok(s) => s,
                    Err(reason) => return (None, Err(reason)),
                },
            };
            let result = dump(&socket, seq);
            // A socket that failed once is not trusted with the next read.
            (result.is_ok().then_some(socket), result)
        })
        .await
        .unwrap_or_else(|e| (None, Err(format!("the read did not finish: {e}"))));
        self.socket = socket;
        result.map_err(|message| NftError::Refused {
            what: "read counters",
            netns: self.netns.clone(),
            message,
        })
    }
}

/// A netlink socket to nftables, made in `netns`.
fn open(netns: Option<&str>) -> Result<OwnedFd, String> {
    let make = || -> Result<OwnedFd, String> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkNetFilter,
        )
        .map_err(|e| format!("netlink socket: {e}"))?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0)).map_err(|e| format!("bind netlink: {e}"))?;
        let within = TimeVal::new(i64::try_from(ANSWER_WITHIN.as_secs()).unwrap_or(2), 0);
        setsockopt(&fd, sockopt::ReceiveTimeout, &within).map_err(|e| format!("netlink timeout: {e}"))?;
        Ok(fd)
    };
    match netns {
        None => make(),
        Some(name) => Netns::open(name)
            .and_then(|ns| ns.run(make))
            .map_err(|e| e.to_string())
            .and_then(|r| r),
    }
}

/// One dump of the table's counter objects on `socket`.
fn dump(socket: &OwnedFd, seq: u32) -> Result<Option<Counters>, String> {
    let request = request(seq);
    send(socket.as_raw_fd(), &request, MsgFlags::empty()).map_err(|e| format!("send: {e}"))?;
    let mut buf = vec![0u8; RECV_BUFFER];
    let mut found = Found::default();
    loop {
        let n = recv(socket.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(|e| match e {
            nix::errno::Errno::EAGAIN => format!("no answer from the kernel in {}s", ANSWER_WITHIN.as_secs()),
            e => format!("recv: {e}"),
        })?;
        if parse(&buf[..n], seq, &mut found)? {
            return Ok((found.objects > 0).then_some(found.counters));
        }
    }
}

/// The request: every counter object of table `inet otherix`.
fn request(seq: u32) -> Vec<u8> {
    let mut msg = Vec::with_capacity(64);
    msg.extend_from_slice(&0u32.to_ne_bytes()); // length, set below
    msg.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETOBJ).to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    msg.extend_from_slice(&seq.to_ne_bytes());
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    msg.extend_from_slice(&[NFPROTO_INET, 0, 0, 0]); // nfgenmsg: family, version 0, res_id 0
    let mut table = TABLE_NAME.as_bytes().to_vec();
    table.push(0);
    attribute(&mut msg, NFTA_OBJ_TABLE, &table);
    attribute(&mut msg, NFTA_OBJ_TYPE, &NFT_OBJECT_COUNTER.to_be_bytes());
    let len = u32::try_from(msg.len()).unwrap_or(u32::MAX);
    msg[..4].copy_from_slice(&len.to_ne_bytes());
    msg
}

fn attribute(msg: &mut Vec<u8>, kind: u16, payload: &[u8]) {
    let len = u16::try_from(4 + payload.len()).unwrap_or(u16::MAX);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(payload);
    msg.resize(align(msg.len()), 0);
}

fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// What a dump gave so far.
#[derive(Debug, Default)]
struct Found {
    counters: Counters,
    objects: usize,
}

/// Reads the messages in `buf` into `found`; `true` once the dump is done.
/// Messages of another sequence number (an earlier read's) are skipped.
fn parse(buf: &[u8], seq: u32, found: &mut Found) -> Result<bool, String> {
    let mut at = 0;
    while at + HEADER <= buf.len() {
        let len = u32_ne(&buf[at..]) as usize;
        let kind = u16_ne(&buf[at + 4..]);
        let msg_seq = u32_ne(&buf[at + 8..]);
        if len < HEADER || at + len > buf.len() {
            return Err(format!("a malformed netlink message (length {len})"));
        }
        let body = &buf[at + HEADER..at + len];
        at += align(len);
        if msg_seq != seq {
            continue;
        }
        match kind {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let code = body
                    .get(..4)
                    .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
                match code {
                    Some(0) => {}
                    Some(code) => {
                        return Err(format!(
                            "the kernel refused: {}",
                            nix::errno::Errno::from_raw(code.saturating_neg())
                        ))
                    }
                    None => return Err("a truncated netlink error".into()),
                }
            }
            k if k == (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWOBJ => {
                let attrs = body.get(NFGENMSG..).ok_or("a truncated nftables object")?;
                object(attrs, found)?;
            }
            _ => {}
        }
    }
    Ok(false)
}

/// One object's attributes: its name and, for a counter of ours, its packets.
fn object(attrs: &[u8], found: &mut Found) -> Result<(), String> {
    let (mut name, mut kind, mut packets) = (None, None, None);
    for (t, payload) in attributes(attrs)? {
        match t {
            NFTA_OBJ_NAME => name = Some(payload.strip_suffix(&[0]).unwrap_or(payload)),
            NFTA_OBJ_TYPE if payload.len() == 4 => {
                kind = Some(u32::from_be_bytes([
                    payload[0], payload[1], payload[2], payload[3],
                ]));
            }
            NFTA_OBJ_DATA => {
                for (t, value) in attributes(payload)? {
                    if t == NFTA_COUNTER_PACKETS && value.len() == 8 {
                        let mut b = [0u8; 8];
                        b.copy_from_slice(value);
                        packets = Some(u64::from_be_bytes(b));
                    }
                }
            }
            _ => {}
        }
    }
    if kind != Some(NFT_OBJECT_COUNTER) {
        return Ok(());
    }
    found.objects += 1;
    let name = name.and_then(|n| std::str::from_utf8(n).ok()).unwrap_or_default();
    if let (Some(slot), Some(packets)) = (found.counters.get_mut(name), packets) {
        *slot = packets;
    }
    Ok(())
}

/// The attributes in `buf`: (type without flags, payload).
fn attributes(buf: &[u8]) -> Result<Vec<(u16, &[u8])>, String> {
    let mut out = Vec::new();
    let mut at = 0;
    while at + 4 <= buf.len() {
        let len = u16_ne(&buf[at..]) as usize;
        let kind = u16_ne(&buf[at + 2..]) & NLA_TYPE_MASK;
        if len < 4 || at + len > buf.len() {
            return Err(format!("a malformed netlink attribute (length {len})"));
        }
        out.push((kind, &buf[at + 4..at + len]));
        at += align(len);
    }
    Ok(out)
}

fn u16_ne(b: &[u8]) -> u16 {
    u16::from_ne_bytes([b[0], b[1]])
}

fn u32_ne(b: &[u8]) -> u32 {
    u32::from_ne_bytes([b[0], b[1], b[2], b[3]])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `NEWOBJ` message as the kernel sends one: a counter named `name`.
    fn counter_message(seq: u32, name: &str, kind: u32, packets: u64) -> Vec<u8> {
        let mut msg = Vec::new();
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(&((NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWOBJ).to_ne_bytes());
        msg.extend_from_slice(&0x2u16.to_ne_bytes()); // NLM_F_MULTI
        msg.extend_from_slice(&seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(&[NFPROTO_INET, 0, 0, 5]);
        attribute(&mut msg, NFTA_OBJ_TABLE, b"otherix\0");
        attribute(&mut msg, NFTA_OBJ_NAME, format!("{name}\0").as_bytes());
        attribute(&mut msg, NFTA_OBJ_TYPE, &kind.to_be_bytes());
        let mut data = Vec::new();
        attribute(&mut data, 1, &(packets * 60).to_be_bytes()); // bytes
        attribute(&mut data, NFTA_COUNTER_PACKETS, &packets.to_be_bytes());
        attribute(&mut msg, NFTA_OBJ_DATA | 0x8000, &data); // NLA_F_NESTED
        let len = u32::try_from(msg.len()).unwrap();
        msg[..4].copy_from_slice(&len.to_ne_bytes());
        msg
    }

    fn control(seq: u32, kind: u16, code: i32) -> Vec<u8> {
        let mut msg = Vec::new();
        msg.extend_from_slice(&20u32.to_ne_bytes());
        msg.extend_from_slice(&kind.to_ne_bytes());
        msg.extend_from_slice(&0u16.to_ne_bytes());
        msg.extend_from_slice(&seq.to_ne_bytes());
        msg.extend_from_slice(&0u32.to_ne_bytes());
        msg.extend_from_slice(&code.to_ne_bytes());
        msg
    }

    #[test]
    fn the_request_asks_for_the_counter_objects_of_our_inet_table() {
        let r = request(7);
        assert_eq!(u32_ne(&r) as usize, r.len());
        assert_eq!(u16_ne(&r[4..]), (10 << 8) | 19, "nf_tables GETOBJ");
        assert_eq!(u16_ne(&r[6..]), 0x301, "a dump request");
        assert_eq!(u32_ne(&r[8..]), 7);
        assert_eq!(r[16], 1, "family inet");
        let attrs = attributes(&r[20..]).unwrap();
        assert_eq!(attrs, vec![(1, &b"otherix\0"[..]), (3, &[0, 0, 0, 1][..])]);
    }

    #[test]
    fn a_dump_gives_our_counters_by_name_and_ends_at_done() {
        let mut buf = Vec::new();
        buf.extend(counter_message(3, "vxlan_dropped", 1, 7));
        buf.extend(counter_message(3, "guest_to_node_dropped", 1, 2));
        buf.extend(counter_message(3, "someone_elses", 1, 9));
        // A quota object of the same table is no counter.
        buf.extend(counter_message(3, "guest_between_networks_dropped", 2, 5));
        // An earlier read's late answer is not this one's.
        buf.extend(counter_message(2, "guest_between_networks_dropped", 1, 99));
        let mut found = Found::default();
        assert!(!parse(&buf, 3, &mut found).unwrap(), "not done before NLMSG_DONE");
        assert!(parse(&control(3, NLMSG_DONE, 0), 3, &mut found).unwrap());
        assert_eq!(found.objects, 3);
        assert_eq!(
            found.counters,
            Counters {
                vxlan_dropped: 7,
                guest_to_node_dropped: 2,
                guest_between_networks_dropped: 0,
            }
        );
    }

    #[test]
    fn a_refusal_or_a_malformed_message_is_an_error_never_a_panic() {
        let mut found = Found::default();
        let err = parse(&control(1, NLMSG_ERROR, -1), 1, &mut found).unwrap_err();
        assert!(err.contains("EPERM"), "{err}");
        assert!(
            !parse(&control(1, NLMSG_ERROR, 0), 1, &mut found).unwrap(),
            "an ack is no end"
        );
        let mut long = control(1, NLMSG_DONE, 0);
        long[..4].copy_from_slice(&200u32.to_ne_bytes());
        assert!(parse(&long, 1, &mut found).is_err());
        let mut short = counter_message(1, "vxlan_dropped", 1, 1);
        short[20..22].copy_from_slice(&300u16.to_ne_bytes()); // an attribute past the end
        assert!(parse(&short, 1, &mut found).is_err());
        for cut in 0..short.len() {
            let _ = parse(&short[..cut], 1, &mut Found::default());
        }
    }
}
