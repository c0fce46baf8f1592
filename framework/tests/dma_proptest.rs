//! Property test: random sequences of map/unmap/pin/unpin/dma_rw give the same results,
//! errors and counts through the coalesced path as through the per-page reference path, and
//! both match a simple refcount model (locked pages == distinct pinned pages under `Lock`).

mod dma_util;

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use dma_util::*;
use proptest::prelude::*;
use umdev::dma::{
    DmaError, DmaHandle, DmaMapping, DmaSpace, PinPolicy, Prot, RemoteDma, PAGE_SIZE,
};

const SLOTS: u64 = 6;
const SLOT_PAGES: u64 = 16;
const LIMIT: u64 = 10;

#[derive(Debug, Clone)]
enum Op {
    Map {
        slot: u64,
        npages: u64,
        prot: u8,
        fdless: bool,
    },
    Unmap {
        slot: u64,
    },
    Pin {
        pfns: Vec<u64>,
        write: bool,
    },
    Unpin {
        pfns: Vec<u64>,
    },
    Write {
        off: u64,
        len: usize,
        byte: u8,
    },
    Read {
        off: u64,
        len: usize,
    },
    /// DMA_LOGGING_REPORT of the whole slot range.
    Report,
}

fn pfns_strategy() -> impl Strategy<Value = Vec<u64>> {
    // Mostly runs (contiguous pieces) with some scatter and duplicates.
    prop::collection::vec((0u64..SLOTS * SLOT_PAGES + 4, 1u64..8), 1..5).prop_map(|pieces| {
        pieces
            .into_iter()
            .flat_map(|(start, len)| start..start + len)
            .collect()
    })
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..SLOTS, 1..=SLOT_PAGES, 1u8..4, prop::bool::weighted(0.2))
            .prop_map(|(slot, npages, prot, fdless)| Op::Map { slot, npages, prot, fdless }),
        1 => (0..SLOTS).prop_map(|slot| Op::Unmap { slot }),
        4 => (pfns_strategy(), any::<bool>()).prop_map(|(pfns, write)| Op::Pin { pfns, write }),
        3 => pfns_strategy().prop_map(|pfns| Op::Unpin { pfns }),
        1 => (0..SLOTS * SLOT_PAGES * PAGE_SIZE, 1usize..3 * PAGE_SIZE as usize, any::<u8>())
            .prop_map(|(off, len, byte)| Op::Write { off, len, byte }),
        1 => (0..SLOTS * SLOT_PAGES * PAGE_SIZE, 1usize..3 * PAGE_SIZE as usize)
            .prop_map(|(off, len)| Op::Read { off, len }),
        1 => Just(Op::Report),
    ]
}

/// Client memory for fd-less regions.
struct VecRemote(Mutex<Vec<u8>>);

impl RemoteDma for VecRemote {
    fn dma_read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        let m = self.0.lock().unwrap();
        buf.copy_from_slice(&m[iova as usize..iova as usize + buf.len()]);
        Ok(())
    }
    fn dma_write(&self, iova: u64, data: &[u8]) -> Result<(), DmaError> {
        let mut m = self.0.lock().unwrap();
        m[iova as usize..iova as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn max_xfer(&self) -> usize {
        1000
    }
}

/// A memfd whose page k holds the marker `first_pfn + k` in its first 8 bytes.
fn marked_memfd(first_pfn: u64, npages: u64) -> std::os::fd::OwnedFd {
    let fd = memfd(npages * PAGE_SIZE);
    for k in 0..npages {
        let v = (first_pfn + k).to_le_bytes();
        // SAFETY: pwrite from a local buffer into our own memfd.
        let n = unsafe {
            libc::pwrite(
                fd.as_raw_fd(),
                v.as_ptr().cast(),
                8,
                (k * PAGE_SIZE) as libc::off_t,
            )
        };
        assert_eq!(n, 8);
    }
    fd
}

fn prot_of(p: u8) -> Prot {
    match p {
        1 => Prot::READ,
        2 => Prot::WRITE,
        _ => Prot::RW,
    }
}

/// What a result looks like for comparison: Ok, or (variant, errno).
fn key<T>(r: &Result<T, DmaError>) -> Option<(String, i32)> {
    r.as_ref().err().map(|e| {
        let dbg = format!("{e:?}");
        let variant = dbg.split([' ', '{', '(']).next().unwrap_or("").to_string();
        (variant, e.errno())
    })
}

fn new_space(policy: PinPolicy) -> (Arc<DmaSpace>, DmaHandle) {
    let s = space(policy, LIMIT);
    s.set_remote(Some(Arc::new(VecRemote(Mutex::new(vec![
        0;
        ((SLOTS + 1) * SLOT_PAGES * PAGE_SIZE)
            as usize
    ])))));
    let h = s.handle();
    (s, h)
}

/// The host address of each pinned page shows the same bytes as a dma read of that page
/// (pages start out holding their own pfn, so a wrong page is caught until overwritten).
fn check_addrs(h: &DmaHandle, pfns: &[u64], addrs: &[u64]) -> Result<(), TestCaseError> {
    for (pfn, &addr) in pfns.iter().zip(addrs) {
        // SAFETY: `addr` was just returned by a successful pin of `pfn`; 8 bytes inside it.
        let v = unsafe { std::ptr::read_volatile(addr as *const u64) };
        let mut b = [0u8; 8];
        h.read(pfn * PAGE_SIZE, &mut b).unwrap();
        prop_assert_eq!(v, u64::from_le_bytes(b), "host address of pfn {:#x}", pfn);
    }
    Ok(())
}

fn run(policy: PinPolicy, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let (sa, ha) = new_space(policy);
    let (sb, hb) = new_space(policy);
    sa.dirty_start(PAGE_SIZE, &[]).unwrap();
    sb.dirty_start(PAGE_SIZE, &[]).unwrap();
    // Model: refcount per pfn, and which slots are mapped (npages).
    let mut model: HashMap<u64, u64> = HashMap::new();
    let mut mapped: HashMap<u64, u64> = HashMap::new();
    for op in ops {
        match op {
            Op::Map {
                slot,
                npages,
                prot,
                fdless,
            } => {
                let pfn = slot * SLOT_PAGES;
                let mk = || DmaMapping {
                    iova: pfn * PAGE_SIZE,
                    size: npages * PAGE_SIZE,
                    prot: prot_of(prot),
                    fd: (!fdless).then(|| marked_memfd(pfn, npages)),
                    offset: 0,
                };
                let ra = sa.map(mk());
                let rb = sb.map(mk());
                prop_assert_eq!(key(&ra), key(&rb));
                if ra.is_ok() {
                    prop_assert!(!mapped.contains_key(&slot));
                    mapped.insert(slot, npages);
                }
            }
            Op::Unmap { slot } => {
                let Some(&npages) = mapped.get(&slot) else {
                    continue;
                };
                let (iova, size) = (slot * SLOT_PAGES * PAGE_SIZE, npages * PAGE_SIZE);
                let ra = sa.unmap(iova, size, &mut no_notify()).unwrap();
                let rb = sb.unmap(iova, size, &mut no_notify()).unwrap();
                prop_assert_eq!(ra, rb);
                let lo = slot * SLOT_PAGES;
                let before = model.len();
                model.retain(|&p, _| p < lo || p >= lo + npages);
                prop_assert_eq!(ra.leftover_pins, (before - model.len()) as u64);
                mapped.remove(&slot);
            }
            Op::Pin { pfns, write } => {
                let prot = if write { Prot::RW } else { Prot::READ };
                let mut aa = vec![0u64; pfns.len()];
                let mut ab = vec![0u64; pfns.len()];
                let ra = ha.pin_pages(&pfns, prot, &mut aa);
                let rb = hb.naive().pin_pages(&pfns, prot, &mut ab);
                prop_assert_eq!(key(&ra), key(&rb), "pin {:?}", pfns);
                if ra.is_ok() {
                    check_addrs(&ha, &pfns, &aa)?;
                    check_addrs(&hb, &pfns, &ab)?;
                    for p in &pfns {
                        *model.entry(*p).or_default() += 1;
                    }
                }
            }
            Op::Unpin { pfns } => {
                let ra = ha.unpin_pages(&pfns);
                let rb = hb.naive().unpin_pages(&pfns);
                prop_assert_eq!(key(&ra), key(&rb), "unpin {:?}", pfns);
                // The model agrees on whether the call is valid.
                let mut need: HashMap<u64, u64> = HashMap::new();
                for p in &pfns {
                    *need.entry(*p).or_default() += 1;
                }
                let valid = need
                    .iter()
                    .all(|(p, n)| model.get(p).copied().unwrap_or(0) >= *n);
                prop_assert_eq!(ra.is_ok(), valid, "unpin {:?}", pfns);
                if valid {
                    for (p, n) in need {
                        let c = model.get_mut(&p).unwrap();
                        *c -= n;
                        if *c == 0 {
                            model.remove(&p);
                        }
                    }
                }
            }
            Op::Write { off, len, byte } => {
                let data = vec![byte; len];
                let ra = ha.write(off, &data);
                let rb = hb.write(off, &data);
                prop_assert_eq!(key(&ra), key(&rb));
            }
            Op::Read { off, len } => {
                let mut ba = vec![0u8; len];
                let mut bb = vec![0u8; len];
                let ra = ha.read(off, &mut ba);
                let rb = hb.read(off, &mut bb);
                prop_assert_eq!(key(&ra), key(&rb));
                if ra.is_ok() {
                    prop_assert_eq!(ba, bb);
                }
            }
            Op::Report => {
                let size = SLOTS * SLOT_PAGES * PAGE_SIZE;
                let mut ba = vec![0u8; (SLOTS * SLOT_PAGES / 8) as usize];
                let mut bb = ba.clone();
                sa.dirty_report(0, size, PAGE_SIZE, &mut ba).unwrap();
                sb.dirty_report(0, size, PAGE_SIZE, &mut bb).unwrap();
                prop_assert_eq!(&ba, &bb);
            }
        }
        let (a, b) = (sa.stats(), sb.stats());
        prop_assert_eq!(a.pinned_pages, b.pinned_pages);
        prop_assert_eq!(a.locked_pages, b.locked_pages);
        prop_assert_eq!(a.leaked_pins_released, b.leaked_pins_released);
        prop_assert_eq!(a.pinned_pages, model.len() as u64);
        if policy == PinPolicy::Lock {
            prop_assert_eq!(a.locked_pages, model.len() as u64);
            prop_assert!(a.locked_pages <= LIMIT);
        } else {
            prop_assert_eq!(a.locked_pages, 0);
        }
        sa.check_invariants().map_err(TestCaseError::fail)?;
        sb.check_invariants().map_err(TestCaseError::fail)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn test_prop_coalesced_matches_naive_translate(ops in prop::collection::vec(op_strategy(), 1..40)) {
        run(PinPolicy::Translate, ops)?;
    }

    #[test]
    fn test_prop_coalesced_matches_naive_lock(ops in prop::collection::vec(op_strategy(), 1..40)) {
        run(PinPolicy::Lock, ops)?;
    }

    #[test]
    fn test_prop_coalesced_matches_naive_populate(ops in prop::collection::vec(op_strategy(), 1..40)) {
        run(PinPolicy::Populate, ops)?;
    }
}
