//! INTx through `uio_pci_generic`: the kernel's handler masks the line (sets Interrupt
//! Disable) when the device's Interrupt Status bit is set and counts the interrupt; the
//! guest's 6.1 `uio_pci_generic` has no irqcontrol, so re-enabling is clearing Interrupt
//! Disable in the command register, as the kernel's UIO how-to describes.
//! Closing the uio device file clears Bus Master.

use std::fs::File;
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::pci::{command, PciDev};

/// An open `/dev/uioN` of a function bound to `uio_pci_generic`.
pub struct Uio {
    file: File,
    last: u32,
}

impl Uio {
    /// Bind `dev` to `uio_pci_generic` and open its uio device.
    pub fn bind(dev: &PciDev) -> io::Result<Uio> {
        dev.bind("uio_pci_generic")?;
        let uio_dir = dev.dir.join("uio");
        let name = std::fs::read_dir(&uio_dir)?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.starts_with("uio"))
            .ok_or_else(|| io::Error::other("uio_pci_generic created no uio device"))?;
        let file = File::open(format!("/dev/{name}"))?;
        Ok(Uio { file, last: 0 })
    }

    /// Wait up to `timeout` for an interrupt; returns how many arrived since the last
    /// wait (0 on timeout).
    pub fn wait(&mut self, timeout: Duration) -> io::Result<u32> {
        let mut pfd = libc::pollfd {
            fd: self.file.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Ok(0);
        }
        let mut b = [0u8; 4];
        self.file.read_exact(&mut b)?;
        let total = u32::from_ne_bytes(b);
        let new = total.wrapping_sub(self.last);
        self.last = total;
        Ok(new)
    }

    /// Re-enable INTx after the kernel masked it (clear Interrupt Disable).
    pub fn reenable(dev: &PciDev) -> io::Result<()> {
        dev.update_command(0, command::INTX_DISABLE).map(|_| ())
    }
}
