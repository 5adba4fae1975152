//! `GET /ui`: a read-only dashboard rendered on the server: plain HTML with
//! inline SVG and no JavaScript, refreshed by `<meta http-equiv="refresh">`.
//! `/ui` lists the quotas with their open window at a glance (see
//! [`fleet`]); `/ui/quotas/{tenant}/{resource}` charts the last windows
//! (limit, bound, admitted per region with the fallback share, stranded)
//! above a table with the same numbers; `/ui/regions` lists the agents'
//! latest statuses.
//!
//! Every string that comes from the database or the request goes through
//! [`escape`]. The pages are admin reads (see `crate::routes` for the auth choice).

pub mod chart;
pub mod fleet;

use crate::error::{Error, Result};
use crate::http::extract::{check_id, ApiPath, ApiQuery};
use crate::policies;
use crate::state::AppState;
use crate::windows::{self, WindowAccount};
use axum::extract::State;
use axum::response::Html;
use chrono::{DateTime, Duration, SecondsFormat, Utc};
use quota_shared::window::Window;
use quota_shared::wire::ErrorBody;
use serde::Deserialize;
use std::collections::BTreeSet;
use std::fmt::Write;
use utoipa::IntoParams;

/// Most quotas the index lists.
pub const MAX_QUOTAS: i64 = 1000;
/// Windows a quota page shows unless `?n=` says otherwise.
pub const DEFAULT_WINDOWS: i64 = 12;

/// Escapes text for HTML element content and attribute values.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn time(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

const STYLE: &str = "body{font-family:sans-serif;margin:1.5em;color:#222}\
table{border-collapse:collapse;margin-top:1em}th,td{border:1px solid #ccc;padding:.25em .6em;text-align:right}\
th{background:#f3f3f3}td.l{text-align:left}.bad{color:#b00;font-weight:bold}a{color:#0645ad}\
tr.stale{color:#888;background:#fafafa}";

fn page(title: &str, body: &str) -> Html<String> {
    Html(format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"5\"><title>{t}</title><style>{STYLE}</style></head>\
         <body><h1>{t}</h1>{body}</body></html>\n",
        t = escape(title)
    ))
}

/// `GET /ui`: every quota with its policy and its open window at a glance.
#[utoipa::path(
    get,
    path = "/ui",
    responses(
        (status = 200, description = "HTML list of quotas with their open window", content_type = "text/html"),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
pub(crate) async fn index(State(state): State<AppState>) -> Result<Html<String>> {
    let rows = policies::list_all(&state.db, MAX_QUOTAS).await?;
    let open = fleet::open_windows(&state, &rows, MAX_QUOTAS).await?;
    let mut body = String::from(
        "<p><a href=\"/ui/regions\">agents by region</a></p>\
         <table id=\"quotas\"><tr><th>quota</th><th>limit</th><th>window (s)</th><th>fail mode</th>\
         <th>fallback / region</th><th>version</th><th>updated</th><th>admitted (open window)</th>\
         <th>bound</th><th>admitted / limit / bound</th><th>regions in fallback</th><th>429 (open window)</th><th>503 (open window)</th>\
         <th>links</th></tr>",
    );
    for p in &rows {
        let _ = write!(
            body,
            "<tr data-quota=\"{t}/{r}\"><td class=\"l\"><a href=\"/ui/quotas/{t}/{r}\">{t}/{r}</a></td><td data-field=\"limit\">{}</td>\
             <td data-field=\"window_secs\">{}</td><td>{}</td><td>{}</td><td data-field=\"version\">{}</td>\
             <td>{}</td>{}</tr>",
            p.limit_tokens,
            p.window_secs,
            escape(&p.fail_mode),
            p.fallback_per_region,
            p.version,
            time(p.updated_at),
            open.get(&(p.tenant.clone(), p.resource.clone()))
                .map(|w| fleet::cells(&p.tenant, &p.resource, w))
                .unwrap_or_default(),
            t = escape(&p.tenant),
            r = escape(&p.resource),
        );
    }
    body.push_str("</table>");
    if rows.is_empty() {
        body.push_str("<p>No quota has a policy yet.</p>");
    }
    Ok(page("Quotas", &body))
}

/// Query of `/ui/quotas/...`.
#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct QuotaQuery {
    /// Windows to show, ending with the current one, 1..=100 (default 12).
    pub n: Option<i64>,
}

/// `GET /ui/quotas/{tenant}/{resource}`: the last windows as a chart and a table.
#[utoipa::path(
    get,
    path = "/ui/quotas/{tenant}/{resource}",
    params(("tenant" = String, Path), ("resource" = String, Path), QuotaQuery),
    responses(
        (status = 200, description = "HTML chart and table of the last windows", content_type = "text/html"),
        (status = 401, description = "Missing or wrong admin token", body = ErrorBody),
        (status = 404, description = "Unknown quota", body = ErrorBody),
        (status = 422, description = "Invalid parameter", body = ErrorBody),
    ),
    security(("admin_token" = [])),
    tag = "operator"
)]
pub(crate) async fn quota(
    State(state): State<AppState>,
    ApiPath((tenant, resource)): ApiPath<(String, String)>,
    ApiQuery(q): ApiQuery<QuotaQuery>,
) -> Result<Html<String>> {
    check_id("tenant", &tenant)?;
    check_id("resource", &resource)?;
    let n = q.n.unwrap_or(DEFAULT_WINDOWS);
    if !(1..=windows::MAX_WINDOWS).contains(&n) {
        return Err(Error::invalid("n", format!("must be between 1 and {}, got {n}", windows::MAX_WINDOWS)));
    }
    let mut conn = state.db.acquire().await?;
    let now = state.db_clock.now(&mut conn).await?;
    let policy = policies::require(&mut conn, &tenant, &resource).await?;
    let current = Window::containing(now, policy.window_secs);
    let from = current.start_at() - Duration::seconds(policy.window_secs * (n - 1));
    let (accounts, _) =
        windows::accounts(&mut conn, &tenant, &resource, from, current.end_at(), n, now).await?;
    let title = format!("{tenant}/{resource}");
    let mut body = format!(
        "<p><a href=\"/ui\">all quotas</a> · policy version <span id=\"version\">{}</span>: limit \
         <span id=\"limit\">{}</span> per {} s window, {} mode, fallback {} per region</p>",
        policy.version,
        policy.limit_tokens,
        policy.window_secs,
        escape(&policy.fail_mode),
        policy.fallback_per_region
    );
    body.push_str(&chart::render(&accounts));
    body.push_str(&table(&accounts));
    Ok(page(&title, &body))
}

/// The table under the chart: one row per window, one admitted column per region.
fn table(accounts: &[WindowAccount]) -> String {
    let regions: BTreeSet<&str> =
        accounts.iter().flat_map(|w| w.regions.keys().map(String::as_str)).collect();
    let mut t = String::from(
        "<table id=\"windows\"><tr><th>window start</th><th>limit</th><th>bound</th><th>admitted</th>",
    );
    for r in &regions {
        let _ = write!(t, "<th>admitted {}</th>", escape(r));
    }
    t.push_str("<th>fallback admitted</th><th>fallback share</th><th>granted</th><th>returned</th><th>stranded</th><th>bound held</th></tr>");
    for w in accounts {
        let share = if w.admitted > 0 { 100.0 * w.fallback_admitted as f64 / w.admitted as f64 } else { 0.0 };
        let _ = write!(
            t,
            "<tr data-window=\"{start}\"><td class=\"l\">{start}</td><td data-field=\"limit\">{}</td>\
             <td data-field=\"bound\">{}</td><td data-field=\"admitted\">{}</td>",
            w.limit,
            w.bound,
            w.admitted,
            start = time(w.window_start),
        );
        for r in &regions {
            let admitted = w.regions.get(*r).map_or(0, |a| a.admitted);
            let _ = write!(t, "<td data-region=\"{}\">{admitted}</td>", escape(r));
        }
        let _ = write!(
            t,
            "<td data-field=\"fallback_admitted\">{}</td><td data-field=\"fallback_share\">{share:.1}%</td>\
             <td data-field=\"granted\">{}</td><td data-field=\"returned\">{}</td>\
             <td data-field=\"stranded\">{}</td><td data-field=\"bound_held\"{}>{}</td></tr>",
            w.fallback_admitted,
            w.granted,
            w.returned,
            w.stranded,
            if w.bound_held { "" } else { " class=\"bad\"" },
            if w.bound_held { "yes" } else { "NO" },
        );
    }
    t.push_str("</table>");
    t
}

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn escape_covers_markup_and_both_quotes() {
        assert_eq!(escape(r#"<a href="x">'&'</a>"#), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
    }
}
