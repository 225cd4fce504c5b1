//! Node trust on the testbed, with real agents: roles follow what an admin
//! grants (a running hypervisor becomes a gateway within a heartbeat of
//! `otherix node update`, and stops being one), and certificates are renewed
//! before they expire while the service goes on.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};

const BIN: &str = env!("CARGO_BIN_EXE_otherix");
const WAIT: Duration = Duration::from_secs(60);

fn cluster(hint: &str, gateways: usize, tweak: impl FnOnce(&mut ClusterSpec)) -> Cluster {
    let world = World::new(hint).expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    spec.gateways = gateways;
    tweak(&mut spec);
    Cluster::start(world, spec).expect("cluster starts")
}

/// Overlay `ov` with VM `web` answering HTTP on 8080 with its name.
fn web(c: &Cluster, subnet: &str) {
    c.cli_ok(&["network", "create", "ov", "--type", "overlay", "--subnet", subnet])
        .unwrap();
    c.cli_ok(&[
        "vm",
        "create",
        "web",
        "--network",
        "ov",
        "--exec",
        "otherix guest http --port 8080",
    ])
    .unwrap();
    c.wait_vm_running("web", WAIT).unwrap();
}

/// One HTTP GET through `addr`; the body.
fn get(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: web\r\nConnection: close\r\n\r\n")
        .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split("\r\n\r\n").nth(1).map(|b| b.trim().to_string())
}

/// `web` answers through `otherix forward`, brokered afresh per connection.
fn web_answers(c: &Cluster) {
    let (_fwd, addr) = c.forward("web", 8080).unwrap();
    wait_until("web to answer through a gateway", WAIT, || {
        (get(addr).as_deref() == Some("web")).then_some(())
    })
    .unwrap();
}

#[test]
fn node_update_makes_a_running_hypervisor_a_gateway_and_back() {
    let c = cluster("trust-role", 0, |_| {});
    web(&c, "10.181.0.0/24");
    let ip = c.node("node1").unwrap().ns.ip();
    let addr = format!("{ip}:8443");
    let err = c.cli(&["connect", "web", "8080"]).unwrap();
    let stderr = String::from_utf8_lossy(&err.stderr);
    assert!(stderr.contains("no Ready gateway"), "no gateway yet: {stderr}");

    // Granted: the agent (started without role flags) serves at once.
    c.cli_ok(&["node", "update", "node1", "--gateway", &addr])
        .unwrap();
    wait_until("node1 to serve the gateway", WAIT, || {
        TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(1))
            .ok()
            .map(drop)
    })
    .unwrap();
    web_answers(&c);
    let node = c.cli_json(&["node", "get", "node1"]).unwrap();
    assert_eq!(node["roles"]["gateway"], addr.as_str(), "{node}");
    assert!(c.node("node1").unwrap().data_dir.join("gateway.crt").exists());

    // Withdrawn: the listener goes away and the broker names no gateway.
    c.cli_ok(&["node", "update", "node1", "--no-gateway"]).unwrap();
    wait_until("node1 to stop serving the gateway", WAIT, || {
        TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(1))
            .is_err()
            .then_some(())
    })
    .unwrap();
    let out = c.cli(&["connect", "web", "8080"]).unwrap();
    assert!(!out.status.success());
}

/// `sha256` of a file, and the certificate's expiry (unix seconds).
fn cert_state(path: &Path) -> (String, i64) {
    let pem = std::fs::read_to_string(path).unwrap();
    let der = otherix_tls::cert_from_pem(&pem).unwrap();
    let (_, c) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
    (
        otherix_tls::fingerprint(der.as_ref()),
        c.validity().not_after.timestamp(),
    )
}

fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() as i64
}

#[test]
fn node_and_serving_certificates_are_renewed_before_they_expire() {
    let c = cluster("trust-renew", 1, |spec| {
        spec.extra_server_args = vec!["--node-cert-validity".into(), "12s".into()];
    });
    web(&c, "10.182.0.0/24");
    web_answers(&c);
    let files = [
        c.node("node1").unwrap().data_dir.join("node.crt"),
        c.node("node1").unwrap().data_dir.join("relay.crt"),
        c.node("gw1").unwrap().data_dir.join("node.crt"),
        c.node("gw1").unwrap().data_dir.join("gateway.crt"),
    ];
    wait_until("the relay certificate", WAIT, || files[1].exists().then_some(())).unwrap();
    let first: Vec<(String, i64)> = files.iter().map(|f| cert_state(f)).collect();
    let last_expiry = first.iter().map(|(_, t)| *t).max().unwrap();
    // Renewed at two thirds of their life, so before any expires...
    wait_until("every certificate to be renewed", WAIT, || {
        files
            .iter()
            .zip(&first)
            .all(|(f, (fp, _))| cert_state(f).0 != *fp)
            .then_some(())
    })
    .unwrap();
    // ...and once all the first ones have expired, nothing noticed.
    wait_until("the first certificates to expire", WAIT, || {
        (unix_now() > last_expiry + 1).then_some(())
    })
    .unwrap();
    for name in ["node1", "gw1"] {
        let n = c.cli_json(&["node", "get", name]).unwrap();
        assert_eq!(n["status"], "Ready", "{n}");
    }
    web_answers(&c);
}

#[test]
fn a_gateway_deleted_and_enrolled_again_on_its_data_directory_serves_a_certificate_clients_accept() {
    use otherix_client::tunnel::{gateway, ConnectError, GatewayPin};
    use otherix_client::Client;
    use otherix_proto::BrokerRequest;

    let mut c = cluster("trust-reenroll", 1, |_| {});
    web(&c, "10.184.0.0/24");
    web_answers(&c);
    let dir = c.node("gw1").unwrap().data_dir.clone();
    let (old, _) = cert_state(&dir.join("gateway.crt"));
    // Deleted (its certificates revoked), then enrolled again under its
    // name from the same data directory, without its old client identity.
    c.kill_agent("gw1").unwrap();
    c.cli_ok(&["node", "delete", "gw1"]).unwrap();
    std::fs::remove_file(dir.join("node.crt")).unwrap();
    c.start_agent("gw1").unwrap();
    // The gateway certificate left in the directory is revoked: clients
    // would refuse it. The agent asked for a new one instead...
    wait_until("gw1's new gateway certificate", WAIT, || {
        let fp = dir
            .join("gateway.crt")
            .exists()
            .then(|| cert_state(&dir.join("gateway.crt")).0)?;
        (fp != old).then_some(())
    })
    .unwrap();
    // ...which a client accepts (the TLS and the certificate check only:
    // how soon the guest answers the re-enrolled gateway is the overlay's
    // business).
    let ca_pem = std::fs::read_to_string(c.ca_file()).unwrap();
    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    let admin = Client::new(&c.url, &ca_pem, Some(token.trim().to_string())).unwrap();
    wait_until("a client to accept gw1's gateway", WAIT, || {
        let grant = rt()
            .block_on(admin.broker(&BrokerRequest {
                target: "web".into(),
                port: 8080,
                exclude: vec![],
            }))
            .ok()?;
        match rt().block_on(gateway::Warm::connect(
            &grant.endpoint,
            GatewayPin::of(&grant).ok()?,
            &ca_pem,
        )) {
            Ok(_) => Some(()),
            Err(e @ ConnectError::RevokedGatewayCertificate { .. }) => panic!("{e}"),
            Err(_) => None,
        }
    })
    .unwrap();
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn the_cp_refuses_the_relay_endpoint_of_a_replaced_node() {
    use otherix_client::tunnel::relay as relay_tunnel;
    use otherix_client::Client;
    use otherix_proto::agent::{EnrollRequest, GuestStatus, Heartbeat};
    use otherix_proto::{BrokerRequest, VmState};

    // The CP keeps a connection to node1's relay endpoint ready after each
    // session (long enough here to outlast the replacement below).
    let c = cluster("trust-relay", 0, |s| {
        s.extra_server_args = vec!["--relay-ready-keep".into(), "9s".into()];
    });
    c.cli_ok(&[
        "network",
        "create",
        "lab",
        "--type",
        "bridge",
        "--subnet",
        "10.183.0.0/24",
        "--node",
        "node1",
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
    let vm = c.wait_vm_running("echo1", WAIT).unwrap();
    let ca_pem = std::fs::read_to_string(c.ca_file()).unwrap();
    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    let admin = Client::new(&c.url, &ca_pem, Some(token.trim().to_string())).unwrap();
    let broker = || {
        rt().block_on(admin.broker(&BrokerRequest {
            target: "echo1".into(),
            port: 7,
            exclude: vec![],
        }))
    };
    wait_until("echo1 to be relayed", WAIT, || {
        let b = broker().ok()?;
        rt().block_on(relay_tunnel::open(&c.url, &ca_pem, &b.credential))
            .ok()
            .map(drop)
    })
    .unwrap();

    // node1 is replaced (say, the machine was rebuilt); the old agent, still
    // running, still serves its relay endpoint with its old certificate.
    let ip = c.node("node1").unwrap().ns.ip().to_string();
    let token = c
        .cli_ok(&[
            "node",
            "join-token",
            "create",
            "--name",
            "node1",
            "--hypervisor",
            "--vtep",
            &ip,
            "--replace",
        ])
        .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let csr_pem = rcgen::CertificateParams::new(Vec::<String>::new())
        .unwrap()
        .serialize_request(&key)
        .unwrap()
        .pem()
        .unwrap();
    let anon = Client::new(&c.url, &ca_pem, None).unwrap();
    let enrolled = rt()
        .block_on(anon.enroll(&EnrollRequest {
            join_token: token.trim().into(),
            node: "node1".parse().unwrap(),
            csr_pem,
        }))
        .unwrap();
    let new = Client::with_identity(&c.url, &ca_pem, &enrolled.cert_pem, &key.serialize_pem()).unwrap();
    let vm_id = vm["id"].as_str().unwrap().to_string();
    // The replacement heartbeats (so node1 is Ready), never serving a relay.
    let beat = || {
        rt().block_on(new.heartbeat(&Heartbeat {
            incoming: Default::default(),
            node: "node1".into(),
            vtep: ip.clone(),
            guests: vec![GuestStatus {
                accelerator: None,
                vm_id: vm_id.clone(),
                state: VmState::Running,
                reason: None,
            }],
            applied_version: None,
            roles: None,
            sessions: Default::default(),
            health: vec![],
            netns: None,
            ready_overlays: vec![],
            migrations: vec![],
            session_epoch: None,
            session_events: vec![],
            session_bytes: Vec::new(),
            reads_one_session_revocations: false,
            version: "test".into(),
            accepts_unchanged: false,
            accepts_delta: false,
            accepts_guest_changes: false,
            health_changes_only: false,
        }))
        .unwrap()
    };
    beat();
    let b = broker().expect("node1 is Ready: the broker relays");
    beat();
    let err = rt()
        .block_on(relay_tunnel::open(&c.url, &ca_pem, &b.credential))
        .map(drop)
        .unwrap_err()
        .to_string();
    assert!(err.contains("502") || err.contains("revoked"), "{err}");
    assert!(err.contains("revoked or was not issued to it"), "{err}");
    // The connection made ready before the replacement, to the old agent
    // with its old certificate, was not used either.
    let log = c.cp().unwrap().log();
    assert!(
        log.contains("relay connection to the node made ready")
            && log.contains("a ready relay connection's certificate is no longer the node's"),
        "{log}"
    );
}
