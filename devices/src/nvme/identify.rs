//! The Identify data structures (4096 bytes each), the log pages, built from the
//! controller's limits and its namespace.

use super::ctrl::{Limits, Shared};
use super::namespace::BLOCK_SIZE;

/// Identify and log page buffer size.
pub const IDENTIFY_SIZE: usize = 4096;
/// Warning composite temperature threshold (kelvin).
pub const WCTEMP: u16 = 343;
/// Critical composite temperature threshold (kelvin).
pub const CCTEMP: u16 = 373;
/// The composite temperature the controller reports (kelvin).
pub const TEMPERATURE: u16 = 310;
/// PCI vendor ID, also Identify VID/SSVID (the unregistered experimental vendor ID the
/// ccw device uses too).
pub const VENDOR_ID: u16 = 0x1234;
/// PCI device ID.
pub const DEVICE_ID: u16 = 0x0e4e;
/// Abort Command Limit, 0-based.
pub const ACL: u8 = 3;
/// Asynchronous Event Request Limit, 0-based.
pub const AERL: u8 = 3;
/// Error log entries, 0-based.
pub const ELPE: u8 = 3;
/// OACS bit: Doorbell Buffer Config.
pub const OACS_DBBUF: u16 = 1 << 8;
/// ONCS bits: Dataset Management (2) and Write Zeroes (3).
pub const ONCS: u16 = 1 << 2 | 1 << 3;

fn put(b: &mut [u8], at: usize, v: &[u8]) {
    b[at..at + v.len()].copy_from_slice(v);
}

/// `s` padded with spaces to `n` bytes (truncated if longer), as Identify strings are.
fn ascii(s: &str, n: usize) -> Vec<u8> {
    let mut v: Vec<u8> = s
        .bytes()
        .filter(|c| c.is_ascii_graphic() || *c == b' ')
        .take(n)
        .collect();
    v.resize(n, b' ');
    v
}

/// Identify Controller (CNS 01h).
pub fn controller(limits: &Limits, oacs: u16) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_SIZE];
    put(&mut b, 0x00, &VENDOR_ID.to_le_bytes());
    put(&mut b, 0x02, &VENDOR_ID.to_le_bytes());
    put(&mut b, 0x04, &ascii(&limits.serial, 20));
    put(&mut b, 0x18, &ascii("umdev NVMe Ctrl", 40));
    put(&mut b, 0x40, &ascii("1.0", 8));
    b[0x48] = 6; // RAB
    b[0x4d] = limits.mdts; // MDTS
    put(&mut b, 0x4e, &1u16.to_le_bytes()); // CNTLID
    put(&mut b, 0x50, &super::regs::VERSION_1_4.to_le_bytes()); // VER
    b[0x6f] = 1; // CNTRLTYPE: I/O controller
    put(&mut b, 0x100, &oacs.to_le_bytes());
    b[0x102] = ACL;
    b[0x103] = AERL;
    b[0x104] = 0x03; // FRMW: one slot, read-only
    b[0x105] = 0x00; // LPA
    b[0x106] = ELPE;
    b[0x107] = 0; // NPSS: one power state
    put(&mut b, 0x10a, &WCTEMP.to_le_bytes());
    put(&mut b, 0x10c, &CCTEMP.to_le_bytes());
    b[0x200] = 0x66; // SQES
    b[0x201] = 0x44; // CQES
    put(&mut b, 0x202, &0u16.to_le_bytes()); // MAXCMD (not reported)
    put(&mut b, 0x204, &1u32.to_le_bytes()); // NN
    put(&mut b, 0x208, &ONCS.to_le_bytes());
    b[0x20d] = 0x01; // VWC present
                     // SGLS (0x218) = 0: PRPs only.
    let nqn = format!("nqn.2024-01.dev.umdev:nvme:{}", limits.serial);
    put(&mut b, 0x300, &nqn.as_bytes()[..nqn.len().min(255)]);
    // Power state 0: 9.00 W, entry/exit latency unreported.
    put(&mut b, 0x800, &900u16.to_le_bytes());
    b
}

/// A namespace globally unique identifier derived from the serial.
pub fn nguid(limits: &Limits) -> [u8; 16] {
    let mut g = [0u8; 16];
    put(&mut g, 0, b"umdv");
    for (i, c) in limits.serial.bytes().take(11).enumerate() {
        g[4 + i] = c;
    }
    g[15] = 1;
    g
}

/// Identify Namespace (CNS 00h) of namespace 1.
pub fn namespace(shared: &Shared) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_SIZE];
    let blocks = shared.ns.blocks();
    put(&mut b, 0x00, &blocks.to_le_bytes()); // NSZE
    put(&mut b, 0x08, &blocks.to_le_bytes()); // NCAP
    put(&mut b, 0x10, &blocks.to_le_bytes()); // NUSE
    b[0x19] = 0; // NLBAF: one format
    b[0x1a] = 0; // FLBAS: format 0
    put(&mut b, 0x68, &nguid(&shared.limits));
    // LBA format 0: no metadata, 2^9 bytes.
    b[0x82] = BLOCK_SIZE.trailing_zeros() as u8;
    b
}

/// Active Namespace ID list (CNS 02h) of the namespaces above `nsid`.
pub fn active_list(nsid: u32) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_SIZE];
    if nsid < 1 {
        put(&mut b, 0, &1u32.to_le_bytes());
    }
    b
}

/// Namespace Identification Descriptor list (CNS 03h) of namespace 1: its NGUID and its
/// command set (NVM).
pub fn descriptors(limits: &Limits) -> Vec<u8> {
    let mut b = vec![0u8; IDENTIFY_SIZE];
    b[0] = 0x02; // NIDT: NGUID
    b[1] = 16;
    put(&mut b, 4, &nguid(limits));
    b[20] = 0x04; // NIDT: command set identifier
    b[21] = 1;
    b[24] = 0; // NVM
    b
}

/// SMART / Health Information log page (512 bytes).
pub fn smart_log(shared: &Shared) -> Vec<u8> {
    use std::sync::atomic::Ordering::Relaxed;
    let c = &shared.counters;
    let mut b = vec![0u8; 512];
    put(&mut b, 1, &TEMPERATURE.to_le_bytes());
    b[3] = 100; // available spare
    b[4] = 10; // available spare threshold
               // Data units are thousands of 512-byte units, rounded up.
    let units = |blocks: u64| blocks.div_ceil(1000) as u128;
    put(
        &mut b,
        32,
        &units(c.blocks_read.load(Relaxed)).to_le_bytes(),
    );
    put(
        &mut b,
        48,
        &units(c.blocks_written.load(Relaxed)).to_le_bytes(),
    );
    put(&mut b, 64, &(c.reads.load(Relaxed) as u128).to_le_bytes());
    put(&mut b, 80, &(c.writes.load(Relaxed) as u128).to_le_bytes());
    put(
        &mut b,
        160,
        &(c.media_errors.load(Relaxed) as u128).to_le_bytes(),
    );
    b
}

/// Firmware Slot Information log page (512 bytes): slot 1 active, revision "1.0".
pub fn firmware_log() -> Vec<u8> {
    let mut b = vec![0u8; 512];
    b[0] = 1;
    put(&mut b, 8, &ascii("1.0", 8));
    b
}

/// Error Information log page: `ELPE + 1` entries of 64 bytes (no entries are kept: all
/// zero, error count 0).
pub fn error_log() -> Vec<u8> {
    vec![0u8; (usize::from(ELPE) + 1) * 64]
}
