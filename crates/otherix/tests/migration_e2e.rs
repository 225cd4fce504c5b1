//! Live migration end to end on the testbed: a CP, two hypervisors and a gateway
//! run by the real agents; a stream through `otherix forward` to an echo guest
//! while `otherix vm migrate` moves the guest between nodes.
//!
//! What the agents do (netns runtime): the source moves the host end of the
//! guest's veth into the target's namespace and onto its overlay bridge, leaving
//! the guest's namespace, workload and TCP state alone; the target adopts the
//! running workload. So a migration must neither reset the stream nor restart
//! the workload. Every test builds its own world; waits use `wait_until`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, Proc, World};
use serde_json::Value;
use sha2::{Digest, Sha256};

const BIN: &str = env!("CARGO_BIN_EXE_otherix");
const WAIT: Duration = Duration::from_secs(60);

// ------------------------------------------------------------------ helpers

fn cluster(hint: &str) -> Cluster {
    let world = World::new(hint).expect("a testbed world (needs root)");
    Cluster::start(world, ClusterSpec::new(BIN)).expect("cluster starts")
}

/// Overlay `ov` and an echo guest `echo1` on node1, reachable through `forward`.
fn echo_guest(c: &Cluster, subnet: &str) -> (Value, Proc, SocketAddr) {
    c.cli_ok(&["network", "create", "ov", "--type", "overlay", "--subnet", subnet])
        .unwrap();
    c.cli_json(&[
        "vm",
        "create",
        "echo1",
        "--network",
        "ov",
        "--node",
        "node1",
        "--exec",
        "otherix guest echo --port 7",
    ])
    .unwrap();
    let vm = c.wait_vm_running("echo1", WAIT).unwrap();
    for n in c.nodes.iter().filter(|n| n.gateway) {
        n.agent
            .as_ref()
            .expect("agent running")
            .wait_for_log("gateway listening", WAIT)
            .unwrap();
    }
    let (fwd, local) = forward(c, "echo1", 7);
    // The first connection may meet a gateway without the neighbor entry yet.
    wait_until("echo1:7 to answer through the forward", WAIT, || {
        let mut s = TcpStream::connect(local).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(b"ping\n").ok()?;
        let mut back = [0u8; 5];
        s.read_exact(&mut back).ok()?;
        (&back == b"ping\n").then_some(())
    })
    .unwrap();
    (vm, fwd, local)
}

/// `otherix forward VM PORT` in the host namespace; returns it and its local address.
fn forward(c: &Cluster, vm: &str, port: u16) -> (Proc, SocketAddr) {
    let config = c.config.to_string_lossy().into_owned();
    let p = c
        .world
        .spawn(
            None,
            BIN,
            ["forward", vm, &port.to_string()],
            &[("OTHERIX_CONFIG", &config), ("RUST_LOG", "info")],
        )
        .unwrap();
    p.wait_for_log("Forwarding", WAIT).unwrap();
    let addr = p
        .log()
        .lines()
        .find_map(|l| l.trim().parse::<SocketAddr>().ok())
        .expect("forward prints its local address");
    (p, addr)
}

/// `otherix vm migrate VM --to NODE`, then waits until the VM runs there.
fn migrate(c: &Cluster, vm: &str, to: &str) -> (Instant, Instant) {
    let started = Instant::now();
    c.cli_ok(&["vm", "migrate", vm, "--to", to]).unwrap();
    let v = c.wait_vm_running(vm, WAIT).unwrap();
    assert_eq!(v["node"].as_str(), Some(to), "{v}");
    (started, Instant::now())
}

/// Processes in the guest's namespace (the workload), seen from the host.
fn guest_pids(c: &Cluster, vm: &Value) -> Vec<String> {
    let id = vm["id"].as_str().unwrap();
    let netns = format!("{}{}", c.world.guest_netns_prefix(), &id[..id.len().min(12)]);
    let out = std::process::Command::new("ip")
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

/// A paced stream through an echo: 16 KiB every 2 ms until stopped, read back
/// on another thread that records when each read returned.
struct Stream {
    stop: Arc<AtomicBool>,
    arrivals: Arc<Mutex<Vec<Instant>>>,
    sender: JoinHandle<(String, u64)>,
    receiver: JoinHandle<(String, u64)>,
}

impl Stream {
    fn start(addr: SocketAddr) -> Stream {
        let conn = TcpStream::connect(addr).unwrap();
        conn.set_nodelay(true).unwrap();
        let mut writer = conn.try_clone().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let stop2 = stop.clone();
        let sender = std::thread::spawn(move || {
            let mut block = vec![0u8; 16 << 10];
            std::fs::File::open("/dev/urandom")
                .unwrap()
                .read_exact(&mut block)
                .unwrap();
            let (mut hash, mut sent, mut n) = (Sha256::new(), 0u64, 0u64);
            while !stop2.load(Ordering::Relaxed) {
                // Stamped, so a lost, repeated or reordered block changes the hash.
                block[..8].copy_from_slice(&n.to_le_bytes());
                writer.write_all(&block).expect("the stream never resets (write)");
                hash.update(&block);
                sent += block.len() as u64;
                n += 1;
                std::thread::sleep(Duration::from_millis(2));
            }
            writer.shutdown(std::net::Shutdown::Write).unwrap();
            (hex::encode(hash.finalize()), sent)
        });
        let arrivals2 = arrivals.clone();
        let receiver = std::thread::spawn(move || {
            let mut reader = conn;
            reader.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let (mut hash, mut got) = (Sha256::new(), 0u64);
            let mut buf = vec![0u8; 1 << 20];
            loop {
                let n = reader.read(&mut buf).expect("the stream never resets (read)");
                if n == 0 {
                    break;
                }
                arrivals2.lock().unwrap().push(Instant::now());
                hash.update(&buf[..n]);
                got += n as u64;
            }
            (hex::encode(hash.finalize()), got)
        });
        Stream {
            stop,
            arrivals,
            sender,
            receiver,
        }
    }

    /// The longest time without data arriving that overlaps `[from, to]`.
    fn max_gap(&self, (from, to): (Instant, Instant)) -> Duration {
        let a = self.arrivals.lock().unwrap();
        a.windows(2)
            .filter(|w| w[1] >= from && w[0] <= to)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }

    /// Stops sending, waits for the echo to drain; asserts every byte came back in order.
    fn finish(self) {
        self.stop.store(true, Ordering::Relaxed);
        let (sent_hash, sent) = self.sender.join().unwrap();
        let (got_hash, got) = self.receiver.join().unwrap();
        assert_eq!(got, sent, "every byte came back");
        assert_eq!(got_hash, sent_hash, "and in order");
        assert!(sent > 0);
    }
}

/// p50 and p99 (nearest rank) of `gaps`.
fn percentiles(gaps: &[Duration]) -> (Duration, Duration) {
    let mut g = gaps.to_vec();
    g.sort();
    let rank = |p: f64| g[((p * g.len() as f64).ceil() as usize).clamp(1, g.len()) - 1];
    (rank(0.50), rank(0.99))
}

/// The static FDB entries and the interfaces of a node, without what legitimately
/// changes when a link comes back (indexes, peer netns ids, learned entries).
fn footprint(c: &Cluster, node: &str) -> (Vec<String>, Vec<String>) {
    let run = |argv: &[&str]| String::from_utf8_lossy(&c.exec_on(node, argv).unwrap().stdout).into_owned();
    let mut fdb: Vec<String> = run(&["bridge", "fdb", "show"])
        .lines()
        // What the agents program: remote entries on VXLAN devices (`dst VTEP`)
        // and static bridge entries. Not the kernel's own per-port and multicast
        // entries, which a recreated device carries with new random MACs.
        .filter(|l| l.contains(" dst ") || l.contains(" static"))
        .map(str::to_owned)
        .collect();
    fdb.sort();
    let mut links: Vec<String> = run(&["ip", "-o", "link"])
        .lines()
        .filter_map(|l| {
            // "12: oxh...@if3: <FLAGS> ..." → "oxh... <FLAGS>"
            let mut parts = l.splitn(3, ": ");
            let (_, name, rest) = (parts.next()?, parts.next()?, parts.next()?);
            let name = name.split('@').next()?;
            let flags = rest.split_whitespace().next()?;
            Some(format!("{name} {flags}"))
        })
        .collect();
    links.sort();
    (fdb, links)
}

// -------------------------------------------------------------------- tests

#[test]
fn a_stream_survives_migrating_its_guest_away_and_back() {
    let c = cluster("mig-stream");
    let (vm, _fwd, local) = echo_guest(&c, "10.150.0.0/24");
    let workload = guest_pids(&c, &vm);
    assert!(!workload.is_empty(), "the echo workload runs");

    let stream = Stream::start(local);
    std::thread::sleep(Duration::from_millis(500));
    let mut gaps = Vec::new();
    for to in ["node2", "node1"] {
        let window = migrate(&c, "echo1", to);
        std::thread::sleep(Duration::from_millis(500));
        gaps.push(stream.max_gap(window));
    }
    stream.finish();
    eprintln!("forwarding gap per migration: {gaps:?}");
    assert_eq!(
        guest_pids(&c, &vm),
        workload,
        "the workload was adopted, never restarted or doubled"
    );
}

#[test]
fn migration_to_a_not_ready_node_is_refused_and_the_guest_stays() {
    let mut c = cluster("mig-notready");
    let (vm, _fwd, local) = echo_guest(&c, "10.151.0.0/24");
    let workload = guest_pids(&c, &vm);
    c.kill_agent("node2").unwrap();
    wait_until("node2 to be NotReady", WAIT, || {
        let nodes = c.cli_json(&["node", "list"]).ok()?;
        nodes
            .as_array()?
            .iter()
            .any(|n| n["name"] == "node2" && n["status"] == "NotReady")
            .then_some(())
    })
    .unwrap();

    let out = c.cli(&["vm", "migrate", "echo1", "--to", "node2"]).unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "refused");
    assert!(err.contains("NotReady"), "{err}");

    let v = c.cli_json(&["vm", "get", "echo1"]).unwrap();
    assert_eq!(
        (v["state"].as_str(), v["node"].as_str()),
        (Some("running"), Some("node1")),
        "{v}"
    );
    assert_eq!(guest_pids(&c, &vm), workload, "the workload was not touched");
    let stream = Stream::start(local);
    std::thread::sleep(Duration::from_millis(300));
    stream.finish();
}

#[test]
fn ten_migrations_under_a_stream_leak_no_fdb_entries_or_interfaces() {
    let c = cluster("mig-ten");
    let (vm, _fwd, local) = echo_guest(&c, "10.152.0.0/24");
    let workload = guest_pids(&c, &vm);
    let before: Vec<_> = ["node1", "node2"].iter().map(|n| footprint(&c, n)).collect();

    let stream = Stream::start(local);
    std::thread::sleep(Duration::from_millis(500));
    let mut gaps = Vec::new();
    for i in 0..10 {
        let to = if i % 2 == 0 { "node2" } else { "node1" };
        let window = migrate(&c, "echo1", to);
        std::thread::sleep(Duration::from_millis(300));
        gaps.push(stream.max_gap(window));
    }
    stream.finish();
    let (p50, p99) = percentiles(&gaps);
    eprintln!(
        "forwarding gap over {} migrations: p50 {p50:?}, p99 {p99:?} ({gaps:?})",
        gaps.len()
    );
    assert_eq!(guest_pids(&c, &vm), workload, "one workload throughout");

    // Back on node1: once both nodes converged, nothing is left over.
    for (node, before) in ["node1", "node2"].iter().zip(&before) {
        let after = wait_until(&format!("{node} to return to its footprint"), WAIT, || {
            let now = footprint(&c, node);
            (now == *before).then_some(now)
        });
        if after.is_err() {
            let now = footprint(&c, node);
            let diff = |a: &[String], b: &[String]| -> Vec<String> {
                a.iter().filter(|l| !b.contains(l)).cloned().collect()
            };
            panic!(
                "{node} differs after the migrations:\nonly before: {:?} {:?}\nonly after: {:?} {:?}",
                diff(&before.0, &now.0),
                diff(&before.1, &now.1),
                diff(&now.0, &before.0),
                diff(&now.1, &before.1)
            );
        }
    }
}
