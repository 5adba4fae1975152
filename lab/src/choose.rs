//! The rules of `cargo lab`: the profile quota-lab runs in (a pure
//! function of the arguments, the override and which `quota-lab` builds
//! exist), and the variables a nested cargo must not inherit.

use std::time::SystemTime;

/// A cargo build profile and its directory under `target/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    Dev,
    Release,
}

impl Profile {
    pub fn dir(self) -> &'static str {
        match self {
            Profile::Dev => "debug",
            Profile::Release => "release",
        }
    }
}

/// When each profile's `quota-lab` was last built (`None`: never).
#[derive(Debug, Clone, Copy)]
pub struct Seen {
    pub dev: Option<SystemTime>,
    pub release: Option<SystemTime>,
}

/// The profile `cargo lab <args>` runs in; `Err` names a bad override.
pub fn profile(args: &[String], wanted: Option<&str>, seen: Seen) -> Result<Profile, String> {
    let bench = args.first().is_some_and(|a| a == "bench");
    let smoke = args.iter().any(|a| a == "--smoke");
    let forced = match wanted {
        None | Some("") => None,
        Some("dev" | "debug") => Some(Profile::Dev),
        Some("release") => Some(Profile::Release),
        Some(other) => return Err(format!("QUOTA_LAB_PROFILE must be `dev` or `release`, not `{other}`")),
    };
    if (bench && !smoke) || gameday_measures(args) {
        return Ok(Profile::Release);
    }
    if let Some(p) = forced {
        return Ok(p);
    }
    Ok(match (seen.dev, seen.release) {
        (Some(d), Some(r)) if d > r => Profile::Dev,
        (Some(_), None) => Profile::Dev,
        _ => Profile::Release,
    })
}

/// Whether `args` run a game day with drill 2 (the hot-tenant flood, a
/// latency measurement): every drill, or `--only 2` among those chosen.
/// Quota-lab refuses that run in a debug build, as it does a measuring
/// bench.
fn gameday_measures(args: &[String]) -> bool {
    if args.first().is_none_or(|a| a != "gameday") || args.iter().any(|a| a == "--list") {
        return false;
    }
    let mut only = Vec::new();
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        if a == "--only" {
            only.extend(it.next().cloned());
        } else if let Some(v) = a.strip_prefix("--only=") {
            only.push(v.to_string());
        }
    }
    only.is_empty() || only.iter().any(|v| v.parse::<u8>() == Ok(2))
}

/// Whether cargo sets the variable `name` for the package it builds or
/// runs (the Cargo book's "Environment variables Cargo sets for crates").
/// The launcher and quota-lab (`chaos::bins::cargo_command`) drop these
/// before a nested `cargo build`.
pub fn set_by_cargo_for_the_package(name: &str) -> bool {
    matches!(
        name,
        "CARGO_MANIFEST_DIR"
            | "CARGO_MANIFEST_PATH"
            | "CARGO_CRATE_NAME"
            | "CARGO_BIN_NAME"
            | "CARGO_PRIMARY_PACKAGE"
            | "CARGO_TARGET_TMPDIR"
            | "CARGO_RUSTC_CURRENT_DIR"
            | "OUT_DIR"
    ) || name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_BIN_EXE_")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn the_build_made_last_runs_and_release_when_there_is_none() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let t1 = t0 + Duration::from_secs(1);
        let table = [
            (None, None, Profile::Release),
            (Some(t0), None, Profile::Dev),
            (None, Some(t0), Profile::Release),
            (Some(t1), Some(t0), Profile::Dev),
            (Some(t0), Some(t1), Profile::Release),
            (Some(t0), Some(t0), Profile::Release),
        ];
        for (dev, release, want) in table {
            let got = profile(&args("demo"), None, Seen { dev, release }).unwrap();
            assert_eq!(got, want, "dev={dev:?} release={release:?}");
        }
    }

    #[test]
    fn a_measuring_bench_is_always_release_a_smoke_one_follows_the_builds() {
        let t0 = SystemTime::UNIX_EPOCH;
        let dev_only = Seen { dev: Some(t0), release: None };
        assert_eq!(profile(&args("bench --quick"), None, dev_only), Ok(Profile::Release));
        assert_eq!(profile(&args("bench"), Some("dev"), dev_only), Ok(Profile::Release));
        assert_eq!(profile(&args("bench --smoke"), None, dev_only), Ok(Profile::Dev));
        // `--smoke` elsewhere than after `bench` does not make a chaos run a bench.
        assert_eq!(profile(&args("chaos --profile short"), None, dev_only), Ok(Profile::Dev));
    }

    #[test]
    fn a_game_day_with_the_flood_drill_is_release_one_without_follows_the_builds() {
        let dev_only = Seen { dev: Some(SystemTime::UNIX_EPOCH), release: None };
        for (a, want) in [
            ("gameday", Profile::Release),
            ("gameday --quick", Profile::Release),
            ("gameday --only 2", Profile::Release),
            ("gameday --only 3 --only=2", Profile::Release),
            ("gameday --only 02", Profile::Release),
            ("gameday --quick --only 3 --only 7", Profile::Dev),
            ("gameday --list", Profile::Dev),
            ("chaos --only 2", Profile::Dev),
        ] {
            assert_eq!(profile(&args(a), None, dev_only), Ok(want), "{a}");
        }
    }

    #[test]
    fn the_package_s_variables_go_and_cargo_s_own_settings_stay() {
        for gone in ["CARGO_MANIFEST_DIR", "CARGO_PKG_NAME", "CARGO_BIN_EXE_quota-lab", "OUT_DIR"] {
            assert!(set_by_cargo_for_the_package(gone), "{gone}");
        }
        for kept in ["CARGO", "CARGO_HOME", "CARGO_TARGET_DIR", "CARGO_LOG", "PATH"] {
            assert!(!set_by_cargo_for_the_package(kept), "{kept}");
        }
    }

    #[test]
    fn the_override_wins_and_a_bad_one_is_named() {
        let none = Seen { dev: None, release: None };
        assert_eq!(profile(&args("demo"), Some("dev"), none), Ok(Profile::Dev));
        assert_eq!(profile(&args("chaos"), Some("release"), none), Ok(Profile::Release));
        assert_eq!(profile(&args("demo"), Some(""), none), Ok(Profile::Release));
        let e = profile(&args("demo"), Some("fast"), none).unwrap_err();
        assert!(e.contains("QUOTA_LAB_PROFILE") && e.contains("fast"), "{e}");
    }
}
