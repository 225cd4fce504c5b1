//! Operability of the CLI against a real control plane: `version`,
//! `logout`, the audit trail a page at a time and followed, `--watch`, and
//! `vm migrate` giving up at its `--timeout`.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use common::fake_node::{empty_heartbeat, enroll_as, rt};
use common::{admin_token, curl, wait_for, Cli, Cp, TempDir, BIN};
use otherix_client::Client;
use otherix_proto::agent::{Heartbeat, NodeRoles};
use otherix_proto::BrokerRequest;

/// A long-running CLI command (`--follow`, `--watch`) whose stdout lines
/// arrive on a channel; killed on drop.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Running {
    fn start(cli: &Cli, args: &[&str]) -> Running {
        let mut child = Command::new(BIN)
            .args(args)
            .env("OTHERIX_CONFIG", &cli.config)
            .env_remove("OTHERIX_TOKEN")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn otherix");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Running { child, lines }
    }

    /// The next stdout line (within 20 s).
    fn line(&self) -> String {
        self.lines
            .recv_timeout(Duration::from_secs(20))
            .expect("a line on stdout within 20 s")
    }

    /// The next line, parsed as one JSON document.
    fn json(&self) -> serde_json::Value {
        let line = self.line();
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not one JSON document a line ({e}): {line}"))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A refused broker call: one `broker` audit event naming `target`.
fn refused_broker_call(client: &Client, target: &str) {
    let err = rt()
        .block_on(client.broker(&BrokerRequest {
            target: target.into(),
            port: 22,
            exclude: vec![],
        }))
        .expect_err("there is no such VM");
    assert!(err.status().is_some(), "refused by the API: {err}");
}

fn admin_client(cp: &Cp) -> Client {
    Client::new(&cp.url, &cp.ca_pem(), Some(admin_token(cp))).unwrap()
}

/// Broker events for targets starting with `prefix`, as `audit` prints them.
fn broker_events(admin: &Cli, prefix: &str) -> Vec<serde_json::Value> {
    admin
        .json(&["audit", "--limit", "5000"])
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["target"].as_str().is_some_and(|t| t.starts_with(prefix)))
        .cloned()
        .collect()
}

#[test]
fn version_shows_client_and_server_and_only_the_client_when_the_server_is_away() {
    let mut cp = Cp::start();
    let admin = cp.admin();
    let (status, info) = curl(&cp, &[&format!("{}/v1/info", cp.url)]);
    assert_eq!(status, 200);
    let info: serde_json::Value = serde_json::from_str(&info).unwrap();

    let v = admin.json(&["version"]);
    assert_eq!(v["client"]["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(v["server"]["version"], info["version"]);
    assert_eq!(v["server"]["cluster_id"], info["cluster_id"]);
    assert_eq!(v["server"]["url"], cp.url.as_str());
    let table = admin.ok(&["version"]);
    assert!(
        table.contains("Client Version:") && table.contains("Server Version:"),
        "{table}"
    );
    assert!(table.contains(info["cluster_id"].as_str().unwrap()), "{table}");
    assert!(admin.ok(&["--version"]).starts_with("otherix "));

    // No server to ask: still the client's version, exit 0, and why on stderr.
    cp.kill9();
    let out = admin.run(&["version", "-o", "json"]);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["client"]["version"], env!("CARGO_PKG_VERSION"));
    assert!(v["server"].is_null(), "{v}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr}");
    assert!(
        stderr.starts_with("note: no server version: cannot connect"),
        "{stderr}"
    );
}

#[test]
fn logout_forgets_the_token_and_commands_then_ask_to_log_in() {
    let cp = Cp::start();
    let admin = cp.admin();
    admin.ok(&["whoami"]);

    let out = admin.run(&["logout"]);
    assert!(out.status.success(), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("logged out of {}", cp.url)), "{stderr}");
    assert!(out.stdout.is_empty());
    let saved = std::fs::read_to_string(&admin.config).unwrap();
    assert!(!saved.contains("token"), "the token is gone: {saved}");
    assert!(saved.contains(&cp.url), "the context stays: {saved}");

    let err = admin.fails(&["vm", "list"]);
    assert!(err.contains("not logged in"), "{err}");
    assert!(err.contains("hint: run `otherix login"), "{err}");

    // Again: nothing to do, not an error.
    let out = admin.run(&["logout"]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("not logged in"));
}

#[test]
fn audit_pages_hold_every_event_once_and_limits_above_the_maximum_are_refused() {
    let cp = Cp::start();
    let admin = cp.admin();
    let client = admin_client(&cp);
    for i in 0..23 {
        refused_broker_call(&client, &format!("ghost{i:02}"));
    }
    // Broker decisions are written on the side: wait until all are there.
    wait_for(|| (broker_events(&admin, "ghost").len() == 23).then_some(()));

    let mut seen: Vec<serde_json::Value> = vec![];
    let mut after: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut args = vec!["audit", "--limit", "5", "-o", "json"];
        if let Some(a) = &after {
            args.extend(["--after", a]);
        }
        let out = admin.run(&args);
        assert!(out.status.success(), "{out:?}");
        let page: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        assert!(page.len() <= 5, "at most --limit events: {}", page.len());
        seen.extend(page);
        pages += 1;
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        match stderr.split_once("`otherix audit --after ") {
            Some((_, rest)) => {
                let rest = rest.trim_end().trim_end_matches('`');
                assert!(rest.ends_with("--limit 5"), "the hint keeps the limit: {stderr}");
                after = Some(rest.split_whitespace().next().unwrap().to_string());
            }
            None => {
                assert!(stderr.is_empty(), "{stderr}");
                break;
            }
        }
        assert!(pages < 20, "paging does not end");
    }
    let ghosts: Vec<&str> = seen
        .iter()
        .filter_map(|e| e["target"].as_str())
        .filter(|t| t.starts_with("ghost"))
        .collect();
    let expected: Vec<String> = (0..23).map(|i| format!("ghost{i:02}")).collect();
    let mut sorted = ghosts.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "every event once, none lost");
    let ids: Vec<u64> = seen.iter().map(|e| e["id"].as_u64().unwrap()).collect();
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), ids.len(), "no event twice: {ids:?}");
    let times: Vec<time::OffsetDateTime> = seen
        .iter()
        .map(|e| {
            time::OffsetDateTime::parse(
                e["at"].as_str().unwrap(),
                &time::format_description::well_known::Rfc3339,
            )
            .unwrap()
        })
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "oldest first: {times:?}");
    assert!(pages >= 5, "23 events in pages of 5: {pages} pages");

    // The API bounds a page, and says so.
    let token = admin_token(&cp);
    let auth = format!("Authorization: Bearer {token}");
    for query in ["limit=5001", "limit=0", "after=yesterday"] {
        let (status, body) = curl(&cp, &["-H", &auth, &format!("{}/v1/audit?{query}", cp.url)]);
        assert_eq!(status, 400, "{query}: {body}");
        assert!(body.contains("\"invalid\"") || body.contains("error"), "{body}");
    }
    let (status, body) = curl(&cp, &["-H", &auth, &format!("{}/v1/audit?limit=5000", cp.url)]);
    assert_eq!(status, 200, "{body}");
    let page: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(page["events"].as_array().unwrap().len() >= 23);
    assert!(page.get("next").is_none(), "one page holds it all: {page}");
    // The CLI refuses it before asking.
    let out = admin.run(&["audit", "--limit", "5001"]);
    assert!(!out.status.success());
}

#[test]
fn audit_follow_prints_events_as_they_are_recorded() {
    let cp = Cp::start();
    let admin = cp.admin();
    let client = admin_client(&cp);
    refused_broker_call(&client, "before");
    wait_for(|| (!broker_events(&admin, "before").is_empty()).then_some(()));

    let follow = Running::start(&admin, &["audit", "--follow", "-o", "json"]);
    let first = follow.json();
    assert_eq!(
        first["target"], "before",
        "what was recorded comes first: {first}"
    );
    refused_broker_call(&client, "after01");
    let next = follow.json();
    assert_eq!(
        (next["target"].as_str(), next["allowed"].as_bool()),
        (Some("after01"), Some(false)),
        "{next}"
    );
    refused_broker_call(&client, "after02");
    assert_eq!(follow.json()["target"], "after02", "each event once, in order");
}

#[test]
fn lb_get_watch_prints_a_new_document_when_the_lb_changes() {
    let cp = Cp::start();
    let admin = cp.admin();
    admin.ok(&["lb", "create", "web-lb", "--port", "80", "--selector", "app=web"]);

    let watch = Running::start(&admin, &["lb", "get", "web-lb", "--watch", "-o", "json"]);
    let first = watch.json();
    assert_eq!(
        (first["name"].as_str(), first["port"].as_u64()),
        (Some("web-lb"), Some(80))
    );
    admin.ok(&["lb", "update", "web-lb", "--port", "8080"]);
    let second = watch.json();
    assert_eq!(second["port"], 8080, "{second}");
    // Nothing changed: nothing printed (within a few polls).
    assert!(
        watch.lines.recv_timeout(Duration::from_millis(2500)).is_err(),
        "a document per change only"
    );
}

#[test]
fn vm_and_node_list_watch_print_a_document_per_change_and_none_per_heartbeat() {
    let cp = Cp::start();
    let admin = cp.admin();
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    common::fake_node::beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    let nodes = Running::start(&admin, &["node", "list", "--watch", "-o", "json"]);
    let first = nodes.json();
    assert_eq!(first[0]["name"], "n1", "{first}");
    // Heartbeats move only the last-heartbeat time: not a change.
    for _ in 0..3 {
        common::fake_node::beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    }
    assert!(
        nodes.lines.recv_timeout(Duration::from_millis(2500)).is_err(),
        "a heartbeat redrew the list"
    );
    // A node joining is one.
    let n2 = enroll_as(&cp, "n2", "10.213.1.12", false);
    common::fake_node::beat(&n2, "n2", "10.213.1.12", true, None).unwrap();
    let mut names = vec![];
    while names.len() < 2 {
        let doc = nodes.json();
        names = doc
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["name"].clone())
            .collect();
    }
    assert_eq!(names, ["n1", "n2"]);

    let vms = Running::start(&admin, &["vm", "list", "--watch", "-o", "json"]);
    assert_eq!(vms.json(), serde_json::json!([]));
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.3.0.0/24",
    ]);
    admin.ok(&["vm", "create", "web01", "--network", "ov"]);
    let doc = vms.json();
    assert_eq!(doc[0]["name"], "web01", "{doc}");
    // -o yaml: the same fields, block style.
    let yaml = admin.ok(&["vm", "get", "web01", "-o", "yaml"]);
    assert!(yaml.lines().any(|l| l == "name: web01"), "{yaml}");
    assert!(yaml.lines().any(|l| l == "network: ov"), "{yaml}");
    let yaml = admin.ok(&["network", "list", "-o", "yaml"]);
    assert!(yaml.starts_with("- "), "a list: {yaml}");
    assert!(yaml.lines().any(|l| l.trim() == "subnet: 10.3.0.0/24"), "{yaml}");
    // The table, off a terminal: each version after a blank line.
    let table = Running::start(&admin, &["vm", "list", "-w"]);
    assert!(table.line().starts_with("NAME"), "the header first");
}

#[test]
fn o_wide_adds_columns_after_the_table_ones() {
    let cp = Cp::start();
    let admin = cp.admin();
    admin.ok(&[
        "network",
        "create",
        "wide-net",
        "--type",
        "overlay",
        "--subnet",
        "10.4.0.0/24",
    ]);
    admin.ok(&["vm", "create", "web01", "--network", "wide-net"]);
    let vm = admin.json(&["vm", "get", "web01"]);
    let mac = vm["mac"].as_str().unwrap().to_string();
    let header = |out: &str| {
        out.lines()
            .next()
            .unwrap()
            .split_whitespace()
            .map(String::from)
            .collect::<Vec<_>>()
    };

    let table = admin.ok(&["vm", "list"]);
    assert_eq!(
        header(&table),
        ["NAME", "STATE", "NETWORK", "IP", "NODE", "LABELS", "AGE"]
    );
    assert!(!table.contains(&mac), "{table}");
    let wide = admin.ok(&["vm", "list", "-o", "wide"]);
    assert_eq!(
        header(&wide),
        ["NAME", "STATE", "NETWORK", "IP", "NODE", "LABELS", "AGE", "MAC", "RUNTIME", "REASON"]
    );
    let row: Vec<&str> = wide.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(
        (row[0], row[7], row[8]),
        ("web01", mac.as_str(), "netns"),
        "{wide}"
    );

    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    common::fake_node::beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    let wide = admin.ok(&["node", "list", "-o", "wide"]);
    assert_eq!(
        header(&wide)[7..],
        ["RELAY", "OVERLAYS", "AGENT", "LAST", "HEARTBEAT", "REASON"],
        "{wide}"
    );
    assert!(
        wide.lines().nth(1).unwrap().contains(" ago"),
        "the heartbeat's age: {wide}"
    );
    // Getting one object is the same in both.
    assert_eq!(
        admin.ok(&["vm", "get", "web01", "-o", "wide"]),
        admin.ok(&["vm", "get", "web01"])
    );
}

#[test]
fn session_list_watch_prints_the_open_sessions() {
    let cp = Cp::start();
    let admin = cp.admin();
    let watch = Running::start(&admin, &["session", "list", "--watch", "-o", "json"]);
    assert_eq!(watch.json(), serde_json::json!([]));

    // Without -o json and not on a terminal: the table (here: that there is none).
    let watch = Running::start(&admin, &["session", "list", "--watch"]);
    assert_eq!(watch.line(), "No open sessions.");
}

#[test]
fn vm_migrate_gives_up_waiting_at_its_timeout_with_one_line() {
    let cp = Cp::start();
    let admin = cp.admin();
    let (n1, n2) = (
        enroll_as(&cp, "n1", "10.213.1.11", false),
        enroll_as(&cp, "n2", "10.213.1.12", false),
    );
    // A hypervisor that heartbeats; it never reports a handover.
    let beat = |client: &Client, name: &str, vtep: &str, running: &[&str]| {
        rt().block_on(client.heartbeat(&Heartbeat {
            node: name.into(),
            roles: Some(NodeRoles {
                hypervisor: true,
                gateway: None,
                relay: None,
            }),
            vtep: vtep.into(),
            guests: otherix_testbed::fake_node::running(running),
            netns: Some(format!("ns-{name}")),
            ready_overlays: vec!["ov".into()],
            ..empty_heartbeat()
        }))
        .unwrap()
    };
    beat(&n1, "n1", "10.213.1.11", &[]);
    beat(&n2, "n2", "10.213.1.12", &[]);
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    let vm = admin.json(&["vm", "create", "web01", "--network", "ov", "--node", "n1"]);
    let id = vm["id"].as_str().unwrap().to_string();
    beat(&n1, "n1", "10.213.1.11", &[&id]);
    assert_eq!(admin.json(&["vm", "get", "web01"])["state"], "running");

    let started = std::time::Instant::now();
    let out = admin.run(&["vm", "migrate", "web01", "--to", "n2", "--timeout", "1s"]);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(out.stdout.is_empty(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let lines: Vec<&str> = err.lines().collect();
    // Not a terminal: one line for the step it reached, then the error.
    assert_eq!(lines.len(), 2, "{err}");
    assert!(lines[0].ends_with("s  handing over from n1"), "{err}");
    assert!(
        lines[1].starts_with("error: vm web01 is still migrating to n2 after 1s (handing over from n1)"),
        "{err}"
    );
    assert!(lines[1].contains("otherix vm get web01"), "{err}");
    // It goes on: the CP still has it migrating.
    let vm = admin.json(&["vm", "get", "web01"]);
    assert_eq!(
        (vm["state"].as_str(), vm["migrate_to"].as_str()),
        (Some("migrating"), Some("n2"))
    );
}

#[test]
fn an_ssh_option_taken_for_the_output_flag_gets_a_hint() {
    let out = Command::new(BIN)
        .args(["ssh", "web01", "-o", "BatchMode=yes"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("invalid value 'BatchMode=yes'"), "{err}");
    assert!(
        err.contains("hint: ssh's own options go after `--`: otherix ssh web01 -- -o BatchMode=yes"),
        "{err}"
    );
}

#[test]
fn api_tokens_expire_at_their_ttl_or_the_servers_default_and_say_so() {
    let cp = Cp::start_with(TempDir::new("tok"), &["--token-ttl", "30d"]);
    let admin = cp.admin();
    admin.ok(&["user", "create", "ci", "--role", "viewer"]);
    // Without --ttl: the server's default, 30 days here.
    let long: serde_json::Value =
        serde_json::from_str(&admin.ok(&["user", "token", "create", "ci", "-o", "json"])).unwrap();
    let expires = time::OffsetDateTime::parse(
        long["expires_at"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let days = (expires - time::OffsetDateTime::now_utc()).whole_days();
    assert!((29..=30).contains(&days), "{long}");
    // With --ttl 2s: works, then is refused with its own message and hint.
    let short = admin.ok(&["user", "token", "create", "ci", "--ttl", "2s"]);
    let ci = admin.with_token(short.trim());
    ci.ok(&["whoami"]);
    let listed = admin.json(&["user", "token", "list", "ci"]);
    assert_eq!(listed.as_array().unwrap().len(), 2, "{listed}");
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["expires_at"].is_string()),
        "{listed}"
    );
    let table = admin.ok(&["user", "token", "list", "ci"]);
    assert!(
        table.starts_with("ID") && table.contains("EXPIRES") && table.contains("LAST USED"),
        "{table}"
    );
    let err = wait_for(|| {
        let out = ci.run(&["whoami"]);
        (!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).to_string())
    });
    assert!(err.starts_with("error: ") && err.contains("expired at"), "{err}");
    assert!(err.contains("hint: an admin makes a new one"), "{err}");
    assert!(!err.contains("log in again"), "{err}");
    assert!(admin.ok(&["user", "token", "list", "ci"]).contains("(expired)"));
    // A lifetime the server does not take is one line.
    let err = admin.fails(&["user", "token", "create", "ci", "--ttl", "4000d"]);
    assert!(err.contains("ttl_seconds must be 1 to"), "{err}");
}
