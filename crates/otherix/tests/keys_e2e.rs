//! `otherix keys rotate` end to end on the testbed: a CP, hypervisors and a
//! gateway agent in their own namespaces, real clients in the host
//! namespace. A rotation under load drops no open session and refuses no
//! new connection; credentials minted before it keep working until they
//! expire, and those minted after carry the new kid.
//!
//! Every test builds its own world; everything is torn down on drop. Waits use
//! `wait_until`; nothing sleeps to assert.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use otherix_client::tunnel::{self as connect, ConnectError, Tunnel};
use otherix_client::Client;
use otherix_proto::{BrokerRequest, BrokerResponse};
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::Value;

mod common;

use common::tunnels::{echo_through, rt};
use common::BIN;

const WAIT: Duration = Duration::from_secs(60);

// ------------------------------------------------------------------ helpers

fn cluster(hint: &str, tweak: impl FnOnce(&mut ClusterSpec)) -> Cluster {
    let world = World::new(hint).expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    tweak(&mut spec);
    Cluster::start(world, spec).expect("cluster starts")
}

fn admin(c: &Cluster) -> Client {
    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    Client::new(&c.url, &ca_pem(c), Some(token.trim().to_string())).unwrap()
}

fn ca_pem(c: &Cluster) -> String {
    std::fs::read_to_string(c.ca_file()).unwrap()
}

fn broker(client: &Client, target: &str, port: u16) -> BrokerResponse {
    rt().block_on(client.broker(&BrokerRequest {
        target: target.into(),
        port: port.into(),
        exclude: Vec::new(),
    }))
    .unwrap_or_else(|e| panic!("broker {target}:{port}: {e}"))
}

fn present(ca: &str, endpoint: &str, credential: &str) -> Result<Tunnel, ConnectError> {
    rt().block_on(connect::open(endpoint, ca, credential))
}

/// The `kid` in a credential's footer (base64url JSON, public).
fn kid_of(credential: &str) -> String {
    let footer = credential.rsplit('.').next().unwrap();
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'-' => 62,
        b'_' => 63,
        _ => panic!("not base64url: {c}"),
    };
    let mut bytes = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in footer.bytes().filter(|c| *c != b'=') {
        acc = (acc << 6) | u32::from(value(c));
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            bytes.push((acc >> bits) as u8);
        }
    }
    let json: Value = serde_json::from_slice(&bytes).unwrap();
    json["kid"].as_str().unwrap().to_string()
}

/// An echo VM `echo1` on overlay `ov`, reachable through the gateway.
fn echo_vm(c: &Cluster, subnet: &str) {
    c.cli_ok(&["network", "create", "ov", "--type", "overlay", "--subnet", subnet])
        .unwrap();
    c.cli_json(&[
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
    for n in c.nodes.iter().filter(|n| n.gateway) {
        n.agent
            .as_ref()
            .expect("agent running")
            .wait_for_log("gateway listening", WAIT)
            .unwrap();
    }
    let (client, ca) = (admin(c), ca_pem(c));
    wait_until("echo1:7 to be reachable through a gateway", WAIT, || {
        let g = rt()
            .block_on(client.broker(&BrokerRequest {
                target: "echo1".into(),
                port: 7u16.into(),
                exclude: Vec::new(),
            }))
            .ok()?;
        present(&ca, &g.endpoint, &g.credential).ok().map(drop)
    })
    .unwrap();
}

/// A session to echo1, proven open.
fn open_session(client: &Client, ca: &str) -> Tunnel {
    let g = broker(client, "echo1", 7);
    let mut t = present(ca, &g.endpoint, &g.credential).expect("a session to echo1");
    echo_through(&mut t, b"open\n");
    t
}

// ------------------------------------------------------------------- tests

#[test]
fn keys_rotate_under_load_drops_no_session_and_earlier_credentials_work_until_they_expire() {
    let c = cluster("keys-rotate", |_| {});
    echo_vm(&c, "10.139.0.0/24");
    let (client, ca) = (admin(&c), ca_pem(&c));

    // Sessions open across the rotation, and a credential minted before it.
    let mut open: Vec<Tunnel> = (0..4).map(|_| open_session(&client, &ca)).collect();
    let early = broker(&client, "echo1", 7);
    let old_kid = kid_of(&early.credential);

    // Load: while the key rotates, connections are brokered and opened one
    // after another, and two sessions carry an echo on every round.
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicUsize::new(0));
    let load = {
        let (client, ca, stop, rounds) = (client.clone(), ca.clone(), stop.clone(), rounds.clone());
        let mut busy: Vec<Tunnel> = (0..2).map(|_| open_session(&client, &ca)).collect();
        std::thread::spawn(move || {
            let mut kids = BTreeSet::new();
            while !stop.load(Ordering::SeqCst) {
                let g = broker(&client, "echo1", 7);
                kids.insert(kid_of(&g.credential));
                let mut t = present(&ca, &g.endpoint, &g.credential)
                    .unwrap_or_else(|e| panic!("a connection during the rotation failed: {e}"));
                echo_through(&mut t, b"new\n");
                for s in &mut busy {
                    echo_through(s, b"busy\n");
                }
                rounds.fetch_add(1, Ordering::SeqCst);
            }
            kids
        })
    };
    wait_until("the load to run", WAIT, || {
        (rounds.load(Ordering::SeqCst) >= 5).then_some(())
    })
    .unwrap();

    let rotated = c.cli_json(&["keys", "rotate"]).unwrap();
    let new_kid = rotated["key"]["kid"].as_str().unwrap().to_string();
    assert_ne!(new_kid, old_kid);
    assert_eq!(rotated["key"]["state"], "current", "{rotated}");
    assert_eq!(rotated["retiring"][0]["kid"], old_kid.as_str(), "{rotated}");

    // From the command's return on, credentials carry the new kid.
    for _ in 0..5 {
        assert_eq!(kid_of(&broker(&client, "echo1", 7).credential), new_kid);
    }
    let after = rounds.load(Ordering::SeqCst);
    wait_until("the load to go on after the rotation", WAIT, || {
        (rounds.load(Ordering::SeqCst) >= after + 10).then_some(())
    })
    .unwrap();
    stop.store(true, Ordering::SeqCst);
    let kids = load.join().expect("no connection failed under load");
    assert!(
        kids.contains(&old_kid) && kids.contains(&new_kid),
        "the load spanned the rotation: {kids:?}"
    );

    // No session dropped.
    for t in &mut open {
        echo_through(t, b"still open\n");
    }
    // A credential minted before the rotation still works (it has not expired).
    let mut t = present(&ca, &early.endpoint, &early.credential).expect("minted before the rotation");
    echo_through(&mut t, b"old kid\n");
    let fresh = broker(&client, "echo1", 7);
    let mut t = present(&ca, &fresh.endpoint, &fresh.credential).expect("minted after");
    echo_through(&mut t, b"new kid\n");

    // The gateway holds the old key with its expiry (and would refuse its
    // credentials after it, the control plane reachable or not).
    let keys_file = c
        .nodes
        .iter()
        .find(|n| n.gateway)
        .unwrap()
        .data_dir
        .join("session-keys.json");
    let saved: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&keys_file).unwrap()).unwrap();
    let old = saved
        .iter()
        .find(|k| k["kid"] == old_kid.as_str())
        .unwrap_or_else(|| panic!("the previous key is still trusted: {saved:?}"));
    assert_eq!(
        old["not_after"], rotated["retiring"][0]["expires_at"],
        "{saved:?}"
    );
    let listed = c.cli_json(&["keys", "list"]).unwrap();
    assert_eq!(listed[0]["kid"], new_kid.as_str());
    assert_eq!(listed[1]["state"], "previous", "{listed}");
}

/// The claims of a credential (its payload is public: the JSON claims, then
/// the 64-byte signature).
fn claims_of(credential: &str) -> otherix_core::credential::Claims {
    let body = credential.strip_prefix("v4.public.").unwrap();
    let body = body.split('.').next().unwrap();
    let bytes = base64url(body);
    serde_json::from_slice(&bytes[..bytes.len() - 64]).unwrap()
}

fn base64url(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'-' => 62,
        b'_' => 63,
        _ => panic!("not base64url: {c}"),
    };
    let mut out = Vec::new();
    let (mut acc, mut bits) = (0u32, 0);
    for c in text.bytes().filter(|c| *c != b'=') {
        acc = (acc << 6) | u32::from(value(c));
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

/// A gateway restarted while the control plane is down, its saved desired
/// state naming no cluster, has not been told its cluster by the control plane: it
/// knows it from the CA it pinned at enrollment, and refuses a credential
/// naming another cluster — signed by a key it trusts — from its first
/// connection, while its own cluster's still pass.
#[test]
fn a_gateway_checks_the_issuer_from_its_first_connection_before_any_desired_state() {
    otherix_testbed::tools::require_programs(&["sqlite3"]);
    let mut c = cluster("keys-iss", |_| {});
    echo_vm(&c, "10.140.0.0/24");
    let (client, ca) = (admin(&c), ca_pem(&c));
    let cluster_id = rt().block_on(client.info()).unwrap().cluster_id;
    let ours = broker(&client, "echo1", 7);
    let kid = kid_of(&ours.credential);

    c.kill_cp().unwrap();
    let gw = c.nodes.iter().find(|n| n.gateway).unwrap().name.clone();
    c.kill_agent(&gw).unwrap();
    let data_dir = c.node(&gw).unwrap().data_dir.clone();
    // The saved desired state does not name the cluster, as one saved
    // before it did (or a fresh agent's none).
    let saved = data_dir.join("desired.json");
    let mut desired: Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    assert_eq!(desired["cluster_id"], cluster_id.as_str(), "{desired}");
    desired.as_object_mut().unwrap().remove("cluster_id");
    std::fs::write(&saved, serde_json::to_vec(&desired).unwrap()).unwrap();
    c.start_agent(&gw).unwrap();
    let agent = c.node(&gw).unwrap().agent.as_ref().unwrap();
    agent.wait_for_log("gateway listening", WAIT).unwrap();
    assert!(
        agent
            .log()
            .lines()
            .any(|l| l.contains("accepts credentials of this cluster only") && l.contains(&cluster_id)),
        "the issuer is set before the gateway serves:\n{}",
        agent.log()
    );

    // A trusted key (its seed, as the store holds it on SQLite without a
    // secret key) signs a credential for this gateway naming another cluster.
    let out = std::process::Command::new("sqlite3")
        .arg(c.cp_dir().join("otherix.db"))
        .arg(format!("SELECT hex(seed) FROM session_keys WHERE kid = '{kid}'"))
        .output()
        .unwrap();
    let seed: [u8; 32] = hex::decode(String::from_utf8(out.stdout).unwrap().trim())
        .unwrap()
        .try_into()
        .expect("a plain 32-byte seed");
    let key = otherix_core::credential::SigningKey::from_seed(kid.clone(), seed).unwrap();
    let mut theirs = claims_of(&ours.credential);
    theirs.iss = format!("not-{cluster_id}");
    theirs.jti = "00112233445566778899aabbccddeeff".into();
    let forged = key.mint(&theirs).unwrap();
    match present(&ca, &ours.endpoint, &forged) {
        Err(ConnectError::Refused { status, reason }) => {
            assert_eq!(status, 403, "{reason}");
            assert!(reason.contains("not this one"), "{reason}");
        }
        Ok(_) => panic!("a credential of another cluster was accepted"),
        Err(e) => panic!("expected a refusal, got {e}"),
    }
    // This cluster's credential, minted before, still passes.
    let mut t = present(&ca, &ours.endpoint, &ours.credential).expect("our own cluster's credential");
    echo_through(&mut t, b"ours\n");
}
