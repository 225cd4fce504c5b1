//! Who may broker what (DESIGN §4, §8): pure policy, no store. The broker
//! reads the caller's role, access rules or grant, and the VM, and asks
//! here; every decision is a table test below.
//!
//! - `admin`: any target.
//! - `user`: a VM whose labels one of its rules' selectors matches, on a
//!   port that rule lists; through a load balancer, only such backends. A
//!   rule whose selector requires no label (stored before such rules were
//!   refused) allows nothing: it would admit VMs that merely lack labels.
//! - `viewer`: nothing.
//! - a grant: exactly its listed `(target, port)` pairs, where the target is
//!   a VM name or `lb/NAME` as written in the grant; a VM target only while
//!   the VM under that name is the one the grant was made for (its id).

use otherix_core::selector::Selector;
use otherix_core::Labels;
use otherix_proto::{AccessRule, GrantTarget, Role, Vm};

/// An access rule with its selector parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub id: i64,
    pub selector: Selector,
    pub ports: Vec<u16>,
    /// The selector requires no label: a rule stored before `allow`
    /// refused those. It allows nothing (failing closed rather than
    /// admitting every VM created without labels), and a refusal it would
    /// have allowed says so, so that an admin replaces it.
    pub inert: bool,
}

impl Rule {
    /// The rule as stored; `None` for a selector that no longer parses
    /// (stored rules were checked when made), which allows nothing.
    pub fn compile(rule: &AccessRule) -> Option<Rule> {
        let selector: Selector = rule.selector.parse().ok()?;
        Some(Rule {
            id: rule.id,
            inert: !selector.requires_a_label(),
            selector,
            ports: rule.ports.clone(),
        })
    }

    /// Whether the rule lets its user reach a VM labelled `labels` on `port`.
    pub fn allows(&self, labels: &Labels, port: u16) -> bool {
        !self.inert && self.ports.contains(&port) && self.selector.matches(labels)
    }

    /// Why a stored rule allows nothing, for `user get`; `None` for a rule
    /// in force.
    pub fn why_inert(rule: &AccessRule) -> Option<String> {
        match rule.selector.parse::<Selector>() {
            Err(e) => Some(format!("allows nothing: {e}")),
            Ok(s) => s
                .require_label()
                .err()
                .map(|e| format!("allows nothing: {e}; replace it with a rule that requires a label")),
        }
    }
}

/// Who asks, with what they were given.
#[derive(Debug, Clone, Copy)]
pub enum Asker<'a> {
    User {
        name: &'a str,
        role: Role,
        rules: &'a [Rule],
    },
    Grant {
        name: &'a str,
        targets: &'a [GrantTarget],
    },
}

/// Why a request is refused (all 403 at the broker, each with its
/// [code](Denied::code)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denied {
    #[error("role viewer may not broker connections")]
    Viewer,
    #[error("grant {grant:?} does not include {target}:{port}")]
    NotInGrant {
        grant: String,
        target: String,
        port: u16,
    },
    #[error("user {user:?} may not reach {vm}:{port}; no access rule allows it")]
    NoRule { user: String, vm: String, port: u16 },
    /// Only a rule that requires no label would have allowed it.
    #[error(
        "user {user:?} may not reach {vm}:{port}: rule {rule} (`{selector}`) requires no label, \
         so it allows nothing; an admin must replace it with a rule that requires a label"
    )]
    InertRule {
        user: String,
        vm: String,
        port: u16,
        rule: i64,
        selector: String,
    },
    /// The VM under the grant's name is not the one the grant was made for.
    #[error(
        "grant {grant:?} was made for another VM named {vm} (deleted since); \
         ask for a new grant to reach this one"
    )]
    GrantForAnotherVm { grant: String, vm: String },
    /// A grant from before grants were bound to VM ids, whose VM was gone
    /// when the store was upgraded: which VM it meant is unknown.
    #[error(
        "grant {grant:?} names {vm}, which did not exist when grants were bound to VM ids; \
         ask for a new grant"
    )]
    GrantVmUnknown { grant: String, vm: String },
    #[error("user {user:?} may not reach any backend of load balancer {lb:?} on port {port}")]
    NoBackend { user: String, lb: String, port: u16 },
}

impl Denied {
    /// The stable code the broker answers and counts the refusal by: the
    /// CLI's hint follows it (a role, a rule, a grant's scope each have
    /// their own remedy).
    pub fn code(&self) -> &'static str {
        match self {
            Denied::Viewer => "forbidden",
            Denied::NotInGrant { .. } => "not_in_grant",
            Denied::NoRule { .. } | Denied::NoBackend { .. } => "no_access_rule",
            Denied::InertRule { .. } => "rule_requires_no_label",
            Denied::GrantForAnotherVm { .. } => "grant_vm_replaced",
            Denied::GrantVmUnknown { .. } => "grant_vm_unknown",
        }
    }
}

/// The first check, before any VM is looked up: may `asker` ask for
/// `target` (a VM name or `lb/NAME`, as requested) on `port` at all?
pub fn request(asker: Asker<'_>, target: &str, port: u16) -> Result<(), Denied> {
    match asker {
        Asker::User {
            role: Role::Viewer, ..
        } => Err(Denied::Viewer),
        Asker::User { .. } => Ok(()),
        Asker::Grant { name, targets } => {
            if targets.iter().any(|t| t.target == target && t.port == port) {
                Ok(())
            } else {
                Err(Denied::NotInGrant {
                    grant: name.to_string(),
                    target: target.to_string(),
                    port,
                })
            }
        }
    }
}

/// Whether `asker` may reach a VM labelled `labels` on `port`, once
/// [`request`] allowed the request. Only a `user`'s rules narrow it: an
/// admin reaches anything, a grant what it lists.
pub fn reaches(asker: Asker<'_>, labels: &Labels, port: u16) -> bool {
    match asker {
        Asker::User {
            role: Role::User,
            rules,
            ..
        } => rules.iter().any(|r| r.allows(labels, port)),
        Asker::User {
            role: Role::Admin, ..
        }
        | Asker::Grant { .. } => true,
        Asker::User {
            role: Role::Viewer, ..
        } => false,
    }
}

/// [`reaches`] for one VM, as a refusal naming it; for a grant, whether the
/// VM is the one the grant was made for.
pub fn vm(asker: Asker<'_>, vm: &Vm, port: u16) -> Result<(), Denied> {
    match asker {
        Asker::Grant { name, targets } => grant_vm(name, targets, vm, port),
        Asker::User { .. } if reaches(asker, &vm.labels, port) => Ok(()),
        // A viewer was refused by `request` already.
        Asker::User { name, rules, .. } => Err(
            match rules
                .iter()
                .find(|r| r.inert && r.ports.contains(&port) && r.selector.matches(&vm.labels))
            {
                Some(inert) => Denied::InertRule {
                    user: name.to_string(),
                    vm: vm.name.clone(),
                    port,
                    rule: inert.id,
                    selector: inert.selector.to_string(),
                },
                None => Denied::NoRule {
                    user: name.to_string(),
                    vm: vm.name.clone(),
                    port,
                },
            },
        ),
    }
}

/// A grant reaches a VM it lists by name only while that name is the VM
/// the grant was made for: one deleted and re-created under the name is
/// another VM, which the grant's holder was never given.
fn grant_vm(grant: &str, targets: &[GrantTarget], vm: &Vm, port: u16) -> Result<(), Denied> {
    let listed = targets.iter().filter(|t| t.target == vm.name && t.port == port);
    let mut outcome = Err(Denied::NotInGrant {
        grant: grant.to_string(),
        target: vm.name.clone(),
        port,
    });
    for t in listed {
        outcome = match t.vm_id.as_deref() {
            Some(id) if id == vm.id => return Ok(()),
            Some(_) => Err(Denied::GrantForAnotherVm {
                grant: grant.to_string(),
                vm: vm.name.clone(),
            }),
            None => Err(Denied::GrantVmUnknown {
                grant: grant.to_string(),
                vm: vm.name.clone(),
            }),
        };
    }
    outcome
}

/// The backends of load balancer `lb` that `asker` may reach on `port`:
/// refused when none is left of a non-empty pool.
pub fn backends<'v, T>(
    asker: Asker<'_>,
    lb: &str,
    pool: Vec<&'v T>,
    labels: impl Fn(&T) -> &Labels,
    port: u16,
) -> Result<Vec<&'v T>, Denied> {
    let allowed: Vec<&T> = pool
        .into_iter()
        .filter(|vm| reaches(asker, labels(*vm), port))
        .collect();
    if allowed.is_empty() {
        if let Asker::User { name, .. } = asker {
            return Err(Denied::NoBackend {
                user: name.to_string(),
                lb: lb.to_string(),
                port,
            });
        }
    }
    Ok(allowed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(s: &str) -> Labels {
        s.split(',')
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.to_string(), v.to_string())
            })
            .collect()
    }

    fn rule(selector: &str, ports: &[u16]) -> Rule {
        Rule::compile(&AccessRule {
            id: 7,
            selector: selector.into(),
            ports: ports.to_vec(),
            inert: None,
        })
        .unwrap()
    }

    /// A VM named `name` whose id is `id-NAME`.
    fn a_vm(name: &str, labels_text: &str) -> Vm {
        Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: name.into(),
            id: format!("id-{name}"),
            network: "ov".into(),
            node: None,
            labels: labels(labels_text),
            mac: "02:00:00:00:00:01".parse().unwrap(),
            ip: std::net::Ipv4Addr::new(10, 0, 0, 2),
            state: otherix_proto::VmState::Running,
            reason: None,
            exec: None,
            migrate_to: None,
            created_at: time::OffsetDateTime::UNIX_EPOCH,
        }
    }

    fn target(target: &str, port: u16, vm_id: Option<&str>) -> GrantTarget {
        GrantTarget {
            target: target.into(),
            port,
            vm_id: vm_id.map(str::to_string),
        }
    }

    fn user<'a>(role: Role, rules: &'a [Rule]) -> Asker<'a> {
        Asker::User {
            name: "alice",
            role,
            rules,
        }
    }

    #[test]
    fn who_may_reach_which_vm_on_which_port() {
        let web_ssh = [rule("app=web", &[22, 80])];
        let not_canary = [rule("app=web,tier!=canary", &[443])];
        let none: [Rule; 0] = [];
        let grant = [target("web01", 443, Some("id-web01"))];
        let partner = Asker::Grant {
            name: "partner",
            targets: &grant,
        };
        // (asker, requested target, VM labels, port, allowed)
        let table: Vec<(Asker<'_>, &str, &str, u16, bool)> = vec![
            (user(Role::Admin, &none), "web01", "app=db", 5432, true),
            (user(Role::Viewer, &web_ssh), "web01", "app=web", 22, false),
            (user(Role::User, &web_ssh), "web01", "app=web", 22, true),
            (user(Role::User, &web_ssh), "web01", "app=web", 80, true),
            (user(Role::User, &web_ssh), "web01", "app=web", 23, false),
            (user(Role::User, &web_ssh), "db01", "app=db", 22, false),
            (user(Role::User, &none), "web01", "app=web", 22, false),
            (
                user(Role::User, &not_canary),
                "web01",
                "app=web,tier=prod",
                443,
                true,
            ),
            (
                user(Role::User, &not_canary),
                "web02",
                "app=web,tier=canary",
                443,
                false,
            ),
            (partner, "web01", "app=web", 443, true),
            (partner, "web01", "app=web", 22, false),
            (partner, "web02", "app=web", 443, false),
            (partner, "lb/web01", "app=web", 443, false),
        ];
        for (asker, target, vm_labels, port, allowed) in table {
            let got = request(asker, target, port).and_then(|()| vm(asker, &a_vm(target, vm_labels), port));
            assert_eq!(
                got.is_ok(),
                allowed,
                "{asker:?} {target}:{port} on [{vm_labels}]: {got:?}"
            );
        }
    }

    #[test]
    fn refusals_say_who_and_what() {
        let none: [Rule; 0] = [];
        assert_eq!(
            request(user(Role::Viewer, &none), "web01", 22)
                .unwrap_err()
                .to_string(),
            "role viewer may not broker connections"
        );
        assert_eq!(
            vm(user(Role::User, &none), &a_vm("web01", "app=web"), 22)
                .unwrap_err()
                .to_string(),
            "user \"alice\" may not reach web01:22; no access rule allows it"
        );
        let targets = [];
        let g = Asker::Grant {
            name: "acme",
            targets: &targets,
        };
        assert_eq!(
            request(g, "lb/web", 80).unwrap_err().to_string(),
            "grant \"acme\" does not include lb/web:80"
        );
    }

    #[test]
    fn a_user_gets_only_the_backends_its_rules_allow() {
        let rules = [rule("tier,tier!=canary", &[80])];
        let vms = [labels("tier=prod"), labels("tier=canary"), labels("tier=prod")];
        let pool: Vec<&Labels> = vms.iter().collect();
        let got = backends(user(Role::User, &rules), "web-lb", pool.clone(), |l| l, 80).unwrap();
        assert_eq!(got.len(), 2);
        assert!(got.iter().all(|l| l["tier"] == "prod"));
        let denied = backends(user(Role::User, &rules), "web-lb", pool.clone(), |l| l, 443).unwrap_err();
        assert_eq!(
            denied,
            Denied::NoBackend {
                user: "alice".into(),
                lb: "web-lb".into(),
                port: 443
            }
        );
        let none: [Rule; 0] = [];
        assert_eq!(
            backends(user(Role::Admin, &none), "web-lb", pool, |l| l, 443)
                .unwrap()
                .len(),
            3
        );
    }

    #[test]
    fn a_stored_rule_that_requires_no_label_allows_nothing_and_says_so() {
        let rules = [rule("env!=prod", &[22]), rule("team=web", &[80])];
        assert!(rules[0].inert && !rules[1].inert);
        let alice = user(Role::User, &rules);
        // Before, `env!=prod` admitted the unlabelled VM: now it fails closed.
        let bare = a_vm("fresh01", "");
        let err = vm(alice, &bare, 22).unwrap_err();
        assert_eq!(err.code(), "rule_requires_no_label");
        assert_eq!(
            err.to_string(),
            "user \"alice\" may not reach fresh01:22: rule 7 (`env!=prod`) requires no label, \
             so it allows nothing; an admin must replace it with a rule that requires a label"
        );
        assert!(!reaches(alice, &bare.labels, 22));
        // Where it would not have matched either, the plain refusal.
        let prod = a_vm("db01", "env=prod");
        assert!(matches!(vm(alice, &prod, 22), Err(Denied::NoRule { .. })));
        // The user's other rules still hold.
        assert_eq!(vm(alice, &a_vm("web01", "team=web"), 80), Ok(()));
        assert_eq!(
            Rule::why_inert(&AccessRule {
                id: 7,
                selector: "env!=prod".into(),
                ports: vec![22],
                inert: None,
            })
            .as_deref(),
            Some(
                "allows nothing: selector `env!=prod` requires no label, so it would admit any VM \
                 created without labels; replace it with a rule that requires a label"
            )
        );
        assert_eq!(
            Rule::why_inert(&AccessRule {
                id: 8,
                selector: "team=web".into(),
                ports: vec![80],
                inert: None,
            }),
            None
        );
    }

    #[test]
    fn a_grant_reaches_only_the_vm_it_was_made_for() {
        let targets = [target("web01", 443, Some("id-web01")), target("old01", 22, None)];
        let acme = Asker::Grant {
            name: "acme",
            targets: &targets,
        };
        assert_eq!(vm(acme, &a_vm("web01", ""), 443), Ok(()));
        // Deleted and re-created under the same name: another VM.
        let recreated = Vm {
            id: "id-new".into(),
            ..a_vm("web01", "")
        };
        assert_eq!(request(acme, "web01", 443), Ok(()));
        let err = vm(acme, &recreated, 443).unwrap_err();
        assert_eq!(err.code(), "grant_vm_replaced");
        assert_eq!(
            err.to_string(),
            "grant \"acme\" was made for another VM named web01 (deleted since); \
             ask for a new grant to reach this one"
        );
        // A grant from before the binding whose VM was already gone.
        let err = vm(acme, &a_vm("old01", ""), 22).unwrap_err();
        assert_eq!(err.code(), "grant_vm_unknown");
        assert!(
            err.to_string().contains("did not exist when grants were bound"),
            "{err}"
        );
        // Right VM, port not listed: as before.
        assert!(matches!(
            vm(acme, &a_vm("web01", ""), 22),
            Err(Denied::NotInGrant { .. })
        ));
    }
}
