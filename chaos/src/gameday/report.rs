//! The game day's report: `report.json` (one object per drill) and
//! `report.md` (the table of verdicts, the criteria, each drill's notes).

use super::drills::{self, Limit, Source};
use super::Outcome;
use serde_json::{json, Value};

/// A figure as the table shows it: whole numbers bare, large ones to one
/// decimal, others to three significant digits (a small ratio such as
/// 0.00012 keeps its digits instead of showing as 0.000).
fn num(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        let decimals = (2 - v.abs().log10().floor() as i32).clamp(3, 12) as usize;
        format!("{v:.decimals$}")
    }
}

/// The judged figures of a drill with their limits: `peak_ratio 0.52 (<= 0.6)`.
fn judged(o: &Outcome) -> String {
    o.drill
        .criteria
        .iter()
        .map(|c| {
            let v = o.figures.get(c.figure).map_or("not measured".to_string(), |v| num(*v));
            let limit = match c.limit {
                Limit::Value(l) => num(l),
                Limit::Figure(f) => o.figures.get(f).map_or(format!("{f}: not measured"), |l| num(*l)),
            };
            format!("{} {v} ({} {limit})", c.figure, if c.at_most { "<=" } else { ">=" })
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn source(o: &Outcome) -> String {
    let s = match o.drill.source {
        Source::Scenario(s) => format!("chaos `{s}`"),
        Source::Flood => "bench flood row".to_string(),
    };
    if o.drill.new {
        format!("new: {s}")
    } else {
        s
    }
}

fn verdict(o: &Outcome) -> &'static str {
    if o.pass() {
        "pass"
    } else {
        "fail"
    }
}

/// `report.json`: `[{drill, name, incidents, verdict, figures, source,
/// new, mode, seconds, notes}]` (`mode`: `quick` or `full`).
pub fn json(outcomes: &[Outcome], quick: bool) -> Value {
    Value::Array(
        outcomes
            .iter()
            .map(|o| {
                json!({
                    "drill": o.drill.n,
                    "name": o.drill.name,
                    "incidents": o.drill.incidents,
                    "verdict": verdict(o),
                    "figures": o.figures,
                    "source": match o.drill.source {
                        Source::Scenario(s) => s.to_string(),
                        Source::Flood => "bench:flood".to_string(),
                    },
                    "new": o.drill.new,
                    "mode": if quick { "quick" } else { "full" },
                    "seconds": (o.seconds * 10.0).round() / 10.0,
                    "notes": o.failed.iter().chain(&o.notes).collect::<Vec<_>>(),
                })
            })
            .collect(),
    )
}

/// The table of verdicts (Markdown, also printed).
pub fn table(outcomes: &[Outcome]) -> String {
    let mut t = String::from(
        "| # | drill | incidents | runs | verdict | judged on | s |\n|---|---|---|---|---|---|---|\n",
    );
    for o in outcomes {
        t.push_str(&format!(
            "| {} | {} | {} | {} | **{}** | {} | {:.0} |\n",
            o.drill.n,
            o.drill.name,
            o.drill.incidents.join(", "),
            source(o),
            verdict(o),
            judged(o),
            o.seconds
        ));
    }
    t
}

/// The outcomes a `report.json` holds (drills it does not know are left
/// out; the notes are not shown in the block).
fn read_back(report: &Value) -> Vec<Outcome> {
    let items = report.as_array().map(Vec::as_slice).unwrap_or_default();
    items
        .iter()
        .filter_map(|o| {
            let drill = super::drills::drill(u8::try_from(o["drill"].as_u64()?).ok()?)?;
            let figures = o["figures"]
                .as_object()
                .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_f64()?))).collect())
                .unwrap_or_default();
            Some(Outcome {
                drill,
                // The block shows verdicts only: a failed one needs no reason here.
                failed: if o["verdict"] == "pass" { Vec::new() } else { vec!["fail".to_string()] },
                figures,
                notes: Vec::new(),
                seconds: o["seconds"].as_f64().unwrap_or(0.0),
            })
        })
        .collect()
}

/// The README's game day block, from a published `report.json`.
pub fn block(report: &Value) -> String {
    let outcomes = read_back(report);
    let passed = outcomes.iter().filter(|o| o.pass()).count();
    let seconds: f64 = outcomes.iter().map(|o| o.seconds).sum();
    let mode = report.get(0).and_then(|o| o["mode"].as_str()).unwrap_or("quick");
    let command = if mode == "full" { "cargo lab gameday" } else { "cargo lab gameday --quick" };
    format!(
        "Latest published run of `{command}`: {passed} of {} drills passed, {} min {} s of drills.\n\n{}",
        outcomes.len(),
        (seconds as u64) / 60,
        (seconds as u64) % 60,
        table(&outcomes)
    )
}

/// `report.md`.
pub fn markdown(outcomes: &[Outcome], command: &str, seconds: f64) -> String {
    let passed = outcomes.iter().filter(|o| o.pass()).count();
    let mut md = format!(
        "# Game day\n\n`{command}`: {} drill(s), {passed} passed, {} failed, in {:.0} s.\n\n",
        outcomes.len(),
        outcomes.len() - passed,
        seconds
    );
    md.push_str(
        "A scenario drill passes when its chaos scenario passes (every window within the bound the policy \
         documents, nothing admitted after its window, the ledger equal to the clients' count up to requests \
         whose answer was lost, and the \
         scenario's own checks) and every criterion holds; the flood drill passes when its criteria hold.\n\n",
    );
    md.push_str(&table(outcomes));
    md.push_str("\n## Drills\n");
    for o in outcomes {
        md.push_str(&format!(
            "\n### {} {} ({})\n\n{}.\n\n",
            o.drill.n,
            o.drill.name,
            verdict(o),
            o.drill.what
        ));
        let crit: Vec<String> = o.drill.criteria.iter().map(drills::describe).collect();
        md.push_str(&format!("Criteria: {}.\n\n", crit.join("; ")));
        if !o.figures.is_empty() {
            let f: Vec<String> = o.figures.iter().map(|(k, v)| format!("`{k}` {}", num(*v))).collect();
            md.push_str(&format!("Figures: {}.\n\n", f.join(", ")));
        }
        for n in o.failed.iter().chain(&o.notes) {
            md.push_str(&format!("- {n}\n"));
        }
    }
    md
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gameday::drills::DRILLS;
    use std::collections::BTreeMap;

    fn outcome(n: usize, pass: bool, figures: &[(&str, f64)]) -> Outcome {
        Outcome {
            drill: &DRILLS[n - 1],
            figures: figures.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>(),
            failed: if pass { Vec::new() } else { vec!["FAILED criterion: x".into()] },
            notes: vec!["a note".into()],
            seconds: 12.34,
        }
    }

    #[test]
    fn the_json_names_the_drill_its_incidents_verdict_and_figures() {
        let v = json(&[outcome(3, true, &[("peak_ratio", 0.5)]), outcome(10, false, &[])], true);
        assert_eq!(v[0]["drill"], 3);
        assert_eq!(v[0]["name"], "synchronized-retry-wave");
        assert_eq!(v[0]["incidents"], serde_json::json!(["F26"]));
        assert_eq!(v[0]["verdict"], "pass");
        assert_eq!(v[0]["figures"]["peak_ratio"], 0.5);
        assert_eq!(v[1]["verdict"], "fail");
        assert_eq!(v[1]["new"], true);
    }

    #[test]
    fn figures_keep_three_significant_digits() {
        for (v, want) in [
            (1000.0, "1000"),
            (6.348471, "6.348"),
            (0.5, "0.500"),
            (0.000123456, "0.000123"),
            (123.45, "123.5"),
        ] {
            assert_eq!(num(v), want);
        }
    }

    #[test]
    fn the_block_reads_the_published_json_back() {
        let v = json(&[outcome(3, true, &[("peak_ratio", 0.5)]), outcome(10, false, &[])], true);
        let b = block(&v);
        assert!(
            b.starts_with("Latest published run of `cargo lab gameday --quick`: 1 of 2 drills passed"),
            "{b}"
        );
        assert!(b.contains("peak_ratio 0.500 (<= 0.600)") && b.contains("| 10 |"), "{b}");
    }

    #[test]
    fn the_table_shows_each_judged_figure_beside_its_limit() {
        let t = table(&[outcome(1, true, &[("admitted_over_bound_max", -200.0)])]);
        assert!(
            t.contains("| 1 | redis-primary-killed-at-peak | F10, F20 | chaos `redis-failover` | **pass** |"),
            "{t}"
        );
        assert!(t.contains("admitted_over_bound_max -200 (<= 0)"), "{t}");
        let t = table(&[outcome(3, false, &[])]);
        assert!(
            t.contains("new: chaos `retry-wave`") && t.contains("peak_ratio not measured (<= 0.600)"),
            "{t}"
        );
    }
}
