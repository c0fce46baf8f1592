//! hello (examples/hello.rs): the counter in guest memory reaches 42 through three
//! doorbells, each answered by an INTx.

use std::time::{Duration, Instant};

use crate::mem::DmaBuf;
use crate::pci::{command, PciDev};
use crate::report::Report;
use crate::uio::Uio;

const VENDOR: u16 = 0x1af4;
const DEVICE: u16 = 0x10f0;
const REG_ID: u64 = 0x00;
const REG_ADDR: u64 = 0x08;
const REG_DOORBELL: u64 = 0x10;
const MAGIC: u32 = 0x4845_4c4f;

/// Run the scenario.
pub fn run(r: &mut Report) -> Option<()> {
    let dev = r.ok("hello.find", PciDev::find(VENDOR, DEVICE))?;
    let mut uio = r.ok("hello.uio_bind", Uio::bind(&dev))?;
    r.ok(
        "hello.enable",
        dev.update_command(command::MEMORY | command::BUS_MASTER, command::INTX_DISABLE),
    )?;
    let bar = r.ok("hello.bar0", dev.bar(0))?;
    let id = r.ok("hello.id_read", bar.read32(REG_ID))?;
    r.check("hello.id", id == MAGIC, format_args!("{id:#x}"));
    let counter = r.ok("hello.alloc", DmaBuf::new(1))?;
    r.ok("hello.addr", bar.write32(REG_ADDR, counter.addr(0) as u32))?;
    let mut interrupts = 0;
    for add in [1u32, 2, 39] {
        r.ok("hello.doorbell", bar.write32(REG_DOORBELL, add))?;
        let got = uio.wait(Duration::from_secs(10)).unwrap_or(0);
        interrupts += got;
        let _ = Uio::reenable(&dev);
    }
    // The interrupt follows the DMA write, but poll briefly in case INTx was lost.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut value = counter.read_u64(0).unwrap_or(0);
    while value != 42 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
        value = counter.read_u64(0).unwrap_or(0);
    }
    r.check(
        "hello.counter_42",
        value == 42,
        format_args!("counter = {value}"),
    );
    r.check(
        "hello.intx_3",
        interrupts == 3,
        format_args!("{interrupts} INTx for 3 doorbells"),
    );
    Some(())
}
