//! VMs and their NIC leases. A VM and its lease are written in one
//! transaction, so there is never a VM without an address or a lease without
//! its VM.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use otherix_core::ipam::{allocate, Subnet};
use otherix_core::mac::MacAddr;
use otherix_proto::{NetworkType, Vm, VmState};
use sqlx::sqlite::SqliteRow;
use sqlx::Row;
use time::OffsetDateTime;

use crate::{from_millis, to_millis, Store, StoreError};

#[derive(Debug, Clone)]
pub struct NewVm {
    pub name: String,
    pub id: String,
    pub network: String,
    pub node: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub exec: Option<String>,
}

pub(crate) const SELECT: &str = "SELECT v.id, v.name, v.network, v.node, v.labels, v.exec, v.state, v.reason,
        v.created_at, v.migrate_to, l.ip, l.mac
    FROM vms v JOIN leases l ON l.owner_kind = 'vm' AND l.owner = v.id";

pub(crate) fn vm_from_row(r: &SqliteRow) -> Result<Vm, StoreError> {
    let labels: String = r.get("labels");
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
        migrate_to: r.get("migrate_to"),
        created_at: from_millis(r.get("created_at")),
    })
}

impl Store {
    /// Creates a VM with a fresh MAC (from `random_mac`, retried on the rare
    /// collision) and the lowest free address of its network.
    pub async fn create_vm(
        &self,
        new: &NewVm,
        mut random_mac: impl FnMut() -> MacAddr,
        now: OffsetDateTime,
    ) -> Result<Vm, StoreError> {
        let mut tx = self.write.begin().await?;
        let exists: Option<String> = sqlx::query_scalar("SELECT id FROM vms WHERE name = ?")
            .bind(&new.name)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_some() {
            return Err(StoreError::AlreadyExists {
                kind: "vm",
                name: new.name.clone(),
            });
        }
        let net: Option<(String, String)> =
            sqlx::query_as("SELECT kind, subnet FROM networks WHERE name = ?")
                .bind(&new.network)
                .fetch_optional(&mut *tx)
                .await?;
        let Some((kind, subnet)) = net else {
            return Err(StoreError::NotFound {
                kind: "network",
                name: new.network.clone(),
            });
        };
        let kind: NetworkType = kind.parse()?;
        let subnet: Subnet = subnet
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("network subnet: {e}")))?;
        let node = match kind {
            NetworkType::Overlay => new.node.clone(),
            NetworkType::Bridge => {
                let nodes: Vec<String> =
                    sqlx::query_scalar("SELECT node FROM network_nodes WHERE network = ? ORDER BY node")
                        .bind(&new.network)
                        .fetch_all(&mut *tx)
                        .await?;
                bridge_placement(&new.network, &nodes, new.node.as_deref())?
            }
        };

        let used: BTreeSet<Ipv4Addr> =
            sqlx::query_scalar::<_, i64>("SELECT ip FROM leases WHERE network = ?")
                .bind(&new.network)
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .map(|ip| Ipv4Addr::from(ip as u32))
                .collect();
        let ip = allocate(&subnet, &used)?;
        let mac = loop_unique_mac(&mut tx, &mut random_mac).await?;

        let labels = serde_json::to_string(&new.labels).map_err(|e| StoreError::Invalid(e.to_string()))?;
        sqlx::query(
            "INSERT INTO vms (id, name, network, node, labels, exec, state, created_at)
             VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
        )
        .bind(&new.id)
        .bind(&new.name)
        .bind(&new.network)
        .bind(&node)
        .bind(labels)
        .bind(&new.exec)
        .bind(to_millis(now))
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO leases (network, ip, mac, owner_kind, owner, created_at) VALUES (?, ?, ?, 'vm', ?, ?)",
        )
        .bind(&new.network)
        .bind(i64::from(u32::from(ip)))
        .bind(mac.to_string())
        .bind(&new.id)
        .bind(to_millis(now))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        self.vm(&new.name).await
    }

    pub async fn vms(&self) -> Result<Vec<Vm>, StoreError> {
        let rows = sqlx::query(&format!("{SELECT} ORDER BY v.name"))
            .fetch_all(&self.read)
            .await?;
        rows.iter().map(vm_from_row).collect()
    }

    pub async fn vm(&self, name: &str) -> Result<Vm, StoreError> {
        let row = sqlx::query(&format!("{SELECT} WHERE v.name = ?"))
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
        let mut tx = self.write.begin().await?;
        let id: Option<String> = sqlx::query_scalar("SELECT id FROM vms WHERE name = ?")
            .bind(name)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(id) = id else {
            return Err(StoreError::NotFound {
                kind: "vm",
                name: name.into(),
            });
        };
        sqlx::query("DELETE FROM leases WHERE owner_kind = 'vm' AND owner = ?")
            .bind(&id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM vms WHERE id = ?")
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
        let mut tx = self.write.begin().await?;
        let labels: Option<String> = sqlx::query_scalar("SELECT labels FROM vms WHERE name = ?")
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
        sqlx::query("UPDATE vms SET labels = ? WHERE name = ?")
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
    pub async fn start_migration(&self, id: &str, from: &str, to: &str) -> Result<bool, StoreError> {
        let res = sqlx::query(
            "UPDATE vms SET state = 'migrating', migrate_to = ?, reason = NULL
             WHERE id = ? AND node = ? AND state = 'running' AND migrate_to IS NULL
               AND ((SELECT kind FROM networks WHERE name = vms.network) = 'overlay'
                    OR EXISTS (SELECT 1 FROM network_nodes m WHERE m.network = vms.network AND m.node = ?))",
        )
        .bind(to)
        .bind(id)
        .bind(from)
        .bind(to)
        .execute(&self.write)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// The source node handed the guest over: it now lives on the target.
    pub async fn complete_migration(&self, id: &str, from: &str) -> Result<bool, StoreError> {
        let res = sqlx::query(
            "UPDATE vms SET node = migrate_to, migrate_to = NULL, reason = NULL
             WHERE id = ? AND node = ? AND migrate_to IS NOT NULL",
        )
        .bind(id)
        .bind(from)
        .execute(&self.write)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Abandons a migration: the guest stays where it is, running.
    pub async fn roll_back_migration(&self, id: &str, reason: &str) -> Result<bool, StoreError> {
        let res = sqlx::query(
            "UPDATE vms SET migrate_to = NULL, state = 'running', reason = ? WHERE id = ? AND migrate_to IS NOT NULL",
        )
        .bind(reason)
        .bind(id)
        .execute(&self.write)
        .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Records a VM's runtime state as reported by its node.
    pub async fn set_vm_state(
        &self,
        id: &str,
        state: VmState,
        reason: Option<&str>,
    ) -> Result<(), StoreError> {
        sqlx::query("UPDATE vms SET state = ?, reason = ? WHERE id = ?")
            .bind(state.as_str())
            .bind(reason)
            .bind(id)
            .execute(&self.write)
            .await?;
        Ok(())
    }
}

/// Where a new VM of bridge network `network` (on `nodes`) goes: the node
/// asked for, which must be one of them; else the only one; else none yet
/// (the scheduler picks among them).
fn bridge_placement(
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
async fn loop_unique_mac(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    random_mac: &mut impl FnMut() -> MacAddr,
) -> Result<MacAddr, StoreError> {
    for _ in 0..16 {
        let mac = random_mac();
        let taken: Option<i64> = sqlx::query_scalar("SELECT 1 FROM leases WHERE mac = ?")
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
