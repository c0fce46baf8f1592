//! An NVMe 1.4 controller that Linux's in-tree `nvme` driver binds: PCI class 01:08:02,
//! BAR0 registers and doorbells, MSI-X with a vector per queue (INTx fallback), one
//! namespace backed by a raw image file.
//!
//! Threads and who does what:
//!
//! - the **connection thread** serves BAR0: register reads, CC writes (which it only
//!   forwards to the controller thread) and doorbells (stored in atomics, the queue's
//!   worker woken). It never waits for a worker and never touches guest memory;
//! - the **controller thread** ([`ctl`]) enables, disables (controller reset) and shuts
//!   down the controller;
//! - one **worker per submission queue** ([`worker`]), the admin queue's included, fetches
//!   commands through the ring's held pins ([`queues`]), runs admin commands ([`admin`])
//!   and hands I/O commands ([`io`]) to the **I/O pool** ([`pool`]), whose threads move
//!   data through pinned PRP page arrays ([`prp`], [`data`]) and the image; the worker
//!   posts the completions.
//!
//! A guest may write anything anywhere: bad fields complete with the status codes the spec
//! defines, doorbells naming a missing queue or a value past the queue's size are ignored
//! and reported as asynchronous events (Invalid Doorbell Register / Write Value), memory
//! the controller cannot reach for its queues is Controller Fatal Status. Nothing the
//! guest does panics the device or leaves a page pinned once its memory is unmapped.
//!
//! The controller migrates ([`migration`]): STOP waits for the commands in flight and holds
//! every queue with the completions it has not posted; the state (registers, features,
//! queues, outstanding Asynchronous Event Requests, shadow doorbells) moves, the image is
//! shared storage.
//!
//! Formats and behaviour for guest authors: `protocol-docs/devices/nvme.md`.

pub mod admin;
pub mod ctl;
pub mod ctrl;
pub mod data;
pub mod dbbuf;
pub mod identify;
pub mod io;
pub mod migration;
pub mod namespace;
pub mod parent;
pub mod pool;
pub mod prp;
pub mod queues;
pub mod regs;
pub mod spec;
pub mod worker;

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::Sender;
use umdev::dma::DmaHandle;
use umdev::irq::Interrupts;
use umdev::pci::{BarKind, BarSpec, MsixSpec, PciConfig, PciDevice, PciIds, RegisterRange};

pub use namespace::ImageError;
pub use parent::{NvmeParent, NvmeParentConfig, NvmeType};
pub use worker::SHADOW_POLL;

use ctl::Ctl;
use ctrl::{Limits, Shared};
use namespace::Namespace;
use regs::{Cc, Doorbell};

/// PCI class code: mass storage, non-volatile memory, NVM Express.
pub const PCI_CLASS: u32 = 0x01_08_02;
/// BAR0 size: registers, doorbells, the MSI-X table and PBA.
pub const BAR0_SIZE: u64 = 0x4000;
/// Offset of the MSI-X table in BAR0.
pub const MSIX_TABLE: u64 = 0x2000;
/// Offset of the MSI-X PBA in BAR0.
pub const MSIX_PBA: u64 = 0x3000;
/// Most I/O queue pairs a controller can be configured with.
pub const MAX_IO_QUEUES: u16 = 64;
/// CAP.TO: the guest waits up to 10 s for CSTS.RDY to change.
const TIMEOUT_500MS: u8 = 20;

/// How to build an [`Nvme`] controller.
#[derive(Clone, Debug)]
pub struct NvmeConfig {
    /// The backing image.
    pub image: PathBuf,
    /// Namespace size in bytes; `None` = the image's size. When set, the image is created
    /// if missing and grown (sparsely) if shorter.
    pub size: Option<u64>,
    /// Most I/O queue pairs (1..=[`MAX_IO_QUEUES`]).
    pub max_io_queues: u16,
    /// Largest queue in entries (2..=65536).
    pub max_queue_entries: u32,
    /// MDTS: the largest transfer is 2^mdts pages (1..=8).
    pub mdts: u8,
    /// Serial number (ASCII, at most 20 characters). Empty (the default): one derived
    /// from the image file's device and inode, `UMDEV` and 15 hex digits, the same on
    /// every start. Two controllers of one guest must never share a serial: Linux groups
    /// controllers by subsystem NQN, which holds it, and would take two namespaces with
    /// equal identifiers for two paths to one disk.
    pub serial: String,
    /// Offer shadow doorbells (Doorbell Buffer Config, OACS bit 8): the guest then traps
    /// only to wake a sleeping queue worker.
    pub shadow_doorbells: bool,
    /// With shadow doorbells, how long a queue worker that ran out of commands keeps
    /// watching the shadow tail (yielding between looks) before it asks the guest to ring
    /// and sleeps: a guest that submits meanwhile does so without a trap. Default
    /// [`SHADOW_POLL`] (50 µs, after activity only: an idle queue costs nothing); zero
    /// arms at once (`umdev run nvme --poll off` sets it, with the connection's polling).
    pub shadow_poll: std::time::Duration,
    /// Threads of the I/O pool shared by the queues (0: each queue's worker does its own
    /// I/O, one command at a time).
    pub io_threads: usize,
    /// Read and write the image with O_DIRECT (bypassing the host's page cache) where a
    /// transfer is 4 KiB aligned in memory, offset and length; others use the page cache.
    /// The image's file system must support O_DIRECT (tmpfs does only from Linux 6.6).
    pub direct: bool,
}

impl NvmeConfig {
    /// Serve an existing image at its size, with 4 I/O queue pairs of up to 1024 entries
    /// and 256 KiB transfers.
    pub fn new(image: impl Into<PathBuf>) -> NvmeConfig {
        NvmeConfig {
            image: image.into(),
            size: None,
            max_io_queues: 4,
            max_queue_entries: 1024,
            mdts: 6,
            serial: String::new(),
            shadow_doorbells: true,
            shadow_poll: SHADOW_POLL,
            io_threads: 4,
            direct: false,
        }
    }

    /// Create the image if needed and make the namespace `bytes` long.
    pub fn with_size(mut self, bytes: u64) -> NvmeConfig {
        self.size = Some(bytes);
        self
    }
}

/// The NVMe controller.
pub struct Nvme {
    limits: Limits,
    ns: Option<Namespace>,
    shared: Option<Arc<Shared>>,
    ctl: Option<Sender<Ctl>>,
    ctl_thread: Option<JoinHandle<()>>,
    cc: u32,
    aqa: u32,
    asq: u64,
    acq: u64,
    blocks: u64,
    io_threads: usize,
    pool_threads: Vec<JoinHandle<()>>,
    /// Live migration: stopped or not, the queues held while stopped (`migration/`).
    mig: migration::Migration,
    /// What the parent lent (the image and its share of the budget); the last field, so
    /// it is given back after everything else is dropped.
    lease: Option<parent::ImageLease>,
}

impl Nvme {
    /// Open the image and build the controller (its threads start at attach).
    pub fn new(config: NvmeConfig) -> Result<Nvme, ImageError> {
        let mut ns = Namespace::open(&config.image, config.size)?;
        if config.direct {
            ns.enable_direct(&config.image)?;
        }
        Ok(Nvme::with_namespace(config, ns))
    }

    /// Build the controller on `file`, the image `config.image` already opened for reading
    /// and writing (how a parent serves an image it has checked; `config.size` as for
    /// [`Nvme::new`], but nothing is created).
    pub fn from_file(config: NvmeConfig, file: std::fs::File) -> Result<Nvme, ImageError> {
        let mut ns = Namespace::from_file(file, &config.image, config.size)?;
        if config.direct {
            ns.enable_direct(&config.image)?;
        }
        Ok(Nvme::with_namespace(config, ns))
    }

    fn with_namespace(mut config: NvmeConfig, ns: Namespace) -> Nvme {
        if config.serial.is_empty() {
            config.serial = ns.serial();
        }
        tracing::info!(
            image = %config.image.display(),
            blocks = ns.blocks(),
            direct = ns.is_direct(),
            serial = %config.serial,
            "nvme: image opened"
        );
        Nvme {
            limits: Limits {
                max_io_queues: config.max_io_queues.clamp(1, MAX_IO_QUEUES),
                max_queue_entries: config.max_queue_entries.clamp(2, 65536),
                mdts: config.mdts.clamp(1, 8),
                serial: config.serial,
                shadow_doorbells: config.shadow_doorbells,
                shadow_poll: config.shadow_poll.min(std::time::Duration::from_millis(1)),
            },
            blocks: ns.blocks(),
            io_threads: config.io_threads.min(64),
            pool_threads: Vec::new(),
            ns: Some(ns),
            shared: None,
            ctl: None,
            ctl_thread: None,
            cc: 0,
            aqa: 0,
            asq: 0,
            acq: 0,
            mig: migration::Migration::default(),
            lease: None,
        }
    }

    /// Hold `lease` until the controller is dropped (after its threads end and the image
    /// is flushed).
    pub(crate) fn with_lease(mut self, lease: parent::ImageLease) -> Nvme {
        self.lease = Some(lease);
        self
    }

    /// Namespace size in 512-byte blocks.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Pages held pinned for command data right now (0 whenever no command runs).
    pub fn data_pins(&self) -> u64 {
        self.shared
            .as_ref()
            .map_or(0, |s| s.data_pins.load(Ordering::SeqCst))
    }

    /// Number of queue rings currently pinned.
    pub fn pinned_rings(&self) -> usize {
        let Some(s) = &self.shared else { return 0 };
        let sqs = (0..s.sqs.len() as u16)
            .filter_map(|q| s.sq(q))
            .filter(|q| q.sq.mem.is_pinned())
            .count();
        let cqs = (0..s.cqs.len() as u16)
            .filter_map(|q| s.cq(q))
            .filter(|q| q.mem.is_pinned())
            .count();
        sqs + cqs
    }

    /// Flush the image to stable storage.
    pub fn flush(&self) -> std::io::Result<()> {
        match (&self.shared, &self.ns) {
            (Some(s), _) => s.ns.flush(),
            (None, Some(ns)) => ns.flush(),
            (None, None) => Ok(()),
        }
    }

    fn cap(&self) -> u64 {
        regs::cap((self.limits.max_queue_entries - 1) as u16, TIMEOUT_500MS)
    }

    fn reg(&self, offset: u64) -> u32 {
        let csts = || {
            self.shared
                .as_ref()
                .map_or(0, |s| s.csts.load(Ordering::SeqCst))
        };
        let intms = || {
            self.shared
                .as_ref()
                .map_or(0, |s| s.intms.load(Ordering::SeqCst))
        };
        match offset {
            regs::CAP_LO => self.cap() as u32,
            regs::CAP_HI => (self.cap() >> 32) as u32,
            regs::VS => regs::VERSION_1_4,
            regs::INTMS | regs::INTMC => intms(),
            regs::CC => self.cc,
            regs::CSTS => csts(),
            regs::AQA => self.aqa,
            regs::ASQ_LO => self.asq as u32,
            regs::ASQ_HI => (self.asq >> 32) as u32,
            regs::ACQ_LO => self.acq as u32,
            regs::ACQ_HI => (self.acq >> 32) as u32,
            _ => 0,
        }
    }

    fn send(&self, msg: Ctl) {
        match &self.ctl {
            Some(tx) => {
                if tx.send(msg).is_err() {
                    tracing::error!("nvme: controller thread gone");
                }
            }
            None => tracing::warn!("nvme: controller register written before attach"),
        }
    }

    fn write_cc(&mut self, value: u32) {
        if self.mig.stopped {
            // No enable, reset or shutdown between STOP and RUNNING (the VMM does not run
            // the guest then): the controller's state must not change.
            tracing::warn!(
                value,
                "nvme: CC written while stopped for migration: ignored"
            );
            return;
        }
        let (old, new) = (Cc(self.cc), Cc(value));
        self.cc = value;
        if !old.en() && new.en() {
            self.send(Ctl::Enable {
                cc: value,
                aqa: self.aqa,
                asq: self.asq,
                acq: self.acq,
            });
        } else if old.en() && !new.en() {
            self.send(Ctl::Disable);
        }
        if new.en() && old.shn() == 0 && new.shn() != 0 {
            self.send(Ctl::Shutdown);
        }
    }

    fn write_reg(&mut self, offset: u64, value: u32) {
        let enabled = Cc(self.cc).en();
        match offset {
            regs::CC => self.write_cc(value),
            regs::INTMS | regs::INTMC => {
                if let Some(s) = &self.shared {
                    if offset == regs::INTMS {
                        s.intms.fetch_or(value, Ordering::SeqCst);
                    } else {
                        s.intms.fetch_and(!value, Ordering::SeqCst);
                    }
                }
            }
            regs::AQA if !enabled => self.aqa = value & 0x0fff_0fff,
            regs::ASQ_LO if !enabled => self.asq = (self.asq & !0xffff_ffff) | u64::from(value),
            regs::ASQ_HI if !enabled => {
                self.asq = (self.asq & 0xffff_ffff) | u64::from(value) << 32
            }
            regs::ACQ_LO if !enabled => self.acq = (self.acq & !0xffff_ffff) | u64::from(value),
            regs::ACQ_HI if !enabled => {
                self.acq = (self.acq & 0xffff_ffff) | u64::from(value) << 32
            }
            o if o >= regs::DOORBELLS => self.doorbell(o, value),
            _ => tracing::debug!(
                offset,
                value,
                "nvme: write to read-only or unknown register ignored"
            ),
        }
    }

    fn doorbell(&mut self, offset: u64, value: u32) {
        let Some(s) = &self.shared else { return };
        if s.csts.load(Ordering::SeqCst) & regs::CSTS_RDY == 0 || s.is_fatal() {
            tracing::debug!(offset, value, "nvme: doorbell while not ready ignored");
            return;
        }
        match regs::doorbell(offset) {
            Some(Doorbell::SqTail(q)) => match s.sq(q) {
                Some(slot) if value < slot.sq.params.size => {
                    slot.sq.tail.store(value, Ordering::Release);
                    let _ = slot.wake.try_send(());
                }
                Some(_) => {
                    tracing::warn!(qid = q, value, "nvme: SQ tail doorbell past the queue size");
                    s.async_event(ctrl::AEN_INVALID_DOORBELL_VALUE);
                }
                None => {
                    tracing::warn!(qid = q, value, "nvme: doorbell of a missing SQ");
                    s.async_event(ctrl::AEN_INVALID_DOORBELL);
                }
            },
            Some(Doorbell::CqHead(q)) => match s.cq(q) {
                Some(cq) if value < cq.params.size => {
                    cq.head.store(value, Ordering::Release);
                    cq.wake_waiters();
                    s.maybe_lower_intx();
                }
                Some(_) => {
                    tracing::warn!(qid = q, value, "nvme: CQ head doorbell past the queue size");
                    s.async_event(ctrl::AEN_INVALID_DOORBELL_VALUE);
                }
                None => {
                    tracing::warn!(qid = q, value, "nvme: doorbell of a missing CQ");
                    s.async_event(ctrl::AEN_INVALID_DOORBELL);
                }
            },
            None => s.async_event(ctrl::AEN_INVALID_DOORBELL),
        }
    }

    /// Reset the controller and wait for it (device reset, disconnect).
    fn reset_and_wait(&mut self) {
        // A reset drops every queue, those held by a migration stop too.
        self.mig.reset();
        self.cc = 0;
        self.aqa = 0;
        self.asq = 0;
        self.acq = 0;
        let Some(tx) = &self.ctl else { return };
        let (done_tx, done_rx) = crossbeam_channel::bounded(1);
        if tx.send(Ctl::Reset(done_tx)).is_ok()
            && done_rx.recv_timeout(Duration::from_secs(30)).is_err()
        {
            tracing::error!("nvme: controller reset did not finish in 30 s");
        }
    }
}

impl PciDevice for Nvme {
    fn config(&self) -> PciConfig {
        let vectors = self.limits.max_io_queues + 1;
        PciConfig {
            ids: PciIds {
                vendor: identify::VENDOR_ID,
                device: identify::DEVICE_ID,
                subsystem_vendor: identify::VENDOR_ID,
                subsystem: identify::DEVICE_ID,
                class_code: PCI_CLASS,
                revision: 2,
            },
            bars: vec![BarSpec {
                index: 0,
                size: BAR0_SIZE,
                kind: BarKind::Mmio64,
                prefetchable: false,
                shared: None,
            }],
            intx: true,
            msi_vectors: 0,
            msix: Some(MsixSpec {
                vectors,
                table_bar: 0,
                table_offset: MSIX_TABLE,
                pba_bar: 0,
                pba_offset: MSIX_PBA,
            }),
            registers: vec![RegisterRange {
                bar: 0,
                offset: 0,
                size: regs::DOORBELLS + u64::from(vectors) * 8,
            }],
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
                "nvme: unsupported register write shape"
            );
        }
        for (off, val) in writes {
            self.write_reg(off, val);
        }
    }

    fn attach(&mut self, dma: DmaHandle, irq: Interrupts) {
        let Some(ns) = self.ns.take() else {
            tracing::error!("nvme: attached twice");
            return;
        };
        let pool = (self.io_threads > 0).then(|| {
            let (tx, handles) = pool::start(self.io_threads);
            self.pool_threads = handles;
            tx
        });
        let shared = Arc::new(Shared::new(self.limits.clone(), dma, irq, ns, pool));
        let (tx, rx) = crossbeam_channel::unbounded();
        let s = shared.clone();
        match std::thread::Builder::new()
            .name("nvme-ctl".into())
            .spawn(move || ctl::run(&s, &rx))
        {
            Ok(h) => {
                self.ctl_thread = Some(h);
                self.ctl = Some(tx);
            }
            Err(e) => tracing::error!(error = %e, "nvme: cannot spawn the controller thread"),
        }
        self.apply_pending(&shared);
        self.shared = Some(shared);
    }

    fn reset(&mut self) {
        self.reset_and_wait();
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "nvme: image flush on reset failed");
        }
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) {
        if let Some(s) = &self.shared {
            s.release_in(iova, size);
        }
    }

    fn migration(&mut self) -> Option<&mut dyn umdev::migration::Migrate> {
        Some(self)
    }

    fn disconnected(&mut self) {
        // The queues lived in the client's memory: the next client starts from reset.
        self.reset_and_wait();
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "nvme: image flush on disconnect failed");
        }
    }
}

impl Drop for Nvme {
    fn drop(&mut self) {
        self.ctl = None;
        if let Some(h) = self.ctl_thread.take() {
            if h.join().is_err() {
                tracing::error!("nvme: controller thread panicked");
            }
        }
        if let Err(e) = self.flush() {
            tracing::warn!(error = %e, "nvme: image flush on drop failed");
        }
        // The last reference to the shared state holds the pool's sender: its threads end.
        self.shared = None;
        for h in self.pool_threads.drain(..) {
            if h.join().is_err() {
                tracing::error!("nvme: I/O thread panicked");
            }
        }
    }
}
