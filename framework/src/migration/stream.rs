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
//! keep the source's segmentation), parses each frame as soon as it is whole, checks its
//! CRC, and applies `Precopy` frames to the device at once. Anything wrong — a bad head, a
//! length over [`MAX_FRAME`], a CRC mismatch, frames out of order, bytes after `End` — is a
//! [`MigrationError::Malformed`] that poisons the reader: every later call fails the same
//! way, so a half-read stream is never taken for a whole one. [`StreamReader::finish`]
//! refuses a stream cut short (no `End`, or a partial frame left over).

use serde::{Deserialize, Serialize};

use super::{decode_state, encode_state, Migrate, MigrationError};

/// The format name in the `Start` frame.
pub const STREAM_FORMAT: &str = "umdev-migration-stream";
/// The stream version this umdev writes; it reads 1..=this.
pub const STREAM_VERSION: u32 = 1;
/// Largest frame payload accepted (a corrupted length must not make the reader buffer
/// without bound).
pub const MAX_FRAME: usize = 1 << 30;
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

fn frame(kind: Kind, payload: &[u8], out: &mut Vec<u8>) -> Result<(), MigrationError> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|&l| l as usize <= MAX_FRAME)
        .ok_or_else(|| malformed(format!("a frame of {} bytes", payload.len())))?;
    let head = Head {
        kind,
        len,
        crc: crc_of(kind, payload),
    };
    let h = postcard::to_allocvec(&head).map_err(|e| malformed(e.to_string()))?;
    out.extend_from_slice(&h);
    out.extend_from_slice(payload);
    Ok(())
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

/// Parses a stream fed in pieces (see the module doc).
#[derive(Debug)]
pub struct StreamReader {
    buf: Vec<u8>,
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
            buf: Vec::new(),
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

    /// Feed the next `data` of the stream; whole `Precopy` frames go to
    /// `dev.load_precopy` at once. An error poisons the reader.
    pub fn feed(&mut self, data: &[u8], dev: &mut dyn Migrate) -> Result<(), MigrationError> {
        if let Phase::Poisoned(why) = &self.phase {
            return Err(malformed(format!("refused earlier: {why}")));
        }
        self.bytes = self.bytes.saturating_add(data.len() as u64);
        self.buf.extend_from_slice(data);
        let r = self.parse(dev);
        if let Err(e) = &r {
            self.phase = Phase::Poisoned(e.to_string());
            self.buf = Vec::new();
            self.state = None;
        }
        r
    }

    fn parse(&mut self, dev: &mut dyn Migrate) -> Result<(), MigrationError> {
        let mut buf = std::mem::take(&mut self.buf);
        let mut pos = 0usize;
        let result = loop {
            let rest = &buf[pos..];
            if rest.is_empty() {
                break Ok(());
            }
            if self.phase == Phase::Ended {
                break Err(malformed(format!("{} bytes after the end", rest.len())));
            }
            let (head, after) = match postcard::take_from_bytes::<Head>(rest) {
                Ok(v) => v,
                Err(postcard::Error::DeserializeUnexpectedEnd) if rest.len() < MAX_HEAD => {
                    break Ok(()); // the head is not whole yet
                }
                Err(e) => break Err(malformed(format!("bad frame head: {e}"))),
            };
            let len = head.len as usize;
            if len > MAX_FRAME {
                break Err(malformed(format!(
                    "frame of {len} bytes is over {MAX_FRAME}"
                )));
            }
            let head_len = rest.len() - after.len();
            if after.len() < len {
                break Ok(()); // the payload is not whole yet
            }
            let payload = &after[..len];
            if crc_of(head.kind, payload) != head.crc {
                break Err(malformed(format!(
                    "{:?} frame of {len} bytes fails its CRC check (corrupted)",
                    head.kind
                )));
            }
            if let Err(e) = self.apply(head.kind, payload, dev) {
                break Err(e);
            }
            pos += head_len + len;
        };
        buf.drain(..pos);
        self.buf = buf;
        result
    }

    fn apply(
        &mut self,
        kind: Kind,
        payload: &[u8],
        dev: &mut dyn Migrate,
    ) -> Result<(), MigrationError> {
        match (&self.phase, kind) {
            (Phase::Header, Kind::Start) => {
                decode_state::<()>(STREAM_FORMAT, 1, STREAM_VERSION, payload)?;
                self.phase = Phase::Body;
            }
            (Phase::Header, k) => {
                return Err(malformed(format!(
                    "the stream starts with a {k:?} frame, not Start (not a umdev stream)"
                )))
            }
            (Phase::Body, Kind::Precopy) => {
                dev.load_precopy(payload)?;
                self.precopy_frames += 1;
            }
            (Phase::Body, Kind::State) => {
                self.state = Some(payload.to_vec());
                self.phase = Phase::AfterState;
            }
            (Phase::AfterState, Kind::End) => self.phase = Phase::Ended,
            (phase, k) => {
                return Err(malformed(format!("a {k:?} frame in phase {phase:?}")));
            }
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
                self.buf.len()
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
    }

    impl Migrate for Sink {
        fn caps(&self) -> MigrationCaps {
            MigrationCaps { pre_copy: true }
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
}
