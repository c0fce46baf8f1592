//! Live migration of the NVMe controller ([`umdev::migration::Migrate`]).
//!
//! **What migrates** ([`wire::NvmeStateV1`]): the registers (CC, AQA, ASQ, ACQ, CSTS,
//! INTMS, and CC as latched at enable), the features set by Set Features, the asynchronous
//! events (outstanding requests' command ids, events waiting, the masked types), the
//! shadow-doorbell buffer's two addresses, the SMART counters, and every queue: a
//! completion queue's id, size, base, vector, IEN, head, tail and phase; a submission
//! queue's id, size, base, completion queue, head and tail, and the completions of commands
//! it ran that were not posted yet (its completion queue was full, or they came back from
//! the I/O pool as STOP came). Not state: pins (the destination pins a ring again the first
//! time it touches it after RUNNING, from its own DMA maps), and configuration (namespace
//! size, queue limits, shadow doorbell support: checked, not copied). The PCI side (config
//! space, MSI-X table and pending bits, INTx) is the framework's.
//!
//! **The image is shared storage**, as for ccw: the destination opens the same image; the
//! state records its size in blocks and a destination with another size refuses it. STOP
//! flushes the image (`fdatasync`) after the last write.
//!
//! **STOP** waits for the controller thread (an enable, disable or shutdown the guest asked
//! for is done first), then stops every queue's worker, the admin queue's first (it is the
//! only one that creates or deletes queues, or completes Asynchronous Event Requests). A
//! worker stops between commands and waits for its commands in the I/O pool; their
//! completions, and any it could not post, are kept with the queue ([`HeldSq`]); the I/O
//! queues are told at once and waited for together, up to 30 s (a queue whose I/O does not
//! finish by then fails the STOP: the migration fails and a reset recovers). So when
//! STOP returns no command is in flight, nothing touches guest memory or raises an
//! interrupt, and every command the controller fetched completes exactly once: posted
//! before STOP, or held and posted first by whichever controller runs next (the
//! destination after a migration, the source after an aborted one). While stopped, a
//! doorbell only stores its value, and a CC write is ignored (a VMM does not run the guest
//! between STOP and RUNNING). A reset while stopped drops what is held, as a reset drops
//! every queue.
//!
//! **Load** reads the state field by field within this controller's limits
//! ([`wire::decode_state_v1`]) and checks it whole ([`wire::NvmeStateV1::check`]) before it
//! changes anything; a refused state leaves the controller reset. A controller not attached
//! yet (a daemon creates the instance with the state before its server starts) keeps the
//! checked state and applies it at attach. The queues' workers start at RUNNING, I/O queues
//! first and the admin queue last (so that no admin command races with a queue coming
//! back).

pub mod wire;

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev::migration::{encode_state, Migrate, MigrationError};

use super::ctl::Ctl;
use super::ctrl::{Aer, Features, Shared, SqSlot};
use super::dbbuf::DbBuf;
use super::queues::{lock, Cq, QueueParams, Sq};
use super::spec::{Completion, Status};
use super::{worker, Nvme};
use wire::{
    CompletionV1, CqV1, FeaturesV1, NvmeStateV1, SqV1, MAX_PENDING, STATE_FORMAT, STATE_VERSION,
};

/// How long STOP waits for the controller thread.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// A submission queue stopped for migration, with what its worker had not posted.
pub(crate) struct HeldSq {
    sq: Arc<Sq>,
    cq: Arc<Cq>,
    pending: VecDeque<Completion>,
}

/// The controller's migration state (touched on the connection thread only).
#[derive(Default)]
pub(crate) struct Migration {
    /// Between STOP and RUNNING.
    pub(crate) stopped: bool,
    /// The queues STOP stopped (or a load built), restarted at RUNNING.
    held: Vec<HeldSq>,
    /// A state loaded before attach, applied at attach.
    pending: Option<NvmeStateV1>,
}

impl Migration {
    /// A reset drops every queue, those held by a migration stop too (and a state loaded
    /// before attach), and leaves the controller running: the framework resumes a device
    /// stopped for migration after its reset, and a STOP that failed leaves through a
    /// reset only.
    pub(crate) fn reset(&mut self) {
        self.held.clear();
        self.pending = None;
        self.stopped = false;
    }
}

fn to_completion(sq: &SqV1, c: &CompletionV1) -> Completion {
    Completion {
        result: c.result,
        sq_head: sq.head as u16,
        sq_id: sq.id,
        cid: c.cid,
        status: Status {
            sct: c.sct,
            sc: c.sc,
            dnr: c.dnr,
        },
    }
}

fn from_completion(c: &Completion) -> CompletionV1 {
    CompletionV1 {
        result: c.result,
        cid: c.cid,
        sct: c.status.sct,
        sc: c.status.sc,
        dnr: c.status.dnr,
    }
}

impl Nvme {
    /// Apply a checked state to the (reset) controller; its queues are held for RUNNING.
    fn apply_state(&mut self, shared: &Arc<Shared>, s: &NvmeStateV1) {
        self.cc = s.cc;
        self.aqa = s.aqa;
        self.asq = s.asq;
        self.acq = s.acq;
        shared.cc.store(s.cc_enabled, Ordering::SeqCst);
        shared.intms.store(s.intms, Ordering::SeqCst);
        let f = &s.features;
        *lock(&shared.features) = Features {
            arbitration: f.arbitration,
            power_state: f.power_state,
            temp_over: f.temp_over,
            temp_under: f.temp_under,
            error_recovery: f.error_recovery,
            write_cache: f.write_cache,
            queues_granted: f.queues_granted,
            irq_coalescing: f.irq_coalescing,
            vector_config: f.vector_config.clone(),
            write_atomicity: f.write_atomicity,
            async_event_config: f.async_event_config,
        };
        *lock(&shared.aer) = Aer {
            outstanding: s.aer_outstanding.clone(),
            events: s.aer_events.iter().copied().collect(),
            masked: s.aer_masked,
        };
        let c = &shared.counters;
        for (counter, v) in [
            &c.blocks_read,
            &c.blocks_written,
            &c.reads,
            &c.writes,
            &c.media_errors,
        ]
        .into_iter()
        .zip(s.counters)
        {
            counter.store(v, Ordering::SeqCst);
        }
        let db = s
            .dbbuf
            .map(|(shadow, ei)| Arc::new(DbBuf::new(&shared.dma, shadow, ei)));
        *lock(&shared.dbbuf) = db.clone();
        let mut cqs: Vec<Option<Arc<Cq>>> = vec![None; shared.cqs.len()];
        for c in &s.cqs {
            let params = QueueParams {
                id: c.id,
                size: c.size,
                base: c.base,
            };
            let cq = Cq::new(shared.dma.clone(), params, c.ien, c.vector);
            cq.head.store(c.head, Ordering::SeqCst);
            {
                let mut t = lock(&cq.tail);
                t.tail = c.tail;
                t.phase = c.phase;
            }
            if let (Some(db), true) = (&db, c.id != 0) {
                let _ = cq.dbbuf.set(db.clone());
            }
            let cq = Arc::new(cq);
            *shared.cqs[usize::from(c.id)]
                .write()
                .unwrap_or_else(|e| e.into_inner()) = Some(cq.clone());
            cqs[usize::from(c.id)] = Some(cq);
        }
        let mut held = Vec::new();
        for q in &s.sqs {
            let params = QueueParams {
                id: q.id,
                size: q.size,
                base: q.base,
            };
            let sq = Sq::new(shared.dma.clone(), params, q.cqid);
            sq.head.store(q.head, Ordering::SeqCst);
            sq.tail.store(q.tail, Ordering::SeqCst);
            if let (Some(db), true) = (&db, q.id != 0) {
                let _ = sq.dbbuf.set(db.clone());
            }
            let Some(cq) = cqs[usize::from(q.cqid)].clone() else {
                // Checked: every submission queue's completion queue is in the state.
                continue;
            };
            held.push(HeldSq {
                sq: Arc::new(sq),
                cq,
                pending: q.pending.iter().map(|c| to_completion(q, c)).collect(),
            });
        }
        shared.csts.store(s.csts, Ordering::SeqCst);
        self.mig.held = held;
    }

    /// A state loaded before attach: apply it now (`shared` was just built); the queues
    /// start unless the controller is stopped.
    pub(crate) fn apply_pending(&mut self, shared: &Arc<Shared>) {
        if let Some(s) = self.mig.pending.take() {
            self.apply_state(shared, &s);
            tracing::info!(
                queues = s.sqs.len(),
                "nvme: state loaded before attach applied"
            );
            if !self.mig.stopped {
                self.start_held(shared);
            }
        }
    }

    /// Start the workers of the held queues: I/O queues first, the admin queue last.
    fn start_held(&mut self, shared: &Arc<Shared>) {
        let mut held = std::mem::take(&mut self.mig.held);
        held.sort_by_key(|h| std::cmp::Reverse(h.sq.params.id));
        for h in held {
            let id = h.sq.params.id;
            h.sq.stop.store(false, Ordering::SeqCst);
            match worker::spawn_with(shared.clone(), h.sq, h.cq, h.pending) {
                Ok(slot) => {
                    *shared.sqs[usize::from(id)]
                        .write()
                        .unwrap_or_else(|e| e.into_inner()) = Some(slot)
                }
                Err(e) => shared.fatal(&format!("cannot restart queue {id}'s worker: {e}")),
            }
        }
    }

    /// Everything [`Migrate::save`] saves, the device stopped.
    fn capture(&self) -> Result<NvmeStateV1, MigrationError> {
        if let Some(p) = &self.mig.pending {
            // Loaded before attach and not applied yet: it is the state.
            return Ok(p.clone());
        }
        let vectors = usize::from(self.limits.max_io_queues) + 1;
        let mut state = NvmeStateV1 {
            blocks: self.blocks,
            max_io_queues: self.limits.max_io_queues,
            max_queue_entries: self.limits.max_queue_entries,
            cc: self.cc,
            cc_enabled: 0,
            aqa: self.aqa,
            asq: self.asq,
            acq: self.acq,
            csts: 0,
            intms: 0,
            features: features_v1(Features::defaults(vectors)),
            aer_outstanding: Vec::new(),
            aer_events: Vec::new(),
            aer_masked: 0,
            dbbuf: None,
            counters: [0; 5],
            cqs: Vec::new(),
            sqs: Vec::new(),
        };
        let Some(s) = &self.shared else {
            return Ok(state);
        };
        state.cc_enabled = s.cc.load(Ordering::SeqCst);
        state.csts = s.csts.load(Ordering::SeqCst);
        state.intms = s.intms.load(Ordering::SeqCst);
        state.features = features_v1(lock(&s.features).clone());
        {
            let a = lock(&s.aer);
            state.aer_outstanding = a.outstanding.clone();
            state.aer_events = a.events.iter().copied().collect();
            state.aer_masked = a.masked;
        }
        state.dbbuf = lock(&s.dbbuf)
            .as_ref()
            .map(|d| (d.shadow.base(), d.eventidx.base()));
        let c = &s.counters;
        state.counters = [
            &c.blocks_read,
            &c.blocks_written,
            &c.reads,
            &c.writes,
            &c.media_errors,
        ]
        .map(|a| a.load(Ordering::SeqCst));
        state.cqs = (0..s.cqs.len() as u16)
            .filter_map(|q| s.cq(q))
            .map(|c| {
                let t = lock(&c.tail);
                CqV1 {
                    id: c.params.id,
                    size: c.params.size,
                    base: c.params.base,
                    ien: c.ien,
                    vector: c.vector,
                    head: c.head.load(Ordering::SeqCst),
                    tail: t.tail,
                    phase: t.phase,
                }
            })
            .collect();
        let mut held: Vec<&HeldSq> = self.mig.held.iter().collect();
        held.sort_by_key(|h| h.sq.params.id);
        for h in held {
            if h.pending.len() > MAX_PENDING {
                return Err(MigrationError::Device(format!(
                    "nvme: queue {} holds {} completions (at most {MAX_PENDING} migrate)",
                    h.sq.params.id,
                    h.pending.len()
                )));
            }
            state.sqs.push(SqV1 {
                id: h.sq.params.id,
                size: h.sq.params.size,
                base: h.sq.params.base,
                cqid: h.sq.cqid,
                head: h.sq.head.load(Ordering::SeqCst),
                tail: h.sq.tail.load(Ordering::SeqCst),
                pending: h.pending.iter().map(from_completion).collect(),
            });
        }
        Ok(state)
    }

    fn load_state(&mut self, bytes: &[u8]) -> Result<NvmeStateV1, MigrationError> {
        if bytes.len() as u64 > self.max_state_size() {
            return Err(MigrationError::Malformed {
                format: STATE_FORMAT.to_owned(),
                why: format!(
                    "{} bytes, at most {} for this controller",
                    bytes.len(),
                    self.max_state_size()
                ),
            });
        }
        let s = wire::decode_state_v1(bytes, self.limits.max_io_queues)?;
        s.check(&self.limits, self.blocks)?;
        Ok(s)
    }
}

fn features_v1(f: Features) -> FeaturesV1 {
    FeaturesV1 {
        arbitration: f.arbitration,
        power_state: f.power_state,
        temp_over: f.temp_over,
        temp_under: f.temp_under,
        error_recovery: f.error_recovery,
        write_cache: f.write_cache,
        queues_granted: f.queues_granted,
        irq_coalescing: f.irq_coalescing,
        vector_config: f.vector_config,
        write_atomicity: f.write_atomicity,
        async_event_config: f.async_event_config,
    }
}

impl Migrate for Nvme {
    /// Every queue of this controller's configuration with the most completions held.
    fn max_state_size(&self) -> u64 {
        wire::max_encoded_size(self.limits.max_io_queues)
    }

    fn stop(&mut self) -> Result<(), MigrationError> {
        if self.mig.stopped {
            return Ok(());
        }
        let Some(shared) = self.shared.clone() else {
            self.mig.stopped = true;
            return Ok(());
        };
        if let Some(tx) = &self.ctl {
            let (done, wait) = crossbeam_channel::bounded(1);
            if tx.send(Ctl::Sync(done)).is_ok() && wait.recv_timeout(STOP_TIMEOUT).is_err() {
                return Err(MigrationError::Device(format!(
                    "nvme: the controller thread did not finish within {STOP_TIMEOUT:?}"
                )));
            }
        }
        self.mig.stopped = true;
        let deadline = Instant::now() + STOP_TIMEOUT;
        let mut held = Vec::new();
        let mut hold = |slot: &SqSlot, pending| match shared.cq(slot.sq.cqid) {
            Some(cq) => held.push(HeldSq {
                sq: slot.sq.clone(),
                cq,
                pending,
            }),
            None => tracing::error!(
                qid = slot.sq.params.id,
                "nvme: a submission queue without its CQ"
            ),
        };
        // The admin queue first: it is the only one that creates or deletes queues. Then
        // every I/O queue told at once, and waited for (their I/O in the pool overlaps).
        let mut late = None;
        if let Some(admin) = shared.sq(0) {
            admin.signal_stop();
            match admin.join_by(deadline) {
                Some(pending) => hold(&admin, pending),
                None => late = Some(0),
            }
        }
        let io: Vec<_> = (1..shared.sqs.len() as u16)
            .filter_map(|q| shared.sq(q))
            .collect();
        if late.is_none() {
            for slot in &io {
                slot.signal_stop();
            }
            for slot in &io {
                match slot.join_by(deadline) {
                    Some(pending) => hold(slot, pending),
                    None => {
                        late = Some(slot.sq.params.id);
                        break;
                    }
                }
            }
        }
        self.mig.held = held;
        if let Some(qid) = late {
            // The device cannot stop: the migration fails (ERROR) and only a reset, which
            // drops every queue and waits for its worker, leaves it.
            return Err(MigrationError::Device(format!(
                "nvme: queue {qid}'s commands did not finish within {STOP_TIMEOUT:?}"
            )));
        }
        let pending: usize = self.mig.held.iter().map(|h| h.pending.len()).sum();
        // What the source wrote must be on the shared image before the destination reads.
        self.flush()
            .map_err(|e| MigrationError::Device(format!("nvme: flushing the image: {e}")))?;
        tracing::debug!(pending, "nvme: stopped for migration");
        Ok(())
    }

    fn resume(&mut self) -> Result<(), MigrationError> {
        if !self.mig.stopped {
            return Ok(());
        }
        self.mig.stopped = false;
        if let Some(shared) = self.shared.clone() {
            self.start_held(&shared);
        }
        tracing::debug!("nvme: running after migration stop");
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
        self.stop()?;
        let state = self.capture()?;
        tracing::info!(
            queues = state.sqs.len(),
            pending = state.sqs.iter().map(|q| q.pending.len()).sum::<usize>(),
            aers = state.aer_outstanding.len(),
            "nvme: state saved"
        );
        encode_state(STATE_FORMAT, STATE_VERSION, &state)
    }

    fn load(&mut self, bytes: &[u8]) -> Result<(), MigrationError> {
        self.stop()?;
        let s = match self.load_state(bytes) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "nvme: migration state refused; the controller is reset");
                let stopped = self.mig.stopped;
                self.reset_and_wait();
                self.mig.stopped = stopped;
                return Err(e);
            }
        };
        let stopped = self.mig.stopped;
        self.reset_and_wait();
        self.mig.stopped = stopped;
        match self.shared.clone() {
            Some(shared) => self.apply_state(&shared, &s),
            None => self.mig.pending = Some(s.clone()),
        }
        tracing::info!(
            queues = s.sqs.len(),
            aers = s.aer_outstanding.len(),
            "nvme: state loaded"
        );
        Ok(())
    }
}
