//! A first start that stops at the wrong moment (issue 26) leaves a data
//! directory the next start completes: the admin's token, when it stopped
//! after the store committed the admin and before `admin.token` was in
//! place (stopped there for real: a directory takes the file's place, so
//! the rename fails); the cluster CA, when it stopped between `ca.key` and
//! `ca.crt`.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{admin_token, Cp, TempDir, BIN};

/// Runs `otherix server` on `data` until it exits (it must, within 30 s);
/// its exit status and stderr.
fn start_that_fails(data: &std::path::Path) -> (std::process::ExitStatus, String) {
    let mut child = Command::new(BIN)
        .args(["server", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("the server started (or hung) where it should have failed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    (status, stderr)
}

#[test]
fn a_first_start_stopped_after_the_admin_was_created_keeps_its_token_for_the_next_start() {
    let dir = TempDir::new("first-start");
    let data = dir.path().join("data");
    // Whatever is at admin.token's place cannot be replaced by a file.
    let obstacle = data.join("admin.token");
    std::fs::create_dir_all(obstacle.join("x")).unwrap();

    let (status, stderr) = start_that_fails(&data);
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains("admin.token") && stderr.contains("moved into place at the next start"),
        "{stderr}"
    );
    let pending = data.join("admin.token.pending");
    let token = std::fs::read_to_string(&pending).expect("the token kept in the data directory");
    assert!(token.starts_with("otx_"), "{token}");

    // The next start finishes the first: the same token, now usable.
    std::fs::remove_dir_all(&obstacle).unwrap();
    let cp = Cp::start_embedded(dir, &[]);
    assert_eq!(admin_token(&cp), token.trim());
    assert!(!pending.exists());
    assert!(
        cp.banner
            .iter()
            .any(|l| l.starts_with("admin token      written to")),
        "{:?}",
        cp.banner
    );
    assert!(cp.log().contains("finished a first start"), "logged");
    let me = cp.admin().json(&["whoami"]);
    assert_eq!(
        (me["principal"].as_str(), me["role"].as_str()),
        (Some("user:admin"), Some("admin"))
    );

    // Later starts leave it as it is.
    let mut cp = cp;
    cp.kill9();
    cp.boot();
    assert_eq!(admin_token(&cp), token.trim());
    assert!(!cp.banner.iter().any(|l| l.starts_with("admin token")));
}

#[test]
fn a_pending_token_the_store_never_committed_is_discarded() {
    // A first start that stopped before the store committed the admin.
    let dir = TempDir::new("first-start-early");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let stale = format!("otx_{}_{}\n", "1".repeat(16), "2".repeat(64));
    std::fs::write(data.join("admin.token.pending"), &stale).unwrap();

    let cp = Cp::start_embedded(dir, &[]);
    let token = admin_token(&cp);
    assert_ne!(
        token,
        stale.trim(),
        "a token the store does not hold became the admin's"
    );
    assert!(!data.join("admin.token.pending").exists());
    assert_eq!(cp.admin().json(&["whoami"])["role"], "admin");
}

#[test]
fn a_first_start_stopped_between_the_ca_key_and_its_certificate_starts_again() {
    // What a first start stopped between writing ca.key and ca.crt leaves:
    // a key, no certificate, a store that never recorded a CA.
    let started = Cp::start_embedded(TempDir::new("first-start-ca-a"), &[]);
    let dir = TempDir::new("first-start-ca-b");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::copy(started.data_dir().join("ca.key"), data.join("ca.key")).unwrap();
    let cp = Cp::start_embedded(dir, &[]);
    assert_ne!(cp.fingerprint, started.fingerprint, "a CA made anew");
    assert!(cp.log().contains("making the cluster CA anew"), "logged");
    assert_eq!(cp.admin().json(&["whoami"])["role"], "admin");

    // A cluster that started (it recorded its CA) never gets a second CA:
    // the lost certificate is reported.
    let mut started = started;
    started.kill9();
    std::fs::remove_file(started.data_dir().join("ca.crt")).unwrap();
    let (status, stderr) = start_that_fails(&started.data_dir());
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("holds ca.key but not ca.crt"), "{stderr}");
}

/// Runs `otherix server` on `data` as a person does in a terminal: stdout
/// and stderr on one stream, the daemon's default log level, under an
/// open-files limit low enough that the start has a warning to give. Stops
/// it once it says it started; everything it wrote.
fn start_on_one_terminal(data: &std::path::Path) -> String {
    let out = data.with_extension("out");
    let file = std::fs::File::create(&out).unwrap();
    let mut child = Command::new("prlimit")
        .args([
            "--nofile=1024:1024",
            BIN,
            "server",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(data)
        .env_remove("RUST_LOG")
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .spawn()
        .unwrap();
    let started = otherix_testbed::wait_until("the server to start", Duration::from_secs(30), || {
        let text = std::fs::read_to_string(&out).ok()?;
        text.contains("control plane started").then_some(())
    });
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&out).unwrap();
    started.unwrap_or_else(|e| panic!("{e}:\n{text}"));
    text
}

/// The banner's lines, from its first to `log in with`; panics unless they
/// come as one block.
fn banner(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let first = lines
        .iter()
        .position(|l| l.starts_with("otherix control plane"))
        .unwrap_or_else(|| panic!("no banner:\n{text}"));
    let last = lines
        .iter()
        .position(|l| l.starts_with("log in with"))
        .unwrap_or_else(|| panic!("no login line:\n{text}"));
    let block = &lines[first..=last];
    // Log lines open with their timestamp; the banner's with a word.
    assert!(
        block.iter().all(|l| !l.starts_with(|c: char| c.is_ascii_digit())),
        "log lines in the middle of the banner:\n{text}"
    );
    block.to_vec()
}

#[test]
fn a_first_start_prints_its_banner_whole_and_warns_of_nothing_it_made() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("first-start-quiet");
    let data = dir.path().join("data");

    let first = start_on_one_terminal(&data);
    let banner_lines = banner(&first);
    assert!(
        banner_lines.iter().any(|l| l.starts_with("connections")),
        "the start under a low open-files limit has something to warn about:\n{first}"
    );
    let warnings: Vec<&str> = first.lines().filter(|l| l.contains(" WARN ")).collect();
    assert!(
        warnings.iter().all(|l| l.contains("connection caps")),
        "a warning about files it made itself:\n{first}"
    );
    let migrations: Vec<&str> = first.lines().filter(|l| l.contains("migrat")).collect();
    assert_eq!(
        migrations.len(),
        1,
        "one line for the store's migrations:\n{first}"
    );
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    for file in ["otherix.db", "otherix.db-wal", "otherix.db-shm"] {
        let path = data.join(file);
        if path.exists() {
            assert_eq!(mode(&path), 0o600, "{file} made the owner's alone");
        }
    }

    // A later start migrates nothing and says nothing of it; a store left
    // open to others meanwhile is still tightened, and said so.
    std::fs::set_permissions(data.join("otherix.db"), std::fs::Permissions::from_mode(0o644)).unwrap();
    let again = start_on_one_terminal(&data);
    banner(&again);
    assert!(!again.contains("migrat"), "{again}");
    assert!(
        again
            .lines()
            .any(|l| l.contains("tightened permissions") && l.contains("otherix.db")),
        "{again}"
    );
    assert_eq!(mode(&data.join("otherix.db")), 0o600);
}
