//! Reading the daemons' Prometheus `/metrics` text: counters and latency
//! histograms, the difference of two scrapes (what happened between them),
//! and quantiles estimated from bucket counts the way Prometheus's
//! `histogram_quantile` does (linear within the bucket).

use std::time::Duration;

/// One scrape: `(name, labels, value)` per sample line.
#[derive(Debug, Clone, Default)]
pub struct Scrape(Vec<(String, String, f64)>);

impl Scrape {
    /// Parses the text format; comment lines and lines that do not parse
    /// are skipped.
    pub fn parse(text: &str) -> Scrape {
        let samples = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter_map(|l| {
                let (series, value) = l.trim().rsplit_once(' ')?;
                let value: f64 = value.parse().ok()?;
                let (name, labels) = match series.split_once('{') {
                    Some((n, rest)) => (n, rest.strip_suffix('}')?),
                    None => (series, ""),
                };
                Some((name.to_string(), labels.to_string(), value))
            })
            .collect();
        Scrape(samples)
    }

    /// The sum of `name` over the series whose labels contain every one
    /// of `having` (`key="value"` strings).
    pub fn sum(&self, name: &str, having: &[&str]) -> f64 {
        self.0
            .iter()
            .filter(|(n, labels, _)| n == name && having.iter().all(|h| labels.contains(h)))
            .map(|(_, _, v)| v)
            .sum()
    }

    /// Every value of label `key` that `name` has over the series whose
    /// labels contain every one of `having` (`key="value"` strings), with
    /// its summed value.
    pub fn by_label_where(&self, name: &str, key: &str, having: &[&str]) -> Vec<(String, f64)> {
        let mut out: Vec<(String, f64)> = Vec::new();
        for (n, labels, v) in &self.0 {
            if n != name || !having.iter().all(|h| labels.contains(h)) {
                continue;
            }
            let Some(value) = label(labels, key) else {
                continue;
            };
            match out.iter_mut().find(|(k, _)| *k == value) {
                Some((_, sum)) => *sum += v,
                None => out.push((value.to_string(), *v)),
            }
        }
        out
    }

    /// Histogram `name` (its `_bucket` series, summed over other labels).
    pub fn histogram(&self, name: &str) -> Histogram {
        let bucket = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for (n, labels, v) in &self.0 {
            if *n != bucket {
                continue;
            }
            let Some(le) = label(labels, "le").and_then(parse_le) else {
                continue;
            };
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some((_, count)) => *count += v,
                None => buckets.push((le, *v)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram { buckets }
    }
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"'))
    })
}

fn parse_le(le: &str) -> Option<f64> {
    if le == "+Inf" {
        Some(f64::INFINITY)
    } else {
        le.parse().ok()
    }
}

/// Cumulative bucket counts `(upper bound in seconds, count)`, ascending.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// What was recorded after `earlier` (same buckets; missing ones count 0).
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let buckets = self
            .buckets
            .iter()
            .map(|(le, count)| {
                let before = earlier
                    .buckets
                    .iter()
                    .find(|(b, _)| b == le)
                    .map_or(0.0, |(_, c)| *c);
                (*le, (count - before).max(0.0))
            })
            .collect();
        Histogram { buckets }
    }

    /// Both histograms' observations together (buckets of either).
    pub fn plus(&self, other: &Histogram) -> Histogram {
        let mut buckets = self.buckets.clone();
        for (le, count) in &other.buckets {
            match buckets.iter_mut().find(|(b, _)| b == le) {
                Some((_, c)) => *c += count,
                None => buckets.push((*le, *count)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Histogram { buckets }
    }

    pub fn count(&self) -> u64 {
        self.buckets.last().map_or(0, |(_, c)| *c as u64)
    }

    /// The `q` quantile, interpolated within its bucket; past the last
    /// finite bound, that bound. `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        let total = self.buckets.last()?.1;
        if total <= 0.0 {
            return None;
        }
        let rank = q * total;
        let (mut lower, mut below) = (0.0, 0.0);
        for &(le, count) in &self.buckets {
            if count >= rank && count > below {
                if le.is_infinite() {
                    return Some(Duration::from_secs_f64(lower));
                }
                let share = (rank - below) / (count - below);
                return Some(Duration::from_secs_f64(lower + (le - lower) * share));
            }
            (lower, below) = (le, count);
        }
        Some(Duration::from_secs_f64(lower))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# TYPE otherix_agent_heartbeats_total counter
otherix_agent_heartbeats_total{result="ok"} 40
otherix_agent_heartbeats_total{result="failed"} 2
# TYPE otherix_agent_heartbeat_duration_seconds histogram
otherix_agent_heartbeat_duration_seconds_bucket{le="0.001"} 0
otherix_agent_heartbeat_duration_seconds_bucket{le="0.0025"} 10
otherix_agent_heartbeat_duration_seconds_bucket{le="0.005"} 30
otherix_agent_heartbeat_duration_seconds_bucket{le="0.01"} 40
otherix_agent_heartbeat_duration_seconds_bucket{le="+Inf"} 42
otherix_agent_heartbeat_duration_seconds_sum 0.2
otherix_agent_heartbeat_duration_seconds_count 42
otherix_connections_refused_total{reason="max_connections_per_ip"} 7
otherix_ingress_connections_refused_total{server="gateway",reason="handshake_timeout"} 5
otherix_ingress_connections_refused_total{server="relay",reason="handshake_timeout"} 3
"#;

    #[test]
    fn counters_are_summed_over_the_chosen_labels() {
        let s = Scrape::parse(TEXT);
        assert_eq!(s.sum("otherix_agent_heartbeats_total", &[]), 42.0);
        assert_eq!(
            s.sum("otherix_agent_heartbeats_total", &[r#"result="failed""#]),
            2.0
        );
        assert_eq!(s.sum("nothing_total", &[]), 0.0);
        assert_eq!(
            s.by_label_where("otherix_connections_refused_total", "reason", &[]),
            vec![("max_connections_per_ip".to_string(), 7.0)]
        );
        assert_eq!(
            s.by_label_where(
                "otherix_ingress_connections_refused_total",
                "reason",
                &[r#"server="gateway""#]
            ),
            vec![("handshake_timeout".to_string(), 5.0)]
        );
    }

    #[test]
    fn quantiles_interpolate_within_the_bucket() {
        let h = Scrape::parse(TEXT).histogram("otherix_agent_heartbeat_duration_seconds");
        assert_eq!(h.count(), 42);
        // Rank 21 of 42 falls in (2.5 ms, 5 ms], 11 of its 20.
        let p50 = h.quantile(0.5).unwrap().as_secs_f64();
        assert!((p50 - (0.0025 + 0.0025 * 11.0 / 20.0)).abs() < 1e-9, "{p50}");
        // Rank 41.58 is past the last finite bound: that bound.
        assert_eq!(h.quantile(0.99), Some(Duration::from_millis(10)));
        assert_eq!(Histogram::default().quantile(0.5), None);
        assert_eq!(Histogram::default().plus(&h).plus(&h).count(), 84);
    }

    #[test]
    fn the_difference_of_two_scrapes_is_what_happened_between_them() {
        let before = Scrape::parse(TEXT).histogram("otherix_agent_heartbeat_duration_seconds");
        let later = TEXT
            .replace(r#"le="0.0025"} 10"#, r#"le="0.0025"} 20"#)
            .replace(r#"le="0.005"} 30"#, r#"le="0.005"} 40"#)
            .replace(r#"le="0.01"} 40"#, r#"le="0.01"} 50"#)
            .replace(r#"le="+Inf"} 42"#, r#"le="+Inf"} 52"#);
        let after = Scrape::parse(&later).histogram("otherix_agent_heartbeat_duration_seconds");
        let d = after.since(&before);
        assert_eq!(d.count(), 10);
        // All ten fell in (1 ms, 2.5 ms].
        let p99 = d.quantile(0.99).unwrap().as_secs_f64();
        assert!(p99 > 0.001 && p99 <= 0.0025, "{p99}");
    }
}
