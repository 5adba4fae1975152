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

/// A loopback port that was free a moment ago, below the kernel's
/// ephemeral range and never handed out before by this process.
///
/// Why not `bind(0)`: that port comes from the ephemeral range, which the
/// kernel also hands to outgoing connections; between this answer and the
/// server's own bind, a connection of a test running beside it could take
/// the port (CI saw redis-server fail with "Address already in use").
/// Below the range only listeners take ports, and each of those asks here.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU16, Ordering};
    // The next candidate; 0 until the first call picks a random start, so
    // that test processes running at once start apart.
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let lo = ports::BELOW_EPHEMERAL_FROM;
    let hi = ports::ephemeral_start().saturating_sub(1).max(lo + 1);
    let span = hi - lo;
    let _ = NEXT.compare_exchange(0, lo + rand::random::<u16>() % span, Ordering::Relaxed, Ordering::Relaxed);
    for _ in 0..span {
        let port = ports::wrap(NEXT.fetch_add(1, Ordering::Relaxed), lo, hi);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    // Every port below the range is taken: the kernel's choice, as before.
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// The port range [`free_port`] draws from (pure parts, unit-tested).
mod ports {
    /// The lowest port handed out: above the well-known and most
    /// registered service ports a developer's machine may be running.
    pub const BELOW_EPHEMERAL_FROM: u16 = 20_000;

    /// The first port of the kernel's ephemeral range (Linux's default when
    /// it cannot be read).
    pub fn ephemeral_start() -> u16 {
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|s| parse_start(&s))
            .unwrap_or(32_768)
    }

    /// The first number of `ip_local_port_range`'s "<low>\t<high>".
    pub fn parse_start(s: &str) -> Option<u16> {
        s.split_whitespace().next()?.parse().ok()
    }

    /// `n` folded into `lo..hi` (the counter runs past `hi` and wraps).
    pub fn wrap(n: u16, lo: u16, hi: u16) -> u16 {
        lo + n.wrapping_sub(lo) % (hi - lo)
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_range_ends_where_the_kernels_begins() {
            assert_eq!(parse_start("32768\t60999\n"), Some(32_768));
            assert_eq!(parse_start("1024 65535"), Some(1024));
            assert_eq!(parse_start(""), None);
        }

        #[test]
        fn a_counter_past_the_range_wraps_into_it() {
            assert_eq!(wrap(20_000, 20_000, 32_767), 20_000);
            assert_eq!(wrap(32_766, 20_000, 32_767), 32_766);
            assert_eq!(wrap(32_767, 20_000, 32_767), 20_000);
            assert_eq!(wrap(65_535, 20_000, 32_767), 20_000 + (65_535 - 20_000) % 12_767);
            // The counter itself wraps past u16::MAX to 0, below `lo`.
            assert!((20_000..32_767).contains(&wrap(5, 20_000, 32_767)));
        }

        #[test]
        fn free_ports_are_below_the_ephemeral_range_and_never_repeat() {
            let got: Vec<u16> = (0..50).map(|_| crate::free_port()).collect();
            let start = ephemeral_start();
            assert!(got.iter().all(|p| *p >= BELOW_EPHEMERAL_FROM && *p < start), "{got:?}");
            let mut unique = got.clone();
            unique.sort_unstable();
            unique.dedup();
            assert_eq!(unique.len(), got.len(), "{got:?}");
        }
    }
}
