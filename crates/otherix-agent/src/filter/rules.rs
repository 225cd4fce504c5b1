//! The host rules as nftables text: the pure half of the filter.
//!
//! [`HostRules`] is what a desired state asks of the node's packet filter (which
//! VTEPs may send VXLAN, which bridges are guest-facing and the node's address on
//! each); [`HostRules::render`] turns it into the one `nft -f` script that replaces
//! the agent's table atomically. The script's first line after the table header is a
//! comment holding a digest of the script, so a restarted agent recognizes the table
//! it installed before and leaves it (and its counters) alone.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::Ipv4Addr;

/// The family and name of the agent's table (one per network namespace).
pub const TABLE: &str = "inet otherix";
/// The table's name in its family (`inet`).
pub const TABLE_NAME: &str = "otherix";

/// Prefixes of the agent's guest-facing interfaces: overlay bridges, bridge
/// networks' bridges, guests' host veths (bridge ports, but a veth not yet
/// enslaved would take IP traffic itself). Matched by prefix (`"oxb*"`), so a
/// device is covered from the moment it exists, desired or stale.
pub const GUEST_PREFIXES: [&str; 3] = ["oxb", "oxl", "oxh"];

/// Marks the digest in the table's comment.
const DIGEST_MARK: &str = "otherix host rules ";

/// What the node's packet filter enforces.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostRules {
    /// The UDP port VXLAN arrives on.
    pub vxlan_port: u16,
    /// The only sources VXLAN is accepted from: the cluster's VTEPs that share an
    /// overlay with this node (the VTEPs of its overlays' FDB entries).
    pub vteps: BTreeSet<Ipv4Addr>,
    /// This node's guest-facing bridges (overlay and bridge networks), each with
    /// this node's own address on it, if it has one. Traffic routed from one of
    /// them back into the same one is a network's own; between two, it is not.
    pub bridges: BTreeMap<String, Option<Ipv4Addr>>,
}

/// The packet counters of the agent's table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// VXLAN packets from a source that is no VTEP of this node's overlays.
    pub vxlan_dropped: u64,
    /// Packets from guests to the node's own addresses (its services).
    pub guest_to_node_dropped: u64,
    /// Packets from guests routed towards another network's guests.
    pub guest_between_networks_dropped: u64,
}

impl Counters {
    /// Counter names in the table, in field order.
    pub const NAMES: [&'static str; 3] = [
        "vxlan_dropped",
        "guest_to_node_dropped",
        "guest_between_networks_dropped",
    ];

    pub(crate) fn get_mut(&mut self, name: &str) -> Option<&mut u64> {
        match name {
            "vxlan_dropped" => Some(&mut self.vxlan_dropped),
            "guest_to_node_dropped" => Some(&mut self.guest_to_node_dropped),
            "guest_between_networks_dropped" => Some(&mut self.guest_between_networks_dropped),
            _ => None,
        }
    }

    /// Field-wise sum (saturating: these only grow).
    pub fn plus(self, other: Counters) -> Counters {
        Counters {
            vxlan_dropped: self.vxlan_dropped.saturating_add(other.vxlan_dropped),
            guest_to_node_dropped: self
                .guest_to_node_dropped
                .saturating_add(other.guest_to_node_dropped),
            guest_between_networks_dropped: self
                .guest_between_networks_dropped
                .saturating_add(other.guest_between_networks_dropped),
        }
    }

    /// Field-wise growth from `before` (zero where a counter went back, as one
    /// does when the table is replaced).
    pub fn since(self, before: Counters) -> Counters {
        Counters {
            vxlan_dropped: self.vxlan_dropped.saturating_sub(before.vxlan_dropped),
            guest_to_node_dropped: self
                .guest_to_node_dropped
                .saturating_sub(before.guest_to_node_dropped),
            guest_between_networks_dropped: self
                .guest_between_networks_dropped
                .saturating_sub(before.guest_between_networks_dropped),
        }
    }
}

/// A rendered ruleset: the script and its digest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rendered {
    pub script: String,
    /// A digest of the script (before the comment that carries it was added).
    pub digest: u64,
    /// Bridge names left out of the allow-lists because they are no safe nft
    /// string (the prefix rules still drop their traffic: leaving one out only
    /// makes the filter stricter).
    pub unsafe_names: Vec<String>,
}

impl HostRules {
    /// The `nft -f` script that replaces the agent's table with these rules, in
    /// one transaction: create it if absent (so the delete cannot fail), delete it,
    /// define it anew. Deterministic: the same rules give the same bytes.
    pub fn render(&self) -> Rendered {
        let mut unsafe_names = Vec::new();
        let mut bridges = Vec::new();
        for (name, addr) in &self.bridges {
            if safe_ifname(name) {
                bridges.push((name.as_str(), *addr));
            } else {
                unsafe_names.push(name.clone());
            }
        }
        let mut body = String::new();
        // Writing to a String cannot fail.
        let w = &mut body;
        let _ = writeln!(w, "\tset vteps {{\n\t\ttype ipv4_addr");
        elements(w, self.vteps.iter().map(|ip| ip.to_string()));
        let _ = writeln!(w, "\t}}");
        let _ = writeln!(w, "\tset routed_within {{\n\t\ttype ifname . ifname");
        elements(w, bridges.iter().map(|(b, _)| format!("\"{b}\" . \"{b}\"")));
        let _ = writeln!(w, "\t}}");
        let _ = writeln!(w, "\tset node_addresses {{\n\t\ttype ifname . ipv4_addr");
        elements(
            w,
            bridges
                .iter()
                .filter_map(|(b, addr)| addr.map(|a| format!("\"{b}\" . {a}"))),
        );
        let _ = writeln!(w, "\t}}");
        for name in Counters::NAMES {
            let _ = writeln!(w, "\tcounter {name} {{}}");
        }
        // Input: what reaches the node's own addresses. Guests first, so no
        // accept below (VXLAN from a VTEP's address) can be earned by a guest
        // forging that address.
        let _ = writeln!(
            w,
            "\tchain input {{\n\t\ttype filter hook input priority filter; policy accept;"
        );
        for p in GUEST_PREFIXES {
            let _ = writeln!(w, "\t\tiifname \"{p}*\" jump from_guest");
        }
        let port = self.vxlan_port;
        let _ = writeln!(w, "\t\tudp dport {port} ip saddr @vteps accept");
        let _ = writeln!(w, "\t\tudp dport {port} counter name \"vxlan_dropped\" drop");
        let _ = writeln!(w, "\t}}");
        // A guest reaches the node only in answer to what the node opened (the
        // gateway's and relay's dials, health probes), pings the node's address
        // on its own network, and resolves IPv6 neighbors; ARP is below this hook.
        let _ = writeln!(w, "\tchain from_guest {{");
        let _ = writeln!(w, "\t\tct state established,related accept");
        let _ = writeln!(
            w,
            "\t\ticmp type echo-request iifname . ip daddr @node_addresses accept"
        );
        let _ = writeln!(
            w,
            "\t\ticmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept"
        );
        let _ = writeln!(w, "\t\tcounter name \"guest_to_node_dropped\" drop");
        let _ = writeln!(w, "\t}}");
        // Forward: what the node would route. Out of a guest-facing device into
        // another one is between networks (bridged traffic, when bridge netfilter
        // shows it here at all, goes in and out of the same bridge).
        let _ = writeln!(
            w,
            "\tchain forward {{\n\t\ttype filter hook forward priority filter; policy accept;"
        );
        for p in GUEST_PREFIXES {
            let _ = writeln!(w, "\t\tiifname \"{p}*\" jump from_guest_routed");
        }
        let _ = writeln!(w, "\t}}");
        let _ = writeln!(w, "\tchain from_guest_routed {{");
        let _ = writeln!(w, "\t\tiifname . oifname @routed_within accept");
        for p in GUEST_PREFIXES {
            let _ = writeln!(
                w,
                "\t\toifname \"{p}*\" counter name \"guest_between_networks_dropped\" drop"
            );
        }
        let _ = writeln!(w, "\t}}");

        let digest = fnv1a(body.as_bytes());
        let script = format!(
            "table {TABLE} {{}}\ndelete table {TABLE}\ntable {TABLE} {{\n\tcomment \"{DIGEST_MARK}{digest:016x}\"\n{body}}}\n"
        );
        Rendered {
            script,
            digest,
            unsafe_names,
        }
    }
}

/// The `nft -f` script that removes the agent's table, whether or not it exists.
pub fn removal_script() -> String {
    format!("table {TABLE} {{}}\ndelete table {TABLE}\n")
}

/// The digest in the comment of a listed table (`nft list table`), if it carries
/// one of ours.
pub fn listed_digest(listing: &str) -> Option<u64> {
    listing
        .lines()
        .take(4)
        .find_map(|l| l.trim().strip_prefix("comment \"")?.strip_prefix(DIGEST_MARK))
        .and_then(|rest| rest.strip_suffix('"'))
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
}

/// The agent's counters from `nft -j list counters table inet otherix`, as an
/// operator reads them (the agent itself reads them over netlink; the tests
/// hold the two to the same figures). Unknown counters are ignored; a
/// malformed document is an error.
pub fn parse_counters(json: &str) -> Result<Counters, String> {
    let doc: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    let items = doc
        .get("nftables")
        .and_then(|v| v.as_array())
        .ok_or("no \"nftables\" array")?;
    let mut out = Counters::default();
    for c in items.iter().filter_map(|i| i.get("counter")) {
        let name = c.get("name").and_then(|n| n.as_str()).unwrap_or_default();
        let packets = c.get("packets").and_then(|p| p.as_u64());
        if let (Some(slot), Some(packets)) = (out.get_mut(name), packets) {
            *slot = packets;
        }
    }
    Ok(out)
}

/// Whether `name` can be put between double quotes in an nft script as is: an
/// interface name of letters, digits, `-`, `_` and `.` (the agent's own names
/// always are; a control-plane id that is not would otherwise inject syntax).
pub fn safe_ifname(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= crate::net::IFNAME_MAX
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// `elements = { a, b }`, or nothing for an empty set (nft refuses `{ }`).
fn elements(w: &mut String, items: impl Iterator<Item = String>) {
    let items: Vec<String> = items.collect();
    if !items.is_empty() {
        let _ = writeln!(w, "\t\telements = {{ {} }}", items.join(", "));
    }
}

/// FNV-1a, 64 bits: a stable digest (the text is ours, not an adversary's).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules() -> HostRules {
        HostRules {
            vxlan_port: 4789,
            vteps: [Ipv4Addr::new(10, 213, 0, 3), Ipv4Addr::new(10, 213, 0, 2)].into(),
            bridges: [
                ("oxb100".to_owned(), Some(Ipv4Addr::new(10, 100, 0, 4))),
                ("oxl0badc0ff".to_owned(), Some(Ipv4Addr::new(10, 101, 0, 1))),
            ]
            .into(),
        }
    }

    #[test]
    fn vxlan_is_accepted_from_the_vteps_only_and_the_rest_counted_and_dropped() {
        let s = rules().render().script;
        assert!(s.contains("elements = { 10.213.0.2, 10.213.0.3 }"), "{s}");
        let accept = s.find("udp dport 4789 ip saddr @vteps accept").unwrap();
        let drop = s
            .find("udp dport 4789 counter name \"vxlan_dropped\" drop")
            .unwrap();
        assert!(accept < drop, "{s}");
    }

    #[test]
    fn guests_are_judged_before_any_accept_a_forged_source_could_earn() {
        let s = rules().render().script;
        let guests = s.find("iifname \"oxb*\" jump from_guest").unwrap();
        assert!(guests < s.find("@vteps accept").unwrap(), "{s}");
        for p in GUEST_PREFIXES {
            assert!(s.contains(&format!("iifname \"{p}*\" jump from_guest\n")), "{s}");
            assert!(
                s.contains(&format!("iifname \"{p}*\" jump from_guest_routed\n")),
                "{s}"
            );
        }
    }

    #[test]
    fn only_a_networks_own_bridge_routes_back_into_it_and_only_its_address_answers_pings() {
        let s = rules().render().script;
        assert!(
            s.contains("elements = { \"oxb100\" . \"oxb100\", \"oxl0badc0ff\" . \"oxl0badc0ff\" }"),
            "{s}"
        );
        assert!(
            s.contains("elements = { \"oxb100\" . 10.100.0.4, \"oxl0badc0ff\" . 10.101.0.1 }"),
            "{s}"
        );
    }

    #[test]
    fn the_script_replaces_the_table_in_one_go_and_carries_its_digest() {
        let r = rules().render();
        assert!(
            r.script
                .starts_with("table inet otherix {}\ndelete table inet otherix\ntable inet otherix {\n"),
            "{}",
            r.script
        );
        // What `nft list table` prints back starts the same way.
        let listed = format!(
            "table inet otherix {{\n\tcomment \"otherix host rules {:016x}\"\n\tset vteps {{",
            r.digest
        );
        assert_eq!(listed_digest(&listed), Some(r.digest));
        assert_eq!(listed_digest("table inet otherix {\n\tset vteps {"), None);
        assert_eq!(
            listed_digest("table inet otherix {\n\tcomment \"someone else\"\n"),
            None
        );
    }

    #[test]
    fn same_rules_same_bytes_other_rules_other_digest() {
        assert_eq!(rules().render(), rules().render());
        let mut other = rules();
        other.vteps.insert(Ipv4Addr::new(10, 213, 0, 9));
        assert_ne!(other.render().digest, rules().render().digest);
    }

    #[test]
    fn empty_sets_carry_no_elements_line() {
        let s = HostRules {
            vxlan_port: 4789,
            ..Default::default()
        }
        .render()
        .script;
        assert!(!s.contains("elements"), "{s}");
        assert!(s.contains("set vteps {\n\t\ttype ipv4_addr\n\t}"), "{s}");
    }

    #[test]
    fn a_name_that_is_no_safe_nft_string_is_left_out_not_injected() {
        let mut r = rules();
        r.bridges.insert("oxl\"; flush".into(), None);
        r.bridges
            .insert("oxl{x}".into(), Some(Ipv4Addr::new(10, 9, 9, 1)));
        let out = r.render();
        assert_eq!(out.unsafe_names, ["oxl\"; flush", "oxl{x}"]);
        assert!(
            !out.script.contains("flush") && !out.script.contains("{x}"),
            "{}",
            out.script
        );
        assert_eq!(out.script, rules().render().script);
    }

    #[test]
    fn counters_are_read_by_name_from_nfts_json() {
        let json = r#"{"nftables": [{"metainfo": {"version": "1.0.6", "json_schema_version": 1}},
            {"counter": {"family": "inet", "name": "vxlan_dropped", "table": "otherix", "handle": 5, "packets": 7, "bytes": 700}},
            {"counter": {"family": "inet", "name": "guest_to_node_dropped", "table": "otherix", "handle": 6, "packets": 2, "bytes": 120}},
            {"counter": {"family": "inet", "name": "someone_elses", "table": "otherix", "handle": 8, "packets": 9, "bytes": 1}}]}"#;
        assert_eq!(
            parse_counters(json).unwrap(),
            Counters {
                vxlan_dropped: 7,
                guest_to_node_dropped: 2,
                guest_between_networks_dropped: 0
            }
        );
        assert!(parse_counters("nope").is_err());
        assert!(parse_counters("{}").is_err());
    }

    #[test]
    fn counters_add_up_across_a_reset() {
        let before = Counters {
            vxlan_dropped: 5,
            ..Default::default()
        };
        let after_reset = Counters {
            vxlan_dropped: 2,
            guest_to_node_dropped: 1,
            ..Default::default()
        };
        assert_eq!(after_reset.since(before).vxlan_dropped, 0);
        assert_eq!(before.plus(after_reset).vxlan_dropped, 7);
    }
}
