//! `POST /v1/broker`: who may reach which `(VM, port)`, through which
//! gateway, with which single-use credential. Every decision is audited.

use axum::extract::State;
use axum::Json;
use otherix_core::credential::Claims;
use otherix_proto::{
    AuditAction, BrokerRequest, BrokerResponse, ErrorBody, NetworkType, Role, Transport, Vm, VmState,
};
use otherix_store::{AuditEvent, GrantUse};
use time::OffsetDateTime;

use super::ApiJson;
use crate::auth::Caller;
use crate::authorize::{self, Asker, Rule};
use crate::desired;
use crate::error::ApiError;
use crate::random;
use crate::state::AppState;

#[utoipa::path(post, path = "/v1/broker", tag = "broker", security(("bearer" = [])), request_body = BrokerRequest,
    responses((status = 200, body = BrokerResponse), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn broker(
    State(state): State<AppState>,
    caller: Caller,
    headers: http::HeaderMap,
    ApiJson(req): ApiJson<BrokerRequest>,
) -> Result<Json<BrokerResponse>, ApiError> {
    let now = OffsetDateTime::now_utc();
    let started = std::time::Instant::now();
    // Only used to tell the client where the relay is: the CP it is
    // already talking to. Never a dial target.
    let host = headers.get(http::header::HOST).and_then(|h| h.to_str().ok());
    // Checked before anything else, and stored bounded: an unvalidated
    // target (up to the body limit) must not reach the audit trail as is.
    let target_ok = valid_target(&req.target);
    let audited = |result: Result<&BrokerResponse, String>| AuditEvent {
        id: 0,
        at: now,
        principal: caller.id(),
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
    if let Err(refused) = state.limits.check(&caller.id(), now) {
        metrics::counter!("otherix_broker_decisions_total", "outcome" => "refused", "reason" => "rate_limited")
            .increment(1);
        if refused.audit {
            tracing::info!(principal = %caller.id(), "broker rate limit hit");
            let reason = "rate limited (further refusals this minute are counted, not audited)";
            audit(&state, audited(Err(reason.into())));
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
    let result = if target_ok {
        decide(&state, &caller, &req, host, now).await
    } else {
        Err(ApiError::Invalid(format!(
            "invalid target {}: expected a VM name or lb/NAME (a DNS label)",
            bounded(&req.target)
        )))
    };
    audit(&state, audited(result.as_ref().map_err(|e| e.to_string())));
    match &result {
        Ok(r) => {
            metrics::counter!("otherix_broker_decisions_total", "outcome" => "allowed", "reason" => "")
                .increment(1);
            metrics::counter!("otherix_credentials_minted_total", "transport" => r.transport.as_str())
                .increment(1);
            tracing::info!(principal = %caller.id(), vm = %r.vm, port = r.port, endpoint = %r.endpoint, "brokered")
        }
        Err(e) => {
            metrics::counter!("otherix_broker_decisions_total", "outcome" => "refused", "reason" => e.code())
                .increment(1);
            tracing::info!(principal = %caller.id(), target = %bounded(&req.target), port = req.port, reason = %e, "broker refused")
        }
    }
    metrics::histogram!("otherix_broker_duration_seconds").record(started.elapsed().as_secs_f64());
    result.map(Json)
}

/// Writes a broker decision to the audit trail on a task of its own: the
/// audit write never holds up or fails a connection.
fn audit(state: &AppState, event: AuditEvent) {
    let store = state.store.clone();
    tokio::spawn(async move {
        if let Err(e) = store.add_audit_event(&event).await {
            tracing::error!(error = %e, "audit write failed");
        }
    });
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
    // The principal's open sessions, as gateways report them and the relay
    // records them: at the cap it closes some before it gets another.
    let cap = state.settings.max_sessions_per_principal;
    if cap > 0 {
        let open = state.store.open_session_count(&caller.id()).await?;
        if open >= cap as u64 {
            return Err(ApiError::TooManyRequests {
                code: "session_cap",
                message: format!(
                    "{} has {open} sessions open, the most one principal may have ({cap}); close some and retry",
                    caller.id()
                ),
                retry_after: std::time::Duration::from_secs(5),
            });
        }
    }
    let port = u16::try_from(req.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| ApiError::Invalid(format!("port {} is out of range 1-65535", req.port)))?;
    // What the caller was given: a user's rules, a grant's targets.
    let (rules, targets) = match caller {
        Caller::User(p) if p.role == Role::User => (compiled_rules(state, &p.name).await?, vec![]),
        Caller::User(_) => (vec![], vec![]),
        Caller::Grant(g) => {
            let grant = state
                .store
                .grant_by_id(&g.id)
                .await?
                .ok_or_else(|| ApiError::Unauthenticated("invalid grant token".into()))?;
            (vec![], grant.targets)
        }
    };
    let asker = match caller {
        Caller::User(p) => Asker::User {
            name: &p.name,
            role: p.role,
            rules: &rules,
        },
        Caller::Grant(g) => Asker::Grant {
            name: &g.name,
            targets: &targets,
        },
    };
    authorize::request(asker, &req.target, port).map_err(denied)?;
    let vm = match req.target.strip_prefix("lb/") {
        Some(lb) => choose_backend(state, asker, lb, port, &req.exclude, now).await?,
        None => {
            let vm = state.store.vm(&req.target).await?;
            authorize::vm(asker, &vm.name, &vm.labels, port).map_err(denied)?;
            vm
        }
    };
    if vm.state != VmState::Running {
        return Err(ApiError::Conflict {
            code: "vm_not_running",
            message: format!("vm {:?} is {}, not running", vm.name, vm.state),
        });
    }
    // Only what the choice below reads (not the whole desired-state snapshot:
    // every VM, LB and key would be loaded per credential).
    let net = state.store.network(&vm.network).await?;
    let nodes = state.store.nodes().await?;
    // Where the client connects, and who must accept the credential there.
    let (transport, endpoint, audience, mac) = if net.kind == NetworkType::Bridge {
        // No gateway shares a bridge's L2: the CP relays, through the node
        // that owns the bridge.
        let owner = nodes.iter().find(|n| Some(&n.name) == vm.node.as_ref());
        if !owner.is_some_and(|n| {
            n.relay_endpoint().is_some() && desired::is_ready(n, now, state.settings.node_timeout)
        }) {
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
        )
    } else {
        // A Ready gateway that is a member of the VM's overlay.
        let leases = state.store.node_leases().await?;
        let gateways: Vec<_> = nodes
            .iter()
            .filter(|n| n.gateway.is_some() && desired::is_ready(n, now, state.settings.node_timeout))
            .filter(|n| leases.iter().any(|l| l.node == n.name && l.network == net.name))
            .collect();
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
        )
    };
    if let Caller::Grant(g) = caller {
        // Counted last, atomically with the cap: refusals above cost nothing.
        match state.store.use_grant(&g.id, now).await? {
            GrantUse::Counted => {}
            GrantUse::Revoked => return Err(ApiError::Forbidden(format!("grant {:?} was revoked", g.name))),
            GrantUse::Expired => return Err(ApiError::Forbidden(format!("grant {:?} has expired", g.name))),
            GrantUse::CapReached => {
                return Err(ApiError::Forbidden(format!(
                    "grant {:?} has used all its connections",
                    g.name
                )))
            }
        }
    }
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
        vm_id: vm.id.clone(),
        net: net.name.clone(),
        mac,
        ip: vm.ip.to_string(),
        port,
    };
    let gateway_node = (transport == Transport::Gateway).then(|| claims.aud.clone());
    let credential = key.mint(&claims).map_err(|e| ApiError::Internal(e.to_string()))?;
    Ok(BrokerResponse {
        node: gateway_node,
        transport,
        endpoint,
        credential,
        expires_at: claims.exp,
        vm: vm.name,
        port,
    })
}

/// A user's access rules, compiled.
async fn compiled_rules(state: &AppState, user: &str) -> Result<Vec<Rule>, ApiError> {
    Ok(state
        .store
        .rules(user)
        .await?
        .iter()
        .filter_map(Rule::compile)
        .collect())
}

fn denied(d: authorize::Denied) -> ApiError {
    ApiError::Forbidden(d.to_string())
}

/// Picks one backend of load balancer `name` for one connection: the pool
/// is what the selector matches now, minus `exclude` (and, for a `user`,
/// minus what its rules do not allow); P2C among the eligible.
async fn choose_backend(
    state: &AppState,
    asker: Asker<'_>,
    name: &str,
    port: u16,
    exclude: &[String],
    now: OffsetDateTime,
) -> Result<Vm, ApiError> {
    let lb = state.store.lb(name).await?;
    if port != lb.port {
        return Err(ApiError::Invalid(format!(
            "load balancer {name:?} serves port {}, not {port}",
            lb.port
        )));
    }
    let vms = state.store.vms().await?;
    let pool = crate::lb::pool(&lb, &vms);
    if pool.is_empty() {
        return Err(ApiError::Unavailable {
            code: "no_backends",
            message: format!(
                "load balancer {name:?} has no backends: selector {:?} matches no VM",
                lb.selector
            ),
        });
    }
    let candidates: Vec<&Vm> = pool
        .into_iter()
        .filter(|vm| !exclude.contains(&vm.name))
        .collect();
    let candidates = authorize::backends(asker, name, candidates, |vm| &vm.labels, port).map_err(denied)?;
    let verdicts = state.store.verdicts().await?;
    let random = random::pair();
    let window = state.keys.ttl();
    match crate::lb::choose(&lb, &candidates, &verdicts, &state.recent, window, now, random) {
        Ok(vm) => {
            state.recent.record(&vm.id, now);
            Ok(vm.clone())
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
}
