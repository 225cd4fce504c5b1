//! Networks: subnets the CP owns, overlay VNIs allocated here.

use otherix_api::{Network, NetworkType};
use otherix_core::ipam::Subnet;
use sqlx::sqlite::SqliteRow;
use sqlx::Row;
use time::OffsetDateTime;

use crate::error::is_unique_violation;
use crate::{from_millis, to_millis, Store, StoreError};

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
    /// The node a bridge network lives on.
    pub node: Option<String>,
}

const SELECT: &str = "SELECT n.name, n.id, n.kind, n.subnet, n.vni, n.node, n.created_at,
        (SELECT COUNT(*) FROM vms v WHERE v.network = n.name) AS vm_count
    FROM networks n";

fn network_from_row(r: &SqliteRow) -> Result<Network, StoreError> {
    let subnet: String = r.get("subnet");
    let parsed: Subnet = subnet
        .parse()
        .map_err(|e| StoreError::Corrupt(format!("network subnet {subnet:?}: {e}")))?;
    Ok(Network {
        name: r.get("name"),
        id: r.get("id"),
        kind: r.get::<String, _>("kind").parse().map_err(StoreError::Corrupt)?,
        subnet,
        vni: r.get::<Option<i64>, _>("vni").map(|v| v as u32),
        node: r.get("node"),
        node_address: parsed.node_address().to_string(),
        vms: r.get::<i64, _>("vm_count") as u32,
        created_at: from_millis(r.get("created_at")),
    })
}

impl Store {
    /// Creates a network. Refuses a subnet that overlaps another network's:
    /// gateways join every overlay, and overlapping subnets on one node would
    /// make their routes ambiguous.
    pub async fn create_network(&self, new: &NewNetwork, now: OffsetDateTime) -> Result<Network, StoreError> {
        let mut tx = self.write.begin().await?;
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
            "INSERT INTO networks (name, id, kind, subnet, vni, node, created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&new.name)
        .bind(&new.id)
        .bind(new.kind.as_str())
        .bind(new.subnet.to_string())
        .bind(vni.map(i64::from))
        .bind(&new.node)
        .bind(to_millis(now))
        .execute(&mut *tx)
        .await;
        match res {
            Err(e) if is_unique_violation(&e) => {
                return Err(StoreError::AlreadyExists {
                    kind: "network",
                    name: new.name.clone(),
                })
            }
            other => other?,
        };
        tx.commit().await?;
        self.network(&new.name).await
    }

    pub async fn networks(&self) -> Result<Vec<Network>, StoreError> {
        let rows = sqlx::query(&format!("{SELECT} ORDER BY n.name"))
            .fetch_all(&self.read)
            .await?;
        rows.iter().map(network_from_row).collect()
    }

    pub async fn network(&self, name: &str) -> Result<Network, StoreError> {
        let row = sqlx::query(&format!("{SELECT} WHERE n.name = ?"))
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
        let mut tx = self.write.begin().await?;
        let vms: Vec<String> = sqlx::query_scalar("SELECT name FROM vms WHERE network = ? ORDER BY name")
            .bind(name)
            .fetch_all(&mut *tx)
            .await?;
        if !vms.is_empty() {
            let shown: Vec<&str> = vms.iter().take(5).map(String::as_str).collect();
            let more = if vms.len() > 5 { ", ..." } else { "" };
            return Err(StoreError::Conflict(format!(
                "network {name:?} is used by {} VM(s) ({}{more}); delete them first",
                vms.len(),
                shown.join(", ")
            )));
        }
        let res = sqlx::query("DELETE FROM networks WHERE name = ?")
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

    #[test]
    fn vni_fills_the_first_gap() {
        assert_eq!(lowest_free_vni(&[]).unwrap(), 100);
        assert_eq!(lowest_free_vni(&[100, 101, 103]).unwrap(), 102);
        assert_eq!(lowest_free_vni(&[5, 100]).unwrap(), 101);
    }
}
