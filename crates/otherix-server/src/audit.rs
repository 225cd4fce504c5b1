//! The audit trail's writer: records are written in batches — whatever is
//! waiting, in a few multi-row statements, each its own commit (group
//! commit; see [`Store::add_audit_statement`]) — and a caller that needs its
//! record durable waits for it. The broker does: a credential is returned
//! only after its decision is in the trail, so a crash or a shutdown never
//! leaves a credential nobody audited. Under load many decisions share one
//! commit, so waiting costs little.

use std::time::Instant;

use otherix_store::{audit_rows_per_statement, AuditEvent, Store};
use tokio::sync::{mpsc, oneshot};

/// Most records one batch carries.
const BATCH: usize = 512;
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
    while let Some(first) = rx.recv().await {
        let mut closing = None;
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            match msg {
                Message::Record(e, done) => {
                    batch.push(*e);
                    waiting.push(done);
                }
                Message::Close(done) => {
                    closing = Some(done);
                    break;
                }
            }
            if batch.len() < BATCH {
                next = rx.try_recv().ok();
            }
        }
        if !batch.is_empty() {
            if write(&store, &batch, &mut waiting).await {
                written.send_modify(|n| *n = n.wrapping_add(1));
            }
            batch.clear();
        }
        if let Some(done) = closing {
            rx.close();
            // Anything sent before the close was seen is still written.
            let mut rest = Vec::new();
            let mut dones = Vec::new();
            while let Ok(Message::Record(e, d)) = rx.try_recv() {
                rest.push(*e);
                dones.push(d);
            }
            write(&store, &rest, &mut dones).await;
            let _ = done.send(());
            return;
        }
    }
}

/// Writes `batch` in statements of [`audit_rows_per_statement`] records,
/// in order, each its own commit, and tells each waiter whether its own
/// record's statement was written (never the fate of another's). Drains
/// `waiting`, which holds one entry per record of `batch`. True when any
/// statement was written (the trail changed).
async fn write(store: &Store, batch: &[AuditEvent], waiting: &mut Vec<Done>) -> bool {
    let mut any = false;
    let mut waiting = waiting.drain(..);
    let mut rest = batch;
    while !rest.is_empty() {
        let (these, after) = rest.split_at(audit_rows_per_statement(rest.len()));
        let started = Instant::now();
        let result = store.add_audit_statement(these).await;
        metrics::histogram!("otherix_audit_batch_records").record(these.len() as f64);
        metrics::histogram!("otherix_audit_commit_seconds").record(started.elapsed().as_secs_f64());
        if let Err(e) = &result {
            tracing::error!(error = %e, records = these.len(), "audit write failed");
        } else {
            any = true;
        }
        let result = result.map_err(|e| e.to_string());
        for done in waiting.by_ref().take(these.len()).flatten() {
            let _ = done.send(result.clone());
        }
        rest = after;
    }
    any
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
}
