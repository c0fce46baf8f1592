//! `umdev run`: serve an example device (being written).
use crate::{CliResult, DeviceKind};

/// Arguments of `umdev run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// Device to serve.
    pub device: DeviceKind,
}

/// Entry point.
pub fn run(_args: RunArgs) -> CliResult {
    Err("umdev run is not implemented yet".into())
}
