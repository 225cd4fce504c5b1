//! TLS for both servers: the gateway's server configuration (rustls with
//! Otherix's provider, ring, ALPN `http/1.1`: the connect request is HTTP/1.1 and
//! nothing else), and serving certificates — PEM to a [`CertifiedKey`] and
//! the [`CertSlot`] a renewed one is swapped into under a running listener.
//! PEM and certificate contents are read by `otherix-tls`.

use std::sync::{Arc, RwLock};

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WantsServerCert};
use rustls::sign::CertifiedKey;
use rustls::{ConfigBuilder, ServerConfig};

const HTTP11: &[u8] = b"http/1.1";

/// The gateway's server configuration presenting `chain` (leaf first, then
/// the cluster CA) with `key`, offering ALPN `http/1.1`.
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<ServerConfig, rustls::Error> {
    Ok(http11(gateway_builder()?.with_single_cert(chain, key)?))
}

/// Like [`server_config`], with the certificate chosen per handshake by
/// `resolver`: a renewed certificate is then swapped in under a running
/// listener.
pub fn server_config_with_resolver(
    resolver: Arc<dyn ResolvesServerCert>,
) -> Result<ServerConfig, rustls::Error> {
    Ok(http11(gateway_builder()?.with_cert_resolver(resolver)))
}

/// The gateway's TLS up to its certificate: Otherix's provider, safe
/// protocol versions, no client certificate (the credential authenticates).
fn gateway_builder() -> Result<ConfigBuilder<ServerConfig, WantsServerCert>, rustls::Error> {
    Ok(ServerConfig::builder_with_provider(otherix_tls::provider())
        .with_safe_default_protocol_versions()?
        .with_no_client_auth())
}

fn http11(mut config: ServerConfig) -> ServerConfig {
    config.alpn_protocols = vec![HTTP11.to_vec()];
    config
}

/// `config` with ALPN exactly `http/1.1`, copied only if it says otherwise.
pub(crate) fn with_http11_alpn(config: Arc<ServerConfig>) -> Arc<ServerConfig> {
    if config.alpn_protocols == [HTTP11] {
        return config;
    }
    Arc::new(http11((*config).clone()))
}

// ------------------------------------------------ serving certificates

/// A serving certificate and key from PEM could not be used (the fault of
/// whoever supplied them: a file, the control plane, a test).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The certificate or the CA is not readable PEM.
    #[error("{0}")]
    Certificate(otherix_tls::TlsError),
    /// The private key is not readable PEM.
    #[error("unreadable key: {0}")]
    Key(otherix_tls::TlsError),
    /// The key is of a kind the provider cannot sign with.
    #[error("{0}")]
    UnsupportedKey(rustls::Error),
    /// The key is not the certificate's.
    #[error("key does not match the certificate: {0}")]
    KeyMismatch(rustls::Error),
    /// The cluster CA cannot serve as a trust anchor.
    #[error("cluster CA certificate is unusable: {0}")]
    Ca(rustls::Error),
    /// The client certificate verifier could not be built.
    #[error("client certificate verifier: {0}")]
    ClientVerifier(#[from] rustls::server::VerifierBuilderError),
    /// rustls refused the configuration.
    #[error(transparent)]
    Rustls(#[from] rustls::Error),
}

/// `cert_pem` with `key_pem`, ready to serve as the chain `[leaf, CA]`
/// (clients find the CA they pin in it); the key must be the certificate's.
pub fn certified_from_pem(
    cert_pem: &str,
    key_pem: &str,
    ca_pem: &str,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let leaf = otherix_tls::cert_from_pem(cert_pem).map_err(TlsError::Certificate)?;
    let ca = otherix_tls::cert_from_pem(ca_pem).map_err(TlsError::Certificate)?;
    let key = otherix_tls::key_from_pem(key_pem).map_err(TlsError::Key)?;
    let signer = rustls::crypto::ring::sign::any_supported_type(&key).map_err(TlsError::UnsupportedKey)?;
    let certified = CertifiedKey::new(vec![leaf, ca], signer);
    certified.keys_match().map_err(TlsError::KeyMismatch)?;
    Ok(Arc::new(certified))
}

/// The certificate in force. A listener's TLS configuration resolves
/// through it, so a renewed certificate is swapped in without closing
/// anything.
#[derive(Debug)]
pub struct CertSlot(RwLock<Arc<CertifiedKey>>);

impl CertSlot {
    pub fn new(certified: Arc<CertifiedKey>) -> Arc<CertSlot> {
        Arc::new(CertSlot(RwLock::new(certified)))
    }

    /// Serves `certified` from the next handshake on.
    pub fn set(&self, certified: Arc<CertifiedKey>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = certified;
    }
}

impl ResolvesServerCert for CertSlot {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(|p| p.into_inner()).clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA and a certificate it signs for `name`: (cert, key, CA) PEM.
    fn issue(name: &str) -> (String, String, String) {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .signed_by(&key, &issuer)
            .unwrap();
        (cert.pem(), key.serialize_pem(), ca.pem())
    }

    #[test]
    fn a_certificate_is_served_with_its_own_key_and_the_ca_only() {
        let (cert, key, ca) = issue("gw1.gateway.otherix");
        let certified = certified_from_pem(&cert, &key, &ca).unwrap();
        assert_eq!(certified.cert.len(), 2, "leaf and cluster CA");
        let (_, other_key, _) = issue("gw1.gateway.otherix");
        let err = certified_from_pem(&cert, &other_key, &ca).unwrap_err();
        assert!(matches!(err, TlsError::KeyMismatch(_)), "{err}");
        assert!(
            err.to_string().starts_with("key does not match the certificate"),
            "{err}"
        );
        let err = certified_from_pem(&cert, "not a key", &ca).unwrap_err();
        assert!(matches!(err, TlsError::Key(_)), "{err}");
    }
}
