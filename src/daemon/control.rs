//! The control socket: accept client connections, answer one request on each.
//!
//! # Model
//! One accept thread polls the listener and a wake-up eventfd. Each accepted connection is
//! handled on a thread of its own (a removal may wait for a client for seconds; other
//! requests are not held up meanwhile): read one request (at most
//! [`protocol::MAX_MESSAGE`] bytes, waited for at most [`protocol::REQUEST_TIMEOUT`]) and the
//! payload it announces (`migrate_load`'s state), check the version, answer (a `saved`
//! reply with its payload), close.
//!
//! # Invariants
//! - The socket is created with mode 0600 by the server module's [`SocketListener`] (bound
//!   in a private directory, then moved into place, so nobody can connect before the mode
//!   applies; a live daemon's socket is never replaced; a stale one is). Its directory is
//!   checked private by the caller. A peer whose uid is neither ours nor root's (possible
//!   only if someone loosened the mode) is refused.
//! - At most [`MAX_CONNECTIONS`] connections are handled at once; the next one gets an
//!   `unavailable` error and is closed.
//! - [`Control::stop`] stops accepting, then waits (bounded) for the connections in hand.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};
use umdev::server::listener::SocketListener;
use vmm_sys_util::eventfd::EventFd;

use super::protocol::{
    self, ControlError, ErrorKind, FrameError, Request, RequestEnvelope, Response, PROTOCOL_VERSION,
};
use super::service::Service;

/// Connections handled at once.
pub const MAX_CONNECTIONS: usize = 64;

/// The running control server.
pub struct Control {
    wake: Arc<EventFd>,
    thread: Option<JoinHandle<()>>,
    in_flight: Arc<AtomicUsize>,
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
    pub fn spawn(listener: SocketListener, service: Arc<Service>) -> std::io::Result<Control> {
        listener.listener.set_nonblocking(true)?;
        let wake = Arc::new(EventFd::new(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK)?);
        let in_flight = Arc::new(AtomicUsize::new(0));
        let thread = std::thread::Builder::new()
            .name("umdev-control".into())
            .spawn({
                let (wake, in_flight) = (wake.clone(), in_flight.clone());
                move || accept_loop(listener, &wake, &service, &in_flight)
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

/// Wait for the listener or the wake-up; true when woken.
fn wait(listener: i32, wake: i32) -> std::io::Result<bool> {
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
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
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
    service: &Arc<Service>,
    in_flight: &Arc<AtomicUsize>,
) {
    info!(path = %listener.path().display(), "control socket listening");
    loop {
        match wait(listener.listener.as_raw_fd(), wake.as_raw_fd()) {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) => {
                warn!(error = %e, "control socket: poll failed; no more requests are taken");
                break;
            }
        }
        let stream = match listener.listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                warn!(error = %e, "control socket: accept failed");
                // EMFILE and the like: do not spin on a listener that stays readable.
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if in_flight.fetch_add(1, Ordering::AcqRel) >= MAX_CONNECTIONS {
            in_flight.fetch_sub(1, Ordering::AcqRel);
            warn!("control socket: {MAX_CONNECTIONS} connections in hand, one refused");
            answer(
                &stream,
                Err(ControlError::new(
                    ErrorKind::Unavailable,
                    format!("the daemon is handling {MAX_CONNECTIONS} requests; try again"),
                )),
            );
            continue;
        }
        let guard = InFlight(in_flight.clone());
        let service = service.clone();
        let spawned = std::thread::Builder::new()
            .name("umdev-request".into())
            .spawn(move || {
                let _guard = guard;
                serve_one(&stream, &service);
            });
        if let Err(e) = spawned {
            // The closure (and its guard) was dropped: the count is back.
            warn!(error = %e, "control socket: cannot spawn a request thread");
        }
    }
    info!(path = %listener.path().display(), "control socket closed");
}

/// Write `result` as the response; a client that went away is only logged.
fn answer(stream: &UnixStream, result: Result<protocol::Reply, ControlError>) {
    answer_with(stream, result.map(|r| (r, Vec::new())));
}

/// Answer, then send the reply's payload (a migrated instance's state) if it has one.
fn answer_with(mut stream: &UnixStream, result: Result<(protocol::Reply, Vec<u8>), ControlError>) {
    let (result, payload) = match result {
        Ok((r, p)) => (Ok(r), p),
        Err(e) => (Err(e), Vec::new()),
    };
    let bytes = protocol::encode(&Response::of(result));
    if let Err(e) = stream
        .write_all(&bytes)
        .and_then(|()| stream.write_all(&payload))
    {
        debug!(error = %e, "control: the client went away before the response");
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

fn serve_one(stream: &UnixStream, service: &Service) {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    match peer_uid(stream) {
        Some(uid) if uid == me || uid == 0 => {}
        other => {
            warn!(peer_uid = ?other, "control: a peer of another user refused");
            answer(
                stream,
                Err(ControlError::new(
                    ErrorKind::Unavailable,
                    "the control socket serves only its owner",
                )),
            );
            return;
        }
    }
    if let Err(e) = stream.set_read_timeout(Some(protocol::REQUEST_TIMEOUT)) {
        warn!(error = %e, "control: cannot set the read timeout");
        return;
    }
    let bad = |why: String| Err(ControlError::new(ErrorKind::BadRequest, why));
    let mut reader = std::io::BufReader::new(stream);
    let message = match protocol::read_message(&mut reader) {
        Ok(m) => m,
        Err(FrameError::Empty) => return,
        Err(e) => {
            let why = super::service::chain(&e);
            warn!(error = %why, "control: unreadable request");
            return answer(stream, bad(why));
        }
    };
    // The envelope first: a client of another version is told so, whatever its request.
    let envelope: RequestEnvelope<serde_json::Value> = match serde_json::from_slice(&message) {
        Ok(v) => v,
        Err(e) => {
            warn!(error = %e, "control: malformed request");
            return answer(stream, bad(format!("malformed request: {e}")));
        }
    };
    if envelope.version != PROTOCOL_VERSION {
        warn!(
            client = envelope.version,
            daemon = PROTOCOL_VERSION,
            "control: protocol version mismatch"
        );
        return answer(
            stream,
            Err(ControlError::new(
                ErrorKind::VersionMismatch,
                format!(
                    "this daemon speaks control protocol version {PROTOCOL_VERSION}, the client \
                     version {}",
                    envelope.version
                ),
            )
            .hint(
                "use the umdev binary the daemon runs, or restart the daemon with the newer one",
            )),
        );
    }
    let request: Request = match serde_json::from_value(envelope.request) {
        Ok(r) => r,
        Err(e) => {
            warn!(error = %e, "control: malformed request");
            return answer(stream, bad(format!("malformed request: {e}")));
        }
    };
    let payload = match protocol::read_payload(&mut reader, request.payload_len()) {
        Ok(p) => p,
        Err(e) => {
            let why = super::service::chain(&e);
            warn!(error = %why, "control: unreadable request payload");
            return answer(stream, bad(why));
        }
    };
    debug!(?request, payload = payload.len(), "control request");
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        service.handle_with_payload(request, payload)
    }))
    .unwrap_or_else(|_| {
        Err(ControlError::new(
            ErrorKind::Internal,
            "the daemon failed handling the request (a bug; its log has the panic)",
        ))
    });
    if let Err(e) = &result {
        info!(kind = ?e.kind, error = %e.message, "control request refused");
    }
    answer_with(stream, result);
}
