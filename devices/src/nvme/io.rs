//! NVM command set I/O commands on namespace 1: Read, Write, Flush, Write Zeroes,
//! Dataset Management (deallocate).
//!
//! A Read or Write checks the namespace, the LBA range and the transfer size (MDTS)
//! first, walks the PRPs into one page array, then moves the data between the image and
//! the pinned guest pages with `preadv`/`pwritev` on the pins, no bounce buffer
//! ([`super::data`]; fd-less memory goes through a buffer). A failure of the host file
//! is logged and becomes a media or internal error status ([`super::namespace::io_status`]).

use std::sync::atomic::Ordering::Relaxed;

use super::ctrl::Shared;
use super::data::ImageIoError;
use super::namespace::{io_status, BLOCK_SIZE};
use super::prp;
use super::queues::Sq;
use super::spec::{io_op, Command, Status};
use super::worker::Outcome;

/// Run I/O command `cmd` fetched from `sq`.
pub fn execute(shared: &Shared, sq: &Sq, cmd: &Command) -> Outcome {
    if cmd.fuse() != 0 || cmd.psdt() != 0 {
        return Outcome::err(Status::INVALID_FIELD);
    }
    let status = match cmd.opcode {
        io_op::FLUSH => {
            if cmd.nsid != 1 && cmd.nsid != 0xffff_ffff {
                return Outcome::err(Status::INVALID_NAMESPACE);
            }
            host(shared.ns.flush(), "flush", true, shared)
        }
        io_op::READ | io_op::WRITE | io_op::WRITE_ZEROES | io_op::DSM if cmd.nsid != 1 => {
            Status::INVALID_NAMESPACE
        }
        io_op::READ => rw(shared, sq, cmd, false),
        io_op::WRITE => rw(shared, sq, cmd, true),
        io_op::WRITE_ZEROES => match lba_range(shared, cmd) {
            Ok((off, len)) => host(
                shared.ns.write_zeroes(off, len),
                "write zeroes",
                true,
                shared,
            ),
            Err(s) => s,
        },
        io_op::DSM => dsm(shared, sq, cmd),
        op => {
            tracing::debug!(op, "nvme: unsupported I/O opcode");
            Status::INVALID_OPCODE
        }
    };
    Outcome::err(status)
}

/// The byte range of SLBA (CDW10-11) and NLB (CDW12 15:0, 0-based).
fn lba_range(shared: &Shared, cmd: &Command) -> Result<(u64, u64), Status> {
    let slba = u64::from(cmd.dw(10)) | u64::from(cmd.dw(11)) << 32;
    let nlb = u64::from(cmd.dw(12) & 0xffff) + 1;
    shared.ns.range(slba, nlb).ok_or(Status::LBA_OUT_OF_RANGE)
}

/// The status of a host file operation, logged when it failed.
fn host(r: std::io::Result<()>, what: &str, write: bool, shared: &Shared) -> Status {
    match r {
        Ok(()) => Status::SUCCESS,
        Err(e) => {
            tracing::error!("nvme: image {what} failed: {e}");
            shared.counters.media_errors.fetch_add(1, Relaxed);
            io_status(&e, write)
        }
    }
}

fn rw(shared: &Shared, sq: &Sq, cmd: &Command, write: bool) -> Status {
    let (off, len) = match lba_range(shared, cmd) {
        Ok(r) => r,
        Err(s) => return s,
    };
    let max = shared.limits.max_transfer();
    let t = match prp::walk(cmd.prp1, cmd.prp2, len, max, |a, b| shared.dma.read(a, b)) {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(qid = sq.params.id, cid = cmd.cid, "nvme: {e}");
            return e.status();
        }
    };
    let data = shared.data_path(sq);
    let c = &shared.counters;
    let what = if write { "write" } else { "read" };
    let mut s = match data.image(&t, &shared.ns, off, !write) {
        Ok(()) => Status::SUCCESS,
        Err(ImageIoError::Dma(e)) => {
            tracing::warn!(qid = sq.params.id, cid = cmd.cid, "nvme: {what} data: {e}");
            return Status::DATA_TRANSFER_ERROR;
        }
        Err(ImageIoError::Host(e)) => host(Err(e), what, write, shared),
    };
    // FUA: on stable storage before the completion.
    if write && s.is_success() && cmd.dw(12) & (1 << 30) != 0 {
        s = host(shared.ns.flush(), "flush", true, shared);
    }
    if s.is_success() {
        if write {
            c.writes.fetch_add(1, Relaxed);
            c.blocks_written.fetch_add(len / BLOCK_SIZE, Relaxed);
        } else {
            c.reads.fetch_add(1, Relaxed);
            c.blocks_read.fetch_add(len / BLOCK_SIZE, Relaxed);
        }
    }
    s
}

/// Dataset Management: with AD, deallocate each range (advisory: a range the filesystem
/// cannot punch is left as it is); without, nothing to do.
fn dsm(shared: &Shared, sq: &Sq, cmd: &Command) -> Status {
    let ranges = u64::from(cmd.dw(10) & 0xff) + 1;
    let len = ranges * 16;
    let t = match prp::walk(cmd.prp1, cmd.prp2, len, len, |a, b| shared.dma.read(a, b)) {
        Ok(t) => t,
        Err(e) => return e.status(),
    };
    let mut buf = vec![0u8; len as usize];
    if let Err(e) = shared.data_path(sq).from_guest(&t, &mut buf) {
        tracing::warn!(qid = sq.params.id, cid = cmd.cid, "nvme: DSM ranges: {e}");
        return Status::DATA_TRANSFER_ERROR;
    }
    let deallocate = cmd.dw(11) & (1 << 2) != 0;
    let mut todo = Vec::with_capacity(ranges as usize);
    for r in buf.chunks_exact(16) {
        let nlb = u64::from(u32::from_le_bytes([r[4], r[5], r[6], r[7]]));
        let slba = u64::from_le_bytes([r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15]]);
        match shared.ns.range(slba, nlb) {
            Some(range) => todo.push(range),
            None => return Status::LBA_OUT_OF_RANGE,
        }
    }
    if deallocate {
        for (off, n) in todo.into_iter().filter(|&(_, n)| n > 0) {
            if let Err(e) = shared.ns.punch(off, n) {
                tracing::debug!("nvme: deallocate of {n} bytes at {off:#x} skipped: {e}");
            }
        }
    }
    Status::SUCCESS
}
