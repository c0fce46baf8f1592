//! Live migration of the GPU ([`umdev::migration::Migrate`]).
//!
//! **What migrates**: the registers (mode, ring base/size/head/tail and enable, `IRQ_STATUS`,
//! `IRQ_ENABLE`, the error registers, `FENCE_VALUE`, the GTT invalidation registers), every
//! GTT entry, and the framebuffer contents. Not state: the pins (the destination pins a GTT
//! page again the first time a command uses it, as after any entry change), the ring
//! generation, the engine's counters, and the engine weight (a destination instance has
//! the weight of its own type). The formats and their versions are in `wire.rs`; the
//! guest-visible contract is in `protocol-docs/devices/gpu.md` ("Live migration").
//!
//! **STOP** is the quiescing a reset uses (`worker.rs`): `Worker::hold` waits until the
//! fetcher and the engine are between units of this GPU and keeps them there. When it
//! returns no register changes, no interrupt is raised, no framebuffer byte is written and
//! no DMA is done (no pin, no ring fetch) on this GPU's behalf; every command is either
//! complete (registers, fence, interrupt) or not started, and the commands not executed
//! stay published in the guest's ring, `RING_HEAD` naming the first. On a shared engine
//! the other GPUs go on: the stopped lane is parked, not waited for. The hold lives until
//! RUNNING (or until the device is re-attached, when the new worker is held instead).
//!
//! **RUNNING** drops the hold and rings the doorbell: the fetcher fetches
//! `[RING_HEAD, RING_TAIL)` again, so on the destination the commands published before
//! STOP execute there, each completing (and interrupting) once. An interrupt raised before
//! STOP is not raised again: it was delivered on the source, and what is still pending in
//! the interrupt controller (MSI-X pending bits, INTx) is the framework's state, not the
//! GPU's.
//!
//! **PRE_COPY** sends the framebuffer while the guest keeps drawing: the first chunk holds
//! every page, each later one the pages changed since (`fb_sync.rs` says how a change is
//! found, guest CPU writes through the mapped BAR2 included), so that STOP_COPY carries only
//! what changed after the last round. The saved state then names how many chunks it builds
//! on, and a destination that did not load exactly those refuses it. What the source sent
//! is forgotten when it runs again ([`Migrate::resume`]): the next migration starts with a
//! whole framebuffer. The framework must call `resume` on every arc back to RUNNING, also
//! PRE_COPY → RUNNING; it may call it when the GPU is not stopped.
//!
//! **Load** checks everything before it changes anything (format, version, that the state
//! is one a GPU of this framebuffer size can be in, that its PRE_COPY base is loaded), so a
//! refused state leaves nothing half applied; the GPU is then reset, as the trait asks.

mod fb_sync;
pub mod wire;

use umdev::migration::{encode_state, Migrate, MigrationCaps, MigrationError};
use umdev::pci::PciDevice;

use super::gtt::{self, lock};
use super::worker::{Hold, Worker};
use super::Gpu;
use fb_sync::{Incoming, Outgoing};
use wire::{
    ChunkV1, FbPartV1, StateV1, PRECOPY_FORMAT, PRECOPY_VERSION, STATE_FORMAT, STATE_VERSION,
};

/// The GPU's migration state (owned by the device, touched on the connection thread only).
#[derive(Default)]
pub(super) struct Migration {
    /// Between STOP and RUNNING.
    stopped: bool,
    /// Keeps the work quiescent while stopped (none while not attached).
    hold: Option<Hold>,
    /// Source: what PRE_COPY has sent.
    outgoing: Option<Outgoing>,
    /// Destination: the PRE_COPY chunks loaded.
    incoming: Option<Incoming>,
}

impl Migration {
    /// The device got a new worker: a stopped GPU stays stopped. The old worker is gone
    /// already (its hold is dropped here, harmlessly).
    pub(super) fn reattached(&mut self, worker: Option<&Worker>) {
        self.hold = None;
        if self.stopped {
            self.hold = worker.map(Worker::hold);
        }
    }
}

impl Gpu {
    /// Hold the work while a state is read or written, whether or not the GPU is stopped
    /// (a stopped GPU's hold nests).
    fn hold_work(&self) -> Option<Hold> {
        self.worker.as_ref().map(Worker::hold)
    }

    fn load_state(&mut self, state: &[u8]) -> Result<(), MigrationError> {
        let (s, pages) = wire::decode_state_v1(state, self.fb_size)?;
        s.check_regs(self.fb_size)?;
        let complete = pages.check(self.fb_size)?;
        let base = s.fb.precopy_chunks;
        if base == 0 && !complete {
            return Err(MigrationError::Malformed {
                format: STATE_FORMAT.to_owned(),
                why: "the framebuffer part is neither whole nor based on PRE_COPY data".into(),
            });
        }
        let loaded = self.mig.incoming.as_ref().map_or(0, |i| i.next);
        if base != 0 && base != loaded {
            return Err(MigrationError::Incompatible(format!(
                "the state builds on {base} PRE_COPY chunks, {loaded} were loaded"
            )));
        }
        // Checked: from here on nothing fails.
        let hold = self.hold_work();
        if let Some(h) = &hold {
            h.discard_work();
        }
        s.apply_regs(&mut lock(&self.shared.regs));
        let pfns = {
            let mut g = self.shared.gtt.quiesce();
            let pfns = g.take_all_pins();
            g.load_entries(&s.gtt);
            pfns
        };
        gtt::release(self.dma.as_ref(), &pfns);
        pages.apply(&self.shared.fb);
        self.shared.idle.notify_all();
        drop(hold);
        tracing::info!(
            pages = pages.len(),
            precopy_chunks = base,
            head = s.ring.head,
            tail = s.ring.tail,
            "gpu: state loaded"
        );
        Ok(())
    }
}

impl Migrate for Gpu {
    fn caps(&self) -> MigrationCaps {
        MigrationCaps { pre_copy: true }
    }

    /// The largest state or chunk of this GPU's framebuffer size (every page sent whole).
    fn max_state_size(&self) -> u64 {
        wire::max_encoded_size(self.fb_size)
    }

    fn stop(&mut self) -> Result<(), MigrationError> {
        if !self.mig.stopped {
            self.mig.hold = self.hold_work();
            self.mig.stopped = true;
            tracing::debug!("gpu: stopped for migration");
        }
        Ok(())
    }

    fn resume(&mut self) -> Result<(), MigrationError> {
        self.mig.stopped = false;
        self.mig.outgoing = None;
        self.mig.incoming = None;
        self.mig.hold = None;
        // The commands published and not executed (on a destination: all of them) are
        // fetched from RING_HEAD; the fetcher needs a doorbell to look.
        if let Some(w) = &self.worker {
            w.doorbell();
        }
        tracing::debug!("gpu: running after migration stop");
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
        let hold = self.hold_work();
        let fb = &self.shared.fb;
        let part = match &self.mig.outgoing {
            Some(out) => FbPartV1 {
                precopy_chunks: out.chunks(),
                pages: out.delta(fb),
            },
            None => FbPartV1 {
                precopy_chunks: 0,
                pages: fb_sync::all_pages(fb),
            },
        };
        let gtt = self.shared.gtt.lock().entries().to_vec();
        let state = StateV1::capture(&lock(&self.shared.regs), &gtt, self.fb_size, part);
        drop(hold);
        tracing::info!(
            pages = state.fb.pages.len(),
            precopy_chunks = state.fb.precopy_chunks,
            "gpu: state saved"
        );
        encode_state(STATE_FORMAT, STATE_VERSION, &state)
    }

    fn load(&mut self, state: &[u8]) -> Result<(), MigrationError> {
        let result = self.load_state(state);
        self.mig.incoming = None;
        if let Err(e) = &result {
            tracing::warn!(error = %e, "gpu: migration state refused; the GPU is reset");
            PciDevice::reset(self);
        }
        result
    }

    fn precopy(&mut self) -> Result<Option<Vec<u8>>, MigrationError> {
        let fb = &self.shared.fb;
        let (seq, pages) = match &mut self.mig.outgoing {
            None => {
                let (out, pages) = Outgoing::start(fb);
                self.mig.outgoing = Some(out);
                (0, pages)
            }
            Some(out) => {
                let pages = out.round(fb);
                if pages.is_empty() {
                    return Ok(None);
                }
                (out.chunks() - 1, pages)
            }
        };
        tracing::debug!(seq, pages = pages.len(), "gpu: PRE_COPY chunk");
        let chunk = ChunkV1 {
            fb_size: self.fb_size,
            seq,
            pages,
        };
        encode_state(PRECOPY_FORMAT, PRECOPY_VERSION, &chunk).map(Some)
    }

    fn load_precopy(&mut self, chunk: &[u8]) -> Result<(), MigrationError> {
        let checked = wire::decode_chunk_v1(chunk, self.fb_size).and_then(|(seq, pages)| {
            let complete = pages.check(self.fb_size)?;
            let expected = self.mig.incoming.as_ref().map_or(0, |i| i.next);
            match seq {
                0 if !complete => Err(MigrationError::Malformed {
                    format: PRECOPY_FORMAT.to_owned(),
                    why: "the first PRE_COPY chunk does not hold every page".into(),
                }),
                0 => Ok((seq, pages)),
                seq if seq == expected => Ok((seq, pages)),
                seq => Err(MigrationError::Incompatible(format!(
                    "PRE_COPY chunk {seq} arrived, chunk {expected} was expected"
                ))),
            }
        });
        match checked {
            Ok((seq, pages)) => {
                pages.apply(&self.shared.fb);
                self.mig.incoming = Some(Incoming {
                    next: seq.saturating_add(1),
                });
                Ok(())
            }
            Err(e) => {
                // A state built on the chunks is refused from now on (a later chunk 0
                // starts over).
                self.mig.incoming = None;
                tracing::warn!(error = %e, "gpu: PRE_COPY chunk refused");
                Err(e)
            }
        }
    }
}
