//! The relay cache fill of the soak: one principal ([`FLOOD_USER`], role
//! `user`, allowed only the bridge guest's echo port) brokers relay tickets
//! and spends each at once on a relay connection it drops, as fast as the
//! broker and the relay let it, to fill the relay's replay cache. The relay
//! gives each principal a share of that cache (`principal_replay_share`):
//! past it, this principal's tickets are refused while everyone else's
//! still pass — which the soak's relay setups, brokered by the admin, test.
//!
//! It runs on a runtime of its own (one thread, at nice 19), as the slow
//! clients do.

use std::sync::Arc;
use std::time::Duration;

use otherix_client::tunnel::{open_brokered, ConnectError};
use otherix_client::{Client, ClientError};

use crate::bed::{Bed, ECHO_PORT, RELAY_VM, RELAY_VM_LABEL};
use crate::broker::broker_for;
use crate::flood::nice_this_thread;
use crate::outcomes::Outcomes;

/// The flooding principal's user name.
pub const FLOOD_USER: &str = "soak-flood";
/// Broker-and-spend loops in flight at once.
const LOOPS: usize = 8;
/// The outcome of a ticket the relay took (a session opened and dropped).
pub const OPENED: &str = "relay opened";
/// The outcome of a ticket the relay refused with 429: this principal at
/// its share of the replay cache (or at its session cap).
pub const REFUSED_429: &str = "relay refused 429";

/// The principal's loops, running until [`RelayFill::stop`].
pub struct RelayFill {
    rt: tokio::runtime::Runtime,
    pub outcomes: Arc<Outcomes>,
}

impl std::fmt::Debug for RelayFill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayFill").finish_non_exhaustive()
    }
}

impl RelayFill {
    /// Creates [`FLOOD_USER`] with a rule for the bridge guest's echo port
    /// and a token, and starts its loops.
    pub fn start(bed: &Bed) -> anyhow::Result<RelayFill> {
        let c = &bed.cluster;
        c.cli_ok(&["user", "create", FLOOD_USER, "--role", "user"])?;
        c.cli_ok(&[
            "user",
            "allow",
            FLOOD_USER,
            "--selector",
            RELAY_VM_LABEL,
            "--ports",
            &ECHO_PORT.to_string(),
        ])?;
        let token = c.cli_ok(&["user", "token", "create", FLOOD_USER])?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("relay-fill")
            .on_thread_start(nice_this_thread)
            .enable_all()
            .build()?;
        let outcomes = Arc::new(Outcomes::default());
        for _ in 0..LOOPS {
            // Its broker calls on a kept-alive connection of its own, as a
            // client brokering in a loop would.
            let client = Client::new(&c.url, &bed.ca_pem, Some(token.trim().to_string()))?;
            rt.spawn(spend(client, c.url.clone(), bed.ca_pem.clone(), outcomes.clone()));
        }
        Ok(RelayFill { rt, outcomes })
    }

    pub fn stop(self) {
        self.rt.shutdown_timeout(Duration::from_secs(5));
    }
}

/// Brokers a ticket for the bridge guest's echo port and spends it on a
/// relay connection, dropped once open; again, for ever.
async fn spend(client: Client, cp_url: String, ca_pem: String, outcomes: Arc<Outcomes>) {
    loop {
        let grant = match broker_for(&client, RELAY_VM, ECHO_PORT).await {
            Ok(grant) => grant,
            Err(e) => {
                outcomes.add(broker_outcome(&e));
                continue;
            }
        };
        outcomes.add("broker 200");
        let opened = open_brokered(&grant, &cp_url, &ca_pem).await;
        outcomes.add(relay_outcome(opened.as_ref().err()));
    }
}

fn broker_outcome(e: &ClientError) -> String {
    match e {
        ClientError::Api { status, code, .. } => format!("broker {status} {code}"),
        _ => "broker failed".into(),
    }
}

fn relay_outcome(e: Option<&ConnectError>) -> String {
    match e {
        None => OPENED.into(),
        Some(ConnectError::Refused { status, .. }) => format!("relay refused {status}"),
        Some(_) => "relay failed".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_name_the_step_and_the_status() {
        assert_eq!(relay_outcome(None), OPENED);
        let share = ConnectError::Refused {
            status: 429,
            reason: "principal at its replay share".into(),
        };
        assert_eq!(relay_outcome(Some(&share)), REFUSED_429);
        let limited = ClientError::Api {
            status: 429,
            code: "rate_limited".into(),
            message: "over its broker rate limit".into(),
        };
        assert_eq!(broker_outcome(&limited), "broker 429 rate_limited");
    }
}
