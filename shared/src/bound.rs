//! The overshoot bound of invariant I6.
//!
//! For every quota and window:
//! `admitted ≤ G + Σ_regions fallback_allowance + Σ_agents local_store_fallback`.
//! Carry-over is zero because leases are clamped to their window (I2).

/// The inputs of the bound for one window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BoundInputs {
    /// The pool limit `G` in force for the window.
    pub limit: i64,
    /// Σ of the fallback allowances of the regions seen in the window.
    pub fallback_allowances: i64,
    /// Σ of the agents' opt-in local-store fallback allowances.
    pub local_store_fallback: i64,
}

impl BoundInputs {
    /// The most a window may admit.
    pub fn bound(&self) -> i64 {
        self.limit.saturating_add(self.fallback_allowances).saturating_add(self.local_store_fallback)
    }
}

/// How one window measured up against its bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// Tokens admitted beyond `G` (0 when within `G`).
    pub overshoot: i64,
    /// The bound computed from [`BoundInputs`].
    pub bound: i64,
    /// `admitted ≤ bound`.
    pub held: bool,
}

/// Compares what a window admitted with its bound.
pub fn verdict(inputs: BoundInputs, admitted: i64) -> Verdict {
    let bound = inputs.bound();
    Verdict { overshoot: (admitted - inputs.limit).max(0), bound, held: admitted <= bound }
}

/// Tokens granted to a closed window that were neither spent nor returned.
pub fn stranded(granted: i64, consumed: i64, returned: i64) -> i64 {
    (granted - consumed - returned).max(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bound_adds_fallback_allowances_to_the_limit() {
        let i = BoundInputs { limit: 1000, fallback_allowances: 200, local_store_fallback: 5 };
        assert_eq!(i.bound(), 1205);
        assert_eq!(verdict(i, 1100), Verdict { overshoot: 100, bound: 1205, held: true });
        assert_eq!(verdict(i, 1206), Verdict { overshoot: 206, bound: 1205, held: false });
        assert_eq!(verdict(i, 10), Verdict { overshoot: 0, bound: 1205, held: true });
    }

    #[test]
    fn stranded_never_negative() {
        assert_eq!(stranded(100, 60, 10), 30);
        assert_eq!(stranded(100, 100, 10), 0);
    }
}
