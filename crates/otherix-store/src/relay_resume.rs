//! Resumable relay sessions: what any control plane needs to let a client
//! resume one (`otherix_proto::resume`). The session itself is an open
//! session like any other (`sessions`); beside it, the SHA-256 of its
//! resume secret, the ticket's claims (so revocations still cover it), the
//! node holding the guest's connection, its grace period, and since when
//! no control plane carries it (`detached_at`), and which connection
//! carries it (`leg`: a connection ending after a resume took the session
//! on neither detaches nor ends it). A session detached for
//! longer than its grace is recorded as ended by whichever replica looks
//! first ([`Store::end_abandoned_sessions`]).

use otherix_proto::{AuditAction, OpenSession, Transport};
use sqlx::Row;
use time::OffsetDateTime;

use crate::sessions::{finish, open_session, start};
use crate::{from_millis, to_millis, AuditEvent, Store, StoreError};

/// Past its grace period, a detached session is ended this much later: the
/// agent ends it at the grace period, and a resume arriving at that moment
/// hears the agent's reason rather than a store that ran ahead.
pub const ABANDON_SLACK_MS: i64 = 5_000;

/// What a resume is checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResumeRecord {
    pub session: String,
    /// SHA-256 of the resume secret, hex.
    pub secret_hash: String,
    /// The ticket's claims, JSON.
    pub claims: String,
    /// The node holding the guest's connection.
    pub node: String,
    pub grace_ms: u64,
    /// Since when no control plane carries it.
    pub detached_at: Option<OffsetDateTime>,
}

impl Store {
    /// Records a resumable relay session that has just started: open, its
    /// start in the audit trail, and what a resume is checked against.
    pub async fn start_resumable_session(
        &self,
        open: &OpenSession,
        resume: &ResumeRecord,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        start(&mut tx, open).await?;
        sqlx::query(
            "INSERT INTO relay_resume (session, secret_hash, claims, node, grace_ms, detached_at)
             VALUES ($1, $2, $3, $4, $5, NULL) ON CONFLICT DO NOTHING",
        )
        .bind(&resume.session)
        .bind(&resume.secret_hash)
        .bind(&resume.claims)
        .bind(&resume.node)
        .bind(resume.grace_ms as i64)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The open resumable session `session`, with what a resume is checked
    /// against.
    pub async fn resumable_session(
        &self,
        session: &str,
    ) -> Result<Option<(OpenSession, ResumeRecord)>, StoreError> {
        let row = sqlx::query(
            "SELECT o.*, r.secret_hash, r.claims, r.node AS resume_node, r.grace_ms, r.detached_at
             FROM open_sessions o JOIN relay_resume r ON r.session = o.id WHERE o.id = $1",
        )
        .bind(session)
        .fetch_optional(&self.read)
        .await?;
        row.as_ref().map(resume_row).transpose()
    }

    /// The resumable sessions no control plane carries now.
    pub async fn waiting_sessions(&self) -> Result<Vec<(OpenSession, ResumeRecord)>, StoreError> {
        let rows = sqlx::query(
            "SELECT o.*, r.secret_hash, r.claims, r.node AS resume_node, r.grace_ms, r.detached_at
             FROM open_sessions o JOIN relay_resume r ON r.session = o.id WHERE r.detached_at IS NOT NULL",
        )
        .fetch_all(&self.read)
        .await?;
        rows.iter().map(resume_row).collect()
    }

    /// How session `session` ended, if it did: its principal and reason.
    pub async fn session_end(&self, session: &str) -> Result<Option<(String, String)>, StoreError> {
        let row =
            sqlx::query("SELECT principal, reason FROM audit_events WHERE session = $1 AND action = $2")
                .bind(session)
                .bind(AuditAction::SessionEnd.as_str())
                .fetch_optional(&self.read)
                .await?;
        Ok(row.map(|r| {
            (
                r.get("principal"),
                r.get::<Option<String>, _>("reason").unwrap_or_default(),
            )
        }))
    }

    /// No control plane carries session `session` since `now` (its client
    /// went away, or its replica is stopping): its grace period counts.
    /// Only `leg`, the connection that carried it last, says so: a leg
    /// that ends after a resume began ([`Store::claim_leg`]) leaves the
    /// session to the one that resumed it.
    /// Whether it did (not when another leg took it on, nor when it was
    /// detached already).
    pub async fn detach_session(
        &self,
        session: &str,
        leg: u64,
        now: OffsetDateTime,
    ) -> Result<bool, StoreError> {
        let done = self
            .exec(
                sqlx::query(
                    "UPDATE relay_resume SET detached_at = $1
                 WHERE session = $2 AND detached_at IS NULL AND leg = $3",
                )
                .bind(to_millis(now))
                .bind(session)
                .bind(leg as i64),
            )
            .await?;
        Ok(done.rows_affected() > 0)
    }

    /// A resume of session `session` is about to ask its node: the
    /// connection it makes is the session's next leg, and the legs before
    /// it no longer detach or end it (the node cuts their side when it
    /// takes the resume, which they may see first as a failure of their
    /// own). The new leg's number, or `None` when the session has ended.
    pub async fn claim_leg(&self, session: &str) -> Result<Option<u64>, StoreError> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE relay_resume SET leg = leg + 1 WHERE session = $1")
            .bind(session)
            .execute(&mut *tx)
            .await?;
        let leg = sqlx::query("SELECT leg FROM relay_resume WHERE session = $1")
            .bind(session)
            .fetch_optional(&mut *tx)
            .await?
            .map(|row| row.get::<i64, _>("leg").max(0) as u64);
        tx.commit().await?;
        Ok(leg)
    }

    /// Records the end of session `end.session` as carried by `leg`: only
    /// while that leg is still the session's last (see
    /// [`Store::claim_leg`]). Whether it was, and the session ended.
    pub async fn end_leg(&self, leg: u64, end: &AuditEvent) -> Result<bool, StoreError> {
        let Some(session) = &end.session else {
            return Err(StoreError::Invalid("an end record names its session".into()));
        };
        let mut tx = self.begin_write().await?;
        let last = sqlx::query("SELECT leg FROM relay_resume WHERE session = $1")
            .bind(session)
            .fetch_optional(&mut *tx)
            .await?
            .map(|row| row.get::<i64, _>("leg"));
        if last != Some(leg as i64) {
            return Ok(false);
        }
        finish(&mut tx, end).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Session `session`'s guest moved to `node`, which holds it now.
    pub async fn move_session(&self, session: &str, node: &str) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE relay_resume SET node = $1 WHERE session = $2")
            .bind(node)
            .bind(session)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE open_sessions SET node = $1 WHERE id = $2")
            .bind(node)
            .bind(session)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Session `resumed.session` goes on, carried by `replica`:
    /// `resumed` is its `session_resume` record.
    pub async fn resume_session(&self, replica: &str, resumed: &AuditEvent) -> Result<(), StoreError> {
        let Some(session) = &resumed.session else {
            return Err(StoreError::Invalid("a resume record names its session".into()));
        };
        let mut tx = self.begin_write().await?;
        sqlx::query("UPDATE relay_resume SET detached_at = NULL WHERE session = $1")
            .bind(session)
            .execute(&mut *tx)
            .await?;
        sqlx::query("UPDATE open_sessions SET replica = $1 WHERE id = $2")
            .bind(replica)
            .bind(session)
            .execute(&mut *tx)
            .await?;
        crate::sessions::insert_audit(&mut tx, resumed).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records the resumable sessions detached for longer than their grace
    /// period (and [`ABANDON_SLACK_MS`]) as ended. Returns how many.
    pub async fn end_abandoned_sessions(&self, now: OffsetDateTime) -> Result<u64, StoreError> {
        let rows = sqlx::query(
            "SELECT o.*, r.grace_ms FROM open_sessions o JOIN relay_resume r ON r.session = o.id
             WHERE r.detached_at IS NOT NULL AND r.detached_at + r.grace_ms + $1 < $2",
        )
        .bind(ABANDON_SLACK_MS)
        .bind(to_millis(now))
        .fetch_all(&self.read)
        .await?;
        if rows.is_empty() {
            return Ok(0);
        }
        let mut tx = self.begin_write().await?;
        for row in &rows {
            let open = open_session(row)?;
            let grace_s = row.get::<i64, _>("grace_ms") / 1000;
            let end = AuditEvent {
                id: 0,
                at: now,
                principal: open.principal,
                action: AuditAction::SessionEnd,
                target: Some(open.target),
                port: Some(open.port),
                transport: Some(Transport::Relay),
                node: Some(open.node),
                allowed: true,
                reason: Some(format!("not resumed within the grace period ({grace_s}s)")),
                bytes_up: None,
                bytes_down: None,
                duration_ms: Some((now - open.started_at).whole_milliseconds().max(0) as u64),
                session: Some(open.id),
            };
            finish(&mut tx, &end).await?;
        }
        tx.commit().await?;
        Ok(rows.len() as u64)
    }
}

fn resume_row(row: &sqlx::any::AnyRow) -> Result<(OpenSession, ResumeRecord), StoreError> {
    let open = open_session(row)?;
    let record = ResumeRecord {
        session: open.id.clone(),
        secret_hash: row.get("secret_hash"),
        claims: row.get("claims"),
        node: row.get("resume_node"),
        grace_ms: row.get::<i64, _>("grace_ms").max(0) as u64,
        detached_at: row.get::<Option<i64>, _>("detached_at").map(from_millis),
    };
    Ok((open, record))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{on_both, TestStore};

    fn open(id: &str, at: OffsetDateTime) -> OpenSession {
        OpenSession {
            id: id.into(),
            principal: "user:alice".into(),
            target: "echo1".into(),
            port: 7,
            transport: Transport::Relay,
            node: "node1".into(),
            replica: Some("r1".into()),
            started_at: at,
            bytes_up: 0,
            bytes_down: 0,
            bytes_at: None,
        }
    }

    fn record(id: &str) -> ResumeRecord {
        ResumeRecord {
            session: id.into(),
            secret_hash: "00".into(),
            claims: "{}".into(),
            node: "node1".into(),
            grace_ms: 60_000,
            detached_at: None,
        }
    }

    fn event(id: &str, action: AuditAction, reason: &str, at: OffsetDateTime) -> AuditEvent {
        AuditEvent {
            id: 0,
            at,
            principal: "user:alice".into(),
            action,
            target: Some("echo1".into()),
            port: Some(7),
            transport: Some(Transport::Relay),
            node: Some("node1".into()),
            allowed: true,
            reason: Some(reason.into()),
            bytes_up: None,
            bytes_down: None,
            duration_ms: None,
            session: Some(id.into()),
        }
    }

    on_both! {
        async fn a_leg_a_resume_took_over_neither_detaches_nor_ends_its_session(store) {
            let t0 = OffsetDateTime::now_utc();
            store.start_resumable_session(&open("s1", t0), &record("s1")).await.unwrap();
            // A resume claims leg 1 before it asks the node, and the node
            // cuts leg 0's side: leg 0 ends as if the node failed.
            assert_eq!(store.claim_leg("s1").await.unwrap(), Some(1));
            assert!(!store.detach_session("s1", 0, t0).await.unwrap());
            let (_, r) = store.resumable_session("s1").await.unwrap().unwrap();
            assert_eq!(r.detached_at, None, "a stale leg does not detach it");
            let stale = event("s1", AuditAction::SessionEnd, "connection to node node1 failed", t0);
            assert!(!store.end_leg(0, &stale).await.unwrap(), "nor end it");
            assert!(store.resumable_session("s1").await.unwrap().is_some());
            assert_eq!(store.session_end("s1").await.unwrap(), None);
            store
                .resume_session("r1", &event("s1", AuditAction::SessionResume, "resumed", t0))
                .await
                .unwrap();
            // The leg that carries it does both.
            assert!(store.detach_session("s1", 1, t0).await.unwrap());
            assert!(!store.detach_session("s1", 1, t0).await.unwrap(), "once");
            let (_, r) = store.resumable_session("s1").await.unwrap().unwrap();
            assert!(r.detached_at.is_some());
            assert_eq!(store.claim_leg("s1").await.unwrap(), Some(2));
            store
                .resume_session("r1", &event("s1", AuditAction::SessionResume, "resumed", t0))
                .await
                .unwrap();
            assert!(store.end_leg(2, &event("s1", AuditAction::SessionEnd, "closed", t0)).await.unwrap());
            assert!(store.resumable_session("s1").await.unwrap().is_none());
            assert_eq!(
                store.session_end("s1").await.unwrap(),
                Some(("user:alice".to_string(), "closed".to_string()))
            );
            // An ended session has no leg to claim.
            assert_eq!(store.claim_leg("s1").await.unwrap(), None);
            assert!(!store.end_leg(2, &event("s1", AuditAction::SessionEnd, "again", t0)).await.unwrap());
        }
    }
}
