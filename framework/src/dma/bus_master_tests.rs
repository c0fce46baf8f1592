//! The Bus Master switch of [`DmaSpace`]: with it clear every device DMA is refused (pins on
//! both paths, `pin_range`, `read`/`write`, the object helpers, fd-less regions without a
//! message to the client), unpinning still works, and setting it again restores everything.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};

use super::{DmaConfig, DmaError, DmaMapping, DmaSpace, Prot, RemoteDma, PAGE_SIZE};

fn memfd(size: u64) -> OwnedFd {
    // SAFETY: memfd_create with a static NUL-terminated name; the result is checked.
    let fd = unsafe { libc::memfd_create(c"umdev-bme-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: ftruncate on our own fd.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), size as i64) }, 0);
    fd
}

fn map(space: &DmaSpace, pfn: u64, npages: u64, fd: Option<OwnedFd>) {
    space
        .map(DmaMapping {
            iova: pfn * PAGE_SIZE,
            size: npages * PAGE_SIZE,
            prot: Prot::RW,
            fd,
            offset: 0,
        })
        .unwrap();
}

/// A client that counts the DMA_READ/DMA_WRITE messages it would get.
#[derive(Default)]
struct CountingRemote {
    calls: Mutex<u32>,
}

impl RemoteDma for CountingRemote {
    fn dma_read(&self, _iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        *self.calls.lock().unwrap() += 1;
        buf.fill(0x5a);
        Ok(())
    }
    fn dma_write(&self, _iova: u64, _data: &[u8]) -> Result<(), DmaError> {
        *self.calls.lock().unwrap() += 1;
        Ok(())
    }
    fn max_xfer(&self) -> usize {
        4096
    }
}

fn is_refused<T: std::fmt::Debug>(r: Result<T, DmaError>, iova: u64) -> bool {
    match r {
        Err(e @ DmaError::BusMasterDisabled { .. }) => {
            assert_eq!(e.errno(), libc::EACCES);
            matches!(e, DmaError::BusMasterDisabled { iova: i } if i == iova)
        }
        other => panic!("expected BusMasterDisabled at {iova:#x}, got {other:?}"),
    }
}

#[test]
fn test_bus_master_clear_refuses_device_dma_and_allows_unpin() {
    let space = DmaSpace::new(DmaConfig::default());
    map(&space, 0, 4, Some(memfd(4 * PAGE_SIZE)));
    map(&space, 0x100, 2, None);
    let remote = Arc::new(CountingRemote::default());
    space.set_remote(Some(remote.clone()));
    let h = space.handle();
    assert!(h.bus_master(), "a new space starts with Bus Master enabled");

    // Pins and data from before the guest clears BME.
    let mut host = [0u64; 2];
    h.pin_pages(&[0, 3], Prot::RW, &mut host).unwrap();
    h.pin_range(1, 2, Prot::READ).unwrap();
    h.write(PAGE_SIZE, &[0x11; 64]).unwrap();
    let before = space.stats();

    assert!(space.set_bus_master(false), "previous value was set");
    assert!(!h.bus_master());
    let mut out = [0u64; 3];
    assert!(is_refused(h.pin_pages(&[2], Prot::READ, &mut out), 0x2000));
    assert!(is_refused(
        h.pin_pages(&[1, 2, 3], Prot::RW, &mut out),
        0x1000
    ));
    assert!(is_refused(
        h.naive().pin_pages(&[2], Prot::RW, &mut out),
        0x2000
    ));
    assert!(is_refused(h.pin_range(2, 1, Prot::RW), 0x2000));
    let mut buf = [0u8; 64];
    assert!(is_refused(h.read(PAGE_SIZE, &mut buf), PAGE_SIZE));
    assert_eq!(buf, [0; 64], "nothing was copied into the buffer");
    assert!(is_refused(h.write(PAGE_SIZE, &[0x22; 64]), PAGE_SIZE));
    assert!(is_refused(h.read_obj::<u64>(PAGE_SIZE), PAGE_SIZE));
    assert!(is_refused(h.write_obj(PAGE_SIZE, &7u64), PAGE_SIZE));
    // fd-less: refused before any message goes to the client.
    assert!(is_refused(
        h.read(0x100 * PAGE_SIZE, &mut buf),
        0x100 * PAGE_SIZE
    ));
    assert!(is_refused(
        h.write(0x100 * PAGE_SIZE, &buf),
        0x100 * PAGE_SIZE
    ));
    assert_eq!(
        *remote.calls.lock().unwrap(),
        0,
        "no DMA_READ/DMA_WRITE sent"
    );
    assert_eq!(space.stats(), before, "refused calls change no accounting");

    // A device can always release what it holds.
    h.unpin_pages(&[0, 3]).unwrap();
    h.unpin_range(1, 2).unwrap();
    assert_eq!(space.stats().pinned_pages, 0);
    space.check_invariants().unwrap();

    // Set again: the same work succeeds, and guest memory was never written meanwhile.
    assert!(!space.set_bus_master(true));
    h.read(PAGE_SIZE, &mut buf).unwrap();
    assert_eq!(buf, [0x11; 64], "the refused write left memory unchanged");
    h.pin_pages(&[1, 2, 3], Prot::RW, &mut out).unwrap();
    h.unpin_pages(&[1, 2, 3]).unwrap();
    h.read(0x100 * PAGE_SIZE, &mut buf).unwrap();
    assert_eq!(buf, [0x5a; 64]);
    assert_eq!(*remote.calls.lock().unwrap(), 1);
    space.check_invariants().unwrap();
}
