//! When to heartbeat next, and when to tell the operator the control plane is gone.
//!
//! A clock-free state machine: the loop reports each heartbeat's outcome and gets the
//! delay until the next one, plus whether this is news worth a log line. While the
//! control plane is unreachable the node keeps running on its last desired state, so
//! an outage is one warning when it starts and one line when it ends, not a warning
//! every second.

use std::time::Duration;

/// Retry schedule while heartbeats fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The normal heartbeat interval.
    pub interval: Duration,
    /// Delay after the first failure; doubles with each further failure.
    pub initial: Duration,
    /// Longest delay between retries.
    pub max: Duration,
}

impl RetryPolicy {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            initial: Duration::from_secs(1),
            max: Duration::from_secs(10),
        }
    }

    /// Delay after `failures` consecutive failures (1 for the first).
    pub fn retry_delay(&self, failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(31);
        self.initial.saturating_mul(1u32 << doublings).min(self.max)
    }
}

/// What a heartbeat outcome means for the logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// Nothing new: still up, or still down.
    Steady,
    /// The first failure after a success (or at start): warn once.
    OutageStarted,
    /// The first success after `failures` failures.
    Recovered { failures: u32 },
}

/// Heartbeat health: consecutive failures and the schedule they imply.
#[derive(Clone, Debug)]
pub struct Heartbeats {
    policy: RetryPolicy,
    failures: u32,
}

impl Heartbeats {
    pub fn new(policy: RetryPolicy) -> Self {
        Self { policy, failures: 0 }
    }

    /// A heartbeat was answered: back to the normal interval.
    pub fn succeeded(&mut self) -> (Duration, Transition) {
        let t = match std::mem::take(&mut self.failures) {
            0 => Transition::Steady,
            failures => Transition::Recovered { failures },
        };
        (self.policy.interval, t)
    }

    /// A heartbeat failed: retry sooner or later per the policy.
    pub fn failed(&mut self) -> (Duration, Transition) {
        self.failures = self.failures.saturating_add(1);
        let t = if self.failures == 1 {
            Transition::OutageStarted
        } else {
            Transition::Steady
        };
        (self.policy.retry_delay(self.failures), t)
    }

    /// Consecutive failures so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(d: Duration) -> u64 {
        d.as_secs()
    }

    #[test]
    fn retries_double_from_one_second_up_to_ten() {
        let mut h = Heartbeats::new(RetryPolicy::new(Duration::from_secs(2)));
        let delays: Vec<u64> = (0..7).map(|_| secs(h.failed().0)).collect();
        assert_eq!(delays, [1, 2, 4, 8, 10, 10, 10]);
    }

    #[test]
    fn success_returns_to_the_normal_interval_and_reports_the_recovery_once() {
        let mut h = Heartbeats::new(RetryPolicy::new(Duration::from_secs(2)));
        assert_eq!(h.succeeded(), (Duration::from_secs(2), Transition::Steady));
        assert_eq!(h.failed().1, Transition::OutageStarted);
        assert_eq!(h.failed().1, Transition::Steady, "one warning per outage");
        assert_eq!(h.failed().1, Transition::Steady);
        assert_eq!(
            h.succeeded(),
            (Duration::from_secs(2), Transition::Recovered { failures: 3 })
        );
        assert_eq!(h.succeeded().1, Transition::Steady);
        // A new outage warns again and starts again from one second.
        assert_eq!(h.failed(), (Duration::from_secs(1), Transition::OutageStarted));
    }

    #[test]
    fn delay_does_not_overflow_after_very_long_outages() {
        let p = RetryPolicy::new(Duration::from_secs(2));
        assert_eq!(p.retry_delay(u32::MAX), p.max);
    }
}
