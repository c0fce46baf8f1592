//! A DMA copy engine: the guest writes a source address, a destination address and a length
//! into BAR0 and rings GO; a worker pins the source pages readable and the destination pages
//! writable, copies between the two pinned arrays (any page offsets), and raises MSI-X
//! vector 0. STATUS counts completed copies, ERROR holds the errno of the last failure.
//! With Bus Master off the copy is refused (EACCES) and no MSI-X goes out (an MSI-X
//! message is a bus-master write): the driver polls ERROR.
//!
//! BAR0 (16 KiB): registers in the first page, the MSI-X table and PBA (the framework's) in
//! pages of their own.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};

use crossbeam_channel::Sender;
use umdev::dma::{DmaError, DmaHandle, PinnedPages, Prot, PAGE_SHIFT, PAGE_SIZE};
use umdev::irq::Interrupts;
use umdev::pci::{BarKind, BarSpec, MsixSpec, PciConfig, PciDevice, PciIds, RegisterRange};

/// Guest address of the source (64-bit).
pub const REG_SRC: u64 = 0x00;
/// Guest address of the destination (64-bit).
pub const REG_DST: u64 = 0x08;
/// Bytes to copy, 1..=[`MAX_LEN`].
pub const REG_LEN: u64 = 0x10;
/// Write: start a copy of SRC, DST, LEN as they are now.
pub const REG_GO: u64 = 0x18;
/// Read: copies completed since the last reset.
pub const REG_STATUS: u64 = 0x20;
/// Read: errno of the last failed copy (0: none).
pub const REG_ERROR: u64 = 0x28;
/// Largest copy.
pub const MAX_LEN: u64 = 1 << 20;
/// Where the framework puts the MSI-X table and PBA.
pub const MSIX: MsixSpec = MsixSpec {
    vectors: 1,
    table_bar: 0,
    table_offset: 0x1000,
    pba_bar: 0,
    pba_offset: 0x2000,
};

/// What the connection thread and the worker share.
#[derive(Default)]
struct Shared {
    /// Bumped by reset and disconnect: copies queued before are dropped.
    epoch: AtomicU64,
    /// Held by the worker for a whole copy. A copy never waits for the client (pinned
    /// memory is a memory copy), so reset and the unmap notifier may wait for it.
    busy: Mutex<()>,
    status: AtomicU64,
    error: AtomicU64,
}

fn lock(m: &Mutex<()>) -> MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The device.
#[derive(Default)]
pub struct CopyEngine {
    regs: [u64; 3],
    shared: Arc<Shared>,
    work: Option<Sender<([u64; 3], u64)>>,
}

impl PciDevice for CopyEngine {
    fn config(&self) -> PciConfig {
        PciConfig {
            ids: PciIds {
                vendor: 0x1af4,
                device: 0x10f3,
                ..Default::default()
            },
            bars: vec![BarSpec {
                index: 0,
                size: 0x4000,
                kind: BarKind::Mmio32,
                prefetchable: false,
                shared: None,
            }],
            registers: vec![RegisterRange {
                bar: 0,
                offset: 0,
                size: 0x30,
            }],
            msix: Some(MSIX),
            ..Default::default()
        }
    }

    fn attach(&mut self, dma: DmaHandle, irq: Interrupts) {
        let (tx, rx) = crossbeam_channel::bounded::<([u64; 3], u64)>(16);
        let shared = self.shared.clone();
        std::thread::spawn(move || {
            for ([src, dst, len], epoch) in rx {
                let _busy = lock(&shared.busy);
                if shared.epoch.load(SeqCst) != epoch {
                    continue; // queued before a reset or a disconnect
                }
                match copy(&dma, src, dst, len) {
                    Ok(()) => {
                        shared.status.fetch_add(1, SeqCst);
                    }
                    Err(e) => {
                        tracing::warn!("copy {src:#x} -> {dst:#x} +{len:#x} failed: {e}");
                        shared.error.store(e.errno() as u64, SeqCst);
                    }
                }
                irq.trigger(0); // completion, good or bad: STATUS and ERROR say which
            }
        });
        self.work = Some(tx);
    }

    fn bar_read(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
        data.fill(0);
        let value = match offset {
            REG_SRC | REG_DST | REG_LEN => self.regs[(offset / 8) as usize],
            REG_STATUS => self.shared.status.load(SeqCst),
            REG_ERROR => self.shared.error.load(SeqCst),
            _ => 0,
        };
        let n = data.len().min(8);
        data[..n].copy_from_slice(&value.to_le_bytes()[..n]);
    }

    fn bar_write(&mut self, _bar: usize, offset: u64, data: &[u8]) {
        let mut bytes = [0u8; 8];
        let n = data.len().min(8);
        bytes[..n].copy_from_slice(&data[..n]);
        match offset {
            REG_SRC | REG_DST | REG_LEN => {
                self.regs[(offset / 8) as usize] = u64::from_le_bytes(bytes)
            }
            REG_GO => {
                let job = (self.regs, self.shared.epoch.load(SeqCst));
                if let Some(Err(e)) = self.work.as_ref().map(|w| w.try_send(job)) {
                    tracing::warn!("GO dropped: {e}");
                }
            }
            _ => tracing::debug!("write to {offset:#x} ignored"),
        }
    }

    fn reset(&mut self) {
        // After the reply no old copy runs: wait for the one in progress, drop the queue.
        let _busy = lock(&self.shared.busy);
        self.shared.epoch.fetch_add(1, SeqCst);
        self.regs = [0; 3];
        self.shared.status.store(0, SeqCst);
        self.shared.error.store(0, SeqCst);
    }

    fn dma_unmap(&mut self, _iova: u64, _size: u64) {
        // The only pins are a copy's, held under `busy`.
        drop(lock(&self.shared.busy));
    }

    fn disconnected(&mut self) {
        self.shared.epoch.fetch_add(1, SeqCst);
    }
}

/// The IOVA pages under `[addr, addr + len)`, `len` > 0.
fn pages(addr: u64, len: u64) -> Result<Vec<u64>, DmaError> {
    let last = addr
        .checked_add(len - 1)
        .ok_or(DmaError::Overflow { what: "copy range" })?;
    Ok(((addr >> PAGE_SHIFT)..=(last >> PAGE_SHIFT)).collect())
}

/// One copy: pin both sides (one call each), copy, unpin (on drop, on every path).
fn copy(dma: &DmaHandle, src: u64, dst: u64, len: u64) -> Result<(), DmaError> {
    if len == 0 || len > MAX_LEN {
        return Err(DmaError::InvalidArgument("copy length"));
    }
    let from = PinnedPages::pin(dma, &pages(src, len)?, Prot::READ)?;
    let to = PinnedPages::pin(dma, &pages(dst, len)?, Prot::WRITE)?;
    from.copy_to(src % PAGE_SIZE, &to, dst % PAGE_SIZE, len)?;
    Ok(())
}
