//! INTx with Interrupt Disable (command register bit 10) through a real socket, with the ccw
//! device: as on PCI, a completion while the guest has set Interrupt Disable asserts the
//! line without signalling it (the status register's Interrupt Status bit reads 1, no
//! eventfd); clearing Interrupt Disable delivers it exactly once — unless the guest
//! acknowledged the completion meanwhile, which makes the device lower its line.
//! umdev's server serves the device, the independent `vfio_user::Client` is the VMM.

#[path = "common/independent_client.rs"]
mod independent;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use independent::{client_map, enable_device};
use umdev::device::{irq_index, region_index};
use umdev::pci::PciAdapter;
use umdev::testing::{memfd, wait_until, TestServer};
use umdev_devices::ccw::driver::{self, regs, CcwWord, Fault, OperationBlock};
use umdev_devices::ccw::{Ccw, CcwConfig};
use vfio_bindings::bindings::vfio::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE,
};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

const RAM: u64 = 0x10_0000;
const RAM_SIZE: u64 = 1 << 20;
const OPB: u64 = RAM;
const STATUS: u64 = RAM + 0x100;
const PROGRAM: u64 = RAM + 0x1000;

/// Command register: memory decoding + Bus Master, with and without Interrupt Disable.
const CMD: u16 = 0x0006;
const CMD_INTX_DISABLED: u16 = 0x0406;
/// Status register: Interrupt Status.
const STATUS_INTERRUPT: u16 = 0x0008;

struct Vm {
    served: TestServer<PciAdapter<Ccw>>,
    client: vfio_user::Client,
    _ram: File,
    intx: EventFd,
}

impl Vm {
    /// A ccw device with guest RAM holding a one-NOP program, INTx (no MSI) with an eventfd.
    fn new() -> Vm {
        let dir = tempfile::tempdir().unwrap();
        let ccw = Ccw::new(CcwConfig::new(dir.path().join("ccw.img")).with_capacity(64)).unwrap();
        let served = TestServer::builder_pci(ccw)
            .unwrap()
            .in_dir(dir)
            .start()
            .unwrap();
        let mut client = independent::connect(served.path());
        enable_device(&mut client);
        let ram = memfd(RAM_SIZE).unwrap();
        client_map(&mut client, served.dma(), &ram, 0, RAM, RAM_SIZE);
        let opb = OperationBlock {
            program: PROGRAM,
            block: 0,
            status: STATUS,
            flags: 0,
            reserved: 0,
        };
        ram.write_all_at(&opb.to_bytes(), OPB - RAM).unwrap();
        let prog = driver::encode_program(&[CcwWord::nop()]);
        ram.write_all_at(&prog, PROGRAM - RAM).unwrap();
        let intx = EventFd::new(EFD_NONBLOCK).unwrap();
        client
            .set_irqs(
                irq_index::INTX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                1,
                &[intx.as_raw_fd()],
            )
            .unwrap();
        Vm {
            served,
            client,
            _ram: ram,
            intx,
        }
    }

    fn reg(&mut self, off: u64) -> u32 {
        independent::bar0_read32(&mut self.client, off)
    }

    fn set_reg(&mut self, off: u64, v: u32) {
        independent::bar0_write32(&mut self.client, off, v)
    }

    fn set_command(&mut self, cmd: u16) {
        self.client
            .region_write(region_index::CONFIG, 4, &cmd.to_le_bytes())
            .unwrap();
    }

    fn pci_status(&mut self) -> u16 {
        let mut b = [0u8; 2];
        self.client
            .region_read(region_index::CONFIG, 6, &mut b)
            .unwrap();
        u16::from_le_bytes(b)
    }

    /// The INTx eventfd's count since the last call (0 if it was not signalled).
    fn intx_count(&self) -> u64 {
        self.intx.read().unwrap_or(0)
    }

    /// With Interrupt Disable set, START the NOP program and wait until the completion has
    /// asserted INTx (Interrupt Status reads 1).
    fn complete_with_intx_disabled(&mut self) {
        self.set_command(CMD_INTX_DISABLED);
        assert_eq!(
            self.pci_status() & STATUS_INTERRUPT,
            0,
            "nothing pending yet"
        );
        self.set_reg(regs::OPB_ADDR_LO, OPB as u32);
        self.set_reg(regs::OPB_ADDR_HI, 0);
        self.set_reg(regs::START, 1);
        assert!(
            wait_until(Duration::from_secs(5), || self.pci_status()
                & STATUS_INTERRUPT
                != 0),
            "Interrupt Status never read 1 after the completion (status {:#06x})",
            self.pci_status()
        );
        assert_eq!(self.reg(regs::IRQ_STATUS), regs::IRQ_DONE);
        assert_eq!(
            driver::decode_last_status(self.reg(regs::LAST_STATUS)).2,
            Some(Fault::None)
        );
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(self.intx_count(), 0, "INTx signalled while disabled");
    }
}

#[test]
fn test_ccw_socket_intx_disabled_completion_pends_then_fires_once_on_enable() {
    let mut vm = Vm::new();
    vm.complete_with_intx_disabled();
    assert_ne!(vm.pci_status() & STATUS_INTERRUPT, 0, "still pending");

    vm.set_command(CMD);
    assert_eq!(
        vm.intx_count(),
        1,
        "clearing Interrupt Disable delivers it once"
    );
    vm.set_command(CMD);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(vm.intx_count(), 0, "exactly once");

    // The guest handles it: acknowledge, EOI (the VMM unmasks). Nothing fires again.
    vm.set_reg(regs::IRQ_STATUS, regs::IRQ_DONE);
    vm.client
        .set_irqs(
            irq_index::INTX,
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_UNMASK,
            0,
            1,
            &[],
        )
        .unwrap();
    assert_eq!(vm.pci_status() & STATUS_INTERRUPT, 0);
    assert_eq!(vm.intx_count(), 0);
    assert_eq!(vm.served.device().device().pins_held(), 0);
}

#[test]
fn test_ccw_socket_intx_disabled_completion_acked_before_enable_is_not_delivered() {
    let mut vm = Vm::new();
    vm.complete_with_intx_disabled();
    // A polling guest acknowledges the completion: the device lowers its line.
    vm.set_reg(regs::IRQ_STATUS, regs::IRQ_DONE);
    assert_eq!(vm.pci_status() & STATUS_INTERRUPT, 0, "line lowered");
    vm.set_command(CMD);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(vm.intx_count(), 0, "a withdrawn interrupt must not fire");

    // INTx still works for the next completion.
    vm.set_reg(regs::START, 1);
    assert!(
        wait_until(Duration::from_secs(5), || vm.intx.read().is_ok()),
        "the next completion did not fire INTx"
    );
}
