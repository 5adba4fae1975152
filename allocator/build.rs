//! Rebuilds the allocator when a migration changes: `sqlx::migrate!`
//! embeds `migrations/` at compile time, and cargo does not track that
//! directory by itself (an edited or added migration would otherwise leave
//! a binary that applies the old set).
fn main() {
    println!("cargo:rerun-if-changed=../migrations");
}
