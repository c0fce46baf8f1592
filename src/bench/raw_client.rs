//! A minimal hand-written vfio-user client for what `vfio_user::Client` cannot do: posted
//! (no-reply) REGION_WRITE messages, and fd-less DMA regions whose DMA_READ/DMA_WRITE
//! requests from the server it answers. It speaks only VERSION, REGION_READ/WRITE, DMA_MAP
//! and DMA_READ/WRITE, straight from the spec (docs/interop/vfio-user.rst in QEMU),
//! independently of umdev's own protocol module.

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::thread::JoinHandle;

/// VFIO_USER_VERSION.
const CMD_VERSION: u16 = 1;
/// VFIO_USER_DMA_MAP.
const CMD_DMA_MAP: u16 = 2;
/// VFIO_USER_DMA_READ (server → client).
const CMD_DMA_READ: u16 = 11;
/// VFIO_USER_DMA_WRITE (server → client).
const CMD_DMA_WRITE: u16 = 12;
/// VFIO_USER_REGION_READ.
const CMD_REGION_READ: u16 = 9;
/// VFIO_USER_REGION_WRITE.
const CMD_REGION_WRITE: u16 = 10;
/// Header flag: this is a reply.
const FLAG_REPLY: u32 = 1;
/// Header flag: the sender wants no reply.
const FLAG_NO_REPLY: u32 = 1 << 4;
/// Header flag: the reply carries an error.
const FLAG_ERROR: u32 = 1 << 5;
/// Size of the message header.
const HEADER: usize = 16;
/// Size of the REGION_READ/WRITE fixed part after the header (offset, region, count).
const REGION_ACCESS: usize = 16;
/// Largest reply accepted.
const MAX_REPLY: usize = 1 << 20;

/// A connected client.
pub struct RawClient {
    stream: UnixStream,
    next_id: u16,
}

fn header(id: u16, cmd: u16, size: usize, flags: u32) -> io::Result<[u8; HEADER]> {
    let size = u32::try_from(size).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let mut h = [0u8; HEADER];
    h[0..2].copy_from_slice(&id.to_le_bytes());
    h[2..4].copy_from_slice(&cmd.to_le_bytes());
    h[4..8].copy_from_slice(&size.to_le_bytes());
    h[8..12].copy_from_slice(&flags.to_le_bytes());
    Ok(h)
}

fn region_access(offset: u64, region: u32, count: u32) -> [u8; REGION_ACCESS] {
    let mut b = [0u8; REGION_ACCESS];
    b[0..8].copy_from_slice(&offset.to_le_bytes());
    b[8..12].copy_from_slice(&region.to_le_bytes());
    b[12..16].copy_from_slice(&count.to_le_bytes());
    b
}

impl RawClient {
    /// Connect to `path` and negotiate version 0.1.
    pub fn connect(path: &Path) -> io::Result<RawClient> {
        let stream = UnixStream::connect(path)?;
        let mut c = RawClient { stream, next_id: 0 };
        let caps = br#"{"capabilities":{"max_msg_fds":16,"max_data_xfer_size":1048576,"migration":{"pgsize":4096}}}"#;
        let mut msg = Vec::new();
        let size = HEADER + 4 + caps.len() + 1;
        msg.extend_from_slice(&header(c.id(), CMD_VERSION, size, 0)?);
        msg.extend_from_slice(&0u16.to_le_bytes());
        msg.extend_from_slice(&1u16.to_le_bytes());
        msg.extend_from_slice(caps);
        msg.push(0);
        c.stream.write_all(&msg)?;
        c.read_reply(CMD_VERSION)?;
        Ok(c)
    }

    fn id(&mut self) -> u16 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    /// Read one reply to `cmd`, returning its payload after the header.
    fn read_reply(&mut self, cmd: u16) -> io::Result<Vec<u8>> {
        let mut h = [0u8; HEADER];
        self.stream.read_exact(&mut h)?;
        let got_cmd = u16::from_le_bytes([h[2], h[3]]);
        let size = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let flags = u32::from_le_bytes([h[8], h[9], h[10], h[11]]);
        let error = u32::from_le_bytes([h[12], h[13], h[14], h[15]]);
        if !(HEADER..=MAX_REPLY).contains(&size) {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "bad reply size"));
        }
        let mut payload = vec![0u8; size - HEADER];
        self.stream.read_exact(&mut payload)?;
        if got_cmd != cmd || flags & FLAG_REPLY == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unexpected message {got_cmd} flags {flags:#x} awaiting reply to {cmd}"),
            ));
        }
        if flags & FLAG_ERROR != 0 {
            return Err(io::Error::from_raw_os_error(error as i32));
        }
        Ok(payload)
    }

    /// REGION_WRITE `data` with the no-reply flag: returns once the message is sent.
    pub fn posted_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        let count =
            u32::try_from(data.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let id = self.id();
        let mut msg = Vec::with_capacity(HEADER + REGION_ACCESS + data.len());
        msg.extend_from_slice(&header(
            id,
            CMD_REGION_WRITE,
            HEADER + REGION_ACCESS + data.len(),
            FLAG_NO_REPLY,
        )?);
        msg.extend_from_slice(&region_access(offset, region, count));
        msg.extend_from_slice(data);
        self.stream.write_all(&msg)
    }

    /// REGION_READ into `data` (waits for the reply, so it also fences posted writes).
    pub fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        let count =
            u32::try_from(data.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let id = self.id();
        let mut msg = Vec::with_capacity(HEADER + REGION_ACCESS);
        msg.extend_from_slice(&header(id, CMD_REGION_READ, HEADER + REGION_ACCESS, 0)?);
        msg.extend_from_slice(&region_access(offset, region, count));
        self.stream.write_all(&msg)?;
        let payload = self.read_reply(CMD_REGION_READ)?;
        let body = payload.get(REGION_ACCESS..).unwrap_or_default();
        if body.len() != data.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "short REGION_READ reply",
            ));
        }
        data.copy_from_slice(body);
        Ok(())
    }
}

impl RawClient {
    /// DMA_MAP of an fd-less region `[iova, iova + size)`, read/write.
    pub fn dma_map_fdless(&mut self, iova: u64, size: u64) -> io::Result<()> {
        let id = self.id();
        let mut msg = Vec::with_capacity(HEADER + 32);
        msg.extend_from_slice(&header(id, CMD_DMA_MAP, HEADER + 32, 0)?);
        msg.extend_from_slice(&32u32.to_le_bytes()); // argsz
        msg.extend_from_slice(&3u32.to_le_bytes()); // READ | WRITE
        msg.extend_from_slice(&0u64.to_le_bytes()); // offset
        msg.extend_from_slice(&iova.to_le_bytes());
        msg.extend_from_slice(&size.to_le_bytes());
        self.stream.write_all(&msg)?;
        self.read_reply(CMD_DMA_MAP).map(drop)
    }

    /// Hand the connection to a thread that answers the server's DMA_READ/DMA_WRITE on
    /// `[iova, iova + size)` from local memory, until [`DmaServer::stop`].
    pub fn serve_dma(self, iova: u64, size: usize) -> io::Result<DmaServer> {
        let control = self.stream.try_clone()?;
        let mut stream = self.stream;
        let thread = std::thread::spawn(move || -> io::Result<u64> {
            let mut mem = vec![0u8; size];
            let mut served = 0u64;
            loop {
                let mut h = [0u8; HEADER];
                match stream.read_exact(&mut h) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(served),
                    Err(e) => return Err(e),
                }
                let id = u16::from_le_bytes([h[0], h[1]]);
                let cmd = u16::from_le_bytes([h[2], h[3]]);
                let msg_size = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
                if !(HEADER..=MAX_REPLY + 64).contains(&msg_size) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "bad message size",
                    ));
                }
                let mut payload = vec![0u8; msg_size - HEADER];
                stream.read_exact(&mut payload)?;
                if payload.len() < 16 || !matches!(cmd, CMD_DMA_READ | CMD_DMA_WRITE) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("unexpected message {cmd}"),
                    ));
                }
                let addr = u64::from_le_bytes(payload[0..8].try_into().unwrap_or_default());
                let count = u64::from_le_bytes(payload[8..16].try_into().unwrap_or_default());
                let start = addr
                    .checked_sub(iova)
                    .and_then(|o| usize::try_from(o).ok())
                    .filter(|&o| o.checked_add(count as usize).is_some_and(|e| e <= size));
                let Some(start) = start else {
                    let mut reply = header(id, cmd, HEADER, FLAG_REPLY | FLAG_ERROR)?;
                    reply[12..16].copy_from_slice(&(libc::EFAULT as u32).to_le_bytes());
                    stream.write_all(&reply)?;
                    continue;
                };
                let end = start + count as usize;
                let mut reply = Vec::with_capacity(HEADER + 16 + count as usize);
                if cmd == CMD_DMA_READ {
                    reply.extend_from_slice(&header(
                        id,
                        cmd,
                        HEADER + 16 + count as usize,
                        FLAG_REPLY,
                    )?);
                    reply.extend_from_slice(&payload[0..16]);
                    reply.extend_from_slice(&mem[start..end]);
                } else {
                    let data = &payload[16..];
                    if data.len() != count as usize {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, "DMA_WRITE size"));
                    }
                    mem[start..end].copy_from_slice(data);
                    reply.extend_from_slice(&header(id, cmd, HEADER + 16, FLAG_REPLY)?);
                    reply.extend_from_slice(&payload[0..16]);
                }
                stream.write_all(&reply)?;
                served += 1;
            }
        });
        Ok(DmaServer { control, thread })
    }
}

/// A thread answering DMA_READ/DMA_WRITE for an fd-less region.
pub struct DmaServer {
    control: UnixStream,
    thread: JoinHandle<io::Result<u64>>,
}

impl DmaServer {
    /// Close the connection and return how many requests were served.
    pub fn stop(self) -> io::Result<u64> {
        let _ = self.control.shutdown(Shutdown::Both);
        self.thread
            .join()
            .map_err(|_| io::Error::other("DMA serving thread panicked"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_header_layout_is_little_endian_fields() {
        let h = header(0x0102, CMD_REGION_WRITE, 36, FLAG_NO_REPLY).unwrap();
        assert_eq!(&h[0..2], &[0x02, 0x01]);
        assert_eq!(u16::from_le_bytes([h[2], h[3]]), 10);
        assert_eq!(u32::from_le_bytes([h[4], h[5], h[6], h[7]]), 36);
        assert_eq!(u32::from_le_bytes([h[8], h[9], h[10], h[11]]), 16);
        assert_eq!(&h[12..16], &[0, 0, 0, 0]);
    }

    #[test]
    fn test_region_access_layout() {
        let b = region_access(0x10, 2, 4);
        assert_eq!(u64::from_le_bytes(b[0..8].try_into().unwrap()), 0x10);
        assert_eq!(u32::from_le_bytes(b[8..12].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(b[12..16].try_into().unwrap()), 4);
    }
}
