//! Metrics on the testbed: a session brokered through the gateway moves the
//! counters of the control plane's and the gateway agent's `/metrics`, a
//! replayed credential is counted by reason, and every daemon answers
//! `/healthz` and `/readyz` on its `--metrics-listen` address.

use std::net::SocketAddr;
use std::time::Duration;

use otherix_client::tunnel as connect;
use otherix_proto::BrokerRequest;

use otherix_client::Client;
use otherix_testbed::cluster::{Cluster, ClusterSpec};
use otherix_testbed::{wait_until, World};

const BIN: &str = env!("CARGO_BIN_EXE_otherix");
const WAIT: Duration = Duration::from_secs(60);
const CP_METRICS: u16 = 9464;
const AGENT_METRICS: u16 = 9465;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The value of the sample `series` (the exact text before the value).
fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

fn scrape(addr: SocketAddr) -> String {
    let (status, body) = otherix_testbed::http::get(addr, "/metrics").expect("/metrics answers");
    assert_eq!(status, 200);
    body
}

#[test]
fn a_brokered_session_moves_the_counters_of_the_cp_and_the_gateway() {
    let world = World::new("metrics").expect("a testbed world (needs root)");
    let mut spec = ClusterSpec::new(BIN);
    spec.hypervisors = 1;
    spec.gateways = 1;
    spec.extra_server_args = vec!["--metrics-listen".into(), format!("0.0.0.0:{CP_METRICS}")];
    spec.extra_agent_args = vec!["--metrics-listen".into(), format!("0.0.0.0:{AGENT_METRICS}")];
    let c = Cluster::start(world, spec).expect("cluster starts");
    let cp = SocketAddr::from((c.cp_ns().ip(), CP_METRICS));
    let gw = SocketAddr::from((c.node("gw1").unwrap().ns.ip(), AGENT_METRICS));
    let node1 = SocketAddr::from((c.node("node1").unwrap().ns.ip(), AGENT_METRICS));

    for (who, addr) in [("cp", cp), ("gw1", gw), ("node1", node1)] {
        assert_eq!(
            otherix_testbed::http::get(addr, "/healthz"),
            Some((200, "ok\n".into())),
            "{who}"
        );
        wait_until(&format!("{who} to be ready"), WAIT, || {
            (otherix_testbed::http::get(addr, "/readyz")?.0 == 200).then_some(())
        })
        .unwrap();
    }

    c.cli_ok(&[
        "network",
        "create",
        "ov",
        "--type",
        "overlay",
        "--subnet",
        "10.184.0.0/24",
    ])
    .unwrap();
    c.cli_ok(&[
        "vm",
        "create",
        "web",
        "--network",
        "ov",
        "--label",
        "app=web",
        "--exec",
        "otherix guest http --port 8080",
    ])
    .unwrap();
    c.cli_ok(&[
        "lb",
        "create",
        "web-lb",
        "--port",
        "8080",
        "--selector",
        "app=web",
    ])
    .unwrap();
    c.wait_vm_running("web", WAIT).unwrap();

    // One session through the gateway, then a replayed credential.
    let ca_pem = std::fs::read_to_string(c.ca_file()).unwrap();
    let token = std::fs::read_to_string(c.cp_dir().join("admin.token")).unwrap();
    let admin = Client::new(&c.url, &ca_pem, Some(token.trim().to_string())).unwrap();
    let body = wait_until("web to answer through the gateway", WAIT, || {
        let b = rt()
            .block_on(admin.broker(&BrokerRequest {
                target: "web".into(),
                port: 8080,
                exclude: vec![],
            }))
            .ok()?;
        let answer = rt().block_on(async {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut t = connect::open(&b.endpoint, &ca_pem, &b.credential).await.ok()?;
            t.write_all(b"GET / HTTP/1.0\r\n\r\n").await.ok()?;
            let mut out = Vec::new();
            t.read_to_end(&mut out).await.ok()?;
            Some(String::from_utf8_lossy(&out).to_string())
        })?;
        let replay = rt().block_on(connect::open(&b.endpoint, &ca_pem, &b.credential));
        assert!(replay.is_err(), "a replayed credential was accepted");
        Some(answer)
    })
    .unwrap();
    assert!(body.ends_with("web\n") || body.contains("web"), "{body}");

    let m = scrape(cp);
    assert!(
        sample(
            &m,
            "otherix_broker_decisions_total{outcome=\"allowed\",reason=\"\"}"
        ) >= 1.0,
        "{m}"
    );
    assert!(
        sample(&m, "otherix_credentials_minted_total{transport=\"gateway\"}") >= 1.0,
        "{m}"
    );
    assert!(
        sample(&m, "otherix_heartbeats_total{result=\"ok\"}") >= 1.0,
        "{m}"
    );
    assert_eq!(sample(&m, "otherix_nodes{status=\"Ready\"}"), 2.0, "{m}");
    assert!(m.contains("otherix_broker_duration_seconds_bucket"), "{m}");
    assert!(m.contains("otherix_sessions_open{transport=\"gateway\"}"), "{m}");

    wait_until("the gateway to count the session's end", WAIT, || {
        let m = scrape(gw);
        (sample(&m, "otherix_gateway_session_duration_seconds_count") >= 1.0).then_some(m)
    })
    .map(|m| {
        assert!(sample(&m, "otherix_gateway_accepted_total") >= 1.0, "{m}");
        assert!(
            sample(&m, "otherix_gateway_refused_total{reason=\"replayed\"}") >= 1.0,
            "{m}"
        );
        assert!(
            sample(&m, "otherix_gateway_bytes_total{direction=\"from_guest\"}") > 0.0,
            "{m}"
        );
        assert!(sample(&m, "otherix_gateway_replay_cache_entries") >= 1.0, "{m}");
        assert!(
            sample(&m, "otherix_agent_heartbeats_total{result=\"ok\"}") >= 1.0,
            "{m}"
        );
    })
    .unwrap();
    // A guest more on the overlay: its members are told with a change
    // (the host its own part's new guest, the gateway two entries). Every
    // state the agents built from the CP's answers, whole or from changes,
    // is the one the CP meant (the digest it named is theirs).
    c.cli_ok(&["vm", "create", "web2", "--network", "ov"]).unwrap();
    c.wait_vm_running("web2", WAIT).unwrap();
    for (who, addr) in [("gw1", gw), ("node1", node1)] {
        let series = |answer: &str, result: &str| {
            format!("otherix_agent_state_digests_total{{answer=\"{answer}\",result=\"{result}\"}}")
        };
        let m = wait_until(&format!("{who} to check a delta's digest"), WAIT, || {
            let m = scrape(addr);
            (sample(&m, &series("delta", "same")) >= 1.0).then_some(m)
        })
        .unwrap();
        assert!(sample(&m, &series("whole", "same")) >= 1.0, "{who}: {m}");
        for answer in ["whole", "delta"] {
            assert_eq!(sample(&m, &series(answer, "different")), 0.0, "{who}: {m}");
        }
    }
    // node1 probes its LB backend.
    wait_until("node1 to count health probes", WAIT, || {
        (sample(
            &scrape(node1),
            "otherix_agent_health_probes_total{result=\"success\"}",
        ) >= 1.0)
            .then_some(())
    })
    .unwrap();
}
