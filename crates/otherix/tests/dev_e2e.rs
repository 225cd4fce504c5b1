//! `otherix dev --replicas 3` as a person runs it: the whole cluster with
//! three control-plane replicas on PostgreSQL comes up, the printed
//! commands work, the CLI goes on when the replica it used is killed as
//! the printout suggests, and Ctrl-C (SIGTERM here) leaves nothing behind.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use otherix_testbed::wait_until;

const BIN: &str = env!("CARGO_BIN_EXE_otherix");

fn cli(config: &std::path::Path, args: &[&str]) -> std::process::Output {
    Command::new(BIN)
        .args(args)
        .env("OTHERIX_CONFIG", config)
        .env_remove("OTHERIX_TOKEN")
        .env_remove("RUST_LOG")
        .output()
        .unwrap()
}

fn ok(config: &std::path::Path, args: &[&str]) -> String {
    let out = cli(config, args);
    assert!(
        out.status.success(),
        "otherix {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn dev_with_three_replicas_comes_up_fails_over_and_tears_down() {
    let dir = std::env::temp_dir().join(format!("otherix-dev-e2e-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    let mut dev = Command::new(BIN)
        .args(["dev", "--replicas", "3", "--state-dir"])
        .arg(dir.join("state"))
        .env("OTHERIX_CONFIG", &config)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The printout, up to "Press Ctrl-C".
    let mut printed = Vec::new();
    let mut lines = BufReader::new(dev.stdout.take().unwrap()).lines();
    let started = Instant::now();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let done = line.starts_with("Press Ctrl-C");
        printed.push(line);
        if done || started.elapsed() > Duration::from_secs(300) {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let text = printed.join("\n");
    assert!(
        text.contains("3 control-plane replicas on PostgreSQL"),
        "{text}\n{}",
        {
            let _ = dev.kill();
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(&mut dev.stderr.take().unwrap(), &mut err);
            err
        }
    );

    // The config names every replica; the demo works through them.
    let saved = std::fs::read_to_string(&config).unwrap();
    assert_eq!(saved.matches("https://").count(), 3, "{saved}");
    let nodes = ok(&config, &["node", "list", "-o", "json"]);
    let nodes: serde_json::Value = serde_json::from_str(&nodes).unwrap();
    assert_eq!(nodes.as_array().unwrap().len(), 3, "{nodes}");
    let echo = |input: &str| {
        let mut child = Command::new(BIN)
            .args(["connect", "lab01", "7"])
            .env("OTHERIX_CONFIG", &config)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), input.as_bytes()).unwrap();
        drop(child.stdin.take());
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(echo("hello\n"), "hello\n");

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
    let first = saved
        .split('"')
        .find(|s| s.starts_with("https://"))
        .unwrap()
        .to_string();
    assert_ne!(version["server"]["url"], first.as_str(), "{version}");
    assert_eq!(echo("after\n"), "after\n");
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
    assert!(Command::new("kill")
        .args(["-TERM", &dev.id().to_string()])
        .status()
        .unwrap()
        .success());
    let status = wait_until("otherix dev to exit", Duration::from_secs(120), || {
        dev.try_wait().unwrap()
    })
    .unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut dev.stderr.take().unwrap(), &mut err).unwrap();
    assert!(status.success(), "{err}");
    assert!(
        err.contains("no namespace, interface or process left behind"),
        "{err}"
    );
    let state = dir.join("state").join("postgres");
    let postmaster = std::fs::read_to_string(state.join("data").join("postmaster.pid")).ok();
    assert!(postmaster.is_none(), "PostgreSQL stopped: {postmaster:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
