//! The controller state shared by the connection thread (registers, doorbells), the
//! controller thread (enable, disable, shutdown) and the queue workers.
//!
//! **No global lock on the I/O path.** The queue tables are one `RwLock` per queue id: a
//! doorbell read-locks its own slot, stores the new value in an atomic and wakes the
//! queue's worker; only queue creation and deletion (admin commands) write a slot. Each
//! submission queue has its own worker thread, so I/O queues run in parallel; a completion
//! queue's posting lock is the only lock two workers may share, and only if the guest
//! binds two submission queues to one completion queue.
//!
//! **Lock order**: slot → `Sq::pinning` → `QueueMem::backing`; `Cq::tail` →
//! `QueueMem::backing`. None of them is held while waiting for the client.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;
use umdev::dma::DmaHandle;
use umdev::irq::{Interrupts, IrqMode};

use super::data::DataPath;
use super::dbbuf::DbBuf;
use super::namespace::Namespace;
use super::pool::Job;
use super::queues::{lock, Cq, Sq};
use super::regs::CSTS_CFS;
use super::spec::Completion;

/// What the controller offers, fixed at construction.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Most I/O queue pairs the guest may create.
    pub max_io_queues: u16,
    /// Largest queue, in entries (CAP.MQES + 1).
    pub max_queue_entries: u32,
    /// MDTS: the largest transfer is 2^mdts pages.
    pub mdts: u8,
    /// Serial number (Identify SN, at most 20 ASCII characters).
    pub serial: String,
    /// Offer Doorbell Buffer Config (OACS bit 8).
    pub shadow_doorbells: bool,
    /// How long a queue worker watches the shadow tail before it arms the EventIdx and
    /// sleeps (zero: it arms at once).
    pub shadow_poll: std::time::Duration,
}

impl Limits {
    /// The largest transfer in bytes.
    pub fn max_transfer(&self) -> u64 {
        4096u64 << self.mdts
    }
}

/// Current values of the features the guest may set.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Features {
    /// Arbitration (CDW11 as set).
    pub arbitration: u32,
    /// Power state.
    pub power_state: u32,
    /// Composite temperature over-threshold, in kelvin.
    pub temp_over: u16,
    /// Composite temperature under-threshold, in kelvin.
    pub temp_under: u16,
    /// Error recovery (TLER).
    pub error_recovery: u32,
    /// Volatile write cache enabled.
    pub write_cache: bool,
    /// Granted I/O queues (0-based NSQA, NCQA), once Number of Queues was set.
    pub queues_granted: Option<(u16, u16)>,
    /// Interrupt coalescing (THR | TIME << 8).
    pub irq_coalescing: u32,
    /// Per-vector coalescing disable bits.
    pub vector_config: Vec<bool>,
    /// Write atomicity normal.
    pub write_atomicity: u32,
    /// Asynchronous event configuration.
    pub async_event_config: u32,
}

impl Features {
    /// The values after a controller reset.
    pub fn defaults(vectors: usize) -> Features {
        Features {
            arbitration: 0,
            power_state: 0,
            temp_over: super::identify::WCTEMP,
            temp_under: 0,
            error_recovery: 0,
            write_cache: true,
            queues_granted: None,
            irq_coalescing: 0,
            vector_config: vec![false; vectors],
            write_atomicity: 0,
            async_event_config: 0,
        }
    }
}

/// Asynchronous events waiting for an Asynchronous Event Request, and the requests
/// waiting for an event.
#[derive(Debug, Default)]
pub struct Aer {
    /// Command ids of outstanding requests.
    pub outstanding: Vec<u16>,
    /// Events not yet reported (completion DW0).
    pub events: VecDeque<u32>,
    /// Event types reported and not yet cleared by reading their log page.
    pub masked: u8,
}

/// Asynchronous event type Error, info Invalid Doorbell Register, log page Error.
pub const AEN_INVALID_DOORBELL: u32 = 0x01 << 16;
/// Asynchronous event type Error, info Invalid Doorbell Write Value, log page Error.
pub const AEN_INVALID_DOORBELL_VALUE: u32 = 0x01 << 16 | 0x01 << 8;
/// Most events kept waiting.
pub(crate) const MAX_EVENTS: usize = 16;

/// The SMART counters.
#[derive(Debug, Default)]
pub struct Counters {
    /// 512-byte units read.
    pub blocks_read: AtomicU64,
    /// 512-byte units written.
    pub blocks_written: AtomicU64,
    /// Read commands completed.
    pub reads: AtomicU64,
    /// Write commands completed.
    pub writes: AtomicU64,
    /// Media and data integrity errors.
    pub media_errors: AtomicU64,
}

/// A submission queue and its worker.
pub struct SqSlot {
    /// The queue.
    pub sq: Arc<Sq>,
    /// Wakes the worker.
    pub wake: Sender<()>,
    /// The worker thread, joined when the queue is deleted.
    pub thread: Mutex<Option<JoinHandle<VecDeque<Completion>>>>,
}

impl SqSlot {
    /// Stop the worker and wait for it (its current command finishes first).
    pub fn stop(&self) {
        self.signal_stop();
        self.join();
    }

    /// Tell the worker to stop after its current command (no wait).
    pub fn signal_stop(&self) {
        self.sq.stop.store(true, Ordering::SeqCst);
        let _ = self.wake.try_send(());
    }

    /// Wait for the stopped worker, its commands in the I/O pool included; the completions
    /// it had not posted yet (a migration keeps them, a reset drops them).
    pub fn join(&self) -> VecDeque<Completion> {
        match lock(&self.thread).take().map(JoinHandle::join) {
            Some(Ok(pending)) => pending,
            Some(Err(_)) => {
                tracing::error!(qid = self.sq.params.id, "nvme: queue worker panicked");
                VecDeque::new()
            }
            None => VecDeque::new(),
        }
    }

    /// [`SqSlot::join`], unless the worker is still running at `deadline`: then `None`
    /// (and the worker is left to finish).
    pub fn join_by(&self, deadline: Instant) -> Option<VecDeque<Completion>> {
        let mut nap = Duration::from_micros(20);
        loop {
            let finished = lock(&self.thread)
                .as_ref()
                .is_none_or(JoinHandle::is_finished);
            if finished {
                return Some(self.join());
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_millis(2));
        }
    }
}

/// Everything the threads share.
pub struct Shared {
    /// The controller's limits.
    pub limits: Limits,
    /// Guest memory.
    pub dma: DmaHandle,
    /// Interrupts.
    pub irq: Interrupts,
    /// The namespace.
    pub ns: Namespace,
    /// Submission queues by id (0 = admin).
    pub sqs: Vec<RwLock<Option<Arc<SqSlot>>>>,
    /// Completion queues by id (0 = admin).
    pub cqs: Vec<RwLock<Option<Arc<Cq>>>>,
    /// CSTS.
    pub csts: AtomicU32,
    /// CC as latched when the controller was enabled.
    pub cc: AtomicU32,
    /// INTMS/INTMC mask (INTx and MSI only).
    pub intms: AtomicU32,
    /// Set features.
    pub features: Mutex<Features>,
    /// Asynchronous events.
    pub aer: Mutex<Aer>,
    /// SMART counters.
    pub counters: Counters,
    /// Pages held pinned for command data right now.
    pub data_pins: AtomicU64,
    /// The shadow doorbell buffer, once the guest configured one.
    pub dbbuf: Mutex<Option<Arc<DbBuf>>>,
    /// The I/O pool (None: I/O runs on the queue workers).
    pub pool: Option<Sender<Job>>,
}

impl Shared {
    /// Shared state for a controller with `limits` on `ns`.
    pub fn new(
        limits: Limits,
        dma: DmaHandle,
        irq: Interrupts,
        ns: Namespace,
        pool: Option<Sender<Job>>,
    ) -> Shared {
        let n = usize::from(limits.max_io_queues) + 1;
        Shared {
            sqs: (0..n).map(|_| RwLock::new(None)).collect(),
            cqs: (0..n).map(|_| RwLock::new(None)).collect(),
            features: Mutex::new(Features::defaults(n)),
            limits,
            dma,
            irq,
            ns,
            csts: AtomicU32::new(0),
            cc: AtomicU32::new(0),
            intms: AtomicU32::new(0),
            aer: Mutex::new(Aer::default()),
            counters: Counters::default(),
            data_pins: AtomicU64::new(0),
            dbbuf: Mutex::new(None),
            pool,
        }
    }

    /// Number of interrupt vectors (one per queue pair, admin included).
    pub fn vectors(&self) -> u16 {
        self.limits.max_io_queues + 1
    }

    /// The submission queue `qid`, if it exists.
    pub fn sq(&self, qid: u16) -> Option<Arc<SqSlot>> {
        let slot = self.sqs.get(usize::from(qid))?;
        slot.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The completion queue `qid`, if it exists.
    pub fn cq(&self, qid: u16) -> Option<Arc<Cq>> {
        let slot = self.cqs.get(usize::from(qid))?;
        slot.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// True if CSTS.CFS is set.
    pub fn is_fatal(&self) -> bool {
        self.csts.load(Ordering::SeqCst) & CSTS_CFS != 0
    }

    /// Enter Controller Fatal Status: the guest must reset the controller.
    pub fn fatal(&self, why: &str) {
        if self.csts.fetch_or(CSTS_CFS, Ordering::SeqCst) & CSTS_CFS == 0 {
            tracing::error!("nvme: controller fatal status: {why}");
        }
    }

    /// The data path of submission queue `sq`.
    pub fn data_path<'a>(&'a self, sq: &'a Sq) -> DataPath<'a> {
        DataPath {
            dma: &self.dma,
            pinning: &sq.pinning,
            pins_held: &self.data_pins,
        }
    }

    /// Interrupt for completions posted on `cq`.
    pub fn interrupt(&self, cq: &Cq) {
        if !cq.ien {
            return;
        }
        match self.irq.mode() {
            IrqMode::Msix => {
                self.irq.trigger(cq.vector);
            }
            IrqMode::Msi => {
                let n = self.irq.enabled_vectors().max(1);
                let v = (u32::from(cq.vector) % n) as u16;
                if self.intms.load(Ordering::SeqCst) & (1 << v) == 0 {
                    self.irq.trigger(v);
                }
            }
            _ => {
                if self.intms.load(Ordering::SeqCst) & 1 == 0 {
                    self.irq.trigger(0);
                }
            }
        }
    }

    /// INTx is a level: lower it once the guest has consumed every completion.
    pub fn maybe_lower_intx(&self) {
        if !matches!(self.irq.mode(), IrqMode::Intx) {
            return;
        }
        let drained = self
            .cqs
            .iter()
            .filter_map(|s| s.read().unwrap_or_else(|e| e.into_inner()).clone())
            .all(|cq| !cq.ien || cq.is_drained());
        if drained {
            self.irq.lower_intx();
        }
    }

    /// Queue an asynchronous event and wake the admin worker to report it.
    pub fn async_event(&self, event: u32) {
        {
            let mut aer = lock(&self.aer);
            let kind = (event & 7) as u8;
            if aer.masked & (1 << kind) != 0 || aer.events.len() >= MAX_EVENTS {
                tracing::debug!(event, "nvme: asynchronous event dropped (masked or full)");
                return;
            }
            aer.events.push_back(event);
        }
        if let Some(admin) = self.sq(0) {
            let _ = admin.wake.try_send(());
        }
    }

    /// Drop the pins of every queue ring in `[iova, iova + size)`, after waiting for the
    /// data pins of commands in progress (the unmap notifier).
    pub fn release_in(&self, iova: u64, size: u64) {
        for slot in &self.sqs {
            let guard = slot.read().unwrap_or_else(|e| e.into_inner());
            if let Some(s) = &*guard {
                drop(s.sq.pinning.write().unwrap_or_else(|e| e.into_inner()));
                s.sq.mem.release_in(iova, size);
            }
        }
        for slot in &self.cqs {
            let guard = slot.read().unwrap_or_else(|e| e.into_inner());
            if let Some(cq) = &*guard {
                cq.mem.release_in(iova, size);
            }
        }
        if let Some(db) = &*lock(&self.dbbuf) {
            db.release_in(iova, size);
        }
    }
}
