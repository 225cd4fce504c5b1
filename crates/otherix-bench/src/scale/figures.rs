//! The arithmetic of a scale row, pure: heartbeats in a window and their
//! percentiles, CPU per heartbeat and per credential, the heartbeat rate
//! the nodes should make, and which nodes went long enough without an
//! answer to be NotReady. Also the bench's small random number generator.

use std::time::{Duration, Instant};

use crate::setup::Latencies;

/// How a heartbeat ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Answered,
    /// No answer within the agent's heartbeat timeout.
    TimedOut,
    /// An error answer or a broken connection.
    Failed,
}

/// One heartbeat of one simulated node.
#[derive(Debug, Clone, Copy)]
pub struct Beat {
    pub node: u32,
    pub started: Instant,
    pub took: Duration,
    pub outcome: Outcome,
    /// Sent at once because the CP's desired-state wait said "changed",
    /// rather than on the interval.
    pub woken: bool,
}

impl Beat {
    pub fn ended(&self) -> Instant {
        self.started + self.took
    }
}

/// The heartbeats of a window.
#[derive(Debug, Clone, Default)]
pub struct BeatSummary {
    /// Answers that arrived within the window: what the CP served in it.
    pub answered: u64,
    /// Heartbeats that started within the window and failed, by how.
    pub timed_out: u64,
    pub failed: u64,
    /// Of the answered ones, those a wake sent early.
    pub woken: u64,
    /// Time to answer of every heartbeat started in the window and done,
    /// a timed-out one counted at the timeout (so a p99 at the timeout
    /// means "at least").
    pub latencies: Latencies,
}

/// What the heartbeats in `beats` did in `from..to`.
pub fn summarize(beats: &[Beat], from: Instant, to: Instant) -> BeatSummary {
    let window = from..to;
    let mut s = BeatSummary::default();
    let mut took = Vec::new();
    for b in beats {
        if b.outcome == Outcome::Answered && window.contains(&b.ended()) {
            s.answered += 1;
            s.woken += u64::from(b.woken);
        }
        if window.contains(&b.started) {
            match b.outcome {
                Outcome::Answered => {}
                Outcome::TimedOut => s.timed_out += 1,
                Outcome::Failed => s.failed += 1,
            }
            took.push(b.took);
        }
    }
    s.latencies = Latencies::new(took);
    s
}

/// CPU-seconds spent per event (heartbeat, credential); `None` without events.
pub fn per_event(cpu_seconds: f64, events: u64) -> Option<Duration> {
    (events > 0 && cpu_seconds >= 0.0).then(|| Duration::from_secs_f64(cpu_seconds / events as f64))
}

/// CPU-seconds over a wall-clock span, as a share of one core (1.0 = 100 %).
pub fn core_share(cpu_seconds: f64, elapsed: Duration) -> f64 {
    if elapsed.is_zero() {
        0.0
    } else {
        cpu_seconds / elapsed.as_secs_f64()
    }
}

/// CPU-seconds of a phase less what the heartbeats answered in it cost at
/// the steady state's CPU per heartbeat: what the phase's own work (the
/// broker calls) cost. Heartbeats answered, not time, because a busy CP
/// answers fewer of them: they give way to the broker calls.
pub fn net_of(cpu_seconds: f64, per_heartbeat: Option<Duration>, heartbeats: u64) -> f64 {
    let theirs = per_heartbeat.map_or(0.0, |d| d.as_secs_f64() * heartbeats as f64);
    (cpu_seconds - theirs).max(0.0)
}

/// Whether a net figure is worth showing: at least a tenth of the raw one
/// (below that it is within what the CPU per heartbeat varies by).
pub fn net_is_signal(net: f64, raw: f64) -> bool {
    raw > 0.0 && net >= 0.1 * raw
}

/// Heartbeats per second `nodes` make at `interval` when every answer is
/// instant (an agent's next heartbeat starts an interval after the answer,
/// so a slow answer lowers the rate).
pub fn expected_rate(nodes: usize, interval: Duration) -> f64 {
    if interval.is_zero() {
        0.0
    } else {
        nodes as f64 / interval.as_secs_f64()
    }
}

/// Nodes (indices below `nodes`) that had no answered heartbeat for longer
/// than `timeout` at some moment of `from..to`: what the CP shows as
/// NotReady, seen from the nodes' side.
pub fn silent_nodes(beats: &[Beat], nodes: usize, timeout: Duration, from: Instant, to: Instant) -> Vec<u32> {
    let mut answers: Vec<Vec<Instant>> = vec![Vec::new(); nodes];
    for b in beats {
        if b.outcome == Outcome::Answered {
            if let Some(a) = answers.get_mut(b.node as usize) {
                a.push(b.ended());
            }
        }
    }
    let mut silent = Vec::new();
    for (node, mut at) in answers.into_iter().enumerate() {
        at.sort();
        // The last answer before the window counts: silence may begin there.
        let before = at.iter().rev().find(|t| **t < from).copied();
        let mut last = before;
        let mut went_silent = false;
        for t in at.iter().filter(|t| (from..to).contains(*t)) {
            if last.is_some_and(|l| *t - l > timeout) {
                went_silent = true;
            }
            last = Some(*t);
        }
        // And from the last answer to the window's end.
        if last.is_none_or(|l| to - l > timeout) {
            went_silent = true;
        }
        if went_silent {
            silent.push(node as u32);
        }
    }
    silent
}

/// SplitMix64: enough to pick VMs at random for the broker without a crate.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn beat(node: u32, t0: Instant, start_ms: u64, took_ms: u64, outcome: Outcome) -> Beat {
        Beat {
            node,
            started: t0 + Duration::from_millis(start_ms),
            took: Duration::from_millis(took_ms),
            outcome,
            woken: false,
        }
    }

    #[test]
    fn a_window_counts_answers_that_arrived_in_it_and_times_those_that_started_in_it() {
        let t0 = Instant::now();
        let beats = [
            // Started before, answered inside: served in the window, not timed.
            beat(0, t0, 900, 200, Outcome::Answered),
            beat(0, t0, 1_100, 10, Outcome::Answered),
            beat(1, t0, 1_200, 30, Outcome::Answered),
            // Started inside, answered after: timed, not served in it.
            beat(1, t0, 1_950, 100, Outcome::Answered),
            beat(2, t0, 1_500, 10_000, Outcome::TimedOut),
            beat(3, t0, 1_600, 5, Outcome::Failed),
            // Outside.
            beat(0, t0, 2_500, 10, Outcome::Answered),
        ];
        let s = summarize(&beats, t0 + Duration::from_secs(1), t0 + Duration::from_secs(2));
        assert_eq!((s.answered, s.timed_out, s.failed), (3, 1, 1));
        assert_eq!(s.latencies.len(), 5);
        assert_eq!(s.latencies.p50(), Duration::from_millis(30));
        assert_eq!(s.latencies.p99(), Duration::from_millis(10_000));
    }

    #[test]
    fn cpu_is_divided_by_events_and_by_wall_time() {
        assert_eq!(per_event(1.3, 100), Some(Duration::from_millis(13)));
        assert_eq!(per_event(1.0, 0), None);
        assert_eq!(per_event(0.05, 1_000), Some(Duration::from_micros(50)));
        assert!((core_share(54.0, Duration::from_secs(30)) - 1.8).abs() < 1e-9);
        assert_eq!(core_share(1.0, Duration::ZERO), 0.0);
        // 3 CPU-s of broker phase, 100 heartbeats answered at 10 ms each.
        assert!((net_of(3.0, Some(Duration::from_millis(10)), 100) - 2.0).abs() < 1e-9);
        assert_eq!(net_of(0.5, Some(Duration::from_millis(10)), 100), 0.0);
        assert_eq!(net_of(0.5, None, 0), 0.5);
        assert!(net_is_signal(2.0, 3.0) && !net_is_signal(0.2, 3.0) && !net_is_signal(0.0, 0.0));
        assert_eq!(expected_rate(100, Duration::from_secs(2)), 50.0);
    }

    #[test]
    fn a_node_is_silent_when_answers_are_further_apart_than_the_timeout() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(10);
        let beats = [
            // Node 0: every 2 s, fine.
            beat(0, t0, 0, 10, Outcome::Answered),
            beat(0, t0, 2_000, 10, Outcome::Answered),
            beat(0, t0, 4_000, 10, Outcome::Answered),
            beat(0, t0, 19_000, 10, Outcome::Answered),
            // Node 1: a 12 s gap inside the window.
            beat(1, t0, 1_000, 10, Outcome::Answered),
            beat(1, t0, 13_000, 10, Outcome::Answered),
            beat(1, t0, 19_000, 10, Outcome::Answered),
            // Node 2: timeouts only after its first answer.
            beat(2, t0, 500, 10, Outcome::Answered),
            beat(2, t0, 3_000, 10_000, Outcome::TimedOut),
            // Node 3 never answers.
        ];
        let from = t0 + Duration::from_secs(3);
        let to = t0 + Duration::from_secs(14);
        assert_eq!(silent_nodes(&beats, 4, timeout, from, to), vec![1, 2, 3]);
    }

    #[test]
    fn the_generator_stays_in_range_and_spreads() {
        let mut r = Rng::new(7);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            seen[r.below(10)] += 1;
        }
        assert!(seen.iter().all(|n| (800..1_200).contains(n)), "{seen:?}");
        assert_eq!(Rng::new(7).next_u64(), Rng::new(7).next_u64());
    }
}
