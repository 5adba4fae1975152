//! Logging set-up and the shutdown signal, shared with the agent.

pub use quota_shared::telemetry::{init, shutdown_signal};
