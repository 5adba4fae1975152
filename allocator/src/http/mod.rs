//! HTTP plumbing shared by every handler, and nothing that knows a handler
//! or the allocator's state: extractors whose rejections are the
//! allocator's errors ([`extract`]), bearer-token and region checks
//! ([`auth`], [`agent_tokens`], [`secret`]), the request metrics middleware
//! ([`metrics`]) and the request span ([`trace`]). Which route takes which
//! check is the route table's business (`crate::routes`).

pub mod agent_tokens;
pub mod auth;
pub mod extract;
pub mod metrics;
pub mod secret;
pub mod trace;
