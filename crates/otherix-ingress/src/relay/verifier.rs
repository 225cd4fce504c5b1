//! The relay endpoint's TLS: its serving certificate, and the one client it
//! lets in — the control plane. Node certificates chain to the same cluster
//! CA, so the chain alone would let any node in; the client certificate
//! must also name exactly `control-plane.otherix`.

use std::sync::Arc;

use otherix_proto::relay;
use otherix_tls::san::CertInfo;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ResolvesServerCert, WebPkiClientVerifier};
use rustls::{CertificateError, DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tracing::info;

use crate::tls::TlsError;

/// The endpoint's TLS: the relay serving certificate (and the CA) that
/// `resolver` holds — a [`crate::tls::CertSlot`], so renewal closes nothing —
/// and the control plane's client certificate required.
pub fn server_config(
    resolver: Arc<dyn ResolvesServerCert>,
    ca_pem: &str,
) -> Result<rustls::ServerConfig, TlsError> {
    let provider = otherix_tls::provider();
    let ca = otherix_tls::cert_from_pem(ca_pem).map_err(TlsError::Certificate)?;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).map_err(TlsError::Ca)?;
    let inner = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    Ok(rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(Arc::new(ControlPlaneOnly { inner }))
        .with_cert_resolver(resolver))
}

/// Accepts a client certificate only if it chains to the cluster CA and its
/// DNS names are exactly [`relay::CP_CLIENT_NAME`].
#[derive(Debug)]
struct ControlPlaneOnly {
    inner: Arc<dyn ClientCertVerifier>,
}

impl ClientCertVerifier for ControlPlaneOnly {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.inner.verify_client_cert(end_entity, intermediates, now)?;
        match CertInfo::parse(end_entity.as_ref()).map(|c| c.dns_names) {
            Ok(names) if names == [relay::CP_CLIENT_NAME] => Ok(ClientCertVerified::assertion()),
            Ok(names) => {
                info!(
                    ?names,
                    "relay refused a client certificate that is not the control plane's"
                );
                Err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName,
                ))
            }
            Err(reason) => Err(rustls::Error::General(reason.to_string())),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}
