//! Node trust (DESIGN §4): a node is what an admin granted, never what it
//! asserts. Each attack a node — or whoever holds one join token — could try
//! against a real `otherix server`, speaking the agent protocol directly:
//! the refusal, and that nothing changed.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use common::fake_node::{beat, empty_heartbeat, enroll, enroll_as, enroll_raw, join_token_for, node_key, rt};
use common::{Cp, TempDir};
use otherix_client::Client;
use otherix_proto::agent::{CertPurpose, CertificateRequest, Heartbeat};
use x509_parser::extensions::{GeneralName, ParsedExtension};

/// The DNS and IP names, extended key usages (`server`, `client`) and
/// lifetime of a PEM certificate.
struct Cert {
    dns: Vec<String>,
    ips: Vec<String>,
    server_auth: bool,
    client_auth: bool,
    lifetime: Duration,
}

fn cert(pem: &str) -> Cert {
    let der = otherix_tls::cert_from_pem(pem).unwrap();
    let (_, c) = x509_parser::parse_x509_certificate(der.as_ref()).unwrap();
    let mut out = Cert {
        dns: vec![],
        ips: vec![],
        server_auth: false,
        client_auth: false,
        lifetime: Duration::from_secs(
            (c.validity().not_after.timestamp() - c.validity().not_before.timestamp()) as u64,
        ),
    };
    for ext in c.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::SubjectAlternativeName(san) => {
                for n in &san.general_names {
                    match n {
                        GeneralName::DNSName(d) => out.dns.push(d.to_string()),
                        GeneralName::IPAddress(b) if b.len() == 4 => out
                            .ips
                            .push(std::net::Ipv4Addr::new(b[0], b[1], b[2], b[3]).to_string()),
                        _ => {}
                    }
                }
            }
            ParsedExtension::ExtendedKeyUsage(eku) => {
                out.server_auth = eku.server_auth;
                out.client_auth = eku.client_auth;
            }
            _ => {}
        }
    }
    out
}

fn node_field(cp: &Cp, name: &str, field: &str) -> serde_json::Value {
    cp.admin().json(&["node", "get", name])[field].clone()
}

fn hv_token(cp: &Cp, name: &str, vtep: &str, more: &[&str]) -> String {
    let mut grant = vec!["--hypervisor", "--vtep", vtep];
    grant.extend_from_slice(more);
    join_token_for(cp, name, "1h", &grant)
}

#[test]
fn a_second_join_token_cannot_take_over_an_enrolled_node() {
    let cp = Cp::start();
    let admin = cp.admin();
    let n1 = enroll_as(&cp, "node1", "10.213.1.11", false);
    beat(&n1, "node1", "10.213.1.11", true, None).unwrap();

    // An admin cannot even mint one by mistake...
    let err = admin.fails(&["node", "join-token", "create", "--name", "node1", "--hypervisor"]);
    assert!(
        err.contains("already enrolled") && err.contains("--replace"),
        "{err}"
    );
    // ...a token for another name does not enroll this one...
    let other = hv_token(&cp, "node7", "10.213.1.17", &[]);
    let err = enroll(&cp, &other, "node1").unwrap_err();
    assert_eq!(err.status(), Some(403), "{err}");
    assert!(
        err.to_string().contains("enrolls node \"node7\", not \"node1\""),
        "{err}"
    );
    // ...and one minted before the name was enrolled is superseded by the
    // enrollment: not usable then, nor after the node is deleted.
    let early_a = hv_token(&cp, "race", "10.213.1.18", &[]);
    let early_b = hv_token(&cp, "race", "10.213.1.18", &[]);
    let early_c = hv_token(&cp, "race", "10.213.1.18", &[]);
    enroll(&cp, &early_a, "race").unwrap();
    let err = enroll(&cp, &early_b, "race").unwrap_err();
    assert_eq!(err.status(), Some(401), "{err}");
    assert!(err.to_string().contains("superseded"), "{err}");
    admin.ok(&["node", "delete", "race"]);
    let err = enroll(&cp, &early_c, "race").unwrap_err();
    assert!(
        err.to_string().contains("superseded"),
        "after the delete too: {err}"
    );

    // The real node is untouched: it still heartbeats, still Ready.
    beat(&n1, "node1", "10.213.1.11", true, None).expect("the real node1 still heartbeats");
    assert_eq!(node_field(&cp, "node1", "status"), "Ready");
    let log = cp.log();
    assert!(
        log.contains("join token used for another node's name"),
        "not logged"
    );
    assert!(log.contains("superseded join token used"), "not logged");
}

#[test]
fn a_replacement_revokes_the_old_certificate_everywhere() {
    let cp = Cp::start();
    let admin = cp.admin();
    let old = enroll_as(&cp, "node1", "10.213.1.11", false);
    beat(&old, "node1", "10.213.1.11", true, None).unwrap();
    let err = admin.fails(&["node", "join-token", "create", "--name", "ghost", "--replace"]);
    assert!(err.contains("nothing to replace"), "{err}");

    let token = hv_token(&cp, "node1", "10.213.1.11", &["--replace"]);
    let new = enroll(&cp, &token, "node1").expect("an explicit replacement enrolls");
    beat(&new, "node1", "10.213.1.11", true, None).expect("the new node1 heartbeats");

    let err = beat(&old, "node1", "10.213.1.11", true, None).unwrap_err();
    assert_eq!(err.status(), Some(401), "{err}");
    assert!(err.to_string().contains("revoked"), "{err}");
    let err = rt().block_on(old.wait_desired(1)).unwrap_err();
    assert_eq!(err.status(), Some(401), "the desired-state wait too: {err}");
    let csr_pem = node_key("x").csr_pem;
    let err = rt()
        .block_on(old.certificate(&CertificateRequest {
            purpose: CertPurpose::Node,
            csr_pem,
        }))
        .unwrap_err();
    assert_eq!(err.status(), Some(401), "and certificate renewal: {err}");

    let audit = admin.json(&["audit", "--target", "node1"]);
    let actions: Vec<&str> = audit
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert!(
        actions.contains(&"node_enroll")
            && actions.contains(&"node_replace")
            && actions.contains(&"node_join_token"),
        "{actions:?}"
    );
}

#[test]
fn deleting_a_node_revokes_its_certificate() {
    let cp = Cp::start();
    let n1 = enroll_as(&cp, "node1", "10.213.1.11", false);
    beat(&n1, "node1", "10.213.1.11", true, None).unwrap();
    cp.admin().ok(&["node", "delete", "node1"]);
    let err = beat(&n1, "node1", "10.213.1.11", true, None).unwrap_err();
    assert_eq!(err.status(), Some(401), "{err}");
    // The name is free again, for a new token.
    let n1 = enroll(&cp, &hv_token(&cp, "node1", "10.213.1.11", &[]), "node1").unwrap();
    beat(&n1, "node1", "10.213.1.11", true, None).unwrap();
}

#[test]
fn roles_and_memberships_a_node_asserts_change_nothing() {
    let cp = Cp::start();
    let admin = cp.admin();
    for (net, subnet) in [("tenant-a", "10.100.0.0/24"), ("tenant-b", "10.101.0.0/24")] {
        admin.ok(&["network", "create", net, "--type", "overlay", "--subnet", subnet]);
    }
    let na = enroll_as(&cp, "na", "10.213.1.11", false);
    let nb = enroll_as(&cp, "nb", "10.213.1.12", false);
    let gw = enroll_as(&cp, "gw", "10.213.1.13", true);
    beat(&na, "na", "10.213.1.11", true, None).unwrap();
    beat(&nb, "nb", "10.213.1.12", true, None).unwrap();
    beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();
    admin.ok(&["vm", "create", "a1", "--network", "tenant-a", "--node", "na"]);
    admin.ok(&["vm", "create", "b1", "--network", "tenant-b", "--node", "nb"]);
    let id = |vm: &str| admin.json(&["vm", "get", vm])["id"].as_str().unwrap().to_string();
    common::fake_node::beat_running(&na, "na", "10.213.1.11", &[id("a1")]);
    common::fake_node::beat_running(&nb, "nb", "10.213.1.12", &[id("b1")]);
    beat(&gw, "gw", "10.213.1.13", false, Some("10.213.1.13:8443")).unwrap();

    // nb, hosting only tenant B, reports sessions on tenant A.
    let d = rt()
        .block_on(nb.heartbeat(&Heartbeat {
            node: "nb".into(),
            vtep: "10.213.1.12".into(),
            sessions: [("tenant-a".to_string(), 1)].into(),
            ..empty_heartbeat()
        }))
        .unwrap();
    let overlays: Vec<&str> = d.overlays.iter().map(|o| o.network.as_str()).collect();
    assert_eq!(overlays, ["tenant-b"], "sessions reported its way into tenant-a");

    // nb claims the gateway role.
    let err = beat(&nb, "nb", "10.213.1.12", true, Some("10.213.1.12:8443")).unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("differ from its grant"), "{err}");
    let node = admin.json(&["node", "get", "nb"]);
    assert_eq!(node["roles"]["gateway"], serde_json::Value::Null, "{node}");
    assert!(
        node["status_reason"]
            .as_str()
            .unwrap_or_default()
            .contains("gateway 10.213.1.12:8443"),
        "node get shows why: {node}"
    );
    let overlays: Vec<&str> = node["overlays"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_str().unwrap())
        .collect();
    assert_eq!(overlays, ["tenant-b"]);
    // Every credential for tenant A names the granted gateway, never nb.
    let broker = Client::new(&cp.url, &cp.ca_pem(), Some(common::admin_token(&cp))).unwrap();
    for _ in 0..20 {
        let b = rt()
            .block_on(broker.broker(&otherix_proto::BrokerRequest {
                target: "a1".into(),
                port: 22,
                exclude: vec![],
            }))
            .unwrap();
        assert_eq!(b.endpoint, "https://10.213.1.13:8443");
    }
    let log = cp.log();
    assert!(log.contains("heartbeat refused"), "the refusal is logged");
    // An accepted heartbeat clears the reason.
    beat(&nb, "nb", "10.213.1.12", true, None).unwrap();
    assert_eq!(node_field(&cp, "nb", "status_reason"), serde_json::Value::Null);
}

#[test]
fn the_vtep_is_the_connections_source_or_what_an_admin_set() {
    let cp = Cp::start();
    let token = join_token_for(&cp, "n1", "1h", &["--hypervisor"]);
    let n1 = enroll(&cp, &token, "n1").unwrap();
    let err = beat(&n1, "n1", "10.9.9.9", true, None).unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("comes from 127.0.0.1"), "{err}");
    assert_eq!(
        node_field(&cp, "n1", "vtep"),
        serde_json::Value::Null,
        "nothing recorded"
    );
    // Its source here is loopback (as behind a proxy on the CP's host): no
    // VTEP. (A node's own source address is its VTEP on the testbed, in
    // every e2e test.)
    let err = beat(&n1, "n1", "127.0.0.1", true, None).unwrap_err();
    assert!(err.to_string().contains("loopback"), "{err}");
    // Behind NAT the admin says where it is.
    cp.admin().ok(&["node", "update", "n1", "--vtep", "10.9.9.9"]);
    beat(&n1, "n1", "10.9.9.9", true, None).expect("the admin's VTEP");
    assert_eq!(node_field(&cp, "n1", "vtep"), "10.9.9.9");
}

#[test]
fn node_update_grants_and_withdraws_roles_and_audits_them() {
    let cp = Cp::start();
    let admin = cp.admin();
    admin.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.100.0.0/24",
    ]);
    let n1 = enroll_as(&cp, "n1", "10.213.1.11", false);
    let n2 = enroll_as(&cp, "n2", "10.213.1.12", false);
    beat(&n1, "n1", "10.213.1.11", true, None).unwrap();
    beat(&n2, "n2", "10.213.1.12", true, None).unwrap();
    admin.ok(&["vm", "create", "web", "--network", "ov", "--node", "n2"]);
    let unpinned = |c: &Client, name: &str, vtep: &str| {
        rt().block_on(c.heartbeat(&Heartbeat {
            node: name.into(),
            vtep: vtep.into(),
            ..empty_heartbeat()
        }))
        .unwrap()
    };
    let d = unpinned(&n1, "n1", "10.213.1.11");
    assert_eq!(d.roles.gateway, None);
    assert!(d.overlays.is_empty(), "n1 hosts nothing");

    let shown = admin.json(&["node", "update", "n1", "--gateway", "10.213.1.11:8443"]);
    assert_eq!(shown["roles"]["gateway"], "10.213.1.11:8443", "{shown}");
    let d = unpinned(&n1, "n1", "10.213.1.11");
    assert_eq!(d.roles.gateway.as_deref(), Some("10.213.1.11:8443"));
    assert_eq!(d.overlays.len(), 1, "a gateway covers every overlay with VMs");
    // Now it may have a gateway certificate, for exactly the granted address.
    let csr_pem = node_key("x").csr_pem;
    let gw = rt()
        .block_on(n1.certificate(&CertificateRequest {
            purpose: CertPurpose::Gateway,
            csr_pem: csr_pem.clone(),
        }))
        .unwrap();
    let c = cert(&gw.cert_pem);
    assert_eq!((c.server_auth, c.client_auth), (true, false), "serverAuth only");
    assert_eq!(c.ips, ["10.213.1.11"]);
    assert_eq!(c.dns, ["n1.gateway.otherix"]);

    admin.ok(&["node", "update", "n1", "--no-gateway"]);
    let d = unpinned(&n1, "n1", "10.213.1.11");
    assert_eq!(d.roles.gateway, None);
    assert!(d.overlays.is_empty(), "withdrawn with the role");
    let err = rt()
        .block_on(n1.certificate(&CertificateRequest {
            purpose: CertPurpose::Gateway,
            csr_pem,
        }))
        .unwrap_err();
    assert_eq!(err.status(), Some(409), "{err}");
    assert!(err.to_string().contains("no gateway role"), "{err}");

    let err = admin.fails(&["node", "update", "n1", "--gateway", "n1:8443"]);
    assert!(err.contains("expected IP:PORT"), "{err}");
    let err = admin.fails(&["node", "update", "n1"]);
    assert!(err.contains("nothing to change"), "{err}");
    let audit = admin.ok(&["audit", "--target", "n1"]);
    assert!(
        audit.contains("no gateway, relay default, vtep 10.213.1.11 -> hypervisor, gateway 10.213.1.11:8443"),
        "{audit}"
    );
}

#[test]
fn every_certificate_has_one_purpose_and_a_short_life() {
    let cp = Cp::start();
    let token = join_token_for(&cp, "n1", "1h", &["--hypervisor", "--vtep", "10.213.1.11"]);
    let n1 = enroll_raw(&cp, &token, "n1").unwrap();
    let c = cert(&n1.cert_pem);
    assert_eq!(c.dns, ["n1.nodes.otherix"], "a name no server can take");
    assert!(c.ips.is_empty());
    assert_eq!((c.server_auth, c.client_auth), (false, true), "clientAuth only");
    assert!(
        c.lifetime <= Duration::from_secs(30 * 86_400 + 600),
        "{:?}",
        c.lifetime
    );

    // A hypervisor's relay endpoint: serverAuth for NODE.relay.otherix.
    let client = n1.client(&cp);
    beat(&client, "n1", "10.213.1.11", true, None).unwrap();
    let relay = rt()
        .block_on(client.certificate(&CertificateRequest {
            purpose: CertPurpose::Relay,
            csr_pem: node_key("x").csr_pem,
        }))
        .unwrap();
    let c = cert(&relay.cert_pem);
    assert_eq!(c.dns, ["n1.relay.otherix"]);
    assert!(
        c.ips.is_empty(),
        "no address: it must never pass for a gateway there"
    );
    assert_eq!((c.server_auth, c.client_auth), (true, false));

    // The CP's own: serverAuth, control-plane.otherix.
    let mut cp_cert = None;
    let ca = otherix_tls::cert_from_pem(&cp.ca_pem()).unwrap();
    let mut config = otherix_tls::pinned_client_config(ca).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    rt().block_on(async {
        let addr: SocketAddr = cp.url.trim_start_matches("https://").parse().unwrap();
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(otherix_tls::cp_server_name(), tcp)
            .await
            .unwrap();
        let der = tls.get_ref().1.peer_certificates().unwrap()[0].clone();
        cp_cert = Some(otherix_tls::cert_to_pem(der.as_ref()));
    });
    let c = cert(&cp_cert.unwrap());
    assert!(
        c.dns.contains(&"control-plane.otherix".to_string()),
        "{:?}",
        c.dns
    );
    assert_eq!((c.server_auth, c.client_auth), (true, false));

    // Names that read as servers are no node names.
    for bad in ["localhost", "control-plane", "127"] {
        let err = cp
            .admin()
            .fails(&["node", "join-token", "create", "--name", bad, "--hypervisor"]);
        assert!(
            err.contains("reserved") || err.contains("all digits"),
            "{bad}: {err}"
        );
    }
}

/// Serves `cert_pem`/`key_pem` (with the cluster CA) on 127.0.0.1 and
/// records whether any request bytes arrived after a handshake.
fn impostor(cert_pem: &str, key_pem: &str, ca_pem: &str) -> (SocketAddr, Arc<std::sync::atomic::AtomicBool>) {
    use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let leaf = otherix_tls::cert_from_pem(cert_pem).unwrap();
    let ca = otherix_tls::cert_from_pem(ca_pem).unwrap();
    let key = rcgen::KeyPair::from_pem(key_pem).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(otherix_tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![leaf, ca], key)
        .unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let got_request = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = got_request.clone();
    std::thread::spawn(move || {
        let config = Arc::new(config);
        for conn in listener.incoming() {
            let Ok(mut tcp) = conn else { continue };
            let Ok(mut server) = rustls::ServerConnection::new(config.clone()) else {
                continue;
            };
            let mut stream = rustls::Stream::new(&mut server, &mut tcp);
            let mut buf = [0u8; 256];
            if let Ok(n) = std::io::Read::read(&mut stream, &mut buf) {
                if n > 0 {
                    flag.store(true, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
    });
    (addr, got_request)
}

#[test]
fn the_cli_refuses_a_server_presenting_a_node_or_gateway_certificate() {
    let cp = Cp::start();
    let admin = cp.admin();
    // A gateway granted 127.0.0.1 (an admin's mistake, or a compromised
    // admin-granted address): its certificate names 127.0.0.1, like the CP's.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let gw = enroll_raw(
        &cp,
        &join_token_for(&cp, "gw", "1h", &["--gateway", &addr, "--vtep", "127.0.0.1"]),
        "gw",
    )
    .unwrap();
    let client = gw.client(&cp);
    rt().block_on(client.heartbeat(&Heartbeat {
        node: "gw".into(),
        vtep: "127.0.0.1".into(),
        ..empty_heartbeat()
    }))
    .unwrap();
    let common::fake_node::FakeNodeKey { key, csr_pem } = node_key("fresh");
    let gw_cert = rt()
        .block_on(client.certificate(&CertificateRequest {
            purpose: CertPurpose::Gateway,
            csr_pem,
        }))
        .unwrap();
    assert_eq!(cert(&gw_cert.cert_pem).ips, ["127.0.0.1"]);

    // Clients reach a gateway by the node the broker names: a certificate
    // for the same address but another node's (or a relay's) is refused.
    let (fake, _) = impostor(&gw_cert.cert_pem, &key.serialize_pem(), &cp.ca_pem());
    let url = format!("https://{fake}");
    let current = [otherix_tls::fingerprint(
        otherix_tls::cert_from_pem(&gw_cert.cert_pem).unwrap().as_ref(),
    )];
    let open_as = |node: &str| {
        rt().block_on(otherix_client::tunnel::open_gateway(
            &url,
            otherix_client::tunnel::GatewayPin {
                node,
                certs: &current,
            },
            &cp.ca_pem(),
            "x",
        ))
        .map(drop)
        .unwrap_err()
        .to_string()
    };
    let err = open_as("gw2");
    assert!(
        err.contains("gw2.gateway.otherix"),
        "another node's gateway passed: {err}"
    );
    let err = open_as("gw");
    assert!(
        !err.contains("certificate"),
        "its own gateway's certificate is accepted: {err}"
    );

    for (what, cert_pem, key_pem) in [
        ("gateway", gw_cert.cert_pem.clone(), key.serialize_pem()),
        ("node", gw.cert_pem.clone(), gw.key_pem.clone()),
    ] {
        let (fake, got_request) = impostor(&cert_pem, &key_pem, &cp.ca_pem());
        let url = format!("https://{fake}");
        // With the saved login pointed at the impostor: no token goes out.
        let config = std::fs::read_to_string(&admin.config)
            .unwrap()
            .replace(&cp.url, &url);
        let moved = TempDir::new("impostor");
        let path = moved.path().join("config.toml");
        std::fs::write(&path, config).unwrap();
        let cli = common::Cli {
            config: path,
            token: None,
        };
        let err = cli.fails(&["vm", "list"]);
        assert!(
            err.contains("control-plane.otherix") && err.contains("node or gateway"),
            "{what}: {err}"
        );
        // Nor does a login trusting the CA file.
        let err = cp.cli(&format!("login-{what}")).fails(&[
            "login",
            "--server",
            &url,
            "--token-file",
            cp.admin_token_file().to_str().unwrap(),
            "--ca-file",
            cp.data_dir().join("ca.crt").to_str().unwrap(),
        ]);
        assert!(
            err.contains("control-plane.otherix") && err.contains("node or gateway"),
            "{what}: {err}"
        );
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !got_request.load(std::sync::atomic::Ordering::SeqCst),
            "{what}: the impostor received a request"
        );
    }
}

#[test]
fn the_data_directory_is_tightened_at_start() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new("perms");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cp = Cp::start_in(dir);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&cp.data_dir()), 0o700);
    // The key material in the directory: the store, or the secret key that
    // seals the CA key in PostgreSQL.
    let private = if common::on_postgres() {
        "secret.key"
    } else {
        "otherix.db"
    };
    assert_eq!(mode(&cp.data_dir().join(private)), 0o600);
    assert!(cp.log().contains("tightened permissions"), "logged");
}

#[test]
fn a_renewed_node_certificate_works_and_the_cp_records_it() {
    let cp = Cp::start_with(TempDir::new("cp"), &["--node-cert-validity", "12s"]);
    let n1 = enroll_raw(&cp, &hv_token(&cp, "n1", "10.213.1.11", &[]), "n1").unwrap();
    assert!(cert(&n1.cert_pem).lifetime <= Duration::from_secs(12 + 300 + 5));
    let client = n1.client(&cp);
    beat(&client, "n1", "10.213.1.11", true, None).unwrap();
    let common::fake_node::FakeNodeKey { key, csr_pem } = node_key("fresh");
    let renewed = rt()
        .block_on(client.certificate(&CertificateRequest {
            purpose: CertPurpose::Node,
            csr_pem,
        }))
        .unwrap();
    let new = Client::with_identity(&cp.url, &cp.ca_pem(), &renewed.cert_pem, &key.serialize_pem()).unwrap();
    beat(&new, "n1", "10.213.1.11", true, None).expect("the renewed certificate heartbeats");
    let c = cert(&renewed.cert_pem);
    assert_eq!(
        (c.dns.as_slice(), c.client_auth, c.server_auth),
        (["n1.nodes.otherix".to_string()].as_slice(), true, false)
    );
}

#[test]
fn agent_endpoints_refuse_a_caller_without_a_node_certificate_before_reading_its_body() {
    let cp = Cp::start();
    let ca = otherix_tls::cert_from_pem(&cp.ca_pem()).unwrap();
    let mut config = otherix_tls::pinned_client_config(ca).unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let addr: SocketAddr = cp.url.trim_start_matches("https://").parse().unwrap();
    for path in ["/v1/agent/heartbeat", "/v1/agent/certificate"] {
        let answer = rt().block_on(async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config.clone()))
                .connect(otherix_tls::cp_server_name(), tcp)
                .await
                .unwrap();
            // A 2 MB body announced, never sent: the answer must not wait for it.
            let head = format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2000000\r\n\r\n{{"
            );
            tls.write_all(head.as_bytes()).await.unwrap();
            let mut buf = vec![0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(3), tls.read(&mut buf))
                .await
                .expect("answered without waiting for the body")
                .unwrap();
            String::from_utf8_lossy(&buf[..n]).to_string()
        });
        assert!(answer.starts_with("HTTP/1.1 401"), "{path}: {answer}");
        assert!(answer.contains("client certificate"), "{path}: {answer}");
    }
}

#[test]
fn strings_a_node_sends_are_bounded_and_never_reach_logs_or_terminals_raw() {
    let cp = Cp::start();
    let token = hv_token(&cp, "n1", "10.9.9.9", &[]);
    let n1 = enroll(&cp, &token, "n1").unwrap();
    let send = |hb: Heartbeat| rt().block_on(n1.heartbeat(&hb));
    let base = || Heartbeat {
        node: "n1".into(),
        vtep: "10.9.9.9".into(),
        ..empty_heartbeat()
    };
    // A version carrying a terminal escape sequence: refused, not stored.
    let err = send(Heartbeat {
        version: "0.1.0\u{1b}]0;pwned\u{7}".into(),
        ..base()
    })
    .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    assert!(
        err.to_string()
            .contains("heartbeat field version: contains control characters"),
        "{err}"
    );
    let shown = cp.admin().ok(&["node", "get", "n1"]);
    assert!(!shown.contains('\u{1b}'), "{shown}");
    assert_eq!(
        node_field(&cp, "n1", "status_reason"),
        "heartbeat field version: contains control characters"
    );
    // A refused VTEP that would forge a log line, and a 2 MB one: refused
    // before it is compared, logged or stored.
    let forged = "10.1.1.1\nINFO otherix: node n2 enrolled by admin";
    let err = send(Heartbeat {
        vtep: forged.into(),
        ..base()
    })
    .unwrap_err();
    assert_eq!(err.status(), Some(400), "{err}");
    let huge = "1".repeat(2 << 20);
    let err = send(Heartbeat { vtep: huge, ..base() }).unwrap_err();
    assert!(err.to_string().contains("bytes; at most 128"), "{err}");
    let reason = node_field(&cp, "n1", "status_reason");
    assert!(reason.as_str().unwrap().len() < 200, "{reason}");
    let log = cp.log();
    assert!(
        !log.contains("INFO otherix: node n2 enrolled"),
        "a forged log line"
    );
    assert!(!log.contains(&"1".repeat(1000)), "the huge VTEP was logged");
    // A well-formed heartbeat is accepted and clears the reason.
    send(Heartbeat {
        version: "0.1.0".into(),
        ..base()
    })
    .expect("a good heartbeat");
    assert_eq!(node_field(&cp, "n1", "status_reason"), serde_json::Value::Null);
    assert_eq!(node_field(&cp, "n1", "agent_version"), "0.1.0");
}
