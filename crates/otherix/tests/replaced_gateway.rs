//! A replaced or deleted gateway's old machine gets no credential (issue
//! 26): it still holds a certificate of the cluster CA with the node's
//! gateway name and address, valid for weeks, and may still answer at the
//! granted address. `otherix connect` presents the credential only to a
//! gateway certificate the control plane stands behind for the node now
//! (the broker answer's `gateway_certs`); a renewed one is accepted.
//!
//! The gateway node speaks the agent protocol directly; at its granted
//! address a TLS listener serves whichever certificate and key the test
//! hands it — the old machine's, the new one's — and counts the request
//! bytes that reach it.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use common::fake_node::{empty_heartbeat, enroll_raw, join_token_for, node_key, rt, running_on_overlay};
use common::{wait_for, Cli, Cp};
use otherix_client::Client;
use otherix_proto::agent::{CertPurpose, CertificateRequest, Heartbeat};

/// A TLS listener at a fixed address serving the certificate it was last
/// given (with the cluster CA), reading once per connection: how many
/// connections it has finished with, and how many request bytes reached it.
struct Listener {
    addr: SocketAddr,
    config: Arc<Mutex<Option<Arc<rustls::ServerConfig>>>>,
    handled: Arc<AtomicUsize>,
    request_bytes: Arc<AtomicUsize>,
}

impl Listener {
    fn bind() -> Listener {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let l = Listener {
            addr: listener.local_addr().unwrap(),
            config: Arc::default(),
            handled: Arc::default(),
            request_bytes: Arc::default(),
        };
        let (config, handled, bytes) = (l.config.clone(), l.handled.clone(), l.request_bytes.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut tcp) = conn else { continue };
                let Some(config) = config.lock().unwrap().clone() else {
                    continue;
                };
                let (handled, bytes) = (handled.clone(), bytes.clone());
                // A thread each: a connection made ready and held unused
                // must not keep the next one waiting.
                std::thread::spawn(move || {
                    let mut server = rustls::ServerConnection::new(config).unwrap();
                    let mut stream = rustls::Stream::new(&mut server, &mut tcp);
                    // The handshake, then the first bytes of a request, if
                    // any come: a client that refused the certificate
                    // closes instead.
                    let mut buf = [0u8; 4096];
                    if let Ok(n) = std::io::Read::read(&mut stream, &mut buf) {
                        bytes.fetch_add(n, Ordering::SeqCst);
                    }
                    drop(tcp);
                    handled.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        l
    }

    /// Serves `cert` from now on.
    fn serve(&self, cert: &Issued, ca_pem: &str) {
        use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
        let leaf = otherix_tls::cert_from_pem(&cert.cert_pem).unwrap();
        let ca = otherix_tls::cert_from_pem(ca_pem).unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
            rcgen::KeyPair::from_pem(&cert.key_pem).unwrap().serialize_der(),
        ));
        let mut config = rustls::ServerConfig::builder_with_provider(otherix_tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![leaf, ca], key)
            .unwrap();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        *self.config.lock().unwrap() = Some(Arc::new(config));
    }

    /// Runs `otherix connect web 22` as `cli` and waits until the listener
    /// is done with its connection: the CLI's stderr (it always fails: the
    /// listener never answers) and the request bytes that reached it.
    fn connect(&self, cli: &Cli) -> (String, usize) {
        let (handled, before) = (
            self.handled.load(Ordering::SeqCst),
            self.request_bytes.load(Ordering::SeqCst),
        );
        let err = cli.fails(&["connect", "web", "22"]);
        wait_for(|| (self.handled.load(Ordering::SeqCst) > handled).then_some(()));
        (err, self.request_bytes.load(Ordering::SeqCst) - before)
    }

    /// The credential reaches whoever serves `cert` at the gateway's address.
    fn accepts(&self, cli: &Cli, cert: &Issued, ca_pem: &str) {
        self.serve(cert, ca_pem);
        let (err, sent) = self.connect(cli);
        assert!(
            sent > 0,
            "no request reached the gateway's current certificate: {err}"
        );
    }

    /// Whoever serves `cert` at the gateway's address gets no credential,
    /// nor any byte of a request.
    fn refuses(&self, cli: &Cli, cert: &Issued, ca_pem: &str) {
        self.serve(cert, ca_pem);
        let (err, sent) = self.connect(cli);
        assert!(
            err.contains("no longer stands behind for node gw") && err.contains("credential was not sent"),
            "{err}"
        );
        assert!(err.contains(&cert.fingerprint()), "names the certificate: {err}");
        assert_eq!(
            sent, 0,
            "request bytes reached the old certificate's holder: {err}"
        );
    }
}

/// A gateway serving certificate and its key.
struct Issued {
    cert_pem: String,
    key_pem: String,
}

impl Issued {
    fn fingerprint(&self) -> String {
        otherix_tls::fingerprint(otherix_tls::cert_from_pem(&self.cert_pem).unwrap().as_ref())
    }
}

/// The cluster: VM `web` running on hypervisor `hv`, on overlay `ov`, and
/// the listener standing where gateway `gw` is granted.
struct Scene {
    cp: Cp,
    admin: Cli,
    at: Listener,
}

impl Scene {
    fn new() -> Scene {
        let cp = Cp::start();
        let admin = cp.admin();
        running_on_overlay(&cp, &admin, &[("web", "")]);
        Scene {
            cp,
            admin,
            at: Listener::bind(),
        }
    }

    /// Enrolls gateway `gw` at the listener's address with `more` join-token
    /// flags (`--replace`), heartbeats it (so it is Ready and covers `ov`).
    fn enroll_gateway(&self, more: &[&str]) -> Client {
        let addr = self.at.addr.to_string();
        let mut grant = vec!["--gateway", addr.as_str(), "--vtep", "127.0.0.1"];
        grant.extend_from_slice(more);
        let gw = enroll_raw(&self.cp, &join_token_for(&self.cp, "gw", "1h", &grant), "gw")
            .unwrap()
            .client(&self.cp);
        rt().block_on(gw.heartbeat(&Heartbeat {
            node: "gw".into(),
            vtep: "127.0.0.1".into(),
            ..empty_heartbeat()
        }))
        .unwrap();
        gw
    }

    fn ca_pem(&self) -> String {
        self.cp.ca_pem()
    }
}

/// A gateway serving certificate for node `gw`'s own new key, as its agent
/// asks for one (first, or renewing).
fn gateway_cert(gw: &Client) -> Issued {
    let common::fake_node::FakeNodeKey { key, csr_pem } = node_key("gw");
    let cert = rt()
        .block_on(gw.certificate(&CertificateRequest {
            purpose: CertPurpose::Gateway,
            csr_pem,
        }))
        .unwrap();
    Issued {
        cert_pem: cert.cert_pem,
        key_pem: key.serialize_pem(),
    }
}

#[test]
fn a_replaced_gateways_old_certificate_gets_no_credential_and_the_new_one_does() {
    let s = Scene::new();
    let ca = s.ca_pem();
    let old = gateway_cert(&s.enroll_gateway(&[]));
    // Before the replacement the old machine is the gateway: the request
    // reaches it (so the refusal below is the pin's, not the set-up's).
    s.at.accepts(&s.admin, &old, &ca);

    // The machine is rebuilt and enrolled again under its name; the old
    // one, still running, still answers at the address with its old
    // certificate — same name, same IP, 30 days of validity left.
    let new = gateway_cert(&s.enroll_gateway(&["--replace"]));
    s.at.refuses(&s.admin, &old, &ca);
    s.at.accepts(&s.admin, &new, &ca);
}

#[test]
fn a_deleted_and_enrolled_again_gateways_old_certificate_gets_no_credential() {
    let s = Scene::new();
    let ca = s.ca_pem();
    let old = gateway_cert(&s.enroll_gateway(&[]));
    s.admin.ok(&["node", "delete", "gw"]);
    // Deleted: the broker names no gateway at all.
    let err = s.admin.fails(&["connect", "web", "22"]);
    assert!(err.contains("no Ready gateway"), "{err}");

    let gw = s.enroll_gateway(&[]);
    // Enrolled again but not yet issued a gateway certificate: nothing is
    // dialed (not even the old machine).
    let handled = s.at.handled.load(Ordering::SeqCst);
    s.at.serve(&old, &ca);
    let err = s.admin.fails(&["connect", "web", "22"]);
    assert!(
        err.contains("has no certificate the control plane stands behind yet"),
        "{err}"
    );
    assert_eq!(
        s.at.handled.load(Ordering::SeqCst),
        handled,
        "the gateway was dialed"
    );

    let new = gateway_cert(&gw);
    s.at.refuses(&s.admin, &old, &ca);
    s.at.accepts(&s.admin, &new, &ca);
}

#[test]
fn a_renewed_gateway_certificate_is_accepted_and_the_one_before_it_until_the_next_renewal() {
    let s = Scene::new();
    let ca = s.ca_pem();
    let gw = s.enroll_gateway(&[]);
    let first = gateway_cert(&gw);
    s.at.accepts(&s.admin, &first, &ca);
    // Renewed: the agent switches to the new one; until then it serves
    // the one it renews, which stays good.
    let second = gateway_cert(&gw);
    s.at.accepts(&s.admin, &second, &ca);
    s.at.accepts(&s.admin, &first, &ca);
    // Renewed again: the control plane keeps the newest two, so the first
    // is revoked.
    let third = gateway_cert(&gw);
    s.at.accepts(&s.admin, &third, &ca);
    s.at.refuses(&s.admin, &first, &ca);
    s.at.accepts(&s.admin, &second, &ca);
}

#[test]
fn forward_and_its_ready_connections_never_present_a_credential_to_a_replaced_gateways_old_certificate() {
    use std::io::{BufRead, Read, Write};
    let s = Scene::new();
    let ca = s.ca_pem();
    let old = gateway_cert(&s.enroll_gateway(&[]));
    let new = gateway_cert(&s.enroll_gateway(&["--replace"]));
    s.at.serve(&old, &ca);
    let mut fwd = Killed(
        std::process::Command::new(common::BIN)
            .args(["forward", "web", "22", "--ready", "2"])
            .env("OTHERIX_CONFIG", &s.admin.config)
            .env_remove("RUST_LOG")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufReader::new(fwd.0.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let local: SocketAddr = line.trim().parse().expect("the forward's address");
    // The connection it makes ready at start: a handshake, then nothing.
    wait_for(|| (s.at.handled.load(Ordering::SeqCst) >= 1).then_some(()));
    // A connection through it: brokered again, refused again; it is closed.
    let mut c = std::net::TcpStream::connect(local).unwrap();
    c.set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    c.write_all(b"SSH-2.0-test\r\n").unwrap();
    let mut got = vec![];
    let _ = c.read_to_end(&mut got);
    assert!(got.is_empty(), "{got:?}");
    wait_for(|| (s.at.handled.load(Ordering::SeqCst) >= 2).then_some(()));
    assert_eq!(
        s.at.request_bytes.load(Ordering::SeqCst),
        0,
        "a request reached the old certificate"
    );

    // The new machine's certificate there: the next connection's request
    // reaches it (the forward itself was fine).
    s.at.serve(&new, &ca);
    let mut c = std::net::TcpStream::connect(local).unwrap();
    c.write_all(b"SSH-2.0-test\r\n").unwrap();
    wait_for(|| (s.at.request_bytes.load(Ordering::SeqCst) > 0).then_some(()));
}

/// A child process killed when dropped, the test failing or not.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
