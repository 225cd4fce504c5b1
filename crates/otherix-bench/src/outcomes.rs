//! What an attacker of the soak got back, counted by outcome (`heartbeat
//! 429`, `relay opened`, ...): its tasks add to it as they go, the soak
//! reads it at both ends of a phase.

use std::collections::BTreeMap;
use std::sync::Mutex;

/// Counts per outcome; shared by an attacker's tasks.
#[derive(Debug, Default)]
pub struct Outcomes(Mutex<BTreeMap<String, u64>>);

impl Outcomes {
    /// One more `outcome`.
    pub fn add(&self, outcome: impl Into<String>) {
        *self.lock().entry(outcome.into()).or_default() += 1;
    }

    /// How many `outcome`s so far.
    pub fn count(&self, outcome: &str) -> u64 {
        self.lock().get(outcome).copied().unwrap_or(0)
    }

    /// Every count now.
    pub fn snapshot(&self) -> BTreeMap<String, u64> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, u64>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What happened between two snapshots (outcomes with none between left out).
pub fn since(now: &BTreeMap<String, u64>, earlier: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    now.iter()
        .map(|(k, v)| (k.clone(), v - earlier.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// `429 12, 200 3` style, the largest first; `none` when empty.
pub fn render(counts: &BTreeMap<String, u64>) -> String {
    if counts.is_empty() {
        return "none".into();
    }
    let mut v: Vec<_> = counts.iter().collect();
    v.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    v.iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_since_a_snapshot_count_only_what_happened_between() {
        let o = Outcomes::default();
        o.add("heartbeat 200");
        o.add("heartbeat 429");
        let earlier = o.snapshot();
        o.add("heartbeat 429");
        o.add("heartbeat 429");
        o.add("certificate 429");
        let between = since(&o.snapshot(), &earlier);
        assert_eq!(
            between,
            BTreeMap::from([
                ("heartbeat 429".to_string(), 2),
                ("certificate 429".to_string(), 1)
            ])
        );
        assert_eq!(render(&between), "heartbeat 429 2, certificate 429 1");
        assert_eq!(render(&BTreeMap::new()), "none");
        assert_eq!(o.count("heartbeat 429"), 3);
    }
}
