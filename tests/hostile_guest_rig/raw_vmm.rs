//! A raw-client VMM that serves the device's DMA_READ/DMA_WRITE requests for one fd-less
//! mapping from its own buffer, honestly, with error replies, or not at all. Needs the
//! including test crate to declare `mod common;` (tests/common).
//!
//! With `defer` set it behaves like QEMU 10.x: QEMU serves server requests in a bottom half
//! of its main loop, and the thread that waits for one of its commands' replies holds that
//! loop, so a request that arrives while a call waits is answered only after the reply
//! (then all of them, in arrival order); between calls it answers as they come
//! ([`RawVmm::serve_idle`]).
#![allow(dead_code)]

use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use crate::common::raw_client::{Msg, RawClient};
use umdev::protocol::dma_map::DmaMapRequest;
use umdev::protocol::region_access::RegionAccess;
use umdev::protocol::{dma_rw, Command, FLAGS_TYPE_COMMAND, FLAGS_TYPE_MASK};

/// How the VMM answers the device's requests.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Answer {
    /// Serve them from the buffer.
    Honest,
    /// Reply EFAULT.
    Errors,
    /// Never reply (the server's remote_dma_timeout must fire).
    Silent,
}

pub struct RawVmm {
    pub c: RawClient,
    pub answer: Answer,
    /// The fd-less memory at `base`.
    pub mem: Vec<u8>,
    pub base: u64,
    /// Requests received so far.
    pub requests: u32,
    /// Every request received, as (command, iova, count), in arrival order.
    pub log: Vec<(u16, u64, u64)>,
    /// Answer requests that arrive during a call only after its reply (like QEMU).
    pub defer: bool,
    /// Requests received and not answered yet (`defer`, or [`RawVmm::hold_request`]).
    pub deferred: Vec<Msg>,
}

impl RawVmm {
    pub fn new(c: RawClient, base: u64, size: usize) -> RawVmm {
        RawVmm {
            c,
            answer: Answer::Honest,
            mem: vec![0; size],
            base,
            requests: 0,
            log: Vec::new(),
            defer: false,
            deferred: Vec::new(),
        }
    }

    /// Like QEMU: requests that arrive during a call are answered after its reply.
    pub fn qemu_like(mut self) -> RawVmm {
        self.defer = true;
        // Long enough to see a server that makes a reply wait for a 5 s remote timeout.
        self.c
            .stream
            .set_read_timeout(Some(Duration::from_secs(15)))
            .unwrap();
        self
    }

    /// Read messages, serving device requests, until the reply to our command arrives.
    pub fn pump(&mut self) -> Msg {
        loop {
            let m = self.c.recv();
            if m.header.flags & FLAGS_TYPE_MASK != FLAGS_TYPE_COMMAND {
                return m;
            }
            self.note(&m);
            if self.defer {
                self.deferred.push(m);
            } else {
                self.answer_one(&m);
            }
        }
    }

    /// Count and log a request from the device.
    fn note(&mut self, m: &Msg) {
        let (iova, count, _) = dma_rw::decode_dma_rw_request(&m.payload).unwrap();
        self.requests += 1;
        self.log.push((m.header.command, iova, count));
    }

    /// Receive the next message, which must be a request from the device, and leave it
    /// unanswered in `deferred` (answered by the next call, after its reply, or by
    /// [`RawVmm::answer_deferred`]). Returns (command, iova, count).
    pub fn hold_request(&mut self) -> (u16, u64, u64) {
        let m = self.c.recv();
        assert_eq!(
            m.header.flags & FLAGS_TYPE_MASK,
            FLAGS_TYPE_COMMAND,
            "expected a request from the device, got a reply to {}",
            m.header.msg_id
        );
        self.note(&m);
        self.deferred.push(m);
        *self.log.last().unwrap()
    }

    /// Answer every deferred request, oldest first.
    pub fn answer_deferred(&mut self) {
        for m in std::mem::take(&mut self.deferred) {
            self.answer_one(&m);
        }
    }

    /// Idle main loop: answer requests as they arrive, for `d` or until `done` holds.
    pub fn serve_idle(&mut self, d: Duration, mut done: impl FnMut(&RawVmm) -> bool) {
        let deadline = Instant::now() + d;
        while !done(self) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            if !umdev::server::socket_io::wait_readable(&self.c.stream, left).unwrap() {
                return;
            }
            let m = self.c.recv();
            assert_eq!(
                m.header.flags & FLAGS_TYPE_MASK,
                FLAGS_TYPE_COMMAND,
                "unexpected reply to {} while idle",
                m.header.msg_id
            );
            self.note(&m);
            self.answer_one(&m);
        }
    }

    /// Answer one request per `answer`.
    fn answer_one(&mut self, m: &Msg) {
        let (iova, count, data) = dma_rw::decode_dma_rw_request(&m.payload).unwrap();
        let off = (iova - self.base) as usize;
        let count = count as usize;
        match self.answer {
            Answer::Silent => {}
            Answer::Errors => self.c.reply_error(&m.header, libc::EFAULT),
            Answer::Honest if m.header.command == Command::DmaRead as u16 => {
                let mut p = dma_rw::encode_dma_read(iova, count as u64);
                p.extend_from_slice(&self.mem[off..off + count]);
                self.c.reply(&m.header, &p);
            }
            Answer::Honest => {
                self.mem[off..off + count].copy_from_slice(data);
                self.c.reply(&m.header, &[]);
            }
        }
    }

    /// Send a command, serve requests meanwhile (after the reply with `defer`), return its
    /// reply.
    pub fn call(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Msg {
        let id = self.c.send(cmd as u16, 0, payload, fds);
        let m = self.pump();
        assert_eq!(m.header.msg_id, id, "reply to another message");
        if self.defer {
            self.answer_deferred();
        }
        m
    }

    /// A posted 32-bit register write (No_reply, as QEMU sends MMIO writes): nobody waits.
    pub fn write32_posted(&mut self, region: u32, off: u64, v: u32) {
        self.c.region_write(
            region,
            off,
            &v.to_le_bytes(),
            umdev::protocol::FLAGS_NO_REPLY,
        );
    }

    /// A fresh non-blocking eventfd attached as the trigger of vector 0 of IRQ `index`.
    pub fn attach_eventfd(&mut self, index: u32) -> vmm_sys_util::eventfd::EventFd {
        use vfio_bindings::bindings::vfio::{
            VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD,
        };
        let efd = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)
            .expect("eventfd");
        let flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
        let p = umdev::protocol::set_irqs::encode_set_irqs(flags, index, 0, 1, &[]);
        let m = self.call(Command::DeviceSetIrqs, &p, &[efd.as_raw_fd()]);
        assert!(!m.header.is_error(), "SET_IRQS errno {}", m.header.error);
        efd
    }

    /// DMA_MAP read-write, with an fd or fd-less; the errno.
    pub fn map(&mut self, iova: u64, size: u64, fd: Option<RawFd>) -> u32 {
        let p = DmaMapRequest {
            flags: 3,
            offset: 0,
            iova,
            size,
        }
        .encode();
        let fds: Vec<RawFd> = fd.into_iter().collect();
        self.call(Command::DmaMap, &p, &fds).header.error
    }

    fn access(&mut self, region: u32, off: u64, write: Option<&[u8]>, count: u32) -> Msg {
        let a = RegionAccess {
            offset: off,
            region,
            count,
        };
        let mut p = a.encode();
        let cmd = match write {
            Some(d) => {
                p.extend_from_slice(d);
                Command::RegionWrite
            }
            None => Command::RegionRead,
        };
        let m = self.call(cmd, &p, &[]);
        assert!(
            !m.header.is_error(),
            "region {region} offset {off:#x}: errno {}",
            m.header.error
        );
        m
    }

    pub fn read32(&mut self, region: u32, off: u64) -> u32 {
        let m = self.access(region, off, None, 4);
        u32::from_le_bytes(m.payload[16..20].try_into().unwrap())
    }

    pub fn write(&mut self, region: u32, off: u64, data: &[u8]) {
        self.access(region, off, Some(data), data.len() as u32);
    }

    pub fn write32(&mut self, region: u32, off: u64, v: u32) {
        self.write(region, off, &v.to_le_bytes());
    }
}
