//! The control socket: accept client connections, answer one request on each.
//!
//! What answers is a [`ControlHandler`]: the daemon's service, or (`umdev run
//! --control`) a program's own that answers the few requests that make sense for one device
//! (`screenshot`) and refuses the others; the bounds below hold for both.
//!
//! # Model
//! One accept thread polls the listener and a wake-up eventfd. Each accepted connection is
//! handled on a thread of its own (a removal may wait for a client for seconds; other
//! requests are not held up meanwhile): read one request ([`protocol::decode_header`]: at
//! most [`protocol::MAX_MESSAGE`] bytes) and the payload it announces (`migrate_load`'s
//! state), answer (a `saved` reply with its payload), close.
//!
//! # Invariants
//! - The socket is created with mode 0600 by the server module's [`SocketListener`] (bound
//!   in a private directory, then moved into place, so nobody can connect before the mode
//!   applies; a live daemon's socket is never replaced; a stale one is). Its directory is
//!   checked private by the caller. A peer whose uid is neither ours nor root's (possible
//!   only if someone loosened the mode) is refused.
//! - **A deadline per request, not a timeout per read.** The whole message must arrive
//!   within [`ControlConfig::request_timeout`] of the accept, its payload within
//!   [`protocol::transfer_time`] more; the reply (and its payload) must be taken within the
//!   same bounds from when it is ready. Every read and write is given what is left of its
//!   deadline; a peer that trickles bytes or stops reading is cut off when it runs out, and
//!   its slot is free again. Handling in between is bounded by the service's own waits
//!   (a removal's `--release-timeout` and teardown).
//! - At most [`MAX_CONNECTIONS`] connections are handled at once; the next one gets an
//!   `unavailable` error and is closed.
//! - **Payload memory is budgeted.** The payloads being received at once total at most
//!   [`PAYLOAD_BUDGET`] bytes (counted as announced, before any is read); a request that
//!   would go over gets `unavailable`. Each payload's buffer grows as its bytes arrive.
//! - A failing accept (EMFILE: the process is out of fds) does not spin: the loop backs off
//!   (10 ms doubling to 1 s, reset by the next accept) and logs at most once per 10 s, with
//!   the number of failures since the last line.
//! - [`Control::stop`] stops accepting, then waits (bounded) for the connections in hand.

use std::io::{self, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::server::listener::{AcceptBackoff, Accepted, SocketListener};
use tracing::{debug, info, warn};
use vmm_sys_util::eventfd::EventFd;

use super::protocol::{
    self, ControlError, DecodeError, ErrorKind, FrameError, Reply, Request, Response,
};
use super::service::{Payload, Service};

/// What answers the requests of a control socket ([`Control::spawn`]). Called on a thread
/// of the request's own, with the payload the request announced already read (and
/// bounded); the reply's payload ([`Reply::payload_len`] bytes) is written after it.
pub trait ControlHandler: Send + Sync + 'static {
    /// Answer `request` (and its `payload`: `migrate_load`'s state; empty for the others).
    fn handle(&self, request: Request, payload: Vec<u8>) -> Result<(Reply, Payload), ControlError>;
}

impl ControlHandler for Service {
    fn handle(&self, request: Request, payload: Vec<u8>) -> Result<(Reply, Payload), ControlError> {
        self.handle_with_payload(request, payload)
    }
}

/// Connections handled at once.
pub const MAX_CONNECTIONS: usize = 64;
/// The payload bytes received at once, over all connections: one state of the largest size.
pub const PAYLOAD_BUDGET: u64 = protocol::MAX_PAYLOAD;

/// How the control server bounds its peers.
#[derive(Clone, Copy, Debug)]
pub struct ControlConfig {
    /// How long a peer has to send its whole request message, and to take the reply.
    pub request_timeout: Duration,
}

impl Default for ControlConfig {
    fn default() -> ControlConfig {
        ControlConfig {
            request_timeout: protocol::REQUEST_TIMEOUT,
        }
    }
}

/// The running control server.
pub struct Control {
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    in_flight: Arc<AtomicUsize>,
}

/// What every request thread shares.
#[derive(Clone)]
struct Shared {
    service: Arc<dyn ControlHandler>,
    config: ControlConfig,
    /// Payload bytes announced by the requests being received ([`PAYLOAD_BUDGET`]).
    payload_in_hand: Arc<AtomicU64>,
}

/// A share of [`PAYLOAD_BUDGET`], given back on drop.
struct PayloadGrant {
    in_hand: Arc<AtomicU64>,
    len: u64,
}

impl PayloadGrant {
    fn take(in_hand: &Arc<AtomicU64>, len: u64) -> Option<PayloadGrant> {
        in_hand
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(len).filter(|&t| t <= PAYLOAD_BUDGET)
            })
            .ok()?;
        Some(PayloadGrant {
            in_hand: in_hand.clone(),
            len,
        })
    }
}

impl Drop for PayloadGrant {
    fn drop(&mut self) {
        self.in_hand.fetch_sub(self.len, Ordering::AcqRel);
    }
}

/// A connection whose reads and writes share a deadline: each is given what is left of it,
/// and fails with `TimedOut` once nothing is.
struct Timed<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
}

impl Timed<'_> {
    fn left(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the request's deadline passed",
            ));
        }
        Ok(left)
    }

    /// A timeout of the socket (`EAGAIN`) said as the deadline it is.
    fn deadline_error(e: io::Error) -> io::Error {
        match e.kind() {
            io::ErrorKind::WouldBlock => {
                io::Error::new(io::ErrorKind::TimedOut, "the request's deadline passed")
            }
            _ => e,
        }
    }
}

impl Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        (&*self.stream).read(buf).map_err(Timed::deadline_error)
    }
}

impl Write for Timed<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        (&*self.stream).write(buf).map_err(Timed::deadline_error)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Counts a connection in hand while it lives.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Control {
    /// Serve `listener` (already bound) with `service`.
    pub fn spawn(
        listener: SocketListener,
        service: Arc<dyn ControlHandler>,
        config: ControlConfig,
    ) -> std::io::Result<Control> {
        listener.listener.set_nonblocking(true)?;
        let wake = Arc::new(EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK)?);
        let in_flight = Arc::new(AtomicUsize::new(0));
        let shared = Shared {
            service,
            config,
            payload_in_hand: Arc::new(AtomicU64::new(0)),
        };
        let thread = std::thread::Builder::new()
            .name("umdev-control".into())
            .spawn({
                let (wake, in_flight) = (wake.clone(), in_flight.clone());
                move || accept_loop(listener, &wake, &shared, &in_flight)
            })?;
        Ok(Control {
            wake,
            thread: Some(thread),
            in_flight,
        })
    }

    /// Stop accepting (the socket file is removed), then wait up to `drain` for the
    /// connections in hand to be answered. Returns how many were still in hand.
    pub fn stop(mut self, drain: Duration) -> usize {
        let _ = self.wake.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let deadline = Instant::now() + drain;
        loop {
            let n = self.in_flight.load(Ordering::Acquire);
            if n == 0 || Instant::now() >= deadline {
                return n;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Wait for the listener (none: `-1`) or the wake-up, at most `timeout` (none: `-1`);
/// true when woken.
fn wait(listener: i32, wake: i32, timeout_ms: i32) -> std::io::Result<bool> {
    let mut fds = [
        libc::pollfd {
            fd: listener,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: wake,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: two valid pollfd entries, for the length given.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        return match e.kind() {
            std::io::ErrorKind::Interrupted => Ok(false),
            _ => Err(e),
        };
    }
    Ok(fds[1].revents != 0)
}

fn accept_loop(
    listener: SocketListener,
    wake: &EventFd,
    shared: &Shared,
    in_flight: &Arc<AtomicUsize>,
) {
    info!(path = %listener.path().display(), "control socket listening");
    let mut backoff = AcceptBackoff::default();
    loop {
        match wait(listener.listener.as_raw_fd(), wake.as_raw_fd(), -1) {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                warn!(error = %e, "control socket: poll failed; no more requests are taken");
                break;
            }
        }
        // EMFILE and the like leave the listener readable: the backoff keeps the loop from
        // spinning on it (the same backoff and log rate as the device servers' accept loop).
        let stream = match listener.accept_with(&mut backoff, "control socket") {
            Accepted::Stream(s) => s,
            Accepted::Retry(w) => {
                let ms = i32::try_from(w.as_millis()).unwrap_or(i32::MAX);
                if !w.is_zero() && matches!(wait(-1, wake.as_raw_fd(), ms), Ok(true)) {
                    break;
                }
                continue;
            }
        };
        if in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            warn!("control socket: {MAX_CONNECTIONS} connections in hand, one refused");
            // Not to be held up by a peer that does not read: a short deadline.
            let deadline = Instant::now() + Duration::from_millis(100);
            answer(
                &stream,
                deadline,
                Err(ControlError::new(
                    ErrorKind::Unavailable,
                    format!("the daemon is handling {MAX_CONNECTIONS} requests; try again"),
                )),
            );
            continue;
        }
        let guard = InFlight(in_flight.clone());
        let shared = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("umdev-request".into())
            .spawn(move || {
                let _guard = guard;
                serve_one(&stream, &shared);
            });
        if let Err(e) = spawned {
            // The closure (and its guard) was dropped: the count is back.
            warn!(error = %e, "control socket: cannot spawn a request thread");
        }
    }
    info!(path = %listener.path().display(), "control socket closed");
}

/// Write `result` as the response by `deadline`; a client that went away (or does not
/// read) is only logged.
fn answer(stream: &UnixStream, deadline: Instant, result: Result<protocol::Reply, ControlError>) {
    answer_with(stream, deadline, result.map(|r| (r, Payload::default())));
}

/// Answer, then send the reply's payload (a migrated instance's state) if it has one; the
/// payload gets [`protocol::transfer_time`] beyond `deadline`.
fn answer_with(
    stream: &UnixStream,
    deadline: Instant,
    result: Result<(protocol::Reply, Payload), ControlError>,
) {
    let (result, payload) = match result {
        Ok((r, p)) => (Ok(r), p),
        Err(e) => (Err(e), Payload::default()),
    };
    let bytes = protocol::encode(&Response::of(result));
    let mut out = Timed {
        stream,
        deadline: deadline + protocol::transfer_time(payload.len() as u64),
    };
    if let Err(e) = out.write_all(&bytes).and_then(|()| out.write_all(&payload)) {
        match e.kind() {
            io::ErrorKind::TimedOut => {
                warn!("control: the client did not take the response in time; disconnected")
            }
            _ => debug!(error = %e, "control: the client went away before the response"),
        }
    }
}

/// The uid of the peer, if the kernel tells.
fn peer_uid(stream: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes at most `len` bytes into `cred`, a valid ucred.
    let r = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (r == 0).then_some(cred.uid)
}

fn serve_one(stream: &UnixStream, shared: &Shared) {
    let timeout = shared.config.request_timeout;
    let reply_deadline = || Instant::now() + timeout;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    match peer_uid(stream) {
        Some(uid) if uid == me || uid == 0 => {}
        other => {
            warn!(peer_uid = ?other, "control: a peer of another user refused");
            answer(
                stream,
                reply_deadline(),
                Err(ControlError::new(
                    ErrorKind::Unavailable,
                    "the control socket serves only its owner",
                )),
            );
            return;
        }
    }
    let bad = |why: String| Err(ControlError::new(ErrorKind::BadRequest, why));
    let mut reader = BufReader::new(Timed {
        stream,
        deadline: Instant::now() + timeout,
    });
    let request = match protocol::decode_header(&mut reader) {
        Ok(r) => r,
        Err(DecodeError::Frame(FrameError::Empty)) => return,
        Err(DecodeError::Version(client)) => {
            warn!(
                client,
                daemon = protocol::PROTOCOL_VERSION,
                "control: protocol version mismatch"
            );
            let e = DecodeError::Version(client);
            return answer(
                stream,
                reply_deadline(),
                Err(
                    ControlError::new(ErrorKind::VersionMismatch, e.to_string()).hint(
                        "use the umdev binary the daemon runs, or restart the daemon with the \
                         newer one",
                    ),
                ),
            );
        }
        Err(e) => {
            let why = super::service::chain(&e);
            warn!(error = %why, "control: unreadable request");
            return answer(stream, reply_deadline(), bad(why));
        }
    };
    let len = request.payload_len();
    let _grant = if len > 0 {
        let Some(grant) = PayloadGrant::take(&shared.payload_in_hand, len) else {
            warn!(
                payload = len,
                "control: payload budget in use by other requests, one refused"
            );
            return answer(
                stream,
                reply_deadline(),
                Err(ControlError::new(
                    ErrorKind::Unavailable,
                    format!(
                        "the daemon is receiving other states (at most {PAYLOAD_BUDGET} bytes at \
                         once); try again"
                    ),
                )),
            );
        };
        reader.get_mut().deadline += protocol::transfer_time(len);
        Some(grant)
    } else {
        None
    };
    let payload = match protocol::read_payload(&mut reader, len) {
        Ok(p) => p,
        Err(e) => {
            let why = super::service::chain(&e);
            warn!(error = %why, "control: unreadable request payload");
            return answer(stream, reply_deadline(), bad(why));
        }
    };
    drop(reader);
    debug!(?request, payload = payload.len(), "control request");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        shared.service.handle(request, payload)
    }))
    .unwrap_or_else(|_| {
        Err(ControlError::new(
            ErrorKind::Internal,
            "the daemon failed handling the request (a bug; its log has the panic)",
        ))
    });
    match &result {
        // A live view asks several times a second while the guest shows nothing yet.
        Err(e) if e.kind == ErrorKind::NothingShown => {
            debug!(error = %e.message, "control request refused")
        }
        Err(e) => info!(kind = ?e.kind, error = %e.message, "control request refused"),
        Ok(_) => {}
    }
    answer_with(stream, reply_deadline(), result);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_timed_write_to_peer_not_reading_cut_off_at_deadline() {
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let t0 = Instant::now();
        let mut out = Timed {
            stream: &ours,
            deadline: t0 + Duration::from_millis(200),
        };
        let e = out.write_all(&vec![0u8; 16 << 20]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }

    #[test]
    fn test_timed_read_of_trickle_cut_off_at_deadline_not_per_read() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let feeder = std::thread::spawn(move || {
            let mut w = &theirs;
            for _ in 0..20 {
                if w.write_all(b"x").is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        let t0 = Instant::now();
        let mut input = Timed {
            stream: &ours,
            deadline: t0 + Duration::from_millis(300),
        };
        let mut got = Vec::new();
        let e = input.read_to_end(&mut got).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(
            t0.elapsed() < Duration::from_millis(700),
            "{:?}",
            t0.elapsed()
        );
        assert!(!got.is_empty() && got.len() < 20, "{got:?}");
        drop(ours);
        feeder.join().unwrap();
    }

    #[test]
    fn test_payload_grant_budget_shared_and_given_back() {
        let in_hand = Arc::new(AtomicU64::new(0));
        let a = PayloadGrant::take(&in_hand, PAYLOAD_BUDGET - 10).unwrap();
        assert!(PayloadGrant::take(&in_hand, 11).is_none());
        let b = PayloadGrant::take(&in_hand, 10).unwrap();
        assert!(PayloadGrant::take(&in_hand, 1).is_none());
        drop(a);
        drop(b);
        assert_eq!(in_hand.load(Ordering::Acquire), 0);
        assert!(PayloadGrant::take(&in_hand, u64::MAX).is_none());
    }
}
