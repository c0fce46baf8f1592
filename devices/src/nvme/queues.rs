//! Submission and completion queues, and the guest memory they live in.
//!
//! **Queue memory is held, not looked up.** A queue's ring (physically contiguous:
//! CAP.CQR = 1) is pinned with one `pin_pages` call the first time the controller touches
//! it and stays pinned across commands, so fetching an entry or posting a completion is a
//! copy through a pinned page ([`PinnedPages::read`]/[`PinnedPages::write`]), no map
//! lookup. The unmap notifier drops the pins of every ring in the range
//! ([`QueueMem::release_in`]); the next access pins again, which fails if the memory is
//! really gone (the controller then reports Controller Fatal Status). Memory mapped
//! without an fd cannot be pinned: such a ring is reached by copies through the DMA layer
//! (server→client DMA_READ/DMA_WRITE, slower, and never while holding a lock the notifier
//! takes).
//!
//! **Locks.** `QueueMem::backing` is held only for a copy through pins (no waiting for the
//! client); the unmap notifier takes it. A completion queue's `tail` lock orders the
//! posters of one queue (several submission queues may share it); the guest's doorbells
//! are atomics, stored by the connection thread without any lock.
//!
//! Bus Master: a copy through held pins checks Bus Master Enable first, so a guest that
//! clears it stops the controller's DMA even though the ring stays pinned.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};

use crossbeam_channel::Sender;
use umdev::dma::{DmaError, DmaHandle, PinnedPages, Prot, PAGE_SHIFT};

use super::dbbuf::DbBuf;
use super::spec::{Command, Completion, CQE_SIZE, SQE_SIZE};

/// Lock `m`, ignoring poisoning (a panicked holder left plain data behind).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

enum Backing {
    /// Not pinned (yet, or again after an unmap).
    Unpinned,
    /// Pinned; copies go through the pins.
    Pinned(PinnedPages),
    /// Fd-less memory: copies go through the DMA layer.
    Copy,
}

/// The guest memory of one queue ring: `[base, base + bytes)`.
pub struct QueueMem {
    base: u64,
    bytes: u64,
    prot: Prot,
    dma: DmaHandle,
    backing: Mutex<Backing>,
}

impl QueueMem {
    /// A ring of `bytes` (not 0) at guest address `base`, accessed with `prot`.
    pub fn new(dma: DmaHandle, base: u64, bytes: u64, prot: Prot) -> QueueMem {
        QueueMem {
            base,
            bytes,
            prot,
            dma,
            backing: Mutex::new(Backing::Unpinned),
        }
    }

    /// Guest address of the ring.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// True while the ring is pinned.
    pub fn is_pinned(&self) -> bool {
        matches!(*lock(&self.backing), Backing::Pinned(_))
    }

    fn pfns(&self) -> Result<Vec<u64>, DmaError> {
        let last = self
            .base
            .checked_add(self.bytes - 1)
            .ok_or(DmaError::Overflow { what: "queue ring" })?;
        Ok(((self.base >> PAGE_SHIFT)..=(last >> PAGE_SHIFT)).collect())
    }

    /// Pin the ring if it is not (or find out it must be copied).
    fn settle(&self, b: &mut Backing) -> Result<(), DmaError> {
        if let Backing::Unpinned = b {
            match PinnedPages::pin(&self.dma, &self.pfns()?, self.prot) {
                Ok(p) => *b = Backing::Pinned(p),
                Err(e @ DmaError::FdLess { .. }) => {
                    tracing::info!(
                        base = self.base,
                        "nvme: queue memory cannot be pinned, served by copies through the \
                         client (DMA_READ/DMA_WRITE, slower): {e}"
                    );
                    *b = Backing::Copy;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Copy `buf.len()` bytes at byte `offset` of the ring into `buf`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        {
            let mut b = lock(&self.backing);
            self.settle(&mut b)?;
            if let Backing::Pinned(p) = &*b {
                self.check_bus_master()?;
                return p.read(offset, buf);
            }
        }
        self.dma.read(self.base + offset, buf)
    }

    /// Copy `data` to byte `offset` of the ring.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), DmaError> {
        {
            let mut b = lock(&self.backing);
            self.settle(&mut b)?;
            if let Backing::Pinned(p) = &*b {
                self.check_bus_master()?;
                return p.write(offset, data);
            }
        }
        self.dma.write(self.base + offset, data)
    }

    fn check_bus_master(&self) -> Result<(), DmaError> {
        if self.dma.bus_master() {
            Ok(())
        } else {
            Err(DmaError::BusMasterDisabled { iova: self.base })
        }
    }

    /// Drop the ring's pins if it overlaps `[iova, iova + size)` (the unmap notifier).
    pub fn release_in(&self, iova: u64, size: u64) {
        let end = iova.saturating_add(size);
        if size == 0 || self.base >= end || self.base.saturating_add(self.bytes) <= iova {
            return;
        }
        let mut b = lock(&self.backing);
        if let Backing::Pinned(_) = &*b {
            *b = Backing::Unpinned;
        }
    }
}

/// Sizes and ids the guest gave a queue at creation (validated by the admin code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueueParams {
    /// Queue identifier.
    pub id: u16,
    /// Entries (1-based, at least 2).
    pub size: u32,
    /// Guest address of the ring.
    pub base: u64,
}

/// A submission queue.
pub struct Sq {
    /// Identity and size.
    pub params: QueueParams,
    /// The completion queue its commands complete on.
    pub cqid: u16,
    /// Ring memory.
    pub mem: QueueMem,
    /// Tail doorbell, as the guest last wrote it (validated `< size`).
    pub tail: AtomicU32,
    /// Head: the next entry the controller fetches (the worker's).
    pub head: AtomicU32,
    /// Set to make the worker stop.
    pub stop: AtomicBool,
    /// Held (shared) by every command of this queue while it holds pins of its data; the
    /// unmap notifier takes it exclusively to wait for them. Never held while waiting for
    /// the client.
    pub pinning: RwLock<()>,
    /// The shadow doorbell buffer, once configured.
    pub dbbuf: OnceLock<Arc<DbBuf>>,
}

impl Sq {
    /// A new, empty submission queue.
    pub fn new(dma: DmaHandle, params: QueueParams, cqid: u16) -> Sq {
        Sq {
            params,
            cqid,
            mem: QueueMem::new(
                dma,
                params.base,
                u64::from(params.size) * SQE_SIZE,
                Prot::READ,
            ),
            tail: AtomicU32::new(0),
            head: AtomicU32::new(0),
            stop: AtomicBool::new(false),
            pinning: RwLock::new(()),
            dbbuf: OnceLock::new(),
        }
    }

    /// The tail the guest published: its shadow doorbell once a buffer is configured (a
    /// value past the queue's size is ignored), else the tail doorbell register.
    pub fn published_tail(&self) -> Result<u32, DmaError> {
        if let Some(db) = self.dbbuf.get() {
            let t = db.sq_tail(self.params.id)?;
            if t < self.params.size {
                self.tail.store(t, Ordering::Release);
                return Ok(t);
            }
            tracing::debug!(
                qid = self.params.id,
                t,
                "nvme: shadow SQ tail past the queue size ignored"
            );
        }
        Ok(self.tail.load(Ordering::Acquire))
    }

    /// Fetch the entry at `index`.
    pub fn fetch(&self, index: u32) -> Result<Command, DmaError> {
        let mut b = [0u8; SQE_SIZE as usize];
        self.mem.read(u64::from(index) * SQE_SIZE, &mut b)?;
        Ok(Command::decode(&b))
    }
}

/// Where a completion queue's producer stands.
#[derive(Debug, Default)]
pub struct CqTail {
    /// Next slot the controller writes.
    pub tail: u32,
    /// Phase tag of the current pass (starts at 1).
    pub phase: bool,
}

/// Result of trying to post a completion.
#[derive(Debug, PartialEq, Eq)]
pub enum Posted {
    /// Written.
    Done,
    /// The queue is full (the guest has not consumed enough): retry after its head
    /// doorbell.
    Full,
}

/// A completion queue.
pub struct Cq {
    /// Identity and size.
    pub params: QueueParams,
    /// Interrupts enabled.
    pub ien: bool,
    /// MSI-X vector.
    pub vector: u16,
    /// Ring memory.
    pub mem: QueueMem,
    /// Head doorbell, as the guest last wrote it (validated `< size`).
    pub head: AtomicU32,
    /// The producer side.
    pub tail: Mutex<CqTail>,
    /// Wake-ups of the submission queue workers waiting for room.
    pub waiters: Mutex<Vec<Sender<()>>>,
    /// The shadow doorbell buffer, once configured.
    pub dbbuf: OnceLock<Arc<DbBuf>>,
}

impl Cq {
    /// A new, empty completion queue.
    pub fn new(dma: DmaHandle, params: QueueParams, ien: bool, vector: u16) -> Cq {
        Cq {
            params,
            ien,
            vector,
            mem: QueueMem::new(
                dma,
                params.base,
                u64::from(params.size) * CQE_SIZE,
                Prot::WRITE,
            ),
            head: AtomicU32::new(0),
            tail: Mutex::new(CqTail {
                tail: 0,
                phase: true,
            }),
            waiters: Mutex::new(Vec::new()),
            dbbuf: OnceLock::new(),
        }
    }

    /// The head the guest published: its shadow doorbell once a buffer is configured (a
    /// value past the queue's size is ignored), else the head doorbell register.
    pub fn published_head(&self) -> Result<u32, DmaError> {
        if let Some(db) = self.dbbuf.get() {
            let h = db.cq_head(self.params.id)?;
            if h < self.params.size {
                self.head.store(h, Ordering::Release);
                return Ok(h);
            }
            tracing::debug!(
                qid = self.params.id,
                h,
                "nvme: shadow CQ head past the queue size ignored"
            );
        }
        Ok(self.head.load(Ordering::Acquire))
    }

    /// True if posting now would find the queue full.
    pub fn is_full(&self) -> Result<bool, DmaError> {
        let tail = lock(&self.tail).tail;
        Ok((tail + 1) % self.params.size == self.published_head()?)
    }

    /// Post `c` at the tail, unless the queue is full.
    pub fn post(&self, c: &Completion) -> Result<Posted, DmaError> {
        let mut t = lock(&self.tail);
        let next = (t.tail + 1) % self.params.size;
        if next == self.published_head()? {
            return Ok(Posted::Full);
        }
        self.mem
            .write(u64::from(t.tail) * CQE_SIZE, &c.encode(t.phase))?;
        t.tail = next;
        if next == 0 {
            t.phase = !t.phase;
        }
        Ok(Posted::Done)
    }

    /// True if the guest has consumed every posted entry.
    pub fn is_drained(&self) -> bool {
        lock(&self.tail).tail == self.head.load(Ordering::Acquire)
    }

    /// Wake the workers waiting for room (after a head doorbell).
    pub fn wake_waiters(&self) {
        for w in lock(&self.waiters).iter() {
            let _ = w.try_send(());
        }
    }
}
