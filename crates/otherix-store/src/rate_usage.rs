//! Rate-limit usage shared between control-plane replicas (PostgreSQL
//! only: on SQLite there is one control plane). Each replica publishes what
//! its limits charged since its last exchange and reads what the others
//! published since then; it charges that to its own buckets, so a principal
//! spreading calls over N replicas gets the configured rate, not N times
//! it. Insert-only rows, read by id; old rows are pruned.

use sqlx::Row;
use time::OffsetDateTime;

use crate::{to_millis, Dialect, Store, StoreError};

/// What one replica's limit of `kind` charged `principal`: `n` calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateUsage {
    pub kind: String,
    pub principal: String,
    pub n: u64,
}

/// Rows older than this are pruned (a replica exchanges every fraction of
/// a second; one that fell further behind starts from what is left).
const KEEP_MS: i64 = 10_000;

impl Store {
    /// Publishes `used` as replica `replica`'s, and returns what the other
    /// replicas published after row `after` (`None` on the first exchange:
    /// nothing, older usage is spent), with the row to pass next time. Does not take the store's write lock: the
    /// rows are independent.
    pub async fn exchange_rate_usage(
        &self,
        replica: &str,
        used: &[RateUsage],
        after: Option<i64>,
        now: OffsetDateTime,
    ) -> Result<(Vec<RateUsage>, Option<i64>), StoreError> {
        if self.dialect == Dialect::Sqlite {
            return Ok((Vec::new(), after));
        }
        let at = to_millis(now);
        if !used.is_empty() {
            // Without the writers' advisory lock: rows of its own, checked against nothing.
            let mut tx = crate::Tx::begin(self.write.conn().await?, None).await?;
            for u in used {
                sqlx::query(
                    "INSERT INTO rate_usage (replica, kind, principal, n, at) VALUES ($1, $2, $3, $4, $5)",
                )
                .bind(replica)
                .bind(&u.kind)
                .bind(&u.principal)
                .bind(i64::try_from(u.n).unwrap_or(i64::MAX))
                .bind(at)
                .execute(&mut *tx)
                .await?;
            }
            tx.commit().await?;
        }
        let Some(after) = after else {
            // The first exchange starts from now: older usage is spent.
            let max: Option<i64> = sqlx::query_scalar("SELECT MAX(id) FROM rate_usage")
                .fetch_one(&self.read)
                .await?;
            return Ok((Vec::new(), Some(max.unwrap_or(0))));
        };
        let rows = {
            sqlx::query(
                "SELECT id, kind, principal, n FROM rate_usage
                 WHERE id > $1 AND replica <> $2 AND at > $3 ORDER BY id",
            )
            .bind(after)
            .bind(replica)
            .bind(at - KEEP_MS)
            .fetch_all(&self.read)
            .await?
        };
        let mut last = after;
        let mut theirs = Vec::with_capacity(rows.len());
        for r in &rows {
            last = last.max(r.get::<i64, _>("id"));
            theirs.push(RateUsage {
                kind: r.get("kind"),
                principal: r.get("principal"),
                n: r.get::<i64, _>("n").max(0) as u64,
            });
        }
        Ok((theirs, Some(last)))
    }

    /// Forgets usage older than every replica still reads.
    pub async fn prune_rate_usage(&self, now: OffsetDateTime) -> Result<u64, StoreError> {
        if self.dialect == Dialect::Sqlite {
            return Ok(0);
        }
        let done = sqlx::query("DELETE FROM rate_usage WHERE at < $1")
            .bind(to_millis(now) - KEEP_MS)
            .execute(&mut *self.write.conn().await?)
            .await?;
        Ok(done.rows_affected())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::on_both;

    fn usage(kind: &str, principal: &str, n: u64) -> RateUsage {
        RateUsage {
            kind: kind.into(),
            principal: principal.into(),
            n,
        }
    }

    on_both! {
        async fn each_replica_reads_what_the_others_charged_once(store) {
            let now = OffsetDateTime::now_utc();
            let (none, a_at) = store.exchange_rate_usage("a", &[], None, now).await.unwrap();
            assert!(none.is_empty());
            let (_, b_at) = store.exchange_rate_usage("b", &[], None, now).await.unwrap();
            store
                .exchange_rate_usage("a", &[usage("broker", "user:u", 7)], a_at, now)
                .await
                .unwrap();
            let (theirs, b_at) = store
                .exchange_rate_usage("b", &[usage("broker", "user:v", 2)], b_at, now)
                .await
                .unwrap();
            let (again, _) = store.exchange_rate_usage("b", &[], b_at, now).await.unwrap();
            let (mine, _) = store.exchange_rate_usage("a", &[], a_at, now).await.unwrap();
            if store.dialect() == Dialect::Postgres {
                assert_eq!(theirs, [usage("broker", "user:u", 7)]);
                assert!(again.is_empty(), "read once");
                assert_eq!(mine, [usage("broker", "user:v", 2)], "a's own usage is not charged back");
                store.prune_rate_usage(now + time::Duration::seconds(11)).await.unwrap();
                let (gone, _) = store.exchange_rate_usage("a", &[], a_at, now + time::Duration::seconds(11)).await.unwrap();
                assert!(gone.is_empty());
            } else {
                assert!(theirs.is_empty() && mine.is_empty(), "one control plane on SQLite");
            }
        }
    }
}
