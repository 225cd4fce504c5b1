//! `otherix dev --replicas 3` as a person runs it: the whole cluster with
//! three control-plane replicas on PostgreSQL comes up, the printed
//! commands work, the CLI goes on when the replica it used is killed as
//! the printout suggests, and Ctrl-C (SIGTERM here) leaves nothing behind
//! but the user's client config as it was before. Its options: metrics,
//! logs kept, a killed daemon said and reaped, join tokens out of `ps`, and
//! a state directory it cannot use refused before anything starts.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
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

/// Only one `otherix dev` runs at a time (it takes a host-wide lock): the
/// tests that start one wait for each other on this file.
const SERIAL_LOCK: &str = "/run/otherix-dev-e2e.lock";

fn one_dev_at_a_time() -> std::fs::File {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(SERIAL_LOCK)
        .unwrap();
    file.lock().unwrap();
    file
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
    let _serial = one_dev_at_a_time();
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
    let state_dir = dir.join("state");
    let (mut dev, text, stderr) = start_dev(
        &config,
        &["--replicas", "3", "--state-dir", state_dir.to_str().unwrap()],
    );
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
    let err = stop_dev(&mut dev, &stderr);
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

/// `otherix dev ARGS` with `config`, its stdout read up to "Press Ctrl-C"
/// (at most 5 minutes), its stderr gathered as it comes.
fn start_dev(config: &Path, args: &[&str]) -> (Dev, String, Arc<Mutex<String>>) {
    let mut dev = Dev(Command::new(BIN)
        .arg("dev")
        .args(args)
        .env("OTHERIX_CONFIG", config)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap());
    let stderr = Arc::new(Mutex::new(String::new()));
    let (err_pipe, gathered) = (dev.0.stderr.take().unwrap(), stderr.clone());
    std::thread::spawn(move || {
        for line in BufReader::new(err_pipe).lines().map_while(Result::ok) {
            let mut all = gathered.lock().unwrap();
            all.push_str(&line);
            all.push('\n');
        }
    });
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
    (dev, printed.join("\n"), stderr)
}

/// SIGTERM, and what the teardown said once `otherix dev` exited.
fn stop_dev(dev: &mut Dev, stderr: &Mutex<String>) -> String {
    dev.terminate();
    let status = wait_until("otherix dev to exit", Duration::from_secs(120), || {
        dev.0.try_wait().unwrap()
    })
    .unwrap();
    // The reader thread ends at the pipe's end, just after the exit.
    let said = wait_until("otherix dev's last words", Duration::from_secs(10), || {
        let all = stderr.lock().unwrap().clone();
        all.contains("left behind").then_some(all)
    })
    .unwrap_or_else(|_| stderr.lock().unwrap().clone());
    assert!(status.success(), "{said}");
    said
}

/// Every live process carrying the world's marker (as the testbed's
/// teardown finds them): pid and command line, arguments joined by spaces.
fn world_processes(prefix: &str) -> Vec<(u32, String)> {
    let marker = format!("{}={prefix}", otherix_testbed::WORLD_ENV);
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().map_while(Result::ok) {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if !environ.split(|&b| b == 0).any(|v| v == marker.as_bytes()) {
            continue;
        }
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        found.push((pid, cmdline));
    }
    found
}

/// A process's state letter from `/proc/PID/status` (`Z` for a zombie);
/// `None` once it is gone.
fn proc_state(pid: u32) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .map(|s| s.trim().chars().next().unwrap_or('?').to_string())
}

#[test]
fn dev_serves_metrics_says_a_killed_replica_once_keeps_no_token_in_ps_and_keeps_its_logs() {
    let _serial = one_dev_at_a_time();
    let dir = std::env::temp_dir().join(format!("otherix-dev-e2e-opts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    let state = dir.join("state");
    let (mut dev, text, stderr) = start_dev(
        &config,
        &[
            "--replicas",
            "2",
            "--metrics",
            "--keep-logs",
            "--state-dir",
            state.to_str().unwrap(),
        ],
    );
    assert!(
        text.contains("2 control-plane replicas on PostgreSQL"),
        "otherix dev did not come up:\n{text}\n{}",
        stderr.lock().unwrap()
    );

    // --metrics: a URL per daemon, printed with the rest; each answers.
    let metrics: Vec<(String, String)> = text
        .lines()
        .skip_while(|l| !l.starts_with("Prometheus metrics"))
        .skip(1)
        .map_while(|l| {
            let mut words = l.split_whitespace();
            Some((words.next()?.to_string(), words.next()?.to_string()))
        })
        .collect();
    let names: Vec<&str> = metrics.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["cp", "cp2", "node1", "node2", "gw1"], "{text}");
    for (name, url) in &metrics {
        let (status, body) =
            otherix_testbed::http::get_url(url).unwrap_or_else(|| panic!("{name}: {url} does not answer"));
        assert_eq!(status, 200, "{name}: {url}: {body}");
        assert!(body.contains("# TYPE"), "{name}: {url} serves no metrics: {body}");
    }

    // The world's processes: none has a join token on its command line;
    // the agents read theirs from files only root reads.
    let logs_line = text
        .lines()
        .find_map(|l| l.strip_prefix("Logs: "))
        .unwrap_or_else(|| panic!("no Logs line:\n{text}"));
    let (world_dir, kept) = logs_line
        .split_once(" (kept in ")
        .unwrap_or_else(|| panic!("--keep-logs says where: {logs_line}"));
    let world_dir = PathBuf::from(world_dir);
    let kept = PathBuf::from(kept.trim_end_matches(" on teardown)"));
    let prefix = world_dir.file_name().unwrap().to_string_lossy().into_owned();
    let processes = world_processes(&prefix);
    let daemons = |role: &str| {
        processes
            .iter()
            .filter(|(_, c)| c.contains(&format!(" {role} ")))
            .count()
    };
    assert_eq!((daemons("server"), daemons("agent")), (2, 3), "{processes:#?}");
    let mut tokens = Vec::new();
    for node in ["node1", "node2", "gw1"] {
        use std::os::unix::fs::PermissionsExt;
        let file = world_dir.join(format!("{node}.join-token"));
        let token = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        assert!(token.starts_with("otxj_"), "{token}");
        assert_eq!(
            std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
            0o600
        );
        tokens.push(token.trim().to_string());
    }
    for (pid, cmdline) in &processes {
        assert!(
            !cmdline.contains("otxj_") && !tokens.iter().any(|t| cmdline.contains(t.as_str())),
            "pid {pid} shows a join token: {cmdline}"
        );
    }

    // A replica killed: said once on stderr, and reaped.
    let (cp2, _) = processes
        .iter()
        .find(|(_, c)| c.contains(" server ") && c.contains(&format!("{}/cp2 ", state.display())))
        .unwrap_or_else(|| panic!("no cp2 among {processes:#?}"));
    assert!(Command::new("kill")
        .args(["-9", &cp2.to_string()])
        .status()
        .unwrap()
        .success());
    let said = format!("dev: control plane cp2 (pid {cp2}) exited (killed by signal 9");
    wait_until("otherix dev to say cp2 exited", Duration::from_secs(30), || {
        stderr.lock().unwrap().contains(&said).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}: {}", stderr.lock().unwrap()));
    let state_now = proc_state(*cp2);
    assert!(state_now.as_deref() != Some("Z"), "cp2 is left a zombie");
    let version = ok(&config, &["version", "-o", "json"]);
    assert!(
        version.contains("\"server\""),
        "the other replica answers: {version}"
    );

    // Teardown: the logs kept where it said, without the data beside them.
    let said_all = stop_dev(&mut dev, &stderr);
    assert_eq!(said_all.matches(&said).count(), 1, "said once:\n{said_all}");
    assert!(
        said_all.contains(&format!("logs kept in {}", kept.display())),
        "{said_all}"
    );
    assert!(!world_dir.exists(), "the temporary directory went");
    for log in [
        "cp-otherix.log",
        "cp2-otherix.log",
        "node1-otherix.log",
        "gw1-otherix.log",
        "world.log",
    ] {
        let path = kept.join(log);
        assert!(
            path.is_file(),
            "{} kept: {:?}",
            path.display(),
            std::fs::read_dir(&kept)
                .map(|d| d.map_while(Result::ok).map(|e| e.file_name()).collect::<Vec<_>>())
        );
    }
    let cp2_log = std::fs::read_to_string(kept.join("cp2-otherix.log")).unwrap();
    assert!(cp2_log.contains("log in with"), "{cp2_log}");
    assert!(kept.join("postgres.log").is_file(), "PostgreSQL's log kept too");
    for entry in std::fs::read_dir(&kept).unwrap().map_while(Result::ok) {
        let name = entry.file_name().to_string_lossy().into_owned();
        assert!(
            entry.file_type().unwrap().is_file() && name.ends_with(".log"),
            "{name} is not a log"
        );
    }
    assert!(
        kept.starts_with(&state),
        "kept beside the state: {}",
        kept.display()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// What `otherix dev ARGS` says when it refuses at once: its stderr lines,
/// asserting it failed within a few seconds without starting anything.
fn refused(config: &Path, args: &[&str]) -> Vec<String> {
    let mut child = Command::new(BIN)
        .arg("dev")
        .args(args)
        .env("OTHERIX_CONFIG", config)
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let exited = wait_until("otherix dev to refuse", Duration::from_secs(10), || {
        child.try_wait().unwrap()
    });
    if exited.is_err() {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    exited.unwrap_or_else(|e| panic!("{e}; it went on: {stderr}"));
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        out.stdout.is_empty() && !stderr.contains("==>"),
        "nothing started: {stderr}"
    );
    stderr.lines().map(str::to_string).collect()
}

/// A read-only file system mounted for the test, unmounted on drop.
struct ReadOnlyMount(PathBuf);

impl ReadOnlyMount {
    fn new(at: &Path) -> ReadOnlyMount {
        std::fs::create_dir_all(at).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "ro,size=64k", "otherix-dev-e2e"])
            .arg(at)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mounting a read-only tmpfs at {}", at.display());
        ReadOnlyMount(at.to_path_buf())
    }
}

impl Drop for ReadOnlyMount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn dev_refuses_a_state_dir_it_cannot_use_before_starting_anything() {
    use std::os::unix::fs::PermissionsExt;
    let dir = std::env::temp_dir().join(format!("otherix-dev-e2e-refusals-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("config.toml");
    let one_error_one_hint = |lines: &[String]| {
        assert_eq!(lines.len(), 2, "{lines:#?}");
        assert!(lines[0].starts_with("error: --state-dir "), "{lines:#?}");
        assert!(lines[1].starts_with("hint: "), "{lines:#?}");
    };

    let file = dir.join("a-file");
    std::fs::write(&file, "").unwrap();
    let lines = refused(&config, &["--state-dir", file.to_str().unwrap()]);
    one_error_one_hint(&lines);
    assert!(lines[0].contains("is not a directory"), "{lines:#?}");

    let ro = dir.join("read-only");
    let mount = ReadOnlyMount::new(&ro);
    let lines = refused(&config, &["--state-dir", ro.to_str().unwrap()]);
    one_error_one_hint(&lines);
    assert!(lines[0].contains("is not writable"), "{lines:#?}");
    drop(mount);

    // PostgreSQL (with replicas) runs as `postgres`, kept out of a 0700
    // directory of root's.
    let private = dir.join("private");
    std::fs::create_dir_all(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
    let inside = private.join("state");
    let lines = refused(
        &config,
        &["--replicas", "2", "--state-dir", inside.to_str().unwrap()],
    );
    one_error_one_hint(&lines);
    assert!(
        lines[0].contains("`postgres`") && lines[0].contains(&format!("cannot enter {}", private.display())),
        "{lines:#?}"
    );
    assert!(
        lines[1].contains(&format!("chmod o+x {}", private.display())),
        "{lines:#?}"
    );
    assert!(!inside.exists(), "nothing made in a directory refused");
    let _ = std::fs::remove_dir_all(&dir);
}
