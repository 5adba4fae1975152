//! TLS served by the allocator itself (DESIGN §5 Security): rustls with the
//! ring provider, the certificate and key from PEM files (`--tls-cert`,
//! `--tls-key`), client certificates required and checked against
//! `--tls-client-ca` when it is given.
//!
//! The files are reloaded without a restart when they change (polled every
//! [`crate::reload::POLL_EVERY`]) or on SIGHUP. A reload builds a whole new
//! `ServerConfig` and swaps the `Arc` the acceptor reads per connection, so
//! each handshake sees either the old certificate, key and client CA or the
//! new ones, never a mix, and open connections keep theirs. (A
//! `ResolvesServerCert` alone would swap the certificate but not the client
//! CA, which lives in the config's verifier.)
//!
//! A verified client certificate whose subject alternative names include a
//! URI or DNS name `region:<region>` limits what the connection may do to
//! those regions ([`ClientCert`], enforced in `http::auth`).

use crate::http::auth::ClientCert;
use crate::reload::Watched;
use axum::Router;
use quota_shared::listen::http::TimedBody;
use quota_shared::listen::{Limits, ListenerMetrics};
use quota_shared::pem;
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use rustls_pki_types::CertificateDer;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

/// Longest a client may take to complete the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The PEM files the server's TLS is built from.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Certificate chain, leaf first (`ALLOCATOR_TLS_CERT`).
    pub cert: PathBuf,
    /// Its private key (`ALLOCATOR_TLS_KEY`).
    pub key: PathBuf,
    /// CA certificates client certificates must chain to; `None` asks for
    /// no client certificate (`ALLOCATOR_TLS_CLIENT_CA`).
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    fn paths(&self) -> Vec<PathBuf> {
        let mut v = vec![self.cert.clone(), self.key.clone()];
        v.extend(self.client_ca.clone());
        v
    }
}

/// Builds the server config from the files. Errors name the setting and
/// the file, never the file's contents (a key is secret).
pub fn build(files: &TlsFiles) -> Result<ServerConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = pem::certs("ALLOCATOR_TLS_CERT", &files.cert)?;
    let key = pem::private_key("ALLOCATOR_TLS_KEY", &files.key)?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?;
    let builder = match &files.client_ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in pem::certs("ALLOCATOR_TLS_CLIENT_CA", ca)? {
                roots.add(c).map_err(|e| {
                    format!("ALLOCATOR_TLS_CLIENT_CA {}: unusable CA certificate: {e}", ca.display())
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("ALLOCATOR_TLS_CLIENT_CA {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        format!(
            "ALLOCATOR_TLS_CERT {} and ALLOCATOR_TLS_KEY {} do not form a usable identity: {e}",
            files.cert.display(),
            files.key.display()
        )
    })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// The server's TLS configuration in force, swapped as a whole on reload.
#[derive(Debug)]
pub struct ServerTls {
    files: TlsFiles,
    /// A std `RwLock`: read once per handshake, written once per reload,
    /// never held across an await.
    current: RwLock<Arc<ServerConfig>>,
    watched: Mutex<Watched>,
}

impl ServerTls {
    /// Loads the files; a failure is a start error.
    pub fn load(files: TlsFiles) -> Result<Arc<ServerTls>, String> {
        let mut watched = Watched::new("tls", files.paths());
        let seen = watched.pending(true).expect("forced");
        let config = build(&files)?;
        watched.applied(seen);
        Ok(Arc::new(ServerTls {
            files,
            current: RwLock::new(Arc::new(config)),
            watched: Mutex::new(watched),
        }))
    }

    /// The configuration new handshakes use.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.current.read().unwrap().clone()
    }

    /// Reloads when a file changed (or always when `force`); on failure the
    /// configuration in force stays.
    pub fn reload_if_changed(&self, force: bool) {
        let mut watched = self.watched.lock().unwrap();
        let Some(seen) = watched.pending(force) else { return };
        match build(&self.files) {
            Ok(config) => {
                *self.current.write().unwrap() = Arc::new(config);
                watched.applied(seen);
                tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
            }
            Err(e) => watched.failed(e),
        }
    }
}

/// The regions a client certificate names: subject alternative names (URI
/// or DNS) of the form `region:<region>`. The certificate has been verified
/// by the handshake; an unparsable one names no region.
pub fn regions_of(cert: &CertificateDer<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok((_, x509)) = x509_parser::parse_x509_certificate(cert.as_ref()) else { return Vec::new() };
    let Ok(Some(san)) = x509.subject_alternative_name() else { return Vec::new() };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            GeneralName::URI(s) | GeneralName::DNSName(s) => s.strip_prefix("region:"),
            _ => None,
        })
        .filter(|r| quota_shared::ids::validate_id(r).is_ok())
        .map(str::to_string)
        .collect()
}

/// Serves `router` over TLS on `listener` until `shutdown` resolves, with
/// the shared accept loop (`quota_shared::listen::http`): the same
/// connection bound, header read and idle timeouts and graceful shutdown
/// as plain HTTP. Each connection's handshake has [`HANDSHAKE_TIMEOUT`]
/// (and counts within the header read timeout, whichever is shorter).
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Arc<ServerTls>,
    limits: Limits,
    metrics: ListenerMetrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let handshake = move |tcp: TcpStream, peer: SocketAddr| {
        let acceptor = TlsAcceptor::from(tls.config());
        let router = router.clone();
        async move {
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return None;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return None;
                }
            };
            let client = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| ClientCert { regions: regions_of(c) });
            let svc = router.map_request(move |mut req: axum::http::Request<TimedBody>| {
                if let Some(c) = &client {
                    req.extensions_mut().insert(c.clone());
                }
                req
            });
            Some((stream, svc))
        }
    };
    quota_shared::listen::http::serve(listener, limits, metrics, handshake, shutdown).await
}
