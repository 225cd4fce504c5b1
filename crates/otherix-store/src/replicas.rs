//! Control-plane replicas and the secrets they share.
//!
//! Every running control plane keeps a row in `replicas` fresh. One whose
//! row goes stale has stopped (killed, cut off from the database): another
//! replica records the relay sessions it carried as ended — they lived in
//! its process — and removes the row ([`Store::reap_replicas`]). Under the
//! write lock, so exactly one replica does it.
//!
//! `secrets` holds what every replica needs and only the control plane may
//! read — the cluster CA's key — sealed with the key every replica is
//! given. The store never sees that key: it keeps the sealed bytes.

use sqlx::Row;
use time::OffsetDateTime;

use crate::sessions::{close, Carrier};
use crate::{from_millis, to_millis, Dialect, Store, StoreError};

/// A control plane that is (or was lately) running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaRecord {
    pub id: String,
    /// The URL it serves at, as it printed it.
    pub address: String,
    pub started_at: OffsetDateTime,
    pub seen_at: OffsetDateTime,
}

/// A secret as stored: its public part, and the rest sealed.
#[derive(Clone)]
pub struct SecretRecord {
    pub name: String,
    pub public: String,
    pub sealed: Vec<u8>,
    pub created_at: OffsetDateTime,
}

impl std::fmt::Debug for SecretRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretRecord")
            .field("name", &self.name)
            .field("created_at", &self.created_at)
            .finish_non_exhaustive()
    }
}

/// What a sweep of stopped replicas did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reaped {
    /// The replica that stopped.
    pub id: String,
    /// Its relay sessions, now recorded as ended.
    pub sessions: u64,
}

impl Store {
    /// Records that replica `id` runs now (the database's clock on
    /// PostgreSQL: replicas on hosts whose clocks differ still agree on
    /// who is stale). Returns `false` when its row was gone — it had been
    /// reaped as stopped (see [`Store::reap_replicas`]) and is registered
    /// anew.
    pub async fn replica_seen(
        &self,
        id: &str,
        address: &str,
        started_at: OffsetDateTime,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_write().await?;
        let now = self.clock(&mut tx).await?;
        let updated = sqlx::query("UPDATE replicas SET seen_at = $1, address = $2 WHERE id = $3")
            .bind(now)
            .bind(address)
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if updated == 0 {
            sqlx::query("INSERT INTO replicas (id, address, started_at, seen_at) VALUES ($1, $2, $3, $4)")
                .bind(id)
                .bind(address)
                .bind(to_millis(started_at))
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(updated == 1)
    }

    /// Every registered replica, oldest first.
    pub async fn replicas(&self) -> Result<Vec<ReplicaRecord>, StoreError> {
        let rows =
            sqlx::query("SELECT id, address, started_at, seen_at FROM replicas ORDER BY started_at, id")
                .fetch_all(&self.read)
                .await?;
        Ok(rows
            .iter()
            .map(|r| ReplicaRecord {
                id: r.get("id"),
                address: r.get("address"),
                started_at: from_millis(r.get("started_at")),
                seen_at: from_millis(r.get("seen_at")),
            })
            .collect())
    }

    /// Replica `id` stops: its row goes (its relay sessions were ended by
    /// the replica itself).
    pub async fn remove_replica(&self, id: &str) -> Result<(), StoreError> {
        self.exec(sqlx::query("DELETE FROM replicas WHERE id = $1").bind(id))
            .await?;
        Ok(())
    }

    /// Replicas not seen for `timeout` (by the clock of
    /// [`Store::replica_seen`]) have stopped: records the relay sessions
    /// each carried as ended (reason "control plane replica ID stopped")
    /// and removes its row, in one transaction. Relay sessions that name
    /// no registered replica (from before replicas, or whose replica was
    /// removed without ending them) are ended too, as carried by no one.
    pub async fn reap_replicas(&self, timeout: std::time::Duration) -> Result<Vec<Reaped>, StoreError> {
        let mut tx = self.begin_write().await?;
        let now_ms = self.clock(&mut tx).await?;
        let now = from_millis(now_ms);
        let stale: Vec<String> = sqlx::query_scalar("SELECT id FROM replicas WHERE seen_at < $1 ORDER BY id")
            .bind(now_ms - timeout.as_millis() as i64)
            .fetch_all(&mut *tx)
            .await?;
        let mut reaped = Vec::with_capacity(stale.len());
        for id in stale {
            let sessions = close(
                &mut tx,
                Carrier::Replica(&id),
                &format!("control plane replica {id} stopped"),
                now,
            )
            .await?;
            sqlx::query("DELETE FROM replicas WHERE id = $1")
                .bind(&id)
                .execute(&mut *tx)
                .await?;
            reaped.push(Reaped { id, sessions });
        }
        let orphans = close(&mut tx, Carrier::Unowned, "control plane stopped", now).await?;
        if orphans > 0 {
            reaped.push(Reaped {
                id: String::new(),
                sessions: orphans,
            });
        }
        tx.commit().await?;
        Ok(reaped)
    }

    /// The database's clock now, on PostgreSQL (`None` on SQLite, whose
    /// clock is this process's): replicas compare their own with it, so
    /// that what one stamps and another checks agree (see the server's
    /// `clock` module).
    pub async fn database_time(&self) -> Result<Option<OffsetDateTime>, StoreError> {
        match self.dialect {
            Dialect::Sqlite => Ok(None),
            Dialect::Postgres => {
                let ms: i64 =
                    sqlx::query_scalar("SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)")
                        .fetch_one(&self.read)
                        .await?;
                Ok(Some(from_millis(ms)))
            }
        }
    }

    /// Now in milliseconds: the database's clock on PostgreSQL (one for
    /// every replica), this process's on SQLite (the only one).
    async fn clock(&self, conn: &mut sqlx::AnyConnection) -> Result<i64, StoreError> {
        match self.dialect {
            Dialect::Sqlite => Ok(to_millis(OffsetDateTime::now_utc())),
            Dialect::Postgres => Ok(sqlx::query_scalar(
                "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) * 1000 AS BIGINT)",
            )
            .fetch_one(conn)
            .await?),
        }
    }

    /// The secret `name`, if it was stored.
    pub async fn secret(&self, name: &str) -> Result<Option<SecretRecord>, StoreError> {
        let row = sqlx::query("SELECT name, public, sealed, created_at FROM secrets WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.read)
            .await?;
        Ok(row.map(|r| secret_record(&r)))
    }

    /// Stores `secret` unless one of its name is stored already, and
    /// returns the one stored: another replica's when it came first (two
    /// replicas bootstrapping together agree on one).
    pub async fn secret_init(&self, secret: &SecretRecord) -> Result<SecretRecord, StoreError> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO secrets (name, public, sealed, created_at) VALUES ($1, $2, $3, $4)
             ON CONFLICT(name) DO NOTHING",
        )
        .bind(&secret.name)
        .bind(&secret.public)
        .bind(&secret.sealed)
        .bind(to_millis(secret.created_at))
        .execute(&mut *tx)
        .await?;
        let row = sqlx::query("SELECT name, public, sealed, created_at FROM secrets WHERE name = $1")
            .bind(&secret.name)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(secret_record(&row))
    }
}

fn secret_record(r: &sqlx::any::AnyRow) -> SecretRecord {
    SecretRecord {
        name: r.get("name"),
        public: r.get("public"),
        sealed: r.get("sealed"),
        created_at: from_millis(r.get("created_at")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::on_both;
    use crate::AuditFilter;
    use otherix_proto::{AuditAction, OpenSession, Transport};

    fn t(s: i64) -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000 + s).unwrap()
    }

    fn relay_session(id: &str, replica: Option<&str>) -> OpenSession {
        OpenSession {
            id: id.into(),
            principal: "user:alice".into(),
            target: "lab01".into(),
            port: 7,
            transport: Transport::Relay,
            node: "node1".into(),
            replica: replica.map(str::to_string),
            started_at: t(0),
            bytes_up: 0,
            bytes_down: 0,
            bytes_at: None,
        }
    }

    async fn ends(store: &Store) -> Vec<(String, String)> {
        let from = otherix_proto::AuditCursor::at_or_after(OffsetDateTime::UNIX_EPOCH);
        let (all, _) = store
            .audit_page(from, &AuditFilter::default(), 10_000)
            .await
            .unwrap();
        let mut out: Vec<(String, String)> = all
            .into_iter()
            .filter(|e| e.action == AuditAction::SessionEnd)
            .map(|e| (e.session.unwrap(), e.reason.unwrap_or_default()))
            .collect();
        out.sort();
        out
    }

    /// Long enough that a replica seen just before a sweep is fresh
    /// however slow the machine, short against the test's pause.
    const TIMEOUT: std::time::Duration = std::time::Duration::from_millis(600);

    on_both! {
        async fn a_stopped_replicas_relay_sessions_are_ended_by_another_and_only_its(store) {
            store.replica_seen("a", "https://a:7443", t(0)).await.unwrap();
            store.replica_seen("b", "https://b:7443", t(0)).await.unwrap();
            store.start_session(&relay_session("s-a", Some("a"))).await.unwrap();
            store.start_session(&relay_session("s-b", Some("b"))).await.unwrap();
            // b keeps saying it runs; a stopped.
            tokio::time::sleep(TIMEOUT * 2).await;
            assert!(store.replica_seen("b", "https://b:7443", t(0)).await.unwrap());

            let reaped = store.reap_replicas(TIMEOUT).await.unwrap();
            assert_eq!(reaped, vec![Reaped { id: "a".into(), sessions: 1 }]);
            assert_eq!(ends(&store).await, vec![("s-a".into(), "control plane replica a stopped".into())]);
            let open: Vec<String> = store.open_sessions().await.unwrap().into_iter().map(|s| s.id).collect();
            assert_eq!(open, vec!["s-b".to_string()]);
            let ids: Vec<String> = store.replicas().await.unwrap().into_iter().map(|r| r.id).collect();
            assert_eq!(ids, vec!["b".to_string()]);

            // A second sweep (another replica racing) finds nothing more.
            assert!(store.reap_replicas(TIMEOUT).await.unwrap().is_empty());
            // A replica that was reaped (it stalled) learns so when it is seen again.
            assert!(!store.replica_seen("a", "https://a:7443", t(0)).await.unwrap());
        }
    }

    on_both! {
        async fn relay_sessions_no_replica_carries_are_ended_and_gateway_sessions_are_not(store) {
            store.replica_seen("a", "https://a:7443", t(0)).await.unwrap();
            store.start_session(&relay_session("old", None)).await.unwrap();
            let gateway = OpenSession {
                transport: Transport::Gateway,
                node: "gw1".into(),
                ..relay_session("gw", None)
            };
            store.start_session(&gateway).await.unwrap();
            let reaped = store.reap_replicas(TIMEOUT).await.unwrap();
            assert_eq!(reaped, vec![Reaped { id: String::new(), sessions: 1 }]);
            assert_eq!(ends(&store).await, vec![("old".into(), "control plane stopped".into())]);
            let open: Vec<String> = store.open_sessions().await.unwrap().into_iter().map(|s| s.id).collect();
            assert_eq!(open, vec!["gw".to_string()]);
        }
    }

    on_both! {
        async fn the_first_secret_stored_is_the_one_every_replica_gets(store) {
            assert!(store.secret("ca").await.unwrap().is_none());
            let first = SecretRecord { name: "ca".into(), public: "cert 1".into(), sealed: vec![1, 2, 3], created_at: t(0) };
            let second = SecretRecord { public: "cert 2".into(), sealed: vec![4, 5, 6], ..first.clone() };
            assert_eq!(store.secret_init(&first).await.unwrap().sealed, vec![1, 2, 3]);
            let got = store.secret_init(&second).await.unwrap();
            assert_eq!((got.public.as_str(), got.sealed), ("cert 1", vec![1, 2, 3]));
            assert_eq!(store.secret("ca").await.unwrap().unwrap().public, "cert 1");
        }
    }

    #[tokio::test]
    async fn replicas_rotating_together_add_one_session_key() {
        let store = crate::testing::postgres().await;
        let now = OffsetDateTime::now_utc();
        let mut set = tokio::task::JoinSet::new();
        for i in 0..3u8 {
            let replica = store.another().await;
            set.spawn(async move {
                let key = crate::SessionKeyRecord {
                    kid: format!("k{i}"),
                    seed: vec![i; 32],
                    public: vec![i; 32],
                    created_at: now,
                    signs_from: Some(now),
                };
                replica
                    .add_session_key_if_due(&key, now - time::Duration::hours(1))
                    .await
                    .unwrap()
            });
        }
        let added = set.join_all().await.into_iter().filter(|a| *a).count();
        assert_eq!(added, 1);
        let keys = store
            .session_keys_since(OffsetDateTime::UNIX_EPOCH)
            .await
            .unwrap();
        assert_eq!(keys.len(), 1);
    }

    #[tokio::test]
    async fn replicas_bootstrapping_together_store_one_secret() {
        let store = crate::testing::postgres().await;
        let mut set = tokio::task::JoinSet::new();
        for i in 0..3u8 {
            let replica = store.another().await;
            set.spawn(async move {
                let secret = SecretRecord {
                    name: "ca".into(),
                    public: format!("cert {i}"),
                    sealed: vec![i],
                    created_at: t(0),
                };
                replica.secret_init(&secret).await.unwrap().public
            });
        }
        let got = set.join_all().await;
        assert!(got.iter().all(|p| *p == got[0]), "{got:?}");
        assert_eq!(store.secret("ca").await.unwrap().unwrap().public, got[0]);
    }
}
