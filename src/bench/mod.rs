//! `umdev bench` (being written).
use crate::CliResult;

/// Arguments of `umdev bench`.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {}

/// Entry point.
pub fn run(_args: BenchArgs) -> CliResult {
    Err("umdev bench is not implemented yet".into())
}
