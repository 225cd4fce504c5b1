//! The gateway's TLS server configuration: rustls with the ring provider,
//! ALPN `http/1.1` (the connect request is HTTP/1.1 and nothing else).

use std::sync::Arc;

use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::ServerConfig;

const HTTP11: &[u8] = b"http/1.1";

/// A server configuration presenting `chain` (leaf first, then the cluster
/// CA) with `key`, offering ALPN `http/1.1`.
pub fn server_config(
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<ServerConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    config.alpn_protocols = vec![HTTP11.to_vec()];
    Ok(config)
}

/// Like [`server_config`], with the certificate chosen per handshake by
/// `resolver`: a renewed certificate is then swapped in under a running
/// listener.
pub fn server_config_with_resolver(
    resolver: Arc<dyn rustls::server::ResolvesServerCert>,
) -> Result<ServerConfig, rustls::Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![HTTP11.to_vec()];
    Ok(config)
}

/// `config` with ALPN exactly `http/1.1`, copied only if it says otherwise.
pub(crate) fn with_http11_alpn(config: Arc<ServerConfig>) -> Arc<ServerConfig> {
    if config.alpn_protocols == [HTTP11] {
        return config;
    }
    let mut copy = (*config).clone();
    copy.alpn_protocols = vec![HTTP11.to_vec()];
    Arc::new(copy)
}
