//! `report.json` of a bench run as one type, written by the run and read
//! back to render the docs: what is rendered is exactly what was measured.

use super::machine::Machine;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// `<target>/bench/report.json` (and its published copy,
/// `docs/reports/bench.json`). Field names and order are the file's keys.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BenchReport {
    pub command: String,
    pub argv: Vec<String>,
    pub mode: String,
    pub repetitions: usize,
    pub machine: Machine,
    pub seconds: f64,
    /// Flat dotted keys, e.g. `acquire.c16.p99_ms`.
    pub results: BTreeMap<String, f64>,
    pub targets: Vec<TargetRow>,
    pub notes: Vec<String>,
}

/// One target and whether the run met it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TargetRow {
    pub key: String,
    pub what: String,
    pub value: Option<f64>,
    pub target: String,
    pub met: bool,
}

/// Why a report could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("{path}: not a report: {source}")]
    Json { path: String, source: serde_json::Error },
}

impl BenchReport {
    /// The value of `key`, if measured.
    pub fn get(&self, key: &str) -> Option<f64> {
        self.results.get(key).copied()
    }

    /// The target row of `key`.
    pub fn target(&self, key: &str) -> Option<&TargetRow> {
        self.targets.iter().find(|t| t.key == key)
    }

    /// Reads a report file.
    pub fn read(path: &Path) -> Result<BenchReport, ReadError> {
        read_json(path)
    }
}

/// Reads a JSON file into `T`.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ReadError> {
    let shown = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|source| ReadError::Io { path: shown.clone(), source })?;
    serde_json::from_str(&text).map_err(|source| ReadError::Json { path: shown, source })
}
