//! The node's identity: its key, its certificate from the cluster CA, and that CA.
//!
//! First start: generate a key on the node (it never leaves), send a CSR with the join
//! token, save what comes back. Later starts reuse the saved identity, so a restarted
//! agent is the same node to the control plane and needs no new token.
//!
//! The client certificate (clientAuth only, `NODE.nodes.otherix`) lives 30 days by
//! default; once two thirds of that have passed the agent renews it over mutual TLS
//! with a new key ([`Identity::renew`]). A renewal is saved so that a crash at any
//! point leaves a usable pair: new key and certificate are written beside the old
//! ones, then the key and last the certificate are renamed over them, and a start
//! that finds a half-done renewal finishes or discards it.

use std::path::Path;

use otherix_client::{Client, ClientError};
use otherix_proto::agent::{CertPurpose, CertificateRequest, EnrollRequest};
use otherix_tls as tls;
use otherix_tls::san::CertInfo;
use tracing::info;

use super::files::{self, CA_FILE, CERT_FILE, KEY_FILE};
use super::serving::{check_cert, csr, unix_now, CertRequestError};
use super::{Config, DaemonError, Trust};

/// Where a renewal's new key and certificate are written before they
/// replace the old ones.
const NEW_KEY_FILE: &str = "node.key.new";
const NEW_CERT_FILE: &str = "node.crt.new";

/// What the agent presents to the control plane (mutual TLS) and whom it trusts.
#[derive(Clone)]
pub struct Identity {
    pub node: String,
    pub cert_pem: String,
    pub key_pem: String,
    pub ca_pem: String,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the private key.
        f.debug_struct("Identity")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl Identity {
    /// A client of the control plane that authenticates as this node.
    pub fn client(&self, servers: &[String]) -> Result<Client, ClientError> {
        Client::with_identity(servers, &self.ca_pem, &self.cert_pem, &self.key_pem)
    }

    /// [`Identity::client`] for the control planes of `old`, keeping the
    /// one it uses (a renewal does not move an agent to another replica).
    pub fn client_like(&self, old: &Client) -> Result<Client, ClientError> {
        old.with_new_identity(&self.ca_pem, &self.cert_pem, &self.key_pem)
    }

    /// Whether the client certificate is due for renewal: two thirds of its
    /// life gone, or not in the current form (`NODE.nodes.otherix`,
    /// clientAuth only — an older control plane issued the bare node name).
    pub fn renewal_due(&self, now: i64) -> bool {
        match check_cert(
            &self.cert_pem,
            &self.ca_pem,
            &tls::node_cert_name(&self.node),
            None,
            now,
        ) {
            Ok(v) => v.renewal_due(now),
            Err(_) => true,
        }
    }

    /// A new key and client certificate from the control plane (over mutual
    /// TLS with the current ones), saved in `dir`.
    pub async fn renew(&self, client: &Client, dir: &Path) -> Result<Identity, CertRequestError> {
        let key = rcgen::KeyPair::generate().map_err(CertRequestError::Key)?;
        let req = CertificateRequest {
            purpose: CertPurpose::Node,
            csr_pem: csr(&key)?,
        };
        let resp = client.certificate(&req).await?;
        check_cert(
            &resp.cert_pem,
            &self.ca_pem,
            &tls::node_cert_name(&self.node),
            None,
            unix_now(),
        )
        .map_err(CertRequestError::Unfit)?;
        let renewed = Identity {
            node: self.node.clone(),
            cert_pem: resp.cert_pem,
            key_pem: key.serialize_pem(),
            ca_pem: self.ca_pem.clone(),
        };
        save_renewal(dir, &renewed)?;
        info!(node = %self.node, "node certificate renewed");
        Ok(renewed)
    }
}

/// Writes a renewed pair beside the old one, then moves key and certificate
/// over it: see [`finish_renewal`] for a crash in between.
fn save_renewal(dir: &Path, id: &Identity) -> Result<(), DaemonError> {
    files::write_atomic(&dir.join(NEW_KEY_FILE), id.key_pem.as_bytes(), 0o600)?;
    files::write_atomic(&dir.join(NEW_CERT_FILE), id.cert_pem.as_bytes(), 0o644)?;
    let rename = |from: &str, to: &str| {
        std::fs::rename(dir.join(from), dir.join(to)).map_err(|e| DaemonError::io("rename", dir.join(to), e))
    };
    rename(NEW_KEY_FILE, KEY_FILE)?;
    rename(NEW_CERT_FILE, CERT_FILE)
}

/// A renewal cut short: with the new key still aside, the old pair is
/// intact and the new one is dropped; with only the new certificate aside,
/// the key was already moved and the certificate follows.
fn finish_renewal(dir: &Path) -> Result<(), DaemonError> {
    let new_cert = dir.join(NEW_CERT_FILE);
    if dir.join(NEW_KEY_FILE).exists() {
        let _ = std::fs::remove_file(dir.join(NEW_KEY_FILE));
        let _ = std::fs::remove_file(&new_cert);
    } else if new_cert.exists() {
        std::fs::rename(&new_cert, dir.join(CERT_FILE))
            .map_err(|e| DaemonError::io("rename", dir.join(CERT_FILE), e))?;
    }
    Ok(())
}

/// The identity saved in `dir` for node `node`, if the node is enrolled.
///
/// The certificate is written last at enrollment, so its presence means "enrolled";
/// a certificate without its key or CA, or one naming another node, is an error for
/// the operator, never silently replaced.
pub fn load(dir: &Path, node: &str) -> Result<Option<Identity>, DaemonError> {
    finish_renewal(dir)?;
    let Some(cert_pem) = files::read_optional(&dir.join(CERT_FILE))? else {
        return Ok(None);
    };
    let bad = |reason: String| DaemonError::Identity {
        dir: dir.to_owned(),
        reason,
    };
    let key_pem = files::read_optional(&dir.join(KEY_FILE))?
        .ok_or_else(|| bad(format!("{CERT_FILE} exists but {KEY_FILE} is missing")))?;
    let ca_pem = files::read_optional(&dir.join(CA_FILE))?
        .ok_or_else(|| bad(format!("{CERT_FILE} exists but {CA_FILE} is missing")))?;
    let names = CertInfo::from_pem(&cert_pem)
        .map_err(|e| bad(format!("{CERT_FILE}: {e}")))?
        .dns_names;
    // `NODE.nodes.otherix`, or the bare name an older control plane issued.
    let mine = tls::node_cert_name(node);
    if !names.iter().any(|n| *n == mine || n == node) {
        let theirs = names.first().map(String::as_str).unwrap_or("(unnamed)");
        return Err(bad(format!(
            "it belongs to node {}, not {node}; use that --name, or another --data-dir to enroll a new node",
            theirs.strip_suffix(".nodes.otherix").unwrap_or(theirs)
        )));
    }
    Ok(Some(Identity {
        node: node.to_owned(),
        cert_pem,
        key_pem,
        ca_pem,
    }))
}

/// Enrolls node `config.node` with its join token and saves the identity in the data
/// directory. Refusals by the control plane (bad, expired or used token) are
/// [`DaemonError::EnrollRefused`] with the control plane's message.
pub async fn enroll(config: &Config) -> Result<Identity, DaemonError> {
    let token = config
        .join_token
        .as_deref()
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or_else(|| DaemonError::MissingJoinToken {
            node: config.node.to_string(),
            dir: config.data_dir.clone(),
        })?;
    let ca_pem = trusted_ca(config).await?;
    // First, so that no crash leaves them beside the new identity.
    super::serving::forget_saved(&config.data_dir)?;

    let key = rcgen::KeyPair::generate().map_err(CertRequestError::Key)?;
    let csr = csr(&key)?;

    let client = Client::new(&config.servers, &ca_pem, None)?;
    let req = EnrollRequest {
        join_token: token.to_owned(),
        node: config.node.clone(),
        csr_pem: csr,
    };
    let resp = client.enroll(&req).await.map_err(|e| match e {
        ClientError::Api { message, .. } => DaemonError::EnrollRefused {
            server: client.server().to_owned(),
            message,
        },
        other => other.into(),
    })?;

    // We trusted the CA we were told to; the answer must not swap it for another.
    if fingerprint_of(&resp.ca_pem)? != fingerprint_of(&ca_pem)? {
        return Err(DaemonError::Identity {
            dir: config.data_dir.clone(),
            reason: "the control plane answered with another cluster CA than the one trusted".into(),
        });
    }
    let identity = Identity {
        node: config.node.to_string(),
        cert_pem: resp.cert_pem,
        key_pem: key.serialize_pem(),
        ca_pem,
    };
    save(&config.data_dir, &identity)?;
    info!(node = %identity.node, dir = %config.data_dir.display(), "enrolled");
    Ok(identity)
}

fn save(dir: &Path, id: &Identity) -> Result<(), DaemonError> {
    files::ensure_dir(dir)?;
    files::write_atomic(&dir.join(KEY_FILE), id.key_pem.as_bytes(), 0o600)?;
    files::write_atomic(&dir.join(CA_FILE), id.ca_pem.as_bytes(), 0o644)?;
    // Last: its presence is what marks the node as enrolled.
    files::write_atomic(&dir.join(CERT_FILE), id.cert_pem.as_bytes(), 0o644)
}

/// The cluster CA to trust for the first contact: a file, or discovered from the
/// server and checked against the expected fingerprint.
async fn trusted_ca(config: &Config) -> Result<String, DaemonError> {
    match config.trust.as_ref().ok_or(DaemonError::MissingTrust)? {
        Trust::CaFile(path) => {
            let pem = files::read_optional(path)?
                .ok_or_else(|| DaemonError::io("read CA file", path, std::io::ErrorKind::NotFound.into()))?;
            tls::cert_from_pem(&pem).map_err(|e| DaemonError::Config(format!("{}: {e}", path.display())))?;
            Ok(pem)
        }
        Trust::Fingerprint(fp) => {
            let expected = tls::parse_fingerprint(fp).map_err(|e| DaemonError::Config(e.to_string()))?;
            let ca = Client::discover_ca(&config.servers, Some(expected)).await?;
            Ok(tls::cert_to_pem(ca.as_ref()))
        }
    }
}

fn fingerprint_of(pem: &str) -> Result<String, DaemonError> {
    let der = tls::cert_from_pem(pem).map_err(|e| DaemonError::Config(format!("cluster CA: {e}")))?;
    Ok(tls::fingerprint(der.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn scratch(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("otherix-agent-id-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_saved_identity_is_reused_and_another_nodes_is_refused() {
        let dir = scratch("reuse");
        assert!(load(&dir, "n1").unwrap().is_none(), "no identity yet");
        let (cert, key) = self_signed("n1");
        let (ca, _) = self_signed("ca");
        save(
            &dir,
            &Identity {
                node: "n1".into(),
                cert_pem: cert.clone(),
                key_pem: key,
                ca_pem: ca,
            },
        )
        .unwrap();
        let id = load(&dir, "n1").unwrap().unwrap();
        assert_eq!(id.cert_pem, cert);
        let err = load(&dir, "n2").unwrap_err().to_string();
        assert!(err.contains("belongs to node n1, not n2"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_certificate_without_its_key_is_reported_not_replaced() {
        let dir = scratch("half");
        files::ensure_dir(&dir).unwrap();
        std::fs::write(dir.join(CERT_FILE), self_signed("n1").0).unwrap();
        let err = load(&dir, "n1").unwrap_err().to_string();
        assert!(err.contains("node.key is missing"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_private_key_never_shows_in_debug_output() {
        let (cert, key) = self_signed("n1");
        let id = Identity {
            node: "n1".into(),
            cert_pem: cert,
            key_pem: key,
            ca_pem: String::new(),
        };
        assert!(!format!("{id:?}").contains("PRIVATE KEY"));
    }
}
