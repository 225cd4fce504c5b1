//! Open sessions, live and one at a time, end to end on the testbed: the
//! byte counts of `otherix forward` sessions grow in `GET /v1/sessions`
//! (`otherix session list`) while data flows — through a gateway, reported
//! in its heartbeats, and through the relay, recorded every few seconds —
//! and `otherix session end ID` ends exactly that session: its client's
//! connection closes, audited `ended by an admin`, while the same user's
//! other session to the same VM and port keeps passing bytes and new
//! connections are let in. A resumable relay session waiting for its
//! client to resume ends the same way.
//!
//! A CP, one hypervisor and a standalone gateway; an echo guest on an
//! overlay (through the gateway) and one on a bridge (through the relay:
//! resumable sessions by default, plain ones with OTHERIX_RELAY_RESUME=off).

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, Proc, World};
use serde_json::Value;

mod common;

use common::BIN;

const WAIT: Duration = Duration::from_secs(60);
/// Longest an ended session may take to close its client's connection:
/// a heartbeat or two for a gateway; generous for a loaded CI machine.
const ENDS_WITHIN: Duration = Duration::from_secs(20);
/// Bytes each round sends (and reads back from the echo guest).
const ROUND: usize = 4096;

/// One connection through an `otherix forward`: one session.
struct Conn {
    what: &'static str,
    stream: TcpStream,
    /// Its session's id, once seen listed.
    id: String,
    /// Bytes sent (and echoed back) so far.
    sent: u64,
}

impl Conn {
    /// Connects to `local` and waits for the session to be listed: its id
    /// is the one that was not there before.
    fn open(c: &Cluster, what: &'static str, local: SocketAddr) -> Conn {
        let before: BTreeSet<String> = sessions(c)
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_owned())
            .collect();
        let stream = TcpStream::connect(local).unwrap();
        stream.set_read_timeout(Some(WAIT)).unwrap();
        let mut conn = Conn {
            what,
            stream,
            id: String::new(),
            sent: 0,
        };
        conn.round(16);
        conn.id = wait_until(&format!("{what}'s session to be listed"), WAIT, || {
            let new: Vec<String> = sessions(c)
                .iter()
                .map(|s| s["id"].as_str().unwrap().to_owned())
                .filter(|id| !before.contains(id))
                .collect();
            assert!(new.len() <= 1, "one session opened, {new:?} listed");
            new.into_iter().next()
        })
        .unwrap();
        conn
    }

    /// Sends `n` bytes and reads them back from the echo guest.
    fn round(&mut self, n: usize) {
        let what = self.what;
        let data: Vec<u8> = (0..n).map(|i| b'a' + (i % 26) as u8).collect();
        self.stream
            .write_all(&data)
            .unwrap_or_else(|e| panic!("{what}: cannot send: {e}"));
        let mut back = vec![0u8; n];
        self.stream
            .read_exact(&mut back)
            .unwrap_or_else(|e| panic!("{what}: no echo: {e}"));
        assert_eq!(back, data, "{what}: echoed something else");
        self.sent += n as u64;
    }

    /// Waits until the listed counts cover what was sent and echoed.
    fn counted(&self, c: &Cluster) -> (u64, u64) {
        wait_until(
            &format!("{}'s bytes ({} each way) to be listed", self.what, self.sent),
            WAIT,
            || {
                let s = sessions(c).into_iter().find(|s| s["id"] == self.id.as_str())?;
                let (up, down) = (s["bytes_up"].as_u64().unwrap(), s["bytes_down"].as_u64().unwrap());
                (up >= self.sent && down >= self.sent).then_some((up, down))
            },
        )
        .unwrap()
    }

    /// Waits until the client's connection has been closed.
    fn closed(&mut self) {
        self.stream.set_read_timeout(Some(ENDS_WITHIN)).unwrap();
        let mut rest = Vec::new();
        match self.stream.read_to_end(&mut rest) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                panic!(
                    "{}: still open {ENDS_WITHIN:?} after its session was ended",
                    self.what
                )
            }
            // A reset is closed too.
            Err(_) => {}
        }
    }
}

fn sessions(c: &Cluster) -> Vec<Value> {
    c.cli_json(&["session", "list"])
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}

/// The reason the audit trail gives for session `id`'s end, once it has one.
fn end_reason(c: &Cluster, id: &str) -> Option<String> {
    c.cli_json(&["audit", "--since", "1h"])
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["action"] == "session_end" && e["session"] == id)
        .map(|e| e["reason"].as_str().unwrap_or_default().to_owned())
}

/// Ends `conn`'s session with `otherix session end`: its connection
/// closes, its end is audited as an admin's, `others` go on.
fn end_one(c: &Cluster, conn: &mut Conn, others: &mut [&mut Conn]) {
    let out = c.cli_ok(&["session", "end", &conn.id]).unwrap();
    assert!(out.contains("only that one"), "{out}");
    conn.closed();
    let reason = wait_until(&format!("{}'s end to be audited", conn.what), WAIT, || {
        end_reason(c, &conn.id)
    })
    .unwrap();
    assert_eq!(reason, "ended by an admin", "{}", conn.what);
    for other in others.iter_mut() {
        other.round(ROUND);
        let listed = sessions(c);
        assert!(
            listed.iter().any(|s| s["id"] == other.id.as_str()),
            "{} is still listed: {listed:#?}",
            other.what
        );
        assert_eq!(end_reason(c, &other.id), None, "{} did not end", other.what);
    }
}

fn forward(c: &Cluster, vm: &str, envs: &[(&str, &str)]) -> (Proc, SocketAddr) {
    c.forward_env(vm, 7, &["--ready", "0"], envs).unwrap()
}

#[test]
fn ending_one_session_ends_that_one_only_and_open_sessions_bytes_grow_live() {
    let world = World::new("sessend").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    let c = Cluster::start(world, spec).expect("cluster starts");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.210.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.211.0.0/24",
        "--node",
        "node1",
    ])
    .unwrap();
    for (vm, net) in [("ovecho", "ov"), ("brecho", "lab")] {
        c.cli_ok(&[
            "vm",
            "create",
            vm,
            "--network",
            net,
            "--exec",
            "otherix guest echo --port 7",
        ])
        .unwrap();
        c.wait_vm_running(vm, WAIT).unwrap();
    }
    let (_gw_fwd, gw_local) = forward(&c, "ovecho", &[]);
    let (_res_fwd, res_local) = forward(&c, "brecho", &[]);
    let (_plain_fwd, plain_local) = forward(&c, "brecho", &[("OTHERIX_RELAY_RESUME", "off")]);
    // Guests listen a moment after `running`, the gateway after its first keys.
    for (vm, local) in [("ovecho", gw_local), ("brecho", res_local)] {
        wait_until(&format!("{vm}:7 to echo"), WAIT, || {
            let mut s = TcpStream::connect(local).ok()?;
            s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
            s.write_all(b"x").ok()?;
            let mut b = [0u8; 1];
            s.read_exact(&mut b).ok()
        })
        .unwrap();
    }
    wait_until("the probe sessions to end", WAIT, || {
        sessions(&c).is_empty().then_some(())
    })
    .unwrap();

    // The admin's sessions to the same VM and port: two through the
    // gateway, one resumable and two plain through the relay.
    let mut gw1 = Conn::open(&c, "the first gateway session", gw_local);
    let mut gw2 = Conn::open(&c, "the second gateway session", gw_local);
    let mut res = Conn::open(&c, "the resumable relay session", res_local);
    let mut plain1 = Conn::open(&c, "the first plain relay session", plain_local);
    let mut plain2 = Conn::open(&c, "the second plain relay session", plain_local);
    let listed = sessions(&c);
    let transport = |id: &str| {
        listed.iter().find(|s| s["id"] == id).unwrap()["transport"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(
        [&gw1, &gw2, &res, &plain1, &plain2].map(|s| transport(&s.id)),
        ["gateway", "gateway", "relay", "relay", "relay"]
    );

    // Bytes grow in the list while data flows, each session its own.
    for conn in [&mut gw1, &mut gw2, &mut res, &mut plain1, &mut plain2] {
        conn.round(ROUND);
        let first = conn.counted(&c);
        conn.round(ROUND);
        let then = conn.counted(&c);
        assert!(
            then.0 > first.0 && then.1 > first.1,
            "{}: {first:?} then {then:?}",
            conn.what
        );
    }
    let table = c.cli_ok(&["session", "list"]).unwrap();
    assert!(table.contains("UP") && table.contains("KiB"), "{table}");

    // Ending one ends that one only, on each path.
    end_one(&c, &mut gw1, &mut [&mut gw2, &mut res, &mut plain1, &mut plain2]);
    end_one(&c, &mut res, &mut [&mut gw2, &mut plain1, &mut plain2]);
    end_one(&c, &mut plain1, &mut [&mut gw2, &mut plain2]);

    // A resumable session waiting for its client to come back (the client
    // went away) ends too — on its node, not at its grace period — and
    // only it.
    let (waiting_fwd, waiting_local) = forward(&c, "brecho", &[]);
    let mut waiting = Conn::open(&c, "a resumable session waiting for a resume", waiting_local);
    waiting.round(ROUND);
    waiting_fwd.kill().unwrap();
    let cp = c.cp().expect("the control plane runs");
    wait_until("the relay to hold the session for a resume", WAIT, || {
        cp.log()
            .lines()
            .any(|l| l.contains("waits for a resume") && l.contains(&waiting.id))
            .then_some(())
    })
    .unwrap();
    c.cli_ok(&["session", "end", &waiting.id]).unwrap();
    let reason = wait_until("the waiting session's end to be audited", WAIT, || {
        end_reason(&c, &waiting.id)
    })
    .unwrap();
    assert_eq!(reason, "ended by an admin");
    assert!(sessions(&c).iter().all(|s| s["id"] != waiting.id.as_str()));
    gw2.round(ROUND);
    plain2.round(ROUND);

    // The user connects again at once, through the gateway and the relay:
    // new credentials are not covered.
    let mut again = Conn::open(&c, "a new gateway session", gw_local);
    again.round(ROUND);
    let mut again_relay = Conn::open(&c, "a new relay session", plain_local);
    again_relay.round(ROUND);
    gw2.round(ROUND);
    plain2.round(ROUND);
    assert_eq!(sessions(&c).len(), 4, "{:#?}", sessions(&c));
}
