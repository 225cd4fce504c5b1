//! The store's tests run on both dialects: [`on_both!`] makes each test
//! twice, on a SQLite file of the test's own (as the control plane opens
//! one) and on a PostgreSQL database of a server the test starts for itself
//! (`otherix_testbed::postgres`).

use std::ops::Deref;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use otherix_testbed::postgres::Postgres;

use crate::Store;

/// SQLite's plan for `query` (its statement already prefixed with
/// `EXPLAIN QUERY PLAN` and its arguments bound): each step's detail,
/// joined with "; ".
pub(crate) async fn query_plan<'q>(
    store: &Store,
    query: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
) -> String {
    use sqlx::Row;
    // Rows are (id, parent, notused, detail).
    let steps: Vec<String> = query
        .fetch_all(&store.read)
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<String, _>(3))
        .collect();
    steps.join("; ")
}

/// A store for one test, and the server it lives on (stopped on drop).
pub(crate) struct TestStore {
    store: Store,
    /// PostgreSQL's: the database's address.
    url: Option<String>,
    _server: Option<Postgres>,
    /// SQLite's: the file's directory (removed after the store is dropped).
    _dir: Option<Dir>,
}

impl TestStore {
    /// Another control plane's store on the same PostgreSQL database.
    pub(crate) async fn another(&self) -> Store {
        let url = self.url.as_deref().expect("a PostgreSQL store");
        Store::open_postgres(url).await.unwrap()
    }
}

impl Deref for TestStore {
    type Target = Store;
    fn deref(&self) -> &Store {
        &self.store
    }
}

/// A SQLite file of the test's own, as the control plane opens one: its
/// writes on the store's held connection, its reads on the read pool.
pub(crate) async fn sqlite() -> TestStore {
    let dir = Dir::new("store");
    TestStore {
        store: Store::open(&dir.0.join("otherix.db")).await.unwrap(),
        url: None,
        _server: None,
        _dir: Some(dir),
    }
}

/// A directory of the test's own, removed on drop.
pub(crate) struct Dir(pub(crate) PathBuf);

impl Dir {
    pub(crate) fn new(test: &str) -> Dir {
        static MADE: AtomicU64 = AtomicU64::new(0);
        let n = MADE.fetch_add(1, Ordering::Relaxed);
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "otherix-store-{test}-{}-{clock:x}-{n}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Dir(dir)
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) async fn postgres() -> TestStore {
    let (server, url) = tokio::task::spawn_blocking(|| {
        let server = Postgres::start_temporary().expect("a PostgreSQL server for the test");
        let url = server.create_database("otherix").expect("a database");
        (server, url)
    })
    .await
    .unwrap();
    TestStore {
        store: Store::open_postgres(&url).await.unwrap(),
        url: Some(url),
        _server: Some(server),
        _dir: None,
    }
}

/// `on_both! { async fn name(store) { ... } }`: the test `name::sqlite`
/// and the test `name::postgres`, each with `store` a fresh [`TestStore`].
macro_rules! on_both {
    ($(#[$meta:meta])* async fn $name:ident($store:ident) $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            $(#[$meta])*
            #[tokio::test]
            async fn sqlite() {
                let $store = crate::testing::sqlite().await;
                $body
            }

            $(#[$meta])*
            #[tokio::test]
            async fn postgres() {
                let $store = crate::testing::postgres().await;
                $body
            }
        }
    };
}
pub(crate) use on_both;

/// Creates an overlay network `name` on `subnet`, with no nodes (id
/// `id-NAME`).
pub(crate) async fn overlay(store: &Store, name: &str, subnet: &str) {
    store
        .create_network(
            &crate::NewNetwork {
                name: name.into(),
                id: format!("id-{name}"),
                kind: otherix_proto::NetworkType::Overlay,
                subnet: subnet.parse().unwrap(),
                nodes: vec![],
            },
            time::OffsetDateTime::now_utc(),
        )
        .await
        .unwrap();
}

/// Enrolls `node` with `grant` (its token id and fingerprint derived from
/// its name).
pub(crate) async fn enroll(store: &Store, node: &str, grant: crate::NodeGrant) {
    use time::{Duration, OffsetDateTime};
    let now = OffsetDateTime::now_utc();
    let token_id = format!("t-{node}");
    store
        .create_join_token(
            &token_id,
            b"hash",
            node,
            &grant,
            false,
            now,
            now + Duration::hours(1),
        )
        .await
        .unwrap();
    let token = store.join_token(&token_id).await.unwrap().unwrap();
    let enrolled = store
        .enroll_node(&token, node, &format!("fp-{node}"), now + Duration::days(30), now)
        .await
        .unwrap();
    assert_eq!(enrolled, Some(crate::Enrolled::New));
}

/// LB `name` on `port`, its pool `app=web`, probed over HTTP.
pub(crate) fn lb(name: &str, port: u16, now: time::OffsetDateTime) -> crate::LbRecord {
    crate::LbRecord {
        name: name.into(),
        port,
        selector: "app=web".into(),
        health_kind: otherix_proto::ProbeKind::Http,
        health_path: Some("/health".into()),
        health_port: Some(8080),
        interval_ms: 5000,
        timeout_ms: 2000,
        rise: 2,
        fall: 3,
        created_at: now,
    }
}

/// Creates VM `name` (id `id-NAME`) on network `net`, unplaced, its MAC
/// the next of `mac`'s.
pub(crate) async fn vm(
    store: &Store,
    net: &str,
    name: &str,
    mac: &mut u64,
) -> Result<otherix_proto::Vm, crate::StoreError> {
    store
        .create_vm(
            &crate::NewVm {
                machine: None,
                name: name.into(),
                id: format!("id-{name}"),
                network: net.into(),
                node: None,
                labels: std::collections::BTreeMap::new(),
                exec: None,
            },
            || {
                *mac += 1;
                let b = mac.to_be_bytes();
                otherix_core::mac::MacAddr([2, b[3], b[4], b[5], b[6], b[7]])
            },
            time::OffsetDateTime::now_utc(),
        )
        .await
}

/// Writes guests' states as one heartbeat reports them.
pub(crate) async fn record_states(
    store: &Store,
    states: &[(
        &str,
        otherix_proto::VmState,
        Option<&str>,
        Option<otherix_proto::Accelerator>,
    )],
) -> Result<(), crate::StoreError> {
    let states = states
        .iter()
        .map(|(id, state, reason, accelerator)| crate::VmStateWrite {
            vm_id: id.to_string(),
            state: *state,
            reason: reason.map(String::from),
            accelerator: *accelerator,
        })
        .collect();
    let beat = crate::HeartbeatWrites {
        states,
        ..Default::default()
    };
    store.record_heartbeats(&[beat]).await
}

/// Writes verdicts as one heartbeat reports them.
pub(crate) async fn record_verdicts(
    store: &Store,
    verdicts: &[crate::VerdictRecord],
) -> Result<(), crate::StoreError> {
    let beat = crate::HeartbeatWrites {
        verdicts: verdicts.to_vec(),
        ..Default::default()
    };
    store.record_heartbeats(&[beat]).await
}
