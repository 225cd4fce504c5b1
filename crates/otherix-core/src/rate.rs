//! Per-principal rate limits: a token bucket per key, pure (`now` passed
//! in), bounded in memory. The broker uses it so that no one user, token or
//! grant can take every credential the control plane can mint.

use std::collections::HashMap;
use std::time::Duration;

use time::OffsetDateTime;

/// Refill rate and burst of every bucket.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rate {
    /// Tokens added per second.
    pub per_second: f64,
    /// Most tokens a bucket holds (the burst a quiet principal may send).
    pub burst: f64,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: OffsetDateTime,
}

/// Token buckets by key.
#[derive(Debug)]
pub struct RateLimiter {
    rate: Rate,
    buckets: HashMap<String, Bucket>,
    /// At most this many keys are remembered: past it, full buckets (keys
    /// quiet long enough to have refilled) are forgotten first.
    max_keys: usize,
}

/// Not now: come back after this long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    pub retry_after: Duration,
}

impl RateLimiter {
    pub fn new(rate: Rate, max_keys: usize) -> RateLimiter {
        RateLimiter {
            rate,
            buckets: HashMap::new(),
            max_keys: max_keys.max(1),
        }
    }

    /// Takes one token from `key`'s bucket, or says how long until there is one.
    pub fn check(&mut self, key: &str, now: OffsetDateTime) -> Result<(), Limited> {
        if self.rate.per_second <= 0.0 {
            return Ok(());
        }
        let rate = self.rate;
        let bucket = self.refilled(key, now);
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        let wait = (1.0 - bucket.tokens) / rate.per_second;
        Err(Limited {
            retry_after: Duration::from_secs_f64(wait).max(Duration::from_millis(1)),
        })
    }

    /// Charges `key` for `n` calls made elsewhere (another replica): its
    /// bucket may go below zero, down to minus one burst, and refills from
    /// there. Past the key limit a new key is not remembered for it.
    pub fn charge(&mut self, key: &str, n: u64, now: OffsetDateTime) {
        if self.rate.per_second <= 0.0 || n == 0 {
            return;
        }
        let burst = self.rate.burst;
        let bucket = self.refilled(key, now);
        bucket.tokens = (bucket.tokens - n as f64).max(-burst);
    }

    /// `key`'s bucket, refilled up to `now` (a new one starts full; past the
    /// key limit, full ones are forgotten first).
    fn refilled(&mut self, key: &str, now: OffsetDateTime) -> &mut Bucket {
        if !self.buckets.contains_key(key) && self.buckets.len() >= self.max_keys {
            self.forget_full(now);
        }
        let rate = self.rate;
        let bucket = self.buckets.entry(key.to_owned()).or_insert(Bucket {
            tokens: rate.burst,
            at: now,
        });
        let elapsed = (now - bucket.at).as_seconds_f64().max(0.0);
        bucket.tokens = (bucket.tokens + elapsed * rate.per_second).min(rate.burst);
        bucket.at = now;
        bucket
    }

    /// Keys remembered now.
    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }

    /// Forgets buckets that have refilled (a new bucket starts full, so
    /// forgetting them changes nothing); if none has, the stalest one.
    fn forget_full(&mut self, now: OffsetDateTime) {
        let rate = self.rate;
        self.buckets.retain(|_, b| {
            let elapsed = (now - b.at).as_seconds_f64().max(0.0);
            b.tokens + elapsed * rate.per_second < rate.burst
        });
        if self.buckets.len() >= self.max_keys {
            if let Some(stalest) = self
                .buckets
                .iter()
                .min_by_key(|(_, b)| b.at)
                .map(|(k, _)| k.clone())
            {
                self.buckets.remove(&stalest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limiter(per_second: f64, burst: f64) -> RateLimiter {
        RateLimiter::new(Rate { per_second, burst }, 1000)
    }

    #[test]
    fn a_burst_is_allowed_then_the_rate() {
        let mut l = limiter(10.0, 5.0);
        let t0 = OffsetDateTime::UNIX_EPOCH;
        for _ in 0..5 {
            l.check("user:a", t0).unwrap();
        }
        let limited = l.check("user:a", t0).unwrap_err();
        assert_eq!(limited.retry_after, Duration::from_millis(100));
        // Another principal is not affected.
        l.check("user:b", t0).unwrap();
        // A tenth of a second later, one more.
        let t1 = t0 + time::Duration::milliseconds(100);
        l.check("user:a", t1).unwrap();
        assert!(l.check("user:a", t1).is_err());
    }

    #[test]
    fn a_zero_rate_means_no_limit() {
        let mut l = limiter(0.0, 0.0);
        for _ in 0..1000 {
            l.check("k", OffsetDateTime::UNIX_EPOCH).unwrap();
        }
        assert!(l.is_empty());
    }

    #[test]
    fn memory_stays_bounded_and_forgetting_refilled_keys_changes_nothing() {
        let mut l = RateLimiter::new(
            Rate {
                per_second: 1.0,
                burst: 2.0,
            },
            3,
        );
        let t0 = OffsetDateTime::UNIX_EPOCH;
        for k in ["a", "b", "c"] {
            l.check(k, t0).unwrap();
        }
        // Later, "a".."c" have refilled; a flood of new keys stays bounded.
        let t1 = t0 + time::Duration::seconds(10);
        for i in 0..100 {
            let _ = l.check(&format!("k{i}"), t1);
            assert!(l.len() <= 3);
        }
    }

    proptest::proptest! {
        #[test]
        fn never_more_than_burst_plus_rate_times_elapsed(steps in proptest::collection::vec(0u64..500, 1..200)) {
            let rate = Rate { per_second: 20.0, burst: 10.0 };
            let mut l = RateLimiter::new(rate, 10);
            let t0 = OffsetDateTime::UNIX_EPOCH;
            let mut now = t0;
            let mut allowed = 0u64;
            for ms in steps {
                now += time::Duration::milliseconds(ms as i64);
                if l.check("p", now).is_ok() {
                    allowed += 1;
                }
            }
            let elapsed = (now - t0).as_seconds_f64();
            proptest::prop_assert!(allowed as f64 <= rate.burst + rate.per_second * elapsed + 1e-9);
        }
    }

    #[test]
    fn calls_charged_from_elsewhere_come_off_the_bucket_down_to_minus_one_burst() {
        let t0 = OffsetDateTime::UNIX_EPOCH;
        let mut l = RateLimiter::new(
            Rate {
                per_second: 10.0,
                burst: 5.0,
            },
            10,
        );
        l.charge("a", 3, t0);
        assert!(l.check("a", t0).is_ok() && l.check("a", t0).is_ok());
        assert!(l.check("a", t0).is_err(), "5 - 3 charged - 2 taken");
        l.charge("a", 1_000, t0);
        // At -5 (not -1000): 6 tokens, 0.6 s, until the next call.
        assert!(l.check("a", t0 + time::Duration::milliseconds(550)).is_err());
        assert!(l.check("a", t0 + time::Duration::milliseconds(650)).is_ok());
        assert!(l.check("b", t0).is_ok(), "others untouched");
    }
}
