//! The read model itself, pure: every object the broker, authentication,
//! the relay and desired-state computation read, with the indexes that
//! keep each of their questions from growing with the cluster. Objects come
//! in whole (re-read by key after a change); each `set_*` replaces one and
//! says which nodes' desired states it may have changed ([`Touched`]).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use otherix_core::selector::Selector;
use otherix_proto::agent::Revocation;
use otherix_proto::{NetworkType, User, Vm};
use otherix_store::{
    GrantRecord, LbRecord, NodeCertRecord, NodeLease, NodeRecord, TokenRecord, VerdictRecord,
};

use crate::authorize::Rule;

/// Everything a full load reads, as rows.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub nodes: Vec<NodeRecord>,
    pub networks: Vec<otherix_proto::Network>,
    pub vms: Vec<Vm>,
    pub node_leases: Vec<NodeLease>,
    pub lbs: Vec<LbRecord>,
    pub verdicts: Vec<VerdictRecord>,
    pub revocations: Vec<Revocation>,
    pub users: Vec<User>,
    pub tokens: Vec<TokenRecord>,
    pub grants: Vec<GrantRecord>,
    pub certs: Vec<NodeCertRecord>,
    /// Open sessions by principal and carrier (see `Model::open_sessions`).
    pub open_sessions: Vec<(String, String, u64)>,
}

/// Whose desired state a change may have changed: the nodes whose own
/// part it may have changed, and the overlays whose shared section (FDB and
/// neighbor entries, `catalog::states`) it may have — whose members follow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Touched {
    /// Nodes whose own part may have changed in any way, to recompute whole.
    pub nodes: BTreeSet<String>,
    /// Nodes whose own part's head (everything but its guests and health
    /// checks: roles, keys, bridges, overlays, forwards) may have changed;
    /// guests that may have changed with it are in `own_guests`.
    pub heads: BTreeSet<String>,
    /// Node → the VMs whose guest or health checks in its own part may
    /// have changed, and nothing else of it: only those are looked at again.
    pub own_guests: BTreeMap<String, BTreeSet<String>>,
    /// Node → the VMs whose health checks alone in its own part may have
    /// changed (a load balancer's pool): like `own_guests`, but nothing the
    /// node must act on at once — a backend with no verdict yet is served —
    /// so the node is woken at the lower rate and otherwise takes them at
    /// its next heartbeat (see [`super::states::Due`]).
    pub health: BTreeMap<String, BTreeSet<String>>,
    /// Every gateway (its coverage, keys or revocations changed).
    pub gateways: bool,
    /// Overlays (names) whose entries may have changed, to recompute whole.
    pub sections: BTreeSet<String>,
    /// Overlay → the guests (VM ids) whose entries there may have changed:
    /// only those are looked at again.
    pub guests: BTreeMap<String, BTreeSet<String>>,
    /// Overlay → the members whose lease's entries there may have changed
    /// (the lease itself, or the member's VTEP): only those are looked at
    /// again.
    pub leases: BTreeMap<String, BTreeSet<String>>,
}

/// Whether two versions of a VM are in the same place: what overlay
/// sections (its node's VTEP, its address and MAC) and the gateways'
/// coverage (an overlay with placed VMs) are made of.
fn same_place(a: &Vm, b: &Vm) -> bool {
    a.network == b.network
        && a.node == b.node
        && a.migrate_to == b.migrate_to
        && a.ip == b.ip
        && a.mac == b.mac
}

impl Touched {
    fn node(&mut self, n: Option<&str>) {
        if let Some(n) = n {
            self.nodes.insert(n.to_string());
        }
    }

    /// VM `id`'s part of node `n`'s own part.
    fn guest(&mut self, n: Option<&str>, id: &str) {
        if let Some(n) = n {
            self.own_guests
                .entry(n.to_string())
                .or_default()
                .insert(id.to_string());
        }
    }

    /// VM `id`'s health checks in node `n`'s own part (see `health`).
    fn health(&mut self, n: Option<&str>, id: &str) {
        if let Some(n) = n {
            self.health
                .entry(n.to_string())
                .or_default()
                .insert(id.to_string());
        }
    }

    pub fn merge(&mut self, other: Touched) {
        self.nodes.extend(other.nodes);
        self.heads.extend(other.heads);
        for (n, ids) in other.own_guests {
            self.own_guests.entry(n).or_default().extend(ids);
        }
        for (n, ids) in other.health {
            self.health.entry(n).or_default().extend(ids);
        }
        self.gateways |= other.gateways;
        self.sections.extend(other.sections);
        for (net, ids) in other.guests {
            self.guests.entry(net).or_default().extend(ids);
        }
        for (net, nodes) in other.leases {
            self.leases.entry(net).or_default().extend(nodes);
        }
    }

    /// Member `node`'s lease entries in overlay `net`.
    fn lease(&mut self, net: &str, node: &str) {
        self.leases
            .entry(net.to_string())
            .or_default()
            .insert(node.to_string());
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
            && self.heads.is_empty()
            && self.own_guests.is_empty()
            && self.health.is_empty()
            && !self.gateways
            && self.sections.is_empty()
            && self.guests.is_empty()
            && self.leases.is_empty()
    }
}

/// A user with its compiled rules.
#[derive(Debug, Clone)]
pub struct UserEntry {
    pub user: User,
    pub rules: Vec<Rule>,
}

/// A load balancer with its selector compiled and its pool kept.
#[derive(Debug, Clone)]
pub struct LbEntry {
    pub record: LbRecord,
    /// `None` for a selector that no longer parses: an empty pool.
    pub selector: Option<Selector>,
    /// VM ids the selector matches.
    pub pool: Pool,
}

/// A set of VM ids that can also be drawn from by position: insert, remove
/// and the `i`th member in O(1), so the broker draws backends at random
/// without listing the pool (`lb::draw`). Positions change on removal.
///
/// Members are also grouped by their labels (a pool usually holds a few
/// kinds of VM): who may reach a backend depends on its labels only, so the
/// broker finds what an asker's rules reach by checking each group once,
/// not each member.
#[derive(Debug, Clone, Default)]
pub struct Pool {
    ids: Vec<String>,
    /// Position and labels of each member.
    at: HashMap<String, (usize, otherix_core::Labels)>,
    groups: HashMap<otherix_core::Labels, BTreeSet<String>>,
}

impl Pool {
    pub fn insert(&mut self, id: String, labels: &otherix_core::Labels) -> bool {
        if self.at.contains_key(&id) {
            return false;
        }
        self.groups.entry(labels.clone()).or_default().insert(id.clone());
        self.at.insert(id.clone(), (self.ids.len(), labels.clone()));
        self.ids.push(id);
        true
    }

    pub fn remove(&mut self, id: &str) -> bool {
        let Some((i, labels)) = self.at.remove(id) else {
            return false;
        };
        if let Some(g) = self.groups.get_mut(&labels) {
            g.remove(id);
            if g.is_empty() {
                self.groups.remove(&labels);
            }
        }
        self.ids.swap_remove(i);
        if let Some(moved) = self.ids.get(i) {
            if let Some(entry) = self.at.get_mut(moved) {
                entry.0 = i;
            }
        }
        true
    }

    /// Members by their labels.
    pub fn groups(&self) -> impl Iterator<Item = (&otherix_core::Labels, &BTreeSet<String>)> {
        self.groups.iter()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.at.contains_key(id)
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The member at position `i` (below [`len`](Self::len)).
    pub fn get(&self, i: usize) -> Option<&str> {
        self.ids.get(i).map(String::as_str)
    }

    pub fn iter(&self) -> impl Iterator<Item = &String> {
        self.ids.iter()
    }
}

impl PartialEq for Pool {
    /// As sets of members with their labels: positions do not count.
    fn eq(&self, other: &Pool) -> bool {
        self.len() == other.len()
            && self
                .at
                .iter()
                .all(|(id, (_, labels))| other.at.get(id).is_some_and(|(_, l)| l == labels))
    }
}

impl Eq for Pool {}

impl LbEntry {
    fn matches(&self, vm: &Vm) -> bool {
        self.selector.as_ref().is_some_and(|s| s.matches(&vm.labels))
    }
}

/// The read model.
#[derive(Debug, Clone, Default)]
pub struct Model {
    vms: HashMap<String, Vm>,
    /// VM ids by name, in name order (`vm list` pages walk a range of it).
    vm_ids: BTreeMap<String, String>,
    /// The same, hashed: a name's lookup on every broker call is one probe,
    /// not a dozen string comparisons down the tree (each a cache miss).
    vm_ids_hashed: HashMap<String, String>,
    /// Network → its VMs' ids.
    vms_by_network: HashMap<String, BTreeSet<String>>,
    /// Node → ids of the VMs placed on it or migrating to it.
    vms_by_node: HashMap<String, BTreeSet<String>>,
    /// Node → network → how many of the VMs placed on it or migrating to
    /// it ([`hosts`]; placed somewhere: a VM that is neither is on no node)
    /// are on that network: the overlays its guests keep it in
    /// ([`Model::guest_networks`]), read at each heartbeat without a walk
    /// of its guests.
    nets_by_node: HashMap<String, BTreeMap<String, usize>>,
    /// Node → ids of the VMs migrating from it or to it: what a
    /// heartbeat's migration bookkeeping reads ([`Model::migrations_at`]).
    migrating_by_node: HashMap<String, BTreeSet<String>>,
    /// Node → how many VMs are placed on it (the scheduler's load).
    placed: HashMap<String, usize>,
    /// Every node as (its load, its name): the scheduler takes the first
    /// that can host a guest, not a walk of every node per create.
    by_load: BTreeSet<(usize, String)>,
    /// Network → how many of its VMs are placed: the gateways cover an
    /// overlay while it has one (a count, not a walk of its VMs).
    placed_by_network: HashMap<String, usize>,
    /// Label key → value → ids of the VMs carrying it: an LB edit matches
    /// only the VMs its selector's `key=value` or `key in (...)` admits.
    by_label: HashMap<String, HashMap<String, BTreeSet<String>>>,
    unplaced: BTreeSet<String>,
    networks: BTreeMap<String, otherix_proto::Network>,
    nodes: BTreeMap<String, NodeRecord>,
    /// Names of the nodes granted the gateway role: a handful, where
    /// `nodes` may be thousands.
    gateway_names: BTreeSet<String>,
    /// (network, node) → the node's lease there.
    leases: BTreeMap<(String, String), NodeLease>,
    leases_by_node: HashMap<String, BTreeSet<String>>,
    /// Network → its membership's stamp ([`Model::member_stamp`]).
    member_stamps: HashMap<String, u64>,
    /// Network → its last few membership changes, oldest first
    /// ([`Model::members_since`]).
    member_changes: HashMap<String, std::collections::VecDeque<MemberChange>>,
    /// Certificate fingerprint → what it was issued as.
    certs: HashMap<String, NodeCertRecord>,
    certs_by_node: HashMap<String, BTreeSet<String>>,
    lbs: BTreeMap<String, LbEntry>,
    /// Label key → value → the LBs whose selector requires it (their first
    /// `key=value` or `key in (...)`): a VM's create or edit matches only
    /// the LBs its labels can admit, not every LB.
    lbs_by_label: HashMap<String, HashMap<String, BTreeSet<String>>>,
    /// LBs whose selector requires no label value (`app!=x`, `app`): every
    /// VM is matched against them.
    lbs_any: BTreeSet<String>,
    /// LB → the label it is indexed under (`None`: in `lbs_any`).
    lb_anchors: HashMap<String, Option<(String, Vec<String>)>>,
    /// VM id → the LBs whose pool holds it.
    lbs_by_vm: HashMap<String, BTreeSet<String>>,
    /// LB → VM id → verdict: looked up by `&str`, without building a key.
    verdicts: HashMap<String, HashMap<String, Held>>,
    /// Node → the latest time it vouched for its verdicts (a heartbeat
    /// with `health_changes_only`): one write per heartbeat, whatever the
    /// node hosts. A reader sees a verdict's probe time as the later of
    /// its own and this, when the vouch came after the verdict became one
    /// the node vouches for ([`Held::since`]).
    vouched: HashMap<String, time::OffsetDateTime>,
    /// VM id → the LBs holding a verdict on it (a VM deleted drops its
    /// verdicts without a walk of every LB).
    verdict_lbs: HashMap<String, BTreeSet<String>>,
    users: HashMap<String, UserEntry>,
    tokens: HashMap<String, TokenRecord>,
    tokens_by_user: HashMap<String, BTreeSet<String>>,
    grants: HashMap<String, GrantRecord>,
    revocations: Vec<Revocation>,
    /// Open sessions by principal, then by carrier (a gateway node, or
    /// `otherix_store::RELAY_CARRIER`).
    open_sessions: HashMap<String, Vec<(String, u64)>>,
    /// Soft state: VM id → the node it was just handed over from, which
    /// forwards frames still arriving for it until then (see
    /// `desired::forwards`). Not in the store: it lasts seconds, and a
    /// CP that restarts or another replica that never saw the move only
    /// ends the forwarding early.
    moved: HashMap<String, Moved>,
}

/// A verdict as the catalog holds it.
#[derive(Debug, Clone)]
struct Held {
    record: VerdictRecord,
    /// While its node vouches for it — its VM placed on or migrating to
    /// `record.node`, and in the LB's pool —, that node's vouch as of when
    /// it began to: only a later vouch moves its probe time. `None` while
    /// its node does not vouch for it. Whenever that may change (the VM,
    /// the LB or the verdict set anew), the probe time a vouch moved is
    /// written into the record first ([`Model::settle_verdicts_of_vm`]).
    since: Option<time::OffsetDateTime>,
}

/// A verdict as its readers see it (`lb::health_of`, `lb get`'s
/// `last_probe`): the record, and its probe time moved forward by the
/// vouches of its node that came after it.
#[derive(Debug, Clone, Copy)]
pub struct Verdict<'m> {
    pub record: &'m VerdictRecord,
    pub probed_at: time::OffsetDateTime,
}

impl<'m> Verdict<'m> {
    /// A verdict no vouch moved: a row from the store.
    pub fn of_row(record: &'m VerdictRecord) -> Verdict<'m> {
        Verdict {
            record,
            probed_at: record.probed_at,
        }
    }
}

/// The vouch time before any vouch (a real one is later).
const NEVER_VOUCHED: time::OffsetDateTime = time::OffsetDateTime::UNIX_EPOCH;

/// A guest just handed over from `from` (see `Model::moved`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    pub from: String,
    /// When the forwarding ends at the latest.
    pub until: time::OffsetDateTime,
}

impl Model {
    /// The model of a full load.
    pub fn build(s: Snapshot) -> Model {
        let mut m = Model::default();
        for n in s.nodes {
            m.set_node(&n.name.clone(), Some(n));
        }
        for n in s.networks {
            m.set_network(&n.name.clone(), Some(n));
        }
        for l in s.node_leases {
            m.set_node_lease(&l.network.clone(), &l.node.clone(), Some(l));
        }
        for lb in s.lbs {
            m.set_lb(&lb.name.clone(), Some(lb));
        }
        for vm in s.vms {
            m.set_vm(&vm.id.clone(), Some(vm));
        }
        for v in s.verdicts {
            m.set_verdict(&v.lb.clone(), &v.vm_id.clone(), Some(v));
        }
        let mut tokens: HashMap<String, Vec<TokenRecord>> = HashMap::new();
        for t in s.tokens {
            tokens.entry(t.user.clone()).or_default().push(t);
        }
        for u in s.users {
            let t = tokens.remove(&u.name).unwrap_or_default();
            m.set_user(&u.name.clone(), Some((u, t)));
        }
        for g in s.grants {
            m.set_grant(&g.id.clone(), Some(g));
        }
        let mut certs: HashMap<String, Vec<NodeCertRecord>> = HashMap::new();
        for c in s.certs {
            certs.entry(c.node.clone()).or_default().push(c);
        }
        for (node, c) in certs {
            m.set_node_certs(&node, c);
        }
        m.set_revocations(s.revocations);
        let mut open: HashMap<String, Vec<(String, u64)>> = HashMap::new();
        for (p, carrier, n) in s.open_sessions {
            open.entry(p).or_default().push((carrier, n));
        }
        for (p, counts) in open {
            m.set_open_sessions(&p, counts);
        }
        m
    }

    // ------------------------------------------------------------ VMs

    /// Replaces (or, with `None`, removes) VM `id`.
    pub fn set_vm(&mut self, id: &str, vm: Option<Vm>) -> Touched {
        let mut t = Touched::default();
        // Where it is and which pools hold it decide whose vouches count.
        self.settle_verdicts_of_vm(id);
        // A node forwarding for it: whether it still does depends on the VM.
        if let Some(m) = self.moved.get(id) {
            t.nodes.insert(m.from.clone());
        }
        // Whether the gateways' coverage changes (an overlay gains its
        // first placed VM or loses its last): only then are they touched.
        let covered_before: Vec<(String, bool)> = [
            self.vms.get(id).map(|v| &v.network),
            vm.as_ref().map(|v| &v.network),
        ]
        .into_iter()
        .flatten()
        .map(|net| (net.clone(), self.has_placed_vms(net)))
        .collect();
        let old = self.vms.remove(id);
        if let Some(old) = &old {
            self.vm_ids.remove(&old.name);
            self.vm_ids_hashed.remove(&old.name);
            for (k, v) in &old.labels {
                if let Some(values) = self.by_label.get_mut(k) {
                    if let Some(ids) = values.get_mut(v) {
                        ids.remove(id);
                        if ids.is_empty() {
                            values.remove(v);
                        }
                    }
                    if values.is_empty() {
                        self.by_label.remove(k);
                    }
                }
            }
            if let Some(s) = self.vms_by_network.get_mut(&old.network) {
                s.remove(id);
            }
            for n in hosts(old) {
                if let Some(s) = self.vms_by_node.get_mut(n) {
                    s.remove(id);
                }
                if old.migrate_to.is_some() {
                    if let Some(s) = self.migrating_by_node.get_mut(n) {
                        s.remove(id);
                        if s.is_empty() {
                            self.migrating_by_node.remove(n);
                        }
                    }
                }
                if let Some(nets) = self.nets_by_node.get_mut(n).filter(|_| old.node.is_some()) {
                    if let Some(count) = nets.get_mut(&old.network) {
                        *count -= 1;
                        if *count == 0 {
                            nets.remove(&old.network);
                        }
                    }
                    if nets.is_empty() {
                        self.nets_by_node.remove(n);
                    }
                }
            }
            self.unplaced.remove(id);
            if let Some(n) = old.node.as_deref() {
                self.count_placed(n, &old.network, false);
            }
        }
        let old_lbs = self.lbs_by_vm.remove(id).unwrap_or_default();
        for lb in &old_lbs {
            if let Some(e) = self.lbs.get_mut(lb) {
                e.pool.remove(id);
            }
        }
        let Some(vm) = vm else {
            // The LBs with a verdict on it, not every LB.
            for lb in self.verdict_lbs.remove(id).unwrap_or_default() {
                if let Some(of_lb) = self.verdicts.get_mut(&lb) {
                    of_lb.remove(id);
                    if of_lb.is_empty() {
                        self.verdicts.remove(&lb);
                    }
                }
            }
            if let Some(old) = &old {
                self.touch_vm(&mut t, old);
            }
            self.touch_coverage(&mut t, &covered_before);
            return t;
        };
        self.vm_ids.insert(vm.name.clone(), id.to_string());
        self.vm_ids_hashed.insert(vm.name.clone(), id.to_string());
        for (k, v) in &vm.labels {
            self.by_label
                .entry(k.clone())
                .or_default()
                .entry(v.clone())
                .or_default()
                .insert(id.to_string());
        }
        self.vms_by_network
            .entry(vm.network.clone())
            .or_default()
            .insert(id.to_string());
        for n in hosts(&vm) {
            self.vms_by_node
                .entry(n.to_string())
                .or_default()
                .insert(id.to_string());
            if vm.migrate_to.is_some() {
                self.migrating_by_node
                    .entry(n.to_string())
                    .or_default()
                    .insert(id.to_string());
            }
            if vm.node.is_some() {
                *self
                    .nets_by_node
                    .entry(n.to_string())
                    .or_default()
                    .entry(vm.network.clone())
                    .or_default() += 1;
            }
        }
        match vm.node.as_deref() {
            Some(n) => self.count_placed(n, &vm.network, true),
            None => {
                self.unplaced.insert(id.to_string());
            }
        }
        // A relabel costs one match per LB its labels can admit.
        let mut lbs = BTreeSet::new();
        for name in self.lbs_admitting(&vm.labels) {
            if let Some(e) = self.lbs.get_mut(&name) {
                if e.matches(&vm) {
                    e.pool.insert(id.to_string(), &vm.labels);
                    lbs.insert(name);
                }
            }
        }
        if !lbs.is_empty() {
            self.lbs_by_vm.insert(id.to_string(), lbs);
        }
        match &old {
            // Its state, labels or reason changed, not where it is: its
            // part of its nodes' own parts, not its overlay's entries nor
            // the gateways' coverage (a guest reported running changes no section).
            Some(old) if same_place(old, &vm) => {
                t.guest(vm.node.as_deref(), id);
                t.guest(vm.migrate_to.as_deref(), id);
            }
            Some(old) => {
                self.touch_vm(&mut t, old);
                self.touch_vm(&mut t, &vm);
            }
            None => self.touch_vm(&mut t, &vm),
        }
        self.vms.insert(id.to_string(), vm);
        self.rebase_verdicts_of_vm(id);
        self.touch_coverage(&mut t, &covered_before);
        t
    }

    /// One guest more (`add`) or less on `node`, in `network`: the
    /// scheduler's load and the network's placed count.
    fn count_placed(&mut self, node: &str, network: &str, add: bool) {
        let before = self.placed.get(node).copied().unwrap_or(0);
        let after = if add { before + 1 } else { before.saturating_sub(1) };
        if after == 0 {
            self.placed.remove(node);
        } else {
            self.placed.insert(node.to_string(), after);
        }
        if self.nodes.contains_key(node) && before != after {
            self.by_load.remove(&(before, node.to_string()));
            self.by_load.insert((after, node.to_string()));
        }
        let count = self.placed_by_network.entry(network.to_string()).or_default();
        *count = if add { *count + 1 } else { count.saturating_sub(1) };
        if *count == 0 {
            self.placed_by_network.remove(network);
        }
    }

    /// Every gateway, when an overlay's coverage changed from `before`
    /// (whether each network had a placed VM): they join or leave it
    /// ([`crate::desired::memberships`]).
    fn touch_coverage(&self, t: &mut Touched, before: &[(String, bool)]) {
        let overlay = |net: &str| {
            self.networks
                .get(net)
                .is_some_and(|n| n.kind == NetworkType::Overlay)
        };
        if before
            .iter()
            .any(|(net, was)| *was != self.has_placed_vms(net) && overlay(net))
        {
            t.gateways = true;
        }
    }

    /// The desired states that name `vm`: its part of the own parts of
    /// where it runs or goes, and its overlay's section (every member
    /// routes to it). The gateways only when their coverage changes
    /// ([`Model::touch_coverage`]): a guest placed where others already
    /// are reaches them through the section.
    fn touch_vm(&self, t: &mut Touched, vm: &Vm) {
        t.guest(vm.node.as_deref(), &vm.id);
        t.guest(vm.migrate_to.as_deref(), &vm.id);
        if self
            .networks
            .get(&vm.network)
            .is_some_and(|n| n.kind == NetworkType::Overlay)
        {
            t.guests
                .entry(vm.network.clone())
                .or_default()
                .insert(vm.id.clone());
        }
    }

    pub fn vm(&self, id: &str) -> Option<&Vm> {
        self.vms.get(id)
    }

    pub fn vm_by_name(&self, name: &str) -> Option<&Vm> {
        self.vms.get(self.vm_ids_hashed.get(name)?)
    }

    /// VMs in name order after `after` (all when `None`) that `keep`
    /// accepts, at most `limit`: a walk of the names from `after` until
    /// `limit` are kept, not of the whole table.
    pub fn vms_page<'a>(
        &'a self,
        after: Option<&str>,
        limit: usize,
        mut keep: impl FnMut(&Vm) -> bool,
    ) -> Vec<&'a Vm> {
        use std::ops::Bound;
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.vm_ids
            .range::<str, _>((from, Bound::Unbounded))
            .filter_map(|(_, id)| self.vms.get(id))
            .filter(|vm| keep(vm))
            .take(limit)
            .collect()
    }

    /// Every VM, by name.
    pub fn vms(&self) -> Vec<&Vm> {
        let mut all: Vec<&Vm> = self.vms.values().collect();
        all.sort_by(|a, b| a.name.cmp(&b.name));
        all
    }

    pub fn vm_count(&self) -> usize {
        self.vms.len()
    }

    /// The VMs an index of ids holds under `key`.
    fn vms_in<'a>(
        &'a self,
        index: &'a HashMap<String, BTreeSet<String>>,
        key: &str,
    ) -> impl Iterator<Item = &'a Vm> + 'a {
        index
            .get(key)
            .into_iter()
            .flatten()
            .filter_map(|id| self.vms.get(id))
    }

    /// The VMs of a network.
    pub fn vms_on_network<'a>(&'a self, network: &str) -> impl Iterator<Item = &'a Vm> + 'a {
        self.vms_in(&self.vms_by_network, network)
    }

    /// The VMs placed on `node` or migrating to it.
    pub fn vms_on_node<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a Vm> + 'a {
        self.vms_in(&self.vms_by_node, node)
    }

    /// The networks of the VMs placed on `node` or migrating to it, in
    /// name order, each once (kept: a lookup, not a walk of its guests).
    pub fn guest_networks<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a str> + 'a {
        self.nets_by_node
            .get(node)
            .into_iter()
            .flat_map(|nets| nets.keys().map(String::as_str))
    }

    /// The VMs migrating from `node` or to it, by id (kept: not a walk of
    /// its guests).
    pub fn migrations_at<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a Vm> + 'a {
        self.vms_in(&self.migrating_by_node, node)
    }

    /// VMs not placed on any node yet.
    pub fn unplaced(&self) -> impl Iterator<Item = &Vm> {
        self.unplaced.iter().filter_map(|id| self.vms.get(id))
    }

    /// The guests placed on `node` (kept: a node list costs the nodes, not
    /// their VMs).
    pub fn guests_on(&self, node: &str) -> usize {
        self.placed.get(node).copied().unwrap_or(0)
    }

    /// Guests per node (kept: what the scheduler reads per heartbeat costs
    /// the nodes, not the VMs).
    pub fn load(&self) -> BTreeMap<String, usize> {
        self.placed.iter().map(|(n, c)| (n.clone(), *c)).collect()
    }

    /// The nodes that may host a guest of `net`, fewest guests first (ties
    /// by name), with their guests: for an overlay every node from the
    /// kept order (the scheduler stops at the first that can take it), for
    /// a bridge network its own nodes. Not a copy of every node's count.
    pub fn hosts_by_load<'a>(
        &'a self,
        net: &'a otherix_proto::Network,
    ) -> Box<dyn Iterator<Item = (usize, &'a NodeRecord)> + 'a> {
        if net.kind == NetworkType::Overlay {
            return Box::new(
                self.by_load
                    .iter()
                    .filter_map(|(load, n)| Some((*load, self.nodes.get(n)?))),
            );
        }
        let mut own: Vec<(usize, &NodeRecord)> = net
            .nodes
            .iter()
            .filter_map(|n| self.nodes.get(n))
            .map(|n| (self.placed.get(&n.name).copied().unwrap_or(0), n))
            .collect();
        own.sort_by(|a, b| (a.0, &a.1.name).cmp(&(b.0, &b.1.name)));
        own.dedup_by(|a, b| a.1.name == b.1.name);
        Box::new(own.into_iter())
    }

    // ------------------------------------------------------------ networks

    pub fn set_network(&mut self, name: &str, network: Option<otherix_proto::Network>) -> Touched {
        let mut t = Touched::default();
        for net in self.networks.get(name).into_iter().chain(network.as_ref()) {
            t.nodes.extend(net.nodes.iter().cloned());
            if net.kind == NetworkType::Overlay {
                t.gateways = true;
            }
        }
        t.nodes.extend(self.members(name).map(str::to_string));
        t.sections.insert(name.to_string());
        for vm in self.vms_on_network(name) {
            t.node(vm.node.as_deref());
        }
        match network {
            Some(n) => {
                self.networks.insert(name.to_string(), n);
            }
            None => {
                self.networks.remove(name);
            }
        }
        t
    }

    /// A network, with its VM count.
    pub fn network(&self, name: &str) -> Option<otherix_proto::Network> {
        let mut n = self.networks.get(name)?.clone();
        n.vms = self.vms_by_network.get(name).map_or(0, |s| s.len() as u32);
        Some(n)
    }

    /// Every network, by name, with VM counts.
    pub fn networks(&self) -> Vec<otherix_proto::Network> {
        self.networks.keys().filter_map(|n| self.network(n)).collect()
    }

    pub fn network_ref(&self, name: &str) -> Option<&otherix_proto::Network> {
        self.networks.get(name)
    }

    pub fn network_refs(&self) -> impl Iterator<Item = &otherix_proto::Network> {
        self.networks.values()
    }

    /// Whether an overlay has a VM placed on some node (gateways cover it).
    pub fn has_placed_vms(&self, network: &str) -> bool {
        self.placed_by_network.get(network).is_some_and(|c| *c > 0)
    }

    // ------------------------------------------------------------ nodes

    /// Replaces node `name`, keeping the soft state the process holds
    /// ([`Model::heartbeat`]) when it is newer than the store's.
    pub fn set_node(&mut self, name: &str, node: Option<NodeRecord>) -> Touched {
        let mut t = Touched::default();
        let old = self.nodes.get(name);
        // Its own part holds its roles and (through its view of the
        // sections) its VTEP: a heartbeat written every few seconds
        // (liveness, sessions, realized networks) leaves it alone.
        let head = |n: &NodeRecord| (n.hypervisor, n.gateway.clone(), n.relay.clone(), n.vtep.clone());
        if old.zip(node.as_ref()).is_none_or(|(a, b)| head(a) != head(b)) {
            t.nodes.insert(name.to_string());
        }
        // Sections hold only its VTEP.
        let vtep = |n: Option<&NodeRecord>| n.map(|n| n.vtep.clone());
        let vtep_moved = vtep(old) != vtep(node.as_ref()) || node.is_none();
        if vtep_moved {
            // Its VTEP is in every fellow member's FDB: its lease's entries
            // (only those: a section costs what changed in it, so a
            // thousand nodes starting do not recompute every overlay a
            // thousand times).
            for net in self.leases_by_node.get(name).into_iter().flatten() {
                t.lease(net, name);
            }
        }
        // Its namespace, realized networks and VTEP are in the handover of
        // every guest migrating to it, which its source's desired state
        // carries; its VTEP is in the FDB entries of the guests it hosts.
        let target = |n: &NodeRecord| (n.netns.clone(), n.ready_overlays.clone(), n.vtep.clone());
        let handover_same = old
            .zip(node.as_ref())
            .is_some_and(|(a, b)| target(a) == target(b));
        for vm in self.vms_on_node(name) {
            if vm.node.as_deref() == Some(name) {
                if vtep_moved {
                    // Its guests' FDB entries point at its VTEP.
                    t.guests
                        .entry(vm.network.clone())
                        .or_default()
                        .insert(vm.id.clone());
                }
            } else if !handover_same {
                t.guest(vm.node.as_deref(), &vm.id);
            }
        }
        let old = self.nodes.remove(name);
        self.gateway_names.remove(name);
        let load = self.placed.get(name).copied().unwrap_or(0);
        match (&old, &node) {
            (None, Some(_)) => {
                self.by_load.insert((load, name.to_string()));
            }
            (Some(_), None) => {
                self.by_load.remove(&(load, name.to_string()));
            }
            _ => {}
        }
        if let Some(mut n) = node {
            if n.gateway.is_some() {
                self.gateway_names.insert(name.to_string());
            }
            if let Some(old) = old {
                if old.last_heartbeat > n.last_heartbeat {
                    n.last_heartbeat = old.last_heartbeat;
                    n.agent_version = old.agent_version;
                    n.applied_version = old.applied_version;
                }
            }
            self.nodes.insert(name.to_string(), n);
        } else {
            for fp in self.certs_by_node.remove(name).unwrap_or_default() {
                self.certs.remove(&fp);
            }
        }
        t
    }

    /// What a heartbeat refreshes and the change log does not carry.
    pub fn heartbeat(
        &mut self,
        name: &str,
        at: time::OffsetDateTime,
        agent_version: &str,
        applied_version: Option<u64>,
    ) {
        if let Some(n) = self.nodes.get_mut(name) {
            n.last_heartbeat = Some(at);
            n.agent_version = Some(agent_version.to_string());
            n.applied_version = applied_version;
        }
    }

    /// VM `id` was just handed over from `from`, which forwards frames
    /// still arriving for it until `until` at the latest (soft state). A
    /// node that forwarded it before stops.
    pub fn set_moved(&mut self, id: &str, from: &str, until: time::OffsetDateTime) -> Touched {
        let mut t = Touched::default();
        let next = Moved {
            from: from.to_string(),
            until,
        };
        if let Some(old) = self.moved.insert(id.to_string(), next) {
            t.nodes.insert(old.from);
        }
        t.nodes.insert(from.to_string());
        t
    }

    /// Ends the forwarding for VM `id` (soft state).
    pub fn end_moved(&mut self, id: &str) -> Touched {
        let mut t = Touched::default();
        if let Some(old) = self.moved.remove(id) {
            t.nodes.insert(old.from);
            // A handover back to that node waited for it (`desired::handover`).
            if let Some(vm) = self.vms.get(id) {
                t.guest(vm.node.as_deref(), id);
            }
        }
        t
    }

    /// Where VM `id` was just handed over from, while that node forwards
    /// for it (soft state).
    pub fn moved(&self, id: &str) -> Option<&Moved> {
        self.moved.get(id)
    }

    /// The VMs whose forwarding (from any node) is past its time at `now`.
    pub fn moved_expired(&self, now: time::OffsetDateTime) -> Vec<String> {
        self.moved
            .iter()
            .filter(|(_, m)| m.until <= now)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// The VMs just handed over from `node`, by id, sorted.
    pub fn moved_from<'a>(&'a self, node: &'a str) -> impl Iterator<Item = (&'a String, &'a Moved)> + 'a {
        let mut v: Vec<_> = self.moved.iter().filter(move |(_, m)| m.from == node).collect();
        v.sort_by(|a, b| a.0.cmp(b.0));
        v.into_iter()
    }

    pub fn node(&self, name: &str) -> Option<&NodeRecord> {
        self.nodes.get(name)
    }

    /// Every node, by name.
    /// How many nodes there are.
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    pub fn nodes(&self) -> impl Iterator<Item = &NodeRecord> {
        self.nodes.values()
    }

    /// Nodes granted the gateway role.
    pub fn gateways(&self) -> impl Iterator<Item = &NodeRecord> {
        self.gateway_names.iter().filter_map(|n| self.nodes.get(n))
    }

    /// Gateways that are members of `network` (hold a lease there): what the
    /// broker picks from for every credential, so it costs the gateways, not
    /// the overlay's members.
    pub fn gateways_on<'a>(&'a self, network: &'a str) -> impl Iterator<Item = &'a NodeRecord> + 'a {
        self.gateways().filter(move |n| {
            self.leases_by_node
                .get(&n.name)
                .is_some_and(|nets| nets.contains(network))
        })
    }

    pub fn set_node_certs(&mut self, node: &str, certs: Vec<NodeCertRecord>) {
        for fp in self.certs_by_node.remove(node).unwrap_or_default() {
            self.certs.remove(&fp);
        }
        let fps: BTreeSet<String> = certs.iter().map(|c| c.fingerprint.clone()).collect();
        for c in certs {
            self.certs.insert(c.fingerprint.clone(), c);
        }
        if !fps.is_empty() {
            self.certs_by_node.insert(node.to_string(), fps);
        }
    }

    /// The certificate with this fingerprint, if the CP issued it and has
    /// not revoked it.
    pub fn cert(&self, fingerprint: &str) -> Option<&NodeCertRecord> {
        self.certs.get(fingerprint)
    }

    /// The certificates issued to `node` and not revoked (expired ones
    /// too, until the store forgets them: callers check `not_after`).
    pub fn node_certs(&self, node: &str) -> impl Iterator<Item = &NodeCertRecord> {
        self.certs_by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|fp| self.certs.get(fp))
    }

    // ------------------------------------------------------------ leases

    pub fn set_node_lease(&mut self, network: &str, node: &str, lease: Option<NodeLease>) -> Touched {
        let mut t = Touched::default();
        let key = (network.to_string(), node.to_string());
        if lease.is_some() != self.leases.contains_key(&key) {
            let stamp = next_member_stamp();
            let before = self.member_stamps.insert(network.to_string(), stamp).unwrap_or(0);
            let log = self.member_changes.entry(network.to_string()).or_default();
            if log.len() == MEMBER_CHANGES {
                log.pop_front();
            }
            log.push_back(MemberChange {
                before,
                node: node.to_string(),
                member: lease.is_some(),
            });
        }
        match lease {
            Some(l) => {
                self.leases.insert(key, l);
                self.leases_by_node
                    .entry(node.to_string())
                    .or_default()
                    .insert(network.to_string());
            }
            None => {
                self.leases.remove(&key);
                if let Some(s) = self.leases_by_node.get_mut(node) {
                    s.remove(network);
                }
            }
        }
        // Its overlays (the head), and whether its guests there are plugged
        // in (a guest waits for its host's lease): not its other guests.
        t.heads.insert(node.to_string());
        for vm in self.vms_on_node(node).filter(|vm| vm.network == network) {
            t.guest(Some(node), &vm.id);
        }
        t.lease(network, node);
        t
    }

    /// A number that changes whenever `network` gains or loses a member,
    /// and that no other membership of any network had in this process (a
    /// model built again stamps anew): what is computed from the members
    /// (a set of them as bits) holds while the stamp does. 0: no member
    /// ever, in this model.
    pub fn member_stamp(&self, network: &str) -> u64 {
        self.member_stamps.get(network).copied().unwrap_or(0)
    }

    /// The changes of `network`'s members from stamp `since` to its
    /// stamp now, oldest first: `(node, whether it is a member after)`.
    /// `None` when the few kept no longer reach back to `since` (walk
    /// [`Model::members`] instead). A set of members kept as of a stamp
    /// follows a node joining with a change, not a walk of a thousand.
    pub fn members_since(
        &self,
        network: &str,
        since: u64,
    ) -> Option<impl Iterator<Item = (&str, bool)> + '_> {
        let now = self.member_stamp(network);
        let log = self.member_changes.get(network);
        let from = if since == now {
            log.map_or(0, |l| l.len())
        } else {
            log?.iter().position(|c| c.before == since)?
        };
        Some(
            log.into_iter()
                .flat_map(move |l| l.range(from..))
                .map(|c| (c.node.as_str(), c.member)),
        )
    }

    /// The nodes holding a lease on `network`: its members.
    pub fn members<'a>(&'a self, network: &str) -> impl Iterator<Item = &'a str> + 'a {
        let network = network.to_string();
        self.leases
            .range((network.clone(), String::new())..)
            .take_while(move |((n, _), _)| *n == network)
            .map(|((_, node), _)| node.as_str())
    }

    /// The leases on `network`.
    pub fn leases_on<'a>(&'a self, network: &str) -> impl Iterator<Item = &'a NodeLease> + 'a {
        let network = network.to_string();
        self.leases
            .range((network.clone(), String::new())..)
            .take_while(move |((n, _), _)| *n == network)
            .map(|(_, l)| l)
    }

    pub fn lease(&self, network: &str, node: &str) -> Option<&NodeLease> {
        self.leases.get(&(network.to_string(), node.to_string()))
    }

    /// The networks `node` holds a lease on, in name order (borrowed: a
    /// look through them, not a copy of every name).
    pub fn leased_network_names<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a str> + 'a {
        self.leases_by_node
            .get(node)
            .into_iter()
            .flat_map(|nets| nets.iter().map(String::as_str))
    }

    // ------------------------------------------------------------ LBs

    /// The LBs whose selector VMs labelled `labels` may match: those
    /// indexed under one of the labels, and those indexed under none.
    fn lbs_admitting(&self, labels: &otherix_core::Labels) -> BTreeSet<String> {
        let mut names = self.lbs_any.clone();
        for (k, v) in labels {
            if let Some(lbs) = self.lbs_by_label.get(k).and_then(|by_value| by_value.get(v)) {
                names.extend(lbs.iter().cloned());
            }
        }
        names
    }

    /// The label an LB is indexed under ([`Model::lbs_by_label`]): of its
    /// selector's `key=value` and `key in (...)`, the one admitting the
    /// fewest VMs now (`app=a7`, not `tier=web`); `None` when it has
    /// neither (it is matched against every VM).
    fn lb_anchor(&self, selector: &Selector) -> Option<(String, Vec<String>)> {
        use otherix_core::selector::Requirement;
        let admits = |key: &str, v: &str| {
            self.by_label
                .get(key)
                .and_then(|by_value| by_value.get(v))
                .map_or(0, BTreeSet::len)
        };
        selector
            .requirements()
            .iter()
            .filter_map(|r| match r {
                Requirement::Equals { key, value } => Some((key.clone(), vec![value.clone()])),
                Requirement::In { key, values } => Some((key.clone(), values.iter().cloned().collect())),
                _ => None,
            })
            .min_by_key(|(key, values)| values.iter().map(|v| admits(key, v)).sum::<usize>())
    }

    fn index_lb(&mut self, name: &str, selector: Option<&Selector>) {
        // A selector that does not parse matches nothing: not indexed.
        let Some(selector) = selector else { return };
        let anchor = self.lb_anchor(selector);
        match &anchor {
            Some((key, values)) => {
                for v in values {
                    self.lbs_by_label
                        .entry(key.clone())
                        .or_default()
                        .entry(v.clone())
                        .or_default()
                        .insert(name.to_string());
                }
            }
            None => {
                self.lbs_any.insert(name.to_string());
            }
        }
        self.lb_anchors.insert(name.to_string(), anchor);
    }

    fn unindex_lb(&mut self, name: &str) {
        match self.lb_anchors.remove(name) {
            Some(Some((key, values))) => {
                if let Some(by_value) = self.lbs_by_label.get_mut(&key) {
                    for v in &values {
                        if let Some(lbs) = by_value.get_mut(v) {
                            lbs.remove(name);
                            if lbs.is_empty() {
                                by_value.remove(v);
                            }
                        }
                    }
                    if by_value.is_empty() {
                        self.lbs_by_label.remove(&key);
                    }
                }
            }
            Some(None) => {
                self.lbs_any.remove(name);
            }
            None => {}
        }
    }

    /// Replaces LB `name`. An edit re-matches every VM once.
    pub fn set_lb(&mut self, name: &str, lb: Option<LbRecord>) -> Touched {
        let mut t = Touched::default();
        // Its pool decides whose vouches count for its verdicts.
        let judged: Vec<String> = self
            .verdicts
            .get(name)
            .into_iter()
            .flatten()
            .map(|(id, _)| id.clone())
            .collect();
        for id in &judged {
            self.settle_verdict(name, id);
        }
        if let Some(old) = self.lbs.remove(name) {
            self.unindex_lb(name);
            for id in old.pool.iter() {
                if let Some(s) = self.lbs_by_vm.get_mut(id) {
                    s.remove(name);
                }
                t.health(self.vms.get(id).and_then(|vm| vm.node.as_deref()), id);
            }
        }
        let Some(record) = lb else {
            for id in self.verdicts.remove(name).unwrap_or_default().keys() {
                self.forget_verdict_lb(id, name);
            }
            return t;
        };
        let selector = record.selector.parse::<Selector>().ok();
        let mut entry = LbEntry {
            record,
            selector,
            pool: Pool::default(),
        };
        let matched: Vec<String> = match self.candidates(entry.selector.as_ref()) {
            Some(ids) => ids
                .into_iter()
                .filter(|id| self.vms.get(id.as_str()).is_some_and(|vm| entry.matches(vm)))
                .cloned()
                .collect(),
            None => self
                .vms
                .iter()
                .filter(|(_, vm)| entry.matches(vm))
                .map(|(id, _)| id.clone())
                .collect(),
        };
        self.index_lb(name, entry.selector.as_ref());
        for id in matched {
            let Some(vm) = self.vms.get(&id) else { continue };
            t.health(vm.node.as_deref(), &id);
            self.lbs_by_vm
                .entry(id.clone())
                .or_default()
                .insert(name.to_string());
            entry.pool.insert(id, &vm.labels);
        }
        self.lbs.insert(name.to_string(), entry);
        for id in &judged {
            self.rebase_verdict(name, id);
        }
        t
    }

    /// The VMs a selector can match at most, from the label index: the
    /// smallest set one of its `key=value` or `key in (...)` requirements
    /// admits. `None` when it has neither (every VM is a candidate).
    fn candidates(&self, selector: Option<&Selector>) -> Option<BTreeSet<&String>> {
        use otherix_core::selector::Requirement;
        let selector = selector?;
        // The VM sets a requirement admits, unmerged: sized before the
        // smallest is collected, so a requirement that admits every VM
        // (`tier=web`) costs a count, not a set of every VM.
        let admitted = |key: &str, values: &mut dyn Iterator<Item = &String>| -> Vec<&BTreeSet<String>> {
            let Some(by_value) = self.by_label.get(key) else {
                return Vec::new();
            };
            values.filter_map(|v| by_value.get(v)).collect()
        };
        let smallest = selector
            .requirements()
            .iter()
            .filter_map(|r| match r {
                Requirement::Equals { key, value } => Some(admitted(key, &mut std::iter::once(value))),
                Requirement::In { key, values } => Some(admitted(key, &mut values.iter())),
                _ => None,
            })
            .min_by_key(|sets| sets.iter().map(|s| s.len()).sum::<usize>())?;
        Some(smallest.into_iter().flatten().collect())
    }

    pub fn lb(&self, name: &str) -> Option<&LbEntry> {
        self.lbs.get(name)
    }

    /// Every LB, by name.
    pub fn lbs(&self) -> impl Iterator<Item = &LbEntry> {
        self.lbs.values()
    }

    /// The VMs in an LB's pool, by name.
    pub fn pool(&self, lb: &LbEntry) -> Vec<&Vm> {
        let mut vms: Vec<&Vm> = lb.pool.iter().filter_map(|id| self.vms.get(id)).collect();
        vms.sort_by(|a, b| a.name.cmp(&b.name));
        vms
    }

    /// The VMs in an LB's pool, by id: what the broker chooses among.
    pub fn backends(&self, lb: &LbEntry) -> Vec<&Vm> {
        lb.pool.iter().filter_map(|id| self.vms.get(id)).collect()
    }

    /// The backends of an LB whose labels `reach` accepts: each group of
    /// members with the same labels is checked once.
    pub fn backends_reaching(&self, lb: &LbEntry, reach: impl Fn(&otherix_core::Labels) -> bool) -> Vec<&Vm> {
        lb.pool
            .groups()
            .filter(|(labels, _)| reach(labels))
            .flat_map(|(_, ids)| ids.iter())
            .filter_map(|id| self.vms.get(id))
            .collect()
    }

    /// The VM at position `i` of an LB's pool ([`Pool::get`]).
    pub fn backend_at(&self, lb: &LbEntry, i: usize) -> Option<&Vm> {
        self.vms.get(lb.pool.get(i)?)
    }

    /// The LBs whose pool holds VM `id`.
    pub fn lbs_of(&self, id: &str) -> impl Iterator<Item = &LbEntry> {
        self.lbs_by_vm
            .get(id)
            .into_iter()
            .flatten()
            .filter_map(|n| self.lbs.get(n))
    }

    fn forget_verdict_lb(&mut self, vm_id: &str, lb: &str) {
        if let Some(lbs) = self.verdict_lbs.get_mut(vm_id) {
            lbs.remove(lb);
            if lbs.is_empty() {
                self.verdict_lbs.remove(vm_id);
            }
        }
    }

    pub fn set_verdict(&mut self, lb: &str, vm_id: &str, v: Option<VerdictRecord>) {
        match v {
            Some(record) => {
                self.verdicts
                    .entry(lb.to_string())
                    .or_default()
                    .insert(vm_id.to_string(), Held { record, since: None });
                self.verdict_lbs
                    .entry(vm_id.to_string())
                    .or_default()
                    .insert(lb.to_string());
                // Only its node's vouches from now on count.
                self.rebase_verdict(lb, vm_id);
            }
            None => {
                self.forget_verdict_lb(vm_id, lb);
                if let Some(of_lb) = self.verdicts.get_mut(lb) {
                    of_lb.remove(vm_id);
                    if of_lb.is_empty() {
                        self.verdicts.remove(lb);
                    }
                }
            }
        }
    }

    /// The verdict on `vm_id` in `lb`, its probe time moved by the vouches
    /// of its node since.
    pub fn verdict(&self, lb: &str, vm_id: &str) -> Option<Verdict<'_>> {
        let h = self.verdicts.get(lb)?.get(vm_id)?;
        Some(Verdict {
            record: &h.record,
            probed_at: self.probed_at(h),
        })
    }

    /// `h`'s probe time: its own, or its node's vouch when later and made
    /// while the node vouched for it.
    fn probed_at(&self, h: &Held) -> time::OffsetDateTime {
        match (h.since, self.vouched.get(&h.record.node)) {
            (Some(since), Some(&at)) if at > since => h.record.probed_at.max(at),
            _ => h.record.probed_at,
        }
    }

    /// A probe time a heartbeat refreshed (soft state).
    pub fn verdict_probed(
        &mut self,
        lb: &str,
        vm_id: &str,
        at: time::OffsetDateTime,
        successes: u32,
        failures: u32,
    ) {
        if let Some(h) = self.verdicts.get_mut(lb).and_then(|of_lb| of_lb.get_mut(vm_id)) {
            // A node's heartbeats come one after another: its counts are
            // the newest, even when a vouch (in the CP's time) already
            // moved the probe time past the probe they come from.
            h.record.successes = successes;
            h.record.failures = failures;
            if at > h.record.probed_at {
                h.record.probed_at = at;
            }
        }
    }

    /// `node` vouched, at `at`, for every verdict it reported and did not
    /// change (a heartbeat with `health_changes_only`): the probe time of
    /// each verdict it vouches for (its own, on a VM it hosts or receives,
    /// in the LB's pool) moves to `at`. One write, whatever the node
    /// holds: readers take the later of a verdict's probe time and this
    /// ([`Model::verdict`]). Vouches are kept as the latest: one earlier
    /// than the latest (a clock stepped back) moves nothing.
    pub fn vouch(&mut self, node: &str, at: time::OffsetDateTime) {
        match self.vouched.get_mut(node) {
            Some(latest) => {
                if at > *latest {
                    *latest = at;
                }
            }
            None => {
                self.vouched.insert(node.to_string(), at);
            }
        }
    }

    /// Whether `record.node` vouches for the verdict on `vm_id` in `lb`:
    /// the VM is on or migrating to it, and in the LB's pool.
    fn vouched_for(&self, lb: &str, vm_id: &str, node: &str) -> bool {
        let here = self
            .vms
            .get(vm_id)
            .is_some_and(|vm| vm.node.as_deref() == Some(node) || vm.migrate_to.as_deref() == Some(node));
        here && self.lbs_by_vm.get(vm_id).is_some_and(|lbs| lbs.contains(lb))
    }

    /// Writes into the verdict the probe time its node's vouches moved,
    /// before what decides whether the node vouches for it changes.
    fn settle_verdict(&mut self, lb: &str, vm_id: &str) {
        let Some(h) = self.verdicts.get(lb).and_then(|of_lb| of_lb.get(vm_id)) else {
            return;
        };
        let at = self.probed_at(h);
        if let Some(h) = self.verdicts.get_mut(lb).and_then(|of_lb| of_lb.get_mut(vm_id)) {
            h.record.probed_at = at;
            h.since = None;
        }
    }

    /// After such a change: whether, and from which vouch on, its node
    /// vouches for it now.
    fn rebase_verdict(&mut self, lb: &str, vm_id: &str) {
        let Some(h) = self.verdicts.get(lb).and_then(|of_lb| of_lb.get(vm_id)) else {
            return;
        };
        let node = h.record.node.as_str();
        let since = self
            .vouched_for(lb, vm_id, node)
            .then(|| self.vouched.get(node).copied().unwrap_or(NEVER_VOUCHED));
        if let Some(h) = self.verdicts.get_mut(lb).and_then(|of_lb| of_lb.get_mut(vm_id)) {
            h.since = since;
        }
    }

    /// [`Model::settle_verdict`] for every verdict on VM `id` (usually none).
    fn settle_verdicts_of_vm(&mut self, id: &str) {
        let Some(lbs) = self.verdict_lbs.get(id) else {
            return;
        };
        for lb in lbs.clone() {
            self.settle_verdict(&lb, id);
        }
    }

    /// [`Model::rebase_verdict`] for every verdict on VM `id`.
    fn rebase_verdicts_of_vm(&mut self, id: &str) {
        let Some(lbs) = self.verdict_lbs.get(id) else {
            return;
        };
        for lb in lbs.clone() {
            self.rebase_verdict(&lb, id);
        }
    }

    // ------------------------------------------------------------ who

    /// Replaces user `name` with its tokens.
    pub fn set_user(&mut self, name: &str, user: Option<(User, Vec<TokenRecord>)>) {
        for id in self.tokens_by_user.remove(name).unwrap_or_default() {
            self.tokens.remove(&id);
        }
        self.users.remove(name);
        let Some((user, tokens)) = user else { return };
        let ids: BTreeSet<String> = tokens.iter().map(|t| t.id.clone()).collect();
        for t in tokens {
            self.tokens.insert(t.id.clone(), t);
        }
        self.tokens_by_user.insert(name.to_string(), ids);
        let rules = user.rules.iter().filter_map(Rule::compile).collect();
        self.users.insert(name.to_string(), UserEntry { user, rules });
    }

    pub fn user(&self, name: &str) -> Option<&UserEntry> {
        self.users.get(name)
    }

    pub fn token(&self, id: &str) -> Option<&TokenRecord> {
        self.tokens.get(id)
    }

    /// A token's last use, as this process recorded it (soft state).
    pub fn token_used(&mut self, id: &str, at: time::OffsetDateTime) {
        if let Some(t) = self.tokens.get_mut(id) {
            t.last_used_at = Some(at);
        }
    }

    pub fn set_grant(&mut self, id: &str, grant: Option<GrantRecord>) {
        match grant {
            Some(g) => {
                self.grants.insert(id.to_string(), g);
            }
            None => {
                self.grants.remove(id);
            }
        }
    }

    pub fn grant(&self, id: &str) -> Option<&GrantRecord> {
        self.grants.get(id)
    }

    pub fn set_revocations(&mut self, revocations: Vec<Revocation>) -> Touched {
        self.revocations = revocations;
        Touched {
            gateways: true,
            ..Default::default()
        }
    }

    /// Revocations in force (the store keeps only unexpired ones).
    pub fn revocations(&self) -> &[Revocation] {
        &self.revocations
    }

    /// `principal`'s open sessions by carrier.
    pub fn set_open_sessions(&mut self, principal: &str, mut counts: Vec<(String, u64)>) {
        counts.retain(|(_, n)| *n > 0);
        if counts.is_empty() {
            self.open_sessions.remove(principal);
        } else {
            self.open_sessions.insert(principal.to_string(), counts);
        }
    }

    /// The sessions `principal` has open through `carrier`: a gateway node's
    /// name, or `otherix_store::RELAY_CARRIER` for the relay. The broker's
    /// cap counts per carrier: what a gateway reports counts only against
    /// itself.
    pub fn open_sessions(&self, principal: &str, carrier: &str) -> u64 {
        self.open_sessions
            .get(principal)
            .and_then(|c| c.iter().find(|(k, _)| k == carrier))
            .map_or(0, |(_, n)| *n)
    }
}

/// Membership changes a network keeps ([`Model::members_since`]): a burst
/// of nodes joining (a thousand starting at once) between two uses of a
/// set of members is walked again instead.
const MEMBER_CHANGES: usize = 64;

/// One change of a network's members: `node` joined (`member`) or left,
/// moving its stamp on from `before` (to the next change's `before`, or
/// the stamp now).
#[derive(Debug, Clone)]
struct MemberChange {
    before: u64,
    node: String,
    member: bool,
}

/// The next membership stamp ([`Model::member_stamp`]): from 1, never
/// given twice in this process.
fn next_member_stamp() -> u64 {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The nodes a VM is on, each once: the one it is placed on and the one it
/// is migrating to (a guest is plugged in at both until its handover).
fn hosts(vm: &Vm) -> impl Iterator<Item = &str> {
    let node = vm.node.as_deref();
    let to = vm.migrate_to.as_deref().filter(|to| Some(*to) != node);
    node.into_iter().chain(to)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use otherix_proto::agent::DesiredState;
    use otherix_proto::{Network, ProbeKind, VmState};
    use proptest::prelude::*;
    use time::OffsetDateTime;

    use super::*;
    use crate::catalog::states::{Reply, States, Whole};
    use crate::desired::{desired_state, node_vtep, own_part, section, Common};

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    const NODES: [&str; 4] = ["n1", "n2", "n3", "gw"];
    const NETS: [&str; 3] = ["ov1", "ov2", "lan"];

    fn node(name: &str, vtep: u8) -> NodeRecord {
        NodeRecord {
            hypervisor: name != "gw",
            gateway: (name == "gw").then(|| "10.0.0.9:8443".to_string()),
            vtep: Some(format!("10.0.0.{vtep}")),
            last_heartbeat: Some(now()),
            ..NodeRecord::new(name, now())
        }
    }

    fn network(i: usize) -> Network {
        let name = NETS[i];
        let bridge = name == "lan";
        Network {
            name: name.into(),
            id: format!("0123456{i}{name}"),
            kind: if bridge {
                NetworkType::Bridge
            } else {
                NetworkType::Overlay
            },
            subnet: format!("10.10{i}.0.0/24").parse().unwrap(),
            vni: (!bridge).then_some(100 + i as u32),
            node: bridge.then(|| "n1".into()),
            nodes: if bridge {
                vec!["n1".into(), "n2".into()]
            } else {
                vec![]
            },
            node_address: format!("10.10{i}.0.1").parse().unwrap(),
            vms: 0,
            created_at: now(),
        }
    }

    fn lb(i: usize, selector: &str) -> LbRecord {
        LbRecord {
            name: format!("lb{i}"),
            port: 80,
            selector: selector.into(),
            health_kind: ProbeKind::Tcp,
            health_path: None,
            health_port: None,
            interval_ms: 1000,
            timeout_ms: 500,
            rise: 1,
            fall: 1,
            created_at: now(),
        }
    }

    /// One write, as the store would make it (the follower re-reads the
    /// object it names).
    #[derive(Debug, Clone)]
    enum Op {
        /// Create or replace VM `i` on network `net`, labelled, maybe placed and migrating.
        PutVm {
            i: u8,
            net: usize,
            app: u8,
            node: Option<usize>,
            to: Option<usize>,
        },
        DeleteVm {
            i: u8,
        },
        PutLease {
            net: usize,
            node: usize,
        },
        DeleteLease {
            net: usize,
            node: usize,
        },
        /// `form` picks the selector's shape: `=`, `in`, `!=`, exists, and `=` with `!key`.
        PutLb {
            i: u8,
            app: u8,
            form: u8,
        },
        DeleteLb {
            i: u8,
        },
        /// A node's VTEP or readiness for migrations changed.
        PutNode {
            node: usize,
            vtep: u8,
            ready: bool,
        },
    }

    impl Op {
        /// VM `i` (app `a{app}`) on the first network, on node `node` or
        /// unplaced, not migrating.
        fn vm(i: u8, app: u8, node: Option<usize>) -> Op {
            Op::PutVm {
                i,
                net: 0,
                app,
                node,
                to: None,
            }
        }
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..8, 0usize..3, 0u8..3, proptest::option::of(0usize..3), proptest::option::of(0usize..3))
                .prop_map(|(i, net, app, node, to)| Op::PutVm { i, net, app, node, to }),
            1 => (0u8..8).prop_map(|i| Op::DeleteVm { i }),
            2 => (0usize..2, 0usize..4).prop_map(|(net, node)| Op::PutLease { net, node }),
            1 => (0usize..2, 0usize..4).prop_map(|(net, node)| Op::DeleteLease { net, node }),
            1 => (0u8..3, 0u8..3, 0u8..5).prop_map(|(i, app, form)| Op::PutLb { i, app, form }),
            1 => (0u8..3).prop_map(|i| Op::DeleteLb { i }),
            1 => (0usize..4, 1u8..20, any::<bool>()).prop_map(|(node, vtep, ready)| Op::PutNode { node, vtep, ready }),
        ]
    }

    /// The rows, as the store holds them.
    #[derive(Debug, Clone, Default)]
    struct Rows {
        nodes: BTreeMap<String, NodeRecord>,
        networks: BTreeMap<String, Network>,
        vms: BTreeMap<String, Vm>,
        leases: BTreeMap<(String, String), NodeLease>,
        lbs: BTreeMap<String, LbRecord>,
    }

    impl Rows {
        fn snapshot(&self) -> Snapshot {
            Snapshot {
                nodes: self.nodes.values().cloned().collect(),
                networks: self.networks.values().cloned().collect(),
                vms: self.vms.values().cloned().collect(),
                node_leases: self.leases.values().cloned().collect(),
                lbs: self.lbs.values().cloned().collect(),
                ..Default::default()
            }
        }

        /// Applies `op` to the rows and to `m` as the follower would.
        fn apply(&mut self, m: &mut Model, op: &Op) -> Touched {
            match op {
                Op::PutVm {
                    i,
                    net,
                    app,
                    node,
                    to,
                } => {
                    let id = format!("vm{i}");
                    let node = node.map(|n| NODES[n].to_string());
                    let to = to
                        .map(|n| NODES[n].to_string())
                        .filter(|t| node.is_some() && Some(t) != node.as_ref());
                    let vm = Vm {
                        migration_id: Default::default(),
                        migration_port: Default::default(),
                        accelerator: None,
                        machine: None,
                        runtime: Default::default(),
                        name: format!("name{i}"),
                        id: id.clone(),
                        network: NETS[*net].into(),
                        node,
                        labels: BTreeMap::from([("app".to_string(), format!("a{app}"))]),
                        // VMs 0 and 6, 1 and 7 share a MAC: an entry two
                        // guests give stays while either does.
                        mac: format!("02:00:00:00:00:{:02x}", i % 6 + 16).parse().unwrap(),
                        ip: format!("10.10{net}.0.{}", i + 10).parse().unwrap(),
                        state: if to.is_some() {
                            VmState::Migrating
                        } else {
                            VmState::Running
                        },
                        reason: None,
                        exec: None,
                        migrate_to: to,
                        created_at: now(),
                    };
                    self.vms.insert(id.clone(), vm.clone());
                    m.set_vm(&id, Some(vm))
                }
                Op::DeleteVm { i } => {
                    let id = format!("vm{i}");
                    self.vms.remove(&id);
                    m.set_vm(&id, None)
                }
                Op::PutLease { net, node } => {
                    let (n, nd) = (NETS[*net].to_string(), NODES[*node].to_string());
                    let l = NodeLease {
                        network: n.clone(),
                        node: nd.clone(),
                        ip: format!("10.10{net}.0.{}", 200 + node).parse().unwrap(),
                        mac: format!("02:00:00:00:01:{:02x}", net * 4 + node).parse().unwrap(),
                    };
                    self.leases.insert((n.clone(), nd.clone()), l.clone());
                    m.set_node_lease(&n, &nd, Some(l))
                }
                Op::DeleteLease { net, node } => {
                    let (n, nd) = (NETS[*net].to_string(), NODES[*node].to_string());
                    self.leases.remove(&(n.clone(), nd.clone()));
                    m.set_node_lease(&n, &nd, None)
                }
                Op::PutLb { i, app, form } => {
                    let selector = match form {
                        0 => format!("app=a{app}"),
                        1 => format!("app in (a{app},a{})", (app + 1) % 3),
                        2 => format!("app!=a{app}"),
                        3 => "app".to_string(),
                        _ => format!("app=a{app},!tier"),
                    };
                    let lb = lb(*i as usize, &selector);
                    self.lbs.insert(lb.name.clone(), lb.clone());
                    m.set_lb(&lb.name.clone(), Some(lb))
                }
                Op::DeleteLb { i } => {
                    let name = format!("lb{i}");
                    self.lbs.remove(&name);
                    m.set_lb(&name, None)
                }
                Op::PutNode { node, vtep, ready } => {
                    let mut n = node_of(NODES[*node], *vtep);
                    if *ready {
                        n.netns = Some(format!("ns-{}", n.name));
                        n.ready_overlays = NETS.iter().map(|s| s.to_string()).collect();
                    }
                    self.nodes.insert(n.name.clone(), n.clone());
                    m.set_node(&n.name.clone(), Some(n))
                }
            }
        }
    }

    fn node_of(name: &str, vtep: u8) -> NodeRecord {
        node(name, vtep)
    }

    fn world() -> Rows {
        let mut r = Rows::default();
        for (i, n) in NODES.iter().enumerate() {
            r.nodes.insert(n.to_string(), node(n, 10 + i as u8));
        }
        for i in 0..NETS.len() {
            let n = network(i);
            r.networks.insert(n.name.clone(), n);
        }
        r
    }

    const COMMON: Common<'static> = Common {
        migration_secret: None,
        mtu: 1450,
        session_keys: &[],
        cluster_id: "c",
    };

    fn all_desired(m: &Model) -> BTreeMap<String, DesiredState> {
        NODES
            .iter()
            .map(|n| (n.to_string(), desired_state(m, &COMMON, n)))
            .collect()
    }

    /// Every node's own part and VTEP (what decides its view of the sections).
    fn all_own(m: &Model) -> BTreeMap<String, (DesiredState, Option<std::net::Ipv4Addr>)> {
        NODES
            .iter()
            .map(|n| {
                let own = (own_part(m, &COMMON, n), crate::desired::node_vtep(m, n));
                (n.to_string(), own)
            })
            .collect()
    }

    /// The overlays with a placed VM, walked (what the kept counts answer):
    /// the gateways' coverage.
    fn covered(m: &Model) -> BTreeSet<String> {
        let walked: BTreeSet<String> = NETS
            .iter()
            .filter(|n| m.vms_on_network(n).any(|vm| vm.node.is_some()))
            .map(|n| n.to_string())
            .collect();
        let kept: BTreeSet<String> = NETS
            .iter()
            .filter(|n| m.has_placed_vms(n))
            .map(|n| n.to_string())
            .collect();
        assert_eq!(walked, kept, "the kept counts are the placed VMs");
        kept.into_iter().filter(|n| *n != "lan").collect()
    }

    #[test]
    fn the_gateways_are_touched_only_when_an_overlay_gains_its_first_placed_guest_or_loses_its_last() {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        let put = |i: u8, node: Option<usize>| Op::vm(i, 0, node);
        let gateways = |rows: &mut Rows, m: &mut Model, op: Op| rows.apply(m, &op).gateways;
        assert!(
            !gateways(&mut rows, &mut m, put(0, None)),
            "unplaced: no coverage yet"
        );
        assert!(
            gateways(&mut rows, &mut m, put(0, Some(0))),
            "the first placed guest"
        );
        assert!(!gateways(&mut rows, &mut m, put(1, Some(1))), "a second one");
        assert!(
            !gateways(&mut rows, &mut m, put(1, Some(2))),
            "moved, still covered"
        );
        assert!(!gateways(&mut rows, &mut m, put(0, Some(0))), "written again");
        assert!(!gateways(&mut rows, &mut m, Op::DeleteVm { i: 1 }), "one left");
        assert!(
            gateways(&mut rows, &mut m, Op::DeleteVm { i: 0 }),
            "the last one gone"
        );
        // A bridge network is nobody's coverage.
        let lan = Op::PutVm {
            i: 2,
            net: 2,
            app: 0,
            node: Some(0),
            to: None,
        };
        assert!(!gateways(&mut rows, &mut m, lan));
        assert!(m.has_placed_vms("lan") && !m.has_placed_vms("ov1"));
    }

    #[test]
    fn the_kept_order_of_loads_follows_nodes_added_and_removed_and_guests_placed() {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        let ov = network(0);
        let order = |m: &Model| -> Vec<(usize, String)> {
            m.hosts_by_load(&ov).map(|(l, n)| (l, n.name.clone())).collect()
        };
        let put = |i: u8, node: usize| Op::vm(i, 0, Some(node));
        let named = |v: &[(usize, &str)]| -> Vec<(usize, String)> {
            v.iter().map(|(l, n)| (*l, n.to_string())).collect()
        };
        rows.apply(&mut m, &put(0, 0));
        rows.apply(&mut m, &put(1, 0));
        assert_eq!(order(&m), named(&[(0, "gw"), (0, "n2"), (0, "n3"), (2, "n1")]));
        // A guest on a node not known yet counts once it is.
        m.set_node("n3", None);
        rows.apply(&mut m, &put(2, 2));
        assert_eq!(order(&m), named(&[(0, "gw"), (0, "n2"), (2, "n1")]));
        m.set_node("n3", Some(node("n3", 12)));
        assert_eq!(order(&m), named(&[(0, "gw"), (0, "n2"), (1, "n3"), (2, "n1")]));
        m.set_node("n3", Some(node("n3", 13)));
        assert_eq!(order(&m).len(), 4, "written again: once");
        m.set_node("n1", None);
        rows.apply(&mut m, &Op::DeleteVm { i: 2 });
        assert_eq!(order(&m), named(&[(0, "gw"), (0, "n2"), (0, "n3")]));
        // A bridge network's candidates are its own nodes, in the same order.
        let lan = network(2);
        let own: Vec<String> = m.hosts_by_load(&lan).map(|(_, n)| n.name.clone()).collect();
        assert_eq!(own, ["n2"], "n1 is gone, n3 has no bridge");
    }

    #[test]
    fn a_networks_membership_changes_are_told_since_a_stamp_while_kept() {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        let net = NETS[0];
        let at_start = m.member_stamp(net);
        let told = |m: &Model, since| {
            m.members_since(net, since)
                .map(|c| c.map(|(n, member)| (n.to_string(), member)).collect::<Vec<_>>())
        };
        assert_eq!(told(&m, at_start), Some(vec![]), "nothing since now");
        rows.apply(&mut m, &Op::PutLease { net: 0, node: 0 });
        let joined = m.member_stamp(net);
        assert_ne!(joined, at_start);
        rows.apply(&mut m, &Op::PutLease { net: 0, node: 1 });
        // A lease written again (a new address) is no change of members.
        rows.apply(&mut m, &Op::PutLease { net: 0, node: 1 });
        rows.apply(&mut m, &Op::DeleteLease { net: 0, node: 0 });
        let (n1, n2) = (NODES[0].to_string(), NODES[1].to_string());
        assert_eq!(
            told(&m, at_start),
            Some(vec![(n1.clone(), true), (n2.clone(), true), (n1.clone(), false)])
        );
        assert_eq!(told(&m, joined), Some(vec![(n2, true), (n1, false)]));
        assert_eq!(told(&m, u64::MAX), None, "a stamp it never had");
        // Another network's changes are its own.
        assert_eq!(
            m.members_since(NETS[1], m.member_stamp(NETS[1]))
                .map(|c| c.count()),
            Some(0)
        );
        // Past the changes kept, the caller walks the members instead.
        for _ in 0..MEMBER_CHANGES {
            rows.apply(&mut m, &Op::PutLease { net: 0, node: 2 });
            rows.apply(&mut m, &Op::DeleteLease { net: 0, node: 2 });
        }
        assert_eq!(told(&m, at_start), None);
        assert_eq!(told(&m, joined), None);
    }

    fn all_sections(m: &Model) -> BTreeMap<String, Option<crate::desired::Section>> {
        NETS.iter().map(|n| (n.to_string(), section(m, n))).collect()
    }

    #[test]
    fn a_vtep_change_reaches_the_members_that_route_to_its_guests() {
        // Found by the property below: n3 hosts a guest of ov1 without a
        // lease there yet; n1's FDB points the guest's MAC at n3's VTEP.
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        rows.apply(&mut m, &Op::PutLease { net: 0, node: 0 });
        rows.apply(
            &mut m,
            &Op::PutVm {
                i: 0,
                net: 0,
                app: 0,
                node: Some(2),
                to: None,
            },
        );
        let touched = rows.apply(
            &mut m,
            &Op::PutNode {
                node: 2,
                vtep: 1,
                ready: false,
            },
        );
        // Only the guest's entries, not the whole section.
        assert!(
            touched.guests.get("ov1").is_some_and(|ids| ids.contains("vm0")) && touched.sections.is_empty(),
            "{touched:?}"
        );
    }

    #[test]
    fn a_member_whose_vtep_moves_marks_its_leases_and_guests_not_whole_sections() {
        // A thousand nodes starting each learn their VTEP: each start must
        // cost that node's entries, not every overlay it is in recomputed.
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        rows.apply(&mut m, &Op::PutLease { net: 0, node: 1 });
        rows.apply(&mut m, &Op::PutLease { net: 1, node: 1 });
        let touched = rows.apply(
            &mut m,
            &Op::PutNode {
                node: 1,
                vtep: 7,
                ready: true,
            },
        );
        assert!(touched.sections.is_empty(), "{touched:?}");
        for net in NETS.iter().take(2) {
            assert!(
                touched.leases.get(*net).is_some_and(|n| n.contains(NODES[1])),
                "{net}: {touched:?}"
            );
        }
        let touched = rows.apply(&mut m, &Op::DeleteLease { net: 0, node: 1 });
        assert!(
            touched.sections.is_empty() && touched.leases.get(NETS[0]).is_some_and(|n| n.contains(NODES[1])),
            "{touched:?}"
        );
    }

    #[test]
    fn a_load_balancers_health_checks_wake_its_backends_hosts_at_the_lower_rate_and_reach_them_whole() {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        let mut states = States::default();
        for node in 0..3 {
            let t = rows.apply(&mut m, &Op::PutLease { net: 0, node });
            states.mark(&t);
        }
        let put = |i: u8, app: u8, node: usize| Op::vm(i, app, Some(node));
        // vm0 (app a0) on n1, vm1 (a1) on n2, vm2 (a0) on n3.
        for (i, app, node) in [(0, 0, 0), (1, 1, 1), (2, 0, 2)] {
            let t = rows.apply(&mut m, &put(i, app, node));
            states.mark(&t);
        }
        let before: BTreeMap<&str, u64> = NODES
            .iter()
            .map(|n| (*n, states.refresh(&m, &COMMON, n)))
            .collect();
        let due = states.due(&m);
        assert!(due.now.is_empty() && due.lazy.is_empty(), "{due:?}");

        // An LB over app=a0: its backends' hosts (n1, n3) only gain checks.
        let t = rows.apply(
            &mut m,
            &Op::PutLb {
                i: 0,
                app: 0,
                form: 0,
            },
        );
        assert!(
            t.own_guests.is_empty() && t.nodes.is_empty() && t.heads.is_empty(),
            "{t:?}"
        );
        assert_eq!(
            t.health.keys().map(String::as_str).collect::<Vec<_>>(),
            ["n1", "n3"],
            "{t:?}"
        );
        states.mark(&t);
        assert!(states.is_dirty(&m, "n1") && states.is_dirty(&m, "n3") && !states.is_dirty(&m, "n2"));
        let due = states.due(&m);
        assert!(due.now.is_empty(), "not woken at once: {due:?}");
        assert_eq!(due.lazy, ["n1", "n3"]);
        // In turn from where the last round stopped, as many as asked,
        // only those wanted (a node nobody waits for).
        assert_eq!(states.due_in_turn(&m, "n1", 9, |_| true).lazy, ["n3", "n1"]);
        assert_eq!(states.due_in_turn(&m, "n3", 9, |_| true).lazy, ["n1", "n3"]);
        assert_eq!(states.due_in_turn(&m, "n9", 9, |_| true).lazy, ["n1", "n3"]);
        assert_eq!(states.due_in_turn(&m, "n1", 1, |_| true).lazy, ["n3"]);
        assert_eq!(states.due_in_turn(&m, "n1", 1, |n| n != "n3").lazy, ["n1"]);
        assert!(states.due_in_turn(&m, "", 0, |_| true).lazy.is_empty());
        // Brought up to date as a whole computation would make it, checks included.
        for n in ["n1", "n3"] {
            assert_ne!(states.refresh(&m, &COMMON, n), before[n], "{n}");
            let state = states.reply(n, None, true).unwrap().state();
            assert_eq!(state, desired_state(&m, &COMMON, n), "{n}");
            assert_eq!(state.health_checks.len(), 1, "{n}: {state:?}");
            assert!(!states.is_dirty(&m, n), "{n}");
        }
        assert_eq!(states.refresh(&m, &COMMON, "n2"), before["n2"]);

        // A guest's own change on a host with checks pending is still woken at once,
        // and both reach it.
        let t = rows.apply(&mut m, &Op::DeleteLb { i: 0 });
        states.mark(&t);
        let t = rows.apply(&mut m, &put(2, 2, 2));
        states.mark(&t);
        let due = states.due(&m);
        assert_eq!(due.now, BTreeSet::from(["n3".to_string()]), "{due:?}");
        assert_eq!(due.lazy, ["n1"], "{due:?}");
        for n in NODES {
            states.refresh(&m, &COMMON, n);
            let state = states.reply(n, None, true).unwrap().state();
            assert_eq!(state, desired_state(&m, &COMMON, n), "{n}");
            assert!(state.health_checks.is_empty(), "{n}: {state:?}");
        }
    }

    #[test]
    fn a_deleted_nodes_state_is_forgotten_at_the_next_round_whether_the_change_log_or_a_whole_load_said_so() {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        let mut states = States::default();
        for n in NODES {
            states.refresh(&m, &COMMON, n);
        }
        // Through the change log: the deletion marks it.
        let t = m.set_node("n2", None);
        assert!(t.nodes.contains("n2"), "{t:?}");
        states.mark(&t);
        states.due(&m);
        assert_eq!(states.version("n2"), None);
        assert!(
            !states.due(&m).now.contains("n2"),
            "nothing is left to wake for it"
        );
        // A model loaded again whole marks nothing of what it no longer has.
        rows.nodes.remove("n2");
        rows.nodes.remove("n3");
        m = Model::build(rows.snapshot());
        states.due(&m);
        assert_eq!(states.version("n3"), None);
        for n in ["n1", "gw"] {
            assert!(states.version(n).is_some(), "{n} is kept");
        }
    }

    #[test]
    fn a_guest_created_reaches_its_overlays_members_as_two_entries_and_a_node_too_far_behind_gets_it_whole() {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        let mut states = States::default();
        for node in 0..4 {
            let t = rows.apply(&mut m, &Op::PutLease { net: 0, node });
            states.mark(&t);
        }
        let put = |i: u8, node: usize| Op::vm(i, 0, Some(node));
        for i in 0..4 {
            let t = rows.apply(&mut m, &put(i, i as usize % 3));
            states.mark(&t);
        }
        let v1 = states.refresh(&m, &COMMON, "n1");
        let held = states.reply("n1", None, true).unwrap().state();
        assert!(!states.reply("n1", None, true).unwrap().is_delta());

        // One more guest, on n2: n1 is answered with its two entries only.
        let t = rows.apply(&mut m, &put(4, 1));
        assert!(t.nodes.is_empty(), "no own part whole: {t:?}");
        assert_eq!(
            t.own_guests,
            BTreeMap::from([("n2".to_string(), BTreeSet::from(["vm4".to_string()]))]),
            "only the new guest of the host's own part"
        );
        states.mark(&t);
        assert_ne!(states.refresh(&m, &COMMON, "n1"), v1);
        let reply = states.reply("n1", Some(v1), true).unwrap();
        assert!(reply.is_delta());
        let answer = reply.state();
        let delta = answer.delta.as_ref().unwrap();
        assert!(delta.own.is_none(), "n1's own part did not change");
        assert_eq!(delta.overlays.len(), 1);
        let c = &delta.overlays[0];
        assert_eq!((c.fdb_added.len(), c.neighbors_added.len()), (1, 1), "{c:?}");
        assert!(c.fdb_removed.is_empty() && c.neighbors_removed.is_empty() && !c.whole);
        assert_eq!(held.apply(&answer).unwrap(), desired_state(&m, &COMMON, "n1"));
        let json = serde_json::to_string(&answer).unwrap();
        assert!(json.len() < 450, "{json}");

        // The host's own part changed (a new guest): the guest alone to an
        // agent that takes guest changes, the own part whole to one that does not.
        states.refresh(&m, &COMMON, "n2");
        let n2_held = states.reply("n2", None, true).unwrap().state();
        let v2 = n2_held.version;
        let t = rows.apply(&mut m, &put(5, 1));
        states.mark(&t);
        states.refresh(&m, &COMMON, "n2");
        let answer = states.reply("n2", Some(v2), true).unwrap().state();
        let delta = answer.delta.as_ref().unwrap();
        assert!(delta.own.is_none());
        assert_eq!(delta.guests.len(), 1, "{delta:?}");
        assert_eq!(delta.guests[0].vm_id, "vm5");
        assert!(delta.guests[0].guest.is_some());
        assert_eq!(n2_held.apply(&answer).unwrap(), desired_state(&m, &COMMON, "n2"));
        let older = states.reply("n2", Some(v2), false).unwrap().state();
        let delta = older.delta.as_ref().unwrap();
        assert!(delta.own.is_some() && delta.guests.is_empty());
        assert_eq!(n2_held.apply(&older).unwrap(), desired_state(&m, &COMMON, "n2"));
        let v2 = states.refresh(&m, &COMMON, "n2");
        let n2 = states.reply("n2", Some(v2), true).unwrap().state();
        assert!(
            n2.delta
                .as_ref()
                .is_some_and(|d| d.own.is_none() && d.overlays.is_empty() && d.guests.is_empty()),
            "current: nothing"
        );

        // More versions than a node keeps: n1's first one is forgotten.
        for i in 5..20 {
            let t = rows.apply(&mut m, &put(i % 8, (i as usize) % 3));
            states.mark(&t);
            states.refresh(&m, &COMMON, "n1");
        }
        let reply = states.reply("n1", Some(v1), true).unwrap();
        assert!(!reply.is_delta(), "the whole state for a version no longer known");
        assert_eq!(reply.state(), desired_state(&m, &COMMON, "n1"));
    }

    /// Four nodes on overlay 0 with a guest each; `n1`'s state refreshed
    /// and answered whole, as at its first heartbeat.
    fn four_nodes_on_one_overlay() -> (Rows, Model, States, DesiredState) {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        let mut states = States::default();
        for node in 0..4 {
            let t = rows.apply(&mut m, &Op::PutLease { net: 0, node });
            states.mark(&t);
            let t = rows.apply(&mut m, &guest_on(node as u8, node));
            states.mark(&t);
        }
        states.applied("n1", None);
        states.refresh(&m, &COMMON, "n1");
        let held = states.reply("n1", None, true).unwrap().state();
        assert_eq!(held, desired_state(&m, &COMMON, "n1"));
        (rows, m, states, held)
    }

    fn guest_on(i: u8, node: usize) -> Op {
        Op::PutVm {
            i,
            net: 0,
            app: 0,
            node: Some(node),
            to: None,
        }
    }

    /// `count` guests created on `n2` and `n3` from VM `from` on, `n1`
    /// refreshed after each (as the CP's wakes do between its heartbeats):
    /// a version of `n1`'s each, its own part unchanged.
    fn guests_elsewhere(rows: &mut Rows, m: &mut Model, states: &mut States, from: u8, count: u8) {
        let before = states.version("n1");
        for i in from..from + count {
            let t = rows.apply(m, &guest_on(i, 1 + i as usize % 2));
            states.mark(&t);
            let v = states.refresh(m, &COMMON, "n1");
            assert_ne!(Some(v), before);
        }
    }

    /// A heartbeat of `n1` that says it applied `applied`, as the catalog
    /// answers it.
    fn heartbeat_n1(m: &Model, states: &mut States, applied: Option<u64>) -> Reply {
        states.applied("n1", applied);
        states.refresh(m, &COMMON, "n1");
        states.reply("n1", applied, true).unwrap()
    }

    #[test]
    fn a_node_twenty_versions_behind_the_one_it_applied_gets_a_delta_against_it_that_adds_up_to_its_state() {
        let (mut rows, mut m, mut states, held) = four_nodes_on_one_overlay();
        let v = held.version;
        // It says it applied the version it was given; it is sent a newer
        // one that it does not get to apply (it says `v` again); then 24
        // versions.
        assert!(heartbeat_n1(&m, &mut states, Some(v)).is_delta());
        guests_elsewhere(&mut rows, &mut m, &mut states, 10, 2);
        let newer = heartbeat_n1(&m, &mut states, Some(v));
        assert!(newer.is_delta() && newer.version() != v);
        guests_elsewhere(&mut rows, &mut m, &mut states, 12, 24);

        let reply = heartbeat_n1(&m, &mut states, Some(v));
        assert!(reply.is_delta(), "a delta against the version applied, 24 behind");
        let answer = reply.state();
        let delta = answer.delta.as_ref().unwrap();
        assert_eq!(delta.base, v);
        assert!(
            delta.own.is_none() && delta.guests.is_empty(),
            "own part unchanged: {delta:?}"
        );
        // The section's log reaches back: the 24 guests' entries added.
        assert_eq!(delta.overlays.len(), 1);
        let c = &delta.overlays[0];
        assert!(!c.whole && c.fdb_removed.is_empty() && c.neighbors_removed.is_empty());
        assert_eq!(c.neighbors_added.len(), 26, "{c:?}");
        let whole = states.reply("n1", None, true).unwrap();
        assert!(!whole.is_delta());
        assert_eq!(held.apply(&answer).unwrap(), whole.state());
        assert_eq!(whole.state(), desired_state(&m, &COMMON, "n1"));
        assert!(reply.json().len() < whole.json().len());
    }

    #[test]
    fn a_node_answered_then_woken_twenty_times_before_it_says_it_applied_gets_a_delta() {
        let (mut rows, mut m, mut states, held) = four_nodes_on_one_overlay();
        // Answered at its first heartbeat; 24 versions before the next.
        guests_elsewhere(&mut rows, &mut m, &mut states, 10, 24);

        let reply = heartbeat_n1(&m, &mut states, Some(held.version));
        assert!(reply.is_delta(), "a delta against the version last sent");
        assert_eq!(
            held.apply(&reply.state()).unwrap(),
            desired_state(&m, &COMMON, "n1")
        );
    }

    #[test]
    fn the_version_applied_is_let_go_once_the_node_applies_a_newer_one() {
        let (mut rows, mut m, mut states, held) = four_nodes_on_one_overlay();
        let v1 = held.version;
        guests_elsewhere(&mut rows, &mut m, &mut states, 10, 12);
        let reply = heartbeat_n1(&m, &mut states, Some(v1));
        assert!(reply.is_delta());
        let next = held.apply(&reply.state()).unwrap();
        let v2 = next.version;
        assert_ne!(v1, v2);

        // It applied v2: v1 is no longer kept (v2 is).
        assert!(heartbeat_n1(&m, &mut states, Some(v2)).is_delta());
        guests_elsewhere(&mut rows, &mut m, &mut states, 30, 12);
        let reply = heartbeat_n1(&m, &mut states, Some(v1));
        assert_whole_n1(
            &m,
            &reply,
            Whole::UnknownBase,
            "the whole state against a version let go",
        );
        // Nor is v2 once the node says it holds the current version.
        let v3 = reply.version();
        heartbeat_n1(&m, &mut states, Some(v3));
        guests_elsewhere(&mut rows, &mut m, &mut states, 50, 12);
        let reply = heartbeat_n1(&m, &mut states, Some(v2));
        assert_whole_n1(&m, &reply, Whole::UnknownBase, "nor v2, once the node holds v3");
    }

    #[test]
    fn a_node_that_applied_nothing_gets_its_whole_state() {
        let (mut rows, mut m, mut states, held) = four_nodes_on_one_overlay();
        assert!(heartbeat_n1(&m, &mut states, Some(held.version)).is_delta());
        guests_elsewhere(&mut rows, &mut m, &mut states, 10, 12);
        // An agent started afresh: nothing applied.
        let reply = heartbeat_n1(&m, &mut states, None);
        assert_whole_n1(&m, &reply, Whole::NoBase, "nothing applied");
    }

    #[test]
    fn a_delta_no_smaller_than_the_whole_state_is_sent_as_the_whole_state() {
        let (mut rows, mut m, mut states, held) = four_nodes_on_one_overlay();
        let v = held.version;
        assert!(heartbeat_n1(&m, &mut states, Some(v)).is_delta());
        // n1's VTEP changes (its view of every section, so each goes whole)
        // and 20 of its own guests (more than its own part's log keeps).
        let t = rows.apply(
            &mut m,
            &Op::PutNode {
                node: 0,
                vtep: 3,
                ready: false,
            },
        );
        states.mark(&t);
        for i in 10..30 {
            let t = rows.apply(&mut m, &guest_on(i, 0));
            states.mark(&t);
            states.refresh(&m, &COMMON, "n1");
        }
        let reply = heartbeat_n1(&m, &mut states, Some(v));
        assert_whole_n1(
            &m,
            &reply,
            Whole::Smaller,
            "own part and every section whole: the whole state",
        );
    }

    /// `reply` is n1's whole state, sent for `why`.
    fn assert_whole_n1(m: &Model, reply: &Reply, why: Whole, what: &str) {
        assert_eq!(reply.whole_why(), Some(why), "{what}");
        assert_eq!(reply.state(), desired_state(m, &COMMON, "n1"), "{what}");
    }

    #[test]
    fn a_pool_is_a_set_whose_every_member_has_a_position_to_draw_and_a_group_by_labels() {
        let web: otherix_core::Labels = [("app".to_string(), "web".to_string())].into();
        let db: otherix_core::Labels = [("app".to_string(), "db".to_string())].into();
        let mut p = Pool::default();
        for (id, labels) in [("a", &web), ("b", &web), ("c", &db), ("d", &db)] {
            assert!(p.insert(id.to_string(), labels));
        }
        assert!(!p.insert("b".to_string(), &web), "once");
        assert!(p.remove("a") && !p.remove("a"));
        assert!(p.remove("c"));
        let at: BTreeSet<&str> = (0..p.len()).filter_map(|i| p.get(i)).collect();
        assert_eq!(at, BTreeSet::from(["b", "d"]), "each member at one position");
        assert_eq!(p.get(p.len()), None);
        let groups: BTreeMap<String, Vec<String>> = p
            .groups()
            .map(|(l, ids)| (l["app"].clone(), ids.iter().cloned().collect()))
            .collect();
        assert_eq!(
            groups,
            BTreeMap::from([("db".into(), vec!["d".into()]), ("web".into(), vec!["b".into()])]),
            "members by labels; emptied groups go"
        );
        p.remove("d");
        assert_eq!(p.groups().count(), 1);
        p.insert("d".to_string(), &db);
        let mut q = Pool::default();
        q.insert("d".to_string(), &db);
        q.insert("b".to_string(), &web);
        assert_eq!(p, q, "positions do not count");
        q.remove("d");
        assert_ne!(p, q);
    }

    #[test]
    fn the_gateways_of_an_overlay_are_its_members_with_the_gateway_role_as_roles_change() {
        let mut m = Model::default();
        for (i, name) in NODES.iter().enumerate() {
            m.set_node(name, Some(node(name, i as u8 + 1)));
        }
        m.set_network("ov1", Some(network(0)));
        let lease = |net: &str, node: &str, i: u8| NodeLease {
            network: net.into(),
            node: node.into(),
            ip: format!("10.100.0.{}", 200 + i).parse().unwrap(),
            mac: format!("02:00:00:00:01:{i:02x}").parse().unwrap(),
        };
        let on = |m: &Model, net: &str| m.gateways_on(net).map(|n| n.name.clone()).collect::<Vec<_>>();
        assert!(on(&m, "ov1").is_empty(), "gw holds no lease on ov1 yet");
        m.set_node_lease("ov1", "n1", Some(lease("ov1", "n1", 1)));
        m.set_node_lease("ov1", "gw", Some(lease("ov1", "gw", 2)));
        assert_eq!(on(&m, "ov1"), ["gw"]);
        assert!(on(&m, "ov2").is_empty());
        // n1 made a gateway too; gw's role taken away; then gw deleted.
        m.set_node(
            "n1",
            Some(NodeRecord {
                gateway: Some("10.0.0.1:8443".into()),
                ..node("n1", 1)
            }),
        );
        assert_eq!(on(&m, "ov1"), ["gw", "n1"]);
        m.set_node(
            "gw",
            Some(NodeRecord {
                gateway: None,
                ..node("gw", 4)
            }),
        );
        assert_eq!(on(&m, "ov1"), ["n1"]);
        assert_eq!(m.gateways().count(), 1);
        m.set_node("n1", None);
        assert!(on(&m, "ov1").is_empty());
        assert_eq!(m.gateways().count(), 0);
    }

    #[test]
    fn a_deleted_vm_or_lb_takes_only_its_own_verdicts_with_it() {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        for i in 0..2 {
            rows.apply(
                &mut m,
                &Op::PutVm {
                    i,
                    net: 0,
                    app: 0,
                    node: Some(0),
                    to: None,
                },
            );
        }
        for i in 0..2 {
            rows.apply(&mut m, &Op::PutLb { i, app: 0, form: 0 });
        }
        let verdict = |lb: &str, vm: &str| VerdictRecord {
            lb: lb.into(),
            vm_id: vm.into(),
            node: "n1".into(),
            health: otherix_core::lb::Health::Healthy,
            probed_at: now(),
            changed_at: Some(now()),
            reason: None,
            successes: 1,
            failures: 0,
        };
        for (lb, vm) in [("lb0", "vm0"), ("lb1", "vm0"), ("lb0", "vm1"), ("lb1", "vm1")] {
            m.set_verdict(lb, vm, Some(verdict(lb, vm)));
        }
        rows.apply(&mut m, &Op::DeleteVm { i: 0 });
        assert!(m.verdict("lb0", "vm0").is_none() && m.verdict("lb1", "vm0").is_none());
        assert!(m.verdict("lb0", "vm1").is_some() && m.verdict("lb1", "vm1").is_some());
        rows.apply(&mut m, &Op::DeleteLb { i: 1 });
        assert!(m.verdict("lb1", "vm1").is_none());
        assert!(m.verdict("lb0", "vm1").is_some(), "another LB's verdict stays");
        m.set_verdict("lb0", "vm1", None);
        assert!(m.verdict("lb0", "vm1").is_none());
        // Nothing is left pointing at what is gone; deleting the VM again is harmless.
        rows.apply(&mut m, &Op::DeleteVm { i: 1 });
        assert!(
            m.verdict_lbs.is_empty() && m.verdicts.is_empty(),
            "{:?}",
            m.verdict_lbs
        );
    }

    #[test]
    fn a_node_vouches_only_for_its_own_verdicts_on_what_it_hosts() {
        let mut rows = world();
        let mut m = Model::build(rows.snapshot());
        for (i, node) in [(0, 0), (1, 1)] {
            rows.apply(
                &mut m,
                &Op::PutVm {
                    i,
                    net: 0,
                    app: 0,
                    node: Some(node),
                    to: None,
                },
            );
        }
        rows.apply(
            &mut m,
            &Op::PutLb {
                i: 0,
                app: 0,
                form: 0,
            },
        );
        let then = now() - time::Duration::minutes(1);
        let verdict = |vm: &str, node: &str| VerdictRecord {
            lb: "lb0".into(),
            vm_id: vm.into(),
            node: node.into(),
            health: otherix_core::lb::Health::Healthy,
            probed_at: then,
            changed_at: Some(then),
            reason: None,
            successes: 1,
            failures: 0,
        };
        m.set_verdict("lb0", "vm0", Some(verdict("vm0", "n1")));
        m.set_verdict("lb0", "vm1", Some(verdict("vm1", "n2")));
        m.vouch("n1", now());
        assert_eq!(m.verdict("lb0", "vm0").unwrap().probed_at, now());
        assert_eq!(m.verdict("lb0", "vm1").unwrap().probed_at, then, "n2's verdict");
        // A verdict from a former owner is not vouched for by the new one.
        m.set_verdict("lb0", "vm1", Some(verdict("vm1", "n1")));
        m.vouch("n2", now());
        assert_eq!(m.verdict("lb0", "vm1").unwrap().probed_at, then);
        // Never backwards.
        m.vouch("n1", then);
        assert_eq!(m.verdict("lb0", "vm0").unwrap().probed_at, now());
    }

    /// A step of a history with verdicts: the model's own, or a verdict's.
    #[derive(Debug, Clone)]
    enum Step {
        Model(Op),
        /// Node `node` reports a new verdict on VM `vm` in LB `lb`, probed `probed` s after `now()`.
        Verdict {
            lb: u8,
            vm: u8,
            node: usize,
            probed: u8,
        },
        /// A heartbeat refreshes that verdict's probe time.
        Probed {
            lb: u8,
            vm: u8,
            at: u8,
        },
        /// Node `node` vouches for its verdicts at the next tick.
        Vouch {
            node: usize,
        },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => op().prop_map(Step::Model),
            2 => (0u8..3, 0u8..8, 0usize..3, 0u8..200)
                .prop_map(|(lb, vm, node, probed)| Step::Verdict { lb, vm, node, probed }),
            1 => (0u8..3, 0u8..8, 0u8..200).prop_map(|(lb, vm, at)| Step::Probed { lb, vm, at }),
            3 => (0usize..3).prop_map(|node| Step::Vouch { node }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        /// One time per node's vouch, read as the later of it and the
        /// verdict's own, is what walking the node's verdicts at every
        /// vouch gave: over random histories of VMs placed, moved,
        /// migrating and deleted, pools changed, verdicts set and
        /// refreshed, and vouches, every verdict's probe time equals the
        /// one the walk computes.
        #[test]
        fn a_vouch_read_lazily_moves_the_probe_times_the_walk_moved(steps in proptest::collection::vec(step(), 1..80)) {
            let mut rows = world();
            let mut m = Model::build(rows.snapshot());
            // (lb, vm) → (its node, the probe time the walk keeps).
            let mut walked: BTreeMap<(String, String), (String, OffsetDateTime)> = BTreeMap::new();
            let mut tick = now();
            for step in &steps {
                match step {
                    Step::Model(op) => {
                        rows.apply(&mut m, op);
                    }
                    Step::Verdict { lb, vm, node, probed } => {
                        let (lb, vm, node) = (format!("lb{lb}"), format!("vm{vm}"), NODES[*node].to_string());
                        let probed_at = now() + time::Duration::seconds(*probed as i64);
                        m.set_verdict(&lb, &vm, Some(VerdictRecord {
                            lb: lb.clone(),
                            vm_id: vm.clone(),
                            node: node.clone(),
                            health: otherix_core::lb::Health::Healthy,
                            probed_at,
                            changed_at: None,
                            reason: None,
                            successes: 1,
                            failures: 0,
                        }));
                        walked.insert((lb, vm), (node, probed_at));
                    }
                    Step::Probed { lb, vm, at } => {
                        let (lb, vm) = (format!("lb{lb}"), format!("vm{vm}"));
                        let at = now() + time::Duration::seconds(*at as i64);
                        m.verdict_probed(&lb, &vm, at, 2, 0);
                        if let Some((_, p)) = walked.get_mut(&(lb, vm)) {
                            *p = (*p).max(at);
                        }
                    }
                    Step::Vouch { node } => {
                        tick += time::Duration::seconds(3);
                        let node = NODES[*node];
                        m.vouch(node, tick);
                        // The walk: the node's verdicts on VMs it hosts or
                        // receives, in the LB's pool.
                        for ((lb, vm), (of, p)) in walked.iter_mut() {
                            let here = m.vm(vm).is_some_and(|v| {
                                v.node.as_deref() == Some(node) || v.migrate_to.as_deref() == Some(node)
                            });
                            let pooled = m.lbs_of(vm).any(|e| e.record.name == *lb);
                            if of == node && here && pooled && tick > *p {
                                *p = tick;
                            }
                        }
                    }
                }
                // A VM or LB deleted takes its verdicts with it.
                walked.retain(|(lb, vm), _| m.verdict(lb, vm).is_some());
                for ((lb, vm), (_, p)) in &walked {
                    prop_assert_eq!(m.verdict(lb, vm).unwrap().probed_at, *p, "{} on {} after {:?}", lb, vm, step);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// A model kept by applying changes equals one built from the rows,
        /// and every node whose own part a change changed was marked, as was
        /// every overlay whose section it changed.
        #[test]
        fn incremental_equals_rebuilt_and_touched_covers_every_change(ops in proptest::collection::vec(op(), 1..40)) {
            let mut rows = world();
            let mut m = Model::build(rows.snapshot());
            let (mut own_before, mut sections_before) = (all_own(&m), all_sections(&m));
            for op in &ops {
                let covered_before = covered(&m);
                let touched = rows.apply(&mut m, op);
                let (own_after, sections_after) = (all_own(&m), all_sections(&m));
                // The gateways join or leave an overlay whose coverage changed.
                prop_assert!(
                    covered(&m) == covered_before || touched.gateways,
                    "{op:?} changed the gateways' coverage without touching them: {touched:?}"
                );
                for (n, d) in &own_after {
                    if own_before[n] != *d {
                        let gateway = m.node(n).is_some_and(|x| x.gateway.is_some());
                        let whole = touched.nodes.contains(n) || (touched.gateways && gateway);
                        let head_marked = touched.heads.contains(n);
                        // Otherwise only guests may have changed, each one marked.
                        let (before, after) = (&own_before[n], d);
                        let head = |o: &(DesiredState, Option<std::net::Ipv4Addr>)| {
                            let mut h = o.0.clone();
                            h.guests.clear();
                            h.health_checks.clear();
                            (h, o.1)
                        };
                        // The VMs whose items (guests, or health checks) differ.
                        let changed = |a: BTreeSet<(String, String)>, b: BTreeSet<(String, String)>| {
                            a.symmetric_difference(&b)
                                .map(|(id, _)| id.clone())
                                .collect::<BTreeSet<String>>()
                        };
                        let guests = |o: &(DesiredState, Option<std::net::Ipv4Addr>)| -> BTreeSet<(String, String)> {
                            o.0.guests.iter().map(|g| (g.vm_id.clone(), format!("{g:?}"))).collect()
                        };
                        let checks = |o: &(DesiredState, Option<std::net::Ipv4Addr>)| -> BTreeSet<(String, String)> {
                            o.0.health_checks.iter().map(|c| (c.vm_id.clone(), format!("{c:?}"))).collect()
                        };
                        let no_ids = BTreeSet::new();
                        let marked = touched.own_guests.get(n.as_str()).unwrap_or(&no_ids);
                        // A guest's change is marked as one; a health check's
                        // alone (a load balancer's pool) may be marked either way.
                        let marked_either: BTreeSet<String> = marked
                            .union(touched.health.get(n.as_str()).unwrap_or(&no_ids))
                            .cloned()
                            .collect();
                        prop_assert!(
                            whole || ((head_marked || head(before) == head(after))
                                && changed(guests(before), guests(after)).is_subset(marked)
                                && changed(checks(before), checks(after)).is_subset(&marked_either)),
                            "{op:?} changed {n}'s own part without marking it: {touched:?}"
                        );
                    }
                }
                for (net, s) in &sections_after {
                    if sections_before[net] != *s {
                        prop_assert!(
                            touched.sections.contains(net)
                                || touched.guests.contains_key(net)
                                || touched.leases.contains_key(net),
                            "{op:?} changed {net}'s section without marking it: {touched:?}"
                        );
                    }
                }
                (own_before, sections_before) = (own_after, sections_after);
            }
            let rebuilt = Model::build(rows.snapshot());
            prop_assert_eq!(all_desired(&m), all_desired(&rebuilt));
            for lb in rebuilt.lbs() {
                prop_assert_eq!(&m.lb(&lb.record.name).unwrap().pool, &lb.pool);
                // The label index admits every VM the selector matches.
                let mut every = Pool::default();
                for vm in m.vms().into_iter().filter(|vm| lb.matches(vm)) {
                    every.insert(vm.id.clone(), &vm.labels);
                }
                prop_assert_eq!(&lb.pool, &every, "{}", lb.record.selector);
            }
            prop_assert_eq!(m.networks().iter().map(|n| (n.name.clone(), n.vms)).collect::<Vec<_>>(),
                rebuilt.networks().iter().map(|n| (n.name.clone(), n.vms)).collect::<Vec<_>>());
            let unplaced = |m: &Model| m.unplaced().map(|v| v.id.clone()).collect::<Vec<_>>();
            prop_assert_eq!(unplaced(&m), unplaced(&rebuilt));
            prop_assert_eq!(m.load(), rebuilt.load());
            prop_assert_eq!(m.load(), crate::schedule::load(m.vms()), "kept counts are the counts");
            let load = m.load();
            let order: BTreeSet<(usize, String)> = m
                .nodes()
                .map(|n| (load.get(&n.name).copied().unwrap_or(0), n.name.clone()))
                .collect();
            prop_assert_eq!(&m.by_load, &order, "the kept order is every node's count");
            for n in m.nodes() {
                let placed = m.vms().into_iter().filter(|vm| vm.node.as_deref() == Some(n.name.as_str())).count();
                prop_assert_eq!(m.guests_on(&n.name), placed, "{}'s guests", n.name);
            }
            // The kept indexes of each node's guests are what a walk of
            // them finds, for every node a VM names (deleted ones too).
            let named: BTreeSet<String> = m
                .vms()
                .into_iter()
                .flat_map(|vm| [vm.node.clone(), vm.migrate_to.clone()])
                .flatten()
                .chain(m.nodes().map(|n| n.name.clone()))
                .collect();
            for n in &named {
                let walked: BTreeSet<&str> = m
                    .vms_on_node(n)
                    .filter(|vm| vm.node.is_some())
                    .map(|vm| vm.network.as_str())
                    .collect();
                prop_assert_eq!(m.guest_networks(n).collect::<BTreeSet<_>>(), walked, "{}'s networks", n);
                let migrating: Vec<&str> = m
                    .vms_on_node(n)
                    .filter(|vm| vm.migrate_to.is_some())
                    .map(|vm| vm.id.as_str())
                    .collect();
                prop_assert_eq!(
                    m.migrations_at(n).map(|vm| vm.id.as_str()).collect::<Vec<_>>(),
                    migrating,
                    "{}'s migrations", n
                );
                prop_assert_eq!(m.guest_networks(n).collect::<Vec<_>>(), rebuilt.guest_networks(n).collect::<Vec<_>>());
            }
            prop_assert_eq!(&m.nets_by_node, &rebuilt.nets_by_node, "no node kept with no guests");
            prop_assert_eq!(&m.migrating_by_node, &rebuilt.migrating_by_node);
            prop_assert_eq!(&m.by_load, &rebuilt.by_load);
            // The names' two indexes hold the same, and a name finds its VM.
            prop_assert_eq!(&m.vm_ids, &rebuilt.vm_ids);
            prop_assert_eq!(
                m.vm_ids_hashed.iter().map(|(n, id)| (n.clone(), id.clone())).collect::<BTreeMap<_, _>>(),
                m.vm_ids.clone()
            );
            for (name, id) in &m.vm_ids {
                prop_assert_eq!(m.vm_by_name(name).map(|v| &v.id), Some(id));
            }
        }

        /// What each node is answered — whole, unchanged or as a delta
        /// against the version it holds — always adds up to its desired
        /// state computed from scratch, with the same version; nodes
        /// heartbeat after some changes and not others (`beats`).
        #[test]
        fn answers_whole_or_as_deltas_add_up_to_the_state_computed_from_scratch(
            ops in proptest::collection::vec(op(), 1..40),
            beats in proptest::collection::vec(0u8..16, 40),
            guest_changes in proptest::collection::vec(any::<bool>(), 40),
            wakes in proptest::collection::vec(any::<bool>(), 40),
        ) {
            let mut rows = world();
            let mut m = Model::build(rows.snapshot());
            let mut states = States::default();
            let mut held: BTreeMap<&str, DesiredState> = BTreeMap::new();
            for (k, op) in ops.iter().enumerate() {
                let touched = rows.apply(&mut m, op);
                states.mark(&touched);
                for (i, node) in NODES.iter().enumerate() {
                    if beats[k] & (1 << i) == 0 {
                        // Woken without a heartbeat: a version more, which
                        // may push the one it holds past those kept by count.
                        if wakes[k] {
                            states.refresh(&m, &COMMON, node);
                        }
                        continue;
                    }
                    let want = desired_state(&m, &COMMON, node);
                    // A node not marked keeps its version (a heartbeat
                    // answers it without a refresh): so it must be current.
                    if !states.is_dirty(&m, node) {
                        prop_assert_eq!(states.version(node), Some(want.version), "{} unmarked after {:?}", node, op);
                    }
                    // As the catalog answers a heartbeat: what it holds first.
                    states.applied(node, held.get(node).map(|h| h.version));
                    let version = states.refresh(&m, &COMMON, node);
                    prop_assert_eq!(version, want.version, "{} after {:?}", node, op);
                    // Every section held, kept from the guests that changed,
                    // is the one computed from scratch.
                    for net in NETS {
                        if let Some(kept) = states.section(net) {
                            let scratch = section(&m, net);
                            prop_assert_eq!(Some(kept), scratch.as_ref(), "{} after {:?}", net, op);
                        }
                    }
                    // The own part, kept from the VMs that changed, is
                    // the one computed from scratch.
                    let kept = states.own(node).expect("refreshed");
                    prop_assert_eq!(kept, &own_part(&m, &COMMON, node), "{} after {:?}", node, op);
                    let base = held.get(node).map(|h| h.version);
                    if base == Some(version) {
                        prop_assert_eq!(&held[node], &want, "{} holds the current version", node);
                        continue;
                    }
                    let reply = states.reply(node, base, guest_changes[k]).expect("refreshed");
                    let state = reply.state();
                    // What goes on the wire is the state, byte for byte.
                    prop_assert_eq!(
                        String::from_utf8(reply.json()).unwrap(),
                        serde_json::to_string(&state).unwrap(),
                        "{} after {:?}", node, op
                    );
                    let got = if reply.is_delta() {
                        held[node].apply(&state).map_err(|e| TestCaseError::fail(format!("{node}: {e}")))?
                    } else {
                        state
                    };
                    prop_assert_eq!(&got, &want, "{} after {:?}", node, op);
                    // What the agent checks: the digest the answer names is
                    // the one of the state it built, computed from it alone.
                    prop_assert_eq!(got.digest, Some(got.digest(node_vtep(&m, node))), "{} after {:?}", node, op);
                    held.insert(node, got);
                }
            }
            // Not a property of every case; shows the cases exercise both.
        }
    }
}
