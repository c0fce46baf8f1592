//! A small device implementing `umdev::device::Device` directly, for the wire tests.
//!
//! - BAR0 (region 0): 4 KiB of plain registers, plus
//!   - 0x100 DOORBELL: writing v triggers MSI vector v (INTx if the MSI vector has no fd);
//!   - 0x200 DMA_IOVA (u64), 0x208 DMA_LEN (u32), 0x20c DMA_OP (u32, 1 = read guest memory
//!     into BAR0 at 0x800, 2 = write BAR0 0x800.. to guest memory), run synchronously on
//!     the connection thread; 0x210 DMA_STATUS (0 ok, else errno);
//!   - 0x218 PANIC: any write makes the device panic (a device bug);
//!   - 0x220 PIN_PFN (u64), 0x228 PIN_OP (u32, 1 = pin page PIN_PFN read-write; status in
//!     DMA_STATUS). The device keeps its pins until its unmap notifier runs for a range
//!     holding them: it then unpins them (one array call) and records them in
//!     `notifier_unpins`, as a device must before the unmap completes.
//! - BAR2 (region 2): 64 KiB memfd; [0x4000, 0x10000) is a sparse mmap area, the first
//!   16 KiB are trapped (read/written through the memfd by the device).
//! - CONFIG (region 7): 256 bytes.
//! - IRQs: INTx ×1, MSI ×2, MSI-X ×0, ERR ×1, REQ ×1.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex};

use umdev::device::*;
use umdev::dma::DmaHandle;
use vmm_sys_util::eventfd::EventFd;

pub const BAR0_SIZE: u64 = 4096;
pub const BAR2_SIZE: u64 = 0x10000;
pub const BAR2_MMAP_START: u64 = 0x4000;
pub const REG_DOORBELL: u64 = 0x100;
pub const REG_DMA_IOVA: u64 = 0x200;
pub const REG_DMA_LEN: u64 = 0x208;
pub const REG_DMA_OP: u64 = 0x20c;
pub const REG_DMA_STATUS: u64 = 0x210;
pub const REG_PANIC: u64 = 0x218;
pub const REG_PIN_PFN: u64 = 0x220;
pub const REG_PIN_OP: u64 = 0x228;
pub const DMA_SCRATCH: u64 = 0x800;

/// What the test can observe and control.
#[derive(Default)]
pub struct DeviceState {
    pub regs: Vec<u8>,
    pub eventfds: HashMap<(u32, u32), EventFd>,
    pub resets: u32,
    pub disconnects: u32,
    pub unmaps: Vec<(u64, u64)>,
    pub set_irqs_calls: u32,
    pub writes: Vec<(u32, u64, Vec<u8>)>,
    pub dma: Option<DmaHandle>,
    pub bar2: Option<Arc<std::fs::File>>,
    /// Pages the device holds pinned (PIN_OP).
    pub pins: Vec<u64>,
    /// Pages the unmap notifier unpinned, in order.
    pub notifier_unpins: Vec<u64>,
}

impl DeviceState {
    /// Signal the eventfd of (index, vector); false if none is attached.
    pub fn trigger(&self, index: u32, vector: u32) -> bool {
        match self.eventfds.get(&(index, vector)) {
            Some(e) => e.write(1).is_ok(),
            None => false,
        }
    }

    pub fn reg32(&self, off: u64) -> u32 {
        let o = off as usize;
        u32::from_le_bytes(self.regs[o..o + 4].try_into().unwrap())
    }
}

pub struct TestDevice {
    state: Arc<Mutex<DeviceState>>,
    bar2_fd: Arc<OwnedFd>,
}

impl TestDevice {
    pub fn new() -> (TestDevice, Arc<Mutex<DeviceState>>) {
        let f = super::memfd(BAR2_SIZE);
        let file = Arc::new(f.try_clone().unwrap());
        let state = Arc::new(Mutex::new(DeviceState {
            regs: vec![0; BAR0_SIZE as usize],
            bar2: Some(file),
            ..Default::default()
        }));
        (
            TestDevice {
                state: state.clone(),
                bar2_fd: Arc::new(OwnedFd::from(f)),
            },
            state,
        )
    }

    fn run_dma(st: &mut DeviceState) {
        let iova = u64::from_le_bytes(st.regs[0x200..0x208].try_into().unwrap());
        let len = (st.reg32(REG_DMA_LEN) as usize).min(0x800);
        let op = st.reg32(REG_DMA_OP);
        let Some(dma) = st.dma.clone() else {
            return;
        };
        let scratch = DMA_SCRATCH as usize;
        let res = match op {
            1 => {
                let mut buf = vec![0u8; len];
                let r = dma.read(iova, &mut buf);
                if r.is_ok() {
                    st.regs[scratch..scratch + len].copy_from_slice(&buf);
                }
                r
            }
            2 => {
                let buf = st.regs[scratch..scratch + len].to_vec();
                dma.write(iova, &buf)
            }
            _ => Ok(()),
        };
        let status = match res {
            Ok(()) => 0u32,
            Err(e) => e.errno() as u32,
        };
        st.regs[0x210..0x214].copy_from_slice(&status.to_le_bytes());
    }

    fn run_pin(st: &mut DeviceState) {
        let o = REG_PIN_PFN as usize;
        let pfn = u64::from_le_bytes(st.regs[o..o + 8].try_into().unwrap());
        let Some(dma) = st.dma.clone() else {
            return;
        };
        let mut host = [0u64; 1];
        let status = match dma.pin_pages(&[pfn], umdev::dma::Prot::RW, &mut host) {
            Ok(()) => {
                st.pins.push(pfn);
                0u32
            }
            Err(e) => e.errno() as u32,
        };
        st.regs[0x210..0x214].copy_from_slice(&status.to_le_bytes());
    }
}

impl Device for TestDevice {
    fn info(&self) -> DeviceInfo {
        let mut regions: Vec<RegionInfo> = (0..region_index::COUNT)
            .map(|i| RegionInfo {
                index: i,
                ..Default::default()
            })
            .collect();
        regions[0].size = BAR0_SIZE;
        regions[0].flags = REGION_FLAG_READ | REGION_FLAG_WRITE;
        regions[2].size = BAR2_SIZE;
        regions[2].flags = REGION_FLAG_READ | REGION_FLAG_WRITE | REGION_FLAG_MMAP;
        regions[2].mmap = Some(RegionMmap {
            fd: self.bar2_fd.clone(),
            file_offset: 0,
            areas: vec![(BAR2_MMAP_START, BAR2_SIZE - BAR2_MMAP_START)],
        });
        regions[7].size = 256;
        regions[7].flags = REGION_FLAG_READ | REGION_FLAG_WRITE;
        let irq = |index, count, flags| IrqInfo {
            index,
            count,
            flags,
        };
        DeviceInfo {
            flags: DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET,
            regions,
            irqs: vec![
                irq(
                    0,
                    1,
                    IRQ_INFO_EVENTFD | IRQ_INFO_MASKABLE | IRQ_INFO_AUTOMASKED,
                ),
                irq(1, 2, IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE),
                irq(2, 0, IRQ_INFO_EVENTFD),
                irq(3, 1, IRQ_INFO_EVENTFD),
                irq(4, 1, IRQ_INFO_EVENTFD),
            ],
        }
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        let st = self.state.lock().unwrap();
        match region {
            0 => {
                let o = offset as usize;
                data.copy_from_slice(&st.regs[o..o + data.len()]);
                Ok(())
            }
            2 => st
                .bar2
                .as_ref()
                .unwrap()
                .read_exact_at(data, offset)
                .map_err(DeviceError::Io),
            7 => {
                for (i, b) in data.iter_mut().enumerate() {
                    *b = (offset as usize + i) as u8;
                }
                Ok(())
            }
            _ => Err(DeviceError::InvalidArgument(format!("region {region}"))),
        }
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        if region == 0 && offset == REG_PANIC {
            panic!("test device: write to the panic register");
        }
        let mut st = self.state.lock().unwrap();
        st.writes.push((region, offset, data.to_vec()));
        match region {
            0 => {
                let o = offset as usize;
                st.regs[o..o + data.len()].copy_from_slice(data);
                if offset == REG_DOORBELL {
                    let v = st.reg32(REG_DOORBELL);
                    if !st.trigger(1, v) {
                        st.trigger(0, 0);
                    }
                }
                if offset == REG_DMA_OP {
                    Self::run_dma(&mut st);
                }
                if offset == REG_PIN_OP && st.reg32(REG_PIN_OP) == 1 {
                    Self::run_pin(&mut st);
                }
                Ok(())
            }
            2 => st
                .bar2
                .as_ref()
                .unwrap()
                .write_all_at(data, offset)
                .map_err(DeviceError::Io),
            7 => Ok(()),
            _ => Err(DeviceError::InvalidArgument(format!("region {region}"))),
        }
    }

    fn attach(&mut self, dma: DmaHandle) {
        self.state.lock().unwrap().dma = Some(dma);
    }

    fn set_irqs(&mut self, req: SetIrqs) -> Result<(), DeviceError> {
        let mut st = self.state.lock().unwrap();
        st.set_irqs_calls += 1;
        match (req.action, req.data) {
            (IrqAction::Trigger, IrqData::Eventfd(fds)) => {
                for (i, fd) in fds.into_iter().enumerate() {
                    let key = (req.index, req.start + i as u32);
                    match fd {
                        Some(fd) => {
                            st.eventfds.insert(key, fd);
                        }
                        None => {
                            st.eventfds.remove(&key);
                        }
                    }
                }
                Ok(())
            }
            (IrqAction::Trigger, IrqData::None) if req.count == 0 => {
                st.eventfds.retain(|k, _| k.0 != req.index);
                Ok(())
            }
            (IrqAction::Trigger, IrqData::None) => {
                for v in req.start..req.start + req.count {
                    st.trigger(req.index, v);
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        let mut st = self.state.lock().unwrap();
        st.resets += 1;
        st.regs.iter_mut().for_each(|b| *b = 0);
        Ok(())
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) {
        let mut st = self.state.lock().unwrap();
        st.unmaps.push((iova, size));
        let inside = |p: &u64| (p << 12).wrapping_sub(iova) < size;
        let drop: Vec<u64> = st.pins.iter().copied().filter(inside).collect();
        if !drop.is_empty() {
            st.pins.retain(|p| !inside(p));
            if let Some(dma) = st.dma.clone() {
                dma.unpin_pages(&drop).unwrap();
            }
            st.notifier_unpins.extend(drop);
        }
    }

    fn disconnected(&mut self) {
        let mut st = self.state.lock().unwrap();
        st.disconnects += 1;
        st.eventfds.clear();
    }
}
