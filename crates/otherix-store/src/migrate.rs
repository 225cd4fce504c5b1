//! Versioned schema migrations, one set per dialect, applied in order.
//! Every pending migration is applied in one transaction; on PostgreSQL
//! under an advisory lock, so replicas started together migrate once.

use sqlx::AnyConnection;
use sqlx::Connection;

use crate::{Dialect, StoreError};

/// The advisory lock PostgreSQL migrations run under ("migrate").
const MIGRATE_LOCK: i64 = 0x6d_6967_7261_7465;

/// PostgreSQL's set. Append only, like SQLite's; a change to the schema is a
/// migration in each set.
const POSTGRES: &[(i64, &str, &str)] = &[
    (
        1,
        "schema as of sqlite 17",
        include_str!("../migrations/postgres/0001_schema.sql"),
    ),
    (
        2,
        "replicas",
        include_str!("../migrations/postgres/0002_replicas.sql"),
    ),
    (
        3,
        "liveness",
        include_str!("../migrations/postgres/0003_liveness.sql"),
    ),
    (
        4,
        "grant vm ids",
        include_str!("../migrations/postgres/0004_grant_vm_ids.sql"),
    ),
    (
        5,
        "session key signs from",
        include_str!("../migrations/postgres/0005_session_key_signs.sql"),
    ),
    (
        6,
        "rate usage shared between replicas",
        include_str!("../migrations/postgres/0006_rate_usage.sql"),
    ),
    (
        7,
        "vm machine",
        include_str!("../migrations/postgres/0007_vm_machine.sql"),
    ),
    (
        8,
        "token expiry",
        include_str!("../migrations/postgres/0008_token_expiry.sql"),
    ),
    (
        9,
        "relay resume",
        include_str!("../migrations/postgres/0009_relay_resume.sql"),
    ),
    (
        10,
        "session bytes, one-session revocations",
        include_str!("../migrations/postgres/0010_session_bytes.sql"),
    ),
    (
        11,
        "leases by owner from the index alone",
        include_str!("../migrations/postgres/0011_leases_owner_covering.sql"),
    ),
    (
        12,
        "the leg carrying a resumable session",
        include_str!("../migrations/postgres/0012_relay_resume_legs.sql"),
    ),
];

/// (version, description, SQL). Append only: never edit a released migration.
const SQLITE: &[(i64, &str, &str)] = &[
    (1, "initial", include_str!("../migrations/0001_initial.sql")),
    (2, "nodes", include_str!("../migrations/0002_nodes.sql")),
    (3, "sessions", include_str!("../migrations/0003_sessions.sql")),
    (4, "grants", include_str!("../migrations/0004_grants.sql")),
    (5, "lbs", include_str!("../migrations/0005_load_balancers.sql")),
    (6, "relay", include_str!("../migrations/0006_node_relay.sql")),
    (7, "audit", include_str!("../migrations/0007_audit_sessions.sql")),
    (8, "drain", include_str!("../migrations/0008_node_sessions.sql")),
    (9, "migration", include_str!("../migrations/0009_migration.sql")),
    (
        10,
        "open sessions",
        include_str!("../migrations/0010_open_sessions.sql"),
    ),
    (
        11,
        "bridge nodes",
        include_str!("../migrations/0011_bridge_nodes.sql"),
    ),
    (
        12,
        "node trust",
        include_str!("../migrations/0012_node_trust.sql"),
    ),
    (
        13,
        "audit paging",
        include_str!("../migrations/0013_audit_paging.sql"),
    ),
    (
        14,
        "used tickets",
        include_str!("../migrations/0014_used_tickets.sql"),
    ),
    (
        15,
        "revocations",
        include_str!("../migrations/0015_revocations.sql"),
    ),
    (16, "changes", include_str!("../migrations/0016_changes.sql")),
    (
        17,
        "lease lookups",
        include_str!("../migrations/0017_lease_lookups.sql"),
    ),
    (18, "replicas", include_str!("../migrations/0018_replicas.sql")),
    (19, "liveness", include_str!("../migrations/0019_liveness.sql")),
    (
        20,
        "grant vm ids",
        include_str!("../migrations/0020_grant_vm_ids.sql"),
    ),
    (
        21,
        "session key signs from",
        include_str!("../migrations/0021_session_key_signs.sql"),
    ),
    (
        22,
        "vm machine",
        include_str!("../migrations/0022_vm_machine.sql"),
    ),
    (
        23,
        "token expiry",
        include_str!("../migrations/0023_token_expiry.sql"),
    ),
    (
        24,
        "relay resume",
        include_str!("../migrations/0024_relay_resume.sql"),
    ),
    (
        25,
        "session bytes, one-session revocations",
        include_str!("../migrations/0025_session_bytes.sql"),
    ),
    (
        26,
        "leases by owner from the index alone",
        include_str!("../migrations/0026_leases_owner_covering.sql"),
    ),
    (
        27,
        "the leg carrying a resumable session",
        include_str!("../migrations/0027_relay_resume_legs.sql"),
    ),
];

pub(crate) async fn run(conn: &mut AnyConnection, dialect: Dialect) -> Result<(), StoreError> {
    let (set, columns) = match dialect {
        Dialect::Sqlite => (
            SQLITE,
            "version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_at INTEGER NOT NULL",
        ),
        Dialect::Postgres => (
            POSTGRES,
            "version BIGINT PRIMARY KEY, description TEXT NOT NULL, applied_at BIGINT NOT NULL",
        ),
    };
    // Every pending migration in one transaction (DDL is transactional in
    // both): a failed one leaves the schema as it was.
    let mut tx = conn.begin().await?;
    if dialect == Dialect::Postgres {
        // "already exists, skipping" is no news worth a log line.
        sqlx::raw_sql("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await?;
    }
    sqlx::raw_sql(&format!(
        "CREATE TABLE IF NOT EXISTS schema_migrations ({columns})"
    ))
    .execute(&mut *tx)
    .await?;
    let current: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        .fetch_one(&mut *tx)
        .await?;
    let known = set.last().map(|m| m.0).unwrap_or(0);
    if current > known {
        return Err(StoreError::TooNew {
            found: current,
            known,
        });
    }
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM schema_migrations")
        .fetch_all(&mut *tx)
        .await?;
    // By presence, not by `> current`: a database that got a later version
    // first (two changes developed side by side) still gets the earlier one.
    for (version, description, sql) in set.iter().filter(|m| !applied.contains(&m.0)) {
        sqlx::raw_sql(sql).execute(&mut *tx).await?;
        sqlx::query("INSERT INTO schema_migrations (version, description, applied_at) VALUES ($1, $2, $3)")
            .bind(version)
            .bind(description)
            .bind(crate::to_millis(time::OffsetDateTime::now_utc()))
            .execute(&mut *tx)
            .await?;
        tracing::debug!(version, description, ?dialect, "applied store migration");
    }
    tx.commit().await?;
    // One line for the whole step, after it committed, not one per
    // migration: a first start makes every table, and a daemon's terminal
    // (or the CLI's, under `-v`) is no place for two dozen lines of it.
    let pending = set.iter().filter(|m| !applied.contains(&m.0)).count();
    if pending > 0 {
        tracing::info!(
            from = current,
            to = known,
            applied = pending,
            ?dialect,
            "store schema migrated"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_listed_once_in_order() {
        listed_in_order(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"), SQLITE);
        listed_in_order(
            concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/postgres"),
            POSTGRES,
        );
    }

    fn listed_in_order(dir: &str, set: &[(i64, &str, &str)]) {
        // Versions increase; a gap is a version another branch holds.
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        assert_eq!(
            files.len(),
            set.len(),
            "a migration file is not listed: {files:?}"
        );
        for (i, (version, _, _)) in set.iter().enumerate() {
            if i > 0 {
                assert!(*version > set[i - 1].0, "versions increase");
            }
            assert!(
                files[i].starts_with(&format!("{:04}_", version)),
                "{} is version {version}",
                files[i]
            );
        }
    }
}
