//! The example devices' guest drivers on umdev's test harness ([`umdev::testing`]): BAR0 as
//! the GPU driver's [`RegisterAccess`] over any [`DeviceAccess`] (the embedded
//! [`Vmm`](umdev::testing::Vmm) through the socket, or a `PciAdapter` in-process), guest
//! memory as the driver's [`GuestRam`], the ccw guest driver's whole round trip
//! ([`run_ccw_program`]) and its data-moving programs ([`ccw_chain`]); and, in
//! [`migration`], the devices moved by live migration (a GPU scene drawn across one).
//!
//! Needs the `testing` feature (which turns on umdev's).

use std::io;
use std::time::Duration;

use umdev::device::region_index;
use umdev::testing::{wait_eventfd, DeviceAccess, GuestMemory};
use vmm_sys_util::eventfd::EventFd;

use crate::ccw::driver::{self as ccw, regs as ccw_regs, CcwWord, OperationBlock, StatusBlock};
use crate::gpu::driver::{GuestRam, RegisterAccess};

pub mod migration;

/// Bytes each CCW of a [`ccw_chain`] program moves (32 KiB).
pub const CCW_CHUNK: u64 = 32 << 10;

/// BAR0 of a device, for the guest drivers: `Bar0(&mut vmm)` through the socket,
/// `Bar0(adapter)` in-process. 64-bit registers are written with one 8-byte access.
#[derive(Debug)]
pub struct Bar0<A>(pub A);

impl<A: DeviceAccess> RegisterAccess for Bar0<A> {
    fn read32(&mut self, off: u64) -> io::Result<u32> {
        self.0.read32(region_index::BAR0, off)
    }

    fn write32(&mut self, off: u64, val: u32) -> io::Result<()> {
        self.0.write32(region_index::BAR0, off, val)
    }

    fn write64(&mut self, off: u64, val: u64) -> io::Result<()> {
        self.0.write64(region_index::BAR0, off, val)
    }
}

impl GuestRam for GuestMemory {
    fn write(&mut self, gpa: u64, data: &[u8]) -> io::Result<()> {
        GuestMemory::write(self, gpa, data)
    }

    fn read(&mut self, gpa: u64, buf: &mut [u8]) -> io::Result<()> {
        GuestMemory::read(self, gpa, buf)
    }
}

/// Act as the ccw guest driver: place `program`, an operation block and a status block at
/// the start of `ram` (operation block at +0, status at +0x80, program at +0x100), START it
/// on `block`, wait (≤ 5 s) for the completion interrupt on `irq`, acknowledge it and return
/// the status block the device stored.
pub fn run_ccw_program(
    dev: &mut impl DeviceAccess,
    ram: &GuestMemory,
    irq: &EventFd,
    program: &[CcwWord],
    block: u64,
) -> io::Result<StatusBlock> {
    let base = ram.base();
    let (opb, status, prog) = (base, base + 0x80, base + 0x100);
    ram.write(prog, &ccw::encode_program(program))?;
    let ob = OperationBlock {
        program: prog,
        block,
        status,
        flags: 0,
        reserved: 0,
    };
    ram.write(opb, &ob.to_bytes())?;
    let bar = region_index::BAR0;
    dev.write32(bar, ccw_regs::OPB_ADDR_LO, opb as u32)?;
    dev.write32(bar, ccw_regs::OPB_ADDR_HI, (opb >> 32) as u32)?;
    dev.write32(bar, ccw_regs::START, 1)?;
    if wait_eventfd(irq, Duration::from_secs(5)).is_none() {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "ccw: no completion interrupt within 5 s",
        ));
    }
    dev.write32(bar, ccw_regs::IRQ_STATUS, ccw_regs::IRQ_ALL)?;
    let mut sb = [0u8; ccw::STATUS_BLOCK_SIZE];
    ram.read(status, &mut sb)?;
    Ok(StatusBlock::from_bytes(&sb))
}

/// A program of `ccws` chained CCWs moving `ccws` × [`CCW_CHUNK`] bytes between the image
/// (from the operation block's block on) and guest memory at `data` (contiguous): to the
/// image when `write`, from it otherwise.
pub fn ccw_chain(write: bool, data: u64, ccws: u64) -> Vec<CcwWord> {
    (0..ccws)
        .map(|i| {
            let addr = data + i * CCW_CHUNK;
            let w = if write {
                CcwWord::write(CCW_CHUNK as u16, addr)
            } else {
                CcwWord::read(CCW_CHUNK as u16, addr)
            };
            if i + 1 < ccws {
                w.chain()
            } else {
                w
            }
        })
        .collect()
}
