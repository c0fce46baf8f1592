//! Results of `umdev bench pin` as data (serialized to `--json`) and as a terminal table.

use std::io::Write;
use std::path::Path;

use super::machine::{self, MachineInfo};
use super::sampler::{SamplePlan, VariantSamples};
use super::stats::{summarize, Summary};
use super::table::{fmt_ns, Table};
use super::OutputArgs;

/// Version tag of the JSON layout.
pub const PIN_SCHEMA: &str = "umdev-bench-pin/1";

/// One variant (coalesced or per-page) of one cell.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct VariantResult {
    /// Iterations timed together per sample (one iteration pins and unpins every array).
    pub iters_per_sample: u64,
    /// Every kept sample, in ns per page (pin + unpin).
    pub samples_ns_per_page: Vec<f64>,
    /// Median and spread of `samples_ns_per_page`.
    pub ns_per_page: Summary,
    /// Median ns per array (pin + unpin).
    pub ns_per_array: f64,
    /// Median residency syscalls (mlock/munlock/madvise) per array, pin + unpin.
    pub syscalls_per_array: f64,
}

impl VariantResult {
    /// From raw samples of iterations of `arrays` arrays holding `pages` pages in all.
    pub fn from_samples(s: &VariantSamples, arrays: usize, pages: usize) -> VariantResult {
        let pages = pages.max(1) as f64;
        let arrays = arrays.max(1) as f64;
        let per_page: Vec<f64> = s.ns_per_iter.iter().map(|ns| ns / pages).collect();
        let ns_per_page = summarize(&per_page);
        let sys = summarize(&s.counter_per_iter).median / arrays;
        VariantResult {
            iters_per_sample: s.iters_per_sample,
            samples_ns_per_page: per_page,
            ns_per_array: ns_per_page.median * pages / arrays,
            ns_per_page,
            syscalls_per_array: sys,
        }
    }
}

/// One measured combination of backing × policy × pattern × size.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PinCell {
    /// Page backing name.
    pub backing: String,
    /// Pin policy name.
    pub policy: String,
    /// Pattern name (`trace:NAME` for a replayed trace).
    pub pattern: String,
    /// Array size (for a trace: the size bucket, arrays of length ≤ size and > the next
    /// smaller configured size).
    pub size: usize,
    /// Arrays pinned per iteration (1 for synthetic patterns).
    pub arrays: usize,
    /// Mean pages per array.
    pub pages_per_array: f64,
    /// Mean maximal runs of consecutive pages per array.
    pub runs_per_array: f64,
    /// `DmaHandle::pin_pages` + `unpin_pages`.
    pub coalesced: Option<VariantResult>,
    /// `DmaHandle::naive().pin_pages` + `unpin_pages`.
    pub per_page: Option<VariantResult>,
    /// Median per-page ns / median coalesced ns (> 1: coalescing is faster).
    pub ratio: Option<f64>,
    /// Per-page / coalesced of each pair of samples taken back to back (sample i of both
    /// variants). Its median is the ratio the table shows (robust to drift between pairs);
    /// its spread says how sure the ratio is on this machine.
    pub ratio_paired: Option<Summary>,
    /// Why the cell has no result.
    pub error: Option<String>,
}

/// Whether a backing was measured or skipped.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BackingStatus {
    /// Backing name.
    pub backing: &'static str,
    /// True if its cells were measured.
    pub measured: bool,
    /// What was obtained, or why it was skipped.
    pub note: String,
}

/// A replayed trace file.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TraceInfo {
    /// Pattern name (`trace:NAME`).
    pub name: String,
    /// The file.
    pub path: String,
    /// Pin calls in the file.
    pub arrays: usize,
    /// Pages in all calls.
    pub pages: usize,
    /// Pages the renumbered trace spans in the bench region.
    pub span_pages: u64,
}

/// The configuration a run used.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PinConfig {
    /// Array sizes.
    pub sizes: Vec<usize>,
    /// Synthetic pattern names.
    pub patterns: Vec<&'static str>,
    /// Replayed traces.
    pub traces: Vec<TraceInfo>,
    /// Policy names.
    pub policies: Vec<&'static str>,
    /// Requested backings.
    pub backings: Vec<&'static str>,
    /// Sampling plan.
    pub plan: SamplePlan,
    /// Pattern seed.
    pub seed: u64,
    /// `--quick`.
    pub quick: bool,
    /// `--self-check`: both sides ran the coalesced path.
    pub self_check: bool,
    /// IOVA of the bench region.
    pub region_iova: u64,
    /// Size of the bench region in bytes.
    pub region_bytes: u64,
    /// Most arrays of one trace bucket replayed per iteration.
    pub trace_bucket_cap: usize,
}

/// Everything `umdev bench pin --json` writes.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PinReport {
    /// [`PIN_SCHEMA`].
    pub schema: &'static str,
    /// The command line.
    pub command: Vec<String>,
    /// Configuration.
    pub config: PinConfig,
    /// Machine and build.
    pub machine: MachineInfo,
    /// Measured and skipped backings.
    pub backings: Vec<BackingStatus>,
    /// Every cell with every sample.
    pub cells: Vec<PinCell>,
    /// Wall time of the run in seconds.
    pub elapsed_s: f64,
}

/// Print a finished run the way every bench does: a header naming the bench and the machine
/// (unless `--quiet`), the table, and the `--json` file written. The caller adds its own
/// lines (the plot) and then the elapsed time.
pub fn print_report(
    bench: &str,
    out: &OutputArgs,
    machine: &MachineInfo,
    table: &str,
    report: &impl serde::Serialize,
) -> std::io::Result<()> {
    if !out.quiet {
        println!("umdev bench {bench} — {}", machine.summary());
    }
    print!("{table}");
    if let Some(path) = &out.json {
        write_json(path, report)?;
        println!("JSON: {}", path.display());
    }
    Ok(())
}

/// Write any report as pretty JSON to `path`.
pub fn write_json(path: &Path, report: &impl serde::Serialize) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    serde_json::to_writer_pretty(&mut f, report).map_err(std::io::Error::other)?;
    writeln!(f)?;
    f.flush()
}

/// Summary of the ratios per-page / coalesced of samples taken back to back.
pub fn paired_ratio(coalesced: &VariantResult, per_page: &VariantResult) -> Summary {
    let ratios: Vec<f64> = coalesced
        .samples_ns_per_page
        .iter()
        .zip(&per_page.samples_ns_per_page)
        .filter(|(a, _)| **a > 0.0)
        .map(|(a, b)| b / a)
        .collect();
    summarize(&ratios)
}

fn spread(s: &Summary) -> String {
    format!("{}–{}", fmt_ns(s.p10), fmt_ns(s.p90))
}

fn fmt_sys(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The terminal table of a pin report: one block per backing × policy.
pub fn pin_table(report: &PinReport) -> String {
    let mut out = String::new();
    let mut blocks: Vec<(&str, &str)> = Vec::new();
    for c in &report.cells {
        let block = (c.backing.as_str(), c.policy.as_str());
        if !blocks.contains(&block) {
            blocks.push(block);
        }
    }
    for (backing, policy) in blocks {
        out.push_str(&format!(
            "\nbacking {backing}, policy {policy}: ns per page (pin + unpin), median and p10–p90\n"
        ));
        let mut t = Table::new(&[
            "pattern",
            ">size",
            ">runs",
            ">coalesced",
            ">p10–p90",
            ">per-page",
            ">p10–p90",
            ">ratio",
            ">paired IQR",
            ">syscalls/array",
        ]);
        for c in report
            .cells
            .iter()
            .filter(|c| c.backing == backing && c.policy == policy)
        {
            let runs = if c.runs_per_array.fract() == 0.0 {
                format!("{:.0}", c.runs_per_array)
            } else {
                format!("{:.1}", c.runs_per_array)
            };
            let size = if c.pattern.starts_with("trace:") {
                format!("≤{} ({:.1})", c.size, c.pages_per_array)
            } else {
                c.size.to_string()
            };
            match (&c.coalesced, &c.per_page, &c.error) {
                (Some(a), Some(b), None) => t.row(vec![
                    c.pattern.clone(),
                    size,
                    runs,
                    fmt_ns(a.ns_per_page.median),
                    spread(&a.ns_per_page),
                    fmt_ns(b.ns_per_page.median),
                    spread(&b.ns_per_page),
                    c.ratio_paired
                        .map(|r| r.median)
                        .or(c.ratio)
                        .map_or("-".into(), |r| format!("{r:.2}×")),
                    c.ratio_paired
                        .map_or("-".into(), |r| format!("{:.2}–{:.2}", r.p25, r.p75)),
                    format!(
                        "{} / {}",
                        fmt_sys(a.syscalls_per_array),
                        fmt_sys(b.syscalls_per_array)
                    ),
                ]),
                (_, _, err) => t.row(vec![
                    c.pattern.clone(),
                    size,
                    runs,
                    format!("error: {}", err.as_deref().unwrap_or("no result")),
                ]),
            }
        }
        out.push_str(&t.render());
    }
    for b in report.backings.iter().filter(|b| !b.measured) {
        out.push_str(&format!("\nskipped {}: {}\n", b.backing, b.note));
    }
    out.push_str(
        "\nratio = per-page / coalesced (> 1: coalescing is faster), the median over pairs of \
         samples taken back to back; paired IQR = its p25–p75; syscalls = coalesced / per-page per array\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_variant_result_divides_by_pages_and_arrays() {
        let s = VariantSamples {
            iters_per_sample: 10,
            ns_per_iter: vec![1000.0, 2000.0, 3000.0],
            counter_per_iter: vec![4.0, 4.0, 4.0],
        };
        let r = VariantResult::from_samples(&s, 2, 100);
        assert_eq!(r.ns_per_page.median, 20.0);
        assert_eq!(r.samples_ns_per_page, vec![10.0, 20.0, 30.0]);
        assert_eq!(r.ns_per_array, 1000.0);
        assert_eq!(r.syscalls_per_array, 2.0);
    }
}

/// Version tag of the JSON layout of `bench dma` and `bench wire`.
pub const PAIR_SCHEMA: &str = "umdev-bench-pair/1";

/// One side of an A/B comparison.
#[derive(Clone, Debug, serde::Serialize)]
pub struct SideResult {
    /// What was timed.
    pub name: String,
    /// Operations timed together per sample.
    pub iters_per_sample: u64,
    /// Every kept sample, ns per operation.
    pub samples_ns: Vec<f64>,
    /// Median and spread of `samples_ns`.
    pub ns: Summary,
}

impl SideResult {
    /// From raw samples.
    pub fn new(name: &str, s: &VariantSamples) -> SideResult {
        SideResult {
            name: name.to_string(),
            iters_per_sample: s.iters_per_sample,
            samples_ns: s.ns_per_iter.clone(),
            ns: summarize(&s.ns_per_iter),
        }
    }
}

/// An A/B comparison at one size, sampled interleaved.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PairRow {
    /// What is compared (e.g. `read: dma_rw vs memcpy`).
    pub group: String,
    /// Bytes per operation.
    pub size_bytes: u64,
    /// The side under test.
    pub a: SideResult,
    /// The reference side.
    pub b: SideResult,
    /// Median of `a` / median of `b` (time ratio: > 1 means `a` is slower).
    pub ratio_a_over_b: f64,
    /// `a` / `b` of each pair of samples taken back to back; the table shows its median
    /// (robust to drift between pairs) and p25–p75.
    pub ratio_paired: Summary,
}

impl PairRow {
    /// A row from two sides.
    pub fn new(group: &str, size_bytes: u64, a: SideResult, b: SideResult) -> PairRow {
        let ratio_a_over_b = if b.ns.median > 0.0 {
            a.ns.median / b.ns.median
        } else {
            f64::NAN
        };
        let paired: Vec<f64> = a
            .samples_ns
            .iter()
            .zip(&b.samples_ns)
            .filter(|(_, y)| **y > 0.0)
            .map(|(x, y)| x / y)
            .collect();
        PairRow {
            group: group.to_string(),
            size_bytes,
            a,
            b,
            ratio_a_over_b,
            ratio_paired: summarize(&paired),
        }
    }
}

/// Everything `umdev bench dma|wire --json` writes.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PairReport {
    /// [`PAIR_SCHEMA`].
    pub schema: &'static str,
    /// `dma` or `wire`.
    pub bench: &'static str,
    /// The command line.
    pub command: Vec<String>,
    /// Sampling plan.
    pub plan: SamplePlan,
    /// Machine and build.
    pub machine: MachineInfo,
    /// Every comparison with every sample.
    pub rows: Vec<PairRow>,
    /// Rows that could not be measured, and why.
    pub unavailable: Vec<String>,
    /// What each side means.
    pub notes: Vec<String>,
    /// Wall time of the run in seconds.
    pub elapsed_s: f64,
}

impl PairReport {
    /// The report of `bench` (`dma` or `wire`) started at `started`: its rows, what each
    /// side means, the machine and the command line.
    pub fn new(
        bench: &'static str,
        plan: SamplePlan,
        rows: Vec<PairRow>,
        notes: Vec<String>,
        started: std::time::Instant,
    ) -> PairReport {
        PairReport {
            schema: PAIR_SCHEMA,
            bench,
            command: std::env::args().collect(),
            plan,
            machine: machine::collect(),
            rows,
            unavailable: Vec::new(),
            notes,
            elapsed_s: started.elapsed().as_secs_f64(),
        }
    }
}

/// A byte count as `8 B`, `4 KiB`, `16 MiB`, `1 GiB`.
pub fn fmt_bytes(v: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    let mut x = v;
    while x >= 1024 && x.is_multiple_of(1024) && unit < UNITS.len() - 1 {
        x /= 1024;
        unit += 1;
    }
    format!("{x} {}", UNITS[unit])
}

/// The terminal table of a pair report: one block per group; `throughput` adds a GB/s
/// column (bytes per operation / time), meaningful for copies only.
pub fn pair_table(report: &PairReport, throughput: bool) -> String {
    let mut out = String::new();
    let groups = {
        let mut g: Vec<&str> = Vec::new();
        for r in &report.rows {
            if !g.contains(&r.group.as_str()) {
                g.push(&r.group);
            }
        }
        g
    };
    for group in groups {
        let rows: Vec<&PairRow> = report.rows.iter().filter(|r| r.group == group).collect();
        let (an, bn) = (&rows[0].a.name, &rows[0].b.name);
        out.push_str(&format!(
            "\n{group}: ns per operation, median and p10–p90\n"
        ));
        let (ah, bh) = (format!(">{an}"), format!(">{bn}"));
        let mut headers = vec![
            ">size",
            &ah,
            ">p10–p90",
            &bh,
            ">p10–p90",
            ">ratio",
            ">paired IQR",
        ];
        if throughput {
            headers.push(">GB/s");
        }
        let mut t = Table::new(&headers);
        for r in rows {
            let gbs = if r.a.ns.median > 0.0 && r.size_bytes > 0 {
                format!(
                    "{:.2} / {:.2}",
                    r.size_bytes as f64 / r.a.ns.median,
                    r.size_bytes as f64 / r.b.ns.median
                )
            } else {
                "-".into()
            };
            let mut row = vec![
                fmt_bytes(r.size_bytes),
                fmt_ns(r.a.ns.median),
                spread(&r.a.ns),
                fmt_ns(r.b.ns.median),
                spread(&r.b.ns),
                format!("{:.2}×", r.ratio_paired.median),
                format!("{:.2}–{:.2}", r.ratio_paired.p25, r.ratio_paired.p75),
            ];
            if throughput {
                row.push(gbs);
            }
            t.row(row);
        }
        out.push_str(&t.render());
    }
    for u in &report.unavailable {
        out.push_str(&format!("\nnot available: {u}\n"));
    }
    out.push_str(
        "\nratio = left / right time (> 1: the left side is slower), the median over pairs of \
         samples taken back to back; paired IQR = its p25–p75\n",
    );
    out
}

#[cfg(test)]
mod pair_tests {
    use super::*;

    #[test]
    fn test_fmt_bytes_picks_exact_unit() {
        assert_eq!(fmt_bytes(8), "8 B");
        assert_eq!(fmt_bytes(4096), "4 KiB");
        assert_eq!(fmt_bytes(16 << 20), "16 MiB");
        assert_eq!(fmt_bytes(16 << 30), "16 GiB");
        assert_eq!(fmt_bytes(1500), "1500 B");
    }

    #[test]
    fn test_pair_row_ratio_is_a_over_b() {
        let s = |ns: f64| VariantSamples {
            iters_per_sample: 1,
            ns_per_iter: vec![ns],
            counter_per_iter: vec![0.0],
        };
        let r = PairRow::new(
            "g",
            8,
            SideResult::new("a", &s(30.0)),
            SideResult::new("b", &s(10.0)),
        );
        assert_eq!(r.ratio_a_over_b, 3.0);
    }
}
