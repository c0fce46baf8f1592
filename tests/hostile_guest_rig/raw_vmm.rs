//! A raw-client VMM that serves the device's DMA_READ/DMA_WRITE requests for one fd-less
//! mapping from its own buffer, honestly, with error replies, or not at all. Needs the
//! including test crate to declare `mod common;` (tests/common).
#![allow(dead_code)]

use std::os::fd::RawFd;

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
        }
    }

    /// Read messages, serving device requests, until the reply to our command arrives.
    pub fn pump(&mut self) -> Msg {
        loop {
            let m = self.c.recv();
            if m.header.flags & FLAGS_TYPE_MASK != FLAGS_TYPE_COMMAND {
                return m;
            }
            let (iova, count, data) = dma_rw::decode_dma_rw_request(&m.payload).unwrap();
            let off = (iova - self.base) as usize;
            let count = count as usize;
            self.requests += 1;
            self.log.push((m.header.command, iova, count as u64));
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
    }

    /// Send a command, serve requests meanwhile, return its reply.
    pub fn call(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> Msg {
        let id = self.c.send(cmd as u16, 0, payload, fds);
        let m = self.pump();
        assert_eq!(m.header.msg_id, id, "reply to another message");
        m
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
