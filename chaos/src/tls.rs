//! A throwaway PKI for `cargo lab demo --tls` and the TLS rows of the
//! bench: one CA made with rcgen for this run only, a server certificate
//! for `localhost`/127.0.0.1 used by the allocator and every Redis, a
//! client certificate per region (SAN `region:<r>`, so the allocator lets
//! it act for that region only) that the region's agents present to the
//! allocator and to Redis, and an operator certificate for the lab's own
//! calls. Files live in a temp dir removed with the [`LabTls`]; nothing is
//! written into the repository and nothing outlives the run.

use quota_tests::http::Http;
use quota_tests::tls::{write, Ca, Leaf, ServerFiles};
use std::path::{Path, PathBuf};

/// The run's CA and certificate files.
pub struct LabTls {
    ca: Ca,
    /// The CA certificate, PEM file (trusted by every side).
    pub ca_file: PathBuf,
    /// The certificate allocators and Redis servers present.
    pub server: ServerFiles,
    operator: Leaf,
    dir: tempfile::TempDir,
}

impl LabTls {
    /// Makes the CA and the server and operator certificates.
    pub fn generate() -> Result<LabTls, String> {
        let dir = tempfile::Builder::new().prefix("quota-lab-tls-").tempdir().map_err(|e| e.to_string())?;
        let ca = Ca::new("quota-lab throwaway CA");
        let server = ServerFiles::write(dir.path(), "server", &ca.server("quota-lab server", 1), &ca);
        let ca_file = server.ca.clone();
        let operator = ca.client("quota-lab operator", None);
        Ok(LabTls { ca, ca_file, server, operator, dir })
    }

    /// Where the files are.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Environment of an allocator serving HTTPS and requiring client
    /// certificates of this CA (mTLS).
    pub fn allocator_env(&self) -> Vec<(String, String)> {
        vec![
            ("ALLOCATOR_TLS_CERT".into(), self.server.cert.display().to_string()),
            ("ALLOCATOR_TLS_KEY".into(), self.server.key.display().to_string()),
            ("ALLOCATOR_TLS_CLIENT_CA".into(), self.ca_file.display().to_string()),
        ]
    }

    /// Environment of an agent of `region`: its client certificate (written
    /// on first use) for the allocator and for Redis, and the CA for both.
    pub fn agent_env(&self, region: &str) -> Vec<(String, String)> {
        let cert = self.dir.path().join(format!("agent-{region}.pem"));
        let key = self.dir.path().join(format!("agent-{region}.key"));
        if !cert.exists() {
            let leaf = self.ca.client(&format!("agents of {region}"), Some(region));
            write(self.dir.path(), &format!("agent-{region}.pem"), &leaf.cert_pem);
            write(self.dir.path(), &format!("agent-{region}.key"), &leaf.key_pem);
        }
        let (ca, cert, key) =
            (self.ca_file.display().to_string(), cert.display().to_string(), key.display().to_string());
        vec![
            ("AGENT_ALLOCATOR_CA_FILE".into(), ca.clone()),
            ("AGENT_ALLOCATOR_CLIENT_CERT".into(), cert.clone()),
            ("AGENT_ALLOCATOR_CLIENT_KEY".into(), key.clone()),
            ("AGENT_REDIS_CA_FILE".into(), ca),
            ("AGENT_REDIS_CLIENT_CERT".into(), cert),
            ("AGENT_REDIS_CLIENT_KEY".into(), key),
        ]
    }

    /// An HTTPS client for `base` presenting the operator certificate.
    pub fn operator(&self, base: &str) -> Http {
        Http::with_identity(base, &self.ca.cert_pem, &self.operator.cert_pem, &self.operator.key_pem)
    }
}
