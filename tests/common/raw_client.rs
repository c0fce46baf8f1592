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
