//! External grants: hashed bearer tokens for a fixed list of targets, with an
//! expiry, an optional connection cap and revocation.

use otherix_proto::GrantTarget;
use sqlx::any::AnyRow;
use sqlx::Row;
use time::OffsetDateTime;

use crate::error::is_unique_violation;
use crate::revocations::{self, Revoking};
use crate::{from_millis, to_millis, Store, StoreError};

#[derive(Debug, Clone)]
pub struct NewGrant {
    pub id: String,
    pub name: String,
    pub targets: Vec<GrantTarget>,
    pub created_by: String,
    pub expires_at: OffsetDateTime,
    pub max_connections: Option<u32>,
}

#[derive(Clone)]
pub struct GrantRecord {
    pub id: String,
    pub name: String,
    pub secret_hash: Vec<u8>,
    pub targets: Vec<GrantTarget>,
    pub created_by: String,
    pub created_at: OffsetDateTime,
    pub expires_at: OffsetDateTime,
    pub max_connections: Option<u32>,
    pub connections: u32,
    pub last_used_at: Option<OffsetDateTime>,
    pub revoked_at: Option<OffsetDateTime>,
}

impl std::fmt::Debug for GrantRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrantRecord")
            .field("id", &self.id)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Why a grant could not be used for one more connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantUse {
    Counted,
    Revoked,
    Expired,
    CapReached,
}

fn grant_from_row(r: &AnyRow) -> Result<GrantRecord, StoreError> {
    let targets: String = r.get("targets");
    Ok(GrantRecord {
        id: r.get("id"),
        name: r.get("name"),
        secret_hash: r.get("secret_hash"),
        targets: serde_json::from_str(&targets)
            .map_err(|e| StoreError::Corrupt(format!("grant targets: {e}")))?,
        created_by: r.get("created_by"),
        created_at: from_millis(r.get("created_at")),
        expires_at: from_millis(r.get("expires_at")),
        max_connections: r.get::<Option<i64>, _>("max_connections").map(|v| v as u32),
        connections: r.get::<i64, _>("connections") as u32,
        last_used_at: r.get::<Option<i64>, _>("last_used_at").map(from_millis),
        revoked_at: r.get::<Option<i64>, _>("revoked_at").map(from_millis),
    })
}

impl Store {
    pub async fn create_grant(
        &self,
        new: &NewGrant,
        secret_hash: &[u8],
        now: OffsetDateTime,
    ) -> Result<GrantRecord, StoreError> {
        let targets = serde_json::to_string(&new.targets).map_err(|e| StoreError::Invalid(e.to_string()))?;
        let res = self.exec(sqlx::query(
            "INSERT INTO grants (id, name, secret_hash, targets, created_by, created_at, expires_at, max_connections)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        )
        .bind(&new.id)
        .bind(&new.name)
        .bind(secret_hash)
        .bind(targets)
        .bind(&new.created_by)
        .bind(to_millis(now))
        .bind(to_millis(new.expires_at))
        .bind(new.max_connections.map(i64::from))
        )
        .await;
        match res {
            Err(e) if is_unique_violation(&e) => Err(StoreError::AlreadyExists {
                kind: "grant",
                name: new.name.clone(),
            }),
            Err(e) => Err(e),
            Ok(_) => self.grant(&new.name).await,
        }
    }

    pub async fn grant(&self, name: &str) -> Result<GrantRecord, StoreError> {
        let row = sqlx::query("SELECT * FROM grants WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.read)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: "grant",
                name: name.into(),
            })?;
        grant_from_row(&row)
    }

    pub async fn grant_by_id(&self, id: &str) -> Result<Option<GrantRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM grants WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *self.write.conn().await?)
            .await?;
        row.as_ref().map(grant_from_row).transpose()
    }

    pub async fn grants(&self) -> Result<Vec<GrantRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM grants ORDER BY name")
            .fetch_all(&self.read)
            .await?;
        rows.iter().map(grant_from_row).collect()
    }

    /// Marks the grant revoked (once: a second revoke keeps the first time)
    /// and records `revoking`.
    pub async fn revoke_grant(
        &self,
        name: &str,
        now: OffsetDateTime,
        revoking: Revoking<'_>,
    ) -> Result<GrantRecord, StoreError> {
        let mut tx = self.begin_write().await?;
        let res = sqlx::query("UPDATE grants SET revoked_at = COALESCE(revoked_at, $1) WHERE name = $2")
            .bind(to_millis(now))
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "grant",
                name: name.into(),
            });
        }
        revocations::insert(&mut tx, revoking).await?;
        tx.commit().await?;
        self.grant(name).await
    }

    /// Counts one connection against the grant, atomically with the checks
    /// (revoked, expired, cap), so concurrent brokers never exceed the cap.
    pub async fn use_grant(&self, id: &str, now: OffsetDateTime) -> Result<GrantUse, StoreError> {
        let res = self
            .exec(
                sqlx::query(
                    "UPDATE grants SET connections = connections + 1, last_used_at = $1
             WHERE id = $2 AND revoked_at IS NULL AND expires_at > $3
               AND (max_connections IS NULL OR connections < max_connections)",
                )
                .bind(to_millis(now))
                .bind(id)
                .bind(to_millis(now)),
            )
            .await?;
        if res.rows_affected() == 1 {
            return Ok(GrantUse::Counted);
        }
        let g = self.grant_by_id(id).await?.ok_or_else(|| StoreError::NotFound {
            kind: "grant",
            name: id.into(),
        })?;
        Ok(if g.revoked_at.is_some() {
            GrantUse::Revoked
        } else if g.expires_at <= now {
            GrantUse::Expired
        } else {
            GrantUse::CapReached
        })
    }

    /// Deletes audit events older than `before`.
    pub async fn prune_audit(&self, before: OffsetDateTime) -> Result<u64, StoreError> {
        let res = self
            .exec(sqlx::query("DELETE FROM audit_events WHERE at < $1").bind(to_millis(before)))
            .await?;
        Ok(res.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use otherix_core::mac::MacAddr;
    use otherix_proto::NetworkType;

    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{on_both, TestStore};
    use crate::{Dialect, NewNetwork, NewVm};

    fn target(target: &str, port: u16, vm_id: Option<&str>) -> GrantTarget {
        GrantTarget {
            target: target.into(),
            port,
            vm_id: vm_id.map(str::to_string),
        }
    }

    on_both! {
        /// A grant stored before grants were bound to VM ids is bound, when
        /// the store is upgraded, to the VM that holds each name then; a
        /// target whose VM is gone stays unbound (the broker refuses it).
        async fn grants_from_before_the_binding_are_bound_to_the_vm_named_at_the_upgrade(store) {
            let now = OffsetDateTime::now_utc();
            store
                .create_network(
                    &NewNetwork {
                        name: "ov".into(),
                        id: "id-ov".into(),
                        kind: NetworkType::Overlay,
                        subnet: "10.9.0.0/24".parse().unwrap(),
                        nodes: vec![],
                    },
                    now,
                )
                .await
                .unwrap();
            let web = store
                .create_vm(
                    &NewVm {
                        machine: None,
                        name: "web01".into(),
                        id: "id-web01".into(),
                        network: "ov".into(),
                        node: None,
                        labels: BTreeMap::new(),
                        exec: None,
                    },
                    || MacAddr([2, 0, 0, 0, 0, 1]),
                    now,
                )
                .await
                .unwrap();
            // As a control plane before the binding wrote it: names only.
            let old = r#"[{"target":"gone01","port":22},{"target":"lb/web","port":80},{"target":"web01","port":443}]"#;
            let pinned = serde_json::to_string(&[target("web01", 22, Some("id-earlier"))]).unwrap();
            for (id, name, targets) in [("g1", "old", old), ("g2", "pinned", pinned.as_str())] {
                store
                    .exec(
                        sqlx::query(
                            "INSERT INTO grants (id, name, secret_hash, targets, created_by, created_at, expires_at)
                             VALUES ($1, $2, $3, $4, 'user:admin', $5, $6)",
                        )
                        .bind(id)
                        .bind(name)
                        .bind(vec![0u8; 32])
                        .bind(targets)
                        .bind(to_millis(now))
                        .bind(to_millis(now + time::Duration::hours(1))),
                    )
                    .await
                    .unwrap();
            }
            // The upgrade: the binding's migration runs again over them.
            let version = match store.dialect() {
                Dialect::Sqlite => 20,
                Dialect::Postgres => 4,
            };
            store
                .exec(sqlx::query("DELETE FROM schema_migrations WHERE version = $1").bind(version))
                .await
                .unwrap();
            crate::migrate::run(&mut store.write.conn().await.unwrap(), store.dialect()).await.unwrap();

            let mut got = store.grant("old").await.unwrap().targets;
            got.sort_by(|a, b| a.target.cmp(&b.target));
            assert_eq!(
                got,
                vec![
                    target("gone01", 22, None),
                    target("lb/web", 80, None),
                    target("web01", 443, Some(&web.id)),
                ]
            );
            // A target already bound keeps its id.
            assert_eq!(
                store.grant("pinned").await.unwrap().targets,
                vec![target("web01", 22, Some("id-earlier"))]
            );
        }
    }
}
