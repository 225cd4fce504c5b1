//! The systemd units in `packaging/systemd` pass `systemd-analyze verify`, with
//! the binary just built in place of `/usr/bin/otherix` (verify checks that
//! ExecStart names an executable). Needs the `systemd` package.

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
