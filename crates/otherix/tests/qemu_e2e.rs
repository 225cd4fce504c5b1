//! QEMU guests end to end on the testbed: real Linux VMs under QEMU (TCG here)
//! on the nodes' bridges, reached through a gateway by `otherix forward` (curl)
//! and `otherix ssh` with the key given at create, through the relay on a
//! bridge network, and kept running (same QEMU, stream unbroken) across an
//! agent restart. Needs root and `qemu-system-x86_64` (skipped with a message
//! without it); the guest image is built once per machine into the shared
//! image cache by `otherix image build` on the host before the first world
//! starts (the agents run in namespaces without a route to Debian's mirror).
//! Each test's call finds it built, or waits on the build's lock.
//!
//! Every test builds its own world; everything is torn down on drop. Waits use
//! `wait_until`; nothing sleeps to assert.

use std::process::Command;
use std::time::Duration;

use otherix_client::tunnel as connect;
use otherix_client::Client;
use otherix_proto::BrokerRequest;
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::tools::qemu_pids;
use otherix_testbed::{wait_until, World};
use serde_json::Value;

mod common;

use common::qemu::{guest_image, qemu_installed};
use common::tunnels::{echo_through, rt};
use common::{kill_client_connections, BIN};

/// A TCG guest boots in seconds; the first test on a machine also waits for
/// the image build (apt-get download of about 30 MB).
const BOOT: Duration = Duration::from_secs(240);
const WAIT: Duration = Duration::from_secs(60);

/// `OTHERIX_TEST_QEMU_BINARY` names another QEMU for the agents (e.g. a
/// wrapper around an older release, to hold its stop-and-copy path).
fn cluster(hint: &str) -> Cluster {
    guest_image();
    let world = World::new(hint).expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    if let Ok(qemu) = std::env::var("OTHERIX_TEST_QEMU_BINARY") {
        spec.extra_agent_args = vec!["--qemu-binary".into(), qemu];
    }
    Cluster::start(world, spec).expect("cluster starts")
}

fn admin(c: &Cluster) -> Client {
    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    let ca = std::fs::read_to_string(c.ca_file()).unwrap();
    Client::new(&c.url, &ca, Some(token.trim().to_string())).unwrap()
}

/// An ed25519 key pair in the world's directory; returns (private, public) paths.
fn ssh_key(c: &Cluster) -> (String, String) {
    let key = c.world_dir().join("id_qemu");
    let out = Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-C", "qemu-test", "-f"])
        .arg(&key)
        .output()
        .expect("ssh-keygen runs (openssh-client)");
    assert!(out.status.success(), "{out:?}");
    let private = key.to_string_lossy().into_owned();
    (private.clone(), format!("{private}.pub"))
}

/// Overlay network `ov` over `subnet`.
fn overlay_net(c: &Cluster, subnet: &str) {
    c.cli_ok(&["network", "create", "ov", "--type", "overlay", "--subnet", subnet])
        .unwrap();
}

/// QEMU guest `qvm` on node1 in overlay `ov` over `subnet`, answering HTTP;
/// returns its id and the admin's client.
fn qvm_on_node1(c: &Cluster, subnet: &str) -> (String, Client) {
    overlay_net(c, subnet);
    let vm = qemu_vm(c, "qvm", &["--network", "ov", "--node", "node1"]);
    let vm_id = vm["id"].as_str().unwrap().to_owned();
    let admin = admin(c);
    wait_http(c, &admin, "qvm");
    (vm_id, admin)
}

/// `vm create NAME ARGS... --runtime qemu`, waited until running.
fn qemu_vm(c: &Cluster, name: &str, args: &[&str]) -> Value {
    let mut argv = vec!["vm", "create", name, "--runtime", "qemu"];
    argv.extend(args);
    let created = c.cli_json(&argv).unwrap();
    assert_eq!(created["runtime"], "qemu", "{created}");
    c.wait_vm_running(name, BOOT).unwrap()
}

/// Brokers and fetches `GET /` until the guest answers (its services start a
/// moment after QEMU reports it running); returns the body.
fn wait_http(c: &Cluster, client: &Client, vm: &str) -> String {
    wait_until(&format!("{vm}:80 to answer HTTP"), BOOT, || {
        let grant = rt()
            .block_on(client.broker(&BrokerRequest {
                target: vm.into(),
                port: 80,
                exclude: Vec::new(),
            }))
            .ok()?;
        let ca = std::fs::read_to_string(c.ca_file()).unwrap();
        rt().block_on(async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut t = connect::open_brokered(&grant, &c.url, &ca).await.ok()?;
            t.write_all(b"GET / HTTP/1.0\r\nHost: guest\r\n\r\n").await.ok()?;
            let mut out = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(10), t.read_to_end(&mut out)).await;
            let text = String::from_utf8_lossy(&out).into_owned();
            text.contains("hello from").then_some(text)
        })
    })
    .unwrap()
}

/// The pid of the QEMU running VM `vm_id` (its `-name ID,process=...`).
fn qemu_pid(vm_id: &str) -> Option<u32> {
    qemu_pids(vm_id).into_iter().next()
}

/// `otherix console VM` fed `input` from a pipe: what the console printed.
fn console_session(c: &Cluster, vm: &str, input: &[u8]) -> String {
    let out = console_as(c, None, vm, input);
    assert!(out.status.success(), "otherix console failed: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `otherix console VM` with `token` (the admin's when `None`).
fn console_as(c: &Cluster, token: Option<&str>, vm: &str, input: &[u8]) -> std::process::Output {
    use std::io::Write;
    let mut child = console_command(c, token, vm).spawn().unwrap();
    let _ = child.stdin.take().unwrap().write_all(input);
    child.wait_with_output().unwrap()
}

/// `otherix console VM` with `token` (the admin's when `None`), its three
/// streams piped.
fn console_command(c: &Cluster, token: Option<&str>, vm: &str) -> Command {
    let mut cmd = Command::new(BIN);
    if let Some(t) = token {
        cmd.env("OTHERIX_TOKEN", t);
    }
    cmd.args(["console", vm])
        .env("OTHERIX_CONFIG", &c.config)
        .env_remove("RUST_LOG")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    cmd
}

fn ssh_args<'a>(key: &'a str, known: &'a str, command: &'a str) -> Vec<&'a str> {
    vec![
        "ssh",
        "root@qvm",
        "--",
        "-i",
        key,
        "-o",
        "StrictHostKeyChecking=accept-new",
        "-o",
        known,
        "-o",
        "BatchMode=yes",
        command,
    ]
}

#[test]
fn a_qemu_guest_is_reached_through_a_gateway_by_forward_and_ssh_and_survives_an_agent_restart() {
    if !qemu_installed() {
        return;
    }
    let mut c = cluster("qemu-gw");
    overlay_net(&c, "10.141.0.0/24");
    let (key, public) = ssh_key(&c);
    let vm = qemu_vm(
        &c,
        "qvm",
        &[
            "--network",
            "ov",
            "--node",
            "node1",
            "--memory",
            "256M",
            "--ssh-key",
            &public,
        ],
    );
    assert_eq!(vm["runtime"], "qemu");
    assert_eq!(vm["machine"]["memory_mib"], 256);
    assert_eq!(vm["machine"]["image"], "default");
    let accel = vm["accelerator"].as_str().unwrap_or_default().to_owned();
    assert!(
        accel == "tcg" || accel == "kvm",
        "vm get shows the accelerator: {vm}"
    );
    let shown = c.cli_ok(&["vm", "get", "qvm"]).unwrap();
    assert!(
        shown.contains(&format!(
            "qemu ({accel}, 256 MiB, 1 CPU, image default, 1 SSH key)"
        )),
        "{shown}"
    );
    let vm_id = vm["id"].as_str().unwrap().to_owned();
    let pid = qemu_pid(&vm_id).expect("a QEMU process runs the VM");

    // curl through `otherix forward`: the guest's own HTTP server answers.
    let admin = admin(&c);
    wait_http(&c, &admin, "qvm");
    let (_fwd, local) = c.forward("qvm", 80).unwrap();
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", &format!("http://{local}/")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "hello from qvm");

    // `otherix ssh` with the key given at create: dropbear in the guest sees
    // the connection on the VM's address, from a gateway's overlay address.
    let known = format!(
        "UserKnownHostsFile={}",
        c.world_dir().join("known_hosts").display()
    );
    let out = c
        .cli(&ssh_args(
            &key,
            &known,
            "echo $SSH_CONNECTION; hostname; cat /proc/uptime",
        ))
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "otherix ssh failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = stdout.lines();
    let conn: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(conn[2], vm["ip"].as_str().unwrap(), "{stdout}");
    assert_eq!(conn[3], "22");
    assert!(
        conn[0].starts_with("10.141.0."),
        "from a gateway's overlay address: {conn:?}"
    );
    assert_eq!(lines.next(), Some("qvm"));
    let uptime: f64 = lines
        .next()
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();

    // An agent restart adopts the running guest: same QEMU, and a stream
    // opened before it (echo on 7, through the gateway) goes on.
    let grant = rt()
        .block_on(admin.broker(&BrokerRequest {
            target: "qvm".into(),
            port: 7,
            exclude: Vec::new(),
        }))
        .unwrap();
    let ca = std::fs::read_to_string(c.ca_file()).unwrap();
    let mut stream = rt()
        .block_on(connect::open_brokered(&grant, &c.url, &ca))
        .unwrap();
    echo_through(&mut stream, b"before the restart\n");
    c.kill_agent("node1").unwrap();
    c.start_agent("node1").unwrap();
    c.node("node1")
        .unwrap()
        .agent
        .as_ref()
        .unwrap()
        .wait_for_log("QEMU guest adopted", WAIT)
        .unwrap();
    echo_through(&mut stream, b"after the restart\n");
    assert_eq!(
        qemu_pid(&vm_id),
        Some(pid),
        "the restarted agent adopted the same QEMU"
    );
    let out = c.cli(&ssh_args(&key, &known, "cat /proc/uptime")).unwrap();
    assert!(out.status.success(), "{out:?}");
    let later: f64 = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        later > uptime,
        "the guest never rebooted: uptime {uptime} then {later}"
    );
    let vm = c.cli_json(&["vm", "get", "qvm"]).unwrap();
    assert_eq!(vm["state"], "running", "{vm}");

    // The serial console, through the relay to node1 (an overlay guest): a
    // command typed there runs in the guest.
    let out = console_session(&c, "qvm", b"\necho console-$((6*7)) $(hostname)\n");
    assert!(
        out.contains("console-42 qvm"),
        "the console ran the command: {out:?}"
    );
    let audit = c.cli_json(&["audit", "--target", "qvm"]).unwrap();
    assert!(
        audit
            .as_array()
            .is_some_and(|a| a.iter().any(|e| e["port"] == 0 && e["allowed"] == true)),
        "the console is audited as port 0: {audit}"
    );
    // A user reaches the console only with a rule that lists it.
    c.cli_ok(&["vm", "label", "qvm", "team=ops"]).unwrap();
    c.cli_ok(&["user", "create", "olga", "--role", "user"]).unwrap();
    let olga = c
        .cli_ok(&["user", "token", "create", "olga"])
        .unwrap()
        .trim()
        .to_string();
    c.cli_ok(&["user", "allow", "olga", "--selector", "team=ops", "--ports", "22"])
        .unwrap();
    let out = console_as(&c, Some(&olga), "qvm", b"\n");
    assert!(
        !out.status.success(),
        "port 22 does not open the console: {out:?}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no access rule for the serial console"),
        "{out:?}"
    );
    c.cli_ok(&[
        "user",
        "allow",
        "olga",
        "--selector",
        "team=ops",
        "--ports",
        "console",
    ])
    .unwrap();
    let out = console_as(&c, Some(&olga), "qvm", b"\necho olga-$((2*21))\n");
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("olga-42"),
        "{out:?}"
    );

    // Deleting the VM ends its QEMU.
    c.cli_ok(&["vm", "delete", "qvm"]).unwrap();
    wait_until("the QEMU to end", WAIT, || {
        qemu_pid(&vm_id).is_none().then_some(())
    })
    .unwrap();
}

#[test]
fn a_qemu_guest_on_a_bridge_is_reached_through_the_relay() {
    if !qemu_installed() {
        return;
    }
    let c = cluster("qemu-relay");
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.142.0.0/24",
        "--node",
        "node1",
    ])
    .unwrap();
    qemu_vm(&c, "qbr", &["--network", "lab"]);
    let admin = admin(&c);
    let body = wait_http(&c, &admin, "qbr");
    assert!(body.contains("hello from qbr"), "{body}");
    let grant = rt()
        .block_on(admin.broker(&BrokerRequest {
            target: "qbr".into(),
            port: 7,
            exclude: Vec::new(),
        }))
        .unwrap();
    assert_eq!(
        grant.transport.as_str(),
        "relay",
        "a bridge VM is relayed: {grant:?}"
    );
    let (_fwd, local) = c.forward("qbr", 80).unwrap();
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "20",
            &format!("http://{local}/cgi-bin/uptime"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let uptime: f64 = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .parse()
        .unwrap_or_else(|_| panic!("the guest's uptime: {out:?}"));
    assert!(uptime > 0.0);
}

#[test]
fn qemu_options_are_checked_before_anything_is_created() {
    let c = cluster("qemu-refuse");
    overlay_net(&c, "10.143.0.0/24");
    let refused = |args: &[&str], want: &str| {
        let mut argv = vec!["vm", "create", "bad", "--network", "ov"];
        argv.extend(args);
        let out = c.cli(&argv).unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "one line: {err}");
    };
    refused(&["--runtime", "qemu", "--memory", "16M"], "give 64 MiB to 64 GiB");
    refused(&["--runtime", "qemu", "--cpus", "0"], "give 1 to 64");
    refused(&["--runtime", "qemu", "--image", "../etc"], "image");
    refused(
        &["--runtime", "qemu", "--exec", "sleep 1"],
        "drop --exec or --runtime qemu",
    );
    refused(&["--runtime", "netns", "--memory", "512M"], "add --runtime qemu");
    let private = c.world_dir().join("not_a_key");
    std::fs::write(&private, "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n").unwrap();
    refused(&["--ssh-key", private.to_str().unwrap()], "is a private key");
    let junk = c.world_dir().join("junk.pub");
    std::fs::write(&junk, "hello world\n").unwrap();
    refused(&["--ssh-key", junk.to_str().unwrap()], "not a public key");
    let vms = c.cli_json(&["vm", "list"]).unwrap();
    assert_eq!(vms.as_array().map(Vec::len), Some(0), "nothing half made: {vms}");

    // Only QEMU guests have a serial console; only admins open one.
    c.cli_ok(&["vm", "create", "plain", "--network", "ov", "--exec", "sleep 1000"])
        .unwrap();
    let out = c.cli(&["console", "plain"]).unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("only QEMU guests"), "{err}");
    let out = c.cli(&["console", "nosuchvm"]).unwrap();
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not found"),
        "{out:?}"
    );
}

/// The guest's uptime in seconds, from its own HTTP server through the broker.
fn guest_uptime(c: &Cluster, client: &Client, vm: &str) -> f64 {
    let grant = rt()
        .block_on(client.broker(&BrokerRequest {
            target: vm.into(),
            port: 80,
            exclude: Vec::new(),
        }))
        .unwrap();
    let ca = std::fs::read_to_string(c.ca_file()).unwrap();
    let text = rt().block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut t = connect::open_brokered(&grant, &c.url, &ca).await.unwrap();
        t.write_all(b"GET /cgi-bin/uptime HTTP/1.0\r\nHost: guest\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(20), t.read_to_end(&mut out)).await;
        String::from_utf8_lossy(&out).into_owned()
    });
    // The CGI's own header ends with a bare newline: the uptime is the last line.
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .and_then(|l| l.split_whitespace().next())
        .and_then(|u| u.parse().ok())
        .unwrap_or_else(|| panic!("no uptime in {text:?}"))
}

/// (sent, its hash, received, its hash, the longest time without data).
type Tally = (u64, u64, u64, u64, Duration);

/// A paced stream through a tunnel to the guest's echo server: what was sent
/// and what came back (FNV-1a of each), and the longest time without data.
struct Stream {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: Option<tokio::task::JoinHandle<Tally>>,
}

impl Stream {
    fn start(t: connect::AnyTunnel) -> Stream {
        use std::sync::atomic::{AtomicBool, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = rt().spawn(async move {
            let (mut r, mut w) = tokio::io::split(t);
            let writer = async move {
                let (mut sent, mut hash) = (0u64, 0xcbf29ce484222325u64);
                let mut i = 0u64;
                while !flag.load(Ordering::Relaxed) {
                    let chunk: Vec<u8> = (0..512).map(|j| ((i * 31 + j) % 251) as u8).collect();
                    w.write_all(&chunk).await.expect("the stream stays open");
                    for b in &chunk {
                        hash = (hash ^ u64::from(*b)).wrapping_mul(0x100000001b3);
                    }
                    sent += chunk.len() as u64;
                    i += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                (sent, hash, w)
            };
            let reader = async move {
                let (mut got, mut hash) = (0u64, 0xcbf29ce484222325u64);
                let mut gap = Duration::ZERO;
                let mut last = std::time::Instant::now();
                let mut buf = vec![0u8; 65536];
                loop {
                    let n = match tokio::time::timeout(Duration::from_secs(5), r.read(&mut buf)).await {
                        Ok(Ok(0)) | Err(_) => break,
                        Ok(Ok(n)) => n,
                        Ok(Err(e)) => panic!("the stream broke: {e}"),
                    };
                    gap = gap.max(last.elapsed());
                    last = std::time::Instant::now();
                    for b in &buf[..n] {
                        hash = (hash ^ u64::from(*b)).wrapping_mul(0x100000001b3);
                    }
                    got += n as u64;
                }
                (got, hash, gap)
            };
            let ((sent, sent_hash, _w), (got, got_hash, gap)) = tokio::join!(writer, reader);
            (sent, sent_hash, got, got_hash, gap)
        });
        Stream {
            stop,
            task: Some(task),
        }
    }

    /// Stops sending; returns (sent, sent hash, received, received hash, longest gap)
    /// once everything sent came back (the reader ends 5 s after the last byte).
    fn finish(mut self) -> Tally {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        rt().block_on(self.task.take().unwrap()).unwrap()
    }
}

// The guest's uptime must grow across the three moves: a restarted guest
// (QEMU ends on a guest panic, `-no-reboot`) fails the test. Under TCG a QEMU
// before 10.0 misses guest writes while it migrates a running guest (a guest
// oops on the target about once in 30 migrations: #28, docs/architecture.md);
// there the agent migrates the guest paused, and this test holds that path
// to the same bytes. `.ci/run` installs QEMU 10 (bookworm-backports on Debian
// 12), so CI holds the live path.
#[test]
fn a_stream_through_the_gateway_stays_byte_exact_across_three_qemu_live_migrations() {
    if !qemu_installed() {
        return;
    }
    let c = cluster("qemu-mig");
    let (vm_id, admin) = qvm_on_node1(&c, "10.144.0.0/24");
    let before = guest_uptime(&c, &admin, "qvm");

    let grant = rt()
        .block_on(admin.broker(&BrokerRequest {
            target: "qvm".into(),
            port: 7,
            exclude: Vec::new(),
        }))
        .unwrap();
    let ca = std::fs::read_to_string(c.ca_file()).unwrap();
    let tunnel = rt()
        .block_on(connect::open_brokered(&grant, &c.url, &ca))
        .unwrap();
    let stream = Stream::start(tunnel);

    let mut pids = vec![qemu_pid(&vm_id).expect("QEMU runs on node1")];
    for to in ["node2", "node1", "node2"] {
        let out = c.cli(&["vm", "migrate", "qvm", "--to", to]).unwrap();
        assert!(
            out.status.success(),
            "migration to {to}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let now = c.cli_json(&["vm", "get", "qvm"]).unwrap();
        assert_eq!(now["node"], to, "{now}");
        assert_eq!(now["state"], "running", "{now}");
        // A real migration: a new QEMU process on the target, the old one gone.
        let pid = wait_until("the source QEMU to end", WAIT, || {
            let pid = qemu_pid(&vm_id)?;
            (!pids.contains(&pid)).then_some(pid)
        })
        .unwrap();
        pids.push(pid);
    }
    let (sent, sent_hash, got, got_hash, gap) = stream.finish();
    eprintln!("stream: {sent} bytes sent, {got} back, longest gap {gap:?}");
    assert!(sent > 0);
    assert_eq!(
        (got, got_hash),
        (sent, sent_hash),
        "byte-exact across three migrations"
    );
    let after = guest_uptime(&c, &admin, "qvm");
    assert!(
        after > before,
        "the guest never rebooted: uptime {before} then {after}"
    );

    // Each move put the forward in at QEMU's switchover, the guest paused on
    // the node it left, before QEMU went on: what still reached that node for
    // the guest went on to it (docs/architecture.md, Live migration).
    for (node, moves) in [("node1", 2), ("node2", 1)] {
        let log = c.node(node).unwrap().agent.as_ref().unwrap().log();
        let lines: Vec<&str> = log.lines().collect();
        let switched: Vec<usize> = (0..lines.len())
            .filter(|&i| {
                lines[i].contains("QEMU switchover") && lines[i].contains("the guest leaves this node")
            })
            .collect();
        assert_eq!(switched.len(), moves, "{node}'s switchovers: {log}");
        for i in switched {
            assert!(lines[i].contains("forwarded=true"), "{node}: {}", lines[i]);
            // And that migration completed (the next word of it in the log).
            let next = lines[i..].iter().find(|l| {
                [
                    "QEMU migration completed",
                    "QEMU migration started",
                    "QEMU migration failed",
                ]
                .iter()
                .any(|w| l.contains(w))
            });
            assert!(
                next.is_some_and(|l| l.contains("completed")),
                "{node}: the switchover, then {next:?}"
            );
        }
    }
    // Each target's agent took the stream from the source's VTEP and handed
    // it to its QEMU (the connection whose buffers it bounds).
    for (node, streams) in [("node1", 1), ("node2", 2)] {
        let log = c.node(node).unwrap().agent.as_ref().unwrap().log();
        let accepted = log
            .lines()
            .filter(|l| l.contains("migration stream accepted"))
            .count();
        assert_eq!(accepted, streams, "{node}'s streams: {log}");
        assert!(!log.contains("not from its source"), "{node}: {log}");
    }
}

#[test]
fn a_qemu_migration_to_a_node_that_cannot_run_qemu_fails_cleanly_and_the_guest_stays() {
    if !qemu_installed() {
        return;
    }
    let mut c = cluster("qemu-mig-fail");
    let (vm_id, admin) = qvm_on_node1(&c, "10.145.0.0/24");
    let pid = qemu_pid(&vm_id).unwrap();
    // node2's agent runs without a QEMU it can start.
    c.kill_agent("node2").unwrap();
    c.start_agent_with("node2", &["--qemu-binary", "/nonexistent/qemu-system-x86_64"])
        .unwrap();
    c.wait_ready(WAIT).unwrap();

    let out = c.cli(&["vm", "migrate", "qvm", "--to", "node2"]).unwrap();
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("cannot receive the guest") && err.contains("not installed"),
        "{err}"
    );
    let now = c.cli_json(&["vm", "get", "qvm"]).unwrap();
    assert_eq!(now["node"], "node1", "{now}");
    assert_eq!(now["state"], "running", "{now}");
    assert!(
        now["reason"].as_str().unwrap_or_default().contains("rolled back"),
        "{now}"
    );
    assert_eq!(qemu_pid(&vm_id), Some(pid), "the guest never left its QEMU");
    wait_http(&c, &admin, "qvm");
}

#[test]
fn a_load_balancer_over_qemu_guests_marks_one_whose_http_server_stopped_unhealthy() {
    if !qemu_installed() {
        return;
    }
    let c = cluster("qemu-lb");
    overlay_net(&c, "10.146.0.0/24");
    let (key, public) = ssh_key(&c);
    for (vm, node) in [("qweb1", "node1"), ("qweb2", "node2")] {
        qemu_vm(
            &c,
            vm,
            &[
                "--network",
                "ov",
                "--node",
                node,
                "--label",
                "app=qweb",
                "--ssh-key",
                &public,
            ],
        );
    }
    c.cli_ok(&[
        "lb",
        "create",
        "qweb",
        "--port",
        "80",
        "--selector",
        "app=qweb",
        "--health",
        "http:/",
        "--interval",
        "1s",
        "--timeout",
        "500ms",
    ])
    .unwrap();
    let health = |vm: &str| -> Option<String> {
        let lb = c.cli_json(&["lb", "get", "qweb"]).ok()?;
        lb["backends"]
            .as_array()?
            .iter()
            .find(|b| b["vm"] == vm)
            .and_then(|b| b["health"].as_str().map(str::to_owned))
    };
    for vm in ["qweb1", "qweb2"] {
        wait_until(&format!("{vm} healthy"), BOOT, || {
            (health(vm).as_deref() == Some("healthy")).then_some(())
        })
        .unwrap();
    }

    // Stop qweb2's HTTP server inside the guest: its node's probes see it.
    let known = format!(
        "UserKnownHostsFile={}",
        c.world_dir().join("known_hosts").display()
    );
    let out = c
        .cli(&[
            "ssh",
            "root@qweb2",
            "--",
            "-i",
            &key,
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            &known,
            "-o",
            "BatchMode=yes",
            "killall httpd",
        ])
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    wait_until("qweb2 unhealthy", WAIT, || {
        (health("qweb2").as_deref() == Some("unhealthy")).then_some(())
    })
    .unwrap();
    assert_eq!(health("qweb1").as_deref(), Some("healthy"));
    // Every connection to the pool now reaches qweb1.
    let (_fwd, local) = c.forward_with("lb/qweb", 80, &["--ready", "0"]).unwrap();
    for _ in 0..4 {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "20", &format!("http://{local}/")])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "hello from qweb1",
            "{out:?}"
        );
    }
}

#[test]
fn a_qemu_migration_whose_target_dies_midway_rolls_back_and_the_guest_runs_on() {
    if !qemu_installed() {
        return;
    }
    let mut c = cluster("qemu-mig-dies");
    let (vm_id, admin) = qvm_on_node1(&c, "10.147.0.0/24");
    let pid = qemu_pid(&vm_id).unwrap();
    // node1 sends at 1 MiB/s: the stream (tens of MB) lasts long enough to
    // kill its target in the middle of it.
    c.kill_agent("node1").unwrap();
    c.start_agent_with("node1", &["--qemu-migration-bandwidth", "1M"])
        .unwrap();
    c.node("node1")
        .unwrap()
        .agent
        .as_ref()
        .unwrap()
        .wait_for_log("QEMU guest adopted", WAIT)
        .unwrap();

    c.cli_ok(&["vm", "migrate", "qvm", "--to", "node2", "--no-wait"])
        .unwrap();
    c.node("node1")
        .unwrap()
        .agent
        .as_ref()
        .unwrap()
        .wait_for_log("QEMU migration started", WAIT)
        .unwrap();
    // The target node dies: its agent and the QEMU receiving the guest.
    let incoming = wait_until("the target's incoming QEMU", WAIT, || {
        qemu_pids(&vm_id).into_iter().find(|p| *p != pid)
    })
    .unwrap();
    c.kill_agent("node2").unwrap();
    let _ = Command::new("kill").args(["-9", &incoming.to_string()]).status();

    let now = wait_until("the migration to be rolled back", WAIT, || {
        let vm = c.cli_json(&["vm", "get", "qvm"]).ok()?;
        (vm["state"] == "running" && vm["migrate_to"].is_null()).then_some(vm)
    })
    .unwrap();
    assert_eq!(now["node"], "node1", "{now}");
    let reason = now["reason"].as_str().unwrap_or_default();
    assert!(reason.contains("rolled back"), "a clear reason: {now}");
    assert_eq!(
        qemu_pids(&vm_id),
        vec![pid],
        "the guest never left its QEMU on node1"
    );
    wait_http(&c, &admin, "qvm");
}

/// `otherix console` kept open, fed from a pipe, its output collected.
struct LiveConsole {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    out: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    err: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

impl LiveConsole {
    fn open(c: &Cluster, vm: &str) -> LiveConsole {
        let mut child = console_command(c, None, vm).spawn().unwrap();
        let collect = |mut from: Box<dyn std::io::Read + Send>| {
            let into = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            let sink = into.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    sink.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
            into
        };
        let out = collect(Box::new(child.stdout.take().unwrap()));
        let err = collect(Box::new(child.stderr.take().unwrap()));
        LiveConsole {
            stdin: child.stdin.take(),
            child,
            out,
            err,
        }
    }

    fn type_line(&mut self, line: &str) {
        use std::io::Write;
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap()).into_owned()
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.err.lock().unwrap()).into_owned()
    }

    /// Types `command` (again every few seconds: a guest's console may
    /// drop input typed while it prints) until `want` is printed.
    fn run_until(&mut self, command: &str, want: &str) {
        let mut typed_at: Option<std::time::Instant> = None;
        wait_until(&format!("the console to print {want:?}"), WAIT, || {
            if self.stdout().contains(want) {
                return Some(());
            }
            if typed_at.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                self.type_line(&format!("\n{command}\n"));
                typed_at = Some(std::time::Instant::now());
            }
            None
        })
        .unwrap_or_else(|e| {
            panic!(
                "{e}\nconsole stdout:\n{}\nstderr:\n{}",
                self.stdout(),
                self.stderr()
            )
        });
    }
}

impl Drop for LiveConsole {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_serial_console_session_resumes_after_its_connection_is_killed_and_goes_on_where_it_was() {
    if !qemu_installed() {
        return;
    }
    let c = cluster("qemu-conres");
    let (_vm_id, _admin) = qvm_on_node1(&c, "10.146.0.0/24");
    let mut console = LiveConsole::open(&c, "qvm");
    console.run_until("OTX=$((6*7)); echo before-$OTX", "before-42");
    for round in 1..=2 {
        kill_client_connections(&c.url);
        wait_until("the console to resume", WAIT, || {
            (console.stderr().matches("relay: resumed").count() >= round).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\nconsole stderr:\n{}", console.stderr()));
        // The same shell, its state kept: a variable set before the drop.
        console.run_until(&format!("echo after-{round}-$OTX"), &format!("after-{round}-42"));
    }
    assert!(
        console.stderr().contains("relay: connection lost"),
        "the client said what happened: {}",
        console.stderr()
    );
    // Stdin ends: the command ends once the guest is quiet, with success.
    drop(console.stdin.take());
    let status = wait_until("the console to end", WAIT, || console.child.try_wait().unwrap()).unwrap();
    assert!(status.success(), "{status}: {}", console.stderr());
    // Audited: one session on port 0, resumed twice with the cause.
    let audit = c.cli_json(&["audit", "--target", "qvm"]).unwrap();
    let resumes: Vec<&Value> = audit
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "session_resume" && e["port"] == 0)
        .collect();
    assert_eq!(resumes.len(), 2, "two resumes audited: {audit}");
    let ends: Vec<&Value> = audit
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "session_end" && e["port"] == 0)
        .collect();
    assert_eq!(ends.len(), 1, "one console session, ended once: {audit}");
}
