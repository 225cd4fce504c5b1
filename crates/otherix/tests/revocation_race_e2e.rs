//! A revocation has no window, attacked on three control-plane replicas
//! on one PostgreSQL: while eight threads broker as a principal through
//! every replica as fast as they can — opening a session with each
//! credential through the gateway (overlay guest) or the relay (bridge
//! guest) — an admin revokes the principal's token, removes its rule,
//! deletes the user or revokes the grant. When the command has returned:
//! - every credential the threads received before it, while it ran, or
//!   after it returned (brokered in flight, on any replica) is refused by
//!   the gateway and the relay with 403 `revoked` when presented;
//! - every session opened before, with any credential, ends;
//! - no replica mints for the principal any more;
//! - another principal brokering all along is untouched.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use otherix_client::tunnel::{self, AnyTunnel, ConnectError};
use otherix_client::Client;
use otherix_proto::{BrokerRequest, BrokerResponse, Transport};
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use tokio::io::AsyncReadExt;

mod common;

use common::tunnels::{echo_through, rt};
use common::BIN;

const WAIT: Duration = Duration::from_secs(60);
/// Brokering threads, spread over the replicas and both transports.
const THREADS: usize = 8;
/// Sessions each thread keeps open (older ones it closes itself).
const KEEP_OPEN: usize = 4;
/// How long the threads go on brokering after the revocation returned.
const AFTER: Duration = Duration::from_secs(2);
/// Longest a session opened before the revocation may outlive its return:
/// the gateways hold the list when it returns, so this is the close.
const ENDS_WITHIN: Duration = Duration::from_secs(10);

fn ca_pem(c: &Cluster) -> String {
    std::fs::read_to_string(c.ca_file()).unwrap()
}

fn broker(client: &Client, target: &str) -> Result<BrokerResponse, String> {
    rt().block_on(client.broker(&BrokerRequest {
        target: target.into(),
        port: 7,
        exclude: Vec::new(),
    }))
    .map_err(|e| e.to_string())
}

fn open(grant: &BrokerResponse, cp_url: &str, ca: &str) -> Result<AnyTunnel, ConnectError> {
    rt().block_on(tunnel::open_brokered(grant, cp_url, ca))
}

/// What one brokering thread saw.
#[derive(Default)]
struct Seen {
    /// Sessions it opened before the revocation returned (the last few).
    open: Vec<(String, AnyTunnel)>,
    /// Credentials it received while the revocation ran or after it
    /// returned, unused, with the replica they came through.
    after: Vec<(BrokerResponse, String)>,
    /// The last few credentials it received before the revocation began,
    /// unused.
    before: Vec<(BrokerResponse, String)>,
    /// Credentials minted in all.
    minted: usize,
    /// Broker refusals after the revocation returned, per replica.
    refused_after: Vec<String>,
}

/// Runs the threads with `clients` (the principal's client per replica),
/// calls `revoke` once they are well under way, and returns what they saw.
fn race(urls: &[String], ca: &str, clients: Vec<Client>, revoke: impl FnOnce()) -> (Vec<Seen>, Instant) {
    let revoking = Arc::new(AtomicBool::new(false));
    let returned = Arc::new(AtomicBool::new(false));
    let returned_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
    let going = Arc::new(Barrier::new(THREADS + 1));
    let clients = Arc::new(clients);
    let threads: Vec<_> = (0..THREADS)
        .map(|i| {
            let (revoking, returned, returned_at, going, clients) = (
                revoking.clone(),
                returned.clone(),
                returned_at.clone(),
                going.clone(),
                clients.clone(),
            );
            let (url, ca) = (urls[i % urls.len()].clone(), ca.to_string());
            std::thread::spawn(move || {
                let client = &clients[i % clients.len()];
                let vm = if i % 2 == 0 { "echo1" } else { "lab1" };
                let mut seen = Seen::default();
                let mut signalled = false;
                loop {
                    if !signalled && seen.minted >= 3 {
                        going.wait();
                        signalled = true;
                    }
                    let since = *returned_at.lock().unwrap();
                    if since.is_some_and(|t| t.elapsed() > AFTER) {
                        break;
                    }
                    let during = revoking.load(Ordering::SeqCst);
                    let answer = broker(client, vm);
                    let after = returned.load(Ordering::SeqCst);
                    match answer {
                        Ok(grant) => {
                            seen.minted += 1;
                            // Kept unused, to present once the revocation
                            // returned: every one brokered after it, every
                            // other one brokered while it ran, and the last
                            // few brokered before it began.
                            let keep = after || (during && seen.minted % 2 == 0);
                            if keep {
                                seen.after.push((grant, url.clone()));
                            } else if !during && seen.minted % 3 == 0 {
                                seen.before.push((grant, url.clone()));
                                if seen.before.len() > KEEP_OPEN {
                                    seen.before.remove(0);
                                }
                            } else if let Ok(t) = open(&grant, &url, &ca) {
                                seen.open.push((format!("{vm} via {url}"), t));
                                if seen.open.len() > KEEP_OPEN {
                                    seen.open.remove(0);
                                }
                            }
                        }
                        Err(e) if after => seen.refused_after.push(format!("{url}: {e}")),
                        // Refused while the revocation is under way: as it should.
                        Err(_) if revoking.load(Ordering::SeqCst) => {}
                        Err(e) => panic!("brokering before the revocation failed: {e}"),
                    }
                }
                if !signalled {
                    going.wait();
                }
                seen
            })
        })
        .collect();
    going.wait();
    revoking.store(true, Ordering::SeqCst);
    revoke();
    *returned_at.lock().unwrap() = Some(Instant::now());
    returned.store(true, Ordering::SeqCst);
    let at = Instant::now();
    let seen = threads.into_iter().map(|t| t.join().unwrap()).collect();
    (seen, at)
}

/// Everything the race must show: the credentials received after the
/// revocation returned are refused as revoked, the sessions opened before
/// end, and every replica refuses to broker.
fn assert_no_window(what: &str, seen: Vec<Seen>, returned: Instant, urls: &[String], ca: &str) {
    let minted: usize = seen.iter().map(|s| s.minted).sum();
    let late: usize = seen.iter().map(|s| s.after.len()).sum();
    let early: usize = seen.iter().map(|s| s.before.len()).sum();
    eprintln!(
        "{what}: {minted} credentials minted, {late} received while the revocation ran or after, {early} before"
    );
    for s in &seen {
        for (grant, url) in s.after.iter().chain(&s.before) {
            match open(grant, url, ca) {
                Err(ConnectError::Refused { status, reason }) => {
                    assert_eq!(status, 403, "{what}: {} credential: {reason}", grant.transport);
                    assert!(reason.contains("revoked"), "{what}: {reason}");
                }
                Err(e) => panic!("{what}: expected a refusal, got {e}"),
                Ok(_) => panic!(
                    "{what}: a {} credential brokered before the revocation returned was accepted after it",
                    grant.transport
                ),
            }
        }
    }
    // Every replica refused by the end (no replica mints for it any more).
    for url in urls {
        assert!(
            seen.iter()
                .any(|s| s.refused_after.iter().any(|r| r.starts_with(url.as_str()))),
            "{what}: no refusal seen from {url}"
        );
    }
    let mut open = 0;
    for s in seen {
        for (name, mut t) in s.open {
            open += 1;
            let ended = rt().block_on(async {
                let mut buf = [0u8; 256];
                let deadline = tokio::time::Instant::from_std(returned + ENDS_WITHIN);
                loop {
                    match tokio::time::timeout_at(deadline, t.read(&mut buf)).await {
                        Err(_) => return false,
                        Ok(Ok(0)) | Ok(Err(_)) => return true,
                        Ok(Ok(_)) => {}
                    }
                }
            });
            assert!(
                ended,
                "{what}: session {name} opened before the revocation was still open {ENDS_WITHIN:?} after it returned"
            );
        }
    }
    assert!(open > 0, "{what}: no session was open to end");
}

#[test]
fn a_revocation_racing_eight_brokering_threads_on_three_replicas_leaves_no_window() {
    let world = World::new("revrace").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    spec.gateways = 1;
    spec.replicas = 3;
    let c = Cluster::start(world, spec).expect("a cluster of three replicas starts");
    let urls = c.urls();
    let ca = ca_pem(&c);
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.186.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.187.0.0/24",
        "--node",
        "node1",
    ])
    .unwrap();
    for (vm, net) in [("echo1", "ov"), ("lab1", "lab")] {
        c.cli_ok(&[
            "vm",
            "create",
            vm,
            "--network",
            net,
            "--label",
            "app=echo",
            "--exec",
            "otherix guest echo --port 7",
        ])
        .unwrap();
        c.wait_vm_running(vm, WAIT).unwrap();
    }
    let user = |name: &str| -> String {
        c.cli_ok(&["user", "create", name, "--role", "user"]).unwrap();
        c.cli_ok(&["user", "allow", name, "--selector", "app=echo", "--ports", "7"])
            .unwrap();
        c.cli_ok(&["user", "token", "create", name])
            .unwrap()
            .trim()
            .to_string()
    };
    let per_replica = |token: &str| -> Vec<Client> {
        urls.iter()
            .map(|u| Client::new(std::slice::from_ref(u), &ca, Some(token.to_string())).unwrap())
            .collect()
    };
    // Both guests answer through every replica before the races start.
    let bystander_token = user("bystander");
    let bystander = per_replica(&bystander_token);
    for (i, url) in urls.iter().enumerate() {
        for vm in ["echo1", "lab1"] {
            let mut t = wait_until(&format!("{vm}:7 through {url}"), WAIT, || {
                open(&broker(&bystander[i], vm).ok()?, url, &ca).ok()
            })
            .unwrap();
            echo_through(&mut t, b"ready\n");
        }
    }
    let mut bystanding = open(&broker(&bystander[0], "echo1").unwrap(), &urls[0], &ca).unwrap();

    // A token revoked.
    let token = user("tokens");
    let id = token.split('_').nth(1).unwrap().to_string();
    let (seen, at) = race(&urls, &ca, per_replica(&token), || {
        c.cli_ok(&["user", "token", "revoke", "tokens", &id]).unwrap();
    });
    assert_no_window("token revoked", seen, at, &urls, &ca);

    // A rule removed.
    let token = user("rules");
    let rule = c.cli_json(&["user", "get", "rules"]).unwrap()["rules"][0]["id"]
        .as_i64()
        .unwrap()
        .to_string();
    let (seen, at) = race(&urls, &ca, per_replica(&token), || {
        c.cli_ok(&["user", "disallow", "rules", "--rule", &rule]).unwrap();
    });
    assert_no_window("rule removed", seen, at, &urls, &ca);

    // A user deleted.
    let token = user("deleted");
    let (seen, at) = race(&urls, &ca, per_replica(&token), || {
        c.cli_ok(&["user", "delete", "deleted"]).unwrap();
    });
    assert_no_window("user deleted", seen, at, &urls, &ca);

    // A grant revoked.
    let grant = c
        .cli_ok(&[
            "grant", "create", "acme", "--target", "echo1:7", "--target", "lab1:7", "--ttl", "1h",
        ])
        .unwrap()
        .trim()
        .to_string();
    let (seen, at) = race(&urls, &ca, per_replica(&grant), || {
        c.cli_ok(&["grant", "revoke", "acme"]).unwrap();
    });
    assert_no_window("grant revoked", seen, at, &urls, &ca);

    // The bystander's session went on, and it still brokers everywhere.
    echo_through(&mut bystanding, b"still here\n");
    for (i, url) in urls.iter().enumerate() {
        let grant = broker(&bystander[i], "lab1").unwrap();
        assert_eq!(grant.transport, Transport::Relay);
        echo_through(&mut open(&grant, url, &ca).unwrap(), b"bystander\n");
    }
}
