//! The API router driven in memory (`tower::ServiceExt::oneshot`, no
//! socket), over a real store in a temporary data directory: every endpoint
//! the OpenAPI document lists refuses a caller without credentials, a
//! viewer's writes, a grant anywhere but the broker, and malformed bodies —
//! each with the API's JSON error and the right status. The end-to-end
//! suites (crates/otherix/tests) cover what succeeds.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::Router;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use otherix_proto::ServerInfo;
use otherix_server::state::Settings;
use serde_json::{json, Value};
use tower::ServiceExt;

/// A data directory of its own, removed on drop.
struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Api {
    router: Router,
    admin: String,
    /// The server's store, to take it away (closed, every query fails).
    store: otherix_store::Store,
    _dir: Dir,
}

impl Api {
    async fn new() -> Api {
        let dir = Dir(std::env::temp_dir().join(format!(
            "otherix-router-{}-{}",
            std::process::id(),
            hex::encode(otherix_server::random::bytes::<6>())
        )));
        let opened = otherix_server::open(&dir.0, None, None).await.unwrap();
        let info = Arc::new(ServerInfo {
            cluster_id: opened.cluster_id.clone(),
            version: "test".into(),
            ca_fingerprint: opened.ca.fingerprint(),
        });
        let state = otherix_server::app_state(opened, info, Settings::default())
            .await
            .unwrap();
        let admin = std::fs::read_to_string(dir.0.join("admin.token"))
            .unwrap()
            .trim()
            .to_string();
        Api {
            store: state.store.clone(),
            router: otherix_server::api::router(state),
            admin,
            _dir: dir,
        }
    }

    async fn call(
        &self,
        method: &Method,
        path: &str,
        token: Option<&str>,
        body: Option<&str>,
    ) -> (StatusCode, Value) {
        let mut req = Request::builder().method(method.clone()).uri(path);
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if body.is_some() {
            req = req.header("content-type", "application/json");
        }
        let req = req.body(Body::from(body.unwrap_or("").to_string())).unwrap();
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
    }

    async fn ok(&self, method: Method, path: &str, body: Value) -> Value {
        let (status, v) = self
            .call(&method, path, Some(&self.admin), Some(&body.to_string()))
            .await;
        assert!(status.is_success(), "{method} {path}: {status} {v}");
        v
    }

    /// Every (method, path) the OpenAPI document lists, with path
    /// parameters filled in.
    async fn endpoints(&self) -> Vec<(Method, String)> {
        let (status, doc) = self.call(&Method::GET, "/v1/openapi.json", None, None).await;
        assert_eq!(status, StatusCode::OK);
        let mut out = vec![];
        for (path, item) in doc["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                let path = path
                    .replace("{name}", "web01")
                    .replace("{id}", "0123456789abcdef")
                    .replace("{node}", "node1");
                out.push((method.to_uppercase().parse().unwrap(), path));
            }
        }
        assert!(out.len() > 30, "the document lists the API: {out:?}");
        out
    }
}

/// Answered without any credential.
const PUBLIC: &[&str] = &["/v1/info", "/v1/openapi.json", "/healthz", "/readyz"];
/// Authenticated by the join token in its body (refused in its own test below).
const ENROLL: &str = "/v1/agent/enroll";
/// Authenticated by a join token or a node's client certificate, not a bearer API token.
const NODE_PATHS: &[&str] = &["/v1/agent/"];

fn is_node_path(path: &str) -> bool {
    NODE_PATHS.iter().any(|p| path.starts_with(p))
}

fn assert_error(v: &Value, code: &str, what: &str) {
    assert_eq!(v["error"]["code"], code, "{what}: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty() && !m.contains('\n')),
        "{what}: one line: {v}"
    );
}

#[tokio::test]
async fn every_endpoint_refuses_a_caller_without_credentials() {
    let api = Api::new().await;
    for (method, path) in api.endpoints().await {
        if PUBLIC.contains(&path.as_str()) || path == ENROLL {
            continue;
        }
        let body = (method != Method::GET && method != Method::DELETE).then_some("{}");
        let (status, v) = api.call(&method, &path, None, body).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path}: {v}");
        assert_error(&v, "unauthenticated", &format!("{method} {path}"));
        // A bad token is the same refusal, whatever its shape.
        for bad in [
            "otx_0123456789abcdef_".to_string() + &"0".repeat(64),
            "garbage".into(),
        ] {
            let (status, _) = api.call(&method, &path, Some(&bad), body).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{method} {path} with {bad}");
        }
    }
}

#[tokio::test]
async fn a_viewer_reads_but_every_write_and_the_broker_refuse_it() {
    let api = Api::new().await;
    api.ok(
        Method::POST,
        "/v1/users",
        json!({"name": "vera", "role": "viewer"}),
    )
    .await;
    let token = api.ok(Method::POST, "/v1/users/vera/tokens", json!({})).await["token"]
        .as_str()
        .unwrap()
        .to_string();
    let (status, _) = api.call(&Method::GET, "/v1/vms", Some(&token), None).await;
    assert_eq!(status, StatusCode::OK, "a viewer reads");
    for (method, path) in api.endpoints().await {
        if method == Method::GET || PUBLIC.contains(&path.as_str()) || is_node_path(&path) {
            continue;
        }
        let body = (method != Method::DELETE).then_some("{}");
        let (status, v) = api.call(&method, &path, Some(&token), body).await;
        // A body the viewer could not have written right is refused first
        // by some endpoints (400); what matters is that nothing is allowed.
        assert!(
            status == StatusCode::FORBIDDEN || status == StatusCode::BAD_REQUEST,
            "{method} {path}: {status} {v}"
        );
        if status == StatusCode::FORBIDDEN {
            assert_error(&v, "forbidden", &format!("{method} {path}"));
        }
    }
    let (status, v) = api
        .call(
            &Method::POST,
            "/v1/broker",
            Some(&token),
            Some(r#"{"target":"web01","port":22}"#),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["error"]["message"], "role viewer may not broker connections");
}

#[tokio::test]
async fn a_grant_token_is_refused_everywhere_but_the_broker_and_whoami() {
    let api = Api::new().await;
    api.ok(
        Method::POST,
        "/v1/networks",
        json!({"name": "net", "type": "overlay", "subnet": "10.100.0.0/24"}),
    )
    .await;
    api.ok(
        Method::POST,
        "/v1/vms",
        json!({"name": "web01", "network": "net"}),
    )
    .await;
    let grant = api
        .ok(
            Method::POST,
            "/v1/grants",
            json!({"name": "acme", "targets": [{"target": "web01", "port": 443}], "ttl_seconds": 3600}),
        )
        .await["token"]
        .as_str()
        .unwrap()
        .to_string();
    for (method, path) in api.endpoints().await {
        if PUBLIC.contains(&path.as_str())
            || is_node_path(&path)
            || path == "/v1/broker"
            || path == "/v1/whoami"
        {
            continue;
        }
        let body = (method != Method::GET && method != Method::DELETE).then_some("{}");
        let (status, v) = api.call(&method, &path, Some(&grant), body).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{method} {path}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("may only broker"),
            "{method} {path}: {v}"
        );
    }
    let (status, v) = api.call(&Method::GET, "/v1/whoami", Some(&grant), None).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    // The broker: only what the grant lists.
    let (status, v) = api
        .call(
            &Method::POST,
            "/v1/broker",
            Some(&grant),
            Some(r#"{"target":"web01","port":22}"#),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{v}");
    assert_eq!(v["error"]["message"], "grant \"acme\" does not include web01:22");
}

#[tokio::test]
async fn malformed_unknown_and_oversized_bodies_are_refused_with_a_reason() {
    let api = Api::new().await;
    let admin = api.admin.clone();
    for (method, path) in api.endpoints().await {
        if matches!(method, Method::GET | Method::DELETE)
            || PUBLIC.contains(&path.as_str())
            || is_node_path(&path)
        {
            continue;
        }
        // Paths whose handler takes no body at all.
        if path.ends_with("/revoke") || path.ends_with("/tokens") || path.ends_with("/rotate") {
            continue;
        }
        for (body, what) in [
            ("{", "truncated JSON"),
            (r#"{"no_such_field": 1}"#, "an unknown field"),
            (r#""web01""#, "not an object"),
        ] {
            let (status, v) = api.call(&method, &path, Some(&admin), Some(body)).await;
            assert_eq!(
                status,
                StatusCode::BAD_REQUEST,
                "{method} {path} with {what}: {v}"
            );
            assert_error(&v, "invalid_request", &format!("{method} {path} with {what}"));
        }
        let huge = format!(
            r#"{{"name": "{}"}}"#,
            "x".repeat(otherix_server::api::MAX_BODY + 1)
        );
        let (status, v) = api.call(&method, &path, Some(&admin), Some(&huge)).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{method} {path}: {v}");
        assert_error(&v, "payload_too_large", &format!("{method} {path}"));
    }
}

#[tokio::test]
async fn every_name_in_a_request_body_is_checked_as_it_is_read_and_the_refusal_names_its_kind() {
    let api = Api::new().await;
    let admin = api.admin.clone();
    let cases = [
        (
            "/v1/users",
            r#"{"name":"Alice","role":"user"}"#,
            "invalid user name",
        ),
        (
            "/v1/networks",
            r#"{"name":"web_net","type":"overlay","subnet":"10.1.0.0/24"}"#,
            "invalid network name",
        ),
        (
            "/v1/networks",
            r#"{"name":"lan","type":"bridge","subnet":"10.2.0.0/24","nodes":["node1","-n2"]}"#,
            "invalid node name",
        ),
        (
            "/v1/vms",
            r#"{"name":"web 01","network":"n1"}"#,
            "invalid VM name",
        ),
        (
            "/v1/vms",
            r#"{"name":"web01","network":"N1"}"#,
            "invalid network name",
        ),
        (
            "/v1/vms",
            r#"{"name":"web01","network":"n1","node":"node1."}"#,
            "invalid node name",
        ),
        ("/v1/vms/web01/migrate", r#"{"to":""}"#, "invalid node name"),
        (
            "/v1/lbs",
            r#"{"name":"web.lb","port":80,"selector":"app=web"}"#,
            "invalid load balancer name",
        ),
        (
            "/v1/grants",
            r#"{"name":"Acme","targets":[{"target":"web01","port":22}],"ttl_seconds":60}"#,
            "invalid grant name",
        ),
        ("/v1/join-tokens", r#"{"node":"node_1"}"#, "invalid node name"),
    ];
    for (path, body, says) in cases {
        let (status, v) = api.call(&Method::POST, path, Some(&admin), Some(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {v}");
        assert_error(&v, "invalid_request", path);
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{path} {body}: {message}");
    }
    // Nothing was made on the way.
    for list in ["/v1/users", "/v1/networks", "/v1/vms", "/v1/lbs", "/v1/grants"] {
        let (status, v) = api.call(&Method::GET, list, Some(&admin), None).await;
        assert_eq!(status, StatusCode::OK, "{list}: {v}");
        let names: Vec<&str> = v
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|x| x["name"].as_str())
            .collect();
        assert!(
            names
                .iter()
                .all(|n| !["Alice", "web_net", "lan", "web 01", "web.lb", "Acme"].contains(n)),
            "{list}: {names:?}"
        );
    }
}

#[tokio::test]
async fn unknown_paths_methods_and_names_are_json_refusals() {
    let api = Api::new().await;
    let admin = api.admin.clone();
    let (status, v) = api.call(&Method::GET, "/v1/nope", Some(&admin), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_error(&v, "not_found", "unknown path");
    let (status, v) = api.call(&Method::PUT, "/v1/vms", Some(&admin), Some("{}")).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_error(&v, "method_not_allowed", "wrong method");
    for path in [
        "/v1/vms/nope",
        "/v1/networks/nope",
        "/v1/users/nope",
        "/v1/lbs/nope",
        "/v1/grants/nope",
        "/v1/nodes/nope",
    ] {
        let (status, v) = api.call(&Method::GET, path, Some(&admin), None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {v}");
        assert_error(&v, "not_found", path);
    }
    let (status, v) = api
        .call(
            &Method::POST,
            "/v1/broker",
            Some(&admin),
            Some(r#"{"target":"nope","port":22}"#),
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    let (status, v) = api
        .call(
            &Method::POST,
            "/v1/broker",
            Some(&admin),
            Some(r#"{"target":"Bad Name","port":22}"#),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let (status, v) = api
        .call(&Method::GET, "/v1/audit?limit=0", Some(&admin), None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let (status, v) = api
        .call(&Method::GET, "/v1/audit?after=garbage", Some(&admin), None)
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("invalid audit cursor"),
        "{v}"
    );
}

#[tokio::test]
async fn the_agent_endpoints_refuse_a_caller_without_a_node_certificate() {
    let api = Api::new().await;
    let admin = api.admin.clone();
    for (method, path) in [
        (Method::POST, "/v1/agent/heartbeat"),
        (Method::POST, "/v1/agent/certificate"),
        (Method::GET, "/v1/agent/desired/wait?version=1"),
    ] {
        // Not even an admin's token makes a node.
        let (status, v) = api.call(&method, path, Some(&admin), Some("{")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}: {v}");
        assert_error(&v, "unauthenticated", path);
    }
    let (status, v) = api
        .call(
            &Method::POST,
            "/v1/agent/enroll",
            None,
            Some(r#"{"node":"node1","join_token":"otxj_nope","csr_pem":"x"}"#),
        )
        .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{v}");
}

/// `/readyz` needs no token, so what it answers is told to anyone: with the
/// store gone, that it is the store and nothing of the driver's error.
#[tokio::test]
async fn readyz_with_the_store_down_names_the_store_and_nothing_of_its_error() {
    let api = Api::new().await;
    let ready = api
        .text(Request::get("/readyz").body(Body::empty()).unwrap())
        .await;
    assert_eq!(ready, (StatusCode::OK, "ready\n".into()));
    api.store.close().await;
    let (status, body) = api
        .text(Request::get("/readyz").body(Body::empty()).unwrap())
        .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body, "not ready: store unavailable\n");
}

/// A join token of the wrong shape, or a CSR that is not one, is refused
/// before the store is read: with the store gone the refusal is the
/// request's own fault, not a store error.
#[tokio::test]
async fn malformed_enrollment_is_refused_without_reading_the_store() {
    let api = Api::new().await;
    api.store.close().await;
    let token = format!("otxj_{}_{}", "0".repeat(16), "0".repeat(64));
    let csr = "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n";
    let enroll = |join_token: &str, csr_pem: &str| {
        json!({"node": "node1", "join_token": join_token, "csr_pem": csr_pem}).to_string()
    };
    for (body, status, code) in [
        (
            enroll("otxj_nope", csr),
            StatusCode::UNAUTHORIZED,
            "unauthenticated",
        ),
        (
            enroll(&token, "not a csr"),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
        (
            enroll(&token, &format!("{csr}{csr}")),
            StatusCode::BAD_REQUEST,
            "invalid_request",
        ),
    ] {
        let (got, v) = api.call(&Method::POST, ENROLL, None, Some(&body)).await;
        assert_eq!(got, status, "{body}: {v}");
        assert_error(&v, code, &body);
    }
    // Well formed: only now is the store asked, and its failure shows.
    let (got, v) = api
        .call(&Method::POST, ENROLL, None, Some(&enroll(&token, csr)))
        .await;
    assert!(got.is_server_error(), "the store was read: {got} {v}");
}

/// The relay checks a ticket's signature against the keys it holds: a
/// stranger's ticket costs no store read. With the store gone, a garbled
/// ticket and one signed by an unknown key get their own refusals, not a
/// store error.
#[tokio::test]
async fn a_strangers_relay_ticket_is_refused_without_reading_the_store() {
    let api = Api::new().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = api.router.clone();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    api.store.close().await;
    let now = time::OffsetDateTime::now_utc();
    let stranger = otherix_core::credential::SigningKey::from_seed("k-stranger", [7; 32]).unwrap();
    let forged = stranger
        .mint(&otherix_core::credential::Claims {
            iss: "c1".into(),
            aud: otherix_proto::relay::AUDIENCE.into(),
            sub: "user:mallory".into(),
            tok: None,
            jti: "j1".into(),
            iat: now,
            nbf: now,
            exp: now + time::Duration::minutes(5),
            vm: "web01".into(),
            vm_id: "a1".into(),
            net: "lan".into(),
            mac: None,
            ip: "10.101.0.2".into(),
            port: 22,
            until: None,
        })
        .unwrap();
    for (ticket, want) in [
        ("v4.public.garbage", "malformed credential"),
        (forged.as_str(), "credential signed by unknown key \"k-stranger\""),
    ] {
        let (status, body) = relay_upgrade(addr, ticket).await;
        assert_eq!(status, 401, "{ticket}: {body}");
        assert!(body.starts_with(want), "{ticket}: {body}");
        assert!(!body.contains("unavailable"), "{ticket}: {body}");
    }
    server.abort();
}

impl Api {
    /// A request's status and body as text.
    async fn text(&self, req: Request<Body>) -> (StatusCode, String) {
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// A WebSocket upgrade of `/v1/relay` with `ticket`, over a real socket (the
/// upgrade needs one): the refusal's status and body.
async fn relay_upgrade(addr: std::net::SocketAddr, ticket: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: cp\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Authorization: Bearer {ticket}\r\n\r\n",
        otherix_proto::relay::PATH
    );
    conn.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    loop {
        let mut buf = [0u8; 4096];
        let n = conn.read(&mut buf).await.unwrap();
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap())
                })
                .expect("a refusal with a length");
            if body.len() >= len || n == 0 {
                let status = head.split(' ').nth(1).unwrap().parse().unwrap();
                return (status, body.to_string());
            }
        }
        assert!(n > 0, "the connection ended before an answer: {text}");
    }
}
