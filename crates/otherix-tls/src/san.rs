//! What a certificate says it is for: its names and addresses (the subject
//! alternative names), its issuer and its validity. Read, never trusted on
//! its own: callers pair it with a chain verification or compare it with
//! what the control plane granted.

use std::net::IpAddr;

use x509_parser::extensions::GeneralName;

use crate::TlsError;

/// The parts of a certificate Otherix reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertInfo {
    /// DNS names among the SANs, in order.
    pub dns_names: Vec<String>,
    /// IP addresses among the SANs, in order.
    pub ips: Vec<IpAddr>,
    /// The raw DER of the issuer's and the subject's names.
    pub issuer: Vec<u8>,
    pub subject: Vec<u8>,
    /// Unix seconds.
    pub not_before: i64,
    pub not_after: i64,
}

impl CertInfo {
    /// Reads a DER certificate.
    pub fn parse(der: &[u8]) -> Result<CertInfo, TlsError> {
        let (_, cert) =
            x509_parser::parse_x509_certificate(der).map_err(|e| TlsError::Certificate(e.to_string()))?;
        let san = cert
            .subject_alternative_name()
            .map_err(|e| TlsError::Certificate(format!("SAN: {e}")))?;
        let mut dns_names = Vec::new();
        let mut ips = Vec::new();
        for name in san.iter().flat_map(|ext| ext.value.general_names.iter()) {
            match name {
                GeneralName::DNSName(d) => dns_names.push((*d).to_owned()),
                GeneralName::IPAddress(b) => {
                    if let Ok(v4) = <[u8; 4]>::try_from(*b) {
                        ips.push(IpAddr::from(v4));
                    } else if let Ok(v6) = <[u8; 16]>::try_from(*b) {
                        ips.push(IpAddr::from(v6));
                    }
                }
                _ => {}
            }
        }
        let validity = cert.validity();
        Ok(CertInfo {
            dns_names,
            ips,
            issuer: cert.issuer().as_raw().to_vec(),
            subject: cert.subject().as_raw().to_vec(),
            not_before: validity.not_before.timestamp(),
            not_after: validity.not_after.timestamp(),
        })
    }

    /// The cluster id a cluster CA certificate names in its common name
    /// ([`crate::CA_COMMON_NAME_PREFIX`]); `None` for any other certificate.
    pub fn cluster_of_ca(der: &[u8]) -> Result<Option<String>, TlsError> {
        let (_, cert) =
            x509_parser::parse_x509_certificate(der).map_err(|e| TlsError::Certificate(e.to_string()))?;
        let Some(cn) = cert.subject().iter_common_name().next() else {
            return Ok(None);
        };
        let cn = cn
            .as_str()
            .map_err(|e| TlsError::Certificate(format!("common name: {e}")))?;
        Ok(cn
            .strip_prefix(crate::CA_COMMON_NAME_PREFIX)
            .filter(|id| !id.is_empty() && !id.contains(char::is_whitespace))
            .map(str::to_owned))
    }

    /// Reads the first certificate of a PEM document.
    pub fn from_pem(pem: &str) -> Result<CertInfo, TlsError> {
        CertInfo::parse(crate::cert_from_pem(pem)?.as_ref())
    }

    /// Whether `name` is one of its DNS names.
    pub fn names(&self, name: &str) -> bool {
        self.dns_names.iter().any(|d| d == name)
    }

    /// Whether `ip` is one of its addresses.
    pub fn covers_ip(&self, ip: IpAddr) -> bool {
        self.ips.contains(&ip)
    }

    /// Whether `issuer` (the CA's own certificate) issued it, by name.
    pub fn issued_by(&self, issuer: &CertInfo) -> bool {
        self.issuer == issuer.subject
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn self_signed_with_cn(cn: &str) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.distinguished_name.push(rcgen::DnType::CommonName, cn);
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn a_cluster_ca_names_its_cluster_and_nothing_else_does() {
        let ca = self_signed_with_cn(&format!("{}c0ffee", crate::CA_COMMON_NAME_PREFIX));
        assert_eq!(CertInfo::cluster_of_ca(&ca).unwrap().as_deref(), Some("c0ffee"));
        for other in [
            "gw1.gateway.otherix",
            "otherix cluster CA ",
            "otherix cluster CA a b",
        ] {
            assert_eq!(
                CertInfo::cluster_of_ca(&self_signed_with_cn(other)).unwrap(),
                None,
                "{other:?}"
            );
        }
        assert!(CertInfo::cluster_of_ca(b"not DER").is_err());
    }

    #[test]
    fn names_and_addresses_are_read_apart() {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![
            "gw1.gateway.otherix".to_owned(),
            "10.0.0.7".to_owned(),
            "::1".to_owned(),
        ])
        .unwrap()
        .self_signed(&key)
        .unwrap();
        let info = CertInfo::from_pem(&cert.pem()).unwrap();
        assert_eq!(info.dns_names, ["gw1.gateway.otherix"]);
        assert!(info.names("gw1.gateway.otherix"));
        assert!(!info.names("gw2.gateway.otherix"));
        assert!(info.covers_ip("10.0.0.7".parse().unwrap()));
        assert!(info.covers_ip("::1".parse().unwrap()));
        assert!(!info.covers_ip("10.0.0.8".parse().unwrap()));
        assert!(info.issued_by(&info), "self-signed");
        assert!(info.not_before < info.not_after);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(CertInfo::parse(b"not a certificate").is_err());
        assert!(CertInfo::from_pem("").is_err());
    }
}
