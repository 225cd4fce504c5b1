//! The agents' host rules on a testbed cluster: every node runs its nftables
//! table, a guest reaches none of its node's services (the relay endpoint,
//! metrics, the gateway listener), `otherix connect` and `otherix forward` work
//! through the gateway and through the relay all the same, and the gateway's
//! dial stays on the overlay's device when a route would send it elsewhere.
//!
//! The world is torn down on drop. Waits use `wait_until` on a state (a
//! counter, a metric, an answer); the connects a guest must not complete are
//! given a bounded time, and the node's drop counter says why they failed.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use otherix_testbed::cluster::{Cluster, ClusterSpec, GATEWAY_PORT};
use otherix_testbed::{wait_until, World};
use serde_json::Value;

mod common;

use common::BIN;
const WAIT: Duration = Duration::from_secs(60);
/// The agents' `--metrics-listen` port, on every address of their node.
const METRICS: u16 = 9464;
/// The relay endpoint's default port (on a hypervisor's VTEP).
const RELAY: u16 = 7444;

fn s<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field].as_str().unwrap_or_else(|| panic!("no {field} in {v}"))
}

/// The guest namespace of VM `vm` (the agents name it from the VM's id).
fn guest_ns(c: &Cluster, vm: &Value) -> String {
    format!("{}{}", c.world.guest_netns_prefix(), &s(vm, "id")[..12])
}

/// A packet counter of `node`'s host rules, read with `nft` in its namespace.
fn dropped(c: &Cluster, node: &str, counter: &str) -> u64 {
    let json = c
        .world
        .exec_ok(
            &c.node(node).unwrap().ns,
            &["nft", "-j", "list", "counters", "table", "inet", "otherix"],
        )
        .unwrap_or_else(|e| panic!("no host rules on {node}: {e}"));
    let doc: Value = serde_json::from_str(&json).unwrap();
    doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .find(|o| o["counter"]["name"] == counter)
        .and_then(|o| o["counter"]["packets"].as_u64())
        .unwrap_or_else(|| panic!("no counter {counter} on {node}: {json}"))
}

/// Whether a TCP connect from guest namespace `netns` to `to` completes within
/// 1.5 s (python3 in the guest: the test's own process stays where it is).
fn guest_connects(c: &Cluster, netns: &str, to: SocketAddr) -> bool {
    let script = "import socket, sys\n\
                  s = socket.socket()\n\
                  s.settimeout(1.5)\n\
                  sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 3)\n";
    let out = c
        .world
        .exec_netns(
            netns,
            &[
                "python3",
                "-c",
                script,
                &to.ip().to_string(),
                &to.port().to_string(),
            ],
        )
        .unwrap();
    match out.status.code() {
        Some(0) => true,
        Some(3) => false,
        _ => panic!("connect probe failed: {}", String::from_utf8_lossy(&out.stderr)),
    }
}

/// A guest's connect to one of `node`'s services is dropped there, and counted.
fn assert_out_of_reach(c: &Cluster, netns: &str, node: &str, to: SocketAddr) {
    let before = dropped(c, node, "guest_to_node_dropped");
    assert!(
        !guest_connects(c, netns, to),
        "a guest reached {node}'s service at {to}"
    );
    assert!(
        dropped(c, node, "guest_to_node_dropped") > before,
        "{node} did not count the guest's attempt at {to}"
    );
}

/// `GET /metrics` of an agent.
fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

/// The value of the sample of `metrics` whose line starts with `series`.
fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// One line through `otherix forward` to `vm`'s echo service, and back: the
/// first connections after a guest starts may meet a gateway that has not
/// programmed its neighbor entry yet, so it is tried until it answers.
fn echo_via_forward(c: &Cluster, vm: &str) {
    let (_fwd, local) = c.forward(vm, 7).expect("otherix forward listens");
    wait_until(
        &format!("an echo from {vm} through otherix forward"),
        WAIT,
        || {
            let mut conn = TcpStream::connect(local).ok()?;
            conn.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
            conn.write_all(b"through the forward\n").ok()?;
            let mut back = [0u8; 20];
            conn.read_exact(&mut back).ok()?;
            (&back == b"through the forward\n").then_some(())
        },
    )
    .unwrap();
}

#[test]
fn guests_reach_no_node_service_while_connect_and_forward_work_through_gateway_and_relay() {
    otherix_testbed::tools::require_programs(&["python3", "nft"]);
    let world = World::new("hostrules").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    spec.gateways = 1;
    spec.extra_agent_args = vec!["--metrics-listen".into(), format!("0.0.0.0:{METRICS}")];
    let c = Cluster::start(world, spec).expect("cluster starts");

    // An overlay guest (reached through gw1) and a bridge guest (through the
    // relay endpoint of node1), both on node1.
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.190.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.191.0.0/24",
        "--node",
        "node1",
    ])
    .unwrap();
    let exec = "otherix guest echo --port 7";
    c.cli_json(&["vm", "create", "ov1", "--network", "ov", "--exec", exec])
        .unwrap();
    c.cli_json(&["vm", "create", "lab1", "--network", "lab", "--exec", exec])
        .unwrap();
    let ov1 = c.wait_vm_running("ov1", WAIT).unwrap();
    let lab1 = c.wait_vm_running("lab1", WAIT).unwrap();

    // Through the gateway and through the relay, with every node's rules in place.
    for node in ["node1", "gw1"] {
        wait_until(&format!("{node}'s host rules"), WAIT, || {
            let out = c
                .world
                .exec(
                    &c.node(node).unwrap().ns,
                    &["nft", "list", "table", "inet", "otherix"],
                )
                .ok()?;
            out.status.success().then_some(())
        })
        .unwrap();
    }
    echo_via_forward(&c, "ov1");
    echo_via_forward(&c, "lab1");
    let child = common::tunnels::connect_process(&c.config, "lab1", 7);
    drop(child);
    let child = common::tunnels::connect_process(&c.config, "ov1", 7);
    drop(child);

    // The bridge guest's default route is its node: the relay endpoint and the
    // metrics of node1 are one hop away, and out of reach.
    let node1 = c.node("node1").unwrap().ns.ip();
    let lab_ns = guest_ns(&c, &lab1);
    assert_out_of_reach(&c, &lab_ns, "node1", SocketAddr::from((node1, RELAY)));
    assert_out_of_reach(&c, &lab_ns, "node1", SocketAddr::from((node1, METRICS)));
    // The agent reads the counter into its metrics.
    let metrics = SocketAddr::from((node1, METRICS));
    wait_until("node1's metrics to show the dropped attempts", WAIT, || {
        let n = sample(&scrape(metrics), "otherix_agent_guest_dropped_total{to=\"node\"}")?;
        (n >= 2.0).then_some(())
    })
    .unwrap();

    // The overlay guest, routed at gw1 through gw1's own lease on the overlay,
    // reaches neither the gateway listener nor gw1's metrics.
    let gw1 = c.node("gw1").unwrap().ns.ip();
    let gw_addrs = c
        .world
        .exec_ok(&c.node("gw1").unwrap().ns, &["ip", "-4", "-o", "addr", "show"])
        .unwrap();
    let gw_lease = gw_addrs
        .lines()
        .find(|l| {
            l.split_whitespace()
                .nth(1)
                .is_some_and(|dev| dev.starts_with("oxb"))
        })
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|cidr| cidr.split('/').next())
        .unwrap_or_else(|| panic!("gw1 has no overlay lease: {gw_addrs}"))
        .to_owned();
    let ov_ns = guest_ns(&c, &ov1);
    c.world
        .exec_netns(
            &ov_ns,
            &["ip", "route", "replace", &format!("{gw1}/32"), "via", &gw_lease],
        )
        .unwrap();
    assert_out_of_reach(&c, &ov_ns, "gw1", SocketAddr::from((gw1, GATEWAY_PORT)));
    assert_out_of_reach(&c, &ov_ns, "gw1", SocketAddr::from((gw1, METRICS)));

    // A route on gw1 that would send the guest's address out of the fabric
    // device: the gateway's dial is bound to the overlay's bridge and still
    // reaches the guest.
    let fabric_dev = gw_addrs
        .lines()
        .find(|l| l.contains(&format!(" {gw1}/")))
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("no fabric device on gw1: {gw_addrs}"))
        .to_owned();
    c.world
        .exec_ok(
            &c.node("gw1").unwrap().ns,
            &[
                "ip",
                "route",
                "add",
                &format!("{}/32", s(&ov1, "ip")),
                "dev",
                &fabric_dev,
            ],
        )
        .unwrap();
    echo_via_forward(&c, "ov1");
}
