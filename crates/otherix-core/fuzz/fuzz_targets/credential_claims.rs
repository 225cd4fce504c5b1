//! Fuzzes what `verify` parses past the signature check: claims and footer
//! chosen by the fuzzer (well-formed fields with odd values, or raw bytes),
//! signed with a real key, verified at a fuzzer-chosen time. A stolen key or
//! a broken minting side is the threat here: whatever is signed, `verify`
//! must not panic, and what it accepts must keep every promise of DESIGN §5
//! (audience, issuer, a validity window no longer than the maximum, `now`
//! inside it), survive a re-mint unchanged, and be single-use in the replay
//! cache.
#![no_main]

use std::sync::OnceLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use otherix_core::credential::{
    paseto, verify, Expected, KeySet, Refusal, ReplayCache, SigningKey, CLOCK_SKEW, DEFAULT_MAX_LIFETIME,
};
use serde_json::{json, Map, Value};
use time::format_description::well_known::Rfc3339;
use time::{Duration, OffsetDateTime};

const KID: &str = "k1";
const SEED: [u8; 32] = [7; 32];
/// Times are offsets from here (2027-01-15), so small numbers mean "around now".
const BASE: i64 = 1_800_000_000;

struct Signer {
    /// The same key as `key`, to sign what `key.mint` would not.
    pair: ed25519_compact::KeyPair,
    key: SigningKey,
    keys: KeySet,
}

fn signer() -> &'static Signer {
    static SIGNER: OnceLock<Signer> = OnceLock::new();
    SIGNER.get_or_init(|| {
        let key = SigningKey::from_seed(KID, SEED).expect("non-zero seed");
        let pair = ed25519_compact::KeyPair::from_seed(ed25519_compact::Seed::new(SEED));
        let mut keys = KeySet::new();
        keys.insert(KID, &key.public_key()).expect("a valid public key");
        Signer { pair, key, keys }
    })
}

#[derive(Arbitrary, Debug)]
enum Time {
    /// Seconds from `BASE`.
    Near(i32),
    /// Any Unix time the `time` crate can hold, else `BASE`.
    Unix(i64),
    /// The edges of RFC 3339, where arithmetic on the parsed time overflows.
    Edge(u8),
    /// Any text, as the claim's string.
    Text(String),
}

const EDGES: &[&str] = &[
    "9999-12-31T23:59:59Z",
    "9999-12-31T23:59:59.999999999Z",
    "9999-12-31T23:59:59-23:59",
    "9999-12-31T23:50:00+23:59",
    "0000-01-01T00:00:00Z",
    "0000-01-01T00:00:00+23:59",
    "0000-01-01T00:00:00-23:59",
    "1970-01-01T00:00:00Z",
];

impl Time {
    fn value(&self) -> Value {
        match self {
            Time::Near(s) => Value::String(rfc3339(at(BASE + i64::from(*s)))),
            Time::Unix(s) => Value::String(rfc3339(at(*s))),
            Time::Edge(i) => Value::String(EDGES[usize::from(*i) % EDGES.len()].to_owned()),
            Time::Text(s) => Value::String(s.clone()),
        }
    }

    /// As `verify`'s `now`.
    fn instant(&self) -> OffsetDateTime {
        match self {
            Time::Near(s) => at(BASE + i64::from(*s)),
            Time::Unix(s) => at(*s),
            Time::Edge(i) => {
                OffsetDateTime::parse(EDGES[usize::from(*i) % EDGES.len()], &Rfc3339).unwrap_or(at(BASE))
            }
            Time::Text(s) => OffsetDateTime::parse(s, &Rfc3339).unwrap_or(at(BASE)),
        }
    }
}

fn at(unix: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp(unix).unwrap_or_else(|_| OffsetDateTime::from_unix_timestamp(BASE).unwrap())
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

#[derive(Arbitrary, Debug)]
enum Text {
    /// The value `verify` expects (the audience, the issuer).
    Expected,
    Any(String),
}

#[derive(Arbitrary, Debug)]
struct Fields {
    iss: Text,
    aud: Text,
    sub: String,
    jti: String,
    iat: Time,
    nbf: Time,
    exp: Time,
    vm: String,
    vm_id: String,
    net: String,
    mac: Option<String>,
    ip: String,
    port: u32,
    /// Drop one field (by index), to reach "missing field".
    drop: Option<u8>,
    /// An extra field (claims deny unknown fields), or a field set to a
    /// value of the wrong type.
    extra: Option<(String, Odd)>,
}

#[derive(Arbitrary, Debug)]
enum Odd {
    Null,
    Bool(bool),
    Number(i64),
    Float(f64),
    Text(String),
    List(Vec<u8>),
}

impl Odd {
    fn value(&self) -> Value {
        match self {
            Odd::Null => Value::Null,
            Odd::Bool(b) => json!(b),
            Odd::Number(n) => json!(n),
            Odd::Float(f) => json!(f),
            Odd::Text(s) => json!(s),
            Odd::List(v) => json!(v),
        }
    }
}

#[derive(Arbitrary, Debug)]
enum Payload {
    /// Claims as JSON, field by field.
    Fields(Fields),
    /// Any bytes as the signed message.
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum Footer {
    /// `{"kid":"k1"}`, the key that signs.
    Ours,
    /// Another kid, or `k1` with another field.
    Other { kid: Text, extra: Option<(String, Odd)> },
    Raw(Vec<u8>),
    None,
}

#[derive(Arbitrary, Debug)]
struct Input {
    payload: Payload,
    footer: Footer,
    now: Time,
    /// Whether the verifier demands the issuer.
    check_issuer: bool,
    /// Longest lifetime accepted, in seconds (0: the default).
    max_lifetime: u16,
}

const AUDIENCE: &str = "gw1";
const ISSUER: &str = "cluster1";

fn claims_json(f: &Fields) -> Vec<u8> {
    let text = |t: &Text, expected: &str| match t {
        Text::Expected => expected.to_owned(),
        Text::Any(s) => s.clone(),
    };
    let mut claims = Map::new();
    claims.insert("iss".into(), json!(text(&f.iss, ISSUER)));
    claims.insert("aud".into(), json!(text(&f.aud, AUDIENCE)));
    claims.insert("sub".into(), json!(f.sub));
    claims.insert("jti".into(), json!(f.jti));
    claims.insert("iat".into(), f.iat.value());
    claims.insert("nbf".into(), f.nbf.value());
    claims.insert("exp".into(), f.exp.value());
    claims.insert("vm".into(), json!(f.vm));
    claims.insert("vm_id".into(), json!(f.vm_id));
    claims.insert("net".into(), json!(f.net));
    if let Some(mac) = &f.mac {
        claims.insert("mac".into(), json!(mac));
    }
    claims.insert("ip".into(), json!(f.ip));
    claims.insert("port".into(), json!(f.port));
    if let Some(i) = f.drop {
        let names: Vec<String> = claims.keys().cloned().collect();
        claims.remove(&names[usize::from(i) % names.len()]);
    }
    if let Some((name, value)) = &f.extra {
        claims.insert(name.clone(), value.value());
    }
    serde_json::to_vec(&claims).expect("a JSON map serializes")
}

fuzz_target!(|input: Input| {
    let s = signer();
    let message = match &input.payload {
        Payload::Fields(f) => claims_json(f),
        Payload::Raw(bytes) => bytes.clone(),
    };
    let footer = match &input.footer {
        Footer::Ours => Some(format!("{{\"kid\":\"{KID}\"}}").into_bytes()),
        Footer::Other { kid, extra } => {
            let mut map = Map::new();
            map.insert(
                "kid".into(),
                json!(match kid {
                    Text::Expected => KID,
                    Text::Any(s) => s.as_str(),
                }),
            );
            if let Some((name, value)) = extra {
                map.insert(name.clone(), value.value());
            }
            Some(serde_json::to_vec(&map).expect("a JSON map serializes"))
        }
        Footer::Raw(bytes) => Some(bytes.clone()),
        Footer::None => None,
    };
    // An empty message cannot be signed (PASETO allows none).
    let Ok(token) = paseto::sign(&message, footer.as_deref().unwrap_or_default(), &[], |m| {
        Some(*s.pair.sk.sign(m, None))
    }) else {
        return;
    };
    let max_lifetime = match input.max_lifetime {
        0 => DEFAULT_MAX_LIFETIME,
        n => Duration::seconds(i64::from(n)),
    };
    let expected = Expected {
        audience: AUDIENCE,
        issuer: input.check_issuer.then_some(ISSUER),
        max_lifetime,
    };
    let now = input.now.instant();
    let claims = match verify(&token, &s.keys, &expected, now) {
        Ok(claims) => claims,
        Err(refusal) => {
            let _ = (refusal.code(), refusal.kind(), refusal.to_string());
            return;
        }
    };
    // Accepted: every promise holds.
    assert_eq!(claims.aud, AUDIENCE);
    if input.check_issuer {
        assert_eq!(claims.iss, ISSUER);
    }
    let start = claims.iat.min(claims.nbf);
    assert!(
        claims.exp - start <= max_lifetime,
        "accepted a credential valid from {start} to {} (max {max_lifetime})",
        claims.exp
    );
    assert!(now <= claims.exp.saturating_add(CLOCK_SKEW) && claims.nbf <= now.saturating_add(CLOCK_SKEW));
    // Re-minted by our own key it verifies to the same claims.
    let again = s.key.mint(&claims).expect("accepted claims can be minted");
    assert_eq!(verify(&again, &s.keys, &expected, now).as_ref(), Ok(&claims));
    // Single use.
    let mut cache = ReplayCache::new(4);
    cache.check_and_insert(&claims.jti, claims.exp, now).expect("first use");
    assert_eq!(
        cache.check_and_insert(&claims.jti, claims.exp, now),
        Err(Refusal::Replayed)
    );
});
