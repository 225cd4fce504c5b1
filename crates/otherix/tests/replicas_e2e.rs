//! Three control-plane replicas on one PostgreSQL, end to end on the
//! testbed: any replica brokers and relays; a relay ticket is single-use
//! across them; `kill -9` of one while gateway sessions are open and
//! brokering goes on loses no session and no audit record, agents
//! heartbeat to another replica within seconds, a resumable relay session
//! the killed one carried (the CLI's) resumes through another replica, a
//! plain one ends at its client with a clear message and is recorded as
//! ended by the others, and new relay sessions work through another replica.

use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use otherix_client::tunnel::{self, AnyTunnel, ConnectError};
use otherix_client::Client;
use otherix_proto::{BrokerRequest, BrokerResponse, Transport};
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::Value;
use time::OffsetDateTime;

mod common;

use common::tunnels::{connect_process, echo_through, read_until_error, rt};
use common::BIN;

const WAIT: Duration = Duration::from_secs(60);
/// Gateway sessions held open across the kill.
const SESSIONS: usize = 50;

fn ca_pem(c: &Cluster) -> String {
    std::fs::read_to_string(c.ca_file()).unwrap()
}

/// A user allowed to reach `app=echo` on port 7, and an API client of
/// `servers` with its token.
fn user(c: &Cluster, name: &str, servers: &[String]) -> Client {
    c.cli_ok(&["user", "create", name, "--role", "user"]).unwrap();
    c.cli_ok(&["user", "allow", name, "--selector", "app=echo", "--ports", "7"])
        .unwrap();
    let token = c.cli_ok(&["user", "token", "create", name]).unwrap();
    Client::new(servers, &ca_pem(c), Some(token.trim().to_string())).unwrap()
}

fn broker(client: &Client, target: &str) -> Result<BrokerResponse, String> {
    rt().block_on(client.broker(&BrokerRequest {
        target: target.into(),
        port: 7,
        exclude: Vec::new(),
    }))
    .map_err(|e| e.to_string())
}

/// The tunnel a broker answer describes; a relay through `cp_url`.
fn open(grant: &BrokerResponse, cp_url: &str, ca: &str) -> Result<AnyTunnel, ConnectError> {
    rt().block_on(tunnel::open_brokered(grant, cp_url, ca))
}

/// Audit records of `principal` (every page of the last hour).
fn audit(c: &Cluster, principal: &str) -> Vec<Value> {
    let list = c
        .cli_json(&[
            "audit",
            "--since",
            "1h",
            "--principal",
            principal,
            "--limit",
            "5000",
        ])
        .unwrap();
    list.as_array().unwrap().clone()
}

fn count(records: &[Value], action: &str, allowed: bool) -> usize {
    records
        .iter()
        .filter(|r| r["action"] == action && r["allowed"] == allowed)
        .count()
}

fn ts(v: &Value) -> Option<OffsetDateTime> {
    OffsetDateTime::parse(v.as_str()?, &time::format_description::well_known::Rfc3339).ok()
}

#[test]
fn three_replicas_any_brokers_and_relays_and_killing_one_loses_nothing() {
    let world = World::new("replicas").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    spec.gateways = 1;
    spec.replicas = 3;
    let mut c = Cluster::start(world, spec).expect("a cluster of three replicas starts");
    let urls = c.urls();
    let ca = ca_pem(&c);
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.181.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.182.0.0/24",
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

    // Every replica brokers, to the gateway and to the relay; a relay
    // session goes through the replica it is presented to.
    for (i, url) in urls.iter().enumerate() {
        let via = user(&c, &format!("via{i}"), std::slice::from_ref(url));
        for vm in ["echo1", "lab1"] {
            let mut t = wait_until(&format!("{vm}:7 through replica {url}"), WAIT, || {
                let grant = broker(&via, vm).ok()?;
                open(&grant, url, &ca).ok()
            })
            .unwrap();
            echo_through(&mut t, format!("{vm} via {url}\n").as_bytes());
        }
    }

    // A relay ticket used through one replica is refused through another.
    let ticket_user = user(&c, "ticket", &urls);
    let grant = broker(&ticket_user, "lab1").unwrap();
    assert_eq!(grant.transport, Transport::Relay);
    let mut first_use = open(&grant, &urls[0], &ca).unwrap();
    echo_through(&mut first_use, b"first use\n");
    match open(&grant, &urls[1], &ca) {
        Err(ConnectError::Refused { status, reason }) => {
            assert_eq!(status, 409, "{reason}");
        }
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(_) => panic!("a used ticket was accepted by another replica"),
    }
    drop(first_use);

    // 50 gateway sessions, brokered through any replica.
    let holder = user(&c, "holder", &urls);
    let mut sessions: Vec<AnyTunnel> = (0..SESSIONS)
        .map(|i| {
            let grant = broker(&holder, "echo1").unwrap();
            assert_eq!(grant.transport, Transport::Gateway);
            let mut t = open(&grant, &urls[0], &ca).unwrap();
            echo_through(&mut t, format!("session {i} before\n").as_bytes());
            t
        })
        .collect();

    // Relay sessions carried by the first replica: the library's, and the
    // CLI's (its config names every replica; it uses the first).
    let relay_user = user(&c, "relayed", &urls[..1]);
    let grant = broker(&relay_user, "lab1").unwrap();
    let mut relayed = open(&grant, &urls[0], &ca).unwrap();
    echo_through(&mut relayed, b"relayed before\n");
    let mut connect = connect_process(&c.config, "lab1", 7);
    // (Recorded on the side of each session: waited for.)
    let first_id = std::fs::read_to_string(c.cp_dir().join("replica.id")).unwrap();
    let first_id = first_id.trim().to_string();
    wait_until(
        "both relay sessions to be listed, on the first replica",
        WAIT,
        || {
            let open = c.cli_json(&["session", "list", "--target", "lab1"]).ok()?;
            let carried: Vec<&Value> = open
                .as_array()?
                .iter()
                .filter(|s| s["transport"] == "relay")
                .collect();
            (carried.len() == 2 && carried.iter().all(|s| s["replica"] == first_id.as_str())).then_some(())
        },
    )
    .unwrap();

    // Brokering goes on all along, through a client that knows every replica.
    let looper = user(&c, "looper", &urls);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let brokering = {
        let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
        std::thread::spawn(move || {
            let mut errors = Vec::new();
            while !stop.load(Ordering::Relaxed) && ok.load(Ordering::Relaxed) < 400 {
                match broker(&looper, "echo1") {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        errors.push(e);
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
                std::thread::sleep(Duration::from_millis(20));
            }
            errors
        })
    };
    wait_until("brokering to run", WAIT, || {
        (ok.load(Ordering::Relaxed) > 20).then_some(())
    })
    .unwrap();

    // kill -9 the first replica.
    let killed_at = OffsetDateTime::now_utc();
    let before_kill = ok.load(Ordering::Relaxed);
    c.kill_replica(0).unwrap();

    // Its plain relay session ends at its client at once, saying why.
    let (err, took) = read_until_error(&mut relayed);
    eprintln!("relay session on the killed replica: {err} after {took:?}");
    assert!(err.to_string().contains("control plane"), "{err}");
    // The CLI's resumable session goes on through another replica.
    {
        use std::io::{BufRead, Write};
        connect
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"after the kill\n")
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(connect.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "after the kill\n", "the CLI's session resumed");
    }
    drop(connect.stdin.take());
    let status = wait_until("otherix connect to exit", Duration::from_secs(30), || {
        connect.try_wait().unwrap()
    })
    .unwrap();
    let mut stderr = String::new();
    connect
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("relay: resumed"), "{stderr}");

    // Brokering continues through the others.
    wait_until("brokering to go on after the kill", WAIT, || {
        (ok.load(Ordering::Relaxed) > before_kill + 50).then_some(())
    })
    .unwrap();

    // Every agent heartbeats to another replica within 10 s.
    let rehomed = wait_until(
        "every node to heartbeat after the kill",
        Duration::from_secs(10),
        || {
            let nodes = c.cli_json(&["node", "list"]).ok()?;
            let all = nodes
                .as_array()?
                .iter()
                .all(|n| n["status"] == "Ready" && ts(&n["last_heartbeat"]).is_some_and(|t| t > killed_at));
            all.then_some(OffsetDateTime::now_utc() - killed_at)
        },
    )
    .unwrap();
    eprintln!("agents heartbeating elsewhere {rehomed} after the kill");

    // Every gateway session survived.
    for (i, t) in sessions.iter_mut().enumerate() {
        echo_through(t, format!("session {i} after\n").as_bytes());
    }

    // New relay sessions work through another replica.
    let mut again = wait_until("a new relay session", WAIT, || {
        let grant = broker(&ticket_user, "lab1").ok()?;
        // The client moved to the replica that answered.
        open(&grant, ticket_user.server(), &ca).ok()
    })
    .unwrap();
    assert_ne!(ticket_user.server(), urls[0]);
    echo_through(&mut again, b"relayed after\n");
    drop(again);

    stop.store(true, Ordering::Relaxed);
    let errors = brokering.join().unwrap();
    // At most the one call in flight when the replica died; nothing is resent.
    assert!(errors.len() <= 1, "{errors:?}");

    // The killed replica's plain relay session is recorded as ended by the
    // others (the resumable one ended when its client closed it), and
    // neither is listed open any more.
    let reason = format!("control plane replica {first_id} stopped");
    let ended = wait_until("the killed replica's relay sessions to be ended", WAIT, || {
        let ends: std::collections::BTreeSet<String> = ["user:relayed", "user:admin"]
            .iter()
            .flat_map(|p| audit(&c, p))
            .filter(|r| {
                r["action"] == "session_end" && r["transport"] == "relay" && r["reason"] == reason.as_str()
            })
            .map(|r| r["session"].as_str().unwrap_or_default().to_string())
            .collect();
        (ends.len() == 1).then_some(ends)
    })
    .unwrap();
    assert!(ended.iter().all(|s| !s.is_empty()), "{ended:?}");
    let open_now = c.cli_json(&["session", "list", "--target", "lab1"]).unwrap();
    assert!(open_now.as_array().unwrap().is_empty(), "{open_now}");

    // No audit record lost: every credential the loop got was recorded,
    // and each of the 50 sessions started and ended once.
    // (A call cut off in flight may have been recorded without its answer
    // reaching the loop.)
    let got = ok.load(Ordering::Relaxed);
    let recorded = count(&audit(&c, "user:looper"), "broker", true);
    assert!(
        (got..=got + errors.len()).contains(&recorded),
        "{recorded} recorded, {got} answered"
    );
    drop(sessions);
    let records = wait_until("the 50 sessions' ends to be recorded", WAIT, || {
        let records = audit(&c, "user:holder");
        (count(&records, "session_end", true) == SESSIONS).then_some(records)
    })
    .unwrap();
    assert_eq!(count(&records, "broker", true), SESSIONS);
    assert_eq!(count(&records, "session_start", true), SESSIONS);
    assert_eq!(count(&records, "session_end", true), SESSIONS);
}
