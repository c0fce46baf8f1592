//! fd-less mappings under unmap: `dma_rw` pieces travel to the client as DMA_READ/DMA_WRITE.
//! Once `unmap` returns (the DMA_UNMAP reply), no further request for the range may be
//! issued, and unmap waits for the piece on the wire. A mock client path records every
//! request with a sequence number against the moment unmap returned.

mod dma_util;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use dma_util::{map_fdless, no_notify};
use umdev::dma::{DmaConfig, DmaError, DmaSpace, Prot, RemoteDma, PAGE_SIZE};

const PFN: u64 = 0x400;
const PAGES: u64 = 16;

/// A slow client: each request takes a while, and every request is logged with its start
/// and end sequence numbers.
#[derive(Default)]
struct SlowClient {
    clock: AtomicU64,
    log: Mutex<Vec<(u64, u64, u64)>>, // (iova, started, finished)
}

impl SlowClient {
    fn serve(&self, iova: u64) {
        let started = self.clock.fetch_add(1, SeqCst);
        thread::sleep(Duration::from_micros(300));
        let finished = self.clock.fetch_add(1, SeqCst);
        self.log.lock().unwrap().push((iova, started, finished));
    }
}

impl RemoteDma for SlowClient {
    fn dma_read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.serve(iova);
        buf.fill(0x11);
        Ok(())
    }
    fn dma_write(&self, iova: u64, _data: &[u8]) -> Result<(), DmaError> {
        self.serve(iova);
        Ok(())
    }
    fn max_xfer(&self) -> usize {
        PAGE_SIZE as usize
    }
}

#[test]
fn test_remote_pieces_never_issued_after_unmap_returns_and_unmap_waits_for_the_wire() {
    let space = DmaSpace::new(DmaConfig::default());
    let client = Arc::new(SlowClient::default());
    space.set_remote(Some(client.clone()));
    for round in 0..5 {
        map_fdless(&space, PFN, PAGES, Prot::RW);
        let stop = Arc::new(AtomicBool::new(false));
        let devices: Vec<_> = (0..2)
            .map(|id| {
                let (h, stop) = (space.handle(), stop.clone());
                thread::spawn(move || {
                    let mut buf = vec![0u8; (PAGES * PAGE_SIZE) as usize];
                    while !stop.load(SeqCst) {
                        let r = if id == 0 {
                            h.write(PFN * PAGE_SIZE, &buf)
                        } else {
                            h.read(PFN * PAGE_SIZE, &mut buf)
                        };
                        if let Err(e) = r {
                            assert!(matches!(e, DmaError::NotMapped { .. }), "{e:?}");
                        }
                    }
                })
            })
            .collect();
        while client.log.lock().unwrap().len() < 4 * (round + 1) {
            thread::sleep(Duration::from_micros(100));
        }
        space
            .unmap(PFN * PAGE_SIZE, PAGES * PAGE_SIZE, &mut no_notify())
            .unwrap();
        let replied = client.clock.fetch_add(1, SeqCst);
        thread::sleep(Duration::from_millis(5));
        stop.store(true, SeqCst);
        devices.into_iter().for_each(|d| d.join().unwrap());
        let log = client.log.lock().unwrap();
        let late: Vec<_> = log
            .iter()
            .filter(|&&(_, s, f)| s > replied || f > replied)
            .collect();
        assert!(
            late.is_empty(),
            "round {round}: requests started or still running after unmap returned: {late:x?}"
        );
        drop(log);
        client.log.lock().unwrap().clear();
    }
    space.check_invariants().unwrap();
}
