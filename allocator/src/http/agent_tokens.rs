//! Per-region agent credentials (`--agent-tokens-file`, DESIGN §5
//! Security): one `region token` pair per line, `#` comments and blank
//! lines allowed. A token from the file acts only for its region.
//!
//! Only a SHA-256 of each token is kept in memory, and a presented token is
//! hashed and compared with every entry in constant time, so neither a
//! memory dump nor response timing reveals a token. Several lines may name
//! one region (rotation: add the new token, move agents, remove the old); one
//! token may not serve two regions. The file is re-read when it changes; a
//! malformed new version is logged (line number only) and the one in force
//! stays.

use super::secret::constant_time_eq;
use crate::reload::Watched;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

#[derive(Clone)]
struct Entry {
    region: String,
    hash: [u8; 32],
}

/// The region only: even a token's hash stays out of logs.
impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry").field("region", &self.region).finish_non_exhaustive()
    }
}

fn hash(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Parses the file's text. Errors name the file and the line, never a
/// token.
fn parse(path: &Path, text: &str) -> Result<Vec<Entry>, String> {
    let mut entries: Vec<(usize, Entry)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [region, token] = fields[..] else {
            return Err(format!(
                "QUOTA_AGENT_TOKENS_FILE {} line {n}: expected two fields \"region token\", found {}",
                path.display(),
                fields.len()
            ));
        };
        // The value is not echoed: a line written "token region" would put
        // the token in the region's place.
        quota_shared::ids::validate_id(region).map_err(|e| {
            format!(
                "QUOTA_AGENT_TOKENS_FILE {} line {n}: the first field is not a region identifier ({e})",
                path.display()
            )
        })?;
        let entry = Entry { region: region.to_string(), hash: hash(token) };
        if let Some((m, other)) = entries.iter().find(|(_, e)| e.hash == entry.hash) {
            if other.region != entry.region {
                return Err(format!(
                    "QUOTA_AGENT_TOKENS_FILE {} line {n}: the token of region {region} is already the token of region {} (line {m}); each region needs its own",
                    path.display(),
                    other.region
                ));
            }
        }
        entries.push((n, entry));
    }
    Ok(entries.into_iter().map(|(_, e)| e).collect())
}

/// The per-region tokens in force, reloaded when the file changes.
pub struct AgentTokens {
    path: PathBuf,
    /// A std `RwLock`: read per request, written per reload, never held
    /// across an await.
    table: RwLock<Arc<Vec<Entry>>>,
    watched: Mutex<Watched>,
}

/// Never prints a hash: the path and how many tokens per region are enough.
impl std::fmt::Debug for AgentTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentTokens")
            .field("path", &self.path)
            .field("tokens", &self.table.read().unwrap().len())
            .finish()
    }
}

impl AgentTokens {
    /// Reads the file; a failure is a start error naming the line.
    pub fn load(path: &Path) -> Result<Arc<AgentTokens>, String> {
        let mut watched = Watched::new("agent_tokens_file", vec![path.to_path_buf()]);
        let seen = watched.pending(true).expect("forced");
        let table = Self::read(path)?;
        watched.applied(seen);
        tracing::info!(path = %path.display(), tokens = table.len(), "agent tokens file loaded");
        Ok(Arc::new(AgentTokens {
            path: path.to_path_buf(),
            table: RwLock::new(Arc::new(table)),
            watched: Mutex::new(watched),
        }))
    }

    fn read(path: &Path) -> Result<Vec<Entry>, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read QUOTA_AGENT_TOKENS_FILE {}: {e}", path.display()))?;
        parse(path, &text)
    }

    /// The region `presented` is a token of. Every entry is compared (no
    /// early exit) on hashes of equal length.
    pub fn region_of(&self, presented: &str) -> Option<String> {
        let h = hash(presented);
        let table = self.table.read().unwrap().clone();
        let mut found = None;
        for e in table.iter() {
            if constant_time_eq(&h, &e.hash) && found.is_none() {
                found = Some(e.region.clone());
            }
        }
        found
    }

    /// Re-reads the file when it changed (or always when `force`).
    pub fn reload_if_changed(&self, force: bool) {
        let mut watched = self.watched.lock().unwrap();
        let Some(seen) = watched.pending(force) else { return };
        match Self::read(&self.path) {
            Ok(table) => {
                let n = table.len();
                *self.table.write().unwrap() = Arc::new(table);
                watched.applied(seen);
                tracing::info!(path = %self.path.display(), tokens = n, "agent tokens file reloaded");
            }
            Err(e) => watched.failed(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("tokens")
    }

    #[test]
    fn parses_pairs_comments_and_blank_lines() {
        let t = parse(p(), "# regions\n\neu  tok-eu-1\nus\ttok-us\neu tok-eu-2 \n").unwrap();
        let regions: Vec<_> = t.iter().map(|e| e.region.as_str()).collect();
        assert_eq!(regions, ["eu", "us", "eu"]);
        assert_eq!(t[0].hash, hash("tok-eu-1"));
    }

    #[test]
    fn malformed_lines_name_the_line_and_never_the_token() {
        let e = parse(p(), "eu good\nus s3cr3t-token extra\n").unwrap_err();
        assert!(e.contains("line 2") && !e.contains("s3cr3t"), "{e}");
        let e = parse(p(), "# c\nlonely-s3cr3t\n").unwrap_err();
        assert!(e.contains("line 2") && !e.contains("s3cr3t"), "{e}");
        let e = parse(p(), "bad/region s3cr3t\n").unwrap_err();
        assert!(e.contains("line 1") && !e.contains("s3cr3t"), "{e}");
        let e = parse(p(), "eu s3cr3t\nus s3cr3t\n").unwrap_err();
        assert!(e.contains("line 2") && e.contains("line 1") && !e.contains("s3cr3t"), "{e}");
    }
}
