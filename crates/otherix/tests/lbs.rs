//! Load balancers on a real `otherix server`, with nodes speaking the agent
//! protocol: computed pools, verdicts, eligibility, broker-time choice.

mod common;

use std::collections::BTreeMap;

use common::fake_node::{beat, empty_heartbeat, enroll_as, rt};
use common::{admin_token, Cp};
use otherix_client::Client;
use otherix_proto::agent::{DesiredState, HealthReport, Heartbeat, NodeRoles};
use otherix_proto::BrokerRequest;
use serde_json::Value;

struct World {
    cp: Cp,
    admin: common::Cli,
    n1: Client,
    n2: Client,
    gw: Client,
    api: Client,
}

fn vm_ids(admin: &common::Cli, node: &str) -> Vec<String> {
    admin
        .json(&["vm", "list"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["node"] == node)
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect()
}

fn id_of(admin: &common::Cli, vm: &str) -> String {
    admin.json(&["vm", "get", vm])["id"].as_str().unwrap().to_string()
}

/// Heartbeat for a hypervisor that runs its guests and reports `health`.
fn report(w: &World, node: &str, health: Vec<HealthReport>) -> DesiredState {
    report_as(w, node, health, false)
}

/// [`report`], saying whether `health` holds only the changed verdicts.
fn report_as(w: &World, node: &str, health: Vec<HealthReport>, changes_only: bool) -> DesiredState {
    let client = if node == "n1" { &w.n1 } else { &w.n2 };
    let vtep = if node == "n1" {
        "10.213.1.11"
    } else {
        "10.213.1.12"
    };
    rt().block_on(client.heartbeat(&Heartbeat {
        node: node.into(),
        roles: Some(NodeRoles {
            hypervisor: true,
            gateway: None,
            relay: None,
        }),
        vtep: vtep.into(),
        guests: otherix_testbed::fake_node::running(vm_ids(&w.admin, node)),
        health,
        health_changes_only: changes_only,
        ..empty_heartbeat()
    }))
    .unwrap()
}

fn verdict(lb: &str, vm_id: &str, health: &str, reason: Option<&str>) -> HealthReport {
    HealthReport {
        lb: lb.into(),
        vm_id: vm_id.into(),
        health: otherix_proto::Health::parse(health).unwrap(),
        probed_at: time::OffsetDateTime::now_utc(),
        changed_at: Some(time::OffsetDateTime::now_utc()),
        reason: reason.map(Into::into),
        successes: 0,
        failures: 3,
    }
}

/// web01 on n1, web02 and web03 on n2 (app=web), all running, and a gateway.
fn world() -> World {
    world_with(&[])
}

/// [`world`] on a CP started with more `otherix server` arguments.
fn world_with(args: &[&str]) -> World {
    let cp = Cp::start_with(common::TempDir::new("cp"), args);
    let admin = cp.admin();
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    let n2 = enroll_as(&cp, "n2", "10.213.1.12", false);
    let gw = enroll_as(&cp, "gw", "10.213.1.13", true);
    beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    beat(&n2, "n2", "10.213.1.12", true, None).unwrap();
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    admin.ok(&[
        "vm",
        "create",
        "web01",
        "--network",
        "ov",
        "--node",
        "n1",
        "-l",
        "app=web",
    ]);
    admin.ok(&[
        "vm",
        "create",
        "web02",
        "--network",
        "ov",
        "--node",
        "n2",
        "-l",
        "app=web",
    ]);
    admin.ok(&[
        "vm",
        "create",
        "web03",
        "--network",
        "ov",
        "--node",
        "n2",
        "-l",
        "app=web",
    ]);
    let api = Client::new(&cp.url, &cp.ca_pem(), Some(admin_token(&cp))).unwrap();
    let w = World {
        cp,
        admin,
        n1,
        n2,
        gw,
        api,
    };
    report(&w, "n1", vec![]);
    report(&w, "n2", vec![]);
    beat(&w.gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    w
}

fn broker(
    w: &World,
    target: &str,
    port: u16,
    exclude: &[&str],
) -> Result<String, otherix_client::ClientError> {
    rt().block_on(w.api.broker(&BrokerRequest {
        target: target.into(),
        port: u32::from(port),
        exclude: exclude.iter().map(|s| s.to_string()).collect(),
    }))
    .map(|r| r.vm)
}

#[test]
fn lb_settings_are_validated() {
    let w = world();
    let err = w.admin.fails(&[
        "lb",
        "create",
        "x",
        "--port",
        "80",
        "--selector",
        "app=web",
        "--interval",
        "1s",
        "--timeout",
        "2s",
    ]);
    assert!(err.contains("below the interval"), "{err}");
    let err = w
        .admin
        .fails(&["lb", "create", "x", "--port", "80", "--selector", "app in (web"]);
    assert!(err.contains("invalid selector"), "{err}");
    let err = w.admin.fails(&[
        "lb",
        "create",
        "x",
        "--port",
        "80",
        "--selector",
        "app=web",
        "--health",
        "udp",
    ]);
    assert!(err.contains("`tcp` or `http:/path`"), "{err}");
    w.admin.ok(&[
        "lb",
        "create",
        "x",
        "--port",
        "80",
        "--selector",
        "app=web",
        "--health",
        "http:/healthz",
    ]);
    let err = w
        .admin
        .fails(&["lb", "create", "x", "--port", "80", "--selector", "app=web"]);
    assert!(err.contains("already exists"), "{err}");
    let err = w.admin.fails(&["lb", "update", "x", "--timeout", "10s"]);
    assert!(err.contains("below the interval"), "{err}");
    assert_eq!(
        w.admin.json(&["lb", "get", "x"])["health_check"]["timeout_ms"],
        2000,
        "a refused update changes nothing"
    );
}

#[test]
fn unknown_backends_are_served_and_connections_spread() {
    let w = world();
    w.admin
        .ok(&["lb", "create", "web-lb", "--port", "80", "--selector", "app=web"]);
    let list = w.admin.json(&["lb", "list"]);
    // Served, but nothing says they work yet: not "healthy" with 0/3.
    assert_eq!(list[0]["status"], "unknown", "no backend has a verdict yet");
    assert_eq!(
        (list[0]["healthy"].as_u64(), list[0]["total"].as_u64()),
        (Some(0), Some(3))
    );
    let table = w.admin.ok(&["lb", "list"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "PORT", "SELECTOR", "STATUS", "TARGETS", "AGE"]);
    assert!(table.contains("0/3"), "{table}");

    let mut counts: BTreeMap<String, u32> = BTreeMap::new();
    for _ in 0..300 {
        *counts
            .entry(broker(&w, "lb/web-lb", 80, &[]).unwrap())
            .or_default() += 1;
    }
    assert_eq!(counts.len(), 3, "every backend is chosen: {counts:?}");
    let (min, max) = (counts.values().min().unwrap(), counts.values().max().unwrap());
    assert!(*max <= 2 * min, "none more than twice another: {counts:?}");

    let err = broker(&w, "lb/web-lb", 81, &[]).unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    let err = broker(&w, "lb/nope", 80, &[]).unwrap_err();
    assert_eq!(err.status(), Some(404), "{err}");
    for _ in 0..20 {
        assert_ne!(
            broker(&w, "lb/web-lb", 80, &["web01"]).unwrap(),
            "web01",
            "excluded backends are skipped"
        );
    }
    // A client leaves out the few backends it just failed to reach, never
    // a pool: a long or malformed list is refused before any is looked at.
    let many: Vec<String> = (0..9).map(|i| format!("vm{i}")).collect();
    let many: Vec<&str> = many.iter().map(String::as_str).collect();
    let err = broker(&w, "lb/web-lb", 80, &many).unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(err.to_string().contains("at most 8"), "{err}");
    let err = broker(&w, "lb/web-lb", 80, &["web01", "bad name\n"]).unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(
        err.to_string().contains("invalid exclude entry \"bad name\\n\""),
        "{err}"
    );
    assert_ne!(
        broker(&w, "lb/web-lb", 80, &many[..8]).unwrap(),
        "",
        "eight are fine"
    );
}

#[test]
fn unhealthy_backends_get_no_connections_and_all_unhealthy_is_refused_with_reasons() {
    let w = world();
    w.admin
        .ok(&["lb", "create", "web-lb", "--port", "80", "--selector", "app=web"]);
    let d = report(&w, "n2", vec![]);
    let checks: Vec<&str> = d.health_checks.iter().map(|c| c.lb.as_str()).collect();
    assert_eq!(checks, ["web-lb", "web-lb"], "n2 probes its two backends");
    assert!(d
        .health_checks
        .iter()
        .all(|c| c.port == 80 && c.kind == otherix_proto::ProbeKind::Tcp && c.network == "ov"));

    let web01 = id_of(&w.admin, "web01");
    report(
        &w,
        "n1",
        vec![verdict("web-lb", &web01, "unhealthy", Some("connection refused"))],
    );
    let lb = w.admin.json(&["lb", "get", "web-lb"]);
    assert_eq!(lb["status"], "degraded");
    let b = lb["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["vm"] == "web01")
        .unwrap()
        .clone();
    assert_eq!(
        (
            b["health"].as_str(),
            b["reason"].as_str(),
            b["eligible"].as_bool()
        ),
        (Some("unhealthy"), Some("connection refused"), Some(false))
    );
    for _ in 0..50 {
        assert_ne!(broker(&w, "lb/web-lb", 80, &[]).unwrap(), "web01");
    }
    let table = w.admin.ok(&["lb", "get", "web-lb"]);
    assert!(
        table.contains("connection refused") && table.contains("HEALTH"),
        "{table}"
    );

    // A verdict about a VM the reporting node does not own is ignored.
    let web02 = id_of(&w.admin, "web02");
    report(
        &w,
        "n1",
        vec![verdict("web-lb", &web02, "unhealthy", Some("lies"))],
    );
    assert_eq!(w.admin.json(&["lb", "get", "web-lb"])["status"], "degraded");

    let web03 = id_of(&w.admin, "web03");
    report(
        &w,
        "n2",
        vec![
            verdict("web-lb", &web02, "unhealthy", Some("timed out")),
            verdict("web-lb", &web03, "unhealthy", Some("connection refused")),
        ],
    );
    let err = broker(&w, "lb/web-lb", 80, &[]).unwrap_err();
    assert_eq!(
        (err.status(), err.code()),
        (Some(503), Some("no_healthy_backend"))
    );
    let msg = err.to_string();
    for vm in ["web01", "web02", "web03"] {
        assert!(msg.contains(vm), "every backend is listed: {msg}");
    }
    assert!(msg.contains("timed out") && msg.contains("last probe"), "{msg}");
    let list = w.admin.json(&["lb", "list"]);
    assert_eq!(
        (list[0]["status"].as_str(), list[0]["healthy"].as_u64()),
        (Some("unhealthy"), Some(0))
    );

    // Healthy again: served again.
    report(&w, "n2", vec![verdict("web-lb", &web03, "healthy", None)]);
    assert_eq!(broker(&w, "lb/web-lb", 80, &[]).unwrap(), "web03");
}

#[test]
fn the_pool_follows_labels_at_once() {
    let w = world();
    w.admin.ok(&[
        "lb",
        "create",
        "web-lb",
        "--port",
        "80",
        "--selector",
        "app=web,tier!=canary",
    ]);
    w.admin.ok(&["vm", "label", "web01", "tier=canary"]);
    assert_eq!(w.admin.json(&["lb", "list"])[0]["total"], 2);
    for _ in 0..30 {
        assert_ne!(
            broker(&w, "lb/web-lb", 80, &[]).unwrap(),
            "web01",
            "relabeled out of the pool"
        );
    }
    w.admin.ok(&[
        "vm",
        "create",
        "web04",
        "--network",
        "ov",
        "--node",
        "n1",
        "-l",
        "app=web",
    ]);
    report(&w, "n1", vec![]);
    let got: Vec<String> = (0..60)
        .map(|_| broker(&w, "lb/web-lb", 80, &[]).unwrap())
        .collect();
    assert!(
        got.iter().any(|v| v == "web04"),
        "a new VM is served before its first verdict"
    );
    w.admin
        .ok(&["lb", "update", "web-lb", "--selector", "app=nothing"]);
    let err = broker(&w, "lb/web-lb", 80, &[]).unwrap_err();
    assert_eq!(err.code(), Some("no_backends"), "{err}");
    let v: Value = w.admin.json(&["lb", "list"]);
    assert_eq!(v[0]["status"], "no_backends");
    w.admin.ok(&["lb", "delete", "web-lb"]);
    assert!(w.admin.json(&["lb", "list"]).as_array().unwrap().is_empty());
    drop(w.cp);
}

#[test]
fn a_verdict_stands_while_its_node_vouches_for_it_and_goes_stale_when_not() {
    let w = world();
    w.admin
        .ok(&["lb", "create", "web-lb", "--port", "80", "--selector", "app=web"]);
    let (web01, web02) = (id_of(&w.admin, "web01"), id_of(&w.admin, "web02"));
    report(
        &w,
        "n1",
        vec![verdict("web-lb", &web01, "unhealthy", Some("connect: refused"))],
    );
    report(
        &w,
        "n2",
        vec![verdict("web-lb", &web02, "unhealthy", Some("connect: refused"))],
    );
    let health = |vm: &str| -> String {
        let v = w.admin.json(&["lb", "get", "web-lb"]);
        let b = v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["vm"] == vm)
            .unwrap()
            .clone();
        b["health"].as_str().unwrap().to_string()
    };
    assert_eq!(
        (health("web01"), health("web02")),
        ("unhealthy".into(), "unhealthy".into())
    );
    // Past the staleness bound (15 s): n1 says "nothing changed" each time,
    // n2 sends a whole set that no longer holds its verdict.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(17);
    while std::time::Instant::now() < until {
        report_as(&w, "n1", vec![], true);
        report(&w, "n2", vec![]);
        beat(&w.gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
        std::thread::sleep(std::time::Duration::from_secs(2));
    }
    assert_eq!(health("web01"), "unhealthy", "vouched for by n1 every heartbeat");
    assert_eq!(
        health("web02"),
        "unknown",
        "not reported for longer than the bound"
    );
    for _ in 0..20 {
        assert_ne!(broker(&w, "lb/web-lb", 80, &[]).unwrap(), "web01");
    }
}

/// Whether `otherix node list` shows `node` as `status`.
fn node_is(w: &World, node: &str, status: &str) -> bool {
    w.admin
        .json(&["node", "list"])
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n["name"] == node && n["status"] == status)
}

#[test]
fn backends_on_a_not_ready_node_are_served_only_when_no_other_backend_is() {
    // Short, for the test to see a node turn NotReady; long enough that the
    // nodes kept up stay Ready between their heartbeats on a busy machine.
    let w = world_with(&["--node-timeout", "5s"]);
    w.admin
        .ok(&["lb", "create", "web-lb", "--port", "80", "--selector", "app=web"]);
    let gateway_up = || {
        beat(&w.gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    };
    // n1 (web01) stops heartbeating; n2 and the gateway go on.
    let keep_up = || {
        report(&w, "n2", vec![]);
        gateway_up();
    };
    otherix_testbed::wait_until("n1 to be NotReady", std::time::Duration::from_secs(30), || {
        keep_up();
        node_is(&w, "n1", "NotReady").then_some(())
    })
    .unwrap();
    keep_up();
    assert!(node_is(&w, "n2", "Ready"));
    let lb = w.admin.json(&["lb", "get", "web-lb"]);
    let web01 = lb["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["vm"] == "web01")
        .unwrap()
        .clone();
    assert_eq!(
        (
            web01["health"].as_str(),
            web01["eligible"].as_bool(),
            web01["node_ready"].as_bool()
        ),
        (Some("unknown"), Some(true), Some(false)),
        "{lb}"
    );
    keep_up();
    let table = w.admin.ok(&["lb", "get", "web-lb"]);
    let row = table.lines().find(|l| l.starts_with("web01")).unwrap();
    assert!(row.contains("unknown (node NotReady)"), "{table}");

    // web01 has had no connection, so P2C alone would favour it.
    let mut counts: BTreeMap<String, u32> = BTreeMap::new();
    for _ in 0..60 {
        keep_up();
        *counts
            .entry(broker(&w, "lb/web-lb", 80, &[]).unwrap())
            .or_default() += 1;
    }
    assert_eq!(
        counts.keys().map(String::as_str).collect::<Vec<_>>(),
        ["web02", "web03"],
        "every connection goes to the Ready node's backends: {counts:?}"
    );

    // n2 stops too: backends on NotReady nodes are all there is, and served.
    otherix_testbed::wait_until("n2 to be NotReady", std::time::Duration::from_secs(30), || {
        gateway_up();
        node_is(&w, "n2", "NotReady").then_some(())
    })
    .unwrap();
    let mut served = std::collections::BTreeSet::new();
    for _ in 0..30 {
        gateway_up();
        served.insert(broker(&w, "lb/web-lb", 80, &[]).unwrap());
    }
    assert!(!served.is_empty() && served.len() <= 3, "{served:?}");
    assert!(
        served.contains("web01"),
        "web01, with the fewest connections, is served again: {served:?}"
    );
}
