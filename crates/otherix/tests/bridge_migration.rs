//! Bridge networks on several nodes, and bridge VMs migrating between them,
//! as the control plane coordinates it with nodes speaking the agent
//! protocol: the node list (create, add, remove — refused while a node hosts
//! VMs of the network), scheduling among the network's nodes, migration only
//! to a node that has the network, the handover onto the target's own bridge.

mod common;

use common::fake_node::{empty_heartbeat, enroll_as, rt};
use common::{admin_token, curl, Cp};
use otherix_client::Client;
use otherix_proto::agent::{DesiredState, Heartbeat, MigrationReport, NodeRoles};

struct Node<'a> {
    client: Client,
    name: &'a str,
    vtep: &'a str,
}

fn hb(n: &Node, running: &[&str], ready: &[&str], migrations: Vec<MigrationReport>) -> DesiredState {
    rt().block_on(n.client.heartbeat(&Heartbeat {
        node: n.name.into(),
        roles: Some(NodeRoles {
            hypervisor: true,
            gateway: None,
            relay: Some(format!("{}:7444", n.vtep)),
        }),
        vtep: n.vtep.into(),
        guests: otherix_testbed::fake_node::running(running),
        netns: Some(format!("ns-{}", n.name)),
        ready_overlays: ready.iter().map(|s| s.to_string()).collect(),
        migrations,
        ..empty_heartbeat()
    }))
    .unwrap()
}

fn nodes_of(v: &serde_json::Value) -> Vec<&str> {
    v["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect()
}

#[test]
fn a_bridge_network_on_several_nodes_gains_and_loses_nodes_but_not_one_with_its_vms() {
    let cp = Cp::start();
    let admin = cp.admin();
    let lan = admin.json(&[
        "network",
        "create",
        "lan",
        "--type",
        "bridge",
        "--subnet",
        "10.101.0.0/24",
        "--node",
        "n2",
        "--node",
        "n1",
    ]);
    assert_eq!(nodes_of(&lan), ["n1", "n2"]);
    assert_eq!(lan["node"], "n1", "the single-node field names the first");
    let line = admin.ok(&["network", "node", "add", "lan", "n3"]);
    assert_eq!(line.trim(), "network/lan is on nodes n1, n2, n3");
    assert_eq!(
        nodes_of(&admin.json(&["network", "get", "lan"])),
        ["n1", "n2", "n3"]
    );
    let table = admin.ok(&["network", "list"]);
    assert!(table.lines().nth(1).unwrap().contains("n1,n2,n3"), "{table}");
    let get = admin.ok(&["network", "get", "lan"]);
    assert!(get.contains("n1,n2,n3"), "{get}");

    // Scheduling picks among the network's nodes only; --node must be one.
    let err = admin.fails(&["vm", "create", "x", "--network", "lan", "--node", "n9"]);
    assert!(err.contains("bridge on node(s) n1, n2, n3"), "{err}");
    admin.ok(&["vm", "create", "web01", "--network", "lan", "--node", "n1"]);

    let err = admin.fails(&["network", "node", "remove", "lan", "n1"]);
    assert!(
        err.contains("node \"n1\" still hosts 1 VM(s) of network \"lan\" (web01)")
            && err.contains("migrate them"),
        "{err}"
    );
    let out = admin.ok(&["network", "node", "remove", "lan", "n3"]);
    assert_eq!(out.trim(), "network/lan left node n3; it is on nodes n1, n2");
    let err = admin.fails(&["network", "node", "remove", "lan", "n3"]);
    assert!(err.contains("not found"), "{err}");
    admin.ok(&["network", "node", "remove", "lan", "n2"]);
    admin.ok(&["vm", "delete", "web01"]);
    let err = admin.fails(&["network", "node", "remove", "lan", "n1"]);
    assert!(
        err.contains("last node") && err.contains("delete the network"),
        "{err}"
    );

    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.102.0.0/24",
    ]);
    let err = admin.fails(&["network", "node", "add", "ov", "n1"]);
    assert!(err.contains("overlay"), "{err}");
    admin.ok(&["user", "create", "vera", "--role", "viewer"]);
    let vera_token = admin.ok(&["user", "token", "create", "vera"]).trim().to_string();
    let vera = admin.with_token(&vera_token);
    let err = vera.fails(&["network", "node", "add", "lan", "n2"]);
    assert!(err.contains("role viewer may not change networks"), "{err}");

    // Older clients: one `node` in the request still works.
    let token = admin_token(&cp);
    let (status, body) = curl(
        &cp,
        &[
            "-H",
            &format!("Authorization: Bearer {token}"),
            "-H",
            "Content-Type: application/json",
            "-d",
            r#"{"name":"old","type":"bridge","subnet":"10.103.0.0/24","node":"n1"}"#,
            &format!("{}/v1/networks", cp.url),
        ],
    );
    assert_eq!(status, 201, "{body}");
    let old: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!((old["node"].as_str(), nodes_of(&old)), (Some("n1"), vec!["n1"]));
}

#[test]
fn a_bridge_vm_migrates_only_to_a_node_with_its_network_onto_that_nodes_bridge() {
    let cp = Cp::start();
    let admin = cp.admin();
    let node = |name: &'static str, vtep: &'static str| Node {
        client: enroll_as(&cp, name, vtep, name == "gw"),
        name,
        vtep,
    };
    let (n1, n2, n3) = (
        node("n1", "10.213.1.11"),
        node("n2", "10.213.1.12"),
        node("n3", "10.213.1.13"),
    );
    for n in [&n1, &n2, &n3] {
        hb(n, &[], &[], vec![]);
    }
    let lan = admin.json(&[
        "network",
        "create",
        "lan",
        "--type",
        "bridge",
        "--subnet",
        "10.101.0.0/24",
        "--node",
        "n1",
        "--node",
        "n2",
    ]);
    let bridge = format!("oxl{}", &lan["id"].as_str().unwrap()[..8]);
    let vm = admin.json(&["vm", "create", "web01", "--network", "lan", "--node", "n1"]);
    let id = vm["id"].as_str().unwrap().to_string();
    let (mac, ip) = (vm["mac"].clone(), vm["ip"].clone());
    hb(&n1, &[&id], &["lan"], vec![]);
    assert_eq!(admin.json(&["vm", "get", "web01"])["state"], "running");

    // Each node of the network has its own bridge, with the same address.
    let on_n1 = [id.as_str()];
    for n in [&n1, &n2] {
        let (running, ready): (&[&str], &[&str]) = if n.name == "n1" {
            (&on_n1, &["lan"])
        } else {
            (&[], &[])
        };
        let d = hb(n, running, ready, vec![]);
        assert_eq!(d.bridges.len(), 1, "{}", n.name);
        assert_eq!(d.bridges[0].address.to_string(), "10.101.0.1/24");
    }
    assert!(hb(&n3, &[], &[], vec![]).bridges.is_empty());

    let err = admin.fails(&["vm", "migrate", "web01", "--to", "n3"]);
    assert!(
        err.contains("bridge network \"lan\", which node \"n3\" does not have (it exists on n1, n2)")
            && err.contains("otherix network node add lan n3"),
        "{err}"
    );
    assert_eq!(
        admin.json(&["vm", "get", "web01"])["state"],
        "running",
        "refusals change nothing"
    );

    admin.ok(&["vm", "migrate", "web01", "--to", "n2", "--no-wait"]);
    // A node that is a migration's target stays in the network.
    let err = admin.fails(&["network", "node", "remove", "lan", "n2"]);
    assert!(err.contains("still hosts 1 VM(s)"), "{err}");
    let d1 = hb(&n1, &[&id], &["lan"], vec![]);
    assert!(
        d1.guests[0].migrate_to.is_none(),
        "not before n2 reports the bridge realized"
    );
    hb(&n2, &[], &["lan"], vec![]);
    let d1 = hb(&n1, &[&id], &["lan"], vec![]);
    let to = d1.guests[0].migrate_to.clone().expect("hand over now");
    assert_eq!(
        (to.node.as_str(), to.netns.as_str(), to.bridge.as_str()),
        ("n2", "ns-n2", bridge.as_str()),
        "onto the target's own bridge of the network"
    );

    let moved = MigrationReport {
        vm_id: id.clone(),
        outcome: otherix_proto::agent::MigrationOutcome::Moved,
        reason: None,
    };
    let d1 = hb(&n1, &[], &["lan"], vec![moved]);
    assert!(d1.guests.is_empty(), "the source no longer runs it");
    assert_eq!(d1.bridges.len(), 1, "the source keeps its bridge of the network");
    let d2 = hb(&n2, &[&id], &["lan"], vec![]);
    assert_eq!(d2.guests.len(), 1);
    assert_eq!(d2.guests[0].gateway.to_string(), "10.101.0.1");
    let vm = admin.json(&["vm", "get", "web01"]);
    assert_eq!(
        (vm["node"].as_str(), vm["state"].as_str(), &vm["mac"], &vm["ip"]),
        (Some("n2"), Some("running"), &mac, &ip)
    );
    // The source's node left: n1 hosts nothing of lan now.
    admin.ok(&["network", "node", "remove", "lan", "n1"]);
}
