//! `umdev bench wire`: vfio-user message round trips through a real socket, umdev's server
//! side by side with the `vfio_user` crate's own `Server` on the same trivial device.
//!
//! Needs the server engine (`umdev::server`); until it has landed the subcommand says so.

use crate::CliResult;

use super::OutputArgs;

/// Arguments of `umdev bench wire`.
#[derive(clap::Args, Debug)]
pub struct WireArgs {
    /// Fast run: fewer and shorter samples.
    #[arg(long)]
    pub quick: bool,
    /// Output options.
    #[command(flatten)]
    pub out: OutputArgs,
}

/// Entry point of `umdev bench wire`.
pub fn run(_args: WireArgs) -> CliResult {
    Err("umdev bench wire needs the server engine (umdev::server), \
         which has not landed in this build"
        .into())
}
