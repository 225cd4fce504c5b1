//! The node's identity: its key, its certificate from the cluster CA, and that CA.
//!
//! First start: generate a key on the node (it never leaves), send a CSR with the join
//! token, save what comes back. Later starts reuse the saved identity, so a restarted
//! agent is the same node to the control plane and needs no new token.

use std::path::Path;

use otherix_api::agent::EnrollRequest;
use otherix_api::{tls, Client, ClientError};
use tracing::info;

use super::files::{self, CA_FILE, CERT_FILE, KEY_FILE};
use super::{Config, DaemonError, Trust};

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
    pub fn client(&self, server: &str) -> Result<Client, ClientError> {
        Client::with_identity(server, &self.ca_pem, &self.cert_pem, &self.key_pem)
    }
}

/// The identity saved in `dir` for node `node`, if the node is enrolled.
///
/// The certificate is written last at enrollment, so its presence means "enrolled";
/// a certificate without its key or CA, or one naming another node, is an error for
/// the operator, never silently replaced.
pub fn load(dir: &Path, node: &str) -> Result<Option<Identity>, DaemonError> {
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
    let names = cert_dns_names(&cert_pem).map_err(|e| bad(format!("{CERT_FILE}: {e}")))?;
    if !names.iter().any(|n| n == node) {
        return Err(bad(format!(
            "it belongs to node {}, not {node}; use that --name, or another --data-dir to enroll a new node",
            names.first().map(String::as_str).unwrap_or("(unnamed)")
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
            node: config.node.clone(),
            dir: config.data_dir.clone(),
        })?;
    let ca_pem = trusted_ca(config).await?;

    let key =
        rcgen::KeyPair::generate().map_err(|e| DaemonError::Config(format!("generating a key: {e}")))?;
    let csr = rcgen::CertificateParams::new(vec![config.node.clone()])
        .and_then(|p| p.serialize_request(&key))
        .and_then(|csr| csr.pem())
        .map_err(|e| {
            DaemonError::Config(format!(
                "invalid node name {:?} for a certificate: {e}",
                config.node
            ))
        })?;

    let client = Client::new(&config.server, &ca_pem, None)?;
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
        node: config.node.clone(),
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
            let expected = tls::parse_fingerprint(fp).map_err(DaemonError::Config)?;
            let ca = Client::discover_ca(&config.server, Some(expected)).await?;
            Ok(tls::cert_to_pem(ca.as_ref()))
        }
    }
}

fn fingerprint_of(pem: &str) -> Result<String, DaemonError> {
    let der = tls::cert_from_pem(pem).map_err(|e| DaemonError::Config(format!("cluster CA: {e}")))?;
    Ok(tls::fingerprint(der.as_ref()))
}

/// The DNS names (SANs) of a PEM certificate.
fn cert_dns_names(pem: &str) -> Result<Vec<String>, String> {
    let der = tls::cert_from_pem(pem)?;
    let (_, cert) =
        x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| format!("unreadable: {e}"))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| format!("unreadable SAN: {e}"))?;
    Ok(san
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    x509_parser::extensions::GeneralName::DNSName(d) => Some((*d).to_owned()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default())
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
