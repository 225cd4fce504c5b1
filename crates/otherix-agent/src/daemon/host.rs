//! Facts about the host the agent runs on: its privileges, its VTEP address and the
//! underlay interface that carries VXLAN.

use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use std::sync::Arc;

use otherix_client::{ClientError, Endpoint};

use super::plan::Underlay;
use super::DaemonError;
use crate::net::{NetError, Netlink};

/// `CAP_NET_ADMIN`: links, addresses, FDB and neighbor tables.
const CAP_NET_ADMIN: u32 = 12;
/// `CAP_SYS_ADMIN`: `setns`, `unshare` and the bind mounts of named namespaces.
const CAP_SYS_ADMIN: u32 = 21;

/// Fails unless the process holds the capabilities the agent needs (root has them).
pub fn check_privileges() -> Result<(), DaemonError> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    if has_caps(&status, &[CAP_NET_ADMIN, CAP_SYS_ADMIN]) {
        Ok(())
    } else {
        Err(DaemonError::NotPrivileged)
    }
}

/// Whether the `CapEff:` line of a `/proc/PID/status` text holds every one of `caps`.
fn has_caps(status: &str, caps: &[u32]) -> bool {
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    caps.iter().all(|c| eff & (1 << c) != 0)
}

/// Whether this process sees another mount table than init does (e.g. it was started
/// by `ip netns exec`, which unshares the mount namespace). Guest namespaces it mounts
/// under `/run/netns` would then be invisible to other tools and to a restarted agent.
pub fn in_private_mount_namespace() -> bool {
    use std::os::unix::fs::MetadataExt;
    let ino = |p: &str| std::fs::metadata(p).map(|m| (m.dev(), m.ino())).ok();
    match (ino("/proc/self/ns/mnt"), ino("/proc/1/ns/mnt")) {
        (Some(me), Some(init)) => me != init,
        _ => false,
    }
}

/// The name under `/run/netns` of the network namespace the agent runs in, if it has
/// one: the entry whose device and inode are those of `/proc/self/ns/net`. Reported in
/// heartbeats so that a migrating guest's source node can hand the guest's veth over
/// to this node's namespace by name. `None` for an unnamed namespace (the host's own,
/// usually).
pub fn own_netns_name() -> Option<String> {
    own_netns_name_in(Path::new("/run/netns"), Path::new("/proc/self/ns/net"))
}

/// The entry of `dir` that is the same file (device and inode) as `own`.
fn own_netns_name_in(dir: &Path, own: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let id = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.dev(), m.ino()));
    let me = id(own)?;
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .filter(|e| id(&e.path()) == Some(me))
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    // Several names for one namespace: any works; pick one deterministically.
    names.sort();
    names.into_iter().next()
}

/// Why the VTEP address cannot be found now: the control plane's name does
/// not resolve, or this host has no IPv4 route to it (`--vtep` names one).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VtepError {
    /// Operator: `--server` is not a URL (checked at start already).
    #[error(transparent)]
    Server(#[from] ClientError),
    /// Network: the control plane's host name does not resolve.
    #[error("resolving {host}: {source}")]
    Resolve {
        host: String,
        #[source]
        source: std::io::Error,
    },
    /// Operator: the control plane's name has only IPv6 addresses.
    #[error("{0} has no IPv4 address; pass --vtep")]
    NoIpv4(String),
    /// Host: a UDP socket cannot be made.
    #[error("udp socket: {0}")]
    Socket(#[source] std::io::Error),
    /// Host: no route to the control plane.
    #[error("no route to {target}: {source}")]
    NoRoute {
        target: std::net::SocketAddr,
        #[source]
        source: std::io::Error,
    },
    /// Host: the route's source address cannot be read.
    #[error("{0}")]
    LocalAddr(#[source] std::io::Error),
    /// Operator: the route leaves from IPv6, and VXLAN here is IPv4.
    #[error("the route to the control plane leaves from IPv6 {0}; pass --vtep")]
    Ipv6(std::net::Ipv6Addr),
}

/// The local address this host uses to reach the control plane — the first
/// of `servers` (its replicas) there is a route to: the VTEP by default.
/// Replicas of one cluster sit on one network, so any gives the address
/// they see the node's connections come from.
pub async fn route_source_to(servers: &[String]) -> Result<Ipv4Addr, VtepError> {
    let mut first_error = None;
    for server in servers {
        match route_source_to_one(server).await {
            Ok(ip) => return Ok(ip),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error.unwrap_or_else(|| VtepError::NoIpv4(String::new())))
}

/// Every address the control planes of `servers` (its replicas) resolve to
/// now: the relay endpoint accepts connections from these only. A server
/// that does not resolve is left out (logged at debug; the caller keeps
/// what it had when none resolves).
pub async fn control_plane_addresses(servers: &[String]) -> Vec<IpAddr> {
    let mut found = Vec::new();
    for server in servers {
        let Ok(ep) = Endpoint::parse(server) else {
            continue;
        };
        let resolved = tokio::net::lookup_host((ep.host.as_str(), ep.port)).await;
        match resolved {
            Ok(addrs) => found.extend(addrs.map(|a| a.ip().to_canonical())),
            Err(e) => tracing::debug!(host = %ep.host, error = %e, "cannot resolve a control plane"),
        }
    }
    found.sort();
    found.dedup();
    found
}

/// Found by "connecting" a UDP socket, which only asks the kernel for a route and
/// sends nothing: it works while the control plane is down, and puts no stray
/// connections in the control plane's logs.
async fn route_source_to_one(server: &str) -> Result<Ipv4Addr, VtepError> {
    let ep = Endpoint::parse(server)?;
    let mut addrs = tokio::net::lookup_host((ep.host.as_str(), ep.port))
        .await
        .map_err(|source| VtepError::Resolve {
            host: ep.host.clone(),
            source,
        })?;
    let target = addrs
        .find(|a| a.is_ipv4())
        .ok_or_else(|| VtepError::NoIpv4(ep.host.clone()))?;
    let sock = tokio::net::UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
        .await
        .map_err(VtepError::Socket)?;
    sock.connect(target)
        .await
        .map_err(|source| VtepError::NoRoute { target, source })?;
    match sock.local_addr().map_err(VtepError::LocalAddr)?.ip() {
        IpAddr::V4(ip) => Ok(ip),
        IpAddr::V6(ip) => Err(VtepError::Ipv6(ip)),
    }
}

/// Why there is no underlay for VXLAN this round; every overlay fails with
/// it (and is retried next round).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum UnderlayError {
    /// Nothing to carry: the desired state has no overlay.
    #[error("no overlay on this node")]
    NoOverlay,
    /// Operator or host: no VTEP address yet (no route to the control plane).
    #[error("this node's VTEP address is unknown; pass --vtep")]
    VtepUnknown,
    /// Host: the interfaces cannot be listed. (Shared: each overlay's
    /// plan carries it.)
    #[error("{0}")]
    Links(#[source] Arc<NetError>),
    /// Operator or host: the VTEP address is on no interface here.
    #[error("no interface in the agent's namespace holds the VTEP address {0}")]
    NotFound(Ipv4Addr),
}

/// The interface holding `vtep`: VXLAN packets leave through it.
pub async fn find_underlay(nl: &Netlink, vtep: Ipv4Addr) -> Result<Underlay, UnderlayError> {
    let links = nl
        .links_with_prefix("")
        .await
        .map_err(|e| UnderlayError::Links(Arc::new(e)))?;
    for link in links {
        // A link may vanish between the dump and this lookup; skip it.
        let Ok(addrs) = nl.addresses(&link.name).await else {
            continue;
        };
        if addrs.iter().any(|a| a.ip == vtep) {
            return Ok(Underlay {
                vtep,
                device: link.name,
            });
        }
    }
    Err(UnderlayError::NotFound(vtep))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_namespace_is_the_entry_with_the_same_inode() {
        let dir = std::env::temp_dir().join(format!("otherix-netns-{}", std::process::id()));
        let names = dir.join("netns");
        std::fs::create_dir_all(&names).unwrap();
        let own = dir.join("own");
        std::fs::write(&own, b"").unwrap();
        std::fs::write(names.join("other"), b"").unwrap();
        assert_eq!(own_netns_name_in(&names, &own), None, "no entry is the same file");
        std::fs::hard_link(&own, names.join("mine")).unwrap();
        assert_eq!(own_netns_name_in(&names, &own).as_deref(), Some("mine"));
        assert_eq!(own_netns_name_in(&dir.join("missing"), &own), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn capabilities_are_read_from_the_effective_set() {
        let root = "Name:\tx\nCapInh:\t0000000000000000\nCapEff:\t000001ffffffffff\n";
        assert!(has_caps(root, &[CAP_NET_ADMIN, CAP_SYS_ADMIN]));
        let net_only = "CapEff:\t0000000000001000\n";
        assert!(has_caps(net_only, &[CAP_NET_ADMIN]));
        assert!(!has_caps(net_only, &[CAP_NET_ADMIN, CAP_SYS_ADMIN]));
        assert!(!has_caps("CapEff:\t0000000000000000\n", &[CAP_NET_ADMIN]));
        assert!(!has_caps("", &[CAP_NET_ADMIN]));
    }

    #[tokio::test]
    async fn route_source_to_loopback_is_loopback() {
        let ip = route_source_to(&["https://127.0.0.1:7443".to_string()])
            .await
            .unwrap();
        assert_eq!(ip, Ipv4Addr::LOCALHOST);
    }
}
