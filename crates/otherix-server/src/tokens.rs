//! Bearer secrets of every kind — API tokens (`otx_`), node join tokens
//! (`otxj_`) and external grants (`otxg_`): minted, stored only as a hash,
//! checked in constant time.
//!
//! A token reads `<prefix><id>_<secret>`: the id (public, 64 bits) finds the
//! row, the secret (256 bits) is checked against the stored SHA-256. A fast
//! hash is right here: the secret is random, not a password.

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::random;

/// API tokens.
pub const PREFIX: &str = "otx_";
/// Node join tokens.
pub const JOIN_PREFIX: &str = "otxj_";

/// A freshly minted token: the secret goes to the caller once, the hash to the store.
pub struct NewToken {
    pub id: String,
    pub token: String,
    pub secret_hash: Vec<u8>,
}

impl std::fmt::Debug for NewToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewToken")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

pub fn new_token() -> NewToken {
    new_token_with(PREFIX)
}

/// A token `<prefix><id>_<secret>` of the same strength as API tokens.
pub fn new_token_with(prefix: &str) -> NewToken {
    let id = hex::encode(random::bytes::<8>());
    let secret = hex::encode(random::bytes::<32>());
    NewToken {
        token: format!("{prefix}{id}_{secret}"),
        secret_hash: hash_secret(&secret),
        id,
    }
}

pub fn hash_secret(secret: &str) -> Vec<u8> {
    Sha256::digest(secret.as_bytes()).to_vec()
}

/// Splits a presented token into (id, secret) if it has the right shape.
pub fn split_token(token: &str) -> Option<(&str, &str)> {
    split_token_with(PREFIX, token)
}

pub fn split_token_with<'a>(prefix: &str, token: &'a str) -> Option<(&'a str, &'a str)> {
    let rest = token.strip_prefix(prefix)?;
    let (id, secret) = rest.split_once('_')?;
    let hexlike = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (hexlike(id, 16) && hexlike(secret, 64)).then_some((id, secret))
}

/// Constant-time equality of a presented secret's hash with a stored one.
pub fn secret_matches(secret: &str, stored_hash: &[u8]) -> bool {
    bool::from(hash_secret(secret).ct_eq(stored_hash))
}

/// External grants.
pub const GRANT_PREFIX: &str = "otxg_";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minted_token_splits_and_hashes_back() {
        let t = new_token();
        let (id, secret) = split_token(&t.token).unwrap();
        assert_eq!(id, t.id);
        assert_eq!(hash_secret(secret), t.secret_hash);
    }

    #[test]
    fn malformed_tokens_do_not_split() {
        for bad in [
            "",
            "otx_",
            "otx_abc_def",
            "xyz_0123456789abcdef_00",
            &format!("otx_{}_{}", "g".repeat(16), "0".repeat(64)),
        ] {
            assert!(split_token(bad).is_none(), "{bad}");
        }
    }
}
