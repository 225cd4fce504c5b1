//! Session signing keys and audit events.

use sqlx::Row;
use time::OffsetDateTime;

use otherix_proto::AuditCursor;

use crate::{from_millis, to_millis, Store, StoreError};

/// A session signing key as stored.
#[derive(Clone)]
pub struct SessionKeyRecord {
    pub kid: String,
    pub seed: Vec<u8>,
    pub public: Vec<u8>,
    pub created_at: OffsetDateTime,
    /// When it signs from; `None` on keys stored before this was recorded.
    pub signs_from: Option<OffsetDateTime>,
}

impl std::fmt::Debug for SessionKeyRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionKeyRecord")
            .field("kid", &self.kid)
            .field("created_at", &self.created_at)
            .field("signs_from", &self.signs_from)
            .finish_non_exhaustive()
    }
}

/// One audited decision: the API's record, stored as it is served.
pub type AuditEvent = otherix_proto::AuditRecord;

impl Store {
    /// Adds `key` unless a key made after `newest_before` exists — one
    /// made meanwhile by another replica whose rotation came due at the
    /// same moment. Returns whether it was added.
    pub async fn add_session_key_if_due(
        &self,
        key: &SessionKeyRecord,
        newest_before: OffsetDateTime,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_write().await?;
        let newer: Option<i64> =
            sqlx::query_scalar("SELECT created_at FROM session_keys WHERE created_at > $1 LIMIT 1")
                .bind(to_millis(newest_before))
                .fetch_optional(&mut *tx)
                .await?;
        if newer.is_some() {
            return Ok(false);
        }
        insert_session_key(&mut tx, key).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Adds `key` whatever else exists: a rotation an admin asked for.
    pub async fn add_session_key(&self, key: &SessionKeyRecord) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        insert_session_key(&mut tx, key).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Keys created after `since`, newest first.
    pub async fn session_keys_since(
        &self,
        since: OffsetDateTime,
    ) -> Result<Vec<SessionKeyRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT kid, seed, public, created_at, signs_from FROM session_keys WHERE created_at > $1 ORDER BY created_at DESC, kid",
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
                signs_from: r.get::<Option<i64>, _>("signs_from").map(from_millis),
            })
            .collect())
    }

    /// Records a relay ticket's use: `false` if it was used before (also by
    /// an earlier run of the CP, or another replica). Entries are pruned by
    /// [`Store::prune_used_tickets`] once no replica can accept the ticket.
    pub async fn use_ticket(&self, jti: &str, exp: OffsetDateTime) -> Result<bool, StoreError> {
        let res = self
            .exec(
                sqlx::query(
                    "INSERT INTO used_tickets (jti, exp) VALUES ($1, $2) ON CONFLICT(jti) DO NOTHING",
                )
                .bind(jti)
                .bind(to_millis(exp)),
            )
            .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Forgets the used tickets no verifier can accept any more at `now`
    /// (by this replica's clock): past their `exp`, the verifiers' clock
    /// skew allowance, another for this clock running ahead of theirs, and
    /// a margin ([`USED_KEPT_PAST_EXP`](otherix_core::credential::USED_KEPT_PAST_EXP)).
    /// Pruning at `exp` left a ticket replayable through a replica whose
    /// clock still accepted it, or after a restart.
    pub async fn prune_used_tickets(&self, now: OffsetDateTime) -> Result<u64, StoreError> {
        let before = otherix_core::credential::used_forgettable_before(now);
        let res = self
            .exec(sqlx::query("DELETE FROM used_tickets WHERE exp < $1").bind(to_millis(before)))
            .await?;
        Ok(res.rows_affected())
    }

    /// Drops keys that can no longer have live credentials.
    pub async fn prune_session_keys(&self, before: OffsetDateTime) -> Result<u64, StoreError> {
        let res = self
            .exec(sqlx::query("DELETE FROM session_keys WHERE created_at < $1").bind(to_millis(before)))
            .await?;
        Ok(res.rows_affected())
    }

    /// Up to [`MAX_AUDIT_BATCH`] audit records in one `INSERT` and
    /// nothing else: durable together or not at all, as a transaction
    /// would make them (a statement is atomic), without a transaction's
    /// `BEGIN` and `COMMIT` — on SQLite two more round trips to sqlx's
    /// worker thread, and inside a transaction SQLite keeps a statement
    /// journal for each multi-row `INSERT`. The batching writer's group
    /// commit: broker decisions and the like, never a session's start or
    /// end, which `start_session` and `end_session` write under the lock.
    /// Without the write lock on PostgreSQL: such a record is checked
    /// against nothing before it is written and is not in the change log,
    /// so replicas' broker records need not wait for each other's writes.
    /// One statement text for any number of records (they are its one
    /// JSON argument), so a batch is one commit whatever its size.
    pub async fn add_audit_statement(&self, events: &[AuditEvent]) -> Result<(), StoreError> {
        if events.len() > MAX_AUDIT_BATCH {
            return Err(StoreError::Invalid(format!(
                "{} audit records for one statement (at most {MAX_AUDIT_BATCH})",
                events.len()
            )));
        }
        let mut conn = self.write.conn().await?;
        crate::sessions::insert_audits(&mut conn, events).await
    }

    /// One page of the audit trail: up to `limit` events after `from`
    /// (exclusive), oldest first by when they happened (a gateway's session
    /// reports arrive after the fact), then by id. The cursor comes back
    /// when more events match. Reads the `at` index (or the principal's or
    /// target's, migration 14) from `from` on and stops after `limit + 1`
    /// rows: never the whole trail.
    pub async fn audit_page(
        &self,
        from: AuditCursor,
        filter: &AuditFilter<'_>,
        limit: u32,
    ) -> Result<(Vec<AuditEvent>, Option<AuditCursor>), StoreError> {
        let sql = page_sql(filter);
        let mut q = sqlx::query(&sql).bind(from.at_ms).bind(from.id as i64);
        if let Some(p) = filter.principal {
            q = q.bind(p);
        }
        if let Some(t) = filter.target {
            q = q.bind(t);
        }
        let rows = q.bind(i64::from(limit) + 1).fetch_all(&self.read).await?;
        let mut events: Vec<AuditEvent> = rows.iter().map(event).collect::<Result<_, _>>()?;
        let next = if events.len() > limit as usize {
            events.truncate(limit as usize);
            events.last().map(AuditCursor::after)
        } else {
            None
        };
        Ok((events, next))
    }
}

/// Most audit records one [`Store::add_audit_statement`] writes: the
/// batching writer's largest batch (its JSON argument about 100 KiB).
pub const MAX_AUDIT_BATCH: usize = 512;

/// Which events a page holds, besides its place in the trail.
#[derive(Debug, Default, Clone, Copy)]
pub struct AuditFilter<'a> {
    /// Only this principal (`user:NAME`, `grant:NAME`).
    pub principal: Option<&'a str>,
    /// Only this target.
    pub target: Option<&'a str>,
}

/// Conditions only for the filters given, so the planner can pick the
/// (principal, at) or (target, at) index; each holds the rowid (`id`) last,
/// so the order needs no sort.
fn page_sql(filter: &AuditFilter<'_>) -> String {
    let mut sql = String::from("SELECT * FROM audit_events WHERE (at, id) > ($1, $2)");
    let mut n = 3;
    if filter.principal.is_some() {
        sql.push_str(&format!(" AND principal = ${n}"));
        n += 1;
    }
    if filter.target.is_some() {
        sql.push_str(&format!(" AND target = ${n}"));
        n += 1;
    }
    sql.push_str(&format!(" ORDER BY at, id LIMIT ${n}"));
    sql
}

fn event(r: &sqlx::any::AnyRow) -> Result<AuditEvent, StoreError> {
    Ok(AuditEvent {
        id: r.get::<i64, _>("id") as u64,
        at: from_millis(r.get("at")),
        principal: r.get("principal"),
        action: r.get::<String, _>("action").parse()?,
        target: r.get("target"),
        port: r.get::<Option<i64>, _>("port").map(|p| p as u16),
        transport: r
            .get::<Option<String>, _>("transport")
            .map(|t| t.parse())
            .transpose()?,
        node: r.get("node"),
        allowed: r.get::<i64, _>("allowed") != 0,
        reason: r.get("reason"),
        bytes_up: r.get::<Option<i64>, _>("bytes_up").map(|b| b as u64),
        bytes_down: r.get::<Option<i64>, _>("bytes_down").map(|b| b as u64),
        duration_ms: r.get::<Option<i64>, _>("duration_ms").map(|b| b as u64),
        session: r.get("session"),
    })
}

/// Inserts a key row (the change log trigger tells every replica).
async fn insert_session_key(
    conn: &mut sqlx::AnyConnection,
    key: &SessionKeyRecord,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO session_keys (kid, seed, public, created_at, signs_from) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(&key.kid)
    .bind(&key.seed)
    .bind(&key.public)
    .bind(to_millis(key.created_at))
    .bind(key.signs_from.map(to_millis))
    .execute(conn)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{on_both, TestStore};
    use time::Duration;

    fn record(at: OffsetDateTime, principal: &str, target: &str) -> AuditEvent {
        AuditEvent {
            id: 0,
            at,
            principal: principal.into(),
            action: otherix_proto::AuditAction::Broker,
            target: Some(target.into()),
            port: Some(22),
            transport: None,
            node: None,
            allowed: false,
            reason: Some("no such vm".into()),
            bytes_up: None,
            bytes_down: None,
            duration_ms: None,
            session: None,
        }
    }

    async fn all_pages(
        store: &Store,
        from: AuditCursor,
        filter: &AuditFilter<'_>,
        limit: u32,
    ) -> Vec<Vec<AuditEvent>> {
        let mut pages = vec![];
        let mut from = from;
        loop {
            let (events, next) = store.audit_page(from, filter, limit).await.unwrap();
            assert!(events.len() <= limit as usize);
            pages.push(events);
            match next {
                Some(c) => from = c,
                None => return pages,
            }
        }
    }

    on_both! {
        async fn pages_hold_every_event_once_in_time_order_even_with_ties_and_late_reports(store) {
            let t0 = OffsetDateTime::now_utc() - Duration::minutes(10);
            // 25 events: runs of the same millisecond, and every fifth written
            // late (it happened before the ones written just before it).
            for i in 0..25i64 {
                let at = if i % 5 == 4 {
                    t0 + Duration::seconds(i - 3)
                } else {
                    t0 + Duration::seconds(i / 3)
                };
                store
                    .add_audit_statement(&[record(at, "user:a", &format!("vm{i}"))])
                    .await
                    .unwrap();
            }
            let pages = all_pages(&store, AuditCursor::at_or_after(t0), &AuditFilter::default(), 7).await;
            assert_eq!(pages.iter().map(Vec::len).collect::<Vec<_>>(), [7, 7, 7, 4]);
            let all: Vec<AuditEvent> = pages.into_iter().flatten().collect();
            let keys: Vec<AuditCursor> = all.iter().map(AuditCursor::after).collect();
            let mut sorted = keys.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(keys, sorted, "ordered by (at, id), nothing twice");
            assert_eq!(keys.len(), 25, "nothing lost");

            // An exact multiple of the limit ends without a cursor to an empty page.
            let pages = all_pages(&store, AuditCursor::at_or_after(t0), &AuditFilter::default(), 5).await;
            assert_eq!(pages.iter().map(Vec::len).collect::<Vec<_>>(), [5, 5, 5, 5, 5]);
            // `since` is a lower bound on `at`.
            let (recent, _) = store
                .audit_page(
                    AuditCursor::at_or_after(t0 + Duration::seconds(8)),
                    &AuditFilter::default(),
                    100,
                )
                .await
                .unwrap();
            assert!(!recent.is_empty() && recent.iter().all(|e| e.at >= t0 + Duration::seconds(8)));
            assert!(recent.len() < 25);
        }
    }

    on_both! {
        async fn a_batch_is_written_whole_in_order_with_every_field_whatever_its_size(store) {
            let t0 = OffsetDateTime::now_utc() - Duration::minutes(10);
            // One record, a few, and up to the largest batch; every field
            // set on some (the counts past 2^53 and a reason JSON must
            // escape), left empty on others.
            let mut written = Vec::new();
            for (b, size) in [1usize, 2, 7, 64, 65, 200, MAX_AUDIT_BATCH].into_iter().enumerate() {
                let batch: Vec<AuditEvent> = (0..size)
                    .map(|i| {
                        let mut e = record(
                            t0 + Duration::milliseconds((b * 1000 + i) as i64),
                            &format!("user:u{b}"),
                            &format!("vm{i}"),
                        );
                        if i % 2 == 0 {
                            e.allowed = true;
                            e.reason = None;
                            e.transport = Some(otherix_proto::Transport::Gateway);
                            e.node = Some(format!("gw{i}:8443"));
                        }
                        if i % 3 == 1 {
                            e.action = otherix_proto::AuditAction::SessionEnd;
                            e.reason = Some(format!("peer said \"bye\"\\ \u{e9}\n{i}"));
                            e.port = Some(u16::MAX);
                            e.bytes_up = Some((1 << 60) + i as u64);
                            e.bytes_down = Some(0);
                            e.duration_ms = Some(86_400_000);
                            e.session = Some(format!("s-{b}-{i}"));
                        }
                        e
                    })
                    .collect();
                store.add_audit_statement(&batch).await.unwrap();
                written.extend(batch);
            }
            let (read, _) = store
                .audit_page(AuditCursor::at_or_after(t0), &AuditFilter::default(), 5000)
                .await
                .unwrap();
            // Stored to the millisecond, with an id of its own.
            let strip = |e: &AuditEvent| {
                let mut e = e.clone();
                e.id = 0;
                e.at = from_millis(to_millis(e.at));
                serde_json::to_value(e).unwrap()
            };
            assert_eq!(read.len(), written.len(), "nothing lost, nothing twice");
            for (r, w) in read.iter().zip(&written) {
                assert_eq!(strip(r), strip(w));
            }
            assert!(read.windows(2).all(|w| w[0].id < w[1].id), "ids in the order written");
        }
    }

    on_both! {
        async fn a_statement_of_more_records_than_it_takes_is_refused_and_writes_nothing(store) {
            let t0 = OffsetDateTime::now_utc() - Duration::minutes(10);
            let batch: Vec<AuditEvent> = (0..MAX_AUDIT_BATCH + 1)
                .map(|i| record(t0 + Duration::milliseconds(i as i64), "user:a", "vm"))
                .collect();
            let err = store.add_audit_statement(&batch).await.unwrap_err();
            assert!(err.to_string().contains("at most 512"), "{err}");
            let (read, _) = store
                .audit_page(AuditCursor::at_or_after(t0), &AuditFilter::default(), 5000)
                .await
                .unwrap();
            assert!(read.is_empty(), "nothing written");
        }
    }

    on_both! {
        async fn filtered_pages_hold_only_the_principal_or_target_asked_for(store) {
            let t0 = OffsetDateTime::now_utc();
            for i in 0..12i64 {
                let who = if i % 3 == 0 { "grant:acme" } else { "user:a" };
                let target = if i % 2 == 0 { "web01" } else { "db01" };
                store
                    .add_audit_statement(&[record(t0 + Duration::milliseconds(i), who, target)])
                    .await
                    .unwrap();
            }
            let from = AuditCursor::at_or_after(t0);
            let acme = AuditFilter {
                principal: Some("grant:acme"),
                target: None,
            };
            let got: Vec<AuditEvent> = all_pages(&store, from, &acme, 2)
                .await
                .into_iter()
                .flatten()
                .collect();
            assert_eq!(got.len(), 4);
            assert!(got.iter().all(|e| e.principal == "grant:acme"));
            let both = AuditFilter {
                principal: Some("grant:acme"),
                target: Some("web01"),
            };
            let got: Vec<AuditEvent> = all_pages(&store, from, &both, 1)
                .await
                .into_iter()
                .flatten()
                .collect();
            assert_eq!(got.len(), 2, "events 0 and 6");
        }
    }

    #[tokio::test]
    async fn every_page_query_searches_an_index_and_never_sorts() {
        let store = Store::open_in_memory().await.unwrap();
        for filter in [
            AuditFilter::default(),
            AuditFilter {
                principal: Some("user:a"),
                target: None,
            },
            AuditFilter {
                principal: None,
                target: Some("web01"),
            },
            AuditFilter {
                principal: Some("user:a"),
                target: Some("web01"),
            },
        ] {
            let sql = format!("EXPLAIN QUERY PLAN {}", page_sql(&filter));
            let mut q = sqlx::query(&sql).bind(0i64).bind(0i64);
            for value in [filter.principal, filter.target].into_iter().flatten() {
                q = q.bind(value);
            }
            let text = crate::testing::query_plan(&store, q.bind(10i64)).await;
            assert!(
                text.contains("USING INDEX") && text.starts_with("SEARCH"),
                "{filter:?}: {text}"
            );
            assert!(!text.contains("TEMP B-TREE"), "{filter:?} sorts: {text}");
        }
    }

    on_both! {
        async fn a_relay_ticket_is_used_once_until_it_is_pruned(store) {
            use otherix_core::credential::{CLOCK_SKEW, USED_KEPT_PAST_EXP};
            let now = OffsetDateTime::now_utc();
            let exp = now + time::Duration::minutes(5);
            assert!(store.use_ticket("j1", exp).await.unwrap());
            assert!(!store.use_ticket("j1", exp).await.unwrap(), "used twice");
            assert_eq!(store.prune_used_tickets(now).await.unwrap(), 0, "still live");
            // Past its exp, but a verifier still accepts it for the skew
            // allowance, by a clock up to the skew behind the pruning one's:
            // the use is kept and a replay refused throughout.
            for after in [
                time::Duration::SECOND,
                CLOCK_SKEW,
                CLOCK_SKEW + CLOCK_SKEW,
                USED_KEPT_PAST_EXP,
            ] {
                assert_eq!(store.prune_used_tickets(exp + after).await.unwrap(), 0, "{after}");
                assert!(!store.use_ticket("j1", exp).await.unwrap(), "replayed {after} past exp");
            }
            assert_eq!(
                store
                    .prune_used_tickets(exp + USED_KEPT_PAST_EXP + time::Duration::SECOND)
                    .await
                    .unwrap(),
                1
            );
            assert!(
                store.use_ticket("j1", exp).await.unwrap(),
                "forgotten once no verifier can accept it"
            );
        }
    }

    /// Relay tickets are single-use across control planes: each one's
    /// store records the use in the one database, so a ticket used through
    /// one is refused through another, even when both race for it.
    #[tokio::test]
    async fn a_relay_ticket_used_on_one_control_plane_is_refused_on_another() {
        let store = crate::testing::postgres().await;
        let other = store.another().await;
        let exp = OffsetDateTime::now_utc() + time::Duration::minutes(5);
        assert!(store.use_ticket("j1", exp).await.unwrap());
        assert!(!other.use_ticket("j1", exp).await.unwrap(), "used on the first");
        for i in 0..50 {
            let jti = format!("race{i}");
            let (a, b) = tokio::join!(store.use_ticket(&jti, exp), other.use_ticket(&jti, exp));
            assert!(a.unwrap() ^ b.unwrap(), "{jti}: exactly one use is accepted");
        }
    }
}
