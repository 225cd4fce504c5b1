//! The broker's log of the credentials it mints to VMs: at info, one
//! summary line per [`EVERY`] (how many), not one line per credential.
//!
//! A credential to a VM is recorded in full by its audit row (principal,
//! VM, port, gateway, time: `otherix audit`), durable before the credential
//! leaves, and counted by `otherix_credentials_minted_total`; the line per
//! credential said nothing more, and formatting and writing it cost ~4.5 %
//! of the CP's CPU per credential. It is still there at debug. Refusals
//! and credentials to a load balancer's backend keep their line per call at
//! info: a refusal's reason is what an operator looks for, and the backend
//! a load balancer gave is in no audit row.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often the summary line is written (when anything was brokered).
pub const EVERY: Duration = Duration::from_secs(10);

/// Credentials minted to VMs since the last summary.
#[derive(Debug, Default)]
pub struct Tally {
    count: AtomicU64,
}

impl Tally {
    /// Counts one credential.
    pub fn add(&self) {
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// What was counted since the last call, and starts over: each
    /// credential is in exactly one summary.
    pub fn take(&self) -> u64 {
        self.count.swap(0, Ordering::Relaxed)
    }
}

/// Writes the summary line every `every` ([`EVERY`] in the server) while
/// anything was brokered, until the tally is dropped (the server stopped).
pub fn spawn_summary(tally: &Arc<Tally>, every: Duration) -> tokio::task::JoinHandle<()> {
    let tally: Weak<Tally> = Arc::downgrade(tally);
    tokio::spawn(async move {
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let Some(tally) = tally.upgrade() else { return };
            summary(tally.take(), every.period());
        }
    })
}

/// The summary line, when there is anything to say.
fn summary(credentials: u64, period: Duration) {
    if credentials > 0 {
        tracing::info!(
            credentials,
            seconds = period.as_secs_f64(),
            "credentials brokered to VMs (each in the audit trail)"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_credential_counted_is_in_exactly_one_summary() {
        let tally = Arc::new(Tally::default());
        let adders: Vec<_> = (0..4)
            .map(|_| {
                let tally = tally.clone();
                std::thread::spawn(move || {
                    let mut taken = 0;
                    for i in 0..10_000 {
                        tally.add();
                        if i % 97 == 0 {
                            taken += tally.take();
                        }
                    }
                    taken
                })
            })
            .collect();
        let taken: u64 = adders.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(taken + tally.take(), 40_000);
        assert_eq!(tally.take(), 0, "taken once");
    }

    #[tokio::test]
    async fn the_summary_task_takes_the_count_and_ends_once_the_tally_is_dropped() {
        let tally = Arc::new(Tally::default());
        let task = spawn_summary(&tally, Duration::from_millis(1));
        tally.add();
        while tally.count.load(Ordering::Relaxed) != 0 {
            tokio::task::yield_now().await;
        }
        drop(tally);
        task.await.expect("the summary task ends, not panics");
    }
}
