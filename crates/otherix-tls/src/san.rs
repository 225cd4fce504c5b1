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
