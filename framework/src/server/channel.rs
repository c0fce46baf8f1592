//! One client connection's socket(s), shared by the connection thread and every thread
//! that issues server→client requests.
//!
//! Reading follows a leader/follower rule so that no reply can be stuck behind a busy
//! thread: whoever holds the read side reads; replies go straight to the waiting
//! requester (a table of pending requests keyed by message id, one crossbeam channel each;
//! ids come from a wrapping counter, so a late reply to a timed-out request cannot be
//! taken for the reply to the next one);
//! commands read by a requester are queued in a backlog for the connection thread. The
//! connection thread holds the read side only while it waits for the next message, never
//! while it calls the device, so a requester (including the device on the connection
//! thread itself) can always take over reading while it waits for its reply.

use std::collections::VecDeque;
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, RecvTimeoutError, Sender, TryRecvError};
use std::collections::HashMap;
use tracing::{debug, warn};

use super::socket_io::{
    discard, header_of, recv_header, recv_payload, send_message, wait_readable,
};
use crate::protocol::{encode_message, Command, Header, MessageType, ProtocolError, HEADER_SIZE};

/// A complete message as received.
#[derive(Debug)]
pub struct Incoming {
    /// Its header.
    pub header: Header,
    /// Its payload (message size − 16 bytes).
    pub payload: Vec<u8>,
    /// Fds that came with it.
    pub fds: Vec<OwnedFd>,
}

/// What one read from the socket produced.
#[derive(Debug)]
pub enum ReadResult {
    /// A well-framed message.
    Message(Incoming, MessageType),
    /// A message that was consumed but is invalid (framing kept): answer with an error.
    Invalid(Header, ProtocolError),
    /// Framing lost (message size below 16): answer with an error, then close.
    Corrupt(Header, ProtocolError),
    /// The peer closed the socket (or the socket failed).
    Eof,
}

/// Read one message from `stream`, validating the header against `max_message`.
pub fn read_one(stream: &UnixStream, max_message: u32) -> ReadResult {
    let raw = match recv_header(stream) {
        Ok(Some(raw)) => raw,
        Ok(None) => return ReadResult::Eof,
        Err(e) => {
            debug!(error = %e, "socket read failed");
            return ReadResult::Eof;
        }
    };
    let header = header_of(&raw);
    let (ty, len) = match header.validate(max_message) {
        Ok(v) => v,
        Err(e @ ProtocolError::MessageTooSmall { .. }) => return ReadResult::Corrupt(header, e),
        Err(e @ ProtocolError::MessageTooLarge { .. }) => {
            if discard(stream, header.msg_size as usize - HEADER_SIZE).is_err() {
                return ReadResult::Eof;
            }
            return ReadResult::Invalid(header, e);
        }
        Err(e) => {
            if discard(stream, header.msg_size as usize - HEADER_SIZE).is_err() {
                return ReadResult::Eof;
            }
            return ReadResult::Invalid(header, e);
        }
    };
    let mut payload = vec![0u8; len];
    if recv_payload(stream, &mut payload).is_err() {
        return ReadResult::Eof;
    }
    if raw.fds_truncated {
        return ReadResult::Invalid(
            header,
            ProtocolError::WrongFdCount {
                what: "message",
                expected: "at most max_msg_fds",
                got: raw.fds.len() + 1,
            },
        );
    }
    ReadResult::Message(
        Incoming {
            header,
            payload,
            fds: raw.fds,
        },
        ty,
    )
}

/// A command read by a requester, waiting for the connection thread (kept in arrival
/// order, invalid ones included, so replies and error replies go out in order).
#[derive(Debug)]
enum Backlogged {
    Command(Incoming),
    Invalid(Header, ProtocolError),
}

/// The read side of the main socket.
#[derive(Debug)]
pub struct ReadSide {
    stream: UnixStream,
    backlog: VecDeque<Backlogged>,
    eof: bool,
}

/// Why a server→client request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The client disconnected (or was never connected).
    #[error("client disconnected")]
    Disconnected,
    /// No reply within the timeout.
    #[error("no reply within {0:?}")]
    Timeout(Duration),
    /// Too many requests in flight.
    #[error("too many requests in flight")]
    Busy,
    /// The client answered with an error.
    #[error("client answered errno {0}")]
    Errno(u32),
    /// The reply is malformed.
    #[error("bad reply: {0}")]
    BadReply(ProtocolError),
}

/// Most server→client requests in flight at once.
const MAX_IN_FLIGHT: usize = 4096;

/// Pending server→client requests by message id.
#[derive(Debug, Default)]
struct Pending {
    waiting: HashMap<u16, Sender<Incoming>>,
    next_id: u16,
}

impl Pending {
    /// Register a requester; its message id is the next unused value of a wrapping counter.
    fn insert(&mut self, tx: Sender<Incoming>) -> Option<u16> {
        if self.waiting.len() >= MAX_IN_FLIGHT {
            return None;
        }
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if let std::collections::hash_map::Entry::Vacant(v) = self.waiting.entry(id) {
                v.insert(tx);
                return Some(id);
            }
        }
    }

    fn take(&mut self, id: u16) -> Option<Sender<Incoming>> {
        self.waiting.remove(&id)
    }

    fn clear(&mut self) {
        self.waiting.clear();
    }
}

/// A connection's socket state, shared by the connection thread and requesters.
#[derive(Debug)]
pub struct Channel {
    writer: Mutex<UnixStream>,
    /// Clones used only to shut the sockets down: a sender blocked in `sendmsg` (a client
    /// that stops reading) holds the writer lock, and `close` must not wait for it.
    control: UnixStream,
    twin_control: OnceLock<UnixStream>,
    reader: Mutex<ReadSide>,
    twin: Mutex<Option<UnixStream>>,
    twin_active: AtomicBool,
    pending: Mutex<Pending>,
    closed: AtomicBool,
    max_xfer: AtomicU32,
    max_message: u32,
    timeout: Duration,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

const PUMP_SLICE: Duration = Duration::from_millis(5);

impl Channel {
    /// Wrap a connected stream.
    pub fn new(
        stream: UnixStream,
        max_message: u32,
        max_xfer: u32,
        timeout: Duration,
    ) -> std::io::Result<Channel> {
        let reader = stream.try_clone()?;
        let control = stream.try_clone()?;
        Ok(Channel {
            writer: Mutex::new(stream),
            control,
            twin_control: OnceLock::new(),
            reader: Mutex::new(ReadSide {
                stream: reader,
                backlog: VecDeque::new(),
                eof: false,
            }),
            twin: Mutex::new(None),
            twin_active: AtomicBool::new(false),
            pending: Mutex::new(Pending::default()),
            closed: AtomicBool::new(false),
            max_xfer: AtomicU32::new(max_xfer),
            max_message,
            timeout,
        })
    }

    /// Set the negotiated transfer limit.
    pub fn set_max_xfer(&self, v: u32) {
        self.max_xfer.store(v, Ordering::Relaxed);
    }

    /// The negotiated transfer limit.
    pub fn max_xfer(&self) -> u32 {
        self.max_xfer.load(Ordering::Relaxed)
    }

    /// Route server→client requests over `twin` from now on.
    pub fn set_twin(&self, twin: UnixStream) {
        if let Ok(c) = twin.try_clone() {
            let _ = self.twin_control.set(c);
        }
        *lock(&self.twin) = Some(twin);
        self.twin_active.store(true, Ordering::Release);
    }

    /// Send one whole message on the main socket.
    pub fn send(&self, buf: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        let w = lock(&self.writer);
        send_message(&w, buf, fds)
    }

    /// Send an error reply to `hdr` (nothing if it asked for no reply or is a reply; a
    /// message of an undefined type is answered, its sender may be waiting).
    pub fn send_error(&self, hdr: &Header, errno: i32) {
        let is_reply =
            hdr.flags & crate::protocol::FLAGS_TYPE_MASK == crate::protocol::FLAGS_TYPE_REPLY;
        if hdr.no_reply() || is_reply {
            return;
        }
        if let Err(e) = self.send(&hdr.error_reply(errno).encode(), &[]) {
            debug!(error = %e, "failed to send an error reply");
        }
    }

    /// Bound every read on the main socket (`None`: wait forever); used until VERSION.
    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        self.control.set_read_timeout(timeout)
    }

    /// Mark the connection closed and fail every pending request.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Release);
        lock(&self.pending).clear();
        // Not through the writer/twin locks: their holder may be blocked in sendmsg, and
        // shutting the socket down is what wakes it.
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.twin_control.get() {
            let _ = t.shutdown(std::net::Shutdown::Both);
        }
    }

    /// True once the connection is closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Deliver a reply to its requester.
    pub fn route_reply(&self, m: Incoming) {
        let id = m.header.msg_id;
        match lock(&self.pending).take(id) {
            Some(tx) => {
                let _ = tx.send(m);
            }
            None => warn!(
                msg_id = m.header.msg_id,
                "reply from the client matches no pending request; dropped"
            ),
        }
    }

    /// Next command for the connection thread; `None` when the connection is over.
    pub fn next_command(&self) -> Option<Incoming> {
        loop {
            let mut rs = lock(&self.reader);
            match rs.backlog.pop_front() {
                Some(Backlogged::Command(m)) => return Some(m),
                Some(Backlogged::Invalid(h, e)) => {
                    drop(rs);
                    warn!(msg_id = h.msg_id, command = h.command, error = %e, "invalid message");
                    self.send_error(&h, e.errno());
                    continue;
                }
                None => {}
            }
            if rs.eof {
                return None;
            }
            match read_one(&rs.stream, self.max_message) {
                ReadResult::Message(m, MessageType::Command) => return Some(m),
                ReadResult::Message(m, MessageType::Reply) => {
                    drop(rs);
                    self.route_reply(m);
                }
                ReadResult::Invalid(h, e) => {
                    drop(rs);
                    warn!(msg_id = h.msg_id, command = h.command, error = %e, "invalid message");
                    self.send_error(&h, e.errno());
                }
                ReadResult::Corrupt(h, e) => {
                    rs.eof = true;
                    drop(rs);
                    warn!(msg_id = h.msg_id, error = %e, "stream framing lost; closing");
                    self.send_error(&h, e.errno());
                    return None;
                }
                ReadResult::Eof => {
                    rs.eof = true;
                    return None;
                }
            }
        }
    }

    /// Read at most one message while waiting for a reply (follower turned leader).
    fn pump(&self, rs: &mut ReadSide, wait: Duration) {
        if rs.eof {
            return;
        }
        match wait_readable(&rs.stream, wait) {
            Ok(true) => {}
            Ok(false) => return,
            Err(_) => {
                rs.eof = true;
                return;
            }
        }
        match read_one(&rs.stream, self.max_message) {
            ReadResult::Message(m, MessageType::Reply) => self.route_reply(m),
            ReadResult::Message(m, MessageType::Command) => {
                rs.backlog.push_back(Backlogged::Command(m))
            }
            ReadResult::Invalid(h, e) => rs.backlog.push_back(Backlogged::Invalid(h, e)),
            ReadResult::Corrupt(h, e) => {
                rs.eof = true;
                rs.backlog.push_back(Backlogged::Invalid(h, e));
            }
            ReadResult::Eof => rs.eof = true,
        }
        if rs.eof {
            self.closed.store(true, Ordering::Release);
            lock(&self.pending).clear();
        }
    }

    /// Send a server→client command and wait for its reply (payload returned). Errors in
    /// the reply header become [`RequestError::Errno`].
    pub fn request(&self, cmd: Command, payload: &[u8]) -> Result<Incoming, RequestError> {
        if self.is_closed() {
            return Err(RequestError::Disconnected);
        }
        let (tx, rx) = bounded(1);
        let id = lock(&self.pending).insert(tx).ok_or(RequestError::Busy)?;
        let hdr = Header::command(id, cmd, payload.len());
        let buf = encode_message(&hdr, payload);
        let twin = self.twin_active.load(Ordering::Acquire);
        let sent = if twin {
            match lock(&self.twin).as_ref() {
                Some(t) => send_message(t, &buf, &[]),
                None => Err(std::io::ErrorKind::NotConnected.into()),
            }
        } else {
            self.send(&buf, &[])
        };
        if sent.is_err() {
            lock(&self.pending).take(id);
            return Err(RequestError::Disconnected);
        }
        let deadline = Instant::now() + self.timeout;
        let reply = loop {
            match rx.try_recv() {
                Ok(m) => break m,
                Err(TryRecvError::Disconnected) => return Err(RequestError::Disconnected),
                Err(TryRecvError::Empty) => {}
            }
            let now = Instant::now();
            if now >= deadline {
                lock(&self.pending).take(id);
                return Err(RequestError::Timeout(self.timeout));
            }
            let slice = (deadline - now).min(PUMP_SLICE);
            if !twin {
                if let Ok(mut rs) = self.reader.try_lock() {
                    if !rs.eof {
                        self.pump(&mut rs, slice);
                        continue;
                    }
                }
            }
            match rx.recv_timeout(slice) {
                Ok(m) => break m,
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(RequestError::Disconnected),
            }
        };
        if reply.header.is_error() {
            return Err(RequestError::Errno(reply.header.error));
        }
        if reply.header.command != cmd as u16 {
            return Err(RequestError::BadReply(ProtocolError::invalid(
                "reply command",
                format!("{} for a {} request", reply.header.command, cmd.name()),
            )));
        }
        Ok(reply)
    }

    /// Body of the twin-socket reader thread: route replies until the socket closes.
    pub fn run_twin_reader(&self, stream: UnixStream) {
        loop {
            match read_one(&stream, self.max_message) {
                ReadResult::Message(m, MessageType::Reply) => self.route_reply(m),
                ReadResult::Message(m, MessageType::Command) => {
                    warn!(
                        command = m.header.command,
                        "command on the server-to-client twin socket; refused"
                    );
                    let _ =
                        send_message(&stream, &m.header.error_reply(libc::EINVAL).encode(), &[]);
                }
                ReadResult::Invalid(h, e) => {
                    warn!(error = %e, "invalid message on the twin socket");
                    let _ = send_message(&stream, &h.error_reply(e.errno()).encode(), &[]);
                }
                ReadResult::Corrupt(..) | ReadResult::Eof => break,
            }
        }
        lock(&self.pending).clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn pair(timeout_ms: u64) -> (Arc<Channel>, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        let chan = Channel::new(a, 1 << 20, 4096, Duration::from_millis(timeout_ms)).unwrap();
        (Arc::new(chan), b)
    }

    #[test]
    fn test_request_reply_matched_by_id_while_commands_backlogged() {
        let (chan, peer) = pair(2000);
        let c2 = chan.clone();
        let t = std::thread::spawn(move || c2.request(Command::DmaRead, &[0; 16]));
        let ReadResult::Message(req, MessageType::Command) = read_one(&peer, 1 << 20) else {
            panic!("expected the request");
        };
        // The client sends a command of its own first, then the reply.
        let cmd = Header::command(77, Command::DeviceReset, 0);
        send_message(&peer, &cmd.encode(), &[]).unwrap();
        let reply = req.header.reply(3);
        send_message(&peer, &encode_message(&reply, &[1, 2, 3]), &[]).unwrap();
        let got = t.join().unwrap().unwrap();
        assert_eq!(got.payload, vec![1, 2, 3]);
        let next = chan.next_command().expect("backlogged command");
        assert_eq!(next.header.msg_id, 77);
    }

    #[test]
    fn test_request_timeout_then_late_reply_dropped() {
        let (chan, peer) = pair(50);
        let e = chan.request(Command::DmaRead, &[0; 16]).unwrap_err();
        assert_eq!(e, RequestError::Timeout(Duration::from_millis(50)));
        let ReadResult::Message(req, _) = read_one(&peer, 1 << 20) else {
            panic!("expected the request");
        };
        send_message(&peer, &req.header.reply(0).encode(), &[]).unwrap();
        drop(peer);
        assert!(
            chan.next_command().is_none(),
            "late reply dropped, then EOF"
        );
    }

    #[test]
    fn test_request_after_timeout_uses_new_id_late_reply_not_misrouted() {
        let (chan, peer) = pair(400);
        assert!(chan.request(Command::DmaRead, &[0; 16]).is_err());
        let ReadResult::Message(first, _) = read_one(&peer, 1 << 20) else {
            panic!("expected the first request");
        };
        let c2 = chan.clone();
        let t = std::thread::spawn(move || c2.request(Command::DmaRead, &[0; 16]));
        let ReadResult::Message(second, _) = read_one(&peer, 1 << 20) else {
            panic!("expected the second request");
        };
        assert_ne!(first.header.msg_id, second.header.msg_id);
        // The late reply to the first request must not satisfy the second one.
        send_message(&peer, &encode_message(&first.header.reply(1), &[1]), &[]).unwrap();
        send_message(&peer, &encode_message(&second.header.reply(1), &[2]), &[]).unwrap();
        assert_eq!(t.join().unwrap().unwrap().payload, vec![2]);
    }

    #[test]
    fn test_request_fails_fast_on_disconnect() {
        let (chan, peer) = pair(5000);
        let c2 = chan.clone();
        let t = std::thread::spawn(move || c2.request(Command::DmaWrite, &[0; 16]));
        let _ = read_one(&peer, 1 << 20);
        let start = Instant::now();
        drop(peer);
        assert_eq!(t.join().unwrap().unwrap_err(), RequestError::Disconnected);
        assert!(start.elapsed() < Duration::from_secs(1));
        assert_eq!(
            chan.request(Command::DmaRead, &[0; 16]).unwrap_err(),
            RequestError::Disconnected
        );
    }
}
