//! Nodes: join tokens, enrollment, the mutual-TLS heartbeat that answers with
//! the node's desired state, and `node list/get/delete`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use otherix_core::credential::{verify_issued, Claims, CLOCK_SKEW};
use otherix_core::node::{
    check_claims, effective_vtep, parse_endpoint, parse_relay, parse_vtep, validate_node_name, Mismatch,
    Roles,
};
use otherix_proto::agent::{
    CertPurpose, CertificateRequest, CertificateResponse, CreateJoinTokenRequest, DesiredState,
    EnrollRequest, EnrollResponse, Heartbeat, JoinToken, Node, NodeRoles, NodeStatus, SessionEvent,
    UpdateNodeRequest, MAX_SESSION_BYTES, MAX_SESSION_EVENTS,
};
use otherix_proto::{AuditAction, ErrorBody, VmState};
use otherix_store::{
    AuditEvent, BytesFrom, Enrolled, HeartbeatWrites, NodeBeat, NodeGrant, NodeRecord, VmStateWrite,
};
use serde::Deserialize;
use time::{Duration, OffsetDateTime};

use super::{ApiJson, ApiPath, ApiQuery, Body};
use crate::auth::Principal;
use crate::catalog::{Answer, Model};
use crate::desired;
use crate::error::ApiError;
use crate::migration::{self, Step};
use crate::random;
use crate::schedule;
use crate::serve::PeerCert;
use crate::state::AppState;
use crate::tokens::{new_token_with, secret_matches, split_token_with, JOIN_PREFIX};

/// Join tokens live at most this long.
const MAX_JOIN_TTL: Duration = Duration::days(7);
const DEFAULT_JOIN_TTL: Duration = Duration::hours(1);

use desired::granted_roles as roles_of;

/// Checks a grant's addresses; returns it with the relay in stored form.
fn grant_from(
    hypervisor: bool,
    gateway: Option<&str>,
    relay: Option<&str>,
    vtep: Option<&str>,
) -> Result<NodeGrant, ApiError> {
    let invalid = |e: otherix_core::node::AddressError| ApiError::Invalid(e.to_string());
    Ok(NodeGrant {
        hypervisor,
        gateway: gateway
            .map(|g| parse_endpoint("gateway endpoint", g).map(|a| a.to_string()))
            .transpose()
            .map_err(invalid)?,
        relay: match relay {
            None => None,
            Some(r) => parse_relay("relay endpoint", r).map_err(invalid)?,
        },
        vtep: vtep
            .map(|v| parse_vtep("vtep", v).map(|ip| ip.to_string()))
            .transpose()
            .map_err(invalid)?,
    })
}

/// Records a change to what nodes are; an audit failure is logged, never
/// a refused change (the change is already committed).
async fn audit(state: &AppState, principal: String, action: AuditAction, node: &str, detail: String) {
    let event = AuditEvent {
        id: 0,
        at: OffsetDateTime::now_utc(),
        principal,
        action,
        target: Some(node.to_string()),
        port: None,
        transport: None,
        node: Some(node.to_string()),
        allowed: true,
        reason: Some(detail),
        bytes_up: None,
        bytes_down: None,
        duration_ms: None,
        session: None,
    };
    if let Err(e) = state.audit.write(event).await {
        tracing::error!(error = %e, %action, node, "audit write failed");
    }
}

fn describe_grant(g: &NodeGrant) -> String {
    let mut parts = vec![if g.hypervisor {
        "hypervisor"
    } else {
        "no hypervisor"
    }
    .to_string()];
    parts.push(match &g.gateway {
        Some(a) => format!("gateway {a}"),
        None => "no gateway".into(),
    });
    parts.push(match g.relay.as_deref() {
        None => "relay default".into(),
        Some(r) => format!("relay {r}"),
    });
    if let Some(v) = &g.vtep {
        parts.push(format!("vtep {v}"));
    }
    parts.join(", ")
}

#[utoipa::path(post, path = "/v1/join-tokens", operation_id = "createJoinToken", tag = "nodes", security(("bearer" = [])), request_body = CreateJoinTokenRequest,
    responses((status = 201, body = JoinToken), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create_join_token(
    State(state): State<AppState>,
    p: Principal,
    body: Body<CreateJoinTokenRequest>,
) -> Result<(StatusCode, Json<JoinToken>), ApiError> {
    p.require_admin("create join tokens")?;
    let req = body.read()?;
    validate_node_name(&req.node).map_err(|e| ApiError::Invalid(e.to_string()))?;
    let grant = grant_from(
        req.hypervisor,
        req.gateway.as_deref(),
        req.relay.as_deref(),
        req.vtep.as_deref(),
    )?;
    let ttl = match req.ttl_seconds {
        None => DEFAULT_JOIN_TTL,
        Some(0) => return Err(ApiError::Invalid("ttl must be positive".into())),
        Some(s) => Duration::seconds(
            i64::try_from(s)
                .unwrap_or(i64::MAX)
                .min(MAX_JOIN_TTL.whole_seconds()),
        ),
    };
    // Said now rather than at enrollment; the enrollment checks it again.
    let exists = match state.store.node(&req.node).await {
        Ok(_) => true,
        Err(otherix_store::StoreError::NotFound { .. }) => false,
        Err(e) => return Err(e.into()),
    };
    if exists && !req.replace {
        return Err(ApiError::Conflict {
            code: "node_exists",
            message: format!(
                "node {:?} is already enrolled; delete it first (otherix node delete {}) or replace it (--replace)",
                req.node, req.node
            ),
        });
    }
    if !exists && req.replace {
        return Err(ApiError::NotFound(format!(
            "node {:?} is not enrolled, so there is nothing to replace; create the token without --replace",
            req.node
        )));
    }
    let now = OffsetDateTime::now_utc();
    let t = new_token_with(JOIN_PREFIX);
    state
        .store
        .create_join_token(
            &t.id,
            &t.secret_hash,
            &req.node,
            &grant,
            req.replace,
            now,
            now + ttl,
        )
        .await?;
    tracing::info!(token_id = %t.id, node = %req.node, replace = req.replace, ttl_s = ttl.whole_seconds(), by = %p.name, "join token created");
    audit(
        &state,
        p.id(),
        AuditAction::NodeJoinToken,
        &req.node,
        format!(
            "{}token {} for {}, valid {}s",
            if req.replace { "replacement " } else { "" },
            t.id,
            describe_grant(&grant),
            ttl.whole_seconds()
        ),
    )
    .await;
    let roles = NodeRoles {
        hypervisor: grant.hypervisor,
        gateway: grant.gateway.clone(),
        relay: grant.relay.clone(),
    };
    Ok((
        StatusCode::CREATED,
        Json(JoinToken {
            id: t.id,
            token: t.token,
            node: req.node.into_string(),
            roles,
            replace: req.replace,
            expires_at: now + ttl,
        }),
    ))
}

/// The shape of a PEM certificate request, without parsing it: the
/// enrollment's cheap check before it reads the store.
fn looks_like_csr(pem: &str) -> bool {
    let pem = pem.trim();
    pem.starts_with("-----BEGIN CERTIFICATE REQUEST-----")
        && pem.ends_with("-----END CERTIFICATE REQUEST-----")
        && pem.matches("-----BEGIN").count() == 1
}

/// Counts an enrollment refusal by its reason
/// (`otherix_enrollments_refused_total{reason}`): strangers guessing join
/// tokens show up there, not only as 401s in a log.
fn enroll_refused(reason: &'static str, e: ApiError) -> ApiError {
    metrics::counter!("otherix_enrollments_refused_total", "reason" => reason).increment(1);
    e
}

/// Enrollment: a join token buys one client certificate for the node's
/// own key, under the name the token was made for, with the token's roles.
#[utoipa::path(post, path = "/v1/agent/enroll", operation_id = "enrollNode", tag = "agent", request_body = EnrollRequest,
    responses((status = 200, body = EnrollResponse), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn enroll(
    State(state): State<AppState>,
    peer: Option<axum::Extension<PeerCert>>,
    ApiJson(req): ApiJson<EnrollRequest>,
) -> Result<Json<EnrollResponse>, ApiError> {
    validate_node_name(&req.node)
        .map_err(|e| enroll_refused("bad_name", ApiError::Invalid(e.to_string())))?;
    let invalid = |reason| enroll_refused(reason, ApiError::Unauthenticated("invalid join token".into()));
    let (id, secret) =
        split_token_with(JOIN_PREFIX, req.join_token.trim()).ok_or_else(|| invalid("malformed_token"))?;
    // Every check that needs nothing stored comes first: a stranger's
    // malformed request costs no store read. The CSR is only parsed (and
    // its signature checked) once the token is known good.
    if !looks_like_csr(&req.csr_pem) {
        return Err(enroll_refused(
            "bad_csr",
            ApiError::Invalid("invalid CSR: csr_pem must be one PEM block \"CERTIFICATE REQUEST\"".into()),
        ));
    }
    let record = state
        .store
        .join_token(id)
        .await?
        .ok_or_else(|| invalid("unknown_token"))?;
    if !secret_matches(secret, &record.secret_hash) {
        return Err(invalid("wrong_secret"));
    }
    let now = OffsetDateTime::now_utc();
    if record.used_by.as_deref() == Some(otherix_store::SUPERSEDED) {
        tracing::warn!(token_id = %id, node = ?record.node, "superseded join token used");
        return Err(enroll_refused(
            "superseded",
            ApiError::Unauthenticated(format!(
                "join token superseded: node {:?} was enrolled, replaced or deleted after it was made; create a new one",
                record.node.as_deref().unwrap_or_default()
            )),
        ));
    }
    if record.used_at.is_some() {
        return Err(enroll_refused(
            "used",
            ApiError::Unauthenticated("join token already used; create a new one".into()),
        ));
    }
    if record.expires_at <= now {
        return Err(enroll_refused(
            "expired",
            ApiError::Unauthenticated("join token expired; create a new one".into()),
        ));
    }
    let Some(bound) = record.node.as_deref() else {
        return Err(enroll_refused(
            "no_node",
            ApiError::Unauthenticated(
                "this join token names no node (made by an older control plane); create one with --name"
                    .into(),
            ),
        ));
    };
    if bound != req.node {
        tracing::warn!(token_id = %id, token_node = bound, asked = %req.node, "join token used for another node's name");
        return Err(enroll_refused(
            "other_node",
            ApiError::Forbidden(format!(
                "this join token enrolls node {bound:?}, not {:?}",
                req.node
            )),
        ));
    }
    let issued = state
        .ca
        .sign_node_csr(&req.csr_pem, &req.node, state.settings.node_cert_validity)
        .map_err(|e| enroll_refused("bad_csr", ApiError::Invalid(format!("{e:#}"))))?;
    let outcome = match state
        .store
        .enroll_node(&record, &req.node, &issued.fingerprint, issued.not_after, now)
        .await
    {
        Ok(Some(o)) => o,
        Ok(None) => {
            return Err(enroll_refused(
                "used",
                ApiError::Unauthenticated("join token already used; create a new one".into()),
            ))
        }
        Err(otherix_store::StoreError::Conflict(message)) => {
            tracing::warn!(node = %req.node, token_id = %id, "enrollment over an enrolled node refused");
            return Err(enroll_refused(
                "node_exists",
                ApiError::Conflict {
                    code: "node_exists",
                    message,
                },
            ));
        }
        Err(e) => return Err(e.into()),
    };
    let (action, detail) = match outcome {
        Enrolled::New => {
            tracing::info!(node = %req.node, token_id = %id, "node enrolled");
            (
                AuditAction::NodeEnroll,
                format!("enrolled as {}", describe_grant(&record.grant)),
            )
        }
        Enrolled::Replaced => {
            tracing::warn!(node = %req.node, token_id = %id, "node replaced; its previous certificates are revoked");
            (
                AuditAction::NodeReplace,
                format!(
                    "replaced (previous certificates revoked) as {}",
                    describe_grant(&record.grant)
                ),
            )
        }
    };
    audit(&state, format!("join-token:{id}"), action, &req.node, detail).await;
    // A node enrolled from here may use the connections kept for nodes.
    if let Some(axum::Extension(peer)) = peer {
        state.node_sources.insert(peer.addr.ip());
    }
    Ok(Json(EnrollResponse {
        node: req.node.into_string(),
        cert_pem: issued.pem,
        ca_pem: state.ca.cert_pem().to_string(),
    }))
}

/// Records why the node's heartbeats are refused, for `node get` — only
/// when that changed: a node looping a bad heartbeat costs no write each.
async fn refused_status(state: &AppState, node: &NodeRecord, reason: &str) -> Result<(), ApiError> {
    if node.status_reason.as_deref() != Some(reason) {
        state.store.set_node_status_reason(&node.name, reason).await?;
        state.catalog.sync().await?;
    }
    Ok(())
}

/// What a heartbeat asserts, checked against the node's grant: the roles
/// it was pinned to, and its VTEP. Returns the VTEP in force.
fn check_assertions(node: &NodeRecord, hb: &Heartbeat, from: IpAddr) -> Result<Ipv4Addr, Mismatch> {
    let granted_vtep = node.vtep_grant.as_deref().and_then(|v| v.parse().ok());
    let vtep = effective_vtep(&node.name, &hb.vtep, granted_vtep, from)?;
    if let Some(claimed) = &hb.roles {
        let addr = |s: &Option<String>| s.as_deref().and_then(|a| a.parse::<SocketAddr>().ok());
        // The relay endpoint as granted, with the VTEP of this heartbeat.
        let granted_relay = NodeRecord {
            vtep: Some(vtep.to_string()),
            ..node.clone()
        }
        .relay_endpoint();
        check_claims(
            &node.name,
            &Roles {
                hypervisor: node.hypervisor,
                gateway: addr(&node.gateway),
                relay: granted_relay,
            },
            &Roles {
                hypervisor: claimed.hypervisor,
                gateway: addr(&claimed.gateway),
                relay: addr(&claimed.relay),
            },
        )?;
    }
    Ok(vtep)
}

/// The heartbeat: records the state the node reports and answers with its
/// desired state. Only over mutual TLS, as the node the certificate names.
/// Roles and addresses are never taken from it: what it asserts must be
/// what was granted (409 and a status reason otherwise, nothing else
/// changes).
#[utoipa::path(post, path = "/v1/agent/heartbeat", operation_id = "heartbeat", tag = "agent", request_body = Heartbeat,
    responses((status = 200, body = DesiredState), (status = 401, body = ErrorBody), (status = 403, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn heartbeat(
    State(state): State<AppState>,
    caller: AgentNode,
    ApiJson(hb): ApiJson<Heartbeat>,
) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    let answer = heartbeat_answer(&state, caller, hb).await;
    let result = match &answer {
        Ok(Reply::Unchanged(_)) => "unchanged",
        Ok(Reply::Delta(_)) => "delta",
        Ok(Reply::Full(_)) => "ok",
        Err(e) => e.code(),
    };
    metrics::counter!("otherix_heartbeats_total", "result" => result).increment(1);
    metrics::histogram!("otherix_heartbeat_duration_seconds").record(started.elapsed().as_secs_f64());
    Ok(match answer? {
        Reply::Full(json) | Reply::Delta(json) => {
            ([(http::header::CONTENT_TYPE, "application/json")], json).into_response()
        }
        Reply::Unchanged(state) => Json(state).into_response(),
    })
}

/// A heartbeat that changes nothing the node row holds but its liveness
/// and versions writes the row at most this often (and at most every half
/// `--node-timeout`): what a CP restarted from the store knows of them.
const HEARTBEAT_WRITE_EVERY: Duration = Duration::seconds(5);

/// What a heartbeat is answered with.
enum Reply {
    /// The whole desired state.
    Full(bytes::Bytes),
    /// What changed since the version the agent applied.
    Delta(bytes::Bytes),
    /// The agent applied the current version: nothing to send but that.
    Unchanged(Box<DesiredState>),
}

async fn heartbeat_answer(state: &AppState, caller: AgentNode, mut hb: Heartbeat) -> Result<Reply, ApiError> {
    let AgentNode { node, from } = caller;
    // Before anything is compared, logged or stored: every string the node
    // sent is bounded and free of control characters.
    if let Err(bad) = hb.check_strings() {
        tracing::warn!(node = %node.name, reason = %bad, "heartbeat refused");
        refused_status(state, &node, &bad.to_string()).await?;
        return Err(ApiError::Invalid(bad.to_string()));
    }
    if hb.node != node.name {
        return Err(ApiError::Forbidden(format!(
            "this certificate belongs to node {:?}, not {:?}",
            node.name, hb.node
        )));
    }
    let vtep = match check_assertions(&node, &hb, from.ip()) {
        Ok(v) => v,
        Err(m) => {
            tracing::warn!(node = %node.name, reason = %m, "heartbeat refused");
            refused_status(state, &node, &m.to_string()).await?;
            return Err(ApiError::Conflict {
                code: m.code(),
                message: m.to_string(),
            });
        }
    };
    if hb.session_events.len() > MAX_SESSION_EVENTS {
        return Err(ApiError::Invalid(format!(
            "{} session events in one heartbeat; at most {MAX_SESSION_EVENTS}",
            hb.session_events.len()
        )));
    }
    if hb.session_bytes.len() > MAX_SESSION_BYTES {
        return Err(ApiError::Invalid(format!(
            "{} session byte counts in one heartbeat; at most {MAX_SESSION_BYTES}",
            hb.session_bytes.len()
        )));
    }
    let now = OffsetDateTime::now_utc();
    // Open sessions count only from a granted gateway (they keep overlay
    // memberships while they drain).
    let no_sessions = BTreeMap::new();
    let vtep = vtep.to_string();
    let sessions = if node.gateway.is_some() {
        &hb.sessions
    } else {
        &no_sessions
    };
    state
        .catalog
        .heartbeat(&node.name, now, &hb.version, hb.applied_version);
    if !hb.session_events.is_empty() {
        vet_session_events(state, &node.name, &mut hb.session_events, now);
    }
    if hb.session_epoch.is_some() || !hb.session_events.is_empty() {
        // Only a granted gateway reports sessions; one whose role was just
        // withdrawn still reports the ends of the sessions it carried.
        let (ended, ignored) = state
            .store
            .record_gateway_sessions(
                &node.name,
                node.gateway.is_some(),
                hb.session_epoch.as_deref(),
                &hb.session_events,
                now,
            )
            .await?;
        if ignored > 0 {
            tracing::warn!(node = %node.name, reports = ignored, "ignored session reports: not from a granted gateway, or about another node's sessions");
        }
        if ended > 0 {
            tracing::info!(node = %node.name, sessions = ended, "the gateway restarted; its earlier sessions are recorded as ended");
        }
    }
    if !hb.session_bytes.is_empty() {
        // After the starts above (one heartbeat may carry a session's start
        // and its first counts). Only sessions through this node move: a
        // node's report never decides another's session.
        state
            .store
            .record_session_bytes(BytesFrom::Gateway(&node.name), &hb.session_bytes, now)
            .await?;
    }
    let mut writes = HeartbeatWrites {
        node: node.name.clone(),
        states: guest_states(state, &node.name, &hb),
        verdicts: health_changes(state, &node.name, &hb),
        row: None,
    };
    // The row is written when what it holds changed, and otherwise only
    // now and then (liveness and versions are the catalog's soft state): a
    // woken heartbeat that changes nothing costs no write. Its `vouched_at`
    // tells the other replicas the node's verdicts stand as of now: it is
    // written with the verdicts it vouches for, in one transaction.
    let same = {
        let m = state.catalog.read();
        m.node(&node.name).is_some_and(|n| {
            n.vtep.as_deref() == Some(vtep.as_str())
                && n.netns.as_deref() == hb.netns.as_deref()
                && n.sessions == *sessions
                && n.status_reason.is_none()
                && n.ready_overlays.len() == hb.ready_overlays.len()
                && hb.ready_overlays.iter().all(|o| n.ready_overlays.contains(o))
        })
    };
    let every = HEARTBEAT_WRITE_EVERY.min(state.settings.node_timeout / 2);
    if !same || state.catalog.heartbeat_write_due(&node.name, every) {
        writes.row = Some(NodeBeat {
            vtep: vtep.clone(),
            agent_version: hb.version.clone(),
            applied_version: hb.applied_version,
            sessions: sessions.clone(),
            netns: hb.netns.clone(),
            ready_overlays: hb.ready_overlays.clone(),
            vouches: hb.health_changes_only,
            at: now,
        });
    }
    if !writes.is_empty() {
        let row = writes.row.is_some();
        write_heartbeat(state, writes).await?;
        if row {
            state.catalog.heartbeat_written(&node.name);
        }
    }
    // What this heartbeat wrote (and anything else committed meanwhile)
    // before the model is read for what follows.
    state.catalog.sync().await?;
    if record_migrations(state, &node.name, &hb, now).await?
        | record_incoming(state, &node.name, &hb).await?
        | schedule_pending(state, now).await?
    {
        state.catalog.sync().await?;
    }
    end_forwards(state, &node.name, now);
    let (drain, wanted) = {
        let m = state.catalog.read();
        let Some(me) = m.node(&node.name) else {
            return Err(ApiError::Unauthenticated(format!(
                "node {:?} was deleted",
                node.name
            )));
        };
        let drain = desired::drain_since(&m, me, now);
        let wanted = desired::membership_names(&m, me, &drain, now, state.settings.max_drain);
        // Names copied only when the leases are to change (rarely: a
        // heartbeat normally finds them as wanted).
        let same = wanted.iter().copied().eq(m.leased_network_names(&node.name));
        let wanted = (!same).then(|| {
            wanted
                .into_iter()
                .map(str::to_string)
                .collect::<std::collections::BTreeSet<_>>()
        });
        let drain = (drain != me.draining_since).then_some(drain);
        (drain, wanted)
    };
    if let Some(drain) = drain {
        state.store.set_node_draining(&node.name, &drain).await?;
    }
    if let Some(wanted) = wanted {
        if state
            .store
            .set_node_leases(&node.name, &wanted, random::mac, now)
            .await?
        {
            state.catalog.sync().await?;
        }
    }
    let applied = hb.applied_version;
    Ok(
        match state.catalog.answer(
            &node.name,
            applied,
            hb.accepts_unchanged,
            hb.accepts_delta,
            hb.accepts_guest_changes,
        ) {
            Answer::Unchanged(version) => Reply::Unchanged(Box::new(DesiredState {
                version,
                node: node.name.clone(),
                unchanged: true,
                ..Default::default()
            })),
            Answer::Delta(_, json) => Reply::Delta(for_agent(json, &hb)),
            Answer::Full(_, json) => Reply::Full(for_agent(json, &hb)),
        },
    )
}

/// The answer as `hb`'s agent reads it: one that predates revocations
/// naming one session gets them without that field (ending every session
/// of the principal to that VM and port, as before) rather than an answer
/// it would refuse whole.
fn for_agent(json: bytes::Bytes, hb: &Heartbeat) -> bytes::Bytes {
    if hb.reads_one_session_revocations {
        return json;
    }
    match otherix_proto::agent::without_one_session_revocations(&json) {
        Some(older) => bytes::Bytes::from(older),
        None => json,
    }
}

/// Keeps of a gateway's session reports only what the control plane can
/// stand behind: a start only with a credential this cluster issued to
/// `node` for that very session (its `jti`), recorded with the principal,
/// VM, port and network the credential names, not the report's; an end's
/// credential is kept only if it is such a credential (the store records
/// the end of a session it never saw start only with one). Signatures are
/// checked here, before any store work and outside the single writer.
/// What is dropped is counted by reason and logged once per heartbeat.
fn vet_session_events(state: &AppState, node: &str, events: &mut Vec<SessionEvent>, now: OffsetDateTime) {
    let keys = state.keys.verifying(now);
    let issuer = state.info.cluster_id.as_str();
    let issued = |credential: Option<&str>, session: &str| -> Result<Claims, &'static str> {
        let token = credential.ok_or("no_credential")?;
        let claims = verify_issued(token, &keys, Some(issuer), node).map_err(|r| r.code())?;
        if claims.jti != session {
            return Err("other_session");
        }
        Ok(claims)
    };
    let mut dropped: BTreeMap<&'static str, u64> = BTreeMap::new();
    events.retain_mut(|event| {
        let session = event.session().to_owned();
        let vetted = issued(event.credential(), &session);
        match vetted {
            Ok(claims) => {
                if let SessionEvent::Start { at, .. } = event {
                    // The gateway's clock says when; never before the
                    // credential was issued, never in the future.
                    *at = (*at).clamp(claims.iat - CLOCK_SKEW, now.max(claims.iat));
                }
                let (principal, vm, port, network) = event.target_mut();
                *principal = claims.sub;
                *vm = claims.vm;
                *port = claims.port;
                *network = claims.net;
                true
            }
            Err(reason) => match event {
                SessionEvent::Start { .. } => {
                    *dropped.entry(reason).or_default() += 1;
                    false
                }
                // Still good for a session open on this node (the store
                // checks); not for one the CP never saw start.
                SessionEvent::End { credential, .. } => {
                    if credential.take().is_some() {
                        *dropped.entry(reason).or_default() += 1;
                    }
                    true
                }
            },
        }
    });
    for (reason, n) in &dropped {
        metrics::counter!("otherix_session_reports_refused_total", "reason" => *reason).increment(*n);
    }
    let total: u64 = dropped.values().sum();
    if total > 0 {
        tracing::warn!(node, reports = total, reasons = ?dropped.keys().collect::<Vec<_>>(), "session reports refused: not with a credential this cluster issued to the gateway for that session");
    }
}

/// A certificate for the node's own key: a renewed client certificate, or
/// a serving certificate for a role it was granted, at the granted address
/// (never one from the request).
#[utoipa::path(post, path = "/v1/agent/certificate", operation_id = "renewNodeCertificate", tag = "agent", request_body = CertificateRequest,
    responses((status = 200, body = CertificateResponse), (status = 401, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn certificate(
    State(state): State<AppState>,
    AgentNode { node, .. }: AgentNode,
    ApiJson(req): ApiJson<CertificateRequest>,
) -> Result<Json<CertificateResponse>, ApiError> {
    let validity = state.settings.node_cert_validity;
    let not_granted = |role: &str, flag: &str| ApiError::Conflict {
        code: "role_not_granted",
        message: format!(
            "node {:?} has no {role} role; an admin grants it: otherix node update {} {flag}",
            node.name, node.name
        ),
    };
    let issued = match req.purpose {
        CertPurpose::Node => state.ca.sign_node_csr(&req.csr_pem, &node.name, validity),
        CertPurpose::Gateway => {
            let addr: SocketAddr = node
                .gateway
                .as_deref()
                .and_then(|g| g.parse().ok())
                .ok_or_else(|| not_granted("gateway", "--gateway IP:PORT"))?;
            state
                .ca
                .sign_gateway_csr(&req.csr_pem, &node.name, addr.ip(), validity)
        }
        CertPurpose::Relay => {
            node.relay_endpoint()
                .ok_or_else(|| not_granted("relay", "--relay IP:PORT"))?;
            state.ca.sign_relay_csr(&req.csr_pem, &node.name, validity)
        }
    }
    .map_err(|e| ApiError::Invalid(format!("{e:#}")))?;
    let now = OffsetDateTime::now_utc();
    state
        .store
        .add_node_cert(
            &node.name,
            &issued.fingerprint,
            req.purpose.as_str(),
            issued.not_after,
            now,
        )
        .await?;
    tracing::info!(node = %node.name, purpose = req.purpose.as_str(), not_after = %issued.not_after, "certificate issued");
    Ok(Json(CertificateResponse {
        cert_pem: issued.pem,
        ca_pem: state.ca.cert_pem().to_string(),
    }))
}

/// The enrolled node a mutual-TLS request comes from, by its client
/// certificate (unexpired, not revoked), and the address it comes from. An
/// extractor of the request's head: it runs before the body is read, so a
/// caller without a node's certificate never gets a heartbeat parsed.
pub struct AgentNode {
    pub node: NodeRecord,
    pub from: SocketAddr,
}

impl axum::extract::FromRequestParts<AppState> for AgentNode {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let need =
            || ApiError::Unauthenticated("this call needs the node's client certificate (mutual TLS)".into());
        let peer = parts.extensions.get::<PeerCert>().cloned().ok_or_else(need)?;
        let fingerprint = peer.fingerprint.ok_or_else(need)?;
        let now = OffsetDateTime::now_utc();
        let find = || {
            let m = state.catalog.read();
            m.cert(&fingerprint)
                .filter(|c| c.purpose == "node" && c.not_after >= now)
                .and_then(|c| m.node(&c.node))
                .cloned()
        };
        let node = match find() {
            Some(node) => Some(node),
            None => {
                // Enrolled or renewed through another replica a moment ago?
                state.catalog.caught_up_since(std::time::Instant::now()).await;
                find()
            }
        };
        let node = node.ok_or_else(|| {
            ApiError::Unauthenticated(
                "unknown, expired or revoked node certificate; enroll the node again with a new join token"
                    .into(),
            )
        })?;
        // Its address may use the connections kept for nodes from now on.
        state.node_sources.insert(peer.addr.ip());
        // Before the body is read: a node looping calls costs a bucket lookup.
        if let Some(call) = crate::limits::NodeCall::of_path(parts.uri.path()) {
            state.node_limits.check(&node.name, call, now)?;
        }
        Ok(AgentNode {
            node,
            from: peer.addr,
        })
    }
}

/// The guest states the node reports that are to be written: for VMs
/// placed on it, when changed.
fn guest_states(state: &AppState, node: &str, hb: &Heartbeat) -> Vec<VmStateWrite> {
    let m = state.catalog.read();
    hb.guests
        .iter()
        .filter(|g| {
            m.vm(&g.vm_id).is_some_and(|vm| {
                vm.node.as_deref() == Some(node)
                    // While a migration is under way the CP owns the state.
                    && g.state != VmState::Migrating
                    && vm.migrate_to.is_none()
                    && (vm.state != g.state
                        // A running guest's last word (why its migration
                        // was rolled back) stays until something else is said.
                        || (vm.reason != g.reason && !(g.state == VmState::Running && g.reason.is_none()))
                        || (vm.machine.is_some() && vm.accelerator != g.accelerator))
            })
        })
        .map(|g| VmStateWrite {
            vm_id: g.vm_id.clone(),
            state: g.state,
            reason: g.reason.clone(),
            accelerator: vm_accelerator(g),
        })
        .collect()
}

/// Writes what a heartbeat wrote, grouped with the heartbeats' writes
/// queued meanwhile (see [`crate::groups`]): one transaction a group. A
/// group that fails is written again one heartbeat at a time, so that one
/// heartbeat's trouble is its own.
async fn write_heartbeat(state: &AppState, writes: HeartbeatWrites) -> Result<(), ApiError> {
    state
        .heartbeat_writes
        .submit(writes, |group, lead| {
            let state = state.clone();
            async move {
                metrics::histogram!("otherix_heartbeat_write_group_size").record(group.len() as f64);
                let answers = match state.store.record_heartbeats(&group).await {
                    Ok(()) => group.iter().map(|_| Ok(())).collect(),
                    Err(e) if group.len() > 1 => {
                        tracing::warn!(error = %e, heartbeats = group.len(), "a group of heartbeats' writes failed; writing each alone");
                        let mut answers = Vec::with_capacity(group.len());
                        for one in group {
                            answers.push(state.store.record_heartbeats(&[one]).await.map_err(ApiError::from));
                        }
                        answers
                    }
                    Err(e) => vec![Err(ApiError::from(e))],
                };
                drop(lead);
                answers
            }
        })
        .await
}

/// The accelerator to record: a running QEMU guest's (a netns guest has none).
fn vm_accelerator(g: &otherix_proto::agent::GuestStatus) -> Option<otherix_proto::Accelerator> {
    (g.state == VmState::Running).then_some(g.accelerator).flatten()
}

/// The health verdicts a node reports for backends placed on it that are
/// to be written: a verdict about a VM the node does not own (any more) is
/// dropped, and only a new verdict is written. A new probe time of the same
/// verdict is the catalog's soft state, taken here.
fn health_changes(state: &AppState, node: &str, hb: &Heartbeat) -> Vec<otherix_store::VerdictRecord> {
    let mut changed = Vec::new();
    let mut probed = Vec::new();
    {
        let m = state.catalog.read();
        for h in &hb.health {
            if m.vm(&h.vm_id).is_none_or(|vm| vm.node.as_deref() != Some(node)) {
                continue;
            }
            let reason: Option<String> = h.reason.as_ref().map(|r| r.chars().take(200).collect());
            // The store keeps milliseconds: compare what it would keep.
            let ms = |t: Option<OffsetDateTime>| t.map(|t| t.unix_timestamp_nanos() / 1_000_000);
            let same = m.verdict(&h.lb, &h.vm_id).is_some_and(|v| {
                let v = v.record;
                v.node == node
                    && v.health == h.health
                    && v.reason == reason
                    && ms(v.changed_at) == ms(h.changed_at)
            });
            // Every report refreshes the probe time the catalog holds; a
            // written one also reaches it through the change log.
            probed.push((
                h.lb.clone(),
                h.vm_id.clone(),
                h.probed_at,
                h.successes,
                h.failures,
            ));
            if !same {
                changed.push(otherix_store::VerdictRecord {
                    lb: h.lb.clone(),
                    vm_id: h.vm_id.clone(),
                    node: node.to_string(),
                    health: h.health,
                    probed_at: h.probed_at,
                    changed_at: h.changed_at,
                    reason,
                    successes: h.successes,
                    failures: h.failures,
                });
            }
        }
    }
    state.catalog.probed(&probed);
    if hb.health_changes_only {
        // The verdicts it did not list stand as of now.
        state.catalog.vouch(node, OffsetDateTime::now_utc());
    }
    changed
}

/// Applies what a source node says about its migrations, and rolls back
/// migrations whose target stopped being Ready (`migration::steps`).
/// Returns whether any changed.
async fn record_migrations(
    state: &AppState,
    node: &str,
    hb: &Heartbeat,
    now: OffsetDateTime,
) -> Result<bool, ApiError> {
    let steps = {
        let m = state.catalog.read();
        // Only VMs migrating matter, from the model's index of them (not
        // a walk of the node's guests); the others are not copied.
        let vms: Vec<otherix_proto::Vm> = m.migrations_at(node).cloned().collect();
        let nodes: Vec<NodeRecord> = vms
            .iter()
            .filter_map(|vm| vm.migrate_to.as_deref().and_then(|to| m.node(to)).cloned())
            .collect();
        migration::steps(
            node,
            &vms,
            &nodes,
            &hb.migrations,
            now,
            state.settings.node_timeout,
        )
    };
    let mut changed = false;
    let mut switched = false;
    for step in steps {
        match step {
            Step::Complete { vm_id, vm, to } => {
                let completed = state.store.complete_migration(&vm_id, node).await?;
                changed |= completed;
                switched |= completed;
                if completed {
                    // Frames for the guest still reach this node until every
                    // member repoints: it sends them on meanwhile.
                    state.catalog.moved(&vm_id, node, now + desired::FORWARD_AT_MOST);
                }
                tracing::info!(%vm, from = node, %to, "guest handed over");
            }
            Step::RollBack { vm_id, vm, reason } => {
                changed |= state.store.roll_back_migration(&vm_id, &reason).await?;
                tracing::warn!(%vm, %reason, "migration rolled back");
            }
        }
    }
    if switched {
        // The catch-up that follows (the caller's) wakes the recompute; the
        // overlay's members repoint the guest's FDB entry at once, not a
        // coalescing round later.
        state.catalog.urgent();
    }
    Ok(changed)
}

/// Ends `node`'s forwarding for guests handed over from it once every
/// other member of their overlay has applied where they are now, or past
/// [`desired::FORWARD_AT_MOST`] (and anyone's past that, so a node that
/// stopped heartbeating leaves nothing behind). Its membership of their
/// overlays, kept for the forwarding, ends with it.
fn end_forwards(state: &AppState, node: &str, now: OffsetDateTime) {
    let (pending, mut over) = {
        let m = state.catalog.read();
        (desired::forwards_pending(&m, node, now), m.moved_expired(now))
    };
    for (vm_id, verdict) in pending {
        let done = match verdict {
            desired::Forwarding::Over => true,
            desired::Forwarding::Until(members) => state.catalog.applied_current(&members),
        };
        if done {
            tracing::debug!(node, %vm_id, "forwarding for a guest that left ends");
            over.push(vm_id);
        }
    }
    if !over.is_empty() {
        over.sort_unstable();
        over.dedup();
        state.catalog.end_moved(&over);
    }
}

/// What a QEMU migration's target says: the port its incoming QEMU listens
/// on (recorded for the migration it names, so the source is told where to
/// stream), or that it cannot receive the guest (the migration is rolled
/// back with its reason). Returns whether anything changed.
async fn record_incoming(state: &AppState, node: &str, hb: &Heartbeat) -> Result<bool, ApiError> {
    let (ports, failed) = {
        let m = state.catalog.read();
        let incoming_here = |vm_id: &str| {
            m.vm(vm_id)
                .filter(|vm| vm.migrate_to.as_deref() == Some(node) && vm.machine.is_some())
                .cloned()
        };
        let ports: Vec<_> = hb
            .incoming
            .iter()
            .filter_map(|r| {
                let vm = incoming_here(&r.vm_id)?;
                (vm.migration_id.as_deref() == Some(r.migration.as_str())
                    && vm.migration_port != Some(r.port))
                .then(|| r.clone())
            })
            .collect();
        let failed: Vec<_> = hb
            .guests
            .iter()
            .filter(|g| g.state == VmState::Failed)
            .filter_map(|g| Some((incoming_here(&g.vm_id)?, g.reason.clone().unwrap_or_default())))
            .collect();
        (ports, failed)
    };
    let mut changed = false;
    for r in ports {
        if state
            .store
            .set_migration_port(&r.vm_id, node, &r.migration, r.port)
            .await?
        {
            tracing::info!(vm_id = %r.vm_id, to = node, port = r.port, "incoming QEMU listens");
            changed = true;
        }
    }
    for (vm, reason) in failed {
        let reason = format!("migration to {node} rolled back: {node} cannot receive the guest: {reason}");
        changed |= state.store.roll_back_migration(&vm.id, &reason).await?;
        tracing::warn!(vm = %vm.name, %reason, "migration rolled back");
    }
    Ok(changed)
}

/// Places every unplaced VM that a Ready hypervisor can take
/// (`schedule::placements`). Returns whether it placed any.
pub async fn schedule_pending(state: &AppState, now: OffsetDateTime) -> Result<bool, ApiError> {
    if state.catalog.read().unplaced().next().is_none() {
        return Ok(false);
    }
    // Another heartbeat is placing them; what it does not see yet, the next one places.
    let Ok(_one) = state.scheduling.try_lock() else {
        return Ok(false);
    };
    let in_transit = state.creates.in_transit().load();
    let placements = {
        let m = state.catalog.read();
        let unplaced: Vec<&otherix_proto::Vm> = m.unplaced().collect();
        if unplaced.is_empty() {
            return Ok(false);
        }
        let networks: BTreeMap<&str, &otherix_proto::Network> =
            m.network_refs().map(|n| (n.name.as_str(), n)).collect();
        schedule::placements(
            |net| m.hosts_by_load(net),
            &networks,
            &unplaced,
            in_transit,
            now,
            state.settings.node_timeout,
        )
    };
    if placements.is_empty() {
        return Ok(false);
    }
    // One transaction for the pass: a group of creates is placed at once.
    let pairs: Vec<(String, String)> = placements
        .iter()
        .map(|p| (p.vm_id.clone(), p.node.clone()))
        .collect();
    let mut placed = false;
    for (p, done) in placements.iter().zip(state.store.place_vms(&pairs).await?) {
        // False when the VM was placed or deleted meanwhile.
        if done {
            tracing::info!(vm_id = %p.vm_id, node = %p.node, "vm scheduled");
            placed = true;
        }
    }
    // Before the next scheduler reads the catalog.
    if placed {
        state.catalog.sync().await?;
    }
    Ok(placed)
}

fn to_api(n: &NodeRecord, m: &Model, now: OffsetDateTime, timeout: Duration) -> Node {
    Node {
        name: n.name.clone(),
        roles: roles_of(n),
        status: if desired::is_ready(n, now, timeout) {
            NodeStatus::Ready
        } else {
            NodeStatus::NotReady
        },
        vtep: n.vtep.clone(),
        guests: m.guests_on(&n.name) as u32,
        overlays: m.leased_network_names(&n.name).map(str::to_string).collect(),
        draining: desired::draining(m, n).into_iter().collect(),
        agent_version: n.agent_version.clone(),
        last_heartbeat: n.last_heartbeat,
        status_reason: n.status_reason.clone(),
        created_at: n.created_at,
    }
}

#[utoipa::path(get, path = "/v1/nodes", operation_id = "listNodes", tag = "nodes", security(("bearer" = [])),
    responses((status = 200, body = Vec<Node>)))]
pub async fn list(State(state): State<AppState>, _p: Principal) -> Result<Json<Vec<Node>>, ApiError> {
    let m = state.catalog.read();
    let now = OffsetDateTime::now_utc();
    Ok(Json(
        m.nodes()
            .map(|n| to_api(n, &m, now, state.settings.node_timeout))
            .collect(),
    ))
}

#[utoipa::path(get, path = "/v1/nodes/{name}", operation_id = "getNode", tag = "nodes", security(("bearer" = [])),
    responses((status = 200, body = Node), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<AppState>,
    _p: Principal,
    ApiPath(name): ApiPath<String>,
) -> Result<Json<Node>, ApiError> {
    let m = state.catalog.read();
    let n = m
        .node(&name)
        .ok_or_else(|| ApiError::NotFound(format!("node {name:?} not found")))?;
    Ok(Json(to_api(
        n,
        &m,
        OffsetDateTime::now_utc(),
        state.settings.node_timeout,
    )))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct DeleteQuery {
    /// Delete even while it hosts guests (they are rescheduled).
    #[serde(default)]
    force: bool,
}

#[utoipa::path(delete, path = "/v1/nodes/{name}", operation_id = "deleteNode", tag = "nodes", security(("bearer" = [])), params(DeleteQuery),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn delete(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<DeleteQuery>,
) -> Result<StatusCode, ApiError> {
    p.require_admin("delete nodes")?;
    state.store.delete_node(&name, q.force).await?;
    tracing::info!(node = %name, force = q.force, by = %p.name, "node deleted; its certificates are revoked");
    audit(
        &state,
        p.id(),
        AuditAction::NodeDelete,
        &name,
        format!(
            "deleted{}; certificates revoked",
            if q.force { " (--force)" } else { "" }
        ),
    )
    .await;
    Ok(StatusCode::NO_CONTENT)
}

/// `otherix node update`: what a node may be is the admin's to change,
/// never the node's.
#[utoipa::path(patch, path = "/v1/nodes/{name}", operation_id = "updateNode", tag = "nodes", security(("bearer" = [])), request_body = UpdateNodeRequest,
    responses((status = 200, body = Node), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn update(
    State(state): State<AppState>,
    p: Principal,
    ApiPath(name): ApiPath<String>,
    body: Body<UpdateNodeRequest>,
) -> Result<Json<Node>, ApiError> {
    p.require_admin("update nodes")?;
    let req = body.read()?;
    let before = state.store.node(&name).await?.grant();
    let after = grant_from(
        req.hypervisor.unwrap_or(before.hypervisor),
        match req.gateway.as_deref() {
            None => before.gateway.as_deref(),
            Some("none") => None,
            Some(g) => Some(g),
        },
        match req.relay.as_deref() {
            None => before.relay.as_deref(),
            Some(r) => Some(r),
        },
        match req.vtep.as_deref() {
            None => before.vtep.as_deref(),
            Some("auto") => None,
            Some(v) => Some(v),
        },
    )?;
    let node = state.store.update_node_grant(&name, &after).await?;
    if after != before {
        let detail = format!("{} -> {}", describe_grant(&before), describe_grant(&after));
        tracing::info!(node = %name, by = %p.name, change = %detail, "node grant changed");
        audit(&state, p.id(), AuditAction::NodeUpdate, &name, detail).await;
    }
    state.catalog.sync().await?;
    let m = state.catalog.read();
    let node = m.node(&name).unwrap_or(&node);
    Ok(Json(to_api(
        node,
        &m,
        OffsetDateTime::now_utc(),
        state.settings.node_timeout,
    )))
}
