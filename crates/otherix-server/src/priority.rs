//! Threads of their own for the short steps everyone else waits on: a
//! create group's turn (`creates`), the catalog's catch-up
//! (`Catalog::sync`) and a heartbeat's writes (`api::nodes`).
//!
//! Each of those steps is a few hand-overs to the store's thread (a
//! statement, a commit) with a little work in between, and while it runs,
//! the creates behind it and every heartbeat that syncs wait. On the
//! runtime that answers heartbeats, each hand-over came back to a queue of
//! heartbeat answers ready to run (at 1,000 nodes, a millisecond of work
//! each): a group's six statements took 14 ms where SQLite spent 0.2, and
//! the creates a second followed that, not the CPU (docs/benchmarks.md).
//! Here the step is polled again the moment the store answers. The
//! threads mostly wait in between: the work they do is what the callers
//! would have done themselves.

use std::future::Future;
use std::sync::OnceLock;

use tokio::task::JoinHandle;

/// Two worker threads for the process, started on first use (a process
/// may run several control planes in tests; they share them). Two, not
/// one: a catch-up applies what it read under the model's lock, which at
/// convergence is milliseconds of work, and with one thread every write's
/// next statement waited for it (the writer held meanwhile). Never shut
/// down: they live as long as the process.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("otherix-priority")
            .enable_all()
            .build()
            // Starting a thread fails only when the process is out of
            // threads or memory: nothing sensible runs after that.
            .expect("cannot start the control plane's priority threads")
    })
}

/// Runs `step` on the priority threads. The handle's output is the step's;
/// a panic in it comes back as the handle's error.
pub fn spawn<F>(step: F) -> JoinHandle<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    runtime().spawn(step)
}

/// Runs `step` on the priority threads and waits for it; a panic in it is
/// raised again here, as if it had run on the caller's task.
pub async fn run<F>(step: F) -> F::Output
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    match spawn(step).await {
        Ok(out) => out,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // The runtime is never shut down, and the handle is not aborted.
        Err(e) => unreachable!("a priority step was cancelled: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_step_runs_on_the_priority_thread_and_answers_its_caller() {
        let name = run(async { std::thread::current().name().map(str::to_owned) }).await;
        assert_eq!(name.as_deref(), Some("otherix-priority"));
    }

    #[tokio::test]
    async fn a_panic_in_a_step_is_the_callers() {
        let caught = tokio::spawn(run(async { panic!("in the step") })).await;
        let e = caught.expect_err("the caller's task panics");
        assert!(e.is_panic());
        // The thread is still there for the next step.
        assert_eq!(run(async { 7 }).await, 7);
    }
}
