//! CPU time and resident memory of processes, from `/proc`.

use std::io;
use std::sync::OnceLock;

/// CPU time (user + system) of `pid`, in seconds; with `children`, plus that
/// of its children it has already waited for (socat forks one per connection).
pub fn cpu_seconds(pid: u32, children: bool) -> io::Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let ticks = parse_stat_ticks(&stat, children)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("odd /proc/{pid}/stat")))?;
    Ok(ticks as f64 / clock_ticks() as f64)
}

/// utime + stime (+ cutime + cstime) from a `/proc/PID/stat` line.
fn parse_stat_ticks(stat: &str, children: bool) -> Option<u64> {
    // The command name (field 2) may hold spaces and parentheses: fields
    // are counted from the last ')'. After it, field 3 (state) is index 0,
    // so utime (14), stime (15), cutime (16), cstime (17) are 11..=14.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |i: usize| fields.get(i)?.parse::<u64>().ok();
    let own = field(11)? + field(12)?;
    Some(if children {
        own + field(13)? + field(14)?
    } else {
        own
    })
}

/// Resident set size of `pid` in bytes (`VmRSS`).
pub fn rss_bytes(pid: u32) -> io::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib * 1024)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("no VmRSS for {pid}")))
}

/// Direct children of `pid` (all its threads').
pub fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// `sysconf(_SC_CLK_TCK)`, through `getconf` (100 on every Linux we know).
fn clock_ticks() -> u64 {
    static TICKS: OnceLock<u64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_are_counted_after_the_command_name() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime cutime cstime ...
        let stat = "42 (a (weird) name) S 1 42 42 0 -1 4194560 10 0 0 0 250 50 7 3 20 0 1 0";
        assert_eq!(parse_stat_ticks(stat, false), Some(300));
        assert_eq!(parse_stat_ticks(stat, true), Some(310));
        assert_eq!(parse_stat_ticks("garbage", false), None);
    }

    #[test]
    fn this_process_has_a_resident_size() {
        assert!(rss_bytes(std::process::id()).unwrap() > 0);
        assert!(cpu_seconds(std::process::id(), false).is_ok());
    }
}
