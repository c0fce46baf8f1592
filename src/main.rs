//! The `umdev` command line: serve an example device, demo it without QEMU, or benchmark.

mod check;
mod completions;
mod daemon;
mod demo;
mod demo_migrate;
mod display;
mod logging;
mod run;

use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

/// umdev: user-space mediated devices served over vfio-user.
#[derive(Parser, Debug)]
#[command(
    name = "umdev",
    version,
    about,
    after_help = "Examples:\n  umdev demo gpu                         draw a scene, write gpu-demo.png (no QEMU needed)\n  umdev demo ccw                         write and verify data through channel programs\n  umdev demo migrate                     move a drawing GPU and a ccw device between two servers\n  umdev run gpu --socket /tmp/gpu.sock   serve the GPU to a VMM until Ctrl-C\n  umdev run virtio-gpu --socket /tmp/vgpu.sock --screenshot-on-exit screen.png\n                                         a virtio-gpu for the guest's own driver\n  umdev screenshot UUID -o screen.png    what a daemon's virtio-gpu instance shows\n  umdev view UUID                        the same, live, at http://127.0.0.1:8080/\n  umdev bench pin --quick                coalesced vs per-page pinning\n\nLogging: RUST_LOG=info (default) shows connects, negotiation and problems;\nRUST_LOG=debug adds one line per vfio-user message (command, id, size, outcome) plus\ndetails of DMA maps and unmaps; RUST_LOG=trace adds config-space writes and GPU commands.\nColour only when stderr is a terminal (NO_COLOR turns it off)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Which example device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceKind {
    /// gvt-style GPU: registers, GTT, command ring, framebuffer.
    Gpu,
    /// ccw-style channel block device backed by an image file.
    Ccw,
    /// NVMe 1.4 controller with one namespace on a raw image file (Linux's stock `nvme`
    /// driver binds it).
    Nvme,
    /// virtio-gpu (2D) that the guest's stock `virtio_gpu` driver binds.
    VirtioGpu,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve an example device on a vfio-user socket until Ctrl-C.
    Run(run::RunArgs),
    /// Start a device and drive it with an embedded client (no QEMU needed); `migrate`
    /// live-migrates running devices between two servers.
    Demo(demo::DemoArgs),
    /// Benchmarks: pin patterns, dma_rw, wire round trips, many instances.
    Bench(umdev_bench::BenchArgs),
    /// Serve many instances of the GPU and ccw parents until Ctrl-C (the commands below).
    Daemon(daemon::DaemonArgs),
    #[command(flatten)]
    Instances(daemon::client::ClientCommand),
    /// Write what a virtio-gpu's scanout shows (with the cursor) as PNG: an instance of the
    /// daemon, or the device of `umdev run --control`.
    Screenshot(display::ScreenshotArgs),
    /// Serve a live view of a virtio-gpu's scanout to a browser (HTTP), until Ctrl-C.
    View(display::ViewArgs),
    /// Give a virtio-gpu's scanout a new mode, as plugging in another monitor would (the
    /// guest's driver is told): an instance of the daemon, or `umdev run --control`'s.
    Resize(display::ResizeArgs),
    /// What this host has and lacks for umdev: memlock, map count, huge pages, QEMU,
    /// the daemon's directories.
    Check(check::CheckArgs),
    /// Print a shell completion script to stdout.
    Completions(completions::CompletionsArgs),
    /// Print the man page (roff) to stdout, or write one page per subcommand.
    Man(completions::ManArgs),
}

fn main() {
    let cli = Cli::parse();
    // A server's log is its report: info by default. A benchmark's report is its tables, so
    // the servers it starts log only warnings unless RUST_LOG asks for more.
    let default_level = match cli.command {
        Command::Bench(_)
        | Command::Instances(_)
        | Command::Screenshot(_)
        | Command::Resize(_)
        | Command::Check(_)
        | Command::Completions(_)
        | Command::Man(_) => "warn",
        Command::Run(_) | Command::Demo(_) | Command::Daemon(_) | Command::View(_) => "info",
    };
    logging::init(default_level);
    let result: CliResult = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => umdev_bench::run(args).map_err(Into::into),
        Command::Daemon(args) => daemon::run(args),
        Command::Instances(command) => daemon::client::run(command),
        Command::Screenshot(args) => display::screenshot(args),
        Command::View(args) => display::view(args),
        Command::Resize(args) => display::resize(args),
        Command::Check(args) => check::run(args),
        Command::Completions(args) => completions::completions(args, Cli::command()),
        Command::Man(args) => completions::man(args, Cli::command()),
    };
    if let Err(e) = result {
        eprintln!("umdev: {e}");
        let mut source = e.source();
        while let Some(s) = source {
            eprintln!("  caused by: {s}");
            source = s.source();
        }
        std::process::exit(1);
    }
}

/// Errors of the CLI: a message and an optional cause.
pub type CliResult = Result<(), Box<dyn std::error::Error>>;
