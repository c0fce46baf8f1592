//! A split virtqueue as the device sees it: take chains from the avail ring, give them
//! back on the used ring, and decide when to interrupt (`VIRTIO_RING_F_EVENT_IDX` or the
//! ring flags).
//!
//! Ring layout (virtio 1.x, 2.7): avail = `flags, idx, ring[size], used_event` (u16 each);
//! used = `flags, idx` (u16), `ring[size]` of `(id: u32, len: u32)`, `avail_event` (u16).
//! Every access is a `dma_rw` through the device's handle. Order: the avail index is read
//! before the entries it publishes (acquire fence), a used entry is written before the used
//! index (release fence), and the used index is written before the driver's suppression
//! field is read (full fence), as the spec's "memory barrier" notes require.

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use crate::dma::{DmaError, DmaHandle};

use super::chain::{DescChain, WalkParams};
use super::error::VirtioError;
use super::signal::{Position, Shared};

/// `avail.flags`: the driver wants no interrupts.
const VIRTQ_AVAIL_F_NO_INTERRUPT: u16 = 1;
/// `used.flags`: the device wants no notifications.
const VIRTQ_USED_F_NO_NOTIFY: u16 = 1;

/// Where an enabled queue lives and what was negotiated for it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QueueSetup {
    pub(crate) index: u16,
    pub(crate) size: u16,
    pub(crate) desc: u64,
    pub(crate) avail: u64,
    pub(crate) used: u64,
    pub(crate) event_idx: bool,
    pub(crate) indirect: bool,
    pub(crate) max_chain_bytes: u64,
}

/// One enabled split virtqueue (see the module docs of [`crate::virtio`]). Not `Clone`:
/// one owner takes chains and completes them. Any error stops the queue and sets
/// `DEVICE_NEEDS_RESET`; a queue from before a device reset returns
/// [`VirtioError::Stopped`] and touches nothing.
pub struct Virtqueue {
    q: QueueSetup,
    next_avail: u16,
    next_used: u16,
    /// The used index when the driver was last considered for an interrupt.
    signalled_used: Option<u16>,
    /// Heads taken and not yet given back.
    in_flight: Vec<bool>,
    dma: DmaHandle,
    shared: Arc<Shared>,
    epoch: u64,
    stopped: bool,
}

impl std::fmt::Debug for Virtqueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Virtqueue")
            .field("setup", &self.q)
            .field("next_avail", &self.next_avail)
            .field("next_used", &self.next_used)
            .field("stopped", &self.stopped)
            .finish()
    }
}

impl Virtqueue {
    /// A queue from `at` (the reset position for a new activation, the saved one after a
    /// migration), with no chain in flight.
    pub(crate) fn new(
        q: QueueSetup,
        dma: DmaHandle,
        shared: Arc<Shared>,
        epoch: u64,
        at: Position,
    ) -> Self {
        if let Some(cell) = shared.positions.get(usize::from(q.index)) {
            cell.store(at);
        }
        Virtqueue {
            in_flight: vec![false; usize::from(q.size)],
            q,
            next_avail: at.next_avail,
            next_used: at.next_used,
            signalled_used: at.signalled_used,
            dma,
            shared,
            epoch,
            stopped: false,
        }
    }

    /// The queue's index.
    pub fn index(&self) -> u16 {
        self.q.index
    }

    /// The queue's size (entries).
    pub fn size(&self) -> u16 {
        self.q.size
    }

    /// The DMA handle the queue reaches memory with.
    pub fn dma(&self) -> &DmaHandle {
        &self.dma
    }

    /// True once an error (or a reset) stopped the queue.
    pub fn is_stopped(&self) -> bool {
        self.stopped || self.shared.epoch.load(Ordering::SeqCst) != self.epoch
    }

    /// Publish the ring positions to the transport (migration reads them once the device
    /// stopped).
    fn mirror(&self) {
        if let Some(cell) = self.shared.positions.get(usize::from(self.q.index)) {
            cell.store(Position {
                next_avail: self.next_avail,
                next_used: self.next_used,
                signalled_used: self.signalled_used,
            });
        }
    }

    fn live(&self) -> Result<(), VirtioError> {
        if self.is_stopped() {
            return Err(VirtioError::Stopped);
        }
        Ok(())
    }

    /// Stop the queue because of `err`: `DEVICE_NEEDS_RESET`, config interrupt, a log line.
    /// Returns `err` for `?`.
    pub fn fail(&mut self, err: VirtioError) -> VirtioError {
        if !self.is_stopped() {
            self.stopped = true;
            self.shared
                .needs_reset(&format_args!("queue {}: {err}", self.q.index));
        }
        err
    }

    fn checked<T>(&mut self, r: Result<T, VirtioError>) -> Result<T, VirtioError> {
        r.map_err(|e| self.fail(e))
    }

    fn read_u16(&self, addr: u64) -> Result<u16, DmaError> {
        let mut b = [0u8; 2];
        self.dma.read(addr, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    fn write_u16(&self, addr: u64, v: u16) -> Result<(), DmaError> {
        self.dma.write(addr, &v.to_le_bytes())
    }

    fn size64(&self) -> u64 {
        u64::from(self.q.size)
    }

    /// The next chain the driver made available, checked (`None`: the ring is empty).
    pub fn pop(&mut self) -> Result<Option<DescChain>, VirtioError> {
        self.live()?;
        let r = self.pop_inner();
        self.checked(r)
    }

    fn pop_inner(&mut self) -> Result<Option<DescChain>, VirtioError> {
        let avail = self.read_u16(self.q.avail + 2)?;
        let ahead = avail.wrapping_sub(self.next_avail);
        if ahead == 0 {
            return Ok(None);
        }
        if ahead > self.q.size {
            return Err(VirtioError::AvailIndexJump {
                avail,
                ahead,
                size: self.q.size,
            });
        }
        // The entries the index publishes are read after it.
        fence(Ordering::Acquire);
        let slot = u64::from(self.next_avail % self.q.size);
        let head = self.read_u16(self.q.avail + 4 + 2 * slot)?;
        let params = WalkParams {
            table: self.q.desc,
            size: self.q.size,
            indirect: self.q.indirect,
            max_bytes: self.q.max_chain_bytes,
        };
        let dma = &self.dma;
        let chain = DescChain::walk(&params, head, &mut |addr, buf| dma.read(addr, buf))?;
        // walk checked head < size.
        let flag = &mut self.in_flight[usize::from(head)];
        if std::mem::replace(flag, true) {
            return Err(VirtioError::BadCompletion(
                "the driver made a head available that is still in flight",
            ));
        }
        self.next_avail = self.next_avail.wrapping_add(1);
        self.mirror();
        Ok(Some(chain))
    }

    /// Give chain `head` back with `len` bytes written into its writable buffers.
    pub fn add_used(&mut self, head: u16, len: u32) -> Result<(), VirtioError> {
        self.live()?;
        let r = self.add_used_inner(head, len);
        self.checked(r)
    }

    fn add_used_inner(&mut self, head: u16, len: u32) -> Result<(), VirtioError> {
        match self.in_flight.get_mut(usize::from(head)) {
            Some(f) if *f => *f = false,
            _ => return Err(VirtioError::BadCompletion("head not in flight")),
        }
        let slot = u64::from(self.next_used % self.q.size);
        let mut entry = [0u8; 8];
        entry[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        entry[4..].copy_from_slice(&len.to_le_bytes());
        self.dma.write(self.q.used + 4 + 8 * slot, &entry)?;
        // The entry is visible before the index that publishes it.
        fence(Ordering::Release);
        self.next_used = self.next_used.wrapping_add(1);
        self.mirror();
        self.write_u16(self.q.used + 2, self.next_used)?;
        Ok(())
    }

    /// Whether the driver wants an interrupt for what was added since the last call
    /// (`used_event` with `VIRTIO_RING_F_EVENT_IDX`, else `VIRTQ_AVAIL_F_NO_INTERRUPT`).
    pub fn needs_notification(&mut self) -> Result<bool, VirtioError> {
        self.live()?;
        let r = self.needs_notification_inner();
        self.checked(r)
    }

    fn needs_notification_inner(&mut self) -> Result<bool, VirtioError> {
        // The used index is written before the driver's field is read.
        fence(Ordering::SeqCst);
        let new = self.next_used;
        if !self.q.event_idx {
            let flags = self.read_u16(self.q.avail)?;
            return Ok(flags & VIRTQ_AVAIL_F_NO_INTERRUPT == 0);
        }
        let event = self.read_u16(self.q.avail + 4 + 2 * self.size64())?;
        let old = self.signalled_used.replace(new);
        self.mirror();
        Ok(match old {
            None => true,
            Some(old) => new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old),
        })
    }

    /// Raise the queue's interrupt (MSI-X vector, or INTx with the ISR bit) unconditionally.
    pub fn notify(&self) {
        if !self.is_stopped() {
            self.shared.raise_queue(self.q.index);
        }
    }

    /// Interrupt the driver if it asked for it ([`Virtqueue::needs_notification`]).
    pub fn notify_if_needed(&mut self) -> Result<(), VirtioError> {
        if self.needs_notification()? {
            self.notify();
        }
        Ok(())
    }

    /// Ask the driver not to notify for new buffers (while the device is busy anyway).
    pub fn disable_notification(&mut self) -> Result<(), VirtioError> {
        self.live()?;
        if self.q.event_idx {
            return Ok(()); // avail_event is simply not advanced
        }
        let r = self
            .write_u16(self.q.used, VIRTQ_USED_F_NO_NOTIFY)
            .map_err(VirtioError::from);
        self.checked(r)
    }

    /// Ask the driver to notify for the next buffer (`avail_event` = the next index, or
    /// the `NO_NOTIFY` flag cleared). Returns true if buffers became available meanwhile:
    /// the device must look again, or it may sleep with work in the ring.
    pub fn enable_notification(&mut self) -> Result<bool, VirtioError> {
        self.live()?;
        let r = self.enable_notification_inner();
        self.checked(r)
    }

    fn enable_notification_inner(&mut self) -> Result<bool, VirtioError> {
        if self.q.event_idx {
            let at = self.q.used + 4 + 8 * self.size64();
            self.write_u16(at, self.next_avail)?;
        } else {
            self.write_u16(self.q.used, 0)?;
        }
        // Our request is visible before the avail index is read again.
        fence(Ordering::SeqCst);
        let avail = self.read_u16(self.q.avail + 2)?;
        Ok(avail != self.next_avail)
    }
}
