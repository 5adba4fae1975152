//! A JSON client for tests: every call returns status, headers and body, so
//! a test can assert on each.

use reqwest::header::HeaderMap;
use serde::Serialize;
use serde_json::Value;
use std::time::Duration;

/// An answer.
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Value,
}

impl Resp {
    /// The JSON `error` code, if any.
    pub fn error(&self) -> &str {
        self.body["error"].as_str().unwrap_or("")
    }

    /// A header as a string.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// Asserts the status, showing the body when it differs.
    #[track_caller]
    pub fn expect(self, status: u16) -> Resp {
        assert_eq!(self.status, status, "unexpected status; body {}", self.body);
        self
    }
}

/// The value of the sample `name` (with its labels, as written) in a
/// Prometheus text exposition.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
}

/// A `reqwest` client builder with the process's rustls provider in place.
///
/// reqwest is built with rustls and the ring provider chosen by the
/// services (no cmake-built aws-lc); a client reqwest configures itself
/// asks for the process default provider, so it is installed here first.
pub fn client_builder() -> reqwest::ClientBuilder {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
}

/// A client bound to one base URL and optional bearer token.
#[derive(Clone)]
pub struct Http {
    pub base: String,
    client: reqwest::Client,
    token: Option<String>,
}

impl Http {
    /// A client for `base`.
    pub fn new(base: &str) -> Http {
        Http::over(base, client_builder().pool_max_idle_per_host(128))
    }

    /// A client for an `https://` `base` that trusts the CA `ca_pem` (and
    /// the usual roots).
    pub fn with_ca(base: &str, ca_pem: &str) -> Http {
        let ca = reqwest::Certificate::from_pem(ca_pem.as_bytes()).expect("CA PEM");
        Http::over(base, client_builder().add_root_certificate(ca))
    }

    /// A client for an `https://` `base` trusting `ca_pem` only and
    /// presenting the client certificate `cert_pem` with `key_pem` (mTLS).
    pub fn with_identity(base: &str, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Http {
        let config = crate::tls::client_config_with_identity(ca_pem, cert_pem, key_pem);
        Http::over(base, client_builder().tls_backend_preconfigured(config))
    }

    /// A client for `base` built from `builder` with the tests' 30 s timeout.
    fn over(base: &str, builder: reqwest::ClientBuilder) -> Http {
        let client = builder.timeout(Duration::from_secs(30)).build().expect("client");
        Http { base: base.to_string(), client, token: None }
    }

    /// The same client with a bearer token.
    pub fn with_token(&self, token: Option<&str>) -> Http {
        Http { token: token.map(str::to_string), ..self.clone() }
    }

    async fn send(&self, rb: reqwest::RequestBuilder) -> Resp {
        let rb = match &self.token {
            Some(t) => rb.bearer_auth(t),
            None => rb,
        };
        let resp = rb.send().await.expect("request");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.bytes().await.expect("body");
        let body = serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
        Resp { status, headers, body }
    }

    /// GET, returning only the status, `None` when nothing answered (for
    /// readiness polls against a server that is still starting).
    pub async fn get_status(&self, path: &str) -> Option<u16> {
        self.client.get(format!("{}{path}", self.base)).send().await.ok().map(|r| r.status().as_u16())
    }

    /// GET.
    pub async fn get(&self, path: &str) -> Resp {
        self.send(self.client.get(format!("{}{path}", self.base))).await
    }

    /// POST a JSON body.
    pub async fn post<T: Serialize + ?Sized>(&self, path: &str, body: &T) -> Resp {
        self.send(self.client.post(format!("{}{path}", self.base)).json(body)).await
    }

    /// PUT a JSON body.
    pub async fn put<T: Serialize + ?Sized>(&self, path: &str, body: &T) -> Resp {
        self.send(self.client.put(format!("{}{path}", self.base)).json(body)).await
    }

    /// PUT a JSON body with extra headers.
    pub async fn put_with<T: Serialize + ?Sized>(
        &self,
        path: &str,
        body: &T,
        headers: &[(&str, &str)],
    ) -> Resp {
        let mut rb = self.client.put(format!("{}{path}", self.base)).json(body);
        for (k, v) in headers {
            rb = rb.header(*k, *v);
        }
        self.send(rb).await
    }

    /// Sends raw bytes with a content type.
    pub async fn raw(&self, method: &str, path: &str, content_type: Option<&str>, body: Vec<u8>) -> Resp {
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
        let mut rb = self.client.request(method, format!("{}{path}", self.base)).body(body);
        if let Some(ct) = content_type {
            rb = rb.header("content-type", ct);
        }
        self.send(rb).await
    }
}
