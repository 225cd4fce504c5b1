//! Session signing keys and audit events.

use sqlx::Row;
use time::OffsetDateTime;

use crate::{from_millis, to_millis, Store, StoreError};

/// A session signing key as stored.
#[derive(Clone)]
pub struct SessionKeyRecord {
    pub kid: String,
    pub seed: Vec<u8>,
    pub public: Vec<u8>,
    pub created_at: OffsetDateTime,
}

impl std::fmt::Debug for SessionKeyRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionKeyRecord")
            .field("kid", &self.kid)
            .field("created_at", &self.created_at)
            .finish_non_exhaustive()
    }
}

/// One audited decision: the API's record, stored as it is served.
pub type AuditEvent = otherix_api::AuditRecord;

impl Store {
    pub async fn add_session_key(&self, key: &SessionKeyRecord) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO session_keys (kid, seed, public, created_at) VALUES (?, ?, ?, ?)")
            .bind(&key.kid)
            .bind(&key.seed)
            .bind(&key.public)
            .bind(to_millis(key.created_at))
            .execute(&self.write)
            .await?;
        Ok(())
    }

    /// Keys created after `since`, newest first.
    pub async fn session_keys_since(
        &self,
        since: OffsetDateTime,
    ) -> Result<Vec<SessionKeyRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT kid, seed, public, created_at FROM session_keys WHERE created_at > ? ORDER BY created_at DESC, kid",
        )
        .bind(to_millis(since))
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(|r| SessionKeyRecord {
                kid: r.get("kid"),
                seed: r.get("seed"),
                public: r.get("public"),
                created_at: from_millis(r.get("created_at")),
            })
            .collect())
    }

    /// Drops keys that can no longer have live credentials.
    pub async fn prune_session_keys(&self, before: OffsetDateTime) -> Result<u64, StoreError> {
        let res = sqlx::query("DELETE FROM session_keys WHERE created_at < ?")
            .bind(to_millis(before))
            .execute(&self.write)
            .await?;
        Ok(res.rows_affected())
    }

    pub async fn add_audit_event(&self, e: &AuditEvent) -> Result<(), StoreError> {
        let mut conn = self.write.acquire().await?;
        crate::sessions::insert_audit(&mut conn, e).await
    }

    /// Audit events at or after `since`, oldest first (by when they
    /// happened: a gateway's session reports arrive after the fact).
    pub async fn audit_events(&self, since: OffsetDateTime) -> Result<Vec<AuditEvent>, StoreError> {
        let rows = sqlx::query("SELECT * FROM audit_events WHERE at >= ? ORDER BY at, id")
            .bind(to_millis(since))
            .fetch_all(&self.read)
            .await?;
        Ok(rows
            .iter()
            .map(|r| AuditEvent {
                at: from_millis(r.get("at")),
                principal: r.get("principal"),
                action: r.get("action"),
                target: r.get("target"),
                port: r.get::<Option<i64>, _>("port").map(|p| p as u16),
                transport: r.get("transport"),
                node: r.get("node"),
                allowed: r.get::<i64, _>("allowed") != 0,
                reason: r.get("reason"),
                bytes_up: r.get::<Option<i64>, _>("bytes_up").map(|b| b as u64),
                bytes_down: r.get::<Option<i64>, _>("bytes_down").map(|b| b as u64),
                duration_ms: r.get::<Option<i64>, _>("duration_ms").map(|b| b as u64),
                session: r.get("session"),
            })
            .collect())
    }
}
