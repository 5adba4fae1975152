//! TLS of the link to the region's Redis (`rediss://`, DESIGN §5 Security):
//! the files of `--redis-ca-file` and `--redis-client-cert`/`--redis-client-key`
//! read once at start and handed to the `redis` crate as
//! [`redis::TlsCertificates`], for a single server, every Redis Cluster node,
//! and through Sentinel both the Sentinels and the primary.
//!
//! The files are checked here, before any connection, so that a wrong path
//! or a file that is not PEM stops the agent at start with an error naming
//! the setting and the file, never its contents (a key file is secret).
//! A certificate Redis presents that does not verify (unknown CA, expired,
//! wrong name) is not a start error: it is a connection failure, the store
//! counts as unusable, and the reason shows in `/v1/status`
//! (`redis_error`), `/readyz` and the log (see [`crate::store`]).
//!
//! The crypto provider is ring, as on the allocator link: the `redis` crate
//! builds its rustls config with the process default provider, so the agent
//! installs ring as that default before the first TLS connection.

use crate::client::TlsFiles;
use quota_shared::pem;
use rustls_pki_types::PrivateKeyDer;
use std::sync::Arc;

/// Makes ring the process-wide rustls provider (a no-op when one is set
/// already). Without a default, rustls picks one from its enabled crate
/// features, and would refuse if a dependency ever enabled a second one.
pub fn install_ring_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The certificates of the Redis link, read and checked from `files`.
/// Without a CA file the system's trust roots verify Redis.
pub fn certificates(files: &TlsFiles) -> Result<redis::TlsCertificates, String> {
    install_ring_provider();
    let root_cert = match &files.ca_file {
        // Parsed only to fail early with the file's name; the bytes go to
        // the redis crate, which parses them again.
        Some(ca) => {
            let bytes = pem::read("AGENT_REDIS_CA_FILE", ca)?;
            pem::parse_certs("AGENT_REDIS_CA_FILE", ca, &bytes)?;
            Some(bytes)
        }
        None => None,
    };
    let client_tls = match &files.client_cert {
        Some((cert, key)) => {
            let client_cert = pem::read("AGENT_REDIS_CLIENT_CERT", cert)?;
            let chain = pem::parse_certs("AGENT_REDIS_CLIENT_CERT", cert, &client_cert)?;
            let client_key = pem::read("AGENT_REDIS_CLIENT_KEY", key)?;
            let key_der = pem::parse_private_key("AGENT_REDIS_CLIENT_KEY", key, &client_key)?;
            check_identity(chain, key_der).map_err(|e| {
                format!("AGENT_REDIS_CLIENT_CERT/KEY ({}) do not form a usable identity: {e}", cert.display())
            })?;
            Some(redis::ClientTlsConfig { client_cert, client_key })
        }
        None => None,
    };
    Ok(redis::TlsCertificates { client_tls, root_cert })
}

/// Whether rustls accepts the certificate chain and key as a client
/// identity (key type supported, key matching the certificate), so a
/// mismatch is a start error and not a handshake failure per connection.
fn check_identity(
    chain: Vec<rustls_pki_types::CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<(), rustls::Error> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_client_auth_cert(chain, key)
        .map(|_| ())
}

/// Whether a Redis URL asks for TLS.
pub fn is_tls_url(url: &str) -> bool {
    url.trim_start().starts_with("rediss://")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn a_missing_file_is_named_and_a_non_pem_key_is_not_echoed() {
        let dir = std::env::temp_dir().join(format!("redis-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e =
            certificates(&TlsFiles { ca_file: Some(dir.join("none.pem")), client_cert: None }).unwrap_err();
        assert!(e.contains("AGENT_REDIS_CA_FILE") && e.contains("none.pem"), "{e}");

        let secret = "not-a-key-but-secret-material";
        let key: PathBuf = dir.join("key.pem");
        std::fs::write(&key, secret).unwrap();
        let cert = dir.join("cert.pem");
        std::fs::write(&cert, "junk").unwrap();
        let e = certificates(&TlsFiles { ca_file: None, client_cert: Some((cert, key)) }).unwrap_err();
        assert!(e.contains("AGENT_REDIS_CLIENT_CERT"), "{e}");
        assert!(!e.contains(secret), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_rediss_urls_ask_for_tls() {
        assert!(is_tls_url("rediss://h:1"));
        assert!(!is_tls_url("redis://h:1"));
    }
}
