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
    // Text through fbcon for the host's screenshot (vmtest/src/display.rs checks it).
    let console = console_text(&[
        format!("PCI {addr}: {driver}, virtio_gpu bound; fb0 {size} at {bpp} bpp, stride {stride}"),
        "The host takes this screen's screenshot now and looks for these lines.".into(),
    ]);
    let wrote = std::fs::write("/dev/tty1", console.as_bytes());
    r.check(
        "tty1_written",
        wrote.is_ok(),
        format!("{} lines: {wrote:?}", console.lines().count()),
    );
    r.ready("fbcon-text");
    // The host takes screenshots until the text has arrived, for at most 4 s
    // (vmtest/src/display.rs, FBCON_DEADLINE): fbcon's damage reaches the device later.
    std::thread::sleep(Duration::from_secs(7));
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

/// What the guest shows on its console for the host's screenshot: the screen cleared and
/// the cursor hidden, a row of 16 full blocks (U+2588; the host finds them as one solid
/// rectangle at the top left), a title, `lines`, and the kernel's messages about the device.
fn console_text(lines: &[String]) -> String {
    let mut text = String::from("\x1b[?25l\x1b[2J\x1b[H");
    text.push_str(&"\u{2588}".repeat(16));
    text.push_str("\numdev virtio-gpu: the guest's fbcon on fb0 (virtio_gpudrmfb)\n");
    for line in lines {
        text.push_str(line);
        text.push('\n');
    }
    text.push('\n');
    let about_the_device = |m: &str| {
        !m.to_lowercase().contains("command line")
            && ["virtio", "drm", "fb0"].iter().any(|w| m.contains(w))
    };
    for line in kernel_messages(about_the_device).iter().take(30) {
        text.push_str(line);
        text.push('\n');
    }
    text
}

/// The kernel log's messages that `keep` selects (read from /dev/kmsg without waiting).
fn kernel_messages(keep: impl Fn(&str) -> bool) -> Vec<String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(mut kmsg) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
    else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut record = vec![0u8; 8192];
    // One record per read; EPIPE once if the oldest records were overwritten since the
    // open, EAGAIN at the end of the log.
    loop {
        let n = match kmsg.read(&mut record) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        };
        let text = String::from_utf8_lossy(&record[..n]);
        if let Some((_, msg)) = text.split_once(';') {
            let msg = msg.lines().next().unwrap_or_default().trim();
            if keep(msg) {
                out.push(msg.chars().take(150).collect());
            }
        }
    }
    out
}

/// The DRM card node of the PCI device at `addr` (`/dev/dri/cardN`).
fn card_of(addr: &str) -> Option<String> {
    let dir = std::fs::read_dir("/sys/class/drm").ok()?;
    dir.flatten().find_map(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("card") || name.contains('-') {
            return None;
        }
        let dev = std::fs::read_link(e.path().join("device")).ok()?;
        // card → virtio device (virtioN) → its PCI parent.
        let pci = std::fs::canonicalize(e.path().join("device").join("..")).ok();
        let hit = dev.to_string_lossy().ends_with(addr)
            || pci.is_some_and(|p| p.to_string_lossy().ends_with(addr));
        hit.then(|| format!("/dev/dri/{name}"))
    })
}

/// The virtio-gpu's PCI address and DRM card node, checked as `<what>.device` and
/// `<what>.card`.
fn device_card(r: &mut Report, what: &str) -> Option<(String, String)> {
    let addr = find("0x1af4", "0x1050");
    let addr = r.ok(
        &format!("{what}.device"),
        addr.ok_or("no 1af4:1050 on the PCI bus"),
    )?;
    let node = r.ok(
        &format!("{what}.card"),
        card_of(&addr).ok_or(format!("no DRM card for {addr}")),
    )?;
    Some((addr, node))
}

/// Fill a dumb buffer with `pattern`.
fn paint(d: &mut crate::drm::Dumb, pattern: fn(u32, u32) -> u32) {
    let (w, h, pitch) = (d.width, d.height, d.pitch as usize);
    let px = d.pixels();
    for y in 0..h {
        let row = &mut px[y as usize * pitch..y as usize * pitch + w as usize * 4];
        for (x, p) in row.chunks_exact_mut(4).enumerate() {
            p.copy_from_slice(&pattern(x as u32, y).to_le_bytes());
        }
    }
}

/// The stock driver's KMS path, as a compositor uses it: DRM master on the card, two
/// XRGB8888 dumb buffers (the test pattern and its flipped variant), a mode set showing the
/// first, a page flip to the second with its completion event. Then the host takes a
/// screenshot at the `kms-flipped` cue and compares it with the flipped pattern. Closing
/// the card hands the display back to fbcon (the `virtio-gpu` scenario runs next).
pub fn run_kms(r: &mut Report) -> Option<()> {
    use umdev_devices::virtio_gpu::test_pattern_flipped;
    let (_, node) = device_card(r, "kms")?;
    let mut card = r.ok("kms.open", crate::drm::Card::open(&node))?;
    r.ok("kms.master", card.set_master())?;
    let out = r.ok("kms.output", card.output())?;
    let mode = crate::drm::find_mode(&out.modes, 1280, 800);
    r.check(
        "kms.mode_1280x800",
        mode.is_some(),
        format_args!("{} modes", out.modes.len()),
    );
    let mode = mode.or_else(|| out.modes.first().copied())?;
    let (w, h) = (u32::from(mode.hdisplay), u32::from(mode.vdisplay));
    let mut a = r.ok("kms.dumb_a", card.dumb(w, h))?;
    let mut b = r.ok("kms.dumb_b", card.dumb(w, h))?;
    paint(&mut a, test_pattern);
    paint(&mut b, test_pattern_flipped);
    r.ok("kms.set_crtc", card.set_crtc(&out, a.fb_id, &mode))?;
    r.ok("kms.page_flip", card.page_flip(&out, b.fb_id, 0x7e57_f11b))?;
    // The host screenshots now; the flip's flush reached the device before the event.
    r.ready("kms-flipped");
    std::thread::sleep(Duration::from_secs(3));
    r.ok("kms.destroy_a", card.destroy(a))?;
    r.ok("kms.destroy_b", card.destroy(b))?;
    // Back to fbcon: closing the last DRM fd makes the fbdev emulation restore its mode.
    drop(card);
    std::thread::sleep(Duration::from_millis(500));
    Some(())
}

/// The preferred (first) mode the driver lists for `connector` (a /sys/class/drm entry)
/// after a fresh probe: "detect" written to its status makes the kernel fill the modes
/// again from what the driver last read of the device (its EDID and display info).
fn probed_first_mode(connector: &str) -> String {
    let _ = std::fs::write(format!("{connector}/status"), "detect");
    read(&format!("{connector}/modes"))
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// Interrupts of the device's config vector (`virtioN-config` in /proc/interrupts).
fn config_interrupts(virtio: &str) -> u64 {
    let name = format!("{virtio}-config");
    read("/proc/interrupts")
        .lines()
        .find(|l| l.split_whitespace().any(|w| w == name))
        .map(|l| {
            l.split_whitespace()
                .skip(1)
                .map_while(|w| w.parse::<u64>().ok())
                .sum()
        })
        .unwrap_or(0)
}

/// A host-side resize (`umdev resize --control`, at the `resize:WxH` cues): the device
/// raises its display event (the config interrupt), the stock driver reads the new display
/// info and EDID, and its connector then lists the new mode first. Then the host sets the
/// original mode back and the guest sees that too, so the scenarios after this one find the
/// display as it booted.
pub fn run_resize(r: &mut Report) -> Option<()> {
    let (addr, node) = device_card(r, "resize")?;
    let card = node.trim_start_matches("/dev/dri/");
    let connector = std::fs::read_dir("/sys/class/drm").ok().and_then(|d| {
        d.flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n.starts_with(&format!("{card}-")))
    });
    let connector = r.ok(
        "resize.connector",
        connector.ok_or(format!("no connector of {card} in /sys/class/drm")),
    )?;
    let connector = format!("/sys/class/drm/{connector}");
    let virtio = std::fs::read_dir(format!("/sys/bus/pci/devices/{addr}"))
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("virtio"))
        .unwrap_or_default();
    let first = probed_first_mode(&connector);
    r.check("resize.boot_mode", first == "1280x800", &first);
    for (w, h) in [(1024, 768), (1280, 800)] {
        let want = format!("{w}x{h}");
        let irqs = config_interrupts(&virtio);
        r.ready(&format!("resize:{want}"));
        let start = std::time::Instant::now();
        let now = loop {
            std::thread::sleep(Duration::from_millis(100));
            let now = probed_first_mode(&connector);
            if now == want || start.elapsed() > Duration::from_secs(20) {
                break now;
            }
        };
        r.check(
            &format!("resize.driver_lists_{want}_first"),
            now == want,
            format_args!("{now} after {:.1} s", start.elapsed().as_secs_f64()),
        );
        let after = config_interrupts(&virtio);
        r.check(
            &format!("resize.config_interrupt_{want}"),
            after > irqs,
            format_args!("{virtio}-config: {irqs} -> {after}"),
        );
    }
    Some(())
}

/// Bus Master cleared under the stock driver: the guest then writes another pattern to
/// /dev/fb0. The device must not read it (the host's final screenshot still shows the
/// `virtio-gpu` scenario's pattern) and must report the failed access as DEVICE_NEEDS_RESET
/// (status bit 0x40, which sysfs shows).
pub fn run_bme(r: &mut Report) -> Option<()> {
    use crate::pci::{command, PciDev};
    let dev = r.ok("bme.pci", PciDev::find(0x1af4, 0x1050))?;
    let addr = dev.bdf.clone();
    let virtio = std::fs::read_dir(format!("/sys/bus/pci/devices/{addr}"))
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .find(|n| n.starts_with("virtio"));
    let virtio = r.ok(
        "bme.virtio_dev",
        virtio.ok_or("no virtioN under the PCI device"),
    )?;
    let status = || {
        let s = read(&format!("/sys/bus/virtio/devices/{virtio}/status"));
        u32::from_str_radix(s.trim_start_matches("0x"), 16).unwrap_or(0)
    };
    let before = status();
    r.check(
        "bme.status_before",
        before & 0x40 == 0 && before & 0x4 != 0,
        format_args!("status {before:#x} (DRIVER_OK, not NEEDS_RESET)"),
    );
    r.ok(
        "bme.clear_bus_master",
        dev.update_command(0, command::BUS_MASTER),
    )?;
    let stride: usize = read("/sys/class/graphics/fb0/stride")
        .parse()
        .unwrap_or(1280 * 4);
    let fb = vec![0x5au8; stride * 800];
    r.ok("bme.fb0_write", std::fs::write("/dev/fb0", &fb))?;
    // The fbdev damage worker flushes on a timer; give it time to try.
    let deadline = std::time::Instant::now() + Duration::from_secs(8);
    let mut now = status();
    while now & 0x40 == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        now = status();
    }
    r.check(
        "bme.needs_reset",
        now & 0x40 != 0,
        format_args!("status {now:#x} after a flush with Bus Master clear"),
    );
    Some(())
}

/// One card of the side-by-side: its label and DRM node.
fn bench_cards() -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/sys/bus/pci/devices") else {
        return out;
    };
    for e in dir.flatten() {
        let p = e.path().display().to_string();
        if read(&format!("{p}/vendor")) != "0x1af4" || read(&format!("{p}/device")) != "0x1050" {
            continue;
        }
        // QEMU's own virtio-gpu-pci has subsystem 1af4:1100; umdev's the device id 0x0010.
        let label = if read(&format!("{p}/subsystem_device")) == "0x1100" {
            "qemu"
        } else {
            "umdev"
        };
        let addr = e.file_name().to_string_lossy().into_owned();
        if let Some(node) = card_of(&addr) {
            out.push((label, node));
        }
    }
    out.sort_by_key(|(l, _)| *l != "umdev");
    out
}

/// Frames per second through the stock driver's KMS path, umdev's virtio-gpu against
/// QEMU's own `virtio-gpu-pci` in the same guest, both 1920×1080: a dumb buffer shown with a
/// mode set, then for [`BENCH_RUN`] each: `frames` (write the whole buffer, then DIRTYFB:
/// what a guest program drawing full frames does) and `flushes` (DIRTYFB alone: the
/// device's TRANSFER_TO_HOST_2D + RESOURCE_FLUSH of the full frame, without the guest's
/// drawing). Runs alternate between the cards, [`BENCH_ROUNDS`] rounds, and are framed by
/// begin/end cues so the host reports its CPU time per frame.
pub fn run_bench(r: &mut Report) -> Option<()> {
    const BENCH_RUN: Duration = Duration::from_secs(3);
    const BENCH_ROUNDS: usize = 2;
    let cards = bench_cards();
    let labels: Vec<&str> = cards.iter().map(|(l, _)| *l).collect();
    r.check(
        "vgpu-bench.cards",
        labels == ["umdev", "qemu"],
        format_args!("{cards:?}"),
    )
    .then_some(())?;
    let mut open = Vec::new();
    for (label, node) in &cards {
        let card = r.ok(
            &format!("vgpu-bench.{label}.open"),
            crate::drm::Card::open(node),
        )?;
        r.ok(&format!("vgpu-bench.{label}.master"), card.set_master())?;
        let out = r.ok(&format!("vgpu-bench.{label}.output"), card.output())?;
        let mode = crate::drm::find_mode(&out.modes, 1920, 1080);
        let mode = r.ok(
            &format!("vgpu-bench.{label}.mode"),
            mode.ok_or(format!("no 1920x1080 among {} modes", out.modes.len())),
        )?;
        let mut d = r.ok(&format!("vgpu-bench.{label}.dumb"), card.dumb(1920, 1080))?;
        paint(&mut d, test_pattern);
        r.ok(
            &format!("vgpu-bench.{label}.set_crtc"),
            card.set_crtc(&out, d.fb_id, &mode),
        )?;
        open.push((*label, card, d));
    }
    let mut sums = [[(0u64, 0f64); 2]; 2];
    for round in 0..BENCH_ROUNDS {
        for (li, load) in ["frames", "flushes"].iter().enumerate() {
            for k in 0..2 {
                let c = (k + round) % 2;
                let (label, card, d) = &mut open[c];
                r.ready(&format!("begin:{label}:{load}"));
                let start = std::time::Instant::now();
                let mut n = 0u64;
                let mut err = None;
                while start.elapsed() < BENCH_RUN {
                    if li == 0 {
                        d.pixels().fill(n as u8);
                    }
                    if let Err(e) = card.dirty(d.fb_id, 1920, 1080) {
                        err = Some(e);
                        break;
                    }
                    n += 1;
                }
                let secs = start.elapsed().as_secs_f64();
                r.ready(&format!("end:{label}:{load}:{n}"));
                let name = format!("vgpu-bench.{label}.{load}.r{round}");
                r.check(
                    &name,
                    err.is_none() && n > 0,
                    format_args!("{n} in {secs:.2} s {err:?}"),
                );
                sums[li][c].0 += n;
                sums[li][c].1 += secs;
            }
        }
    }
    for (li, load) in ["frames", "flushes"].iter().enumerate() {
        let rate = |c: usize| sums[li][c].0 as f64 / sums[li][c].1.max(1e-9);
        r.measure(&format!("umdev.{load}_per_s"), rate(0), "1/s");
        r.measure(&format!("qemu.{load}_per_s"), rate(1), "1/s");
        r.measure(
            &format!("ratio.{load}"),
            rate(0) / rate(1).max(1e-9),
            "x_qemu",
        );
    }
    for (label, card, d) in open {
        r.ok(&format!("vgpu-bench.{label}.destroy"), card.destroy(d))?;
    }
    Some(())
}
