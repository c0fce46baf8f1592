//! PciAdapter tests: MSI-X table/PBA, MSI, INTx delivery through `Interrupts`.

use super::test_device::*;
use crate::device::{irq_index, Device, IrqAction, IrqData, SetIrqs};
use crate::irq::IrqMode;

const MSI_CTL: u64 = 0x42;
const MSI_MASK: u64 = 0x50;
const MSI_PENDING: u64 = 0x54;
const MSIX_CTL: u64 = 0x5a;
const TABLE: u64 = 0x2000;
const PBA: u64 = 0x3000;

fn entry(vector: u64, field: u64) -> u64 {
    TABLE + 16 * vector + 4 * field
}

#[test]
fn test_msix_table_write_reads_back() {
    let mut a = adapter(full_config());
    bar_write32(&mut a, 0, entry(2, 0), 0xfee0_1000);
    bar_write32(&mut a, 0, entry(2, 1), 0x1);
    bar_write32(&mut a, 0, entry(2, 2), 0x4041);
    let mut buf = [0u8; 16];
    a.region_read(0, entry(2, 0), &mut buf).unwrap();
    assert_eq!(
        &buf[..12],
        &[0x00, 0x10, 0xe0, 0xfe, 1, 0, 0, 0, 0x41, 0x40, 0, 0]
    );
    assert!(
        a.device().accesses.is_empty(),
        "table never reaches the device"
    );
}

#[test]
fn test_msix_masked_vector_sets_pending_and_fires_on_unmask() {
    let mut a = adapter(full_config());
    bus_master_on(&mut a);
    let fds = attach_eventfds(&mut a, irq_index::MSIX, 8);
    let irq = irq_of(&a);
    cfg_write(&mut a, MSIX_CTL, 2, 0x8000);
    assert_eq!(irq.mode(), IrqMode::Msix);
    assert!(irq.trigger(1));
    assert!(fired(&fds[1]));

    bar_write32(&mut a, 0, entry(5, 3), 1);
    assert!(!irq.trigger(5));
    assert!(!fired(&fds[5]));
    assert_eq!(bar_read32(&mut a, 0, PBA), 1 << 5);
    bar_write32(&mut a, 0, PBA, 0);
    assert_eq!(bar_read32(&mut a, 0, PBA), 1 << 5, "PBA is read-only");
    bar_write32(&mut a, 0, entry(5, 3), 0);
    assert!(fired(&fds[5]));
    assert_eq!(bar_read32(&mut a, 0, PBA), 0);
    assert!(!fired(&fds[5]), "sent exactly once");
}

#[test]
fn test_msix_function_mask_defers_until_cleared() {
    let mut a = adapter(full_config());
    bus_master_on(&mut a);
    let fds = attach_eventfds(&mut a, irq_index::MSIX, 8);
    let irq = irq_of(&a);
    cfg_write(&mut a, MSIX_CTL, 2, 0xc000);
    assert!(!irq.trigger(0));
    assert!(!irq.trigger(7));
    assert_eq!(bar_read32(&mut a, 0, PBA), 0x81);
    cfg_write(&mut a, MSIX_CTL, 2, 0x8000);
    assert!(fired(&fds[0]) && fired(&fds[7]));
    assert_eq!(bar_read32(&mut a, 0, PBA), 0);
}

#[test]
fn test_msix_set_irqs_mask_is_honoured() {
    let mut a = adapter(full_config());
    bus_master_on(&mut a);
    let fds = attach_eventfds(&mut a, irq_index::MSIX, 8);
    let irq = irq_of(&a);
    cfg_write(&mut a, MSIX_CTL, 2, 0x8000);
    a.set_irqs(SetIrqs {
        index: irq_index::MSIX,
        start: 2,
        count: 2,
        action: IrqAction::Mask,
        data: IrqData::Bool(vec![false, true]),
    })
    .unwrap();
    assert!(irq.trigger(2));
    assert!(!irq.trigger(3));
    a.set_irqs(irqs(irq_index::MSIX, 3, 1, IrqAction::Unmask))
        .unwrap();
    assert!(fired(&fds[2]) && fired(&fds[3]));
}

#[test]
fn test_msix_access_straddling_table_start_is_split() {
    let mut a = adapter(full_config());
    let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
    a.region_write(0, TABLE - 4, &data).unwrap();
    assert_eq!(a.device().accesses, vec![(0, TABLE - 4, 4, true)]);
    assert_eq!(
        bar_read32(&mut a, 0, TABLE),
        0x0807_0604,
        "address low bits 1:0 read as zero"
    );
    let mut back = [0u8; 8];
    a.region_read(0, TABLE - 4, &mut back).unwrap();
    assert_eq!(back, [1, 2, 3, 4, 4, 6, 7, 8]);
}

#[test]
fn test_msix_disabled_falls_back_to_msi_then_intx() {
    let mut a = adapter(full_config());
    let irq = irq_of(&a);
    assert_eq!(irq.mode(), IrqMode::Intx);
    cfg_write(&mut a, MSI_CTL, 2, 0x0001);
    assert_eq!(irq.mode(), IrqMode::Msi);
    cfg_write(&mut a, MSIX_CTL, 2, 0x8000);
    assert_eq!(irq.mode(), IrqMode::Msix);
    cfg_write(&mut a, MSIX_CTL, 2, 0);
    cfg_write(&mut a, MSI_CTL, 2, 0);
    assert_eq!(irq.mode(), IrqMode::Intx);
    cfg_write(&mut a, 0x04, 2, 0x0400);
    assert_eq!(irq.mode(), IrqMode::Intx, "Interrupt Disable holds INTx");
}

#[test]
fn test_msi_enable_trigger_fires_the_right_eventfd() {
    let mut a = adapter(full_config());
    bus_master_on(&mut a);
    let fds = attach_eventfds(&mut a, irq_index::MSI, 4);
    let irq = irq_of(&a);
    cfg_write(&mut a, 0x44, 4, 0xfee0_0000);
    cfg_write(&mut a, 0x4c, 2, 0x41);
    cfg_write(&mut a, MSI_CTL, 2, 0x0011); // enable, MME = 1 → 2 vectors
    assert_eq!(irq.enabled_vectors(), 2);
    assert!(irq.trigger(1));
    let got: Vec<bool> = fds.iter().map(fired).collect();
    assert_eq!(got, vec![false, true, false, false]);
    assert!(!irq.trigger(2), "vector beyond the enabled count");
    assert!(fds.iter().all(|f| !fired(f)));
}

#[test]
fn test_msi_mask_bit_pends_and_unmask_fires() {
    let mut a = adapter(full_config());
    bus_master_on(&mut a);
    let fds = attach_eventfds(&mut a, irq_index::MSI, 4);
    let irq = irq_of(&a);
    cfg_write(&mut a, MSI_CTL, 2, 0x0021);
    cfg_write(&mut a, MSI_MASK, 4, 0b1000);
    assert!(!irq.trigger(3));
    assert_eq!(cfg_read(&mut a, MSI_PENDING, 4), 0b1000);
    cfg_write(&mut a, MSI_MASK, 4, 0);
    assert!(fired(&fds[3]));
    assert_eq!(cfg_read(&mut a, MSI_PENDING, 4), 0);
}

#[test]
fn test_intx_trigger_automasks_until_unmask() {
    let mut a = adapter(full_config());
    let fds = attach_eventfds(&mut a, irq_index::INTX, 1);
    let irq = irq_of(&a);
    assert!(irq.trigger(0));
    assert!(fired(&fds[0]));
    assert_ne!(cfg_read(&mut a, 0x06, 2) & 0x8, 0, "interrupt status set");
    assert!(!irq.trigger(0), "automasked");
    assert!(!fired(&fds[0]));
    a.set_irqs(irqs(irq_index::INTX, 0, 1, IrqAction::Unmask))
        .unwrap();
    assert!(fired(&fds[0]), "pending trigger fires at unmask");
    a.set_irqs(irqs(irq_index::INTX, 0, 1, IrqAction::Unmask))
        .unwrap();
    assert_eq!(cfg_read(&mut a, 0x06, 2) & 0x8, 0, "interrupt status clear");
    assert!(irq.trigger(0));
    assert!(fired(&fds[0]));
}

#[test]
fn test_intx_disable_bit_holds_interrupt_until_cleared() {
    let mut a = adapter(full_config());
    let fds = attach_eventfds(&mut a, irq_index::INTX, 1);
    let irq = irq_of(&a);
    cfg_write(&mut a, 0x04, 2, 0x0400);
    assert!(!irq.trigger(0), "held while Interrupt Disable is set");
    assert!(!fired(&fds[0]));
    assert_ne!(
        cfg_read(&mut a, 0x06, 2) & 0x8,
        0,
        "Interrupt Status reads 1 while the line would be asserted"
    );
    cfg_write(&mut a, 0x04, 2, 0x0400);
    assert!(!fired(&fds[0]), "rewriting the bit set delivers nothing");
    cfg_write(&mut a, 0x04, 2, 0);
    assert!(
        fired(&fds[0]),
        "clearing Interrupt Disable delivers the held interrupt"
    );
    cfg_write(&mut a, 0x04, 2, 0);
    assert!(!fired(&fds[0]), "exactly once");
}

#[test]
fn test_intx_lowered_while_disabled_is_not_delivered_on_enable() {
    let mut a = adapter(full_config());
    let fds = attach_eventfds(&mut a, irq_index::INTX, 1);
    let irq = irq_of(&a);
    cfg_write(&mut a, 0x04, 2, 0x0400);
    assert!(!irq.trigger(0));
    assert_ne!(cfg_read(&mut a, 0x06, 2) & 0x8, 0, "pending");
    irq.lower_intx();
    assert_eq!(
        cfg_read(&mut a, 0x06, 2) & 0x8,
        0,
        "the device lowered its line: Interrupt Status clear"
    );
    cfg_write(&mut a, 0x04, 2, 0);
    assert!(!fired(&fds[0]), "a withdrawn interrupt is not delivered");
    assert!(irq.trigger(0), "the line works normally afterwards");
    assert!(fired(&fds[0]));
}

#[test]
fn test_set_irqs_trigger_without_data_fires_loopback() {
    let mut a = adapter(full_config());
    let err = attach_eventfds(&mut a, irq_index::ERR, 1);
    a.set_irqs(irqs(irq_index::ERR, 0, 1, IrqAction::Trigger))
        .unwrap();
    assert!(fired(&err[0]));
    assert!(irq_of(&a).trigger_error());
    assert!(fired(&err[0]));
}

#[test]
fn test_trigger_from_worker_thread_delivers() {
    let mut a = adapter(full_config());
    bus_master_on(&mut a);
    let fds = attach_eventfds(&mut a, irq_index::MSIX, 8);
    cfg_write(&mut a, MSIX_CTL, 2, 0x8000);
    let irq = irq_of(&a);
    let t = std::thread::spawn(move || (0..8).all(|v| irq.trigger(v)));
    assert!(t.join().unwrap());
    assert!(fds.iter().all(fired));
}

fn wait_readable(fd: &vmm_sys_util::eventfd::EventFd) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd on the stack.
    unsafe { libc::poll(&mut p, 1, 5000) == 1 }
}

/// The order QEMU (with KVM) uses at realize and at every system reset, as in
/// QEMU-CLIENT.md: INTx trigger fd, mask, resample fd, unmask; on reset: disable, command
/// write, DEVICE_RESET, re-enable.
#[test]
fn test_qemu_intx_realize_and_reset_sequence_delivers() {
    let mut a = adapter(full_config());
    let irq = irq_of(&a);
    for round in 0..2 {
        let trigger = attach_eventfds(&mut a, irq_index::INTX, 1).remove(0);
        a.set_irqs(irqs(irq_index::INTX, 0, 1, IrqAction::Mask))
            .unwrap();
        let resample = efd();
        a.set_irqs(SetIrqs {
            index: irq_index::INTX,
            start: 0,
            count: 1,
            action: IrqAction::Unmask,
            data: IrqData::Eventfd(vec![Some(resample.try_clone().unwrap())]),
        })
        .unwrap();
        a.set_irqs(irqs(irq_index::INTX, 0, 1, IrqAction::Unmask))
            .unwrap();
        cfg_write(&mut a, 0x04, 2, 0x0006);

        assert!(irq.trigger(0), "round {round}");
        assert!(fired(&trigger));
        assert!(!irq.trigger(0), "automasked until the guest's EOI");
        resample.write(1).unwrap();
        assert!(wait_readable(&trigger), "pending INTx fires after EOI");
        assert!(fired(&trigger));

        // System reset.
        a.set_irqs(irqs(irq_index::INTX, 0, 0, IrqAction::Trigger))
            .unwrap();
        let cmd = cfg_read(&mut a, 0x04, 2);
        cfg_write(&mut a, 0x04, 2, cmd & !0x7);
        assert!(!irq.trigger(0), "no eventfd after the disable");
        a.reset().unwrap();
    }
}

#[test]
fn test_intx_trigger_without_eventfd_fires_when_one_is_attached() {
    let mut a = adapter(full_config());
    let irq = irq_of(&a);
    assert!(!irq.trigger(0));
    assert_ne!(cfg_read(&mut a, 0x06, 2) & 0x8, 0, "still asserted");
    let fds = attach_eventfds(&mut a, irq_index::INTX, 1);
    assert!(
        fired(&fds[0]),
        "level INTx delivered once an eventfd is attached"
    );
    assert!(!irq.trigger(0), "and automasked");
}
