//! Guest memory the VMM keeps to itself: DMA-mapped without an fd, so the device reaches it
//! only through server→client DMA_READ/DMA_WRITE requests, which [`FdlessMemory::serve`]
//! answers from a buffer.
//!
//! How it answers is the test's choice ([`Answer`]): honestly, with an EFAULT error reply,
//! or never (the server's remote DMA timeout must fire). Every request is logged on arrival
//! as a [`DmaRequest`], whether it is answered or not, for tests that assert on traffic
//! ("no DMA_READ of the ring after the reset reply"); a benchmark turns the log off and
//! keeps the count. A request outside the buffer is
//! answered with EFAULT, a malformed one with EINVAL, as QEMU does; neither panics.
//!
//! Both layouts of the DMA_READ/DMA_WRITE payload are served: the spec's (count u64, data at
//! offset 16) and QEMU 10.x's (count u32, data at offset 12, and a DMA_WRITE whose message is
//! shorter than QEMU's struct plus the count gets E2BIG, as QEMU answers).

use std::io;
use std::os::unix::net::UnixStream;

use crate::protocol::dma_rw::{self, DmaRwLayout};
use crate::protocol::wire::Put;
use crate::protocol::{encode_message, Command, Header, HEADER_SIZE};
use crate::server::socket_io::send_message;

use super::raw_client::Msg;

/// How the VMM answers the device's DMA requests.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum Answer {
    /// Serve them from the buffer.
    #[default]
    Honest,
    /// Reply EFAULT.
    Errors,
    /// Never reply (the server's remote DMA timeout must fire).
    Silent,
}

/// One request from the server, as logged on arrival.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct DmaRequest {
    /// `Command::DmaRead` or `Command::DmaWrite`, as its wire number.
    pub command: u16,
    /// Guest address.
    pub iova: u64,
    /// Bytes asked for.
    pub count: u64,
}

/// The fd-less memory at `base`, with its answer policy and its log.
#[derive(Debug)]
pub struct FdlessMemory {
    base: u64,
    bytes: Vec<u8>,
    answer: Answer,
    layout: DmaRwLayout,
    log: Vec<DmaRequest>,
    keep_log: bool,
    requests: usize,
    reads: u64,
    writes: u64,
    largest: u64,
}

/// QEMU's `VFIOUserDMARW`: header, offset u64, count u32, padded to 8 bytes.
const QEMU_DMA_RW_STRUCT: u64 = 32;

impl FdlessMemory {
    /// `size` zeroed bytes at guest address `base`.
    pub fn new(base: u64, size: usize) -> FdlessMemory {
        FdlessMemory {
            base,
            bytes: vec![0; size],
            answer: Answer::Honest,
            layout: DmaRwLayout::Spec,
            log: Vec::new(),
            keep_log: true,
            requests: 0,
            reads: 0,
            writes: 0,
            largest: 0,
        }
    }

    /// `size` bytes at `base` holding `offset % 251`, so a read of the wrong place shows.
    pub fn with_pattern(base: u64, size: usize) -> FdlessMemory {
        let mut m = Self::new(base, size);
        for (i, b) in m.bytes.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        m
    }

    /// Guest address of the first byte.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The memory, as the VMM sees it.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The memory, to change it as the guest would.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.bytes
    }

    /// How requests are answered from now on.
    pub fn set_answer(&mut self, answer: Answer) {
        self.answer = answer;
    }

    /// The current answer policy.
    pub fn answer(&self) -> Answer {
        self.answer
    }

    /// Parse and answer requests in `layout` (QEMU 10.x's, or the spec's: the default).
    pub fn set_layout(&mut self, layout: DmaRwLayout) {
        self.layout = layout;
    }

    /// Log every request (the default), or only count them (a long benchmark would grow
    /// the log without bound).
    pub fn set_keep_log(&mut self, keep: bool) {
        self.keep_log = keep;
    }

    /// Every request received so far, in arrival order (while the log is kept).
    pub fn log(&self) -> &[DmaRequest] {
        &self.log
    }

    /// Number of requests received so far.
    pub fn requests(&self) -> usize {
        self.requests
    }

    /// DMA_READs answered with data.
    pub fn reads(&self) -> u64 {
        self.reads
    }

    /// DMA_WRITEs applied.
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// Largest count asked for so far.
    pub fn largest(&self) -> u64 {
        self.largest
    }

    /// True if `m` is a DMA_READ or DMA_WRITE request from the server.
    pub fn is_dma_request(m: &Msg) -> bool {
        m.is_request()
            && (m.header.command == Command::DmaRead as u16
                || m.header.command == Command::DmaWrite as u16)
    }

    /// (address, count, data) of a request in this memory's layout.
    fn decode<'a>(&self, m: &'a Msg) -> Option<(u64, u64, &'a [u8])> {
        match self.layout {
            DmaRwLayout::Spec => dma_rw::decode_dma_rw_request(&m.payload).ok(),
            DmaRwLayout::Qemu => {
                let addr = u64::from_ne_bytes(m.payload.get(0..8)?.try_into().ok()?);
                let count = u32::from_ne_bytes(m.payload.get(8..12)?.try_into().ok()?);
                Some((addr, u64::from(count), &m.payload[12..]))
            }
        }
    }

    /// Log the request `m` (a DMA request, see [`FdlessMemory::is_dma_request`]).
    pub fn note(&mut self, m: &Msg) -> DmaRequest {
        let (iova, count) = self.decode(m).map_or((0, 0), |(a, c, _)| (a, c));
        let r = DmaRequest {
            command: m.header.command,
            iova,
            count,
        };
        self.largest = self.largest.max(count);
        self.requests += 1;
        if self.keep_log {
            self.log.push(r);
        }
        r
    }

    /// Answer the request `m` on `stream` as the policy says (without logging it).
    pub fn answer_on(&mut self, stream: &UnixStream, m: &Msg) -> io::Result<()> {
        let h = &m.header;
        match self.answer {
            Answer::Silent => Ok(()),
            Answer::Errors => error_reply(stream, h, libc::EFAULT),
            Answer::Honest => self.answer_honestly(stream, m),
        }
    }

    fn answer_honestly(&mut self, stream: &UnixStream, m: &Msg) -> io::Result<()> {
        let h = &m.header;
        let Some((addr, count, data)) = self.decode(m) else {
            return error_reply(stream, h, libc::EINVAL);
        };
        let is_write = h.command == Command::DmaWrite as u16;
        if is_write
            && self.layout == DmaRwLayout::Qemu
            && u64::from(h.msg_size) < QEMU_DMA_RW_STRUCT.saturating_add(count)
        {
            return error_reply(stream, h, libc::E2BIG);
        }
        let range = addr
            .checked_sub(self.base)
            .and_then(|o| usize::try_from(o).ok())
            .and_then(|start| Some(start..start.checked_add(usize::try_from(count).ok()?)?))
            .filter(|r| r.end <= self.bytes.len());
        let Some(range) = range else {
            return error_reply(stream, h, libc::EFAULT);
        };
        if is_write {
            let Some(data) = data.get(..range.len()) else {
                return error_reply(stream, h, libc::EINVAL);
            };
            self.bytes[range].copy_from_slice(data);
            self.writes += 1;
            // Like QEMU: a bare reply header.
            return send_message(stream, &h.reply(0).encode(), &[]);
        }
        let mut p = Vec::with_capacity(HEADER_SIZE + range.len());
        p.put_u64(addr);
        match self.layout {
            DmaRwLayout::Spec => p.put_u64(count),
            DmaRwLayout::Qemu => p.put_u32(count as u32),
        }
        p.extend_from_slice(&self.bytes[range]);
        if self.layout == DmaRwLayout::Qemu {
            p.put_u32(0);
        }
        self.reads += 1;
        send_message(stream, &encode_message(&h.reply(p.len()), &p), &[])
    }

    /// If `m` is a DMA request, log it and answer it on `stream`; true if it was one.
    pub fn serve(&mut self, stream: &UnixStream, m: &Msg) -> io::Result<bool> {
        if !Self::is_dma_request(m) {
            return Ok(false);
        }
        self.note(m);
        self.answer_on(stream, m)?;
        Ok(true)
    }
}

fn error_reply(stream: &UnixStream, h: &Header, errno: i32) -> io::Result<()> {
    send_message(stream, &h.error_reply(errno).encode(), &[])
}
