//! Session reports at the API level: a gateway node (a real CP, a fake
//! agent) reports session starts and ends in its heartbeats, each with the
//! credential the session was opened with; `otherix session list` and
//! `otherix audit` show them. A report the control plane cannot stand
//! behind (no credential, one issued to another gateway or for another
//! session, a tampered one) records nothing. The end-to-end version, with
//! real gateways, the relay and byte counts checked against what was sent,
//! is in `audit_e2e.rs`.

mod common;

use common::fake_node::{empty_heartbeat, enroll_as, rt, running_on_overlay};
use common::{Cli, Cp};
use otherix_client::{Client, ClientError};
use otherix_core::credential::{verify, Expected, KeySet};
use otherix_proto::agent::{DesiredState, Heartbeat, NodeRoles, SessionEvent, MAX_SESSION_EVENTS};
use serde_json::Value;
use time::OffsetDateTime;

fn gw_beat(gw: &Client, epoch: &str, events: Vec<SessionEvent>) -> Result<DesiredState, ClientError> {
    gw_beat_as(gw, "gw", "10.213.1.13", Some("10.213.1.13:8443"), epoch, events)
}

fn gw_beat_as(
    gw: &Client,
    node: &str,
    vtep: &str,
    gateway: Option<&str>,
    epoch: &str,
    events: Vec<SessionEvent>,
) -> Result<DesiredState, ClientError> {
    rt().block_on(gw.heartbeat(&Heartbeat {
        node: node.into(),
        roles: Some(NodeRoles {
            hypervisor: false,
            gateway: gateway.map(Into::into),
            relay: None,
        }),
        vtep: vtep.into(),
        session_epoch: Some(epoch.into()),
        session_events: events,
        session_bytes: Vec::new(),
        reads_one_session_revocations: false,
        ..empty_heartbeat()
    }))
}

/// A credential the broker minted, and the session id it names (its `jti`).
#[derive(Clone)]
struct Minted {
    token: String,
    jti: String,
}

/// The cluster: VMs `web01` (label `app=web`) and `db01` running on
/// hypervisor `hv` on overlay `ov`, and gateway `gw` covering it.
struct Scene {
    cp: Cp,
    admin: Cli,
    gw: Client,
    keys: KeySet,
}

impl Scene {
    fn new(cp: Cp) -> Scene {
        let admin = cp.admin();
        running_on_overlay(&cp, &admin, &[("web01", "app=web"), ("db01", "app=db")]);
        let gw = enroll_as(&cp, "gw", "10.213.1.13", true);
        let desired = gw_beat(&gw, "run1", vec![]).unwrap();
        let mut keys = KeySet::new();
        for k in desired.session_keys {
            keys.insert(k.kid, &hex::decode(&k.public).unwrap()).unwrap();
        }
        assert!(!keys.is_empty(), "the gateway learnt the session keys");
        Scene { cp, admin, gw, keys }
    }

    /// A credential for `vm:22` brokered with API token `token` (through `gw`).
    fn mint(&self, token: &str, vm: &str) -> Minted {
        let (status, body) = self.broker(token, vm);
        assert_eq!(status, 200, "{body}");
        let answer = json_body(&body);
        let token = answer["credential"].as_str().unwrap().to_string();
        let claims = verify(
            &token,
            &self.keys,
            &Expected::new("gw"),
            OffsetDateTime::now_utc(),
        )
        .unwrap();
        Minted {
            token,
            jti: claims.jti,
        }
    }

    /// `POST /v1/broker` for `vm:22` with `token`: status and body.
    fn broker(&self, token: &str, vm: &str) -> (u16, String) {
        common::curl(
            &self.cp,
            &[
                "-i",
                "-X",
                "POST",
                "-H",
                &format!("Authorization: Bearer {token}"),
                "-H",
                "Content-Type: application/json",
                "-d",
                &format!(r#"{{"target":"{vm}","port":22}}"#),
                &format!("{}/v1/broker", self.cp.url),
            ],
        )
    }
}

/// The JSON body of an answer read with `curl -i` (headers first).
fn json_body(text: &str) -> Value {
    let body = text.split("\r\n\r\n").last().unwrap_or(text);
    serde_json::from_str(body).unwrap_or(Value::Null)
}

/// A start report of `m` naming `principal` and `vm` (the control plane
/// takes both from the credential, whatever the report says).
fn start(m: &Minted, principal: &str, vm: &str) -> SessionEvent {
    SessionEvent::Start {
        session: m.jti.clone(),
        at: OffsetDateTime::now_utc(),
        principal: principal.into(),
        vm: vm.into(),
        port: 22,
        network: "ov".into(),
        credential: Some(m.token.clone()),
    }
}

fn end(m: &Minted, principal: &str, vm: &str, up: u64, down: u64) -> SessionEvent {
    SessionEvent::End {
        session: m.jti.clone(),
        at: OffsetDateTime::now_utc(),
        principal: principal.into(),
        vm: vm.into(),
        port: 22,
        network: "ov".into(),
        bytes_up: up,
        bytes_down: down,
        duration_ms: 1500,
        reason: "closed".into(),
        credential: Some(m.token.clone()),
    }
}

/// A report with no credential, or one not issued for it.
fn forged(session: &str, principal: &str, credential: Option<&str>) -> SessionEvent {
    SessionEvent::Start {
        session: session.into(),
        at: OffsetDateTime::now_utc(),
        principal: principal.into(),
        vm: "web01".into(),
        port: 22,
        network: "ov".into(),
        credential: credential.map(Into::into),
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
    let s = Scene::new(Cp::start());
    let admin = &s.admin;
    admin.ok(&["user", "create", "uma", "--role", "user"]);
    admin.ok(&["user", "allow", "uma", "--selector", "app=web", "--ports", "22"]);
    admin.ok(&["user", "create", "vera", "--role", "viewer"]);
    let uma_token = admin.ok(&["user", "token", "create", "uma"]).trim().to_string();
    let uma = admin.with_token(&uma_token);
    let vera = admin.with_token(admin.ok(&["user", "token", "create", "vera"]).trim());
    let by_uma = s.mint(&uma_token, "web01");
    let by_admin = s.mint(&common::admin_token(&s.cp), "db01");

    // The report's own principal and VM are not what is recorded: the credential's are.
    gw_beat(&s.gw, "run1", vec![start(&by_uma, "user:uma", "web01")]).unwrap();
    gw_beat(
        &s.gw,
        "run1",
        vec![start(&by_admin, "user:someone-else", "web01")],
    )
    .unwrap();
    let open = admin.json(&["session", "list"]);
    assert_eq!(ids(&open), [by_uma.jti.clone(), by_admin.jti.clone()]);
    let first = &open[0];
    assert_eq!(first["principal"], "user:uma");
    assert_eq!(first["target"], "web01");
    assert_eq!(first["port"], 22);
    assert_eq!(first["transport"], "gateway");
    assert_eq!(first["node"], "gw");
    assert_eq!(open[1]["principal"], "user:admin");
    assert_eq!(open[1]["target"], "db01");
    // Filters; a viewer sees all, a user only their own.
    assert_eq!(
        ids(&admin.json(&["session", "list", "--principal", "user:admin"])),
        std::slice::from_ref(&by_admin.jti)
    );
    assert_eq!(
        ids(&admin.json(&["session", "list", "--target", "web01"])),
        std::slice::from_ref(&by_uma.jti)
    );
    assert_eq!(ids(&vera.json(&["session", "list"])).len(), 2);
    assert_eq!(
        ids(&uma.json(&["session", "list"])),
        std::slice::from_ref(&by_uma.jti)
    );
    let table = admin.ok(&["session", "list"]);
    assert!(
        table.contains("PRINCIPAL") && table.contains("user:admin") && table.contains("db01:22"),
        "{table}"
    );

    // The end, sent twice (a heartbeat answer lost on the way back).
    let ending = vec![end(&by_uma, "user:uma", "web01", 1000, 2000)];
    gw_beat(&s.gw, "run1", ending.clone()).unwrap();
    gw_beat(&s.gw, "run1", ending).unwrap();
    assert_eq!(
        ids(&admin.json(&["session", "list"])),
        std::slice::from_ref(&by_admin.jti)
    );
    let audit = admin.json(&["audit"]);
    let records = session_records(&audit, &by_uma.jti);
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
    gw_beat(&s.gw, "run2", vec![]).unwrap();
    assert!(ids(&admin.json(&["session", "list"])).is_empty());
    let audit = admin.json(&["audit", "--principal", "user:admin"]);
    let records = session_records(&audit, &by_admin.jti);
    assert_eq!(records.last().unwrap()["reason"], "gateway restarted");
    assert!(records.last().unwrap().get("bytes_up").is_none());
    assert!(admin.ok(&["session", "list"]).is_empty());
}

#[test]
fn session_reports_from_a_node_without_the_gateway_role_are_ignored_and_too_many_at_once_refused() {
    let s = Scene::new(Cp::start());
    let admin = &s.admin;
    let m = s.mint(&common::admin_token(&s.cp), "web01");
    // A hypervisor was never granted the gateway role: its reports are
    // ignored (and logged), its heartbeat is not refused.
    let hv2 = enroll_as(&s.cp, "hv2", "10.213.1.12", false);
    rt().block_on(hv2.heartbeat(&Heartbeat {
        node: "hv2".into(),
        vtep: "10.213.1.12".into(),
        session_epoch: Some("run1".into()),
        session_events: vec![start(&m, "user:admin", "web01")],
        session_bytes: Vec::new(),
        reads_one_session_revocations: false,
        ..empty_heartbeat()
    }))
    .unwrap();
    assert!(
        ids(&admin.json(&["session", "list"])).is_empty(),
        "nothing recorded"
    );
    assert!(
        s.cp.log().contains("session reports refused"),
        "the credential names gw, not hv2"
    );
    // Nor does a gateway make itself something else by what it says.
    let err = gw_beat_as(
        &s.gw,
        "gw",
        "10.213.1.13",
        None,
        "run1",
        vec![start(&m, "user:admin", "web01")],
    )
    .unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("differ from its grant"), "{err}");
    let many: Vec<_> = (0..=MAX_SESSION_EVENTS)
        .map(|_| start(&m, "user:admin", "web01"))
        .collect();
    let err = gw_beat(&s.gw, "run1", many).unwrap_err();
    assert!(err.to_string().contains("at most 2000"), "{err}");
    // Refused reports leave nothing behind; the same reports in an allowed size go in, once.
    assert!(ids(&admin.json(&["session", "list"])).is_empty());
    let batch: Vec<_> = (0..MAX_SESSION_EVENTS)
        .map(|_| start(&m, "user:admin", "web01"))
        .collect();
    gw_beat(&s.gw, "run1", batch).unwrap();
    assert_eq!(
        ids(&admin.json(&["session", "list"])),
        std::slice::from_ref(&m.jti)
    );
}

/// The attack of issue "Isolation and fairness": a granted gateway reports
/// a thousand session starts for a user it never carried, so that the
/// user's next broker call is refused `session_cap` on every replica. The
/// control plane records a start only with a credential it issued to that
/// gateway for that very session.
#[test]
fn forged_session_starts_record_nothing_and_lock_nobody_out() {
    let metrics_at: std::net::SocketAddr = format!("127.0.0.1:{}", common::free_port()).parse().unwrap();
    let s = Scene::new(Cp::start_with(
        common::TempDir::new("cp"),
        &[
            "--max-sessions-per-principal",
            "2",
            "--metrics-listen",
            &metrics_at.to_string(),
        ],
    ));
    let admin = &s.admin;
    admin.ok(&["user", "create", "uma", "--role", "user"]);
    admin.ok(&["user", "allow", "uma", "--selector", "app=web", "--ports", "22"]);
    let uma_token = admin.ok(&["user", "token", "create", "uma"]).trim().to_string();
    let real = s.mint(&uma_token, "web01");
    // Another granted gateway, not on uma's path, is the attacker.
    let evil = enroll_as(&s.cp, "evil", "10.213.1.14", true);
    let beat_evil = |events: Vec<SessionEvent>| {
        gw_beat_as(
            &evil,
            "evil",
            "10.213.1.14",
            Some("10.213.1.14:8443"),
            "run1",
            events,
        )
        .unwrap();
    };
    // One character of the signed message changed (`v4.public.MESSAGE+SIG.FOOTER`).
    let mut tampered: Vec<char> = real.token.chars().collect();
    let i = "v4.public.".len() + 20;
    tampered[i] = if tampered[i] == 'A' { 'B' } else { 'A' };
    let tampered: String = tampered.into_iter().collect();
    let mut reports: Vec<SessionEvent> = (0..1000)
        .map(|i| forged(&format!("fake-{i}"), "user:uma", None))
        .collect();
    // gw's real credential, reported by another gateway; and tampered.
    reports.push(start(&real, "user:uma", "web01"));
    reports.push(forged("fake-t", "user:uma", Some(&tampered)));
    beat_evil(reports);
    // Its own credential under another session id is no better.
    gw_beat(
        &s.gw,
        "run1",
        vec![forged("fake-other", "user:uma", Some(&real.token))],
    )
    .unwrap();
    assert!(
        ids(&admin.json(&["session", "list"])).is_empty(),
        "nothing recorded"
    );
    // Fake ends of sessions never seen start are not audited either.
    let fake_end = SessionEvent::End {
        session: "fake-end".into(),
        at: OffsetDateTime::now_utc(),
        principal: "user:uma".into(),
        vm: "web01".into(),
        port: 22,
        network: "ov".into(),
        bytes_up: 1,
        bytes_down: 1,
        duration_ms: 1,
        reason: "closed".into(),
        credential: None,
    };
    beat_evil(vec![fake_end]);
    let audit = admin.json(&["audit", "--principal", "user:uma"]);
    assert!(
        audit.as_array().unwrap().iter().all(|e| e["session"].is_null()),
        "no session record: {audit}"
    );
    let metrics = common::http_get(metrics_at, "/metrics").1;
    let refused = |reason: &str| {
        common::sample(
            &metrics,
            &format!("otherix_session_reports_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(refused("no_credential"), Some(1000.0));
    assert_eq!(
        refused("wrong_audience"),
        Some(1.0),
        "gw's credential reported by evil"
    );
    assert_eq!(refused("bad_signature"), Some(1.0));
    assert_eq!(refused("other_session"), Some(1.0));
    // uma is not locked out.
    let (status, body) = s.broker(&uma_token, "web01");
    assert_eq!(status, 200, "{body}");
}

#[test]
fn a_principal_at_its_session_cap_through_a_gateway_is_refused_429_and_others_are_not() {
    let s = Scene::new(Cp::start_with(
        common::TempDir::new("cp"),
        &["--max-sessions-per-principal", "2"],
    ));
    let admin = &s.admin;
    admin.ok(&["user", "create", "uma", "--role", "user"]);
    admin.ok(&["user", "allow", "uma", "--selector", "app=web", "--ports", "22"]);
    let uma_token = admin.ok(&["user", "token", "create", "uma"]).trim().to_string();
    let admin_token = common::admin_token(&s.cp);
    // One session open: still served.
    let one = s.mint(&admin_token, "web01");
    gw_beat(&s.gw, "run1", vec![start(&one, "user:admin", "web01")]).unwrap();
    let two = s.mint(&admin_token, "web01");
    // Two: at the cap through gw, refused.
    gw_beat(&s.gw, "run1", vec![start(&two, "user:admin", "web01")]).unwrap();
    let (status, body) = s.broker(&admin_token, "web01");
    assert_eq!(status, 429, "{body}");
    assert!(
        body.contains("session_cap") && body.contains("user:admin has 2 sessions open through gateway gw"),
        "{body}"
    );
    assert!(body.to_ascii_lowercase().contains("retry-after: 5"), "{body}");
    // Another principal is not held by it.
    assert_eq!(s.broker(&uma_token, "web01").0, 200);
    // A session ends: room again.
    gw_beat(&s.gw, "run1", vec![end(&one, "user:admin", "web01", 1, 1)]).unwrap();
    assert_eq!(s.broker(&admin_token, "web01").0, 200);
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

#[test]
fn a_gateways_byte_counts_show_live_and_ending_one_session_names_it_to_gateways_that_read_it() {
    let s = Scene::new(Cp::start());
    let token = common::admin_token(&s.cp);
    let (one, other) = (s.mint(&token, "web01"), s.mint(&token, "web01"));
    gw_beat(
        &s.gw,
        "run1",
        vec![
            start(&one, "user:admin", "web01"),
            start(&other, "user:admin", "web01"),
        ],
    )
    .unwrap();

    // The gateway's counts of its open sessions show in the list.
    let counts = |id: &str| {
        let list = s.admin.json(&["session", "list"]);
        let found = list.as_array().unwrap().iter().find(|x| x["id"] == id).cloned();
        found.map(|x| (x["bytes_up"].as_u64().unwrap(), x["bytes_down"].as_u64().unwrap()))
    };
    rt().block_on(s.gw.heartbeat(&Heartbeat {
        session_bytes: vec![otherix_proto::agent::SessionBytes {
            session: one.jti.clone(),
            bytes_up: 300,
            bytes_down: 7000,
        }],
        ..gw_heartbeat("run1")
    }))
    .unwrap();
    assert_eq!(counts(&one.jti), Some((300, 7000)));
    assert_eq!(counts(&other.jti), Some((0, 0)));
    let table = s.admin.ok(&["session", "list"]);
    assert!(table.contains("300 B") && table.contains("6.8 KiB"), "{table}");

    // Ending one: a gateway that reads one-session revocations is told that
    // session; one that predates them (this fake one, until it says so)
    // gets the same entry as the VM-and-port revocation it can read.
    s.admin.ok(&["session", "end", &one.jti]);
    let older = gw_beat(&s.gw, "run1", vec![]).unwrap();
    let entry = older
        .revocations
        .iter()
        .find(|r| r.principal == "user:admin")
        .expect("a revocation for the admin");
    assert_eq!(entry.session, None);
    assert_eq!((entry.vm_id.is_some(), entry.port), (true, Some(22)));
    let newer = rt()
        .block_on(s.gw.heartbeat(&Heartbeat {
            reads_one_session_revocations: true,
            ..gw_heartbeat("run1")
        }))
        .unwrap();
    let entry = newer
        .revocations
        .iter()
        .find(|r| r.principal == "user:admin")
        .expect("a revocation for the admin");
    assert_eq!(entry.session.as_deref(), Some(one.jti.as_str()));
    assert_eq!((entry.vm_id.is_some(), entry.port), (true, Some(22)));
}

/// The fake gateway's heartbeat with nothing to report.
fn gw_heartbeat(epoch: &str) -> Heartbeat {
    Heartbeat {
        node: "gw".into(),
        roles: Some(NodeRoles {
            hypervisor: false,
            gateway: Some("10.213.1.13:8443".into()),
            relay: None,
        }),
        vtep: "10.213.1.13".into(),
        session_epoch: Some(epoch.into()),
        ..empty_heartbeat()
    }
}
