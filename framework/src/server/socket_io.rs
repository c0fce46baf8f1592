//! Message I/O on a UNIX stream socket: one `recvmsg` with room for SCM_RIGHTS fds (the
//! connection's read-ahead, `read_ahead`, and the one-message readers: header with its
//! fds, then the payload); send a whole message (optionally with fds) in one `sendmsg`.

use std::io::{self, Read, Write};
use std::mem;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::protocol::{Header, HEADER_SIZE};

/// Room for this many fds in the control buffer; more than that sets MSG_CTRUNC (the
/// kernel closes what did not fit) and the message is rejected.
pub const FD_SLOTS: usize = 32;
/// Control buffer size in u64 words: CMSG_SPACE(32 fds) = 16-byte cmsghdr + 128 bytes.
const CBUF_WORDS: usize = (16 + FD_SLOTS * mem::size_of::<RawFd>()).div_ceil(8);

/// A received header with the fds that came with it.
#[derive(Debug)]
pub struct RawHeader {
    /// The header bytes.
    pub bytes: [u8; HEADER_SIZE],
    /// Fds from SCM_RIGHTS (owned: dropping closes them).
    pub fds: Vec<OwnedFd>,
    /// The control data was truncated (more fds than [`FD_SLOTS`]).
    pub fds_truncated: bool,
}

/// Receive one header (16 bytes) and its fds. `Ok(None)` on EOF before any byte.
pub fn recv_header(stream: &UnixStream) -> io::Result<Option<RawHeader>> {
    recv_header_with(stream, false)
}

/// [`recv_header`]; with `dontwait`, an error of kind `WouldBlock` if no byte is there yet
/// (nothing consumed). Once the first byte is read, the rest of the header is waited for.
pub fn recv_header_with(stream: &UnixStream, dontwait: bool) -> io::Result<Option<RawHeader>> {
    let mut bytes = [0u8; HEADER_SIZE];
    let got = recv_with_fds(stream, &mut bytes, dontwait)?;
    if got.len == 0 {
        return Ok(None);
    }
    if got.len < HEADER_SIZE {
        // The rest of the header follows without fds.
        let mut s = stream;
        s.read_exact(&mut bytes[got.len..])?;
    }
    Ok(Some(RawHeader {
        bytes,
        fds: got.fds,
        fds_truncated: got.fds_truncated,
    }))
}

/// What one `recvmsg` returned.
#[derive(Debug)]
pub struct Received {
    /// Bytes read (0: end of stream).
    pub len: usize,
    /// Fds from SCM_RIGHTS (owned: dropping closes them).
    pub fds: Vec<OwnedFd>,
    /// The control data was truncated (more fds than [`FD_SLOTS`]; the kernel closed what
    /// did not fit).
    pub fds_truncated: bool,
}

/// One `recvmsg` into `buf` with room for [`FD_SLOTS`] fds: at most `buf.len()` bytes,
/// fewer if fewer are there (on a stream socket, Linux also stops after the first part of
/// a sender's `sendmsg` that carries fds: see `read_ahead`). With `dontwait`, an error of
/// kind `WouldBlock` if no byte is there (nothing consumed). `EINTR` is retried.
pub fn recv_with_fds(stream: &UnixStream, buf: &mut [u8], dontwait: bool) -> io::Result<Received> {
    // SAFETY: `buf` is valid for writes of `buf.len()` initialised bytes.
    unsafe { recv_raw(stream, buf.as_mut_ptr(), buf.len(), dontwait) }
}

/// [`recv_with_fds`] into the spare capacity of `buf` (its uninitialised tail), then
/// extends `buf` by the bytes read: nothing is zeroed first, and pages of the capacity that
/// no message reached stay untouched.
pub fn recv_append(stream: &UnixStream, buf: &mut Vec<u8>, dontwait: bool) -> io::Result<Received> {
    let room = buf.spare_capacity_mut();
    // SAFETY: `room` is valid for writes of `room.len()` bytes (uninitialised bytes may be
    // written; the kernel writes, never reads them).
    let got = unsafe { recv_raw(stream, room.as_mut_ptr().cast(), room.len(), dontwait)? };
    // SAFETY: recvmsg initialised the first `got.len` bytes of the spare capacity
    // (`got.len` ≤ `room.len()`).
    unsafe { buf.set_len(buf.len() + got.len) };
    Ok(got)
}

/// # Safety
///
/// `ptr` is valid for writes of `len` bytes for the duration of the call.
unsafe fn recv_raw(
    stream: &UnixStream,
    ptr: *mut u8,
    len: usize,
    dontwait: bool,
) -> io::Result<Received> {
    let flags = libc::MSG_CMSG_CLOEXEC | if dontwait { libc::MSG_DONTWAIT } else { 0 };
    // u64 storage keeps the control buffer aligned for cmsghdr; on the stack, so the hot
    // path does not allocate.
    let mut cbuf = [0u64; CBUF_WORDS];
    let space = CBUF_WORDS * 8;
    let mut iov = libc::iovec {
        iov_base: ptr.cast(),
        iov_len: len,
    };
    // SAFETY: an all-zero msghdr is a valid empty value; the pointers are set below.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    let n = loop {
        // SAFETY: msg points at a live iovec over `len` writable bytes (the caller's
        // promise) and a control buffer of `space` bytes, both outliving the call.
        let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, flags) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break n as usize;
    };
    let mut fds = Vec::new();
    // SAFETY: msg was filled by recvmsg; CMSG_FIRSTHDR/NXTHDR walk within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let len = (*c).cmsg_len as usize - (data as usize - c as usize);
                for i in 0..len / mem::size_of::<RawFd>() {
                    let fd = std::ptr::read_unaligned(data.add(i));
                    // The kernel installed this fd for us; we are its only owner.
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok(Received {
        len: n,
        fds,
        fds_truncated: msg.msg_flags & libc::MSG_CTRUNC != 0,
    })
}

/// Read exactly `buf.len()` payload bytes.
pub fn recv_payload(stream: &UnixStream, buf: &mut [u8]) -> io::Result<()> {
    let mut s = stream;
    s.read_exact(buf)
}

/// Read and drop `len` bytes (the payload of a message we refuse to buffer).
pub fn discard(stream: &UnixStream, mut len: usize) -> io::Result<()> {
    let mut scratch = [0u8; 4096];
    let mut s = stream;
    while len > 0 {
        let n = len.min(scratch.len());
        s.read_exact(&mut scratch[..n])?;
        len -= n;
    }
    Ok(())
}

/// Send `buf` (one whole message) with `fds` attached to its first byte.
pub fn send_message(stream: &UnixStream, buf: &[u8], fds: &[RawFd]) -> io::Result<()> {
    if fds.is_empty() {
        let mut s = stream;
        return s.write_all(buf);
    }
    let space =
        // SAFETY: CMSG_SPACE only computes a size from its argument.
        unsafe { libc::CMSG_SPACE(mem::size_of_val(fds) as u32) } as usize;
    // On the stack for up to FD_SLOTS fds (every reply umdev sends); a larger set is the
    // caller's business and gets a heap buffer.
    let mut stack = [0u64; CBUF_WORDS];
    let mut heap = Vec::new();
    let cbuf: &mut [u64] = if space <= CBUF_WORDS * 8 {
        &mut stack[..space.div_ceil(8)]
    } else {
        heap.resize(space.div_ceil(8), 0u64);
        &mut heap
    };
    let mut iov = libc::iovec {
        iov_base: buf.as_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty value; the pointers are set below.
    let mut msg: libc::msghdr = unsafe { mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer has room for one cmsghdr carrying `fds`; we write the
    // header and the fd array inside it.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(mem::size_of_val(fds) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c) as *mut RawFd, fds.len());
    }
    let sent = loop {
        // SAFETY: msg points at a live iovec over `buf` and a filled control buffer.
        let n = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        break n as usize;
    };
    if sent < buf.len() {
        let mut s = stream;
        s.write_all(&buf[sent..])?;
    }
    Ok(())
}

/// Wait until `stream` is readable or `timeout` passes; true if readable (or hung up).
pub fn wait_readable(stream: &UnixStream, timeout: Duration) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(false);
        }
        return Err(e);
    }
    Ok(n > 0)
}

/// Decode the header bytes (cannot fail on 16 bytes).
pub fn header_of(raw: &RawHeader) -> Header {
    Header::decode(&raw.bytes).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::File;

    #[test]
    fn test_send_recv_fds_travel_with_header() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        let h = Header::command(5, crate::protocol::Command::DeviceReset, 4);
        let msg = crate::protocol::encode_message(&h, &[1, 2, 3, 4]);
        send_message(&a, &msg, &[f.as_raw_fd(), f.as_raw_fd()]).unwrap();
        let raw = recv_header(&b).unwrap().unwrap();
        assert_eq!(header_of(&raw), h);
        assert_eq!(raw.fds.len(), 2);
        assert!(!raw.fds_truncated);
        let mut p = [0u8; 4];
        recv_payload(&b, &mut p).unwrap();
        assert_eq!(p, [1, 2, 3, 4]);
    }

    #[test]
    fn test_control_buffer_holds_fd_slots() {
        // SAFETY: CMSG_SPACE only computes a size from its argument.
        let need = unsafe { libc::CMSG_SPACE((FD_SLOTS * mem::size_of::<RawFd>()) as u32) };
        assert!(CBUF_WORDS * 8 >= need as usize);
    }

    #[test]
    fn test_recv_header_dontwait_empty_would_block_then_reads() {
        let (a, b) = UnixStream::pair().unwrap();
        let e = recv_header_with(&b, true).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        let h = Header::command(9, crate::protocol::Command::DeviceReset, 0);
        send_message(&a, &h.encode(), &[]).unwrap();
        let raw = recv_header_with(&b, true).unwrap().unwrap();
        assert_eq!(header_of(&raw), h);
    }

    #[test]
    fn test_recv_header_eof_returns_none() {
        let (a, b) = UnixStream::pair().unwrap();
        drop(a);
        assert!(recv_header(&b).unwrap().is_none());
    }

    #[test]
    fn test_recv_header_too_many_fds_truncated() {
        let (a, b) = UnixStream::pair().unwrap();
        let f = File::open("/dev/null").unwrap();
        let fds = vec![f.as_raw_fd(); FD_SLOTS + 4];
        let h = Header::command(1, crate::protocol::Command::DeviceReset, 0);
        send_message(&a, &h.encode(), &fds).unwrap();
        let raw = recv_header(&b).unwrap().unwrap();
        assert!(raw.fds_truncated);
    }
}
