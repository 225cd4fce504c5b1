//! Heartbeat at once when the control plane says this node's desired state
//! changed, instead of on the next tick.
//!
//! After each answered heartbeat the agent keeps one request open to `GET
//! /v1/agent/desired/wait?version=V` (see the control plane's `api::wake`).
//! Its answer only wakes the heartbeat loop; the state itself still comes
//! from the heartbeat, so nothing here can make a node apply something the
//! heartbeat did not hand it. A control plane without the endpoint (404)
//! turns the wake off for good; any other failure until the next answered
//! heartbeat, which is as often as the agent would have heartbeated anyway.

use std::future::{pending, Future};
use std::pin::Pin;
use std::time::Duration;

use otherix_client::{Client, ClientError};
use tokio::time::Instant;
use tracing::{debug, info};

/// A woken heartbeat starts at least this long after the previous one: a
/// control plane that kept answering "changed" could not make the agent spin.
pub const MIN_SPACING: Duration = Duration::from_millis(50);

type Waiting = Pin<Box<dyn Future<Output = Result<bool, ClientError>> + Send>>;

/// The one open wait, and what it waits on.
pub struct Wake {
    client: Client,
    version: Option<u64>,
    waiting: Option<Waiting>,
    off: bool,
}

impl Wake {
    pub fn new(client: Client) -> Wake {
        Wake {
            client,
            version: None,
            waiting: None,
            off: false,
        }
    }

    /// After an answered heartbeat: keeps waiting on `version`, or starts to.
    pub fn watch(&mut self, version: u64) {
        if self.off || (self.version == Some(version) && self.waiting.is_some()) {
            return;
        }
        self.version = Some(version);
        self.start(version);
    }

    fn start(&mut self, version: u64) {
        let client = self.client.clone();
        self.waiting = Some(Box::pin(async move {
            // The control plane answers within its hold; this only guards
            // against a connection that died without a word.
            let hold = Duration::from_secs(45);
            match tokio::time::timeout(hold, client.wait_desired(version)).await {
                Ok(r) => r.map(|w| w.changed),
                Err(_) => Ok(false),
            }
        }));
    }

    /// Completes when the control plane reports a change. Cancel-safe: the
    /// request lives in `self`, so a `select!` that drops this future loses
    /// nothing.
    pub async fn changed(&mut self) {
        loop {
            let Some(waiting) = self.waiting.as_mut() else {
                return pending().await;
            };
            let result = waiting.await;
            self.waiting = None;
            match result {
                Ok(true) => return,
                Ok(false) => {
                    if let Some(v) = self.version {
                        self.start(v);
                    }
                }
                Err(ClientError::Api { status: 404, .. }) => {
                    info!("the control plane has no desired-state wait; changes arrive with heartbeats");
                    self.off = true;
                }
                // Tried again after the next answered heartbeat.
                Err(e) => debug!(error = %e, "desired-state wait failed"),
            }
        }
    }
}

/// When a woken heartbeat may start, given when the last one did.
pub fn woken_beat(now: Instant, last_beat: Instant) -> Instant {
    now.max(last_beat + MIN_SPACING)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wake_never_brings_heartbeats_closer_than_the_spacing() {
        let t = Instant::now();
        assert_eq!(woken_beat(t, t), t + MIN_SPACING);
        let later = t + Duration::from_secs(1);
        assert_eq!(woken_beat(later, t), later);
    }
}
