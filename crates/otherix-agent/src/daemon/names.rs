//! Names of the kernel objects the agent owns, derived from control-plane ids.
//!
//! Every link the agent creates starts with `ox` and a letter saying what it is, so
//! stale ones are found by prefix after a restart without any state file:
//!
//! | object | name | example |
//! |---|---|---|
//! | overlay bridge | `oxb{vni}` | `oxb100` |
//! | overlay VXLAN device | `oxv{vni}` | `oxv100` |
//! | bridge network | `oxl{network_id[..8]}` | `oxl3fa9c2d1` |
//! | guest's host veth | `oxh{vm_id[..10]}` | `oxh9b1e0c77aa` |
//! | guest namespace | `{netns_prefix}{vm_id[..12]}` | `oxg9b1e0c77aa01` |
//! | bridge network's MAC | `0a:` + `network_id[..10]` | `0a:3f:a9:c2:d1:e4` |
//!
//! All link names fit the kernel's 15 bytes (a VNI has at most 8 digits). Ids are
//! hex from the control plane; truncation keeps 32 to 48 random bits, and the plan
//! refuses the (astronomically rare) guest whose short name collides with another's.

/// Prefix of overlay bridges.
pub const OVERLAY_BRIDGE_PREFIX: &str = "oxb";
/// Prefix of overlay VXLAN devices.
pub const VXLAN_PREFIX: &str = "oxv";
/// Prefix of bridge-network bridges.
pub const BRIDGE_NETWORK_PREFIX: &str = "oxl";
/// Prefix of guests' host-side veths.
pub const HOST_VETH_PREFIX: &str = "oxh";

/// What every prefix of [`LINK_PREFIXES`] starts with (one link dump finds them all).
pub const LINK_PREFIX_COMMON: &str = "ox";

/// Every prefix of links the agent owns: anything with one of these that the desired
/// state does not name is deleted. Each kind has its own, so one kind's keep-list
/// never protects or endangers another's links.
pub const LINK_PREFIXES: [&str; 4] = [
    OVERLAY_BRIDGE_PREFIX,
    VXLAN_PREFIX,
    BRIDGE_NETWORK_PREFIX,
    HOST_VETH_PREFIX,
];

pub fn overlay_bridge(vni: u32) -> String {
    format!("{OVERLAY_BRIDGE_PREFIX}{vni}")
}

pub fn vxlan(vni: u32) -> String {
    format!("{VXLAN_PREFIX}{vni}")
}

pub fn bridge_network(network_id: &str) -> String {
    format!("{BRIDGE_NETWORK_PREFIX}{}", head(network_id, 8))
}

/// The MAC of a bridge network's bridge: the same on every node of the network
/// (an anycast gateway), so a guest migrated to another node of it finds the
/// node-side address at the MAC already in its ARP cache — a fresh MAC there would
/// leave its answers addressed to the old node's bridge until the entry expired.
/// `0a:` and the id's first five bytes: locally administered, unicast, and never a
/// lease's (the CP's start with `02:`). A malformed id is hashed instead.
pub fn bridge_network_mac(network_id: &str) -> [u8; 6] {
    let mut mac = [0x0a, 0, 0, 0, 0, 0];
    let hex = head(network_id, 10);
    let parsed = (hex.len() == 10)
        .then(|| {
            (0..5)
                .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok())
                .collect::<Option<Vec<u8>>>()
        })
        .flatten();
    let bytes = parsed.unwrap_or_else(|| {
        // FNV-1a: any stable spread will do.
        let h = network_id.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        h.to_be_bytes()[..5].to_vec()
    });
    mac[1..].copy_from_slice(&bytes);
    mac
}

pub fn host_veth(vm_id: &str) -> String {
    format!("{HOST_VETH_PREFIX}{}", head(vm_id, 10))
}

pub fn guest_netns(prefix: &str, vm_id: &str) -> String {
    format!("{prefix}{}", head(vm_id, 12))
}

/// The first `n` bytes of `s`, cut back to a character boundary (ids are ASCII hex,
/// but a malformed one must not panic the agent).
fn head(s: &str, n: usize) -> &str {
    let mut end = n.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::validate_ifname;

    const VM: &str = "9b1e0c77aa0122334455667788990011";
    const NET: &str = "3fa9c2d1e4b5a697";

    #[test]
    fn names_follow_the_documented_patterns() {
        assert_eq!(overlay_bridge(100), "oxb100");
        assert_eq!(vxlan(100), "oxv100");
        assert_eq!(bridge_network(NET), "oxl3fa9c2d1");
        assert_eq!(host_veth(VM), "oxh9b1e0c77aa");
        assert_eq!(guest_netns("oxg", VM), "oxg9b1e0c77aa01");
    }

    #[test]
    fn a_bridge_networks_mac_is_the_same_on_every_node_and_never_a_leases() {
        assert_eq!(bridge_network_mac(NET), [0x0a, 0x3f, 0xa9, 0xc2, 0xd1, 0xe4]);
        let odd = bridge_network_mac("not-hex-at-all");
        assert_eq!(odd, bridge_network_mac("not-hex-at-all"));
        assert_eq!(odd[0], 0x0a);
        assert_ne!(odd, bridge_network_mac("not-hex-at-alm"));
        assert_eq!(bridge_network_mac("3f")[0], 0x0a, "short ids too");
    }

    #[test]
    fn link_names_fit_the_kernel_limit_even_for_the_largest_vni() {
        for name in [
            overlay_bridge(0x00ff_ffff),
            vxlan(0x00ff_ffff),
            bridge_network(NET),
            host_veth(VM),
        ] {
            validate_ifname(&name).unwrap_or_else(|e| panic!("{name}: {e}"));
        }
    }

    #[test]
    fn short_and_non_ascii_ids_do_not_panic() {
        assert_eq!(host_veth("ab"), "oxhab");
        assert_eq!(bridge_network("ééééé"), "oxléééé");
    }

    #[test]
    fn every_kind_has_its_own_prefix() {
        assert!(LINK_PREFIXES.iter().all(|p| p.starts_with(LINK_PREFIX_COMMON)));
        // The host rules treat exactly the agent's links as guest-facing, bar the
        // VXLAN devices (ports of their bridges, never an IP interface of their own).
        let guest_facing: Vec<&str> = LINK_PREFIXES.into_iter().filter(|p| *p != VXLAN_PREFIX).collect();
        assert_eq!(guest_facing, crate::filter::GUEST_PREFIXES);
        for (i, a) in LINK_PREFIXES.iter().enumerate() {
            for b in &LINK_PREFIXES[i + 1..] {
                assert!(!a.starts_with(b) && !b.starts_with(a), "{a} vs {b}");
            }
        }
    }
}
