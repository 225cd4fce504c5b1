//! Multi-node end-to-end tests on the testbed: a CP, two hypervisor nodes
//! and one standalone gateway, each in its own network namespace with a
//! real agent, guests realized as namespaces by the agents.

use std::time::Duration;

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_otherix");
const WAIT: Duration = Duration::from_secs(60);

fn cluster(hint: &str) -> Cluster {
    let world = World::new(hint).expect("a testbed world (needs root)");
    Cluster::start(world, ClusterSpec::new(BIN)).expect("cluster starts")
}

fn vm(c: &Cluster, args: &[&str]) -> Value {
    let mut argv = vec!["vm", "create"];
    argv.extend(args);
    c.cli_json(&argv).unwrap()
}

/// The guest namespace the agents make for a VM.
fn guest_ns(c: &Cluster, vm: &Value) -> String {
    format!(
        "{}{}",
        c.world.guest_netns_prefix(),
        &vm["id"].as_str().unwrap()[..12]
    )
}

fn curl_from(c: &Cluster, node: &str, url: &str) -> Option<String> {
    let out = c.exec_on(node, &["curl", "-s", "--max-time", "3", url]).ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn curl_from_guest(c: &Cluster, netns: &str, url: &str) -> Option<String> {
    let out = c
        .world
        .exec_netns(netns, &["curl", "-s", "--max-time", "3", url])
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn shell_on(c: &Cluster, node: &str, script: &str) -> String {
    let out = c.exec_on(node, &["sh", "-c", script]).unwrap();
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn overlay_guests_on_two_nodes_reach_each_other_and_the_gateway_reaches_every_guest() {
    let c = cluster("overlay");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.120.0.0/24",
    ])
    .unwrap();
    let a = vm(
        &c,
        &[
            "a",
            "--network",
            "ov",
            "--node",
            "node1",
            "--exec",
            "otherix guest http --port 8080",
        ],
    );
    let b = vm(
        &c,
        &[
            "b",
            "--network",
            "ov",
            "--node",
            "node2",
            "--exec",
            "otherix guest http --port 8080",
        ],
    );
    for name in ["a", "b"] {
        c.wait_vm_running(name, WAIT).unwrap();
    }
    let (a_ip, b_ip) = (a["ip"].as_str().unwrap(), b["ip"].as_str().unwrap());
    let got = wait_until("a to reach b over VXLAN", WAIT, || {
        curl_from_guest(&c, &guest_ns(&c, &a), &format!("http://{b_ip}:8080/"))
    })
    .unwrap();
    assert_eq!(got, "b");
    let got = curl_from_guest(&c, &guest_ns(&c, &b), &format!("http://{a_ip}:8080/")).unwrap();
    assert_eq!(got, "a");
    // The gateway node reaches every overlay guest from its own overlay address.
    for (ip, name) in [(a_ip, "a"), (b_ip, "b")] {
        let got = wait_until("the gateway to reach a guest", WAIT, || {
            curl_from(&c, "gw1", &format!("http://{ip}:8080/"))
        })
        .unwrap();
        assert_eq!(got, name);
    }
    let gw = c.cli_json(&["node", "get", "gw1"]).unwrap();
    assert_eq!(gw["overlays"], serde_json::json!(["ov"]));

    // 1 MiB both ways through an echo guest on the other hypervisor: full-size
    // frames cross VXLAN (MTU sized for its 50 bytes).
    let e = vm(
        &c,
        &[
            "e",
            "--network",
            "ov",
            "--node",
            "node2",
            "--exec",
            "otherix guest echo --port 7",
        ],
    );
    c.wait_vm_running("e", WAIT).unwrap();
    let script = format!(
        "import socket, hashlib, threading\n\
         data = bytes(range(256)) * 4096\n\
         s = socket.create_connection(('{}', 7), timeout=20)\n\
         t = threading.Thread(target=lambda: (s.sendall(data), s.shutdown(socket.SHUT_WR)))\n\
         t.start()\n\
         got = b''\n\
         while True:\n\
         \x20   chunk = s.recv(65536)\n\
         \x20   if not chunk: break\n\
         \x20   got += chunk\n\
         t.join()\n\
         print('ok' if hashlib.sha256(got).digest() == hashlib.sha256(data).digest() else 'mismatch %d' % len(got))\n",
        e["ip"].as_str().unwrap()
    );
    let out = wait_until("1 MiB echoed over the overlay", WAIT, || {
        let o = c.exec_on("node1", &["python3", "-c", &script]).ok()?;
        let text = String::from_utf8_lossy(&o.stdout).trim().to_string();
        (!text.is_empty()).then_some(text)
    })
    .unwrap();
    assert_eq!(out, "ok");
}

#[test]
fn a_bridge_guest_is_reachable_from_its_node_only() {
    let c = cluster("bridge");
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.121.0.0/24",
        "--node",
        "node1",
    ])
    .unwrap();
    let lab = vm(
        &c,
        &[
            "lab01",
            "--network",
            "lab",
            "--exec",
            "otherix guest http --port 8080",
        ],
    );
    assert_eq!(lab["node"], "node1");
    c.wait_vm_running("lab01", WAIT).unwrap();
    let url = format!("http://{}:8080/", lab["ip"].as_str().unwrap());
    let got = wait_until("node1 to reach its bridge guest", WAIT, || {
        curl_from(&c, "node1", &url)
    })
    .unwrap();
    assert_eq!(got, "lab01");
    assert_eq!(
        curl_from(&c, "node2", &url),
        None,
        "another node has no path to a bridge guest"
    );
    assert_eq!(curl_from(&c, "gw1", &url), None);
}

#[test]
fn deleting_vms_and_networks_removes_their_kernel_state_everywhere_and_drift_is_repaired() {
    let c = cluster("cleanup");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.122.0.0/24",
    ])
    .unwrap();
    let a = vm(
        &c,
        &[
            "a",
            "--network",
            "ov",
            "--node",
            "node1",
            "--exec",
            "otherix guest http --port 8080",
        ],
    );
    vm(&c, &["b", "--network", "ov", "--node", "node2"]);
    c.wait_vm_running("a", WAIT).unwrap();
    c.wait_vm_running("b", WAIT).unwrap();
    let mac = a["mac"].as_str().unwrap().to_string();
    let vni = c.cli_json(&["network", "get", "ov"]).unwrap()["vni"]
        .as_u64()
        .unwrap();
    let vx = format!("oxv{vni}");

    // Every other member has an FDB entry for a's MAC.
    for node in ["node2", "gw1"] {
        wait_until("a's FDB entry on every member", WAIT, || {
            shell_on(&c, node, &format!("bridge fdb show dev {vx}"))
                .contains(&mac)
                .then_some(())
        })
        .unwrap();
    }

    // Drift: an FDB entry deleted by hand is back after a sync.
    // The VXLAN device's own entry for a's MAC: `MAC dst VTEP self permanent`.
    let vxlan_entry = |node: &str| -> Option<String> {
        shell_on(&c, node, &format!("bridge fdb show dev {vx}"))
            .lines()
            .find(|l| l.starts_with(&mac) && l.contains(" dst "))
            .and_then(|l| l.split(" dst ").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_string)
    };
    let dst = vxlan_entry("gw1").expect("gw1 points a's MAC at node1's VTEP");
    assert_eq!(dst, c.node("node1").unwrap().ns.ip().to_string());
    let del = c
        .exec_on(
            "gw1",
            &["bridge", "fdb", "del", &mac, "dev", &vx, "dst", &dst, "self"],
        )
        .unwrap();
    assert!(del.status.success(), "{}", String::from_utf8_lossy(&del.stderr));
    wait_until("the deleted FDB entry to be repaired", WAIT, || {
        vxlan_entry("gw1").filter(|d| *d == dst)
    })
    .unwrap();

    let a_ns = guest_ns(&c, &a);
    c.cli_ok(&["vm", "delete", "a"]).unwrap();
    wait_until(
        "a's namespace, veth, FDB and neighbor entries to go",
        WAIT,
        || {
            let ns_gone = !shell_on(&c, "node1", "ip netns list").contains(&a_ns);
            // Our entries: the VXLAN device's static ones and permanent neighbors
            // (what the bridge learned from traffic ages out on its own).
            let fdb_gone = ["node2", "gw1"].iter().all(|n| vxlan_entry(n).is_none());
            let neigh_gone = ["node1", "node2", "gw1"]
                .iter()
                .all(|n| !shell_on(&c, n, "ip neigh show nud permanent").contains(&mac));
            let veth_gone = !shell_on(&c, "node1", "ip -o link show")
                .contains(&format!("oxh{}", &a["id"].as_str().unwrap()[..10]));
            (ns_gone && fdb_gone && neigh_gone && veth_gone).then_some(())
        },
    )
    .unwrap();

    c.cli_ok(&["vm", "delete", "b"]).unwrap();
    c.cli_ok(&["network", "delete", "ov"]).unwrap();
    wait_until(
        "the overlay's bridge and VXLAN device to go from every node",
        WAIT,
        || {
            ["node1", "node2", "gw1"]
                .iter()
                .all(|n| {
                    let links = shell_on(&c, n, "ip -o link show");
                    !links.contains(&vx) && !links.contains(&format!("oxb{vni}"))
                })
                .then_some(())
        },
    )
    .unwrap();
}

#[test]
fn agent_restart_keeps_guests_and_open_connections_and_cp_restart_loses_nothing() {
    let mut c = cluster("restart");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.123.0.0/24",
    ])
    .unwrap();
    let e = vm(
        &c,
        &[
            "echo1",
            "--network",
            "ov",
            "--node",
            "node1",
            "--exec",
            "otherix guest echo --port 7",
        ],
    );
    c.wait_vm_running("echo1", WAIT).unwrap();
    let ip = e["ip"].as_str().unwrap().to_string();

    // A client on the gateway node holds one TCP connection into the guest,
    // sends a line before and one after the agent restart.
    let go = c.world_dir().join("go");
    let script = format!(
        "import socket, os, time\n\
         s = socket.create_connection(('{ip}', 7), timeout=30)\n\
         s.sendall(b'one\\n'); assert s.recv(16) == b'one\\n'; print('first ok', flush=True)\n\
         while not os.path.exists('{go}'): time.sleep(0.05)\n\
         s.sendall(b'two\\n'); assert s.recv(16) == b'two\\n'; print('second ok', flush=True)\n",
        go = go.display()
    );
    let gw_ns = c.node("gw1").unwrap().ns.clone();
    let client = wait_until("a connection into the guest", WAIT, || {
        let p = c
            .world
            .spawn(Some(&gw_ns), "python3", ["-c", &script], &[])
            .ok()?;
        p.wait_for_log("first ok", Duration::from_secs(5)).ok().map(|_| p)
    })
    .unwrap();

    c.kill_agent("node1").unwrap();
    c.start_agent("node1").unwrap();
    c.wait_ready(WAIT).unwrap();
    std::fs::write(&go, b"").unwrap();
    client.wait_for_log("second ok", Duration::from_secs(20)).unwrap();

    // CP killed and restarted: nodes come back Ready, nothing is lost.
    let before = c.cli_json(&["vm", "list"]).unwrap();
    c.kill_cp().unwrap();
    c.start_cp().unwrap();
    c.wait_ready(WAIT).unwrap();
    let after = c.cli_json(&["vm", "list"]).unwrap();
    assert_eq!(before, after);
}

#[test]
fn teardown_leaves_no_namespace_interface_or_process() {
    let c = cluster("teardown");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.124.0.0/24",
    ])
    .unwrap();
    vm(
        &c,
        &["t1", "--network", "ov", "--exec", "otherix guest echo --port 7"],
    );
    c.wait_vm_running("t1", WAIT).unwrap();
    let prefix = c.world.prefix().to_string();
    assert!(
        !World::leftovers(&prefix).is_empty(),
        "the world exists while the cluster runs"
    );
    drop(c);
    assert_eq!(World::leftovers(&prefix), Vec::<String>::new());
}
