//! Bearer-token auth (DESIGN §5 Security). Agent routes take the agent token,
//! policy writes and operator reads the admin token. Comparison is constant
//! time so response timing does not reveal a token's prefix.
//!
//! Agent credentials come in two kinds. The shared `QUOTA_AGENT_TOKEN` acts
//! for every region (the simple mode). A token from `--agent-tokens-file`
//! acts only for its region, and so does a connection whose verified client
//! certificate names `region:<r>` (the certificate narrows whatever token
//! comes with it; it does not replace the token). The middleware records
//! the result as an [`AgentScope`]; each agent handler checks the region it
//! is about to act for against it, and another region is `403 wrong_region`.

use super::agent_tokens::AgentTokens;
use super::secret::constant_time_eq;
use crate::error::Error;
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

/// Configured tokens; a class without a token is open (loopback only, see
/// `serve`).
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// `QUOTA_AGENT_TOKEN`: acts for every region.
    pub agent: Option<String>,
    /// `QUOTA_ADMIN_TOKEN`.
    pub admin: Option<String>,
    /// `--agent-tokens-file`: tokens that act for one region each.
    pub regions: Option<Arc<AgentTokens>>,
}

impl Tokens {
    /// Whether any agent credential is configured (otherwise agent routes
    /// are open, loopback only).
    pub fn agent_configured(&self) -> bool {
        self.agent.is_some() || self.regions.is_some()
    }
}

/// The verified client certificate of a TLS connection, put on each of its
/// requests by the TLS server.
#[derive(Debug, Clone)]
pub struct ClientCert {
    /// Regions named by `region:<r>` subject alternative names; empty when
    /// it names none (then it limits nothing).
    pub regions: Vec<String>,
}

/// The regions an agent request may act for.
#[derive(Debug, Clone, Default)]
pub struct AgentScope {
    /// The region of a token from the tokens file.
    token: Option<String>,
    /// The regions of the connection's client certificate.
    cert: Option<Vec<String>>,
}

impl AgentScope {
    /// `Ok` when the credentials may act for `region`, else
    /// [`Error::WrongRegion`].
    pub fn check(&self, region: &str) -> Result<(), Error> {
        let token_ok = self.token.as_deref().is_none_or(|r| r == region);
        let cert_ok = self.cert.as_ref().is_none_or(|rs| rs.iter().any(|r| r == region));
        if token_ok && cert_ok {
            return Ok(());
        }
        let allowed = match (&self.token, &self.cert) {
            (Some(t), _) if !token_ok => t.clone(),
            (_, Some(c)) => c.join(", "),
            _ => String::new(),
        };
        Err(Error::WrongRegion { allowed, requested: region.to_string() })
    }
}

/// Agent handlers take their scope as an argument; a request that did not
/// pass [`require_agent`] has none and is refused (fail closed).
impl<S: Send + Sync> FromRequestParts<S> for AgentScope {
    type Rejection = Error;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Error> {
        parts.extensions.get::<AgentScope>().cloned().ok_or(Error::Unauthorized)
    }
}

/// The principal of a request to a route class without a configured token
/// (only possible on a loopback address, see `serve`).
pub const ANONYMOUS: &str = "anonymous/loopback";

/// Who made a request (the token's name: `agent`, `admin`, or
/// [`ANONYMOUS`]), recorded as `updated_by` and in ledger events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Principal(pub &'static str);

fn bearer(req: &Request) -> Option<&str> {
    req.headers().get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")
}

fn matches(presented: Option<&str>, token: &Option<String>) -> bool {
    match (presented, token) {
        (Some(p), Some(t)) => constant_time_eq(p.as_bytes(), t.as_bytes()),
        _ => false,
    }
}

/// Agent routes: the shared agent token, a region's token from the tokens
/// file, or the admin token (for operators' tools); records who and for
/// which regions.
pub async fn require_agent(
    State(tokens): State<Tokens>,
    mut req: Request,
    next: Next,
) -> Result<Response, Error> {
    let presented = bearer(&req);
    let mut scope = AgentScope {
        token: None,
        cert: req
            .extensions()
            .get::<ClientCert>()
            .filter(|c| !c.regions.is_empty())
            .map(|c| c.regions.clone()),
    };
    let principal = if !tokens.agent_configured() {
        Principal(ANONYMOUS)
    } else if matches(presented, &tokens.agent) {
        Principal("agent")
    } else if let Some(region) = presented.and_then(|p| tokens.regions.as_ref()?.region_of(p)) {
        scope.token = Some(region);
        Principal("agent")
    } else if matches(presented, &tokens.admin) {
        Principal("admin")
    } else {
        return Err(Error::Unauthorized);
    };
    req.extensions_mut().insert(principal);
    req.extensions_mut().insert(scope);
    Ok(next.run(req).await)
}

/// Admin routes: only the admin token. An agent token is a wrong token here
/// and gets the same bare 401 as any other (DESIGN §5), so agents can neither
/// read nor change policies.
pub async fn require_admin(
    State(tokens): State<Tokens>,
    mut req: Request,
    next: Next,
) -> Result<Response, Error> {
    let presented = bearer(&req);
    let principal = if tokens.admin.is_none() {
        Principal(ANONYMOUS)
    } else if matches(presented, &tokens.admin) {
        Principal("admin")
    } else {
        return Err(Error::Unauthorized);
    };
    req.extensions_mut().insert(principal);
    Ok(next.run(req).await)
}

#[cfg(test)]
mod tests {
    use super::AgentScope;

    #[test]
    fn a_scope_admits_only_its_regions() {
        assert!(AgentScope::default().check("us").is_ok(), "shared token: every region");
        let token = AgentScope { token: Some("eu".into()), cert: None };
        assert!(token.check("eu").is_ok());
        assert_eq!(token.check("us").unwrap_err().code(), "wrong_region");
        let cert = AgentScope { token: None, cert: Some(vec!["eu".into(), "eu2".into()]) };
        assert!(cert.check("eu2").is_ok() && cert.check("us").is_err());
        let both = AgentScope { token: Some("eu".into()), cert: Some(vec!["us".into()]) };
        assert!(both.check("eu").is_err() && both.check("us").is_err(), "both must allow it");
    }
}
