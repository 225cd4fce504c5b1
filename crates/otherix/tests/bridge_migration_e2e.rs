//! A bridge VM migrating between two nodes of its bridge network, end to end
//! on the testbed: a CP and two hypervisors run by the real agents, the
//! network on both (each node with a bridge of its own, the same subnet and
//! node-side address), an echo guest reached through the CP's relay with the
//! real clients (`otherix forward`, `otherix connect`).
//!
//! Resumable relay sessions (what the CLI opens) follow the migration: the
//! agent hands the guest's TCP connection over with TCP repair and the
//! client resumes through the new node. A plain relay session (a WebSocket
//! client that does not ask to resume) ends at once with a reason the client
//! prints. New sessions reach the guest on its new node. The guest itself moves as an overlay guest does
//! (the host end of its veth into the target's namespace, onto the target's
//! bridge): its workload keeps running, same processes. The test builds its
//! own world; everything is torn down on drop.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, Proc, World};
use serde_json::Value;

mod common;

use common::BIN;
const WAIT: Duration = Duration::from_secs(60);

/// What the client prints when the relay ends a session because the VM moved.
const MOVED: &str = "relay session ended: vm echo1 moved to another node (node2); connect again";

/// `otherix forward VM PORT` in the host namespace; returns it and its local address.
fn forward(c: &Cluster, vm: &str, port: u16) -> (Proc, SocketAddr) {
    c.forward(vm, port).expect("otherix forward listens")
}

/// A plain relay session to `vm:port` (the library's tunnel that does not
/// ask to resume), brokered as the admin.
fn plain_relay(c: &Cluster, vm: &str, port: u16) -> otherix_client::tunnel::AnyTunnel {
    let ca = std::fs::read_to_string(c.ca_file()).unwrap();
    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    let admin = otherix_client::Client::new(&c.url, &ca, Some(token.trim().to_string())).unwrap();
    let rt = common::tunnels::rt();
    let grant = rt
        .block_on(admin.broker(&otherix_proto::BrokerRequest {
            target: vm.into(),
            port: port.into(),
            exclude: Vec::new(),
        }))
        .unwrap();
    rt.block_on(otherix_client::tunnel::relay::open(
        &c.url,
        &ca,
        &grant.credential,
    ))
    .map(otherix_client::tunnel::AnyTunnel::Relay)
    .unwrap()
}

/// A connection through the forward that has echoed `line` back.
fn echo_connection(addr: SocketAddr, line: &[u8]) -> Option<TcpStream> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(line).ok()?;
    let mut back = vec![0u8; line.len()];
    s.read_exact(&mut back).ok()?;
    (back == line).then_some(s)
}

/// Processes in the guest's namespace (the workload), seen from the host.
fn guest_pids(c: &Cluster, vm: &Value) -> Vec<String> {
    let id = vm["id"].as_str().unwrap();
    let netns = format!("{}{}", c.world.guest_netns_prefix(), &id[..id.len().min(12)]);
    let out = Command::new("ip")
        .args(["netns", "pids", &netns])
        .output()
        .unwrap();
    assert!(out.status.success(), "ip netns pids {netns}: {out:?}");
    let mut pids: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    pids.sort();
    pids
}

/// The bridge (`master`) the guest's host veth hangs on in `node`'s
/// namespace, if it is there.
fn host_veth_master(c: &Cluster, node: &str, vm: &Value) -> Option<String> {
    let id = vm["id"].as_str().unwrap();
    let veth = format!("oxh{}", &id[..10]);
    let ns = &c.node(node).unwrap().ns;
    let out = c.world.exec(ns, &["ip", "-o", "link", "show", &veth]).unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut words = text.split_whitespace();
    words.find(|w| *w == "master")?;
    words.next().map(str::to_owned)
}

#[test]
fn relay_sessions_follow_a_migrated_bridge_vm_a_plain_one_ends_with_a_clear_error_and_new_ones_work() {
    let world = World::new("bridge-migrate").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 2;
    spec.gateways = 0;
    let c = Cluster::start(world, spec).expect("cluster starts");

    let lan = c
        .cli_json(&[
            "network",
            "create",
            "lan",
            "--type",
            "bridge",
            "--subnet",
            "10.186.0.0/24",
            "--node",
            "node1",
            "--node",
            "node2",
        ])
        .unwrap();
    assert_eq!(lan["nodes"], serde_json::json!(["node1", "node2"]), "{lan}");
    let bridge = format!("oxl{}", &lan["id"].as_str().unwrap()[..8]);
    c.cli_json(&[
        "vm",
        "create",
        "echo1",
        "--network",
        "lan",
        "--node",
        "node1",
        "--exec",
        "otherix guest echo --port 7",
    ])
    .unwrap();
    let vm = c.wait_vm_running("echo1", WAIT).unwrap();
    assert_eq!(
        host_veth_master(&c, "node1", &vm).as_deref(),
        Some(bridge.as_str())
    );

    let (fwd, local) = forward(&c, "echo1", 7);
    wait_until("echo1:7 to answer through the relay", WAIT, || {
        echo_connection(local, b"ping\n").map(drop)
    })
    .unwrap();

    // Sessions open while it moves: two that resume (through the forward,
    // and by `otherix connect`) and one plain relay session (a WebSocket
    // client that does not ask to resume).
    let mut session = echo_connection(local, b"before the move\n").expect("a session through the forward");
    let mut connect = common::tunnels::connect_process(&c.config, "echo1", 7);
    let mut plain = plain_relay(&c, "echo1", 7);
    common::tunnels::echo_through(&mut plain, b"plain, before the move\n");
    let pids = guest_pids(&c, &vm);
    assert!(!pids.is_empty(), "the workload runs");

    let started = Instant::now();
    c.cli_ok(&["vm", "migrate", "echo1", "--to", "node2"]).unwrap();
    let moved = c.wait_vm_running("echo1", WAIT).unwrap();
    assert_eq!(
        (moved["node"].as_str(), &moved["ip"], &moved["mac"]),
        (Some("node2"), &vm["ip"], &vm["mac"]),
        "{moved}"
    );
    eprintln!("migrated in {:?}", started.elapsed());

    // The resumable sessions went with the guest: the same connections
    // answer on node2.
    session.write_all(b"after the move\n").unwrap();
    let mut back = vec![0u8; b"after the move\n".len()];
    session.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    session.read_exact(&mut back).unwrap();
    assert_eq!(back, b"after the move\n");
    {
        use std::io::BufRead;
        connect
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"connect, after the move\n")
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(connect.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "connect, after the move\n");
    }
    drop(connect.stdin.take());
    let out = connect.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("relay: resumed"), "{stderr}");
    fwd.wait_for_log("relay: resumed", WAIT).unwrap();

    // The plain one ends, with one clear line.
    let (err, took) = common::tunnels::read_until_error(&mut plain);
    eprintln!("the plain session ended after {took:?}: {err}");
    assert_eq!(err.to_string(), MOVED);

    // New connections reach the guest on node2, onto node2's own bridge.
    assert_eq!(
        host_veth_master(&c, "node2", &moved).as_deref(),
        Some(bridge.as_str())
    );
    assert_eq!(
        host_veth_master(&c, "node1", &moved),
        None,
        "nothing left on node1"
    );
    wait_until("echo1:7 to answer on node2", WAIT, || {
        echo_connection(local, b"after the move\n").map(drop)
    })
    .unwrap();
    let mut again = common::tunnels::connect_process(&c.config, "echo1", 7);
    drop(again.stdin.take());
    let status = wait_until("otherix connect to end", Duration::from_secs(30), || {
        again.try_wait().unwrap()
    })
    .unwrap();
    assert!(status.success(), "a new otherix connect works end to end");

    assert_eq!(
        guest_pids(&c, &moved),
        pids,
        "the workload kept running: same processes"
    );
    let node = c.cli_json(&["node", "get", "node2"]).unwrap();
    assert_eq!(node["guests"], 1, "{node}");
}
