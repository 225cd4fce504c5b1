//! Thin wrappers over `ip`, `kill` and `/proc`: the only places the testbed touches the host.

use std::ffi::OsStr;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::{Error, Result, WORLD_ENV};

/// Where `ip netns add` mounts named namespaces.
pub(crate) const NETNS_DIR: &str = "/run/netns";

/// Checks what every world needs from the host: root, `ip`, `nsenter` and `kill`.
pub(crate) fn preflight() -> Result<()> {
    let euid = effective_uid();
    if euid.as_deref() != Some("0") {
        return Err(Error::NotRoot {
            euid: euid.unwrap_or_else(|| "unknown".to_owned()),
        });
    }
    let probe = |tool: &'static str, arg: &str, hint: &'static str| {
        Command::new(tool)
            .arg(arg)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(drop)
            .map_err(|source| Error::MissingTool { tool, hint, source })
    };
    probe("ip", "-V", "install iproute2 (`apt-get install iproute2`)")?;
    probe(
        "nsenter",
        "--version",
        "install util-linux (`apt-get install util-linux`)",
    )?;
    probe("kill", "-l", "install procps (`apt-get install procps`)")?;
    Ok(())
}

/// The effective uid, from `/proc/self/status` (std has no `geteuid`).
pub(crate) fn effective_uid() -> Option<String> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    // Uid: real effective saved fs
    line.split_whitespace().nth(2).map(str::to_owned)
}

/// `cmd` as a shell-like string, for errors and the world log.
pub(crate) fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `cmd` to completion with stdin closed, capturing its output.
pub(crate) fn output(cmd: &mut Command) -> Result<Output> {
    cmd.stdin(Stdio::null())
        .output()
        .map_err(Error::io(format!("could not run `{}`", describe(cmd))))
}

/// Runs `cmd` and returns its stdout, or an error carrying its stderr if it failed.
pub(crate) fn checked(cmd: &mut Command) -> Result<String> {
    let out = output(cmd)?;
    if !out.status.success() {
        return Err(Error::Command {
            command: describe(cmd),
            status: out.status,
            stderr: first_lines(&String::from_utf8_lossy(&out.stderr)),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The first lines of a command's stderr: enough to say why, without a usage screen.
pub(crate) fn first_lines(stderr: &str) -> String {
    const LINES: usize = 5;
    let mut lines: Vec<&str> = stderr.trim().lines().take(LINES + 1).collect();
    if lines.len() > LINES {
        lines[LINES] = "...";
    }
    lines.join("\n")
}

/// `ip ARGS...`, failing on a non-zero exit.
pub(crate) fn ip(args: &[&str]) -> Result<String> {
    checked(Command::new("ip").args(args))
}

/// `ip ARGS...` during teardown: a failure is not an error (the thing may be gone already).
fn ip_quiet(args: &[&str]) -> bool {
    Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Sends `signal` (a name such as `KILL`) to a whole process group.
pub(crate) fn signal_group(pgid: u32, signal: &str) {
    signal_raw(&[format!("-{pgid}")], signal);
}

/// Sends `signal` to each of `pids`.
pub(crate) fn signal_pids(pids: &[u32], signal: &str) {
    if !pids.is_empty() {
        signal_raw(&pids.iter().map(u32::to_string).collect::<Vec<_>>(), signal);
    }
}

fn signal_raw(targets: &[String], signal: &str) {
    // Errors mean "no such process" here: the target is gone, which is what we want.
    let _ = Command::new("kill")
        .args(["-s", signal, "--"])
        .args(targets)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The start time of `pid` (field 22 of `/proc/PID/stat`), or `None` if there is no such
/// live process (a zombie counts as dead). Together with the pid it names one process.
pub(crate) fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may hold spaces: split after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state), so field 22 (starttime) is fields[19].
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | None) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// Live processes in the process group `pgid`.
pub(crate) fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            let Some(close) = stat.rfind(')') else {
                return false;
            };
            // After the command name: state (field 3), ppid, pgrp (field 5).
            let fields: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            !matches!(fields.first(), Some(&"Z") | Some(&"X"))
                && fields.get(2) == Some(&pgid.to_string().as_str())
        })
        .collect()
}

/// SIGKILLs the process group `pgid` and waits (at most 3 s) until none of it is alive.
pub(crate) fn kill_group(pgid: u32) {
    signal_group(pgid, "KILL");
    kill_until_gone(|| group_members(pgid));
}

/// Live processes (other than this one) whose environment holds `WORLD_ENV=prefix`.
pub(crate) fn world_pids(prefix: &str) -> Vec<u32> {
    let needle = format!("{WORLD_ENV}={prefix}");
    let me = std::process::id();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != me)
        .filter(|pid| {
            // Zombies and exited processes have an empty environment: they never match.
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|var| var == needle.as_bytes()))
        })
        .collect()
}

/// The command line of `pid`, for reports.
pub(crate) fn cmdline(pid: u32) -> String {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&raw)
        .split('\0')
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// Names of all named network namespaces.
pub(crate) fn netns_names() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(NETNS_DIR) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .collect();
    names.sort();
    names
}

/// Pids of the processes inside a named namespace.
fn netns_pids(name: &str) -> Vec<u32> {
    let out = Command::new("ip")
        .args(["netns", "pids", name])
        .stdin(Stdio::null())
        .output();
    let Ok(out) = out else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Names of the links in the host (the current) namespace.
pub(crate) fn host_links() -> Vec<String> {
    let Ok(out) = ip(&["-o", "link", "show"]) else {
        return Vec::new();
    };
    parse_link_names(&out)
}

/// Parses `ip -o link show`: `5: oxa3f1h@if4: <BROADCAST,...> ...`.
fn parse_link_names(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|line| {
            let name = line.split(": ").nth(1)?;
            Some(name.split('@').next().unwrap_or(name).to_owned())
        })
        .collect()
}

/// Whether the namespace `name` belongs to the world with `prefix`.
pub(crate) fn netns_belongs(name: &str, prefix: &str) -> bool {
    name.strip_prefix(prefix)
        .is_some_and(|rest| rest.starts_with('-') || rest.starts_with('g'))
}

/// Everything of the world with `prefix` that still exists: namespaces, host links and
/// processes carrying the world's [`WORLD_ENV`] marker.
pub(crate) fn leftovers(prefix: &str) -> Vec<String> {
    let mut found: Vec<String> = netns_names()
        .into_iter()
        .filter(|n| netns_belongs(n, prefix))
        .map(|n| format!("netns {n}"))
        .collect();
    found.extend(
        host_links()
            .into_iter()
            .filter(|l| l.starts_with(prefix))
            .map(|l| format!("link {l}")),
    );
    found.extend(
        world_pids(prefix)
            .into_iter()
            .map(|p| format!("process {p} ({})", cmdline(p))),
    );
    found
}

/// Removes everything of the world with `prefix`: kills its processes, deletes its
/// namespaces (guests first, the fabric last) and its host links. Returns what is left.
pub(crate) fn teardown(prefix: &str) -> Vec<String> {
    // Processes first, so that no agent makes new guest namespaces while we delete them.
    kill_until_gone(|| world_pids(prefix));

    let mut namespaces: Vec<String> = netns_names()
        .into_iter()
        .filter(|n| netns_belongs(n, prefix))
        .collect();
    let fabric = format!("{prefix}-fab");
    // Guests (`Pg...`) sort before nodes (`P-...`) by rank; the fabric goes last.
    namespaces.sort_by_key(|n| (*n == fabric, !n[prefix.len()..].starts_with('g'), n.clone()));
    for ns in &namespaces {
        // A namespace outlives `ip netns del` while a process is inside: empty it first.
        kill_until_gone(|| netns_pids(ns));
        ip_quiet(&["netns", "del", ns]);
    }

    for link in host_links().into_iter().filter(|l| l.starts_with(prefix)) {
        ip_quiet(&["link", "del", &link]);
    }
    leftovers(prefix)
}

/// SIGKILLs whatever `pids` lists until it lists nothing, for at most 3 s.
fn kill_until_gone(mut pids: impl FnMut() -> Vec<u32>) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let found = pids();
        if found.is_empty() || Instant::now() >= deadline {
            return;
        }
        signal_pids(&found, "KILL");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_names_drop_the_peer_suffix() {
        let out = "1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536\n\
                   5: oxa3f1h@if4: <BROADCAST,MULTICAST> mtu 1500 qdisc noop\n";
        assert_eq!(parse_link_names(out), ["lo", "oxa3f1h"]);
    }

    #[test]
    fn guest_and_node_namespaces_belong_but_other_worlds_do_not() {
        assert!(netns_belongs("oxa3f1-fab", "oxa3f1"));
        assert!(netns_belongs("oxa3f1-node1", "oxa3f1"));
        assert!(netns_belongs("oxa3f1g42", "oxa3f1"));
        assert!(!netns_belongs("oxa3f1", "oxa3f1"));
        assert!(!netns_belongs("oxa3f2-fab", "oxa3f1"));
        assert!(!netns_belongs("oxa3f1x", "oxa3f1"));
    }

    #[test]
    fn this_process_has_a_start_time() {
        assert!(process_start_time(std::process::id()).is_some());
    }
}
