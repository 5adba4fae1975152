//! The fleet at a glance: the open-window columns of the `/ui` index (per
//! quota admitted against limit and bound with a small bar, the regions in
//! fallback, the 429 and 503 answers of the open window) and the
//! `/ui/regions` page (every agent's latest status, stale ones marked).
//!
//! Admits come from the allocator's own accounting (the agents' reports);
//! modes and refusal counts from the agents' statuses ([`crate::fleet`]).
//! A region is in fallback when it admitted from its fallback allowance in
//! the open window (reported once its partition healed) or when a fresh
//! status of one of its agents says so (an agent that cannot reach the
//! allocator cannot send a status either, so the accounting is what shows
//! a partition after the fact).
//! A status older than [`STALE_AFTER_SECS`] (database clock) is stale: its
//! agent is marked on the regions page and its modes no longer put a region
//! in fallback, while its counts still count for the window they name.

use super::{escape, page, time};
use crate::error::Result;
use crate::fleet::{self, AgentStatusRow};
use crate::policies::PolicyRow;
use crate::state::AppState;
use axum::extract::State;
use axum::response::Html;
use chrono::{DateTime, Utc};
use quota_shared::bound::{self, BoundInputs};
use quota_shared::wire::{ErrorBody, QuotaMode};
use std::collections::{BTreeSet, HashMap};
use std::fmt::Write;

/// Most agents the pages read (and the regions page lists).
pub const MAX_AGENTS: i64 = 500;
/// A status older than this is stale (agents send one every 2 s by default).
pub const STALE_AFTER_SECS: i64 = 15;
/// Width of the index's bar, px.
const BAR_WIDTH: u32 = 120;

/// Whether a status seen at `last_seen` is stale at `now`.
pub fn is_stale(last_seen: DateTime<Utc>, now: DateTime<Utc>) -> bool {
    (now - last_seen).num_seconds() > STALE_AFTER_SECS
}

/// The bar's pixel widths `(admitted, limit mark)` on a scale whose full
/// `width` is the larger of the bound and the admitted tokens, so an
/// overshoot past the bound fills the bar.
pub fn bar_widths(admitted: i64, limit: i64, bound: i64, width: u32) -> (u32, u32) {
    let scale = bound.max(admitted).max(1) as f64;
    let px = |v: i64| ((v.max(0) as f64 / scale) * f64::from(width)).round() as u32;
    (px(admitted).min(width), px(limit).min(width))
}

/// The index's inline SVG bar: admitted tokens (green up to the limit,
/// amber up to the bound, red beyond it) with a mark at the limit.
fn bar(admitted: i64, limit: i64, bound: i64) -> String {
    let (a, l) = bar_widths(admitted, limit, bound, BAR_WIDTH);
    let colour = if admitted > bound {
        "#c22"
    } else if admitted > limit {
        "#e90"
    } else {
        "#4a7"
    };
    format!(
        "<svg class=\"bar\" width=\"{BAR_WIDTH}\" height=\"12\" role=\"img\" aria-label=\"{admitted} of {limit} (bound {bound})\">\
         <rect width=\"{BAR_WIDTH}\" height=\"12\" fill=\"#eee\"/><rect class=\"admitted\" width=\"{a}\" height=\"12\" fill=\"{colour}\"/>\
         <line class=\"limit\" x1=\"{l}\" x2=\"{l}\" y1=\"0\" y2=\"12\" stroke=\"#222\" stroke-width=\"2\"/></svg>"
    )
}

/// A mode as the agent's `/v1/status` names it.
fn mode_name(m: QuotaMode) -> &'static str {
    match m {
        QuotaMode::Leased => "leased",
        QuotaMode::Fallback => "fallback",
        QuotaMode::Strict => "strict",
        QuotaMode::Exhausted => "exhausted",
    }
}

/// One quota's open window: what the index shows beside its policy.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OpenWindow {
    pub admitted: i64,
    pub limit: i64,
    pub bound: i64,
    /// Regions that admitted from fallback in the window, or with a fresh
    /// agent in fallback mode (strict: refusing) for the quota.
    pub fallback_regions: BTreeSet<String>,
    pub strict_regions: BTreeSet<String>,
    /// 429 and 503 answers the agents counted in the open window.
    pub quota_exhausted: i64,
    pub unavailable: i64,
}

struct PoolRow {
    tenant: String,
    resource: String,
    limit_tokens: i64,
    fallback_per_region: i64,
    regions: i64,
    consumed: i64,
    fallback_admitted: i64,
    fallback_regions: Vec<String>,
}

/// Adds the agents' statuses to the open windows: modes from fresh
/// statuses, counts from every status whose window is the quota's open one
/// (`open_start` by quota, Unix seconds).
pub fn add_statuses(
    open: &mut HashMap<(String, String), OpenWindow>,
    open_start: &HashMap<(String, String), i64>,
    statuses: &[AgentStatusRow],
    now: DateTime<Utc>,
) {
    for s in statuses {
        let fresh = !is_stale(s.last_seen, now);
        for q in s.quotas.iter() {
            let key = (q.tenant.clone(), q.resource.clone());
            let Some(start) = open_start.get(&key) else { continue };
            let Some(w) = open.get_mut(&key) else { continue };
            if q.window_start.timestamp() == *start {
                w.quota_exhausted += q.quota_exhausted;
                w.unavailable += q.unavailable;
            }
            if fresh {
                match q.mode {
                    QuotaMode::Fallback => w.fallback_regions.insert(s.region.clone()),
                    QuotaMode::Strict => w.strict_regions.insert(s.region.clone()),
                    QuotaMode::Leased | QuotaMode::Exhausted => false,
                };
            }
        }
    }
}

/// The open window of each listed policy, with the agents' statuses added.
pub async fn open_windows(
    state: &AppState,
    policies: &[PolicyRow],
    limit: i64,
) -> Result<HashMap<(String, String), OpenWindow>> {
    let mut conn = state.db.acquire().await?;
    let now = state.db_clock.now(&mut conn).await?;
    let t = now.timestamp();
    let pools =
        sqlx::query_file_as!(PoolRow, "src/sql/ui_open_windows.sql", t, limit).fetch_all(&mut *conn).await?;
    drop(conn);
    let mut open: HashMap<(String, String), OpenWindow> = policies
        .iter()
        .map(|p| {
            let w = OpenWindow { limit: p.limit_tokens, bound: p.limit_tokens, ..Default::default() };
            ((p.tenant.clone(), p.resource.clone()), w)
        })
        .collect();
    let open_start: HashMap<(String, String), i64> = policies
        .iter()
        .map(|p| ((p.tenant.clone(), p.resource.clone()), t - t.rem_euclid(p.window_secs)))
        .collect();
    for p in pools {
        let admitted = p.consumed + p.fallback_admitted;
        let v = bound::verdict(
            BoundInputs {
                limit: p.limit_tokens,
                fallback_allowances: p.fallback_per_region * p.regions,
                local_store_fallback: 0,
            },
            admitted,
        );
        if let Some(w) = open.get_mut(&(p.tenant, p.resource)) {
            (w.admitted, w.limit, w.bound) = (admitted, p.limit_tokens, v.bound);
            w.fallback_regions.extend(p.fallback_regions);
        }
    }
    let statuses = fleet::latest(&state.db, MAX_AGENTS).await?;
    add_statuses(&mut open, &open_start, &statuses, now);
    Ok(open)
}

/// The index's open-window cells of one quota.
pub fn cells(tenant: &str, resource: &str, w: &OpenWindow) -> String {
    let (t, r) = (escape(tenant), escape(resource));
    let regions = |set: &BTreeSet<String>, suffix: &str| {
        set.iter()
            .map(|g| format!("<a href=\"/v1/explain/{t}/{r}?region={g}\">{g}</a>{suffix}", g = escape(g)))
            .collect::<Vec<_>>()
    };
    let mut listed = regions(&w.fallback_regions, "");
    listed.extend(regions(&w.strict_regions, " (strict)"));
    let mut out = String::new();
    let _ = write!(
        out,
        "<td data-field=\"admitted\">{}</td><td data-field=\"bound\">{}</td><td>{}</td>\
         <td class=\"l\" data-field=\"fallback_regions\">{}</td>\
         <td data-field=\"refused_429\">{}</td><td data-field=\"refused_503\">{}</td>\
         <td class=\"l\"><a href=\"/ui/quotas/{t}/{r}\">chart</a> · <a href=\"/v1/windows/{t}/{r}\">windows</a> \
         · <a href=\"/v1/policies/{t}/{r}/versions\">versions</a></td>",
        w.admitted,
        w.bound,
        bar(w.admitted, w.limit, w.bound),
        listed.join(", "),
        w.quota_exhausted,
        w.unavailable,
    );
    out
}

/// `GET /ui/regions`: every agent's latest status, by region.
#[utoipa::path(
    get,
    path = "/ui/regions",
    responses(
        (status = 200, description = "HTML table of the agents' latest statuses", content_type = "text/html"),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
pub(crate) async fn regions(State(state): State<AppState>) -> Result<Html<String>> {
    let now = state.db_clock.now_on(&state.db).await?;
    let mut rows = fleet::latest(&state.db, MAX_AGENTS + 1).await?;
    let cut = rows.len() as i64 > MAX_AGENTS;
    rows.truncate(MAX_AGENTS as usize);
    let stale = rows.iter().filter(|s| is_stale(s.last_seen, now)).count();
    let mut body = format!(
        "<p><a href=\"/ui\">all quotas</a> · <span id=\"agents\">{}</span> agents, \
         <span id=\"stale\">{stale}</span> stale (no status for more than {STALE_AFTER_SECS} s)</p>",
        rows.len()
    );
    body.push_str(
        "<table id=\"regions\"><tr><th>region</th><th>agent</th><th>epoch</th><th>last seen</th>\
         <th>age (s)</th><th>allocator reachable</th><th>outbox depth</th><th>dead letters</th>\
         <th>quotas</th><th>quotas not leased</th></tr>",
    );
    for s in &rows {
        let stale = is_stale(s.last_seen, now);
        let not_leased: Vec<String> = s
            .quotas
            .iter()
            .filter(|q| q.mode != QuotaMode::Leased)
            .map(|q| format!("{}/{} {}", escape(&q.tenant), escape(&q.resource), mode_name(q.mode)))
            .collect();
        let _ = write!(
            body,
            "<tr data-agent=\"{r}/{a}\"{cls}><td class=\"l\">{r}</td><td class=\"l\">{a}</td>\
             <td data-field=\"epoch\">{}</td><td>{}</td><td data-field=\"age\"{age_cls}>{}{}</td>\
             <td data-field=\"reachable\"{reach_cls}>{}</td><td data-field=\"outbox_depth\">{}</td>\
             <td data-field=\"dead_letters\">{}</td><td data-field=\"quotas\">{}</td><td class=\"l\">{}</td></tr>",
            s.epoch,
            time(s.last_seen),
            (now - s.last_seen).num_seconds().max(0),
            if stale { " stale" } else { "" },
            if s.allocator_reachable { "yes" } else { "NO" },
            s.outbox_depth,
            s.dead_letters.map_or_else(|| "?".to_string(), |d| d.to_string()),
            s.quotas_total,
            not_leased.join(", "),
            r = escape(&s.region),
            a = escape(&s.agent),
            cls = if stale { " class=\"stale\"" } else { "" },
            age_cls = if stale { " class=\"bad\"" } else { "" },
            reach_cls = if s.allocator_reachable { "" } else { " class=\"bad\"" },
        );
    }
    body.push_str("</table>");
    if rows.is_empty() {
        body.push_str("<p>No agent has sent a status yet.</p>");
    }
    if cut {
        let _ =
            write!(body, "<p id=\"cut\">Only the first {MAX_AGENTS} agents by region and id are shown.</p>");
    }
    Ok(page("Agents by region", &body))
}

#[cfg(test)]
mod tests {
    use super::*;
    use quota_shared::wire::AgentQuotaStatus;

    #[test]
    fn the_bar_scales_to_the_bound_or_to_an_overshoot() {
        assert_eq!(bar_widths(500, 1000, 1100, 110), (50, 100));
        assert_eq!(bar_widths(1200, 1000, 1100, 120), (120, 100));
        assert_eq!(bar_widths(0, 0, 0, 120), (0, 0));
        assert_eq!(bar_widths(-5, 10, 10, 100), (0, 100));
    }

    #[test]
    fn a_status_is_stale_after_the_threshold_only() {
        let now = DateTime::from_timestamp(1_800_000_100, 0).unwrap();
        let ago = |s| now - chrono::Duration::seconds(s);
        assert!(!is_stale(ago(0), now));
        assert!(!is_stale(ago(STALE_AFTER_SECS), now));
        assert!(is_stale(ago(STALE_AFTER_SECS + 1), now));
    }

    #[test]
    fn counts_add_up_for_the_open_window_and_only_fresh_agents_put_a_region_in_fallback() {
        let now = DateTime::from_timestamp(1_800_000_030, 0).unwrap();
        let open_start = 1_800_000_000;
        let q = |mode, start: i64, e, u| AgentQuotaStatus {
            tenant: "atlas".into(),
            resource: "read".into(),
            mode,
            window_start: DateTime::from_timestamp(start, 0).unwrap(),
            quota_exhausted: e,
            unavailable: u,
            per_key_limited: 0,
            admitted: 0,
            policy_version: None,
        };
        let agent = |region: &str, agent: &str, age: i64, quotas| AgentStatusRow {
            region: region.into(),
            agent: agent.into(),
            epoch: 1,
            allocator_reachable: true,
            outbox_depth: 0,
            dead_letters: Some(0),
            quotas_total: 1,
            quotas: sqlx::types::Json(quotas),
            last_seen: now - chrono::Duration::seconds(age),
        };
        let statuses = vec![
            agent("eu", "eu-1", 1, vec![q(QuotaMode::Exhausted, open_start, 3, 0)]),
            agent("eu", "eu-2", 2, vec![q(QuotaMode::Leased, open_start - 60, 7, 7)]),
            agent("us", "us-1", 1, vec![q(QuotaMode::Fallback, open_start, 0, 2)]),
            agent("ap", "ap-1", 100, vec![q(QuotaMode::Strict, open_start, 1, 1)]),
        ];
        let key = ("atlas".to_string(), "read".to_string());
        let mut open = HashMap::from([(key.clone(), OpenWindow::default())]);
        let starts = HashMap::from([(key.clone(), open_start)]);
        add_statuses(&mut open, &starts, &statuses, now);
        let w = &open[&key];
        assert_eq!((w.quota_exhausted, w.unavailable), (4, 3), "the previous window's 7s are left out");
        assert_eq!(w.fallback_regions, BTreeSet::from(["us".to_string()]));
        assert!(w.strict_regions.is_empty(), "ap's status is stale");
    }
}
