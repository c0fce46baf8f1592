//! Hostile command streams against the command executor: random commands with random ids,
//! sizes, rectangles, offsets, backing entries (in and out of guest memory) and truncated
//! requests. Never a panic; the budget accounting stays exact (used = the resources' bytes
//! ≤ budget); every response has a header; after a reset no pin is left.

use proptest::prelude::*;
use umdev::dma::{DmaConfig, DmaSpace, Prot};
use umdev::testing::GuestMemory;

use super::commands::execute;
use super::protocol::cmd;
use super::state::GpuState;

const BASE: u64 = 0x10000;
const MEM: u64 = 0x40000;

fn field() -> impl Strategy<Value = u32> {
    prop_oneof![4 => 0u32..5, 3 => 0u32..80, 1 => any::<u32>()]
}

fn request() -> impl Strategy<Value = Vec<u8>> {
    let kinds = prop_oneof![
        Just(cmd::GET_DISPLAY_INFO),
        Just(cmd::GET_EDID),
        Just(cmd::RESOURCE_CREATE_2D),
        Just(cmd::RESOURCE_UNREF),
        Just(cmd::SET_SCANOUT),
        Just(cmd::RESOURCE_FLUSH),
        Just(cmd::TRANSFER_TO_HOST_2D),
        Just(cmd::RESOURCE_ATTACH_BACKING),
        Just(cmd::RESOURCE_DETACH_BACKING),
        Just(cmd::UPDATE_CURSOR),
        Just(cmd::MOVE_CURSOR),
        any::<u32>(),
    ];
    let entry = (
        prop_oneof![3 => BASE..BASE + MEM, 1 => any::<u64>()],
        prop_oneof![3 => 1u32..0x8000, 1 => any::<u32>()],
    );
    (
        kinds,
        proptest::collection::vec(field(), 10),
        proptest::collection::vec(entry, 0..4),
        any::<u64>(),
        0usize..120,
    )
        .prop_map(|(kind, fields, entries, offset, cut)| {
            let mut b = Vec::new();
            b.extend_from_slice(&kind.to_le_bytes());
            b.extend_from_slice(&[0u8; 20]);
            if kind == cmd::RESOURCE_ATTACH_BACKING {
                b.extend_from_slice(&fields[0].to_le_bytes());
                b.extend_from_slice(&(entries.len() as u32).to_le_bytes());
                for (addr, len) in entries {
                    b.extend_from_slice(&addr.to_le_bytes());
                    b.extend_from_slice(&len.to_le_bytes());
                    b.extend_from_slice(&[0; 4]);
                }
            } else if kind == cmd::TRANSFER_TO_HOST_2D {
                for f in &fields[..4] {
                    b.extend_from_slice(&f.to_le_bytes());
                }
                b.extend_from_slice(&(offset % 0x10000).to_le_bytes());
                b.extend_from_slice(&fields[4].to_le_bytes());
                b.extend_from_slice(&[0; 4]);
            } else {
                for f in &fields {
                    b.extend_from_slice(&f.to_le_bytes());
                }
            }
            if cut < b.len() && cut % 3 == 0 {
                b.truncate(cut); // a request too short for its command
            }
            b
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn test_virtio_gpu_hostile_commands_keep_budget_exact_and_leak_no_pin(
        reqs in proptest::collection::vec(request(), 1..40),
    ) {
        let mem = GuestMemory::new(BASE, MEM as usize).unwrap();
        let space = DmaSpace::new(DmaConfig::default());
        space.map(mem.dma_mapping(BASE, MEM, Prot::RW).unwrap()).unwrap();
        let dma = space.handle();
        let mut state = GpuState::new(&[(64, 48), (32, 32)], 96 << 10, true);
        for req in &reqs {
            let resp = execute(&mut state, &dma, req);
            prop_assert!(resp.len() >= 24);
            let sum: u64 = state.resources.values().map(|r| r.data.len() as u64).sum();
            prop_assert_eq!(state.used, sum);
            prop_assert!(state.used <= state.budget);
            let _ = super::screenshot::capture(&state, 0);
        }
        state.reset();
        prop_assert_eq!(space.stats().pinned_pages, 0);
        prop_assert!(space.check_invariants().is_ok());
    }
}
