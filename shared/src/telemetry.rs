//! Logging set-up and the shutdown signal, the same for both binaries
//! (feature `service`).

use tracing_subscriber::EnvFilter;

/// Log output format (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per event.
    Json,
}

/// Installs the global `tracing` subscriber once (`RUST_LOG` filters, `info`
/// by default). Later calls are no-ops so tests may call it freely.
///
/// A JSON line carries the event's fields at the top level, the innermost
/// span's name and fields under `span` and every enclosing span, outermost
/// first, under `spans` (the request's route and status, the grant's
/// tenant, resource, region and lease id); text lines show the same spans
/// as their prefix.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => {
            builder.json().flatten_event(true).with_current_span(true).with_span_list(true).try_init()
        }
        LogFormat::Text => builder.try_init(),
    };
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term => {},
    }
    tracing::info!("shutdown signal received: finishing in-flight requests");
}
