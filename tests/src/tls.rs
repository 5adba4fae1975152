//! Certificates for TLS tests, made fresh per test with `rcgen` (no files
//! checked in, nothing that can expire in the repository), and a rustls
//! client that reports which certificate a server presents.

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType, SerialNumber};
use rustls_pki_types::{CertificateDer, ServerName};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// A test certificate authority.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    /// Its certificate, PEM.
    pub cert_pem: String,
    /// Its certificate, DER.
    pub der: CertificateDer<'static>,
}

/// A certificate issued by a [`Ca`] and its key.
pub struct Leaf {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key, PEM.
    pub key_pem: String,
    /// The certificate, DER (to compare with what a server presents).
    pub der: CertificateDer<'static>,
}

impl Ca {
    /// A new self-signed CA named `name`.
    pub fn new(name: &str) -> Ca {
        let key = KeyPair::generate().expect("CA key");
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let cert = params.self_signed(&key).expect("CA cert");
        Ca { cert_pem: cert.pem(), der: cert.der().clone(), issuer: Issuer::new(params, key) }
    }

    /// A certificate named `cn` with `sans` and `serial`.
    pub fn issue(&self, cn: &str, sans: Vec<SanType>, serial: u64) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.subject_alt_names = sans;
        params.serial_number = Some(SerialNumber::from(serial));
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        Leaf { cert_pem: cert.pem(), key_pem: key.serialize_pem(), der: cert.der().clone() }
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    pub fn server(&self, cn: &str, serial: u64) -> Leaf {
        self.issue(
            cn,
            vec![
                SanType::DnsName("localhost".try_into().expect("dns")),
                SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
            ],
            serial,
        )
    }

    /// A server certificate for `localhost` and 127.0.0.1 that expired
    /// years ago (valid 2020-01-01 to 2021-01-01).
    pub fn expired_server(&self, cn: &str, serial: u64) -> Leaf {
        let key = KeyPair::generate().expect("leaf key");
        let mut params = CertificateParams::default();
        params.distinguished_name.push(DnType::CommonName, cn);
        params.subject_alt_names = vec![
            SanType::DnsName("localhost".try_into().expect("dns")),
            SanType::IpAddress(std::net::Ipv4Addr::LOCALHOST.into()),
        ];
        params.serial_number = Some(SerialNumber::from(serial));
        params.not_before = rcgen::date_time_ymd(2020, 1, 1);
        params.not_after = rcgen::date_time_ymd(2021, 1, 1);
        let cert = params.signed_by(&key, &self.issuer).expect("leaf cert");
        Leaf { cert_pem: cert.pem(), key_pem: key.serialize_pem(), der: cert.der().clone() }
    }

    /// A client certificate, naming `region:<r>` as a SAN URI when given.
    pub fn client(&self, cn: &str, region: Option<&str>) -> Leaf {
        let sans = region
            .map(|r| vec![SanType::URI(format!("region:{r}").try_into().expect("uri"))])
            .unwrap_or_default();
        self.issue(cn, sans, 7)
    }
}

/// Writes `contents` to `dir/name` atomically (a temporary file renamed
/// over the target), as deployment tools do, and returns the path.
pub fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, contents).expect("write temp");
    std::fs::rename(&tmp, &path).expect("rename");
    path
}

/// A rustls client trusting `roots` only.
pub fn client_config(roots: &[CertificateDer<'static>]) -> rustls::ClientConfig {
    let mut store = rustls::RootCertStore::empty();
    for r in roots {
        store.add(r.clone()).expect("root");
    }
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(store)
        .with_no_client_auth()
}

/// A rustls client trusting the CA `ca_pem` only and presenting
/// `cert_pem`/`key_pem` as its client certificate.
pub fn client_config_with_identity(ca_pem: &str, cert_pem: &str, key_pem: &str) -> rustls::ClientConfig {
    use rustls_pki_types::pem::PemObject;
    let mut store = rustls::RootCertStore::empty();
    store.add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA")).expect("root");
    let chain = vec![CertificateDer::from_pem_slice(cert_pem.as_bytes()).expect("cert")];
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("key");
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(store)
        .with_client_auth_cert(chain, key)
        .expect("identity")
}

/// Connects to `addr` (TCP and TLS handshake as `localhost`, 5 s
/// deadline) and returns the certificate the server presented.
pub async fn served_cert(
    addr: &str,
    config: Arc<rustls::ClientConfig>,
) -> Result<CertificateDer<'static>, String> {
    let connect = async {
        let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from("localhost").expect("name");
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        tls.get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.clone().into_owned())
            .ok_or_else(|| "no server certificate".to_string())
    };
    tokio::time::timeout(Duration::from_secs(5), connect).await.map_err(|_| "timed out".to_string())?
}

/// The files a TLS-serving Redis (or Sentinel) is started with: its
/// certificate and key, and the CA it trusts for client certificates (and,
/// between servers, for each other's).
#[derive(Debug, Clone)]
pub struct ServerFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
}

impl ServerFiles {
    /// Writes `leaf` and `ca`'s certificate into `dir`, named after `name`.
    pub fn write(dir: &Path, name: &str, leaf: &Leaf, ca: &Ca) -> ServerFiles {
        ServerFiles {
            cert: write(dir, &format!("{name}.pem"), &leaf.cert_pem),
            key: write(dir, &format!("{name}.key"), &leaf.key_pem),
            ca: write(dir, &format!("{name}-ca.pem"), &ca.cert_pem),
        }
    }

    /// `redis-server` arguments serving TLS on `port` with these files;
    /// `auth_clients` requires client certificates (`--tls-auth-clients`).
    pub fn redis_args(&self, port: u16, auth_clients: bool) -> Vec<String> {
        vec![
            "--tls-port".into(),
            port.to_string(),
            "--tls-cert-file".into(),
            self.cert.display().to_string(),
            "--tls-key-file".into(),
            self.key.display().to_string(),
            "--tls-ca-cert-file".into(),
            self.ca.display().to_string(),
            "--tls-auth-clients".into(),
            if auth_clients { "yes" } else { "no" }.into(),
        ]
    }
}
