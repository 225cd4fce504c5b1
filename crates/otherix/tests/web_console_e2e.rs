//! The web console (`/ui/`) in a real headless browser: Debian's Chromium,
//! driven by Playwright for Python (`tests/web_console/driver.py`, in the
//! venv `.ci/web-console-venv` makes under `target/`), against a real
//! control plane — alone for sign-in and the refusals, and with nodes,
//! guests and a load balancer for the live pages. The Rust side does what
//! people do outside the browser (a guest stops serving, `otherix forward`,
//! the grant's holder at the CLI) between the browser's steps.
//!
//! Chromium runs in a network namespace of the test's world of its own,
//! without IPv6: in the host's, the interfaces other tests' worlds add and
//! remove make it abort what it is loading (`ERR_NETWORK_CHANGED`), and so
//! would a link-local address settling in its own.
//!
//! `OTHERIX_CONSOLE_SHOTS=DIR` saves a screenshot of each page there (the
//! ones in `docs/console/` were taken so).

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::browser::{Browser, SHOW_MS};
use common::BIN;

/// Where the console is.
struct Cp {
    url: String,
}
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// A `fetch` from the page's own script context, as a forger with the
/// page's cookie would make it: the answer's status and error code.
const FORGE: &str = r#"async ([path, body, csrf]) => {
  const headers = { "Content-Type": "application/json" };
  if (csrf) headers["X-Otherix-CSRF"] = me.csrf;
  const r = await fetch(path, { method: "POST", headers, body: JSON.stringify(body), credentials: "same-origin" });
  let code = null;
  try { code = (await r.json()).error.code; } catch (_) {}
  return [r.status, code];
}"#;

// ------------------------------------------------------------------ a control plane alone

#[test]
fn sign_in_with_a_token_a_viewer_sees_no_write_controls_and_forged_and_cross_site_writes_are_refused() {
    let world = World::new("webui-cp").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    (spec.hypervisors, spec.gateways) = (0, 0);
    let c = Cluster::start(world, spec).expect("the control plane starts");
    let cp = Cp { url: c.url.clone() };
    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    let token = token.trim();
    c.cli_ok(&["user", "create", "vera", "--role", "viewer"]).unwrap();
    let vera = c
        .cli_ok(&["user", "token", "create", "vera"])
        .unwrap()
        .trim()
        .to_string();
    let mut b = Browser::start(&c.world);

    // A wrong token is refused, in one line, and nothing is signed in.
    b.open("stranger");
    b.goto("stranger", &format!("{}/ui/", cp.url));
    b.shows("stranger", "#sign-in h1", "Sign in");
    b.fill(
        "stranger",
        "#token",
        &format!("otx_{}_{}", "0".repeat(16), "0".repeat(64)),
    );
    b.click("stranger", "#sign-in-form button");
    b.shows("stranger", "#sign-in-error", "invalid or revoked API token");
    b.shot("stranger", "sign-in");

    // The admin signs in: the cookie is HttpOnly (no script reads it).
    b.sign_in("admin", &cp.url, token);
    assert_eq!(b.texts("admin", "#who"), ["user:admin (admin)"]);
    assert_eq!(b.eval("admin", "() => document.cookie", json!(null)), "");
    b.page("admin", "#/grants", "Grants");
    assert_eq!(b.count("admin", "#grant-form"), 1, "an admin may create grants");

    // The viewer: every page readable, no write control anywhere.
    b.sign_in("viewer", &cp.url, &vera);
    for (hash, heading) in [
        ("#/overview", "Overview"),
        ("#/vms", "VMs"),
        ("#/lbs", "Load balancers"),
        ("#/sessions", "Sessions"),
        ("#/audit", "Audit"),
        ("#/grants", "Grants"),
        ("#/nodes", "Nodes"),
    ] {
        b.page("viewer", hash, heading);
        let writes = b.count(
            "viewer",
            "#page form#grant-form, #page button.primary, #page button.danger",
        );
        assert_eq!(writes, 0, "{hash}: a viewer is shown no write control");
    }
    b.page("viewer", "#/grants", "Grants");
    b.shows("viewer", "#grant-table .error", "role viewer may not list grants");

    // A forged write from the viewer's session, CSRF token and all: the
    // API refuses it (403) as it refuses the viewer's bearer token.
    let grant = json!({"name": "forged", "targets": [{"target": "lb/x", "port": 80}], "ttl_seconds": 3600});
    let forged = b.eval("viewer", FORGE, json!(["/v1/grants", grant, true]));
    assert_eq!(forged, json!([403, "forbidden"]), "a viewer's forged write");
    // The admin's session without its CSRF token: refused too.
    let no_csrf = b.eval("admin", FORGE, json!(["/v1/grants", grant, false]));
    assert_eq!(
        no_csrf,
        json!([403, "forbidden"]),
        "a write without the CSRF token"
    );

    // A cross-site form post, from another origin's page in the admin's
    // browser: the cookie is not sent (SameSite=Strict), nothing is made.
    let form = format!(
        r#"<!doctype html><form method="post" action="{}/v1/grants" enctype="text/plain">
<input name='{{"name":"csrf","targets":[{{"target":"lb/x","port":80}}],"ttl_seconds":3600,"x":"' value='"}}'>
<button id="go" type="submit">win a prize</button></form>"#,
        cp.url
    );
    b.ok(
        "admin",
        json!({"op": "route_html", "url": "https://attacker.invalid/", "html": form}),
    );
    b.ok("admin", json!({"op": "goto", "url": "https://attacker.invalid/"}));
    b.click("admin", "#go");
    b.shows("admin", "body", "error");
    let body = b.texts("admin", "body").join("\n");
    assert!(
        body.contains("\"unauthenticated\"") || body.contains("\"forbidden\""),
        "the cross-site post is refused: {body}"
    );
    let grants = c.cli_json(&["grant", "list"]).unwrap();
    assert_eq!(grants, json!([]), "no grant was made by any of it");

    // Back on the console the admin is still signed in; revoking the
    // viewer's token signs the viewer's browser out at once.
    b.goto("admin", &format!("{}/ui/#/overview", cp.url));
    b.shows("admin", "#page h1", "Overview");
    let vera_id = vera
        .strip_prefix("otx_")
        .and_then(|t| t.split('_').next())
        .unwrap();
    c.cli_ok(&["user", "token", "revoke", "vera", vera_id]).unwrap();
    b.shows("viewer", "#sign-in-error", "revoked");

    // Signing out ends the session: the old cookie opens nothing.
    b.click("admin", "#sign-out");
    b.shows("admin", "#sign-in-error", "signed out");
    let me = b.eval(
        "admin",
        "async () => (await fetch('/ui/api/me')).status",
        json!(null),
    );
    assert_eq!(me, 401, "signed out");
}

// ------------------------------------------------------------------ a cluster

/// Serves HTTP on 8080 while `$1/$OTHERIX_VM_NAME` exists (see lb_e2e).
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

/// `otherix connect VM PORT` with the config `config`, `line` on stdin:
/// what came back, or the error.
fn connect(config: &Path, vm: &str, port: u16, line: &[u8]) -> Result<Vec<u8>, String> {
    let mut child = Command::new(BIN)
        .args(["connect", vm, &port.to_string()])
        .env("OTHERIX_CONFIG", config)
        .env_remove("RUST_LOG")
        .env_remove("OTHERIX_GRANT")
        .env_remove("OTHERIX_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(line).unwrap();
    let out = child.wait_with_output().unwrap();
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
    }
}

/// Sends `n` bytes through `conn` and reads them back from the echo guest.
fn echo_round(conn: &mut TcpStream, n: usize) -> u64 {
    let data: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
    conn.write_all(&data).unwrap();
    let mut back = vec![0u8; n];
    conn.read_exact(&mut back).unwrap();
    assert_eq!(back, data);
    n as u64
}

#[test]
fn the_console_shows_the_cluster_live_ends_a_session_and_hands_out_a_grant_that_works_until_revoked() {
    let world = World::new("webui").expect("a testbed world (needs root)");
    let c = Cluster::start(world, ClusterSpec::new(BIN)).expect("cluster starts");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.193.0.0/24",
    ])
    .unwrap();
    let script = c.world_dir().join("serve.sh");
    std::fs::write(&script, SERVE_SH).unwrap();
    let switches = c.world_dir().join("on");
    std::fs::create_dir_all(&switches).unwrap();
    let exec = format!("sh {} {}", script.display(), switches.display());
    for (vm, node) in [("web01", "node1"), ("web02", "node2")] {
        std::fs::write(switches.join(vm), b"").unwrap();
        c.cli_ok(&[
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
            &exec,
        ])
        .unwrap();
    }
    c.cli_ok(&[
        "vm",
        "create",
        "echo01",
        "--network",
        "ov",
        "--node",
        "node1",
        "--label",
        "app=echo",
        "--exec",
        "otherix guest echo",
    ])
    .unwrap();
    for vm in ["web01", "web02", "echo01"] {
        c.wait_vm_running(vm, WAIT).unwrap();
    }
    c.cli_ok(&[
        "lb",
        "create",
        "web-lb",
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
    wait_until("web-lb healthy", WAIT, || {
        let lb = c.cli_json(&["lb", "get", "web-lb"]).ok()?;
        (lb["status"] == "healthy").then_some(())
    })
    .unwrap();
    // The echo guest answers through the gateway (it listens a moment after `running`).
    wait_until("echo01:7 to echo", WAIT, || {
        connect(&c.config, "echo01", 7, b"ping\n")
            .ok()
            .filter(|r| r == b"ping\n")
    })
    .unwrap();

    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    let mut b = Browser::start(&c.world);
    b.sign_in("admin", &c.url, token.trim());

    // Overview: the nodes, VMs and the LB at a glance.
    b.shows("admin", "#t-nodes-ready .n", "3");
    b.shows("admin", "#t-vms-running .n", "3");
    b.shows("admin", "#t-lbs-healthy .n", "1");

    // VMs: every one listed; a selector and a state filter on the server.
    b.page("admin", "#/vms", "VMs");
    b.shows("admin", "#vm-table tr[data-id=echo01]", "running");
    let names = |b: &mut Browser| b.texts("admin", "#vm-table tbody tr td:first-child");
    assert_eq!(names(&mut b), ["echo01", "web01", "web02"]);
    b.fill("admin", "#vm-selector", "app=web");
    b.click("admin", "#page form button");
    b.gone("admin", "#vm-table tr[data-id=echo01]", "echo01");
    assert_eq!(names(&mut b), ["web01", "web02"]);
    b.shot("admin", "vms");
    b.ok(
        "admin",
        json!({"op": "select", "selector": "#vm-state", "value": "failed"}),
    );
    b.click("admin", "#page form button");
    b.shows("admin", "#vm-table", "No VMs match.");
    b.ok(
        "admin",
        json!({"op": "select", "selector": "#vm-state", "value": ""}),
    );
    b.fill("admin", "#vm-selector", "");
    b.click("admin", "#page form button");
    b.click("admin", "#vm-table tr[data-id=web01]");
    b.shows("admin", "#page h1", "web01");
    b.shows("admin", "#page code.cmd", "otherix ssh web01");
    b.shows("admin", "#page code.cmd", "otherix forward web01");
    b.shot("admin", "vm-detail");

    // Load balancers: a backend whose guest stops serving turns unhealthy
    // on the open page, with the reason, and comes back — no reload.
    b.page("admin", "#/lbs", "Load balancers");
    b.shows("admin", "tr[data-id=web-lb]", "2/2 healthy");
    b.shot("admin", "lbs");
    b.click("admin", "tr[data-id=web-lb]");
    b.shows("admin", "tr[data-id=web02]", "healthy");
    let marker = b.eval(
        "admin",
        "() => { window.notReloaded = 1; return 1; }",
        json!(null),
    );
    assert_eq!(marker, 1);
    std::fs::remove_file(switches.join("web02")).unwrap();
    b.shows("admin", "tr[data-id=web02] .unhealthy", "unhealthy");
    b.shows("admin", "#page h1 .degraded", "degraded");
    b.shot("admin", "lb-detail");
    std::fs::write(switches.join("web02"), b"").unwrap();
    b.shows("admin", "tr[data-id=web02] .healthy", "healthy");
    b.shows("admin", "#page h1 .healthy", "healthy");
    assert_eq!(
        b.eval("admin", "() => window.notReloaded", json!(null)),
        1,
        "the page was updated, not reloaded"
    );

    // Sessions: one opened with `otherix forward` appears live and its
    // bytes grow without a reload; ending it on the page ends the client's
    // connection, and only it: another session to the same VM and port stays.
    b.page("admin", "#/sessions", "Sessions");
    b.shows("admin", "#session-table", "No open sessions.");
    b.eval("admin", "() => { window.sessionsNotReloaded = 1; }", json!(null));
    let (fwd, local) = c.forward_with("echo01", 7, &["--ready", "0"]).unwrap();
    let mut conn = TcpStream::connect(local).unwrap();
    conn.set_read_timeout(Some(WAIT)).unwrap();
    let mut sent = echo_round(&mut conn, 6);
    b.shows("admin", "#session-table tr", "echo01:7");
    b.shows("admin", "#session-table tr", "user:admin");
    let listed = |c: &Cluster| -> Vec<String> {
        c.cli_json(&["session", "list"])
            .unwrap()
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let ended_id = listed(&c).pop().expect("the session is listed");
    let row = |id: &str| format!("#session-table tr[data-id=\"{id}\"]");
    for _ in 0..2 {
        sent += echo_round(&mut conn, 4096);
        // As the gateway's next heartbeat reports it, pushed to the page.
        let counts = format!("{} .bytes-up[data-bytes=\"{sent}\"]", row(&ended_id));
        b.ok(
            "admin",
            json!({"op": "wait", "selector": counts, "timeout_ms": SHOW_MS}),
        );
        let counts = format!("{} .bytes-down[data-bytes=\"{sent}\"]", row(&ended_id));
        b.ok(
            "admin",
            json!({"op": "wait", "selector": counts, "timeout_ms": SHOW_MS}),
        );
    }
    let mut stays = TcpStream::connect(local).unwrap();
    stays.set_read_timeout(Some(WAIT)).unwrap();
    echo_round(&mut stays, 6);
    let stays_id = wait_until("the second session to be listed", WAIT, || {
        listed(&c).into_iter().find(|id| *id != ended_id)
    })
    .unwrap();
    b.ok(
        "admin",
        json!({"op": "wait", "selector": row(&stays_id), "timeout_ms": SHOW_MS}),
    );
    b.shot("admin", "sessions");
    b.click("admin", &format!("{} button.end-session", row(&ended_id)));
    b.ok(
        "admin",
        json!({"op": "wait_gone", "selector": row(&ended_id), "timeout_ms": SHOW_MS}),
    );
    let mut rest = Vec::new();
    let ended = conn.read_to_end(&mut rest);
    assert!(
        matches!(ended, Ok(0)) || ended.is_err(),
        "the client's connection ended: {ended:?} {rest:?}\n{}",
        fwd.log()
    );
    echo_round(&mut stays, 4096);
    b.ok(
        "admin",
        json!({"op": "wait", "selector": row(&stays_id), "timeout_ms": SHOW_MS}),
    );
    assert_eq!(
        b.eval("admin", "() => window.sessionsNotReloaded", json!(null)),
        1,
        "the sessions page was updated, not reloaded"
    );
    drop(stays);
    b.shows("admin", "#session-table", "No open sessions.");
    drop(fwd);

    // Audit: the session's start and end, and the revocation that ended it.
    b.page("admin", "#/audit", "Audit");
    b.shows("admin", "#audit-table", "session_end");
    b.shows("admin", "#audit-table", "session ended");
    b.shot("admin", "audit");

    // Grants: made on the page, its file downloaded, used by its holder at
    // the CLI; revoked on the page, refused.
    b.page("admin", "#/grants", "Grants");
    b.fill("admin", "#grant-name", "acme");
    b.fill("admin", "#grant-targets", "echo01:7");
    b.click("admin", "#grant-form button");
    b.shows("admin", "#grant-made h2", "Grant acme created");
    let holder = c.world_dir().join("holder");
    std::fs::create_dir_all(&holder).unwrap();
    let file = holder.join("acme.grant");
    b.ok(
        "admin",
        json!({"op": "download", "selector": "#grant-download", "path": file}),
    );
    b.shows("admin", "#grant-table tr[data-id=acme]", "active");
    b.shot("admin", "grants");
    let config = holder.join("config.toml");
    let login = Command::new(BIN)
        .args(["login", "--grant-file"])
        .arg(&file)
        .env("OTHERIX_CONFIG", &config)
        .env_remove("OTHERIX_TOKEN")
        .output()
        .unwrap();
    assert!(
        login.status.success(),
        "login --grant-file: {}",
        String::from_utf8_lossy(&login.stderr)
    );
    assert_eq!(connect(&config, "echo01", 7, b"as acme\n").unwrap(), b"as acme\n");
    // The holder signs in to the console with the file: its targets, nothing else.
    b.open("holder");
    b.goto("holder", &format!("{}/ui/", c.url));
    b.shows("holder", "#sign-in h1", "Sign in");
    b.ok(
        "holder",
        json!({"op": "set_files", "selector": "#grant-file", "path": file}),
    );
    b.click("holder", "#sign-in-form button");
    b.shows("holder", "#page h1", "Your access");
    b.shows("holder", "#page code.cmd", "otherix forward echo01 7");
    assert_eq!(b.texts("holder", "nav a"), ["Your access"]);
    b.click("admin", "#grant-table tr[data-id=acme] button.revoke-grant");
    b.shows("admin", "#grant-table tr[data-id=acme]", "revoked");
    let refused = connect(&config, "echo01", 7, b"again\n").unwrap_err();
    assert!(refused.contains("revoked"), "{refused}");
    b.shows("holder", "#sign-in-error", "revoked");

    // Nodes: roles, addresses, heartbeats and certificates; an admin
    // makes a join token.
    b.page("admin", "#/nodes", "Nodes");
    b.shows("admin", "#node-table tr[data-id=gw1]", "gateway");
    b.shows("admin", "#node-table tr[data-id=node1]", "Ready");
    let cert = b.texts("admin", "#node-table tr[data-id=node1] td:nth-child(7)");
    assert!(cert[0].starts_with("20"), "a certificate expiry: {cert:?}");
    b.fill("admin", "#join-node", "node9");
    b.click("admin", "#page form button.primary");
    b.shows("admin", "#join-made code.cmd", "--join-token otxj_");
    b.shot("admin", "nodes");

    // The overview's recent refusals: a user without an access rule asks.
    c.cli_ok(&["user", "create", "uma", "--role", "user"]).unwrap();
    let uma = c.cli_ok(&["user", "token", "create", "uma"]).unwrap();
    let refused = Command::new(BIN)
        .args(["connect", "echo01", "7"])
        .env("OTHERIX_CONFIG", &c.config)
        .env("OTHERIX_TOKEN", uma.trim())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!refused.status.success(), "uma has no rule for echo01");
    b.page("admin", "#/overview", "Overview");
    b.shows("admin", "#overview tr", "user:uma");
    b.shot("admin", "overview");
}
