//! Brokered access to VMs on host-local bridge networks through the control
//! plane's relay, end to end on the testbed: the client speaks WebSocket to
//! the CP, the CP mutual TLS to the agent that owns the bridge, the agent
//! dials the guest. Real clients in the host namespace — OpenSSH (`otherix
//! ssh`), `curl` through `otherix forward`, `otherix connect` — a Rust client
//! hashing streams, and raw requests for what the real client never sends.
//!
//! Every test builds its own world; everything is torn down on drop. Waits
//! use `wait_until`; nothing sleeps to assert (the expired ticket waits for
//! the clock, which is the point of that test).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use otherix_client::tunnel::{self as connect, relay as relay_tunnel, AnyTunnel, ConnectError};
use otherix_client::Client;
use otherix_proto::{relay, BrokerRequest, BrokerResponse, Transport};
use otherix_testbed::cluster::{Cluster, ClusterSpec, GATEWAY_PORT};
use otherix_testbed::tools::SshFiles;
use otherix_testbed::{wait_until, Proc, World};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;

mod common;

use common::flood;
use common::tunnels::{echo_stream, echo_through, forwarded, read_until_error, rt, wait_made_ready};
use common::BIN;
const WAIT: Duration = Duration::from_secs(60);

// ------------------------------------------------------------------ helpers

/// A CP and `hypervisors` nodes, no gateway unless `tweak` asks for one.
fn cluster(hint: &str, hypervisors: usize, tweak: impl FnOnce(&mut ClusterSpec)) -> Cluster {
    let world = World::new(hint).expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = hypervisors;
    spec.gateways = 0;
    tweak(&mut spec);
    Cluster::start(world, spec).expect("cluster starts")
}

/// Bridge network `lab` on node1.
fn bridge(c: &Cluster, subnet: &str) {
    c.cli_ok(&[
        "network", "create", "lab", "--type", "bridge", "--subnet", subnet, "--node", "node1",
    ])
    .unwrap();
}

/// `otherix vm create NAME --network lab --exec EXEC`, waited until running.
fn vm(c: &Cluster, name: &str, exec: &str) -> Value {
    c.cli_json(&["vm", "create", name, "--network", "lab", "--exec", exec])
        .unwrap();
    c.wait_vm_running(name, WAIT).unwrap()
}

fn s<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field].as_str().unwrap_or_else(|| panic!("no {field} in {v}"))
}

fn ca_pem(c: &Cluster) -> String {
    std::fs::read_to_string(c.ca_file()).unwrap()
}

/// The admin's API client.
fn admin(c: &Cluster) -> Client {
    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    Client::new(&c.url, &ca_pem(c), Some(token.trim().to_string())).unwrap()
}

fn try_broker(client: &Client, target: &str, port: u16) -> Result<BrokerResponse, String> {
    rt().block_on(client.broker(&BrokerRequest {
        target: target.into(),
        port: port.into(),
        exclude: Vec::new(),
    }))
    .map_err(|e| e.to_string())
}

fn broker(client: &Client, target: &str, port: u16) -> BrokerResponse {
    let grant = try_broker(client, target, port).unwrap_or_else(|e| panic!("broker {target}:{port}: {e}"));
    assert_eq!(
        grant.transport,
        Transport::Relay,
        "a bridge VM is relayed: {grant:?}"
    );
    grant
}

/// Presents a relay ticket to the CP.
fn present(c: &Cluster, ticket: &str) -> Result<AnyTunnel, ConnectError> {
    rt().block_on(relay_tunnel::open(&c.url, &ca_pem(c), ticket))
        .map(AnyTunnel::Relay)
}

fn refusal(r: Result<AnyTunnel, ConnectError>) -> (u16, String) {
    match r {
        Ok(_) => panic!("accepted a ticket that should be refused"),
        Err(ConnectError::Refused { status, reason }) => (status, reason),
        Err(e) => panic!("expected a refusal, got {e}"),
    }
}

/// Brokers and connects until `vm:port` answers: the node reports its relay
/// endpoint and the guest starts listening a moment after `running`.
fn wait_reachable(c: &Cluster, client: &Client, vm: &str, port: u16) {
    wait_until(
        &format!("{vm}:{port} to be reachable through the relay"),
        WAIT,
        || {
            let grant = try_broker(client, vm, port).ok()?;
            present(c, &grant.credential).ok().map(drop)
        },
    )
    .unwrap();
}

/// A node's relay endpoint, as granted (what the CP dials).
fn relay_endpoint(c: &Cluster, node: &str) -> String {
    let n = c.cli_json(&["node", "get", node]).unwrap();
    n["roles"]["relay"]
        .as_str()
        .unwrap_or_else(|| panic!("{node} reports no relay endpoint: {n}"))
        .to_string()
}

/// `otherix forward VM PORT` in the host namespace; returns it and its local address.
fn forward(c: &Cluster, vm: &str, port: u16) -> (Proc, SocketAddr) {
    c.forward(vm, port).expect("otherix forward listens")
}

/// `cmd` must succeed; its stdout.
fn run_ok(cmd: &mut Command) -> String {
    // A missing program fails here, naming its package, not as a timeout.
    otherix_testbed::tools::require_programs(&[cmd.get_program().to_str().unwrap_or_default()]);
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A guest workload that logs every connection to a file and answers with its
/// name: proof of whether anything ever reached it.
fn write_logger(dir: &Path) -> PathBuf {
    let script = dir.join("logger.py");
    std::fs::write(
        &script,
        "import socket, sys\n\
         port, name, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]\n\
         s = socket.socket()\n\
         s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('0.0.0.0', port))\n\
         s.listen(16)\n\
         open(log, 'a').write('listening\\n')\n\
         while True:\n\
         \x20   c, a = s.accept()\n\
         \x20   open(log, 'a').write('connection from %s\\n' % a[0])\n\
         \x20   c.settimeout(5)\n\
         \x20   try: c.recv(65536)\n\
         \x20   except OSError: pass\n\
         \x20   c.sendall(b'HTTP/1.0 200 OK\\r\\n\\r\\n' + name.encode() + b'\\n')\n\
         \x20   c.close()\n",
    )
    .unwrap();
    script
}

fn connections(log: &Path) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("connection from"))
        .count()
}

fn logger_vm(c: &Cluster, name: &str, port: u16) -> (Value, PathBuf) {
    let dir = c.world_dir().to_path_buf();
    let script = write_logger(&dir);
    let log = dir.join(format!("{name}.log"));
    otherix_testbed::tools::require_programs(&["python3"]);
    let exec = format!("python3 -u {} {port} {name} {}", script.display(), log.display());
    let v = vm(c, name, &exec);
    wait_until(&format!("{name} to listen"), WAIT, || {
        std::fs::read_to_string(&log)
            .ok()
            .filter(|t| t.contains("listening"))
            .map(drop)
    })
    .unwrap();
    (v, log)
}

/// Sends an HTTP/1.0 request through a tunnel, ends our side, returns the body.
fn http_through(mut t: AnyTunnel) -> String {
    rt().block_on(async {
        t.write_all(b"GET / HTTP/1.0\r\nHost: guest\r\n\r\n")
            .await
            .unwrap();
        t.shutdown().await.unwrap();
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(20), t.read_to_end(&mut out))
            .await
            .expect("answer within 20 s")
            .unwrap();
        body_of(&out)
    })
}

fn body_of(response: &[u8]) -> String {
    let text = String::from_utf8_lossy(response).to_string();
    text.split_once("\r\n\r\n")
        .map(|(_, b)| b.trim().to_string())
        .unwrap_or(text)
}

// -------------------------------------------------------------------- OpenSSH

#[test]
fn openssh_curl_and_connect_reach_bridge_vms_through_the_relay() {
    let c = cluster("relay-ssh", 1, |_| {});
    bridge(&c, "10.170.0.0/24");
    let files = SshFiles::new(c.world_dir());
    let sshvm = vm(&c, "sshvm", &files.sshd_exec());
    vm(&c, "web", "otherix guest http --port 8080");
    let admin = admin(&c);
    wait_reachable(&c, &admin, "sshvm", 22);
    wait_reachable(&c, &admin, "web", 8080);
    // Every node that can host bridge guests serves the relay on its VTEP.
    let node1_ip = c.node("node1").unwrap().ns.ip().to_string();
    assert_eq!(relay_endpoint(&c, "node1"), format!("{node1_ip}:7444"));

    // Real OpenSSH through `otherix ssh` (ProxyCommand `otherix connect`):
    // sshd sees the connection from node1's address on the bridge.
    let key = files.client_key.to_string_lossy().into_owned();
    let known = format!(
        "UserKnownHostsFile={}",
        c.world_dir().join("known_hosts").display()
    );
    let started = Instant::now();
    let out = c
        .cli(&[
            "ssh",
            "root@sshvm",
            "--",
            "-i",
            &key,
            "-o",
            "StrictHostKeyChecking=accept-new",
            "-o",
            &known,
            "-o",
            "BatchMode=yes",
            "echo $SSH_CONNECTION; echo hi",
        ])
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "otherix ssh failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("otherix ssh through the relay took {:?}", started.elapsed());
    let mut lines = stdout.lines();
    let conn: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(conn[0], "10.170.0.1", "from node1's bridge address: {conn:?}");
    assert_eq!(conn[2], s(&sshvm, "ip"));
    assert_eq!(conn[3], "22");
    assert_eq!(lines.next(), Some("hi"));

    // curl through `otherix forward`, twice: every connection is brokered anew.
    let (_fwd, local) = forward(&c, "web", 8080);
    for _ in 0..2 {
        let out = run_ok(Command::new("curl").args(["-sS", "--max-time", "20", &format!("http://{local}/")]));
        assert_eq!(out.trim(), "web");
    }

    // `otherix connect` with stdin ending right after the request: the
    // half-close reaches the guest and its answer still comes back.
    let mut child = Command::new(BIN)
        .args(["connect", "web", "8080"])
        .env("OTHERIX_CONFIG", &c.config)
        .env_remove("RUST_LOG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"GET / HTTP/1.0\r\n\r\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(body_of(&out.stdout), "web");
}

#[test]
fn one_mib_and_one_gib_each_way_through_the_relay_arrive_intact() {
    let c = cluster("relay-stream", 1, |_| {});
    bridge(&c, "10.171.0.0/24");
    vm(&c, "echo1", "otherix guest echo --port 7");
    wait_reachable(&c, &admin(&c), "echo1", 7);
    let (_fwd, local) = forward(&c, "echo1", 7);
    for len in [1u64 << 20, 1 << 30] {
        let started = Instant::now();
        let (sent, received, got) = echo_stream(local, len);
        eprintln!(
            "{len} bytes each way through the relay in {:?}",
            started.elapsed()
        );
        assert_eq!(got, len, "every byte came back");
        assert_eq!(sent, received, "and in order");
    }
}

// ---------------------------------------------------------------- refusals

#[test]
fn a_replayed_relay_ticket_is_refused_also_after_a_cp_restart() {
    let mut c = cluster("relay-replay", 1, |_| {});
    bridge(&c, "10.172.0.0/24");
    vm(&c, "echo1", "otherix guest echo --port 7");
    let admin = admin(&c);
    wait_reachable(&c, &admin, "echo1", 7);

    let grant = broker(&admin, "echo1", 7);
    let mut t = present(&c, &grant.credential).expect("first use");
    echo_through(&mut t, b"first\n");
    // While the first session is open, and after it ended: refused.
    let (status, reason) = refusal(present(&c, &grant.credential));
    assert_eq!(status, 409, "{reason}");
    assert!(reason.contains("already used"), "{reason}");
    drop(t);
    let (status, reason) = refusal(present(&c, &grant.credential));
    assert_eq!(status, 409, "{reason}");
    // The CP restarts within the ticket's life: it remembers the use.
    c.kill_cp().unwrap();
    c.start_cp().unwrap();
    let (status, reason) = wait_until("the restarted CP to answer", WAIT, || {
        match present(&c, &grant.credential) {
            Err(ConnectError::Refused { status, reason }) => Some((status, reason)),
            Ok(_) => panic!("a used ticket was accepted after a restart"),
            Err(_) => None,
        }
    })
    .unwrap();
    assert_eq!(status, 409, "{reason}");
    assert!(reason.contains("already used"), "{reason}");
}

#[test]
fn an_expired_relay_ticket_is_refused() {
    // Tickets live 1 s; the CP allows 30 s of clock skew on top
    // (otherix_core::credential::CLOCK_SKEW), so "expired" means 31 s old.
    let c = cluster("relay-expired", 1, |spec| {
        spec.extra_server_args = vec!["--credential-ttl".into(), "1s".into()];
    });
    bridge(&c, "10.173.0.0/24");
    vm(&c, "echo1", "otherix guest echo --port 7");
    let admin = admin(&c);
    wait_reachable(&c, &admin, "echo1", 7);

    let old = broker(&admin, "echo1", 7);
    let fresh = broker(&admin, "echo1", 7);
    let mut t = present(&c, &fresh.credential).expect("a ticket within its lifetime and the skew");
    echo_through(&mut t, b"in time\n");
    drop(t);
    let dead_at = old.expires_at + time::Duration::seconds(31);
    let wait = dead_at - time::OffsetDateTime::now_utc();
    if wait.is_positive() {
        std::thread::sleep(wait.unsigned_abs());
    }
    let (status, reason) = refusal(present(&c, &old.credential));
    assert_eq!(status, 401, "{reason}");
    assert!(reason.contains("expired"), "{reason}");
}

#[test]
fn a_gateway_credential_is_refused_by_the_relay_and_a_relay_ticket_by_a_gateway() {
    let c = cluster("relay-aud", 1, |spec| spec.gateways = 1);
    bridge(&c, "10.174.0.0/24");
    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.175.0.0/24",
    ])
    .unwrap();
    c.cli_json(&[
        "vm",
        "create",
        "ovecho",
        "--network",
        "ov",
        "--exec",
        "otherix guest echo --port 7",
    ])
    .unwrap();
    c.wait_vm_running("ovecho", WAIT).unwrap();
    vm(&c, "echo1", "otherix guest echo --port 7");
    let admin = admin(&c);
    wait_reachable(&c, &admin, "echo1", 7);
    wait_until("the gateway to reach ovecho", WAIT, || {
        let g = try_broker(&admin, "ovecho", 7).ok()?;
        rt().block_on(connect::open(&g.endpoint, &ca_pem(&c), &g.credential))
            .ok()
            .map(drop)
    })
    .unwrap();

    // A gateway credential (aud = gw1) presented to the relay: wrong audience.
    let gw = try_broker(&admin, "ovecho", 7).unwrap();
    assert_eq!(gw.transport, Transport::Gateway);
    let (status, reason) = refusal(present(&c, &gw.credential));
    assert_eq!(status, 403, "{reason}");
    assert!(reason.contains("gw1"), "the refusal names the audience: {reason}");
    // Not spent by that refusal: still good at its own gateway.
    let mut t = rt()
        .block_on(connect::open(&gw.endpoint, &ca_pem(&c), &gw.credential))
        .map(AnyTunnel::Gateway)
        .expect("accepted by its gateway");
    echo_through(&mut t, b"right place\n");

    // A relay ticket (aud = the control plane) presented to the gateway.
    let ticket = broker(&admin, "echo1", 7);
    let gw_endpoint = format!("https://{}:{GATEWAY_PORT}", c.node("gw1").unwrap().ns.ip());
    match rt().block_on(connect::open(&gw_endpoint, &ca_pem(&c), &ticket.credential)) {
        Err(ConnectError::Refused { status, reason }) => {
            assert_eq!(status, 403, "{reason}");
            assert!(reason.contains(relay::AUDIENCE), "{reason}");
        }
        other => panic!("the gateway accepted a relay ticket: {:?}", other.map(drop)),
    }
    let mut t = present(&c, &ticket.credential).expect("and the relay still takes it");
    echo_through(&mut t, b"relayed\n");
}

/// A TLS client of an agent's relay endpoint presenting `identity` (PEM
/// cert, key) or nothing; the request line sent and whatever comes back
/// (an `Err` when the handshake or the first read fails).
fn call_agent_relay(
    c: &Cluster,
    endpoint: &str,
    node: &str,
    identity: Option<(&str, &str)>,
    line: &str,
) -> Result<String, String> {
    let ca = otherix_tls::cert_from_pem(&ca_pem(c)).unwrap();
    let config = match identity {
        Some((cert, key)) => otherix_tls::pinned_client_config_with_identity(ca, cert, key).unwrap(),
        None => otherix_tls::pinned_client_config(ca).unwrap(),
    };
    let addr: SocketAddr = endpoint.parse().unwrap();
    rt().block_on(async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let name = rustls::pki_types::ServerName::try_from(node.to_string()).unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tls.write_all(line.as_bytes()).await.map_err(|e| e.to_string())?;
        tls.flush().await.map_err(|e| e.to_string())?;
        let mut got = Vec::new();
        match tokio::time::timeout(Duration::from_secs(15), tls.read_to_end(&mut got)).await {
            Err(_) => Err("no answer".into()),
            Ok(Err(e)) if got.is_empty() => Err(e.to_string()),
            Ok(_) => Ok(String::from_utf8_lossy(&got).into_owned()),
        }
    })
}

/// A cluster of one hypervisor whose agent serves `/metrics` on port
/// [`AGENT_METRICS`] of its namespace, with `agent_args`.
fn cluster_with_agent_args(hint: &str, agent_args: impl FnOnce(&World) -> Vec<String>) -> Cluster {
    let world = World::new(hint).expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    spec.gateways = 0;
    spec.extra_agent_args = vec!["--metrics-listen".into(), format!("0.0.0.0:{AGENT_METRICS}")];
    spec.extra_agent_args.extend(agent_args(&world));
    Cluster::start(world, spec).expect("cluster starts")
}

/// Where agents of [`cluster_with_agent_args`] serve `/metrics`.
const AGENT_METRICS: u16 = 9465;

/// Waits until node1's agent counts at least `n` relay connections refused
/// for `reason`.
fn wait_relay_refused(c: &Cluster, reason: &str, n: f64) {
    let metrics = SocketAddr::from((c.node("node1").unwrap().ns.ip(), AGENT_METRICS));
    wait_until(&format!("{n} relay connections refused: {reason}"), WAIT, || {
        let m = flood::scrape(metrics)?;
        (flood::ingress_refused(&m, "relay", reason) >= n).then_some(())
    })
    .unwrap();
}

#[test]
fn only_the_control_plane_may_call_an_agents_relay_endpoint() {
    // The test's own address is let through to the TLS handshake, so that
    // the certificate checks behind the source check are what refuse.
    let c = cluster_with_agent_args("relay-mtls", |w| {
        vec![
            "--relay-allow-from".into(),
            w.host_ip().to_string(),
            "--handshake-timeout".into(),
            "2s".into(),
        ]
    });
    bridge(&c, "10.176.0.0/24");
    let (trap, trap_log) = logger_vm(&c, "trap", 8080);
    let admin = admin(&c);
    let endpoint = wait_until("node1 to report its relay endpoint", WAIT, || {
        let n = c.cli_json(&["node", "get", "node1"]).ok()?;
        n["roles"]["relay"].as_str().map(str::to_string)
    })
    .unwrap();
    wait_until("node1's relay to listen", WAIT, || {
        c.node("node1")
            .unwrap()
            .agent
            .as_ref()
            .unwrap()
            .log()
            .contains("relay listening")
            .then_some(())
    })
    .unwrap();
    let line = relay::request_line(s(&trap, "id"), 8080);

    // The node's own certificate: same cluster CA, ClientAuth, but it names a
    // node, not the control plane.
    let dir = &c.node("node1").unwrap().data_dir;
    let cert = std::fs::read_to_string(dir.join("node.crt")).unwrap();
    let key = std::fs::read_to_string(dir.join("node.key")).unwrap();
    let err = call_agent_relay(&c, &endpoint, "node1", Some((&cert, &key)), &line)
        .expect_err("a node certificate was let in");
    eprintln!("node certificate: {err}");
    // No certificate.
    let err = call_agent_relay(&c, &endpoint, "node1", None, &line).expect_err("no certificate was let in");
    eprintln!("no certificate: {err}");
    // A certificate that names the control plane, from another CA.
    let key_pair = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec![relay::CP_CLIENT_NAME.to_string()]).unwrap();
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let forged = params.self_signed(&key_pair).unwrap();
    let err = call_agent_relay(
        &c,
        &endpoint,
        "node1",
        Some((&forged.pem(), &key_pair.serialize_pem())),
        &line,
    )
    .expect_err("a self-made control-plane certificate was let in");
    eprintln!("forged certificate: {err}");

    assert_eq!(connections(&trap_log), 0, "a non-CP caller reached the guest");
    // Through the CP, the same target answers.
    let grant = broker(&admin, "trap", 8080);
    assert_eq!(http_through(present(&c, &grant.credential).unwrap()), "trap");
    assert_eq!(connections(&trap_log), 1);

    // A handshake begun and never finished is cut at its deadline (2 s),
    // long before the request's (10 s), and counted.
    let endpoint: SocketAddr = endpoint.parse().unwrap();
    let mut stalled = flood::half_open(c.world.host_ip(), endpoint, 1);
    assert!(
        flood::closed_unanswered(&mut stalled[0]),
        "a stalled handshake was answered"
    );
    wait_relay_refused(&c, "handshake_timeout", 1.0);
}

#[test]
fn a_caller_from_no_control_planes_address_is_closed_before_its_handshake_and_a_flood_of_them_keeps_no_cp_out(
) {
    // Twenty slots: a stranger's forty half-open handshakes would fill them
    // all if they were let in.
    let c = cluster_with_agent_args("relay-flood", |_| {
        vec!["--relay-max-connections".into(), "20".into()]
    });
    bridge(&c, "10.179.0.0/24");
    let (_trap, trap_log) = logger_vm(&c, "trap", 8080);
    let admin = admin(&c);
    wait_reachable(&c, &admin, "trap", 8080);
    // The probe's session reached the guest: counted once its line is
    // written (the guest logs after the answer has gone out).
    let seen = wait_until("the probe's connection in the guest's log", WAIT, || {
        let n = connections(&trap_log);
        (n >= 1).then_some(n)
    })
    .unwrap();
    let endpoint: SocketAddr = relay_endpoint(&c, "node1").parse().unwrap();

    // Closed before the handshake: not one byte answered (the ingress
    // tests show the control plane's own certificate does not help either).
    let stranger = flood::HostAddr::add(&c.world, 200);
    let mut flood = flood::half_open(stranger.ip, endpoint, 40);
    for s in &mut flood {
        assert!(
            flood::closed_unanswered(s),
            "a stranger's connection was answered"
        );
    }
    wait_relay_refused(&c, "not_control_plane", 40.0);

    // Held by the stranger all along, they take no slot: the control
    // plane's dials still go through.
    for _ in 0..3 {
        let grant = broker(&admin, "trap", 8080);
        assert_eq!(http_through(present(&c, &grant.credential).unwrap()), "trap");
    }
    wait_until("the CP's three sessions in the guest's log", WAIT, || {
        (connections(&trap_log) >= seen + 3).then_some(())
    })
    .unwrap();
    assert_eq!(
        connections(&trap_log),
        seen + 3,
        "only the CP's sessions reached the guest"
    );
    let log = c.node("node1").unwrap().agent.as_ref().unwrap().log();
    assert!(
        log.contains("relay connection refused before its handshake was done")
            && log.contains("not_control_plane"),
        "the refusal is logged"
    );
    drop(flood);
}

#[test]
fn the_cp_refuses_to_relay_through_an_agent_whose_certificate_names_another_node() {
    let c = cluster("relay-name", 2, |_| {});
    bridge(&c, "10.177.0.0/24");
    let (_trap, trap_log) = logger_vm(&c, "trap", 8080);
    let admin = admin(&c);
    wait_reachable(&c, &admin, "trap", 8080);
    // A full answer: the logger has logged every connection made so far.
    let grant = broker(&admin, "trap", 8080);
    assert_eq!(http_through(present(&c, &grant.credential).unwrap()), "trap");
    let seen = connections(&trap_log);

    // node1 cannot point the CP elsewhere by what it says (the endpoint is
    // the CP's: by default its VTEP, port 7444). An admin's mistake can:
    // node1's relay endpoint set to node2's. The CP dials node2, whose
    // certificate is node2's relay certificate, not node1's.
    let node2_relay = relay_endpoint(&c, "node2");
    let own = relay_endpoint(&c, "node1");
    c.cli_ok(&["node", "update", "node1", "--relay", &node2_relay])
        .unwrap();
    assert_eq!(relay_endpoint(&c, "node1"), node2_relay);
    let grant = broker(&admin, "trap", 8080);
    let (status, reason) = refusal(present(&c, &grant.credential));
    eprintln!("misdirected relay endpoint: {status} {reason}");
    assert_eq!(status, 502, "{reason}");
    assert!(reason.contains("node1") && reason.contains("TLS"), "{reason}");
    assert_eq!(connections(&trap_log), seen, "nothing reached the guest");

    // Its own endpoint again: relayed.
    c.cli_ok(&["node", "update", "node1", "--relay", "auto"]).unwrap();
    assert_eq!(relay_endpoint(&c, "node1"), own);
    wait_reachable(&c, &admin, "trap", 8080);
}

/// A raw TLS connection to the CP's relay, for requests the real client
/// never sends: the status, the head, and on 101 the WebSocket.
struct Raw {
    status: u16,
    head: String,
    ws: Option<tokio_tungstenite::WebSocketStream<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>>,
}

fn raw_relay(c: &Cluster, path: &str, host: &str, ticket: &str, extra: &str) -> Raw {
    let addr: SocketAddr = c.url.trim_start_matches("https://").parse().unwrap();
    let ca = otherix_tls::cert_from_pem(&ca_pem(c)).unwrap();
    let mut config = otherix_tls::pinned_client_config(ca).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let head = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ticket}\r\nConnection: Upgrade\r\n\
         Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n{extra}\r\n"
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
        let head = String::from_utf8_lossy(&got).to_string();
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        let ws = if status == 101 {
            Some(tokio_tungstenite::WebSocketStream::from_raw_socket(stream, Role::Client, None).await)
        } else {
            None
        };
        Raw { status, head, ws }
    })
}

/// An HTTP/1.0 GET over a raw relay WebSocket: request, end of stream (an
/// empty frame), then the body of what comes back.
fn http_over_ws(raw: Raw) -> String {
    let mut ws = raw.ws.expect("upgraded");
    rt().block_on(async {
        ws.send(Message::Binary(b"GET / HTTP/1.0\r\n\r\n".to_vec().into()))
            .await
            .unwrap();
        ws.send(Message::Binary(Vec::new().into())).await.unwrap();
        let mut out = Vec::new();
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(20), ws.next())
                .await
                .expect("frames within 20 s");
            match msg {
                Some(Ok(Message::Binary(b))) if b.is_empty() => break,
                Some(Ok(Message::Binary(b))) => out.extend_from_slice(&b),
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => {}
                Some(Err(e)) => panic!("{e}"),
            }
        }
        body_of(&out)
    })
}

#[test]
fn a_target_smuggled_in_the_url_query_or_headers_is_never_dialed() {
    let c = cluster("relay-smuggle", 1, |_| {});
    bridge(&c, "10.178.0.0/24");
    let (trap, trap_log) = logger_vm(&c, "trap", 8080);
    vm(&c, "web", "otherix guest http --port 8080");
    let admin = admin(&c);
    wait_reachable(&c, &admin, "web", 8080);
    let (trap_ip, trap_id) = (s(&trap, "ip"), s(&trap, "id"));

    // Host, query and every header naming the trap: the session still goes
    // to what the ticket names.
    let extra = format!(
        "X-Forwarded-Host: {trap_ip}:8080\r\nForwarded: host={trap_ip}:8080\r\nX-Otherix-Target: trap\r\n\
         X-Otherix-Vm: {trap_id}\r\nX-Otherix-Ip: {trap_ip}\r\nX-Otherix-Port: 8080\r\n"
    );
    for path in [
        relay::PATH.to_string(),
        format!("{}?vm=trap&vm_id={trap_id}&ip={trap_ip}&port=8080", relay::PATH),
    ] {
        let grant = broker(&admin, "web", 8080);
        let raw = raw_relay(&c, &path, &format!("{trap_ip}:8080"), &grant.credential, &extra);
        assert_eq!(raw.status, 101, "{path}: {}", raw.head);
        assert_eq!(http_over_ws(raw), "web", "{path}");
    }
    // Another path naming the trap is no relay at all.
    for path in [
        format!("{}/trap", relay::PATH),
        format!("{}/{trap_ip}:8080", relay::PATH),
    ] {
        let grant = broker(&admin, "web", 8080);
        let raw = raw_relay(&c, &path, "cp", &grant.credential, "");
        assert_eq!(raw.status, 404, "{path}: {}", raw.head);
    }

    assert_eq!(connections(&trap_log), 0, "a smuggled target was dialed");
    let grant = broker(&admin, "trap", 8080);
    assert_eq!(http_through(present(&c, &grant.credential).unwrap()), "trap");
    assert_eq!(connections(&trap_log), 1);
}

// ------------------------------------------------------ endings and restarts

/// Waits (at most 30 s) for `child` to exit; its status, stderr and how long.
fn exit_of(mut child: std::process::Child) -> (std::process::ExitStatus, String, Duration) {
    let started = Instant::now();
    let status = wait_until("otherix connect to exit", Duration::from_secs(30), || {
        child.try_wait().unwrap()
    })
    .expect("otherix connect hung instead of failing");
    let mut stderr = String::new();
    child.stderr.take().unwrap().read_to_string(&mut stderr).unwrap();
    (status, stderr, started.elapsed())
}

#[test]
fn agent_or_control_plane_restarts_end_plain_relay_sessions_with_an_error_and_resumable_ones_resume() {
    let mut c = cluster("relay-restart", 1, |_| {});
    bridge(&c, "10.179.0.0/24");
    vm(&c, "echo1", "otherix guest echo --port 7");
    let admin = admin(&c);
    wait_reachable(&c, &admin, "echo1", 7);

    // The agent killed mid-stream: the CP tells the client which node went away.
    let grant = broker(&admin, "echo1", 7);
    let mut t = present(&c, &grant.credential).unwrap();
    echo_through(&mut t, b"before the agent dies\n");
    c.kill_agent("node1").unwrap();
    let (err, took) = read_until_error(&mut t);
    eprintln!("agent killed: the client saw {err:?} after {took:?}");
    assert!(err.to_string().contains("node node1"), "{err}");
    c.start_agent("node1").unwrap();
    c.wait_ready(WAIT).unwrap();
    wait_reachable(&c, &admin, "echo1", 7);

    // The CP killed mid-stream: a plain relay session (the library's plain
    // tunnel, what a WebSocket client that does not ask to resume gets)
    // fails fast; the CLI's resumable one goes on once the CP is back.
    let mut child = common::tunnels::connect_process(&c.config, "echo1", 7);
    let grant = broker(&admin, "echo1", 7);
    let mut t = present(&c, &grant.credential).unwrap();
    echo_through(&mut t, b"before the control plane dies\n");
    c.kill_cp().unwrap();
    let (err, took) = read_until_error(&mut t);
    eprintln!("control plane killed: the client saw {err:?} after {took:?}");
    assert!(err.to_string().contains("relay"), "{err}");
    c.start_cp().unwrap();
    {
        use std::io::BufRead;
        child
            .stdin
            .as_mut()
            .unwrap()
            .write_all(b"after the restart\n")
            .unwrap();
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, "after the restart\n", "the CLI's session resumed");
    }
    drop(child.stdin.take());
    let (status, stderr, took) = exit_of(child);
    eprintln!("control plane restarted: otherix connect exited {status} after {took:?}: {stderr}");
    assert!(status.success(), "{stderr}");
    assert!(stderr.contains("relay: resumed"), "{stderr}");

    // After a restart, new sessions work.
    c.wait_ready(WAIT).unwrap();
    wait_reachable(&c, &admin, "echo1", 7);
    let grant = broker(&admin, "echo1", 7);
    let mut t = present(&c, &grant.credential).unwrap();
    echo_through(&mut t, b"after the restart\n");

    // A CP stopped with SIGTERM says so before its connections drain.
    let cp = c.cps[0].proc.take().unwrap();
    let stopping = std::thread::spawn(move || cp.terminate(Duration::from_secs(30)));
    let (err, took) = read_until_error(&mut t);
    eprintln!("control plane stopped: the client saw {err:?} after {took:?}");
    assert!(err.to_string().contains("control plane shutting down"), "{err}");
    stopping.join().unwrap().unwrap();
}

// ------------------------------------------------------------------- scale

/// VmRSS of `pid` in KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

#[test]
fn fifty_concurrent_relay_sessions_carry_their_payloads_and_cp_memory_stays_bounded() {
    const SESSIONS: usize = 50;
    const PAYLOAD: usize = 4 << 20;
    let c = cluster("relay-fifty", 1, |_| {});
    bridge(&c, "10.180.0.0/24");
    vm(&c, "echo1", "otherix guest echo --port 7");
    let admin = admin(&c);
    wait_reachable(&c, &admin, "echo1", 7);
    let cp = c.cp().unwrap().pid();
    assert!(
        std::fs::read_to_string(format!("/proc/{cp}/comm"))
            .unwrap()
            .starts_with("otherix"),
        "the pid is the control plane's own"
    );
    let before = rss_kib(cp);

    // Sample the CP's RSS while the sessions run.
    let peak = Arc::new(AtomicU64::new(before));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kib(cp), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };

    let grants: Vec<BrokerResponse> = (0..SESSIONS).map(|_| broker(&admin, "echo1", 7)).collect();
    let (url, ca) = (c.url.clone(), ca_pem(&c));
    let started = Instant::now();
    let results = rt().block_on(async {
        let mut tasks = Vec::new();
        for (i, grant) in grants.into_iter().enumerate() {
            let (url, ca) = (url.clone(), ca.clone());
            tasks.push(tokio::spawn(async move {
                let t = connect::open_brokered(&grant, &url, &ca)
                    .await
                    .map_err(|e| e.to_string())?;
                let (mut rd, mut wr) = tokio::io::split(t);
                // A payload of its own per session: a crossed stream shows.
                let payload: Vec<u8> = (0..PAYLOAD).map(|j| (j * 31 + i * 7 + j / 4099) as u8).collect();
                let want = hex::encode(Sha256::digest(&payload));
                let writer = tokio::spawn(async move {
                    for chunk in payload.chunks(64 << 10) {
                        wr.write_all(chunk).await?;
                    }
                    wr.shutdown().await?;
                    Ok::<_, std::io::Error>(())
                });
                let mut got = Vec::with_capacity(PAYLOAD);
                rd.read_to_end(&mut got).await.map_err(|e| e.to_string())?;
                writer.await.unwrap().map_err(|e| e.to_string())?;
                Ok::<_, String>((want, hex::encode(Sha256::digest(&got)), got.len()))
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    });
    let took = started.elapsed();
    done.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    for (i, r) in results.iter().enumerate() {
        let (want, got, len) = r.as_ref().unwrap_or_else(|e| panic!("session {i}: {e}"));
        assert_eq!(*len, PAYLOAD, "session {i} got every byte back");
        assert_eq!(want, got, "session {i} got its own bytes back, in order");
    }
    let peak = peak.load(Ordering::Relaxed);
    let after = rss_kib(cp);
    eprintln!(
        "{SESSIONS} concurrent relay sessions, {} MiB each way each, in {took:?}; CP RSS before {} MiB, peak {} MiB, after {} MiB",
        PAYLOAD >> 20,
        before / 1024,
        peak / 1024,
        after / 1024
    );
    // Per session the CP holds a 64 KiB buffer, one frame in flight each way
    // and two TLS connections: well under 1 MiB. 64 MiB of growth would mean
    // it buffers whole streams.
    assert!(
        peak.saturating_sub(before) < 64 * 1024,
        "CP RSS grew from {before} KiB to {peak} KiB for {SESSIONS} sessions"
    );
}

#[test]
fn a_relay_session_ends_at_its_maximum_lifetime_with_a_clear_reason() {
    let c = cluster("relay-maxlife", 1, |spec| {
        spec.extra_server_args = vec!["--max-session".into(), "2s".into()];
    });
    bridge(&c, "10.179.0.0/24");
    vm(&c, "echo1", "otherix guest echo --port 7");
    let admin = admin(&c);
    wait_reachable(&c, &admin, "echo1", 7);
    let grant = broker(&admin, "echo1", 7);
    let mut t = present(&c, &grant.credential).expect("relayed");
    let started = Instant::now();
    // Busy all the while; the session still ends at 2 s.
    let err = rt().block_on(async {
        let mut buf = [0u8; 6];
        loop {
            if let Err(e) = t.write_all(b"tick\n\n").await {
                return e.to_string();
            }
            match tokio::time::timeout(Duration::from_secs(5), t.read_exact(&mut buf)).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return e.to_string(),
                Err(_) => return "no answer".to_string(),
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the session outlived --max-session"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    assert!(
        started.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        started.elapsed()
    );
    assert!(err.contains("maximum lifetime"), "{err}");
    // Audited with the reason (written as the session's last act).
    wait_until("the session's end in the audit trail", WAIT, || {
        let audit = c.cli_json(&["audit", "--since", "10m"]).ok()?;
        audit
            .as_array()?
            .iter()
            .any(|e| e["action"] == "session_end" && e["reason"] == "max_lifetime")
            .then_some(())
    })
    .unwrap();
}

#[test]
fn forward_keeps_relay_connections_ready_and_replaces_one_the_control_plane_closed() {
    let mut c = cluster("relay-ready", 1, |_| {});
    bridge(&c, "10.178.0.0/24");
    vm(&c, "web", "otherix guest http --port 8080");
    wait_reachable(&c, &admin(&c), "web", 8080);
    let curl = |local: SocketAddr| {
        run_ok(Command::new("curl").args(["-sS", "--max-time", "20", &format!("http://{local}/")]))
    };

    // Ready relay connections: a ticket and TLS to the control plane, each
    // used by one connection.
    let (fwd, local) = c.forward_with("web", 8080, &["--ready-keep", "9s"]).unwrap();
    wait_made_ready(&fwd, 1);
    assert_eq!(curl(local).trim(), "web");
    wait_made_ready(&fwd, 5);
    for _ in 0..3 {
        assert_eq!(curl(local).trim(), "web");
    }
    let lines = forwarded(&fwd);
    assert_eq!(lines.len(), 4, "{}", fwd.log());
    assert!(lines.iter().all(|l| l.contains("ready=true")), "{lines:#?}");

    // The control plane restarts: the ready connections' TLS sessions to it
    // are gone. The next connection tries one, brokers anew, goes through.
    c.kill_cp().unwrap();
    c.start_cp().unwrap();
    wait_reachable(&c, &admin(&c), "web", 8080);
    assert_eq!(curl(local).trim(), "web", "{}", fwd.log());
    let log = fwd.log();
    assert!(
        log.contains("a ready connection was refused; brokering anew"),
        "the dead one was tried, then replaced: {log}"
    );
    assert!(forwarded(&fwd)[4].contains("ready=false"), "{log}");

    // With --ready 0 every connection brokers and connects when it comes.
    let (off, local) = c.forward_with("web", 8080, &["--ready", "0"]).unwrap();
    assert_eq!(curl(local).trim(), "web");
    let lines = forwarded(&off);
    assert_eq!(lines.len(), 1, "{}", off.log());
    assert!(lines[0].contains("ready=false"), "{lines:#?}");
    assert!(!off.log().contains("connection made ready"), "{}", off.log());
}

/// The control plane's "relay session open" lines that say `ready={ready}`.
fn relay_sessions(c: &Cluster, ready: bool) -> usize {
    let needle = format!("ready={ready}");
    c.cp()
        .unwrap()
        .log()
        .lines()
        .filter(|l| l.contains("relay session open") && l.contains(&needle))
        .count()
}

/// One relay session to `vm`'s echo port: brokered, presented, one line echoed.
fn relay_echo(c: &Cluster, admin: &Client, vm: &str) {
    let grant = broker(admin, vm, 7);
    let mut t = present(c, &grant.credential).expect("a relay session");
    echo_through(&mut t, b"ping\n");
}

/// One node, echo1 on its bridge reachable through the relay, the control
/// plane started with `--relay-ready-keep keep`; and the admin's client.
fn echo_cluster_keeping(hint: &str, keep: &str) -> (Cluster, Client) {
    let c = cluster(hint, 1, |s| {
        s.extra_server_args = vec!["--relay-ready-keep".into(), keep.into()];
    });
    bridge(&c, "10.179.0.0/24");
    vm(&c, "echo1", "otherix guest echo --port 7");
    let client = admin(&c);
    wait_reachable(&c, &client, "echo1", 7);
    (c, client)
}

#[test]
fn the_control_plane_keeps_a_connection_to_the_node_ready_for_its_next_relay_session() {
    let (mut c, client) = echo_cluster_keeping("relay-cp-ready", "9s");

    // After a session to node1 the CP has the next one's connection made;
    // sessions one after the other each find one ready.
    for i in 1..=3 {
        let before = relay_sessions(&c, true);
        wait_until("a connection to node1 made ready", WAIT, || {
            c.cp()
                .unwrap()
                .log()
                .matches("relay connection to the node made ready")
                .count()
                .ge(&(before + 1))
                .then_some(())
        })
        .unwrap();
        relay_echo(&c, &client, "echo1");
        assert_eq!(
            relay_sessions(&c, true),
            before + 1,
            "session {i}: {}",
            c.cp().unwrap().log()
        );
    }

    // The agent restarts: the ready connection is dead. The next session
    // tries it, finds it closed, dials anew and goes through; what the
    // client sees is never the dead connection.
    let ready_before = relay_sessions(&c, true);
    let made = Instant::now();
    c.kill_agent("node1").unwrap();
    c.start_agent("node1").unwrap();
    let agent = c.node("node1").unwrap().agent.as_ref().unwrap();
    agent.wait_for_log("relay listening", WAIT).unwrap();
    wait_until("a relay session after the agent's restart", WAIT, || {
        let grant = broker(&client, "echo1", 7);
        match present(&c, &grant.credential) {
            Ok(mut t) => {
                echo_through(&mut t, b"again\n");
                Some(())
            }
            Err(ConnectError::Refused { reason, .. }) => {
                // Until it knows its guest again; never the dead connection.
                assert!(!reason.contains("relay endpoint:"), "{reason}");
                None
            }
            Err(e) => panic!("{e}"),
        }
    })
    .unwrap();
    let log = c.cp().unwrap().log();
    assert!(
        log.contains("a ready relay connection was closed; dialing anew"),
        "the restart took {:?} (the keep is 9 s): {log}",
        made.elapsed()
    );
    assert_eq!(relay_sessions(&c, true), ready_before, "{log}");

    // With --relay-ready-keep 0s the control plane keeps none.
    let (mut off, off_admin) = echo_cluster_keeping("relay-cp-ready-off", "0s");
    relay_echo(&off, &off_admin, "echo1");
    let log = off.cp().unwrap().log();
    assert!(!log.contains("made ready"), "{log}");
    assert!(
        relay_sessions(&off, true) == 0 && relay_sessions(&off, false) >= 2,
        "{log}"
    );
    // (A keep past the agents' request timeout is refused in one line.)
    let out = Command::new(BIN)
        .args(["server", "--relay-ready-keep", "30s", "--data-dir"])
        .arg(off.world_dir().join("never"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("at most 9s"),
        "{out:?}"
    );
    drop(off.kill_cp());
}
