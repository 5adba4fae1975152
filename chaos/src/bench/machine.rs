//! The machine a run measured, so a figure is never read without it:
//! numbers from a 2-core shared box and from a 32-core server differ by
//! more than any change the benchmark is meant to show.

use serde::{Deserialize, Serialize};

/// What `report.json` says about the machine.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Machine {
    pub nproc: usize,
    pub cpu_model: String,
    pub mem_total_mb: u64,
    pub kernel: String,
    pub date_utc: String,
    pub load_avg_at_start: String,
}

/// Reads `/proc` (empty strings where a file cannot be read).
pub fn describe() -> Machine {
    let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu_model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .unwrap_or_default();
    let mem_total_mb = read("/proc/meminfo")
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb / 1024)
        .unwrap_or(0);
    Machine {
        nproc: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        cpu_model,
        mem_total_mb,
        kernel: read("/proc/sys/kernel/osrelease").trim().to_string(),
        date_utc: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        load_avg_at_start: read("/proc/loadavg").split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    }
}

/// `VmRSS` of a process in MiB, from `/proc/<pid>/status`.
pub fn rss_mb(pid: u32) -> Result<f64, String> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    text.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .ok_or_else(|| format!("{path}: no VmRSS line"))
}

/// CPU time (user + system) of process `pid` so far, in µs
/// (`/proc/<pid>/stat`, clock ticks of usually 10 ms: measure over runs
/// of a second or more).
pub fn cpu_us(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name (which may hold spaces) start at ") ".
    let rest = &stat[stat.rfind(") ")? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz * 1e6)
}
