//! Relay sessions that resume, end to end with the real client: a 256 MiB
//! stream each way through `otherix forward` to an echo guest on a bridge
//! network, byte-exact (SHA-256 both ways) while whatever carries it
//! blinks — the client's TCP connection to the control plane killed
//! (`ss -K`) three times, the control plane restarted, a replica killed
//! with SIGKILL, the guest migrated node1 → node2 → node1 — and an
//! interactive `otherix ssh` session that answers before, during and after
//! a migration.
//!
//! Every test builds its own world and owns its names and addresses; each
//! waits on the stream's progress and the client's own words on stderr
//! (`relay: resumed`), never on a sleep.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, Proc, World};

mod common;

use common::tunnels::{read_hashed, send_stamped};
use common::{kill_client_connections, BIN};
const WAIT: Duration = Duration::from_secs(60);
const STREAM: u64 = 256 << 20;

/// A cluster of `replicas` control planes and `hypervisors` nodes, with
/// bridge network `lab` on node1 (and node2 when there are two) and echo
/// guest `echo1` on node1, answering through `otherix forward`.
fn echo_cluster(
    hint: &str,
    subnet: &str,
    hypervisors: usize,
    replicas: usize,
) -> (Cluster, Proc, SocketAddr) {
    let world = World::new(hint).expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = hypervisors;
    spec.gateways = 0;
    spec.replicas = replicas;
    // A node taken for NotReady on a loaded machine would refuse a
    // migration or a forward's first check: room for slow heartbeats.
    spec.node_timeout = Duration::from_secs(15);
    let c = Cluster::start(world, spec).expect("cluster starts");
    lab(&c, subnet, hypervisors);
    c.cli_ok(&[
        "vm",
        "create",
        "echo1",
        "--network",
        "lab",
        "--node",
        "node1",
        "--exec",
        "otherix guest echo --port 7",
    ])
    .unwrap();
    c.wait_vm_running("echo1", WAIT).unwrap();
    // The forward checks the target once at start: a VM seen pending a
    // moment (its node late with a heartbeat) is tried again.
    let (fwd, addr) = wait_until("otherix forward to start", WAIT, || c.forward("echo1", 7).ok()).unwrap();
    wait_until("echo1:7 to answer through the forward", WAIT, || {
        let mut s = TcpStream::connect(addr).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        s.write_all(b"ping").ok()?;
        let mut b = [0u8; 4];
        s.read_exact(&mut b).ok()?;
        (&b == b"ping").then_some(())
    })
    .unwrap();
    (c, fwd, addr)
}

/// Bridge network `lab` on node1, and node2 when there are two.
fn lab(c: &Cluster, subnet: &str, hypervisors: usize) {
    let mut args = vec![
        "network", "create", "lab", "--type", "bridge", "--subnet", subnet, "--node", "node1",
    ];
    if hypervisors > 1 {
        args.extend(["--node", "node2"]);
    }
    c.cli_ok(&args).unwrap();
}

/// A stream of `len` bytes each way through the echo at `addr`, on threads:
/// its progress (bytes back so far) and, joined, (sent hash, received hash,
/// received length).
struct Stream {
    back: Arc<AtomicU64>,
    /// The sender holds its last sixteenth back until this opens, so the
    /// session is still there for the events a test makes (the stream can
    /// outrun them).
    gate: Arc<(std::sync::Mutex<bool>, std::sync::Condvar)>,
    sender: std::thread::JoinHandle<String>,
    receiver: std::thread::JoinHandle<(String, u64)>,
}

impl Stream {
    fn start(addr: SocketAddr, len: u64) -> Stream {
        let conn = TcpStream::connect(addr).unwrap();
        conn.set_nodelay(true).unwrap();
        let writer = conn.try_clone().unwrap();
        let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
        let held = gate.clone();
        let hold_at = len - len / 16;
        let sender = std::thread::spawn(move || {
            send_stamped(writer, len, |sent| {
                if sent >= hold_at {
                    let (open, opened) = &*held;
                    let mut open = open.lock().unwrap();
                    while !*open {
                        open = opened.wait(open).unwrap();
                    }
                }
            })
        });
        let back = Arc::new(AtomicU64::new(0));
        let progress = back.clone();
        let receiver = std::thread::spawn(move || {
            read_hashed(conn, Duration::from_secs(90), |got| {
                progress.store(got, Ordering::Relaxed)
            })
        });
        Stream {
            back,
            gate,
            sender,
            receiver,
        }
    }

    /// Lets the sender send its last part.
    fn release(&self) {
        let (open, opened) = &*self.gate;
        *open.lock().unwrap() = true;
        opened.notify_all();
    }

    /// Waits until `n` bytes have come back.
    fn wait_back(&self, n: u64) {
        wait_until(&format!("{n} bytes back through the stream"), WAIT, || {
            (self.back.load(Ordering::Relaxed) >= n).then_some(())
        })
        .unwrap();
    }

    /// [`Stream::wait_back`] that, when it times out, shows the TCP
    /// connections of every namespace of `c`'s world (the guest's and the
    /// nodes') before failing.
    fn wait_back_in(&self, c: &Cluster, n: u64) {
        let waited = wait_until(&format!("{n} bytes back through the stream"), WAIT, || {
            (self.back.load(Ordering::Relaxed) >= n).then_some(())
        });
        if let Err(e) = waited {
            let mut report = String::new();
            // The connections, the kernel's TCP counters (which drop
            // reason rose) and the firewall's counters of every namespace.
            const DUMPS: [&[&str]; 3] = [
                &["ss", "-tinoe"],
                &["nstat", "-asz"],
                &["nft", "list", "counters"],
            ];
            for ns in c.world.namespaces() {
                for cmd in DUMPS {
                    if let Ok(out) = c.world.exec(&ns, cmd) {
                        report.push_str(&format!(
                            "--- {} {}\n{}",
                            ns.name(),
                            cmd.join(" "),
                            String::from_utf8_lossy(&out.stdout)
                        ));
                    }
                }
            }
            let guests = std::process::Command::new("ip")
                .args(["netns", "list"])
                .output()
                .unwrap();
            for line in String::from_utf8_lossy(&guests.stdout).lines() {
                let name = line.split_whitespace().next().unwrap_or_default();
                if name.starts_with(&c.world.guest_netns_prefix()) {
                    for cmd in DUMPS {
                        if let Ok(out) = c.world.exec_netns(name, cmd) {
                            report.push_str(&format!(
                                "--- {name} {}\n{}",
                                cmd.join(" "),
                                String::from_utf8_lossy(&out.stdout)
                            ));
                        }
                    }
                }
            }
            panic!("{e}\n{report}");
        }
    }

    /// Joins it: every byte came back, in order.
    fn finish(self, len: u64) {
        self.release();
        let sent = self.sender.join().unwrap();
        let (received, got) = self.receiver.join().unwrap();
        assert_eq!(got, len, "every byte came back");
        assert_eq!(sent, received, "and in order, none twice");
    }
}

/// How often the client said it resumed.
fn resumes(fwd: &Proc) -> usize {
    fwd.log().matches("relay: resumed").count()
}

fn wait_resumes(fwd: &Proc, n: usize) {
    wait_until(&format!("the client to resume {n} times"), WAIT, || {
        (resumes(fwd) >= n).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\nforward's log:\n{}", fwd.log()));
}

#[test]
fn a_256_mib_stream_each_way_survives_its_client_connection_killed_three_times() {
    let (c, fwd, addr) = echo_cluster("resume-ssk", "10.195.0.0/24", 1, 1);
    let stream = Stream::start(addr, STREAM);
    for i in 1..=3u64 {
        stream.wait_back(STREAM * i / 4);
        let before = resumes(&fwd);
        kill_client_connections(&c.url);
        wait_resumes(&fwd, before + 1);
    }
    stream.finish(STREAM);
    assert!(fwd.log().contains("relay: connection lost"), "{}", fwd.log());
    // The audit trail: three resumes, each with its cause.
    let audit = c
        .cli_json(&["audit", "--since", "1h", "--target", "echo1"])
        .unwrap();
    let resumed: Vec<_> = audit
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "session_resume")
        .collect();
    assert!(resumed.len() >= 3, "{resumed:?}");
}

#[test]
fn a_256_mib_stream_survives_a_control_plane_restart() {
    let (mut c, fwd, addr) = echo_cluster("resume-cprestart", "10.196.0.0/24", 1, 1);
    let stream = Stream::start(addr, STREAM);
    stream.wait_back(STREAM / 3);
    let cp = c.cps[0].proc.take().unwrap();
    cp.terminate(Duration::from_secs(20)).unwrap();
    c.start_cp().unwrap();
    wait_resumes(&fwd, 1);
    stream.wait_back(STREAM * 2 / 3);
    c.kill_cp().unwrap();
    c.start_cp().unwrap();
    wait_resumes(&fwd, 2);
    stream.finish(STREAM);
}

#[test]
fn a_256_mib_stream_survives_its_replica_killed() {
    let (mut c, fwd, addr) = echo_cluster("resume-failover", "10.197.0.0/24", 1, 2);
    let stream = Stream::start(addr, STREAM);
    stream.wait_back(STREAM / 3);
    // The client talks to the first replica it is configured with.
    c.kill_replica(0).unwrap();
    wait_resumes(&fwd, 1);
    stream.finish(STREAM);
}

#[test]
fn a_256_mib_stream_follows_its_bridge_vm_migrating_there_and_back() {
    let (c, fwd, addr) = echo_cluster("resume-migrate", "10.198.0.0/24", 2, 1);
    let stream = Stream::start(addr, STREAM);
    let started = Instant::now();
    for (i, to) in [(1u64, "node2"), (2, "node1")] {
        stream.wait_back_in(&c, STREAM * i / 3);
        if i == 2 {
            // The connection restored on node2 kept the relay's
            // retransmission floor (socket options do not move with a
            // repaired connection): its timeout is well under Linux's 200 ms.
            let out = c
                .world
                .exec(
                    &c.node("node2").unwrap().ns,
                    &["ss", "-tinH", "dst", "10.198.0.0/24"],
                )
                .unwrap();
            let out = String::from_utf8_lossy(&out.stdout).into_owned();
            let rto: Vec<f64> = out
                .split_whitespace()
                .filter_map(|w| w.strip_prefix("rto:")?.parse().ok())
                .collect();
            assert!(!rto.is_empty() && rto.iter().all(|&ms| ms < 200.0), "{out}");
        }
        c.cli_ok(&["vm", "migrate", "echo1", "--to", to]).unwrap();
        wait_until(&format!("echo1 to run on {to}"), WAIT, || {
            let vm = c.cli_json(&["vm", "get", "echo1"]).ok()?;
            (vm["node"] == to && vm["state"] == "running").then_some(())
        })
        .unwrap();
        wait_resumes(&fwd, i as usize);
    }
    stream.release();
    stream.wait_back_in(&c, STREAM);
    stream.finish(STREAM);
    eprintln!(
        "256 MiB each way across two migrations in {:?}",
        started.elapsed()
    );
}

/// Reads `stdout` until a line equal to `want` comes (at most 60 s).
fn read_line_until(out: &mut std::io::BufReader<std::process::ChildStdout>, want: &str) {
    use std::io::BufRead;
    let deadline = Instant::now() + WAIT;
    let mut line = String::new();
    while Instant::now() < deadline {
        line.clear();
        let n = out.read_line(&mut line).unwrap();
        assert!(n > 0, "the ssh session ended before {want:?}");
        if line.trim_end() == want {
            return;
        }
    }
    panic!("no {want:?} within {WAIT:?}");
}

#[test]
fn an_interactive_ssh_session_answers_before_during_and_after_its_vm_migrates() {
    let world = World::new("resume-ssh").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 2;
    spec.gateways = 0;
    spec.node_timeout = Duration::from_secs(15);
    let c = Cluster::start(world, spec).expect("cluster starts");
    lab(&c, "10.199.0.0/24", 2);
    let files = otherix_testbed::tools::SshFiles::new(c.world_dir());
    c.cli_ok(&[
        "vm",
        "create",
        "sshvm",
        "--network",
        "lab",
        "--node",
        "node1",
        "--exec",
        &files.sshd_exec(),
    ])
    .unwrap();
    c.wait_vm_running("sshvm", WAIT).unwrap();
    let key = files.client_key.to_string_lossy().into_owned();
    let known = format!(
        "UserKnownHostsFile={}",
        c.world_dir().join("known_hosts").display()
    );
    let ssh_args = |command: &str| -> Vec<String> {
        [
            "ssh",
            "root@sshvm",
            "--",
            "-i",
            &key,
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            &known,
            "-o",
            "BatchMode=yes",
            command,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    // sshd listens a moment after `running`.
    wait_until("sshd to answer through the relay", WAIT, || {
        let args = ssh_args("echo up");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = c.cli(&args).ok()?;
        (String::from_utf8_lossy(&out.stdout).trim() == "up").then_some(())
    })
    .unwrap();
    // One interactive session: a shell answering each line it reads.
    let args = ssh_args("while read l; do echo \"got $l\"; done");
    let mut child = Command::new(BIN)
        .args(&args)
        .env("OTHERIX_CONFIG", &c.config)
        .env("RUST_LOG", "info")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    stdin.write_all(b"before\n").unwrap();
    read_line_until(&mut stdout, "got before");
    for (i, to) in ["node2", "node1"].iter().enumerate() {
        c.cli_ok(&["vm", "migrate", "sshvm", "--to", to]).unwrap();
        // While it moves: the line is answered once the session follows.
        let during = format!("during {i}");
        stdin.write_all(format!("{during}\n").as_bytes()).unwrap();
        read_line_until(&mut stdout, &format!("got {during}"));
        wait_until(&format!("sshvm to run on {to}"), WAIT, || {
            let vm = c.cli_json(&["vm", "get", "sshvm"]).ok()?;
            (vm["node"] == *to && vm["state"] == "running").then_some(())
        })
        .unwrap();
        let after = format!("after {i}");
        stdin.write_all(format!("{after}\n").as_bytes()).unwrap();
        read_line_until(&mut stdout, &format!("got {after}"));
    }
    drop(stdin);
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    assert!(status.success(), "ssh ended with {status}: {stderr}");
    assert!(stderr.matches("relay: resumed").count() >= 2, "{stderr}");
}
