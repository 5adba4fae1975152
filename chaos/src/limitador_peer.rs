//! `limitador-peer`: the benchmark's peer, in a process of its own so that
//! only `cargo lab bench` pays for building `limitador` (its Redis storage
//! does not compile without its RocksDB storage, a long C++ build needing
//! libclang); the product and every other lab command never link it.
//!
//! One closed-loop run of `check_rate_limited_and_update` on one counter
//! limit in limitador's async Redis storage, at `--clients` concurrency for
//! `--millis`; prints the [`Sample`] as one JSON line on stdout.

use chaos::bench::hist::{closed_loop, Op, Sample};
use clap::Parser;
use futures::FutureExt;
use limitador::limit::{Context, Expression, Limit, Namespace, Predicate};
use limitador::storage::redis::AsyncRedisStorage;
use limitador::AsyncRateLimiter;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// Every Redis call gives up after this long.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Parser)]
#[command(name = "limitador-peer", about = "Benchmark peer: limitador on Redis in a closed loop")]
struct Args {
    /// Redis to keep the counter in (`redis://host:port`).
    #[arg(long)]
    redis: String,
    /// Concurrent clients.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    clients: u16,
    /// How long to drive the limiter, in milliseconds.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    millis: u64,
    /// The limit's size (large, so the counter never limits during a run).
    #[arg(long, default_value_t = 1_000_000_000)]
    limit: u64,
    /// The limit's window in seconds.
    #[arg(long, default_value_t = 86_400)]
    window_secs: u64,
    /// The limit's namespace.
    #[arg(long, default_value = "bench")]
    namespace: String,
}

async fn limiter(a: &Args) -> Result<Arc<AsyncRateLimiter>, String> {
    let storage = tokio::time::timeout(CALL_TIMEOUT, AsyncRedisStorage::new(&a.redis))
        .await
        .map_err(|_| "connecting to Redis timed out".to_string())?
        .map_err(|e| format!("connecting to Redis: {e}"))?;
    let limiter = AsyncRateLimiter::new_with_storage(Box::new(storage));
    limiter.add_limit(Limit::new(
        a.namespace.as_str(),
        a.limit,
        a.window_secs,
        Vec::<Predicate>::new(),
        Vec::<Expression>::new(),
    ));
    Ok(Arc::new(limiter))
}

fn op(limiter: Arc<AsyncRateLimiter>, namespace: &str) -> Op {
    let ns: Namespace = namespace.into();
    Arc::new(move |_, _| {
        let (limiter, ns) = (limiter.clone(), ns.clone());
        async move {
            let ctx = Context::default();
            let r = tokio::time::timeout(CALL_TIMEOUT, limiter.check_rate_limited_and_update(&ns, &ctx, 1))
                .await
                .map_err(|_| "limitador timed out".to_string())?
                .map_err(|e| format!("limitador: {e}"))?;
            if r.limited {
                Err("limitador limited".into())
            } else {
                Ok(())
            }
        }
        .boxed()
    })
}

async fn run(a: Args) -> Result<Sample, String> {
    let limiter = limiter(&a).await?;
    closed_loop(a.clients.into(), Duration::from_millis(a.millis), op(limiter, &a.namespace)).await
}

fn main() -> ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("limitador-peer: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(args)).and_then(|s| serde_json::to_string(&s).map_err(|e| e.to_string())) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("limitador-peer: {e}");
            ExitCode::FAILURE
        }
    }
}
