//! Per-principal limits on the broker: a token bucket per principal
//! (`otherix-core::rate`), so that one user, token or grant cannot take every
//! credential the control plane can mint; refusals say when to retry (429,
//! `Retry-After`), are counted, and are audited once a minute per principal
//! rather than once per refused call.

use std::collections::HashMap;
use std::sync::Mutex;

use otherix_core::rate::{Limited, Rate, RateLimiter};
use time::{Duration, OffsetDateTime};

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
