//! Errors of the server module and their errno mapping.

use std::io;
use std::path::PathBuf;

use crate::device::DeviceError;
use crate::dma::DmaError;
use crate::migration::{MachineError, MigrationError};
use crate::protocol::ProtocolError;

/// Errors while serving: setting up the socket, or handling one message.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A live server already listens on the socket path.
    #[error("socket {0} is in use by a running server")]
    SocketInUse(PathBuf),
    /// The socket path exists and is not a socket.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// Socket setup or I/O failed.
    #[error("socket I/O on {what}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The message is malformed.
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    /// The device refused the request.
    #[error("device refused")]
    Device(#[source] DeviceError),
    /// The DMA layer refused the request.
    #[error("DMA layer refused")]
    Dma(#[source] DmaError),
    /// The DMA layer refused a DMA_MAP / DMA_UNMAP of this range.
    #[error("iova={iova:#x} size={size:#x} rejected")]
    DmaRejected {
        /// Start of the range.
        iova: u64,
        /// Size of the range.
        size: u64,
        /// Why.
        #[source]
        source: DmaError,
    },
    /// A region/IRQ index or range outside what the device reports.
    #[error("{0}")]
    OutOfRange(String),
    /// A command before VERSION, or a second VERSION.
    #[error("{0}")]
    BadState(&'static str),
    /// The server thread panicked.
    #[error("server thread panicked")]
    Panicked,
    /// The device does not migrate (a migration feature or MIG_DATA on such a device).
    #[error("the device does not support migration")]
    NoMigration,
    /// A migration request failed (state unchanged, or ERROR if an arc failed).
    #[error("migration")]
    Migration(#[source] MachineError),
    /// A DMA_MAP would take the client past [`super::ServerConfig::max_dma_mapped_bytes`].
    #[error("DMA_MAP of {size:#x} bytes would exceed the mapped-bytes budget ({mapped:#x} of {max:#x} in use)")]
    DmaBudget {
        /// Size of the refused map.
        size: u64,
        /// Bytes mapped now.
        mapped: u64,
        /// The budget.
        max: u64,
    },
}

impl ServerError {
    /// The errno of the error reply (never 0).
    pub fn errno(&self) -> i32 {
        match self {
            ServerError::Protocol(e) => e.errno(),
            ServerError::Device(e) => nonzero(e.errno()),
            ServerError::Dma(e) | ServerError::DmaRejected { source: e, .. } => nonzero(e.errno()),
            ServerError::OutOfRange(_) | ServerError::BadState(_) => libc::EINVAL,
            ServerError::Io { source, .. } => nonzero(source.raw_os_error().unwrap_or(libc::EIO)),
            ServerError::SocketInUse(_) => libc::EADDRINUSE,
            ServerError::NotASocket(_) => libc::EEXIST,
            ServerError::Panicked => libc::EIO,
            ServerError::DmaBudget { .. } => libc::ENOSPC,
            ServerError::NoMigration => libc::ENOTSUP,
            ServerError::Migration(e) => machine_errno(e),
        }
    }

    pub(crate) fn io(what: &'static str, source: io::Error) -> Self {
        ServerError::Io { what, source }
    }
}

/// The errno of a failed migration request: a refused target, data in the wrong state or
/// a stream that cannot be loaded is `EINVAL` (as libvfio-user and the kernel answer); a
/// device that failed to stop, resume, save or load its own state is `EIO`.
fn machine_errno(e: &MachineError) -> i32 {
    let of = |m: &MigrationError| match m {
        MigrationError::Device(_) => libc::EIO,
        MigrationError::WrongFormat { .. }
        | MigrationError::UnsupportedVersion { .. }
        | MigrationError::Malformed { .. }
        | MigrationError::Incompatible(_) => libc::EINVAL,
    };
    match e {
        MachineError::Arc { .. } | MachineError::NoSession { .. } => libc::EINVAL,
        MachineError::ArcFailed { source, .. }
        | MachineError::Stream(source)
        | MachineError::Produce(source) => of(source),
    }
}

/// `e` and its chain of sources, joined with ": " (for one-line logs).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn nonzero(e: i32) -> i32 {
    if e > 0 {
        e
    } else {
        libc::EIO
    }
}
