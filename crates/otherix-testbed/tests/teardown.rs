//! Worlds leave nothing behind: not after a panic, not after their process was killed,
//! and their processes die with them. Runs as root.

use std::io::{BufRead, BufReader};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use otherix_testbed::{wait_until, Error, World, STATE_DIR};

const PATIENCE: Duration = Duration::from_secs(20);

/// Whether `pid` is a live process (zombies are dead).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        !matches!(
            stat.rsplit(')').next().unwrap_or("").split_whitespace().next(),
            Some("Z" | "X")
        )
    })
}

fn netns_pids(name: &str) -> Vec<u32> {
    let out = Command::new("ip").args(["netns", "pids", name]).output().unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

fn record_path(prefix: &str) -> PathBuf {
    Path::new(STATE_DIR).join(format!("{prefix}.world"))
}

#[test]
fn a_world_dropped_during_a_panic_leaves_no_namespace_link_or_process() {
    let mut made = None;
    let mut pids = Vec::new();
    let result = panic::catch_unwind(AssertUnwindSafe(|| {
        let world = World::new("panicking test").unwrap();
        made = Some((world.prefix().to_owned(), world.dir().to_owned()));
        let node = world.add_namespace("node").unwrap();

        // An "agent": makes a guest namespace, as agents do, and leaves a process in it
        // that does not carry the world's environment marker.
        let guest = format!("{}1", world.guest_netns_prefix());
        let script = format!(
            "set -e; ip netns add {guest}; ip netns exec {guest} env -i sleep 1000 & echo started; wait"
        );
        let agent = world.spawn(Some(&node), "sh", ["-c", &script], &[]).unwrap();
        agent.wait_for_log("started", PATIENCE).unwrap();
        let in_guest = wait_until("a process in the guest namespace", PATIENCE, || {
            let found = netns_pids(&guest);
            (!found.is_empty()).then_some(found)
        })
        .unwrap();
        let on_host = world.spawn(None, "sleep", ["1000"], &[]).unwrap();
        pids.extend(in_guest);
        pids.extend([agent.pid(), on_host.pid()]);

        let before = World::leftovers(world.prefix());
        assert!(
            before.iter().any(|l| l == &format!("netns {guest}")),
            "{before:?}"
        );
        assert!(
            before.iter().any(|l| l == &format!("link {}", world.host_link())),
            "{before:?}"
        );
        panic!("deliberate panic with a live world");
    }));

    assert!(result.is_err());
    let (prefix, dir) = made.unwrap();
    let kept_logs = dir.exists();
    // Remove the kept logs before asserting, so a failure leaves nothing either.
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(World::leftovers(&prefix), Vec::<String>::new());
    assert!(!record_path(&prefix).exists());
    let survivors: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert_eq!(survivors, Vec::<u32>::new(), "processes of the world survived it");
    assert!(kept_logs, "the world's logs are kept after a panic");
}

const HELPER_ENV: &str = "OTHERIX_TESTBED_STALE_HELPER";

/// Kills the helper process if the test fails before it does.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_stale_world_whose_owner_died_is_cleaned_by_the_next_world() {
    // A child process (this test binary, running the helper below) makes a world and is
    // then killed, as a test run killed by a timeout would be.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "stale_world_helper",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_ENV, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut child = KillOnDrop(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest prints `test stale_world_helper ... ` before the helper's own output.
            if let Some((_, prefix)) = line.split_once("stale world ready: ") {
                let _ = tx.send(prefix.trim().to_owned());
            }
        }
    });
    let prefix = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the helper reports its world");

    let before = World::leftovers(&prefix);
    assert!(
        before.iter().any(|l| l == &format!("netns {prefix}-node")),
        "{before:?}"
    );
    assert!(before.iter().any(|l| l.starts_with("process ")), "{before:?}");
    assert!(record_path(&prefix).exists());

    child.0.kill().unwrap();
    child.0.wait().unwrap();
    // The world outlives its owner...
    assert!(!World::leftovers(&prefix).is_empty() || !record_path(&prefix).exists());

    // ...until the next world is made (by this test, or by a test running in parallel).
    let _next = World::new("after a stale world").unwrap();
    assert_eq!(World::leftovers(&prefix), Vec::<String>::new());
    assert!(!record_path(&prefix).exists());
}

#[test]
#[ignore = "helper: run in a child process by a_stale_world_whose_owner_died_is_cleaned_by_the_next_world"]
fn stale_world_helper() {
    if std::env::var_os(HELPER_ENV).is_none() {
        return;
    }
    let world = World::new("stale world helper").unwrap();
    let node = world.add_namespace("node").unwrap();
    let _in_node = world.spawn(Some(&node), "sleep", ["1000"], &[]).unwrap();
    let _on_host = world.spawn(None, "sleep", ["1000"], &[]).unwrap();
    println!("stale world ready: {}", world.prefix());
    // Wait to be killed; never outlive the parent test for long.
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn terminate_sends_sigterm_and_returns_the_exit_status() {
    let world = World::new("terminate").unwrap();
    let node = world.add_namespace("node").unwrap();
    let script = "trap 'echo got TERM; exit 3' TERM; echo ready; while :; do sleep 0.1; done";
    let proc = world.spawn(Some(&node), "sh", ["-c", script], &[]).unwrap();
    proc.wait_for_log("ready", PATIENCE).unwrap();
    assert!(proc.is_running());

    let status = proc.terminate(PATIENCE).unwrap();
    assert_eq!(status.code(), Some(3));
    assert!(!proc.is_running());
    assert!(proc.log().contains("got TERM"), "{}", proc.log());
}

#[test]
fn waiting_for_a_log_line_fails_early_when_the_process_exits() {
    let world = World::new("early exit").unwrap();
    let proc = world
        .spawn(None, "sh", ["-c", "echo giving up; exit 7"], &[])
        .unwrap();
    let started = Instant::now();
    let err = proc
        .wait_for_log("never printed", Duration::from_secs(600))
        .unwrap_err();
    assert!(
        started.elapsed() < Duration::from_secs(300),
        "it did not wait for the timeout"
    );
    match err {
        Error::Exited { status, log_tail, .. } => {
            assert_eq!(status.code(), Some(7));
            assert!(log_tail.contains("giving up"), "{log_tail}");
        }
        other => panic!("expected Exited, got {other}"),
    }
}

#[test]
fn dropping_a_proc_kills_its_whole_process_group() {
    let world = World::new("proc drop").unwrap();
    let node = world.add_namespace("node").unwrap();
    let proc = world
        .spawn(
            Some(&node),
            "sh",
            ["-c", "sleep 1000 & sleep 1000 & echo forked; wait"],
            &[],
        )
        .unwrap();
    proc.wait_for_log("forked", PATIENCE).unwrap();
    let members = wait_until("the shell and its two children", PATIENCE, || {
        let found = netns_pids(node.name());
        (found.len() == 3).then_some(found)
    })
    .unwrap();

    drop(proc);
    assert_eq!(
        members.iter().copied().filter(|&p| alive(p)).collect::<Vec<_>>(),
        Vec::<u32>::new()
    );
}
