//! Taking access away ends the access, end to end on the testbed: revoking a
//! grant, revoking one API token, removing an access rule and deleting a
//! user each end that principal's live sessions through the gateway and
//! through the relay within a heartbeat or so, audited with reason
//! `revoked`; credentials and relay tickets brokered before and not yet used
//! are refused; everyone else's sessions go on. A grant's expiry ends its
//! sessions the same way, at the expiry, audited `grant expired`.
//!
//! A CP, one hypervisor and a standalone gateway; an echo guest on an overlay
//! (through the gateway) and one on a bridge (through the relay), both
//! labelled `app=echo`. Sessions are held by real `otherix connect`
//! processes.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use otherix_client::tunnel::relay as relay_tunnel;
use otherix_client::tunnel::{self as connect, ConnectError};
use otherix_client::Client;
use otherix_proto::{BrokerRequest, BrokerResponse};
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::Value;

mod common;

use common::tunnels::rt;
use common::BIN;
const WAIT: Duration = Duration::from_secs(60);
/// Longest a revocation may take to end a session: the wake-up, one
/// heartbeat, the close; generous for a loaded CI machine.
const ENDS_WITHIN: Duration = Duration::from_secs(20);

/// Who holds a session.
#[derive(Clone, Copy)]
enum As<'a> {
    Admin,
    Token(&'a str),
    Grant(&'a Path),
}

/// A session held open by `otherix connect` to an echo guest.
struct Held {
    what: String,
    child: Child,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

impl Held {
    fn open(c: &Cluster, who: As<'_>, vm: &str, what: &str) -> Held {
        Held::try_open(c, who, vm, what).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_open(c: &Cluster, who: As<'_>, vm: &str, what: &str) -> Result<Held, String> {
        let mut cmd = Command::new(BIN);
        if let As::Grant(g) = who {
            cmd.arg("--grant-file").arg(g);
        }
        cmd.args(["connect", vm, "7"])
            .env("OTHERIX_CONFIG", &c.config)
            .env_remove("RUST_LOG")
            .env_remove("OTHERIX_TOKEN");
        if let As::Token(t) = who {
            cmd.env("OTHERIX_TOKEN", t);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut held = Held {
            what: what.to_string(),
            stdin: child.stdin.take().unwrap(),
            stdout: child.stdout.take().unwrap(),
            child,
        };
        held.try_echo()?;
        Ok(held)
    }

    /// One line there and back.
    fn try_echo(&mut self) -> Result<(), String> {
        let what = &self.what;
        self.stdin
            .write_all(b"ping\n")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("{what}: cannot send: {e}"))?;
        let mut back = [0u8; 5];
        self.stdout
            .read_exact(&mut back)
            .map_err(|e| format!("{what}: no echo: {e}"))?;
        if &back != b"ping\n" {
            return Err(format!("{what}: echoed {back:?}"));
        }
        Ok(())
    }

    fn echo(&mut self) {
        self.try_echo().unwrap_or_else(|e| panic!("{e}"));
    }

    /// Waits until the session's process has ended.
    fn ended(&mut self) -> Duration {
        self.ended_within(ENDS_WITHIN)
    }

    /// Waits at most `within` until the session's process has ended.
    fn ended_within(&mut self, within: Duration) -> Duration {
        let started = Instant::now();
        while started.elapsed() < within {
            if self.child.try_wait().unwrap().is_some() {
                return started.elapsed();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{}: still open {within:?} after it should have ended", self.what);
    }

    fn still_open(&mut self) {
        assert!(self.child.try_wait().unwrap().is_none(), "{} ended", self.what);
        self.echo();
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn ca_pem(c: &Cluster) -> String {
    std::fs::read_to_string(c.ca_file()).unwrap()
}

fn client(c: &Cluster, token: &str) -> Client {
    Client::new(&c.url, &ca_pem(c), Some(token.to_string())).unwrap()
}

fn broker(client: &Client, vm: &str) -> BrokerResponse {
    rt().block_on(client.broker(&BrokerRequest {
        target: vm.into(),
        port: 7,
        exclude: Vec::new(),
    }))
    .unwrap_or_else(|e| panic!("broker {vm}: {e}"))
}

/// Presents a brokered credential (gateway) or ticket (relay); the refusal's
/// status and reason.
fn refused(c: &Cluster, b: &BrokerResponse) -> (u16, String) {
    let result = if b.transport == otherix_proto::Transport::Relay {
        rt().block_on(relay_tunnel::open(&c.url, &ca_pem(c), &b.credential))
            .map(|_| ())
    } else {
        rt().block_on(connect::open(&b.endpoint, &ca_pem(c), &b.credential))
            .map(|_| ())
    };
    match result {
        Ok(()) => panic!(
            "a {} credential brokered before the revocation was accepted",
            b.transport
        ),
        Err(ConnectError::Refused { status, reason }) => (status, reason),
        Err(e) => panic!("expected a refusal, got {e}"),
    }
}

fn assert_revoked_refusal(c: &Cluster, b: &BrokerResponse) {
    let (status, reason) = refused(c, b);
    assert_eq!(status, 403, "{}: {reason}", b.transport);
    assert!(reason.contains("revoked"), "{}: {reason}", b.transport);
}

/// The token's public id: `otx_<id>_<secret>`.
fn token_id(token: &str) -> String {
    token.split('_').nth(1).unwrap().to_string()
}

fn audit(c: &Cluster) -> Vec<Value> {
    c.cli_json(&["audit", "--since", "1h"])
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// A CP, one hypervisor and a gateway, with echo guests `ovecho` (overlay
/// `subnets.0`, through the gateway) and `brecho` (bridge `subnets.1`,
/// through the relay), both answering.
fn echo_cluster(hint: &str, subnets: (&str, &str)) -> Cluster {
    let world = World::new(hint).expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    let c = Cluster::start(world, spec).expect("cluster starts");
    c.cli_ok(&[
        "network", "create", "ov", "--type", "overlay", "--subnet", subnets.0,
    ])
    .unwrap();
    c.cli_ok(&[
        "network", "create", "lab", "--type", "bridge", "--subnet", subnets.1, "--node", "node1",
    ])
    .unwrap();
    for (vm, net) in [("ovecho", "ov"), ("brecho", "lab")] {
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
    // Guests listen a moment after `running`, the gateway after its first keys.
    for vm in ["ovecho", "brecho"] {
        wait_until(&format!("{vm}:7 to echo"), WAIT, || {
            Held::try_open(&c, As::Admin, vm, vm).ok().map(drop)
        })
        .unwrap();
    }
    c
}

#[test]
fn revoking_a_grant_a_token_a_rule_or_a_user_ends_their_sessions_and_no_one_elses() {
    let c = echo_cluster("revoke", ("10.124.0.0/24", "10.125.0.0/24"));
    let mut admin = Held::open(&c, As::Admin, "ovecho", "the admin's session");

    // ---- a grant: its gateway and relay sessions end, its unused
    // credential and ticket are refused.
    let grant = c.world_dir().join("acme.grant");
    let token = c
        .cli_ok(&[
            "grant", "create", "acme", "--target", "ovecho:7", "--target", "brecho:7", "--ttl", "1h",
        ])
        .unwrap();
    std::fs::write(&grant, token.trim()).unwrap();
    let mut acme_gw = Held::open(&c, As::Grant(&grant), "ovecho", "acme through the gateway");
    let mut acme_relay = Held::open(&c, As::Grant(&grant), "brecho", "acme through the relay");
    let acme = client(&c, token.trim());
    let (unused_gw, unused_relay) = (broker(&acme, "ovecho"), broker(&acme, "brecho"));
    assert_eq!(
        (unused_gw.transport.as_str(), unused_relay.transport.as_str()),
        ("gateway", "relay")
    );
    c.cli_ok(&["grant", "revoke", "acme"]).unwrap();
    let took = (acme_gw.ended(), acme_relay.ended());
    eprintln!("acme's sessions ended {took:?} after the revocation");
    assert_revoked_refusal(&c, &unused_gw);
    assert_revoked_refusal(&c, &unused_relay);
    admin.still_open();

    // ---- a user with two tokens and one rule.
    c.cli_ok(&["user", "create", "alice", "--role", "user"]).unwrap();
    c.cli_ok(&["user", "allow", "alice", "--selector", "app=echo", "--ports", "7"])
        .unwrap();
    let t1 = c
        .cli_ok(&["user", "token", "create", "alice"])
        .unwrap()
        .trim()
        .to_string();
    let t2 = c
        .cli_ok(&["user", "token", "create", "alice"])
        .unwrap()
        .trim()
        .to_string();
    let mut by_t1 = Held::open(&c, As::Token(&t1), "ovecho", "alice's first token");
    let mut by_t2 = Held::open(&c, As::Token(&t2), "ovecho", "alice's second token");
    let unused_t1 = broker(&client(&c, &t1), "ovecho");
    // Revoking one token ends that token's session only.
    c.cli_ok(&["user", "token", "revoke", "alice", &token_id(&t1)])
        .unwrap();
    by_t1.ended();
    assert_revoked_refusal(&c, &unused_t1);
    by_t2.still_open();

    // Removing the rule ends what it allowed.
    let rule = c.cli_json(&["user", "get", "alice"]).unwrap()["rules"][0]["id"]
        .as_i64()
        .unwrap()
        .to_string();
    c.cli_ok(&["user", "disallow", "alice", "--rule", &rule]).unwrap();
    by_t2.ended();

    // Deleting the user ends the rest, through the relay too.
    c.cli_ok(&["user", "allow", "alice", "--selector", "app=echo", "--ports", "7"])
        .unwrap();
    // On PostgreSQL the removal's revocation covers what replicas could
    // still mint for 3 s after it (MINT_LAG + REPLICA_SKEW; see "No
    // window"): access given back within that is refused until it passes.
    let mut alice_relay = wait_until("alice's access given back to take effect", WAIT, || {
        Held::try_open(&c, As::Token(&t2), "brecho", "alice through the relay").ok()
    })
    .unwrap();
    c.cli_ok(&["user", "delete", "alice"]).unwrap();
    alice_relay.ended();
    admin.still_open();

    // The audit trail: each revoked session ended with reason `revoked`,
    // the admin's none; each change names who took what away.
    let ended = wait_until("every revoked session's end to be audited", WAIT, || {
        let revoked: Vec<(String, String)> = audit(&c)
            .iter()
            .filter(|e| e["action"] == "session_end" && e["reason"] == "revoked")
            .map(|e| {
                (
                    e["principal"].as_str().unwrap().to_string(),
                    e["transport"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        (revoked.len() >= 5).then_some(revoked)
    })
    .unwrap();
    let mut ended = ended;
    ended.sort();
    assert_eq!(
        ended,
        [
            ("grant:acme".to_string(), "gateway".to_string()),
            ("grant:acme".into(), "relay".into()),
            ("user:alice".into(), "gateway".into()),
            ("user:alice".into(), "gateway".into()),
            ("user:alice".into(), "relay".into()),
        ]
    );
    let changes: Vec<String> = audit(&c)
        .iter()
        .filter(|e| e["action"] == "revoke")
        .map(|e| {
            assert_eq!(e["principal"], "user:admin", "{e}");
            e["target"].as_str().unwrap().to_string()
        })
        .collect();
    assert_eq!(changes.len(), 4, "{changes:?}");
    assert_eq!(changes[0], "grant:acme");
    assert!(changes[1].starts_with("user:alice token "), "{changes:?}");
    assert!(changes[2].starts_with("user:alice rule "), "{changes:?}");
    assert_eq!(changes[3], "user:alice");
    drop(admin);
}

#[test]
fn a_grants_expiry_ends_its_sessions_through_the_gateway_and_the_relay() {
    let c = echo_cluster("gexpire", ("10.127.0.0/24", "10.128.0.0/24"));
    let mut admin = Held::open(&c, As::Admin, "ovecho", "the admin's session");
    // Long enough to open both sessions on a loaded machine; nothing but
    // the expiry (no revocation, --max-session is 12 h) ends them.
    let ttl = Duration::from_secs(15);
    let grant = c.world_dir().join("short.grant");
    let created = Instant::now();
    let token = c
        .cli_ok(&[
            "grant", "create", "short", "--target", "ovecho:7", "--target", "brecho:7", "--ttl", "15s",
        ])
        .unwrap();
    std::fs::write(&grant, token.trim()).unwrap();
    let mut gw = Held::open(&c, As::Grant(&grant), "ovecho", "short through the gateway");
    let mut relay = Held::open(&c, As::Grant(&grant), "brecho", "short through the relay");
    assert!(
        created.elapsed() < ttl,
        "the sessions took longer to open than the grant lives"
    );
    gw.still_open();
    relay.still_open();
    // Both end at the expiry: not before it, and soon after.
    gw.ended_within(ttl + ENDS_WITHIN);
    relay.ended_within(ttl + ENDS_WITHIN);
    assert!(
        created.elapsed() >= ttl - Duration::from_secs(1),
        "ended {:?} after a grant of {ttl:?} was created",
        created.elapsed()
    );
    admin.still_open();

    // Audited like any end, with the reason, through each transport.
    let ended = wait_until("both expired sessions' ends to be audited", WAIT, || {
        let ends: Vec<(String, String)> = audit(&c)
            .iter()
            .filter(|e| e["action"] == "session_end" && e["principal"] == "grant:short")
            .map(|e| {
                (
                    e["transport"].as_str().unwrap().to_string(),
                    e["reason"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        (ends.len() >= 2).then_some(ends)
    })
    .unwrap();
    let mut ended = ended;
    ended.sort();
    assert_eq!(
        ended,
        [
            ("gateway".to_string(), "grant expired".to_string()),
            ("relay".into(), "grant expired".into()),
        ]
    );
    drop(admin);
}
