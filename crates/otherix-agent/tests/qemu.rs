//! The QEMU runtime with real QEMU guests in a real namespace: boot on a
//! bridge with the lease's MAC and IP, answer HTTP, adoption by a new runtime
//! (an agent restart), restart after a crash, removal. Needs root and
//! `qemu-system-x86_64`; skipped with a message where QEMU is not installed.

mod common;

use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{mac, World};
use otherix_agent::net::{BridgeSpec, Change, IfAddr, Netlink, Netns};
use otherix_agent::runtime::qemu::{image, AccelChoice, QemuView};
use otherix_agent::runtime::{GuestSpec, QemuConfig, QemuRuntime, QemuSpec};

fn qemu_installed() -> bool {
    let found = std::process::Command::new(otherix_agent::runtime::qemu::QEMU)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipped: qemu-system-x86_64 is not installed (Debian: apt-get install qemu-system-x86)");
    }
    found
}

/// The shared image cache; the image is built once per machine (under its lock).
async fn image_cache() -> PathBuf {
    let cache = image::default_cache_dir();
    let c = cache.clone();
    tokio::task::spawn_blocking(move || image::ensure(&c, image::DEFAULT_IMAGE, &mut |_| {}))
        .await
        .unwrap()
        .expect("the guest image builds");
    cache
}

fn guest(t: u8) -> (GuestSpec, QemuSpec) {
    (
        GuestSpec {
            id: format!("qemu-guest-{t}"),
            netns: "unused".into(),
            host_veth: format!("tap{t}"),
            bridge: "br0".into(),
            mac: mac(t.into(), 11),
            ip: Ipv4Addr::new(10, 214, t, 11),
            prefix: 24,
            gateway: Ipv4Addr::new(10, 214, t, 1),
            mtu: 1500,
            command: None,
            qemu: Some(QemuSpec {
                hostname: format!("vm{t}"),
                memory_mib: 256,
                cpus: 1,
                image: image::DEFAULT_IMAGE.into(),
                ssh_keys: vec![],
            }),
        },
        QemuSpec {
            hostname: format!("vm{t}"),
            memory_mib: 256,
            cpus: 1,
            image: image::DEFAULT_IMAGE.into(),
            ssh_keys: vec![],
        },
    )
}

/// `GET path` from inside `ns`, or the error.
/// Namespace `ns` as a node: bridge `br0` at `address`/24, and a QEMU
/// runtime (TCG, QEMU `binary`) keeping its guests under the world's
/// directory.
async fn node_runtime(
    world: &World,
    ns: &str,
    address: Ipv4Addr,
    binary: &str,
) -> (Netlink, QemuRuntime, QemuConfig) {
    let nl = Netlink::connect_in(&Netns::open(ns).unwrap()).unwrap();
    nl.reconcile_bridge_network(&BridgeSpec {
        bridge: "br0".into(),
        mtu: 1500,
        address: Some(IfAddr::new(address, 24)),
        mac: None,
        neighbors: vec![],
    })
    .await
    .unwrap();
    let config = QemuConfig {
        migration_bandwidth: Default::default(),
        migration_downtime: otherix_agent::runtime::qemu::DEFAULT_MIGRATION_DOWNTIME,
        state_dir: world.tmp.join("qemu"),
        image_cache: image_cache().await,
        accel: AccelChoice::Tcg,
        binary: binary.into(),
    };
    (nl.clone(), QemuRuntime::new(nl, config.clone()), config)
}

fn http_get(ns: &str, ip: Ipv4Addr, path: &str) -> Result<String, String> {
    let path = path.to_owned();
    Netns::open(ns)
        .unwrap()
        .run(move || -> Result<String, String> {
            let mut s = std::net::TcpStream::connect_timeout(&(ip, 80).into(), Duration::from_secs(2))
                .map_err(|e| e.to_string())?;
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            write!(s, "GET {path} HTTP/1.0\r\nHost: guest\r\n\r\n").map_err(|e| e.to_string())?;
            let mut out = String::new();
            s.read_to_string(&mut out).map_err(|e| e.to_string())?;
            Ok(out)
        })
        .unwrap()
}

/// Waits until the guest answers HTTP with `want` in the body (boot under TCG
/// takes seconds; bounded at 90 s for a loaded machine).
fn wait_http(ns: &str, ip: Ipv4Addr, want: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        match http_get(ns, ip, "/") {
            Ok(body) if body.contains(want) => return body,
            other => assert!(Instant::now() < deadline, "guest never answered HTTP: {other:?}"),
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qemu_guest_boots_on_its_bridge_is_adopted_restarted_and_removed() {
    if !qemu_installed() {
        return;
    }
    let world = World::new(60);
    let ns = world.create_ns("n");
    let (nl, runtime, config) = node_runtime(
        &world,
        &ns,
        Ipv4Addr::new(10, 214, 60, 1),
        otherix_agent::runtime::qemu::QEMU,
    )
    .await;
    let (spec, q) = guest(60);

    // Boot: QEMU starts with its tap on the bridge, the guest takes the lease.
    let changes = runtime.ensure(&spec, &q).await.unwrap();
    assert!(
        changes.iter().any(|c| matches!(c, Change::QemuStarted { .. })),
        "{changes:?}"
    );
    let pid = runtime.pid(&spec.id).expect("QEMU runs");
    let tap = nl.link("tap60").await.unwrap().expect("the tap exists");
    let bridge = nl.link("br0").await.unwrap().unwrap();
    assert_eq!(tap.controller, Some(bridge.index), "the tap is on the bridge");
    assert!(wait_http(&ns, spec.ip, "hello from vm60").starts_with("HTTP/1."));
    assert!(matches!(runtime.view(&spec.id), QemuView::Running { .. }));
    // The guest's NIC carries the lease's MAC: the bridge learned it on the tap.
    let fdb = common::sh(&format!("ip -n {ns} -br neigh show 10.214.60.11"));
    assert!(fdb.contains(&otherix_agent::net::fmt_mac(&spec.mac)), "{fdb}");

    // An agent restart: a new runtime adopts the running QEMU, starts nothing.
    drop(runtime);
    let runtime = QemuRuntime::new(nl.clone(), config.clone());
    let changes = runtime.ensure(&spec, &q).await.unwrap();
    assert!(changes.is_empty(), "adopted as it was: {changes:?}");
    assert_eq!(runtime.pid(&spec.id), Some(pid));
    let listed = runtime.list().unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].pid, Some(pid));

    // A crash: reported, then started again after its backoff.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while runtime.pid(&spec.id).is_some() {
        assert!(Instant::now() < deadline, "QEMU did not die");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let changes = runtime.ensure(&spec, &q).await.unwrap();
    assert!(changes.is_empty(), "not at once: backoff first ({changes:?})");
    assert_eq!(runtime.view(&spec.id), QemuView::Starting("QEMU ended".into()));
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let changes = runtime.ensure(&spec, &q).await.unwrap();
        if changes.iter().any(|c| matches!(c, Change::QemuStarted { .. })) {
            break;
        }
        assert!(Instant::now() < deadline, "QEMU was not started again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let new_pid = runtime.pid(&spec.id).expect("QEMU runs again");
    assert_ne!(new_pid, pid);
    wait_http(&ns, spec.ip, "hello from vm60");

    // Removal: QEMU ends, its tap and its directory go.
    let changes = runtime.remove(&spec.id).await.unwrap();
    assert!(
        changes.iter().any(|c| matches!(c, Change::QemuEnded { .. })),
        "{changes:?}"
    );
    assert_eq!(runtime.pid(&spec.id), None);
    assert!(!std::path::Path::new(&format!("/proc/{new_pid}")).exists() || runtime.pid(&spec.id).is_none());
    assert!(
        nl.link("tap60").await.unwrap().is_none(),
        "the tap went with QEMU"
    );
    assert!(runtime.list().unwrap().is_empty());
    assert!(
        runtime.remove(&spec.id).await.unwrap().is_empty(),
        "removing twice is fine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_whose_qemu_is_missing_fails_with_what_to_install() {
    let world = World::new(61);
    let ns = world.create_ns("n");
    let (_, runtime, _) = node_runtime(
        &world,
        &ns,
        Ipv4Addr::new(10, 214, 61, 1),
        "/nonexistent/qemu-system-x86_64",
    )
    .await;
    let (spec, q) = guest(61);
    let err = runtime.ensure(&spec, &q).await.unwrap_err().to_string();
    assert!(
        err.contains("is not installed on this node") && err.contains("qemu-system-x86"),
        "{err}"
    );
    match runtime.view(&spec.id) {
        QemuView::Starting(why) => assert!(why.contains("not installed"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// A migration's target: the agent listens for the stream itself and hands
/// the connection to the incoming QEMU. An agent that ends while QEMU waits
/// (here: its tokio runtime shut down, the wait and its listener with it)
/// is replaced by one that listens again on the port the source was told,
/// and the next connection from the source's address reaches QEMU.
#[test]
fn an_incoming_qemu_waits_on_the_port_it_reported_across_an_agent_restart() {
    if !qemu_installed() {
        return;
    }
    let world = World::new(62);
    let ns = world.create_ns("n");
    let vtep = Ipv4Addr::new(10, 214, 62, 1);
    let key = "ab".repeat(32);
    let (spec, q) = guest(62);
    let runtime_of = |rt: &tokio::runtime::Runtime, world: &World| {
        rt.block_on(node_runtime(world, &ns, vtep, otherix_agent::runtime::qemu::QEMU))
            .1
    };
    let two_threads = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    };

    let first = two_threads();
    let runtime = runtime_of(&first, &world);
    let (changes, port) = first
        .block_on(runtime.ensure_incoming(&spec, &q, &key, vtep, Some(vtep)))
        .unwrap();
    assert!(
        changes.iter().any(|c| matches!(c, Change::QemuStarted { .. })),
        "{changes:?}"
    );
    let port = port.expect("a port to report");
    let pid = runtime.pid(&spec.id).expect("the incoming QEMU runs");
    // Each round while it waits: the same port, nothing new.
    let (again, same) = first
        .block_on(runtime.ensure_incoming(&spec, &q, &key, vtep, Some(vtep)))
        .unwrap();
    assert_eq!(same, Some(port));
    assert!(
        !again.iter().any(|c| matches!(c, Change::QemuStarted { .. })),
        "{again:?}"
    );
    drop(runtime);
    first.shutdown_timeout(Duration::from_secs(5));

    let second = two_threads();
    let runtime = runtime_of(&second, &world);
    let (_, reported) = second
        .block_on(runtime.ensure_incoming(&spec, &q, &key, vtep, Some(vtep)))
        .unwrap();
    assert_eq!(reported, Some(port), "listening again where the source was told");
    assert_eq!(runtime.pid(&spec.id), Some(pid), "the same QEMU waits on");

    // The stream from the source's address (the node's own here) reaches
    // QEMU: its incoming migration starts (it then waits for a handshake
    // these bytes are not).
    let qmp_state = |rt: &tokio::runtime::Runtime| {
        rt.block_on(async {
            let mut qmp = otherix_agent::runtime::qemu::qmp::Qmp::connect(&runtime.qmp_socket(&spec.id))
                .await
                .unwrap();
            qmp.execute("query-migrate", None).await.unwrap()
        })
    };
    assert!(
        qmp_state(&second).get("status").is_none(),
        "nothing reached QEMU yet"
    );
    let netns = Netns::open(&ns).unwrap();
    netns
        .run(|| {
            let mut s = std::net::TcpStream::connect((vtep, port)).expect("the port answers");
            let _ = s.write_all(b"no migration stream\n");
        })
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = qmp_state(&second);
        if state.get("status").is_some() {
            assert_eq!(state["status"], "setup", "{state}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the connection never reached QEMU: {state}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    second.block_on(runtime.remove(&spec.id)).unwrap();
}

/// A migration's source whose target does not listen yet (its agent
/// restarting, say) waits, round after round, with the guest running and
/// nothing started; past the migration's timeout it gives up with why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_waits_for_a_target_that_does_not_listen_yet_with_its_guest_running() {
    if !qemu_installed() {
        return;
    }
    let world = World::new(63);
    let ns = world.create_ns("n");
    let vtep = Ipv4Addr::new(10, 214, 63, 1);
    let (_, runtime, _) = node_runtime(&world, &ns, vtep, otherix_agent::runtime::qemu::QEMU).await;
    let (spec, q) = guest(63);
    runtime.ensure(&spec, &q).await.unwrap();
    wait_http(&ns, spec.ip, "hello from vm63");

    // Port 9 on the node's own address: nothing listens there.
    let target = format!("{vtep}:9");
    let key = "cd".repeat(32);
    let migrate =
        |timeout: Duration| runtime.migrate_out(&spec.id, "m1", &target, &key, timeout, None, Some(vtep));
    for _ in 0..2 {
        match migrate(Duration::from_secs(60)).await.unwrap() {
            otherix_agent::runtime::qemu::Outgoing::Active(why) => {
                assert!(why.contains("waiting for the target to listen"), "{why}")
            }
            other => panic!("expected a wait, got {other:?}"),
        }
    }
    assert!(
        matches!(runtime.view(&spec.id), QemuView::Running { .. }),
        "the guest runs on, not paused"
    );
    assert!(wait_http(&ns, spec.ip, "hello from vm63").starts_with("HTTP/1."));
    let err = migrate(Duration::ZERO).await.unwrap_err().to_string();
    assert!(err.contains("did not take the stream"), "{err}");
    runtime.remove(&spec.id).await.unwrap();
}
