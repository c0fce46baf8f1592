//! Where `umdev daemon` keeps its files by default, where the client commands look for it,
//! and the check that a directory holding sockets is private. A daemon of another program
//! gives [`DaemonConfig::new`](super::DaemonConfig::new) directories of its own.
//!
//! | what | root | other users |
//! |---|---|---|
//! | state (definitions; `umdev daemon`'s ccw images) | `/var/lib/umdev` | `$XDG_STATE_HOME/umdev`, else `~/.local/state/umdev` |
//! | sockets (instances, control) | `/run/umdev` | `$XDG_RUNTIME_DIR/umdev`, else `/tmp/umdev-<uid>` |
//! | control socket | `<sockets>/control.sock` | the same |

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The control socket's file name in the socket directory.
pub const CONTROL_SOCKET: &str = "control.sock";
/// The environment variable the client commands read the control socket's path from.
pub const CONTROL_ENV: &str = "UMDEV_CONTROL";

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn env_dir(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
}

/// The default state directory.
pub fn default_state_dir() -> PathBuf {
    if euid() == 0 {
        return PathBuf::from("/var/lib/umdev");
    }
    env_dir("XDG_STATE_HOME")
        .or_else(|| env_dir("HOME").map(|h| h.join(".local/state")))
        .map(|d| d.join("umdev"))
        .unwrap_or_else(|| PathBuf::from(format!("/tmp/umdev-state-{}", euid())))
}

/// The default socket directory.
pub fn default_socket_dir() -> PathBuf {
    if euid() == 0 {
        return PathBuf::from("/run/umdev");
    }
    env_dir("XDG_RUNTIME_DIR")
        .map(|d| d.join("umdev"))
        .unwrap_or_else(|| PathBuf::from(format!("/tmp/umdev-{}", euid())))
}

/// The default control socket.
pub fn default_control() -> PathBuf {
    default_socket_dir().join(CONTROL_SOCKET)
}

/// Why a directory is not fit to hold the daemon's sockets or state.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    /// It could not be created or inspected.
    #[error("directory {}", path.display())]
    Io {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// It belongs to someone else, or others may write in it.
    #[error(
        "directory {} is not private: {why} (it must belong to uid {uid} and not be writable by \
         group or others)",
        path.display()
    )]
    NotPrivate {
        /// The directory.
        path: PathBuf,
        /// What is wrong.
        why: String,
        /// Our uid.
        uid: u32,
    },
}

/// Create `dir` (mode 0700, parents as needed) if it is missing, and check that it is a
/// directory of ours that no one else can write in: a socket or a file in it cannot be
/// replaced by another user, whatever the umask was. Returns its absolute, canonical path
/// (a relative `--socket-dir` must not become a relative socket path in a QEMU line).
pub fn ensure_private_dir(dir: &Path) -> Result<PathBuf, DirError> {
    let io_err = |source| DirError::Io {
        path: dir.to_path_buf(),
        source,
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io_err)?;
    let meta = fs::symlink_metadata(dir).map_err(io_err)?;
    let not_private = |why: String| DirError::NotPrivate {
        path: dir.to_path_buf(),
        why,
        uid: euid(),
    };
    if !meta.is_dir() {
        return Err(not_private("not a directory (or a symbolic link)".into()));
    }
    if meta.uid() != euid() {
        return Err(not_private(format!("it belongs to uid {}", meta.uid())));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(not_private(format!("its mode is {mode:o}")));
    }
    fs::canonicalize(dir).map_err(io_err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_ensure_private_dir_creates_0700_refuses_group_writable() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("a/b");
        assert_eq!(
            ensure_private_dir(&dir).unwrap(),
            fs::canonicalize(&dir).unwrap()
        );
        let mode = fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o770)).unwrap();
        let e = ensure_private_dir(&dir).unwrap_err();
        assert!(e.to_string().contains("mode is 770"), "{e}");
        let link = base.path().join("link");
        std::os::unix::fs::symlink(base.path(), &link).unwrap();
        assert!(ensure_private_dir(&link).is_err());
    }
}
