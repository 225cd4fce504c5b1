//! The audit trail's writer: records are written in batches — whatever is
//! waiting, in one multi-row statement, one commit (group commit; see
//! [`Store::add_audit_statement`]) — and a caller that needs its record
//! durable waits for it. The broker does: a credential is returned only
//! after its decision is in the trail, so a crash or a shutdown never
//! leaves a credential nobody audited. Under load many decisions share one
//! commit, so waiting costs little; and under load the writer first lets
//! the tasks already running add theirs ([`LINGER_TURNS`]), so a commit
//! carries what one turn of the runtime brings, not what arrived while
//! the last one was written.

use std::time::Instant;

use otherix_store::{AuditEvent, Store, MAX_AUDIT_BATCH};
use tokio::sync::{mpsc, oneshot};

/// Most records one batch carries.
const BATCH: usize = MAX_AUDIT_BATCH;
/// Under load (the last batch held more than one record), turns of the
/// runtime the writer yields before it writes, while each turn brings
/// more records and the batch is under [`LINGER_UNTIL`]: the tasks that
/// are ready run first, and those about to be audited join this commit
/// instead of making the next one. At the broker's 19,000/s a commit
/// carried 6 records, each commit a round trip to the database's thread
/// and WAL pages of its own; a lone caller never waits for a turn.
const LINGER_TURNS: usize = 4;
/// Records past which a batch is written without waiting for more: a
/// commit's own cost is spread thin by then, and a larger batch only
/// holds its callers longer (and leaves the cores idle while the
/// database writes it).
const LINGER_UNTIL: usize = 32;
/// Records waiting to be written before callers wait to enqueue.
const QUEUE: usize = 16_384;

type Done = Option<oneshot::Sender<Result<(), String>>>;

/// Handle to the writer task. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AuditWriter {
    tx: mpsc::Sender<Message>,
    /// Bumped after each batch is durable: the web console follows it.
    written: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
}

#[derive(Debug)]
enum Message {
    Record(Box<AuditEvent>, Done),
    /// Write what is queued, then stop.
    Close(oneshot::Sender<()>),
}

/// Why a record could not be written.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("the audit trail is closed (the control plane is stopping)")]
    Closed,
    #[error("writing the audit trail failed: {0}")]
    Store(String),
}

impl AuditWriter {
    /// Starts the writer on `store`.
    pub fn spawn(store: Store) -> AuditWriter {
        let (tx, rx) = mpsc::channel(QUEUE);
        let written = std::sync::Arc::new(tokio::sync::watch::channel(0).0);
        tokio::spawn(run(store, rx, written.clone()));
        AuditWriter { tx, written }
    }

    /// Changes whenever a batch of records has been written.
    pub fn written(&self) -> tokio::sync::watch::Receiver<u64> {
        self.written.subscribe()
    }

    /// Writes `event` and waits until it is durable.
    pub async fn write(&self, event: AuditEvent) -> Result<(), AuditError> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send(Message::Record(Box::new(event), Some(done)))
            .await
            .map_err(|_| AuditError::Closed)?;
        match wait.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(AuditError::Store(e)),
            Err(_) => Err(AuditError::Closed),
        }
    }

    /// Queues `event` without waiting for it (session records written on
    /// the side of a running session); a failure is logged.
    pub fn record(&self, event: AuditEvent) {
        if let Err(e) = self.tx.try_send(Message::Record(Box::new(event), None)) {
            tracing::error!(error = %e, "audit queue full or closed; a record is lost");
        }
    }

    /// Writes everything queued so far, then stops the writer.
    pub async fn close(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Message::Close(done)).await.is_ok() {
            let _ = wait.await;
        }
    }
}

async fn run(
    store: Store,
    mut rx: mpsc::Receiver<Message>,
    written: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
) {
    let mut batch: Vec<AuditEvent> = Vec::with_capacity(BATCH);
    let mut waiting: Vec<Done> = Vec::with_capacity(BATCH);
    let mut last = 0;
    while let Some(first) = rx.recv().await {
        let mut closing = take(Some(first), &mut rx, &mut batch, &mut waiting);
        if last > 1 {
            for _ in 0..LINGER_TURNS {
                if closing.is_some() || batch.len() >= LINGER_UNTIL {
                    break;
                }
                let had = batch.len();
                tokio::task::yield_now().await;
                closing = take(rx.try_recv().ok(), &mut rx, &mut batch, &mut waiting);
                if batch.len() == had {
                    break;
                }
            }
        }
        last = batch.len();
        if !batch.is_empty() {
            if write(&store, &batch, &mut waiting).await {
                written.send_modify(|n| *n = n.wrapping_add(1));
            }
            batch.clear();
        }
        if let Some(done) = closing {
            rx.close();
            // Anything sent before the close was seen is still written.
            loop {
                take(rx.try_recv().ok(), &mut rx, &mut batch, &mut waiting);
                if batch.is_empty() {
                    break;
                }
                write(&store, &batch, &mut waiting).await;
                batch.clear();
            }
            let _ = done.send(());
            return;
        }
    }
}

/// Adds `next` and whatever else is queued to `batch` (up to [`BATCH`]
/// records): the close, if one came, is returned and ends the batch.
fn take(
    mut next: Option<Message>,
    rx: &mut mpsc::Receiver<Message>,
    batch: &mut Vec<AuditEvent>,
    waiting: &mut Vec<Done>,
) -> Option<oneshot::Sender<()>> {
    while let Some(msg) = next.take() {
        match msg {
            Message::Record(e, done) => {
                batch.push(*e);
                waiting.push(done);
            }
            Message::Close(done) => return Some(done),
        }
        if batch.len() < BATCH {
            next = rx.try_recv().ok();
        }
    }
    None
}

/// Writes `batch` (at most [`BATCH`] records) in one statement, one
/// commit, and tells each waiter whether it was written. Drains
/// `waiting`, which holds one entry per record of `batch`. True when it
/// was written (the trail changed).
async fn write(store: &Store, batch: &[AuditEvent], waiting: &mut Vec<Done>) -> bool {
    let started = Instant::now();
    let result = store.add_audit_statement(batch).await;
    metrics::histogram!("otherix_audit_batch_records").record(batch.len() as f64);
    metrics::histogram!("otherix_audit_commit_seconds").record(started.elapsed().as_secs_f64());
    if let Err(e) = &result {
        tracing::error!(error = %e, records = batch.len(), "audit write failed");
    }
    let written = result.is_ok();
    let result = result.map_err(|e| e.to_string());
    for done in waiting.drain(..).flatten() {
        let _ = done.send(result.clone());
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;
    use otherix_proto::AuditAction;
    use time::OffsetDateTime;

    fn event(i: usize) -> AuditEvent {
        AuditEvent {
            id: 0,
            at: OffsetDateTime::now_utc(),
            principal: format!("user:u{i}"),
            action: AuditAction::Broker,
            target: Some("web01".into()),
            port: Some(22),
            transport: None,
            node: None,
            allowed: true,
            reason: None,
            bytes_up: None,
            bytes_down: None,
            duration_ms: None,
            session: None,
        }
    }

    async fn count(store: &Store) -> usize {
        store
            .audit_page(
                otherix_proto::AuditCursor::at_or_after(OffsetDateTime::UNIX_EPOCH),
                &otherix_store::AuditFilter::default(),
                5000,
            )
            .await
            .unwrap()
            .0
            .len()
    }

    #[tokio::test]
    async fn concurrent_writers_are_durable_when_answered_and_close_drains_the_queue() {
        let store = Store::open_in_memory().await.unwrap();
        let w = AuditWriter::spawn(store.clone());
        let writes: Vec<_> = (0..300)
            .map(|i| {
                let w = w.clone();
                tokio::spawn(async move { w.write(event(i)).await })
            })
            .collect();
        for t in writes {
            t.await.unwrap().unwrap();
        }
        assert_eq!(count(&store).await, 300, "every answered write is in the trail");
        for i in 0..50 {
            w.record(event(1000 + i));
        }
        w.close().await;
        assert_eq!(
            count(&store).await,
            350,
            "what was queued before the close is written"
        );
        assert!(matches!(w.write(event(9)).await, Err(AuditError::Closed)));
    }

    #[tokio::test]
    async fn close_writes_everything_queued_even_past_a_batch() {
        let store = Store::open_in_memory().await.unwrap();
        let w = AuditWriter::spawn(store.clone());
        for i in 0..BATCH * 2 + 100 {
            w.record(event(i));
        }
        w.close().await;
        assert_eq!(count(&store).await, BATCH * 2 + 100);
    }

    /// One record queued, then `n` tasks woken that write one each: they
    /// are ready to run when the writer takes the first. Returns when all
    /// are durable.
    async fn one_then_n_ready(w: &AuditWriter, n: usize) {
        let go = std::sync::Arc::new(tokio::sync::Notify::new());
        let mut tasks = Vec::new();
        for i in 0..n {
            let (y, go) = (w.clone(), go.clone());
            tasks.push(tokio::spawn(async move {
                go.notified().await;
                y.write(event(i + 1)).await
            }));
        }
        // Each waits for `go` before the first is queued.
        tokio::task::yield_now().await;
        w.record(event(0));
        go.notify_waiters();
        for t in tasks {
            t.await.unwrap().unwrap();
        }
    }

    #[tokio::test]
    async fn a_lone_record_is_written_at_once_and_under_load_the_ready_tasks_join_its_commit() {
        let store = Store::open_in_memory().await.unwrap();
        let w = AuditWriter::spawn(store.clone());
        let batches = w.written();
        // Idle: the first record is written alone, without waiting a turn
        // for the others (which make a batch of their own).
        one_then_n_ready(&w, 5).await;
        assert_eq!(*batches.borrow(), 2, "the lone record went alone");
        // Under load (the last batch held 5): the record waits while the
        // tasks the turn brings add theirs, and all six share a commit.
        one_then_n_ready(&w, 5).await;
        assert_eq!(*batches.borrow(), 3, "one commit for the six");
        assert_eq!(count(&store).await, 12);
    }
}
