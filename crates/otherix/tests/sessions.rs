//! Session reports at the API level: a gateway node (a real CP, a fake
//! agent) reports session starts and ends in its heartbeats; `otherix
//! session list` and `otherix audit` show them. The end-to-end version, with
//! real gateways, the relay and byte counts checked against what was sent,
//! is in `audit_e2e.rs`.

mod common;

use common::fake_node::{empty_heartbeat, enroll_as, rt};
use common::Cp;
use otherix_client::{Client, ClientError};
use otherix_proto::agent::{DesiredState, Heartbeat, NodeRoles, SessionEvent, MAX_SESSION_EVENTS};
use serde_json::Value;
use time::OffsetDateTime;

fn gw_beat(gw: &Client, epoch: &str, events: Vec<SessionEvent>) -> Result<DesiredState, ClientError> {
    gw_beat_as(gw, Some("10.213.1.13:8443"), epoch, events)
}

fn gw_beat_as(
    gw: &Client,
    gateway: Option<&str>,
    epoch: &str,
    events: Vec<SessionEvent>,
) -> Result<DesiredState, ClientError> {
    rt().block_on(gw.heartbeat(&Heartbeat {
        node: "gw".into(),
        roles: Some(NodeRoles {
            hypervisor: false,
            gateway: gateway.map(Into::into),
            relay: None,
        }),
        vtep: "10.213.1.13".into(),
        session_epoch: Some(epoch.into()),
        session_events: events,
        ..empty_heartbeat()
    }))
}

fn start(id: &str, principal: &str, vm: &str) -> SessionEvent {
    SessionEvent::Start {
        session: id.into(),
        at: OffsetDateTime::now_utc(),
        principal: principal.into(),
        vm: vm.into(),
        port: 22,
        network: "ov".into(),
    }
}

fn end(id: &str, principal: &str, vm: &str, up: u64, down: u64) -> SessionEvent {
    SessionEvent::End {
        session: id.into(),
        at: OffsetDateTime::now_utc(),
        principal: principal.into(),
        vm: vm.into(),
        port: 22,
        network: "ov".into(),
        bytes_up: up,
        bytes_down: down,
        duration_ms: 1500,
        reason: "closed".into(),
    }
}

fn ids(list: &Value) -> Vec<String> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_string())
        .collect()
}

fn session_records(audit: &Value, id: &str) -> Vec<Value> {
    audit
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["session"] == id)
        .cloned()
        .collect()
}

#[test]
fn gateway_reports_open_and_close_sessions_and_each_is_audited_once() {
    let cp = Cp::start();
    let admin = cp.admin();
    admin.ok(&["user", "create", "uma", "--role", "user"]);
    admin.ok(&["user", "create", "vera", "--role", "viewer"]);
    let uma = admin.with_token(admin.ok(&["user", "token", "create", "uma"]).trim());
    let vera = admin.with_token(admin.ok(&["user", "token", "create", "vera"]).trim());
    let gw = enroll_as(&cp, "gw", "10.213.1.13", true);

    let first = start("s-uma", "user:uma", "web01");
    std::thread::sleep(std::time::Duration::from_millis(5));
    gw_beat(&gw, "run1", vec![first, start("s-acme", "grant:acme", "db01")]).unwrap();
    let open = admin.json(&["session", "list"]);
    assert_eq!(ids(&open), ["s-uma", "s-acme"]);
    let first = &open[0];
    assert_eq!(first["principal"], "user:uma");
    assert_eq!(first["target"], "web01");
    assert_eq!(first["port"], 22);
    assert_eq!(first["transport"], "gateway");
    assert_eq!(first["node"], "gw");
    // Filters; a viewer sees all, a user only their own.
    assert_eq!(
        ids(&admin.json(&["session", "list", "--principal", "grant:acme"])),
        ["s-acme"]
    );
    assert_eq!(
        ids(&admin.json(&["session", "list", "--target", "web01"])),
        ["s-uma"]
    );
    assert_eq!(ids(&vera.json(&["session", "list"])).len(), 2);
    assert_eq!(ids(&uma.json(&["session", "list"])), ["s-uma"]);
    let table = admin.ok(&["session", "list"]);
    assert!(
        table.contains("PRINCIPAL") && table.contains("grant:acme") && table.contains("db01:22"),
        "{table}"
    );

    // The end, sent twice (a heartbeat answer lost on the way back).
    let ending = vec![end("s-uma", "user:uma", "web01", 1000, 2000)];
    gw_beat(&gw, "run1", ending.clone()).unwrap();
    gw_beat(&gw, "run1", ending).unwrap();
    assert_eq!(ids(&admin.json(&["session", "list"])), ["s-acme"]);
    let audit = admin.json(&["audit"]);
    let records = session_records(&audit, "s-uma");
    assert_eq!(records.len(), 2, "one start and one end: {records:?}");
    assert_eq!(records[0]["action"], "session_start");
    let end_record = &records[1];
    assert_eq!(end_record["action"], "session_end");
    assert_eq!(end_record["principal"], "user:uma");
    assert_eq!(end_record["transport"], "gateway");
    assert_eq!(end_record["node"], "gw");
    assert_eq!(end_record["bytes_up"], 1000);
    assert_eq!(end_record["bytes_down"], 2000);
    assert_eq!(end_record["duration_ms"], 1500);
    assert_eq!(end_record["reason"], "closed");
    let table = admin.ok(&["audit"]);
    assert!(
        table.contains("closed after 1.5s, 1000 B up, 2.0 KiB down via gw"),
        "{table}"
    );

    // The gateway restarts: what it had open is recorded as ended.
    gw_beat(&gw, "run2", vec![]).unwrap();
    assert!(ids(&admin.json(&["session", "list"])).is_empty());
    let audit = admin.json(&["audit", "--principal", "grant:acme"]);
    let records = session_records(&audit, "s-acme");
    assert_eq!(records.last().unwrap()["reason"], "gateway restarted");
    assert!(records.last().unwrap().get("bytes_up").is_none());
    assert!(admin.ok(&["session", "list"]).is_empty());
}

#[test]
fn session_reports_from_a_node_without_the_gateway_role_are_ignored_and_too_many_at_once_refused() {
    let cp = Cp::start();
    let admin = cp.admin();
    let gw = enroll_as(&cp, "gw", "10.213.1.13", true);
    // A hypervisor was never granted the gateway role: its reports are
    // ignored (and logged), its heartbeat is not refused.
    let hv = enroll_as(&cp, "hv", "10.213.1.11", false);
    rt().block_on(hv.heartbeat(&Heartbeat {
        node: "hv".into(),
        vtep: "10.213.1.11".into(),
        session_epoch: Some("run1".into()),
        session_events: vec![start("s1", "user:x", "web01")],
        ..empty_heartbeat()
    }))
    .unwrap();
    assert!(
        ids(&admin.json(&["session", "list"])).is_empty(),
        "nothing recorded"
    );
    assert!(cp
        .log()
        .contains("ignored session reports: not from a granted gateway"));
    // Nor does a gateway make itself something else by what it says.
    let err = gw_beat_as(&gw, None, "run1", vec![start("s1", "user:x", "web01")]).unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("differ from its grant"), "{err}");
    let many: Vec<_> = (0..=MAX_SESSION_EVENTS)
        .map(|i| start(&format!("s{i}"), "user:x", "web01"))
        .collect();
    let err = gw_beat(&gw, "run1", many).unwrap_err();
    assert!(err.to_string().contains("at most 2000"), "{err}");
    // Refused reports leave nothing behind; the same reports in allowed sizes go in.
    assert!(ids(&admin.json(&["session", "list"])).is_empty());
    let batch: Vec<_> = (0..MAX_SESSION_EVENTS)
        .map(|i| start(&format!("s{i}"), "user:x", "web01"))
        .collect();
    gw_beat(&gw, "run1", batch).unwrap();
    assert_eq!(ids(&admin.json(&["session", "list"])).len(), MAX_SESSION_EVENTS);
}

#[test]
fn a_principal_at_its_session_cap_is_refused_429_and_others_are_not() {
    let cp = Cp::start_with(common::TempDir::new("cp"), &["--max-sessions-per-principal", "2"]);
    let admin = cp.admin();
    admin.ok(&["user", "create", "uma", "--role", "user"]);
    let uma_token = admin.ok(&["user", "token", "create", "uma"]).trim().to_string();
    let gw = enroll_as(&cp, "gw", "10.213.1.13", true);
    let call = |token: &str| {
        common::curl(
            &cp,
            &[
                "-i",
                "-X",
                "POST",
                "-H",
                &format!("Authorization: Bearer {token}"),
                "-H",
                "Content-Type: application/json",
                "-d",
                r#"{"target":"ghost","port":22}"#,
                &format!("{}/v1/broker", cp.url),
            ],
        )
    };
    let admin_token = common::admin_token(&cp);
    // One session open: still decided (the VM does not exist).
    gw_beat(&gw, "run1", vec![start("s1", "user:admin", "web01")]).unwrap();
    assert_eq!(call(&admin_token).0, 404);
    // Two: at the cap, refused before anything else is looked at.
    gw_beat(&gw, "run1", vec![start("s2", "user:admin", "web01")]).unwrap();
    let (status, body) = call(&admin_token);
    assert_eq!(status, 429, "{body}");
    assert!(
        body.contains("session_cap") && body.contains("user:admin has 2 sessions open"),
        "{body}"
    );
    assert!(body.to_ascii_lowercase().contains("retry-after: 5"), "{body}");
    // Another principal is not held by it.
    assert_eq!(call(&uma_token).0, 404);
    // A session ends: room again.
    gw_beat(&gw, "run1", vec![end("s1", "user:admin", "web01", 1, 1)]).unwrap();
    assert_eq!(call(&admin_token).0, 404);
    // The refusal is audited with its reason.
    let audit = admin.json(&["audit", "--principal", "user:admin"]);
    assert!(
        audit
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["allowed"] == false
                && e["reason"].as_str().is_some_and(|r| r.contains("sessions open"))),
        "{audit}"
    );
}
