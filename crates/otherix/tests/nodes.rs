//! Enrollment, mutual-TLS heartbeats, node status, scheduling and desired
//! state, against a real `otherix server`, speaking the agent protocol
//! directly (the agent daemon has its own end-to-end tests).

mod common;

use common::fake_node::{beat, empty_heartbeat, enroll, enroll_as, join_token, rt};
use common::{admin_token, Cp};
use otherix_client::Client;
use otherix_proto::agent::{Heartbeat, NodeRoles};

#[test]
fn enrollment_refuses_bad_reused_and_expired_join_tokens() {
    let cp = Cp::start();
    let good = join_token(&cp, "n1", "1h");
    let err = enroll(
        &cp,
        "otxj_0000000000000000_0000000000000000000000000000000000000000000000000000000000000000",
        "n1",
    )
    .unwrap_err();
    assert_eq!(
        (err.status(), err.to_string().as_str()),
        (Some(401), "invalid join token")
    );
    let mut tampered = good.clone();
    tampered.pop();
    tampered.push(if good.ends_with('0') { '1' } else { '0' });
    assert_eq!(
        enroll(&cp, &tampered, "n1").unwrap_err().to_string(),
        "invalid join token"
    );

    enroll(&cp, &good, "n1").expect("a fresh token enrolls");
    let err = enroll(&cp, &good, "n2").unwrap_err();
    assert!(err.to_string().contains("already used"), "{err}");

    let short = join_token(&cp, "n3", "1s");
    std::thread::sleep(std::time::Duration::from_millis(1200));
    let err = enroll(&cp, &short, "n3").unwrap_err();
    assert!(err.to_string().contains("expired"), "{err}");

    let names = cp.admin().json(&["node", "list"]);
    let names: Vec<&str> = names
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["n1"], "refused enrollments leave no node behind");
}

#[test]
fn heartbeats_need_the_nodes_own_certificate() {
    let cp = Cp::start();
    let a = enroll_as(&cp, "node-a", "10.213.1.11", false);
    enroll_as(&cp, "node-b", "10.213.1.12", false);
    beat(&a, "node-a", "10.213.1.11", true, None).expect("own name is fine");
    let err = beat(&a, "node-b", "10.213.1.11", true, None).unwrap_err();
    assert_eq!(err.status(), Some(403));
    assert!(err.to_string().contains("belongs to node \"node-a\""), "{err}");

    // Without a client certificate, even an admin token does not make a heartbeat.
    let admin = Client::new(&cp.url, &cp.ca_pem(), Some(admin_token(&cp))).unwrap();
    let err = rt()
        .block_on(admin.heartbeat(&Heartbeat {
            node: "node-a".into(),
            roles: None,
            vtep: "10.213.1.11".into(),
            version: String::new(),
            ..empty_heartbeat()
        }))
        .unwrap_err();
    assert_eq!(err.status(), Some(401), "{err}");
    assert!(err.to_string().contains("mutual TLS"), "{err}");

    // A VTEP is granted (or the source address), never taken from the node.
    let err = beat(&a, "node-a", "not-an-ip", true, None).unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("VTEP"), "{err}");
}

#[test]
fn nodes_turn_ready_vms_get_scheduled_and_gateways_join_every_overlay() {
    let cp = Cp::start();
    let admin = cp.admin();
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    let n2 = enroll_as(&cp, "n2", "10.213.1.12", false);
    let gw = enroll_as(&cp, "gw", "10.213.1.13", true);

    let list = admin.json(&["node", "list"]);
    assert!(
        list.as_array().unwrap().iter().all(|n| n["status"] == "NotReady"),
        "{list}"
    );
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    let vm = admin.json(&["vm", "create", "early", "--network", "ov"]);
    assert_eq!(vm["node"], serde_json::Value::Null, "no Ready hypervisor yet");

    beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    beat(&n2, "n2", "10.213.1.12", true, None).unwrap();
    beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    let early = admin.json(&["vm", "get", "early"]);
    let first = early["node"].as_str().expect("placed by a heartbeat").to_string();
    let second = admin.json(&["vm", "create", "late", "--network", "ov"]);
    let second = second["node"].as_str().unwrap().to_string();
    assert_ne!(first, second, "the least-loaded hypervisor gets the next VM");
    for vm in ["web1", "web2"] {
        admin.ok(&["vm", "create", vm, "--network", "ov"]);
    }

    let table = admin.ok(&["node", "list"]);
    assert!(table.lines().next().unwrap().starts_with("NAME"), "{table}");
    let nodes = admin.json(&["node", "list"]);
    for n in nodes.as_array().unwrap() {
        assert_eq!(n["status"], "Ready", "{n}");
    }
    let g = admin.json(&["node", "get", "gw"]);
    assert_eq!(g["roles"]["gateway"], "10.213.1.13:8443");
    assert_eq!(g["guests"], 0);

    // Heartbeat twice so every member has its lease, then read desired state.
    for _ in 0..2 {
        beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
        beat(&n2, "n2", "10.213.1.12", true, None).unwrap();
        beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    }
    let d = beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    assert!(d.guests.is_empty(), "a pure gateway hosts no guests");
    assert_eq!(d.overlays.len(), 1, "the gateway is a member of the overlay");
    let ov = &d.overlays[0];
    let vms = admin.json(&["vm", "list"]);
    for vm in vms.as_array().unwrap() {
        let mac = vm["mac"].as_str().unwrap();
        let vtep = match vm["node"].as_str().unwrap() {
            "n1" => "10.213.1.11",
            _ => "10.213.1.12",
        };
        assert!(
            ov.fdb
                .iter()
                .any(|e| e.mac.to_string() == mac && e.vtep.to_string() == vtep),
            "{mac} -> {vtep} in {:?}",
            ov.fdb
        );
        assert!(ov
            .neighbors
            .iter()
            .any(|n| n.mac.to_string() == mac && n.ip.to_string() == vm["ip"].as_str().unwrap()));
    }
    assert!(
        !ov.fdb.iter().any(|e| e.vtep.to_string() == "10.213.1.13"),
        "never an FDB entry to ourselves"
    );
    let same = beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    assert_eq!(same.version, d.version, "an unchanged state keeps its version");

    let h = beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    assert_eq!(h.guests.len(), 2);
    assert!(h.guests.iter().all(|g| g.gateway.to_string() == "10.100.0.1"));

    let err = admin.fails(&["node", "delete", "n1"]);
    assert!(err.contains("hosts 2 guest(s)"), "{err}");
    admin.ok(&["node", "delete", "n1", "--force"]);
    let left = admin.json(&["vm", "list"]);
    let moved: Vec<_> = left
        .as_array()
        .unwrap()
        .iter()
        .filter(|v| v["node"].is_null())
        .collect();
    assert_eq!(
        moved.len(),
        2,
        "guests of a force-deleted node wait for a new placement"
    );
    beat(&n2, "n2", "10.213.1.12", true, None).unwrap();
    let left = admin.json(&["vm", "list"]);
    assert!(
        left.as_array().unwrap().iter().all(|v| v["node"] == "n2"),
        "{left}"
    );
}

#[test]
fn broker_mints_a_credential_for_exactly_the_target_and_enforces_roles() {
    use otherix_core::credential::{verify, Expected, KeySet};
    use otherix_proto::agent::GuestStatus;
    use otherix_proto::{BrokerRequest, VmState};

    let cp = Cp::start();
    let admin = cp.admin();
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    let gw = enroll_as(&cp, "gw", "10.213.1.13", true);
    beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    let web = admin.json(&["vm", "create", "web01", "--network", "ov", "-l", "app=web"]);
    admin.ok(&["vm", "create", "db01", "--network", "ov", "-l", "app=db"]);
    let client_for = |token: &str| Client::new(&cp.url, &cp.ca_pem(), Some(token.to_string())).unwrap();
    let root = client_for(&admin_token(&cp));
    let broker = |c: &Client, target: &str, port: u32| {
        rt().block_on(c.broker(&BrokerRequest {
            target: target.into(),
            port,
            exclude: vec![],
        }))
    };

    let err = broker(&root, "web01", 22).unwrap_err();
    assert_eq!(err.code(), Some("vm_not_running"), "{err}");
    // The node reports its guests running; the gateway joins the overlay.
    let vms = admin.json(&["vm", "list"]);
    let guests: Vec<GuestStatus> = vms
        .as_array()
        .unwrap()
        .iter()
        .map(|v| GuestStatus {
            accelerator: None,
            vm_id: v["id"].as_str().unwrap().into(),
            state: VmState::Running,
            reason: None,
        })
        .collect();
    rt().block_on(n1.heartbeat(&Heartbeat {
        node: "n1".into(),
        roles: Some(NodeRoles {
            hypervisor: true,
            gateway: None,
            relay: None,
        }),
        vtep: "10.213.1.11".into(),
        guests,
        ..empty_heartbeat()
    }))
    .unwrap();
    let desired = beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    assert!(
        !desired.session_keys.is_empty(),
        "gateways learn the public session keys"
    );

    let r = broker(&root, "web01", 22).unwrap();
    assert_eq!(
        (r.transport.as_str(), r.endpoint.as_str()),
        ("gateway", "https://10.213.1.13:8443")
    );
    let mut keys = KeySet::new();
    for k in &desired.session_keys {
        keys.insert(k.kid.clone(), &hex_decode(&k.public)).unwrap();
    }
    assert!(!desired.cluster_id.is_empty(), "gateways learn the cluster id");
    let gateway = Expected {
        issuer: Some(&desired.cluster_id),
        ..Expected::new("gw")
    };
    let claims =
        verify(&r.credential, &keys, &gateway, time::OffsetDateTime::now_utc()).expect("verifies offline");
    assert_eq!(claims.sub, "user:admin");
    assert_eq!(
        (claims.ip.as_str(), claims.port),
        (web["ip"].as_str().unwrap(), 22)
    );
    assert_eq!(claims.mac.as_deref(), web["mac"].as_str());
    assert_eq!(claims.vm_id, web["id"].as_str().unwrap());
    assert!(
        verify(
            &r.credential,
            &keys,
            &Expected::new("n1"),
            time::OffsetDateTime::now_utc()
        )
        .is_err(),
        "bound to one gateway"
    );
    let other = broker(&root, "web01", 22).unwrap();
    assert_ne!(
        other.credential, r.credential,
        "every connection gets its own credential"
    );

    assert_eq!(broker(&root, "ghost", 22).unwrap_err().status(), Some(404));
    assert_eq!(broker(&root, "web01", 0).unwrap_err().status(), Some(400));
    assert_eq!(broker(&root, "web01", 70000).unwrap_err().status(), Some(400));

    admin.ok(&["user", "create", "uma", "--role", "user"]);
    admin.ok(&["user", "allow", "uma", "--selector", "app=web", "--ports", "22"]);
    admin.ok(&["user", "create", "vic", "--role", "viewer"]);
    let uma = client_for(admin.ok(&["user", "token", "create", "uma"]).trim());
    let vic = client_for(admin.ok(&["user", "token", "create", "vic"]).trim());
    broker(&uma, "web01", 22).expect("allowed by the rule");
    let err = broker(&uma, "web01", 80).unwrap_err();
    assert_eq!(err.status(), Some(403), "{err}");
    let err = broker(&uma, "db01", 22).unwrap_err();
    assert_eq!(err.status(), Some(403), "{err}");
    let err = broker(&vic, "web01", 22).unwrap_err();
    assert_eq!(err.status(), Some(403), "{err}");
    assert!(err.to_string().contains("viewer may not broker"), "{err}");
}

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[test]
fn a_gateway_keeps_its_overlay_membership_until_its_sessions_drain() {
    let cp = Cp::start();
    let admin = cp.admin();
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    let gw = enroll_as(&cp, "gw", "10.213.1.13", true);
    beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    admin.ok(&["vm", "create", "only", "--network", "ov", "--node", "n1"]);
    beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    let gw_beat = |sessions: &[(&str, u32)]| {
        rt().block_on(gw.heartbeat(&Heartbeat {
            node: "gw".into(),
            roles: Some(NodeRoles {
                hypervisor: false,
                gateway: Some("10.213.1.13:8443".into()),
                relay: None,
            }),
            vtep: "10.213.1.13".into(),
            sessions: sessions.iter().map(|(n, c)| (n.to_string(), *c)).collect(),
            ..empty_heartbeat()
        }))
        .unwrap()
    };
    assert_eq!(gw_beat(&[]).overlays.len(), 1, "coverage: the overlay has a VM");

    // The overlay's last VM goes while the gateway has a session open there.
    gw_beat(&[("ov", 1)]);
    admin.ok(&["vm", "delete", "only"]);
    let kept = gw_beat(&[("ov", 1)]);
    assert_eq!(
        kept.overlays.len(),
        1,
        "membership is sticky while sessions are open"
    );
    let node = admin.json(&["node", "get", "gw"]);
    assert_eq!(node["draining"], serde_json::json!(["ov"]));
    assert!(admin.ok(&["node", "get", "gw"]).contains("Draining:"));

    // Drained: withdrawn, and the gateway's lease on the overlay is freed.
    let withdrawn = gw_beat(&[]);
    assert!(
        withdrawn.overlays.is_empty(),
        "withdrawn once the sessions drained"
    );
    let node = admin.json(&["node", "get", "gw"]);
    assert_eq!(node["overlays"], serde_json::json!([]));
    assert_eq!(node["draining"], serde_json::json!([]));
}

#[test]
fn a_heartbeat_past_the_request_limit_but_within_its_own_is_answered() {
    // A gateway with many LB backends reports a verdict for each: its
    // heartbeat outgrows the 64 KiB other requests are held to.
    let cp = Cp::start();
    let client = enroll_as(&cp, "n1", "10.213.9.11", false);
    let report = |i: usize| otherix_proto::agent::HealthReport {
        lb: format!("lb-{i}"),
        vm_id: format!("{i:032x}"),
        health: otherix_proto::api::Health::Healthy,
        probed_at: time::OffsetDateTime::now_utc(),
        changed_at: None,
        reason: None,
        successes: 3,
        failures: 0,
    };
    let hb = Heartbeat {
        node: "n1".into(),
        vtep: "10.213.9.11".into(),
        health: (0..2_000).map(report).collect(),
        ..empty_heartbeat()
    };
    assert!(serde_json::to_vec(&hb).unwrap().len() > 128 * 1024);
    rt().block_on(client.heartbeat(&hb))
        .expect("a 2,000-verdict heartbeat is within the heartbeat's limit");
    // Past it, the refusal names the heartbeat's limit, not other requests'.
    let hb = Heartbeat {
        health: (0..50_000).map(report).collect(),
        ..hb
    };
    assert!(serde_json::to_vec(&hb).unwrap().len() > 8 * 1024 * 1024);
    let err = rt().block_on(client.heartbeat(&hb)).unwrap_err();
    assert_eq!(err.status(), Some(413), "{err}");
    assert!(err.to_string().contains("8388608 bytes"), "{err}");
}
