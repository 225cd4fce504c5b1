//! The control plane's read model from the outside, against a real CP with
//! nodes speaking the agent protocol: a heartbeat whose applied version is
//! current gets a short `unchanged` answer, and one a change behind the
//! change; a change wakes only the nodes whose desired state it changes;
//! what a client writes it reads back at once; the catalog survives a
//! restart of the CP.

mod common;

use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::fake_node::{empty_heartbeat, enroll_as, rt};
use common::Cp;
use otherix_client::Client;
use otherix_proto::agent::{DesiredState, Heartbeat, NodeRoles};

fn heartbeat(
    client: &Client,
    name: &str,
    vtep: &str,
    applied: Option<u64>,
    accepts_unchanged: bool,
) -> DesiredState {
    beat(client, name, vtep, applied, accepts_unchanged, false)
}

fn beat(
    client: &Client,
    name: &str,
    vtep: &str,
    applied: Option<u64>,
    accepts_unchanged: bool,
    accepts_delta: bool,
) -> DesiredState {
    rt().block_on(client.heartbeat(&Heartbeat {
        node: name.to_string(),
        roles: Some(NodeRoles {
            hypervisor: true,
            gateway: None,
            relay: None,
        }),
        vtep: vtep.to_string(),
        applied_version: applied,
        accepts_unchanged,
        accepts_delta,
        ..empty_heartbeat()
    }))
    .unwrap()
}

#[test]
fn a_current_node_gets_unchanged_and_a_change_wakes_only_the_nodes_it_concerns() {
    let cp = Cp::start();
    let admin = cp.admin();
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    let n2 = enroll_as(&cp, "n2", "10.213.1.12", false);
    admin.ok(&[
        "network",
        "create",
        "net-a",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    admin.ok(&[
        "network",
        "create",
        "net-b",
        "--type",
        "overlay",
        "--subnet",
        "10.101.0.0/24",
    ]);
    heartbeat(&n1, "n1", "10.213.1.11", None, false);
    heartbeat(&n2, "n2", "10.213.1.12", None, false);
    admin.ok(&["vm", "create", "a1", "--network", "net-a", "--node", "n1"]);
    admin.ok(&["vm", "create", "b1", "--network", "net-b", "--node", "n2"]);
    // Two beats each: the first makes them members (a lease), the second
    // carries the overlay.
    let mut v1 = 0;
    let mut v2 = 0;
    for _ in 0..2 {
        v1 = heartbeat(&n1, "n1", "10.213.1.11", None, false).version;
        v2 = heartbeat(&n2, "n2", "10.213.1.12", None, false).version;
    }

    // Current: the short answer, for an agent that asks for it.
    let same = heartbeat(&n1, "n1", "10.213.1.11", Some(v1), true);
    assert!(same.unchanged, "{same:?}");
    assert_eq!(same.version, v1);
    assert!(
        same.overlays.is_empty() && same.guests.is_empty(),
        "nothing but the version"
    );
    // An agent that does not ask gets the whole state, as before.
    let whole = heartbeat(&n1, "n1", "10.213.1.11", Some(v1), false);
    assert!(!whole.unchanged);
    assert_eq!(whole.version, v1);
    assert_eq!(whole.guests.len(), 1);
    // Behind: the whole state.
    let behind = heartbeat(&n1, "n1", "10.213.1.11", Some(v1 ^ 1), true);
    assert!(!behind.unchanged);
    assert_eq!(behind.version, v1);

    // Both wait; a VM on n1's overlay changes n1's state, not n2's.
    let (tx, rx) = mpsc::channel();
    for (name, client, version) in [("n1", n1.clone(), v1), ("n2", n2.clone(), v2)] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            let answer = rt().block_on(client.wait_desired(version));
            let _ = tx.send((name, answer.map(|w| w.changed), Instant::now()));
        });
    }
    // Both waits are held before the change is made.
    std::thread::sleep(Duration::from_millis(500));
    let changed_at = Instant::now();
    admin.ok(&["vm", "create", "a2", "--network", "net-a", "--node", "n1"]);
    let (first, changed, at) = rx.recv_timeout(Duration::from_secs(10)).expect("a wait answered");
    assert_eq!((first, changed.unwrap()), ("n1", true), "n1 is woken");
    assert!(
        at - changed_at < Duration::from_secs(5),
        "within a round trip, not a hold"
    );
    assert!(
        rx.recv_timeout(Duration::from_secs(3)).is_err(),
        "n2's desired state did not change: its wait is still held"
    );
    // A change behind, from an agent that takes changes: the new guest's
    // entries and n1's own part (it hosts the guest), not the rest.
    let delta = beat(&n1, "n1", "10.213.1.11", Some(v1), true, true);
    let change = delta.delta.as_ref().expect("a delta");
    assert_eq!(change.base, v1);
    let own = change.own.as_ref().expect("n1's own part changed: a guest");
    assert_eq!(own.guests.len(), 2);
    assert!(own
        .overlays
        .iter()
        .all(|o| o.fdb.is_empty() && o.neighbors.is_empty()));
    assert_eq!(change.overlays.len(), 1, "{change:?}");
    assert_eq!(change.overlays[0].network, "net-a");
    assert_eq!(
        change.overlays[0].neighbors_added.len(),
        1,
        "the new guest's neighbor entry (it runs here: no FDB entry)"
    );
    let after = heartbeat(&n1, "n1", "10.213.1.11", Some(v1), true);
    assert!(!after.unchanged);
    assert_eq!(after.guests.len(), 2, "the new guest is in n1's state");
    assert_eq!(
        whole.apply(&delta).unwrap(),
        after,
        "the change adds up to the whole state"
    );
    // A version the CP does not know: the whole state, even when asked for a change.
    let unknown = beat(&n1, "n1", "10.213.1.11", Some(v1 ^ 1), true, true);
    assert!(unknown.delta.is_none());
    assert_eq!(unknown, after);
    assert_eq!(
        heartbeat(&n2, "n2", "10.213.1.12", Some(v2), true).version,
        v2,
        "n2's version did not move"
    );
}

#[test]
fn what_a_client_writes_it_reads_back_at_once_and_the_catalog_survives_a_restart() {
    let mut cp = Cp::start();
    let admin = cp.admin();
    admin.ok(&[
        "network",
        "create",
        "net",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    for i in 0..20 {
        let name = format!("web{i:02}");
        admin.ok(&["vm", "create", &name, "--network", "net", "--label", "app=web"]);
        // Read back at once, by the broker's own lookup (not the store's):
        // an unknown VM would be 404, this one is known (and not running).
        let err = admin.fails(&["connect", &name, "22"]);
        assert!(
            err.contains("not running") || err.contains("pending"),
            "{name}: {err}"
        );
    }
    admin.ok(&["lb", "create", "web-lb", "--port", "80", "--selector", "app=web"]);
    let lb = admin.json(&["lb", "get", "web-lb"]);
    assert_eq!(lb["total"], 20, "{lb}");
    admin.ok(&["vm", "label", "web03", "app-"]);
    assert_eq!(
        admin.json(&["lb", "get", "web-lb"])["total"],
        19,
        "a relabel leaves the pool at once"
    );
    admin.ok(&["vm", "delete", "web04"]);
    assert_eq!(admin.json(&["vm", "list"]).as_array().unwrap().len(), 19);

    cp.terminate();
    cp.boot();
    let admin = cp.admin();
    assert_eq!(
        admin.json(&["vm", "list"]).as_array().unwrap().len(),
        19,
        "loaded again at start"
    );
    assert_eq!(admin.json(&["lb", "get", "web-lb"])["total"], 18);
    let net = admin.json(&["network", "get", "net"]);
    assert_eq!(net["vms"], 19, "{net}");
}
