//! Fuzzes credential decoding from arbitrary bytes: `verify` against a fixed
//! key set, as a gateway (or the relay, for tickets) calls it with whatever
//! followed `Authorization: Bearer`. It must refuse without panicking. The
//! seed corpus holds tokens these keys really signed, so the fuzzer mutates
//! from inside the format (and from past the signature check, for the
//! seeds themselves); what is accepted keeps the audience and lifetime.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use otherix_core::credential::{verify, Expected, KeySet, SigningKey, DEFAULT_MAX_LIFETIME};
use time::OffsetDateTime;

/// Keys under the kids a fuzzer can guess (`k1`, the empty kid, a long one),
/// so footers that name them reach the signature check.
fn keys() -> &'static KeySet {
    static KEYS: OnceLock<KeySet> = OnceLock::new();
    KEYS.get_or_init(|| {
        let mut keys = KeySet::new();
        for (kid, seed) in [("k1", 1u8), ("", 2), ("kid-0123456789abcdef", 3)] {
            let key = SigningKey::from_seed(kid, [seed; 32]).expect("non-zero seed");
            keys.insert(kid, &key.public_key()).expect("a valid public key");
        }
        keys
    })
}

fuzz_target!(|data: &[u8]| {
    // Tokens arrive as header text: the gateway's parser hands over ASCII
    // only, but `verify` takes any `&str`, so feed it any UTF-8.
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).expect("in range");
    match verify(token, keys(), &Expected::new("gw1"), now) {
        Ok(claims) => {
            assert_eq!(claims.aud, "gw1");
            assert!(claims.exp - claims.iat.min(claims.nbf) <= DEFAULT_MAX_LIFETIME);
        }
        // What the gateway does with a refusal: none of it may panic.
        Err(refusal) => {
            let _ = (refusal.code(), refusal.kind(), refusal.to_string());
        }
    }
});
