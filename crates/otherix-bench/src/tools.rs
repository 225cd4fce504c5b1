//! The outside programs the benchmark drives, checked before anything is
//! built, and the file-descriptor limit that 10,000 sessions need.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::bail;

use crate::bed::Purpose;

/// nginx's stream module as Debian ships it (`libnginx-mod-stream`).
pub const STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

/// Open files allowed to this process and, by inheritance, to every process
/// of the testbed (the gateway agent holds two per session, the guest one).
pub const NOFILE: u64 = 65_536;

/// Fails with what to install when a tool is missing (apt packages, and
/// `cargo install websocat`); otherwise returns websocat's path. The soak
/// needs only the testbed's own tools (and no websocat).
pub fn preflight(websocat: Option<&Path>, purpose: Purpose) -> anyhow::Result<Option<PathBuf>> {
    let speed = purpose == Purpose::Speed;
    let mut missing: Vec<&str> = Vec::new();
    for (program, package, for_soak) in [
        ("nginx", "nginx", false),
        ("socat", "socat", false),
        ("iperf3", "iperf3", false),
        ("websockify", "websockify", false),
        ("openssl", "openssl", false),
        ("prlimit", "util-linux", true),
        ("ip", "iproute2", true),
        ("nsenter", "util-linux", true),
    ] {
        if (speed || for_soak) && which(program).is_none() && !missing.contains(&package) {
            missing.push(package);
        }
    }
    if speed && !Path::new(STREAM_MODULE).is_file() {
        missing.push("libnginx-mod-stream");
    }
    let websocat = match websocat {
        Some(p) if p.is_file() => Some(p.to_path_buf()),
        Some(p) => bail!(
            "no websocat at {}\nhint: cargo install websocat (or leave out --websocat)",
            p.display()
        ),
        None => find_websocat(),
    };
    let mut hints = Vec::new();
    if !missing.is_empty() {
        hints.push(format!("apt-get install {}", missing.join(" ")));
    }
    if speed && websocat.is_none() {
        hints.push(
            "cargo install websocat (found on PATH, in $CARGO_HOME/bin, ~/.cargo/bin or /root/.cargo/bin; or pass --websocat PATH)".into(),
        );
    }
    if !hints.is_empty() {
        bail!("missing tools; install them with:\n  {}", hints.join("\n  "));
    }
    Ok(websocat)
}

/// websocat on `PATH`, or where `cargo install` puts it (`sudo` usually
/// drops `~/.cargo/bin` from `PATH`).
fn find_websocat() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let path: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    let cargo_dirs = [
        env("CARGO_HOME").map(|h| h.join("bin")),
        env("HOME").map(|h| h.join(".cargo/bin")),
        env("SUDO_USER").map(|u| PathBuf::from("/home").join(u).join(".cargo/bin")),
        Some(PathBuf::from("/root/.cargo/bin")),
    ];
    let dirs: Vec<PathBuf> = path.into_iter().chain(cargo_dirs.into_iter().flatten()).collect();
    first_file(&dirs, "websocat", |p| p.is_file())
}

/// The first `dir/program` among `dirs` for which `exists` holds.
fn first_file(dirs: &[PathBuf], program: &str, exists: impl Fn(&Path) -> bool) -> Option<PathBuf> {
    dirs.iter().map(|d| d.join(program)).find(|p| exists(p))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_directory_holding_the_program_wins() {
        let dirs = [
            PathBuf::from("/usr/bin"),
            PathBuf::from("/root/.cargo/bin"),
            PathBuf::from("/home/me/.cargo/bin"),
        ];
        let found = first_file(&dirs, "websocat", |p| {
            p.starts_with("/root") || p.starts_with("/home")
        });
        assert_eq!(found, Some(PathBuf::from("/root/.cargo/bin/websocat")));
        assert_eq!(first_file(&dirs, "websocat", |_| false), None);
    }
}
