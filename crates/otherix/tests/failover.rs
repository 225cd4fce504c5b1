//! Clients that know several control planes (replicas of one cluster on one
//! PostgreSQL database): the CLI and the client library use the next one
//! when the one in use cannot be reached, never send a request that was
//! sent once to another, and never skip over a server whose certificate is
//! not the cluster's control plane's.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::curl;

use common::{admin_token, Cli, Cp, TempDir};
use otherix_client::{Client, ClientError};
use otherix_testbed::postgres::Postgres;
use tokio::io::AsyncReadExt;

/// Two control planes on one database, the second with the first's secret key.
struct Replicas {
    _pg: Postgres,
    a: Cp,
    b: Cp,
}

fn replicas() -> Replicas {
    let pg = Postgres::start_temporary().expect("a PostgreSQL server");
    let url = pg.create_database("otherix").expect("a database");
    let a = Cp::start_with(TempDir::new("fo-a"), &["--database", &url]);
    let dir = TempDir::new("fo-b");
    let key = dir.path().join("secret.key");
    std::fs::copy(a.data_dir().join("secret.key"), &key).unwrap();
    let b = Cp::start_with(
        dir,
        &["--database", &url, "--secret-key-file", key.to_str().unwrap()],
    );
    Replicas { _pg: pg, a, b }
}

/// A CLI logged in to both, `first` listed first.
fn login_both(first: &Cp, second: &Cp, dir: &TempDir) -> Cli {
    let cli = Cli {
        config: dir.path().join("both.toml"),
        token: None,
    };
    cli.ok(&[
        "login",
        "--server",
        &first.url,
        "--server",
        &second.url,
        "--token-file",
        first.admin_token_file().to_str().unwrap(),
        "--ca-fingerprint",
        &first.fingerprint,
    ]);
    cli
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// An address nothing listens on, held so for as long as the socket lives
/// (bound, never listening: connections to it are refused, and no other
/// test's server can take the port meanwhile).
fn closed_port() -> (socket2::Socket, String) {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
        .unwrap();
    let addr = socket.local_addr().unwrap().as_socket().unwrap();
    (socket, format!("https://{addr}"))
}

#[test]
fn the_cli_goes_on_through_the_next_replica_when_one_is_killed() {
    let mut r = replicas();
    let dir = TempDir::new("fo-cli");
    let cli = login_both(&r.a, &r.b, &dir);
    let saved = std::fs::read_to_string(&cli.config).unwrap();
    assert!(
        saved.contains(&format!("server = [\"{}\", \"{}\"]", r.a.url, r.b.url)),
        "{saved}"
    );
    cli.ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.79.0.0/24",
    ]);
    let whoami = cli.json(&["whoami"]);
    assert_eq!(whoami["name"], "admin");

    r.a.kill9();
    let started = Instant::now();
    cli.ok(&["vm", "create", "web01", "--network", "ov"]);
    let vms = cli.json(&["vm", "list"]);
    assert_eq!(vms[0]["name"], "web01", "{vms}");
    eprintln!("two commands after the kill took {:?}", started.elapsed());
    let version = cli.json(&["version"]);
    assert_eq!(version["server"]["url"], r.b.url.as_str(), "{version}");

    // Both down: one line naming each.
    r.b.kill9();
    let err = cli.fails(&["vm", "list"]);
    assert!(err.contains("no control plane could be reached"), "{err}");
    assert!(err.contains(&r.a.url) && err.contains(&r.b.url), "{err}");
}

#[test]
fn login_takes_the_replica_that_answers_when_the_first_is_down() {
    let r = replicas();
    let dir = TempDir::new("fo-login");
    let (_held, dead) = closed_port();
    let cli = Cli {
        config: dir.path().join("c.toml"),
        token: None,
    };
    cli.ok(&[
        "login",
        "--server",
        &dead,
        "--server",
        &r.b.url,
        "--token-file",
        r.a.admin_token_file().to_str().unwrap(),
        "--ca-fingerprint",
        &r.a.fingerprint,
    ]);
    let saved = std::fs::read_to_string(&cli.config).unwrap();
    assert!(saved.contains(&dead) && saved.contains(&r.b.url), "{saved}");
    assert_eq!(cli.json(&["whoami"])["name"], "admin");
}

/// A TLS server with the control plane's name, from the cluster CA, that
/// reads each request and closes without answering: a replica that died
/// with the request in hand. Counts the requests it read.
async fn black_hole(cp: &Cp) -> (SocketAddr, Arc<AtomicUsize>) {
    let ca_key =
        rcgen::KeyPair::from_pem(&std::fs::read_to_string(cp.data_dir().join("ca.key")).unwrap()).unwrap();
    let issuer = rcgen::Issuer::from_ca_cert_pem(&cp.ca_pem(), ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec![otherix_tls::CP_NAME.to_string()]).unwrap();
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let cert = params.signed_by(&key, &issuer).unwrap();
    let config = rustls::ServerConfig::builder_with_provider(otherix_tls::provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
        )
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let counter = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, counter) = (acceptor.clone(), counter.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let mut buf = vec![0u8; 64 * 1024];
                if let Ok(n) = tls.read(&mut buf).await {
                    if n > 0 {
                        counter.fetch_add(1, Ordering::SeqCst);
                    }
                }
                // Gone, with the request unanswered.
            });
        }
    });
    (addr, seen)
}

#[test]
fn a_request_that_was_sent_is_never_sent_again_to_another_control_plane() {
    // The black hole signs with the CA key in the data directory.
    let cp = Cp::start_embedded(TempDir::new("fo-hole"), &[]);
    let rt = runtime();
    rt.block_on(async {
        let (hole, seen) = black_hole(&cp).await;
        let servers = vec![format!("https://{hole}"), cp.url.clone()];
        let client = Client::new(&servers, &cp.ca_pem(), Some(admin_token(&cp))).unwrap();
        let req = otherix_proto::CreateNetworkRequest {
            name: "once".parse().unwrap(),
            kind: otherix_proto::NetworkType::Overlay,
            subnet: "10.80.0.0/24".into(),
            node: None,
            nodes: Vec::new(),
        };
        let err = client.create_network(&req).await.unwrap_err();
        assert!(matches!(err, ClientError::Protocol { .. }), "{err:?}");
        assert_eq!(seen.load(Ordering::SeqCst), 1, "the black hole read it");
        // The other control plane never saw it.
        let direct = Client::new(&cp.url, &cp.ca_pem(), Some(admin_token(&cp))).unwrap();
        assert!(direct.list_networks().await.unwrap().is_empty());
    });
}

#[test]
fn a_control_plane_that_cannot_be_reached_is_skipped_before_anything_is_sent() {
    let cp = Cp::start();
    let rt = runtime();
    rt.block_on(async {
        let (_held, dead) = closed_port();
        let servers = vec![dead, cp.url.clone()];
        let client = Client::new(&servers, &cp.ca_pem(), Some(admin_token(&cp))).unwrap();
        assert_eq!(client.whoami().await.unwrap().name, "admin");
        assert_eq!(client.server(), cp.url, "it keeps using the one that answered");
    });
}

#[test]
fn a_server_that_is_not_the_clusters_control_plane_is_an_error_not_skipped() {
    // Another cluster's control plane answers first: its CA is not pinned.
    let ours = Cp::start();
    let theirs = Cp::start();
    let rt = runtime();
    rt.block_on(async {
        let servers = vec![theirs.url.clone(), ours.url.clone()];
        let client = Client::new(&servers, &ours.ca_pem(), Some(admin_token(&ours))).unwrap();
        let err = client.whoami().await.unwrap_err();
        assert!(matches!(err, ClientError::UntrustedServer { .. }), "{err:?}");
    });
}

#[test]
fn discovering_the_ca_never_goes_past_a_server_with_another_ca() {
    // Another cluster answers first: the fingerprint does not match, which
    // is a verdict, not an outage.
    let ours = Cp::start();
    let theirs = Cp::start();
    let rt = runtime();
    rt.block_on(async {
        let expected = otherix_tls::parse_fingerprint(&ours.fingerprint).unwrap();
        let servers = vec![theirs.url.clone(), ours.url.clone()];
        let err = Client::discover_ca(&servers, Some(expected)).await.unwrap_err();
        assert!(
            !matches!(err, ClientError::Unreachable { .. } | ClientError::Connect { .. }),
            "{err:?}"
        );
        // With ours first it is found.
        let servers = vec![ours.url.clone(), theirs.url.clone()];
        Client::discover_ca(&servers, Some(expected)).await.unwrap();
    });
}

/// `sql` as the database's superuser, through psql.
fn psql(pg: &Postgres, sql: &str) {
    pg.query("otherix", sql).unwrap_or_else(|e| panic!("{sql}: {e}"));
}

#[test]
fn a_replica_cut_off_from_its_database_sends_clients_to_another_and_serves_again_after() {
    let pg = Postgres::start_temporary().expect("a PostgreSQL server");
    let url = pg.create_database("otherix").expect("a database");
    // Replica a connects as its own role, which the test takes away.
    psql(&pg, "CREATE ROLE cut LOGIN SUPERUSER");
    let cut_url = url.replacen("postgres://otherix@", "postgres://cut@", 1);
    let a = Cp::start_with(TempDir::new("fo-cut-a"), &["--database", &cut_url]);
    let dir = TempDir::new("fo-cut-b");
    let key = dir.path().join("secret.key");
    std::fs::copy(a.data_dir().join("secret.key"), &key).unwrap();
    let b = Cp::start_with(
        dir,
        &["--database", &url, "--secret-key-file", key.to_str().unwrap()],
    );
    let cli_dir = TempDir::new("fo-cut-cli");
    let cli = login_both(&a, &b, &cli_dir);
    cli.ok(&[
        "network",
        "create",
        "n1",
        "--type",
        "overlay",
        "--subnet",
        "10.83.0.0/24",
    ]);

    psql(&pg, "ALTER ROLE cut NOLOGIN");
    psql(
        &pg,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'cut'",
    );
    // Until a fences itself its writes fail (each waiting for a database
    // connection first); then it answers 503 and the CLI goes on through b.
    let cut_at = Instant::now();
    let mut i = 2;
    loop {
        let (name, subnet) = (format!("n{i}"), format!("10.83.{i}.0/24"));
        let out = cli.run(&[
            "network", "create", &name, "--type", "overlay", "--subnet", &subnet,
        ]);
        if out.status.success() {
            break;
        }
        assert!(
            cut_at.elapsed() < Duration::from_secs(120),
            "the CLI never went on through b: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        i += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "the CLI went on through b {:?} after a lost its database",
        cut_at.elapsed()
    );
    let info = |cp: &Cp| curl(cp, &[&format!("{}/v1/info", cp.url)]);
    let (status, body) = info(&a);
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("replica_unavailable"), "{body}");
    assert!(a.log().contains("cut off from the store"), "{}", a.log());
    let (status, _) = curl(&a, &[&format!("{}/healthz", a.url)]);
    assert_eq!(status, 200, "the health endpoints still answer");

    // Given its database back, it serves again.
    psql(&pg, "ALTER ROLE cut LOGIN");
    common::wait_for(|| (info(&a).0 == 200).then_some(()));
    assert!(a.log().contains("serves again"), "{}", a.log());
    drop(pg);
}
