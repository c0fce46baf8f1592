//! One client connection's socket(s), shared by the connection thread and every thread
//! that issues server→client requests.
//!
//! Reading follows a leader/follower rule so that no reply can be stuck behind a busy
//! thread: whoever holds the read side reads; replies go straight to the waiting
//! requester (slab of pending requests keyed by message id, one crossbeam channel each);
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
use slab::Slab;
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

/// The read side of the main socket.
#[derive(Debug)]
pub struct ReadSide {
    stream: UnixStream,
    backlog: VecDeque<Incoming>,
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
    pending: Mutex<Slab<Sender<Incoming>>>,
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
            pending: Mutex::new(Slab::new()),
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
        let id = m.header.msg_id as usize;
        match lock(&self.pending).try_remove(id) {
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
            if let Some(m) = rs.backlog.pop_front() {
                return Some(m);
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
            ReadResult::Message(m, MessageType::Command) => rs.backlog.push_back(m),
            ReadResult::Invalid(h, e) => {
                warn!(msg_id = h.msg_id, command = h.command, error = %e, "invalid message");
                self.send_error(&h, e.errno());
            }
            ReadResult::Corrupt(h, e) => {
                rs.eof = true;
                self.send_error(&h, e.errno());
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
        let id = {
            let mut p = lock(&self.pending);
            if p.len() >= u16::MAX as usize {
                return Err(RequestError::Busy);
            }
            p.insert(tx)
        };
        let hdr = Header::command(id as u16, cmd, payload.len());
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
            lock(&self.pending).try_remove(id);
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
                lock(&self.pending).try_remove(id);
                return Err(RequestError::Timeout(self.timeout));
            }
            let slice = (deadline - now).min(PUMP_SLICE);
            if !twin {
                if let Ok(mut rs) = self.reader.try_lock() {
                    self.pump(&mut rs, slice);
                    continue;
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
