//! Persistence for the control plane: an embedded SQLite database (WAL) with
//! versioned migrations applied at start.
//!
//! SQLite allows one writer at a time. Writes go through a pool of exactly one
//! connection, so transactions never race for the write lock (a deferred
//! transaction that must upgrade to a writer fails immediately under
//! contention, which no busy timeout can fix); reads use a separate pool and,
//! thanks to WAL, never wait for writers.

mod audit;
mod changes;
mod error;
mod grants;
mod lbs;
mod migrate;
mod networks;
mod nodes;
mod revocations;
mod sessions;
mod users;
mod vms;

use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::SqlitePool;
use time::OffsetDateTime;

pub use audit::{AuditEvent, AuditFilter, SessionKeyRecord};
pub use changes::{Change, ChangeKind, NodeCertRecord};
pub use error::StoreError;
pub use grants::{GrantRecord, GrantUse, NewGrant};
pub use lbs::{LbRecord, VerdictRecord};
pub use networks::NewNetwork;
pub use nodes::{Enrolled, HeartbeatRecord, JoinTokenRecord, NodeGrant, NodeLease, NodeRecord, SUPERSEDED};
pub use revocations::Revoking;
pub use sessions::Carrier;
pub use users::TokenRecord;
pub use vms::NewVm;

/// Handle to the store. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    write: SqlitePool,
    read: SqlitePool,
}

impl Store {
    /// Opens (creating if needed) the database at `path` and migrates it.
    pub async fn open(path: &Path) -> Result<Store, StoreError> {
        let base = SqliteConnectOptions::new()
            .filename(path)
            .journal_mode(SqliteJournalMode::Wal)
            // NORMAL under WAL survives a killed process (kill -9) with every
            // committed transaction; only a power loss may drop the newest.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(30));
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(base.clone().create_if_missing(true))
            .await?;
        migrate::run(&write).await?;
        let read = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(base.read_only(true))
            .await?;
        Ok(Store { write, read })
    }

    /// An in-memory store for unit tests of code above the store.
    pub async fn open_in_memory() -> Result<Store, StoreError> {
        let opts = SqliteConnectOptions::from_str("sqlite::memory:")?.foreign_keys(true);
        // One shared connection: each in-memory connection is its own database.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(opts)
            .await?;
        migrate::run(&pool).await?;
        Ok(Store {
            write: pool.clone(),
            read: pool,
        })
    }

    /// Closes both pools, waiting for in-flight statements.
    /// Whether the store answers a query (readiness).
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.read).await?;
        Ok(())
    }

    pub async fn close(&self) {
        self.write.close().await;
        self.read.close().await;
    }

    /// Reads a metadata value.
    pub async fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        Ok(sqlx::query_scalar("SELECT value FROM meta WHERE key = ?")
            .bind(key)
            .fetch_optional(&self.read)
            .await?)
    }

    /// Sets `key` to `value` unless it is already set; returns the stored value.
    pub async fn meta_init(&self, key: &str, value: &str) -> Result<String, StoreError> {
        sqlx::query("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO NOTHING")
            .bind(key)
            .bind(value)
            .execute(&self.write)
            .await?;
        Ok(sqlx::query_scalar("SELECT value FROM meta WHERE key = ?")
            .bind(key)
            .fetch_one(&self.write)
            .await?)
    }
}

pub(crate) fn to_millis(t: OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

pub(crate) fn from_millis(ms: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000).unwrap_or(OffsetDateTime::UNIX_EPOCH)
}
