//! The `virtio-gpu` scenario: umdev's virtio-gpu, driven by the guest kernel's stock
//! `virtio_gpu` driver (no umdev code in the guest touches the device). Checks that
//! `virtio-pci` and `virtio_gpu` bound it, that fbcon took the framebuffer, then writes
//! [`umdev_devices::virtio_gpu::test_pattern`] to `/dev/fb0` in one write (Linux 6.1's
//! fbdev emulation damages the written range; the flush reaches the device on a timer)
//! and waits. The host compares the device's screenshot with the pattern.

use std::time::Duration;

use umdev_devices::virtio_gpu::test_pattern;

use crate::report::Report;

fn read(path: &str) -> String {
    std::fs::read_to_string(path)
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|e| format!("({path}: {e})"))
}

/// The PCI address of the device with `vendor:device`, if any.
fn find(vendor: &str, device: &str) -> Option<String> {
    let dir = std::fs::read_dir("/sys/bus/pci/devices").ok()?;
    dir.flatten().find_map(|e| {
        let p = e.path();
        let v = read(&format!("{}/vendor", p.display()));
        let d = read(&format!("{}/device", p.display()));
        (v == vendor && d == device).then(|| e.file_name().to_string_lossy().into_owned())
    })
}

pub fn run(r: &mut Report) -> Option<()> {
    let addr = find("0x1af4", "0x1050");
    if !r.check("device_found", addr.is_some(), "1af4:1050 on the PCI bus") {
        return None;
    }
    let addr = addr?;
    let driver = std::fs::read_link(format!("/sys/bus/pci/devices/{addr}/driver"))
        .map(|p| {
            p.file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    r.check("virtio_pci_bound", driver == "virtio-pci", &driver);
    let bound = std::fs::read_dir("/sys/bus/virtio/drivers/virtio_gpu")
        .map(|d| {
            d.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("virtio"))
        })
        .unwrap_or(false);
    r.check(
        "virtio_gpu_bound",
        bound,
        "/sys/bus/virtio/drivers/virtio_gpu",
    );
    let name = read("/sys/class/graphics/fb0/name");
    if !r.check("fb0_is_virtio_gpu", name == "virtio_gpudrmfb", &name) {
        return None;
    }
    let size = read("/sys/class/graphics/fb0/virtual_size");
    let bpp = read("/sys/class/graphics/fb0/bits_per_pixel");
    let stride = read("/sys/class/graphics/fb0/stride");
    r.check(
        "fb0_mode",
        size == "1280,800" && bpp == "32",
        format!("{size} {bpp} bpp"),
    );
    let fbcon = (0..4)
        .any(|i| read(&format!("/sys/class/vtconsole/vtcon{i}/name")).contains("frame buffer"));
    r.check(
        "fbcon_bound",
        fbcon,
        "a vtconsole is the frame buffer device",
    );
    let _ = std::fs::write("/sys/class/graphics/fbcon/cursor_blink", "0");
    let stride: usize = stride.parse().unwrap_or(1280 * 4);
    let (w, h) = (1280u32, 800u32);
    let mut fb = vec![0u8; stride * h as usize];
    for y in 0..h {
        for x in 0..w {
            let at = y as usize * stride + x as usize * 4;
            fb[at..at + 4].copy_from_slice(&test_pattern(x, y).to_le_bytes());
        }
    }
    let wrote = std::fs::write("/dev/fb0", &fb);
    r.check(
        "fb0_written",
        wrote.is_ok(),
        format!("{} bytes: {wrote:?}", fb.len()),
    );
    // The fbdev damage worker flushes on a timer (about 1 s at worst under TCG).
    std::thread::sleep(Duration::from_secs(4));
    Some(())
}
