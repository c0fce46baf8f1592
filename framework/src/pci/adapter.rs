//! [`PciAdapter`]: serves a [`PciDevice`] as a vfio-user [`Device`].
//!
//! The adapter owns config space (region 7), routes BAR accesses (shared memory, the MSI-X
//! table and PBA, or the device), reports regions and IRQs, applies SET_IRQS and keeps the
//! interrupt state that the device's [`Interrupts`] handle delivers through.
//!
//! It also drives the DMA space's Bus Master switch ([`DmaSpace::set_bus_master`]) from the
//! command register's BUS_MASTER bit: at attach (the reset value, clear), after every config
//! write and after reset, so a device whose guest cleared BME cannot touch guest memory, no
//! matter how the device is written. A change is logged at info level once. The same bit
//! gates MSI/MSI-X delivery in the interrupt state (an MSI is a memory write).

use std::sync::Arc;

use super::bar::{self, BarPart, BarRanges};
use super::config_space::{command, reg, status, ConfigSpace, CONFIG_SIZE};
use super::header::{self, CapLayout};
use super::msix::{self, MsixTable};
use super::validate::validate;
use super::{BarSpec, PciConfig, PciDevice};
use crate::device::{
    irq_index, region_index, Device, DeviceError, DeviceInfo, IrqInfo, RegionInfo, RegionMmap,
    SetIrqs, DEVICE_FLAGS_PCI, DEVICE_FLAGS_RESET, IRQ_INFO_AUTOMASKED, IRQ_INFO_EVENTFD,
    IRQ_INFO_MASKABLE, IRQ_INFO_NORESIZE, REGION_FLAG_MMAP, REGION_FLAG_READ, REGION_FLAG_WRITE,
};
use crate::dma::{DmaHandle, DmaSpace};
use crate::irq::state::IrqState;
use crate::irq::Interrupts;
use crate::migration::{Migrate, MigrationCaps};

mod migration;

/// One declared BAR and the framework-emulated ranges inside it.
#[derive(Debug)]
struct Bar {
    spec: BarSpec,
    ranges: BarRanges,
}

/// Serves a [`PciDevice`] as a vfio-user [`Device`].
pub struct PciAdapter<D: PciDevice> {
    dev: D,
    config: PciConfig,
    space: ConfigSpace,
    caps: CapLayout,
    bars: [Option<Bar>; 6],
    msix_table: Option<MsixTable>,
    irq: Arc<IrqState>,
    /// The DMA space the device got at attach; its Bus Master switch follows the command
    /// register.
    dma: Option<Arc<DmaSpace>>,
    /// What the device's [`PciDevice::migration`] offered when the adapter was built
    /// (`None`: the device does not migrate).
    mig_caps: Option<MigrationCaps>,
    /// The device's [`Migrate::max_state_size`](crate::migration::Migrate::max_state_size)
    /// when the adapter was built.
    mig_max_state: u64,
}

impl<D: PciDevice> std::fmt::Debug for PciAdapter<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PciAdapter")
            .field("space", &self.space)
            .field("bars", &self.bars)
            .field("irq", &self.irq)
            .finish_non_exhaustive()
    }
}

/// What made the adapter re-read BUS_MASTER (for the log line of a change).
#[derive(Clone, Copy, Debug)]
enum BmeCause {
    Attach,
    ConfigWrite,
    Reset,
    Migration,
}

fn invalid(msg: String) -> DeviceError {
    tracing::warn!("{msg}");
    DeviceError::InvalidArgument(msg)
}

impl<D: PciDevice> PciAdapter<D> {
    /// Wrap a device; validates its [`PciConfig`] (BAR sizes and slots, MSI-X placement).
    pub fn new(mut dev: D) -> Result<PciAdapter<D>, DeviceError> {
        let config = dev.config();
        let mig_caps = dev.migration().map(|m| m.caps());
        let mig_max_state = dev.migration().map_or(0, |m| m.max_state_size());
        validate(&config)?;
        let (space, caps) = header::build(&config);
        let mut bars: [Option<Bar>; 6] = Default::default();
        for spec in &config.bars {
            bars[spec.index] = Some(Bar {
                spec: spec.clone(),
                ranges: BarRanges::default(),
            });
        }
        let msix_vectors = config.msix.map_or(0, |m| m.vectors);
        if let Some(m) = config.msix {
            // Both BARs exist (validated).
            if let Some(b) = bars[m.table_bar].as_mut() {
                let end = m.table_offset + msix::table_size(m.vectors);
                b.ranges.add(m.table_offset, end, BarPart::MsixTable);
            }
            if let Some(b) = bars[m.pba_bar].as_mut() {
                let end = m.pba_offset + msix::pba_size(m.vectors);
                b.ranges.add(m.pba_offset, end, BarPart::MsixPba);
            }
        }
        let irq = Arc::new(IrqState::new(
            config.intx,
            u32::from(config.msi_vectors),
            u32::from(msix_vectors),
        ));
        tracing::debug!(ids = ?config.ids, bars = config.bars.len(), "PCI adapter built");
        // Bus Master is clear at power-on: no MSI/MSI-X until the guest sets it.
        irq.set_bus_master(space.u16(reg::COMMAND) & command::BUS_MASTER != 0);
        Ok(PciAdapter {
            dev,
            msix_table: config.msix.map(|m| MsixTable::new(m.vectors)),
            config,
            space,
            caps,
            bars,
            irq,
            dma: None,
            mig_caps,
            mig_max_state,
        })
    }

    /// The wrapped device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The wrapped device, mutably.
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// Another handle on the interrupts the device got at attach (for tests and tools).
    pub fn interrupts(&self) -> Interrupts {
        Interrupts::new(self.irq.clone())
    }

    /// True if the guest enabled bus mastering (the DMA space refuses device DMA otherwise).
    pub fn bus_master_enabled(&self) -> bool {
        self.space.u16(reg::COMMAND) & command::BUS_MASTER != 0
    }

    /// The base address the guest programmed into BAR `slot` (0 if not declared).
    pub fn bar_address(&self, slot: usize) -> u64 {
        self.bars
            .get(slot)
            .and_then(|b| b.as_ref())
            .map_or(0, |b| bar::address(&self.space, &b.spec))
    }

    /// Push the command register's BUS_MASTER bit into the DMA space's switch. A change
    /// is logged once (info when the guest or a reset made it, debug at attach); writes that
    /// leave the bit as it was log nothing.
    /// The same bit gates MSI/MSI-X sending ([`IrqState::set_bus_master`]), before attach
    /// too.
    fn sync_bus_master(&self, cause: BmeCause) {
        let enabled = self.bus_master_enabled();
        match cause {
            BmeCause::Migration => self.irq.restore_bus_master(enabled),
            _ => self.irq.set_bus_master(enabled),
        }
        let Some(dma) = &self.dma else { return };
        if dma.set_bus_master(enabled) == enabled {
            return;
        }
        match (cause, enabled) {
            (BmeCause::Attach, _) => tracing::debug!(enabled, "Bus Master Enable at attach"),
            (_, true) => tracing::info!(?cause, "Bus Master Enable set: device DMA allowed"),
            (_, false) => tracing::info!(?cause, "Bus Master Enable clear: device DMA refused"),
        }
    }

    /// Push the guest-controlled interrupt bits of config space into the IRQ state.
    fn sync_irq(&self) {
        let cmd = self.space.u16(reg::COMMAND);
        self.irq.set_intx_disabled(cmd & command::INTX_DISABLE != 0);
        if let Some(cap) = self.caps.msi {
            self.irq.set_msi_mask_bits(cap.mask_bits(&self.space));
            self.irq.set_msi_enabled(cap.enabled_vectors(&self.space));
        }
        if let Some(cap) = self.caps.msix {
            let (enabled, function_mask) = cap.control(&self.space);
            self.irq.set_msix_control(enabled, function_mask);
        }
    }

    /// Store the computed fields (interrupt status, MSI pending) before a guest read.
    fn refresh_dynamic(&mut self) {
        let mut st = self.space.u16(reg::STATUS) & !status::INTERRUPT;
        if self.irq.intx.status() {
            st |= status::INTERRUPT;
        }
        self.space.set_u16_raw(reg::STATUS, st);
        if let Some(cap) = self.caps.msi {
            cap.set_pending_bits(&mut self.space, self.irq.msi_pending_bits());
        }
    }

    fn bar(&self, region: u32, offset: u64, len: usize) -> Result<&Bar, DeviceError> {
        let bar = self
            .bars
            .get(region as usize)
            .and_then(|b| b.as_ref())
            .ok_or_else(|| invalid(format!("region {region} is not an implemented BAR")))?;
        let end = offset.checked_add(len as u64);
        if end.filter(|&e| e <= bar.spec.size).is_none() {
            return Err(invalid(format!(
                "BAR{region} access {offset:#x}+{len:#x} outside its {:#x} bytes",
                bar.spec.size
            )));
        }
        Ok(bar)
    }

    fn bar_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> Result<(), DeviceError> {
        let bar = self.bar(region, offset, data.len())?;
        if data.is_empty() {
            return Ok(()); // Nothing to do; spares devices an empty slice.
        }
        if let Some(shm) = &bar.spec.shared {
            return shm.read_at(offset, data).map_err(DeviceError::Io);
        }
        let slot = bar.spec.index;
        if bar.ranges.device_only(offset, data.len() as u64) {
            self.dev.bar_read(slot, offset, data);
            return Ok(());
        }
        for (off, len, part) in bar.ranges.split(offset, data.len() as u64) {
            // Pieces lie inside `offset..offset + data.len()`, which fits usize.
            let start = (off - offset) as usize;
            let piece = &mut data[start..start + len as usize];
            match (part, &self.config.msix, &self.msix_table) {
                (BarPart::MsixTable, Some(m), Some(t)) => {
                    t.read(&self.irq, off - m.table_offset, piece)
                }
                (BarPart::MsixPba, Some(m), _) => {
                    MsixTable::read_pba(&self.irq, off - m.pba_offset, piece)
                }
                _ => self.dev.bar_read(slot, off, piece),
            }
        }
        Ok(())
    }

    fn bar_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let bar = self.bar(region, offset, data.len())?;
        if data.is_empty() {
            return Ok(()); // Nothing to do; spares devices an empty slice.
        }
        if let Some(shm) = &bar.spec.shared {
            return shm.write_at(offset, data).map_err(DeviceError::Io);
        }
        let slot = bar.spec.index;
        if bar.ranges.device_only(offset, data.len() as u64) {
            self.dev.bar_write(slot, offset, data);
            return Ok(());
        }
        let pieces = bar.ranges.split(offset, data.len() as u64);
        for (off, len, part) in pieces {
            let start = (off - offset) as usize;
            let piece = &data[start..start + len as usize];
            match (part, &self.config.msix, &mut self.msix_table) {
                (BarPart::MsixTable, Some(m), Some(t)) => {
                    t.write(&self.irq, off - m.table_offset, piece)
                }
                (BarPart::MsixPba, _, _) => {
                    tracing::debug!(bar = slot, off, "write to MSI-X PBA ignored")
                }
                _ => self.dev.bar_write(slot, off, piece),
            }
        }
        Ok(())
    }

    fn region_infos(&self) -> Vec<RegionInfo> {
        (0..region_index::COUNT)
            .map(|index| {
                let mut info = RegionInfo {
                    index,
                    ..Default::default()
                };
                if index == region_index::CONFIG {
                    info.size = CONFIG_SIZE as u64;
                    info.flags = REGION_FLAG_READ | REGION_FLAG_WRITE;
                } else if let Some(Some(bar)) = self.bars.get(index as usize) {
                    info.size = bar.spec.size;
                    info.flags = REGION_FLAG_READ | REGION_FLAG_WRITE;
                    if let Some(shm) = &bar.spec.shared {
                        info.flags |= REGION_FLAG_MMAP;
                        info.mmap = Some(RegionMmap {
                            fd: shm.fd(),
                            file_offset: 0,
                            areas: vec![(0, bar.spec.size)],
                        });
                    }
                }
                info
            })
            .collect()
    }

    fn irq_infos(&self) -> Vec<IrqInfo> {
        let counts = self.irq.counts();
        (0..irq_index::COUNT)
            .map(|index| {
                let count = counts[index as usize];
                let flags = match index {
                    _ if count == 0 => 0,
                    irq_index::INTX => IRQ_INFO_EVENTFD | IRQ_INFO_MASKABLE | IRQ_INFO_AUTOMASKED,
                    irq_index::MSI | irq_index::MSIX => IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE,
                    _ => IRQ_INFO_EVENTFD,
                };
                IrqInfo {
                    index,
                    count,
                    flags,
                }
            })
            .collect()
    }
}

impl<D: PciDevice> Device for PciAdapter<D> {
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            flags: DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET,
            regions: self.region_infos(),
            irqs: self.irq_infos(),
        }
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        match region {
            0..=5 => self.bar_read(region, offset, data),
            region_index::CONFIG => {
                self.refresh_dynamic();
                self.space.read(offset, data)
            }
            _ => Err(invalid(format!("region {region} is not readable"))),
        }
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        match region {
            0..=5 => self.bar_write(region, offset, data),
            region_index::CONFIG => {
                self.space.write(offset, data)?;
                tracing::trace!(offset, len = data.len(), "config write");
                self.sync_bus_master(BmeCause::ConfigWrite);
                self.sync_irq();
                Ok(())
            }
            _ => Err(invalid(format!("region {region} is not writable"))),
        }
    }

    /// Hands the device its handles; from here on the DMA space's Bus Master switch follows
    /// the command register (clear after reset, so a guest must set BUS_MASTER before the
    /// device can DMA, as on real hardware).
    fn attach(&mut self, dma: DmaHandle) {
        self.dma = Some(dma.space().clone());
        self.sync_bus_master(BmeCause::Attach);
        self.dev.attach(dma, Interrupts::new(self.irq.clone()));
    }

    fn set_irqs(&mut self, req: SetIrqs) -> Result<(), DeviceError> {
        self.irq.set_irqs(req)
    }

    /// Config space back to its defaults (Bus Master off), MSI-X table zeroed, interrupt
    /// state cleared (eventfds stay attached, as VFIO keeps trigger fds), then the device's
    /// reset.
    fn reset(&mut self) -> Result<(), DeviceError> {
        self.space.reset();
        self.sync_bus_master(BmeCause::Reset);
        if let Some(t) = self.msix_table.as_mut() {
            t.reset();
        }
        self.irq.reset();
        self.sync_irq();
        self.dev.reset();
        tracing::debug!("PCI function reset");
        Ok(())
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) {
        self.dev.dma_unmap(iova, size);
    }

    fn disconnected(&mut self) {
        self.irq.disconnect();
        self.dev.disconnected();
    }

    /// The adapter itself when the device migrates: its [`Migrate`] saves and loads the
    /// framework's PCI state around the device's own (`adapter/migration.rs`).
    fn migration(&mut self) -> Option<&mut dyn Migrate> {
        if self.mig_caps.is_some() && self.dev.migration().is_some() {
            Some(self)
        } else {
            None
        }
    }

    /// Signals the request IRQ (index 4) through [`Interrupts::trigger_request`].
    fn request_release(&mut self) -> bool {
        let signalled = self.interrupts().trigger_request();
        tracing::info!(
            signalled,
            "device request IRQ: asking the client to release the device"
        );
        signalled
    }
}
