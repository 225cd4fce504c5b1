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

/// `otherix server` with `args` that must refuse to start: its one error line.
fn refused(args: &[&str], data: &std::path::Path) -> String {
    let out = Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "one error line: {err}");
    assert!(
        err.lines()
            .all(|l| l.starts_with("error") || l.contains(" WARN ")),
        "{err}"
    );
    errors[0].to_string()
}

#[test]
fn replicas_sharing_a_database_share_its_objects_and_its_ca_sealed_with_one_secret_key() {
    let (pg, url) = database();
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
    // The CA's key is in the database, sealed: not in the data directory,
    // not readable in the database. The certificate is in both.
    let key_file = first.data_dir().join("secret.key");
    assert!(key_file.exists(), "the first replica made the secret key");
    assert!(first.data_dir().join("ca.crt").exists());
    assert!(!first.data_dir().join("ca.key").exists(), "no CA key in a file");
    let stored = pg
        .query(
            "otherix",
            "SELECT name, public, encode(sealed, 'escape') FROM secrets",
        )
        .unwrap();
    assert!(stored.starts_with("ca|-----BEGIN CERTIFICATE-----"), "{stored}");
    assert!(!stored.contains("PRIVATE KEY"), "{stored}");
    let seeds = pg
        .query("otherix", "SELECT length(seed) FROM session_keys")
        .unwrap();
    assert!(
        seeds.lines().all(|l| l.trim() != "32"),
        "seeds are sealed, not the bare 32 bytes: {seeds}"
    );

    // A replica without the key is refused, naming the file to copy; one
    // with another key too. Neither changes anything.
    let stranger = TempDir::new("pg-b");
    let err = refused(&["--database", &url], &stranger.path().join("data"));
    assert!(err.contains("copy the secret key file"), "{err}");
    let wrong = stranger.path().join("wrong.key");
    std::fs::write(&wrong, format!("{}\n", "ab".repeat(32))).unwrap();
    let err = refused(
        &["--database", &url, "--secret-key-file", wrong.to_str().unwrap()],
        &stranger.path().join("data"),
    );
    assert!(
        err.contains("does not open this cluster's secrets") && err.contains("same secret key file"),
        "{err}"
    );
    assert!(!err.contains(&"ab".repeat(32)), "the key is never printed: {err}");

    // With a copy of the first one's key, it serves the same cluster.
    let dir = TempDir::new("pg-c");
    let copy = dir.path().join("secret.key");
    std::fs::copy(&key_file, &copy).unwrap();
    let second = Cp::start_with(
        dir,
        &["--database", &url, "--secret-key-file", copy.to_str().unwrap()],
    );
    assert_eq!(second.fingerprint, first.fingerprint);
    assert!(
        !second.data_dir().join("admin.token").exists(),
        "the first admin exists already: no second token"
    );
    assert_eq!(
        std::fs::read(second.data_dir().join("ca.crt")).unwrap(),
        std::fs::read(first.data_dir().join("ca.crt")).unwrap()
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
    // Both sign with the one session key, made once.
    let keys = pg.query("otherix", "SELECT count(*) FROM session_keys").unwrap();
    assert_eq!(keys.trim(), "1", "{keys}");
    // Each is a registered replica.
    let replicas = pg.query("otherix", "SELECT count(*) FROM replicas").unwrap();
    assert_eq!(replicas.trim(), "2", "{replicas}");
}

#[test]
fn a_cluster_that_kept_its_ca_in_files_moves_it_into_the_database() {
    let (pg, url) = database();
    // The CA an earlier version made (or a SQLite control plane's).
    let dir = TempDir::new("pg-files");
    let data = dir.path().join("data");
    let sqlite = Cp::start_embedded(TempDir::new("pg-files-origin"), &[]);
    std::fs::create_dir_all(&data).unwrap();
    for f in ["ca.crt", "ca.key"] {
        std::fs::copy(sqlite.data_dir().join(f), data.join(f)).unwrap();
    }
    let cp = Cp::start_with(dir, &["--database", &url]);
    assert_eq!(cp.fingerprint, sqlite.fingerprint, "the same CA, not a new one");
    // A replica that brings another CA in its files is refused.
    let other = TempDir::new("pg-files-other");
    let other_data = other.path().join("data");
    let stranger = Cp::start_embedded(TempDir::new("pg-files-stranger"), &[]);
    std::fs::create_dir_all(&other_data).unwrap();
    for f in ["ca.crt", "ca.key"] {
        std::fs::copy(stranger.data_dir().join(f), other_data.join(f)).unwrap();
    }
    std::fs::copy(cp.data_dir().join("secret.key"), other_data.join("secret.key")).unwrap();
    let err = refused(&["--database", &url], &other_data);
    assert!(
        err.contains("holds a CA") && err.contains("remove ca.crt and ca.key"),
        "{err}"
    );

    // Before the move (as if the cluster still kept it in files): a replica
    // without the files never makes a CA of its own, and says which to start.
    pg.query("otherix", "DELETE FROM secrets").unwrap();
    let fresh = TempDir::new("pg-files-fresh");
    let fresh_data = fresh.path().join("data");
    std::fs::create_dir_all(&fresh_data).unwrap();
    std::fs::copy(cp.data_dir().join("secret.key"), fresh_data.join("secret.key")).unwrap();
    let err = refused(&["--database", &url], &fresh_data);
    assert!(err.contains("still kept in files"), "{err}");
    let stored = pg.query("otherix", "SELECT count(*) FROM secrets").unwrap();
    assert_eq!(stored.trim(), "0", "nothing stored by the refused one");
    // The one holding the files moves it, and then the other starts.
    let mut cp = cp;
    cp.kill9();
    cp.boot();
    assert_eq!(cp.fingerprint, sqlite.fingerprint);
    let joined = Cp::start_with(fresh, &["--database", &url]);
    assert_eq!(joined.fingerprint, sqlite.fingerprint);
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

#[test]
fn replicas_started_together_with_one_key_agree_on_one_cluster() {
    let (pg, url) = database();
    // The operator's key, made once (`openssl rand -hex 32`) and copied to each.
    let keys = TempDir::new("pg-together-key");
    let key = keys.path().join("secret.key");
    let hex: String = (0..32).map(|i| format!("{:02x}", (i * 37 + 11) % 256)).collect();
    std::fs::write(&key, format!("{hex}\n")).unwrap();
    let replicas: Vec<Cp> = std::thread::scope(|s| {
        let started: Vec<_> = (0..3)
            .map(|i| {
                let (url, key) = (url.clone(), key.clone());
                s.spawn(move || {
                    Cp::start_with(
                        TempDir::new(&format!("pg-together-{i}")),
                        &["--database", &url, "--secret-key-file", key.to_str().unwrap()],
                    )
                })
            })
            .collect();
        started.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert!(
        replicas.iter().all(|r| r.fingerprint == replicas[0].fingerprint),
        "one CA"
    );
    let tokens = replicas.iter().filter(|r| r.admin_token_file().exists()).count();
    assert_eq!(tokens, 1, "one first admin, one token");
    let keys = pg.query("otherix", "SELECT count(*) FROM session_keys").unwrap();
    assert_eq!(keys.trim(), "1", "one session key: {keys}");
    let secrets = pg.query("otherix", "SELECT count(*) FROM secrets").unwrap();
    assert_eq!(secrets.trim(), "1");
}

#[test]
fn a_node_heartbeating_to_one_replica_is_ready_on_every_one() {
    use common::fake_node::{beat, enroll_raw, join_token_for};
    let (_pg, url) = database();
    let a = Cp::start_with(
        TempDir::new("pg-live-a"),
        &["--database", &url, "--node-timeout", "6s"],
    );
    let dir = TempDir::new("pg-live-b");
    let key = dir.path().join("secret.key");
    std::fs::copy(a.data_dir().join("secret.key"), &key).unwrap();
    let b = Cp::start_with(
        dir,
        &[
            "--database",
            &url,
            "--secret-key-file",
            key.to_str().unwrap(),
            "--node-timeout",
            "6s",
        ],
    );
    // What one replica made is known to the other at once: a user's
    // token, a node's certificate (the first heartbeat comes right after
    // the enrollment, through the other).
    let admin_a = a.admin();
    admin_a.ok(&["user", "create", "vera", "--role", "viewer"]);
    for _ in 0..5 {
        let token = admin_a
            .ok(&["user", "token", "create", "vera"])
            .trim()
            .to_string();
        let vera_on_b = otherix_client::Client::new(&b.url, &b.ca_pem(), Some(token)).unwrap();
        let me = common::fake_node::rt().block_on(vera_on_b.whoami()).unwrap();
        assert_eq!(me.name, "vera");
    }
    let vtep = "10.213.9.21";
    let token = join_token_for(&a, "n1", "10m", &["--hypervisor", "--vtep", vtep]);
    let n1 = enroll_raw(&a, &token, "n1").unwrap();
    // n1 heartbeats to b alone, every half second (on a thread of its own,
    // whatever the CLI costs), for twice a's node timeout.
    let to_b = otherix_client::Client::with_identity(&b.url, &b.ca_pem(), &n1.cert_pem, &n1.key_pem).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let beating = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                beat(&to_b, "n1", vtep, true, None).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
        })
    };
    let status_on_a = || {
        let nodes = admin_a.json(&["node", "list"]);
        nodes.as_array().unwrap()[0]["status"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(13);
    let mut seen = Vec::new();
    while std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(500));
        seen.push(status_on_a());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    beating.join().unwrap();
    // (The first answer may come before a has heard of any heartbeat.)
    assert!(
        seen.iter().skip(2).all(|s| s == "Ready"),
        "a sees the node b answers as: {seen:?}"
    );
}

#[test]
fn verdicts_reported_to_one_replica_stand_on_another_only_while_vouched_for() {
    use common::fake_node::{enroll_raw, join_token_for, rt};
    use otherix_proto::agent::{HealthReport, Heartbeat, NodeRoles};
    let (_pg, url) = database();
    let a = Cp::start_with(TempDir::new("pg-vouch-a"), &["--database", &url]);
    let dir = TempDir::new("pg-vouch-b");
    let key = dir.path().join("secret.key");
    std::fs::copy(a.data_dir().join("secret.key"), &key).unwrap();
    let b = Cp::start_with(
        dir,
        &["--database", &url, "--secret-key-file", key.to_str().unwrap()],
    );
    let admin = a.admin();
    // n1 and n2 enroll through a and heartbeat to b alone.
    let nodes: Vec<(&str, &str, otherix_client::Client)> = [("n1", "10.213.9.31"), ("n2", "10.213.9.32")]
        .into_iter()
        .map(|(name, vtep)| {
            let token = join_token_for(&a, name, "10m", &["--hypervisor", "--vtep", vtep]);
            let id = enroll_raw(&a, &token, name).unwrap();
            let to_b = otherix_client::Client::with_identity(&b.url, &b.ca_pem(), &id.cert_pem, &id.key_pem)
                .unwrap();
            (name, vtep, to_b)
        })
        .collect();
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.84.0.0/24",
    ]);
    for (vm, node) in [("web01", "n1"), ("web02", "n2")] {
        admin.ok(&[
            "vm",
            "create",
            vm,
            "--network",
            "ov",
            "--node",
            node,
            "-l",
            "app=web",
        ]);
    }
    admin.ok(&["lb", "create", "web-lb", "--port", "80", "--selector", "app=web"]);
    let id = |vm: &str| admin.json(&["vm", "get", vm])["id"].as_str().unwrap().to_string();
    let (web01, web02) = (id("web01"), id("web02"));
    let beat = |i: usize, health: Vec<HealthReport>, changes_only: bool| {
        let (name, vtep, client) = &nodes[i];
        let vm = if i == 0 { &web01 } else { &web02 };
        rt().block_on(client.heartbeat(&Heartbeat {
            node: name.to_string(),
            roles: Some(NodeRoles {
                hypervisor: true,
                gateway: None,
                relay: None,
            }),
            vtep: vtep.to_string(),
            guests: otherix_testbed::fake_node::running(vec![vm.clone()]),
            health,
            health_changes_only: changes_only,
            ..common::fake_node::empty_heartbeat()
        }))
        .unwrap();
    };
    let unhealthy = |vm_id: &str| HealthReport {
        lb: "web-lb".into(),
        vm_id: vm_id.into(),
        health: otherix_proto::Health::parse("unhealthy").unwrap(),
        probed_at: time::OffsetDateTime::now_utc(),
        changed_at: Some(time::OffsetDateTime::now_utc()),
        reason: Some("connect: refused".into()),
        successes: 0,
        failures: 3,
    };
    beat(0, vec![unhealthy(&web01)], false);
    beat(1, vec![unhealthy(&web02)], false);
    let health_on_a = |vm: &str| -> String {
        let lb = admin.json(&["lb", "get", "web-lb"]);
        let b = lb["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["vm"] == vm)
            .unwrap()
            .clone();
        b["health"].as_str().unwrap().to_string()
    };
    common::wait_for(|| {
        (health_on_a("web01") == "unhealthy" && health_on_a("web02") == "unhealthy").then_some(())
    });
    // Past the staleness bound (15 s): n1 says "nothing changed" each time
    // (vouching), n2 sends whole sets that no longer hold its verdict.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(17);
    while std::time::Instant::now() < until {
        beat(0, vec![], true);
        beat(1, vec![], false);
        std::thread::sleep(std::time::Duration::from_secs(2));
    }
    assert_eq!(health_on_a("web01"), "unhealthy", "vouched for through b");
    assert_eq!(
        health_on_a("web02"),
        "unknown",
        "not reported for longer than the bound"
    );
}

/// A principal's broker rate holds across replicas: calls spread over two
/// replicas get about the configured rate, not twice it (each replica
/// charges what the other let through, exchanged through the database).
#[test]
fn a_principals_broker_rate_holds_across_replicas() {
    let (_pg, url) = database();
    let limits = ["--broker-rate", "10", "--broker-burst", "5"];
    let mut args = vec!["--database", url.as_str()];
    args.extend_from_slice(&limits);
    let first = Cp::start_with(TempDir::new("pg-rate-a"), &args);
    let dir = TempDir::new("pg-rate-b");
    let copy = dir.path().join("secret.key");
    std::fs::copy(first.data_dir().join("secret.key"), &copy).unwrap();
    let mut args = vec![
        "--database",
        url.as_str(),
        "--secret-key-file",
        copy.to_str().unwrap(),
    ];
    args.extend_from_slice(&limits);
    let second = Cp::start_with(dir, &args);
    let token = common::admin_token(&first);
    let call = |cp: &Cp| {
        common::curl(
            cp,
            &[
                "-X",
                "POST",
                "-H",
                &format!("Authorization: Bearer {token}"),
                "-H",
                "Content-Type: application/json",
                "-d",
                r#"{"target":"ghost","port":22}"#,
                &format!("{}/v1/broker", cp.url),
            ],
        )
        .0
    };
    let started = std::time::Instant::now();
    let window = std::time::Duration::from_secs(4);
    let (mut allowed, mut refused) = (0u32, 0u32);
    while started.elapsed() < window {
        for cp in [&first, &second] {
            match call(cp) {
                429 => refused += 1,
                404 => allowed += 1,
                other => panic!("broker answered {other}"),
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    // One replica's worth: 5 at once, then 10/s. Both buckets start full and
    // each learns of the other's calls within an exchange (250 ms): at most
    // another burst and a little more. Counted per replica, it would be
    // twice the rate (about 90 here).
    let one = 5.0 + 10.0 * secs;
    assert!(refused > 0, "{allowed} allowed, none refused");
    assert!(
        f64::from(allowed) <= one + 5.0 + 10.0,
        "{allowed} allowed in {secs:.1}s; one replica's rate allows {one:.0}"
    );
    assert!(f64::from(allowed) >= one * 0.6, "{allowed} allowed in {secs:.1}s");
}

/// `/metrics` of a control plane's `--metrics-listen`.
fn scrape(addr: std::net::SocketAddr) -> String {
    common::http_get(addr, "/metrics").1
}

/// The value of `series` in `metrics` (0 if absent).
fn sample(metrics: &str, series: &str) -> f64 {
    common::sample(metrics, series).unwrap_or(0.0)
}

#[test]
fn a_replica_whose_change_listener_is_cut_makes_it_again_and_follows_the_others_at_once() {
    let (pg, url) = database();
    let metrics: std::net::SocketAddr = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap()
    };
    let a = Cp::start_with(
        TempDir::new("pg-relisten-a"),
        &["--database", &url, "--metrics-listen", &metrics.to_string()],
    );
    let dir = TempDir::new("pg-relisten-b");
    let key = dir.path().join("secret.key");
    std::fs::copy(a.data_dir().join("secret.key"), &key).unwrap();
    let b = Cp::start_with(
        dir,
        &["--database", &url, "--secret-key-file", key.to_str().unwrap()],
    );
    let listeners = || {
        pg.query(
            "otherix",
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'otherix change listener'",
        )
        .unwrap()
        .trim()
        .parse::<u32>()
        .unwrap()
    };
    common::wait_for(|| (sample(&scrape(metrics), "otherix_store_listener_up") == 1.0).then_some(()));
    common::wait_for(|| (listeners() == 2).then_some(()));

    // Every replica's listener backend ended by the database's administrator.
    let ended = pg
        .query(
            "otherix",
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = 'otherix change listener'",
        )
        .unwrap();
    assert_eq!(ended.lines().filter(|l| l.trim() == "t").count(), 2, "{ended}");

    // a notices, says so once, makes it again and says that once.
    common::wait_for(|| a.log().contains("lost the change listener").then_some(()));
    common::wait_for(|| a.log().contains("change listener back").then_some(()));
    common::wait_for(|| {
        let m = scrape(metrics);
        (sample(&m, "otherix_store_listener_up") == 1.0
            && sample(&m, "otherix_store_listener_reconnects_total") >= 1.0)
            .then_some(())
    });
    common::wait_for(|| (listeners() == 2).then_some(()));
    let log = a.log();
    assert_eq!(log.matches("lost the change listener").count(), 1, "{log}");
    assert_eq!(log.matches("change listener back").count(), 1, "{log}");

    // A change made through b reaches a by a notification again, not only
    // by the poll.
    let notified = |m: &str| sample(m, "otherix_catalog_syncs_total{trigger=\"notification\"}");
    let before = notified(&scrape(metrics));
    let admin_on_b = b.cli("admin-on-b");
    admin_on_b.ok(&[
        "login",
        "--server",
        &b.url,
        "--token-file",
        a.admin_token_file().to_str().unwrap(),
        "--ca-fingerprint",
        &b.fingerprint,
    ]);
    admin_on_b.ok(&["user", "create", "nora", "--role", "viewer"]);
    common::wait_for(|| (notified(&scrape(metrics)) > before).then_some(()));
    let users = a.admin().json(&["user", "list"]);
    assert!(names(&users).contains(&"nora".to_string()), "{users}");
    let m = scrape(metrics);
    assert!(
        m.contains("otherix_catalog_lag_seconds "),
        "the catalog's lag is exported: {m}"
    );
}
