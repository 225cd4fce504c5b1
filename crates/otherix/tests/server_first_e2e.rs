//! Guests that speak first (SSH and SMTP banners) through both transports:
//! `echo hi | otherix connect VM 25` against a guest that writes a banner
//! the moment it accepts gets the banner, then its echo — every time, not
//! most times. Through the relay the banner can reach the agent in the same
//! TLS record as the agent's `OK`; the control plane once refused such a
//! session ("node sent data before OK") a few times in thirty.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};

mod common;

use common::BIN;

const WAIT: Duration = Duration::from_secs(60);
/// Connections per transport.
const TRIES: usize = 30;
const BANNER: &str = "220 mail.example ESMTP ready";

/// `echo LINE | otherix connect VM 25`: what it printed, or its error line.
fn connect_once(c: &Cluster, vm: &str, line: &str) -> Result<String, String> {
    let mut child = Command::new(BIN)
        .args(["connect", vm, "25"])
        .env("OTHERIX_CONFIG", &c.config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{line}\n").as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

#[test]
fn a_guest_that_speaks_first_is_reached_every_time_through_the_relay_and_the_gateway() {
    let world = World::new("banner").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    spec.gateways = 1;
    let c = Cluster::start(world, spec).expect("cluster starts");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.188.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.189.0.0/24",
        "--node",
        "node1",
    ])
    .unwrap();
    let exec = format!("otherix guest echo --port 25 --banner '{BANNER}'");
    for (vm, net) in [("mailov", "ov"), ("maillab", "lab")] {
        c.cli_ok(&["vm", "create", vm, "--network", net, "--exec", &exec])
            .unwrap();
        c.wait_vm_running(vm, WAIT).unwrap();
        // The guest listens a moment after `running`; the gateway after its first keys.
        wait_until(&format!("{vm}:25 to answer"), WAIT, || {
            connect_once(&c, vm, "warm").ok()
        })
        .unwrap();
    }
    for vm in ["maillab", "mailov"] {
        let transport = c.cli_json(&["vm", "get", vm]).unwrap();
        let mut failures = Vec::new();
        for i in 0..TRIES {
            let line = format!("hello {i}");
            match connect_once(&c, vm, &line) {
                Ok(out) => assert_eq!(out, format!("{BANNER}\n{line}\n"), "{vm}, try {i}"),
                Err(e) => failures.push(format!("try {i}: {e}")),
            }
        }
        assert!(
            failures.is_empty(),
            "{vm} ({}): {} of {TRIES} connections failed: {failures:#?}",
            transport["network"],
            failures.len()
        );
    }
}
