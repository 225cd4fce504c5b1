//! End-to-end behaviour of the gateway on loopback: the real client
//! (`otherix_client::tunnel::open`) or raw TLS requests against a gateway with
//! a fake overlay, echo guests and trap listeners that must never be dialed.

mod support;

use std::time::{Duration, Instant};

use otherix_client::tunnel::ConnectError;
use otherix_core::credential::DEFAULT_TTL;
use otherix_proto::agent::SessionEvent;
use sha2::{Digest, Sha256};
use support::*;
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The status and reason of a refused `open`.
fn refused(result: Result<otherix_client::tunnel::Tunnel, ConnectError>) -> (u16, String) {
    match result {
        Err(ConnectError::Refused { status, reason }) => (status, reason),
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("expected a refusal, got a tunnel"),
    }
}

/// Sends `len` pseudo-random bytes through the tunnel to an echo guest while
/// reading the echo; returns the hashes of what was sent and what came back.
async fn echo_through(tunnel: otherix_client::tunnel::Tunnel, len: usize) -> ([u8; 32], [u8; 32], Duration) {
    let (mut rd, mut wr) = tokio::io::split(tunnel);
    let started = Instant::now();
    let writer = tokio::spawn(async move {
        // One pseudo-random block, stamped with its sequence number each
        // time it is sent, so a lost, repeated or reordered block changes the hash.
        let mut chunk = vec![0u8; 256 * 1024];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for word in chunk.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            word.copy_from_slice(&state.to_le_bytes());
        }
        let mut hash = Sha256::new();
        let mut left = len;
        let mut seq = 0u64;
        while left > 0 {
            let n = left.min(chunk.len());
            chunk[..8].copy_from_slice(&seq.to_le_bytes());
            seq += 1;
            hash.update(&chunk[..n]);
            wr.write_all(&chunk[..n]).await.unwrap();
            left -= n;
        }
        wr.shutdown().await.unwrap();
        <[u8; 32]>::from(hash.finalize())
    });
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 256 * 1024];
    let mut got = 0usize;
    loop {
        let n = rd.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        got += n;
    }
    let elapsed = started.elapsed();
    assert_eq!(got, len, "every byte came back");
    (writer.await.unwrap(), hash.finalize().into(), elapsed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valid_credential_tunnels_to_the_target_and_streams_arrive_intact() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    for len in [1 << 20, 64 << 20] {
        let tunnel = gw.open(&gw.credential(guest.port)).await.unwrap();
        let (sent, echoed, elapsed) = echo_through(tunnel, len).await;
        assert_eq!(sent, echoed, "{len} bytes both ways arrive hashed equal");
        let mib = len as f64 / (1024.0 * 1024.0);
        eprintln!(
            "{mib:.0} MiB each way in {:.2} s: {:.0} MiB/s each way ({} build)",
            elapsed.as_secs_f64(),
            mib / elapsed.as_secs_f64(),
            if cfg!(debug_assertions) {
                "debug"
            } else {
                "release"
            }
        );
    }
    assert_eq!(guest.connections.load(std::sync::atomic::Ordering::SeqCst), 2);
    let c = gw.gateway.counters();
    assert_eq!(c.accepted, 2);
    eventually("byte counters are updated", || {
        let c = gw.gateway.counters();
        c.bytes_to_guest == (65 << 20) && c.bytes_from_guest == (65 << 20)
    })
    .await;
}

#[tokio::test]
async fn bytes_pipelined_after_the_head_reach_the_guest() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let mut request = request(&gw.credential(guest.port)).into_bytes();
    request.extend_from_slice(b"SSH-2.0-early\r\n");
    let mut tunnel = gw.raw_tunnel(&request).await;
    let mut echoed = [0u8; 15];
    tunnel.read_exact(&mut echoed).await.unwrap();
    assert_eq!(&echoed, b"SSH-2.0-early\r\n");
}

#[tokio::test]
async fn half_close_lets_the_client_read_after_shutting_its_write_side() {
    let gw = Harness::start(|_| {}).await;
    let port = count_then_reply().await;
    let mut tunnel = gw.open(&gw.credential(port)).await.unwrap();
    tunnel.write_all(&[7u8; 100_000]).await.unwrap();
    tunnel.shutdown().await.unwrap();
    // The guest answers only once it has seen the end of the client's stream.
    let answer = read_until_close(&mut tunnel).await;
    assert_eq!(String::from_utf8(answer).unwrap(), "got 100000 bytes\n");
}

#[tokio::test]
async fn each_session_is_reported_with_its_start_its_end_and_the_bytes_each_way() {
    let gw = Harness::start(|_| {}).await;
    let port = count_then_reply().await;
    let mut tunnel = gw.open(&gw.credential(port)).await.unwrap();
    tunnel.write_all(&[7u8; 100_000]).await.unwrap();
    tunnel.shutdown().await.unwrap();
    let answer = read_until_close(&mut tunnel).await;
    // A refused connection is no session: it is not reported.
    let trap = trap().await;
    let mut forged = gw.credential(trap.local_addr().unwrap().port()).into_bytes();
    let last = forged.len() - 1;
    forged[last] = if forged[last] == b'A' { b'B' } else { b'A' };
    assert!(gw.open(&String::from_utf8(forged).unwrap()).await.is_err());

    let mut reports = Vec::new();
    eventually("the session's end is reported", || {
        reports.extend(gw.gateway.take_reports(100));
        reports.len() >= 2
    })
    .await;
    let [SessionEvent::Start {
        session: started,
        principal,
        vm,
        port: p,
        ..
    }, SessionEvent::End {
        session: ended,
        bytes_up,
        bytes_down,
        reason,
        ..
    }] = reports.as_slice()
    else {
        panic!("expected a start and an end, got {reports:?}");
    };
    assert_eq!(started, ended);
    assert_eq!(
        (principal.as_str(), vm.as_str(), *p),
        ("user:alice", "web01", port)
    );
    assert_eq!((*bytes_up, *bytes_down), (100_000, answer.len() as u64));
    assert_eq!(reason, "closed");

    // Undelivered reports go back to the front of the queue.
    gw.gateway.give_back_reports(reports.clone());
    assert_eq!(gw.gateway.take_reports(100), reports);
}

#[tokio::test]
async fn tampered_payload_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    let token = gw.credential(trap.local_addr().unwrap().port());
    let at = "v4.public.".len() + 10;
    let mut bytes = token.into_bytes();
    bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
    let (status, reason) = refused(gw.open(&String::from_utf8(bytes).unwrap()).await);
    assert_eq!(status, 401);
    assert!(reason.contains("signature is invalid"), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("bad_signature"), 1);
}

#[tokio::test]
async fn tampered_signature_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    let token = gw.credential(trap.local_addr().unwrap().port());
    // The signature is the last 64 bytes of the body, before the footer.
    let body_end = token.rfind('.').unwrap();
    let at = body_end - 10;
    let mut bytes = token.into_bytes();
    bytes[at] = if bytes[at] == b'A' { b'B' } else { b'A' };
    let (status, _) = refused(gw.open(&String::from_utf8(bytes).unwrap()).await);
    assert_eq!(status, 401);
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("bad_signature"), 1);
}

#[tokio::test]
async fn unknown_kid_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    let stranger = signing_key("k9", 9);
    let token = stranger.mint(&claims(trap.local_addr().unwrap().port())).unwrap();
    let (status, reason) = refused(gw.open(&token).await);
    assert_eq!(status, 401);
    assert!(reason.contains("unknown key"), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("unknown_key"), 1);
}

/// A retired key's seed, stolen or kept by a broken minting side, signs a
/// credential that is itself in its time window: the gateway refuses it once
/// the key is past the expiry the control plane published, without asking
/// the control plane, and nothing reaches the guest.
#[tokio::test]
async fn credential_signed_by_an_expired_key_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    let retired = signing_key("k0", 5);
    let mut set = keyset(&[&gw.key]);
    let expired_at = OffsetDateTime::now_utc() - time::Duration::seconds(1);
    set.insert_until(retired.kid(), &retired.public_key(), Some(expired_at))
        .unwrap();
    gw.gateway.set_keys(set);
    let token = retired.mint(&claims(trap.local_addr().unwrap().port())).unwrap();
    let (status, reason) = refused(gw.open(&token).await);
    assert_eq!(status, 401);
    assert!(reason.contains("key \"k0\", which expired at"), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("key_expired"), 1);
    assert!(gw.gateway.metrics_text().contains("reason=\"key_expired\"} 1"));
    // The key still signing is unaffected.
    let guest = echo().await;
    drop(
        gw.open(&gw.credential(guest.port))
            .await
            .expect("the current key's"),
    );
}

#[tokio::test]
async fn a_key_before_its_expiry_is_trusted() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let previous = signing_key("k0", 5);
    let mut set = keyset(&[&gw.key]);
    let later = OffsetDateTime::now_utc() + time::Duration::minutes(5);
    set.insert_until(previous.kid(), &previous.public_key(), Some(later))
        .unwrap();
    gw.gateway.set_keys(set);
    drop(
        gw.open(&previous.mint(&claims(guest.port)).unwrap())
            .await
            .expect("a previous key's credential until the key expires"),
    );
}

#[tokio::test]
async fn expired_credential_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    let mut c = claims(trap.local_addr().unwrap().port());
    let long_ago = OffsetDateTime::now_utc() - DEFAULT_TTL - time::Duration::minutes(5);
    (c.iat, c.nbf, c.exp) = (long_ago, long_ago, long_ago + DEFAULT_TTL);
    let (status, reason) = refused(gw.open(&gw.mint(&c)).await);
    assert_eq!(status, 401);
    assert!(reason.contains("expired"), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("expired"), 1);
}

#[tokio::test]
async fn not_yet_valid_credential_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    let mut c = claims(trap.local_addr().unwrap().port());
    let later = OffsetDateTime::now_utc() + time::Duration::minutes(2);
    (c.nbf, c.exp) = (later, later + DEFAULT_TTL);
    let (status, reason) = refused(gw.open(&gw.mint(&c)).await);
    assert_eq!(status, 401);
    assert!(reason.contains("not valid before"), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("not_yet_valid"), 1);
}

#[tokio::test]
async fn credential_for_another_gateway_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    let mut c = claims(trap.local_addr().unwrap().port());
    c.aud = "gw2".into();
    let (status, reason) = refused(gw.open(&gw.mint(&c)).await);
    assert_eq!(status, 403);
    assert!(reason.contains("gw2"), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("wrong_audience"), 1);
}

#[tokio::test]
async fn credential_from_another_cluster_is_refused() {
    let gw = Harness::start(|c| c.issuer = Some("cluster1".into())).await;
    let trap = trap().await;
    let mut c = claims(trap.local_addr().unwrap().port());
    c.iss = "cluster2".into();
    let (status, reason) = refused(gw.open(&gw.mint(&c)).await);
    assert_eq!(status, 403);
    assert!(reason.contains("issued by cluster \"cluster2\""), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("wrong_issuer"), 1);
    assert!(gw.gateway.metrics_text().contains("reason=\"wrong_issuer\"} 1"));
}

#[tokio::test]
async fn issuer_learnt_at_runtime_is_checked_from_then_on() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let mut c = claims(guest.port);
    c.iss = "cluster2".into();
    drop(
        gw.open(&gw.mint(&c))
            .await
            .expect("no issuer known yet: not checked"),
    );
    gw.gateway.set_issuer(Some("cluster1"));
    c.jti = jti();
    let (status, _) = refused(gw.open(&gw.mint(&c)).await);
    assert_eq!(status, 403);
    assert_eq!(gw.gateway.counters().refused("wrong_issuer"), 1);
    drop(
        gw.open(&gw.credential(guest.port))
            .await
            .expect("our own cluster's"),
    );
}

#[tokio::test]
async fn credential_living_longer_than_the_maximum_is_refused() {
    let gw = Harness::start(|c| c.max_credential_lifetime = Duration::from_secs(600)).await;
    let trap = trap().await;
    let mut c = claims(trap.local_addr().unwrap().port());
    c.exp = c.iat + time::Duration::hours(24);
    let (status, reason) = refused(gw.open(&gw.mint(&c)).await);
    assert_eq!(status, 401);
    assert!(
        reason.contains("lives 86400 s, longer than the 600 s"),
        "{reason}"
    );
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("lifetime_too_long"), 1);
}

#[tokio::test]
async fn replayed_credential_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let token = gw.credential(guest.port);
    let first = gw.open(&token).await.unwrap();
    let (status, reason) = refused(gw.open(&token).await);
    assert_eq!(status, 409);
    assert!(reason.contains("already used"), "{reason}");
    // Also after the first session has ended.
    drop(first);
    let (status, _) = refused(gw.open(&token).await);
    assert_eq!(status, 409);
    assert_eq!(guest.connections.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(gw.gateway.counters().refused("replayed"), 2);
}

#[tokio::test]
async fn stale_mac_is_refused_without_dialing() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    // The IP now belongs to another guest.
    gw.overlay.set(LOOPBACK, [0x02, 0, 0, 0, 0, 0x99]);
    let (status, reason) = refused(gw.open(&gw.credential(trap.local_addr().unwrap().port())).await);
    assert_eq!(status, 409);
    assert_eq!(
        reason,
        format!("target changed: 127.0.0.1 is no longer {GUEST_MAC_TEXT}")
    );
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("target_changed"), 1);
}

#[tokio::test]
async fn missing_neighbor_entry_is_refused_without_dialing() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    gw.overlay.remove(LOOPBACK);
    let (status, reason) = refused(gw.open(&gw.credential(trap.local_addr().unwrap().port())).await);
    assert_eq!(status, 409);
    assert!(reason.contains("no neighbor entry"), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("no_neighbor"), 1);
}

#[tokio::test]
async fn credential_without_a_mac_is_refused_without_dialing() {
    let gw = Harness::start(|_| {}).await;
    let trap = trap().await;
    // A relay ticket, say: signed, but naming no MAC to check.
    let mut c = claims(trap.local_addr().unwrap().port());
    c.mac = None;
    let (status, reason) = refused(gw.open(&gw.mint(&c)).await);
    assert_eq!(status, 403);
    assert!(reason.contains("no MAC"), "{reason}");
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("bad_target"), 1);
}

#[tokio::test]
async fn smuggled_target_in_host_or_headers_is_ignored() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let trap = trap().await;
    let other = trap.local_addr().unwrap();
    let credential = gw.credential(guest.port);
    let request = format!(
        "GET /v1/connect HTTP/1.1\r\nHost: {other}\r\nX-Target: {other}\r\nX-Forwarded-Host: {other}\r\n\
         Forwarded: host={other}\r\nAuthorization: Bearer {credential}\r\nConnection: Upgrade\r\n\
         Upgrade: otherix-tcp\r\n\r\n"
    );
    let mut tunnel = gw.raw_tunnel(request.as_bytes()).await;
    tunnel.write_all(b"ping").await.unwrap();
    let mut pong = [0u8; 4];
    tunnel.read_exact(&mut pong).await.unwrap();
    assert_eq!(&pong, b"ping", "the credential's target answered");
    assert_eq!(guest.connections.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_untouched(&trap).await;
}

#[tokio::test]
async fn smuggled_target_in_path_or_query_is_refused_without_dialing() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let trap = trap().await;
    let other = trap.local_addr().unwrap();
    for target in [
        format!("/v1/connect?target={other}"),
        format!("/v1/connect?host={}&port={}", other.ip(), other.port()),
        format!("http://{other}/v1/connect"),
        format!("/v1/connect/{other}"),
        other.to_string(),
    ] {
        let credential = gw.credential(guest.port);
        let request = request(&credential).replacen("/v1/connect", &target, 1);
        let (status, body) = gw.raw(request.as_bytes()).await;
        assert_eq!(status, 404, "{target}: {body}");
        // Refused before the credential was even looked at: it is unspent.
        let tunnel = gw.open(&credential).await.unwrap();
        drop(tunnel);
    }
    assert_untouched(&trap).await;
    assert_eq!(gw.gateway.counters().refused("wrong_path"), 5);
}

#[tokio::test]
async fn malformed_heads_are_refused_with_their_status() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let good = request(&gw.credential(guest.port));
    let cases: Vec<(String, u16, &str)> = vec![
        (good.replacen("GET", "POST", 1), 405, "not_get"),
        (good.replacen("HTTP/1.1", "HTTP/1.0", 1), 505, "wrong_version"),
        (
            good.replacen("Upgrade: otherix-tcp", "Upgrade: websocket", 1),
            400,
            "missing_upgrade",
        ),
        (
            good.replacen("Connection: Upgrade", "Connection: close", 1),
            400,
            "missing_connection_upgrade",
        ),
        (
            good.replacen("Authorization: Bearer ", "Authorization: Basic ", 1),
            401,
            "malformed_authorization",
        ),
        (
            good.replacen("Authorization", "X-Authorization", 1),
            401,
            "missing_authorization",
        ),
        (
            good.replacen("\r\n\r\n", "\r\nAuthorization: Bearer abc\r\n\r\n", 1),
            400,
            "duplicate_authorization",
        ),
        (
            good.replacen("Host: gw1", "Host: gw\u{1}1", 1),
            400,
            "invalid_header",
        ),
        (good.replacen("Host: gw1", "Host : gw1", 1), 400, "invalid_header"),
    ];
    for (request, status, code) in &cases {
        let (got, body) = gw.raw(request.as_bytes()).await;
        assert_eq!(got, *status, "{code}: {body}");
        assert_eq!(body.matches('\n').count(), 1, "one line: {body:?}");
        assert!(gw.gateway.counters().refused(code) >= 1, "{code} counted");
    }
    assert_eq!(guest.connections.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn slow_client_is_cut_off_after_the_header_timeout() {
    let gw = Harness::start(|c| c.limits.request_timeout = Duration::from_millis(500)).await;
    let started = Instant::now();
    let mut tls = gw.tls().await;
    tls.write_all(b"GET /v1/connect HTTP/1.1\r\nHost: gw1\r\n")
        .await
        .unwrap();
    let answer = read_until_close(&mut tls).await;
    let (status, body) = split_response(&answer);
    assert_eq!(status, 408, "{body}");
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(gw.gateway.counters().refused("head_timeout"), 1);

    // A client that never even starts TLS is closed too.
    let mut silent = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let mut byte = [0u8; 1];
    let n = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut byte))
        .await
        .expect("closed in time")
        .unwrap_or(0);
    assert_eq!(n, 0);
    assert_eq!(gw.gateway.counters().tls_handshake_failures, 1);
}

#[tokio::test]
async fn oversized_head_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let request = request(&gw.credential(guest.port)).replacen(
        "Host: gw1",
        &format!("Host: gw1\r\nX-Pad: {}", "a".repeat(9000)),
        1,
    );
    let (status, body) = gw.raw(request.as_bytes()).await;
    assert_eq!(status, 431, "{body}");
    assert_eq!(gw.gateway.counters().refused("head_too_large"), 1);
    assert_eq!(guest.connections.load(std::sync::atomic::Ordering::SeqCst), 0);
}

#[tokio::test]
async fn connection_limit_is_enforced() {
    // A principal's share is at most half the slots: three principals.
    let gw = Harness::start(|c| {
        c.limits.max_connections = 2;
        c.max_sessions_per_principal = 1;
    })
    .await;
    let guest = echo().await;
    let of = |gw: &Harness, sub: &str| {
        let mut c = support::claims(guest.port);
        c.sub = sub.into();
        gw.mint(&c)
    };
    let mut a = gw.open(&gw.credential(guest.port)).await.unwrap();
    let b = gw.open(&of(&gw, "grant:b")).await.unwrap();
    let third = of(&gw, "grant:c");
    let (status, reason) = refused(gw.open(&third).await);
    assert_eq!(status, 503, "{reason}");
    assert_eq!(gw.gateway.counters().refused("too_many_connections"), 1);
    // The open sessions are unaffected.
    a.write_all(b"still here").await.unwrap();
    let mut back = [0u8; 10];
    a.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"still here");
    // A slot frees when a session ends.
    drop(b);
    eventually("a connection slot is free", || {
        gw.gateway.counters().open_connections == 1
    })
    .await;
    // Turned away before its request was read, the credential is unspent.
    gw.open(&third).await.unwrap();
}

#[tokio::test]
async fn refusals_are_counted_per_reason() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let token = gw.credential(guest.port);
    drop(gw.open(&token).await.unwrap());
    refused(gw.open(&token).await);
    refused(
        gw.open(&signing_key("k9", 9).mint(&claims(guest.port)).unwrap())
            .await,
    );
    gw.overlay.set(LOOPBACK, [0x02, 0, 0, 0, 0, 0x99]);
    refused(gw.open(&gw.credential(guest.port)).await);
    refused(gw.open(&gw.credential(guest.port)).await);

    let c = gw.gateway.counters();
    assert_eq!(c.accepted, 1);
    assert_eq!(c.refused("replayed"), 1);
    assert_eq!(c.refused("unknown_key"), 1);
    assert_eq!(c.refused("target_changed"), 2);
    assert_eq!(c.refused.values().sum::<u64>(), 4, "{:?}", c.refused);
    let text = gw.gateway.metrics_text();
    assert!(
        text.contains("otherix_gateway_refusals_total{reason=\"target_changed\"} 2\n"),
        "{text}"
    );
    assert!(
        text.contains("otherix_gateway_sessions_accepted_total 1\n"),
        "{text}"
    );
}

#[tokio::test]
async fn sessions_are_counted_per_network_while_open() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let tunnel = gw.open(&gw.credential(guest.port)).await.unwrap();
    eventually("the session is counted", || {
        gw.gateway.sessions().get(NET) == Some(&1)
    })
    .await;
    assert!(gw
        .gateway
        .metrics_text()
        .contains("otherix_gateway_sessions_open{network=\"ov1\"} 1\n"));
    drop(tunnel);
    eventually("the session is uncounted", || gw.gateway.sessions().is_empty()).await;
}

#[tokio::test]
async fn unreachable_target_is_a_retryable_502() {
    let gw = Harness::start(|_| {}).await;
    // A port nothing listens on.
    let port = trap().await.local_addr().unwrap().port();
    let result = gw.open(&gw.credential(port)).await;
    assert!(result.as_ref().is_err_and(ConnectError::retryable));
    let (status, reason) = refused(result);
    assert_eq!(status, 502);
    assert!(
        reason.starts_with("cannot connect to web01 at 127.0.0.1:"),
        "{reason}"
    );
    assert_eq!(gw.gateway.counters().refused("dial_failed"), 1);
}

#[tokio::test]
async fn idle_session_is_closed() {
    let gw = Harness::start(|c| c.limits.idle_timeout = Duration::from_millis(300)).await;
    let guest = echo().await;
    let mut tunnel = gw.open(&gw.credential(guest.port)).await.unwrap();
    tunnel.write_all(b"x").await.unwrap();
    let mut byte = [0u8; 1];
    tunnel.read_exact(&mut byte).await.unwrap();
    let started = Instant::now();
    let rest = read_until_close(&mut tunnel).await;
    assert!(rest.is_empty());
    assert!(started.elapsed() >= Duration::from_millis(250));
}

#[tokio::test]
async fn a_busy_session_ends_at_its_maximum_lifetime_and_is_reported_so() {
    let gw = Harness::start(|c| c.limits.max_session = Duration::from_millis(600)).await;
    let guest = echo().await;
    let mut tunnel = gw.open(&gw.credential(guest.port)).await.unwrap();
    let started = Instant::now();
    let mut byte = [0u8; 1];
    // Busy all the while: a byte every 50 ms, echoed.
    let ended = loop {
        if tunnel.write_all(b"x").await.is_err() {
            break true;
        }
        match tokio::time::timeout(Duration::from_secs(2), tunnel.read(&mut byte)).await {
            Ok(Ok(1)) => {}
            _ => break true,
        }
        if started.elapsed() > Duration::from_secs(5) {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(ended, "the session outlived its maximum lifetime");
    assert!(
        started.elapsed() >= Duration::from_millis(550),
        "{:?}",
        started.elapsed()
    );
    eventually("the session's end report", || {
        gw.gateway.sessions().values().sum::<u32>() == 0
    })
    .await;
    let reports = gw.gateway.take_reports(100);
    assert!(
        reports
            .iter()
            .any(|r| matches!(r, SessionEvent::End { reason, .. } if reason == "max lifetime")),
        "{reports:?}"
    );
}

#[tokio::test]
async fn replay_cache_survives_a_gateway_restart() {
    let file = temp_dir("restart").join("replay.log");
    let path = file.clone();
    let mut first = Harness::start(move |c| c.replay_file = Some(path)).await;
    let guest = echo().await;
    let token = first.credential(guest.port);
    drop(first.open(&token).await.unwrap());
    first.stop().await;

    let path = file.clone();
    let second = Harness::start(move |c| c.replay_file = Some(path)).await;
    let (status, _) = refused(second.open(&token).await);
    assert_eq!(status, 409, "used before the restart");
    drop(second.open(&second.credential(guest.port)).await.unwrap());
    assert_eq!(guest.connections.load(std::sync::atomic::Ordering::SeqCst), 2);
    let _ = std::fs::remove_dir_all(file.parent().unwrap());
}

#[tokio::test]
async fn keys_replaced_at_runtime_take_effect() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let old = signing_key("k1", 7);
    let new = signing_key("k2", 8);
    // Rotation: the new key is added, the old one is still trusted.
    gw.gateway.set_keys(keyset(&[&old, &new]));
    drop(gw.open(&old.mint(&claims(guest.port)).unwrap()).await.unwrap());
    drop(gw.open(&new.mint(&claims(guest.port)).unwrap()).await.unwrap());
    // The old key leaves the set: its credentials are now unknown.
    gw.gateway.set_keys(keyset(&[&new]));
    let (status, reason) = refused(gw.open(&old.mint(&claims(guest.port)).unwrap()).await);
    assert_eq!(status, 401);
    assert!(reason.contains("unknown key \"k1\""), "{reason}");
    drop(gw.open(&new.mint(&claims(guest.port)).unwrap()).await.unwrap());
}

#[tokio::test]
async fn graceful_shutdown_lets_open_sessions_finish() {
    let mut gw = Harness::start(|c| c.drain_timeout = Duration::from_secs(10)).await;
    let guest = echo().await;
    let mut tunnel = gw.open(&gw.credential(guest.port)).await.unwrap();
    let stopped = gw.begin_stop();
    // No new connections…
    eventually("the listener is closed", || {
        std::net::TcpStream::connect_timeout(&gw.addr, Duration::from_millis(100)).is_err()
    })
    .await;
    // …but the open session still works, and the gateway waits for it.
    tunnel.write_all(b"after shutdown").await.unwrap();
    let mut back = [0u8; 14];
    tunnel.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"after shutdown");
    assert!(!stopped.is_finished());
    tunnel.shutdown().await.unwrap();
    assert!(read_until_close(&mut tunnel).await.is_empty());
    tokio::time::timeout(Duration::from_secs(5), stopped)
        .await
        .expect("run returns once the session ended")
        .unwrap()
        .unwrap();
}

/// A revocation of everything `principal` was issued up to now.
fn revoke_all(principal: &str) -> otherix_proto::agent::Revocation {
    otherix_proto::agent::Revocation {
        principal: principal.into(),
        token: None,
        vm_id: None,
        port: None,
        session: None,
        before: OffsetDateTime::now_utc(),
    }
}

#[tokio::test]
async fn a_revocation_ends_the_sessions_it_covers_and_refuses_their_credentials() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    let mut theirs = support::claims(guest.port);
    theirs.sub = "grant:acme".into();
    let mut unused = support::claims(guest.port);
    unused.sub = "grant:acme".into();
    let unused = gw.mint(&unused);
    let mut revoked = gw.open(&gw.mint(&theirs)).await.unwrap();
    let mut other = gw.open(&gw.credential(guest.port)).await.unwrap();
    revoked.write_all(b"ping").await.unwrap();
    let mut four = [0u8; 4];
    revoked.read_exact(&mut four).await.unwrap();

    gw.gateway.set_revocations(vec![revoke_all("grant:acme")]);
    // acme's session ends at once; alice's goes on.
    let rest = read_until_close(&mut revoked).await;
    assert!(rest.is_empty(), "{rest:?}");
    other.write_all(b"pong").await.unwrap();
    other.read_exact(&mut four).await.unwrap();
    assert_eq!(&four, b"pong");
    // A credential issued before the revocation and never used is refused.
    let (status, reason) = refused(gw.open(&unused).await);
    assert_eq!(status, 403, "{reason}");
    assert!(reason.contains("revoked"), "{reason}");
    assert_eq!(gw.gateway.counters().refused.get("revoked"), Some(&1));
    // One issued after it is not.
    let mut fresh = support::claims(guest.port);
    fresh.sub = "grant:acme".into();
    fresh.iat = OffsetDateTime::now_utc();
    fresh.nbf = fresh.iat;
    drop(gw.open(&gw.mint(&fresh)).await.unwrap());

    let mut reports = Vec::new();
    eventually("the revoked session's end report", || {
        reports.extend(gw.gateway.take_reports(100));
        reports
            .iter()
            .any(|r| matches!(r, SessionEvent::End { reason, .. } if reason == "revoked"))
    })
    .await;
    let ended: Vec<_> = reports
        .iter()
        .filter_map(|r| match r {
            SessionEvent::End {
                principal,
                reason,
                bytes_up,
                ..
            } if reason == "revoked" => Some((principal.clone(), *bytes_up)),
            _ => None,
        })
        .collect();
    assert_eq!(ended, [("grant:acme".to_string(), 4)]);
}

#[tokio::test]
async fn a_grants_session_ends_when_the_grant_expires_and_a_late_credential_is_refused() {
    let gw = Harness::start(|_| {}).await;
    let guest = echo().await;
    // A grant ending in 1.5 s: the broker cut its credential to that and
    // wrote the end into it.
    let until = OffsetDateTime::now_utc() + time::Duration::milliseconds(1500);
    let mut grants = support::claims(guest.port);
    grants.sub = "grant:ci".into();
    grants.exp = until;
    grants.until = Some(until);
    let mut session = gw.open(&gw.mint(&grants)).await.unwrap();
    let mut other = gw.open(&gw.credential(guest.port)).await.unwrap();
    session.write_all(b"ping").await.unwrap();
    let mut four = [0u8; 4];
    session.read_exact(&mut four).await.unwrap();

    // Open until the grant's end, closed then (busy or not, long before
    // --max-session); the user's session goes on.
    let rest = read_until_close(&mut session).await;
    assert!(rest.is_empty(), "{rest:?}");
    assert!(OffsetDateTime::now_utc() >= until, "ended before the grant did");
    other.write_all(b"pong").await.unwrap();
    other.read_exact(&mut four).await.unwrap();
    assert_eq!(&four, b"pong");

    // A credential of an ended grant, still inside its clock-skew window:
    // refused before anything is dialed.
    let trap = trap().await;
    let now = OffsetDateTime::now_utc();
    let mut late = support::claims(trap.local_addr().unwrap().port());
    late.sub = "grant:ci".into();
    late.iat = now - time::Duration::seconds(10);
    late.nbf = late.iat;
    late.exp = now - time::Duration::seconds(1);
    late.until = Some(late.exp);
    let (status, reason) = refused(gw.open(&gw.mint(&late)).await);
    assert_eq!(status, 403, "{reason}");
    assert!(reason.contains("grant") && reason.contains("expired"), "{reason}");
    assert_eq!(gw.gateway.counters().refused.get("grant_expired"), Some(&1));
    assert_untouched(&trap).await;

    let mut reports = Vec::new();
    eventually("the expired session's end report", || {
        reports.extend(gw.gateway.take_reports(100));
        reports
            .iter()
            .any(|r| matches!(r, SessionEvent::End { reason, .. } if reason == "grant expired"))
    })
    .await;
    let ended: Vec<_> = reports
        .iter()
        .filter_map(|r| match r {
            SessionEvent::End {
                principal,
                reason,
                bytes_up,
                ..
            } if reason == "grant expired" => Some((principal.clone(), *bytes_up)),
            _ => None,
        })
        .collect();
    assert_eq!(ended, [("grant:ci".to_string(), 4)]);
}

#[tokio::test]
async fn one_principal_at_its_session_limit_does_not_keep_others_out() {
    let gw = Harness::start(|c| c.max_sessions_per_principal = 2).await;
    let guest = echo().await;
    let flood = |gw: &Harness| {
        let mut c = support::claims(guest.port);
        c.sub = "grant:flood".into();
        gw.mint(&c)
    };
    let _one = gw.open(&flood(&gw)).await.unwrap();
    let _two = gw.open(&flood(&gw)).await.unwrap();
    let (status, reason) = refused(gw.open(&flood(&gw)).await);
    assert_eq!(status, 429, "{reason}");
    assert!(reason.contains("grant:flood has 2 sessions open"), "{reason}");
    // Another principal still gets in.
    let mut other = gw.open(&gw.credential(guest.port)).await.unwrap();
    other.write_all(b"ok").await.unwrap();
    let mut two = [0u8; 2];
    other.read_exact(&mut two).await.unwrap();
    assert_eq!(
        gw.gateway.counters().refused.get("principal_session_cap"),
        Some(&1)
    );
}

#[tokio::test]
async fn one_principal_cannot_fill_the_replay_cache_for_everyone() {
    let gw = Harness::start(|c| {
        c.replay_capacity = 10;
        c.replay_share_per_principal = 3;
    })
    .await;
    let guest = echo().await;
    for _ in 0..3 {
        let mut c = support::claims(guest.port);
        c.sub = "grant:flood".into();
        drop(gw.open(&gw.mint(&c)).await.unwrap());
    }
    let mut c = support::claims(guest.port);
    c.sub = "grant:flood".into();
    let (status, reason) = refused(gw.open(&gw.mint(&c)).await);
    assert_eq!(status, 429, "{reason}");
    assert!(reason.contains("3 used credentials"), "{reason}");
    drop(gw.open(&gw.credential(guest.port)).await.unwrap());
    assert_eq!(gw.gateway.replay_cache_len(), 4);
}

#[tokio::test]
async fn one_source_holding_half_open_connections_does_not_keep_another_out() {
    // Sixteen slots (four may be in their handshake), four per source: a
    // host that opens more and never starts TLS holds its four; the others
    // are closed at once, unanswered.
    let gw = Harness::start(|c| {
        c.limits.max_connections = 16;
        c.limits.max_connections_per_source = 4;
        c.max_sessions_per_principal = 4;
    })
    .await;
    let guest = echo().await;
    let mut flood = Vec::new();
    for _ in 0..8 {
        flood.push(connect_from("127.0.0.2", gw.addr).await);
    }
    eventually("four flooding connections closed at their source's share", || {
        let c = gw.gateway.counters();
        c.connections_refused["max_connections_per_source"] == 4 && c.open_connections == 4
    })
    .await;
    // Another source's session goes through while the flood holds its share.
    let mut tunnel = gw.open(&gw.credential(guest.port)).await.unwrap();
    tunnel.write_all(b"through").await.unwrap();
    let mut back = [0u8; 7];
    tunnel.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"through");
    // The ones over the share were closed, not left waiting; and the
    // session's handshake took the place of the flood's oldest.
    let mut closed = 0;
    for s in &mut flood {
        if tokio::time::timeout(Duration::from_millis(200), s.read(&mut [0u8; 1]))
            .await
            .is_ok()
        {
            closed += 1;
        }
    }
    assert_eq!(
        closed, 5,
        "the connections past the share, and one cut, are closed"
    );
    assert_eq!(gw.gateway.counters().connections_refused["handshake_cut"], 1);
    let text = gw.gateway.metrics_text();
    assert!(
        text.contains(
            "otherix_ingress_connections_refused_total{server=\"gateway\",reason=\"max_connections_per_source\"} 4\n"
        ),
        "{text}"
    );
    assert_eq!(gw.gateway.counters().refused("too_many_connections"), 0);
}

#[tokio::test]
async fn half_open_handshakes_from_many_sources_are_cut_for_newcomers_and_never_fill_the_gateway() {
    // Sixteen slots, four per source: four hosts holding four half-open
    // handshakes each would take every slot. A quarter of the slots may be
    // in their handshake; past that each newcomer cuts the oldest of the
    // source holding the most.
    let gw = Harness::start(|c| {
        c.limits.max_connections = 16;
        c.limits.max_connections_per_source = 4;
        c.max_sessions_per_principal = 8;
        c.limits.handshake_timeout = Duration::from_secs(60);
        c.limits.request_timeout = Duration::from_secs(60);
    })
    .await;
    assert_eq!(gw.gateway.counters().handshakes_pending, 0);
    let guest = echo().await;
    let mut flood = Vec::new();
    for host in 2..=5 {
        for _ in 0..4 {
            flood.push(connect_from(&format!("127.0.0.{host}"), gw.addr).await);
        }
    }
    eventually("twelve of the flood's handshakes cut, four held", || {
        let c = gw.gateway.counters();
        c.connections_refused["handshake_cut"] == 12 && c.open_connections == 4 && c.handshakes_pending == 4
    })
    .await;
    // Every session goes through: the first cuts one more of the flood's,
    // and once done leaves the budget.
    for i in 0..5u8 {
        let mut tunnel = gw.open(&gw.credential(guest.port)).await.unwrap();
        tunnel.write_all(&[i]).await.unwrap();
        let mut back = [0u8; 1];
        tunnel.read_exact(&mut back).await.unwrap();
        assert_eq!(back, [i]);
    }
    let c = gw.gateway.counters();
    assert_eq!(c.connections_refused["handshake_cut"], 13);
    assert_eq!(c.connections_refused["max_connections_per_source"], 0);
    assert_eq!(c.refused("too_many_connections"), 0, "the gateway was never full");
    // The cut ones were closed unanswered; three still held.
    let mut closed = 0;
    for s in &mut flood {
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(200), s.read(&mut byte)).await {
            Ok(Ok(0)) | Ok(Err(_)) => closed += 1,
            Ok(Ok(_)) => panic!("a half-open handshake got an answer"),
            Err(_) => {}
        }
    }
    assert_eq!(closed, 13);
    let text = gw.gateway.metrics_text();
    assert!(text.contains("otherix_gateway_handshakes_pending 3\n"), "{text}");
}

#[tokio::test]
async fn a_tls_handshake_not_done_by_its_deadline_is_cut_and_counted() {
    let gw = Harness::start(|c| {
        c.limits.handshake_timeout = Duration::from_millis(300);
        c.limits.request_timeout = Duration::from_secs(60);
    })
    .await;
    // Nothing sent; then a ClientHello's first bytes and nothing more.
    let mut silent = connect_from("127.0.0.2", gw.addr).await;
    let mut partial = connect_from("127.0.0.2", gw.addr).await;
    partial.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).await.unwrap();
    // Cut at the handshake deadline, well before the request's.
    assert!(closed_within(&mut silent, Duration::from_secs(30))
        .await
        .is_empty());
    assert!(closed_within(&mut partial, Duration::from_secs(30))
        .await
        .is_empty());
    eventually("both cuts counted and their slots given back", || {
        let c = gw.gateway.counters();
        c.connections_refused["handshake_timeout"] == 2 && c.open_connections == 0
    })
    .await;
    // A client that does its handshake is served as before.
    let guest = echo().await;
    drop(gw.open(&gw.credential(guest.port)).await.unwrap());
}
