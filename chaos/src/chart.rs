//! An SVG chart of per-window rows: admitted by region as stacked bars
//! (fallback admits drawn lighter on top), the limit and the bound as
//! lines, stranded tokens as a thin bar under each window.

use crate::report::WindowRow;
use std::fmt::Write as _;

const W: f64 = 900.0;
const H: f64 = 360.0;
const LEFT: f64 = 60.0;
const TOP: f64 = 30.0;
const PLOT_H: f64 = 250.0;
const COLORS: [&str; 4] = ["#3b6ea5", "#e08a2c", "#5a9e5a", "#9a5aa8"];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// The chart of `rows` for `title`, as an SVG document.
pub fn svg(title: &str, rows: &[WindowRow]) -> String {
    let regions: Vec<String> = {
        let mut r: Vec<String> = rows.iter().flat_map(|w| w.regions.keys().cloned()).collect();
        r.sort();
        r.dedup();
        r
    };
    let top =
        rows.iter().map(|w| (w.bound.max(w.limit) as f64).max(w.admitted as f64)).fold(1.0, f64::max) * 1.1;
    let y = |v: f64| TOP + PLOT_H - v / top * PLOT_H;
    let n = rows.len().max(1) as f64;
    let slot = (W - LEFT - 20.0) / n;
    let bar = (slot * 0.7).max(1.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(s, r#"<text x="{LEFT}" y="18" font-size="14">{}</text>"#, esc(title));
    for i in 0..=4 {
        let v = top / 4.0 * i as f64;
        let _ = writeln!(
            s,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#eee"/><text x="{}" y="{:.1}" text-anchor="end">{:.0}</text>"##,
            W - 20.0,
            LEFT - 4.0,
            y(v) + 4.0,
            v,
            y = y(v)
        );
    }
    for (i, w) in rows.iter().enumerate() {
        let x = LEFT + slot * i as f64 + (slot - bar) / 2.0;
        let mut acc = 0.0;
        for (ri, r) in regions.iter().enumerate() {
            let v = *w.regions.get(r).unwrap_or(&0) as f64;
            if v > 0.0 {
                let _ = writeln!(
                    s,
                    r#"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{:.1}" fill="{}"><title>{} {}: {}</title></rect>"#,
                    y(acc + v),
                    y(acc) - y(acc + v),
                    COLORS[ri % COLORS.len()],
                    esc(&w.window_start),
                    esc(r),
                    v
                );
            }
            acc += v;
        }
        if w.fallback > 0 {
            let f = w.fallback as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{:.1}" fill="white" fill-opacity="0.45" stroke="black" stroke-dasharray="2,2"><title>fallback {f}</title></rect>"#,
                y(acc),
                y(acc - f) - y(acc)
            );
        }
        for (v, color, dash) in [(w.limit, "#222", ""), (w.bound, "#c33", "6,3")] {
            let _ = writeln!(
                s,
                r#"<line x1="{:.1}" x2="{:.1}" y1="{yy:.1}" y2="{yy:.1}" stroke="{color}" stroke-width="2" stroke-dasharray="{dash}"/>"#,
                x - 2.0,
                x + bar + 2.0,
                yy = y(v as f64)
            );
        }
        if w.stranded > 0 {
            let h = (w.stranded as f64 / top * PLOT_H).max(1.0);
            let _ = writeln!(
                s,
                r##"<rect x="{x:.1}" y="{:.1}" width="{bar:.1}" height="{h:.1}" fill="#c33"><title>stranded {}</title></rect>"##,
                TOP + PLOT_H + 4.0,
                w.stranded
            );
        }
        let label = w.window_start.get(11..19).unwrap_or(&w.window_start);
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            x + bar / 2.0,
            TOP + PLOT_H + 24.0,
            esc(label)
        );
    }
    let mut lx = LEFT;
    let ly = H - 20.0;
    for (ri, r) in regions.iter().enumerate() {
        let _ = writeln!(
            s,
            r#"<rect x="{lx}" y="{}" width="10" height="10" fill="{}"/><text x="{}" y="{ly}">admitted {}</text>"#,
            ly - 9.0,
            COLORS[ri % COLORS.len()],
            lx + 14.0,
            esc(r)
        );
        lx += 110.0;
    }
    let _ = writeln!(
        s,
        r##"<line x1="{lx}" x2="{}" y1="{y0}" y2="{y0}" stroke="#222" stroke-width="2"/><text x="{}" y="{ly}">limit G</text>"##,
        lx + 18.0,
        lx + 22.0,
        y0 = ly - 4.0
    );
    lx += 80.0;
    let _ = writeln!(
        s,
        r##"<line x1="{lx}" x2="{}" y1="{y0}" y2="{y0}" stroke="#c33" stroke-width="2" stroke-dasharray="6,3"/><text x="{}" y="{ly}">bound G + Σ fallback</text>"##,
        lx + 18.0,
        lx + 22.0,
        y0 = ly - 4.0
    );
    lx += 150.0;
    let _ = writeln!(
        s,
        r##"<rect x="{lx}" y="{}" width="10" height="10" fill="white" stroke="black" stroke-dasharray="2,2"/><text x="{}" y="{ly}">fallback</text><rect x="{}" y="{}" width="10" height="10" fill="#c33"/><text x="{}" y="{ly}">stranded</text>"##,
        ly - 9.0,
        lx + 14.0,
        lx + 80.0,
        ly - 9.0,
        lx + 94.0
    );
    s.push_str("</svg>\n");
    s
}
