//! The migration data stream: what MIG_DATA_READ hands out on the source and
//! MIG_DATA_WRITE feeds in on the destination (`protocol-docs/migration.md`).
//!
//! The stream is a sequence of frames. A frame is a head — postcard of
//! `(kind, payload length, CRC-32 of kind and payload)` — followed by the payload:
//!
//! 1. one `Start` frame whose payload is [`encode_state`] of
//!    [`STREAM_FORMAT`] at [`STREAM_VERSION`] (so a stream of another format or a newer
//!    version is refused by its first frame, before anything else is read);
//! 2. any number of `Precopy` frames: the device's [`Migrate::precopy`] chunks, in order;
//! 3. one `State` frame: the device's [`Migrate::save`] (for a PCI device the framework's
//!    own PCI section, then the device's section: see `pci/migration.rs`);
//! 4. one `End` frame, empty.
//!
//! The reader ([`StreamReader`]) takes the bytes in pieces of any size (the client need not
//! keep the source's segmentation) and applies each frame as soon as it is whole: it checks
//! the frame's CRC, applies `Precopy` frames to the device at once and keeps the `State`
//! payload for [`StreamReader::finish`].
//!
//! **Memory.** A stream is client data, so the reader bounds what it holds: a frame head is
//! checked as soon as it is whole — its kind against the phase (frames out of order), its
//! length against the kind (a `Start` of at most [`MAX_START`] bytes, an empty `End`, a
//! `Precopy` or `State` of at most the device's [`Migrate::max_state_size`]) — before any of
//! its payload is buffered. The payload then goes straight into one buffer of exactly its
//! length, reserved once (fallibly: a failed reservation is an error, not an abort), so the
//! reader holds at most one frame, in one copy: a `State` payload is that buffer itself, a
//! `Precopy` payload is dropped once applied.
//!
//! Anything wrong — a bad head, a length over its limit, a CRC mismatch, frames out of
//! order, bytes after `End` — is a [`MigrationError::Malformed`] that poisons the reader:
//! every later call fails the same way, so a half-read stream is never taken for a whole
//! one. [`StreamReader::finish`] refuses a stream cut short (no `End`, or a partial frame
//! left over).

use serde::{Deserialize, Serialize};

use super::{decode_state, encode_state, Migrate, MigrationError};

/// The format name in the `Start` frame.
pub const STREAM_FORMAT: &str = "umdev-migration-stream";
/// The stream version this umdev writes; it reads 1..=this.
pub const STREAM_VERSION: u32 = 1;
/// Largest frame payload the format can carry (the head's length is a `u32`): the ceiling
/// of any device's [`Migrate::max_state_size`]. What a reader accepts is the device's own
/// limit, not this.
pub const MAX_FRAME: usize = u32::MAX as usize;
/// Largest `Start` payload accepted (it is a format name and a version).
pub const MAX_START: usize = 64;
/// Largest possible encoded frame head (kind byte plus two 5-byte varints).
const MAX_HEAD: usize = 11;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
enum Kind {
    Start,
    Precopy,
    State,
    End,
}

#[derive(Serialize, Deserialize)]
struct Head {
    kind: Kind,
    len: u32,
    crc: u32,
}

fn crc_of(kind: Kind, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&[kind as u8]);
    h.update(payload);
    h.finalize()
}

fn malformed(why: impl Into<String>) -> MigrationError {
    MigrationError::Malformed {
        format: STREAM_FORMAT.to_owned(),
        why: why.into(),
    }
}

/// The head of a frame of `kind` carrying `payload`.
fn head_of(kind: Kind, payload: &[u8]) -> Result<Vec<u8>, MigrationError> {
    let len = u32::try_from(payload.len())
        .map_err(|_| malformed(format!("a frame of {} bytes", payload.len())))?;
    let head = Head {
        kind,
        len,
        crc: crc_of(kind, payload),
    };
    postcard::to_allocvec(&head).map_err(|e| malformed(e.to_string()))
}

fn frame(kind: Kind, payload: &[u8], out: &mut Vec<u8>) -> Result<(), MigrationError> {
    out.extend_from_slice(&head_of(kind, payload)?);
    out.extend_from_slice(payload);
    Ok(())
}

/// The head of a `Precopy` frame carrying `chunk` (the chunk follows it unchanged): for a
/// writer that keeps the chunk in its own buffer instead of copying it after the head.
pub fn precopy_head(chunk: &[u8]) -> Result<Vec<u8>, MigrationError> {
    head_of(Kind::Precopy, chunk)
}

/// The head of the `State` frame carrying `state`; the state follows it unchanged, then
/// [`end_frame`].
pub fn state_head(state: &[u8]) -> Result<Vec<u8>, MigrationError> {
    head_of(Kind::State, state)
}

/// The `End` frame.
pub fn end_frame() -> Result<Vec<u8>, MigrationError> {
    let mut out = Vec::new();
    frame(Kind::End, &[], &mut out)?;
    Ok(out)
}

/// Append the `Start` frame.
pub fn write_start(out: &mut Vec<u8>) -> Result<(), MigrationError> {
    write_start_version(STREAM_VERSION, out)
}

/// Append a `Start` frame naming stream version `version`: what another umdev would write
/// (tests use it to check that a newer version is refused by its first frame).
pub fn write_start_version(version: u32, out: &mut Vec<u8>) -> Result<(), MigrationError> {
    let header = encode_state(STREAM_FORMAT, version, &())?;
    frame(Kind::Start, &header, out)
}

/// Append a `Precopy` frame carrying `chunk`.
pub fn write_precopy(chunk: &[u8], out: &mut Vec<u8>) -> Result<(), MigrationError> {
    frame(Kind::Precopy, chunk, out)
}

/// Append the `State` frame carrying `state`, then the `End` frame.
pub fn write_state_and_end(state: &[u8], out: &mut Vec<u8>) -> Result<(), MigrationError> {
    frame(Kind::State, state, out)?;
    frame(Kind::End, &[], out)
}

/// Where the reader is in the stream.
#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Nothing parsed yet: the next frame must be `Start`.
    Header,
    /// After `Start`: `Precopy` frames, then `State`.
    Body,
    /// After `State`: `End`.
    AfterState,
    /// `End` seen: the stream is whole.
    Ended,
    /// Refused; the message says why.
    Poisoned(String),
}

/// A frame whose head was read: its payload so far.
#[derive(Debug)]
struct Partial {
    kind: Kind,
    len: usize,
    crc: u32,
    payload: Vec<u8>,
}

/// Parses a stream fed in pieces (see the module doc).
#[derive(Debug)]
pub struct StreamReader {
    /// Bytes of a frame head not whole yet (at most [`MAX_HEAD`]).
    head: Vec<u8>,
    /// The frame being received, after its head.
    frame: Option<Partial>,
    phase: Phase,
    state: Option<Vec<u8>>,
    precopy_frames: u64,
    bytes: u64,
}

impl Default for StreamReader {
    fn default() -> Self {
        Self::new()
    }
}

impl StreamReader {
    /// A reader expecting the `Start` frame.
    pub fn new() -> StreamReader {
        StreamReader {
            head: Vec::with_capacity(MAX_HEAD),
            frame: None,
            phase: Phase::Header,
            state: None,
            precopy_frames: 0,
            bytes: 0,
        }
    }

    /// Bytes fed so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// `Precopy` frames applied so far.
    pub fn precopy_frames(&self) -> u64 {
        self.precopy_frames
    }

    /// Bytes the reader holds now (a partial head, the frame being received, the state):
    /// at most one frame's payload plus the state (tests check the bound with it).
    pub fn held(&self) -> usize {
        self.head.capacity()
            + self.frame.as_ref().map_or(0, |f| f.payload.capacity())
            + self.state.as_ref().map_or(0, Vec::capacity)
    }

    /// Feed the next `data` of the stream; whole `Precopy` frames go to
    /// `dev.load_precopy` at once. An error poisons the reader.
    pub fn feed(&mut self, data: &[u8], dev: &mut dyn Migrate) -> Result<(), MigrationError> {
        if let Phase::Poisoned(why) = &self.phase {
            return Err(malformed(format!("refused earlier: {why}")));
        }
        self.bytes = self.bytes.saturating_add(data.len() as u64);
        let r = self.parse(data, dev);
        if let Err(e) = &r {
            tracing::warn!(error = %e, fed = self.bytes, "migration stream refused");
            self.phase = Phase::Poisoned(e.to_string());
            self.head = Vec::new();
            self.frame = None;
            self.state = None;
        }
        r
    }

    fn parse(&mut self, mut data: &[u8], dev: &mut dyn Migrate) -> Result<(), MigrationError> {
        loop {
            if let Some(f) = &mut self.frame {
                let take = (f.len - f.payload.len()).min(data.len());
                f.payload.extend_from_slice(&data[..take]);
                data = &data[take..];
                if f.payload.len() < f.len {
                    return Ok(()); // the payload is not whole yet (`data` is used up)
                }
                let Some(f) = self.frame.take() else {
                    return Ok(());
                };
                if crc_of(f.kind, &f.payload) != f.crc {
                    return Err(malformed(format!(
                        "{:?} frame of {} bytes fails its CRC check (corrupted)",
                        f.kind, f.len
                    )));
                }
                self.apply(f.kind, f.payload, dev)?;
                continue;
            }
            if data.is_empty() {
                return Ok(());
            }
            if self.phase == Phase::Ended {
                return Err(malformed(format!("{} bytes after the end", data.len())));
            }
            // Complete the head from `data`: at most MAX_HEAD bytes are ever held.
            let had = self.head.len();
            let take = (MAX_HEAD - had).min(data.len());
            self.head.extend_from_slice(&data[..take]);
            let (head, used) = match postcard::take_from_bytes::<Head>(&self.head) {
                Ok((h, after)) => (h, self.head.len() - after.len()),
                Err(postcard::Error::DeserializeUnexpectedEnd) if self.head.len() < MAX_HEAD => {
                    return Ok(()); // the head is not whole yet (`data` is used up)
                }
                Err(e) => return Err(malformed(format!("bad frame head: {e}"))),
            };
            // `had` bytes did not parse alone, so the head took more than those.
            data = &data[used - had..];
            self.head.clear();
            let len = head.len as usize;
            self.check_head(head.kind, len, dev)?;
            let mut payload = Vec::new();
            payload.try_reserve_exact(len).map_err(|e| {
                MigrationError::Device(format!(
                    "cannot hold a {:?} frame of {len} bytes: {e}",
                    head.kind
                ))
            })?;
            self.frame = Some(Partial {
                kind: head.kind,
                len,
                crc: head.crc,
                payload,
            });
        }
    }

    /// A head is whole: its kind must fit the phase and its length the kind, before any
    /// of its payload is held.
    fn check_head(&self, kind: Kind, len: usize, dev: &dyn Migrate) -> Result<(), MigrationError> {
        let limit = match (&self.phase, kind) {
            (Phase::Header, Kind::Start) => MAX_START as u64,
            (Phase::Header, k) => {
                return Err(malformed(format!(
                    "the stream starts with a {k:?} frame, not Start (not a umdev stream)"
                )))
            }
            (Phase::Body, Kind::Precopy) if !dev.caps().pre_copy => {
                return Err(malformed(
                    "a Precopy frame for a device without PRE_COPY support",
                ))
            }
            (Phase::Body, Kind::Precopy | Kind::State) => {
                dev.max_state_size().min(MAX_FRAME as u64)
            }
            (Phase::AfterState, Kind::End) => 0,
            (phase, k) => return Err(malformed(format!("a {k:?} frame in phase {phase:?}"))),
        };
        if len as u64 > limit {
            return Err(malformed(format!(
                "a {kind:?} frame of {len} bytes is over this device's limit of {limit}"
            )));
        }
        Ok(())
    }

    fn apply(
        &mut self,
        kind: Kind,
        payload: Vec<u8>,
        dev: &mut dyn Migrate,
    ) -> Result<(), MigrationError> {
        match kind {
            Kind::Start => {
                decode_state::<()>(STREAM_FORMAT, 1, STREAM_VERSION, &payload)?;
                self.phase = Phase::Body;
            }
            Kind::Precopy => {
                dev.load_precopy(&payload)?;
                self.precopy_frames += 1;
            }
            Kind::State => {
                self.state = Some(payload);
                self.phase = Phase::AfterState;
            }
            Kind::End => self.phase = Phase::Ended,
        }
        Ok(())
    }

    /// The whole stream was fed: the saved state to load, or why the stream is not whole.
    pub fn finish(&mut self) -> Result<Vec<u8>, MigrationError> {
        match &self.phase {
            Phase::Poisoned(why) => Err(malformed(format!("refused earlier: {why}"))),
            Phase::Ended => self
                .state
                .take()
                .ok_or_else(|| malformed("the stream's state was already taken")),
            phase => Err(malformed(format!(
                "the stream is cut short ({} bytes received, {} of a frame left over, in phase {phase:?})",
                self.bytes,
                self.head.len() + self.frame.as_ref().map_or(0, |f| f.payload.len())
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::migration::MigrationCaps;

    /// Records what the reader applies.
    #[derive(Default)]
    struct Sink {
        chunks: Vec<Vec<u8>>,
        /// `max_state_size` (0: the default).
        limit: u64,
        no_precopy: bool,
    }

    impl Migrate for Sink {
        fn caps(&self) -> MigrationCaps {
            MigrationCaps {
                pre_copy: !self.no_precopy,
            }
        }
        fn max_state_size(&self) -> u64 {
            if self.limit == 0 {
                crate::migration::DEFAULT_MAX_STATE
            } else {
                self.limit
            }
        }
        fn stop(&mut self) -> Result<(), MigrationError> {
            Ok(())
        }
        fn resume(&mut self) -> Result<(), MigrationError> {
            Ok(())
        }
        fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
            Ok(Vec::new())
        }
        fn load(&mut self, _state: &[u8]) -> Result<(), MigrationError> {
            Ok(())
        }
        fn load_precopy(&mut self, chunk: &[u8]) -> Result<(), MigrationError> {
            self.chunks.push(chunk.to_vec());
            Ok(())
        }
    }

    fn stream() -> Vec<u8> {
        let mut s = Vec::new();
        write_start(&mut s).unwrap();
        write_precopy(b"first chunk", &mut s).unwrap();
        write_precopy(&[7; 300], &mut s).unwrap();
        write_state_and_end(b"the state", &mut s).unwrap();
        s
    }

    fn read(bytes: &[u8], piece: usize) -> (Result<Vec<u8>, MigrationError>, Sink) {
        let mut sink = Sink::default();
        let mut r = StreamReader::new();
        for p in bytes.chunks(piece.max(1)) {
            if let Err(e) = r.feed(p, &mut sink) {
                return (Err(e), sink);
            }
        }
        (r.finish(), sink)
    }

    #[test]
    fn test_stream_round_trip_in_any_piece_size() {
        let s = stream();
        for piece in [1, 2, 3, 7, 64, s.len()] {
            let (state, sink) = read(&s, piece);
            assert_eq!(state.unwrap(), b"the state", "piece {piece}");
            assert_eq!(sink.chunks, [b"first chunk".to_vec(), vec![7; 300]]);
        }
    }

    #[test]
    fn test_stream_cut_short_anywhere_refused() {
        let s = stream();
        for cut in 0..s.len() {
            let (state, _) = read(&s[..cut], 5);
            let e = state.unwrap_err();
            assert!(
                matches!(e, MigrationError::Malformed { .. }),
                "cut {cut}: {e}"
            );
        }
    }

    #[test]
    fn test_stream_any_flipped_byte_refused() {
        let s = stream();
        for i in 0..s.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = s.clone();
                bad[i] ^= bit;
                let (state, _) = read(&bad, 16);
                assert!(state.is_err(), "byte {i} ^ {bit:#x} was accepted");
            }
        }
    }

    #[test]
    fn test_stream_newer_version_refused_by_its_first_frame() {
        let mut s = Vec::new();
        write_start_version(STREAM_VERSION + 1, &mut s).unwrap();
        let mut r = StreamReader::new();
        let e = r.feed(&s, &mut Sink::default()).unwrap_err();
        assert!(
            matches!(e, MigrationError::UnsupportedVersion { found, .. } if found == STREAM_VERSION + 1),
            "{e}"
        );
        // Poisoned: a good stream fed afterwards is refused too.
        assert!(r.feed(&stream(), &mut Sink::default()).is_err());
        assert!(r.finish().is_err());
    }

    #[test]
    fn test_stream_trailing_bytes_and_missing_start_refused() {
        let mut s = stream();
        s.push(0);
        assert!(read(&s, 9).0.is_err());
        let mut no_start = Vec::new();
        write_precopy(b"x", &mut no_start).unwrap();
        assert!(read(&no_start, 9).0.is_err());
        let mut huge = Vec::new();
        let head = Head {
            kind: Kind::State,
            len: u32::MAX,
            crc: 0,
        };
        write_start(&mut huge).unwrap();
        huge.extend(postcard::to_allocvec(&head).unwrap());
        assert!(
            read(&huge, 9).0.is_err(),
            "a 4 GiB frame is refused at its head"
        );
    }

    /// A stream of `Start`, then the head of a `kind` frame of `len` bytes (no payload).
    fn start_and_head(kind: Kind, len: u32) -> Vec<u8> {
        let mut s = Vec::new();
        write_start(&mut s).unwrap();
        s.extend(postcard::to_allocvec(&Head { kind, len, crc: 0 }).unwrap());
        s
    }

    #[test]
    fn test_stream_frame_over_device_limit_refused_at_its_head() {
        for kind in [Kind::State, Kind::Precopy] {
            let mut sink = Sink {
                limit: 1000,
                ..Sink::default()
            };
            let mut r = StreamReader::new();
            r.feed(&start_and_head(kind, 1000), &mut sink).unwrap();
            assert!(r.held() >= 1000, "a frame within the limit is received");
            let mut r = StreamReader::new();
            let e = r.feed(&start_and_head(kind, 1001), &mut sink).unwrap_err();
            assert!(e.to_string().contains("limit"), "{kind:?}: {e}");
            assert_eq!(r.held(), 0, "nothing held after the refusal");
        }
        // A Precopy frame for a device without PRE_COPY, a Start frame over MAX_START and
        // an End frame with a payload: refused at their heads as well.
        let mut sink = Sink {
            no_precopy: true,
            ..Sink::default()
        };
        assert!(StreamReader::new()
            .feed(&start_and_head(Kind::Precopy, 10), &mut sink)
            .is_err());
        let big_start = postcard::to_allocvec(&Head {
            kind: Kind::Start,
            len: MAX_START as u32 + 1,
            crc: 0,
        })
        .unwrap();
        assert!(StreamReader::new()
            .feed(&big_start, &mut Sink::default())
            .is_err());
        let mut end = start_and_head(Kind::State, 0);
        end.extend(
            postcard::to_allocvec(&Head {
                kind: Kind::End,
                len: 1,
                crc: 0,
            })
            .unwrap(),
        );
        assert!(StreamReader::new()
            .feed(&end, &mut Sink::default())
            .is_err());
    }

    #[test]
    fn test_stream_large_frame_fed_in_pieces_held_once_at_its_exact_size() {
        let state = vec![0x5a; 1 << 20];
        let mut s = Vec::new();
        write_start(&mut s).unwrap();
        write_state_and_end(&state, &mut s).unwrap();
        let mut sink = Sink::default();
        let mut r = StreamReader::new();
        let mut peak = 0;
        for p in s.chunks(4096 + 7) {
            r.feed(p, &mut sink).unwrap();
            peak = peak.max(r.held());
        }
        assert!(
            peak <= state.len() + MAX_HEAD,
            "held {peak} bytes for a {}-byte frame",
            state.len()
        );
        assert_eq!(r.finish().unwrap(), state);
    }

    #[test]
    fn test_stream_state_over_1_gib_accepted_for_a_device_that_declares_it() {
        // A 2 GiB GPU type's state is ~2.004 GiB: its head must not be refused for its
        // size (the reader once capped every frame at 1 GiB, so STOP_COPY of such a type
        // could never be loaded). Nothing of the payload is fed: only its buffer is
        // reserved, untouched.
        let mut sink = Sink {
            limit: (2 << 30) + (10 << 20),
            ..Sink::default()
        };
        let mut r = StreamReader::new();
        r.feed(
            &start_and_head(Kind::State, (2 << 30) + (9 << 20)),
            &mut sink,
        )
        .unwrap();
    }
}
