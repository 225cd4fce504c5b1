//! Who may broker what (DESIGN §4, §8): pure policy, no store. The broker
//! reads the caller's role, access rules or grant, and the VM, and asks
//! here; every decision is a table test below.
//!
//! - `admin`: any target.
//! - `user`: a VM whose labels one of its rules' selectors matches, on a
//!   port that rule lists; through a load balancer, only such backends.
//! - `viewer`: nothing.
//! - a grant: exactly its listed `(target, port)` pairs, where the target is
//!   a VM name or `lb/NAME` as written in the grant.

use otherix_core::selector::Selector;
use otherix_core::Labels;
use otherix_proto::{AccessRule, GrantTarget, Role};

/// An access rule with its selector parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rule {
    pub selector: Selector,
    pub ports: Vec<u16>,
}

impl Rule {
    /// The rule as stored; `None` for a selector that no longer parses
    /// (stored rules were checked when made), which allows nothing.
    pub fn compile(rule: &AccessRule) -> Option<Rule> {
        Some(Rule {
            selector: rule.selector.parse().ok()?,
            ports: rule.ports.clone(),
        })
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

/// Why a request is refused (all 403 at the broker).
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
    #[error("user {user:?} may not reach any backend of load balancer {lb:?} on port {port}")]
    NoBackend { user: String, lb: String, port: u16 },
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
        } => rules
            .iter()
            .any(|r| r.ports.contains(&port) && r.selector.matches(labels)),
        Asker::User {
            role: Role::Admin, ..
        }
        | Asker::Grant { .. } => true,
        Asker::User {
            role: Role::Viewer, ..
        } => false,
    }
}

/// [`reaches`] for one VM, as a refusal naming it.
pub fn vm(asker: Asker<'_>, vm: &str, labels: &Labels, port: u16) -> Result<(), Denied> {
    if reaches(asker, labels, port) {
        return Ok(());
    }
    Err(match asker {
        Asker::User { name, .. } => Denied::NoRule {
            user: name.to_string(),
            vm: vm.to_string(),
            port,
        },
        // A viewer was refused by `request` already; a grant reaches what it lists.
        Asker::Grant { .. } => Denied::Viewer,
    })
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
        Rule {
            selector: selector.parse().unwrap(),
            ports: ports.to_vec(),
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
        let grant = [GrantTarget {
            target: "web01".into(),
            port: 443,
        }];
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
            let got = request(asker, target, port).and_then(|()| vm(asker, target, &labels(vm_labels), port));
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
            vm(user(Role::User, &none), "web01", &labels("app=web"), 22)
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
        let rules = [rule("tier!=canary", &[80])];
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
}
