//! Shadow mode: a policy with `enforce: false` decides as usual, but a
//! refusal it would answer becomes an admit that debits nothing on the
//! quota, counted for the window's report (`shadow_refused`).

use crate::app::Decider;
use crate::error::Error;
use crate::quotas::{PolicyInfo, Quota};
use crate::request::{Paid, Shadow};
use crate::scripts::{self, Admit};
use quota_shared::window::Window;

/// Shadow mode: the refusal `e` an enforced policy would answer becomes an
/// admit that debits nothing on the quota, counted for the window's report.
pub(crate) async fn shadow_admit(app: &Decider, q: &Quota, p: PolicyInfo, s: Shadow, e: &Error) -> Paid {
    let ws = Window::containing(app.allocator_now(), p.window_secs).start;
    if let Err(err) = scripts::shadow(&app.store, &q.prefix, ws).await {
        tracing::warn!(tenant = %q.tenant, resource = %q.resource, error = %err, "shadow refusal not counted");
        app.metrics.inc("agent_shadow_uncounted_total", &[]);
    }
    let limit = match s {
        Shadow::PerKey => "per_key",
        Shadow::Quota => "quota",
        Shadow::Reserve => "reserve",
    };
    app.metrics.inc("agent_shadow_refusals_total", &[("limit", limit)]);
    let key_remaining = match e {
        Error::KeyLimited { remaining, .. } => Some(*remaining),
        _ => None,
    };
    Paid {
        admit: Admit { source: "shadow".into(), window_start: ws, remaining: 0, key_remaining },
        shadow: Some(s),
        pool_room: 0,
    }
}
