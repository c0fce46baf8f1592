//! The listening socket: refuse to clobber a live server, remove a stale socket, set the
//! file mode, remove the file again when done.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use tracing::info;

use super::ServerError;

/// A bound listener that removes its socket file on drop.
#[derive(Debug)]
pub struct SocketListener {
    /// The listener.
    pub listener: UnixListener,
    path: PathBuf,
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
        let listener =
            UnixListener::bind(path).map_err(|e| ServerError::io("binding the socket", e))?;
        let guard = SocketListener {
            listener,
            path: path.to_path_buf(),
        };
        fs::set_permissions(path, fs::Permissions::from_mode(mode))
            .map_err(|e| ServerError::io("setting the socket mode", e))?;
        Ok(guard)
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketListener {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
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
