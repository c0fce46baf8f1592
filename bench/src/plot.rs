//! The `--plot` SVG of `umdev bench pin`, drawn with [`plotters`]: one panel per pattern
//! (columns) and backing × policy (rows), ns/page against array size on log–log axes,
//! coalesced (solid) and per-page (dashed) medians with p10–p90 bars.
//!
//! Every panel shares the same axes (array sizes of the run on x, whole decades of ns/page
//! on y), so panels compare at a glance. A replayed trace sits at the mean length of the
//! arrays in its bucket. [`pin_svg_from_json`] draws the plot again from a `--json` file.

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::machine::MachineInfo;
use super::report::{PinCell, VariantResult};
use crate::BenchError;

const PANEL_W: i32 = 190;
const PANEL_H: i32 = 150;
const GAP_X: i32 = 46;
const GAP_Y: i32 = 40;
const LEFT: i32 = 120;
const TOP: i32 = 92;
/// Room left of a panel for its y labels, and below it for its x labels.
const Y_LABELS_W: i32 = 40;
const X_LABELS_H: i32 = 14;
const COALESCED: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
const PER_PAGE: RGBColor = RGBColor(0xd6, 0x27, 0x28);
const FRAME: RGBColor = RGBColor(0x99, 0x99, 0x99);
const GRID: RGBColor = RGBColor(0xee, 0xee, 0xee);
const NOTE: RGBColor = RGBColor(0x55, 0x55, 0x55);

const BLACK_TEXT: RGBColor = RGBColor(0, 0, 0);
const LEGEND_NOTE: RGBColor = RGBColor(0x77, 0x77, 0x77);

/// A sans-serif font that comes out as `px` pixels in the SVG (plotters writes the size
/// divided by 1.24).
fn font(px: f64) -> FontDesc<'static> {
    ("sans-serif", px * 1.24).into_font()
}

/// Text of `px` pixels, bold or not, in `colour`, placed at its `anchor`.
fn text_style(px: f64, bold: bool, colour: &'static RGBColor, anchor: Pos) -> TextStyle<'static> {
    let f = font(px);
    let f = if bold { f.style(FontStyle::Bold) } else { f };
    TextStyle::from(f).color(colour).pos(anchor)
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

/// Where a cell sits on the x axis: its array size, or for a replayed trace the mean length
/// of the arrays in its bucket.
fn x_of(c: &PinCell) -> f64 {
    if c.pattern.starts_with("trace:") {
        c.pages_per_array.max(1.0)
    } else {
        c.size as f64
    }
}

/// (x, median, p10, p90) of one variant of `cells`, by x, clamped into the axes.
fn variant_points(
    cells: &[&PinCell],
    pick: fn(&PinCell) -> Option<&VariantResult>,
    (x_lo, x_hi): (f64, f64),
    (y_lo, y_hi): (f64, f64),
) -> Vec<(f64, f64, f64, f64)> {
    let y = |v: f64| v.clamp(y_lo, y_hi);
    let mut pts: Vec<_> = cells
        .iter()
        .filter_map(|c| {
            let v = &pick(c)?.ns_per_page;
            (v.median.is_finite() && v.median > 0.0).then(|| {
                let (p10, p90) = (finite_or(v.p10, v.median), finite_or(v.p90, v.median));
                (x_of(c).clamp(x_lo, x_hi), y(v.median), y(p10), y(p90))
            })
        })
        .collect();
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    pts
}

fn finite_or(v: f64, or: f64) -> f64 {
    if v.is_finite() && v > 0.0 {
        v
    } else {
        or
    }
}

/// The whole decades from the one below `lo` to the one above `hi`.
fn decades(lo: f64, hi: f64) -> Vec<f64> {
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    (a..=b.max(a + 1)).map(|e| 10f64.powi(e)).collect()
}

fn fmt_decade(v: &f64) -> String {
    if *v >= 1.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// The drawing surface, and what drawing on it can fail with (only a bug: it is a String).
type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type Drawn = Result<(), DrawingAreaErrorKind<std::io::Error>>;

/// Draw `text` at `at` in `style`.
fn label(root: &Area<'_>, text: &str, at: (i32, i32), style: TextStyle<'static>) -> Drawn {
    root.draw(&Text::new(text.to_string(), at, style))
}

/// What every panel shares: the patterns (columns), backing × policy (rows), the x range
/// and the y decades.
struct Layout {
    patterns: Vec<String>,
    rows: Vec<(String, String)>,
    x: (f64, f64),
    y_decades: Vec<f64>,
}

impl Layout {
    fn of(cells: &[PinCell]) -> Layout {
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
        let y_min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let y_max = values.iter().copied().fold(0.0, f64::max);
        Layout {
            patterns: unique(cells.iter().map(|c| c.pattern.clone())),
            rows: unique(cells.iter().map(|c| (c.backing.clone(), c.policy.clone()))),
            x: (x_lo, x_hi),
            y_decades: if y_min.is_finite() && y_max > 0.0 {
                decades(y_min, y_max)
            } else {
                vec![1.0, 10.0]
            },
        }
    }

    fn size(&self) -> (i32, i32) {
        let width = (LEFT + self.patterns.len().max(1) as i32 * (PANEL_W + GAP_X) + 20).max(800);
        let height = TOP + self.rows.len().max(1) as i32 * (PANEL_H + GAP_Y) + 20;
        (width, height)
    }
}

/// The SVG document for the cells of a `umdev bench pin` run on `machine`.
pub fn pin_svg(machine: &MachineInfo, cells: &[PinCell]) -> Result<String, BenchError> {
    let layout = Layout::of(cells);
    let (width, height) = layout.size();
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (width as u32, height as u32)).into_drawing_area();
        draw(&root, machine, cells, &layout)
            .and_then(|()| root.present())
            .map_err(|e| std::io::Error::other(format!("drawing the plot: {e}")))?;
    }
    svg.push('\n');
    Ok(svg)
}

fn draw(root: &Area<'_>, machine: &MachineInfo, cells: &[PinCell], layout: &Layout) -> Drawn {
    let left_mid = Pos::new(HPos::Left, VPos::Center);
    let plain = |colour| text_style(11.0, false, colour, left_mid);
    root.fill(&WHITE)?;
    label(
        root,
        "umdev bench pin: ns per page (pin + unpin) vs array size, log–log",
        (LEFT, 15),
        text_style(14.0, true, &BLACK_TEXT, left_mid),
    )?;
    label(root, &machine.summary(), (LEFT, 34), plain(&NOTE))?;
    // The legend.
    root.draw(&PathElement::new(
        vec![(LEFT, 58), (LEFT + 24, 58)],
        COALESCED.stroke_width(2),
    ))?;
    label(
        root,
        "coalesced (pin_pages)",
        (LEFT + 30, 58),
        plain(&BLACK_TEXT),
    )?;
    root.draw(&DashedPathElement::new(
        vec![(LEFT + 170, 58), (LEFT + 194, 58)],
        5,
        3,
        PER_PAGE.stroke_width(2),
    ))?;
    label(
        root,
        "per-page (naive)",
        (LEFT + 200, 58),
        plain(&BLACK_TEXT),
    )?;
    label(root, "bars: p10–p90", (LEFT + 320, 58), plain(&LEGEND_NOTE))?;

    for (ri, (backing, policy)) in layout.rows.iter().enumerate() {
        let y0 = TOP + ri as i32 * (PANEL_H + GAP_Y);
        label(
            root,
            &format!("{backing} / {policy}"),
            (8, y0 + PANEL_H / 2),
            text_style(11.0, true, &BLACK_TEXT, left_mid),
        )?;
        for (ci, pattern) in layout.patterns.iter().enumerate() {
            let x0 = LEFT + ci as i32 * (PANEL_W + GAP_X);
            if ri == 0 {
                let above = Pos::new(HPos::Center, VPos::Bottom);
                label(
                    root,
                    pattern,
                    (x0 + PANEL_W / 2, y0 - 6),
                    text_style(11.0, true, &BLACK_TEXT, above),
                )?;
            }
            let here: Vec<&PinCell> = cells
                .iter()
                .filter(|c| &c.pattern == pattern && &c.backing == backing && &c.policy == policy)
                .collect();
            panel(root, (x0, y0), &here, layout)?;
        }
    }
    let (_, height) = layout.size();
    label(
        root,
        "x: array size (pages), y: ns per page",
        (LEFT, height - 10),
        plain(&NOTE),
    )
}

/// One panel with its plotting area at `(x0, y0)`: frame, decade grid, the array sizes of
/// its cells on x, both variants.
fn panel(root: &Area<'_>, (x0, y0): (i32, i32), cells: &[&PinCell], layout: &Layout) -> Drawn {
    let (x_lo, x_hi) = layout.x;
    let y_decades = &layout.y_decades;
    let (y_lo, y_hi) = (y_decades[0], y_decades[y_decades.len() - 1]);
    let mut xs: Vec<f64> = unique(cells.iter().map(|c| x_of(c).round() as u64))
        .into_iter()
        .map(|v| (v as f64).clamp(x_lo, x_hi))
        .collect();
    xs.sort_by(f64::total_cmp);
    let area = root.clone().shrink(
        (x0 - Y_LABELS_W, y0),
        (PANEL_W + Y_LABELS_W, PANEL_H + X_LABELS_H),
    );
    let mut chart = ChartBuilder::on(&area)
        .x_label_area_size(X_LABELS_H)
        .y_label_area_size(Y_LABELS_W)
        .build_cartesian_2d(
            (x_lo..x_hi).log_scale().with_key_points(xs),
            (y_lo..y_hi).log_scale().with_key_points(y_decades.clone()),
        )?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .bold_line_style(GRID)
        // The frame is drawn below, all four sides alike; no axis lines or ticks of its own.
        .axis_style(TRANSPARENT)
        .set_all_tick_mark_size(2)
        .label_style(font(9.0))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&fmt_decade)
        .draw()?;
    root.draw(&Rectangle::new(
        [(x0, y0), (x0 + PANEL_W, y0 + PANEL_H)],
        FRAME.stroke_width(1),
    ))?;
    type Pick = fn(&PinCell) -> Option<&VariantResult>;
    let coalesced: Pick = |c| c.coalesced.as_ref();
    let per_page: Pick = |c| c.per_page.as_ref();
    for (pick, colour, dashed) in [(coalesced, COALESCED, false), (per_page, PER_PAGE, true)] {
        let pts = variant_points(cells, pick, (x_lo, x_hi), (y_lo, y_hi));
        let line = pts.iter().map(|p| (p.0, p.1));
        if dashed {
            chart.draw_series(DashedLineSeries::new(line, 5, 3, colour.stroke_width(2)))?;
        } else {
            chart.draw_series(LineSeries::new(line, colour.stroke_width(2)))?;
        }
        chart.draw_series(
            pts.iter()
                .map(|p| ErrorBar::new_vertical(p.0, p.2, p.1, p.3, colour.filled(), 4)),
        )?;
    }
    Ok(())
}

/// What [`pin_svg_from_json`] reads of a `umdev bench pin --json` file.
#[derive(serde::Deserialize)]
struct PlotInput {
    machine: MachineInfo,
    cells: Vec<PinCell>,
}

/// The SVG of a `umdev bench pin --json` file's run: the same plot `--plot` drew.
pub fn pin_svg_from_json(json: &str) -> Result<String, BenchError> {
    let input: PlotInput = serde_json::from_str(json)
        .map_err(|e| BenchError::Options(format!("not a umdev bench pin JSON report: {e}")))?;
    pin_svg(&input.machine, &input.cells)
}

#[cfg(test)]
mod tests {
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
            backing: "4k".into(),
            policy: "lock".into(),
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

    fn report(cells: Vec<PinCell>) -> PinReport {
        PinReport {
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
            cells,
            elapsed_s: 0.0,
        }
    }

    fn two_panels() -> PinReport {
        report(vec![
            cell("contiguous", 1, 100.0, 100.0),
            cell("contiguous", 512, 10.0, 100.0),
            cell("scat<tered", 1, 100.0, 100.0),
            cell("scat<tered", 512, 100.0, 100.0),
        ])
    }

    /// The text of every `<text>` element (plotters writes it on the line after the tag).
    fn texts(svg: &str) -> Vec<&str> {
        let lines: Vec<&str> = svg.lines().collect();
        lines
            .windows(2)
            .filter(|w| w[0].starts_with("<text"))
            .map(|w| w[1])
            .collect()
    }

    /// The (cx, cy) of every circle of `colour` (the medians), in drawing order.
    fn medians(svg: &str, colour: &str) -> Vec<(i32, i32)> {
        svg.lines()
            .filter(|l| l.starts_with("<circle") && l.contains(&format!("fill=\"{colour}\"")))
            .map(|l| {
                let attr = |name: &str| -> i32 {
                    let from = l.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
                    l[from..].split('"').next().unwrap().parse().unwrap()
                };
                (attr("cx"), attr("cy"))
            })
            .collect()
    }

    #[test]
    fn test_pin_svg_one_panel_per_pattern_both_variants_in_each() {
        let r = two_panels();
        let svg = pin_svg(&r.machine, &r.cells).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        // One solid coalesced line per panel; the per-page line is dashed (many pieces).
        let solid = svg
            .lines()
            .filter(|l| l.starts_with("<polyline") && l.contains("stroke=\"#1F77B4\""))
            .count();
        assert_eq!(solid, 2 + 1, "two panels and the legend");
        let dashes = svg
            .lines()
            .filter(|l| l.starts_with("<polyline") && l.contains("stroke=\"#D62728\""))
            .count();
        assert!(dashes > 2 * 4, "dashed per-page lines: {dashes} pieces");
        assert_eq!(medians(&svg, "#1F77B4").len(), 4);
        assert_eq!(medians(&svg, "#D62728").len(), 4);
        let texts = texts(&svg);
        for title in ["contiguous", "scat&lt;tered", "4k / lock"] {
            assert!(texts.contains(&title), "{title} in {texts:?}");
        }
        assert!(!svg.contains("NaN"));
    }

    /// Pixel positions agree to a pixel (plotters maps a range onto its last pixel, not
    /// one past it).
    #[track_caller]
    fn assert_near(got: i32, want: i32, what: &str) {
        assert!((got - want).abs() <= 1, "{what}: {got} vs {want}");
    }

    #[test]
    fn test_pin_svg_log_axes_place_medians_by_decade() {
        // contiguous: coalesced 100 ns/page at 1 page, 10 at 512; per-page 100 at both.
        let r = two_panels();
        let svg = pin_svg(&r.machine, &r.cells).unwrap();
        let c = medians(&svg, "#1F77B4");
        let p = medians(&svg, "#D62728");
        // First panel: x from the panel's left edge (size 1) to its right edge (size 512).
        let what = format!("{c:?} {p:?}");
        assert_near(c[0].0, LEFT, &what);
        assert_near(c[1].0, LEFT + PANEL_W, &what);
        // The y axis spans the decades 10..100 exactly: 100 at the top, 10 at the bottom.
        assert_near(c[0].1, TOP, &what);
        assert_near(c[1].1, TOP + PANEL_H, &what);
        assert_near(p[0].1, TOP, &what);
        assert_near(p[1].1, TOP, &what);
        // Each y label is a decade.
        let texts = texts(&svg);
        for label in ["10", "100"] {
            assert!(texts.contains(&label), "y label {label} in {texts:?}");
        }
        assert!(!texts.contains(&"1000"), "{texts:?}");
    }

    #[test]
    fn test_pin_svg_trace_cell_sits_at_its_mean_array_length() {
        let mut t = cell("trace:gpu", 512, 10.0, 20.0);
        t.pages_per_array = 32.0;
        let r = report(vec![
            cell("contiguous", 1, 100.0, 100.0),
            cell("contiguous", 1024, 10.0, 10.0),
            t,
        ]);
        let svg = pin_svg(&r.machine, &r.cells).unwrap();
        let c = medians(&svg, "#1F77B4");
        // Second panel, x axis 1..1024 log: 32 pages is half way.
        let x0 = LEFT + PANEL_W + GAP_X;
        assert_near(c[2].0, x0 + PANEL_W / 2, &format!("{c:?}"));
        assert!(
            texts(&svg).contains(&"32"),
            "x label at the trace's mean length"
        );
    }

    #[test]
    fn test_pin_svg_from_json_draws_what_the_report_draws() {
        let r = two_panels();
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(
            pin_svg_from_json(&json).unwrap(),
            pin_svg(&r.machine, &r.cells).unwrap()
        );
        assert!(matches!(
            pin_svg_from_json("{\"cells\": 3}"),
            Err(BenchError::Options(_))
        ));
    }
}
