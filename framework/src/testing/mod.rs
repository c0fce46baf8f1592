//! The test harness for device authors: serve a device on a socket, drive it with an
//! embedded VMM, look at it while the server owns it.
//!
//! ```
//! use umdev::dma::{DmaConfig, DmaHandle};
//! use umdev::irq::Interrupts;
//! use umdev::pci::{BarKind, BarSpec, PciConfig, PciDevice, PciIds};
//! use umdev::testing::{DeviceAccess, TestServer};
//!
//! /// One register: writing `n` makes the device add `n` to the u64 at guest address 0x1000.
//! #[derive(Default)]
//! struct Adder(Option<DmaHandle>);
//!
//! impl PciDevice for Adder {
//!     fn config(&self) -> PciConfig {
//!         let bar = BarSpec { index: 0, size: 4096, kind: BarKind::Mmio32, prefetchable: false, shared: None };
//!         PciConfig { ids: PciIds::default(), bars: vec![bar], intx: true, msi_vectors: 0, msix: None, registers: vec![], vendor_capabilities: vec![] }
//!     }
//!     fn attach(&mut self, dma: DmaHandle, _irq: Interrupts) {
//!         self.0 = Some(dma);
//!     }
//!     fn bar_read(&mut self, _bar: usize, _offset: u64, data: &mut [u8]) {
//!         data.fill(0);
//!     }
//!     fn bar_write(&mut self, _bar: usize, _offset: u64, data: &[u8]) {
//!         // DMA in the handler keeps the example short and works with this test's
//!         // memfd RAM; a real device does it on a worker thread (with fd-less RAM this
//!         // fails with EDEADLK: see the guide, section 3).
//!         let Some(dma) = &self.0 else { return };
//!         let n = data.first().copied().unwrap_or(0) as u64;
//!         let _ = dma.read_obj::<u64>(0x1000).and_then(|v| dma.write_obj(0x1000, &(v + n)));
//!     }
//! }
//!
//! let server = TestServer::start_pci(Adder::default())?; // a socket in a temp dir
//! let mut vmm = server.connect()?.with_ram(0, 1 << 20)?; // 1 MiB of guest RAM at 0
//! vmm.enable_device()?; // memory decoding + Bus Master, as a guest driver does
//! vmm.ram().write_u64(0x1000, 40)?;
//! vmm.write32(0, 0, 2)?;
//! assert_eq!(vmm.ram().read_u64(0x1000)?, 42);
//! assert_eq!(server.dma().stats().maps, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! In a device crate: `[dev-dependencies] umdev = { version = "…", features = ["testing"] }`.
//! The [guide](crate::guide) tests a whole device this way: a worker thread, pinned page
//! arrays, fd-less memory, reset and unmap racing with work in flight.
//!
//! What is here, one implementation each:
//! - [`TestServer`]: a device ([`PciDevice`](crate::pci::PciDevice) through
//!   [`PciAdapter`](crate::pci::PciAdapter), or any [`Device`](crate::device::Device)) served
//!   on a temp-dir socket with its [`DmaSpace`](crate::dma::DmaSpace), shut down on drop;
//!   [`TestServer::device`] looks at the device while the server owns it.
//! - [`Vmm`]: the embedded VMM. Guest RAM as shared memory ([`GuestMemory`]) and fd-less
//!   memory whose DMA_READ/DMA_WRITE it answers ([`FdlessMemory`]: honestly, with errors,
//!   never, or QEMU-like after its own reply), DMA map/unmap, region access, a request log;
//!   migration (the features, MIG_DATA loops) and DMA logging (`vmm_migration.rs`).
//! - [`Migration`] / [`migrate`]: the VMM-side live-migration driver that moves a running
//!   device and its guest RAM from one [`Vmm`]'s server to another's (`migrate.rs`).
//! - [`DeviceAccess`]: what a guest driver does with a device (8/16/32/64-bit accesses, the
//!   capability walk, enabling the device, MSI, MSI-X, INTx), written once for the socket
//!   ([`Vmm`]) and for a [`PciAdapter`](crate::pci::PciAdapter) called in-process.
//! - [`RawClient`]: a raw protocol client for malformed-input tests: any bytes, any fds.
//! - [`TrivialDevice`], a device with nothing but registers, and small helpers: [`memfd`],
//!   [`wait_until`], [`wait_eventfd`] (and [`Vmm::wait_irq_serving`], which answers the
//!   device's DMA requests while it waits), [`EventFd`], [`open_fds`], [`Rng`], [`init_logs`].
//!
//! The [`Vmm`] is built on the [`RawClient`], not on the `vfio_user` crate's client: that
//! client cannot answer the server's DMA_READ/DMA_WRITE. umdev's own tests still drive
//! devices with `vfio_user::Client` where the point is a client nobody here wrote.
//!
//! **Why a feature and not a separate crate.** The harness speaks the same wire types as the
//! server and changes with them in the same commit; as a feature there is one version to
//! depend on, and authors add one line to their dev-dependencies. Nothing of it (nor its
//! dependencies, `tempfile` and `tracing-subscriber`) is in a build without the feature.
//! And umdev's own unit tests use it: a separate crate depending on umdev would, inside
//! umdev's `#[cfg(test)]` code, be linked against a second copy of umdev whose types do not
//! match the crate's own.

mod access;
mod fdless;
mod guest_memory;
mod migrate;
mod raw_client;
mod rng;
mod server;
mod trivial;
mod virtio_driver;
mod vmm;
mod vmm_migration;

#[cfg(test)]
mod tests;

pub use access::{
    DeviceAccess, PCI_CAPABILITY_LIST, PCI_CAP_ID_MSI, PCI_CAP_ID_MSIX, PCI_COMMAND,
    PCI_COMMAND_INTX_DISABLE, PCI_COMMAND_MASTER, PCI_COMMAND_MEMORY,
};
pub use fdless::{Answer, DmaRequest, FdlessMemory};
pub use guest_memory::GuestMemory;
pub use migrate::{
    migrate, ms, MigrateError, MigrateOptions, Migration, MigrationReport, RoundReport, Side,
    MIGRATION_PAGE,
};
pub use raw_client::{Msg, RawClient, DEFAULT_CAPS, READ_TIMEOUT};
pub use rng::Rng;
pub use server::{SharedDevice, TestServer, TestServerBuilder, TEST_REMOTE_DMA_TIMEOUT};
pub use trivial::{TrivialDevice, TRIVIAL_BAR0_SIZE, TRIVIAL_CONFIG_SIZE};
pub use virtio_driver::{
    queue_bytes, Buf, DriverQueue, VirtioDriver, VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT,
    VIRTQ_DESC_F_WRITE,
};
pub use vmm::{wait_eventfd, DmaServer, MappedRegion, RegionInfo, Vmm, CONNECT_RETRY, POLL};
pub use vmm_migration::MIGRATION_CAPS;
/// The interrupt eventfds the harness hands out ([`DeviceAccess::enable_msi`] and the like)
/// and waits on ([`wait_eventfd`], [`Vmm::wait_irq_serving`]): vmm-sys-util's, re-exported
/// so that a test crate needs no vmm-sys-util dependency of its own.
pub use vmm_sys_util::eventfd::EventFd;

use std::fs::File;
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

/// Route `tracing` output to the test's captured output (shown when a test fails). The
/// filter comes from `RUST_LOG`, default `warn`. Only the first call in a process counts;
/// [`TestServer`] calls it.
pub fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A memfd of `size` bytes, not sealed (a test may shrink it under the device, as a hostile
/// VMM would).
pub fn memfd(size: u64) -> io::Result<File> {
    // SAFETY: a NUL-terminated literal name; the result is checked before use.
    let fd = unsafe { libc::memfd_create(c"umdev-testing".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let f = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.set_len(size)?;
    Ok(f)
}

/// Poll `cond` every millisecond for up to `timeout`; whether it came true.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Open fds of this process (the server runs in-process, so a leaked fd shows here). The
/// directory handle of the count itself is included every time, so differences are exact.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}
