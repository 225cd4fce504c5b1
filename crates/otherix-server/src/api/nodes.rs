//! Nodes: join tokens, enrollment, the mutual-TLS heartbeat that answers with
//! the node's desired state, and `node list/get/delete`.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;

use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use otherix_api::agent::{
    CreateJoinTokenRequest, DesiredState, EnrollRequest, EnrollResponse, GatewayCertRequest,
    GatewayCertResponse, Heartbeat, JoinToken, Node, NodeRoles, NodeStatus, MAX_SESSION_EVENTS,
};
use otherix_api::{ErrorBody, VmState};
use otherix_core::mac::MacAddr;
use otherix_core::names::validate_name;
use otherix_store::{HeartbeatRecord, NodeRecord};
use serde::Deserialize;
use time::{Duration, OffsetDateTime};

use super::{ApiError, ApiJson, ApiPath, ApiQuery, AppState};
use crate::auth::{new_token_with, random_bytes, secret_matches, split_token_with, Principal, JOIN_PREFIX};
use crate::desired::{self, Snapshot};
use crate::serve::PeerCert;

/// Join tokens live at most this long.
const MAX_JOIN_TTL: Duration = Duration::days(7);
const DEFAULT_JOIN_TTL: Duration = Duration::hours(1);

#[utoipa::path(post, path = "/v1/join-tokens", tag = "nodes", security(("bearer" = [])), request_body = CreateJoinTokenRequest,
    responses((status = 201, body = JoinToken), (status = 403, body = ErrorBody)))]
pub async fn create_join_token(
    State(state): State<AppState>,
    p: Principal,
    ApiJson(req): ApiJson<CreateJoinTokenRequest>,
) -> Result<(StatusCode, Json<JoinToken>), ApiError> {
    p.require_admin("create join tokens")?;
    let ttl = match req.ttl_seconds {
        None => DEFAULT_JOIN_TTL,
        Some(0) => return Err(ApiError::Invalid("ttl must be positive".into())),
        Some(s) => Duration::seconds(
            i64::try_from(s)
                .unwrap_or(i64::MAX)
                .min(MAX_JOIN_TTL.whole_seconds()),
        ),
    };
    let now = OffsetDateTime::now_utc();
    let t = new_token_with(JOIN_PREFIX);
    state
        .store
        .create_join_token(&t.id, &t.secret_hash, now, now + ttl)
        .await?;
    tracing::info!(token_id = %t.id, ttl_s = ttl.whole_seconds(), by = %p.name, "join token created");
    Ok((
        StatusCode::CREATED,
        Json(JoinToken {
            id: t.id,
            token: t.token,
            expires_at: now + ttl,
        }),
    ))
}

/// Enrollment: a join token buys one certificate for the node's own key.
#[utoipa::path(post, path = "/v1/agent/enroll", tag = "agent", request_body = EnrollRequest,
    responses((status = 200, body = EnrollResponse), (status = 401, body = ErrorBody)))]
pub async fn enroll(
    State(state): State<AppState>,
    ApiJson(req): ApiJson<EnrollRequest>,
) -> Result<Json<EnrollResponse>, ApiError> {
    validate_name(&req.node).map_err(|e| ApiError::Invalid(format!("invalid node name: {e}")))?;
    let invalid = || ApiError::Unauthenticated("invalid join token".into());
    let (id, secret) = split_token_with(JOIN_PREFIX, req.join_token.trim()).ok_or_else(invalid)?;
    let record = state.store.join_token(id).await?.ok_or_else(invalid)?;
    if !secret_matches(secret, &record.secret_hash) {
        return Err(invalid());
    }
    let now = OffsetDateTime::now_utc();
    if record.used_at.is_some() {
        return Err(ApiError::Unauthenticated(
            "join token already used; create a new one".into(),
        ));
    }
    if record.expires_at <= now {
        return Err(ApiError::Unauthenticated(
            "join token expired; create a new one".into(),
        ));
    }
    let cert_pem = state
        .ca
        .sign_node_csr(&req.csr_pem, &req.node)
        .map_err(|e| ApiError::Invalid(format!("{e:#}")))?;
    let der = otherix_api::tls::cert_from_pem(&cert_pem).map_err(ApiError::Internal)?;
    let fingerprint = otherix_api::tls::fingerprint(der.as_ref());
    if !state.store.enroll_node(id, &req.node, &fingerprint, now).await? {
        return Err(ApiError::Unauthenticated(
            "join token already used; create a new one".into(),
        ));
    }
    tracing::info!(node = %req.node, token_id = %id, "node enrolled");
    Ok(Json(EnrollResponse {
        node: req.node,
        cert_pem,
        ca_pem: state.ca.cert_pem().to_string(),
    }))
}

/// The heartbeat: records what the node reports and answers with its
/// desired state. Only over mutual TLS, as the node the certificate names.
#[utoipa::path(post, path = "/v1/agent/heartbeat", tag = "agent", request_body = Heartbeat,
    responses((status = 200, body = DesiredState), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody)))]
pub async fn heartbeat(
    State(state): State<AppState>,
    peer: Option<Extension<PeerCert>>,
    ApiJson(hb): ApiJson<Heartbeat>,
) -> Result<Json<DesiredState>, ApiError> {
    let node = agent_node(&state, peer).await?;
    if hb.node != node.name {
        return Err(ApiError::Forbidden(format!(
            "this certificate belongs to node {:?}, not {:?}",
            node.name, hb.node
        )));
    }
    hb.vtep
        .parse::<Ipv4Addr>()
        .map_err(|_| ApiError::Invalid(format!("invalid vtep {:?}: expected an IPv4 address", hb.vtep)))?;
    if let Some(relay) = &hb.roles.relay {
        relay
            .parse::<std::net::SocketAddr>()
            .map_err(|_| ApiError::Invalid(format!("invalid relay endpoint {relay:?}: expected IP:PORT")))?;
    }
    if let Some(gw) = &hb.roles.gateway {
        gw.parse::<std::net::SocketAddr>()
            .map_err(|_| ApiError::Invalid(format!("invalid gateway endpoint {gw:?}: expected IP:PORT")))?;
    }
    if !hb.session_events.is_empty() && hb.roles.gateway.is_none() {
        return Err(ApiError::Invalid(
            "session events from a node without the gateway role: only a gateway reports sessions".into(),
        ));
    }
    if hb.session_events.len() > MAX_SESSION_EVENTS {
        return Err(ApiError::Invalid(format!(
            "{} session events in one heartbeat; at most {MAX_SESSION_EVENTS}",
            hb.session_events.len()
        )));
    }
    let now = OffsetDateTime::now_utc();
    state
        .store
        .record_heartbeat(
            &node.name,
            &HeartbeatRecord {
                hypervisor: hb.roles.hypervisor,
                gateway: hb.roles.gateway.as_deref(),
                relay: hb.roles.relay.as_deref(),
                vtep: &hb.vtep,
                agent_version: &hb.version,
                applied_version: hb.applied_version,
                sessions: &hb.sessions,
                netns: hb.netns.as_deref(),
                ready_overlays: &hb.ready_overlays,
            },
            now,
        )
        .await?;
    if hb.session_epoch.is_some() || !hb.session_events.is_empty() {
        let ended = state
            .store
            .record_gateway_sessions(&node.name, hb.session_epoch.as_deref(), &hb.session_events, now)
            .await?;
        if ended > 0 {
            tracing::info!(node = %node.name, sessions = ended, "the gateway restarted; its earlier sessions are recorded as ended");
        }
    }

    let mut snap = snapshot(&state).await?;
    record_guest_states(&state, &snap, &node.name, &hb).await?;
    record_health(&state, &snap, &node.name, &hb).await?;
    if record_migrations(&state, &snap, &node.name, &hb, now).await? {
        snap = snapshot(&state).await?;
    }
    if schedule_pending(&state, &snap, now).await? {
        snap = snapshot(&state).await?;
    }
    let me = snap
        .nodes
        .iter()
        .find(|n| n.name == node.name)
        .cloned()
        .unwrap_or(node);
    let wanted = desired::memberships(&snap, &me);
    if state
        .store
        .set_node_leases(
            &me.name,
            &wanted,
            || MacAddr::from_random(random_bytes::<5>()),
            now,
        )
        .await?
    {
        snap = snapshot(&state).await?;
    }
    Ok(Json(desired::desired_state(&snap, &me.name, state.settings.mtu)))
}

/// A serving certificate for the node's gateway endpoint. The IP comes from
/// the node's own heartbeat, never from this request.
#[utoipa::path(post, path = "/v1/agent/gateway-cert", tag = "agent", request_body = GatewayCertRequest,
    responses((status = 200, body = GatewayCertResponse), (status = 401, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn gateway_cert(
    State(state): State<AppState>,
    peer: Option<Extension<PeerCert>>,
    ApiJson(req): ApiJson<GatewayCertRequest>,
) -> Result<Json<GatewayCertResponse>, ApiError> {
    let node = agent_node(&state, peer).await?;
    let addr: std::net::SocketAddr =
        node.gateway
            .as_deref()
            .and_then(|g| g.parse().ok())
            .ok_or_else(|| ApiError::Conflict {
                code: "not_a_gateway",
                message: format!(
                    "node {:?} has not reported a gateway endpoint; heartbeat with it first",
                    node.name
                ),
            })?;
    let cert_pem = state
        .ca
        .sign_gateway_csr(&req.csr_pem, &node.name, addr.ip())
        .map_err(|e| ApiError::Invalid(format!("{e:#}")))?;
    tracing::info!(node = %node.name, ip = %addr.ip(), "gateway certificate issued");
    Ok(Json(GatewayCertResponse {
        cert_pem,
        ca_pem: state.ca.cert_pem().to_string(),
    }))
}

/// The node a mutual-TLS request comes from.
pub(super) async fn agent_node(
    state: &AppState,
    peer: Option<Extension<PeerCert>>,
) -> Result<NodeRecord, ApiError> {
    let fingerprint = peer.and_then(|Extension(p)| p.0).ok_or_else(|| {
        ApiError::Unauthenticated("this call needs the node's client certificate (mutual TLS)".into())
    })?;
    state
        .store
        .node_by_fingerprint(&fingerprint)
        .await?
        .ok_or_else(|| ApiError::Unauthenticated("unknown node certificate; enroll the node again".into()))
}

/// Reads everything desired-state computation needs.
pub async fn snapshot(state: &AppState) -> Result<Snapshot, ApiError> {
    Ok(Snapshot {
        nodes: state.store.nodes().await?,
        networks: state.store.networks().await?,
        vms: state.store.vms().await?,
        node_leases: state.store.node_leases().await?,
        session_keys: state.keys.published(OffsetDateTime::now_utc()).await?,
        cluster_id: state.info.cluster_id.clone(),
        lbs: state.store.lbs().await?,
    })
}

/// Writes guest states the node reports, for VMs placed on it, when changed.
async fn record_guest_states(
    state: &AppState,
    snap: &Snapshot,
    node: &str,
    hb: &Heartbeat,
) -> Result<(), ApiError> {
    let mine: BTreeMap<&str, &otherix_api::Vm> = snap
        .vms
        .iter()
        .filter(|vm| vm.node.as_deref() == Some(node))
        .map(|vm| (vm.id.as_str(), vm))
        .collect();
    for g in &hb.guests {
        let Some(vm) = mine.get(g.vm_id.as_str()) else {
            continue;
        };
        // While a migration is under way the CP owns the state.
        if g.state == VmState::Migrating || vm.migrate_to.is_some() {
            continue;
        }
        if vm.state != g.state || vm.reason != g.reason {
            state
                .store
                .set_vm_state(&g.vm_id, g.state, g.reason.as_deref())
                .await?;
        }
    }
    Ok(())
}

/// Records the health verdicts a node reports for backends placed on it; a
/// verdict about a VM the node does not own (any more) is dropped.
async fn record_health(
    state: &AppState,
    snap: &Snapshot,
    node: &str,
    hb: &Heartbeat,
) -> Result<(), ApiError> {
    let verdicts: Vec<otherix_store::VerdictRecord> = hb
        .health
        .iter()
        .filter(|h| {
            snap.vms
                .iter()
                .any(|vm| vm.id == h.vm_id && vm.node.as_deref() == Some(node))
        })
        .map(|h| otherix_store::VerdictRecord {
            lb: h.lb.clone(),
            vm_id: h.vm_id.clone(),
            node: node.to_string(),
            health: match h.health.as_str() {
                "healthy" | "unhealthy" => h.health.clone(),
                _ => "unknown".into(),
            },
            probed_at: h.probed_at,
            changed_at: h.changed_at,
            reason: h.reason.as_ref().map(|r| r.chars().take(200).collect()),
            successes: h.successes,
            failures: h.failures,
        })
        .collect();
    state.store.record_verdicts(&verdicts).await?;
    Ok(())
}

/// Applies what a source node says about its migrations, and rolls back
/// migrations whose target stopped being Ready. Returns whether any changed.
async fn record_migrations(
    state: &AppState,
    snap: &Snapshot,
    node: &str,
    hb: &Heartbeat,
    now: OffsetDateTime,
) -> Result<bool, ApiError> {
    let mut changed = false;
    for m in &hb.migrations {
        let Some(vm) = snap
            .vms
            .iter()
            .find(|vm| vm.id == m.vm_id && vm.node.as_deref() == Some(node) && vm.migrate_to.is_some())
        else {
            continue;
        };
        let to = vm.migrate_to.clone().unwrap_or_default();
        if m.outcome == "moved" {
            changed |= state.store.complete_migration(&vm.id, node).await?;
            tracing::info!(vm = %vm.name, from = node, to = %to, "guest handed over");
        } else {
            let reason = format!(
                "migration to {to} rolled back: {}",
                m.reason.as_deref().unwrap_or("the source node failed")
            );
            changed |= state.store.roll_back_migration(&vm.id, &reason).await?;
            tracing::warn!(vm = %vm.name, %reason, "migration rolled back");
        }
    }
    for vm in snap.vms.iter().filter(|vm| vm.node.as_deref() == Some(node)) {
        let Some(to) = &vm.migrate_to else { continue };
        let ready = snap
            .nodes
            .iter()
            .any(|n| &n.name == to && desired::is_ready(n, now, state.settings.node_timeout));
        if !ready {
            let reason = format!("migration to {to} rolled back: {to} is NotReady");
            changed |= state.store.roll_back_migration(&vm.id, &reason).await?;
            tracing::warn!(vm = %vm.name, %reason, "migration rolled back");
        }
    }
    Ok(changed)
}

/// Places every unplaced VM on a Ready hypervisor that can host its network. Returns whether
/// it placed any.
pub async fn schedule_pending(
    state: &AppState,
    snap: &Snapshot,
    now: OffsetDateTime,
) -> Result<bool, ApiError> {
    let mut snap = snap.clone();
    let mut placed = false;
    let unplaced: Vec<String> = snap
        .vms
        .iter()
        .filter(|vm| vm.node.is_none())
        .map(|vm| vm.id.clone())
        .collect();
    for id in unplaced {
        let Some(vm) = snap.vms.iter().find(|vm| vm.id == id) else {
            continue;
        };
        // A bridge VM waits for one of its network's nodes: others may still fit.
        let Some(node) =
            desired::choose_node(&snap, vm, now, state.settings.node_timeout).map(|n| n.name.clone())
        else {
            continue;
        };
        if state.store.place_vm(&id, &node).await? {
            tracing::info!(vm_id = %id, node = %node, "vm scheduled");
            placed = true;
            if let Some(vm) = snap.vms.iter_mut().find(|vm| vm.id == id) {
                vm.node = Some(node);
            }
        }
    }
    Ok(placed)
}

fn to_api(n: &NodeRecord, snap: &Snapshot, now: OffsetDateTime, timeout: Duration) -> Node {
    Node {
        name: n.name.clone(),
        roles: NodeRoles {
            hypervisor: n.hypervisor,
            gateway: n.gateway.clone(),
            relay: n.relay.clone(),
        },
        status: if desired::is_ready(n, now, timeout) {
            NodeStatus::Ready
        } else {
            NodeStatus::NotReady
        },
        vtep: n.vtep.clone(),
        guests: snap
            .vms
            .iter()
            .filter(|vm| vm.node.as_deref() == Some(n.name.as_str()))
            .count() as u32,
        overlays: snap
            .node_leases
            .iter()
            .filter(|l| l.node == n.name)
            .map(|l| l.network.clone())
            .collect(),
        draining: desired::draining(snap, n).into_iter().collect(),
        agent_version: n.agent_version.clone(),
        last_heartbeat: n.last_heartbeat,
        created_at: n.created_at,
    }
}

#[utoipa::path(get, path = "/v1/nodes", tag = "nodes", security(("bearer" = [])),
    responses((status = 200, body = Vec<Node>)))]
pub async fn list(State(state): State<AppState>, _p: Principal) -> Result<Json<Vec<Node>>, ApiError> {
    let snap = snapshot(&state).await?;
    let now = OffsetDateTime::now_utc();
    Ok(Json(
        snap.nodes
            .iter()
            .map(|n| to_api(n, &snap, now, state.settings.node_timeout))
            .collect(),
    ))
}

#[utoipa::path(get, path = "/v1/nodes/{name}", tag = "nodes", security(("bearer" = [])),
    responses((status = 200, body = Node), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    _p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Node>, ApiError> {
    let snap = snapshot(&state).await?;
    let n = snap
        .nodes
        .iter()
        .find(|n| n.name == name)
        .ok_or_else(|| ApiError::NotFound(format!("node {name:?} not found")))?;
    Ok(Json(to_api(
        n,
        &snap,
        OffsetDateTime::now_utc(),
        state.settings.node_timeout,
    )))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    /// Delete even while it hosts guests (they are rescheduled).
    #[serde(default)]
    force: bool,
}

#[utoipa::path(delete, path = "/v1/nodes/{name}", tag = "nodes", security(("bearer" = [])), params(DeleteQuery),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("delete nodes")?;
    state.store.delete_node(&name, q.force).await?;
    tracing::info!(node = %name, force = q.force, by = %p.name, "node deleted");
    Ok(StatusCode::NO_CONTENT)
}
