//! Fakes for the gateway's end-to-end tests, all on loopback: a cluster CA
//! and serving certificate (rcgen), a session signing key, an overlay whose
//! neighbor table is a map the test controls, echo and trap servers, and a
//! raw TLS client for requests `otherix_client::tunnel::open` would not send.

#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use otherix_core::credential::{Claims, KeySet, SigningKey, DEFAULT_TTL};
use otherix_ingress::{DialSource, Gateway, GatewayConfig, Overlay};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer, ServerName};
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

pub const NODE: &str = "gw1";
pub const NET: &str = "ov1";
pub const GUEST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const GUEST_MAC_TEXT: &str = "02:00:00:00:00:01";
pub const LOOPBACK: Ipv4Addr = Ipv4Addr::LOCALHOST;

// ---------------------------------------------------------------- PKI, keys

pub struct Pki {
    pub ca_pem: String,
    pub server: Arc<rustls::ServerConfig>,
}

/// One CA and serving certificate (SAN 127.0.0.1) for the whole test binary.
pub fn pki() -> &'static Pki {
    static PKI: OnceLock<Pki> = OnceLock::new();
    PKI.get_or_init(|| {
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::default();
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "test cluster CA");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf_key = KeyPair::generate().unwrap();
        let leaf_params = CertificateParams::new(vec!["127.0.0.1".to_string(), NODE.to_string()]).unwrap();
        let leaf = leaf_params.signed_by(&leaf_key, &issuer).unwrap();
        let chain = vec![leaf.der().clone(), ca_cert.der().clone()];
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(leaf_key.serialize_der()));
        Pki {
            ca_pem: ca_cert.pem(),
            server: Arc::new(otherix_ingress::server_config(chain, key).unwrap()),
        }
    })
}

pub fn signing_key(kid: &str, seed: u8) -> SigningKey {
    SigningKey::from_seed(kid, [seed; 32]).unwrap()
}

pub fn keyset(keys: &[&SigningKey]) -> KeySet {
    let mut set = KeySet::new();
    for k in keys {
        set.insert(k.kid(), &k.public_key()).unwrap();
    }
    set
}

/// A fresh 128-bit id, hex.
pub fn jti() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let t = OffsetDateTime::now_utc().unix_timestamp_nanos() as u64;
    format!("{:016x}{:016x}", t ^ u64::from(std::process::id()), n)
}

/// Valid-now claims for this gateway, aimed at the guest MAC on `port`.
pub fn claims(port: u16) -> Claims {
    let now = OffsetDateTime::now_utc();
    Claims {
        iss: "cluster1".into(),
        aud: NODE.into(),
        sub: "user:alice".into(),
        tok: None,
        jti: jti(),
        iat: now,
        nbf: now,
        exp: now + DEFAULT_TTL,
        vm: "web01".into(),
        vm_id: "vm-0001".into(),
        net: NET.into(),
        mac: Some(GUEST_MAC_TEXT.into()),
        ip: LOOPBACK.to_string(),
        port,
        until: None,
    }
}

// ------------------------------------------------------------- the overlay

/// An overlay whose neighbor table is a map the test controls; this node's
/// address on every network is 127.0.0.1.
/// (network, IP) → MAC, like the kernel's neighbor tables of the overlays.
pub type NeighborTable = HashMap<(String, Ipv4Addr), [u8; 6]>;

#[derive(Clone, Default)]
pub struct FakeOverlay {
    pub neighbors: Arc<Mutex<NeighborTable>>,
}

impl FakeOverlay {
    pub fn set(&self, ip: Ipv4Addr, mac: [u8; 6]) {
        self.neighbors.lock().unwrap().insert((NET.to_string(), ip), mac);
    }

    pub fn remove(&self, ip: Ipv4Addr) {
        self.neighbors.lock().unwrap().remove(&(NET.to_string(), ip));
    }
}

impl Overlay for FakeOverlay {
    /// The map always answers.
    type Error = std::convert::Infallible;

    fn neighbor_mac(
        &self,
        network: &str,
        ip: Ipv4Addr,
    ) -> impl Future<Output = Result<Option<[u8; 6]>, Self::Error>> + Send {
        let found = self
            .neighbors
            .lock()
            .unwrap()
            .get(&(network.to_string(), ip))
            .copied();
        async move { Ok(found) }
    }

    fn dial_source(&self, _network: &str) -> Option<DialSource> {
        Some(DialSource {
            address: LOOPBACK,
            device: "lo".into(),
        })
    }
}

// --------------------------------------------------------------- a gateway

pub struct Harness {
    pub gateway: Arc<Gateway<FakeOverlay>>,
    pub overlay: FakeOverlay,
    pub addr: SocketAddr,
    pub endpoint: String,
    pub key: SigningKey,
    shutdown: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl Harness {
    /// A gateway on 127.0.0.1:0 trusting key `k1`, with the guest MAC in
    /// the neighbor table for 127.0.0.1; `tweak` adjusts the config.
    pub async fn start(tweak: impl FnOnce(&mut GatewayConfig)) -> Harness {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut config = GatewayConfig::new(addr, NODE);
        config.drain_timeout = Duration::from_secs(2);
        tweak(&mut config);
        let overlay = FakeOverlay::default();
        overlay.set(LOOPBACK, GUEST_MAC);
        let gateway = Arc::new(Gateway::new(config, overlay.clone()).unwrap());
        let key = signing_key("k1", 7);
        gateway.set_keys(keyset(&[&key]));
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(
            Arc::clone(&gateway).run(listener, pki().server.clone(), async move {
                let _ = rx.await;
            }),
        );
        Harness {
            gateway,
            overlay,
            addr,
            endpoint: format!("https://127.0.0.1:{}", addr.port()),
            key,
            shutdown: Some(tx),
            task: Some(task),
        }
    }

    pub fn mint(&self, claims: &Claims) -> String {
        self.key.mint(claims).unwrap()
    }

    /// A valid credential for the guest on `port`.
    pub fn credential(&self, port: u16) -> String {
        self.mint(&claims(port))
    }

    pub async fn open(
        &self,
        credential: &str,
    ) -> Result<otherix_client::tunnel::Tunnel, otherix_client::tunnel::ConnectError> {
        otherix_client::tunnel::open(&self.endpoint, &pki().ca_pem, credential).await
    }

    /// Asks the gateway to stop and waits until `run` returns.
    pub async fn stop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("gateway stops")
                .unwrap()
                .unwrap();
        }
    }

    pub fn begin_stop(&mut self) -> JoinHandle<std::io::Result<()>> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.task.take().expect("running")
    }

    /// A TLS connection to the gateway, no request sent yet.
    pub async fn tls(&self) -> TlsStream<TcpStream> {
        let ca = otherix_tls::cert_from_pem(&pki().ca_pem).unwrap();
        let mut config = otherix_tls::pinned_client_config(ca).unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let tcp = TcpStream::connect(self.addr).await.unwrap();
        TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("127.0.0.1").unwrap(), tcp)
            .await
            .unwrap()
    }

    /// Sends `request` as is and returns the status and body of the answer.
    pub async fn raw(&self, request: &[u8]) -> (u16, String) {
        let mut tls = self.tls().await;
        tls.write_all(request).await.unwrap();
        tls.flush().await.unwrap();
        let answer = read_until_close(&mut tls).await;
        split_response(&answer)
    }

    /// Sends `request` as is and, when the answer is `101`, returns the
    /// tunnel; otherwise panics with the answer.
    pub async fn raw_tunnel(&self, request: &[u8]) -> TlsStream<TcpStream> {
        let mut tls = self.tls().await;
        tls.write_all(request).await.unwrap();
        tls.flush().await.unwrap();
        let head = read_head(&mut tls).await;
        assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
        tls
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// A well-formed connect request head carrying `credential`.
pub fn request(credential: &str) -> String {
    format!(
        "GET /v1/connect HTTP/1.1\r\nHost: gw1\r\nAuthorization: Bearer {credential}\r\nConnection: Upgrade\r\nUpgrade: otherix-tcp\r\n\r\n"
    )
}

/// Reads a response head byte by byte (nothing after it is consumed).
pub async fn read_head<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> String {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte))
            .await
            .expect("answer in time")
            .unwrap();
        assert_eq!(n, 1, "closed after {:?}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    String::from_utf8(head).unwrap()
}

/// Everything until the peer closes (a close without `close_notify` too).
pub async fn read_until_close<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
            .await
            .expect("peer closes in time")
        {
            Ok(0) | Err(_) => return out,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
}

pub fn split_response(answer: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(answer);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    (status, body.to_string())
}

// ------------------------------------------------------------- the guests

/// An echo server; counts the connections it accepted.
pub struct Echo {
    pub port: u16,
    pub connections: Arc<AtomicUsize>,
}

pub async fn echo() -> Echo {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let mut buf = vec![0u8; 256 * 1024];
                loop {
                    match r.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if w.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
                let _ = w.shutdown().await;
            });
        }
    });
    Echo { port, connections }
}

/// A server that reads until the end of stream, then answers with how many
/// bytes it got and closes: it answers only if the client's half-close
/// reached it.
pub async fn count_then_reply() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut all = Vec::new();
                s.read_to_end(&mut all).await.unwrap();
                s.write_all(format!("got {} bytes\n", all.len()).as_bytes())
                    .await
                    .unwrap();
                s.shutdown().await.unwrap();
            });
        }
    });
    port
}

/// A listener that must never see a connection; it does not accept, so any
/// connection would wait in its backlog for [`assert_untouched`].
pub async fn trap() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

pub async fn assert_untouched(trap: &TcpListener) {
    let got = tokio::time::timeout(Duration::from_millis(300), trap.accept()).await;
    assert!(got.is_err(), "the trap listener was dialed: {got:?}");
}

pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("otherix-gw-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits until `cond` holds, for at most 5 s.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting until {what}");
}

/// A TCP connection to `to` from the loopback address `source`
/// (`127.0.0.2`, ...: every 127/8 address is this host's), sending nothing.
pub async fn connect_from(source: &str, to: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(source.parse().unwrap(), 0)).unwrap();
    socket.connect(to).await.unwrap()
}

/// Reads until the peer closes (or resets) `s`; panics if it stays open for
/// `within`. Returns the bytes read first.
pub async fn closed_within(s: &mut TcpStream, within: Duration) -> Vec<u8> {
    let mut got = Vec::new();
    let read = tokio::time::timeout(within, s.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "still open after {within:?}");
    got
}
