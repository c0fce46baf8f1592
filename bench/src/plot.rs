//! The `--plot` SVG of `umdev bench pin`, written by hand (no plotting crate): one panel per
//! pattern (columns) and backing × policy (rows), ns/page against array size on log–log
//! axes, coalesced (solid) and per-page (dashed) medians with p10–p90 bars.

use std::fmt::Write;

use super::report::{PinCell, PinReport, VariantResult};

const PANEL_W: f64 = 190.0;
const PANEL_H: f64 = 150.0;
const GAP_X: f64 = 46.0;
const GAP_Y: f64 = 40.0;
const LEFT: f64 = 120.0;
const TOP: f64 = 92.0;
const COALESCED: &str = "#1f77b4";
const PER_PAGE: &str = "#d62728";

/// Escape text for SVG.
pub fn xml_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

fn unique<T: PartialEq + Clone>(items: impl Iterator<Item = T>) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for i in items {
        if !out.contains(&i) {
            out.push(i);
        }
    }
    out
}

/// Log-scale mapping of `[lo, hi]` onto `[a, b]`.
struct LogAxis {
    lo: f64,
    hi: f64,
    a: f64,
    b: f64,
}

impl LogAxis {
    fn map(&self, v: f64) -> f64 {
        let (l, h) = (self.lo.log10(), self.hi.log10());
        if h <= l {
            return (self.a + self.b) / 2.0;
        }
        self.a + (v.max(self.lo).log10() - l) / (h - l) * (self.b - self.a)
    }
}

fn variant_points(
    cells: &[&PinCell],
    pick: fn(&PinCell) -> Option<&VariantResult>,
) -> Vec<(f64, f64, f64, f64)> {
    cells
        .iter()
        .filter_map(|c| {
            pick(c).map(|v| {
                (
                    x_of(c),
                    v.ns_per_page.median,
                    v.ns_per_page.p10,
                    v.ns_per_page.p90,
                )
            })
        })
        .filter(|p| p.1.is_finite() && p.1 > 0.0)
        .collect()
}

/// Where a cell sits on the x axis: its array size, or for a replayed trace the mean length
/// of the arrays in its bucket.
fn x_of(c: &PinCell) -> f64 {
    if c.pattern.starts_with("trace:") {
        c.pages_per_array.max(1.0)
    } else {
        c.size as f64
    }
}

/// The SVG document for `report`.
pub fn pin_svg(report: &PinReport) -> String {
    let cells = &report.cells;
    let patterns = unique(cells.iter().map(|c| c.pattern.clone()));
    let rows = unique(cells.iter().map(|c| (c.backing, c.policy)));
    let sizes: Vec<f64> = cells.iter().map(|c| c.size as f64).collect();
    let values: Vec<f64> = cells
        .iter()
        .flat_map(|c| [&c.coalesced, &c.per_page])
        .flatten()
        .flat_map(|v| [v.ns_per_page.p10, v.ns_per_page.p90, v.ns_per_page.median])
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect();
    let x_lo = sizes.iter().copied().fold(f64::INFINITY, f64::min).max(1.0);
    let x_hi = sizes.iter().copied().fold(0.0, f64::max).max(x_lo * 2.0);
    let y_lo = 10f64.powf(
        values
            .iter()
            .copied()
            .fold(f64::INFINITY, f64::min)
            .log10()
            .floor(),
    );
    let y_hi = 10f64.powf(values.iter().copied().fold(0.0, f64::max).log10().ceil());
    let (y_lo, y_hi) = if y_lo.is_finite() && y_hi > y_lo {
        (y_lo, y_hi)
    } else {
        (1.0, 10.0)
    };
    let width = (LEFT + patterns.len().max(1) as f64 * (PANEL_W + GAP_X) + 20.0).max(800.0);
    let height = TOP + rows.len().max(1) as f64 * (PANEL_H + GAP_Y) + 20.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0}" height="{height:.0}" viewBox="0 0 {width:.0} {height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{LEFT}" y="20" font-size="14" font-weight="bold">umdev bench pin: ns per page (pin + unpin) vs array size, log–log</text>"#
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="38" fill="#555">{}</text>"##,
        xml_escape(&report.machine.summary())
    );
    let _ = writeln!(
        s,
        r##"<line x1="{x1}" y1="58" x2="{x2}" y2="58" stroke="{COALESCED}" stroke-width="2"/><text x="{t1}" y="62">coalesced (pin_pages)</text><line x1="{x3}" y1="58" x2="{x4}" y2="58" stroke="{PER_PAGE}" stroke-width="2" stroke-dasharray="5,3"/><text x="{t2}" y="62">per-page (naive)</text><text x="{t3}" y="62" fill="#777">bars: p10–p90</text>"##,
        x1 = LEFT,
        x2 = LEFT + 24.0,
        t1 = LEFT + 30.0,
        x3 = LEFT + 170.0,
        x4 = LEFT + 194.0,
        t2 = LEFT + 200.0,
        t3 = LEFT + 320.0,
    );
    for (ri, (backing, policy)) in rows.iter().enumerate() {
        let y0 = TOP + ri as f64 * (PANEL_H + GAP_Y);
        let _ = writeln!(
            s,
            r#"<text x="8" y="{:.1}" font-weight="bold">{} / {}</text>"#,
            y0 + PANEL_H / 2.0,
            xml_escape(backing),
            xml_escape(policy)
        );
        for (ci, pattern) in patterns.iter().enumerate() {
            let x0 = LEFT + ci as f64 * (PANEL_W + GAP_X);
            let xa = LogAxis {
                lo: x_lo,
                hi: x_hi,
                a: x0,
                b: x0 + PANEL_W,
            };
            let ya = LogAxis {
                lo: y_lo,
                hi: y_hi,
                a: y0 + PANEL_H,
                b: y0,
            };
            let _ = writeln!(
                s,
                r##"<rect x="{x0:.1}" y="{y0:.1}" width="{PANEL_W}" height="{PANEL_H}" fill="none" stroke="#999"/>"##,
            );
            if ri == 0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-weight="bold">{}</text>"#,
                    x0 + PANEL_W / 2.0,
                    y0 - 6.0,
                    xml_escape(pattern)
                );
            }
            // Decade grid and labels on the y axis.
            let mut d = y_lo;
            while d <= y_hi * 1.0001 {
                let y = ya.map(d);
                let _ = writeln!(
                    s,
                    r##"<line x1="{x0:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="9">{}</text>"##,
                    x0 + PANEL_W,
                    x0 - 2.0,
                    y + 3.0,
                    fmt_decade(d)
                );
                d *= 10.0;
            }
            let here: Vec<&PinCell> = cells
                .iter()
                .filter(|c| &c.pattern == pattern && c.backing == *backing && c.policy == *policy)
                .collect();
            let mut xs: Vec<f64> = unique(here.iter().map(|c| x_of(c).round() as u64))
                .into_iter()
                .map(|v| v as f64)
                .collect();
            xs.sort_by(f64::total_cmp);
            for size in xs {
                let x = xa.map(size);
                let _ = writeln!(
                    s,
                    r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="9">{size:.0}</text>"#,
                    y0 + PANEL_H + 11.0
                );
            }
            for (pick, colour, dash) in [
                (
                    (|c: &PinCell| c.coalesced.as_ref()) as fn(&PinCell) -> Option<&VariantResult>,
                    COALESCED,
                    "",
                ),
                (
                    (|c: &PinCell| c.per_page.as_ref()) as fn(&PinCell) -> Option<&VariantResult>,
                    PER_PAGE,
                    r#" stroke-dasharray="5,3""#,
                ),
            ] {
                let mut pts = variant_points(&here, pick);
                pts.sort_by(|a, b| a.0.total_cmp(&b.0));
                if pts.is_empty() {
                    continue;
                }
                let path: Vec<String> = pts
                    .iter()
                    .map(|p| format!("{:.1},{:.1}", xa.map(p.0), ya.map(p.1)))
                    .collect();
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{colour}" stroke-width="1.6"{dash}/>"#,
                    path.join(" ")
                );
                for p in &pts {
                    let (x, y) = (xa.map(p.0), ya.map(p.1));
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{x:.1}" cy="{y:.1}" r="2.2" fill="{colour}"/><line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{colour}" stroke-width="1"/>"#,
                        ya.map(p.2),
                        ya.map(p.3)
                    );
                }
            }
        }
    }
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="{:.0}" fill="#555">x: array size (pages), y: ns per page</text>"##,
        height - 6.0,
    );
    s.push_str("</svg>\n");
    s
}

fn fmt_decade(v: f64) -> String {
    if v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_xml_escape_escapes_markup() {
        assert_eq!(xml_escape("a<b&\"c\""), "a&lt;b&amp;&quot;c&quot;");
    }

    #[test]
    fn test_log_axis_maps_ends_and_middle() {
        let ax = LogAxis {
            lo: 1.0,
            hi: 100.0,
            a: 0.0,
            b: 200.0,
        };
        assert_eq!(ax.map(1.0), 0.0);
        assert!((ax.map(10.0) - 100.0).abs() < 1e-9);
        assert_eq!(ax.map(100.0), 200.0);
    }
}

#[cfg(test)]
mod report_tests {
    use super::*;
    use crate::report::{PinConfig, PinReport, PIN_SCHEMA};
    use crate::sampler::{SamplePlan, VariantSamples};

    fn cell(pattern: &str, size: usize, a: f64, b: f64) -> PinCell {
        let v = |ns: f64| {
            VariantResult::from_samples(
                &VariantSamples {
                    iters_per_sample: 1,
                    ns_per_iter: vec![ns * size as f64; 3],
                    counter_per_iter: vec![0.0; 3],
                },
                1,
                size,
            )
        };
        PinCell {
            backing: "4k",
            policy: "lock",
            pattern: pattern.into(),
            size,
            arrays: 1,
            pages_per_array: size as f64,
            runs_per_array: 1.0,
            coalesced: Some(v(a)),
            per_page: Some(v(b)),
            ratio: Some(b / a),
            ratio_paired: None,
            error: None,
        }
    }

    #[test]
    fn test_pin_svg_one_panel_per_pattern_two_lines_each() {
        let report = PinReport {
            schema: PIN_SCHEMA,
            command: vec![],
            config: PinConfig {
                sizes: vec![1, 512],
                patterns: vec!["contiguous", "scattered"],
                traces: vec![],
                policies: vec!["lock"],
                backings: vec!["4k"],
                plan: SamplePlan {
                    warmup: std::time::Duration::ZERO,
                    samples: 3,
                    sample_target: std::time::Duration::ZERO,
                    max_iters: 1,
                    cell_budget: None,
                    min_samples: 1,
                },
                seed: 0,
                quick: true,
                self_check: false,
                region_iova: 0,
                region_bytes: 0,
                trace_bucket_cap: 1,
            },
            machine: crate::machine::collect(),
            backings: vec![],
            cells: vec![
                cell("contiguous", 1, 100.0, 100.0),
                cell("contiguous", 512, 10.0, 100.0),
                cell("scat<tered", 1, 100.0, 100.0),
                cell("scat<tered", 512, 100.0, 100.0),
            ],
            elapsed_s: 0.0,
        };
        let svg = pin_svg(&report);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 4);
        assert!(svg.contains("scat&lt;tered"));
        assert!(!svg.contains("NaN"));
    }
}
