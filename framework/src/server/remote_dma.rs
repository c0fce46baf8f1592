//! [`RemoteDma`] over the connection: DMA_READ / DMA_WRITE to the client, split into
//! transfers of at most the negotiated max_data_xfer_size (DMA_READ also at most
//! [`MAX_DMA_READ_PIECE`]), each registered with the range it targets so that a DMA_UNMAP
//! can cancel it ([`RemoteDma::cancel`]).
//!
//! errnos a device sees besides the client's own: ECANCELED (cancelled by a DEVICE_RESET
//! or by a DMA_UNMAP of the range, or refused during a reset), EDEADLK (issued from the
//! connection thread while the client waits for that thread's reply: see
//! [`super::channel`]), ETIMEDOUT (no reply in time), EPROTO (malformed reply).

use std::sync::Arc;

use tracing::{debug, warn};

use super::channel::{Channel, RequestError};
use crate::dma::{DmaError, RemoteDma};
use crate::protocol::dma_rw::{decode_dma_write_reply, encode_dma_read, DmaRwLayout};
use crate::protocol::Command;

/// Largest DMA_READ umdev asks for, whatever max_data_xfer_size says (64 KiB).
///
/// The client answers a DMA_READ with the data in its reply. QEMU 10.2 sends messages with
/// a non-blocking `writev` and takes a partial write for a complete one
/// (`hw/vfio-user/proxy.c`, `vfio_user_send_one`): a reply larger than the free space of
/// its socket send buffer (about 208 KiB by default, `net.core.wmem_default`) is cut short
/// and the stream is out of step for good (seen with a real guest: a 288 KiB DMA_READ was
/// never answered and every later request timed out). Pieces well below the buffer are
/// written whole. DMA_WRITE is not affected: umdev writes its requests completely, and
/// QEMU's reply to one is 16 + 24 bytes.
pub const MAX_DMA_READ_PIECE: usize = 64 * 1024;

/// The server→client DMA path of one connection.
#[derive(Debug, Clone)]
pub struct ClientDma {
    chan: Arc<Channel>,
    layout: DmaRwLayout,
}

impl ClientDma {
    /// DMA through `chan`, with data placed per `layout`.
    pub fn new(chan: Arc<Channel>, layout: DmaRwLayout) -> Self {
        ClientDma { chan, layout }
    }

    fn fail(&self, op: &str, iova: u64, len: usize, e: RequestError) -> DmaError {
        if matches!(e, RequestError::Cancelled(_)) {
            // Expected during a reset or an unmap; the device sees ECANCELED.
            debug!(iova = format_args!("{iova:#x}"), len, error = %e, "{op} to the client cancelled");
        } else {
            warn!(iova = format_args!("{iova:#x}"), len, error = %e, "{op} to the client failed");
        }
        match e {
            RequestError::Disconnected => DmaError::Disconnected,
            RequestError::Busy => DmaError::Busy("too many server-to-client requests in flight"),
            RequestError::Errno(errno) => DmaError::Remote {
                iova,
                errno: if errno == 0 { libc::EIO } else { errno as i32 },
            },
            RequestError::Timeout(_) => DmaError::Remote {
                iova,
                errno: libc::ETIMEDOUT,
            },
            RequestError::BadReply(_) => DmaError::Remote {
                iova,
                errno: libc::EPROTO,
            },
            RequestError::Cancelled(_) => DmaError::Remote {
                iova,
                errno: libc::ECANCELED,
            },
            RequestError::WouldDeadlock => DmaError::Remote {
                iova,
                errno: libc::EDEADLK,
            },
        }
    }

    /// DMA_READ `buf.len()` bytes at `iova`, in chunks.
    pub fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), RequestError> {
        let max = (self.chan.max_xfer() as usize).clamp(1, MAX_DMA_READ_PIECE);
        let mut done = 0usize;
        while done < buf.len() {
            let n = (buf.len() - done).min(max);
            let addr = iova.checked_add(done as u64).ok_or(RequestError::BadReply(
                crate::protocol::ProtocolError::invalid("DMA_READ", "address wraps"),
            ))?;
            let reply = self.chan.request_at(
                Command::DmaRead,
                &encode_dma_read(addr, n as u64),
                addr,
                n as u64,
            )?;
            let data = self
                .layout
                .decode_read_reply(&reply.payload, addr, n as u64)
                .map_err(RequestError::BadReply)?;
            buf[done..done + n].copy_from_slice(data);
            done += n;
        }
        Ok(())
    }

    /// DMA_WRITE `data` at `iova`, in chunks.
    pub fn write(&self, iova: u64, data: &[u8]) -> Result<(), RequestError> {
        let max = self.chan.max_xfer().max(1) as usize;
        let mut payload = Vec::with_capacity(16 + data.len().min(max));
        for (i, chunk) in data.chunks(max).enumerate() {
            let addr = iova
                .checked_add((i * max) as u64)
                .ok_or(RequestError::BadReply(
                    crate::protocol::ProtocolError::invalid("DMA_WRITE", "address wraps"),
                ))?;
            payload.clear();
            self.layout.put_write(&mut payload, addr, chunk);
            let reply =
                self.chan
                    .request_at(Command::DmaWrite, &payload, addr, chunk.len() as u64)?;
            decode_dma_write_reply(&reply.payload, addr, chunk.len() as u64)
                .map_err(RequestError::BadReply)?;
        }
        Ok(())
    }
}

impl RemoteDma for ClientDma {
    fn dma_read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.read(iova, buf)
            .map_err(|e| self.fail("DMA_READ", iova, buf.len(), e))
    }

    fn dma_write(&self, iova: u64, data: &[u8]) -> Result<(), DmaError> {
        self.write(iova, data)
            .map_err(|e| self.fail("DMA_WRITE", iova, data.len(), e))
    }

    fn max_xfer(&self) -> usize {
        self.chan.max_xfer() as usize
    }

    fn cancel(&self, iova: u64, size: u64) {
        self.chan
            .cancel_range(iova, size, "DMA_UNMAP of the range it targets");
    }
}
