//! The open-file limit: raised to the hard limit at start (a service
//! manager's usual soft limit, 1,024, is far below what the connection
//! bounds need), and the bounds fitted under what it allows.

/// File descriptors kept out of the connection bounds for everything else
/// a process holds: its Redis and PostgreSQL connections, the allocator
/// link's pool, files, the runtime's own.
pub const HEADROOM: usize = 128;

/// The open-file limits before and after [`raise`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoFile {
    /// The soft limit found at start.
    pub soft_before: u64,
    /// The soft limit in force after raising it.
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

fn get() -> std::io::Result<libc::rlimit> {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `lim` is a valid, writable rlimit for the call's duration.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(lim)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (an unlimited hard
/// limit stays as the kernel's `nr_open` would cap it: the soft limit is
/// then left as it is) and answers both.
pub fn raise() -> std::io::Result<NoFile> {
    let before = get()?;
    let target = before.rlim_max;
    if target != libc::RLIM_INFINITY && before.rlim_cur < target {
        let lim = libc::rlimit { rlim_cur: target, rlim_max: before.rlim_max };
        // SAFETY: `lim` is a valid rlimit; raising the soft limit up to the
        // hard one needs no privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let after = get()?;
    Ok(NoFile {
        soft_before: before.rlim_cur as u64,
        soft: after.rlim_cur as u64,
        hard: after.rlim_max as u64,
    })
}

/// Raises the limit and logs both values (a warning when it cannot).
pub fn raise_and_log() -> Option<NoFile> {
    match raise() {
        Ok(n) => {
            tracing::info!(soft_before = n.soft_before, soft = n.soft, hard = n.hard, "open-file limit");
            Some(n)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the open-file limit");
            None
        }
    }
}

/// Fits `bounds` (connection bounds of listeners sharing one process)
/// under `soft` minus [`HEADROOM`], lowering each in proportion when their
/// sum does not fit; answers whether any was lowered. Each keeps at least
/// [`super::MIN_CONNECTIONS`].
pub fn fit(bounds: &mut [usize], soft: u64) -> bool {
    let room = (soft as usize).saturating_sub(HEADROOM).max(super::MIN_CONNECTIONS * bounds.len());
    let sum: usize = bounds.iter().sum();
    if sum <= room {
        return false;
    }
    for b in bounds.iter_mut() {
        *b = (*b * room / sum).max(super::MIN_CONNECTIONS);
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_that_fit_stay() {
        let mut b = [1024, 256];
        assert!(!fit(&mut b, 4096));
        assert_eq!(b, [1024, 256]);
    }

    #[test]
    fn bounds_are_lowered_in_proportion_under_a_small_limit() {
        let mut b = [1024, 256];
        assert!(fit(&mut b, 1024));
        assert!(b.iter().sum::<usize>() <= 1024 - HEADROOM, "{b:?}");
        assert_eq!(b, [716, 179]);
    }

    #[test]
    fn raising_keeps_soft_at_most_hard() {
        let n = raise().expect("rlimit");
        assert!(n.soft <= n.hard && n.soft >= n.soft_before, "{n:?}");
    }
}
