//! Bearer-token auth (DESIGN §5 Security). Agent routes take the agent token,
//! policy writes and operator reads the admin token. Comparison is constant
//! time so response timing does not reveal a token's prefix.

use crate::{AppState, Error};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

/// Configured tokens; a class without a token is open (loopback only, see
/// `serve`).
#[derive(Debug, Clone, Default)]
pub struct Tokens {
    /// `QUOTA_AGENT_TOKEN`.
    pub agent: Option<String>,
    /// `QUOTA_ADMIN_TOKEN`.
    pub admin: Option<String>,
}

/// The principal of a request to a route class without a configured token
/// (only possible on a loopback address, see `serve`).
pub const ANONYMOUS: &str = "anonymous/loopback";

/// Who made a request (the token's name: `agent`, `admin`, or
/// [`ANONYMOUS`]), recorded as `updated_by` and in ledger events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Principal(pub &'static str);

/// Byte-wise comparison whose time depends only on the lengths: every byte
/// is visited and folded into one accumulator, with no early exit, and
/// `black_box` keeps the optimiser from turning the fold back into a
/// short-circuiting compare.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= std::hint::black_box(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0));
    }
    std::hint::black_box(diff) == 0
}

fn bearer(req: &Request) -> Option<&str> {
    req.headers().get("authorization")?.to_str().ok()?.strip_prefix("Bearer ")
}

fn matches(presented: Option<&str>, token: &Option<String>) -> bool {
    match (presented, token) {
        (Some(p), Some(t)) => constant_time_eq(p.as_bytes(), t.as_bytes()),
        _ => false,
    }
}

/// Agent routes: the agent token (or the admin token, for operators' tools).
pub async fn require_agent(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, Error> {
    let tokens = &state.auth;
    let presented = bearer(&req);
    let principal = if tokens.agent.is_none() {
        Principal(ANONYMOUS)
    } else if matches(presented, &tokens.agent) {
        Principal("agent")
    } else if matches(presented, &tokens.admin) {
        Principal("admin")
    } else {
        return Err(Error::Unauthorized);
    };
    req.extensions_mut().insert(principal);
    Ok(next.run(req).await)
}

/// Admin routes: only the admin token. An agent token is a wrong token here
/// and gets the same bare 401 as any other (DESIGN §5), so agents can neither
/// read nor change policies.
pub async fn require_admin(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, Error> {
    let tokens = &state.auth;
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
    use super::constant_time_eq;

    #[test]
    fn constant_time_eq_compares_whole_strings() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}
