//! The QEMU runtime: a guest is a real Linux VM, a `qemu-system-x86_64`
//! process with a virtio NIC on a tap in the guest's bridge, carrying the
//! lease's MAC. The guest learns its lease IP, prefix, gateway and MTU on the
//! kernel command line (`otherix.ip=`…: no DHCP server to run, secure or keep
//! in step with the CP, and the address is the lease's by construction) and
//! its authorized SSH keys over fw_cfg (`opt/otherix/authorized_keys`, as a
//! cloud's metadata service would give them).
//!
//! Each guest has a directory `{state}/{id}` with its QMP socket, its serial
//! console's socket and log, its pid file and the record of how it was
//! started. QEMU is started daemonized, so it outlives the agent: an agent
//! restart or upgrade finds it by its pid file (whose process must name that
//! pid file on its command line) and adopts it. A QEMU that ended is started
//! again after a backoff (1 s doubling to 30 s); three quick ends in a row
//! report the guest failed until it stays up.
//!
//! Accelerator: KVM when `/dev/kvm` opens and can run a stock guest kernel;
//! TCG otherwise. A PVM host (`/sys/module/kvm_pvm`) has a `/dev/kvm` under
//! which a stock kernel fails, so it gets TCG too. The choice is made once
//! per agent and reported per guest.

pub mod image;
pub mod qmp;
pub mod stream;
pub mod switchover;

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use otherix_proto::Accelerator;
use serde_json::json;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::RuntimeError;
use crate::daemon::status::CrashCounter;
use crate::net::{Change, LinkWant, Netlink, Netns};

pub use image::{Image, ImageError, DEFAULT_IMAGE};
pub use switchover::{Forward, Switchover};

/// The QEMU binary the runtime starts.
pub const QEMU: &str = "qemu-system-x86_64";
/// Longest kernel command line an x86 guest takes.
const MAX_CMDLINE: usize = 2048;

/// What a QEMU guest is made of, beside its network (`GuestSpec`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QemuSpec {
    /// The guest's host name (the VM's name).
    pub hostname: String,
    pub memory_mib: u32,
    pub cpus: u32,
    pub image: String,
    /// Lines for root's `authorized_keys`.
    pub ssh_keys: Vec<String>,
}

/// Which accelerator the runtime asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AccelChoice {
    /// KVM where it can run a stock guest kernel, TCG otherwise.
    #[default]
    Auto,
    Kvm,
    Tcg,
}

impl std::str::FromStr for AccelChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "kvm" => Ok(Self::Kvm),
            "tcg" => Ok(Self::Tcg),
            _ => Err(format!("accelerator {s:?}: say auto, kvm or tcg")),
        }
    }
}

/// How the runtime is set up.
#[derive(Clone, Debug)]
pub struct QemuConfig {
    /// Where guests' directories go (`{agent state}/qemu`).
    pub state_dir: PathBuf,
    /// Where images are kept and built ([`image::default_cache_dir`]).
    pub image_cache: PathBuf,
    pub accel: AccelChoice,
    /// The QEMU binary (a name looked up in `PATH`, or a path).
    pub binary: PathBuf,
    /// Most bytes a second an outgoing migration may send (`None`: QEMU's
    /// default), so a migration does not take the whole underlay.
    pub migration_bandwidth: Option<u64>,
    /// Longest the guest may stand still at an outgoing migration's
    /// switchover, as QEMU estimates it (its `downtime-limit`): QEMU copies
    /// until what is left fits, then pauses the guest for the rest. A
    /// migration starts at [`FIRST_MIGRATION_DOWNTIME`] (this, if lower)
    /// and is allowed more only when the guest writes memory faster than
    /// that lets QEMU finish ([`downtime_limit`]).
    pub migration_downtime: Duration,
}

/// [`QemuConfig::migration_downtime`] unless the agent is told otherwise.
/// QEMU's own default is 300 ms: with TCP's retransmissions after it, a
/// client saw 120–460 ms of silence per migration.
pub const DEFAULT_MIGRATION_DOWNTIME: Duration = Duration::from_millis(50);

/// The downtime limit an outgoing migration starts with. A guest that
/// writes little memory meets it after two or three passes; on the
/// project's testbed it took a QEMU guest's clients' silence per migration
/// from a p99 of 116 ms (at 50 ms) to 96 ms.
pub const FIRST_MIGRATION_DOWNTIME: Duration = Duration::from_millis(10);

/// Passes over the guest's memory QEMU makes at the first limit; after
/// them the limit doubles each pass, up to the agent's
/// [`QemuConfig::migration_downtime`].
pub const PASSES_AT_FIRST_LIMIT: u64 = 3;

/// The downtime limit of a migration that has gone over the guest's memory
/// `passes` times (QEMU's `dirty-sync-count`), under `most`: the first
/// limit, doubled each pass past [`PASSES_AT_FIRST_LIMIT`], never above
/// `most`. A guest that writes faster than QEMU copies would never fit in
/// the first, and would be cancelled at the migration's timeout.
pub fn downtime_limit(passes: u64, most: Duration) -> Duration {
    let first = FIRST_MIGRATION_DOWNTIME.min(most);
    let doublings = passes.saturating_sub(PASSES_AT_FIRST_LIMIT).min(20) as u32;
    first.saturating_mul(1 << doublings).min(most)
}

impl QemuConfig {
    pub fn new(state_dir: PathBuf) -> Self {
        Self {
            state_dir,
            image_cache: image::default_cache_dir(),
            accel: AccelChoice::Auto,
            binary: PathBuf::from(QEMU),
            migration_bandwidth: None,
            migration_downtime: DEFAULT_MIGRATION_DOWNTIME,
        }
    }
}

/// The accelerator to use here, and why.
pub fn detect_accel(choice: AccelChoice) -> (Accelerator, String) {
    match choice {
        AccelChoice::Tcg => (Accelerator::Tcg, "asked for".into()),
        AccelChoice::Kvm => (Accelerator::Kvm, "asked for".into()),
        AccelChoice::Auto => {
            if Path::new("/sys/module/kvm_pvm").exists() {
                return (
                    Accelerator::Tcg,
                    "/dev/kvm is a PVM host's, which cannot run a stock guest kernel".into(),
                );
            }
            match fs::OpenOptions::new().read(true).write(true).open("/dev/kvm") {
                Ok(_) => (Accelerator::Kvm, "/dev/kvm opens".into()),
                Err(e) => (Accelerator::Tcg, format!("/dev/kvm: {e}")),
            }
        }
    }
}

/// A QEMU guest found on the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QemuGuest {
    pub id: String,
    /// The QEMU process, while it runs.
    pub pid: Option<i32>,
}

/// Per guest: restarts, and what the last start said.
#[derive(Debug, Default)]
struct Life {
    crashes: CrashCounter,
    /// No start before this (backoff after an end).
    not_before: Option<Instant>,
    /// Why it is not running, when it is not.
    last: Option<String>,
    /// Whether it was seen running (an end after that is a crash).
    seen_running: bool,
    ends: u32,
    /// When this node started streaming the guest away.
    migrating_since: Option<Instant>,
    /// That migration's switchover.
    switchover: Option<Arc<Switchover>>,
    /// A migration's target: the wait for the stream.
    incoming: Option<IncomingWait>,
    /// A migration's source: the downtime limit last given QEMU.
    downtime: Option<Duration>,
    /// A migration's source: since when it has tried to reach the target's
    /// listener (the migration's id, the first try).
    connecting: Option<(String, Instant)>,
}

/// A migration's target's wait: the task that accepts the stream and hands
/// it to the incoming QEMU ([`stream::hand_over`]), and whether it did.
#[derive(Debug)]
struct IncomingWait {
    task: tokio::task::JoinHandle<()>,
    handed: Arc<AtomicBool>,
}

/// An image build: running (`None`), or done with its outcome (a failure
/// with when it happened: it is tried again [`IMAGE_RETRY`] later).
type Build = Option<Result<(), (String, std::time::Instant)>>;

/// A failed image build (Debian's mirror unreachable, say) is tried again
/// this long after; until then the guest is reported failed with its error.
pub const IMAGE_RETRY: Duration = Duration::from_secs(30);

/// The first QEMU release whose live migration under TCG keeps a guest's
/// memory whole, as far as this project measured. TCG marks a page dirty for
/// migration only when a store misses the vCPU's TLB; a store through an entry
/// cached before the dirty bitmap was synced is not seen, and that page is not
/// sent again. On QEMU 7.2 (Debian 12) a busy guest's kernel oopsed on the
/// target in 4 of 12 rounds of two migrations at 10 MiB/s, 2 in 30 with TLS at
/// full speed; on 10.0.2 (bookworm-backports) 0 in 32 such rounds (see
/// docs/architecture.md, "Live migration of a QEMU guest under TCG"). KVM
/// tracks dirty pages in the host kernel and is not concerned.
pub const TCG_LIVE_MIGRATION_FROM: (u64, u64) = (10, 0);

/// Whether a guest of `accel` on QEMU `version` (major, minor) may migrate
/// running. When not, its migration pauses it first (stop-and-copy): a longer
/// pause, the same memory on both ends.
pub fn migrates_live(accel: Accelerator, version: (u64, u64)) -> bool {
    accel == Accelerator::Kvm || version >= TCG_LIVE_MIGRATION_FROM
}

/// The file in a guest's directory that says its QEMU was paused for the
/// migration it names (and must run again if that migration does not complete).
const PAUSED_FOR_MIGRATION: &str = "paused-for-migration";

/// How an outgoing migration goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outgoing {
    /// Streaming (QEMU's status: `setup`, `active`, `device`...).
    Active(String),
    /// The guest runs on the target; this QEMU ended.
    Completed,
    /// It failed; the guest runs on here. Why.
    Failed(String),
}

/// What the runtime says about one guest, for its status.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QemuView {
    Running {
        accelerator: Accelerator,
    },
    /// Not running yet, or restarting; why.
    Starting(String),
    /// Ended quickly several times in a row.
    Crashing(String),
}

/// The QEMU guest runtime of one node.
pub struct QemuRuntime {
    node: Netlink,
    config: QemuConfig,
    accel: Accelerator,
    lives: Mutex<BTreeMap<String, Life>>,
    /// Images being built in the background, by name, with their outcome.
    builds: Arc<Mutex<BTreeMap<String, Build>>>,
    /// Woken when an outgoing migration ends (or its watcher gives up).
    events: Arc<Notify>,
}

impl QemuRuntime {
    pub fn new(node: Netlink, config: QemuConfig) -> Self {
        let (accel, why) = detect_accel(config.accel);
        info!(accelerator = accel.as_str(), why = %why, state = %config.state_dir.display(), "QEMU runtime ready");
        Self {
            node,
            config,
            accel,
            lives: Mutex::new(BTreeMap::new()),
            builds: Arc::new(Mutex::new(BTreeMap::new())),
            events: Arc::new(Notify::new()),
        }
    }

    /// Notified when an outgoing migration ended: the agent then heartbeats
    /// and runs a round at once, so the move is reported without waiting for
    /// the next poll.
    pub fn events(&self) -> Arc<Notify> {
        self.events.clone()
    }

    /// The accelerator new guests get.
    pub fn accelerator(&self) -> Accelerator {
        self.accel
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.config.state_dir.join(id)
    }

    /// The guest's serial console socket (one client at a time).
    pub fn console_socket(&self, id: &str) -> PathBuf {
        self.dir(id).join("console.sock")
    }

    /// The guest's QMP socket.
    pub fn qmp_socket(&self, id: &str) -> PathBuf {
        self.dir(id).join("qmp.sock")
    }

    /// The guest's second QMP monitor, for a migration's watcher alone
    /// ([`switchover`]): QMP serves one client a socket at a time.
    pub fn watch_socket(&self, id: &str) -> PathBuf {
        self.dir(id).join(WATCH_SOCKET)
    }

    /// The pid of guest `id`'s QEMU, if it runs: the pid file's process, and
    /// only if its command line names that pid file (a recycled pid is not it).
    pub fn pid(&self, id: &str) -> Option<i32> {
        pid_in(&self.dir(id))
    }

    /// Makes guest `spec` run: adopts a running QEMU, or starts one (after
    /// its backoff, once its image is built), and keeps its tap on the bridge.
    pub async fn ensure(&self, spec: &super::GuestSpec, q: &QemuSpec) -> Result<Vec<Change>, RuntimeError> {
        spec.validate()?;
        let invalid = |reason: String| RuntimeError::InvalidSpec {
            id: spec.id.clone(),
            reason,
        };
        if !(64..=1 << 20).contains(&q.memory_mib) || !(1..=64).contains(&q.cpus) {
            return Err(invalid(format!(
                "{} MiB and {} CPUs are out of range",
                q.memory_mib, q.cpus
            )));
        }
        let mut changes = Vec::new();
        let now = Instant::now();
        self.cancel_abandoned(&spec.id).await?;
        if self.pid(&spec.id).is_none() {
            {
                let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
                let life = lives.entry(spec.id.clone()).or_default();
                if life.seen_running {
                    // It ran and ended: a crash (or someone killed it).
                    life.seen_running = false;
                    life.crashes.exited(now);
                    life.ends += 1;
                    let delay = Duration::from_secs(1 << life.ends.min(5).saturating_sub(1))
                        .min(Duration::from_secs(30));
                    life.not_before = Some(now + delay);
                    life.last = Some("QEMU ended".into());
                    warn!(vm_id = %spec.id, restart_in = ?delay, "QEMU guest ended; starting it again");
                }
                if life.not_before.is_some_and(|t| now < t) {
                    return Ok(changes);
                }
            }
            let image = match self.image(&q.image) {
                Ok(Some(image)) => image,
                Ok(None) => {
                    self.set_last(&spec.id, format!("building guest image {}", q.image));
                    return Ok(changes);
                }
                Err(reason) => {
                    self.set_last(&spec.id, reason.clone());
                    return Err(invalid(reason));
                }
            };
            match self.start(spec, q, &image, None).await {
                Ok(pid) => {
                    let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
                    let life = lives.entry(spec.id.clone()).or_default();
                    life.crashes.started(now);
                    life.last = None;
                    info!(vm_id = %spec.id, pid, accelerator = self.accel.as_str(), image = %image.name, "QEMU guest started");
                    changes.push(Change::QemuStarted {
                        id: spec.id.clone(),
                        pid,
                    });
                }
                Err(e) => {
                    let reason = crate::daemon::one_line(&e);
                    let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
                    let life = lives.entry(spec.id.clone()).or_default();
                    life.crashes.exited(now);
                    life.ends += 1;
                    life.not_before =
                        Some(now + Duration::from_secs(1 << life.ends.min(5).saturating_sub(1)));
                    life.last = Some(reason);
                    return Err(e);
                }
            }
        }
        // The tap exists while QEMU runs: on the bridge, up, at the network's MTU.
        let want = LinkWant {
            mtu: Some(spec.mtu),
            mac: None,
            controller: Some(spec.bridge.clone()),
            up: true,
            alias: Some(format!("otherix qemu {}", spec.id)),
        };
        changes.extend(self.node.ensure_link(&spec.host_veth, &want).await?);
        let started = changes.iter().any(|c| matches!(c, Change::QemuStarted { .. }));
        let first_sight = !self
            .lives
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&spec.id)
            .is_some_and(|l| l.seen_running);
        let dir = self.dir(&spec.id);
        let paused_here = dir.join(PAUSED_FOR_MIGRATION).exists();
        if (first_sight || paused_here) && !started {
            // Moved here paused (stop-and-copy) before the target's last look,
            // or paused here for a migration no longer asked for: it runs.
            let mut qmp =
                qmp::Qmp::connect(&self.qmp_socket(&spec.id))
                    .await
                    .map_err(|e| RuntimeError::Qemu {
                        id: spec.id.clone(),
                        reason: e.to_string(),
                    })?;
            if paused_here {
                let _ = qmp.execute("migrate_cancel", None).await;
                let _ = fs::remove_file(dir.join("migration.id"));
            }
            resume_if_paused(&mut qmp, &dir, &spec.id).await;
        }
        let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
        let life = lives.entry(spec.id.clone()).or_default();
        if !life.seen_running && !started {
            // Running before this runtime knew it: an agent restart or upgrade.
            info!(vm_id = %spec.id, pid = ?self.pid(&spec.id), "QEMU guest adopted");
        }
        life.seen_running = true;
        Ok(changes)
    }

    /// Cancels a migration this node started that is no longer asked for
    /// (the control plane rolled it back): QEMU may still stream, or wait at
    /// the switchover with the guest paused (`migrate_cancel` ends that wait
    /// too, and QEMU runs the guest here again). First in [`QemuRuntime::ensure`],
    /// so that nothing else of the round that fails holds it back.
    async fn cancel_abandoned(&self, id: &str) -> Result<(), RuntimeError> {
        let dir = self.dir(id);
        let Ok(outgoing) = fs::read_to_string(dir.join("migration.id")) else {
            return Ok(());
        };
        if fs::read_to_string(dir.join("migrated")).ok().as_deref() == Some(outgoing.as_str())
            || self.pid(id).is_none()
        {
            return Ok(());
        }
        let mut qmp = qmp::Qmp::connect(&self.qmp_socket(id))
            .await
            .map_err(|e| RuntimeError::Qemu {
                id: id.to_owned(),
                reason: e.to_string(),
            })?;
        let _ = qmp.execute("migrate_cancel", None).await;
        let _ = fs::remove_file(dir.join("migration.id"));
        info!(vm_id = %id, "QEMU migration no longer asked for: cancelled, the guest runs on here");
        resume_if_paused(&mut qmp, &dir, id).await;
        Ok(())
    }

    fn set_last(&self, id: &str, reason: String) {
        let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
        lives.entry(id.to_owned()).or_default().last = Some(reason);
    }

    /// The image `name` if it is built; otherwise starts building it in the
    /// background (`Ok(None)` until it is), or says why it cannot be had.
    fn image(&self, name: &str) -> Result<Option<Image>, String> {
        match Image::open(&self.config.image_cache, name) {
            Ok(Some(image)) => return Ok(Some(image)),
            Ok(None) => {}
            Err(e) => return Err(format!("guest image {name}: {e}")),
        }
        let mut builds = self.builds.lock().unwrap_or_else(|p| p.into_inner());
        match builds.get(name) {
            Some(None) => return Ok(None),
            Some(Some(Err((e, at)))) if at.elapsed() < IMAGE_RETRY => {
                return Err(format!(
                    "guest image {name} could not be built (tried again {}s after): {e}",
                    IMAGE_RETRY.as_secs()
                ))
            }
            // Built, yet not there: someone removed it; or failed a while
            // ago. Build again.
            Some(Some(_)) | None => {}
        }
        builds.insert(name.to_owned(), None);
        let (cache, name, builds) = (
            self.config.image_cache.clone(),
            name.to_owned(),
            self.builds.clone(),
        );
        info!(image = %name, cache = %cache.display(), "building the guest image (first use)");
        std::thread::spawn(move || {
            let outcome = image::ensure(&cache, &name, &mut |step| info!(image = %name, "{step}"))
                .map(|_| ())
                .map_err(|e| (e.to_string(), std::time::Instant::now()));
            if let Err((e, _)) = &outcome {
                warn!(image = %name, error = %e, retry_secs = IMAGE_RETRY.as_secs(), "guest image not built");
            }
            builds
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(name, Some(outcome));
        });
        Ok(None)
    }

    /// Starts QEMU for the guest, daemonized; returns its pid. With
    /// `incoming` (the migration's key), it waits for a migration stream
    /// instead of booting (`-incoming defer`).
    async fn start(
        &self,
        spec: &super::GuestSpec,
        q: &QemuSpec,
        image: &Image,
        incoming: Option<&str>,
    ) -> Result<i32, RuntimeError> {
        let dir = self.dir(&spec.id);
        let io_err = |what: &str, e: std::io::Error| RuntimeError::Qemu {
            id: spec.id.clone(),
            reason: format!("{what}: {e}"),
        };
        fs::create_dir_all(&dir).map_err(|e| io_err("create its directory", e))?;
        for f in [
            "qemu.pid",
            "qmp.sock",
            "console.sock",
            "incoming.port",
            "migrated",
            "migration.id",
        ] {
            let _ = fs::remove_file(dir.join(f));
        }
        let keys = dir.join("authorized_keys");
        let mut text = q.ssh_keys.join("\n");
        text.push('\n');
        fs::write(&keys, text).map_err(|e| io_err("write its authorized keys", e))?;
        let mut argv = qemu_argv(spec, q, image, &dir, self.accel)?;
        if let Some(key) = incoming {
            let psk = write_psk(&dir, "psk-in", key).map_err(|e| io_err("write the migration key", e))?;
            argv.extend([
                "-object".into(),
                format!("tls-creds-psk,id=migin,endpoint=server,dir={}", psk.display()),
                "-incoming".into(),
                "defer".into(),
            ]);
        }
        fs::write(dir.join("argv"), argv.join("\n")).map_err(|e| io_err("record its command line", e))?;

        let mut cmd = Command::new(&self.config.binary);
        cmd.args(&argv)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let netns = self.node.netns().map(str::to_owned);
        let binary = self.config.binary.display().to_string();
        let id = spec.id.clone();
        let output = tokio::task::spawn_blocking(move || match netns {
            Some(ns) => Netns::open(&ns)?
                .run(move || cmd.output())
                .map_err(RuntimeError::from),
            None => Ok(cmd.output()),
        })
        .await
        .map_err(|e| RuntimeError::Qemu {
            id: id.clone(),
            reason: format!("start task: {e}"),
        })??;
        let output = output.map_err(|e| RuntimeError::Qemu {
            id: spec.id.clone(),
            reason: if e.kind() == std::io::ErrorKind::NotFound {
                format!("{binary} is not installed on this node (Debian: apt-get install qemu-system-x86)")
            } else {
                format!("{binary}: {e}")
            },
        })?;
        if !output.status.success() {
            let err = String::from_utf8_lossy(&output.stderr);
            let line = err
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("no message");
            return Err(RuntimeError::Qemu {
                id: spec.id.clone(),
                reason: format!("QEMU did not start ({}): {}", output.status, line.trim()),
            });
        }
        self.pid(&spec.id).ok_or_else(|| RuntimeError::Qemu {
            id: spec.id.clone(),
            reason: "QEMU started but wrote no pid file".into(),
        })
    }

    /// A migration's target: makes sure an incoming QEMU for the guest waits
    /// for the stream, encrypted and authenticated with `key`, on `vtep`.
    /// With `from` (the source's VTEP, from the control plane's FDB) the
    /// agent listens and hands QEMU the first connection from there
    /// ([`stream`]); without it QEMU listens itself.
    /// Returns the port it listens on while it waits; `None` once the guest
    /// arrived (it runs here) or while its image is still being built.
    pub async fn ensure_incoming(
        &self,
        spec: &super::GuestSpec,
        q: &QemuSpec,
        key: &str,
        vtep: std::net::Ipv4Addr,
        from: Option<std::net::Ipv4Addr>,
    ) -> Result<(Vec<Change>, Option<u16>), RuntimeError> {
        spec.validate()?;
        let fail = |reason: String| RuntimeError::Qemu {
            id: spec.id.clone(),
            reason,
        };
        let dir = self.dir(&spec.id);
        let mut changes = Vec::new();
        if self.pid(&spec.id).is_none() {
            let image = match self.image(&q.image) {
                Ok(Some(image)) => image,
                Ok(None) => {
                    self.set_last(&spec.id, format!("building guest image {}", q.image));
                    return Ok((changes, None));
                }
                Err(reason) => {
                    self.set_last(&spec.id, reason.clone());
                    return Err(fail(reason));
                }
            };
            // A wait left from an earlier incoming QEMU goes first: it
            // belongs to that QEMU, and its record would hide that this one
            // has no listener.
            if let Some(old) = self
                .lives
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_mut(&spec.id)
                .and_then(|l| l.incoming.take())
            {
                old.task.abort();
            }
            let pid = match self.start(spec, q, &image, Some(key)).await {
                Ok(pid) => pid,
                Err(e) => {
                    self.set_last(&spec.id, crate::daemon::one_line(&e));
                    return Err(e);
                }
            };
            info!(vm_id = %spec.id, pid, "incoming QEMU started");
            changes.push(Change::QemuStarted {
                id: spec.id.clone(),
                pid,
            });
            let mut qmp = qmp::Qmp::connect(&self.qmp_socket(&spec.id))
                .await
                .map_err(|e| fail(e.to_string()))?;
            qmp.execute("migrate-set-parameters", Some(json!({ "tls-creds": "migin" })))
                .await
                .map_err(|e| fail(e.to_string()))?;
            match from {
                Some(from) => {
                    drop(qmp);
                    self.listen_incoming(&spec.id, vtep, 0, from).await?;
                }
                None => {
                    qmp.execute(
                        "migrate-incoming",
                        Some(json!({ "uri": format!("tcp:{vtep}:0") })),
                    )
                    .await
                    .map_err(|e| fail(e.to_string()))?;
                    let info = qmp
                        .execute("query-migrate", None)
                        .await
                        .map_err(|e| fail(e.to_string()))?;
                    let port = info["socket-address"]
                        .as_array()
                        .and_then(|a| a.first())
                        .and_then(|a| a["port"].as_str().and_then(|p| p.parse::<u16>().ok()))
                        .ok_or_else(|| {
                            fail(format!("the incoming QEMU names no port it listens on: {info}"))
                        })?;
                    fs::write(dir.join("incoming.port"), port.to_string())
                        .map_err(|e| fail(format!("record the incoming port: {e}")))?;
                }
            }
            self.set_last(&spec.id, "waiting for the migration stream".into());
        }
        let want = LinkWant {
            mtu: Some(spec.mtu),
            mac: None,
            controller: Some(spec.bridge.clone()),
            up: true,
            alias: Some(format!("otherix qemu {}", spec.id)),
        };
        changes.extend(self.node.ensure_link(&spec.host_veth, &want).await?);
        let mut qmp = qmp::Qmp::connect(&self.qmp_socket(&spec.id))
            .await
            .map_err(|e| fail(e.to_string()))?;
        let status = qmp.status().await.map_err(|e| fail(e.to_string()))?;
        if status != "inmigrate" {
            // Received: it runs here now (a guest paused for the migration
            // arrives paused, and goes on here).
            if status == "paused" {
                qmp.execute("cont", None).await.map_err(|e| fail(e.to_string()))?;
                info!(vm_id = %spec.id, "guest moved paused (stop-and-copy); it runs again here");
            }
            let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
            let life = lives.entry(spec.id.clone()).or_default();
            life.seen_running = true;
            life.last = None;
            if let Some(wait) = life.incoming.take() {
                wait.task.abort();
            }
            return Ok((changes, None));
        }
        let recorded: Option<u16> = fs::read_to_string(dir.join("incoming.port"))
            .ok()
            .and_then(|p| p.trim().parse().ok());
        let waiting = {
            let lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
            lives
                .get(&spec.id)
                .and_then(|l| l.incoming.as_ref())
                .is_some_and(|wait| !wait.task.is_finished() || wait.handed.load(Ordering::Acquire))
        };
        if waiting {
            return Ok((changes, recorded));
        }
        // No one waits for the stream (an agent restarted, a hand-over that
        // failed): unless QEMU already reads one or listens itself, listen
        // again, on the port the source was told if it is free.
        let Some(from) = from else {
            return Ok((changes, recorded));
        };
        let info = qmp
            .execute("query-migrate", None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let reading = info
            .get("status")
            .and_then(|s| s.as_str())
            .is_some_and(|s| s != "none");
        // QEMU listening itself (started so by an older agent) says where.
        if reading || info.get("socket-address").is_some() {
            return Ok((changes, recorded));
        }
        qmp.execute("migrate-set-parameters", Some(json!({ "tls-creds": "migin" })))
            .await
            .map_err(|e| fail(e.to_string()))?;
        drop(qmp);
        let port = match recorded {
            Some(port) => match self.listen_incoming(&spec.id, vtep, port, from).await {
                Ok(port) => port,
                Err(e) => {
                    warn!(vm_id = %spec.id, port, error = %e, "cannot listen on the migration's port again; listening on another");
                    self.listen_incoming(&spec.id, vtep, 0, from).await?
                }
            },
            None => self.listen_incoming(&spec.id, vtep, 0, from).await?,
        };
        Ok((changes, Some(port)))
    }

    /// Listens for guest `id`'s migration stream on `vtep`:`port` (0: any),
    /// records the port, and starts the task that hands the stream from
    /// `from` to the incoming QEMU ([`stream`]). Returns the port.
    async fn listen_incoming(
        &self,
        id: &str,
        vtep: std::net::Ipv4Addr,
        port: u16,
        from: std::net::Ipv4Addr,
    ) -> Result<u16, RuntimeError> {
        let fail = |reason: String| RuntimeError::Qemu {
            id: id.to_owned(),
            reason,
        };
        let dir = self.dir(id);
        let listener = stream::listen(self.node.netns().map(str::to_owned), vtep, port)
            .await
            .map_err(|e| fail(format!("listen for the migration stream on {vtep}:{port}: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| fail(format!("the migration listener's address: {e}")))?
            .port();
        fs::write(dir.join("incoming.port"), port.to_string())
            .map_err(|e| fail(format!("record the incoming port: {e}")))?;
        // This QEMU's wait: it ends with that process, not with the
        // directory's next one.
        let alive = {
            let dir = dir.clone();
            let pid = pid_in(&dir);
            move || pid.is_some() && pid_in(&dir) == pid
        };
        let handed = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(stream::hand_over(
            id.to_owned(),
            listener,
            from,
            self.qmp_socket(id),
            alive,
            handed.clone(),
        ));
        let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
        let wait = IncomingWait { task, handed };
        if let Some(old) = lives.entry(id.to_owned()).or_default().incoming.replace(wait) {
            old.task.abort();
        }
        Ok(port)
    }

    /// A migration's source: streams the guest to the target's incoming
    /// QEMU at `address` with `key`, and follows it. Idempotent: call it each
    /// round; it starts the stream once and says how it goes. Once it
    /// completed, this QEMU ends (the guest runs on the target).
    ///
    /// `forward`: where frames for the guest go on from once it has left;
    /// pinned at the switchover ([`switchover`]) until the round ends it
    /// ([`QemuRuntime::end_switchover`]). `local`: this node's VTEP, the
    /// address the stream leaves from (the target takes it from no other).
    #[allow(clippy::too_many_arguments)]
    pub async fn migrate_out(
        &self,
        id: &str,
        migration: &str,
        address: &str,
        key: &str,
        timeout: Duration,
        forward: Option<Forward>,
        local: Option<std::net::Ipv4Addr>,
    ) -> Result<Outgoing, RuntimeError> {
        let dir = self.dir(id);
        let fail = |reason: String| RuntimeError::Qemu {
            id: id.to_owned(),
            reason,
        };
        if fs::read_to_string(dir.join("migrated")).is_ok_and(|m| m.trim() == migration) {
            return Ok(Outgoing::Completed);
        }
        if self.pid(id).is_none() {
            return Ok(Outgoing::Failed("QEMU is not running on the source".into()));
        }
        let mut qmp = qmp::Qmp::connect(&self.qmp_socket(id))
            .await
            .map_err(|e| fail(e.to_string()))?;
        let ours = fs::read_to_string(dir.join("migration.id")).ok();
        let started_here = ours.as_deref().map(str::trim) == Some(migration);
        if !started_here {
            // The stream's connection first, before anything that pauses the
            // guest. A target not listening yet (its agent restarting, say)
            // is tried again each round, up to the migration's timeout.
            let target: std::net::SocketAddr = address
                .parse()
                .map_err(|e| fail(format!("the migration's target {address:?}: {e}")))?;
            let socket = match stream::connect(self.node.netns().map(str::to_owned), local, target).await {
                Ok(socket) => {
                    let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
                    lives.entry(id.to_owned()).or_default().connecting = None;
                    std::net::TcpStream::from(socket)
                }
                Err(e) => {
                    let waited = {
                        let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
                        let life = lives.entry(id.to_owned()).or_default();
                        if life.connecting.as_ref().is_none_or(|(m, _)| m != migration) {
                            life.connecting = Some((migration.to_owned(), Instant::now()));
                        }
                        life.connecting
                            .as_ref()
                            .map(|(_, t)| t.elapsed())
                            .unwrap_or_default()
                    };
                    if waited < timeout {
                        return Ok(Outgoing::Active(format!(
                            "waiting for the target to listen at {target}: {e}"
                        )));
                    }
                    return Err(fail(format!(
                        "the migration's target {target} did not take the stream in {}s: {e}",
                        timeout.as_secs()
                    )));
                }
            };
            let psk =
                write_psk(&dir, "psk-out", key).map_err(|e| fail(format!("write the migration key: {e}")))?;
            // An earlier migration's credentials go first (a retry after a failure).
            let _ = qmp.execute("object-del", Some(json!({ "id": "migout" }))).await;
            qmp.execute(
                "object-add",
                Some(json!({
                    "qom-type": "tls-creds-psk",
                    "id": "migout",
                    "endpoint": "client",
                    "dir": psk.display().to_string(),
                    "username": PSK_USER,
                })),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
            let downtime = downtime_limit(0, self.config.migration_downtime);
            let downtime_ms = u64::try_from(downtime.as_millis()).unwrap_or(u64::MAX);
            let mut params = json!({ "tls-creds": "migout", "downtime-limit": downtime_ms });
            if let Some(bw) = self.config.migration_bandwidth {
                params["max-bandwidth"] = json!(bw);
            }
            qmp.execute("migrate-set-parameters", Some(params))
                .await
                .map_err(|e| fail(e.to_string()))?;
            // The watcher's monitor before the migration starts, so that it
            // misses no event. Without one (a QEMU started before it existed)
            // QEMU does not wait at the switchover: the rounds follow alone.
            let watcher = match qmp::Qmp::connect(&self.watch_socket(id)).await {
                Ok(w) => Some(w),
                Err(e) => {
                    debug!(vm_id = %id, error = %e, "no second QMP monitor; the rounds follow the migration");
                    None
                }
            };
            qmp.execute(
                "migrate-set-capabilities",
                Some(json!({ "capabilities": [
                    { "capability": "events", "state": true },
                    { "capability": "pause-before-switchover", "state": watcher.is_some() },
                ] })),
            )
            .await
            .map_err(|e| fail(e.to_string()))?;
            let accel = self.recorded_accel(id).unwrap_or(self.accel);
            let version = qemu_version(&mut qmp).await.map_err(|e| fail(e.to_string()))?;
            if !migrates_live(accel, version) {
                qmp.execute("stop", None).await.map_err(|e| fail(e.to_string()))?;
                fs::write(dir.join(PAUSED_FOR_MIGRATION), migration)
                    .map_err(|e| fail(format!("record the pause: {e}")))?;
                warn!(
                    vm_id = %id,
                    qemu = %format!("{}.{}", version.0, version.1),
                    "QEMU before {}.{} misses guest writes in a live migration under TCG; this one pauses the guest until it has moved (stop-and-copy)",
                    TCG_LIVE_MIGRATION_FROM.0,
                    TCG_LIVE_MIGRATION_FROM.1
                );
            }
            let started = async {
                qmp.send_fd(stream::OUT_FD, &socket)
                    .await
                    .map_err(|e| e.to_string())?;
                qmp.execute(
                    "migrate",
                    Some(json!({ "uri": format!("fd:{}", stream::OUT_FD) })),
                )
                .await
                .map_err(|e| e.to_string())
            };
            if let Err(e) = started.await {
                // QEMU may hold a copy: the connection itself is shut, so
                // the target's QEMU is not left waiting on it.
                let _ = socket.shutdown(std::net::Shutdown::Both);
                resume_if_paused(&mut qmp, &dir, id).await;
                return Err(fail(e));
            }
            fs::write(dir.join("migration.id"), migration)
                .map_err(|e| fail(format!("record the migration: {e}")))?;
            let switchover = Switchover::new(id, forward.clone());
            {
                let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
                let life = lives.entry(id.to_owned()).or_default();
                life.migrating_since = Some(Instant::now());
                life.switchover = Some(switchover.clone());
                life.downtime = Some(downtime);
            }
            if let Some(w) = watcher {
                tokio::spawn(switchover::watch(w, switchover, self.events.clone(), timeout));
            }
            info!(vm_id = %id, to = %address, "QEMU migration started");
        }
        let info = qmp
            .execute("query-migrate", None)
            .await
            .map_err(|e| fail(e.to_string()))?;
        let status = info["status"].as_str().unwrap_or("none").to_owned();
        match status.as_str() {
            "completed" => {
                fs::write(dir.join("migrated"), migration)
                    .map_err(|e| fail(format!("record the migration: {e}")))?;
                let downtime = info["downtime"].as_u64();
                let total = info["total-time"].as_u64();
                let sent = info["ram"]["transferred"].as_u64();
                let passes = info["ram"]["dirty-sync-count"].as_u64();
                info!(vm_id = %id, downtime_ms = ?downtime, total_ms = ?total, bytes = ?sent, passes = ?passes, "QEMU migration completed; the source QEMU ends");
                let _ = qmp.execute("quit", None).await;
                Ok(Outgoing::Completed)
            }
            "pre-switchover" => {
                // Paused for the switchover. The watcher lets it go; with no
                // watcher (gone, or an agent restarted meanwhile) the round does.
                let switchover = self.switchover(id, forward);
                // Refused: the next round tries again, while QEMU waits there.
                if !switchover.watched() && switchover.let_go(&mut qmp).await.is_ok_and(|gone| gone) {
                    let forwarded = switchover.fired().await.is_some();
                    info!(vm_id = %id, forwarded, "QEMU switchover let go by the round: the guest leaves this node");
                }
                Ok(Outgoing::Active(status))
            }
            "failed" | "cancelled" => {
                let why = info["error-desc"].as_str().unwrap_or(&status).to_owned();
                let _ = fs::remove_file(dir.join("migration.id"));
                resume_if_paused(&mut qmp, &dir, id).await;
                warn!(vm_id = %id, error = %why, "QEMU migration failed; the guest runs on here");
                Ok(Outgoing::Failed(format!("QEMU migration {status}: {why}")))
            }
            _ => {
                let since = self
                    .lives
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(id.to_owned())
                    .or_default()
                    .migrating_since
                    .get_or_insert_with(Instant::now)
                    .elapsed();
                if since > timeout {
                    let _ = qmp.execute("migrate_cancel", None).await;
                    let _ = fs::remove_file(dir.join("migration.id"));
                    resume_if_paused(&mut qmp, &dir, id).await;
                    return Ok(Outgoing::Failed(format!(
                        "QEMU migration timed out after {}s ({status}); the guest runs on here",
                        timeout.as_secs()
                    )));
                }
                if let Some(passes) = info["ram"]["dirty-sync-count"].as_u64() {
                    self.raise_downtime(&mut qmp, id, passes).await;
                }
                Ok(Outgoing::Active(status))
            }
        }
    }

    /// Gives QEMU a higher downtime limit once the migration has made more
    /// passes than a guest that settles needs ([`downtime_limit`]). Never
    /// lowers it. A refused limit is not asked again; the next pass's is.
    async fn raise_downtime(&self, qmp: &mut qmp::Qmp, id: &str, passes: u64) {
        let want = downtime_limit(passes, self.config.migration_downtime);
        let set = {
            let lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
            lives.get(id).and_then(|l| l.downtime)
        };
        if set.is_some_and(|set| set >= want) {
            return;
        }
        let ms = u64::try_from(want.as_millis()).unwrap_or(u64::MAX);
        match qmp
            .execute("migrate-set-parameters", Some(json!({ "downtime-limit": ms })))
            .await
        {
            Ok(_) => {
                if want > downtime_limit(0, self.config.migration_downtime) {
                    info!(vm_id = %id, passes, downtime_limit_ms = ms, "the guest writes memory faster than the migration's downtime limit lets it finish; allowing more");
                }
                let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
                lives.entry(id.to_owned()).or_default().downtime = Some(want);
            }
            Err(e) => {
                // Not asked again for this limit (each round would).
                warn!(vm_id = %id, error = %e, downtime_limit_ms = ms, "QEMU refused a higher downtime limit");
                let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
                lives.entry(id.to_owned()).or_default().downtime = Some(want);
            }
        }
    }

    /// The switchover of guest `id`'s outgoing migration: the one its start
    /// recorded, or (an agent restarted since) a new one.
    fn switchover(&self, id: &str, forward: Option<Forward>) -> Arc<Switchover> {
        let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
        lives
            .entry(id.to_owned())
            .or_default()
            .switchover
            .get_or_insert_with(|| Switchover::new(id, forward))
            .clone()
    }

    /// The guests with a switchover recorded.
    pub fn switchovers(&self) -> Vec<String> {
        let lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
        lives
            .iter()
            .filter(|(_, life)| life.switchover.is_some())
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// Forgets guest `id`'s switchover, once its migration ended (or is no
    /// longer asked for), and says the forward it put in (overlay device,
    /// MAC), if it did: the round unpins it.
    pub async fn end_switchover(&self, id: &str) -> Option<(String, [u8; 6])> {
        let switchover = {
            let mut lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
            lives.get_mut(id)?.switchover.take()?
        };
        switchover.end().await
    }

    /// Ends guest `id` (QMP `quit`, then SIGKILL past 5 s) and removes its
    /// directory; its tap goes with QEMU. An unknown guest is not an error.
    pub async fn remove(&self, id: &str) -> Result<Vec<Change>, RuntimeError> {
        let mut changes = Vec::new();
        if let Some(task) = self
            .lives
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(id)
            .and_then(|l| l.incoming.take())
        {
            task.task.abort();
        }
        if let Some(pid) = self.pid(id) {
            let quit = async {
                let mut qmp = qmp::Qmp::connect(&self.qmp_socket(id)).await?;
                qmp.execute("quit", None).await
            };
            if let Err(e) = quit.await {
                warn!(vm_id = %id, pid, error = %e, "QEMU did not take quit; killing it");
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGTERM,
                );
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while self.pid(id).is_some() {
                if Instant::now() >= deadline {
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            info!(vm_id = %id, pid, "QEMU guest ended");
            changes.push(Change::QemuEnded {
                id: id.to_owned(),
                pid,
            });
        }
        let dir = self.dir(id);
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(|e| RuntimeError::Qemu {
                id: id.to_owned(),
                reason: format!("remove {}: {e}", dir.display()),
            })?;
        }
        self.lives.lock().unwrap_or_else(|p| p.into_inner()).remove(id);
        Ok(changes)
    }

    /// Every QEMU guest this node has a directory for.
    pub fn list(&self) -> Result<Vec<QemuGuest>, RuntimeError> {
        let entries = match fs::read_dir(&self.config.state_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => {
                return Err(RuntimeError::Qemu {
                    id: "*".into(),
                    reason: format!("list {}: {e}", self.config.state_dir.display()),
                })
            }
        };
        let mut out: Vec<QemuGuest> = entries
            .filter_map(Result::ok)
            .filter(|e| e.path().is_dir())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|id| super::validate_id(id).is_ok())
            .map(|id| QemuGuest {
                pid: self.pid(&id),
                id,
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// What to report for guest `id`.
    pub fn view(&self, id: &str) -> QemuView {
        let lives = self.lives.lock().unwrap_or_else(|p| p.into_inner());
        let life = lives.get(id);
        if self.pid(id).is_some() {
            return QemuView::Running {
                accelerator: self.recorded_accel(id).unwrap_or(self.accel),
            };
        }
        let last = life
            .and_then(|l| l.last.clone())
            .unwrap_or_else(|| "QEMU not started yet".into());
        if life.is_some_and(|l| l.crashes.is_crashing()) {
            QemuView::Crashing(last)
        } else {
            QemuView::Starting(last)
        }
    }

    /// The accelerator guest `id` was started with (its recorded command line).
    fn recorded_accel(&self, id: &str) -> Option<Accelerator> {
        let argv = fs::read_to_string(self.dir(id).join("argv")).ok()?;
        if argv.contains("accel=kvm") {
            Some(Accelerator::Kvm)
        } else if argv.contains("accel=tcg") {
            Some(Accelerator::Tcg)
        } else {
            None
        }
    }
}

/// The TLS-PSK identity both ends of a migration use.
const PSK_USER: &str = "otherix";

/// The second QMP monitor's socket, in a guest's directory.
const WATCH_SOCKET: &str = "qmp-watch.sock";

/// QEMU's version, (major, minor), from QMP.
async fn qemu_version(qmp: &mut qmp::Qmp) -> Result<(u64, u64), qmp::QmpError> {
    let v = qmp.execute("query-version", None).await?;
    match (v["qemu"]["major"].as_u64(), v["qemu"]["minor"].as_u64()) {
        (Some(major), Some(minor)) => Ok((major, minor)),
        _ => Err(qmp::QmpError::Protocol(format!(
            "query-version without a version: {v}"
        ))),
    }
}

/// The pid of the QEMU whose state directory is `dir`, while it runs (its
/// pidfile names a live process whose command line names that pidfile).
fn pid_in(dir: &Path) -> Option<i32> {
    let pidfile = dir.join("qemu.pid");
    let pid: i32 = fs::read_to_string(&pidfile).ok()?.trim().parse().ok()?;
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let want = pidfile.to_string_lossy();
    cmdline
        .split(|&b| b == 0)
        .any(|arg| arg == want.as_bytes())
        .then_some(pid)
}

/// Runs a guest paused for a migration again (`cont`), if it is paused, and
/// forgets the pause. Best effort: a failure is logged, and the next round
/// tries again while the record stays.
async fn resume_if_paused(qmp: &mut qmp::Qmp, dir: &Path, id: &str) {
    let paused_here = dir.join(PAUSED_FOR_MIGRATION).exists();
    let resumable = match qmp.status().await {
        Ok(status) if status == "paused" => Ok(true),
        // Still switching over (a cancel not through yet): the record stays,
        // and the next round looks again.
        Ok(status) if status == "finish-migrate" && paused_here => return,
        // Left there by a migration cancelled or failed after this node
        // paused the guest; never after one that completed (that guest runs
        // on the target now).
        Ok(status) if status == "postmigrate" && paused_here => {
            match qmp.execute("query-migrate", None).await {
                Ok(info) => Ok(matches!(info["status"].as_str(), Some("cancelled" | "failed"))),
                Err(e) => Err(e),
            }
        }
        Ok(_) => Ok(false),
        Err(e) => Err(e),
    };
    match resumable {
        Ok(true) => match qmp.execute("cont", None).await {
            Ok(_) => info!(vm_id = %id, "guest paused for a migration runs again"),
            Err(e) => {
                warn!(vm_id = %id, error = %e, "guest paused for a migration did not run again");
                return;
            }
        },
        Ok(_) => {}
        Err(e) => {
            warn!(vm_id = %id, error = %e, "no status for a guest paused for a migration");
            return;
        }
    }
    let _ = fs::remove_file(dir.join(PAUSED_FOR_MIGRATION));
}

/// Writes `dir/{name}/keys.psk` (the owner's alone) for QEMU's
/// `tls-creds-psk`; returns the directory.
fn write_psk(dir: &Path, name: &str, key: &str) -> std::io::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    if key.len() != 64 || !key.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(std::io::Error::other("the migration key is not 32 bytes of hex"));
    }
    let psk = dir.join(name);
    fs::DirBuilder::new().recursive(true).mode(0o700).create(&psk)?;
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(psk.join("keys.psk"))?;
    std::io::Write::write_all(&mut f, format!("{PSK_USER}:{key}\n").as_bytes())?;
    Ok(psk)
}

/// QEMU's arguments for a guest: pure, so the command line is a unit test.
pub fn qemu_argv(
    spec: &super::GuestSpec,
    q: &QemuSpec,
    image: &Image,
    dir: &Path,
    accel: Accelerator,
) -> Result<Vec<String>, RuntimeError> {
    let invalid = |reason: String| RuntimeError::InvalidSpec {
        id: spec.id.clone(),
        reason,
    };
    // The host name goes on the kernel command line: keep it one plain word.
    if q.hostname.is_empty()
        || q.hostname.len() > 63
        || !q
            .hostname
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
    {
        return Err(invalid(format!("host name {:?} is not a plain name", q.hostname)));
    }
    let mac = spec
        .mac
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    let append = format!(
        "console=ttyS0 quiet panic=-1 otherix.name={} otherix.ip={}/{} otherix.gw={} otherix.mtu={}",
        q.hostname, spec.ip, spec.prefix, spec.gateway, spec.mtu
    );
    if append.len() >= MAX_CMDLINE {
        return Err(invalid("kernel command line too long".into()));
    }
    // A comma in a path would split QEMU's option lists.
    if dir.display().to_string().contains(',') {
        return Err(invalid(format!(
            "state directory {} holds a comma",
            dir.display()
        )));
    }
    let path = |f: &str| dir.join(f).display().to_string();
    let argv: Vec<String> = vec![
        "-name".into(),
        format!("{},process=oxq-{}", spec.id, &spec.id[..spec.id.len().min(10)]),
        "-machine".into(),
        format!("pc,accel={}", accel.as_str()),
        "-m".into(),
        format!("{}M", q.memory_mib),
        "-smp".into(),
        q.cpus.to_string(),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-kernel".into(),
        image.kernel.display().to_string(),
        "-initrd".into(),
        image.initrd.display().to_string(),
        "-append".into(),
        append,
        "-netdev".into(),
        format!("tap,id=n0,ifname={},script=no,downscript=no", spec.host_veth),
        "-device".into(),
        format!("virtio-net-pci,netdev=n0,mac={mac},host_mtu={}", spec.mtu),
        "-fw_cfg".into(),
        format!(
            "name=opt/otherix/authorized_keys,file={}",
            path("authorized_keys")
        ),
        "-chardev".into(),
        format!(
            "socket,id=console,path={},server=on,wait=off,logfile={},logappend=on",
            path("console.sock"),
            path("console.log")
        ),
        "-serial".into(),
        "chardev:console".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", path("qmp.sock")),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", path(WATCH_SOCKET)),
        "-pidfile".into(),
        path("qemu.pid"),
        "-daemonize".into(),
    ];
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    #[test]
    fn the_downtime_limit_starts_low_and_doubles_after_three_passes_up_to_the_most() {
        let ms = Duration::from_millis;
        let most = DEFAULT_MIGRATION_DOWNTIME;
        let limits: Vec<_> = (0..=8).map(|p| downtime_limit(p, most)).collect();
        assert_eq!(
            limits,
            [
                ms(10),
                ms(10),
                ms(10),
                ms(10),
                ms(20),
                ms(40),
                ms(50),
                ms(50),
                ms(50)
            ]
        );
        // A most below the first limit is the limit from the start.
        assert_eq!(downtime_limit(0, ms(5)), ms(5));
        assert_eq!(downtime_limit(100, ms(5)), ms(5));
        // No overflow however many passes.
        assert_eq!(
            downtime_limit(u64::MAX, Duration::from_secs(10)),
            Duration::from_secs(10)
        );
    }
    use crate::runtime::GuestSpec;

    fn spec() -> (GuestSpec, QemuSpec, Image) {
        (
            GuestSpec {
                id: "0123456789abcdef".into(),
                netns: "oxg-x".into(),
                host_veth: "oxh0123".into(),
                bridge: "oxb100".into(),
                mac: [2, 0, 0, 0, 0, 9],
                ip: Ipv4Addr::new(10, 1, 0, 5),
                prefix: 24,
                gateway: Ipv4Addr::new(10, 1, 0, 1),
                mtu: 1450,
                command: None,
                qemu: None,
            },
            QemuSpec {
                hostname: "web01".into(),
                memory_mib: 256,
                cpus: 1,
                image: "default".into(),
                ssh_keys: vec![],
            },
            Image {
                name: "default".into(),
                dir: "/c/default".into(),
                kernel: "/c/default/vmlinuz".into(),
                initrd: "/c/default/initrd.cpio".into(),
                kernel_release: "6.1".into(),
            },
        )
    }

    #[test]
    fn the_guest_gets_the_leases_mac_ip_and_mtu_and_a_tap_on_its_name() {
        let (s, q, i) = spec();
        let argv = qemu_argv(&s, &q, &i, Path::new("/state/qemu/g"), Accelerator::Tcg).unwrap();
        let line = argv.join(" ");
        assert!(
            line.contains("virtio-net-pci,netdev=n0,mac=02:00:00:00:00:09,host_mtu=1450"),
            "{line}"
        );
        assert!(line.contains("tap,id=n0,ifname=oxh0123,"), "{line}");
        assert!(
            line.contains("otherix.ip=10.1.0.5/24 otherix.gw=10.1.0.1 otherix.mtu=1450"),
            "{line}"
        );
        assert!(line.contains("pc,accel=tcg"), "{line}");
        assert!(
            line.contains("-pidfile /state/qemu/g/qemu.pid -daemonize"),
            "{line}"
        );
    }

    #[test]
    fn a_host_name_that_is_no_plain_word_is_refused() {
        let (s, mut q, i) = spec();
        for bad in ["", "a b", "x otherix.ip=1.2.3.4/32", "a\"b"] {
            q.hostname = bad.into();
            assert!(
                qemu_argv(&s, &q, &i, Path::new("/s"), Accelerator::Tcg).is_err(),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_state_directory_with_a_comma_is_refused() {
        let (s, q, i) = spec();
        assert!(qemu_argv(&s, &q, &i, Path::new("/s,x"), Accelerator::Tcg).is_err());
    }

    #[test]
    fn tcg_guests_migrate_live_only_on_a_qemu_that_sees_every_write() {
        assert!(
            !migrates_live(Accelerator::Tcg, (7, 2)),
            "Debian 12's QEMU pauses the guest"
        );
        assert!(!migrates_live(Accelerator::Tcg, (9, 2)));
        assert!(migrates_live(Accelerator::Tcg, (10, 0)));
        assert!(migrates_live(Accelerator::Tcg, (11, 1)));
        assert!(
            migrates_live(Accelerator::Kvm, (7, 2)),
            "KVM tracks dirty pages in the kernel"
        );
    }

    #[test]
    fn accelerator_choices_parse() {
        assert_eq!("auto".parse::<AccelChoice>().unwrap(), AccelChoice::Auto);
        assert_eq!("tcg".parse::<AccelChoice>().unwrap(), AccelChoice::Tcg);
        assert!("hvf".parse::<AccelChoice>().is_err());
        assert_eq!(detect_accel(AccelChoice::Tcg).0, Accelerator::Tcg);
    }
}
