//! `umdev demo`: drive an example device with an embedded client (being written).
use crate::{CliResult, DeviceKind};

/// Arguments of `umdev demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Device to demo.
    pub device: DeviceKind,
}

/// Entry point.
pub fn run(_args: DemoArgs) -> CliResult {
    Err("umdev demo is not implemented yet".into())
}
