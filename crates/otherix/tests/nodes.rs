//! Enrollment, mutual-TLS heartbeats, node status, scheduling and desired
//! state, against a real `otherix server`, speaking the agent protocol
//! directly (the agent daemon has its own end-to-end tests).

mod common;

use common::{admin_token, Cp};
use otherix_api::agent::{DesiredState, EnrollRequest, Heartbeat, NodeRoles};
use otherix_api::{Client, ClientError};

/// A node identity made the way an agent makes one.
struct FakeNodeKey {
    key: rcgen::KeyPair,
    csr_pem: String,
}

fn node_key(name: &str) -> FakeNodeKey {
    let key = rcgen::KeyPair::generate().unwrap();
    let csr_pem = rcgen::CertificateParams::new(vec![name.to_string()])
        .unwrap()
        .serialize_request(&key)
        .unwrap()
        .pem()
        .unwrap();
    FakeNodeKey { key, csr_pem }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn join_token(cp: &Cp, ttl: &str) -> String {
    cp.admin()
        .ok(&["node", "join-token", "create", "--ttl", ttl])
        .trim()
        .to_string()
}

fn enroll(cp: &Cp, token: &str, name: &str) -> Result<Client, ClientError> {
    let k = node_key(name);
    let anon = Client::new(&cp.url, &cp.ca_pem(), None).unwrap();
    let resp = rt().block_on(anon.enroll(&EnrollRequest {
        join_token: token.to_string(),
        node: name.to_string(),
        csr_pem: k.csr_pem.clone(),
    }))?;
    assert_eq!(resp.ca_pem.trim(), cp.ca_pem().trim());
    Ok(Client::with_identity(&cp.url, &resp.ca_pem, &resp.cert_pem, &k.key.serialize_pem()).unwrap())
}

fn beat(
    client: &Client,
    name: &str,
    vtep: &str,
    hypervisor: bool,
    gateway: Option<&str>,
) -> Result<DesiredState, ClientError> {
    rt().block_on(client.heartbeat(&Heartbeat {
        node: name.to_string(),
        roles: NodeRoles {
            hypervisor,
            gateway: gateway.map(Into::into),
        },
        vtep: vtep.to_string(),
        applied_version: None,
        guests: vec![],
        sessions: Default::default(),
        version: "test".into(),
    }))
}

#[test]
fn enrollment_refuses_bad_reused_and_expired_join_tokens() {
    let cp = Cp::start();
    let good = join_token(&cp, "1h");
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

    let short = join_token(&cp, "1s");
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
    let a = enroll(&cp, &join_token(&cp, "1h"), "node-a").unwrap();
    enroll(&cp, &join_token(&cp, "1h"), "node-b").unwrap();
    beat(&a, "node-a", "10.213.1.11", true, None).expect("own name is fine");
    let err = beat(&a, "node-b", "10.213.1.11", true, None).unwrap_err();
    assert_eq!(err.status(), Some(403));
    assert!(err.to_string().contains("belongs to node \"node-a\""), "{err}");

    // Without a client certificate, even an admin token does not make a heartbeat.
    let admin = Client::new(&cp.url, &cp.ca_pem(), Some(admin_token(&cp))).unwrap();
    let err = rt()
        .block_on(admin.heartbeat(&Heartbeat {
            node: "node-a".into(),
            roles: NodeRoles::default(),
            vtep: "10.213.1.11".into(),
            applied_version: None,
            guests: vec![],
            sessions: Default::default(),
            version: String::new(),
        }))
        .unwrap_err();
    assert_eq!(err.status(), Some(401), "{err}");
    assert!(err.to_string().contains("mutual TLS"), "{err}");

    let err = beat(&a, "node-a", "not-an-ip", true, None).unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
}

#[test]
fn nodes_turn_ready_vms_get_scheduled_and_gateways_join_every_overlay() {
    let cp = Cp::start();
    let admin = cp.admin();
    let n1 = enroll(&cp, &join_token(&cp, "1h"), "n1").unwrap();
    let n2 = enroll(&cp, &join_token(&cp, "1h"), "n2").unwrap();
    let gw = enroll(&cp, &join_token(&cp, "1h"), "gw").unwrap();

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
            ov.fdb.iter().any(|e| e.mac == mac && e.vtep == vtep),
            "{mac} -> {vtep} in {:?}",
            ov.fdb
        );
        assert!(ov
            .neighbors
            .iter()
            .any(|n| n.mac == mac && n.ip == vm["ip"].as_str().unwrap()));
    }
    assert!(
        !ov.fdb.iter().any(|e| e.vtep == "10.213.1.13"),
        "never an FDB entry to ourselves"
    );
    let same = beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    assert_eq!(same.version, d.version, "an unchanged state keeps its version");

    let h = beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    assert_eq!(h.guests.len(), 2);
    assert!(h.guests.iter().all(|g| g.gateway == "10.100.0.1"));

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
