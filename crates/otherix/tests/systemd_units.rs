//! The systemd units in `packaging/systemd` pass `systemd-analyze verify`, with
//! the binary just built in place of `/usr/bin/otherix` (verify checks that
//! ExecStart names an executable), and the server unit's system call filter
//! admits what the control plane calls. Needs the `systemd` package.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_otherix");
const UNITS: &[&str] = &["otherix-server.service", "otherix-agent.service"];

fn units_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/systemd")
}

fn systemd_analyze() -> &'static str {
    let found = Command::new("systemd-analyze").arg("--version").output();
    assert!(
        found.is_ok_and(|o| o.status.success()),
        "systemd-analyze is missing: install the Debian package `systemd` (apt-get install systemd)"
    );
    "systemd-analyze"
}

#[test]
fn units_pass_systemd_analyze_verify() {
    let tool = systemd_analyze();
    let dir = std::env::temp_dir().join(format!("otherix-units-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut copies = Vec::new();
    for unit in UNITS {
        let text = std::fs::read_to_string(units_dir().join(unit)).unwrap();
        assert!(
            text.contains("ExecStart=/usr/bin/otherix "),
            "{unit}: ExecStart moved"
        );
        let copy = dir.join(unit);
        std::fs::write(&copy, text.replace("/usr/bin/otherix", BIN)).unwrap();
        copies.push(copy);
    }
    let out = Command::new(tool).arg("verify").args(&copies).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // An unknown key or a bad value is only a warning (exit 0): refuse those too.
    let about_ours: Vec<&str> = stderr.lines().filter(|l| l.contains("otherix")).collect();
    assert!(
        out.status.success() && about_ours.is_empty(),
        "systemd-analyze verify: {}\n{stderr}",
        out.status
    );
}

#[test]
fn agent_unit_keeps_guests_and_the_hosts_mount_namespace() {
    let text = std::fs::read_to_string(units_dir().join("otherix-agent.service")).unwrap();
    let settings: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && l.contains('='))
        .collect();
    assert!(
        settings.contains(&"KillMode=process"),
        "guests must survive an agent restart"
    );
    // Each of these gives the agent a mount namespace of its own: its guest
    // namespaces under /run/netns would not be seen by the host.
    for option in [
        "ProtectSystem",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "PrivateMounts",
        "PrivateNetwork",
        "ReadWritePaths",
        "ReadOnlyPaths",
        "InaccessiblePaths",
        "TemporaryFileSystem",
        "BindPaths",
        "ProtectKernelTunables",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectControlGroups",
        "ProtectProc",
        "ProcSubset",
        "MountFlags",
    ] {
        assert!(
            !settings.iter().any(|s| s.starts_with(&format!("{option}="))),
            "{option} would put the agent in a private mount namespace"
        );
    }
}

#[test]
fn sysusers_file_creates_the_servers_user() {
    systemd_analyze(); // the same package, `systemd`, provides systemd-sysusers
    let root = std::env::temp_dir().join(format!("otherix-sysusers-{}", std::process::id()));
    std::fs::create_dir_all(root.join("etc")).unwrap();
    let file = units_dir().join("otherix.sysusers");
    let out = Command::new("systemd-sysusers")
        .arg("--dry-run")
        .arg(format!("--root={}", root.display()))
        .arg(&file)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&root);
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !text.contains("otherix.sysusers"),
        "{text}"
    );
    assert!(text.contains("Creating user 'otherix'"), "{text}");
}

/// The server unit's `SystemCallFilter=` lines, in order.
fn server_filter_lines() -> Vec<String> {
    let text = std::fs::read_to_string(units_dir().join("otherix-server.service")).unwrap();
    text.lines()
        .filter_map(|l| l.strip_prefix("SystemCallFilter="))
        .map(str::to_string)
        .collect()
}

/// The system calls of a filter set (`@name`), its nested sets expanded, as
/// this machine's systemd defines them.
fn expand(set: &str, cache: &mut BTreeMap<String, BTreeSet<String>>) -> BTreeSet<String> {
    if !set.starts_with('@') {
        return BTreeSet::from([set.to_string()]);
    }
    if let Some(done) = cache.get(set) {
        return done.clone();
    }
    let out = Command::new(systemd_analyze())
        .args(["syscall-filter", set])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "systemd-analyze syscall-filter {set}: {out:?}"
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let mut calls = BTreeSet::new();
    // The first line names the set; then one entry a line, `#` comments.
    for entry in text.lines().skip(1).map(str::trim) {
        if entry.is_empty() || entry.starts_with('#') {
            continue;
        }
        calls.extend(expand(entry, cache));
    }
    cache.insert(set.to_string(), calls.clone());
    calls
}

/// What systemd does with the lines: the first, not inverted, makes an
/// allow-list; each later line adds its calls, or with `~` takes them away.
fn allowed_calls(lines: &[String]) -> BTreeSet<String> {
    let mut cache = BTreeMap::new();
    let mut allowed = BTreeSet::new();
    for (i, line) in lines.iter().enumerate() {
        let (deny, entries) = match line.strip_prefix('~') {
            Some(rest) => (true, rest),
            None => (false, line.as_str()),
        };
        assert!(!(i == 0 && deny), "the server's filter is an allow-list: {line}");
        for entry in entries.split_whitespace() {
            let calls = expand(entry, &mut cache);
            if deny {
                allowed.retain(|c| !calls.contains(c));
            } else {
                allowed.extend(calls);
            }
        }
    }
    allowed
}

/// The control plane lowers its TLS handshake threads' priority
/// (`otherix-tls::handshakes`: `setpriority`, and `getpriority` in its
/// checks); `~@resources` took `setpriority` away, and with it the nice
/// value where the product ships.
#[test]
fn server_unit_admits_the_calls_that_lower_the_handshake_threads_priority() {
    let lines = server_filter_lines();
    let allowed = allowed_calls(&lines);
    for call in ["setpriority", "getpriority"] {
        assert!(
            allowed.contains(call),
            "SystemCallFilter {lines:?} refuses {call}"
        );
    }
    // The rest of @resources stays out.
    for call in ["sched_setscheduler", "sched_setaffinity", "ioprio_set"] {
        assert!(
            !allowed.contains(call),
            "SystemCallFilter {lines:?} admits {call}"
        );
    }
}

/// The same, for real: `nice` run under the server unit's sandbox by the
/// service manager. Only where systemd is the init system.
#[test]
fn setpriority_succeeds_under_the_server_units_sandbox() {
    if !Path::new("/run/systemd/system").exists() {
        eprintln!(
            "SKIPPED: systemd is not running as PID 1 here (no /run/systemd/system), so no \
             transient unit can run; server_unit_admits_the_calls_that_lower_the_handshake_threads_priority \
             checks the filter statically"
        );
        return;
    }
    let text = std::fs::read_to_string(units_dir().join("otherix-server.service")).unwrap();
    // The sandbox's properties as the unit sets them (the user is left out:
    // it exists only once the package is installed).
    let sandbox = [
        "NoNewPrivileges",
        "CapabilityBoundingSet",
        "RestrictNamespaces",
        "RestrictRealtime",
        "LockPersonality",
        "MemoryDenyWriteExecute",
        "SystemCallArchitectures",
        "SystemCallFilter",
        "SystemCallErrorNumber",
    ];
    let mut cmd = Command::new("systemd-run");
    cmd.args(["--wait", "--pipe", "--quiet", "--collect"]);
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        if let Some((key, _)) = line.split_once('=') {
            if sandbox.contains(&key) {
                cmd.arg("-p").arg(line);
            }
        }
    }
    // The inner `nice` prints the niceness it got: 10 only if the outer
    // one's setpriority was allowed (a refused one is only a warning).
    let out = cmd
        .args(["/usr/bin/nice", "-n", "10", "/usr/bin/nice"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.trim() == "10",
        "nice under the server unit's sandbox: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
