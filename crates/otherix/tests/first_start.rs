//! The first start's admin token survives a start that stops at the worst
//! moment (issue 26): after the store has committed the first admin, before
//! `admin.token` is in place. Stopped there for real — the rename into
//! place fails, because `admin.token` is taken by a directory — the next
//! start finishes it, so the admin's token is never lost.

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
            panic!("the server started although admin.token cannot be written");
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
