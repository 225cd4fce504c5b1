//! A grant's connection budget, end to end on the testbed: the `grant create
//! --help` example (`otherix grant create ci --target web01:22 --ttl 1h
//! --max-connections 3`) used through `otherix forward` serves exactly three
//! real connections and refuses the fourth clearly, with nothing sent to the
//! guest — the forward keeps no credentials ready for a budgeted grant, so
//! none of the budget goes to connections nobody made.
//!
//! A CP, one hypervisor and a gateway; an echo guest on an overlay, on
//! port 22 as in the example.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::Value;

mod common;

use common::BIN;
const WAIT: Duration = Duration::from_secs(60);

/// The admin's `otherix connect VM PORT` with `line` on stdin: what the
/// echo guest sent back, or the error.
fn admin_echo(c: &Cluster, vm: &str, port: u16, line: &[u8]) -> Result<Vec<u8>, String> {
    let mut child = Command::new(BIN)
        .args(["connect", vm, &port.to_string()])
        .env("OTHERIX_CONFIG", &c.config)
        .env_remove("RUST_LOG")
        .env_remove("OTHERIX_GRANT")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Dropping stdin after the line half-closes: the guest answers and closes.
    child.stdin.take().unwrap().write_all(line).unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// One connection through the forward: `line` there and back.
fn echo_via(local: SocketAddr, line: &[u8]) -> Result<(), String> {
    let mut s = TcpStream::connect(local).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(WAIT)).unwrap();
    s.write_all(line).map_err(|e| e.to_string())?;
    let mut back = vec![0u8; line.len()];
    s.read_exact(&mut back).map_err(|e| format!("no echo: {e}"))?;
    if back != line {
        return Err(format!("echoed {back:?}"));
    }
    Ok(())
}

fn audit_of(c: &Cluster, principal: &str) -> Vec<Value> {
    c.cli_json(&["audit", "--since", "1h", "--principal", principal])
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

fn grant_ci(c: &Cluster) -> Value {
    let list = c.cli_json(&["grant", "list"]).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "ci")
        .cloned()
        .expect("grant ci listed")
}

#[test]
fn forward_with_a_three_connection_grant_serves_three_connections_and_refuses_the_fourth() {
    let world = World::new("gbudget").expect("a testbed world (needs root)");
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
        "10.126.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "vm",
        "create",
        "web01",
        "--network",
        "ov",
        "--exec",
        "otherix guest echo --port 22",
    ])
    .unwrap();
    c.wait_vm_running("web01", WAIT).unwrap();
    // The guest listens a moment after `running`, the gateway after its keys.
    wait_until("web01:22 to echo", WAIT, || {
        admin_echo(&c, "web01", 22, b"ping\n")
            .ok()
            .filter(|r| r == b"ping\n")
    })
    .unwrap();

    // The example of `grant create --help`, as written.
    let token = c
        .cli_ok(&[
            "grant",
            "create",
            "ci",
            "--target",
            "web01:22",
            "--ttl",
            "1h",
            "--max-connections",
            "3",
        ])
        .unwrap();
    let (fwd, local) = c
        .forward_env("web01", 22, &[], &[("OTHERIX_GRANT", token.trim())])
        .expect("otherix forward listens");
    // It learns the grant is budgeted and says it makes none ready.
    fwd.wait_for_log("none is made ready ahead", WAIT).unwrap();

    for i in 1..=3u32 {
        echo_via(local, format!("connection {i}\n").as_bytes())
            .unwrap_or_else(|e| panic!("connection {i} of 3: {e}\n{}", fwd.log()));
        let ci = grant_ci(&c);
        assert_eq!(ci["connections"], i, "one connection, one count: {ci}");
    }
    let ci = grant_ci(&c);
    assert_eq!(
        (ci["connections"].as_u64(), ci["max_connections"].as_u64()),
        (Some(3), Some(3))
    );
    assert_eq!(ci["state"], "exhausted", "{ci}");

    // The fourth: closed without an echo, the reason on the forward's stderr.
    let refused = echo_via(local, b"connection 4\n").unwrap_err();
    assert!(refused.starts_with("no echo"), "{refused}");
    let line = wait_until("the fourth connection's refusal", WAIT, || {
        fwd.log()
            .lines()
            .find(|l| l.starts_with("error: connection from"))
            .map(str::to_string)
    })
    .unwrap();
    assert!(
        line.contains("grant \"ci\" has used all its connections"),
        "{line}"
    );
    assert!(
        !fwd.log().contains("connection made ready"),
        "a budgeted grant's credential was kept ready:\n{}",
        fwd.log()
    );

    // The trail: three connections brokered and opened, one refusal (the
    // fourth; no credential kept ready was refused on the way), and no
    // fourth session reached the guest.
    let ends = wait_until("the three sessions' ends", WAIT, || {
        let audit = audit_of(&c, "grant:ci");
        let ends = audit.iter().filter(|e| e["action"] == "session_end").count();
        (ends >= 3).then_some(audit)
    })
    .unwrap();
    let count = |action: &str, allowed: bool| {
        ends.iter()
            .filter(|e| e["action"] == action && e["allowed"] == allowed)
            .count()
    };
    assert_eq!(count("broker", true), 3, "{ends:#?}");
    assert_eq!(count("broker", false), 1, "{ends:#?}");
    assert_eq!(count("session_start", true), 3, "{ends:#?}");
    let refusal = ends
        .iter()
        .find(|e| e["action"] == "broker" && e["allowed"] == false)
        .unwrap();
    assert!(
        refusal["reason"]
            .as_str()
            .unwrap()
            .contains("has used all its connections"),
        "{refusal}"
    );
}
