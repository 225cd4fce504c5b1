//! Certificates and TLS for every Otherix process: the names each kind of
//! certificate carries (one purpose each, see "Trust model" in
//! `docs/architecture.md`), PEM, fingerprints, the names and addresses a
//! certificate is for ([`san`]), and client configurations that trust
//! exactly one cluster CA — discovered safely at `otherix login` by its
//! fingerprint (the same idea as `kubeadm join
//! --discovery-token-ca-cert-hash`).

#[cfg(feature = "handshakes")]
pub mod handshakes;
pub mod san;

/// Why a certificate, key or TLS configuration could not be used: the
/// input's fault (a bad fingerprint, PEM or certificate) or the
/// configuration's (rustls refused it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    #[error("invalid CA fingerprint {0:?}: expected sha256:<64 hex digits>")]
    Fingerprint(String),
    #[error("invalid certificate PEM: {0}")]
    CertificatePem(String),
    #[error("no certificate found in PEM")]
    NoCertificate,
    #[error("invalid private key PEM: {0}")]
    KeyPem(String),
    #[error("no private key found in PEM")]
    NoKey,
    #[error("unreadable certificate: {0}")]
    Certificate(String),
    #[error("cluster CA certificate is unusable: {0}")]
    UnusableCa(String),
    #[error("client certificate: {0}")]
    ClientCertificate(String),
    #[error("TLS configuration: {0}")]
    Config(String),
}

use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use sha2::{Digest, Sha256};

/// The name clients and agents verify the control plane by, whatever
/// address they dial: only the CP's serving certificate carries it. A node
/// or gateway certificate, also issued by the cluster CA, never does (node
/// names are DNS labels, without a dot), so a node cannot pass for the CP.
pub const CP_NAME: &str = "control-plane.otherix";

/// The cluster CA's common name is this followed by the cluster id (the `iss`
/// every credential of the cluster carries): a node that pinned the CA at
/// enrollment knows its cluster before the control plane ever answers it.
pub const CA_COMMON_NAME_PREFIX: &str = "otherix cluster CA ";

/// The name in node `node`'s client certificate (clientAuth only): a
/// namespace no server name can take.
pub fn node_cert_name(node: &str) -> String {
    format!("{node}.nodes.otherix")
}

/// The name in node `node`'s gateway serving certificate, beside the
/// granted address.
pub fn gateway_cert_name(node: &str) -> String {
    format!("{node}.gateway.otherix")
}

/// The name in node `node`'s relay-endpoint serving certificate, beside the
/// granted address; the CP dials the relay endpoint by it.
pub fn relay_cert_name(node: &str) -> String {
    format!("{node}.relay.otherix")
}

/// `ServerName` of [`CP_NAME`].
pub fn cp_server_name() -> ServerName<'static> {
    // A valid DNS name: a constant.
    ServerName::try_from(CP_NAME).expect("CP_NAME is a valid DNS name")
}

/// The crypto provider used everywhere in Otherix (ring: small to build).
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// `sha256:<hex>` of a DER certificate.
pub fn fingerprint(der: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(der)))
}

/// Normalizes a user-supplied fingerprint: accepts `sha256:HEX` or bare `HEX`,
/// any case, with or without `:` between bytes.
pub fn parse_fingerprint(s: &str) -> Result<[u8; 32], TlsError> {
    let hexpart = s.strip_prefix("sha256:").unwrap_or(s).replace(':', "");
    let bytes =
        hex::decode(hexpart.to_ascii_lowercase()).map_err(|_| TlsError::Fingerprint(s.to_string()))?;
    bytes.try_into().map_err(|_| TlsError::Fingerprint(s.to_string()))
}

/// Parses the first certificate of a PEM document.
pub fn cert_from_pem(pem: &str) -> Result<CertificateDer<'static>, TlsError> {
    match CertificateDer::pem_slice_iter(pem.as_bytes()).next() {
        Some(Ok(cert)) => Ok(cert),
        Some(Err(e)) => Err(TlsError::CertificatePem(e.to_string())),
        None => Err(TlsError::NoCertificate),
    }
}

/// Parses the private key of a PEM document (PKCS#8, SEC1 or PKCS#1).
pub fn key_from_pem(pem: &str) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|e| match e {
        pem::Error::NoItemsFound => TlsError::NoKey,
        e => TlsError::KeyPem(e.to_string()),
    })
}

/// PEM text of a DER certificate.
pub fn cert_to_pem(der: &[u8]) -> String {
    ::pem::encode(&::pem::Pem::new("CERTIFICATE", der.to_vec()))
}

/// A TLS client configuration that trusts only `ca` (the pinned cluster CA).
pub fn pinned_client_config(ca: CertificateDer<'static>) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.add(ca).map_err(|e| TlsError::UnusableCa(e.to_string()))?;
    let config = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(config)
}

/// Like [`pinned_client_config`], presenting `cert_pem`/`key_pem` as the
/// client certificate.
pub fn pinned_client_config_with_identity(
    ca: CertificateDer<'static>,
    cert_pem: &str,
    key_pem: &str,
) -> Result<rustls::ClientConfig, TlsError> {
    let mut roots = RootCertStore::empty();
    roots.add(ca).map_err(|e| TlsError::UnusableCa(e.to_string()))?;
    let cert = cert_from_pem(cert_pem)?;
    let key = key_from_pem(key_pem)?;
    rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots)
        .with_client_auth_cert(vec![cert], key)
        .map_err(|e| TlsError::ClientCertificate(e.to_string()))
}

/// Verifies the server against the CA it presents in its chain, provided that
/// CA's fingerprint is the expected one (or, with `expected == None`, any CA:
/// used only to show a person the fingerprint before they choose to trust it).
/// The CA found is kept so the caller can pin it.
#[derive(Debug)]
pub struct DiscoveringVerifier {
    expected: Option<[u8; 32]>,
    found: Mutex<Option<CertificateDer<'static>>>,
    provider: Arc<CryptoProvider>,
}

impl DiscoveringVerifier {
    pub fn new(expected: Option<[u8; 32]>) -> Arc<Self> {
        Arc::new(DiscoveringVerifier {
            expected,
            found: Mutex::new(None),
            provider: provider(),
        })
    }

    /// The CA certificate the server presented and the chain verified against.
    pub fn found_ca(&self) -> Option<CertificateDer<'static>> {
        self.found.lock().ok().and_then(|g| g.clone())
    }
}

impl ServerCertVerifier for DiscoveringVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // Otherix servers send [leaf, cluster CA]; the CA is the last element.
        let Some(ca) = intermediates.last() else {
            return Err(rustls::Error::General(
                "server did not present its cluster CA certificate".into(),
            ));
        };
        let digest: [u8; 32] = Sha256::digest(ca.as_ref()).into();
        if let Some(expected) = self.expected {
            // Not secret material, but constant-time costs nothing here.
            if !constant_time_eq(&digest, &expected) {
                return Err(rustls::Error::General(format!(
                    "cluster CA fingerprint mismatch: the server presented {}, expected sha256:{}",
                    fingerprint(ca.as_ref()),
                    hex::encode(expected)
                )));
            }
        }
        let ca = ca.clone().into_owned();
        let mut roots = RootCertStore::empty();
        roots.add(ca.clone())?;
        let inner = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
            .build()
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        inner.verify_server_cert(
            end_entity,
            &intermediates[..intermediates.len() - 1],
            server_name,
            ocsp_response,
            now,
        )?;
        if let Ok(mut found) = self.found.lock() {
            *found = Some(ca);
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprint_accepts_common_spellings() {
        let hex64 = "ab".repeat(32);
        let want = parse_fingerprint(&format!("sha256:{hex64}")).unwrap();
        assert_eq!(parse_fingerprint(&hex64.to_uppercase()).unwrap(), want);
        let colons = hex64
            .as_bytes()
            .chunks(2)
            .map(|c| std::str::from_utf8(c).unwrap())
            .collect::<Vec<_>>()
            .join(":");
        assert_eq!(parse_fingerprint(&colons).unwrap(), want);
    }

    #[test]
    fn pem_round_trips() {
        let der: Vec<u8> = (0..731u32).map(|i| (i * 7 + 3) as u8).collect();
        let back = cert_from_pem(&cert_to_pem(&der)).unwrap();
        assert_eq!(back.as_ref(), der.as_slice());
    }

    #[test]
    fn short_fingerprint_is_refused() {
        let err = parse_fingerprint("sha256:abcd").unwrap_err();
        assert!(err.to_string().contains("64 hex digits"), "{err}");
    }
}
