//! Resumable relay sessions (`otherix_proto::resume`), end to end on the
//! testbed: the agent keeps the guest's connection and what it sent while
//! the client is away, and the session goes on byte-exact over a new
//! connection. These tests speak the protocol's frames themselves (a raw
//! WebSocket client), so that every wrong resume a real client never sends
//! can be tried; the stream tests through `otherix forward` are in
//! `relay_resume_stream_e2e`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use otherix_client::Client;
use otherix_proto::resume::{self, Frame};
use otherix_proto::{BrokerRequest, BrokerResponse, Transport};
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;

mod common;

use common::tunnels::rt;
use common::BIN;
const WAIT: Duration = Duration::from_secs(60);

type Ws = tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>;

/// A CP (`grace` to resume) and one hypervisor with echo guest `echo1` on
/// bridge `lab`, answering through the relay.
fn echo_cluster(hint: &str, subnet: &str, grace: &str) -> (Cluster, Client) {
    echo_cluster_of(hint, subnet, grace, 1)
}

/// [`echo_cluster`] with `replicas` control planes (on PostgreSQL past one).
fn echo_cluster_of(hint: &str, subnet: &str, grace: &str, replicas: usize) -> (Cluster, Client) {
    let world = World::new(hint).expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    spec.gateways = 0;
    spec.replicas = replicas;
    // A node late with a heartbeat on a loaded machine would have its VM
    // seen pending a moment: room for slow heartbeats.
    spec.node_timeout = Duration::from_secs(15);
    spec.extra_server_args = vec!["--relay-resume-grace".into(), grace.into()];
    let c = Cluster::start(world, spec).expect("cluster starts");
    c.cli_ok(&[
        "network", "create", "lab", "--type", "bridge", "--subnet", subnet, "--node", "node1",
    ])
    .unwrap();
    c.cli_ok(&[
        "vm",
        "create",
        "echo1",
        "--network",
        "lab",
        "--exec",
        "otherix guest echo --port 7",
    ])
    .unwrap();
    c.wait_vm_running("echo1", WAIT).unwrap();
    let admin = client(&c, &token(&c));
    // The guest listens a moment after `running`.
    wait_until("echo1:7 to answer through the relay", WAIT, || {
        let mut s = open(&c, &admin).ok()?;
        rt().block_on(async {
            s.send_data(b"ping").await;
            (s.read_data(4).await == b"ping").then_some(())
        })
    })
    .unwrap();
    (c, admin)
}

fn ca_pem(c: &Cluster) -> String {
    std::fs::read_to_string(c.ca_file()).unwrap()
}

fn token(c: &Cluster) -> String {
    std::fs::read_to_string(c.cp_dir().join("admin.token"))
        .unwrap()
        .trim()
        .to_string()
}

fn client(c: &Cluster, token: &str) -> Client {
    Client::new(&c.url, &ca_pem(c), Some(token.to_string())).unwrap()
}

fn broker(client: &Client) -> Result<BrokerResponse, String> {
    let grant = rt()
        .block_on(client.broker(&BrokerRequest {
            target: "echo1".into(),
            port: 7u16.into(),
            exclude: Vec::new(),
        }))
        .map_err(|e| e.to_string())?;
    assert_eq!(grant.transport, Transport::Relay);
    Ok(grant)
}

/// The answer to a raw upgrade: status, head, and the WebSocket on a 101.
struct Answer {
    status: u16,
    head: String,
    ws: Option<Ws>,
}

impl Answer {
    fn header(&self, name: &str) -> Option<String> {
        self.head.lines().find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
        })
    }

    fn body_says(&self, what: &str) -> bool {
        self.head.contains(what)
    }
}

/// `GET /v1/relay` with `bearer` and `extra` header lines, offering the
/// resumable protocol; the answer's head (and body, for a refusal).
fn upgrade(c: &Cluster, bearer: &str, extra: &str) -> Answer {
    upgrade_at(c, &c.url, bearer, extra)
}

/// [`upgrade`] to the control plane at `url` (a replica).
fn upgrade_at(c: &Cluster, url: &str, bearer: &str, extra: &str) -> Answer {
    let addr: SocketAddr = url.trim_start_matches("https://").parse().unwrap();
    let ca = otherix_tls::cert_from_pem(&ca_pem(c)).unwrap();
    let mut config = otherix_tls::pinned_client_config(ca).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let head = format!(
        "GET /v1/relay HTTP/1.1\r\nHost: cp\r\nAuthorization: Bearer {bearer}\r\nConnection: Upgrade\r\n\
         Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Sec-WebSocket-Protocol: {}\r\n{extra}\r\n",
        resume::PROTOCOL
    );
    rt().block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
        let mut stream = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .unwrap();
        stream.write_all(head.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let mut byte = [0u8; 1];
        while !got.ends_with(b"\r\n\r\n") {
            let n = tokio::time::timeout(Duration::from_secs(20), stream.read(&mut byte))
                .await
                .expect("an answer within 20 s")
                .unwrap();
            assert_eq!(
                n,
                1,
                "closed before an answer: {:?}",
                String::from_utf8_lossy(&got)
            );
            got.push(byte[0]);
        }
        let mut head = String::from_utf8_lossy(&got).to_string();
        let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        let ws = if status == 101 {
            Some(tokio_tungstenite::WebSocketStream::from_raw_socket(stream, Role::Client, None).await)
        } else {
            // The refusal's one line.
            let mut body = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut body)).await;
            head.push_str(&String::from_utf8_lossy(&body));
            None
        };
        Answer { status, head, ws }
    })
}

/// An open resumable session as the client sees it.
struct Session {
    id: String,
    secret: String,
    ws: Ws,
    /// Units received from the agent.
    received: u64,
}

impl Session {
    async fn send_data(&mut self, data: &[u8]) {
        let frame = Frame::Data(data.to_vec().into());
        self.ws
            .send(Message::Binary(frame.encode().into()))
            .await
            .unwrap();
    }

    async fn send(&mut self, frame: Frame) {
        self.ws
            .send(Message::Binary(frame.encode().into()))
            .await
            .unwrap();
    }

    /// Reads data frames until `n` bytes came (acks skipped).
    async fn read_data(&mut self, n: usize) -> Vec<u8> {
        let mut got = Vec::new();
        while got.len() < n {
            let msg = tokio::time::timeout(Duration::from_secs(20), self.ws.next())
                .await
                .expect("frames within 20 s");
            match msg {
                Some(Ok(Message::Binary(b))) => match Frame::decode(b).unwrap() {
                    Frame::Data(d) => {
                        self.received += d.len() as u64;
                        got.extend_from_slice(&d);
                    }
                    Frame::Ack(_) => {}
                    other => panic!("unexpected {other:?}"),
                },
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                other => panic!("the session ended: {other:?}"),
            }
        }
        got
    }

    /// The next Close, with its code and reason.
    async fn closed(&mut self) -> (u16, String) {
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(20), self.ws.next())
                .await
                .expect("a close within 20 s");
            match msg {
                Some(Ok(Message::Close(Some(f)))) => return (f.code.into(), f.reason.to_string()),
                Some(Ok(_)) => {}
                other => panic!("no close: {other:?}"),
            }
        }
    }
}

/// A new resumable session to echo1:7 as `client`'s principal.
fn open(c: &Cluster, client: &Client) -> Result<Session, String> {
    let grant = broker(client)?;
    let a = upgrade(c, &grant.credential, "");
    if a.status != 101 {
        return Err(a.head);
    }
    assert_eq!(
        a.header("sec-websocket-protocol").as_deref(),
        Some(resume::PROTOCOL),
        "{}",
        a.head
    );
    assert!(a.header(resume::HEADER_GRACE).is_some(), "{}", a.head);
    Ok(Session {
        id: a.header(resume::HEADER_SESSION).expect("a session id"),
        secret: a.header(resume::HEADER_SECRET).expect("a resume secret"),
        ws: a.ws.unwrap(),
        received: 0,
    })
}

/// A resume of `id` with `secret`, having received `received`, as `bearer`.
fn try_resume(c: &Cluster, bearer: &str, id: &str, secret: &str, received: u64) -> Answer {
    try_resume_at(c, &c.url, bearer, id, secret, received)
}

/// [`try_resume`] through the control plane at `url`.
fn try_resume_at(c: &Cluster, url: &str, bearer: &str, id: &str, secret: &str, received: u64) -> Answer {
    upgrade_at(
        c,
        url,
        bearer,
        &format!(
            "{}: {id}\r\n{}: {secret}\r\n{}: {received}\r\n{}: test dropped the connection\r\n",
            resume::HEADER_RESUME,
            resume::HEADER_SECRET,
            resume::HEADER_RECEIVED,
            resume::HEADER_CAUSE
        ),
    )
}

fn audit(c: &Cluster, session: &str) -> Vec<Value> {
    c.cli_json(&["audit", "--since", "1h"])
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["session"].as_str() == Some(session))
        .cloned()
        .collect()
}

fn ended_with(c: &Cluster, session: &str) -> Option<String> {
    audit(c, session)
        .into_iter()
        .find(|e| e["action"] == "session_end")
        .map(|e| e["reason"].as_str().unwrap_or_default().to_string())
}

#[test]
fn a_session_resumes_byte_exact_and_every_wrong_resume_is_refused_with_nothing_reattached() {
    let (c, admin) = echo_cluster("resume-raw", "10.191.0.0/24", "60s");
    let admin_token = token(&c);
    c.cli_ok(&["user", "create", "bob", "--role", "user"]).unwrap();
    let bob_token = c
        .cli_ok(&["user", "token", "create", "bob"])
        .unwrap()
        .trim()
        .to_string();

    let mut s = open(&c, &admin).unwrap();
    rt().block_on(async {
        s.send_data(b"hello ").await;
        assert_eq!(s.read_data(6).await, b"hello ");
        s.send(Frame::Ack(s.received)).await;
        // More the client will not have read when its connection drops.
        s.send_data(b"lost? ").await;
    });
    let Session {
        id,
        secret,
        ws,
        received,
    } = s;
    drop(ws);

    // Wrong: secret, principal, the ticket (single use, not the principal's
    // token), a count the client cannot have. Nothing is reattached.
    let a = try_resume(&c, &admin_token, &id, "0".repeat(64).as_str(), received);
    assert_eq!(a.status, 403, "{}", a.head);
    assert!(a.body_says("wrong resume secret"), "{}", a.head);
    let a = try_resume(&c, &bob_token, &id, &secret, received);
    assert_eq!(a.status, 404, "{}", a.head);
    assert!(
        a.body_says(&format!("no relay session {id} of yours")),
        "{}",
        a.head
    );
    let a = try_resume(&c, &admin_token, "not-a-session", &secret, received);
    assert_eq!(a.status, 404, "{}", a.head);
    let a = upgrade(&c, &admin_token, &format!("{}: {id}\r\n", resume::HEADER_RESUME));
    assert_eq!(a.status, 400, "{}", a.head);

    // Right: the agent received both pieces; the echo of the second is sent
    // again from where the client was.
    let a = try_resume(&c, &admin_token, &id, &secret, received);
    assert_eq!(a.status, 101, "{}", a.head);
    assert_eq!(
        a.header(resume::HEADER_RECEIVED).as_deref(),
        Some("12"),
        "{}",
        a.head
    );
    let mut s = Session {
        id: id.clone(),
        secret: secret.clone(),
        ws: a.ws.unwrap(),
        received,
    };
    rt().block_on(async {
        assert_eq!(s.read_data(6).await, b"lost? ");
        s.send_data(b"world").await;
        assert_eq!(s.read_data(5).await, b"world");
        s.send(Frame::Ack(s.received)).await;
    });
    let resumes: Vec<_> = audit(&c, &id)
        .into_iter()
        .filter(|e| e["action"] == "session_resume")
        .collect();
    assert_eq!(resumes.len(), 1, "one resume recorded: {resumes:?}");
    assert!(
        resumes[0]["reason"]
            .as_str()
            .unwrap()
            .contains("after: test dropped the connection"),
        "{resumes:?}"
    );

    // Resumed again while the last connection is still open: that one hears
    // it was taken over.
    let a = try_resume(&c, &admin_token, &id, &secret, s.received);
    assert_eq!(a.status, 101, "{}", a.head);
    let (code, reason) = rt().block_on(s.closed());
    assert_eq!(code, resume::CLOSE_TAKEN_OVER, "{reason}");
    let s = Session {
        id: id.clone(),
        secret: secret.clone(),
        ws: a.ws.unwrap(),
        received: s.received,
    };

    // Past the buffer: a count below what the client acknowledged is no
    // longer kept. The session cannot go on byte-exact: it ends, with why.
    drop(s.ws);
    let a = try_resume(&c, &admin_token, &id, &secret, 0);
    assert_eq!(a.status, 410, "{}", a.head);
    assert!(a.body_says("cannot resume from unit 0"), "{}", a.head);
    let a = try_resume(&c, &admin_token, &id, &secret, s.received);
    assert_eq!(a.status, 410, "{}", a.head);
    wait_until("the end recorded", WAIT, || ended_with(&c, &id)).unwrap();
}

#[test]
fn a_session_waits_its_grace_and_no_longer_and_a_revocation_ends_a_waiting_one_at_once() {
    let (c, admin) = echo_cluster("resume-grace", "10.192.0.0/24", "4s");
    let admin_token = token(&c);

    // Not resumed within the grace: ended, and a late resume hears why.
    let mut s = open(&c, &admin).unwrap();
    rt().block_on(async {
        s.send_data(b"x").await;
        s.read_data(1).await;
    });
    let (id, secret) = (s.id.clone(), s.secret.clone());
    drop(s.ws);
    let reason = wait_until("the session to end at its grace", WAIT, || ended_with(&c, &id)).unwrap();
    assert!(reason.contains("grace period (4s)"), "{reason}");
    let a = try_resume(&c, &admin_token, &id, &secret, 1);
    assert_eq!(a.status, 410, "{}", a.head);
    assert!(a.body_says("grace period"), "{}", a.head);

    // A grant's session waiting for a resume when the grant is revoked:
    // it ends at once (well before its grace), and a resume is refused.
    let grant = c
        .cli_ok(&["grant", "create", "acme", "--target", "echo1:7", "--ttl", "1h"])
        .unwrap()
        .trim()
        .to_string();
    let acme = client(&c, &grant);
    let mut s = open(&c, &acme).unwrap();
    rt().block_on(async {
        s.send_data(b"y").await;
        s.read_data(1).await;
    });
    let (id, secret) = (s.id.clone(), s.secret.clone());
    drop(s.ws);
    wait_until("the session to wait for a resume", WAIT, || {
        let listed = c.cli_json(&["session", "list"]).ok()?;
        listed
            .as_array()?
            .iter()
            .any(|x| x["id"] == id.as_str())
            .then_some(())
    })
    .unwrap();
    c.cli_ok(&["grant", "revoke", "acme"]).unwrap();
    // Ended by the revocation, not by its grace (which says so).
    let reason = wait_until("the waiting session to end", WAIT, || ended_with(&c, &id)).unwrap();
    assert_eq!(reason, "revoked");
    let a = try_resume(&c, &grant, &id, &secret, 1);
    assert!(a.status == 403 || a.status == 401, "{}", a.head);
}

/// Resumes `s` (its connection gone) through `url` and checks the stream
/// goes on: what the agent received is what was sent, and a new piece
/// comes back.
fn resume_and_echo(c: &Cluster, url: &str, bearer: &str, s: Session, sent: u64, piece: &[u8]) -> Session {
    let a = try_resume_at(c, url, bearer, &s.id, &s.secret, s.received);
    assert_eq!(a.status, 101, "{}", a.head);
    assert_eq!(
        a.header(resume::HEADER_RECEIVED),
        Some(sent.to_string()),
        "{}",
        a.head
    );
    let mut s = Session {
        ws: a.ws.unwrap(),
        ..s
    };
    rt().block_on(async {
        s.send_data(piece).await;
        assert_eq!(s.read_data(piece.len()).await, piece);
        s.send(Frame::Ack(s.received)).await;
    });
    s
}

#[test]
fn a_session_outlives_a_control_plane_restart_and_a_kill_minus_nine() {
    let (mut c, admin) = echo_cluster("resume-restart", "10.193.0.0/24", "60s");
    let bearer = token(&c);
    let mut s = open(&c, &admin).unwrap();
    rt().block_on(async {
        s.send_data(b"one").await;
        assert_eq!(s.read_data(3).await, b"one");
    });
    // SIGTERM: the control plane says to resume; it comes back on the same
    // store and the agent still holds the session.
    let cp = c.cps[0].proc.take().unwrap();
    let closed = std::thread::scope(|scope| {
        let close = scope.spawn(|| rt().block_on(s.closed()));
        cp.terminate(Duration::from_secs(20)).unwrap();
        close.join().unwrap()
    });
    assert_eq!(closed.0, resume::CLOSE_RESUME, "{closed:?}");
    c.start_cp().unwrap();
    let url = c.url.clone();
    let s = resume_and_echo(&c, &url, &bearer, s, 3, b"two");
    // SIGKILL: the connection just drops.
    c.kill_cp().unwrap();
    c.start_cp().unwrap();
    let s = resume_and_echo(&c, &url, &bearer, s, 6, b"three");
    let id = s.id.clone();
    let resumes = audit(&c, &id)
        .into_iter()
        .filter(|e| e["action"] == "session_resume")
        .count();
    assert_eq!(resumes, 2);
    assert_eq!(ended_with(&c, &id), None, "still open");
}

#[test]
fn a_session_carried_by_a_killed_replica_resumes_through_another() {
    let (mut c, admin) = echo_cluster_of("resume-replica", "10.194.0.0/24", "60s", 2);
    let bearer = token(&c);
    let urls = c.urls();
    let mut s = open(&c, &admin).unwrap();
    rt().block_on(async {
        s.send_data(b"before").await;
        assert_eq!(s.read_data(6).await, b"before");
    });
    c.kill_replica(0).unwrap();
    let s = resume_and_echo(&c, &urls[1], &bearer, s, 6, b"after");
    let resumed: Vec<_> = audit(&c, &s.id)
        .into_iter()
        .filter(|e| e["action"] == "session_resume")
        .collect();
    assert_eq!(resumed.len(), 1, "{resumed:?}");
    // Once the dead replica is reaped, its sessions are ended: not this one,
    // which another carries now.
    c.cps[1]
        .proc
        .as_ref()
        .unwrap()
        .wait_for_log("control plane replica stopped", WAIT)
        .unwrap();
    assert_eq!(ended_with(&c, &s.id), None);
    let listed = c.cli_json(&["session", "list"]).unwrap();
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|x| x["id"] == s.id.as_str()),
        "{listed}"
    );
}

/// A client that resumes while its last connection still carries a
/// stream both ways (it took that connection for lost): the agent cuts the
/// old connection's side mid-stream, so the control plane carrying it may
/// see the node fail, or its client go, before it hears of the takeover.
/// Either is the old connection's end, not the session's: the session is
/// neither ended nor marked waiting, goes on byte-exact over the new
/// connection, and resumes again after that.
#[test]
fn a_connection_taken_over_mid_stream_neither_ends_nor_detaches_its_session() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let (c, admin) = echo_cluster("resume-takeover", "10.185.0.0/24", "60s");
    let bearer = token(&c);
    let s = open(&c, &admin).unwrap();
    let (id, secret) = (s.id.clone(), s.secret.clone());
    // The old connection: a writer within the window the agent's acks
    // open, and a reader counting what came back (acknowledging nothing,
    // so the agent keeps it all for the resume).
    let (mut sink, mut stream) = s.ws.split();
    let read = Arc::new(AtomicU64::new(0));
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let reader = {
        let (read, acked) = (read.clone(), acked.clone());
        rt().spawn(async move {
            while let Some(Ok(msg)) = stream.next().await {
                if let Message::Binary(b) = msg {
                    match Frame::decode(b) {
                        Ok(Frame::Data(d)) => {
                            read.fetch_add(d.len() as u64, Ordering::SeqCst);
                        }
                        Ok(Frame::Ack(n)) => acked.store(n, Ordering::SeqCst),
                        _ => {}
                    }
                }
            }
        })
    };
    let sent = Arc::new(AtomicU64::new(0));
    let writer = {
        let (sent, acked, stop) = (sent.clone(), acked.clone(), stop.clone());
        rt().spawn(async move {
            const PIECE: usize = 16 * 1024;
            let frame = Frame::Data(vec![b'a'; PIECE].into()).encode();
            let window = resume::DEFAULT_BUFFER as u64 / 2;
            while !stop.load(Ordering::SeqCst) {
                if sent.load(Ordering::SeqCst) + PIECE as u64 > acked.load(Ordering::SeqCst) + window {
                    tokio::task::yield_now().await;
                    continue;
                }
                if sink.send(Message::Binary(frame.clone().into())).await.is_err() {
                    break;
                }
                sent.fetch_add(PIECE as u64, Ordering::SeqCst);
            }
        })
    };
    let cp = c.cps[0].proc.as_ref().unwrap();
    let count = |line: &str| cp.log().matches(line).count();
    let (waited, closed) = (
        count("relay session waits for a resume"),
        count("relay session closed"),
    );
    wait_until("the old connection to carry 2 MiB back", WAIT, || {
        (read.load(Ordering::SeqCst) >= 2 << 20).then_some(())
    })
    .unwrap();
    // What the client has: the resume goes on from there; what the old
    // reader gets after this is dropped (it is sent again).
    let from = read.load(Ordering::SeqCst);
    let a = try_resume(&c, &bearer, &id, &secret, from);
    assert_eq!(a.status, 101, "{}", a.head);
    let agent_received: u64 = a.header(resume::HEADER_RECEIVED).unwrap().parse().unwrap();
    let mut s = Session {
        id: id.clone(),
        secret: secret.clone(),
        ws: a.ws.unwrap(),
        received: from,
    };
    // The old connection's carrier ends, whichever way it learns of it:
    // as taken over, and not as the session's end nor as waiting.
    wait_until("the old connection's carrier to end", WAIT, || {
        let ends = count("relay session resumed on another connection")
            + count("relay session waits for a resume")
            + count("relay session closed");
        (ends > waited + closed).then_some(())
    })
    .unwrap_or_else(|e| panic!("{e}\n{}", cp.log()));
    stop.store(true, Ordering::SeqCst);
    rt().block_on(writer).unwrap();
    reader.abort();
    assert_eq!(count("relay session waits for a resume"), waited, "{}", cp.log());
    assert_eq!(count("relay session closed"), closed, "{}", cp.log());
    assert_eq!(ended_with(&c, &id), None, "the session did not end");
    // What the agent received and the client has not read comes back,
    // then what follows.
    rt().block_on(async {
        s.send_data(b"marker").await;
        let want = agent_received + 6 - from;
        let (mut got, mut tail) = (0u64, Vec::new());
        while got < want {
            let chunk = s.read_data(1).await;
            got += chunk.len() as u64;
            tail.extend_from_slice(&chunk);
            let keep = tail.len().saturating_sub(64);
            tail.drain(..keep);
            s.send(Frame::Ack(s.received)).await;
        }
        assert_eq!(got, want);
        assert!(tail.ends_with(b"marker"), "{tail:?}");
    });
    // And it resumes again.
    let received = s.received;
    drop(s.ws);
    let a = try_resume(&c, &bearer, &id, &secret, received);
    assert_eq!(a.status, 101, "{}", a.head);
    let mut s = Session {
        id: id.clone(),
        secret,
        ws: a.ws.unwrap(),
        received,
    };
    rt().block_on(async {
        s.send_data(b"again").await;
        assert_eq!(s.read_data(5).await, b"again");
    });
    assert_eq!(ended_with(&c, &id), None);
    eprintln!(
        "old connection's end: {}",
        if cp.log().contains("this one's end is not the session's") {
            "seen as its own (node or client), after the takeover"
        } else {
            "told it was taken over"
        }
    );
}
