//! Networks: subnets the CP owns, overlay VNIs allocated here.

use std::collections::BTreeSet;

use otherix_core::ipam::Subnet;
use otherix_proto::{Network, NetworkType};
use sqlx::any::AnyRow;
use sqlx::Row;
use time::OffsetDateTime;

use crate::error::is_unique_violation;
use crate::{from_millis, to_millis, Dialect, Store, StoreError};

/// VNIs below this are left alone (some tools treat small VNIs specially).
const FIRST_VNI: u32 = 100;
/// VXLAN has 24-bit VNIs.
const LAST_VNI: u32 = (1 << 24) - 1;

#[derive(Debug, Clone)]
pub struct NewNetwork {
    pub name: String,
    pub id: String,
    pub kind: NetworkType,
    pub subnet: Subnet,
    /// The nodes a bridge network exists on (none for an overlay).
    pub nodes: Vec<String>,
}

/// Networks with their VM count and node list; the list is an aggregate,
/// which the dialects spell differently.
fn select(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Sqlite => {
            "SELECT n.name, n.id, n.kind, n.subnet, n.vni, n.created_at,
                (SELECT COUNT(*) FROM vms v WHERE v.network = n.name) AS vm_count,
                (SELECT group_concat(node, ',') FROM
                    (SELECT node FROM network_nodes m WHERE m.network = n.name ORDER BY node)) AS nodes
            FROM networks n"
        }
        Dialect::Postgres => {
            "SELECT n.name, n.id, n.kind, n.subnet, n.vni, n.created_at,
                (SELECT COUNT(*) FROM vms v WHERE v.network = n.name) AS vm_count,
                (SELECT string_agg(node, ',' ORDER BY node) FROM network_nodes m WHERE m.network = n.name) AS nodes
            FROM networks n"
        }
    }
}

fn network_from_row(r: &AnyRow) -> Result<Network, StoreError> {
    let subnet: String = r.get("subnet");
    let parsed: Subnet = subnet
        .parse()
        .map_err(|e| StoreError::Corrupt(format!("network subnet {subnet:?}: {e}")))?;
    // Node names are DNS labels: no commas.
    let nodes: Vec<String> = r
        .get::<Option<String>, _>("nodes")
        .map(|s| s.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    Ok(Network {
        name: r.get("name"),
        id: r.get("id"),
        kind: r.get::<String, _>("kind").parse()?,
        subnet: parsed,
        vni: r.get::<Option<i64>, _>("vni").map(|v| v as u32),
        node: nodes.first().cloned(),
        nodes,
        node_address: parsed.node_address(),
        vms: r.get::<i64, _>("vm_count") as u32,
        created_at: from_millis(r.get("created_at")),
    })
}

impl Store {
    /// Creates a network. Refuses a subnet that overlaps another network's:
    /// gateways join every overlay, and overlapping subnets on one node would
    /// make their routes ambiguous.
    pub async fn create_network(&self, new: &NewNetwork, now: OffsetDateTime) -> Result<Network, StoreError> {
        let nodes: BTreeSet<&str> = new.nodes.iter().map(String::as_str).collect();
        let mut tx = self.begin_write().await?;
        let existing: Vec<(String, String)> = sqlx::query_as("SELECT name, subnet FROM networks")
            .fetch_all(&mut *tx)
            .await?;
        for (name, subnet) in &existing {
            if name == &new.name {
                return Err(StoreError::AlreadyExists {
                    kind: "network",
                    name: new.name.clone(),
                });
            }
            let other: Subnet = subnet
                .parse()
                .map_err(|e| StoreError::Corrupt(format!("network {name:?} subnet: {e}")))?;
            if other.overlaps(&new.subnet) {
                return Err(StoreError::Conflict(format!(
                    "subnet {} overlaps network {name:?} ({other})",
                    new.subnet
                )));
            }
        }
        let vni = match new.kind {
            NetworkType::Overlay => {
                let used: Vec<i64> =
                    sqlx::query_scalar("SELECT vni FROM networks WHERE vni IS NOT NULL ORDER BY vni")
                        .fetch_all(&mut *tx)
                        .await?;
                Some(lowest_free_vni(&used)?)
            }
            NetworkType::Bridge => None,
        };
        let res = sqlx::query(
            "INSERT INTO networks (name, id, kind, subnet, vni, node, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&new.name)
        .bind(&new.id)
        .bind(new.kind.as_str())
        .bind(new.subnet.to_string())
        .bind(vni.map(i64::from))
        .bind(nodes.first())
        .bind(to_millis(now))
        .execute(&mut *tx)
        .await
        .map_err(StoreError::from);
        match res {
            Err(e) if is_unique_violation(&e) => {
                return Err(StoreError::AlreadyExists {
                    kind: "network",
                    name: new.name.clone(),
                })
            }
            other => other?,
        };
        for node in &nodes {
            sqlx::query("INSERT INTO network_nodes (network, node) VALUES ($1, $2)")
                .bind(&new.name)
                .bind(node)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        self.network(&new.name).await
    }

    /// A bridge network also exists on `node` from now on: the node gets a
    /// bridge of its own for it. Idempotent.
    pub async fn add_network_node(&self, network: &str, node: &str) -> Result<Network, StoreError> {
        let mut tx = self.begin_write().await?;
        bridge_kind(&mut tx, network).await?;
        sqlx::query("INSERT INTO network_nodes (network, node) VALUES ($1, $2) ON CONFLICT DO NOTHING")
            .bind(network)
            .bind(node)
            .execute(&mut *tx)
            .await?;
        sync_first_node(&mut tx, network).await?;
        tx.commit().await?;
        self.network(network).await
    }

    /// A bridge network no longer exists on `node`. Refused while the node
    /// hosts (or is receiving) VMs of it, and for its last node: delete the
    /// network instead.
    pub async fn remove_network_node(&self, network: &str, node: &str) -> Result<Network, StoreError> {
        let mut tx = self.begin_write().await?;
        bridge_kind(&mut tx, network).await?;
        let nodes: Vec<String> =
            sqlx::query_scalar("SELECT node FROM network_nodes WHERE network = $1 ORDER BY node")
                .bind(network)
                .fetch_all(&mut *tx)
                .await?;
        if !nodes.iter().any(|n| n == node) {
            return Err(StoreError::NotFound {
                kind: "network node",
                name: format!("{network}/{node}"),
            });
        }
        let vms: Vec<String> = sqlx::query_scalar(
            "SELECT name FROM vms WHERE network = $1 AND (node = $2 OR migrate_to = $3) ORDER BY name",
        )
        .bind(network)
        .bind(node)
        .bind(node)
        .fetch_all(&mut *tx)
        .await?;
        if !vms.is_empty() {
            return Err(StoreError::Conflict(format!(
                "node {node:?} still hosts {} VM(s) of network {network:?} ({}); migrate them to another of its nodes or delete them first",
                vms.len(),
                shown(&vms)
            )));
        }
        if nodes.len() == 1 {
            return Err(StoreError::Conflict(format!(
                "node {node:?} is the last node of bridge network {network:?}; delete the network instead"
            )));
        }
        sqlx::query("DELETE FROM network_nodes WHERE network = $1 AND node = $2")
            .bind(network)
            .bind(node)
            .execute(&mut *tx)
            .await?;
        sync_first_node(&mut tx, network).await?;
        tx.commit().await?;
        self.network(network).await
    }

    pub async fn networks(&self) -> Result<Vec<Network>, StoreError> {
        let rows = sqlx::query(&format!("{} ORDER BY n.name", select(self.dialect)))
            .fetch_all(&self.read)
            .await?;
        rows.iter().map(network_from_row).collect()
    }

    pub async fn network(&self, name: &str) -> Result<Network, StoreError> {
        let row = sqlx::query(&format!("{} WHERE n.name = $1", select(self.dialect)))
            .bind(name)
            .fetch_optional(&self.read)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: "network",
                name: name.into(),
            })?;
        network_from_row(&row)
    }

    /// Deletes a network. Refused while any VM has a NIC on it.
    pub async fn delete_network(&self, name: &str) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let vms: Vec<String> = sqlx::query_scalar("SELECT name FROM vms WHERE network = $1 ORDER BY name")
            .bind(name)
            .fetch_all(&mut *tx)
            .await?;
        if !vms.is_empty() {
            return Err(StoreError::Conflict(format!(
                "network {name:?} is used by {} VM(s) ({}); delete them first",
                vms.len(),
                shown(&vms)
            )));
        }
        let res = sqlx::query("DELETE FROM networks WHERE name = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "network",
                name: name.into(),
            });
        }
        tx.commit().await?;
        Ok(())
    }
}

/// Up to five names, then "...".
fn shown(names: &[String]) -> String {
    let first: Vec<&str> = names.iter().take(5).map(String::as_str).collect();
    let more = if names.len() > 5 { ", ..." } else { "" };
    format!("{}{more}", first.join(", "))
}

/// Checks that `network` exists and is a bridge network (overlays have no
/// node list: nodes join them by hosting guests).
async fn bridge_kind(tx: &mut crate::Tx, network: &str) -> Result<(), StoreError> {
    let kind: Option<String> = sqlx::query_scalar("SELECT kind FROM networks WHERE name = $1")
        .bind(network)
        .fetch_optional(&mut **tx)
        .await?;
    match kind.as_deref() {
        None => Err(StoreError::NotFound {
            kind: "network",
            name: network.into(),
        }),
        Some("bridge") => Ok(()),
        Some(_) => Err(StoreError::Invalid(format!(
            "network {network:?} is an overlay: it spans nodes by itself (a node joins when it hosts one of its VMs)"
        ))),
    }
}

/// Keeps `networks.node` (which the schema's CHECK requires of a bridge)
/// naming the first of the network's nodes.
async fn sync_first_node(tx: &mut crate::Tx, network: &str) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE networks SET node = (SELECT MIN(node) FROM network_nodes WHERE network = $1) WHERE name = $2",
    )
    .bind(network)
    .bind(network)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// The lowest VNI not in `used` (sorted ascending).
fn lowest_free_vni(used: &[i64]) -> Result<u32, StoreError> {
    let mut candidate = i64::from(FIRST_VNI);
    for &v in used {
        if v < candidate {
            continue;
        }
        if v > candidate {
            break;
        }
        candidate += 1;
    }
    if candidate > i64::from(LAST_VNI) {
        return Err(StoreError::Conflict(
            "no free VXLAN network identifier left".into(),
        ));
    }
    Ok(candidate as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{on_both, TestStore};

    fn bridge(name: &str, subnet: &str, nodes: &[&str]) -> NewNetwork {
        NewNetwork {
            name: name.into(),
            id: format!("id{name}"),
            kind: NetworkType::Bridge,
            subnet: subnet.parse().unwrap(),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
        }
    }

    fn vm(name: &str, network: &str, node: Option<&str>) -> crate::NewVm {
        crate::NewVm {
            machine: None,
            name: name.into(),
            id: format!("id{name}"),
            network: network.into(),
            node: node.map(Into::into),
            labels: Default::default(),
            exec: None,
        }
    }

    fn mac(n: u8) -> impl FnMut() -> otherix_core::mac::MacAddr {
        move || otherix_core::mac::MacAddr::from_random([0, 0, 0, 0, n])
    }

    on_both! {
        async fn a_bridge_network_lists_its_nodes_and_gains_and_loses_them(store) {
            let now = OffsetDateTime::now_utc();
            let net = store
                .create_network(&bridge("lan", "10.101.0.0/24", &["n2", "n1", "n2"]), now)
                .await
                .unwrap();
            assert_eq!(net.nodes, ["n1", "n2"], "sorted, once each");
            assert_eq!(net.node.as_deref(), Some("n1"), "the first, for older clients");
            let net = store.add_network_node("lan", "n3").await.unwrap();
            assert_eq!(net.nodes, ["n1", "n2", "n3"]);
            let again = store.add_network_node("lan", "n3").await.unwrap();
            assert_eq!(again.nodes, net.nodes, "adding twice changes nothing");
            let net = store.remove_network_node("lan", "n1").await.unwrap();
            assert_eq!(
                (net.nodes.clone(), net.node),
                (vec!["n2".to_string(), "n3".to_string()], Some("n2".into()))
            );
            assert!(matches!(
                store.remove_network_node("lan", "n1").await,
                Err(StoreError::NotFound { .. })
            ));
        }
    }

    on_both! {
        async fn a_node_that_hosts_vms_of_the_network_or_its_last_node_stays(store) {
            let now = OffsetDateTime::now_utc();
            store
                .create_network(&bridge("lan", "10.101.0.0/24", &["n1", "n2"]), now)
                .await
                .unwrap();
            store
                .create_vm(&vm("a", "lan", Some("n1")), mac(1), now)
                .await
                .unwrap();
            let err = store
                .remove_network_node("lan", "n1")
                .await
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("still hosts 1 VM(s)") && err.contains("(a)"),
                "{err}"
            );
            store.remove_network_node("lan", "n2").await.unwrap();
            store.delete_vm("a").await.unwrap();
            let err = store
                .remove_network_node("lan", "n1")
                .await
                .unwrap_err()
                .to_string();
            assert!(err.contains("last node"), "{err}");
            store
                .create_network(
                    &NewNetwork {
                        kind: NetworkType::Overlay,
                        nodes: vec![],
                        ..bridge("ov", "10.102.0.0/24", &[])
                    },
                    now,
                )
                .await
                .unwrap();
            let err = store.add_network_node("ov", "n1").await.unwrap_err().to_string();
            assert!(err.contains("overlay"), "{err}");
        }
    }

    on_both! {
        async fn a_bridge_vm_goes_to_the_node_asked_for_or_the_only_one(store) {
            let now = OffsetDateTime::now_utc();
            store
                .create_network(&bridge("one", "10.101.0.0/24", &["n1"]), now)
                .await
                .unwrap();
            store
                .create_network(&bridge("two", "10.102.0.0/24", &["n1", "n2"]), now)
                .await
                .unwrap();
            let a = store.create_vm(&vm("a", "one", None), mac(1), now).await.unwrap();
            assert_eq!(a.node.as_deref(), Some("n1"));
            let b = store.create_vm(&vm("b", "two", None), mac(2), now).await.unwrap();
            assert_eq!(b.node, None, "the scheduler picks one of its nodes");
            let c = store
                .create_vm(&vm("c", "two", Some("n2")), mac(3), now)
                .await
                .unwrap();
            assert_eq!(c.node.as_deref(), Some("n2"));
            let err = store
                .create_vm(&vm("d", "two", Some("n3")), mac(4), now)
                .await
                .unwrap_err()
                .to_string();
            assert!(err.contains("n1, n2") && err.contains("not on \"n3\""), "{err}");
        }
    }

    on_both! {
        async fn deleting_a_node_frees_bridge_vms_whose_network_has_another_node(store) {
            let now = OffsetDateTime::now_utc();
            store
                .create_network(&bridge("one", "10.101.0.0/24", &["n1"]), now)
                .await
                .unwrap();
            store
                .create_network(&bridge("two", "10.102.0.0/24", &["n1", "n2"]), now)
                .await
                .unwrap();
            store.create_vm(&vm("a", "one", None), mac(1), now).await.unwrap();
            store
                .create_vm(&vm("b", "two", Some("n1")), mac(2), now)
                .await
                .unwrap();
            sqlx::query("INSERT INTO nodes (name, cert_fingerprint, created_at) VALUES ('n1', 'fp', 0)")
                .execute(&mut *store.write.conn().await.unwrap())
                .await
                .unwrap();
            store.delete_node("n1", true).await.unwrap();
            let a = store.vm("a").await.unwrap();
            let b = store.vm("b").await.unwrap();
            assert_eq!(a.node.as_deref(), Some("n1"), "its network has no other node");
            assert_eq!(b.node, None, "rescheduled among the network's other nodes");
        }
    }

    #[test]
    fn vni_fills_the_first_gap() {
        assert_eq!(lowest_free_vni(&[]).unwrap(), 100);
        assert_eq!(lowest_free_vni(&[100, 101, 103]).unwrap(), 102);
        assert_eq!(lowest_free_vni(&[5, 100]).unwrap(), 101);
    }
}
