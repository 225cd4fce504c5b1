//! Live migration end to end on the testbed: a CP, two hypervisors and a gateway
//! run by the real agents; a stream through `otherix forward` to an echo guest,
//! or an interactive OpenSSH session to `sshd` in a guest, while `otherix vm
//! migrate` moves the guest between nodes; and the gateway's sticky membership
//! of an overlay whose last VM left while a session was open.
//!
//! What the agents do (netns runtime): the source moves the host end of the
//! guest's veth into the target's namespace and onto its overlay bridge, leaving
//! the guest's namespace, workload and TCP state alone; the target adopts the
//! running workload. So a migration must neither reset the stream nor restart
//! the workload. Every test builds its own world; waits use `wait_until`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
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
    Cluster::start(world, ClusterSpec::new(bin())).expect("cluster starts")
}

/// The `otherix` binary the cluster runs: this build's, or `OTHERIX_MIGRATION_BIN`
/// (the benchmark's before/after pairs run this test against two builds).
fn bin() -> String {
    std::env::var("OTHERIX_MIGRATION_BIN").unwrap_or_else(|_| BIN.to_owned())
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

/// The VNI of overlay `ov`.
fn overlay_vni(c: &Cluster) -> u64 {
    c.cli_json(&["network", "get", "ov"]).unwrap()["vni"]
        .as_u64()
        .expect("an overlay has a VNI")
}

/// A connection to the forward at `local`: a session through the gateway.
fn session_through(local: SocketAddr) -> TcpStream {
    let session = TcpStream::connect(local).unwrap();
    session.set_read_timeout(Some(WAIT)).unwrap();
    session
}

/// `otherix forward VM PORT` in the host namespace; returns it and its local address.
fn forward(c: &Cluster, vm: &str, port: u16) -> (Proc, SocketAddr) {
    c.forward(vm, port).expect("otherix forward listens")
}

/// `otherix vm migrate VM --to NODE`, then waits until the VM runs there.
fn migrate(c: &Cluster, vm: &str, to: &str) -> (Instant, Instant) {
    let started = Instant::now();
    c.cli_ok(&["vm", "migrate", vm, "--to", to]).unwrap();
    let v = c.wait_vm_running(vm, WAIT).unwrap();
    assert_eq!(v["node"].as_str(), Some(to), "{v}");
    (started, Instant::now())
}

/// The name of a guest's namespace (the agents name it from the VM's id).
fn guest_netns(c: &Cluster, vm: &Value) -> String {
    let id = vm["id"].as_str().unwrap();
    format!("{}{}", c.world.guest_netns_prefix(), &id[..id.len().min(12)])
}

/// Processes in the guest's namespace (the workload), seen from the host.
fn guest_pids(c: &Cluster, vm: &Value) -> Vec<String> {
    let netns = guest_netns(c, vm);
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

    /// Stops sending, waits for the echo to drain; asserts every byte came back
    /// in order. Returns how many bytes went each way.
    fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        let (sent_hash, sent) = self.sender.join().unwrap();
        let (got_hash, got) = self.receiver.join().unwrap();
        assert_eq!(got, sent, "every byte came back");
        assert_eq!(got_hash, sent_hash, "and in order");
        assert!(sent > 0);
        sent
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
/// changes when a link comes back (indexes, peer netns ids, learned entries), and
/// the `clsact` qdiscs (the forwarding for guests that left) among the interfaces.
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
    // "qdisc clsact ffff: dev oxv100 parent ffff:fff1" → "clsact on oxv100"
    links.extend(run(&["tc", "qdisc", "show"]).lines().filter_map(|l| {
        let mut w = l.split_whitespace();
        let kind = w.nth(1)?;
        let dev = w.skip_while(|x| *x != "dev").nth(1)?;
        (kind == "clsact").then(|| format!("{kind} on {dev}"))
    }));
    links.sort();
    (fdb, links)
}

/// For each time a source agent forwarded frames for the guest that left it:
/// how long until it stopped (the control plane's word that every member
/// repointed, or its bound).
fn forwarding_spans(c: &Cluster) -> Vec<Duration> {
    let mut spans = Vec::new();
    for node in ["node1", "node2"] {
        let log = c.node(node).unwrap().agent.as_ref().expect("agent running").log();
        let ended = logged_at(&log, &["forwarding for guests that left ended"]);
        for began in logged_at(&log, &["forwarding frames for guests that left"]) {
            if let Some(t) = ended.iter().find(|t| **t >= began) {
                spans.push(Duration::try_from(*t - began).unwrap_or_default());
            }
        }
    }
    spans
}

/// TCP retransmissions, as the kernel counts them where the stream's bytes can
/// be lost: the gateway's socket towards the guest (in the gateway node's
/// namespace) and the echo's socket in the guest's namespace.
#[derive(Debug, Clone, Copy, Default)]
struct Retrans {
    /// `tcpi_bytes_retrans` of the gateway's socket to the guest.
    gateway_bytes: u64,
    /// `tcpi_total_retrans` (segments) of that socket.
    gateway_segs: u64,
    /// The same for the echo's socket in the guest.
    guest_bytes: u64,
    guest_segs: u64,
}

impl Retrans {
    /// Reads the counters of the established connections to (gateway side) and
    /// from (guest side) the guest's port 7.
    fn sample(c: &Cluster, guest_ns: &str, guest_ip: &str) -> Retrans {
        let gw = c
            .exec_on(
                "gw1",
                &[
                    "ss",
                    "-tinH",
                    "state",
                    "established",
                    "dst",
                    &format!("{guest_ip}:7"),
                ],
            )
            .unwrap();
        let guest = c
            .world
            .exec_netns(
                guest_ns,
                &["ss", "-tinH", "state", "established", "sport", "=", ":7"],
            )
            .unwrap();
        let (gateway_bytes, gateway_segs) = ss_retrans(&String::from_utf8_lossy(&gw.stdout));
        let (guest_bytes, guest_segs) = ss_retrans(&String::from_utf8_lossy(&guest.stdout));
        Retrans {
            gateway_bytes,
            gateway_segs,
            guest_bytes,
            guest_segs,
        }
    }

    fn since(self, before: Retrans) -> Retrans {
        Retrans {
            gateway_bytes: self.gateway_bytes - before.gateway_bytes,
            gateway_segs: self.gateway_segs - before.gateway_segs,
            guest_bytes: self.guest_bytes - before.guest_bytes,
            guest_segs: self.guest_segs - before.guest_segs,
        }
    }
}

/// The TCP counters (`nstat`) that tell where a migration's tail comes from: the
/// retransmission timer (`TCPTimeouts`), tail loss probes, fast retransmissions,
/// and whether what was sent again had been lost or only reordered (D-SACKs: the
/// receiver says it got the segment twice; `TCPSpuriousRTOs`, `TCPSACKReorder`).
const TCP_COUNTERS: [&str; 9] = [
    "TcpExtTCPTimeouts",
    "TcpExtTCPLossProbes",
    "TcpExtTCPFastRetrans",
    "TcpExtTCPSpuriousRTOs",
    "TcpExtTCPDSACKRecv",
    "TcpExtTCPDSACKOfoRecv",
    "TcpExtTCPSACKReorder",
    "TcpExtTCPDSACKOldSent",
    "TcpExtTCPDSACKOfoSent",
];

/// [`TCP_COUNTERS`] of one namespace (the guest's, whose only socket is the echo's;
/// `gw1`'s, where the gateway's socket to the guest is the one that can lose).
#[derive(Debug, Clone, Copy, Default)]
struct Tcp([u64; TCP_COUNTERS.len()]);

impl Tcp {
    fn read(out: &Output) -> Tcp {
        let mut t = Tcp::default();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut words = line.split_whitespace();
            let (Some(name), Some(value)) = (words.next(), words.next()) else {
                continue;
            };
            if let Some(i) = TCP_COUNTERS.iter().position(|c| *c == name) {
                t.0[i] = value.parse().unwrap_or(0);
            }
        }
        t
    }

    fn guest(c: &Cluster, guest_ns: &str) -> Tcp {
        Tcp::read(&c.world.exec_netns(guest_ns, &["nstat", "-asz"]).unwrap())
    }

    fn gateway(c: &Cluster) -> Tcp {
        Tcp::read(&c.exec_on("gw1", &["nstat", "-asz"]).unwrap())
    }

    fn since(self, before: Tcp) -> Tcp {
        Tcp(std::array::from_fn(|i| self.0[i].saturating_sub(before.0[i])))
    }

    fn add(self, other: Tcp) -> Tcp {
        Tcp(std::array::from_fn(|i| self.0[i] + other.0[i]))
    }

    fn get(&self, name: &str) -> u64 {
        self.0[TCP_COUNTERS.iter().position(|c| *c == name).unwrap()]
    }

    /// `RTO/TLP/fast/spurious RTO/D-SACK recvd/reorder/D-SACK sent`.
    fn row(&self) -> String {
        format!(
            "{}/{}/{}/{}/{}/{}/{}",
            self.get("TcpExtTCPTimeouts"),
            self.get("TcpExtTCPLossProbes"),
            self.get("TcpExtTCPFastRetrans"),
            self.get("TcpExtTCPSpuriousRTOs"),
            self.get("TcpExtTCPDSACKRecv") + self.get("TcpExtTCPDSACKOfoRecv"),
            self.get("TcpExtTCPSACKReorder"),
            self.get("TcpExtTCPDSACKOldSent") + self.get("TcpExtTCPDSACKOfoSent"),
        )
    }
}

/// The times `ip -ts monitor link` in the guest's namespace saw its `eth0` without
/// carrier (its veth's other end down while it moves), and for how long. The kernel
/// reports carrier changes from linkwatch, a work item that needs the RTNL and reads
/// the state when it runs: a window that ends before it runs (a move that holds the
/// RTNL until the veth is up again) is not seen at all, and those it sees are timed
/// from when it ran.
struct Carrier {
    child: Child,
    windows: Arc<Mutex<Vec<Duration>>>,
}

impl Carrier {
    fn watch(guest_ns: &str) -> Carrier {
        let mut child = Command::new("ip")
            .args(["-n", guest_ns, "-ts", "monitor", "link"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let windows = Arc::new(Mutex::new(Vec::new()));
        let w = Arc::clone(&windows);
        std::thread::spawn(move || {
            let mut lost_at: Option<f64> = None;
            for line in out.lines().map_while(Result::ok) {
                let Some((at, carrier)) = carrier_event(&line) else {
                    continue;
                };
                match (carrier, lost_at) {
                    (false, None) => lost_at = Some(at),
                    (true, Some(from)) => {
                        let d = (at - from).rem_euclid(86_400.0);
                        w.lock().unwrap().push(Duration::from_secs_f64(d));
                        lost_at = None;
                    }
                    _ => {}
                }
            }
        });
        Carrier { child, windows }
    }

    fn windows(&self) -> Vec<Duration> {
        self.windows.lock().unwrap().clone()
    }
}

impl Drop for Carrier {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// From a line of `ip -ts monitor link` about `eth0`: the second of the day it was
/// stamped and whether the link has its carrier.
fn carrier_event(line: &str) -> Option<(f64, bool)> {
    let (stamp, rest) = line.strip_prefix('[')?.split_once("] ")?;
    let (_, name_and_flags) = rest.split_once(": ")?;
    if !(name_and_flags.starts_with("eth0:") || name_and_flags.starts_with("eth0@")) {
        return None;
    }
    let (_, time) = stamp.split_once('T')?;
    let mut hms = time.split(':');
    let (h, m, s) = (hms.next()?, hms.next()?, hms.next()?);
    let at = h.parse::<f64>().ok()? * 3600.0 + m.parse::<f64>().ok()? * 60.0 + s.parse::<f64>().ok()?;
    let flags = rest.split_once('<')?.1.split_once('>')?.0;
    let has = |f: &str| flags.split(',').any(|x| x == f);
    Some((at, has("LOWER_UP") && !has("NO-CARRIER")))
}

#[test]
fn carrier_events_are_read_from_ip_monitor_lines() {
    let lost = "[2026-12-05T18:38:34.578441] 3: eth0@if9: <NO-CARRIER,BROADCAST,MULTICAST,UP> mtu 1450 qdisc noqueue state LOWERLAYERDOWN";
    let back = "[2026-12-05T18:38:34.579000] 3: eth0@if9: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1450 qdisc noqueue state UP";
    let (t0, c0) = carrier_event(lost).unwrap();
    let (t1, c1) = carrier_event(back).unwrap();
    assert!(!c0 && c1);
    assert!((t1 - t0 - 0.000559).abs() < 1e-6);
    assert_eq!(
        carrier_event("[2026-12-05T18:38:34.5] 1: lo: <UP,LOWER_UP> mtu 65536"),
        None
    );
    assert_eq!(
        carrier_event("    link/ether d2:c2:36:40:e7:49 brd ff:ff:ff:ff:ff:ff"),
        None
    );
}

/// Sums `bytes_retrans:N` and the total of `retrans:CUR/TOTAL` over the
/// sockets `ss -ti` lists (ss leaves out counters that are zero).
fn ss_retrans(out: &str) -> (u64, u64) {
    let (mut bytes, mut segs) = (0, 0);
    for word in out.split_whitespace() {
        if let Some(n) = word.strip_prefix("bytes_retrans:") {
            bytes += n.parse::<u64>().unwrap_or(0);
        } else if let Some(pair) = word.strip_prefix("retrans:") {
            segs += pair
                .split('/')
                .nth(1)
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    (bytes, segs)
}

/// When each agent log line containing every one of `needles` was written.
fn logged_at(log: &str, needles: &[&str]) -> Vec<time::OffsetDateTime> {
    log.lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .filter_map(|l| {
            let stamp = l.split_whitespace().next()?;
            time::OffsetDateTime::parse(stamp, &time::format_description::well_known::Rfc3339).ok()
        })
        .collect()
}

/// For each handover of `vm` (the source's log line), how long until the
/// gateway's agent had pointed the guest's MAC at the target's VTEP.
fn handover_to_gateway_fdb(c: &Cluster, vm: &Value) -> Vec<Duration> {
    let log = |node: &str| c.node(node).unwrap().agent.as_ref().expect("agent running").log();
    let id = vm["id"].as_str().unwrap();
    let mac = format!("mac={}", vm["mac"].as_str().unwrap());
    let gw = log("gw1");
    let mut delays = Vec::new();
    for (from, to) in [("node1", "node2"), ("node2", "node1")] {
        let vtep = format!("vtep={}", c.node(to).unwrap().ns.ip());
        // "moved" when repointed in place, "added" when it had no entry before.
        let mut repointed = logged_at(&gw, &["fdb entry moved", &mac, &vtep]);
        repointed.extend(logged_at(&gw, &["fdb entry added", &mac, &vtep]));
        repointed.sort();
        for handed in logged_at(&log(from), &["guest handed over", id]) {
            if let Some(t) = repointed.iter().find(|t| **t >= handed) {
                delays.push(Duration::try_from(*t - handed).unwrap_or_default());
            }
        }
    }
    delays
}

/// The kernel's side of a node's overlay membership: whether its VXLAN device
/// and bridge exist, and the IPv4 addresses on the bridge.
#[derive(Debug, PartialEq, Eq)]
struct Membership {
    vxlan: bool,
    bridge: bool,
    addresses: Vec<String>,
}

fn membership(c: &Cluster, node: &str, vni: u64) -> Membership {
    let link = |name: &str| {
        c.exec_on(node, &["ip", "link", "show", "dev", name])
            .unwrap()
            .status
            .success()
    };
    let (vxlan, bridge) = (link(&format!("oxv{vni}")), link(&format!("oxb{vni}")));
    let addresses = if bridge {
        let out = c
            .exec_on(
                node,
                &["ip", "-o", "-4", "addr", "show", "dev", &format!("oxb{vni}")],
            )
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| {
                let mut w = l.split_whitespace();
                w.find(|x| *x == "inet")?;
                w.next().map(str::to_owned)
            })
            .collect()
    } else {
        Vec::new()
    };
    Membership {
        vxlan,
        bridge,
        addresses,
    }
}

/// `(overlays, draining)` of `otherix node get NODE -o json`.
/// Waits (`what`) until gw1 has neither the overlay `vni`'s VXLAN device
/// nor its bridge, and the control plane lists it in no overlay.
fn gw1_leaves_the_overlay(c: &Cluster, vni: u64, what: &str) {
    wait_until(what, WAIT, || {
        let m = membership(c, "gw1", vni);
        (!m.vxlan && !m.bridge).then_some(())
    })
    .unwrap();
    assert_eq!(node_memberships(c, "gw1"), (vec![], vec![]));
}

fn node_memberships(c: &Cluster, node: &str) -> (Vec<String>, Vec<String>) {
    let n = c.cli_json(&["node", "get", node]).unwrap();
    let names = |field: &str| -> Vec<String> {
        n[field]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect())
            .unwrap_or_default()
    };
    (names("overlays"), names("draining"))
}

/// An interactive `otherix ssh` session with a terminal on the far side
/// (`ssh -tt`): commands go in on stdin, a thread reads the answers line by
/// line. Its process group is killed on drop.
struct Ssh {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    asked: u64,
}

impl Ssh {
    fn open(c: &Cluster, vm: &str, key: &Path) -> Ssh {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(c.world_dir().join("host-ssh-interactive.log"))
            .unwrap();
        let mut child = Command::new(bin())
            .args(["ssh", &format!("root@{vm}"), "--", "-tt", "-i"])
            .arg(key)
            .args([
                "-o",
                "StrictHostKeyChecking=no",
                "-o",
                "UserKnownHostsFile=/dev/null",
            ])
            .args(["-o", "BatchMode=yes", "-o", "LogLevel=ERROR"])
            .env("OTHERIX_CONFIG", &c.config)
            .env_remove("OTHERIX_TOKEN")
            .env_remove("RUST_LOG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ssh {
            child,
            stdin,
            lines,
            asked: 0,
        }
    }

    /// Runs a command in the session and waits for its answer: a number the
    /// shell computes, so the terminal's echo of the command never matches.
    fn ask(&mut self) {
        if let Err(e) = self.try_ask(WAIT) {
            panic!(
                "no answer to command {} in the ssh session ({e}); it dropped",
                self.asked
            );
        }
    }

    /// [`Ssh::ask`], with a deadline and without panicking.
    fn try_ask(&mut self, within: Duration) -> Result<(), String> {
        self.asked += 1;
        let n = self.asked;
        writeln!(self.stdin, "echo answer-$(({n} * 7))").map_err(|e| e.to_string())?;
        let want = format!("answer-{}", n * 7);
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if answers(&line, &want) => return Ok(()),
                Ok(_) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

/// Whether a line the terminal printed is `want`: a shell may put control
/// sequences first (bash's bracketed paste mode ends with `ESC[?2004l`).
fn answers(line: &str, want: &str) -> bool {
    line.trim_end().ends_with(want)
}

impl Drop for Ssh {
    fn drop(&mut self) {
        // The whole group: `otherix ssh`, ssh and its ProxyCommand.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.wait();
    }
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
fn an_interactive_ssh_session_keeps_working_across_a_migration() {
    let c = cluster("mig-ssh");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.154.0.0/24",
    ])
    .unwrap();
    let files = otherix_testbed::tools::SshFiles::new(c.world_dir());
    let (key, exec) = (files.client_key.clone(), files.sshd_exec());
    c.cli_json(&[
        "vm",
        "create",
        "sshvm",
        "--network",
        "ov",
        "--node",
        "node1",
        "--exec",
        &exec,
    ])
    .unwrap();
    let vm = c.wait_vm_running("sshvm", WAIT).unwrap();
    c.node("gw1")
        .unwrap()
        .agent
        .as_ref()
        .expect("agent running")
        .wait_for_log("gateway listening", WAIT)
        .unwrap();

    // The first session may meet a gateway without the guest's neighbor entry
    // yet: open sessions until one answers.
    let mut ssh = wait_until("an ssh session to answer", WAIT, || {
        let mut s = Ssh::open(&c, "sshvm", &key);
        s.try_ask(Duration::from_secs(10)).ok().map(|()| s)
    })
    .unwrap();
    // sshd, the session's sshd and its shell, which must all carry over; not
    // what the shell runs for a moment around a prompt (seen in one look only).
    let first = guest_pids(&c, &vm);
    for _ in 0..3 {
        ssh.ask();
    }
    let workload: Vec<String> = guest_pids(&c, &vm)
        .into_iter()
        .filter(|p| first.contains(p))
        .collect();
    assert!(workload.len() >= 3, "sshd, its session and a shell: {workload:?}");

    for to in ["node2", "node1"] {
        // Commands and answers while the migration runs, one after another.
        let during = std::thread::scope(|s| {
            let migration = s.spawn(|| migrate(&c, "sshvm", to));
            let mut during = 0;
            while !migration.is_finished() {
                ssh.ask();
                during += 1;
                std::thread::sleep(Duration::from_millis(50));
            }
            migration.join().unwrap();
            during
        });
        assert!(during > 0, "commands ran while the guest migrated to {to}");
        for _ in 0..3 {
            ssh.ask();
        }
    }
    let now = guest_pids(&c, &vm);
    assert!(
        workload.iter().all(|p| now.contains(p)),
        "sshd and the session were adopted, never restarted: before {workload:?}, now {now:?}"
    );

    // The same session, never reconnected, ends as sessions do.
    writeln!(ssh.stdin, "exit").unwrap();
    let status = wait_until("ssh to exit", WAIT, || ssh.child.try_wait().ok().flatten()).unwrap();
    assert!(status.success(), "ssh ended cleanly: {status:?}");
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

/// Also the migration benchmark (`docs/benchmarks.md`): run with
/// `--no-capture` to see the gap of each migration and the retransmissions.
#[test]
fn twenty_migrations_under_a_stream_lose_no_byte_and_leak_no_fdb_entries_or_interfaces() {
    const MIGRATIONS: usize = 20;
    let c = cluster("mig-twenty");
    let (vm, _fwd, local) = echo_guest(&c, "10.152.0.0/24");
    let workload = guest_pids(&c, &vm);
    let before: Vec<_> = ["node1", "node2"].iter().map(|n| footprint(&c, n)).collect();
    let (guest_ns, guest_ip) = (guest_netns(&c, &vm), vm["ip"].as_str().unwrap().to_owned());

    let carrier = Carrier::watch(&guest_ns);
    let stream = Stream::start(local);
    std::thread::sleep(Duration::from_millis(500));
    let mut rows = Vec::new();
    let mut tcp = Vec::new();
    for i in 0..MIGRATIONS {
        let to = if i % 2 == 0 { "node2" } else { "node1" };
        let retrans = Retrans::sample(&c, &guest_ns, &guest_ip);
        let (guest_tcp, gateway_tcp) = (Tcp::guest(&c, &guest_ns), Tcp::gateway(&c));
        let window = migrate(&c, "echo1", to);
        std::thread::sleep(Duration::from_millis(300));
        let gap = stream.max_gap(window);
        rows.push((
            to,
            window.1 - window.0,
            gap,
            Retrans::sample(&c, &guest_ns, &guest_ip).since(retrans),
        ));
        tcp.push((
            Tcp::gateway(&c).since(gateway_tcp),
            Tcp::guest(&c, &guest_ns).since(guest_tcp),
        ));
    }
    let sent = stream.finish();
    let no_carrier = carrier.windows();
    drop(carrier);
    assert_eq!(guest_pids(&c, &vm), workload, "one workload throughout");

    let gaps: Vec<Duration> = rows.iter().map(|r| r.2).collect();
    let (p50, p99) = percentiles(&gaps);
    let total = rows.iter().fold(Retrans::default(), |t, r| Retrans {
        gateway_bytes: t.gateway_bytes + r.3.gateway_bytes,
        gateway_segs: t.gateway_segs + r.3.gateway_segs,
        guest_bytes: t.guest_bytes + r.3.guest_bytes,
        guest_segs: t.guest_segs + r.3.guest_segs,
    });
    eprintln!("| # | to | migration | gap | retransmitted by the gateway | by the guest |");
    eprintln!("|---|---|---|---|---|---|");
    for (i, (to, took, gap, r)) in rows.iter().enumerate() {
        eprintln!(
            "| {} | {to} | {:.2} s | {:.0} ms | {} B ({} segs) | {} B ({} segs) |",
            i + 1,
            took.as_secs_f64(),
            gap.as_secs_f64() * 1e3,
            r.gateway_bytes,
            r.gateway_segs,
            r.guest_bytes,
            r.guest_segs
        );
    }
    eprintln!(
        "forwarding gap over {MIGRATIONS} migrations: p50 {:.0} ms, p99 {:.0} ms; retransmitted: \
         gateway {} B ({} segs), guest {} B ({} segs); {} B echoed in all",
        p50.as_secs_f64() * 1e3,
        p99.as_secs_f64() * 1e3,
        total.gateway_bytes,
        total.gateway_segs,
        total.guest_bytes,
        total.guest_segs,
        sent
    );
    // Where each gap came from: the counters of the two ends, per migration
    // (`nstat`: RTO / TLP / fast retransmissions / spurious RTOs / D-SACKs
    // received / reorderings detected / D-SACKs sent).
    eprintln!(
        "| # | gap | gateway RTO/TLP/fast/spurious/D-SACK recvd/reorder/D-SACK sent | guest, the same |"
    );
    eprintln!("|---|---|---|---|");
    for (i, ((_, _, gap, _), (gw, guest))) in rows.iter().zip(&tcp).enumerate() {
        eprintln!(
            "| {} | {:.0} ms | {} | {} |",
            i + 1,
            gap.as_secs_f64() * 1e3,
            gw.row(),
            guest.row()
        );
    }
    let (gw_all, guest_all) = tcp
        .iter()
        .fold((Tcp::default(), Tcp::default()), |(a, b), (g, h)| {
            (a.add(*g), b.add(*h))
        });
    eprintln!(
        "over {MIGRATIONS} migrations, RTO/TLP/fast/spurious/D-SACK recvd/reorder/D-SACK sent: gateway {}, guest {}; \
         migrations where the guest's timer fired: {}",
        gw_all.row(),
        guest_all.row(),
        tcp.iter().filter(|(_, g)| g.get("TcpExtTCPTimeouts") > 0).count()
    );
    if !no_carrier.is_empty() {
        let (n50, n99) = percentiles(&no_carrier);
        eprintln!(
            "ip monitor (linkwatch) saw the guest's eth0 without carrier {} times, for p50 {:.3} ms, p99 {:.3} ms, the longest {:.3} ms",
            no_carrier.len(),
            n50.as_secs_f64() * 1e3,
            n99.as_secs_f64() * 1e3,
            no_carrier.iter().max().unwrap().as_secs_f64() * 1e3
        );
    }
    let fdb = handover_to_gateway_fdb(&c, &vm);
    if !fdb.is_empty() {
        let (fdb50, fdb99) = percentiles(&fdb);
        eprintln!(
            "from the source's handover to the gateway's FDB entry for the target ({} handovers): \
             p50 {:.0} ms, p99 {:.0} ms",
            fdb.len(),
            fdb50.as_secs_f64() * 1e3,
            fdb99.as_secs_f64() * 1e3
        );
    }

    // Back on node1: once both nodes converged, nothing is left over (no
    // forwarding rule, no membership kept for it either).
    wait_until("every source to have forwarded and stopped", WAIT, || {
        (forwarding_spans(&c).len() >= MIGRATIONS).then_some(())
    })
    .unwrap();
    let spans = forwarding_spans(&c);
    let (f50, f99) = percentiles(&spans);
    eprintln!(
        "the source forwarded frames for the guest after each of {} handovers, for p50 {:.0} ms, p99 {:.0} ms",
        spans.len(),
        f50.as_secs_f64() * 1e3,
        f99.as_secs_f64() * 1e3
    );
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

#[test]
fn a_gateway_keeps_the_overlay_of_a_departed_last_vm_until_its_session_ends() {
    let c = cluster("mig-drain");
    let (vm, _fwd, local) = echo_guest(&c, "10.153.0.0/24");
    let vni = overlay_vni(&c);
    let guest_ip = vm["ip"].as_str().unwrap().to_owned();

    // A session through the gateway, used before and after the migration.
    let mut session = session_through(local);
    let mut echo = |line: &[u8]| {
        session.write_all(line).unwrap();
        let mut back = vec![0u8; line.len()];
        session.read_exact(&mut back).unwrap();
        assert_eq!(back, line);
    };
    echo(b"before\n");
    // The overlay's only VM leaves the only node that hosted it.
    migrate(&c, "echo1", "node2");
    echo(b"after the migration\n");
    wait_until("node1 to leave the overlay", WAIT, || {
        let m = membership(&c, "node1", vni);
        (!m.vxlan && !m.bridge).then_some(())
    })
    .unwrap();
    let joined = membership(&c, "gw1", vni);
    assert!(
        joined.vxlan && joined.bridge && joined.addresses.len() == 1,
        "{joined:?}"
    );
    assert_eq!(node_memberships(&c, "gw1"), (vec!["ov".to_string()], vec![]));

    // Then it is deleted: no VM is left on the overlay, so the gateway's
    // coverage shrinks — but its session there is still open. node2 kills
    // the echo before it removes the guest's veth, so the guest's FIN reaches
    // the gateway, which passes the half-close on; the client's direction
    // stays open, and with it the session, until the client closes.
    c.cli_ok(&["vm", "delete", "echo1"]).unwrap();
    wait_until("gw1 to show ov as draining", WAIT, || {
        (node_memberships(&c, "gw1") == (vec!["ov".to_string()], vec!["ov".to_string()])).then_some(())
    })
    .unwrap();
    // The gateway has taken the deletion in (the VM's static neighbor entry is gone)
    // and node2 has left the overlay, yet the gateway's membership stays.
    wait_until(
        "gw1 to drop the deleted VM's neighbor entry, node2 to leave",
        WAIT,
        || {
            let out = c
                .exec_on(
                    "gw1",
                    &[
                        "ip",
                        "neigh",
                        "show",
                        "nud",
                        "permanent",
                        "dev",
                        &format!("oxb{vni}"),
                    ],
                )
                .unwrap();
            let neighbors = String::from_utf8_lossy(&out.stdout).into_owned();
            let m2 = membership(&c, "node2", vni);
            (!neighbors.contains(&format!("{guest_ip} ")) && !m2.vxlan && !m2.bridge).then_some(())
        },
    )
    .unwrap();
    // ... across further heartbeats of the gateway.
    let heartbeat = || c.cli_json(&["node", "get", "gw1"]).unwrap()["last_heartbeat"].clone();
    for _ in 0..3 {
        let seen = heartbeat();
        wait_until("another heartbeat of gw1", WAIT, || {
            (heartbeat() != seen).then_some(())
        })
        .unwrap();
        assert_eq!(
            membership(&c, "gw1", vni),
            joined,
            "the membership stays while the session is open"
        );
        assert_eq!(
            node_memberships(&c, "gw1"),
            (vec!["ov".to_string()], vec!["ov".to_string()])
        );
    }

    // The session ends: the membership is withdrawn, in the kernel too.
    drop(session);
    gw1_leaves_the_overlay(&c, vni, "gw1 to leave the overlay");
}

/// The guest dies with its wire already cut, so its FIN never reaches the
/// gateway (as when the gateway drops the dead guest's node from its
/// overlay, host rules included, before that FIN arrives): once the client
/// closes, the gateway's own FIN to the guest goes unacknowledged, and the
/// session ends at the gateway's TCP user timeout (its keepalive, 30 s),
/// not after TCP's retransmissions; the overlay it kept goes with it.
#[test]
fn a_session_whose_guest_vanished_without_a_fin_ends_once_its_client_closes() {
    let c = cluster("mig-nofin");
    let (vm, _fwd, local) = echo_guest(&c, "10.154.0.0/24");
    let vni = overlay_vni(&c);
    let mut session = session_through(local);
    session.write_all(b"before\n").unwrap();
    let mut back = [0u8; 7];
    session.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"before\n");

    // Nothing the guest sends leaves its namespace from now on.
    let netns = guest_netns(&c, &vm);
    let cut = c
        .exec_on(
            "node1",
            &["ip", "netns", "exec", &netns, "ip", "link", "set", "eth0", "down"],
        )
        .unwrap();
    assert!(cut.status.success(), "{cut:?}");
    c.cli_ok(&["vm", "delete", "echo1"]).unwrap();
    wait_until("gw1 to show ov as draining", WAIT, || {
        (node_memberships(&c, "gw1") == (vec!["ov".to_string()], vec!["ov".to_string()])).then_some(())
    })
    .unwrap();

    drop(session);
    gw1_leaves_the_overlay(&c, vni, "gw1 to end the session and leave the overlay");
}
