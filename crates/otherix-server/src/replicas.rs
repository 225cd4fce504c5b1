//! This control plane among the replicas that share its store.
//!
//! Each replica has an id (made once, kept in its data directory) and keeps
//! its row in the store fresh every [`SEEN_EVERY`]. Relay sessions live in
//! the process that carries them, so when a replica stops — killed, or cut
//! off from the database — another one, within [`TIMEOUT`], records the
//! sessions it carried as ended and removes its row. A replica that finds
//! its own row gone had been taken for stopped: it ends the sessions it
//! still carries, so that the audit trail and the open-session counts are
//! true, and registers anew.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use otherix_store::{Carrier, Dialect, Store};
use time::OffsetDateTime;

use crate::clock::ClockCheck;
use crate::relay::RelayState;

/// How often a replica says it runs, and looks for replicas that stopped.
pub const SEEN_EVERY: Duration = Duration::from_secs(2);
/// A replica not seen for this long has stopped.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// This replica: its id, where it serves, since when.
#[derive(Debug, Clone)]
pub struct Replica {
    pub id: String,
    pub address: String,
    pub started_at: OffsetDateTime,
}

/// The replica id kept in `dir/replica.id`, made the first time: a
/// restarted control plane is the same replica, and ends what its
/// previous run left open at once rather than after [`TIMEOUT`].
pub fn id(dir: &Path) -> anyhow::Result<String> {
    let path = dir.join("replica.id");
    match std::fs::read_to_string(&path) {
        Ok(id) if is_id(id.trim()) => Ok(id.trim().to_string()),
        Ok(_) => anyhow::bail!(
            "{} does not hold a replica id; remove it and a new one is made",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = crate::random::short_id();
            crate::pki::write_private(&path, format!("{id}\n").as_bytes())?;
            Ok(id)
        }
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

fn is_id(s: &str) -> bool {
    (1..=64).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
}

impl Replica {
    /// Registers this replica before it serves, and records the relay
    /// sessions its previous run left open as ended. On SQLite, whose one
    /// control plane this is, every relay session left open is.
    pub async fn register(&self, store: &Store) -> anyhow::Result<()> {
        let now = OffsetDateTime::now_utc();
        let carrier = match store.dialect() {
            Dialect::Sqlite => Carrier::Relay,
            Dialect::Postgres => Carrier::Replica(&self.id),
        };
        match store
            .close_sessions(carrier, "control plane restarted", now)
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                sessions = n,
                "relay sessions of the previous run recorded as ended"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot record the previous run's relay sessions as ended"),
        }
        store
            .replica_seen(&self.id, &self.address, self.started_at)
            .await
            .context("registering this control plane among its replicas")?;
        Ok(())
    }

    /// Keeps this replica's row fresh and ends the sessions of replicas
    /// that stopped, until the process ends. Cut off from the store for
    /// [`TIMEOUT`], it fences itself (`fenced`): the others take it for
    /// stopped, so it ends its relay sessions and answers nothing until
    /// the store answers again.
    /// Each round also reads the database's clock (`clock`).
    pub fn spawn(
        self,
        store: Store,
        relay: Arc<RelayState>,
        fenced: Arc<AtomicBool>,
        clock: Arc<ClockCheck>,
    ) {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SEEN_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failing_since: Option<Instant> = None;
            loop {
                tick.tick().await;
                self.round(&store, &relay, &fenced, &mut failing_since).await;
                if let Err(e) = clock.measure(&store).await {
                    tracing::warn!(error = %e, "cannot read the database's clock");
                }
            }
        });
    }

    async fn round(
        &self,
        store: &Store,
        relay: &RelayState,
        fenced: &AtomicBool,
        failing_since: &mut Option<Instant>,
    ) {
        // A registry write that hangs counts as a failed one.
        let seen = tokio::time::timeout(
            SEEN_EVERY,
            store.replica_seen(&self.id, &self.address, self.started_at),
        )
        .await
        .unwrap_or_else(|_| Err(otherix_store::StoreError::Invalid("no answer in time".into())));
        match seen {
            Ok(found) => {
                *failing_since = None;
                if fenced.swap(false, Ordering::Relaxed) {
                    tracing::warn!(replica = %self.id, "the store answers again: this replica serves again");
                } else if !found {
                    let open = relay.open();
                    tracing::warn!(
                        replica = %self.id,
                        sessions = open,
                        "the other replicas took this one for stopped (no contact with the database for {}s): ending its relay sessions",
                        TIMEOUT.as_secs()
                    );
                    relay.cut_all();
                }
            }
            Err(e) => {
                let since = *failing_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= TIMEOUT && !fenced.swap(true, Ordering::Relaxed) {
                    tracing::error!(
                        replica = %self.id,
                        error = %e,
                        sessions = relay.open(),
                        "cut off from the store for {}s: the other replicas take this one for stopped; ending its relay sessions and answering every call 503 replica_unavailable until the store answers",
                        TIMEOUT.as_secs()
                    );
                    relay.cut_all();
                } else {
                    tracing::warn!(error = %e, "cannot reach the store to say this replica runs");
                }
                return;
            }
        }
        match store.reap_replicas(TIMEOUT).await {
            Ok(reaped) => {
                for r in reaped {
                    if r.id.is_empty() {
                        tracing::info!(
                            sessions = r.sessions,
                            "relay sessions no replica carries recorded as ended"
                        );
                    } else {
                        tracing::warn!(
                            replica = %r.id,
                            sessions = r.sessions,
                            "control plane replica stopped; its relay sessions recorded as ended"
                        );
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "cannot look for stopped replicas"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replica_keeps_its_id_across_restarts() {
        let dir = std::env::temp_dir().join(format!("otherix-replica-{}", crate::random::short_id()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = id(&dir).unwrap();
        assert!(is_id(&first));
        assert_eq!(id(&dir).unwrap(), first);
        std::fs::write(dir.join("replica.id"), "../../etc\n").unwrap();
        assert!(id(&dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
