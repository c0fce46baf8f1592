//! ccw-style channel block device.
//!
//! A PCI device (BAR0: 4 KiB of registers, MSI with one vector, INTx) in front of a backing
//! image file. The guest writes the address of an *operation block* to OPB_ADDR and 1 to
//! START; a worker thread then reads the operation block, walks and validates the whole
//! *channel program* it points to (chained 16-byte CCWs: READ, WRITE, SENSE, NOP, TIC; data
//! addresses direct or through IDAW lists of 4 KiB pages), pins every data page of the
//! program with one `pin_pages` call per direction (like vfio-ccw's `page_array_pin`),
//! moves the data between the image and the pinned pages with `pread`/`pwrite`, unpins,
//! stores a status block and raises MSI vector 0 (or INTx).
//!
//! The guest-visible formats are in [`format`](mod@format) and [`status`], the registers in
//! [`regs`], and
//! `protocol-docs/devices/ccw.md` documents them for driver authors; [`driver`] holds the
//! encoders a guest driver (the CLI demo, the tests) uses.
//!
//! Pins never outlive a program: they are released before the status is stored, and
//! [`PciDevice::dma_unmap`], [`PciDevice::reset`] and [`PciDevice::disconnected`] abort a
//! running program and wait until its pins are gone. [`Ccw::pins_held`] exposes the count.
//!
//! The device migrates ([`migration`]): STOP finishes the program doing I/O and holds
//! back what has not happened yet (a START, a completion), which runs or is delivered at
//! RUNNING, on the destination after a migration; the image is shared storage, not state.

pub mod driver;
pub mod format;
pub mod idal;
pub mod image;
pub mod io;
pub mod migration;
pub mod parent;
pub mod pins;
pub mod program;
pub mod regs;
pub mod status;
pub mod worker;

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};
use umdev::dma::DmaHandle;
use umdev::irq::Interrupts;
use umdev::pci::{BarKind, BarSpec, PciConfig, PciDevice, PciIds};

pub use image::CcwError;
pub use parent::{CcwParent, CcwParentConfig, CcwType};

use format::BLOCK_SIZE;
use status::Fault;
use worker::{Job, Shared, Task, Worker};

/// PCI vendor ID of the ccw device (the unregistered "experimental" vendor ID that QEMU's
/// stdvga also uses; pick your own for anything real).
pub const PCI_VENDOR_ID: u16 = 0x1234;
/// PCI device ID of the ccw device.
pub const PCI_DEVICE_ID: u16 = 0x0cc1;
/// PCI class code: mass storage, other.
pub const PCI_CLASS: u32 = 0x01_80_00;

/// How to build a [`Ccw`].
#[derive(Clone, Debug)]
pub struct CcwConfig {
    /// The backing image file.
    pub image: PathBuf,
    /// Capacity in 512-byte blocks; `None` = the image's size. When set, a shorter image is
    /// grown (sparsely) to it.
    pub capacity_blocks: Option<u64>,
    /// Create the image if it does not exist.
    pub create: bool,
    /// Most CCWs (TICs included) one program may fetch.
    pub max_ccws: usize,
}

impl CcwConfig {
    /// Use an existing image at its current size.
    pub fn new(image: impl Into<PathBuf>) -> CcwConfig {
        CcwConfig {
            image: image.into(),
            capacity_blocks: None,
            create: false,
            max_ccws: program::DEFAULT_MAX_CCWS,
        }
    }

    /// Create the image if needed and make it `blocks` blocks long.
    pub fn with_capacity(mut self, blocks: u64) -> CcwConfig {
        self.capacity_blocks = Some(blocks);
        self.create = true;
        self
    }
}

/// The ccw-style channel block device.
pub struct Ccw {
    image: Arc<File>,
    capacity_blocks: u64,
    max_ccws: usize,
    opb_addr: u64,
    start_dropped: bool,
    shared: Arc<Shared>,
    tx: Option<Sender<Job>>,
    rx: Option<Receiver<Job>>,
    worker: Option<JoinHandle<()>>,
    irq: Interrupts,
    /// Stopped for live migration (`migration.rs`): between STOP and RUNNING.
    stopped: bool,
    /// The program in flight while stopped, not started or not yet completed (the worker
    /// set it aside, or it came with a loaded state): run or delivered at RUNNING.
    held: Option<Task>,
    /// What the device borrowed from its parent (its image and its share of the budget),
    /// given back when it is dropped, after the image is flushed.
    lease: Option<parent::ImageLease>,
}

impl Ccw {
    /// Open the image and build the device (the worker starts at attach).
    pub fn new(config: CcwConfig) -> Result<Ccw, CcwError> {
        let (file, blocks) =
            image::open_image(&config.image, config.capacity_blocks, config.create)?;
        tracing::info!(image = %config.image.display(), blocks, "ccw: image opened");
        Ok(Ccw::with_image(file, blocks, config.max_ccws))
    }

    /// Build the device on an image already open and sized ([`image::settle_capacity`]).
    pub(crate) fn with_image(file: File, capacity_blocks: u64, max_ccws: usize) -> Ccw {
        Ccw {
            image: Arc::new(file),
            capacity_blocks,
            max_ccws: max_ccws.max(1),
            opb_addr: 0,
            start_dropped: false,
            shared: Arc::default(),
            tx: None,
            rx: None,
            worker: None,
            irq: Interrupts::default(),
            stopped: false,
            held: None,
            lease: None,
        }
    }

    /// Attach what the device borrowed from its parent; given back when it is dropped.
    pub(crate) fn with_lease(mut self, lease: parent::ImageLease) -> Ccw {
        self.lease = Some(lease);
        self
    }

    /// Page entries this device currently holds pinned (0 whenever no program runs).
    pub fn pins_held(&self) -> u64 {
        self.shared.pins_held.load(Ordering::SeqCst)
    }

    /// Capacity in 512-byte blocks.
    pub fn capacity_blocks(&self) -> u64 {
        self.capacity_blocks
    }

    /// True while a program is queued or running.
    pub fn is_busy(&self) -> bool {
        self.shared.busy.load(Ordering::SeqCst)
    }

    /// Flush the image to stable storage.
    pub fn flush(&self) -> std::io::Result<()> {
        self.image.sync_data()
    }

    fn stop_worker(&mut self) {
        self.shared.cancel_all(self.rx.as_ref());
        self.tx = None;
        self.rx = None;
        if let Some(h) = self.worker.take() {
            if h.join().is_err() {
                tracing::error!("ccw: worker thread panicked");
            }
        }
    }

    fn start(&mut self) {
        let Some(tx) = &self.tx else {
            tracing::warn!("ccw: START before attach");
            self.start_dropped = true;
            let (d, c) = Fault::NotAttached.status();
            let last =
                u32::from(d) | u32::from(c) << 8 | u32::from(Fault::NotAttached.code()) << 16;
            self.shared.last_status.store(last, Ordering::SeqCst);
            return;
        };
        if self
            .shared
            .busy
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            tracing::warn!("ccw: START while busy dropped");
            self.start_dropped = true;
            return;
        }
        let task = Task::Start {
            opb_addr: self.opb_addr,
        };
        if self.stopped {
            // Stopped for migration: the program starts at RUNNING (here or on the
            // destination).
            self.held = Some(task);
            self.start_dropped = false;
            return;
        }
        let job = Job {
            task,
            epoch: self.shared.epoch(),
        };
        if tx.try_send(job).is_err() {
            tracing::warn!("ccw: job queue full, START dropped");
            self.shared.busy.store(false, Ordering::SeqCst);
            self.start_dropped = true;
            return;
        }
        self.start_dropped = false;
    }

    fn reg(&self, offset: u64) -> u32 {
        let s = &self.shared;
        match offset {
            regs::ID => regs::MAGIC,
            regs::VERSION => regs::VERSION_VALUE,
            regs::OPB_ADDR_LO => self.opb_addr as u32,
            regs::OPB_ADDR_HI => (self.opb_addr >> 32) as u32,
            regs::STATUS => {
                let mut v = 0;
                if s.busy.load(Ordering::SeqCst) {
                    v |= regs::STATUS_BUSY;
                }
                if self.start_dropped {
                    v |= regs::STATUS_START_DROPPED;
                }
                v
            }
            regs::IRQ_STATUS => s.irq_status.load(Ordering::SeqCst),
            regs::CAPACITY_LO => self.capacity_blocks as u32,
            regs::CAPACITY_HI => (self.capacity_blocks >> 32) as u32,
            regs::LAST_STATUS => s.last_status.load(Ordering::SeqCst),
            regs::COMPLETED => s.completed.load(Ordering::SeqCst),
            regs::MAX_CCWS => u32::try_from(self.max_ccws).unwrap_or(u32::MAX),
            regs::BLOCK_SIZE_REG => BLOCK_SIZE as u32,
            _ => 0,
        }
    }

    fn write_reg(&mut self, offset: u64, value: u32) {
        match offset {
            regs::OPB_ADDR_LO => {
                self.opb_addr = (self.opb_addr & !0xffff_ffff) | u64::from(value);
            }
            regs::OPB_ADDR_HI => {
                self.opb_addr = (self.opb_addr & 0xffff_ffff) | u64::from(value) << 32;
            }
            regs::START if value == 1 => self.start(),
            regs::IRQ_STATUS => {
                let irq_status = &self.shared.irq_status;
                let clear = value & regs::IRQ_ALL;
                let left = irq_status.fetch_and(!clear, Ordering::SeqCst) & !clear;
                if left == 0 {
                    // INTx is level-triggered: lower it once every cause is acknowledged,
                    // so a completion latched while the line was masked does not fire
                    // after the guest has already handled it. A completion that raced
                    // with the ack re-raises it.
                    self.irq.lower_intx();
                    if irq_status.load(Ordering::SeqCst) != 0 {
                        self.irq.trigger(0);
                    }
                }
            }
            _ => tracing::debug!(offset, value, "ccw: write to read-only/unknown register"),
        }
    }
}

impl PciDevice for Ccw {
    fn config(&self) -> PciConfig {
        PciConfig {
            ids: PciIds {
                vendor: PCI_VENDOR_ID,
                device: PCI_DEVICE_ID,
                subsystem_vendor: PCI_VENDOR_ID,
                subsystem: PCI_DEVICE_ID,
                class_code: PCI_CLASS,
                revision: 1,
            },
            bars: vec![BarSpec {
                index: 0,
                size: regs::BAR0_SIZE,
                kind: BarKind::Mmio32,
                prefetchable: false,
                shared: None,
            }],
            intx: true,
            msi_vectors: 1,
            msix: None,
            registers: Vec::new(),
            vendor_capabilities: Vec::new(),
        }
    }

    fn bar_read(&mut self, bar: usize, offset: u64, data: &mut [u8]) {
        if bar != 0 {
            data.fill(0);
            return;
        }
        regs::read_bytes(offset, data, |o| self.reg(o));
    }

    fn bar_write(&mut self, bar: usize, offset: u64, data: &[u8]) {
        if bar != 0 {
            return;
        }
        let writes = regs::decode_write(offset, data);
        if writes.is_empty() {
            tracing::debug!(
                offset,
                len = data.len(),
                "ccw: unsupported register write shape"
            );
        }
        for (off, val) in writes {
            self.write_reg(off, val);
        }
    }

    fn attach(&mut self, dma: DmaHandle, irq: Interrupts) {
        self.stop_worker();
        self.irq = irq.clone();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let worker = Worker {
            shared: self.shared.clone(),
            dma,
            irq,
            image: self.image.clone(),
            capacity: self.capacity_blocks.saturating_mul(BLOCK_SIZE),
            max_ccws: self.max_ccws,
        };
        let worker_rx = rx.clone();
        match std::thread::Builder::new()
            .name("ccw-worker".into())
            .spawn(move || worker.run(worker_rx))
        {
            Ok(h) => {
                self.worker = Some(h);
                self.tx = Some(tx);
                self.rx = Some(rx);
            }
            Err(e) => tracing::error!(error = %e, "ccw: cannot spawn worker"),
        }
        // A program held for migration stays held, and runs if the device already runs.
        self.shared.flight().stopping = self.stopped;
        if self.held.is_some() {
            self.shared.busy.store(true, Ordering::SeqCst);
            if !self.stopped {
                self.submit_held();
            }
        }
    }

    fn reset(&mut self) {
        self.shared.cancel_all(self.rx.as_ref());
        self.held = None;
        self.opb_addr = 0;
        self.start_dropped = false;
        let s = &self.shared;
        s.irq_status.store(0, Ordering::SeqCst);
        self.irq.lower_intx();
        s.last_status.store(0, Ordering::SeqCst);
        s.completed.store(0, Ordering::SeqCst);
        *s.sense.lock().unwrap_or_else(|p| p.into_inner()) = [0; format::SENSE_SIZE];
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "ccw: image flush on reset failed");
        }
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) {
        self.shared.unmap(iova, size);
    }

    fn disconnected(&mut self) {
        self.shared.cancel_all(self.rx.as_ref());
        self.held = None;
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "ccw: image flush on disconnect failed");
        }
    }

    fn migration(&mut self) -> Option<&mut dyn umdev::migration::Migrate> {
        Some(self)
    }
}

impl Drop for Ccw {
    fn drop(&mut self) {
        self.stop_worker();
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "ccw: image flush on drop failed");
        }
        // Only now may another instance open the image.
        self.lease = None;
    }
}
