//! `umdev bench pin`: pin arrays of every pattern and size under every policy and page
//! backing, `DmaHandle::pin_pages`/`unpin_pages` (coalesced) against
//! `DmaHandle::naive()` (one lookup, check and residency operation per page), interleaved
//! sample by sample in the same run.
//!
//! One iteration pins an array and unpins it again (for a trace bucket: every array of the
//! bucket in recorded order), so every iteration starts from the same state. The reported
//! figure is ns per page of pin + unpin; syscalls per array come from
//! `DmaStats::residency_syscalls`.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev::dma::{
    DmaConfig, DmaError, DmaHandle, DmaMapping, DmaSpace, PinPolicy, Prot, PAGE_SHIFT, PAGE_SIZE,
};

use super::backing::{prepare, Backing, Prepared, HUGE_PAGE};
use super::machine;
use super::patterns::{generate, runs, Pattern};
use super::plot::pin_svg;
use super::progress::Progress;
use super::report::{
    paired_ratio, pin_table, print_report, BackingStatus, PinCell, PinConfig, PinReport, TraceInfo,
    VariantResult, PIN_SCHEMA,
};
use super::sampler::{interleaved, SamplePlan};
use super::trace::{compact, read_trace};
use super::OutputArgs;
use crate::BenchError;

/// IOVA where the bench region is mapped (1 GiB, an ordinary guest RAM address).
pub const REGION_IOVA: u64 = 1 << 30;
/// Largest accepted array size.
pub const MAX_SIZE: usize = 1 << 16;
/// Most arrays of one trace bucket replayed per iteration.
pub const TRACE_BUCKET_CAP: usize = 256;

/// Residency policy on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PolicyArg {
    /// Refcount + address only.
    Translate,
    /// mlock each run.
    Lock,
    /// MADV_POPULATE_WRITE/READ each run.
    Populate,
}

impl PolicyArg {
    /// Every policy, in report order.
    pub const ALL: [PolicyArg; 3] = [PolicyArg::Translate, PolicyArg::Lock, PolicyArg::Populate];

    /// Name in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            PolicyArg::Translate => "translate",
            PolicyArg::Lock => "lock",
            PolicyArg::Populate => "populate",
        }
    }

    /// The DMA layer's policy.
    pub fn policy(self) -> PinPolicy {
        match self {
            PolicyArg::Translate => PinPolicy::Translate,
            PolicyArg::Lock => PinPolicy::Lock,
            PolicyArg::Populate => PinPolicy::Populate,
        }
    }
}

/// Arguments of `umdev bench pin`.
#[derive(clap::Args, Debug)]
pub struct PinArgs {
    /// Array sizes in pages.
    #[arg(long, value_delimiter = ',', default_values_t = vec![1usize, 8, 64, 512, 4096])]
    pub sizes: Vec<usize>,
    /// Synthetic patterns.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Pattern::ALL.to_vec())]
    pub patterns: Vec<Pattern>,
    /// Replay pin arrays recorded with `umdev run --record-pins FILE` (repeatable).
    #[arg(long = "trace", value_name = "FILE")]
    pub traces: Vec<PathBuf>,
    /// Leave the synthetic patterns out (only replay `--trace` files).
    #[arg(long)]
    pub traces_only: bool,
    /// Residency policies.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = PolicyArg::ALL.to_vec())]
    pub policies: Vec<PolicyArg>,
    /// Page backings (unavailable ones are skipped with a message).
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = Backing::ALL.to_vec())]
    pub backings: Vec<Backing>,
    /// Fast run: fewer and shorter samples (same sizes).
    #[arg(long)]
    pub quick: bool,
    /// Samples kept per variant and cell [default: 41, quick 21].
    #[arg(long)]
    pub samples: Option<usize>,
    /// Target duration of one sample in ms [default: 1, quick 0.25].
    #[arg(long)]
    pub sample_ms: Option<f64>,
    /// Warm-up per cell in ms [default: 10, quick 1].
    #[arg(long)]
    pub warmup_ms: Option<f64>,
    /// Seed of the seeded patterns.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// A/A check of the harness: run the coalesced path on both sides (every ratio should
    /// then be 1.00 within noise).
    #[arg(long)]
    pub self_check: bool,
    /// Output options.
    #[command(flatten)]
    pub out: OutputArgs,
    /// Write an SVG plot of ns/page against array size.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// The sampling plan of `args`.
pub fn plan_of(args: &PinArgs) -> SamplePlan {
    // Many short samples: on a shared machine a sample that gets preempted is an outlier
    // the median ignores; long samples would all contain some preemption.
    // Slow comparisons (mlock of thousands of scattered pages) keep fewer samples within a
    // per-cell budget so that `--quick` stays well under a minute.
    let (samples, sample_ms, warmup_ms, budget_ms, min_samples) = if args.quick {
        (21, 0.25, 1.0, 300.0, 5)
    } else {
        (41, 1.0, 10.0, 4000.0, 11)
    };
    let ms = |v: f64| Duration::from_secs_f64(v.clamp(0.0, 60_000.0) / 1e3);
    SamplePlan {
        warmup: ms(args.warmup_ms.unwrap_or(warmup_ms)),
        samples: args.samples.unwrap_or(samples).clamp(1, 10_000),
        sample_target: ms(args.sample_ms.unwrap_or(sample_ms)),
        max_iters: 1_000_000,
        cell_budget: Some(ms(budget_ms)),
        min_samples: min_samples.min(args.samples.unwrap_or(usize::MAX)),
    }
}

/// One unit of work: the arrays one iteration pins and unpins (for a synthetic pattern one
/// array, for a trace bucket every recorded array of the bucket, in order).
pub struct Work {
    /// Pattern name (`trace:NAME` for a replayed trace).
    pub pattern: String,
    /// Array size, or the size bucket of a trace.
    pub size: usize,
    /// The arrays with the permission each is pinned with.
    pub arrays: Vec<(Vec<u64>, Prot)>,
}

impl Work {
    /// The array of `size` pages of `pattern` for `seed`, in the bench region at
    /// [`REGION_IOVA`], pinned read/write.
    pub fn synthetic(pattern: Pattern, size: usize, seed: u64) -> Work {
        Work {
            pattern: pattern.name().to_string(),
            size,
            arrays: vec![(
                generate(pattern, size, REGION_IOVA >> PAGE_SHIFT, seed),
                Prot::RW,
            )],
        }
    }

    /// Pages in all arrays.
    pub fn pages(&self) -> usize {
        self.arrays.iter().map(|(a, _)| a.len()).sum()
    }

    /// Mean maximal runs of consecutive pages per array.
    pub fn runs_per_array(&self) -> f64 {
        let total: usize = self.arrays.iter().map(|(a, _)| runs(a)).sum();
        total as f64 / self.arrays.len().max(1) as f64
    }

    fn max_pfn(&self) -> u64 {
        self.arrays
            .iter()
            .flat_map(|(a, _)| a.iter().copied())
            .max()
            .unwrap_or(0)
    }
}

/// A DMA space under `policy` with `fd` mapped read/write at [`REGION_IOVA`] for
/// `region_bytes`, its lock limit the region's size (so `Lock` never hits it).
pub fn map_region(
    fd: OwnedFd,
    policy: PinPolicy,
    region_bytes: u64,
) -> Result<Arc<DmaSpace>, DmaError> {
    let space = DmaSpace::new(DmaConfig {
        policy,
        lock_limit_bytes: Some(region_bytes),
        ..DmaConfig::default()
    });
    space.map(DmaMapping {
        iova: REGION_IOVA,
        size: region_bytes,
        prot: Prot::RW,
        fd: Some(fd),
        offset: 0,
    })?;
    Ok(space)
}

/// The smallest configured size ≥ `len`, or the largest.
fn bucket(len: usize, sorted_sizes: &[usize]) -> usize {
    sorted_sizes
        .iter()
        .copied()
        .find(|&s| s >= len)
        .or(sorted_sizes.last().copied())
        .unwrap_or(len)
}

fn trace_name(path: &std::path::Path) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace".into());
    format!("trace:{stem}")
}

/// Build every unit of work and the trace descriptions.
fn build_work(args: &PinArgs) -> Result<(Vec<Work>, Vec<TraceInfo>), BenchError> {
    let base = REGION_IOVA >> PAGE_SHIFT;
    let mut sizes = args.sizes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    if let Some(&bad) = sizes.iter().find(|&&s| s == 0 || s > MAX_SIZE) {
        return Err(BenchError::Options(format!(
            "array size {bad} out of range 1..={MAX_SIZE}"
        )));
    }
    let mut work = Vec::new();
    if !args.traces_only {
        for &p in &args.patterns {
            for &s in &args.sizes {
                work.push(Work::synthetic(p, s, args.seed));
            }
        }
    }
    let mut infos = Vec::new();
    for path in &args.traces {
        let entries = read_trace(path)?;
        let (entries, span) = compact(&entries, base);
        let name = trace_name(path);
        infos.push(TraceInfo {
            name: name.clone(),
            path: path.display().to_string(),
            arrays: entries.len(),
            pages: entries.iter().map(|e| e.pfns.len()).sum(),
            span_pages: span,
        });
        for &s in &sizes {
            let arrays: Vec<(Vec<u64>, Prot)> = entries
                .iter()
                .filter(|e| bucket(e.pfns.len(), &sizes) == s)
                .take(TRACE_BUCKET_CAP)
                .map(|e| (e.pfns.clone(), e.prot()))
                .collect();
            if !arrays.is_empty() {
                work.push(Work {
                    pattern: name.clone(),
                    size: s,
                    arrays,
                });
            }
        }
    }
    if work.is_empty() {
        return Err(BenchError::Options(
            "nothing to measure (no pattern, size or trace selected)".into(),
        ));
    }
    Ok((work, infos))
}

/// Check that both paths return the same host addresses, and leave nothing pinned.
fn cross_check(h: &DmaHandle, w: &Work) -> Result<(), String> {
    for (a, prot) in &w.arrays {
        let mut x = vec![0u64; a.len()];
        let mut y = vec![0u64; a.len()];
        h.pin_pages(a, *prot, &mut x).map_err(|e| e.to_string())?;
        h.unpin_pages(a).map_err(|e| e.to_string())?;
        h.naive()
            .pin_pages(a, *prot, &mut y)
            .map_err(|e| e.to_string())?;
        h.naive().unpin_pages(a).map_err(|e| e.to_string())?;
        if x != y {
            return Err("coalesced and per-page paths returned different host addresses".into());
        }
    }
    Ok(())
}

/// Measure `w` on `h`: the coalesced path (`pin_pages`/`unpin_pages`) against the per-page
/// path (`naive()`), or against itself with `self_check`, sampled interleaved under `plan`.
/// Both paths must return the same host addresses first, and nothing may stay pinned after.
/// The counter of every sample is the space's residency syscalls.
pub fn measure(h: &DmaHandle, w: &Work, plan: &SamplePlan, self_check: bool) -> PinCellResult {
    cross_check(h, w)?;
    let mut bufs_a: Vec<Vec<u64>> = w.arrays.iter().map(|(a, _)| vec![0; a.len()]).collect();
    let mut bufs_b = bufs_a.clone();
    let mut coalesced = || -> Result<(), DmaError> {
        for ((a, prot), buf) in w.arrays.iter().zip(bufs_a.iter_mut()) {
            h.pin_pages(a, *prot, buf)?;
            h.unpin_pages(a)?;
        }
        Ok(())
    };
    let mut per_page = || -> Result<(), DmaError> {
        let naive = h.naive();
        for ((a, prot), buf) in w.arrays.iter().zip(bufs_b.iter_mut()) {
            if self_check {
                // A/A: the same path on both sides; the ratio shows the harness's own bias.
                h.pin_pages(a, *prot, buf)?;
                h.unpin_pages(a)?;
            } else {
                naive.pin_pages(a, *prot, buf)?;
                naive.unpin_pages(a)?;
            }
        }
        Ok(())
    };
    let (a, b) = interleaved(plan, &mut coalesced, &mut per_page, &mut || {
        h.stats().residency_syscalls
    })
    .map_err(|e| e.to_string())?;
    let left = h.stats().pinned_pages;
    if left != 0 {
        return Err(format!("{left} pages still pinned after the cell"));
    }
    let (arrays, pages) = (w.arrays.len(), w.pages());
    Ok((
        VariantResult::from_samples(&a, arrays, pages),
        VariantResult::from_samples(&b, arrays, pages),
    ))
}

/// The coalesced and the per-page result of a cell, or why it has none.
pub type PinCellResult = Result<(VariantResult, VariantResult), String>;

/// What every policy run shares.
struct RunCtx<'a> {
    self_check: bool,
    region_bytes: u64,
    work: &'a [Work],
    plan: SamplePlan,
}

/// Measure every unit of work on one fd under one policy.
fn run_policy(
    ctx: &RunCtx<'_>,
    fd: OwnedFd,
    backing: Backing,
    policy: PolicyArg,
    progress: &mut Progress,
    cells: &mut Vec<PinCell>,
) -> Result<(), BenchError> {
    let (region_bytes, work, plan) = (ctx.region_bytes, ctx.work, &ctx.plan);
    let space = map_region(fd, policy.policy(), region_bytes)?;
    let handle = space.handle();
    for w in work {
        progress.start_step(&format!(
            "{} {} {} {}",
            backing.name(),
            policy.name(),
            w.pattern,
            w.size
        ));
        let result = measure(&handle, w, plan, ctx.self_check);
        let (coalesced, per_page, error) = match result {
            Ok((a, b)) => (Some(a), Some(b), None),
            Err(e) => (None, None, Some(e)),
        };
        let (ratio, ratio_paired) = match (&coalesced, &per_page) {
            (Some(a), Some(b)) if a.ns_per_page.median > 0.0 => (
                Some(b.ns_per_page.median / a.ns_per_page.median),
                Some(paired_ratio(a, b)),
            ),
            _ => (None, None),
        };
        cells.push(PinCell {
            backing: backing.name().into(),
            policy: policy.name().into(),
            pattern: w.pattern.clone(),
            size: w.size,
            arrays: w.arrays.len(),
            pages_per_array: w.pages() as f64 / w.arrays.len().max(1) as f64,
            runs_per_array: w.runs_per_array(),
            coalesced,
            per_page,
            ratio,
            ratio_paired,
            error,
        });
        progress.finish_step();
    }
    space.unmap(REGION_IOVA, region_bytes, &mut |_, _| {})?;
    Ok(())
}

/// Entry point of `umdev bench pin`.
pub fn run(args: PinArgs) -> Result<(), BenchError> {
    let started = Instant::now();
    let plan = plan_of(&args);
    let (work, traces) = build_work(&args)?;
    let base = REGION_IOVA >> PAGE_SHIFT;
    let span_pages = work
        .iter()
        .map(|w| w.max_pfn() + 1 - base)
        .max()
        .unwrap_or(1);
    let region_bytes = (span_pages * PAGE_SIZE).div_ceil(HUGE_PAGE) * HUGE_PAGE;
    let machine = machine::collect();
    let mut progress = Progress::for_run(
        args.out.quiet,
        work.len() * args.policies.len() * args.backings.len(),
    );
    let ctx = RunCtx {
        self_check: args.self_check,
        region_bytes,
        work: &work,
        plan,
    };
    let mut cells = Vec::new();
    let mut statuses = Vec::new();
    for &backing in &args.backings {
        match prepare(backing, region_bytes)? {
            Prepared::Skipped(why) => {
                progress.note(&format!("skipping {}: {why}", backing.name()));
                // Account the skipped steps so the bar still reaches its end.
                for _ in 0..work.len() * args.policies.len() {
                    progress.finish_step();
                }
                statuses.push(BackingStatus {
                    backing: backing.name(),
                    measured: false,
                    note: why,
                });
            }
            Prepared::Ready(fd, note) => {
                for &policy in &args.policies {
                    run_policy(
                        &ctx,
                        fd.try_clone()?,
                        backing,
                        policy,
                        &mut progress,
                        &mut cells,
                    )?;
                }
                statuses.push(BackingStatus {
                    backing: backing.name(),
                    measured: true,
                    note,
                });
            }
        }
    }
    progress.finish();
    let report = PinReport {
        schema: PIN_SCHEMA,
        command: std::env::args().collect(),
        config: PinConfig {
            sizes: args.sizes.clone(),
            patterns: if args.traces_only {
                Vec::new()
            } else {
                args.patterns.iter().map(|p| p.name()).collect()
            },
            traces,
            policies: args.policies.iter().map(|p| p.name()).collect(),
            backings: args.backings.iter().map(|b| b.name()).collect(),
            plan,
            seed: args.seed,
            quick: args.quick,
            self_check: args.self_check,
            region_iova: REGION_IOVA,
            region_bytes,
            trace_bucket_cap: TRACE_BUCKET_CAP,
        },
        machine,
        backings: statuses,
        cells,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    print_report(
        "pin",
        &args.out,
        &report.machine,
        &pin_table(&report),
        &report,
    )?;
    if let Some(path) = &args.plot {
        std::fs::write(path, pin_svg(&report.machine, &report.cells)?)?;
        println!("plot: {}", path.display());
    }
    println!("{:.1} s", report.elapsed_s);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_bucket_picks_smallest_size_at_least_len() {
        let sizes = [1, 8, 64];
        assert_eq!(bucket(1, &sizes), 1);
        assert_eq!(bucket(2, &sizes), 8);
        assert_eq!(bucket(64, &sizes), 64);
        assert_eq!(bucket(1000, &sizes), 64);
    }

    #[test]
    fn test_trace_name_uses_file_stem() {
        assert_eq!(
            trace_name(std::path::Path::new("/x/gpu.jsonl")),
            "trace:gpu"
        );
    }
}
