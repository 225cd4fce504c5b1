//! The control plane on PostgreSQL (`otherix server --database`): a real
//! server process on a real PostgreSQL server the test starts for itself,
//! driven by the real CLI.

mod common;

use std::process::{Command, Stdio};

use common::{Cp, TempDir, BIN};
use otherix_testbed::postgres::Postgres;

fn database() -> (Postgres, String) {
    let pg = Postgres::start_temporary().expect("a PostgreSQL server");
    let url = pg.create_database("otherix").expect("a database");
    (pg, url)
}

fn names(list: &serde_json::Value) -> Vec<String> {
    let mut names: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

#[test]
fn a_control_plane_on_postgresql_keeps_everything_across_a_kill_9() {
    let (_pg, url) = database();
    let mut cp = Cp::start_with(TempDir::new("pg"), &["--database", &url]);
    assert!(
        cp.banner
            .iter()
            .any(|l| l.starts_with("database") && l.contains("postgres://")),
        "{:?}",
        cp.banner
    );
    assert!(
        !cp.data_dir().join("otherix.db").exists(),
        "the store is the database, not a file in the data directory"
    );
    let admin = cp.admin();
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.77.0.0/24",
    ]);
    for vm in ["web01", "web02", "db01"] {
        admin.ok(&["vm", "create", vm, "--network", "ov", "--label", "app=web"]);
    }
    admin.ok(&["vm", "delete", "web02"]);
    admin.ok(&["user", "create", "alice", "--role", "viewer"]);
    let before = admin.json(&["vm", "list"]);

    cp.kill9();
    cp.boot();
    let admin = cp.admin();
    let after = admin.json(&["vm", "list"]);
    assert_eq!(names(&after), ["db01", "web01"]);
    assert_eq!(after, before, "every VM as it was, with its address and MAC");
    // The freed address is the next one leased, as on SQLite.
    let freed = before
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["ip"].as_str().unwrap().to_string())
        .collect::<Vec<_>>();
    let web03 = admin.json(&["vm", "create", "web03", "--network", "ov"]);
    assert_eq!(web03["ip"], "10.77.0.3", "web02's address, freed: {freed:?}");
    let users = admin.json(&["user", "list"]);
    assert!(names(&users).contains(&"alice".to_string()), "{users}");
}

#[test]
fn control_planes_sharing_a_database_share_its_objects_and_one_with_another_ca_is_refused() {
    let (_pg, url) = database();
    let first = Cp::start_with(TempDir::new("pg-a"), &["--database", &url]);
    let admin = first.admin();
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.78.0.0/24",
    ]);

    // A second data directory makes a CA of its own: refused, saying why.
    let stranger = TempDir::new("pg-b");
    let out = Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(stranger.path().join("data"))
        .args(["--database", &url])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("needs the same CA") && err.contains("ca.crt and ca.key"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "one line: {err}");

    // With the first one's CA, it serves the same cluster.
    let dir = TempDir::new("pg-c");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    for f in ["ca.crt", "ca.key"] {
        std::fs::copy(first.data_dir().join(f), data.join(f)).unwrap();
    }
    let second = Cp::start_with(dir, &["--database", &url]);
    assert_eq!(second.fingerprint, first.fingerprint);
    assert!(
        !second.data_dir().join("admin.token").exists(),
        "the first admin exists already: no second token"
    );
    let via_second = second.cli("admin");
    via_second.ok(&[
        "login",
        "--server",
        &second.url,
        "--token-file",
        first.admin_token_file().to_str().unwrap(),
        "--ca-fingerprint",
        &second.fingerprint,
    ]);
    via_second.ok(&["vm", "create", "web01", "--network", "ov"]);
    admin.ok(&["vm", "create", "web02", "--network", "ov"]);
    // Each catalog follows the one change log: both list both, with
    // addresses leased once.
    for cli in [&admin, &via_second] {
        let list = common::wait_for(|| {
            let list = cli.json(&["vm", "list"]);
            (names(&list) == ["web01", "web02"]).then_some(list)
        });
        let mut ips: Vec<&str> = list
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["ip"].as_str().unwrap())
            .collect();
        ips.sort();
        assert_eq!(ips, ["10.78.0.2", "10.78.0.3"]);
    }
}

#[test]
fn a_database_address_that_is_not_postgresql_is_refused_in_one_line() {
    let dir = TempDir::new("pg-bad");
    let out = Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path().join("data"))
        .args(["--database", "mysql://root:hunter2@db/otherix"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("PostgreSQL URL") && err.contains("root:***@db"),
        "{err}"
    );
    assert!(!err.contains("hunter2"), "the password is never printed: {err}");
}
