//! Session signing keys: Ed25519 keys the CP creates and rotates, signs
//! credentials with, and publishes (public halves) to gateways in heartbeat
//! answers while credentials signed by them may still be alive.

use std::sync::{Arc, RwLock};

use otherix_api::agent::SessionPublicKey;
use otherix_core::credential::{SigningKey, CLOCK_SKEW};
use otherix_store::{SessionKeyRecord, Store, StoreError};
use time::{Duration, OffsetDateTime};

use crate::auth::random_bytes;

#[derive(Debug)]
pub struct SessionKeys {
    store: Store,
    /// A new key is made when the newest is this old.
    rotation: Duration,
    /// Credential lifetime: a retired key is published this much longer.
    ttl: Duration,
    current: RwLock<Option<Arc<SigningKey>>>,
}

impl SessionKeys {
    pub fn new(store: Store, rotation: Duration, ttl: Duration) -> SessionKeys {
        SessionKeys {
            store,
            rotation,
            ttl,
            current: RwLock::new(None),
        }
    }

    /// Loads the newest key, or makes one if it is missing or due for
    /// rotation. Idempotent; called at start and periodically.
    pub async fn rotate_if_due(&self, now: OffsetDateTime) -> Result<(), StoreError> {
        let newest = self
            .store
            .session_keys_since(now - self.rotation)
            .await?
            .into_iter()
            .next();
        let record = match newest {
            Some(r) => r,
            None => {
                let seed = random_bytes::<32>();
                let kid = hex::encode(random_bytes::<8>());
                let key = SigningKey::from_seed(kid.clone(), seed)
                    .map_err(|e| StoreError::Invalid(e.to_string()))?;
                let record = SessionKeyRecord {
                    kid,
                    seed: seed.to_vec(),
                    public: key.public_key().to_vec(),
                    created_at: now,
                };
                self.store.add_session_key(&record).await?;
                tracing::info!(kid = %record.kid, "session signing key rotated");
                record
            }
        };
        let loaded = self
            .current
            .read()
            .ok()
            .and_then(|c| c.as_ref().map(|k| k.kid().to_string()));
        if loaded.as_deref() != Some(record.kid.as_str()) {
            let seed: [u8; 32] = record
                .seed
                .as_slice()
                .try_into()
                .map_err(|_| StoreError::Corrupt(format!("session key {} has a bad seed", record.kid)))?;
            let key = SigningKey::from_seed(record.kid.clone(), seed)
                .map_err(|e| StoreError::Corrupt(e.to_string()))?;
            if let Ok(mut cur) = self.current.write() {
                *cur = Some(Arc::new(key));
            }
        }
        // Keys older than any live credential are of no use to anyone.
        let horizon = now - self.rotation - self.ttl - CLOCK_SKEW - Duration::hours(1);
        self.store.prune_session_keys(horizon).await?;
        Ok(())
    }

    /// The key to sign with now.
    pub fn current(&self) -> Option<Arc<SigningKey>> {
        self.current.read().ok().and_then(|c| c.clone())
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Public halves that may still have live credentials.
    pub async fn published(&self, now: OffsetDateTime) -> Result<Vec<SessionPublicKey>, StoreError> {
        let since = now - self.rotation - self.ttl - CLOCK_SKEW;
        Ok(self
            .store
            .session_keys_since(since)
            .await?
            .into_iter()
            .map(|r| SessionPublicKey {
                kid: r.kid,
                public: hex::encode(r.public),
            })
            .collect())
    }

    /// Rotates in the background until the process ends.
    pub fn spawn_rotation(self: Arc<Self>) {
        let every: Duration = (self.rotation / 10_i32).clamp(Duration::seconds(1), Duration::seconds(60));
        let every = std::time::Duration::try_from(every).unwrap_or(std::time::Duration::from_secs(60));
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if let Err(e) = self.rotate_if_due(OffsetDateTime::now_utc()).await {
                    tracing::error!(error = %e, "session key rotation failed");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn rotation_keeps_the_previous_key_published_until_its_credentials_die() {
        let store = Store::open_in_memory().await.unwrap();
        let keys = SessionKeys::new(store, Duration::hours(1), Duration::minutes(5));
        let t0 = OffsetDateTime::now_utc();
        keys.rotate_if_due(t0).await.unwrap();
        let first = keys.current().unwrap().kid().to_string();
        keys.rotate_if_due(t0 + Duration::minutes(30)).await.unwrap();
        assert_eq!(keys.current().unwrap().kid(), first, "not due yet");
        let t1 = t0 + Duration::hours(1) + Duration::seconds(1);
        keys.rotate_if_due(t1).await.unwrap();
        let second = keys.current().unwrap().kid().to_string();
        assert_ne!(second, first);
        let published: Vec<String> = keys
            .published(t1)
            .await
            .unwrap()
            .into_iter()
            .map(|k| k.kid)
            .collect();
        assert_eq!(
            published,
            [second.clone(), first.clone()],
            "newest first, old one still live"
        );
        let later = t1 + Duration::hours(1) + Duration::minutes(10);
        keys.rotate_if_due(later).await.unwrap();
        let published: Vec<String> = keys
            .published(later)
            .await
            .unwrap()
            .into_iter()
            .map(|k| k.kid)
            .collect();
        assert!(
            !published.contains(&first),
            "a key whose credentials are all dead is withdrawn"
        );
    }
}
