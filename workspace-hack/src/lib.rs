//! `quota-hack`: no code. Every workspace crate depends on it, and it
//! depends on the third-party crates the workspace builds with the union of
//! the features any member asks for (kept by `cargo hakari generate`; `.ci/run`
//! runs `cargo hakari verify`). So `cargo build --release --bins`,
//! `cargo build -p regional-agent`, `cargo test --workspace` and `cargo lab`
//! resolve every dependency to one feature set and reuse one another's
//! artifacts instead of recompiling rustls, tokio and the workspace crates
//! whenever the package selection changes.
