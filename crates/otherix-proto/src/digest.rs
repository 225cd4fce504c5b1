//! The hashes both ends compute of a desired state: the control plane's
//! version of a node's state, and the digest an agent checks the state it
//! holds against.
//!
//! A node's state is its own part (everything but the overlays' entries)
//! and, per overlay, the FDB and neighbor entries it installs. Each is
//! hashed so that a part kept up to date piece by piece keeps its hash with
//! an addition and a subtraction: the own part is the hash of its head
//! ([`head_hash`]) plus one per guest and per health check ([`item_hash`]);
//! an overlay's entries are the sum of one per entry ([`fdb_hash`],
//! [`neighbor_hash`]). [`version`] hashes those parts together.
//!
//! The control plane's version hashes each overlay's whole section, which
//! every member shares; the digest ([`DesiredState::digest`]) hashes the
//! entries as this node installs them (without those at its own VTEP and
//! its own lease's neighbor entry), so an agent can compute it from what it
//! holds. An agent that builds its state from changes checks it against the
//! digest the control plane sends with each answer, and asks for the whole
//! state only when they differ — not every few minutes just in case.

use std::net::Ipv4Addr;

use sha2::{Digest, Sha256};

use crate::agent::{DesiredState, FdbEntry, NeighborEntry, OverlayState};

/// What a hash keeps: JSON numbers above 2^53 lose precision in some
/// clients.
pub const HASH_BITS: u64 = (1 << 53) - 1;

/// An FDB entry's part of its overlay's hash: the same on every CP and
/// after a restart, as a version must be.
pub fn fdb_hash(e: &FdbEntry) -> u64 {
    mix(mix(0x6664_6200 ^ mac_bits(&e.mac)).wrapping_add(u64::from(u32::from(e.vtep))))
}

/// A neighbor entry's part of its overlay's hash (see [`fdb_hash`]).
pub fn neighbor_hash(e: &NeighborEntry) -> u64 {
    mix(mix(0x6e62_7200 ^ u64::from(u32::from(e.ip))).wrapping_add(mac_bits(&e.mac)))
}

/// The hash of a list of entries: the sum of theirs, in [`HASH_BITS`].
pub fn entries_hash(fdb: &[FdbEntry], neighbors: &[NeighborEntry]) -> u64 {
    fdb.iter()
        .map(fdb_hash)
        .chain(neighbors.iter().map(neighbor_hash))
        .fold(0u64, u64::wrapping_add)
        & HASH_BITS
}

fn mac_bits(mac: &otherix_core::MacAddr) -> u64 {
    mac.0.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
}

/// A 64-bit finalizer (MurmurHash3's): every input bit reaches every
/// output bit, so sums of entries' hashes differ when the entries do.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A hash of a node's own part and its VTEP (which decides its view of
/// the overlays): [`head_hash`] plus each guest's and each check's
/// [`item_hash`].
pub fn own_hash(state: &DesiredState, vtep: Option<Ipv4Addr>) -> u64 {
    let items = state
        .guests
        .iter()
        .map(|g| item_hash(b"guest", g))
        .chain(state.health_checks.iter().map(|c| item_hash(b"check", c)))
        .fold(0u64, u64::wrapping_add);
    head_hash(state, vtep).wrapping_add(items) & HASH_BITS
}

/// The hash of `state` less its guests, health checks and overlays'
/// entries, and of `vtep`. The answer's own fields (`version`,
/// `unchanged`, `delta`, `digest`) are not part of it.
pub fn head_hash(state: &DesiredState, vtep: Option<Ipv4Addr>) -> u64 {
    // Every field named: a field added to the state is hashed or left out
    // here on purpose, not by accident.
    let DesiredState {
        version: _,
        node,
        roles,
        mtu,
        overlays,
        bridges,
        guests: _,
        session_keys,
        cluster_id,
        health_checks: _,
        revocations,
        forwards,
        unchanged: _,
        delta: _,
        digest: _,
    } = state;
    let head = DesiredState {
        version: 0,
        node: node.clone(),
        roles: roles.clone(),
        mtu: *mtu,
        overlays: overlays.iter().map(without_entries).collect(),
        bridges: bridges.clone(),
        guests: Vec::new(),
        session_keys: session_keys.clone(),
        cluster_id: cluster_id.clone(),
        health_checks: Vec::new(),
        revocations: revocations.clone(),
        forwards: forwards.clone(),
        unchanged: false,
        delta: None,
        digest: None,
    };
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(&head).unwrap_or_default());
    h.update(vtep.map_or([0; 4], |v| v.octets()));
    first_53_bits(&h.finalize())
}

/// An overlay without its entries (not copied to be dropped).
fn without_entries(o: &OverlayState) -> OverlayState {
    let OverlayState {
        network,
        network_id,
        vni,
        subnet,
        address,
        mac,
        fdb: _,
        neighbors: _,
    } = o;
    OverlayState {
        network: network.clone(),
        network_id: network_id.clone(),
        vni: *vni,
        subnet: *subnet,
        address: *address,
        mac: *mac,
        fdb: Vec::new(),
        neighbors: Vec::new(),
    }
}

/// One guest's or health check's part of its node's own hash (`kind`
/// tells them apart): 64 bits of the SHA-256 of its JSON.
pub fn item_hash<T: serde::Serialize>(kind: &[u8], item: &T) -> u64 {
    let mut h = Sha256::new();
    h.update(kind);
    h.update([0]);
    h.update(serde_json::to_vec(item).unwrap_or_default());
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// The hash of an own part's hash and, per overlay in the state's order,
/// its name and the hash of its entries: a node's version when those are
/// whole sections, its digest when they are what it installs.
pub fn version(own_hash: u64, overlays: &[(&str, u64)]) -> u64 {
    let mut h = Sha256::new();
    h.update(own_hash.to_be_bytes());
    for (net, hash) in overlays {
        h.update(net.as_bytes());
        h.update([0]);
        h.update(hash.to_be_bytes());
    }
    first_53_bits(&h.finalize())
}

fn first_53_bits(digest: &[u8]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first) & HASH_BITS
}

impl DesiredState {
    /// The digest of this state as the node at `vtep` holds it: what the
    /// control plane sends as [`DesiredState::digest`] for the state it
    /// means the node to hold. Costs a pass over every entry.
    pub fn digest(&self, vtep: Option<Ipv4Addr>) -> u64 {
        let overlays: Vec<(&str, u64)> = self
            .overlays
            .iter()
            .map(|o| (o.network.as_str(), entries_hash(&o.fdb, &o.neighbors)))
            .collect();
        version(own_hash(self, vtep), &overlays)
    }
}
