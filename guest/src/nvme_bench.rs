//! `nvme-bench`: umdev's NVMe controller and QEMU's built-in `-device nvme` side by side in
//! one guest (same QEMU, same kernel, all images on the host's tmpfs), plus a second umdev
//! controller without shadow doorbells (`umdev-trapped`: every doorbell write traps, the
//! other doorbell mode), driven by the stock
//! `nvme` driver through Linux AIO on O_DIRECT block devices, so queue depth is real depth
//! (no thread per request).
//!
//! Loads, each run for [`RUN`] on one disk after the other (the order rotates every round,
//! [`ROUNDS`] rounds, so drift of a shared host hits all alike):
//!
//! | name | what |
//! |---|---|
//! | `seqwrite128k` | 128 KiB sequential writes, queue depth 1 |
//! | `seqread128k` | 128 KiB sequential reads, queue depth 1 |
//! | `randread4k_qd1` | 4 KiB random reads, queue depth 1 |
//! | `randread4k_qd32` | 4 KiB random reads, queue depth 32 |
//!
//! Each run is framed by `UMDEV-READY nvme-bench begin:<disk>:<load>` and
//! `end:<disk>:<load>:<ios>` cues: the host samples the CPU time of QEMU and of umdev's
//! server at each, and reports host CPU per I/O (`vmtest/src/nvme_bench.rs`). A last
//! `idle` phase (the controller enabled, nothing submitted) measures what an idle
//! controller costs the host. The guest reports IOPS / MB/s per disk and their ratios to
//! QEMU's; the checks are only that every I/O completed with its full length.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::time::{Duration, Instant};

use crate::nvme::Aligned;
use crate::report::Report;

/// Length of one run.
const RUN: Duration = Duration::from_secs(2);
/// Rounds (each load on each disk once per round).
const ROUNDS: usize = 2;
/// The idle phase.
const IDLE: Duration = Duration::from_secs(3);
/// The span of each disk the loads use (both namespaces are at least this big).
const SPAN: u64 = 64 << 20;

/// One load.
#[derive(Clone, Copy)]
struct Load {
    name: &'static str,
    write: bool,
    block: usize,
    depth: usize,
    random: bool,
}

const LOADS: [Load; 4] = [
    Load {
        name: "seqwrite128k",
        write: true,
        block: 128 << 10,
        depth: 1,
        random: false,
    },
    Load {
        name: "seqread128k",
        write: false,
        block: 128 << 10,
        depth: 1,
        random: false,
    },
    Load {
        name: "randread4k_qd1",
        write: false,
        block: 4096,
        depth: 1,
        random: true,
    },
    Load {
        name: "randread4k_qd32",
        write: false,
        block: 4096,
        depth: 32,
        random: true,
    },
];

/// Linux AIO's `struct iocb` (x86-64, little endian: key before rw_flags).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Iocb {
    data: u64,
    key: u32,
    rw_flags: u32,
    opcode: u16,
    reqprio: i16,
    fildes: u32,
    buf: u64,
    nbytes: u64,
    offset: i64,
    reserved2: u64,
    flags: u32,
    resfd: u32,
}

/// Linux AIO's `struct io_event`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct IoEvent {
    data: u64,
    obj: u64,
    res: i64,
    res2: i64,
}

const IOCB_CMD_PREAD: u16 = 0;
const IOCB_CMD_PWRITE: u16 = 1;

/// An AIO context of `depth` slots, destroyed on drop.
struct Aio {
    ctx: libc::c_ulong,
}

impl Aio {
    fn new(depth: usize) -> io::Result<Aio> {
        let mut ctx: libc::c_ulong = 0;
        // SAFETY: io_setup writes the new context id to `ctx`, a live local.
        let rc = unsafe { libc::syscall(libc::SYS_io_setup, depth as libc::c_long, &mut ctx) };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Aio { ctx })
    }

    /// Submit one request. The buffer `iocb.buf` points to must stay alive and untouched
    /// until its event is reaped (the callers own one buffer per slot and reap every
    /// submitted slot before dropping them).
    fn submit(&self, iocb: &mut Iocb) -> io::Result<()> {
        let mut list = [iocb as *mut Iocb];
        // SAFETY: `list` holds one pointer to a valid iocb for the call's duration; the
        // kernel copies the iocb at submission. Its buffer's lifetime is the caller's rule
        // above.
        let rc = unsafe { libc::syscall(libc::SYS_io_submit, self.ctx, 1, list.as_mut_ptr()) };
        match rc {
            1 => Ok(()),
            r if r < 0 => Err(io::Error::last_os_error()),
            r => Err(io::Error::other(format!("io_submit queued {r} of 1"))),
        }
    }

    /// Wait for at least one completion (at most 10 s); returns how many `events` holds.
    fn reap(&self, events: &mut [IoEvent]) -> io::Result<usize> {
        let mut timeout = libc::timespec {
            tv_sec: 10,
            tv_nsec: 0,
        };
        // SAFETY: `events` is a live buffer of `events.len()` io_events the kernel fills;
        // `timeout` is a live local.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_io_getevents,
                self.ctx,
                1 as libc::c_long,
                events.len() as libc::c_long,
                events.as_mut_ptr(),
                &mut timeout,
            )
        };
        match rc {
            0 => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no AIO completion within 10 s",
            )),
            r if r < 0 => Err(io::Error::last_os_error()),
            r => Ok(r as usize),
        }
    }
}

impl Drop for Aio {
    fn drop(&mut self) {
        // SAFETY: destroys the context created in `new`; it waits for requests still in
        // flight, so no buffer is written after this returns.
        unsafe { libc::syscall(libc::SYS_io_destroy, self.ctx) };
    }
}

/// Result of one run.
struct Ran {
    ios: u64,
    secs: f64,
}

/// Run `load` on `f` for `dur`: keep `depth` requests in flight, every completion checked
/// for its full length; drain before returning.
fn run_load(f: &File, load: Load, dur: Duration, seed: u64) -> io::Result<Ran> {
    // The buffers outlive the context: its drop waits for requests still in flight.
    let mut bufs: Vec<Aligned> = (0..load.depth)
        .map(|i| Aligned::filled(load.block, 0x40 + i as u8))
        .collect();
    let aio = Aio::new(load.depth)?;
    let blocks = SPAN / load.block as u64;
    let mut rng = seed | 1;
    let mut next_seq = 0u64;
    let mut next_offset = |random: bool| -> i64 {
        let b = if random {
            // xorshift64
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % blocks
        } else {
            let b = next_seq % blocks;
            next_seq += 1;
            b
        };
        (b * load.block as u64) as i64
    };
    let opcode = if load.write {
        IOCB_CMD_PWRITE
    } else {
        IOCB_CMD_PREAD
    };
    let fd = f.as_raw_fd() as u32;
    let mut in_flight = 0usize;
    let mut first_error: Option<io::Error> = None;
    for (slot, buf) in bufs.iter_mut().enumerate() {
        let mut cb = Iocb {
            data: slot as u64,
            opcode,
            fildes: fd,
            buf: buf.addr(),
            nbytes: load.block as u64,
            offset: next_offset(load.random),
            ..Iocb::default()
        };
        aio.submit(&mut cb)?;
        in_flight += 1;
    }
    let start = Instant::now();
    let mut ios = 0u64;
    let mut events = vec![IoEvent::default(); load.depth];
    while in_flight > 0 {
        let n = match aio.reap(&mut events) {
            Ok(n) => n,
            Err(e) => {
                // The context's drop waits for what is still in flight.
                return Err(e);
            }
        };
        for ev in &events[..n] {
            in_flight -= 1;
            if ev.res != load.block as i64 {
                first_error.get_or_insert_with(|| {
                    io::Error::other(format!(
                        "a {} of {} bytes completed with {}",
                        if load.write { "write" } else { "read" },
                        load.block,
                        ev.res
                    ))
                });
                continue;
            }
            ios += 1;
            if first_error.is_none() && start.elapsed() < dur {
                let slot = ev.data as usize;
                let mut cb = Iocb {
                    data: slot as u64,
                    opcode,
                    fildes: fd,
                    buf: bufs[slot].addr(),
                    nbytes: load.block as u64,
                    offset: next_offset(load.random),
                    ..Iocb::default()
                };
                aio.submit(&mut cb)?;
                in_flight += 1;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    drop(aio);
    match first_error {
        Some(e) => Err(e),
        None => Ok(Ran { ios, secs }),
    }
}

/// The serial of umdev's controller with every doorbell trapped (`vmtest`'s
/// `Kind::NvmeTrapped`).
const TRAPPED_SERIAL: &str = "UMDEVTRAPPED";

/// The disks to compare, by their controllers' model and serial: `umdev` (shadow
/// doorbells), `qemu` (QEMU's own), and `umdev-trapped` if present (every doorbell traps).
fn find_disks(timeout: Duration) -> io::Result<Vec<(&'static str, String)>> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut found: Vec<(&'static str, String)> = Vec::new();
        for e in std::fs::read_dir("/sys/block")?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if !name.starts_with("nvme") || !std::path::Path::new(&format!("/dev/{name}")).exists()
            {
                continue;
            }
            let attr = |a: &str| {
                std::fs::read_to_string(format!("/sys/block/{name}/device/{a}"))
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            };
            let label = match (attr("model"), attr("serial")) {
                (m, s) if m.starts_with("umdev") && s == TRAPPED_SERIAL => "umdev-trapped",
                (m, _) if m.starts_with("umdev") => "umdev",
                (m, _) if m.starts_with("QEMU") => "qemu",
                _ => continue,
            };
            found.push((label, name));
        }
        found.sort();
        let has = |l: &str| found.iter().any(|(x, _)| *x == l);
        if has("umdev") && has("qemu") && (has("umdev-trapped") || Instant::now() > deadline) {
            // umdev first, QEMU's second: the ratios are against QEMU's.
            found.sort_by_key(|(l, _)| match *l {
                "umdev" => 0,
                "qemu" => 1,
                _ => 2,
            });
            return Ok(found);
        }
        if Instant::now() > deadline {
            return Err(io::Error::other(format!(
                "after {timeout:?}: found {found:?} (want umdev's and QEMU's namespaces)"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn open(dev: &str) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/dev/{dev}"))
}

/// Run the scenario.
pub fn run(r: &mut Report) -> Option<()> {
    let found = r.ok("nvme-bench.disks", find_disks(Duration::from_secs(30)))?;
    let mut disks = Vec::new();
    for (label, dev) in &found {
        r.note(format_args!("{label}: /dev/{dev}"));
        disks.push((
            *label,
            r.ok(&format!("nvme-bench.open_{label}"), open(dev))?,
        ));
    }
    let n = disks.len();
    // sums[load][disk]: summed ios and seconds over the rounds.
    let mut sums = vec![vec![(0u64, 0f64); n]; LOADS.len()];
    for round in 0..ROUNDS {
        for (li, load) in LOADS.iter().enumerate() {
            for k in 0..n {
                // Each round starts with another disk, so none always goes first.
                let d = (k + round) % n;
                let (disk, f) = (disks[d].0, &disks[d].1);
                r.ready(&format!("begin:{disk}:{}", load.name));
                let res = run_load(f, *load, RUN, 0x9e37_79b9 + (round * 8 + li) as u64);
                let ios = res.as_ref().map_or(0, |x| x.ios);
                r.ready(&format!("end:{disk}:{}:{ios}", load.name));
                let name = format!("nvme-bench.{disk}.{}.r{round}", load.name);
                let ran = r.ok(&name, res)?;
                r.check(
                    &format!("{name}.ios"),
                    ran.ios > 0,
                    format_args!("{} I/Os in {:.2} s", ran.ios, ran.secs),
                );
                sums[li][d].0 += ran.ios;
                sums[li][d].1 += ran.secs;
            }
        }
    }
    for (li, load) in LOADS.iter().enumerate() {
        let big = load.block >= 64 << 10;
        let rate = |d: usize| {
            let (ios, secs) = sums[li][d];
            let per_s = ios as f64 / secs.max(1e-9);
            if big {
                per_s * load.block as f64 / 1e6
            } else {
                per_s
            }
        };
        let unit = if big { "MB/s" } else { "IOPS" };
        let qemu = rate(1);
        for (d, (disk, _)) in disks.iter().enumerate() {
            r.measure(&format!("{disk}.{}", load.name), rate(d), unit);
            if d != 1 {
                r.measure(
                    &format!("ratio.{disk}.{}", load.name),
                    rate(d) / qemu.max(1e-9),
                    "x_qemu",
                );
            }
        }
    }
    drop(disks);
    r.ready("begin:umdev:idle");
    std::thread::sleep(IDLE);
    r.ready("end:umdev:idle:0");
    Some(())
}
