//! `umdev bench wire`: vfio-user message round trips through a real UNIX socket, umdev's
//! server side by side with the `vfio_user` crate's own `Server`, both serving the same
//! [`vfio_user_trivial`](super::vfio_user_trivial) in this process, both driven by the
//! `vfio_user::Client` (and, for posted writes, which that client cannot send, by umdev's
//! embedded [`Vmm`]). The two sides are sampled interleaved, on one CPU; the
//! [`placement`](super::placement) table before them has same core and cross core and the
//! poll modes.
//!
//! Rows: REGION_READ 4 B, REGION_WRITE 4 B, posted REGION_WRITE 4 B (no-reply flag, in
//! batches of 64 fenced by one REGION_READ; ns per write), DMA_MAP+DMA_UNMAP of a sparse
//! memfd of 4 KiB … 16 GiB (both servers mmap and munmap the region).

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::thread::JoinHandle;
use std::time::Instant;

use super::local_mapping::memfd;
use super::placement::{PlacementPlan, PlacementReport};
use super::progress::Progress;
use super::report::{fmt_bytes, pair_table, print_report, PairReport, PairRow, SideResult};
use super::sampler::interleaved;
use super::vfio_user_trivial::{vfio_user_regions, VfioUserTrivial};
use super::PairArgs;
use crate::BenchError;
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::server::{PollMode, RunningServer, Server, ServerConfig};
use umdev::testing::{DeviceAccess, TrivialDevice, Vmm};

/// IOVA of the DMA_MAP rows.
pub const MAP_IOVA: u64 = 1 << 40;
/// Posted writes per fenced batch.
pub const POSTED_BATCH: usize = 64;

/// Arguments of `umdev bench wire`.
#[derive(clap::Args, Debug)]
pub struct WireArgs {
    /// DMA_MAP sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![4096u64, 1 << 20, 256 << 20, 16 << 30])]
    pub map_sizes: Vec<u64>,
    /// Interleaved rounds of the placement table (same core / cross core × server × poll
    /// mode).
    #[arg(long, default_value_t = 7)]
    pub rounds: usize,
    /// Round trips per variant per round in the placement table [default: 5000, quick 1000].
    #[arg(long)]
    pub per_round: Option<usize>,
    /// Also measure libvfio-user in the placement table: the path of its
    /// `gpio-pci-idio-16` sample server (built from nutanix/libvfio-user with meson; the
    /// bench starts it with a socket path and reads its BAR2).
    #[arg(long, value_name = "BINARY")]
    pub libvfio_user: Option<std::path::PathBuf>,
    /// Also measure `BINARY run gpu` in the placement table, as a process of its own (the
    /// GPU's BAR0 ID register): e.g. a build from before a change against this one.
    /// Repeatable.
    #[arg(long, value_name = "BINARY")]
    pub umdev_binary: Vec<std::path::PathBuf>,
    /// Only the placement table (no side-by-side rows, no DMA_MAP rows).
    #[arg(long)]
    pub placement_only: bool,
    /// No placement table.
    #[arg(long, conflicts_with = "placement_only")]
    pub no_placement: bool,
    /// Sampling and output options.
    #[command(flatten)]
    pub run: PairArgs,
}

/// What `umdev bench wire --json` writes.
#[derive(serde::Serialize)]
struct WireReport<'a> {
    #[serde(flatten)]
    pairs: &'a PairReport,
    placement: Option<&'a PlacementReport>,
}

/// Start umdev's server on `path` serving the trivial device, as a VMM would find it: the
/// server itself, no test wrapper around the device (DMA layer with its default Translate
/// policy).
pub fn spawn_umdev(path: &Path) -> Result<RunningServer, BenchError> {
    spawn_umdev_with(path, ServerConfig::new(path).poll)
}

/// [`spawn_umdev`] with the connection thread waiting as `poll` says.
pub fn spawn_umdev_with(path: &Path, poll: PollMode) -> Result<RunningServer, BenchError> {
    let space = DmaSpace::new(DmaConfig::default());
    let mut config = ServerConfig::new(path);
    config.poll = poll;
    Ok(Server::new(config, Box::new(TrivialDevice::default()), space).spawn()?)
}

/// Stop a server started by [`spawn_umdev`]; a failure is logged, not returned (the
/// measurements are taken by then).
pub fn stop_umdev(running: RunningServer) {
    if let Err(e) = running.shutdown() {
        tracing::warn!(error = %e, "umdev server shutdown");
    }
}

/// Start the `vfio_user::Server` side on `path`, serving `connections` connections one
/// after the other on a thread of its own.
pub fn spawn_vfio_user(path: &Path, connections: usize) -> Result<JoinHandle<()>, BenchError> {
    let server = vfio_user::Server::new(path, true, Vec::new(), vfio_user_regions())
        .map_err(|e| BenchError::VfioUser(format!("vfio_user::Server::new: {e}")))?;
    Ok(std::thread::spawn(move || {
        let mut dev = VfioUserTrivial::default();
        for _ in 0..connections {
            if let Err(e) = server.run(&mut dev) {
                tracing::warn!(error = %e, "vfio_user::Server connection ended with an error");
            }
        }
    }))
}

/// Connect the `vfio_user` crate's client to `path`.
pub fn client(path: &Path) -> Result<vfio_user::Client, BenchError> {
    vfio_user::Client::new(path)
        .map_err(|e| BenchError::VfioUser(format!("vfio_user::Client::new: {e}")))
}

type Io = Result<(), std::io::Error>;

fn vfio_err(e: vfio_user::Error) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// Entry point of `umdev bench wire`.
pub fn run(args: WireArgs) -> Result<(), BenchError> {
    let started = Instant::now();
    let plan = args.run.plan((20.0, 5.0), 1_000_000);
    let dir = tempfile::Builder::new()
        .prefix("umdev-bench-wire-")
        .tempdir()?;
    let placement = if args.no_placement {
        None
    } else {
        let plan = PlacementPlan {
            rounds: args.rounds.max(1),
            per_round: args
                .per_round
                .unwrap_or(if args.run.quick { 1000 } else { 5000 })
                .max(1),
            idle_ms: if args.run.quick { 300 } else { 1000 },
        };
        if !args.run.out.quiet {
            eprintln!("round trips by placement…");
        }
        Some(super::placement::run(
            plan,
            dir.path(),
            args.libvfio_user.as_deref(),
            &args.umdev_binary,
        )?)
    };
    if args.placement_only {
        let placement = placement.expect("not both --placement-only and --no-placement");
        let report = PairReport::new("wire", plan, Vec::new(), Vec::new(), started);
        let wire = WireReport {
            pairs: &report,
            placement: Some(&placement),
        };
        print_report(
            "wire",
            &args.run.out,
            &report.machine,
            &super::placement::table(&placement),
            &wire,
        )?;
        println!("{:.1} s", started.elapsed().as_secs_f64());
        return Ok(());
    }
    // The side-by-side rows run on one CPU (servers and clients inherit the mask): left to
    // the scheduler, each server's thread lands on the client's CPU or on the other one,
    // and a round trip takes ~5 or ~50 µs accordingly (the placement table above shows
    // both), which would make the ratios a coin toss.
    let original = super::placement::allowed_cpus()?;
    if let Some(&first) = original.first() {
        super::placement::pin_to(&[first])?;
    }
    let result = pairs(
        &args,
        plan,
        dir.path(),
        started,
        placement.as_ref(),
        &original,
    );
    super::placement::pin_to(&original)?;
    result
}

/// The side-by-side rows, then the report.
fn pairs(
    args: &WireArgs,
    plan: super::sampler::SamplePlan,
    dir: &Path,
    started: Instant,
    placement: Option<&PlacementReport>,
    original_cpus: &[usize],
) -> Result<(), BenchError> {
    let umdev_path = dir.join("umdev.sock");
    let vfio_path = dir.join("vfio-user.sock");
    let umdev_side = spawn_umdev(&umdev_path)?;
    let vfio_thread = spawn_vfio_user(&vfio_path, 2)?;
    let mut progress = Progress::for_run(args.run.out.quiet, 3 + args.map_sizes.len());
    let names = ("umdev server", "vfio_user::Server");
    let mut rows = Vec::new();
    {
        let mut cu = client(&umdev_path)?;
        let mut cv = client(&vfio_path)?;
        let mut b1 = [0u8; 4];
        let mut b2 = [0u8; 4];

        progress.start_step("REGION_READ 4 B");
        let (a, b) = interleaved(
            &plan,
            &mut || -> Io { cu.region_read(0, 0, &mut b1).map_err(vfio_err) },
            &mut || -> Io { cv.region_read(0, 0, &mut b2).map_err(vfio_err) },
            &mut || 0,
        )?;
        rows.push(PairRow::new(
            "REGION_READ round trip",
            4,
            SideResult::new(names.0, &a),
            SideResult::new(names.1, &b),
        ));
        progress.finish_step();

        progress.start_step("REGION_WRITE 4 B");
        let (a, b) = interleaved(
            &plan,
            &mut || -> Io { cu.region_write(0, 0, &[1, 2, 3, 4]).map_err(vfio_err) },
            &mut || -> Io { cv.region_write(0, 0, &[1, 2, 3, 4]).map_err(vfio_err) },
            &mut || 0,
        )?;
        rows.push(PairRow::new(
            "REGION_WRITE round trip",
            4,
            SideResult::new(names.0, &a),
            SideResult::new(names.1, &b),
        ));
        progress.finish_step();

        for &size in &args.map_sizes {
            progress.start_step(&format!("DMA_MAP+UNMAP {}", fmt_bytes(size)));
            let fu: OwnedFd = memfd("umdev-bench-wire", 0, size)?;
            let fv: OwnedFd = memfd("umdev-bench-wire", 0, size)?;
            let (a, b) = interleaved(
                &plan,
                &mut || -> Io {
                    cu.dma_map(0, MAP_IOVA, size, fu.as_raw_fd())
                        .map_err(vfio_err)?;
                    cu.dma_unmap(MAP_IOVA, size).map_err(vfio_err)
                },
                &mut || -> Io {
                    cv.dma_map(0, MAP_IOVA, size, fv.as_raw_fd())
                        .map_err(vfio_err)?;
                    cv.dma_unmap(MAP_IOVA, size).map_err(vfio_err)
                },
                &mut || 0,
            )?;
            rows.push(PairRow::new(
                "DMA_MAP + DMA_UNMAP round trips",
                size,
                SideResult::new(names.0, &a),
                SideResult::new(names.1, &b),
            ));
            progress.finish_step();
        }
        let _ = cu.shutdown();
        let _ = cv.shutdown();
    }
    {
        let mut ru = Vmm::connect(&umdev_path)?;
        let mut rv = Vmm::connect(&vfio_path)?;
        progress.start_step("posted REGION_WRITE 4 B");
        let (mut a, mut b) = interleaved(
            &plan,
            &mut || posted_batch(&mut ru),
            &mut || posted_batch(&mut rv),
            &mut || 0,
        )?;
        for s in [&mut a, &mut b] {
            for v in &mut s.ns_per_iter {
                *v /= POSTED_BATCH as f64;
            }
            s.iters_per_sample *= POSTED_BATCH as u64;
        }
        rows.push(PairRow::new(
            "posted REGION_WRITE (no reply; batches of 64 + 1 fencing read)",
            4,
            SideResult::new(names.0, &a),
            SideResult::new(names.1, &b),
        ));
        progress.finish_step();
    }
    progress.finish();
    stop_umdev(umdev_side);
    let _ = vfio_thread.join();

    // Measured: the machine description reads the CPUs this thread may use.
    super::placement::pin_to(original_cpus)?;
    let report = PairReport::new(
        "wire",
        plan,
        rows,
        vec![
            "both servers serve the same trivial device (4 KiB BAR0 registers) in this \
             process; clients are vfio_user::Client, posted writes use umdev's embedded VMM"
                .into(),
            "ratio = umdev / vfio_user::Server time (< 1: umdev is faster)".into(),
            "these rows run on one CPU (servers and clients alike); the placement table \
             has same core and cross core"
                .into(),
        ],
        started,
    );
    let mut table = pair_table(&report, false);
    if let Some(p) = placement {
        table.push('\n');
        table.push_str(&super::placement::table(p));
    }
    let wire = WireReport {
        pairs: &report,
        placement,
    };
    print_report("wire", &args.run.out, &report.machine, &table, &wire)?;
    println!("{:.1} s", report.elapsed_s);
    Ok(())
}

/// [`POSTED_BATCH`] posted writes, then one REGION_READ that waits for all of them.
fn posted_batch(c: &mut Vmm) -> Io {
    for i in 0..POSTED_BATCH {
        c.posted_write(0, (i as u64 % 64) * 4, &[1, 2, 3, 4])?;
    }
    let mut fence = [0u8; 4];
    c.read_bytes(0, 0, &mut fence)
}
