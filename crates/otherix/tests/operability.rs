//! What an operator sees of a control plane: `/metrics`, `/healthz` and
//! `/readyz` on `--metrics-listen`, the public `/healthz` and `/readyz`, and
//! JSON log lines, against a real `otherix server`.

mod common;

use std::io::Read;
use std::net::{SocketAddr, TcpStream};

use common::fake_node::{beat, enroll_as};
use common::{curl, free_port, http_get as get, sample, Cp, TempDir};

#[test]
fn the_control_plane_serves_metrics_health_and_json_logs() {
    let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let cp = Cp::start_with(
        TempDir::new("cp"),
        &["--metrics-listen", &addr.to_string(), "--log-format", "json"],
    );
    assert_eq!(get(addr, "/healthz"), (200, "ok\n".into()));
    assert_eq!(get(addr, "/readyz"), (200, "ready\n".into()));
    // The public port answers the probes too, without a token.
    let (status, body) = curl(&cp, &[&format!("{}/readyz", cp.url)]);
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    assert_eq!(curl(&cp, &[&format!("{}/healthz", cp.url)]).0, 200);

    let (_, before) = get(addr, "/metrics");
    for name in [
        "otherix_broker_decisions_total",
        "otherix_credentials_minted_total",
        "otherix_heartbeats_total",
        "otherix_relay_bytes_total",
        "otherix_nodes",
        "otherix_sessions_open",
    ] {
        assert!(
            before.contains(&format!("# TYPE {name} ")),
            "{name} missing:\n{before}"
        );
    }

    // A refusal and a heartbeat move their counters.
    let admin = cp.admin();
    admin.fails(&["connect", "nosuchvm", "22"]);
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    let (_, after) = get(addr, "/metrics");
    assert_eq!(
        sample(
            &after,
            "otherix_broker_decisions_total{outcome=\"refused\",reason=\"not_found\"}"
        ),
        Some(1.0),
        "{after}"
    );
    assert_eq!(
        sample(&after, "otherix_heartbeats_total{result=\"ok\"}"),
        Some(1.0),
        "{after}"
    );
    assert_eq!(
        sample(&after, "otherix_nodes{status=\"Ready\"}"),
        Some(1.0),
        "{after}"
    );
    assert!(
        after.contains("otherix_broker_duration_seconds_bucket"),
        "{after}"
    );
    assert!(
        after.contains("otherix_heartbeat_duration_seconds_count"),
        "{after}"
    );
    assert!(
        after.contains("otherix_desired_state_duration_seconds_count"),
        "{after}"
    );

    // Info by default, one JSON object per line, no secret.
    let log = cp.log();
    let token = common::admin_token(&cp);
    assert!(!log.contains(&token), "the admin token reached the log");
    let mut infos = 0;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not a JSON log line ({e}): {line}"));
        if v["level"] == "INFO" {
            infos += 1;
        }
    }
    assert!(infos > 0, "no info lines:\n{log}");
}

#[test]
fn an_oversized_target_is_refused_and_its_audit_row_stays_bounded() {
    let cp = Cp::start();
    let client = otherix_client::Client::new(&cp.url, &cp.ca_pem(), Some(common::admin_token(&cp))).unwrap();
    let huge = "x".repeat(60_000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt
        .block_on(client.broker(&otherix_proto::BrokerRequest {
            target: huge,
            port: 22,
            exclude: vec![],
        }))
        .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(
        err.to_string().len() < 300,
        "the refusal echoes the whole target: {err}"
    );
    // Logged at info with its reason, and answered with its path (the
    // broker's span is at debug), both written before the answer.
    let log = cp.log();
    assert!(
        log.lines()
            .any(|l| l.contains("broker refused") && l.contains("reason=invalid target")),
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("answered") && l.contains("path=/v1/broker") && l.contains("status=400")),
        "{log}"
    );
    let events = cp.admin().json(&["audit", "--since", "1h"]);
    let broker: Vec<&serde_json::Value> = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["action"] == "broker")
        .collect();
    assert_eq!(broker.len(), 1, "{events}");
    let target = broker[0]["target"].as_str().unwrap();
    assert!(
        target.len() < 100 && target.ends_with("(60000 bytes)"),
        "{target}"
    );
    assert_eq!(broker[0]["allowed"], false);
}

#[test]
fn the_control_plane_raises_its_open_files_limit_to_the_hard_one() {
    otherix_testbed::tools::require_programs(&["prlimit"]);
    let dir = TempDir::new("nofile");
    let mut child = std::process::Command::new("prlimit")
        .args([
            "--nofile=512:4096",
            common::BIN,
            "server",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
        ])
        .arg(dir.path().join("data"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The banner means the start is past the raise.
    let mut banner = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    while std::io::BufRead::read_line(&mut banner, &mut line).unwrap() > 0 && !line.contains("log in with") {
        line.clear();
    }
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let open_files = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let fields: Vec<&str> = open_files.split_whitespace().collect();
    assert_eq!(&fields[3..5], ["4096", "4096"], "{open_files}");
}

#[test]
fn a_principal_over_its_broker_rate_gets_429_with_retry_after_and_others_do_not() {
    let cp = Cp::start_with(TempDir::new("cp"), &["--broker-rate", "1", "--broker-burst", "3"]);
    let admin = cp.admin();
    admin.ok(&["user", "create", "bob", "--role", "user"]);
    let bob_token = admin.ok(&["user", "token", "create", "bob"]).trim().to_string();
    let token = common::admin_token(&cp);
    let call = |token: &str| {
        curl(
            &cp,
            &[
                "-i",
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
    };
    // The burst: three calls are decided (the VM does not exist).
    for _ in 0..3 {
        let (status, body) = call(&token);
        assert_eq!(status, 404, "{body}");
    }
    // Then the rate.
    let mut limited = 0;
    for _ in 0..5 {
        let (status, body) = call(&token);
        if status == 429 {
            limited += 1;
            assert!(body.to_ascii_lowercase().contains("retry-after: 1"), "{body}");
            assert!(
                body.contains("rate_limited") && body.contains("user:admin"),
                "{body}"
            );
        }
    }
    assert!(limited >= 4, "{limited} of 5 limited");
    // Another principal has its own bucket.
    assert_eq!(call(&bob_token).0, 404);
    // Audited once, not per refused call.
    let events = admin.json(&["audit", "--principal", "user:admin"]);
    let rate_rows = events
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["reason"]
                .as_str()
                .unwrap_or_default()
                .starts_with("rate limited")
        })
        .count();
    assert_eq!(rate_rows, 1, "{events}");
}

#[test]
fn a_slow_body_is_cut_at_its_deadline() {
    let cp = Cp::start();
    let ca = otherix_tls::cert_from_pem(&cp.ca_pem()).unwrap();
    let mut config = otherix_tls::pinned_client_config(ca).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let addr: SocketAddr = cp.url.trim_start_matches("https://").parse().unwrap();
    let token = common::admin_token(&cp);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (answer, took) = rt.block_on(async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(otherix_tls::cp_server_name(), tcp)
            .await
            .unwrap();
        let head = format!(
            "POST /v1/users HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{"
        );
        tls.write_all(head.as_bytes()).await.unwrap();
        let started = std::time::Instant::now();
        let mut buf = vec![0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(30), tls.read(&mut buf))
            .await
            .expect("cut within 30 s")
            .unwrap_or(0);
        (String::from_utf8_lossy(&buf[..n]).to_string(), started.elapsed())
    });
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.contains("request body not received within 10s"),
        "{answer}"
    );
    assert!(took >= std::time::Duration::from_secs(9), "{took:?}");
}

#[test]
fn one_source_past_its_connection_cap_is_refused_and_others_are_not() {
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let cp = Cp::start_with(
        TempDir::new("cp"),
        &[
            "--max-connections-per-ip",
            "3",
            "--metrics-listen",
            &metrics.to_string(),
        ],
    );
    let addr: SocketAddr = cp.url.trim_start_matches("https://").parse().unwrap();
    wait_open_connections(metrics, "public", 0);
    let held: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
    wait_open_connections(metrics, "public", 3);
    // The fourth from the same address is closed at once, unanswered.
    let mut fourth = TcpStream::connect(addr).unwrap();
    fourth
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut buf = [0u8; 16];
    let n = fourth.read(&mut buf).unwrap_or(0);
    assert_eq!(n, 0, "the fourth connection was served");
    let (_, m) = get(metrics, "/metrics");
    assert!(
        m.contains("otherix_connections_refused_total{reason=\"max_connections_per_ip\"}"),
        "{m}"
    );
    // Released: served again.
    drop(held);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert_eq!(curl(&cp, &[&format!("{}/healthz", cp.url)]).0, 200);
}

#[test]
fn past_the_connection_cap_nodes_still_heartbeat_and_others_are_closed() {
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let cp = Cp::start_with(
        TempDir::new("cp"),
        &[
            "--max-connections",
            "3",
            "--reserved-node-connections",
            "4",
            "--metrics-listen",
            &metrics.to_string(),
        ],
    );
    let token =
        common::fake_node::join_token_for(&cp, "n1", "1h", &["--vtep", "10.213.9.11", "--hypervisor"]);
    let node = common::fake_node::enroll_raw(&cp, &token, "n1").unwrap();
    let addr: SocketAddr = cp.url.trim_start_matches("https://").parse().unwrap();
    // The enrollment's pooled connection closes in the background; start
    // from no open connection so the flood below holds exactly the cap.
    wait_open_connections(metrics, "public", 0);
    // A flood holds every public slot, its handshakes done, sending no
    // request (half-open ones could not: one of the three may be in its
    // handshake, a newcomer cuts the oldest).
    let held: Vec<Held> = (0..3).map(|_| Held::open(addr)).collect();
    wait_open_connections(metrics, "public", 3);
    // A client without a node certificate gets no answer...
    let (status, body) = curl(&cp, &["--max-time", "5", &format!("{}/healthz", cp.url)]);
    assert_ne!(status, 200, "served past the cap: {body}");
    // ...a node does, on a fresh connection (from the reserve).
    let beat = beat(&node.client(&cp), "n1", "10.213.9.11", true, None);
    assert!(beat.is_ok(), "{beat:?}");
    // A connection that never finishes its handshake loses its reserved
    // slot within 2 s; the reserve stays usable.
    let stalled: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    std::thread::sleep(std::time::Duration::from_millis(2500));
    for mut s in stalled {
        s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let mut b = [0u8; 1];
        assert_eq!(
            s.read(&mut b).unwrap_or(0),
            0,
            "a stalled reserved connection stays open"
        );
    }
    assert!(beat_ok(&cp, &node));
    let (_, m) = get(metrics, "/metrics");
    assert!(
        m.contains("otherix_connections_refused_total{reason=\"reserved_for_nodes\"}"),
        "{m}"
    );
    drop(held);
}

/// A TLS connection to the control plane (OpenSSL's `s_client`) with its
/// handshake done, holding its slot without a request until dropped.
struct Held {
    child: std::process::Child,
    /// Kept open: closed, s_client's next line would end it.
    _stderr: std::io::BufReader<std::process::ChildStderr>,
}

impl Held {
    fn open(addr: SocketAddr) -> Held {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let mut child = Command::new("openssl")
            .args(["s_client", "-brief", "-connect", &addr.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("openssl s_client");
        // `-brief` says so on stderr once the handshake is done.
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut said = Vec::new();
        let mut line = String::new();
        while stderr.read_line(&mut line).unwrap_or(0) > 0 {
            if line.contains("CONNECTION ESTABLISHED") {
                return Held {
                    child,
                    _stderr: stderr,
                };
            }
            said.push(std::mem::take(&mut line));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("no TLS connection to {addr}: {said:?}");
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until the CP's `otherix_connections_open{slots}` gauge reads `want`
/// (absent counts as 0).
fn wait_open_connections(metrics: SocketAddr, slots: &str, want: u64) {
    let series = format!("otherix_connections_open{{slots=\"{slots}\"}} ");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (_, m) = get(metrics, "/metrics");
        let open = m
            .lines()
            .find_map(|l| l.strip_prefix(&series))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        if open as u64 == want {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{open} {slots} connections open, waited for {want}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

fn beat_ok(cp: &Cp, node: &common::fake_node::Enrolled) -> bool {
    beat(&node.client(cp), "n1", "10.213.9.11", true, None).is_ok()
}

#[test]
fn connection_caps_fit_the_open_files_limit_and_a_flood_past_it_leaves_heartbeats_answered() {
    otherix_testbed::tools::require_programs(&["prlimit"]);
    let cp = Cp::start_with_nofile(TempDir::new("fds"), 1024);
    // (1024 - 256) / 2 = 384 connections: 38 for nodes, 346 public.
    assert!(
        cp.banner
            .iter()
            .any(|l| l.contains("at most 346 (+38 for nodes): fitted to 1024 open files")),
        "{:?}",
        cp.banner
    );
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    beat(&n1, "n1", "10.213.1.11", true, None).expect("a heartbeat before the flood");
    // A stranger opens more connections than the control plane has
    // descriptors, and sends nothing — from other source addresses than
    // the node's (127.0.0.2-9), as strangers do.
    let addr: SocketAddr = cp.url.trim_start_matches("https://").parse().unwrap();
    let from = |i: usize| -> Option<socket2::Socket> {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
        let src: SocketAddr = format!("127.0.0.{}:0", 2 + i % 8).parse().unwrap();
        s.bind(&src.into()).ok()?;
        s.connect(&addr.into()).ok()?;
        Some(s)
    };
    let flood: Vec<socket2::Socket> = (0..1200).filter_map(from).collect();
    assert!(flood.len() > 1024, "{} connections made", flood.len());
    // The node's heartbeat is still answered (from the nodes' reserve),
    // and the control plane never ran out of descriptors.
    let during = beat(&n1, "n1", "10.213.1.11", true, None);
    drop(flood);
    let log = std::fs::read_to_string(cp.dir.path().join("server.log")).unwrap();
    let tail: Vec<&str> = log.lines().rev().take(15).collect();
    during.unwrap_or_else(|e| panic!("a heartbeat during the flood: {e}\n{tail:#?}"));
    assert!(!log.contains("accept failed"), "the descriptors ran out");
}

/// A node looping heartbeats and certificate requests is refused 429 past
/// its rate, before its body is read, and counted; another node's
/// heartbeats are answered all the while.
#[test]
fn a_node_looping_heartbeats_is_rate_limited_and_others_are_answered() {
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let cp = Cp::start_with(TempDir::new("cp"), &["--metrics-listen", &metrics.to_string()]);
    let noisy = enroll_as(&cp, "noisy", "10.213.1.11", false);
    let quiet = enroll_as(&cp, "quiet", "10.213.1.12", false);
    let mut refused = 0;
    let mut answered = 0;
    for _ in 0..200 {
        match beat(&noisy, "noisy", "10.213.1.11", true, None) {
            Ok(_) => answered += 1,
            Err(e) => {
                assert_eq!(e.status(), Some(429), "{e}");
                assert!(e.to_string().contains("over its rate limit for heartbeat"), "{e}");
                refused += 1;
            }
        }
    }
    assert!(
        refused > 0 && answered >= 60,
        "{answered} answered, {refused} refused"
    );
    for _ in 0..5 {
        beat(&quiet, "quiet", "10.213.1.12", true, None).expect("another node is answered");
    }
    let (_, text) = get(metrics, "/metrics");
    assert_eq!(
        sample(&text, r#"otherix_node_calls_limited_total{call="heartbeat"}"#),
        Some(refused as f64)
    );
    assert!(cp.log().contains("node over its rate limit"), "logged");
}

/// Every enrollment refusal is counted by its reason: a stranger guessing
/// join tokens shows on `/metrics`, not only as 401s.
#[test]
fn enrollment_refusals_are_counted_by_reason() {
    let metrics: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let cp = Cp::start_with(TempDir::new("cp"), &["--metrics-listen", &metrics.to_string()]);
    let token = common::fake_node::join_token(&cp, "n1", "1h");
    let (id, _) = token.rsplit_once('_').unwrap_or((&token, ""));
    for (attempt, name) in [
        ("otxj_nonsense".to_string(), "n1"),
        (format!("{id}_{}", "0".repeat(64)), "n1"),
        (token.clone(), "n2"),
    ] {
        let err = common::fake_node::enroll(&cp, &attempt, name).expect_err("refused");
        assert!(matches!(err.status(), Some(401 | 403)), "{err}");
    }
    common::fake_node::enroll(&cp, &token, "n1").expect("the right token enrolls");
    let err = common::fake_node::enroll(&cp, &token, "n1").expect_err("used");
    assert!(err.to_string().contains("already used"), "{err}");
    let (_, text) = get(metrics, "/metrics");
    let refused = |reason: &str| {
        sample(
            &text,
            &format!("otherix_enrollments_refused_total{{reason=\"{reason}\"}}"),
        )
    };
    assert_eq!(
        refused("malformed_token"),
        Some(1.0),
        "{}",
        text.lines()
            .filter(|l| l.contains("enrollments"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(refused("wrong_secret"), Some(1.0));
    assert_eq!(refused("other_node"), Some(1.0));
    assert_eq!(refused("used"), Some(1.0));
}
