//! mmio-latency: what a guest waits for a trapped register. The same guest times reads and
//! writes of a register of a umdev device (hello's ID and ADDR registers: every access is
//! a vfio-user REGION_READ/REGION_WRITE message to the hello server) and of a register of
//! QEMU's built-in `edu` device (emulated inside QEMU), one access at a time, and reports
//! the median and p99 of each as measures, with umdev's cost as a ratio of QEMU's.
//!
//! The checks are correctness only (every read returns the register's value); the
//! latencies are measurements, judged in docs/benchmarks.md, not here (a shared CI machine
//! cannot hold a latency target).

use std::time::Instant;

use crate::pci::{command, Mmio, PciDev};
use crate::report::Report;

const HELLO: (u16, u16) = (0x1af4, 0x10f0);
const HELLO_ID: u64 = 0x00;
const HELLO_ADDR: u64 = 0x08;
const HELLO_MAGIC: u32 = 0x4845_4c4f;
/// QEMU's `edu` (docs/specs/edu.rst): 0x00 identification, 0x04 liveness check (reads
/// back the bitwise inverse of what was written).
const EDU: (u16, u16) = (0x1234, 0x11e8);
const EDU_ID: u64 = 0x00;
const EDU_LIVENESS: u64 = 0x04;
/// Accesses per register and direction (after a warm-up of a tenth as many).
const N: usize = 4000;

/// Per-access latencies in µs, sorted.
struct Samples(Vec<f64>);

impl Samples {
    fn time(n: usize, mut access: impl FnMut(usize) -> bool) -> (Samples, usize) {
        for i in 0..n / 10 {
            access(i);
        }
        let mut v = Vec::with_capacity(n);
        let mut bad = 0;
        for i in 0..n {
            let t = Instant::now();
            let ok = access(i);
            v.push(t.elapsed().as_secs_f64() * 1e6);
            bad += usize::from(!ok);
        }
        v.sort_by(f64::total_cmp);
        (Samples(v), bad)
    }

    fn quantile(&self, q: f64) -> f64 {
        let i = ((self.0.len() as f64 - 1.0) * q).round() as usize;
        self.0.get(i).copied().unwrap_or(f64::NAN)
    }
}

fn map(r: &mut Report, who: &str, ids: (u16, u16)) -> Option<Mmio> {
    let dev = r.ok(&format!("{who}.find"), PciDev::find(ids.0, ids.1))?;
    r.ok(
        &format!("{who}.enable"),
        dev.update_command(command::MEMORY, 0),
    )?;
    r.ok(&format!("{who}.bar0"), dev.bar(0))
}

/// Time `n` reads and `n` writes; report them under `who`; the medians (read, write).
fn measure(
    r: &mut Report,
    who: &str,
    n: usize,
    read: impl Fn() -> bool,
    write: impl Fn(usize) -> bool,
) -> (f64, f64) {
    let (reads, bad_reads) = Samples::time(n, |_| read());
    let (writes, bad_writes) = Samples::time(n, write);
    r.check(
        &format!("{who}.reads_correct"),
        bad_reads == 0,
        format_args!("{bad_reads} of {n} reads returned a wrong value"),
    );
    r.check(
        &format!("{who}.writes_correct"),
        bad_writes == 0,
        format_args!("{bad_writes} of {n} writes failed or read back wrong"),
    );
    for (what, s) in [("read", &reads), ("write", &writes)] {
        r.measure(&format!("{who}_{what}_median"), s.quantile(0.5), "us");
        r.measure(&format!("{who}_{what}_p99"), s.quantile(0.99), "us");
    }
    (reads.quantile(0.5), writes.quantile(0.5))
}

/// Run the scenario.
pub fn run(r: &mut Report) -> Option<()> {
    let hello = map(r, "hello", HELLO)?;
    let edu = map(r, "edu", EDU)?;
    let (edu_read, edu_write) = measure(
        r,
        "edu",
        N,
        || edu.read32(EDU_ID).is_ok_and(|v| v & 0xff == 0xed),
        // A write, then its read-back every 64th time (a write alone is the timed access
        // otherwise; a read-back would time a read too).
        |i| {
            let v = i as u32 ^ 0x5a5a_0000;
            edu.write32(EDU_LIVENESS, v).is_ok()
                && (i % 64 != 0 || edu.read32(EDU_LIVENESS).is_ok_and(|got| got == !v))
        },
    );
    let (hello_read, hello_write) = measure(
        r,
        "hello",
        N,
        || hello.read32(HELLO_ID).is_ok_and(|v| v == HELLO_MAGIC),
        // ADDR only latches an address for the next doorbell (none is rung here).
        |i| {
            hello.write32(HELLO_ADDR, (i as u32) << 12).is_ok()
                && (i % 64 != 0
                    || hello
                        .read32(HELLO_ADDR)
                        .is_ok_and(|got| got == (i as u32) << 12))
        },
    );
    r.measure("read_ratio_median", hello_read / edu_read, "x");
    r.measure("write_ratio_median", hello_write / edu_write, "x");
    r.note(format_args!(
        "median read: umdev hello {hello_read:.1} µs, QEMU edu {edu_read:.1} µs ({:.1}×); \
         write: {hello_write:.1} µs vs {edu_write:.1} µs ({:.1}×)",
        hello_read / edu_read,
        hello_write / edu_write
    ));
    Some(())
}
