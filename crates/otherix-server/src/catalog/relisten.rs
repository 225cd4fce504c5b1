//! When to make the change listener again after it was lost (PostgreSQL
//! restarted, its backend terminated, the network cut): exponential backoff
//! with jitter from [`FIRST`] to [`MOST`], the poll carrying the catalog
//! meanwhile, and one log line when an outage starts and one when it ends.
//!
//! Pure: the caller passes `now` and a random number.

use std::time::{Duration, Instant};

/// The first retry comes this soon after the listener was lost ...
pub const FIRST: Duration = Duration::from_millis(100);
/// ... each further one twice as late, at most this late.
pub const MOST: Duration = Duration::from_secs(5);

/// The delay before attempt `failures + 1`, after `failures` failed ones
/// (0: the listener was just lost): half of the doubled delay for sure, the
/// other half random (`random`), so replicas that lost their listeners
/// together do not all come back at once.
pub fn delay(failures: u32, random: u64) -> Duration {
    let base = FIRST.saturating_mul(1u32 << failures.min(16)).min(MOST);
    let half = base / 2;
    let spread = u64::try_from(half.as_micros()).unwrap_or(u64::MAX).max(1);
    half + Duration::from_micros(random % spread)
}

/// An outage of the listener, if one is under way.
#[derive(Debug, Default)]
pub struct Outage {
    since: Option<Instant>,
    failures: u32,
}

impl Outage {
    /// The listener was lost at `now` (or could not be made at start):
    /// `true` when this starts an outage (say so once). The next attempt is
    /// due after [`Outage::next_delay`].
    pub fn lost(&mut self, now: Instant) -> bool {
        let starts = self.since.is_none();
        self.since.get_or_insert(now);
        self.failures = 0;
        starts
    }

    /// An attempt to make it again failed.
    pub fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
    }

    /// The delay before the next attempt.
    pub fn next_delay(&self, random: u64) -> Duration {
        delay(self.failures, random)
    }

    /// It was made again at `now`: how long the outage lasted and how many
    /// attempts failed in between (say so once).
    pub fn ended(&mut self, now: Instant) -> Option<(Duration, u32)> {
        let since = self.since.take()?;
        Some((
            now.saturating_duration_since(since),
            std::mem::take(&mut self.failures),
        ))
    }

    pub fn is_down(&self) -> bool {
        self.since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_double_from_100_ms_to_5_s_with_half_of_each_random() {
        for (failures, base) in [(0, 100), (1, 200), (2, 400), (5, 3200), (6, 5000), (40, 5000)] {
            let base = Duration::from_millis(base);
            assert_eq!(delay(failures, 0), base / 2, "{failures}");
            assert!(delay(failures, u64::MAX) < base, "{failures}");
            for r in [1, 77, 123_456_789] {
                let d = delay(failures, r);
                assert!(d >= base / 2 && d < base, "{failures} {r}: {d:?}");
            }
        }
    }

    #[test]
    fn an_outage_is_said_once_when_it_starts_and_once_when_it_ends() {
        let t0 = Instant::now();
        let mut o = Outage::default();
        assert_eq!(o.ended(t0), None, "no outage, nothing to say");
        assert!(o.lost(t0));
        o.failed();
        o.failed();
        assert!(o.next_delay(0) >= Duration::from_millis(200));
        assert!(!o.lost(t0 + Duration::from_secs(1)), "still the same outage");
        assert!(o.is_down());
        o.failed();
        let (lasted, failed) = o.ended(t0 + Duration::from_secs(3)).unwrap();
        assert_eq!((lasted, failed), (Duration::from_secs(3), 1));
        assert!(!o.is_down());
        assert_eq!(o.next_delay(0), FIRST / 2);
    }
}
