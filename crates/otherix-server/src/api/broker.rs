//! `POST /v1/broker`: who may reach which `(VM, port)`, through which
//! gateway, with which single-use credential. Every decision is audited.

use axum::extract::State;
use axum::Json;
use otherix_core::credential::Claims;
use otherix_proto::{
    AuditAction, BrokerRequest, BrokerResponse, ErrorBody, NetworkType, Role, Transport, Vm, VmState,
};
use otherix_store::{AuditEvent, GrantUse, NodeRecord};
use time::OffsetDateTime;

use super::extract::Host;
use super::Body;
use crate::auth::Caller;
use crate::authorize::{self, Asker, Rule};
use crate::catalog::Model;
use crate::desired;
use crate::error::ApiError;
use crate::random;
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/broker", operation_id = "broker", tag = "broker", security(("bearer" = [])), request_body = BrokerRequest,
    responses((status = 200, body = BrokerResponse), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn broker(
    State(state): State<AppState>,
    caller: Caller,
    Host(host): Host,
    body: Body<BrokerRequest>,
) -> Result<Json<BrokerResponse>, ApiError> {
    // A viewer may not broker, whatever it asks: its malformed request is
    // told so too (its well-formed one is refused, and audited, below).
    let req = match body.read() {
        Ok(req) => req,
        Err(_) if matches!(&caller, Caller::User(p) if p.role == Role::Viewer) => {
            return Err(ApiError::Forbidden(authorize::Denied::Viewer.to_string()));
        }
        Err(e) => return Err(e),
    };
    let now = OffsetDateTime::now_utc();
    let started = std::time::Instant::now();
    let principal = caller.id();
    // Only used to tell the client where the relay is: the CP it is
    // already talking to. Never a dial target.
    let host = host.as_deref();
    // Checked before anything else, and stored bounded: an unvalidated
    // target (up to the body limit) must not reach the audit trail as is.
    let target_ok = valid_target(&req.target);
    let audited = |result: Result<&BrokerResponse, String>| AuditEvent {
        id: 0,
        at: now,
        principal: principal.clone(),
        action: AuditAction::Broker,
        target: Some(if target_ok {
            req.target.clone()
        } else {
            bounded(&req.target)
        }),
        port: u16::try_from(req.port).ok(),
        transport: result.as_ref().ok().map(|r| r.transport),
        node: result
            .as_ref()
            .ok()
            .and_then(|r| r.endpoint.strip_prefix("https://").map(str::to_string)),
        allowed: result.is_ok(),
        reason: result.err(),
        bytes_up: None,
        bytes_down: None,
        duration_ms: None,
        session: None,
    };
    // Over its rate: refused before any work, audited once a minute.
    if let Err(refused) = state.limits.check(&principal, now) {
        metrics::counter!("otherix_broker_decisions_total", "outcome" => "refused", "reason" => "rate_limited")
            .increment(1);
        if refused.audit {
            tracing::info!(principal = %caller.id(), "broker rate limit hit");
            let reason = "rate limited (further refusals this minute are counted, not audited)";
            state.audit.record(audited(Err(reason.into())));
        }
        return Err(ApiError::TooManyRequests {
            code: "rate_limited",
            message: format!(
                "{} is over its broker rate limit ({}/s); retry in {} ms",
                caller.id(),
                state.settings.broker_rate,
                refused.limited.retry_after.as_millis().max(1)
            ),
            retry_after: refused.limited.retry_after,
        });
    }
    let result = if !target_ok {
        Err(ApiError::Invalid(format!(
            "invalid target {}: expected a VM name or lb/NAME (a DNS label)",
            bounded(&req.target)
        )))
    } else if let Err(e) = valid_exclude(&req.exclude) {
        Err(e)
    } else {
        decide(&state, &caller, &req, host, now).await
    };
    let event = audited(result.as_ref().map_err(|e| e.to_string()));
    let result = match result {
        // The credential leaves only once its decision is in the trail.
        Ok(r) => match state.audit.write(event).await {
            Ok(()) => Ok(r),
            Err(e) => Err(ApiError::Unavailable {
                code: "audit_unavailable",
                message: format!("{e}; no credential was issued"),
            }),
        },
        Err(e) => {
            state.audit.record(event);
            Err(e)
        }
    };
    match &result {
        Ok(r) => {
            metrics::counter!("otherix_broker_decisions_total", "outcome" => "allowed", "reason" => "")
                .increment(1);
            metrics::counter!("otherix_credentials_minted_total", "transport" => r.transport.as_str())
                .increment(1);
            // The request's own `answered` line is at debug for this one,
            // and so is its own line when the target is a VM: its audit
            // row says it all, and the info log counts it in a summary
            // (`crate::brokered`). A load balancer's pick is in no audit
            // row: that line stays at info.
            let elapsed_ms = started.elapsed().as_millis() as u64;
            if req.target.starts_with("lb/") {
                tracing::info!(%principal, target = %req.target, vm = %r.vm, port = r.port, endpoint = %r.endpoint, elapsed_ms, "brokered")
            } else {
                state.brokered.add();
                tracing::debug!(%principal, vm = %r.vm, port = r.port, endpoint = %r.endpoint, elapsed_ms, "brokered")
            }
        }
        Err(e) => {
            metrics::counter!("otherix_broker_decisions_total", "outcome" => "refused", "reason" => e.code())
                .increment(1);
            tracing::info!(%principal, target = %bounded(&req.target), port = req.port, reason = %e, "broker refused")
        }
    }
    metrics::histogram!("otherix_broker_duration_seconds").record(started.elapsed().as_secs_f64());
    result.map(Json)
}

/// Most backends a broker call may ask to leave out: a client excludes
/// the few it just failed to reach, never a pool.
pub const MAX_EXCLUDE: usize = 8;

/// `exclude`: at most [`MAX_EXCLUDE`] VM names — checked before anything
/// is read, so a long list never multiplies a walk of the pool.
fn valid_exclude(exclude: &[String]) -> Result<(), ApiError> {
    if exclude.len() > MAX_EXCLUDE {
        return Err(ApiError::Invalid(format!(
            "exclude names {} backends; at most {MAX_EXCLUDE} may be left out",
            exclude.len()
        )));
    }
    match exclude
        .iter()
        .find(|n| otherix_core::names::validate_name(n).is_err())
    {
        Some(bad) => Err(ApiError::Invalid(format!(
            "invalid exclude entry {}: expected a VM name",
            bounded(bad)
        ))),
        None => Ok(()),
    }
}

/// A VM name or `lb/NAME`.
fn valid_target(target: &str) -> bool {
    otherix_core::names::validate_name(target.strip_prefix("lb/").unwrap_or(target)).is_ok()
}

/// A refused target as stored and shown: at most 64 characters, control and
/// non-ASCII characters escaped, marked when cut.
fn bounded(target: &str) -> String {
    const MAX: usize = 64;
    let escaped: String = target.chars().flat_map(char::escape_default).collect();
    if escaped.chars().count() <= MAX {
        format!("\"{escaped}\"")
    } else {
        let cut: String = escaped.chars().take(MAX).collect();
        format!("\"{cut}\"... ({} bytes)", target.len())
    }
}

async fn decide(
    state: &AppState,
    caller: &Caller,
    req: &BrokerRequest,
    host: Option<&str>,
    now: OffsetDateTime,
) -> Result<BrokerResponse, ApiError> {
    if let Caller::User(p) = caller {
        if p.role == Role::Viewer {
            return Err(ApiError::Forbidden(authorize::Denied::Viewer.to_string()));
        }
    }
    may_mint(state).await?;
    let port = u16::try_from(req.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ApiError::Invalid(format!("port {} is out of range 1-65535", req.port)))?;
    let Choice {
        vm,
        net,
        transport,
        endpoint,
        audience,
        mac,
        gateway_certs,
    } = choose(state, &state.catalog.read(), caller, req, port, host, now)?;
    let key = state
        .keys
        .current(now)
        .ok_or_else(|| ApiError::Internal("no session signing key loaded".into()))?;
    let ttl = state.keys.ttl();
    let claims = Claims {
        iss: state.info.cluster_id.clone(),
        aud: audience,
        sub: caller.id(),
        tok: match caller {
            Caller::User(p) => Some(p.token_id.clone()),
            Caller::Grant(_) => None,
        },
        jti: random::long_id(),
        iat: now,
        nbf: now,
        // A grant's credential never outlives the grant.
        exp: match caller {
            Caller::Grant(g) => (now + ttl).min(g.expires_at),
            Caller::User(_) => now + ttl,
        },
        vm: vm.name.clone(),
        vm_id: vm.id,
        net,
        mac,
        ip: vm.ip.to_string(),
        port,
        // Its sessions end when the grant does (gateway and relay alike).
        until: match caller {
            Caller::Grant(g) => Some(g.expires_at),
            Caller::User(_) => None,
        },
    };
    // A revocation that covers these claims — one applied since the model
    // was read above, or one stamped ahead of its commit (see `revoke`) —
    // is refused here rather than minted for a gateway to refuse.
    not_revoked(state, &claims, || format!("{}:{port}", claims.vm))?;
    if let Caller::Grant(g) = caller {
        // Counted last, atomically with the cap: refusals above cost nothing.
        match state.store.use_grant(&g.id, now).await? {
            GrantUse::Counted => {}
            GrantUse::Revoked => {
                return Err(ApiError::Denied {
                    code: "grant_revoked",
                    message: format!("grant {:?} was revoked", g.name),
                })
            }
            GrantUse::Expired => {
                return Err(ApiError::Denied {
                    code: "grant_expired",
                    message: format!("grant {:?} has expired", g.name),
                })
            }
            GrantUse::CapReached => {
                return Err(ApiError::Denied {
                    code: "grant_exhausted",
                    message: format!("grant {:?} has used all its connections", g.name),
                })
            }
        }
    }
    let gateway_node = (transport == Transport::Gateway).then(|| claims.aud.clone());
    let credential = key.mint(&claims).map_err(|e| ApiError::Internal(e.to_string()))?;
    let expires_in = std::time::Duration::try_from(claims.exp - now).unwrap_or_default();
    Ok(BrokerResponse {
        node: gateway_node,
        transport,
        endpoint,
        credential,
        expires_in_ms: Some(u64::try_from(expires_in.as_millis()).unwrap_or(u64::MAX)),
        expires_at: claims.exp,
        vm: vm.name,
        port,
        // Counted above: the client must not keep such credentials ready.
        budgeted: matches!(caller, Caller::Grant(g) if g.max_connections.is_some()),
        gateway_certs,
    })
}

/// Whether this replica may mint now. Minting from a catalog that stopped
/// following the store could hand out access that was taken away: the
/// catalog holds every change committed until MINT_LAG before the model is
/// read (`now`, the credential's `iat`, was stamped before), and this
/// replica's clock agrees with the others' — what `revoke` relies on to
/// cover every credential minted before a revocation reached this replica.
/// Refuses claims a revocation covers: `access to WHAT was revoked for SUB`
/// (`what` is only spelt out for a refusal).
fn not_revoked(state: &AppState, claims: &Claims, what: impl FnOnce() -> String) -> Result<(), ApiError> {
    if state
        .catalog
        .read()
        .revocations()
        .iter()
        .any(|r| r.covers(claims))
    {
        return Err(ApiError::Forbidden(format!(
            "access to {} was revoked for {}",
            what(),
            claims.sub
        )));
    }
    Ok(())
}

async fn may_mint(state: &AppState) -> Result<(), ApiError> {
    if !state.catalog.fresh() || !state.catalog.ready_to_mint().await {
        return Err(ApiError::Unavailable {
            code: "catalog_stale",
            message: "the control plane has lost track of its store; retry shortly".into(),
        });
    }
    if let Err(e) = state.clock.check() {
        return Err(ApiError::Unavailable {
            code: "clock_skew",
            message: format!("{e}; no credential was issued"),
        });
    }
    Ok(())
}

/// What the broker decided from the catalog, before anything is written.
struct Choice {
    /// What the credential names of the VM (not a copy of the whole VM:
    /// its labels and the rest would be copied per credential for nothing).
    vm: ChosenVm,
    net: String,
    transport: Transport,
    endpoint: String,
    audience: String,
    mac: Option<String>,
    /// For a gateway: the certificates the client may accept there.
    gateway_certs: Option<Vec<String>>,
}

/// The chosen VM, as the credential names it.
struct ChosenVm {
    name: String,
    id: String,
    ip: std::net::Ipv4Addr,
}

/// Everything the broker reads, from the catalog alone: the session cap,
/// what the caller was given, the VM (or the LB's backend), and where the
/// client connects.
fn choose(
    state: &AppState,
    m: &Model,
    caller: &Caller,
    req: &BrokerRequest,
    port: u16,
    host: Option<&str>,
    now: OffsetDateTime,
) -> Result<Choice, ApiError> {
    // Authenticated before `now` was stamped: the token (or grant) must
    // still be here in the model this decision reads, so a revocation
    // applied in between is never minted past.
    match caller {
        Caller::User(p) => {
            if m.token(&p.token_id).is_none_or(|t| t.user != p.name) {
                return Err(ApiError::Unauthenticated("invalid or revoked API token".into()));
            }
        }
        Caller::Grant(g) => {
            if m.grant(&g.id).is_none_or(|g| g.revoked_at.is_some()) {
                return Err(ApiError::Forbidden(format!("grant {:?} was revoked", g.name)));
            }
        }
    }
    // What the caller was given: a user's rules, a grant's targets.
    let no_rules: &[Rule] = &[];
    let asker = match caller {
        Caller::User(p) => Asker::User {
            name: &p.name,
            role: p.role,
            rules: m.user(&p.name).map_or(no_rules, |u| u.rules.as_slice()),
        },
        Caller::Grant(g) => Asker::Grant {
            name: &g.name,
            targets: &m
                .grant(&g.id)
                .ok_or_else(|| ApiError::Unauthenticated("invalid grant token".into()))?
                .targets,
        },
    };
    authorize::request(asker, &req.target, port).map_err(denied)?;
    let vm = match req.target.strip_prefix("lb/") {
        Some(lb) => {
            let exclude: std::collections::HashSet<&str> = req.exclude.iter().map(String::as_str).collect();
            choose_backend(state, m, asker, lb, port, &exclude, now)?
        }
        None => {
            let vm = m
                .vm_by_name(&req.target)
                .ok_or_else(|| ApiError::NotFound(format!("vm {:?} not found", req.target)))?;
            authorize::vm(asker, vm, port).map_err(denied)?;
            vm
        }
    };
    if vm.state != VmState::Running {
        return Err(ApiError::Conflict {
            code: "vm_not_running",
            message: format!("vm {:?} is {}, not running", vm.name, vm.state),
        });
    }
    let net = m
        .network_ref(&vm.network)
        .ok_or_else(|| ApiError::NotFound(format!("network {:?} not found", vm.network)))?;
    let ready = |n: &&NodeRecord| desired::is_ready(n, now, state.settings.node_timeout);
    // Where the client connects, and who must accept the credential there.
    let (transport, endpoint, audience, mac, gateway_certs) = if net.kind == NetworkType::Bridge {
        // No gateway shares a bridge's L2: the CP relays, through the node
        // that owns the bridge.
        let owner = vm.node.as_deref().and_then(|n| m.node(n));
        if owner.filter(ready).is_none_or(|n| n.relay_endpoint().is_none()) {
            return Err(ApiError::Unavailable {
                code: "no_relay",
                message: format!(
                    "node {} of bridge VM {:?} is not Ready to relay; retry shortly",
                    vm.node.as_deref().unwrap_or("-"),
                    vm.name
                ),
            });
        }
        let host = host.unwrap_or("control-plane");
        (
            Transport::Relay,
            format!("wss://{host}{}", otherix_proto::relay::PATH),
            otherix_proto::relay::AUDIENCE.to_string(),
            None,
            None,
        )
    } else {
        // A Ready gateway that is a member of the VM's overlay.
        let gateways: Vec<&NodeRecord> = m.gateways_on(&net.name).filter(ready).collect();
        if gateways.is_empty() {
            return Err(ApiError::Conflict {
                code: "no_gateway",
                message: format!(
                    "no Ready gateway covers network {:?} yet; retry shortly",
                    net.name
                ),
            });
        }
        let pick = gateways[random::index(gateways.len())];
        (
            Transport::Gateway,
            format!("https://{}", pick.gateway.clone().unwrap_or_default()),
            pick.name.clone(),
            Some(vm.mac.to_string()),
            Some(current_gateway_certs(m, &pick.name, now)),
        )
    };
    // The principal's open sessions where this one would go, as that gateway
    // reports them or the relay records them: at the cap it closes some
    // before it gets another. Per carrier, so that what one gateway reports
    // never refuses a session through another (or the relay).
    let cap = state.settings.max_sessions_per_principal;
    if cap > 0 {
        let carrier = match transport {
            Transport::Gateway => audience.as_str(),
            Transport::Relay => otherix_store::RELAY_CARRIER,
        };
        let open = m.open_sessions(&caller.id(), carrier);
        if open >= cap as u64 {
            let through = match transport {
                Transport::Gateway => format!("gateway {audience}"),
                Transport::Relay => "the relay".to_string(),
            };
            return Err(ApiError::TooManyRequests {
                code: "session_cap",
                message: format!(
                    "{} has {open} sessions open through {through}, the most one principal may have ({cap}); close some and retry",
                    caller.id()
                ),
                retry_after: std::time::Duration::from_secs(5),
            });
        }
    }
    Ok(Choice {
        vm: ChosenVm {
            name: vm.name.clone(),
            id: vm.id.clone(),
            ip: vm.ip,
        },
        net: net.name.clone(),
        transport,
        endpoint,
        audience,
        mac,
        gateway_certs,
    })
}

/// A refusal of [`authorize`] as the broker answers (403) and counts it:
/// by its code (`forbidden` for the older refusals, as before).
/// The fingerprints of node `node`'s gateway serving certificates that are
/// current at `now`: issued to it and not revoked (a deletion or a
/// replacement deletes them), not expired. Clients accept no other
/// certificate at its endpoint, whatever name it carries. Empty while the
/// node has not been issued one yet: its gateway is not serving then.
fn current_gateway_certs(m: &Model, node: &str, now: OffsetDateTime) -> Vec<String> {
    let mut fps: Vec<String> = m
        .node_certs(node)
        .filter(|c| c.purpose == otherix_proto::agent::CertPurpose::Gateway.as_str() && c.not_after >= now)
        .map(|c| c.fingerprint.clone())
        .collect();
    fps.sort();
    fps
}

fn denied(d: authorize::Denied) -> ApiError {
    ApiError::Denied {
        code: d.code(),
        message: d.to_string(),
    }
}

/// Picks one backend of load balancer `name` for one connection: the pool
/// is what the selector matches now, minus `exclude` (and, for a `user`,
/// minus what its rules do not allow); P2C among the eligible on Ready
/// nodes, else among the eligible on NotReady ones.
fn choose_backend<'m>(
    state: &AppState,
    m: &'m Model,
    asker: Asker<'_>,
    name: &str,
    port: u16,
    exclude: &std::collections::HashSet<&str>,
    now: OffsetDateTime,
) -> Result<&'m Vm, ApiError> {
    let lb = m
        .lb(name)
        .ok_or_else(|| ApiError::NotFound(format!("load balancer {name:?} not found")))?;
    if port != lb.record.port {
        return Err(ApiError::Invalid(format!(
            "load balancer {name:?} serves port {}, not {port}",
            lb.record.port
        )));
    }
    let verdicts = |vm: &Vm| m.verdict(name, &vm.id);
    // Backends on NotReady nodes only when no other is eligible.
    let ready = |vm: &Vm| crate::lb::node_ready(m, vm, now, state.settings.node_timeout);
    let random = random::pair();
    let window = state.keys.ttl();
    // Drawn at random first: a few lookups, whatever the pool's size.
    let usable = |vm: &Vm| !exclude.contains(vm.name.as_str()) && authorize::reaches(asker, &vm.labels, port);
    if let Some(vm) = crate::lb::draw(
        &lb.record,
        lb.pool.len(),
        |i| m.backend_at(lb, i),
        usable,
        &verdicts,
        &ready,
        &state.recent,
        window,
        now,
        random,
    ) {
        state.recent.record(&vm.id, now, window);
        return Ok(vm);
    }
    // A small or mostly unusable pool: every backend the asker may reach,
    // found by checking each group of same-labelled backends once (an asker
    // whose rules reach none of a big pool costs a few checks, not a walk),
    // and why none when none.
    if lb.pool.is_empty() {
        return Err(ApiError::Unavailable {
            code: "no_backends",
            message: format!(
                "load balancer {name:?} has no backends: selector {:?} matches no VM",
                lb.record.selector
            ),
        });
    }
    let candidates: Vec<&Vm> = m
        .backends_reaching(lb, |labels| authorize::reaches(asker, labels, port))
        .into_iter()
        .filter(|vm| !exclude.contains(vm.name.as_str()))
        .collect();
    let candidates = authorize::backends(asker, name, candidates, |vm| &vm.labels, port).map_err(denied)?;
    match crate::lb::choose(
        &lb.record,
        &candidates,
        &verdicts,
        &ready,
        &state.recent,
        window,
        now,
        random,
    ) {
        Ok(vm) => {
            state.recent.record(&vm.id, now, window);
            Ok(vm)
        }
        Err(views) => {
            let why: Vec<String> = views
                .iter()
                .map(|b| {
                    let probe = b
                        .last_probe
                        .map(|t| {
                            t.format(&time::format_description::well_known::Rfc3339)
                                .unwrap_or_default()
                        })
                        .unwrap_or_else(|| "never probed".into());
                    format!(
                        "{} ({}, last probe {probe}{})",
                        b.vm,
                        b.health,
                        b.reason.as_ref().map(|r| format!(", {r}")).unwrap_or_default()
                    )
                })
                .collect();
            Err(ApiError::Unavailable {
                code: "no_healthy_backend",
                message: format!(
                    "load balancer {name:?} has no healthy backend: {}",
                    why.join("; ")
                ),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_names_or_lb_names_and_refused_ones_are_stored_bounded() {
        assert!(valid_target("web01") && valid_target("lb/web-lb"));
        for bad in ["", "lb/", "Web", "a/b", "web01\n", &"x".repeat(64)] {
            assert!(!valid_target(bad), "{bad:?}");
        }
        assert_eq!(bounded("a\nb"), "\"a\\nb\"");
        let long = bounded(&"y".repeat(65_000));
        assert!(long.len() < 100, "{long}");
        assert!(long.ends_with("... (65000 bytes)"), "{long}");
    }

    #[test]
    fn a_client_is_told_only_the_gateway_certificates_current_for_the_chosen_node() {
        use otherix_store::NodeCertRecord;
        let now = OffsetDateTime::now_utc();
        let cert = |fp: &str, node: &str, purpose: &str, left: i64| NodeCertRecord {
            fingerprint: fp.into(),
            node: node.into(),
            purpose: purpose.into(),
            not_after: now + time::Duration::seconds(left),
        };
        let mut m = Model::build(crate::catalog::Snapshot {
            certs: vec![
                // A renewal under way: both are current.
                cert("sha256:new", "gw1", "gateway", 3_600),
                cert("sha256:old", "gw1", "gateway", 60),
                cert("sha256:expired", "gw1", "gateway", -1),
                // Its other purposes, and another node's gateway.
                cert("sha256:relay", "gw1", "relay", 3_600),
                cert("sha256:client", "gw1", "node", 3_600),
                cert("sha256:other", "gw2", "gateway", 3_600),
            ],
            ..Default::default()
        });
        assert_eq!(
            current_gateway_certs(&m, "gw1", now),
            ["sha256:new", "sha256:old"]
        );
        assert_eq!(current_gateway_certs(&m, "gw2", now), ["sha256:other"]);
        // Never issued one: nothing to accept (the client refuses).
        assert!(current_gateway_certs(&m, "gw3", now).is_empty());
        // Replaced: the store deleted the old machine's certificates.
        m.set_node_certs("gw1", vec![cert("sha256:replacement", "gw1", "node", 3_600)]);
        assert!(current_gateway_certs(&m, "gw1", now).is_empty());
    }
}

/// `POST /v1/vms/{name}/console` (admin): a single-use relay ticket for a
/// QEMU guest's serial console, on whichever network it is. The ticket
/// names [`otherix_proto::relay::CONSOLE_PORT`]: the relay asks the guest's
/// node for its console (`CONSOLE <vm_id>`), never a TCP port, and a ticket
/// for a port never opens a console. Audited as a broker decision for port
/// 0, its session as any relay session (start, end, bytes).
#[utoipa::path(post, path = "/v1/vms/{name}/console", operation_id = "consoleVm", tag = "vms", security(("bearer" = [])),
    request_body = otherix_proto::ConsoleRequest,
    params(("name" = String, Path, description = "The VM's name")),
    responses((status = 200, body = BrokerResponse), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn console(
    State(state): State<AppState>,
    // A user's token: a grant's is refused here, as everywhere but the broker.
    p: crate::auth::Principal,
    headers: http::HeaderMap,
    super::ApiPath(name): super::ApiPath<String>,
    body: Body<otherix_proto::ConsoleRequest>,
) -> Result<Json<BrokerResponse>, ApiError> {
    let now = OffsetDateTime::now_utc();
    // A viewer is refused before anything is looked up, or its body read.
    if p.role == Role::Viewer {
        return Err(ApiError::Forbidden(authorize::Denied::Viewer.to_string()));
    }
    let otherix_proto::ConsoleRequest {} = body.read()?;
    let caller = Caller::User(p);
    let minted = async {
        let claims = console_claims(&state, &caller, &name, now).await?;
        console_ticket(&state, &headers, claims, now)
    }
    .await;
    audit_console(&state, &caller, &name, now, minted).await.map(Json)
}

/// A console opened from the web console's terminal (`console::terminal`):
/// decided and audited exactly as `POST /v1/vms/{name}/console` is, but
/// the claims go straight to the relay rather than out as a ticket.
pub(crate) async fn console_for_terminal(
    state: &AppState,
    caller: &Caller,
    name: &str,
    now: OffsetDateTime,
) -> Result<Claims, ApiError> {
    if let Caller::User(p) = caller {
        if p.role == Role::Viewer {
            return Err(ApiError::Forbidden(authorize::Denied::Viewer.to_string()));
        }
    }
    let decided = console_claims(state, caller, name, now).await;
    audit_console(state, caller, name, now, decided).await
}

/// Whether `caller` may open VM `name`'s serial console, as
/// [`console_claims`] decides it but without a rate limit spent or
/// anything recorded: the pages show the terminal only to those it opens for.
pub(crate) fn console_allowed(state: &AppState, caller: &Caller, name: &str) -> Result<(), ApiError> {
    console_vm(state, caller, name).map(|_| ())
}

/// The broker decision of a console in the audit trail, as port 0. An
/// allowed one goes on only once it is recorded.
async fn audit_console<T>(
    state: &AppState,
    caller: &Caller,
    name: &str,
    now: OffsetDateTime,
    result: Result<T, ApiError>,
) -> Result<T, ApiError> {
    let event = AuditEvent {
        id: 0,
        at: now,
        principal: caller.id(),
        action: AuditAction::Broker,
        target: Some(if valid_target(name) {
            name.to_string()
        } else {
            bounded(name)
        }),
        port: Some(otherix_proto::relay::CONSOLE_PORT),
        transport: result.as_ref().ok().map(|_| Transport::Relay),
        node: None,
        allowed: result.is_ok(),
        reason: result.as_ref().err().map(|e| e.to_string()),
        bytes_up: None,
        bytes_down: None,
        duration_ms: None,
        session: None,
    };
    match result {
        // The ticket leaves (the session opens) only once its decision is
        // in the trail.
        Ok(r) => {
            state
                .audit
                .write(event)
                .await
                .map_err(|e| ApiError::Unavailable {
                    code: "audit_unavailable",
                    message: format!("{e}; no credential was issued"),
                })?;
            tracing::info!(principal = %caller.id(), vm = %bounded(name), "console brokered");
            Ok(r)
        }
        Err(e) => {
            state.audit.record(event);
            tracing::info!(principal = %caller.id(), vm = %bounded(name), reason = %e, "console refused");
            Err(e)
        }
    }
}

/// Who may open VM `name`'s console: an admin, or a user with a rule for
/// the VM that lists the console (port 0) — the console is root's shell on
/// the guest; never a grant. Only QEMU guests have one.
fn console_vm(state: &AppState, caller: &Caller, name: &str) -> Result<otherix_proto::Vm, ApiError> {
    let p = match caller {
        Caller::Grant(g) => return Err(no_console_for(g)),
        Caller::User(p) => p,
    };
    if !valid_target(name) || name.starts_with("lb/") {
        return Err(ApiError::Invalid(format!("invalid VM name {}", bounded(name))));
    }
    let m = state.catalog.read();
    let vm = m
        .vm_by_name(name)
        .cloned()
        .ok_or_else(|| ApiError::NotFound(format!("vm {name:?} not found")))?;
    let no_rules: &[Rule] = &[];
    let asker = Asker::User {
        name: &p.name,
        role: p.role,
        rules: m.user(&p.name).map_or(no_rules, |u| u.rules.as_slice()),
    };
    if p.role == Role::Viewer {
        return Err(ApiError::Forbidden(authorize::Denied::Viewer.to_string()));
    }
    if p.role != Role::Admin && authorize::vm(asker, &vm, otherix_proto::relay::CONSOLE_PORT).is_err() {
        return Err(ApiError::Forbidden(format!(
            "{} has no access rule for the serial console of vm {name:?} (an admin grants it: otherix user allow {} --selector ... --ports console)",
            p.name, p.name
        )));
    }
    if vm.machine.is_none() {
        return Err(ApiError::Invalid(format!(
            "vm {name:?} is a netns guest: only QEMU guests (--runtime qemu) have a serial console"
        )));
    }
    Ok(vm)
}

/// No grant opens a console: its holder gets exactly its targets' ports.
fn no_console_for(g: &crate::auth::GrantCaller) -> ApiError {
    ApiError::Forbidden(format!("grant {:?} does not open serial consoles", g.name))
}

/// The claims of a console session of `caller` on VM `name`: the broker's
/// rate limit, [`console_vm`]'s rules, a placed VM, and access not revoked.
async fn console_claims(
    state: &AppState,
    caller: &Caller,
    name: &str,
    now: OffsetDateTime,
) -> Result<Claims, ApiError> {
    if let Caller::Grant(g) = caller {
        return Err(no_console_for(g));
    }
    if let Err(refused) = state.limits.check(&caller.id(), now) {
        return Err(ApiError::TooManyRequests {
            code: "rate_limited",
            message: format!("{} is over its broker rate limit; retry shortly", caller.id()),
            retry_after: refused.limited.retry_after,
        });
    }
    if !valid_target(name) || name.starts_with("lb/") {
        return Err(ApiError::Invalid(format!("invalid VM name {}", bounded(name))));
    }
    may_mint(state).await?;
    let vm = console_vm(state, caller, name)?;
    if vm.node.is_none() {
        return Err(ApiError::Conflict {
            code: "not_placed",
            message: format!("vm {name:?} is not placed on a node yet"),
        });
    }
    let Caller::User(p) = caller else {
        unreachable!("console_vm refuses grants");
    };
    let claims = Claims {
        iss: state.info.cluster_id.clone(),
        aud: otherix_proto::relay::AUDIENCE.to_string(),
        sub: caller.id(),
        tok: Some(p.token_id.clone()),
        jti: random::long_id(),
        iat: now,
        nbf: now,
        exp: now + state.keys.ttl(),
        vm: vm.name.clone(),
        vm_id: vm.id.clone(),
        net: vm.network.clone(),
        mac: None,
        ip: vm.ip.to_string(),
        port: otherix_proto::relay::CONSOLE_PORT,
        until: None,
    };
    not_revoked(state, &claims, || claims.vm.clone())?;
    Ok(claims)
}

/// `claims` signed into a ticket for `/v1/relay` on this CP.
fn console_ticket(
    state: &AppState,
    headers: &http::HeaderMap,
    claims: Claims,
    now: OffsetDateTime,
) -> Result<BrokerResponse, ApiError> {
    let key = state
        .keys
        .current(now)
        .ok_or_else(|| ApiError::Internal("no session signing key loaded".into()))?;
    let host = headers
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("control-plane");
    let credential = key.mint(&claims).map_err(|e| ApiError::Internal(e.to_string()))?;
    let expires_in = std::time::Duration::try_from(claims.exp - now).unwrap_or_default();
    Ok(BrokerResponse {
        node: None,
        transport: Transport::Relay,
        endpoint: format!("wss://{host}{}", otherix_proto::relay::PATH),
        credential,
        expires_in_ms: Some(u64::try_from(expires_in.as_millis()).unwrap_or(u64::MAX)),
        expires_at: claims.exp,
        vm: claims.vm,
        port: otherix_proto::relay::CONSOLE_PORT,
        budgeted: false,
        gateway_certs: None,
    })
}
