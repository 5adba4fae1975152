//! Noticing that configuration files changed, for the files the allocator
//! reloads without a restart (its TLS certificate, key and client CA, and the
//! agent tokens file).
//!
//! A file counts as changed when its modification time, length or inode
//! differ from the version last applied, so both an in-place rewrite and the
//! usual "write a new file, rename it over the old one" are seen. A reload
//! that fails (a half-written file, a key that does not match its
//! certificate) keeps what is in force and is retried at the next poll; its
//! reason is logged once, not once per poll.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

/// How often the files are polled.
pub const POLL_EVERY: Duration = Duration::from_secs(1);

/// What identifies one version of a file.
type Stamp = (SystemTime, u64, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

/// A set of files loaded together, with the versions last applied.
#[derive(Debug)]
pub struct Watched {
    what: &'static str,
    paths: Vec<PathBuf>,
    applied: Vec<Option<Stamp>>,
    last_error: Option<String>,
}

/// A version of the files seen by [`Watched::pending`], to hand back to
/// [`Watched::applied`] once it is in force.
#[derive(Debug)]
pub struct Seen(Vec<Option<Stamp>>);

impl Watched {
    /// Watches `paths` (named `what` in logs). Call [`Watched::pending`]
    /// before the first load so that a write during the load is noticed.
    pub fn new(what: &'static str, paths: Vec<PathBuf>) -> Watched {
        let applied = vec![None; paths.len()];
        Watched { what, paths, applied, last_error: None }
    }

    /// The current versions when they differ from the applied ones (or
    /// always when `force`, e.g. on SIGHUP). Taken before the files are read.
    pub fn pending(&self, force: bool) -> Option<Seen> {
        let now: Vec<_> = self.paths.iter().map(|p| stamp(p)).collect();
        (force || now != self.applied).then_some(Seen(now))
    }

    /// The version `seen` is in force now.
    pub fn applied(&mut self, seen: Seen) {
        self.applied = seen.0;
        if self.last_error.take().is_some() {
            tracing::info!(what = self.what, "reload succeeded after an earlier failure");
        }
    }

    /// A reload failed; what is in force stays. `error` must name files and
    /// lines, never their contents.
    pub fn failed(&mut self, error: String) {
        if self.last_error.as_deref() != Some(error.as_str()) {
            tracing::warn!(what = self.what, %error, "reload failed; keeping the version in force");
            self.last_error = Some(error);
        }
    }
}
