//! What one answer means for the lab's tally, whichever client got it
//! (the HTTP traffic of [`crate::traffic`] or the requests through Envoy
//! of [`crate::envoy_traffic`]).

/// What one answer means for the tally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Admitted into the window starting then (Unix seconds): from a
    /// lease, or through Envoy, whose answer does not say the source.
    Lease(i64),
    /// Admitted from the fallback allowance into that window.
    Fallback(i64),
    /// 429.
    Denied,
    /// 503, or through Envoy any 5xx (500 when the agent cannot decide and
    /// `failure_mode_deny` is set): nothing was charged.
    Unavailable,
    /// No answer, or one that says nothing certain.
    Ambiguous,
    /// The connection was refused.
    Refused,
}
