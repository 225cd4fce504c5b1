//! Writes grouped into shared transactions (group commit): each writer
//! queues what it writes and either finds its answer already given, or
//! becomes the group's leader and writes what was queued meanwhile, its own
//! among it. A lone writer writes alone; a burst shares transactions, and
//! the store's one writer is taken once a group instead of once a write.
//! VM and LB creates ([`crate::creates`]) and heartbeats' writes
//! ([`crate::api::nodes`]) are grouped so.
use std::future::Future;
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, OwnedMutexGuard};

use crate::error::ApiError;

/// Most writes one group takes.
const MAX_GROUP: usize = 256;

/// A queue of writes of one kind waiting for a group, and the right to
/// lead one.
#[derive(Debug)]
pub struct Groups<I, O> {
    queue: Mutex<Vec<Waiting<I, O>>>,
    /// Held by a group from its forming to the end of its write: the next
    /// group forms once it is written (while a create group catches up).
    leader: Arc<tokio::sync::Mutex<()>>,
}

/// The right to lead the next group: a group's run lets go of it once its
/// write is done.
pub type Lead = OwnedMutexGuard<()>;

impl<I, O> Default for Groups<I, O> {
    fn default() -> Self {
        Groups {
            queue: Mutex::new(Vec::new()),
            leader: Arc::default(),
        }
    }
}

#[derive(Debug)]
struct Waiting<I, O> {
    new: I,
    done: oneshot::Sender<Result<O, ApiError>>,
}

impl<I: Send + 'static, O: Send + 'static> Groups<I, O> {
    /// Queues `new` and either finds its answer given, or leads the next
    /// group: `run` writes it (one answer per write, in order) and lets go
    /// of the lead once its write is done.
    pub async fn submit<F, Fut>(&self, new: I, run: F) -> Result<O, ApiError>
    where
        F: Fn(Vec<I>, Lead) -> Fut,
        Fut: Future<Output = Vec<Result<O, ApiError>>> + Send + 'static,
    {
        let (done, mut answer) = oneshot::channel();
        lock(&self.queue).push(Waiting { new, done });
        let dropped = || Err(ApiError::Internal("a group of writes was dropped".into()));
        loop {
            let lead = tokio::select! {
                biased;
                answer = &mut answer => return answer.unwrap_or_else(|_| dropped()),
                lead = self.leader.clone().lock_owned() => lead,
            };
            // Ours may have been in the group that just finished.
            if let Ok(answer) = answer.try_recv() {
                return answer;
            }
            let (news, dones): (Vec<I>, Vec<_>) = {
                let mut queue = lock(&self.queue);
                let n = queue.len().min(MAX_GROUP);
                queue.drain(..n).map(|w| (w.new, w.done)).unzip()
            };
            if news.is_empty() {
                // Ours is in a group still catching up: nothing to lead.
                drop(lead);
                return answer.await.unwrap_or_else(|_| dropped());
            }
            // On a task of its own: a leader whose caller goes away (a
            // dropped request) still answers the group it took.
            let written = run(news, lead);
            tokio::spawn(async move {
                let answers = written.await;
                for (done, answer) in dones.into_iter().zip(answers) {
                    // The writer's caller may have gone (a dropped request): what it wrote stays.
                    let _ = done.send(answer);
                }
            });
        }
    }
}

impl<I, O> Groups<I, O> {
    /// How many writes wait for a group.
    pub fn waiting(&self) -> usize {
        lock(&self.queue).len()
    }

    /// Whether a group is formed and writing (its leader holds the lead).
    pub fn leading(&self) -> bool {
        self.leader.try_lock().is_err()
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    type Answers = std::pin::Pin<Box<dyn Future<Output = Vec<Result<u32, ApiError>>> + Send>>;

    /// Answers each write with its double, recording the groups' sizes; the
    /// first group waits for `gate`.
    fn doubling(
        sizes: Arc<Mutex<Vec<usize>>>,
        gate: Arc<tokio::sync::Notify>,
    ) -> impl Fn(Vec<u32>, Lead) -> Answers {
        move |group, lead| {
            let (sizes, gate) = (sizes.clone(), gate.clone());
            Box::pin(async move {
                let first = {
                    let mut sizes = lock(&sizes);
                    sizes.push(group.len());
                    sizes.len() == 1
                };
                if first {
                    gate.notified().await;
                }
                drop(lead);
                group.into_iter().map(|n| Ok(n * 2)).collect()
            })
        }
    }

    #[tokio::test]
    async fn writes_queued_while_a_group_writes_are_the_next_group_and_each_gets_its_own_answer() {
        let groups: Arc<Groups<u32, u32>> = Arc::default();
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let gate = Arc::new(tokio::sync::Notify::new());
        let run = Arc::new(doubling(sizes.clone(), gate.clone()));
        let mut tasks = tokio::task::JoinSet::new();
        let submit = |n: u32| {
            let (groups, run) = (groups.clone(), run.clone());
            async move { (n, groups.submit(n, |g, l| run(g, l)).await) }
        };
        tasks.spawn(submit(0));
        // The first leads a group of one, held at the gate.
        while lock(&sizes).is_empty() {
            tokio::task::yield_now().await;
        }
        for n in 1..10 {
            tasks.spawn(submit(n));
        }
        while lock(&groups.queue).len() < 9 {
            tokio::task::yield_now().await;
        }
        gate.notify_one();
        let mut answered = Vec::new();
        while let Some(done) = tasks.join_next().await {
            let (n, answer) = done.unwrap();
            assert_eq!(answer.unwrap(), n * 2, "write {n} got another's answer");
            answered.push(n);
        }
        answered.sort_unstable();
        assert_eq!(answered, (0..10).collect::<Vec<_>>());
        assert_eq!(*lock(&sizes), [1, 9], "the nine queued meanwhile are one group");
    }
}
