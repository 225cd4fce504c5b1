//! The node flood of the soak: one enrolled node ([`FLOOD_NODE`], a real
//! node certificate, enrolled as the probe node is) that loops its agent
//! calls — heartbeats, desired-state waits that return at once (it asks
//! about a version it does not hold), certificate renewals — as fast as the
//! control plane answers, ignoring every `Retry-After`. The CP limits each
//! node's calls (`otherix-server` `limits::NodeLimits`); what the other
//! nodes' heartbeats and the brokers pay meanwhile is the soak's question.
//!
//! Each renewal it gets, it uses from then on, as an agent does: the CP
//! keeps only a node's two newest certificates, so a node that renewed
//! twice and kept its first would be refused (401) as a stranger, and the
//! flood would measure something else.
//!
//! It runs on a runtime of its own (one thread, at nice 19), as the slow
//! clients do: a real node floods from its own machine, not from the
//! servers' cores.

use std::net::Ipv4Addr;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use anyhow::Context;
use otherix_client::{Client, ClientError};
use otherix_proto::agent::{CertPurpose, CertificateRequest, Heartbeat};
use otherix_testbed::fake_node;

use crate::bed::Bed;
use crate::flood::nice_this_thread;
use crate::outcomes::Outcomes;

/// The flooding node's name.
pub const FLOOD_NODE: &str = "soak-flood";
/// Heartbeat loops in flight at once (over the client's pooled connections).
const HEARTBEAT_LOOPS: usize = 6;
/// Wait loops (one certificate loop besides).
const WAIT_LOOPS: usize = 1;
/// A desired version the CP never hands out: the wait answers at once.
const NO_SUCH_VERSION: u64 = u64::MAX;

/// The flooding node's loops, running until [`NodeFlood::stop`].
pub struct NodeFlood {
    rt: tokio::runtime::Runtime,
    pub outcomes: Arc<Outcomes>,
}

impl std::fmt::Debug for NodeFlood {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeFlood").finish_non_exhaustive()
    }
}

impl NodeFlood {
    /// Enrolls [`FLOOD_NODE`] (heartbeating from `vtep`, the address its
    /// connections come from) and starts its loops.
    pub fn start(bed: &Bed, vtep: Ipv4Addr) -> anyhow::Result<NodeFlood> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("node-flood")
            .on_thread_start(nice_this_thread)
            .enable_all()
            .build()?;
        // Enrolled on its own runtime: its connections belong to it.
        let (client, hb) = rt.block_on(crate::probe::enroll(bed, FLOOD_NODE, vtep))?;
        let renewal = Renewal {
            key: fake_node::node_key(FLOOD_NODE).context("the flooding node's renewal key")?,
            url: bed.cluster.url.clone(),
            ca_pem: bed.ca_pem.clone(),
        };
        let current = Arc::new(RwLock::new(client));
        let outcomes = Arc::new(Outcomes::default());
        for _ in 0..HEARTBEAT_LOOPS {
            rt.spawn(heartbeats(current.clone(), hb.clone(), outcomes.clone()));
        }
        for _ in 0..WAIT_LOOPS {
            rt.spawn(waits(current.clone(), outcomes.clone()));
        }
        rt.spawn(certificates(current, renewal, outcomes.clone()));
        Ok(NodeFlood { rt, outcomes })
    }

    /// Stops the loops; the node stays enrolled (the caller deletes it).
    pub fn stop(self) {
        self.rt.shutdown_timeout(Duration::from_secs(5));
    }
}

/// The client with the node's newest certificate, shared by its loops.
type Current = Arc<RwLock<Client>>;

fn current(c: &Current) -> Client {
    c.read().unwrap_or_else(|p| p.into_inner()).clone()
}

async fn heartbeats(c: Current, mut hb: Heartbeat, outcomes: Arc<Outcomes>) {
    loop {
        let answer = current(&c).heartbeat(&hb).await;
        if let Ok(desired) = &answer {
            hb.applied_version = Some(desired.version);
        }
        outcomes.add(outcome("heartbeat", &answer));
    }
}

async fn waits(c: Current, outcomes: Arc<Outcomes>) {
    loop {
        let answer = current(&c).wait_desired(NO_SUCH_VERSION).await;
        outcomes.add(outcome("wait", &answer));
    }
}

/// What a renewal needs: the node's key (one for every renewal) and where
/// the control plane is.
struct Renewal {
    key: fake_node::NodeKey,
    url: String,
    ca_pem: String,
}

/// Renews the node's certificate again and again; each one granted, the
/// loops use from their next call.
async fn certificates(c: Current, renewal: Renewal, outcomes: Arc<Outcomes>) {
    let req = CertificateRequest {
        purpose: CertPurpose::Node,
        csr_pem: renewal.key.csr_pem.clone(),
    };
    let key_pem = renewal.key.key.serialize_pem();
    loop {
        let answer = current(&c).certificate(&req).await;
        if let Ok(issued) = &answer {
            match Client::with_identity(renewal.url.as_str(), &renewal.ca_pem, &issued.cert_pem, &key_pem) {
                Ok(renewed) => *c.write().unwrap_or_else(|p| p.into_inner()) = renewed,
                Err(_) => outcomes.add("certificate unusable"),
            }
        }
        outcomes.add(outcome("certificate", &answer));
    }
}

/// `heartbeat 200`, `heartbeat 429`, or `heartbeat failed` (no answer).
fn outcome<T>(call: &str, answer: &Result<T, ClientError>) -> String {
    match answer {
        Ok(_) => format!("{call} 200"),
        Err(ClientError::Api { status, .. }) => format!("{call} {status}"),
        Err(_) => format!("{call} failed"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outcome_is_the_call_and_its_status() {
        let ok: Result<(), ClientError> = Ok(());
        assert_eq!(outcome("heartbeat", &ok), "heartbeat 200");
        let limited: Result<(), ClientError> = Err(ClientError::Api {
            status: 429,
            code: "rate_limited".into(),
            message: "node soak-flood is over its rate limit".into(),
        });
        assert_eq!(outcome("wait", &limited), "wait 429");
        let gone: Result<(), ClientError> = Err(ClientError::Timeout { server: "cp".into() });
        assert_eq!(outcome("certificate", &gone), "certificate failed");
    }
}
