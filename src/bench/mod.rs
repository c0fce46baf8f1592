//! `umdev bench`: measurements a reader can trust and see.
//!
//! - `umdev bench pin`: pin arrays of several patterns and sizes, coalesced path against the
//!   per-page baseline, interleaved in one run ([`pin`]).
//! - `umdev bench dma`: `DmaHandle::read`/`write` against plain memcpy on the same memory and a
//!   lookup-per-call path ([`dma`]).
//! - `umdev bench wire`: vfio-user message round trips through a real socket ([`wire`]).
//! - `umdev bench record`: record the pin arrays an example device issues ([`record`]).
//!
//! Shared pieces: array [`patterns`], recorded pin [`trace`]s, page [`backing`], the
//! interleaved [`sampler`], [`stats`], the terminal/JSON [`report`], the SVG [`plot`],
//! [`progress`] lines and [`machine`] information.

pub mod backing;
pub mod dma;
pub mod local_mapping;
pub mod machine;
pub mod patterns;
pub mod pin;
pub mod plot;
pub mod progress;
pub mod record;
pub mod report;
pub mod rng;
pub mod sampler;
pub mod stats;
pub mod table;
pub mod trace;
pub mod trivial_device;
pub mod wire;

use std::path::PathBuf;

use crate::CliResult;

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
}

/// Entry point of `umdev bench`.
pub fn run(args: BenchArgs) -> CliResult {
    match args.command {
        BenchCommand::Pin(a) => pin::run(*a),
        BenchCommand::Dma(a) => dma::run(*a),
        BenchCommand::Wire(a) => wire::run(*a),
        BenchCommand::Record(a) => record::run(*a),
    }
}
