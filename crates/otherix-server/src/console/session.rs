//! The web console's sign-ins: a session cookie stands for the API token
//! or grant it was opened with, and each request made with it is
//! authenticated again from that credential (so revoking the token, or the
//! grant, signs the console out at once). What the browser holds:
//!
//! - the cookie `__Host-otx_console` = `otxs_<id>_<secret>`, `HttpOnly`,
//!   `Secure`, `SameSite=Strict`, `Path=/`; only the SHA-256 of the secret
//!   is kept here, checked in constant time (as API tokens are);
//! - a CSRF token, `HMAC(key, id)` under a key of this process, that the
//!   pages send in [`CSRF_HEADER`] on every write; it is stored nowhere.
//!
//! Pure but for the clock, which is passed in: every rule is a unit test.

use std::collections::HashMap;
use std::sync::Mutex;

use http::HeaderMap;
use ring::hmac;
use subtle::ConstantTimeEq;
use time::{Duration, OffsetDateTime};

use crate::tokens::{hash_secret, new_token_with, secret_matches, split_token_with};

/// The cookie's name: `__Host-` makes the browser refuse it unless it is
/// `Secure`, has `Path=/` and no `Domain` (no sibling host can set it).
pub const COOKIE: &str = "__Host-otx_console";
/// What a console cookie's value starts with.
pub const PREFIX: &str = "otxs_";
/// The header that carries the CSRF token on writes.
pub const CSRF_HEADER: &str = "x-otherix-csrf";
/// A session unused this long is closed.
pub const IDLE: Duration = Duration::minutes(30);
/// No session lives longer than this, used or not.
pub const MAX_AGE: Duration = Duration::hours(8);
/// Sessions one credential may hold open; past it the oldest is closed.
pub const PER_CREDENTIAL: usize = 16;
/// Sessions in all; past it the oldest is closed.
pub const MAX_SESSIONS: usize = 10_000;

/// The Content-Security-Policy of every console response: nothing but this
/// origin's own files, no inline script or style, no framing.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

/// The policy of the page itself (`/ui/`): [`CSP`], but `<style>` elements
/// that carry `nonce` (a fresh one each time the page is served) apply too.
/// The terminal's xterm.js (DOM renderer) makes two `<style>` elements of
/// its own; the page stamps them with the nonce as they are made (see
/// `app.js`, `stampStyleNonce`). Scripts stay `'self'` only, style
/// attributes stay refused (xterm.js then loses only 24-bit colours and
/// contrast corrections, which it sets as `style=`), and no `'unsafe-inline'`
/// appears anywhere: markup injected into the page could not carry the
/// nonce, which only the page's own script reads.
pub fn page_csp(nonce: &str) -> String {
    CSP.replace("style-src 'self';", &format!("style-src 'self' 'nonce-{nonce}';"))
}

/// What a session was opened with: re-checked on every request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// An API token (its public id).
    User { token_id: String },
    /// A grant (its id).
    Grant { grant_id: String },
}

#[derive(Debug)]
struct Entry {
    secret_hash: Vec<u8>,
    holder: Holder,
    opened: OffsetDateTime,
    used: OffsetDateTime,
}

impl Entry {
    fn expires(&self) -> OffsetDateTime {
        (self.used + IDLE).min(self.opened + MAX_AGE)
    }
}

/// A session just opened: the cookie's value and the CSRF token go to the
/// browser once.
pub struct Opened {
    pub cookie: String,
    pub csrf: String,
}

impl std::fmt::Debug for Opened {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Opened").finish_non_exhaustive()
    }
}

/// A session a cookie named.
#[derive(Debug, Clone)]
pub struct Found {
    pub id: String,
    pub holder: Holder,
}

/// The console's open sessions, in this process.
pub struct Sessions {
    open: Mutex<HashMap<String, Entry>>,
    csrf_key: hmac::Key,
    /// Bumped whenever a session is closed (signed out): what a session
    /// opened with a cookie (the terminal) re-checks its cookie on.
    closings: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions").finish_non_exhaustive()
    }
}

impl Default for Sessions {
    fn default() -> Self {
        Sessions {
            open: Mutex::default(),
            csrf_key: hmac::Key::new(hmac::HMAC_SHA256, &crate::random::bytes::<32>()),
            closings: tokio::sync::watch::channel(0).0,
        }
    }
}

impl Sessions {
    /// Opens a session for `holder`, closing expired ones, and the
    /// holder's oldest past [`PER_CREDENTIAL`].
    pub fn open(&self, holder: Holder, now: OffsetDateTime) -> Opened {
        let t = new_token_with(PREFIX);
        let mut open = self.lock();
        open.retain(|_, e| e.expires() > now);
        let mut mine: Vec<(OffsetDateTime, String)> = open
            .iter()
            .filter(|(_, e)| e.holder == holder)
            .map(|(id, e)| (e.opened, id.clone()))
            .collect();
        mine.sort();
        for (_, id) in mine.iter().take((mine.len() + 1).saturating_sub(PER_CREDENTIAL)) {
            open.remove(id);
        }
        if open.len() >= MAX_SESSIONS {
            if let Some(oldest) = open
                .iter()
                .min_by_key(|(_, e)| e.opened)
                .map(|(id, _)| id.clone())
            {
                open.remove(&oldest);
            }
        }
        open.insert(
            t.id.clone(),
            Entry {
                secret_hash: t.secret_hash,
                holder,
                opened: now,
                used: now,
            },
        );
        Opened {
            csrf: self.csrf_of(&t.id),
            cookie: t.token,
        }
    }

    /// The live session `cookie` names, its idle time restarted; `None`
    /// for a malformed, unknown, wrong or expired one.
    pub fn find(&self, cookie: &str, now: OffsetDateTime) -> Option<Found> {
        let (id, secret) = split_token_with(PREFIX, cookie)?;
        let mut open = self.lock();
        let entry = open.get_mut(id)?;
        if !secret_matches(secret, &entry.secret_hash) {
            return None;
        }
        if entry.expires() <= now {
            open.remove(id);
            return None;
        }
        entry.used = now;
        Some(Found {
            id: id.to_string(),
            holder: entry.holder.clone(),
        })
    }

    /// Closes the session `cookie` names (sign-out).
    pub fn close(&self, cookie: &str) {
        if let Some((id, secret)) = split_token_with(PREFIX, cookie) {
            let mut open = self.lock();
            if open
                .get(id)
                .is_some_and(|e| secret_matches(secret, &e.secret_hash))
            {
                open.remove(id);
                drop(open);
                self.closings.send_modify(|n| *n += 1);
            }
        }
    }

    /// Changes each time a session is closed.
    pub fn closings(&self) -> tokio::sync::watch::Receiver<u64> {
        self.closings.subscribe()
    }

    /// The CSRF token of session `id`.
    pub fn csrf_of(&self, id: &str) -> String {
        hex::encode(hmac::sign(&self.csrf_key, id.as_bytes()).as_ref())
    }

    /// Whether `presented` is session `id`'s CSRF token (constant time).
    pub fn csrf_matches(&self, id: &str, presented: Option<&str>) -> bool {
        let Some(presented) = presented else {
            return false;
        };
        // Both hashed first: equal lengths, and nothing learned from timing.
        bool::from(hash_secret(presented).ct_eq(&hash_secret(&self.csrf_of(id))))
    }

    /// Sessions open now (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The console cookie's value among a request's `Cookie` headers.
pub fn cookie_value(headers: &HeaderMap) -> Option<&str> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(name, _)| *name == COOKIE)
        .map(|(_, value)| value.trim())
}

/// `Set-Cookie` for a session just opened.
pub fn set_cookie(value: &str) -> String {
    format!(
        "{COOKIE}={value}; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age={}",
        MAX_AGE.whole_seconds()
    )
}

/// `Set-Cookie` that removes the session cookie (sign-out).
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/; Secure; HttpOnly; SameSite=Strict; Max-Age=0")
}

/// Whether a request made with the cookie comes from this origin's own
/// pages, as far as the browser says: `Sec-Fetch-Site`, when sent, is
/// `same-origin`, and `Origin`, when sent, is `https://` + `Host`. A
/// cross-site form post fails here (and carries no cookie anyway, being
/// `SameSite=Strict`); the CSRF token is the check that does not depend on
/// the browser saying anything.
pub fn same_origin(headers: &HeaderMap) -> bool {
    let header = |name: &str| headers.get(name).map(|v| v.to_str().unwrap_or("\u{0}"));
    if header("sec-fetch-site").is_some_and(|site| site != "same-origin") {
        return false;
    }
    match header("origin") {
        None => true,
        Some(origin) => header("host").is_some_and(|host| origin == format!("https://{host}")),
    }
}

/// Whether a request made with the cookie that the browser does not hold
/// to the same origin — a WebSocket handshake: a page of any site may open
/// one to us, and the browser sends the cookie along — comes from the
/// console's own pages: `Origin` must be sent and be `https://` + `Host`
/// (every browser sends it on a WebSocket handshake), and `Sec-Fetch-Site`,
/// when sent, `same-origin`. `Err` says which origin it was.
pub fn own_origin(headers: &HeaderMap) -> Result<(), String> {
    let origin = headers
        .get("origin")
        .map(|v| v.to_str().unwrap_or("(not text)"))
        .ok_or_else(|| "none".to_string())?;
    let host = headers.get("host").and_then(|v| v.to_str().ok());
    let site_ok = headers
        .get("sec-fetch-site")
        .is_none_or(|v| v.as_bytes() == b"same-origin");
    match host {
        Some(host) if site_ok && origin == format!("https://{host}") => Ok(()),
        // Bounded: it goes into a log line and an answer.
        _ => Err(origin.chars().take(100).collect()),
    }
}

/// Whether a method changes something (and so needs the CSRF token).
pub fn is_write(method: &http::Method) -> bool {
    !matches!(
        *method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: i64) -> OffsetDateTime {
        OffsetDateTime::UNIX_EPOCH + Duration::seconds(1_700_000_000 + secs)
    }

    fn user(id: &str) -> Holder {
        Holder::User { token_id: id.into() }
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn an_opened_session_is_found_by_its_cookie_and_by_nothing_else() {
        let s = Sessions::default();
        let o = s.open(user("t1"), at(0));
        assert!(o.cookie.starts_with(PREFIX));
        let found = s.find(&o.cookie, at(1)).unwrap();
        assert_eq!(found.holder, user("t1"));
        let (id, secret) = split_token_with(PREFIX, &o.cookie).unwrap();
        let wrong = format!(
            "{PREFIX}{id}_{}",
            if secret.starts_with('0') { "1" } else { "0" }.repeat(64)
        );
        assert!(s.find(&wrong, at(1)).is_none(), "a wrong secret");
        assert!(s.find("otxs_garbage", at(1)).is_none(), "a malformed cookie");
        assert!(s.find("", at(1)).is_none());
    }

    #[test]
    fn a_session_ends_when_idle_or_too_old_and_use_keeps_it_alive_until_then() {
        let s = Sessions::default();
        let o = s.open(user("t1"), at(0));
        let idle = IDLE.whole_seconds();
        assert!(s.find(&o.cookie, at(idle - 1)).is_some(), "used just in time");
        assert!(
            s.find(&o.cookie, at(2 * idle - 2)).is_some(),
            "the use restarted the idle time"
        );
        assert!(s.find(&o.cookie, at(3 * idle)).is_none(), "idle too long");

        let o = s.open(user("t2"), at(0));
        let mut t = 0;
        while t + idle / 2 < MAX_AGE.whole_seconds() {
            t += idle / 2;
            assert!(s.find(&o.cookie, at(t)).is_some());
        }
        assert!(
            s.find(&o.cookie, at(MAX_AGE.whole_seconds())).is_none(),
            "past its maximum age"
        );
    }

    #[test]
    fn sign_out_closes_only_the_session_whose_whole_cookie_is_presented() {
        let s = Sessions::default();
        let a = s.open(user("t1"), at(0));
        let b = s.open(user("t1"), at(0));
        let (id, _) = split_token_with(PREFIX, &a.cookie).unwrap();
        s.close(&format!("{PREFIX}{id}_{}", "0".repeat(64)));
        assert!(
            s.find(&a.cookie, at(1)).is_some(),
            "a guessed secret closes nothing"
        );
        s.close(&a.cookie);
        assert!(s.find(&a.cookie, at(1)).is_none());
        assert!(s.find(&b.cookie, at(1)).is_some());
    }

    #[test]
    fn one_credential_holds_at_most_its_share_of_sessions_the_oldest_closing_first() {
        let s = Sessions::default();
        let first = s.open(user("t1"), at(0));
        let other = s.open(user("t2"), at(0));
        for i in 0..PER_CREDENTIAL {
            s.open(user("t1"), at(1 + i as i64));
        }
        assert!(
            s.find(&first.cookie, at(100)).is_none(),
            "the oldest of t1's was closed"
        );
        assert!(
            s.find(&other.cookie, at(100)).is_some(),
            "another credential's is kept"
        );
        assert_eq!(s.len(), PER_CREDENTIAL + 1);
    }

    #[test]
    fn the_csrf_token_is_the_sessions_own_and_anything_else_is_refused() {
        let s = Sessions::default();
        let a = s.open(user("t1"), at(0));
        let b = s.open(user("t1"), at(0));
        let ida = s.find(&a.cookie, at(1)).unwrap().id;
        assert!(s.csrf_matches(&ida, Some(&a.csrf)));
        assert!(!s.csrf_matches(&ida, Some(&b.csrf)), "another session's token");
        assert!(!s.csrf_matches(&ida, None), "no token");
        assert!(!s.csrf_matches(&ida, Some("")), "an empty token");
        // Another process (another key) mints other tokens.
        let other = Sessions::default();
        assert_ne!(other.csrf_of(&ida), a.csrf);
    }

    #[test]
    fn the_cookie_is_found_among_others_and_set_with_every_protection() {
        let h = headers(&[("cookie", "a=1; __Host-otx_console=otxs_x_y ; b=2")]);
        assert_eq!(cookie_value(&h), Some("otxs_x_y"));
        let h = headers(&[("cookie", "a=1"), ("cookie", "__Host-otx_console=v")]);
        assert_eq!(cookie_value(&h), Some("v"));
        assert_eq!(cookie_value(&headers(&[("cookie", "otx_console=v")])), None);
        let set = set_cookie("v");
        for attr in ["HttpOnly", "Secure", "SameSite=Strict", "Path=/"] {
            assert!(set.contains(attr), "{set} lacks {attr}");
        }
        assert!(!set.contains("Domain"), "a __Host- cookie has no Domain");
        assert!(clear_cookie().contains("Max-Age=0"));
    }

    #[test]
    fn cross_site_requests_are_told_apart_from_the_consoles_own() {
        let host = ("host", "10.0.0.1:7443");
        assert!(
            same_origin(&headers(&[host])),
            "no Origin: a same-origin GET or an old browser"
        );
        assert!(same_origin(&headers(&[
            host,
            ("origin", "https://10.0.0.1:7443"),
            ("sec-fetch-site", "same-origin")
        ])));
        assert!(!same_origin(&headers(&[
            host,
            ("origin", "https://evil.example")
        ])));
        assert!(
            !same_origin(&headers(&[host, ("origin", "http://10.0.0.1:7443")])),
            "another scheme"
        );
        assert!(!same_origin(&headers(&[host, ("origin", "null")])));
        assert!(!same_origin(&headers(&[host, ("sec-fetch-site", "cross-site")])));
        assert!(!same_origin(&headers(&[host, ("sec-fetch-site", "same-site")])));
        assert!(
            !same_origin(&headers(&[("origin", "https://10.0.0.1:7443")])),
            "no Host to compare"
        );
    }

    #[test]
    fn a_websocket_handshake_must_say_it_comes_from_the_consoles_own_origin() {
        let host = ("host", "10.0.0.1:7443");
        assert_eq!(
            own_origin(&headers(&[host, ("origin", "https://10.0.0.1:7443")])),
            Ok(())
        );
        assert_eq!(
            own_origin(&headers(&[
                host,
                ("origin", "https://10.0.0.1:7443"),
                ("sec-fetch-site", "same-origin")
            ])),
            Ok(())
        );
        assert_eq!(
            own_origin(&headers(&[host])),
            Err("none".into()),
            "no Origin: not a browser's page of ours"
        );
        for bad in [
            "https://evil.example",
            "http://10.0.0.1:7443",
            "https://10.0.0.1:7443.evil.example",
            "null",
        ] {
            assert_eq!(
                own_origin(&headers(&[host, ("origin", bad)])),
                Err(bad.into()),
                "{bad}"
            );
        }
        assert!(own_origin(&headers(&[
            host,
            ("origin", "https://10.0.0.1:7443"),
            ("sec-fetch-site", "same-site")
        ]))
        .is_err());
        assert!(
            own_origin(&headers(&[("origin", "https://10.0.0.1:7443")])).is_err(),
            "no Host to compare"
        );
    }

    #[test]
    fn the_pages_policy_adds_only_a_style_nonce() {
        let page = page_csp("n0nce");
        assert_eq!(
            page.replace(" 'nonce-n0nce'", ""),
            CSP,
            "the same policy otherwise"
        );
        assert!(page.contains("style-src 'self' 'nonce-n0nce';"), "{page}");
        assert!(
            page.contains("script-src 'self';"),
            "no nonce for scripts: {page}"
        );
        assert!(!page.contains("unsafe"), "{page}");
    }

    #[test]
    fn signing_out_is_told_to_those_who_watch() {
        let s = Sessions::default();
        let mut closings = s.closings();
        let a = s.open(user("t1"), at(0));
        s.close(&format!("{PREFIX}nosuch_{}", "0".repeat(64)));
        assert!(!closings.has_changed().unwrap(), "nothing was closed");
        s.close(&a.cookie);
        assert!(closings.has_changed().unwrap());
        closings.mark_unchanged();
    }

    #[test]
    fn the_content_security_policy_allows_no_inline_script_or_style_and_no_framing() {
        assert!(CSP.contains("script-src 'self'"));
        assert!(CSP.contains("style-src 'self'"));
        assert!(CSP.contains("frame-ancestors 'none'"));
        assert!(CSP.starts_with("default-src 'none'"));
        assert!(!CSP.contains("unsafe"), "{CSP}");
    }

    #[test]
    fn only_reads_go_without_the_csrf_token() {
        assert!(!is_write(&http::Method::GET));
        assert!(!is_write(&http::Method::HEAD));
        for m in [
            http::Method::POST,
            http::Method::PUT,
            http::Method::PATCH,
            http::Method::DELETE,
        ] {
            assert!(is_write(&m), "{m}");
        }
    }
}
