//! A heartbeat probe for the soak: a node the bench enrolls itself
//! (`soak-probe`, hypervisor role, no guests) and heartbeats as, four times
//! a second, over one kept-alive mutual-TLS connection as an agent does —
//! timing each heartbeat exactly, where the agents' own histogram has only
//! coarse buckets and one heartbeat every two seconds.

use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use otherix_client::Client;
use otherix_proto::agent::Heartbeat;
use otherix_testbed::fake_node;

use crate::bed::Bed;

/// The probe node's name.
pub const PROBE_NODE: &str = "soak-probe";
/// Time between the starts of two probe heartbeats.
const EVERY: Duration = Duration::from_millis(250);

/// One probe heartbeat: when it started and how long it took, or why it failed.
pub type Beat = (Instant, Result<Duration, String>);

/// The probe's heartbeats so far; it beats until dropped.
#[derive(Debug)]
pub struct Probe {
    beats: Arc<Mutex<Vec<Beat>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Probe {
    /// Enrolls [`PROBE_NODE`] and starts heartbeating from `vtep` (the
    /// address the bench's connections to the CP come from).
    pub async fn start(bed: &Bed, vtep: Ipv4Addr) -> anyhow::Result<Probe> {
        let (client, hb) = enroll(bed, PROBE_NODE, vtep).await?;
        let beats: Arc<Mutex<Vec<Beat>>> = Arc::default();
        let task = tokio::spawn(beat(client, hb, beats.clone()));
        Ok(Probe { beats, task })
    }

    /// The heartbeats that started within `from..to`.
    pub fn between(&self, from: Instant, to: Instant) -> Vec<Beat> {
        self.beats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(at, _)| (from..to).contains(at))
            .cloned()
            .collect()
    }
}

/// Enrolls node `name` (hypervisor, no guests) with a join token of its
/// own and a key made here, and sends its first heartbeat from `vtep`: its
/// client (mutual TLS, the node certificate the CP signed) and the
/// heartbeat to send next.
pub async fn enroll(bed: &Bed, name: &str, vtep: Ipv4Addr) -> anyhow::Result<(Client, Heartbeat)> {
    let token = bed.cluster.cli_ok(&[
        "node",
        "join-token",
        "create",
        "--name",
        name,
        "--hypervisor",
        "--ttl",
        "10m",
    ])?;
    let key = fake_node::node_key(name).with_context(|| format!("{name}'s key"))?;
    let anonymous = Client::new(&bed.cluster.url, &bed.ca_pem, None)?;
    let client = fake_node::enroll(&anonymous, &token, name, key)
        .await
        .with_context(|| format!("enrolling node {name}"))?
        .client(&bed.cluster.url, &bed.ca_pem)?;
    // The first heartbeat must pass: otherwise every later one fails too.
    let mut hb = heartbeat(name, vtep);
    let desired = client
        .heartbeat(&hb)
        .await
        .with_context(|| format!("{name}'s first heartbeat"))?;
    hb.applied_version = Some(desired.version);
    Ok((client, hb))
}

/// What an idle hypervisor reports: nothing but that it is there.
fn heartbeat(name: &str, vtep: Ipv4Addr) -> Heartbeat {
    Heartbeat {
        version: concat!("otherix-bench/", env!("CARGO_PKG_VERSION")).into(),
        ..fake_node::empty_heartbeat(name, &vtep.to_string())
    }
}

async fn beat(client: Client, mut hb: Heartbeat, beats: Arc<Mutex<Vec<Beat>>>) {
    loop {
        let started = Instant::now();
        let result = match client.heartbeat(&hb).await {
            Ok(desired) => {
                hb.applied_version = Some(desired.version);
                Ok(started.elapsed())
            }
            Err(e) => Err(e.to_string()),
        };
        beats
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((started, result));
        // A late heartbeat is not made up for: the next starts on time or now.
        tokio::time::sleep_until((started + EVERY).into()).await;
    }
}
