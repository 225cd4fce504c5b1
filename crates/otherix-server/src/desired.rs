//! Computes a node's desired state from the read model (`catalog::Model`).
//! Pure: no IO, `now` passed in, so every rule here is unit-tested without a
//! cluster. What a node gets is proportional to what it holds — its
//! overlays, bridges, guests and their health checks — never to the whole
//! cluster.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;

use otherix_core::ipam::Ipv4Cidr;
use otherix_proto::agent::{
    BridgeState, DesiredState, FdbEntry, Forward, GuestState, HealthCheck, IncomingMigration, MigrateTo,
    MigrationKey, NeighborEntry, OverlayChange, OverlayState, QemuMigration, SessionPublicKey,
};
use otherix_proto::{Network, NetworkType, Vm};
use otherix_store::NodeRecord;
use time::{Duration, OffsetDateTime};

use crate::catalog::Model;

pub mod json;

pub use otherix_proto::digest::{
    entries_hash, fdb_hash, head_hash, item_hash, neighbor_hash, own_hash, version, HASH_BITS,
};

/// What every node's desired state shares, beside the model.
#[derive(Debug, Clone, Copy)]
pub struct Common<'a> {
    /// MTU of guest and overlay interfaces.
    pub mtu: u32,
    /// Published session public keys (gateways get them).
    pub session_keys: &'a [SessionPublicKey],
    /// This cluster's id, the `iss` of its credentials.
    pub cluster_id: &'a str,
    /// What QEMU migrations' keys are derived from ([`migration_key`]).
    pub migration_secret: Option<&'a [u8; 32]>,
}

/// What an admin granted `node`, as the API and the agent see it: the relay
/// as the endpoint the CP dials.
pub fn granted_roles(node: &NodeRecord) -> otherix_proto::agent::NodeRoles {
    otherix_proto::agent::NodeRoles {
        hypervisor: node.hypervisor,
        gateway: node.gateway.clone(),
        relay: node.relay_endpoint().map(|a| a.to_string()),
    }
}

/// A node is Ready while its last heartbeat is younger than `timeout`.
pub fn is_ready(node: &NodeRecord, now: OffsetDateTime, timeout: Duration) -> bool {
    node.last_heartbeat.is_some_and(|t| now - t < timeout)
}

/// The overlays `node` must be a member of: those where it hosts a guest,
/// for a granted gateway every overlay that has placed VMs, and — sticky —
/// every overlay where it still reports open sessions (DESIGN §3: membership
/// is withdrawn only after they drain), for at most `max_drain` since
/// `drain_since` says the drain began.
pub fn memberships(
    m: &Model,
    node: &NodeRecord,
    drain_since: &BTreeMap<String, OffsetDateTime>,
    now: OffsetDateTime,
    max_drain: Duration,
) -> BTreeSet<String> {
    membership_names(m, node, drain_since, now, max_drain)
        .into_iter()
        .map(str::to_string)
        .collect()
}

/// [`memberships`], borrowed from the model and `node`: what a heartbeat
/// compares with the leases `node` holds, copying names only when they
/// differ.
/// Sorted, each once. The networks of its guests come sorted from the
/// model's index: they are copied into one list, not into a set of ~100
/// names at every heartbeat; only a node forwarding or draining (rare)
/// sorts.
pub fn membership_names<'a>(
    m: &'a Model,
    node: &'a NodeRecord,
    drain_since: &BTreeMap<String, OffsetDateTime>,
    now: OffsetDateTime,
    max_drain: Duration,
) -> Vec<&'a str> {
    let mut wanted = Vec::new();
    covered(m, node, &mut wanted);
    let covered = wanted.len();
    wanted.extend(forwarding(m, &node.name).map(|(_, vm)| vm.network.as_str()));
    wanted.extend(
        draining_names(m, node)
            .into_iter()
            .filter(|net| drain_since.get(*net).is_none_or(|t| now - *t < max_drain)),
    );
    debug_assert!(wanted[..covered].is_sorted_by(|a, b| a < b));
    if wanted.len() > covered {
        wanted.sort_unstable();
        wanted.dedup();
    }
    wanted
}

/// How long a node forwards frames for a guest handed over from it at the
/// most: until every other member of the guest's overlay has applied a
/// desired state that says where the guest is now, normally a heartbeat
/// or two; this bounds it for a member that never does (NotReady).
pub const FORWARD_AT_MOST: Duration = Duration::seconds(10);

/// The guests `node` still forwards frames for, by VM id: each VM just
/// handed over from it (`Model::moved_from`, until the heartbeat ends it:
/// [`forwards_pending`]) that is on an overlay, placed on another node
/// and not migrating again. `node` stays a member of their overlays
/// meanwhile ([`memberships`]): its VXLAN device is what they arrive on.
pub fn forwarding<'a>(m: &'a Model, node: &'a str) -> impl Iterator<Item = (&'a String, &'a Vm)> + 'a {
    m.moved_from(node).filter_map(move |(id, _)| {
        let vm = m.vm(id)?;
        let host = vm.node.as_deref()?;
        let overlay = m
            .network_ref(&vm.network)
            .is_some_and(|n| n.kind == NetworkType::Overlay);
        (overlay && host != node && vm.migrate_to.is_none()).then_some((id, vm))
    })
}

/// What `node`'s desired state says it forwards (see [`forwarding`]), on
/// the overlays it holds (`overlays`), to each guest's host's VTEP as the
/// CP holds it. Sorted.
pub fn forwards(m: &Model, node: &str, overlays: &[OverlayState]) -> Vec<Forward> {
    let mut out: Vec<Forward> = forwarding(m, node)
        .filter(|(_, vm)| overlays.iter().any(|o| o.network == vm.network))
        .filter_map(|(_, vm)| {
            Some(Forward {
                network: vm.network.clone(),
                mac: vm.mac,
                vtep: node_vtep(m, vm.node.as_deref()?)?,
            })
        })
        .collect();
    out.sort_unstable();
    out
}

/// Whether `node`'s forwarding for a guest handed over from it goes on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Forwarding {
    /// Over: past its time, or there is nothing left to forward (the VM
    /// gone, back here, migrating again).
    Over,
    /// Until these members of the guest's overlay (all but `node` and the
    /// guest's host, sorted) have applied a desired state that says where
    /// the guest is now.
    Until(Vec<String>),
}

/// For each VM just handed over from `node` (by id): whether its
/// forwarding goes on at `now` (see [`Forwarding`]).
pub fn forwards_pending(m: &Model, node: &str, now: OffsetDateTime) -> Vec<(String, Forwarding)> {
    let live: BTreeMap<&String, &Vm> = forwarding(m, node).collect();
    m.moved_from(node)
        .map(|(id, moved)| {
            let verdict = match live.get(id) {
                Some(vm) if now < moved.until => {
                    let host = vm.node.as_deref().unwrap_or_default();
                    Forwarding::Until(
                        m.leases_on(&vm.network)
                            .map(|l| l.node.clone())
                            .filter(|n| n != node && n != host)
                            .collect::<BTreeSet<_>>()
                            .into_iter()
                            .collect(),
                    )
                }
                // Migrating back here: over once this node applied a state
                // without it (its rule gone), so that frames for the guest
                // are not sent away from it once it is back. Its handover
                // waits for that ([`handover`]).
                _ if now < moved.until
                    && m.vm(id).is_some_and(|vm| vm.migrate_to.as_deref() == Some(node)) =>
                {
                    Forwarding::Until(vec![node.to_string()])
                }
                _ => Forwarding::Over,
            };
            (id.clone(), verdict)
        })
        .collect()
}

/// Overlays kept for `node` only because its sessions there have not
/// drained. Only a granted gateway's reported sessions count, and only on
/// overlays it is already a member of: a node cannot report its way into
/// an overlay.
pub fn draining(m: &Model, node: &NodeRecord) -> BTreeSet<String> {
    draining_names(m, node).into_iter().map(str::to_string).collect()
}

/// [`draining`], borrowed from `node`.
fn draining_names<'a>(m: &Model, node: &'a NodeRecord) -> BTreeSet<&'a str> {
    if node.gateway.is_none() {
        return BTreeSet::new();
    }
    let covered = coverage(m, node);
    node.sessions
        .iter()
        .filter(|(net, n)| **n > 0 && !covered.contains(net.as_str()))
        .filter(|(net, _)| m.network_ref(net).is_some_and(|x| x.kind == NetworkType::Overlay))
        .filter(|(net, _)| m.lease(net, &node.name).is_some())
        .map(|(net, _)| net.as_str())
        .collect()
}

/// Since when each of `node`'s draining memberships has been draining: the
/// recorded time, or `now` for one that just began.
pub fn drain_since(m: &Model, node: &NodeRecord, now: OffsetDateTime) -> BTreeMap<String, OffsetDateTime> {
    draining_names(m, node)
        .into_iter()
        .map(|net| {
            let t = node.draining_since.get(net).copied().unwrap_or(now);
            (net.to_string(), t)
        })
        .collect()
}

/// Memberships that follow from placement alone (a migration's target
/// joins the overlay before the guest is handed over).
fn coverage<'a>(m: &'a Model, node: &NodeRecord) -> BTreeSet<&'a str> {
    let mut names = Vec::new();
    covered(m, node, &mut names);
    names.into_iter().collect()
}

/// [`coverage`] added to `out`, in name order (both sources are kept
/// sorted by name).
fn covered<'a>(m: &'a Model, node: &NodeRecord, out: &mut Vec<&'a str>) {
    if node.gateway.is_some() {
        out.extend(
            m.network_refs()
                .filter(|n| n.kind == NetworkType::Overlay && m.has_placed_vms(&n.name))
                .map(|n| n.name.as_str()),
        );
        return;
    }
    // The networks of its guests, kept by the model (a lookup per network,
    // not a walk of its guests).
    out.extend(m.guest_networks(&node.name).filter(|name| {
        m.network_ref(name)
            .is_some_and(|n| n.kind == NetworkType::Overlay)
    }));
}

/// Whether `node` may run a guest of `net`: any node for an overlay (it
/// joins by hosting), only the network's own nodes for a bridge network.
pub fn can_host(net: &Network, node: &str) -> bool {
    match net.kind {
        NetworkType::Overlay => true,
        NetworkType::Bridge => net.nodes.iter().any(|n| n == node),
    }
}

/// The desired state of `node`, whole: its own part with every overlay's
/// entries as `node` sees them, and its version. What a heartbeat answer
/// describes, however it is sent (see `catalog::states`).
pub fn desired_state(m: &Model, common: &Common<'_>, node: &str) -> DesiredState {
    let own = own_part(m, common, node);
    let vtep = node_vtep(m, node);
    let sections: Vec<Option<Section>> = own.overlays.iter().map(|o| section(m, &o.network)).collect();
    let own_hash = own_hash(&own, vtep);
    let hashes: Vec<(&str, u64)> = own
        .overlays
        .iter()
        .zip(&sections)
        .map(|(o, s)| (o.network.as_str(), s.as_ref().map_or(0, Section::hash)))
        .collect();
    let version = version(own_hash, &hashes);
    let mut state = compose(&own, vtep, version, None, |i| sections[i].as_ref());
    state.digest = Some(state.digest(vtep));
    state
}

/// An overlay's FDB and neighbor entries, as every member shares them:
/// each placed guest (neighbor; FDB at its host's VTEP when known) and each
/// member's lease with a known VTEP (both). Sorted, without repeats. A
/// member sees it less the entries that are its own ([`Section::view`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Section {
    /// The overlay's id: a network recreated under the same name is another section.
    pub network_id: String,
    pub fdb: Vec<FdbEntry>,
    pub neighbors: Vec<NeighborEntry>,
}

/// What changed between two contents of a section (each list sorted).
#[derive(Debug, Clone, Default)]
pub struct SectionDiff {
    pub fdb_added: Vec<FdbEntry>,
    pub fdb_removed: Vec<FdbEntry>,
    pub neighbors_added: Vec<NeighborEntry>,
    pub neighbors_removed: Vec<NeighborEntry>,
    /// The entries added, as JSON: written by the first member's answer
    /// that takes them, copied by the others ([`SectionDiff::added_json`]).
    added_json: std::sync::OnceLock<json::SectionJson>,
}

impl PartialEq for SectionDiff {
    fn eq(&self, other: &SectionDiff) -> bool {
        self.fdb_added == other.fdb_added
            && self.fdb_removed == other.fdb_removed
            && self.neighbors_added == other.neighbors_added
            && self.neighbors_removed == other.neighbors_removed
    }
}

impl Eq for SectionDiff {}

impl SectionDiff {
    /// The entries added, as JSON, written once for every member.
    pub fn added_json(&self) -> &json::SectionJson {
        self.added_json.get_or_init(|| json::SectionJson::added(self))
    }

    pub fn only_adds(&self) -> bool {
        self.fdb_removed.is_empty() && self.neighbors_removed.is_empty()
    }

    pub fn len(&self) -> usize {
        self.fdb_added.len()
            + self.fdb_removed.len()
            + self.neighbors_added.len()
            + self.neighbors_removed.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Section {
    pub fn len(&self) -> usize {
        self.fdb.len() + self.neighbors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A hash of the content (the entries, not the id): the sum of its
    /// entries' hashes ([`fdb_hash`], [`neighbor_hash`]), so a section
    /// kept up to date entry by entry keeps its hash with two additions.
    pub fn hash(&self) -> u64 {
        entries_hash(&self.fdb, &self.neighbors)
    }

    /// The entries as the member with VTEP `vtep` and its lease in `overlay`
    /// sees them: none at its own VTEP (frames to it are local), not its
    /// own lease's neighbor entry.
    pub fn view(
        &self,
        vtep: Option<Ipv4Addr>,
        overlay: &OverlayState,
    ) -> (Vec<FdbEntry>, Vec<NeighborEntry>) {
        self.view_at(vtep, (overlay.address.addr(), overlay.mac))
    }

    /// [`Section::view`] of the member whose lease is `(ip, mac)`.
    pub fn view_at(
        &self,
        vtep: Option<Ipv4Addr>,
        lease: (Ipv4Addr, otherix_core::MacAddr),
    ) -> (Vec<FdbEntry>, Vec<NeighborEntry>) {
        let fdb = self.fdb.iter().filter(|e| keep_fdb(e, vtep)).copied().collect();
        let neighbors = self
            .neighbors
            .iter()
            .filter(|e| keeps_neighbor(e, lease))
            .copied()
            .collect();
        (fdb, neighbors)
    }

    /// What changed from `self` to `next`.
    pub fn diff(&self, next: &Section) -> SectionDiff {
        let (fdb_added, fdb_removed) = sorted_diff(&self.fdb, &next.fdb);
        let (neighbors_added, neighbors_removed) = sorted_diff(&self.neighbors, &next.neighbors);
        SectionDiff {
            fdb_added,
            fdb_removed,
            neighbors_added,
            neighbors_removed,
            added_json: Default::default(),
        }
    }
}

/// Whether the member at `vtep` installs this FDB entry.
pub fn keep_fdb(e: &FdbEntry, vtep: Option<Ipv4Addr>) -> bool {
    Some(e.vtep) != vtep
}

/// Whether the member whose lease `overlay` holds installs this neighbor entry.
pub fn keep_neighbor(e: &NeighborEntry, overlay: &OverlayState) -> bool {
    keeps_neighbor(e, (overlay.address.addr(), overlay.mac))
}

/// [`keep_neighbor`] for the member whose lease is `(ip, mac)`.
pub fn keeps_neighbor(e: &NeighborEntry, (ip, mac): (Ipv4Addr, otherix_core::MacAddr)) -> bool {
    !(e.ip == ip && e.mac == mac)
}

/// Entries of `new` not in `old`, and of `old` not in `new` (both sorted).
fn sorted_diff<T: Ord + Copy>(old: &[T], new: &[T]) -> (Vec<T>, Vec<T>) {
    let (mut added, mut removed) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < old.len() || j < new.len() {
        match (old.get(i), new.get(j)) {
            (Some(a), Some(b)) if a == b => {
                i += 1;
                j += 1;
            }
            (Some(a), Some(b)) if a < b => {
                removed.push(*a);
                i += 1;
            }
            (Some(_), Some(b)) => {
                added.push(*b);
                j += 1;
            }
            (Some(a), None) => {
                removed.push(*a);
                i += 1;
            }
            (None, Some(b)) => {
                added.push(*b);
                j += 1;
            }
            (None, None) => break,
        }
    }
    (added, removed)
}

/// Overlay `network`'s section; `None` for a network that is not an overlay.
pub fn section(m: &Model, network: &str) -> Option<Section> {
    Some(section_of(&sources(m, network)?))
}

/// The section these sources make.
pub fn section_of(sources: &Sources) -> Section {
    let mut fdb = Vec::new();
    let mut neighbors = Vec::new();
    for (_, e) in &sources.guests {
        neighbors.push(e.neighbor);
        fdb.extend(e.fdb);
    }
    for (_, e) in &sources.leases {
        neighbors.push(e.neighbor);
        fdb.extend(e.fdb);
    }
    // Sorted and without repeats, as a set would hold them (cheaper).
    fdb.sort_unstable();
    fdb.dedup();
    neighbors.sort_unstable();
    neighbors.dedup();
    Section {
        network_id: sources.network_id.clone(),
        fdb,
        neighbors,
    }
}

/// What one guest or one member's lease puts in its overlay's section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entries {
    pub neighbor: NeighborEntry,
    /// At its host's VTEP, when that is known.
    pub fdb: Option<FdbEntry>,
}

/// Where overlay `network`'s section comes from: its placed guests (by VM
/// id) and its members' leases with a known VTEP (by member). `catalog::states`
/// keeps a section up to date from the sources that changed, one by one.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    pub network_id: String,
    pub guests: Vec<(String, Entries)>,
    pub leases: Vec<(String, Entries)>,
}

/// One source of a section's entries.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    /// A placed guest, by VM id.
    Guest(String),
    /// A member's lease, by node name.
    Lease(String),
}

/// See [`Sources`]; `None` for a network that is not an overlay.
pub fn sources(m: &Model, network: &str) -> Option<Sources> {
    let net = m
        .network_ref(network)
        .filter(|n| n.kind == NetworkType::Overlay)?;
    // A VTEP is stored only once checked (`node::parse_vtep`). Looked up
    // once per host, not once per guest: an overlay holds thousands.
    let mut vteps: HashMap<&str, Option<Ipv4Addr>> = HashMap::new();
    let mut vtep_of = |n: &'_ str| -> Option<Ipv4Addr> {
        if let Some(v) = vteps.get(n) {
            return *v;
        }
        let rec = m.node(n)?;
        let v = rec.vtep.as_deref().and_then(|v| v.parse().ok());
        vteps.insert(rec.name.as_str(), v);
        v
    };
    let mut guests = Vec::new();
    for vm in m.vms_on_network(network) {
        let Some(host) = vm.node.as_deref() else { continue };
        let vtep = vtep_of(host);
        guests.push((vm.id.clone(), vm_entries(vm, vtep)));
    }
    let mut leases = Vec::new();
    for lease in m.leases_on(network) {
        let Some(vtep) = vtep_of(&lease.node) else {
            continue;
        };
        leases.push((lease.node.clone(), lease_entries(lease, vtep)));
    }
    Some(Sources {
        network_id: net.id.clone(),
        guests,
        leases,
    })
}

/// What VM `id` puts in overlay `network`'s section now: nothing unless it
/// is on that network and placed.
pub fn guest_entries(m: &Model, network: &str, id: &str) -> Option<Entries> {
    let vm = m.vm(id).filter(|vm| vm.network == network)?;
    let host = vm.node.as_deref()?;
    Some(vm_entries(vm, node_vtep(m, host)))
}

/// What `source` puts in overlay `network`'s section now, as [`sources`]
/// finds it: a guest's entries, or a member's lease at its VTEP (none
/// while its VTEP is unknown).
pub fn source_entries(m: &Model, network: &str, source: &Source) -> Option<Entries> {
    match source {
        Source::Guest(id) => guest_entries(m, network, id),
        Source::Lease(node) => {
            let lease = m.lease(network, node)?;
            Some(lease_entries(lease, node_vtep(m, node)?))
        }
    }
}

fn lease_entries(lease: &otherix_store::NodeLease, vtep: Ipv4Addr) -> Entries {
    Entries {
        neighbor: NeighborEntry {
            ip: lease.ip,
            mac: lease.mac,
        },
        fdb: Some(FdbEntry { mac: lease.mac, vtep }),
    }
}

fn vm_entries(vm: &Vm, vtep: Option<Ipv4Addr>) -> Entries {
    Entries {
        neighbor: NeighborEntry {
            ip: vm.ip,
            mac: vm.mac,
        },
        fdb: vtep.map(|vtep| FdbEntry { mac: vm.mac, vtep }),
    }
}

/// `node`'s VTEP as the CP holds it (checked when stored).
pub fn node_vtep(m: &Model, node: &str) -> Option<Ipv4Addr> {
    m.node(node)?.vtep.as_deref()?.parse().ok()
}

/// `node`'s whole state from its own part and its overlays' sections
/// (`section(i)` for `own.overlays[i]`), with `version` and `digest`.
pub fn compose<'a>(
    own: &DesiredState,
    vtep: Option<Ipv4Addr>,
    version: u64,
    digest: Option<u64>,
    section: impl Fn(usize) -> Option<&'a Section>,
) -> DesiredState {
    let mut state = own.clone();
    state.version = version;
    state.digest = digest;
    for (i, o) in state.overlays.iter_mut().enumerate() {
        if let Some(s) = section(i) {
            (o.fdb, o.neighbors) = s.view(vtep, o);
        }
    }
    state
}

/// [`compose`] as JSON, byte for byte what `serde_json::to_vec` of its
/// result gives, without building it: the own part (small) is serialized
/// as it is, and each overlay's entries are copied from its section's JSON
/// ([`json::SectionJson`], written once for every member) less the
/// member's own. A whole state is all of its overlays' entries (18 MiB at
/// 1,000 nodes in 100 overlays of 1,000 VMs), and every node takes one at
/// its start: formatting each entry for each member was most of its cost.
pub fn compose_json<'a>(
    own: &DesiredState,
    vtep: Option<Ipv4Addr>,
    version: u64,
    digest: Option<u64>,
    section: impl Fn(usize) -> Option<(&'a Section, &'a json::SectionJson)>,
) -> Vec<u8> {
    let compose_slowly = || {
        serde_json::to_vec(&compose(own, vtep, version, digest, |i| {
            section(i).map(|(s, _)| s)
        }))
        .unwrap_or_default()
    };
    // The own part's overlays hold no entries: each serializes ending with
    // EMPTY, the last two fields of `OverlayState`. Those bytes cannot be
    // inside a JSON string (its quotes would be escaped), and no other
    // part of the state has these fields; should that ever change, the
    // count below tells, and the state is composed the slow way.
    const EMPTY: &[u8] = br#""fdb":[],"neighbors":[]}"#;
    if own
        .overlays
        .iter()
        .any(|o| !o.fdb.is_empty() || !o.neighbors.is_empty())
    {
        return compose_slowly();
    }
    let mut head = own.clone();
    head.version = version;
    head.digest = digest;
    let Ok(bytes) = serde_json::to_vec(&head) else {
        return Vec::new();
    };
    let at: Vec<usize> = memchr_all(&bytes, EMPTY);
    if at.len() != own.overlays.len() {
        debug_assert!(
            false,
            "an overlay's empty entries found {} times for {}",
            at.len(),
            own.overlays.len()
        );
        return compose_slowly();
    }
    let entries: usize = (0..own.overlays.len())
        .filter_map(&section)
        .map(|(s, _)| s.fdb.len() + s.neighbors.len())
        .sum();
    let mut out = Vec::with_capacity(bytes.len() + entries * 48);
    let mut from = 0;
    for (i, (&pos, o)) in at.iter().zip(&own.overlays).enumerate() {
        out.extend_from_slice(&bytes[from..pos]);
        out.extend_from_slice(br#""fdb":["#);
        let s = section(i);
        if let Some((s, j)) = s {
            j.fdb.write_except(&mut out, &json::fdb_skips(&s.fdb, vtep));
        }
        out.extend_from_slice(br#"],"neighbors":["#);
        if let Some((s, j)) = s {
            let lease = (o.address.addr(), o.mac);
            j.neighbors
                .write_except(&mut out, &json::neighbor_skip(&s.neighbors, lease));
        }
        out.extend_from_slice(b"]}");
        from = pos + EMPTY.len();
    }
    out.extend_from_slice(&bytes[from..]);
    out
}

/// An FDB entry as serde writes it.
fn write_fdb(out: &mut Vec<u8>, e: &FdbEntry) {
    let mut b = Entry::default();
    b.put(br#"{"mac":""#);
    b.put(e.mac.text().as_str().as_bytes());
    b.put(br#"","vtep":""#);
    b.ipv4(e.vtep);
    b.put(br#""}"#);
    out.extend_from_slice(b.bytes());
}

/// A neighbor entry as serde writes it.
fn write_neighbor(out: &mut Vec<u8>, e: &NeighborEntry) {
    let mut b = Entry::default();
    b.put(br#"{"ip":""#);
    b.ipv4(e.ip);
    b.put(br#"","mac":""#);
    b.put(e.mac.text().as_str().as_bytes());
    b.put(br#""}"#);
    out.extend_from_slice(b.bytes());
}

/// One entry's JSON, built on the stack and added to the answer in one
/// copy: an answer holds up to hundreds of thousands of them (a whole
/// state at 1,000 nodes), and a push per byte, each checking the answer's
/// capacity, was a tenth of the answers' cost while nodes converge.
struct Entry {
    buf: [u8; 64],
    len: usize,
}

impl Default for Entry {
    fn default() -> Entry {
        Entry { buf: [0; 64], len: 0 }
    }
}

impl Entry {
    fn put(&mut self, bytes: &[u8]) {
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len();
    }

    /// An address in dotted decimal, as `Ipv4Addr`'s `Display` writes it.
    fn ipv4(&mut self, ip: Ipv4Addr) {
        for (i, octet) in ip.octets().into_iter().enumerate() {
            if i > 0 {
                self.put(b".");
            }
            let (digits, n) = OCTETS[usize::from(octet)];
            self.put(&digits[..usize::from(n)]);
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// Each octet's decimal digits, and how many.
const OCTETS: [([u8; 3], u8); 256] = {
    let mut t = [([0u8; 3], 0u8); 256];
    let mut i = 0;
    while i < 256 {
        let v = i as u8;
        t[i] = if v >= 100 {
            ([b'0' + v / 100, b'0' + v / 10 % 10, b'0' + v % 10], 3)
        } else if v >= 10 {
            ([b'0' + v / 10, b'0' + v % 10, 0], 2)
        } else {
            ([b'0' + v, 0, 0], 1)
        };
        i += 1;
    }
    t
};

/// Begins a list field after a comma: `,"key":[`.
fn open_field(out: &mut Vec<u8>, key: &[u8]) {
    out.extend_from_slice(b",\"");
    out.extend_from_slice(key);
    out.extend_from_slice(b"\":[");
}

/// A list of entries as serde writes it, `"key":[...]` after a comma,
/// nothing when empty (`skip_serializing_if`).
fn write_list<T>(out: &mut Vec<u8>, key: &[u8], list: &[T], write: fn(&mut Vec<u8>, &T)) {
    let Some((first, rest)) = list.split_first() else {
        return;
    };
    open_field(out, key);
    write(out, first);
    for e in rest {
        out.push(b',');
        write(out, e);
    }
    out.push(b']');
}

/// A delta's overlay changes as serde writes the list (`[...]`), each
/// entry written straight to the bytes: a burst of creates at 1,000 nodes
/// sends each member hundreds of entries a second, and serde's formatting
/// of their strings was most of the cost of the answers.
pub fn overlay_changes_json(out: &mut Vec<u8>, changes: &[OverlayChange]) {
    out.push(b'[');
    for (i, c) in changes.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        overlay_change_json(out, c);
    }
    out.push(b']');
}

/// One of [`overlay_changes_json`]'s changes.
pub fn overlay_change_json(out: &mut Vec<u8>, c: &OverlayChange) {
    {
        out.extend_from_slice(br#"{"network":"#);
        // A name is validated (no escapes), but written as serde would anyway.
        if serde_json::to_writer(&mut *out, &c.network).is_err() {
            out.extend_from_slice(b"\"\"");
        }
        if c.whole {
            out.extend_from_slice(br#","whole":true"#);
        }
        write_list(out, b"fdb_added", &c.fdb_added, write_fdb);
        write_list(out, b"fdb_removed", &c.fdb_removed, write_fdb);
        write_list(out, b"neighbors_added", &c.neighbors_added, write_neighbor);
        write_list(out, b"neighbors_removed", &c.neighbors_removed, write_neighbor);
        out.push(b'}');
    }
}

/// Where `needle` starts in `hay`, each time, left to right, not overlapping.
fn memchr_all(hay: &[u8], needle: &[u8]) -> Vec<usize> {
    let mut found = Vec::new();
    let mut i = 0;
    while i + needle.len() <= hay.len() {
        if hay[i..].starts_with(needle) {
            found.push(i);
            i += needle.len();
        } else {
            i += 1;
        }
    }
    found
}

/// An address in dotted decimal, as `Ipv4Addr`'s `Display` writes it.
#[cfg(test)]
fn write_ipv4(out: &mut Vec<u8>, ip: Ipv4Addr) {
    let mut b = Entry::default();
    b.ipv4(ip);
    out.extend_from_slice(b.bytes());
}

/// `node`'s own part, version 0: everything but its overlays' FDB and
/// neighbor entries (empty here), which come from the shared sections.
/// Its head ([`own_head`]) and one [`GuestPart`] per VM placed on it or
/// migrating to it, in order.
pub fn own_part(m: &Model, common: &Common<'_>, node: &str) -> DesiredState {
    let head = own_head(m, common, node);
    let parts = guest_parts(m, common, node, &head.overlays);
    assemble(head, parts.iter().map(|(_, p)| p))
}

/// The non-empty [`GuestPart`]s of `node` (whose head lists `overlays`),
/// by VM id.
pub fn guest_parts(
    m: &Model,
    common: &Common<'_>,
    node: &str,
    overlays: &[OverlayState],
) -> Vec<(String, GuestPart)> {
    m.vms_on_node(node)
        .map(|vm| (vm.id.clone(), guest_part(m, common, node, overlays, vm)))
        .filter(|(_, p)| !p.is_empty())
        .collect()
}

/// An own part from its head and its guests' parts: guests sorted by VM
/// id, health checks sorted.
pub fn assemble<'a>(mut head: DesiredState, parts: impl Iterator<Item = &'a GuestPart>) -> DesiredState {
    for p in parts {
        head.guests.extend(p.guest.iter().cloned());
        head.health_checks.extend(p.health_checks.iter().cloned());
    }
    head.guests.sort_by(|a, b| a.vm_id.cmp(&b.vm_id));
    head.health_checks.sort_unstable();
    head
}

/// `node`'s own part without its guests and health checks: roles, keys,
/// revocations, bridges, overlays.
pub fn own_head(m: &Model, common: &Common<'_>, node: &str) -> DesiredState {
    let me = m.node(node);
    let roles = me.map(granted_roles).unwrap_or_default();
    // Only a gateway verifies credentials and ends sessions by revocations.
    let gateway = roles.gateway.is_some();
    let mut state = DesiredState {
        version: 0,
        node: node.to_string(),
        revocations: if gateway {
            m.revocations().to_vec()
        } else {
            Vec::new()
        },
        roles,
        mtu: common.mtu,
        session_keys: if gateway {
            common.session_keys.to_vec()
        } else {
            Vec::new()
        },
        cluster_id: common.cluster_id.to_string(),
        ..Default::default()
    };
    for net in m.network_refs() {
        if net.kind == NetworkType::Bridge && net.nodes.iter().any(|n| n == node) {
            state.bridges.push(BridgeState {
                network: net.name.clone(),
                network_id: net.id.clone(),
                subnet: net.subnet,
                address: Ipv4Cidr::on(&net.subnet, net.subnet.node_address()),
            });
        }
    }
    for name in m.leased_network_names(node) {
        let Some(net) = m.network_ref(name).filter(|n| n.kind == NetworkType::Overlay) else {
            continue;
        };
        let Some(vni) = net.vni else { continue };
        let Some(mine) = m.lease(name, node) else {
            continue;
        };
        state.overlays.push(OverlayState {
            network: net.name.clone(),
            network_id: net.id.clone(),
            vni,
            subnet: net.subnet,
            address: Ipv4Cidr::on(&net.subnet, mine.ip),
            mac: mine.mac,
            fdb: Vec::new(),
            neighbors: Vec::new(),
        });
    }
    state.forwards = forwards(m, node, &state.overlays);
    state
}

/// What one VM puts in a node's own part: itself as a guest (placed here,
/// or a QEMU guest migrating here), and the health checks of its LBs
/// (placed here). Depends on the VM, its network, its LBs, the node's
/// overlays (`overlays`, from [`own_head`]) and a migration target's record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GuestPart {
    pub guest: Option<GuestState>,
    /// Sorted.
    pub health_checks: Vec<HealthCheck>,
}

impl GuestPart {
    pub fn is_empty(&self) -> bool {
        self.guest.is_none() && self.health_checks.is_empty()
    }

    /// Its part of the own hash (see [`own_hash`]).
    pub fn hash(&self) -> u64 {
        self.guest
            .iter()
            .map(|g| item_hash(b"guest", g))
            .chain(self.health_checks.iter().map(|c| item_hash(b"check", c)))
            .fold(0u64, u64::wrapping_add)
    }
}

/// VM `id`'s part of `node`'s own part now (see [`GuestPart`]).
pub fn guest_part_of(
    m: &Model,
    common: &Common<'_>,
    node: &str,
    overlays: &[OverlayState],
    id: &str,
) -> GuestPart {
    match m.vm(id) {
        Some(vm) => guest_part(m, common, node, overlays, vm),
        None => GuestPart::default(),
    }
}

fn guest_part(m: &Model, common: &Common<'_>, node: &str, overlays: &[OverlayState], vm: &Vm) -> GuestPart {
    let mut part = GuestPart::default();
    let Some(net) = m.network_ref(&vm.network) else {
        return part;
    };
    // An overlay guest's network must be realized here before the guest
    // can be plugged in; it always is, since hosting makes us a member —
    // unless our lease is not allocated yet, in which case wait a beat.
    let member = net.kind != NetworkType::Overlay || overlays.iter().any(|o| o.network == net.name);
    if vm.node.as_deref() == Some(node) {
        for lb in m.lbs_of(&vm.id) {
            let lb = &lb.record;
            part.health_checks.push(HealthCheck {
                lb: lb.name.clone(),
                vm_id: vm.id.clone(),
                network: vm.network.clone(),
                ip: vm.ip,
                port: lb.health_port.unwrap_or(lb.port),
                kind: lb.health_kind,
                path: lb.health_path.clone(),
                interval_ms: lb.interval_ms,
                timeout_ms: lb.timeout_ms,
                rise: lb.rise,
                fall: lb.fall,
            });
        }
        part.health_checks.sort_unstable();
        if member {
            part.guest = Some(GuestState {
                exec: vm.exec.clone(),
                migrate_to: handover(m, vm, net, common.migration_secret),
                ..guest_state(vm, net)
            });
        }
        return part;
    }
    // A QEMU guest migrating here: an incoming QEMU receives it, once this
    // node is a member of its network.
    if vm.migrate_to.as_deref() != Some(node) || vm.machine.is_none() {
        return part;
    }
    let (Some(from), Some(migration), Some(secret)) = (
        vm.node.as_deref(),
        vm.migration_id.as_deref(),
        common.migration_secret,
    ) else {
        return part;
    };
    if !member || (net.kind == NetworkType::Bridge && !can_host(net, node)) {
        return part;
    }
    part.guest = Some(GuestState {
        incoming: Some(IncomingMigration {
            from: from.to_owned(),
            migration: migration.to_owned(),
            key: migration_key(secret, &vm.id, migration, from, node),
        }),
        ..guest_state(vm, net)
    });
    part
}

/// `vm` as a guest on `net`, with nothing to run, hand over or receive.
fn guest_state(vm: &Vm, net: &Network) -> GuestState {
    GuestState {
        incoming: None,
        machine: vm.machine.clone(),
        vm_id: vm.id.clone(),
        name: vm.name.clone(),
        network: vm.network.clone(),
        network_id: net.id.clone(),
        mac: vm.mac,
        address: Ipv4Cidr::on(&net.subnet, vm.ip),
        gateway: net.subnet.node_address(),
        exec: None,
        migrate_to: None,
    }
}

/// For a migrating guest: where to hand it over, once the target has
/// realized the guest's network (and runs in a named namespace). The bridge
/// is the overlay's, or the target's own bridge of a bridge network (the
/// agent's names: `oxb{vni}`, `oxl{network_id[..8]}`).
fn handover(m: &Model, vm: &Vm, net: &Network, secret: Option<&[u8; 32]>) -> Option<MigrateTo> {
    let target = m.node(vm.migrate_to.as_deref()?)?;
    // The target still forwards frames for this guest (it left there a
    // moment ago): not before it stopped, or they would be sent away from
    // the guest once it is back.
    if m.moved(&vm.id).is_some_and(|mv| mv.from == target.name) {
        return None;
    }
    let bridge = match net.kind {
        NetworkType::Overlay => format!("oxb{}", net.vni?),
        NetworkType::Bridge if can_host(net, &target.name) => {
            format!("oxl{}", net.id.get(..8).unwrap_or(&net.id))
        }
        NetworkType::Bridge => return None,
    };
    // `ready_overlays` names bridge networks too (the field predates them).
    if !target.ready_overlays.contains(&net.name) {
        return None;
    }
    // A QEMU guest goes once the target's incoming QEMU listens: at the
    // target's VTEP (the CP's record, never an address a node names).
    let qemu = match &vm.machine {
        None => None,
        Some(_) => {
            let (migration, port, secret, from) = (
                vm.migration_id.as_deref()?,
                vm.migration_port?,
                secret?,
                vm.node.as_deref()?,
            );
            let vtep: std::net::Ipv4Addr = target.vtep.as_deref()?.parse().ok()?;
            Some(QemuMigration {
                migration: migration.to_owned(),
                address: std::net::SocketAddrV4::new(vtep, port).to_string(),
                key: migration_key(secret, &vm.id, migration, from, &target.name),
            })
        }
    };
    Some(MigrateTo {
        qemu,
        node: target.name.clone(),
        netns: target.netns.clone()?,
        bridge,
    })
}

/// The key of one QEMU migration's stream (TLS-PSK between the two QEMUs):
/// HMAC-SHA256 under the CP's migration secret of what names this migration
/// — the VM, the migration's id (new per `vm migrate`), source and target.
/// Nothing is stored: every replica derives it again, and only the two
/// nodes are told it.
pub fn migration_key(secret: &[u8; 32], vm_id: &str, migration: &str, from: &str, to: &str) -> MigrationKey {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let mut ctx = ring::hmac::Context::with_key(&key);
    for part in [vm_id, migration, from, to] {
        ctx.update(part.as_bytes());
        ctx.update(&[0]);
    }
    MigrationKey(hex::encode(ctx.sign().as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use otherix_proto::agent::Revocation;
    use otherix_proto::VmState;
    use otherix_store::{LbRecord, NodeLease};
    use std::net::Ipv4Addr;

    #[test]
    fn overlay_changes_are_written_as_serde_writes_them() {
        let fdb = |i: u8| FdbEntry {
            mac: format!("02:00:00:00:00:{i:02x}").parse().unwrap(),
            vtep: Ipv4Addr::new(10, 0, i, 200),
        };
        let nb = |i: u8| NeighborEntry {
            ip: Ipv4Addr::new(192, 168, 100, i),
            mac: format!("02:00:00:00:01:{i:02x}").parse().unwrap(),
        };
        let lists = [
            vec![],
            vec![OverlayChange {
                network: "ov".into(),
                ..Default::default()
            }],
            vec![
                OverlayChange {
                    network: "a\"b\\c".into(),
                    whole: true,
                    fdb_added: vec![fdb(1), fdb(22)],
                    neighbors_added: vec![nb(3)],
                    ..Default::default()
                },
                OverlayChange {
                    network: "ov2".into(),
                    fdb_removed: vec![fdb(0)],
                    neighbors_added: vec![nb(9), nb(100)],
                    neighbors_removed: vec![nb(255)],
                    ..Default::default()
                },
            ],
        ];
        for changes in lists {
            let mut out = Vec::new();
            overlay_changes_json(&mut out, &changes);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                serde_json::to_string(&changes).unwrap()
            );
        }
    }

    /// The rows a test world is made of.
    #[derive(Debug, Clone, Default)]
    struct Snapshot {
        nodes: Vec<NodeRecord>,
        networks: Vec<Network>,
        vms: Vec<Vm>,
        node_leases: Vec<NodeLease>,
        session_keys: Vec<SessionPublicKey>,
        cluster_id: String,
        lbs: Vec<LbRecord>,
        revocations: Vec<Revocation>,
    }

    fn model(s: &Snapshot) -> Model {
        Model::build(crate::catalog::Snapshot {
            nodes: s.nodes.clone(),
            networks: s.networks.clone(),
            vms: s.vms.clone(),
            node_leases: s.node_leases.clone(),
            lbs: s.lbs.clone(),
            revocations: s.revocations.clone(),
            ..Default::default()
        })
    }

    fn desired_state(s: &Snapshot, node: &str, mtu: u32) -> DesiredState {
        let common = Common {
            migration_secret: Default::default(),
            mtu,
            session_keys: &s.session_keys,
            cluster_id: &s.cluster_id,
        };
        super::desired_state(&model(s), &common, node)
    }

    fn memberships(
        s: &Snapshot,
        node: &NodeRecord,
        since: &BTreeMap<String, OffsetDateTime>,
        now: OffsetDateTime,
        max: Duration,
    ) -> BTreeSet<String> {
        super::memberships(&model(s), node, since, now, max)
    }

    fn draining(s: &Snapshot, node: &NodeRecord) -> BTreeSet<String> {
        super::draining(&model(s), node)
    }

    fn drain_since(s: &Snapshot, node: &NodeRecord, now: OffsetDateTime) -> BTreeMap<String, OffsetDateTime> {
        super::drain_since(&model(s), node, now)
    }

    fn node(name: &str, vtep: &str, hypervisor: bool, gateway: bool, hb_secs_ago: Option<i64>) -> NodeRecord {
        let now = OffsetDateTime::now_utc();
        NodeRecord {
            name: name.into(),
            cert_fingerprint: format!("fp-{name}"),
            hypervisor,
            gateway: gateway.then(|| format!("{vtep}:8443")),
            relay: None,
            vtep: Some(vtep.into()),
            agent_version: None,
            applied_version: None,
            last_heartbeat: hb_secs_ago.map(|s| now - Duration::seconds(s)),
            created_at: now,
            sessions: Default::default(),
            netns: None,
            ready_overlays: Default::default(),
            vtep_grant: None,
            status_reason: None,
            draining_since: Default::default(),
        }
    }

    /// Memberships with no drain recorded yet, now.
    fn members(s: &Snapshot, n: &NodeRecord) -> BTreeSet<String> {
        memberships(
            s,
            n,
            &BTreeMap::new(),
            OffsetDateTime::now_utc(),
            Duration::hours(12),
        )
    }

    fn overlay(name: &str, subnet: &str, vni: u32) -> Network {
        Network {
            name: name.into(),
            id: format!("id-{name}"),
            kind: NetworkType::Overlay,
            subnet: subnet.parse().unwrap(),
            vni: Some(vni),
            node: None,
            nodes: vec![],
            node_address: Ipv4Addr::UNSPECIFIED,
            vms: 0,
            created_at: OffsetDateTime::now_utc(),
        }
    }

    fn bridge(name: &str, subnet: &str, nodes: &[&str]) -> Network {
        Network {
            name: name.into(),
            id: format!("0123abcd{name}"),
            kind: NetworkType::Bridge,
            subnet: subnet.parse().unwrap(),
            vni: None,
            node: nodes.first().map(|n| n.to_string()),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            node_address: Ipv4Addr::UNSPECIFIED,
            vms: 0,
            created_at: OffsetDateTime::now_utc(),
        }
    }

    fn vm(name: &str, net: &str, ip: &str, mac: &str, node: Option<&str>) -> Vm {
        Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: name.into(),
            id: format!("id-{name}"),
            network: net.into(),
            node: node.map(Into::into),
            labels: Default::default(),
            mac: mac.parse().unwrap(),
            ip: ip.parse().unwrap(),
            state: VmState::Pending,
            reason: None,
            exec: None,
            migrate_to: None,
            created_at: OffsetDateTime::now_utc(),
        }
    }

    fn lease(net: &str, node: &str, ip: &str, mac: &str) -> NodeLease {
        NodeLease {
            network: net.into(),
            node: node.into(),
            ip: ip.parse().unwrap(),
            mac: mac.parse().unwrap(),
        }
    }

    fn world() -> Snapshot {
        Snapshot {
            nodes: vec![
                node("n1", "10.0.0.11", true, false, Some(1)),
                node("n2", "10.0.0.12", true, false, Some(1)),
                node("gw", "10.0.0.13", false, true, Some(1)),
            ],
            networks: vec![
                overlay("ov", "10.100.0.0/24", 100),
                overlay("empty", "10.101.0.0/24", 101),
            ],
            vms: vec![
                vm("a", "ov", "10.100.0.2", "02:00:00:00:00:0a", Some("n1")),
                vm("b", "ov", "10.100.0.3", "02:00:00:00:00:0b", Some("n2")),
            ],
            node_leases: vec![
                lease("ov", "n1", "10.100.0.4", "02:00:00:00:01:01"),
                lease("ov", "n2", "10.100.0.5", "02:00:00:00:01:02"),
                lease("ov", "gw", "10.100.0.6", "02:00:00:00:01:03"),
            ],
            session_keys: vec![],
            cluster_id: "c0ffee".into(),
            lbs: vec![],
            revocations: vec![],
        }
    }

    #[test]
    fn the_node_a_guest_left_forwards_for_it_until_the_members_caught_up_or_its_time_is_up() {
        // Guest `a` was on n1 and now runs on n2; n1 was told it moved.
        let mut s = world();
        s.vms[0].node = Some("n2".into());
        let mut m = model(&s);
        let now = OffsetDateTime::now_utc();
        let n1 = s.nodes[0].clone();
        let only = |m: &Model| super::memberships(m, &n1, &BTreeMap::new(), now, Duration::hours(12));
        assert!(only(&m).is_empty(), "n1 hosts nothing any more");
        m.set_moved("id-a", "n1", now + FORWARD_AT_MOST);
        assert_eq!(
            only(&m),
            BTreeSet::from(["ov".to_string()]),
            "a member while it forwards"
        );
        let common = Common {
            migration_secret: None,
            mtu: 1450,
            session_keys: &[],
            cluster_id: "c",
        };
        let own = own_part(&m, &common, "n1");
        assert_eq!(
            own.forwards,
            vec![Forward {
                network: "ov".into(),
                mac: "02:00:00:00:00:0a".parse().unwrap(),
                // n2's VTEP, from the CP's record of n2.
                vtep: "10.0.0.12".parse().unwrap(),
            }]
        );
        assert!(
            own_part(&m, &common, "n2").forwards.is_empty(),
            "the host forwards nothing"
        );
        assert_eq!(
            forwards_pending(&m, "n1", now),
            vec![("id-a".to_string(), Forwarding::Until(vec!["gw".to_string()]))],
            "until every other member (the gateway) applied it"
        );
        assert_eq!(
            forwards_pending(&m, "n1", now + FORWARD_AT_MOST),
            vec![("id-a".to_string(), Forwarding::Over)],
            "bounded in time"
        );
        // Migrating again, or back on n1: nothing to forward.
        let mut again = s.clone();
        again.vms[0].migrate_to = Some("n1".into());
        let mut m2 = model(&again);
        m2.set_moved("id-a", "n1", now + FORWARD_AT_MOST);
        assert!(own_part(&m2, &common, "n1").forwards.is_empty());
        assert_eq!(
            forwards_pending(&m2, "n1", now),
            vec![("id-a".to_string(), Forwarding::Until(vec!["n1".to_string()]))],
            "back to n1: over once n1 applied a state without the forward"
        );
        let mut ready = s.nodes[0].clone();
        ready.netns = Some("ns-n1".into());
        ready.ready_overlays = ["ov".to_string()].into();
        let a = m2.vm("id-a").unwrap().clone();
        let net = m2.network_ref("ov").unwrap().clone();
        let mut m3 = m2.clone();
        m3.set_node("n1", Some(ready.clone()));
        assert_eq!(
            handover(&m3, &a, &net, None),
            None,
            "the handover waits for n1 to stop forwarding"
        );
        let t = m3.end_moved("id-a");
        assert!(
            t.own_guests.get("n2").is_some_and(|ids| ids.contains("id-a")),
            "n2's handover looked at again"
        );
        assert!(handover(&m3, &a, &net, None).is_some());
        let mut m4 = model(&{
            let mut x = again.clone();
            x.vms[0].migrate_to = Some("gw".into());
            x
        });
        m4.set_moved("id-a", "n1", now + FORWARD_AT_MOST);
        assert_eq!(
            forwards_pending(&m4, "n1", now),
            vec![("id-a".to_string(), Forwarding::Over)]
        );
        let t = m.end_moved("id-a");
        assert!(t.nodes.contains("n1"), "n1's state is recomputed");
        assert!(only(&m).is_empty() && own_part(&m, &common, "n1").forwards.is_empty());
    }

    #[test]
    fn gateway_joins_every_overlay_with_vms_and_hosts_join_their_own() {
        let s = world();
        assert_eq!(members(&s, &s.nodes[2]), BTreeSet::from(["ov".to_string()]));
        assert_eq!(members(&s, &s.nodes[0]), BTreeSet::from(["ov".to_string()]));
        let mut idle = s.clone();
        idle.vms.retain(|v| v.node.as_deref() != Some("n1"));
        assert!(
            members(&idle, &idle.nodes[0]).is_empty(),
            "no guest, no membership"
        );
    }

    #[test]
    fn a_gateway_keeps_an_overlay_while_its_sessions_drain() {
        let mut s = world();
        s.vms.clear();
        let mut gw = s.nodes[2].clone();
        assert!(members(&s, &gw).is_empty(), "no VMs, no coverage");
        gw.sessions.insert("ov".into(), 1);
        assert_eq!(members(&s, &gw), BTreeSet::from(["ov".to_string()]));
        assert_eq!(draining(&s, &gw), BTreeSet::from(["ov".to_string()]));
        gw.sessions.insert("ov".into(), 0);
        assert!(members(&s, &gw).is_empty(), "withdrawn once drained");
        gw.sessions.insert("gone".into(), 3);
        assert!(members(&s, &gw).is_empty(), "a deleted network is not kept");
    }

    #[test]
    fn only_a_granted_gateway_already_in_an_overlay_keeps_it_by_its_sessions() {
        let mut s = world();
        s.vms.retain(|v| v.node.as_deref() == Some("n2"));
        // n1 hosts nothing now and is no gateway: sessions it reports do not
        // make (or keep) it a member, whatever it says.
        let mut n1 = s.nodes[0].clone();
        n1.sessions.insert("ov".into(), 5);
        assert!(members(&s, &n1).is_empty(), "a hypervisor reported its way in");
        // A gateway reporting sessions on an overlay it holds no lease on.
        let mut gw = s.nodes[2].clone();
        s.vms.clear();
        s.node_leases.retain(|l| l.node != "gw");
        gw.sessions.insert("ov".into(), 1);
        assert!(
            members(&s, &gw).is_empty(),
            "not a member before: no membership from sessions"
        );
    }

    #[test]
    fn a_drain_is_held_at_most_max_drain() {
        let mut s = world();
        s.vms.clear();
        let mut gw = s.nodes[2].clone();
        gw.sessions.insert("ov".into(), 1);
        let now = OffsetDateTime::now_utc();
        let since = drain_since(&s, &gw, now);
        assert_eq!(since.get("ov"), Some(&now), "the drain begins now");
        gw.draining_since = since.clone();
        assert_eq!(
            drain_since(&s, &gw, now + Duration::hours(1)),
            since,
            "and keeps its start"
        );
        let max = Duration::hours(2);
        assert_eq!(
            memberships(&s, &gw, &since, now + Duration::hours(1), max),
            BTreeSet::from(["ov".to_string()])
        );
        assert!(
            memberships(&s, &gw, &since, now + Duration::hours(3), max).is_empty(),
            "withdrawn after max_drain even with sessions open"
        );
    }

    #[test]
    fn fdb_points_remote_macs_at_their_vtep_and_never_at_ourselves() {
        let d = desired_state(&world(), "n1", 1450);
        assert_eq!(
            d.cluster_id, "c0ffee",
            "gateways check credentials' iss against it"
        );
        let ov = &d.overlays[0];
        assert_eq!(ov.address.to_string(), "10.100.0.4/24");
        assert_eq!(ov.mac.to_string(), "02:00:00:00:01:01");
        let fdb: BTreeSet<(String, String)> = ov
            .fdb
            .iter()
            .map(|e| (e.mac.to_string(), e.vtep.to_string()))
            .collect();
        assert!(
            fdb.contains(&("02:00:00:00:00:0b".into(), "10.0.0.12".into())),
            "remote guest"
        );
        assert!(
            fdb.contains(&("02:00:00:00:01:03".into(), "10.0.0.13".into())),
            "gateway's lease"
        );
        assert!(
            !fdb.iter().any(|(_, v)| v == "10.0.0.11"),
            "no entry to our own VTEP"
        );
        assert!(
            ov.neighbors.iter().any(|n| n.ip.to_string() == "10.100.0.2"),
            "local guests too"
        );
        assert_eq!(d.guests.len(), 1);
        assert_eq!(d.guests[0].address.to_string(), "10.100.0.2/24");
        assert_eq!(d.guests[0].gateway.to_string(), "10.100.0.1");
    }

    #[test]
    fn every_member_shares_one_section_and_sees_it_less_its_own_entries() {
        let s = world();
        let m = model(&s);
        let net = &s.networks[0].name;
        let section = section(&m, net).expect("an overlay");
        for node in ["n1", "n2", "gw"] {
            let d = desired_state(&s, node, 1450);
            let ov = d.overlays.iter().find(|o| o.network == *net).expect("a member");
            let vtep = node_vtep(&m, node);
            // The section holds this member's own entries; its view does not.
            assert!(section.fdb.iter().any(|e| Some(e.vtep) == vtep), "{node}");
            assert!(ov.fdb.iter().all(|e| Some(e.vtep) != vtep), "{node}");
            assert!(!ov.neighbors.iter().any(|e| e.ip == ov.address.addr()), "{node}");
            let (fdb, neighbors) = section.view(vtep, ov);
            assert_eq!((&fdb, &neighbors), (&ov.fdb, &ov.neighbors), "{node}");
            assert_eq!(
                fdb.len() + neighbors.len() + 1,
                section.len() - section.fdb.iter().filter(|e| Some(e.vtep) == vtep).count(),
                "{node}: only its own entries are left out"
            );
        }
        // A diff and its reverse undo each other.
        let mut moved = s.clone();
        moved.vms[1].node = Some("n1".into());
        let after = super::section(&model(&moved), net).unwrap();
        let d = section.diff(&after);
        assert!(!d.is_empty());
        assert_eq!(d.fdb_added.len(), d.fdb_removed.len(), "one FDB entry repointed");
        assert!(d.neighbors_added.is_empty() && d.neighbors_removed.is_empty());
        assert_ne!(section.hash(), after.hash());
        assert_eq!(section.hash(), super::section(&m, net).unwrap().hash());
    }

    #[test]
    fn version_changes_exactly_when_content_does() {
        let s = world();
        let a = desired_state(&s, "gw", 1450);
        assert_eq!(a.version, desired_state(&s, "gw", 1450).version);
        let mut moved = s.clone();
        moved.vms[1].node = Some("n1".into());
        assert_ne!(a.version, desired_state(&moved, "gw", 1450).version);
    }

    #[test]
    fn revocations_go_to_gateways_only_and_change_their_version() {
        let mut s = world();
        let (gw, host) = (desired_state(&s, "gw", 1450), desired_state(&s, "n1", 1450));
        s.revocations.push(otherix_proto::agent::Revocation {
            principal: "grant:acme".into(),
            token: None,
            vm_id: None,
            port: None,
            session: None,
            before: OffsetDateTime::now_utc(),
        });
        let revoked = desired_state(&s, "gw", 1450);
        assert_eq!(revoked.revocations, s.revocations);
        assert_ne!(revoked.version, gw.version, "the gateway is woken");
        let host_now = desired_state(&s, "n1", 1450);
        assert!(host_now.revocations.is_empty());
        assert_eq!(host_now.version, host.version, "a hypervisor is not");
    }

    fn bridged_world() -> Snapshot {
        let mut s = world();
        s.nodes.push(node("n3", "10.0.0.14", true, false, Some(1)));
        s.networks.push(bridge("lan", "10.102.0.0/24", &["n1", "n2"]));
        s.vms
            .push(vm("l", "lan", "10.102.0.2", "02:00:00:00:00:1a", Some("n1")));
        s
    }

    #[test]
    fn every_node_of_a_bridge_network_gets_its_own_bridge_and_no_other_node_does() {
        let s = bridged_world();
        for n in ["n1", "n2"] {
            let d = desired_state(&s, n, 1450);
            assert_eq!(d.bridges.len(), 1, "{n}");
            assert_eq!(
                d.bridges[0].address.to_string(),
                "10.102.0.1/24",
                "the same node-side address on {n}"
            );
        }
        assert!(desired_state(&s, "n3", 1450).bridges.is_empty());
        let guests = |n: &str| {
            desired_state(&s, n, 1450)
                .guests
                .iter()
                .filter(|g| g.network == "lan")
                .count()
        };
        assert_eq!(
            (guests("n1"), guests("n2")),
            (1, 0),
            "the guest only where it is placed"
        );
    }

    #[test]
    fn a_bridge_guest_is_handed_to_the_targets_own_bridge_once_it_is_ready() {
        let mut s = bridged_world();
        s.vms[2].migrate_to = Some("n2".into());
        s.nodes[1].netns = Some("ns-n2".into());
        let handover = |s: &Snapshot| {
            desired_state(s, "n1", 1450)
                .guests
                .into_iter()
                .find(|g| g.name == "l")
                .unwrap()
                .migrate_to
        };
        assert_eq!(handover(&s), None, "not before n2 reports the network realized");
        s.nodes[1].ready_overlays.insert("lan".into());
        let to = handover(&s).expect("hand over now");
        assert_eq!(
            (to.node.as_str(), to.netns.as_str(), to.bridge.as_str()),
            ("n2", "ns-n2", "oxl0123abcd")
        );
        // A target without the network never gets it (the API refuses that).
        s.vms[2].migrate_to = Some("n3".into());
        s.nodes[3].netns = Some("ns-n3".into());
        s.nodes[3].ready_overlays.insert("lan".into());
        assert_eq!(handover(&s), None);
    }

    #[test]
    fn addresses_are_written_as_display_writes_them() {
        for a in [0u8, 1, 9, 10, 11, 99, 100, 101, 199, 200, 249, 250, 255] {
            for b in [0u8, 7, 42, 255] {
                let ip = std::net::Ipv4Addr::new(a, b, a.wrapping_add(b), 255 - a);
                let mut out = Vec::new();
                write_ipv4(&mut out, ip);
                assert_eq!(String::from_utf8(out).unwrap(), ip.to_string());
            }
        }
    }
}
