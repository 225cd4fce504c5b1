//! A node that speaks the agent protocol from the calling process: its own
//! key and CSR, enrollment with a join token, and heartbeats over mutual
//! TLS — for control-plane tests and benchmarks that need nodes but not
//! their kernel state (no namespaces, no root).
//!
//! What it reports is up to the caller: start from [`empty_heartbeat`] and
//! fill in what the test or benchmark needs
//! (`Heartbeat { guests, ..empty_heartbeat(name, vtep) }`).

use otherix_client::{Client, ClientError};
use otherix_proto::agent::{EnrollRequest, GuestStatus, Heartbeat};

/// A node's key and the CSR made for it, the way an agent makes them (only
/// the public key is taken: the CP names the certificate itself).
pub struct NodeKey {
    pub key: rcgen::KeyPair,
    pub csr_pem: String,
}

/// A fresh ECDSA P-256 key and a CSR for it.
pub fn node_key(name: &str) -> Result<NodeKey, rcgen::Error> {
    let key = rcgen::KeyPair::generate()?;
    let csr_pem = rcgen::CertificateParams::new(vec![name.to_string()])?
        .serialize_request(&key)?
        .pem()?;
    Ok(NodeKey { key, csr_pem })
}

/// An enrolled node's identity: the certificate the CP signed and its key.
#[derive(Clone)]
pub struct Identity {
    pub cert_pem: String,
    pub key_pem: String,
    /// The cluster CA, as the CP handed it out with the certificate.
    pub ca_pem: String,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the private key.
        f.debug_struct("Identity").finish_non_exhaustive()
    }
}

impl Identity {
    /// A client of the CP at `url` presenting this identity (mutual TLS),
    /// trusting only `ca_pem`.
    /// A client of the control plane at `servers` (one URL, or its replicas)
    /// that authenticates as this node.
    pub fn client(
        &self,
        servers: impl otherix_client::client::ServerList,
        ca_pem: &str,
    ) -> Result<Client, ClientError> {
        Client::with_identity(servers, ca_pem, &self.cert_pem, &self.key_pem)
    }
}

/// Enrolls `name` with `join_token` through `anonymous` (a client of the
/// CP without credentials), as `otherix agent --join-token` does.
pub async fn enroll(
    anonymous: &Client,
    join_token: &str,
    name: &str,
    key: NodeKey,
) -> Result<Identity, ClientError> {
    let resp = anonymous
        .enroll(&EnrollRequest {
            join_token: join_token.trim().to_string(),
            node: name.parse()?,
            csr_pem: key.csr_pem,
        })
        .await?;
    Ok(Identity {
        cert_pem: resp.cert_pem,
        key_pem: key.key.serialize_pem(),
        ca_pem: resp.ca_pem,
    })
}

/// A heartbeat of `node` from `vtep` with nothing to report: no pinned
/// roles, no guests, no sessions, no verdicts, nothing applied yet.
pub fn empty_heartbeat(node: &str, vtep: &str) -> Heartbeat {
    Heartbeat {
        incoming: Default::default(),
        node: node.to_string(),
        roles: None,
        vtep: vtep.to_string(),
        applied_version: None,
        guests: Vec::new(),
        sessions: Default::default(),
        health: Vec::new(),
        netns: None,
        ready_overlays: Vec::new(),
        migrations: Vec::new(),
        session_epoch: None,
        session_events: Vec::new(),
        session_bytes: Vec::new(),
        reads_one_session_revocations: false,
        version: concat!("fake-node/", env!("CARGO_PKG_VERSION")).into(),
        accepts_unchanged: false,
        accepts_delta: false,
        accepts_guest_changes: false,
        health_changes_only: false,
    }
}

/// Guest statuses saying each of `vm_ids` runs, as an agent that realized
/// them reports.
pub fn running<I>(vm_ids: I) -> Vec<GuestStatus>
where
    I: IntoIterator,
    I::Item: AsRef<str>,
{
    vm_ids
        .into_iter()
        .map(|id| GuestStatus {
            accelerator: None,
            vm_id: id.as_ref().to_string(),
            state: otherix_proto::VmState::Running,
            reason: None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_key_comes_with_a_csr_for_it() {
        let k = node_key("n1").unwrap();
        assert!(k.csr_pem.starts_with("-----BEGIN CERTIFICATE REQUEST-----"));
        assert!(!k.key.serialize_pem().is_empty());
    }

    #[test]
    fn an_empty_heartbeat_reports_nothing_but_who_and_where() {
        let hb = empty_heartbeat("n1", "10.50.0.1");
        assert_eq!((hb.node.as_str(), hb.vtep.as_str()), ("n1", "10.50.0.1"));
        assert!(hb.guests.is_empty() && hb.applied_version.is_none() && hb.roles.is_none());
    }
}
