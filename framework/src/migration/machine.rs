//! The migration state machine of one connection: the device state, the data transfer
//! session, and the calls into the device's [`Migrate`] on each arc.
//!
//! **Arcs** ([`super::arcs`] has the table): a SET walks the shortest legal path one arc at a
//! time, the way the kernel's drivers loop on `vfio_mig_get_next_state`; each arc is one
//! step of `Machine::step`:
//!
//! - RUNNING → STOP, PRE_COPY → STOP_COPY: [`Migrate::stop`], preceded by
//!   [`Quiesce::Stopping`] (the server cancels and refuses server→client requests from then
//!   on: a device thread blocked on the client cannot delay the stop, and no request reaches
//!   the client while the device is stopped).
//! - STOP → RUNNING: [`Quiesce::Running`] (requests allowed again), then
//!   [`Migrate::resume`].
//! - STOP → STOP_COPY and PRE_COPY → STOP_COPY: [`Migrate::save`], framed after whatever
//!   the session already holds: the reads that follow drain it, and a short read means the
//!   end of the stream.
//! - RUNNING → PRE_COPY: a saving session starts (the stream's `Start` frame); each read
//!   that finds the session drained takes the next [`Migrate::precopy`] chunk.
//! - STOP_COPY → STOP, PRE_COPY → RUNNING: the saving session ends (unread data is
//!   dropped).
//! - STOP → RESUMING: a resuming session starts ([`StreamReader`]); writes feed it.
//! - RESUMING → STOP: the stream must be whole; [`Migrate::load`] of its state.
//!
//! **Invariants.**
//! - `state` changes only by a successful arc, by [`Machine::reset`], or to ERROR.
//! - A target that is not reachable (ERROR, a P2P state, PRE_COPY without support,
//!   STOP_COPY → PRE_COPY, anything from ERROR) is refused before any arc runs: the state is
//!   unchanged.
//! - An arc whose device call fails puts the machine in ERROR (as the kernel's drivers do
//!   when they cannot restore a valid state); the session is dropped. Only a reset leaves
//!   ERROR ([`Machine::reset`] after the device's reset).
//! - `device_stopped` is true from a successful [`Migrate::stop`] until a successful
//!   [`Migrate::resume`]: it, not `state`, says whether the device must be resumed (after a
//!   reset or a disconnect from ERROR, say).
//! - A saving session exists exactly in PRE_COPY and STOP_COPY, a resuming one exactly in
//!   RESUMING; data reads and writes in any other state are refused.

use std::collections::VecDeque;

use super::arcs::{self, ArcError};
use super::stream::{self, StreamReader};
use super::{MigState, Migrate, MigrationCaps, MigrationError};

/// What the machine tells its owner around stopping and running the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quiesce {
    /// The device is about to be stopped: refuse server→client requests from now on.
    Stopping,
    /// The device is about to run again: server→client requests are allowed.
    Running,
}

/// Why a migration request failed.
#[derive(Debug, thiserror::Error)]
pub enum MachineError {
    /// The requested state cannot be reached (the state is unchanged).
    #[error("cannot go from {from:?} to {to:?}")]
    Arc {
        /// The state the device is in.
        from: MigState,
        /// The requested state.
        to: MigState,
        /// Why.
        #[source]
        source: ArcError,
    },
    /// An arc's device call failed; the device is now in ERROR.
    #[error("the arc {from:?} -> {to:?} failed; the device is in ERROR until reset")]
    ArcFailed {
        /// Start of the failed arc.
        from: MigState,
        /// End of the failed arc.
        to: MigState,
        /// The device's error.
        #[source]
        source: MigrationError,
    },
    /// MIG_DATA_READ/WRITE in a state without the matching session.
    #[error("migration data {what} in state {state:?}")]
    NoSession {
        /// "read" or "write".
        what: &'static str,
        /// The current state.
        state: MigState,
    },
    /// The data written is not a stream this umdev can load (the session stays refused).
    #[error("migration data refused")]
    Stream(#[source] MigrationError),
    /// Producing data to read failed (the read fails; the state is unchanged).
    #[error("producing migration data failed")]
    Produce(#[source] MigrationError),
}

/// A saving session: the bytes produced and not read yet.
///
/// Kept as the buffers they were produced in — a frame head, then the device's own state
/// or chunk — so a large state is never copied to sit behind its head: the reads copy out
/// of these buffers, and each is dropped once read.
#[derive(Debug, Default)]
struct Saving {
    queue: VecDeque<Vec<u8>>,
    /// Bytes of the front buffer already read.
    pos: usize,
    /// Bytes not read yet, over the whole queue.
    left: usize,
    /// The client saw the end of the data produced so far (a short read); in PRE_COPY the
    /// next read asks the device for more.
    may_refill: bool,
    /// The first PRE_COPY chunk was asked for: until then the `Start` frame is not a round
    /// of its own, so the first read carries it and the first chunk.
    first_asked: bool,
    /// STOP_COPY's state is framed: after it, the stream has ended for good.
    final_state: bool,
}

impl Saving {
    fn left(&self) -> usize {
        self.left
    }

    /// Queue `more` after the unread bytes.
    fn push(&mut self, more: Vec<u8>) {
        if !more.is_empty() {
            self.left += more.len();
            self.queue.push_back(more);
        }
    }

    /// Take up to `n` bytes.
    fn take(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n.min(self.left));
        while out.len() < n {
            let Some(front) = self.queue.front() else {
                break;
            };
            let k = (n - out.len()).min(front.len() - self.pos);
            out.extend_from_slice(&front[self.pos..self.pos + k]);
            self.pos += k;
            if self.pos == front.len() {
                self.queue.pop_front();
                self.pos = 0;
            }
        }
        self.left -= out.len();
        out
    }
}

#[derive(Debug)]
enum Session {
    None,
    Saving(Saving),
    Resuming(StreamReader),
}

/// Counters of one machine (for logs and tests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MachineStats {
    /// Bytes handed out by reads, over all sessions.
    pub bytes_read: u64,
    /// Bytes taken by writes, over all sessions.
    pub bytes_written: u64,
    /// PRE_COPY chunks produced.
    pub precopy_chunks: u64,
}

/// Refuse a state or chunk over the device's declared [`Migrate::max_state_size`]: no
/// destination would read it (a device bug, reported on the source).
fn within_limit(what: &str, len: usize, dev: &dyn Migrate) -> Result<(), MigrationError> {
    let max = dev.max_state_size().min(stream::MAX_FRAME as u64);
    if len as u64 > max {
        return Err(MigrationError::Device(format!(
            "the device produced a {what} of {len} bytes, over the {max} it declares"
        )));
    }
    Ok(())
}

/// The state machine of one connection (see the module doc).
#[derive(Debug)]
pub struct Machine {
    caps: MigrationCaps,
    state: MigState,
    device_stopped: bool,
    session: Session,
    stats: MachineStats,
}

impl Machine {
    /// A machine for a device with `caps`, RUNNING.
    pub fn new(caps: MigrationCaps) -> Machine {
        Machine {
            caps,
            state: MigState::Running,
            device_stopped: false,
            session: Session::None,
            stats: MachineStats::default(),
        }
    }

    /// The device's optional features.
    pub fn caps(&self) -> MigrationCaps {
        self.caps
    }

    /// The current state.
    pub fn state(&self) -> MigState {
        self.state
    }

    /// True if the device was stopped and not resumed since.
    pub fn device_stopped(&self) -> bool {
        self.device_stopped
    }

    /// Counters.
    pub fn stats(&self) -> MachineStats {
        self.stats
    }

    /// Walk to `target`, arc by arc. The path is checked before the first arc runs, so an
    /// unreachable target changes nothing; a failing arc leaves the machine in ERROR.
    pub fn set_state(
        &mut self,
        target: MigState,
        dev: &mut dyn Migrate,
        quiesce: &mut dyn FnMut(Quiesce),
    ) -> Result<(), MachineError> {
        let from = self.state;
        let path = arcs::path(from, target, self.caps).map_err(|source| MachineError::Arc {
            from,
            to: target,
            source,
        })?;
        for next in path {
            let cur = self.state;
            if let Err(source) = self.step(next, dev, quiesce) {
                tracing::warn!(from = ?cur, to = ?next, error = %source, "migration arc failed; device state ERROR");
                self.state = MigState::Error;
                self.session = Session::None;
                return Err(MachineError::ArcFailed {
                    from: cur,
                    to: next,
                    source,
                });
            }
            tracing::debug!(from = ?cur, to = ?next, "migration arc");
            self.state = next;
        }
        Ok(())
    }

    /// One direct arc from the current state to `next`.
    fn step(
        &mut self,
        next: MigState,
        dev: &mut dyn Migrate,
        quiesce: &mut dyn FnMut(Quiesce),
    ) -> Result<(), MigrationError> {
        use MigState::*;
        match (self.state, next) {
            (Running, Stop) => self.stop(dev, quiesce),
            (Stop, Running) => {
                quiesce(Quiesce::Running);
                dev.resume().inspect_err(|_| quiesce(Quiesce::Stopping))?;
                self.device_stopped = false;
                Ok(())
            }
            (Stop, StopCopy) => {
                let mut s = Saving::default();
                let mut start = Vec::new();
                stream::write_start(&mut start)?;
                s.push(start);
                self.save_final(&mut s, dev)?;
                self.session = Session::Saving(s);
                Ok(())
            }
            (PreCopy, StopCopy) => {
                self.stop(dev, quiesce)?;
                let Session::Saving(mut s) = std::mem::replace(&mut self.session, Session::None)
                else {
                    return Err(MigrationError::Device("PRE_COPY without a session".into()));
                };
                self.save_final(&mut s, dev)?;
                self.session = Session::Saving(s);
                Ok(())
            }
            (StopCopy, Stop) | (PreCopy, Running) => {
                self.session = Session::None;
                Ok(())
            }
            (Running, PreCopy) => {
                let mut start = Vec::new();
                stream::write_start(&mut start)?;
                let mut s = Saving {
                    may_refill: true,
                    ..Saving::default()
                };
                s.push(start);
                self.session = Session::Saving(s);
                Ok(())
            }
            (Stop, Resuming) => {
                self.session = Session::Resuming(StreamReader::new());
                Ok(())
            }
            (Resuming, Stop) => {
                let Session::Resuming(mut r) = std::mem::replace(&mut self.session, Session::None)
                else {
                    return Err(MigrationError::Device("RESUMING without a session".into()));
                };
                let state = r.finish()?;
                dev.load(&state)
            }
            (from, to) => Err(MigrationError::Device(format!(
                "no arc {from:?} -> {to:?} (a framework bug)"
            ))),
        }
    }

    fn stop(
        &mut self,
        dev: &mut dyn Migrate,
        quiesce: &mut dyn FnMut(Quiesce),
    ) -> Result<(), MigrationError> {
        quiesce(Quiesce::Stopping);
        dev.stop()?;
        self.device_stopped = true;
        Ok(())
    }

    fn save_final(&mut self, s: &mut Saving, dev: &mut dyn Migrate) -> Result<(), MigrationError> {
        let state = dev.save()?;
        within_limit("state", state.len(), dev)?;
        s.push(stream::state_head(&state)?);
        s.push(state);
        s.push(stream::end_frame()?);
        s.final_state = true;
        Ok(())
    }

    /// The device's next PRE_COPY chunk, queued; false if it has none.
    fn produce(&mut self, dev: &mut dyn Migrate) -> Result<bool, MachineError> {
        let Session::Saving(s) = &mut self.session else {
            return Ok(false);
        };
        let Some(chunk) = dev.precopy().map_err(MachineError::Produce)? else {
            return Ok(false);
        };
        within_limit("PRE_COPY chunk", chunk.len(), dev).map_err(MachineError::Produce)?;
        s.push(stream::precopy_head(&chunk).map_err(MachineError::Produce)?);
        s.push(chunk);
        self.stats.precopy_chunks += 1;
        Ok(true)
    }

    /// MIG_DATA_READ of up to `size` bytes (fewer means: no more data for now in PRE_COPY,
    /// the end of the stream in STOP_COPY). The first PRE_COPY read carries the `Start`
    /// frame and as much of the first chunk as fits.
    pub fn read(&mut self, size: usize, dev: &mut dyn Migrate) -> Result<Vec<u8>, MachineError> {
        let state = self.state;
        let Session::Saving(s) = &mut self.session else {
            return Err(MachineError::NoSession {
                what: "read",
                state,
            });
        };
        if !s.final_state {
            if !s.first_asked {
                s.first_asked = true;
                self.produce(dev)?;
            } else if s.left() == 0 {
                if !s.may_refill {
                    // The previous read ended exactly at the end of a chunk: this empty
                    // read is the client's "no more data for now"; the next one asks the
                    // device.
                    s.may_refill = true;
                    return Ok(Vec::new());
                }
                if !self.produce(dev)? {
                    return Ok(Vec::new());
                }
            }
        }
        let Session::Saving(s) = &mut self.session else {
            return Ok(Vec::new());
        };
        let out = s.take(size);
        if s.left() == 0 {
            s.may_refill = out.len() < size;
        }
        self.stats.bytes_read += out.len() as u64;
        Ok(out)
    }

    /// MIG_DATA_WRITE of `data` (the next bytes of the stream).
    pub fn write(&mut self, data: &[u8], dev: &mut dyn Migrate) -> Result<(), MachineError> {
        let state = self.state;
        let Session::Resuming(r) = &mut self.session else {
            return Err(MachineError::NoSession {
                what: "write",
                state,
            });
        };
        self.stats.bytes_written += data.len() as u64;
        r.feed(data, dev).map_err(MachineError::Stream)
    }

    /// The device was reset (DEVICE_RESET): back to RUNNING with no session. The caller
    /// resumes the device first if [`Machine::device_stopped`] (then `resumed` is true).
    pub fn reset(&mut self, resumed: bool) {
        if resumed {
            self.device_stopped = false;
        }
        self.state = if self.device_stopped {
            MigState::Error
        } else {
            MigState::Running
        };
        self.session = Session::None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One PRE_COPY chunk of `chunk` bytes, then none; a state of `state` bytes.
    struct OneChunk {
        chunk: usize,
        state: usize,
        sent: bool,
        limit: u64,
    }

    impl OneChunk {
        fn new(chunk: usize, state: usize) -> OneChunk {
            OneChunk {
                chunk,
                state,
                sent: false,
                limit: crate::migration::DEFAULT_MAX_STATE,
            }
        }
    }

    impl Migrate for OneChunk {
        fn caps(&self) -> MigrationCaps {
            MigrationCaps { pre_copy: true }
        }
        fn max_state_size(&self) -> u64 {
            self.limit
        }
        fn stop(&mut self) -> Result<(), MigrationError> {
            Ok(())
        }
        fn resume(&mut self) -> Result<(), MigrationError> {
            Ok(())
        }
        fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
            Ok(vec![2; self.state])
        }
        fn load(&mut self, _state: &[u8]) -> Result<(), MigrationError> {
            Ok(())
        }
        fn precopy(&mut self) -> Result<Option<Vec<u8>>, MigrationError> {
            Ok((!std::mem::replace(&mut self.sent, true)).then(|| vec![1; self.chunk]))
        }
    }

    fn start_len() -> usize {
        let mut s = Vec::new();
        stream::write_start(&mut s).unwrap();
        s.len()
    }

    #[test]
    fn test_machine_first_precopy_read_carries_start_and_first_chunk() {
        let mut dev = OneChunk::new(100, 10);
        let mut m = Machine::new(dev.caps());
        m.set_state(MigState::PreCopy, &mut dev, &mut |_| {})
            .unwrap();
        let first = m.read(4096, &mut dev).unwrap();
        assert!(
            first.len() > start_len() + 100,
            "the first read returned {} bytes (the Start frame is {})",
            first.len(),
            start_len()
        );
        assert!(m.read(4096, &mut dev).unwrap().is_empty(), "round over");
        // A small first read still gets the start first, then the rest of the chunk.
        let mut dev = OneChunk::new(100, 10);
        let mut m = Machine::new(dev.caps());
        m.set_state(MigState::PreCopy, &mut dev, &mut |_| {})
            .unwrap();
        let mut all = m.read(8, &mut dev).unwrap();
        loop {
            let more = m.read(8, &mut dev).unwrap();
            let short = more.len() < 8;
            all.extend(more);
            if short {
                break;
            }
        }
        assert_eq!(all, first, "the same bytes in small reads");
        // STOP_COPY then drains the state and ends.
        m.set_state(MigState::StopCopy, &mut dev, &mut |_| {})
            .unwrap();
        let rest = m.read(4096, &mut dev).unwrap();
        assert!(m.read(4096, &mut dev).unwrap().is_empty());
        assert!(!rest.is_empty());
    }

    #[test]
    fn test_machine_state_over_declared_limit_fails_the_arc_on_the_source() {
        let mut dev = OneChunk::new(10, 2000);
        dev.limit = 1000;
        let mut m = Machine::new(dev.caps());
        m.set_state(MigState::Stop, &mut dev, &mut |_| {}).unwrap();
        let e = m
            .set_state(MigState::StopCopy, &mut dev, &mut |_| {})
            .unwrap_err();
        assert!(e.to_string().contains("ERROR"), "{e}");
        assert_eq!(m.state(), MigState::Error);
    }
}
