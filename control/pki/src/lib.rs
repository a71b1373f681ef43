//! Laneway's public-key infrastructure: one CA per cluster, certificates that name a node's
//! identity, and the TLS settings every process (controller, agent, `lanectl`) builds from them.
//!
//! An identity is a URI in the certificate's subject alternative names,
//! `laneway://<cluster>/<kind>/<name>`: a controller's name is its Raft node id, an agent's its
//! node id, a person's or a script's their user name, with the kind giving their admin role.
//! Servers take the caller's identity from the certificate the TLS handshake verified, never
//! from the message. Controller certificates also carry the DNS names `controller.laneway` (any
//! controller; what agents and `lanectl` verify) and `controller-<id>.laneway` (one controller;
//! what a Raft peer verifies, so a certificate for another node id is refused at the handshake).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

pub use laneway_core::identity::{IdentityError, Kind, PeerIdentity};

/// The DNS name every controller certificate carries.
pub const ANY_CONTROLLER: &str = "controller.laneway";

/// The DNS name only controller `id`'s certificate carries.
pub fn controller_server_name(id: u64) -> String {
    format!("controller-{id}.laneway")
}

/// What went wrong with keys, certificates or TLS settings.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{0}")]
    Invalid(String),
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
}

impl From<IdentityError> for PkiError {
    fn from(e: IdentityError) -> Self {
        PkiError::Invalid(e.0)
    }
}

/// Parses a certificate (DER) and returns the identity in its SAN.
pub fn identity_of(cert_der: &[u8]) -> Result<PeerIdentity, PkiError> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| PkiError::Invalid(format!("unreadable certificate: {e}")))?;
    let sans = cert
        .subject_alternative_name()
        .map_err(|e| PkiError::Invalid(format!("unreadable subject alternative names: {e}")))?;
    let mut found = None;
    for name in sans.iter().flat_map(|s| s.value.general_names.iter()) {
        if let x509_parser::extensions::GeneralName::URI(uri) = name {
            if let Some(id) = PeerIdentity::from_uri(uri) {
                if found.is_some() {
                    return Err(PkiError::Invalid(
                        "the certificate names more than one laneway identity".into(),
                    ));
                }
                found = Some(id?);
            }
        }
    }
    found.ok_or_else(|| {
        PkiError::Invalid("the certificate names no laneway identity (laneway://cluster/kind/name SAN)".into())
    })
}

/// A certificate's serial number (DER), as lowercase hex: what `lanectl certs revoke` names.
pub fn serial_of(cert_der: &[u8]) -> Result<String, PkiError> {
    let (_, cert) = x509_parser::parse_x509_certificate(cert_der)
        .map_err(|e| PkiError::Invalid(format!("unreadable certificate: {e}")))?;
    Ok(hex::encode(cert.raw_serial()))
}

/// The sha256 (lowercase hex) of the public key a certificate signing request (PEM) is for:
/// what a join remembers, so that only the same key may ask again with the same token.
pub fn csr_key_sha256(csr_pem: &str) -> Result<String, PkiError> {
    use sha2::Digest as _;
    use x509_parser::prelude::FromDer as _;
    let (_, pem) = x509_parser::pem::parse_x509_pem(csr_pem.as_bytes())
        .map_err(|e| PkiError::Invalid(format!("the certificate signing request is not PEM: {e}")))?;
    let (_, csr) = x509_parser::certification_request::X509CertificationRequest::from_der(&pem.contents)
        .map_err(|e| PkiError::Invalid(format!("the certificate signing request is not valid: {e}")))?;
    Ok(hex::encode(sha2::Sha256::digest(
        csr.certification_request_info.subject_pki.raw,
    )))
}

/// [`serial_of`] for a PEM certificate.
pub fn serial_of_pem(cert_pem: &str) -> Result<String, PkiError> {
    serial_of(&first_cert_der(cert_pem)?)
}

/// The identity a certificate (PEM) names.
pub fn identity_of_pem(cert_pem: &str) -> Result<PeerIdentity, PkiError> {
    identity_of(&first_cert_der(cert_pem)?)
}

/// When a certificate (PEM) stops being valid.
pub fn not_after(cert_pem: &str) -> Result<SystemTime, PkiError> {
    validity(cert_pem).map(|(_, to)| to)
}

/// When a certificate (PEM) starts being valid.
pub fn not_before(cert_pem: &str) -> Result<SystemTime, PkiError> {
    validity(cert_pem).map(|(from, _)| from)
}

fn validity(cert_pem: &str) -> Result<(SystemTime, SystemTime), PkiError> {
    validity_der(&first_cert_der(cert_pem)?)
}

/// When a certificate (DER) starts and stops being valid.
pub fn validity_der(der: &[u8]) -> Result<(SystemTime, SystemTime), PkiError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| PkiError::Invalid(format!("unreadable certificate: {e}")))?;
    let at = |t: i64| SystemTime::UNIX_EPOCH + Duration::from_secs(t.max(0) as u64);
    Ok((
        at(cert.validity().not_before.timestamp()),
        at(cert.validity().not_after.timestamp()),
    ))
}

fn first_cert_der(cert_pem: &str) -> Result<Vec<u8>, PkiError> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
        .map_err(|e| PkiError::Invalid(format!("not a PEM certificate: {e}")))?;
    Ok(pem.contents)
}

/// A certificate and its private key, both PEM.
#[derive(Clone)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

impl fmt::Debug for Issued {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Issued").finish_non_exhaustive()
    }
}

/// The cluster's certificate authority.
pub struct Ca {
    cluster: String,
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl fmt::Debug for Ca {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ca")
            .field("cluster", &self.cluster)
            .finish_non_exhaustive()
    }
}

impl Ca {
    /// A new CA for `cluster`, valid for `valid_for`.
    pub fn create(cluster: &str, valid_for: Duration) -> Result<Ca, PkiError> {
        PeerIdentity::new(cluster, Kind::Viewer, "ca")?;
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = dn(&format!("laneway cluster CA {cluster}"), cluster);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        set_validity(&mut params, valid_for);
        let cert = params.self_signed(&key)?;
        let (cert_pem, key_pem) = (cert.pem(), key.serialize_pem());
        Ca::load(&cert_pem, &key_pem)
    }

    /// A CA from its certificate and key (PEM).
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<Ca, PkiError> {
        let key = KeyPair::from_pem(key_pem)?;
        let der = first_cert_der(cert_pem)?;
        let (_, cert) = x509_parser::parse_x509_certificate(&der)
            .map_err(|e| PkiError::Invalid(format!("unreadable CA certificate: {e}")))?;
        if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(PkiError::Invalid(
                "the CA key does not belong to the CA certificate".into(),
            ));
        }
        let cluster = cert
            .subject()
            .iter_organization()
            .next()
            .and_then(|o| o.as_str().ok())
            .map(str::to_string)
            .ok_or_else(|| PkiError::Invalid("the CA certificate names no cluster (organization)".into()))?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(Ca {
            cluster,
            cert_pem: cert_pem.to_string(),
            key_pem: key_pem.to_string(),
            issuer,
        })
    }

    /// Reads `ca.pem` and `ca.key` from `dir`.
    pub fn load_dir(dir: &Path) -> Result<Ca, PkiError> {
        Ca::load(&read(&dir.join("ca.pem"))?, &read(&dir.join("ca.key"))?)
    }

    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// A new key and a certificate for `kind`/`name`, with `extra_dns` names (hostnames or IP
    /// addresses the holder is also reached by) added to its SANs.
    pub fn issue(&self, kind: Kind, name: &str, extra_dns: &[String], valid_for: Duration) -> Result<Issued, PkiError> {
        let key = KeyPair::generate()?;
        let params = self.leaf_params(kind, name, extra_dns, valid_for)?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Signs a certificate signing request (PEM) for `kind`/`name`. The names in the request
    /// are ignored: the identity is the one the CA was asked to certify.
    pub fn sign_csr(&self, csr_pem: &str, kind: Kind, name: &str, valid_for: Duration) -> Result<String, PkiError> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| PkiError::Invalid(format!("the certificate signing request is not valid: {e}")))?;
        csr.params = self.leaf_params(kind, name, &[], valid_for)?;
        Ok(csr.signed_by(&self.issuer)?.pem())
    }

    fn leaf_params(
        &self,
        kind: Kind,
        name: &str,
        extra_dns: &[String],
        valid_for: Duration,
    ) -> Result<CertificateParams, PkiError> {
        let id = PeerIdentity::new(&self.cluster, kind, name)?;
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = dn(&id.to_string(), &self.cluster);
        params
            .subject_alt_names
            .push(SanType::URI(id.uri().as_str().try_into()?));
        if let Some(n) = id.controller_id() {
            for dns in [ANY_CONTROLLER.to_string(), controller_server_name(n)] {
                params
                    .subject_alt_names
                    .push(SanType::DnsName(dns.as_str().try_into()?));
            }
        }
        for extra in extra_dns {
            params.subject_alt_names.push(match extra.parse::<std::net::IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(extra.as_str().try_into()?),
            });
        }
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params, valid_for);
        Ok(params)
    }
}

fn dn(common_name: &str, cluster: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, cluster);
    dn
}

/// Valid from a minute ago (clocks of the hosts differ a little) for `valid_for`.
fn set_validity(params: &mut CertificateParams, valid_for: Duration) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::minutes(1);
    params.not_after = now + time::Duration::seconds(valid_for.as_secs().min(i64::MAX as u64) as i64);
    let mut serial = [0u8; 16];
    rand::Rng::fill(&mut rand::rng(), &mut serial[..]);
    serial[0] &= 0x7f;
    params.serial_number = Some(serial.to_vec().into());
}

/// A new key and a certificate signing request for it (both PEM); the CA decides the names.
pub fn new_csr() -> Result<Issued, PkiError> {
    let key = KeyPair::generate()?;
    let csr = CertificateParams::new(Vec::<String>::new())?.serialize_request(&key)?;
    Ok(Issued {
        cert_pem: csr.pem()?,
        key_pem: key.serialize_pem(),
    })
}

/// Where a process finds its TLS material.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
pub struct TlsFiles {
    /// The cluster CA's certificate.
    pub ca: Option<PathBuf>,
    /// This process's certificate.
    pub cert: Option<PathBuf>,
    /// This process's private key.
    pub key: Option<PathBuf>,
    /// Controllers only, optional: the CA's key, so that controllers sign the certificates of
    /// agents that join with a token (and renew them). Without it agents need certificates
    /// issued with `lanectl certs issue`.
    #[serde(default)]
    pub ca_key: Option<PathBuf>,
}

impl TlsFiles {
    /// `Ok(None)` when none of the three is set; an error naming what is missing when only some
    /// are (half-configured TLS never silently falls back to plaintext).
    pub fn load(&self) -> Result<Option<Tls>, PkiError> {
        match (&self.ca, &self.cert, &self.key) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => Tls::from_pem(read(ca)?, read(cert)?, read(key)?).map(Some),
            _ => {
                let missing: Vec<&str> = [("ca", &self.ca), ("cert", &self.cert), ("key", &self.key)]
                    .into_iter()
                    .filter(|(_, v)| v.is_none())
                    .map(|(n, _)| n)
                    .collect();
                Err(PkiError::Invalid(format!(
                    "TLS is half configured: {} missing; give all of ca, cert and key (make them with `lanectl certs init` and `lanectl certs issue`)",
                    missing.join(" and ")
                )))
            }
        }
    }
}

fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(|source| PkiError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// A process's TLS material, checked: its certificate names an identity and is in its
/// validity period.
#[derive(Clone)]
pub struct Tls {
    ca_pem: String,
    cert_pem: String,
    key_pem: String,
    identity: PeerIdentity,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Tls {
    pub fn from_pem(ca_pem: String, cert_pem: String, key_pem: String) -> Result<Tls, PkiError> {
        let identity = identity_of(&first_cert_der(&cert_pem)?)?;
        let expires = not_after(&cert_pem)?;
        if expires <= SystemTime::now() {
            return Err(PkiError::Invalid(format!(
                "the certificate for {identity} expired at {}; issue a new one with `lanectl certs issue`",
                humantime_like(expires)
            )));
        }
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| PkiError::Invalid(format!("the private key is not usable: {e}")))?;
        let der = first_cert_der(&cert_pem)?;
        let (_, cert) = x509_parser::parse_x509_certificate(&der)
            .map_err(|e| PkiError::Invalid(format!("unreadable certificate: {e}")))?;
        if cert.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
            return Err(PkiError::Invalid(format!(
                "the private key does not belong to the certificate for {identity}: install the key it was issued for"
            )));
        }
        first_cert_der(&ca_pem)?;
        Ok(Tls {
            ca_pem,
            cert_pem,
            key_pem,
            identity,
        })
    }

    /// Who this process is, from its own certificate.
    pub fn identity(&self) -> &PeerIdentity {
        &self.identity
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The server side: this certificate, and clients' certificates verified against the CA.
    /// A client certificate is optional at the handshake (token-only admin clients have
    /// none); each service then refuses callers without the identity it needs.
    pub fn server(&self, handshake_timeout: Duration) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            .client_auth_optional(true)
            .timeout(handshake_timeout)
    }

    /// The client side, verifying that the server's certificate names `server_name`.
    pub fn client(&self, server_name: &str) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .domain_name(server_name)
    }
}

/// A TLS acceptor for an HTTPS listener (the inference router) from a certificate chain and key
/// (PEM): the operator's certificate for the router's public name, from any CA. HTTP/1.1 only,
/// as the router speaks.
pub fn https_acceptor(cert_pem: &str, key_pem: &str) -> Result<tokio_rustls::TlsAcceptor, PkiError> {
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<_, _>>()
        .map_err(|e| PkiError::Invalid(format!("the router certificate is not PEM: {e}")))?;
    if chain.is_empty() {
        return Err(PkiError::Invalid(
            "the router certificate file holds no certificate".into(),
        ));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
        .map_err(|e| PkiError::Invalid(format!("the router key is not a PEM private key: {e}")))?;
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| PkiError::Invalid(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| PkiError::Invalid(format!("the router certificate and key do not go together: {e}")))?;
    // HTTP/2 for gRPC clients (the KServe v2 service), HTTP/1.1 for the rest.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)))
}

/// Client TLS without a certificate of one's own: for token-authenticated `lanectl` and for an
/// agent that has only a join token yet.
pub fn client_without_identity(ca_pem: &str, server_name: &str) -> ClientTlsConfig {
    ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name(server_name)
}

/// A gRPC endpoint for `addr` (`host:port`): `https` with `tls`, `http` without.
pub fn endpoint(addr: &str, tls: Option<ClientTlsConfig>) -> Result<Endpoint, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let ep = Endpoint::from_shared(format!("{scheme}://{addr}")).map_err(|e| e.to_string())?;
    match tls {
        Some(t) => ep.tls_config(t).map_err(|e| e.to_string()),
        None => Ok(ep),
    }
}

/// The identity a request's client certificate names: `None` without a certificate (or
/// without TLS), an error when the certificate names none that is readable.
pub fn peer_identity<T>(req: &tonic::Request<T>) -> Option<Result<PeerIdentity, PkiError>> {
    let certs = req.peer_certs()?;
    let leaf = certs.first()?;
    Some(identity_of(leaf.as_ref()))
}

fn humantime_like(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    time::OffsetDateTime::from_unix_timestamp(secs as i64)
        .map(|d| d.to_string())
        .unwrap_or_else(|_| format!("unix {secs}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn issued_certificates_name_their_identity() {
        let ca = Ca::create("prod", DAY).unwrap();
        assert_eq!(ca.cluster(), "prod");
        let c = ca
            .issue(Kind::Controller, "2", &["10.0.0.2".into(), "c2.example".into()], DAY)
            .unwrap();
        let der = first_cert_der(&c.cert_pem).unwrap();
        let id = identity_of(&der).unwrap();
        assert_eq!(id, PeerIdentity::new("prod", Kind::Controller, "2").unwrap());
        assert_eq!(id.controller_id(), Some(2));
        let (_, x) = x509_parser::parse_x509_certificate(&der).unwrap();
        let sans = format!("{:?}", x.subject_alternative_name().unwrap().unwrap().value);
        for want in [
            "controller.laneway",
            "controller-2.laneway",
            "c2.example",
            "[10, 0, 0, 2]",
        ] {
            assert!(sans.contains(want), "{want} not in {sans}");
        }
        // Reloading the CA from its PEM gives an issuer for the same cluster.
        let again = Ca::load(ca.cert_pem(), ca.key_pem()).unwrap();
        let other = Ca::create("prod", DAY).unwrap();
        assert!(
            Ca::load(ca.cert_pem(), other.key_pem()).is_err(),
            "a key of another CA is refused"
        );
        let a = again.issue(Kind::Agent, "h100-1", &[], DAY).unwrap();
        assert_eq!(
            identity_of(&first_cert_der(&a.cert_pem).unwrap()).unwrap().to_string(),
            "agent:h100-1"
        );
    }

    #[test]
    fn a_csr_gets_the_identity_the_ca_chooses() {
        let ca = Ca::create("prod", DAY).unwrap();
        let req = new_csr().unwrap();
        let cert = ca.sign_csr(&req.cert_pem, Kind::Agent, "l4-7", DAY).unwrap();
        let id = identity_of(&first_cert_der(&cert).unwrap()).unwrap();
        assert_eq!((id.kind, id.name.as_str()), (Kind::Agent, "l4-7"));
        // The key in the certificate is the one from the request.
        Tls::from_pem(ca.cert_pem().into(), cert, req.key_pem).unwrap();
        assert!(ca.sign_csr("not a csr", Kind::Agent, "x", DAY).is_err());
    }

    #[test]
    fn bad_names_and_half_configured_tls_are_refused_with_the_reason() {
        let e = PeerIdentity::new("prod", Kind::Controller, "c1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("node id"), "{e}");
        let e = PeerIdentity::new("prod", Kind::Agent, "a/b").unwrap_err().to_string();
        assert!(e.contains("cannot go in a certificate"), "{e}");
        assert!("root".parse::<Kind>().is_err());
        let files = TlsFiles {
            ca: Some("/x/ca.pem".into()),
            ..TlsFiles::default()
        };
        let e = files.load().unwrap_err().to_string();
        assert!(e.contains("cert and key missing"), "{e}");
        assert!(TlsFiles::default().load().unwrap().is_none());
    }

    #[test]
    fn an_expired_certificate_is_refused_at_load() {
        let ca = Ca::create("prod", DAY).unwrap();
        let c = ca.issue(Kind::Agent, "a", &[], Duration::ZERO).unwrap();
        // Valid from a minute ago until now: already over.
        std::thread::sleep(Duration::from_millis(1100));
        let e = Tls::from_pem(ca.cert_pem().into(), c.cert_pem, c.key_pem)
            .unwrap_err()
            .to_string();
        assert!(e.contains("expired"), "{e}");
    }
}
