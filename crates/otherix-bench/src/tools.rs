//! The outside programs the benchmark drives, checked before anything is
//! built, and the file-descriptor limit that 10,000 sessions need.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::bail;

/// nginx's stream module as Debian ships it (`libnginx-mod-stream`).
pub const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// Open files allowed to this process and, by inheritance, to every process
/// of the testbed (the gateway agent holds two per session, the guest one).
pub const NOFILE: u64 = 65_536;

/// Fails with one line naming the apt packages to install when a tool is missing.
pub fn preflight() -> anyhow::Result<()> {
    let mut missing: Vec<&str> = Vec::new();
    for (program, package) in [
        ("nginx", "nginx"),
        ("socat", "socat"),
        ("iperf3", "iperf3"),
        ("prlimit", "util-linux"),
        ("ip", "iproute2"),
        ("nsenter", "util-linux"),
    ] {
        if which(program).is_none() && !missing.contains(&package) {
            missing.push(package);
        }
    }
    if !Path::new(STREAM_MODULE).is_file() {
        missing.push("libnginx-mod-stream");
    }
    if !missing.is_empty() {
        bail!(
            "missing tools; install them with: apt-get install {}",
            missing.join(" ")
        );
    }
    Ok(())
}

/// `program` on `PATH`.
pub fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(program))
            .find(|p| p.is_file())
    })
}

/// Raises this process's open-file limit (soft and hard) to `n` with
/// `prlimit`, so the processes it spawns inherit it. Without
/// `CAP_SYS_RESOURCE` the hard limit cannot rise: the soft limit is raised to
/// it instead, and the memory figure then opens as many sessions as fit.
pub fn raise_nofile_limit(n: u64) {
    if prlimit_nofile(n, n).is_ok() {
        return;
    }
    let Some(hard) = nofile_limits(std::process::id()).map(|(_, hard)| hard) else {
        return;
    };
    match prlimit_nofile(hard.min(n), hard) {
        Ok(()) => eprintln!(
            "otherix-bench: note: the open-file limit stays at {hard} (raising it needs CAP_SYS_RESOURCE)"
        ),
        Err(e) => eprintln!("otherix-bench: warning: cannot raise the open-file limit: {e}"),
    }
}

fn prlimit_nofile(soft: u64, hard: u64) -> Result<(), String> {
    let pid = std::process::id().to_string();
    let limit = format!("--nofile={soft}:{hard}");
    match Command::new("prlimit").args(["--pid", &pid, &limit]).output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        Err(e) => Err(format!("cannot run prlimit: {e}")),
    }
}

/// The soft and hard open-file limits of `pid`, as the kernel reports them.
pub fn nofile_limits(pid: u32) -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    let mut fields = line.split_whitespace().skip(3);
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// How many files `pid` has open now.
pub fn open_files(pid: u32) -> Option<u64> {
    Some(std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64)
}
