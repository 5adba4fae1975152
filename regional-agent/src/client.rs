//! The allocator client: every call has a timeout, goes through the circuit
//! breaker, and is classified as answered (2xx or a 4xx refusal, the
//! allocator is up) or unreachable (timeout, refused connection, 5xx).

use crate::breaker::Breaker;
use quota_shared::wire::{
    ErrorBody, GrantRequest, GrantResponse, LeaseView, RegisterRequest, RegisterResponse, ReleaseRequest,
    ReportRequest, ReportResponse,
};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;

/// Why a call did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// Timeout, connection failure, 5xx, or the breaker is open.
    #[error("allocator unreachable: {0}")]
    Unreachable(String),
    /// The allocator answered and refused.
    #[error("allocator refused ({status} {code}): {message}")]
    Refused { status: u16, code: String, message: String },
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

/// The allocator's agent API.
pub struct AllocatorClient {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    /// The breaker shared by every call.
    pub breaker: Breaker,
}

impl AllocatorClient {
    /// A client for `base` with `timeout` per call.
    pub fn new(base: &str, token: Option<String>, timeout: Duration) -> Result<Self, String> {
        let http = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_max_idle_per_host(16)
            .build()
            .map_err(|e| format!("http client: {e}"))?;
        Ok(AllocatorClient { http, base: base.to_string(), token, breaker: Breaker::default() })
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
            Err(e) => {
                self.breaker.failure();
                return Err(CallError::Unreachable(e.to_string()));
            }
        };
        let status = resp.status();
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => {
                self.breaker.failure();
                return Err(CallError::Unreachable(e.to_string()));
            }
        };
        if status.is_server_error() || status.as_u16() == 408 {
            self.breaker.failure();
            return Err(CallError::Unreachable(format!("status {status}")));
        }
        self.breaker.success();
        if !status.is_success() {
            let body: Option<ErrorBody> = serde_json::from_slice(&bytes).ok();
            let (code, message) =
                body.map(|b| (b.error, b.message)).unwrap_or_else(|| ("unknown".into(), String::new()));
            return Err(CallError::Refused { status: status.as_u16(), code, message });
        }
        serde_json::from_slice(&bytes).map_err(|e| CallError::Refused {
            status: status.as_u16(),
            code: "bad_answer".into(),
            message: e.to_string(),
        })
    }

    /// `POST /v1/agents/register`.
    pub async fn register(&self, region: &str, agent: &str) -> Result<RegisterResponse, CallError> {
        self.post("/v1/agents/register", &RegisterRequest { region: region.into(), agent: agent.into() })
            .await
    }

    /// `POST /v1/grants`.
    pub async fn grant(&self, req: &GrantRequest) -> Result<GrantResponse, CallError> {
        self.post("/v1/grants", req).await
    }

    /// `POST /v1/leases/{id}/release`.
    pub async fn release(&self, lease_id: &str, req: &ReleaseRequest) -> Result<LeaseView, CallError> {
        self.post(&format!("/v1/leases/{lease_id}/release"), req).await
    }

    /// `POST /v1/reports`.
    pub async fn report(&self, req: &ReportRequest) -> Result<ReportResponse, CallError> {
        self.post("/v1/reports", req).await
    }
}
