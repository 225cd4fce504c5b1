//! The typed client against a real control plane: keep-alive connections are
//! reused across calls (one TLS handshake, not one per call), and a
//! connection the server closed while idle is replaced without the caller
//! seeing an error.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{admin_token, Cp};
use otherix_client::client::MAX_IDLE;
use otherix_client::Client;

/// Established connections to the CP's port from clients on this host.
fn connections_to(cp: &Cp) -> usize {
    let port = cp.url.rsplit(':').next().unwrap().trim_end_matches('/');
    let out = Command::new("ss")
        .args(["-Htn", "state", "established", &format!("( dport = :{port} )")])
        .output()
        .expect("ss (iproute2)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).lines().count()
}

#[test]
fn calls_reuse_one_connection_and_survive_the_server_closing_it() {
    let cp = Cp::start();
    let client = Client::new(&cp.url, &cp.ca_pem(), Some(admin_token(&cp))).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for _ in 0..20 {
            assert_eq!(client.whoami().await.unwrap().name, "admin");
        }
        // Errors are answers too: the connection stays usable.
        assert!(client.get_user("nobody").await.is_err());
        assert_eq!(client.list_users().await.unwrap().len(), 1);
    });
    assert_eq!(connections_to(&cp), 1, "22 calls, one connection");

    // Concurrent calls open what they need; at most MAX_IDLE stay.
    rt.block_on(async {
        let calls: Vec<_> = (0..16)
            .map(|_| {
                let c = client.clone();
                tokio::spawn(async move { c.whoami().await.map(|w| w.name) })
            })
            .collect();
        for call in calls {
            assert_eq!(call.await.unwrap().unwrap(), "admin");
        }
    });
    let open = connections_to(&cp);
    assert!((1..=MAX_IDLE).contains(&open), "{open} connections kept");

    // The server drops idle connections after its header timeout (10 s);
    // the next call goes through on a new one.
    std::thread::sleep(Duration::from_secs(12));
    rt.block_on(async {
        for _ in 0..3 {
            assert_eq!(client.whoami().await.unwrap().name, "admin");
        }
    });
}
