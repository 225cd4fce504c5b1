//! IPv4 address management for private networks: subnets and lease allocation.
//!
//! Pure bookkeeping: the caller owns the set of leased addresses (it lives in
//! the store) and asks here which address to hand out next. Within a subnet,
//! the network address and the broadcast address are never leased, and the
//! first usable address is reserved for the node's side of the network.

use std::collections::BTreeSet;
use std::fmt;
use std::net::Ipv4Addr;
use std::ops::RangeInclusive;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Shortest prefix we accept: a /8 already holds 16 million addresses.
pub const MIN_PREFIX: u8 = 8;
/// Longest prefix we accept: a /29 leaves 5 leasable addresses once the
/// network, node and broadcast addresses are set aside; anything smaller is
/// not worth a network.
pub const MAX_PREFIX: u8 = 29;

/// An IPv4 network in CIDR form, e.g. `10.20.0.0/24`.
///
/// Invariant: `prefix` is within `MIN_PREFIX..=MAX_PREFIX` and `network` has
/// no host bits set. Both constructors enforce it, and the arithmetic below
/// relies on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Subnet {
    network: u32,
    prefix: u8,
}

/// A subnet the caller wrote was refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SubnetError {
    /// No `/prefix` part.
    #[error("subnet {input:?} has no prefix length; expected CIDR notation such as 10.20.0.0/24")]
    MissingPrefix {
        /// The refused text.
        input: String,
    },
    /// The part before `/` is not a dotted-quad IPv4 address.
    #[error(
        "invalid network address {address:?} in subnet {input:?}; \
         expected four numbers 0-255 separated by dots, such as 10.20.0.0/24"
    )]
    InvalidAddress {
        /// The refused text.
        input: String,
        /// The part before `/`.
        address: String,
    },
    /// The part after `/` is not a number.
    #[error(
        "invalid prefix length {prefix:?} in subnet {input:?}; \
         expected a number between 8 and 29 after '/'"
    )]
    InvalidPrefix {
        /// The refused text.
        input: String,
        /// The part after `/`.
        prefix: String,
    },
    /// The prefix length is a number, but outside `8..=29`.
    #[error("prefix length /{prefix} is out of range; expected between /8 and /29")]
    PrefixOutOfRange {
        /// The refused prefix length.
        prefix: u32,
    },
    /// The address has bits set below the prefix: it names a host, not a
    /// network.
    #[error("host bits set in {address}/{prefix}; did you mean {network}/{prefix}?")]
    HostBitsSet {
        /// The address as given.
        address: Ipv4Addr,
        /// The prefix length as given.
        prefix: u8,
        /// The network the address belongs to.
        network: Ipv4Addr,
    },
}

/// Allocation failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum IpamError {
    /// Every leasable address is in use; a larger subnet or freeing a lease is
    /// needed.
    #[error("subnet {subnet} is exhausted: all {capacity} addresses are leased")]
    Exhausted {
        /// The full subnet.
        subnet: Subnet,
        /// How many addresses it can lease.
        capacity: u32,
    },
}

impl Subnet {
    /// Builds a subnet from its network address and prefix length, refusing
    /// out-of-range prefixes and addresses with host bits set.
    pub fn new(network: Ipv4Addr, prefix: u8) -> Result<Self, SubnetError> {
        if !(MIN_PREFIX..=MAX_PREFIX).contains(&prefix) {
            return Err(SubnetError::PrefixOutOfRange {
                prefix: u32::from(prefix),
            });
        }
        let addr = u32::from(network);
        let masked = addr & mask(prefix);
        if masked != addr {
            return Err(SubnetError::HostBitsSet {
                address: network,
                prefix,
                network: Ipv4Addr::from(masked),
            });
        }
        Ok(Self {
            network: addr,
            prefix,
        })
    }

    /// The network address (all host bits zero).
    pub fn network(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.network)
    }

    /// The prefix length, between 8 and 29.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The broadcast address (all host bits one).
    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.broadcast_u32())
    }

    /// Whether `ip` is inside this subnet, network and broadcast included.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        u32::from(ip) & mask(self.prefix) == self.network
    }

    /// The node's own address on this network: the first usable address,
    /// never leased to a VM.
    pub fn node_address(&self) -> Ipv4Addr {
        // Cannot overflow: the network address has its low 3+ bits clear.
        Ipv4Addr::from(self.network + 1)
    }

    /// The leasable addresses as numbers: from network+2 to broadcast-1.
    /// Use `u32::from(ip)` to test an address, or [`Subnet::is_leasable`].
    pub fn lease_range(&self) -> RangeInclusive<u32> {
        // Cannot overflow or cross: a /29 or larger spans at least 8 addresses.
        (self.network + 2)..=(self.broadcast_u32() - 1)
    }

    /// Whether `ip` may be leased to a VM.
    pub fn is_leasable(&self, ip: Ipv4Addr) -> bool {
        self.lease_range().contains(&u32::from(ip))
    }

    /// How many addresses can be leased: the subnet size minus the network,
    /// node and broadcast addresses.
    pub fn capacity(&self) -> u32 {
        // 2^(32-prefix) fits in u32 because prefix >= 8, and is at least 8.
        (1u32 << (32 - u32::from(self.prefix))) - 3
    }

    /// Whether the two subnets share any address. CIDR blocks are either
    /// nested or disjoint, so checking each network address suffices.
    pub fn overlaps(&self, other: &Subnet) -> bool {
        self.contains(other.network()) || other.contains(self.network())
    }

    fn broadcast_u32(&self) -> u32 {
        self.network | !mask(self.prefix)
    }
}

/// The netmask for `prefix` (0..=32).
fn mask(prefix: u8) -> u32 {
    // `checked_shl` returns None for a shift of 32 (prefix 0): no mask bits.
    u32::MAX.checked_shl(32 - u32::from(prefix.min(32))).unwrap_or(0)
}

impl fmt::Display for Subnet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix)
    }
}

impl FromStr for Subnet {
    type Err = SubnetError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (address, prefix) = s
            .split_once('/')
            .ok_or_else(|| SubnetError::MissingPrefix { input: s.to_owned() })?;
        let ip: Ipv4Addr = address.parse().map_err(|_| SubnetError::InvalidAddress {
            input: s.to_owned(),
            address: address.to_owned(),
        })?;
        let invalid_prefix = || SubnetError::InvalidPrefix {
            input: s.to_owned(),
            prefix: prefix.to_owned(),
        };
        // Digits only: `u32::from_str` would also take a leading '+'.
        if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid_prefix());
        }
        let number: u32 = prefix.parse().map_err(|_| invalid_prefix())?;
        let prefix = u8::try_from(number)
            .ok()
            .filter(|p| (MIN_PREFIX..=MAX_PREFIX).contains(p))
            .ok_or(SubnetError::PrefixOutOfRange { prefix: number })?;
        Subnet::new(ip, prefix)
    }
}

impl TryFrom<String> for Subnet {
    type Error = SubnetError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Subnet> for String {
    fn from(subnet: Subnet) -> Self {
        subnet.to_string()
    }
}

/// An interface address: an IPv4 address and the prefix length of its
/// network, written `10.100.0.5/24` — what a guest's NIC, an overlay
/// member's bridge or a bridge network's node side carries. Unlike a
/// [`Subnet`], the host bits may be set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Ipv4Cidr {
    addr: Ipv4Addr,
    prefix: u8,
}

/// An interface address that is not `a.b.c.d/n` with `n` at most 32.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("invalid address {input:?}: expected an IPv4 address with a prefix length, like 10.100.0.5/24")]
pub struct CidrError {
    pub input: String,
}

impl Ipv4Cidr {
    /// `addr/prefix`; `None` for a prefix above 32.
    pub fn new(addr: Ipv4Addr, prefix: u8) -> Option<Ipv4Cidr> {
        (prefix <= 32).then_some(Ipv4Cidr { addr, prefix })
    }

    /// `addr` on `subnet`.
    pub fn on(subnet: &Subnet, addr: Ipv4Addr) -> Ipv4Cidr {
        Ipv4Cidr {
            addr,
            prefix: subnet.prefix(),
        }
    }

    pub fn addr(&self) -> Ipv4Addr {
        self.addr
    }

    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// Whether `ip` is on the same network.
    pub fn contains(&self, ip: Ipv4Addr) -> bool {
        let mask = mask(self.prefix);
        u32::from(ip) & mask == u32::from(self.addr) & mask
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || CidrError { input: s.to_owned() };
        let (addr, prefix) = s.split_once('/').ok_or_else(bad)?;
        // Digits only: `u8::from_str` would also take a leading '+'.
        if prefix.is_empty() || prefix.len() > 2 || !prefix.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        Ipv4Cidr::new(addr.parse().map_err(|_| bad())?, prefix).ok_or_else(bad)
    }
}

impl TryFrom<String> for Ipv4Cidr {
    type Error = CidrError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Ipv4Cidr> for String {
    fn from(c: Ipv4Cidr) -> Self {
        c.to_string()
    }
}

/// Picks the lowest leasable address of `subnet` not in `used`.
///
/// Lowest-first makes allocation deterministic and reuses freed addresses
/// before fresh ones. Addresses in `used` outside the lease range (the node
/// address, other subnets) are ignored. Runs in time proportional to the
/// number of used addresses below the first gap, not to the subnet's size.
pub fn allocate(subnet: &Subnet, used: &BTreeSet<Ipv4Addr>) -> Result<Ipv4Addr, IpamError> {
    let range = subnet.lease_range();
    let (first, last) = (*range.start(), *range.end());
    let mut candidate = first;
    // `Ipv4Addr` orders like its `u32` value, so this walks the leased
    // addresses in numeric order; the first one above `candidate` is a gap.
    for &ip in used.range(Ipv4Addr::from(first)..=Ipv4Addr::from(last)) {
        if u32::from(ip) != candidate {
            break;
        }
        // Cannot overflow: candidate <= last < broadcast <= u32::MAX.
        candidate += 1;
    }
    if candidate <= last {
        Ok(Ipv4Addr::from(candidate))
    } else {
        Err(IpamError::Exhausted {
            subnet: *subnet,
            capacity: subnet.capacity(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::btree_set;
    use proptest::prelude::*;
    use serde::de::value::{Error as DeError, StrDeserializer};
    use serde::de::IntoDeserializer;

    fn subnet(s: &str) -> Subnet {
        s.parse().unwrap()
    }

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn cidr_parses_into_network_and_prefix() {
        let s = subnet("10.20.0.0/24");
        assert_eq!(s.network(), ip("10.20.0.0"));
        assert_eq!(s.prefix(), 24);
        assert_eq!(s.broadcast(), ip("10.20.0.255"));
        assert_eq!(s.node_address(), ip("10.20.0.1"));
        assert_eq!(
            s.lease_range(),
            u32::from(ip("10.20.0.2"))..=u32::from(ip("10.20.0.254"))
        );
        assert_eq!(s.capacity(), 253);
        assert_eq!(s.to_string(), "10.20.0.0/24");
    }

    #[test]
    fn smallest_and_largest_subnets_have_the_right_capacity() {
        assert_eq!(subnet("10.0.0.0/29").capacity(), 5);
        assert_eq!(subnet("10.0.0.0/8").capacity(), 16_777_213);
        assert_eq!(subnet("10.0.0.0/8").broadcast(), ip("10.255.255.255"));
    }

    #[test]
    fn host_bits_set_suggests_the_network() {
        let err = "10.20.0.5/24".parse::<Subnet>().unwrap_err();
        assert_eq!(
            err.to_string(),
            "host bits set in 10.20.0.5/24; did you mean 10.20.0.0/24?"
        );
    }

    #[test]
    fn missing_prefix_is_refused() {
        let err = "10.20.0.0".parse::<Subnet>().unwrap_err();
        assert_eq!(
            err,
            SubnetError::MissingPrefix {
                input: "10.20.0.0".into()
            }
        );
        assert_eq!(
            err.to_string(),
            "subnet \"10.20.0.0\" has no prefix length; expected CIDR notation such as 10.20.0.0/24"
        );
    }

    #[test]
    fn malformed_address_is_refused() {
        for input in [
            "10.20.0/24",
            "10.20.0.256/24",
            "/24",
            "ten.0.0.0/24",
            " 10.0.0.0/24",
        ] {
            let err = input.parse::<Subnet>().unwrap_err();
            assert!(
                matches!(err, SubnetError::InvalidAddress { .. }),
                "{input}: {err}"
            );
            assert!(err.to_string().contains("expected four numbers 0-255"), "{err}");
        }
    }

    #[test]
    fn malformed_prefix_is_refused() {
        for input in [
            "10.0.0.0/",
            "10.0.0.0/x",
            "10.0.0.0/+24",
            "10.0.0.0/24/1",
            "10.0.0.0/-8",
        ] {
            let err = input.parse::<Subnet>().unwrap_err();
            assert!(matches!(err, SubnetError::InvalidPrefix { .. }), "{input}: {err}");
        }
        let err = "10.0.0.0/99999999999".parse::<Subnet>().unwrap_err();
        assert!(matches!(err, SubnetError::InvalidPrefix { .. }), "{err}");
        assert!(err.to_string().contains("expected a number between 8 and 29"));
    }

    #[test]
    fn prefix_outside_8_to_29_is_refused() {
        for (input, prefix) in [("10.0.0.0/7", 7), ("10.0.0.0/30", 30), ("0.0.0.0/0", 0)] {
            assert_eq!(
                input.parse::<Subnet>(),
                Err(SubnetError::PrefixOutOfRange { prefix }),
                "{input}"
            );
        }
        assert_eq!(
            SubnetError::PrefixOutOfRange { prefix: 30 }.to_string(),
            "prefix length /30 is out of range; expected between /8 and /29"
        );
        assert_eq!(
            "10.0.0.0/300".parse::<Subnet>(),
            Err(SubnetError::PrefixOutOfRange { prefix: 300 })
        );
    }

    #[test]
    fn prefix_range_is_checked_before_host_bits() {
        assert_eq!(
            "10.0.0.5/30".parse::<Subnet>(),
            Err(SubnetError::PrefixOutOfRange { prefix: 30 })
        );
    }

    #[test]
    fn new_enforces_the_same_rules() {
        assert_eq!(Subnet::new(ip("10.0.0.0"), 16), Ok(subnet("10.0.0.0/16")));
        assert!(matches!(
            Subnet::new(ip("10.0.0.1"), 16),
            Err(SubnetError::HostBitsSet { .. })
        ));
        assert_eq!(
            Subnet::new(ip("10.0.0.0"), 31),
            Err(SubnetError::PrefixOutOfRange { prefix: 31 })
        );
    }

    #[test]
    fn contains_includes_network_and_broadcast_only_inside() {
        let s = subnet("192.168.4.0/22");
        assert!(s.contains(ip("192.168.4.0")));
        assert!(s.contains(ip("192.168.7.255")));
        assert!(!s.contains(ip("192.168.8.0")));
        assert!(!s.contains(ip("192.168.3.255")));
    }

    #[test]
    fn node_network_and_broadcast_are_not_leasable() {
        let s = subnet("10.0.0.0/29");
        assert!(!s.is_leasable(ip("10.0.0.0")));
        assert!(!s.is_leasable(ip("10.0.0.1")));
        assert!(s.is_leasable(ip("10.0.0.2")));
        assert!(s.is_leasable(ip("10.0.0.6")));
        assert!(!s.is_leasable(ip("10.0.0.7")));
    }

    #[test]
    fn nested_and_equal_subnets_overlap() {
        let big = subnet("10.0.0.0/8");
        let small = subnet("10.20.0.0/24");
        assert!(big.overlaps(&small));
        assert!(small.overlaps(&big));
        assert!(small.overlaps(&small));
        assert!(!small.overlaps(&subnet("10.20.1.0/24")));
        assert!(!subnet("10.0.0.0/29").overlaps(&subnet("10.0.0.8/29")));
    }

    #[test]
    fn first_allocation_is_right_after_the_node_address() {
        let s = subnet("10.20.0.0/24");
        assert_eq!(allocate(&s, &BTreeSet::new()), Ok(ip("10.20.0.2")));
    }

    #[test]
    fn allocation_skips_used_addresses() {
        let s = subnet("10.20.0.0/24");
        let used = BTreeSet::from([ip("10.20.0.2"), ip("10.20.0.3"), ip("10.20.0.5")]);
        assert_eq!(allocate(&s, &used), Ok(ip("10.20.0.4")));
    }

    #[test]
    fn freed_address_is_reused_first() {
        let s = subnet("10.20.0.0/24");
        let mut used = BTreeSet::new();
        for _ in 0..10 {
            used.insert(allocate(&s, &used).unwrap());
        }
        used.remove(&ip("10.20.0.7"));
        used.remove(&ip("10.20.0.4"));
        assert_eq!(allocate(&s, &used), Ok(ip("10.20.0.4")));
    }

    #[test]
    fn addresses_outside_the_lease_range_are_ignored() {
        let s = subnet("10.0.0.0/29");
        let used = BTreeSet::from([
            ip("10.0.0.0"),
            ip("10.0.0.1"),
            ip("10.0.0.7"),
            ip("10.0.0.9"),
            ip("9.255.255.255"),
        ]);
        assert_eq!(allocate(&s, &used), Ok(ip("10.0.0.2")));
    }

    #[test]
    fn full_subnet_reports_exhaustion() {
        let s = subnet("10.0.0.0/29");
        let used: BTreeSet<Ipv4Addr> = (2..=6).map(|i| Ipv4Addr::new(10, 0, 0, i)).collect();
        let err = allocate(&s, &used).unwrap_err();
        assert_eq!(
            err,
            IpamError::Exhausted {
                subnet: s,
                capacity: 5
            }
        );
        assert_eq!(
            err.to_string(),
            "subnet 10.0.0.0/29 is exhausted: all 5 addresses are leased"
        );
    }

    #[test]
    fn last_free_address_is_found_at_the_top_of_the_range() {
        let s = subnet("10.0.0.0/29");
        let used: BTreeSet<Ipv4Addr> = (2..=5).map(|i| Ipv4Addr::new(10, 0, 0, i)).collect();
        assert_eq!(allocate(&s, &used), Ok(ip("10.0.0.6")));
    }

    #[test]
    fn allocating_in_a_slash_8_walks_only_the_used_set() {
        let s = subnet("10.0.0.0/8");
        let first = u32::from(ip("10.0.0.2"));
        let used: BTreeSet<Ipv4Addr> = (first..first + 200_000).map(Ipv4Addr::from).collect();
        assert_eq!(allocate(&s, &used), Ok(Ipv4Addr::from(first + 200_000)));
        let far = BTreeSet::from([ip("10.255.255.254")]);
        assert_eq!(allocate(&s, &far), Ok(ip("10.0.0.2")));
    }

    #[test]
    fn subnet_deserializes_from_text_and_reports_errors() {
        let de: StrDeserializer<'_, DeError> = "10.1.0.0/16".into_deserializer();
        assert_eq!(Subnet::deserialize(de), Ok(subnet("10.1.0.0/16")));
        let de: StrDeserializer<'_, DeError> = "10.1.2.0/16".into_deserializer();
        let err = Subnet::deserialize(de).unwrap_err();
        assert!(err.to_string().contains("did you mean 10.1.0.0/16?"), "{err}");
        assert_eq!(String::from(subnet("10.1.0.0/16")), "10.1.0.0/16");
    }

    fn any_subnet(prefixes: RangeInclusive<u8>) -> impl Strategy<Value = Subnet> {
        (any::<u32>(), prefixes).prop_map(|(addr, prefix)| Subnet {
            network: addr & mask(prefix),
            prefix,
        })
    }

    /// Subnets drawn from one /22, so that pairs often overlap.
    fn nearby_subnet() -> impl Strategy<Value = Subnet> {
        (0x0a00_0000u32..0x0a00_0400, 22u8..=29).prop_map(|(addr, prefix)| Subnet {
            network: addr & mask(prefix),
            prefix,
        })
    }

    /// A small subnet plus a used set mixing addresses inside it (including
    /// network, node and broadcast) and outside it.
    fn subnet_and_used() -> impl Strategy<Value = (Subnet, BTreeSet<Ipv4Addr>)> {
        any_subnet(26..=29).prop_flat_map(|s| {
            let lo = s.network;
            let hi = s.broadcast_u32();
            let inside = (lo..=hi).prop_map(Ipv4Addr::from);
            let near = (lo.saturating_sub(4)..=hi.saturating_add(4)).prop_map(Ipv4Addr::from);
            (Just(s), btree_set(prop_oneof![4 => inside, 1 => near], 0..70))
        })
    }

    fn lowest_free_by_brute_force(s: &Subnet, used: &BTreeSet<Ipv4Addr>) -> Option<Ipv4Addr> {
        s.lease_range().map(Ipv4Addr::from).find(|ip| !used.contains(ip))
    }

    proptest! {
        #[test]
        fn repeated_allocation_hands_out_each_free_address_once((s, mut used) in subnet_and_used()) {
            let free_at_start =
                s.lease_range().filter(|&i| !used.contains(&Ipv4Addr::from(i))).count();
            let mut handed_out = 0;
            loop {
                let expected = lowest_free_by_brute_force(&s, &used);
                match allocate(&s, &used) {
                    Ok(ip) => {
                        prop_assert_eq!(Some(ip), expected);
                        prop_assert!(!used.contains(&ip));
                        prop_assert!(s.is_leasable(ip));
                        prop_assert!(s.contains(ip));
                        prop_assert_ne!(ip, s.network());
                        prop_assert_ne!(ip, s.node_address());
                        prop_assert_ne!(ip, s.broadcast());
                        used.insert(ip);
                        handed_out += 1;
                    }
                    Err(err) => {
                        prop_assert_eq!(expected, None);
                        prop_assert!(s.lease_range().all(|i| used.contains(&Ipv4Addr::from(i))));
                        prop_assert_eq!(
                            err,
                            IpamError::Exhausted { subnet: s, capacity: s.capacity() }
                        );
                        break;
                    }
                }
            }
            prop_assert_eq!(handed_out, free_at_start);
        }

        #[test]
        fn freeing_then_allocating_returns_the_lowest_freed(
            (s, freed) in any_subnet(26..=29).prop_flat_map(|s| {
                let range = s.lease_range();
                (Just(s), btree_set(range.prop_map(Ipv4Addr::from), 1..6))
            })
        ) {
            let mut used: BTreeSet<Ipv4Addr> = s.lease_range().map(Ipv4Addr::from).collect();
            prop_assert!(allocate(&s, &used).is_err());
            for ip in &freed {
                used.remove(ip);
            }
            prop_assert_eq!(allocate(&s, &used).ok(), freed.first().copied());
        }

        #[test]
        fn capacity_is_the_lease_range_length(s in any_subnet(8..=29)) {
            let range = s.lease_range();
            prop_assert_eq!(s.capacity(), range.end() - range.start() + 1);
            prop_assert!(s.contains(s.network()) && s.contains(s.broadcast()));
            prop_assert!(!s.is_leasable(s.node_address()));
        }

        #[test]
        fn subnet_display_parses_back(s in any_subnet(8..=29)) {
            prop_assert_eq!(s.to_string().parse::<Subnet>(), Ok(s));
        }

        #[test]
        fn host_bits_suggestion_parses(addr in any::<u32>(), prefix in 8u8..=29) {
            let text = format!("{}/{prefix}", Ipv4Addr::from(addr));
            match text.parse::<Subnet>() {
                Ok(s) => prop_assert_eq!(u32::from(s.network()), addr),
                Err(SubnetError::HostBitsSet { network, .. }) => {
                    let suggested: Subnet = format!("{network}/{prefix}").parse().unwrap();
                    prop_assert!(suggested.contains(Ipv4Addr::from(addr)));
                }
                Err(other) => prop_assert!(false, "unexpected error {other}"),
            }
        }

        #[test]
        fn overlap_is_symmetric_and_matches_shared_addresses(
            a in nearby_subnet(), b in nearby_subnet()
        ) {
            prop_assert_eq!(a.overlaps(&b), b.overlaps(&a));
            let shared = (a.network..=a.broadcast_u32()).any(|i| b.contains(Ipv4Addr::from(i)));
            prop_assert_eq!(a.overlaps(&b), shared);
        }

        #[test]
        fn arbitrary_text_never_panics(s in "[0-9./+ -]{0,20}|.{0,20}") {
            let _ = s.parse::<Subnet>();
        }
    }

    #[test]
    fn interface_addresses_parse_strictly_and_keep_their_host_bits() {
        let c: Ipv4Cidr = "10.100.0.5/24".parse().unwrap();
        assert_eq!((c.addr(), c.prefix()), (Ipv4Addr::new(10, 100, 0, 5), 24));
        assert_eq!(c.to_string(), "10.100.0.5/24");
        assert!(c.contains(Ipv4Addr::new(10, 100, 0, 200)));
        assert!(!c.contains(Ipv4Addr::new(10, 100, 1, 1)));
        assert!("0.0.0.0/0"
            .parse::<Ipv4Cidr>()
            .unwrap()
            .contains(Ipv4Addr::new(1, 2, 3, 4)));
        for bad in [
            "10.100.0.5",
            "10.100.0.5/33",
            "10.100.0.5/+4",
            "10.100.0.5/",
            "x/24",
            "10.100.0.5/024",
            "",
        ] {
            assert!(bad.parse::<Ipv4Cidr>().is_err(), "{bad}");
        }
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(json, "\"10.100.0.5/24\"");
        assert_eq!(serde_json::from_str::<Ipv4Cidr>(&json).unwrap(), c);
    }
}
