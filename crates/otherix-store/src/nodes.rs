//! Nodes, join tokens, and nodes' own leases on overlays.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use otherix_core::ipam::{allocate, Subnet};
use otherix_core::mac::MacAddr;
use sqlx::sqlite::SqliteRow;
use sqlx::Row;
use time::OffsetDateTime;

use crate::error::is_unique_violation;
use crate::{from_millis, to_millis, Store, StoreError};

/// A join token as stored: only the hash of its secret.
#[derive(Clone)]
pub struct JoinTokenRecord {
    pub id: String,
    pub secret_hash: Vec<u8>,
    pub expires_at: OffsetDateTime,
    pub used_at: Option<OffsetDateTime>,
}

impl std::fmt::Debug for JoinTokenRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinTokenRecord")
            .field("id", &self.id)
            .field("expires_at", &self.expires_at)
            .field("used_at", &self.used_at)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct NodeRecord {
    pub name: String,
    pub cert_fingerprint: String,
    pub hypervisor: bool,
    pub gateway: Option<String>,
    pub relay: Option<String>,
    pub vtep: Option<String>,
    pub agent_version: Option<String>,
    pub applied_version: Option<u64>,
    pub last_heartbeat: Option<OffsetDateTime>,
    pub created_at: OffsetDateTime,
    /// Open gateway sessions per overlay network, as last reported.
    pub sessions: std::collections::BTreeMap<String, u32>,
    /// The node's own network namespace name, when it runs in a named one.
    pub netns: Option<String>,
    /// Overlays the node reports as realized.
    pub ready_overlays: std::collections::BTreeSet<String>,
}

/// What a heartbeat says about its node.
#[derive(Debug, Clone)]
pub struct HeartbeatRecord<'a> {
    pub hypervisor: bool,
    pub gateway: Option<&'a str>,
    pub relay: Option<&'a str>,
    pub vtep: &'a str,
    pub agent_version: &'a str,
    pub applied_version: Option<u64>,
    pub sessions: &'a std::collections::BTreeMap<String, u32>,
    pub netns: Option<&'a str>,
    pub ready_overlays: &'a [String],
}

/// A node's own address on an overlay.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeLease {
    pub network: String,
    pub node: String,
    pub ip: Ipv4Addr,
    pub mac: String,
}

fn node_from_row(r: &SqliteRow) -> NodeRecord {
    NodeRecord {
        name: r.get("name"),
        cert_fingerprint: r.get("cert_fingerprint"),
        hypervisor: r.get::<i64, _>("hypervisor") != 0,
        gateway: r.get("gateway"),
        relay: r.get("relay"),
        vtep: r.get("vtep"),
        agent_version: r.get("agent_version"),
        applied_version: r.get::<Option<i64>, _>("applied_version").map(|v| v as u64),
        last_heartbeat: r.get::<Option<i64>, _>("last_heartbeat").map(from_millis),
        created_at: from_millis(r.get("created_at")),
        // Bookkeeping written by us; unreadable means "none reported".
        sessions: serde_json::from_str(&r.get::<String, _>("sessions")).unwrap_or_default(),
        netns: r.get("netns"),
        ready_overlays: serde_json::from_str(&r.get::<String, _>("ready_overlays")).unwrap_or_default(),
    }
}

impl Store {
    pub async fn create_join_token(
        &self,
        id: &str,
        secret_hash: &[u8],
        now: OffsetDateTime,
        expires_at: OffsetDateTime,
    ) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO join_tokens (id, secret_hash, created_at, expires_at) VALUES (?, ?, ?, ?)")
            .bind(id)
            .bind(secret_hash)
            .bind(to_millis(now))
            .bind(to_millis(expires_at))
            .execute(&self.write)
            .await?;
        Ok(())
    }

    pub async fn join_token(&self, id: &str) -> Result<Option<JoinTokenRecord>, StoreError> {
        let row = sqlx::query("SELECT id, secret_hash, expires_at, used_at FROM join_tokens WHERE id = ?")
            .bind(id)
            .fetch_optional(&self.write)
            .await?;
        Ok(row.map(|r| JoinTokenRecord {
            id: r.get("id"),
            secret_hash: r.get("secret_hash"),
            expires_at: from_millis(r.get("expires_at")),
            used_at: r.get::<Option<i64>, _>("used_at").map(from_millis),
        }))
    }

    /// Consumes a join token and records the node's identity, atomically:
    /// of two concurrent enrollments with one token, exactly one wins.
    /// Returns false if the token was already used.
    pub async fn enroll_node(
        &self,
        token_id: &str,
        node: &str,
        cert_fingerprint: &str,
        now: OffsetDateTime,
    ) -> Result<bool, StoreError> {
        let mut tx = self.write.begin().await?;
        let used =
            sqlx::query("UPDATE join_tokens SET used_at = ?, used_by = ? WHERE id = ? AND used_at IS NULL")
                .bind(to_millis(now))
                .bind(node)
                .bind(token_id)
                .execute(&mut *tx)
                .await?;
        if used.rows_affected() == 0 {
            return Ok(false);
        }
        sqlx::query(
            "INSERT INTO nodes (name, cert_fingerprint, created_at) VALUES (?, ?, ?)
             ON CONFLICT(name) DO UPDATE SET cert_fingerprint = excluded.cert_fingerprint",
        )
        .bind(node)
        .bind(cert_fingerprint)
        .bind(to_millis(now))
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub async fn node_by_fingerprint(&self, fingerprint: &str) -> Result<Option<NodeRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM nodes WHERE cert_fingerprint = ?")
            .bind(fingerprint)
            .fetch_optional(&self.read)
            .await?;
        Ok(row.as_ref().map(node_from_row))
    }

    pub async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let rows = sqlx::query("SELECT * FROM nodes ORDER BY name")
            .fetch_all(&self.read)
            .await?;
        Ok(rows.iter().map(node_from_row).collect())
    }

    pub async fn node(&self, name: &str) -> Result<NodeRecord, StoreError> {
        let row = sqlx::query("SELECT * FROM nodes WHERE name = ?")
            .bind(name)
            .fetch_optional(&self.read)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: "node",
                name: name.into(),
            })?;
        Ok(node_from_row(&row))
    }

    pub async fn record_heartbeat(
        &self,
        node: &str,
        hb: &HeartbeatRecord<'_>,
        now: OffsetDateTime,
    ) -> Result<(), StoreError> {
        sqlx::query(
            "UPDATE nodes SET hypervisor = ?, gateway = ?, relay = ?, vtep = ?, agent_version = ?,
                 applied_version = ?, last_heartbeat = ?, sessions = ?, netns = ?, ready_overlays = ?
             WHERE name = ?",
        )
        .bind(hb.hypervisor as i64)
        .bind(hb.gateway)
        .bind(hb.relay)
        .bind(hb.vtep)
        .bind(hb.agent_version)
        .bind(hb.applied_version.map(|v| v as i64))
        .bind(to_millis(now))
        .bind(serde_json::to_string(hb.sessions).unwrap_or_else(|_| "{}".into()))
        .bind(hb.netns)
        .bind(serde_json::to_string(hb.ready_overlays).unwrap_or_else(|_| "[]".into()))
        .bind(node)
        .execute(&self.write)
        .await?;
        Ok(())
    }

    /// Deletes a node. Refused while VMs are placed on it unless `force`,
    /// which returns those VMs to `pending` so they are scheduled elsewhere.
    pub async fn delete_node(&self, name: &str, force: bool) -> Result<(), StoreError> {
        let mut tx = self.write.begin().await?;
        let vms: Vec<String> = sqlx::query_scalar("SELECT name FROM vms WHERE node = ? ORDER BY name")
            .bind(name)
            .fetch_all(&mut *tx)
            .await?;
        if !vms.is_empty() && !force {
            return Err(StoreError::Conflict(format!(
                "node {name:?} hosts {} guest(s) ({}); use --force to delete it and reschedule them",
                vms.len(),
                vms.iter().take(5).cloned().collect::<Vec<_>>().join(", ")
            )));
        }
        let res = sqlx::query("DELETE FROM nodes WHERE name = ?")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "node",
                name: name.into(),
            });
        }
        // Overlay VMs move on, and bridge VMs whose network has another
        // node (the scheduler picks among those); a bridge VM whose network
        // has no other node stays bound to it.
        sqlx::query(
            "UPDATE vms SET node = CASE WHEN (SELECT kind FROM networks n WHERE n.name = vms.network) = 'bridge'
                     AND NOT EXISTS (SELECT 1 FROM network_nodes m WHERE m.network = vms.network AND m.node != ?)
                 THEN node ELSE NULL END,
                 state = 'pending', reason = ? WHERE node = ?",
        )
        .bind(name)
        .bind(format!("node {name} was deleted"))
        .bind(name)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM leases WHERE owner_kind = 'node' AND owner = ?")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        crate::sessions::close(
            &mut tx,
            crate::Carrier::Node(name),
            "node deleted",
            OffsetDateTime::now_utc(),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Places a pending VM on a node (only if it is still unplaced).
    pub async fn place_vm(&self, vm_id: &str, node: &str) -> Result<bool, StoreError> {
        let res = sqlx::query("UPDATE vms SET node = ?, reason = NULL WHERE id = ? AND node IS NULL")
            .bind(node)
            .bind(vm_id)
            .execute(&self.write)
            .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Every node's overlay leases.
    pub async fn node_leases(&self) -> Result<Vec<NodeLease>, StoreError> {
        let rows = sqlx::query(
            "SELECT network, owner, ip, mac FROM leases WHERE owner_kind = 'node' ORDER BY network, owner",
        )
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .map(|r| NodeLease {
                network: r.get("network"),
                node: r.get("owner"),
                ip: Ipv4Addr::from(r.get::<i64, _>("ip") as u32),
                mac: r.get("mac"),
            })
            .collect())
    }

    /// Makes `node`'s overlay leases exactly `networks`: allocates missing
    /// ones, frees the rest. Returns whether anything changed.
    pub async fn set_node_leases(
        &self,
        node: &str,
        networks: &BTreeSet<String>,
        mut random_mac: impl FnMut() -> MacAddr,
        now: OffsetDateTime,
    ) -> Result<bool, StoreError> {
        let mut tx = self.write.begin().await?;
        let have: BTreeSet<String> =
            sqlx::query_scalar("SELECT network FROM leases WHERE owner_kind = 'node' AND owner = ?")
                .bind(node)
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .collect();
        if &have == networks {
            return Ok(false);
        }
        for gone in have.difference(networks) {
            sqlx::query("DELETE FROM leases WHERE owner_kind = 'node' AND owner = ? AND network = ?")
                .bind(node)
                .bind(gone)
                .execute(&mut *tx)
                .await?;
        }
        for net in networks.difference(&have) {
            let subnet: Option<String> = sqlx::query_scalar("SELECT subnet FROM networks WHERE name = ?")
                .bind(net)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(subnet) = subnet else { continue };
            let subnet: Subnet = subnet
                .parse()
                .map_err(|e| StoreError::Corrupt(format!("network subnet: {e}")))?;
            let used: BTreeSet<Ipv4Addr> =
                sqlx::query_scalar::<_, i64>("SELECT ip FROM leases WHERE network = ?")
                    .bind(net)
                    .fetch_all(&mut *tx)
                    .await?
                    .into_iter()
                    .map(|ip| Ipv4Addr::from(ip as u32))
                    .collect();
            let ip = allocate(&subnet, &used)?;
            let mut inserted = false;
            for _ in 0..16 {
                let res = sqlx::query(
                    "INSERT INTO leases (network, ip, mac, owner_kind, owner, created_at) VALUES (?, ?, ?, 'node', ?, ?)",
                )
                .bind(net)
                .bind(i64::from(u32::from(ip)))
                .bind(random_mac().to_string())
                .bind(node)
                .bind(to_millis(now))
                .execute(&mut *tx)
                .await;
                match res {
                    Ok(_) => {
                        inserted = true;
                        break;
                    }
                    // Only the MAC can collide here: the IP was free in this transaction.
                    Err(e) if is_unique_violation(&e) => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            if !inserted {
                return Err(StoreError::Conflict(
                    "could not draw an unused MAC address".into(),
                ));
            }
        }
        tx.commit().await?;
        Ok(true)
    }
}
