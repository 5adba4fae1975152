//! Types and arithmetic that the allocator and the regional agent must agree on.
//!
//! # Layout
//!
//! * [`ids`]: identifier validation (`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`).
//! * [`window`]: UTC window math (I8): `[k·W, (k+1)·W)` in Unix seconds.
//! * [`wire`]: JSON bodies of the allocator's HTTP API, used by both sides.
//! * [`bound`]: the overshoot bound of invariant I6.
//! * [`clock`]: the one clock trait the services ask for "now".
//! * [`prom`]: the services' Prometheus registry, a facade over the
//!   `metrics` crate's Prometheus exporter.
//! * `openapi` (feature `service`): what both OpenAPI documents share.
//! * `pem` (feature `tls`): certificates and keys read from PEM files, with
//!   errors that name the setting and the file, never the file's contents.
//! * `listen` (feature `listen`): the listeners' limits (header and idle
//!   timeouts, connection bound with probes kept answerable, open-file
//!   limit) and the HTTP/1 accept loop both services serve with.
//! * `telemetry` (feature `service`): logging set-up and the shutdown signal.
//!
//! Nothing here depends on axum, sqlx or redis (`listen` speaks hyper), so the agent and
//! the allocator
//! can share it without sharing a runtime.

pub mod bound;
pub mod clock;
pub mod ids;
#[cfg(feature = "listen")]
pub mod listen;
#[cfg(feature = "service")]
pub mod openapi;
#[cfg(feature = "tls")]
pub mod pem;
pub mod prom;
#[cfg(feature = "service")]
pub mod telemetry;
pub mod window;
pub mod wire;
