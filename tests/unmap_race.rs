//! Unmap races through a real socket: the device's worker thread pins guest pages and
//! writes them (GPU READBACK through GTT pins, ccw READ programs straight into pinned pages)
//! while the VMM (`vfio_user::Client`) unmaps and remaps the very memory they use.
//!
//! After each DMA_UNMAP reply the test overwrites the old memfd with a poison byte and keeps
//! it for a while: a device write after the unmap would show up as changed bytes. Pins and
//! the DMA accounting return to zero at the end, and nothing had to be force-released (the
//! devices honour the unmap notifier).

#[path = "common/independent_client.rs"]
mod independent;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use independent::{client_map, enable_device, SocketRegs};
use umdev::device::region_index;
use umdev::dma::{DmaConfig, PinPolicy};
use umdev::testing::{memfd, wait_until, GuestMemory, TestServer};
use umdev_devices::ccw::driver::{self as ccw_driver, regs as ccw_regs, CcwWord, Fault};
use umdev_devices::ccw::driver::{OperationBlock, StatusBlock};
use umdev_devices::ccw::{Ccw, CcwConfig};
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, Gpu, GpuConfig};

const POISON: u8 = 0xde;

/// Memory the VMM unmapped: poisoned after the unmap reply, checked later.
struct Retired {
    file: File,
    len: usize,
    what: String,
}

impl Retired {
    fn new(file: File, len: usize, what: String) -> Retired {
        file.write_all_at(&vec![POISON; len], 0).unwrap();
        Retired { file, len, what }
    }

    fn assert_untouched(&self) {
        let mut b = vec![0u8; self.len];
        self.file.read_exact_at(&mut b, 0).unwrap();
        if let Some(i) = b.iter().position(|&x| x != POISON) {
            panic!(
                "{}: byte {i} became {:#x} after the DMA_UNMAP reply",
                self.what, b[i]
            );
        }
    }
}

/// Keep the last few retired memfds; check each one when it leaves (and all at the end).
#[derive(Default)]
struct Graveyard(Vec<Retired>);

impl Graveyard {
    fn push(&mut self, r: Retired) {
        self.0.push(r);
        if self.0.len() > 6 {
            self.0.remove(0).assert_untouched();
        }
    }

    fn check_all(&self) {
        self.0.iter().for_each(Retired::assert_untouched);
    }
}

const RING_GPA: u64 = 0x1000_0000;
const SURF_GPA: u64 = 0x2000_0000;
const SURF_PAGES: u64 = 16;
const SURF_SIZE: u64 = SURF_PAGES * 4096;

#[test]
fn test_unmap_race_gpu_readbacks_never_write_unmapped_memory() {
    let gpu = Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap();
    let served = TestServer::builder_pci(gpu)
        .unwrap()
        .dma_config(DmaConfig {
            policy: PinPolicy::Lock,
            lock_limit_bytes: Some(1 << 20),
            ..DmaConfig::default()
        })
        .start()
        .unwrap();
    let mut client = independent::connect(served.path());
    enable_device(&mut client);
    let mut ring = GuestMemory::new(RING_GPA, 64 * 1024).unwrap();
    client_map(
        &mut client,
        served.dma(),
        &ring.fd(),
        0,
        RING_GPA,
        64 * 1024,
    );
    let mut surf = memfd(SURF_SIZE).unwrap();
    client_map(&mut client, served.dma(), &surf, 0, SURF_GPA, SURF_SIZE);
    let mut drv = Driver::probe(SocketRegs::new(client)).unwrap();
    drv.set_mode(64, 64, 256).unwrap();
    drv.setup_ring(RING_GPA, 32 * 1024).unwrap();
    for i in 0..SURF_PAGES as u32 {
        drv.set_gtt(i, SURF_GPA + u64::from(i) * 4096, true)
            .unwrap();
    }
    let mut graveyard = Graveyard::default();
    let mut fence = 0;
    let mut faults = 0;
    for it in 0..40u32 {
        // A batch of readbacks (16 rows, one GTT page each) the worker is busy with...
        let color = 0x0010_2030 + it;
        let mut cmds = vec![Command::FillRect {
            x: 0,
            y: 0,
            w: 64,
            h: 64,
            color,
        }];
        for _ in 0..24 {
            cmds.push(Command::Readback {
                src_x: 0,
                src_y: 0,
                w: 64,
                h: SURF_PAGES as u32,
                gtt_index: 0,
                stride: 4096,
            });
        }
        fence += 1;
        cmds.push(Command::Fence { value: fence });
        drv.submit(&mut ring, &cmds).unwrap();
        // ...while the VMM pulls the memory away, then maps fresh memory at the same IOVA.
        drv.regs().client.dma_unmap(SURF_GPA, SURF_SIZE).unwrap();
        let old = std::mem::replace(&mut surf, memfd(SURF_SIZE).unwrap());
        graveyard.push(Retired::new(
            old,
            SURF_SIZE as usize,
            format!("surface #{it}"),
        ));
        let (dma, regs) = (served.dma(), drv.regs());
        client_map(&mut regs.client, dma, &surf, 0, SURF_GPA, SURF_SIZE);
        drv.wait_fence(fence).unwrap();
        if drv.read(REG_IRQ_STATUS).unwrap() & IRQ_ERROR != 0 {
            assert_eq!(
                drv.read(REG_ERROR_CODE).unwrap(),
                7,
                "only GTT_FAULT is expected"
            );
            faults += 1;
            drv.ack(IRQ_ERROR).unwrap();
        }
    }
    graveyard.check_all();
    // Without an unmap, the same readback really lands in the surface memory (so the
    // poison checks above watched memory the device does write).
    fence += 1;
    let cmds = [
        Command::FillRect {
            x: 0,
            y: 0,
            w: 64,
            h: 64,
            color: 0x0055_aa11,
        },
        Command::Readback {
            src_x: 0,
            src_y: 0,
            w: 64,
            h: SURF_PAGES as u32,
            gtt_index: 0,
            stride: 4096,
        },
        Command::Fence { value: fence },
    ];
    drv.submit(&mut ring, &cmds).unwrap();
    drv.wait_fence(fence).unwrap();
    let mut px = [0u8; 4];
    surf.read_exact_at(&mut px, (SURF_PAGES - 1) * 4096 + 252)
        .unwrap();
    assert_eq!(u32::from_le_bytes(px), 0x0055_aa11);
    eprintln!("GPU: 40 unmaps under load, {faults} batches saw GTT_FAULT");
    drv.clear_gtt(0, SURF_PAGES as u32).unwrap();
    assert_eq!(served.device().device().pins_held(), 0);
    served.assert_space_unpinned();
}

const RAM: u64 = 0x10_0000;
const RAM_SIZE: u64 = 64 << 10;
const OPB: u64 = RAM;
const STATUS: u64 = RAM + 0x100;
const PROGRAM: u64 = RAM + 0x1000;
const DATA_GPA: u64 = 0x100_0000;
const DATA_PAGES: u64 = 32;
const DATA_SIZE: u64 = DATA_PAGES * 4096;

#[test]
fn test_unmap_race_ccw_reads_never_write_unmapped_memory() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("race.img");
    // Image bytes that are not poison.
    std::fs::write(&image, vec![0x5a; 1 << 20]).unwrap();
    let ccw = Ccw::new(CcwConfig::new(&image)).unwrap();
    let served = TestServer::builder_pci(ccw)
        .unwrap()
        .dma_config(DmaConfig {
            policy: PinPolicy::Lock,
            lock_limit_bytes: Some(1 << 20),
            ..DmaConfig::default()
        })
        .in_dir(dir)
        .start()
        .unwrap();
    let mut client = independent::connect(served.path());
    enable_device(&mut client);
    let ram = memfd(RAM_SIZE).unwrap();
    client_map(&mut client, served.dma(), &ram, 0, RAM, RAM_SIZE);
    let mut data = memfd(DATA_SIZE).unwrap();
    client_map(&mut client, served.dma(), &data, 0, DATA_GPA, DATA_SIZE);
    // Four chained 32 KiB READs covering the 32 data pages, eight times over.
    let mut words = Vec::new();
    for _pass in 0..8 {
        for i in 0..4u64 {
            words.push(CcwWord::read(32 * 1024, DATA_GPA + i * 32 * 1024).chain());
        }
    }
    words.push(CcwWord::nop());
    ram.write_all_at(&ccw_driver::encode_program(&words), PROGRAM - RAM)
        .unwrap();
    let opb = OperationBlock {
        program: PROGRAM,
        block: 0,
        status: STATUS,
        flags: 0,
        reserved: 0,
    };
    ram.write_all_at(&opb.to_bytes(), OPB - RAM).unwrap();
    let reg = |c: &mut vfio_user::Client, off: u64| {
        let mut b = [0u8; 4];
        c.region_read(region_index::BAR0, off, &mut b).unwrap();
        u32::from_le_bytes(b)
    };
    let set = |c: &mut vfio_user::Client, off: u64, v: u32| {
        c.region_write(region_index::BAR0, off, &v.to_le_bytes())
            .unwrap()
    };
    set(&mut client, ccw_regs::OPB_ADDR_LO, OPB as u32);
    set(&mut client, ccw_regs::OPB_ADDR_HI, 0);
    let mut graveyard = Graveyard::default();
    let (mut ok, mut aborted, mut unmapped) = (0, 0, 0);
    for it in 0..40 {
        let done = reg(&mut client, ccw_regs::COMPLETED);
        set(&mut client, ccw_regs::START, 1);
        // Race the program: unmap its data pages, poison them, map fresh memory.
        std::thread::sleep(Duration::from_micros(100 * (it % 8)));
        client.dma_unmap(DATA_GPA, DATA_SIZE).unwrap();
        let old = std::mem::replace(&mut data, memfd(DATA_SIZE).unwrap());
        graveyard.push(Retired::new(old, DATA_SIZE as usize, format!("data #{it}")));
        client_map(&mut client, served.dma(), &data, 0, DATA_GPA, DATA_SIZE);
        assert!(
            wait_until(Duration::from_secs(5), || reg(
                &mut client,
                ccw_regs::COMPLETED
            ) != done),
            "program {it} never completed"
        );
        let irq = reg(&mut client, ccw_regs::IRQ_STATUS);
        set(&mut client, ccw_regs::IRQ_STATUS, irq);
        let last = reg(&mut client, ccw_regs::LAST_STATUS);
        match ccw_driver::decode_last_status(last).2 {
            Some(Fault::None) => ok += 1,
            Some(Fault::Aborted) => aborted += 1,
            Some(Fault::DataAddressInvalid) => unmapped += 1,
            other => panic!("program {it}: unexpected end {other:?}"),
        }
        assert_eq!(served.device().device().pins_held(), 0, "program {it}");
    }
    graveyard.check_all();
    eprintln!(
        "ccw: 40 unmaps under load: {ok} completed, {aborted} aborted, {unmapped} saw no mapping"
    );
    // A last program against the current memory reads the image for real.
    set(&mut client, ccw_regs::IRQ_STATUS, ccw_regs::IRQ_ALL);
    let done = reg(&mut client, ccw_regs::COMPLETED);
    set(&mut client, ccw_regs::START, 1);
    assert!(wait_until(Duration::from_secs(5), || reg(
        &mut client,
        ccw_regs::COMPLETED
    ) != done));
    let mut sb = [0u8; 32];
    ram.read_exact_at(&mut sb, STATUS - RAM).unwrap();
    assert!(StatusBlock::from_bytes(&sb).is_ok());
    let mut b = vec![0u8; DATA_SIZE as usize];
    data.read_exact_at(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 0x5a), "image data not read");
    served.assert_space_unpinned();
}

#[test]
fn test_unmap_race_ccw_disconnect_mid_program_releases_everything_next_client_works() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disc.img");
    std::fs::write(&image, vec![0x5a; 1 << 20]).unwrap();
    let ccw = Ccw::new(CcwConfig::new(&image)).unwrap();
    let served = TestServer::builder_pci(ccw)
        .unwrap()
        .dma_config(DmaConfig {
            policy: PinPolicy::Lock,
            lock_limit_bytes: Some(1 << 20),
            ..DmaConfig::default()
        })
        .in_dir(dir)
        .start()
        .unwrap();
    let ram = memfd(RAM_SIZE).unwrap();
    let mut words = Vec::new();
    for _pass in 0..8 {
        for i in 0..4u64 {
            words.push(CcwWord::read(32 * 1024, DATA_GPA + i * 32 * 1024).chain());
        }
    }
    words.push(CcwWord::nop());
    ram.write_all_at(&ccw_driver::encode_program(&words), PROGRAM - RAM)
        .unwrap();
    let opb = OperationBlock {
        program: PROGRAM,
        block: 0,
        status: STATUS,
        flags: 0,
        reserved: 0,
    };
    ram.write_all_at(&opb.to_bytes(), OPB - RAM).unwrap();
    let mut graveyard = Graveyard::default();
    for it in 0..12u64 {
        let mut client = independent::connect(served.path());
        enable_device(&mut client);
        let data = memfd(DATA_SIZE).unwrap();
        client_map(&mut client, served.dma(), &ram, 0, RAM, RAM_SIZE);
        client_map(&mut client, served.dma(), &data, 0, DATA_GPA, DATA_SIZE);
        for (off, v) in [
            (ccw_regs::OPB_ADDR_LO, OPB as u32),
            (ccw_regs::OPB_ADDR_HI, 0),
            (ccw_regs::START, 1),
        ] {
            client
                .region_write(region_index::BAR0, off, &v.to_le_bytes())
                .unwrap();
        }
        std::thread::sleep(Duration::from_micros(150 * (it % 4)));
        drop(client); // the VMM dies mid-program
        assert!(
            wait_until(Duration::from_secs(5), || served.dma().stats().maps == 0),
            "maps not released at disconnect"
        );
        // Disconnect aborts without storing status; the memory is the VMM's again.
        graveyard.push(Retired::new(
            data,
            DATA_SIZE as usize,
            format!("data #{it}"),
        ));
        assert_eq!(served.device().device().pins_held(), 0, "round {it}");
        served.assert_space_unpinned();
    }
    graveyard.check_all();
    // The next client gets a working device.
    let mut client = independent::connect(served.path());
    enable_device(&mut client);
    let data = memfd(DATA_SIZE).unwrap();
    client_map(&mut client, served.dma(), &ram, 0, RAM, RAM_SIZE);
    client_map(&mut client, served.dma(), &data, 0, DATA_GPA, DATA_SIZE);
    let reg = |c: &mut vfio_user::Client, off: u64| {
        let mut b = [0u8; 4];
        c.region_read(region_index::BAR0, off, &mut b).unwrap();
        u32::from_le_bytes(b)
    };
    let done = reg(&mut client, ccw_regs::COMPLETED);
    for (off, v) in [
        (ccw_regs::OPB_ADDR_LO, OPB as u32),
        (ccw_regs::OPB_ADDR_HI, 0),
        (ccw_regs::START, 1),
    ] {
        client
            .region_write(region_index::BAR0, off, &v.to_le_bytes())
            .unwrap();
    }
    assert!(wait_until(Duration::from_secs(5), || reg(
        &mut client,
        ccw_regs::COMPLETED
    ) != done));
    let mut sb = [0u8; 32];
    ram.read_exact_at(&mut sb, STATUS - RAM).unwrap();
    assert!(
        StatusBlock::from_bytes(&sb).is_ok(),
        "{:?}",
        StatusBlock::from_bytes(&sb)
    );
    let mut b = vec![0u8; DATA_SIZE as usize];
    data.read_exact_at(&mut b, 0).unwrap();
    assert!(b.iter().all(|&x| x == 0x5a), "image data not read");
    served.assert_space_unpinned();
}

#[test]
fn test_unmap_race_fdless_no_dma_request_for_range_after_unmap_reply() {
    use umdev::testing::{Answer, DeviceAccess, FdlessMemory, RawClient, Vmm};
    const FDLESS: u64 = 0x8000_0000;
    const SIZE: u64 = 64 * 1024;
    let gpu = Gpu::new(GpuConfig { fb_size: 64 * 1024 }).unwrap();
    let served = TestServer::builder_pci(gpu).unwrap().start().unwrap();
    // Small transfers: a 64 KiB device write becomes 16 DMA_WRITE round trips.
    let caps = r#"{"capabilities":{"max_msg_fds":16,"max_data_xfer_size":4096,"pgsizes":4096,"max_dma_maps":65535}}"#;
    let (c, _) = RawClient::negotiated(served.path(), caps);
    let mut vmm = Vmm::from_client(c).with_fdless(FdlessMemory::new(FDLESS, SIZE as usize));
    vmm.set_answer(Answer::Honest);
    // Memory space + Bus Master: the test's "device thread" DMAs through the device's handle.
    vmm.write_bytes(region_index::CONFIG, 4, &6u16.to_le_bytes())
        .unwrap();
    for round in 0..6 {
        vmm.dma_map_fdless(FDLESS, SIZE).unwrap();
        let h = served.dma().handle();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let device = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let data = vec![0xab; SIZE as usize];
                let mut buf = vec![0u8; SIZE as usize];
                let mut i = 0u32;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    i += 1;
                    let _ = if i.is_multiple_of(2) {
                        h.write(FDLESS, &data)
                    } else {
                        h.read(FDLESS, &mut buf)
                    };
                    std::thread::yield_now();
                }
            })
        };
        // Let the device's transfers get going, then unmap in the middle of them.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while vmm.requests() < 8 * (round + 1) {
            assert!(
                std::time::Instant::now() < deadline,
                "device thread never ran"
            );
            vmm.read32(region_index::BAR0, 0).unwrap();
        }
        let p = umdev::protocol::dma_map::DmaUnmapRequest {
            argsz: 24,
            all: false,
            iova: FDLESS,
            size: SIZE,
        }
        .encode();
        let m = vmm
            .call(umdev::protocol::Command::DmaUnmap, &p, &[])
            .unwrap();
        assert!(!m.header.is_error(), "unmap errno {}", m.header.error);
        let at_reply = vmm.log().len();
        // Keep serving for a while: the device must not ask for the unmapped range again.
        for _ in 0..50 {
            vmm.read32(region_index::BAR0, 0).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !device.is_finished() {
            assert!(
                std::time::Instant::now() < deadline,
                "device thread did not stop"
            );
            vmm.read32(region_index::BAR0, 0).unwrap();
        }
        device.join().unwrap();
        let late: Vec<_> = vmm.log()[at_reply..]
            .iter()
            .filter(|r| (FDLESS..FDLESS + SIZE).contains(&r.iova))
            .collect();
        assert!(
            late.is_empty(),
            "round {round}: {} DMA requests for the range after its DMA_UNMAP reply, first {:x?}",
            late.len(),
            late[0]
        );
    }
}
