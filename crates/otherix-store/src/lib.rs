//! Persistence for the control plane: an embedded SQLite database (WAL) by
//! default, or a PostgreSQL database several replicas share, with versioned
//! migrations (one set per dialect) applied at start. One `Store` over both,
//! through sqlx's `Any` driver: the SQL is shared where the dialects agree.
//!
//! SQLite allows one writer at a time. Writes go through exactly one
//! connection, which the store holds itself (see [`Writer`]), so transactions
//! never race for the write lock (a deferred transaction that must upgrade to
//! a writer fails immediately under contention, which no busy timeout can
//! fix); reads use a pool of their own and, thanks to WAL, never wait for
//! writers. The WAL is copied back into the
//! database file by a task of its own, not inside a commit (`checkpoint`).
//! On PostgreSQL every write
//! transaction takes one advisory lock first, which serializes writers the
//! same way across replicas ([`Store::begin_write`]).

mod audit;
mod beats;
mod changes;
mod checkpoint;
mod error;
mod grants;
mod lbs;
mod migrate;
mod networks;
mod nodes;
mod rate_usage;
mod relay_resume;
mod replicas;
mod revocations;
mod sessions;
#[cfg(test)]
mod testing;
mod users;
mod vm_batch;
mod vms;

use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::any::{AnyArguments, AnyConnectOptions, AnyPoolOptions, AnyQueryResult};
use sqlx::pool::PoolConnection;
use sqlx::{Any, AnyConnection, AnyPool, ConnectOptions, Connection, Database, Executor, TransactionManager};
use time::OffsetDateTime;

pub use audit::{AuditEvent, AuditFilter, SessionKeyRecord, MAX_AUDIT_BATCH};
pub use beats::{HeartbeatWrites, VmStateWrite};
pub use changes::{Change, ChangeKind, NodeCertRecord};
pub use checkpoint::{Checkpointed, WalPolicy, WAL_KEPT};
pub use error::StoreError;
pub use grants::{GrantRecord, GrantUse, NewGrant};
pub use lbs::{LbRecord, VerdictRecord};
pub use networks::NewNetwork;
pub use nodes::{
    Enrolled, JoinTokenRecord, Liveness, NodeBeat, NodeGrant, NodeLease, NodeRecord, SUPERSEDED,
};
pub use rate_usage::RateUsage;
pub use relay_resume::{ResumeRecord, ABANDON_SLACK_MS};
pub use replicas::{Reaped, ReplicaRecord, SecretRecord};
pub use revocations::Revoking;
pub use sessions::{BytesFrom, Carrier, SessionFilter, RELAY_CARRIER};
pub use users::TokenRecord;
pub use vm_batch::MAX_BATCH as MAX_VM_BATCH;
pub use vms::NewVm;

/// Where the store's writes go.
///
/// A SQLite file's one write connection is held by the store itself, behind
/// a lock, not in a pool of one: sqlx's pool takes a connection back on a
/// task of its own and pings it first (a round trip to SQLite's thread)
/// before the next writer may have it, two more turns of the runtime on
/// every write with the writer held. A lock passes it on the moment it is
/// let go.
#[derive(Clone, Debug)]
enum Writer {
    Held(Arc<Held>),
    /// PostgreSQL's (its connections may be lost and are made again), and an
    /// in-memory SQLite store's one connection, shared with its reads.
    Pool(AnyPool),
}

#[derive(Debug)]
struct Held {
    /// `None` once the store is closed.
    conn: Arc<tokio::sync::Mutex<Option<AnyConnection>>>,
    closed: AtomicBool,
}

/// How long a writer waits for the write connection before it gives up: as
/// long as the pools' acquire.
const WRITER_WAIT: Duration = Duration::from_secs(30);

/// The write connection, one writer's for as long as it is held. How long
/// writers waited for it and held it are metrics
/// (`otherix_store_write_wait_seconds`, `otherix_store_write_held_seconds`):
/// the store's writes are serialized, so a long hold is every other
/// writer's wait.
struct WriteConn {
    conn: Conn,
    since: Instant,
}

enum Conn {
    /// Invariant: `Some` (checked by [`Writer::conn`]).
    Held(tokio::sync::OwnedMutexGuard<Option<AnyConnection>>),
    Pooled(PoolConnection<Any>),
}

impl WriteConn {
    fn new(conn: Conn, asked: Instant) -> WriteConn {
        let since = Instant::now();
        metrics::histogram!("otherix_store_write_wait_seconds")
            .record(since.duration_since(asked).as_secs_f64());
        WriteConn { conn, since }
    }
}

impl Drop for WriteConn {
    fn drop(&mut self) {
        metrics::histogram!("otherix_store_write_held_seconds").record(self.since.elapsed().as_secs_f64());
    }
}

impl Writer {
    /// Waits for the write connection; an error once the store is closed,
    /// or after [`WRITER_WAIT`] (as a pool's acquire gives up).
    async fn conn(&self) -> Result<WriteConn, StoreError> {
        let asked = Instant::now();
        let conn = match self {
            Writer::Held(held) => {
                let conn = tokio::time::timeout(WRITER_WAIT, held.conn.clone().lock_owned())
                    .await
                    .map_err(|_| sqlx::Error::PoolTimedOut)?;
                // Closed while this writer waited: it writes nothing.
                if conn.is_none() || held.closed.load(Ordering::Acquire) {
                    return Err(sqlx::Error::PoolClosed.into());
                }
                Conn::Held(conn)
            }
            Writer::Pool(pool) => Conn::Pooled(pool.acquire().await?),
        };
        Ok(WriteConn::new(conn, asked))
    }

    fn is_closed(&self) -> bool {
        match self {
            Writer::Held(held) => held.closed.load(Ordering::Acquire),
            Writer::Pool(pool) => pool.is_closed(),
        }
    }

    /// Refuses every writer from now on, those waiting for the connection
    /// too; the one that holds it finishes. (A pool refuses when closed.)
    fn refuse(&self) {
        if let Writer::Held(held) = self {
            held.closed.store(true, Ordering::Release);
        }
    }

    /// Closed at once, as a pool's close: the writers waiting for the
    /// connection get an error, not the connection. Waits for the writer
    /// that holds it, then closes it.
    async fn close(&self) {
        self.refuse();
        match self {
            Writer::Held(held) => {
                let conn = held.conn.lock().await.take();
                if let Some(conn) = conn {
                    if let Err(e) = conn.close().await {
                        tracing::debug!(error = %e, "closing the store's write connection");
                    }
                }
            }
            Writer::Pool(pool) => pool.close().await,
        }
    }
}

impl Deref for WriteConn {
    type Target = AnyConnection;
    fn deref(&self) -> &AnyConnection {
        match &self.conn {
            Conn::Held(conn) => conn.as_ref().expect("a held write connection is open"),
            Conn::Pooled(conn) => conn,
        }
    }
}

impl DerefMut for WriteConn {
    fn deref_mut(&mut self) -> &mut AnyConnection {
        match &mut self.conn {
            Conn::Held(conn) => conn.as_mut().expect("a held write connection is open"),
            Conn::Pooled(conn) => conn,
        }
    }
}

type Manager = <Any as Database>::TransactionManager;

/// A write transaction on the write connection (see [`Store::begin_write`]).
/// Dropped before [`Tx::commit`], it is rolled back: on SQLite the rollback
/// is queued on the connection's thread before the next writer's first
/// statement; on PostgreSQL it is sent when the pool takes the connection
/// back, as sqlx's own transactions are.
pub(crate) struct Tx {
    conn: WriteConn,
    open: bool,
}

/// How a write transaction begins on SQLite: `BEGIN IMMEDIATE` (see
/// [`Store::begin_write`]), unless sqlx counts a transaction still open on
/// the connection. SQLite ends a transaction on its own after some errors
/// (a full disk, an I/O error, a trigger's `RAISE(ROLLBACK)`); sqlx's
/// rollback then fails ("no transaction is active") and its count stays
/// at 1, and it refuses a caller's `BEGIN` from then on. A rollback is
/// tried first (it clears a transaction that is really open); if the count
/// stays, the driver's own begin is used, a `SAVEPOINT`, which SQLite runs
/// as a (deferred) transaction of its own when none is open: the writes go
/// on, without the lock taken at their start.
async fn sqlite_begin(conn: &mut WriteConn) -> Option<&'static str> {
    if Manager::get_transaction_depth(conn) > 0 {
        if let Err(e) = Manager::rollback(conn).await {
            tracing::debug!(error = %e, "rolling back what sqlx counts as open on the write connection");
        }
    }
    if Manager::get_transaction_depth(conn) == 0 {
        return Some("BEGIN IMMEDIATE");
    }
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "the write connection's transaction count is off (SQLite ended a transaction on its own); \
             writes begin deferred until the process restarts"
        );
    }
    None
}

impl Tx {
    /// Begins with `statement`, or the driver's own `BEGIN` if `None`.
    ///
    /// The `Tx` exists from before its `BEGIN` is sent, so that a writer
    /// dropped anywhere in it queues a rollback (which does nothing where
    /// sqlx counts no transaction open). The case it is for: sqlx's SQLite
    /// begin with a caller's statement awaits once more after the statement
    /// is acknowledged (to check it did begin); a writer dropped there left
    /// the connection in a transaction, and the next writer's `BEGIN` was
    /// refused. (A `BEGIN` never acknowledged, sqlx's SQLite thread rolls
    /// back itself.)
    async fn begin(conn: WriteConn, statement: Option<&'static str>) -> Result<Tx, sqlx::Error> {
        let mut tx = Tx { conn, open: true };
        Manager::begin(&mut tx.conn, statement.map(Into::into)).await?;
        Ok(tx)
    }

    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        Manager::commit(&mut self.conn).await?;
        self.open = false;
        Ok(())
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        if self.open {
            Manager::start_rollback(&mut self.conn);
        }
    }
}

impl Deref for Tx {
    type Target = AnyConnection;
    fn deref(&self) -> &AnyConnection {
        &self.conn
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut AnyConnection {
        &mut self.conn
    }
}

/// Which database a store is on. The SQL text is shared where the two
/// dialects agree (`$N` placeholders, `ON CONFLICT`, `IS DISTINCT FROM`,
/// `RETURNING`); the few statements that differ ask [`Store::dialect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// Embedded, one process: the default.
    Sqlite,
    /// Shared by several control-plane replicas.
    Postgres,
}

impl Dialect {
    /// A statement's rows read from its argument `$arg`, a JSON array of
    /// arrays, as `j` (`FROM` this): row columns `j.value ->> K` (see
    /// [`json_int`]), its place in the array [`Dialect::json_place`]. One
    /// statement text whatever the number of rows, prepared once.
    pub(crate) fn json_rows(self, arg: usize) -> String {
        match self {
            Dialect::Sqlite => format!("json_each(${arg}) AS j"),
            Dialect::Postgres => format!("json_array_elements(${arg}::json) WITH ORDINALITY AS j(value, n)"),
        }
    }

    /// The place of a row of [`Dialect::json_rows`] in its array.
    pub(crate) fn json_place(self) -> &'static str {
        match self {
            Dialect::Sqlite => "j.key",
            Dialect::Postgres => "j.n",
        }
    }
}

/// Column `k` of a row of [`Dialect::json_rows`] as an integer.
pub(crate) fn json_int(k: usize) -> String {
    format!("CAST(j.value ->> {k} AS BIGINT)")
}

/// The advisory lock every PostgreSQL write transaction takes first (see
/// [`Store::begin_write`]); its number spells "otherix" in ASCII.
pub(crate) const WRITE_LOCK: i64 = 0x6f_7468_6572_6978;

/// Handle to the store. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Store {
    write: Writer,
    read: AnyPool,
    dialect: Dialect,
    /// PostgreSQL's address, for [`Store::change_listener`]'s own connection.
    url: Option<Secret>,
    /// A SQLite file's checkpointer (none in memory or on PostgreSQL).
    wal: Option<std::sync::Arc<checkpoint::Wal>>,
}

/// A database address that may hold a password: never in a `Debug` print.
#[derive(Clone)]
struct Secret(std::sync::Arc<str>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<database url>")
    }
}

/// The channel the change log's trigger notifies on every commit that wrote
/// to it (PostgreSQL folds a transaction's notifications into one).
pub const CHANGES_CHANNEL: &str = "otherix_changes";

/// What the change listener's connection is called in PostgreSQL's
/// `pg_stat_activity` (`application_name`), so an operator can tell it apart.
pub const LISTENER_APPLICATION_NAME: &str = "otherix change listener";

/// Wakes when another writer committed changes (PostgreSQL's LISTEN).
pub struct ChangeListener(sqlx::postgres::PgListener);

impl ChangeListener {
    /// Waits for the next commit that wrote to the change log. An error
    /// means the listener's connection is lost — closed, or ended by the
    /// server (a restart, `pg_terminate_backend`) — and notifications with
    /// it: the caller makes a new listener (and catches up by reading the
    /// log), on its own schedule rather than the driver's.
    pub async fn next(&mut self) -> Result<(), StoreError> {
        match self.0.try_recv().await? {
            Some(_) => Ok(()),
            None => Err(StoreError::Db(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the change listener's connection was lost",
            )))),
        }
    }
}

impl Store {
    /// Opens (creating if needed) the SQLite database at `path` and
    /// migrates it; its WAL is checkpointed as [`WalPolicy::default`] says.
    pub async fn open(path: &Path) -> Result<Store, StoreError> {
        Store::open_with(path, WalPolicy::default()).await
    }

    /// [`Store::open`], with the WAL checkpointed as `wal` says.
    pub async fn open_with(path: &Path, wal: WalPolicy) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let url = sqlite_url(path);
        let kept = wal.truncate_above.min(checkpoint::WAL_KEPT);
        let connect = |mode: &str| -> Result<AnyConnectOptions, StoreError> {
            Ok(AnyConnectOptions::from_url(
                &format!("{url}?mode={mode}").parse().map_err(bad_url)?,
            )?)
        };
        let mut conn = connect("rwc")?.connect().await?;
        conn.execute(pragmas(kept).as_str()).await?;
        conn.execute("PRAGMA journal_mode = WAL").await?;
        migrate::run(&mut conn, Dialect::Sqlite).await?;
        let write = Writer::Held(Arc::new(Held {
            conn: Arc::new(tokio::sync::Mutex::new(Some(conn))),
            closed: AtomicBool::new(false),
        }));
        let read = sqlite_pool(4, kept).connect_with(connect("ro")?).await?;
        // The checkpoints' first pass, beside the writes (see `checkpoint`).
        let copier = checkpoint::CopierConn::open(connect("rw")?, pragmas(kept)).await?;
        let mut file = path.as_os_str().to_owned();
        file.push("-wal");
        let wal = checkpoint::Wal::spawn(write.clone(), copier, file.into(), wal);
        Ok(Store {
            write,
            read,
            dialect: Dialect::Sqlite,
            url: None,
            wal: Some(std::sync::Arc::new(wal)),
        })
    }

    /// Connects to the PostgreSQL database at `url`
    /// (`postgres://USER@HOST/DB`, or `postgres:///DB?host=/run/postgresql`
    /// for a Unix socket) and migrates it. Several replicas may open one
    /// database at once: migrations run under an advisory lock.
    pub async fn open_postgres(url: &str) -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        let options: AnyConnectOptions = url.parse()?;
        let pool = |n| {
            AnyPoolOptions::new()
                .max_connections(n)
                .acquire_timeout(Duration::from_secs(30))
        };
        let write = pool(4).connect_with(options.clone()).await?;
        migrate::run(&mut *write.acquire().await?, Dialect::Postgres).await?;
        let write = Writer::Pool(write);
        let read = pool(8).connect_with(options).await?;
        Ok(Store {
            write,
            read,
            dialect: Dialect::Postgres,
            url: Some(Secret(url.into())),
            wal: None,
        })
    }

    /// An in-memory SQLite store for unit tests of code above the store.
    pub async fn open_in_memory() -> Result<Store, StoreError> {
        sqlx::any::install_default_drivers();
        // One connection that never closes: an in-memory database lives as
        // long as a connection to it.
        let pool = sqlite_pool(1, checkpoint::WAL_KEPT)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect("sqlite::memory:")
            .await?;
        migrate::run(&mut *pool.acquire().await?, Dialect::Sqlite).await?;
        Ok(Store {
            write: Writer::Pool(pool.clone()),
            read: pool,
            dialect: Dialect::Sqlite,
            url: None,
            wal: None,
        })
    }

    /// On PostgreSQL, a listener woken by every commit that wrote to the
    /// change log, on any control plane: a catalog follows other writers at
    /// once instead of at its next poll. `None` on SQLite, whose only
    /// writer is this process.
    pub async fn change_listener(&self) -> Result<Option<ChangeListener>, StoreError> {
        let Some(url) = &self.url else {
            return Ok(None);
        };
        let options: sqlx::postgres::PgConnectOptions = url.0.parse()?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_lazy_with(options.application_name(LISTENER_APPLICATION_NAME));
        let mut listener = sqlx::postgres::PgListener::connect_with(&pool).await?;
        // A lost connection is the caller's to re-make (`next` says so),
        // with its backoff, instead of the driver's at once and unseen.
        listener.eager_reconnect(false);
        listener.listen(CHANGES_CHANNEL).await?;
        Ok(Some(ChangeListener(listener)))
    }

    pub fn dialect(&self) -> Dialect {
        self.dialect
    }

    /// Whether the store answers a query (readiness).
    pub async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.read).await?;
        Ok(())
    }

    /// Closes the read pool, the WAL checkpointer's connection and the write
    /// connection, waiting for in-flight statements and checkpoints.
    pub async fn close(&self) {
        // Writers are refused at once; the write connection closes last, so
        // that on SQLite it can be the last connection to close, which
        // copies the WAL back and removes its file (a read-only one cannot).
        self.write.refuse();
        self.read.close().await;
        if let Some(wal) = &self.wal {
            wal.close().await;
        }
        self.write.close().await;
    }

    /// Checkpoints a SQLite file's WAL now, as its task does on its timer
    /// (see [`WalPolicy`]); `None` in memory and on PostgreSQL.
    pub async fn checkpoint_wal(&self) -> Result<Option<Checkpointed>, StoreError> {
        match &self.wal {
            Some(wal) => Ok(Some(wal.checkpoint().await?)),
            None => Ok(None),
        }
    }

    /// Counts the checkpoints a SQLite file's task has run (it changes
    /// after each); `None` in memory and on PostgreSQL.
    pub fn wal_checkpoints(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.wal.as_ref().map(|wal| wal.runs())
    }

    /// Begins a transaction that writes. On SQLite the single write
    /// connection already serializes writers. On PostgreSQL, where several
    /// replicas write at once, it first takes one cluster-wide advisory
    /// lock: writers are serialized as SQLite's are, so every check a
    /// transaction makes before it writes (a free address, an overlapping
    /// subnet, the last admin, a grant's connection cap) still holds when
    /// it commits; the change log's revisions commit in order (a reader
    /// that saw revision N has seen every revision below it); and no two
    /// writers ever wait on each other's rows (no deadlock, no retry).
    pub(crate) async fn begin_write(&self) -> Result<Tx, StoreError> {
        // On SQLite the write lock is taken at `BEGIN`, where another
        // connection's lock is waited for (`busy_timeout`). A deferred
        // `BEGIN` would take it at the first write after a read, and SQLite
        // refuses that at once when another connection holds it: it cannot
        // wait without risking a deadlock. This process writes through one
        // connection, so the lock is its own but for another process on
        // the same file (a repair, a backup, an operator's shell).
        let mut conn = self.write.conn().await?;
        let begin = match self.dialect {
            Dialect::Sqlite => sqlite_begin(&mut conn).await,
            Dialect::Postgres => None,
        };
        let mut tx = Tx::begin(conn, begin).await?;
        if self.dialect == Dialect::Postgres {
            sqlx::query("SELECT pg_advisory_xact_lock($1)")
                .bind(WRITE_LOCK)
                .execute(&mut *tx)
                .await?;
        }
        Ok(tx)
    }

    /// One write statement, in a transaction of its own where the dialect
    /// needs one (see [`Store::begin_write`]).
    pub(crate) async fn exec<'q>(
        &self,
        query: sqlx::query::Query<'q, Any, AnyArguments<'q>>,
    ) -> Result<AnyQueryResult, StoreError> {
        match self.dialect {
            Dialect::Sqlite => Ok(query.execute(&mut *self.write.conn().await?).await?),
            Dialect::Postgres => {
                let mut tx = self.begin_write().await?;
                let done = query.execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(done)
            }
        }
    }

    /// Reads a metadata value.
    pub async fn meta(&self, key: &str) -> Result<Option<String>, StoreError> {
        Ok(sqlx::query_scalar("SELECT value FROM meta WHERE key = $1")
            .bind(key)
            .fetch_optional(&self.read)
            .await?)
    }

    /// Sets `key` to `value` unless it is already set; returns the stored
    /// value (another replica's, if it set it first).
    pub async fn meta_init(&self, key: &str, value: &str) -> Result<String, StoreError> {
        let mut tx = self.begin_write().await?;
        sqlx::query("INSERT INTO meta (key, value) VALUES ($1, $2) ON CONFLICT(key) DO NOTHING")
            .bind(key)
            .bind(value)
            .execute(&mut *tx)
            .await?;
        let stored = sqlx::query_scalar("SELECT value FROM meta WHERE key = $1")
            .bind(key)
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(stored)
    }
}

/// How long a store connection waits for a lock before `SQLITE_BUSY`.
pub(crate) const BUSY_MS: u64 = 30_000;

/// A pool of SQLite connections set up as the store needs them: WAL,
/// `synchronous=NORMAL` (under WAL it survives a killed process with every
/// committed transaction; only a power loss may drop the newest), foreign
/// keys on, a busy timeout for readers, no checkpoint inside a commit
/// (`wal_autocheckpoint=0`: the store's own task checkpoints, see
/// `checkpoint`) and the WAL's file cut back to `wal_limit` bytes whenever
/// it starts over, and temporary storage in memory (`temp_store=MEMORY`):
/// a statement that writes many rows in a transaction (a group's) keeps
/// the pages it changes in a statement journal, which otherwise spills to
/// a temporary file past 64 KiB, a `write` system call a page. A
/// connection is not pinged
/// before each use: a SQLite connection is a file handle in this process,
/// with no server at the other end to hang up, and on SQLite the ping is a
/// round trip to sqlx's worker thread (two thread wakes) in front of every
/// store call — the audit writer's every batch, every heartbeat's write.
fn sqlite_pool(connections: u32, wal_limit: u64) -> AnyPoolOptions {
    AnyPoolOptions::new()
        .max_connections(connections)
        .test_before_acquire(false)
        .after_connect(move |conn, _| {
            Box::pin(async move {
                conn.execute(pragmas(wal_limit).as_str()).await?;
                // Read-only connections cannot change the journal mode; the
                // writer sets it (it is kept in the file).
                let _ = conn.execute("PRAGMA journal_mode = WAL").await;
                Ok(())
            })
        })
}

/// What every SQLite connection of the store sets first.
fn pragmas(wal_limit: u64) -> String {
    format!(
        "PRAGMA foreign_keys = ON; PRAGMA busy_timeout = {BUSY_MS}; PRAGMA synchronous = NORMAL; \
         PRAGMA wal_autocheckpoint = 0; PRAGMA journal_size_limit = {wal_limit}; \
         PRAGMA temp_store = MEMORY;"
    )
}

/// `sqlite://PATH`, with the characters a URL gives meaning to escaped.
fn sqlite_url(path: &Path) -> String {
    let mut url = String::from("sqlite://");
    for c in path.to_string_lossy().chars() {
        match c {
            '%' | '?' | '#' | ' ' => url.push_str(&format!("%{:02X}", c as u32)),
            c => url.push(c),
        }
    }
    url
}

fn bad_url(e: impl std::fmt::Display) -> StoreError {
    StoreError::Invalid(format!("database address: {e}"))
}

pub(crate) fn to_millis(t: OffsetDateTime) -> i64 {
    (t.unix_timestamp_nanos() / 1_000_000) as i64
}

pub(crate) fn from_millis(ms: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000).unwrap_or(OffsetDateTime::UNIX_EPOCH)
}

/// Each key's last item, in the order of the key's first mention: one row
/// written once per statement (PostgreSQL refuses to update a row twice in
/// one), as the last report has it.
pub(crate) fn last_per_key<'a, T, K: std::hash::Hash + Eq>(
    items: &'a [T],
    key: impl Fn(&'a T) -> K,
) -> Vec<&'a T> {
    let mut last: Vec<&T> = Vec::with_capacity(items.len());
    let mut at: std::collections::HashMap<K, usize> = std::collections::HashMap::with_capacity(items.len());
    for item in items {
        match at.get(&key(item)) {
            Some(&i) => last[i] = item,
            None => {
                at.insert(key(item), last.len());
                last.push(item);
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::Future;

    use crate::testing::on_both;

    /// Writes `key` in a transaction of its own, dropped once it has waited
    /// `waits` times (on the connection, or on the database's answer to one
    /// of its steps); whether it ran to its end first.
    async fn cut_short(store: &Store, key: &str, waits: usize) -> bool {
        let write = async {
            let mut tx = store.begin_write().await.unwrap();
            sqlx::query("INSERT INTO meta (key, value) VALUES ($1, 'x')")
                .bind(key)
                .execute(&mut *tx)
                .await
                .unwrap();
            tx.commit().await.unwrap();
        };
        let mut write = std::pin::pin!(write);
        let mut waited = 0;
        std::future::poll_fn(|cx| match write.as_mut().poll(cx) {
            std::task::Poll::Ready(()) => std::task::Poll::Ready(true),
            std::task::Poll::Pending if waited == waits => std::task::Poll::Ready(false),
            std::task::Poll::Pending => {
                waited += 1;
                std::task::Poll::Pending
            }
        })
        .await
    }

    /// A write transaction on SQLite takes the file's write lock at its
    /// `BEGIN`, where another connection's lock (another process on the
    /// file) is waited for. Taken later, at the first write after a read,
    /// SQLite would refuse it at once while the other connection holds it.
    #[tokio::test]
    async fn a_write_transaction_takes_the_lock_at_its_begin_and_waits_for_another_connections() {
        use sqlx::Connection as _;

        let dir = crate::testing::Dir::new("lockwait");
        let db = dir.0.join("otherix.db");
        let store = Store::open(&db).await.unwrap();
        let mut other = sqlx::SqliteConnection::connect(&sqlite_url(&db)).await.unwrap();
        // Held from `BEGIN`: the other connection cannot take it, and does
        // not wait for it here.
        sqlx::query("PRAGMA busy_timeout = 0")
            .execute(&mut other)
            .await
            .unwrap();
        let tx = store.begin_write().await.unwrap();
        let refused = sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .unwrap_err();
        assert!(refused.to_string().contains("locked"), "{refused}");
        drop(tx);

        // The other way round: the other connection holds it, and a
        // transaction that reads before it writes waits until it is let go
        // (whether it began before or after the other's commit, it must
        // end committed: refused at once is the failure this catches when
        // it began before, as it mostly does).
        sqlx::query("PRAGMA busy_timeout = 30000")
            .execute(&mut other)
            .await
            .unwrap();
        sqlx::query("BEGIN IMMEDIATE").execute(&mut other).await.unwrap();
        let store = std::sync::Arc::new(store);
        let writer = tokio::spawn({
            let store = store.clone();
            async move {
                let mut tx = store.begin_write().await?;
                let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM meta")
                    .fetch_one(&mut *tx)
                    .await?;
                sqlx::query("INSERT INTO meta (key, value) VALUES ('waited', $1)")
                    .bind(n.to_string())
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                Ok::<(), StoreError>(())
            }
        });
        sqlx::query("INSERT INTO meta (key, value) VALUES ('first', 'other')")
            .execute(&mut other)
            .await
            .unwrap();
        sqlx::query("COMMIT").execute(&mut other).await.unwrap();
        writer.await.unwrap().unwrap();
        assert_eq!(store.meta("first").await.unwrap().as_deref(), Some("other"));
        assert!(store.meta("waited").await.unwrap().is_some());
        other.close().await.unwrap();
    }

    /// SQLite ends a transaction on its own after some errors (a full
    /// disk, an I/O error; here a trigger's `RAISE(ROLLBACK)`), and sqlx's
    /// count of open transactions is then off by one (its rollback fails):
    /// the writes after it still begin, and commit.
    #[tokio::test]
    async fn writes_go_on_after_sqlite_ends_a_transaction_on_its_own() {
        let store = crate::testing::sqlite().await;
        {
            let mut conn = store.write.conn().await.unwrap();
            sqlx::query(
                "CREATE TRIGGER boom BEFORE INSERT ON meta WHEN NEW.key = 'boom' \
                 BEGIN SELECT RAISE(ROLLBACK, 'ended by SQLite'); END",
            )
            .execute(&mut *conn)
            .await
            .unwrap();
        }
        let mut tx = store.begin_write().await.unwrap();
        let ended = sqlx::query("INSERT INTO meta (key, value) VALUES ('boom', 'x')")
            .execute(&mut *tx)
            .await
            .unwrap_err();
        assert!(ended.to_string().contains("ended by SQLite"), "{ended}");
        drop(tx);
        for i in 0..3 {
            write_and_read_back(&store, &format!("after-{i}"), "after SQLite ended one").await;
        }
        assert_eq!(store.meta("boom").await.unwrap(), None);
    }

    /// Writes `key` in a write transaction of its own and reads it back on
    /// a connection of the read pool: committed for real.
    async fn write_and_read_back(store: &Store, key: &str, when: &str) {
        let mut tx = store.begin_write().await.unwrap();
        sqlx::query("INSERT INTO meta (key, value) VALUES ($1, 'y')")
            .bind(key)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(store.meta(key).await.unwrap().as_deref(), Some("y"), "{when}");
    }

    /// Every connection of a SQLite file, the writer's and the readers',
    /// runs as [`pragmas`] sets it up: foreign keys checked, and statement
    /// journals and temporary tables in memory (a group's write once spilled
    /// its statement journal to a file, a system call a page).
    #[tokio::test]
    async fn a_sqlite_files_connections_check_foreign_keys_and_keep_temporary_storage_in_memory() {
        let store = crate::testing::sqlite().await;
        let pragma = |name: &'static str| format!("PRAGMA {name}");
        let mut write = store.write.conn().await.unwrap();
        for (name, want) in [("temp_store", 2), ("foreign_keys", 1), ("synchronous", 1)] {
            let on_writer: i64 = sqlx::query_scalar(&pragma(name))
                .fetch_one(&mut *write)
                .await
                .unwrap();
            let on_reader: i64 = sqlx::query_scalar(&pragma(name))
                .fetch_one(&store.read)
                .await
                .unwrap();
            assert_eq!((on_writer, on_reader), (want, want), "{name}");
        }
    }

    on_both! {
        /// A transaction let go of before its commit writes nothing, and the
        /// next writer's commit is a commit (seen by another connection), not
        /// a savepoint inside what was left open.
        async fn a_transaction_dropped_before_its_commit_writes_nothing_and_the_next_one_commits(store) {
            {
                let mut tx = store.begin_write().await.unwrap();
                sqlx::query("INSERT INTO meta (key, value) VALUES ('dropped', 'x')")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
            }
            store
                .exec(sqlx::query("INSERT INTO meta (key, value) VALUES ('next', 'y')"))
                .await
                .unwrap();
            assert_eq!(store.meta("next").await.unwrap().as_deref(), Some("y"));
            assert_eq!(store.meta("dropped").await.unwrap(), None);
        }
    }

    on_both! {
        /// Writers cut short after each number of their waits in turn — for
        /// the connection, their `BEGIN`, their statement, their `COMMIT` —
        /// leave the connection to the next writer as it was.
        async fn writers_cut_short_at_any_step_leave_the_write_connection_as_it_was(store) {
            // How many waits a write makes depends on how quickly the
            // database answers each step: cut at every count up to more
            // than it makes, whatever it makes this time.
            // A write whose every step is answered before it is polled
            // again never waits, and cannot be cut: rounds until some were.
            let mut cut = 0;
            for (round, waits) in (0..50).flat_map(|round| (0..16).map(move |waits| (round, waits))) {
                if waits == 0 && cut > 0 {
                    break;
                }
                let ended = cut_short(&store, &format!("cut-{round}-{waits}"), waits).await;
                let key = format!("after-{round}-{waits}");
                write_and_read_back(&store, &key, &format!("after a writer cut after {waits} waits")).await;
                if ended {
                    assert_eq!(store.meta(&format!("cut-{round}-{waits}")).await.unwrap().as_deref(), Some("x"));
                } else {
                    cut += 1;
                }
            }
            assert!(cut > 0, "no writer was cut short in 50 rounds");
        }
    }

    /// SQLite's held connection (a pool's close is sqlx's): the writer that
    /// has it finishes, the one queued behind it is refused.
    #[tokio::test]
    async fn closing_lets_the_writer_that_holds_the_connection_finish_and_refuses_the_one_queued() {
        let store = crate::testing::sqlite().await;
        let mut tx = store.begin_write().await.unwrap();
        let queued = {
            let store = store.clone();
            tokio::spawn(async move {
                store
                    .exec(sqlx::query(
                        "INSERT INTO meta (key, value) VALUES ('queued', 'x')",
                    ))
                    .await
            })
        };
        // The test's runtime has one thread: the writer runs until it waits
        // for the connection.
        tokio::task::yield_now().await;
        let closing = {
            let store = store.clone();
            tokio::spawn(async move { store.close().await })
        };
        tokio::task::yield_now().await;
        assert!(
            !closing.is_finished(),
            "close waits for the writer that holds the connection"
        );
        sqlx::query("INSERT INTO meta (key, value) VALUES ('held', 'x')")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        let refused = queued.await.unwrap().unwrap_err();
        assert!(
            matches!(refused, StoreError::Db(sqlx::Error::PoolClosed)),
            "{refused:?}"
        );
        closing.await.unwrap();
    }

    on_both! {
        /// Once the store is closed, a write is an error, not a hang or a panic.
        async fn a_write_after_the_store_is_closed_is_an_error(store) {
            store.close().await;
            let err = store
                .exec(sqlx::query("INSERT INTO meta (key, value) VALUES ('late', 'x')"))
                .await
                .unwrap_err();
            assert!(matches!(err, StoreError::Db(sqlx::Error::PoolClosed)), "{err:?}");
            assert!(store.begin_write().await.is_err());
        }
    }
}
