//! The test harness: real PostgreSQL and Redis servers, the allocator in
//! process, and a small HTTP client.
//!
//! # Layout
//!
//! * [`pg`]: an ephemeral PostgreSQL per test (initdb once per process into a
//!   template, copied per test, free loopback port, run as an unprivileged
//!   user when the tests run as root), or `DATABASE_URL` with a fresh
//!   database per test, or a Docker container when neither is possible.
//! * [`redis`]: an ephemeral `redis-server` per test (no persistence, extra
//!   arguments on demand), or `REDIS_URL` with a key prefix per test.
//! * [`redis_cluster`]: an ephemeral local 3-master Redis Cluster per test.
//! * [`sentinel`]: an ephemeral primary, replica and Sentinel per test.
//! * [`procs`]: child processes that die with the test, also on panic.
//! * [`proxy`]: the fault proxy on a link (pass, blackhole, refuse, latency,
//!   lost replies; a load balancer over several upstreams).
//! * [`promtool`]: Prometheus' checker for rules, rule tests and scrapes.
//! * [`app`]: the allocator started in process on a free port.
//! * [`allocator_proc`]: the `allocator` binary as a real process (start,
//!   wait ready, stop, restart on the same port).
//! * [`agent`]: the `regional-agent` binary as a real process.
//! * [`http`]: a JSON client that returns status, headers and body.
//! * [`listeners`]: slow, idle and crowding clients for the listener limits.
//! * [`fixtures`]: allocator API helpers (policy, register, grant, pool rows).
//! * [`wait`]: polling a condition with a deadline instead of sleeping.
//! * [`clock`]: one shifted clock for the allocator and the agents of a
//!   test, so its windows start when it wants, not at a real boundary.
//! * [`tls`]: certificates made per test (rcgen) and a rustls probe client.
//! * [`chromium`]: headless Chromium rendering the `/ui` pages.

pub mod agent;
pub mod allocator_proc;
pub mod app;
pub mod chromium;
pub mod clock;
pub mod db;
pub mod envoy;
pub mod fixtures;
pub mod http;
pub mod listeners;
pub mod patroni;
pub mod pg;
pub mod procs;
pub mod promtool;
pub mod proxy;
pub mod redis;
pub mod redis_cluster;
pub mod sentinel;
pub mod tls;
pub mod wait;

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}
