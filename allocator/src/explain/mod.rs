//! `GET /v1/explain/{tenant}/{resource}?region=&at=`: one answer to "why did
//! admission look like this for that region at that instant", assembled from
//! the policy history, the window's leases, the region's reports and its
//! recent refusals in the ledger.
//!
//! Every number is as of `at` where history allows (`as_of` names the
//! instant of each part): the pool's and the region's grants and returns are
//! rebuilt from the leases issued and released up to `at`, consumption and
//! fallback admits from the reports received up to `at`, the limit and the
//! fallback allowance from the policy in force at `at`, and "live" is judged
//! at `at`. Where retention has removed the history of the window the part
//! is the total as stored now, and `notes` says so. `current` always carries
//! the totals as stored now (reports arrive after the admits they count, so
//! they may know more about `at` than the reports received by then).
//!
//! The handler reads a `Snapshot` (`load`: every query, the window's in one
//! transaction) and `assemble`s the answer from it (no I/O, table-tested);
//! the answer's types are in `answer`.

mod answer;
mod assemble;
mod load;

pub use answer::{
    ExplainCurrent, ExplainFallback, ExplainInstants, ExplainLease, ExplainPool, ExplainRegion, Explanation,
};
pub use assemble::{verdict, Position};
pub use load::{MAX_LEASES, MAX_REFUSALS};

use assemble::assemble;
use load::load;

use crate::error::{Error, Result};
use crate::http::extract::{check_id, ApiPath, ApiQuery};
use crate::ledger::parse_time;
use crate::state::AppState;
use axum::extract::State;
use axum::Json;
use quota_shared::wire::ErrorBody;
use serde::Deserialize;
use utoipa::IntoParams;

/// Query of `GET /v1/explain/...`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ExplainQuery {
    /// The region to explain (required).
    pub region: Option<String>,
    /// RFC 3339 instant (default: now).
    pub at: Option<String>,
}

/// `GET /v1/explain/{tenant}/{resource}?region=&at=`.
#[utoipa::path(
    get,
    path = "/v1/explain/{tenant}/{resource}",
    params(("tenant" = String, Path), ("resource" = String, Path), ExplainQuery),
    responses(
        (status = 200, description = "Why admission looked this way for the region at that instant", body = Explanation),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota (or no policy yet at that instant)", body = ErrorBody),
        (status = 422, description = "Invalid parameter; the message names the field", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
#[tracing::instrument(name = "explain", skip_all, fields(tenant = %tenant, resource = %resource))]
pub(crate) async fn explain(
    State(state): State<AppState>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<ExplainQuery>,
) -> Result<Json<Explanation>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let region = q.region.ok_or_else(|| Error::invalid("region", "is required"))?;
    check_id("region", &region)?;
    let at = match q.at.as_deref() {
        Some(s) => parse_time("at", s)?,
        None => state.db_clock.now_on(&state.db).await?,
    };
    let snapshot = load(&state.db, &state.db_clock, tenant, resource, region, at).await?;
    Ok(Json(assemble(snapshot, at)))
}
