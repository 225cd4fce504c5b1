//! Taking access away ends the access: what a revoked grant or token, a
//! deleted user or a removed access rule revokes, and getting it to the
//! places that hold sessions.
//!
//! A change that takes access away writes [`Revocation`]s in its own store
//! transaction. Gateways get them in their desired state (the agents are
//! woken at once), refuse the credentials they cover and end the sessions
//! opened with them, reporting reason `revoked`; the relay, which runs here,
//! ends its covered sessions at once and refuses covered tickets. A
//! revocation is kept until every credential it covers has expired.
//!
//! **No window.** A revocation covers credentials issued (`iat`) up to its
//! instant, `before`. Every replica mints only from a catalog that holds
//! every change committed until [`MINT_LAG`] before it reads, with a clock
//! within [`REPLICA_SKEW`] of the others' (see the broker). So a replica
//! that has not applied a revocation yet can only issue credentials
//! stamped before the revocation's commit + `MINT_LAG` + `REPLICA_SKEW`:
//! [`stamp`] puts `before` that far ahead of the transaction, plus
//! [`COMMIT_BUDGET`] for the commit itself, and [`enforce`] — once the
//! commit is in and this catalog has applied it — records the entries
//! again with a later instant if the commit took longer than that. When
//! the API call returns, no replica mints for the revoked access any more,
//! every credential minted before is covered, and the Ready gateways hold
//! the list ([`enforce`] waits for them).

use std::time::Duration;

use otherix_core::credential::{CLOCK_SKEW, DEFAULT_MAX_LIFETIME};
use otherix_core::selector::Selector;
use otherix_proto::agent::Revocation;
use otherix_proto::{AccessRule, Vm};
use otherix_store::{AuditEvent, Revoking};
use time::OffsetDateTime;

use crate::authorize::Rule;
use crate::catalog::MINT_LAG;
use crate::clock::REPLICA_SKEW;
use crate::state::AppState;

/// Room for the revoking transaction to wait for the write lock and
/// commit, within the instant stamped before it; a commit that takes
/// longer is covered by recording the entries again (see [`enforce`]).
pub const COMMIT_BUDGET: Duration = Duration::from_secs(2);
/// How long a revocation waits for the Ready gateways to hold it before
/// it answers anyway (a gateway that does not answer in time is logged
/// and counted; it refuses the covered credentials from its next
/// heartbeat on).
pub const GATEWAY_ACK_WAIT: Duration = Duration::from_secs(5);

/// A rule removal that takes away more targets than this revokes all the
/// user's credentials and sessions instead of one entry per target (the
/// user brokers again for what other rules still allow).
pub const MAX_TARGETS_PER_RULE: usize = 256;

/// What a replica that has not applied a revocation committed at `t` may
/// still stamp: on PostgreSQL, `t` plus the catalog's lag bound and the
/// replicas' skew; on SQLite, whose one catalog applied it at `t`, `t`.
fn reach(state: &AppState, t: OffsetDateTime) -> OffsetDateTime {
    match state.store.dialect() {
        otherix_store::Dialect::Sqlite => t,
        otherix_store::Dialect::Postgres => t + MINT_LAG + REPLICA_SKEW,
    }
}

/// The instant a revocation made at `now` (before its transaction) covers
/// up to, while it commits: what any replica may still mint until the
/// commit is everywhere, on either store. [`enforce`] restamps it once the
/// commit is in: to the exact bound, earlier than this unless the commit
/// took longer than [`COMMIT_BUDGET`].
pub fn stamp(now: OffsetDateTime) -> OffsetDateTime {
    now + MINT_LAG + REPLICA_SKEW + COMMIT_BUDGET
}

/// Until when revocations covering up to `before` are kept: past the life
/// of any credential issued before then (the broker's TTL, or the longest a
/// gateway accepts, whichever is longer) and the clock skew gateways
/// tolerate.
pub fn keep_until(state: &AppState, before: OffsetDateTime) -> OffsetDateTime {
    before + state.settings.credential_ttl.max(DEFAULT_MAX_LIFETIME) + CLOCK_SKEW
}

/// Everything `principal` was issued up to `now`.
pub fn all_of(principal: String, now: OffsetDateTime) -> Revocation {
    Revocation {
        principal,
        token: None,
        vm_id: None,
        port: None,
        session: None,
        before: now,
    }
}

/// Everything user `user` brokered with API token `token` up to `now`.
pub fn token_of(user: &str, token: &str, now: OffsetDateTime) -> Revocation {
    Revocation {
        token: Some(token.to_string()),
        ..all_of(format!("user:{user}"), now)
    }
}

/// What removing `removed` from user `user` takes away, given the rules
/// that stay and the VMs there are: one entry per `(VM, port)` the removed
/// rule allowed and no remaining rule does. More than
/// [`MAX_TARGETS_PER_RULE`] collapse into one entry for all of the user's
/// access (see there).
pub fn rule_removal(
    user: &str,
    removed: &AccessRule,
    remaining: &[AccessRule],
    vms: &[Vm],
    now: OffsetDateTime,
) -> Vec<Revocation> {
    let principal = format!("user:{user}");
    // A rule whose selector no longer parses allowed nothing; one of the
    // remaining that does not parse allows nothing either. The removed
    // rule counts with what its selector matches even when it requires no
    // label and so allows nothing now: a control plane from before that
    // refusal may have minted with it (taking away too much is safe), while
    // a remaining such rule keeps nothing.
    let Ok(selector) = removed.selector.parse::<Selector>() else {
        return Vec::new();
    };
    let remaining: Vec<Rule> = remaining.iter().filter_map(Rule::compile).collect();
    let mut out = Vec::new();
    for vm in vms.iter().filter(|vm| selector.matches(&vm.labels)) {
        for &port in &removed.ports {
            let still = remaining.iter().any(|r| r.allows(&vm.labels, port));
            if !still {
                if out.len() == MAX_TARGETS_PER_RULE {
                    return vec![all_of(principal, now)];
                }
                out.push(Revocation {
                    vm_id: Some(vm.id.clone()),
                    port: Some(port),
                    ..all_of(principal.clone(), now)
                });
            }
        }
    }
    out
}

/// The store's side of a change: the entries and how long they are kept
/// (past the latest instant among them).
pub fn recording<'a>(state: &AppState, entries: &'a [Revocation], before: OffsetDateTime) -> Revoking<'a> {
    let latest = entries
        .iter()
        .map(|r| r.before)
        .max()
        .unwrap_or(before)
        .max(before);
    Revoking {
        entries,
        keep_until: keep_until(state, latest),
    }
}

/// After the change is committed: restamps the `recorded` entries to cover
/// exactly what any replica minted until the commit was everywhere (later
/// than first recorded if the commit took longer than [`COMMIT_BUDGET`]),
/// ends the covered relay sessions here, waits (at most
/// [`GATEWAY_ACK_WAIT`]) for the Ready gateways to hold the list, and
/// audits the change (who took what away, and how many relay sessions it
/// ended at once; gateway sessions are audited as they end).
pub async fn enforce(state: &AppState, by: String, what: &str, subject: &str, recorded: &[Revocation]) {
    // This catalog applied the change (the broker here mints no more for
    // it); from now, no replica applies it later than `reach(now)`: the
    // instant every entry must cover, no more (a principal re-created, or
    // a rule given back, right after is not refused for longer than that).
    if let Err(e) = state.catalog.sync().await {
        tracing::warn!(error = %e, "catalog did not catch up after a revocation");
    }
    let exact = reach(state, OffsetDateTime::now_utc());
    let mut entries = recorded.to_vec();
    if entries.iter().any(|r| r.before < exact) {
        metrics::counter!("otherix_revocations_late_total").increment(1);
        tracing::warn!(
            subject,
            "a revocation's commit took longer than its budget; recording it with a later instant"
        );
    }
    for r in &mut entries {
        r.before = exact;
    }
    match state
        .store
        .restamp_revocations(recorded, recording(state, &entries, exact))
        .await
    {
        Ok(()) => {
            if let Err(e) = state.catalog.sync().await {
                tracing::warn!(error = %e, "catalog did not catch up after a revocation");
            }
        }
        Err(e) => {
            // The entries as first recorded stay, covering a little more.
            tracing::warn!(error = %e, subject, "cannot restamp a revocation; it stays as recorded");
            entries = recorded.to_vec();
        }
    }
    let in_force = state.catalog.read().revocations().to_vec();
    let ended = state.relay.set_revocations(in_force);
    // Relay sessions waiting for a resume end now too, on their nodes.
    crate::relay_resume::end_revoked_waiting(state, &entries);
    let unacked = gateways_hold(state).await;
    tracing::info!(by = %by, subject, revocations = entries.len(), relay_sessions = ended, "{what}");
    let event = AuditEvent {
        id: 0,
        at: OffsetDateTime::now_utc(),
        principal: by,
        action: otherix_proto::AuditAction::Revoke,
        target: Some(subject.to_string()),
        port: None,
        transport: None,
        node: None,
        allowed: true,
        reason: Some(format!(
            "{what}: {} revocation{}; {}{}",
            entries.len(),
            if entries.len() == 1 { "" } else { "s" },
            if entries.iter().all(Revocation::is_one_session) {
                "the session ends with reason ended by an admin"
            } else {
                "its sessions end with reason revoked"
            },
            if unacked.is_empty() {
                String::new()
            } else {
                format!("; not yet held by gateway(s) {}", unacked.join(", "))
            }
        )),
        bytes_up: None,
        bytes_down: None,
        duration_ms: None,
        session: None,
    };
    if let Err(e) = state.audit.write(event).await {
        tracing::error!(error = %e, "audit write failed");
    }
}

/// Waits until every Ready gateway has applied its current desired state
/// (which holds the revocations just made), for at most
/// [`GATEWAY_ACK_WAIT`]. Agents heartbeat again at once after an answer
/// that changed their revocations, so this is a round trip or two.
/// Returns the gateways that did not in time.
async fn gateways_hold(state: &AppState) -> Vec<String> {
    let started = std::time::Instant::now();
    loop {
        let behind = state
            .catalog
            .gateways_behind(OffsetDateTime::now_utc(), state.settings.node_timeout);
        if behind.is_empty() {
            metrics::histogram!("otherix_revocation_gateway_wait_seconds")
                .record(started.elapsed().as_secs_f64());
            return behind;
        }
        if started.elapsed() >= GATEWAY_ACK_WAIT {
            metrics::counter!("otherix_revocations_unacknowledged_total").increment(1);
            tracing::warn!(
                gateways = %behind.join(","),
                "revocation not yet acknowledged by every Ready gateway after {}s; they refuse its credentials from their next heartbeat",
                GATEWAY_ACK_WAIT.as_secs()
            );
            return behind;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn vm(id: &str, labels: &[(&str, &str)]) -> Vm {
        Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: id.into(),
            id: id.into(),
            network: "lan".into(),
            node: None,
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            mac: "02:00:00:00:00:01".parse().unwrap(),
            ip: "10.0.0.2".parse().unwrap(),
            state: otherix_proto::VmState::Running,
            reason: None,
            exec: None,
            migrate_to: None,
            created_at: OffsetDateTime::now_utc(),
        }
    }

    fn rule(id: i64, selector: &str, ports: &[u16]) -> AccessRule {
        AccessRule {
            id,
            selector: selector.into(),
            ports: ports.to_vec(),
            inert: None,
        }
    }

    #[test]
    fn a_removed_rule_revokes_only_what_no_other_rule_still_allows() {
        let now = OffsetDateTime::now_utc();
        let vms = [
            vm("web1", &[("app", "web")]),
            vm("web2", &[("app", "web"), ("env", "prod")]),
            vm("db1", &[("app", "db")]),
        ];
        let removed = rule(1, "app=web", &[22, 80]);
        // Port 80 of production web VMs stays allowed by another rule.
        let remaining = [rule(2, "env=prod", &[80])];
        let got: Vec<(String, u16)> = rule_removal("alice", &removed, &remaining, &vms, now)
            .into_iter()
            .map(|r| {
                assert_eq!(
                    (r.principal.as_str(), r.token.as_deref(), r.before),
                    ("user:alice", None, now)
                );
                (r.vm_id.unwrap(), r.port.unwrap())
            })
            .collect();
        assert_eq!(
            got,
            [("web1".into(), 22), ("web1".into(), 80), ("web2".into(), 22)]
        );
    }

    #[test]
    fn rules_that_require_no_label_keep_nothing_but_take_away_what_they_matched() {
        let now = OffsetDateTime::now_utc();
        let vms = [vm("bare1", &[]), vm("web1", &[("app", "web")])];
        let targets = |removed: &AccessRule, remaining: &[AccessRule]| -> Vec<(String, u16)> {
            rule_removal("alice", removed, remaining, &vms, now)
                .into_iter()
                .map(|r| (r.vm_id.unwrap(), r.port.unwrap()))
                .collect()
        };
        // A remaining `env!=prod` allows nothing, so it keeps nothing.
        assert_eq!(
            targets(&rule(1, "app=web", &[22]), &[rule(2, "env!=prod", &[22])]),
            [("web1".to_string(), 22)]
        );
        // Removing one takes away what an older control plane let it reach.
        assert_eq!(
            targets(&rule(2, "env!=prod", &[22]), &[]),
            [("bare1".to_string(), 22), ("web1".to_string(), 22)]
        );
    }

    #[test]
    fn a_rule_taking_away_many_targets_revokes_all_of_the_users_access() {
        let now = OffsetDateTime::now_utc();
        let vms: Vec<Vm> = (0..MAX_TARGETS_PER_RULE + 1)
            .map(|i| vm(&format!("vm{i}"), &[("app", "web")]))
            .collect();
        let got = rule_removal("alice", &rule(1, "app=web", &[22]), &[], &vms, now);
        assert_eq!(got, [all_of("user:alice".into(), now)]);
        let just = &vms[..MAX_TARGETS_PER_RULE];
        assert_eq!(
            rule_removal("alice", &rule(1, "app=web", &[22]), &[], just, now).len(),
            MAX_TARGETS_PER_RULE
        );
    }
}
