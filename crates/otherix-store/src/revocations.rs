//! Revocations: access taken away, kept until every credential they cover
//! has expired. Written in the transaction of the change that takes the
//! access away (grant revoked, token revoked, user deleted, rule removed),
//! so neither can happen without the other.

use otherix_proto::agent::Revocation;
use sqlx::{AnyConnection, Row};
use time::OffsetDateTime;

use crate::sessions::CARRIER;
use crate::{from_millis, to_millis, Store, StoreError};

/// Revocations to record with a change, kept until `keep_until` (when every
/// credential they cover has expired).
#[derive(Debug, Clone, Copy)]
pub struct Revoking<'a> {
    pub entries: &'a [Revocation],
    pub keep_until: OffsetDateTime,
}

/// Adds the revocations.
pub(crate) async fn insert(conn: &mut AnyConnection, revoking: Revoking<'_>) -> Result<(), StoreError> {
    let keep_until = revoking.keep_until;
    for r in revoking.entries {
        sqlx::query(
            "INSERT INTO revocations (principal, token, vm_id, port, session, before, keep_until)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&r.principal)
        .bind(&r.token)
        .bind(&r.vm_id)
        .bind(r.port.map(i64::from))
        .bind(&r.session)
        .bind(ceil_millis(r.before))
        .bind(to_millis(keep_until))
        .execute(&mut *conn)
        .await?;
    }
    Ok(())
}

/// `t` in whole milliseconds, rounded up: a revocation stored a little late
/// still covers every credential issued up to its instant (`iat` has
/// nanoseconds), never a little early.
fn ceil_millis(t: OffsetDateTime) -> i64 {
    let nanos = t.unix_timestamp_nanos();
    (nanos.div_euclid(1_000_000) + i128::from(nanos.rem_euclid(1_000_000) != 0)) as i64
}

impl Store {
    /// Revocations still in force at `now`, oldest first.
    pub async fn revocations(&self, now: OffsetDateTime) -> Result<Vec<Revocation>, StoreError> {
        let rows = sqlx::query(
            "SELECT principal, token, vm_id, port, session, before FROM revocations
             WHERE keep_until > $1 ORDER BY id",
        )
        .bind(to_millis(now))
        .fetch_all(&self.read)
        .await?;
        rows.iter()
            .map(|r| {
                let port: Option<i64> = r.get("port");
                Ok(Revocation {
                    principal: r.get("principal"),
                    token: r.get("token"),
                    vm_id: r.get("vm_id"),
                    port: port
                        .map(u16::try_from)
                        .transpose()
                        .map_err(|_| StoreError::Corrupt("revocation port out of range".into()))?,
                    session: r.get("session"),
                    before: from_millis(r.get("before")),
                })
            })
            .collect()
    }

    /// Replaces the entries a change recorded (`recorded`: each found by its
    /// principal and instant) with `revoking` — the same entries restamped
    /// once the change is known to be everywhere (the server's
    /// `revoke::enforce`: later when its commit took long, earlier when it
    /// did not). One transaction: the entries are never missing.
    pub async fn restamp_revocations(
        &self,
        recorded: &[Revocation],
        revoking: Revoking<'_>,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let stamped: std::collections::BTreeSet<(&str, i64)> = recorded
            .iter()
            .map(|r| (r.principal.as_str(), ceil_millis(r.before)))
            .collect();
        for (principal, before) in stamped {
            sqlx::query("DELETE FROM revocations WHERE principal = $1 AND before = $2")
                .bind(principal)
                .bind(before)
                .execute(&mut *tx)
                .await?;
        }
        insert(&mut tx, revoking).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Forgets revocations no credential they cover can outlive any more.
    pub async fn prune_revocations(&self, now: OffsetDateTime) -> Result<u64, StoreError> {
        let res = self
            .exec(sqlx::query("DELETE FROM revocations WHERE keep_until <= $1").bind(to_millis(now)))
            .await?;
        Ok(res.rows_affected())
    }

    /// Sessions `principal` has open now, by what carries them (a gateway
    /// node's name, or [`crate::RELAY_CARRIER`] for the relay).
    pub async fn open_session_count(&self, principal: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {CARRIER} AS carrier, COUNT(*) AS n FROM open_sessions WHERE principal = $1 GROUP BY carrier"
        ))
        .bind(principal)
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get("carrier"), r.get::<i64, _>("n").max(0) as u64))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use otherix_proto::Role;
    use time::Duration;

    use super::*;
    use crate::testing::on_both;

    fn whole(principal: &str, before: OffsetDateTime) -> Revocation {
        Revocation {
            principal: principal.into(),
            token: None,
            vm_id: None,
            port: None,
            session: None,
            before,
        }
    }

    on_both! {
        async fn a_one_session_revocation_keeps_its_session_and_target(store) {
            let now = OffsetDateTime::now_utc();
            let one = Revocation {
                vm_id: Some("vm1".into()),
                port: Some(22),
                session: Some("jti-1".into()),
                ..whole("user:alice", now)
            };
            store
                .restamp_revocations(
                    &[],
                    Revoking {
                        entries: std::slice::from_ref(&one),
                        keep_until: now + Duration::minutes(20),
                    },
                )
                .await
                .unwrap();
            let kept = store.revocations(now).await.unwrap();
            assert_eq!(kept, vec![Revocation { before: kept[0].before, ..one }]);
        }
    }

    on_both! {
        async fn a_revocation_is_written_with_its_change_and_kept_until_its_credentials_expire(store) {
            let now = OffsetDateTime::now_utc();
            store.create_user("alice", Role::User, now).await.unwrap();
            store.create_token("alice", "t1", &[0; 32], now, None).await.unwrap();
            let keep_until = now + Duration::minutes(20);
            let token = Revocation {
                token: Some("t1".into()),
                ..whole("user:alice", now)
            };
            store
                .revoke_token(
                    "alice",
                    "t1",
                    Revoking {
                        entries: std::slice::from_ref(&token),
                        keep_until,
                    },
                )
                .await
                .unwrap();
            // A change that fails records nothing.
            let err = store
                .revoke_token(
                    "alice",
                    "t1",
                    Revoking {
                        entries: &[whole("user:alice", now)],
                        keep_until,
                    },
                )
                .await;
            assert!(matches!(err, Err(StoreError::NotFound { .. })), "{err:?}");
            store
                .delete_user(
                    "alice",
                    Revoking {
                        entries: &[whole("user:alice", now)],
                        keep_until,
                    },
                )
                .await
                .unwrap();

            let kept = store.revocations(now).await.unwrap();
            assert_eq!(kept.len(), 2, "{kept:?}");
            assert_eq!(kept[0].token.as_deref(), Some("t1"));
            assert_eq!(kept[1], whole("user:alice", kept[1].before));
            // Stored in whole milliseconds, never before the instant it was taken.
            assert!(kept[1].before >= now && kept[1].before - now < Duration::milliseconds(1));

            assert_eq!(store.prune_revocations(now).await.unwrap(), 0);
            assert_eq!(store.revocations(keep_until).await.unwrap(), vec![]);
            assert_eq!(store.prune_revocations(keep_until).await.unwrap(), 2);
        }
    }

    #[test]
    fn instants_round_up_to_the_millisecond() {
        let t = OffsetDateTime::from_unix_timestamp_nanos(1_000_000_001).unwrap();
        assert_eq!(ceil_millis(t), 1001);
        let exact = OffsetDateTime::from_unix_timestamp_nanos(1_000_000_000).unwrap();
        assert_eq!(ceil_millis(exact), 1000);
    }
}
