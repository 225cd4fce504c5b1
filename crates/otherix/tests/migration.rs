//! Live migration as the control plane coordinates it, with nodes speaking
//! the agent protocol: the target joins the overlay first, the source is told
//! to hand over only once the target reports the overlay realized, the FDB
//! follows the new placement, refusals and rollbacks are clear.

mod common;

use common::fake_node::{beat, empty_heartbeat, enroll_as, rt};
use common::Cp;
use otherix_client::Client;
use otherix_proto::agent::{DesiredState, Heartbeat, MigrationReport, NodeRoles};

struct Node<'a> {
    client: Client,
    name: &'a str,
    vtep: &'a str,
}

fn hb(n: &Node, running: &[&str], ready: &[&str], migrations: Vec<MigrationReport>) -> DesiredState {
    hb_applied(n, running, ready, migrations, None)
}

/// [`hb`] from an agent that applied version `applied`.
fn hb_applied(
    n: &Node,
    running: &[&str],
    ready: &[&str],
    migrations: Vec<MigrationReport>,
    applied: Option<u64>,
) -> DesiredState {
    rt().block_on(n.client.heartbeat(&Heartbeat {
        applied_version: applied,
        node: n.name.into(),
        roles: Some(NodeRoles {
            hypervisor: n.name != "gw",
            gateway: (n.name == "gw").then(|| format!("{}:8443", n.vtep)),
            relay: None,
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

#[test]
fn a_migration_hands_over_only_to_a_ready_target_and_the_fdb_follows() {
    let cp = Cp::start();
    let admin = cp.admin();
    let node = |name: &'static str, vtep: &'static str| Node {
        client: enroll_as(&cp, name, vtep, name == "gw"),
        name,
        vtep,
    };
    let (n1, n2, gw) = (
        node("n1", "10.213.1.11"),
        node("n2", "10.213.1.12"),
        node("gw", "10.213.1.13"),
    );
    for n in [&n1, &n2, &gw] {
        hb(n, &[], &[], vec![]);
    }
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    let vm = admin.json(&[
        "vm",
        "create",
        "web01",
        "--network",
        "ov",
        "--node",
        "n1",
        "-l",
        "app=web",
    ]);
    let id = vm["id"].as_str().unwrap().to_string();
    let mac = vm["mac"].as_str().unwrap().to_string();
    hb(&n1, &[&id], &["ov"], vec![]);
    assert_eq!(admin.json(&["vm", "get", "web01"])["state"], "running");
    // The gateway joins the overlay (it covers every overlay with placed VMs).
    assert_eq!(hb(&gw, &[], &[], vec![]).overlays.len(), 1);

    let started = admin.json(&["vm", "migrate", "web01", "--to", "n2", "--no-wait"]);
    assert_eq!(
        (started["state"].as_str(), started["migrate_to"].as_str()),
        (Some("migrating"), Some("n2"))
    );
    let err = admin.fails(&["vm", "migrate", "web01", "--to", "n2", "--no-wait"]);
    assert!(err.contains("migrating"), "{err}");

    // The source keeps running it and reporting it; the CP keeps `migrating`.
    let d1 = hb(&n1, &[&id], &["ov"], vec![]);
    assert!(
        d1.guests[0].migrate_to.is_none(),
        "not before the target has the overlay"
    );
    let vm = admin.json(&["vm", "get", "web01"]);
    assert_eq!(vm["state"], "migrating", "{vm}");
    // The target joins the overlay first.
    let d2 = hb(&n2, &[], &[], vec![]);
    assert_eq!(
        d2.overlays.len(),
        1,
        "the target becomes a member before the handover"
    );
    assert!(d2.guests.is_empty());
    hb(&n2, &[], &["ov"], vec![]);
    let d1 = hb(&n1, &[&id], &["ov"], vec![]);
    let to = d1.guests[0].migrate_to.clone().expect("hand over now");
    assert_eq!((to.node.as_str(), to.netns.as_str()), ("n2", "ns-n2"));
    assert!(to.bridge.starts_with("oxb"), "{to:?}");

    // The source reports the handover: placement moves, every member's FDB follows.
    let moved = MigrationReport {
        vm_id: id.clone(),
        outcome: otherix_proto::agent::MigrationOutcome::Moved,
        reason: None,
    };
    let d1 = hb(&n1, &[], &[], vec![moved]);
    assert!(d1.guests.is_empty(), "the source no longer runs it");
    // It forwards what still arrives for the guest, to the target's VTEP,
    // and stays a member of the overlay meanwhile.
    assert_eq!(
        d1.overlays.len(),
        1,
        "the source stays a member while it forwards"
    );
    assert_eq!(
        d1.forwards
            .iter()
            .map(|f| (f.network.as_str(), f.mac.to_string(), f.vtep.to_string()))
            .collect::<Vec<_>>(),
        vec![("ov", mac.clone(), "10.213.1.12".to_string())]
    );
    let vm = admin.json(&["vm", "get", "web01"]);
    assert_eq!(
        (vm["node"].as_str(), vm["mac"].as_str(), vm["ip"].as_str()),
        (Some("n2"), Some(mac.as_str()), Some("10.100.0.2"))
    );
    let dg = hb(&gw, &[], &[], vec![]);
    let entry = dg.overlays[0]
        .fdb
        .iter()
        .find(|e| e.mac.to_string() == mac)
        .expect("gateway FDB entry");
    assert_eq!(
        entry.vtep.to_string(),
        "10.213.1.12",
        "frames for the guest now go to the target's VTEP"
    );
    let d2 = hb(&n2, &[&id], &["ov"], vec![]);
    assert_eq!(d2.guests.len(), 1);
    assert_eq!(admin.json(&["vm", "get", "web01"])["state"], "running");
    assert_eq!(admin.json(&["vm", "get", "web01"])["labels"]["app"], "web");

    // Not applied by the other members yet: the source still forwards.
    let d1 = hb(&n1, &[], &[], vec![]);
    assert_eq!(d1.forwards.len(), 1, "{d1:?}");
    // Once the gateway has applied where the guest is, it ends, and the
    // source leaves the overlay.
    let d1 = hb_applied(&gw, &[], &[], vec![], Some(dg.version));
    assert_eq!(
        d1.version, dg.version,
        "the gateway's state did not change meanwhile"
    );
    let d1 = hb(&n1, &[], &[], vec![]);
    assert!(d1.forwards.is_empty(), "{:?}", d1.forwards);
    assert!(d1.overlays.is_empty(), "the source left the overlay");
}

#[test]
fn migrations_are_refused_or_rolled_back_with_a_reason() {
    let cp = Cp::start();
    let admin = cp.admin();
    let node = |name: &'static str, vtep: &'static str| Node {
        client: enroll_as(&cp, name, vtep, name == "gw"),
        name,
        vtep,
    };
    let (n1, n2, gw) = (
        node("n1", "10.213.1.11"),
        node("n2", "10.213.1.12"),
        node("gw", "10.213.1.13"),
    );
    enroll_as(&cp, "silent", "10.213.1.19", false);
    for n in [&n1, &n2, &gw] {
        hb(n, &[], &[], vec![]);
    }
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    admin.ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.101.0.0/24",
        "--node",
        "n1",
    ]);
    let id = admin.json(&["vm", "create", "web01", "--network", "ov", "--node", "n1"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let lab = admin.json(&["vm", "create", "lab01", "--network", "lab"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    hb(&n1, &[&id, &lab], &["ov"], vec![]);

    let err = admin.fails(&["vm", "migrate", "web01", "--to", "silent"]);
    assert!(err.contains("NotReady"), "{err}");
    let err = admin.fails(&["vm", "migrate", "web01", "--to", "gw"]);
    assert!(err.contains("not a hypervisor"), "{err}");
    let err = admin.fails(&["vm", "migrate", "web01", "--to", "n1"]);
    assert!(err.contains("already runs on n1"), "{err}");
    let err = admin.fails(&["vm", "migrate", "lab01", "--to", "n2"]);
    assert!(
        err.contains("which node \"n2\" does not have (it exists on n1)"),
        "{err}"
    );
    let err = admin.fails(&["vm", "migrate", "ghost", "--to", "n2"]);
    assert!(err.contains("not found"), "{err}");
    assert_eq!(
        admin.json(&["vm", "get", "web01"])["state"],
        "running",
        "refusals change nothing"
    );

    // The source fails the handover: rolled back, the guest stays where it was.
    admin.ok(&["vm", "migrate", "web01", "--to", "n2", "--no-wait"]);
    hb(&n2, &[], &["ov"], vec![]);
    let failed = MigrationReport {
        vm_id: id.clone(),
        outcome: otherix_proto::agent::MigrationOutcome::Failed,
        reason: Some("veth busy".into()),
    };
    hb(&n1, &[&id], &["ov"], vec![failed]);
    let vm = admin.json(&["vm", "get", "web01"]);
    assert_eq!(
        (vm["state"].as_str(), vm["node"].as_str()),
        (Some("running"), Some("n1"))
    );
    assert!(
        vm["reason"].as_str().unwrap().contains("rolled back: veth busy"),
        "{vm}"
    );
    let _ = beat;
}

#[test]
fn a_waiting_node_is_answered_when_its_desired_state_changes() {
    let cp = Cp::start();
    let admin = cp.admin();
    let node = |name: &'static str, vtep: &'static str| Node {
        client: enroll_as(&cp, name, vtep, name == "gw"),
        name,
        vtep,
    };
    let (n1, gw) = (node("n1", "10.213.1.11"), node("gw", "10.213.1.13"));
    hb(&n1, &[], &[], vec![]);
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    let id = admin.json(&["vm", "create", "web01", "--network", "ov", "--node", "n1"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    hb(&n1, &[&id], &["ov"], vec![]);
    let seen = hb(&gw, &[], &[], vec![]).version;

    // A version the node no longer has is answered at once.
    let stale = rt().block_on(gw.client.wait_desired(seen ^ 1)).unwrap();
    assert_eq!((stale.changed, stale.version), (true, seen));

    // A wait on the current version is answered by a write that changes the
    // node's desired state (a new VM: a new neighbor entry on the gateway),
    // with the version the next heartbeat brings.
    let client = gw.client.clone();
    let waiting = std::thread::spawn(move || rt().block_on(client.wait_desired(seen)).unwrap());
    admin.ok(&["vm", "create", "web02", "--network", "ov", "--node", "n1"]);
    let woken = waiting.join().unwrap();
    assert!(woken.changed, "{woken:?}");
    assert_eq!(woken.version, hb(&gw, &[], &[], vec![]).version);

    // Only over mutual TLS, as a node.
    let err = rt()
        .block_on(
            otherix_client::Client::new(&cp.url, &cp.ca_pem(), Some(common::admin_token(&cp)))
                .unwrap()
                .wait_desired(seen),
        )
        .unwrap_err();
    assert!(err.to_string().contains("client certificate"), "{err}");
}
