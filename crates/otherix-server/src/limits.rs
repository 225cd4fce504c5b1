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
            }),
        }
    }

    /// One broker call by `principal` now.
    pub fn check(&self, principal: &str, now: OffsetDateTime) -> Result<(), Refused> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let Err(limited) = inner.limiter.check(principal, now) else {
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
}
