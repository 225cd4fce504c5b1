//! VMs and their NIC leases. A VM and its lease are written in one
//! transaction, so there is never a VM without an address or a lease without
//! its VM.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use otherix_core::ipam::{IpamError, Subnet};
use otherix_core::mac::MacAddr;
use otherix_proto::{Accelerator, Machine, Runtime, Vm};
use sqlx::any::AnyRow;
use sqlx::Row;
use time::OffsetDateTime;

use crate::{from_millis, Store, StoreError};

#[derive(Debug, Clone)]
pub struct NewVm {
    pub name: String,
    pub id: String,
    pub network: String,
    pub node: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub exec: Option<String>,
    /// A QEMU guest's machine; `None` for the netns runtime.
    pub machine: Option<Machine>,
}

pub(crate) const SELECT: &str = "SELECT v.id, v.name, v.network, v.node, v.labels, v.exec, v.state, v.reason,
        v.created_at, v.migrate_to, v.machine, v.accelerator, v.migration_id, v.migration_port, l.ip, l.mac
    FROM vms v JOIN leases l ON l.owner_kind = 'vm' AND l.owner = v.id";

pub(crate) fn vm_from_row(r: &AnyRow) -> Result<Vm, StoreError> {
    let labels: String = r.get("labels");
    let machine: Option<Machine> = r
        .get::<Option<String>, _>("machine")
        .map(|m| serde_json::from_str(&m))
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("vm machine: {e}")))?;
    let accelerator: Option<Accelerator> = r
        .get::<Option<String>, _>("accelerator")
        .map(|a| a.parse())
        .transpose()?;
    Ok(Vm {
        id: r.get("id"),
        name: r.get("name"),
        network: r.get("network"),
        node: r.get("node"),
        labels: serde_json::from_str(&labels).map_err(|e| StoreError::Corrupt(format!("vm labels: {e}")))?,
        mac: r
            .get::<String, _>("mac")
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("vm mac: {e}")))?,
        ip: Ipv4Addr::from(r.get::<i64, _>("ip") as u32),
        state: r.get::<String, _>("state").parse()?,
        reason: r.get("reason"),
        exec: r.get("exec"),
        migration_id: r.get("migration_id"),
        migration_port: r
            .get::<Option<i64>, _>("migration_port")
            .and_then(|p| u16::try_from(p).ok()),
        runtime: if machine.is_some() {
            Runtime::Qemu
        } else {
            Runtime::Netns
        },
        machine,
        accelerator,
        migrate_to: r.get("migrate_to"),
        created_at: from_millis(r.get("created_at")),
    })
}

impl Store {
    /// Creates a VM with a fresh MAC (from `random_mac`, retried on the rare
    /// collision) and the lowest free address of its network: a batch of
    /// one (see `vm_batch`).
    pub async fn create_vm(
        &self,
        new: &NewVm,
        random_mac: impl FnMut() -> MacAddr,
        now: OffsetDateTime,
    ) -> Result<Vm, StoreError> {
        let mut vms = self
            .create_vms(std::slice::from_ref(new), random_mac, now)
            .await?;
        // Invariant: a batch that was not refused created every VM of it.
        Ok(vms.pop().expect("one VM created"))
    }

    pub async fn vms(&self) -> Result<Vec<Vm>, StoreError> {
        let rows = sqlx::query(&format!("{SELECT} ORDER BY v.name"))
            .fetch_all(&self.read)
            .await?;
        rows.iter().map(vm_from_row).collect()
    }

    pub async fn vm(&self, name: &str) -> Result<Vm, StoreError> {
        let row = sqlx::query(&format!("{SELECT} WHERE v.name = $1"))
            .bind(name)
            .fetch_optional(&self.read)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: "vm",
                name: name.into(),
            })?;
        vm_from_row(&row)
    }

    /// Deletes a VM and frees its lease, in one transaction.
    pub async fn delete_vm(&self, name: &str) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let id: Option<String> = sqlx::query_scalar("SELECT id FROM vms WHERE name = $1")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(id) = id else {
            return Err(StoreError::NotFound {
                kind: "vm",
                name: name.into(),
            });
        };
        sqlx::query("DELETE FROM leases WHERE owner_kind = 'vm' AND owner = $1")
            .bind(&id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM vms WHERE id = $1")
            .bind(&id)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Sets and removes labels atomically; returns the VM as it is now.
    /// Refused, with nothing changed, if the result would carry more than
    /// `max_labels` labels.
    pub async fn update_vm_labels(
        &self,
        name: &str,
        set: &BTreeMap<String, String>,
        remove: &[String],
        max_labels: usize,
    ) -> Result<Vm, StoreError> {
        let mut tx = self.begin_write().await?;
        let labels: Option<String> = sqlx::query_scalar("SELECT labels FROM vms WHERE name = $1")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(labels) = labels else {
            return Err(StoreError::NotFound {
                kind: "vm",
                name: name.into(),
            });
        };
        let mut labels: BTreeMap<String, String> =
            serde_json::from_str(&labels).map_err(|e| StoreError::Corrupt(format!("vm labels: {e}")))?;
        for key in remove {
            labels.remove(key);
        }
        for (k, v) in set {
            labels.insert(k.clone(), v.clone());
        }
        if labels.len() > max_labels {
            return Err(StoreError::Invalid(format!(
                "vm {name:?} would carry {} labels; at most {max_labels} are allowed",
                labels.len()
            )));
        }
        let encoded = serde_json::to_string(&labels).map_err(|e| StoreError::Invalid(e.to_string()))?;
        sqlx::query("UPDATE vms SET labels = $1 WHERE name = $2")
            .bind(encoded)
            .bind(name)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        self.vm(name).await
    }

    /// Starts a migration: `migrating` toward `to`, only from `running` on
    /// `from` (so two concurrent requests cannot both start one), and for a
    /// bridge VM only while `to` has its network (a concurrent removal of
    /// that node from the network cannot slip in between).
    /// Starts migration `migration` (a fresh id) of VM `id` from `from` to `to`.
    pub async fn start_migration(
        &self,
        id: &str,
        from: &str,
        to: &str,
        migration: &str,
    ) -> Result<bool, StoreError> {
        let res = self
            .exec(
                sqlx::query(
                    "UPDATE vms SET state = 'migrating', migrate_to = $1, reason = NULL,
                    migration_id = $5, migration_port = NULL
             WHERE id = $2 AND node = $3 AND state = 'running' AND migrate_to IS NULL
               AND ((SELECT kind FROM networks WHERE name = vms.network) = 'overlay'
                    OR EXISTS (SELECT 1 FROM network_nodes m WHERE m.network = vms.network AND m.node = $4))",
                )
                .bind(to)
                .bind(id)
                .bind(from)
                .bind(to)
                .bind(migration),
            )
            .await?;
        Ok(res.rows_affected() == 1)
    }

    /// The source node handed the guest over: it now lives on the target.
    pub async fn complete_migration(&self, id: &str, from: &str) -> Result<bool, StoreError> {
        let res = self
            .exec(
                sqlx::query(
                    "UPDATE vms SET node = migrate_to, migrate_to = NULL, reason = NULL,
                    migration_id = NULL, migration_port = NULL
             WHERE id = $1 AND node = $2 AND migrate_to IS NOT NULL",
                )
                .bind(id)
                .bind(from),
            )
            .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Abandons a migration: the guest stays where it is, running.
    pub async fn roll_back_migration(&self, id: &str, reason: &str) -> Result<bool, StoreError> {
        let res = self
            .exec(
                sqlx::query(
                    "UPDATE vms SET migrate_to = NULL, state = 'running', reason = $1,
                migration_id = NULL, migration_port = NULL
             WHERE id = $2 AND migrate_to IS NOT NULL",
                )
                .bind(reason)
                .bind(id),
            )
            .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Records the port a QEMU migration's target listens on: only for the
    /// migration `migration` of VM `id` that goes to `node`.
    pub async fn set_migration_port(
        &self,
        id: &str,
        node: &str,
        migration: &str,
        port: u16,
    ) -> Result<bool, StoreError> {
        let res = self
            .exec(
                sqlx::query(
                    "UPDATE vms SET migration_port = $1 WHERE id = $2 AND migrate_to = $3 AND migration_id = $4",
                )
                .bind(i64::from(port))
                .bind(id)
                .bind(node)
                .bind(migration),
            )
            .await?;
        Ok(res.rows_affected() == 1)
    }
}

/// Where a new VM of bridge network `network` (on `nodes`) goes: the node
/// asked for, which must be one of them; else the only one; else none yet
/// (the scheduler picks among them).
pub(crate) fn bridge_placement(
    network: &str,
    nodes: &[String],
    asked: Option<&str>,
) -> Result<Option<String>, StoreError> {
    match (asked, nodes) {
        (Some(asked), _) if nodes.iter().any(|n| n == asked) => Ok(Some(asked.to_owned())),
        (Some(asked), _) => Err(StoreError::Invalid(format!(
            "network {network:?} is a bridge on node(s) {}; its VMs run there, not on {asked:?}",
            nodes.join(", ")
        ))),
        (None, [only]) => Ok(Some(only.clone())),
        (None, _) => Ok(None),
    }
}

/// Draws MACs until one is not leased yet. With 40 random bits a collision is
/// rare; a bounded loop keeps a broken generator from spinning forever.
/// The lowest free address of `network`, which the caller leases in the
/// same transaction. Starts at the network's hint (every address below it
/// is leased) and walks the leases from there a page at a time: amortized
/// a few index reads per allocation, not every lease of the network.
pub(crate) async fn free_address(
    tx: &mut crate::Tx,
    network: &str,
    subnet: &Subnet,
) -> Result<Ipv4Addr, StoreError> {
    const PAGE: i64 = 256;
    let range = subnet.lease_range();
    let (first, last) = (*range.start(), *range.end());
    let hint: Option<i64> = sqlx::query_scalar("SELECT next FROM lease_hints WHERE network = $1")
        .bind(network)
        .fetch_optional(&mut **tx)
        .await?;
    // u64: `last + 1` may not fit an address, and a corrupt hint is clamped.
    let mut candidate = hint
        .map_or(u64::from(first), |h| h.max(0) as u64)
        .max(u64::from(first));
    while candidate <= u64::from(last) {
        let taken: Vec<i64> = sqlx::query_scalar(
            "SELECT ip FROM leases WHERE network = $1 AND ip >= $2 AND ip <= $3 ORDER BY ip LIMIT $4",
        )
        .bind(network)
        .bind(candidate as i64)
        .bind(i64::from(last))
        .bind(PAGE)
        .fetch_all(&mut **tx)
        .await?;
        let full_page = taken.len() as i64 == PAGE;
        let mut gap = false;
        for ip in taken {
            if ip as u64 != candidate {
                gap = true;
                break;
            }
            candidate += 1;
        }
        if gap || !full_page {
            break;
        }
    }
    if candidate > u64::from(last) {
        return Err(IpamError::Exhausted {
            subnet: *subnet,
            capacity: subnet.capacity(),
        }
        .into());
    }
    sqlx::query(
        "INSERT INTO lease_hints (network, next) VALUES ($1, $2)
         ON CONFLICT (network) DO UPDATE SET next = excluded.next",
    )
    .bind(network)
    .bind((candidate + 1) as i64)
    .execute(&mut **tx)
    .await?;
    Ok(Ipv4Addr::from(candidate as u32))
}

pub(crate) async fn unique_mac(
    tx: &mut crate::Tx,
    random_mac: &mut impl FnMut() -> MacAddr,
) -> Result<MacAddr, StoreError> {
    for _ in 0..16 {
        let mac = random_mac();
        let taken: Option<i64> = sqlx::query_scalar("SELECT 1 FROM leases WHERE mac = $1")
            .bind(mac.to_string())
            .fetch_optional(&mut **tx)
            .await?;
        if taken.is_none() {
            return Ok(mac);
        }
    }
    Err(StoreError::Conflict(
        "could not draw an unused MAC address".into(),
    ))
}

#[cfg(test)]
mod tests {
    use otherix_proto::VmState;

    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{on_both, TestStore};

    async fn network(store: &Store, name: &str, subnet: &str) {
        crate::testing::overlay(store, name, subnet).await
    }

    async fn create(store: &Store, net: &str, name: &str, mac: &mut u64) -> Result<Vm, StoreError> {
        crate::testing::vm(store, net, name, mac).await
    }

    on_both! {
        async fn the_lowest_free_address_is_leased_freed_ones_again_and_a_full_subnet_refused(store) {
            let mut mac = 0;
            // A /22: 1,021 leasable addresses, past several pages of the walk.
            network(&store, "big", "10.20.0.0/22").await;
            let mut ips = Vec::new();
            for i in 0..1_021 {
                ips.push(
                    create(&store, "big", &format!("vm{i}"), &mut mac)
                        .await
                        .unwrap()
                        .ip,
                );
            }
            assert_eq!(ips[0], Ipv4Addr::new(10, 20, 0, 2));
            assert_eq!(ips[1_020], Ipv4Addr::new(10, 20, 3, 254));
            assert!(ips.windows(2).all(|w| u32::from(w[1]) == u32::from(w[0]) + 1));
            let err = create(&store, "big", "one-more", &mut mac).await.unwrap_err();
            assert!(matches!(err, StoreError::Exhausted(_)), "{err:?}");
            // Freed addresses are leased again, the lowest first, then the next.
            store.delete_vm("vm700").await.unwrap();
            store.delete_vm("vm300").await.unwrap();
            assert_eq!(create(&store, "big", "a", &mut mac).await.unwrap().ip, ips[300]);
            assert_eq!(create(&store, "big", "b", &mut mac).await.unwrap().ip, ips[700]);
            assert!(create(&store, "big", "c", &mut mac).await.is_err());
        }
    }

    on_both! {
        async fn a_hosts_report_of_many_guests_sets_each_ones_state_and_the_last_word_on_one_listed_twice(store) {
            let mut mac = 0;
            network(&store, "net", "10.40.0.0/22").await;
            let n = 203;
            for i in 0..n {
                create(&store, "net", &format!("vm{i}"), &mut mac).await.unwrap();
            }
            let ids: Vec<String> = (0..n).map(|i| format!("id-vm{i}")).collect();
            let mut states: Vec<(&str, VmState, Option<&str>, Option<Accelerator>)> = ids
                .iter()
                .map(|id| (id.as_str(), VmState::Running, None, None))
                .collect();
            states[1] = (&ids[1], VmState::Failed, Some("exec: not found"), None);
            states[2] = (&ids[2], VmState::Running, None, Some(Accelerator::Kvm));
            // Listed twice: the last word counts. An unknown VM is no error.
            states.push((&ids[0], VmState::Failed, Some("boot timed out"), None));
            states.push(("id-unknown", VmState::Running, None, None));
            crate::testing::record_states(&store, &states).await.unwrap();
            let vm = |i: usize| {
                let store = &store;
                async move { store.vm(&format!("vm{i}")).await.unwrap() }
            };
            let v0 = vm(0).await;
            assert_eq!((v0.state, v0.reason.as_deref()), (VmState::Failed, Some("boot timed out")));
            let v1 = vm(1).await;
            assert_eq!((v1.state, v1.reason.as_deref()), (VmState::Failed, Some("exec: not found")));
            let v2 = vm(2).await;
            assert_eq!((v2.state, v2.accelerator), (VmState::Running, Some(Accelerator::Kvm)));
            for i in 3..n {
                let v = vm(i).await;
                assert_eq!((v.state, v.reason, v.accelerator), (VmState::Running, None, None), "vm{i}");
            }
            // A few, in one statement: a reason said before is cleared.
            crate::testing::record_states(
                &store,
                &[
                    (&ids[1], VmState::Running, None, None),
                    (&ids[3], VmState::Failed, Some("gone"), None),
                ],
            )
            .await
                .unwrap();
            let (v1, v3) = (vm(1).await, vm(3).await);
            assert_eq!((v1.state, v1.reason), (VmState::Running, None));
            assert_eq!((v3.state, v3.reason.as_deref()), (VmState::Failed, Some("gone")));
        }
    }

    on_both! {
        async fn a_network_made_again_under_the_same_name_starts_from_its_first_address(store) {
            let mut mac = 0;
            network(&store, "net", "10.30.0.0/24").await;
            for i in 0..5 {
                create(&store, "net", &format!("vm{i}"), &mut mac).await.unwrap();
            }
            for i in 0..5 {
                store.delete_vm(&format!("vm{i}")).await.unwrap();
            }
            store.delete_network("net").await.unwrap();
            network(&store, "net", "10.31.0.0/24").await;
            assert_eq!(
                create(&store, "net", "fresh", &mut mac).await.unwrap().ip,
                Ipv4Addr::new(10, 31, 0, 2)
            );
        }
    }
}

#[cfg(test)]
mod replicas {
    use std::collections::HashSet;

    use super::*;
    use crate::NewNetwork;
    use otherix_proto::NetworkType;

    /// Three replicas' stores on one PostgreSQL database create 500 VMs at
    /// once, in one network: every create succeeds, and no address or MAC
    /// is leased twice.
    #[tokio::test]
    async fn three_replicas_creating_500_vms_at_once_lease_every_address_once_and_never_fail() {
        let (server, url) = tokio::task::spawn_blocking(|| {
            let server = otherix_testbed::postgres::Postgres::start_temporary().unwrap();
            let url = server.create_database("otherix").unwrap();
            (server, url)
        })
        .await
        .unwrap();
        // Opened together: the migrations run once, under their lock.
        let stores = futures_join3(
            Store::open_postgres(&url),
            Store::open_postgres(&url),
            Store::open_postgres(&url),
        )
        .await;
        let stores: Vec<Store> = stores.into_iter().map(Result::unwrap).collect();
        stores[0]
            .create_network(
                &NewNetwork {
                    name: "net".into(),
                    id: "id-net".into(),
                    kind: NetworkType::Overlay,
                    subnet: "10.40.0.0/22".parse().unwrap(),
                    nodes: vec![],
                },
                OffsetDateTime::now_utc(),
            )
            .await
            .unwrap();
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..500u32 {
            let store = stores[i as usize % 3].clone();
            tasks.spawn(async move {
                // MACs drawn from a small space on purpose: replicas collide
                // and must redraw, never lease one twice.
                let mut draw = u64::from(i) * 7;
                store
                    .create_vm(
                        &NewVm {
                            machine: None,
                            name: format!("vm{i}"),
                            id: format!("id-vm{i}"),
                            network: "net".into(),
                            node: None,
                            labels: BTreeMap::new(),
                            exec: None,
                        },
                        move || {
                            draw = (draw + 1) % 4096;
                            MacAddr([2, 0, 0, 0, (draw >> 8) as u8, draw as u8])
                        },
                        OffsetDateTime::now_utc(),
                    )
                    .await
            });
        }
        let mut failures = Vec::new();
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done.unwrap() {
                failures.push(e.to_string());
            }
        }
        assert!(
            failures.is_empty(),
            "{} creates failed: {:?}",
            failures.len(),
            &failures[..failures.len().min(5)]
        );
        let vms = stores[1].vms().await.unwrap();
        assert_eq!(vms.len(), 500);
        let ips: HashSet<Ipv4Addr> = vms.iter().map(|v| v.ip).collect();
        let macs: HashSet<MacAddr> = vms.iter().map(|v| v.mac).collect();
        assert_eq!(
            (ips.len(), macs.len()),
            (500, 500),
            "an address or a MAC leased twice"
        );
        // The lowest 500 addresses: allocation stayed lowest-free throughout.
        let lowest: HashSet<Ipv4Addr> = (2..502u32)
            .map(|n| Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 40, 0, 0)) + n))
            .collect();
        assert_eq!(ips, lowest);
        // Every replica follows the same change log, in one order.
        let changes = stores[2].changes_since(0, 10_000).await.unwrap();
        assert!(changes.windows(2).all(|w| w[0].revision < w[1].revision));
        for s in &stores {
            s.close().await;
        }
        drop(server);
    }

    async fn futures_join3<A: std::future::Future>(a: A, b: A, c: A) -> [A::Output; 3] {
        let (a, b, c) = tokio::join!(a, b, c);
        [a, b, c]
    }
}
