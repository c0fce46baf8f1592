//! The vfio-user server engine: sockets, connection loop, fd passing, server→client requests.
//!
//! A [`Server`] owns one device (`Box<dyn Device>`) and its [`crate::dma::DmaSpace`], which
//! lives as long as the server, across client reconnects. [`Server::spawn`] binds the
//! socket (mode 0600 by default; a live socket is never clobbered, a stale one is
//! removed), attaches the device to the DMA space once, and serves one client at a time on
//! a connection thread; a second simultaneous client is refused: its first command gets
//! an EBUSY error reply, then it is closed.
//!
//! Per connection ([`connection`]): VERSION first, then every command is decoded by
//! [`crate::protocol`], bounds-checked against the device's regions and IRQs, and
//! dispatched (`dispatch.rs`): DMA_MAP/UNMAP and DMA logging to the DMA space, the
//! migration messages to the connection's migration state machine (`migration.rs`), the
//! rest to the device. Errors go back as error replies with a fitting errno (never 0); commands
//! with No_reply get no reply at all. On disconnect all DMA maps are removed, the
//! server→client path is uninstalled and the device drops its IRQ fds; device state stays.
//! A client that does not read what the server sends is disconnected after
//! [`ServerConfig::send_timeout`]; what a client makes a connection hold (fds beyond a
//! command's use, commands queued while a device waits for a reply) is bounded
//! ([`channel`]); the accept loop backs off while the process's fd table is full
//! ([`listener::AcceptBackoff`]).
//!
//! Server→client DMA_READ/DMA_WRITE ([`remote_dma`]) may be issued from any thread while
//! the client is talking: requests are matched to replies by message id, replies are
//! routed by whoever is reading the socket ([`channel`] explains the leader/follower rule
//! that keeps the connection thread from deadlocking), transfers are split to the
//! negotiated max_data_xfer_size, a missing reply times out, and a disconnect fails every
//! pending request. In twin-socket mode the requests use a separate socket with its own
//! reader thread. Every message is handled in a `tracing` span (id, command, size, errno).
//! Between two messages the connection thread may spin for a short, adaptive time before
//! it blocks ([`poll`], [`ServerConfig::poll`]).
//!
//! A binary serves until Ctrl-C/SIGTERM with [`TerminationSignals`] ([`signals`]).

pub mod channel;
mod config;
pub mod connection;
mod dispatch;
mod error;
pub mod listener;
mod migration;
pub mod poll;
mod read_ahead;
mod refuse;
pub mod remote_dma;
mod running;
pub mod signals;
pub mod slice;
pub mod socket_io;

pub use channel::{BacklogLimits, BacklogUsage};
pub use config::{ServerConfig, DEFAULT_MAX_DMA_MAPPED_BYTES};
pub use error::ServerError;
pub use poll::PollMode;
pub use running::{RunningServer, Server, ShutdownHandle};
pub use signals::TerminationSignals;
pub use slice::{set_thread_slice, DEFAULT_THREAD_SLICE};
