//! The web console's terminal in a real headless browser (see
//! `common::browser`) on a real QEMU guest's serial console: typed keys run
//! a command in the guest and its answer shows in xterm.js; the browser's
//! connection cut, the terminal resumes the same session (the shell's
//! variables still set); another site's page is refused the WebSocket (and
//! counted); signing out ends the session, audited as such. A test binary of its own: the QEMU guest
//! takes a while to boot, and the suite runs binaries side by side.
//!
//! Needs root, Chromium with Playwright (as `web_console_e2e`) and
//! `qemu-system-x86_64` (skipped with a message without it); the guest
//! image is built into the shared image cache on the host, as `qemu_e2e`
//! does, before the world starts.

mod common;

use std::process::Command;
use std::time::Duration;

use common::browser::Browser;
use common::qemu::{guest_image, qemu_installed};
use common::BIN;
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::{json, Value};

/// A TCG guest boots in seconds; the first test on a machine also waits for
/// the image build (apt-get download of about 30 MB).
const BOOT: Duration = Duration::from_secs(240);
const WAIT: Duration = Duration::from_secs(60);
/// Where the control plane serves its metrics, in its own namespace.
const CP_METRICS: u16 = 9468;
/// What the test types, and what only the guest's shell can answer.
const COMMAND: &str = "echo otx-$((6*7))\n";
const ANSWER: &str = "otx-42";

/// The value of the sample `series` (the exact text before the value).
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// The audit records of VM `vm`.
fn audit(c: &Cluster, vm: &str) -> Vec<Value> {
    c.cli_json(&["audit", "--target", vm])
        .unwrap()
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// The whole of the terminal's buffer, read through xterm.js's API.
const BUFFER: &str = r#"() => {
  const b = window.otxTerminal.buffer.active;
  const lines = [];
  for (let i = 0; i < b.length; i++) lines.push(b.getLine(i).translateToString(true));
  return lines.join("\n");
}"#;

/// Opens the terminal on the VM page shown and waits until it is connected.
fn open_terminal(b: &mut Browser) {
    b.shows("admin", "#term-card h2", "Serial console");
    b.click("admin", "#term-open");
    b.shows("admin", "#term-state", "connected");
}

/// Types [`COMMAND`] into the terminal until the guest's shell answers it
/// (keys typed while the guest still boots are lost; each try waits for
/// the answer before typing again).
fn run_command(b: &mut Browser) {
    wait_until("the guest's shell to answer in the terminal", BOOT, || {
        b.ok(
            "admin",
            json!({"op": "keys", "selector": "#terminal .xterm-helper-textarea", "text": COMMAND}),
        );
        b.call(json!({
            "op": "wait", "page": "admin", "selector": "#terminal .xterm-rows",
            "text": ANSWER, "timeout_ms": 15_000,
        }))
        .ok()
    })
    .unwrap();
}

/// Types `keys` into the terminal once and waits for `answer` to show.
fn type_and_wait(b: &mut Browser, keys: &str, answer: &str) {
    b.ok(
        "admin",
        json!({"op": "keys", "selector": "#terminal .xterm-helper-textarea", "text": keys}),
    );
    b.shows("admin", "#terminal .xterm-rows", answer);
}

#[test]
fn a_terminal_on_a_qemu_guests_console_runs_a_command_resumes_refuses_other_sites_and_ends_on_sign_out() {
    if !qemu_installed() {
        return;
    }
    guest_image();
    let world = World::new("webterm").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    (spec.hypervisors, spec.gateways) = (1, 0);
    spec.extra_server_args = vec!["--metrics-listen".into(), format!("0.0.0.0:{CP_METRICS}")];
    let c = Cluster::start(world, spec).expect("cluster starts");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.146.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "vm",
        "create",
        "qvm",
        "--runtime",
        "qemu",
        "--network",
        "ov",
        "--node",
        "node1",
    ])
    .unwrap();
    c.wait_vm_running("qvm", BOOT).unwrap();

    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    let mut b = Browser::start(&c.world);
    b.sign_in("admin", &c.url, token.trim());
    b.eval("admin", "() => { location.hash = '#/vms/qvm'; }", json!(null));
    b.shows("admin", "#page h1", "qvm");
    b.shows("admin", "#page code.cmd", "otherix console qvm");

    // The terminal: keys typed into xterm.js run in the guest, and its
    // answer comes back into xterm.js's buffer.
    open_terminal(&mut b);
    run_command(&mut b);
    let buffer = b.eval("admin", BUFFER, json!(null));
    assert!(
        buffer.as_str().is_some_and(|t| t.contains(ANSWER)),
        "the buffer: {buffer}"
    );
    b.shot("admin", "terminal");
    // xterm.js's own <style> elements applied under the page's policy (the
    // style nonce): the browser refused no inline style.
    let said = b.ok("admin", json!({"op": "messages"}));
    assert!(
        !said.to_string().contains("Content Security Policy"),
        "the page logged a CSP violation: {said}"
    );
    let styled = b.eval(
        "admin",
        "() => getComputedStyle(document.querySelector('#terminal .xterm-rows span') || document.querySelector('#terminal .xterm-rows')).color",
        json!(null),
    );
    assert_eq!(
        styled, "rgb(232, 232, 232)",
        "xterm.js's theme (app.js: foreground #e8e8e8) applied"
    );
    // Decided and audited as `otherix console`: a broker decision for port
    // 0 and a relay session of the admin's.
    let records = audit(&c, "qvm");
    assert!(
        records
            .iter()
            .any(|r| r["action"] == "broker" && r["port"] == 0 && r["allowed"] == true),
        "{records:?}"
    );
    assert!(
        records
            .iter()
            .any(|r| r["action"] == "session_start" && r["principal"] == "user:admin" && r["port"] == 0),
        "{records:?}"
    );

    // The browser's connection to the control plane cut (reset, as a
    // dropped network would leave it): the page resumes the session, and
    // the shell it talks to is the same one — what was set before the cut
    // is still set, and what is typed after runs there.
    type_and_wait(&mut b, "OTX_KEPT=kept-$((5*5)); echo set-$((2+3))\n", "set-5");
    let cp_port = c
        .url
        .rsplit(':')
        .next()
        .unwrap()
        .trim_end_matches('/')
        .to_string();
    let cut = [
        "ss",
        "-K",
        "dst",
        &c.cp_ns().ip().to_string(),
        "dport",
        "=",
        &cp_port,
    ];
    let said = c
        .world
        .exec_ok(&b.ns, &cut)
        .expect("ss -K in the browser's namespace");
    assert!(
        said.contains("ESTAB"),
        "the terminal's connection was cut: {said}"
    );
    b.shows("admin", "#term-state", "resumed");
    type_and_wait(&mut b, "echo \"$OTX_KEPT\"\n", "kept-25");
    wait_until("the resume in the audit trail", WAIT, || {
        audit(&c, "qvm")
            .iter()
            .any(|r| {
                r["action"] == "session_resume"
                    && r["reason"]
                        .as_str()
                        .is_some_and(|s| s.contains("connection-lost-1006"))
            })
            .then_some(())
    })
    .unwrap();

    // Another site's page in the same browser (the cookie goes along with a
    // WebSocket) is refused before the upgrade, and counted.
    let cp = std::net::SocketAddr::from((c.cp_ns().ip(), CP_METRICS));
    let series = r#"otherix_console_terminal_refused_total{reason="cross_site"}"#;
    let scrape = || {
        let (status, body) = otherix_testbed::http::get(cp, "/metrics").expect("/metrics answers");
        assert_eq!(status, 200);
        sample(&body, series)
    };
    let before = scrape();
    let attacker = format!(
        r#"<!doctype html><p id="out">opening</p><script>
const ws = new WebSocket("{}/ui/api/vms/qvm/console", ["otherix.console.v1"]);
ws.binaryType = "arraybuffer";
ws.onopen = () => {{ document.getElementById("out").textContent = "opened"; }};
ws.onclose = (e) => {{ document.getElementById("out").textContent = "refused " + e.code; }};
</script>"#,
        c.url.replacen("https://", "wss://", 1)
    );
    b.ok(
        "admin",
        json!({"op": "route_html", "url": "https://attacker.invalid/", "html": attacker}),
    );
    b.ok("admin", json!({"op": "goto", "url": "https://attacker.invalid/"}));
    b.shows("admin", "#out", "refused");
    assert_eq!(b.texts("admin", "#out"), ["refused 1006"], "never opened");
    wait_until("the cross-site refusal to be counted", WAIT, || {
        (scrape() > before).then_some(())
    })
    .unwrap();

    // Back on the console (still signed in), the terminal opens again;
    // signing out — here as from another tab, so that the page does not
    // close it itself — ends the session from the control plane's side,
    // which says why.
    b.goto("admin", &format!("{}/ui/#/vms/qvm", c.url));
    open_terminal(&mut b);
    run_command(&mut b);
    let out = b.eval(
        "admin",
        "async () => (await fetch('/ui/api/session', { method: 'DELETE', headers: { 'X-Otherix-CSRF': me.csrf } })).status",
        json!(null),
    );
    assert_eq!(out, 204, "signed out");
    wait_until("the terminal to say the session ended", WAIT, || {
        let state = b.eval(
            "admin",
            "() => document.getElementById('term-state').textContent",
            json!(null),
        );
        state
            .as_str()
            .is_some_and(|s| s.starts_with("ended:") && s.contains("signed out"))
            .then_some(())
    })
    .unwrap();
    let signed_out_ends = || {
        audit(&c, "qvm")
            .iter()
            .filter(|r| r["action"] == "session_end" && r["reason"] == "console signed out")
            .count()
    };
    wait_until("the session's end in the audit trail", WAIT, || {
        (signed_out_ends() == 1).then_some(())
    })
    .unwrap();

    // Signed out while the session waits for a resume — the browser's
    // network down, so that nothing of it reaches the control plane; the
    // sign-out comes from elsewhere — the session ends at once, not at the
    // end of its grace (60 s).
    b.sign_in("admin", &c.url, token.trim());
    b.goto("admin", &format!("{}/ui/#/vms/qvm", c.url));
    open_terminal(&mut b);
    run_command(&mut b);
    let csrf = b.eval("admin", "() => me.csrf", json!(null));
    let cookies = b.ok("admin", json!({"op": "cookies"}));
    let cookie = cookies
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == "__Host-otx_console")
        .and_then(|c| c["value"].as_str())
        .expect("the console's cookie")
        .to_string();
    // New connections refused, then the open ones cut.
    let block = format!(
        "add rule ip otx_cut out ip daddr {} tcp dport {cp_port} tcp flags & (syn|ack) == syn reject with tcp reset",
        c.cp_ns().ip()
    );
    for nft in [
        "add table ip otx_cut",
        "add chain ip otx_cut out { type filter hook output priority 0 ; }",
        &block,
    ] {
        c.world
            .exec_ok(&b.ns, &["nft", nft])
            .expect("nft in the browser's namespace");
    }
    c.world
        .exec_ok(&b.ns, &cut)
        .expect("ss -K in the browser's namespace");
    b.shows("admin", "#term-state", "connection lost, resuming (attempt");
    let status = Command::new("curl")
        .args(["-sk", "-o", "/dev/null", "-w", "%{http_code}", "-X", "DELETE"])
        .arg("-H")
        .arg(format!("Cookie: __Host-otx_console={cookie}"))
        .arg("-H")
        .arg(format!("X-Otherix-CSRF: {}", csrf.as_str().unwrap()))
        .arg("-H")
        .arg(format!("Origin: {}", c.url))
        .arg(format!("{}/ui/api/session", c.url))
        .output()
        .expect("curl runs");
    assert_eq!(String::from_utf8_lossy(&status.stdout), "204", "signed out");
    wait_until(
        "the waiting session's end, as signed out",
        Duration::from_secs(20),
        || (signed_out_ends() == 2).then_some(()),
    )
    .unwrap();
    // Connections go through again: the page's next resume is refused (a
    // page hears no reason for that), it asks the console whether it may
    // still open it and stops, saying it was signed out — rather than
    // trying again until the grace period is over.
    c.world
        .exec_ok(&b.ns, &["nft", "delete table ip otx_cut"])
        .expect("nft in the browser's namespace");
    b.shows("admin", "#sign-in-error", "signed out; sign in again");
}
