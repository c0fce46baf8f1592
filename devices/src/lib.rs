//! Example umdev devices: a gvt-style GPU, a ccw-style channel block device and an NVMe
//! controller.
//!
//! The GPU, served on a socket and driven by its guest driver through umdev's embedded VMM
//! (the `testing` features of `umdev` and of this crate): a mode, a command ring in guest
//! RAM, one rectangle.
//!
//! ```
//! use umdev::testing::{DeviceAccess, TestServer};
//! use umdev_devices::gpu::{driver::Driver, Command, Gpu, GpuConfig};
//! use umdev_devices::testing::Bar0;
//!
//! let gpu = Gpu::new(GpuConfig::default())?;
//! let screen = gpu.handle(); // looks at the framebuffer while the server owns the GPU
//! let server = TestServer::start_pci(gpu)?;
//! let mut vmm = server.connect()?.with_ram(1 << 30, 1 << 20)?; // 1 MiB of guest RAM at 1 GiB
//! vmm.enable_device()?; // memory decoding and Bus Master
//! let mut ram = vmm.ram().clone();
//! let mut driver = Driver::probe(Bar0(&mut vmm))?;
//! driver.set_mode(64, 48, 64 * 4)?;
//! driver.setup_ring(1 << 30, 4096)?; // the ring at the start of guest RAM
//! let red = Command::FillRect { x: 8, y: 4, w: 16, h: 8, color: 0x00ff_0000 };
//! driver.submit(&mut ram, &[red])?; // written into the ring, one doorbell
//! driver.wait_idle()?; // the device's worker fetched and drew it
//! assert_eq!(screen.pixel(8, 4), Some(0x00ff_0000));
//! assert_eq!(screen.pixel(23, 11), Some(0x00ff_0000));
//! assert_eq!(screen.pixel(24, 11), Some(0));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! - [`gpu`]: BAR0 registers, a framebuffer BAR the client can mmap, a GTT of guest pages
//!   the device pins, a command ring executed by a worker thread, MSI/MSI-X/INTx.
//!   Register layout and command encoding: `protocol-docs/devices/gpu.md`.
//! - [`ccw`]: channel programs of chained command words and IDAW lists, every data page
//!   pinned with one `pin_pages` call per direction, I/O against an image file.
//!   Formats: `protocol-docs/devices/ccw.md`.
//! - [`nvme`]: an NVMe 1.4 controller that Linux's stock `nvme` driver binds: admin and
//!   I/O queues in guest memory held pinned across commands, PRP lists pinned as one page
//!   array per command, one worker thread per submission queue, a raw image namespace.
//!   Behaviour and status codes: `protocol-docs/devices/nvme.md`.
//! - `testing` (with the `testing` feature): the devices' guest drivers on umdev's test
//!   harness (BAR0 as the GPU driver's register access, guest memory as its RAM, a ccw
//!   program's round trip).
//!
//! Both are complete examples of what `umdev`'s guide (`framework/docs/writing-a-device.md`)
//! describes: DMA on worker threads, pins dropped in the unmap notifier, reset that quiesces
//! the worker first, device state kept across a disconnect. Each module's documentation
//! says how.
#![deny(missing_docs)]

pub mod ccw;
pub mod gpu;
pub mod nvme;
mod parent_common;
#[cfg(feature = "testing")]
pub mod testing;
pub mod virtio_gpu;
