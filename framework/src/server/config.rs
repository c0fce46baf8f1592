//! Server configuration.

use std::path::PathBuf;
use std::time::Duration;

use super::channel::BacklogLimits;
use super::poll::PollMode;
use crate::protocol::dma_rw::DmaRwLayout;
use crate::protocol::version::{
    ServerOffer, DEFAULT_MAX_DATA_XFER_SIZE, DEFAULT_MAX_DMA_MAPS, MAX_MAX_DATA_XFER_SIZE,
};

/// Default of [`ServerConfig::max_dma_mapped_bytes`]: 16 TiB.
pub const DEFAULT_MAX_DMA_MAPPED_BYTES: u64 = 16 << 40;

/// How a [`super::Server`] listens and what it offers in VERSION.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Path of the UNIX socket.
    pub socket_path: PathBuf,
    /// Permission bits of the socket file (default 0o600: only the owner may connect).
    pub socket_mode: u32,
    /// Most fds accepted with one message (≤ 16 is what QEMU accepts in our reply).
    pub max_msg_fds: u32,
    /// Largest data transfer accepted or sent (REGION_READ/WRITE, DMA_READ/WRITE).
    pub max_data_xfer_size: u32,
    /// Most DMA maps advertised (the [`crate::dma::DmaSpace`] enforces its own limit).
    pub max_dma_maps: u32,
    /// Most bytes one client may have DMA-mapped at once (sum of its map sizes; beyond it
    /// DMA_MAP fails with ENOSPC). The DMA layer keeps bookkeeping proportional to the
    /// mapped size even for fd-less maps, so this bounds what a client can make the server
    /// allocate. Default 16 TiB.
    pub max_dma_mapped_bytes: u64,
    /// How long a new client may stay silent before its VERSION: each read before the
    /// negotiation waits at most this long, then the client is disconnected (it would
    /// otherwise hold the single client slot without ever using it). Default 10 s; zero
    /// means no limit; no limit applies once VERSION is negotiated.
    pub negotiation_timeout: Duration,
    /// DMA page size (mappings must be aligned to it).
    pub pgsize: u64,
    /// Offer twin-socket mode to clients that support it.
    pub twin_socket: bool,
    /// How long a server→client DMA_READ/DMA_WRITE waits for its reply.
    pub remote_dma_timeout: Duration,
    /// How long sending one message to the client (a reply, a server→client request) may
    /// block because the client does not read (`SO_SNDTIMEO`); then the client is
    /// disconnected, with the usual teardown (maps removed, pins released, device state
    /// kept). Default 10 s; zero means no limit.
    pub send_timeout: Duration,
    /// Bounds of the commands a requester reads and queues while it waits for the reply to
    /// a server→client DMA_READ/DMA_WRITE (default 256 messages, 8 MiB, 64 fds); reading
    /// stops while one is reached (see `server::channel`).
    pub backlog: BacklogLimits,
    /// Layout of server→client DMA_READ/DMA_WRITE data. `None` (default) picks per client:
    /// QEMU's layout for a client that proposes `migration.max_bitmap_size` (only QEMU
    /// does), the spec's otherwise.
    pub dma_rw_layout: Option<DmaRwLayout>,
    /// Accept fd-backed DMA_MAPs of any mmappable file. Default `false`: only memfd,
    /// shmem/tmpfs and hugetlbfs files, whose page faults no client can stall (a FUSE file
    /// whose READ is never answered would stop the device thread copying through it, and a
    /// thread shared with other instances with it); others get EPERM. Set it only for
    /// trusted clients, e.g. QEMU with `memory-backend-file` on a disk filesystem.
    pub allow_any_file_maps: bool,
    /// The time slice the connection thread (and the twin-socket reader) ask the kernel
    /// for when they start ([`super::slice`]): a short slice lets a thread woken by a
    /// message preempt CPU-bound threads on a busy host (Linux ≥ 6.12), so a guest's
    /// trapped access does not wait milliseconds for a CPU. Default
    /// [`DEFAULT_THREAD_SLICE`](super::DEFAULT_THREAD_SLICE) (100 µs, the measurement is in
    /// [`super::slice`]); `None`: the kernel's default slice.
    pub thread_slice: Option<Duration>,
    /// Answer a client's `write_multiple: true` in VERSION (and accept REGION_WRITE_MULTI).
    /// Default `false`: QEMU 10.1/10.2 define their write-multiple flag as 0x16, which
    /// includes FORCE_QUEUED (0x4), so a server that answers it makes QEMU queue every
    /// message and send it from its I/O thread instead of the vCPU thread, one more thread
    /// hop per trapped access, for batching that only starts once 1,024 messages are
    /// queued (`protocol-docs/qemu.md`). Turn it on for a client without that bug.
    pub write_multiple: bool,
    /// How the connection thread waits for the next message: spin for a while with
    /// non-blocking reads before blocking (see `server::poll`; `--poll` on the command
    /// line). Default [`PollMode::Auto`].
    pub poll: PollMode,
}

impl ServerConfig {
    /// Defaults for a socket at `socket_path`.
    pub fn new(socket_path: impl Into<PathBuf>) -> Self {
        ServerConfig {
            socket_path: socket_path.into(),
            socket_mode: 0o600,
            max_msg_fds: 16,
            max_data_xfer_size: DEFAULT_MAX_DATA_XFER_SIZE,
            max_dma_maps: DEFAULT_MAX_DMA_MAPS,
            max_dma_mapped_bytes: DEFAULT_MAX_DMA_MAPPED_BYTES,
            negotiation_timeout: Duration::from_secs(10),
            pgsize: 4096,
            twin_socket: true,
            remote_dma_timeout: Duration::from_secs(5),
            send_timeout: Duration::from_secs(10),
            backlog: BacklogLimits::default(),
            dma_rw_layout: None,
            allow_any_file_maps: false,
            thread_slice: Some(super::DEFAULT_THREAD_SLICE),
            write_multiple: false,
            poll: PollMode::Auto,
        }
    }

    /// The VERSION offer derived from this configuration (values clamped to the ranges
    /// QEMU accepts).
    pub fn offer(&self) -> ServerOffer {
        ServerOffer {
            max_msg_fds: self.max_msg_fds.clamp(1, 16),
            max_data_xfer_size: self.max_data_xfer_size.clamp(4096, MAX_MAX_DATA_XFER_SIZE),
            max_dma_maps: self.max_dma_maps.clamp(1, 65535),
            pgsize: self.pgsize,
            twin_socket: self.twin_socket,
            write_multiple: self.write_multiple,
            // The connection sets it when its device migrates.
            migration: false,
        }
    }

    /// Largest whole message accepted: the transfer limit plus room for headers and the
    /// largest fixed-size commands (WRITE_MULTI, DMA logging ranges).
    pub fn max_message_size(&self) -> u32 {
        self.offer().max_data_xfer_size.saturating_add(64 * 1024)
    }
}
