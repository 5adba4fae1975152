//! `bogus-principals` (seed 002 F14/F15/F35, game day 4): a flood of
//! distinct, never repeated principals (the acquire's `key`) against a
//! quota with a per-key bucket, the shape of an attacker who changes the
//! API key or the forwarded address on every request. The agent API has no
//! caller authentication of its own (it is a sidecar behind the gateway's,
//! DESIGN §5), so every bogus key reaches the spend script and gets a
//! bucket in the region's Redis. What must hold: each bucket carries a TTL
//! (state expires by itself, F14), Redis grows by a bounded number of bytes
//! per principal, nothing is evicted (the agents admit only on a
//! `noeviction` Redis, F15), the agent's own memory does not grow with the
//! number of principals, and the script rate per request stays at or below
//! one. Ordinary traffic on `chaos/calls` runs throughout, so the window
//! checks of every scenario apply.
//!
//! A bucket lives until it would be full again plus a minute (F04,
//! `lua/spend.lua`), so the flood's buckets are all gone a minute and a
//! refill after it: the short profile judges that from their TTLs (it
//! cannot wait a minute), the long one watches them go.

use super::harness::{Profile, Run, TENANT};
use crate::bins::Bins;
use crate::report::ScenarioReport;
use crate::stack::StackSpec;
use futures::StreamExt;
use regional_agent::keys::Keys;
use serde_json::json;
use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

/// The flooded quota (a resource of its own beside `calls`).
const ANON: &str = "anon";
/// Distinct principals of the flood (the game day's 50,000 in the long
/// profile; the short one keeps CI lean).
const PRINCIPALS_SHORT: usize = 20_000;
const PRINCIPALS_LONG: usize = 50_000;
/// Requests in flight at once (one connection each).
const CONCURRENCY: usize = 64;
/// The per-key bucket: one token, refilled in one second.
const KEY_RATE_PER_SEC: f64 = 1.0;
const KEY_BURST: i64 = 1;
/// What `lua/spend.lua` adds to a bucket's refill time for its TTL ("until
/// it would be full again, plus a minute of slack", F04).
const BUCKET_SLACK_MS: i64 = 60_000;
/// Longest one half of the flood may take: well beyond what two cores
/// need (about 4.5 s per 10,000 requests on a debug build, 12 s for a half
/// of the long profile's flood), so hitting it means the agent stalled.
const HALF_DEADLINE: Duration = Duration::from_secs(30);
/// Most bytes of Redis memory one principal may cost. Its bucket is one
/// key: the name (~95 bytes, 112 with its sds header in jemalloc's size
/// class), a small listpack hash `{t, at}` (~48), the value object (16),
/// its entries in the key and expiry dictionaries (2 × 24) and their
/// bucket arrays (~2 × 8 × 1.6): about 250 bytes, which is what runs
/// measure. 400 leaves room for the dictionaries' doubling steps while a
/// second key per principal (another ~200 bytes) would break it.
const MAX_BYTES_PER_PRINCIPAL: f64 = 400.0;
/// Most the agent's RSS may grow over the second half of the flood
/// (half the principals): the agent keeps nothing per admitted principal,
/// so that half should cost no memory (runs measure -0.03 to 0.15 MiB);
/// 1 MiB is about 105 bytes per principal of the short profile's half, so
/// a per-principal record of any real size (a map entry holding the key
/// is more) would break it.
const MAX_SECOND_HALF_RSS_MIB: f64 = 1.0;
/// Most the agent's RSS may grow over the whole flood: the first half pays
/// for the 64 connections' buffers and the runtime's warm-up (about 3 MiB
/// measured); 16 MiB would be 800 bytes per principal of the short
/// profile's 20,000.
const MAX_RSS_GROWTH_MIB: f64 = 16.0;

/// What the flood's clients saw.
#[derive(Debug, Default)]
struct Flooded {
    admitted: u64,
    /// Answers other than 200, by status (0: no answer).
    other: BTreeMap<u16, u64>,
    first_other: Option<String>,
}

/// Sends one acquire per key to `base`, `CONCURRENCY` at a time.
async fn flood(http: &reqwest::Client, base: &str, keys: &[String], out: &mut Flooded) -> Result<(), String> {
    let url = format!("{base}/v1/acquire");
    let answers = futures::stream::iter(keys.iter())
        .map(|k| {
            let body = json!({"tenant": TENANT, "resource": ANON, "key": k});
            let req = http.post(&url).json(&body);
            async move {
                match req.send().await {
                    Ok(r) => {
                        let status = r.status().as_u16();
                        // Read the body so the connection goes back to the pool.
                        let text = r.text().await.unwrap_or_default();
                        (status, text)
                    }
                    Err(e) => (0, e.to_string()),
                }
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect::<Vec<_>>();
    let answers = tokio::time::timeout(HALF_DEADLINE, answers)
        .await
        .map_err(|_| format!("{} acquires were not answered within {HALF_DEADLINE:?}", keys.len()))?;
    for (status, text) in answers {
        if status == 200 {
            out.admitted += 1;
        } else {
            *out.other.entry(status).or_insert(0) += 1;
            out.first_other.get_or_insert(format!("{status} {text}"));
        }
    }
    Ok(())
}

/// A field of `INFO <section>` as a number.
async fn info(
    conn: &mut redis::aio::MultiplexedConnection,
    section: &str,
    field: &str,
) -> Result<i64, String> {
    let text: String = redis::cmd("INFO")
        .arg(section)
        .query_async(conn)
        .await
        .map_err(|e| format!("INFO {section}: {e}"))?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().parse().ok())
        .ok_or_else(|| format!("INFO {section} has no {field}"))
}

/// How many of `keys` exist.
async fn present_buckets(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &[String],
) -> Result<usize, String> {
    Ok(pttls(conn, keys).await?.iter().filter(|t| **t != -2).count())
}

/// PTTL of each of `keys` (ms; -1 no TTL, -2 no such key), pipelined.
async fn pttls(conn: &mut redis::aio::MultiplexedConnection, keys: &[String]) -> Result<Vec<i64>, String> {
    let mut out = Vec::with_capacity(keys.len());
    for chunk in keys.chunks(1000) {
        let mut pipe = redis::pipe();
        for k in chunk {
            pipe.cmd("PTTL").arg(k);
        }
        let ttls: Vec<i64> = pipe.query_async(conn).await.map_err(|e| format!("PTTL: {e}"))?;
        out.extend(ttls);
    }
    Ok(out)
}

pub async fn bogus_principals(p: &Profile, bins: Bins) -> Result<ScenarioReport, String> {
    // One agent per region: the flood's agent is the only one whose RSS and
    // script runs are read, and fewer processes leave the two cores to it.
    let mut run = Run::start("bogus-principals", p, bins, Some(StackSpec::two_regions()), false).await?;
    let policy = json!({
        "limit": 1_000_000, "window_secs": p.window_secs,
        "per_key": {"rate_per_sec": KEY_RATE_PER_SEC, "burst": KEY_BURST},
    });
    crate::pools::put_policy(&run.stack.admin, TENANT, ANON, &policy).await?;
    run.traffic(&[("eu", 0.4), ("us", 0.3)]);
    run.pass(1.0).await;

    let region = run.stack.region("eu");
    let base = region.agents[0].base.clone();
    let pid = region.agents[0].pid().ok_or("the agent is not running")?;
    let redis_url = region.redis.url.clone();
    let quota_prefix = Keys::new(&region.redis.prefix).quota(TENANT, ANON);
    let http = quota_tests::http::client_builder()
        .pool_max_idle_per_host(CONCURRENCY)
        .timeout(Duration::from_secs(5))
        .build()
        .map_err(|e| e.to_string())?;
    let mut redis = crate::redis_conn::connect(&redis_url, Duration::from_secs(10)).await?;
    let everything = crate::redis_conn::under(&region.redis.prefix);

    // The quota learns its policy on its first acquire (one grant); the
    // flood then measures principals, not that.
    let warm = http
        .post(format!("{base}/v1/acquire"))
        .json(&json!({"tenant": TENANT, "resource": ANON, "key": "warm-up"}))
        .send()
        .await
        .map_err(|e| format!("warm-up acquire: {e}"))?;
    if warm.status() != 200 {
        return Err(format!("warm-up acquire of {TENANT}/{ANON} answered {}", warm.status()));
    }
    let policy_name: Vec<String> = redis::cmd("CONFIG")
        .arg("GET")
        .arg("maxmemory-policy")
        .query_async(&mut redis)
        .await
        .map_err(|e| format!("CONFIG GET: {e}"))?;
    run.note(format!("eu's Redis: maxmemory-policy {}", policy_name.get(1).map_or("?", |s| s.as_str())));

    let principals = if p.name == "long" { PRINCIPALS_LONG } else { PRINCIPALS_SHORT };
    let keys: Vec<String> =
        (0..principals).map(|_| format!("bogus-{}", uuid::Uuid::new_v4().simple())).collect();
    let before: HashSet<String> =
        crate::redis_conn::scan(&mut redis, &everything).await?.into_iter().collect();
    let mem0 = info(&mut redis, "memory", "used_memory").await?;
    let evicted0 = info(&mut redis, "stats", "evicted_keys").await?;
    let runs0 = crate::bench::flood::spend_runs(&http, &base).await?;
    let rss0 = crate::bench::machine::rss_mb(pid)?;

    let since = chrono::Utc::now().timestamp_millis();
    let started = Instant::now();
    let mut seen = Flooded::default();
    let (first, second) = keys.split_at(principals / 2);
    flood(&http, &base, first, &mut seen).await?;
    let rss_half = crate::bench::machine::rss_mb(pid)?;
    flood(&http, &base, second, &mut seen).await?;
    let secs = started.elapsed().as_secs_f64();
    let flood_end = Instant::now();
    let until = chrono::Utc::now().timestamp_millis();
    let rss1 = crate::bench::machine::rss_mb(pid)?;
    let runs = crate::bench::flood::spend_runs(&http, &base).await? - runs0;
    let mem1 = info(&mut redis, "memory", "used_memory").await?;
    let evicted = info(&mut redis, "stats", "evicted_keys").await? - evicted0;

    // Decisions the agent made meanwhile: the flood's and eu's ordinary
    // clients' (the metric counts runs for both quotas).
    let ordinary: Vec<_> = run.answers("eu", since).into_iter().filter(|a| a.sent_ms <= until).collect();
    let decided = principals + ordinary.len();
    let per_s = principals as f64 / secs;
    run.figure("principals", principals as f64);
    run.figure("principals_per_s", per_s);
    run.figure("script_runs_per_request", runs / decided as f64);
    run.note(format!(
        "{principals} distinct keys sent to eu's agent in {secs:.1} s ({per_s:.0}/s, {CONCURRENCY} in flight): \
         {} admitted, others {:?} (first: {:?}); {runs:.0} spend-script runs for {decided} decisions \
         ({} of them eu's ordinary clients')",
        seen.admitted,
        seen.other,
        seen.first_other,
        ordinary.len()
    ));
    run.check(
        seen.admitted == principals as u64,
        format!("every bogus principal's first request admitted (its bucket starts full): {}", seen.admitted),
    );
    run.check(
        runs <= decided as f64,
        format!("at most one spend-script run per decision: {runs:.0} runs, {decided} decisions"),
    );
    let unavailable = ordinary.iter().filter(|a| a.status >= 500 || a.status == 0).count();
    let served = ordinary.iter().filter(|a| a.status == 200).count();
    run.check(
        unavailable == 0 && served > 0,
        format!(
            "eu's ordinary clients during the flood: {served} admitted, {unavailable} unanswered or 5xx of {}",
            ordinary.len()
        ),
    );

    // Redis: the keys the flood created, their TTLs, memory, evictions.
    let after = crate::redis_conn::scan(&mut redis, &everything).await?;
    let created: Vec<String> = after.into_iter().filter(|k| !before.contains(k)).collect();
    let created_ttls = pttls(&mut redis, &created).await?;
    let without_ttl = created_ttls.iter().filter(|t| **t == -1).count();
    let buckets: Vec<String> = keys.iter().map(|k| Keys::per_key_bucket(&quota_prefix, k)).collect();
    let measured = Instant::now();
    let bucket_ttls = pttls(&mut redis, &buckets).await?;
    let present = bucket_ttls.iter().filter(|t| **t != -2).count();
    let max_ttl_ms = bucket_ttls.iter().copied().max().unwrap_or(0);
    let bytes_per = (mem1 - mem0) as f64 / principals as f64;
    run.figure("redis_keys_without_ttl", without_ttl as f64);
    run.figure("redis_bytes_per_principal", bytes_per);
    run.figure("evicted_keys", evicted as f64);
    run.note(format!(
        "eu's Redis: {} keys created during the flood ({present} of them the principals' buckets), \
         used_memory {:.1} → {:.1} MiB",
        created.len(),
        mem0 as f64 / 1048576.0,
        mem1 as f64 / 1048576.0
    ));
    run.check(evicted == 0, format!("eu's Redis evicted {evicted} keys during the flood"));
    run.check(
        without_ttl == 0,
        format!("keys created during the flood without a TTL: {without_ttl} of {}", created.len()),
    );
    run.check(present == principals, format!("a bucket in Redis for each principal: {present}"));
    run.check(
        bytes_per <= MAX_BYTES_PER_PRINCIPAL,
        format!("Redis grew {bytes_per:.0} bytes per principal (at most {MAX_BYTES_PER_PRINCIPAL})"),
    );
    // A bucket spent by one admit (cost 1) is full again after 1 / rate
    // seconds, and the script keeps it a minute longer (F04, docs/api.md):
    // the horizon by which every bucket of the flood must be gone.
    let refill_ms = (1000.0 / KEY_RATE_PER_SEC).ceil() as i64;
    let horizon_ms = refill_ms + BUCKET_SLACK_MS;
    let since_flood_ms = measured.duration_since(flood_end).as_millis() as i64;
    let gone_within_s = (max_ttl_ms + since_flood_ms) as f64 / 1000.0;
    // Buckets without a TTL or whose TTL reaches past the horizon (10 ms
    // for rounding): those left once it has passed. Nothing touches these
    // keys again, so their PTTL now is their end, and Redis never answers
    // a key past its TTL (it expires it on access).
    let outliving =
        bucket_ttls.iter().filter(|t| **t == -1 || **t + since_flood_ms > horizon_ms + 10).count();
    run.figure("principal_keys_expire_within_s", gone_within_s);
    run.check(
        outliving == 0,
        format!(
            "every principal's bucket expires within the refill time plus the script's minute ({horizon_ms} ms \
             after the flood): longest PTTL {max_ttl_ms} ms, all gone {gone_within_s:.1} s after the flood; \
             {outliving} would outlive it"
        ),
    );

    // At the refill time the buckets are full again, yet kept for the
    // script's minute: counted, so the report shows what a flood leaves in
    // memory meanwhile.
    let refilled = flood_end + Duration::from_millis(refill_ms as u64);
    tokio::time::sleep_until(refilled.into()).await;
    let at_refill = present_buckets(&mut redis, &buckets).await?;
    run.figure("principal_keys_left_at_refill", at_refill as f64);
    run.note(format!(
        "{at_refill} of {principals} buckets still in Redis {:.1} s after the flood (refill {refill_ms} ms; \
         the script keeps a full bucket for {} s more, F04)",
        flood_end.elapsed().as_secs_f64(),
        BUCKET_SLACK_MS / 1000
    ));
    let left = if p.name == "long" {
        // The long profile has the time to watch them go.
        let horizon = Duration::from_millis(horizon_ms as u64);
        let deadline = flood_end + horizon + Duration::from_secs(5);
        let mut at_horizon = None;
        let gone = loop {
            let n = present_buckets(&mut redis, &buckets).await?;
            let t = flood_end.elapsed();
            if t >= horizon {
                at_horizon.get_or_insert(n);
            }
            if n == 0 {
                break Some(t);
            }
            if Instant::now() >= deadline {
                break None;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        };
        match gone {
            Some(t) => {
                run.figure("principal_keys_gone_s", t.as_secs_f64());
                run.check(
                    t <= horizon + Duration::from_secs(2),
                    format!("the last bucket was seen gone {:.1} s after the flood", t.as_secs_f64()),
                );
            }
            None => run.check(false, format!("buckets still in Redis {deadline:?} after the flood")),
        }
        at_horizon.unwrap_or(0)
    } else {
        outliving
    };
    run.figure("principal_keys_left_after_refill", left as f64);
    run.note(format!(
        "buckets left after the refill time plus the script's minute: {left} ({})",
        if p.name == "long" {
            "seen in Redis"
        } else {
            "from their TTLs: the short profile cannot wait a minute"
        }
    ));

    let growth = rss1 - rss0;
    let second_half = rss1 - rss_half;
    run.figure("agent_rss_growth_mib", growth);
    run.figure("agent_rss_growth_second_half_mib", second_half);
    run.check(
        growth <= MAX_RSS_GROWTH_MIB,
        format!("eu's agent RSS {rss0:.1} → {rss1:.1} MiB over the flood (+{growth:.1}, at most {MAX_RSS_GROWTH_MIB})"),
    );
    run.check(
        second_half <= MAX_SECOND_HALF_RSS_MIB,
        format!(
            "eu's agent RSS grew {second_half:.2} MiB over the flood's second {} principals \
             (at most {MAX_SECOND_HALF_RSS_MIB}: nothing kept per principal)",
            principals - principals / 2
        ),
    );
    run.pass(0.5).await;
    run.finish().await
}
