//! Heartbeats' writes, many heartbeats' in one transaction
//! ([`Store::record_heartbeats`]).
//!
//! At 1,000 nodes nearly every heartbeat writes something — a guest's new
//! state, a changed verdict, its row every few seconds — and the store's
//! writes are serialized: written one by one, each holds the writer for a
//! round trip to the database and a turn of the runtime, and creates queue
//! behind them. Written together, a group of them holds it once.
use otherix_proto::{Accelerator, VmState};

use crate::lbs::{bind_verdicts, verdicts_upsert_from, VERDICTS_PER_INSERT};
use crate::nodes::{beat_sql, bind_beat};
use crate::vms::{bind_states, states_update_from, STATES_PER_UPDATE};
use crate::{last_per_key, Dialect, NodeBeat, Store, StoreError, VerdictRecord};

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

/// Most arguments one string of statements carries on SQLite (its limit is
/// 32,766).
const ARGS_PER_STRING: usize = 8_000;

/// One statement of a group's write.
enum Piece<'a> {
    Verdicts(Vec<&'a VerdictRecord>),
    States(Vec<&'a VmStateWrite>),
    Row {
        node: &'a str,
        beat: &'a NodeBeat,
        sessions: String,
        overlays: String,
    },
}

impl Piece<'_> {
    fn args(&self) -> usize {
        match self {
            Piece::Verdicts(v) => 9 * v.len(),
            Piece::States(s) => 4 * s.len(),
            Piece::Row { .. } => 9,
        }
    }

    fn sql(&self, first: usize) -> String {
        match self {
            Piece::Verdicts(v) => verdicts_upsert_from(first, v.len()),
            Piece::States(s) => states_update_from(first, s.len()),
            Piece::Row { .. } => beat_sql(first),
        }
    }
}

type Query<'q> = sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>;

fn bind<'q>(q: Query<'q>, piece: &'q Piece<'q>) -> Query<'q> {
    match piece {
        Piece::Verdicts(v) => bind_verdicts(q, v),
        Piece::States(s) => bind_states(q, s),
        Piece::Row {
            node,
            beat,
            sessions,
            overlays,
        } => bind_beat(q, node, beat, sessions, overlays),
    }
}

impl Store {
    /// Writes the heartbeats' `writes` in one transaction: every verdict
    /// (upserted where its LB still exists), every guest's state, then
    /// every node's row (its `vouched_at` after the verdicts it vouches
    /// for). A later heartbeat's word on a verdict or a guest is the one
    /// kept, as if they were written one after the other. On SQLite the
    /// statements go to the database's thread as one string (one round
    /// trip, the arguments numbered across them); PostgreSQL prepares one
    /// at a time. A single statement is written on its own, with no
    /// transaction around it.
    pub async fn record_heartbeats(&self, writes: &[HeartbeatWrites]) -> Result<(), StoreError> {
        let verdicts: Vec<&VerdictRecord> = writes.iter().flat_map(|w| &w.verdicts).collect();
        let verdicts = last_per_key(&verdicts, |v| (v.lb.as_str(), v.vm_id.as_str()));
        let states: Vec<&VmStateWrite> = writes.iter().flat_map(|w| &w.states).collect();
        let states = last_per_key(&states, |s| s.vm_id.as_str());
        let mut pieces = Vec::new();
        for chunk in verdicts.chunks(VERDICTS_PER_INSERT) {
            pieces.push(Piece::Verdicts(chunk.iter().map(|v| **v).collect()));
        }
        for chunk in states.chunks(STATES_PER_UPDATE) {
            pieces.push(Piece::States(chunk.iter().map(|s| **s).collect()));
        }
        for w in writes {
            if let Some(beat) = &w.row {
                pieces.push(Piece::Row {
                    node: &w.node,
                    beat,
                    sessions: serde_json::to_string(&beat.sessions).unwrap_or_else(|_| "{}".into()),
                    overlays: serde_json::to_string(&beat.ready_overlays).unwrap_or_else(|_| "[]".into()),
                });
            }
        }
        match pieces.as_slice() {
            [] => return Ok(()),
            [one] if self.dialect == Dialect::Sqlite => {
                let sql = one.sql(1);
                self.exec(bind(sqlx::query(&sql), one)).await?;
                return Ok(());
            }
            _ => {}
        }
        let mut tx = self.begin_write().await?;
        let mut rest = pieces.as_slice();
        while !rest.is_empty() {
            // On SQLite as many as fit in one string; one at a time on PostgreSQL.
            let mut n = 1;
            if self.dialect == Dialect::Sqlite {
                let mut args = rest[0].args();
                while n < rest.len() && args + rest[n].args() <= ARGS_PER_STRING {
                    args += rest[n].args();
                    n += 1;
                }
            }
            let (these, after) = rest.split_at(n);
            rest = after;
            let mut first = 1;
            let sql: Vec<String> = these
                .iter()
                .map(|p| {
                    let sql = p.sql(first);
                    first += p.args();
                    sql
                })
                .collect();
            let sql = sql.join(";\n");
            let mut q = sqlx::query(&sql);
            for p in these {
                q = bind(q, p);
            }
            q.execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
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
        async fn heartbeats_past_one_string_of_statements_are_written_whole(store) {
            let at = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
            store.create_lb(&lb("web", 80, at)).await.unwrap();
            let n = 2 * ARGS_PER_STRING / 9 + 3;
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
