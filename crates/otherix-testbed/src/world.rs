//! The world: its fabric, its namespaces, spawning into them, and tearing it all down.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fmt::Display;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::Instant;

use crate::alloc::{self, Record, RANGE_OCTETS};
use crate::proc::{lock, Registry};
use crate::{sys, Error, Proc, Result, WORLD_ENV};

/// Name of the bridge inside the fabric namespace.
const BRIDGE: &str = "fab0";
/// The host leg's port on the bridge (`v` + the last octet of the host leg's address,
/// like the ports of namespaces).
const HOST_PORT: &str = "v1";
/// MTU of the bridge and of every veth on it.
const MTU: &str = "1500";
/// Longest role name accepted by [`World::add_namespace`].
const MAX_ROLE_LEN: usize = 40;

/// A set of network namespaces on one fabric, made for one test or `otherix dev` run, and
/// removed when dropped. See the crate docs for its names and addresses.
pub struct World {
    record: Record,
    started: Instant,
    state: Mutex<State>,
    registry: Registry,
    /// `world.log` in the world's directory; `None` if it could not be opened.
    world_log: Mutex<Option<File>>,
    /// Where the logs go when the world drops, if they are to outlive it.
    keep_logs: Mutex<Option<PathBuf>>,
    /// More logs than the spawned processes' (see [`World::log_elsewhere`]).
    other_logs: Mutex<Vec<(PathBuf, String)>>,
}

struct State {
    namespaces: Vec<Ns>,
    /// Last octet of the next namespace's address.
    next_host: u8,
    /// How many processes got each log name, so a second `b-sleep` logs to `b-sleep-2.log`.
    log_names: HashMap<String, u32>,
}

/// A namespace of a world, on its fabric.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ns {
    name: String,
    role: String,
    ip: Ipv4Addr,
}

impl Ns {
    /// The namespace's name, `{prefix}-{role}`, as `ip netns` knows it.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The role it was created with.
    pub fn role(&self) -> &str {
        &self.role
    }

    /// Its address on the fabric (on `eth0`, in the world's /24).
    pub fn ip(&self) -> Ipv4Addr {
        self.ip
    }
}

impl std::fmt::Debug for World {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("World")
            .field("prefix", &self.record.prefix)
            .field("subnet", &self.subnet_cidr())
            .field("hint", &self.record.hint)
            .finish()
    }
}

impl World {
    /// Makes a new world: cleans up stale worlds, claims a prefix and a free /24 of
    /// [`crate::FABRIC_RANGE`], and builds the fabric and the host leg.
    ///
    /// `hint` says what the world is for (a test name, "dev"); it shows in the world's
    /// record and messages. Fails with [`Error::NotRoot`] or [`Error::MissingTool`] on a
    /// host that cannot run worlds.
    pub fn new(hint: &str) -> Result<World> {
        sys::preflight()?;
        let log_root = std::env::temp_dir().join("otherix-testbed");
        let record = alloc::claim(hint, &log_root)?;
        let world_log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(record.dir.join("world.log"))
            .ok();
        // From here on, dropping `world` removes whatever was made, also if building fails.
        let world = World {
            record,
            started: Instant::now(),
            state: Mutex::new(State {
                namespaces: Vec::new(),
                next_host: 2,
                log_names: HashMap::new(),
            }),
            registry: Registry::default(),
            world_log: Mutex::new(world_log),
            keep_logs: Mutex::new(None),
            other_logs: Mutex::new(Vec::new()),
        };
        world.note(format_args!(
            "world {} for {:?}: {}, owner pid {}",
            world.prefix(),
            world.record.hint,
            world.subnet_cidr(),
            world.record.pid
        ));
        world.build_fabric()?;
        Ok(world)
    }

    fn build_fabric(&self) -> Result<()> {
        let fab = self.fabric_netns();
        let host_link = self.host_link();
        let host_cidr = format!("{}/24", self.host_ip());
        self.ip(&["netns", "add", &fab])?;
        self.ip(&["-n", &fab, "link", "set", "dev", "lo", "up"])?;
        self.ip(&["-n", &fab, "link", "add", BRIDGE, "mtu", MTU, "type", "bridge"])?;
        self.ip(&["-n", &fab, "link", "set", "dev", BRIDGE, "up"])?;
        self.ip(&[
            "link", "add", &host_link, "mtu", MTU, "type", "veth", "peer", "name", HOST_PORT, "netns", &fab,
        ])?;
        self.ip(&[
            "-n", &fab, "link", "set", "dev", HOST_PORT, "master", BRIDGE, "up",
        ])?;
        self.ip(&["addr", "add", &host_cidr, "dev", &host_link])?;
        self.ip(&["link", "set", "dev", &host_link, "up"])?;
        Ok(())
    }

    /// Creates the namespace `{prefix}-{role}` on the fabric, with `eth0` at the next free
    /// address of the world's /24 (`.2`, `.3`, ...) and `lo` up. It gets no other route.
    ///
    /// `role` is lowercase letters, digits and `-` (starting with a letter or digit), at
    /// most 40 bytes, not `fab`, and unique in the world.
    pub fn add_namespace(&self, role: &str) -> Result<Ns> {
        validate_role(role)?;
        let mut state = lock(&self.state);
        if state.namespaces.iter().any(|ns| ns.role == role) {
            return Err(invalid_role(
                role,
                "the world already has a namespace with this role",
            ));
        }
        let host = state.next_host;
        if host == 255 {
            return Err(invalid_role(role, "the world's /24 has no address left"));
        }
        let ns = Ns {
            name: format!("{}-{role}", self.prefix()),
            role: role.to_owned(),
            ip: self.addr(host),
        };
        let fab = self.fabric_netns();
        let port = format!("v{host}");
        let cidr = format!("{}/24", ns.ip);
        self.ip(&["netns", "add", &ns.name])?;
        state.next_host += 1;
        self.ip(&["-n", &ns.name, "link", "set", "dev", "lo", "up"])?;
        self.ip(&[
            "-n", &fab, "link", "add", &port, "mtu", MTU, "type", "veth", "peer", "name", "eth0", "netns",
            &ns.name,
        ])?;
        self.ip(&["-n", &fab, "link", "set", "dev", &port, "master", BRIDGE, "up"])?;
        self.ip(&["-n", &ns.name, "addr", "add", &cidr, "dev", "eth0"])?;
        self.ip(&["-n", &ns.name, "link", "set", "dev", "eth0", "up"])?;
        state.namespaces.push(ns.clone());
        Ok(ns)
    }

    /// Starts `program` inside `ns` (`None`: in the host namespace, where the test runs)
    /// through `nsenter --net` as the leader of a new process group, with stdin closed and stdout and stderr
    /// appended to `{dir}/{role}-{program}.log` (`host` for the host namespace; `-2`, `-3`
    /// ... for later processes of the same name).
    ///
    /// The process gets `envs` and [`WORLD_ENV`] on top of this process's environment. Its
    /// whole group is SIGKILLed when the returned [`Proc`] or the world drops.
    pub fn spawn<I, S>(
        &self,
        ns: Option<&Ns>,
        program: impl AsRef<OsStr>,
        args: I,
        envs: &[(&str, &str)],
    ) -> Result<Proc>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let program = program.as_ref();
        let mut cmd = match ns {
            Some(ns) => {
                self.check_netns(&ns.name)?;
                // Not `ip netns exec`: it moves the program into a mount namespace that is a
                // slave of the host's, so namespaces an agent makes with `ip netns add`
                // would be invisible (and unusable) outside it. `nsenter --net` only
                // switches the network namespace; the program keeps the host's mounts
                // (including its /sys).
                let mut cmd = Command::new("nsenter");
                cmd.arg(format!("--net={}/{}", sys::NETNS_DIR, ns.name))
                    .arg("--")
                    .arg(program);
                cmd
            }
            None => Command::new(program),
        };
        cmd.args(args)
            .envs(envs.iter().copied())
            .env(WORLD_ENV, self.prefix());

        let name = self.log_name(ns.map_or("host", |ns| &ns.role), program);
        let log_path = self.dir().join(format!("{name}.log"));
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(Error::io(format!("could not open {}", log_path.display())))?;
        let log_err = log
            .try_clone()
            .map_err(Error::io(format!("could not open {}", log_path.display())))?;
        cmd.stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0);

        let described = sys::describe(&cmd);
        let child = cmd
            .spawn()
            .map_err(Error::io(format!("could not start `{described}`")))?;
        self.note(format_args!(
            "spawned pid {}: {described} > {}",
            child.id(),
            log_path.display()
        ));
        Ok(Proc::new(name, child, log_path, self.registry.clone()))
    }

    fn log_name(&self, role: &str, program: &OsStr) -> String {
        let program = Path::new(program)
            .file_name()
            .unwrap_or(program)
            .to_string_lossy();
        let program: String = program
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || "._-".contains(c) {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let base = format!("{role}-{program}");
        let mut state = lock(&self.state);
        let count = state.log_names.entry(base.clone()).or_insert(0);
        *count += 1;
        if *count == 1 {
            base
        } else {
            format!("{base}-{count}")
        }
    }

    /// Runs `argv` to completion inside `ns`, capturing its output. The exit status is the
    /// caller's to judge; see [`World::exec_ok`].
    ///
    /// This goes through `ip netns exec`, so `/sys` shows the namespace's own devices (as
    /// `ip`, `bridge` and `sysctl` expect); namespaces the command makes with
    /// `ip netns add` stay invisible outside it — start such programs with
    /// [`World::spawn`].
    pub fn exec<S: AsRef<OsStr>>(&self, ns: &Ns, argv: &[S]) -> Result<Output> {
        self.exec_netns(&ns.name, argv)
    }

    /// Like [`World::exec`], but fails unless the command succeeds, and returns its stdout.
    pub fn exec_ok<S: AsRef<OsStr>>(&self, ns: &Ns, argv: &[S]) -> Result<String> {
        let out = self.exec(ns, argv)?;
        if !out.status.success() {
            let command = argv
                .iter()
                .map(|a| a.as_ref().to_string_lossy())
                .collect::<Vec<_>>()
                .join(" ");
            return Err(Error::Command {
                command: format!("{command} (in {})", ns.name),
                status: out.status,
                stderr: sys::first_lines(&String::from_utf8_lossy(&out.stderr)),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs `argv` to completion inside any namespace of this world by name, including
    /// guest namespaces that agents made (`{guest_netns_prefix}...`).
    pub fn exec_netns<S: AsRef<OsStr>>(&self, netns: &str, argv: &[S]) -> Result<Output> {
        self.check_netns(netns)?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", netns])
            .args(argv)
            .env(WORLD_ENV, self.prefix());
        sys::output(&mut cmd)
    }

    fn check_netns(&self, netns: &str) -> Result<()> {
        if sys::netns_belongs(netns, self.prefix()) {
            Ok(())
        } else {
            Err(Error::ForeignNamespace {
                netns: netns.to_owned(),
                prefix: self.prefix().to_owned(),
            })
        }
    }

    /// The world's prefix, `ox` + 4 hex digits (e.g. `oxa3f1`): every namespace, link and
    /// file of the world is named with it.
    pub fn prefix(&self) -> &str {
        &self.record.prefix
    }

    /// What the world is for, as given to [`World::new`].
    pub fn hint(&self) -> &str {
        &self.record.hint
    }

    /// The world's directory (logs), `$TMPDIR/otherix-testbed/{prefix}`.
    pub fn dir(&self) -> &Path {
        &self.record.dir
    }

    /// When the world drops, its logs — `world.log` and the spawned processes' (the
    /// `*.log` of its directory), and those named with [`World::log_elsewhere`] — are
    /// copied to `dest` (made `0700`) once the processes writing them are gone, before
    /// the directory goes. The data beside them (keys, tokens, databases) is not.
    pub fn keep_logs_in(&self, dest: impl Into<PathBuf>) {
        *lock(&self.keep_logs) = Some(dest.into());
    }

    /// One more log for [`World::keep_logs_in`]: `file` (written by a process this world
    /// did not spawn, such as a PostgreSQL server), kept as `name`.
    pub fn log_elsewhere(&self, file: impl Into<PathBuf>, name: &str) {
        lock(&self.other_logs).push((file.into(), name.to_owned()));
    }

    /// The network address of the world's /24, `10.213.N.0`.
    pub fn subnet(&self) -> Ipv4Addr {
        self.addr(0)
    }

    /// The world's /24 as text, `10.213.N.0/24`.
    pub fn subnet_cidr(&self) -> String {
        format!("{}/24", self.subnet())
    }

    /// The host leg's address, `10.213.N.1`: where the world's namespaces reach the host.
    pub fn host_ip(&self) -> Ipv4Addr {
        self.addr(1)
    }

    /// The host side of the host leg, `{prefix}h`.
    pub fn host_link(&self) -> String {
        format!("{}h", self.prefix())
    }

    /// The fabric namespace, `{prefix}-fab`, holding the bridge `fab0`.
    pub fn fabric_netns(&self) -> String {
        format!("{}-fab", self.prefix())
    }

    /// The prefix agents must give the guest namespaces they make, `{prefix}g`
    /// (e.g. `oxa3f1g` + the guest's name or number), so that teardown and
    /// [`World::leftovers`] find them. Keep guest namespace names of this world ≤ 15 bytes
    /// if they also name links.
    pub fn guest_netns_prefix(&self) -> String {
        format!("{}g", self.prefix())
    }

    /// The namespaces made with [`World::add_namespace`], in order.
    pub fn namespaces(&self) -> Vec<Ns> {
        lock(&self.state).namespaces.clone()
    }

    /// The namespace made for `role`, if any.
    pub fn ns(&self, role: &str) -> Option<Ns> {
        lock(&self.state)
            .namespaces
            .iter()
            .find(|ns| ns.role == role)
            .cloned()
    }

    /// What still exists of the world with `prefix` (as returned by [`World::prefix`]):
    /// `netns NAME` for its namespaces (`{prefix}-*`, `{prefix}g*`), `link NAME` for host
    /// links starting with `prefix`, `process PID (CMDLINE)` for live processes carrying
    /// its [`WORLD_ENV`] marker. Empty after a clean teardown.
    pub fn leftovers(prefix: &str) -> Vec<String> {
        sys::leftovers(prefix)
    }

    fn addr(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(RANGE_OCTETS[0], RANGE_OCTETS[1], self.record.subnet, host)
    }

    fn ip(&self, args: &[&str]) -> Result<String> {
        self.note(format_args!("ip {}", args.join(" ")));
        sys::ip(args).inspect_err(|err| self.note(format_args!("  failed: {err}")))
    }

    /// Appends a line to `world.log`.
    fn note(&self, line: impl Display) {
        if let Some(file) = lock(&self.world_log).as_mut() {
            let _ = writeln!(file, "[{:8.3}s] {line}", self.started.elapsed().as_secs_f64());
        }
    }
}

impl Drop for World {
    fn drop(&mut self) {
        let prefix = self.record.prefix.clone();
        self.note("tearing down");
        let pgids: Vec<u32> = lock(&self.registry).iter().copied().collect();
        for pgid in pgids {
            sys::kill_group(pgid);
        }
        let left = sys::teardown(&prefix);
        let dir: PathBuf = self.record.dir.clone();
        if left.is_empty() {
            let _ = std::fs::remove_file(Record::path(&prefix));
        } else {
            // The record stays, so the next `World::new` after this process exits retries.
            self.note(format_args!("left behind: {}", left.join(", ")));
            eprintln!(
                "otherix-testbed: world {prefix} could not remove: {}",
                left.join(", ")
            );
        }
        if std::thread::panicking() {
            eprintln!(
                "otherix-testbed: world {prefix} ({}) dropped during a panic; its logs are kept in {}",
                self.record.hint,
                dir.display()
            );
        } else {
            *lock(&self.world_log) = None;
            if let Some(dest) = lock(&self.keep_logs).take() {
                let others = std::mem::take(&mut *lock(&self.other_logs));
                if let Err(e) = copy_logs(&dir, &others, &dest) {
                    eprintln!(
                        "otherix-testbed: world {prefix}: could not keep its logs in {}: {e}",
                        dest.display()
                    );
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// Copies the world's logs in `dir`, and `others` (file, name) that exist, to `to`
/// (see [`World::keep_logs_in`]).
fn copy_logs(dir: &Path, others: &[(PathBuf, String)], to: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(to)?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if entry.file_type()?.is_file() && name.to_string_lossy().ends_with(".log") {
            std::fs::copy(entry.path(), to.join(&name))?;
        }
    }
    for (file, name) in others.iter().filter(|(file, _)| file.is_file()) {
        std::fs::copy(file, to.join(name))?;
    }
    Ok(())
}

fn validate_role(role: &str) -> Result<()> {
    let starts_well = role
        .bytes()
        .next()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    let chars_ok = role
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !starts_well || !chars_ok {
        return Err(invalid_role(
            role,
            "use lowercase letters, digits and `-`, starting with a letter or digit",
        ));
    }
    if role.len() > MAX_ROLE_LEN {
        return Err(invalid_role(role, &format!("longer than {MAX_ROLE_LEN} bytes")));
    }
    if role == "fab" {
        return Err(invalid_role(role, "`fab` names the fabric namespace"));
    }
    Ok(())
}

fn invalid_role(role: &str, reason: &str) -> Error {
    Error::InvalidRole {
        role: role.to_owned(),
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_are_short_lowercase_names() {
        assert!(validate_role("node1").is_ok());
        assert!(validate_role("cp").is_ok());
        assert!(validate_role("gw-2").is_ok());
        assert!(validate_role("").is_err());
        assert!(validate_role("-x").is_err());
        assert!(validate_role("Node").is_err());
        assert!(validate_role("a/b").is_err());
        assert!(validate_role("fab").is_err());
        assert!(validate_role(&"x".repeat(41)).is_err());
    }
}
