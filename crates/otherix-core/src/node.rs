//! What a node may be, and checking what it asserts against that (DESIGN §4:
//! a node is what an admin granted, never what it asserts). Pure: the
//! control plane passes in the grant, the heartbeat's claims and the address
//! the heartbeat came from.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use thiserror::Error;

use crate::names::{validate_name, NameError};

/// The relay endpoint's port on a hypervisor's VTEP, unless an admin
/// granted another address.
pub const RELAY_DEFAULT_PORT: u16 = 7444;

/// Names no node may take: they name servers (a certificate or a log line
/// for one of these would read as the CP's or the local host's).
pub const RESERVED_NODE_NAMES: &[&str] = &["localhost", "control-plane", "otherix"];

/// Why a node name was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum NodeNameError {
    #[error("invalid node name: {0}")]
    Invalid(#[from] NameError),
    #[error("node name {0:?} is reserved: it names a server; choose another")]
    Reserved(String),
    #[error("node name {0:?} is all digits, which reads as an address; choose a name with a letter")]
    Numeric(String),
}

/// A DNS label that cannot be mistaken for a server's name or an address.
pub fn validate_node_name(name: &str) -> Result<(), NodeNameError> {
    validate_name(name)?;
    if RESERVED_NODE_NAMES.contains(&name) {
        return Err(NodeNameError::Reserved(name.to_owned()));
    }
    if name.bytes().all(|b| b.is_ascii_digit()) {
        return Err(NodeNameError::Numeric(name.to_owned()));
    }
    Ok(())
}

/// Why an address given for a role was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum AddressError {
    #[error("invalid {what} {value:?}: expected IP:PORT with a port above 0")]
    Endpoint { what: &'static str, value: String },
    #[error("invalid {what} {value:?}: expected IP:PORT, `off` or `auto`")]
    Relay { what: &'static str, value: String },
    #[error("invalid {what} {value:?}: expected an IPv4 address")]
    Vtep { what: &'static str, value: String },
    #[error("{what} {value:?} is not an address a node can serve on (unspecified or multicast)")]
    Unusable { what: &'static str, value: String },
}

/// An advertised `IP:PORT` (a gateway or relay endpoint).
pub fn parse_endpoint(what: &'static str, value: &str) -> Result<SocketAddr, AddressError> {
    let addr: SocketAddr = value
        .parse()
        .ok()
        .filter(|a: &SocketAddr| a.port() != 0)
        .ok_or_else(|| AddressError::Endpoint {
            what,
            value: value.to_owned(),
        })?;
    if addr.ip().is_unspecified() || addr.ip().is_multicast() {
        return Err(AddressError::Unusable {
            what,
            value: value.to_owned(),
        });
    }
    Ok(addr)
}

/// A relay grant as stored: `None` (the default), `off`, or `IP:PORT`.
/// `auto` reads as the default.
pub fn parse_relay(what: &'static str, value: &str) -> Result<Option<String>, AddressError> {
    match value {
        "auto" => Ok(None),
        "off" => Ok(Some("off".into())),
        v => parse_endpoint(what, v)
            .map(|a| Some(a.to_string()))
            .map_err(|_| AddressError::Relay {
                what,
                value: value.to_owned(),
            }),
    }
}

/// An admin-set VTEP.
pub fn parse_vtep(what: &'static str, value: &str) -> Result<Ipv4Addr, AddressError> {
    let ip: Ipv4Addr = value.parse().map_err(|_| AddressError::Vtep {
        what,
        value: value.to_owned(),
    })?;
    if ip.is_unspecified() || ip.is_multicast() || ip.is_broadcast() {
        return Err(AddressError::Unusable {
            what,
            value: value.to_owned(),
        });
    }
    Ok(ip)
}

/// Roles as granted or as claimed: hosts guests, gateway endpoint, relay
/// endpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Roles {
    pub hypervisor: bool,
    pub gateway: Option<SocketAddr>,
    pub relay: Option<SocketAddr>,
}

/// Why a heartbeat's assertions were refused. The node is at fault: its
/// configuration says something its grant does not.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum Mismatch {
    #[error(
        "node {node} asserts roles ({claimed}) that differ from its grant ({granted}); \
         change the grant with `otherix node update {node}` or restart the agent without the role flags"
    )]
    Roles {
        node: String,
        claimed: String,
        granted: String,
    },
    #[error(
        "node {node} reports VTEP {reported}, but its connection comes from {from}; behind NAT an admin \
         sets it: otherix node update {node} --vtep {reported}"
    )]
    VtepNotSource {
        node: String,
        reported: String,
        from: String,
    },
    #[error("node {node} reports VTEP {reported}, but it was granted {granted}; fix the agent's --vtep or the grant")]
    VtepNotGranted {
        node: String,
        reported: String,
        granted: Ipv4Addr,
    },
}

impl Mismatch {
    /// Stable code for the refusal.
    pub fn code(&self) -> &'static str {
        match self {
            Mismatch::Roles { .. } => "roles_mismatch",
            Mismatch::VtepNotSource { .. } | Mismatch::VtepNotGranted { .. } => "vtep_mismatch",
        }
    }
}

fn describe(r: &Roles) -> String {
    let mut parts = Vec::new();
    if r.hypervisor {
        parts.push("hypervisor".to_string());
    }
    if let Some(g) = r.gateway {
        parts.push(format!("gateway {g}"));
    }
    if let Some(rl) = r.relay {
        parts.push(format!("relay {rl}"));
    }
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// Checks roles an agent was pinned to against its grant. The hypervisor
/// role and the gateway endpoint must be exactly the grant; a claimed relay
/// endpoint must be the granted one (the agent need not claim one).
pub fn check_claims(node: &str, granted: &Roles, claimed: &Roles) -> Result<(), Mismatch> {
    let relay_ok = claimed.relay.is_none() || claimed.relay == granted.relay;
    if claimed.hypervisor == granted.hypervisor && claimed.gateway == granted.gateway && relay_ok {
        return Ok(());
    }
    Err(Mismatch::Roles {
        node: node.to_owned(),
        claimed: describe(claimed),
        granted: describe(granted),
    })
}

/// The VTEP in force for a heartbeat that reports `reported` and comes from
/// `from`: the admin's, else the source address — never an address only
/// the node asserts.
pub fn effective_vtep(
    node: &str,
    reported: &str,
    granted: Option<Ipv4Addr>,
    from: IpAddr,
) -> Result<Ipv4Addr, Mismatch> {
    let reported_ip = reported.parse::<Ipv4Addr>().ok();
    match granted {
        Some(g) if reported_ip == Some(g) => Ok(g),
        Some(g) => Err(Mismatch::VtepNotGranted {
            node: node.to_owned(),
            reported: reported.to_owned(),
            granted: g,
        }),
        None => {
            let from_v4 = match from {
                IpAddr::V4(ip) => Some(ip),
                IpAddr::V6(ip) => ip.to_ipv4_mapped(),
            };
            match (from_v4, reported_ip) {
                // Behind a proxy on the CP's host every node would come from
                // there: such a source is no VTEP, an admin sets one.
                (Some(f), _) if f.is_loopback() || f.is_unspecified() || f.is_link_local() => {
                    Err(Mismatch::VtepNotSource {
                        node: node.to_owned(),
                        reported: reported.to_owned(),
                        from: format!("{from} (loopback or link-local: no VTEP)"),
                    })
                }
                (Some(f), Some(r)) if f == r => Ok(f),
                _ => Err(Mismatch::VtepNotSource {
                    node: node.to_owned(),
                    reported: reported.to_owned(),
                    from: from.to_string(),
                }),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(hypervisor: bool, gateway: Option<&str>, relay: Option<&str>) -> Roles {
        Roles {
            hypervisor,
            gateway: gateway.map(|g| g.parse().unwrap()),
            relay: relay.map(|r| r.parse().unwrap()),
        }
    }

    #[test]
    fn server_names_and_numbers_are_no_node_names() {
        for bad in ["localhost", "control-plane", "otherix", "127", "10"] {
            assert!(validate_node_name(bad).is_err(), "{bad}");
        }
        for good in ["node1", "gw-1", "1node"] {
            validate_node_name(good).unwrap();
        }
        assert!(
            validate_node_name("node1.example").is_err(),
            "a dot would leave the label namespace"
        );
    }

    #[test]
    fn claimed_roles_must_be_the_grant() {
        let granted = roles(true, None, Some("10.0.0.2:7444"));
        check_claims("n", &granted, &roles(true, None, None)).unwrap();
        check_claims("n", &granted, &roles(true, None, Some("10.0.0.2:7444"))).unwrap();
        let err = check_claims("n", &granted, &roles(true, Some("10.0.0.2:8443"), None)).unwrap_err();
        assert_eq!(err.code(), "roles_mismatch");
        assert!(err.to_string().contains("gateway 10.0.0.2:8443"), "{err}");
        assert!(check_claims("n", &granted, &roles(false, None, None)).is_err());
        assert!(check_claims("n", &granted, &roles(true, None, Some("10.0.0.3:7444"))).is_err());
    }

    #[test]
    fn the_vtep_is_the_source_address_unless_an_admin_set_one() {
        let from: IpAddr = "10.0.0.7".parse().unwrap();
        assert_eq!(
            effective_vtep("n", "10.0.0.7", None, from).unwrap(),
            Ipv4Addr::new(10, 0, 0, 7)
        );
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        assert_eq!(
            effective_vtep("n", "10.0.0.7", None, mapped).unwrap(),
            Ipv4Addr::new(10, 0, 0, 7)
        );
        let err = effective_vtep("n", "10.9.9.9", None, from).unwrap_err();
        assert_eq!(err.code(), "vtep_mismatch");
        assert!(err.to_string().contains("--vtep 10.9.9.9"), "{err}");
        let natted = Some(Ipv4Addr::new(192, 0, 2, 1));
        assert_eq!(
            effective_vtep("n", "192.0.2.1", natted, from).unwrap(),
            Ipv4Addr::new(192, 0, 2, 1)
        );
        assert!(effective_vtep("n", "10.0.0.7", natted, from).is_err());
        assert!(effective_vtep("n", "not-an-ip", None, from).is_err());
    }

    #[test]
    fn role_addresses_parse_strictly() {
        assert!(parse_endpoint("gateway", "10.0.0.1:8443").is_ok());
        for bad in ["10.0.0.1", "10.0.0.1:0", "gw:8443", "0.0.0.0:8443", "224.0.0.1:1"] {
            assert!(parse_endpoint("gateway", bad).is_err(), "{bad}");
        }
        assert_eq!(parse_relay("relay", "auto").unwrap(), None);
        assert_eq!(parse_relay("relay", "off").unwrap().as_deref(), Some("off"));
        assert_eq!(
            parse_relay("relay", "10.0.0.1:7444").unwrap().as_deref(),
            Some("10.0.0.1:7444")
        );
        assert!(parse_relay("relay", "on").is_err());
        assert!(parse_vtep("vtep", "0.0.0.0").is_err());
        assert!(parse_vtep("vtep", "10.0.0.1").is_ok());
    }
}
