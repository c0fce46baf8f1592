//! umdev's benchmarks as a library: what `umdev bench` runs, and the pieces the criterion
//! benches in `bench/benches/` share with it, so that a measurement is written once.
//!
//! - [`pin`] (`umdev bench pin`): pin arrays of several patterns and sizes, the coalesced
//!   path against the per-page baseline, interleaved in one run.
//! - [`dma`] (`umdev bench dma`): `DmaHandle::read`/`write` against plain memcpy on the same
//!   memory and a lookup-per-call path.
//! - [`wire`] (`umdev bench wire`): vfio-user message round trips through a real socket,
//!   umdev's server against the `vfio_user` crate's, serving the same device
//!   ([`vfio_user_trivial`]), and by CPU placement and polling mode ([`placement`]).
//! - [`record`] (`umdev bench record`): record the pin arrays an example device issues.
//! - [`instances`] (`umdev bench instances`): many instances in one registry (create,
//!   idle cost, all serving at once) and the shared GPU engine's fairness.
//! - [`isolation`] (`umdev bench isolation`): one hostile client per attack against seven
//!   victim instances in one process: their p99 latencies under attack against without.
//!
//! Shared pieces: array [`patterns`], recorded pin [`trace`]s, page [`backing`] and
//! [`local_mapping`]s of it, [`cputime`], the interleaved [`sampler`], [`stats`], the terminal/JSON
//! [`report`] and its [`table`]s, the SVG [`plot`], [`progress`] on stderr and [`machine`]
//! information.
//!
//! The options of each bench are clap `Args` ([`BenchArgs`] is the whole `umdev bench`
//! command line): the `umdev` binary only parses and dispatches to [`run`]. Devices and the
//! embedded VMM come from `umdev::testing`, the harness every test uses.
#![deny(missing_docs)]

pub mod backing;
pub mod cputime;
pub mod dma;
pub mod instances;
pub mod isolation;
pub mod local_mapping;
pub mod machine;
pub mod patterns;
pub mod pin;
pub mod placement;
pub mod plot;
pub mod progress;
pub mod record;
pub mod report;
pub mod rng;
pub mod sampler;
pub mod stats;
pub mod table;
pub mod trace;
pub mod vfio_user_trivial;
pub mod wire;

use std::path::PathBuf;

/// Errors of a benchmark run. Every variant but [`BenchError::Options`] and
/// [`BenchError::VfioUser`] shows its cause as it is (message and source chain).
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// Options that cannot be run: a size out of range, nothing selected.
    #[error("{0}")]
    Options(String),
    /// A recorded trace could not be read.
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    /// Memory, files, sockets.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The DMA layer refused a map or unmap.
    #[error(transparent)]
    Dma(#[from] umdev::dma::DmaError),
    /// umdev's server failed to start or stop.
    #[error(transparent)]
    Server(#[from] umdev::server::ServerError),
    /// The `vfio_user` crate's client or server failed (its errors carry no source).
    #[error("{0}")]
    VfioUser(String),
    /// An example device, its parent or its guest driver failed under a workload.
    #[error(transparent)]
    Workload(Box<dyn std::error::Error + Send + Sync>),
    /// The instance registry refused to create or remove an instance.
    #[error(transparent)]
    Instance(#[from] umdev::instance::InstanceError),
}

/// Output options shared by every bench.
#[derive(clap::Args, Debug, Default)]
pub struct OutputArgs {
    /// Write every sample, the configuration and the machine description as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// No progress and no header on the terminal (the table is still printed).
    #[arg(long)]
    pub quiet: bool,
}

/// Options of the A/B benches (`dma`, `wire`): how much to sample, where the report goes.
#[derive(clap::Args, Debug, Default)]
pub struct PairArgs {
    /// Fast run: fewer and shorter samples.
    #[arg(long)]
    pub quick: bool,
    /// Samples kept per side [default: 31, quick 15].
    #[arg(long)]
    pub samples: Option<usize>,
    /// Output options.
    #[command(flatten)]
    pub out: OutputArgs,
}

impl PairArgs {
    /// The sampling plan: 31 samples of 2 ms each side (quick: 15 of 0.5 ms) after
    /// `warmup_ms` (full, quick) of warm-up, at most `max_iters` iterations per sample and
    /// 5 s per comparison (quick: 1 s), never fewer than 5 samples.
    pub fn plan(&self, warmup_ms: (f64, f64), max_iters: u64) -> sampler::SamplePlan {
        let (n, target_ms, warm_ms, budget_s) = if self.quick {
            (15, 0.5, warmup_ms.1, 1)
        } else {
            (31, 2.0, warmup_ms.0, 5)
        };
        sampler::SamplePlan {
            warmup: std::time::Duration::from_secs_f64(warm_ms / 1e3),
            samples: self.samples.unwrap_or(n).clamp(1, 10_000),
            sample_target: std::time::Duration::from_secs_f64(target_ms / 1e3),
            max_iters,
            cell_budget: Some(std::time::Duration::from_secs(budget_s)),
            min_samples: 5,
        }
    }
}

/// Arguments of `umdev bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Which benchmark.
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// The benchmarks.
#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Pin arrays: patterns × sizes × policies × page backing, coalesced vs per-page.
    Pin(Box<pin::PinArgs>),
    /// dma_rw vs memcpy, held handle vs lookup per call, fd-less regions.
    Dma(Box<dma::DmaArgs>),
    /// vfio-user message round trips through a real socket.
    Wire(Box<wire::WireArgs>),
    /// Record the pin arrays an example device issues under a workload (for `pin --trace`).
    Record(Box<record::RecordArgs>),
    /// Many instances in one registry: create, idle cost, all serving; GPU engine fairness.
    Instances(Box<instances::InstancesArgs>),
    /// One hostile client against seven victim GPU instances in one process, per attack.
    Isolation(Box<isolation::IsolationArgs>),
}

/// Run `umdev bench`: the chosen benchmark, its table on stdout, progress on stderr.
pub fn run(args: BenchArgs) -> Result<(), BenchError> {
    match args.command {
        BenchCommand::Pin(a) => pin::run(*a),
        BenchCommand::Dma(a) => dma::run(*a),
        BenchCommand::Wire(a) => wire::run(*a),
        BenchCommand::Record(a) => record::run(*a),
        BenchCommand::Instances(a) => instances::run(*a),
        BenchCommand::Isolation(a) => isolation::run(*a),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn test_pair_args_plan_quick_is_fewer_and_shorter_samples() {
        let mut args = PairArgs::default();
        let full = args.plan((20.0, 5.0), 1000);
        assert_eq!(
            (full.samples, full.sample_target, full.warmup),
            (31, Duration::from_millis(2), Duration::from_millis(20))
        );
        assert_eq!(full.cell_budget, Some(Duration::from_secs(5)));
        assert_eq!((full.max_iters, full.min_samples), (1000, 5));
        args.quick = true;
        let quick = args.plan((20.0, 5.0), 1000);
        assert_eq!(
            (quick.samples, quick.sample_target, quick.warmup),
            (15, Duration::from_micros(500), Duration::from_millis(5))
        );
        assert_eq!(quick.cell_budget, Some(Duration::from_secs(1)));
        args.samples = Some(0);
        assert_eq!(args.plan((1.0, 1.0), 1).samples, 1, "at least one sample");
    }
}
