//! `dma_rw` (DmaHandle::read / write) through the public API.

mod dma_util;

use std::sync::{Arc, Mutex};

use dma_util::*;
use umdev::dma::{DmaError, PinPolicy, Prot, RemoteDma, PAGE_SIZE};

#[test]
fn test_rw_across_adjacent_regions_round_trips() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 3, Prot::RW);
    map_pages(&s, 3, 5, Prot::RW);
    let h = s.handle();
    let data: Vec<u8> = (0..5 * PAGE_SIZE as usize).map(|i| (i * 7) as u8).collect();
    h.write(PAGE_SIZE + 100, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    h.read(PAGE_SIZE + 100, &mut back).unwrap();
    assert_eq!(back, data);
}

#[test]
fn test_rw_permission_and_gap_errors() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 2, Prot::READ);
    map_pages(&s, 4, 2, Prot::WRITE);
    let h = s.handle();
    let mut buf = [0u8; 16];
    assert!(matches!(h.write(0, &buf), Err(DmaError::Permission { .. })));
    assert!(matches!(
        h.read(4 * PAGE_SIZE, &mut buf),
        Err(DmaError::Permission { .. })
    ));
    // Crosses the unmapped gap at pages 2..4.
    let e = h.read(2 * PAGE_SIZE - 8, &mut buf).unwrap_err();
    assert!(matches!(e, DmaError::NotMapped { iova: 0x2000 }), "{e}");
    assert!(matches!(
        h.read(u64::MAX - 4, &mut buf),
        Err(DmaError::Overflow { .. })
    ));
    h.read(0, &mut []).unwrap();
}

#[test]
fn test_rw_obj_helpers_round_trip() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 1, Prot::RW);
    let h = s.handle();
    h.write_obj(24, &0x1122_3344_5566_7788u64).unwrap();
    assert_eq!(h.read_obj::<u64>(24).unwrap(), 0x1122_3344_5566_7788);
}

/// A fake client: memory in a Vec, records every transfer's size.
struct FakeRemote {
    mem: Mutex<Vec<u8>>,
    base: u64,
    max: usize,
    sizes: Mutex<Vec<usize>>,
}

impl RemoteDma for FakeRemote {
    fn dma_read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        assert!(buf.len() <= self.max);
        self.sizes.lock().unwrap().push(buf.len());
        let off = (iova - self.base) as usize;
        buf.copy_from_slice(&self.mem.lock().unwrap()[off..off + buf.len()]);
        Ok(())
    }
    fn dma_write(&self, iova: u64, data: &[u8]) -> Result<(), DmaError> {
        assert!(data.len() <= self.max);
        self.sizes.lock().unwrap().push(data.len());
        let off = (iova - self.base) as usize;
        self.mem.lock().unwrap()[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn max_xfer(&self) -> usize {
        self.max
    }
}

#[test]
fn test_rw_fdless_split_at_max_xfer() {
    let s = space(PinPolicy::Translate, 0);
    map_fdless(&s, 0x100, 4, Prot::RW);
    let h = s.handle();
    let mut buf = vec![0u8; 10000];
    assert!(matches!(
        h.read(0x100000, &mut buf),
        Err(DmaError::Disconnected)
    ));
    let remote = Arc::new(FakeRemote {
        mem: Mutex::new(vec![0; 4 * PAGE_SIZE as usize]),
        base: 0x100000,
        max: 4096,
        sizes: Mutex::new(Vec::new()),
    });
    s.set_remote(Some(remote.clone()));
    let data: Vec<u8> = (0..10000).map(|i| (i % 251) as u8).collect();
    h.write(0x100000 + 10, &data).unwrap();
    assert_eq!(*remote.sizes.lock().unwrap(), vec![4096, 4096, 1808]);
    remote.sizes.lock().unwrap().clear();
    h.read(0x100000 + 10, &mut buf).unwrap();
    assert_eq!(buf, data);
    assert_eq!(*remote.sizes.lock().unwrap(), vec![4096, 4096, 1808]);
    s.set_remote(None);
    assert!(matches!(
        h.read(0x100000, &mut buf),
        Err(DmaError::Disconnected)
    ));
}

#[test]
fn test_rw_mixed_fd_and_fdless_regions() {
    let s = space(PinPolicy::Translate, 0);
    map_pages(&s, 0, 1, Prot::RW);
    map_fdless(&s, 1, 1, Prot::RW);
    let remote = Arc::new(FakeRemote {
        mem: Mutex::new(vec![0; PAGE_SIZE as usize]),
        base: PAGE_SIZE,
        max: 1000,
        sizes: Mutex::new(Vec::new()),
    });
    s.set_remote(Some(remote.clone()));
    let h = s.handle();
    let data = vec![0xabu8; 2 * PAGE_SIZE as usize];
    h.write(0, &data).unwrap();
    let mut back = vec![0u8; data.len()];
    h.read(0, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(remote.sizes.lock().unwrap().iter().all(|&n| n <= 1000));
}
