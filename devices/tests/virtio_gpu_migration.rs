//! virtio-gpu live migration, driven by the harness's guest-side virtio driver and its
//! VMM-side migration driver (`umdev::testing::migrate` / `Migration`): resources, their
//! pixels, backing (re-pinned on the destination at first use), scanout and cursor move to
//! a second device, whose screenshot is the source's pixel for pixel and whose queues
//! continue; STOP with commands in flight completes each exactly once; hostile, cut and
//! random sections are refused without a panic; a destination with a smaller budget
//! refuses resources beyond it.

use std::collections::BTreeMap;
use std::time::Duration;

use proptest::prelude::*;
use umdev::device::irq_index;
use umdev::migration::{decode_state, encode_state, Decoder, Migrate, MigrationError};
use umdev::pci::PciAdapter;
use umdev::testing::{
    migrate, DeviceAccess, EventFd, MigrateOptions, Migration, TestServer, VirtioDriver, Vmm,
    MIGRATION_CAPS,
};
use umdev::virtio::migration::{TransportStateV1, TRANSPORT_FORMAT};
use umdev::virtio::{VirtioMigrate, VirtioPci, VIRTIO_F_VERSION_1, VIRTIO_RING_F_EVENT_IDX};
use umdev_devices::virtio_gpu::migration::{StateV1, STATE_FORMAT, STATE_VERSION};
use umdev_devices::virtio_gpu::protocol::{cmd, resp, VIRTIO_GPU_FLAG_FENCE, VIRTIO_GPU_F_EDID};
use umdev_devices::virtio_gpu::{VirtioGpu, VirtioGpuConfig, VirtioGpuHandle};

const RAM: u64 = 0x10_0000;
const RAM_SIZE: usize = 4 << 20;
const CTRLQ: u64 = RAM;
const CURSORQ: u64 = RAM + 0x4000;
const REQ: u64 = RAM + 0x8000;
const RESP: u64 = RAM + 0xa000;
/// Request slots for commands posted together (0x80 bytes each) and their responses.
const REQS: u64 = RAM + 0xc000;
const RESPS: u64 = RAM + 0xe000;
const BACKING: u64 = RAM + 0x10_0000;
const WAIT: Duration = Duration::from_secs(5);
const XRGB: u32 = 2; // B8G8R8X8
const BGRA: u32 = 1; // B8G8R8A8

type Server = TestServer<PciAdapter<VirtioPci<VirtioGpu>>>;

struct Guest {
    server: Server,
    vmm: Vmm,
    drv: Option<VirtioDriver>,
    msix: Vec<EventFd>,
    gpu: VirtioGpuHandle,
}

/// A device with `config` and a VMM that can migrate it (no driver yet).
fn device(config: VirtioGpuConfig) -> Guest {
    umdev::testing::init_logs();
    let gpu = VirtioGpu::new(config).unwrap();
    let handle = gpu.handle();
    let server = TestServer::start_pci(VirtioPci::new(gpu).unwrap()).unwrap();
    let mut vmm = Vmm::connect_with_caps(server.path(), MIGRATION_CAPS)
        .unwrap()
        .with_ram(RAM, RAM_SIZE)
        .unwrap();
    vmm.enable_device().unwrap();
    Guest {
        server,
        vmm,
        drv: None,
        msix: Vec::new(),
        gpu: handle,
    }
}

/// A device the guest's driver brought up (control queue 256, cursor queue 16).
fn start(config: VirtioGpuConfig) -> Guest {
    let mut g = device(config);
    let mut drv = VirtioDriver::probe(&mut g.vmm).unwrap();
    g.msix = drv.enable_msix(&mut g.vmm, 3).unwrap();
    let features = VIRTIO_F_VERSION_1 | VIRTIO_RING_F_EVENT_IDX | VIRTIO_GPU_F_EDID;
    assert!(drv.negotiate(&mut g.vmm, features).unwrap());
    drv.set_config_vector(&mut g.vmm, 0).unwrap();
    drv.setup_queue(&mut g.vmm, 0, 256, CTRLQ, 1).unwrap();
    drv.setup_queue(&mut g.vmm, 1, 16, CURSORQ, 2).unwrap();
    drv.driver_ok(&mut g.vmm).unwrap();
    g.drv = Some(drv);
    g
}

fn hdr(kind: u32, fence: Option<u64>) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&kind.to_le_bytes());
    let flags = if fence.is_some() {
        VIRTIO_GPU_FLAG_FENCE
    } else {
        0
    };
    b.extend_from_slice(&flags.to_le_bytes());
    b.extend_from_slice(&fence.unwrap_or(0).to_le_bytes());
    b.extend_from_slice(&[0; 8]);
    b
}

fn words(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_le_bytes()).collect()
}

fn transfer_req(id: u32, rect: [u32; 4], offset: u64, fence: Option<u64>) -> Vec<u8> {
    let mut req = hdr(cmd::TRANSFER_TO_HOST_2D, fence);
    req.extend_from_slice(&words(&rect));
    req.extend_from_slice(&offset.to_le_bytes());
    req.extend_from_slice(&words(&[id, 0]));
    req
}

fn cursor_req(kind: u32, pos: (u32, u32), id: u32, hot: (u32, u32)) -> Vec<u8> {
    let mut req = hdr(kind, None);
    req.extend_from_slice(&words(&[0, pos.0, pos.1, 0, id, hot.0, hot.1, 0]));
    req
}

fn kind_of(r: &[u8]) -> u32 {
    u32::from_le_bytes(r[..4].try_into().unwrap())
}

impl Guest {
    fn drv(&mut self) -> (&mut VirtioDriver, &mut Vmm) {
        (self.drv.as_mut().expect("driver up"), &mut self.vmm)
    }

    /// Send a request on `queue` and return the response bytes.
    fn call_on(&mut self, queue: u16, req: &[u8], resp_len: u32) -> Vec<u8> {
        self.vmm.ram().write(REQ, req).unwrap();
        self.vmm.ram().fill(RESP, resp_len as usize, 0xee).unwrap();
        let mut bufs = vec![(REQ, req.len() as u32, false)];
        if resp_len > 0 {
            bufs.push((RESP, resp_len, true));
        }
        let (drv, vmm) = self.drv();
        let head = drv.add_chain(vmm, queue, &bufs).unwrap();
        drv.publish(vmm, queue, head).unwrap();
        drv.kick(vmm, queue).unwrap();
        let (id, len) = drv
            .wait_used(vmm, queue, WAIT)
            .unwrap()
            .expect("no response");
        assert_eq!(id, u32::from(head));
        self.vmm.ram().read_vec(RESP, len as usize).unwrap()
    }

    fn simple(&mut self, kind: u32, body: &[u32]) -> u32 {
        let mut req = hdr(kind, None);
        req.extend_from_slice(&words(body));
        kind_of(&self.call_on(0, &req, 24))
    }

    fn attach(&mut self, id: u32, entries: &[(u64, u32)]) -> u32 {
        let mut req = hdr(cmd::RESOURCE_ATTACH_BACKING, None);
        req.extend_from_slice(&words(&[id, entries.len() as u32]));
        for &(addr, len) in entries {
            req.extend_from_slice(&addr.to_le_bytes());
            req.extend_from_slice(&words(&[len, 0]));
        }
        kind_of(&self.call_on(0, &req, 24))
    }

    fn transfer(&mut self, id: u32, rect: [u32; 4], offset: u64) -> u32 {
        kind_of(&self.call_on(0, &transfer_req(id, rect, offset, None), 24))
    }

    /// Post `req` in slot `slot` on `queue` (a response buffer if `resp`), no kick.
    fn post(&mut self, queue: u16, slot: u64, req: &[u8], resp: bool) -> u16 {
        self.vmm.ram().write(REQS + slot * 0x80, req).unwrap();
        let mut bufs = vec![(REQS + slot * 0x80, req.len() as u32, false)];
        if resp {
            bufs.push((RESPS + slot * 0x40, 24, true));
        }
        let (drv, vmm) = self.drv();
        let head = drv.add_chain(vmm, queue, &bufs).unwrap();
        drv.publish(vmm, queue, head).unwrap();
        head
    }

    fn used_idx(&self, queue: u16) -> u16 {
        let q = self.drv.as_ref().unwrap().queue_layout(queue).unwrap();
        let mut b = [0u8; 2];
        self.vmm.ram().read(q.used + 2, &mut b).unwrap();
        u16::from_le_bytes(b)
    }

    /// Used ring entry `i` of `queue`: (head, len).
    fn used_entry(&self, queue: u16, i: u16) -> (u32, u32) {
        let q = self.drv.as_ref().unwrap().queue_layout(queue).unwrap();
        let mut e = [0u8; 8];
        let at = q.used + 4 + 8 * u64::from(i % q.size);
        self.vmm.ram().read(at, &mut e).unwrap();
        (
            u32::from_le_bytes(e[..4].try_into().unwrap()),
            u32::from_le_bytes(e[4..].try_into().unwrap()),
        )
    }

    /// The destination's VMM re-attaches `src`'s interrupt eventfds and takes its driver.
    fn adopt(&mut self, src: &mut Guest) {
        self.drv = src.drv.take();
        self.msix = std::mem::take(&mut src.msix);
        for (v, efd) in self.msix.iter().enumerate() {
            self.vmm
                .set_irq_eventfd(irq_index::MSIX, v as u32, efd)
                .unwrap();
        }
    }
}

/// Write a `w`-wide surface of `color` at BACKING (first `split` bytes) and
/// BACKING + 0x40000 (the rest): two scattered backing pieces.
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

const W: u32 = 100;
const H: u32 = 40;
const SPLIT: u64 = 0x2100;
const CURSOR_BACKING: u64 = BACKING + 0x80000;

/// Resource 1 (W × H, scattered backing) on scanout 0, transferred and flushed; resource 2
/// a 64×64 cursor (opaque red square with a transparent left half) at (50, 20), hot (2, 3).
fn scene(g: &mut Guest) {
    put_pixels(&g.vmm, W, H, SPLIT, pattern);
    assert_eq!(
        g.simple(cmd::RESOURCE_CREATE_2D, &[1, XRGB, W, H]),
        resp::OK_NODATA
    );
    let size = u64::from(W * H * 4);
    let entries = [
        (BACKING, SPLIT as u32),
        (BACKING + 0x40000, (size - SPLIT) as u32),
    ];
    assert_eq!(g.attach(1, &entries), resp::OK_NODATA);
    assert_eq!(
        g.simple(cmd::SET_SCANOUT, &[0, 0, W, H, 0, 1]),
        resp::OK_NODATA
    );
    assert_eq!(g.transfer(1, [0, 0, W, H], 0), resp::OK_NODATA);
    assert_eq!(
        g.simple(cmd::RESOURCE_FLUSH, &[0, 0, W, H, 1, 0]),
        resp::OK_NODATA
    );
    let mut cursor = Vec::new();
    for _y in 0..64u32 {
        for x in 0..64u32 {
            let a: u32 = if x < 32 { 0 } else { 0xff };
            cursor.extend_from_slice(&(a << 24 | 0xff_0000).to_le_bytes());
        }
    }
    g.vmm.ram().write(CURSOR_BACKING, &cursor).unwrap();
    assert_eq!(
        g.simple(cmd::RESOURCE_CREATE_2D, &[2, BGRA, 64, 64]),
        resp::OK_NODATA
    );
    assert_eq!(
        g.attach(2, &[(CURSOR_BACKING, 64 * 64 * 4)]),
        resp::OK_NODATA
    );
    assert_eq!(g.transfer(2, [0, 0, 64, 64], 0), resp::OK_NODATA);
    g.call_on(1, &cursor_req(cmd::UPDATE_CURSOR, (50, 20), 2, (2, 3)), 0);
}

#[test]
fn test_virtio_gpu_migration_screen_backing_and_queues_continue_on_destination() {
    let mut src = start(VirtioGpuConfig::default());
    scene(&mut src);
    let before = src.gpu.screenshot(0).expect("scanout 0 shows resource 1");
    assert_eq!(before.pixel(48 + 32, 17), Some([0xff, 0, 0]), "the cursor");
    let ctrl_used = src.used_idx(0);
    let mut dst = device(VirtioGpuConfig::default());
    let msix = std::mem::take(&mut src.msix);
    migrate(
        &mut src.vmm,
        &mut dst.vmm,
        &MigrateOptions::default(),
        |_, _| Ok(()),
        |v| {
            for (i, efd) in msix.iter().enumerate() {
                v.set_irq_eventfd(irq_index::MSIX, i as u32, efd)?;
            }
            Ok(())
        },
    )
    .unwrap();
    dst.drv = src.drv.take();
    dst.msix = msix;

    let after = dst.gpu.screenshot(0).expect("the destination shows it");
    assert_eq!(after, before, "the destination's screen is the source's");
    assert_eq!(dst.gpu.memory(), src.gpu.memory());
    assert_eq!(dst.gpu.resources(), (2, 2));
    assert_eq!(dst.gpu.flushes(0), 1);
    assert_eq!(dst.gpu.pinned_backings(), 0, "pins are not state");
    assert_eq!(dst.used_idx(0), ctrl_used);

    // The same backing, new guest pixels: the destination pins it from its own maps.
    put_pixels(&dst.vmm, W, H, SPLIT, |x, y| !pattern(x, y) & 0xff_ffff);
    let r = dst.call_on(0, &transfer_req(1, [0, 0, W, H], 0, Some(901)), 24);
    assert_eq!(kind_of(&r), resp::OK_NODATA);
    assert_eq!(u64::from_le_bytes(r[8..16].try_into().unwrap()), 901);
    assert_eq!(dst.gpu.pinned_backings(), 1, "resource 1 re-pinned");
    assert_eq!(
        dst.used_idx(0),
        ctrl_used.wrapping_add(1),
        "used ring continues"
    );
    assert!(
        dst.vmm.wait_irq_serving(&dst.msix[1], WAIT).unwrap(),
        "the control queue's vector fires on the destination"
    );
    let shot = dst.gpu.screenshot(0).unwrap();
    for y in 0..H {
        for x in 0..W {
            let cursor = (48..112).contains(&x) && (17..81).contains(&y) && x >= 48 + 32;
            let c = if cursor {
                [0xff, 0, 0]
            } else {
                rgb(!pattern(x, y) & 0xff_ffff)
            };
            assert_eq!(shot.pixel(x, y), Some(c), "pixel {x},{y}");
        }
    }
    // The cursor queue continues too.
    dst.call_on(1, &cursor_req(cmd::MOVE_CURSOR, (2, 3), 0, (0, 0)), 0);
    let shot = dst.gpu.screenshot(0).unwrap();
    assert_eq!(shot.pixel(32, 0), Some([0xff, 0, 0]), "moved cursor");
    assert_eq!(shot.pixel(10, 30), Some(rgb(!pattern(10, 30) & 0xff_ffff)));
    assert!(dst.server.device_panics().is_empty());
    assert!(src.server.device_panics().is_empty());
}

#[test]
fn test_virtio_gpu_migration_stop_with_commands_in_flight_completes_each_once() {
    let mut src = start(VirtioGpuConfig::default());
    let (w, h) = (512u32, 512u32); // 1 MiB per transfer
    assert_eq!(
        src.simple(cmd::RESOURCE_CREATE_2D, &[1, XRGB, w, h]),
        resp::OK_NODATA
    );
    assert_eq!(src.attach(1, &[(BACKING, w * h * 4)]), resp::OK_NODATA);
    let base = src.used_idx(0);
    let mut dst = device(VirtioGpuConfig::default());
    let opts = MigrateOptions {
        pre_copy: false,
        ..MigrateOptions::default()
    };
    // RAM copied and logging on first, so that STOP follows the notify at once.
    let mut m = Migration::start(&mut src.vmm, &mut dst.vmm, &opts).unwrap();
    // 24 fenced transfers notified on the control queue; 6 cursor moves published on the
    // cursor queue without a notify (the worker is not told of them before STOP).
    let mut heads = BTreeMap::new();
    for i in 0..24u64 {
        let req = transfer_req(1, [0, 0, w, h], 0, Some(1000 + i));
        heads.insert((0u16, src.post(0, i, &req, true)), i);
    }
    for i in 0..6u64 {
        let req = cursor_req(cmd::MOVE_CURSOR, (i as u32, 0), 0, (0, 0));
        heads.insert((1u16, src.post(1, 24 + i, &req, false)), 24 + i);
    }
    let (drv, vmm) = src.drv();
    drv.kick(vmm, 0).unwrap();
    m.stop_copy(&mut src.vmm, &mut dst.vmm).unwrap();
    // STOP waited for everything the worker was told of; nothing is written after it.
    let (ctrl, cur) = (src.used_idx(0), src.used_idx(1));
    assert_eq!(
        ctrl.wrapping_sub(base),
        24,
        "STOP returned before the worker finished"
    );
    assert_eq!(cur, 0, "the cursor queue was not notified");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        (src.used_idx(0), src.used_idx(1)),
        (ctrl, cur),
        "a used write after STOP"
    );
    assert_eq!(src.gpu.pinned_backings(), 1);
    let mut seen: BTreeMap<(u16, u32), u32> = BTreeMap::new();
    for i in 0..24u16 {
        let (head, len) = src.used_entry(0, base.wrapping_add(i));
        assert_eq!(len, 24);
        *seen.entry((0, head)).or_default() += 1;
    }
    m.resume_destination(&mut src.vmm, &mut dst.vmm).unwrap();
    dst.adopt(&mut src);
    let (drv, vmm) = dst.drv();
    for _ in 0..6 {
        let (head, _) = drv.wait_used(vmm, 1, WAIT).unwrap().expect("cursor move");
        *seen.entry((1, head)).or_default() += 1;
    }
    assert_eq!(
        drv.wait_used(vmm, 1, Duration::from_millis(50)).unwrap(),
        None
    );
    let expect: BTreeMap<(u16, u32), u32> =
        heads.keys().map(|&(q, h)| ((q, u32::from(h)), 1)).collect();
    assert_eq!(seen, expect, "every command completed exactly once");
    // The fences came back in order with their responses (in the copied RAM).
    for i in 0..24u64 {
        let r = dst.vmm.ram().read_vec(RESPS + i * 0x40, 24).unwrap();
        assert_eq!(kind_of(&r), resp::OK_NODATA, "command {i}");
        assert_eq!(u64::from_le_bytes(r[8..16].try_into().unwrap()), 1000 + i);
    }
    assert_eq!(
        dst.used_idx(0),
        ctrl,
        "the destination completed no control command twice"
    );
    let shot = dst.gpu.screenshot(0);
    assert!(shot.is_none(), "nothing on the scanout");
    assert_eq!(dst.gpu.pinned_backings(), 0);
}

/// The saved state of `g`'s transport (stopped, saved, resumed), split into the transport's
/// section and the device's.
fn saved(g: &Guest) -> (TransportStateV1, Vec<u8>) {
    let bytes = {
        let mut dev = g.server.device();
        let pci = dev.device_mut();
        pci.stop().unwrap();
        let b = pci.save().unwrap();
        pci.resume().unwrap();
        b
    };
    let (_, mut d) = Decoder::new(TRANSPORT_FORMAT, 1, 1, &bytes).unwrap();
    let t: TransportStateV1 = d.value().unwrap();
    (t, d.into_rest().to_vec())
}

fn section_of(bytes: &[u8]) -> StateV1<Vec<u8>> {
    decode_state(STATE_FORMAT, 1, STATE_VERSION, bytes)
        .unwrap()
        .1
}

fn encode(s: &StateV1<Vec<u8>>) -> Vec<u8> {
    encode_state(STATE_FORMAT, STATE_VERSION, s).unwrap()
}

/// Load a device section into a fresh device of `config`; its handle tells what it holds.
fn load_into(
    config: VirtioGpuConfig,
    bytes: &[u8],
) -> (Result<(), MigrationError>, VirtioGpuHandle) {
    let mut gpu = VirtioGpu::new(config).unwrap();
    let handle = gpu.handle();
    (VirtioMigrate::load(&mut gpu, bytes), handle)
}

/// A source with the scene, and its device section.
fn scene_section() -> (Guest, Vec<u8>) {
    let mut g = start(VirtioGpuConfig::default());
    scene(&mut g);
    let (_, section) = saved(&g);
    (g, section)
}

#[test]
fn test_virtio_gpu_migration_hostile_sections_are_refused_and_leave_the_device_reset() {
    let (_g, good) = scene_section();
    let base = section_of(&good);
    let (r, h) = load_into(VirtioGpuConfig::default(), &good);
    r.unwrap();
    assert_eq!(h.resources(), (2, 2), "the untouched section loads");
    type Edit = fn(&mut StateV1<Vec<u8>>);
    let edits: &[(&str, Edit)] = &[
        ("duplicated resource id", |s| {
            let r = s.resources[0].clone();
            s.resources.push(r);
        }),
        ("resource id 0", |s| s.resources[0].id = 0),
        ("pixels cut short", |s| {
            s.resources[0].data.pop();
        }),
        ("pixels of another size", |s| s.resources[0].width += 1),
        ("unknown format", |s| s.resources[0].format = 999),
        ("empty backing entry", |s| {
            s.resources[0].backing.as_mut().unwrap()[0].1 = 0
        }),
        ("wrapping backing entry", |s| {
            s.resources[0].backing.as_mut().unwrap()[0] = (u64::MAX - 8, 64)
        }),
        ("no backing entries", |s| {
            s.resources[0].backing = Some(Vec::new())
        }),
        ("backing far larger than the resource", |s| {
            s.resources[0].backing.as_mut().unwrap()[0].1 = u32::MAX
        }),
        ("scanout shows a missing resource", |s| {
            s.scanouts[0].resource = 7
        }),
        ("scanout rectangle outside", |s| s.scanouts[0].rect.2 = 1000),
        ("scanout mode out of range", |s| {
            s.scanouts[0].mode = (0, 10)
        }),
        ("cursor image of another size", |s| {
            s.cursor.image.as_mut().unwrap().push(0)
        }),
        ("cursor on a missing scanout", |s| s.cursor.scanout = 3),
        ("cursor hot spot outside", |s| s.cursor.hot_x = 64),
        ("unknown event bits", |s| s.events = 0x80),
        ("another display", |s| s.configured = vec![(1024, 768)]),
        ("two scanouts for one", |s| {
            let o = s.scanouts[0];
            s.scanouts.push(o)
        }),
        ("EDID not offered", |s| s.edid = false),
    ];
    for (what, edit) in edits {
        let mut s = base.clone();
        edit(&mut s);
        let (r, h) = load_into(VirtioGpuConfig::default(), &encode(&s));
        assert!(r.is_err(), "{what}: accepted");
        assert_eq!(h.resources(), (0, 0), "{what}: not reset");
        assert!(h.screenshot(0).is_none(), "{what}: shows something");
    }
    for cut in (0..good.len())
        .step_by(97)
        .chain(good.len() - 8..good.len())
    {
        let (r, h) = load_into(VirtioGpuConfig::default(), &good[..cut]);
        assert!(r.is_err(), "cut at {cut} of {}", good.len());
        assert_eq!(h.resources(), (0, 0));
    }
    let mut long = good.clone();
    long.push(0);
    assert!(
        load_into(VirtioGpuConfig::default(), &long).0.is_err(),
        "trailing byte"
    );
    // A resource count far beyond what the bytes hold is refused before allocating.
    let mut huge = base.clone();
    huge.resources.clear();
    let mut bytes = encode(&huge);
    let last = bytes.len() - 1;
    assert_eq!(
        bytes[last], 0,
        "the empty resource sequence ends the section"
    );
    bytes.truncate(last);
    bytes.extend_from_slice(&[0xff, 0x1f]); // 4095 resources declared, none there
    assert!(load_into(VirtioGpuConfig::default(), &bytes).0.is_err());
}

#[test]
fn test_virtio_gpu_migration_transport_refuses_other_features_and_device_stays_reset() {
    let (g, _) = scene_section();
    let bytes = {
        let mut dev = g.server.device();
        let pci = dev.device_mut();
        pci.stop().unwrap();
        let b = pci.save().unwrap();
        pci.resume().unwrap();
        b
    };
    // A destination without EDID offers other features: refused by the transport.
    let dst = device(VirtioGpuConfig {
        edid: false,
        ..Default::default()
    });
    let e = dst.server.device().device_mut().load(&bytes).unwrap_err();
    assert!(matches!(e, MigrationError::Incompatible(_)), "{e}");
    assert_eq!(dst.server.device().device().status(), 0);
    assert_eq!(dst.gpu.resources(), (0, 0));
    // A state longer than the destination declares: refused before it is decoded.
    let small = device(VirtioGpuConfig {
        memory_budget: 1 << 20,
        ..Default::default()
    });
    {
        let mut dev = small.server.device();
        let pci = dev.device_mut();
        let mut long = bytes.clone();
        long.resize(pci.max_state_size() as usize + 1, 0);
        assert!(pci.load(&long).is_err(), "an oversized state");
        assert_eq!(pci.status(), 0);
    }
    // The same configuration takes it.
    let ok = device(VirtioGpuConfig::default());
    ok.server.device().device_mut().load(&bytes).unwrap();
    assert_eq!(ok.gpu.resources(), (2, 2));
    assert_eq!(ok.gpu.screenshot(0), g.gpu.screenshot(0));
}

#[test]
fn test_virtio_gpu_migration_resources_beyond_the_destination_budget_are_refused() {
    let big = VirtioGpuConfig {
        memory_budget: 8 << 20,
        ..Default::default()
    };
    let small = VirtioGpuConfig {
        memory_budget: 2 << 20,
        ..Default::default()
    };
    let mut src = start(big.clone());
    // 3 MiB of resources (no backing needed to hold pixels).
    assert_eq!(
        src.simple(cmd::RESOURCE_CREATE_2D, &[1, XRGB, 1024, 512]),
        resp::OK_NODATA
    );
    assert_eq!(
        src.simple(cmd::RESOURCE_CREATE_2D, &[2, XRGB, 512, 512]),
        resp::OK_NODATA
    );
    let (_, section) = saved(&src);
    // The device refuses it whole, naming the budget, before allocating any of it.
    let (r, h) = load_into(small.clone(), &section);
    let e = r.unwrap_err();
    assert!(
        matches!(&e, MigrationError::Incompatible(m) if m.contains("budget")),
        "{e}"
    );
    assert_eq!(h.memory(), (0, 2 << 20));
    // Through a VMM: the stream is refused (at its frame head: longer than the smaller
    // destination's largest state), the migration aborts and the source runs on.
    let mut dst = device(small);
    let r = migrate(
        &mut src.vmm,
        &mut dst.vmm,
        &MigrateOptions::default(),
        |_, _| Ok(()),
        |_| Ok(()),
    );
    assert!(r.is_err(), "a destination took more than its budget");
    assert_eq!(dst.gpu.memory().0, 0);
    assert_eq!(
        src.simple(cmd::RESOURCE_UNREF, &[2]),
        resp::OK_NODATA,
        "the source runs after the abort"
    );
    // A destination of the source's budget takes it.
    let (r, h) = load_into(big, &section);
    r.unwrap();
    assert_eq!(h.memory().0, 3 << 20);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn test_virtio_gpu_migration_random_and_flipped_sections_never_panic(
        random in proptest::collection::vec(any::<u8>(), 0..400),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
    ) {
        let _ = load_into(VirtioGpuConfig::default(), &random);
        let mut header = encode_state(STATE_FORMAT, STATE_VERSION, &()).unwrap();
        header.extend_from_slice(&random);
        let _ = load_into(VirtioGpuConfig::default(), &header);
        let good = section_bytes();
        let mut b = good.to_vec();
        for (at, x) in flips {
            let i = at.index(b.len());
            b[i] ^= x;
        }
        let (r, h) = load_into(VirtioGpuConfig::default(), &b);
        if r.is_err() {
            prop_assert_eq!(h.resources(), (0, 0));
        }
    }
}

/// A small valid section (built once): a resource with backing, on the scanout, a cursor.
fn section_bytes() -> &'static [u8] {
    static S: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    S.get_or_init(|| {
        let mut image = vec![0u8; 64 * 64 * 4];
        image[3] = 0xff;
        let s = StateV1 {
            configured: vec![(1280, 800)],
            edid: true,
            events: 0,
            scanouts: vec![umdev_devices::virtio_gpu::migration::ScanoutV1 {
                mode: (1280, 800),
                resource: 5,
                rect: (0, 0, 4, 2),
                flushes: 3,
            }],
            cursor: umdev_devices::virtio_gpu::migration::CursorV1 {
                scanout: 0,
                x: 1,
                y: 1,
                hot_x: 0,
                hot_y: 0,
                image: Some(image),
            },
            resources: vec![umdev_devices::virtio_gpu::migration::ResourceV1 {
                id: 5,
                format: XRGB,
                width: 4,
                height: 2,
                backing: Some(vec![(BACKING, 32)]),
                data: (0..32).collect(),
            }],
        };
        let b = encode(&s);
        let (r, h) = load_into(VirtioGpuConfig::default(), &b);
        r.unwrap();
        assert_eq!(h.resources(), (1, 1));
        b
    })
}

#[test]
fn test_virtio_gpu_migration_resize_while_stopped_interrupts_only_at_running() {
    let mut g = start(VirtioGpuConfig::default());
    g.server.device().device_mut().stop().unwrap();
    g.gpu.resize(0, 800, 600).unwrap();
    assert!(
        !g.vmm
            .wait_irq_serving(&g.msix[0], Duration::from_millis(50))
            .unwrap(),
        "a config interrupt while stopped"
    );
    g.server.device().device_mut().resume().unwrap();
    assert!(
        g.vmm.wait_irq_serving(&g.msix[0], WAIT).unwrap(),
        "the display event is told at RUNNING"
    );
    let mut ev = [0u8; 4];
    let (drv, vmm) = g.drv();
    drv.read_config(vmm, 0, &mut ev).unwrap();
    assert_eq!(u32::from_le_bytes(ev), 1, "VIRTIO_GPU_EVENT_DISPLAY");
    assert_eq!(g.gpu.mode(0), Some((800, 600)));
}
