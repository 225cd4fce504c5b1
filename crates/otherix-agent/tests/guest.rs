//! The netns guest runtime in real namespaces: creation, drift repair, removal,
//! re-adoption after a restart, workloads, and moving a guest's wire between nodes.
//! Needs root.

mod common;

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use common::{mac, payload, sh, sock, transfer, TwoNodes, World};
use otherix_agent::net::{fmt_mac, netns, BridgeSpec, Change, IfAddr, NeighborEntry, Netlink, Netns};
use otherix_agent::runtime::{
    spawn_in_netns, Backoff, GuestRuntime, GuestSpec, NetnsLauncher, NetnsRuntime, RuntimeError, Supervisor,
    SupervisorEvent, Workload, WorkloadState,
};

/// A node namespace with a host-local bridge network `br0` (10.214.t.1/24).
async fn bridge_node(world: &World, t: u8) -> (String, Netlink, NetnsRuntime) {
    let ns = world.create_ns("n");
    let nl = Netlink::connect_in(&Netns::open(&ns).unwrap()).unwrap();
    let spec = BridgeSpec {
        bridge: "br0".into(),
        mtu: 1500,
        address: Some(IfAddr::new(Ipv4Addr::new(10, 214, t, 1), 24)),
        mac: None,
        neighbors: (1..=2)
            .map(|n| NeighborEntry::new(Ipv4Addr::new(10, 214, t, 10 + n), mac(t.into(), 10 + n)))
            .collect(),
    };
    assert!(!nl.reconcile_bridge_network(&spec).await.unwrap().is_empty());
    assert_eq!(nl.reconcile_bridge_network(&spec).await.unwrap(), vec![]);
    let runtime = NetnsRuntime::new(nl.clone(), world.name("g")).unwrap();
    (ns, nl, runtime)
}

fn guest(world: &World, t: u8, n: u8) -> GuestSpec {
    GuestSpec {
        id: format!("guest-{n}"),
        netns: world.name(&format!("g{n}")),
        host_veth: format!("hv{n}"),
        bridge: "br0".into(),
        mac: mac(t.into(), 10 + n),
        ip: Ipv4Addr::new(10, 214, t, 10 + n),
        prefix: 24,
        gateway: Ipv4Addr::new(10, 214, t, 1),
        mtu: 1500,
        command: None,
        qemu: None,
    }
}

/// Waits (bounded) until `cond` holds.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn ensure_is_idempotent_and_repairs_a_removed_veth_without_touching_the_workload() {
    let w = TwoNodes::new(10).await;
    let a = &w.a;
    // Healthy: nothing to do.
    assert_eq!(a.runtime.ensure(&a.guest).await.unwrap(), vec![]);
    let eth0 = sh(&format!("ip -n {} link show eth0", a.guest.netns));
    assert!(eth0.contains(&fmt_mac(&a.guest.mac)), "{eth0}");

    let log = w.world.tmp.join("a.log");
    let mut workload = spawn_in_netns(&a.guest.netns, &["sleep".into(), "300".into()], &log).unwrap();

    // Drift 1: the veth is deleted by hand (both ends go).
    sh(&format!("ip -n {} link del hva", a.netns));
    let changes = a.runtime.ensure(&a.guest).await.unwrap();
    assert!(
        changes.contains(&Change::LinkCreated {
            link: format!("hva (netns {})", a.netns)
        }),
        "{changes:#?}"
    );
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::DefaultRouteSet { .. })),
        "{changes:#?}"
    );
    assert!(
        !changes.iter().any(|c| matches!(c, Change::NetnsCreated { .. })),
        "{changes:#?}"
    );
    // Drift 2: eth0's MAC and MTU changed by hand.
    sh(&format!(
        "ip -n {} link set eth0 address 02:00:00:00:00:42 mtu 1400",
        a.guest.netns
    ));
    let changes = a.runtime.ensure(&a.guest).await.unwrap();
    for what in ["mac", "mtu"] {
        assert!(
            changes
                .iter()
                .any(|c| matches!(c, Change::LinkUpdated { what: w, .. } if *w == what)),
            "{what}: {changes:#?}"
        );
    }
    // Drift 3: eth0 taken down (which also flushes its routes).
    sh(&format!("ip -n {} link set eth0 down", a.guest.netns));
    let changes = a.runtime.ensure(&a.guest).await.unwrap();
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::LinkUpdated { what: "up", .. })),
        "{changes:#?}"
    );
    assert!(
        changes
            .iter()
            .any(|c| matches!(c, Change::DefaultRouteSet { .. })),
        "{changes:#?}"
    );
    assert_eq!(a.runtime.ensure(&a.guest).await.unwrap(), vec![]);

    // The workload never noticed: same process, still running, same namespace.
    assert_eq!(workload.try_wait().unwrap(), None);
    assert_eq!(netns::pids(&a.guest.netns).unwrap(), vec![workload.id() as i32]);
    let eth0 = sh(&format!("ip -n {} addr show eth0", a.guest.netns));
    assert!(
        eth0.contains(&format!("inet {}/24", a.guest.ip)) && eth0.contains("mtu 1450"),
        "{eth0}"
    );
    transfer(
        &w.b.guest.netns,
        &a.guest.netns,
        sock(a.guest.ip, 7100),
        b"after repair",
    );
    workload.kill().unwrap();
    workload.wait().unwrap();
}

#[tokio::test]
async fn removing_a_guest_removes_its_namespace_veth_and_processes() {
    let world = World::new(11);
    let (ns, nl, runtime) = bridge_node(&world, 11).await;
    let g = guest(&world, 11, 1);
    let changes = runtime.ensure(&g).await.unwrap();
    assert!(
        changes.contains(&Change::NetnsCreated {
            netns: g.netns.clone()
        }),
        "{changes:#?}"
    );
    // A host-local bridge network carries TCP from the node to the guest.
    transfer(&ns, &g.netns, sock(g.ip, 7110), &payload(100_000));
    assert_eq!(nl.neighbor_mac("br0", g.ip).await.unwrap(), Some(g.mac));

    let log = world.tmp.join("g1.log");
    let mut child = spawn_in_netns(&g.netns, &["sleep".into(), "300".into()], &log).unwrap();
    assert!(runtime
        .state(&g.id)
        .await
        .unwrap()
        .is_some_and(|s| s.is_running()));

    let changes = runtime.remove(&g.id).await.unwrap();
    assert_eq!(
        changes,
        vec![
            Change::LinkDeleted {
                link: format!("hv1 (netns {ns})")
            },
            Change::NetnsDeleted {
                netns: g.netns.clone()
            },
        ]
    );
    // The workload was killed...
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(9));
    // ... and the namespace and both veth ends are gone.
    assert!(!sh("ip netns list").contains(&g.netns));
    assert!(!netns::exists(&g.netns));
    assert!(nl.link("hv1").await.unwrap().is_none());
    assert!(runtime.state(&g.id).await.unwrap().is_none());
    // Removing again is a no-op, not an error.
    assert_eq!(runtime.remove(&g.id).await.unwrap(), vec![]);
}

#[tokio::test]
async fn a_restarted_runtime_lists_and_readopts_its_guests() {
    let world = World::new(12);
    let (ns, _nl, runtime) = bridge_node(&world, 12).await;
    let (g1, g2) = (guest(&world, 12, 1), guest(&world, 12, 2));
    runtime.ensure(&g1).await.unwrap();
    runtime.ensure(&g2).await.unwrap();
    // A namespace with our prefix but no guest record (a crash mid-creation).
    let stray = world.name("g9");
    netns::create(&stray).unwrap();
    drop(runtime);

    // "Agent restart": a new connection and a new runtime, no state carried over.
    let nl = Netlink::connect_in(&Netns::open(&ns).unwrap()).unwrap();
    let runtime = NetnsRuntime::new(nl, world.name("g")).unwrap();
    let mut found = runtime.list().await.unwrap();
    found.sort_by(|x, y| x.netns.cmp(&y.netns));
    let summary: Vec<_> = found
        .iter()
        .map(|g| (g.id.clone(), g.netns.clone(), g.host_veth.clone()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (Some(g1.id.clone()), g1.netns.clone(), Some(g1.host_veth.clone())),
            (Some(g2.id.clone()), g2.netns.clone(), Some(g2.host_veth.clone())),
            (None, stray.clone(), None),
        ]
    );
    // Adopted as they are: healthy guests need no change.
    assert_eq!(runtime.ensure(&g1).await.unwrap(), vec![]);
    assert_eq!(runtime.ensure(&g2).await.unwrap(), vec![]);
    transfer(&g1.netns, &g2.netns, sock(g2.ip, 7120), b"still connected");
    // The record-less namespace can still be cleaned up.
    let changes = runtime.purge(&found[2]).await.unwrap();
    assert_eq!(changes, vec![Change::NetnsDeleted { netns: stray.clone() }]);
    assert_eq!(runtime.list().await.unwrap().len(), 2);
}

#[tokio::test]
async fn supervised_workload_runs_inside_the_guest_and_is_restarted_after_a_crash() {
    let world = World::new(13);
    let (_ns, _nl, runtime) = bridge_node(&world, 13).await;
    let mut g = guest(&world, 13, 1);
    g.command = Some(vec![
        "sh".into(),
        "-c".into(),
        "readlink /proc/self/ns/net; cat /proc/net/dev; echo started >&2; exec sleep 300".into(),
    ]);
    runtime.ensure(&g).await.unwrap();
    let log = world.tmp.join("logs/guest-1.log");
    let backoff = Backoff {
        initial: Duration::from_millis(100),
        ..Backoff::default()
    };
    let mut sup = Supervisor::new(NetnsLauncher, backoff);
    let events = sup.ensure(Workload::for_guest(&g, &log).unwrap(), Instant::now());
    let [SupervisorEvent::Started { pid, .. }] = events[..] else {
        panic!("{events:?}");
    };
    eventually("the workload's log", || {
        std::fs::read_to_string(&log).is_ok_and(|l| l.contains("started"))
    });
    let out = std::fs::read_to_string(&log).unwrap();
    // It runs in the guest's namespace: its own netns inode, and only lo and eth0.
    let ino = std::fs::metadata(format!("{}/{}", netns::NETNS_DIR, g.netns))
        .unwrap()
        .ino();
    assert!(out.contains(&format!("net:[{ino}]")), "{out}");
    assert!(
        out.contains("eth0:") && !out.contains("br0:") && !out.contains("hv1:"),
        "{out}"
    );
    assert!(sup.is_running(&g.id));
    assert_eq!(
        runtime.state(&g.id).await.unwrap().unwrap().pids,
        vec![pid as i32]
    );

    // It crashes: noticed at the next tick, restarted after the backoff, again inside.
    sh(&format!("kill -9 {pid}"));
    let exited_at = loop {
        let now = Instant::now();
        if sup
            .tick(now)
            .iter()
            .any(|e| matches!(e, SupervisorEvent::Exited { .. }))
        {
            break now;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let Some(WorkloadState::Waiting { until, .. }) = sup.state(&g.id) else {
        panic!("{:?}", sup.state(&g.id));
    };
    assert_eq!(until - exited_at, Duration::from_millis(100));
    let events = sup.tick(until);
    let [SupervisorEvent::Started { pid: new_pid, .. }] = events[..] else {
        panic!("{events:?}");
    };
    eventually("the restarted workload in the guest", || {
        netns::pids(&g.netns).unwrap() == vec![new_pid as i32]
    });
    assert!(matches!(
        sup.state(&g.id),
        Some(WorkloadState::Running { restarts: 1, .. })
    ));

    // Stopping it leaves the guest's network in place.
    assert!(sup.stop(&g.id).is_some());
    assert!(!sup.is_running(&g.id));
    assert!(netns::pids(&g.netns).unwrap().is_empty());
    assert_eq!(runtime.ensure(&g).await.unwrap(), vec![]);
}

#[tokio::test]
async fn moving_the_host_veth_to_another_node_keeps_a_tcp_stream_alive() {
    let w = TwoNodes::new(14).await;
    let (a, b) = (&w.a, &w.b);
    // What the guest sees of its own NIC (its peer's index may change on the move).
    let guest_nic = || sh(&format!("ip -n {} -o addr show dev eth0", a.guest.netns));
    let eth0_before = guest_nic();

    // An echo server in guest A, a client in guest B: the stream crosses the overlay.
    let listener = common::listen_in(&a.guest.netns, sock(a.guest.ip, 7140));
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = s.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            s.write_all(&buf[..n]).unwrap();
        }
    });
    let mut client = common::connect_from(&b.guest.netns, sock(a.guest.ip, 7140));
    let mut round_trip = |tag: u8| {
        let data: Vec<u8> = payload(256 * 1024).into_iter().map(|x| x ^ tag).collect();
        let writer = {
            let mut c = client.try_clone().unwrap();
            let data = data.clone();
            std::thread::spawn(move || c.write_all(&data).unwrap())
        };
        let mut back = vec![0u8; data.len()];
        client.read_exact(&mut back).unwrap();
        writer.join().unwrap();
        assert!(back == data, "echo differs (round {tag})");
    };
    round_trip(1);

    // Migrate: guest A's wire moves to node B's bridge; the control plane repoints
    // guest A's MAC to node B's VTEP on every member.
    let to = Netns::open(&b.netns).unwrap();
    // The hook runs once the veth has left, and only when it moves.
    let hooked = std::cell::Cell::new(0);
    let hook = async || {
        assert!(
            a.nl.link("hva").await.unwrap().is_none(),
            "the veth has left when the hook runs"
        );
        hooked.set(hooked.get() + 1);
    };
    let changes = a
        .runtime
        .move_host_veth(&a.guest, &to, "br0", hook)
        .await
        .unwrap();
    assert_eq!(hooked.get(), 1);
    assert_eq!(
        changes[0],
        Change::LinkMoved {
            link: format!("hva (netns {})", a.netns),
            to_netns: b.netns.clone()
        }
    );
    for n in [a, b] {
        let mut spec = w.overlay(n);
        for e in &mut spec.fdb {
            if e.mac == a.guest.mac {
                e.vtep = b.vtep;
            }
        }
        n.nl.reconcile_overlay(&spec).await.unwrap();
    }
    assert!(b.nl.link("hva").await.unwrap().is_some_and(|l| l.up));
    assert!(a.nl.link("hva").await.unwrap().is_none());
    // Idempotent: moving again only checks it is enslaved and up.
    assert_eq!(
        a.runtime
            .move_host_veth(&a.guest, &to, "br0", async || hooked.set(hooked.get() + 1))
            .await
            .unwrap(),
        vec![]
    );
    assert_eq!(hooked.get(), 1, "no hook when nothing moved");

    // The same TCP connection keeps working, and the guest's namespace is untouched.
    round_trip(2);
    round_trip(3);
    assert_eq!(guest_nic(), eth0_before);
    client.shutdown(std::net::Shutdown::Write).unwrap();
    server.join().unwrap();
}

#[tokio::test]
async fn one_request_moves_the_host_veth_onto_the_target_bridge_up_with_its_mtu() {
    let w = TwoNodes::new(16).await;
    let (a, b) = (&w.a, &w.b);
    sh(&format!("ip -n {} link set hva mtu 1400", a.netns));
    let br0 = b.nl.link("br0").await.unwrap().unwrap().index;
    a.nl.move_link_onto("hva", &Netns::open(&b.netns).unwrap(), br0, a.guest.mtu)
        .await
        .unwrap();
    // Nothing else was asked of the target: the kernel did it all in the move.
    assert!(a.nl.link("hva").await.unwrap().is_none());
    let there =
        b.nl.link("hva")
            .await
            .unwrap()
            .expect("the veth is on the target");
    assert_eq!(there.controller, Some(br0), "enslaved to the target's bridge");
    assert!(there.up, "up");
    assert_eq!(there.mtu, Some(a.guest.mtu));
    assert!(
        sh(&format!("ip -n {} link show eth0", a.guest.netns)).contains("LOWER_UP"),
        "the guest's eth0 has its carrier back"
    );
}

#[tokio::test]
async fn a_guest_attached_elsewhere_is_reported_not_torn_away() {
    let w = TwoNodes::new(15).await;
    let (a, b) = (&w.a, &w.b);
    a.runtime
        .move_host_veth(&a.guest, &Netns::open(&b.netns).unwrap(), "br0", async || {})
        .await
        .unwrap();
    // Node A's runtime still believes it hosts guest A: it must not rip out the NIC.
    let err = a.runtime.ensure(&a.guest).await.unwrap_err();
    assert!(matches!(err, RuntimeError::AttachedElsewhere { .. }), "{err}");
    assert!(sh(&format!("ip -n {} link show eth0", a.guest.netns)).contains("UP"));
    assert!(b.nl.link("hva").await.unwrap().is_some());
}

#[tokio::test]
async fn a_veth_handed_over_to_a_node_is_arriving_there_from_the_moment_it_moves() {
    let w = TwoNodes::new(17).await;
    let (a, b) = (&w.a, &w.b);
    // Node B's runtime with node A's guest prefix, as agents on one host share one.
    let on_b = NetnsRuntime::new(b.nl.clone(), w.world.name("ga")).unwrap();
    assert!(
        !on_b.arriving("hva", &b.netns).await.unwrap(),
        "a guest at home is not arriving anywhere"
    );
    a.runtime
        .move_host_veth(&a.guest, &Netns::open(&b.netns).unwrap(), "br0", async || {})
        .await
        .unwrap();
    // Asked after the move, with no earlier listing: the record is read now.
    assert!(on_b.arriving("hva", &b.netns).await.unwrap());
    assert!(
        !on_b.arriving("hva", &a.netns).await.unwrap(),
        "handed to B, not to A"
    );
    assert!(
        !on_b.arriving("hvb", &b.netns).await.unwrap(),
        "no guest of this prefix names that veth"
    );
    // B takes the guest in: its `ensure` writes the plain record back.
    on_b.ensure(&a.guest).await.unwrap();
    assert!(!on_b.arriving("hva", &b.netns).await.unwrap(), "arrived");
    assert!(b.nl.link("hva").await.unwrap().is_some());
}
