//! Nodes, join tokens, and nodes' own leases on overlays.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use otherix_core::ipam::Subnet;
use otherix_core::mac::MacAddr;
use sqlx::any::AnyRow;
use sqlx::Row;
use time::OffsetDateTime;

use crate::{from_millis, to_millis, Store, StoreError};

/// What an admin granted a node: its roles and addresses. Set by a join
/// token and `node update`, never by the node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeGrant {
    pub hypervisor: bool,
    /// Gateway role at this advertised `IP:PORT`.
    pub gateway: Option<String>,
    /// The relay endpoint: `None` for the default (a hypervisor's VTEP,
    /// port 7444), `Some("off")`, or `Some("IP:PORT")`.
    pub relay: Option<String>,
    /// The VTEP, when not the address the node's connections come from.
    pub vtep: Option<String>,
}

/// A join token as stored: only the hash of its secret.
#[derive(Clone)]
pub struct JoinTokenRecord {
    pub id: String,
    pub secret_hash: Vec<u8>,
    pub expires_at: OffsetDateTime,
    pub used_at: Option<OffsetDateTime>,
    /// The node it enrolls (`None` for tokens made before tokens were bound:
    /// they enroll nothing).
    pub node: Option<String>,
    pub grant: NodeGrant,
    /// May enroll over an enrolled node of that name (revoking it).
    pub replace: bool,
    /// Used, and by whom: a node name, or [`SUPERSEDED`].
    pub used_by: Option<String>,
}

/// `used_by` of a token that was never used but can no longer be: its
/// node was enrolled, replaced or deleted after it was made.
pub const SUPERSEDED: &str = "(superseded)";

impl std::fmt::Debug for JoinTokenRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JoinTokenRecord")
            .field("id", &self.id)
            .field("node", &self.node)
            .field("grant", &self.grant)
            .field("replace", &self.replace)
            .field("expires_at", &self.expires_at)
            .field("used_at", &self.used_at)
            .finish_non_exhaustive()
    }
}

/// How an enrollment went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Enrolled {
    /// A new node.
    New,
    /// It replaced the enrolled node of that name, whose certificates are revoked.
    Replaced,
}

/// A node's last heartbeat as written (see [`Store::liveness_since`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Liveness {
    pub at: OffsetDateTime,
    pub agent_version: String,
    pub applied_version: Option<u64>,
    /// The last written heartbeat that vouched for the node's verdicts.
    pub vouched_at: Option<OffsetDateTime>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct NodeRecord {
    pub name: String,
    /// The node's newest client certificate.
    pub cert_fingerprint: String,
    /// Granted: hosts guests.
    pub hypervisor: bool,
    /// Granted: the gateway role at this `IP:PORT`.
    pub gateway: Option<String>,
    /// Granted relay endpoint: `None` default, `off`, or `IP:PORT` (see
    /// [`NodeRecord::relay_endpoint`]).
    pub relay: Option<String>,
    /// The VTEP in force: the admin's, else the address the node's last
    /// accepted heartbeat came from.
    pub vtep: Option<String>,
    /// The admin-set VTEP, if any.
    pub vtep_grant: Option<String>,
    /// Why the node's last heartbeat was refused; cleared by an accepted one.
    pub status_reason: Option<String>,
    /// Overlay → since when the gateway's membership is held only by its
    /// draining sessions.
    pub draining_since: std::collections::BTreeMap<String, OffsetDateTime>,
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

impl NodeRecord {
    /// A node that holds no grant and has reported nothing yet.
    pub fn new(name: &str, created_at: OffsetDateTime) -> NodeRecord {
        NodeRecord {
            name: name.to_string(),
            cert_fingerprint: String::new(),
            hypervisor: false,
            gateway: None,
            relay: None,
            vtep: None,
            vtep_grant: None,
            status_reason: None,
            draining_since: Default::default(),
            agent_version: None,
            applied_version: None,
            last_heartbeat: None,
            created_at,
            sessions: Default::default(),
            netns: None,
            ready_overlays: Default::default(),
        }
    }

    /// The address the CP dials for relay sessions: the granted one, or by
    /// default port 7444 on a hypervisor's VTEP.
    pub fn relay_endpoint(&self) -> Option<std::net::SocketAddr> {
        match self.relay.as_deref() {
            Some("off") => None,
            Some(addr) => addr.parse().ok(),
            None if self.hypervisor => {
                let ip: Ipv4Addr = self.vtep.as_deref()?.parse().ok()?;
                Some(std::net::SocketAddr::from((
                    ip,
                    otherix_core::node::RELAY_DEFAULT_PORT,
                )))
            }
            None => None,
        }
    }

    /// The grant, as set by a token and `node update`.
    pub fn grant(&self) -> NodeGrant {
        NodeGrant {
            hypervisor: self.hypervisor,
            gateway: self.gateway.clone(),
            relay: self.relay.clone(),
            vtep: self.vtep_grant.clone(),
        }
    }
}

/// What an accepted heartbeat says about its node (state, never identity
/// or roles): its row as the heartbeat leaves it
/// ([`Store::record_heartbeats`]).
#[derive(Debug, Clone)]
pub struct NodeBeat {
    /// The VTEP in force (checked by the caller).
    pub vtep: String,
    pub agent_version: String,
    pub applied_version: Option<u64>,
    pub sessions: std::collections::BTreeMap<String, u32>,
    pub netns: Option<String>,
    pub ready_overlays: Vec<String>,
    /// It lists only the verdicts that changed: the others stand as of it.
    pub vouches: bool,
    pub at: OffsetDateTime,
}

/// A node's own address on an overlay.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct NodeLease {
    pub network: String,
    pub node: String,
    pub ip: Ipv4Addr,
    pub mac: MacAddr,
}

fn node_from_row(r: &AnyRow) -> NodeRecord {
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
        vtep_grant: r.get("vtep_grant"),
        status_reason: r.get("status_reason"),
        draining_since: serde_json::from_str::<std::collections::BTreeMap<String, i64>>(
            &r.get::<String, _>("draining_since"),
        )
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k, from_millis(v)))
        .collect(),
    }
}

fn token_from_row(r: &AnyRow) -> JoinTokenRecord {
    JoinTokenRecord {
        id: r.get("id"),
        secret_hash: r.get("secret_hash"),
        expires_at: from_millis(r.get("expires_at")),
        used_at: r.get::<Option<i64>, _>("used_at").map(from_millis),
        node: r.get("node"),
        grant: NodeGrant {
            hypervisor: r.get::<i64, _>("hypervisor") != 0,
            gateway: r.get("gateway"),
            relay: r.get("relay"),
            vtep: r.get("vtep"),
        },
        replace: r.get::<i64, _>("replace") != 0,
        used_by: r.get("used_by"),
    }
}

/// Unused join tokens for `node` other than `except` can no longer be
/// used: a token minted before a name was enrolled, replaced or deleted
/// must not enroll it later.
async fn supersede_tokens(
    tx: &mut crate::Tx,
    node: &str,
    except: Option<&str>,
    now: OffsetDateTime,
) -> Result<(), StoreError> {
    sqlx::query(
        "UPDATE join_tokens SET used_at = $1, used_by = $2 WHERE node = $3 AND used_at IS NULL AND id IS DISTINCT FROM $4",
    )
    .bind(to_millis(now))
    .bind(SUPERSEDED)
    .bind(node)
    .bind(except)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl Store {
    #[allow(clippy::too_many_arguments)]
    pub async fn create_join_token(
        &self,
        id: &str,
        secret_hash: &[u8],
        node: &str,
        grant: &NodeGrant,
        replace: bool,
        now: OffsetDateTime,
        expires_at: OffsetDateTime,
    ) -> Result<(), StoreError> {
        self.exec(sqlx::query(
            "INSERT INTO join_tokens (id, secret_hash, created_at, expires_at, node, hypervisor, gateway, relay, vtep, replace)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
        )
        .bind(id)
        .bind(secret_hash)
        .bind(to_millis(now))
        .bind(to_millis(expires_at))
        .bind(node)
        .bind(grant.hypervisor as i64)
        .bind(grant.gateway.as_deref())
        .bind(grant.relay.as_deref())
        .bind(grant.vtep.as_deref())
        .bind(replace as i64)
        )
        .await?;
        Ok(())
    }

    pub async fn join_token(&self, id: &str) -> Result<Option<JoinTokenRecord>, StoreError> {
        let row = sqlx::query("SELECT * FROM join_tokens WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut *self.write.conn().await?)
            .await?;
        Ok(row.as_ref().map(token_from_row))
    }

    /// Consumes a join token and records the node it enrolls, with the
    /// token's grant and the new client certificate, atomically: of two
    /// concurrent enrollments with one token, exactly one wins. A node of
    /// that name already enrolled is a conflict unless the token replaces
    /// it; then its certificates are revoked (deleted) in the same
    /// transaction. `Ok(None)`: the token was already used.
    pub async fn enroll_node(
        &self,
        token: &JoinTokenRecord,
        node: &str,
        cert_fingerprint: &str,
        cert_not_after: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<Option<Enrolled>, StoreError> {
        let mut tx = self.begin_write().await?;
        let used = sqlx::query(
            "UPDATE join_tokens SET used_at = $1, used_by = $2 WHERE id = $3 AND used_at IS NULL",
        )
        .bind(to_millis(now))
        .bind(node)
        .bind(&token.id)
        .execute(&mut *tx)
        .await?;
        if used.rows_affected() == 0 {
            return Ok(None);
        }
        let exists: Option<String> = sqlx::query_scalar("SELECT name FROM nodes WHERE name = $1")
            .bind(node)
            .fetch_optional(&mut *tx)
            .await?;
        let g = &token.grant;
        let outcome = if exists.is_some() {
            if !token.replace {
                // Dropping the transaction rolls the token's use back.
                return Err(StoreError::Conflict(format!(
                    "node {node:?} is already enrolled; delete it first (otherix node delete {node}) \
                     or create a join token with --replace {node}"
                )));
            }
            sqlx::query("DELETE FROM node_certs WHERE node = $1")
                .bind(node)
                .execute(&mut *tx)
                .await?;
            sqlx::query(
                "UPDATE nodes SET cert_fingerprint = $1, hypervisor = $2, gateway = $3, relay = $4, vtep_grant = $5,
                     vtep = $6, status_reason = NULL, sessions = '{}', draining_since = '{}', last_heartbeat = NULL
                 WHERE name = $7",
            )
            .bind(cert_fingerprint)
            .bind(g.hypervisor as i64)
            .bind(g.gateway.as_deref())
            .bind(g.relay.as_deref())
            .bind(g.vtep.as_deref())
            .bind(g.vtep.as_deref())
            .bind(node)
            .execute(&mut *tx)
            .await?;
            Enrolled::Replaced
        } else {
            sqlx::query(
                "INSERT INTO nodes (name, cert_fingerprint, created_at, hypervisor, gateway, relay, vtep_grant, vtep)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
            )
            .bind(node)
            .bind(cert_fingerprint)
            .bind(to_millis(now))
            .bind(g.hypervisor as i64)
            .bind(g.gateway.as_deref())
            .bind(g.relay.as_deref())
            .bind(g.vtep.as_deref())
            .bind(g.vtep.as_deref())
            .execute(&mut *tx)
            .await?;
            Enrolled::New
        };
        insert_cert(&mut tx, node, cert_fingerprint, "node", cert_not_after, now).await?;
        supersede_tokens(&mut tx, node, Some(&token.id), now).await?;
        tx.commit().await?;
        Ok(Some(outcome))
    }

    /// Records a certificate issued to `node` for `purpose` (`node`,
    /// `gateway`, `relay`), and forgets the node's expired ones. For
    /// `node` it becomes the node's current client certificate.
    pub async fn add_node_cert(
        &self,
        node: &str,
        fingerprint: &str,
        purpose: &str,
        not_after: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let exists: Option<String> = sqlx::query_scalar("SELECT name FROM nodes WHERE name = $1")
            .bind(node)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Err(StoreError::NotFound {
                kind: "node",
                name: node.into(),
            });
        }
        sqlx::query("DELETE FROM node_certs WHERE node = $1 AND not_after < $2")
            .bind(node)
            .bind(to_millis(now))
            .execute(&mut *tx)
            .await?;
        insert_cert(&mut tx, node, fingerprint, purpose, not_after, now).await?;
        // The new one and the one it renews (still in use until the agent
        // switches); any older one is revoked, so asking again and again
        // does not pile up valid certificates.
        // Issue order: SQLite's rowid, PostgreSQL's `seq` column.
        let order = match self.dialect {
            crate::Dialect::Sqlite => "rowid",
            crate::Dialect::Postgres => "seq",
        };
        sqlx::query(&format!(
            "DELETE FROM node_certs WHERE node = $1 AND purpose = $2 AND {order} NOT IN
                 (SELECT {order} FROM node_certs WHERE node = $3 AND purpose = $4 ORDER BY {order} DESC LIMIT 2)",
        ))
        .bind(node)
        .bind(purpose)
        .bind(node)
        .bind(purpose)
        .execute(&mut *tx)
        .await?;
        if purpose == "node" {
            sqlx::query("UPDATE nodes SET cert_fingerprint = $1 WHERE name = $2")
                .bind(fingerprint)
                .bind(node)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Whether `fingerprint` is an unexpired, unrevoked certificate issued
    /// to `node` for `purpose`.
    pub async fn node_cert_valid(
        &self,
        node: &str,
        fingerprint: &str,
        purpose: &str,
        now: OffsetDateTime,
    ) -> Result<bool, StoreError> {
        let found: Option<i64> = sqlx::query_scalar(
            "SELECT 1 FROM node_certs WHERE fingerprint = $1 AND node = $2 AND purpose = $3 AND not_after >= $4",
        )
        .bind(fingerprint)
        .bind(node)
        .bind(purpose)
        .bind(to_millis(now))
        .fetch_optional(&self.read)
        .await?;
        Ok(found.is_some())
    }

    /// Changes what a node may be. Returns the node as it is now.
    pub async fn update_node_grant(&self, name: &str, grant: &NodeGrant) -> Result<NodeRecord, StoreError> {
        let res = self.exec(sqlx::query(
            "UPDATE nodes SET hypervisor = $1, gateway = $2, relay = $3, vtep_grant = $4,
                 vtep = COALESCE($5, CASE WHEN vtep_grant IS NULL THEN vtep ELSE NULL END), status_reason = NULL
             WHERE name = $6",
        )
        .bind(grant.hypervisor as i64)
        .bind(grant.gateway.as_deref())
        .bind(grant.relay.as_deref())
        .bind(grant.vtep.as_deref())
        .bind(grant.vtep.as_deref())
        .bind(name)
        )
        .await?;
        if res.rows_affected() == 0 {
            return Err(StoreError::NotFound {
                kind: "node",
                name: name.into(),
            });
        }
        let row = sqlx::query("SELECT * FROM nodes WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *self.write.conn().await?)
            .await?;
        Ok(node_from_row(&row))
    }

    /// Records since when each of the gateway's draining memberships has
    /// been held only by its sessions.
    pub async fn set_node_draining(
        &self,
        name: &str,
        since: &std::collections::BTreeMap<String, OffsetDateTime>,
    ) -> Result<(), StoreError> {
        let millis: std::collections::BTreeMap<&String, i64> =
            since.iter().map(|(k, v)| (k, to_millis(*v))).collect();
        self.exec(
            sqlx::query("UPDATE nodes SET draining_since = $1 WHERE name = $2")
                .bind(serde_json::to_string(&millis).unwrap_or_else(|_| "{}".into()))
                .bind(name),
        )
        .await?;
        Ok(())
    }

    /// Records why a node's heartbeat was refused (nothing else changes).
    pub async fn set_node_status_reason(&self, name: &str, reason: &str) -> Result<(), StoreError> {
        self.exec(
            sqlx::query(
                "UPDATE nodes SET status_reason = $1 WHERE name = $2 AND status_reason IS DISTINCT FROM $3",
            )
            .bind(reason)
            .bind(name)
            .bind(reason),
        )
        .await?;
        Ok(())
    }

    /// The node a client certificate of purpose `node` belongs to, if it
    /// is unexpired and not revoked.
    pub async fn node_by_client_cert(
        &self,
        fingerprint: &str,
        now: OffsetDateTime,
    ) -> Result<Option<NodeRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT n.* FROM node_certs c JOIN nodes n ON n.name = c.node
             WHERE c.fingerprint = $1 AND c.purpose = 'node' AND c.not_after >= $2",
        )
        .bind(fingerprint)
        .bind(to_millis(now))
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
        let row = sqlx::query("SELECT * FROM nodes WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.read)
            .await?
            .ok_or_else(|| StoreError::NotFound {
                kind: "node",
                name: name.into(),
            })?;
        Ok(node_from_row(&row))
    }

    /// What the heartbeats of nodes written after `since` said of them:
    /// when, the agent's version, the desired state it had applied, and
    /// when it last vouched for its verdicts. Every node writes its
    /// heartbeat every few seconds, so this is a bounded read of at most
    /// one row per node; control-plane replicas follow one another's
    /// heartbeats with it.
    pub async fn liveness_since(&self, since: OffsetDateTime) -> Result<Vec<(String, Liveness)>, StoreError> {
        let rows = sqlx::query(
            "SELECT name, last_heartbeat, agent_version, applied_version, vouched_at FROM nodes
             WHERE last_heartbeat > $1",
        )
        .bind(to_millis(since))
        .fetch_all(&self.read)
        .await?;
        Ok(rows
            .iter()
            .filter_map(|r| {
                Some((
                    r.get("name"),
                    Liveness {
                        at: from_millis(r.get::<Option<i64>, _>("last_heartbeat")?),
                        agent_version: r.get::<Option<String>, _>("agent_version").unwrap_or_default(),
                        applied_version: r.get::<Option<i64>, _>("applied_version").map(|v| v as u64),
                        vouched_at: r.get::<Option<i64>, _>("vouched_at").map(from_millis),
                    },
                ))
            })
            .collect())
    }

    /// Deletes a node. Refused while VMs are placed on it unless `force`,
    /// which returns those VMs to `pending` so they are scheduled elsewhere.
    pub async fn delete_node(&self, name: &str, force: bool) -> Result<(), StoreError> {
        let mut tx = self.begin_write().await?;
        let vms: Vec<String> = sqlx::query_scalar("SELECT name FROM vms WHERE node = $1 ORDER BY name")
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
        let res = sqlx::query("DELETE FROM nodes WHERE name = $1")
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
                     AND NOT EXISTS (SELECT 1 FROM network_nodes m WHERE m.network = vms.network AND m.node != $1)
                 THEN node ELSE NULL END,
                 state = 'pending', reason = $2 WHERE node = $3",
        )
        .bind(name)
        .bind(format!("node {name} was deleted"))
        .bind(name)
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM leases WHERE owner_kind = 'node' AND owner = $1")
            .bind(name)
            .execute(&mut *tx)
            .await?;
        supersede_tokens(&mut tx, name, None, OffsetDateTime::now_utc()).await?;
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
        let res = self
            .exec(
                sqlx::query("UPDATE vms SET node = $1, reason = NULL WHERE id = $2 AND node IS NULL")
                    .bind(node)
                    .bind(vm_id),
            )
            .await?;
        Ok(res.rows_affected() == 1)
    }

    /// Places several pending VMs in one transaction: one answer per
    /// `(vm id, node)`, false where the VM was placed or deleted meanwhile.
    pub async fn place_vms(&self, placements: &[(String, String)]) -> Result<Vec<bool>, StoreError> {
        let mut tx = self.begin_write().await?;
        let mut placed = Vec::with_capacity(placements.len());
        for (vm_id, node) in placements {
            let res = sqlx::query("UPDATE vms SET node = $1, reason = NULL WHERE id = $2 AND node IS NULL")
                .bind(node)
                .bind(vm_id)
                .execute(&mut *tx)
                .await?;
            placed.push(res.rows_affected() == 1);
        }
        tx.commit().await?;
        Ok(placed)
    }

    /// Every node's overlay leases.
    pub async fn node_leases(&self) -> Result<Vec<NodeLease>, StoreError> {
        let rows = sqlx::query(
            "SELECT network, owner, ip, mac FROM leases WHERE owner_kind = 'node' ORDER BY network, owner",
        )
        .fetch_all(&self.read)
        .await?;
        rows.iter().map(crate::changes::node_lease_from_row).collect()
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
        let mut tx = self.begin_write().await?;
        let have: BTreeSet<String> = sqlx::query_scalar(NODE_NETWORKS)
            .bind(node)
            .fetch_all(&mut *tx)
            .await?
            .into_iter()
            .collect();
        if &have == networks {
            return Ok(false);
        }
        for gone in have.difference(networks) {
            sqlx::query("DELETE FROM leases WHERE owner_kind = 'node' AND owner = $1 AND network = $2")
                .bind(node)
                .bind(gone)
                .execute(&mut *tx)
                .await?;
        }
        for net in networks.difference(&have) {
            let subnet: Option<String> = sqlx::query_scalar("SELECT subnet FROM networks WHERE name = $1")
                .bind(net)
                .fetch_optional(&mut *tx)
                .await?;
            let Some(subnet) = subnet else { continue };
            let subnet: Subnet = subnet
                .parse()
                .map_err(|e| StoreError::Corrupt(format!("network subnet: {e}")))?;
            let ip = crate::vms::free_address(&mut tx, net, &subnet).await?;
            // The MAC is checked before the insert, not retried after a
            // violation: PostgreSQL aborts a transaction at its first error.
            let mac = crate::vms::unique_mac(&mut tx, &mut random_mac).await?;
            sqlx::query(
                "INSERT INTO leases (network, ip, mac, owner_kind, owner, created_at) VALUES ($1, $2, $3, 'node', $4, $5)",
            )
            .bind(net)
            .bind(i64::from(u32::from(ip)))
            .bind(mac.to_string())
            .bind(node)
            .bind(to_millis(now))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }
}

/// The networks a node holds leases in: from `leases_owner` alone (it
/// holds the network; see migration 26).
const NODE_NETWORKS: &str = "SELECT network FROM leases WHERE owner_kind = 'node' AND owner = $1";

async fn insert_cert(
    tx: &mut crate::Tx,
    node: &str,
    fingerprint: &str,
    purpose: &str,
    not_after: OffsetDateTime,
    now: OffsetDateTime,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO node_certs (fingerprint, node, purpose, not_after, created_at) VALUES ($1, $2, $3, $4, $5)
         ON CONFLICT(fingerprint) DO NOTHING",
    )
    .bind(fingerprint)
    .bind(node)
    .bind(purpose)
    .bind(to_millis(not_after))
    .bind(to_millis(now))
    .execute(&mut **tx)
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_nodes_networks_are_read_from_the_owner_index_alone() {
        let store = Store::open_in_memory().await.unwrap();
        let sql = format!("EXPLAIN QUERY PLAN {NODE_NETWORKS}");
        let text = crate::testing::query_plan(&store, sqlx::query(&sql).bind("hv-1")).await;
        assert!(text.contains("USING COVERING INDEX leases_owner"), "{text}");
    }
}
