//! Shadow doorbells (Doorbell Buffer Config, OACS bit 8): doorbells in guest memory, so
//! the guest traps only to wake a sleeping controller.
//!
//! QEMU's vfio-user client has no ioeventfds: every trapped doorbell write is a
//! synchronous socket round trip. With a doorbell buffer configured, Linux writes each new
//! SQ tail and CQ head into the *shadow* page (same layout as the doorbell registers:
//! queue `y`'s SQ tail at `8y`, its CQ head at `8y + 4`) and rings the real doorbell only
//! if the *EventIdx* page says the controller asked for it (`need_event(ei, new, old)`:
//! `ei` lies in `[old, new)`, in wrapping 16-bit arithmetic).
//!
//! The controller's side ([`super::worker`]): while a queue's worker is busy it reads the
//! shadow tail after every batch and never moves the EventIdx, so the guest's updates
//! stay silent; before it sleeps it sets EventIdx to the head it reached, fences, and reads
//! the shadow once more (a tail written meanwhile is served, not missed). The first update
//! after that traps and wakes it. A worker waiting for room in a full completion queue
//! arms the CQ head's EventIdx the same way. Linux does not use the buffer for the admin
//! queue, so neither does the controller. Both pages are held pinned like queue rings
//! ([`QueueMem`]) and released by the unmap notifier.

use std::sync::atomic::{fence, Ordering};

use umdev::dma::{DmaError, DmaHandle, Prot};

use super::queues::QueueMem;

/// The two pages of a configured doorbell buffer.
pub struct DbBuf {
    /// The shadow doorbells (the guest writes, the controller reads).
    pub shadow: QueueMem,
    /// The event indexes (the controller writes, the guest reads).
    pub eventidx: QueueMem,
}

fn sq_slot(qid: u16) -> u64 {
    u64::from(qid) * 8
}

fn cq_slot(qid: u16) -> u64 {
    u64::from(qid) * 8 + 4
}

impl DbBuf {
    /// The buffer at `shadow` and `eventidx` (page aligned, checked by the caller).
    pub fn new(dma: &DmaHandle, shadow: u64, eventidx: u64) -> DbBuf {
        DbBuf {
            shadow: QueueMem::new(dma.clone(), shadow, 4096, Prot::RW),
            eventidx: QueueMem::new(dma.clone(), eventidx, 4096, Prot::WRITE),
        }
    }

    fn read(&self, at: u64) -> Result<u32, DmaError> {
        let mut b = [0u8; 4];
        self.shadow.read(at, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    /// The shadow SQ tail of `qid`.
    pub fn sq_tail(&self, qid: u16) -> Result<u32, DmaError> {
        self.read(sq_slot(qid))
    }

    /// The shadow CQ head of `qid`.
    pub fn cq_head(&self, qid: u16) -> Result<u32, DmaError> {
        self.read(cq_slot(qid))
    }

    /// Ask for a doorbell once the SQ tail of `qid` moves past `v`, then fence, so that
    /// a re-read of the shadow tail afterwards sees any update the guest made before it
    /// read the event index.
    pub fn arm_sq(&self, qid: u16, v: u32) -> Result<(), DmaError> {
        self.eventidx.write(sq_slot(qid), &v.to_le_bytes())?;
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// Ask for a doorbell once the CQ head of `qid` moves past `v` (and fence).
    pub fn arm_cq(&self, qid: u16, v: u32) -> Result<(), DmaError> {
        self.eventidx.write(cq_slot(qid), &v.to_le_bytes())?;
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// Start queue `qid` on the buffer with its current tail and head.
    pub fn init_queue(
        &self,
        qid: u16,
        sq_tail: Option<u32>,
        cq_head: Option<u32>,
    ) -> Result<(), DmaError> {
        if let Some(t) = sq_tail {
            self.shadow.write(sq_slot(qid), &t.to_le_bytes())?;
            self.eventidx.write(sq_slot(qid), &t.to_le_bytes())?;
        }
        if let Some(h) = cq_head {
            self.shadow.write(cq_slot(qid), &h.to_le_bytes())?;
            self.eventidx.write(cq_slot(qid), &h.to_le_bytes())?;
        }
        Ok(())
    }

    /// Drop the pins of either page in `[iova, iova + size)`.
    pub fn release_in(&self, iova: u64, size: u64) {
        self.shadow.release_in(iova, size);
        self.eventidx.release_in(iova, size);
    }
}
