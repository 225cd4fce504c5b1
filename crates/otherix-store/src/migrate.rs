//! Versioned schema migrations, applied in order, each in its own transaction.

use sqlx::SqlitePool;

use crate::StoreError;

/// (version, description, SQL). Append only: never edit a released migration.
const MIGRATIONS: &[(i64, &str, &str)] = &[
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
];

pub(crate) async fn run(pool: &SqlitePool) -> Result<(), StoreError> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
            version     INTEGER PRIMARY KEY,
            description TEXT NOT NULL,
            applied_at  INTEGER NOT NULL
        )",
    )
    .execute(pool)
    .await?;
    let current: i64 = sqlx::query_scalar("SELECT COALESCE(MAX(version), 0) FROM schema_migrations")
        .fetch_one(pool)
        .await?;
    let known = MIGRATIONS.last().map(|m| m.0).unwrap_or(0);
    if current > known {
        return Err(StoreError::TooNew {
            found: current,
            known,
        });
    }
    let applied: Vec<i64> = sqlx::query_scalar("SELECT version FROM schema_migrations")
        .fetch_all(pool)
        .await?;
    // By presence, not by `> current`: a database that got a later version
    // first (two changes developed side by side) still gets the earlier one.
    for (version, description, sql) in MIGRATIONS.iter().filter(|m| !applied.contains(&m.0)) {
        let mut tx = pool.begin().await?;
        sqlx::raw_sql(sql).execute(&mut *tx).await?;
        sqlx::query("INSERT INTO schema_migrations (version, description, applied_at) VALUES (?, ?, ?)")
            .bind(version)
            .bind(description)
            .bind(crate::to_millis(time::OffsetDateTime::now_utc()))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        tracing::info!(version, description, "applied store migration");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_migration_file_is_listed_once_in_order() {
        // Versions increase; a gap is a version another branch holds.
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".sql"))
            .collect();
        files.sort();
        assert_eq!(
            files.len(),
            MIGRATIONS.len(),
            "a migration file is not listed: {files:?}"
        );
        for (i, (version, _, _)) in MIGRATIONS.iter().enumerate() {
            if i > 0 {
                assert!(*version > MIGRATIONS[i - 1].0, "versions increase");
            }
            assert!(
                files[i].starts_with(&format!("{:04}_", version)),
                "{} is version {version}",
                files[i]
            );
        }
    }
}
