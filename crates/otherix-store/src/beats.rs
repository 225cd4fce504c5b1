//! Heartbeats' writes, many heartbeats' in one transaction
//! ([`Store::record_heartbeats`]).
//!
//! At 1,000 nodes nearly every heartbeat writes something — a guest's new
//! state, a changed verdict, its row every few seconds — and the store's
//! writes are serialized: written one by one, each holds the writer for a
//! round trip to the database and a turn of the runtime, and creates queue
//! behind them. Written together, a group of them holds it once.
use std::collections::HashMap;

use otherix_proto::{Accelerator, VmState};

use crate::{json_int, last_per_key, to_millis, Dialect, NodeBeat, Store, StoreError, VerdictRecord};

/// What one heartbeat writes: the verdicts that changed, the guests'
/// states that changed, and the node's row when it is due.
#[derive(Debug, Clone, Default)]
pub struct HeartbeatWrites {
    pub node: String,
    pub verdicts: Vec<VerdictRecord>,
    pub states: Vec<VmStateWrite>,
    pub row: Option<NodeBeat>,
}

impl HeartbeatWrites {
    pub fn is_empty(&self) -> bool {
        self.verdicts.is_empty() && self.states.is_empty() && self.row.is_none()
    }
}

/// A guest's state as its node reports it (and a QEMU guest's accelerator).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmStateWrite {
    pub vm_id: String,
    pub state: VmState,
    pub reason: Option<String>,
    pub accelerator: Option<Accelerator>,
}

/// One statement of a group's write, and its one argument: its rows as a
/// JSON array of arrays, each row's columns by position.
///
/// Each statement reads its rows from that argument (`json_each` on
/// SQLite, `json_array_elements` on PostgreSQL), so its text is the same
/// whatever the group holds: prepared once per connection and kept in its
/// statement cache. With an argument per column, every group's shape was a
/// new text: SQLite prepared it anew (looking each `$N` up by name among
/// the ones before it, quadratic in their number), set a guest's state
/// through a `CASE` of every guest in the statement, and each new text
/// pushed a create's statements out of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Piece {
    /// Verdicts, upserted where their LB still exists.
    Verdicts,
    /// Guests' states.
    States,
    /// Nodes' rows.
    Rows,
}

impl Piece {
    /// The statement, its argument `$arg`.
    fn sql(self, dialect: Dialect, arg: usize) -> String {
        let rows = dialect.json_rows(arg);
        let int = json_int;
        match self {
            Piece::Verdicts => format!(
                "INSERT INTO health_verdicts (lb, vm_id, node, health, probed_at, changed_at, reason, successes, failures)
                 SELECT j.value ->> 0, j.value ->> 1, j.value ->> 2, j.value ->> 3, {}, {}, j.value ->> 6, {}, {}
                 FROM {rows}
                 WHERE EXISTS (SELECT 1 FROM load_balancers WHERE name = j.value ->> 0)
                 ON CONFLICT(lb, vm_id) DO UPDATE SET node = excluded.node, health = excluded.health,
                     probed_at = excluded.probed_at, changed_at = excluded.changed_at, reason = excluded.reason,
                     successes = excluded.successes, failures = excluded.failures",
                int(4),
                int(5),
                int(7),
                int(8),
            ),
            Piece::States => format!(
                "UPDATE vms SET state = j.value ->> 1, reason = j.value ->> 2, accelerator = j.value ->> 3
                 FROM {rows} WHERE vms.id = j.value ->> 0"
            ),
            // The last heartbeat never goes back in time, and `vouched_at`
            // moves only to a heartbeat that listed only changes.
            Piece::Rows => format!(
                "UPDATE nodes SET vtep = j.value ->> 1, agent_version = j.value ->> 2, applied_version = {applied},
                     last_heartbeat = CASE WHEN nodes.last_heartbeat IS NULL OR nodes.last_heartbeat < {at}
                         THEN {at} ELSE nodes.last_heartbeat END,
                     sessions = j.value ->> 5, netns = j.value ->> 6, ready_overlays = j.value ->> 7,
                     status_reason = NULL,
                     vouched_at = CASE WHEN j.value ->> 8 IS NOT NULL
                         AND (nodes.vouched_at IS NULL OR nodes.vouched_at < {vouched})
                         THEN {vouched} ELSE nodes.vouched_at END
                 FROM {rows} WHERE nodes.name = j.value ->> 0",
                applied = int(3),
                at = int(4),
                vouched = int(8),
            ),
        }
    }
}

/// A node's row as a group leaves it: the last heartbeat's fields, the
/// latest time of any (its last heartbeat) and of any that vouched.
struct Row<'a> {
    node: &'a str,
    beat: &'a NodeBeat,
    at: i64,
    vouched: Option<i64>,
}

/// The rows of `writes`, one per node, as if written one after the other.
fn node_rows(writes: &[HeartbeatWrites]) -> Vec<Row<'_>> {
    let mut rows: Vec<Row> = Vec::new();
    let mut at: HashMap<&str, usize> = HashMap::new();
    for w in writes {
        let Some(beat) = &w.row else { continue };
        let t = to_millis(beat.at);
        let vouched = beat.vouches.then_some(t);
        match at.get(w.node.as_str()) {
            Some(&i) => {
                let row = &mut rows[i];
                row.beat = beat;
                row.at = row.at.max(t);
                row.vouched = row.vouched.max(vouched);
            }
            None => {
                at.insert(&w.node, rows.len());
                rows.push(Row {
                    node: &w.node,
                    beat,
                    at: t,
                    vouched,
                });
            }
        }
    }
    rows
}

/// The JSON argument of each statement a group writes, in order.
fn arguments(writes: &[HeartbeatWrites]) -> Result<Vec<(Piece, String)>, StoreError> {
    let mut out = Vec::new();
    let verdicts: Vec<&VerdictRecord> = writes.iter().flat_map(|w| &w.verdicts).collect();
    let verdicts = last_per_key(&verdicts, |v| (v.lb.as_str(), v.vm_id.as_str()));
    if !verdicts.is_empty() {
        let rows: Vec<_> = verdicts
            .iter()
            .map(|v| {
                (
                    &v.lb,
                    &v.vm_id,
                    &v.node,
                    v.health.as_str(),
                    to_millis(v.probed_at),
                    v.changed_at.map(to_millis),
                    &v.reason,
                    v.successes,
                    v.failures,
                )
            })
            .collect();
        out.push((Piece::Verdicts, json(&rows)?));
    }
    let states: Vec<&VmStateWrite> = writes.iter().flat_map(|w| &w.states).collect();
    let states = last_per_key(&states, |s| s.vm_id.as_str());
    if !states.is_empty() {
        let rows: Vec<_> = states
            .iter()
            .map(|s| {
                (
                    &s.vm_id,
                    s.state.as_str(),
                    &s.reason,
                    s.accelerator.map(Accelerator::as_str),
                )
            })
            .collect();
        out.push((Piece::States, json(&rows)?));
    }
    let nodes = node_rows(writes);
    if !nodes.is_empty() {
        let mut rows = Vec::with_capacity(nodes.len());
        for r in &nodes {
            rows.push((
                r.node,
                &r.beat.vtep,
                &r.beat.agent_version,
                r.beat.applied_version.map(|v| v as i64),
                r.at,
                json(&r.beat.sessions)?,
                &r.beat.netns,
                json(&r.beat.ready_overlays)?,
                r.vouched,
            ));
        }
        out.push((Piece::Rows, json(&rows)?));
    }
    Ok(out)
}

fn json(value: &impl serde::Serialize) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(|e| StoreError::Invalid(format!("heartbeat writes: {e}")))
}

impl Store {
    /// Writes the heartbeats' `writes` in one transaction: every verdict
    /// (upserted where its LB still exists), every guest's state, then
    /// every node's row (its `vouched_at` after the verdicts it vouches
    /// for). A later heartbeat's word on a verdict, a guest or a row is the
    /// one kept, as if they were written one after the other. At most three
    /// statements, each with its rows in one argument (see [`Piece`]): on
    /// SQLite they go to the database's thread as one string (one round
    /// trip), and alone with no transaction around it when there is one;
    /// PostgreSQL runs one at a time.
    pub async fn record_heartbeats(&self, writes: &[HeartbeatWrites]) -> Result<(), StoreError> {
        let pieces = arguments(writes)?;
        match (pieces.as_slice(), self.dialect) {
            ([], _) => Ok(()),
            ([(piece, arg)], Dialect::Sqlite) => {
                let sql = piece.sql(self.dialect, 1);
                self.exec(sqlx::query(&sql).bind(arg.as_str())).await?;
                Ok(())
            }
            (_, Dialect::Sqlite) => {
                let sql: Vec<String> = pieces
                    .iter()
                    .enumerate()
                    .map(|(i, (piece, _))| piece.sql(self.dialect, i + 1))
                    .collect();
                let sql = sql.join(";\n");
                let mut q = sqlx::query(&sql);
                for (_, arg) in &pieces {
                    q = q.bind(arg.as_str());
                }
                let mut tx = self.begin_write().await?;
                q.execute(&mut *tx).await?;
                tx.commit().await?;
                Ok(())
            }
            (_, Dialect::Postgres) => {
                let mut tx = self.begin_write().await?;
                for (piece, arg) in &pieces {
                    let sql = piece.sql(self.dialect, 1);
                    sqlx::query(&sql).bind(arg.as_str()).execute(&mut *tx).await?;
                }
                tx.commit().await?;
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use otherix_core::lb::Health;
    use time::OffsetDateTime;

    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{enroll, lb, on_both, overlay, vm, TestStore};

    fn beat(vtep: &str, applied: u64, at: OffsetDateTime, vouches: bool) -> NodeBeat {
        NodeBeat {
            vtep: vtep.into(),
            agent_version: format!("agent-{applied}"),
            applied_version: Some(applied),
            sessions: BTreeMap::from([("s1".to_string(), applied as u32)]),
            netns: Some("ns".into()),
            ready_overlays: vec!["net".into()],
            vouches,
            at,
        }
    }

    fn verdict(vm_id: &str, node: &str, health: Health, at: OffsetDateTime) -> VerdictRecord {
        VerdictRecord {
            lb: "web".into(),
            vm_id: vm_id.into(),
            node: node.into(),
            health,
            probed_at: at,
            changed_at: Some(at),
            reason: (health == Health::Unhealthy).then(|| "refused".into()),
            successes: 1,
            failures: 0,
        }
    }

    fn state(vm_id: &str, state: VmState, reason: Option<&str>) -> VmStateWrite {
        VmStateWrite {
            vm_id: vm_id.into(),
            state,
            reason: reason.map(String::from),
            accelerator: None,
        }
    }

    on_both! {
        async fn a_group_of_heartbeats_writes_each_ones_rows_and_the_later_word_on_a_guest_or_a_verdict(store) {
            let at = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
            let later = at + time::Duration::seconds(2);
            enroll(&store, "n1", Default::default()).await;
            enroll(&store, "n2", Default::default()).await;
            store.create_lb(&lb("web", 80, at)).await.unwrap();
            overlay(&store, "net", "10.50.0.0/24").await;
            let mut mac = 0;
            for name in ["a", "b", "c"] {
                vm(&store, "net", name, &mut mac).await.unwrap();
            }
            let group = vec![
                HeartbeatWrites {
                    node: "n1".into(),
                    verdicts: vec![
                        verdict("id-a", "n1", Health::Unhealthy, at),
                        VerdictRecord {
                            lb: "gone".into(),
                            ..verdict("id-b", "n1", Health::Healthy, at)
                        },
                    ],
                    states: vec![state("id-a", VmState::Failed, Some("boot timed out")), state("id-b", VmState::Running, None)],
                    row: Some(beat("192.0.2.1", 7, later, true)),
                },
                HeartbeatWrites {
                    node: "n2".into(),
                    verdicts: vec![verdict("id-c", "n2", Health::Healthy, at)],
                    states: vec![state("id-c", VmState::Running, None)],
                    // Its row waits for its next turn (written every few seconds).
                    row: None,
                },
                // The same node again, later: its word stands.
                HeartbeatWrites {
                    node: "n1".into(),
                    verdicts: vec![verdict("id-a", "n1", Health::Healthy, later)],
                    states: vec![state("id-a", VmState::Running, None), state("id-unknown", VmState::Running, None)],
                    row: Some(beat("192.0.2.1", 8, at, false)),
                },
            ];
            store.record_heartbeats(&group).await.unwrap();
            let state_of = |name: &'static str| {
                let store = &store;
                async move {
                    let v = store.vm(name).await.unwrap();
                    (v.state, v.reason)
                }
            };
            assert_eq!(state_of("a").await, (VmState::Running, None));
            assert_eq!(state_of("b").await, (VmState::Running, None));
            assert_eq!(state_of("c").await, (VmState::Running, None));
            let mut stored = store.verdicts().await.unwrap();
            stored.sort_by(|a, b| a.vm_id.cmp(&b.vm_id));
            assert_eq!(
                stored,
                vec![verdict("id-a", "n1", Health::Healthy, later), verdict("id-c", "n2", Health::Healthy, at)],
                "the later word on id-a, none on the deleted LB"
            );
            let n1 = store.node("n1").await.unwrap();
            assert_eq!(
                (n1.vtep.as_deref(), n1.agent_version.as_deref(), n1.applied_version),
                (Some("192.0.2.1"), Some("agent-8"), Some(8))
            );
            assert_eq!(n1.sessions, BTreeMap::from([("s1".to_string(), 8)]));
            assert_eq!(n1.netns.as_deref(), Some("ns"));
            assert!(n1.ready_overlays.contains("net"));
            // The later beat's time was the earlier: the last heartbeat never goes back.
            assert_eq!(n1.last_heartbeat, Some(later));
            let n2 = store.node("n2").await.unwrap();
            assert_eq!((n2.vtep, n2.last_heartbeat), (None, None));
            let live = store.liveness_since(at - time::Duration::seconds(1)).await.unwrap();
            assert_eq!(live.len(), 1);
            assert_eq!(live[0].1.vouched_at, Some(later), "vouched by the beat that listed only changes");
        }
    }

    on_both! {
        async fn a_group_of_thousands_of_heartbeats_is_written_whole(store) {
            let at = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
            store.create_lb(&lb("web", 80, at)).await.unwrap();
            let n = 2_003;
            let group: Vec<HeartbeatWrites> = (0..n)
                .map(|i| HeartbeatWrites {
                    node: format!("n{}", i % 7),
                    verdicts: vec![verdict(&format!("id-{i}"), "n1", Health::Healthy, at)],
                    ..Default::default()
                })
                .collect();
            store.record_heartbeats(&group).await.unwrap();
            assert_eq!(store.verdicts().await.unwrap().len(), n);
        }
    }

    on_both! {
        async fn one_heartbeats_row_alone_and_nothing_at_all_are_written_as_such(store) {
            let at = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
            enroll(&store, "n1", Default::default()).await;
            store.record_heartbeats(&[]).await.unwrap();
            store.record_heartbeats(&[HeartbeatWrites { node: "n1".into(), ..Default::default() }]).await.unwrap();
            assert_eq!(store.node("n1").await.unwrap().last_heartbeat, None);
            let one = HeartbeatWrites {
                node: "n1".into(),
                row: Some(beat("192.0.2.9", 3, at, false)),
                ..Default::default()
            };
            store.record_heartbeats(&[one]).await.unwrap();
            let n1 = store.node("n1").await.unwrap();
            assert_eq!((n1.vtep.as_deref(), n1.last_heartbeat), (Some("192.0.2.9"), Some(at)));
            let live = store.liveness_since(at - time::Duration::seconds(1)).await.unwrap();
            assert_eq!(live[0].1.vouched_at, None, "a whole set of verdicts vouches for nothing");
        }
    }
}
