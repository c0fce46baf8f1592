//! Handlers of the individual commands: DMA map/unmap to the [`crate::dma::DmaSpace`],
//! region/IRQ/reset to the device (after bounds checks), DMA logging to the dirty log.

use std::os::fd::{FromRawFd, IntoRawFd, OwnedFd};

use tracing::{debug, warn};
use vmm_sys_util::eventfd::EventFd;

use super::connection::{lock_device, Connection, Reply};
use super::ServerError;
use crate::device::{IrqData, SetIrqs, REGION_FLAG_MMAP, REGION_FLAG_READ, REGION_FLAG_WRITE};
use crate::dma::{DmaMapping, Prot};
use crate::protocol::device_info::{
    encode_device_info, encode_irq_info, RegionInfoReply, RegionInfoRequest, RegionIoFdsRequest,
};
use crate::protocol::dma_map::{
    DmaMapRequest, DmaUnmapRequest, DMA_MAP_FLAG_READ, DMA_MAP_FLAG_WRITE,
};
use crate::protocol::feature::FeatureRequest;
use crate::protocol::region_access::{encode_write_multi_reply, RegionAccess, WriteOne};
use crate::protocol::set_irqs::{SetIrqsData, SetIrqsRequest};
use crate::protocol::wire::Put;

impl Connection {
    fn check_access(
        &self,
        region: u32,
        offset: u64,
        count: u32,
        need: u32,
    ) -> Result<(), ServerError> {
        let n = self.info.regions.len();
        let r = self.info.regions.get(region as usize).ok_or_else(|| {
            ServerError::OutOfRange(format!("region {region} does not exist (device has {n})"))
        })?;
        let end = offset
            .checked_add(count as u64)
            .ok_or_else(|| ServerError::OutOfRange(format!("offset {offset:#x} wraps")))?;
        if end > r.size {
            return Err(ServerError::OutOfRange(format!(
                "access {offset:#x}+{count} is beyond region {region} (size {:#x})",
                r.size
            )));
        }
        if r.flags & need == 0 {
            let what = if need == REGION_FLAG_READ {
                "readable"
            } else {
                "writable"
            };
            return Err(ServerError::OutOfRange(format!(
                "region {region} is not {what}"
            )));
        }
        Ok(())
    }

    pub(super) fn dma_map(
        &mut self,
        m: DmaMapRequest,
        fds: Vec<OwnedFd>,
    ) -> Result<Reply, ServerError> {
        let prot = Prot {
            read: m.flags & DMA_MAP_FLAG_READ != 0,
            write: m.flags & DMA_MAP_FLAG_WRITE != 0,
        };
        let max = self.config.max_dma_mapped_bytes;
        if self
            .mapped_bytes
            .checked_add(m.size)
            .is_none_or(|total| total > max)
        {
            warn!(
                "DMA_MAP iova={:#x} size={:#x} rejected: mapped-bytes budget",
                m.iova, m.size
            );
            return Err(ServerError::DmaBudget {
                size: m.size,
                mapped: self.mapped_bytes,
                max,
            });
        }
        let fd = fds.into_iter().next();
        let has_fd = fd.is_some();
        let mapping = DmaMapping {
            iova: m.iova,
            size: m.size,
            prot,
            fd,
            offset: if has_fd { m.offset } else { 0 },
        };
        match self.dma.map(mapping) {
            Ok(()) => {
                self.mapped_bytes += m.size;
                debug!(
                    iova = format_args!("{:#x}", m.iova),
                    size = format_args!("{:#x}", m.size),
                    fd = has_fd,
                    "DMA_MAP"
                );
                Ok(Reply::empty())
            }
            Err(source) => Err(ServerError::DmaRejected {
                iova: m.iova,
                size: m.size,
                source,
            }),
        }
    }

    /// DMA_UNMAP: the DMA layer removes every mapping the range covers (type1v2, see
    /// `DmaSpace::unmap`); the budget shrinks by the bytes removed and the reply's size field
    /// says how many that was.
    pub(super) fn dma_unmap(&mut self, u: DmaUnmapRequest) -> Result<Reply, ServerError> {
        let mut dev = lock_device(&self.device);
        let report = if u.is_all() {
            self.dma
                .unmap_all(&mut |iova, size| dev.dma_unmap(iova, size))
        } else {
            self.dma
                .unmap(u.iova, u.size, &mut |iova, size| dev.dma_unmap(iova, size))
                .map_err(|source| ServerError::DmaRejected {
                    iova: u.iova,
                    size: u.size,
                    source,
                })?
        };
        self.mapped_bytes = self.mapped_bytes.saturating_sub(report.bytes_removed);
        debug!(
            all = u.is_all(),
            iova = format_args!("{:#x}", u.iova),
            size = format_args!("{:#x}", u.size),
            maps = report.maps_removed,
            bytes = format_args!("{:#x}", report.bytes_removed),
            "DMA_UNMAP"
        );
        if report.leftover_pins > 0 {
            warn!(
                leftover_pins = report.leftover_pins,
                "DMA_UNMAP iova={:#x} size={:#x}: device left pins behind; force-released",
                u.iova,
                u.size
            );
        }
        Ok(Reply::from_payload(&u.encode_reply(report.bytes_removed)))
    }

    pub(super) fn device_info(&mut self) -> Reply {
        self.info = lock_device(&self.device).info();
        Reply::from_payload(&encode_device_info(
            self.info.flags,
            self.info.regions.len() as u32,
            self.info.irqs.len() as u32,
        ))
    }

    pub(super) fn region_info(&mut self, r: RegionInfoRequest) -> Result<Reply, ServerError> {
        self.info = lock_device(&self.device).info();
        let n = self.info.regions.len();
        let region = self.info.regions.get(r.index as usize).ok_or_else(|| {
            ServerError::OutOfRange(format!(
                "region {} does not exist (device has {n})",
                r.index
            ))
        })?;
        let mut flags = region.flags & (REGION_FLAG_READ | REGION_FLAG_WRITE);
        let mut info = RegionInfoReply {
            index: r.index,
            size: region.size,
            ..Default::default()
        };
        let mut fd = None;
        if let Some(m) = &region.mmap {
            info.offset = m.file_offset;
            // No areas named: the whole region (what MMAP without the capability means in
            // VFIO), sent as one area like libvfio-user's server does, so the fd always
            // travels with a capability and never with the short reply.
            let whole = [(0, region.size)];
            let areas = if m.areas.is_empty() {
                &whole[..]
            } else {
                &m.areas
            };
            for &(off, size) in areas {
                let inside = off
                    .checked_add(size)
                    .is_some_and(|end| size > 0 && end <= region.size);
                if inside {
                    info.sparse_areas.push((off, size));
                } else {
                    warn!(
                        region = r.index,
                        "device reports sparse mmap area {off:#x}+{size:#x} outside the region; not offered"
                    );
                }
            }
            if info.sparse_areas.is_empty() {
                warn!(
                    region = r.index,
                    "no valid sparse mmap area; region offered without MMAP"
                );
            } else {
                flags |= REGION_FLAG_MMAP;
                fd = Some(m.fd.clone());
            }
        }
        info.flags = flags;
        let mut reply = Reply::from_payload(&info.encode(r.argsz));
        if let Some(fd) = fd.filter(|_| info.fd_goes_with(r.argsz)) {
            reply.attach(fd);
        }
        Ok(reply)
    }

    pub(super) fn region_io_fds(&mut self, r: RegionIoFdsRequest) -> Result<Reply, ServerError> {
        if r.index as usize >= self.info.regions.len() {
            return Err(ServerError::OutOfRange(format!(
                "region {} does not exist",
                r.index
            )));
        }
        Ok(Reply::from_payload(&r.encode_empty_reply()))
    }

    pub(super) fn irq_info(&mut self, index: u32) -> Result<Reply, ServerError> {
        let irq = self.info.irqs.get(index as usize).ok_or_else(|| {
            ServerError::OutOfRange(format!(
                "IRQ index {index} does not exist (device has {})",
                self.info.irqs.len()
            ))
        })?;
        Ok(Reply::from_payload(&encode_irq_info(
            irq.flags, index, irq.count,
        )))
    }

    pub(super) fn set_irqs(
        &mut self,
        s: SetIrqsRequest,
        fds: Vec<OwnedFd>,
    ) -> Result<Reply, ServerError> {
        let irq = self.info.irqs.get(s.index as usize).ok_or_else(|| {
            ServerError::OutOfRange(format!("IRQ index {} does not exist", s.index))
        })?;
        // start + count cannot wrap: the protocol layer checked it.
        if s.count > 0 && s.start + s.count > irq.count {
            return Err(ServerError::OutOfRange(format!(
                "IRQ vectors {}..{} beyond index {} (count {})",
                s.start,
                s.start + s.count,
                s.index,
                irq.count
            )));
        }
        let data = match s.data {
            SetIrqsData::None => IrqData::None,
            SetIrqsData::Bool(b) => IrqData::Bool(b),
            SetIrqsData::Eventfd { nfds: 0 } => {
                IrqData::Eventfd((0..s.count).map(|_| None).collect())
            }
            SetIrqsData::Eventfd { .. } => IrqData::Eventfd(
                fds.into_iter()
                    .map(|fd| {
                        // SAFETY: the fd was received with SCM_RIGHTS and is owned by us alone;
                        // into_raw_fd hands that ownership to the EventFd.
                        Some(unsafe { EventFd::from_raw_fd(fd.into_raw_fd()) })
                    })
                    .collect(),
            ),
        };
        lock_device(&self.device)
            .set_irqs(SetIrqs {
                index: s.index,
                start: s.start,
                count: s.count,
                action: s.action,
                data,
            })
            .map_err(ServerError::Device)?;
        Ok(Reply::empty())
    }

    pub(super) fn region_read(&mut self, a: RegionAccess) -> Result<Reply, ServerError> {
        self.check_access(a.region, a.offset, a.count, REGION_FLAG_READ)?;
        let mut reply = self.reply(16 + a.count as usize);
        let buf = reply.buf_mut();
        a.put(buf);
        let start = buf.len();
        buf.resize(start + a.count as usize, 0);
        lock_device(&self.device)
            .region_read(a.region, a.offset, &mut buf[start..])
            .map_err(ServerError::Device)?;
        Ok(reply)
    }

    pub(super) fn region_write(
        &mut self,
        a: RegionAccess,
        data: &[u8],
    ) -> Result<Reply, ServerError> {
        self.check_access(a.region, a.offset, a.count, REGION_FLAG_WRITE)?;
        lock_device(&self.device)
            .region_write(a.region, a.offset, data)
            .map_err(ServerError::Device)?;
        // The reply is the access header without the data.
        let mut reply = self.reply(16);
        a.put(reply.buf_mut());
        Ok(reply)
    }

    pub(super) fn region_write_multi(&mut self, ws: &[WriteOne]) -> Result<Reply, ServerError> {
        for w in ws {
            self.check_access(
                w.access.region,
                w.access.offset,
                w.access.count,
                REGION_FLAG_WRITE,
            )?;
        }
        let mut dev = lock_device(&self.device);
        for w in ws {
            dev.region_write(w.access.region, w.access.offset, w.bytes())
                .map_err(ServerError::Device)?;
        }
        Ok(Reply::from_payload(&encode_write_multi_reply(
            ws.len() as u64
        )))
    }

    /// DEVICE_RESET. The device's reset may wait for its threads to stop, and one of them
    /// may be waiting for the client (DMA to fd-less memory), which QEMU does not answer
    /// while it waits for this reply: the reset runs with every server→client request
    /// cancelled and new ones refused (ECANCELED to the device), so the reply never waits
    /// for the client and no request from before the reset reaches it after the reply.
    pub(super) fn reset(&mut self) -> Result<Reply, ServerError> {
        let _held = self.chan.hold_requests("DEVICE_RESET in progress");
        let mut dev = lock_device(&self.device);
        dev.reset().map_err(ServerError::Device)?;
        self.info = dev.info();
        drop(dev);
        // A device stopped for migration runs again, in RUNNING (the only way out of ERROR).
        self.migration_after_reset()?;
        Ok(Reply::empty())
    }

    pub(super) fn feature(
        &mut self,
        f: FeatureRequest,
        payload: &[u8],
    ) -> Result<Reply, ServerError> {
        match f {
            FeatureRequest::Probe => Ok(Reply::from_payload(payload)),
            FeatureRequest::MigrationProbe
            | FeatureRequest::Migration
            | FeatureRequest::MigStateGet
            | FeatureRequest::MigStateSet(_) => self.migration_feature(f, payload),
            FeatureRequest::LoggingStart { page_size, ranges } => {
                self.dma
                    .dirty_start(page_size, &ranges)
                    .map_err(ServerError::Dma)?;
                debug!(page_size, ranges = ranges.len(), "DMA logging started");
                Ok(Reply::from_payload(payload))
            }
            FeatureRequest::LoggingStop => {
                self.dma.dirty_stop();
                debug!("DMA logging stopped");
                Ok(Reply::from_payload(payload))
            }
            FeatureRequest::LoggingReport {
                iova,
                length,
                page_size,
                bitmap_len,
            } => {
                let mut bitmap = vec![0u8; bitmap_len];
                self.dma
                    .dirty_report(iova, length, page_size, &mut bitmap)
                    .map_err(ServerError::Dma)?;
                let mut reply = Reply::with_capacity(payload.len() + bitmap_len);
                let buf = reply.buf_mut();
                buf.put_u32((payload.len() + bitmap_len) as u32);
                buf.extend_from_slice(&payload[4..]);
                buf.extend_from_slice(&bitmap);
                Ok(reply)
            }
        }
    }
}
