//! The access credential (DESIGN §5): a PASETO `v4.public` token (Ed25519)
//! bound to one gateway, one VM, its NIC's MAC and IP, and one port; minted
//! by the CP, verified offline by gateways. The token's framing is
//! [`paseto`]; AWS-LC signs and verifies.
//!
//! Pure: keys come from seeds the caller draws, `now` is an argument, the
//! replay cache is a plain data structure. Verification follows the order of
//! DESIGN §5 — signature, then what the verifier [`Expected`]: issuer,
//! audience, lifetime, time window — and each failure is its own
//! [`Refusal`] with a stable code and a [`Kind`] that says what sort of
//! refusal it is; each protocol (the gateway's, the relay's) maps kinds to
//! its own statuses.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use time::{Duration, OffsetDateTime};

pub mod paseto;

/// Default lifetime of a credential.
pub const DEFAULT_TTL: Duration = Duration::seconds(300);
/// Longest credential lifetime (`exp` less the earlier of `iat` and `nbf`)
/// a verifier accepts unless told otherwise: three times [`DEFAULT_TTL`], so
/// a CP may lengthen its TTL somewhat, while a credential minted to live
/// for hours (a stolen key, a broken minting side) is refused even inside
/// its time window.
pub const DEFAULT_MAX_LIFETIME: Duration = Duration::minutes(15);
/// Clock skew tolerated between the CP and a gateway.
pub const CLOCK_SKEW: Duration = Duration::seconds(30);
/// How long past its `exp` a used credential stays remembered where several
/// verifiers share the record (the relay's used tickets, across replicas
/// and restarts): a verifier accepts one until `exp` + [`CLOCK_SKEW`] by its
/// own clock, the replica that prunes may run up to [`CLOCK_SKEW`] ahead of
/// it, and a minute more for the hourly prune's own delay and the
/// unexpected. Forgotten any sooner, a ticket could be used again.
pub const USED_KEPT_PAST_EXP: Duration = Duration::seconds(2 * CLOCK_SKEW.whole_seconds() + 60);

/// A used credential whose `exp` is before this, at `now` by the pruning
/// replica's clock, can no longer pass any verifier's time check: its use
/// may be forgotten ([`USED_KEPT_PAST_EXP`]).
pub fn used_forgettable_before(now: OffsetDateTime) -> OffsetDateTime {
    now.saturating_sub(USED_KEPT_PAST_EXP)
}

/// Longest token accepted before any parsing (a credential is ~600 bytes).
pub const MAX_TOKEN_LEN: usize = 4096;

/// Credentials a verifier (a gateway, the relay) remembers as used, by
/// default. A credential lives 300 s plus skew, so this bounds sustained new
/// sessions to about capacity / 330 per second on that verifier.
pub const REPLAY_CAPACITY: usize = 100_000;

/// One principal's default share of a verifier's capacity (connection slots,
/// replay cache) is `capacity / SHARE_DIVISOR`: twenty principals at their
/// share are needed to fill it, where at half two were. A principal that
/// needs more should be split (several service identities) or given a
/// verifier of its own, not handed most of a shared one.
pub const SHARE_DIVISOR: usize = 20;

/// One principal's default share of `capacity` (at least 1).
pub fn default_share(capacity: usize) -> usize {
    (capacity / SHARE_DIVISOR).max(1)
}

/// Whether a configured per-principal `share` leaves room for others: at
/// most half of `capacity`, so no single principal can fill it.
pub fn share_fits(share: usize, capacity: usize) -> bool {
    share >= 1 && share.saturating_mul(2) <= capacity
}

/// The claims (DESIGN §5). Times are RFC 3339, as PASETO's registered claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Claims {
    /// Cluster id.
    pub iss: String,
    /// The one node (gateway) or service (`cp` for relay tickets) that may accept it.
    pub aud: String,
    /// Principal: `user:<name>` or `grant:<name>`.
    pub sub: String,
    /// The id of the API token a user brokered with (public, not the secret):
    /// revoking that token revokes its credentials and ends their sessions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tok: Option<String>,
    /// 128-bit random id, hex; single use.
    pub jti: String,
    #[serde(with = "time::serde::rfc3339")]
    pub iat: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub nbf: OffsetDateTime,
    #[serde(with = "time::serde::rfc3339")]
    pub exp: OffsetDateTime,
    pub vm: String,
    pub vm_id: String,
    /// Network name of the target NIC.
    pub net: String,
    /// The NIC's MAC; the gateway checks the neighbor table against it.
    /// Absent on relay tickets (the relay has no shared L2 with the guest).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    pub ip: String,
    pub port: u16,
    /// When every session opened with it must have ended: a grant's
    /// credential carries the grant's expiry, so that the expiry ends its
    /// sessions as a revocation does (reason `grant_expired`) rather than
    /// leaving them to `--max-session`. A user's credential carries none.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "time::serde::rfc3339::option"
    )]
    pub until: Option<OffsetDateTime>,
}

impl Claims {
    /// How long from `now` a session opened with these claims may go on
    /// before its access ends ([`Claims::until`]): `None` when nothing ends
    /// it but the verifier's own limits, zero when it has ended already.
    pub fn access_left(&self, now: OffsetDateTime) -> Option<std::time::Duration> {
        self.until
            .map(|until| std::time::Duration::try_from(until - now).unwrap_or_default())
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Footer {
    kid: String,
}

/// Why a credential is refused. Every variant is the presenter's fault
/// except `ReplayCacheFull` (ours, retryable).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    #[error("malformed credential: {0}")]
    Malformed(String),
    #[error("credential signed by unknown key {kid:?}")]
    UnknownKey { kid: String },
    /// The key that signed it was retired: it stopped signing longer ago
    /// than any credential it signed can live, so whatever it signs now was
    /// not minted by the control plane (a stolen retired key, or a minting
    /// side whose clock is wrong).
    #[error("credential signed by key {kid:?}, which expired at {not_after}")]
    KeyExpired { kid: String, not_after: String },
    #[error("credential signature is invalid (forged or tampered)")]
    BadSignature,
    #[error("credential was issued by cluster {iss:?}, not this one")]
    WrongIssuer { iss: String },
    #[error("credential is for gateway {aud:?}, not this one")]
    WrongAudience { aud: String },
    #[error("credential lives {lifetime_secs} s, longer than the {max_secs} s accepted here")]
    LifetimeTooLong { lifetime_secs: i64, max_secs: i64 },
    #[error("credential expired at {exp}")]
    Expired { exp: String },
    #[error("credential is not valid before {nbf}")]
    NotYetValid { nbf: String },
    #[error("credential was already used")]
    Replayed,
    #[error("too many live credentials to track; retry shortly")]
    ReplayCacheFull,
    /// The credential's principal has used its share of the replay cache
    /// (credentials used here and not yet expired); others still get theirs.
    #[error("this principal has {limit} used credentials here that have not expired yet, its most; retry in a few minutes")]
    ReplayShareFull { limit: usize },
    /// An admin took the access away (grant or token revoked, user deleted,
    /// access rule removed) after the credential was issued.
    #[error("access was revoked after this credential was issued")]
    Revoked,
    /// The grant it was brokered for has expired ([`Claims::until`]); no
    /// clock skew allowance: the access ends when the grant says.
    #[error("the grant this credential was brokered for expired at {until}")]
    GrantExpired { until: String },
}

impl Refusal {
    /// Stable code for logs and metrics labels.
    pub fn code(&self) -> &'static str {
        match self {
            Refusal::Malformed(_) => "malformed",
            Refusal::UnknownKey { .. } => "unknown_key",
            Refusal::KeyExpired { .. } => "key_expired",
            Refusal::BadSignature => "bad_signature",
            Refusal::WrongIssuer { .. } => "wrong_issuer",
            Refusal::WrongAudience { .. } => "wrong_audience",
            Refusal::LifetimeTooLong { .. } => "lifetime_too_long",
            Refusal::Expired { .. } => "expired",
            Refusal::NotYetValid { .. } => "not_yet_valid",
            Refusal::Replayed => "replayed",
            Refusal::ReplayCacheFull => "replay_cache_full",
            Refusal::ReplayShareFull { .. } => "principal_replay_share",
            Refusal::Revoked => "revoked",
            Refusal::GrantExpired { .. } => "grant_expired",
        }
    }

    /// What sort of refusal it is.
    pub fn kind(&self) -> Kind {
        match self {
            Refusal::Malformed(_)
            | Refusal::UnknownKey { .. }
            | Refusal::KeyExpired { .. }
            | Refusal::BadSignature
            | Refusal::LifetimeTooLong { .. }
            | Refusal::Expired { .. }
            | Refusal::NotYetValid { .. } => Kind::Invalid,
            Refusal::WrongIssuer { .. }
            | Refusal::WrongAudience { .. }
            | Refusal::Revoked
            | Refusal::GrantExpired { .. } => Kind::NotHere,
            Refusal::Replayed => Kind::Reused,
            Refusal::ReplayCacheFull => Kind::Overloaded,
            Refusal::ReplayShareFull { .. } => Kind::PrincipalShare,
        }
    }
}

/// What sort of refusal a [`Refusal`] is, and so who must act: the
/// presenter (a new credential), an admin (access), or nobody (wait).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// It proves nothing: malformed, unknown key, bad signature, outside its
    /// time window, or longer-lived than accepted. The presenter's fault.
    Invalid,
    /// It is genuine but not for here, or no longer: another cluster,
    /// another audience, revoked. Brokering again may give one that is.
    NotHere,
    /// It was used before.
    Reused,
    /// Its principal used its share of this verifier; others are unaffected.
    PrincipalShare,
    /// The verifier is out of room: nobody's fault, retry shortly.
    Overloaded,
}

/// Errors of the minting side (the caller's fault).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    #[error("invalid key material: {0}")]
    Invalid(&'static str),
    #[error("cannot sign: {0}")]
    Sign(String),
}

/// An Ed25519 session signing key with its id.
pub struct SigningKey {
    kid: String,
    /// AWS-LC's key pair (why AWS-LC: the workspace's manifest).
    pair: aws_lc_rs::signature::Ed25519KeyPair,
    public: [u8; 32],
    /// `{"kid":...}`, the footer of every token it signs: serialized once.
    footer: Vec<u8>,
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningKey")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

impl SigningKey {
    /// Derives the key from a 32-byte random seed drawn by the caller.
    pub fn from_seed(kid: impl Into<String>, seed: [u8; 32]) -> Result<SigningKey, KeyError> {
        if seed == [0u8; 32] {
            return Err(KeyError::Invalid("all-zero seed"));
        }
        use aws_lc_rs::signature::KeyPair as _;
        let pair = aws_lc_rs::signature::Ed25519KeyPair::from_seed_unchecked(&seed)
            .map_err(|_| KeyError::Invalid("not an Ed25519 seed"))?;
        let public = pair
            .public_key()
            .as_ref()
            .try_into()
            .map_err(|_| KeyError::Invalid("its public key is not 32 bytes"))?;
        let kid = kid.into();
        let footer =
            serde_json::to_vec(&Footer { kid: kid.clone() }).map_err(|e| KeyError::Sign(e.to_string()))?;
        Ok(SigningKey {
            kid,
            pair,
            public,
            footer,
        })
    }

    pub fn kid(&self) -> &str {
        &self.kid
    }

    /// The public half, as gateways learn it.
    pub fn public_key(&self) -> [u8; 32] {
        self.public
    }

    /// Signs `claims` into a `v4.public` token with footer `{"kid":...}`.
    pub fn mint(&self, claims: &Claims) -> Result<String, KeyError> {
        let message = serde_json::to_vec(claims).map_err(|e| KeyError::Sign(e.to_string()))?;
        // Deterministic (no noise): RFC 8032's signature, as pasetors made.
        paseto::sign(&message, &self.footer, &[], |pae| {
            self.pair.try_sign(pae).ok()?.as_ref().try_into().ok()
        })
        .map_err(|e| KeyError::Sign(e.to_string()))
    }
}

/// Public keys a verifier trusts, by key id, each until its expiry if it
/// has one.
#[derive(Default)]
pub struct KeySet {
    keys: BTreeMap<String, Trusted>,
}

/// One trusted key.
struct Trusted {
    /// The raw Ed25519 public key.
    key: [u8; 32],
    /// After this instant no credential it signed can be valid (it stopped
    /// signing, then every credential's life and the clock skew passed):
    /// it is refused from then on, even by a verifier that has not heard
    /// from the control plane since. `None`: it still signs.
    not_after: Option<OffsetDateTime>,
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.keys.keys()).finish()
    }
}

impl KeySet {
    pub fn new() -> KeySet {
        KeySet::default()
    }

    /// Trusts `public` as key `kid`, with no expiry.
    pub fn insert(&mut self, kid: impl Into<String>, public: &[u8]) -> Result<(), KeyError> {
        self.insert_until(kid, public, None)
    }

    /// Trusts `public` as key `kid` until `not_after` (see [`KeySet`]).
    pub fn insert_until(
        &mut self,
        kid: impl Into<String>,
        public: &[u8],
        not_after: Option<OffsetDateTime>,
    ) -> Result<(), KeyError> {
        let key = public
            .try_into()
            .map_err(|_| KeyError::Invalid("ed25519 public key"))?;
        self.keys.insert(kid.into(), Trusted { key, not_after });
        Ok(())
    }

    /// Key `kid`'s expiry: `None` if it has none or is not trusted.
    pub fn not_after(&self, kid: &str) -> Option<OffsetDateTime> {
        self.keys.get(kid).and_then(|t| t.not_after)
    }

    pub fn kids(&self) -> impl Iterator<Item = &str> {
        self.keys.keys().map(String::as_str)
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

/// What a verifier demands of a validly signed credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expected<'a> {
    /// Who verifies: a gateway's node name, or the relay's audience.
    pub audience: &'a str,
    /// The cluster id the credential must carry as `iss`; `None`: not
    /// checked (a gateway that has not learnt it yet).
    pub issuer: Option<&'a str>,
    /// Longest lifetime accepted: `exp` less the earlier of `iat` and `nbf`.
    pub max_lifetime: Duration,
}

impl<'a> Expected<'a> {
    /// Credentials for `audience` from any issuer, living at most
    /// [`DEFAULT_MAX_LIFETIME`].
    pub fn new(audience: &'a str) -> Expected<'a> {
        Expected {
            audience,
            issuer: None,
            max_lifetime: DEFAULT_MAX_LIFETIME,
        }
    }
}

/// Verifies that `audience` was issued `token` by this cluster: the
/// signature, then the issuer and the audience — not whether it is still
/// good to use. The control plane checks so a gateway's report of a
/// session it opened with the credential (possibly long after it expired).
pub fn verify_issued(
    token: &str,
    keys: &KeySet,
    issuer: Option<&str>,
    audience: &str,
) -> Result<Claims, Refusal> {
    let claims = signed(token, keys, None)?;
    if let Some(issuer) = issuer {
        if claims.iss != issuer {
            return Err(Refusal::WrongIssuer { iss: claims.iss });
        }
    }
    if claims.aud != audience {
        return Err(Refusal::WrongAudience { aud: claims.aud });
    }
    Ok(claims)
}

/// The claims of a token one of `keys` signed; with `now`, refused if the
/// key had retired by then.
fn signed(token: &str, keys: &KeySet, now: Option<OffsetDateTime>) -> Result<Claims, Refusal> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(Refusal::Malformed(format!("longer than {MAX_TOKEN_LEN} bytes")));
    }
    let untrusted = paseto::parse(token).map_err(|e| Refusal::Malformed(e.to_string()))?;
    let footer: Footer = serde_json::from_slice(untrusted.footer())
        .map_err(|_| Refusal::Malformed("footer lacks a key id".into()))?;
    let key = keys.keys.get(&footer.kid).ok_or_else(|| Refusal::UnknownKey {
        kid: footer.kid.chars().take(64).collect(),
    })?;
    // Before the signature: nothing a retired key signs is worth checking
    // (the expiry already holds the clock skew).
    if let Some(not_after) = key.not_after.filter(|t| now.is_some_and(|now| now > *t)) {
        return Err(Refusal::KeyExpired {
            kid: footer.kid.chars().take(64).collect(),
            not_after: rfc3339(not_after),
        });
    }
    let message = untrusted
        .verify(&key.key, &[])
        .map_err(|_| Refusal::BadSignature)?;
    // Signed by us, so well-formed unless our own minting is broken.
    serde_json::from_slice(&message).map_err(|e| Refusal::Malformed(format!("claims: {e}")))
}

/// Verifies the signature, then the issuer, audience, lifetime and time
/// window `expected` asks for, in that order (DESIGN §5). Replay and target
/// checks come after, by the caller.
pub fn verify(
    token: &str,
    keys: &KeySet,
    expected: &Expected<'_>,
    now: OffsetDateTime,
) -> Result<Claims, Refusal> {
    let claims = signed(token, keys, Some(now))?;
    if let Some(issuer) = expected.issuer {
        if claims.iss != issuer {
            return Err(Refusal::WrongIssuer { iss: claims.iss });
        }
    }
    if claims.aud != expected.audience {
        return Err(Refusal::WrongAudience { aud: claims.aud });
    }
    // The credential is good from its earlier start (`iat` or `nbf`) to
    // `exp`; that whole window must fit, or an `iat` just before `exp`
    // would hide an `nbf` years earlier.
    let lifetime = claims.exp - claims.iat.min(claims.nbf);
    if lifetime > expected.max_lifetime {
        return Err(Refusal::LifetimeTooLong {
            lifetime_secs: lifetime.whole_seconds(),
            max_secs: expected.max_lifetime.whole_seconds(),
        });
    }
    // Saturating: a signed `exp` (or a `now`) at the end of the calendar
    // must be refused or accepted, not overflow.
    if now > claims.exp.saturating_add(CLOCK_SKEW) {
        return Err(Refusal::Expired {
            exp: rfc3339(claims.exp),
        });
    }
    if now.saturating_add(CLOCK_SKEW) < claims.nbf {
        return Err(Refusal::NotYetValid {
            nbf: rfc3339(claims.nbf),
        });
    }
    // Within its window, but the grant behind it has ended: a session
    // opened now would have to end at once.
    if let Some(until) = claims.until.filter(|until| now >= *until) {
        return Err(Refusal::GrantExpired {
            until: rfc3339(until),
        });
    }
    Ok(claims)
}

fn rfc3339(t: OffsetDateTime) -> String {
    t.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| t.to_string())
}

/// Remembers used `jti`s until their credential expires (plus skew), so
/// each credential connects once. Bounded: when full it refuses (fails
/// closed) rather than forgetting. Entries may name their principal
/// ([`ReplayCache::check_and_insert_owned`]), so that one principal cannot
/// take more than its share and leave the rest of the cache to nobody.
#[derive(Debug)]
pub struct ReplayCache {
    seen: HashMap<String, (OffsetDateTime, Option<Arc<str>>)>,
    by_expiry: BinaryHeap<Reverse<(OffsetDateTime, String)>>,
    /// Live entries per principal.
    owners: HashMap<Arc<str>, usize>,
    capacity: usize,
}

impl ReplayCache {
    pub fn new(capacity: usize) -> ReplayCache {
        ReplayCache {
            seen: HashMap::new(),
            by_expiry: BinaryHeap::new(),
            owners: HashMap::new(),
            capacity,
        }
    }

    /// Records `jti` as used; refuses if it was used before.
    pub fn check_and_insert(
        &mut self,
        jti: &str,
        exp: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<(), Refusal> {
        self.insert(jti, None, exp, now)
    }

    /// Records `jti` as used by `owner`; refuses if it was used before, or
    /// if `owner` already has `share` live entries.
    pub fn check_and_insert_owned(
        &mut self,
        jti: &str,
        owner: &str,
        share: usize,
        exp: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<(), Refusal> {
        self.insert(jti, Some((owner, share)), exp, now)
    }

    fn insert(
        &mut self,
        jti: &str,
        owner: Option<(&str, usize)>,
        exp: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<(), Refusal> {
        self.evict(now);
        if self.seen.contains_key(jti) {
            return Err(Refusal::Replayed);
        }
        if self.seen.len() >= self.capacity {
            return Err(Refusal::ReplayCacheFull);
        }
        let owner = match owner {
            Some((name, share)) => {
                let (key, count) = match self.owners.get_key_value(name) {
                    Some((k, n)) => (k.clone(), *n),
                    None => (Arc::<str>::from(name), 0),
                };
                if count >= share {
                    return Err(Refusal::ReplayShareFull { limit: share });
                }
                self.owners.insert(key.clone(), count + 1);
                Some(key)
            }
            None => None,
        };
        let forget_at = exp.saturating_add(CLOCK_SKEW);
        self.seen.insert(jti.to_string(), (forget_at, owner));
        self.by_expiry.push(Reverse((forget_at, jti.to_string())));
        Ok(())
    }

    /// Forgets entries whose credential can no longer pass the time check.
    pub fn evict(&mut self, now: OffsetDateTime) {
        while let Some(Reverse((at, _))) = self.by_expiry.peek() {
            if *at >= now {
                break;
            }
            let Some(Reverse((_, jti))) = self.by_expiry.pop() else {
                break;
            };
            if let Some((_, Some(owner))) = self.seen.remove(&jti) {
                if let Some(n) = self.owners.get_mut(&owner) {
                    *n -= 1;
                    if *n == 0 {
                        self.owners.remove(&owner);
                    }
                }
            }
        }
    }

    /// Live entries `owner` holds.
    pub fn owned_by(&self, owner: &str) -> usize {
        self.owners.get(owner).copied().unwrap_or(0)
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn claims(aud: &str) -> Claims {
        Claims {
            iss: "cluster1".into(),
            aud: aud.into(),
            sub: "user:alice".into(),
            tok: None,
            jti: "00112233445566778899aabbccddeeff".into(),
            iat: now(),
            nbf: now(),
            exp: now() + DEFAULT_TTL,
            vm: "web01".into(),
            vm_id: "vmid".into(),
            net: "ov".into(),
            mac: Some("02:00:00:00:00:01".into()),
            ip: "10.100.0.2".into(),
            port: 22,
            until: None,
        }
    }

    fn key(kid: &str, b: u8) -> SigningKey {
        SigningKey::from_seed(kid, [b; 32]).unwrap()
    }

    fn keyset(keys: &[&SigningKey]) -> KeySet {
        let mut ks = KeySet::new();
        for k in keys {
            ks.insert(k.kid(), &k.public_key()).unwrap();
        }
        ks
    }

    #[test]
    fn issued_is_checked_without_the_time_and_with_the_key_audience_and_issuer() {
        let k = key("k1", 7);
        let token = k.mint(&claims("gw1")).unwrap();
        let mut ks = keyset(&[&k]);
        // Long after it expired, and its key retired: still issued to gw1.
        ks.insert_until(k.kid(), &k.public_key(), Some(now())).unwrap();
        let late = verify_issued(&token, &ks, Some("cluster1"), "gw1").unwrap();
        assert_eq!(late.jti, claims("gw1").jti);
        assert!(verify(&token, &ks, &Expected::new("gw1"), now() + Duration::days(1)).is_err());
        assert_eq!(
            verify_issued(&token, &ks, Some("cluster1"), "gw2")
                .unwrap_err()
                .code(),
            "wrong_audience"
        );
        assert_eq!(
            verify_issued(&token, &ks, Some("other"), "gw1")
                .unwrap_err()
                .code(),
            "wrong_issuer"
        );
        let other = key("k2", 9);
        let forged = other.mint(&claims("gw1")).unwrap();
        assert_eq!(
            verify_issued(&forged, &ks, None, "gw1").unwrap_err().code(),
            "unknown_key"
        );
        assert_eq!(
            verify_issued("v4.public.xx", &ks, None, "gw1")
                .unwrap_err()
                .code(),
            "malformed"
        );
    }

    #[test]
    fn minted_credential_verifies_with_every_claim_intact() {
        let k = key("k1", 7);
        let token = k.mint(&claims("gw1")).unwrap();
        assert!(token.starts_with("v4.public."));
        assert_eq!(
            verify(&token, &keyset(&[&k]), &Expected::new("gw1"), now()).unwrap(),
            claims("gw1")
        );
    }

    #[test]
    fn tampered_payload_is_refused_as_bad_signature() {
        let k = key("k1", 7);
        let token = k.mint(&claims("gw1")).unwrap();
        // Re-sign other claims with another key and graft the footer: the
        // signature no longer matches what the kid's key signed.
        let mut other = claims("gw1");
        other.ip = "10.100.0.99".into();
        let forged = key("k1", 8).mint(&other).unwrap();
        assert_eq!(
            verify(&forged, &keyset(&[&k]), &Expected::new("gw1"), now()),
            Err(Refusal::BadSignature)
        );
        // Flip one character inside the body.
        let body_start = "v4.public.".len() + 10;
        let mut bytes = token.into_bytes();
        bytes[body_start] = if bytes[body_start] == b'A' { b'B' } else { b'A' };
        let flipped = String::from_utf8(bytes).unwrap();
        assert_eq!(
            verify(&flipped, &keyset(&[&k]), &Expected::new("gw1"), now()),
            Err(Refusal::BadSignature)
        );
    }

    #[test]
    fn unknown_kid_wrong_audience_and_time_window_are_distinct_refusals() {
        let k = key("k1", 7);
        let token = k.mint(&claims("gw1")).unwrap();
        assert_eq!(
            verify(&token, &keyset(&[&key("k2", 9)]), &Expected::new("gw1"), now()),
            Err(Refusal::UnknownKey { kid: "k1".into() })
        );
        assert_eq!(
            verify(&token, &keyset(&[&k]), &Expected::new("gw2"), now()),
            Err(Refusal::WrongAudience { aud: "gw1".into() })
        );
        let late = now() + DEFAULT_TTL + CLOCK_SKEW + Duration::seconds(1);
        assert!(matches!(
            verify(&token, &keyset(&[&k]), &Expected::new("gw1"), late),
            Err(Refusal::Expired { .. })
        ));
        assert!(
            verify(
                &token,
                &keyset(&[&k]),
                &Expected::new("gw1"),
                now() + DEFAULT_TTL + CLOCK_SKEW
            )
            .is_ok(),
            "skew tolerated"
        );
        let early = now() - CLOCK_SKEW - Duration::seconds(1);
        assert!(matches!(
            verify(&token, &keyset(&[&k]), &Expected::new("gw1"), early),
            Err(Refusal::NotYetValid { .. })
        ));
    }

    #[test]
    fn a_grant_credential_ends_its_access_at_the_grants_expiry_without_skew() {
        let k = key("k1", 7);
        let mut c = claims("gw1");
        // A grant ending in 60 s cut the credential short to it.
        let until = now() + Duration::seconds(60);
        c.exp = until;
        c.until = Some(until);
        let token = k.mint(&c).unwrap();
        let verified = verify(&token, &keyset(&[&k]), &Expected::new("gw1"), now()).unwrap();
        assert_eq!(verified.until, Some(until), "the claim survives signing");
        assert_eq!(
            verified.access_left(now()),
            Some(std::time::Duration::from_secs(60))
        );
        assert_eq!(
            verified.access_left(until + Duration::seconds(5)),
            Some(std::time::Duration::ZERO)
        );
        // Within the skew allowance past `exp` the credential would still
        // verify, but the grant has ended: refused, with a reason of its own.
        let refusal = verify(&token, &keyset(&[&k]), &Expected::new("gw1"), until).unwrap_err();
        assert!(matches!(refusal, Refusal::GrantExpired { .. }), "{refusal:?}");
        assert_eq!((refusal.code(), refusal.kind()), ("grant_expired", Kind::NotHere));
        // A user's credential carries no end: nothing but the verifier's
        // limits ends its session.
        assert_eq!(claims("gw1").access_left(now()), None);
        let json = serde_json::to_string(&claims("gw1")).unwrap();
        assert!(!json.contains("until"), "{json}");
    }

    #[test]
    fn a_used_credential_is_forgotten_only_once_no_verifier_can_accept_it() {
        let k = key("k1", 7);
        let c = claims("gw1");
        let token = k.mint(&c).unwrap();
        // The last instant a verifier accepts it, by its clock...
        let last = c.exp + CLOCK_SKEW;
        assert!(verify(&token, &keyset(&[&k]), &Expected::new("gw1"), last).is_ok());
        // ...seen by a pruning replica whose clock runs the allowed skew
        // ahead: its use is still kept.
        assert!(used_forgettable_before(last + CLOCK_SKEW) <= c.exp);
        assert!(used_forgettable_before(last + CLOCK_SKEW + Duration::seconds(59)) <= c.exp);
        // Once no clock within the skew can accept it, it may go.
        let gone = c.exp + USED_KEPT_PAST_EXP + Duration::seconds(1);
        assert!(used_forgettable_before(gone) > c.exp);
        assert!(matches!(
            verify(&token, &keyset(&[&k]), &Expected::new("gw1"), gone - CLOCK_SKEW),
            Err(Refusal::Expired { .. })
        ));
    }

    #[test]
    fn credential_from_another_cluster_is_refused() {
        let k = key("k1", 7);
        let ours = Expected {
            issuer: Some("cluster1"),
            ..Expected::new("gw1")
        };
        let mut theirs = claims("gw1");
        theirs.iss = "cluster2".into();
        let refusal = verify(&k.mint(&theirs).unwrap(), &keyset(&[&k]), &ours, now()).unwrap_err();
        assert_eq!(
            refusal,
            Refusal::WrongIssuer {
                iss: "cluster2".into()
            }
        );
        assert_eq!((refusal.code(), refusal.kind()), ("wrong_issuer", Kind::NotHere));
        assert_eq!(
            refusal.to_string(),
            "credential was issued by cluster \"cluster2\", not this one"
        );
        let token = k.mint(&claims("gw1")).unwrap();
        assert!(verify(&token, &keyset(&[&k]), &ours, now()).is_ok());
        assert!(
            verify(
                &k.mint(&theirs).unwrap(),
                &keyset(&[&k]),
                &Expected::new("gw1"),
                now()
            )
            .is_ok(),
            "no issuer expected: not checked"
        );
    }

    #[test]
    fn credential_living_longer_than_the_maximum_is_refused() {
        let k = key("k1", 7);
        let mut c = claims("gw1");
        c.exp = c.iat + Duration::hours(2);
        let token = k.mint(&c).unwrap();
        // Inside its time window: only the lifetime is wrong.
        let refusal = verify(&token, &keyset(&[&k]), &Expected::new("gw1"), now()).unwrap_err();
        assert_eq!(
            refusal,
            Refusal::LifetimeTooLong {
                lifetime_secs: 7200,
                max_secs: 900
            }
        );
        assert_eq!(
            (refusal.code(), refusal.kind()),
            ("lifetime_too_long", Kind::Invalid)
        );
        assert_eq!(
            refusal.to_string(),
            "credential lives 7200 s, longer than the 900 s accepted here"
        );
        let exactly = Expected {
            max_lifetime: Duration::hours(2),
            ..Expected::new("gw1")
        };
        assert!(
            verify(&token, &keyset(&[&k]), &exactly, now()).is_ok(),
            "the maximum itself is allowed"
        );
    }

    #[test]
    fn credential_valid_long_before_its_iat_is_refused_as_too_long() {
        // Found by fuzzing (credential_claims): `iat` just before `exp` hid an
        // `nbf` decades earlier, so a signed credential lived for decades.
        let k = key("k1", 7);
        let mut c = claims("gw1");
        c.nbf = OffsetDateTime::UNIX_EPOCH;
        c.iat = c.exp - Duration::seconds(1);
        let token = k.mint(&c).unwrap();
        let refusal = verify(&token, &keyset(&[&k]), &Expected::new("gw1"), now()).unwrap_err();
        assert_eq!(refusal.code(), "lifetime_too_long", "{refusal}");
        // An `iat` after `exp` is no way around it either.
        c.iat = c.exp + Duration::days(365);
        let token = k.mint(&c).unwrap();
        let refusal = verify(&token, &keyset(&[&k]), &Expected::new("gw1"), now()).unwrap_err();
        assert_eq!(refusal.code(), "lifetime_too_long", "{refusal}");
    }

    #[test]
    fn times_at_the_end_of_the_calendar_are_refused_never_a_panic() {
        // Found by fuzzing (credential_claims): `exp + CLOCK_SKEW` overflowed
        // for an `exp` at the end of year 9999, and panicked.
        let k = key("k1", 7);
        let end = time::macros::datetime!(9999-12-31 23:59:59 UTC);
        let mut c = claims("gw1");
        (c.iat, c.nbf, c.exp) = (end, end, end);
        let token = k.mint(&c).unwrap();
        assert!(matches!(
            verify(&token, &keyset(&[&k]), &Expected::new("gw1"), now()),
            Err(Refusal::NotYetValid { .. })
        ));
        // And a verifier whose clock reads the end of time.
        assert!(verify(&token, &keyset(&[&k]), &Expected::new("gw1"), end).is_ok());
        let mut cache = ReplayCache::new(2);
        cache.check_and_insert(&c.jti, c.exp, end).unwrap();
        assert_eq!(cache.check_and_insert(&c.jti, c.exp, end), Err(Refusal::Replayed));
    }

    #[test]
    fn garbage_is_malformed_never_a_panic() {
        let ks = keyset(&[&key("k1", 7)]);
        for bad in [
            "",
            "v4.public.",
            "v4.local.abc",
            "v2.public.xx",
            "v4.public.!!!!",
            &"a".repeat(5000),
        ] {
            assert!(
                matches!(
                    verify(bad, &ks, &Expected::new("gw1"), now()),
                    Err(Refusal::Malformed(_))
                ),
                "{bad:.20}"
            );
        }
    }

    #[test]
    fn replayed_credential_is_refused_until_it_expires_then_forgotten() {
        let mut cache = ReplayCache::new(10);
        let exp = now() + DEFAULT_TTL;
        cache.check_and_insert("j1", exp, now()).unwrap();
        assert_eq!(cache.check_and_insert("j1", exp, now()), Err(Refusal::Replayed));
        cache.check_and_insert("j2", exp, now()).unwrap();
        let after = exp + CLOCK_SKEW + Duration::seconds(1);
        cache.evict(after);
        assert!(cache.is_empty(), "entries leave once their credential is dead");
    }

    #[test]
    fn a_full_replay_cache_fails_closed() {
        let mut cache = ReplayCache::new(2);
        let exp = now() + DEFAULT_TTL;
        cache.check_and_insert("a", exp, now()).unwrap();
        cache.check_and_insert("b", exp, now()).unwrap();
        assert_eq!(
            cache.check_and_insert("c", exp, now()),
            Err(Refusal::ReplayCacheFull)
        );
        assert_eq!(cache.check_and_insert("a", exp, now()), Err(Refusal::Replayed));
    }

    #[test]
    fn one_principal_gets_its_share_of_the_replay_cache_and_no_more() {
        let mut cache = ReplayCache::new(10);
        let exp = now() + DEFAULT_TTL;
        for j in ["a1", "a2", "a3"] {
            cache
                .check_and_insert_owned(j, "grant:flood", 3, exp, now())
                .unwrap();
        }
        assert_eq!(
            cache.check_and_insert_owned("a4", "grant:flood", 3, exp, now()),
            Err(Refusal::ReplayShareFull { limit: 3 })
        );
        assert_eq!(cache.owned_by("grant:flood"), 3);
        // Others still get theirs, and a replay is a replay whoever sends it.
        cache
            .check_and_insert_owned("b1", "user:alice", 3, exp, now())
            .unwrap();
        assert_eq!(
            cache.check_and_insert_owned("a1", "user:alice", 3, exp, now()),
            Err(Refusal::Replayed)
        );
        // The share frees as its credentials expire.
        let later_exp = exp + Duration::minutes(1);
        cache.evict(exp + CLOCK_SKEW + Duration::seconds(1));
        assert_eq!(cache.owned_by("grant:flood"), 0);
        cache
            .check_and_insert_owned("a4", "grant:flood", 3, later_exp, now())
            .unwrap();
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn default_shares_are_a_twentieth_and_configured_ones_at_most_half() {
        assert_eq!(default_share(REPLAY_CAPACITY), 5_000);
        assert_eq!(default_share(10_000), 500);
        assert_eq!(default_share(3), 1);
        assert!(share_fits(default_share(REPLAY_CAPACITY), REPLAY_CAPACITY));
        assert!(share_fits(50_000, 100_000));
        assert!(!share_fits(50_001, 100_000));
        assert!(!share_fits(0, 100_000));
        assert!(!share_fits(usize::MAX, 100_000));
    }

    #[test]
    fn a_principal_filling_its_default_share_leaves_the_cache_to_the_others() {
        let mut cache = ReplayCache::new(REPLAY_CAPACITY);
        let share = default_share(REPLAY_CAPACITY);
        let exp = now() + DEFAULT_TTL;
        for i in 0..share {
            cache
                .check_and_insert_owned(&format!("f{i}"), "grant:flood", share, exp, now())
                .unwrap();
        }
        assert_eq!(
            cache.check_and_insert_owned("f-more", "grant:flood", share, exp, now()),
            Err(Refusal::ReplayShareFull { limit: share })
        );
        assert_eq!(
            Refusal::ReplayShareFull { limit: share }.code(),
            "principal_replay_share"
        );
        // The flood took a twentieth: everyone else still gets in.
        assert_eq!(cache.len(), REPLAY_CAPACITY / 20);
        cache
            .check_and_insert_owned("b1", "user:bob", share, exp, now())
            .unwrap();
    }

    #[test]
    fn a_key_is_trusted_until_its_expiry_and_refused_after_it() {
        let k = key("k1", 7);
        let token = k.mint(&claims("gw1")).unwrap();
        let mut ks = KeySet::new();
        let not_after = now() + Duration::seconds(10);
        ks.insert_until(k.kid(), &k.public_key(), Some(not_after))
            .unwrap();
        assert_eq!(ks.not_after("k1"), Some(not_after));
        assert!(verify(&token, &ks, &Expected::new("gw1"), now()).is_ok());
        assert!(
            verify(&token, &ks, &Expected::new("gw1"), not_after).is_ok(),
            "up to its expiry inclusive"
        );
        let refusal = verify(
            &token,
            &ks,
            &Expected::new("gw1"),
            not_after + Duration::milliseconds(1),
        )
        .unwrap_err();
        assert_eq!(refusal.code(), "key_expired");
        assert_eq!(refusal.kind(), Kind::Invalid);
        assert!(refusal.to_string().contains("\"k1\""), "{refusal}");
        // Even for a credential that is itself in its time window: a retired
        // key whose seed leaked mints fresh ones.
        let mut fresh = claims("gw1");
        let late = not_after + Duration::minutes(1);
        (fresh.iat, fresh.nbf, fresh.exp) = (late, late, late + DEFAULT_TTL);
        assert_eq!(
            verify(&k.mint(&fresh).unwrap(), &ks, &Expected::new("gw1"), late)
                .unwrap_err()
                .code(),
            "key_expired"
        );
        // A key without an expiry is trusted for as long as it is in the set.
        assert!(verify(&token, &keyset(&[&k]), &Expected::new("gw1"), now()).is_ok());
    }

    /// What `pasetors` 0.7.8 (the signer before, and the verifier of the
    /// gateways built before) minted for `claims("gw1")` with key `k1` =
    /// seed `[7; 32]`: Ed25519 is deterministic, so ours must be this very
    /// token (and pasetors verified ours: tested both ways before it left
    /// the dependencies).
    const PASETORS_TOKEN: &str = "v4.public.eyJpc3MiOiJjbHVzdGVyMSIsImF1ZCI6Imd3MSIsInN1YiI6InVzZXI6YWxpY2UiLCJqdGkiOiIwMDExMjIzMzQ0NTU2Njc3ODg5OWFhYmJjY2RkZWVmZiIsImlhdCI6IjIwMjctMDEtMTVUMDg6MDA6MDBaIiwibmJmIjoiMjAyNy0wMS0xNVQwODowMDowMFoiLCJleHAiOiIyMDI3LTAxLTE1VDA4OjA1OjAwWiIsInZtIjoid2ViMDEiLCJ2bV9pZCI6InZtaWQiLCJuZXQiOiJvdiIsIm1hYyI6IjAyOjAwOjAwOjAwOjAwOjAxIiwiaXAiOiIxMC4xMDAuMC4yIiwicG9ydCI6MjJ99HkMon-QX1FUOTgKVZGsyj6sge5x4e7ngl3yDo2wSIzjqetDG8WS-5VH8uTt7-7axw7IRSdpSG2BxP02PxgBBg.eyJraWQiOiJrMSJ9";

    #[test]
    fn tokens_are_byte_for_byte_what_pasetors_minted() {
        let k = key("k1", 7);
        assert_eq!(k.mint(&claims("gw1")).unwrap(), PASETORS_TOKEN);
        assert_eq!(
            verify(PASETORS_TOKEN, &keyset(&[&k]), &Expected::new("gw1"), now()).unwrap(),
            claims("gw1")
        );
    }

    /// What minting and verifying one credential cost, and each beside the
    /// other Ed25519s the tests build: minting with ring's or
    /// ed25519-compact's signature instead of AWS-LC's, verifying with
    /// theirs (the framing the same). 20 rounds of 2,000 each, taking turns
    /// so that a busy machine weighs on all alike; the fastest round (the
    /// cost with the least interference) and the median. Run with
    /// `cargo test --release -p otherix-core --lib cost_of_minting -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, not a check: run it --release with --ignored --nocapture"]
    fn cost_of_minting_and_verifying() {
        use std::hint::black_box;
        use std::time::Instant;

        /// ns per call of each of `ops`, per round, sorted.
        fn rounds(ops: &mut [&mut dyn FnMut()]) -> Vec<Vec<u128>> {
            const N: u32 = 2_000;
            let mut out = vec![Vec::new(); ops.len()];
            for _ in 0..20 {
                for (op, times) in ops.iter_mut().zip(&mut out) {
                    let start = Instant::now();
                    for _ in 0..N {
                        op();
                    }
                    times.push(start.elapsed().as_nanos() / u128::from(N));
                }
            }
            for times in &mut out {
                times.sort_unstable();
            }
            out
        }

        let k = key("k1", 7);
        let ks = keyset(&[&k]);
        let c = claims("gw1");
        let token = k.mint(&c).unwrap();

        let mut ours_mint = || {
            black_box(k.mint(black_box(&c)).unwrap());
        };
        let ring_pair = ring::signature::Ed25519KeyPair::from_seed_unchecked(&[7; 32]).unwrap();
        let mut ring_mint = || {
            let message = serde_json::to_vec(black_box(&c)).unwrap();
            let token = paseto::sign(&message, &k.footer, &[], |m| {
                ring_pair.sign(m).as_ref().try_into().ok()
            });
            black_box(token.unwrap());
        };
        let compact_pair = ed25519_compact::KeyPair::from_seed(ed25519_compact::Seed::new([7; 32]));
        let mut compact_mint = || {
            let message = serde_json::to_vec(black_box(&c)).unwrap();
            let token = paseto::sign(&message, &k.footer, &[], |m| Some(*compact_pair.sk.sign(m, None)));
            black_box(token.unwrap());
        };
        let mut ours_verify = || {
            black_box(verify(black_box(&token), &ks, &Expected::new("gw1"), now()).unwrap());
        };
        // The same steps as `verify` up to the claims (the checks after
        // cost next to nothing), the signature checked by another Ed25519.
        let steps = |check: &dyn Fn(&[u8], &[u8; 64])| {
            let untrusted = paseto::parse(black_box(&token)).unwrap();
            let footer: Footer = serde_json::from_slice(untrusted.footer()).unwrap();
            assert!(ks.keys.contains_key(&footer.kid));
            let (signed, signature, message) = untrusted.parts(&[]);
            check(&signed, signature);
            black_box(serde_json::from_slice::<Claims>(message).unwrap());
        };
        let public = k.public_key();
        let ring_public = ring::signature::UnparsedPublicKey::new(&ring::signature::ED25519, public);
        let mut ring_verify = || steps(&|signed, signature| ring_public.verify(signed, signature).unwrap());
        let compact_public = ed25519_compact::PublicKey::new(public);
        let mut compact_verify = || {
            steps(&|signed, signature| {
                compact_public
                    .verify(signed, &ed25519_compact::Signature::new(*signature))
                    .unwrap();
            });
        };
        let times = rounds(&mut [
            &mut ours_mint,
            &mut compact_mint,
            &mut ring_mint,
            &mut ours_verify,
            &mut ring_verify,
            &mut compact_verify,
        ]);
        let names = [
            "mint (ours: AWS-LC)",
            "mint, signing with ed25519-compact",
            "mint, signing with ring",
            "verify (ours: AWS-LC)",
            "verify with ring",
            "verify with ed25519-compact",
        ];
        for (name, t) in names.iter().zip(&times) {
            println!("{name:34} fastest {:6} ns, median {:6} ns", t[0], t[t.len() / 2]);
        }
    }

    #[test]
    fn all_zero_seed_is_refused() {
        assert!(SigningKey::from_seed("k", [0; 32]).is_err());
    }
}
