//! Comparing secrets (bearer tokens, token hashes) without leaking where
//! they differ through timing; used by [`super::auth`] and
//! [`super::agent_tokens`] alike.

/// Byte-wise comparison whose time depends only on the lengths: every byte
/// is visited and folded into one accumulator, with no early exit, and
/// `black_box` keeps the optimiser from turning the fold back into a
/// short-circuiting compare.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= std::hint::black_box(a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0));
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::constant_time_eq;

    #[test]
    fn constant_time_eq_compares_whole_strings() {
        assert!(constant_time_eq(b"secret", b"secret"));
        assert!(!constant_time_eq(b"secret", b"secreT"));
        assert!(!constant_time_eq(b"secret", b"secret2"));
        assert!(!constant_time_eq(b"", b"x"));
        assert!(constant_time_eq(b"", b""));
    }
}
