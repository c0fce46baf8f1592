//! The worker thread of one submission queue: fetch, execute, post, interrupt.
//!
//! A doorbell only stores the new tail and wakes the worker (a token in a one-slot
//! channel, so wake-ups coalesce and an idle queue costs no CPU). The worker then runs
//! every entry between its head and the tail: fetches it through the ring's held pins,
//! executes it (admin commands on the worker, one at a time; I/O commands in the I/O pool,
//! [`super::pool`], up to [`MAX_IN_FLIGHT`] at once, so they overlap and may complete out
//! of order), and posts the completions on its completion queue. When the
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

use std::collections::VecDeque;

use crossbeam_channel::{Receiver, Sender};

use super::admin;
use super::ctrl::{Shared, SqSlot};
use super::io as nvm;
use super::pool::Job;
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
    spawn_with(shared, sq, cq, VecDeque::new())
}

/// Start the worker of `sq` with `pending`, completions of commands it ran before a
/// migration stop that are not posted yet (posted first, in order).
pub fn spawn_with(
    shared: Arc<Shared>,
    sq: Arc<Sq>,
    cq: Arc<Cq>,
    pending: VecDeque<Completion>,
) -> io::Result<Arc<SqSlot>> {
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
        .spawn(move || run(&shared, &s, &cq, &rx, pending))?;
    Ok(Arc::new(SqSlot {
        sq,
        wake: tx,
        thread: Mutex::new(Some(h)),
    }))
}

/// Most commands of one queue in the I/O pool at once.
pub const MAX_IN_FLIGHT: usize = 64;

/// A worker's completions: ready to post, and on their way back from the pool.
struct Flights {
    ready: VecDeque<Completion>,
    in_flight: usize,
    done_tx: Sender<Completion>,
    done_rx: Receiver<Completion>,
}

impl Flights {
    fn collect(&mut self) {
        while let Ok(c) = self.done_rx.try_recv() {
            self.in_flight -= 1;
            self.ready.push_back(c);
        }
    }
}

/// Sends a pool job's completion back to its worker, or Internal Error if the job ended
/// without one (a panic), so that the worker never waits for it forever.
struct Reply {
    tx: Sender<Completion>,
    completion: Completion,
    sent: bool,
}

impl Reply {
    fn send(mut self, outcome: Outcome) {
        if let Outcome::Done { status, result } = outcome {
            self.completion.status = status;
            self.completion.result = result;
        }
        self.sent = true;
        let _ = self.tx.send(self.completion);
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if !self.sent {
            let _ = self.tx.send(self.completion);
        }
    }
}

/// The worker's loop, until its queue is stopped; returns the completions not posted yet
/// (the pool's commands of the queue all back: none is in flight when it returns).
fn run(
    shared: &Arc<Shared>,
    sq: &Arc<Sq>,
    cq: &Cq,
    wake: &Receiver<()>,
    pending: VecDeque<Completion>,
) -> VecDeque<Completion> {
    let (done_tx, done_rx) = crossbeam_channel::unbounded();
    let mut f = Flights {
        ready: pending,
        in_flight: 0,
        done_tx,
        done_rx,
    };
    while !sq.stop.load(Ordering::SeqCst) {
        serve(shared, sq, cq, &mut f);
        let saturated = f.in_flight >= MAX_IN_FLIGHT;
        if !saturated && f.ready.is_empty() && poll_shadow(shared, sq, &f) {
            continue;
        }
        if shared.is_fatal() || saturated || !rearm(shared, sq, cq, !f.ready.is_empty()) {
            // Nothing visible to do: sleep until a doorbell, a command back from the pool,
            // or a stop.
            crossbeam_channel::select! {
                recv(wake) -> r => if r.is_err() { break },
                recv(f.done_rx) -> c => if let Ok(c) = c {
                    f.in_flight -= 1;
                    f.ready.push_back(c);
                },
            }
        }
    }
    // The pool's commands of this queue hold pins and touch guest memory: wait for them.
    while f.in_flight > 0 {
        match f.done_rx.recv() {
            Ok(c) => {
                f.in_flight -= 1;
                f.ready.push_back(c);
            }
            Err(_) => break,
        }
    }
    f.ready
}

/// How long [`poll_shadow`] watches by default ([`super::NvmeConfig::shadow_poll`]).
pub const SHADOW_POLL: std::time::Duration = std::time::Duration::from_micros(50);

/// With shadow doorbells, before arming the EventIdx: watch the shadow tail (and the
/// pool's completions) for up to `shared.limits.shadow_poll` (default [`SHADOW_POLL`]),
/// yielding between looks. A guest that
/// submits meanwhile does so without a doorbell trap (the EventIdx is not armed), and the
/// worker sees it without being woken. True if there is work.
fn poll_shadow(shared: &Shared, sq: &Sq, f: &Flights) -> bool {
    let budget = shared.limits.shadow_poll;
    if budget.is_zero() || sq.dbbuf.get().is_none() || shared.is_fatal() {
        return false;
    }
    let head = sq.head.load(Ordering::SeqCst);
    let start = std::time::Instant::now();
    while start.elapsed() < budget {
        if sq.stop.load(Ordering::SeqCst) || !f.done_rx.is_empty() {
            return true;
        }
        match sq.published_tail() {
            Ok(t) if t != head => return true,
            Ok(_) => {}
            Err(_) => return false,
        }
        std::thread::yield_now();
    }
    false
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

/// Post the ready completions in order (each with the SQ head as it is now); false if
/// the queue is full or gone.
fn flush(shared: &Shared, sq: &Sq, cq: &Cq, f: &mut Flights, posted: &mut u32, every: u32) -> bool {
    while let Some(c) = f.ready.front_mut() {
        c.sq_head = sq.head.load(Ordering::SeqCst) as u16;
        match cq.post(c) {
            Ok(Posted::Done) => {
                f.ready.pop_front();
                *posted += 1;
                if (*posted).is_multiple_of(every) {
                    shared.interrupt(cq);
                }
            }
            Ok(Posted::Full) => return false,
            Err(e) => {
                shared.fatal(&format!(
                    "completion queue {} unwritable: {e}",
                    cq.params.id
                ));
                return false;
            }
        }
    }
    true
}

/// Run everything that can run now.
fn serve(shared: &Arc<Shared>, sq: &Arc<Sq>, cq: &Cq, f: &mut Flights) {
    let admin = sq.params.id == 0;
    let every = per_interrupt(shared, cq);
    let mut posted = 0u32;
    loop {
        if sq.stop.load(Ordering::SeqCst) || shared.is_fatal() {
            break;
        }
        f.collect();
        if !flush(shared, sq, cq, f, &mut posted, every) {
            break;
        }
        let head = sq.head.load(Ordering::SeqCst);
        if admin {
            if let Some(c) = next_event(shared, head) {
                f.ready.push_back(c);
                continue;
            }
        }
        if f.in_flight >= MAX_IN_FLIGHT {
            break;
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
        let template = Completion {
            result: 0,
            sq_head: next as u16,
            sq_id: sq.params.id,
            cid: cmd.cid,
            status: Status::INTERNAL_ERROR,
        };
        // The pool overlaps a queue's commands; a command alone in its queue (nothing in
        // flight, nothing published behind it: queue depth 1) runs here instead, which
        // saves two thread wake-ups (to a pool thread and back) on its latency.
        let alone = f.in_flight == 0 && matches!(sq.published_tail(), Ok(t) if t == next);
        if !admin && !alone {
            if let Some(pool) = &shared.pool {
                let reply = Reply {
                    tx: f.done_tx.clone(),
                    completion: template,
                    sent: false,
                };
                let (s, q) = (shared.clone(), sq.clone());
                let job: Job = Box::new(move || reply.send(nvm::execute(&s, &q, &cmd)));
                // If the pool is gone (shutting down), the dropped job's Reply reports
                // Internal Error: either way one completion comes back.
                let _ = pool.send(job);
                f.in_flight += 1;
                continue;
            }
        }
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
            f.ready.push_back(Completion {
                status,
                result,
                ..template
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
