//! VM creates grouped into shared transactions (group commit). A create
//! queues its VM and either finds its answer already given, or becomes the
//! group's leader: it takes every VM queued meanwhile (its own among them),
//! writes them in one transaction (`Store::create_vms_each`: each VM refused
//! or created on its own), brings the catalog up to date once, places the
//! group's VMs with one scheduler pass and one write, and answers each. So
//! a burst of creates costs a few statements, one catch-up and one round of
//! wakes per group instead of per VM, and a lone create costs what it did.

use std::sync::Mutex;

use otherix_proto::Vm;
use otherix_store::{NewVm, StoreError};
use time::OffsetDateTime;
use tokio::sync::oneshot;

use crate::error::ApiError;
use crate::random;
use crate::state::AppState;

/// Most VMs one group writes.
const MAX_GROUP: usize = 256;

/// The queue of creates waiting for a group, and the right to lead one.
#[derive(Debug, Default)]
pub struct CreateGroups {
    queue: Mutex<Vec<Waiting>>,
    leader: tokio::sync::Mutex<()>,
}

#[derive(Debug)]
struct Waiting {
    new: NewVm,
    done: oneshot::Sender<Result<Vm, ApiError>>,
}

impl CreateGroups {
    /// Creates `new` in the next group, and answers with the VM as the
    /// catalog holds it then (placed, if a hypervisor was Ready).
    pub async fn create(&self, state: &AppState, new: NewVm) -> Result<Vm, ApiError> {
        let (done, mut answer) = oneshot::channel();
        lock(&self.queue).push(Waiting { new, done });
        loop {
            let lead = tokio::select! {
                biased;
                answer = &mut answer => {
                    return answer.unwrap_or_else(|_| Err(ApiError::Internal("a VM create group was dropped".into())))
                }
                lead = self.leader.lock() => lead,
            };
            // Our VM may have been in the group that just finished.
            if let Ok(answer) = answer.try_recv() {
                return answer;
            }
            let group: Vec<Waiting> = {
                let mut queue = lock(&self.queue);
                let n = queue.len().min(MAX_GROUP);
                queue.drain(..n).collect()
            };
            // On a task of its own: a leader whose caller goes away (a
            // dropped request) still answers the group it took.
            let state = state.clone();
            let _ = tokio::spawn(async move { run(&state, group).await }).await;
            drop(lead);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Writes one group and answers each of its creates.
async fn run(state: &AppState, group: Vec<Waiting>) {
    if group.is_empty() {
        return;
    }
    let news: Vec<NewVm> = group.iter().map(|w| w.new.clone()).collect();
    let now = OffsetDateTime::now_utc();
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
    let created: Vec<&Vm> = answers.iter().filter_map(|a| a.as_ref().ok()).collect();
    for vm in &created {
        tracing::info!(vm = %vm.name, vm_id = %vm.id, network = %vm.network, ip = %vm.ip, mac = %vm.mac, "vm created");
    }
    let placed = if created.is_empty() {
        Ok(())
    } else {
        settle(state, created.iter().any(|vm| vm.node.is_none())).await
    };
    let m = state.catalog.read();
    for (w, answer) in group.into_iter().zip(answers) {
        let answer = match (answer, &placed) {
            (Err(e), _) => Err(e.into()),
            // Created, but the catch-up or the placement failed: the VM is
            // there and a later heartbeat places it; the create succeeded.
            (Ok(vm), Err(_)) => Ok(vm),
            (Ok(vm), Ok(())) => Ok(m.vm(&vm.id).cloned().unwrap_or(vm)),
        };
        // The create's caller may have gone (a dropped request): its VM stays.
        let _ = w.done.send(answer);
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
