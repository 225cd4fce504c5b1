//! The `netns` guest runtime: a guest is a network namespace plus a veth pair.
//!
//! Layout of one guest (names from the [`GuestSpec`]):
//!
//! ```text
//!  node namespace                         guest namespace (spec.netns)
//!  bridge ── host_veth  <── veth pair ──>  eth0: lease MAC, IP/prefix, MTU
//!                                          lo (up; its alias records the guest id)
//!                                          default via spec.gateway
//! ```
//!
//! The guest's id and host veth name are recorded in the kernel itself, as the alias
//! of the guest namespace's `lo` (which cannot be deleted), so that [`GuestRuntime::list`]
//! finds and attributes guests after an agent restart without any state file.
//!
//! The runtime works in two namespaces at once: `node` (a [`Netlink`] handle given at
//! construction, for the bridge and host veths) and each guest's namespace, reached
//! with [`Netlink::connect_in`]. Neither moves any thread of the agent.

use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tracing::{info, info_span, warn, Instrument};

use super::{GuestInfo, GuestRuntime, GuestSpec, Launcher, RuntimeError, Workload};
use crate::net::{netns, Change, IfAddr, Link, LinkWant, NetError, Netlink, Netns};

/// Name of the guest's NIC inside its namespace.
pub const GUEST_IFNAME: &str = "eth0";

/// Start of the `lo` alias that marks a namespace as a guest of ours.
const RECORD_TAG: &str = "otherix-guest";

fn record(id: &str, host_veth: &str) -> String {
    format!("{RECORD_TAG} id={id} veth={host_veth}")
}

/// The record of a guest being handed over to the node namespace `to`: the target's
/// agent keeps such a guest, which is not in its desired state yet, instead of removing
/// it as a stray. The target's `ensure` writes the plain record back.
fn handover_record(id: &str, host_veth: &str, to: &str) -> String {
    format!("{} to={to}", record(id, host_veth))
}

/// The `to=` word of a guest record: the namespace the guest was handed over to.
fn parse_handover(alias: &str) -> Option<String> {
    parse_record(alias)?;
    alias
        .split_whitespace()
        .find_map(|w| w.strip_prefix("to=").map(str::to_owned))
}

/// Parses [`record`]'s output back into `(id, host_veth)`.
fn parse_record(alias: &str) -> Option<(String, String)> {
    let mut words = alias.split_whitespace();
    if words.next()? != RECORD_TAG {
        return None;
    }
    let (mut id, mut veth) = (None, None);
    for w in words {
        if let Some(v) = w.strip_prefix("id=") {
            id = Some(v.to_owned());
        } else if let Some(v) = w.strip_prefix("veth=") {
            veth = Some(v.to_owned());
        }
    }
    Some((id?, veth?))
}

/// True if `host` (in the node namespace) and `eth0` (in the guest's) are the two
/// ends of one veth pair: each one's `IFLA_LINK` is the other's index.
fn paired(host: &Link, eth0: &Link) -> bool {
    host.kind.as_deref() == Some("veth")
        && host.peer_index == Some(eth0.index)
        && eth0.peer_index == Some(host.index)
}

/// Guests as network namespaces, attached to bridges in the node namespace.
#[derive(Clone, Debug)]
pub struct NetnsRuntime {
    node: Netlink,
    prefix: String,
}

impl NetnsRuntime {
    /// A runtime whose guests' namespaces are named `prefix...`, with bridges and host
    /// veths in the namespace of `node`. Use one prefix per node: namespaces are
    /// host-global, and [`GuestRuntime::list`] claims every namespace with the prefix.
    pub fn new(node: Netlink, prefix: impl Into<String>) -> Result<Self, RuntimeError> {
        let prefix = prefix.into();
        if prefix.is_empty() {
            return Err(RuntimeError::InvalidSpec {
                id: String::new(),
                reason: "the guest namespace prefix must not be empty".into(),
            });
        }
        Ok(Self { node, prefix })
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The node-namespace handle this runtime works with.
    pub fn node(&self) -> &Netlink {
        &self.node
    }

    /// Moves the host end of `guest`'s veth from this runtime's node namespace into
    /// `to` and enslaves it to `to_bridge` there (live migration in the netns world).
    ///
    /// The guest's namespace, its `eth0`, addresses and TCP state are untouched; only
    /// the wire behind it moves. The caller repoints the overlays' FDB entries. If the
    /// veth is already in `to`, this only makes sure it is enslaved and up there.
    /// `on_moved` runs right after the veth left this namespace (by then already
    /// enslaved and up in `to`: one request does all three), and only then.
    pub async fn move_host_veth(
        &self,
        guest: &GuestSpec,
        to: &Netns,
        to_bridge: &str,
        on_moved: impl AsyncFnOnce(),
    ) -> Result<Vec<Change>, RuntimeError> {
        guest.validate()?;
        crate::net::validate_ifname(to_bridge)?;
        let target = Netlink::connect_in(to)?;
        // Fail before moving anything if the destination bridge is missing.
        let Some(bridge) = target.link(to_bridge).await? else {
            return Err(RuntimeError::TargetBridgeMissing {
                bridge: to_bridge.to_owned(),
                netns: to.name().to_owned(),
            });
        };
        // Marked before the move, so the target never takes it for a stray.
        let ns = Netns::open(&guest.netns)?;
        let lo = LinkWant {
            up: true,
            alias: Some(handover_record(&guest.id, &guest.host_veth, to.name())),
            ..LinkWant::default()
        };
        let marked = Netlink::connect_in(&ns)?.ensure_link("lo", &lo).await?;
        let mut changes = Vec::new();
        if self.node.link(&guest.host_veth).await?.is_some() {
            // One request moves it, enslaves it to the bridge there and raises it:
            // the guest's `eth0` has no carrier, and drops what the guest sends,
            // only while the kernel moves it, not for two round trips more.
            self.node
                .move_link_onto(&guest.host_veth, to, bridge.index, guest.mtu)
                .await?;
            // First thing once the veth has left (frames for the guest that still
            // arrive here are lost from now on).
            on_moved().await;
            changes.push(Change::LinkMoved {
                link: self.node.at(&guest.host_veth),
                to_netns: to.name().to_owned(),
            });
        } else if target.link(&guest.host_veth).await?.is_none() {
            return Err(NetError::LinkNotFound {
                link: guest.host_veth.clone(),
            }
            .into());
        }
        let want = LinkWant {
            mtu: Some(guest.mtu),
            controller: Some(to_bridge.to_owned()),
            up: true,
            ..LinkWant::default()
        };
        changes.extend(marked);
        // Only checks, after a move that went in whole; makes it right otherwise
        // (a veth moved in an earlier round, or a kernel that refused part of it).
        changes.extend(target.ensure_link(&guest.host_veth, &want).await?);
        Ok(changes)
    }

    /// The node namespace a guest was handed over to, if its record says so (set by
    /// [`NetnsRuntime::move_host_veth`], cleared by the target's `ensure`).
    pub async fn handed_to(&self, guest_netns: &str) -> Result<Option<String>, RuntimeError> {
        let ns = Netns::open(guest_netns)?;
        let lo = Netlink::connect_in(&ns)?.link("lo").await?;
        Ok(lo.and_then(|l| l.alias).and_then(|a| parse_handover(&a)))
    }

    /// True if a guest namespace of this runtime records `host_veth` as its veth and
    /// says it was handed over to the node namespace `to`. Read when asked, not from
    /// an earlier [`GuestRuntime::list`]: a veth that arrived since (a migration's
    /// source moves it at any moment) is seen as arriving, not as a stray.
    pub async fn arriving(&self, host_veth: &str, to: &str) -> Result<bool, RuntimeError> {
        for name in netns::list(&self.prefix)? {
            let ns = match Netns::open(&name) {
                Ok(ns) => ns,
                Err(NetError::NetnsNotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let alias = Netlink::connect_in(&ns)?
                .link("lo")
                .await?
                .and_then(|lo| lo.alias);
            let Some(alias) = alias else { continue };
            if parse_record(&alias).is_some_and(|(_, veth)| veth == host_veth)
                && parse_handover(&alias).as_deref() == Some(to)
            {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Removes a guest found by [`GuestRuntime::list`], also one without an id.
    pub async fn purge(&self, guest: &GuestInfo) -> Result<Vec<Change>, RuntimeError> {
        let mut changes = Vec::new();
        kill_all_in(&guest.netns).await?;
        if let Some(veth) = &guest.host_veth {
            // Deleting one end of a veth deletes both. If the host end has moved away
            // (to another node), freeing the namespace below takes the pair down.
            if let Some(link) = self.node.link(veth).await? {
                if link.kind.as_deref() == Some("veth") && self.node.delete_link(veth).await? {
                    changes.push(Change::LinkDeleted {
                        link: self.node.at(veth),
                    });
                }
            }
        }
        if netns::delete(&guest.netns)? {
            changes.push(Change::NetnsDeleted {
                netns: guest.netns.clone(),
            });
        }
        Ok(changes)
    }

    async fn ensure_inner(&self, spec: &GuestSpec) -> Result<Vec<Change>, RuntimeError> {
        spec.validate()?;
        if !spec.netns.starts_with(&self.prefix) {
            return Err(RuntimeError::InvalidSpec {
                id: spec.id.clone(),
                reason: format!(
                    "netns {} does not start with this runtime's prefix {}",
                    spec.netns, self.prefix
                ),
            });
        }
        // Check the bridge first so a bad spec leaves nothing half-built behind.
        self.node.require_index(&spec.bridge).await?;

        let mut changes = Vec::new();
        if netns::create(&spec.netns)? {
            changes.push(Change::NetnsCreated {
                netns: spec.netns.clone(),
            });
        }
        let ns = Netns::open(&spec.netns)?;
        let guest = Netlink::connect_in(&ns)?;
        // The record goes first: a crash after this point still leaves a namespace
        // that `list` attributes to this guest, so `remove` can clean it up.
        let lo = LinkWant {
            up: true,
            alias: Some(record(&spec.id, &spec.host_veth)),
            ..LinkWant::default()
        };
        changes.extend(guest.ensure_link("lo", &lo).await?);

        let host = self.node.link(&spec.host_veth).await?;
        let eth0 = guest.link(GUEST_IFNAME).await?;
        let create = match (&host, &eth0) {
            (Some(h), Some(e)) if paired(h, e) => false,
            (_, Some(_)) => {
                return Err(RuntimeError::AttachedElsewhere {
                    id: spec.id.clone(),
                    netns: spec.netns.clone(),
                    host_veth: spec.host_veth.clone(),
                })
            }
            (Some(h), None) => {
                if h.kind.as_deref() != Some("veth") {
                    return Err(NetError::WrongKind {
                        link: spec.host_veth.clone(),
                        expected: "veth",
                        found: h.kind.clone().unwrap_or_else(|| "kindless link".into()),
                    }
                    .into());
                }
                // A host end without its guest end: a half-built or damaged pair.
                warn!(host_veth = %spec.host_veth, "host veth has no guest end; recreating the pair");
                self.node.delete_link(&spec.host_veth).await?;
                changes.push(Change::LinkDeleted {
                    link: self.node.at(&spec.host_veth),
                });
                true
            }
            (None, None) => true,
        };
        if create {
            self.node
                .create_veth_into(&spec.host_veth, &ns, GUEST_IFNAME, spec.mac, spec.mtu)
                .await?;
            changes.push(Change::LinkCreated {
                link: self.node.at(&spec.host_veth),
            });
        }

        let host_want = LinkWant {
            mtu: Some(spec.mtu),
            controller: Some(spec.bridge.clone()),
            up: true,
            ..LinkWant::default()
        };
        changes.extend(self.node.ensure_link(&spec.host_veth, &host_want).await?);
        let eth0_want = LinkWant {
            mtu: Some(spec.mtu),
            mac: Some(spec.mac),
            up: true,
            ..LinkWant::default()
        };
        changes.extend(guest.ensure_link(GUEST_IFNAME, &eth0_want).await?);
        changes.extend(
            guest
                .ensure_address(GUEST_IFNAME, Some(IfAddr::new(spec.ip, spec.prefix)), true)
                .await?,
        );
        changes.extend(guest.ensure_default_route(GUEST_IFNAME, spec.gateway).await?);
        if !changes.is_empty() {
            info!(changes = changes.len(), "guest network converged");
        }
        Ok(changes)
    }
}

impl GuestRuntime for NetnsRuntime {
    async fn ensure(&self, spec: &GuestSpec) -> Result<Vec<Change>, RuntimeError> {
        let span = info_span!("guest", id = %spec.id, netns = %spec.netns);
        self.ensure_inner(spec).instrument(span).await
    }

    async fn remove(&self, id: &str) -> Result<Vec<Change>, RuntimeError> {
        super::validate_id(id)?;
        let guests = self.list().await?;
        let mut changes = Vec::new();
        // Normally one; more only if something duplicated the record by hand.
        for g in guests.iter().filter(|g| g.id.as_deref() == Some(id)) {
            changes.extend(self.purge(g).await?);
        }
        Ok(changes)
    }

    async fn list(&self) -> Result<Vec<GuestInfo>, RuntimeError> {
        let mut out = Vec::new();
        for name in netns::list(&self.prefix)? {
            let ns = match Netns::open(&name) {
                Ok(ns) => ns,
                // Deleted while we listed: not a guest any more.
                Err(NetError::NetnsNotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let nl = Netlink::connect_in(&ns)?;
            let rec = nl
                .link("lo")
                .await?
                .and_then(|lo| lo.alias)
                .and_then(|alias| parse_record(&alias));
            let (id, host_veth) = match rec {
                Some((id, veth)) => (Some(id), Some(veth)),
                None => (None, None),
            };
            out.push(GuestInfo {
                id,
                netns: name.clone(),
                host_veth,
                pids: netns::pids(&name)?,
            });
        }
        Ok(out)
    }
}

/// SIGKILLs every process in the namespace and waits (bounded) until none is left.
async fn kill_all_in(netns_name: &str) -> Result<(), RuntimeError> {
    for _ in 0..200 {
        let pids = match netns::pids(netns_name) {
            Ok(p) => p,
            // Already gone.
            Err(NetError::Netns { .. }) => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        if pids.is_empty() {
            return Ok(());
        }
        for pid in pids {
            // ESRCH: it exited meanwhile, which is what we want.
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    warn!(
        netns = netns_name,
        "processes survived SIGKILL for 2s; deleting the namespace anyway"
    );
    Ok(())
}

/// Starts `argv` inside the named namespace, stdout and stderr appended to `log_path`
/// (created with its parent directory if needed), stdin from `/dev/null`, as the
/// leader of a new process group so that it can be stopped with all its children.
///
/// The child is forked from a thread that has entered the namespace (see
/// [`Netns::run`]), so it starts inside it: no `pre_exec` hook and no `unsafe`.
/// Unlike `ip netns exec`, it does not remount `/sys` or bind `/etc/netns/NAME`.
pub fn spawn_in_netns(netns_name: &str, argv: &[String], log_path: &Path) -> Result<Child, RuntimeError> {
    let Some((program, args)) = argv.split_first() else {
        return Err(RuntimeError::InvalidSpec {
            id: netns_name.to_owned(),
            reason: "empty command".into(),
        });
    };
    let io_err = |op: &'static str, e: io::Error| NetError::netns(netns_name, op, e);
    if let Some(dir) = log_path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io_err("create log directory", e))?;
    }
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(log_path)
        .map_err(|e| io_err("open log file", e))?;
    let log2 = log.try_clone().map_err(|e| io_err("dup log file", e))?;
    let mut cmd = Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log2)
        .process_group(0);
    let ns = Netns::open(netns_name)?;
    let child = ns
        .run(move || cmd.spawn())?
        .map_err(|e| io_err("spawn workload", e))?;
    info!(netns = netns_name, pid = child.id(), program = %program, "workload started");
    Ok(child)
}

/// [`Launcher`] for the netns runtime: starts workloads with [`spawn_in_netns`].
#[derive(Clone, Copy, Debug, Default)]
pub struct NetnsLauncher;

impl Launcher for NetnsLauncher {
    fn launch(&self, w: &Workload) -> io::Result<Child> {
        spawn_in_netns(&w.netns, &w.command, &w.log_path).map_err(io::Error::other)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_record_round_trips() {
        let r = record("web-01.a", "oxv1");
        assert_eq!(parse_record(&r), Some(("web-01.a".into(), "oxv1".into())));
    }

    #[test]
    fn a_handover_record_is_still_a_guest_record_and_names_the_target() {
        let r = handover_record("web-01.a", "oxv1", "ox12ab-node2");
        assert_eq!(parse_record(&r), Some(("web-01.a".into(), "oxv1".into())));
        assert_eq!(parse_handover(&r).as_deref(), Some("ox12ab-node2"));
        assert_eq!(parse_handover(&record("web-01.a", "oxv1")), None);
        assert_eq!(parse_handover("to=x"), None, "not a guest record");
    }

    #[test]
    fn foreign_alias_is_not_a_guest_record() {
        assert_eq!(parse_record("uplink to rack 3"), None);
        assert_eq!(parse_record("otherix-guest id=x"), None);
    }
}
