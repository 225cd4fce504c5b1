//! The audit trail end to end on the testbed: real gateways and the relay
//! report each session's start and end, and `otherix audit -o json` lists
//! every allowed and refused connection with its principal, reason and byte
//! counts equal to what was sent; `otherix session list` shows what is open.
//!
//! A CP, one hypervisor and a standalone gateway; an echo guest on an overlay
//! (through the gateway) and one on a bridge (through the relay); an admin
//! and a grant holder connect with `otherix connect` and `otherix forward`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, Proc, World};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_otherix");
const WAIT: Duration = Duration::from_secs(60);

/// `otherix [--grant-file F] connect VM PORT` with `payload` on stdin; the
/// echo guest answers every byte and closes after the end of stdin. Returns
/// what came back, or the error line.
fn connect(
    c: &Cluster,
    grant: Option<&Path>,
    vm: &str,
    port: u16,
    payload: &[u8],
) -> Result<Vec<u8>, String> {
    let mut cmd = Command::new(BIN);
    if let Some(g) = grant {
        cmd.arg("--grant-file").arg(g);
    }
    let mut child = cmd
        .args(["connect", vm, &port.to_string()])
        .env("OTHERIX_CONFIG", &c.config)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let payload = payload.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&payload);
        // Dropping stdin ends the client's direction: a half-close.
    });
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

fn random(len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut b)
        .unwrap();
    b
}

/// `otherix forward VM PORT`; its local address.
fn forward(c: &Cluster, vm: &str, port: u16) -> (Proc, SocketAddr) {
    c.forward(vm, port).expect("otherix forward listens")
}

fn session_ends(c: &Cluster) -> Vec<Value> {
    let audit = c.cli_json(&["audit", "--since", "1h"]).unwrap();
    audit
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "session_end")
        .cloned()
        .collect()
}

#[test]
fn the_audit_trail_lists_every_connection_with_its_principal_reason_and_bytes() {
    let world = World::new("audit").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    let c = Cluster::start(world, spec).expect("cluster starts");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.120.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.121.0.0/24",
        "--node",
        "node1",
    ])
    .unwrap();
    for (vm, net) in [("ovecho", "ov"), ("brecho", "lab")] {
        c.cli_ok(&[
            "vm",
            "create",
            vm,
            "--network",
            net,
            "--exec",
            "otherix guest echo --port 7",
        ])
        .unwrap();
        c.wait_vm_running(vm, WAIT).unwrap();
    }
    let grant = c.world_dir().join("acme.grant");
    let token = c
        .cli_ok(&["grant", "create", "acme", "--target", "ovecho:7", "--ttl", "1h"])
        .unwrap();
    std::fs::write(&grant, token.trim()).unwrap();
    // Guests listen a moment after `running`, gateways after their first keys.
    for vm in ["ovecho", "brecho"] {
        wait_until(&format!("{vm}:7 to echo"), WAIT, || {
            connect(&c, None, vm, 7, b"ping").ok().filter(|r| r == b"ping")
        })
        .unwrap();
    }
    // Those probes are sessions too: count only what follows.
    wait_until("the probes' session ends to be reported", WAIT, || {
        (session_ends(&c).len() >= 2).then_some(())
    })
    .unwrap();
    let before = session_ends(&c).len();

    // Allowed: the admin through the gateway and through the relay, the
    // grant through the gateway; each with its own payload size.
    let cases = [
        (None, "ovecho", "user:admin", "gateway", 300_001usize),
        (None, "brecho", "user:admin", "relay", 200_002),
        (Some(grant.as_path()), "ovecho", "grant:acme", "gateway", 100_003),
    ];
    for (g, vm, _, _, len) in &cases {
        let payload = random(*len);
        let echoed = connect(&c, *g, vm, 7, &payload).unwrap();
        assert!(
            echoed == payload,
            "{vm}: {} bytes came back for {len}",
            echoed.len()
        );
    }
    // Refused: the grant outside its targets, a VM that does not exist.
    let err = connect(&c, Some(&grant), "brecho", 7, b"x").unwrap_err();
    assert!(err.contains("not allowed") || err.contains("grant"), "{err}");
    let err = connect(&c, Some(&grant), "ovecho", 22, b"x").unwrap_err();
    assert!(!err.is_empty());
    let err = connect(&c, None, "nosuchvm", 7, b"x").unwrap_err();
    assert!(err.contains("nosuchvm"), "{err}");

    // An open session is listed while it is open, with who and where.
    let (_fwd, local) = forward(&c, "ovecho", 7);
    let mut held = TcpStream::connect(local).unwrap();
    held.write_all(b"hold\n").unwrap();
    let mut back = [0u8; 5];
    held.read_exact(&mut back).unwrap();
    let open = wait_until("the held session to be listed", WAIT, || {
        let list = c.cli_json(&["session", "list"]).unwrap();
        list.as_array().unwrap().first().cloned()
    })
    .unwrap();
    assert_eq!(open["principal"], "user:admin");
    assert_eq!(open["target"], "ovecho");
    assert_eq!(open["port"], 7);
    assert_eq!(open["transport"], "gateway");
    assert_eq!(open["node"], "gw1");
    drop(held);
    wait_until("the held session to leave the list", WAIT, || {
        let list = c.cli_json(&["session", "list"]).unwrap();
        list.as_array().unwrap().is_empty().then_some(())
    })
    .unwrap();

    // Every session's end, with the bytes each way equal to what was sent.
    let ends = wait_until("every session's end to be reported", WAIT, || {
        let ends = session_ends(&c);
        // The cases and the held session.
        (ends.len() > before + cases.len()).then_some(ends)
    })
    .unwrap();
    let ends = &ends[before..];
    for (_, vm, principal, transport, len) in &cases {
        let e = ends
            .iter()
            .find(|e| e["target"] == *vm && e["principal"] == *principal && e["bytes_up"] == *len as u64)
            .unwrap_or_else(|| {
                panic!("no session end for {principal} → {vm} with {len} bytes up: {ends:#?}")
            });
        assert_eq!(e["bytes_down"], *len as u64, "{e}");
        assert_eq!(e["transport"], *transport, "{e}");
        assert_eq!(e["port"], 7);
        assert_eq!(e["allowed"], true);
        assert_eq!(
            e["node"],
            if *transport == "gateway" { "gw1" } else { "node1" },
            "{e}"
        );
        assert_eq!(e["reason"], "closed", "{e}");
        assert!(e["duration_ms"].as_u64().is_some(), "{e}");
        assert!(e["session"].as_str().is_some_and(|s| s.len() == 32), "{e}");
    }
    let held = ends
        .iter()
        .find(|e| e["bytes_up"] == 5)
        .expect("the held session's end");
    assert_eq!(held["bytes_down"], 5);

    // Each session also has its start, under the same id.
    let audit = c.cli_json(&["audit", "--since", "1h"]).unwrap();
    let audit = audit.as_array().unwrap();
    for e in ends {
        let id = &e["session"];
        let starts = audit
            .iter()
            .filter(|s| s["action"] == "session_start" && &s["session"] == id)
            .count();
        assert_eq!(starts, 1, "start of {id}");
    }
    // The refusals, with the principal and the reason.
    let refused: Vec<&Value> = audit.iter().filter(|e| e["allowed"] == false).collect();
    let find = |principal: &str, target: &str, port: u64| {
        refused
            .iter()
            .find(|e| e["principal"] == principal && e["target"] == target && e["port"] == port)
            .unwrap_or_else(|| panic!("no refusal for {principal} → {target}:{port}: {refused:#?}"))
    };
    assert!(find("grant:acme", "brecho", 7)["reason"]
        .as_str()
        .unwrap()
        .contains("grant"));
    assert!(find("grant:acme", "ovecho", 22)["reason"]
        .as_str()
        .unwrap()
        .contains("grant"));
    assert!(find("user:admin", "nosuchvm", 7)["reason"]
        .as_str()
        .unwrap()
        .contains("nosuchvm"));
    // The grant's own view: `--principal` narrows to it.
    let mine = c
        .cli_json(&["audit", "--since", "1h", "--principal", "grant:acme"])
        .unwrap();
    assert!(mine
        .as_array()
        .unwrap()
        .iter()
        .all(|e| e["principal"] == "grant:acme"));
}

#[test]
fn a_session_that_ends_while_its_gateway_agent_stops_is_audited_with_its_bytes() {
    let world = World::new("audstop").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    let c = Cluster::start(world, spec).expect("cluster starts");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.122.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "vm",
        "create",
        "echo1",
        "--network",
        "ov",
        "--exec",
        "otherix guest echo --port 7",
    ])
    .unwrap();
    c.wait_vm_running("echo1", WAIT).unwrap();
    wait_until("echo1:7 to echo", WAIT, || {
        connect(&c, None, "echo1", 7, b"ping")
            .ok()
            .filter(|r| r == b"ping")
    })
    .unwrap();
    let (_fwd, local) = forward(&c, "echo1", 7);
    let mut held = TcpStream::connect(local).unwrap();
    let mut back = [0u8; 6];
    held.write_all(b"first\n").unwrap();
    held.read_exact(&mut back).unwrap();

    // SIGTERM: the gateway stops accepting; the open session drains.
    let agent = c.node("gw1").unwrap().agent.as_ref().expect("gw1's agent");
    let status = Command::new("kill")
        .args(["-TERM", &agent.pid().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    agent.wait_for_log("draining sessions", WAIT).unwrap();
    held.write_all(b"later\n").unwrap();
    held.read_exact(&mut back).unwrap();
    assert_eq!(&back, b"later\n");
    drop(held);
    agent.wait(WAIT).expect("the agent exits once the session ended");

    // Its end went out with the agent's last heartbeat.
    let ends = session_ends(&c);
    let end = ends
        .iter()
        .find(|e| e["bytes_up"] == 12)
        .unwrap_or_else(|| panic!("no session end with 12 bytes up: {ends:#?}"));
    assert_eq!(end["bytes_down"], 12);
    assert_eq!(end["reason"], "closed");
    assert_eq!(end["node"], "gw1");
    assert!(c
        .cli_json(&["session", "list"])
        .unwrap()
        .as_array()
        .unwrap()
        .is_empty());
}
