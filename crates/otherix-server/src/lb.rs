//! Load balancers: each backend's effective health, the views `lb list/get`
//! show, and the choice of one backend per connection (the pools are the
//! catalog's).

use std::collections::HashMap;
use std::sync::Mutex;

use otherix_core::lb::{effective, eligible, p2c_best, pool_status, standing, Health, RecentCount, Standing};
use otherix_proto::{HealthCheckSpec, LbBackend, LoadBalancer, ProbeKind, Vm, VmState};
use otherix_store::{LbRecord, VerdictRecord};

use crate::catalog::Verdict;
use time::{Duration, OffsetDateTime};

/// Looks up the verdict on a backend: only the one from the node that owns
/// the VM now counts (after a migration, the old owner's verdicts do not).
pub trait VerdictOf<'v> {
    fn verdict(&self, vm: &Vm) -> Option<Verdict<'v>>;
}

impl<'v, F: Fn(&Vm) -> Option<Verdict<'v>>> VerdictOf<'v> for F {
    fn verdict(&self, vm: &Vm) -> Option<Verdict<'v>> {
        self(vm).filter(|v| Some(v.record.node.as_str()) == vm.node.as_deref())
    }
}

/// An LB's verdicts by VM id, built once from rows.
pub struct Verdicts<'v> {
    by_vm: HashMap<&'v str, &'v VerdictRecord>,
}

impl<'v> Verdicts<'v> {
    pub fn of(lb: &LbRecord, verdicts: &'v [VerdictRecord]) -> Verdicts<'v> {
        let mut by_vm = HashMap::with_capacity(verdicts.len());
        for v in verdicts.iter().filter(|v| v.lb == lb.name) {
            by_vm.insert(v.vm_id.as_str(), v);
        }
        Verdicts { by_vm }
    }
}

impl<'v> VerdictOf<'v> for Verdicts<'v> {
    fn verdict(&self, vm: &Vm) -> Option<Verdict<'v>> {
        let v = *self.by_vm.get(vm.id.as_str())?;
        (Some(v.node.as_str()) == vm.node.as_deref()).then_some(Verdict::of_row(v))
    }
}

/// The health the broker acts on: the owner's verdict, unknown when stale.
fn health_of(lb: &LbRecord, v: Option<Verdict<'_>>, now: OffsetDateTime) -> Health {
    let interval = Duration::milliseconds(lb.interval_ms as i64);
    match v {
        Some(v) => effective(v.record.health, Some(v.probed_at), interval, now),
        None => Health::Unknown,
    }
}

/// A backend as the broker and `lb get` see it. Only a verdict from the
/// node that owns the VM now counts; a stale one counts as unknown.
/// `node_ready`: whether the VM's node is Ready.
pub fn backend(
    lb: &LbRecord,
    vm: &Vm,
    verdicts: &[VerdictRecord],
    node_ready: bool,
    now: OffsetDateTime,
) -> LbBackend {
    backend_with(lb, vm, Verdicts::of(lb, verdicts).verdict(vm), node_ready, now)
}

fn backend_with(
    lb: &LbRecord,
    vm: &Vm,
    v: Option<Verdict<'_>>,
    node_ready: bool,
    now: OffsetDateTime,
) -> LbBackend {
    let health = health_of(lb, v, now);
    LbBackend {
        vm: vm.name.clone(),
        node: vm.node.clone(),
        ip: vm.ip,
        health,
        last_probe: v.map(|v| v.probed_at),
        last_change: v.and_then(|v| v.record.changed_at),
        reason: match (v, vm.state) {
            (_, s) if s != VmState::Running => Some(format!("vm is {s}")),
            (Some(v), _) => v.record.reason.clone(),
            (None, _) => None,
        },
        successes: v.map(|v| v.record.successes).unwrap_or(0),
        failures: v.map(|v| v.record.failures).unwrap_or(0),
        eligible: vm.state == VmState::Running && eligible(health),
        node_ready,
    }
}

/// Whether `vm`'s node is Ready (heartbeat within `node_timeout`): what
/// the broker ranks backends by, and `lb get` shows.
pub fn node_ready(m: &crate::catalog::Model, vm: &Vm, now: OffsetDateTime, node_timeout: Duration) -> bool {
    vm.node
        .as_deref()
        .and_then(|n| m.node(n))
        .is_some_and(|n| crate::desired::is_ready(n, now, node_timeout))
}

/// How readily the broker serves `vm` (`ready`: whether a VM's node is Ready).
fn standing_of<'v>(
    lb: &LbRecord,
    vm: &Vm,
    verdicts: &impl VerdictOf<'v>,
    ready: &impl Fn(&Vm) -> bool,
    now: OffsetDateTime,
) -> Standing {
    let health = health_of(lb, verdicts.verdict(vm), now);
    standing(health, vm.state == VmState::Running, ready(vm))
}

pub fn spec(lb: &LbRecord) -> HealthCheckSpec {
    HealthCheckSpec {
        kind: lb.health_kind,
        path: lb.health_path.clone(),
        port: lb.health_port,
        interval_ms: lb.interval_ms,
        timeout_ms: lb.timeout_ms,
        rise: lb.rise,
        fall: lb.fall,
    }
}

/// The LB with its pool summarized (and, with `detail`, each backend).
/// `ready`: whether a VM's node is Ready.
pub fn view<'v>(
    lb: &LbRecord,
    pool: &[&Vm],
    verdicts: &impl VerdictOf<'v>,
    ready: &impl Fn(&Vm) -> bool,
    now: OffsetDateTime,
    detail: bool,
) -> LoadBalancer {
    let backends: Vec<LbBackend> = pool
        .iter()
        .map(|vm| backend_with(lb, vm, verdicts.verdict(vm), ready(vm), now))
        .collect();
    let healths: Vec<Health> = backends.iter().map(|b| b.health).collect();
    LoadBalancer {
        name: lb.name.clone(),
        port: lb.port,
        selector: lb.selector.clone(),
        health_check: spec(lb),
        status: pool_status(&healths),
        healthy: healths.iter().filter(|h| **h == Health::Healthy).count() as u32,
        total: backends.len() as u32,
        created_at: lb.created_at,
        backends: if detail { backends } else { vec![] },
    }
}

/// Connections recently brokered to each backend, the load P2C compares.
/// Until gateways report per-backend sessions, a connection counts for as
/// long as its credential could be in use (the credential TTL, `window`).
/// Memory is O(backends): a fixed-size [`RecentCount`] per backend brokered
/// to within the last window or two, whatever the connection rate.
#[derive(Debug, Default)]
pub struct RecentConnections {
    inner: Mutex<Recent>,
}

#[derive(Debug, Default)]
struct Recent {
    by_vm: HashMap<String, RecentCount>,
    /// When backends with nothing recent were last dropped.
    swept: Option<OffsetDateTime>,
}

impl RecentConnections {
    /// Connections to `vm_id` within the window [`record`](Self::record)
    /// kept them for (the credential TTL, fixed for the CP's life).
    pub fn count(&self, vm_id: &str, now: OffsetDateTime, _window: Duration) -> u32 {
        let Ok(r) = self.inner.lock() else { return 0 };
        r.by_vm.get(vm_id).map_or(0, |c| c.count(now))
    }

    /// [`count`](Self::count) for each of `vms`, under one lock.
    pub fn counts(&self, vms: &[&Vm], now: OffsetDateTime, _window: Duration) -> Vec<u32> {
        let Ok(r) = self.inner.lock() else {
            return vec![0; vms.len()];
        };
        vms.iter()
            .map(|vm| r.by_vm.get(&vm.id).map_or(0, |c| c.count(now)))
            .collect()
    }

    /// Counts one connection to `vm_id` at `now`. Once a window, backends
    /// whose count fell to zero (deleted VMs, idle pools) are dropped: a
    /// pass over the map, amortized over a window's records.
    pub fn record(&self, vm_id: &str, now: OffsetDateTime, window: Duration) {
        let Ok(mut r) = self.inner.lock() else { return };
        if r.swept.is_none_or(|t| now - t > window) {
            r.by_vm.retain(|_, c| c.count(now) > 0);
            r.swept = Some(now);
        }
        match r.by_vm.get_mut(vm_id) {
            Some(c) => c.record(now, window),
            None => {
                let mut c = RecentCount::default();
                c.record(now, window);
                r.by_vm.insert(vm_id.to_string(), c);
            }
        }
    }

    /// Backends with a count kept (what the memory grows with).
    pub fn backends(&self) -> usize {
        self.inner.lock().map_or(0, |r| r.by_vm.len())
    }
}

/// Picks one eligible backend by power of two choices, or explains why none.
/// Backends on Ready nodes (`ready`) come first: one on a NotReady node is
/// picked only when no eligible backend is on a Ready node.
#[allow(clippy::too_many_arguments)]
pub fn choose<'a, 'v>(
    lb: &LbRecord,
    candidates: &[&'a Vm],
    verdicts: &impl VerdictOf<'v>,
    ready: &impl Fn(&Vm) -> bool,
    recent: &RecentConnections,
    window: Duration,
    now: OffsetDateTime,
    random: (u64, u64),
) -> Result<&'a Vm, Vec<LbBackend>> {
    let standings: Vec<Standing> = candidates
        .iter()
        .map(|vm| standing_of(lb, vm, verdicts, ready, now))
        .collect();
    // Only the two drawn are counted.
    match p2c_best(&standings, random.0, random.1, |i| {
        recent.count(&candidates[i].id, now, window)
    }) {
        Some(i) => Ok(candidates[i]),
        // Only a refusal needs the full views (they explain it).
        None => Err(candidates
            .iter()
            .map(|vm| backend_with(lb, vm, verdicts.verdict(vm), ready(vm), now))
            .collect()),
    }
}

/// Draws attempted by [`draw`] before it gives up on the pool being mostly
/// usable and [`choose`] looks at every backend.
pub const DRAWS: usize = 16;

/// [`choose`] without listing the pool: draws positions at random until two
/// distinct backends are usable (`usable`: the asker may reach it and did
/// not exclude it), eligible and on a Ready node (`ready`), then keeps the
/// one with fewer recent connections — the same choice as [`choose`]'s,
/// each drawn uniformly among those. `None` when [`DRAWS`] draws did not
/// find two (a small or mostly ineligible pool, or one mostly on NotReady
/// nodes): then [`choose`] decides, falls back to NotReady nodes, and
/// explains a refusal. A decision costs a few lookups, not the pool's size.
#[allow(clippy::too_many_arguments)]
pub fn draw<'a, 'v>(
    lb: &LbRecord,
    len: usize,
    at: impl Fn(usize) -> Option<&'a Vm>,
    usable: impl Fn(&Vm) -> bool,
    verdicts: &impl VerdictOf<'v>,
    ready: &impl Fn(&Vm) -> bool,
    recent: &RecentConnections,
    window: Duration,
    now: OffsetDateTime,
    seed: (u64, u64),
) -> Option<&'a Vm> {
    if len < 2 {
        return None;
    }
    let mut rng = SplitMix(seed.0 ^ seed.1.rotate_left(32));
    let mut first: Option<(usize, &Vm)> = None;
    for _ in 0..DRAWS {
        let i = (rng.next() % len as u64) as usize;
        if first.is_some_and(|(f, _)| f == i) {
            continue;
        }
        let Some(vm) = at(i) else { continue };
        let ok = usable(vm) && standing_of(lb, vm, verdicts, ready, now) == Standing::Preferred;
        if !ok {
            continue;
        }
        match first {
            None => first = Some((i, vm)),
            Some((_, a)) => {
                let b = vm;
                return Some(
                    if recent.count(&b.id, now, window) < recent.count(&a.id, now, window) {
                        b
                    } else {
                        a
                    },
                );
            }
        }
    }
    None
}

/// splitmix64: positions to draw from one seed of OS randomness.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Broker decisions per second for one LB of `backends` running VMs, measured
/// over `iterations` decisions: what the broker computes per connection from
/// the catalog — two backends drawn from the kept pool ([`draw`], every
/// backend only when that finds none), their effective health and whether
/// their nodes are Ready, P2C on recent connections (from OS randomness, as
/// the broker draws it), and recording the choice. In memory, no store, no IO.
/// One in ten backends is unhealthy, the rest healthy with fresh verdicts.
/// Called by the benchmark table (`crates/otherix-bench`).
pub fn bench_choose(backends: usize, iterations: usize) -> f64 {
    let now = OffsetDateTime::now_utc();
    let lb = LbRecord {
        name: "web-lb".into(),
        port: 8080,
        selector: "app=web".into(),
        health_kind: ProbeKind::Tcp,
        health_path: None,
        health_port: None,
        interval_ms: 2_000,
        timeout_ms: 1_000,
        rise: 2,
        fall: 3,
        created_at: now,
    };
    let vms: Vec<Vm> = (0..backends)
        .map(|i| Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: format!("web{i:04}"),
            id: format!("vm-{i:016x}"),
            network: "ov".into(),
            node: Some(format!("node{}", i % 16)),
            labels: [("app".to_string(), "web".to_string())].into(),
            mac: otherix_core::MacAddr([2, 0, 0, 0, (i >> 8 & 0xff) as u8, (i & 0xff) as u8]),
            ip: std::net::Ipv4Addr::new(
                10,
                (i >> 16 & 0xff) as u8,
                (i >> 8 & 0xff) as u8,
                (i & 0xff) as u8,
            ),
            state: VmState::Running,
            reason: None,
            exec: None,
            migrate_to: None,
            created_at: now,
        })
        .collect();
    let verdicts: Vec<VerdictRecord> = vms
        .iter()
        .enumerate()
        .map(|(i, vm)| VerdictRecord {
            lb: lb.name.clone(),
            vm_id: vm.id.clone(),
            node: vm.node.clone().unwrap_or_default(),
            health: if i % 10 == 9 {
                Health::Unhealthy
            } else {
                Health::Healthy
            },
            probed_at: now,
            changed_at: Some(now),
            reason: None,
            successes: 5,
            failures: 0,
        })
        .collect();
    let nodes: Vec<otherix_store::NodeRecord> = (0..16)
        .map(|i| otherix_store::NodeRecord {
            last_heartbeat: Some(now),
            ..otherix_store::NodeRecord::new(&format!("node{i}"), now)
        })
        .collect();
    // The catalog the broker reads: pools kept, verdicts by key.
    let m = crate::catalog::Model::build(crate::catalog::Snapshot {
        nodes,
        vms,
        lbs: vec![lb.clone()],
        verdicts,
        ..Default::default()
    });
    let recent = RecentConnections::default();
    let window = Duration::minutes(5);
    let entry = m.lb(&lb.name).expect("the LB was loaded");
    let started = std::time::Instant::now();
    for _ in 0..iterations {
        // As the broker does: a draw, and every backend only when it finds none.
        let verdicts = |vm: &Vm| m.verdict(&lb.name, &vm.id);
        let ready = |vm: &Vm| node_ready(&m, vm, now, Duration::seconds(10));
        let random = crate::random::pair();
        let drawn = draw(
            &lb,
            entry.pool.len(),
            |i| m.backend_at(entry, i),
            |_| true,
            &verdicts,
            &ready,
            &recent,
            window,
            now,
            random,
        );
        let chosen = match drawn {
            Some(vm) => Some(vm),
            None => choose(
                &lb,
                &m.backends(entry),
                &verdicts,
                &ready,
                &recent,
                window,
                now,
                random,
            )
            .ok(),
        };
        if let Some(vm) = chosen {
            recent.record(&vm.id, now, window);
        }
    }
    iterations as f64 / started.elapsed().as_secs_f64().max(f64::MIN_POSITIVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_ready(_: &Vm) -> bool {
        true
    }

    fn lb() -> LbRecord {
        LbRecord {
            name: "web-lb".into(),
            port: 8080,
            selector: "app=web".into(),
            health_kind: ProbeKind::Tcp,
            health_path: None,
            health_port: None,
            interval_ms: 1_000,
            timeout_ms: 500,
            rise: 2,
            fall: 3,
            created_at: OffsetDateTime::UNIX_EPOCH,
        }
    }

    fn vm(name: &str, node: &str) -> Vm {
        Vm {
            migration_id: Default::default(),
            migration_port: Default::default(),
            accelerator: None,
            machine: None,
            runtime: Default::default(),
            name: name.into(),
            id: format!("id-{name}"),
            network: "ov".into(),
            node: Some(node.into()),
            labels: [("app".to_string(), "web".to_string())].into(),
            mac: "02:00:00:00:00:01".parse().unwrap(),
            ip: "10.0.0.2".parse().unwrap(),
            state: VmState::Running,
            reason: None,
            exec: None,
            migrate_to: None,
            created_at: OffsetDateTime::UNIX_EPOCH,
        }
    }

    fn verdict(vm: &Vm, node: &str, health: &str, at: OffsetDateTime) -> VerdictRecord {
        let health = Health::parse(health).unwrap();
        VerdictRecord {
            lb: "web-lb".into(),
            vm_id: vm.id.clone(),
            node: node.into(),
            health,
            probed_at: at,
            changed_at: Some(at),
            reason: Some("connect: refused".into()),
            successes: 0,
            failures: 3,
        }
    }

    #[test]
    fn only_the_owning_nodes_fresh_verdict_counts() {
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let (a, b) = (vm("web01", "node1"), vm("web02", "node2"));
        let verdicts = [
            verdict(&a, "node1", "unhealthy", now),
            // web02 moved to node2: node1's old verdict on it no longer counts.
            verdict(&b, "node1", "unhealthy", now),
        ];
        let recent = RecentConnections::default();
        for r in 0..20 {
            let got = choose(
                &lb(),
                &[&a, &b],
                &Verdicts::of(&lb(), &verdicts),
                &all_ready,
                &recent,
                Duration::minutes(5),
                now,
                (r, r + 1),
            );
            assert_eq!(got.unwrap().name, "web02");
        }
        // A stale verdict (the reporting pipeline broke) is unknown, so served.
        let later = now + Duration::seconds(16);
        assert_eq!(backend(&lb(), &a, &verdicts, true, later).health, Health::Unknown);
        assert!(backend(&lb(), &a, &verdicts, true, later).eligible);
    }

    #[test]
    fn an_all_unhealthy_pool_is_refused_with_every_backend_explained() {
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let (a, b) = (vm("web01", "node1"), vm("web02", "node2"));
        let verdicts = [
            verdict(&a, "node1", "unhealthy", now),
            verdict(&b, "node2", "unhealthy", now),
        ];
        let recent = RecentConnections::default();
        let why = choose(
            &lb(),
            &[&a, &b],
            &Verdicts::of(&lb(), &verdicts),
            &all_ready,
            &recent,
            Duration::minutes(5),
            now,
            (0, 1),
        )
        .unwrap_err();
        let names: Vec<&str> = why.iter().map(|b| b.vm.as_str()).collect();
        assert_eq!(names, ["web01", "web02"]);
        assert!(why.iter().all(|b| b.health == Health::Unhealthy && !b.eligible));
        assert_eq!(why[0].reason.as_deref(), Some("connect: refused"));
    }

    #[test]
    fn a_draw_serves_only_usable_eligible_backends_spreads_over_them_and_leaves_a_refusal_to_choose() {
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let vms: Vec<Vm> = (0..40).map(|i| vm(&format!("web{i:02}"), "node1")).collect();
        // Every fourth is unhealthy; web01 is not the asker's to reach.
        let verdicts: Vec<VerdictRecord> = vms
            .iter()
            .enumerate()
            .map(|(i, v)| verdict(v, "node1", if i % 4 == 0 { "unhealthy" } else { "healthy" }, now))
            .collect();
        let verdicts = Verdicts::of(&lb(), &verdicts);
        let recent = RecentConnections::default();
        let window = Duration::minutes(5);
        let usable = |vm: &Vm| vm.name != "web01";
        let mut served = std::collections::BTreeMap::new();
        for r in 0..2_000u64 {
            let got = draw(
                &lb(),
                vms.len(),
                |i| vms.get(i),
                usable,
                &verdicts,
                &all_ready,
                &recent,
                window,
                now,
                (r, r.wrapping_mul(7919)),
            )
            .expect("most of the pool is eligible: a draw finds two");
            recent.record(&got.id, now, window);
            *served.entry(got.name.clone()).or_insert(0u32) += 1;
        }
        let index = |name: &str| name[3..].parse::<usize>().unwrap();
        assert!(
            served.keys().all(|n| index(n) % 4 != 0 && n != "web01"),
            "{served:?}"
        );
        // 29 eligible and usable: P2C on recent connections spreads them evenly.
        assert_eq!(served.len(), 29, "{served:?}");
        let (lo, hi) = (served.values().min().unwrap(), served.values().max().unwrap());
        assert!(hi - lo <= 3, "even spread: {served:?}");

        // All unhealthy: no draw, and `choose` explains.
        let sick: Vec<VerdictRecord> = vms
            .iter()
            .map(|v| verdict(v, "node1", "unhealthy", now))
            .collect();
        let sick = Verdicts::of(&lb(), &sick);
        let drawn = draw(
            &lb(),
            vms.len(),
            |i| vms.get(i),
            |_| true,
            &sick,
            &all_ready,
            &recent,
            window,
            now,
            (1, 2),
        );
        assert!(drawn.is_none());
        let pool: Vec<&Vm> = vms.iter().collect();
        assert!(choose(&lb(), &pool, &sick, &all_ready, &recent, window, now, (1, 2)).is_err());
        // One backend: `choose` decides.
        assert!(draw(
            &lb(),
            1,
            |i| vms.get(i),
            |_| true,
            &verdicts,
            &all_ready,
            &recent,
            window,
            now,
            (1, 2)
        )
        .is_none());
    }

    #[test]
    fn recent_connections_stay_one_count_per_backend_however_many_are_recorded() {
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let window = Duration::minutes(5);
        let recent = RecentConnections::default();
        // A pool of one: every connection goes to the same backend.
        for i in 0..1_000_000i64 {
            recent.record("id-web01", now + Duration::microseconds(i * 50), window);
        }
        let then = now + Duration::seconds(50);
        assert_eq!(recent.backends(), 1);
        assert_eq!(recent.count("id-web01", then, window), 1_000_000);
        // Backends that got nothing for a window are dropped at the next record.
        for i in 0..1_000 {
            recent.record(&format!("id-gone{i}"), then, window);
        }
        assert_eq!(recent.backends(), 1_001);
        let later = then + window + Duration::minutes(1);
        assert_eq!(recent.count("id-web01", later, window), 0);
        recent.record("id-web02", later, window);
        assert_eq!(recent.backends(), 1);
        assert_eq!(recent.count("id-web02", later, window), 1);
    }

    #[test]
    fn the_backend_with_fewer_recent_connections_wins() {
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let window = Duration::minutes(5);
        let (a, b) = (vm("web01", "node1"), vm("web02", "node2"));
        let none = Verdicts::of(&lb(), &[]);
        let recent = RecentConnections::default();
        for _ in 0..5 {
            recent.record(&a.id, now - Duration::minutes(1), window);
        }
        recent.record(&b.id, now - Duration::minutes(1), window);
        let pair = [a.clone(), b.clone()];
        for r in 0..50u64 {
            let seed = (r, r.wrapping_mul(0x9E37_79B9));
            let chosen = choose(&lb(), &[&a, &b], &none, &all_ready, &recent, window, now, seed).unwrap();
            assert_eq!(chosen.name, "web02");
            // A draw from a pool of two finds both and keeps the same one.
            let drawn = draw(
                &lb(),
                2,
                |i| pair.get(i),
                |_| true,
                &none,
                &all_ready,
                &recent,
                window,
                now,
                seed,
            );
            assert_eq!(drawn.unwrap().name, "web02");
        }
        // Once web01's connections age out of the window, it is the less loaded.
        let later = now + Duration::minutes(4) + Duration::seconds(30);
        recent.record(&b.id, later, window);
        let chosen = choose(
            &lb(),
            &[&a, &b],
            &none,
            &all_ready,
            &recent,
            window,
            later,
            (0, 1),
        )
        .unwrap();
        assert_eq!(chosen.name, "web01");
    }

    #[test]
    fn backends_on_not_ready_nodes_are_served_only_when_no_other_is_eligible() {
        let now = OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap();
        let window = Duration::minutes(5);
        let (a, b, c) = (vm("web01", "dead"), vm("web02", "node2"), vm("web03", "node2"));
        let ready = |vm: &Vm| vm.node.as_deref() != Some("dead");
        let none = Verdicts::of(&lb(), &[]);
        let recent = RecentConnections::default();
        // web01 has the fewest connections, and P2C would favour it.
        for vm in [&b, &c] {
            recent.record(&vm.id, now, window);
        }
        let pool = [a.clone(), b.clone(), c.clone()];
        for r in 0..100u64 {
            let seed = (r, r.wrapping_mul(7919));
            let chosen = choose(&lb(), &[&a, &b, &c], &none, &ready, &recent, window, now, seed).unwrap();
            assert_ne!(chosen.name, "web01");
            if let Some(drawn) = draw(
                &lb(),
                3,
                |i| pool.get(i),
                |_| true,
                &none,
                &ready,
                &recent,
                window,
                now,
                seed,
            ) {
                assert_ne!(drawn.name, "web01");
            }
        }
        // The others confirmed unhealthy: the NotReady node's backend is served.
        let sick = [
            verdict(&b, "node2", "unhealthy", now),
            verdict(&c, "node2", "unhealthy", now),
        ];
        let sick = Verdicts::of(&lb(), &sick);
        for r in 0..20u64 {
            let chosen = choose(
                &lb(),
                &[&a, &b, &c],
                &sick,
                &ready,
                &recent,
                window,
                now,
                (r, r + 1),
            );
            assert_eq!(chosen.unwrap().name, "web01");
        }
        // `lb get` says why it gets nothing while the others are eligible.
        let shown = view(&lb(), &[&a, &b], &none, &ready, now, true);
        let flags: Vec<(bool, bool)> = shown
            .backends
            .iter()
            .map(|b| (b.eligible, b.node_ready))
            .collect();
        assert_eq!(flags, [(true, false), (true, true)]);
    }

    /// The benchmark figure for docs/benchmarks.md:
    /// `cargo test --release -p otherix-server lb_choice_rate -- --ignored --nocapture`.
    #[test]
    #[ignore = "a benchmark, run by hand in release mode"]
    fn lb_choice_rate_with_1000_backends() {
        let rate = bench_choose(1000, 2000);
        println!("broker decisions per second, LB of 1000 backends: {rate:.0}");
    }

    #[test]
    fn bench_choose_runs_small_and_reports_a_rate() {
        let rate = bench_choose(50, 200);
        assert!(rate.is_finite() && rate > 0.0, "{rate}");
    }
}
