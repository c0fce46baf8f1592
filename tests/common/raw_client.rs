//! A tiny vfio-user client speaking raw messages, for what `vfio_user::Client` cannot
//! send (posted writes, WRITE_MULTI, malformed messages) and for serving DMA_READ/WRITE.

use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use umdev::protocol::{encode_message, Command, Header, FLAGS_TYPE_REPLY, HEADER_SIZE};
use umdev::server::socket_io::{header_of, recv_header, recv_payload, send_message};

/// A received message.
pub struct Msg {
    pub header: Header,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

pub struct RawClient {
    pub stream: UnixStream,
    next_id: u16,
}

pub const DEFAULT_CAPS: &str = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,\"max_dma_maps\":65535,\"write_multiple\":true}}";

impl RawClient {
    pub fn connect(path: &Path) -> RawClient {
        let stream = UnixStream::connect(path).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(4)))
            .unwrap();
        RawClient {
            stream,
            next_id: 0x100,
        }
    }

    /// Connect and negotiate with `caps` JSON; returns the reply.
    pub fn negotiated(path: &Path, caps: &str) -> (RawClient, Msg) {
        let mut c = Self::connect(path);
        let mut p = vec![0, 0, 0, 0];
        p.extend_from_slice(caps.as_bytes());
        p.push(0);
        let r = c.call(Command::Version as u16, 0, &p, &[]);
        assert!(
            !r.header.is_error(),
            "VERSION failed: errno {}",
            r.header.error
        );
        (c, r)
    }

    pub fn new_default(path: &Path) -> RawClient {
        Self::negotiated(path, DEFAULT_CAPS).0
    }

    /// Send a command; returns its message id.
    pub fn send(&mut self, cmd: u16, flags: u32, payload: &[u8], fds: &[RawFd]) -> u16 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let h = Header {
            msg_id: id,
            command: cmd,
            msg_size: (HEADER_SIZE + payload.len()) as u32,
            flags,
            error: 0,
        };
        send_message(&self.stream, &encode_message(&h, payload), fds).unwrap();
        id
    }

    /// Send raw bytes.
    pub fn send_raw(&mut self, bytes: &[u8], fds: &[RawFd]) {
        send_message(&self.stream, bytes, fds).unwrap();
    }

    pub fn recv(&mut self) -> Msg {
        let raw = recv_header(&self.stream)
            .expect("recv failed")
            .expect("server closed the connection");
        let header = header_of(&raw);
        let mut payload = vec![0u8; header.msg_size as usize - HEADER_SIZE];
        recv_payload(&self.stream, &mut payload).unwrap();
        Msg {
            header,
            payload,
            fds: raw.fds,
        }
    }

    /// Send a command and wait for its reply.
    pub fn call(&mut self, cmd: u16, flags: u32, payload: &[u8], fds: &[RawFd]) -> Msg {
        let id = self.send(cmd, flags, payload, fds);
        let m = self.recv();
        assert_eq!(m.header.msg_id, id, "reply id");
        assert_eq!(m.header.command, cmd, "reply command");
        assert_eq!(m.header.flags & 0xf, FLAGS_TYPE_REPLY, "reply type");
        m
    }

    /// Send a command that must fail; returns the errno.
    pub fn expect_error(&mut self, cmd: u16, payload: &[u8], fds: &[RawFd]) -> u32 {
        let m = self.call(cmd, 0, payload, fds);
        assert!(m.header.is_error(), "command {cmd} unexpectedly succeeded");
        assert_eq!(
            m.header.msg_size as usize, HEADER_SIZE,
            "error reply has a payload"
        );
        assert_ne!(m.header.error, 0, "errno 0 in an error reply");
        m.header.error
    }

    /// Reply to a server request.
    pub fn reply(&mut self, req: &Header, payload: &[u8]) {
        let h = req.reply(payload.len());
        send_message(&self.stream, &encode_message(&h, payload), &[]).unwrap();
    }

    pub fn reply_error(&mut self, req: &Header, errno: i32) {
        send_message(&self.stream, &req.error_reply(errno).encode(), &[]).unwrap();
    }

    /// REGION_READ returning the data.
    pub fn region_read(&mut self, region: u32, offset: u64, count: u32) -> Vec<u8> {
        let a = umdev::protocol::region_access::RegionAccess {
            offset,
            region,
            count,
        };
        let m = self.call(Command::RegionRead as u16, 0, &a.encode(), &[]);
        assert!(!m.header.is_error(), "REGION_READ errno {}", m.header.error);
        assert_eq!(m.payload.len(), 16 + count as usize);
        m.payload[16..].to_vec()
    }

    /// REGION_WRITE, `flags` may hold No_reply (then nothing is read back).
    pub fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
        flags: u32,
    ) -> Option<Msg> {
        let a = umdev::protocol::region_access::RegionAccess {
            offset,
            region,
            count: data.len() as u32,
        };
        let mut p = a.encode();
        p.extend_from_slice(data);
        if flags & umdev::protocol::FLAGS_NO_REPLY != 0 {
            self.send(Command::RegionWrite as u16, flags, &p, &[]);
            None
        } else {
            Some(self.call(Command::RegionWrite as u16, flags, &p, &[]))
        }
    }
}

/// Guest memory the raw client serves DMA_READ/DMA_WRITE from.
pub struct GuestMem {
    pub base: u64,
    pub bytes: Vec<u8>,
    pub reads: usize,
    pub writes: usize,
    pub largest: u64,
    /// Serve with QEMU 10.x's layout (count u32, data at payload offset 12).
    pub qemu_layout: bool,
}

impl GuestMem {
    pub fn new(base: u64, size: usize) -> GuestMem {
        GuestMem {
            base,
            bytes: (0..size).map(|i| (i % 251) as u8).collect(),
            reads: 0,
            writes: 0,
            largest: 0,
            qemu_layout: false,
        }
    }
}

impl RawClient {
    /// If `m` is a DMA_READ/DMA_WRITE from the server, serve it from `mem` on `stream`
    /// and return true.
    pub fn serve_on(stream: &UnixStream, m: &Msg, mem: &mut GuestMem) -> bool {
        use umdev::protocol::dma_rw::decode_dma_rw_request;
        use umdev::protocol::wire::Put;
        let is_cmd = m.header.flags & 0xf == 0;
        let cmd = m.header.command;
        if !is_cmd || (cmd != Command::DmaRead as u16 && cmd != Command::DmaWrite as u16) {
            return false;
        }
        let (addr, count, data) = if mem.qemu_layout {
            // QEMU's VFIOUserDMARW: offset u64, count u32, data[] at 12.
            let addr = u64::from_ne_bytes(m.payload[0..8].try_into().unwrap());
            let count = u32::from_ne_bytes(m.payload[8..12].try_into().unwrap()) as u64;
            if cmd == Command::DmaWrite as u16 {
                assert!(
                    m.header.msg_size as u64 >= 32 + count,
                    "QEMU would answer E2BIG"
                );
            }
            (addr, count, &m.payload[12..])
        } else {
            decode_dma_rw_request(&m.payload).unwrap()
        };
        mem.largest = mem.largest.max(count);
        let start = (addr - mem.base) as usize;
        let end = start + count as usize;
        if cmd == Command::DmaRead as u16 {
            mem.reads += 1;
            let mut p = Vec::new();
            p.put_u64(addr);
            if mem.qemu_layout {
                p.put_u32(count as u32);
                p.extend_from_slice(&mem.bytes[start..end]);
                p.put_u32(0);
            } else {
                p.put_u64(count);
                p.extend_from_slice(&mem.bytes[start..end]);
            }
            let h = m.header.reply(p.len());
            send_message(stream, &encode_message(&h, &p), &[]).unwrap();
        } else {
            mem.writes += 1;
            mem.bytes[start..end].copy_from_slice(&data[..count as usize]);
            // Answer like QEMU: a bare reply header.
            send_message(stream, &m.header.reply(0).encode(), &[]).unwrap();
        }
        true
    }

    /// Send a command and wait for its reply while serving DMA requests from `mem`.
    pub fn call_serving(
        &mut self,
        cmd: u16,
        flags: u32,
        payload: &[u8],
        mem: &mut GuestMem,
    ) -> Msg {
        let id = self.send(cmd, flags, payload, &[]);
        loop {
            let m = self.recv();
            if Self::serve_on(&self.stream, &m, mem) {
                continue;
            }
            assert_eq!(m.header.msg_id, id, "reply id");
            return m;
        }
    }

    /// Receive one message on `stream` (e.g. the twin socket).
    pub fn recv_on(stream: &UnixStream) -> Msg {
        let raw = recv_header(stream).expect("recv").expect("closed");
        let header = header_of(&raw);
        let mut payload = vec![0u8; header.msg_size as usize - HEADER_SIZE];
        recv_payload(stream, &mut payload).unwrap();
        Msg {
            header,
            payload,
            fds: raw.fds,
        }
    }
}
