//! Frames for guests that just left this node, sent on towards where they are now.
//!
//! Between a guest's handover and the moment every member of its overlay has
//! repointed its FDB entry, frames for the guest still arrive here, on the
//! overlay's VXLAN device. A `tc` rule on that device's ingress sends each one
//! whose destination is such a guest's MAC back out of the same device; the
//! device's FDB (the control plane's: the guest's MAC at its new host's VTEP) or,
//! before that entry is in, its flood list (which holds the new host, a member)
//! takes it there. Without it they are lost and wait for TCP's retransmission.
//!
//! The rules live in the device's `clsact` qdisc, which this module owns: it is
//! replaced whole when the set of MACs changes and deleted when the set is empty,
//! and it goes with the device when the overlay is left. rtnetlink has no traffic
//! control builder, so this runs `tc` (iproute2), once per change, in the node's
//! namespace — as the packet filter runs `nft`.

use std::collections::BTreeSet;
use std::process::Output;

use super::{fmt_mac, validate_ifname, Netns};

/// Why the forwarding rules of a device were not converged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ForwardError {
    /// This node lacks iproute2's `tc`.
    #[error("tc (iproute2) is not installed: frames for guests that left are not forwarded")]
    NotInstalled,
    #[error("cannot run tc{}: {reason}", in_netns(.netns))]
    Spawn { netns: Option<String>, reason: String },
    #[error("tc refused the rules of {device}: {message}")]
    Refused { device: String, message: String },
    #[error("{0}")]
    Name(String),
}

fn in_netns(netns: &Option<String>) -> String {
    netns
        .as_deref()
        .map(|n| format!(" in namespace {n}"))
        .unwrap_or_default()
}

/// Runs `tc` in one network namespace (the agent's own when `None`).
#[derive(Debug, Clone)]
pub struct Tc {
    netns: Option<String>,
}

impl Tc {
    pub fn new(netns: Option<String>) -> Self {
        Self { netns }
    }

    /// Makes `device`'s ingress forward frames for exactly `macs` back out of
    /// it; with no MACs, takes the rules (and the `clsact` qdisc) away. A
    /// device that does not exist has nothing to take away.
    pub async fn converge(&self, device: &str, macs: &BTreeSet<[u8; 6]>) -> Result<(), ForwardError> {
        validate_ifname(device).map_err(|e| ForwardError::Name(e.to_string()))?;
        let out = self.run(script(device, macs)).await?;
        if out.status.success() {
            return Ok(());
        }
        let message = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if macs.is_empty() && absent(&message) {
            return Ok(());
        }
        Err(ForwardError::Refused {
            device: device.to_string(),
            message: message
                .lines()
                .next()
                .unwrap_or_default()
                .chars()
                .take(300)
                .collect(),
        })
    }

    async fn run(&self, script: String) -> Result<Output, ForwardError> {
        let program = crate::program::find("tc").ok_or(ForwardError::NotInstalled)?;
        let netns = self.netns.clone();
        let spawn_err = |netns: &Option<String>, reason: String| ForwardError::Spawn {
            netns: netns.clone(),
            reason,
        };
        tokio::task::spawn_blocking(move || {
            let run = || crate::program::run(&program, &["-batch".into(), "-".into()], Some(&script));
            let out = match &netns {
                None => run(),
                Some(name) => Netns::open(name)
                    .and_then(|ns| ns.run(run))
                    .map_err(|e| std::io::Error::other(e.to_string()))
                    .and_then(|r| r),
            };
            out.map_err(|e| spawn_err(&netns, e.to_string()))
        })
        .await
        .map_err(|e| spawn_err(&self.netns, e.to_string()))?
    }
}

/// The `tc -batch` script that leaves `device` forwarding exactly `macs`: the
/// qdisc deleted when there are none, else replaced, its ingress filters
/// deleted and one per MAC added (a `u32` match on the destination: `flower`
/// is a module some kernels lack).
pub fn script(device: &str, macs: &BTreeSet<[u8; 6]>) -> String {
    if macs.is_empty() {
        return format!("qdisc del dev {device} clsact\n");
    }
    let mut s = format!("qdisc replace dev {device} clsact\nfilter del dev {device} ingress\n");
    for mac in macs {
        s.push_str(&format!(
            "filter add dev {device} ingress protocol all pref 1 u32 match ether dst {} action mirred egress redirect dev {device}\n",
            fmt_mac(mac)
        ));
    }
    s
}

/// Whether `tc`'s complaint says there was nothing to delete.
fn absent(message: &str) -> bool {
    message.contains("Cannot find specified qdisc")
        || message.contains("Cannot find device")
        || message.contains("Invalid handle")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_macs_deletes_the_qdisc() {
        assert_eq!(
            script("oxv100", &BTreeSet::new()),
            "qdisc del dev oxv100 clsact\n"
        );
    }

    #[test]
    fn each_mac_is_redirected_back_out_of_the_device() {
        let macs = BTreeSet::from([[2, 0, 0, 0, 0, 2], [2, 0, 0, 0, 0, 1]]);
        let s = script("oxv7", &macs);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[0], "qdisc replace dev oxv7 clsact");
        assert_eq!(lines[1], "filter del dev oxv7 ingress");
        assert_eq!(
            lines[2],
            "filter add dev oxv7 ingress protocol all pref 1 u32 match ether dst 02:00:00:00:00:01 action mirred egress redirect dev oxv7"
        );
        assert!(lines[3].contains("02:00:00:00:00:02"));
        assert_eq!(lines.len(), 4);
    }

    #[test]
    fn nothing_to_delete_is_not_an_error() {
        assert!(absent("Error: Cannot find specified qdisc on specified device."));
        assert!(!absent("Error: Specified qdisc kind is unknown."));
    }
}
