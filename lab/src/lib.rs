//! The rules of `cargo lab`'s launcher (see `main.rs`): which profile
//! quota-lab runs in, and which variables a nested cargo must not inherit.
//! A library too, so that quota-lab's own nested builds follow the same
//! rule (`chaos::bins`).

pub mod choose;
