//! End-to-end tests of the control plane foundation: a real `otherix server`
//! process driven by the real CLI (and by curl for raw HTTP).

mod common;

use std::collections::BTreeSet;

use common::{admin_token, curl, Cp};
use serde_json::Value;

#[test]
fn first_start_writes_an_admin_token_with_mode_0600_and_never_logs_it() {
    let cp = Cp::start();
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(cp.admin_token_file()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    let token = admin_token(&cp);
    assert!(token.starts_with("otx_"), "{token}");
    let banner = cp.banner.join("\n");
    assert!(
        cp.fingerprint.starts_with("sha256:") && cp.fingerprint.len() == 71,
        "{banner}"
    );
    assert!(!banner.contains(&token) && !cp.log().contains(&token));
}

#[test]
fn login_pins_the_ca_and_a_wrong_fingerprint_is_refused() {
    let cp = Cp::start();
    let cli = cp.cli("pin");
    let wrong = format!("sha256:{}", "00".repeat(32));
    let err = cli.fails(&[
        "login",
        "--server",
        &cp.url,
        "--token-file",
        cp.admin_token_file().to_str().unwrap(),
        "--ca-fingerprint",
        &wrong,
    ]);
    assert!(err.contains("fingerprint mismatch"), "{err}");
    assert!(!cli.config.exists(), "a refused login must save nothing");

    // Without a fingerprint and without a terminal, nothing is trusted blindly.
    let err = cli.fails(&[
        "login",
        "--server",
        &cp.url,
        "--token-file",
        cp.admin_token_file().to_str().unwrap(),
    ]);
    assert!(
        err.contains(&cp.fingerprint) && err.contains("--ca-fingerprint"),
        "{err}"
    );

    let admin = cp.admin();
    let me = admin.json(&["whoami"]);
    assert_eq!(me["principal"], "user:admin");
    assert_eq!(me["role"], "admin");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&admin.config).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the client config holds a token");

    // Another cluster (another CA) at the saved URL's place is refused.
    let other = Cp::start();
    let cfg = std::fs::read_to_string(&admin.config).unwrap();
    std::fs::write(&admin.config, cfg.replace(&cp.url, &other.url)).unwrap();
    let err = admin.fails(&["vm", "list"]);
    assert!(err.contains("not signed by the pinned cluster CA"), "{err}");
}

#[test]
fn login_with_a_bad_token_saves_nothing() {
    let cp = Cp::start();
    let cli = cp.cli("bad");
    let err = cli.fails(&[
        "login",
        "--server",
        &cp.url,
        "--token",
        "otx_0000000000000000_0000000000000000000000000000000000000000000000000000000000000000",
        "--ca-fingerprint",
        &cp.fingerprint,
    ]);
    assert!(err.contains("invalid or revoked API token"), "{err}");
    assert!(!cli.config.exists());
}

#[test]
fn networks_and_vms_round_trip_through_every_command() {
    let cp = Cp::start();
    let a = cp.admin();
    let out = a.ok(&[
        "network",
        "create",
        "web-net",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    assert!(out.contains("network/web-net created"), "{out}");
    let lab = a.json(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.101.0.0/24",
        "--node",
        "node1",
    ]);
    assert_eq!(lab["type"], "bridge");
    assert_eq!(lab["node"], "node1");
    assert_eq!(lab["vni"], Value::Null);
    let other = a.json(&[
        "network",
        "create",
        "other",
        "--type",
        "overlay",
        "--subnet",
        "10.102.0.0/24",
    ]);
    let web = a.json(&["network", "get", "web-net"]);
    assert_ne!(web["vni"], other["vni"], "each overlay gets its own VNI");
    assert_eq!(web["node_address"], "10.100.0.1");

    let table = a.ok(&["network", "list"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header, ["NAME", "TYPE", "SUBNET", "VNI", "NODES", "VMS", "AGE"]);
    assert_eq!(a.json(&["network", "list"]).as_array().unwrap().len(), 3);

    let web01 = a.json(&[
        "vm",
        "create",
        "web01",
        "--network",
        "web-net",
        "--label",
        "app=web",
    ]);
    assert_eq!(
        web01["ip"], "10.100.0.2",
        "the first lease follows the node address"
    );
    assert_eq!(web01["state"], "pending");
    let mac = web01["mac"].as_str().unwrap();
    assert!(mac.starts_with("02:"), "locally administered: {mac}");
    a.ok(&[
        "vm",
        "create",
        "web02",
        "--network",
        "web-net",
        "-l",
        "app=web",
        "-l",
        "tier=canary",
    ]);
    a.ok(&["vm", "create", "db01", "--network", "web-net", "-l", "app=db"]);
    let bridged = a.json(&["vm", "create", "lab01", "--network", "lab"]);
    assert_eq!(bridged["node"], "node1", "a bridge VM runs on its bridge's node");
    let err = a.fails(&["vm", "create", "lab02", "--network", "lab", "--node", "node2"]);
    assert!(err.contains("bridge on node(s) node1"), "{err}");

    let names = |v: Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|vm| vm["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(
        names(a.json(&["vm", "list", "--selector", "app=web"])),
        ["web01", "web02"]
    );
    assert_eq!(
        names(a.json(&["vm", "list", "-l", "app=web,tier!=canary"])),
        ["web01"]
    );
    assert_eq!(
        names(a.json(&["vm", "list", "-l", "app in (db,web),!tier"])),
        ["db01", "web01"]
    );
    assert_eq!(
        names(a.json(&["vm", "list", "-l", "app notin (web)"])),
        ["db01", "lab01"]
    );
    // Pages, in name order: a page shorter than its limit is the last.
    let token = admin_token(&cp);
    let page = |query: &str| -> (u16, String) {
        curl(
            &cp,
            &[
                "-H",
                &format!("Authorization: Bearer {token}"),
                &format!("{}/v1/vms?{query}", cp.url),
            ],
        )
    };
    let (status, body) = page("limit=2");
    assert_eq!(status, 200, "{body}");
    assert_eq!(names(serde_json::from_str(&body).unwrap()), ["db01", "lab01"]);
    let (_, body) = page("limit=2&after=lab01");
    assert_eq!(names(serde_json::from_str(&body).unwrap()), ["web01", "web02"]);
    let (_, body) = page("limit=2&after=web02");
    assert!(names(serde_json::from_str(&body).unwrap()).is_empty());
    let (_, body) = page("limit=1&after=db01&selector=app%3Dweb");
    assert_eq!(names(serde_json::from_str(&body).unwrap()), ["web01"]);
    for bad in ["limit=0", "limit=1001", "limit=x"] {
        let (status, body) = page(bad);
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let err = a.fails(&["vm", "list", "-l", "app=we b"]);
    assert!(
        err.contains("position 7"),
        "the error points at the bad character: {err}"
    );

    let got = a.json(&["vm", "label", "web02", "tier-", "env=prod"]);
    assert_eq!(got["labels"], serde_json::json!({"app": "web", "env": "prod"}));
    assert_eq!(
        names(a.json(&["vm", "list", "-l", "app=web,!tier"])),
        ["web01", "web02"]
    );
    let err = a.fails(&["vm", "label", "web02", "bad key=x"]);
    assert!(err.contains("invalid label change"), "{err}");

    let table = a.ok(&["vm", "get", "web01"]);
    assert!(table.contains("10.100.0.2") && table.contains(mac), "{table}");
    let table = a.ok(&["vm", "list"]);
    assert!(table.starts_with("NAME") && table.contains("web02"), "{table}");

    let err = a.fails(&["network", "delete", "web-net"]);
    assert!(err.contains("used by 3 VM(s)"), "{err}");
    a.ok(&["vm", "delete", "web01"]);
    // The freed address is leased again first.
    let again = a.json(&["vm", "create", "web03", "--network", "web-net"]);
    assert_eq!(again["ip"], "10.100.0.2");
    for vm in ["web02", "web03", "db01"] {
        a.ok(&["vm", "delete", vm]);
    }
    a.ok(&["network", "delete", "web-net"]);
    let err = a.fails(&["network", "get", "web-net"]);
    assert!(err.contains("not found"), "{err}");
}

#[test]
fn invalid_names_subnets_and_duplicates_are_refused_clearly() {
    let cp = Cp::start();
    let a = cp.admin();
    let err = a.misused(&[
        "network",
        "create",
        "Web_Net",
        "--type",
        "overlay",
        "--subnet",
        "10.1.0.0/24",
    ]);
    assert!(err.contains("invalid network name"), "{err}");
    let err = a.fails(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.1.0.5/24",
    ]);
    assert!(err.contains("did you mean 10.1.0.0/24"), "{err}");
    let err = a.fails(&[
        "network",
        "create",
        "n1",
        "--type",
        "bridge",
        "--subnet",
        "10.1.0.0/24",
    ]);
    assert!(err.contains("--node"), "{err}");
    let err = a.fails(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.1.0.0/24",
        "--node",
        "x",
    ]);
    assert!(err.contains("takes no `node`"), "{err}");
    a.ok(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.1.0.0/24",
    ]);
    let err = a.fails(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.2.0.0/24",
    ]);
    assert!(err.contains("already exists"), "{err}");
    let err = a.fails(&[
        "network",
        "create",
        "n2",
        "--type",
        "overlay",
        "--subnet",
        "10.1.0.128/25",
    ]);
    assert!(err.contains("overlaps network \"n1\""), "{err}");
    let err = a.misused(&["vm", "create", "bad_name", "--network", "n1"]);
    assert!(err.contains("invalid VM name"), "{err}");
    let err = a.fails(&["vm", "create", "vm1", "--network", "nope"]);
    assert!(err.contains("network \"nope\" not found"), "{err}");
    a.ok(&["vm", "create", "vm1", "--network", "n1"]);
    let err = a.fails(&["vm", "create", "vm1", "--network", "n1"]);
    assert!(err.contains("vm \"vm1\" already exists"), "{err}");
    let err = a.fails(&["vm", "create", "vm2", "--network", "n1", "--label", "noequals"]);
    assert!(err.contains("invalid --label"), "{err}");
    let err = a.fails(&["vm", "get", "ghost"]);
    assert!(err.contains("vm \"ghost\" not found"), "{err}");
}

#[test]
fn an_exhausted_subnet_is_reported_and_leaves_nothing_behind() {
    let cp = Cp::start();
    let a = cp.admin();
    // A /29 has 8 addresses: network, node side, broadcast, and 5 leases.
    a.ok(&[
        "network",
        "create",
        "tiny",
        "--type",
        "overlay",
        "--subnet",
        "10.9.0.0/29",
    ]);
    let mut ips = BTreeSet::new();
    for i in 0..5 {
        let vm = a.json(&["vm", "create", &format!("t{i}"), "--network", "tiny"]);
        ips.insert(vm["ip"].as_str().unwrap().to_string());
    }
    assert_eq!(ips.len(), 5);
    let err = a.fails(&["vm", "create", "t5", "--network", "tiny"]);
    assert!(err.contains("exhausted"), "{err}");
    a.fails(&["vm", "get", "t5"]);
    assert_eq!(a.json(&["vm", "list"]).as_array().unwrap().len(), 5);
}

#[test]
fn roles_are_enforced_401_without_a_valid_token_403_without_the_role() {
    let cp = Cp::start();
    let a = cp.admin();
    a.ok(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.1.0.0/24",
    ]);
    a.ok(&["user", "create", "vera", "--role", "viewer"]);
    a.ok(&["user", "create", "uma", "--role", "user"]);
    let vera_token = a.ok(&["user", "token", "create", "vera"]).trim().to_string();
    let uma_token = a.ok(&["user", "token", "create", "uma"]).trim().to_string();
    let vera = a.with_token(&vera_token);
    let uma = a.with_token(&uma_token);

    // Viewer: reads, cannot write.
    assert_eq!(vera.json(&["whoami"])["role"], "viewer");
    vera.ok(&["network", "list"]);
    vera.ok(&["vm", "list"]);
    let err = vera.fails(&[
        "network",
        "create",
        "n2",
        "--type",
        "overlay",
        "--subnet",
        "10.2.0.0/24",
    ]);
    assert!(err.contains("role viewer may not create networks"), "{err}");
    let err = vera.fails(&["vm", "create", "v1", "--network", "n1"]);
    assert!(err.contains("may not create VMs"), "{err}");
    // User: cannot manage users.
    let err = uma.fails(&["user", "create", "eve", "--role", "admin"]);
    assert!(err.contains("role user may not create users"), "{err}");
    let err = uma.fails(&["user", "token", "create", "uma"]);
    assert!(err.contains("may not create tokens"), "{err}");
    uma.fails(&["user", "list"]);

    // Raw statuses: 401 vs 403.
    let url = format!("{}/v1/networks", cp.url);
    let (status, body) = curl(&cp, &[&url]);
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("\"unauthenticated\""), "{body}");
    let auth = format!("Authorization: Bearer {vera_token}");
    let (status, body) = curl(
        &cp,
        &[
            "-H",
            &auth,
            "-H",
            "Content-Type: application/json",
            "-d",
            r#"{"name":"x","type":"overlay","subnet":"10.3.0.0/24"}"#,
            &url,
        ],
    );
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("\"forbidden\""), "{body}");

    // A revoked token stops working at once.
    let vera_id = a.json(&["user", "get", "vera"])["tokens"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    a.ok(&["user", "token", "revoke", "vera", &vera_id]);
    let err = vera.fails(&["vm", "list"]);
    assert!(err.contains("invalid or revoked API token"), "{err}");
    assert!(err.contains("hint:"), "{err}");

    // Deleting a user kills its tokens; the last admin cannot go.
    a.ok(&["user", "delete", "uma"]);
    uma.fails(&["vm", "list"]);
    let err = a.fails(&["user", "delete", "admin"]);
    assert!(err.contains("last admin"), "{err}");
}

#[test]
fn access_rules_are_validated_and_listed() {
    let cp = Cp::start();
    let a = cp.admin();
    a.ok(&["user", "create", "alice", "--role", "user"]);
    let out = a.ok(&[
        "user",
        "allow",
        "alice",
        "--selector",
        "app=web",
        "--ports",
        "22,80",
    ]);
    assert!(out.contains("app=web on ports 22,80"), "{out}");
    let user = a.json(&["user", "get", "alice"]);
    assert_eq!(user["rules"][0]["selector"], "app=web");
    assert_eq!(user["rules"][0]["ports"], serde_json::json!([22, 80]));
    let err = a.fails(&["user", "allow", "alice", "--selector", "=web", "--ports", "22"]);
    assert!(err.contains("invalid selector"), "{err}");
    let err = a.misused(&["user", "allow", "alice", "--selector", "app=web", "--ports", "0"]);
    assert!(err.contains("a port is 1 to 65535, or `console`"), "{err}");
    let err = a.fails(&["user", "allow", "admin", "--selector", "app=web", "--ports", "22"]);
    assert!(err.contains("apply to role user"), "{err}");
    let id = user["rules"][0]["id"].to_string();
    a.ok(&["user", "disallow", "alice", "--rule", &id]);
    assert_eq!(a.json(&["user", "get", "alice"])["rules"], serde_json::json!([]));
    // The console is its own word, shown as such.
    let out = a.ok(&[
        "user",
        "allow",
        "alice",
        "--selector",
        "app=db",
        "--ports",
        "22,console",
    ]);
    assert!(out.contains("app=db on ports console,22"), "{out}");
    let user = a.json(&["user", "get", "alice"]);
    assert_eq!(user["rules"][0]["ports"], serde_json::json!([0, 22]));
    let id = user["rules"][0]["id"].to_string();
    a.ok(&["user", "disallow", "alice", "--rule", &id]);
    let table = a.ok(&["user", "list"]);
    assert!(table.starts_with("NAME") && table.contains("alice"), "{table}");
}

#[test]
fn five_hundred_concurrent_creates_never_lease_one_ip_twice() {
    let cp = Cp::start();
    let a = cp.admin();
    a.ok(&[
        "network",
        "create",
        "big",
        "--type",
        "overlay",
        "--subnet",
        "10.50.0.0/22",
    ]);
    let client = otherix_client::Client::new(&cp.url, &cp.ca_pem(), Some(admin_token(&cp))).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let results: Vec<Result<otherix_proto::Vm, otherix_client::ClientError>> = rt.block_on(async {
        let tasks: Vec<_> = (0..500)
            .map(|i| {
                let c = client.clone();
                tokio::spawn(async move {
                    c.create_vm(&otherix_proto::CreateVmRequest {
                        runtime: Default::default(),
                        ssh_keys: Vec::new(),
                        cpus: None,
                        image: None,
                        memory_mib: None,
                        name: format!("vm{i:03}").parse().unwrap(),
                        network: "big".parse().unwrap(),
                        labels: Default::default(),
                        node: None,
                        exec: None,
                    })
                    .await
                })
            })
            .collect();
        let mut out = vec![];
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let vms: Vec<_> = results
        .into_iter()
        .map(|r| r.expect("every create succeeds"))
        .collect();
    let ips: BTreeSet<_> = vms.iter().map(|v| v.ip).collect();
    let macs: BTreeSet<_> = vms.iter().map(|v| v.mac).collect();
    assert_eq!(ips.len(), 500, "no IP leased twice");
    assert_eq!(macs.len(), 500, "no MAC used twice");
    let listed = a.json(&["vm", "list"]);
    let listed_ips: BTreeSet<String> = listed
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["ip"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(listed_ips.len(), 500);
}

#[test]
fn kill_9_and_restart_keeps_every_object() {
    let mut cp = Cp::start();
    let a = cp.admin();
    a.ok(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.1.0.0/24",
    ]);
    a.ok(&[
        "network",
        "create",
        "b1",
        "--type",
        "bridge",
        "--subnet",
        "10.2.0.0/24",
        "--node",
        "node1",
    ]);
    for i in 0..20 {
        a.ok(&[
            "vm",
            "create",
            &format!("vm{i}"),
            "--network",
            "n1",
            "-l",
            &format!("idx={i}"),
        ]);
    }
    a.ok(&["user", "create", "alice", "--role", "user"]);
    a.ok(&["user", "allow", "alice", "--selector", "app=web", "--ports", "22"]);
    let alice_token = a.ok(&["user", "token", "create", "alice"]).trim().to_string();
    let before = (
        a.json(&["vm", "list"]),
        a.json(&["network", "list"]),
        a.json(&["user", "get", "alice"]),
    );
    let fingerprint = cp.fingerprint.clone();
    let token_before = admin_token(&cp);

    cp.kill9();
    cp.boot();
    assert_eq!(cp.fingerprint, fingerprint, "the cluster CA survives a restart");
    assert_eq!(admin_token(&cp), token_before, "no second admin is bootstrapped");
    assert!(
        !cp.banner.iter().any(|l| l.starts_with("admin token")),
        "{:?}",
        cp.banner
    );
    let a = cp.admin();
    let after = (
        a.json(&["vm", "list"]),
        a.json(&["network", "list"]),
        a.json(&["user", "get", "alice"]),
    );
    assert_eq!(before.0, after.0);
    assert_eq!(before.1, after.1);
    assert_eq!(before.2["rules"], after.2["rules"]);
    assert_eq!(
        a.with_token(&alice_token).json(&["whoami"])["principal"],
        "user:alice"
    );
    // Allocation continues after the restart without reusing a live lease.
    let next = a.json(&["vm", "create", "vm20", "--network", "n1"]);
    assert_eq!(next["ip"], "10.1.0.22");
}

#[test]
fn sigterm_shuts_down_gracefully() {
    let mut cp = Cp::start();
    cp.admin().ok(&["whoami"]);
    let status = cp.terminate();
    assert!(status.success(), "exit status after SIGTERM: {status}");
    assert!(cp.log().contains("control plane stopped"), "{}", cp.log());
}

#[test]
fn malformed_oversized_and_unknown_field_bodies_are_refused_and_create_nothing() {
    let cp = Cp::start();
    let a = cp.admin();
    a.ok(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.1.0.0/24",
    ]);
    let auth = format!("Authorization: Bearer {}", admin_token(&cp));
    let url = format!("{}/v1/vms", cp.url);
    let post = |ctype: &str, body: &str| {
        curl(
            &cp,
            &[
                "-H",
                &auth,
                "-H",
                &format!("Content-Type: {ctype}"),
                "--data-binary",
                body,
                &url,
            ],
        )
    };
    let json = "application/json";

    let (s, b) = post(json, r#"{"name": "vm1", "network": "n1""#);
    assert_eq!(s, 400, "{b}");
    assert!(b.contains("invalid_request"), "{b}");

    let (s, b) = post(json, r#"{"name": "vm1", "network": "n1", "netwrok": "n2"}"#);
    assert_eq!(s, 400, "{b}");
    assert!(b.contains("unknown field `netwrok`"), "{b}");

    let (s, b) = post(json, r#"{"name": "vm1", "network": 7}"#);
    assert_eq!(s, 400, "{b}");

    let big = cp.dir.path().join("big.json");
    std::fs::write(
        &big,
        format!(
            r#"{{"name": "vm1", "network": "n1", "exec": "{}"}}"#,
            "x".repeat(70 * 1024)
        ),
    )
    .unwrap();
    let (s, b) = post(json, &format!("@{}", big.display()));
    assert_eq!(s, 413, "{b}");
    assert!(b.contains("payload_too_large"), "{b}");

    let (s, b) = post("text/plain", r#"{"name": "vm1", "network": "n1"}"#);
    assert_eq!(s, 415, "{b}");

    let (s, b) = post(
        json,
        r#"{"name": "vm1", "network": "n1", "labels": {"bad key": "v"}}"#,
    );
    assert_eq!(s, 400, "{b}");
    assert!(b.contains("invalid label key"), "{b}");

    let (s, b) = curl(&cp, &["-H", &auth, &format!("{}/v1/nope", cp.url)]);
    assert_eq!(s, 404, "{b}");
    assert!(b.contains("\"not_found\""), "{b}");
    let (s, b) = curl(&cp, &["-X", "PUT", "-H", &auth, &url]);
    assert_eq!(s, 405, "{b}");

    let (s, b) = curl(&cp, &["-H", &auth, &format!("{url}?selector=app%3D%3D%3D")]);
    assert_eq!(s, 400, "{b}");
    assert!(b.contains("invalid selector"), "{b}");

    assert_eq!(
        a.json(&["vm", "list"]),
        serde_json::json!([]),
        "nothing half-created"
    );
}

#[test]
fn openapi_document_is_served_and_lists_the_endpoints() {
    let cp = Cp::start();
    let (s, body) = curl(&cp, &[&format!("{}/v1/openapi.json", cp.url)]);
    assert_eq!(s, 200);
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    for path in [
        "/v1/vms",
        "/v1/vms/{name}",
        "/v1/networks",
        "/v1/users/{name}/tokens",
        "/v1/whoami",
    ] {
        assert!(doc["paths"].get(path).is_some(), "missing {path}");
    }
    assert!(doc["components"]["schemas"].get("Vm").is_some());
    // A name in a request is a DNS label, and the document says so.
    let name = &doc["components"]["schemas"]["VmName"];
    assert_eq!(name["type"], "string", "{name}");
    assert_eq!(name["maxLength"], 63, "{name}");
    assert!(name["pattern"].as_str().is_some(), "{name}");
    let create = &doc["components"]["schemas"]["CreateVmRequest"]["properties"];
    assert_eq!(create["name"]["$ref"], "#/components/schemas/VmName", "{create}");
    assert_eq!(
        create["network"]["$ref"], "#/components/schemas/NetworkName",
        "{create}"
    );
}

#[test]
fn help_teaches_and_completions_are_generated() {
    let cli = common::Cli {
        config: "/nonexistent/otherix.toml".into(),
        token: None,
    };
    let help = cli.ok(&["vm", "create", "--help"]);
    assert!(help.contains("Examples:") && help.contains("--label"), "{help}");
    for shell in ["bash", "zsh", "fish"] {
        let script = cli.ok(&["completion", shell]);
        assert!(
            script.contains("otherix") && script.contains("network"),
            "{shell}"
        );
    }
    let err = cli.fails(&["vm", "list"]);
    assert!(err.contains("not logged in") && err.contains("hint:"), "{err}");

    // A command's help shows the global options that apply to it only.
    let options = |args: &[&str]| -> Vec<String> {
        cli.ok(args)
            .lines()
            .filter_map(|l| l.trim_start().split([' ', ',']).next())
            .filter(|w| w.starts_with('-'))
            .map(String::from)
            .collect()
    };
    let client = ["-o", "--context", "--grant-file"];
    let vm_list = options(&["vm", "list", "--help"]);
    for flag in client.iter().chain(&["--config", "-v", "--log-format"]) {
        assert!(
            vm_list.iter().any(|f| f == flag),
            "vm list lacks {flag}: {vm_list:?}"
        );
    }
    for cmd in ["server", "agent", "dev"] {
        let shown = options(&[cmd, "--help"]);
        for flag in client {
            assert!(!shown.iter().any(|f| f == flag), "{cmd} shows {flag}: {shown:?}");
        }
        assert!(shown.iter().any(|f| f == "--log-format"), "{cmd}: {shown:?}");
    }
    let image = options(&["image", "build", "--help"]);
    assert!(
        image.iter().any(|f| f == "-o") && !image.iter().any(|f| f == "--context"),
        "{image:?}"
    );
    // ... and refuses the others, with a usage error.
    let err = cli.misused(&["server", "-o", "json"]);
    assert!(
        err.starts_with("error: -o/--output does not apply to `otherix server`"),
        "{err}"
    );
    let err = cli.misused(&["--context", "prod", "completion", "bash"]);
    assert!(
        err.starts_with("error: --context does not apply to `otherix completion`"),
        "{err}"
    );

    // A reader that leaves early (`| head -1`) ends a printing command quietly.
    let mut head = std::process::Command::new(common::BIN)
        .args(["completion", "bash"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    std::io::Read::read_exact(head.stdout.as_mut().unwrap(), &mut first).unwrap();
    drop(head.stdout.take());
    let out = head.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !stderr.contains("panicked"),
        "{}: {stderr}",
        out.status
    );

    let out = cli.run(&["vm", "frobnicate"]);
    assert_eq!(out.status.code(), Some(2), "usage errors exit 2");
}

#[test]
fn a_vms_workload_command_is_shown_to_admins_only_and_whole_list_reads_are_rate_limited_per_principal() {
    let cp = Cp::start();
    let a = cp.admin();
    a.ok(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.3.0.0/24",
    ]);
    let secret = "otherix guest echo --banner password=hunter2";
    a.ok(&["vm", "create", "web01", "--network", "n1", "--exec", secret]);
    a.ok(&["user", "create", "vera", "--role", "viewer"]);
    let vera_token = a.ok(&["user", "token", "create", "vera"]).trim().to_string();
    let vera = a.with_token(&vera_token);

    // The admin sees the command; a viewer sees the VM without it.
    assert_eq!(a.json(&["vm", "get", "web01"])["exec"], secret);
    assert_eq!(a.json(&["vm", "list"])[0]["exec"], secret);
    let seen = vera.json(&["vm", "get", "web01"]);
    assert_eq!(seen["name"], "web01");
    assert!(seen["exec"].is_null(), "{seen}");
    let listed = vera.json(&["vm", "list"]);
    assert_eq!(listed[0]["name"], "web01");
    assert!(listed[0]["exec"].is_null(), "{listed}");
    assert!(!vera.ok(&["vm", "get", "web01"]).contains("hunter2"));

    // A viewer looping whole-table reads is slowed down (429 with
    // Retry-After); the admin, reading as fast, is not.
    let statuses = |token: &str, path: &str| -> Vec<u16> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let client = otherix_client::Client::new(&cp.url, &cp.ca_pem(), Some(token.to_string())).unwrap();
        rt.block_on(async {
            let calls = (0..100).map(|_| {
                let client = client.clone();
                let path = path.to_string();
                async move {
                    match client.get::<serde_json::Value>(&path).await {
                        Ok(_) => 200,
                        Err(otherix_client::ClientError::Api {
                            status,
                            code,
                            message,
                            ..
                        }) => {
                            assert_eq!(code, "rate_limited", "{message}");
                            assert!(message.contains("retry in"), "{message}");
                            status
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
            });
            futures_util::future::join_all(calls).await
        })
    };
    let admin = admin_token(&cp);
    for path in ["/v1/vms", "/v1/lbs"] {
        let viewer = statuses(&vera_token, path);
        let limited = viewer.iter().filter(|s| **s == 429).count();
        assert!(limited > 0 && viewer.contains(&200), "{path}: {viewer:?}");
        assert!(statuses(&admin, path).iter().all(|s| *s == 200), "{path}");
    }
}

/// The issue-26 hole: `!=`, `notin`, `!k` and the empty selector match a VM
/// that merely lacks labels, so such a rule would admit every VM created a
/// second later without them. `allow` refuses them; one an older control
/// plane stored allows nothing, says why at `user get` and at the broker.
#[test]
fn rules_that_require_no_label_are_refused_and_stored_ones_allow_nothing() {
    let mut cp = Cp::start();
    let a = cp.admin();
    a.ok(&["user", "create", "alice", "--role", "user"]);
    let err = a.fails(&[
        "user",
        "allow",
        "alice",
        "--selector",
        "env!=prod",
        "--ports",
        "22",
    ]);
    assert!(
        err.contains(
            "a rule must require at least one label: selector `env!=prod` requires no label, \
             so it would admit any VM created without labels; add a label the VMs must carry, \
             e.g. `team=web,env!=prod`"
        ),
        "{err}"
    );
    for selector in ["!legacy", "env notin (prod,staging)", "a!=1,!b", ""] {
        let err = a.fails(&["user", "allow", "alice", "--selector", selector, "--ports", "22"]);
        assert!(
            err.contains("a rule must require at least one label"),
            "{selector:?}: {err}"
        );
    }
    let rules = format!("{}/v1/users/alice/rules", cp.url);
    let auth = format!("Authorization: Bearer {}", admin_token(&cp));
    let (status, body) = curl(
        &cp,
        &[
            "-H",
            &auth,
            "-H",
            "Content-Type: application/json",
            "-d",
            r#"{"selector":"env!=prod","ports":[22]}"#,
            &rules,
        ],
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("\"rule_requires_no_label\""), "{body}");
    assert_eq!(a.json(&["user", "get", "alice"])["rules"], serde_json::json!([]));
    // Naming a label to carry makes the same exclusion acceptable.
    a.ok(&[
        "user",
        "allow",
        "alice",
        "--selector",
        "team=web,env!=prod",
        "--ports",
        "22",
    ]);

    a.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.7.0.0/24",
    ]);
    a.ok(&["vm", "create", "bare01", "--network", "ov"]);
    a.ok(&["vm", "create", "web01", "--network", "ov", "-l", "team=web"]);
    let alice = a.ok(&["user", "token", "create", "alice"]).trim().to_string();

    // A rule stored before `allow` refused these, as an upgrade finds it.
    cp.terminate();
    store_rule_as_before(&cp, "alice", "env!=prod", &[22]);
    cp.boot();
    let a = cp.admin();
    let user = a.json(&["user", "get", "alice"]);
    let rules = user["rules"].as_array().unwrap();
    let old = rules
        .iter()
        .find(|r| r["selector"] == "env!=prod")
        .expect("the stored rule");
    let inert = old["inert"].as_str().unwrap_or_default();
    assert!(
        inert.starts_with("allows nothing: selector `env!=prod` requires no label"),
        "{user}"
    );
    let good = rules
        .iter()
        .find(|r| r["selector"] == "team=web,env!=prod")
        .unwrap();
    assert!(good.get("inert").is_none(), "{user}");
    let table = a.ok(&["user", "get", "alice"]);
    assert!(table.contains("STATUS") && table.contains("in force"), "{table}");
    assert!(table.contains("allows nothing"), "{table}");

    let broker = |target: &str| {
        curl(
            &cp,
            &[
                "-H",
                &format!("Authorization: Bearer {alice}"),
                "-H",
                "Content-Type: application/json",
                "-d",
                &format!(r#"{{"target":"{target}","port":22}}"#),
                &format!("{}/v1/broker", cp.url),
            ],
        )
    };
    // Before, `env!=prod` admitted the unlabelled VM; now it fails closed.
    let (status, body) = broker("bare01");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("\"rule_requires_no_label\""), "{body}");
    assert!(
        body.contains(&format!("rule {} (`env!=prod`) requires no label", old["id"])),
        "{body}"
    );
    // The rule in force still admits its VM: refused only because no node
    // runs it, past the authorization.
    let (status, body) = broker("web01");
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("\"vm_not_running\""), "{body}");
}

/// Stores an access rule directly, as a control plane from before rules
/// had to require a label could have; the control plane must be stopped.
fn store_rule_as_before(cp: &Cp, user: &str, selector: &str, ports: &[u16]) {
    let database = cp
        .args
        .iter()
        .position(|a| a == "--database")
        .map(|i| cp.args[i + 1].clone());
    let db = cp.data_dir().join("otherix.db");
    common::fake_node::rt().block_on(async {
        let store = match database {
            Some(url) => otherix_store::Store::open_postgres(&url).await,
            None => otherix_store::Store::open(&db).await,
        }
        .unwrap();
        store
            .add_rule(user, selector, ports, time::OffsetDateTime::now_utc())
            .await
            .unwrap();
    });
}
