//! The cluster CA: created on first start, kept in the data directory, and
//! used to sign every certificate of the cluster, each with one purpose:
//! the CP's serving certificate (serverAuth, `control-plane.otherix` and its
//! addresses) and relay client certificate (clientAuth,
//! `control-plane.otherix`), node client certificates (clientAuth,
//! `NODE.nodes.otherix`), gateway and relay-endpoint serving certificates
//! (serverAuth, `NODE.gateway.otherix` / `NODE.relay.otherix` and the
//! granted address).

use std::fs;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::{Duration, OffsetDateTime};

/// How long the cluster CA is valid.
const CA_VALIDITY: Duration = Duration::days(3650);
/// How long the CP's own certificates are valid. They are re-issued at
/// every start.
const SERVING_VALIDITY: Duration = Duration::days(365);
/// How long node, gateway and relay certificates are valid by default
/// (`--node-cert-validity`); agents renew them at two thirds.
pub const NODE_CERT_VALIDITY: Duration = Duration::days(30);

/// The cluster certificate authority.
pub struct ClusterCa {
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa")
            .field("fingerprint", &self.fingerprint())
            .finish_non_exhaustive()
    }
}

/// A certificate chain `[leaf, CA]` and the leaf's private key.
pub struct ServingIdentity {
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl ClusterCa {
    /// Loads `ca.crt`/`ca.key` from `dir`, or creates them (key mode 0600).
    ///
    /// `in_use` says whether the cluster's store shows it ever started
    /// with a CA (it recorded the CA's fingerprint, or has users). When it
    /// does not, a `ca.key` without its `ca.crt` is a first start stopped
    /// between the two writes: nothing was ever issued with that key, so
    /// it is made anew (logged) rather than the cluster never starting.
    pub fn load_or_create(dir: &Path, cluster_id: &str, in_use: bool) -> anyhow::Result<ClusterCa> {
        let (key_path, cert_path) = (dir.join("ca.key"), dir.join("ca.crt"));
        if !in_use && key_path.exists() && !cert_path.exists() {
            tracing::warn!(dir = %dir.display(), "a first start stopped after writing ca.key, before ca.crt; making the cluster CA anew");
            fs::remove_file(&key_path).with_context(|| format!("removing {}", key_path.display()))?;
        }
        if let Some(ca) = ClusterCa::load(dir)? {
            return Ok(ca);
        }
        let ca = ClusterCa::generate(cluster_id)?;
        // Key first: a crash between the two writes leaves a key and no
        // certificate, which the next start reports (or, before the
        // cluster ever started, makes anew: above) instead of silently
        // making a second CA.
        write_private(&key_path, ca.key_pem().as_bytes())?;
        ca.write_cert(dir)?;
        Ok(ca)
    }

    /// Loads `ca.crt`/`ca.key` from `dir`; `None` when neither is there.
    /// Only one of the two is reported, never taken for "no CA".
    pub fn load(dir: &Path) -> anyhow::Result<Option<ClusterCa>> {
        let cert_path = dir.join("ca.crt");
        let key_path = dir.join("ca.key");
        match (cert_path.exists(), key_path.exists()) {
            (true, true) => {
                let cert_pem = fs::read_to_string(&cert_path)
                    .with_context(|| format!("reading {}", cert_path.display()))?;
                let key_pem =
                    fs::read_to_string(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
                Ok(Some(ClusterCa::from_pem(&cert_pem, &key_pem)?))
            }
            (false, false) => Ok(None),
            (cert, _) => bail!(
                "the data directory {} holds {} but not {}; restore it from a backup or start with an empty directory",
                dir.display(),
                if cert { "ca.crt" } else { "ca.key" },
                if cert { "ca.key" } else { "ca.crt" }
            ),
        }
    }

    /// A CA from its certificate and key (PEM).
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> anyhow::Result<ClusterCa> {
        let key = KeyPair::from_pem(key_pem).context("parsing the cluster CA key")?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).context("parsing the cluster CA certificate")?;
        let cert_der = otherix_tls::cert_from_pem(cert_pem).map_err(anyhow::Error::msg)?;
        Ok(ClusterCa {
            cert_der,
            cert_pem: cert_pem.to_string(),
            issuer,
        })
    }

    /// A new CA (ECDSA P-256, ten years), in memory.
    pub fn generate(cluster_id: &str) -> anyhow::Result<ClusterCa> {
        let key = KeyPair::generate().context("generating the cluster CA key")?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "Otherix");
        // Names the cluster, so that a node knows it (`iss`) from its enrollment.
        dn.push(
            DnType::CommonName,
            format!("{}{cluster_id}", otherix_tls::CA_COMMON_NAME_PREFIX),
        );
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + CA_VALIDITY;
        let cert = params.self_signed(&key).context("self-signing the cluster CA")?;
        Ok(ClusterCa {
            cert_der: cert.der().clone(),
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// A secret derived from the CA's key for `label`: HMAC-SHA256 of the
    /// label under a hash of the key. Every replica holds the CA's key, so
    /// every replica derives the same secret without storing it; the label
    /// keeps it apart from anything else (the key itself only signs).
    pub fn derive_secret(&self, label: &str) -> [u8; 32] {
        let der = self.issuer.key().serialize_der();
        let hashed = ring::digest::digest(&ring::digest::SHA256, &der);
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, hashed.as_ref());
        let tag = ring::hmac::sign(&key, label.as_bytes());
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    /// The CA's private key (PEM): only ever written to a 0600 file or
    /// sealed.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// Writes the certificate (public) to `dir/ca.crt`, for `--ca-file` and
    /// other tools, unless it is there already.
    pub fn write_cert(&self, dir: &Path) -> anyhow::Result<()> {
        let path = dir.join("ca.crt");
        if fs::read_to_string(&path).is_ok_and(|pem| pem == self.cert_pem) {
            return Ok(());
        }
        write_atomic(&path, self.cert_pem.as_bytes(), 0o644)
    }

    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// `sha256:<hex>` of the CA certificate; what clients pin.
    pub fn fingerprint(&self) -> String {
        otherix_tls::fingerprint(self.cert_der.as_ref())
    }

    /// Issues a TLS serving certificate for `sans` (IPs or DNS names).
    pub fn issue_serving(&self, common_name: &str, sans: &[String]) -> anyhow::Result<ServingIdentity> {
        let key = KeyPair::generate().context("generating a serving key")?;
        let mut params = CertificateParams::new(sans.to_vec()).context("invalid subject alternative name")?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + SERVING_VALIDITY;
        params.use_authority_key_identifier_extension = true;
        let cert = params
            .signed_by(&key, &self.issuer)
            .context("signing a serving certificate")?;
        Ok(ServingIdentity {
            chain: vec![cert.der().clone(), self.cert_der.clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }
}

impl ClusterCa {
    /// Issues a client certificate (ClientAuth only) for `name`: the CP's
    /// identity when it dials agents' relay endpoints.
    pub fn issue_client(&self, name: &str) -> anyhow::Result<ServingIdentity> {
        let key = KeyPair::generate().context("generating a client key")?;
        let mut params = CertificateParams::new(vec![name.to_string()]).context("invalid client name")?;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::hours(1);
        params.not_after = now + SERVING_VALIDITY;
        params.use_authority_key_identifier_extension = true;
        let cert = params
            .signed_by(&key, &self.issuer)
            .context("signing a client certificate")?;
        Ok(ServingIdentity {
            chain: vec![cert.der().clone(), self.cert_der.clone()],
            key: PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der())),
        })
    }

    /// Signs a node's client-certificate CSR: clientAuth only, named
    /// `NODE.nodes.otherix` (a name no server can take). Only the CSR's
    /// public key is taken: name, usage and validity are ours.
    pub fn sign_node_csr(&self, csr_pem: &str, node: &str, validity: Duration) -> anyhow::Result<IssuedCert> {
        self.sign_csr(
            csr_pem,
            &otherix_tls::node_cert_name(node),
            vec![SanType::DnsName(dns(&otherix_tls::node_cert_name(node))?)],
            ExtendedKeyUsagePurpose::ClientAuth,
            validity,
        )
    }

    /// Signs a gateway's serving CSR: serverAuth only, for the granted
    /// address and `NODE.gateway.otherix`.
    pub fn sign_gateway_csr(
        &self,
        csr_pem: &str,
        node: &str,
        ip: std::net::IpAddr,
        validity: Duration,
    ) -> anyhow::Result<IssuedCert> {
        self.sign_serving_csr(csr_pem, &otherix_tls::gateway_cert_name(node), ip, validity)
    }

    /// Signs a relay endpoint's serving CSR: serverAuth only, for
    /// `NODE.relay.otherix` alone — the name the CP dials by. No address:
    /// a relay certificate must never pass for a gateway at that address.
    pub fn sign_relay_csr(
        &self,
        csr_pem: &str,
        node: &str,
        validity: Duration,
    ) -> anyhow::Result<IssuedCert> {
        let name = otherix_tls::relay_cert_name(node);
        self.sign_csr(
            csr_pem,
            &name,
            vec![SanType::DnsName(dns(&name)?)],
            ExtendedKeyUsagePurpose::ServerAuth,
            validity,
        )
    }

    fn sign_serving_csr(
        &self,
        csr_pem: &str,
        name: &str,
        ip: std::net::IpAddr,
        validity: Duration,
    ) -> anyhow::Result<IssuedCert> {
        self.sign_csr(
            csr_pem,
            name,
            vec![SanType::DnsName(dns(name)?), SanType::IpAddress(ip)],
            ExtendedKeyUsagePurpose::ServerAuth,
            validity,
        )
    }

    fn sign_csr(
        &self,
        csr_pem: &str,
        common_name: &str,
        sans: Vec<SanType>,
        usage: ExtendedKeyUsagePurpose,
        validity: Duration,
    ) -> anyhow::Result<IssuedCert> {
        let csr = rcgen::CertificateSigningRequestParams::from_pem(csr_pem).context("invalid CSR")?;
        let mut params = CertificateParams::default();
        params.subject_alt_names = sans;
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, common_name);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![usage];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - Duration::minutes(5);
        params.not_after = now + validity;
        params.use_authority_key_identifier_extension = true;
        let cert = params
            .signed_by(&csr.public_key, &self.issuer)
            .context("signing the certificate")?;
        Ok(IssuedCert {
            fingerprint: otherix_tls::fingerprint(cert.der().as_ref()),
            pem: cert.pem(),
            not_after: params.not_after,
        })
    }
}

/// A certificate issued to a node.
#[derive(Debug, Clone)]
pub struct IssuedCert {
    pub pem: String,
    /// `sha256:<hex>` of the DER: how the CP recognizes (and revokes) it.
    pub fingerprint: String,
    pub not_after: OffsetDateTime,
}

fn dns(name: &str) -> anyhow::Result<rcgen::string::Ia5String> {
    rcgen::string::Ia5String::try_from(name.to_string()).context("invalid DNS name")
}

/// Writes a secret file readable by its owner only, atomically.
pub fn write_private(path: &Path, contents: &[u8]) -> anyhow::Result<()> {
    write_atomic(path, contents, 0o600)
}

fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> anyhow::Result<()> {
    let tmp: PathBuf = path.with_extension("tmp");
    let _ = fs::remove_file(&tmp);
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(contents)
        .and_then(|_| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_names_its_cluster_so_that_nodes_know_it_from_enrollment() {
        let ca = ClusterCa::generate("c0ffee").unwrap();
        assert_eq!(
            otherix_tls::san::CertInfo::cluster_of_ca(ca.cert_der.as_ref())
                .unwrap()
                .as_deref(),
            Some("c0ffee")
        );
    }

    #[test]
    fn ca_survives_a_reload_with_the_same_fingerprint() {
        let dir = tempdir();
        let a = ClusterCa::load_or_create(&dir, "c1", false).unwrap();
        let b = ClusterCa::load_or_create(&dir, "c1", true).unwrap();
        assert_eq!(a.fingerprint(), b.fingerprint());
        let mode = fs::metadata(dir.join("ca.key")).unwrap().permissions();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(mode.mode() & 0o777, 0o600);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn half_a_ca_is_reported_not_replaced() {
        let dir = tempdir();
        ClusterCa::load_or_create(&dir, "c1", false).unwrap();
        fs::remove_file(dir.join("ca.key")).unwrap();
        for in_use in [true, false] {
            let err = ClusterCa::load_or_create(&dir, "c1", in_use)
                .unwrap_err()
                .to_string();
            assert!(err.contains("holds ca.crt but not ca.key"), "{err}");
        }
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_key_without_its_certificate_is_made_anew_only_before_the_cluster_ever_started() {
        let dir = tempdir();
        let first = ClusterCa::load_or_create(&dir, "c1", false).unwrap();
        fs::remove_file(dir.join("ca.crt")).unwrap();
        // The store recorded a CA: whatever it issued is out there.
        let err = ClusterCa::load_or_create(&dir, "c1", true)
            .unwrap_err()
            .to_string();
        assert!(err.contains("holds ca.key but not ca.crt"), "{err}");
        assert!(dir.join("ca.key").exists(), "the key is kept");
        // A first start stopped between the two writes.
        let second = ClusterCa::load_or_create(&dir, "c1", false).unwrap();
        assert_ne!(first.fingerprint(), second.fingerprint());
        assert!(dir.join("ca.crt").exists() && dir.join("ca.key").exists());
        let _ = fs::remove_dir_all(&dir);
    }

    fn tempdir() -> PathBuf {
        let mut bytes = [0u8; 8];
        getrandom::fill(&mut bytes).unwrap();
        let dir = std::env::temp_dir().join(format!("otherix-pki-{}", hex::encode(bytes)));
        fs::create_dir_all(&dir).unwrap();
        dir
    }
}
