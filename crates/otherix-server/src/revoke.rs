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

use otherix_core::credential::{CLOCK_SKEW, DEFAULT_MAX_LIFETIME};
use otherix_core::selector::Selector;
use otherix_proto::agent::Revocation;
use otherix_proto::{AccessRule, Vm};
use otherix_store::{AuditEvent, Revoking};
use time::OffsetDateTime;

use crate::authorize::Rule;
use crate::state::AppState;

/// A rule removal that takes away more targets than this revokes all the
/// user's credentials and sessions instead of one entry per target (the
/// user brokers again for what other rules still allow).
pub const MAX_TARGETS_PER_RULE: usize = 256;

/// Until when revocations made at `now` are kept: past the life of any
/// credential issued before them (the broker's TTL, or the longest a gateway
/// accepts, whichever is longer) and the clock skew gateways tolerate.
pub fn keep_until(state: &AppState, now: OffsetDateTime) -> OffsetDateTime {
    now + state.settings.credential_ttl.max(DEFAULT_MAX_LIFETIME) + CLOCK_SKEW
}

/// Everything `principal` was issued up to `now`.
pub fn all_of(principal: String, now: OffsetDateTime) -> Revocation {
    Revocation {
        principal,
        token: None,
        vm_id: None,
        port: None,
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

/// The store's side of a change: the entries and how long they are kept.
pub fn recording<'a>(state: &AppState, entries: &'a [Revocation], now: OffsetDateTime) -> Revoking<'a> {
    Revoking {
        entries,
        keep_until: keep_until(state, now),
    }
}

/// After the change is committed: ends the covered relay sessions here,
/// wakes the agents so gateways get the list within a round trip, and
/// audits the change (who took what away, and how many relay sessions it
/// ended at once; gateway sessions are audited as they end).
pub async fn enforce(state: &AppState, by: String, what: &str, subject: &str, entries: &[Revocation]) {
    let ended = state.relay.revoke(entries);
    if let Err(e) = state.catalog.sync().await {
        tracing::warn!(error = %e, "catalog did not catch up after a revocation");
    }
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
            "{what}: {} revocation{}; its sessions end with reason revoked",
            entries.len(),
            if entries.len() == 1 { "" } else { "s" }
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn vm(id: &str, labels: &[(&str, &str)]) -> Vm {
        Vm {
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
