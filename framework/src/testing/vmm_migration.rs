//! The [`Vmm`]'s side of migration: DEVICE_FEATURE MIGRATION and MIG_DEVICE_STATE,
//! MIG_DATA_READ/WRITE (single messages and whole-stream loops in pieces of the
//! negotiated transfer size), and DMA logging start/stop/report, for tests and for a
//! VMM-side migration driver. Errors from the server come back as `io::Error`s carrying
//! their errno.

use std::io;

use vfio_bindings::bindings::vfio::{
    VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
    VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, VFIO_DEVICE_FEATURE_GET, VFIO_DEVICE_FEATURE_MIGRATION,
    VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, VFIO_DEVICE_FEATURE_PROBE, VFIO_DEVICE_FEATURE_SET,
};

use crate::migration::MigState;
use crate::protocol::feature::{encode_feature, FEATURE_HEADER_SIZE};
use crate::protocol::migration::{
    decode_mig_data_reply, encode_mig_data, encode_mig_data_read, encode_mig_state_data,
    MIG_DATA_HEADER_SIZE,
};
use crate::protocol::wire::{Put, Reader};
use crate::protocol::Command;

use super::raw_client::Msg;
use super::vmm::Vmm;

/// [`super::DEFAULT_CAPS`] plus a `migration` object, as a migrating VMM proposes it.
pub const MIGRATION_CAPS: &str = "{\"capabilities\":{\"max_msg_fds\":16,\"max_data_xfer_size\":1048576,\"pgsizes\":4096,\"max_dma_maps\":65535,\"migration\":{\"pgsize\":4096,\"max_bitmap_size\":1048576},\"write_multiple\":true}}";

fn errno_of(m: &Msg) -> io::Result<()> {
    if m.header.is_error() {
        return Err(io::Error::from_raw_os_error(m.header.error as i32));
    }
    Ok(())
}

fn bad(e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl Vmm {
    /// DEVICE_FEATURE with `argsz`, `flags` and `data`; the reply payload (an error reply
    /// is an error with its errno).
    pub fn feature(&mut self, argsz: u32, flags: u32, data: &[u8]) -> io::Result<Vec<u8>> {
        let m = self.call(
            Command::DeviceFeature,
            &encode_feature(argsz, flags, data),
            &[],
        )?;
        errno_of(&m)?;
        Ok(m.payload)
    }

    /// PROBE of `feature` with the operation bits `ops` (GET/SET).
    pub fn probe_feature(&mut self, feature: u32, ops: u32) -> io::Result<()> {
        self.feature(8, VFIO_DEVICE_FEATURE_PROBE | ops | feature, &[])
            .map(drop)
    }

    /// MIGRATION GET: the `VFIO_MIGRATION_*` flags the device offers.
    pub fn migration_flags(&mut self) -> io::Result<u64> {
        let p = self.feature(
            16,
            VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_MIGRATION,
            &[],
        )?;
        let mut r = Reader::new(
            p.get(FEATURE_HEADER_SIZE..).unwrap_or_default(),
            "MIGRATION",
        );
        r.u64().map_err(bad)
    }

    /// MIG_DEVICE_STATE GET.
    pub fn mig_state(&mut self) -> io::Result<MigState> {
        let p = self.feature(
            16,
            VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE,
            &[],
        )?;
        Self::state_of(&p)
    }

    fn state_of(p: &[u8]) -> io::Result<MigState> {
        let mut r = Reader::new(
            p.get(FEATURE_HEADER_SIZE..).unwrap_or_default(),
            "MIG_DEVICE_STATE",
        );
        let raw = r.u32().map_err(bad)?;
        MigState::from_u32(raw).ok_or_else(|| bad(format!("device_state {raw}")))
    }

    /// MIG_DEVICE_STATE SET of a raw state value; the state the reply reports.
    pub fn set_mig_state_raw(&mut self, raw: u32) -> io::Result<MigState> {
        let p = self.feature(
            16,
            VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE,
            &encode_mig_state_data(raw),
        )?;
        Self::state_of(&p)
    }

    /// MIG_DEVICE_STATE SET to `s`.
    pub fn set_mig_state(&mut self, s: MigState) -> io::Result<()> {
        let got = self.set_mig_state_raw(s as u32)?;
        if got != s {
            return Err(bad(format!("set {s:?}, the reply says {got:?}")));
        }
        Ok(())
    }

    /// One MIG_DATA_READ of up to `size` bytes; the data (shorter: no more for now).
    pub fn mig_data_read(&mut self, size: u32) -> io::Result<Vec<u8>> {
        let m = self.call(Command::MigDataRead, &encode_mig_data_read(size), &[])?;
        errno_of(&m)?;
        let data = decode_mig_data_reply(&m.payload).map_err(bad)?;
        if data.len() > size as usize {
            return Err(bad(format!("{} bytes for a read of {size}", data.len())));
        }
        // libvfio-user's clients read exactly 8 + size bytes (protocol-docs/migration.md).
        if m.payload.len() != MIG_DATA_HEADER_SIZE + size as usize {
            return Err(bad(format!(
                "a reply of {} bytes to a read of {size}: not padded to 8 + {size}",
                m.payload.len()
            )));
        }
        Ok(data.to_vec())
    }

    /// Read until a short read, in pieces of the negotiated transfer size: one PRE_COPY
    /// round, or the rest of the stream in STOP_COPY.
    pub fn mig_read_all(&mut self) -> io::Result<Vec<u8>> {
        let piece = self.max_data_xfer_size();
        let mut out = Vec::new();
        loop {
            let d = self.mig_data_read(piece)?;
            let short = d.len() < piece as usize;
            out.extend_from_slice(&d);
            if short {
                return Ok(out);
            }
        }
    }

    /// One MIG_DATA_WRITE of `data`.
    pub fn mig_data_write(&mut self, data: &[u8]) -> io::Result<()> {
        let m = self.call(Command::MigDataWrite, &encode_mig_data(data), &[])?;
        errno_of(&m)
    }

    /// Write `data` in pieces of the negotiated transfer size.
    pub fn mig_write_all(&mut self, data: &[u8]) -> io::Result<()> {
        let piece = self.max_data_xfer_size() as usize;
        for c in data.chunks(piece.max(1)) {
            self.mig_data_write(c)?;
        }
        Ok(())
    }

    /// DMA_LOGGING_START at `page_size` over `ranges` (iova, length; empty = all).
    pub fn dirty_start(&mut self, page_size: u64, ranges: &[(u64, u64)]) -> io::Result<()> {
        let mut d = Vec::with_capacity(16 + 16 * ranges.len());
        d.put_u64(page_size);
        d.put_u32(ranges.len() as u32);
        d.put_u32(0);
        for &(iova, len) in ranges {
            d.put_u64(iova);
            d.put_u64(len);
        }
        let argsz = (FEATURE_HEADER_SIZE + d.len()) as u32;
        self.feature(
            argsz,
            VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
            &d,
        )
        .map(drop)
    }

    /// DMA_LOGGING_STOP.
    pub fn dirty_stop(&mut self) -> io::Result<()> {
        self.feature(
            8,
            VFIO_DEVICE_FEATURE_SET | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP,
            &[],
        )
        .map(drop)
    }

    /// DMA_LOGGING_REPORT of `[iova, iova + length)` at `page_size`: the dirty bitmap (bit
    /// n of word n / 64 is page n), cleared on the server as it is reported.
    pub fn dirty_report(&mut self, iova: u64, length: u64, page_size: u64) -> io::Result<Vec<u64>> {
        let pages = length.div_ceil(page_size.max(1));
        let bitmap = usize::try_from(pages.div_ceil(64) * 8)
            .map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?;
        let mut d = Vec::with_capacity(24);
        d.put_u64(iova);
        d.put_u64(length);
        d.put_u64(page_size);
        let argsz = u32::try_from(FEATURE_HEADER_SIZE + d.len() + bitmap)
            .map_err(|_| io::Error::from_raw_os_error(libc::E2BIG))?;
        let p = self.feature(
            argsz,
            VFIO_DEVICE_FEATURE_GET | VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT,
            &d,
        )?;
        let bits = p
            .get(FEATURE_HEADER_SIZE + 24..)
            .filter(|b| b.len() == bitmap)
            .ok_or_else(|| bad(format!("a report of {} bytes", p.len())))?;
        Ok(bits
            .chunks_exact(8)
            .map(|w| u64::from_ne_bytes(w.try_into().unwrap_or([0; 8])))
            .collect())
    }
}
