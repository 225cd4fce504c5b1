//! The host rules (the agent's nftables table) against real namespaces: a guest
//! reaches no service of its node, guests of two networks never reach each other
//! through it, VXLAN passes from a peer VTEP and is dropped (and counted) from
//! any other source, and the table is written once, adopted after a restart,
//! put back when removed behind the agent's back, and removed with the last
//! network. Needs root and `nft` (Debian package nftables).

mod common;

use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{listen_in, sh, sock, transfer, World};
use otherix_agent::daemon::{host, Reconciler, ReconcilerConfig, Underlay, UnderlayError};
use otherix_agent::filter::rules::parse_counters;
use otherix_agent::filter::Counters;
use otherix_agent::net::{Netlink, Netns};
use otherix_agent::runtime::Backoff;
use otherix_agent::runtime::QemuConfig;
use otherix_proto::agent::{BridgeState, DesiredState, FdbEntry, GuestState, NeighborEntry, OverlayState};

/// A node namespace with a reconciler, as the agent runs one.
struct Node {
    ns: String,
    nl: Netlink,
    config: ReconcilerConfig,
}

impl Node {
    fn new(world: &World, suffix: &str) -> Node {
        let ns = world.create_ns(suffix);
        let nl = Netlink::connect_in(&Netns::open(&ns).unwrap()).unwrap();
        let config = ReconcilerConfig {
            netns_prefix: world.name(&format!("g{suffix}")),
            guest_dir: world.tmp.join(format!("guests-{suffix}")),
            workload_path: None,
            backoff: Backoff::default(),
            unrecorded_grace: Duration::from_secs(1),
            handover_patience: Duration::from_secs(1),
            qemu: QemuConfig::new(world.tmp.join(format!("qemu-{suffix}"))),
        };
        Node { ns, nl, config }
    }

    fn reconciler(&self) -> Reconciler {
        Reconciler::new(self.nl.clone(), self.config.clone()).unwrap()
    }

    fn guest_ns(&self, vm_id: &str) -> String {
        format!("{}{}", self.config.netns_prefix, &vm_id[..12])
    }

    /// The table's counters, read with `nft` as an operator would.
    fn counters(&self) -> Counters {
        let out = nft(&self.ns, &["-j", "list", "counters", "table", "inet", "otherix"]);
        assert!(
            out.status.success(),
            "no host rules in {}: {}",
            self.ns,
            stderr(&out)
        );
        parse_counters(&String::from_utf8_lossy(&out.stdout)).unwrap()
    }

    fn has_table(&self) -> bool {
        let out = nft(&self.ns, &["list", "tables"]);
        String::from_utf8_lossy(&out.stdout).contains("table inet otherix")
    }
}

fn nft(ns: &str, args: &[&str]) -> std::process::Output {
    Command::new("ip")
        .args(["netns", "exec", ns, "nft"])
        .args(args)
        .output()
        .unwrap()
}

fn stderr(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn vm_id(n: u8) -> String {
    format!("{n:02x}{}", "b2".repeat(15))
}

/// Guest `n` of network `net` (id `net_id`) at `ip`/`prefix`, default route `gw`.
fn guest(n: u8, net: &str, net_id: &str, ip: Ipv4Addr, prefix: u8, gw: Ipv4Addr) -> GuestState {
    GuestState {
        incoming: Default::default(),
        machine: None,
        vm_id: vm_id(n),
        name: format!("vm{n}"),
        network: net.into(),
        network_id: net_id.into(),
        mac: format!("02:00:0a:d6:00:{n:02x}").parse().unwrap(),
        address: format!("{ip}/{prefix}").parse().unwrap(),
        gateway: gw,
        exec: None,
        migrate_to: None,
    }
}

fn bridge(net: &str, net_id: &str, subnet: &str, address: &str) -> BridgeState {
    BridgeState {
        network: net.into(),
        network_id: net_id.into(),
        subnet: subnet.parse().unwrap(),
        address: address.parse().unwrap(),
    }
}

fn no_underlay() -> Result<Underlay, UnderlayError> {
    Err(UnderlayError::NoOverlay)
}

/// Polls `cond` until it holds (bounded).
fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A TCP connect from inside namespace `ns`, given `limit` to succeed.
fn try_connect(ns: &str, to: SocketAddr, limit: Duration) -> std::io::Result<TcpStream> {
    Netns::open(ns)
        .unwrap()
        .run(move || TcpStream::connect_timeout(&to, limit))
        .unwrap()
}

/// A connect that the host rules must swallow: it times out (a drop, not a
/// refusal), and `counter` of `node` grew meanwhile.
fn assert_dropped(node: &Node, from_ns: &str, to: SocketAddr, counter: fn(&Counters) -> u64) {
    let before = counter(&node.counters());
    match try_connect(from_ns, to, Duration::from_millis(1500)) {
        Ok(_) => panic!("{from_ns} reached {to}"),
        Err(e) => assert_eq!(e.kind(), ErrorKind::TimedOut, "{from_ns} -> {to}: {e}"),
    }
    assert!(
        counter(&node.counters()) > before,
        "{from_ns} -> {to} not counted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_reaches_no_service_of_its_node_but_the_node_still_reaches_the_guest() {
    let world = World::new(50);
    let node = Node::new(&world, "n");
    // The node's own address on its fabric, where its services listen in real life.
    sh(&format!(
        "ip -n {ns} link add fab0 type veth peer name fab1 && ip -n {ns} link set fab1 up && \
         ip -n {ns} addr add 10.213.50.1/24 dev fab0 && ip -n {ns} link set fab0 up",
        ns = node.ns
    ));
    let net_id = "0badc0ffee000050";
    let d = DesiredState {
        version: 1,
        node: "n".into(),
        mtu: 1500,
        bridges: vec![bridge("lab", net_id, "10.214.50.0/24", "10.214.50.1/24")],
        guests: vec![guest(
            1,
            "lab",
            net_id,
            Ipv4Addr::new(10, 214, 50, 11),
            24,
            Ipv4Addr::new(10, 214, 50, 1),
        )],
        ..Default::default()
    };
    let mut rec = node.reconciler();
    assert_eq!(rec.apply(&d, &no_underlay()).await.errors, 0);
    let guest_ns = node.guest_ns(&vm_id(1));

    // A service of the node on every address, as the relay endpoint, the gateway
    // or metrics may listen: out of reach through the guest's own network's
    // address and through any other address of the node.
    let _service = listen_in(&node.ns, sock(Ipv4Addr::UNSPECIFIED, 7444));
    for to in [Ipv4Addr::new(10, 214, 50, 1), Ipv4Addr::new(10, 213, 50, 1)] {
        assert_dropped(&node, &guest_ns, sock(to, 7444), |c| c.guest_to_node_dropped);
    }
    // What the node opens to the guest is answered (the relay's and the
    // gateway's dials, health probes).
    transfer(
        &node.ns,
        &guest_ns,
        sock(Ipv4Addr::new(10, 214, 50, 11), 7000),
        &common::payload(256 * 1024),
    );
    // The round reports what it counted.
    rec.apply(&d, &no_underlay()).await;
    assert!(rec.dropped().guest_to_node_dropped >= 2, "{:?}", rec.dropped());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guests_of_two_networks_never_reach_each_other_through_their_node() {
    let world = World::new(51);
    let node = Node::new(&world, "n");
    // A node that routes (as many hosts do): without the host rules it would
    // carry one network's packets into the other.
    sh(&format!(
        "ip netns exec {} sysctl -qw net.ipv4.ip_forward=1",
        node.ns
    ));
    let (lab, lab2) = ("51adc0ffee000001", "52adc0ffee000002");
    let gw1 = Ipv4Addr::new(10, 214, 51, 1);
    let gw2 = Ipv4Addr::new(10, 214, 51, 129);
    let d = DesiredState {
        version: 1,
        node: "n".into(),
        mtu: 1500,
        bridges: vec![
            bridge("lab", lab, "10.214.51.0/25", "10.214.51.1/25"),
            bridge("lab2", lab2, "10.214.51.128/25", "10.214.51.129/25"),
        ],
        guests: vec![
            guest(1, "lab", lab, Ipv4Addr::new(10, 214, 51, 11), 25, gw1),
            guest(3, "lab", lab, Ipv4Addr::new(10, 214, 51, 13), 25, gw1),
            guest(2, "lab2", lab2, Ipv4Addr::new(10, 214, 51, 140), 25, gw2),
        ],
        ..Default::default()
    };
    let mut rec = node.reconciler();
    assert_eq!(rec.apply(&d, &no_underlay()).await.errors, 0);
    let (g1, g2, g3) = (
        node.guest_ns(&vm_id(1)),
        node.guest_ns(&vm_id(2)),
        node.guest_ns(&vm_id(3)),
    );

    let _listener = listen_in(&g2, sock(Ipv4Addr::new(10, 214, 51, 140), 7000));
    assert_dropped(&node, &g1, sock(Ipv4Addr::new(10, 214, 51, 140), 7000), |c| {
        c.guest_between_networks_dropped
    });
    // Within one network, guests reach each other (bridged; with bridge
    // netfilter on, as here by default, through the forward hook in and out of
    // the same bridge), and the node reaches both networks.
    let bridge_nf = sh(&format!(
        "ip netns exec {} cat /proc/sys/net/bridge/bridge-nf-call-iptables 2>/dev/null || echo absent",
        node.ns
    ));
    eprintln!("bridge-nf-call-iptables in the node: {}", bridge_nf.trim());
    transfer(
        &g1,
        &g3,
        sock(Ipv4Addr::new(10, 214, 51, 13), 7001),
        &common::payload(256 * 1024),
    );
    transfer(
        &node.ns,
        &g2,
        sock(Ipv4Addr::new(10, 214, 51, 140), 7002),
        &common::payload(64 * 1024),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vxlan_passes_from_a_peer_vtep_and_is_dropped_and_counted_from_any_other_source() {
    let world = World::new(52);
    let (a, b) = (Node::new(&world, "a"), Node::new(&world, "b"));
    let stranger = world.create_ns("s");
    // The fabric: a bridge in a namespace of its own, with node a, node b and a
    // stranger (no VTEP of the overlay) on it.
    let fab = world.create_ns("f");
    sh(&format!(
        "ip -n {fab} link add br0 type bridge && ip -n {fab} link set br0 up"
    ));
    for (ns, host, port) in [(&a.ns, 1, "pa"), (&b.ns, 2, "pb"), (&stranger, 9, "ps")] {
        sh(&format!(
            "ip -n {fab} link add {port} type veth peer name fab0 netns {ns} && \
             ip -n {fab} link set {port} master br0 up && \
             ip -n {ns} addr add 10.213.52.{host}/24 dev fab0 && ip -n {ns} link set fab0 up"
        ));
    }
    let vtep = |host: u8| Ipv4Addr::new(10, 213, 52, host);
    let ip = |host: u8| Ipv4Addr::new(10, 214, 52, host);
    let mac = |n: u8| format!("02:00:0a:d6:00:{n:02x}").parse().unwrap();
    let net_id = "0badc0ffee000053";
    // Leases .1 (a) and .2 (b); guest 11 on a, guest 12 on b.
    let desired_for = |me: u8| {
        let other = 3 - me;
        let guest_of = |host: u8| guest(10 + host, "web", net_id, ip(10 + host), 24, ip(254));
        DesiredState {
            version: 1,
            node: format!("n{me}"),
            mtu: 1450,
            overlays: vec![OverlayState {
                network: "web".into(),
                network_id: net_id.into(),
                vni: 520,
                subnet: "10.214.52.0/24".parse().unwrap(),
                address: format!("{}/24", ip(me)).parse().unwrap(),
                mac: mac(me),
                fdb: vec![
                    FdbEntry {
                        mac: mac(other),
                        vtep: vtep(other),
                    },
                    FdbEntry {
                        mac: mac(10 + other),
                        vtep: vtep(other),
                    },
                ],
                neighbors: [other, 11, 12]
                    .into_iter()
                    .map(|h| NeighborEntry {
                        ip: ip(h),
                        mac: mac(h),
                    })
                    .collect(),
            }],
            guests: vec![guest_of(me)],
            ..Default::default()
        }
    };
    let mut recs = Vec::new();
    for (node, me) in [(&a, 1u8), (&b, 2u8)] {
        let underlay = host::find_underlay(&node.nl, vtep(me)).await;
        let mut rec = node.reconciler();
        let round = rec.apply(&desired_for(me), &underlay).await;
        assert_eq!(round.errors, 0, "node {me}");
        recs.push(rec);
    }
    let (ga, gb) = (a.guest_ns(&vm_id(11)), b.guest_ns(&vm_id(12)));

    // From the peer VTEP: guest b reaches guest a over the overlay.
    transfer(&gb, &ga, sock(ip(11), 7000), &common::payload(256 * 1024));
    let inbox = Netns::open(&ga)
        .unwrap()
        .run(|| UdpSocket::bind(sock(ip(11), 7001)))
        .unwrap()
        .unwrap();
    inbox.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let from_b = Netns::open(&gb)
        .unwrap()
        .run(|| UdpSocket::bind(sock(ip(12), 0)))
        .unwrap()
        .unwrap();
    from_b.send_to(b"from a peer", sock(ip(11), 7001)).unwrap();
    let mut buf = [0u8; 64];
    let n = inbox.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"from a peer");
    assert_eq!(a.counters().vxlan_dropped, 0, "nothing from the peer was dropped");

    // The stranger builds its own end of VNI 520 towards node a and sends
    // guest a a datagram: encapsulated from a source that is no VTEP of the
    // overlay, it never reaches the guest, and node a counts it.
    sh(&format!(
        "ip -n {stranger} link add vx0 type vxlan id 520 local 10.213.52.9 remote 10.213.52.1 dev fab0 dstport 4789 nolearning && \
         ip -n {stranger} link set vx0 mtu 1450 up && ip -n {stranger} addr add 10.214.52.99/24 dev vx0 && \
         ip -n {stranger} neigh add {ga_ip} lladdr 02:00:0a:d6:00:0b dev vx0 nud permanent",
        ga_ip = ip(11)
    ));
    let forger = Netns::open(&stranger)
        .unwrap()
        .run(|| UdpSocket::bind(sock(ip(99), 0)))
        .unwrap()
        .unwrap();
    forger.send_to(b"forged", sock(ip(11), 7001)).unwrap();
    wait_until("node a to count the stranger's VXLAN", || {
        a.counters().vxlan_dropped >= 1
    });
    inbox.set_nonblocking(true).unwrap();
    match inbox.recv(&mut buf) {
        Ok(n) => panic!(
            "the guest got {:?} from the stranger",
            String::from_utf8_lossy(&buf[..n])
        ),
        Err(e) => assert_eq!(e.kind(), ErrorKind::WouldBlock, "{e}"),
    }
    // The peer still passes, and the agent's round reads the count.
    inbox.set_nonblocking(false).unwrap();
    from_b.send_to(b"again", sock(ip(11), 7001)).unwrap();
    let n = inbox.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"again");
    let underlay = host::find_underlay(&a.nl, vtep(1)).await;
    let listed_before = a.counters();
    assert_eq!(
        recs[0].apply(&desired_for(1), &underlay).await,
        Default::default()
    );
    let listed_after = a.counters();
    assert!(recs[0].dropped().vxlan_dropped >= 1, "{:?}", recs[0].dropped());
    // The round reads them over netlink: every counter between what `nft`
    // listed before and after it (the stranger's device may still send).
    let read = recs[0].dropped();
    let fields = |c: &Counters| {
        [
            c.vxlan_dropped,
            c.guest_to_node_dropped,
            c.guest_between_networks_dropped,
        ]
    };
    for ((b, r), a) in fields(&listed_before)
        .into_iter()
        .zip(fields(&read))
        .zip(fields(&listed_after))
    {
        assert!(
            b <= r && r <= a,
            "nft {listed_before:?}, then the round {read:?}, then nft {listed_after:?}"
        );
    }

    // A VTEP that joins the overlay is let in as soon as the desired state names it.
    let mut joined = desired_for(1);
    joined.overlays[0].fdb.push(FdbEntry {
        mac: mac(99),
        vtep: vtep(9),
    });
    joined.overlays[0].neighbors.push(NeighborEntry {
        ip: ip(99),
        mac: mac(99),
    });
    joined.version = 2;
    assert_eq!(recs[0].apply(&joined, &underlay).await.errors, 0);
    forger.send_to(b"now a member", sock(ip(11), 7001)).unwrap();
    let n = inbox.recv(&mut buf).unwrap();
    assert_eq!(&buf[..n], b"now a member");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_rules_are_written_once_adopted_after_a_restart_restored_and_removed_with_the_last_network() {
    let world = World::new(53);
    let node = Node::new(&world, "n");
    let net_id = "0badc0ffee000054";
    let mut d = DesiredState {
        version: 1,
        node: "n".into(),
        mtu: 1500,
        bridges: vec![bridge("lab", net_id, "10.214.53.0/24", "10.214.53.1/24")],
        ..Default::default()
    };
    assert!(!node.has_table());
    let mut rec = node.reconciler();
    let round = rec.apply(&d, &no_underlay()).await;
    assert_eq!(round.errors, 0);
    assert!(round.changes > 0);
    assert!(node.has_table());
    assert_eq!(rec.apply(&d, &no_underlay()).await, Default::default(), "steady");

    // A restarted agent recognizes its table (its counters stay).
    drop(rec);
    let mut rec = node.reconciler();
    assert_eq!(rec.apply(&d, &no_underlay()).await, Default::default(), "adopted");

    // Removed behind the agent's back: the next round puts it back.
    let out = nft(&node.ns, &["delete", "table", "inet", "otherix"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let round = rec.apply(&d, &no_underlay()).await;
    assert_eq!((round.changes, round.errors), (1, 0));
    assert!(node.has_table());

    // A change of the wanted rules rewrites the table.
    d.version = 2;
    d.bridges.push(bridge(
        "lab2",
        "55adc0ffee000055",
        "10.214.153.0/24",
        "10.214.153.1/24",
    ));
    let round = rec.apply(&d, &no_underlay()).await;
    assert_eq!(round.errors, 0);
    assert!(round.changes >= 2, "the new bridge and the rules: {round:?}");
    let listing =
        String::from_utf8_lossy(&nft(&node.ns, &["list", "table", "inet", "otherix"]).stdout).into_owned();
    assert!(listing.contains("\"oxl55adc0ff\" . 10.214.153.1"), "{listing}");

    // Nothing desired: the links go, and the table with them.
    let empty = DesiredState {
        version: 3,
        node: "n".into(),
        ..Default::default()
    };
    let round = rec.apply(&empty, &no_underlay()).await;
    assert_eq!(round.errors, 0);
    assert!(!node.has_table());
    assert_eq!(rec.apply(&empty, &no_underlay()).await, Default::default());
}
