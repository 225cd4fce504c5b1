//! The SQLite store's WAL checkpoints, run by a task of their own instead
//! of inside the commit that happens to take the WAL over its threshold.
//!
//! By default SQLite checkpoints inside the `COMMIT` of whichever
//! connection takes the WAL past 1,000 pages (`wal_autocheckpoint`): that
//! commit copies the WAL back into the database file and `fsync`s it, and
//! its caller — the broker's audit rows, whose credentials wait for their
//! commit — waits for all of it. The store turns that off on its
//! connections and checkpoints on a timer instead (`PASSIVE`, which waits
//! for no reader), and each checkpoint copies a page the writes touched
//! many times once. Once the WAL is copied back whole, the next write
//! starts it again from its beginning, so its size stays about what is
//! written between two checkpoints. A reader that holds an old snapshot
//! through several checkpoints keeps the WAL from starting over; when the
//! file has grown past [`WalPolicy::truncate_above`] the checkpoint waits
//! for readers (a second at most) and truncates it.
//!
//! A checkpoint runs in two passes. The first copies the bulk on a
//! connection of its own (the copier), beside the writes: a `PASSIVE`
//! checkpoint takes no write lock, and with the broker busy it copies
//! thousands of pages (tens of milliseconds) that every write, and every
//! credential waiting for its audit row, would otherwise wait for. The
//! second runs on the store's one write connection, between two writes,
//! and copies only what was committed during the first: with nothing left
//! to copy and no writer in the middle of a commit, the next write starts
//! the WAL over. A copier that fails leaves the whole copy to the second
//! pass, and is opened again at the next checkpoint.
//!
//! A `TRUNCATE` runs on the write connection too, never beside the
//! writes: on a connection of its own it took the write lock, and a write
//! transaction that had begun by reading (a deferred `BEGIN`) and then
//! wanted to write got `SQLITE_BUSY` at once, without waiting (SQLite
//! cannot let a reader wait for the write lock: its snapshot may be stale
//! by then).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sqlx::any::AnyConnectOptions;
use sqlx::{AnyConnection, ConnectOptions as _, Connection as _, Executor as _};
use tokio::sync::{watch, Mutex};

use crate::{StoreError, Writer};

/// When the SQLite store copies its WAL back into the database file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalPolicy {
    /// How often a checkpoint runs. Between two, the WAL holds what was
    /// written meanwhile: each broker credential's audit row dirties a
    /// page or two of its indexes, so at 10,000 credentials/s ~40 MB at
    /// the default.
    pub every: Duration,
    /// The WAL's size on disk above which a checkpoint also truncates it
    /// (`TRUNCATE`, which waits for readers and holds writers back for as
    /// long): it gets there only when readers kept the WAL from starting
    /// over. Whenever the WAL starts over, SQLite cuts its file back to the
    /// smaller of this and [`WAL_KEPT`] (`journal_size_limit`).
    pub truncate_above: u64,
}

impl Default for WalPolicy {
    fn default() -> WalPolicy {
        WalPolicy {
            every: Duration::from_millis(500),
            truncate_above: 256 << 20,
        }
    }
}

/// The most of the WAL's file SQLite keeps when the WAL starts over (a
/// file reused is cheaper to write than one grown again; one that a burst
/// grew is cut back).
pub const WAL_KEPT: u64 = 64 << 20;

/// How long a `TRUNCATE` waits for readers.
const TRUNCATE_BUSY_MS: u64 = 1_000;

/// What one checkpoint did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checkpointed {
    /// Pages in the WAL when it ran.
    pub wal_pages: u64,
    /// Of them, copied back into the database file (all of them, unless a
    /// reader still needed older ones or a writer was committing).
    pub copied: u64,
    /// Of those, copied back by the end of the first pass, beside the
    /// writes (SQLite counts a WAL's copied pages from its start over, so
    /// pages an earlier checkpoint copied count too); the rest waited for
    /// the write connection.
    pub copied_beside: u64,
    /// Whether the WAL was over [`WalPolicy::truncate_above`] and truncated
    /// (false when it was over and a reader kept it from being truncated).
    pub truncated: bool,
}

/// The connection of a checkpoint's first pass, shared by the timer's
/// task and the store.
type Copier = Arc<Mutex<CopierConn>>;

/// The copier's connection, and how to open it again.
pub(crate) struct CopierConn {
    /// `None` after a failed pass (opened again at the next one) or once
    /// the store is closed.
    conn: Option<AnyConnection>,
    /// The store is closed: never opened again.
    closed: bool,
    /// The last pass failed: said once, not at every tick.
    failing: bool,
    options: AnyConnectOptions,
    /// Run on each connection opened (the store's pragmas).
    setup: String,
}

impl std::fmt::Debug for CopierConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopierConn")
            .field("open", &self.conn.is_some())
            .field("closed", &self.closed)
            .field("failing", &self.failing)
            .finish_non_exhaustive()
    }
}

impl CopierConn {
    /// A copier on `options`, opened now (so a store that cannot open it
    /// is not opened either); `setup` runs on it and on each reopened one.
    pub(crate) async fn open(options: AnyConnectOptions, setup: String) -> Result<CopierConn, StoreError> {
        let mut copier = CopierConn {
            conn: None,
            closed: false,
            failing: false,
            options,
            setup,
        };
        copier.conn = Some(connect(&copier.options, &copier.setup).await?);
        Ok(copier)
    }

    /// One `PASSIVE` checkpoint, on a connection opened again if the last
    /// pass failed: the pages it copied. A connection that fails is
    /// dropped, for the next pass to replace (so is one whose pass was
    /// cancelled: a `Store::checkpoint_wal` caller that gave up).
    async fn pass(&mut self) -> Result<u64, StoreError> {
        let mut conn = match self.conn.take() {
            Some(conn) => conn,
            None => connect(&self.options, &self.setup).await?,
        };
        let (_busy, _wal_pages, copied): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
            .fetch_one(&mut conn)
            .await?;
        self.conn = Some(conn);
        Ok(copied.max(0) as u64)
    }

    /// Closes the connection, for good: no pass opens another.
    async fn close(&mut self) {
        self.closed = true;
        if let Some(conn) = self.conn.take() {
            let _ = conn.close().await;
        }
    }
}

/// The store's side of the checkpointer: the connections it checkpoints
/// through (its own, and the store's one write connection), the WAL's
/// file, and a count of the checkpoints the task has run (tests wait on
/// it).
#[derive(Debug)]
pub(crate) struct Wal {
    writer: Writer,
    copier: Copier,
    file: PathBuf,
    policy: WalPolicy,
    runs: watch::Receiver<u64>,
}

impl Wal {
    /// Starts the task that checkpoints the WAL at `file` through `copier`
    /// (a read-write connection of its own) and `writer` (the store's one
    /// write connection) every `policy.every`. It stops when the store is
    /// closed or the last handle is dropped.
    pub(crate) fn spawn(writer: Writer, copier: CopierConn, file: PathBuf, policy: WalPolicy) -> Wal {
        let (runs_tx, runs) = watch::channel(0u64);
        let copier = Arc::new(Mutex::new(copier));
        tokio::spawn(run(writer.clone(), copier.clone(), file.clone(), policy, runs_tx));
        Wal {
            writer,
            copier,
            file,
            policy,
            runs,
        }
    }

    pub(crate) async fn checkpoint(&self) -> Result<Checkpointed, StoreError> {
        checkpoint(&self.writer, &self.copier, &self.file, self.policy.truncate_above).await
    }

    pub(crate) fn runs(&self) -> watch::Receiver<u64> {
        self.runs.clone()
    }

    /// Closes the copier's connection, after a pass it is in the middle
    /// of.
    pub(crate) async fn close(&self) {
        self.copier.lock().await.close().await;
    }
}

async fn run(writer: Writer, copier: Copier, file: PathBuf, policy: WalPolicy, runs: watch::Sender<u64>) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + policy.every, policy.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            // Every handle (the store's clones, a test's receiver) is gone.
            _ = runs.closed() => return,
        }
        if writer.is_closed() {
            return;
        }
        match checkpoint(&writer, &copier, &file, policy.truncate_above).await {
            Ok(done) if done.truncated || done.copied < done.wal_pages => {
                tracing::debug!(
                    wal_pages = done.wal_pages,
                    copied = done.copied,
                    copied_beside = done.copied_beside,
                    truncated = done.truncated,
                    "WAL checkpoint"
                );
            }
            Ok(_) => {}
            Err(_) if writer.is_closed() => return,
            Err(e) => tracing::warn!(error = %e, "WAL checkpoint failed; retrying at the next tick"),
        }
        runs.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// A `PASSIVE` checkpoint beside the writes (see [`copy_beside`]), another
/// between two writes for what was committed meanwhile, then a `TRUNCATE`
/// one if the WAL's file is still over `truncate_above` bytes.
async fn checkpoint(
    writer: &Writer,
    copier: &Copier,
    file: &Path,
    truncate_above: u64,
) -> Result<Checkpointed, StoreError> {
    let copied_beside = copy_beside(copier).await;
    let mut conn = writer.conn().await?;
    let (_busy, wal_pages, copied): (i64, i64, i64) = sqlx::query_as("PRAGMA wal_checkpoint(PASSIVE)")
        .fetch_one(&mut *conn)
        .await?;
    let size = tokio::fs::metadata(file).await.map(|m| m.len()).unwrap_or(0);
    let mut truncated = false;
    if size > truncate_above {
        // Waits for readers (the connection's busy timeout, a second here)
        // while the writes wait for the connection; a reader that outlasts
        // it leaves it for next time.
        sqlx::query(&format!("PRAGMA busy_timeout = {TRUNCATE_BUSY_MS}"))
            .execute(&mut *conn)
            .await?;
        let done: Result<(i64, i64, i64), _> = sqlx::query_as("PRAGMA wal_checkpoint(TRUNCATE)")
            .fetch_one(&mut *conn)
            .await;
        sqlx::query(&format!("PRAGMA busy_timeout = {}", crate::BUSY_MS))
            .execute(&mut *conn)
            .await?;
        truncated = done?.0 == 0;
        if !truncated {
            tracing::warn!(
                wal_bytes = size,
                "the WAL is over its limit and a reader kept it from being truncated"
            );
        }
    }
    let copied = copied.max(0) as u64;
    Ok(Checkpointed {
        wal_pages: wal_pages.max(0) as u64,
        copied,
        copied_beside: copied_beside.min(copied),
        truncated,
    })
}

/// A connection on `options`, `setup` run on it.
async fn connect(options: &AnyConnectOptions, setup: &str) -> Result<AnyConnection, StoreError> {
    let mut conn = options.connect().await?;
    conn.execute(setup).await?;
    Ok(conn)
}

/// The first pass: a `PASSIVE` checkpoint on the copier's connection,
/// which takes no write lock, so writes go on meanwhile. The pages it
/// copied; 0 once the store is closed, or if it failed (the second pass
/// then copies them all). A failure is logged when it starts and when it
/// ends, not at every tick.
async fn copy_beside(copier: &Copier) -> u64 {
    let mut copier = copier.lock().await;
    if copier.closed {
        return 0;
    }
    match copier.pass().await {
        Ok(copied) => {
            if std::mem::take(&mut copier.failing) {
                tracing::info!("WAL checkpoints copy beside the writes again");
            }
            copied
        }
        Err(e) => {
            if std::mem::replace(&mut copier.failing, true) {
                tracing::debug!(error = %e, "WAL checkpoint beside the writes failed again");
            } else {
                tracing::warn!(
                    error = %e,
                    "WAL checkpoint beside the writes failed; the write connection copies it all until a new connection for it opens"
                );
            }
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};
    use std::time::Duration;

    use time::OffsetDateTime;

    use super::WalPolicy;
    use crate::testing::Dir;
    use crate::{AuditEvent, AuditFilter, Store};

    fn wal_bytes(db: &Path) -> u64 {
        let mut wal = db.as_os_str().to_owned();
        wal.push("-wal");
        std::fs::metadata(PathBuf::from(wal))
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// `n` broker-like records, to random-ish targets so that each dirties
    /// index pages all over, as the broker's do.
    async fn write_records(store: &Store, first: usize, n: usize) {
        let mut batch = Vec::with_capacity(64);
        for i in first..first + n {
            batch.push(AuditEvent {
                id: 0,
                at: OffsetDateTime::now_utc(),
                principal: format!("grant:g{}", i % 97),
                action: otherix_proto::AuditAction::Broker,
                target: Some(format!("vm-{:05}", (i * 7919) % 10_007)),
                port: Some(22),
                transport: None,
                node: None,
                allowed: true,
                reason: None,
                bytes_up: None,
                bytes_down: None,
                duration_ms: None,
                session: None,
            });
            if batch.len() == 64 || i + 1 == first + n {
                store.add_audit_statement(&batch).await.unwrap();
                batch.clear();
            }
        }
    }

    async fn count(store: &Store) -> usize {
        let mut n = 0;
        let mut from = otherix_proto::api::AuditCursor::at_or_after(OffsetDateTime::UNIX_EPOCH);
        loop {
            let (page, next) = store
                .audit_page(from, &AuditFilter::default(), 1000)
                .await
                .unwrap();
            n += page.len();
            match next {
                Some(c) => from = c,
                None => return n,
            }
        }
    }

    #[tokio::test]
    async fn a_commit_never_checkpoints_and_a_checkpoint_bounds_the_wal_and_loses_nothing() {
        let dir = Dir::new("commit");
        let db = dir.0.join("otherix.db");
        // A timer that never fires during the test: only the test checkpoints.
        let policy = WalPolicy {
            every: Duration::from_secs(3600),
            truncate_above: 1 << 20,
        };
        let store = Store::open_with(&db, policy).await.unwrap();
        // SQLite's own auto-checkpoint would start the WAL over at about
        // 1,000 pages (4 MiB); with it off the WAL holds every commit.
        let mut written = 0;
        while wal_bytes(&db) < 8 << 20 {
            assert!(written < 100_000, "the WAL stays small: a commit checkpoints");
            write_records(&store, written, 2_048).await;
            written += 2_048;
        }
        let done = store.checkpoint_wal().await.unwrap().expect("a SQLite file");
        assert_eq!(done.copied, done.wal_pages, "{done:?}");
        assert!(done.truncated, "{done:?}");
        assert_eq!(wal_bytes(&db), 0);
        assert_eq!(count(&store).await, written);

        // Written after the checkpoint, then the process "dies": the files
        // as it leaves them, copied aside while it still has them open.
        write_records(&store, written, 1_000).await;
        written += 1_000;
        let crashed = Dir::new("crashed");
        for name in ["otherix.db", "otherix.db-wal"] {
            std::fs::copy(dir.0.join(name), crashed.0.join(name)).unwrap();
        }
        let after_crash = Store::open_with(&crashed.0.join("otherix.db"), policy)
            .await
            .unwrap();
        assert_eq!(count(&after_crash).await, written);
        after_crash.close().await;

        // And a clean stop and start.
        store.close().await;
        let reopened = Store::open_with(&db, policy).await.unwrap();
        assert_eq!(count(&reopened).await, written);
        reopened.close().await;
    }

    /// A store in a directory of its own whose timer never fires during a
    /// test: only the test checkpoints.
    async fn untimed(name: &str) -> (Dir, PathBuf, WalPolicy, Store) {
        let dir = Dir::new(name);
        let db = dir.0.join("otherix.db");
        let policy = WalPolicy {
            every: Duration::from_secs(3600),
            truncate_above: 256 << 20,
        };
        let store = Store::open_with(&db, policy).await.unwrap();
        (dir, db, policy, store)
    }

    #[tokio::test]
    async fn the_bulk_is_copied_beside_the_writes_and_the_write_connection_copies_the_rest() {
        let (_dir, db, policy, store) = untimed("beside").await;
        write_records(&store, 0, 2_048).await;
        let wal = store.wal.as_ref().expect("a SQLite file");

        // A write is in the middle of its transaction (the write connection
        // is held): the first pass copies every page all the same.
        {
            let held = store.write.conn().await.unwrap();
            let copied = tokio::time::timeout(Duration::from_secs(30), super::copy_beside(&wal.copier))
                .await
                .expect("the first pass never waits for the write connection");
            assert!(copied > 100, "{copied} pages");
            drop(held);
        }

        // Written after the first pass: the write connection's pass copies
        // them, and the WAL starts over at the next write.
        write_records(&store, 2_048, 512).await;
        let done = store.checkpoint_wal().await.unwrap().expect("a SQLite file");
        assert_eq!(done.copied, done.wal_pages, "{done:?}");
        assert_eq!(
            done.copied_beside, done.wal_pages,
            "nothing was written during it: {done:?}"
        );
        write_records(&store, 2_560, 1).await;
        let next = store.checkpoint_wal().await.unwrap().expect("a SQLite file");
        assert!(
            next.wal_pages > 0 && next.wal_pages < 16,
            "the WAL started over and holds one record's pages: {next:?} after {done:?}"
        );
        assert_eq!(count(&store).await, 2_561);

        // A clean close closes the copier too, and loses nothing.
        store.close().await;
        let wal = store.wal.as_ref().expect("a SQLite file");
        let copier = wal.copier.lock().await;
        assert!(copier.closed && copier.conn.is_none(), "the copier is closed");
        drop(copier);
        let reopened = Store::open_with(&db, policy).await.unwrap();
        assert_eq!(count(&reopened).await, 2_561);
        reopened.close().await;
    }

    #[tokio::test]
    async fn a_copier_that_fails_leaves_the_whole_copy_to_the_write_connection_and_is_opened_again() {
        let (_dir, db, _policy, store) = untimed("nocopier").await;
        write_records(&store, 0, 1_024).await;
        let wal = store.wal.as_ref().expect("a SQLite file");
        // A connection that cannot checkpoint in the copier's place: a
        // read-only one, whose pass fails when it writes the WAL's pages
        // into the database file it opened read-only.
        let read_only: sqlx::any::AnyConnectOptions =
            format!("{}?mode=ro", crate::sqlite_url(&db)).parse().unwrap();
        wal.copier.lock().await.conn = Some(sqlx::ConnectOptions::connect(&read_only).await.unwrap());
        let done = store.checkpoint_wal().await.unwrap().expect("a SQLite file");
        assert_eq!(done.copied, done.wal_pages, "{done:?}");
        assert_eq!(done.copied_beside, 0, "{done:?}");
        assert!(done.wal_pages > 100, "{done:?}");
        {
            let copier = wal.copier.lock().await;
            assert!(copier.failing && copier.conn.is_none(), "{copier:?}");
        }

        // The next checkpoint opens a new copier, which copies the bulk again.
        write_records(&store, 1_024, 1_024).await;
        let done = store.checkpoint_wal().await.unwrap().expect("a SQLite file");
        assert_eq!(done.copied, done.wal_pages, "{done:?}");
        assert_eq!(done.copied_beside, done.wal_pages, "{done:?}");
        {
            let copier = wal.copier.lock().await;
            assert!(!copier.failing && copier.conn.is_some(), "{copier:?}");
        }
        assert_eq!(count(&store).await, 2_048);

        // Once the store is closed it is never opened again.
        store.close().await;
        assert_eq!(super::copy_beside(&wal.copier).await, 0);
        assert!(wal.copier.lock().await.conn.is_none());
    }

    #[tokio::test]
    async fn the_checkpointer_keeps_the_wal_under_its_limit_while_writes_go_on() {
        let dir = Dir::new("timer");
        let db = dir.0.join("otherix.db");
        let policy = WalPolicy {
            every: Duration::from_millis(10),
            truncate_above: 512 << 10,
        };
        let store = Store::open_with(&db, policy).await.unwrap();
        let mut runs = store.wal_checkpoints().expect("a SQLite file");
        let mut written = 0;
        for _ in 0..40 {
            write_records(&store, written, 128).await;
            written += 128;
            // A checkpoint that started after these writes has finished.
            let seen = *runs.borrow_and_update();
            runs.wait_for(|n| *n >= seen + 2).await.unwrap();
            assert!(
                wal_bytes(&db) <= policy.truncate_above,
                "{} bytes",
                wal_bytes(&db)
            );
        }
        assert_eq!(count(&store).await, written);
        store.close().await;
    }

    #[tokio::test]
    async fn a_transaction_that_reads_then_writes_never_meets_a_locked_database_while_the_wal_is_truncated() {
        let dir = Dir::new("busy");
        let db = dir.0.join("otherix.db");
        // A tiny limit: nearly every checkpoint truncates, as often as it can.
        let policy = WalPolicy {
            every: Duration::from_millis(1),
            truncate_above: 16 << 10,
        };
        let store = Store::open_with(&db, policy).await.unwrap();
        let mut runs = store.wal_checkpoints().expect("a SQLite file");
        let writes = {
            let store = store.clone();
            tokio::spawn(async move { write_records(&store, 0, 4_096).await })
        };
        for i in 0..200 {
            // A read first, then a write, in one write transaction.
            let mut tx = store.begin_write().await.unwrap();
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM audit_events")
                .fetch_one(&mut *tx)
                .await
                .unwrap();
            sqlx::query("INSERT INTO meta (key, value) VALUES ($1, $2)")
                .bind(format!("busy-test-{i}"))
                .bind(n.to_string())
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
            if i % 20 == 0 {
                // Some checkpoints in between, whatever the scheduling.
                let seen = *runs.borrow_and_update();
                runs.wait_for(|n| *n > seen).await.unwrap();
            }
        }
        writes.await.unwrap();
        assert_eq!(count(&store).await, 4_096);
        store.close().await;
    }
}
