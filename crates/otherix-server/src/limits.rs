//! Per-principal limits on the broker: a token bucket per principal
//! (`otherix-core::rate`), so that one user, token or grant cannot take every
//! credential the control plane can mint; refusals say when to retry (429,
//! `Retry-After`), are counted, and are audited once a minute per principal
//! rather than once per refused call.

use std::collections::HashMap;
use std::sync::Mutex;

use otherix_core::rate::{Limited, Rate, RateLimiter};
use time::{Duration, OffsetDateTime};

/// Calls per second each non-admin principal may make to the reads that
/// walk a whole table (`vm list`, `lb list`, `lb get`), and the burst.
pub const LIST_RATE: f64 = 20.0;
pub const LIST_BURST: f64 = 40.0;

/// Principals remembered at most (buckets and audit marks each).
const MAX_PRINCIPALS: usize = 100_000;
/// A principal's rate-limit refusals are audited at most this often.
const AUDIT_EVERY: Duration = Duration::minutes(1);

#[derive(Debug)]
pub struct BrokerLimits {
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    limiter: RateLimiter,
    /// When each principal's last rate-limit refusal was audited.
    audited: HashMap<String, OffsetDateTime>,
    /// Calls let through since the last exchange with the other replicas.
    used: HashMap<String, u64>,
}

/// A rate-limit refusal, and whether this one goes to the audit trail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub limited: Limited,
    pub audit: bool,
}

impl BrokerLimits {
    pub fn new(per_second: f64, burst: f64) -> BrokerLimits {
        BrokerLimits {
            inner: Mutex::new(Inner {
                limiter: RateLimiter::new(
                    Rate {
                        per_second,
                        burst: burst.max(1.0),
                    },
                    MAX_PRINCIPALS,
                ),
                audited: HashMap::new(),
                used: HashMap::new(),
            }),
        }
    }

    /// Calls let through since the last time this was asked, by principal
    /// (for the other replicas to charge).
    pub fn take_used(&self) -> Vec<(String, u64)> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut inner.used).into_iter().collect()
    }

    /// Charges `principal` for `n` calls another replica let through.
    pub fn charge(&self, principal: &str, n: u64, now: OffsetDateTime) {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.limiter.charge(principal, n, now);
    }

    /// One broker call by `principal` now.
    pub fn check(&self, principal: &str, now: OffsetDateTime) -> Result<(), Refused> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Err(limited) = inner.limiter.check(principal, now) else {
            // Bounded like the buckets: past it, the other replicas charge
            // less until the next exchange.
            if inner.used.len() < MAX_PRINCIPALS || inner.used.contains_key(principal) {
                *inner.used.entry(principal.to_owned()).or_default() += 1;
            }
            return Ok(());
        };
        let audit = inner
            .audited
            .get(principal)
            .is_none_or(|last| now - *last >= AUDIT_EVERY);
        if audit {
            if inner.audited.len() >= MAX_PRINCIPALS {
                inner.audited.retain(|_, last| now - *last < AUDIT_EVERY);
            }
            inner.audited.insert(principal.to_owned(), now);
        }
        Err(Refused { limited, audit })
    }
}

/// The reads that walk a whole table, per principal: a user or viewer
/// looping `vm list` must not take the catalog from the broker and the
/// heartbeats. Admins are not limited (they can stop the cluster anyway).
pub fn check_list(
    limits: &BrokerLimits,
    p: &crate::auth::Principal,
    what: &str,
) -> Result<(), crate::error::ApiError> {
    if p.role == otherix_proto::Role::Admin {
        return Ok(());
    }
    match limits.check(&p.id(), OffsetDateTime::now_utc()) {
        Ok(()) => Ok(()),
        Err(refused) => {
            metrics::counter!("otherix_list_rate_limited_total").increment(1);
            Err(crate::error::ApiError::TooManyRequests {
                code: "rate_limited",
                message: format!(
                    "{} is over its rate limit for {what} ({LIST_RATE}/s); retry in {} ms",
                    p.id(),
                    refused.limited.retry_after.as_millis().max(1)
                ),
                retry_after: refused.limited.retry_after,
            })
        }
    }
}

/// How often a replica exchanges rate-limit usage with the others.
pub const SHARE_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

/// On PostgreSQL, keeps the per-principal limits (`broker`, `list`) whole
/// across replicas: every [`SHARE_EVERY`] this replica publishes what it
/// let through and charges what the others did (see
/// `otherix_store::Store::exchange_rate_usage`). A principal spreading its
/// calls over N replicas gets the configured rate plus at most one
/// exchange's worth per replica, not N times it.
pub fn spawn_sharing(
    store: otherix_store::Store,
    replica: String,
    broker: std::sync::Arc<BrokerLimits>,
    list: std::sync::Arc<BrokerLimits>,
) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(SHARE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut after = None;
        let mut rounds: u64 = 0;
        loop {
            tick.tick().await;
            let now = OffsetDateTime::now_utc();
            let mut used = Vec::new();
            for (kind, limits) in [("broker", &broker), ("list", &list)] {
                used.extend(
                    limits
                        .take_used()
                        .into_iter()
                        .map(|(principal, n)| otherix_store::RateUsage {
                            kind: kind.into(),
                            principal,
                            n,
                        }),
                );
            }
            match store.exchange_rate_usage(&replica, &used, after, now).await {
                Ok((theirs, next)) => {
                    after = next;
                    for u in theirs {
                        match u.kind.as_str() {
                            "broker" => broker.charge(&u.principal, u.n, now),
                            "list" => list.charge(&u.principal, u.n, now),
                            _ => {}
                        }
                    }
                }
                Err(e) => {
                    // What this replica let through is not shared this time:
                    // the others charge it late or not at all (fail open, as
                    // the limits are each replica's own when it cannot share).
                    metrics::counter!("otherix_rate_share_failures_total").increment(1);
                    tracing::debug!(error = %e, "cannot share rate-limit usage with the other replicas");
                }
            }
            rounds += 1;
            if rounds.is_multiple_of(20) {
                if let Err(e) = store.prune_rate_usage(now).await {
                    tracing::debug!(error = %e, "cannot prune shared rate-limit usage");
                }
            }
        }
    });
}

/// A node's calls on the agent API, by kind: each has its own bucket per
/// node, so one node looping heartbeats (each up to the body limit, each a
/// trip through the store's single writer) or certificate requests cannot
/// take the control plane from the others. A healthy agent stays far below:
/// it heartbeats every few seconds, at once after a change, and renews its
/// certificates once in weeks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeCall {
    Heartbeat,
    Wait,
    Certificate,
}

impl NodeCall {
    /// The call of an agent API path, if it is limited.
    pub fn of_path(path: &str) -> Option<NodeCall> {
        match path {
            "/v1/agent/heartbeat" => Some(NodeCall::Heartbeat),
            "/v1/agent/desired/wait" => Some(NodeCall::Wait),
            "/v1/agent/certificate" => Some(NodeCall::Certificate),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            NodeCall::Heartbeat => "heartbeat",
            NodeCall::Wait => "wait",
            NodeCall::Certificate => "certificate",
        }
    }

    /// Calls per second and burst, per node.
    fn rate(self) -> Rate {
        match self {
            NodeCall::Heartbeat => Rate {
                per_second: 20.0,
                burst: 60.0,
            },
            NodeCall::Wait => Rate {
                per_second: 10.0,
                burst: 30.0,
            },
            NodeCall::Certificate => Rate {
                per_second: 0.5,
                burst: 10.0,
            },
        }
    }
}

/// Per-node limits on the agent API (see [`NodeCall`]).
#[derive(Debug)]
pub struct NodeLimits {
    inner: Mutex<NodeInner>,
}

#[derive(Debug)]
struct NodeInner {
    heartbeat: RateLimiter,
    wait: RateLimiter,
    certificate: RateLimiter,
    /// When each node's last refusal was logged.
    logged: HashMap<String, OffsetDateTime>,
}

impl Default for NodeLimits {
    fn default() -> Self {
        let limiter = |call: NodeCall| RateLimiter::new(call.rate(), MAX_PRINCIPALS);
        NodeLimits {
            inner: Mutex::new(NodeInner {
                heartbeat: limiter(NodeCall::Heartbeat),
                wait: limiter(NodeCall::Wait),
                certificate: limiter(NodeCall::Certificate),
                logged: HashMap::new(),
            }),
        }
    }
}

impl NodeLimits {
    /// One `call` by `node` now: refused 429 `rate_limited` past its rate
    /// (counted; logged at most once a minute per node).
    pub fn check(
        &self,
        node: &str,
        call: NodeCall,
        now: OffsetDateTime,
    ) -> Result<(), crate::error::ApiError> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let limiter = match call {
            NodeCall::Heartbeat => &mut inner.heartbeat,
            NodeCall::Wait => &mut inner.wait,
            NodeCall::Certificate => &mut inner.certificate,
        };
        let Err(limited) = limiter.check(node, now) else {
            return Ok(());
        };
        metrics::counter!("otherix_node_calls_limited_total", "call" => call.as_str()).increment(1);
        let log = inner
            .logged
            .get(node)
            .is_none_or(|last| now - *last >= AUDIT_EVERY);
        if log {
            if inner.logged.len() >= MAX_PRINCIPALS {
                inner.logged.retain(|_, last| now - *last < AUDIT_EVERY);
            }
            inner.logged.insert(node.to_owned(), now);
            tracing::warn!(
                node,
                call = call.as_str(),
                "node over its rate limit; refusing its calls (logged once a minute)"
            );
        }
        let rate = call.rate();
        Err(crate::error::ApiError::TooManyRequests {
            code: "rate_limited",
            message: format!(
                "node {node} is over its rate limit for {} ({}/s, burst {}); retry in {} ms",
                call.as_str(),
                rate.per_second,
                rate.burst,
                limited.retry_after.as_millis().max(1)
            ),
            retry_after: limited.retry_after,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_audited_once_a_minute_per_principal() {
        let limits = BrokerLimits::new(1.0, 1.0);
        let t0 = OffsetDateTime::UNIX_EPOCH;
        limits.check("user:a", t0).unwrap();
        let first = limits.check("user:a", t0).unwrap_err();
        assert!(first.audit);
        assert!(
            !limits.check("user:a", t0).unwrap_err().audit,
            "not every refusal"
        );
        assert!(limits.check("user:b", t0).is_ok(), "others are not affected");
        let later = t0 + Duration::seconds(61);
        limits.check("user:a", later).unwrap();
        assert!(
            limits.check("user:a", later).unwrap_err().audit,
            "a minute on, again"
        );
    }

    #[test]
    fn each_node_and_call_has_its_own_bucket() {
        let limits = NodeLimits::default();
        let t0 = OffsetDateTime::UNIX_EPOCH;
        for _ in 0..60 {
            limits.check("n1", NodeCall::Heartbeat, t0).unwrap();
        }
        let refused = limits.check("n1", NodeCall::Heartbeat, t0).unwrap_err();
        assert!(
            refused
                .to_string()
                .contains("node n1 is over its rate limit for heartbeat"),
            "{refused}"
        );
        assert!(
            limits.check("n2", NodeCall::Heartbeat, t0).is_ok(),
            "another node"
        );
        assert!(limits.check("n1", NodeCall::Wait, t0).is_ok(), "another call");
        // 20/s: a twentieth of a second later, one more.
        let later = t0 + Duration::milliseconds(50);
        assert!(limits.check("n1", NodeCall::Heartbeat, later).is_ok());
        assert!(limits.check("n1", NodeCall::Heartbeat, later).is_err());
        assert_eq!(
            NodeCall::of_path("/v1/agent/heartbeat"),
            Some(NodeCall::Heartbeat)
        );
        assert_eq!(NodeCall::of_path("/v1/agent/enroll"), None);
    }
}
