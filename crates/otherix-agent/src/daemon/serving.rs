//! Serving certificates for the roles an admin granted this node — the
//! gateway and the relay endpoint — each with one purpose (serverAuth), for
//! the granted address, issued by the control plane for a key made here.
//!
//! ```text
//! start        saved NAME.crt/.key still fit (CA, name, address, validity)? ──▶ serve at once
//! heartbeat    none yet, address changed, or two thirds of its life gone?
//!              ──▶ key, CSR, POST /v1/agent/certificate {purpose} ──▶ saved (key first)
//!              ──▶ swapped in under the running listener (TLS resolves through a slot)
//! ```
//!
//! The control plane decides the names and the address; the request only
//! carries a public key. The certificate is checked before it is served, so
//! a control plane (or a file) handing over something else is not used.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use otherix_client::{Client, ClientError};
use otherix_ingress::tls::{certified_from_pem, CertSlot, TlsError};
use otherix_proto::agent::{CertPurpose, CertificateRequest};
use otherix_tls as tls;
use otherix_tls::san::CertInfo;
use rustls::sign::CertifiedKey;
use tracing::{debug, info, warn};

use super::{files, DaemonError};

/// Longest wait for the control plane to sign a certificate.
const CERT_TIMEOUT: Duration = Duration::from_secs(10);

/// The DNS name a certificate of `purpose` for `node` carries.
pub fn cert_name(purpose: CertPurpose, node: &str) -> String {
    match purpose {
        CertPurpose::Node => tls::node_cert_name(node),
        CertPurpose::Gateway => tls::gateway_cert_name(node),
        CertPurpose::Relay => tls::relay_cert_name(node),
    }
}

/// Validity of a certificate, unix seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Validity {
    pub not_before: i64,
    pub not_after: i64,
}

impl Validity {
    /// Renewal is due once two thirds of the lifetime have passed: a
    /// 30-day certificate is renewed with 10 days left.
    pub fn renewal_due(&self, now: i64) -> bool {
        let life = (self.not_after - self.not_before).max(0);
        now >= self.not_before + life * 2 / 3
    }
}

/// Why a certificate does not fit what it is to serve as: the fault of
/// whoever handed it over (a file from an earlier run, the control plane).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CertUnfit {
    /// Not a readable certificate.
    #[error("{0}")]
    Unreadable(otherix_tls::TlsError),
    /// The cluster CA is not a readable certificate.
    #[error("CA: {0}")]
    UnreadableCa(otherix_tls::TlsError),
    #[error("not issued by the cluster CA")]
    NotIssuedByCa,
    /// It does not carry the granted address.
    #[error("does not name {0}")]
    MissingIp(IpAddr),
    /// It does not carry the role's name.
    #[error("does not name {0}")]
    MissingName(String),
    #[error("not valid yet")]
    NotYetValid,
    #[error("expired")]
    Expired,
}

/// Whether `cert_pem` is a certificate for `name` (and `ip`, when given)
/// issued by the cluster CA `ca_pem`, valid at `now` (unix seconds).
pub fn check_cert(
    cert_pem: &str,
    ca_pem: &str,
    name: &str,
    ip: Option<IpAddr>,
    now: i64,
) -> Result<Validity, CertUnfit> {
    let cert = CertInfo::from_pem(cert_pem).map_err(CertUnfit::Unreadable)?;
    let ca = CertInfo::from_pem(ca_pem).map_err(CertUnfit::UnreadableCa)?;
    if !cert.issued_by(&ca) {
        return Err(CertUnfit::NotIssuedByCa);
    }
    if let Some(ip) = ip {
        if !cert.covers_ip(ip) {
            return Err(CertUnfit::MissingIp(ip));
        }
    }
    if !cert.names(name) {
        return Err(CertUnfit::MissingName(name.to_owned()));
    }
    let v = Validity {
        not_before: cert.not_before,
        not_after: cert.not_after,
    };
    if now < v.not_before {
        return Err(CertUnfit::NotYetValid);
    }
    if now >= v.not_after {
        return Err(CertUnfit::Expired);
    }
    Ok(v)
}

/// Why the saved certificate is not served (it is asked for anew).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SavedCertError {
    /// The host: the files cannot be read.
    #[error(transparent)]
    Read(#[from] DaemonError),
    /// The files: not for this role, address or cluster, or out of date.
    #[error(transparent)]
    Unfit(#[from] CertUnfit),
    /// The files: the key is unreadable or not the certificate's.
    #[error(transparent)]
    Unusable(#[from] TlsError),
}

/// Why no certificate came from the control plane (retried after the next
/// heartbeat). Variants say who is at fault: this host (`Key`, `Csr`,
/// `Save`), the control plane being unreachable or refusing (`NoAnswer`,
/// `ControlPlane`), or what it handed over (`Unfit`, `Unusable`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertRequestError {
    #[error("generating a key: {0}")]
    Key(#[source] rcgen::Error),
    #[error("building the CSR: {0}")]
    Csr(#[source] rcgen::Error),
    #[error("no answer within {0:?}")]
    NoAnswer(Duration),
    #[error(transparent)]
    ControlPlane(#[from] ClientError),
    #[error("the control plane's certificate is unusable: {0}")]
    Unfit(#[source] CertUnfit),
    #[error(transparent)]
    Unusable(#[from] TlsError),
    #[error(transparent)]
    Save(#[from] DaemonError),
}

pub fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
}

/// Removes the serving certificates and keys saved in `dir`, before a node
/// enrolls there. Any left belong to an earlier identity, whose
/// certificates the control plane revoked when it deleted or replaced the
/// node: clients accept only the gateway certificates it stands behind
/// (and it dials only relay certificates it does), so, reused at start,
/// they would be refused until their renewal, weeks later.
pub fn forget_saved(dir: &Path) -> Result<(), DaemonError> {
    for purpose in [CertPurpose::Gateway, CertPurpose::Relay] {
        for ext in ["crt", "key"] {
            let path = dir.join(format!("{}.{ext}", purpose.as_str()));
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    info!(file = %path.display(), "removed a serving certificate of an earlier enrollment")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(DaemonError::io("remove", &path, e)),
            }
        }
    }
    Ok(())
}

/// One role's serving certificate: kept in the data directory, renewed
/// from the control plane, served through a [`CertSlot`].
pub struct ServingCert {
    purpose: CertPurpose,
    /// The DNS name it must carry.
    name: String,
    /// The granted address's IP it must carry (a gateway's; a relay
    /// certificate names no address).
    ip: IpAddr,
    dir: PathBuf,
    ca_pem: String,
    cert_file: String,
    key_file: String,
    /// The certificate in force, once there is one.
    current: Option<(Arc<CertSlot>, Validity)>,
    /// A failure to get one was logged at warn; quieter until it clears.
    trouble: bool,
}

impl ServingCert {
    /// The role's certificate, loading the saved one if it still fits.
    pub fn load(purpose: CertPurpose, node: &str, ip: IpAddr, dir: &Path, ca_pem: &str) -> ServingCert {
        let mut cert = ServingCert {
            purpose,
            name: cert_name(purpose, node),
            ip,
            dir: dir.to_owned(),
            ca_pem: ca_pem.to_owned(),
            cert_file: format!("{}.crt", purpose.as_str()),
            key_file: format!("{}.key", purpose.as_str()),
            current: None,
            trouble: false,
        };
        match cert.load_saved() {
            Ok(Some((certified, validity))) => cert.install(certified, validity),
            Ok(None) => {}
            Err(reason) => info!(
                purpose = purpose.as_str(),
                %reason,
                "the saved serving certificate does not fit; a new one is asked for after the next heartbeat"
            ),
        }
        cert
    }

    /// The resolver to serve with, once there is a certificate.
    pub fn slot(&self) -> Option<Arc<CertSlot>> {
        self.current.as_ref().map(|(slot, _)| slot.clone())
    }

    /// The granted address moved: the certificate in force no longer fits
    /// (it is kept serving until the new one arrives).
    pub fn set_ip(&mut self, ip: IpAddr) {
        if self.ip != ip {
            self.ip = ip;
            if let Some((_, v)) = &mut self.current {
                // Due at once.
                v.not_after = v.not_before;
            }
        }
    }

    /// Gets a certificate if there is none yet or renewal is due. Returns
    /// whether one is in force.
    pub async fn refresh(&mut self, client: &Client) -> bool {
        let due = self
            .current
            .as_ref()
            .is_none_or(|(_, v)| v.renewal_due(unix_now()));
        if due {
            match self.request(client).await {
                Ok((certified, validity)) => {
                    self.trouble = false;
                    self.install(certified, validity);
                }
                Err(reason) if !self.trouble => {
                    self.trouble = true;
                    warn!(purpose = self.purpose.as_str(), %reason, "cannot get a serving certificate; retrying after each heartbeat");
                }
                Err(reason) => {
                    debug!(purpose = self.purpose.as_str(), %reason, "serving certificate still unavailable")
                }
            }
        }
        self.current.is_some()
    }

    /// The address the certificate must name.
    fn address(&self) -> Option<IpAddr> {
        (self.purpose == CertPurpose::Gateway).then_some(self.ip)
    }

    fn load_saved(&self) -> Result<Option<(Arc<CertifiedKey>, Validity)>, SavedCertError> {
        let read = |name: &str| files::read_optional(&self.dir.join(name));
        let (Some(cert_pem), Some(key_pem)) = (read(&self.cert_file)?, read(&self.key_file)?) else {
            return Ok(None);
        };
        let validity = check_cert(&cert_pem, &self.ca_pem, &self.name, self.address(), unix_now())?;
        let certified = certified_from_pem(&cert_pem, &key_pem, &self.ca_pem)?;
        info!(file = %self.dir.join(&self.cert_file).display(), "reusing the saved serving certificate");
        Ok(Some((certified, validity)))
    }

    /// A new key, signed by the control plane for the granted address
    /// (which it takes from its own state), saved key first, certificate last.
    async fn request(&self, client: &Client) -> Result<(Arc<CertifiedKey>, Validity), CertRequestError> {
        let key = rcgen::KeyPair::generate().map_err(CertRequestError::Key)?;
        let csr_pem = csr(&key)?;
        let req = CertificateRequest {
            purpose: self.purpose,
            csr_pem,
        };
        let resp = tokio::time::timeout(CERT_TIMEOUT, client.certificate(&req))
            .await
            .map_err(|_| CertRequestError::NoAnswer(CERT_TIMEOUT))??;
        let validity = check_cert(
            &resp.cert_pem,
            &self.ca_pem,
            &self.name,
            self.address(),
            unix_now(),
        )
        .map_err(CertRequestError::Unfit)?;
        let key_pem = key.serialize_pem();
        let certified = certified_from_pem(&resp.cert_pem, &key_pem, &self.ca_pem)?;
        let save = || -> Result<(), DaemonError> {
            files::write_atomic(&self.dir.join(&self.key_file), key_pem.as_bytes(), 0o600)?;
            files::write_atomic(&self.dir.join(&self.cert_file), resp.cert_pem.as_bytes(), 0o644)
        };
        if let Err(e) = save() {
            // Serve anyway; a restart asks again.
            warn!(error = %e, "cannot save the serving certificate");
        }
        info!(purpose = self.purpose.as_str(), ip = %self.ip, "serving certificate issued by the control plane");
        Ok((certified, validity))
    }

    fn install(&mut self, certified: Arc<CertifiedKey>, validity: Validity) {
        match &mut self.current {
            Some((slot, v)) => {
                slot.set(certified);
                *v = validity;
                info!(purpose = self.purpose.as_str(), "serving certificate renewed");
            }
            None => self.current = Some((CertSlot::new(certified), validity)),
        }
    }
}

/// A CSR for `key`. The control plane takes only the public key: names,
/// usages and validity are its own.
pub fn csr(key: &rcgen::KeyPair) -> Result<String, CertRequestError> {
    rcgen::CertificateParams::new(Vec::<String>::new())
        .and_then(|p| p.serialize_request(key))
        .and_then(|csr| csr.pem())
        .map_err(CertRequestError::Csr)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA named `ca_name` and a certificate it signs for `sans`.
    pub(crate) fn issue(ca_name: &str, sans: &[&str]) -> (String, String, String) {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
        let ca_key = KeyPair::generate().unwrap();
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, ca_name);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issuer = Issuer::new(ca_params, ca_key);
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(sans.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
        let cert = params.signed_by(&key, &issuer).unwrap();
        (cert.pem(), key.serialize_pem(), ca.pem())
    }

    #[test]
    fn enrolling_forgets_the_serving_certificates_of_an_earlier_identity() {
        let dir = std::env::temp_dir().join(format!("otherix-agent-forget-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        files::ensure_dir(&dir).unwrap();
        for f in [
            "gateway.crt",
            "gateway.key",
            "relay.crt",
            "relay.key",
            "node.crt",
            "desired.json",
        ] {
            std::fs::write(dir.join(f), "x").unwrap();
        }
        forget_saved(&dir).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["desired.json", "node.crt"]);
        // Nothing to forget: fine.
        forget_saved(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let gw = ServingCert::load(CertPurpose::Gateway, "gw1", "10.0.0.1".parse().unwrap(), &dir, "");
        assert_eq!(gw.cert_file, "gateway.crt", "the names forget_saved removes");
        assert_eq!(gw.key_file, "gateway.key");
    }

    #[test]
    fn a_saved_certificate_is_reused_only_for_the_same_name_address_and_ca() {
        let (cert, key, ca) = issue("CA one", &["gw1.gateway.otherix", "10.213.1.5"]);
        let ip: IpAddr = "10.213.1.5".parse().unwrap();
        let now = unix_now();
        let v = check_cert(&cert, &ca, "gw1.gateway.otherix", Some(ip), now).expect("fits");
        assert!(v.not_after > now);
        certified_from_pem(&cert, &key, &ca).expect("key and certificate match");

        let other_ip = "10.213.1.6".parse().unwrap();
        let err = check_cert(&cert, &ca, "gw1.gateway.otherix", Some(other_ip), now).unwrap_err();
        assert_eq!(err, CertUnfit::MissingIp(other_ip));
        assert_eq!(err.to_string(), "does not name 10.213.1.6");
        let err = check_cert(&cert, &ca, "gw1.relay.otherix", Some(ip), now).unwrap_err();
        assert_eq!(
            err,
            CertUnfit::MissingName("gw1.relay.otherix".into()),
            "a gateway certificate serves no relay"
        );
        let (_, _, other_ca) = issue("CA two", &["x"]);
        let err = check_cert(&cert, &other_ca, "gw1.gateway.otherix", Some(ip), now).unwrap_err();
        assert_eq!(err, CertUnfit::NotIssuedByCa);
        let err = check_cert(&cert, &ca, "gw1.gateway.otherix", Some(ip), v.not_after + 1).unwrap_err();
        assert_eq!(err, CertUnfit::Expired);
    }

    #[test]
    fn renewal_is_due_at_two_thirds_of_the_lifetime() {
        let v = Validity {
            not_before: 1_000,
            not_after: 1_000 + 30 * 86_400,
        };
        assert!(!v.renewal_due(1_000));
        assert!(!v.renewal_due(1_000 + 19 * 86_400));
        assert!(v.renewal_due(1_000 + 20 * 86_400));
        assert!(v.renewal_due(1_000 + 31 * 86_400));
    }
}
