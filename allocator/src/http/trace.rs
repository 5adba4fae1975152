//! The request span: every request runs in an `http` span named by its
//! route template (axum's [`MatchedPath`], `unmatched` for the fallback, as
//! in the request metrics) and, once answered, its status. Spans opened
//! below it (the grant transaction, a report's apply, database round trips)
//! nest in it, so a log line of a request carries both.

use axum::extract::{MatchedPath, Request};
use axum::response::Response;
use std::time::Duration;
use tower_http::classify::{ServerErrorsAsFailures, SharedClassifier};
use tower_http::trace::TraceLayer;
use tracing::Span;

/// The layer's type: the span and response hooks below, no other events.
pub type Layer = TraceLayer<
    SharedClassifier<ServerErrorsAsFailures>,
    fn(&Request) -> Span,
    (),
    fn(&Response, Duration, &Span),
    (),
    (),
    (),
>;

/// The layer: a span per request (`http`: method, route, status), the
/// status recorded when the answer leaves.
/// No events of its own beyond a debug line per answer: errors are logged
/// where they are mapped to HTTP (`crate::error`), once.
pub fn layer() -> Layer {
    TraceLayer::new_for_http()
        .make_span_with(request_span as fn(&Request) -> Span)
        .on_request(())
        .on_response(on_response as fn(&Response, Duration, &Span))
        .on_body_chunk(())
        .on_eos(())
        .on_failure(())
}

/// The span of one request; `status` is recorded by `on_response`.
fn request_span(req: &Request) -> Span {
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", MatchedPath::as_str);
    tracing::info_span!("http", method = %req.method(), route, status = tracing::field::Empty)
}

fn on_response(resp: &Response, latency: Duration, span: &Span) {
    span.record("status", resp.status().as_u16());
    tracing::debug!(latency_ms = latency.as_millis() as u64, "answered");
}
