//! The daemon under a service manager: the control socket by socket activation, and
//! readiness notifications.
//!
//! - **Socket activation** (`sd_listen_fds(3)`): when `LISTEN_PID` is this process and
//!   `LISTEN_FDS` is 1, fd 3 is the control socket, bound and listening already
//!   (`umdev.socket`'s `ListenStream=`). It must be a listening `AF_UNIX` stream socket, or
//!   the daemon refuses to start; more than one fd is refused too (the unit passes one).
//!   The variables are cleared, so nothing the daemon starts later mistakes the fd for its
//!   own. The socket file is the manager's: the daemon never removes it.
//! - **Notifications** (`sd_notify(3)`) on `$NOTIFY_SOCKET`, if set: `READY=1` once the
//!   autostart instances serve and the control socket answers, `RELOADING=1` / `READY=1`
//!   around a SIGHUP reload, `STOPPING=1` when a stop begins, each with a `STATUS=` line.
//!   A notification that cannot be sent is logged, never fatal. (An abstract
//!   `NOTIFY_SOCKET`, `@name`, is not supported by the crate used: systemd's own is a path.)
//!
//! Both through the `sd-notify` crate: no dependencies but libc, maintained, and it does
//! exactly these two protocols.

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;

use crate::server::listener::SocketListener;
use sd_notify::NotifyState;
use tracing::warn;

/// Why the inherited control socket cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ActivationError {
    /// `LISTEN_PID`/`LISTEN_FDS` could not be read.
    #[error("socket activation: LISTEN_FDS/LISTEN_PID are malformed")]
    Env(#[source] std::io::Error),
    /// Not exactly one fd.
    #[error("socket activation: {0} sockets passed (LISTEN_FDS); the control socket is one")]
    Count(usize),
    /// The fd is not what the control socket must be.
    #[error("socket activation: fd {fd} is not a listening AF_UNIX stream socket ({why})")]
    NotAListener {
        /// The fd.
        fd: RawFd,
        /// What it is instead.
        why: String,
    },
}

/// An `int` socket option of `fd`.
fn sockopt(fd: RawFd, name: libc::c_int) -> std::io::Result<libc::c_int> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `v`, a live c_int; a bad fd is an
    // error return, not undefined behaviour.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            name,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    match r {
        0 => Ok(v),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Check that `fd` is a listening AF_UNIX stream socket.
fn check_listener(fd: RawFd) -> Result<(), ActivationError> {
    let not = |why: String| ActivationError::NotAListener { fd, why };
    let domain = sockopt(fd, libc::SO_DOMAIN).map_err(|e| not(e.to_string()))?;
    if domain != libc::AF_UNIX {
        return Err(not(format!("address family {domain}")));
    }
    let ty = sockopt(fd, libc::SO_TYPE).map_err(|e| not(e.to_string()))?;
    if ty != libc::SOCK_STREAM {
        return Err(not(format!(
            "socket type {ty}: ListenStream= makes a stream"
        )));
    }
    let listening = sockopt(fd, libc::SO_ACCEPTCONN).map_err(|e| not(e.to_string()))?;
    if listening == 0 {
        return Err(not("not listening".into()));
    }
    Ok(())
}

/// The control socket passed by the service manager, if any.
///
/// # Safety
/// Call it before any thread is spawned: it clears `LISTEN_FDS`/`LISTEN_PID` with
/// `std::env::remove_var`, which must not race another thread's reading of the environment.
pub(crate) unsafe fn inherited_control() -> Result<Option<SocketListener>, ActivationError> {
    // SAFETY: the caller guarantees no other thread runs (this function's contract).
    let fds: Vec<RawFd> = unsafe { sd_notify::listen_fds_and_unset_env() }
        .map_err(ActivationError::Env)?
        .collect();
    let fd = match fds.as_slice() {
        [] => return Ok(None),
        [fd] => *fd,
        more => return Err(ActivationError::Count(more.len())),
    };
    check_listener(fd)?;
    // SAFETY: `fd` was passed to this process for it to own (LISTEN_PID is ours), and the
    // variables naming it are cleared, so nothing else here takes it; it was checked to be
    // a listening AF_UNIX stream socket, which is what a UnixListener wraps.
    let listener = unsafe { UnixListener::from_raw_fd(fd) };
    let path = listener
        .local_addr()
        .ok()
        .and_then(|a| a.as_pathname().map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(format!("(inherited fd {fd})")));
    Ok(Some(SocketListener::inherited(listener, path)))
}

/// Tell the service manager `states` (nothing without `NOTIFY_SOCKET`); a failure is logged.
pub(crate) fn notify(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(states) {
        warn!(error = %e, "cannot notify the service manager (NOTIFY_SOCKET)");
    }
}

/// `RELOADING=1` with the `MONOTONIC_USEC=` systemd 253 and later want beside it.
pub(crate) fn notify_reloading() {
    match NotifyState::monotonic_usec_now() {
        Ok(now) => notify(&[NotifyState::Reloading, now]),
        Err(_) => notify(&[NotifyState::Reloading]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::{UnixDatagram, UnixStream};

    #[test]
    fn test_check_listener_accepts_listener_refuses_stream_datagram_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let l = UnixListener::bind(dir.path().join("l.sock")).unwrap();
        check_listener(l.as_raw_fd()).unwrap();
        let (a, _b) = UnixStream::pair().unwrap();
        let e = check_listener(a.as_raw_fd()).unwrap_err();
        assert!(e.to_string().contains("not listening"), "{e}");
        let d = UnixDatagram::unbound().unwrap();
        let e = check_listener(d.as_raw_fd()).unwrap_err();
        assert!(e.to_string().contains("socket type"), "{e}");
        let f = std::fs::File::open("/dev/null").unwrap();
        let e = check_listener(f.as_raw_fd()).unwrap_err();
        assert!(e.to_string().contains("fd "), "{e}");
        let t = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let e = check_listener(t.as_raw_fd()).unwrap_err();
        assert!(e.to_string().contains("address family"), "{e}");
    }
}
