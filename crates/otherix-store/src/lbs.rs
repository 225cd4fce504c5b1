//! Load balancers and backend health verdicts.

use std::collections::HashSet;

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

/// LBs per multi-row INSERT: 11 arguments each stays below SQLite's
/// oldest limit on the arguments of one statement (999).
const ROWS_PER_INSERT: usize = 80;

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

    /// Creates each LB of `lbs` that is not refused (a name taken, in the
    /// store or earlier in `lbs`), in one transaction: one answer per LB,
    /// in order, each what [`Store::create_lb`] would have answered. An
    /// error of the store itself fails the whole group, and nothing is
    /// written. Concurrent LB creates share it (group commit).
    pub async fn create_lbs_each(
        &self,
        lbs: &[LbRecord],
    ) -> Result<Vec<Result<LbRecord, StoreError>>, StoreError> {
        let mut tx = self.begin_write().await?;
        let mut taken: HashSet<String> = HashSet::new();
        for chunk in lbs.chunks(ROWS_PER_INSERT) {
            let sql = format!(
                "SELECT name FROM load_balancers WHERE name IN ({})",
                crate::vm_batch::placeholders(1, chunk.len())
            );
            let mut q = sqlx::query_scalar::<_, String>(&sql);
            for lb in chunk {
                q = q.bind(&lb.name);
            }
            taken.extend(q.fetch_all(&mut *tx).await?);
        }
        let mut answers = Vec::with_capacity(lbs.len());
        let mut fresh = Vec::with_capacity(lbs.len());
        for lb in lbs {
            // `taken` holds the earlier ones of the group too.
            if !taken.insert(lb.name.clone()) {
                answers.push(Err(StoreError::AlreadyExists {
                    kind: "load balancer",
                    name: lb.name.clone(),
                }));
                continue;
            }
            // As read back: times are kept to the millisecond.
            let stored = LbRecord {
                created_at: from_millis(to_millis(lb.created_at)),
                ..lb.clone()
            };
            fresh.push(stored.clone());
            answers.push(Ok(stored));
        }
        for chunk in fresh.chunks(ROWS_PER_INSERT) {
            let rows: Vec<String> = (0..chunk.len())
                .map(|i| format!("({})", crate::vm_batch::placeholders(i * 11 + 1, 11)))
                .collect();
            let sql = format!(
                "INSERT INTO load_balancers (name, port, selector, health_kind, health_path, health_port,
                 interval_ms, timeout_ms, rise, fall, created_at) VALUES {}",
                rows.join(", ")
            );
            let mut q = sqlx::query(&sql);
            for lb in chunk {
                q = q
                    .bind(lb.name.clone())
                    .bind(i64::from(lb.port))
                    .bind(lb.selector.clone())
                    .bind(lb.health_kind.as_str())
                    .bind(lb.health_path.clone())
                    .bind(lb.health_port.map(i64::from))
                    .bind(lb.interval_ms as i64)
                    .bind(lb.timeout_ms as i64)
                    .bind(i64::from(lb.rise))
                    .bind(i64::from(lb.fall))
                    .bind(to_millis(lb.created_at));
            }
            q.execute(&mut *tx).await?;
        }
        if !fresh.is_empty() {
            tx.commit().await?;
        }
        Ok(answers)
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

    pub async fn verdicts(&self) -> Result<Vec<VerdictRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM health_verdicts")
            .fetch_all(&self.read)
            .await?;
        Ok(rows.iter().map(verdict_from_row).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{lb, on_both, TestStore};

    on_both! {
        async fn a_report_of_many_verdicts_is_written_whole_its_last_word_on_one_listed_twice_and_none_on_a_deleted_lb(store) {
            let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
            store.create_lb(&lb("web", 80, now)).await.unwrap();
            let verdict = |lb: &str, vm: String, health: Health, reason: Option<&str>| VerdictRecord {
                lb: lb.into(),
                vm_id: vm,
                node: "n1".into(),
                health,
                probed_at: now,
                changed_at: reason.map(|_| now),
                reason: reason.map(String::from),
                successes: 3,
                failures: 1,
            };
            // Past one statement's worth: two statements in a transaction.
            let mut report: Vec<VerdictRecord> = (0..102)
                .map(|i| verdict("web", format!("id-{i}"), Health::Healthy, None))
                .collect();
            report.push(verdict("gone", "id-0".into(), Health::Healthy, None));
            report.push(verdict("web", "id-1".into(), Health::Unhealthy, Some("connection refused")));
            crate::testing::record_verdicts(&store, &report).await.unwrap();
            let mut stored = store.verdicts().await.unwrap();
            stored.sort_by(|a, b| a.vm_id.cmp(&b.vm_id));
            assert_eq!(stored.len(), 102, "none on the deleted LB");
            let id1 = stored.iter().find(|v| v.vm_id == "id-1").unwrap();
            assert_eq!(id1, &verdict("web", "id-1".into(), Health::Unhealthy, Some("connection refused")));
            let id0 = stored.iter().find(|v| v.vm_id == "id-0").unwrap();
            assert_eq!(id0, &verdict("web", "id-0".into(), Health::Healthy, None));
            // A few, in one statement, over what is there.
            crate::testing::record_verdicts(
                &store,
                &[
                    verdict("web", "id-1".into(), Health::Healthy, None),
                    verdict("web", "id-new".into(), Health::Unhealthy, Some("timeout")),
                ],
            )
            .await
                .unwrap();
            let stored = store.verdicts().await.unwrap();
            assert_eq!(stored.len(), 103);
            let find = |id: &str| stored.iter().find(|v| v.vm_id == id).unwrap().clone();
            assert_eq!(find("id-1"), verdict("web", "id-1".into(), Health::Healthy, None));
            assert_eq!(find("id-new"), verdict("web", "id-new".into(), Health::Unhealthy, Some("timeout")));
        }
    }

    on_both! {
        async fn grouped_lb_creates_refuse_only_the_taken_names_and_answer_what_is_read_back(store) {
            let now = OffsetDateTime::from_unix_timestamp_nanos(1_800_000_000_123_456_789).unwrap();
            store.create_lb(&lb("old", 80, now)).await.unwrap();
            // More than one INSERT's worth, a name already stored, and a
            // name twice in the group (the first one wins).
            let mut group: Vec<LbRecord> = (0..ROWS_PER_INSERT + 5)
                .map(|i| lb(&format!("lb{i}"), 1000 + i as u16, now))
                .collect();
            group.insert(3, lb("old", 81, now));
            group.push(lb("lb1", 82, now));
            let answers = store.create_lbs_each(&group).await.unwrap();
            assert_eq!(answers.len(), group.len());
            for (i, (asked, answer)) in group.iter().zip(&answers).enumerate() {
                let refused = i == 3 || i == group.len() - 1;
                match answer {
                    Err(StoreError::AlreadyExists { name, .. }) if refused => assert_eq!(name, &asked.name),
                    Ok(created) if !refused => {
                        assert_eq!(created, &store.lb(&asked.name).await.unwrap(), "answered as read back");
                        assert_eq!(created.port, asked.port);
                    }
                    other => panic!("{i}: {other:?}"),
                }
            }
            assert_eq!(store.lb("old").await.unwrap().port, 80, "the stored one stays");
            assert_eq!(store.lb("lb1").await.unwrap().port, 1001, "the first of the group wins");
            assert_eq!(store.lbs().await.unwrap().len(), ROWS_PER_INSERT + 5 + 1);

            // All refused: nothing written, no error.
            let answers = store.create_lbs_each(&[lb("old", 83, now)]).await.unwrap();
            assert!(matches!(answers[..], [Err(StoreError::AlreadyExists { .. })]), "{answers:?}");
        }
    }
}
