//! virtio-gpu through a socket, driven the way Linux's `virtio_gpu` drives it (through the
//! harness's guest-side virtio driver): display info and EDID, a framebuffer resource with
//! scattered backing, transfers checked against the screenshot, fences, the memory budget,
//! bad rectangles and offsets, backing pins held until detach and dropped by an unmap,
//! the cursor, a host-side resize, reset.
use std::time::Duration;

use umdev::pci::PciAdapter;
use umdev::testing::{DeviceAccess, EventFd, TestServer, VirtioDriver, Vmm};
use umdev::virtio::{VirtioPci, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use umdev_devices::virtio_gpu::protocol::{cmd, resp, VIRTIO_GPU_FLAG_FENCE, VIRTIO_GPU_F_EDID};
use umdev_devices::virtio_gpu::{ResizeError, VirtioGpu, VirtioGpuConfig, VirtioGpuHandle};

const RAM: u64 = 0x10_0000;
const RAM_SIZE: usize = 4 << 20;
const CTRLQ: u64 = RAM;
const CURSORQ: u64 = RAM + 0x4000;
const REQ: u64 = RAM + 0x8000;
const RESP: u64 = RAM + 0xa000;
const BACKING: u64 = RAM + 0x10_0000;
const WAIT: Duration = Duration::from_secs(5);
const XRGB: u32 = 2; // B8G8R8X8_UNORM: DRM's XRGB8888

struct Guest {
    server: TestServer<PciAdapter<VirtioPci<VirtioGpu>>>,
    vmm: Vmm,
    drv: VirtioDriver,
    msix: Vec<EventFd>,
    gpu: VirtioGpuHandle,
}

fn start(config: VirtioGpuConfig) -> Guest {
    let gpu = VirtioGpu::new(config).unwrap();
    let handle = gpu.handle();
    let server = TestServer::start_pci(VirtioPci::new(gpu).unwrap()).unwrap();
    let mut vmm = server.connect().unwrap().with_ram(RAM, RAM_SIZE).unwrap();
    vmm.enable_device().unwrap();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    let msix = drv.enable_msix(&mut vmm, 3).unwrap();
    let features = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | VIRTIO_GPU_F_EDID;
    assert!(drv.negotiate(&mut vmm, features).unwrap());
    drv.set_config_vector(&mut vmm, 0).unwrap();
    drv.setup_queue(&mut vmm, 0, 256, CTRLQ, 1).unwrap();
    drv.setup_queue(&mut vmm, 1, 16, CURSORQ, 2).unwrap();
    drv.driver_ok(&mut vmm).unwrap();
    Guest {
        server,
        vmm,
        drv,
        msix,
        gpu: handle,
    }
}

fn hdr(kind: u32, fence: Option<u64>) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&kind.to_le_bytes());
    b.extend_from_slice(
        &(if fence.is_some() {
            VIRTIO_GPU_FLAG_FENCE
        } else {
            0
        })
        .to_le_bytes(),
    );
    b.extend_from_slice(&fence.unwrap_or(0).to_le_bytes());
    b.extend_from_slice(&[0; 8]);
    b
}

fn words(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

impl Guest {
    /// Send a request on `queue` and return the response bytes.
    fn call_on(&mut self, queue: u16, req: &[u8], resp_len: u32) -> Vec<u8> {
        self.vmm.ram().write(REQ, req).unwrap();
        self.vmm.ram().fill(RESP, resp_len as usize, 0xee).unwrap();
        let mut bufs = vec![(REQ, req.len() as u32, false)];
        if resp_len > 0 {
            bufs.push((RESP, resp_len, true));
        }
        let head = self.drv.add_chain(&mut self.vmm, queue, &bufs).unwrap();
        self.drv.publish(&mut self.vmm, queue, head).unwrap();
        self.drv.kick(&mut self.vmm, queue).unwrap();
        let (id, len) = self
            .drv
            .wait_used(&mut self.vmm, queue, WAIT)
            .unwrap()
            .expect("no response");
        assert_eq!(id, u32::from(head));
        self.vmm.ram().read_vec(RESP, len as usize).unwrap()
    }

    fn call(&mut self, req: &[u8], resp_len: u32) -> Vec<u8> {
        self.call_on(0, req, resp_len)
    }

    /// A command with a no-data response: its response type.
    fn simple(&mut self, kind: u32, body: &[u32]) -> u32 {
        let mut req = hdr(kind, None);
        req.extend_from_slice(&words(body));
        let r = self.call(&req, 24);
        u32::from_le_bytes(r[..4].try_into().unwrap())
    }

    fn create(&mut self, id: u32, w: u32, h: u32) -> u32 {
        self.simple(cmd::RESOURCE_CREATE_2D, &[id, XRGB, w, h])
    }

    fn attach(&mut self, id: u32, entries: &[(u64, u32)]) -> u32 {
        let mut req = hdr(cmd::RESOURCE_ATTACH_BACKING, None);
        req.extend_from_slice(&words(&[id, entries.len() as u32]));
        for &(addr, len) in entries {
            req.extend_from_slice(&addr.to_le_bytes());
            req.extend_from_slice(&words(&[len, 0]));
        }
        let r = self.call(&req, 24);
        u32::from_le_bytes(r[..4].try_into().unwrap())
    }

    fn transfer(&mut self, id: u32, rect: [u32; 4], offset: u64) -> u32 {
        let mut req = hdr(cmd::TRANSFER_TO_HOST_2D, None);
        req.extend_from_slice(&words(&rect));
        req.extend_from_slice(&offset.to_le_bytes());
        req.extend_from_slice(&words(&[id, 0]));
        let r = self.call(&req, 24);
        u32::from_le_bytes(r[..4].try_into().unwrap())
    }
}

/// The guest pixel at (x, y) of a `w`-wide XRGB surface spread over two backing pieces:
/// the first `split` bytes at BACKING, the rest at BACKING + 0x40000.
fn put_pixels(vmm: &Vmm, w: u32, h: u32, split: u64, color: impl Fn(u32, u32) -> u32) {
    let mut bytes = Vec::new();
    for y in 0..h {
        for x in 0..w {
            bytes.extend_from_slice(&color(x, y).to_le_bytes());
        }
    }
    let split = split as usize;
    vmm.ram().write(BACKING, &bytes[..split]).unwrap();
    vmm.ram().write(BACKING + 0x40000, &bytes[split..]).unwrap();
}

fn pattern(x: u32, y: u32) -> u32 {
    (x * 4) << 16 | (y * 8) << 8 | ((x + y) & 0xff)
}

fn rgb(c: u32) -> [u8; 3] {
    [(c >> 16) as u8, (c >> 8) as u8, c as u8]
}

#[test]
fn test_virtio_gpu_display_info_and_edid_report_configured_scanouts() {
    let mut g = start(VirtioGpuConfig {
        scanouts: vec![(1024, 768), (640, 480)],
        ..Default::default()
    });
    let mut n = [0u8; 4];
    g.drv.read_config(&mut g.vmm, 8, &mut n).unwrap();
    assert_eq!(u32::from_le_bytes(n), 2, "num_scanouts");
    let r = g.call(&hdr(cmd::GET_DISPLAY_INFO, None), 24 + 16 * 24);
    assert_eq!(
        u32::from_le_bytes(r[..4].try_into().unwrap()),
        resp::OK_DISPLAY_INFO
    );
    let mode = |i: usize| -> Vec<u32> {
        (0..6)
            .map(|k| u32::from_le_bytes(r[24 + 24 * i + 4 * k..][..4].try_into().unwrap()))
            .collect()
    };
    assert_eq!(mode(0), vec![0, 0, 1024, 768, 1, 0]);
    assert_eq!(mode(1), vec![0, 0, 640, 480, 1, 0]);
    assert_eq!(mode(2)[4], 0, "scanout 2 disabled");
    let mut req = hdr(cmd::GET_EDID, None);
    req.extend_from_slice(&words(&[1, 0]));
    let r = g.call(&req, 24 + 8 + 1024);
    assert_eq!(
        u32::from_le_bytes(r[..4].try_into().unwrap()),
        resp::OK_EDID
    );
    assert_eq!(u32::from_le_bytes(r[24..28].try_into().unwrap()), 128);
    let edid = &r[32..160];
    assert_eq!(&edid[..8], &[0, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0]);
    assert_eq!(u32::from(edid[56]) | (u32::from(edid[58] >> 4) << 8), 640);
    let mut req = hdr(cmd::GET_EDID, None);
    req.extend_from_slice(&words(&[2, 0]));
    let r = g.call(&req, 24 + 8 + 1024);
    assert_eq!(
        u32::from_le_bytes(r[..4].try_into().unwrap()),
        resp::ERR_INVALID_SCANOUT_ID
    );
}

#[test]
fn test_virtio_gpu_scattered_backing_transfers_match_the_screenshot() {
    let mut g = start(VirtioGpuConfig::default());
    let (w, h) = (100u32, 40u32); // 400-byte rows: rows straddle the pieces' pages
    let size = u64::from(w * h * 4);
    let split = 0x2100; // first piece ends mid-row, not on a page
    put_pixels(&g.vmm, w, h, split, pattern);
    assert_eq!(g.create(1, w, h), resp::OK_NODATA);
    let entries = [
        (BACKING, split as u32),
        (BACKING + 0x40000, (size - split) as u32),
    ];
    assert_eq!(g.attach(1, &entries), resp::OK_NODATA);
    assert!(g.server.dma().stats().pinned_pages > 0, "backing is pinned");
    assert_eq!(
        g.simple(cmd::SET_SCANOUT, &[0, 0, w, h, 0, 1]),
        resp::OK_NODATA
    );
    assert_eq!(g.transfer(1, [0, 0, w, h], 0), resp::OK_NODATA);
    // Fenced flush: the response echoes the fence.
    let mut req = hdr(cmd::RESOURCE_FLUSH, Some(77));
    req.extend_from_slice(&words(&[0, 0, w, h, 1, 0]));
    let r = g.call(&req, 24);
    assert_eq!(
        u32::from_le_bytes(r[..4].try_into().unwrap()),
        resp::OK_NODATA
    );
    assert_eq!(
        u32::from_le_bytes(r[4..8].try_into().unwrap()),
        VIRTIO_GPU_FLAG_FENCE
    );
    assert_eq!(u64::from_le_bytes(r[8..16].try_into().unwrap()), 77);
    let shot = g.gpu.screenshot(0).expect("scanout shows resource 1");
    assert_eq!((shot.width, shot.height), (w, h));
    for y in 0..h {
        for x in 0..w {
            assert_eq!(shot.pixel(x, y), Some(rgb(pattern(x, y))), "pixel {x},{y}");
        }
    }
    assert_eq!(g.gpu.flushes(0), 1);
    // A partial transfer: a 10×5 rectangle at (33, 7), offset as Linux computes it.
    put_pixels(&g.vmm, w, h, split, |x, y| !pattern(x, y) & 0xff_ffff);
    let offset = u64::from(7 * w * 4 + 33 * 4);
    assert_eq!(g.transfer(1, [33, 7, 10, 5], offset), resp::OK_NODATA);
    let shot = g.gpu.screenshot(0).unwrap();
    for y in 0..h {
        for x in 0..w {
            let inside = (33..43).contains(&x) && (7..12).contains(&y);
            let c = if inside {
                !pattern(x, y) & 0xff_ffff
            } else {
                pattern(x, y)
            };
            assert_eq!(shot.pixel(x, y), Some(rgb(c)), "pixel {x},{y}");
        }
    }
    let png = std::env::temp_dir().join(format!("umdev-virtio-gpu-{}.png", std::process::id()));
    shot.write_png(&png).unwrap();
    assert!(std::fs::metadata(&png).unwrap().len() > 100);
    let _ = std::fs::remove_file(png);
    // Unref releases the pins and the memory.
    assert_eq!(g.simple(cmd::RESOURCE_UNREF, &[1, 0]), resp::OK_NODATA);
    assert_eq!(g.gpu.memory().0, 0);
    assert!(g.gpu.screenshot(0).is_none());
    g.server.assert_space_unpinned();
}

#[test]
fn test_virtio_gpu_bad_ids_rects_offsets_and_entries_are_refused() {
    let mut g = start(VirtioGpuConfig::default());
    let (w, h) = (64u32, 16u32);
    assert_eq!(g.create(1, w, h), resp::OK_NODATA);
    assert_eq!(g.create(1, w, h), resp::ERR_INVALID_RESOURCE_ID, "exists");
    assert_eq!(g.create(0, w, h), resp::ERR_INVALID_RESOURCE_ID, "id 0");
    assert_eq!(
        g.simple(cmd::RESOURCE_CREATE_2D, &[2, 999, 4, 4]),
        resp::ERR_INVALID_PARAMETER
    );
    assert_eq!(g.create(2, 0, 4), resp::ERR_INVALID_PARAMETER, "empty");
    assert_eq!(
        g.transfer(1, [0, 0, w, h], 0),
        resp::ERR_UNSPEC,
        "no backing yet"
    );
    assert_eq!(
        g.attach(1, &[(BACKING, 0)]),
        resp::ERR_INVALID_PARAMETER,
        "empty entry"
    );
    assert_eq!(
        g.attach(1, &[(u64::MAX - 8, 64)]),
        resp::ERR_INVALID_PARAMETER,
        "wraps"
    );
    assert_eq!(
        g.attach(1, &[(1 << 40, 4096)]),
        resp::ERR_UNSPEC,
        "unmapped: not pinnable"
    );
    assert_eq!(
        g.attach(9, &[(BACKING, 4096)]),
        resp::ERR_INVALID_RESOURCE_ID
    );
    g.server.assert_space_unpinned();
    assert_eq!(g.attach(1, &[(BACKING, w * h * 4)]), resp::OK_NODATA);
    assert_eq!(
        g.attach(1, &[(BACKING, 4096)]),
        resp::ERR_UNSPEC,
        "already backed"
    );
    for (rect, offset) in [
        ([0, 0, w + 1, 1], 0),        // wider than the resource
        ([0, h, 1, 1], 0),            // below it
        ([u32::MAX, 0, 2, 1], 0),     // x + width wraps
        ([0, 0, 0, 0], 0),            // empty
        ([0, 0, w, h], 4),            // last row beyond the backing
        ([0, 0, 1, 1], u64::MAX - 2), // offset wraps
    ] {
        assert_eq!(
            g.transfer(1, rect, offset),
            resp::ERR_INVALID_PARAMETER,
            "{rect:?} +{offset}"
        );
    }
    assert_eq!(
        g.simple(cmd::SET_SCANOUT, &[0, 0, w, h, 5, 1]),
        resp::ERR_INVALID_SCANOUT_ID
    );
    assert_eq!(
        g.simple(cmd::SET_SCANOUT, &[0, 0, w, h, 0, 7]),
        resp::ERR_INVALID_RESOURCE_ID
    );
    assert_eq!(
        g.simple(cmd::SET_SCANOUT, &[1, 0, w, h, 0, 1]),
        resp::ERR_INVALID_PARAMETER
    );
    assert_eq!(
        g.simple(cmd::RESOURCE_UNREF, &[7, 0]),
        resp::ERR_INVALID_RESOURCE_ID
    );
    assert_eq!(g.simple(0x9999, &[]), resp::ERR_UNSPEC, "unknown command");
    // Too short for its command.
    let r = g.call(&hdr(cmd::RESOURCE_CREATE_2D, None), 24);
    assert_eq!(
        u32::from_le_bytes(r[..4].try_into().unwrap()),
        resp::ERR_UNSPEC
    );
    assert_eq!(
        g.simple(cmd::RESOURCE_DETACH_BACKING, &[1, 0]),
        resp::OK_NODATA
    );
    assert_eq!(
        g.simple(cmd::RESOURCE_DETACH_BACKING, &[1, 0]),
        resp::ERR_UNSPEC
    );
    g.server.assert_space_unpinned();
}

#[test]
fn test_virtio_gpu_memory_beyond_the_budget_is_out_of_memory() {
    let mut g = start(VirtioGpuConfig {
        memory_budget: 64 << 10,
        ..Default::default()
    });
    for id in 1..=4 {
        assert_eq!(g.create(id, 64, 64), resp::OK_NODATA, "16 KiB each");
    }
    assert_eq!(g.create(5, 64, 64), resp::ERR_OUT_OF_MEMORY);
    assert_eq!(
        g.create(6, 1 << 20, 1 << 20),
        resp::ERR_OUT_OF_MEMORY,
        "4 TiB"
    );
    assert_eq!(g.gpu.memory(), (64 << 10, 64 << 10));
    assert_eq!(g.simple(cmd::RESOURCE_UNREF, &[2, 0]), resp::OK_NODATA);
    assert_eq!(
        g.create(5, 64, 64),
        resp::OK_NODATA,
        "room again after an unref"
    );
}

#[test]
fn test_virtio_gpu_backing_pins_are_dropped_by_unmap_and_reset() {
    let mut g = start(VirtioGpuConfig::default());
    assert_eq!(g.create(1, 64, 64), resp::OK_NODATA);
    assert_eq!(g.attach(1, &[(BACKING, 64 * 64 * 4)]), resp::OK_NODATA);
    assert_eq!(g.gpu.resources(), (1, 1));
    assert_eq!(g.server.dma().stats().pinned_pages, 4);
    // The guest's memory goes away (a vIOMMU unmap, a memory hot-unplug): the notifier
    // drops the backing before the unmap is answered.
    g.vmm.dma_unmap(RAM, RAM_SIZE as u64).unwrap();
    assert_eq!(g.gpu.resources(), (1, 0));
    g.server.assert_space_unpinned();

    let mut g = start(VirtioGpuConfig::default());
    assert_eq!(g.create(1, 64, 64), resp::OK_NODATA);
    assert_eq!(g.attach(1, &[(BACKING, 64 * 64 * 4)]), resp::OK_NODATA);
    assert_eq!(
        g.simple(cmd::SET_SCANOUT, &[0, 0, 64, 64, 0, 1]),
        resp::OK_NODATA
    );
    let shown = g.gpu.screenshot(0).unwrap();
    g.drv.set_status(&mut g.vmm, 0).unwrap(); // virtio reset
    assert!(g.gpu.screenshot(0).is_none(), "nothing shown after a reset");
    assert_eq!(
        g.gpu.last_frame(0),
        Some(shown),
        "the frame before the reset"
    );
    assert_eq!(g.gpu.resources(), (0, 0));
    assert_eq!(g.gpu.memory().0, 0);
    g.server.assert_space_unpinned();
}

#[test]
fn test_virtio_gpu_cursor_is_drawn_in_the_screenshot() {
    let mut g = start(VirtioGpuConfig::default());
    let (w, h) = (128u32, 128u32);
    put_pixels(&g.vmm, w, h, 0, |_, _| 0x0000_00ff); // blue screen
    assert_eq!(g.create(1, w, h), resp::OK_NODATA);
    assert_eq!(
        g.attach(1, &[(BACKING + 0x40000, w * h * 4)]),
        resp::OK_NODATA
    );
    assert_eq!(g.transfer(1, [0, 0, w, h], 0), resp::OK_NODATA);
    assert_eq!(
        g.simple(cmd::SET_SCANOUT, &[0, 0, w, h, 0, 1]),
        resp::OK_NODATA
    );
    // A 64×64 cursor, opaque red (B8G8R8A8: alpha in byte 3), hot spot (2, 3).
    let cursor: Vec<u8> = (0..64 * 64).flat_map(|_| [0u8, 0, 0xff, 0xff]).collect();
    g.vmm.ram().write(BACKING + 0x80000, &cursor).unwrap();
    assert_eq!(
        g.simple(cmd::RESOURCE_CREATE_2D, &[2, 1, 64, 64]),
        resp::OK_NODATA
    );
    assert_eq!(
        g.attach(2, &[(BACKING + 0x80000, 64 * 64 * 4)]),
        resp::OK_NODATA
    );
    assert_eq!(g.transfer(2, [0, 0, 64, 64], 0), resp::OK_NODATA);
    let mut req = hdr(cmd::UPDATE_CURSOR, None);
    req.extend_from_slice(&words(&[0, 50, 60, 0, 2, 2, 3, 0]));
    g.call_on(1, &req, 0); // the cursor queue: no response buffer, as Linux sends it
    let shot = g.gpu.screenshot(0).unwrap();
    assert_eq!(shot.pixel(48, 57), Some([0xff, 0, 0]), "cursor's top-left");
    assert_eq!(shot.pixel(47, 57), Some([0, 0, 0xff]), "left of it");
    assert_eq!(
        shot.pixel(111, 120),
        Some([0xff, 0, 0]),
        "cursor's bottom-right"
    );
    let mut req = hdr(cmd::MOVE_CURSOR, None);
    req.extend_from_slice(&words(&[0, 2, 3, 0, 0, 0, 0, 0]));
    g.call_on(1, &req, 0);
    let shot = g.gpu.screenshot(0).unwrap();
    assert_eq!(shot.pixel(0, 0), Some([0xff, 0, 0]));
    assert_eq!(shot.pixel(111, 120), Some([0, 0, 0xff]), "moved away");
}

#[test]
fn test_virtio_gpu_host_resize_raises_the_display_event() {
    let mut g = start(VirtioGpuConfig::default());
    g.gpu.resize(0, 1920, 1080).unwrap();
    assert!(
        g.vmm.wait_irq_serving(&g.msix[0], WAIT).unwrap(),
        "no config interrupt"
    );
    let mut ev = [0u8; 4];
    g.drv.read_config(&mut g.vmm, 0, &mut ev).unwrap();
    assert_eq!(u32::from_le_bytes(ev), 1, "VIRTIO_GPU_EVENT_DISPLAY");
    g.drv
        .write_config(&mut g.vmm, 4, &1u32.to_le_bytes())
        .unwrap();
    g.drv.read_config(&mut g.vmm, 0, &mut ev).unwrap();
    assert_eq!(u32::from_le_bytes(ev), 0, "cleared through events_clear");
    let r = g.call(&hdr(cmd::GET_DISPLAY_INFO, None), 24 + 16 * 24);
    assert_eq!(u32::from_le_bytes(r[32..36].try_into().unwrap()), 1920);
    assert_eq!(u32::from_le_bytes(r[36..40].try_into().unwrap()), 1080);
    assert_eq!(
        g.gpu.resize(3, 800, 600),
        Err(ResizeError::NoSuchScanout(1))
    );
    assert_eq!(
        g.gpu.resize(0, 0, 600),
        Err(ResizeError::OutOfRange(0, 600))
    );
    assert_eq!(
        g.gpu.resize(0, 800, 4096),
        Err(ResizeError::OutOfRange(800, 4096))
    );
    // A refused resize changed nothing.
    let r = g.call(&hdr(cmd::GET_DISPLAY_INFO, None), 24 + 16 * 24);
    assert_eq!(u32::from_le_bytes(r[32..36].try_into().unwrap()), 1920);
}
