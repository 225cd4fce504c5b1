//! The web console under `/ui/`: hand-written pages compiled into the
//! binary, served on the API's own listener (same origin, so the pages
//! call the `/v1/` API with the session cookie; see `docs/architecture.md`).
//!
//! This module only signs browsers in and out ([`session`]), serves the
//! files, pushes change notices, and sums up the overview. What a signed-in
//! browser may see or do is decided where it is for every caller: the
//! `/v1/` handlers, which take the cookie as they take a bearer token
//! ([`caller_of_cookie`]), with the CSRF token required on every write.

pub mod session;
pub mod terminal;

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::{Json, Router};
use http::request::Parts;
use http::{header, HeaderMap, HeaderValue, StatusCode};
use otherix_proto::{AuditCursor, AuditRecord, GrantTarget, Role};
use otherix_store::{AuditFilter, ChangeKind};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::api::ApiJson;
use crate::auth::{Caller, Principal};
use crate::error::ApiError;
use crate::state::AppState;
use session::{Found, Holder};

/// The console's files, compiled in: no toolchain at build time, nothing
/// fetched at run time.
const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");
/// xterm.js for the terminal, vendored (see `assets/vendor/xterm-5.5.0/README.md`);
/// its version is in the path, so these may be cached.
const XTERM_DIR: &str = "/ui/vendor/xterm-5.5.0/";
const XTERM_JS: &str = include_str!("assets/vendor/xterm-5.5.0/xterm.js");
const XTERM_CSS: &str = include_str!("assets/vendor/xterm-5.5.0/xterm.css");
const XTERM_FIT_JS: &str = include_str!("assets/vendor/xterm-5.5.0/addon-fit.js");
/// What `index.html` says where its style nonce goes.
const NONCE_SLOT: &str = "{{style-nonce}}";

/// Change notices go out at most this often: one at once, what follows
/// within this long together after it.
const COALESCE: Duration = Duration::from_millis(200);
/// How often a live stream checks that its session still stands and
/// whether a node turned Ready or NotReady (time passing, not a change).
const RECHECK: Duration = Duration::from_secs(2);
/// The overview's "recent refusals": this far back ...
const REFUSALS_WINDOW: time::Duration = time::Duration::minutes(15);
/// ... at most this many records read, and this many shown.
const REFUSALS_SCAN: u32 = 5000;
const REFUSALS_SHOWN: usize = 20;

/// The console's routes, merged into the API's router (its layers apply).
pub fn router() -> Router<AppState> {
    Router::new()
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(index))
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/ui/app.css",
            get(|| async { asset("text/css; charset=utf-8", APP_CSS) }),
        )
        .route(
            &format!("{XTERM_DIR}xterm.js"),
            get(|| async { vendored("text/javascript; charset=utf-8", XTERM_JS) }),
        )
        .route(
            &format!("{XTERM_DIR}addon-fit.js"),
            get(|| async { vendored("text/javascript; charset=utf-8", XTERM_FIT_JS) }),
        )
        .route(
            &format!("{XTERM_DIR}xterm.css"),
            get(|| async { vendored("text/css; charset=utf-8", XTERM_CSS) }),
        )
        .route("/ui/api/session", axum::routing::post(sign_in).delete(sign_out))
        .route("/ui/api/me", get(me))
        .route("/ui/api/overview", get(overview))
        .route("/ui/api/events", get(events))
        .route("/ui/api/vms/{name}/console", get(terminal::terminal))
        .route("/ui/api/vms/{name}/console/access", get(terminal::access))
        .layer(axum::middleware::map_response(protect))
}

/// Headers on every console answer: the strict CSP (the page's own, with
/// its style nonce, when it set one), no sniffing, no framing, no
/// referrer, and nothing cached that a later user could see.
async fn protect(mut resp: Response) -> Response {
    let h = resp.headers_mut();
    h.entry(header::CONTENT_SECURITY_POLICY)
        .or_insert(HeaderValue::from_static(session::CSP));
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    resp
}

/// The page, with a style nonce of its own in its policy and in its
/// stylesheet link, where `app.js` reads it (see [`session::page_csp`]).
async fn index() -> Response {
    let nonce = hex::encode(crate::random::bytes::<16>());
    let policy =
        HeaderValue::from_str(&session::page_csp(&nonce)).unwrap_or(HeaderValue::from_static(session::CSP));
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/html; charset=utf-8"),
            ),
            (header::CONTENT_SECURITY_POLICY, policy),
        ],
        INDEX_HTML.replace(NONCE_SLOT, &nonce),
    )
        .into_response()
}

/// A vendored library's file: the same for everyone, its version in its path.
fn vendored(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "public, max-age=604800, immutable"),
        ],
        body,
    )
        .into_response()
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}

/// The caller a console cookie stands for, authenticated again from the
/// credential the session was opened with; on a write, only from the
/// console's own pages and with the session's CSRF token.
pub async fn caller_of_cookie(parts: &Parts, state: &AppState, cookie: &str) -> Result<Caller, ApiError> {
    let (found, caller) = session_caller(state, cookie).await?;
    if session::is_write(&parts.method) {
        if !session::same_origin(&parts.headers) {
            return Err(ApiError::Forbidden(
                "cross-site request refused: console writes come from the console's own pages".into(),
            ));
        }
        let presented = parts
            .headers
            .get(session::CSRF_HEADER)
            .and_then(|v| v.to_str().ok());
        if !state.console.csrf_matches(&found.id, presented) {
            return Err(ApiError::Forbidden(format!(
                "missing or wrong CSRF token ({}); reload the console",
                session::CSRF_HEADER
            )));
        }
    }
    Ok(caller)
}

/// The session `cookie` names and who it is now. A session whose
/// credential was revoked or expired is closed.
async fn session_caller(state: &AppState, cookie: &str) -> Result<(Found, Caller), ApiError> {
    let found = state
        .console
        .find(cookie, OffsetDateTime::now_utc())
        .ok_or_else(|| {
            ApiError::Unauthenticated("console session expired or signed out; sign in again".into())
        })?;
    let caller = match &found.holder {
        Holder::User { token_id } => crate::auth::user_by_token_id(state, token_id)
            .await
            .map(Caller::User),
        Holder::Grant { grant_id } => crate::auth::grant_by_id(state, grant_id).await.map(Caller::Grant),
    };
    match caller {
        Ok(caller) => Ok((found, caller)),
        Err(e) => {
            state.console.close(cookie);
            Err(e)
        }
    }
}

/// `POST /ui/api/session`: an API token or a grant token (the pages read it
/// out of a grant file) for a session cookie.
#[derive(Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
struct SignIn {
    token: String,
}

/// Who is signed in, as the pages show it.
#[derive(Debug, Serialize)]
struct Me {
    /// `user:NAME` or `grant:NAME`.
    principal: String,
    name: String,
    /// A user's role; none for a grant.
    role: Option<Role>,
    /// Sent back in `x-otherix-csrf` on every write.
    csrf: String,
    /// A grant's targets (all a grant holder sees).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    targets: Vec<GrantTarget>,
    #[serde(
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    expires_at: Option<OffsetDateTime>,
    /// For the commands the pages print: the CA to trust.
    ca_fingerprint: String,
    cluster_id: String,
}

async fn sign_in(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<SignIn>,
) -> Result<Response, ApiError> {
    // A JSON body cannot come from a cross-site form; a cross-site fetch
    // would say where it comes from.
    if !session::same_origin(&headers) {
        return Err(ApiError::Forbidden("cross-site sign-in refused".into()));
    }
    let token = req.token.trim();
    let caller = if token.starts_with(crate::tokens::GRANT_PREFIX) {
        Caller::Grant(crate::auth::authenticate_grant(&state, token).await?)
    } else {
        Caller::User(crate::auth::authenticate_user(&state, token).await?)
    };
    let holder = match &caller {
        Caller::User(p) => Holder::User {
            token_id: p.token_id.clone(),
        },
        Caller::Grant(g) => Holder::Grant {
            grant_id: g.id.clone(),
        },
    };
    let opened = state.console.open(holder, OffsetDateTime::now_utc());
    tracing::info!(principal = %caller.id(), "console signed in");
    let me = me_of(&state, &caller, opened.csrf.clone());
    let cookie = HeaderValue::from_str(&session::set_cookie(&opened.cookie))
        .map_err(|e| ApiError::Internal(format!("session cookie: {e}")))?;
    Ok(([(header::SET_COOKIE, cookie)], Json(me)).into_response())
}

/// `DELETE /ui/api/session`: signs out (a write: the CSRF token is checked).
async fn sign_out(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if let Some(cookie) = session::cookie_value(&headers) {
        state.console.close(cookie);
    }
    tracing::info!(principal = %caller.id(), "console signed out");
    let clear = HeaderValue::from_str(&session::clear_cookie())
        .map_err(|e| ApiError::Internal(format!("session cookie: {e}")))?;
    Ok((StatusCode::NO_CONTENT, [(header::SET_COOKIE, clear)]).into_response())
}

async fn me(State(state): State<AppState>, caller: Caller, headers: HeaderMap) -> Json<Me> {
    let csrf = session::cookie_value(&headers)
        .and_then(|c| state.console.find(c, OffsetDateTime::now_utc()))
        .map(|f| state.console.csrf_of(&f.id))
        .unwrap_or_default();
    Json(me_of(&state, &caller, csrf))
}

fn me_of(state: &AppState, caller: &Caller, csrf: String) -> Me {
    let (name, role, targets, expires_at) = match caller {
        Caller::User(p) => (p.name.clone(), Some(p.role), Vec::new(), None),
        Caller::Grant(g) => (
            g.name.clone(),
            None,
            state
                .catalog
                .read()
                .grant(&g.id)
                .map(|r| r.targets.clone())
                .unwrap_or_default(),
            Some(g.expires_at),
        ),
    };
    Me {
        principal: caller.id(),
        name,
        role,
        csrf,
        targets,
        expires_at,
        ca_fingerprint: state.info.ca_fingerprint.clone(),
        cluster_id: state.info.cluster_id.clone(),
    }
}

/// `GET /ui/api/overview`: the cluster at a glance, summed up here from the
/// catalog (a few counts, not the tables).
#[derive(Debug, Serialize)]
struct Overview {
    nodes_ready: usize,
    nodes_not_ready: usize,
    /// VMs per state.
    vms: BTreeMap<String, usize>,
    /// Load balancers per status.
    lbs: BTreeMap<String, usize>,
    /// Sessions open now (a user: their own).
    sessions_open: usize,
    /// Refused broker decisions of the last minutes, newest first (admins
    /// and viewers: what the audit trail shows them).
    refusals: Vec<AuditRecord>,
    /// Per node, when its certificate that expires first does.
    #[serde(serialize_with = "rfc3339_map")]
    cert_expiry: BTreeMap<String, OffsetDateTime>,
}

fn rfc3339_map<S: serde::Serializer>(m: &BTreeMap<String, OffsetDateTime>, s: S) -> Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut out = s.serialize_map(Some(m.len()))?;
    for (k, v) in m {
        let text = v
            .format(&time::format_description::well_known::Rfc3339)
            .map_err(serde::ser::Error::custom)?;
        out.serialize_entry(k, &text)?;
    }
    out.end()
}

async fn overview(State(state): State<AppState>, p: Principal) -> Result<Json<Overview>, ApiError> {
    crate::limits::check_list(&state.list_limits, &p, "console overview")?;
    let now = OffsetDateTime::now_utc();
    let mut o = Overview {
        nodes_ready: 0,
        nodes_not_ready: 0,
        vms: BTreeMap::new(),
        lbs: BTreeMap::new(),
        sessions_open: 0,
        refusals: Vec::new(),
        cert_expiry: BTreeMap::new(),
    };
    {
        let m = state.catalog.read();
        for n in m.nodes() {
            if crate::desired::is_ready(n, now, state.settings.node_timeout) {
                o.nodes_ready += 1;
            } else {
                o.nodes_not_ready += 1;
            }
            if let Some(first) = m.node_certs(&n.name).map(|c| c.not_after).min() {
                o.cert_expiry.insert(n.name.clone(), first);
            }
        }
        for vm in m.vms() {
            *o.vms.entry(vm.state.to_string()).or_default() += 1;
        }
        for lb in m.lbs() {
            let name = lb.record.name.as_str();
            let view = crate::lb::view(
                &lb.record,
                &m.pool(lb),
                &|vm: &otherix_proto::Vm| m.verdict(name, &vm.id),
                &|vm: &otherix_proto::Vm| crate::lb::node_ready(&m, vm, now, state.settings.node_timeout),
                now,
                false,
            );
            // Its wire name (`healthy`, `degraded`, ...), as `lb list` shows it.
            let status = serde_json::to_value(view.status)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default();
            *o.lbs.entry(status).or_default() += 1;
        }
    }
    let own = (p.role == Role::User).then(|| p.id());
    o.sessions_open = state
        .store
        .open_sessions_by_transport(own.as_deref())
        .await?
        .iter()
        .map(|(_, n)| *n as usize)
        .sum();
    // The audit trail is for admins and viewers, as `GET /v1/audit` says.
    if p.role != Role::User {
        let from = AuditCursor::at_or_after(now - REFUSALS_WINDOW);
        let filter = AuditFilter {
            principal: None,
            target: None,
        };
        let (events, _) = state.store.audit_page(from, &filter, REFUSALS_SCAN).await?;
        o.refusals = events
            .into_iter()
            .rev()
            .filter(|e| !e.allowed)
            .take(REFUSALS_SHOWN)
            .collect();
    }
    Ok(Json(o))
}

/// What a page shows, as the live stream names it: a page re-reads what it
/// shows when its topic comes.
pub const TOPICS: [&str; 8] = [
    "audit", "grants", "lbs", "networks", "nodes", "sessions", "users", "vms",
];

/// The topics a catch-up's kinds of change concern.
pub fn topics_of(kinds: &BTreeSet<ChangeKind>) -> BTreeSet<&'static str> {
    let mut t = BTreeSet::new();
    for kind in kinds {
        match kind {
            ChangeKind::User => t.extend(["users"]),
            ChangeKind::Grant => t.extend(["grants"]),
            ChangeKind::Network => t.extend(["networks"]),
            // A VM's labels and state move it in and out of pools.
            ChangeKind::Vm => t.extend(["vms", "lbs"]),
            ChangeKind::NodeLease | ChangeKind::Node | ChangeKind::NodeCert => t.extend(["nodes"]),
            ChangeKind::Lb | ChangeKind::Verdict => t.extend(["lbs"]),
            // Session starts and ends are audit records too.
            ChangeKind::OpenSessions => t.extend(["sessions", "audit"]),
            // Byte counts move all the time: `follow` tells the sessions
            // page at most once per `RECHECK`, not per catch-up.
            ChangeKind::SessionKeys | ChangeKind::Revocations | ChangeKind::SessionBytes => {}
        }
    }
    t
}

/// `GET /ui/api/events`: Server-Sent Events, `change` with the topics that
/// changed, pushed as the catalog applies the change log (and the audit
/// writer commits). The first event names every topic: a page that
/// (re)connects re-reads what it shows, so a dropped stream catches up.
/// The stream ends (`signed-out`) once its session no longer stands.
async fn events(
    State(state): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
) -> Sse<impl futures_util::Stream<Item = Result<Event, Infallible>>> {
    let cookie = session::cookie_value(&headers).map(str::to_owned);
    let (tx, rx) = tokio::sync::mpsc::channel::<Event>(16);
    tokio::spawn(follow(state, caller, cookie, tx));
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
}

/// Feeds one live stream until the browser goes or its session ends.
async fn follow(
    state: AppState,
    caller: Caller,
    cookie: Option<String>,
    tx: tokio::sync::mpsc::Sender<Event>,
) {
    let mut applied = state.catalog.applied();
    let mut audit = state.audit.written();
    let mut recheck = tokio::time::interval(RECHECK);
    recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut readiness = ready_nodes(&state);
    let mut seq: u64 = 0;
    let mut pending: BTreeSet<&'static str> = TOPICS.into_iter().collect();
    // A change goes out at once; what follows within COALESCE of it goes
    // out together after it (a burst of writes costs a page one re-read).
    let started = tokio::time::Instant::now();
    let mut last_sent = started.checked_sub(COALESCE).unwrap_or(started);
    // Open sessions' byte counts moved since the last recheck.
    let mut bytes_moved = false;
    tracing::debug!(principal = %caller.id(), "console stream opened");
    loop {
        if !pending.is_empty() {
            let until = last_sent + COALESCE;
            while tokio::time::Instant::now() < until {
                tokio::select! {
                    () = tokio::time::sleep_until(until) => break,
                    got = applied.recv() => match got {
                        Ok(kinds) => {
                            bytes_moved |= kinds.contains(&ChangeKind::SessionBytes);
                            pending.extend(topics_of(&kinds));
                        }
                        Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => pending.extend(TOPICS),
                        Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                    },
                    changed = audit.changed() => {
                        if changed.is_err() { return; }
                        pending.insert("audit");
                    }
                }
            }
            seq += 1;
            last_sent = tokio::time::Instant::now();
            let topics: Vec<&str> = std::mem::take(&mut pending).into_iter().collect();
            let data = serde_json::json!({ "topics": topics }).to_string();
            if tx
                .send(Event::default().event("change").id(seq.to_string()).data(data))
                .await
                .is_err()
            {
                return;
            }
        }
        tokio::select! {
            () = tx.closed() => return,
            got = applied.recv() => match got {
                Ok(kinds) => {
                    bytes_moved |= kinds.contains(&ChangeKind::SessionBytes);
                    pending.extend(topics_of(&kinds));
                }
                Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => pending.extend(TOPICS),
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
            },
            changed = audit.changed() => {
                if changed.is_err() { return; }
                pending.insert("audit");
            }
            _ = recheck.tick() => {
                if let Some(cookie) = &cookie {
                    if let Err(e) = session_caller(&state, cookie).await {
                        let data = serde_json::json!({ "message": e.to_string() }).to_string();
                        let _ = tx.send(Event::default().event("signed-out").data(data)).await;
                        return;
                    }
                }
                if std::mem::take(&mut bytes_moved) {
                    pending.insert("sessions");
                }
                let now = ready_nodes(&state);
                if now != readiness {
                    readiness = now;
                    pending.insert("nodes");
                }
            }
        }
    }
}

/// The Ready nodes, by name: a node turns NotReady by time passing, which
/// no change records.
fn ready_nodes(state: &AppState) -> BTreeSet<String> {
    let now = OffsetDateTime::now_utc();
    state
        .catalog
        .read()
        .nodes()
        .filter(|n| crate::desired::is_ready(n, now, state.settings.node_timeout))
        .map(|n| n.name.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_change_reaches_the_pages_that_show_it() {
        let of = |k: ChangeKind| topics_of(&BTreeSet::from([k]));
        assert_eq!(of(ChangeKind::Verdict), BTreeSet::from(["lbs"]));
        assert_eq!(of(ChangeKind::Vm), BTreeSet::from(["lbs", "vms"]));
        assert_eq!(
            of(ChangeKind::OpenSessions),
            BTreeSet::from(["audit", "sessions"])
        );
        assert_eq!(of(ChangeKind::NodeCert), BTreeSet::from(["nodes"]));
        assert_eq!(of(ChangeKind::Grant), BTreeSet::from(["grants"]));
        assert!(of(ChangeKind::SessionKeys).is_empty());
        // Told once per recheck by the stream, not per catch-up.
        assert!(of(ChangeKind::SessionBytes).is_empty());
        let all = topics_of(&ChangeKind::ALL.into_iter().collect());
        for t in all {
            assert!(TOPICS.contains(&t), "{t} is a topic");
        }
    }

    #[test]
    fn the_pages_reference_only_their_own_files_and_no_inline_script_or_style() {
        for (name, text) in [("index.html", INDEX_HTML), ("app.js", APP_JS)] {
            for forbidden in [
                "<script>",
                "style=",
                "onclick=",
                "onload=",
                "javascript:",
                "http://",
                "https://",
                "eval(",
            ] {
                assert!(!text.contains(forbidden), "{name} has {forbidden:?}");
            }
        }
        assert!(INDEX_HTML.contains(r#"<script src="/ui/app.js" defer></script>"#));
        assert!(INDEX_HTML.contains(r#"<link rel="stylesheet" href="/ui/app.css" nonce="{{style-nonce}}">"#));
        assert!(
            APP_JS.contains(XTERM_DIR),
            "app.js loads the vendored xterm.js from where it is served"
        );
    }
}
