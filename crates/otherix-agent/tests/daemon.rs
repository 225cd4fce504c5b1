//! The daemon's reconciler against real namespaces, without a control plane: a desired
//! state in, kernel objects, workloads and guest statuses out. Covers idempotency,
//! re-adoption of running workloads by a restarted agent, crash loops, removal of
//! what is no longer desired, and overlays on the underlay that holds the VTEP.
//! Needs root.

mod common;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{sh, sock, transfer, World};
use otherix_agent::daemon::{host, Reconciler, ReconcilerConfig, Underlay, UnderlayError};
use otherix_agent::net::{netns, Netlink, Netns};
use otherix_agent::runtime::Backoff;
use otherix_agent::runtime::QemuConfig;
use otherix_proto::agent::{
    BridgeState, DesiredState, GuestState, GuestStatus, MigrateTo, MigrationOutcome, OverlayState,
};
use otherix_proto::VmState;

const NET_ID: &str = "0badc0ffee000001";
const BRIDGE: &str = "oxl0badc0ff";

fn vm_id(n: u8) -> String {
    format!("{n:02x}{}", "a1".repeat(15))
}

fn guest(t: u8, n: u8, exec: Option<&str>) -> GuestState {
    GuestState {
        incoming: Default::default(),
        machine: None,
        vm_id: vm_id(n),
        name: format!("vm{n}"),
        network: "lab".into(),
        network_id: NET_ID.into(),
        mac: format!("02:00:0a:d6:{t:02x}:{:02x}", 10 + n).parse().unwrap(),
        address: format!("10.214.{t}.{}/24", 10 + n).parse().unwrap(),
        gateway: format!("10.214.{t}.1").parse().unwrap(),
        exec: exec.map(Into::into),
        migrate_to: None,
    }
}

/// A bridge network `lab` (10.214.t.0/24) with `guests`.
fn desired(t: u8, version: u64, guests: Vec<GuestState>) -> DesiredState {
    DesiredState {
        version,
        node: "n1".into(),
        mtu: 1500,
        bridges: vec![BridgeState {
            network: "lab".into(),
            network_id: NET_ID.into(),
            subnet: format!("10.214.{t}.0/24").parse().unwrap(),
            address: format!("10.214.{t}.1/24").parse().unwrap(),
        }],
        guests,
        ..Default::default()
    }
}

struct Node {
    world: World,
    ns: String,
    nl: Netlink,
    config: ReconcilerConfig,
}

impl Node {
    fn new(testno: u32) -> Node {
        let world = World::new(testno);
        let ns = world.create_ns("n");
        let nl = Netlink::connect_in(&Netns::open(&ns).unwrap()).unwrap();
        let config = ReconcilerConfig {
            netns_prefix: world.name("g"),
            guest_dir: world.tmp.join("guests"),
            workload_path: None,
            backoff: Backoff {
                initial: Duration::from_millis(50),
                max: Duration::from_millis(200),
                reset_after: Duration::from_secs(10),
                stop_grace: Duration::from_millis(500),
            },
            unrecorded_grace: Duration::from_secs(1),
            handover_patience: Duration::from_secs(1),
            qemu: QemuConfig::new(world.tmp.join("qemu")),
        };
        Node {
            world,
            ns,
            nl,
            config,
        }
    }

    /// A fresh reconciler, as a (re)started agent makes.
    fn reconciler(&self) -> Reconciler {
        Reconciler::new(self.nl.clone(), self.config.clone()).unwrap()
    }

    fn guest_ns(&self, n: u8) -> String {
        format!("{}{}", self.config.netns_prefix, &vm_id(n)[..12])
    }

    fn log(&self, n: u8) -> PathBuf {
        self.config.guest_dir.join(format!("{}.log", vm_id(n)))
    }
}

fn no_underlay() -> Result<Underlay, UnderlayError> {
    Err(UnderlayError::NoOverlay)
}

fn status_of(rec: &Reconciler, n: u8) -> GuestStatus {
    rec.statuses()
        .into_iter()
        .find(|s| s.vm_id == vm_id(n))
        .expect("a status for every desired guest")
}

/// Supervises until `cond` holds (bounded).
fn supervise_until(rec: &mut Reconciler, what: &str, mut cond: impl FnMut(&Reconciler) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        rec.supervise(Instant::now());
        if cond(rec) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn link_exists(ns: &str, link: &str) -> bool {
    std::process::Command::new("ip")
        .args(["-n", ns, "link", "show", link])
        .output()
        .unwrap()
        .status
        .success()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn desired_guests_come_up_running_and_a_second_round_changes_nothing() {
    let node = Node::new(30);
    let t = 30;
    let mut rec = node.reconciler();
    let d = desired(t, 1, vec![guest(t, 1, Some("sleep 300")), guest(t, 2, None)]);

    let round = rec.apply(&d, &no_underlay()).await;
    assert_eq!(round.errors, 0);
    assert!(round.changes > 0);
    assert_eq!(rec.applied_version(), Some(1));
    for n in [1, 2] {
        let s = status_of(&rec, n);
        assert_eq!((s.state, s.reason), (VmState::Running, None), "guest {n}");
    }
    let pids = rec.workload_pids(&vm_id(1));
    assert_eq!(pids.len(), 1);
    assert!(
        netns::pids(&node.guest_ns(1)).unwrap().contains(&pids[0]),
        "workload runs in the guest"
    );
    let env = std::fs::read_to_string(format!("/proc/{}/environ", pids[0])).unwrap();
    assert!(env.split('\0').any(|v| v == "OTHERIX_VM_NAME=vm1"), "{env:?}");
    assert!(env
        .split('\0')
        .any(|v| v == format!("OTHERIX_VM_ID={}", vm_id(1))));

    // Level-triggered: the same state again is a no-op.
    let round = rec.apply(&d, &no_underlay()).await;
    assert_eq!((round.changes, round.errors), (0, 0));
    assert_eq!(rec.workload_pids(&vm_id(1)), pids, "workload untouched");

    // The node reaches the guest over the bridge network; its neighbor is permanent.
    let ip = Ipv4Addr::new(10, 214, t, 12);
    transfer(
        &node.ns,
        &node.guest_ns(2),
        sock(ip, 7000),
        &common::payload(64 * 1024),
    );
    let neigh = sh(&format!("ip -n {} neigh show dev {BRIDGE} {ip}", node.ns));
    assert!(neigh.contains("PERMANENT"), "{neigh}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_adopts_the_running_workload_instead_of_starting_another() {
    let node = Node::new(31);
    let t = 31;
    let d = desired(t, 1, vec![guest(t, 1, Some("sleep 300"))]);
    let (leader, before) = {
        let mut rec = node.reconciler();
        assert_eq!(rec.apply(&d, &no_underlay()).await.errors, 0);
        let pids = rec.workload_pids(&vm_id(1));
        assert_eq!(pids.len(), 1, "one supervised process: the `sh -c` leader");
        // Give `sh` time to fork `sleep`, so the guest holds its whole workload.
        std::thread::sleep(Duration::from_millis(100));
        (pids[0], netns::pids(&node.guest_ns(1)).unwrap())
        // The reconciler is dropped here, as when the agent is killed.
    };
    assert!(
        before.contains(&leader),
        "workload outlives the agent: {before:?}"
    );

    let mut rec = node.reconciler();
    let round = rec.apply(&d, &no_underlay()).await;
    assert_eq!(
        (round.changes, round.errors),
        (0, 0),
        "a healthy guest is not touched"
    );
    assert_eq!(rec.workload_pids(&vm_id(1)), before, "adopted, not restarted");
    assert_eq!(status_of(&rec, 1).state, VmState::Running);
    for _ in 0..5 {
        rec.supervise(Instant::now());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(netns::pids(&node.guest_ns(1)).unwrap(), before, "no second copy");

    // Once the adopted processes are gone, the workload is started again, supervised.
    nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(leader),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    supervise_until(&mut rec, "a new workload process", |r| {
        let p = r.workload_pids(&vm_id(1));
        p.len() == 1 && !before.contains(&p[0])
    });
    assert_eq!(status_of(&rec, 1).state, VmState::Running);

    // A changed exec replaces an adopted workload.
    let new_pid = rec.workload_pids(&vm_id(1))[0];
    drop(rec);
    let mut rec = node.reconciler();
    let changed = desired(t, 2, vec![guest(t, 1, Some("sleep 301"))]);
    assert_eq!(rec.apply(&changed, &no_underlay()).await.errors, 0);
    let p = rec.workload_pids(&vm_id(1));
    assert!(p.len() == 1 && p[0] != new_pid, "{p:?}");
    let cmdline = std::fs::read_to_string(format!("/proc/{}/cmdline", p[0])).unwrap();
    assert!(cmdline.contains("sleep 301"), "{cmdline:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_that_keeps_exiting_fails_the_guest_with_its_exit_status() {
    let node = Node::new(32);
    let t = 32;
    let mut rec = node.reconciler();
    let d = desired(t, 1, vec![guest(t, 1, Some("echo starting; exit 3"))]);
    assert_eq!(rec.apply(&d, &no_underlay()).await.errors, 0);
    supervise_until(&mut rec, "a failed status", |r| {
        status_of(r, 1).state == VmState::Failed
    });
    let s = status_of(&rec, 1);
    assert_eq!(s.reason.as_deref(), Some("workload keeps exiting (exit code 3)"));
    let log = std::fs::read_to_string(node.log(1)).unwrap();
    assert!(log.matches("starting").count() >= 3, "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_is_no_longer_desired_is_removed_and_strays_with_our_names_too() {
    let node = Node::new(33);
    let t = 33;
    let mut rec = node.reconciler();
    let both = desired(t, 1, vec![guest(t, 1, Some("sleep 300")), guest(t, 2, None)]);
    assert_eq!(rec.apply(&both, &no_underlay()).await.errors, 0);
    let pid = rec.workload_pids(&vm_id(1))[0];

    // Strays: a link with one of our prefixes, a half-made guest namespace.
    sh(&format!("ip -n {} link add oxhdeadbeef00 type bridge", node.ns));
    let stray = format!("{}stray", node.config.netns_prefix);
    netns::create(&stray).unwrap();

    let one = desired(t, 2, vec![guest(t, 2, None)]);
    assert_eq!(rec.apply(&one, &no_underlay()).await.errors, 0);
    assert!(!netns::exists(&node.guest_ns(1)), "guest 1's namespace is gone");
    // A namespace without its record may be one another agent is building: it
    // stays for the grace, and goes once it has been record-less that long.
    assert!(
        netns::exists(&stray),
        "the record-less namespace waits for its grace"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(rec.apply(&one, &no_underlay()).await.errors, 0);
    assert!(!netns::exists(&stray), "the stray namespace is gone");
    assert!(!link_exists(&node.ns, &format!("oxh{}", &vm_id(1)[..10])));
    assert!(!link_exists(&node.ns, "oxhdeadbeef00"));
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists() || {
            // A zombie until its parent (this test process) reaps it: not running.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit_once(") ")
                .is_none_or(|(_, rest)| rest.starts_with('Z'))
        }
    );
    assert!(netns::exists(&node.guest_ns(2)), "guest 2 stays");
    assert_eq!(rec.statuses().len(), 1);

    // No guests, no network: the bridge goes too.
    let empty = DesiredState {
        version: 3,
        node: "n1".into(),
        mtu: 1500,
        ..Default::default()
    };
    assert_eq!(rec.apply(&empty, &no_underlay()).await.errors, 0);
    assert!(!netns::exists(&node.guest_ns(2)));
    assert!(!link_exists(&node.ns, BRIDGE));
    drop(node.world);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlays_ride_the_interface_that_holds_the_vtep() {
    let node = Node::new(34);
    let t = 34u8;
    sh(&format!(
        "ip -n {ns} link add fab0 type veth peer name fab1 && ip -n {ns} link set fab1 up && ip -n {ns} addr add 10.213.{t}.1/24 dev fab0 && ip -n {ns} link set fab0 up",
        ns = node.ns
    ));
    let vtep = Ipv4Addr::new(10, 213, t, 1);
    let underlay = host::find_underlay(&node.nl, vtep).await;
    assert_eq!(
        underlay.as_ref().ok(),
        Some(&Underlay {
            vtep,
            device: "fab0".into()
        })
    );
    let elsewhere = Ipv4Addr::new(10, 213, t, 99);
    assert!(matches!(
        host::find_underlay(&node.nl, elsewhere).await,
        Err(UnderlayError::NotFound(ip)) if ip == elsewhere
    ));

    let d = DesiredState {
        version: 1,
        node: "n1".into(),
        mtu: 1450,
        overlays: vec![OverlayState {
            network: "web".into(),
            network_id: "0badc0ffee000002".into(),
            vni: 4242,
            subnet: format!("10.214.{t}.0/24").parse().unwrap(),
            address: format!("10.214.{t}.4/24").parse().unwrap(),
            mac: "02:00:00:00:42:01".parse().unwrap(),
            fdb: vec![otherix_proto::agent::FdbEntry {
                mac: "02:00:00:00:42:02".parse().unwrap(),
                vtep: format!("10.213.{t}.2").parse().unwrap(),
            }],
            neighbors: vec![],
        }],
        guests: vec![GuestState {
            network: "web".into(),
            network_id: "0badc0ffee000002".into(),
            ..guest(t, 1, None)
        }],
        ..Default::default()
    };
    let mut rec = node.reconciler();
    let round = rec.apply(&d, &underlay).await;
    assert_eq!(round.errors, 0);
    let br = sh(&format!("ip -n {} -d link show oxb4242", node.ns));
    assert!(
        br.contains("02:00:00:00:42:01") && br.contains("mtu 1450"),
        "{br}"
    );
    let vx = sh(&format!("ip -n {} -d link show oxv4242", node.ns));
    assert!(vx.contains("vxlan id 4242") && vx.contains("dev fab0"), "{vx}");
    // No flood-and-learn, not even by the bridge: the CP's FDB is the only truth.
    assert!(vx.contains("bridge_slave") && vx.contains("learning off"), "{vx}");
    let fdb = sh(&format!("bridge -n {} fdb show dev oxv4242", node.ns));
    assert!(fdb.contains("02:00:00:00:42:02 dst 10.213.34.2"), "{fdb}");
    assert_eq!(status_of(&rec, 1).state, VmState::Running);
    assert_eq!(rec.apply(&d, &underlay).await, Default::default(), "converged");

    // Without an underlay the overlay is reported, and nothing already built is torn down.
    let round = rec.apply(&d, &Err(UnderlayError::VtepUnknown)).await;
    assert_eq!(round.errors, 1);
    assert!(link_exists(&node.ns, "oxb4242") && link_exists(&node.ns, "oxv4242"));
    assert_eq!(rec.applied_version(), Some(1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_sharing_a_guest_prefix_never_remove_each_others_guests() {
    let a = Node::new(35);
    let t = 35;
    // A second node namespace in the same world, with the same guest prefix.
    let b_ns = a.world.create_ns("m");
    let b_nl = Netlink::connect_in(&Netns::open(&b_ns).unwrap()).unwrap();
    let mut b = Reconciler::new(b_nl, a.config.clone()).unwrap();

    let mut rec = a.reconciler();
    let d = desired(t, 1, vec![guest(t, 1, Some("sleep 300"))]);
    assert_eq!(rec.apply(&d, &no_underlay()).await.errors, 0);
    // Let `sh -c` fork its `sleep` before taking the snapshot.
    std::thread::sleep(Duration::from_millis(100));
    let pids = netns::pids(&a.guest_ns(1)).unwrap();

    // Node b wants no guests: it sees a's guest under the shared prefix, and leaves it.
    let empty = DesiredState {
        version: 9,
        node: "n2".into(),
        mtu: 1500,
        ..Default::default()
    };
    assert_eq!(b.apply(&empty, &no_underlay()).await.errors, 0);
    assert!(netns::exists(&a.guest_ns(1)), "a's guest survives b's reconcile");
    assert_eq!(
        netns::pids(&a.guest_ns(1)).unwrap(),
        pids,
        "and so does its workload"
    );
    assert_eq!(
        rec.apply(&d, &no_underlay()).await,
        Default::default(),
        "a sees nothing to repair"
    );
}

/// A handover to a target that has not built the guest's bridge yet (or has just
/// torn a stale one down) is no failure: the source waits, says nothing to the
/// control plane, and moves the guest once the bridge is there. Only a target that
/// stays unready past the patience fails the migration.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handover_waits_for_its_targets_bridge_and_fails_only_past_its_patience() {
    let a = Node::new(36);
    let t = 36;
    let b_ns = a.world.create_ns("m");
    let b_nl = Netlink::connect_in(&Netns::open(&b_ns).unwrap()).unwrap();
    let mut b = Reconciler::new(b_nl, a.config.clone()).unwrap();
    let mut rec = a.reconciler();
    let guests = vec![guest(t, 1, Some("sleep 300")), guest(t, 2, Some("sleep 300"))];
    assert_eq!(
        rec.apply(&desired(t, 1, guests.clone()), &no_underlay())
            .await
            .errors,
        0
    );
    let veth1 = otherix_agent::daemon::names::host_veth(&vm_id(1));
    assert!(link_exists(&a.ns, &veth1));

    // Guest 1 goes to b, whose bridge does not exist yet; guest 2 to a namespace that never will.
    let mut moving = guests.clone();
    moving[0].migrate_to = Some(MigrateTo {
        qemu: None,
        node: "n2".into(),
        netns: b_ns.clone(),
        bridge: BRIDGE.into(),
    });
    moving[1].migrate_to = Some(MigrateTo {
        qemu: None,
        node: "n3".into(),
        netns: a.world.name("gone"),
        bridge: BRIDGE.into(),
    });
    let d2 = desired(t, 2, moving);
    let started = Instant::now();
    rec.apply(&d2, &no_underlay()).await;
    assert!(rec.migrations().is_empty(), "{:?}", rec.migrations());
    assert!(rec.handover_waiting());
    assert!(
        link_exists(&a.ns, &veth1),
        "nothing moved while the target is not ready"
    );

    // b realizes the network; the next round hands guest 1 over.
    let mut on_b = desired(t, 7, Vec::new());
    on_b.node = "n2".into();
    assert_eq!(b.apply(&on_b, &no_underlay()).await.errors, 0);
    rec.apply(&d2, &no_underlay()).await;
    let report = |rec: &Reconciler, n: u8| rec.migrations().into_iter().find(|m| m.vm_id == vm_id(n));
    assert_eq!(report(&rec, 1).map(|m| m.outcome), Some(MigrationOutcome::Moved));
    assert!(link_exists(&b_ns, &veth1), "guest 1's veth is on the target");
    assert_eq!(report(&rec, 2), None, "guest 2 still waits");

    // Past the patience, guest 2's migration is reported failed, with the reason.
    let failed = loop {
        rec.apply(&d2, &no_underlay()).await;
        if let Some(m) = report(&rec, 2) {
            break m;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "guest 2 never reported"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(started.elapsed() >= a.config.handover_patience);
    assert_eq!(failed.outcome, MigrationOutcome::Failed);
    assert!(
        failed
            .reason
            .as_deref()
            .unwrap_or("")
            .contains(&a.world.name("gone")),
        "{failed:?}"
    );
    assert!(!rec.handover_waiting());
}
