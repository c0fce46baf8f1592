//! `umdev run virtio-gpu` as a user runs it: a guest-side virtio driver draws a pattern
//! through the socket, SIGTERM stops it, and `--screenshot-on-exit` holds the pattern.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umdev::testing::{DeviceAccess, VirtioDriver, Vmm};
use umdev::virtio::VIRTIO_F_VERSION_1;

const RAM: u64 = 1 << 30;
const REQ: u64 = RAM + 0x8000;
const RESP: u64 = RAM + 0x9000;
const FB: u64 = RAM + 0x10000;
const W: u32 = 64;
const H: u32 = 32;

fn request(vmm: &mut Vmm, drv: &mut VirtioDriver, words: &[u32], tail: &[u8]) -> u32 {
    let mut req: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    req.extend_from_slice(tail);
    vmm.ram().write(REQ, &req).unwrap();
    let head = drv
        .add_chain(vmm, 0, &[(REQ, req.len() as u32, false), (RESP, 24, true)])
        .unwrap();
    drv.publish(vmm, 0, head).unwrap();
    drv.kick(vmm, 0).unwrap();
    drv.wait_used(vmm, 0, Duration::from_secs(5))
        .unwrap()
        .expect("no response");
    let r = vmm.ram().read_vec(RESP, 4).unwrap();
    u32::from_le_bytes(r[..4].try_into().unwrap())
}

#[test]
fn test_run_virtio_gpu_screenshot_on_exit_holds_what_the_guest_drew() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("vgpu.sock");
    let png = dir.path().join("screen.png");
    let child = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args([
            "run",
            "virtio-gpu",
            "--width",
            "64",
            "--height",
            "32",
            "--socket",
        ])
        .arg(&sock)
        .arg("--screenshot-on-exit")
        .arg(&png)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut vmm = Vmm::connect(&sock).unwrap().with_ram(RAM, 1 << 20).unwrap();
    vmm.enable_device().unwrap();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    assert!(drv.negotiate(&mut vmm, VIRTIO_F_VERSION_1).unwrap());
    drv.setup_queue(&mut vmm, 0, 64, RAM, 0xffff).unwrap();
    drv.driver_ok(&mut vmm).unwrap();
    // XRGB8888 stripes: red left half, green right half.
    let pixels: Vec<u8> = (0..W * H)
        .flat_map(|i| {
            let c: u32 = if i % W < W / 2 { 0xff_0000 } else { 0x00_ff00 };
            c.to_le_bytes()
        })
        .collect();
    vmm.ram().write(FB, &pixels).unwrap();
    let ok = 0x1100;
    let hdr = |kind: u32| [kind, 0, 0, 0, 0, 0];
    assert_eq!(
        request(
            &mut vmm,
            &mut drv,
            &[&hdr(0x101)[..], &[1, 2, W, H]].concat(),
            &[]
        ),
        ok
    );
    let mut entry = FB.to_le_bytes().to_vec();
    entry.extend_from_slice(&(W * H * 4).to_le_bytes());
    entry.extend_from_slice(&[0; 4]);
    assert_eq!(
        request(
            &mut vmm,
            &mut drv,
            &[&hdr(0x106)[..], &[1, 1]].concat(),
            &entry
        ),
        ok
    );
    assert_eq!(
        request(
            &mut vmm,
            &mut drv,
            &[&hdr(0x103)[..], &[0, 0, W, H, 0, 1]].concat(),
            &[]
        ),
        ok
    );
    let transfer = [&hdr(0x105)[..], &[0, 0, W, H, 0, 0, 1, 0]].concat();
    assert_eq!(request(&mut vmm, &mut drv, &transfer, &[]), ok);
    drop(vmm);

    // SAFETY: sending SIGTERM to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "umdev run failed: {log}");
    let decoder = png::Decoder::new(std::fs::File::open(&png).expect("no screenshot"));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!((info.width, info.height), (W, H));
    let at = |x: u32, y: u32| {
        let i = ((y * W + x) * 3) as usize;
        [buf[i], buf[i + 1], buf[i + 2]]
    };
    assert_eq!(at(0, 0), [0xff, 0, 0]);
    assert_eq!(at(W / 2 - 1, H - 1), [0xff, 0, 0]);
    assert_eq!(at(W / 2, 0), [0, 0xff, 0]);
}

#[test]
fn test_run_screenshot_on_exit_is_refused_for_other_devices() {
    let out = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["run", "gpu", "--socket", "/nonexistent/x.sock"])
        .args(["--screenshot-on-exit", "/tmp/x.png"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("for virtio-gpu"));
}
