//! The web console's sign-in driven in memory through the whole router (as
//! `router.rs` drives the API): a session cookie is taken by every `/v1/`
//! endpoint as the token it was opened with is, writes need its CSRF token
//! and the console's own origin, and it ends with its token. The browser
//! tests (crates/otherix/tests/web_console_e2e.rs) cover the pages.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::Router;
use http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use otherix_proto::ServerInfo;
use otherix_server::console::session::{COOKIE, CSP, CSRF_HEADER};
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

const HOST: &str = "cp.test:7443";
const ORIGIN: &str = "https://cp.test:7443";

struct Api {
    router: Router,
    admin: String,
    _dir: Dir,
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
        let dir = Dir(std::env::temp_dir().join(format!(
            "otherix-console-{}-{}",
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
            router: otherix_server::api::router(state),
            admin,
            _dir: dir,
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
        assert_eq!(a.headers["content-security-policy"], CSP, "{path}");
        assert_eq!(a.headers["x-content-type-options"], "nosniff", "{path}");
        assert_eq!(a.headers["x-frame-options"], "DENY", "{path}");
    }
    let a = api.call(Method::GET, "/ui/api/me", With::default(), None).await;
    assert_eq!(a.status, StatusCode::UNAUTHORIZED, "{}", a.text);
}
