//! The daemon's directories (the defaults of `umdev daemon`, `umdev::daemon::paths`) and
//! whether a daemon already serves the state directory.

use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use super::{CheckArgs, Finding, Status};
use umdev::daemon::paths;

/// The state directory, the socket directory and the control socket `umdev daemon` would
/// use with the same options.
pub fn resolve(args: &CheckArgs) -> (PathBuf, PathBuf, PathBuf) {
    let state = args
        .state_dir
        .clone()
        .unwrap_or_else(paths::default_state_dir);
    let sockets = args
        .socket_dir
        .clone()
        .unwrap_or_else(paths::default_socket_dir);
    let control = args
        .control
        .clone()
        .unwrap_or_else(|| sockets.join(paths::CONTROL_SOCKET));
    // The daemon takes relative directories from its working directory: so does the check.
    let abs = |p: PathBuf| std::path::absolute(&p).unwrap_or(p);
    (abs(state), abs(sockets), abs(control))
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// May we create entries in the directory `dir`?
fn writable(dir: &Path) -> bool {
    let Ok(c) = CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a NUL-terminated path; access reads it and nothing else.
    unsafe { libc::access(c.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

/// The directory `name` at `dir`: what `paths::ensure_private_dir` will say of it, without
/// creating it.
pub fn private_dir(name: &'static str, dir: &Path) -> Finding {
    let shown = dir.display().to_string();
    let base = |status, detail: String| {
        Finding::new(name, true, status, detail).value("path", shown.clone())
    };
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // The daemon creates it (mode 0700, parents too) if it may.
            let parent = dir.ancestors().skip(1).find(|a| a.exists());
            return match parent {
                Some(p) if writable(p) => base(
                    Status::Ok,
                    format!(
                        "{shown} does not exist yet; the daemon creates it (mode 700) in {}",
                        p.display()
                    ),
                )
                .value("exists", false),
                Some(p) => base(
                    Status::Missing,
                    format!(
                        "{shown} does not exist and {} is not writable by uid {}",
                        p.display(),
                        euid()
                    ),
                )
                .fix(format!(
                    "create it for this user (`install -d -m 700 {shown}`), or pick another \
                     with --{name}"
                ))
                .value("exists", false),
                None => base(Status::Missing, format!("{shown}: no existing parent"))
                    .fix(format!("pick an absolute path with --{name}"))
                    .value("exists", false),
            };
        }
        Err(e) => {
            return base(Status::Missing, format!("{shown}: {e}"))
                .fix(format!("pick another with --{name}"))
        }
    };
    let mode = meta.permissions().mode() & 0o7777;
    let f = |status, detail: String| {
        base(status, detail)
            .value("exists", true)
            .value("mode", format!("{mode:o}"))
            .value("owner_uid", meta.uid())
    };
    if !meta.is_dir() {
        return f(
            Status::Missing,
            format!("{shown} is not a directory (or is a symbolic link)"),
        )
        .fix(format!("remove it, or pick another with --{name}"));
    }
    if meta.uid() != euid() {
        return f(
            Status::Missing,
            format!(
                "{shown} belongs to uid {}, not to this user (uid {}): the daemon refuses it",
                meta.uid(),
                euid()
            ),
        )
        .fix(format!("`chown {} {shown}`, or run as its owner", euid()));
    }
    if mode & 0o022 != 0 {
        return f(
            Status::Missing,
            format!(
                "{shown} has mode {mode:o}: group or others may replace its files, so the \
                 daemon refuses it"
            ),
        )
        .fix(format!("`chmod 700 {shown}`"));
    }
    if !writable(dir) {
        return f(
            Status::Missing,
            format!("{shown} (mode {mode:o}) is not writable by this user"),
        )
        .fix(format!("`chmod u+rwx {shown}`"));
    }
    let detail = if mode & 0o055 != 0 {
        format!("{shown} is ours, mode {mode:o} (others may list it; 700 keeps it private)")
    } else {
        format!("{shown} is ours and private (mode {mode:o})")
    };
    f(Status::Ok, detail)
}

/// Is `<state>/daemon.lock` held by a daemon? Takes and drops a shared non-blocking lock
/// (a daemon starting in that instant would be refused once; retrying starts it).
fn lock_held(state: &Path) -> Result<Option<bool>, std::io::Error> {
    let path = state.join("daemon.lock");
    let file = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    // SAFETY: flock on a descriptor we own; it changes no memory. Closing `file` releases it.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
    if rc == 0 {
        return Ok(Some(false));
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(Some(true))
    } else {
        Err(e)
    }
}

/// A daemon on the state directory (its lock), and whether the control socket answers.
pub fn other_daemon(state: &Path, control: &Path) -> Finding {
    let held = lock_held(state);
    let live = UnixStream::connect(control).is_ok();
    let control_shown = control.display().to_string();
    let state_shown = state.display().to_string();
    let held_value = held.as_ref().ok().map(|h| h.unwrap_or(false));
    let f = |status, detail: String| {
        Finding::new("daemon", false, status, detail)
            .value("state_dir", state_shown.clone())
            .value("control", control_shown.clone())
            .value("lock_held", held_value)
            .value("control_answers", live)
    };
    match (held, live) {
        (Err(e), _) => f(
            Status::Warn,
            format!("cannot test {state_shown}/daemon.lock: {e}"),
        )
        .fix("make it readable by this user, or run the check as the daemon's user"),
        (Ok(Some(true)), true) => f(
            Status::Ok,
            format!(
                "a daemon serves {state_shown} and answers on {control_shown} (use it; a second \
                 daemon on this state directory is refused)"
            ),
        ),
        (Ok(Some(true)), false) => f(
            Status::Warn,
            format!(
                "a daemon holds {state_shown}/daemon.lock but nothing answers on {control_shown}"
            ),
        )
        .fix("it uses another --control (pass it here), or it is stuck: look at its log"),
        (_, true) => f(
            Status::Warn,
            format!(
                "something answers on {control_shown} but no daemon holds {state_shown}: a \
                 daemon started here could not bind its control socket"
            ),
        )
        .fix("it is a daemon of another --state-dir: give this one another --control"),
        (_, false) => f(
            Status::Ok,
            format!("no daemon serves {state_shown}; {control_shown} is free"),
        ),
    }
}
