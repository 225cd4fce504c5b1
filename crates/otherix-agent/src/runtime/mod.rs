//! Guest runtimes: how a guest (its NIC on a network, its workload) is realized.
//!
//! [`GuestRuntime`] is the trait the agent's sync loop drives; the ingress path never
//! sees which implementation is behind it (DESIGN.md §3). The first implementation,
//! [`NetnsRuntime`], makes a guest a network namespace. A QEMU/KVM runtime (tap
//! devices on the same bridges) can come later behind the same trait.
//!
//! Workloads are supervised separately by [`Supervisor`], a synchronous, clock-free
//! state machine the agent ticks: the runtime builds the guest's network, the
//! supervisor keeps its process running with restart backoff.

mod netns;
pub mod qemu;
mod supervisor;

use std::future::Future;
use std::net::Ipv4Addr;

use crate::net::{validate_ifname, Change, NetError};

pub use netns::{spawn_in_netns, NetnsLauncher, NetnsRuntime, GUEST_IFNAME};
pub use qemu::{QemuConfig, QemuRuntime, QemuSpec};
pub use supervisor::{Backoff, Launcher, Supervisor, SupervisorEvent, Workload, WorkloadState};

/// One guest as the control plane wants it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestSpec {
    /// Stable guest id (the control plane's VM id). Letters, digits, `.`, `_`, `-`.
    pub id: String,
    /// Name of the guest's network namespace; must start with the runtime's prefix.
    pub netns: String,
    /// Name of the host end of the guest's veth, in the node's namespace.
    pub host_veth: String,
    /// Bridge of the guest's network, in the node's namespace.
    pub bridge: String,
    /// The lease MAC, carried by the guest's `eth0`.
    pub mac: [u8; 6],
    /// The lease IP and the network's prefix length.
    pub ip: Ipv4Addr,
    pub prefix: u8,
    /// Default gateway of the guest (an address on the network's bridge).
    pub gateway: Ipv4Addr,
    /// MTU of both veth ends; must match the bridge's (overlay: underlay − 50).
    pub mtu: u32,
    /// The workload to run inside the guest, if any (argv, not a shell line).
    pub command: Option<Vec<String>>,
    /// `Some`: a QEMU guest (a VM on a tap named `host_veth`), not a namespace.
    pub qemu: Option<QemuSpec>,
}

impl GuestSpec {
    /// Checks what can be checked without the kernel.
    pub fn validate(&self) -> Result<(), RuntimeError> {
        let invalid = |reason: String| RuntimeError::InvalidSpec {
            id: self.id.clone(),
            reason,
        };
        validate_id(&self.id)?;
        crate::net::netns::validate_netns_name(&self.netns)?;
        validate_ifname(&self.host_veth)?;
        validate_ifname(&self.bridge)?;
        if self.prefix > 32 {
            return Err(invalid(format!("prefix {} is over 32", self.prefix)));
        }
        if !(68..=65535).contains(&self.mtu) {
            return Err(invalid(format!("MTU {} is outside 68..=65535", self.mtu)));
        }
        // A multicast or all-zeros MAC would be refused by the kernel or break the FDB.
        if self.mac[0] & 1 == 1 || self.mac == [0; 6] {
            return Err(invalid("MAC must be a non-zero unicast address".into()));
        }
        if self.prefix > 0 && self.prefix < 32 {
            let mask = u32::MAX << (32 - u32::from(self.prefix));
            if u32::from(self.ip) & mask != u32::from(self.gateway) & mask {
                return Err(invalid(format!(
                    "gateway {} is outside {}/{}",
                    self.gateway, self.ip, self.prefix
                )));
            }
        }
        if let Some(cmd) = &self.command {
            if cmd.is_empty() || cmd[0].is_empty() {
                return Err(invalid("command is empty".into()));
            }
        }
        Ok(())
    }
}

pub(crate) fn validate_id(id: &str) -> Result<(), RuntimeError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(RuntimeError::InvalidSpec {
            id: id.to_owned(),
            reason: "id must be 1..=128 letters, digits, '.', '_' or '-'".into(),
        })
    }
}

/// A guest found on the node (for re-adoption after an agent restart).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GuestInfo {
    /// `None` if the namespace carries no guest record (a crash mid-creation).
    pub id: Option<String>,
    pub netns: String,
    pub host_veth: Option<String>,
    /// Processes running inside the guest's namespace.
    pub pids: Vec<i32>,
}

impl GuestInfo {
    /// Whether any process (the workload) runs in the guest.
    pub fn is_running(&self) -> bool {
        !self.pids.is_empty()
    }
}

/// An error of a guest runtime.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuntimeError {
    /// Caller error: the spec cannot be realized.
    #[error("guest {id}: invalid spec: {reason}")]
    InvalidSpec { id: String, reason: String },

    /// The guest's NIC is attached somewhere else (its veth peer is not our
    /// `host_veth`), e.g. moved to another node by a migration. We refuse to tear it
    /// away; `move_host_veth` is the way to move it.
    #[error("guest {id}: eth0 in netns {netns} is not paired with {host_veth} here (attached elsewhere?)")]
    AttachedElsewhere {
        id: String,
        netns: String,
        host_veth: String,
    },

    /// A handover's target has no bridge for the guest's network yet (the
    /// target node is still realizing it, or tearing down a stale copy it is
    /// about to build again): nothing was moved.
    #[error("bridge {bridge} is not in netns {netns} yet")]
    TargetBridgeMissing { bridge: String, netns: String },

    /// QEMU could not be started, stopped or listed.
    #[error("guest {id}: {reason}")]
    Qemu { id: String, reason: String },

    /// A netlink or namespace operation failed.
    #[error(transparent)]
    Net(#[from] NetError),
}

/// How the agent realizes guests. Every method is idempotent.
pub trait GuestRuntime: Send + Sync {
    /// Creates or repairs the guest so that it matches `spec`, without disturbing a
    /// healthy guest. Returns the changes made; empty means it was already right.
    fn ensure(&self, spec: &GuestSpec) -> impl Future<Output = Result<Vec<Change>, RuntimeError>> + Send;

    /// Stops the guest's processes and deletes its namespace and NIC. Removing an
    /// unknown guest is not an error (it is already gone).
    fn remove(&self, id: &str) -> impl Future<Output = Result<Vec<Change>, RuntimeError>> + Send;

    /// Guests that exist on this node, whoever created them.
    fn list(&self) -> impl Future<Output = Result<Vec<GuestInfo>, RuntimeError>> + Send;

    /// The guest `id`, if it exists.
    fn state(&self, id: &str) -> impl Future<Output = Result<Option<GuestInfo>, RuntimeError>> + Send {
        async move {
            Ok(self
                .list()
                .await?
                .into_iter()
                .find(|g| g.id.as_deref() == Some(id)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> GuestSpec {
        GuestSpec {
            id: "web01".into(),
            netns: "oxg-web01".into(),
            host_veth: "oxv-web01".into(),
            bridge: "br0".into(),
            mac: [2, 0, 0, 0, 0, 1],
            ip: Ipv4Addr::new(10, 214, 0, 10),
            prefix: 24,
            gateway: Ipv4Addr::new(10, 214, 0, 1),
            mtu: 1450,
            command: None,
            qemu: None,
        }
    }

    #[test]
    fn valid_spec_passes() {
        spec().validate().unwrap();
    }

    #[test]
    fn multicast_mac_long_veth_name_and_bad_id_are_refused() {
        let mut s = spec();
        s.mac = [1, 0, 0, 0, 0, 1];
        assert!(matches!(s.validate(), Err(RuntimeError::InvalidSpec { .. })));
        let mut s = spec();
        s.host_veth = "oxv-a-very-long-name".into();
        assert!(matches!(
            s.validate(),
            Err(RuntimeError::Net(NetError::InvalidName { .. }))
        ));
        let mut s = spec();
        s.id = "web 01".into();
        assert!(matches!(s.validate(), Err(RuntimeError::InvalidSpec { .. })));
        let mut s = spec();
        s.gateway = Ipv4Addr::new(10, 215, 0, 1);
        assert!(matches!(s.validate(), Err(RuntimeError::InvalidSpec { .. })));
        let mut s = spec();
        s.command = Some(vec![]);
        assert!(matches!(s.validate(), Err(RuntimeError::InvalidSpec { .. })));
    }
}
