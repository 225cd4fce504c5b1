//! `otherix dev --replicas 3` as a person runs it: the whole cluster with
//! three control-plane replicas on PostgreSQL comes up, the printed
//! commands work, the CLI goes on when the replica it used is killed as
//! the printout suggests, and Ctrl-C (SIGTERM here) leaves nothing behind
//! but the user's client config as it was before.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use otherix_testbed::wait_until;

const BIN: &str = env!("CARGO_BIN_EXE_otherix");

fn cli(config: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("OTHERIX_CONFIG", config)
        .env_remove("OTHERIX_TOKEN")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn ok(config: &Path, args: &[&str]) -> String {
    let out = cli(config, args);
    assert!(
        out.status.success(),
        "otherix {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `otherix connect lab01 7` with `input` on stdin: what came back.
fn echo(config: &Path, input: &str) -> String {
    let mut child = Command::new(BIN)
        .args(["connect", "lab01", "7"])
        .env("OTHERIX_CONFIG", config)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.as_mut().unwrap().write_all(input.as_bytes()).unwrap();
    drop(child.stdin.take());
    let status = wait_until("otherix connect to exit", Duration::from_secs(30), || {
        child.try_wait().unwrap()
    });
    let Ok(status) = status else {
        let _ = child.kill();
        panic!("otherix connect hung");
    };
    let (mut out, mut err) = (String::new(), String::new());
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(status.success(), "{err}");
    out
}

/// `otherix dev`, stopped (SIGTERM, then SIGKILL) if the test ends early,
/// so a failed assertion leaves no cluster behind.
struct Dev(Child);

impl Dev {
    fn terminate(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
    }
}

impl Drop for Dev {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            self.terminate();
            let deadline = Instant::now() + Duration::from_secs(120);
            while Instant::now() < deadline && matches!(self.0.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(200));
            }
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn dev_with_three_replicas_comes_up_fails_over_and_tears_down() {
    let dir = std::env::temp_dir().join(format!("otherix-dev-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    // A context of the user's own, current before: current again after.
    std::fs::write(
        &config,
        "current_context = \"mine\"\n\n[contexts.mine]\nserver = \"https://mine.example:7443\"\nca_fingerprint = \"sha256:00\"\nca_pem = \"PEM\"\n",
    )
    .unwrap();
    let mut dev = Dev(Command::new(BIN)
        .args(["dev", "--replicas", "3", "--state-dir"])
        .arg(dir.join("state"))
        .env("OTHERIX_CONFIG", &config)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap());
    // The printout, up to "Press Ctrl-C" (read on a thread: a dev that
    // hangs must not hang the test).
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = dev.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut printed = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(300);
    while let Ok(line) = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        let done = line.starts_with("Press Ctrl-C");
        printed.push(line);
        if done {
            break;
        }
    }
    let text = printed.join("\n");
    assert!(
        text.contains("3 control-plane replicas on PostgreSQL"),
        "otherix dev did not come up:\n{text}"
    );

    // The `dev` context, current, names every replica; the demo works
    // through them.
    let contexts = ok(&config, &["context", "list", "-o", "json"]);
    let contexts: serde_json::Value = serde_json::from_str(&contexts).unwrap();
    let dev_context = contexts
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "dev")
        .unwrap_or_else(|| panic!("no dev context: {contexts}"));
    assert_eq!(dev_context["current"], true, "{contexts}");
    assert_eq!(dev_context["servers"].as_array().unwrap().len(), 3, "{contexts}");
    let nodes = ok(&config, &["node", "list", "-o", "json"]);
    let nodes: serde_json::Value = serde_json::from_str(&nodes).unwrap();
    assert_eq!(nodes.as_array().unwrap().len(), 3, "{nodes}");
    assert_eq!(echo(&config, "hello\n"), "hello\n");

    // The failover the printout suggests: kill -9 of the first replica.
    let pid = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("kill -9 "))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the printout names the first replica's pid")
        .to_string();
    assert!(Command::new("kill")
        .args(["-9", &pid])
        .status()
        .unwrap()
        .success());
    let version = ok(&config, &["version", "-o", "json"]);
    let version: serde_json::Value = serde_json::from_str(&version).unwrap();
    let first = dev_context["servers"][0].as_str().unwrap().to_string();
    assert_ne!(version["server"]["url"], first.as_str(), "{version}");
    assert_eq!(echo(&config, "after\n"), "after\n");
    wait_until(
        "every node Ready through the other replicas",
        Duration::from_secs(30),
        || {
            let nodes = cli(&config, &["node", "list", "-o", "json"]);
            let nodes: serde_json::Value = serde_json::from_slice(&nodes.stdout).ok()?;
            nodes
                .as_array()?
                .iter()
                .all(|n| n["status"] == "Ready")
                .then_some(())
        },
    )
    .unwrap();

    // Ctrl-C: everything goes, PostgreSQL too.
    dev.terminate();
    let status = wait_until("otherix dev to exit", Duration::from_secs(120), || {
        dev.0.try_wait().unwrap()
    })
    .unwrap();
    let mut err = String::new();
    dev.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(status.success(), "{err}");
    assert!(
        err.contains("no namespace, interface or process left behind"),
        "{err}"
    );
    assert!(err.contains("context \"mine\" is current again"), "{err}");
    let contexts = ok(&config, &["context", "list", "-o", "json"]);
    let contexts: serde_json::Value = serde_json::from_str(&contexts).unwrap();
    assert_eq!(
        contexts.as_array().unwrap().len(),
        1,
        "the dev context is gone: {contexts}"
    );
    assert_eq!(contexts[0]["name"], "mine");
    assert_eq!(contexts[0]["current"], true);
    let state = dir.join("state").join("postgres");
    let postmaster = std::fs::read_to_string(state.join("data").join("postmaster.pid")).ok();
    assert!(postmaster.is_none(), "PostgreSQL stopped: {postmaster:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
