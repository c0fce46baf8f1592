//! A raw vfio-user client: it sends any bytes with any fds and shows every reply as it came,
//! for tests that send what a real client never would (malformed messages, lying sizes,
//! posted writes, WRITE_MULTI) and for tests that answer the server's own requests.
//!
//! Two flavours of each operation: `try_*` returns `io::Result` (what [`super::Vmm`] builds
//! on), the plain one panics with a message that names the operation, so a test reads as
//! straight-line code. [`RawClient::call`] asserts that the next message is the reply to the
//! command just sent (same id and command, reply type): a server that answers out of order
//! fails the test there. [`RawClient::expect_error`] asserts the shape of an error reply: no
//! payload, errno not 0.

use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::protocol::region_access::RegionAccess;
use crate::protocol::{
    encode_message, Command, Header, FLAGS_NO_REPLY, FLAGS_TYPE_COMMAND, FLAGS_TYPE_MASK,
    FLAGS_TYPE_REPLY, HEADER_SIZE,
};
use crate::server::socket_io::{header_of, recv_header, recv_payload, send_message};

/// The capabilities the raw client proposes by default: QEMU's limits, write_multiple on.
pub const DEFAULT_CAPS: &str = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,\"max_dma_maps\":65535,\"write_multiple\":true}}";

/// How long a receive waits before it fails (a server that never answers fails the test).
pub const READ_TIMEOUT: Duration = Duration::from_secs(4);

/// Largest message the client accepts (64 MiB of data plus headers): a bigger size field
/// is an error, not an allocation.
const MAX_MESSAGE: usize = (64 << 20) + 4096;

/// A received message: header, payload, and the fds that came with it.
#[derive(Debug)]
pub struct Msg {
    /// The decoded header.
    pub header: Header,
    /// Everything after the header.
    pub payload: Vec<u8>,
    /// Fds received with the header.
    pub fds: Vec<OwnedFd>,
}

impl Msg {
    /// True if this is a command (a request from the server), not a reply.
    pub fn is_request(&self) -> bool {
        self.header.flags & FLAGS_TYPE_MASK == FLAGS_TYPE_COMMAND
    }
}

/// A connected raw client.
pub struct RawClient {
    stream: UnixStream,
    next_id: u16,
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The VERSION payload: major 0, minor 0, `caps` as NUL-terminated JSON.
fn version_payload(caps: &str) -> Vec<u8> {
    let mut p = vec![0, 0, 0, 0];
    p.extend_from_slice(caps.as_bytes());
    p.push(0);
    p
}

impl RawClient {
    /// Connect to `path` (nothing sent yet); receives time out after [`READ_TIMEOUT`].
    pub fn try_connect(path: &Path) -> io::Result<RawClient> {
        let stream = UnixStream::connect(path)?;
        stream.set_read_timeout(Some(READ_TIMEOUT))?;
        Ok(RawClient {
            stream,
            next_id: 0x100,
        })
    }

    /// [`RawClient::try_connect`], panicking on failure.
    pub fn connect(path: &Path) -> RawClient {
        Self::try_connect(path).unwrap_or_else(|e| panic!("connect to {}: {e}", path.display()))
    }

    /// Send VERSION with `caps`; the reply, or its errno as the error.
    pub fn try_negotiate(&mut self, caps: &str) -> io::Result<Msg> {
        let r = self.try_call(Command::Version as u16, 0, &version_payload(caps), &[])?;
        if r.header.is_error() {
            return Err(io::Error::from_raw_os_error(r.header.error as i32));
        }
        Ok(r)
    }

    /// Connect and negotiate with `caps` JSON; returns the VERSION reply too. Panics if
    /// either fails.
    pub fn negotiated(path: &Path, caps: &str) -> (RawClient, Msg) {
        let mut c = Self::connect(path);
        let r = c
            .try_negotiate(caps)
            .unwrap_or_else(|e| panic!("VERSION failed: {e}"));
        (c, r)
    }

    /// Connect and negotiate [`DEFAULT_CAPS`]; panics on failure.
    pub fn new_default(path: &Path) -> RawClient {
        Self::negotiated(path, DEFAULT_CAPS).0
    }

    /// The socket (to set timeouts, poll it, or shut it down).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Send a command with the next message id; returns the id.
    pub fn try_send(
        &mut self,
        cmd: u16,
        flags: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> io::Result<u16> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let size = HEADER_SIZE
            .checked_add(payload.len())
            .and_then(|s| u32::try_from(s).ok())
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let h = Header {
            msg_id: id,
            command: cmd,
            msg_size: size,
            flags,
            error: 0,
        };
        send_message(&self.stream, &encode_message(&h, payload), fds)?;
        Ok(id)
    }

    /// [`RawClient::try_send`], panicking on failure.
    pub fn send(&mut self, cmd: u16, flags: u32, payload: &[u8], fds: &[RawFd]) -> u16 {
        self.try_send(cmd, flags, payload, fds)
            .unwrap_or_else(|e| panic!("send command {cmd}: {e}"))
    }

    /// Send `bytes` as they are (any header, any size field) with `fds`.
    pub fn send_raw(&mut self, bytes: &[u8], fds: &[RawFd]) {
        send_message(&self.stream, bytes, fds).unwrap_or_else(|e| panic!("send raw bytes: {e}"));
    }

    /// Receive one message on `stream` (this client's socket, or a twin socket).
    pub fn try_recv_on(stream: &UnixStream) -> io::Result<Msg> {
        let raw = recv_header(stream)?.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection",
            )
        })?;
        let header = header_of(&raw);
        let size = header.msg_size as usize;
        if !(HEADER_SIZE..=MAX_MESSAGE).contains(&size) {
            return Err(invalid(format!("message size {size} from the server")));
        }
        let mut payload = vec![0u8; size - HEADER_SIZE];
        recv_payload(stream, &mut payload)?;
        Ok(Msg {
            header,
            payload,
            fds: raw.fds,
        })
    }

    /// [`RawClient::try_recv_on`], panicking on failure.
    pub fn recv_on(stream: &UnixStream) -> Msg {
        Self::try_recv_on(stream).unwrap_or_else(|e| panic!("receive: {e}"))
    }

    /// Receive the next message.
    pub fn try_recv(&mut self) -> io::Result<Msg> {
        Self::try_recv_on(&self.stream)
    }

    /// [`RawClient::try_recv`], panicking on failure.
    pub fn recv(&mut self) -> Msg {
        Self::recv_on(&self.stream)
    }

    /// Check that `m` is the reply to command `cmd` sent with `id`.
    pub fn check_reply(m: &Msg, id: u16, cmd: u16) -> io::Result<()> {
        if m.header.msg_id != id
            || m.header.command != cmd
            || m.header.flags & FLAGS_TYPE_MASK != FLAGS_TYPE_REPLY
        {
            return Err(invalid(format!(
                "expected the reply to command {cmd} id {id}, got command {} id {} flags {:#x}",
                m.header.command, m.header.msg_id, m.header.flags
            )));
        }
        Ok(())
    }

    /// Send a command and receive its reply (which may be an error reply); the next
    /// message must be that reply.
    pub fn try_call(
        &mut self,
        cmd: u16,
        flags: u32,
        payload: &[u8],
        fds: &[RawFd],
    ) -> io::Result<Msg> {
        let id = self.try_send(cmd, flags, payload, fds)?;
        let m = self.try_recv()?;
        Self::check_reply(&m, id, cmd)?;
        Ok(m)
    }

    /// Send a command and wait for its reply; asserts that the next message is that reply.
    #[track_caller]
    pub fn call(&mut self, cmd: u16, flags: u32, payload: &[u8], fds: &[RawFd]) -> Msg {
        let id = self.send(cmd, flags, payload, fds);
        let m = self.recv();
        assert_eq!(m.header.msg_id, id, "reply id");
        assert_eq!(m.header.command, cmd, "reply command");
        assert_eq!(
            m.header.flags & FLAGS_TYPE_MASK,
            FLAGS_TYPE_REPLY,
            "reply type"
        );
        m
    }

    /// Send a command that must fail; returns the errno. Asserts an error reply without a
    /// payload and with an errno that is not 0.
    #[track_caller]
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

    /// Reply to the server's request `req` with `payload`.
    pub fn try_reply(&mut self, req: &Header, payload: &[u8]) -> io::Result<()> {
        let h = req.reply(payload.len());
        send_message(&self.stream, &encode_message(&h, payload), &[])
    }

    /// [`RawClient::try_reply`], panicking on failure.
    pub fn reply(&mut self, req: &Header, payload: &[u8]) {
        self.try_reply(req, payload)
            .unwrap_or_else(|e| panic!("reply to request {}: {e}", req.msg_id));
    }

    /// Answer the server's request `req` with an error reply carrying `errno`.
    pub fn try_reply_error(&mut self, req: &Header, errno: i32) -> io::Result<()> {
        send_message(&self.stream, &req.error_reply(errno).encode(), &[])
    }

    /// [`RawClient::try_reply_error`], panicking on failure.
    pub fn reply_error(&mut self, req: &Header, errno: i32) {
        self.try_reply_error(req, errno)
            .unwrap_or_else(|e| panic!("error reply to request {}: {e}", req.msg_id));
    }

    /// REGION_READ of `count` bytes; asserts success and the reply's size; the data.
    #[track_caller]
    pub fn region_read(&mut self, region: u32, offset: u64, count: u32) -> Vec<u8> {
        let a = RegionAccess {
            offset,
            region,
            count,
        };
        let m = self.call(Command::RegionRead as u16, 0, &a.encode(), &[]);
        assert!(!m.header.is_error(), "REGION_READ errno {}", m.header.error);
        assert_eq!(m.payload.len(), 16 + count as usize);
        m.payload[16..].to_vec()
    }

    /// REGION_WRITE of `data`. With [`FLAGS_NO_REPLY`] in `flags` the write is posted and
    /// nothing is read back (`None`); otherwise the reply (which may be an error reply).
    #[track_caller]
    pub fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
        flags: u32,
    ) -> Option<Msg> {
        let a = RegionAccess {
            offset,
            region,
            count: data.len() as u32,
        };
        let mut p = a.encode();
        p.extend_from_slice(data);
        if flags & FLAGS_NO_REPLY != 0 {
            self.send(Command::RegionWrite as u16, flags, &p, &[]);
            None
        } else {
            Some(self.call(Command::RegionWrite as u16, flags, &p, &[]))
        }
    }
}
