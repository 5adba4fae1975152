//! `quota-lab`: one local-stack orchestrator for the chaos suite
//! (`cargo lab chaos`), the benchmarks (`cargo lab bench`) and the demo
//! (`cargo lab demo`). It runs the real `allocator` and `regional-agent`
//! binaries over an ephemeral PostgreSQL and one ephemeral Redis per region,
//! with a fault proxy (`quota_tests::proxy`) on every link.
//!
//! * [`bins`]: building and finding the service binaries, checking servers.
//! * [`profile`]: a measuring benchmark runs only in a release build (`cargo lab` picks the profile: `lab/`).
//! * [`install`]: PostgreSQL and Redis servers: found, installed with apt-get, or the command printed.
//! * [`stack`]: starting and stopping the whole stack.
//! * [`pools`]: the policies and agent identities the bench and scenarios set up.
//! * [`pg_conn`], [`redis_conn`]: bounded connections of the lab's own to
//!   PostgreSQL and to a region's Redis (with SCAN), for checks.
//! * [`tls`]: the throwaway CA and certificates of `--tls` runs.
//! * [`traffic`]: client processes' ground truth: 200s, 429s and 503s per window.
//! * [`accounts`]: the allocator's window accounting, read over HTTP.
//! * [`report`]: per-window tables as text, Markdown and JSON.
//! * [`figures`]: the docs' figure blocks, generated from committed reports and checked.
//! * [`chart`]: the same rows as an SVG chart.
//! * [`scenarios`]: the chaos scenarios and their verdicts.
//! * [`gameday`]: seed 002's ten game days as drills over the scenarios and the flood row.
//! * [`demo`]: the one-command demo.
//! * [`envoy_front`], [`envoy_traffic`]: the demo through Envoy (`--envoy`): the Envoys and
//!   their upstream, and what the clients send them and read from their answers.
//! * [`bench`]: the benchmarks.

pub mod accounts;
pub mod bench;
pub mod bins;
pub mod chart;
pub mod demo;
mod demo_table;
pub mod envoy_front;
pub mod envoy_traffic;
pub mod figures;
pub mod gameday;
pub mod install;
pub mod pg_conn;
pub mod pools;
pub mod profile;
pub mod redis_conn;
pub mod report;
pub mod scenarios;
pub mod seen;
pub mod stack;
pub mod tls;
pub mod traffic;
