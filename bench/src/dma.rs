//! `umdev bench dma`: the cost of `DmaHandle::read`/`write` (dma_rw) against the physical
//! limit, and of a lookup per call against the held handle.
//!
//! Three comparisons per size (8 B … 16 MiB), each sampled interleaved:
//! - **read / write: dma_rw vs memcpy** — `DmaHandle::read`/`write` at an IOVA against a
//!   plain `copy_nonoverlapping` between a local buffer and a second local mapping of the
//!   *same* memfd pages: same memory, no translation, no checks, so the physical limit.
//! - **read: lookup per call vs held handle** — the held path calls `read` on the
//!   `DmaHandle` the device keeps. The lookup path models a device that does not keep it:
//!   per call it locks a process-wide registry (`Mutex<HashMap<device id, Arc<DmaSpace>>>`
//!   with 16 devices), clones the space out, builds a handle with `space.handle()`, reads,
//!   and drops both — the user-space analog of the per-call group lookup and reference that
//!   seeds/03 removed from the kernel's vfio_dma_rw path.
//! - **read / write: fd-less vs fd-backed** — the same `DmaHandle::read`/`write` on a region
//!   the client mapped without an fd, so every access becomes server→client DMA_READ or
//!   DMA_WRITE messages (split at the negotiated 1 MiB max_data_xfer_size) through a real
//!   umdev server socket, answered by a client thread from its own memory; against the
//!   fd-backed region.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use umdev::dma::{DmaConfig, DmaError, DmaHandle, DmaMapping, DmaSpace, Prot};

use super::local_mapping::{memfd, LocalMapping};
use super::progress::Progress;
use super::report::{pair_table, print_report, PairReport, PairRow, SideResult};
use super::sampler::interleaved;
use super::PairArgs;
use crate::BenchError;
use umdev::server::{Server, ServerConfig};
use umdev::testing::{FdlessMemory, TrivialDevice, Vmm};

/// IOVA of the bench region.
pub const REGION_IOVA: u64 = 1 << 30;
/// IOVA of the fd-less region.
pub const FDLESS_IOVA: u64 = 1 << 34;
/// Largest accepted operation size (the region is twice this).
pub const MAX_SIZE: u64 = 64 << 20;
/// Devices in the lookup-per-call registry.
pub const REGISTRY_DEVICES: u64 = 16;

/// Arguments of `umdev bench dma`.
#[derive(clap::Args, Debug)]
pub struct DmaArgs {
    /// Operation sizes in bytes.
    #[arg(long, value_delimiter = ',', default_values_t = vec![8u64, 64, 512, 4096, 32768, 262144, 2097152, 16777216])]
    pub sizes: Vec<u64>,
    /// Sampling and output options.
    #[command(flatten)]
    pub run: PairArgs,
}

/// `v` as a `usize` (sizes are checked against [`MAX_SIZE`] first, so this fails only on a
/// 32-bit host).
fn to_usize(v: u64) -> Result<usize, BenchError> {
    usize::try_from(v).map_err(|_| BenchError::Options(format!("size {v} does not fit usize")))
}

/// Entry point of `umdev bench dma`.
pub fn run(args: DmaArgs) -> Result<(), BenchError> {
    let started = Instant::now();
    let plan = args.run.plan((10.0, 2.0), 10_000_000);
    if let Some(&bad) = args.sizes.iter().find(|&&s| s == 0 || s > MAX_SIZE) {
        return Err(BenchError::Options(format!(
            "size {bad} out of range 1..={MAX_SIZE}"
        )));
    }
    let max = args.sizes.iter().copied().max().unwrap_or(8);
    let region = max.next_multiple_of(2 << 20);
    let fd = memfd("umdev-bench-dma", 0, region)?;
    let region_len = to_usize(region)?;
    let local = LocalMapping::new(&fd, region_len)?;
    local.touch(4096);
    let space = DmaSpace::new(DmaConfig::default());
    space.map(DmaMapping {
        iova: REGION_IOVA,
        size: region,
        prot: Prot::RW,
        fd: Some(fd),
        offset: 0,
    })?;
    let handle = space.handle();
    let mut registry: HashMap<u64, Arc<DmaSpace>> = (0..REGISTRY_DEVICES)
        .map(|id| (id, DmaSpace::new(DmaConfig::default())))
        .collect();
    let our_id = REGISTRY_DEVICES / 2;
    registry.insert(our_id, space.clone());
    let registry = Mutex::new(registry);

    // The fd-less region: a umdev server on the same space, a client that maps a region
    // without an fd and answers the server's DMA_READ/DMA_WRITE from its own memory.
    let sock_dir = tempfile::Builder::new()
        .prefix("umdev-bench-dma-")
        .tempdir()?;
    let running = Server::new(
        ServerConfig::new(sock_dir.path().join("dma.sock")),
        Box::new(TrivialDevice::default()),
        space.clone(),
    )
    .spawn()?;
    let mut client = Vmm::connect(running.path())?;
    let mut fdless = FdlessMemory::new(FDLESS_IOVA, region_len);
    fdless.set_keep_log(false);
    client.set_fdless(fdless);
    client.dma_map_fdless(FDLESS_IOVA, region)?;
    let dma_server = client.serve_in_background()?;

    let mut progress = Progress::for_run(args.run.out.quiet, args.sizes.len() * 5);
    let mut rows = Vec::new();
    for &size in &args.sizes {
        let len = to_usize(size)?;
        let mut buf = vec![0u8; len];
        let mut buf2 = vec![0u8; len];
        let src = vec![0xa5u8; len];

        progress.start_step(&format!("read {size} B"));
        let (a, b) = interleaved(
            &plan,
            &mut || handle.read(REGION_IOVA, &mut buf),
            &mut || -> Result<(), DmaError> {
                local.copy_to(&mut buf2);
                Ok(())
            },
            &mut || 0,
        )?;
        rows.push(PairRow::new(
            "read: dma_rw vs memcpy",
            size,
            SideResult::new("DmaHandle::read", &a),
            SideResult::new("memcpy", &b),
        ));
        progress.finish_step();

        progress.start_step(&format!("write {size} B"));
        let (a, b) = interleaved(
            &plan,
            &mut || handle.write(REGION_IOVA, &src),
            &mut || -> Result<(), DmaError> {
                local.copy_from(&src);
                Ok(())
            },
            &mut || 0,
        )?;
        rows.push(PairRow::new(
            "write: dma_rw vs memcpy",
            size,
            SideResult::new("DmaHandle::write", &a),
            SideResult::new("memcpy", &b),
        ));
        progress.finish_step();

        progress.start_step(&format!("lookup {size} B"));
        let (a, b) = interleaved(
            &plan,
            &mut || -> Result<(), DmaError> {
                let space = {
                    let reg = registry.lock().unwrap_or_else(|p| p.into_inner());
                    reg.get(&our_id)
                        .cloned()
                        .ok_or(DmaError::NotMapped { iova: REGION_IOVA })?
                };
                let h: DmaHandle = space.handle();
                h.read(REGION_IOVA, &mut buf)
            },
            &mut || handle.read(REGION_IOVA, &mut buf2),
            &mut || 0,
        )?;
        rows.push(PairRow::new(
            "read: lookup per call vs held handle",
            size,
            SideResult::new("lookup+read", &a),
            SideResult::new("held read", &b),
        ));
        progress.finish_step();

        progress.start_step(&format!("fd-less read {size} B"));
        let (a, b) = interleaved(
            &plan,
            &mut || handle.read(FDLESS_IOVA, &mut buf),
            &mut || handle.read(REGION_IOVA, &mut buf2),
            &mut || 0,
        )?;
        rows.push(PairRow::new(
            "read: fd-less (DMA_READ messages) vs fd-backed",
            size,
            SideResult::new("fd-less read", &a),
            SideResult::new("fd-backed read", &b),
        ));
        progress.finish_step();

        progress.start_step(&format!("fd-less write {size} B"));
        let (a, b) = interleaved(
            &plan,
            &mut || handle.write(FDLESS_IOVA, &src),
            &mut || handle.write(REGION_IOVA, &src),
            &mut || 0,
        )?;
        rows.push(PairRow::new(
            "write: fd-less (DMA_WRITE messages) vs fd-backed",
            size,
            SideResult::new("fd-less write", &a),
            SideResult::new("fd-backed write", &b),
        ));
        progress.finish_step();
    }
    progress.finish();
    space.unmap(REGION_IOVA, region, &mut |_, _| {})?;
    let served = dma_server.stop()?;
    running.shutdown()?;
    drop(sock_dir);
    drop(local);
    tracing::debug!(served, "fd-less DMA requests served");

    let report = PairReport::new(
        "dma",
        plan,
        rows,
        vec![
            "memcpy: copy_nonoverlapping between a local buffer and a second mapping of the \
             same memfd pages (the physical limit)"
                .into(),
            "lookup+read: per call, lock a registry Mutex<HashMap<id, Arc<DmaSpace>>> of 16 \
             devices, clone the space, space.handle(), read, drop"
                .into(),
            "fd-less: DmaHandle::read/write on a region mapped without fd through a real \
             umdev server socket; the client answers DMA_READ/DMA_WRITE from its memory"
                .into(),
        ],
        started,
    );
    print_report(
        "dma",
        &args.run.out,
        &report.machine,
        &pair_table(&report, true),
        &report,
    )?;
    println!("{:.1} s", report.elapsed_s);
    Ok(())
}
