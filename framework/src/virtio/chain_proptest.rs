//! Chain validation against hostile descriptor tables: random descriptors (addresses in
//! and out of guest memory, any length, any flags, any `next`), random indirect tables and
//! avail rings. For every input: no panic; a chain the queue accepts is exactly what an
//! independent reference walker accepts (with the same buffers); a refused one stops the
//! queue with `DEVICE_NEEDS_RESET`; pinning, reading and writing an accepted chain stay
//! inside it; and no pin is left afterwards.

use std::collections::HashSet;
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;

use proptest::prelude::*;

use super::chain::{Segment, VIRTQ_DESC_F_INDIRECT, VIRTQ_DESC_F_NEXT, VIRTQ_DESC_F_WRITE};
use super::queue::{QueueSetup, Virtqueue};
use super::signal::Shared;
use super::{status, VirtioError};
use crate::dma::{DmaConfig, DmaSpace, Prot};
use crate::testing::GuestMemory;

const BASE: u64 = 0x10000;
const MEM: u64 = 0x20000;
const SIZE: u16 = 8;
const DESC: u64 = BASE;
const AVAIL: u64 = BASE + 0x100;
const USED: u64 = BASE + 0x200;
/// Where indirect tables may live.
const TABLES: u64 = BASE + 0x1000;
const MAX_BYTES: u64 = 0x9000;

#[derive(Clone, Copy, Debug)]
struct RawDesc {
    addr: u64,
    len: u32,
    flags: u16,
    next: u16,
}

fn desc_strategy() -> impl Strategy<Value = RawDesc> {
    let addr = prop_oneof![
        4 => BASE..BASE + MEM,               // inside guest memory
        1 => 0u64..u64::MAX,                  // anywhere, mostly unmapped
        1 => u64::MAX - 0x2000..=u64::MAX,    // near the top: wraps
        2 => (0u64..16).prop_map(|k| TABLES + 0x100 * k), // at an indirect table
    ];
    let len = prop_oneof![
        4 => 0u32..0x3000,
        1 => Just(0u32),
        1 => 0u32..=u32::MAX,
        2 => (1u32..8).prop_map(|k| 16 * k), // a plausible indirect length
    ];
    (addr, len, 0u16..8, 0u16..12).prop_map(|(addr, len, flags, next)| RawDesc {
        addr,
        len,
        flags,
        next,
    })
}

fn write_desc(mem: &GuestMemory, at: u64, d: &RawDesc) {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&d.addr.to_le_bytes());
    b[8..12].copy_from_slice(&d.len.to_le_bytes());
    b[12..14].copy_from_slice(&d.flags.to_le_bytes());
    b[14..].copy_from_slice(&d.next.to_le_bytes());
    mem.write(at, &b).unwrap();
}

fn read_desc(mem: &GuestMemory, at: u64) -> Option<RawDesc> {
    let mut b = [0u8; 16];
    mem.read(at, &mut b).ok()?;
    Some(RawDesc {
        addr: u64::from_le_bytes(b[..8].try_into().unwrap()),
        len: u32::from_le_bytes(b[8..12].try_into().unwrap()),
        flags: u16::from_le_bytes([b[12], b[13]]),
        next: u16::from_le_bytes([b[14], b[15]]),
    })
}

type Model = Option<(Vec<Segment>, Vec<Segment>)>;

/// The reference walker: the spec's rules, written the obvious way (a visited set for
/// loops), independent of `chain.rs`.
fn model(mem: &GuestMemory, head: u16, indirect_ok: bool) -> Model {
    let (mut r, mut w) = (Vec::new(), Vec::new());
    let (mut rl, mut wl) = (0u64, 0u64);
    let mut table = DESC;
    let mut len = u32::from(SIZE);
    let mut in_indirect = false;
    let mut i = u32::from(head);
    let mut seen = HashSet::new();
    loop {
        if i >= len || !seen.insert((in_indirect, i)) {
            return None;
        }
        let d = read_desc(mem, table + 16 * u64::from(i))?;
        if d.flags & VIRTQ_DESC_F_INDIRECT != 0 {
            let ok = indirect_ok
                && !in_indirect
                && d.flags & VIRTQ_DESC_F_NEXT == 0
                && d.len > 0
                && d.len % 16 == 0
                && d.len / 16 <= super::MAX_INDIRECT_DESCRIPTORS;
            // The whole table must be readable guest memory.
            let inside = d.addr >= BASE && d.addr.checked_add(u64::from(d.len))? <= BASE + MEM;
            if !ok || !inside {
                return None;
            }
            table = d.addr;
            len = d.len / 16;
            in_indirect = true;
            i = 0;
            continue;
        }
        let writable = d.flags & VIRTQ_DESC_F_WRITE != 0;
        if !writable && !w.is_empty() {
            return None;
        }
        if d.len > 0 {
            d.addr.checked_add(u64::from(d.len) - 1)?;
            let (list, total) = if writable {
                (&mut w, &mut wl)
            } else {
                (&mut r, &mut rl)
            };
            *total += u64::from(d.len);
            if *total > MAX_BYTES {
                return None;
            }
            list.push(Segment {
                addr: d.addr,
                len: d.len,
            });
        }
        if d.flags & VIRTQ_DESC_F_NEXT == 0 {
            return Some((r, w));
        }
        i = u32::from(d.next);
    }
}

/// Entry `k` of the avail ring.
fn ring_head(mem: &GuestMemory, k: usize) -> u16 {
    let mut b = [0u8; 2];
    mem.read(AVAIL + 4 + 2 * (k as u64 % u64::from(SIZE)), &mut b)
        .unwrap();
    u16::from_le_bytes(b)
}

fn in_memory(segs: &[Segment]) -> bool {
    segs.iter()
        .all(|s| s.addr >= BASE && s.addr + u64::from(s.len) <= BASE + MEM)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn test_chain_hostile_tables_match_reference_and_leak_no_pin(
        descs in proptest::collection::vec(desc_strategy(), SIZE as usize),
        tables in proptest::collection::vec(desc_strategy(), 64),
        heads in proptest::collection::vec(0u16..10, 1..6),
        jump in prop_oneof![4 => Just(None), 1 => (0u16..=u16::MAX).prop_map(Some)],
        indirect_ok in any::<bool>(),
    ) {
        let mem = GuestMemory::new(BASE, MEM as usize).unwrap();
        let space = DmaSpace::new(DmaConfig::default());
        space.map(mem.dma_mapping(BASE, MEM, Prot::RW).unwrap()).unwrap();
        for (i, d) in descs.iter().enumerate() {
            write_desc(&mem, DESC + 16 * i as u64, d);
        }
        for (i, d) in tables.iter().enumerate() {
            write_desc(&mem, TABLES + 16 * i as u64, d);
        }
        for (k, h) in heads.iter().enumerate() {
            mem.write(AVAIL + 4 + 2 * k as u64, &h.to_le_bytes()).unwrap();
        }
        let avail_idx = jump.unwrap_or(heads.len() as u16);
        mem.write(AVAIL + 2, &avail_idx.to_le_bytes()).unwrap();

        let shared = Arc::new(Shared::new(1));
        shared.status.store(status::DRIVER_OK, SeqCst);
        let setup = QueueSetup {
            index: 0, size: SIZE, desc: DESC, avail: AVAIL, used: USED,
            event_idx: true, indirect: indirect_ok, max_chain_bytes: MAX_BYTES,
        };
        let mut q = Virtqueue::new(setup, space.handle(), shared.clone(), 0, Default::default());
        let jumped = avail_idx > SIZE;
        let mut k = 0usize;
        loop {
            match q.pop() {
                Ok(None) => {
                    prop_assert!(!jumped);
                    prop_assert_eq!(k, usize::from(avail_idx));
                    break;
                }
                Ok(Some(chain)) => {
                    prop_assert!(!jumped);
                    let expect = model(&mem, ring_head(&mem, k), indirect_ok);
                    prop_assert_eq!(
                        Some((chain.readable().to_vec(), chain.writable().to_vec())),
                        expect
                    );
                    let fits = in_memory(chain.readable()) && in_memory(chain.writable());
                    match chain.pin(&space.handle()) {
                        Ok(p) => {
                            prop_assert!(fits, "pinned a chain outside guest memory");
                            let data = p.read_all().unwrap();
                            prop_assert_eq!(data.len() as u64, chain.readable_len());
                            let out = vec![0xa5u8; p.writable_len() as usize];
                            p.write(0, &out).unwrap();
                            // One byte past either stream is refused.
                            prop_assert!(p.read(p.readable_len(), &mut [0]).is_err());
                            prop_assert!(p.write(p.writable_len(), &[0]).is_err());
                            q.add_used(chain.head(), out.len() as u32).unwrap();
                        }
                        Err(_) => {
                            prop_assert!(!fits, "refused to pin a chain in guest memory");
                            prop_assert_eq!(space.stats().pinned_pages, 0);
                            q.add_used(chain.head(), 0).unwrap();
                        }
                    }
                    k += 1;
                }
                Err(e) => {
                    if !jumped {
                        // Only a head the reference also refuses (or a repeated head still
                        // in flight: not here, every chain is used at once).
                        prop_assert_eq!(model(&mem, ring_head(&mem, k), indirect_ok), None, "{}", e);
                    }
                    prop_assert!(shared.status.load(SeqCst) & status::DEVICE_NEEDS_RESET != 0);
                    prop_assert!(matches!(q.pop(), Err(VirtioError::Stopped)));
                    break;
                }
            }
        }
        let s = space.stats();
        prop_assert_eq!(s.pinned_pages, 0, "{:?}", s);
        prop_assert!(space.check_invariants().is_ok());
    }
}
