//! The API router driven in memory (`tower::ServiceExt::oneshot`, no
//! socket), over a real store in a temporary data directory: every endpoint
//! the OpenAPI document lists refuses a caller without credentials, a
//! viewer's writes, a grant anywhere but the broker, and malformed bodies —
//! each with the API's JSON error and the right status. The end-to-end
//! suites (crates/otherix/tests) cover what succeeds.

mod support;

use axum::body::Body;
use axum::Router;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

use support::Server;

struct Api {
    router: Router,
    admin: String,
    /// The server's store, to take it away (closed, every query fails).
    store: otherix_store::Store,
    _server: Server,
}

impl Api {
    async fn new() -> Api {
        let server = Server::start("router").await;
        Api {
            store: server.state.store.clone(),
            router: server.router.clone(),
            admin: server.admin.clone(),
            _server: server,
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
        // The role is checked before the path's ids and the body are
        // read: a viewer's write is forbidden, however wrong it is.
        let path = path.replace("0123456789abcdef", "not-a-number");
        for body in [Some("{}"), Some(r#"["x", 1]"#), Some("{"), None] {
            let (status, v) = api.call(&method, &path, Some(&token), body).await;
            assert_eq!(
                status,
                StatusCode::FORBIDDEN,
                "{method} {path} with {body:?}: {v}"
            );
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
        if path.ends_with("/revoke") || path.ends_with("/rotate") || path.ends_with("/end") {
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
        // A batch of VMs may be larger than other requests.
        let limit = match path.as_str() {
            "/v1/vm-batches" => otherix_server::api::VM_BATCH_MAX_BODY,
            _ => otherix_server::api::MAX_BODY,
        };
        let huge = format!(r#"{{"name": "{}"}}"#, "x".repeat(limit + 1));
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
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: cp\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
         Authorization: Bearer {ticket}\r\n\r\n",
        otherix_proto::relay::PATH
    );
    let (status, _head, body) = support::answer(addr, &req).await;
    (status, body)
}

/// The document's schema of a component, by name.
fn component<'a>(doc: &'a Value, name: &str) -> &'a Value {
    &doc["components"]["schemas"][name]
}

/// The enums `wire_enum!` defines, named in otherix-proto's sources, so
/// that a new one cannot be left out of the test below.
fn wire_enums_in_the_sources() -> Vec<String> {
    let sources = [
        include_str!("../../otherix-proto/src/api.rs"),
        include_str!("../../otherix-proto/src/agent.rs"),
    ];
    let mut names = vec![];
    for source in sources {
        for block in source.split("wire_enum! {").skip(1) {
            let name = block
                .split("enum ")
                .nth(1)
                .and_then(|rest| rest.split(':').next())
                .unwrap();
            names.push(name.trim().to_string());
        }
    }
    names.sort();
    names
}

fn words<T: Copy + std::fmt::Display>(all: &[T]) -> Value {
    all.iter().map(|v| Value::from(v.to_string())).collect()
}

#[tokio::test]
async fn every_enum_in_the_document_is_the_words_the_wire_carries() {
    use otherix_proto::agent::{CertPurpose, MigrationOutcome, NodeStatus};
    use otherix_proto::*;
    let api = Api::new().await;
    let (_, doc) = api.call(&Method::GET, "/v1/openapi.json", None, None).await;
    let published: Vec<(&str, Value)> = vec![
        ("Accelerator", words(Accelerator::ALL)),
        ("AuditAction", words(AuditAction::ALL)),
        ("CertPurpose", words(CertPurpose::ALL)),
        ("GrantState", words(GrantState::ALL)),
        ("KeyState", words(KeyState::ALL)),
        ("MigrationOutcome", words(MigrationOutcome::ALL)),
        ("NetworkType", words(NetworkType::ALL)),
        ("NodeStatus", words(NodeStatus::ALL)),
        ("ProbeKind", words(ProbeKind::ALL)),
        ("Role", words(Role::ALL)),
        ("Runtime", words(Runtime::ALL)),
        ("Transport", words(Transport::ALL)),
        ("VmState", words(VmState::ALL)),
    ];
    let mut listed: Vec<String> = published.iter().map(|(n, _)| n.to_string()).collect();
    listed.sort();
    assert_eq!(
        listed,
        wire_enums_in_the_sources(),
        "every wire enum is checked here"
    );
    for (name, wire) in &published {
        let schema = component(&doc, name);
        assert_eq!(schema["type"], "string", "{name}: {schema}");
        assert_eq!(&schema["enum"], wire, "{name} is published as the wire words");
    }
    // And a word read off the document is one the server takes.
    api.ok(
        Method::POST,
        "/v1/users",
        json!({"name": "vera", "role": component(&doc, "Role")["enum"][2]}),
    )
    .await;
}

#[tokio::test]
async fn the_document_declares_every_path_parameter_once_and_names_every_operation_once() {
    let api = Api::new().await;
    let (_, doc) = api.call(&Method::GET, "/v1/openapi.json", None, None).await;
    let mut ids = std::collections::BTreeSet::new();
    let schemes = doc["components"]["securitySchemes"].as_object().unwrap();
    assert_eq!(schemes["node_certificate"]["type"], "mutualTLS");
    for (path, item) in doc["paths"].as_object().unwrap() {
        let mut template: Vec<&str> = path
            .split('/')
            .filter_map(|s| s.strip_prefix('{')?.strip_suffix('}'))
            .collect();
        template.sort();
        for (method, op) in item.as_object().unwrap() {
            let what = format!("{method} {path}");
            let id = op["operationId"]
                .as_str()
                .unwrap_or_else(|| panic!("{what} has no id"));
            assert!(ids.insert(id.to_string()), "{what}: operationId {id} used twice");
            let params = op["parameters"].as_array().cloned().unwrap_or_default();
            let mut in_path: Vec<&str> = params
                .iter()
                .filter(|p| p["in"] == "path")
                .map(|p| p["name"].as_str().unwrap())
                .collect();
            in_path.sort();
            assert_eq!(in_path, template, "{what}: path parameters");
            for p in &params {
                if p["in"] == "path" {
                    assert_eq!(p["required"], true, "{what}: {p}");
                }
            }
            for security in op["security"].as_array().into_iter().flatten() {
                for scheme in security.as_object().unwrap().keys() {
                    assert!(schemes.contains_key(scheme), "{what}: unknown scheme {scheme}");
                }
            }
            let responses = op["responses"].as_object().unwrap();
            let uses = |scheme: &str| {
                op["security"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|r| r.get(scheme).is_some()))
            };
            if uses("bearer") || uses("node_certificate") {
                assert!(responses.contains_key("401"), "{what}: 401");
            }
            if op.get("requestBody").is_some() {
                for status in ["400", "413", "415"] {
                    assert!(responses.contains_key(status), "{what}: {status}");
                }
            }
        }
    }
    // The filters are in the query, not the path.
    let audit = &doc["paths"]["/v1/audit"]["get"]["parameters"];
    assert!(
        audit.as_array().unwrap().iter().all(|p| p["in"] == "query"),
        "{audit}"
    );
    // The agent calls take the node's certificate; enrollment its join token.
    for path in [
        "/v1/agent/heartbeat",
        "/v1/agent/certificate",
        "/v1/agent/desired/wait",
    ] {
        let op = doc["paths"][path].as_object().unwrap().values().next().unwrap();
        assert_eq!(op["security"], json!([{"node_certificate": []}]), "{path}");
    }
    let broker = &doc["paths"]["/v1/broker"]["post"]["responses"]["429"];
    assert!(broker["headers"].get("Retry-After").is_some(), "{broker}");
}

#[tokio::test]
async fn a_json_array_is_never_read_as_a_request_body() {
    let api = Api::new().await;
    let admin = api.admin.clone();
    // Read positionally, this would be an admin named arr2.
    let (status, v) = api
        .call(
            &Method::POST,
            "/v1/users",
            Some(&admin),
            Some(r#"["arr2","admin"]"#),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_error(&v, "invalid_request", "an array body");
    let (status, _) = api.call(&Method::GET, "/v1/users/arr2", Some(&admin), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "no user was made");

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
    api.ok(
        Method::POST,
        "/v1/lbs",
        json!({"name": "web", "port": 80, "selector": "app=web"}),
    )
    .await;
    let (status, v) = api
        .call(&Method::PATCH, "/v1/lbs/web", Some(&admin), Some("[8080]"))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(api.ok(Method::GET, "/v1/lbs/web", json!({})).await["port"], 80);

    // Nor deeper down: a grant's target is an object too.
    let (status, v) = api
        .call(
            &Method::POST,
            "/v1/grants",
            Some(&admin),
            Some(r#"{"name":"acme","targets":[["web01",443]],"ttl_seconds":60}"#),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("targets[0]"),
        "the refusal says where: {v}"
    );
}

#[tokio::test]
async fn ports_are_published_with_the_bounds_the_server_keeps() {
    let api = Api::new().await;
    let admin = api.admin.clone();
    let (_, doc) = api.call(&Method::GET, "/v1/openapi.json", None, None).await;
    let port = component(&doc, "Port");
    assert_eq!(
        (port["minimum"].as_f64(), port["maximum"].as_f64()),
        (Some(1.0), Some(65535.0))
    );
    for (schema, field) in [
        ("CreateLbRequest", "port"),
        ("BrokerRequest", "port"),
        ("GrantTarget", "port"),
    ] {
        let published = &component(&doc, schema)["properties"][field];
        assert_eq!(
            published["$ref"], "#/components/schemas/Port",
            "{schema}.{field}: {published}"
        );
    }
    // A rule's ports may also be 0: the serial console.
    let items = &component(&doc, "AllowRequest")["properties"]["ports"]["items"];
    assert_eq!(items["$ref"], "#/components/schemas/RulePort", "{items}");
    let rule_port = component(&doc, "RulePort");
    assert_eq!(
        (rule_port["minimum"].as_f64(), rule_port["maximum"].as_f64()),
        (Some(0.0), Some(65535.0))
    );
    for bad in [0, 70000] {
        let (status, v) = api
            .call(
                &Method::POST,
                "/v1/lbs",
                Some(&admin),
                Some(&json!({"name": "web", "port": bad, "selector": "app=web"}).to_string()),
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "port {bad}: {v}");
    }
}

#[tokio::test]
async fn a_refusal_made_before_the_body_is_read_still_reaches_a_client_sending_it() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let api = Api::new().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = api.router.clone();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    // No token: refused (401) from the head alone. The client sends its
    // body after the head, as most do; the answer must not be a reset.
    let body = format!(
        r#"{{"name":"vera","role":"viewer","pad":"{}"}}"#,
        "x".repeat(60_000)
    );
    for _ in 0..3 {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /v1/users HTTP/1.1\r\nHost: cp\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            body.len()
        );
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(body.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        while !String::from_utf8_lossy(&got).contains("unauthenticated") {
            let n = conn.read(&mut buf).await.expect("an answer, not a reset");
            assert!(n > 0, "the connection ended before an answer: {got:?}");
            got.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&got);
        assert!(text.starts_with("HTTP/1.1 401"), "{text}");
    }
    server.abort();
}

#[tokio::test]
async fn a_fenced_replica_refuses_every_call_but_the_health_endpoints() {
    let api = Api::new().await;
    api._server
        .state
        .fenced
        .store(true, std::sync::atomic::Ordering::Relaxed);
    for (method, path, body) in [
        (Method::GET, "/v1/vms", None),
        (
            Method::POST,
            "/v1/broker",
            Some(r#"{"target":"web01","port":22}"#),
        ),
        (
            Method::POST,
            "/v1/users",
            Some(r#"{"name":"vera","role":"viewer"}"#),
        ),
    ] {
        let (status, v) = api.call(&method, path, Some(&api.admin), body).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{method} {path}: {v}");
        assert_eq!(v["error"]["code"], "replica_unavailable", "{method} {path}: {v}");
    }
    // Answered by their own handlers (`/readyz` says what it finds).
    let (status, _) = api.call(&Method::GET, "/healthz", None, None).await;
    assert_eq!(status, StatusCode::OK);
    let (_, v) = api.call(&Method::GET, "/readyz", None, None).await;
    assert_ne!(v["error"]["code"], "replica_unavailable", "{v}");
    api._server
        .state
        .fenced
        .store(false, std::sync::atomic::Ordering::Relaxed);
    let (status, v) = api.call(&Method::GET, "/v1/vms", Some(&api.admin), None).await;
    assert_eq!(status, StatusCode::OK, "answered again once unfenced: {v}");
}
