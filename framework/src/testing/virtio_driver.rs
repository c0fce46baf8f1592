//! [`VirtioDriver`]: the guest half of a virtio device, as Linux's `virtio_pci` drives one,
//! for tests: find the capabilities, negotiate, lay out split queues in guest RAM, post
//! chains (direct or indirect), kick, and take used entries. It writes descriptors exactly
//! as told, so a test can also post chains that break every rule.

use std::io;
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::device::{irq_index, region_index};
use crate::virtio::status;

use super::access::{DeviceAccess, PCI_CAP_ID_MSIX};
use super::vmm::Vmm;

/// Capability ID of vendor-specific capabilities.
const PCI_CAP_ID_VNDR: u8 = 0x09;
/// Descriptor flags.
pub const VIRTQ_DESC_F_NEXT: u16 = 1;
/// Descriptor flag: device-writable.
pub const VIRTQ_DESC_F_WRITE: u16 = 2;
/// Descriptor flag: indirect table.
pub const VIRTQ_DESC_F_INDIRECT: u16 = 4;

/// One buffer of a chain the test posts: guest address, length, device-writable.
pub type Buf = (u64, u32, bool);

/// Where a queue lives in guest RAM, and the driver's indexes.
#[derive(Clone, Copy, Debug)]
pub struct DriverQueue {
    /// Queue size.
    pub size: u16,
    /// Descriptor table address.
    pub desc: u64,
    /// Avail ring address.
    pub avail: u64,
    /// Used ring address.
    pub used: u64,
    next_desc: u16,
    avail_idx: u16,
    last_used: u16,
}

/// Bytes of guest RAM a queue of `size` needs with [`VirtioDriver::setup_queue`].
pub fn queue_bytes(size: u16) -> u64 {
    let s = u64::from(size);
    (16 * s + 6 + 2 * s).next_multiple_of(4) + 6 + 8 * s
}

/// A guest-side virtio-pci driver (see the module docs).
#[derive(Debug)]
pub struct VirtioDriver {
    bar: u32,
    common: u64,
    notify: u64,
    notify_mult: u64,
    isr: u64,
    device_cfg: Option<u64>,
    queues: Vec<Option<DriverQueue>>,
}

fn invalid(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

impl VirtioDriver {
    /// Find the virtio capabilities (common, notify, ISR, device) by walking config space.
    pub fn probe(vmm: &mut Vmm) -> io::Result<VirtioDriver> {
        let mut ptr = u64::from(vmm.read8(region_index::CONFIG, 0x34)? & !3);
        let mut found = [None::<(u32, u64, u32)>; 5];
        let mut mult = 0u64;
        for _ in 0..48 {
            if ptr == 0 {
                break;
            }
            let id = vmm.read8(region_index::CONFIG, ptr)?;
            if id == PCI_CAP_ID_VNDR {
                let cfg_type = vmm.read8(region_index::CONFIG, ptr + 3)?;
                let bar = u32::from(vmm.read8(region_index::CONFIG, ptr + 4)?);
                let offset = vmm.read32(region_index::CONFIG, ptr + 8)?;
                let length = vmm.read32(region_index::CONFIG, ptr + 12)?;
                if (1..=4).contains(&cfg_type) {
                    found[usize::from(cfg_type)] = Some((bar, u64::from(offset), length));
                }
                if cfg_type == 2 {
                    mult = u64::from(vmm.read32(region_index::CONFIG, ptr + 16)?);
                }
            }
            ptr = u64::from(vmm.read8(region_index::CONFIG, ptr + 1)? & !3);
        }
        let (Some(common), Some(notify), Some(isr)) = (found[1], found[2], found[3]) else {
            return Err(invalid("virtio capabilities missing"));
        };
        Ok(VirtioDriver {
            bar: common.0,
            common: common.1,
            notify: notify.1,
            notify_mult: mult,
            isr: isr.1,
            device_cfg: found[4].map(|d| d.1),
            queues: Vec::new(),
        })
    }

    /// BAR offset of the common configuration.
    pub fn common(&self) -> u64 {
        self.common
    }

    /// The BAR the structures are in.
    pub fn bar(&self) -> u32 {
        self.bar
    }

    /// Read `device_status`.
    pub fn status(&self, vmm: &mut Vmm) -> io::Result<u8> {
        vmm.read8(self.bar, self.common + 0x14)
    }

    /// Write `device_status`.
    pub fn set_status(&self, vmm: &mut Vmm, v: u8) -> io::Result<()> {
        vmm.write8(self.bar, self.common + 0x14, v)
    }

    /// The 64 feature bits the device offers.
    pub fn device_features(&self, vmm: &mut Vmm) -> io::Result<u64> {
        let mut f = 0u64;
        for sel in 0..2u32 {
            vmm.write32(self.bar, self.common, sel)?;
            f |= u64::from(vmm.read32(self.bar, self.common + 4)?) << (32 * sel);
        }
        Ok(f)
    }

    /// Reset, ACKNOWLEDGE, DRIVER, write `features`, set FEATURES_OK; true if the device
    /// kept FEATURES_OK (accepted the features).
    pub fn negotiate(&mut self, vmm: &mut Vmm, features: u64) -> io::Result<bool> {
        self.set_status(vmm, 0)?;
        self.set_status(vmm, status::ACKNOWLEDGE)?;
        self.set_status(vmm, status::ACKNOWLEDGE | status::DRIVER)?;
        for sel in 0..2u32 {
            vmm.write32(self.bar, self.common + 8, sel)?;
            vmm.write32(self.bar, self.common + 0xc, (features >> (32 * sel)) as u32)?;
        }
        let s = status::ACKNOWLEDGE | status::DRIVER | status::FEATURES_OK;
        self.set_status(vmm, s)?;
        Ok(self.status(vmm)? & status::FEATURES_OK != 0)
    }

    /// Number of queues the device has.
    pub fn num_queues(&self, vmm: &mut Vmm) -> io::Result<u16> {
        vmm.read16(self.bar, self.common + 0x12)
    }

    /// Select queue `index` and read its maximum size.
    pub fn queue_max(&self, vmm: &mut Vmm, index: u16) -> io::Result<u16> {
        vmm.write16(self.bar, self.common + 0x16, index)?;
        vmm.read16(self.bar, self.common + 0x18)
    }

    /// Lay out queue `index` with `size` entries at guest address `base`
    /// ([`queue_bytes`] bytes, 16-byte aligned), give it MSI-X `vector`
    /// (`VIRTIO_MSI_NO_VECTOR` for none), zero its rings and enable it. The 64-bit
    /// addresses are written as two 32-bit halves, as Linux does.
    pub fn setup_queue(
        &mut self,
        vmm: &mut Vmm,
        index: u16,
        size: u16,
        base: u64,
        vector: u16,
    ) -> io::Result<()> {
        let s = u64::from(size);
        let q = DriverQueue {
            size,
            desc: base,
            avail: base + 16 * s,
            used: base + (16 * s + 6 + 2 * s).next_multiple_of(4),
            next_desc: 0,
            avail_idx: 0,
            last_used: 0,
        };
        vmm.ram().fill(base, queue_bytes(size) as usize, 0)?;
        let c = self.common;
        vmm.write16(self.bar, c + 0x16, index)?;
        vmm.write16(self.bar, c + 0x18, size)?;
        vmm.write16(self.bar, c + 0x1a, vector)?;
        for (off, addr) in [(0x20, q.desc), (0x28, q.avail), (0x30, q.used)] {
            vmm.write32(self.bar, c + off, addr as u32)?;
            vmm.write32(self.bar, c + off + 4, (addr >> 32) as u32)?;
        }
        vmm.write16(self.bar, c + 0x1c, 1)?;
        let i = usize::from(index);
        if self.queues.len() <= i {
            self.queues.resize(i + 1, None);
        }
        self.queues[i] = Some(q);
        Ok(())
    }

    /// Set the config-change MSI-X vector.
    pub fn set_config_vector(&self, vmm: &mut Vmm, vector: u16) -> io::Result<()> {
        vmm.write16(self.bar, self.common + 0x10, vector)
    }

    /// Set DRIVER_OK (keeping the other bits).
    pub fn driver_ok(&self, vmm: &mut Vmm) -> io::Result<()> {
        let s = self.status(vmm)?;
        self.set_status(vmm, s | status::DRIVER_OK)
    }

    /// Enable MSI-X and give `vectors` vectors each an eventfd (index = vector).
    pub fn enable_msix(&self, vmm: &mut Vmm, vectors: u16) -> io::Result<Vec<EventFd>> {
        let cap = vmm
            .find_capability(PCI_CAP_ID_MSIX)?
            .ok_or_else(|| invalid("no MSI-X capability"))?;
        let table = vmm.read32(region_index::CONFIG, cap + 4)?;
        let (bar, base) = (table & 7, u64::from(table & !7));
        let ctrl = vmm.read16(region_index::CONFIG, cap + 2)?;
        vmm.write16(region_index::CONFIG, cap + 2, (ctrl | 0x8000) & !0x4000)?;
        let mut fds = Vec::new();
        for v in 0..vectors {
            let entry = base + 16 * u64::from(v);
            vmm.write32(bar, entry, 0xfee0_0000)?;
            vmm.write32(bar, entry + 4, 0)?;
            vmm.write32(bar, entry + 8, 0x40 + u32::from(v))?;
            vmm.write32(bar, entry + 12, 0)?;
            let efd = EventFd::new(EFD_NONBLOCK)?;
            vmm.set_irq_eventfd(irq_index::MSIX, u32::from(v), &efd)?;
            fds.push(efd);
        }
        Ok(fds)
    }

    /// Read the ISR byte (clears it).
    pub fn read_isr(&self, vmm: &mut Vmm) -> io::Result<u8> {
        vmm.read8(self.bar, self.isr)
    }

    /// Read `data.len()` bytes of device config at `offset`.
    pub fn read_config(&self, vmm: &mut Vmm, offset: u64, data: &mut [u8]) -> io::Result<()> {
        let base = self.device_cfg.ok_or_else(|| invalid("no device config"))?;
        vmm.read_bytes(self.bar, base + offset, data)
    }

    /// Write device config at `offset`.
    pub fn write_config(&self, vmm: &mut Vmm, offset: u64, data: &[u8]) -> io::Result<()> {
        let base = self.device_cfg.ok_or_else(|| invalid("no device config"))?;
        vmm.write_bytes(self.bar, base + offset, data)
    }

    /// `config_generation`.
    pub fn generation(&self, vmm: &mut Vmm) -> io::Result<u8> {
        vmm.read8(self.bar, self.common + 0x15)
    }

    fn queue(&mut self, index: u16) -> io::Result<&mut DriverQueue> {
        self.queues
            .get_mut(usize::from(index))
            .and_then(Option::as_mut)
            .ok_or_else(|| invalid("queue not set up"))
    }

    /// The layout of queue `index`.
    pub fn queue_layout(&self, index: u16) -> Option<DriverQueue> {
        self.queues.get(usize::from(index)).copied().flatten()
    }

    /// Write descriptor `i` of queue `index` as given (no checks: tests post bad ones too).
    pub fn write_desc(
        &mut self,
        vmm: &mut Vmm,
        index: u16,
        i: u16,
        desc: (u64, u32, u16, u16),
    ) -> io::Result<()> {
        let q = *self.queue(index)?;
        vmm.ram()
            .write(q.desc + 16 * u64::from(i), &desc_bytes(desc))
    }

    /// Write descriptors for `bufs` (chained with NEXT, WRITE for writable ones) into the
    /// next free slots and return the head (slots are used round-robin).
    pub fn add_chain(&mut self, vmm: &mut Vmm, index: u16, bufs: &[Buf]) -> io::Result<u16> {
        let q = self.queue(index)?;
        let size = q.size;
        let first = q.next_desc;
        q.next_desc = q.next_desc.wrapping_add(bufs.len() as u16) % size;
        let q = *q;
        for (k, &(addr, len, w)) in bufs.iter().enumerate() {
            let i = (first + k as u16) % size;
            let mut flags = if w { VIRTQ_DESC_F_WRITE } else { 0 };
            if k + 1 < bufs.len() {
                flags |= VIRTQ_DESC_F_NEXT;
            }
            let next = (i + 1) % size;
            vmm.ram().write(
                q.desc + 16 * u64::from(i),
                &desc_bytes((addr, len, flags, next)),
            )?;
        }
        Ok(first)
    }

    /// Write `bufs` as an indirect table at guest address `table` and one descriptor
    /// pointing at it; returns the head.
    pub fn add_indirect(
        &mut self,
        vmm: &mut Vmm,
        index: u16,
        table: u64,
        bufs: &[Buf],
    ) -> io::Result<u16> {
        for (k, &(addr, len, w)) in bufs.iter().enumerate() {
            let mut flags = if w { VIRTQ_DESC_F_WRITE } else { 0 };
            if k + 1 < bufs.len() {
                flags |= VIRTQ_DESC_F_NEXT;
            }
            vmm.ram().write(
                table + 16 * k as u64,
                &desc_bytes((addr, len, flags, k as u16 + 1)),
            )?;
        }
        let q = self.queue(index)?;
        let head = q.next_desc;
        q.next_desc = (q.next_desc + 1) % q.size;
        let q = *q;
        let len = 16 * bufs.len() as u32;
        vmm.ram().write(
            q.desc + 16 * u64::from(head),
            &desc_bytes((table, len, VIRTQ_DESC_F_INDIRECT, 0)),
        )?;
        Ok(head)
    }

    /// Put `head` on the avail ring and publish it (bump `avail.idx`).
    pub fn publish(&mut self, vmm: &mut Vmm, index: u16, head: u16) -> io::Result<()> {
        let q = self.queue(index)?;
        let slot = u64::from(q.avail_idx % q.size);
        q.avail_idx = q.avail_idx.wrapping_add(1);
        let q = *q;
        vmm.ram()
            .write(q.avail + 4 + 2 * slot, &head.to_le_bytes())?;
        vmm.ram().write(q.avail + 2, &q.avail_idx.to_le_bytes())
    }

    /// Write `avail.idx` directly (tests of an index that jumps).
    pub fn set_avail_idx(&mut self, vmm: &mut Vmm, index: u16, idx: u16) -> io::Result<()> {
        let q = self.queue(index)?;
        q.avail_idx = idx;
        let at = q.avail + 2;
        vmm.ram().write(at, &idx.to_le_bytes())
    }

    /// Write `used_event` (the driver's interrupt threshold with EVENT_IDX).
    pub fn set_used_event(&mut self, vmm: &mut Vmm, index: u16, v: u16) -> io::Result<()> {
        let q = *self.queue(index)?;
        vmm.ram()
            .write(q.avail + 4 + 2 * u64::from(q.size), &v.to_le_bytes())
    }

    /// Read `avail_event` (the device's notification threshold with EVENT_IDX).
    pub fn avail_event(&mut self, vmm: &mut Vmm, index: u16) -> io::Result<u16> {
        let q = *self.queue(index)?;
        let mut b = [0u8; 2];
        vmm.ram().read(q.used + 4 + 8 * u64::from(q.size), &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    /// Notify queue `index` (a write to its notify address).
    pub fn kick(&mut self, vmm: &mut Vmm, index: u16) -> io::Result<()> {
        let at = self.notify + self.notify_mult * u64::from(index);
        vmm.write16(self.bar, at, index)
    }

    /// The next used entry `(id, len)` of queue `index`, if the device added one.
    pub fn take_used(&mut self, vmm: &mut Vmm, index: u16) -> io::Result<Option<(u32, u32)>> {
        let q = *self.queue(index)?;
        let mut b = [0u8; 2];
        vmm.ram().read(q.used + 2, &mut b)?;
        if u16::from_le_bytes(b) == q.last_used {
            return Ok(None);
        }
        let slot = u64::from(q.last_used % q.size);
        let mut e = [0u8; 8];
        vmm.ram().read(q.used + 4 + 8 * slot, &mut e)?;
        self.queue(index)?.last_used = q.last_used.wrapping_add(1);
        Ok(Some((
            u32::from_le_bytes([e[0], e[1], e[2], e[3]]),
            u32::from_le_bytes([e[4], e[5], e[6], e[7]]),
        )))
    }

    /// Serve the device's DMA requests until queue `index` has a used entry or `timeout`.
    pub fn wait_used(
        &mut self,
        vmm: &mut Vmm,
        index: u16,
        timeout: Duration,
    ) -> io::Result<Option<(u32, u32)>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(u) = self.take_used(vmm, index)? {
                return Ok(Some(u));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            vmm.serve_idle(Duration::from_millis(1), |_| false)?;
        }
    }
}

fn desc_bytes((addr, len, flags, next): (u64, u32, u16, u16)) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&addr.to_le_bytes());
    b[8..12].copy_from_slice(&len.to_le_bytes());
    b[12..14].copy_from_slice(&flags.to_le_bytes());
    b[14..].copy_from_slice(&next.to_le_bytes());
    b
}
