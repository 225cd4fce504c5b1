//! The change log (migration 0016): triggers append `(revision, kind, key)`
//! to `changes` in the transaction of every write to what the catalog
//! holds; readers catch up by revision and re-read what each change names.
//! Also the readers that re-reading needs: one object by its key, and
//! every row of a kind for a full load.

use std::collections::HashMap;
use std::net::Ipv4Addr;

use sqlx::Row;
use time::OffsetDateTime;

use crate::{from_millis, to_millis, NodeLease, Store, StoreError, TokenRecord, VerdictRecord};

/// What a change is about; its key names the object (see the migration).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ChangeKind {
    /// A user, its tokens or its rules (key: user name).
    User,
    /// Key: grant id.
    Grant,
    /// A network or its node list (key: name).
    Network,
    /// A VM or its lease (key: VM id).
    Vm,
    /// A node's overlay lease (key: `NETWORK NODE`).
    NodeLease,
    /// Key: node name.
    Node,
    /// A node's certificates (key: node name).
    NodeCert,
    /// Key: LB name.
    Lb,
    /// Key: `LB VM_ID`.
    Verdict,
    /// The session signing keys (whole set).
    SessionKeys,
    /// The revocations (whole set).
    Revocations,
    /// The open sessions of one principal (key: principal).
    OpenSessions,
    /// Byte counts of open sessions moved (key: the gateway node, or empty
    /// for the relay). One per batch of updates, written by the batch, not
    /// by a trigger: nothing to re-read, the consoles' sessions pages are
    /// told (no more often than their coalescing lets them).
    SessionBytes,
}

impl ChangeKind {
    /// Every kind.
    pub const ALL: [ChangeKind; 13] = [
        ChangeKind::User,
        ChangeKind::Grant,
        ChangeKind::Network,
        ChangeKind::Vm,
        ChangeKind::NodeLease,
        ChangeKind::Node,
        ChangeKind::NodeCert,
        ChangeKind::Lb,
        ChangeKind::Verdict,
        ChangeKind::SessionKeys,
        ChangeKind::Revocations,
        ChangeKind::OpenSessions,
        ChangeKind::SessionBytes,
    ];

    fn parse(s: &str) -> Option<ChangeKind> {
        Some(match s {
            "user" => ChangeKind::User,
            "grant" => ChangeKind::Grant,
            "network" => ChangeKind::Network,
            "vm" => ChangeKind::Vm,
            "node_lease" => ChangeKind::NodeLease,
            "node" => ChangeKind::Node,
            "node_cert" => ChangeKind::NodeCert,
            "lb" => ChangeKind::Lb,
            "verdict" => ChangeKind::Verdict,
            "session_keys" => ChangeKind::SessionKeys,
            "revocations" => ChangeKind::Revocations,
            "open_sessions" => ChangeKind::OpenSessions,
            "session_bytes" => ChangeKind::SessionBytes,
            _ => return None,
        })
    }
}

/// Appends a change no trigger writes (one per batch of updates, where a
/// row-by-row trigger would log each row) in `conn`'s transaction; on
/// PostgreSQL, other replicas are notified at commit as by the triggers.
pub(crate) async fn log(
    conn: &mut sqlx::AnyConnection,
    kind: &str,
    key: &str,
    dialect: crate::Dialect,
) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO changes (kind, key) VALUES ($1, $2)")
        .bind(kind)
        .bind(key)
        .execute(&mut *conn)
        .await?;
    if dialect == crate::Dialect::Postgres {
        sqlx::query("SELECT pg_notify($1, '')")
            .bind(crate::CHANGES_CHANNEL)
            .execute(&mut *conn)
            .await?;
    }
    Ok(())
}

/// One entry of the change log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub revision: i64,
    pub kind: ChangeKind,
    pub key: String,
}

/// A certificate issued to a node, as the agent endpoints check it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCertRecord {
    pub fingerprint: String,
    pub node: String,
    pub purpose: String,
    pub not_after: OffsetDateTime,
}

/// The change log past `$1` (at most `$2` changes), each VM change with
/// the VM's row and lease as [`crate::vms::SELECT`] reads them.
const CHANGES_AND_VMS: &str = "SELECT c.revision, c.kind, c.key, v.id, v.name, v.network, v.node, v.labels,
        v.exec, v.state, v.reason, v.created_at, v.migrate_to, v.machine, v.accelerator, v.migration_id,
        v.migration_port, l.ip, l.mac
    FROM (SELECT revision, kind, key FROM changes WHERE revision > $1 ORDER BY revision LIMIT $2) c
    LEFT JOIN vms v ON c.kind = 'vm' AND v.id = c.key
    LEFT JOIN leases l ON l.owner_kind = 'vm' AND l.owner = v.id
    ORDER BY c.revision";

impl Store {
    /// The newest revision (0 before any change).
    pub async fn revision(&self) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT COALESCE(MAX(revision), 0) FROM changes")
                .fetch_one(&self.read)
                .await?,
        )
    }

    /// The oldest revision still in the log (0 when it is empty): a reader
    /// whose last applied revision is below it has missed pruned changes
    /// and must load everything again.
    pub async fn oldest_revision(&self) -> Result<i64, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT COALESCE(MIN(revision), 0) FROM changes")
                .fetch_one(&self.read)
                .await?,
        )
    }

    /// Up to `limit` changes after `revision`, oldest first. A change of a
    /// kind this binary does not know (a newer one wrote it) is skipped.
    pub async fn changes_since(&self, revision: i64, limit: u32) -> Result<Vec<Change>, StoreError> {
        let rows = sqlx::query(
            "SELECT revision, kind, key FROM changes WHERE revision > $1 ORDER BY revision LIMIT $2",
        )
        .bind(revision)
        .bind(i64::from(limit))
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                Some(Change {
                    revision: r.get("revision"),
                    kind: ChangeKind::parse(r.get("kind"))?,
                    key: r.get("key"),
                })
            })
            .collect())
    }

    /// [`Store::changes_since`], with the VMs the changes name as they are
    /// now, read in the same query (one round trip for a catch-up that a
    /// group of creates or a host's report of its guests' states caused,
    /// not two; and one statement text whatever the number of VMs). A VM
    /// named but gone is not in the map.
    pub async fn changes_and_vms_since(
        &self,
        revision: i64,
        limit: u32,
    ) -> Result<(Vec<Change>, HashMap<String, otherix_proto::Vm>), StoreError> {
        let rows = sqlx::query(CHANGES_AND_VMS)
            .bind(revision)
            .bind(i64::from(limit))
            .fetch_all(&self.read)
            .await?;
        let mut changes = Vec::with_capacity(rows.len());
        let mut vms = HashMap::new();
        for r in &rows {
            let Some(kind) = ChangeKind::parse(r.get("kind")) else {
                continue;
            };
            let key: String = r.get("key");
            // A VM row only with its lease, as every read of VMs has them.
            let found = kind == ChangeKind::Vm
                && r.try_get::<Option<String>, _>("id")?.is_some()
                && r.try_get::<Option<i64>, _>("ip")?.is_some();
            if found && !vms.contains_key(&key) {
                vms.insert(key.clone(), crate::vms::vm_from_row(r)?);
            }
            changes.push(Change {
                revision: r.get("revision"),
                kind,
                key,
            });
        }
        Ok((changes, vms))
    }

    /// Forgets changes older than `before`, keeping at least the newest
    /// `keep` whatever their age.
    pub async fn prune_changes(&self, before: OffsetDateTime, keep: u32) -> Result<u64, StoreError> {
        let res = self.exec(sqlx::query(
            "DELETE FROM changes WHERE at < $1 AND revision <= (SELECT COALESCE(MAX(revision), 0) FROM changes) - $2",
        )
        .bind(to_millis(before))
        .bind(i64::from(keep))
        )
        .await?;
        Ok(res.rows_affected())
    }

    /// A VM by id.
    pub async fn vm_by_id(&self, id: &str) -> Result<Option<otherix_proto::Vm>, StoreError> {
        let row = sqlx::query(&format!("{} WHERE v.id = $1", crate::vms::SELECT))
            .bind(id)
            .fetch_optional(&self.read)
            .await?;
        row.as_ref().map(crate::vms::vm_from_row).transpose()
    }

    /// One node's lease on one overlay.
    pub async fn node_lease(&self, network: &str, node: &str) -> Result<Option<NodeLease>, StoreError> {
        let row = sqlx::query(
            "SELECT network, owner, ip, mac FROM leases WHERE owner_kind = 'node' AND network = $1 AND owner = $2",
        )
        .bind(network)
        .bind(node)
        .fetch_optional(&self.read)
        .await?;
        row.as_ref().map(node_lease_from_row).transpose()
    }

    /// Every certificate issued to `node` (or, with `None`, to any node).
    pub async fn node_certs(&self, node: Option<&str>) -> Result<Vec<NodeCertRecord>, StoreError> {
        let rows = match node {
            Some(n) => {
                sqlx::query("SELECT fingerprint, node, purpose, not_after FROM node_certs WHERE node = $1")
                    .bind(n)
                    .fetch_all(&self.read)
                    .await?
            }
            None => {
                sqlx::query("SELECT fingerprint, node, purpose, not_after FROM node_certs")
                    .fetch_all(&self.read)
                    .await?
            }
        };
        Ok(rows
            .iter()
            .map(|r| NodeCertRecord {
                fingerprint: r.get("fingerprint"),
                node: r.get("node"),
                purpose: r.get("purpose"),
                not_after: from_millis(r.get("not_after")),
            })
            .collect())
    }

    /// The tokens of `user` (or, with `None`, of everyone), with their hashes.
    pub async fn tokens(&self, user: Option<&str>) -> Result<Vec<TokenRecord>, StoreError> {
        let sql = "SELECT t.id, t.user_name, u.role, t.secret_hash, t.last_used_at, t.expires_at
             FROM api_tokens t JOIN users u ON u.name = t.user_name";
        let rows = match user {
            Some(u) => {
                sqlx::query(&format!("{sql} WHERE t.user_name = $1"))
                    .bind(u)
                    .fetch_all(&self.read)
                    .await?
            }
            None => sqlx::query(sql).fetch_all(&self.read).await?,
        };
        rows.iter().map(crate::users::token_from_row).collect()
    }

    /// The verdict of `vm_id` behind `lb`.
    pub async fn verdict(&self, lb: &str, vm_id: &str) -> Result<Option<VerdictRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM health_verdicts WHERE lb = $1 AND vm_id = $2")
            .bind(lb)
            .bind(vm_id)
            .fetch_optional(&self.read)
            .await?;
        Ok(row.as_ref().map(crate::lbs::verdict_from_row))
    }

    /// The verdicts of `pairs` (LB, VM id) that exist, in one query per few
    /// hundred: a catalog catching up on a burst of verdicts (a new LB's
    /// backends probed) reads them together.
    pub async fn verdicts_of(&self, pairs: &[(&str, &str)]) -> Result<Vec<VerdictRecord>, StoreError> {
        let mut found = Vec::with_capacity(pairs.len());
        for chunk in pairs.chunks(200) {
            let wanted = (0..chunk.len())
                .map(|i| format!("(lb = ${} AND vm_id = ${})", 2 * i + 1, 2 * i + 2))
                .collect::<Vec<_>>()
                .join(" OR ");
            let sql = format!("SELECT * FROM health_verdicts WHERE {wanted}");
            let mut q = sqlx::query(&sql);
            for (lb, vm) in chunk {
                q = q.bind(*lb).bind(*vm);
            }
            for row in q.fetch_all(&self.read).await? {
                found.push(crate::lbs::verdict_from_row(&row));
            }
        }
        Ok(found)
    }

    /// Open sessions per principal and carrier (see [`Store::open_session_count`]).
    pub async fn open_session_counts(&self) -> Result<Vec<(String, String, u64)>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT principal, {} AS carrier, COUNT(*) AS n FROM open_sessions GROUP BY principal, carrier",
            crate::sessions::CARRIER
        ))
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(|r| (r.get("principal"), r.get("carrier"), r.get::<i64, _>("n") as u64))
            .collect())
    }
}

pub(crate) fn node_lease_from_row(r: &sqlx::any::AnyRow) -> Result<NodeLease, StoreError> {
    Ok(NodeLease {
        network: r.get("network"),
        node: r.get("owner"),
        ip: Ipv4Addr::from(r.get::<i64, _>("ip") as u32),
        mac: r
            .get::<String, _>("mac")
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("node lease mac: {e}")))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{on_both, TestStore};
    use otherix_proto::NetworkType;

    on_both! {
        async fn writes_append_changes_that_name_what_they_touched(store) {
            let start = store.revision().await.unwrap();
            let now = OffsetDateTime::now_utc();
            store
                .create_network(
                    &crate::NewNetwork {
                        name: "net".into(),
                        id: "n1".into(),
                        kind: NetworkType::Overlay,
                        subnet: "10.100.0.0/24".parse().unwrap(),
                        nodes: vec![],
                    },
                    now,
                )
                .await
                .unwrap();
            let changes = store.changes_since(start, 100).await.unwrap();
            assert!(
                changes
                    .iter()
                    .any(|c| c.kind == ChangeKind::Network && c.key == "net"),
                "{changes:?}"
            );
            assert!(changes.windows(2).all(|w| w[0].revision < w[1].revision));
            let after = store.revision().await.unwrap();
            assert!(after > start);
            assert!(store.changes_since(after, 100).await.unwrap().is_empty());
            assert_eq!(store.changes_since(start, 1).await.unwrap().len(), 1, "bounded");
            // Pruning keeps the newest.
            store
                .prune_changes(now + time::Duration::hours(1), 1)
                .await
                .unwrap();
            assert_eq!(store.oldest_revision().await.unwrap(), after);
        }
    }

    on_both! {
        async fn the_log_comes_with_the_vms_it_names_as_they_are_now(store) {
            crate::testing::overlay(&store, "net", "10.101.0.0/24").await;
            let start = store.revision().await.unwrap();
            let now = OffsetDateTime::now_utc();
            let mut macs = (1u8..).map(|i| otherix_core::mac::MacAddr([2, 0, 0, 0, 9, i]));
            let new = |name: &str| crate::NewVm {
                machine: None,
                name: name.into(),
                id: format!("id-{name}"),
                network: "net".into(),
                node: None,
                labels: Default::default(),
                exec: None,
            };
            let vms = store
                .create_vms(&[new("a"), new("b"), new("c")], || macs.next().unwrap(), now)
                .await
                .unwrap();
            crate::testing::record_states(&store, &[("id-b", otherix_proto::VmState::Running, None, None)])
                .await
                .unwrap();
            store.delete_vm("c").await.unwrap();
            crate::testing::overlay(&store, "other", "10.102.0.0/24").await;

            let (changes, found) = store.changes_and_vms_since(start, 100).await.unwrap();
            assert_eq!(changes, store.changes_since(start, 100).await.unwrap(), "the same log");
            assert!(changes.iter().any(|c| c.kind == ChangeKind::Network && c.key == "other"));
            // a as created, b as it is now (running), c gone.
            assert_eq!(found.len(), 2, "{found:?}");
            let as_now = store.vms().await.unwrap();
            for id in ["id-a", "id-b"] {
                let now = as_now.iter().find(|v| v.id == id).unwrap();
                assert_eq!(
                    serde_json::to_value(&found[id]).unwrap(),
                    serde_json::to_value(now).unwrap()
                );
            }
            assert_eq!(found["id-b"].state, otherix_proto::VmState::Running);
            assert_eq!(found["id-a"].ip, vms[0].ip);
            assert!(changes.iter().any(|c| c.kind == ChangeKind::Vm && c.key == "id-c"));
            assert!(!found.contains_key("id-c"));
            // Bounded like the log alone, the VMs of the changes read only.
            let (first, found) = store.changes_and_vms_since(start, 1).await.unwrap();
            assert_eq!(first.len(), 1);
            assert!(found.keys().all(|id| first.iter().any(|c| &c.key == id)));
        }
    }
}

#[cfg(test)]
mod verdicts {
    use std::collections::BTreeMap;

    use otherix_core::lb::Health;
    use otherix_proto::{NetworkType, ProbeKind};

    use super::*;
    use crate::testing::on_both;
    use crate::{LbRecord, NewVm};

    on_both! {
        /// The verdicts a catalog catching up asks for, read in one query:
        /// exactly those that exist, whichever LB and VM they pair.
        async fn verdicts_are_read_together_exactly_as_asked(store) {
            let now = OffsetDateTime::now_utc();
            store
                .create_network(
                    &crate::NewNetwork {
                        name: "net".into(),
                        id: "n1".into(),
                        kind: NetworkType::Overlay,
                        subnet: "10.100.0.0/24".parse().unwrap(),
                        nodes: vec![],
                    },
                    now,
                )
                .await
                .unwrap();
            let news: Vec<NewVm> = ["a", "b", "c"]
                .iter()
                .map(|n| NewVm {
                    name: n.to_string(),
                    id: format!("id-{n}"),
                    network: "net".into(),
                    node: None,
                    labels: BTreeMap::new(),
                    exec: None,
                    machine: None,
                })
                .collect();
            let mut mac = 0u8;
            store
                .create_vms(&news, || {
                    mac += 1;
                    otherix_core::mac::MacAddr([2, 0, 0, 0, 0, mac])
                }, now)
                .await
                .unwrap();
            for lb in ["lb1", "lb2"] {
                store
                    .create_lb(&LbRecord {
                        name: lb.into(),
                        port: 80,
                        selector: "app=web".into(),
                        health_kind: ProbeKind::Tcp,
                        health_path: None,
                        health_port: None,
                        interval_ms: 5000,
                        timeout_ms: 2000,
                        rise: 2,
                        fall: 3,
                        created_at: now,
                    })
                    .await
                    .unwrap();
            }
            let verdict = |lb: &str, vm: &str, health| VerdictRecord {
                lb: lb.into(),
                vm_id: vm.into(),
                node: "node1".into(),
                health,
                probed_at: now,
                changed_at: Some(now),
                reason: None,
                successes: 2,
                failures: 0,
            };
            crate::testing::record_verdicts(
                &store,
                &[
                    verdict("lb1", "id-a", Health::Healthy),
                    verdict("lb2", "id-b", Health::Unhealthy),
                    verdict("lb1", "id-c", Health::Healthy),
                ],
            )
            .await
                .unwrap();
            let mut found: Vec<(String, String, Health)> = store
                .verdicts_of(&[("lb1", "id-a"), ("lb2", "id-b"), ("lb1", "id-b"), ("lb2", "id-c")])
                .await
                .unwrap()
                .into_iter()
                .map(|v| (v.lb, v.vm_id, v.health))
                .collect();
            found.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
            assert_eq!(
                found,
                vec![
                    ("lb1".to_string(), "id-a".to_string(), Health::Healthy),
                    ("lb2".to_string(), "id-b".to_string(), Health::Unhealthy),
                ]
            );
        }
    }
}

#[cfg(test)]
mod listening {
    use super::*;
    use crate::testing::on_both;

    on_both! {
        /// Another control plane's write wakes the listener (PostgreSQL);
        /// SQLite has no other writer and no listener.
        async fn a_commit_by_another_store_wakes_the_listener(store) {
            let Some(mut listener) = store.change_listener().await.unwrap() else {
                assert_eq!(store.dialect(), crate::Dialect::Sqlite);
                return;
            };
            let other = store.another().await;
            let wait = tokio::spawn(async move { listener.next().await });
            other
                .create_user("carol", otherix_proto::Role::Viewer, OffsetDateTime::now_utc())
                .await
                .unwrap();
            tokio::time::timeout(std::time::Duration::from_secs(20), wait)
                .await
                .expect("woken by the commit")
                .unwrap()
                .unwrap();
        }
    }
}
