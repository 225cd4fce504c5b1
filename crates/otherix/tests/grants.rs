//! External grants and the audit trail, against a real `otherix server`
//! with nodes speaking the agent protocol.

mod common;

use common::fake_node::{beat, beat_running, enroll_as};
use common::Cp;
use serde_json::Value;

/// A CP with one hypervisor, one gateway, and running VMs web01 and db01.
fn world() -> (Cp, common::Cli) {
    let (cp, admin, _) = world_with_node();
    (cp, admin)
}

/// [`world`], and the hypervisor n1's client to report VMs running.
fn world_with_node() -> (Cp, common::Cli, otherix_client::Client) {
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
    let ids: Vec<String> = ["web01", "db01"]
        .iter()
        .map(|vm| {
            admin.json(&["vm", "create", vm, "--network", "ov"])["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    beat_running(&n1, "n1", "10.213.1.11", &ids);
    beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    (cp, admin, n1)
}

fn grant(admin: &common::Cli, args: &[&str]) -> String {
    let mut argv = vec!["grant", "create"];
    argv.extend(args);
    admin.ok(&argv).trim().to_string()
}

/// A CLI that knows only the CP URL and CA (no API token), using a grant.
fn third_party(cp: &Cp, token: &str, name: &str) -> common::Cli {
    let file = cp.dir.path().join(format!("{name}.grant"));
    std::fs::write(&file, token).unwrap();
    let cli = cp.cli(name);
    let out = cli.ok(&[
        "login",
        "--server",
        &cp.url,
        "--ca-fingerprint",
        &cp.fingerprint,
        "--grant-file",
        file.to_str().unwrap(),
    ]);
    assert!(out.contains("grant:"), "{out}");
    cli
}

fn broker_json(cli: &common::Cli, target: &str, port: u16) -> Result<Value, String> {
    // `otherix connect` would also dial the gateway; brokering alone is what
    // grants govern, so ask the broker through the API with the CLI's config.
    let file: toml::Value = toml::from_str(&std::fs::read_to_string(&cli.config).unwrap()).unwrap();
    let cfg = &file["contexts"][file["current_context"].as_str().unwrap()];
    let client = otherix_client::Client::new(
        cfg["server"].as_str().unwrap(),
        cfg["ca_pem"].as_str().unwrap(),
        cfg.get("token").and_then(|t| t.as_str()).map(str::to_string),
    )
    .unwrap();
    common::fake_node::rt()
        .block_on(client.broker(&otherix_proto::BrokerRequest {
            target: target.into(),
            port: u32::from(port),
            exclude: vec![],
        }))
        .map(|r| serde_json::to_value(r).unwrap())
        .map_err(|e| e.to_string())
}

#[test]
fn a_grant_reaches_exactly_its_targets_and_nothing_else() {
    let (cp, admin) = world();
    let token = grant(&admin, &["acme", "--target", "web01:443", "--ttl", "24h"]);
    assert!(token.starts_with("otxg_"), "{token}");
    let acme = third_party(&cp, &token, "acme");
    assert_eq!(acme.json(&["whoami"])["principal"], "grant:acme");

    let r = broker_json(&acme, "web01", 443).expect("the listed target is allowed");
    assert_eq!(r["vm"], "web01");
    for (target, port) in [("web01", 22), ("db01", 443), ("ghost", 443)] {
        let err = broker_json(&acme, target, port).unwrap_err();
        assert!(err.contains("does not include"), "{target}:{port}: {err}");
    }
    // Every other API call is refused.
    for argv in [
        vec!["vm", "list"],
        vec!["network", "list"],
        vec!["vm", "create", "x", "--network", "ov"],
        vec!["grant", "list"],
        vec!["user", "list"],
    ] {
        let err = acme.fails(&argv);
        assert!(err.contains("may only broker"), "{argv:?}: {err}");
    }
    // A grant can never be widened: there is no call that changes targets.
    let g = admin.json(&["grant", "get", "acme"]);
    let web01 = admin.json(&["vm", "get", "web01"])["id"].clone();
    assert_eq!(
        g["targets"],
        serde_json::json!([{"target": "web01", "port": 443, "vm_id": web01}])
    );
    assert_eq!(g["connections"], 1);
    assert_eq!(g["state"], "active");
    let table = admin.ok(&["grant", "list"]);
    assert!(
        table.starts_with("NAME") && table.contains("web01:443"),
        "{table}"
    );
}

/// A grant names VMs but is bound to the VM that had the name when it was
/// made: deleting web01 and creating another web01 must not hand the old
/// grant's holder the new VM (issue 26).
#[test]
fn a_grant_reaches_the_vm_it_was_made_for_and_not_one_recreated_under_its_name() {
    let (cp, admin, n1) = world_with_node();
    let token = grant(&admin, &["acme", "--target", "web01:443", "--ttl", "1h"]);
    let acme = third_party(&cp, &token, "acme");
    let first = admin.json(&["vm", "get", "web01"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        admin.json(&["grant", "get", "acme"])["targets"][0]["vm_id"],
        first.as_str()
    );
    let r = broker_json(&acme, "web01", 443).expect("the VM the grant was made for");
    assert_eq!(r["vm"], "web01");

    admin.ok(&["vm", "delete", "web01"]);
    let second = admin.json(&["vm", "create", "web01", "--network", "ov"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(first, second);
    let db01 = admin.json(&["vm", "get", "db01"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    beat_running(&n1, "n1", "10.213.1.11", &[db01, second.clone()]);
    common::wait_for(|| (admin.json(&["vm", "get", "web01"])["state"] == "running").then_some(()));

    let err = broker_json(&acme, "web01", 443).unwrap_err();
    assert!(
        err.contains("grant \"acme\" was made for another VM named web01 (deleted since)"),
        "{err}"
    );
    let (status, body) = common::curl(
        &cp,
        &[
            "-H",
            &format!("Authorization: Bearer {token}"),
            "-H",
            "Content-Type: application/json",
            "-d",
            r#"{"target":"web01","port":443}"#,
            &format!("{}/v1/broker", cp.url),
        ],
    );
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("\"grant_vm_replaced\""), "{body}");
    // The grant still shows the VM it was made for; the refusal is audited.
    let g = admin.json(&["grant", "get", "acme"]);
    assert_eq!(g["targets"][0]["vm_id"], first.as_str(), "{g}");
    assert_eq!(g["connections"], 1, "refusals are not counted: {g}");
    let table = admin.ok(&["grant", "list"]);
    assert!(
        table.contains(&format!("web01:443 (vm {})", &first[..12])),
        "{table}"
    );
    let trail = common::wait_for(|| {
        let t = admin.json(&["audit", "--since", "1h", "--principal", "grant:acme"]);
        t.as_array()
            .unwrap()
            .iter()
            .find(|e| e["allowed"] == false)
            .cloned()
    });
    assert!(
        trail["reason"].as_str().unwrap().contains("(deleted since)"),
        "{trail}"
    );

    // A grant made now is bound to the new VM, and reaches it.
    let token = grant(&admin, &["acme2", "--target", "web01:443", "--ttl", "1h"]);
    let acme2 = third_party(&cp, &token, "acme2");
    assert_eq!(
        admin.json(&["grant", "get", "acme2"])["targets"][0]["vm_id"],
        second.as_str()
    );
    broker_json(&acme2, "web01", 443).expect("the new grant reaches the new VM");
    // An admin may pin the VM a grant is for: refused if the name moved on.
    let (status, body) = common::curl(
        &cp,
        &[
            "-H",
            &format!("Authorization: Bearer {}", common::admin_token(&cp)),
            "-H",
            "Content-Type: application/json",
            "-d",
            &format!(
                r#"{{"name":"pinned","ttl_seconds":60,"targets":[{{"target":"web01","port":443,"vm_id":"{first}"}}]}}"#
            ),
            &format!("{}/v1/grants", cp.url),
        ],
    );
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("\"vm_replaced\""), "{body}");
    admin.fails(&["grant", "get", "pinned"]);
}

#[test]
fn revoked_expired_and_exhausted_grants_are_refused() {
    let (cp, admin) = world();
    let token = grant(&admin, &["revokee", "--target", "web01:443", "--ttl", "1h"]);
    let revokee = third_party(&cp, &token, "revokee");
    broker_json(&revokee, "web01", 443).unwrap();
    admin.ok(&["grant", "revoke", "revokee"]);
    let err = broker_json(&revokee, "web01", 443).unwrap_err();
    assert!(err.contains("revoked"), "{err}");
    let err = revokee.fails(&["connect", "web01", "443"]);
    assert!(err.contains("hint: the grant was revoked"), "{err}");
    assert_eq!(admin.json(&["grant", "get", "revokee"])["state"], "revoked");

    let token = grant(
        &admin,
        &[
            "capped",
            "--target",
            "web01:443",
            "--ttl",
            "1h",
            "--max-connections",
            "3",
        ],
    );
    let capped = third_party(&cp, &token, "capped");
    for _ in 0..3 {
        broker_json(&capped, "web01", 443).unwrap();
    }
    let err = broker_json(&capped, "web01", 443).unwrap_err();
    assert!(err.contains("used all its connections"), "{err}");
    // The CLI's hint says what to do about it, not "log in again".
    let err = capped.fails(&["connect", "web01", "443"]);
    assert!(
        err.contains("hint: the grant's --max-connections are all used"),
        "{err}"
    );
    assert_eq!(admin.json(&["grant", "get", "capped"])["connections"], 3);

    let token = grant(&admin, &["brief", "--target", "web01:443", "--ttl", "1s"]);
    let file = cp.dir.path().join("brief.grant");
    std::fs::write(&file, &token).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1300));
    let err = admin.with_token(&token).fails(&["whoami"]);
    assert!(err.contains("expired"), "{err}");
    assert!(err.contains("hint: the grant's time is over"), "{err}");
    assert!(!err.contains("log in again"), "{err}");
}

#[test]
fn grant_tokens_are_never_stored_or_logged_in_clear() {
    let (cp, admin) = world();
    let token = grant(&admin, &["secret", "--target", "web01:443", "--ttl", "1h"]);
    let acme = third_party(&cp, &token, "secret");
    broker_json(&acme, "web01", 443).unwrap();
    let secret = token.rsplit('_').next().unwrap();
    for entry in std::fs::read_dir(cp.data_dir()).unwrap() {
        let path = entry.unwrap().path();
        let bytes = std::fs::read(&path).unwrap_or_default();
        let text = String::from_utf8_lossy(&bytes);
        assert!(!text.contains(secret), "grant secret found in {}", path.display());
    }
    assert!(!cp.log().contains(secret), "grant secret found in the server log");
}

#[test]
fn the_audit_trail_lists_every_decision_with_its_principal_and_reason() {
    let (cp, admin) = world();
    let token = grant(&admin, &["acme", "--target", "web01:443", "--ttl", "1h"]);
    let acme = third_party(&cp, &token, "acme");
    broker_json(&acme, "web01", 443).unwrap();
    broker_json(&acme, "db01", 443).unwrap_err();
    broker_json(&admin, "web01", 22).unwrap();

    let trail = common::wait_for(|| {
        let t = admin.json(&["audit", "--since", "1h"]);
        (t.as_array().unwrap().len() >= 3).then_some(t)
    });
    let events = trail.as_array().unwrap();
    let find = |principal: &str, target: &str| {
        events
            .iter()
            .find(|e| e["principal"] == principal && e["target"] == target)
            .unwrap_or_else(|| panic!("no audit event for {principal} -> {target}: {trail}"))
    };
    let ok = find("grant:acme", "web01");
    assert_eq!(
        (ok["allowed"].as_bool(), ok["port"].as_u64()),
        (Some(true), Some(443))
    );
    assert_eq!(ok["transport"], "gateway");
    let refused = find("grant:acme", "db01");
    assert_eq!(refused["allowed"], false);
    assert!(
        refused["reason"].as_str().unwrap().contains("does not include"),
        "{refused}"
    );
    assert_eq!(find("user:admin", "web01")["allowed"], true);

    let only = admin.json(&["audit", "--principal", "grant:acme"]);
    assert_eq!(only.as_array().unwrap().len(), 2);
    let table = admin.ok(&["audit"]);
    assert!(table.starts_with("TIME") && table.contains("refused"), "{table}");
}

#[test]
fn a_credential_minted_for_a_grant_never_outlives_it() {
    let (cp, admin) = world();
    let token = grant(&admin, &["brief", "--target", "web01:443", "--ttl", "60s"]);
    let brief = third_party(&cp, &token, "brief");
    let r = broker_json(&brief, "web01", 443).unwrap();
    let g = admin.json(&["grant", "get", "brief"]);
    let grant_expiry = time::OffsetDateTime::parse(
        g["expires_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let cred_expiry = time::OffsetDateTime::parse(
        r["expires_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    // The credential TTL is 5 min; the grant has a minute left.
    assert!(cred_expiry <= grant_expiry, "{cred_expiry} > {grant_expiry}");
}

#[test]
fn a_grant_file_holds_all_its_holder_needs_to_log_in_with_one_command() {
    use std::os::unix::fs::PermissionsExt;
    let (cp, admin) = world();
    let path = cp.dir.path().join("acme.grant");
    let file = path.to_str().unwrap();
    let out = admin.run(&[
        "grant",
        "create",
        "acme",
        "--target",
        "web01:443",
        "--ttl",
        "1h",
        "--file",
        file,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(out.stdout.is_empty(), "the token is in the file, not on stdout");
    assert!(
        stderr.contains("its holder runs: otherix login --grant-file"),
        "{stderr}"
    );
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains(&cp.url) && text.contains(&cp.fingerprint), "{text}");
    assert!(text.contains("token = \"otxg_"), "{text}");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // An existing file: said before any grant is made.
    let err = admin.fails(&[
        "grant",
        "create",
        "acme2",
        "--target",
        "web01:443",
        "--ttl",
        "1h",
        "--file",
        file,
    ]);
    assert!(err.contains("exists already; no grant made"), "{err}");
    admin.fails(&["grant", "get", "acme2"]);

    // The holder, with nothing but the file: one command.
    let holder = cp.cli("holder");
    let out = holder.ok(&["login", "--grant-file", file]);
    assert!(out.contains("grant:acme"), "{out}");
    assert_eq!(holder.json(&["whoami"])["principal"], "grant:acme");
    // whoami says where the cluster is, and which CA it has.
    let me = holder.ok(&["whoami"]);
    assert!(me.contains(&cp.url) && me.contains(&cp.fingerprint), "{me}");
    // Without a grant file naming them, the servers are required.
    let err = cp.cli("nobody").fails(&["login", "--token-file", file]);
    assert!(err.contains("--server is required"), "{err}");
}
