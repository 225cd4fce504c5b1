//! The web console's sign-in driven in memory through the whole router (as
//! `router.rs` drives the API): a session cookie is taken by every `/v1/`
//! endpoint as the token it was opened with is, writes need its CSRF token
//! and the console's own origin, and it ends with its token. The browser
//! tests (crates/otherix/tests/web_console_e2e.rs) cover the pages.

mod support;

use axum::body::Body;
use axum::Router;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use otherix_server::console::session::{COOKIE, CSP, CSRF_HEADER};
use otherix_server::console::terminal::{
    CAUSE_PROTOCOL_PREFIX, CSRF_PROTOCOL_PREFIX, PROTOCOL as TERMINAL_PROTOCOL, RECEIVED_PROTOCOL_PREFIX,
    RESUME_PROTOCOL_PREFIX, SECRET_PROTOCOL_PREFIX,
};
use serde_json::{json, Value};
use tower::ServiceExt;

use support::Server;

const HOST: &str = "cp.test:7443";
const ORIGIN: &str = "https://cp.test:7443";

struct Api {
    router: Router,
    /// The router's state, for what a test sets up beside it.
    state: otherix_server::state::AppState,
    admin: String,
    _server: Server,
}

/// What a request carries besides its method, path and body.
#[derive(Default)]
struct With<'a> {
    bearer: Option<&'a str>,
    cookie: Option<&'a str>,
    csrf: Option<&'a str>,
    origin: Option<&'a str>,
    content_type: Option<&'a str>,
}

struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    json: Value,
    text: String,
}

impl Api {
    async fn new() -> Api {
        let server = Server::start("console").await;
        Api {
            router: server.router.clone(),
            state: server.state.clone(),
            admin: server.admin.clone(),
            _server: server,
        }
    }

    async fn call(&self, method: Method, path: &str, with: With<'_>, body: Option<Value>) -> Answer {
        let mut req = Request::builder().method(method).uri(path).header("host", HOST);
        if let Some(t) = with.bearer {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        if let Some(c) = with.cookie {
            req = req.header("cookie", format!("theme=dark; {COOKIE}={c}"));
        }
        if let Some(c) = with.csrf {
            req = req.header(CSRF_HEADER, c);
        }
        if let Some(o) = with.origin {
            req = req.header("origin", o);
        }
        if body.is_some() {
            req = req.header("content-type", with.content_type.unwrap_or("application/json"));
        }
        let req = req
            .body(Body::from(body.map(|b| b.to_string()).unwrap_or_default()))
            .unwrap();
        let resp = self.router.clone().oneshot(req).await.unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        let text = String::from_utf8_lossy(&bytes).into_owned();
        Answer {
            status,
            headers,
            json: serde_json::from_str(&text).unwrap_or(Value::Null),
            text,
        }
    }

    /// Signs in with `token` from the console's own page: (cookie, csrf).
    async fn sign_in(&self, token: &str) -> (String, String) {
        let a = self
            .call(
                Method::POST,
                "/ui/api/session",
                With {
                    origin: Some(ORIGIN),
                    ..With::default()
                },
                Some(json!({ "token": token })),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
        let set = a.headers["set-cookie"].to_str().unwrap().to_string();
        for attr in ["HttpOnly", "Secure", "SameSite=Strict", "Path=/"] {
            assert!(set.contains(attr), "{set}");
        }
        let cookie = set
            .strip_prefix(&format!("{COOKIE}="))
            .and_then(|v| v.split(';').next())
            .unwrap()
            .to_string();
        (cookie, a.json["csrf"].as_str().unwrap().to_string())
    }
}

#[tokio::test]
async fn a_console_session_is_the_token_it_was_opened_with_and_writes_need_its_csrf_token_and_origin() {
    let api = Api::new().await;
    let (cookie, csrf) = api.sign_in(&api.admin).await;
    let c = Some(cookie.as_str());

    let a = api
        .call(
            Method::GET,
            "/v1/whoami",
            With {
                cookie: c,
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(
        (a.status, a.json["principal"].as_str()),
        (StatusCode::OK, Some("user:admin"))
    );

    let user = |name: &str| Some(json!({ "name": name, "role": "viewer" }));
    let no_csrf = api
        .call(
            Method::POST,
            "/v1/users",
            With {
                cookie: c,
                origin: Some(ORIGIN),
                ..With::default()
            },
            user("a"),
        )
        .await;
    assert_eq!(no_csrf.status, StatusCode::FORBIDDEN, "{}", no_csrf.text);
    assert!(no_csrf.text.contains("CSRF"), "{}", no_csrf.text);
    let wrong = api
        .call(
            Method::POST,
            "/v1/users",
            With {
                cookie: c,
                csrf: Some(&"0".repeat(64)),
                ..With::default()
            },
            user("a"),
        )
        .await;
    assert_eq!(wrong.status, StatusCode::FORBIDDEN, "{}", wrong.text);
    let cross = api
        .call(
            Method::POST,
            "/v1/users",
            With {
                cookie: c,
                csrf: Some(&csrf),
                origin: Some("https://attacker.example"),
                ..With::default()
            },
            user("a"),
        )
        .await;
    assert_eq!(cross.status, StatusCode::FORBIDDEN, "{}", cross.text);
    assert!(cross.text.contains("cross-site"), "{}", cross.text);
    let made = api
        .call(
            Method::POST,
            "/v1/users",
            With {
                cookie: c,
                csrf: Some(&csrf),
                origin: Some(ORIGIN),
                ..With::default()
            },
            user("a"),
        )
        .await;
    assert_eq!(made.status, StatusCode::CREATED, "{}", made.text);

    // A bearer token is what it always was: no CSRF token asked.
    let bearer = api
        .call(
            Method::POST,
            "/v1/users",
            With {
                bearer: Some(&api.admin),
                ..With::default()
            },
            user("b"),
        )
        .await;
    assert_eq!(bearer.status, StatusCode::CREATED, "{}", bearer.text);

    // Sign-out is a write too; after it the cookie opens nothing.
    let out = api
        .call(
            Method::DELETE,
            "/ui/api/session",
            With {
                cookie: c,
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(
        out.status,
        StatusCode::FORBIDDEN,
        "sign-out without the CSRF token"
    );
    let out = api
        .call(
            Method::DELETE,
            "/ui/api/session",
            With {
                cookie: c,
                csrf: Some(&csrf),
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(out.status, StatusCode::NO_CONTENT, "{}", out.text);
    assert!(out.headers["set-cookie"].to_str().unwrap().contains("Max-Age=0"));
    let a = api
        .call(
            Method::GET,
            "/v1/whoami",
            With {
                cookie: c,
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.text);
}

#[tokio::test]
async fn sign_in_refuses_a_bad_token_a_cross_site_page_and_a_form_post() {
    let api = Api::new().await;
    let bad = format!("otx_{}_{}", "0".repeat(16), "0".repeat(64));
    let call = |token: String, origin: &'static str, content_type: &'static str| {
        let api = &api;
        async move {
            api.call(
                Method::POST,
                "/ui/api/session",
                With {
                    origin: Some(origin),
                    content_type: Some(content_type),
                    ..With::default()
                },
                Some(json!({ "token": token })),
            )
            .await
        }
    };
    let a = call(bad, ORIGIN, "application/json").await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.text);
    assert!(a.headers.get("set-cookie").is_none());
    let a = call(api.admin.clone(), "https://attacker.example", "application/json").await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.text);
    assert!(a.headers.get("set-cookie").is_none());
    let a = call(api.admin.clone(), ORIGIN, "text/plain").await;
    assert_eq!(
        a.status,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "a form cannot send JSON: {}",
        a.text
    );
    assert!(a.headers.get("set-cookie").is_none());
}

#[tokio::test]
async fn a_viewers_session_writes_nothing_and_ends_when_its_token_is_revoked() {
    let api = Api::new().await;
    let admin = With {
        bearer: Some(&api.admin),
        ..With::default()
    };
    let a = api
        .call(
            Method::POST,
            "/v1/users",
            admin,
            Some(json!({"name": "vera", "role": "viewer"})),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.text);
    let admin = With {
        bearer: Some(&api.admin),
        ..With::default()
    };
    let t = api
        .call(Method::POST, "/v1/users/vera/tokens", admin, Some(json!({})))
        .await;
    assert_eq!(t.status, StatusCode::CREATED, "{}", t.text);
    let (token, id) = (t.json["token"].as_str().unwrap(), t.json["id"].as_str().unwrap());
    let (cookie, csrf) = api.sign_in(token).await;
    let c = Some(cookie.as_str());

    let me = api
        .call(
            Method::GET,
            "/ui/api/me",
            With {
                cookie: c,
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(me.json["role"], "viewer", "{}", me.text);
    let forged = api
        .call(
            Method::POST,
            "/v1/grants",
            With {
                cookie: c,
                csrf: Some(&csrf),
                origin: Some(ORIGIN),
                ..With::default()
            },
            Some(json!({"name": "g", "targets": [{"target": "lb/x", "port": 80}], "ttl_seconds": 60})),
        )
        .await;
    assert_eq!(forged.status, StatusCode::FORBIDDEN, "{}", forged.text);
    assert!(forged.text.contains("role viewer may not"), "{}", forged.text);

    let admin = With {
        bearer: Some(&api.admin),
        ..With::default()
    };
    let r = api
        .call(
            Method::DELETE,
            &format!("/v1/users/vera/tokens/{id}"),
            admin,
            None,
        )
        .await;
    assert!(r.status.is_success(), "{}", r.text);
    let a = api
        .call(
            Method::GET,
            "/v1/whoami",
            With {
                cookie: c,
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.text);
    assert!(a.text.contains("revoked"), "{}", a.text);
}

#[tokio::test]
async fn a_grants_session_sees_its_targets_and_nothing_else() {
    let api = Api::new().await;
    let admin = With {
        bearer: Some(&api.admin),
        ..With::default()
    };
    let g = api
        .call(
            Method::POST,
            "/v1/grants",
            admin,
            Some(json!({"name": "acme", "targets": [{"target": "lb/web", "port": 80}], "ttl_seconds": 600})),
        )
        .await;
    assert_eq!(g.status, StatusCode::CREATED, "{}", g.text);
    let (cookie, _) = api.sign_in(g.json["token"].as_str().unwrap()).await;
    let c = Some(cookie.as_str());
    let me = api
        .call(
            Method::GET,
            "/ui/api/me",
            With {
                cookie: c,
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(me.json["principal"], "grant:acme", "{}", me.text);
    assert_eq!(
        me.json["targets"],
        json!([{"target": "lb/web", "port": 80}]),
        "{}",
        me.text
    );
    for path in ["/v1/vms", "/v1/sessions", "/ui/api/overview"] {
        let a = api
            .call(
                Method::GET,
                path,
                With {
                    cookie: c,
                    ..With::default()
                },
                None,
            )
            .await;
        assert_eq!(a.status, StatusCode::FORBIDDEN, "{path}: {}", a.text);
    }
    let admin = With {
        bearer: Some(&api.admin),
        ..With::default()
    };
    let r = api
        .call(Method::POST, "/v1/grants/acme/revoke", admin, None)
        .await;
    assert!(r.status.is_success(), "{}", r.text);
    let me = api
        .call(
            Method::GET,
            "/ui/api/me",
            With {
                cookie: c,
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(me.status, StatusCode::UNAUTHORIZED, "{}", me.text);
}

#[tokio::test]
async fn the_console_is_served_from_the_binary_under_a_strict_content_security_policy() {
    let api = Api::new().await;
    for (path, kind) in [
        ("/ui/", "text/html"),
        ("/ui/app.js", "text/javascript"),
        ("/ui/app.css", "text/css"),
    ] {
        let a = api.call(Method::GET, path, With::default(), None).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        assert!(
            a.headers["content-type"].to_str().unwrap().starts_with(kind),
            "{path}"
        );
        let policy = a.headers["content-security-policy"].to_str().unwrap();
        if path == "/ui/" {
            // The page's own: a fresh style nonce, in its stylesheet link too.
            let nonce = policy
                .split("'nonce-")
                .nth(1)
                .and_then(|n| n.split('\'').next())
                .expect("a style nonce");
            assert_eq!(policy.replace(&format!(" 'nonce-{nonce}'"), ""), CSP, "{path}");
            assert!(a.text.contains(&format!("nonce=\"{nonce}\"")), "{}", a.text);
            let again = api.call(Method::GET, path, With::default(), None).await;
            assert_ne!(
                again.headers["content-security-policy"], policy,
                "a nonce per page served"
            );
        } else {
            assert_eq!(policy, CSP, "{path}");
        }
        assert_eq!(a.headers["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(a.headers["x-frame-options"], "DENY", "{path}");
    }
    // xterm.js, vendored: served from the binary, cacheable (its version is
    // in its path), under the same policy.
    for (file, kind) in [
        ("xterm.js", "text/javascript"),
        ("addon-fit.js", "text/javascript"),
        ("xterm.css", "text/css"),
    ] {
        let path = format!("/ui/vendor/xterm-5.5.0/{file}");
        let a = api.call(Method::GET, &path, With::default(), None).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        assert!(a.headers["content-type"].to_str().unwrap().starts_with(kind));
        assert_eq!(a.headers["content-security-policy"], CSP, "{path}");
        assert!(a.headers["cache-control"].to_str().unwrap().contains("immutable"));
        assert!(a.text.len() > 1000, "{path}");
    }
    let a = api.call(Method::GET, "/ui/api/me", With::default(), None).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.text);
}

// ------------------------------------------------------------------ the terminal

/// What a terminal handshake carries.
#[derive(Default, Clone, Copy)]
struct Handshake<'a> {
    cookie: Option<&'a str>,
    origin: Option<&'a str>,
    /// `Sec-WebSocket-Protocol`, as sent.
    protocols: Option<&'a str>,
}

/// The protocols the console's page offers, with `csrf`.
fn offered(csrf: &str) -> String {
    format!("{TERMINAL_PROTOCOL}, {CSRF_PROTOCOL_PREFIX}{csrf}")
}

/// A WebSocket handshake for `path` over a real socket (an upgrade needs
/// one): the status and the JSON error's code and message.
async fn handshake(addr: std::net::SocketAddr, path: &str, h: Handshake<'_>) -> (u16, String, String) {
    let mut req = format!(
        "GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
    );
    if let Some(c) = h.cookie {
        req += &format!("Cookie: theme=dark; {COOKIE}={c}\r\n");
    }
    if let Some(o) = h.origin {
        req += &format!("Origin: {o}\r\n");
    }
    if let Some(p) = h.protocols {
        req += &format!("Sec-WebSocket-Protocol: {p}\r\n");
    }
    req += "\r\n";
    let (status, head, body) = support::answer(addr, &req).await;
    assert_ne!(status, 101, "upgraded: {head}");
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
    let code = v["error"]["code"].as_str().unwrap_or_default().to_string();
    let message = v["error"]["message"].as_str().unwrap_or(&body).to_string();
    (status, code, message)
}

impl Api {
    /// `POST path` with the admin's token, which must succeed: the answer.
    async fn admin_post(&self, path: &str, body: Value) -> Value {
        let a = self
            .call(
                Method::POST,
                path,
                With {
                    bearer: Some(&self.admin),
                    ..With::default()
                },
                Some(body),
            )
            .await;
        assert!(a.status.is_success(), "{path}: {}", a.text);
        a.json
    }

    /// User `name` with `role`, signed in to the console: (cookie, csrf).
    async fn user_signed_in(&self, name: &str, role: &str) -> (String, String) {
        self.admin_post("/v1/users", json!({"name": name, "role": role}))
            .await;
        let t = self
            .admin_post(&format!("/v1/users/{name}/tokens"), json!({}))
            .await;
        self.sign_in(t["token"].as_str().unwrap()).await
    }
}

/// The terminal's WebSocket takes the console's sign-in instead of a ticket,
/// so it refuses — before upgrading, each for its own reason — another
/// site's page (the browser sends the cookie along), a missing session, a
/// missing or wrong CSRF token, and whomever `POST /v1/vms/{name}/console`
/// refuses; what it decides is audited as that is.
#[tokio::test]
async fn the_terminals_websocket_refuses_other_sites_no_session_no_csrf_token_and_whom_the_console_refuses() {
    let api = Api::new().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = api.router.clone();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    api.admin_post(
        "/v1/networks",
        json!({"name": "ov", "type": "overlay", "subnet": "10.77.0.0/24"}),
    )
    .await;
    api.admin_post("/v1/vms", json!({"name": "plain", "network": "ov"}))
        .await;
    api.admin_post(
        "/v1/vms",
        json!({"name": "qvm", "network": "ov", "runtime": "qemu", "labels": {"team": "ops"}}),
    )
    .await;
    let grant = api
        .admin_post(
            "/v1/grants",
            json!({"name": "acme", "targets": [{"target": "qvm", "port": 22}], "ttl_seconds": 600}),
        )
        .await;
    let (admin, admin_csrf) = api.sign_in(&api.admin).await;
    let (vera, vera_csrf) = api.user_signed_in("vera", "viewer").await;
    let (olga, olga_csrf) = api.user_signed_in("olga", "user").await;
    let (acme, acme_csrf) = api.sign_in(grant["token"].as_str().unwrap()).await;
    let qvm = "/ui/api/vms/qvm/console";
    let good = offered(&admin_csrf);
    let as_admin = Handshake {
        cookie: Some(&admin),
        origin: Some(ORIGIN),
        protocols: Some(&good),
    };

    // Not a WebSocket handshake at all.
    let a = api
        .call(
            Method::GET,
            qvm,
            With {
                cookie: Some(&admin),
                origin: Some(ORIGIN),
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST, "{}", a.text);

    // Another site's page, with the admin's cookie the browser sends along
    // (and even the token, had it learnt it): refused before anything else.
    for origin in [
        Some("https://attacker.example"),
        Some("http://cp.test:7443"),
        Some("null"),
        None,
    ] {
        let (status, code, message) = handshake(addr, qvm, Handshake { origin, ..as_admin }).await;
        assert_eq!(
            (status, code.as_str()),
            (403, "cross_site"),
            "{origin:?}: {message}"
        );
    }

    // No session, or one signed out.
    let (status, code, message) = handshake(
        addr,
        qvm,
        Handshake {
            cookie: None,
            ..as_admin
        },
    )
    .await;
    assert_eq!((status, code.as_str()), (401, "unauthenticated"), "{message}");

    // The session's own CSRF token, among the subprotocols, and the
    // terminal's protocol.
    let vera_token = offered(&vera_csrf);
    for (protocols, want_status, want_code) in [
        (Some(TERMINAL_PROTOCOL.to_string()), 403, "csrf"),
        (Some(vera_token.clone()), 403, "csrf"),
        (
            Some(format!("{TERMINAL_PROTOCOL}, {CSRF_PROTOCOL_PREFIX}")),
            403,
            "csrf",
        ),
        (None, 400, "invalid_request"),
        (
            Some(format!("{CSRF_PROTOCOL_PREFIX}{admin_csrf}")),
            400,
            "invalid_request",
        ),
    ] {
        let (status, code, message) = handshake(
            addr,
            qvm,
            Handshake {
                protocols: protocols.as_deref(),
                ..as_admin
            },
        )
        .await;
        assert_eq!(
            (status, code.as_str()),
            (want_status, want_code),
            "{protocols:?}: {message}"
        );
    }

    // Whom the console refuses: a viewer, a grant, a user without a rule
    // that lists the console; a netns guest; a VM not placed yet.
    let olga_token = offered(&olga_csrf);
    let acme_token = offered(&acme_csrf);
    for (cookie, protocols, path, want_status, want) in [
        (&vera, &vera_token, qvm, 403, "role viewer"),
        (&acme, &acme_token, qvm, 403, "does not open serial consoles"),
        (
            &olga,
            &olga_token,
            qvm,
            403,
            "no access rule for the serial console",
        ),
        (&admin, &good, "/ui/api/vms/plain/console", 400, "netns guest"),
        (&admin, &good, "/ui/api/vms/nosuch/console", 404, "not found"),
        (&admin, &good, qvm, 409, "not placed"),
    ] {
        let (status, code, message) = handshake(
            addr,
            path,
            Handshake {
                cookie: Some(cookie),
                origin: Some(ORIGIN),
                protocols: Some(protocols),
            },
        )
        .await;
        assert_eq!(status, want_status, "{path}: {code} {message}");
        assert!(message.contains(want), "{path}: {message}");
    }
    // The console's rule lets olga through to the same point as the admin.
    api.admin_post(
        "/v1/users/olga/rules",
        json!({"selector": "team=ops", "ports": [0]}),
    )
    .await;
    let (status, _, message) = handshake(
        addr,
        qvm,
        Handshake {
            cookie: Some(&olga),
            origin: Some(ORIGIN),
            protocols: Some(&olga_token),
        },
    )
    .await;
    assert_eq!(status, 409, "{message}");

    // The pages ask first whether to show the terminal: the same decision.
    for (cookie, path, allowed) in [
        (&admin, "/ui/api/vms/qvm/console/access", true),
        (&olga, "/ui/api/vms/qvm/console/access", true),
        (&vera, "/ui/api/vms/qvm/console/access", false),
        (&admin, "/ui/api/vms/plain/console/access", false),
    ] {
        let a = api
            .call(
                Method::GET,
                path,
                With {
                    cookie: Some(cookie),
                    ..With::default()
                },
                None,
            )
            .await;
        assert_eq!(a.json["allowed"], allowed, "{path}: {}", a.text);
    }

    // The decisions are in the audit trail as the console's (port 0); the
    // cross-site attempts and the missing tokens never reached one. (Refusals
    // are written on the side: waited for.)
    let refused_for = |records: &Value, who: &str| {
        records["events"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|r| r["principal"] == who && r["port"] == 0 && r["allowed"] == false)
            .count()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let a = api
            .call(
                Method::GET,
                "/v1/audit?target=qvm",
                With {
                    bearer: Some(&api.admin),
                    ..With::default()
                },
                None,
            )
            .await;
        let counts = [
            refused_for(&a.json, "user:admin"),
            refused_for(&a.json, "user:olga"),
            refused_for(&a.json, "grant:acme"),
        ];
        if counts == [1, 2, 1] {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "audit records {counts:?}: {}",
            a.text
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }

    // Signed out: the cookie opens nothing.
    let out = api
        .call(
            Method::DELETE,
            "/ui/api/session",
            With {
                cookie: Some(&admin),
                csrf: Some(&admin_csrf),
                origin: Some(ORIGIN),
                ..With::default()
            },
            None,
        )
        .await;
    assert!(out.status.is_success(), "{}", out.text);
    let (status, code, message) = handshake(addr, qvm, as_admin).await;
    assert_eq!((status, code.as_str()), (401, "unauthenticated"), "{message}");
    server.abort();
}

/// A resumable session of `principal` on VM `vm`'s console, as the
/// terminal's open records it (no agent holds it here: a resume that passes
/// every check stops at its node, gone), waiting for a resume with `secret`.
async fn waiting_session(api: &Api, principal: &str, vm: &str, secret: &str) -> String {
    let id = hex::encode(otherix_server::random::bytes::<16>());
    let now = time::OffsetDateTime::now_utc();
    let at = now
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    let claims = json!({
        "iss": "test", "aud": "cp", "sub": principal, "jti": id, "iat": at, "nbf": at, "exp": at,
        "vm": vm, "vm_id": "vm-1", "net": "ov", "ip": "10.77.0.2", "port": 0,
    });
    let open = otherix_proto::OpenSession {
        id: id.clone(),
        principal: principal.into(),
        target: vm.into(),
        port: 0,
        transport: otherix_proto::Transport::Relay,
        node: "gone-node".into(),
        replica: None,
        started_at: now,
        bytes_up: 0,
        bytes_down: 0,
        bytes_at: None,
    };
    let record = otherix_store::ResumeRecord {
        session: id.clone(),
        secret_hash: hex::encode(otherix_server::tokens::hash_secret(secret)),
        claims: claims.to_string(),
        node: "gone-node".into(),
        grace_ms: 60_000,
        detached_at: None,
    };
    api.state
        .store
        .start_resumable_session(&open, &record)
        .await
        .unwrap();
    api.state.store.detach_session(&id, 0, now).await.unwrap();
    id
}

/// A page resuming its terminal offers, besides the terminal's protocols,
/// the resumable stream and the resume's parts as subprotocols.
fn resume_offered(csrf: &str, id: &str, secret: &str) -> String {
    format!(
        "{}, otherix.relay.resumable.v1, {RESUME_PROTOCOL_PREFIX}{id}, {SECRET_PROTOCOL_PREFIX}{secret}, \
         {RECEIVED_PROTOCOL_PREFIX}42, {CAUSE_PROTOCOL_PREFIX}connection-lost-1006",
        offered(csrf)
    )
}

/// A terminal's resume comes through the terminal's own URL, checked as its
/// open is (the console's origin, a session, its CSRF token), then as every
/// relay resume is: the session must be the caller's, and that VM's
/// console (else 404, as if there were none), its secret right (403).
#[tokio::test]
async fn a_terminals_resume_is_checked_as_its_open_then_as_every_resume() {
    let api = Api::new().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = api.router.clone();
    let server = tokio::spawn(async move { axum::serve(listener, router).await });
    let (admin, admin_csrf) = api.sign_in(&api.admin).await;
    let (olga, olga_csrf) = api.user_signed_in("olga", "user").await;
    let secret = hex::encode(otherix_server::random::bytes::<32>());
    let mine = waiting_session(&api, "user:admin", "qvm", &secret).await;
    let olgas = waiting_session(&api, "user:olga", "qvm", &secret).await;
    let qvm = "/ui/api/vms/qvm/console";
    let good = resume_offered(&admin_csrf, &mine, &secret);
    let as_admin = Handshake {
        cookie: Some(&admin),
        origin: Some(ORIGIN),
        protocols: Some(&good),
    };

    // The open's checks first: another site's page, no session, no token.
    let (status, code, message) = handshake(
        addr,
        qvm,
        Handshake {
            origin: Some("https://attacker.example"),
            ..as_admin
        },
    )
    .await;
    assert_eq!((status, code.as_str()), (403, "cross_site"), "{message}");
    let (status, code, message) = handshake(
        addr,
        qvm,
        Handshake {
            cookie: None,
            ..as_admin
        },
    )
    .await;
    assert_eq!((status, code.as_str()), (401, "unauthenticated"), "{message}");
    let no_csrf = good.replace(&admin_csrf, "00");
    let (status, code, message) = handshake(
        addr,
        qvm,
        Handshake {
            protocols: Some(&no_csrf),
            ..as_admin
        },
    )
    .await;
    assert_eq!((status, code.as_str()), (403, "csrf"), "{message}");

    // Then the resume's: a wrong secret, another principal's session (with
    // the right secret), a session of another VM's console, none at all.
    let wrong = resume_offered(&admin_csrf, &mine, &"0".repeat(64));
    let theirs = resume_offered(&admin_csrf, &olgas, &secret);
    let unknown = resume_offered(&admin_csrf, &"ab".repeat(16), &secret);
    for (path, protocols, want, says) in [
        (qvm, &wrong, 403, "wrong resume secret"),
        (qvm, &theirs, 404, "of yours to resume"),
        ("/ui/api/vms/other/console", &good, 404, "of yours to resume"),
        (qvm, &unknown, 404, "of yours to resume"),
    ] {
        let (status, _, message) = handshake(
            addr,
            path,
            Handshake {
                protocols: Some(protocols),
                ..as_admin
            },
        )
        .await;
        assert_eq!(status, want, "{path}: {message}");
        assert!(message.contains(says), "{path}: {message}");
    }
    // Olga's own resume passes every check: it stops at the node, gone.
    let hers = resume_offered(&olga_csrf, &olgas, &secret);
    let (status, _, message) = handshake(
        addr,
        qvm,
        Handshake {
            cookie: Some(&olga),
            origin: Some(ORIGIN),
            protocols: Some(&hers),
        },
    )
    .await;
    assert_eq!(status, 503, "{message}");
    assert!(message.contains("gone-node is gone"), "{message}");

    // A resume without the resumable stream, or without its secret, is malformed.
    for protocols in [
        good.replace(", otherix.relay.resumable.v1", ""),
        good.replace(&format!(", {SECRET_PROTOCOL_PREFIX}{secret}"), ""),
    ] {
        let (status, code, message) = handshake(
            addr,
            qvm,
            Handshake {
                protocols: Some(&protocols),
                ..as_admin
            },
        )
        .await;
        assert_eq!(
            (status, code.as_str()),
            (400, "invalid_request"),
            "{protocols}: {message}"
        );
    }
    server.abort();
}

/// `GET /v1/sessions` reads the sessions its filters name (a user's, their
/// own), `POST /v1/sessions/{id}/end` the one it ends, and the console's
/// overview counts a user's own.
#[tokio::test]
async fn session_lists_hold_what_their_filters_and_the_callers_role_allow() {
    let api = Api::new().await;
    let mut tokens = Vec::new();
    for name in ["alice", "bob"] {
        api.admin_post("/v1/users", json!({"name": name, "role": "user"}))
            .await;
        let t = api
            .admin_post(&format!("/v1/users/{name}/tokens"), json!({}))
            .await;
        tokens.push(t["token"].as_str().unwrap().to_string());
    }
    let now = time::OffsetDateTime::now_utc();
    for (i, (id, principal, target, node)) in [
        ("a1", "user:alice", "web01", "gw1"),
        ("b1", "user:bob", "web01", "gw2"),
        ("a2", "user:alice", "db01", "gw2"),
    ]
    .into_iter()
    .enumerate()
    {
        let open = otherix_proto::OpenSession {
            id: id.into(),
            principal: principal.into(),
            target: target.into(),
            port: 22,
            transport: otherix_proto::Transport::Relay,
            node: node.into(),
            replica: None,
            started_at: now + time::Duration::seconds(i as i64),
            bytes_up: 0,
            bytes_down: 0,
            bytes_at: None,
        };
        api.state.store.start_session(&open).await.unwrap();
    }
    let ids = |a: &Answer| -> Vec<String> {
        assert_eq!(a.status, StatusCode::OK, "{}", a.text);
        a.json
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect()
    };
    fn as_user(t: &str) -> With<'_> {
        With {
            bearer: Some(t),
            ..With::default()
        }
    }
    let admin = api.admin.clone();
    for (token, path, want) in [
        (&tokens[0], "/v1/sessions", vec!["a1", "a2"]),
        (&tokens[0], "/v1/sessions?target=db01", vec!["a2"]),
        (
            &tokens[0],
            "/v1/sessions?principal=user:alice&node=gw1",
            vec!["a1"],
        ),
        // Another's: none of them, not an error that tells what exists.
        (&tokens[0], "/v1/sessions?principal=user:bob", vec![]),
        (&tokens[1], "/v1/sessions", vec!["b1"]),
        (&admin, "/v1/sessions", vec!["a1", "b1", "a2"]),
        (&admin, "/v1/sessions?principal=user:bob", vec!["b1"]),
        (&admin, "/v1/sessions?target=web01&node=gw2", vec!["b1"]),
        (&admin, "/v1/sessions?node=gw9", vec![]),
    ] {
        let a = api.call(Method::GET, path, as_user(token), None).await;
        assert_eq!(ids(&a), want, "{path}");
    }
    let a = api
        .call(Method::POST, "/v1/sessions/zz/end", as_user(&admin), None)
        .await;
    assert_eq!(a.status, StatusCode::NOT_FOUND, "{}", a.text);
    assert!(a.text.contains("no open session \\\"zz\\\""), "{}", a.text);
    let a = api
        .call(Method::POST, "/v1/sessions/b1/end", as_user(&tokens[0]), None)
        .await;
    assert_eq!(a.status, StatusCode::FORBIDDEN, "{}", a.text);
    let (cookie, _) = api.sign_in(&tokens[0]).await;
    let a = api
        .call(
            Method::GET,
            "/ui/api/overview",
            With {
                cookie: Some(&cookie),
                ..With::default()
            },
            None,
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text);
    assert_eq!(a.json["sessions_open"], 2, "{}", a.text);
}
