//! `umdev migrate UUID --to DST` between two daemon processes in temp dirs: the real binary,
//! the embedded VMM as the QEMU that draws into a GPU before and reads it back after.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use umdev::testing::{DeviceAccess, Vmm};
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::{self, ID_MAGIC};
use umdev_devices::gpu::Command as GpuCmd;
use umdev_devices::testing::Bar0;

#[path = "common/daemon.rs"]
mod daemon;

use daemon::{Daemon, BIN};

const RAM_BASE: u64 = 1 << 30;
const UUID: &str = "00000000-0000-4000-8000-0000000000b1";

/// What these tests ask a daemon beyond the shared rig.
trait MigrateRig {
    fn snapshot(&self) -> (Value, Value);
    fn instance(&self, uuid: &str) -> Option<Value>;
    fn socket(&self, uuid: &str) -> PathBuf;
    fn wait_detached(&self, uuid: &str);
}

impl MigrateRig for Daemon {
    /// What `list` and `list --defined` say: compared before and after a refused migration.
    fn snapshot(&self) -> (Value, Value) {
        let mut list = self.json(&["list"]);
        // DMA counters are not what a migration changes.
        for i in list["instances"].as_array_mut().unwrap() {
            i["dma"] = Value::Null;
        }
        (list, self.json(&["list", "--defined"]))
    }

    fn instance(&self, uuid: &str) -> Option<Value> {
        self.json(&["list"])["instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["uuid"] == uuid)
            .cloned()
    }

    fn socket(&self, uuid: &str) -> PathBuf {
        PathBuf::from(self.instance(uuid).unwrap()["socket"].as_str().unwrap())
    }

    /// Wait until the instance's client is gone (its teardown done).
    fn wait_detached(&self, uuid: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.instance(uuid).unwrap()["client_attached"] == true {
            assert!(Instant::now() < deadline, "the client never detached");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn migrate(src: &Daemon, dst: &Daemon, extra: &[&str]) -> Output {
    let to = dst.control();
    let mut args = vec!["migrate", UUID, "--to", to.to_str().unwrap()];
    args.extend_from_slice(extra);
    src.umdev(&args)
}

/// The registers a migration must carry (mode, ring, interrupt enables, fence).
const KEPT_REGS: [u64; 9] = [
    regs::REG_MODE_WIDTH,
    regs::REG_MODE_HEIGHT,
    regs::REG_MODE_STRIDE,
    regs::REG_MODE_CTRL,
    regs::REG_RING_BASE_LO,
    regs::REG_RING_SIZE,
    regs::REG_RING_HEAD,
    regs::REG_IRQ_ENABLE,
    regs::REG_FENCE_VALUE,
];

/// Set a mode, draw two rectangles and wait for them (fence `fence`): the device runs.
/// Returns the registers and the framebuffer's first 64 rows as the device shows them.
fn draw(vmm: &mut Vmm, fence: u32) -> (Vec<u32>, Vec<u8>) {
    let mut ram = vmm.ram().clone();
    let mut drv = Driver::probe(Bar0(&mut *vmm)).unwrap();
    drv.set_mode(64, 64, 256).unwrap();
    drv.enable_irqs(0).unwrap();
    drv.setup_ring(RAM_BASE, 64 * 1024).unwrap();
    let cmds = [
        GpuCmd::FillRect {
            x: 3,
            y: 5,
            w: 20,
            h: 7,
            color: 0x00ab_cdef,
        },
        GpuCmd::FillRect {
            x: 40,
            y: 30,
            w: 9,
            h: 21,
            color: 0x0012_3456,
        },
        GpuCmd::Fence { value: fence },
    ];
    drv.submit(&mut ram, &cmds).unwrap();
    drv.wait_fence(fence).unwrap();
    read_back(vmm)
}

fn read_back(vmm: &mut Vmm) -> (Vec<u32>, Vec<u8>) {
    let regs: Vec<u32> = KEPT_REGS
        .iter()
        .map(|&r| vmm.read32(0, r).unwrap())
        .collect();
    let mut fb = vec![0u8; 64 * 256];
    vmm.read_bytes(2, 0, &mut fb).unwrap();
    (regs, fb)
}

#[test]
fn test_migrate_detached_gpu_framebuffer_and_regs_identical_definition_moved() {
    let a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID, "--auto"]);
    let mut vmm = Vmm::connect(&a.socket(UUID))
        .unwrap()
        .with_ram(RAM_BASE, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    let (regs_before, fb_before) = draw(&mut vmm, 7);
    assert_eq!(regs_before[0], 64, "the mode was set");
    let px = 4 * (5 * 64 + 3);
    assert_eq!(fb_before[px..px + 4], 0x00ab_cdefu32.to_le_bytes(), "drawn");
    drop(vmm);
    a.wait_detached(UUID);

    let out = migrate(&a, &b, &["--json"]);
    assert!(
        out.status.success(),
        "{}\nsource log:\n{}\ndestination log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        a.log(),
        b.log()
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let m = &v["migrated"];
    assert_eq!(m["uuid"], UUID, "{v}");
    assert_eq!(m["type"], "gpu-4m", "{v}");
    assert_eq!(m["source_removed"], true, "{v}");
    assert_eq!(m["autostart"], true, "{v}");
    // At least the drawn framebuffer pages (the GPU sends the pages that are not zero).
    assert!(m["state_bytes"].as_u64().unwrap() > 2 * 4096, "{v}");

    // The source has neither the instance nor its definition; the destination has both.
    assert!(a.instance(UUID).is_none());
    assert!(a.json(&["list", "--defined"])["definitions"]
        .as_array()
        .unwrap()
        .is_empty());
    let row = b.instance(UUID).expect("the destination serves it");
    assert_eq!(
        (row["defined"].clone(), row["autostart"].clone()),
        (true.into(), true.into())
    );
    assert_eq!(row["client_attached"], false);

    let mut vmm = Vmm::connect(&b.socket(UUID)).unwrap();
    assert_eq!(vmm.read32(0, 0).unwrap(), ID_MAGIC);
    let (regs_after, fb_after) = read_back(&mut vmm);
    assert_eq!(regs_after, regs_before, "registers {KEPT_REGS:x?}");
    assert!(
        fb_after == fb_before,
        "the framebuffer differs after the migration"
    );
    drop(vmm);
    b.wait_detached(UUID);
    // It runs there: a guest's next commands execute.
    let mut vmm = Vmm::connect(&b.socket(UUID))
        .unwrap()
        .with_ram(RAM_BASE, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    draw(&mut vmm, 8);
}

#[test]
fn test_migrate_errors_leave_both_daemons_unchanged() {
    let a = Daemon::start(&[]);
    // A 4 MiB pool and no gpu-16m type.
    let b = Daemon::start(&["--gpu-pool-mib", "4", "--gpu-type", "gpu-4m:4:1"]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID, "--auto"]);
    let other = "00000000-0000-4000-8000-0000000000b2";
    a.ok(&["create", "--type", "gpu-16m", "--uuid", other]);
    let blocker = "00000000-0000-4000-8000-0000000000b3";
    b.ok(&["create", "--type", "gpu-4m", "--uuid", blocker]);
    let check = |why: &str, e: &str, wanted: &[&str], before: &[(Value, Value); 2]| {
        for w in wanted {
            assert!(e.contains(w), "{why}: {w:?} not in {e:?}");
        }
        assert_eq!(a.snapshot(), before[0], "{why}: the source changed");
        assert_eq!(b.snapshot(), before[1], "{why}: the destination changed");
        let mut vmm = Vmm::connect(&a.socket(UUID)).unwrap();
        assert_eq!(
            vmm.read32(0, 0).unwrap(),
            ID_MAGIC,
            "{why}: the source serves"
        );
    };
    let before = [a.snapshot(), b.snapshot()];

    // No resources: the destination's pool is taken.
    let e = String::from_utf8(migrate(&a, &b, &[]).stderr).unwrap();
    check(
        "exhausted",
        &e,
        &[
            "destination daemon",
            "refused",
            "4 MiB of framebuffer, 0 MiB left",
        ],
        &before,
    );
    b.ok(&["remove", blocker]);
    // UUID in use on the destination (a definition there).
    b.ok(&["define", "--type", "gpu-4m", "--uuid", UUID]);
    let before = [a.snapshot(), b.snapshot()];
    let e = String::from_utf8(migrate(&a, &b, &[]).stderr).unwrap();
    check(
        "uuid in use",
        &e,
        &[&format!("UUID {UUID} is in use")],
        &before,
    );
    b.ok(&["undefine", UUID]);
    let before = [a.snapshot(), b.snapshot()];
    // The destination lacks the type.
    let to = b.control();
    let e = a.fail(&["migrate", other, "--to", to.to_str().unwrap()]);
    check("type", &e, &["unknown type \"gpu/gpu-16m\""], &before);
    // Unknown UUID on the source.
    let e = a.fail(&[
        "migrate",
        "00000000-0000-4000-8000-0000000000ff",
        "--to",
        to.to_str().unwrap(),
    ]);
    check(
        "unknown uuid",
        &e,
        &["no instance 00000000-0000-4000-8000-0000000000ff"],
        &before,
    );
    // Destination unreachable.
    let e = a.fail(&["migrate", UUID, "--to", "/nonexistent/control.sock"]);
    check(
        "unreachable",
        &e,
        &["no umdev daemon is listening on /nonexistent/control.sock"],
        &before,
    );
    // A state the destination's device refuses (cut short): nothing is created there.
    let (status, body) = raw_load(&b.control(), &[0x01, 0x02, 0x03]);
    assert_eq!(status, "migration", "{body}");
    assert!(body.contains("the migration stream was refused"), "{body}");
    check("refused stream", "", &[], &before);
    // The source runs on after every refusal (each stopped and resumed it): it executes.
    let mut vmm = Vmm::connect(&a.socket(UUID))
        .unwrap()
        .with_ram(RAM_BASE, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    draw(&mut vmm, 3);
}

/// Send `request` and `payload` to the daemon on `control` by hand; returns the answer
/// and the payload after it.
fn raw(control: &Path, request: Value, payload: &[u8]) -> (Value, Vec<u8>) {
    let mut s = UnixStream::connect(control).unwrap();
    let req = serde_json::json!({ "version": 2, "request": request });
    s.write_all(format!("{req}\n").as_bytes()).unwrap();
    s.write_all(payload).unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let nl = all.iter().position(|&b| b == b'\n').unwrap();
    let v: Value = serde_json::from_slice(&all[..nl]).unwrap();
    (v, all[nl + 1..].to_vec())
}

/// Send `migrate_load` of `UUID` with `state` by hand; returns the error kind and the answer.
fn raw_load(control: &Path, state: &[u8]) -> (String, String) {
    let request = serde_json::json!({
        "op": "migrate_load", "uuid": UUID, "type": "gpu/gpu-4m", "state_len": state.len(),
    });
    let (v, _) = raw(control, request, state);
    (
        v["error"]["kind"].as_str().unwrap_or("").to_owned(),
        v.to_string(),
    )
}

/// What `list --defined` says of `uuid` on `d`.
fn definition(d: &Daemon, uuid: &str) -> Option<Value> {
    d.json(&["list", "--defined"])["definitions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["uuid"] == uuid)
        .cloned()
}

/// `migrate_save` of `UUID` by hand, handed over to `to`; returns the reply and the state.
fn raw_save(src: &Daemon, to: &Path) -> (Value, Vec<u8>) {
    let (v, state) = raw(
        &src.control(),
        serde_json::json!({"op": "migrate_save", "uuid": UUID, "to": to}),
        &[],
    );
    assert_eq!(v["ok"]["reply"], "saved", "{v}");
    assert_eq!(v["ok"]["handed_over"], true, "{v}");
    assert_eq!(v["ok"]["state_len"].as_u64(), Some(state.len() as u64));
    (v, state)
}

/// Draw into `UUID` on `d` and leave; returns the registers and framebuffer drawn.
fn draw_and_leave(d: &Daemon) -> (Vec<u32>, Vec<u8>) {
    let mut vmm = Vmm::connect(&d.socket(UUID))
        .unwrap()
        .with_ram(RAM_BASE, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    let drawn = draw(&mut vmm, 5);
    drop(vmm);
    d.wait_detached(UUID);
    drawn
}

fn recover(src: &Daemon, dst: &Daemon) -> String {
    src.ok(&[
        "migrate",
        UUID,
        "--to",
        dst.control().to_str().unwrap(),
        "--recover",
    ])
}

#[test]
fn test_migrate_save_hands_over_abort_serves_state_again_finish_forgets() {
    let a = Daemon::start(&[]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID, "--auto"]);
    let socket = a.socket(UUID);
    let drawn = draw_and_leave(&a);
    let to = Path::new("/elsewhere/control.sock");
    raw_save(&a, to);
    // Handed over: not served here any more, its definition marked and never started.
    assert!(a.instance(UUID).is_none());
    assert!(!socket.exists(), "the socket is gone");
    let def = definition(&a, UUID).unwrap();
    assert_eq!(def["migrating_to"], to.to_str().unwrap(), "{def}");
    assert_eq!(def["autostart"], true, "{def}");
    let table = a.ok(&["list", "--defined"]);
    assert!(
        table.contains("migrating out") && table.contains("--recover"),
        "{table}"
    );
    for args in [
        &["start", UUID][..],
        &["create", "--type", "gpu-4m", "--uuid", UUID][..],
    ] {
        let e = a.fail(args);
        assert!(
            e.contains("was handed over") && e.contains("--recover"),
            "{e}"
        );
    }
    let (v, _) = raw(
        &a.control(),
        serde_json::json!({"op": "migrate_save", "uuid": UUID}),
        &[],
    );
    assert_eq!(v["error"]["kind"], "migrating_out", "{v}");

    // Aborted: served again with the state it had, the mark gone.
    let (v, _) = raw(
        &a.control(),
        serde_json::json!({"op": "migrate_abort", "uuid": UUID}),
        &[],
    );
    assert_eq!(v["ok"]["reply"], "started", "{v}");
    let mut vmm = Vmm::connect(&socket).unwrap();
    assert_eq!(read_back(&mut vmm), drawn, "the state kept");
    drop(vmm);
    a.wait_detached(UUID);
    let def = definition(&a, UUID).unwrap();
    assert!(def.get("migrating_to").is_none(), "{def}");

    // Finished: the state and the definition forgotten.
    raw_save(&a, to);
    let finish = serde_json::json!({"op": "migrate_finish", "uuid": UUID});
    let (v, _) = raw(&a.control(), finish.clone(), &[]);
    assert_eq!(v["ok"]["reply"], "removed", "{v}");
    assert!(a.instance(UUID).is_none());
    assert!(definition(&a, UUID).is_none());
    let (v, _) = raw(&a.control(), finish, &[]);
    assert_eq!(v["error"]["kind"], "migration", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not handed over"),
        "{v}"
    );
}

#[test]
fn test_migrate_interrupted_after_load_one_daemon_serves_recover_removes_source_leftover() {
    let mut a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID, "--auto"]);
    let drawn = draw_and_leave(&a);
    // The CLI's steps by hand, killed before `migrate_finish`.
    let (_, state) = raw_save(&a, &b.control());
    let request = serde_json::json!({
        "op": "migrate_load", "uuid": UUID, "type": "gpu/gpu-4m", "define": true,
        "autostart": true, "state_len": state.len(),
    });
    let (v, _) = raw(&b.control(), request, &state);
    assert_eq!(v["ok"]["reply"], "started", "{v}");
    // One daemon serves it: the destination.
    assert!(a.instance(UUID).is_none(), "the source serves it too");
    let mut vmm = Vmm::connect(&b.socket(UUID)).unwrap();
    assert_eq!(read_back(&mut vmm), drawn);
    drop(vmm);
    b.wait_detached(UUID);
    // A restart of the source does not start its leftover, autostart or not.
    a.stop();
    a.restart();
    assert!(a.instance(UUID).is_none(), "the source started it again");
    assert!(a.log().contains("autostart: not started"), "{}", a.log());
    assert!(definition(&a, UUID).unwrap()["migrating_to"].is_string());

    let out = recover(&a, &b);
    assert!(
        out.contains("the destination") && out.contains("has it"),
        "{out}"
    );
    assert!(definition(&a, UUID).is_none(), "the leftover is gone");
    assert!(a.instance(UUID).is_none());
    assert_eq!(b.instance(UUID).unwrap()["defined"], true);
}

#[test]
fn test_migrate_interrupted_after_save_nobody_serves_recover_serves_source_with_state() {
    let a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID]);
    let drawn = draw_and_leave(&a);
    // The CLI killed while the state arrives: it reads the reply's line and goes.
    let mut s = UnixStream::connect(a.control()).unwrap();
    let req = serde_json::json!({"version": 2, "request":
        {"op": "migrate_save", "uuid": UUID, "to": b.control()}});
    s.write_all(format!("{req}\n").as_bytes()).unwrap();
    let mut first = [0u8; 64];
    s.read_exact(&mut first).unwrap();
    drop(s);
    assert!(a.instance(UUID).is_none());
    assert!(b.instance(UUID).is_none());
    let out = recover(&a, &b);
    assert!(out.contains("the source serves it again"), "{out}");
    assert!(b.instance(UUID).is_none());
    let mut vmm = Vmm::connect(&a.socket(UUID)).unwrap();
    assert_eq!(read_back(&mut vmm), drawn, "the state kept");
    drop(vmm);
    // Nothing left to settle.
    let e = a.fail(&[
        "migrate",
        UUID,
        "--to",
        b.control().to_str().unwrap(),
        "--recover",
    ]);
    assert!(
        e.contains("not handed over") && e.contains("runs here"),
        "{e}"
    );
}

#[test]
fn test_migrate_source_restarted_after_save_recover_starts_definition_remove_drops_it() {
    let mut a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID, "--auto"]);
    raw_save(&a, &b.control());
    a.stop();
    a.restart();
    assert!(a.instance(UUID).is_none());
    let out = recover(&a, &b);
    assert!(out.contains("the source serves it again"), "{out}");
    let row = a.instance(UUID).expect("started from its definition");
    assert_eq!(
        (row["defined"].clone(), row["autostart"].clone()),
        (true.into(), true.into())
    );
    assert!(a.log().contains("its state is lost"), "{}", a.log());
    // `umdev remove` drops a leftover too (here the kept state of a transient one).
    let other = "00000000-0000-4000-8000-0000000000b9";
    a.ok(&["create", "--type", "gpu-4m", "--uuid", other]);
    raw(
        &a.control(),
        serde_json::json!({"op": "migrate_save", "uuid": other, "to": b.control()}),
        &[],
    );
    assert!(a.instance(other).is_none());
    a.ok(&["remove", other]);
    let e = a.fail(&[
        "migrate",
        other,
        "--to",
        b.control().to_str().unwrap(),
        "--recover",
    ]);
    assert!(e.contains("not handed over"), "{e}");
}

#[test]
fn test_migrate_attached_refused_names_prepare_which_creates_destination_only() {
    let a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID]);
    let mut vmm = Vmm::connect(&a.socket(UUID)).unwrap();
    let before = [a.snapshot(), b.snapshot()];
    let e = String::from_utf8(migrate(&a, &b, &[]).stderr).unwrap();
    assert!(
        e.contains("only its VMM can migrate an attached device") && e.contains("--prepare"),
        "{e}"
    );
    assert_eq!([a.snapshot(), b.snapshot()], before, "nothing changed");
    assert_eq!(
        vmm.read32(0, 0).unwrap(),
        ID_MAGIC,
        "the client is still served"
    );

    let out = migrate(&a, &b, &["--prepare", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let socket = PathBuf::from(v["instance"]["socket"].as_str().unwrap());
    assert_eq!(v["instance"]["uuid"], UUID, "{v}");
    assert_eq!(v["instance"]["type"], "gpu-4m", "{v}");
    assert_eq!(socket, b.socket(UUID));
    assert_eq!(b.instance(UUID).unwrap()["defined"], false);
    // The source is untouched, its client still attached.
    assert_eq!(a.instance(UUID).unwrap()["client_attached"], true);
    assert_eq!(vmm.read32(0, 0).unwrap(), ID_MAGIC);
    let mut dst = Vmm::connect(&socket).unwrap();
    assert_eq!(dst.read32(0, 0).unwrap(), ID_MAGIC);
}

#[test]
fn test_migrate_keep_source_leaves_source_and_definition() {
    let a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID, "--auto"]);
    let out = a.ok(&[
        "migrate",
        UUID,
        "--to",
        b.control().to_str().unwrap(),
        "--keep-source",
    ]);
    assert!(
        out.contains(&format!("migrated {UUID} (gpu/gpu-4m")),
        "{out}"
    );
    assert!(out.contains("--keep-source"), "{out}");
    let src = a.instance(UUID).unwrap();
    assert_eq!(
        (src["defined"].clone(), src["autostart"].clone()),
        (true.into(), true.into())
    );
    assert_eq!(b.instance(UUID).unwrap()["defined"], false);
}

#[test]
fn test_migrate_detached_virtio_gpu_moves_to_a_daemon_with_its_type() {
    let a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    a.ok(&["create", "--type", "vgpu-720p", "--uuid", UUID]);
    let out = migrate(&a, &b, &["--json"]);
    assert!(
        out.status.success(),
        "{}\nsource log:\n{}\ndestination log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        a.log(),
        b.log()
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["migrated"]["type"], "vgpu-720p", "{v}");
    assert!(a.instance(UUID).is_none());
    let row = b.instance(UUID).expect("the destination serves it");
    assert_eq!(row["type"], "vgpu-720p", "{row}");
    // It answers there as a virtio-gpu (vendor 0x1af4, device 0x1050).
    let mut vmm = Vmm::connect(&b.socket(UUID)).unwrap();
    assert_eq!(vmm.read32(7, 0).unwrap(), 0x1050_1af4);
}

#[test]
fn test_migrate_help_has_an_example() {
    let out = Command::new(BIN)
        .args(["migrate", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success());
    assert!(
        text.contains("umdev migrate 6f1a0c36-") && text.contains("--to"),
        "{text}"
    );
    assert!(
        text.contains("--prepare") && text.contains("--keep-source"),
        "{text}"
    );
}

#[test]
fn test_migrate_ccw_named_image_keeps_registers_default_image_refused() {
    use umdev_devices::ccw::regs as ccw_regs;
    let a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    // The image on both sides (shared storage, or copied while detached).
    for d in [&a, &b] {
        let f = fs::File::create(d.state().join("ccw-images/disk.img")).unwrap();
        f.set_len(16 << 20).unwrap();
    }
    a.ok(&[
        "create",
        "--type",
        "ccw-16m",
        "--uuid",
        UUID,
        "image=disk.img",
    ]);
    let mut vmm = Vmm::connect(&a.socket(UUID)).unwrap();
    assert_eq!(vmm.read32(0, ccw_regs::ID).unwrap(), ccw_regs::MAGIC);
    vmm.write32(0, ccw_regs::OPB_ADDR_LO, 0x1234_5000).unwrap();
    vmm.write32(0, ccw_regs::OPB_ADDR_HI, 0x42).unwrap();
    drop(vmm);
    a.wait_detached(UUID);
    let out = migrate(&a, &b, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(a.instance(UUID).is_none());
    assert_eq!(b.instance(UUID).unwrap()["params"]["image"], "disk.img");
    let mut vmm = Vmm::connect(&b.socket(UUID)).unwrap();
    assert_eq!(vmm.read32(0, ccw_regs::OPB_ADDR_LO).unwrap(), 0x1234_5000);
    assert_eq!(vmm.read32(0, ccw_regs::OPB_ADDR_HI).unwrap(), 0x42);
    drop(vmm);

    // Its default image stays behind in the source's directory: refused.
    let other = "00000000-0000-4000-8000-0000000000c2";
    a.ok(&["create", "--type", "ccw-16m", "--uuid", other]);
    let before = [a.snapshot(), b.snapshot()];
    let e = a.fail(&["migrate", other, "--to", b.control().to_str().unwrap()]);
    assert!(
        e.contains(&format!("image {other}.img")) && e.contains("image=NAME"),
        "{e}"
    );
    assert_eq!([a.snapshot(), b.snapshot()], before);
}

#[test]
fn test_migrate_nvme_named_image_moves_default_image_refused() {
    use umdev_devices::nvme::regs as nvme_regs;
    let a = Daemon::start(&[]);
    let b = Daemon::start(&[]);
    let data = b"nvme data on the shared image";
    for d in [&a, &b] {
        let f = fs::File::create(d.state().join("nvme-images/disk.img")).unwrap();
        f.set_len(256 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, data, 4096).unwrap();
    }
    a.ok(&[
        "create",
        "--type",
        "nvme-256m",
        "--uuid",
        UUID,
        "image=disk.img",
    ]);
    let mut vmm = Vmm::connect(&a.socket(UUID)).unwrap();
    assert_eq!(vmm.read32(0, nvme_regs::VS).unwrap(), 0x0001_0400);
    drop(vmm);
    a.wait_detached(UUID);
    let out = migrate(&a, &b, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(a.instance(UUID).is_none());
    assert_eq!(b.instance(UUID).unwrap()["params"]["image"], "disk.img");
    let mut vmm = Vmm::connect(&b.socket(UUID)).unwrap();
    assert_eq!(vmm.read32(0, nvme_regs::VS).unwrap(), 0x0001_0400);
    assert_eq!(vmm.read32(0, nvme_regs::CSTS).unwrap(), 0);
    drop(vmm);

    // Its default image stays behind in the source's directory: refused.
    let other = "00000000-0000-4000-8000-0000000000c3";
    a.ok(&["create", "--type", "nvme-256m", "--uuid", other]);
    let before = [a.snapshot(), b.snapshot()];
    let e = a.fail(&["migrate", other, "--to", b.control().to_str().unwrap()]);
    assert!(
        e.contains(&format!("image {other}.img")) && e.contains("image=NAME"),
        "{e}"
    );
    assert_eq!([a.snapshot(), b.snapshot()], before);
}

/// A destination that answers `types`, takes a `migrate_load` and hangs up without an
/// answer (as if it crashed in the step), then lists no instance and no definition: the CLI
/// cannot tell what the load did, and has to look. Returns its socket and the ops it saw.
fn hang_up_destination(dir: &Path) -> (PathBuf, std::thread::JoinHandle<Vec<String>>) {
    use std::io::BufRead;
    let path = dir.join("hang-up.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let seen = std::thread::spawn(move || {
        let mut ops = Vec::new();
        for _ in 0..4 {
            let (s, _) = listener.accept().unwrap();
            let mut line = String::new();
            std::io::BufReader::new(&s).read_line(&mut line).unwrap();
            let v: Value = serde_json::from_str(&line).unwrap();
            let op = v["request"]["op"].as_str().unwrap().to_owned();
            let ok = match (op.as_str(), v["request"]["defined"].as_bool()) {
                ("types", _) => serde_json::json!({"reply": "types", "types": [], "resources": []}),
                ("list", Some(true)) => {
                    serde_json::json!({"reply": "definitions", "definitions": [], "broken": []})
                }
                ("list", _) => serde_json::json!({"reply": "instances", "instances": []}),
                _ => {
                    ops.push(op);
                    continue; // hang up
                }
            };
            ops.push(op);
            let reply = serde_json::json!({"version": 2, "ok": ok});
            (&s).write_all(format!("{reply}\n").as_bytes()).unwrap();
        }
        ops
    });
    (path, seen)
}

#[test]
fn test_migrate_destination_hangs_up_in_load_cli_settles_source_serves_with_state() {
    let a = Daemon::start(&[]);
    a.ok(&["create", "--type", "gpu-4m", "--uuid", UUID, "--auto"]);
    let drawn = draw_and_leave(&a);
    let (to, seen) = hang_up_destination(a.dir.path());
    let e = a.fail(&["migrate", UUID, "--to", to.to_str().unwrap()]);
    assert!(e.contains("the source serves the instance again"), "{e}");
    assert_eq!(
        seen.join().unwrap(),
        ["types", "migrate_load", "list", "list"]
    );
    let row = a.instance(UUID).expect("served again");
    assert_eq!(
        (row["defined"].clone(), row["autostart"].clone()),
        (true.into(), true.into())
    );
    assert!(definition(&a, UUID).unwrap().get("migrating_to").is_none());
    let mut vmm = Vmm::connect(&a.socket(UUID)).unwrap();
    assert_eq!(read_back(&mut vmm), drawn, "the state kept");
}
