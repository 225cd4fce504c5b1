//! Load balancers and backend health verdicts.

use otherix_core::lb::Health;
use otherix_proto::ProbeKind;
use sqlx::any::AnyRow;
use sqlx::Row;
use time::OffsetDateTime;

use crate::error::is_unique_violation;
use crate::{from_millis, to_millis, Store, StoreError};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LbRecord {
    pub name: String,
    pub port: u16,
    pub selector: String,
    pub health_kind: ProbeKind,
    pub health_path: Option<String>,
    pub health_port: Option<u16>,
    pub interval_ms: u64,
    pub timeout_ms: u64,
    pub rise: u32,
    pub fall: u32,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerdictRecord {
    pub lb: String,
    pub vm_id: String,
    pub node: String,
    pub health: Health,
    pub probed_at: OffsetDateTime,
    pub changed_at: Option<OffsetDateTime>,
    pub reason: Option<String>,
    pub successes: u32,
    pub failures: u32,
}

pub(crate) fn verdict_from_row(r: &AnyRow) -> VerdictRecord {
    VerdictRecord {
        lb: r.get("lb"),
        vm_id: r.get("vm_id"),
        node: r.get("node"),
        // Only the three words are ever written.
        health: Health::parse(r.get("health")).unwrap_or(Health::Unknown),
        probed_at: from_millis(r.get("probed_at")),
        changed_at: r.get::<Option<i64>, _>("changed_at").map(from_millis),
        reason: r.get("reason"),
        successes: r.get::<i64, _>("successes") as u32,
        failures: r.get::<i64, _>("failures") as u32,
    }
}

fn lb_from_row(r: &AnyRow) -> Result<LbRecord, StoreError> {
    Ok(LbRecord {
        name: r.get("name"),
        port: r.get::<i64, _>("port") as u16,
        selector: r.get("selector"),
        health_kind: r.get::<String, _>("health_kind").parse()?,
        health_path: r.get("health_path"),
        health_port: r.get::<Option<i64>, _>("health_port").map(|p| p as u16),
        interval_ms: r.get::<i64, _>("interval_ms") as u64,
        timeout_ms: r.get::<i64, _>("timeout_ms") as u64,
        rise: r.get::<i64, _>("rise") as u32,
        fall: r.get::<i64, _>("fall") as u32,
        created_at: from_millis(r.get("created_at")),
    })
}

impl Store {
    pub async fn create_lb(&self, lb: &LbRecord) -> Result<LbRecord, StoreError> {
        let res = self.exec(sqlx::query(
            "INSERT INTO load_balancers (name, port, selector, health_kind, health_path, health_port,
                 interval_ms, timeout_ms, rise, fall, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)",
        )
        .bind(&lb.name)
        .bind(i64::from(lb.port))
        .bind(&lb.selector)
        .bind(lb.health_kind.as_str())
        .bind(&lb.health_path)
        .bind(lb.health_port.map(i64::from))
        .bind(lb.interval_ms as i64)
        .bind(lb.timeout_ms as i64)
        .bind(i64::from(lb.rise))
        .bind(i64::from(lb.fall))
        .bind(to_millis(lb.created_at))
        )
        .await;
        match res {
            Err(e) if is_unique_violation(&e) => Err(StoreError::AlreadyExists {
                kind: "load balancer",
                name: lb.name.clone(),
            }),
            Err(e) => Err(e),
            Ok(_) => self.lb(&lb.name).await,
        }
    }

    /// Replaces an LB's settings (name and creation time stay).
    pub async fn update_lb(&self, lb: &LbRecord) -> Result<LbRecord, StoreError> {
        let res = self.exec(sqlx::query(
            "UPDATE load_balancers SET port = $1, selector = $2, health_kind = $3, health_path = $4, health_port = $5,
                 interval_ms = $6, timeout_ms = $7, rise = $8, fall = $9 WHERE name = $10",
        )
        .bind(i64::from(lb.port))
        .bind(&lb.selector)
        .bind(lb.health_kind.as_str())
        .bind(&lb.health_path)
        .bind(lb.health_port.map(i64::from))
        .bind(lb.interval_ms as i64)
        .bind(lb.timeout_ms as i64)
        .bind(i64::from(lb.rise))
        .bind(i64::from(lb.fall))
        .bind(&lb.name)
        )
        .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "load balancer",
                name: lb.name.clone(),
            });
        }
        self.lb(&lb.name).await
    }

    pub async fn lb(&self, name: &str) -> Result<LbRecord, StoreError> {
        let row = sqlx::query("SELECT * FROM load_balancers WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.read)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: "load balancer",
                name: name.into(),
            })?;
        lb_from_row(&row)
    }

    pub async fn lbs(&self) -> Result<Vec<LbRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM load_balancers ORDER BY name")
            .fetch_all(&self.read)
            .await?;
        rows.iter().map(lb_from_row).collect()
    }

    pub async fn delete_lb(&self, name: &str) -> Result<(), StoreError> {
        let res = self
            .exec(sqlx::query("DELETE FROM load_balancers WHERE name = $1").bind(name))
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "load balancer",
                name: name.into(),
            });
        }
        Ok(())
    }

    /// Records verdicts from `node` (one transaction for the whole report).
    pub async fn record_verdicts(&self, verdicts: &[VerdictRecord]) -> Result<(), StoreError> {
        if verdicts.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        for v in verdicts {
            sqlx::query(
                "INSERT INTO health_verdicts (lb, vm_id, node, health, probed_at, changed_at, reason, successes, failures)
                 SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9 WHERE EXISTS (SELECT 1 FROM load_balancers WHERE name = $10)
                 ON CONFLICT(lb, vm_id) DO UPDATE SET node = excluded.node, health = excluded.health,
                     probed_at = excluded.probed_at, changed_at = excluded.changed_at, reason = excluded.reason,
                     successes = excluded.successes, failures = excluded.failures",
            )
            .bind(&v.lb)
            .bind(&v.vm_id)
            .bind(&v.node)
            .bind(v.health.as_str())
            .bind(to_millis(v.probed_at))
            .bind(v.changed_at.map(to_millis))
            .bind(&v.reason)
            .bind(i64::from(v.successes))
            .bind(i64::from(v.failures))
            .bind(&v.lb)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn verdicts(&self) -> Result<Vec<VerdictRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM health_verdicts")
            .fetch_all(&self.read)
            .await?;
        Ok(rows.iter().map(verdict_from_row).collect())
    }
}
