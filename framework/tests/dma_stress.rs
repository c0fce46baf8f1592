//! DMA-level unmap race stress: four device threads pin, use and unpin page arrays and copy
//! with `dma_rw` while the connection side (this thread) unmaps and remaps the same ranges.
//!
//! After every unmap returns, the test overwrites the old memfd with a poison byte and keeps
//! it: a device access after the unmap would either *change* poisoned bytes (a write; checked
//! when the memfd is retired) or *see* poison (a read or a pinned page; checked by the
//! threads). At the end the accounting must be exact: no pin left, locked == pinned under
//! `Lock`, nothing force-released (the threads honour the notifier), invariants hold.

mod dma_util;

use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use dma_util::memfd;
use umdev::dma::{
    DmaConfig, DmaError, DmaHandle, DmaMapping, DmaSpace, PinPolicy, Prot, PAGE_SIZE,
};
use vm_memory::Bytes;

const SLOTS: u64 = 4;
const SLOT_PAGES: u64 = 8;
/// First page of slot 0; the slots are adjacent, so arrays and copies cross them.
const BASE_PFN: u64 = 0x1000;
const POISON: u8 = 0xde;
const THREADS: u64 = 4;

struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What the threads and the unmapper share.
struct Shared {
    /// Held (shared) by a thread from before its pin until after its unpin; the unmap
    /// notifier takes it exclusively, i.e. waits until no thread holds pins.
    pin_gate: RwLock<()>,
    stop: AtomicBool,
    /// Successful operations, to show the threads did real work while maps changed.
    pins_ok: AtomicU64,
    rw_ok: AtomicU64,
    refused: AtomicU64,
}

impl Shared {
    fn ops(&self) -> u64 {
        self.pins_ok.load(SeqCst) + self.rw_ok.load(SeqCst) + self.refused.load(SeqCst)
    }
}

fn random_pfns(rng: &mut Rng) -> Vec<u64> {
    let span = SLOTS * SLOT_PAGES + 2; // two pages past the last slot: never mapped
    let n = 1 + rng.below(6) as usize;
    if rng.below(2) == 0 {
        let start = BASE_PFN + rng.below(span);
        (0..n as u64).map(|i| start + i).collect()
    } else {
        (0..n).map(|_| BASE_PFN + rng.below(span)).collect()
    }
}

fn is_expected_refusal(e: &DmaError) -> bool {
    // The range is unmapped or being unmapped: anything else is a bug.
    matches!(e, DmaError::NotMapped { .. })
}

fn device_thread(id: u64, h: DmaHandle, sh: Arc<Shared>) {
    let mut rng = Rng::new(id + 1);
    let pattern = 0x10 + id as u8;
    let mut addrs = [0u64; 8];
    let mut buf = vec![0u8; 3 * PAGE_SIZE as usize];
    while !sh.stop.load(SeqCst) {
        // Leave the (few, shared) CPUs to the unmapping thread now and then.
        thread::yield_now();
        match rng.below(3) {
            0 => {
                let pfns = random_pfns(&mut rng);
                let _gate = sh.pin_gate.read().unwrap();
                let prot = if rng.below(2) == 0 {
                    Prot::RW
                } else {
                    Prot::READ
                };
                match h.pin_pages(&pfns, prot, &mut addrs[..pfns.len()]) {
                    Ok(()) => {
                        for &a in &addrs[..pfns.len()] {
                            // SAFETY: `a` is the host address of a page pinned just above
                            // and unpinned only below.
                            let page = unsafe { h.pinned_slice(a, PAGE_SIZE as usize) };
                            if prot == Prot::RW {
                                page.write_obj(pattern, (id * 64) as usize).unwrap();
                            }
                            let seen: u8 = page.read_obj(((id * 64) + 1) as usize).unwrap();
                            assert_ne!(
                                seen, POISON,
                                "pinned page shows poison: unmapped under a pin"
                            );
                        }
                        h.unpin_pages(&pfns)
                            .expect("unpin of pins the thread holds");
                        sh.pins_ok.fetch_add(1, SeqCst);
                    }
                    Err(e) if is_expected_refusal(&e) => {
                        sh.refused.fetch_add(1, SeqCst);
                    }
                    Err(e) => panic!("pin {pfns:x?}: unexpected {e:?}"),
                }
            }
            kind => {
                let span = (SLOTS * SLOT_PAGES + 1) * PAGE_SIZE;
                let iova = BASE_PFN * PAGE_SIZE + rng.below(span);
                let len = 1 + rng.below(buf.len() as u64) as usize;
                let res = if kind == 1 {
                    buf[..len].fill(pattern);
                    h.write(iova, &buf[..len])
                } else {
                    h.read(iova, &mut buf[..len]).map(|()| {
                        if let Some(i) = buf[..len].iter().position(|&b| b == POISON) {
                            panic!("read at {iova:#x}+{i} returned poison: read after unmap");
                        }
                    })
                };
                match res {
                    Ok(()) => {
                        sh.rw_ok.fetch_add(1, SeqCst);
                    }
                    Err(e) if is_expected_refusal(&e) => {
                        sh.refused.fetch_add(1, SeqCst);
                    }
                    Err(e) => panic!("dma_rw {iova:#x}+{len}: unexpected {e:?}"),
                }
            }
        }
    }
}

fn slot_iova(k: u64) -> u64 {
    (BASE_PFN + k * SLOT_PAGES) * PAGE_SIZE
}

fn map_slot(space: &DmaSpace, k: u64) -> File {
    let fd: OwnedFd = memfd(SLOT_PAGES * PAGE_SIZE);
    let file = File::from(fd.try_clone().unwrap());
    space
        .map(DmaMapping {
            iova: slot_iova(k),
            size: SLOT_PAGES * PAGE_SIZE,
            prot: Prot::RW,
            fd: Some(fd),
            offset: 0,
        })
        .unwrap();
    file
}

fn poison(f: &File) {
    f.write_all_at(&vec![POISON; (SLOT_PAGES * PAGE_SIZE) as usize], 0)
        .unwrap();
}

fn assert_still_poisoned(f: &File, what: &str) {
    let mut b = vec![0u8; (SLOT_PAGES * PAGE_SIZE) as usize];
    f.read_exact_at(&mut b, 0).unwrap();
    if let Some(i) = b.iter().position(|&x| x != POISON) {
        panic!(
            "{what}: byte {i} of an unmapped memfd became {:#x}: device wrote after unmap",
            b[i]
        );
    }
}

/// Run the stress for `iterations` unmap/remap rounds under `policy`.
fn stress(policy: PinPolicy, iterations: u64) {
    let space = DmaSpace::new(DmaConfig {
        policy,
        lock_limit_bytes: Some(1 << 20),
        ..DmaConfig::default()
    });
    let mut files: Vec<File> = (0..SLOTS).map(|k| map_slot(&space, k)).collect();
    let sh = Arc::new(Shared {
        pin_gate: RwLock::new(()),
        stop: AtomicBool::new(false),
        pins_ok: AtomicU64::new(0),
        rw_ok: AtomicU64::new(0),
        refused: AtomicU64::new(0),
    });
    let threads: Vec<_> = (0..THREADS)
        .map(|id| {
            let (h, sh) = (space.handle(), sh.clone());
            thread::spawn(move || device_thread(id, h, sh))
        })
        .collect();
    let mut retired: Vec<(u64, File)> = Vec::new();
    let mut rng = Rng::new(99);
    let started = Instant::now();
    for it in 0..iterations {
        if threads.iter().any(|t| t.is_finished()) {
            break; // a thread panicked: join below reports it
        }
        let notify = &mut |_iova: u64, _size: u64| drop(sh.pin_gate.write().unwrap());
        let old: Vec<(u64, File)> = if it % 50 == 49 {
            let report = space.unmap_all(notify);
            assert_eq!(report.maps_removed, SLOTS);
            assert_eq!(report.leftover_pins, 0);
            let old = files
                .drain(..)
                .enumerate()
                .map(|(k, f)| (k as u64, f))
                .collect();
            files = (0..SLOTS).map(|k| map_slot(&space, k)).collect();
            old
        } else {
            let k = rng.below(SLOTS);
            let report = space
                .unmap(slot_iova(k), SLOT_PAGES * PAGE_SIZE, notify)
                .unwrap();
            assert_eq!(report.leftover_pins, 0);
            let new = map_slot(&space, k);
            vec![(k, std::mem::replace(&mut files[k as usize], new))]
        };
        // The unmap has returned: from now on no byte of the old memory may change.
        for (k, f) in old {
            poison(&f);
            retired.push((k, f));
        }
        // Let the threads run against the new maps (and the poisoned old memory) for a few
        // operations, however loaded the machine is.
        let ops = sh.ops();
        let deadline = Instant::now() + Duration::from_millis(20);
        while sh.ops() < ops + 3 * THREADS && Instant::now() < deadline {
            thread::yield_now();
        }
        if retired.len() > 8 {
            let (k, f) = retired.remove(0);
            assert_still_poisoned(&f, &format!("slot {k}, iteration {it}"));
        }
        if it % 16 == 0 {
            space.check_invariants().unwrap();
        }
    }
    sh.stop.store(true, SeqCst);
    for t in threads {
        t.join().expect("device thread panicked");
    }
    for (k, f) in &retired {
        assert_still_poisoned(f, &format!("slot {k} at the end"));
    }
    let s = space.stats();
    eprintln!(
        "{policy:?}: {iterations} unmaps in {:?}; {} pin+unpin, {} dma_rw, {} refused; {s:?}",
        started.elapsed(),
        sh.pins_ok.load(SeqCst),
        sh.rw_ok.load(SeqCst),
        sh.refused.load(SeqCst)
    );
    assert!(
        sh.pins_ok.load(SeqCst) > 0 && sh.rw_ok.load(SeqCst) > 0,
        "threads did no work"
    );
    assert!(sh.refused.load(SeqCst) > 0, "no access ever raced an unmap");
    assert_eq!((s.pinned_pages, s.locked_pages), (0, 0), "{s:?}");
    assert_eq!(s.leaked_pins_released, 0, "{s:?}");
    assert_eq!(s.maps, SLOTS);
    space.check_invariants().unwrap();
}

#[test]
fn test_stress_lock_pins_and_rw_racing_unmap_never_touch_unmapped_memory() {
    stress(PinPolicy::Lock, 300);
}

#[test]
fn test_stress_translate_pins_and_rw_racing_unmap_never_touch_unmapped_memory() {
    stress(PinPolicy::Translate, 300);
}

#[test]
fn test_stress_device_ignoring_notifier_writes_scratch_never_unmapped_memory() {
    // A buggy device keeps writing through its pinned host addresses after the unmap: umdev
    // force-releases its pins and swaps the range for scratch memory, so the client's memory
    // (poisoned after the unmap returned) never changes.
    let space = DmaSpace::new(DmaConfig {
        policy: PinPolicy::Lock,
        lock_limit_bytes: Some(1 << 20),
        ..DmaConfig::default()
    });
    for round in 0..4u64 {
        let file = map_slot(&space, 0);
        let h = space.handle();
        let pfns: Vec<u64> = (BASE_PFN..BASE_PFN + SLOT_PAGES).collect();
        let mut addrs = [0u64; SLOT_PAGES as usize];
        h.pin_pages(&pfns, Prot::RW, &mut addrs).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(AtomicU64::new(0));
        let writer = {
            let (h, stop, progress) = (h.clone(), stop.clone(), progress.clone());
            thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(SeqCst) {
                    for &a in &addrs {
                        // SAFETY: the buggy device's pins; umdev keeps the addresses mapped
                        // (client memory, then scratch) for the space's lifetime.
                        let page = unsafe { h.pinned_slice(a, PAGE_SIZE as usize) };
                        page.write_obj(0x42u8, (n % PAGE_SIZE) as usize).unwrap();
                    }
                    n += 1;
                    progress.store(n, SeqCst);
                }
            })
        };
        // Wait for the writer to be running (however loaded the machine), then unmap under it.
        let wait_for = |n: u64| {
            let deadline = Instant::now() + Duration::from_secs(5);
            while progress.load(SeqCst) < n {
                assert!(Instant::now() < deadline, "writer thread does not run");
                thread::yield_now();
            }
        };
        wait_for(10);
        let report = space
            .unmap(slot_iova(0), SLOT_PAGES * PAGE_SIZE, &mut |_, _| {})
            .unwrap();
        assert_eq!(report.leftover_pins, SLOT_PAGES, "round {round}");
        poison(&file);
        // Many more writes through the stale addresses after the unmap returned.
        wait_for(progress.load(SeqCst) + 200);
        stop.store(true, SeqCst);
        writer.join().unwrap();
        assert_still_poisoned(&file, &format!("round {round}"));
        // The device's late unpin is refused, without underflowing anything.
        assert!(matches!(
            h.unpin_pages(&pfns),
            Err(DmaError::NotMapped { .. }) | Err(DmaError::NotPinned { .. })
        ));
        let s = space.stats();
        assert_eq!((s.pinned_pages, s.locked_pages, s.maps), (0, 0, 0), "{s:?}");
        assert_eq!(s.leaked_pins_released, (round + 1) * SLOT_PAGES);
        space.check_invariants().unwrap();
    }
}
