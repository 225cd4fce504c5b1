//! Load balancers end to end on the testbed: a CP, two hypervisors and a gateway,
//! each with its real agent; three `app=web` guests serving HTTP; the agents probing
//! them; `curl` through `otherix forward lb/web-lb 8080` in the host namespace.
//!
//! Every guest runs `serve.sh`: `otherix guest http --port 8080` while its switch
//! file `on/<vm>` exists, nothing on 8080 otherwise. Stopping a workload this way is
//! deterministic — killing `otherix guest http` alone would not be, since the agent
//! restarts a workload that exits.
//!
//! Health waits are generous `wait_until`s, never timed assertions; how long each
//! transition took is printed (`--nocapture`) for the record.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, Proc, World};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_otherix");
const WAIT: Duration = Duration::from_secs(60);
const LB: &str = "web-lb";

// ------------------------------------------------------------------ helpers

/// Serves HTTP on 8080 while `$1/$OTHERIX_VM_NAME` exists.
const SERVE_SH: &str = r#"#!/bin/sh
on="$1/$OTHERIX_VM_NAME"
while :; do
  if [ -e "$on" ]; then
    otherix guest http --port 8080 &
    pid=$!
    while [ -e "$on" ] && kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
    kill "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
  fi
  sleep 0.1
done
"#;

/// A cluster with overlay `ov`, web01 on node1, web02 and web03 on node2, all
/// serving, and `web-lb` over `app=web` with all three healthy.
struct Web {
    c: Cluster,
    switches: PathBuf,
    exec: String,
}

impl Web {
    fn start(hint: &str, subnet: &str) -> Web {
        let world = World::new(hint).expect("a testbed world (needs root)");
        let c = Cluster::start(world, ClusterSpec::new(BIN)).expect("cluster starts");
        c.cli_ok(&["network", "create", "ov", "--type", "overlay", "--subnet", subnet])
            .unwrap();
        let script = c.world_dir().join("serve.sh");
        std::fs::write(&script, SERVE_SH).unwrap();
        let switches = c.world_dir().join("on");
        std::fs::create_dir_all(&switches).unwrap();
        let exec = format!("sh {} {}", script.display(), switches.display());
        let web = Web { c, switches, exec };
        for (vm, node) in [("web01", "node1"), ("web02", "node2"), ("web03", "node2")] {
            web.add_vm(vm, node);
        }
        web.c
            .cli_ok(&[
                "lb",
                "create",
                LB,
                "--port",
                "8080",
                "--selector",
                "app=web",
                "--interval",
                "1s",
                "--timeout",
                "500ms",
            ])
            .unwrap();
        for vm in ["web01", "web02", "web03"] {
            web.wait_health(vm, "healthy");
        }
        web
    }

    /// Creates `vm` (label `app=web`) on `node`, serving; waits until it runs and
    /// the gateway has its neighbor entry.
    fn add_vm(&self, vm: &str, node: &str) -> Value {
        self.on(vm);
        self.c
            .cli_json(&[
                "vm",
                "create",
                vm,
                "--network",
                "ov",
                "--node",
                node,
                "--label",
                "app=web",
                "--exec",
                &self.exec,
            ])
            .unwrap();
        let v = self.c.wait_vm_running(vm, WAIT).unwrap();
        let (ip, mac) = (s(&v, "ip"), s(&v, "mac"));
        wait_until(&format!("gw1 to map {ip} to {mac}"), WAIT, || {
            let out = self.c.exec_on("gw1", &["ip", "neigh", "show", ip]).ok()?;
            String::from_utf8_lossy(&out.stdout).contains(mac).then_some(())
        })
        .unwrap();
        v
    }

    /// Switches `vm`'s workload on.
    fn on(&self, vm: &str) {
        std::fs::write(self.switches.join(vm), b"").unwrap();
    }

    /// Switches `vm`'s workload off: nothing listens on its port 8080 any more.
    fn off(&self, vm: &str) {
        std::fs::remove_file(self.switches.join(vm)).unwrap();
    }

    /// `lb get web-lb -o json`.
    fn lb(&self) -> Value {
        self.c.cli_json(&["lb", "get", LB]).unwrap()
    }

    /// Waits until `lb get` shows `vm` with `health`; returns how long it took.
    fn wait_health(&self, vm: &str, health: &str) -> Duration {
        let t = Instant::now();
        wait_until(&format!("{vm} to be {health}"), WAIT, || {
            let lb = self.c.cli_json(&["lb", "get", LB]).ok()?;
            (backend(&lb, vm)?["health"] == health).then_some(())
        })
        .unwrap_or_else(|e| panic!("{e}\nlast view: {}", self.lb()));
        t.elapsed()
    }

    /// Broker decisions for `vm` in the CP's log so far.
    fn brokered_to(&self, vm: &str) -> usize {
        let needle = format!(" vm={vm} ");
        self.c
            .cp()
            .expect("CP running")
            .log()
            .lines()
            .filter(|l| l.contains("brokered") && l.contains(&needle))
            .count()
    }

    /// Sessions opened or refused by the gateway so far: any dial toward a guest
    /// shows up as one or the other.
    fn gateway_attempts(&self) -> usize {
        let gw = self.c.node("gw1").unwrap();
        gw.agent
            .as_ref()
            .expect("gateway agent running")
            .log()
            .lines()
            .filter(|l| l.contains("session open") || l.contains("refused"))
            .count()
    }
}

fn s<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field].as_str().unwrap_or_else(|| panic!("no {field} in {v}"))
}

fn backend<'a>(lb: &'a Value, vm: &str) -> Option<&'a Value> {
    lb["backends"].as_array()?.iter().find(|b| b["vm"] == vm)
}

fn backend_names(lb: &Value) -> Vec<String> {
    lb["backends"]
        .as_array()
        .map(|a| a.iter().map(|b| s(b, "vm").to_string()).collect())
        .unwrap_or_default()
}

/// `otherix forward lb/web-lb 8080` in the host namespace, and its local address.
fn forward(c: &Cluster) -> (Proc, std::net::SocketAddr) {
    c.forward(&format!("lb/{LB}"), 8080)
        .expect("otherix forward listens")
}

/// One `curl` through the forward: the answering VM's name, or curl's error.
fn curl(local: std::net::SocketAddr) -> Result<String, String> {
    otherix_testbed::tools::require_programs(&["curl"]);
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "20", &format!("http://{local}/")])
        .output()
        .unwrap();
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

fn curl_ok(local: std::net::SocketAddr) -> String {
    curl(local).unwrap_or_else(|e| panic!("curl through the forward failed: {e}"))
}

/// Curls until `vm` answers.
fn wait_served(local: std::net::SocketAddr, vm: &str) {
    wait_until(&format!("{vm} to answer through the forward"), WAIT, || {
        (curl(local).ok()? == vm).then_some(())
    })
    .unwrap();
}

/// `otherix lb list` (table): the row of `web-lb`, split on whitespace.
fn list_row(c: &Cluster) -> Vec<String> {
    let out = c.cli_ok(&["lb", "list"]).unwrap();
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "PORT", "SELECTOR", "STATUS", "TARGETS", "AGE"],
        "{out}"
    );
    lines
        .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
        .find(|r| r.first().map(String::as_str) == Some(LB))
        .unwrap_or_else(|| panic!("no {LB} row in:\n{out}"))
}

/// `otherix lb list -o json`: the entry of `web-lb`.
fn list_json(c: &Cluster) -> Value {
    let all = c.cli_json(&["lb", "list"]).unwrap();
    all.as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == LB)
        .cloned()
        .unwrap_or_else(|| panic!("no {LB} in {all}"))
}

/// `otherix lb get web-lb` (table): its `Key: value` fields and backend rows.
fn get_table(c: &Cluster) -> (String, Vec<Vec<String>>) {
    let out = c.cli_ok(&["lb", "get", LB]).unwrap();
    let rows = out
        .lines()
        .skip_while(|l| !l.starts_with("VM"))
        .skip(1)
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    (out, rows)
}

fn field<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .map(str::trim)
        .unwrap_or_else(|| panic!("no {key:?} in:\n{text}"))
}

/// Lines the forward printed for connections it could not broker.
fn forward_errors(p: &Proc) -> Vec<String> {
    p.log()
        .lines()
        .filter(|l| l.starts_with("error: connection from"))
        .map(str::to_string)
        .collect()
}

// ------------------------------------------------------------------- tests

#[test]
fn connections_spread_over_every_backend_and_list_and_get_show_the_pool() {
    let web = Web::start("lb-spread", "10.160.0.0/24");
    let c = &web.c;

    // `lb list`: table and JSON.
    let row = list_row(c);
    assert_eq!(&row[..5], [LB, "8080", "app=web", "healthy", "3/3"], "{row:?}");
    let l = list_json(c);
    assert_eq!(
        (l["status"].as_str(), l["healthy"].as_u64(), l["total"].as_u64()),
        (Some("healthy"), Some(3), Some(3))
    );
    assert_eq!(l["health_check"]["interval_ms"], 1000);
    assert_eq!(l["health_check"]["timeout_ms"], 500);

    // `lb get`: JSON, each backend on its node, probed, healthy.
    let lb = web.lb();
    assert_eq!(backend_names(&lb), ["web01", "web02", "web03"]);
    for (vm, node) in [("web01", "node1"), ("web02", "node2"), ("web03", "node2")] {
        let b = backend(&lb, vm).unwrap();
        assert_eq!((s(b, "node"), s(b, "health")), (node, "healthy"), "{b}");
        assert!(b["last_probe"].is_string() && b["last_change"].is_string(), "{b}");
        assert!(b["successes"].as_u64().unwrap() >= 1, "{b}");
        assert_eq!(b["eligible"], true);
    }
    // OK/FAIL move with the probes (every second here), not only when the
    // health changes.
    let first = backend(&lb, "web01").unwrap()["successes"].as_u64().unwrap();
    wait_until("web01's success count to move with its probes", WAIT, || {
        let now = backend(&web.lb(), "web01").unwrap()["successes"]
            .as_u64()
            .unwrap();
        (now != first).then_some(())
    })
    .unwrap();
    // ... and as a table.
    let (text, rows) = get_table(c);
    assert_eq!(field(&text, "Status:"), "healthy");
    assert_eq!(field(&text, "Targets:"), "3/3 healthy");
    assert!(
        field(&text, "Health check:").starts_with("tcp on port 8080 every 1000ms, timeout 500ms"),
        "{text}"
    );
    assert_eq!(rows.len(), 3, "{text}");
    for r in &rows {
        assert_eq!(r[3], "healthy", "{text}");
        assert_ne!(r[4], "never", "probed: {text}");
    }

    // 300 connections through one forward, each brokered anew.
    let (_fwd, local) = forward(c);
    let t = Instant::now();
    let mut counts = std::collections::BTreeMap::<String, u32>::new();
    for _ in 0..300 {
        *counts.entry(curl_ok(local)).or_default() += 1;
    }
    eprintln!("300 curls through the forward in {:?}: {counts:?}", t.elapsed());
    assert_eq!(
        counts.keys().collect::<Vec<_>>(),
        ["web01", "web02", "web03"],
        "every backend answers"
    );
    let (min, max) = (counts.values().min().unwrap(), counts.values().max().unwrap());
    assert!(
        max <= &(2 * min),
        "no backend gets more than twice another: {counts:?}"
    );

    // Relabeling takes a VM out of the pool at once: no wait.
    c.cli_ok(&["vm", "label", "web01", "app-"]).unwrap();
    assert_eq!(backend_names(&web.lb()), ["web02", "web03"]);
    assert_eq!(&list_row(c)[4], "2/2");
    let before = web.brokered_to("web01");
    for _ in 0..30 {
        assert_ne!(curl_ok(local), "web01");
    }
    assert_eq!(
        web.brokered_to("web01"),
        before,
        "nothing brokered to web01 once relabeled"
    );
    // ... and back into it.
    c.cli_ok(&["vm", "label", "web01", "app=web"]).unwrap();
    assert_eq!(backend_names(&web.lb()), ["web01", "web02", "web03"]);
    wait_served(local, "web01");

    // An HTTP check (GET /healthz, 2xx): a new target, so every verdict starts
    // over, and the guests' HTTP servers pass it.
    let switched = time::OffsetDateTime::now_utc();
    c.cli_ok(&["lb", "update", LB, "--health", "http:/healthz"])
        .unwrap();
    let t = Instant::now();
    wait_until("fresh verdicts from the HTTP check", WAIT, || {
        let lb = web.lb();
        let fresh = |b: &Value| {
            let changed = b["last_change"].as_str()?;
            let changed =
                time::OffsetDateTime::parse(changed, &time::format_description::well_known::Rfc3339).ok()?;
            (b["health"] == "healthy" && changed > switched).then_some(())
        };
        let all = lb["backends"].as_array()?;
        (all.len() == 3 && all.iter().all(|b| fresh(b).is_some())).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\nlast view: {}", web.lb()));
    eprintln!(
        "fresh healthy verdicts {:?} after switching to the HTTP check",
        t.elapsed()
    );
    let (text, _) = get_table(c);
    assert!(
        field(&text, "Health check:").starts_with("http GET /healthz on port 8080"),
        "{text}"
    );
    curl_ok(local);
}

#[test]
fn a_failing_backend_is_taken_out_until_it_serves_again_and_an_all_failing_pool_is_refused() {
    let web = Web::start("lb-health", "10.161.0.0/24");
    let c = &web.c;
    let (fwd, local) = forward(c);
    wait_served(local, "web02");

    // web02 stops serving: unhealthy after fall (3) failed probes, 1 s apart.
    web.off("web02");
    let took = web.wait_health("web02", "unhealthy");
    eprintln!("web02 unhealthy {took:?} after its workload stopped (fall 3 x interval 1s)");
    let b = backend(&web.lb(), "web02").unwrap().clone();
    assert_eq!(b["eligible"], false);
    assert!(s(&b, "reason").contains("connect:"), "{b}");
    assert!(b["failures"].as_u64().unwrap() >= 3, "{b}");
    assert_eq!(&list_row(c)[3..5], ["degraded", "2/3"]);
    // It gets no new connections: the broker never picks it.
    let before = web.brokered_to("web02");
    for _ in 0..30 {
        assert_ne!(curl_ok(local), "web02");
    }
    assert_eq!(
        web.brokered_to("web02"),
        before,
        "nothing brokered to an unhealthy backend"
    );

    // Serving again: healthy after rise (2) good probes, and served.
    web.on("web02");
    let took = web.wait_health("web02", "healthy");
    eprintln!("web02 healthy again {took:?} after its workload restarted (rise 2)");
    wait_served(local, "web02");

    // Every workload stops: the pool is unhealthy and the broker refuses,
    // with every backend's reason, before anything is dialed.
    for vm in ["web01", "web02", "web03"] {
        web.off(vm);
    }
    let t = Instant::now();
    wait_until("web-lb to be unhealthy", WAIT, || {
        (list_json(c)["status"] == "unhealthy").then_some(())
    })
    .unwrap();
    eprintln!("web-lb unhealthy {:?} after every workload stopped", t.elapsed());
    let row = list_row(c);
    assert_eq!(&row[3..5], ["unhealthy", "0/3"], "{row:?}");
    let l = list_json(c);
    assert_eq!((l["healthy"].as_u64(), l["total"].as_u64()), (Some(0), Some(3)));
    let (text, rows) = get_table(c);
    assert_eq!(field(&text, "Status:"), "unhealthy");
    assert!(rows.iter().all(|r| r[3] == "unhealthy"), "{text}");

    let (errors_before, dials_before) = (forward_errors(&fwd).len(), web.gateway_attempts());
    for _ in 0..5 {
        assert!(
            curl(local).is_err(),
            "a refused connection is closed without an answer"
        );
    }
    let errors = wait_until("one error line per refused connection", WAIT, || {
        let e = forward_errors(&fwd);
        (e.len() >= errors_before + 5).then_some(e)
    })
    .unwrap();
    let new = &errors[errors_before..];
    assert_eq!(new.len(), 5, "one line per failed connection: {new:#?}");
    for line in new {
        assert!(line.contains("has no healthy backend"), "{line}");
        for vm in ["web01", "web02", "web03"] {
            assert!(
                line.contains(&format!("{vm} (unhealthy, last probe ")),
                "{vm} and why: {line}"
            );
        }
        assert!(line.contains("connect:"), "the probe's reason: {line}");
    }
    assert_eq!(
        web.gateway_attempts(),
        dials_before,
        "no connection reached the gateway, so no guest was dialed"
    );

    // Back to serving.
    for vm in ["web01", "web02", "web03"] {
        web.on(vm);
    }
    wait_until("web-lb to be healthy", WAIT, || {
        let l = list_json(c);
        (l["status"] == "healthy" && l["healthy"] == 3).then_some(())
    })
    .unwrap();
    curl_ok(local);
}

#[test]
fn a_forward_keeping_lb_connections_ready_still_spreads_them_and_serves_a_failed_backend_no_longer_than_its_hold(
) {
    let web = Web::start("lb-ready", "10.164.0.0/24");
    let c = &web.c;
    // Asked for: off by default for an LB (each ready credential has its
    // backend chosen when it is minted), held 2 s.
    let (fwd, local) = c
        .forward_with(&format!("lb/{LB}"), 8080, &["--ready", "2", "--ready-keep", "2s"])
        .expect("otherix forward listens");
    let mut seen = BTreeSet::new();
    wait_until(
        "every backend to answer through the ready connections",
        WAIT,
        || {
            seen.insert(curl_ok(local));
            (seen.len() == 3).then_some(())
        },
    )
    .unwrap();
    assert!(
        fwd.log()
            .lines()
            .any(|l| l.contains("connection forwarded") && l.contains("ready=true")),
        "ready connections were used: {}",
        fwd.log()
    );

    // web02 fails; once it is confirmed unhealthy, a credential minted for
    // it before is used at most for the hold (2 s), never after.
    web.off("web02");
    web.wait_health("web02", "unhealthy");
    std::thread::sleep(Duration::from_millis(2_500));
    for _ in 0..30 {
        match curl(local) {
            Ok(vm) => assert_ne!(vm, "web02"),
            Err(e) => panic!(
                "past the hold, every connection goes to a healthy backend: {e}\n{}",
                fwd.log()
            ),
        }
    }
}

#[test]
fn a_new_backend_is_served_before_its_first_verdict() {
    let web = Web::start("lb-new", "10.162.0.0/24");
    let c = &web.c;
    let (_fwd, local) = forward(c);

    // Probes a day apart (the agents reschedule at once, within the new interval):
    // the first probe of a new backend comes at a random point in that day, so it
    // stays without a verdict for the rest of this test (but for a ~1-in-3000 draw).
    // The old verdicts stay fresh: staleness is 3 intervals now.
    c.cli_ok(&["lb", "update", LB, "--interval", "24h"]).unwrap();
    web.add_vm("web04", "node2");
    let lb = web.lb();
    let b = backend(&lb, "web04").expect("web04 joined the pool at once");
    assert_eq!(
        (s(b, "health"), b["eligible"].as_bool()),
        ("unknown", Some(true)),
        "{b}"
    );
    assert!(b["last_probe"].is_null(), "not probed yet: {b}");
    assert_eq!(&list_row(c)[3..5], ["healthy", "3/4"]);

    wait_served(local, "web04");
    let lb = web.lb();
    let b = backend(&lb, "web04").unwrap();
    assert_eq!(s(b, "health"), "unknown", "served while unknown: {b}");
    assert!(b["last_probe"].is_null(), "served before its first probe: {b}");

    // Back to 1 s: the changed parameters take effect, and web04 gets its verdict.
    c.cli_ok(&["lb", "update", LB, "--interval", "1s"]).unwrap();
    let took = web.wait_health("web04", "healthy");
    eprintln!("web04 healthy {took:?} after the interval went back to 1s");
}

#[test]
fn backends_of_a_dead_agent_turn_unknown_and_are_passed_over_while_a_ready_nodes_backend_is_eligible() {
    let mut web = Web::start("lb-agent", "10.163.0.0/24");
    let (_fwd, local) = forward(&web.c);

    // node2's agent dies: its guests (web02, web03) keep running, but nobody
    // probes them or reports on them any more.
    web.c.kill_agent("node2").unwrap();
    let t = Instant::now();
    web.wait_health("web02", "unknown");
    web.wait_health("web03", "unknown");
    eprintln!(
        "node2's backends unknown {:?} after its agent was killed (staleness 15 s)",
        t.elapsed()
    );
    // Its node goes NotReady: its backends stay eligible (unknown fails
    // toward serving) but are passed over while a backend on a Ready node
    // is eligible — a dead node's guests would make clients wait and fail.
    let lb = wait_until("node2's backends to show their node NotReady", WAIT, || {
        let lb = web.lb();
        ["web02", "web03"]
            .iter()
            .all(|vm| backend(&lb, vm).is_some_and(|b| b["node_ready"] == false))
            .then_some(lb)
    })
    .unwrap();
    for vm in ["web02", "web03"] {
        let b = backend(&lb, vm).unwrap();
        assert_eq!(b["eligible"], true, "unknown stays eligible: {b}");
        assert!(
            b["last_probe"].is_string(),
            "the stale verdict's probe time is still shown: {b}"
        );
    }
    assert_eq!(s(backend(&lb, "web01").unwrap(), "health"), "healthy");
    assert_eq!(&list_row(&web.c)[3..5], ["healthy", "1/3"]);
    let shown = web.c.cli_ok(&["lb", "get", LB]).unwrap();
    assert!(shown.contains("unknown (node NotReady)"), "{shown}");
    for _ in 0..10 {
        assert_eq!(curl_ok(local), "web01", "a backend on a NotReady node was chosen");
    }

    // The agent comes back: fresh verdicts, and its backends are served again.
    web.c.start_agent("node2").unwrap();
    web.wait_health("web02", "healthy");
    web.wait_health("web03", "healthy");
    wait_served(local, "web02");
    wait_served(local, "web03");
}

#[test]
fn an_lb_over_bridge_vms_works_through_the_relay() {
    let world = World::new("lb-relay").expect("a testbed world (needs root)");
    let c = Cluster::start(world, ClusterSpec::new(BIN)).expect("cluster starts");
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.131.0.0/24",
        "--node",
        "node1",
    ])
    .unwrap();
    for vm in ["lab01", "lab02"] {
        c.cli_ok(&[
            "vm",
            "create",
            vm,
            "--network",
            "lab",
            "--label",
            "app=web",
            "--exec",
            "otherix guest http --port 8080",
        ])
        .unwrap();
        c.wait_vm_running(vm, WAIT).unwrap();
    }
    c.cli_ok(&[
        "lb",
        "create",
        LB,
        "--port",
        "8080",
        "--selector",
        "app=web",
        "--interval",
        "1s",
        "--timeout",
        "500ms",
    ])
    .unwrap();
    // node1 probes its bridge guests from the bridge's own address.
    wait_until("both bridge backends to be healthy", WAIT, || {
        let lb = c.cli_json(&["lb", "get", LB]).ok()?;
        (lb["healthy"] == 2).then_some(())
    })
    .unwrap();
    let (_fwd, local) = forward(&c);
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        seen.insert(curl_ok(local));
    }
    assert_eq!(
        seen,
        ["lab01", "lab02"].iter().map(|s| s.to_string()).collect(),
        "both bridge backends answer through the relay"
    );
    let audit = c.cli_json(&["audit", "--target", "lab01"]).unwrap();
    let relayed = audit
        .as_array()
        .unwrap()
        .iter()
        .any(|e| e["transport"] == "relay" && e["allowed"] == true);
    assert!(relayed, "the broker chose the relay for bridge backends: {audit}");
}
