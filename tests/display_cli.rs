//! The display, for a person: `umdev screenshot` and the live view (`umdev view`, `umdev run
//! --view`) of a virtio-gpu whose guest-side driver (the test harness' `VirtioDriver`) drew
//! red and green stripes, against a daemon instance and against `umdev run --control`; and
//! the errors (unknown UUID, an instance without a display, a scanout never set, an output
//! that cannot be written).

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use umdev::testing::{DeviceAccess, VirtioDriver, Vmm};
use umdev::virtio::VIRTIO_F_VERSION_1;

#[path = "common/daemon.rs"]
mod daemon;

use daemon::{Daemon, BIN};

const RAM: u64 = 1 << 30;
const REQ: u64 = RAM + 0x8000;
const RESP: u64 = RAM + 0x9000;
const FB: u64 = RAM + 0x10000;
const W: u32 = 64;
const H: u32 = 32;
const RED: [u8; 3] = [0xff, 0, 0];
const GREEN: [u8; 3] = [0, 0xff, 0];

/// One command on the control queue: its header `words` and `tail`, a response of
/// `resp_len` bytes (returned).
fn call(
    vmm: &mut Vmm,
    drv: &mut VirtioDriver,
    words: &[u32],
    tail: &[u8],
    resp_len: u32,
) -> Vec<u8> {
    let mut req: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    req.extend_from_slice(tail);
    vmm.ram().write(REQ, &req).unwrap();
    let head = drv
        .add_chain(
            vmm,
            0,
            &[(REQ, req.len() as u32, false), (RESP, resp_len, true)],
        )
        .unwrap();
    drv.publish(vmm, 0, head).unwrap();
    drv.kick(vmm, 0).unwrap();
    drv.wait_used(vmm, 0, Duration::from_secs(5))
        .unwrap()
        .expect("no response");
    vmm.ram().read_vec(RESP, resp_len as usize).unwrap()
}

/// [`call`] with a plain 24-byte response: its type.
fn request(vmm: &mut Vmm, drv: &mut VirtioDriver, words: &[u32], tail: &[u8]) -> u32 {
    let r = call(vmm, drv, words, tail, 24);
    u32::from_le_bytes(r[..4].try_into().unwrap())
}

/// Attach to the virtio-gpu on `sock` and show a W×H resource on scanout 0: red in the left
/// half, green in the right. The returned client and driver stay attached.
fn draw_stripes(sock: &Path) -> (Vmm, VirtioDriver) {
    let mut vmm = Vmm::connect(sock).unwrap().with_ram(RAM, 1 << 20).unwrap();
    vmm.enable_device().unwrap();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    assert!(drv.negotiate(&mut vmm, VIRTIO_F_VERSION_1).unwrap());
    drv.setup_queue(&mut vmm, 0, 64, RAM, 0xffff).unwrap();
    drv.driver_ok(&mut vmm).unwrap();
    let pixels: Vec<u8> = (0..W * H)
        .flat_map(|i| {
            let c: u32 = if i % W < W / 2 { 0xff_0000 } else { 0x00_ff00 };
            c.to_le_bytes()
        })
        .collect();
    vmm.ram().write(FB, &pixels).unwrap();
    let ok = 0x1100;
    let hdr = |kind: u32| [kind, 0, 0, 0, 0, 0];
    // RESOURCE_CREATE_2D (id 1, B8G8R8X8), ATTACH_BACKING, SET_SCANOUT, TRANSFER_TO_HOST_2D.
    let create = [&hdr(0x101)[..], &[1, 2, W, H]].concat();
    assert_eq!(request(&mut vmm, &mut drv, &create, &[]), ok);
    let mut entry = FB.to_le_bytes().to_vec();
    entry.extend_from_slice(&(W * H * 4).to_le_bytes());
    entry.extend_from_slice(&[0; 4]);
    let attach = [&hdr(0x106)[..], &[1, 1]].concat();
    assert_eq!(request(&mut vmm, &mut drv, &attach, &entry), ok);
    let scanout = [&hdr(0x103)[..], &[0, 0, W, H, 0, 1]].concat();
    assert_eq!(request(&mut vmm, &mut drv, &scanout, &[]), ok);
    let transfer = [&hdr(0x105)[..], &[0, 0, W, H, 0, 0, 1, 0]].concat();
    assert_eq!(request(&mut vmm, &mut drv, &transfer, &[]), ok);
    (vmm, drv)
}

/// What the guest's driver learns after a host resize: the display event in the config
/// space's `events_read`, and scanout 0's mode from GET_DISPLAY_INFO.
fn guest_sees(vmm: &mut Vmm, drv: &mut VirtioDriver) -> (u32, (u32, u32)) {
    let mut ev = [0u8; 4];
    drv.read_config(vmm, 0, &mut ev).unwrap();
    // GET_DISPLAY_INFO: the header, then 16 scanouts of 24 bytes.
    let r = call(vmm, drv, &[0x100, 0, 0, 0, 0, 0], &[], 24 + 16 * 24);
    let word = |at: usize| u32::from_le_bytes(r[at..at + 4].try_into().unwrap());
    assert_eq!(word(0), 0x1101, "RESP_OK_DISPLAY_INFO");
    (u32::from_le_bytes(ev), (word(32), word(36)))
}

/// Decode a PNG: (width, height, RGB pixels).
fn decode(png: &[u8]) -> (u32, u32, Vec<u8>) {
    let decoder = png::Decoder::new(png);
    let mut reader = decoder.read_info().expect("not a PNG");
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

/// The PNG shows the stripes `draw_stripes` drew, every pixel.
fn assert_stripes(png: &[u8]) {
    let (w, h, rgb) = decode(png);
    assert_eq!((w, h), (W, H));
    for y in 0..H {
        for x in 0..W {
            let i = ((y * W + x) * 3) as usize;
            let want = if x < W / 2 { RED } else { GREEN };
            assert_eq!(rgb[i..i + 3], want, "pixel ({x}, {y})");
        }
    }
}

/// One HTTP request to `addr`; returns (status, head, body).
fn http(addr: &str, request: &str) -> (u16, String, Vec<u8>) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let at = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("no HTTP head");
    let head = String::from_utf8(all[..at].to_vec()).unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head, all[at + 4..].to_vec())
}

fn get(addr: &str, path: &str) -> (u16, String, Vec<u8>) {
    http(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n"),
    )
}

/// Wait until `log` holds `http://ADDR/`; returns ADDR.
fn view_addr(log: &Path, child: &mut Child) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = fs::read_to_string(log).unwrap_or_default();
        if let Some(at) = text.find("http://") {
            let rest = &text[at + "http://".len()..];
            return rest[..rest.find('/').unwrap()].to_owned();
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("exited ({status}) before serving the view:\n{text}");
        }
        assert!(Instant::now() < deadline, "no view URL logged:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A child process killed when the test ends, failed or not (no `umdev run` left behind).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Create an instance with `umdev create --type TYPE --json`; returns (uuid, socket).
fn create(d: &Daemon, ty: &str) -> (String, PathBuf) {
    let v = d.json(&["create", "--type", ty]);
    let i = &v["instance"];
    (
        i["uuid"].as_str().unwrap().to_owned(),
        PathBuf::from(i["socket"].as_str().unwrap()),
    )
}

#[test]
fn test_daemon_screenshot_png_matches_what_the_guest_drew() {
    let d = Daemon::start(&[]);
    let (uuid, sock) = create(&d, "vgpu-720p");
    let out = d.dir.path().join("screen.png");
    let out_s = out.to_str().unwrap();

    // Before the guest set a scanout: a clear error, and no file.
    let err = d.fail(&["screenshot", &uuid, "-o", out_s]);
    assert!(err.contains("shows nothing yet"), "{err}");
    assert!(!out.exists());

    let _guest = draw_stripes(&sock);
    let said = d.ok(&["screenshot", &uuid, "-o", out_s]);
    assert!(
        said.contains(&format!("{W}x{H}")) && said.contains(out_s),
        "{said}"
    );
    assert_stripes(&fs::read(&out).unwrap());

    // --json names what was written; `-o -` writes the PNG itself to stdout.
    let v = d.json(&["screenshot", &uuid, "-o", out_s]);
    assert_eq!(v["screenshot"]["width"], W);
    assert_eq!(v["screenshot"]["uuid"], uuid.as_str());
    let raw = d.umdev(&["screenshot", &uuid, "-o", "-"]);
    assert!(raw.status.success());
    assert_stripes(&raw.stdout);

    // A scanout the type does not have.
    let err = d.fail(&["screenshot", &uuid, "--scanout", "3", "-o", out_s]);
    assert!(err.contains("scanout 3 does not exist"), "{err}");
}

#[test]
fn test_daemon_screenshot_errors_unknown_uuid_no_display_unwritable() {
    let d = Daemon::start(&[]);
    let out = d.dir.path().join("x.png");
    let out_s = out.to_str().unwrap();
    let unknown = "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11";
    let err = d.fail(&["screenshot", unknown, "-o", out_s]);
    assert!(err.contains(&format!("no instance {unknown}")), "{err}");
    assert!(err.contains("umdev list"), "{err}");
    let err = d.fail(&["screenshot", "not-a-uuid", "-o", out_s]);
    assert!(err.contains("is not a UUID"), "{err}");
    let err = d.fail(&["screenshot", "-o", out_s]);
    assert!(err.contains("needs a UUID"), "{err}");

    let (ccw, _) = create(&d, "ccw-16m");
    let err = d.fail(&["screenshot", &ccw, "-o", out_s]);
    assert!(
        err.contains(&format!(
            "instance {ccw} of type ccw/ccw-16m has no display"
        )),
        "{err}"
    );
    let json = d.umdev(&["screenshot", &ccw, "-o", out_s, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "no_display");

    let (vgpu, sock) = create(&d, "vgpu-720p");
    let _guest = draw_stripes(&sock);
    let err = d.fail(&["screenshot", &vgpu, "-o", "/nonexistent/dir/x.png"]);
    assert!(err.contains("cannot write /nonexistent/dir/x.png"), "{err}");
    assert!(!out.exists());
}

#[test]
fn test_daemon_resize_tells_the_guest_and_refuses_what_it_cannot_show() {
    let d = Daemon::start(&[]);
    let (uuid, sock) = create(&d, "vgpu-720p");
    let (mut vmm, mut drv) = draw_stripes(&sock);
    assert_eq!(guest_sees(&mut vmm, &mut drv), (0, (1280, 720)));

    let said = d.ok(&["resize", &uuid, "--size", "1024x768"]);
    assert!(said.contains("is now 1024x768"), "{said}");
    assert_eq!(guest_sees(&mut vmm, &mut drv), (1, (1024, 768)));
    let v = d.json(&["resize", &uuid, "--size", "800x600"]);
    assert_eq!(v["resized"]["width"], 800);
    assert_eq!(v["resized"]["uuid"], uuid.as_str());
    assert_eq!(guest_sees(&mut vmm, &mut drv).1, (800, 600));

    // Refused: sizes an EDID cannot describe, a scanout it lacks, what is not WxH, an
    // instance without a display, no UUID. None of them changes the mode.
    let err = d.fail(&["resize", &uuid, "--size", "4096x600"]);
    assert!(err.contains("4096x600 is not a mode it can show"), "{err}");
    let err = d.fail(&["resize", &uuid, "--size", "0x600"]);
    assert!(err.contains("each side 1 to 4095"), "{err}");
    let err = d.fail(&["resize", &uuid, "--size", "640x480", "--scanout", "3"]);
    assert!(err.contains("no such scanout (the device has 1)"), "{err}");
    let bad = d.umdev(&["resize", &uuid, "--size", "1024"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("is not WIDTHxHEIGHT"));
    let (ccw, _) = create(&d, "ccw-16m");
    let err = d.fail(&["resize", &ccw, "--size", "640x480"]);
    assert!(err.contains("has no display"), "{err}");
    let err = d.fail(&["resize", "--size", "640x480"]);
    assert!(err.contains("the resize request needs a UUID"), "{err}");
    assert_eq!(guest_sees(&mut vmm, &mut drv).1, (800, 600));
}

#[test]
fn test_daemon_view_serves_png_and_page_404_405() {
    let d = Daemon::start(&[]);
    let (uuid, sock) = create(&d, "vgpu-720p");
    let _guest = draw_stripes(&sock);
    let log = d.dir.path().join("view.log");
    let mut view = Killed(
        Command::new(BIN)
            .args(["view", &uuid, "--listen", "127.0.0.1:0"])
            .env("UMDEV_CONTROL", d.control())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let addr = view_addr(&log, &mut view.0);
    let (status, head, png) = get(&addr, "/screen.png?t=1");
    assert_eq!(status, 200, "{head}");
    assert!(head.contains("Content-Type: image/png"), "{head}");
    assert_stripes(&png);
    let (status, _, page) = get(&addr, "/");
    assert_eq!(status, 200);
    let page = String::from_utf8(page).unwrap();
    assert!(
        page.contains("/screen.png") && page.contains(&uuid),
        "{page}"
    );
    assert_eq!(get(&addr, "/other").0, 404);
    assert_eq!(http(&addr, "POST / HTTP/1.1\r\n\r\n").0, 405);
    drop(view);

    // An instance without a display: `umdev view` says so at once.
    let (ccw, _) = create(&d, "ccw-16m");
    let err = d.fail(&["view", &ccw, "--listen", "127.0.0.1:0"]);
    assert!(err.contains("has no display"), "{err}");
}

#[test]
fn test_run_control_screenshot_and_view_show_what_the_guest_drew() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vgpu.sock");
    let ctl = dir.path().join("vgpu.ctl");
    let log = dir.path().join("run.log");
    let out = dir.path().join("screen.png");
    let mut run = Killed(
        Command::new(BIN)
            .args(["run", "virtio-gpu", "--width", "64", "--height", "32"])
            .arg("--socket")
            .arg(&sock)
            .arg("--control")
            .arg(&ctl)
            .args(["--view", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    let addr = view_addr(&log, &mut run.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(sock.exists() && ctl.exists()) {
        assert!(Instant::now() < deadline, "no sockets");
        std::thread::sleep(Duration::from_millis(20));
    }
    let umdev = |args: &[&str]| {
        Command::new(BIN)
            .args(args)
            .arg("--control")
            .arg(&ctl)
            .env_remove("UMDEV_CONTROL")
            .output()
            .unwrap()
    };
    let out_s = out.to_str().unwrap();

    // Nothing shown yet: the screenshot fails clearly, the view answers 503 with why.
    let early = umdev(&["screenshot", "-o", out_s]);
    assert_eq!(early.status.code(), Some(1));
    let err = String::from_utf8_lossy(&early.stderr);
    assert!(err.contains("scanout 0 shows nothing yet"), "{err}");
    let (status, _, body) = get(&addr, "/screen.png");
    assert_eq!(status, 503);
    assert!(String::from_utf8_lossy(&body).contains("shows nothing yet"));

    let mut guest = draw_stripes(&sock);
    let shot = umdev(&["screenshot", "-o", out_s]);
    assert!(
        shot.status.success(),
        "{}",
        String::from_utf8_lossy(&shot.stderr)
    );
    assert_stripes(&fs::read(&out).unwrap());
    // The view's frame cache keeps a frame for 200 ms: wait past the 503 above.
    std::thread::sleep(Duration::from_millis(300));
    let (status, head, png) = get(&addr, "/screen.png");
    assert_eq!(status, 200, "{head}");
    assert_stripes(&png);
    assert_eq!(get(&addr, "/favicon.ico").0, 404);
    assert_eq!(http(&addr, "DELETE /screen.png HTTP/1.1\r\n\r\n").0, 405);

    // `umdev view` against run's control socket serves the same picture.
    let vlog = dir.path().join("view.log");
    let mut view = Killed(
        Command::new(BIN)
            .args(["view", "--listen", "127.0.0.1:0", "--control"])
            .arg(&ctl)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&vlog).unwrap())
            .spawn()
            .unwrap(),
    );
    let vaddr = view_addr(&vlog, &mut view.0);
    let (status, _, png) = get(&vaddr, "/screen.png");
    assert_eq!(status, 200);
    assert_stripes(&png);
    drop(view);

    // A UUID, or a daemon command, on run's control socket: refused, saying why.
    let with_uuid = umdev(&[
        "screenshot",
        "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11",
        "-o",
        out_s,
    ]);
    assert!(String::from_utf8_lossy(&with_uuid.stderr).contains("leave out the UUID"));
    let list = umdev(&["list"]);
    assert_eq!(list.status.code(), Some(1));
    let err = String::from_utf8_lossy(&list.stderr);
    assert!(err.contains("answers `umdev screenshot`"), "{err}");

    // A host resize through run's control socket reaches the guest's driver.
    let resized = umdev(&["resize", "--size", "48x16"]);
    assert!(
        resized.status.success(),
        "{}",
        String::from_utf8_lossy(&resized.stderr)
    );
    let (vmm, drv) = &mut guest;
    assert_eq!(guest_sees(vmm, drv), (1, (48, 16)));
    let with_uuid = umdev(&[
        "resize",
        "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11",
        "--size",
        "48x16",
    ]);
    assert!(String::from_utf8_lossy(&with_uuid.stderr).contains("leave out the UUID"));

    // SAFETY: sending SIGTERM to our own child process.
    assert_eq!(unsafe { libc::kill(run.0.id() as i32, libc::SIGTERM) }, 0);
    let status = run.0.wait().unwrap();
    assert!(status.success(), "{}", fs::read_to_string(&log).unwrap());
    assert!(
        !ctl.exists(),
        "the control socket is removed when run stops"
    );
}

#[test]
fn test_run_control_and_view_refused_for_devices_without_display() {
    let out = Command::new(BIN)
        .args(["run", "gpu", "--socket", "/nonexistent/x.sock"])
        .args(["--view", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--control and --view are for virtio-gpu"),
        "{err}"
    );
}
