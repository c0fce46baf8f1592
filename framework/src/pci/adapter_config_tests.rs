//! PciAdapter tests: config space, BARs, info(), reset, lifecycle.

use proptest::prelude::*;

use super::test_device::*;
use super::{BarKind, PciAdapter, PciConfig};
use crate::device::{
    irq_index, Device, DeviceError, IrqAction, DEVICE_FLAGS_PCI, DEVICE_FLAGS_RESET,
    IRQ_INFO_AUTOMASKED, IRQ_INFO_EVENTFD, IRQ_INFO_MASKABLE, IRQ_INFO_NORESIZE, REGION_FLAG_MMAP,
    REGION_FLAG_READ, REGION_FLAG_WRITE,
};

#[test]
fn test_header_ids_class_and_pin_read_back() {
    let mut a = adapter(full_config());
    assert_eq!(cfg_read(&mut a, 0x00, 4), 0x10f0_1af4);
    assert_eq!(cfg_read(&mut a, 0x08, 4), 0x0300_0102);
    assert_eq!(cfg_read(&mut a, 0x0e, 1), 0, "type-0 header");
    assert_eq!(cfg_read(&mut a, 0x2c, 4), 0x5678_1234);
    assert_eq!(cfg_read(&mut a, 0x3d, 1), 1, "INTA");
    let mut no_intx = full_config();
    no_intx.intx = false;
    let mut b = adapter(no_intx);
    assert_eq!(cfg_read(&mut b, 0x3d, 1), 0);
}

#[test]
fn test_bar_sizing_32_64_io_prefetchable_through_config_region() {
    let mut a = adapter(full_config());
    assert_eq!(cfg_read(&mut a, 0x10, 4), 0, "32-bit, not prefetchable");
    assert_eq!(cfg_read(&mut a, 0x18, 4), 0xc, "64-bit prefetchable");
    assert_eq!(cfg_read(&mut a, 0x20, 4), 0x1, "I/O");
    for slot in 0..6u64 {
        cfg_write(&mut a, 0x10 + 4 * slot, 4, 0xffff_ffff);
    }
    let sizes: Vec<u64> = (0..6u64)
        .map(|s| cfg_read(&mut a, 0x10 + 4 * s, 4))
        .collect();
    assert_eq!(
        sizes,
        vec![
            0xffff_c000,
            0,
            0x0000_000c,
            0xffff_fffe,
            0xffff_ffe1,
            0xffff_e000
        ]
    );
    assert_eq!(
        cfg_read(&mut a, 0x18, 8),
        0xffff_fffe_0000_000c,
        "8-byte read"
    );
    cfg_write(&mut a, 0x10, 4, 0xfebf_0000);
    assert_eq!(a.bar_address(0), 0xfebf_0000);
    cfg_write(&mut a, 0x18, 8, 0x0000_0004_0000_0000);
    assert_eq!(a.bar_address(2), 0x4_0000_0000);
}

#[test]
fn test_rom_bar_sizing_reads_zero() {
    let mut a = adapter(full_config());
    cfg_write(&mut a, 0x30, 4, 0xffff_f800);
    assert_eq!(cfg_read(&mut a, 0x30, 4), 0);
    assert_eq!(a.info().regions[6].size, 0);
}

#[test]
fn test_command_register_keeps_only_writable_bits() {
    let mut a = adapter(full_config());
    cfg_write(&mut a, 0x04, 2, 0xffff);
    assert_eq!(cfg_read(&mut a, 0x04, 2), 0x0407);
    assert!(a.bus_master_enabled());
    cfg_write(&mut a, 0x04, 2, 0);
    assert_eq!(cfg_read(&mut a, 0x04, 2), 0);
    assert!(!a.bus_master_enabled());
}

#[test]
fn test_status_reports_capability_list_and_ignores_writes() {
    let mut a = adapter(full_config());
    assert_eq!(cfg_read(&mut a, 0x06, 2), 0x0010);
    cfg_write(&mut a, 0x06, 2, 0xffff);
    assert_eq!(cfg_read(&mut a, 0x06, 2), 0x0010);
    let mut plain = PciConfig::default();
    plain.bars.push(bar(0, 0x1000, BarKind::Mmio32, false));
    let mut b = adapter(plain);
    assert_eq!(cfg_read(&mut b, 0x06, 2), 0, "no capabilities");
    assert_eq!(cfg_read(&mut b, 0x34, 1), 0);
}

#[test]
fn test_capability_chain_finds_msi_and_msix() {
    let mut a = adapter(full_config());
    let caps = walk_caps(&mut a);
    assert_eq!(
        caps.iter().map(|c| c.0).collect::<Vec<_>>(),
        vec![0x05, 0x11]
    );
    let (_, msi) = caps[0];
    let (_, msix) = caps[1];
    let msi_ctl = cfg_read(&mut a, u64::from(msi) + 2, 2);
    assert_eq!(msi_ctl & 0xe, 2 << 1, "MMC = log2(4)");
    assert_ne!(msi_ctl & 0x80, 0, "64-bit");
    assert_ne!(msi_ctl & 0x100, 0, "per-vector masking");
    assert_eq!(cfg_read(&mut a, u64::from(msix) + 2, 2), 7, "table size 8");
    assert_eq!(
        cfg_read(&mut a, u64::from(msix) + 4, 4),
        0x2000,
        "table BIR 0"
    );
    assert_eq!(
        cfg_read(&mut a, u64::from(msix) + 8, 4),
        0x3000,
        "PBA BIR 0"
    );
    cfg_write(&mut a, u64::from(msix) + 4, 4, 0xffff_ffff);
    assert_eq!(
        cfg_read(&mut a, u64::from(msix) + 4, 4),
        0x2000,
        "read-only"
    );
}

#[test]
fn test_config_straddling_write_applies_per_field_masks() {
    let mut a = adapter(full_config());
    // 8 bytes from 0x0c: cache line (rw), latency (ro), header type (ro), BIST (ro), BAR0.
    cfg_write(&mut a, 0x0c, 8, u64::MAX);
    assert_eq!(cfg_read(&mut a, 0x0c, 4), 0x0000_00ff);
    assert_eq!(cfg_read(&mut a, 0x10, 4), 0xffff_c000);
    // Unaligned 2-byte write across vendor/device stays read-only.
    cfg_write(&mut a, 0x01, 2, 0);
    assert_eq!(cfg_read(&mut a, 0x00, 4), 0x10f0_1af4);
    // Interrupt line is writable, pin is not.
    cfg_write(&mut a, 0x3c, 2, 0x0909);
    assert_eq!(cfg_read(&mut a, 0x3c, 2), 0x0109);
}

#[test]
fn test_config_access_past_end_is_rejected() {
    let mut a = adapter(full_config());
    let mut buf = [0u8; 4];
    let e = a.region_read(7, 0xfe, &mut buf).unwrap_err();
    assert!(matches!(e, DeviceError::InvalidArgument(_)));
    assert!(a.region_write(7, u64::MAX, &buf).is_err());
    assert!(
        a.region_read(8, 0, &mut buf).is_err(),
        "VGA not implemented"
    );
    assert!(a.region_read(6, 0, &mut buf).is_err(), "no ROM");
}

#[test]
fn test_info_reports_regions_and_irqs() {
    let a = adapter(full_config());
    let info = a.info();
    assert_eq!(info.flags, DEVICE_FLAGS_PCI | DEVICE_FLAGS_RESET);
    assert_eq!(info.regions.len(), 9);
    for (i, r) in info.regions.iter().enumerate() {
        assert_eq!(r.index as usize, i);
    }
    let rw = REGION_FLAG_READ | REGION_FLAG_WRITE;
    let sizes: Vec<u64> = info.regions.iter().map(|r| r.size).collect();
    assert_eq!(
        sizes,
        vec![0x4000, 0, 0x2_0000_0000, 0, 32, 0x2000, 0, 256, 0]
    );
    assert_eq!(info.regions[0].flags, rw);
    assert_eq!(info.regions[1].flags, 0);
    assert_eq!(info.regions[7].flags, rw);
    assert!(info.regions[0].mmap.is_none());
    let irqs: Vec<(u32, u32)> = info.irqs.iter().map(|i| (i.count, i.flags)).collect();
    assert_eq!(
        irqs,
        vec![
            (
                1,
                IRQ_INFO_EVENTFD | IRQ_INFO_MASKABLE | IRQ_INFO_AUTOMASKED
            ),
            (4, IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE),
            (8, IRQ_INFO_EVENTFD | IRQ_INFO_NORESIZE),
            (1, IRQ_INFO_EVENTFD),
            (1, IRQ_INFO_EVENTFD),
        ]
    );
}

#[test]
fn test_shared_bar_reports_mmap_and_message_access_goes_to_memory() {
    use std::os::fd::AsRawFd;
    let config = full_config();
    let shm = config.bars[3].shared.clone().unwrap();
    let mut a = adapter(config);
    let info = a.info();
    let r5 = &info.regions[5];
    assert_eq!(
        r5.flags,
        REGION_FLAG_READ | REGION_FLAG_WRITE | REGION_FLAG_MMAP
    );
    let mmap = r5.mmap.as_ref().unwrap();
    assert_eq!(mmap.areas, vec![(0, 0x2000)]);
    assert_eq!(mmap.file_offset, 0);
    assert_eq!(mmap.fd.as_raw_fd(), shm.as_raw_fd());

    bar_write32(&mut a, 5, 0x1ffc, 0xdead_beef);
    let mut buf = [0u8; 4];
    shm.read_at(0x1ffc, &mut buf).unwrap();
    assert_eq!(u32::from_le_bytes(buf), 0xdead_beef);
    shm.write_at(0x10, &[1, 2, 3, 4]).unwrap();
    assert_eq!(bar_read32(&mut a, 5, 0x10), 0x0403_0201);
    assert!(
        a.device().accesses.is_empty(),
        "device never sees shared BAR"
    );
}

#[test]
fn test_trapped_bar_access_goes_to_device() {
    let mut a = adapter(full_config());
    bar_write32(&mut a, 0, 0x10, 0x1234_5678);
    assert_eq!(bar_read32(&mut a, 0, 0x10), 0x1234_5678);
    let mut b = [0u8; 2];
    a.region_write(4, 30, &[7, 8]).unwrap();
    a.region_read(4, 30, &mut b).unwrap();
    assert_eq!(b, [7, 8]);
    assert_eq!(
        a.device().accesses,
        vec![
            (0, 0x10, 4, true),
            (0, 0x10, 4, false),
            (4, 30, 2, true),
            (4, 30, 2, false)
        ]
    );
}

#[test]
fn test_bar_access_out_of_range_or_undeclared_is_rejected() {
    let mut a = adapter(full_config());
    let mut buf = [0u8; 4];
    assert!(a.region_read(0, 0x3ffe, &mut buf).is_err());
    assert!(a.region_write(4, u64::MAX - 1, &buf).is_err());
    assert!(
        a.region_read(1, 0, &mut buf).is_err(),
        "slot 1 is not declared"
    );
    assert!(
        a.region_read(3, 0, &mut buf).is_err(),
        "upper half of 64-bit BAR2"
    );
    a.region_read(0, 0x10, &mut []).unwrap();
    a.region_write(0, 0x4000, &[]).unwrap();
    assert!(
        a.device().accesses.is_empty(),
        "empty accesses never reach the device"
    );
}

#[test]
fn test_reset_restores_config_defaults_and_resets_device() {
    let mut a = adapter(full_config());
    let fresh: Vec<u64> = (0..32).map(|i| cfg_read(&mut a, i * 8, 8)).collect();
    cfg_write(&mut a, 0x04, 2, 0x0407);
    cfg_write(&mut a, 0x10, 4, 0xfebf_0000);
    cfg_write(&mut a, 0x3c, 1, 11);
    cfg_write(&mut a, 0x42, 2, 0x0021);
    cfg_write(&mut a, 0x5a, 2, 0x8000);
    bar_write32(&mut a, 0, 0x2000, 0xfee0_0000);
    let fds = attach_eventfds(&mut a, irq_index::MSIX, 8);
    a.reset().unwrap();
    let after: Vec<u64> = (0..32).map(|i| cfg_read(&mut a, i * 8, 8)).collect();
    assert_eq!(fresh, after);
    assert_eq!(bar_read32(&mut a, 0, 0x2000), 0, "MSI-X table zeroed");
    assert_eq!(a.device().resets, 1);
    let irq = irq_of(&a);
    assert_eq!(irq.mode(), crate::irq::IrqMode::Intx);
    // Eventfds survive a reset: enabling MSI-X (and Bus Master, which the reset cleared)
    // again delivers without a new SET_IRQS.
    bus_master_on(&mut a);
    cfg_write(&mut a, 0x5a, 2, 0x8000);
    assert!(irq.trigger(3));
    assert!(fired(&fds[3]));
}

#[test]
fn test_disconnect_drops_eventfds_and_notifies_device() {
    let mut a = adapter(full_config());
    let fds = attach_eventfds(&mut a, irq_index::INTX, 1);
    let irq = irq_of(&a);
    a.disconnected();
    assert_eq!(a.device().disconnects, 1);
    assert!(!irq.trigger(0));
    assert!(!fired(&fds[0]));
}

#[test]
fn test_dma_unmap_is_forwarded() {
    let mut a = adapter(full_config());
    a.dma_unmap(0x1000, 0x2000);
    assert_eq!(a.device().unmaps, vec![(0x1000, 0x2000)]);
}

#[test]
fn test_new_rejects_invalid_config() {
    let mut config = full_config();
    config.bars.push(bar(3, 0x1000, BarKind::Mmio32, false));
    let r = PciAdapter::new(TestDevice {
        config,
        ..Default::default()
    });
    assert!(matches!(r, Err(DeviceError::InvalidArgument(m)) if m.contains("slot 3")));
}

#[test]
fn test_set_irqs_through_adapter_validates_ranges() {
    let mut a = adapter(full_config());
    for (index, start, count) in [(irq_index::MSI, 0, 5), (irq_index::MSIX, 8, 1), (9, 0, 1)] {
        let e = a
            .set_irqs(irqs(index, start, count, IrqAction::Trigger))
            .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
    }
    a.set_irqs(irqs(irq_index::MSIX, 0, 0, IrqAction::Trigger))
        .unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn test_random_config_accesses_never_panic(
        ops in prop::collection::vec(
            (
                0u64..300,
                prop_oneof![prop::sample::select(vec![1usize, 2, 4, 8]), 0usize..=300],
                any::<u8>(),
                any::<bool>(),
            ),
            1..64,
        )
    ) {
        let mut a = adapter(full_config());
        for (offset, len, fill, write) in ops {
            let mut buf = vec![fill; len];
            let in_range = offset + len as u64 <= 256;
            if write {
                prop_assert_eq!(a.region_write(7, offset, &buf).is_ok(), in_range);
            } else {
                prop_assert_eq!(a.region_read(7, offset, &mut buf).is_ok(), in_range);
            }
        }
        // Whatever was written, the identity and the capability chain are intact.
        prop_assert_eq!(cfg_read(&mut a, 0, 4), 0x10f0_1af4);
        prop_assert_eq!(walk_caps(&mut a).len(), 2);
        let irq = irq_of(&a);
        let _ = irq.trigger(0);
    }

    #[test]
    fn test_random_bar0_accesses_never_panic(
        ops in prop::collection::vec((0u64..0x4010, 1usize..=8, any::<u64>(), any::<bool>()), 1..64)
    ) {
        let mut a = adapter(full_config());
        cfg_write(&mut a, 0x5a, 2, 0x8000);
        for (offset, len, value, write) in ops {
            let bytes = value.to_le_bytes();
            let in_range = offset + len as u64 <= 0x4000;
            if write {
                prop_assert_eq!(a.region_write(0, offset, &bytes[..len]).is_ok(), in_range);
            } else {
                let mut buf = [0u8; 8];
                prop_assert_eq!(a.region_read(0, offset, &mut buf[..len]).is_ok(), in_range);
            }
            let _ = irq_of(&a).trigger((value % 9) as u16);
        }
    }
}

#[test]
fn test_adapter_is_send_for_the_server_thread() {
    fn check<T: Send + 'static>() {}
    check::<PciAdapter<TestDevice>>();
    let boxed: Box<dyn Device> = Box::new(adapter(full_config()));
    assert_eq!(boxed.info().regions.len(), 9);
}

#[test]
fn test_vendor_capabilities_chain_after_msix_read_only_and_aligned() {
    let mut config = full_config();
    config.vendor_capabilities = vec![vec![5, 0xaa, 0xbb], vec![4, 0xcc]];
    let mut a = adapter(config);
    // Walk the chain: MSI (0x05), MSI-X (0x11), then the two vendor capabilities.
    let mut ptr = cfg_read(&mut a, 0x34, 1);
    let mut seen = Vec::new();
    while ptr != 0 {
        seen.push((ptr, cfg_read(&mut a, ptr, 1)));
        ptr = cfg_read(&mut a, ptr + 1, 1);
    }
    let ids: Vec<u64> = seen.iter().map(|s| s.1).collect();
    assert_eq!(ids, vec![0x05, 0x11, 0x09, 0x09]);
    let (v0, v1) = (seen[2].0, seen[3].0);
    assert_eq!(v0 % 4, 0, "aligned");
    assert_eq!(v1 % 4, 0, "aligned");
    assert_eq!(cfg_read(&mut a, v0 + 2, 2), 0xaa05);
    assert_eq!(cfg_read(&mut a, v0 + 4, 1), 0xbb);
    assert_eq!(cfg_read(&mut a, v1 + 2, 2), 0xcc04);
    cfg_write(&mut a, v0 + 3, 1, 0x11);
    assert_eq!(cfg_read(&mut a, v0 + 3, 1), 0xaa, "read-only");
}

#[test]
fn test_vendor_capabilities_with_bad_length_or_too_large_are_refused() {
    let mut wrong_len = full_config();
    wrong_len.vendor_capabilities = vec![vec![9, 1, 2]];
    let Err(err) = PciAdapter::new(TestDevice {
        config: wrong_len,
        ..Default::default()
    }) else {
        panic!("a wrong length byte is accepted");
    };
    assert!(err.to_string().contains("length byte"), "{err}");
    let mut too_big = full_config();
    too_big.vendor_capabilities = vec![[vec![200u8], vec![0; 197]].concat()];
    let Err(err) = PciAdapter::new(TestDevice {
        config: too_big,
        ..Default::default()
    }) else {
        panic!("capabilities past 0x100 are accepted");
    };
    assert!(err.to_string().contains("config space"), "{err}");
}
