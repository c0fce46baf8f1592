//! Peak memory of a migration destination fed a hostile stream, through a real socket: a
//! GPU (32 MiB framebuffer) in RESUMING gets MIG_DATA_WRITEs of max_data_xfer_size, and
//! the growth of the process's peak RSS (VmHWM, reset with `/proc/self/clear_refs` just
//! before the stream's measured part, after `malloc_trim` returned the test's own freed
//! memory) is compared with the size of the data.
//!
//! Each case runs in a child process (this binary, re-run with `MIG_RSS_CASE` set), since
//! VmHWM is per process and tests of one binary share it:
//! - `precopy-dup`: a 24 MiB PRE_COPY chunk of 3-byte pages, all of them page 0 (8 Mi
//!   duplicates, each a 32-byte `Page` once decoded whole);
//! - `precopy-pages`: a 24 MiB PRE_COPY chunk of 6144 distinct whole pages (legitimate data,
//!   into a framebuffer made resident first by a PRE_COPY chunk 0);
//! - `pci-section`: a State frame whose PCI section carries 32 MiB of "config space".

use std::process::Command;
use std::time::{Duration, Instant};

use umdev::migration::stream::{write_precopy, write_start, write_state_and_end};
use umdev::migration::{encode_state, MigState};
use umdev::testing::{wait_until, TestServer, Vmm};
use umdev_devices::gpu::migration::wire::{PRECOPY_FORMAT, PRECOPY_VERSION};
use umdev_devices::gpu::{Gpu, GpuConfig};

const FB_SIZE: u64 = 32 << 20;
const PAGE: usize = 4096;
const CASE_VAR: &str = "MIG_RSS_CASE";

fn status_kib(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Reset VmHWM to the current RSS (`clear_refs` 5); false where that is not allowed.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// A GPU PRE_COPY chunk (`ChunkV1`) written by hand, so the test itself never holds the
/// pages decoded: `pages` already encoded, `count` of them.
fn chunk(seq: u32, count: u64, pages: &[u8]) -> Vec<u8> {
    let mut c = encode_state(PRECOPY_FORMAT, PRECOPY_VERSION, &(FB_SIZE, seq)).unwrap();
    varint(count, &mut c);
    c.extend_from_slice(pages);
    c
}

/// Chunk 0: every page, solid 0 (small on the wire; the destination writes every page of
/// its framebuffer, so the framebuffer is resident before the measured part).
fn chunk0() -> Vec<u8> {
    let n = FB_SIZE / PAGE as u64;
    let mut pages = Vec::new();
    for i in 0..n {
        varint(i, &mut pages);
        pages.extend([0, 0]); // Solid(0)
    }
    chunk(0, n, &pages)
}

/// The stream's parts: what is written before the measurement, and the measured part.
fn case_stream(case: &str) -> (Vec<u8>, Vec<u8>) {
    let mut before = Vec::new();
    write_start(&mut before).unwrap();
    write_precopy(&chunk0(), &mut before).unwrap();
    let mut measured = Vec::new();
    match case {
        "precopy-dup" => {
            let count = (24 << 20) / 3;
            let pages = vec![0u8; count * 3]; // index 0, Solid, 0
            write_precopy(&chunk(1, count as u64, &pages), &mut measured).unwrap();
        }
        "precopy-pages" => {
            let count = (24 << 20) / PAGE;
            let mut pages = Vec::with_capacity(count * (PAGE + 8));
            for i in 0..count {
                varint(i as u64, &mut pages);
                pages.push(1); // Bytes
                varint(PAGE as u64, &mut pages);
                pages.extend((0..PAGE).map(|b| (b * 7 + i) as u8));
            }
            write_precopy(&chunk(1, count as u64, &pages), &mut measured).unwrap();
        }
        "pci-section" => {
            // {config: 32 MiB, msix_table: [], masks: [], [], msi_pending: 0, intx: false}
            let pci = encode_state(
                "umdev-pci",
                1,
                &(
                    vec![0u8; 32 << 20],
                    Vec::<[u32; 3]>::new(),
                    Vec::<u64>::new(),
                    Vec::<u64>::new(),
                    0u64,
                    false,
                ),
            )
            .unwrap();
            let function = encode_state("umdev-pci-function", 1, &(pci, Vec::<u8>::new())).unwrap();
            write_state_and_end(&function, &mut measured).unwrap();
        }
        other => panic!("no case {other}"),
    }
    (before, measured)
}

/// The child's side: prints `peak_growth_kib data_kib`.
fn run_case(case: &str) {
    let gpu = Gpu::new(GpuConfig { fb_size: FB_SIZE }).unwrap();
    let served = TestServer::builder_pci(gpu).unwrap().start().unwrap();
    let mut vmm = Vmm::connect(served.path()).unwrap();
    vmm.set_mig_state(MigState::Resuming).unwrap();
    let (before, measured) = case_stream(case);
    vmm.mig_write_all(&before).unwrap();
    drop(before);
    // The stream was built through temporaries; give their memory back to the kernel so
    // the destination cannot reuse it unseen (glibc keeps freed heap memory otherwise).
    // SAFETY: malloc_trim only releases free heap memory; no pointer is involved.
    unsafe { libc::malloc_trim(0) };
    let reset = reset_peak();
    let base = if reset {
        status_kib("VmHWM:")
    } else {
        status_kib("VmRSS:")
    };
    // Refused somewhere (a write, or the load at RESUMING -> STOP) or loaded: either way
    // the destination's memory is what is measured.
    let t = Instant::now();
    let written = vmm.mig_write_all(&measured);
    let stopped = vmm.set_mig_state(MigState::Stop);
    // A load that outlasted the client's receive timeout still holds the device: wait
    // for it before the peak is read.
    drop(served.device());
    let peak = status_kib("VmHWM:");
    eprintln!(
        "{case}: write {:?}, stop {:?}, peak reset {reset}, {:?}, base {base} KiB, peak {peak} KiB",
        written.err().map(|e| e.to_string()),
        stopped.err().map(|e| e.to_string()),
        t.elapsed()
    );
    // The server still serves: the next client finds the device RUNNING.
    drop(vmm);
    assert!(wait_until(Duration::from_secs(600), || !served.client_attached()));
    let mut vmm = served.connect().unwrap();
    assert_eq!(vmm.mig_state().unwrap(), MigState::Running);
    println!(
        "MIG_RSS {} {}",
        peak.saturating_sub(base),
        measured.len() / 1024
    );
}

#[test]
fn test_migration_rss_case_child() {
    if let Ok(case) = std::env::var(CASE_VAR) {
        run_case(&case);
    }
}

#[test]
fn test_migration_load_hostile_stream_peak_rss_at_most_1_5x_the_data() {
    let exe = std::env::current_exe().unwrap();
    for case in ["precopy-dup", "precopy-pages", "pci-section"] {
        let out = Command::new(&exe)
            .args(["--exact", "test_migration_rss_case_child", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(CASE_VAR, case)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{case}: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (growth, data) = stdout
            .lines()
            .find_map(|l| {
                let mut w = l.strip_prefix("MIG_RSS ")?.split_whitespace();
                Some((
                    w.next()?.parse::<u64>().ok()?,
                    w.next()?.parse::<u64>().ok()?,
                ))
            })
            .unwrap_or_else(|| panic!("{case}: no result in {stdout}"));
        let ratio = growth as f64 / data as f64;
        eprintln!("{case}: peak RSS +{growth} KiB for {data} KiB of data ({ratio:.2}x)");
        assert!(
            ratio <= 1.5,
            "{case}: peak RSS grew by {growth} KiB for {data} KiB of data ({ratio:.2}x)"
        );
    }
}
