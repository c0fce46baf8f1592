//! The controller thread: enable, disable (controller reset), shutdown.
//!
//! The connection thread never waits for queue workers: a CC write only sends a [`Ctl`]
//! here, and CSTS (RDY, SHST, CFS) changes when this thread has done the work, which is
//! what the guest polls for (CAP.TO bounds the wait). Disabling stops and joins every
//! queue worker (the admin queue first: it is the only one that creates queues), which drops every ring pin, and
//! puts features and asynchronous events back to their reset values. A device reset
//! (DEVICE_RESET, [`Ctl::Reset`]) does the same and tells the caller when it is done; a
//! migration STOP sends [`Ctl::Sync`] to wait for what the guest asked before it.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crossbeam_channel::{Receiver, Sender};

use super::ctrl::{Aer, Features, Shared};
use super::queues::{lock, Cq, QueueParams, Sq};
use super::regs::{Cc, CSTS_RDY, CSTS_SHST_COMPLETE, CSTS_SHST_MASK, CSTS_SHST_OCCURRING};
use super::worker;

/// Work for the controller thread.
#[derive(Debug)]
pub enum Ctl {
    /// CC.EN went 0 → 1 with these registers.
    Enable {
        /// CC.
        cc: u32,
        /// AQA.
        aqa: u32,
        /// ASQ.
        asq: u64,
        /// ACQ.
        acq: u64,
    },
    /// CC.EN went 1 → 0: controller reset.
    Disable,
    /// CC.SHN became non-zero.
    Shutdown,
    /// Device reset: like Disable, then answer.
    Reset(Sender<()>),
    /// Answer once everything sent before is done (a migration stop).
    Sync(Sender<()>),
}

/// The thread's loop; ends when the device drops its sender.
pub fn run(shared: &Arc<Shared>, rx: &Receiver<Ctl>) {
    for msg in rx {
        match msg {
            Ctl::Enable { cc, aqa, asq, acq } => enable(shared, cc, aqa, asq, acq),
            Ctl::Disable => disable(shared),
            Ctl::Shutdown => shutdown(shared),
            Ctl::Reset(done) => {
                disable(shared);
                let _ = done.send(());
            }
            Ctl::Sync(done) => {
                let _ = done.send(());
            }
        }
    }
    disable(shared);
}

fn enable(shared: &Arc<Shared>, cc: u32, aqa: u32, asq: u64, acq: u64) {
    let c = Cc(cc);
    let sq_size = (aqa & 0xfff) + 1;
    let cq_size = ((aqa >> 16) & 0xfff) + 1;
    let why = if c.mps() != 0 {
        Some("CC.MPS is not 4 KiB")
    } else if c.css() != 0 {
        Some("CC.CSS is not the NVM command set")
    } else if c.ams() != 0 {
        Some("CC.AMS is not round robin")
    } else if sq_size < 2 || cq_size < 2 {
        Some("AQA names an admin queue of one entry")
    } else if !asq.is_multiple_of(4096) || !acq.is_multiple_of(4096) {
        Some("ASQ or ACQ is not page aligned")
    } else if asq.checked_add(u64::from(sq_size) * 64).is_none()
        || acq.checked_add(u64::from(cq_size) * 16).is_none()
    {
        Some("ASQ or ACQ wraps the address space")
    } else {
        None
    };
    if let Some(why) = why {
        shared.fatal(&format!("enable refused: {why} (CC {cc:#x}, AQA {aqa:#x})"));
        return;
    }
    shared.cc.store(cc, Ordering::SeqCst);
    let cq = Arc::new(Cq::new(
        shared.dma.clone(),
        QueueParams {
            id: 0,
            size: cq_size,
            base: acq,
        },
        true,
        0,
    ));
    let sq = Arc::new(Sq::new(
        shared.dma.clone(),
        QueueParams {
            id: 0,
            size: sq_size,
            base: asq,
        },
        0,
    ));
    *shared.cqs[0].write().unwrap_or_else(|e| e.into_inner()) = Some(cq.clone());
    match worker::spawn(shared.clone(), sq, cq) {
        Ok(slot) => *shared.sqs[0].write().unwrap_or_else(|e| e.into_inner()) = Some(slot),
        Err(e) => {
            shared.fatal(&format!("cannot start the admin queue worker: {e}"));
            return;
        }
    }
    shared.csts.fetch_or(CSTS_RDY, Ordering::SeqCst);
    tracing::info!(sq_size, cq_size, "nvme: controller enabled");
}

/// Stop every queue and return to the reset state; CSTS becomes 0.
pub fn disable(shared: &Shared) {
    // The admin worker first: it is the only one that creates queues.
    let take = |slot: &std::sync::RwLock<Option<Arc<super::ctrl::SqSlot>>>| {
        slot.write().unwrap_or_else(|e| e.into_inner()).take()
    };
    if let Some(admin) = take(&shared.sqs[0]) {
        admin.stop();
    }
    for slot in shared.sqs.iter().skip(1) {
        if let Some(s) = take(slot) {
            s.stop();
        }
    }
    for slot in &shared.cqs {
        slot.write().unwrap_or_else(|e| e.into_inner()).take();
    }
    *lock(&shared.features) = Features::defaults(usize::from(shared.vectors()));
    *lock(&shared.aer) = Aer::default();
    *lock(&shared.dbbuf) = None;
    shared.cc.store(0, Ordering::SeqCst);
    shared.intms.store(0, Ordering::SeqCst);
    shared.irq.lower_intx();
    shared.csts.store(0, Ordering::SeqCst);
}

fn shutdown(shared: &Shared) {
    let set = |v| {
        let _ = shared
            .csts
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| {
                Some(c & !CSTS_SHST_MASK | v)
            });
    };
    set(CSTS_SHST_OCCURRING);
    if let Err(e) = shared.ns.flush() {
        tracing::error!("nvme: image flush at shutdown failed: {e}");
    }
    set(CSTS_SHST_COMPLETE);
    tracing::info!("nvme: shutdown complete");
}
