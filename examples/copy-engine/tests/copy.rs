//! The copy engine through a socket, driven by umdev's embedded VMM as QEMU and a guest
//! driver would; every wait is for the device's MSI-X interrupt.
use std::os::fd::AsFd;
use std::time::Duration;

use copy_engine::*;
use umdev::dma::DmaError;
use umdev::testing::{DeviceAccess, EventFd, FdlessMemory, TestServer, Vmm, PCI_COMMAND_MASTER};

type Server = TestServer<umdev::pci::PciAdapter<CopyEngine>>;

const RAM: u64 = 0x10_0000;
const WAIT: Duration = Duration::from_secs(5);

fn setup() -> Result<(Server, Vmm, EventFd), Box<dyn std::error::Error>> {
    let server = TestServer::start_pci(CopyEngine::default())?;
    let mut vmm = server.connect()?.with_ram(RAM, 1 << 20)?;
    vmm.enable_device()?;
    let msix = vmm.enable_msix()?;
    Ok((server, vmm, msix))
}

fn go(vmm: &mut Vmm, src: u64, dst: u64, len: u64) -> std::io::Result<()> {
    vmm.write64(0, REG_SRC, src)?;
    vmm.write64(0, REG_DST, dst)?;
    vmm.write64(0, REG_LEN, len)?;
    vmm.write32(0, REG_GO, 1)
}

#[test]
fn test_copy_across_unaligned_page_edges_copies_and_raises_msix(
) -> Result<(), Box<dyn std::error::Error>> {
    let (server, mut vmm, msix) = setup()?;
    for (i, (src, dst, len)) in [
        (0x0ff9, 0x5003, 0x3001),
        (0x2000, 0x9000, 0x2000),
        (0x7, 0x40, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let data: Vec<u8> = (0..len).map(|b| (b * 13 + i as u64) as u8).collect();
        vmm.ram().write(RAM + src, &data)?;
        go(&mut vmm, RAM + src, RAM + dst, len)?;
        assert!(vmm.wait_irq_serving(&msix, WAIT)?, "no MSI-X for copy {i}");
        assert_eq!(
            vmm.ram().read_vec(RAM + dst, len as usize)?,
            data,
            "copy {i}"
        );
        assert_eq!(vmm.read64(0, REG_STATUS)?, i as u64 + 1);
    }
    assert_eq!(vmm.read64(0, REG_ERROR)?, 0);
    server.assert_space_unpinned();
    Ok(())
}

#[test]
fn test_copy_bad_address_or_length_reports_errno_and_pins_nothing(
) -> Result<(), Box<dyn std::error::Error>> {
    let (server, mut vmm, msix) = setup()?;
    let cases = [
        (1 << 40, RAM, 16, libc_efault()), // source nothing maps
        (RAM, RAM + (1 << 20) - 8, 16, libc_efault()), // destination runs off the RAM
        (RAM, RAM + 0x1000, 0, libc_einval()), // empty
        (u64::MAX - 4, RAM, 16, libc_einval()), // wraps the address space
    ];
    for (src, dst, len, errno) in cases {
        go(&mut vmm, src, dst, len)?;
        assert!(
            vmm.wait_irq_serving(&msix, WAIT)?,
            "no completion for {src:#x}"
        );
        assert_eq!(
            vmm.read64(0, REG_ERROR)?,
            errno,
            "{src:#x} -> {dst:#x} +{len}"
        );
        server.assert_space_unpinned();
    }
    assert_eq!(vmm.read64(0, REG_STATUS)?, 0);
    Ok(())
}

#[test]
fn test_copy_with_bus_master_off_is_refused() -> Result<(), Box<dyn std::error::Error>> {
    let (_server, mut vmm, msix) = setup()?;
    let cmd = vmm.command()?;
    vmm.set_command(cmd & !PCI_COMMAND_MASTER)?;
    go(&mut vmm, RAM, RAM + 0x1000, 64)?;
    // An MSI-X message is a bus-master write: with Bus Master off the completion cannot
    // interrupt (umdev drops it, as PCI says), so the driver polls ERROR instead.
    let deadline = std::time::Instant::now() + WAIT;
    while vmm.read64(0, REG_ERROR)? != libc_eacces() {
        assert!(
            std::time::Instant::now() < deadline,
            "the copy was not refused"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(vmm.read64(0, REG_STATUS)?, 0);
    assert!(
        !vmm.wait_irq_serving(&msix, Duration::from_millis(100))?,
        "an MSI-X with Bus Master off"
    );
    // Bus Master on again: no stale interrupt, and the next copy works and interrupts.
    vmm.set_command(cmd)?;
    assert!(!vmm.wait_irq_serving(&msix, Duration::from_millis(100))?);
    go(&mut vmm, RAM, RAM + 0x1000, 64)?;
    assert!(
        vmm.wait_irq_serving(&msix, WAIT)?,
        "no MSI-X after Bus Master is back"
    );
    assert_eq!(vmm.read64(0, REG_STATUS)?, 1);
    Ok(())
}

#[test]
fn test_copy_fdless_memory_cannot_be_pinned_and_says_so() -> Result<(), Box<dyn std::error::Error>>
{
    let (server, mut vmm, msix) = setup()?;
    const PLAIN: u64 = 1 << 30;
    vmm.set_fdless(FdlessMemory::new(PLAIN, 0x4000));
    vmm.dma_map_fdless(PLAIN, 0x4000)?;
    go(&mut vmm, PLAIN, RAM, 64)?;
    assert!(vmm.wait_irq_serving(&msix, WAIT)?);
    assert_eq!(vmm.read64(0, REG_ERROR)?, libc_efault());
    server.assert_space_unpinned();
    Ok(())
}

#[test]
fn test_copy_unmap_and_reset_under_copies_leave_no_pin_behind(
) -> Result<(), Box<dyn std::error::Error>> {
    let (server, mut vmm, _msix) = setup()?;
    let fd = vmm.ram().try_clone_fd()?;
    // Unmap while a 512 KiB copy is in flight: the notifier waits for its pins.
    for _ in 0..300 {
        go(&mut vmm, RAM, RAM + 0x8_0000, 0x8_0000)?;
        vmm.dma_unmap(RAM, 1 << 20)?;
        vmm.dma_map_fd(RAM, 1 << 20, fd.as_fd(), 0)?;
    }
    assert_eq!(server.dma().stats().leaked_pins_released, 0);
    // Reset while copies are queued and running: none of them shows after the reply.
    for round in 0..100 {
        for _ in 0..4 {
            go(&mut vmm, RAM, RAM + 0x8_0000, 0x8_0000)?;
        }
        // Let the worker start, for varying times, so that some resets meet a copy midway.
        std::thread::sleep(Duration::from_micros(round % 8 * 40));
        vmm.reset()?;
        std::thread::sleep(Duration::from_millis(2)); // room for a copy that escaped
        assert_eq!(
            vmm.read64(0, REG_STATUS)?,
            0,
            "a copy from before the reset"
        );
        vmm.enable_device()?;
    }
    vmm.reset()?;
    assert_eq!(server.dma().stats().leaked_pins_released, 0);
    server.assert_space_unpinned();
    Ok(())
}

// The errnos the device reports, as umdev maps its DMA errors.
fn libc_efault() -> u64 {
    DmaError::NotMapped { iova: 0 }.errno() as u64
}

fn libc_einval() -> u64 {
    DmaError::InvalidArgument("").errno() as u64
}

fn libc_eacces() -> u64 {
    DmaError::BusMasterDisabled { iova: 0 }.errno() as u64
}
