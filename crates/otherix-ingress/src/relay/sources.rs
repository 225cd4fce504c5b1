//! Who may open a connection to the relay endpoint at all: the control
//! plane's replicas. Checked on the source address right after the TCP
//! accept, before a slot or a TLS handshake is spent on the connection; the
//! TLS client check (`verifier`) still follows for those let through.
//!
//! The agent knows the replicas by the addresses of its configured control
//! planes (`--server`, resolved), and the operator may add networks
//! (`--relay-allow-from`) for a control plane whose dials leave from another
//! address (NAT, a second interface).

use std::collections::BTreeSet;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An address, or a network (`IP/PREFIX`), connections may come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SourceNet {
    /// The network's address, host bits zero.
    network: IpAddr,
    prefix: u8,
}

/// A `--relay-allow-from` entry is neither an address nor `IP/PREFIX` with
/// no host bits set (the operator's fault).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid source network {input:?}: {reason}")]
pub struct SourceNetError {
    input: String,
    reason: &'static str,
}

impl SourceNet {
    /// Exactly the address `ip`.
    pub fn host(ip: IpAddr) -> SourceNet {
        let ip = ip.to_canonical();
        SourceNet {
            network: ip,
            prefix: max_prefix(ip),
        }
    }

    /// Whether `ip` is in this network (IPv4-mapped IPv6 addresses count as
    /// the IPv4 address they carry).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_ipv4() == self.network.is_ipv4() && masked(ip, self.prefix) == self.network
    }
}

/// `ip` with every bit past the first `prefix` zero.
fn masked(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((u32::from(v4) & mask).into())
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((u128::from(v6) & mask).into())
        }
    }
}

fn max_prefix(ip: IpAddr) -> u8 {
    if ip.is_ipv4() {
        32
    } else {
        128
    }
}

impl FromStr for SourceNet {
    type Err = SourceNetError;

    /// `IP` or `IP/PREFIX` (IPv4 or IPv6), no host bits set.
    fn from_str(s: &str) -> Result<SourceNet, SourceNetError> {
        let bad = |reason| SourceNetError {
            input: s.to_owned(),
            reason,
        };
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let ip: IpAddr = addr.parse().map_err(|_| bad("not an IP address"))?;
        let ip = ip.to_canonical();
        let Some(prefix) = prefix else {
            return Ok(SourceNet::host(ip));
        };
        if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) || prefix.len() > 3 {
            return Err(bad("the prefix is not a number"));
        }
        let prefix: u8 = prefix.parse().map_err(|_| bad("the prefix is not a number"))?;
        if prefix > max_prefix(ip) {
            return Err(bad("the prefix is longer than the address"));
        }
        // Its own address must be its network's: `10.0.0.1/8` is a typo
        // that would let in far more than meant.
        if masked(ip, prefix) != ip {
            return Err(bad("host bits are set"));
        }
        Ok(SourceNet { network: ip, prefix })
    }
}

impl fmt::Display for SourceNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.prefix == max_prefix(self.network) {
            write!(f, "{}", self.network)
        } else {
            write!(f, "{}/{}", self.network, self.prefix)
        }
    }
}

/// The sources the relay endpoint accepts connections from. Empty: none
/// (the agent has not resolved any control plane yet) — closed, not open.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ControlPlanes(BTreeSet<SourceNet>);

impl ControlPlanes {
    /// The control planes at `addrs`, and whatever `extra` networks the
    /// operator allows.
    pub fn new(addrs: impl IntoIterator<Item = IpAddr>, extra: &[SourceNet]) -> ControlPlanes {
        ControlPlanes(
            addrs
                .into_iter()
                .map(SourceNet::host)
                .chain(extra.iter().copied())
                .collect(),
        )
    }

    /// Whether a connection from `ip` may go on to its TLS handshake.
    pub fn allows(&self, ip: IpAddr) -> bool {
        self.0.iter().any(|n| n.contains(ip))
    }

    /// How many addresses and networks are allowed.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for ControlPlanes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, n) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{n}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn only_the_control_planes_and_the_allowed_networks_get_through() {
        let extra = ["192.0.2.0/24".parse().unwrap(), "2001:db8::/32".parse().unwrap()];
        let cps = ControlPlanes::new([ip("10.0.0.1"), ip("10.0.0.2")], &extra);
        for yes in [
            "10.0.0.1",
            "10.0.0.2",
            "::ffff:10.0.0.1",
            "192.0.2.77",
            "2001:db8::9",
        ] {
            assert!(cps.allows(ip(yes)), "{yes}");
        }
        for no in ["10.0.0.3", "127.0.0.1", "192.0.3.1", "2001:db9::1", "::1"] {
            assert!(!cps.allows(ip(no)), "{no}");
        }
        assert_eq!(cps.to_string(), "10.0.0.1, 10.0.0.2, 192.0.2.0/24, 2001:db8::/32");
    }

    #[test]
    fn no_control_plane_known_lets_nobody_in() {
        let cps = ControlPlanes::default();
        assert!(cps.is_empty());
        assert!(!cps.allows(ip("10.0.0.1")));
    }

    #[test]
    fn source_networks_parse_strictly() {
        assert_eq!("10.1.2.3".parse::<SourceNet>().unwrap().to_string(), "10.1.2.3");
        assert_eq!(
            "10.0.0.0/8".parse::<SourceNet>().unwrap().to_string(),
            "10.0.0.0/8"
        );
        assert!("0.0.0.0/0".parse::<SourceNet>().unwrap().contains(ip("8.8.8.8")));
        for bad in [
            "",
            "10.0.0.1/8",
            "10.0.0.0/33",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "host",
            "10.0.0.0/0008",
        ] {
            assert!(bad.parse::<SourceNet>().is_err(), "{bad:?}");
        }
    }
}
