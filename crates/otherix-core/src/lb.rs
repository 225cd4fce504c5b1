//! Load-balancer logic, pure: the per-backend health state machine (rise,
//! fall, staleness), eligibility, pool status, and power-of-two-choices
//! selection. Time and randomness are arguments.

use serde::{Deserialize, Serialize};
use time::{Duration, OffsetDateTime};

/// What a health verdict says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// No verdict yet, or the verdict is stale: served (fail toward serving).
    Unknown,
    Healthy,
    Unhealthy,
}

impl Health {
    /// The verdict a word names, if it names one.
    pub fn parse(word: &str) -> Option<Health> {
        match word {
            "unknown" => Some(Health::Unknown),
            "healthy" => Some(Health::Healthy),
            "unhealthy" => Some(Health::Unhealthy),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Health::Unknown => "unknown",
            Health::Healthy => "healthy",
            Health::Unhealthy => "unhealthy",
        }
    }
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Thresholds of a health check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Thresholds {
    /// Consecutive successes that make an unhealthy backend healthy again.
    pub rise: u32,
    /// Consecutive failures that make a backend unhealthy.
    pub fall: u32,
}

/// Outcome of one probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    Success,
    /// The backend failed the check (refused, timed out, non-2xx).
    Failure(String),
    /// The probe could not run on the agent's side (no route yet, no
    /// address): says nothing about the backend, so recorded as unknown.
    Inconclusive(String),
}

/// One backend's health as its owning agent tracks it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HealthState {
    pub health: Health,
    pub successes: u32,
    pub failures: u32,
    pub last_probe: Option<OffsetDateTime>,
    pub last_change: Option<OffsetDateTime>,
    pub reason: Option<String>,
}

impl Default for HealthState {
    fn default() -> Self {
        HealthState {
            health: Health::Unknown,
            successes: 0,
            failures: 0,
            last_probe: None,
            last_change: None,
            reason: None,
        }
    }
}

impl HealthState {
    /// Applies one probe result. From `unknown`, one success makes a
    /// backend healthy; `fall` consecutive failures make it unhealthy; from
    /// `unhealthy`, `rise` consecutive successes make it healthy again.
    pub fn observe(&mut self, probe: Probe, t: &Thresholds, now: OffsetDateTime) {
        self.last_probe = Some(now);
        let next = match probe {
            Probe::Success => {
                self.successes = self.successes.saturating_add(1);
                self.failures = 0;
                self.reason = None;
                match self.health {
                    Health::Unknown => Health::Healthy,
                    Health::Unhealthy if self.successes >= t.rise.max(1) => Health::Healthy,
                    h => h,
                }
            }
            Probe::Failure(reason) => {
                self.failures = self.failures.saturating_add(1);
                self.successes = 0;
                self.reason = Some(reason);
                if self.failures >= t.fall.max(1) {
                    Health::Unhealthy
                } else {
                    self.health
                }
            }
            Probe::Inconclusive(reason) => {
                self.successes = 0;
                self.failures = 0;
                self.reason = Some(reason);
                Health::Unknown
            }
        };
        if next != self.health {
            self.health = next;
            self.last_change = Some(now);
        }
    }
}

/// A verdict older than this is stale: max(3 × interval, 15 s).
pub fn staleness(interval: Duration) -> Duration {
    (interval * 3_i32).max(Duration::seconds(15))
}

/// The health the CP acts on: a stale verdict (the reporting pipeline broke)
/// counts as unknown.
pub fn effective(
    health: Health,
    probed_at: Option<OffsetDateTime>,
    interval: Duration,
    now: OffsetDateTime,
) -> Health {
    match probed_at {
        Some(t) if now - t <= staleness(interval) => health,
        _ => Health::Unknown,
    }
}

/// Unknown and healthy backends get new connections; unhealthy ones do not.
pub fn eligible(h: Health) -> bool {
    h != Health::Unhealthy
}

/// How readily the broker serves a backend. Ordered: the broker picks
/// among the best standing any backend has.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Standing {
    /// Confirmed unhealthy, or not running: never served.
    Ineligible,
    /// Eligible, but its node is NotReady (no heartbeat within the node
    /// timeout): its verdict soon turns `unknown` while the node may well
    /// be dead, so it is served only when no backend is [`Preferred`](Standing::Preferred)
    /// — failing toward serving.
    Fallback,
    /// Eligible, on a Ready node.
    Preferred,
}

/// A backend's standing from its effective health, whether its VM is
/// running and whether its node is Ready.
pub fn standing(health: Health, running: bool, node_ready: bool) -> Standing {
    match (running && eligible(health), node_ready) {
        (false, _) => Standing::Ineligible,
        (true, false) => Standing::Fallback,
        (true, true) => Standing::Preferred,
    }
}

/// [`p2c_with`] among the backends of the best standing present: those on
/// Ready nodes when there are any, else the eligible ones on NotReady
/// nodes. `None` when every backend is ineligible.
pub fn p2c_best(standings: &[Standing], r1: u64, r2: u64, active: impl Fn(usize) -> u32) -> Option<usize> {
    let best = standings.iter().copied().max()?;
    if best == Standing::Ineligible {
        return None;
    }
    let mask: Vec<bool> = standings.iter().map(|s| *s == best).collect();
    p2c_with(&mask, r1, r2, active)
}

/// `lb list`'s STATUS column.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum PoolStatus {
    /// The selector matches nothing.
    NoBackends,
    /// Every backend is confirmed unhealthy.
    Unhealthy,
    /// Some confirmed unhealthy, some eligible.
    Degraded,
    /// No backend has a verdict yet (a new pool, or its agents not probed
    /// yet): they are served, but nothing says they work.
    Unknown,
    /// None confirmed unhealthy, at least one confirmed healthy.
    Healthy,
}

impl PoolStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PoolStatus::NoBackends => "no_backends",
            PoolStatus::Unhealthy => "unhealthy",
            PoolStatus::Degraded => "degraded",
            PoolStatus::Unknown => "unknown",
            PoolStatus::Healthy => "healthy",
        }
    }
}

pub fn pool_status(healths: &[Health]) -> PoolStatus {
    let unhealthy = healths.iter().filter(|h| **h == Health::Unhealthy).count();
    match (healths.len(), unhealthy) {
        (0, _) => PoolStatus::NoBackends,
        (n, u) if u == n => PoolStatus::Unhealthy,
        _ if healths.iter().all(|h| *h == Health::Unknown) => PoolStatus::Unknown,
        (_, 0) => PoolStatus::Healthy,
        _ => PoolStatus::Degraded,
    }
}

/// Power of two choices: draws two eligible candidates with `r1`, `r2`
/// (uniform random numbers from the caller) and returns the index of the one
/// with fewer active connections. `None` when nothing is eligible.
pub fn p2c(active: &[u32], eligible: &[bool], r1: u64, r2: u64) -> Option<usize> {
    p2c_with(&eligible[..eligible.len().min(active.len())], r1, r2, |i| {
        active[i]
    })
}

/// [`p2c`] asking `active` only about the two candidates drawn: with a
/// thousand backends, counting every one's connections per decision is the
/// cost that matters.
pub fn p2c_with(eligible: &[bool], r1: u64, r2: u64, active: impl Fn(usize) -> u32) -> Option<usize> {
    let pool: Vec<usize> = (0..eligible.len()).filter(|&i| eligible[i]).collect();
    match pool.len() {
        0 => None,
        1 => Some(pool[0]),
        n => {
            let a = pool[(r1 % n as u64) as usize];
            // Second draw among the others, so the two candidates differ.
            let mut b_idx = (r2 % (n as u64 - 1)) as usize;
            if pool[b_idx] == a {
                b_idx = n - 1;
            }
            let b = pool[b_idx];
            Some(if active(b) < active(a) { b } else { a })
        }
    }
}

/// Slots a [`RecentCount`] divides its window into.
pub const RECENT_SLOTS: usize = 16;

/// Connections recorded within a sliding window, in constant memory: a
/// count per slot of 1/[`RECENT_SLOTS`] of the window, the oldest slot
/// reused as time moves on. A connection counts for at least 15/16 of the
/// window and at most the whole window (the slot it fell in ages out as a
/// whole) — exact enough for P2C, which only compares two counts, and the
/// same size after a million records as after one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecentCount {
    slots: [u32; RECENT_SLOTS],
    /// Slot number (milliseconds since the epoch / `width_ms`) of the newest
    /// slot in use.
    newest: i64,
    /// Width of a slot in milliseconds; 0 until the first record.
    width_ms: i64,
}

impl RecentCount {
    /// Counts one connection at `now`. A record too old to count any more
    /// (a late caller's `now`) is dropped. A new `window` (the CP's is fixed
    /// at start) starts the slots over, keeping what they count as recent.
    pub fn record(&mut self, now: OffsetDateTime, window: Duration) {
        let width = slot_width_ms(window);
        if width != self.width_ms {
            let kept = self.count(now);
            *self = RecentCount {
                newest: slot_number(now, width),
                width_ms: width,
                ..RecentCount::default()
            };
            self.slots[self.index(self.newest)] = kept;
        }
        let s = slot_number(now, width);
        if s > self.newest {
            // Slots between the newest and now have aged out: reuse them.
            for e in (self.newest + 1).max(s - RECENT_SLOTS as i64 + 1)..=s {
                let i = self.index(e);
                self.slots[i] = 0;
            }
            self.newest = s;
        } else if s <= self.newest - RECENT_SLOTS as i64 {
            return;
        }
        let i = self.index(s);
        self.slots[i] = self.slots[i].saturating_add(1);
    }

    /// Connections recorded within the window (as of [`record`](Self::record)) before `now`.
    pub fn count(&self, now: OffsetDateTime) -> u32 {
        if self.width_ms == 0 {
            return 0;
        }
        let s = slot_number(now, self.width_ms);
        let oldest = s.max(self.newest) - RECENT_SLOTS as i64 + 1;
        (oldest..=self.newest)
            .map(|e| self.slots[self.index(e)])
            .fold(0u32, u32::saturating_add)
    }

    fn index(&self, slot: i64) -> usize {
        slot.rem_euclid(RECENT_SLOTS as i64) as usize
    }
}

fn slot_width_ms(window: Duration) -> i64 {
    (window.whole_milliseconds() / RECENT_SLOTS as i128).clamp(1, i64::MAX as i128) as i64
}

fn slot_number(t: OffsetDateTime, width_ms: i64) -> i64 {
    let ms = (t - OffsetDateTime::UNIX_EPOCH).whole_milliseconds();
    ms.div_euclid(width_ms as i128) as i64
}

/// When a probe runs: the first at a random point in the interval (`r` in
/// [0, 1)), later ones every interval ± 10 % jitter (`r` again).
pub fn first_probe_delay(interval: Duration, r: f64) -> Duration {
    interval * r.clamp(0.0, 0.999_999)
}

pub fn next_probe_delay(interval: Duration, r: f64) -> Duration {
    let factor = 0.9 + 0.2 * r.clamp(0.0, 1.0);
    interval * factor
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t0() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    const T: Thresholds = Thresholds { rise: 2, fall: 3 };

    #[test]
    fn one_success_makes_an_unknown_backend_healthy() {
        let mut s = HealthState::default();
        s.observe(Probe::Success, &T, t0());
        assert_eq!(s.health, Health::Healthy);
        assert_eq!(s.last_change, Some(t0()));
    }

    #[test]
    fn fall_consecutive_failures_make_it_unhealthy_and_rise_successes_bring_it_back() {
        let mut s = HealthState::default();
        s.observe(Probe::Success, &T, t0());
        for i in 1..=2 {
            s.observe(Probe::Failure("refused".into()), &T, t0() + Duration::seconds(i));
            assert_eq!(s.health, Health::Healthy, "{i} failures are not enough");
        }
        s.observe(Probe::Failure("refused".into()), &T, t0() + Duration::seconds(3));
        assert_eq!(s.health, Health::Unhealthy);
        assert_eq!(s.reason.as_deref(), Some("refused"));
        s.observe(Probe::Success, &T, t0() + Duration::seconds(4));
        assert_eq!(s.health, Health::Unhealthy, "one success is not rise");
        s.observe(Probe::Success, &T, t0() + Duration::seconds(5));
        assert_eq!(s.health, Health::Healthy);
        assert_eq!(s.last_change, Some(t0() + Duration::seconds(5)));
    }

    #[test]
    fn a_failure_between_successes_resets_the_rise_count() {
        let mut s = HealthState {
            health: Health::Unhealthy,
            ..Default::default()
        };
        s.observe(Probe::Success, &T, t0());
        s.observe(Probe::Failure("x".into()), &T, t0());
        s.observe(Probe::Success, &T, t0());
        assert_eq!(s.health, Health::Unhealthy);
    }

    #[test]
    fn an_inconclusive_probe_is_unknown_not_unhealthy() {
        let mut s = HealthState::default();
        s.observe(Probe::Success, &T, t0());
        s.observe(Probe::Inconclusive("no overlay address yet".into()), &T, t0());
        assert_eq!(s.health, Health::Unknown);
        assert!(eligible(s.health));
    }

    #[test]
    fn stale_verdicts_are_unknown_after_max_of_three_intervals_and_15s() {
        let i = Duration::seconds(2);
        assert_eq!(staleness(i), Duration::seconds(15));
        assert_eq!(staleness(Duration::seconds(10)), Duration::seconds(30));
        let probed = t0();
        assert_eq!(
            effective(Health::Unhealthy, Some(probed), i, t0() + Duration::seconds(15)),
            Health::Unhealthy
        );
        assert_eq!(
            effective(Health::Unhealthy, Some(probed), i, t0() + Duration::seconds(16)),
            Health::Unknown
        );
        assert_eq!(effective(Health::Healthy, None, i, t0()), Health::Unknown);
    }

    #[test]
    fn pool_status_follows_the_definitions() {
        use Health::*;
        assert_eq!(pool_status(&[]), PoolStatus::NoBackends);
        assert_eq!(pool_status(&[Unhealthy, Unhealthy]), PoolStatus::Unhealthy);
        assert_eq!(pool_status(&[Unhealthy, Unknown]), PoolStatus::Degraded);
        assert_eq!(pool_status(&[Healthy, Unknown]), PoolStatus::Healthy);
        // A new pool: no verdict yet is not "healthy".
        assert_eq!(pool_status(&[Unknown, Unknown, Unknown]), PoolStatus::Unknown);
        assert_eq!(PoolStatus::Unknown.as_str(), "unknown");
    }

    #[test]
    fn p2c_prefers_the_less_loaded_of_two() {
        let active = [5, 1, 9];
        let all = [true, true, true];
        // r1 picks 0, r2 picks 1 (among the others): 1 has fewer.
        assert_eq!(p2c(&active, &all, 0, 1), Some(1));
        assert_eq!(p2c(&active, &[false, false, true], 0, 0), Some(2));
        assert_eq!(p2c(&active, &[false, false, false], 0, 0), None);
    }

    #[test]
    fn backends_on_ready_nodes_are_preferred_and_the_others_served_when_alone() {
        use Standing::*;
        assert_eq!(standing(Health::Unknown, true, true), Preferred);
        assert_eq!(standing(Health::Healthy, true, false), Fallback);
        assert_eq!(standing(Health::Unhealthy, true, true), Ineligible);
        assert_eq!(standing(Health::Healthy, false, true), Ineligible);
        let load = |i: usize| [0, 9, 9][i];
        // The NotReady backend has the fewest connections, and is never drawn.
        for r in 0..20 {
            assert_ne!(
                p2c_best(&[Fallback, Preferred, Preferred], r, r + 1, load),
                Some(0)
            );
        }
        assert_eq!(p2c_best(&[Fallback, Ineligible, Ineligible], 3, 4, load), Some(0));
        assert_eq!(p2c_best(&[Ineligible, Ineligible], 3, 4, load), None);
        assert_eq!(p2c_best(&[], 3, 4, load), None);
    }

    #[test]
    fn a_recent_count_counts_a_window_and_forgets_what_aged_out() {
        let window = Duration::minutes(5);
        let mut c = RecentCount::default();
        assert_eq!(c.count(t0()), 0);
        for i in 0..1_000_000i64 {
            // A million connections in 100 s, then none.
            c.record(t0() + Duration::microseconds(i * 100), window);
        }
        let last = t0() + Duration::seconds(100);
        assert_eq!(c.count(last), 1_000_000);
        assert_eq!(c.count(last + Duration::minutes(3)), 1_000_000);
        assert_eq!(c.count(last + window + Duration::seconds(1)), 0);
        // A caller late with its `now` still counts within the window.
        c.record(last, window);
        c.record(last - Duration::minutes(10), window);
        assert_eq!(c.count(last), 1_000_001);
    }

    proptest! {
        #[test]
        fn p2c_best_serves_the_best_standing_present(
            standings in proptest::collection::vec(0u8..3, 0..20),
            r1 in any::<u64>(), r2 in any::<u64>(),
        ) {
            let standings: Vec<Standing> = standings
                .iter()
                .map(|s| [Standing::Ineligible, Standing::Fallback, Standing::Preferred][*s as usize])
                .collect();
            let best = standings.iter().copied().max().unwrap_or(Standing::Ineligible);
            match p2c_best(&standings, r1, r2, |i| i as u32) {
                Some(i) => prop_assert!(standings[i] == best && best != Standing::Ineligible),
                None => prop_assert_eq!(best, Standing::Ineligible),
            }
        }

        /// Held against the obvious count (every timestamp kept): the slots
        /// count at least what is younger than 15/16 of the window and at
        /// most what is younger than the window, whatever the order the
        /// records come in.
        #[test]
        fn a_recent_count_stays_within_a_slot_of_the_exact_count(
            window_s in 1i64..600,
            steps in proptest::collection::vec((0i64..120_000, any::<bool>()), 1..300),
        ) {
            let window = Duration::seconds(window_s);
            let width = Duration::milliseconds(slot_width_ms(window));
            let mut c = RecentCount::default();
            let mut kept: Vec<OffsetDateTime> = vec![];
            let mut latest = t0();
            for (at, late) in steps {
                // Mostly forward in time, sometimes a record a little late.
                let t = if late {
                    latest - Duration::milliseconds(at % 2_000)
                } else {
                    latest + Duration::milliseconds(at)
                };
                latest = latest.max(t);
                c.record(t, window);
                kept.push(t);
                let now = latest;
                let younger = |age: Duration| kept.iter().filter(|t| now - **t < age).count() as u32;
                let got = c.count(now);
                prop_assert!(got >= younger(width * (RECENT_SLOTS as i32 - 1)), "{got}");
                prop_assert!(got <= younger(width * RECENT_SLOTS as i32), "{got}");
            }
        }

        #[test]
        fn p2c_never_picks_an_ineligible_backend(
            active in proptest::collection::vec(0u32..100, 1..20),
            mask in proptest::collection::vec(any::<bool>(), 1..20),
            r1 in any::<u64>(), r2 in any::<u64>(),
        ) {
            let n = active.len().min(mask.len());
            let (active, mask) = (&active[..n], &mask[..n]);
            match p2c(active, mask, r1, r2) {
                Some(i) => prop_assert!(mask[i]),
                None => prop_assert!(!mask.iter().any(|m| *m)),
            }
        }

        #[test]
        fn jitter_stays_within_ten_percent_and_the_first_probe_within_the_interval(r in 0.0f64..1.0, secs in 1i64..300) {
            let i = Duration::seconds(secs);
            let next = next_probe_delay(i, r);
            prop_assert!(next >= i * 0.9 && next <= i * 1.1);
            let first = first_probe_delay(i, r);
            prop_assert!(first >= Duration::ZERO && first < i);
        }

        #[test]
        fn health_never_flips_to_unhealthy_before_fall_failures(fails in 0u32..10, fall in 1u32..6) {
            let t = Thresholds { rise: 2, fall };
            let mut s = HealthState::default();
            s.observe(Probe::Success, &t, t0());
            for _ in 0..fails {
                s.observe(Probe::Failure("x".into()), &t, t0());
            }
            prop_assert_eq!(s.health == Health::Unhealthy, fails >= fall);
        }
    }
}
