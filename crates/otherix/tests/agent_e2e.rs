//! The node agent end to end: a real `otherix server` on loopback and a real
//! `otherix agent` in a node namespace made for the test. The agent enrolls, turns
//! Ready, runs a guest with `otherix guest http` on a bridge network, and survives a
//! `kill -9` and a restart without disturbing the guest. Also: enrollment refusals
//! reach the operator as one line. Needs root.
//!
//! Topology (names carry the test's pid, so a stale one from a killed run is swept):
//!
//! ```text
//!  host ns: CP on 127.0.0.1:P ◀── forwarder ──┐
//!           oxz<pid>h 10.213.250.1/24         │
//!              │ veth                          │
//!  node ns oxz<pid>n: eth0 10.213.250.2/24, 127.0.0.1:P (forwarded to the CP)
//!           agent ── oxl<net> 10.214.250.1/24 ── oxh<vm> ══ guest ns oxz<pid>g<vm>
//! ```
//!
//! The CP listens on loopback only, so the node reaches it through a forwarder that
//! listens on the node namespace's own loopback: the agent's URL (and the CP
//! certificate's name) stays `https://127.0.0.1:P`.

mod common;

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{Cli, Cp, TempDir, BIN};
use otherix_agent::net::{netns, Netns};
use serde_json::Value;

const FABRIC: &str = "10.213.250.0/24";
const HOST_IP: &str = "10.213.250.1";
const NODE_IP: &str = "10.213.250.2";
const GUEST_SUBNET: &str = "10.214.250.0/24";
const WAIT: Duration = Duration::from_secs(60);

fn sh(cmd: &str) -> String {
    let out = Command::new("sh").arg("-c").arg(cmd).output().unwrap();
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn is_root() -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// Polls `f` until it returns `Some`, or panics after `timeout`.
fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The node namespace, its veth to the host, and every guest namespace its agent
/// makes; all removed on drop, also after a panic.
struct NodeNs {
    name: String,
    guest_prefix: String,
}

impl NodeNs {
    fn create() -> NodeNs {
        assert!(is_root(), "this test creates network namespaces and needs root");
        sweep_dead_runs();
        // Our addresses must not shadow anything the host already routes.
        let routes = sh(&format!("ip -4 -o route show match {FABRIC}"));
        let clash: Vec<&str> = routes.lines().filter(|l| !l.starts_with("default")).collect();
        assert!(
            clash.is_empty(),
            "the host already routes into {FABRIC}: {clash:?}"
        );

        let pid = std::process::id();
        let node = NodeNs {
            name: format!("oxz{pid}n"),
            guest_prefix: format!("oxz{pid}g"),
        };
        assert!(
            netns::create(&node.name).unwrap(),
            "{} already existed",
            node.name
        );
        let (ns, host) = (&node.name, format!("oxz{pid}h"));
        sh(&format!("ip -n {ns} link set lo up"));
        sh(&format!("ip link add {host} type veth peer name eth0 netns {ns}"));
        sh(&format!(
            "ip addr add {HOST_IP}/24 dev {host} && ip link set {host} up"
        ));
        sh(&format!(
            "ip -n {ns} addr add {NODE_IP}/24 dev eth0 && ip -n {ns} link set eth0 up"
        ));
        node
    }

    /// `curl` from the node namespace; the body on success.
    fn curl(&self, url: &str) -> Option<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "curl", "-sS", "--max-time", "3", url])
            .output()
            .unwrap();
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for NodeNs {
    fn drop(&mut self) {
        // Deleting the node namespace takes the veth pair with it.
        sweep(&self.guest_prefix);
        sweep(&self.name);
    }
}

/// Kills everything in, and deletes, each namespace starting with `prefix`.
fn sweep(prefix: &str) {
    for name in netns::list(prefix).unwrap_or_default() {
        for pid in netns::pids(&name).unwrap_or_default() {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        }
        let _ = netns::delete(&name);
    }
}

/// Removes the namespaces of runs whose process is gone. `oxz` is not `ox` + a hex
/// digit, so testbed worlds (`ox` + 4 hex digits) and the agent crate's test worlds
/// (`oxa...`) are never mistaken for ours.
fn sweep_dead_runs() {
    for name in netns::list("oxz").unwrap_or_default() {
        let digits: String = name[3..].chars().take_while(char::is_ascii_digit).collect();
        if let Ok(pid) = digits.parse::<u32>() {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                sweep(&format!("oxz{pid}"));
            }
        }
    }
}

/// Makes the CP reachable at 127.0.0.1:`port` inside `ns`, forwarding to the host's
/// 127.0.0.1 at the port in the returned cell (set it when the CP restarts on another).
fn forward_cp_into(ns: &str, port: u16) -> Arc<AtomicU16> {
    let target = Arc::new(AtomicU16::new(port));
    let listener = Netns::open(ns)
        .unwrap()
        .run(move || TcpListener::bind(("127.0.0.1", port)))
        .unwrap()
        .unwrap();
    let to = target.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(inside) = conn else { continue };
            // A refused connect drops the client's connection: "CP unreachable".
            let Ok(cp) = TcpStream::connect(("127.0.0.1", to.load(Ordering::SeqCst))) else {
                continue;
            };
            pipe(inside.try_clone().unwrap(), cp.try_clone().unwrap());
            pipe(cp, inside);
        }
    });
    target
}

fn pipe(mut from: TcpStream, mut to: TcpStream) {
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(std::net::Shutdown::Write);
    });
}

/// A running `otherix agent`; SIGKILLed on drop.
struct Agent {
    child: Option<Child>,
    banner: String,
}

impl Agent {
    /// Starts the agent inside `ns` (network namespace only: like `nsenter --net`,
    /// not `ip netns exec`, so the guest namespaces it mounts are visible here) and
    /// waits for its banner.
    fn start(ns: &str, args: &[String], log: &Path) -> Agent {
        let mut cmd = Command::new(BIN);
        cmd.arg("agent")
            .args(args)
            .env("RUST_LOG", "info")
            .env_remove("OTHERIX_AGENT_JOIN_TOKEN")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .unwrap(),
            ));
        let mut child = Netns::open(ns)
            .unwrap()
            .run(move || cmd.spawn())
            .unwrap()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let banner = rx.recv_timeout(WAIT).unwrap_or_else(|_| {
            panic!(
                "the agent printed no banner; its log:\n{}",
                std::fs::read_to_string(log).unwrap_or_default()
            )
        });
        Agent {
            child: Some(child),
            banner,
        }
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGTERM; the exit status.
    fn terminate(&mut self) -> std::process::ExitStatus {
        let mut c = self.child.take().expect("agent running");
        sh(&format!("kill -TERM {}", c.id()));
        wait_for("the agent to exit after SIGTERM", Duration::from_secs(20), || {
            c.try_wait().unwrap()
        })
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs `otherix agent` to completion (it is expected to fail fast), inside `ns` if
/// given, killing it after 30 s.
fn agent_once(ns: Option<&str>, args: &[&str]) -> Output {
    let mut cmd = Command::new(BIN);
    cmd.arg("agent")
        .args(args)
        .env_remove("OTHERIX_AGENT_JOIN_TOKEN")
        .env_remove("OTHERIX_AGENT_JOIN_TOKEN_FILE")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match ns {
        Some(ns) => Netns::open(ns)
            .unwrap()
            .run(move || cmd.spawn())
            .unwrap()
            .unwrap(),
        None => cmd.spawn().unwrap(),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("otherix agent {args:?} did not exit");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// The first stderr line of a failed agent start, asserting it failed with exit 1
/// and printed nothing on stdout.
fn refusal(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(
        out.stdout.is_empty(),
        "stdout: {:?}",
        String::from_utf8_lossy(&out.stdout)
    );
    let first = stderr.lines().next().unwrap_or_default().to_string();
    assert!(first.starts_with("error: "), "{stderr}");
    first
}

/// Whether `pid` is a live (not zombie) process.
fn alive(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| stat.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
        .unwrap_or(false)
}

/// A join token for hypervisor `name` at [`NODE_IP`]: its heartbeats reach
/// the CP through a forward, so the VTEP is granted, not the source address.
fn join_token(admin: &Cli, name: &str, ttl: &str) -> String {
    admin
        .ok(&[
            "node",
            "join-token",
            "create",
            "--name",
            name,
            "--hypervisor",
            "--vtep",
            NODE_IP,
            "--ttl",
            ttl,
        ])
        .trim()
        .to_string()
}

fn node_status(admin: &Cli, name: &str) -> Option<Value> {
    let nodes = admin.json(&["node", "list"]);
    nodes.as_array()?.iter().find(|n| n["name"] == name).cloned()
}

#[test]
fn agent_enrolls_runs_a_guest_and_a_restart_keeps_it_undisturbed() {
    let node = NodeNs::create();
    let mut cp = Cp::start();
    let admin = cp.admin();
    let port = |url: &str| -> u16 { url.rsplit(':').next().unwrap().parse().unwrap() };
    let cp_url = cp.url.clone();
    let forward = forward_cp_into(&node.name, port(&cp_url));

    let dir = TempDir::new("agent");
    let data_dir = dir.path().join("agent");
    let log = dir.path().join("agent.log");
    let token = join_token(&admin, "node1", "10m");
    let args = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "--server",
            &cp_url,
            "--name",
            "node1",
            "--hypervisor",
            "--data-dir",
            data_dir.to_str().unwrap(),
            "--vtep",
            NODE_IP,
            "--netns-prefix",
            &node.guest_prefix,
            "--heartbeat-interval",
            "500ms",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };

    // First start: enroll with the token, pinning the CA by its fingerprint.
    let mut agent = Agent::start(
        &node.name,
        &args(&["--join-token", &token, "--ca-fingerprint", &cp.fingerprint]),
        &log,
    );
    assert!(
        agent.banner.contains("node1") && agent.banner.contains("enrolled now"),
        "{}",
        agent.banner
    );
    assert!(
        agent.banner.contains(&cp.url) && agent.banner.contains("hypervisor"),
        "{}",
        agent.banner
    );
    for (file, mode) in [("node.key", 0o600), ("node.crt", 0o644), ("ca.crt", 0o644)] {
        use std::os::unix::fs::PermissionsExt;
        let m = std::fs::metadata(data_dir.join(file))
            .unwrap()
            .permissions()
            .mode()
            & 0o777;
        assert_eq!(m, mode, "{file}");
    }
    let n = wait_for("node1 to be Ready", WAIT, || {
        node_status(&admin, "node1").filter(|n| n["status"] == "Ready")
    });
    assert_eq!(n["vtep"], NODE_IP);
    assert_eq!(n["roles"]["hypervisor"], true);

    // The token is single use: another node cannot enroll with it.
    let other_dir = dir.path().join("other");
    let out = agent_once(
        Some(&node.name),
        &[
            "--server",
            &cp.url,
            "--name",
            "node2",
            "--data-dir",
            other_dir.to_str().unwrap(),
            "--join-token",
            &token,
            "--ca-fingerprint",
            &cp.fingerprint,
            "--netns-prefix",
            &format!("{}x", node.guest_prefix),
        ],
    );
    let first = refusal(&out);
    assert!(first.contains("join token already used"), "{first}");

    // A guest on a bridge network of this node, serving its name over HTTP.
    admin.ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        GUEST_SUBNET,
        "--node",
        "node1",
    ]);
    let vm = admin.json(&[
        "vm",
        "create",
        "web01",
        "--network",
        "lab",
        "--node",
        "node1",
        "--exec",
        "otherix guest http --port 8080",
    ]);
    let ip = vm["ip"].as_str().unwrap().to_string();
    let vm_id = vm["id"].as_str().unwrap().to_string();
    let guest_ns = format!("{}{}", node.guest_prefix, &vm_id[..12]);
    wait_for("web01 to be running", WAIT, || {
        let v = admin.json(&["vm", "get", "web01"]);
        (v["state"] == "running").then_some(())
    });
    let url = format!("http://{ip}:8080/");
    let body = wait_for("the guest to answer over HTTP", WAIT, || node.curl(&url));
    assert_eq!(body, "web01\n");
    assert!(
        data_dir.join("desired.json").exists(),
        "the desired state is saved"
    );
    let pids = netns::pids(&guest_ns).unwrap();
    assert!(!pids.is_empty(), "the workload runs in {guest_ns}");

    // kill -9: the guest keeps serving without its agent.
    agent.kill9();
    assert_eq!(node.curl(&url).as_deref(), Some("web01\n"));

    // Restart without token or CA flags: the saved identity is reused, the running
    // workload is adopted, not started a second time.
    let mut agent = Agent::start(&node.name, &args(&[]), &log);
    assert!(agent.banner.contains("identity reused"), "{}", agent.banner);
    wait_for("the restarted agent to adopt the workload", WAIT, || {
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("adopted running workload")
            .then_some(())
    });
    let before = admin.json(&["node", "get", "node1"])["last_heartbeat"].clone();
    wait_for("a heartbeat from the restarted agent", WAIT, || {
        (admin.json(&["node", "get", "node1"])["last_heartbeat"] != before).then_some(())
    });
    // Several supervision rounds later, still the same processes.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        netns::pids(&guest_ns).unwrap(),
        pids,
        "the workload was not restarted"
    );
    assert_eq!(node.curl(&url).as_deref(), Some("web01\n"));
    assert_eq!(admin.json(&["vm", "get", "web01"])["state"], "running");

    // SIGTERM: a clean exit that leaves the guest running.
    assert!(agent.terminate().success());
    assert_eq!(netns::pids(&guest_ns).unwrap(), pids);
    assert_eq!(node.curl(&url).as_deref(), Some("web01\n"));

    // The CP goes away: a running agent keeps the node as it is and warns once; an
    // agent restarted meanwhile serves from its saved desired state.
    let mut agent = Agent::start(&node.name, &args(&[]), &log);
    let seen = std::fs::read_to_string(&log).unwrap().len();
    cp.kill9();
    std::thread::sleep(Duration::from_secs(5));
    let outage = std::fs::read_to_string(&log).unwrap()[seen..].to_string();
    assert_eq!(
        outage
            .matches("heartbeat failed; keeping the node on its last desired state")
            .count(),
        1,
        "one warning per outage, not one per retry:\n{outage}"
    );
    agent.kill9();
    let seen = std::fs::read_to_string(&log).unwrap().len();
    let agent = Agent::start(&node.name, &args(&[]), &log);
    assert!(agent.banner.contains("identity reused"), "{}", agent.banner);
    wait_for("the agent to adopt the workload with the CP down", WAIT, || {
        std::fs::read_to_string(&log).unwrap()[seen..]
            .contains("adopted running workload")
            .then_some(())
    });
    assert_eq!(netns::pids(&guest_ns).unwrap(), pids);
    assert_eq!(node.curl(&url).as_deref(), Some("web01\n"));

    // The CP is back (on another port, behind the same forwarded address).
    cp.boot();
    forward.store(port(&cp.url), Ordering::SeqCst);
    let admin = cp.admin();
    wait_for("the agent to reach the CP again", WAIT, || {
        std::fs::read_to_string(&log).unwrap()[seen..]
            .contains("control plane reachable again")
            .then_some(())
    });
    wait_for("node1 to be Ready again", WAIT, || {
        node_status(&admin, "node1").filter(|n| n["status"] == "Ready")
    });
    assert_eq!(admin.json(&["vm", "get", "web01"])["state"], "running");
    assert_eq!(
        netns::pids(&guest_ns).unwrap(),
        pids,
        "the outage never touched the guest"
    );

    // Deleting the VM while the agent runs removes its namespace and workload.
    admin.ok(&["vm", "delete", "web01"]);
    wait_for("the guest namespace to be removed", WAIT, || {
        (!netns::exists(&guest_ns)).then_some(())
    });
    assert!(pids.iter().all(|&p| !alive(p)), "the workload was stopped");
    drop(agent);
}

#[test]
fn enrollment_problems_stop_the_agent_with_one_line() {
    assert!(is_root(), "the agent's privilege check passes only for root");
    let cp = Cp::start();
    let admin = cp.admin();
    let dir = TempDir::new("agent-refusals");
    let data_dir: PathBuf = dir.path().join("agent");
    let base = |extra: &[&str]| -> Output {
        let mut args = vec![
            "--server",
            &cp.url,
            "--name",
            "node9",
            "--hypervisor",
            "--data-dir",
            data_dir.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        // These all fail before any netlink: safe in the host namespace.
        agent_once(None, &args)
    };

    let first = refusal(&base(&["--ca-fingerprint", &cp.fingerprint]));
    assert!(
        first.contains("not enrolled yet") && first.contains("--join-token"),
        "{first}"
    );

    // A token file that holds nothing, or is not there, says which.
    let empty = dir.path().join("empty.join-token");
    std::fs::write(&empty, "\n").unwrap();
    let empty = empty.to_str().unwrap();
    let first = refusal(&base(&[
        "--join-token-file",
        empty,
        "--ca-fingerprint",
        &cp.fingerprint,
    ]));
    assert!(first.contains(empty) && first.contains("is empty"), "{first}");
    let missing = dir.path().join("missing.join-token");
    let missing = missing.to_str().unwrap();
    let first = refusal(&base(&[
        "--join-token-file",
        missing,
        "--ca-fingerprint",
        &cp.fingerprint,
    ]));
    assert!(
        first.contains("cannot read --join-token-file") && first.contains(missing),
        "{first}"
    );

    let token = join_token(&admin, "node9", "10m");
    let first = refusal(&base(&["--join-token", &token]));
    assert!(first.contains("--ca-fingerprint"), "{first}");

    let first = refusal(&base(&[
        "--join-token",
        "otxj_bogus_bogus",
        "--ca-fingerprint",
        &cp.fingerprint,
    ]));
    assert!(
        first.contains("enrollment refused") && first.contains("invalid join token"),
        "{first}"
    );

    let wrong_fp = format!("sha256:{}", "00".repeat(32));
    let first = refusal(&base(&["--join-token", &token, "--ca-fingerprint", &wrong_fp]));
    assert!(!first.contains("enrolled"), "{first}");

    let expiring = join_token(&admin, "node9", "1s");
    std::thread::sleep(Duration::from_millis(1500));
    let first = refusal(&base(&[
        "--join-token",
        &expiring,
        "--ca-fingerprint",
        &cp.fingerprint,
    ]));
    assert!(first.contains("join token expired"), "{first}");

    assert!(
        !data_dir.join("node.crt").exists(),
        "no identity saved after a refusal"
    );

    // Without root: refused before anything else.
    let out = Command::new("setpriv")
        .args([
            "--reuid",
            "65534",
            "--regid",
            "65534",
            "--clear-groups",
            "--inh-caps",
            "-all",
        ])
        .arg(BIN)
        .args([
            "agent",
            "--server",
            &cp.url,
            "--name",
            "node9",
            "--data-dir",
            "/nonexistent",
        ])
        .env_remove("RUST_LOG")
        .output();
    if let Ok(out) = out {
        let first = refusal(&out);
        assert!(first.contains("needs root (CAP_NET_ADMIN"), "{first}");
    }
}
