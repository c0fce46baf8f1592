//! The listening socket: refuse to clobber a live server, remove a stale socket, set the
//! file mode before anyone can connect (bind in a private directory, chmod, move into
//! place), remove the file again when done; and how the accept loop waits out a full fd
//! table ([`AcceptBackoff`]).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use tracing::{debug, info};

use super::ServerError;

/// A bound listener that removes its socket file on drop (unless it was
/// [inherited](SocketListener::inherited)).
#[derive(Debug)]
pub struct SocketListener {
    /// The listener.
    pub listener: UnixListener,
    path: PathBuf,
    /// Whether the socket file is ours to remove on drop.
    owned: bool,
}

impl SocketListener {
    /// Bind `path` with permission bits `mode`. An existing socket that accepts
    /// connections is a live server (`SocketInUse`); one that refuses is stale and removed;
    /// anything else at the path is left alone (`NotASocket`).
    pub fn bind(path: &Path, mode: u32) -> Result<SocketListener, ServerError> {
        match fs::symlink_metadata(path) {
            Ok(meta) => {
                if !meta.file_type().is_socket() {
                    return Err(ServerError::NotASocket(path.to_path_buf()));
                }
                match UnixStream::connect(path) {
                    Ok(_) => return Err(ServerError::SocketInUse(path.to_path_buf())),
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        info!(path = %path.display(), "removing stale socket");
                        fs::remove_file(path)
                            .map_err(|e| ServerError::io("removing a stale socket", e))?;
                    }
                    Err(e) => return Err(ServerError::io("probing an existing socket", e)),
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(ServerError::io("inspecting the socket path", e)),
        }
        let listener = match bind_private(path, mode) {
            Ok(l) => l,
            Err(PrivateBind::InUse) => return Err(ServerError::SocketInUse(path.to_path_buf())),
            Err(PrivateBind::Unavailable(why)) => {
                // Plain bind + chmod: between the two the file carries the umask's mode.
                debug!(why, "binding the socket in place");
                let l = UnixListener::bind(path)
                    .map_err(|e| ServerError::io("binding the socket", e))?;
                let guard = SocketListener {
                    listener: l,
                    path: path.to_path_buf(),
                    owned: true,
                };
                fs::set_permissions(path, fs::Permissions::from_mode(mode))
                    .map_err(|e| ServerError::io("setting the socket mode", e))?;
                return Ok(guard);
            }
        };
        Ok(SocketListener {
            listener,
            path: path.to_path_buf(),
            owned: true,
        })
    }

    /// A listener someone else bound and handed over (a service manager's socket
    /// activation): served like a bound one, but its socket file, if any, belongs to whoever
    /// bound it and is left in place on drop (systemd keeps listening on it and starts the
    /// service again at the next connection). `path` is what logs call it.
    pub fn inherited(listener: UnixListener, path: PathBuf) -> SocketListener {
        SocketListener {
            listener,
            path,
            owned: false,
        }
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

enum PrivateBind {
    /// Something appeared at the path meanwhile.
    InUse,
    /// The private-directory route is not possible here (path too long, no
    /// RENAME_NOREPLACE, ...): fall back to bind + chmod.
    Unavailable(&'static str),
}

static BIND_SEQ: AtomicU32 = AtomicU32::new(0);

/// Bind so that nobody can connect before `mode` applies: bind inside a fresh 0700
/// directory next to `path`, chmod there, then move the socket into place with
/// RENAME_NOREPLACE (a file that appeared at `path` meanwhile is never replaced).
fn bind_private(path: &Path, mode: u32) -> Result<UnixListener, PrivateBind> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = parent.join(format!(
        ".umdev-bind.{}.{}",
        std::process::id(),
        BIND_SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    fs::DirBuilder::new()
        .mode(0o700)
        .create(&dir)
        .map_err(|_| PrivateBind::Unavailable("cannot create a private directory"))?;
    let tmp = dir.join("s");
    let result = (|| {
        let l = UnixListener::bind(&tmp)
            .map_err(|_| PrivateBind::Unavailable("cannot bind in the private directory"))?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))
            .map_err(|_| PrivateBind::Unavailable("cannot set the mode"))?;
        let from = CString::new(tmp.as_os_str().as_bytes())
            .map_err(|_| PrivateBind::Unavailable("NUL in the path"))?;
        let to = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| PrivateBind::Unavailable("NUL in the path"))?;
        // SAFETY: two valid NUL-terminated paths; renameat2 only reads them.
        let r = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if r != 0 {
            return Err(match io::Error::last_os_error().raw_os_error() {
                Some(libc::EEXIST) => PrivateBind::InUse,
                _ => PrivateBind::Unavailable("renameat2(RENAME_NOREPLACE) failed"),
            });
        }
        Ok(l)
    })();
    let _ = fs::remove_file(&tmp);
    let _ = fs::remove_dir(&dir);
    result
}

/// What the accept loop does after a failed `accept`.
///
/// A connection the server cannot accept for lack of resources (EMFILE, ENFILE, ENOBUFS,
/// ENOMEM) stays queued, so the listener stays readable and an immediate retry fails the
/// same way: the loop would spin on one core and log at that rate. Instead it waits before
/// the next attempt, 10 ms after the first failure, doubling up to 1 s, and logs the first
/// failure of an episode and then at most one line per 10 s (with the number of failures
/// in between). A successful accept ends the episode. Other errors (the peer gave up:
/// ECONNABORTED, EPROTO, ...) are retried at once.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    /// Failures in the current episode.
    failures: u64,
    /// Failures not logged yet.
    unlogged: u64,
    /// When a line was last logged.
    logged_at: Option<Instant>,
}

/// First wait after a resource failure.
const BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest wait between attempts.
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// At most one log line per this period while failures go on.
const LOG_EVERY: Duration = Duration::from_secs(10);

/// What to do after a failed accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AcceptRetry {
    /// Wait this long (for a stop request only) before the next attempt.
    pub wait: Duration,
    /// `Some(n)`: log now, `n` failures since the last line (this one included).
    pub log: Option<u64>,
}

impl AcceptBackoff {
    /// A failed accept at `now`.
    pub fn failed(&mut self, e: &io::Error, now: Instant) -> AcceptRetry {
        let resource = matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        );
        if !resource {
            return AcceptRetry {
                wait: Duration::ZERO,
                log: Some(1),
            };
        }
        self.failures += 1;
        self.unlogged += 1;
        let wait = BACKOFF_MIN
            .saturating_mul(1u32 << (self.failures - 1).min(16))
            .min(BACKOFF_MAX);
        let log = match self.logged_at {
            Some(t) if now.duration_since(t) < LOG_EVERY => None,
            _ => {
                self.logged_at = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        };
        AcceptRetry { wait, log }
    }

    /// A successful accept: the episode is over.
    pub fn succeeded(&mut self) {
        *self = AcceptBackoff::default();
    }
}

/// What [`SocketListener::accept_with`] got.
#[derive(Debug)]
pub enum Accepted {
    /// A new connection.
    Stream(UnixStream),
    /// None this time: try again after waiting this long (zero: at once; the wait is the
    /// loop's, so that a stop request can end it).
    Retry(Duration),
}

impl SocketListener {
    /// Accept one connection from the (non-blocking) listener, with `backoff` applied to a
    /// failure and the failure logged at its rate, naming `what` listens (e.g. "control
    /// socket").
    pub fn accept_with(&self, backoff: &mut AcceptBackoff, what: &str) -> Accepted {
        match self.listener.accept() {
            Ok((s, _)) => {
                backoff.succeeded();
                Accepted::Stream(s)
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Accepted::Retry(Duration::ZERO),
            Err(e) => {
                let retry = backoff.failed(&e, Instant::now());
                if let Some(failures) = retry.log {
                    tracing::warn!(
                        error = %e,
                        failures,
                        retry_in_ms = retry.wait.as_millis() as u64,
                        "{what}: accept failed (logged at most every 10 s)"
                    );
                }
                Accepted::Retry(retry.wait)
            }
        }
    }
}

impl Drop for SocketListener {
    fn drop(&mut self) {
        if self.owned {
            let _ = fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_bind_live_socket_refused_stale_removed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let live = SocketListener::bind(&p, 0o600).unwrap();
        let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(
            SocketListener::bind(&p, 0o600),
            Err(ServerError::SocketInUse(_))
        ));
        drop(live);
        // A crashed server leaves its socket file behind with nobody listening.
        drop(UnixListener::bind(&p).unwrap());
        assert!(p.exists());
        let again = SocketListener::bind(&p, 0o600).unwrap();
        drop(again);
        assert!(!p.exists());
    }

    #[test]
    fn test_inherited_listener_leaves_its_socket_file_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("s.sock");
        let inherited = SocketListener::inherited(UnixListener::bind(&p).unwrap(), p.clone());
        assert_eq!(inherited.path(), p);
        drop(inherited);
        assert!(
            p.exists(),
            "the socket file of whoever bound it was removed"
        );
    }

    #[test]
    fn test_accept_backoff_emfile_waits_grow_logs_rate_limited_success_resets() {
        let mut b = AcceptBackoff::default();
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        let t0 = Instant::now();
        let first = b.failed(&emfile, t0);
        assert_eq!(
            first,
            AcceptRetry {
                wait: BACKOFF_MIN,
                log: Some(1)
            }
        );
        let mut waits = vec![first.wait];
        // 1000 failures within 5 s: no further line, waits double up to the cap.
        for i in 1..1000u64 {
            let r = b.failed(&emfile, t0 + Duration::from_millis(5 * i));
            assert_eq!(r.log, None, "failure {i} logged");
            waits.push(r.wait);
        }
        assert!(waits.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(waits[1], 2 * BACKOFF_MIN);
        assert_eq!(*waits.last().unwrap(), BACKOFF_MAX);
        // After the period, one line counting what was suppressed.
        let r = b.failed(&emfile, t0 + LOG_EVERY + Duration::from_secs(1));
        assert_eq!(r.log, Some(1000));
        b.succeeded();
        assert_eq!(b.failed(&emfile, t0 + LOG_EVERY * 2).wait, BACKOFF_MIN);
        // An aborted connection is retried at once.
        let aborted = io::Error::from_raw_os_error(libc::ECONNABORTED);
        assert_eq!(b.failed(&aborted, t0).wait, Duration::ZERO);
    }

    #[test]
    fn test_bind_regular_file_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("file");
        fs::write(&p, b"x").unwrap();
        assert!(matches!(
            SocketListener::bind(&p, 0o600),
            Err(ServerError::NotASocket(_))
        ));
        assert!(p.exists());
    }
}
