//! The key control-plane replicas seal their shared secrets with — the
//! cluster CA's key and the session keys' seeds — before those go into the
//! store (`--secret-key-file`). Several replicas share one database, so
//! what only the control plane may hold must live there, and the database
//! (its backups, its administrators) must not be able to read it.
//!
//! AES-256-GCM (ring). A sealed value is `1 ‖ nonce (12) ‖ ciphertext ‖ tag`;
//! the nonce is random per seal, and the secret's name is the associated
//! data, so a sealed value moved to another row (the CA key's bytes as a
//! session key's seed) does not open.
//!
//! The key file holds 64 hex digits (a line), the owner's alone (0600). A
//! replica whose key is not the one the store's secrets were sealed with is
//! refused at start, naming the file to copy.

use std::path::Path;

use anyhow::Context;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

use crate::random;

/// The format byte of a sealed value.
const VERSION: u8 = 1;
/// What the associated data starts with, before the secret's name.
const AAD_PREFIX: &[u8] = b"otherix sealed secret v1\0";

/// The key secrets are sealed with. Never printed.
pub struct SecretKey {
    key: LessSafeKey,
    /// SHA-256 of the key, first 8 bytes, hex: names it in messages
    /// without giving anything away.
    id: String,
}

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretKey")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

/// A sealed value that did not open: another key sealed it, or it was
/// changed, or it belongs to another name.
#[derive(Debug, thiserror::Error)]
#[error("the secret {name:?} does not open with this secret key ({reason})")]
pub struct Unsealable {
    pub name: String,
    pub reason: &'static str,
}

impl SecretKey {
    /// A key from its 32 bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> SecretKey {
        use sha2::Digest;
        let id = hex::encode(&sha2::Sha256::digest(bytes)[..8]);
        let key = UnboundKey::new(&AES_256_GCM, &bytes).expect("AES-256 takes a 32-byte key");
        SecretKey {
            key: LessSafeKey::new(key),
            id,
        }
    }

    /// A new random key.
    pub fn generate() -> SecretKey {
        SecretKey::from_bytes(random::bytes::<32>())
    }

    /// A short public name for the key (a hash prefix), for messages.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Reads the key file at `path`: 64 hex digits.
    pub fn load(path: &Path) -> anyhow::Result<SecretKey> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(text.trim(), &mut bytes).map_err(|_| {
            anyhow::anyhow!(
                "{} is not a secret key file (64 hex digits, as `otherix server` writes it)",
                path.display()
            )
        })?;
        crate::tighten(path, 0o600)?;
        Ok(SecretKey::from_bytes(bytes))
    }

    /// Makes a new key and writes it to `path` (0600) — unless a file is
    /// there already, made meanwhile: `None`, and that one is the key.
    /// Exclusive creation, so two processes never both think theirs won.
    pub fn create(path: &Path) -> anyhow::Result<Option<SecretKey>> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let bytes = random::bytes::<32>();
        let mut file = match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Ok(None),
            Err(e) => return Err(e).with_context(|| format!("creating {}", path.display())),
        };
        let written = file
            .write_all(format!("{}\n", hex::encode(bytes)).as_bytes())
            .and_then(|()| file.sync_all());
        if let Err(e) = written {
            let _ = std::fs::remove_file(path);
            return Err(e).with_context(|| format!("writing {}", path.display()));
        }
        Ok(Some(SecretKey::from_bytes(bytes)))
    }

    /// Seals `plain` as the secret `name`.
    pub fn seal(&self, name: &str, plain: &[u8]) -> Vec<u8> {
        let nonce = random::bytes::<NONCE_LEN>();
        let mut out = Vec::with_capacity(1 + NONCE_LEN + plain.len() + AES_256_GCM.tag_len());
        out.push(VERSION);
        out.extend_from_slice(&nonce);
        let mut body = plain.to_vec();
        self.key
            .seal_in_place_append_tag(Nonce::assume_unique_for_key(nonce), aad(name), &mut body)
            .expect("sealing a secret of bounded size cannot fail");
        out.extend_from_slice(&body);
        out
    }

    /// Opens a value [`SecretKey::seal`] sealed as `name`.
    pub fn open(&self, name: &str, sealed: &[u8]) -> Result<Vec<u8>, Unsealable> {
        let fail = |reason| Unsealable {
            name: name.to_string(),
            reason,
        };
        let (&version, rest) = sealed.split_first().ok_or_else(|| fail("empty"))?;
        if version != VERSION {
            return Err(fail("unknown format"));
        }
        if rest.len() < NONCE_LEN + AES_256_GCM.tag_len() {
            return Err(fail("too short"));
        }
        let (nonce, body) = rest.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| fail("bad nonce"))?;
        let mut body = body.to_vec();
        let plain = self
            .key
            .open_in_place(nonce, aad(name), &mut body)
            .map_err(|_| fail("another key sealed it, or it was altered"))?;
        Ok(plain.to_vec())
    }
}

fn aad(name: &str) -> Aad<Vec<u8>> {
    let mut aad = AAD_PREFIX.to_vec();
    aad.extend_from_slice(name.as_bytes());
    Aad::from(aad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_secret_opens_with_its_key_and_name_only() {
        let key = SecretKey::generate();
        let sealed = key.seal("ca", b"the CA key");
        assert_eq!(key.open("ca", &sealed).unwrap(), b"the CA key");
        // Not readable in the store.
        assert!(!sealed.windows(10).any(|w| w == b"the CA key"));
        // Another replica's key, another name, a flipped bit: refused.
        assert!(SecretKey::generate().open("ca", &sealed).is_err());
        assert!(key.open("session_key:1", &sealed).is_err());
        for i in 0..sealed.len() {
            let mut tampered = sealed.clone();
            tampered[i] ^= 1;
            assert!(key.open("ca", &tampered).is_err(), "byte {i}");
        }
        assert!(key.open("ca", &sealed[..20]).is_err());
        assert!(key.open("ca", &[]).is_err());
    }

    #[test]
    fn each_seal_takes_a_fresh_nonce() {
        let key = SecretKey::generate();
        assert_ne!(key.seal("x", b"same"), key.seal("x", b"same"));
    }

    #[test]
    fn the_key_file_round_trips_and_is_the_owners_alone() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("otherix-secret-{}", random::short_id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("secret.key");
        let made = SecretKey::create(&path).unwrap().expect("a new file");
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        let loaded = SecretKey::load(&path).unwrap();
        assert_eq!(made.id(), loaded.id());
        assert_eq!(loaded.open("n", &made.seal("n", b"v")).unwrap(), b"v");
        assert!(
            SecretKey::create(&path).unwrap().is_none(),
            "never overwrites a key"
        );
        assert_eq!(SecretKey::load(&path).unwrap().id(), made.id());
        // Not a key: refused in one line, without echoing the content.
        std::fs::write(&path, "not hex at all\n").unwrap();
        let err = SecretKey::load(&path).unwrap_err().to_string();
        assert!(err.contains("is not a secret key file"), "{err}");
        assert!(!err.contains("not hex at all"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_debug_print_names_the_key_by_a_hash_prefix_only() {
        let key = SecretKey::from_bytes([0xab; 32]);
        let printed = format!("{key:?}");
        assert!(printed.contains(key.id()), "{printed}");
        assert!(!printed.contains("abab"), "{printed}");
    }
}
