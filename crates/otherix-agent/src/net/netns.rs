//! Named network namespaces, compatible with `ip netns`.
//!
//! A named namespace is a namespace kept alive by a bind mount of its nsfs inode at
//! `/run/netns/NAME`, exactly as `ip netns add` makes it, so `ip netns exec NAME ...`,
//! `ip -n NAME ...` and this module see the same namespaces.
//!
//! Why threads: a network namespace is a per-*thread* attribute. Creating one
//! (`unshare(CLONE_NEWNET)`) or entering one (`setns`) only affects the calling thread,
//! so we do both on short-lived dedicated threads and never move a tokio worker or
//! the main thread. Anything created on such a thread — a netlink socket, a TCP
//! socket, a child process — stays in that namespace after the thread is gone:
//! sockets are bound to the namespace they were created in, and a child inherits the
//! namespace of the thread that forked it. [`Netns::run`] is the one tool for all of
//! these. None of this needs `unsafe`: `nix` exposes `setns`, `unshare` and `mount`
//! as safe functions, and no `pre_exec` hook is needed to start a workload.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};

use super::NetError;

/// Where named namespaces are mounted (the `ip netns` convention).
pub const NETNS_DIR: &str = "/run/netns";

/// Serializes create/delete within this process: two concurrent creates of one name
/// would otherwise stack two mounts on one path, and a later delete would leave one.
static NETNS_LOCK: Mutex<()> = Mutex::new(());

/// An open handle on a named network namespace.
///
/// Holding it keeps the namespace alive even if its name is deleted meanwhile.
#[derive(Debug)]
pub struct Netns {
    name: String,
    file: File,
}

impl Netns {
    /// Opens the namespace mounted at `/run/netns/NAME`.
    pub fn open(name: &str) -> Result<Self, NetError> {
        validate_netns_name(name)?;
        let path = path_of(name);
        if !is_nsfs(&path) {
            return Err(NetError::NetnsNotFound {
                netns: name.to_owned(),
            });
        }
        let file = File::open(&path).map_err(|e| NetError::netns(name, "open", e))?;
        Ok(Self {
            name: name.to_owned(),
            file,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The namespace file descriptor, e.g. for `IFLA_NET_NS_FD`. Valid while `self` lives.
    pub fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Runs `f` on a fresh thread that has entered this namespace, and waits for it.
    ///
    /// Use it to create things that must live in the namespace: sockets, netlink
    /// connections, child processes. `f` blocks the caller until it returns, so keep
    /// it short: for long-running work, create the socket here and use it from
    /// any thread afterwards.
    /// A panic in `f` is propagated to the caller.
    pub fn run<T, F>(&self, f: F) -> Result<T, NetError>
    where
        F: FnOnce() -> T + Send,
        T: Send,
    {
        std::thread::scope(|s| {
            let thread = std::thread::Builder::new()
                .name(format!("netns-{}", self.name))
                .spawn_scoped(s, || -> Result<T, NetError> {
                    setns(&self.file, CloneFlags::CLONE_NEWNET)
                        .map_err(|e| NetError::netns(&self.name, "setns", e))?;
                    Ok(f())
                })
                .map_err(|e| NetError::netns(&self.name, "spawn thread", e))?;
            match thread.join() {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            }
        })
    }
}

/// Creates the named namespace if it does not exist. Returns `true` if it created it.
///
/// Like `ip netns add`: makes `/run/netns` a shared mount point, creates an empty
/// file, creates a namespace on a throwaway thread and bind-mounts it on the file.
/// A leftover file that is not a mount (a crash between the two steps) is reused.
pub fn create(name: &str) -> Result<bool, NetError> {
    validate_netns_name(name)?;
    let _lock = NETNS_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let path = path_of(name);
    if is_nsfs(&path) {
        return Ok(false);
    }
    fs::create_dir_all(NETNS_DIR).map_err(|e| NetError::netns(name, "mkdir /run/netns", e))?;
    make_run_dir_shared().map_err(|e| NetError::netns(name, "make /run/netns shared", e))?;
    OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o000)
        .open(&path)
        .map_err(|e| NetError::netns(name, "create mount point", e))?;

    let target = path.clone();
    let made = std::thread::Builder::new()
        .name("netns-create".into())
        .spawn(move || -> Result<(), (&'static str, Errno)> {
            // Only this thread moves to the new namespace; it exits right after the
            // bind mount, which is what keeps the namespace alive.
            unshare(CloneFlags::CLONE_NEWNET).map_err(|e| ("unshare", e))?;
            mount(
                Some("/proc/thread-self/ns/net"),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(|e| ("bind mount", e))
        })
        .map_err(|e| NetError::netns(name, "spawn thread", e))?
        .join();
    match made {
        Ok(Ok(())) => Ok(true),
        Ok(Err((op, e))) => {
            let _ = fs::remove_file(&path);
            Err(NetError::netns(name, op, e))
        }
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

/// Deletes the named namespace (unmount and remove the file). Returns `true` if it
/// existed. The kernel frees the namespace, and the links in it, once no process,
/// socket or open handle refers to it any more.
pub fn delete(name: &str) -> Result<bool, NetError> {
    validate_netns_name(name)?;
    let _lock = NETNS_LOCK.lock().unwrap_or_else(|p| p.into_inner());
    let path = path_of(name);
    if fs::symlink_metadata(&path).is_err() {
        return Ok(false);
    }
    // More than one mount may be stacked on the path (another tool raced us); peel
    // them all, bounded so a pathological mount table cannot loop us forever.
    for _ in 0..8 {
        match umount2(&path, MntFlags::MNT_DETACH) {
            Ok(()) => continue,
            Err(Errno::EINVAL) | Err(Errno::ENOENT) => break,
            Err(e) => return Err(NetError::netns(name, "unmount", e)),
        }
    }
    match fs::remove_file(&path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(true),
        Err(e) => Err(NetError::netns(name, "remove mount point", e)),
    }
}

/// Whether a namespace with this name is mounted.
pub fn exists(name: &str) -> bool {
    validate_netns_name(name).is_ok() && is_nsfs(&path_of(name))
}

/// Names of the mounted namespaces that start with `prefix`, sorted.
pub fn list(prefix: &str) -> Result<Vec<String>, NetError> {
    let entries = match fs::read_dir(NETNS_DIR) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(NetError::netns(NETNS_DIR, "list", e)),
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix) && is_nsfs(&path_of(n)))
        .collect();
    names.sort();
    Ok(names)
}

/// Processes whose network namespace is the named one (like `ip netns pids`).
///
/// Compares each `/proc/PID/ns/net` with the mounted nsfs inode. Never lists the
/// calling process itself.
pub fn pids(name: &str) -> Result<Vec<i32>, NetError> {
    validate_netns_name(name)?;
    let target = fs::metadata(path_of(name)).map_err(|e| NetError::netns(name, "stat", e))?;
    let me = std::process::id() as i32;
    let mut out = Vec::new();
    let proc = fs::read_dir("/proc").map_err(|e| NetError::netns(name, "read /proc", e))?;
    for entry in proc.filter_map(|e| e.ok()) {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        // Processes exit while we scan; a failed stat just means "not there".
        if let Ok(md) = fs::metadata(format!("/proc/{pid}/ns/net")) {
            if md.dev() == target.dev() && md.ino() == target.ino() {
                out.push(pid);
            }
        }
    }
    out.sort_unstable();
    Ok(out)
}

pub(crate) fn validate_netns_name(name: &str) -> Result<(), NetError> {
    let reason = if name.is_empty() {
        Some("empty")
    } else if name.len() > 255 {
        Some("longer than 255 bytes")
    } else if name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        Some("not a plain file name")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(NetError::InvalidName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

fn path_of(name: &str) -> PathBuf {
    Path::new(NETNS_DIR).join(name)
}

/// True if `path` is a mounted namespace (the nsfs filesystem), not a bare file.
fn is_nsfs(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .map(|s| s.filesystem_type() == nix::sys::statfs::NSFS_MAGIC)
        .unwrap_or(false)
}

/// Makes `/run/netns` a shared mount point, as `ip netns add` does, so namespaces
/// mounted later also appear in mount namespaces created from this one (e.g. by
/// `ip netns exec`). If it is not a mount point yet, bind-mount it onto itself first.
fn make_run_dir_shared() -> Result<(), Errno> {
    let shared = || {
        mount(
            None::<&str>,
            NETNS_DIR,
            Some("none"),
            MsFlags::MS_SHARED | MsFlags::MS_REC,
            None::<&str>,
        )
    };
    match shared() {
        Ok(()) => Ok(()),
        Err(Errno::EINVAL) => {
            mount(
                Some(NETNS_DIR),
                NETNS_DIR,
                Some("none"),
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )?;
            shared()
        }
        Err(e) => Err(e),
    }
}
