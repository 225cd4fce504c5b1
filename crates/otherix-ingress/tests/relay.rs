//! The relay endpoint end to end on loopback: a cluster CA and the
//! certificates it signs (rcgen), an echo guest, and TLS clients presenting
//! the control plane's certificate, a node's, a forged one or none.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use otherix_ingress::relay::{server_config, ControlPlanes, Relay, Target, Targets};
use otherix_ingress::tls::{certified_from_pem, CertSlot};
use otherix_ingress::Limits;
use otherix_proto::relay;
use otherix_tls as tls;
use rcgen::{BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsConnector;

/// A cluster CA and certificates it signs, as the CP's PKI makes them.
struct Pki {
    ca_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Pki {
    fn new(name: &str) -> Pki {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        let ca = params.self_signed(&key).unwrap();
        Pki {
            ca_pem: ca.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// (cert, key) for `name` with the given usages.
    fn issue(&self, name: &str, usages: Vec<ExtendedKeyUsagePurpose>) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
        params.extended_key_usages = usages;
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn node(&self, name: &str) -> (String, String) {
        self.issue(
            name,
            vec![
                ExtendedKeyUsagePurpose::ClientAuth,
                ExtendedKeyUsagePurpose::ServerAuth,
            ],
        )
    }

    fn control_plane(&self) -> (String, String) {
        self.issue(relay::CP_CLIENT_NAME, vec![ExtendedKeyUsagePurpose::ClientAuth])
    }
}

/// An echo guest on 127.0.0.1 that counts the connections it accepts.
async fn echo_guest() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                let _ = w.shutdown().await;
            });
        }
    });
    (addr, count)
}

const VM: &str = "abc123";

/// node1's relay endpoint on 127.0.0.1, with VM [`VM`] at 127.0.0.1.
async fn endpoint(pki: &Pki, limits: Limits) -> SocketAddr {
    endpoint_and_relay(pki, limits).await.0
}

async fn endpoint_and_relay(pki: &Pki, limits: Limits) -> (SocketAddr, Arc<Relay>) {
    endpoint_for(pki, limits, &["127.0.0.1"]).await
}

/// [`endpoint_and_relay`] accepting connections from `control_planes` only.
async fn endpoint_for(pki: &Pki, limits: Limits, control_planes: &[&str]) -> (SocketAddr, Arc<Relay>) {
    let (cert, key) = pki.node("node1");
    let certified = certified_from_pem(&cert, &key, &pki.ca_pem).unwrap();
    let tls = server_config(CertSlot::new(certified), &pki.ca_pem).unwrap();
    let control_planes = ControlPlanes::new(control_planes.iter().map(|a| a.parse().unwrap()), &[]);
    let relay = Arc::new(Relay::new(tls, limits, control_planes).unwrap());
    relay.set_targets(Targets::from([(
        VM.to_string(),
        Target {
            ip: Ipv4Addr::LOCALHOST,
            source: Ipv4Addr::LOCALHOST,
        },
    )]));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(relay.clone().run(listener, std::future::pending()));
    (addr, relay)
}

/// A TLS client of the endpoint, presenting `identity` (or nothing),
/// trusting `ca_pem`, expecting the server to be `node1`.
async fn call(
    addr: SocketAddr,
    ca_pem: &str,
    identity: Option<&(String, String)>,
    line: &str,
) -> std::io::Result<(String, tokio_rustls::client::TlsStream<TcpStream>)> {
    call_from("127.0.0.1", addr, ca_pem, identity, line).await
}

/// A TCP connection to `to` from the loopback address `source`.
async fn connect_from(source: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(source.parse().unwrap(), 0))?;
    socket.connect(to).await
}

/// [`call`] from the loopback address `source`.
async fn call_from(
    source: &str,
    addr: SocketAddr,
    ca_pem: &str,
    identity: Option<&(String, String)>,
    line: &str,
) -> std::io::Result<(String, tokio_rustls::client::TlsStream<TcpStream>)> {
    let ca = tls::cert_from_pem(ca_pem).unwrap();
    let config = match identity {
        Some((cert, key)) => tls::pinned_client_config_with_identity(ca, cert, key).unwrap(),
        None => tls::pinned_client_config(ca).unwrap(),
    };
    let tcp = connect_from(source, addr).await?;
    let name = rustls::pki_types::ServerName::try_from("node1").unwrap();
    let mut tls = TlsConnector::from(Arc::new(config)).connect(name, tcp).await?;
    tls.write_all(line.as_bytes()).await?;
    tls.flush().await?;
    let mut reader = tokio::io::BufReader::new(tls);
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut answer))
        .await
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::TimedOut))??;
    if answer.is_empty() {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    assert!(reader.buffer().is_empty());
    Ok((answer, reader.into_inner()))
}

#[tokio::test]
async fn the_control_plane_is_relayed_to_the_guest_with_half_close() {
    let pki = Pki::new("cluster CA");
    let (guest, accepted) = echo_guest().await;
    let addr = endpoint(&pki, Limits::default()).await;
    let cp = pki.control_plane();
    let (answer, mut tls) = call(
        addr,
        &pki.ca_pem,
        Some(&cp),
        &relay::request_line(VM, guest.port()),
    )
    .await
    .unwrap();
    assert_eq!(answer, "OK\n");
    tls.write_all(b"ping through the relay").await.unwrap();
    tls.shutdown().await.unwrap();
    let mut back = Vec::new();
    tls.read_to_end(&mut back).await.unwrap();
    assert_eq!(
        back, b"ping through the relay",
        "the echo came back after our half-close"
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_session_ends_at_once_when_its_guest_leaves_the_node() {
    let pki = Pki::new("cluster CA");
    let (guest, _) = echo_guest().await;
    let (addr, relay) = endpoint_and_relay(&pki, Limits::default()).await;
    let line = relay::request_line(VM, guest.port());
    let (answer, mut tls) = call(addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
        .await
        .unwrap();
    assert_eq!(answer, "OK\n");
    tls.write_all(b"before").await.unwrap();
    let mut buf = [0u8; 6];
    tls.read_exact(&mut buf).await.unwrap();
    // Handed over to another node: no longer a target here.
    relay.set_targets(Targets::new());
    let mut rest = Vec::new();
    let end = tokio::time::timeout(Duration::from_secs(2), tls.read_to_end(&mut rest))
        .await
        .expect("the session ends at once, not at its idle timeout");
    assert_eq!(
        end.unwrap_err().kind(),
        std::io::ErrorKind::UnexpectedEof,
        "ended without close_notify, so the CP reports it rather than a clean end"
    );
    let (answer, _) = call(addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
        .await
        .unwrap();
    assert_eq!(
        answer,
        format!("ERR vm {VM} is not a guest on a bridge of this node\n")
    );
}

#[tokio::test]
async fn a_node_certificate_is_refused_and_nothing_is_dialed() {
    let pki = Pki::new("cluster CA");
    let (guest, accepted) = echo_guest().await;
    let addr = endpoint(&pki, Limits::default()).await;
    let line = relay::request_line(VM, guest.port());
    // Another node's certificate: same CA, ClientAuth, but not the CP.
    let node2 = pki.node("node2");
    assert!(call(addr, &pki.ca_pem, Some(&node2), &line).await.is_err());
    // A certificate naming the CP, from another CA.
    let other = Pki::new("another CA");
    let forged = other.control_plane();
    assert!(call(addr, &pki.ca_pem, Some(&forged), &line).await.is_err());
    // No certificate at all.
    assert!(call(addr, &pki.ca_pem, None, &line).await.is_err());
    // A certificate naming the CP and more.
    let key = KeyPair::generate().unwrap();
    let mut params = CertificateParams::new(vec![relay::CP_CLIENT_NAME.to_string(), "node2".into()]).unwrap();
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let both = (
        params.signed_by(&key, &pki.issuer).unwrap().pem(),
        key.serialize_pem(),
    );
    assert!(call(addr, &pki.ca_pem, Some(&both), &line).await.is_err());

    assert_eq!(
        accepted.load(Ordering::SeqCst),
        0,
        "a refused caller reached the guest"
    );
    // The CP's own certificate still works.
    let (answer, _) = call(addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
        .await
        .unwrap();
    assert_eq!(answer, "OK\n");
}

#[tokio::test]
async fn unknown_vms_and_addresses_on_the_wire_get_err_without_a_dial() {
    let pki = Pki::new("cluster CA");
    let (guest, accepted) = echo_guest().await;
    let addr = endpoint(&pki, Limits::default()).await;
    let cp = pki.control_plane();
    let port = guest.port();
    for (line, want) in [
        (
            relay::request_line("ffff", port),
            "ERR vm ffff is not a guest on a bridge of this node\n",
        ),
        (format!("RELAY 127.0.0.1 {port}\n"), "ERR malformed request\n"),
        (
            format!("RELAY {VM} {port} 127.0.0.1\n"),
            "ERR malformed request\n",
        ),
        (format!("CONNECT 127.0.0.1:{port}\n"), "ERR malformed request\n"),
        (
            format!("RELAY {VM} {}\n", "9".repeat(600)),
            "ERR malformed request\n",
        ),
    ] {
        let (answer, _) = call(addr, &pki.ca_pem, Some(&cp), &line).await.unwrap();
        assert_eq!(answer, want, "{line}");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 0);
    // A known VM on a closed port: ERR with the reason, not a hang.
    let closed = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (answer, _) = call(addr, &pki.ca_pem, Some(&cp), &relay::request_line(VM, closed))
        .await
        .unwrap();
    assert!(answer.starts_with("ERR cannot reach 127.0.0.1:"), "{answer}");
}

#[tokio::test]
async fn a_caller_that_never_sends_its_request_is_dropped_in_time() {
    let pki = Pki::new("cluster CA");
    let mut limits = Limits::default();
    limits.request_timeout = Duration::from_millis(300);
    let addr = endpoint(&pki, limits).await;
    let cp = pki.control_plane();
    let ca = tls::cert_from_pem(&pki.ca_pem).unwrap();
    let config = tls::pinned_client_config_with_identity(ca, &cp.0, &cp.1).unwrap();
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("node1").unwrap();
    let mut tls = TlsConnector::from(Arc::new(config))
        .connect(name, tcp)
        .await
        .unwrap();
    tls.write_all(b"RELAY abc").await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut rest)).await;
    assert!(read.is_ok(), "closed by the endpoint, not left hanging");
    assert!(rest.is_empty());
}

/// Waits until `cond` holds, for at most 10 s.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

/// Limits whose deadlines are far off: a connection closed at once was
/// refused, not timed out.
fn patient() -> Limits {
    let mut limits = Limits::default();
    limits.handshake_timeout = Duration::from_secs(60);
    limits.request_timeout = Duration::from_secs(60);
    limits
}

#[tokio::test]
async fn a_caller_that_is_no_control_plane_is_closed_before_its_handshake() {
    let pki = Pki::new("cluster CA");
    let (guest, accepted) = echo_guest().await;
    let (addr, relay) = endpoint_for(&pki, patient(), &["127.0.0.1"]).await;
    let line = relay::request_line(VM, guest.port());
    // The control plane's own certificate does not help from another address.
    let err = call_from("127.0.0.2", addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
        .await
        .expect_err("a caller from another address was let in");
    eprintln!("from 127.0.0.2: {err}");
    // Raw: closed with not one byte of a handshake answered, long before any
    // deadline.
    let mut tcp = connect_from("127.0.0.2", addr).await.unwrap();
    let _ = tcp.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00]).await;
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), tcp.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "left open");
    assert!(got.is_empty(), "answered: {got:?}");
    eventually("both refusals counted", || {
        relay.refused("not_control_plane") == 2
    })
    .await;
    assert_eq!(relay.refused("handshake_timeout"), 0);
    assert_eq!(relay.open_connections(), 0);
    assert_eq!(accepted.load(Ordering::SeqCst), 0, "nothing dialed");
    // From the control plane's address, the same call is relayed.
    let (answer, _tls) = call(addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
        .await
        .unwrap();
    assert_eq!(answer, "OK\n");
    // An address added to the control planes is let in from then on.
    relay.set_control_planes(ControlPlanes::new(
        ["127.0.0.1".parse().unwrap()],
        &["127.0.0.2/32".parse().unwrap()],
    ));
    let (answer, _tls) = call_from("127.0.0.2", addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
        .await
        .unwrap();
    assert_eq!(answer, "OK\n");
}

#[tokio::test]
async fn one_source_at_its_share_leaves_the_control_planes_slots() {
    let pki = Pki::new("cluster CA");
    let (guest, _) = echo_guest().await;
    let mut limits = patient();
    // Two of the eight may be in their handshake: the flood's two, until
    // the other replica's newcomer cuts one.
    limits.max_connections = 8;
    limits.max_connections_per_source = 2;
    // Two replicas; the one at 127.0.0.3 floods with half-open connections.
    let (addr, relay) = endpoint_for(&pki, limits, &["127.0.0.1", "127.0.0.3"]).await;
    let mut flood = Vec::new();
    for _ in 0..4 {
        flood.push(connect_from("127.0.0.3", addr).await.unwrap());
    }
    eventually("two flooding connections closed at their share", || {
        relay.refused("max_connections_per_source") == 2 && relay.open_connections() == 2
    })
    .await;
    let line = relay::request_line(VM, guest.port());
    let (answer, _tls) = call(addr, &pki.ca_pem, Some(&pki.control_plane()), &line)
        .await
        .unwrap();
    assert_eq!(answer, "OK\n");
    assert_eq!(relay.refused("handshake_cut"), 1);
}

#[tokio::test]
async fn a_handshake_not_done_by_its_deadline_is_cut_and_counted() {
    let pki = Pki::new("cluster CA");
    let mut limits = Limits::default();
    limits.handshake_timeout = Duration::from_millis(300);
    limits.request_timeout = Duration::from_secs(60);
    let (addr, relay) = endpoint_for(&pki, limits, &["127.0.0.1"]).await;
    let mut silent = connect_from("127.0.0.1", addr).await.unwrap();
    let mut got = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), silent.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "left open past the handshake deadline");
    eventually("the cut counted and its slot given back", || {
        relay.refused("handshake_timeout") == 1 && relay.open_connections() == 0
    })
    .await;
}
