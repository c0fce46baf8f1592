//! The worker thread of one submission queue: fetch, execute, post, interrupt.
//!
//! A doorbell only stores the new tail and wakes the worker (a token in a one-slot
//! channel, so wake-ups coalesce and an idle queue costs no CPU). The worker then runs
//! every entry between its head and the tail: fetches it through the ring's held pins,
//! executes it (admin or I/O), and posts the completion on its completion queue. When the
//! completion queue is full the completion is kept and the worker sleeps until the
//! guest's head doorbell wakes it; no entry is fetched meanwhile. An interrupt follows a
//! batch (at most [`BATCH`] completions), not every completion.
//!
//! A ring the controller can no longer read or write (its memory unmapped, Bus Master
//! cleared) is Controller Fatal Status: nothing more runs until the guest resets the
//! controller.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use crossbeam_channel::Receiver;

use super::admin;
use super::ctrl::{Shared, SqSlot};
use super::io as nvm;
use super::prp;
use super::queues::{lock, Cq, Posted, Sq};
use super::spec::{Command, Completion, Status};

/// Most completions posted before an interrupt is raised.
pub const BATCH: u32 = 32;

/// What a command's execution produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Complete now.
    Done {
        /// The status.
        status: Status,
        /// DW0.
        result: u32,
    },
    /// Completed later (an Asynchronous Event Request).
    Deferred,
}

impl Outcome {
    /// Success with `result`.
    pub fn ok(result: u32) -> Outcome {
        Outcome::Done {
            status: Status::SUCCESS,
            result,
        }
    }

    /// Failure with `status`.
    pub fn err(status: Status) -> Outcome {
        Outcome::Done { status, result: 0 }
    }

    /// `status`, with `result` if it is a success.
    pub fn from_status(status: Status, result: u32) -> Outcome {
        Outcome::Done { status, result }
    }
}

/// Copy `data` to the buffer `cmd` names with its PRPs (admin data: Identify, logs).
pub fn send_data(shared: &Shared, sq: &Sq, cmd: &Command, data: &[u8]) -> Status {
    let max = shared.limits.max_transfer();
    let t = match prp::walk(cmd.prp1, cmd.prp2, data.len() as u64, max, |a, b| {
        shared.dma.read(a, b)
    }) {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(cid = cmd.cid, "nvme: admin data: {e}");
            return e.status();
        }
    };
    match shared.data_path(sq).to_guest(&t, data) {
        Ok(()) => Status::SUCCESS,
        Err(e) => {
            tracing::warn!(cid = cmd.cid, "nvme: admin data transfer failed: {e}");
            Status::DATA_TRANSFER_ERROR
        }
    }
}

/// Start the worker of `sq`, completing on `cq`.
pub fn spawn(shared: Arc<Shared>, sq: Arc<Sq>, cq: Arc<Cq>) -> io::Result<Arc<SqSlot>> {
    let (tx, rx) = crossbeam_channel::bounded(1);
    {
        let mut waiters = lock(&cq.waiters);
        waiters.retain(|w| {
            !matches!(
                w.try_send(()),
                Err(crossbeam_channel::TrySendError::Disconnected(_))
            )
        });
        waiters.push(tx.clone());
    }
    let s = sq.clone();
    let h = std::thread::Builder::new()
        .name(format!("nvme-sq{}", sq.params.id))
        .spawn(move || run(&shared, &s, &cq, &rx))?;
    Ok(Arc::new(SqSlot {
        sq,
        wake: tx,
        thread: Mutex::new(Some(h)),
    }))
}

fn run(shared: &Arc<Shared>, sq: &Sq, cq: &Cq, wake: &Receiver<()>) {
    let mut pending: Option<Completion> = None;
    while !sq.stop.load(Ordering::SeqCst) {
        serve(shared, sq, cq, &mut pending);
        if shared.is_fatal() || !rearm(shared, sq, cq, pending.is_some()) {
            // Nothing visible to do: sleep until a doorbell (or a stop).
            if wake.recv().is_err() {
                return;
            }
        }
    }
}

/// With shadow doorbells: ask the guest to ring when it publishes more (the SQ tail past
/// our head, or the CQ head while a completion waits for room), then look once more;
/// true if there is work after all. Without: false.
fn rearm(shared: &Shared, sq: &Sq, cq: &Cq, waiting_for_room: bool) -> bool {
    let (Some(sdb), cdb) = (sq.dbbuf.get(), cq.dbbuf.get()) else {
        return false;
    };
    let result = (|| {
        let head = sq.head.load(Ordering::SeqCst);
        if waiting_for_room {
            if let Some(cdb) = cdb {
                cdb.arm_cq(cq.params.id, cq.published_head()?)?;
            }
            return Ok(!cq.is_full()?);
        }
        sdb.arm_sq(sq.params.id, head)?;
        Ok(sq.published_tail()? != head)
    })();
    result.unwrap_or_else(|e: umdev::dma::DmaError| {
        shared.fatal(&format!("doorbell buffer unreachable: {e}"));
        false
    })
}

/// Completions per interrupt within a burst: the Interrupt Coalescing feature's
/// aggregation threshold (THR + 1) unless the vector opted out (Interrupt Vector
/// Configuration CD), else [`BATCH`]. The end of a burst always interrupts: the
/// aggregation time (TIME) is accepted and not used, so no completion waits for a timer.
fn per_interrupt(shared: &Shared, cq: &Cq) -> u32 {
    let f = lock(&shared.features);
    let opted_out = f
        .vector_config
        .get(usize::from(cq.vector))
        .copied()
        .unwrap_or(true);
    if f.irq_coalescing == 0 || opted_out || cq.params.id == 0 {
        BATCH
    } else {
        (f.irq_coalescing & 0xff) + 1
    }
}

/// Post `pending` if there is one; false if the queue is full or gone.
fn flush(
    shared: &Shared,
    cq: &Cq,
    pending: &mut Option<Completion>,
    posted: &mut u32,
    every: u32,
) -> bool {
    let Some(c) = pending.as_ref() else {
        return true;
    };
    match cq.post(c) {
        Ok(Posted::Done) => {
            *pending = None;
            *posted += 1;
            if (*posted).is_multiple_of(every) {
                shared.interrupt(cq);
            }
            true
        }
        Ok(Posted::Full) => false,
        Err(e) => {
            shared.fatal(&format!(
                "completion queue {} unwritable: {e}",
                cq.params.id
            ));
            false
        }
    }
}

/// Run everything that can run now.
fn serve(shared: &Arc<Shared>, sq: &Sq, cq: &Cq, pending: &mut Option<Completion>) {
    let admin = sq.params.id == 0;
    let every = per_interrupt(shared, cq);
    let mut posted = 0u32;
    loop {
        if sq.stop.load(Ordering::SeqCst) || shared.is_fatal() {
            break;
        }
        if !flush(shared, cq, pending, &mut posted, every) {
            break;
        }
        let head = sq.head.load(Ordering::SeqCst);
        if admin {
            if let Some(c) = next_event(shared, head) {
                *pending = Some(c);
                continue;
            }
        }
        match sq.published_tail() {
            Ok(tail) if tail == head => break,
            Ok(_) => {}
            Err(e) => {
                shared.fatal(&format!("doorbell buffer unreadable: {e}"));
                break;
            }
        }
        let cmd = match sq.fetch(head) {
            Ok(c) => c,
            Err(e) => {
                shared.fatal(&format!(
                    "submission queue {} unreadable: {e}",
                    sq.params.id
                ));
                break;
            }
        };
        let next = (head + 1) % sq.params.size;
        sq.head.store(next, Ordering::SeqCst);
        let outcome = if admin {
            admin::execute(shared, sq, &cmd)
        } else {
            nvm::execute(shared, sq, &cmd)
        };
        if let Outcome::Done { status, result } = outcome {
            if !status.is_success() {
                tracing::debug!(
                    qid = sq.params.id,
                    cid = cmd.cid,
                    op = cmd.opcode,
                    ?status,
                    "nvme: command failed"
                );
            }
            *pending = Some(Completion {
                result,
                sq_head: next as u16,
                sq_id: sq.params.id,
                cid: cmd.cid,
                status,
            });
        }
    }
    if !posted.is_multiple_of(every) {
        shared.interrupt(cq);
    }
}

/// The completion of an outstanding Asynchronous Event Request, if an event waits.
fn next_event(shared: &Shared, head: u32) -> Option<Completion> {
    let mut aer = lock(&shared.aer);
    if aer.outstanding.is_empty() || aer.events.is_empty() {
        return None;
    }
    let cid = aer.outstanding.remove(0);
    let event = aer.events.pop_front()?;
    aer.masked |= 1 << (event & 7);
    Some(Completion {
        result: event,
        sq_head: head as u16,
        sq_id: 0,
        cid,
        status: Status::SUCCESS,
    })
}
