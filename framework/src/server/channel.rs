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
//!
//! # When the server may wait for the client, and cancelling
//!
//! QEMU (10.x) answers server→client requests in a bottom half of its main loop, and the
//! thread that waits for one of our replies holds that loop (the BQL): while QEMU waits for
//! *any* reply, it answers no DMA_READ/DMA_WRITE. A reply of ours that waits for such a
//! request therefore waits for the remote timeout, and QEMU drops a reply later than its
//! own `x-msg-timeout` (5 s). Rule: **no reply waits for a server→client request** (see
//! `protocol-docs/server-dma.md`). The tools:
//!
//! - [`Channel::hold_requests`] fails every pending request with
//!   [`RequestError::Cancelled`] and refuses new ones until the returned [`RequestHold`] is
//!   dropped (DEVICE_RESET around the device's reset; migration's STOP can keep one from
//!   STOP until the device runs again). The refusal is checked under the pending-table
//!   lock, and a request is registered and sent as one step under the lock of the socket
//!   it goes out on, so when `hold_requests` returns, every request registered before it
//!   is on the wire and failed, and none can follow: nothing reaches the client after the
//!   reply that ends the hold.
//! - [`Channel::cancel_range`] fails the pending requests whose target overlaps a range
//!   (DMA_UNMAP of fd-less mappings). It does not refuse later requests: the DMA layer
//!   stops new accesses to the range itself and calls it again until the range's in-flight
//!   count drains, which catches a request registered just after a pass.
//! - A request issued from the connection thread itself (a device doing fd-less DMA in a
//!   region handler) fails at once with [`RequestError::WouldDeadlock`] if the client
//!   waits for a reply from that thread: the message being handled expects one, or a
//!   command expecting one is backlogged (it may arrive while the request waits, which
//!   then fails). Only the single-socket mode: a twin-socket client has a reader for
//!   requests of its own.
//!
//! A cancelled request's id is remembered (a bounded list) and not reused while
//! remembered, so the client's late reply to it is dropped quietly; a reply matching no
//! id at all is dropped with a warning.
//!
//! # Bounds on what a client makes the channel hold
//!
//! - **Fds at receive time.** A message carrying more fds than its command can use (one for
//!   DMA_MAP, `max_msg_fds` for SET_IRQS, none for anything else and for replies) has all
//!   of them closed as soon as it is read, and becomes an invalid message (EINVAL
//!   error reply); a message with more than [`super::socket_io::FD_SLOTS`] fds is cut by
//!   the kernel and refused the same way. So a backlogged message holds at most the fds its
//!   command will consume.
//! - **The backlog** is bounded in messages, bytes (header + payload) and fds
//!   ([`BacklogLimits`]). While any bound is reached, a requester does not read the socket
//!   (back-pressure): the client's further messages wait in the kernel's socket buffer, and
//!   so does the reply the requester waits for, which then times out like an unanswered
//!   one. A bound is checked before a read, so the backlog exceeds it by at most one
//!   message (≤ the largest message, ≤ `max_msg_fds` fds).
//! - **The read-ahead.** Every reader of the main socket reads through one per-connection
//!   buffer (`read_ahead`): one `recvmsg` brings as many whole messages as have arrived.
//!   It is fixed and small (64 KiB, at most two sets of
//!   ≤ FD_SLOTS fds, see there), so it is not counted in the backlog's bounds; while the
//!   backlog is full nothing is taken out of it either, and its messages wait there as
//!   they would in the kernel's socket buffer. Fds are given to the message that holds the
//!   last byte of the `recvmsg` that returned them (why that is their message: `read_ahead`).
//! - **Sending** (replies, error replies, requests) uses the socket's send timeout
//!   (`SO_SNDTIMEO`, set by the server from `ServerConfig::send_timeout`): a client that
//!   does not read what we send makes the send fail after that time, and any failed send
//!   closes the connection (a partly sent message has lost the framing anyway); the
//!   connection thread then runs the usual teardown (maps removed, pins released).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, RecvTimeoutError, Sender, TryRecvError};
use tracing::{debug, warn};

use super::poll::{PollMode, Poller};
use super::read_ahead::ReadAhead;
use super::socket_io::{
    discard, header_of, recv_header, recv_payload, send_message, wait_readable, RawHeader, FD_SLOTS,
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
    /// Fds that came with it beyond what its command can use: closed at receive, counted
    /// here so the command is refused for its fd count as if they were still attached.
    pub fds_closed: usize,
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

/// Read one message from `stream`, validating the header against `max_message` (fds: at
/// most what the command can use with `max_msg_fds` = [`super::socket_io::FD_SLOTS`]).
///
/// It reads exactly one message (a `recvmsg` of the header, then the payload) and nothing
/// of the next, for callers that read a socket once; a connection reads through its
/// read-ahead instead (`read_ahead`: one `recvmsg` for as many messages as arrived).
pub fn read_one(stream: &UnixStream, max_message: u32) -> ReadResult {
    read_one_with(stream, max_message, FD_SLOTS)
}

/// Most fds a message with header `h` can use: one for DMA_MAP, `max_msg_fds` for
/// SET_IRQS, none for any other command or for a reply.
pub(super) fn usable_fds(h: &Header, max_msg_fds: usize) -> usize {
    let is_reply = h.flags & crate::protocol::FLAGS_TYPE_MASK == crate::protocol::FLAGS_TYPE_REPLY;
    if is_reply {
        return 0;
    }
    match Command::from_u16(h.command) {
        Ok(Command::DmaMap) => 1,
        Ok(Command::DeviceSetIrqs) => max_msg_fds,
        _ => 0,
    }
}

/// [`read_one`] with the client's `max_msg_fds`: the fds of a message that carries more
/// than its command can use are closed at once ([`Incoming::fds_closed`] counts them, so
/// the command is refused for its fd count when it is handled).
pub fn read_one_with(stream: &UnixStream, max_message: u32, max_msg_fds: usize) -> ReadResult {
    let raw = match recv_header(stream) {
        Ok(Some(raw)) => raw,
        Ok(None) => return ReadResult::Eof,
        Err(e) => {
            debug!(error = %e, "socket read failed");
            return ReadResult::Eof;
        }
    };
    read_rest(stream, raw, max_message, max_msg_fds)
}

/// Largest payload buffer kept for reuse between messages ([`Channel::next_command_reusing`]):
/// the register accesses of the hot path are far smaller, and an idle connection should
/// not hold a large buffer.
pub const SPARE_PAYLOAD_MAX: usize = 4096;

/// The rest of the message whose header is `raw`: validation, the payload, the fds.
fn read_rest(
    stream: &UnixStream,
    mut raw: RawHeader,
    max_message: u32,
    max_msg_fds: usize,
) -> ReadResult {
    let header = header_of(&raw);
    let mut fds_closed = 0;
    if raw.fds.len() > usable_fds(&header, max_msg_fds) {
        // Closed now, not when the (possibly backlogged) message is handled.
        fds_closed = raw.fds.len();
        raw.fds.clear();
    }
    let (ty, len) = match header.validate(max_message) {
        Ok(v) => v,
        Err(e @ ProtocolError::MessageTooSmall { .. }) => return ReadResult::Corrupt(header, e),
        Err(e) => {
            if discard(stream, header.msg_size as usize - HEADER_SIZE).is_err() {
                return ReadResult::Eof;
            }
            return ReadResult::Invalid(header, e);
        }
    };
    let mut payload = vec![0; len];
    if recv_payload(stream, &mut payload).is_err() {
        return ReadResult::Eof;
    }
    if raw.fds_truncated {
        return ReadResult::Invalid(
            header,
            ProtocolError::WrongFdCount {
                what: "message",
                expected: "at most max_msg_fds",
                got: fds_closed.max(raw.fds.len()) + 1,
            },
        );
    }
    ReadResult::Message(
        Incoming {
            header,
            payload,
            fds: raw.fds,
            fds_closed,
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

impl Backlogged {
    /// Bytes it holds (header + payload) and fds.
    fn weight(&self) -> (usize, usize) {
        match self {
            Backlogged::Command(m) => (HEADER_SIZE + m.payload.len(), m.fds.len()),
            Backlogged::Invalid(..) => (HEADER_SIZE, 0),
        }
    }

    /// True if its sender waits for a reply from the connection thread (an error reply,
    /// for an invalid message that is not itself a reply).
    fn awaits_reply(&self) -> bool {
        let h = match self {
            Backlogged::Command(m) => &m.header,
            Backlogged::Invalid(h, _) => h,
        };
        let is_reply =
            h.flags & crate::protocol::FLAGS_TYPE_MASK == crate::protocol::FLAGS_TYPE_REPLY;
        !h.no_reply() && !is_reply
    }
}

/// The read side of the main socket.
#[derive(Debug)]
pub struct ReadSide {
    stream: UnixStream,
    /// Messages read from `stream` and not yet handed out (`read_ahead`): every reader of
    /// the main socket (the connection thread, a pumping requester) reads through it.
    ahead: ReadAhead,
    backlog: VecDeque<Backlogged>,
    eof: bool,
    /// How the connection thread waits for its next command (`server::poll`).
    poller: Poller,
}

/// Bounds of the backlog of commands read by requesters (module doc). Reading stops while
/// any one is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BacklogLimits {
    /// Most messages.
    pub messages: usize,
    /// Most bytes (header + payload of each message).
    pub bytes: usize,
    /// Most fds held by backlogged messages.
    pub fds: usize,
}

impl Default for BacklogLimits {
    /// 256 messages, 8 MiB, 64 fds.
    fn default() -> Self {
        BacklogLimits {
            messages: 256,
            bytes: 8 << 20,
            fds: 64,
        }
    }
}

/// What the backlog holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BacklogUsage {
    /// Messages.
    pub messages: usize,
    /// Bytes.
    pub bytes: usize,
    /// Fds.
    pub fds: usize,
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
    /// The server cancelled the request before its reply arrived, or refused it (the
    /// reason says why: a DEVICE_RESET in progress, a DMA_UNMAP of the range it targets).
    #[error("cancelled: {0}")]
    Cancelled(&'static str),
    /// Issued from the connection thread while the client waits for a reply from that
    /// thread: a client such as QEMU answers no request until it has that reply.
    #[error(
        "the client waits for a reply from the connection thread and cannot answer this \
         request before it; do DMA to fd-less memory on a worker thread, not in a region \
         handler (or give the client fd-backed memory)"
    )]
    WouldDeadlock,
}

/// Most server→client requests in flight at once.
const MAX_IN_FLIGHT: usize = 4096;

/// Most ids of cancelled requests remembered (their late replies are dropped quietly).
const MAX_CANCELLED: usize = 4096;

/// What a requester's channel delivers.
#[derive(Debug)]
enum Delivery {
    Reply(Incoming),
    Cancelled(&'static str),
}

/// One waiting requester.
#[derive(Debug)]
struct Waiter {
    tx: Sender<Delivery>,
    /// Guest addresses the request targets, `[first, last]` (inclusive), if any.
    target: Option<(u64, u64)>,
}

/// Pending server→client requests by message id.
#[derive(Debug, Default)]
struct Pending {
    waiting: HashMap<u16, Waiter>,
    next_id: u16,
    /// Ids of cancelled requests whose late reply may still come, oldest first; not
    /// reused while listed.
    cancelled: VecDeque<u16>,
    cancelled_set: HashSet<u16>,
    /// Live [`RequestHold`]s: while non-zero, new requests are refused.
    holds: u32,
    /// Why requests are held (the latest hold's reason).
    hold_reason: &'static str,
}

impl Pending {
    /// Register a requester; its message id is the next value of a wrapping counter that
    /// is neither pending nor a remembered cancelled id.
    fn insert(
        &mut self,
        tx: Sender<Delivery>,
        target: Option<(u64, u64)>,
    ) -> Result<u16, RequestError> {
        if self.holds > 0 {
            return Err(RequestError::Cancelled(self.hold_reason));
        }
        if self.waiting.len() >= MAX_IN_FLIGHT {
            return Err(RequestError::Busy);
        }
        // At most MAX_IN_FLIGHT + MAX_CANCELLED ids are taken, far fewer than 2^16: the
        // loop ends.
        loop {
            let id = self.next_id;
            self.next_id = self.next_id.wrapping_add(1);
            if self.cancelled_set.contains(&id) {
                continue;
            }
            if let std::collections::hash_map::Entry::Vacant(v) = self.waiting.entry(id) {
                v.insert(Waiter { tx, target });
                return Ok(id);
            }
        }
    }

    fn take(&mut self, id: u16) -> Option<Waiter> {
        self.waiting.remove(&id)
    }

    /// Forget a pending request whose reply may still come; its late reply is dropped
    /// quietly.
    fn abandon(&mut self, id: u16) {
        if self.waiting.remove(&id).is_none() {
            return;
        }
        if self.cancelled.len() >= MAX_CANCELLED {
            if let Some(old) = self.cancelled.pop_front() {
                self.cancelled_set.remove(&old);
            }
        }
        self.cancelled.push_back(id);
        self.cancelled_set.insert(id);
    }

    /// Fail every pending request that `pick` selects with `Cancelled(why)`.
    fn cancel_where(&mut self, why: &'static str, pick: impl Fn(&Waiter) -> bool) -> usize {
        let ids: Vec<u16> = self
            .waiting
            .iter()
            .filter(|(_, w)| pick(w))
            .map(|(&id, _)| id)
            .collect();
        for &id in &ids {
            if let Some(w) = self.waiting.get(&id) {
                let _ = w.tx.send(Delivery::Cancelled(why));
            }
            self.abandon(id);
        }
        ids.len()
    }

    /// True (and forgotten) if `id` is a cancelled request's.
    fn was_cancelled(&mut self, id: u16) -> bool {
        if !self.cancelled_set.remove(&id) {
            return false;
        }
        self.cancelled.retain(|&c| c != id);
        true
    }

    fn clear(&mut self) {
        self.waiting.clear();
    }
}

/// While it lives, server→client requests on its channel are refused with
/// [`RequestError::Cancelled`] (those pending when it was taken were failed); see
/// [`Channel::hold_requests`]. It owns a reference to the channel, so a state that spans
/// several messages (migration's STOP) can keep it.
#[derive(Debug)]
#[must_use = "requests are allowed again as soon as the hold is dropped"]
pub struct RequestHold {
    chan: Arc<Channel>,
}

impl Drop for RequestHold {
    fn drop(&mut self) {
        let mut p = lock(&self.chan.pending);
        p.holds = p.holds.saturating_sub(1);
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
    /// The thread that handles the client's commands ([`Channel::bind_connection_thread`]).
    conn_thread: OnceLock<ThreadId>,
    /// The client waits for the reply to the message the connection thread is handling.
    client_waits: AtomicBool,
    /// Backlogged messages whose sender waits for a reply (changed under the reader lock).
    backlog_awaiting: AtomicUsize,
    /// Bounds of the backlog.
    limits: BacklogLimits,
    /// The client's max_msg_fds (fds beyond what a command can use are closed at receive).
    max_msg_fds: usize,
    /// What the backlog holds (changed under the reader lock, read by [`Channel::backlog`]).
    backlog_messages: AtomicUsize,
    backlog_bytes: AtomicUsize,
    backlog_fds: AtomicUsize,
    /// The backlog reached a bound and reading stopped (logged once per episode).
    throttled: AtomicBool,
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
                ahead: ReadAhead::new(),
                backlog: VecDeque::new(),
                eof: false,
                poller: Poller::new(PollMode::Off),
            }),
            twin: Mutex::new(None),
            twin_active: AtomicBool::new(false),
            pending: Mutex::new(Pending::default()),
            closed: AtomicBool::new(false),
            max_xfer: AtomicU32::new(max_xfer),
            max_message,
            timeout,
            conn_thread: OnceLock::new(),
            client_waits: AtomicBool::new(false),
            backlog_awaiting: AtomicUsize::new(0),
            limits: BacklogLimits::default(),
            max_msg_fds: FD_SLOTS,
            backlog_messages: AtomicUsize::new(0),
            backlog_bytes: AtomicUsize::new(0),
            backlog_fds: AtomicUsize::new(0),
            throttled: AtomicBool::new(false),
        })
    }

    /// Bound the backlog by `limits` and accept at most `max_msg_fds` fds with a SET_IRQS
    /// (one with a DMA_MAP, none with anything else).
    pub fn with_limits(mut self, limits: BacklogLimits, max_msg_fds: u32) -> Channel {
        self.limits = limits;
        self.max_msg_fds = max_msg_fds as usize;
        self
    }

    /// Wait for commands as `mode` says (`server::poll`).
    pub fn set_poll(&self, mode: PollMode) {
        lock(&self.reader).poller = Poller::new(mode);
    }

    /// What the backlog holds now.
    pub fn backlog(&self) -> BacklogUsage {
        BacklogUsage {
            messages: self.backlog_messages.load(Ordering::Relaxed),
            bytes: self.backlog_bytes.load(Ordering::Relaxed),
            fds: self.backlog_fds.load(Ordering::Relaxed),
        }
    }

    /// True if a bound of the backlog is reached (no more reading until it drains).
    fn backlog_full(&self) -> bool {
        let u = self.backlog();
        u.messages >= self.limits.messages
            || u.bytes >= self.limits.bytes
            || u.fds >= self.limits.fds
    }

    /// Account for `b` entering (`add`) or leaving the backlog; the caller holds the
    /// reader lock.
    fn account(&self, b: &Backlogged, add: bool) {
        let (bytes, fds) = b.weight();
        let op = |a: &AtomicUsize, v: usize| {
            if add {
                a.fetch_add(v, Ordering::AcqRel);
            } else {
                a.fetch_sub(v, Ordering::AcqRel);
            }
        };
        op(&self.backlog_messages, 1);
        op(&self.backlog_bytes, bytes);
        op(&self.backlog_fds, fds);
        if b.awaits_reply() {
            op(&self.backlog_awaiting, 1);
        }
    }

    /// Record the calling thread as the connection thread (the one that handles commands
    /// and sends their replies); once per channel.
    pub fn bind_connection_thread(&self) {
        let _ = self.conn_thread.set(std::thread::current().id());
    }

    /// Say whether the client waits for the reply to the message the connection thread is
    /// about to handle (`false` once it is handled).
    pub fn set_client_waits(&self, waits: bool) {
        self.client_waits.store(waits, Ordering::Release);
    }

    fn on_connection_thread(&self) -> bool {
        self.conn_thread.get() == Some(&std::thread::current().id())
    }

    /// True if a request from the connection thread would wait for a client that waits for
    /// that thread: the message it handles expects a reply, or a backlogged one does.
    fn client_waits_for_us(&self) -> bool {
        self.client_waits.load(Ordering::Acquire)
            || self.backlog_awaiting.load(Ordering::Acquire) > 0
    }

    /// Fail every pending server→client request with [`RequestError::Cancelled`]`(why)` and
    /// refuse new ones until the returned hold is dropped (holds nest). When this returns,
    /// every request registered before it has been sent and failed, and no other can be
    /// sent while the hold lives: a reply sent under the hold is the last thing the client
    /// receives about them. Use it around anything that makes a reply wait for the device
    /// to stop (DEVICE_RESET; migration's STOP), so that a device thread blocked on the
    /// client cannot delay the reply. It takes each socket lock briefly (the barrier): a
    /// sender blocked on a client that stops reading delays it, as it would delay the reply
    /// anyway.
    pub fn hold_requests(self: &Arc<Self>, why: &'static str) -> RequestHold {
        let n = {
            let mut p = lock(&self.pending);
            p.holds += 1;
            p.hold_reason = why;
            p.cancel_where(why, |_| true)
        };
        // Barrier: a request is registered and sent under its socket's lock, so once both
        // locks were free, any request registered before the hold is fully sent.
        drop(lock(&self.writer));
        drop(lock(&self.twin));
        if n > 0 {
            debug!(
                cancelled = n,
                reason = why,
                "server-to-client requests cancelled"
            );
        }
        RequestHold { chan: self.clone() }
    }

    /// Fail the pending requests whose target overlaps `[iova, iova + size)` with
    /// [`RequestError::Cancelled`]`(why)`; returns how many. Later requests are not refused
    /// (the caller stops them: see the module doc).
    pub fn cancel_range(&self, iova: u64, size: u64, why: &'static str) -> usize {
        let Some(last) = size.checked_sub(1).map(|s| iova.saturating_add(s)) else {
            return 0;
        };
        let n = lock(&self.pending).cancel_where(why, |w| {
            w.target.is_some_and(|(f, l)| f <= last && iova <= l)
        });
        if n > 0 {
            debug!(
                cancelled = n,
                iova = format_args!("{iova:#x}"),
                size = format_args!("{size:#x}"),
                reason = why,
                "server-to-client requests cancelled"
            );
        }
        n
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

    /// Send one whole message on the main socket. A failure (the client hung up, or did not
    /// read within the socket's send timeout) closes the connection: part of the message
    /// may be on the wire, so the framing is lost.
    pub fn send(&self, buf: &[u8], fds: &[RawFd]) -> std::io::Result<()> {
        let w = lock(&self.writer);
        let r = send_message(&w, buf, fds);
        drop(w);
        if let Err(e) = &r {
            self.send_failed(e);
        }
        r
    }

    /// A send failed: close the connection, saying why unless the client simply left.
    fn send_failed(&self, e: &std::io::Error) {
        if self.is_closed() {
            return;
        }
        if matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ) {
            warn!(
                "the client does not read what the server sends (send timeout); disconnecting it"
            );
        } else {
            debug!(error = %e, "send failed; closing the connection");
        }
        self.close();
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
        let mut p = lock(&self.pending);
        match p.take(id) {
            Some(w) => {
                drop(p);
                let _ = w.tx.send(Delivery::Reply(m));
            }
            None if p.was_cancelled(id) => {
                drop(p);
                debug!(msg_id = id, "late reply to a cancelled request; dropped");
            }
            None => {
                drop(p);
                warn!(
                    msg_id = id,
                    "reply from the client matches no pending request; dropped"
                )
            }
        }
    }

    /// Next command for the connection thread; `None` when the connection is over.
    pub fn next_command(&self) -> Option<Incoming> {
        self.next_command_reusing(&mut Vec::new())
    }

    /// [`Channel::next_command`], reading the payload into `spare`'s buffer when the
    /// message comes from the socket (the connection thread hands back the previous
    /// message's payload, so the hot path does not allocate).
    pub fn next_command_reusing(&self, spare: &mut Vec<u8>) -> Option<Incoming> {
        loop {
            let mut rs = lock(&self.reader);
            let next = rs.backlog.pop_front();
            if let Some(b) = &next {
                self.account(b, false);
                if !self.backlog_full() {
                    self.throttled.store(false, Ordering::Relaxed);
                }
            }
            match next {
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
            match self.wait_and_read(&mut rs, spare) {
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

    /// Read the next message on the connection thread: spin for the poller's budget with
    /// non-blocking reads (yielding the CPU between two), then block (`server::poll`). A
    /// message already in the read-ahead is returned at once, without a syscall.
    fn wait_and_read(&self, rs: &mut ReadSide, spare: &mut Vec<u8>) -> ReadResult {
        let (max, fds) = (self.max_message, self.max_msg_fds);
        let budget = rs.poller.budget();
        if (budget.is_zero() && !rs.poller.adapts()) || rs.ahead.has_message() {
            // `off`, or nothing to wait for: no clock reads either.
            return rs
                .ahead
                .next(&rs.stream, max, fds, spare, false)
                .unwrap_or(ReadResult::Eof);
        }
        let start = Instant::now();
        if !budget.is_zero() {
            let deadline = start + budget;
            loop {
                if let Some(r) = rs.ahead.next(&rs.stream, max, fds, spare, true) {
                    rs.poller.observe(true, start.elapsed());
                    return r;
                }
                if Instant::now() >= deadline {
                    break;
                }
                std::thread::yield_now();
            }
        }
        let r = rs
            .ahead
            .next(&rs.stream, max, fds, spare, false)
            .unwrap_or(ReadResult::Eof);
        rs.poller.observe(false, start.elapsed());
        r
    }

    /// Read at most one message while waiting for a reply (follower turned leader); false
    /// (nothing read) while the backlog is full: the caller then waits without reading.
    fn pump(&self, rs: &mut ReadSide, wait: Duration) -> bool {
        if rs.eof {
            return false;
        }
        if self.backlog_full() {
            if !self.throttled.swap(true, Ordering::Relaxed) {
                let u = self.backlog();
                warn!(
                    messages = u.messages,
                    bytes = u.bytes,
                    fds = u.fds,
                    "command backlog full while waiting for the client's reply; not reading \
                     the socket until the connection thread catches up"
                );
            }
            return false;
        }
        if !rs.ahead.has_message() {
            match wait_readable(&rs.stream, wait) {
                Ok(true) => {}
                Ok(false) => return true,
                Err(_) => {
                    rs.eof = true;
                    return true;
                }
            }
        }
        // Non-blocking: a message that has arrived only in part stays in the read-ahead
        // (this requester goes back to waiting for its reply), except one larger than the
        // read-ahead, which is read whole once begun.
        let read = rs.ahead.next(
            &rs.stream,
            self.max_message,
            self.max_msg_fds,
            &mut Vec::new(),
            true,
        );
        let Some(read) = read else {
            return true;
        };
        let backlogged = match read {
            ReadResult::Message(m, MessageType::Reply) => {
                self.route_reply(m);
                None
            }
            ReadResult::Message(m, MessageType::Command) => Some(Backlogged::Command(m)),
            ReadResult::Invalid(h, e) => Some(Backlogged::Invalid(h, e)),
            ReadResult::Corrupt(h, e) => {
                rs.eof = true;
                Some(Backlogged::Invalid(h, e))
            }
            ReadResult::Eof => {
                rs.eof = true;
                None
            }
        };
        if let Some(b) = backlogged {
            self.account(&b, true);
            rs.backlog.push_back(b);
        }
        if rs.eof {
            self.closed.store(true, Ordering::Release);
            lock(&self.pending).clear();
        }
        true
    }

    /// Send a server→client command and wait for its reply (payload returned). Errors in
    /// the reply header become [`RequestError::Errno`].
    pub fn request(&self, cmd: Command, payload: &[u8]) -> Result<Incoming, RequestError> {
        self.request_impl(cmd, payload, None)
    }

    /// As [`Channel::request`], for a request that targets the guest addresses
    /// `[iova, iova + len)` (a DMA_READ/DMA_WRITE piece): [`Channel::cancel_range`] of an
    /// overlapping range fails it.
    pub fn request_at(
        &self,
        cmd: Command,
        payload: &[u8],
        iova: u64,
        len: u64,
    ) -> Result<Incoming, RequestError> {
        let target = len.checked_sub(1).map(|l| (iova, iova.saturating_add(l)));
        self.request_impl(cmd, payload, target)
    }

    /// Register the request and send it, as one step under the lock of the socket it goes
    /// out on (what [`Channel::hold_requests`] relies on); returns its message id.
    fn register_and_send(
        &self,
        twin: bool,
        tx: Sender<Delivery>,
        target: Option<(u64, u64)>,
        cmd: Command,
        buf: &mut [u8],
    ) -> Result<u16, RequestError> {
        let send = |stream: Option<&UnixStream>, buf: &mut [u8]| {
            let id = lock(&self.pending).insert(tx, target)?;
            let hdr = Header::command(id, cmd, buf.len() - HEADER_SIZE);
            buf[..HEADER_SIZE].copy_from_slice(&hdr.encode());
            let sent = match stream {
                Some(s) => send_message(s, buf, &[]),
                None => Err(std::io::ErrorKind::NotConnected.into()),
            };
            if let Err(e) = sent {
                lock(&self.pending).take(id);
                self.send_failed(&e);
                return Err(RequestError::Disconnected);
            }
            Ok(id)
        };
        if twin {
            let t = lock(&self.twin);
            send(t.as_ref(), buf)
        } else {
            let w = lock(&self.writer);
            send(Some(&w), buf)
        }
    }

    fn request_impl(
        &self,
        cmd: Command,
        payload: &[u8],
        target: Option<(u64, u64)>,
    ) -> Result<Incoming, RequestError> {
        if self.is_closed() {
            return Err(RequestError::Disconnected);
        }
        let twin = self.twin_active.load(Ordering::Acquire);
        // A request from the connection thread while the client waits for that thread
        // (module doc): fail before sending anything.
        let on_conn = !twin && self.on_connection_thread();
        if on_conn && self.client_waits_for_us() {
            return Err(RequestError::WouldDeadlock);
        }
        let (tx, rx) = bounded(1);
        // The id is written into the header once registered.
        let mut buf = encode_message(&Header::command(0, cmd, payload.len()), payload);
        let id = self.register_and_send(twin, tx, target, cmd, &mut buf)?;
        let deadline = Instant::now() + self.timeout;
        let reply = loop {
            match rx.try_recv() {
                Ok(Delivery::Reply(m)) => break m,
                Ok(Delivery::Cancelled(why)) => return Err(RequestError::Cancelled(why)),
                Err(TryRecvError::Disconnected) => return Err(RequestError::Disconnected),
                Err(TryRecvError::Empty) => {}
            }
            if on_conn && self.client_waits_for_us() {
                // A command that expects a reply arrived meanwhile: the client will not
                // answer before it has that reply, which only this thread can send.
                lock(&self.pending).abandon(id);
                return Err(RequestError::WouldDeadlock);
            }
            let now = Instant::now();
            if now >= deadline {
                lock(&self.pending).take(id);
                return Err(RequestError::Timeout(self.timeout));
            }
            let slice = (deadline - now).min(PUMP_SLICE);
            if !twin {
                if let Ok(mut rs) = self.reader.try_lock() {
                    if !rs.eof && self.pump(&mut rs, slice) {
                        continue;
                    }
                }
            }
            match rx.recv_timeout(slice) {
                Ok(Delivery::Reply(m)) => break m,
                Ok(Delivery::Cancelled(why)) => return Err(RequestError::Cancelled(why)),
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
        let mut ahead = ReadAhead::new();
        loop {
            let read = ahead.next(&stream, self.max_message, FD_SLOTS, &mut Vec::new(), false);
            match read.unwrap_or(ReadResult::Eof) {
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
    use std::os::fd::AsRawFd;
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
    fn test_request_reply_behind_command_in_one_write_routed_from_read_ahead() {
        // The command and the reply arrive in one read: the requester backlogs the command
        // and finds the reply in the read-ahead, without waiting for the socket again.
        let (chan, peer) = pair(2000);
        let c2 = chan.clone();
        let t = std::thread::spawn(move || c2.request(Command::DmaRead, &[0; 16]));
        let ReadResult::Message(req, MessageType::Command) = read_one(&peer, 1 << 20) else {
            panic!("expected the request");
        };
        let mut both = Header::command(77, Command::DeviceReset, 0)
            .encode()
            .to_vec();
        both.extend(encode_message(&req.header.reply(2), &[8, 9]));
        send_message(&peer, &both, &[]).unwrap();
        let started = Instant::now();
        let got = t.join().unwrap().unwrap();
        assert_eq!(got.payload, vec![8, 9]);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "no timeout on a buffered reply"
        );
        assert_eq!(chan.next_command().expect("backlogged").header.msg_id, 77);
    }

    #[test]
    fn test_next_command_burst_in_one_write_each_polling_mode() {
        for mode in [
            PollMode::Off,
            PollMode::Auto,
            PollMode::Fixed(Duration::from_micros(50)),
        ] {
            let (chan, peer) = pair(2000);
            chan.set_poll(mode);
            let mut burst = Vec::new();
            for id in 0..8u16 {
                burst.extend(encode_message(
                    &Header::command(id, Command::RegionWrite, 4),
                    &id.to_le_bytes().repeat(2),
                ));
            }
            send_message(&peer, &burst, &[]).unwrap();
            let mut spare = Vec::new();
            for id in 0..8u16 {
                let m = chan.next_command_reusing(&mut spare).expect("command");
                assert_eq!(m.header.msg_id, id, "{mode}");
                spare = m.payload;
            }
            drop(peer);
            assert!(chan.next_command().is_none());
        }
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

    /// The next request the peer receives, if one comes within `wait`.
    fn next_request(peer: &UnixStream, wait: Duration) -> Option<Incoming> {
        if !wait_readable(peer, wait).unwrap() {
            return None;
        }
        match read_one(peer, 1 << 20) {
            ReadResult::Message(m, MessageType::Command) => Some(m),
            other => panic!("expected a request, got {other:?}"),
        }
    }

    #[test]
    fn test_hold_requests_cancels_pending_refuses_new_until_dropped() {
        let (chan, peer) = pair(5000);
        let c2 = chan.clone();
        let t = std::thread::spawn(move || c2.request_at(Command::DmaRead, &[0; 16], 0x1000, 8));
        let req = next_request(&peer, Duration::from_secs(2)).expect("the request");
        let start = Instant::now();
        let hold = chan.hold_requests("test reset");
        assert_eq!(
            t.join().unwrap().unwrap_err(),
            RequestError::Cancelled("test reset")
        );
        assert!(start.elapsed() < Duration::from_secs(1), "failed fast");
        // Refused while held, and nothing goes out.
        assert_eq!(
            chan.request(Command::DmaRead, &[0; 16]).unwrap_err(),
            RequestError::Cancelled("test reset")
        );
        assert!(next_request(&peer, Duration::from_millis(50)).is_none());
        drop(hold);
        let c2 = chan.clone();
        let t = std::thread::spawn(move || c2.request(Command::DmaRead, &[0; 16]));
        let second = next_request(&peer, Duration::from_secs(2)).expect("a request again");
        assert_ne!(second.header.msg_id, req.header.msg_id);
        // The late reply to the cancelled request is dropped, not taken for this one.
        send_message(&peer, &encode_message(&req.header.reply(1), &[1]), &[]).unwrap();
        send_message(&peer, &encode_message(&second.header.reply(1), &[2]), &[]).unwrap();
        assert_eq!(t.join().unwrap().unwrap().payload, vec![2]);
    }

    #[test]
    fn test_hold_requests_racing_requesters_none_sent_after_hold_returns() {
        // Requesters race with the hold: whatever they registered before it must be on
        // the wire when it returns; nothing may follow.
        for _ in 0..50 {
            let (chan, peer) = pair(5000);
            let threads: Vec<_> = (0..4)
                .map(|_| {
                    let c = chan.clone();
                    std::thread::spawn(
                        move || {
                            while c.request(Command::DmaRead, &[0; 16]).is_ok() {}
                        },
                    )
                })
                .collect();
            std::thread::sleep(Duration::from_micros(200));
            let hold = chan.hold_requests("test reset");
            let marker = Header::command(0xfff0, Command::DeviceReset, 0);
            chan.send(&marker.encode(), &[]).unwrap();
            for t in threads {
                t.join().unwrap();
            }
            loop {
                match read_one(&peer, 1 << 20) {
                    ReadResult::Message(m, _) if m.header.msg_id == 0xfff0 => break,
                    ReadResult::Message(m, _) => {
                        assert_eq!(m.header.command, Command::DmaRead as u16)
                    }
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert!(
                next_request(&peer, Duration::from_millis(2)).is_none(),
                "a request was sent after the hold"
            );
            drop(hold);
        }
    }

    #[test]
    fn test_cancel_range_fails_only_overlapping_requests() {
        let (chan, peer) = pair(5000);
        let spawn = |iova: u64| {
            let c = chan.clone();
            std::thread::spawn(move || c.request_at(Command::DmaRead, &[0; 16], iova, 0x100))
        };
        let inside = spawn(0x2f00);
        let a = next_request(&peer, Duration::from_secs(2)).unwrap();
        let outside = spawn(0x3000);
        let b = next_request(&peer, Duration::from_secs(2)).unwrap();
        let (inside_req, outside_req) = if a.header.msg_id < b.header.msg_id {
            (a, b)
        } else {
            (b, a)
        };
        assert_eq!(chan.cancel_range(0x2000, 0x1000, "test unmap"), 1);
        assert_eq!(
            inside.join().unwrap().unwrap_err(),
            RequestError::Cancelled("test unmap")
        );
        assert_eq!(chan.cancel_range(0x2000, 0x1000, "test unmap"), 0);
        send_message(&peer, &inside_req.header.reply(0).encode(), &[]).unwrap();
        send_message(
            &peer,
            &encode_message(&outside_req.header.reply(1), &[9]),
            &[],
        )
        .unwrap();
        assert_eq!(outside.join().unwrap().unwrap().payload, vec![9]);
    }

    #[test]
    fn test_request_from_connection_thread_client_waiting_fails_fast_sends_nothing() {
        let (chan, peer) = pair(5000);
        chan.bind_connection_thread();
        chan.set_client_waits(true);
        let start = Instant::now();
        assert_eq!(
            chan.request(Command::DmaRead, &[0; 16]).unwrap_err(),
            RequestError::WouldDeadlock
        );
        assert!(start.elapsed() < Duration::from_millis(500));
        assert!(next_request(&peer, Duration::from_millis(50)).is_none());
        // Another thread's request is not concerned.
        let c2 = chan.clone();
        let t = std::thread::spawn(move || c2.request(Command::DmaRead, &[0; 16]));
        let req = next_request(&peer, Duration::from_secs(2)).unwrap();
        send_message(&peer, &req.header.reply(0).encode(), &[]).unwrap();
        assert!(t.join().unwrap().is_ok());
    }

    #[test]
    fn test_request_from_connection_thread_posted_command_waits_awaited_command_fails() {
        let (chan, peer) = pair(5000);
        chan.bind_connection_thread();
        let client = std::thread::spawn(move || {
            // A posted command does not stop the request: the reply comes after it.
            let req = next_request(&peer, Duration::from_secs(2)).unwrap();
            let mut posted = Header::command(40, Command::RegionWrite, 0);
            posted.flags |= crate::protocol::FLAGS_NO_REPLY;
            send_message(&peer, &posted.encode(), &[]).unwrap();
            send_message(&peer, &req.header.reply(0).encode(), &[]).unwrap();
            // A command that expects a reply does: the client waits for its reply.
            let _req = next_request(&peer, Duration::from_secs(2)).unwrap();
            let awaited = Header::command(41, Command::RegionRead, 0);
            send_message(&peer, &awaited.encode(), &[]).unwrap();
            peer
        });
        assert!(chan.request(Command::DmaRead, &[0; 16]).is_ok());
        let start = Instant::now();
        assert_eq!(
            chan.request(Command::DmaRead, &[0; 16]).unwrap_err(),
            RequestError::WouldDeadlock
        );
        assert!(start.elapsed() < Duration::from_secs(1));
        let _peer = client.join().unwrap();
        assert_eq!(chan.next_command().unwrap().header.msg_id, 40);
        assert_eq!(chan.next_command().unwrap().header.msg_id, 41);
        // Handled: a request is allowed again.
        assert!(!chan.client_waits_for_us());
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

    fn limited(timeout_ms: u64, limits: BacklogLimits) -> (Arc<Channel>, UnixStream) {
        let (a, b) = UnixStream::pair().unwrap();
        let chan = Channel::new(a, 1 << 20, 4096, Duration::from_millis(timeout_ms))
            .unwrap()
            .with_limits(limits, 16);
        (Arc::new(chan), b)
    }

    /// A posted (no reply) command with `payload` and `fds`.
    fn posted(id: u16, cmd: Command, payload: &[u8], fds: &[RawFd], peer: &UnixStream) {
        let mut h = Header::command(id, cmd, payload.len());
        h.flags |= crate::protocol::FLAGS_NO_REPLY;
        send_message(peer, &encode_message(&h, payload), fds).unwrap();
    }

    /// Start a request that nobody answers; the peer gets it before this returns.
    fn unanswered(chan: &Arc<Channel>, peer: &UnixStream) -> std::thread::JoinHandle<()> {
        let c2 = chan.clone();
        let t = std::thread::spawn(move || {
            let e = c2.request(Command::DmaRead, &[0; 16]).unwrap_err();
            assert!(matches!(e, RequestError::Timeout(_)), "{e:?}");
        });
        next_request(peer, Duration::from_secs(2)).expect("the request");
        t
    }

    #[test]
    fn test_backlog_flood_while_request_waits_stops_reading_at_message_bound() {
        let limits = BacklogLimits {
            messages: 8,
            ..BacklogLimits::default()
        };
        let (chan, peer) = limited(400, limits);
        let t = unanswered(&chan, &peer);
        for i in 0..50 {
            posted(i, Command::RegionWrite, &[0; 32], &[], &peer);
        }
        t.join().unwrap();
        assert_eq!(chan.backlog().messages, 8, "{:?}", chan.backlog());
        // Nothing was lost: the rest waited in the socket, in order.
        drop(peer);
        let ids: Vec<u16> = std::iter::from_fn(|| chan.next_command())
            .map(|m| m.header.msg_id)
            .collect();
        assert_eq!(ids, (0..50).collect::<Vec<_>>());
        assert_eq!(chan.backlog(), BacklogUsage::default());
    }

    #[test]
    fn test_backlog_flood_while_request_waits_bounded_in_bytes() {
        let limits = BacklogLimits {
            bytes: 4096,
            ..BacklogLimits::default()
        };
        let (chan, peer) = limited(400, limits);
        let t = unanswered(&chan, &peer);
        for i in 0..40 {
            posted(i, Command::RegionWrite, &[0; 1000], &[], &peer);
        }
        t.join().unwrap();
        let u = chan.backlog();
        assert!(u.bytes >= 4096 && u.bytes < 4096 + 1016, "{u:?}");
        assert_eq!(u.messages, 5);
    }

    #[test]
    fn test_backlog_flood_with_fds_stops_reading_at_fd_bound() {
        let limits = BacklogLimits {
            fds: 8,
            ..BacklogLimits::default()
        };
        let (chan, peer) = limited(400, limits);
        let t = unanswered(&chan, &peer);
        let f = std::fs::File::open("/dev/null").unwrap();
        let fds = [f.as_raw_fd(); 4];
        for i in 0..100 {
            posted(i, Command::DeviceSetIrqs, &[0; 20], &fds, &peer);
        }
        t.join().unwrap();
        let u = chan.backlog();
        assert_eq!((u.messages, u.fds), (2, 8), "{u:?}");
    }

    #[test]
    fn test_backlog_fds_beyond_command_use_closed_at_receive_still_counted() {
        let (chan, peer) = limited(400, BacklogLimits::default());
        let t = unanswered(&chan, &peer);
        let (r, w) = std::io::pipe().unwrap();
        // A command that takes no fd, and a DMA_MAP with two: all closed at once.
        let mut h = Header::command(5, Command::DeviceReset, 0);
        send_message(&peer, &h.encode(), &[w.as_raw_fd(), w.as_raw_fd()]).unwrap();
        h = Header::command(6, Command::DmaMap, 0);
        send_message(&peer, &h.encode(), &[w.as_raw_fd(), w.as_raw_fd()]).unwrap();
        drop(w);
        t.join().unwrap();
        assert_eq!(chan.backlog().messages, 2);
        assert_eq!(chan.backlog().fds, 0);
        // Every copy of the write end is closed: the pipe reads EOF while both are queued.
        let mut buf = [0u8; 1];
        assert_eq!(std::io::Read::read(&mut &r, &mut buf).unwrap(), 0);
        // Both are handled in order, refused for the fds they carried (the connection's
        // decode counts `fds_closed`).
        drop(peer);
        for id in [5, 6] {
            let m = chan.next_command().expect("the backlogged command");
            assert_eq!((m.header.msg_id, m.fds.len(), m.fds_closed), (id, 0, 2));
        }
    }

    #[test]
    fn test_send_to_client_not_reading_times_out_closes_connection() {
        let (a, peer) = UnixStream::pair().unwrap();
        a.set_write_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let chan = Channel::new(a, 1 << 20, 4096, Duration::from_secs(5)).unwrap();
        let big = encode_message(&Header::command(1, Command::RegionRead, 65536), &[0; 65536]);
        let start = Instant::now();
        let mut sent = 0;
        while chan.send(&big, &[]).is_ok() {
            sent += 1;
            assert!(sent < 10_000, "the socket never filled");
        }
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(chan.is_closed());
        // A requester fails at once too.
        assert_eq!(
            chan.request(Command::DmaRead, &[0; 16]).unwrap_err(),
            RequestError::Disconnected
        );
        drop(peer);
    }
}
