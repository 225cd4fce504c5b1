//! The overlay, end to end in real namespaces: VXLAN between two node namespaces,
//! programmed only by `reconcile_overlay`, carrying TCP between netns guests.
//! Needs root.

mod common;

use std::net::{Ipv4Addr, UdpSocket};
use std::time::Duration;

use common::{mac, payload, sh, sock, transfer, TwoNodes, World, OVERLAY_MTU};
use otherix_agent::net::{
    fmt_mac, Change, FdbEntry, IfAddr, NetError, Netlink, Netns, OverlaySpec, FLOOD_MAC,
};

#[tokio::test]
async fn guests_on_two_nodes_exchange_tcp_over_vxlan_both_ways() {
    let w = TwoNodes::new(1).await;
    let (a, b) = (&w.a, &w.b);
    // Guest to guest, both directions.
    transfer(
        &a.guest.netns,
        &b.guest.netns,
        sock(b.guest.ip, 7001),
        b"hello from a",
    );
    transfer(
        &b.guest.netns,
        &a.guest.netns,
        sock(a.guest.ip, 7002),
        b"hello from b",
    );
    // The gateway path: a node dials a guest on the other node through its overlay
    // address, with the guest's MAC taken from the programmed neighbor entry.
    transfer(
        &a.netns,
        &b.guest.netns,
        sock(b.guest.ip, 7003),
        b"node a to guest b",
    );
    transfer(
        &b.netns,
        &a.guest.netns,
        sock(a.guest.ip, 7004),
        b"node b to guest a",
    );
}

#[tokio::test]
async fn one_mebibyte_and_full_size_frames_cross_the_overlay() {
    let w = TwoNodes::new(2).await;
    let (a, b) = (&w.a, &w.b);
    // Everything on the overlay path carries the overlay MTU (underlay 1500 - 50).
    for (ns, link) in [
        (&a.netns, "br0"),
        (&a.netns, "vx0"),
        (&a.netns, "hva"),
        (&a.guest.netns, "eth0"),
    ] {
        let out = sh(&format!("ip -n {ns} link show {link}"));
        assert!(
            out.contains(&format!("mtu {OVERLAY_MTU}")),
            "{link} in {ns}: {out}"
        );
    }
    // 1 MiB each way: TCP fills every segment to the MSS (1410 bytes of payload).
    let data = payload(1 << 20);
    let tx_before = vx0_tx_bytes(&a.netns);
    transfer(&a.guest.netns, &b.guest.netns, sock(b.guest.ip, 7010), &data);
    transfer(&b.guest.netns, &a.guest.netns, sock(a.guest.ip, 7011), &data);
    // And it really went through the tunnel.
    assert!(vx0_tx_bytes(&a.netns) - tx_before >= 1 << 20);

    // One UDP datagram that makes a full 1450-byte IP packet (1422 + 8 + 20) arrives
    // whole: nothing on the path drops full-size frames.
    let rx_addr = sock(b.guest.ip, 7012);
    let rx = Netns::open(&b.guest.netns)
        .unwrap()
        .run(move || UdpSocket::bind(rx_addr))
        .unwrap()
        .unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let tx = Netns::open(&a.guest.netns)
        .unwrap()
        .run(|| UdpSocket::bind("0.0.0.0:0"))
        .unwrap()
        .unwrap();
    let datagram = payload(1422);
    let mut buf = [0u8; 2048];
    // ARP may still be resolving for the first datagram; a few tries, then it must work.
    let got = (0..5).find_map(|_| {
        tx.send_to(&datagram, rx_addr).unwrap();
        rx.recv(&mut buf).ok()
    });
    assert_eq!(got, Some(1422));
    assert_eq!(&buf[..1422], &datagram[..]);
}

/// Bytes sent by `vx0` in `ns`, from `ip -s link`.
fn vx0_tx_bytes(ns: &str) -> u64 {
    let out = sh(&format!("ip -s -n {ns} link show vx0"));
    let mut lines = out.lines();
    lines.find(|l| l.trim_start().starts_with("TX:"));
    lines
        .next()
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no TX bytes in {out}"))
}

#[tokio::test]
async fn reconcile_is_idempotent_and_repairs_drift() {
    let w = TwoNodes::new(3).await;
    let a = &w.a;
    let spec = w.overlay(a);

    // Converged: a second run changes nothing.
    assert_eq!(a.nl.reconcile_overlay(&spec).await.unwrap(), vec![]);

    // What we program is what `bridge fdb` shows, flood entry included.
    let fdb = sh(&format!("ip netns exec {} bridge fdb show dev vx0", a.netns));
    let guest_b = fmt_mac(&w.b.guest.mac);
    let vtep_b = w.b.vtep;
    assert!(
        fdb.contains(&format!("{guest_b} dst {vtep_b} self permanent")),
        "{fdb}"
    );
    assert!(
        fdb.contains(&format!("00:00:00:00:00:00 dst {vtep_b} self permanent")),
        "{fdb}"
    );

    // Drift: an FDB entry deleted by hand, one added by hand, a neighbor deleted, a
    // stray address on the bridge, the VXLAN device down.
    sh(&format!(
        "ip netns exec {} bridge fdb del {guest_b} dev vx0 dst {vtep_b} self",
        a.netns
    ));
    sh(&format!(
        "ip netns exec {} bridge fdb append 02:00:00:00:00:99 dev vx0 dst 10.213.3.77 self permanent",
        a.netns
    ));
    sh(&format!("ip -n {} neigh del {} dev br0", a.netns, w.b.guest.ip));
    sh(&format!("ip -n {} addr add 10.214.3.200/24 dev br0", a.netns));
    sh(&format!("ip -n {} link set vx0 down", a.netns));

    let mut changes = a.nl.reconcile_overlay(&spec).await.unwrap();
    changes.sort_by_key(|c| c.to_string());
    let stray = FdbEntry::new([2, 0, 0, 0, 0, 0x99], Ipv4Addr::new(10, 213, 3, 77));
    let expected = [
        Change::AddressRemoved {
            link: format!("br0 (netns {})", a.netns),
            addr: IfAddr::new(Ipv4Addr::new(10, 214, 3, 200), 24),
        },
        Change::FdbAdded {
            link: format!("vx0 (netns {})", a.netns),
            entry: FdbEntry::new(w.b.guest.mac, vtep_b),
        },
        Change::FdbRemoved {
            link: format!("vx0 (netns {})", a.netns),
            entry: stray,
        },
        Change::LinkUpdated {
            link: format!("vx0 (netns {})", a.netns),
            what: "up",
        },
    ];
    for e in &expected {
        assert!(changes.contains(e), "missing {e}; got {changes:#?}");
    }
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::NeighborSet { entry, .. } if entry.ip == w.b.guest.ip)),
        "{changes:#?}"
    );
    assert_eq!(changes.len(), 5, "{changes:#?}");

    let fdb = sh(&format!("ip netns exec {} bridge fdb show dev vx0", a.netns));
    assert!(
        fdb.contains(&format!("{guest_b} dst {vtep_b} self permanent")),
        "{fdb}"
    );
    assert!(!fdb.contains("02:00:00:00:00:99"), "{fdb}");
    // Converged again, and the overlay works.
    assert_eq!(a.nl.reconcile_overlay(&spec).await.unwrap(), vec![]);
    transfer(
        &a.guest.netns,
        &w.b.guest.netns,
        sock(w.b.guest.ip, 7020),
        b"after repair",
    );
}

#[tokio::test]
async fn neighbor_mac_returns_the_programmed_mac_and_ignores_learned_entries() {
    let w = TwoNodes::new(4).await;
    let a = &w.a;
    assert_eq!(
        a.nl.neighbor_mac("br0", w.b.guest.ip).await.unwrap(),
        Some(w.b.guest.mac)
    );
    assert_eq!(
        a.nl.neighbor_mac("br0", a.guest.ip).await.unwrap(),
        Some(a.guest.mac)
    );
    assert_eq!(
        a.nl.neighbor_mac("br0", Ipv4Addr::new(10, 214, 4, 99))
            .await
            .unwrap(),
        None
    );

    // A learned (non-permanent) entry is not the control plane's word: a guest can get
    // one made for any IP by answering ARP.
    sh(&format!(
        "ip -n {} neigh add 10.214.4.98 lladdr 02:00:00:00:00:98 dev br0 nud reachable",
        a.netns
    ));
    assert_eq!(
        a.nl.neighbor_mac("br0", Ipv4Addr::new(10, 214, 4, 98))
            .await
            .unwrap(),
        None
    );
    // ... and reconcile leaves it to the kernel.
    assert_eq!(a.nl.reconcile_overlay(&w.overlay(a)).await.unwrap(), vec![]);

    // A MAC change from the control plane is what the check then sees.
    let mut spec = w.overlay(a);
    let new_mac = mac(4, 0x77);
    spec.neighbors[1].mac = new_mac;
    a.nl.reconcile_overlay(&spec).await.unwrap();
    assert_eq!(
        a.nl.neighbor_mac("br0", w.b.guest.ip).await.unwrap(),
        Some(new_mac)
    );

    // Asking about a bridge that does not exist is an error naming it.
    let err = a.nl.neighbor_mac("nosuchbr", w.b.guest.ip).await.unwrap_err();
    assert!(matches!(err, NetError::LinkNotFound { .. }), "{err}");
    assert!(err.to_string().contains("nosuchbr"), "{err}");
}

/// A single node is enough for device-level tests. Its underlay is one end of a veth
/// pair (this kernel has no dummy driver).
async fn single_node(world: &World) -> (String, Netlink) {
    let ns = world.create_ns("n");
    sh(&format!("ip -n {ns} link add und0 type veth peer name und1"));
    sh(&format!("ip -n {ns} addr add 10.213.5.1/24 dev und0"));
    sh(&format!("ip -n {ns} link set und0 up"));
    let nl = Netlink::connect_in(&Netns::open(&ns).unwrap()).unwrap();
    (ns, nl)
}

fn lone_overlay(vni: u32) -> OverlaySpec {
    OverlaySpec {
        bridge: "br0".into(),
        vxlan: "vx0".into(),
        vni,
        local_vtep: Ipv4Addr::new(10, 213, 5, 1),
        underlay: "und0".into(),
        mtu: OVERLAY_MTU,
        address: Some(IfAddr::new(Ipv4Addr::new(10, 214, 5, 1), 24)),
        mac: None,
        fdb: vec![FdbEntry::new(mac(5, 2), Ipv4Addr::new(10, 213, 5, 2))],
        neighbors: vec![],
    }
}

#[tokio::test]
async fn vxlan_device_is_recreated_when_its_vni_changes() {
    let world = World::new(5);
    let (ns, nl) = single_node(&world).await;
    nl.reconcile_overlay(&lone_overlay(100)).await.unwrap();
    let details = sh(&format!("ip -d -n {ns} link show vx0"));
    assert!(
        details.contains("vxlan id 100 local 10.213.5.1 dev und0"),
        "{details}"
    );
    assert!(details.contains("nolearning"), "{details}");
    assert!(details.contains("dstport 4789"), "{details}");
    assert!(details.contains("master br0"), "{details}");

    let changes = nl.reconcile_overlay(&lone_overlay(101)).await.unwrap();
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::LinkRecreated { link, .. } if link.starts_with("vx0"))),
        "{changes:#?}"
    );
    let details = sh(&format!("ip -d -n {ns} link show vx0"));
    assert!(details.contains("vxlan id 101"), "{details}");
    assert!(details.contains("master br0"), "{details}");
    // The FDB died with the old device and was programmed again on the new one.
    let fdb = nl.fdb("vx0").await.unwrap();
    assert!(
        fdb.contains(&FdbEntry::new(mac(5, 2), Ipv4Addr::new(10, 213, 5, 2))),
        "{fdb:?}"
    );
    assert!(
        fdb.contains(&FdbEntry::new(FLOOD_MAC, Ipv4Addr::new(10, 213, 5, 2))),
        "{fdb:?}"
    );
    assert_eq!(nl.reconcile_overlay(&lone_overlay(101)).await.unwrap(), vec![]);
}

#[tokio::test]
async fn a_guest_mac_that_moves_to_another_vtep_is_repointed_in_one_round() {
    let world = World::new(9);
    let (_ns, nl) = single_node(&world).await;
    let (guest, from, to) = (
        mac(5, 2),
        Ipv4Addr::new(10, 213, 5, 2),
        Ipv4Addr::new(10, 213, 5, 3),
    );
    nl.reconcile_overlay(&lone_overlay(100)).await.unwrap();
    // A migration: the guest's MAC now lives behind another VTEP.
    let mut moved = lone_overlay(100);
    moved.fdb = vec![FdbEntry::new(guest, to)];
    nl.reconcile_overlay(&moved).await.unwrap();
    let fdb = nl.fdb("vx0").await.unwrap();
    assert!(fdb.contains(&FdbEntry::new(guest, to)), "{fdb:?}");
    assert!(!fdb.contains(&FdbEntry::new(guest, from)), "{fdb:?}");
    // The flood list follows the members: the new VTEP in, the old one out.
    assert!(fdb.contains(&FdbEntry::new(FLOOD_MAC, to)), "{fdb:?}");
    assert!(!fdb.contains(&FdbEntry::new(FLOOD_MAC, from)), "{fdb:?}");
    assert_eq!(
        nl.reconcile_overlay(&moved).await.unwrap(),
        vec![],
        "converged in one round"
    );
}

#[tokio::test]
async fn repointing_ahead_moves_only_macs_that_moved_and_needs_a_device() {
    let world = World::new(11);
    let (_ns, nl) = single_node(&world).await;
    let (guest, from, to) = (
        mac(5, 2),
        Ipv4Addr::new(10, 213, 5, 2),
        Ipv4Addr::new(10, 213, 5, 3),
    );
    // No VXLAN device yet: nothing to repoint, and no error.
    let moved = vec![FdbEntry::new(guest, to), FdbEntry::new(mac(5, 9), to)];
    assert_eq!(nl.repoint_fdb("vx0", &moved).await.unwrap(), vec![]);
    nl.reconcile_overlay(&lone_overlay(100)).await.unwrap();
    let changes = nl.repoint_fdb("vx0", &moved).await.unwrap();
    assert_eq!(changes.len(), 1, "only the MAC it had elsewhere: {changes:?}");
    let fdb = nl.fdb("vx0").await.unwrap();
    assert!(fdb.contains(&FdbEntry::new(guest, to)), "{fdb:?}");
    assert!(!fdb.contains(&FdbEntry::new(guest, from)), "{fdb:?}");
    // A MAC it did not have is left to the overlay's round; so is the flood list.
    assert!(!fdb.iter().any(|e| e.mac == mac(5, 9)), "{fdb:?}");
    assert!(fdb.contains(&FdbEntry::new(FLOOD_MAC, from)), "{fdb:?}");
    assert_eq!(nl.repoint_fdb("vx0", &moved).await.unwrap(), vec![], "done once");
}

#[tokio::test]
async fn remove_stale_deletes_only_our_undesired_links() {
    let world = World::new(6);
    let (ns, nl) = single_node(&world).await;
    for name in ["oxbr-keep", "oxbr-gone", "other0"] {
        nl.ensure_bridge(name, 1500, None).await.unwrap();
    }
    let changes = nl.remove_stale("oxbr-", &["oxbr-keep"]).await.unwrap();
    assert_eq!(
        changes,
        vec![Change::LinkDeleted {
            link: format!("oxbr-gone (netns {ns})")
        }]
    );
    let links = sh(&format!("ip -n {ns} -o link show"));
    assert!(links.contains("oxbr-keep") && links.contains("other0"), "{links}");
    assert!(!links.contains("oxbr-gone"), "{links}");
    assert_eq!(nl.remove_stale("oxbr-", &["oxbr-keep"]).await.unwrap(), vec![]);
    assert!(matches!(
        nl.remove_stale("", &[]).await,
        Err(NetError::InvalidSpec(_))
    ));
}

#[tokio::test]
async fn bad_names_are_refused_before_touching_the_kernel() {
    let world = World::new(7);
    let (ns, nl) = single_node(&world).await;
    let mut spec = lone_overlay(100);
    spec.bridge = "br-name-too-long0".into();
    let err = nl.reconcile_overlay(&spec).await.unwrap_err();
    assert!(
        matches!(err, NetError::InvalidName { ref name, .. } if name == "br-name-too-long0"),
        "{err}"
    );
    assert!(err.to_string().contains("longer than 15 bytes"), "{err}");
    // Nothing was created.
    let links = sh(&format!("ip -n {ns} -o link show"));
    assert!(!links.contains("vx0") && !links.contains("br-name"), "{links}");

    // A link of the wrong kind under our name is reported, not deleted.
    sh(&format!("ip -n {ns} link add br0 type veth peer name br0peer"));
    let err = nl.reconcile_overlay(&lone_overlay(100)).await.unwrap_err();
    assert!(
        matches!(
            err,
            NetError::WrongKind {
                expected: "bridge",
                ..
            }
        ),
        "{err}"
    );
    assert!(sh(&format!("ip -d -n {ns} link show br0")).contains("veth"));
}

#[test]
fn a_world_is_removed_even_when_its_test_panics() {
    let prefix = std::panic::catch_unwind(|| {
        let world = World::new(8);
        world.create_ns("x");
        let prefix = world.prefix.clone();
        assert!(!otherix_agent::net::netns::list(&prefix).unwrap().is_empty());
        panic!("{prefix}");
    })
    .unwrap_err()
    .downcast::<String>()
    .unwrap();
    assert_eq!(
        otherix_agent::net::netns::list(&prefix).unwrap(),
        Vec::<String>::new()
    );
}

/// The forwarding for guests that left, on a real kernel: the rules on a
/// VXLAN device's ingress (put in through netlink) follow the MACs asked for,
/// read back by `tc` as the rule `tc` itself would make, and nothing is left
/// when none are (twice: a restarted agent clears what may or may not be
/// there). A rule made ready for a handover changes nothing until it fires.
#[tokio::test]
async fn forwarding_rules_follow_the_macs_asked_for_and_leave_nothing_behind() {
    use otherix_agent::net::forward::Forwarder;
    use std::collections::BTreeSet;
    let w = World::new(70);
    let ns = w.create_ns("fwd");
    sh(&format!(
        "ip -n {ns} link add vx0 type vxlan id 42 local 127.0.0.1 dstport 4789 nolearning && ip -n {ns} link set vx0 up"
    ));
    let fwd = Forwarder::new(Netlink::connect_in(&Netns::open(&ns).unwrap()).unwrap());
    let filters = || sh(&format!("ip netns exec {ns} tc filter show dev vx0 ingress"));
    let clsact = || sh(&format!("ip netns exec {ns} tc qdisc show dev vx0")).contains("clsact");
    let (m1, m2) = ([2, 0, 0, 0, 0, 0x0a], [2, 0, 0, 0, 0, 0x0b]);

    fwd.converge("vx0", &BTreeSet::from([m1, m2])).await.unwrap();
    let f = filters();
    assert_eq!(f.matches("Egress Redirect to device vx0").count(), 2, "{f}");
    assert!(f.contains("filter protocol all pref 1 u32"), "{f}");
    // u32 shows the destination as two keys before the network header.
    assert!(
        f.contains("00000200/0000ffff at -16") && f.contains("0000000a/ffffffff at -12"),
        "{f}"
    );

    fwd.converge("vx0", &BTreeSet::from([m2])).await.unwrap();
    let f = filters();
    assert_eq!(f.matches("Egress Redirect to device vx0").count(), 1, "{f}");
    assert!(
        f.contains("0000000b/ffffffff at -12") && !f.contains("0000000a/ffffffff"),
        "{f}"
    );

    // Made ready: the qdisc is there, the filters are as they were.
    let armed = fwd.arm("vx0", m1).await.unwrap();
    assert!(clsact());
    assert_eq!(filters().matches("Egress Redirect").count(), 1);
    armed.fire().await.unwrap();
    let f = filters();
    assert_eq!(f.matches("Egress Redirect to device vx0").count(), 2, "{f}");
    assert!(f.contains("0000000a/ffffffff at -12"), "{f}");

    for _ in 0..2 {
        fwd.converge("vx0", &BTreeSet::new()).await.unwrap();
        assert!(!clsact(), "no qdisc left");
    }
    // Made ready and never fired: clearing takes the qdisc away.
    let _ = fwd.arm("vx0", m2).await.unwrap();
    assert!(clsact());
    fwd.converge("vx0", &BTreeSet::new()).await.unwrap();
    assert!(!clsact(), "no qdisc left");
    // A device that went (with its overlay) has nothing to clear.
    fwd.converge("vx9", &BTreeSet::new()).await.unwrap();
    assert!(fwd.converge("vx9", &BTreeSet::from([m1])).await.is_err());
    assert!(fwd.arm("vx9", m1).await.is_err());
}

/// A QEMU guest's switchover pins its MAC (from a task of its own, while the
/// agent's rounds go on): every convergence keeps it, whatever it is asked,
/// until it is unpinned; then the next convergence decides alone. A clone of
/// the forwarder (the switchover's) pins for all of them.
#[tokio::test]
async fn a_pinned_mac_is_forwarded_through_every_convergence_until_unpinned() {
    use otherix_agent::net::forward::Forwarder;
    use std::collections::BTreeSet;
    let w = World::new(71);
    let ns = w.create_ns("pin");
    sh(&format!(
        "ip -n {ns} link add vx0 type vxlan id 43 local 127.0.0.1 dstport 4789 nolearning && ip -n {ns} link set vx0 up"
    ));
    let fwd = Forwarder::new(Netlink::connect_in(&Netns::open(&ns).unwrap()).unwrap());
    let switchover = fwd.clone();
    let redirects = || {
        let f = sh(&format!("ip netns exec {ns} tc filter show dev vx0 ingress"));
        let macs: BTreeSet<String> = ["0a", "0b"]
            .into_iter()
            .filter(|m| f.contains(&format!("000000{m}/ffffffff at -12")))
            .map(str::to_owned)
            .collect();
        assert_eq!(
            f.matches("Egress Redirect to device vx0").count(),
            macs.len(),
            "{f}"
        );
        macs
    };
    let set = |m: &[&str]| m.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
    let (m1, m2) = ([2, 0, 0, 0, 0, 0x0a], [2, 0, 0, 0, 0, 0x0b]);

    switchover.pin("vx0", m1).await.unwrap();
    assert_eq!(redirects(), set(&["0a"]));
    assert_eq!(fwd.pinned("vx0"), BTreeSet::from([m1]));
    // The round converges to what it was asked, the pinned MAC with it.
    let now = fwd.converge("vx0", &BTreeSet::from([m2])).await.unwrap();
    assert_eq!(now, BTreeSet::from([m1, m2]));
    assert_eq!(redirects(), set(&["0a", "0b"]));
    let now = fwd.converge("vx0", &BTreeSet::new()).await.unwrap();
    assert_eq!(now, BTreeSet::from([m1]));
    assert_eq!(redirects(), set(&["0a"]), "an empty ask keeps the pinned MAC");

    assert!(switchover.unpin("vx0", m1));
    assert!(!switchover.unpin("vx0", m1), "unpinned once");
    assert!(fwd.pinned("vx0").is_empty());
    let now = fwd.converge("vx0", &BTreeSet::new()).await.unwrap();
    assert!(now.is_empty());
    assert!(redirects().is_empty());
    assert!(
        !sh(&format!("ip netns exec {ns} tc qdisc show dev vx0")).contains("clsact"),
        "no qdisc left"
    );
    // A pin that failed may have reached the kernel in part: the device's
    // next convergence goes to the kernel, and settles it.
    assert!(!fwd.unsure("vx0"));
    assert!(switchover.pin("vx9", m1).await.is_err());
    assert!(fwd.pinned("vx9").is_empty());
    assert!(fwd.unsure("vx9"));
    fwd.converge("vx9", &BTreeSet::new()).await.unwrap();
    assert!(!fwd.unsure("vx9"));
}
