//! The durable outbox (I7). Counts of admits live in region-wide Redis
//! counters per quota and window; `lua/cut.lua` moves them atomically into
//! a report entry with a fresh report id in this agent's outbox list (in the
//! quota's slot), and releases of expired leases' unspent tokens are pushed
//! into the outbox of the lease's agent by the scripts that retire the
//! leases. This task sends each entry to the allocator and removes it only
//! once the allocator accepted it or refused it for a reason that can never
//! change, so a crash at any point resends the same report id or lease
//! release, both idempotent at the allocator. The releases one round meets
//! in all the quotas' lists leave together ([`crate::release_batch`]), each
//! still leaving its list only on its own answer. The outbox is bounded: no new
//! report is cut while an agent's outbox holds [`MAX_OUTBOX`] entries; the
//! counts wait in their counters.
//!
//! **Outboxes belong to the region, not to a process.** Each agent keeps a
//! liveness key (refreshed every round, expiring [`live_ttl`] after the
//! last) and is listed in the region's agent set. An agent whose liveness
//! key is gone (SIGKILL, OOM kill, a pod replaced under a new name) is
//! adopted by the region's live replicas: its reports are sent under the
//! adopter's own identity (the allocator applies a report id once, whoever
//! sends it), its lease releases under the dead agent's identity, for which
//! the adopter registers (that fences out the dead incarnation, I4; should it
//! come back, its own registration fences the adopter in turn). Two adopters
//! sending the same entry are harmless: both calls are idempotent.
//!
//! **Refusals are classified** ([`classify`]): only an answer that can never
//! change (`idempotency_mismatch`, `unknown_lease`, `report_expired`, an
//! invalid item) takes an entry out without the allocator applying it, and
//! such an entry goes to the region's dead-letter list (read through
//! `/v1/status`, counted in `agent_outbox_dead_letters_total`, logged as an
//! error). A report item the allocator names as invalid is dead-lettered
//! alone and the rest is sent again under a report id derived from the
//! first, so a resend after a crash is still idempotent. Everything else
//! (401/403 during a token rotation, 408, 413, 429, 5xx, a proxy's 404 with
//! no error body) stays and is retried with backoff.

use crate::app::App;
use crate::client::{AllocatorClient, CallError};
use crate::commands;
use crate::config::Settings;
use crate::fallback::LocalFallback;
use crate::fleet_counts::FleetStatus;
use crate::identity::Identity;
use crate::keys::{Keys, Layout};
use crate::quotas::{Quota, Quotas};
use crate::release_batch::{Releases, MAX_RELEASE_BATCH};
use crate::scripts;
use crate::store::{Store, StoreError};
use chrono::{TimeZone, Utc};
use quota_shared::prom::Registry;
use quota_shared::wire::{ReleaseItem, ReleaseRequest, ReportItem, ReportRequest};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// Most entries one agent's outbox of one quota holds before cutting pauses.
pub const MAX_OUTBOX: i64 = 64;
/// Entries sent per quota per round.
const BATCH: isize = 32;
/// Dead letters kept per region (newest first).
pub const MAX_DEAD_LETTERS: isize = 1000;
/// Adoption runs every this many rounds.
const ADOPT_EVERY: u32 = 5;
/// Dead agents looked at per adoption round, and quotas of each.
const ADOPT_AGENTS: usize = 8;
const ADOPT_QUOTAS: usize = 128;
/// Dead agents whose identity this agent holds at once.
const MAX_ADOPTED: usize = 256;
/// A dead agent whose outboxes were all empty for this long leaves the
/// region's agent set (a lease of it retired later is stranded: safe side).
const ADOPT_QUIET: Duration = Duration::from_secs(15 * 60);

/// How long an agent's liveness key outlives its last refresh.
pub fn live_ttl(interval: Duration) -> Duration {
    (interval * 10).max(Duration::from_secs(10))
}

/// One outbox entry as `lua/*.lua` writes it.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(tag = "k")]
enum Entry {
    /// A release: lease id and unspent tokens.
    #[serde(rename = "rel")]
    Release { id: String, u: i64 },
    /// A report: id and its items.
    #[serde(rename = "rep")]
    Report { rid: String, items: Vec<Item> },
}

/// One report item as `lua/cut.lua` writes it: `[window_start, consumed,
/// fallback_admitted]`, plus `shadow_refused` when not 0 (an entry written
/// before shadow mode has three numbers, and one without shadow refusals
/// keeps that form, so either version of the agent reads the other's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<i64>", into = "Vec<i64>")]
struct Item {
    window_start: i64,
    consumed: i64,
    fallback_admitted: i64,
    shadow_refused: i64,
}

impl TryFrom<Vec<i64>> for Item {
    type Error = String;
    fn try_from(v: Vec<i64>) -> Result<Item, String> {
        match v[..] {
            [window_start, consumed, fallback_admitted] => {
                Ok(Item { window_start, consumed, fallback_admitted, shadow_refused: 0 })
            }
            [window_start, consumed, fallback_admitted, shadow_refused] => {
                Ok(Item { window_start, consumed, fallback_admitted, shadow_refused })
            }
            _ => Err(format!("a report item has 3 or 4 numbers, not {}", v.len())),
        }
    }
}

impl From<Item> for Vec<i64> {
    fn from(i: Item) -> Vec<i64> {
        let mut v = vec![i.window_start, i.consumed, i.fallback_admitted];
        if i.shadow_refused != 0 {
            v.push(i.shadow_refused);
        }
        v
    }
}

/// What an answer to one entry means for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Applied (or applied before): the entry leaves.
    Done,
    /// Not applied, may be later: the entry stays, the outbox backs off.
    Retry,
    /// The sender's epoch is stale: register again, then resend.
    Reregister,
    /// Refused for a reason that can never change: dead letter.
    Dead,
    /// One report item is invalid: that item is dead-lettered, the rest resent.
    DeadItem(usize),
}

/// The refusal rule. `status`/`code`/`item` are the allocator's answer
/// (`code` is `unknown` when the body was not the allocator's error JSON,
/// as from a proxy).
pub fn classify(status: u16, code: &str, item: Option<usize>, items: usize) -> Verdict {
    match (status, code) {
        (409, "stale_epoch") => Verdict::Reregister,
        (409, "idempotency_mismatch") | (404, "unknown_lease") | (422, "report_expired") => Verdict::Dead,
        (422, "invalid_field") => match item {
            Some(i) if items > 1 && i < items => Verdict::DeadItem(i),
            _ => Verdict::Dead,
        },
        // A quota, agent or region the allocator does not know any more
        // (deleted policy, agent row past retention: the latter answers
        // stale_epoch) cannot be reported into.
        (404, "unknown_quota") => Verdict::Dead,
        // 401/403 (token rotation, another region's credential), 404 or 413
        // from a proxy, 408, 429, anything unexpected: the allocator may
        // accept it later.
        _ => Verdict::Retry,
    }
}

/// The report id of what is left of report `rid` once item `i` is taken
/// out: derived, so the same split after a crash gives the same id.
fn split_id(rid: &str, i: usize) -> String {
    format!("{rid}.{i}")
}

/// Adopted identities of dead agents and the outbox's retry state.
/// What the outbox uses of the agent's state: nearly all of it (it reads
/// the quotas, sends through the allocator client under the agent's
/// identity, reports the local fallback's admits and feeds the metrics and
/// the fleet status), but not the request path's parts (guard, negative
/// cache, clocks, the task list).
#[derive(Clone)]
pub struct OutboxParts {
    pub settings: Arc<Settings>,
    pub keys: Keys,
    pub store: Store,
    pub alloc: Arc<AllocatorClient>,
    pub quotas: Arc<Quotas>,
    pub ident: Arc<Identity>,
    pub metrics: Arc<Registry>,
    pub local: Arc<LocalFallback>,
    pub fleet_status: Arc<FleetStatus>,
    pub legacy: Arc<crate::legacy::Gate>,
    pub cancel: CancellationToken,
}

impl OutboxParts {
    /// The outbox's handles on `app`'s parts.
    pub fn of(app: &App) -> OutboxParts {
        OutboxParts {
            settings: app.settings.clone(),
            keys: app.keys.clone(),
            store: app.store.clone(),
            alloc: app.alloc.clone(),
            quotas: app.quotas.clone(),
            ident: app.ident.clone(),
            metrics: app.metrics.clone(),
            local: app.local.clone(),
            fleet_status: app.fleet_status.clone(),
            legacy: app.legacy.clone(),
            cancel: app.cancel.clone(),
        }
    }
}

#[derive(Default)]
pub struct Outboxes {
    /// Dead agent id → (epoch registered for it, when its outboxes were
    /// first seen empty).
    adopted: Mutex<HashMap<String, (i64, Option<Instant>)>>,
    /// Consecutive rounds that ended in a retryable refusal.
    retries: Mutex<u32>,
    /// Whether releases go in batches.
    releases: Releases,
}

/// A release entry met in a quota's list, sent later with the round's
/// other releases (see [`crate::release_batch`]); it stays in its list
/// until its answer says it may leave.
struct Deferred {
    /// The list it is in, and its raw value there.
    list: String,
    raw: String,
    /// The agent whose list it is (a stale epoch is that agent's).
    owner: String,
    tenant: String,
    resource: String,
    item: ReleaseItem,
}

/// Whose outbox is being sent, and as whom.
struct Sender {
    /// The agent whose list it is.
    owner: String,
    /// Epoch for releases (the owner's).
    release_epoch: i64,
    /// The agent and epoch reports go out under.
    report_agent: String,
    report_epoch: i64,
}

/// Cuts and drains every `interval` until cancelled.
pub async fn run(app: OutboxParts, ob: Arc<Outboxes>) {
    let mut round = 0u32;
    loop {
        let retries = *ob.retries.lock().unwrap();
        let pause = if retries == 0 {
            app.settings.outbox_interval
        } else {
            crate::breaker::backoff(retries, app.settings.outbox_interval, Duration::from_secs(5))
        };
        tokio::select! {
            _ = app.cancel.cancelled() => return,
            _ = tokio::time::sleep(pause) => {},
        }
        heartbeat(&app).await;
        drain_all(&app, &ob, None).await;
        round = round.wrapping_add(1);
        if round.is_multiple_of(ADOPT_EVERY) {
            adopt(&app, &ob).await;
        }
    }
}

/// Refreshes this agent's liveness key (its value says the agent's key
/// layout, see [`crate::legacy`]) and lists it in its layout's agent set.
pub async fn heartbeat(app: &OutboxParts) {
    let (region, agent) = (&app.settings.region, &app.settings.agent);
    let ttl = live_ttl(app.settings.outbox_interval).as_millis() as u64;
    let value = match app.keys.layout() {
        Layout::Tenant => crate::legacy::LIVE_TENANT,
        Layout::Legacy => crate::legacy::LIVE_LEGACY,
    };
    let live = app.keys.agent_live(region, agent);
    commands::heartbeat(&app.store, &live, value, ttl, &app.keys.region_agents(region), agent).await;
}

/// Repeats rounds until every outbox is empty or `deadline` passes (at
/// shutdown). Returns the entries left.
pub async fn final_drain(app: &OutboxParts, ob: &Outboxes, deadline: Duration) -> i64 {
    let until = Instant::now() + deadline;
    loop {
        let left = drain_all(app, ob, Some(until)).await;
        if left == 0 || Instant::now() >= until {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One round over every quota of this agent; returns the entries left (at
/// least 1 when a quota could not be read, so a final drain keeps trying).
/// A round stops at the first Redis failure or at `until`: with thousands of
/// quotas and Redis gone, one timeout per quota would hold a shutdown for
/// minutes.
#[tracing::instrument(skip_all)]
pub async fn drain_all(app: &OutboxParts, ob: &Outboxes, until: Option<Instant>) -> i64 {
    let epoch = app.ident.epoch();
    if epoch == 0 {
        return 1;
    }
    let me = Sender {
        owner: app.settings.agent.clone(),
        release_epoch: epoch,
        report_agent: app.settings.agent.clone(),
        report_epoch: epoch,
    };
    let mut left = 0;
    let quotas = app.quotas.all();
    let mut stopped = false;
    // A loaded Redis may time out one call; three in a row (one at
    // shutdown) mean it is gone for this round.
    let give_up = if until.is_some() { 1 } else { 3 };
    let mut failed_in_row = 0;
    let mut releases = Vec::new();
    for q in &quotas {
        if until.is_some_and(|t| Instant::now() >= t) {
            stopped = true;
            break;
        }
        let mut drained =
            drain_list(app, ob, &q.prefix, &q.tenant, &q.resource, &me, true, Some(&mut releases)).await;
        if releases.len() >= MAX_RELEASE_BATCH {
            drained = match (drained, send_releases(app, ob, &mut releases).await) {
                (Ok(n), Ok(sent)) => Ok(n - sent),
                (Ok(_), Err(e)) | (Err(e), _) => Err(e),
            };
        }
        let done = q.legacy_done.load(Ordering::Relaxed) && legacy_passed(app, q);
        if app.keys.layout() == Layout::Tenant && !done {
            drained = match drained {
                Ok(n) => sweep_legacy(app, ob, q, &me).await.map(|l| n + l),
                e => e,
            };
        }
        match drained {
            Ok(n) => {
                left += n;
                failed_in_row = 0;
            }
            Err(_) => {
                stopped = true;
                failed_in_row += 1;
                if failed_in_row >= give_up {
                    break;
                }
            }
        }
    }
    match send_releases(app, ob, &mut releases).await {
        Ok(sent) => left -= sent,
        Err(_) => stopped = true,
    }
    if stopped {
        left = left.max(1);
    } else {
        app.metrics.set("agent_outbox_depth", &[], left as f64);
        app.fleet_status.set_outbox_depth(left);
    }
    left += drain_local(app, epoch).await;
    // The agent's quota set lives as long as the agent does, plus the
    // counters' ttl: a set of an agent id that never comes back expires (F04).
    if !stopped {
        let set = app.keys.agent_quotas(&app.settings.region, &app.settings.agent);
        let _ = commands::keep(&app.store, &set).await;
    }
    left
}

/// What the legacy layout holds of quota `q` (see [`crate::legacy`]):
/// expired legacy leases retired (their unspent tokens become releases),
/// legacy counters cut into this agent's legacy outbox and sent. Once
/// nothing is left and no legacy agent can write any more, the quota's
/// legacy keys are not looked at again. Returns the entries left.
async fn sweep_legacy(app: &OutboxParts, ob: &Outboxes, q: &Quota, me: &Sender) -> Result<i64, StoreError> {
    let prefix = app.keys.legacy_quota(&q.tenant, &q.resource);
    let live = commands::live_leases(&app.store, &prefix).await?;
    if let (true, Some(p)) = (live > 0, q.policy()) {
        let on = scripts::On { prefix: &prefix, token: "" };
        let by = scripts::Caller { agent: &app.settings.agent, epoch: me.report_epoch };
        let args =
            scripts::ViewArgs { window_secs: p.window_secs, allowance: p.fallback_allowance, lasting_ms: 0 };
        scripts::view(&app.store, on, by, args).await?;
    }
    let left = drain_list(app, ob, &prefix, &q.tenant, &q.resource, me, true, None).await?;
    let done = live == 0 && left == 0 && legacy_passed(app, q);
    if !done {
        q.legacy_done.store(false, Ordering::Relaxed);
    } else if !q.legacy_done.swap(true, Ordering::Relaxed) {
        tracing::debug!(tenant = %q.tenant, resource = %q.resource, "the quota's legacy keys are empty");
    }
    Ok(left)
}

/// Whether no legacy agent can write quota `q`'s legacy keys any more (see
/// [`crate::legacy::Gate::passed`]); a quota whose policy is not known yet
/// waits as if its window never ended.
fn legacy_passed(app: &OutboxParts, q: &Quota) -> bool {
    app.legacy.passed(q.policy().map_or(i64::MAX / 2000, |p| p.window_secs))
}

/// Cuts (when `cut`) and sends one quota's list of `s.owner`; returns the
/// entries left in it. With `releases`, its release entries are not sent
/// here but collected there (still in the list) for the round's batch.
#[tracing::instrument(skip_all, fields(tenant = tenant, resource = resource, agent = %s.owner))]
#[allow(clippy::too_many_arguments)]
async fn drain_list(
    app: &OutboxParts,
    state: &Outboxes,
    prefix: &str,
    tenant: &str,
    resource: &str,
    s: &Sender,
    cut: bool,
    mut releases: Option<&mut Vec<Deferred>>,
) -> Result<i64, StoreError> {
    if cut {
        scripts::cut(&app.store, prefix, &s.owner, &uuid::Uuid::new_v4().to_string(), MAX_OUTBOX).await?;
    }
    let ob = Keys::outbox(prefix, &s.owner);
    let entries = commands::list_page(&app.store, &ob, BATCH).await?;
    for raw in entries {
        let entry = match serde_json::from_str::<Entry>(&raw) {
            Ok(e) => e,
            Err(e) => {
                dead_letter(app, tenant, resource, &s.owner, &raw, 0, "unreadable", &e.to_string()).await;
                commands::outbox_remove(&app.store, &ob, &raw).await?;
                continue;
            }
        };
        if let (Entry::Release { id, u }, Some(batch)) = (&entry, releases.as_deref_mut()) {
            if let Ok(lease_id) = uuid::Uuid::parse_str(id) {
                let item = ReleaseItem { lease_id, epoch: s.release_epoch, unspent: *u };
                let (tenant, resource) = (tenant.to_string(), resource.to_string());
                batch.push(Deferred {
                    list: ob.clone(),
                    raw,
                    owner: s.owner.clone(),
                    tenant,
                    resource,
                    item,
                });
                continue;
            }
        }
        let result = send(app, tenant, resource, s, &entry).await;
        let verdict = match &result {
            Ok(()) => Verdict::Done,
            Err(CallError::Unreachable(_)) => Verdict::Retry,
            Err(CallError::Refused { status, code, item, .. }) => {
                let n = match &entry {
                    Entry::Report { items, .. } => items.len(),
                    Entry::Release { .. } => 1,
                };
                classify(*status, code, *item, n)
            }
        };
        match verdict {
            Verdict::Done => {
                app.metrics.inc("agent_outbox_sent_total", &[]);
                *state.retries.lock().unwrap() = 0;
            }
            Verdict::Retry | Verdict::Reregister => {
                if verdict == Verdict::Reregister {
                    stale(app, state, &s.owner);
                } else if let Err(CallError::Refused { status, code, message, .. }) = &result {
                    let mut r = state.retries.lock().unwrap();
                    *r = r.saturating_add(1);
                    tracing::warn!(
                        tenant,
                        resource,
                        status,
                        code,
                        message,
                        "allocator refused an outbox entry for now; retrying with backoff"
                    );
                }
                break;
            }
            Verdict::Dead => {
                let (status, code, message) = refusal(&result);
                dead_letter(app, tenant, resource, &s.owner, &raw, status, &code, &message).await;
            }
            Verdict::DeadItem(i) => {
                let Entry::Report { rid, mut items } = entry else { break };
                let bad = items.remove(i);
                let (status, code, message) = refusal(&result);
                let bad_raw = serde_json::json!({"k": "rep", "rid": rid, "items": [bad]}).to_string();
                let rest = serde_json::to_string(&Entry::Report { rid: split_id(&rid, i), items })
                    .unwrap_or_default();
                // The remainder first: a crash between the two leaves both,
                // and the old entry splits again into the same id.
                commands::outbox_push_front(&app.store, &ob, &rest).await?;
                dead_letter(app, tenant, resource, &s.owner, &bad_raw, status, &code, &message).await;
            }
        }
        commands::outbox_remove(&app.store, &ob, &raw).await?;
    }
    commands::list_len(&app.store, &ob).await
}

fn refusal(result: &Result<(), CallError>) -> (u16, String, String) {
    match result {
        Err(CallError::Refused { status, code, message, .. }) => (*status, code.clone(), message.clone()),
        _ => (0, String::new(), String::new()),
    }
}

/// A stale epoch: this agent registers again; an adopted identity is
/// dropped (the dead agent came back, or another adopter took over).
fn stale(app: &OutboxParts, state: &Outboxes, owner: &str) {
    if owner == app.settings.agent {
        app.ident.request_register();
    } else {
        state.adopted.lock().unwrap().remove(owner);
    }
}

/// Sends the collected releases (in one request when there are several)
/// and applies each answer as [`drain_list`] applies a single one: the
/// entries that may leave their lists leave; the rest stay for the next
/// round. Returns how many left.
async fn send_releases(
    app: &OutboxParts,
    state: &Outboxes,
    pending: &mut Vec<Deferred>,
) -> Result<i64, StoreError> {
    if pending.is_empty() {
        return Ok(0);
    }
    let items: Vec<ReleaseItem> = pending.iter().map(|d| d.item.clone()).collect();
    let answers = state.releases.send(&app.alloc, &items).await;
    let mut left_lists = 0;
    let mut warned = false;
    for (d, result) in pending.drain(..).zip(answers) {
        let verdict = match &result {
            Ok(()) => Verdict::Done,
            Err(CallError::Unreachable(_)) => Verdict::Retry,
            Err(CallError::Refused { status, code, item, .. }) => classify(*status, code, *item, 1),
        };
        match verdict {
            Verdict::Done => {
                app.metrics.inc("agent_outbox_sent_total", &[]);
                *state.retries.lock().unwrap() = 0;
            }
            Verdict::Reregister => {
                stale(app, state, &d.owner);
                continue;
            }
            Verdict::Retry => {
                if let (Err(CallError::Refused { status, code, message, .. }), false) = (&result, warned) {
                    warned = true;
                    let mut r = state.retries.lock().unwrap();
                    *r = r.saturating_add(1);
                    tracing::warn!(
                        tenant = %d.tenant,
                        resource = %d.resource,
                        status,
                        code,
                        message,
                        "allocator refused a lease release for now; retrying with backoff"
                    );
                }
                continue;
            }
            Verdict::Dead | Verdict::DeadItem(_) => {
                let (status, code, message) = refusal(&result);
                dead_letter(app, &d.tenant, &d.resource, &d.owner, &d.raw, status, &code, &message).await;
            }
        }
        commands::outbox_remove(&app.store, &d.list, &d.raw).await?;
        left_lists += 1;
    }
    Ok(left_lists)
}

/// Sends one entry.
async fn send(
    app: &OutboxParts,
    tenant: &str,
    resource: &str,
    s: &Sender,
    e: &Entry,
) -> Result<(), CallError> {
    match e {
        Entry::Release { id, u } => {
            app.alloc.release(id, &ReleaseRequest { epoch: s.release_epoch, unspent: *u }).await.map(|_| ())
        }
        Entry::Report { rid, items } => {
            let req = ReportRequest {
                region: app.settings.region.clone(),
                agent: s.report_agent.clone(),
                epoch: s.report_epoch,
                report_id: rid.clone(),
                items: items
                    .iter()
                    .map(|i| ReportItem {
                        tenant: tenant.to_string(),
                        resource: resource.to_string(),
                        window_start: Utc.timestamp_opt(i.window_start, 0).single().unwrap_or_default(),
                        consumed: i.consumed,
                        fallback_admitted: i.fallback_admitted,
                        shadow_refused: i.shadow_refused,
                    })
                    .collect(),
            };
            app.alloc.report(&req).await.map(|_| ())
        }
    }
}

/// Puts a refused entry on the region's dead-letter list.
#[allow(clippy::too_many_arguments)]
async fn dead_letter(
    app: &OutboxParts,
    tenant: &str,
    resource: &str,
    owner: &str,
    raw: &str,
    status: u16,
    code: &str,
    message: &str,
) {
    tracing::error!(
        tenant,
        resource,
        agent = owner,
        entry = raw,
        status,
        code,
        message,
        "allocator refused an outbox entry for good; moved to the region's dead letters"
    );
    app.metrics.inc("agent_outbox_dead_letters_total", &[]);
    let letter = serde_json::json!({
        "at": Utc::now(),
        "tenant": tenant,
        "resource": resource,
        "agent": owner,
        "entry": serde_json::from_str::<serde_json::Value>(raw).unwrap_or_else(|_| raw.into()),
        "status": status,
        "error": code,
        "message": message,
    });
    let key = app.keys.region_dead_letters(&app.settings.region);
    commands::dead_letter(&app.store, &key, &letter.to_string(), MAX_DEAD_LETTERS).await;
}

/// The region's dead letters: how many, and the newest `n`.
pub async fn dead_letters(
    store: &Store,
    keys: &Keys,
    region: &str,
    n: isize,
) -> Result<(i64, Vec<serde_json::Value>), StoreError> {
    let key = keys.region_dead_letters(region);
    let count = commands::list_len(store, &key).await?;
    if n <= 0 || count == 0 {
        return Ok((count, Vec::new()));
    }
    let recent = commands::list_page(store, &key, n).await?;
    Ok((count, recent.iter().filter_map(|r| serde_json::from_str(r).ok()).collect()))
}

/// Sends what agents of the region that are gone left in their outboxes.
/// Both layouts' agents are adopted (see [`crate::legacy`]).
async fn adopt(app: &OutboxParts, ob: &Outboxes) {
    for set in app.keys.agent_sets(&app.settings.region) {
        adopt_set(app, ob, &set).await;
    }
}

async fn adopt_set(app: &OutboxParts, ob: &Outboxes, set: &str) {
    let (region, me) = (&app.settings.region, &app.settings.agent);
    let Ok(agents) = commands::sample(&app.store, set, ADOPT_AGENTS).await else {
        return;
    };
    for dead in agents.into_iter().filter(|a| a != me) {
        if app.cancel.is_cancelled() {
            return;
        }
        match commands::is_live(&app.store, &app.keys.agent_live(region, &dead)).await {
            Ok(false) => {}
            _ => {
                ob.adopted.lock().unwrap().remove(&dead);
                continue;
            }
        }
        if let Err(e) = adopt_one(app, ob, &dead, set).await {
            tracing::debug!(agent = %dead, error = %e, "adopting a gone agent's outbox failed; next round");
            return;
        }
    }
}

async fn adopt_one(app: &OutboxParts, ob: &Outboxes, dead: &str, set: &str) -> Result<(), StoreError> {
    let region = &app.settings.region;
    let quota_set = app.keys.agent_quotas(region, dead);
    let quotas = commands::sample(&app.store, &quota_set, ADOPT_QUOTAS).await?;
    if quotas.is_empty() {
        // Its quota set expired (or it never held a quota): nothing is left.
        commands::leave(&app.store, set, dead).await?;
        ob.adopted.lock().unwrap().remove(dead);
        return Ok(());
    }
    let mut lists = Vec::new();
    for m in &quotas {
        let Some((t, r)) = m.split_once('/') else { continue };
        for prefix in app.keys.quota_prefixes(t, r) {
            let n = commands::list_len(&app.store, &Keys::outbox(&prefix, dead)).await?;
            if n > 0 {
                lists.push((prefix, t.to_string(), r.to_string()));
            }
        }
    }
    if lists.is_empty() {
        let all = commands::set_size(&app.store, &quota_set).await?;
        let quiet_since = {
            let mut a = ob.adopted.lock().unwrap();
            if a.len() >= MAX_ADOPTED && !a.contains_key(dead) {
                return Ok(());
            }
            let e = a.entry(dead.to_string()).or_insert((0, None));
            *e.1.get_or_insert_with(Instant::now)
        };
        if all as usize <= ADOPT_QUOTAS && quiet_since.elapsed() >= ADOPT_QUIET {
            commands::leave(&app.store, set, dead).await?;
            ob.adopted.lock().unwrap().remove(dead);
            tracing::info!(agent = %dead, "a gone agent's outboxes stayed empty; it left the region's agent set");
        }
        return Ok(());
    }
    let Some(epoch) = adopted_epoch(app, ob, dead).await else { return Ok(()) };
    let me = app.ident.epoch();
    if me == 0 {
        return Ok(());
    }
    let s = Sender {
        owner: dead.to_string(),
        release_epoch: epoch,
        report_agent: app.settings.agent.clone(),
        report_epoch: me,
    };
    let mut releases = Vec::new();
    for (prefix, t, r) in lists {
        let left = drain_list(app, ob, &prefix, &t, &r, &s, false, Some(&mut releases)).await?;
        tracing::info!(agent = %dead, tenant = %t, resource = %r, left, "sent a gone agent's outbox entries");
        if releases.len() >= MAX_RELEASE_BATCH {
            send_releases(app, ob, &mut releases).await?;
        }
    }
    let sent = send_releases(app, ob, &mut releases).await?;
    if sent > 0 {
        tracing::info!(agent = %dead, sent, "sent a gone agent's lease releases");
    }
    Ok(())
}

/// The epoch this agent holds for a dead agent's identity, registering for
/// it the first time.
async fn adopted_epoch(app: &OutboxParts, ob: &Outboxes, dead: &str) -> Option<i64> {
    {
        let mut a = ob.adopted.lock().unwrap();
        let full = a.len() >= MAX_ADOPTED;
        match a.get_mut(dead) {
            Some((e, quiet)) if *e > 0 => {
                *quiet = None;
                return Some(*e);
            }
            Some(_) => {}
            None if full => return None,
            None => {}
        }
    }
    match app.alloc.register(&app.settings.region, dead).await {
        Ok(r) => {
            tracing::warn!(agent = %dead, epoch = r.epoch, "adopting the outbox of a gone agent of this region");
            ob.adopted.lock().unwrap().insert(dead.to_string(), (r.epoch, None));
            Some(r.epoch)
        }
        Err(e) => {
            tracing::debug!(agent = %dead, error = %e, "cannot register for a gone agent's outbox");
            None
        }
    }
}

async fn drain_local(app: &OutboxParts, epoch: i64) -> i64 {
    let pending = app.local.pending();
    let mut left = 0;
    for p in pending {
        let req = ReportRequest {
            region: app.settings.region.clone(),
            agent: app.settings.agent.clone(),
            epoch,
            report_id: p.report_id.clone(),
            items: vec![ReportItem {
                tenant: p.tenant.clone(),
                resource: p.resource.clone(),
                window_start: Utc.timestamp_opt(p.window_start, 0).single().unwrap_or_default(),
                consumed: 0,
                fallback_admitted: p.admitted,
                shadow_refused: 0,
            }],
        };
        match app.alloc.report(&req).await {
            Ok(_) => app.local.sent(&p.report_id),
            Err(CallError::Unreachable(_)) => left += 1,
            Err(CallError::Refused { status, code, item, message }) => {
                match classify(status, &code, item, 1) {
                    Verdict::Done => app.local.sent(&p.report_id),
                    Verdict::Retry => left += 1,
                    Verdict::Reregister => {
                        app.ident.request_register();
                        left += 1;
                    }
                    Verdict::Dead | Verdict::DeadItem(_) => {
                        let raw = serde_json::json!({"k": "local", "rid": p.report_id, "window_start": p.window_start,
                        "fallback_admitted": p.admitted})
                    .to_string();
                        dead_letter(
                            app,
                            &p.tenant,
                            &p.resource,
                            &app.settings.agent,
                            &raw,
                            status,
                            &code,
                            &message,
                        )
                        .await;
                        app.local.sent(&p.report_id);
                    }
                }
            }
        }
    }
    left
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_refusals_that_cannot_change_take_an_entry_out() {
        for (status, code) in [(409, "idempotency_mismatch"), (404, "unknown_lease"), (422, "report_expired")]
        {
            assert_eq!(classify(status, code, None, 1), Verdict::Dead, "{status} {code}");
        }
        for (status, code) in [
            (401, "unauthorized"),
            (403, "wrong_region"),
            (404, "unknown"),
            (408, "unknown"),
            (413, "unknown"),
            (429, "unknown"),
            (400, "malformed_json"),
            (502, "unknown"),
        ] {
            assert_eq!(classify(status, code, None, 1), Verdict::Retry, "{status} {code}");
        }
        assert_eq!(classify(409, "stale_epoch", None, 1), Verdict::Reregister);
    }

    #[test]
    fn an_invalid_item_is_taken_out_alone() {
        assert_eq!(classify(422, "invalid_field", Some(1), 3), Verdict::DeadItem(1));
        // The only item, or an index the entry does not have: the whole entry.
        assert_eq!(classify(422, "invalid_field", Some(0), 1), Verdict::Dead);
        assert_eq!(classify(422, "invalid_field", Some(5), 3), Verdict::Dead);
        assert_eq!(classify(422, "invalid_field", None, 3), Verdict::Dead);
        assert_eq!(split_id("r1", 2), "r1.2");
        assert_eq!(split_id(&split_id("r1", 2), 0), "r1.2.0");
    }

    #[test]
    fn entries_round_trip_as_the_scripts_write_them() {
        let item = |window_start, consumed, fallback_admitted, shadow_refused| Item {
            window_start,
            consumed,
            fallback_admitted,
            shadow_refused,
        };
        let rep: Entry =
            serde_json::from_str(r#"{"k":"rep","rid":"a","items":[[60,3,1],[120,0,0,7]]}"#).unwrap();
        assert_eq!(
            rep,
            Entry::Report { rid: "a".into(), items: vec![item(60, 3, 1, 0), item(120, 0, 0, 7)] }
        );
        let text = serde_json::to_string(&rep).unwrap();
        // Without shadow refusals an item keeps the three-number form an
        // agent before shadow mode reads.
        assert!(text.contains("[60,3,1]") && text.contains("[120,0,0,7]"), "{text}");
        let back: Entry = serde_json::from_str(&text).unwrap();
        assert_eq!(back, rep);
        assert!(serde_json::from_str::<Entry>(r#"{"k":"rep","rid":"a","items":[[60,3]]}"#).is_err());
        let rel: Entry = serde_json::from_str(r#"{"k":"rel","id":"x","u":4}"#).unwrap();
        assert_eq!(rel, Entry::Release { id: "x".into(), u: 4 });
        assert!(live_ttl(Duration::from_millis(200)) >= Duration::from_secs(10));
    }
}
