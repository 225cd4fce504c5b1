//! VM creates grouped into shared transactions (group commit). A create
//! queues its VM and either finds its answer already given, or becomes the
//! group's leader: it takes every VM queued meanwhile (its own among them),
//! chooses their nodes as the scheduler would, writes them placed in one
//! transaction (`Store::create_vms_each`: each VM refused or created on its
//! own), brings the catalog up to date once, and answers each (the queue
//! and its leader: [`crate::groups`]). So
//! a burst of creates costs a few statements, one catch-up and one round of
//! wakes per group instead of per VM, and a lone create costs what it did.
//! LB creates are grouped the same way (`Store::create_lbs_each`, one
//! catch-up per group).
//!
//! Groups are pipelined: the next group is formed and written as soon as
//! the one before is written, while that one's catch-up runs. The guests a
//! group wrote placed count towards their nodes' load ([`InTransit`])
//! until the catalog holds them, so the next group's choices see them.
use std::collections::HashMap;
use std::sync::Mutex;

use otherix_proto::{NetworkType, Vm};
use otherix_store::{LbRecord, NewVm, StoreError};
use time::OffsetDateTime;

use crate::error::ApiError;
use crate::groups::{lock, Groups, Lead};
use crate::random;
use crate::schedule;
use crate::state::AppState;

/// VM and LB creates, each kind grouped on its own.
#[derive(Debug, Default)]
pub struct CreateGroups {
    vms: Groups<NewVm, Vm>,
    lbs: Groups<LbRecord, LbRecord>,
    /// Guests written placed that the catalog may not hold yet.
    in_transit: InTransit,
}

/// Guests written placed whose catch-up has not finished, by node: the
/// catalog's load misses them until it holds them, and the scheduler's
/// next choices must not (a burst would otherwise pile onto the node that
/// looked least loaded). Counted from the write to the end of the
/// catch-up, so for a moment a guest may count twice, never not at all.
#[derive(Debug, Default)]
pub struct InTransit(Mutex<HashMap<String, usize>>);

impl InTransit {
    /// The guests in transit, by node: what the scheduler adds to the
    /// catalog's load before it chooses.
    pub fn load(&self) -> HashMap<String, usize> {
        lock(&self.0).clone()
    }

    /// Counts `nodes`' guests as written, not yet in the catalog.
    pub fn add(&self, nodes: &HashMap<String, usize>) {
        let mut m = lock(&self.0);
        for (node, n) in nodes {
            *m.entry(node.clone()).or_default() += n;
        }
    }

    /// Takes back what [`InTransit::add`] counted, once the catalog holds it.
    pub fn remove(&self, nodes: &HashMap<String, usize>) {
        let mut m = lock(&self.0);
        for (node, n) in nodes {
            if let Some(have) = m.get_mut(node) {
                *have = have.saturating_sub(*n);
                if *have == 0 {
                    m.remove(node);
                }
            }
        }
    }
}

impl CreateGroups {
    /// Guests written placed that the catalog may not hold yet.
    pub fn in_transit(&self) -> &InTransit {
        &self.in_transit
    }

    /// The VM creates' queue: how many wait, whether a group writes.
    pub fn vms(&self) -> &Groups<NewVm, Vm> {
        &self.vms
    }

    /// The LB creates' queue.
    pub fn lbs(&self) -> &Groups<LbRecord, LbRecord> {
        &self.lbs
    }

    /// Creates `new` in the next group, and answers with the VM as the
    /// catalog holds it then (placed, if a hypervisor was Ready).
    pub async fn create(&self, state: &AppState, new: NewVm) -> Result<Vm, ApiError> {
        self.vms
            .submit(new, |group, lead| {
                let state = state.clone();
                async move { run(&state, group, lead).await }
            })
            .await
    }

    /// Creates LB `lb` in the next group (`Store::create_lbs_each`: each
    /// refused or created on its own), and answers once the catalog holds
    /// it.
    pub async fn create_lb(&self, state: &AppState, lb: LbRecord) -> Result<LbRecord, ApiError> {
        self.lbs
            .submit(lb, |group, lead| {
                let state = state.clone();
                async move { run_lbs(&state, group, lead).await }
            })
            .await
    }
}

/// Writes one group of VMs, placed as they are written; one answer each.
/// Lets go of `lead` (and the scheduler's lock) once the group is written
/// and its guests count [`InTransit`], then brings the catalog up to date.
async fn run(state: &AppState, mut news: Vec<NewVm>, lead: Lead) -> Vec<Result<Vm, ApiError>> {
    if news.is_empty() {
        return Vec::new();
    }
    let now = OffsetDateTime::now_utc();
    let started = std::time::Instant::now();
    metrics::histogram!("otherix_vm_create_group_size").record(news.len() as f64);
    // The scheduler's lock from the choice until the group's guests count
    // in transit: no heartbeat places VMs from a load that misses these.
    let scheduling = state.scheduling.lock().await;
    place(state, &mut news, now);
    let placed_at = std::time::Instant::now();
    let answers: Vec<Result<Vm, StoreError>> = match state
        .store
        .create_vms_each(&news, random::mac, now)
        .await
    {
        Ok(answers) => answers,
        // An error of the store, not a refusal: nothing was written. Each
        // create is tried alone, so one VM's trouble is its own.
        Err(e) => {
            tracing::warn!(error = %e, vms = news.len(), "a group of VM creates failed; trying each alone");
            let mut answers = Vec::with_capacity(news.len());
            for new in &news {
                answers.push(
                    match state
                        .store
                        .create_vms_each(std::slice::from_ref(new), random::mac, now)
                        .await
                    {
                        Ok(mut one) => one
                            .pop()
                            .unwrap_or_else(|| Err(StoreError::Invalid("no answer".into()))),
                        Err(e) => Err(e),
                    },
                );
            }
            answers
        }
    };
    let written_at = std::time::Instant::now();
    let created: Vec<&Vm> = answers.iter().filter_map(|a| a.as_ref().ok()).collect();
    let mut hosted: HashMap<String, usize> = HashMap::new();
    for vm in &created {
        tracing::info!(vm = %vm.name, vm_id = %vm.id, network = %vm.network, ip = %vm.ip, mac = %vm.mac, node = vm.node.as_deref().unwrap_or("-"), "vm created");
        if let Some(node) = &vm.node {
            *hosted.entry(node.clone()).or_default() += 1;
        }
    }
    let in_transit = state.creates.in_transit();
    in_transit.add(&hosted);
    drop(scheduling);
    // The next group forms and writes while this one catches up.
    drop(lead);
    let placed = if created.is_empty() {
        Ok(())
    } else {
        settle(state, created.iter().any(|vm| vm.node.is_none())).await
    };
    in_transit.remove(&hosted);
    let done = std::time::Instant::now();
    // Where a group's time goes: the scheduler's lock and the choice, the
    // store's transaction, the catalog's catch-up (and placing what the
    // group could not).
    metrics::histogram!("otherix_vm_create_group_seconds", "phase" => "place")
        .record((placed_at - started).as_secs_f64());
    metrics::histogram!("otherix_vm_create_group_seconds", "phase" => "write")
        .record((written_at - placed_at).as_secs_f64());
    metrics::histogram!("otherix_vm_create_group_seconds", "phase" => "catch_up")
        .record((done - written_at).as_secs_f64());
    let m = state.catalog.read();
    answers
        .into_iter()
        .map(|answer| match (answer, &placed) {
            (Err(e), _) => Err(e.into()),
            // Created, but the catch-up or the placement failed: the VM is
            // there and a later heartbeat places it; the create succeeded.
            (Ok(vm), Err(_)) => Ok(vm),
            (Ok(vm), Ok(())) => Ok(m.vm(&vm.id).cloned().unwrap_or(vm)),
        })
        .collect()
}

/// Chooses the node of each overlay VM of `news` that names none, as the
/// scheduler would once it is written (`schedule::choose_node`, each choice
/// counting towards the next), so that the group is written placed: no
/// second transaction and catch-up to place it, and its hosts learn of
/// their guests from one change. The caller holds the scheduler's lock
/// until the catalog holds the group. A VM no node can take now (none
/// Ready) and a bridge network's VM are left to the scheduler, as before.
pub fn place(state: &AppState, news: &mut [NewVm], now: OffsetDateTime) {
    let mut added = state.creates.in_transit().load();
    let m = state.catalog.read();
    for new in news.iter_mut().filter(|new| new.node.is_none()) {
        let Some(net) = m.network_ref(&new.network) else {
            continue;
        };
        if net.kind != NetworkType::Overlay {
            continue;
        }
        let hosts = m.hosts_by_load(net);
        if let Some(node) = schedule::choose_node(hosts, net, &added, now, state.settings.node_timeout) {
            *added.entry(node.name.clone()).or_default() += 1;
            new.node = Some(node.name.clone());
        }
    }
}

/// Writes one group of LBs, lets go of `lead`, brings the catalog up to
/// date once; one answer each.
async fn run_lbs(state: &AppState, lbs: Vec<LbRecord>, lead: Lead) -> Vec<Result<LbRecord, ApiError>> {
    if lbs.is_empty() {
        return Vec::new();
    }
    let answers = match state.store.create_lbs_each(&lbs).await {
        Ok(answers) => answers,
        // An error of the store, not a refusal: nothing was written.
        Err(e) => {
            tracing::warn!(error = %e, lbs = lbs.len(), "a group of LB creates failed; trying each alone");
            let mut answers = Vec::with_capacity(lbs.len());
            for lb in &lbs {
                answers.push(state.store.create_lb(lb).await);
            }
            answers
        }
    };
    // The next group forms and writes while this one catches up.
    drop(lead);
    if answers.iter().any(Result::is_ok) {
        // The LBs are written; a catch-up that fails here is retried by the
        // next one, and the answers are rendered after a catch-up of their own.
        if let Err(e) = state.catalog.sync().await {
            tracing::warn!(error = %e, "LBs created but the catalog did not catch up yet");
        }
    }
    answers.into_iter().map(|a| a.map_err(ApiError::from)).collect()
}

/// Brings the catalog up to date after creates written placed ([`place`]),
/// then lets go of the scheduler's lock (`scheduling`) and, when some VMs
/// still await a node, places them now if a hypervisor is Ready
/// (otherwise a later heartbeat will).
pub async fn settle_placed(
    state: &AppState,
    scheduling: tokio::sync::MutexGuard<'_, ()>,
    unplaced: bool,
) -> Result<(), ApiError> {
    let synced = state.catalog.sync().await.map(drop).map_err(ApiError::from);
    drop(scheduling);
    match synced {
        Ok(()) if unplaced => settle(state, true).await,
        Ok(()) => Ok(()),
        Err(e) => {
            tracing::warn!(error = %e, "VMs created but the catalog did not catch up yet; a heartbeat will place them");
            Err(e)
        }
    }
}

/// Brings the catalog up to date after creates and, when some VMs await
/// a node, places them now if a hypervisor is Ready (otherwise a later
/// heartbeat will).
pub async fn settle(state: &AppState, unplaced: bool) -> Result<(), ApiError> {
    let done = async {
        state.catalog.sync().await?;
        if unplaced {
            crate::api::nodes::schedule_pending(state, OffsetDateTime::now_utc()).await?;
        }
        Ok::<(), ApiError>(())
    }
    .await;
    if let Err(e) = &done {
        tracing::warn!(error = %e, "VMs created but not placed yet; a heartbeat will place them");
    }
    done
}
