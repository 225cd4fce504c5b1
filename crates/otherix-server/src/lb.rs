//! Load balancers over a store snapshot: the computed pool, each backend's
//! effective health, and the choice of one backend per connection.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Mutex;

use otherix_api::{HealthCheckSpec, LbBackend, LoadBalancer, Vm, VmState};
use otherix_core::lb::{effective, eligible, p2c, pool_status, Health};
use otherix_core::selector::Selector;
use otherix_store::{LbRecord, VerdictRecord};
use time::{Duration, OffsetDateTime};

/// The VMs an LB's selector matches now.
pub fn pool<'a>(lb: &LbRecord, vms: &'a [Vm]) -> Vec<&'a Vm> {
    let Ok(sel) = lb.selector.parse::<Selector>() else {
        return vec![];
    };
    vms.iter().filter(|vm| sel.matches(&vm.labels)).collect()
}

fn parse_health(s: &str) -> Health {
    match s {
        "healthy" => Health::Healthy,
        "unhealthy" => Health::Unhealthy,
        _ => Health::Unknown,
    }
}

/// A backend as the broker and `lb get` see it. Only a verdict from the
/// node that owns the VM now counts; a stale one counts as unknown.
pub fn backend(lb: &LbRecord, vm: &Vm, verdicts: &[VerdictRecord], now: OffsetDateTime) -> LbBackend {
    let interval = Duration::milliseconds(lb.interval_ms as i64);
    let v = verdicts
        .iter()
        .find(|v| v.lb == lb.name && v.vm_id == vm.id && Some(&v.node) == vm.node.as_ref());
    let health = match v {
        Some(v) => effective(parse_health(&v.health), Some(v.probed_at), interval, now),
        None => Health::Unknown,
    };
    LbBackend {
        vm: vm.name.clone(),
        node: vm.node.clone(),
        ip: vm.ip.clone(),
        health: health.as_str().into(),
        last_probe: v.map(|v| v.probed_at),
        last_change: v.and_then(|v| v.changed_at),
        reason: match (v, vm.state) {
            (_, s) if s != VmState::Running => Some(format!("vm is {s}")),
            (Some(v), _) => v.reason.clone(),
            (None, _) => None,
        },
        successes: v.map(|v| v.successes).unwrap_or(0),
        failures: v.map(|v| v.failures).unwrap_or(0),
        eligible: vm.state == VmState::Running && eligible(health),
    }
}

pub fn spec(lb: &LbRecord) -> HealthCheckSpec {
    HealthCheckSpec {
        kind: lb.health_kind.clone(),
        path: lb.health_path.clone(),
        port: lb.health_port,
        interval_ms: lb.interval_ms,
        timeout_ms: lb.timeout_ms,
        rise: lb.rise,
        fall: lb.fall,
    }
}

/// The LB with its pool summarized (and, with `detail`, each backend).
pub fn view(
    lb: &LbRecord,
    vms: &[Vm],
    verdicts: &[VerdictRecord],
    now: OffsetDateTime,
    detail: bool,
) -> LoadBalancer {
    let backends: Vec<LbBackend> = pool(lb, vms)
        .into_iter()
        .map(|vm| backend(lb, vm, verdicts, now))
        .collect();
    let healths: Vec<Health> = backends.iter().map(|b| parse_health(&b.health)).collect();
    LoadBalancer {
        name: lb.name.clone(),
        port: lb.port,
        selector: lb.selector.clone(),
        health_check: spec(lb),
        status: pool_status(&healths).as_str().into(),
        healthy: healths.iter().filter(|h| **h == Health::Healthy).count() as u32,
        total: backends.len() as u32,
        created_at: lb.created_at,
        backends: if detail { backends } else { vec![] },
    }
}

/// Connections recently brokered to each backend, the load P2C compares.
/// Until gateways report per-backend sessions, a connection counts for as
/// long as its credential could be in use (the credential TTL).
#[derive(Debug, Default)]
pub struct RecentConnections {
    by_vm: Mutex<HashMap<String, VecDeque<OffsetDateTime>>>,
}

impl RecentConnections {
    pub fn count(&self, vm_id: &str, now: OffsetDateTime, window: Duration) -> u32 {
        let Ok(mut map) = self.by_vm.lock() else { return 0 };
        let Some(q) = map.get_mut(vm_id) else { return 0 };
        while q.front().is_some_and(|t| now - *t > window) {
            q.pop_front();
        }
        q.len() as u32
    }

    pub fn record(&self, vm_id: &str, now: OffsetDateTime) {
        if let Ok(mut map) = self.by_vm.lock() {
            map.entry(vm_id.to_string()).or_default().push_back(now);
        }
    }
}

/// Picks one eligible backend by power of two choices, or explains why none.
pub fn choose<'a>(
    lb: &LbRecord,
    candidates: &[&'a Vm],
    verdicts: &[VerdictRecord],
    recent: &RecentConnections,
    window: Duration,
    now: OffsetDateTime,
    random: (u64, u64),
) -> Result<&'a Vm, Vec<LbBackend>> {
    let views: Vec<LbBackend> = candidates
        .iter()
        .map(|vm| backend(lb, vm, verdicts, now))
        .collect();
    let active: Vec<u32> = candidates
        .iter()
        .map(|vm| recent.count(&vm.id, now, window))
        .collect();
    let ok: Vec<bool> = views.iter().map(|b| b.eligible).collect();
    match p2c(&active, &ok, random.0, random.1) {
        Some(i) => Ok(candidates[i]),
        None => Err(views),
    }
}

/// Health checks for the LB backends placed on `node`.
pub fn checks_for_node(node: &str, lbs: &[LbRecord], vms: &[Vm]) -> Vec<otherix_api::agent::HealthCheck> {
    let mut out = BTreeMap::new();
    for lb in lbs {
        for vm in pool(lb, vms)
            .into_iter()
            .filter(|vm| vm.node.as_deref() == Some(node))
        {
            let check = otherix_api::agent::HealthCheck {
                lb: lb.name.clone(),
                vm_id: vm.id.clone(),
                network: vm.network.clone(),
                ip: vm.ip.clone(),
                port: lb.health_port.unwrap_or(lb.port),
                kind: lb.health_kind.clone(),
                path: lb.health_path.clone(),
                interval_ms: lb.interval_ms,
                timeout_ms: lb.timeout_ms,
                rise: lb.rise,
                fall: lb.fall,
            };
            out.insert((lb.name.clone(), vm.id.clone()), check);
        }
    }
    out.into_values().collect()
}
