//! The SVG chart of a quota's last windows: per window one bar stacked by
//! region (the fallback part of each region drawn paler), a thin red bar of
//! stranded tokens beside it, the limit as a solid step line and the I6
//! bound as a dashed one. Pure string building, so it is unit-testable and
//! needs no browser-side code.

use super::escape;
use crate::windows::WindowAccount;
use std::collections::BTreeSet;
use std::fmt::Write;

const WIDTH: f64 = 960.0;
const HEIGHT: f64 = 320.0;
const LEFT: f64 = 60.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 20.0;
const BOTTOM: f64 = 40.0;
const PALETTE: [&str; 8] =
    ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"];

/// The chart of `windows` (oldest first) as an `<svg>` element.
pub fn render(windows: &[WindowAccount]) -> String {
    let regions: Vec<&str> = windows
        .iter()
        .flat_map(|w| w.regions.keys().map(String::as_str))
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let top = windows
        .iter()
        .map(|w| w.bound.max(w.limit).max(w.admitted).max(w.stranded))
        .max()
        .unwrap_or(0)
        .max(1) as f64
        * 1.1;
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let y = |v: f64| TOP + plot_h - v / top * plot_h;
    let slot = plot_w / windows.len().max(1) as f64;
    let bar = slot * 0.6;

    let mut s = format!(
        "<svg id=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{h}\" \
         viewBox=\"0 0 {WIDTH} {h}\" role=\"img\" aria-label=\"admitted per window\">\
         <rect x=\"0\" y=\"0\" width=\"{WIDTH}\" height=\"{h}\" fill=\"#fff\"/>",
        h = HEIGHT + 30.0
    );
    // Axes and a few horizontal grid lines with their values.
    for i in 0..=4 {
        let v = top / 1.1 * i as f64 / 4.0;
        let _ = write!(
            s,
            "<line x1=\"{LEFT}\" x2=\"{x2}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#eee\"/>\
             <text x=\"{tx}\" y=\"{ty:.1}\" font-size=\"11\" text-anchor=\"end\">{v:.0}</text>",
            x2 = WIDTH - RIGHT,
            yy = y(v),
            tx = LEFT - 6.0,
            ty = y(v) + 4.0
        );
    }
    let _ = write!(
        s,
        "<line x1=\"{LEFT}\" x2=\"{LEFT}\" y1=\"{TOP}\" y2=\"{b}\" stroke=\"#444\"/>\
         <line x1=\"{LEFT}\" x2=\"{r}\" y1=\"{b}\" y2=\"{b}\" stroke=\"#444\"/>",
        b = TOP + plot_h,
        r = WIDTH - RIGHT
    );
    let mut limit_pts = String::new();
    let mut bound_pts = String::new();
    for (i, w) in windows.iter().enumerate() {
        let x0 = LEFT + slot * i as f64;
        let bx = x0 + (slot - bar) / 2.0;
        let mut base = 0.0;
        for (ri, r) in regions.iter().enumerate() {
            let Some(a) = w.regions.get(*r) else { continue };
            let color = PALETTE[ri % PALETTE.len()];
            for (part, v, opacity) in [("lease", a.consumed, 1.0), ("fallback", a.fallback_admitted, 0.45)] {
                if v <= 0 {
                    continue;
                }
                let (y1, y0) = (y(base + v as f64), y(base));
                let _ = write!(
                    s,
                    "<rect class=\"admitted\" x=\"{bx:.1}\" y=\"{y1:.1}\" width=\"{bar:.1}\" height=\"{h:.1}\" \
                     fill=\"{color}\" fill-opacity=\"{opacity}\"><title>{r} {part}: {v}</title></rect>",
                    h = (y0 - y1).max(0.5),
                    r = escape(r),
                );
                base += v as f64;
            }
        }
        if w.stranded > 0 {
            let sx = bx + bar + 2.0;
            let _ = write!(
                s,
                "<rect class=\"stranded\" x=\"{sx:.1}\" y=\"{y1:.1}\" width=\"{sw:.1}\" height=\"{h:.1}\" \
                 fill=\"#d62728\"><title>stranded: {v}</title></rect>",
                y1 = y(w.stranded as f64),
                sw = (slot - bar) / 2.0 - 3.0,
                h = (y(0.0) - y(w.stranded as f64)).max(0.5),
                v = w.stranded,
            );
        }
        let (xa, xb) = (x0, x0 + slot);
        let _ = write!(limit_pts, "{xa:.1},{ly:.1} {xb:.1},{ly:.1} ", ly = y(w.limit as f64));
        let _ = write!(bound_pts, "{xa:.1},{by:.1} {xb:.1},{by:.1} ", by = y(w.bound as f64));
        let _ = write!(
            s,
            "<text x=\"{tx:.1}\" y=\"{ty}\" font-size=\"10\" text-anchor=\"middle\">{label}</text>",
            tx = x0 + slot / 2.0,
            ty = TOP + plot_h + 14.0,
            label = escape(&w.window_start.format("%H:%M:%S").to_string()),
        );
    }
    let _ = write!(
        s,
        "<polyline class=\"limit\" points=\"{}\" fill=\"none\" stroke=\"#000\" stroke-width=\"2\"/>\
         <polyline class=\"bound\" points=\"{}\" fill=\"none\" stroke=\"#d62728\" stroke-width=\"1.5\" \
         stroke-dasharray=\"6 4\"/>",
        limit_pts.trim_end(),
        bound_pts.trim_end()
    );
    // Legend: (swatch kind, colour, label), laid out left to right.
    let mut legend: Vec<(&str, &str, String)> =
        vec![("line", "#000", "limit".to_string()), ("dash", "#d62728", "bound".to_string())];
    for (ri, r) in regions.iter().enumerate() {
        legend.push(("box", PALETTE[ri % PALETTE.len()], format!("{r} (paler: fallback)")));
    }
    legend.push(("box", "#d62728", "stranded".to_string()));
    let ly = HEIGHT + 10.0;
    let mut lx = LEFT;
    for (kind, color, label) in legend {
        let swatch = match kind {
            "box" => format!("<rect x=\"{lx}\" y=\"{ly}\" width=\"14\" height=\"12\" fill=\"{color}\"/>"),
            _ => format!(
                "<line x1=\"{lx}\" x2=\"{x2}\" y1=\"{yy}\" y2=\"{yy}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>",
                x2 = lx + 14.0,
                yy = ly + 6.0,
                dash = if kind == "dash" { " stroke-dasharray=\"4 2\"" } else { "" },
            ),
        };
        let _ = write!(
            s,
            "{swatch}<text x=\"{tx}\" y=\"{ty}\" font-size=\"12\">{}</text>",
            escape(&label),
            tx = lx + 18.0,
            ty = ly + 10.0
        );
        lx += 30.0 + 7.0 * label.len() as f64;
    }
    s.push_str("</svg>");
    s
}

#[cfg(test)]
mod tests {
    use super::render;
    use crate::windows::{RegionAccount, WindowAccount};
    use chrono::{TimeZone, Utc};
    use std::collections::BTreeMap;

    #[test]
    fn chart_escapes_region_names_and_draws_every_series() {
        let mut regions = BTreeMap::new();
        regions.insert(
            "<eu>".to_string(),
            RegionAccount { consumed: 10, fallback_admitted: 5, admitted: 15, ..Default::default() },
        );
        let w = WindowAccount {
            window_start: Utc.timestamp_opt(0, 0).unwrap(),
            window_end: Utc.timestamp_opt(60, 0).unwrap(),
            window_secs: 60,
            closed: true,
            limit: 100,
            granted: 30,
            returned: 0,
            consumed: 10,
            fallback_admitted: 5,
            fallback_repaid: 0,
            shadow_refused: 0,
            admitted: 15,
            overshoot: 0,
            bound: 110,
            bound_held: true,
            stranded: 20,
            regions,
        };
        let svg = render(&[w]);
        assert!(!svg.contains("<eu>"), "{svg}");
        assert!(svg.contains("&lt;eu&gt; fallback: 5"));
        for class in ["admitted", "stranded", "limit", "bound"] {
            assert!(svg.contains(&format!("class=\"{class}\"")), "{class}");
        }
    }
}
