//! Sessions open now, and their start and end records in the audit trail.
//!
//! Gateways report their sessions in heartbeats (`SessionEvent`s, resent
//! until a heartbeat is answered), the relay reports its own. Every write
//! here is idempotent per session: the audit trail has at most one
//! `session_start` and one `session_end` record per session id, and an end
//! that is already recorded is never reopened by a late or resent start.

use otherix_proto::agent::{SessionBytes, SessionEvent};
use otherix_proto::{AuditAction, OpenSession, Transport};
use sqlx::{AnyConnection, Row};
use time::OffsetDateTime;

use crate::{from_millis, json_int, to_millis, AuditEvent, Dialect, Store, StoreError};

/// What carries an open session, as the broker's session cap counts it: the
/// gateway node for a gateway session (a gateway's reports count only
/// against sessions through it, so one that lies can refuse only its own
/// users, which it could anyway), [`RELAY_CARRIER`] for every relay session
/// (the CP records those itself).
pub(crate) const CARRIER: &str = "CASE WHEN transport = 'gateway' THEN node ELSE '' END";

/// The carrier of relay sessions in [`Store::open_session_count`].
pub const RELAY_CARRIER: &str = "";

/// Whose byte counts a report may update: a gateway only those of the
/// sessions through it, a control plane only relay sessions (each replica
/// the ones it carries; a resumed session's counts go on from where they
/// were, so an older replica's late batch cannot lower them).
#[derive(Debug, Clone, Copy)]
pub enum BytesFrom<'a> {
    /// A gateway node's heartbeat.
    Gateway(&'a str),
    /// The control plane's relay.
    Relay,
}

/// Which open sessions to close (because whatever carried them is gone).
#[derive(Debug, Clone, Copy)]
pub enum Carrier<'a> {
    /// The gateway sessions of one node.
    Gateway(&'a str),
    /// Every session through one node, by gateway or relay.
    Node(&'a str),
    /// Every relay session (the one control plane on this store, SQLite's,
    /// restarted).
    Relay,
    /// The relay sessions one control-plane replica carried.
    Replica(&'a str),
    /// Relay sessions no registered replica carries.
    Unowned,
}

impl Store {
    /// Records a session that has just started (the relay's own sessions).
    pub async fn start_session(&self, open: &OpenSession) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        start(&mut tx, open).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records a session's end: it is no longer open; `end` is its audit
    /// record (its `session` names it).
    pub async fn end_session(&self, end: &AuditEvent) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        finish(&mut tx, end).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Applies one gateway heartbeat's session reports in one transaction.
    /// A new `epoch` (the gateway restarted) first closes the sessions
    /// still listed open for the node's previous run.
    ///
    /// `gateway`: whether the node holds the gateway role now. Only a
    /// granted gateway reports starts — the caller has checked each start's
    /// credential (issued to this gateway) and taken its fields from it. A
    /// node reports the ends of sessions open on it (also after its role was
    /// withdrawn), recorded with the principal, VM and port the start
    /// recorded; a granted gateway also the end of a session the CP never
    /// saw start, only with its credential (the caller clears one it could
    /// not verify). Nobody ends another node's session. Returns how many
    /// sessions a restart ended and how many reports were ignored.
    ///
    /// What the reports need from the store is read first, in two queries
    /// outside the single writer; the write holds it only to write.
    pub async fn record_gateway_sessions(
        &self,
        node: &str,
        gateway: bool,
        epoch: Option<&str>,
        events: &[SessionEvent],
        now: OffsetDateTime,
    ) -> Result<(u64, usize), StoreError> {
        let ids: Vec<&str> = events.iter().map(SessionEvent::session).collect();
        let open = self.open_by_id(&ids).await?;
        let ended = self.ended_ids(&ids).await?;
        let mut ignored = 0;
        let mut writes = Vec::with_capacity(events.len());
        for event in events {
            match event {
                SessionEvent::Start {
                    session,
                    at,
                    principal,
                    vm,
                    port,
                    ..
                } => {
                    if !gateway {
                        ignored += 1;
                        continue;
                    }
                    // A resent or late start of a session already ended or
                    // already open changes nothing.
                    if ended.contains(session.as_str()) || open.contains_key(session.as_str()) {
                        continue;
                    }
                    writes.push(Write::Start(OpenSession {
                        id: session.clone(),
                        principal: principal.clone(),
                        target: vm.clone(),
                        port: *port,
                        transport: Transport::Gateway,
                        node: node.into(),
                        replica: None,
                        started_at: *at,
                        bytes_up: 0,
                        bytes_down: 0,
                        bytes_at: None,
                    }));
                }
                SessionEvent::End {
                    session,
                    at,
                    principal,
                    vm,
                    port,
                    bytes_up,
                    bytes_down,
                    duration_ms,
                    reason,
                    credential,
                    ..
                } => {
                    let (principal, vm, port) = match open.get(session.as_str()) {
                        Some(o) if o.node == node => (o.principal.clone(), o.target.clone(), o.port),
                        Some(_) => {
                            ignored += 1;
                            continue;
                        }
                        None if ended.contains(session.as_str()) => continue,
                        None if gateway && credential.is_some() => (principal.clone(), vm.clone(), *port),
                        None => {
                            ignored += 1;
                            continue;
                        }
                    };
                    writes.push(Write::End(AuditEvent {
                        id: 0,
                        at: *at,
                        principal,
                        action: AuditAction::SessionEnd,
                        target: Some(vm),
                        port: Some(port),
                        transport: Some(Transport::Gateway),
                        node: Some(node.into()),
                        allowed: true,
                        reason: Some(reason.clone()),
                        bytes_up: Some(*bytes_up),
                        bytes_down: Some(*bytes_down),
                        duration_ms: Some(*duration_ms),
                        session: Some(session.clone()),
                    }));
                }
            }
        }
        if epoch.is_none() && writes.is_empty() {
            return Ok((0, ignored));
        }
        let mut tx = self.begin_write().await?;
        let mut closed = 0;
        if let Some(epoch) = epoch {
            let known: Option<Option<String>> =
                sqlx::query_scalar("SELECT session_epoch FROM nodes WHERE name = $1")
                    .bind(node)
                    .fetch_optional(&mut *tx)
                    .await?;
            if known.is_some_and(|k| k.as_deref() != Some(epoch)) {
                closed = close(&mut tx, Carrier::Gateway(node), "gateway restarted", now).await?;
                sqlx::query("UPDATE nodes SET session_epoch = $1 WHERE name = $2")
                    .bind(epoch)
                    .bind(node)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        for w in &writes {
            match w {
                // Read outside the writer that it had not ended. What could
                // end it in between — this node's restart (sessions of its
                // previous run, never in this batch) or its deletion (then
                // it sends no heartbeat) — does not touch it.
                Write::Start(open) => start_unended(&mut tx, open).await?,
                Write::End(end) => finish(&mut tx, end).await?,
            }
        }
        tx.commit().await?;
        Ok((closed, ignored))
    }

    /// The open sessions among `ids`, by id (one query per 500 ids).
    async fn open_by_id(
        &self,
        ids: &[&str],
    ) -> Result<std::collections::HashMap<String, OpenSession>, StoreError> {
        let mut found = std::collections::HashMap::new();
        for chunk in ids.chunks(IN_CHUNK) {
            let sql = format!(
                "SELECT * FROM open_sessions WHERE id IN ({})",
                placeholders(chunk.len())
            );
            let mut q = sqlx::query(&sql);
            for id in chunk {
                q = q.bind(*id);
            }
            for row in q.fetch_all(&self.read).await? {
                let o = open_session(&row)?;
                found.insert(o.id.clone(), o);
            }
        }
        Ok(found)
    }

    /// The sessions among `ids` whose end is recorded.
    async fn ended_ids(&self, ids: &[&str]) -> Result<std::collections::HashSet<String>, StoreError> {
        let mut found = std::collections::HashSet::new();
        for chunk in ids.chunks(IN_CHUNK) {
            let sql = format!(
                "SELECT session FROM audit_events WHERE action = $1 AND session IN ({})",
                placeholders_from(2, chunk.len())
            );
            let mut q = sqlx::query_scalar::<_, String>(&sql).bind(AuditAction::SessionEnd.as_str());
            for id in chunk {
                q = q.bind(*id);
            }
            found.extend(q.fetch_all(&self.read).await?);
        }
        Ok(found)
    }

    /// Ends every open session `carrier` held, with `reason` and unknown
    /// byte counts (whatever counted them is gone). Returns how many.
    pub async fn close_sessions(
        &self,
        carrier: Carrier<'_>,
        reason: &str,
        now: OffsetDateTime,
    ) -> Result<u64, StoreError> {
        let mut tx = self.begin_write().await?;
        let n = close(&mut tx, carrier, reason, now).await?;
        tx.commit().await?;
        Ok(n)
    }

    /// Records open sessions' byte counts so far (totals, not increments)
    /// in one transaction, with one `session_bytes` change for the batch.
    /// A count only grows: a late or repeated report never lowers one.
    /// Reports of sessions `from` does not carry, or no longer open, change
    /// nothing. Returns how many sessions moved.
    pub async fn record_session_bytes(
        &self,
        from: BytesFrom<'_>,
        bytes: &[SessionBytes],
        now: OffsetDateTime,
    ) -> Result<u64, StoreError> {
        if bytes.is_empty() {
            return Ok(0);
        }
        let (carrier, key) = match from {
            BytesFrom::Gateway(node) => ("transport = 'gateway' AND node = $5", node),
            BytesFrom::Relay => ("transport = 'relay' AND $5 = ''", RELAY_CARRIER),
        };
        let sql = format!(
            "UPDATE open_sessions SET bytes_up = $1, bytes_down = $2, bytes_at = $3
             WHERE id = $4 AND {carrier} AND bytes_up <= $1 AND bytes_down <= $2
             AND (bytes_up < $1 OR bytes_down < $2)"
        );
        let mut tx = self.begin_write().await?;
        let mut moved = 0;
        for b in bytes {
            moved += sqlx::query(&sql)
                .bind(clamp_i64(b.bytes_up))
                .bind(clamp_i64(b.bytes_down))
                .bind(to_millis(now))
                .bind(&b.session)
                .bind(key)
                .execute(&mut *tx)
                .await?
                .rows_affected();
        }
        if moved > 0 {
            crate::changes::log(&mut tx, "session_bytes", key, self.dialect()).await?;
        }
        tx.commit().await?;
        Ok(moved)
    }

    /// Sessions open now, oldest first.
    pub async fn open_sessions(&self) -> Result<Vec<OpenSession>, StoreError> {
        self.open_sessions_matching(&SessionFilter::default()).await
    }

    /// The open sessions `filter` matches, oldest first: the filter is the
    /// query's (a user's list reads that user's rows through the
    /// principal's index, not the whole table).
    pub async fn open_sessions_matching(
        &self,
        filter: &SessionFilter,
    ) -> Result<Vec<OpenSession>, StoreError> {
        let mut sql = String::from("SELECT * FROM open_sessions");
        let mut binds = Vec::new();
        for (column, value) in [
            ("principal", &filter.principal),
            ("target", &filter.target),
            ("node", &filter.node),
        ] {
            if let Some(v) = value {
                binds.push(v.as_str());
                let word = if binds.len() == 1 { "WHERE" } else { "AND" };
                sql.push_str(&format!(" {word} {column} = ${}", binds.len()));
            }
        }
        sql.push_str(" ORDER BY started_at, id");
        let mut query = sqlx::query(&sql);
        for v in binds {
            query = query.bind(v);
        }
        let rows = query.fetch_all(&self.read).await?;
        rows.iter().map(open_session).collect()
    }

    /// One open session by its id, if open.
    pub async fn open_session(&self, id: &str) -> Result<Option<OpenSession>, StoreError> {
        let row = sqlx::query("SELECT * FROM open_sessions WHERE id = $1")
            .bind(id)
            .fetch_optional(&self.read)
            .await?;
        row.as_ref().map(open_session).transpose()
    }

    /// How many sessions are open, by transport (of `principal` only, if
    /// given): counted by the query, no row read.
    pub async fn open_sessions_by_transport(
        &self,
        principal: Option<&str>,
    ) -> Result<Vec<(Transport, u64)>, StoreError> {
        let rows = match principal {
            Some(p) => sqlx::query(
                "SELECT transport, COUNT(*) AS n FROM open_sessions WHERE principal = $1 GROUP BY transport",
            )
            .bind(p)
            .fetch_all(&self.read)
            .await?,
            None => {
                sqlx::query("SELECT transport, COUNT(*) AS n FROM open_sessions GROUP BY transport")
                    .fetch_all(&self.read)
                    .await?
            }
        };
        rows.iter()
            .map(|r| {
                Ok((
                    r.get::<String, _>("transport").parse()?,
                    r.get::<i64, _>("n").max(0) as u64,
                ))
            })
            .collect()
    }
}

/// Which open sessions to read ([`Store::open_sessions_matching`]); each
/// field left `None` matches every session.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionFilter {
    /// `user:NAME`, `grant:NAME`.
    pub principal: Option<String>,
    /// The VM's name.
    pub target: Option<String>,
    /// The node carrying it.
    pub node: Option<String>,
}

/// Ids per `IN (...)` query: well under SQLite's and PostgreSQL's limits
/// on bound parameters.
const IN_CHUNK: usize = 500;

/// `$1, $2, ... $n`.
fn placeholders(n: usize) -> String {
    placeholders_from(1, n)
}

/// `$first, ... $(first + n - 1)`.
fn placeholders_from(first: usize, n: usize) -> String {
    (first..first + n)
        .map(|i| format!("${i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One write a heartbeat's reports lead to.
enum Write {
    Start(OpenSession),
    End(AuditEvent),
}

pub(crate) fn open_session(r: &sqlx::any::AnyRow) -> Result<OpenSession, StoreError> {
    Ok(OpenSession {
        id: r.get("id"),
        principal: r.get("principal"),
        target: r.get("target"),
        port: r.get::<i64, _>("port") as u16,
        transport: r.get::<String, _>("transport").parse()?,
        node: r.get("node"),
        replica: r.get("replica"),
        started_at: from_millis(r.get("started_at")),
        bytes_up: r.get::<i64, _>("bytes_up").max(0) as u64,
        bytes_down: r.get::<i64, _>("bytes_down").max(0) as u64,
        bytes_at: r.get::<Option<i64>, _>("bytes_at").map(from_millis),
    })
}

/// A byte count as the store's signed integers hold it.
fn clamp_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

pub(crate) async fn start(conn: &mut AnyConnection, open: &OpenSession) -> Result<(), StoreError> {
    let ended: Option<i64> =
        sqlx::query_scalar("SELECT 1 FROM audit_events WHERE session = $1 AND action = $2")
            .bind(&open.id)
            .bind(AuditAction::SessionEnd.as_str())
            .fetch_optional(&mut *conn)
            .await?;
    if ended.is_some() {
        return insert_audit(conn, &start_record(open)).await;
    }
    start_unended(conn, open).await
}

/// [`start`] of a session the caller knows has not ended.
async fn start_unended(conn: &mut AnyConnection, open: &OpenSession) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO open_sessions (id, principal, target, port, transport, node, replica, started_at)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
    )
    .bind(&open.id)
    .bind(&open.principal)
    .bind(&open.target)
    .bind(i64::from(open.port))
    .bind(open.transport.as_str())
    .bind(&open.node)
    .bind(open.replica.as_deref())
    .bind(to_millis(open.started_at))
    .execute(&mut *conn)
    .await?;
    insert_audit(conn, &start_record(open)).await
}

/// A session's `session_start` audit record.
fn start_record(open: &OpenSession) -> AuditEvent {
    AuditEvent {
        id: 0,
        at: open.started_at,
        principal: open.principal.clone(),
        action: AuditAction::SessionStart,
        target: Some(open.target.clone()),
        port: Some(open.port),
        transport: Some(open.transport),
        node: Some(open.node.clone()),
        allowed: true,
        reason: None,
        bytes_up: None,
        bytes_down: None,
        duration_ms: None,
        session: Some(open.id.clone()),
    }
}

pub(crate) async fn finish(conn: &mut AnyConnection, end: &AuditEvent) -> Result<(), StoreError> {
    if let Some(id) = &end.session {
        sqlx::query("DELETE FROM open_sessions WHERE id = $1")
            .bind(id)
            .execute(&mut *conn)
            .await?;
        sqlx::query("DELETE FROM relay_resume WHERE session = $1")
            .bind(id)
            .execute(&mut *conn)
            .await?;
    }
    insert_audit(conn, end).await
}

pub(crate) async fn close(
    conn: &mut AnyConnection,
    carrier: Carrier<'_>,
    reason: &str,
    now: OffsetDateTime,
) -> Result<u64, StoreError> {
    let rows = match carrier {
        Carrier::Gateway(node) => {
            sqlx::query("SELECT * FROM open_sessions WHERE node = $1 AND transport = 'gateway'")
                .bind(node)
                .fetch_all(&mut *conn)
                .await?
        }
        Carrier::Node(node) => {
            sqlx::query("SELECT * FROM open_sessions WHERE node = $1")
                .bind(node)
                .fetch_all(&mut *conn)
                .await?
        }
        Carrier::Relay => {
            sqlx::query("SELECT * FROM open_sessions WHERE transport = 'relay'")
                .fetch_all(&mut *conn)
                .await?
        }
        Carrier::Replica(id) => {
            sqlx::query("SELECT * FROM open_sessions WHERE replica = $1 AND transport = 'relay'")
                .bind(id)
                .fetch_all(&mut *conn)
                .await?
        }
        Carrier::Unowned => {
            sqlx::query(
                "SELECT * FROM open_sessions WHERE transport = 'relay'
                 AND (replica IS NULL OR replica NOT IN (SELECT id FROM replicas))",
            )
            .fetch_all(&mut *conn)
            .await?
        }
    };
    // A control plane gone is no end for a resumable relay session: the
    // agent holds it for its grace period and any replica may resume it.
    // Ending the node's sessions (deleted, restarted) does end them.
    let detach = matches!(carrier, Carrier::Relay | Carrier::Replica(_) | Carrier::Unowned);
    let mut ended = 0;
    for open in rows.iter().map(open_session).collect::<Result<Vec<_>, _>>()? {
        if detach {
            let detached = sqlx::query(
                "UPDATE relay_resume SET detached_at = COALESCE(detached_at, $1) WHERE session = $2",
            )
            .bind(to_millis(now))
            .bind(&open.id)
            .execute(&mut *conn)
            .await?;
            if detached.rows_affected() > 0 {
                continue;
            }
        }
        ended += 1;
        let end = AuditEvent {
            id: 0,
            at: now,
            principal: open.principal,
            action: AuditAction::SessionEnd,
            target: Some(open.target),
            port: Some(open.port),
            transport: Some(open.transport),
            node: Some(open.node),
            allowed: true,
            reason: Some(reason.into()),
            bytes_up: None,
            bytes_down: None,
            duration_ms: Some((now - open.started_at).whole_milliseconds().max(0) as u64),
            session: Some(open.id),
        };
        finish(conn, &end).await?;
    }
    Ok(ended)
}

/// Inserts audit records in one statement, in order; a session's second
/// start or end is ignored. The records are the statement's one argument,
/// a JSON array of arrays (each record's columns by position, as a group
/// of heartbeats' writes in `crate::beats`), so its text is the same
/// whatever their number: prepared once per connection, and a batch of
/// any size is one statement, one commit. With an argument per column,
/// every size was a statement text of its own, so a batch was written as
/// one statement (and one commit) per power of two in its size, to keep
/// the texts few.
pub(crate) async fn insert_audits(conn: &mut AnyConnection, events: &[AuditEvent]) -> Result<(), StoreError> {
    if events.is_empty() {
        return Ok(());
    }
    let rows: Vec<_> = events
        .iter()
        .map(|e| {
            (
                to_millis(e.at),
                &e.principal,
                e.action.as_str(),
                &e.target,
                e.port,
                e.transport.map(Transport::as_str),
                &e.node,
                e.allowed as i64,
                &e.reason,
                e.bytes_up.map(|b| b as i64),
                e.bytes_down.map(|b| b as i64),
                e.duration_ms.map(|b| b as i64),
                &e.session,
            )
        })
        .collect();
    let rows =
        serde_json::to_string(&rows).map_err(|e| StoreError::Invalid(format!("audit records: {e}")))?;
    let sql = if conn.backend_name().eq_ignore_ascii_case("sqlite") {
        &*INSERT_AUDITS_SQLITE
    } else {
        &*INSERT_AUDITS_POSTGRES
    };
    sqlx::query(sql).bind(rows).execute(&mut *conn).await?;
    Ok(())
}

/// [`insert_audits`]' statement on each dialect, the rows in the array's
/// order (`WHERE true` keeps SQLite from reading `ON CONFLICT` as a
/// join's constraint).
static INSERT_AUDITS_SQLITE: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| insert_audits_sql(Dialect::Sqlite));
static INSERT_AUDITS_POSTGRES: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| insert_audits_sql(Dialect::Postgres));

/// The statement of [`insert_audits`] on `dialect`.
///
/// On SQLite each row is read from the argument once, into JSONB, before
/// its columns are: `json_each` hands a row to `->>` as JSON text,
/// converted back from the parsed argument for each of the 13 columns
/// read (there is no `jsonb_each` in the SQLite linked), and `->>` reads
/// JSONB as it is. A materialized `WITH` keeps the conversion to one per
/// row: a subquery in `FROM` would be flattened into the `SELECT`, and the
/// conversion with it into each column.
fn insert_audits_sql(dialect: Dialect) -> String {
    let text = |k: usize| format!("j.value ->> {k}");
    let int = json_int;
    let (with, rows, order) = match dialect {
        Dialect::Sqlite => (
            "WITH j(key, value) AS MATERIALIZED (SELECT key, jsonb(value) FROM json_each($1)) ",
            "j".to_string(),
            "j.key",
        ),
        Dialect::Postgres => ("", dialect.json_rows(1), dialect.json_place()),
    };
    format!(
        "{with}INSERT INTO audit_events (at, principal, action, target, port, transport, node, allowed, reason,
             bytes_up, bytes_down, duration_ms, session)
         SELECT {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {}
         FROM {rows} WHERE true ORDER BY {order}
         ON CONFLICT DO NOTHING",
        int(0),
        text(1),
        text(2),
        text(3),
        int(4),
        text(5),
        text(6),
        int(7),
        text(8),
        int(9),
        int(10),
        int(11),
        text(12),
    )
}

/// Inserts an audit record; a session's second start or end is ignored.
pub(crate) async fn insert_audit(conn: &mut AnyConnection, e: &AuditEvent) -> Result<(), StoreError> {
    insert_audits(conn, std::slice::from_ref(e)).await
}

#[cfg(test)]
mod tests {
    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{on_both, TestStore};
    use time::Duration;

    fn start_event(id: &str, at: OffsetDateTime) -> SessionEvent {
        SessionEvent::Start {
            session: id.into(),
            at,
            principal: "user:alice".into(),
            vm: "web01".into(),
            port: 22,
            network: "ov".into(),
            credential: None,
        }
    }

    fn end_event(id: &str, at: OffsetDateTime) -> SessionEvent {
        SessionEvent::End {
            session: id.into(),
            at,
            principal: "user:alice".into(),
            vm: "web01".into(),
            port: 22,
            network: "ov".into(),
            bytes_up: 1234,
            bytes_down: 5678,
            duration_ms: 1000,
            reason: "closed".into(),
            credential: None,
        }
    }

    async fn store_with_node(store: TestStore, node: &str) -> TestStore {
        add_node(&store, node).await;
        store
    }

    /// Enrolls gateway `node` (token id and fingerprint derived from its name).
    async fn add_node(store: &Store, node: &str) {
        let grant = crate::NodeGrant {
            gateway: Some("10.0.0.1:8443".into()),
            ..Default::default()
        };
        crate::testing::enroll(store, node, grant).await;
    }

    async fn session_records(store: &Store) -> Vec<AuditEvent> {
        let from = otherix_proto::AuditCursor::at_or_after(OffsetDateTime::UNIX_EPOCH);
        let (all, _) = store.audit_page(from, &Default::default(), 10_000).await.unwrap();
        all.into_iter().filter(|e| e.session.is_some()).collect()
    }

    on_both! {
        async fn a_start_opens_a_session_and_its_end_closes_it_with_its_byte_counts(store) {
            let store = store_with_node(store, "gw1").await;
            let t0 = OffsetDateTime::now_utc();
            store
                .record_gateway_sessions("gw1", true, Some("e1"), &[start_event("s1", t0)], t0)
                .await
                .unwrap();
            let open = store.open_sessions().await.unwrap();
            assert_eq!(open.len(), 1);
            assert_eq!(
                (
                    open[0].id.as_str(),
                    open[0].transport.as_str(),
                    open[0].node.as_str()
                ),
                ("s1", "gateway", "gw1")
            );
            store
                .record_gateway_sessions(
                    "gw1",
                    true,
                    Some("e1"),
                    &[end_event("s1", t0 + Duration::SECOND)],
                    t0,
                )
                .await
                .unwrap();
            assert!(store.open_sessions().await.unwrap().is_empty());
            let records = session_records(&store).await;
            let actions: Vec<_> = records.iter().map(|e| e.action).collect();
            assert_eq!(actions, [AuditAction::SessionStart, AuditAction::SessionEnd]);
            let end = &records[1];
            assert_eq!((end.bytes_up, end.bytes_down), (Some(1234), Some(5678)));
            assert_eq!(end.reason.as_deref(), Some("closed"));
            assert_eq!(end.principal, "user:alice");
        }
    }

    on_both! {
        async fn resent_reports_record_each_session_once_and_never_reopen_an_ended_one(store) {
            let store = store_with_node(store, "gw1").await;
            let t0 = OffsetDateTime::now_utc();
            let batch = [start_event("s1", t0), end_event("s1", t0), start_event("s2", t0)];
            for _ in 0..3 {
                store
                    .record_gateway_sessions("gw1", true, Some("e1"), &batch, t0)
                    .await
                    .unwrap();
            }
            // A start arriving alone after its end (a resend) does not reopen s1.
            store
                .record_gateway_sessions("gw1", true, Some("e1"), &[start_event("s1", t0)], t0)
                .await
                .unwrap();
            let open: Vec<_> = store
                .open_sessions()
                .await
                .unwrap()
                .into_iter()
                .map(|s| s.id)
                .collect();
            assert_eq!(open, ["s2"]);
            assert_eq!(session_records(&store).await.len(), 3);
        }
    }

    on_both! {
        async fn a_new_gateway_run_ends_the_sessions_of_the_previous_one(store) {
            let store = store_with_node(store, "gw1").await;
            let t0 = OffsetDateTime::now_utc();
            store
                .record_gateway_sessions("gw1", true, Some("e1"), &[start_event("s1", t0)], t0)
                .await
                .unwrap();
            // Same run: nothing closes.
            assert_eq!(
                store
                    .record_gateway_sessions("gw1", true, Some("e1"), &[], t0)
                    .await
                    .unwrap(),
                (0, 0)
            );
            let later = t0 + Duration::seconds(5);
            let (closed, _) = store
                .record_gateway_sessions("gw1", true, Some("e2"), &[start_event("s2", later)], later)
                .await
                .unwrap();
            assert_eq!(closed, 1);
            let open: Vec<_> = store
                .open_sessions()
                .await
                .unwrap()
                .into_iter()
                .map(|s| s.id)
                .collect();
            assert_eq!(open, ["s2"]);
            let end = session_records(&store)
                .await
                .into_iter()
                .find(|e| e.action == AuditAction::SessionEnd)
                .unwrap();
            assert_eq!(end.session.as_deref(), Some("s1"));
            assert_eq!(end.reason.as_deref(), Some("gateway restarted"));
            assert_eq!((end.bytes_up, end.bytes_down), (None, None));
            assert_eq!(end.duration_ms, Some(5000));
        }
    }

    on_both! {
        async fn relay_sessions_end_when_closed_and_deleting_a_node_ends_its_sessions(store) {
            let store = store_with_node(store, "n1").await;
            let t0 = OffsetDateTime::now_utc();
            for (id, transport) in [
                ("r1", Transport::Relay),
                ("r2", Transport::Relay),
                ("g1", Transport::Gateway),
            ] {
                store
                    .start_session(&OpenSession {
                        id: id.into(),
                        principal: "grant:partner".into(),
                        target: "db01".into(),
                        port: 5432,
                        transport,
                        node: "n1".into(),
                        replica: None,
                        started_at: t0,
                        bytes_up: 0,
                        bytes_down: 0,
                        bytes_at: None,
                    })
                    .await
                    .unwrap();
            }
            assert_eq!(
                store
                    .close_sessions(Carrier::Relay, "control plane restarted", t0)
                    .await
                    .unwrap(),
                2
            );
            let open: Vec<_> = store
                .open_sessions()
                .await
                .unwrap()
                .into_iter()
                .map(|s| s.id)
                .collect();
            assert_eq!(open, ["g1"]);
            store.delete_node("n1", false).await.unwrap();
            assert!(store.open_sessions().await.unwrap().is_empty());
            let reasons: Vec<_> = session_records(&store)
                .await
                .into_iter()
                .filter(|e| e.action == AuditAction::SessionEnd)
                .map(|e| (e.session.unwrap(), e.reason.unwrap()))
                .collect();
            assert_eq!(
                reasons,
                [
                    ("r1".to_string(), "control plane restarted".to_string()),
                    ("r2".into(), "control plane restarted".into()),
                    ("g1".into(), "node deleted".into()),
                ]
            );
        }
    }

    on_both! {
        async fn a_withdrawn_gateway_reports_only_the_ends_of_its_own_open_sessions(store) {
            let store = store_with_node(store, "gw1").await;
            let t0 = OffsetDateTime::now_utc();
            store
                .record_gateway_sessions("gw1", true, Some("e1"), &[start_event("s1", t0)], t0)
                .await
                .unwrap();
            // The role is withdrawn: new starts are not taken, nor ends of
            // sessions it never carried; the end of its own open one is.
            let (_, ignored) = store
                .record_gateway_sessions(
                    "gw1",
                    false,
                    Some("e1"),
                    &[
                        start_event("s9", t0),
                        end_event("s8", t0),
                        end_event("s1", t0 + Duration::SECOND),
                    ],
                    t0,
                )
                .await
                .unwrap();
            assert_eq!(ignored, 2);
            assert!(store.open_sessions().await.unwrap().is_empty());
            let ids: Vec<_> = session_records(&store)
                .await
                .into_iter()
                .filter_map(|e| e.session)
                .collect();
            assert_eq!(ids, ["s1", "s1"], "start and end of s1 only");
        }
    }

    fn bytes(id: &str, up: u64, down: u64) -> SessionBytes {
        SessionBytes {
            session: id.into(),
            bytes_up: up,
            bytes_down: down,
        }
    }

    async fn counts(store: &Store) -> Vec<(String, u64, u64)> {
        store
            .open_sessions()
            .await
            .unwrap()
            .into_iter()
            .map(|s| (s.id, s.bytes_up, s.bytes_down))
            .collect()
    }

    on_both! {
        async fn open_sessions_are_read_by_filter_by_id_and_counted_by_transport(store) {
            let store = store_with_node(store, "gw1").await;
            add_node(&store, "gw2").await;
            let t0 = OffsetDateTime::now_utc();
            let open = |id: &str, principal: &str, target: &str, transport: Transport, node: &str, at| OpenSession {
                id: id.into(),
                principal: principal.into(),
                target: target.into(),
                port: 22,
                transport,
                node: node.into(),
                replica: None,
                started_at: at,
                bytes_up: 0,
                bytes_down: 0,
                bytes_at: None,
            };
            for s in [
                open("a1", "user:alice", "web01", Transport::Relay, "gw1", t0),
                open("b1", "user:bob", "web01", Transport::Gateway, "gw2", t0 + Duration::SECOND),
                open("a2", "user:alice", "db01", Transport::Gateway, "gw2", t0 + 2 * Duration::SECOND),
            ] {
                store.start_session(&s).await.unwrap();
            }
            let ids = |v: Vec<OpenSession>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
            let matching = |principal: Option<&str>, target: Option<&str>, node: Option<&str>| SessionFilter {
                principal: principal.map(str::to_owned),
                target: target.map(str::to_owned),
                node: node.map(str::to_owned),
            };
            assert_eq!(ids(store.open_sessions().await.unwrap()), ["a1", "b1", "a2"], "oldest first");
            for (filter, want) in [
                (matching(Some("user:alice"), None, None), vec!["a1", "a2"]),
                (matching(None, Some("web01"), None), vec!["a1", "b1"]),
                (matching(None, None, Some("gw2")), vec!["b1", "a2"]),
                (matching(Some("user:alice"), Some("db01"), Some("gw2")), vec!["a2"]),
                (matching(Some("user:alice"), None, Some("gw9")), vec![]),
                (matching(Some("user:carol"), None, None), vec![]),
            ] {
                assert_eq!(ids(store.open_sessions_matching(&filter).await.unwrap()), want, "{filter:?}");
            }
            assert_eq!(store.open_session("b1").await.unwrap().unwrap().principal, "user:bob");
            assert!(store.open_session("zz").await.unwrap().is_none());
            let mut all = store.open_sessions_by_transport(None).await.unwrap();
            all.sort();
            assert_eq!(all, [(Transport::Gateway, 2), (Transport::Relay, 1)]);
            let mut alice = store.open_sessions_by_transport(Some("user:alice")).await.unwrap();
            alice.sort();
            assert_eq!(alice, [(Transport::Gateway, 1), (Transport::Relay, 1)]);
            assert!(store.open_sessions_by_transport(Some("user:carol")).await.unwrap().is_empty());
        }
    }

    on_both! {
        async fn open_sessions_byte_counts_grow_with_reports_from_their_carrier_only(store) {
            let store = store_with_node(store, "gw1").await;
            add_node(&store, "gw2").await;
            let t0 = OffsetDateTime::now_utc();
            store
                .record_gateway_sessions("gw1", true, Some("e1"), &[start_event("s1", t0), start_event("s2", t0)], t0)
                .await
                .unwrap();
            store
                .start_session(&OpenSession {
                    id: "r1".into(),
                    principal: "user:alice".into(),
                    target: "web01".into(),
                    port: 22,
                    transport: Transport::Relay,
                    node: "gw1".into(),
                    replica: None,
                    started_at: t0,
                    bytes_up: 0,
                    bytes_down: 0,
                    bytes_at: None,
                })
                .await
                .unwrap();
            assert!(store.open_sessions().await.unwrap().iter().all(|s| s.bytes_at.is_none()));
            let rev = store.revision().await.unwrap();
            let t1 = t0 + Duration::SECOND;
            let moved = store
                .record_session_bytes(BytesFrom::Gateway("gw1"), &[bytes("s1", 100, 2000)], t1)
                .await
                .unwrap();
            assert_eq!(moved, 1);
            // One change for the batch, not one per row.
            let changes = store.changes_since(rev, 100).await.unwrap();
            assert_eq!(
                changes.iter().map(|c| (c.kind, c.key.as_str())).collect::<Vec<_>>(),
                [(crate::ChangeKind::SessionBytes, "gw1")]
            );
            // Another gateway's report, the relay's report of a gateway
            // session, a gateway's of a relay session: nothing moves.
            let rev = store.revision().await.unwrap();
            assert_eq!(
                store
                    .record_session_bytes(BytesFrom::Gateway("gw2"), &[bytes("s1", 999, 9999), bytes("s2", 5, 5)], t1)
                    .await
                    .unwrap(),
                0
            );
            assert_eq!(
                store
                    .record_session_bytes(BytesFrom::Relay, &[bytes("s2", 7, 7)], t1)
                    .await
                    .unwrap(),
                0
            );
            assert_eq!(
                store
                    .record_session_bytes(BytesFrom::Gateway("gw1"), &[bytes("r1", 7, 7)], t1)
                    .await
                    .unwrap(),
                0
            );
            assert_eq!(store.revision().await.unwrap(), rev, "no change logged when nothing moved");
            // The relay moves its own; a late, lower report (a resend) and
            // an unchanged one move nothing; an ended session none either.
            assert_eq!(
                store
                    .record_session_bytes(BytesFrom::Relay, &[bytes("r1", 10, 20)], t1)
                    .await
                    .unwrap(),
                1
            );
            let t2 = t1 + Duration::SECOND;
            assert_eq!(
                store
                    .record_session_bytes(
                        BytesFrom::Gateway("gw1"),
                        &[bytes("s1", 50, 2500), bytes("s1", 100, 2000), bytes("s3", 1, 1)],
                        t2
                    )
                    .await
                    .unwrap(),
                0
            );
            let mut now = counts(&store).await;
            now.sort();
            assert_eq!(
                now,
                [
                    ("r1".to_string(), 10, 20),
                    ("s1".into(), 100, 2000),
                    ("s2".into(), 0, 0),
                ]
            );
            let s1 = store.open_sessions().await.unwrap().into_iter().find(|s| s.id == "s1").unwrap();
            assert_eq!(s1.bytes_at.map(crate::to_millis), Some(crate::to_millis(t1)));
            assert_eq!(
                store
                    .record_session_bytes(BytesFrom::Gateway("gw1"), &[bytes("s1", 150, 2000)], t2)
                    .await
                    .unwrap(),
                1
            );
            // Its end records the end report's counts and closes it.
            store
                .record_gateway_sessions("gw1", true, Some("e1"), &[end_event("s1", t2)], t2)
                .await
                .unwrap();
            assert_eq!(
                store
                    .record_session_bytes(BytesFrom::Gateway("gw1"), &[bytes("s1", 9000, 9000)], t2)
                    .await
                    .unwrap(),
                0
            );
            assert!(counts(&store).await.iter().all(|(id, ..)| id != "s1"));
        }
    }

    on_both! {
        async fn a_gateway_never_ends_another_nodes_session(store) {
            let store = store_with_node(store, "gw1").await;
            add_node(&store, "gw2").await;
            let now = OffsetDateTime::now_utc();
            store
                .record_gateway_sessions("gw1", true, Some("e1"), &[start_event("s1", now)], now)
                .await
                .unwrap();
            let (_, ignored) = store
                .record_gateway_sessions("gw2", true, Some("e2"), &[end_event("s1", now)], now)
                .await
                .unwrap();
            assert_eq!(ignored, 1);
            let open = store.open_sessions().await.unwrap();
            assert_eq!(open.len(), 1, "gw1's session is still open");
            assert_eq!(open[0].node, "gw1");
        }
    }

    on_both! {
        async fn an_end_is_recorded_as_its_start_was_and_one_never_seen_start_only_with_its_credential(store) {
            let store = store_with_node(store, "gw1").await;
            let now = OffsetDateTime::now_utc();
            store
                .record_gateway_sessions("gw1", true, Some("e1"), &[start_event("s1", now)], now)
                .await
                .unwrap();
            // The end names someone else: the start's principal and VM are recorded.
            let mut lying = end_event("s1", now);
            if let SessionEvent::End { principal, vm, .. } = &mut lying {
                *principal = "user:mallory".into();
                *vm = "db01".into();
            }
            let unseen = end_event("s2", now);
            let mut vouched = end_event("s3", now);
            if let SessionEvent::End { credential, .. } = &mut vouched {
                *credential = Some("v4.public.checked-by-the-caller".into());
            }
            let (_, ignored) = store
                .record_gateway_sessions("gw1", true, Some("e1"), &[lying, unseen, vouched], now)
                .await
                .unwrap();
            assert_eq!(ignored, 1, "the end of s2, never seen start, with no credential");
            let ends: Vec<AuditEvent> = session_records(&store)
                .await
                .into_iter()
                .filter(|e| e.action == AuditAction::SessionEnd)
                .collect();
            let sessions: Vec<_> = ends.iter().map(|e| e.session.as_deref().unwrap()).collect();
            assert_eq!(sessions, ["s1", "s3"]);
            assert_eq!(ends[0].principal, "user:alice");
            assert_eq!(ends[0].target.as_deref(), Some("web01"));
            assert!(store.open_sessions().await.unwrap().is_empty());
        }
    }
}
