//! The framebuffer: BAR2's shared memory, accessed with volatile copies only.
//!
//! The client may map BAR2 and write it at any time, so the memory is never turned into a
//! Rust slice: every access goes through [`SharedMemory::read_at`]/[`SharedMemory::write_at`]
//! (bounds-checked volatile copies).

use std::sync::Arc;

use umdev::pci::SharedMemory;

/// BAR2's memory as the device sees it.
#[derive(Debug, Clone)]
pub struct Framebuffer {
    mem: Arc<SharedMemory>,
}

impl Framebuffer {
    /// Wrap BAR2's shared memory.
    pub fn new(mem: Arc<SharedMemory>) -> Framebuffer {
        Framebuffer { mem }
    }

    /// The shared memory (for the BAR declaration).
    pub fn memory(&self) -> &Arc<SharedMemory> {
        &self.mem
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.mem.len() as usize
    }

    /// True if the framebuffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy `buf.len()` bytes at `off` out of the framebuffer. False if out of range.
    pub fn read(&self, off: usize, buf: &mut [u8]) -> bool {
        self.mem.read_at(off as u64, buf).is_ok()
    }

    /// Copy `data` into the framebuffer at `off`. False if out of range.
    pub fn write(&self, off: usize, data: &[u8]) -> bool {
        self.mem.write_at(off as u64, data).is_ok()
    }

    /// Zero the whole framebuffer.
    pub fn clear(&self) {
        let zeros = vec![0u8; 64 * 1024];
        let mut off = 0;
        while off < self.len() {
            let n = zeros.len().min(self.len() - off);
            self.write(off, &zeros[..n]);
            off += n;
        }
    }
}
