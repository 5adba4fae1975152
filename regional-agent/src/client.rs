//! The allocator client: every call has a timeout, goes through the circuit
//! breaker, and is classified as answered (2xx or a 4xx refusal, the
//! allocator is up) or unreachable (timeout, refused connection, 5xx).
//!
//! `https://` allocator URLs go over rustls (ring provider): the system's
//! trust roots plus `--allocator-ca-file`, and a client certificate for mTLS
//! when `--allocator-client-cert`/`--allocator-client-key` are given. A TLS
//! failure (unknown issuer, expired certificate, refused client certificate)
//! is a connection failure, so it counts as unreachable and the quota's fail
//! mode applies; the reason is kept for `/v1/status` (`allocator_error`) and
//! logged once each time it changes, not once per request.

use crate::breaker::Breaker;
use quota_shared::pem;
use quota_shared::wire::{
    AgentStatusReport, ErrorBody, GrantBatchRequest, GrantBatchResponse, GrantRequest, GrantResponse,
    LeaseView, PermitLease, PermitLeaseRequest, RegisterRequest, RegisterResponse, ReleaseBatchRequest,
    ReleaseBatchResponse, ReleaseRequest, ReportRequest, ReportResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Why a call did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// Timeout, connection failure, 5xx, or the breaker is open.
    #[error("allocator unreachable: {0}")]
    Unreachable(String),
    /// The allocator answered and refused.
    #[error("allocator refused ({status} {code}): {message}")]
    Refused {
        status: u16,
        code: String,
        message: String,
        /// The report item the refusal names (`invalid_field` on a report).
        item: Option<usize>,
    },
}

impl CallError {
    /// The refusal's error code, if the allocator answered.
    pub fn code(&self) -> Option<&str> {
        match self {
            CallError::Refused { code, .. } => Some(code),
            CallError::Unreachable(_) => None,
        }
    }
}

/// TLS settings of the link to the allocator (PEM files).
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// Extra trust roots (`--allocator-ca-file`), added to the system's.
    pub ca_file: Option<PathBuf>,
    /// Client certificate chain and its key (`--allocator-client-cert`,
    /// `--allocator-client-key`), for mTLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

/// The rustls configuration of the allocator link: system roots plus the CA
/// file, and the client certificate when given. Built with the ring provider
/// explicitly, so no process-wide default provider is needed. Errors name
/// the file, never its contents (a key file's bytes are secret).
pub fn tls_config(files: &TlsFiles) -> Result<rustls::ClientConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    let (added, _ignored) = roots.add_parsable_certificates(native.certs);
    if added == 0 && files.ca_file.is_none() {
        tracing::debug!("no system trust roots found; https allocator URLs need --allocator-ca-file");
    }
    if let Some(ca) = &files.ca_file {
        for cert in pem::certs("AGENT_ALLOCATOR_CA_FILE", ca)? {
            roots.add(cert).map_err(|e| {
                format!("AGENT_ALLOCATOR_CA_FILE {}: unusable CA certificate: {e}", ca.display())
            })?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS set-up: {e}"))?
        .with_root_certificates(roots);
    match &files.client_cert {
        None => Ok(builder.with_no_client_auth()),
        Some((cert, key)) => {
            let chain = pem::certs("AGENT_ALLOCATOR_CLIENT_CERT", cert)?;
            let key_der = pem::private_key("AGENT_ALLOCATOR_CLIENT_KEY", key)?;
            builder.with_client_auth_cert(chain, key_der).map_err(|e| {
                format!(
                    "AGENT_ALLOCATOR_CLIENT_CERT/KEY ({}) do not form a usable identity: {e}",
                    cert.display()
                )
            })
        }
    }
}

/// The reason of the latest failed call, rendered with its cause chain
/// (where the TLS reason lives) and without the URL.
fn describe(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut out = e.to_string();
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        src = s.source();
    }
    out
}

/// The allocator's agent API.
pub struct AllocatorClient {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    /// The breaker shared by every call.
    pub breaker: Breaker,
    /// Why the latest call found the allocator unreachable; cleared by an
    /// answer. A std `Mutex`: set and read without an await in between.
    last_error: Mutex<Option<String>>,
}

impl AllocatorClient {
    /// A client for `base` with `timeout` per call (connect, TLS handshake
    /// and answer together) and the given TLS settings.
    pub fn new(base: &str, token: Option<String>, timeout: Duration, tls: &TlsFiles) -> Result<Self, String> {
        // Always hand reqwest our own rustls config: with the ring provider
        // and no process default, reqwest could not build one itself.
        let http = reqwest::Client::builder()
            .tls_backend_preconfigured(tls_config(tls)?)
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_max_idle_per_host(16)
            .build()
            .map_err(|e| format!("http client: {e}"))?;
        Ok(AllocatorClient {
            http,
            base: base.to_string(),
            token,
            breaker: Breaker::default(),
            last_error: Mutex::new(None),
        })
    }

    /// Why the allocator counts as unreachable, while it does.
    pub fn last_error(&self) -> Option<String> {
        self.last_error.lock().unwrap().clone()
    }

    /// Records an unreachable call; logs only when the reason changes, so
    /// a partition or a bad certificate is one warning, not one per request.
    pub(crate) fn unreachable(&self, why: String) -> CallError {
        self.breaker.failure();
        let mut last = self.last_error.lock().unwrap();
        if last.as_deref() != Some(why.as_str()) {
            tracing::warn!(reason = %why, "allocator unreachable");
            *last = Some(why.clone());
        }
        CallError::Unreachable(why)
    }

    /// Records an answer: the allocator is reachable again.
    fn answered(&self) {
        self.breaker.success();
        if self.last_error.lock().unwrap().take().is_some() {
            tracing::info!("allocator reachable again");
        }
    }

    async fn post<B: Serialize, R: DeserializeOwned>(&self, path: &str, body: &B) -> Result<R, CallError> {
        if !self.breaker.allow() {
            return Err(CallError::Unreachable("circuit breaker open".into()));
        }
        let mut rb = self.http.post(format!("{}{path}", self.base)).json(body);
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        let resp = match rb.send().await {
            Ok(r) => r,
            Err(e) => return Err(self.unreachable(describe(e))),
        };
        let status = resp.status();
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => return Err(self.unreachable(describe(e))),
        };
        if status.is_server_error() || status.as_u16() == 408 {
            return Err(self.unreachable(format!("status {status}")));
        }
        self.answered();
        if !status.is_success() {
            let body: Option<ErrorBody> = serde_json::from_slice(&bytes).ok();
            // A body that is not the allocator's error JSON (a proxy's page)
            // is code "unknown": the outbox retries those.
            let (code, message, item) = body
                .map(|b| (b.error, b.message, b.item))
                .unwrap_or_else(|| ("unknown".into(), String::new(), None));
            return Err(CallError::Refused { status: status.as_u16(), code, message, item });
        }
        serde_json::from_slice(&bytes).map_err(|e| CallError::Refused {
            status: status.as_u16(),
            code: "bad_answer".into(),
            message: e.to_string(),
            item: None,
        })
    }

    /// The error of a batch item answered `status` (not 200) with `error`,
    /// as the single form's call would have returned it: a 5xx or 408 is
    /// the allocator failing (counted by the breaker), anything else a
    /// refusal.
    pub(crate) fn item_error(&self, status: u16, error: Option<ErrorBody>) -> CallError {
        if status >= 500 || status == 408 {
            let why = error.map(|e| e.error).unwrap_or_default();
            return self.unreachable(format!("status {status} {why}"));
        }
        let (code, message) =
            error.map(|e| (e.error, e.message)).unwrap_or_else(|| ("unknown".into(), String::new()));
        CallError::Refused { status, code, message, item: None }
    }

    /// `POST /v1/agents/register`.
    pub async fn register(&self, region: &str, agent: &str) -> Result<RegisterResponse, CallError> {
        self.post("/v1/agents/register", &RegisterRequest { region: region.into(), agent: agent.into() })
            .await
    }

    /// `POST /v1/grants`, one grant in the single form. Renewers call
    /// [`AllocatorClient::grant`], which batches.
    pub(crate) async fn grant_single(&self, req: &GrantRequest) -> Result<GrantResponse, CallError> {
        self.post("/v1/grants", req).await
    }

    /// `POST /v1/grants` with `items`.
    pub(crate) async fn post_grants(&self, req: &GrantBatchRequest) -> Result<GrantBatchResponse, CallError> {
        self.post("/v1/grants", req).await
    }

    /// `POST /v1/leases/{id}/release`.
    pub async fn release(&self, lease_id: &str, req: &ReleaseRequest) -> Result<LeaseView, CallError> {
        self.post(&format!("/v1/leases/{lease_id}/release"), req).await
    }

    /// `POST /v1/leases/release` with `items` (see [`crate::release_batch`]).
    pub(crate) async fn post_releases(
        &self,
        req: &ReleaseBatchRequest,
    ) -> Result<ReleaseBatchResponse, CallError> {
        self.post("/v1/leases/release", req).await
    }

    /// `POST /v1/permits/lease` (see [`crate::permits`]).
    pub async fn permit_lease(&self, req: &PermitLeaseRequest) -> Result<PermitLease, CallError> {
        self.post("/v1/permits/lease", req).await
    }

    /// `POST /v1/reports`.
    pub async fn report(&self, req: &ReportRequest) -> Result<ReportResponse, CallError> {
        self.post("/v1/reports", req).await
    }

    /// `PUT /v1/agents/{region}/{agent}/status`, outside the breaker: the
    /// status is for operators, so neither its failure nor its success may
    /// change whether spending counts the allocator as reachable.
    pub async fn put_status(
        &self,
        region: &str,
        agent: &str,
        body: &AgentStatusReport,
    ) -> Result<(), CallError> {
        let mut rb = self.http.put(format!("{}/v1/agents/{region}/{agent}/status", self.base)).json(body);
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(t);
        }
        let resp = rb.send().await.map_err(|e| CallError::Unreachable(describe(e)))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(());
        }
        if status.is_server_error() || status.as_u16() == 408 {
            return Err(CallError::Unreachable(format!("status {status}")));
        }
        let body: Option<ErrorBody> = resp.json().await.ok();
        let (code, message) =
            body.map(|b| (b.error, b.message)).unwrap_or_else(|| ("unknown".into(), String::new()));
        Err(CallError::Refused { status: status.as_u16(), code, message, item: None })
    }
}
