//! The arithmetic of the runtime comparison, pure: what the source agent's
//! log says a QEMU migration took, the echo stream's longest silence within
//! a migration's window, percentiles with their spread, and what a guest's
//! serial console says about boots and kernel oopses.

use std::time::{Duration, Instant};

/// The source agent's line once QEMU reports a migration completed
/// (`otherix-agent` `runtime/qemu`), with QEMU's own `query-migrate` figures.
pub const COMPLETED: &str = "QEMU migration completed";

/// What QEMU said about one completed migration. QEMU may leave a figure
/// out (the agent then logs `None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QemuMigration {
    /// The guest stopped: from the source pausing it to the target running it.
    pub downtime: Option<Duration>,
    /// From `migrate` to completion.
    pub total: Option<Duration>,
    /// RAM bytes sent (`ram.transferred`).
    pub bytes: Option<u64>,
}

/// Every [`COMPLETED`] line for VM `vm_id` in an agent's log, in order.
pub fn completed_migrations(log: &str, vm_id: &str) -> Vec<QemuMigration> {
    log.lines().filter_map(|l| parse_completed(l, vm_id)).collect()
}

/// One [`COMPLETED`] line, if it is about `vm_id`. The agent logs text
/// with `key=value` fields after the message; a figure is `Some(N)` or `None`
/// (it is an `Option` logged with `?`), or a bare number.
pub fn parse_completed(line: &str, vm_id: &str) -> Option<QemuMigration> {
    let (_, fields) = line.split_once(COMPLETED)?;
    let mut found = QemuMigration::default();
    let mut this_vm = false;
    for word in fields.split_whitespace() {
        let Some((key, value)) = word.split_once('=') else {
            continue;
        };
        let number = || -> Option<u64> {
            let v = value.trim_matches('"');
            let v = v
                .strip_prefix("Some(")
                .and_then(|v| v.strip_suffix(')'))
                .unwrap_or(v);
            v.parse().ok()
        };
        match key {
            "vm_id" => this_vm = value.trim_matches('"') == vm_id,
            "downtime_ms" => found.downtime = number().map(Duration::from_millis),
            "total_ms" => found.total = number().map(Duration::from_millis),
            "bytes" => found.bytes = number(),
            _ => {}
        }
    }
    this_vm.then_some(found)
}

/// The agent's line when a QEMU guest's process ended on its own (a guest
/// kernel panic ends it: QEMU runs with `-no-reboot`) and is started again.
pub const RESTARTED: &str = "QEMU guest ended; starting it again";

/// How many times an agent's log says it started VM `vm_id`'s QEMU again.
pub fn restarts(log: &str, vm_id: &str) -> usize {
    let id = format!("vm_id={vm_id}");
    log.lines()
        .filter(|l| l.contains(RESTARTED) && l.split_whitespace().any(|w| w == id))
        .count()
}

/// A silence of the echo stream: from one arrival (`after`) until the next,
/// `long`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Silence {
    pub after: Instant,
    pub long: Duration,
}

/// The longest silence that overlaps `[from, to)` (a migration's window),
/// whole even where it began before `from` or ended after `to`: what a
/// client saw around that migration. Zero when none overlaps.
pub fn longest_silence(silences: &[Silence], from: Instant, to: Instant) -> Duration {
    silences
        .iter()
        .filter(|s| s.after < to && s.after + s.long > from)
        .map(|s| s.long)
        .max()
        .unwrap_or(Duration::ZERO)
}

/// A sample's median, 99th percentile (nearest rank: over 20 samples, the
/// largest), and its smallest and largest values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spread<T> {
    pub p50: T,
    pub p99: T,
    pub min: T,
    pub max: T,
    pub n: usize,
}

impl<T: Copy + Ord> Spread<T> {
    /// `None` for an empty sample.
    pub fn of(mut samples: Vec<T>) -> Option<Spread<T>> {
        if samples.is_empty() {
            return None;
        }
        samples.sort();
        let rank = |q: f64| {
            let r = (q * samples.len() as f64).ceil() as usize;
            samples[r.clamp(1, samples.len()) - 1]
        };
        Some(Spread {
            p50: rank(0.50),
            p99: rank(0.99),
            min: samples[0],
            max: samples[samples.len() - 1],
            n: samples.len(),
        })
    }
}

/// The line the guest's init prints on the console each time it boots
/// (`otherix-agent` `runtime/qemu/init.sh`; the kernel itself boots `quiet`).
pub const BOOTED: &str = "otherix guest ";
const BOOTED_TAIL: &str = " ready:";

/// How many times the guest booted, by its console.
pub fn boots(console: &str) -> usize {
    console
        .lines()
        .filter(|l| l.contains(BOOTED) && l.contains(BOOTED_TAIL))
        .count()
}

/// The console's lines that say the guest kernel hit trouble (printed even
/// with `quiet`: these are emergency and alert levels).
pub fn kernel_trouble(console: &str) -> Vec<String> {
    const SIGNS: [&str; 7] = [
        "Oops",
        "BUG:",
        "kernel BUG at",
        "Kernel panic",
        "general protection fault",
        "WARNING: CPU:",
        "Call Trace",
    ];
    console
        .lines()
        .filter(|l| SIGNS.iter().any(|s| l.contains(s)))
        .map(|l| l.trim_end().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LINE: &str = "2026-12-05T10:41:07.123456Z  INFO QEMU migration completed; the source QEMU ends vm_id=4f2a9c downtime_ms=Some(12) total_ms=Some(2840) bytes=Some(70123456)";

    #[test]
    fn a_completed_line_gives_qemus_own_figures() {
        assert_eq!(
            parse_completed(LINE, "4f2a9c"),
            Some(QemuMigration {
                downtime: Some(Duration::from_millis(12)),
                total: Some(Duration::from_millis(2840)),
                bytes: Some(70_123_456),
            })
        );
    }

    #[test]
    fn another_vms_line_or_another_message_is_not_ours() {
        assert_eq!(parse_completed(LINE, "77"), None);
        assert_eq!(
            parse_completed(
                "INFO QEMU migration started vm_id=4f2a9c to=10.0.0.3:4000",
                "4f2a9c"
            ),
            None
        );
    }

    #[test]
    fn a_figure_qemu_left_out_stays_unknown() {
        let line = "INFO reconcile{node=node1}: QEMU migration completed; the source QEMU ends vm_id=\"ab\" downtime_ms=None total_ms=913 bytes=Some(5)";
        assert_eq!(
            parse_completed(line, "ab"),
            Some(QemuMigration {
                downtime: None,
                total: Some(Duration::from_millis(913)),
                bytes: Some(5),
            })
        );
    }

    #[test]
    fn every_completed_line_of_a_log_is_found_in_order() {
        let log = format!(
            "{LINE}\nINFO guest handed over vm_id=4f2a9c\n{}\n",
            LINE.replace("Some(12)", "Some(7)")
        );
        let found = completed_migrations(&log, "4f2a9c");
        assert_eq!(found.len(), 2);
        assert_eq!(found[1].downtime, Some(Duration::from_millis(7)));
    }

    #[test]
    fn an_agents_restarts_of_a_guest_are_counted() {
        let log = "2026-12-04T11:07:07.218190Z  WARN QEMU guest ended; starting it again vm_id=6766 restart_in=1s\n\
                   2026-12-04T11:07:08.298698Z  INFO QEMU guest started vm_id=6766 pid=28486\n\
                   2026-12-04T11:09:07.218190Z  WARN QEMU guest ended; starting it again vm_id=67661 restart_in=1s\n";
        assert_eq!(restarts(log, "6766"), 1);
        assert_eq!(restarts(log, "99"), 0);
    }

    #[test]
    fn a_migration_sees_the_longest_silence_that_overlaps_its_window() {
        let t = Instant::now();
        let at = |ms: u64| t + Duration::from_millis(ms);
        let silence = |after: u64, long: u64| Silence {
            after: at(after),
            long: Duration::from_millis(long),
        };
        let silences = [
            silence(100, 5),
            silence(900, 400), // begins before the window, ends in it
            silence(1500, 220),
            silence(3100, 900), // after the window
        ];
        assert_eq!(
            longest_silence(&silences, at(1000), at(3000)),
            Duration::from_millis(400)
        );
        assert_eq!(
            longest_silence(&silences, at(1400), at(3000)),
            Duration::from_millis(220)
        );
        assert_eq!(longest_silence(&silences, at(5000), at(6000)), Duration::ZERO);
    }

    #[test]
    fn the_spread_of_twenty_has_the_largest_as_p99() {
        let s = Spread::of((1..=20u64).rev().collect()).unwrap();
        assert_eq!((s.p50, s.p99, s.min, s.max, s.n), (10, 20, 1, 20, 20));
        let one = Spread::of(vec![Duration::from_millis(3)]).unwrap();
        assert_eq!(
            (one.p50, one.p99),
            (Duration::from_millis(3), Duration::from_millis(3))
        );
        assert_eq!(Spread::<u64>::of(Vec::new()), None);
    }

    #[test]
    fn the_console_tells_boots_and_oopses() {
        let console = "otherix guest bq-qemu ready: 10.150.0.5/24\n\
                       [  812.1] BUG: kernel NULL pointer dereference, address: 0000000000000008\n\
                       [  812.1] Oops: 0000 [#1] PREEMPT SMP NOPTI\n\
                       otherix guest bq-qemu ready: 10.150.0.5/24\n";
        assert_eq!(boots(console), 2);
        assert_eq!(kernel_trouble(console).len(), 2);
        assert!(kernel_trouble("otherix guest x ready: 10.0.0.2/24\nhello\n").is_empty());
        // As a guest printed it after a migration (issue #28).
        let panic = "[   46.372051] list_del corruption, fffff7f4c00ba608->next is NULL\r\n\
                     [   46.376512] kernel BUG at lib/list_debug.c:49!\r\n\
                     [   46.387959] Kernel panic - not syncing: Fatal exception in interrupt\r\n";
        assert_eq!(
            kernel_trouble(panic),
            vec![
                "[   46.376512] kernel BUG at lib/list_debug.c:49!",
                "[   46.387959] Kernel panic - not syncing: Fatal exception in interrupt"
            ]
        );
    }
}
