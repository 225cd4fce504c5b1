//! Creating many VMs in one transaction, in a handful of statements whatever
//! their number: the names checked with one query, each network read once,
//! MACs checked together, addresses walked once per network from its hint,
//! and the rows inserted a few hundred to a statement. Two uses:
//!
//! - [`Store::create_vms`], a batch (`POST /v1/vm-batches`, `vm create
//!   --count`): all or nothing — one refusal and nothing is written;
//! - [`Store::create_vms_each`], concurrent single creates grouped into one
//!   transaction (group commit): each VM gets its own answer, the refused
//!   ones write nothing and the others commit together.
//!
//! Either way every refusal is decided before anything is written (a name
//! taken, in the store or earlier in the batch; a network missing; a bridge
//! placement refused; a subnet exhausted), so a refused VM leaves no trace,
//! and the leases of one transaction are distinct because they are drawn
//! one after the other from one walk of the network's leases.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::Ipv4Addr;

use otherix_core::ipam::{IpamError, Subnet};
use otherix_core::mac::MacAddr;
use otherix_proto::{NetworkType, Runtime, Vm, VmState};
use time::OffsetDateTime;

use crate::vms::{bridge_placement, NewVm};
use crate::{from_millis, to_millis, Dialect, Store, StoreError, Tx};

/// Most VMs one batch may create (`POST /v1/vm-batches`).
pub const MAX_BATCH: usize = 1000;

/// Rows per multi-row INSERT: 9 arguments each stays far below SQLite's
/// and PostgreSQL's limits on the arguments of one statement.
const ROWS_PER_INSERT: usize = 200;

/// Leases read per page of a network's walk.
const PAGE: i64 = 256;

impl Store {
    /// Creates every VM of `news` or none: the first refusal (with the
    /// VM's name in its message where the refusal itself does not say it)
    /// is returned and nothing is written. Each VM gets a fresh MAC and the
    /// lowest free address of its network, distinct from the others'.
    pub async fn create_vms(
        &self,
        news: &[NewVm],
        random_mac: impl FnMut() -> MacAddr,
        now: OffsetDateTime,
    ) -> Result<Vec<Vm>, StoreError> {
        let mut tx = self.begin_write().await?;
        let (planned, hints) = plan(&mut tx, news, random_mac, now).await?;
        let mut vms = Vec::with_capacity(planned.len());
        for p in planned {
            vms.push(p?);
        }
        write(&mut tx, self.dialect(), &vms, &hints, now).await?;
        tx.commit().await?;
        Ok(vms)
    }

    /// Creates each VM of `news` that is not refused, in one transaction:
    /// one answer per VM, in order. An error of the store itself (not a
    /// refusal) fails the whole group, and nothing is written.
    pub async fn create_vms_each(
        &self,
        news: &[NewVm],
        random_mac: impl FnMut() -> MacAddr,
        now: OffsetDateTime,
    ) -> Result<Vec<Result<Vm, StoreError>>, StoreError> {
        let mut tx = self.begin_write().await?;
        let (planned, hints) = plan(&mut tx, news, random_mac, now).await?;
        let vms: Vec<Vm> = planned.iter().filter_map(|p| p.as_ref().ok().cloned()).collect();
        if !vms.is_empty() {
            write(&mut tx, self.dialect(), &vms, &hints, now).await?;
            tx.commit().await?;
        }
        Ok(planned)
    }
}

/// What each VM would be: refused, or the row to write with its address
/// and MAC; and where each network's lease hint moves (past the addresses
/// handed out). Writes nothing: [`write`] writes the VMs, their leases and
/// the hints in the same transaction.
async fn plan(
    tx: &mut Tx,
    news: &[NewVm],
    mut random_mac: impl FnMut() -> MacAddr,
    now: OffsetDateTime,
) -> Result<(Vec<Result<Vm, StoreError>>, Vec<(String, i64)>), StoreError> {
    // The names taken and a MAC for every VM, checked in one query (most
    // groups): what a refusal leaves unused is dropped.
    // The networks come with them (most groups: one query for all three).
    let (taken, mut drawn, read) = names_and_macs(tx, news, &mut random_mac).await?;
    // Every network the group names, read in one query.
    let names: Vec<&str> = {
        let mut names: Vec<&str> = news
            .iter()
            .filter(|n| !taken.contains(n.name.as_str()))
            .map(|n| n.network.as_str())
            .collect();
        names.sort_unstable();
        names.dedup();
        names
    };
    let mut networks: HashMap<&str, Result<Network, StoreError>> = match read {
        Some(found) => with_bridge_nodes(tx, &names, found).await?,
        None => read_networks(tx, &names).await?,
    };
    let mut seen: HashSet<&str> = HashSet::new();
    // Refusals that need no address: names and networks.
    let mut out: Vec<Result<(Option<String>, &NewVm), StoreError>> = Vec::with_capacity(news.len());
    for new in news {
        if taken.contains(new.name.as_str()) || !seen.insert(new.name.as_str()) {
            out.push(Err(StoreError::AlreadyExists {
                kind: "vm",
                name: new.name.clone(),
            }));
            continue;
        }
        if !networks.contains_key(new.network.as_str()) {
            // Not in the group's read (a name refused above shares it).
            let net = network(tx, &new.network).await?;
            networks.insert(new.network.as_str(), net);
        }
        let net = match &networks[new.network.as_str()] {
            Ok(net) => net,
            Err(_) => {
                out.push(Err(StoreError::NotFound {
                    kind: "network",
                    name: new.network.clone(),
                }));
                continue;
            }
        };
        let node = match net.kind {
            NetworkType::Overlay => Ok(new.node.clone()),
            NetworkType::Bridge => bridge_placement(&new.network, &net.nodes, new.node.as_deref()),
        };
        out.push(node.map(|node| (node, new)));
    }
    // MACs, then addresses: a subnet's exhaustion is the last refusal, so
    // an address handed out always ends up leased.
    let wanting = out.iter().filter(|o| o.is_ok()).count();
    drawn.truncate(wanting);
    let mut macs = unique_macs(tx, wanting, drawn, &mut random_mac)
        .await?
        .into_iter();
    // One walk per network that hands out addresses, each started from a
    // first page of its leases read together.
    let mut walks: HashMap<String, Walk> = HashMap::new();
    for new in out.iter().filter_map(|o| o.as_ref().ok().map(|(_, new)| *new)) {
        if let Some(Ok(net)) = networks.get(new.network.as_str()) {
            walks
                .entry(new.network.clone())
                .or_insert_with(|| Walk::new(&net.subnet, net.hint));
        }
    }
    first_pages(tx, &mut walks).await?;
    let mut planned = Vec::with_capacity(news.len());
    for o in out {
        let (node, new) = match o {
            Ok(ok) => ok,
            Err(e) => {
                planned.push(Err(e));
                continue;
            }
        };
        let Ok(net) = &networks[new.network.as_str()] else {
            unreachable!("a VM of a missing network was refused above");
        };
        let walk = walks
            .entry(new.network.clone())
            .or_insert_with(|| Walk::new(&net.subnet, net.hint));
        let ip = match walk.next_free(tx, &new.network, &net.subnet).await? {
            Ok(ip) => ip,
            Err(e) => {
                planned.push(Err(e.into()));
                continue;
            }
        };
        // Invariant: one MAC was drawn for every VM not refused above.
        let mac = macs.next().expect("a MAC for every VM not refused");
        planned.push(Ok(Vm {
            id: new.id.clone(),
            name: new.name.clone(),
            network: new.network.clone(),
            node,
            labels: new.labels.clone(),
            mac,
            ip,
            state: VmState::Pending,
            reason: None,
            exec: new.exec.clone(),
            migration_id: None,
            migration_port: None,
            runtime: if new.machine.is_some() {
                Runtime::Qemu
            } else {
                Runtime::Netns
            },
            machine: new.machine.clone(),
            accelerator: None,
            migrate_to: None,
            // As the store keeps it: milliseconds.
            created_at: from_millis(to_millis(now)),
        }));
    }
    let mut hints: Vec<(String, i64)> = walks
        .into_iter()
        .filter(|(_, w)| w.moved)
        .map(|(net, w)| (net, w.candidate as i64))
        .collect();
    hints.sort_unstable();
    Ok((planned, hints))
}

/// The networks `names` as a create needs them, in one query (a bridge
/// network's nodes in one more); a name without a network is refused.
async fn read_networks<'n>(
    tx: &mut Tx,
    names: &[&'n str],
) -> Result<HashMap<&'n str, Result<Network, StoreError>>, StoreError> {
    let mut found: HashMap<String, Network> = HashMap::new();
    for chunk in names.chunks(ROWS_PER_INSERT * 4) {
        let sql = format!(
            "SELECT n.name, n.kind, n.subnet, h.next FROM networks n
             LEFT JOIN lease_hints h ON h.network = n.name WHERE n.name IN ({})",
            placeholders(1, chunk.len())
        );
        let mut q = sqlx::query_as::<_, (String, String, String, Option<i64>)>(&sql);
        for name in chunk {
            q = q.bind(*name);
        }
        for (name, kind, subnet, hint) in q.fetch_all(&mut **tx).await? {
            found.insert(name, Network::from_row(&kind, &subnet, hint)?);
        }
    }
    with_bridge_nodes(tx, names, found).await
}

/// `found` (the networks read, by name) with their bridge networks' nodes
/// (one query), each of `names` answered: a name not found is refused.
async fn with_bridge_nodes<'n>(
    tx: &mut Tx,
    names: &[&'n str],
    mut found: HashMap<String, Network>,
) -> Result<HashMap<&'n str, Result<Network, StoreError>>, StoreError> {
    let bridges: Vec<String> = found
        .iter()
        .filter(|(_, n)| n.kind == NetworkType::Bridge)
        .map(|(name, _)| name.clone())
        .collect();
    for chunk in bridges.chunks(ROWS_PER_INSERT * 4) {
        let sql = format!(
            "SELECT network, node FROM network_nodes WHERE network IN ({}) ORDER BY network, node",
            placeholders(1, chunk.len())
        );
        let mut q = sqlx::query_as::<_, (String, String)>(&sql);
        for name in chunk {
            q = q.bind(name);
        }
        for (network, node) in q.fetch_all(&mut **tx).await? {
            if let Some(n) = found.get_mut(&network) {
                n.nodes.push(node);
            }
        }
    }
    Ok(names
        .iter()
        .map(|&name| {
            let net = found.remove(name).ok_or_else(|| StoreError::NotFound {
                kind: "network",
                name: name.into(),
            });
            (name, net)
        })
        .collect())
}

/// Starts each walk of `walks` with its first page of leases, the pages of
/// every network read in one query (a page each, as [`Walk::next_free`]
/// reads them).
async fn first_pages(tx: &mut Tx, walks: &mut HashMap<String, Walk>) -> Result<(), StoreError> {
    let wanting: Vec<(String, u64, u64)> = walks
        .iter()
        .filter(|(_, w)| w.candidate <= w.last)
        .map(|(net, w)| (net.clone(), w.candidate, w.last))
        .collect();
    let mut pages: HashMap<String, Vec<i64>> = HashMap::new();
    // Four arguments a network.
    for chunk in wanting.chunks(ROWS_PER_INSERT) {
        let sql = chunk
            .iter()
            .enumerate()
            .map(|(i, _)| {
                let b = i * 4;
                format!(
                    "SELECT network, ip FROM (SELECT network, ip FROM leases
                     WHERE network = ${} AND ip >= ${} AND ip <= ${} ORDER BY ip LIMIT ${}) AS page{i}",
                    b + 1,
                    b + 2,
                    b + 3,
                    b + 4
                )
            })
            .collect::<Vec<_>>()
            .join(" UNION ALL ");
        let mut q = sqlx::query_as::<_, (String, i64)>(&sql);
        for (net, from, to) in chunk {
            q = q
                .bind(net.as_str())
                .bind(*from as i64)
                .bind(*to as i64)
                .bind(PAGE);
        }
        for (net, ip) in q.fetch_all(&mut **tx).await? {
            pages.entry(net).or_default().push(ip);
        }
    }
    for (net, _, _) in &wanting {
        let mut taken = pages.remove(net.as_str()).unwrap_or_default();
        taken.sort_unstable();
        if let Some(w) = walks.get_mut(net.as_str()) {
            w.start(taken);
        }
    }
    Ok(())
}

/// A network as a create needs it.
struct Network {
    kind: NetworkType,
    subnet: Subnet,
    /// A bridge network's nodes, in name order.
    nodes: Vec<String>,
    /// Its lease hint (every address below it is leased), read with it:
    /// one round trip to the store's thread fewer per group.
    hint: Option<i64>,
}

impl Network {
    /// A network row as read (its nodes, for a bridge, read apart).
    fn from_row(kind: &str, subnet: &str, hint: Option<i64>) -> Result<Network, StoreError> {
        Ok(Network {
            kind: kind.parse()?,
            subnet: subnet
                .parse()
                .map_err(|e| StoreError::Corrupt(format!("network subnet: {e}")))?,
            nodes: Vec::new(),
            hint,
        })
    }
}

async fn network(tx: &mut Tx, name: &str) -> Result<Result<Network, StoreError>, StoreError> {
    let row: Option<(String, String, Option<i64>)> = sqlx::query_as(
        "SELECT n.kind, n.subnet, h.next FROM networks n
         LEFT JOIN lease_hints h ON h.network = n.name WHERE n.name = $1",
    )
    .bind(name)
    .fetch_optional(&mut **tx)
    .await?;
    let Some((kind, subnet, hint)) = row else {
        return Ok(Err(StoreError::NotFound {
            kind: "network",
            name: name.into(),
        }));
    };
    let kind: NetworkType = kind.parse()?;
    let subnet: Subnet = subnet
        .parse()
        .map_err(|e| StoreError::Corrupt(format!("network subnet: {e}")))?;
    let nodes = match kind {
        NetworkType::Overlay => Vec::new(),
        NetworkType::Bridge => {
            sqlx::query_scalar("SELECT node FROM network_nodes WHERE network = $1 ORDER BY node")
                .bind(name)
                .fetch_all(&mut **tx)
                .await?
        }
    };
    Ok(Ok(Network {
        kind,
        subnet,
        nodes,
        hint,
    }))
}

/// `$first, $first+1, ...`: `n` placeholders for an `IN (...)` list.
pub(crate) fn placeholders(first: usize, n: usize) -> String {
    (first..first + n)
        .map(|i| format!("${i}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Most VMs whose names and MACs are checked in one query (two arguments
/// each): larger batches check them apart, a few hundred at a time.
const CHECKED_TOGETHER: usize = 400;

/// The names of `news` that VMs already carry, up to one MAC for each VM
/// of `news` leased to nothing and distinct from one another (a MAC that
/// collides is left out: [`unique_macs`] draws what is missing), and the
/// networks `news` name that exist (without a bridge's nodes), read in
/// one query: each is a hand-over to the store's thread and back, and the
/// write connection is held meanwhile. Past [`CHECKED_TOGETHER`] VMs, the
/// names alone (the networks are then read apart).
async fn names_and_macs(
    tx: &mut Tx,
    news: &[NewVm],
    random_mac: &mut impl FnMut() -> MacAddr,
) -> Result<(HashSet<String>, Vec<MacAddr>, Option<HashMap<String, Network>>), StoreError> {
    if news.is_empty() || news.len() > CHECKED_TOGETHER {
        return Ok((names_taken(tx, news).await?, Vec::new(), None));
    }
    let mut drawn: Vec<MacAddr> = Vec::with_capacity(news.len());
    for _ in 0..news.len() {
        let mac = random_mac();
        if !drawn.contains(&mac) {
            drawn.push(mac);
        }
    }
    let mut nets: Vec<&str> = news.iter().map(|n| n.network.as_str()).collect();
    nets.sort_unstable();
    nets.dedup();
    // The networks' branch first: PostgreSQL types a UNION's columns pair
    // by pair from the left, and the others' NULLs take its types.
    let sql = format!(
        "SELECT 'net' AS what, n.name AS value, n.kind AS kind, n.subnet AS subnet, h.next AS hint
             FROM networks n LEFT JOIN lease_hints h ON h.network = n.name WHERE n.name IN ({})
         UNION ALL SELECT 'name' AS what, name AS value, NULL AS kind, NULL AS subnet, NULL AS hint
             FROM vms WHERE name IN ({})
         UNION ALL SELECT 'mac' AS what, mac AS value, NULL AS kind, NULL AS subnet, NULL AS hint
             FROM leases WHERE mac IN ({})",
        placeholders(1, nets.len()),
        placeholders(nets.len() + 1, news.len()),
        placeholders(nets.len() + news.len() + 1, drawn.len())
    );
    type Row = (String, String, Option<String>, Option<String>, Option<i64>);
    let mut q = sqlx::query_as::<_, Row>(&sql);
    for net in &nets {
        q = q.bind(*net);
    }
    for new in news {
        q = q.bind(&new.name);
    }
    for mac in &drawn {
        q = q.bind(mac.to_string());
    }
    let mut taken = HashSet::new();
    let mut leased = HashSet::new();
    let mut networks = HashMap::new();
    for (what, value, kind, subnet, hint) in q.fetch_all(&mut **tx).await? {
        match what.as_str() {
            "name" => {
                taken.insert(value);
            }
            "mac" => {
                leased.insert(value);
            }
            _ => {
                let (Some(kind), Some(subnet)) = (kind, subnet) else {
                    return Err(StoreError::Corrupt(format!(
                        "network {value:?} without a kind or subnet"
                    )));
                };
                networks.insert(value, Network::from_row(&kind, &subnet, hint)?);
            }
        }
    }
    drawn.retain(|mac| !leased.contains(&mac.to_string()));
    Ok((taken, drawn, Some(networks)))
}

/// The names of `news` that VMs already carry.
async fn names_taken(tx: &mut Tx, news: &[NewVm]) -> Result<HashSet<String>, StoreError> {
    let mut taken = HashSet::new();
    for chunk in news.chunks(ROWS_PER_INSERT * 4) {
        let sql = format!(
            "SELECT name FROM vms WHERE name IN ({})",
            placeholders(1, chunk.len())
        );
        let mut q = sqlx::query_scalar::<_, String>(&sql);
        for new in chunk {
            q = q.bind(&new.name);
        }
        taken.extend(q.fetch_all(&mut **tx).await?);
    }
    Ok(taken)
}

/// `n` MACs leased to nothing and distinct from one another, from
/// `random_mac`, redrawing collisions (rare with 40 random bits; a bounded
/// number of rounds keeps a broken generator from spinning forever).
async fn unique_macs(
    tx: &mut Tx,
    n: usize,
    checked: Vec<MacAddr>,
    random_mac: &mut impl FnMut() -> MacAddr,
) -> Result<Vec<MacAddr>, StoreError> {
    // Those already found unused and distinct ([`names_and_macs`]).
    let mut chosen: Vec<MacAddr> = checked;
    let mut chosen_set: HashSet<MacAddr> = chosen.iter().copied().collect();
    for _ in 0..16 {
        let missing = n - chosen.len();
        if missing == 0 {
            return Ok(chosen);
        }
        let mut drawn: Vec<MacAddr> = Vec::with_capacity(missing);
        for _ in 0..missing {
            let mac = random_mac();
            if !chosen_set.contains(&mac) && !drawn.contains(&mac) {
                drawn.push(mac);
            }
        }
        let mut leased: HashSet<String> = HashSet::new();
        for chunk in drawn.chunks(ROWS_PER_INSERT * 4) {
            let sql = format!(
                "SELECT mac FROM leases WHERE mac IN ({})",
                placeholders(1, chunk.len())
            );
            let mut q = sqlx::query_scalar::<_, String>(&sql);
            for mac in chunk {
                q = q.bind(mac.to_string());
            }
            leased.extend(q.fetch_all(&mut **tx).await?);
        }
        for mac in drawn {
            if !leased.contains(&mac.to_string()) {
                chosen_set.insert(mac);
                chosen.push(mac);
            }
        }
    }
    if chosen.len() == n {
        return Ok(chosen);
    }
    Err(StoreError::Conflict(
        "could not draw an unused MAC address".into(),
    ))
}

/// One network's walk for free addresses within a transaction: from the
/// network's hint (every address below it is leased), through the leases
/// above it a page at a time. Addresses it hands out are past the walk, so
/// it never hands one out twice.
struct Walk {
    /// The lowest address that may be free (u64: `last + 1` may not fit).
    candidate: u64,
    last: u64,
    /// Leased addresses at or above `candidate` read but not yet passed.
    page: VecDeque<u64>,
    /// Whether everything above the page is known free (the last page read
    /// was short).
    rest_free: bool,
    /// Whether an address was handed out (the hint must move).
    moved: bool,
}

impl Walk {
    /// From the network's hint, read in this transaction (`None`: none yet).
    fn new(subnet: &Subnet, hint: Option<i64>) -> Walk {
        let range = subnet.lease_range();
        let first = u64::from(*range.start());
        Walk {
            // A corrupt hint is clamped.
            candidate: hint.map_or(first, |h| h.max(0) as u64).max(first),
            last: u64::from(*range.end()),
            page: VecDeque::new(),
            rest_free: false,
            moved: false,
        }
    }

    /// The lowest free address, or the subnet's exhaustion.
    async fn next_free(
        &mut self,
        tx: &mut Tx,
        network: &str,
        subnet: &Subnet,
    ) -> Result<Result<Ipv4Addr, IpamError>, StoreError> {
        loop {
            if self.candidate > self.last {
                return Ok(Err(IpamError::Exhausted {
                    subnet: *subnet,
                    capacity: subnet.capacity(),
                }));
            }
            while self.page.front().is_some_and(|&ip| ip < self.candidate) {
                self.page.pop_front();
            }
            match self.page.front() {
                Some(&ip) if ip == self.candidate => {
                    self.page.pop_front();
                    self.candidate += 1;
                }
                Some(_) => break,
                None if self.rest_free => break,
                None => {
                    let taken: Vec<i64> = sqlx::query_scalar(
                        "SELECT ip FROM leases WHERE network = $1 AND ip >= $2 AND ip <= $3 ORDER BY ip LIMIT $4",
                    )
                    .bind(network)
                    .bind(self.candidate as i64)
                    .bind(self.last as i64)
                    .bind(PAGE)
                    .fetch_all(&mut **tx)
                    .await?;
                    self.rest_free = (taken.len() as i64) < PAGE;
                    self.page = taken.into_iter().map(|ip| ip as u64).collect();
                }
            }
        }
        let ip = Ipv4Addr::from(self.candidate as u32);
        self.candidate += 1;
        self.moved = true;
        Ok(Ok(ip))
    }

    /// Starts the walk with the first page of leases from its candidate
    /// (`taken`, ascending, at most [`PAGE`]), read by the caller.
    fn start(&mut self, taken: Vec<i64>) {
        self.rest_free = (taken.len() as i64) < PAGE;
        self.page = taken.into_iter().map(|ip| ip as u64).collect();
    }
}

/// Writes `vms`, their leases and the networks' lease hints, a few hundred
/// rows to a statement. On SQLite the statements of each few hundred go
/// to its thread as one string (one round trip: the arguments are
/// numbered across them); PostgreSQL prepares one statement at a time.
async fn write(
    tx: &mut Tx,
    dialect: Dialect,
    vms: &[Vm],
    hints: &[(String, i64)],
    now: OffsetDateTime,
) -> Result<(), StoreError> {
    let at = to_millis(now);
    let mut hints_left = hints;
    for chunk in vms.chunks(ROWS_PER_INSERT) {
        // The hints go with the first few hundred VMs (a batch's networks
        // past ROWS_PER_INSERT, in statements of their own).
        let these = &hints_left[..hints_left.len().min(ROWS_PER_INSERT)];
        hints_left = &hints_left[these.len()..];
        let mut parts = Vec::with_capacity(3);
        let mut next = 1;
        if !these.is_empty() {
            parts.push(hints_sql(next, these.len()));
            next += 2 * these.len();
        }
        parts.push(vms_sql(next, chunk.len()));
        next += 7 * chunk.len() + 1;
        parts.push(leases_sql(next, chunk.len()));
        match dialect {
            Dialect::Sqlite => {
                let sql = parts.join(";\n");
                let q = bind_hints(sqlx::query(&sql), these);
                let q = bind_vms(q, chunk, at)?;
                bind_leases(q, chunk, at).execute(&mut **tx).await?;
            }
            Dialect::Postgres => {
                // Each statement numbered from $1 on its own.
                if !these.is_empty() {
                    let sql = hints_sql(1, these.len());
                    bind_hints(sqlx::query(&sql), these).execute(&mut **tx).await?;
                }
                let sql = vms_sql(1, chunk.len());
                bind_vms(sqlx::query(&sql), chunk, at)?.execute(&mut **tx).await?;
                let sql = leases_sql(1, chunk.len());
                bind_leases(sqlx::query(&sql), chunk, at)
                    .execute(&mut **tx)
                    .await?;
            }
        }
    }
    for these in hints_left.chunks(ROWS_PER_INSERT) {
        let sql = hints_sql(1, these.len());
        bind_hints(sqlx::query(&sql), these).execute(&mut **tx).await?;
    }
    Ok(())
}

type Query<'q> = sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>;

/// The upsert of `n` networks' lease hints, its arguments from `$first`.
fn hints_sql(first: usize, n: usize) -> String {
    let rows: Vec<String> = (0..n)
        .map(|i| format!("({})", placeholders(first + 2 * i, 2)))
        .collect();
    format!(
        "INSERT INTO lease_hints (network, next) VALUES {}
         ON CONFLICT (network) DO UPDATE SET next = excluded.next",
        rows.join(", ")
    )
}

fn bind_hints<'q>(mut q: Query<'q>, hints: &[(String, i64)]) -> Query<'q> {
    for (net, next) in hints {
        q = q.bind(net.clone()).bind(*next);
    }
    q
}

/// The insert of `n` VMs, its arguments from `$first`: seven a VM, then
/// the time created.
fn vms_sql(first: usize, n: usize) -> String {
    // created_at is the last argument of all.
    let at = first + n * 7;
    let rows: Vec<String> = (0..n)
        .map(|i| format!("({}, 'pending', ${at})", placeholders(first + i * 7, 7)))
        .collect();
    format!(
        "INSERT INTO vms (id, name, network, node, labels, exec, machine, state, created_at) VALUES {}",
        rows.join(", ")
    )
}

fn bind_vms<'q>(mut q: Query<'q>, vms: &[Vm], at: i64) -> Result<Query<'q>, StoreError> {
    for vm in vms {
        let labels = serde_json::to_string(&vm.labels).map_err(|e| StoreError::Invalid(e.to_string()))?;
        let machine = vm
            .machine
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        q = q
            .bind(vm.id.clone())
            .bind(vm.name.clone())
            .bind(vm.network.clone())
            .bind(vm.node.clone())
            .bind(labels)
            .bind(vm.exec.clone())
            .bind(machine);
    }
    Ok(q.bind(at))
}

/// The insert of `n` VMs' leases, its arguments from `$first`: four a
/// lease, then the time created.
fn leases_sql(first: usize, n: usize) -> String {
    let at = first + n * 4;
    let rows: Vec<String> = (0..n)
        .map(|i| {
            let b = first + i * 4;
            format!("({}, 'vm', ${}, ${at})", placeholders(b, 3), b + 3)
        })
        .collect();
    format!(
        "INSERT INTO leases (network, ip, mac, owner_kind, owner, created_at) VALUES {}",
        rows.join(", ")
    )
}

fn bind_leases<'q>(mut q: Query<'q>, vms: &[Vm], at: i64) -> Query<'q> {
    for vm in vms {
        q = q
            .bind(vm.network.clone())
            .bind(i64::from(u32::from(vm.ip)))
            .bind(vm.mac.to_string())
            .bind(vm.id.clone());
    }
    q.bind(at)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    #[allow(unused_imports)]
    use crate::testing::{on_both, TestStore};

    async fn network(store: &Store, name: &str, subnet: &str) {
        crate::testing::overlay(store, name, subnet).await
    }

    fn new_vm(net: &str, name: &str) -> NewVm {
        NewVm {
            machine: None,
            name: name.into(),
            id: format!("id-{name}"),
            network: net.into(),
            node: None,
            labels: BTreeMap::from([("app".to_string(), "web".to_string())]),
            exec: None,
        }
    }

    /// MACs from a space of 256: batches collide with each other and with
    /// themselves, and must redraw.
    fn small_macs(seed: u64) -> impl FnMut() -> MacAddr {
        let mut x = seed;
        move || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            MacAddr([2, 0, 0, 0, 0, (x >> 56) as u8])
        }
    }

    fn distinct<T: std::hash::Hash + Eq>(items: impl IntoIterator<Item = T>) -> usize {
        items.into_iter().collect::<HashSet<T>>().len()
    }

    fn json(vm: &Vm) -> serde_json::Value {
        serde_json::to_value(vm).unwrap()
    }

    async fn count(store: &Store) -> usize {
        store.vms().await.unwrap().len()
    }

    on_both! {
        async fn a_batch_leases_distinct_lowest_addresses_and_is_written_whole_or_not_at_all(store) {
            // A /26: 61 leasable addresses.
            network(&store, "net", "10.50.0.0/26").await;
            let now = OffsetDateTime::now_utc();
            let first: Vec<NewVm> = (0..20).map(|i| new_vm("net", &format!("a{i}"))).collect();
            let vms = store.create_vms(&first, small_macs(1), now).await.unwrap();
            let ips: Vec<u32> = vms.iter().map(|v| u32::from(v.ip)).collect();
            let base = u32::from(Ipv4Addr::new(10, 50, 0, 2));
            assert_eq!(ips, (base..base + 20).collect::<Vec<_>>());
            // As the store reads them back.
            let stored = store.vms().await.unwrap();
            assert_eq!(stored.len(), 20);
            for vm in &vms {
                let back = stored.iter().find(|s| s.id == vm.id).unwrap();
                assert_eq!(json(back), json(vm));
            }

            // Each refusal writes nothing: a name already taken, a name twice
            // in the batch, a network missing, more VMs than addresses left.
            let mut taken: Vec<NewVm> = (0..5).map(|i| new_vm("net", &format!("b{i}"))).collect();
            taken.push(new_vm("net", "a3"));
            let err = store.create_vms(&taken, small_macs(2), now).await.unwrap_err();
            assert!(matches!(err, StoreError::AlreadyExists { ref name, .. } if name == "a3"), "{err:?}");
            let twice = vec![new_vm("net", "c"), new_vm("net", "d"), new_vm("net", "c")];
            let err = store.create_vms(&twice, small_macs(3), now).await.unwrap_err();
            assert!(matches!(err, StoreError::AlreadyExists { .. }), "{err:?}");
            let lost = vec![new_vm("net", "e"), new_vm("nowhere", "f")];
            let err = store.create_vms(&lost, small_macs(4), now).await.unwrap_err();
            assert!(matches!(err, StoreError::NotFound { kind: "network", .. }), "{err:?}");
            let too_many: Vec<NewVm> = (0..42).map(|i| new_vm("net", &format!("g{i}"))).collect();
            let err = store.create_vms(&too_many, small_macs(5), now).await.unwrap_err();
            assert!(matches!(err, StoreError::Exhausted(_)), "{err:?}");
            assert_eq!(count(&store).await, 20);

            // The hint was left where it was: the next VM gets the next address,
            // and the 41 left fill the subnet exactly.
            let rest: Vec<NewVm> = (0..41).map(|i| new_vm("net", &format!("h{i}"))).collect();
            let vms = store.create_vms(&rest, small_macs(6), now).await.unwrap();
            assert_eq!(u32::from(vms[0].ip), base + 20);
            let all = store.vms().await.unwrap();
            assert_eq!(all.len(), 61);
            assert_eq!(distinct(all.iter().map(|v| v.ip)), 61, "an address leased twice");
            assert_eq!(distinct(all.iter().map(|v| v.mac)), 61, "a MAC leased twice");
            let err = store.create_vm(&new_vm("net", "one-more"), small_macs(7), now).await.unwrap_err();
            assert!(matches!(err, StoreError::Exhausted(_)), "{err:?}");

            // Freed addresses are leased again, lowest first, inside a batch too.
            store.delete_vm("a5").await.unwrap();
            store.delete_vm("a9").await.unwrap();
            let again = vec![new_vm("net", "i0"), new_vm("net", "i1")];
            let vms = store.create_vms(&again, small_macs(8), now).await.unwrap();
            assert_eq!(
                vms.iter().map(|v| u32::from(v.ip)).collect::<Vec<_>>(),
                vec![base + 5, base + 9]
            );
        }
    }

    on_both! {
        async fn a_group_commits_the_creates_it_can_and_refuses_the_others_alone(store) {
            network(&store, "one", "10.60.0.0/24").await;
            network(&store, "two", "10.61.0.0/29").await; // 5 addresses
            let now = OffsetDateTime::now_utc();
            store.create_vm(&new_vm("one", "exists"), small_macs(9), now).await.unwrap();
            let mut group = Vec::new();
            for i in 0..8 {
                group.push(new_vm(if i % 2 == 0 { "one" } else { "two" }, &format!("vm{i}")));
            }
            group.push(new_vm("one", "exists"));
            group.push(new_vm("nowhere", "lost"));
            group.push(new_vm("one", "vm0"));
            for i in 8..12 {
                group.push(new_vm("two", &format!("vm{i}")));
            }
            let answers = store.create_vms_each(&group, small_macs(10), now).await.unwrap();
            assert_eq!(answers.len(), group.len());
            let refused: Vec<&str> = group
                .iter()
                .zip(&answers)
                .filter(|(_, a)| a.is_err())
                .map(|(n, _)| n.name.as_str())
                .collect();
            // "two" holds 5: vm1, vm3, vm5, vm7 and vm8; vm9 to vm11 find it full.
            assert_eq!(refused, vec!["exists", "lost", "vm0", "vm9", "vm10", "vm11"]);
            assert!(matches!(answers[8], Err(StoreError::AlreadyExists { .. })));
            assert!(matches!(answers[9], Err(StoreError::NotFound { .. })));
            assert!(matches!(answers[13], Err(StoreError::Exhausted(_))));
            let all = store.vms().await.unwrap();
            assert_eq!(all.len(), 1 + 9);
            assert_eq!(distinct(all.iter().map(|v| (v.network.clone(), v.ip))), 10);
            assert_eq!(distinct(all.iter().map(|v| v.mac)), 10);
            for (new, answer) in group.iter().zip(&answers) {
                if let Ok(vm) = answer {
                    let back = all.iter().find(|s| s.name == new.name).unwrap();
                    assert_eq!(json(back), json(vm));
                }
            }
        }
    }

    on_both! {
        async fn a_group_over_several_networks_gets_each_ones_lowest_free_addresses_past_its_gaps(store) {
            network(&store, "a", "10.70.0.0/24").await;
            network(&store, "b", "10.71.0.0/24").await;
            store
                .create_network(
                    &crate::NewNetwork {
                        name: "br".into(),
                        id: "id-br".into(),
                        kind: NetworkType::Bridge,
                        subnet: "10.72.0.0/24".parse().unwrap(),
                        nodes: vec!["n2".into(), "n1".into()],
                    },
                    OffsetDateTime::now_utc(),
                )
                .await
                .unwrap();
            let now = OffsetDateTime::now_utc();
            // Ten in each overlay, then gaps: a2 and a7 in "a", b0 in "b".
            let first: Vec<NewVm> = (0..10)
                .flat_map(|i| [new_vm("a", &format!("a{i}")), new_vm("b", &format!("b{i}"))])
                .collect();
            store.create_vms(&first, small_macs(11), now).await.unwrap();
            for gone in ["a2", "a7", "b0"] {
                store.delete_vm(gone).await.unwrap();
            }
            let ip = |last: u8, net: u8| Ipv4Addr::new(10, net, 0, last);
            // One group: three in "a" (its two gaps, then past its ten), two
            // in "b" (its gap, then past), one on the bridge (its asked node).
            let mut bridged = new_vm("br", "c0");
            bridged.node = Some("n1".into());
            let group = vec![
                new_vm("a", "x0"),
                new_vm("b", "y0"),
                new_vm("a", "x1"),
                bridged,
                new_vm("b", "y1"),
                new_vm("a", "x2"),
            ];
            let answers = store.create_vms_each(&group, small_macs(12), now).await.unwrap();
            let got: Vec<(Ipv4Addr, Option<String>)> = answers
                .into_iter()
                .map(|a| a.map(|vm| (vm.ip, vm.node)).unwrap())
                .collect();
            assert_eq!(
                got,
                vec![
                    (ip(4, 70), None),
                    (ip(2, 71), None),
                    (ip(9, 70), None),
                    (ip(2, 72), Some("n1".into())),
                    (ip(12, 71), None),
                    (ip(12, 70), None),
                ]
            );
            // The hints moved past what was handed out: the next of each
            // overlay is the one after.
            let next = store
                .create_vms(&[new_vm("a", "x3"), new_vm("b", "y2")], small_macs(13), now)
                .await
                .unwrap();
            assert_eq!(next.iter().map(|v| v.ip).collect::<Vec<_>>(), vec![ip(13, 70), ip(13, 71)]);
            let all = store.vms().await.unwrap();
            assert_eq!(distinct(all.iter().map(|v| (v.network.clone(), v.ip))), all.len());
        }
    }

    on_both! {
        async fn a_batch_past_one_statements_rows_writes_every_vm_lease_and_hint(store) {
            network(&store, "p", "10.80.0.0/22").await;
            network(&store, "q", "10.81.0.0/22").await;
            let now = OffsetDateTime::now_utc();
            // 450 VMs: three statements' worth (ROWS_PER_INSERT is 200).
            let batch: Vec<NewVm> = (0..450)
                .map(|i| new_vm(if i % 3 == 0 { "q" } else { "p" }, &format!("v{i}")))
                .collect();
            let mut n = 0u64;
            let macs = move || {
                n += 1;
                MacAddr([2, 0, 0, (n >> 16) as u8, (n >> 8) as u8, n as u8])
            };
            let vms = store.create_vms(&batch, macs, now).await.unwrap();
            assert_eq!(vms.len(), 450);
            let all = store.vms().await.unwrap();
            assert_eq!(all.len(), 450);
            for vm in &vms {
                let back = all.iter().find(|s| s.id == vm.id).unwrap();
                assert_eq!(json(back), json(vm));
            }
            // 300 in "p" and 150 in "q", each from its first address on; the
            // hints moved past them.
            let next = store
                .create_vms(
                    &[new_vm("p", "p-next"), new_vm("q", "q-next")],
                    {
                        let mut m = 0u8;
                        move || {
                            m += 1;
                            MacAddr([2, 0, 9, 9, 9, m])
                        }
                    },
                    now,
                )
                .await
                .unwrap();
            let first = |a: u8, b: u8| u32::from(Ipv4Addr::new(10, a, 0, b));
            assert_eq!(u32::from(next[0].ip), first(80, 2) + 300);
            assert_eq!(u32::from(next[1].ip), first(81, 2) + 150);
        }
    }

    #[test]
    fn statements_sent_together_number_their_arguments_once_each_in_order() {
        let sql = [hints_sql(1, 2), vms_sql(5, 3), leases_sql(27, 3)].join(";\n");
        let mut seen: Vec<usize> = sql
            .split('$')
            .skip(1)
            .map(|rest| {
                rest.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
                    .parse()
                    .unwrap()
            })
            .collect();
        seen.sort_unstable();
        seen.dedup();
        // 2 hints × 2, 3 VMs × 7 + 1, 3 leases × 4 + 1.
        assert_eq!(seen, (1..=4 + 22 + 13).collect::<Vec<_>>());
    }

    on_both! {
        async fn an_empty_group_writes_nothing_and_asks_nothing_it_cannot(store) {
            let now = OffsetDateTime::now_utc();
            assert!(store.create_vms_each(&[], small_macs(30), now).await.unwrap().is_empty());
            assert!(store.create_vms(&[], small_macs(31), now).await.unwrap().is_empty());
            assert_eq!(count(&store).await, 0);
        }
    }
}
