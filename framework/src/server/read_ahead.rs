//! A connection's read-ahead: one `recvmsg` brings the header and payload of a message,
//! and every further whole message that has arrived with it.
//!
//! # The algorithm
//!
//! The read-ahead owns a buffer of [`READ_AHEAD`] bytes that always begins at a message
//! boundary. [`ReadAhead::next`] hands out the first buffered message if it is whole (no
//! syscall); otherwise it makes one `recvmsg` into the free tail of the buffer (the partial
//! message moved to the front first) and looks again. A message larger than the buffer is
//! read differently: what is buffered goes into its payload and the rest is read straight
//! into the payload, waiting for it, so no large message is copied twice. A message the
//! header refuses (too large, bad flags) is skipped: its buffered part dropped, the rest
//! read and discarded.
//!
//! # Fds: which message they belong to
//!
//! How Linux's `AF_UNIX` `SOCK_STREAM` receive (`unix_stream_read_generic`,
//! `net/unix/af_unix.c`) treats fds: `unix_stream_sendmsg` attaches a `sendmsg`'s fds to
//! the first skb it queues (a large `sendmsg` is split into several skbs; only the first
//! carries fds). A `recvmsg` copies skb after skb into the caller's buffer, gluing skbs
//! without fds; it may read *into* an skb that carries fds after such skbs, takes that skb's
//! fds (the whole set, even if it reads only part of the skb) and then stops: it never reads
//! past an skb that carried fds in the same call. Bytes read by `read()` (no control
//! buffer) lose the fds of the skbs they come from (the kernel closes them, MSG_CTRUNC is
//! set where no one sees it).
//!
//! So the fds a `recvmsg` returns came with the last skb it read, which holds its last
//! byte. umdev gives them to **the message that contains the last byte of the read that
//! returned them**. With a client that sends each message in one `sendmsg`, fds attached
//! (QEMU, libvfio-user, umdev's own clients), that skb is the first of the message the fds
//! were sent with, and nothing of a later message can be in the same read: the fds land on
//! their message and on no other, however many messages one read brings
//! (`test_fds_stay_on_their_message_back_to_back`). A client that packs several messages
//! into one `sendmsg` with fds has them given to the last message it began there; one that
//! sends fds in the middle of a message has them given to that message (its command's fd
//! check then applies).
//!
//! # Bounds
//!
//! - Bytes: the buffer's [`READ_AHEAD`], fixed (its capacity is allocated once per
//!   connection and never grows; pages no message reached are never touched). It does not
//!   count against the backlog's byte bound (`channel`): it is small and fixed, and a
//!   requester reads no more while the backlog is full, so messages in the read-ahead wait
//!   there as they would in the kernel's socket buffer.
//! - Fds: a read happens only when no whole message is buffered, so the buffer then holds
//!   at most one (partial) message and one fd set; a read adds at most one more. At most two
//!   sets of at most [`FD_SLOTS`] fds each are held; fds given to one message beyond
//!   [`FD_SLOTS`] in all are closed and the message is refused as if the kernel had cut them
//!   (MSG_CTRUNC).
//! - A message is read whole before it is handed out; the header's size is validated
//!   against `max_message` before any payload is allocated, and a message too large is
//!   discarded, as in `channel::read_one`.
//! - Non-blocking reads (`dontwait`, the poller's spinning, a requester's pump) consume
//!   nothing when no byte is there; bytes of a message that has arrived only in part are
//!   kept in the buffer and the next call continues with them (a message larger than the
//!   buffer is waited for once its remainder is read straight into the payload).

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use tracing::debug;

use super::channel::{usable_fds, Incoming, ReadResult};
use super::socket_io::{discard, recv_append, recv_with_fds, Received, FD_SLOTS};
use crate::protocol::{Header, MessageType, ProtocolError, HEADER_SIZE};

/// Bytes of the read-ahead buffer: far more than a burst of register accesses (16-byte
/// header + 16 to 24 bytes each), small enough that a connection holds little.
pub const READ_AHEAD: usize = 64 << 10;

/// Fds given to one message that has not been handed out yet.
#[derive(Debug)]
struct FdSet {
    /// Stream offset of the message's first byte.
    at: u64,
    fds: Vec<OwnedFd>,
    /// Fds received for it in all (including closed ones).
    received: usize,
    /// More than [`FD_SLOTS`] were sent with it (all closed).
    truncated: bool,
}

impl FdSet {
    fn new(at: u64) -> FdSet {
        FdSet {
            at,
            fds: Vec::new(),
            received: 0,
            truncated: false,
        }
    }

    /// Add the fds of one read; beyond [`FD_SLOTS`] in all, close every one and mark the
    /// set truncated (the message is refused as if the kernel had cut them).
    fn add(&mut self, got: Received) {
        self.received += got.fds.len();
        self.truncated |= got.fds_truncated || self.received > FD_SLOTS;
        if self.truncated {
            self.fds.clear();
        } else {
            self.fds.extend(got.fds);
        }
    }
}

/// The message `header` with `payload` and the fds given to it, as `channel` hands it on:
/// fds beyond what its command can use closed (counted), truncated fds refused.
fn message(
    header: Header,
    ty: MessageType,
    payload: Vec<u8>,
    set: Option<FdSet>,
    max_msg_fds: usize,
) -> ReadResult {
    let (mut fds, received, truncated) = match set {
        Some(s) => (s.fds, s.received, s.truncated),
        None => (Vec::new(), 0, false),
    };
    let mut fds_closed = 0;
    if fds.len() > usable_fds(&header, max_msg_fds) {
        // Closed now, not when the (possibly backlogged) message is handled.
        fds_closed = fds.len();
        fds.clear();
    }
    if truncated {
        return ReadResult::Invalid(
            header,
            ProtocolError::WrongFdCount {
                what: "message",
                expected: "at most max_msg_fds",
                got: received.max(FD_SLOTS) + 1,
            },
        );
    }
    ReadResult::Message(
        Incoming {
            header,
            payload,
            fds,
            fds_closed,
        },
        ty,
    )
}

/// One connection's read-ahead (module doc).
#[derive(Debug)]
pub struct ReadAhead {
    /// `buf[start..]` is what was read and not yet handed out; `start` is a message
    /// boundary. Capacity [`READ_AHEAD`], never more.
    buf: Vec<u8>,
    start: usize,
    /// Stream offset of `buf[start]`.
    offset: u64,
    /// Fd sets of buffered messages, in stream order (at most two: module doc).
    fds: Vec<FdSet>,
}

impl Default for ReadAhead {
    fn default() -> Self {
        ReadAhead::new()
    }
}

impl ReadAhead {
    /// An empty read-ahead of [`READ_AHEAD`] bytes.
    pub fn new() -> ReadAhead {
        ReadAhead::with_capacity(READ_AHEAD)
    }

    /// An empty read-ahead of `cap` bytes (at least a header's).
    pub fn with_capacity(cap: usize) -> ReadAhead {
        ReadAhead {
            buf: Vec::with_capacity(cap.max(HEADER_SIZE)),
            start: 0,
            offset: 0,
            fds: Vec::with_capacity(2),
        }
    }

    /// Bytes buffered and not yet handed out.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Fds held for buffered messages.
    #[cfg(test)]
    fn held_fds(&self) -> usize {
        self.fds.iter().map(|s| s.fds.len()).sum()
    }

    /// True if [`ReadAhead::next`] can return a message without reading: a whole message
    /// is buffered (or a header whose size has lost the framing).
    pub fn has_message(&self) -> bool {
        match self.header() {
            Some(h) => {
                (h.msg_size as usize) < HEADER_SIZE || self.buffered() >= h.msg_size as usize
            }
            None => false,
        }
    }

    /// The first buffered message's header, if all of it is buffered.
    fn header(&self) -> Option<Header> {
        let b = self.buf.get(self.start..self.start + HEADER_SIZE)?;
        Header::decode(b).ok()
    }

    /// The next message from `stream` (validated against `max_message`, fds checked
    /// against what its command can use with `max_msg_fds`), its payload in `spare`'s
    /// buffer (`spare` is left empty). With `dontwait`, `None` if no whole message is there
    /// yet: nothing was there to read, or what arrived is kept for the next call.
    pub fn next(
        &mut self,
        stream: &UnixStream,
        max_message: u32,
        max_msg_fds: usize,
        spare: &mut Vec<u8>,
        dontwait: bool,
    ) -> Option<ReadResult> {
        loop {
            if let Some(h) = self.header() {
                if let Some(r) = self.take(stream, h, max_message, max_msg_fds, spare) {
                    return Some(r);
                }
            }
            // No whole message is buffered: read more.
            self.compact();
            match recv_append(stream, &mut self.buf, dontwait) {
                Ok(got) if got.len == 0 => return Some(ReadResult::Eof),
                Ok(got) => self.attach(got),
                Err(e) if dontwait && e.kind() == io::ErrorKind::WouldBlock => return None,
                Err(e) => {
                    debug!(error = %e, "socket read failed");
                    return Some(ReadResult::Eof);
                }
            }
        }
    }

    /// Hand out the first message (header `h`) if it is whole, or if it is too large for
    /// the buffer (its remainder read into its payload) or refused (discarded); `None` if
    /// more must be read into the buffer first.
    fn take(
        &mut self,
        stream: &UnixStream,
        header: Header,
        max_message: u32,
        max_msg_fds: usize,
        spare: &mut Vec<u8>,
    ) -> Option<ReadResult> {
        let size = header.msg_size as usize;
        let buffered = self.buffered();
        let (ty, len) = match header.validate(max_message) {
            Ok(v) => v,
            Err(e @ ProtocolError::MessageTooSmall { .. }) => {
                // Framing lost: the connection ends; nothing after the header is read.
                self.consume(HEADER_SIZE);
                self.drop_fds_before(self.offset);
                return Some(ReadResult::Corrupt(header, e));
            }
            Err(e) => {
                // Framing kept: skip the message (its fds are closed with it).
                let here = size.min(buffered);
                self.consume(here);
                if discard(stream, size - here).is_err() {
                    return Some(ReadResult::Eof);
                }
                self.offset += (size - here) as u64;
                self.drop_fds_before(self.offset);
                return Some(ReadResult::Invalid(header, e));
            }
        };
        if buffered < size && size <= self.buf.capacity() {
            return None;
        }
        let at = self.offset;
        let mut payload = std::mem::take(spare);
        payload.clear();
        let here = size.min(buffered);
        payload.extend_from_slice(&self.buf[self.start + HEADER_SIZE..self.start + here]);
        self.consume(here);
        let mut set = self.take_fds(at);
        if payload.len() < len {
            // Larger than the buffer: the rest straight into the payload, waiting for it.
            let have = payload.len();
            payload.resize(len, 0);
            let mut done = have;
            while done < len {
                match recv_with_fds(stream, &mut payload[done..], false) {
                    Ok(got) if got.len == 0 => return Some(ReadResult::Eof),
                    Ok(got) => {
                        done += got.len;
                        self.offset += got.len as u64;
                        if !got.fds.is_empty() || got.fds_truncated {
                            set.get_or_insert_with(|| FdSet::new(at)).add(got);
                        }
                    }
                    Err(e) => {
                        debug!(error = %e, "socket read failed");
                        return Some(ReadResult::Eof);
                    }
                }
            }
        }
        Some(message(header, ty, payload, set, max_msg_fds))
    }

    /// Give the fds of a read that just ended at the buffer's end to the message holding
    /// the read's last byte (module doc).
    fn attach(&mut self, got: Received) {
        if got.fds.is_empty() && !got.fds_truncated {
            return;
        }
        let at = self.offset + (self.owner_of_last_byte() - self.start) as u64;
        match self.fds.last_mut() {
            Some(set) if set.at == at => set.add(got),
            _ => {
                let mut set = FdSet::new(at);
                set.add(got);
                self.fds.push(set);
            }
        }
    }

    /// Buffer index of the first byte of the message holding the buffer's last byte,
    /// following the headers' sizes from `start` (as `next` will).
    fn owner_of_last_byte(&self) -> usize {
        let end = self.buf.len();
        let mut pos = self.start;
        loop {
            let Some(h) = self.buf.get(pos..pos + HEADER_SIZE) else {
                return pos;
            };
            let size = Header::decode(h).map(|h| h.msg_size as usize).unwrap_or(0);
            if size < HEADER_SIZE {
                return pos;
            }
            match pos.checked_add(size) {
                Some(next) if next < end => pos = next,
                _ => return pos,
            }
        }
    }

    /// The fds given to the message starting at stream offset `at` (earlier sets, of
    /// messages already handed out, cannot exist; dropped if they did).
    fn take_fds(&mut self, at: u64) -> Option<FdSet> {
        self.drop_fds_before(at);
        if self.fds.first().is_some_and(|s| s.at == at) {
            return Some(self.fds.remove(0));
        }
        None
    }

    /// Close the fd sets of messages before stream offset `at`.
    fn drop_fds_before(&mut self, at: u64) {
        self.fds.retain(|s| s.at >= at);
    }

    /// `n` buffered bytes are handed out or skipped.
    fn consume(&mut self, n: usize) {
        self.start += n;
        self.offset += n as u64;
        if self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        }
    }

    /// Move the buffered bytes to the front, so the free tail is as large as it can be.
    fn compact(&mut self) {
        if self.start > 0 {
            self.buf.copy_within(self.start.., 0);
            self.buf.truncate(self.buf.len() - self.start);
            self.start = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{encode_message, Command, FLAGS_NO_REPLY};
    use crate::server::socket_io::send_message;
    use std::fs::File;
    use std::io::Write;
    use std::os::fd::{AsRawFd, RawFd};

    const MAX: u32 = 1 << 20;

    fn msg(id: u16, cmd: Command, payload: &[u8]) -> Vec<u8> {
        let mut h = Header::command(id, cmd, payload.len());
        h.flags |= FLAGS_NO_REPLY;
        encode_message(&h, payload)
    }

    fn next(ra: &mut ReadAhead, s: &UnixStream, dontwait: bool) -> Option<ReadResult> {
        ra.next(s, MAX, FD_SLOTS, &mut Vec::new(), dontwait)
    }

    /// The message, or a panic saying what came instead.
    fn message_of(r: Option<ReadResult>) -> Incoming {
        match r {
            Some(ReadResult::Message(m, _)) => m,
            other => panic!("expected a message, got {other:?}"),
        }
    }

    /// A file whose identity (`/proc/self/fd` link) tells it apart.
    fn named(tag: &str) -> (tempfile::TempDir, File) {
        let d = tempfile::tempdir().unwrap();
        let f = File::create(d.path().join(tag)).unwrap();
        (d, f)
    }

    fn link_of(fd: &OwnedFd) -> String {
        std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .unwrap()
            .to_string_lossy()
            .into_owned()
    }

    /// Send `buf` with `fds` in one sendmsg.
    fn send(s: &UnixStream, buf: &[u8], fds: &[RawFd]) {
        send_message(s, buf, fds).unwrap();
    }

    #[test]
    fn test_kernel_recvmsg_reads_into_fd_skb_and_stops_after_it() {
        // What the attribution rule (module doc) rests on, checked on this kernel.
        let (a, b) = UnixStream::pair().unwrap();
        let (_d, f) = named("f");
        send(&a, &[1; 40], &[]);
        send(&a, &[2; 24], &[f.as_raw_fd()]);
        send(&a, &[3; 32], &[]);
        let mut buf = vec![0u8; 4096];
        let got = recv_with_fds(&b, &mut buf, false).unwrap();
        assert_eq!(
            got.len, 64,
            "glued the fd-less skb and the one with fds, then stopped"
        );
        assert_eq!(got.fds.len(), 1);
        let got = recv_with_fds(&b, &mut buf, false).unwrap();
        assert_eq!(got.len, 32);
        assert!(got.fds.is_empty());
        // A read that ends inside the skb with fds takes all of them with its first bytes.
        send(&a, &[4; 40], &[f.as_raw_fd(), f.as_raw_fd()]);
        let got = recv_with_fds(&b, &mut buf[..10], false).unwrap();
        assert_eq!((got.len, got.fds.len()), (10, 2));
        let got = recv_with_fds(&b, &mut buf, false).unwrap();
        assert_eq!((got.len, got.fds.len()), (30, 0));
    }

    #[test]
    fn test_several_messages_in_one_read_handed_out_without_more_reads() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut all = Vec::new();
        for id in 0..5u16 {
            all.extend(msg(id, Command::RegionWrite, &[id as u8; 24]));
        }
        (&a).write_all(&all).unwrap();
        drop(a);
        let mut ra = ReadAhead::new();
        let m = message_of(next(&mut ra, &b, false));
        assert_eq!(m.header.msg_id, 0);
        assert_eq!(ra.buffered(), 4 * 40, "one read brought all five");
        for id in 1..5u16 {
            assert!(ra.has_message());
            let m = message_of(next(&mut ra, &b, true));
            assert_eq!((m.header.msg_id, m.payload), (id, vec![id as u8; 24]));
        }
        assert_eq!(ra.buffered(), 0);
        assert!(matches!(next(&mut ra, &b, false), Some(ReadResult::Eof)));
    }

    #[test]
    fn test_dontwait_nothing_there_consumes_nothing() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut ra = ReadAhead::new();
        assert!(next(&mut ra, &b, true).is_none());
        assert_eq!(ra.buffered(), 0);
        send(&a, &msg(7, Command::DeviceReset, &[]), &[]);
        assert_eq!(message_of(next(&mut ra, &b, true)).header.msg_id, 7);
    }

    #[test]
    fn test_message_split_across_reads_kept_until_whole() {
        let (a, b) = UnixStream::pair().unwrap();
        let m = msg(3, Command::RegionWrite, &[9; 100]);
        let mut ra = ReadAhead::new();
        // Mid-header, then mid-payload: kept, nothing handed out.
        for cut in [10, 70] {
            let done = ra.buffered();
            (&a).write_all(&m[done..cut]).unwrap();
            assert!(next(&mut ra, &b, true).is_none());
            assert_eq!(ra.buffered(), cut);
        }
        (&a).write_all(&m[70..]).unwrap();
        let got = message_of(next(&mut ra, &b, true));
        assert_eq!((got.header.msg_id, got.payload), (3, vec![9; 100]));
        // A blocking read waits for the rest.
        let m2 = msg(4, Command::RegionWrite, &[5; 100]);
        (&a).write_all(&m2[..30]).unwrap();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            (&a).write_all(&m2[30..]).unwrap();
            a
        });
        let got = message_of(next(&mut ra, &b, false));
        assert_eq!((got.header.msg_id, got.payload.len()), (4, 100));
        t.join().unwrap();
    }

    #[test]
    fn test_fds_stay_on_their_message_back_to_back() {
        let (a, b) = UnixStream::pair().unwrap();
        let (_d1, f1) = named("map-a");
        let (_d2, f2) = named("irq-b");
        let (_d3, f3) = named("irq-c");
        // Everything is sent before the first read: fd-less messages glue onto the ones
        // with fds in the same recvmsg.
        send(&a, &msg(1, Command::RegionWrite, &[0; 24]), &[]);
        send(&a, &msg(2, Command::DmaMap, &[0; 32]), &[f1.as_raw_fd()]);
        send(&a, &msg(3, Command::RegionWrite, &[0; 24]), &[]);
        send(&a, &msg(4, Command::RegionWrite, &[0; 24]), &[]);
        send(
            &a,
            &msg(5, Command::DeviceSetIrqs, &[0; 20]),
            &[f2.as_raw_fd(), f3.as_raw_fd()],
        );
        send(&a, &msg(6, Command::DmaMap, &[0; 32]), &[f1.as_raw_fd()]);
        send(&a, &msg(7, Command::RegionWrite, &[0; 24]), &[]);
        drop(a);
        let mut ra = ReadAhead::new();
        let mut seen = Vec::new();
        loop {
            match next(&mut ra, &b, false) {
                Some(ReadResult::Message(m, _)) => {
                    assert!(ra.held_fds() <= 2 * FD_SLOTS);
                    assert_eq!(m.fds_closed, 0, "message {}", m.header.msg_id);
                    let names: Vec<String> = m.fds.iter().map(link_of).collect();
                    seen.push((m.header.msg_id, names));
                }
                Some(ReadResult::Eof) => break,
                other => panic!("{other:?}"),
            }
        }
        let name = |n: &str| vec![n.to_string()];
        let fd_names = |f: &File| {
            std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))
                .unwrap()
                .to_string_lossy()
                .into_owned()
        };
        let want = vec![
            (1, vec![]),
            (2, name(&fd_names(&f1))),
            (3, vec![]),
            (4, vec![]),
            (5, vec![fd_names(&f2), fd_names(&f3)]),
            (6, name(&fd_names(&f1))),
            (7, vec![]),
        ];
        assert_eq!(seen, want);
    }

    #[test]
    fn test_fds_on_message_that_cannot_use_them_closed_and_counted() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        send(
            &a,
            &msg(1, Command::RegionWrite, &[0; 24]),
            &[f.as_raw_fd()],
        );
        send(&a, &msg(2, Command::RegionWrite, &[0; 24]), &[]);
        let mut ra = ReadAhead::new();
        let m = message_of(next(&mut ra, &b, false));
        assert_eq!((m.fds.len(), m.fds_closed), (0, 1));
        let m = message_of(next(&mut ra, &b, false));
        assert_eq!((m.header.msg_id, m.fds.len(), m.fds_closed), (2, 0, 0));
    }

    #[test]
    fn test_too_many_fds_truncated_message_invalid_next_intact() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        let fds = vec![f.as_raw_fd(); FD_SLOTS + 4];
        send(&a, &msg(1, Command::DeviceSetIrqs, &[0; 20]), &fds);
        send(&a, &msg(2, Command::RegionWrite, &[0; 24]), &[]);
        let mut ra = ReadAhead::new();
        match next(&mut ra, &b, false) {
            Some(ReadResult::Invalid(h, ProtocolError::WrongFdCount { .. })) => {
                assert_eq!(h.msg_id, 1)
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(ra.held_fds(), 0);
        assert_eq!(message_of(next(&mut ra, &b, false)).header.msg_id, 2);
    }

    #[test]
    fn test_fds_piling_up_on_one_message_beyond_slots_refused() {
        // One message sent in pieces, each with fds: more than FD_SLOTS in all.
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        let m = msg(1, Command::DeviceSetIrqs, &[0; 80]);
        let fds = vec![f.as_raw_fd(); FD_SLOTS / 2 + 1];
        for piece in m.chunks(48) {
            send(&a, piece, &fds);
        }
        let mut ra = ReadAhead::new();
        assert!(matches!(
            next(&mut ra, &b, false),
            Some(ReadResult::Invalid(_, ProtocolError::WrongFdCount { .. }))
        ));
        assert_eq!(ra.held_fds(), 0);
    }

    #[test]
    fn test_eof_mid_header_and_mid_payload_is_eof() {
        for cut in [0, 5, 16, 30] {
            let (a, b) = UnixStream::pair().unwrap();
            let m = msg(1, Command::RegionWrite, &[0; 24]);
            (&a).write_all(&m[..cut]).unwrap();
            drop(a);
            let mut ra = ReadAhead::new();
            assert!(
                matches!(next(&mut ra, &b, false), Some(ReadResult::Eof)),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn test_message_larger_than_buffer_read_into_payload_fds_kept() {
        let (a, b) = UnixStream::pair().unwrap();
        let (_d, f) = named("big");
        let big: Vec<u8> = (0..1000u32).map(|i| i as u8).collect();
        send(&a, &msg(1, Command::DmaMap, &big), &[f.as_raw_fd()]);
        send(&a, &msg(2, Command::RegionWrite, &[7; 24]), &[]);
        let mut ra = ReadAhead::with_capacity(64);
        let m = message_of(next(&mut ra, &b, false));
        assert_eq!((m.header.msg_id, &m.payload, m.fds.len()), (1, &big, 1));
        let m = message_of(next(&mut ra, &b, false));
        assert_eq!((m.header.msg_id, m.payload), (2, vec![7; 24]));
    }

    #[test]
    fn test_hostile_sizes_too_large_discarded_too_small_corrupt() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut h = Header::command(1, Command::RegionWrite, 0);
        h.msg_size = 16 + 100;
        let mut junk = h.encode().to_vec();
        junk.extend([0xee; 100]);
        (&a).write_all(&junk).unwrap();
        send(&a, &msg(2, Command::RegionWrite, &[1; 24]), &[]);
        let mut bad = Header::command(3, Command::RegionWrite, 0);
        bad.msg_size = 3;
        (&a).write_all(&bad.encode()).unwrap();
        let mut ra = ReadAhead::new();
        let r = ra.next(&b, 64, FD_SLOTS, &mut Vec::new(), false);
        assert!(matches!(
            r,
            Some(ReadResult::Invalid(
                _,
                ProtocolError::MessageTooLarge { .. }
            ))
        ));
        let r = ra.next(&b, 64, FD_SLOTS, &mut Vec::new(), false);
        assert_eq!(message_of(r).header.msg_id, 2, "framing kept");
        let r = ra.next(&b, 64, FD_SLOTS, &mut Vec::new(), false);
        assert!(matches!(r, Some(ReadResult::Corrupt(..))));
        // A garbage size far beyond the buffer and the limit: discarded from the socket.
        let mut huge = Header::command(4, Command::RegionWrite, 0);
        huge.msg_size = u32::MAX;
        (&a).write_all(&huge.encode()).unwrap();
        drop(a);
        let r = ra.next(&b, 64, FD_SLOTS, &mut Vec::new(), false);
        assert!(matches!(r, Some(ReadResult::Eof)), "EOF while discarding");
    }

    #[test]
    fn test_random_chunking_every_message_intact_fds_on_their_message() {
        // Messages of random sizes (some larger than the buffer), written in random pieces
        // that cross message boundaries; a message with fds starts a sendmsg of its own
        // that ends inside it (as a client sending one message per sendmsg does, possibly
        // cut short by a full socket buffer).
        let f = File::open("/dev/null").unwrap();
        for seed in 1..=20u64 {
            let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let mut rand = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let mut plan = Vec::new();
            for id in 0..60u16 {
                let len = if rand(10) == 0 {
                    300 + rand(400)
                } else {
                    rand(64)
                } as usize;
                let nfds = if rand(4) == 0 {
                    1 + rand(3) as usize
                } else {
                    0
                };
                let payload: Vec<u8> = (0..len).map(|i| (i as u8) ^ (id as u8)).collect();
                plan.push((msg(id, Command::DeviceSetIrqs, &payload), nfds));
            }
            let (a, b) = UnixStream::pair().unwrap();
            let sent = plan
                .iter()
                .map(|(m, n)| (m.clone(), *n))
                .collect::<Vec<_>>();
            let fd = f.as_raw_fd();
            let pieces: Vec<usize> = (0..2000).map(|_| 1 + rand(90) as usize).collect();
            let writer = std::thread::spawn(move || {
                let mut stream = Vec::new();
                let mut starts = Vec::new();
                for (m, n) in &sent {
                    starts.push((stream.len(), stream.len() + m.len(), *n));
                    stream.extend_from_slice(m);
                }
                let mut pos = 0;
                let mut next_piece = pieces.iter().cycle();
                while pos < stream.len() {
                    let mut end = (pos + next_piece.next().unwrap()).min(stream.len());
                    let mut fds = Vec::new();
                    if let Some(&(_, m_end, n)) = starts.iter().find(|s| s.0 == pos && s.2 > 0) {
                        end = end.min(m_end);
                        fds = vec![fd; n];
                    } else if let Some(&(s, _, _)) =
                        starts.iter().find(|s| s.0 > pos && s.0 < end && s.2 > 0)
                    {
                        // Stop before a message with fds: it starts a sendmsg.
                        end = s;
                    }
                    send_message(&a, &stream[pos..end], &fds).unwrap();
                    pos = end;
                }
            });
            let mut ra = ReadAhead::with_capacity(256);
            for (id, (m, nfds)) in plan.iter().enumerate() {
                // Non-blocking reads (retried: a partial message is kept) or blocking ones.
                let dontwait = rand(2) == 0;
                let got = loop {
                    if let Some(r) = next(&mut ra, &b, dontwait) {
                        break message_of(Some(r));
                    }
                };
                assert_eq!(got.header.msg_id as usize, id, "seed {seed}");
                assert_eq!(got.payload, m[HEADER_SIZE..], "seed {seed} message {id}");
                assert_eq!(got.fds.len(), *nfds, "seed {seed} message {id}");
                assert!(ra.held_fds() <= 2 * FD_SLOTS);
            }
            writer.join().unwrap();
            assert!(matches!(next(&mut ra, &b, false), Some(ReadResult::Eof)));
        }
    }

    #[test]
    fn test_payload_reuses_spare_capacity() {
        let (a, b) = UnixStream::pair().unwrap();
        send(&a, &msg(1, Command::RegionWrite, &[3; 24]), &[]);
        let mut ra = ReadAhead::new();
        let mut spare = Vec::with_capacity(4096);
        let ptr = spare.as_ptr();
        let m = message_of(ra.next(&b, MAX, FD_SLOTS, &mut spare, false));
        assert_eq!(m.payload.as_ptr(), ptr, "no allocation for a small message");
    }
}
