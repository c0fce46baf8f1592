//! Removing an instance while this guest uses it (`umdev remove`, issue 12 item 2), as the
//! `unplug` guest run of `vmtest/` stages it: one `umdev daemon` serves two GPU instances
//! and a ccw instance; GPU A sits behind a `pcie-root-port` (a hotplug slot), GPU B on q35's
//! root bus `pcie.0` (no hotplug), the ccw instance behind a root port of its own.
//!
//! - `unplug`: the guest drives A (uio bound, BARs mapped, a FILL and a READBACK into guest
//!   pages its GTT pins, a FENCE), keeps all of that in place, prints the cue
//!   `UMDEV-READY unplug remove` and waits (bounded) for A to leave
//!   `/sys/bus/pci/devices`. The host runs `umdev remove A`, and QEMU is asked to unplug A
//!   (by the device-request IRQ where QEMU answers it, by QMP `device_del` where it does
//!   not, as QEMU 10.2.2's vfio-user-pci); the guest kernel's hotplug driver ejects the
//!   function, QEMU frees it and closes the socket, the removal completes. Then the ccw
//!   instance must still serve.
//! - `unplug-busy`: the same use of B, the cue `UMDEV-READY unplug-busy remove`, then B's ID
//!   register is polled (bounded). QEMU cannot unplug a device on `pcie.0`, so the host's
//!   `umdev remove B` ends in `busy` and `umdev remove B --force` disconnects QEMU from the
//!   server: from then on a trapped BAR access reaches no server, and the guest records
//!   what it reads (QEMU answers all-ones, after its message timeout). B stays in the
//!   guest's PCI tree throughout.
//!
//! The kernel's hotplug messages (`/dev/kmsg`) are printed as notes, and the slot's driver
//! (acpiphp or pciehp) is in the `unplug.hotplug_slot` check.

use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use umdev_devices::ccw::driver::{pattern, CcwWord, BLOCK_SIZE};
use umdev_devices::gpu::commands::Command;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{DEVICE_ID, VENDOR_ID};

use crate::ccw::Ccw;
use crate::gpu_kit::{self, Gpu, Surface};
use crate::mem::DmaBuf;
use crate::pci::PciDev;
use crate::report::Report;

/// How long the guest waits for the host's removal to take effect. The daemon's release
/// timeout is 10 s, a forced removal follows a refused one, and TCG is slow.
const WAIT: Duration = Duration::from_secs(90);

/// The window of the framebuffer the CPU initialises (small: nothing here compares screens).
const WINDOW: gpu_kit::Rect = (0, 0, 16, 16);

/// The READBACK target: 64 × 16 pixels in scattered guest pages behind GTT entries 0..
const SURF: (u32, u32, u32) = (64, 16, 64 * 4 + 64);
const FILL_COLOR: u32 = 0x0031_4159;

/// The ccw blocks each scenario writes and reads back (away from the other scenarios').
const CCW_BLOCK_UNPLUG: u64 = 30000;
const CCW_BLOCK_BUSY: u64 = 30100;
const CCW_LEN: usize = 8192;

/// `bus` of a `dddd:bb:dd.f` address.
fn bus_of(bdf: &str) -> Option<u8> {
    let bus = bdf.split(':').nth(1)?;
    u8::from_str_radix(bus, 16).ok()
}

/// The GPUs: (the one on the root bus, the one behind a port), each if present.
fn gpus() -> io::Result<(Option<PciDev>, Option<PciDev>)> {
    let (mut root, mut port) = (None, None);
    for d in PciDev::find_all(VENDOR_ID, DEVICE_ID)? {
        match bus_of(&d.bdf) {
            Some(0) => root = root.or(Some(d)),
            Some(_) => port = port.or(Some(d)),
            None => {}
        }
    }
    Ok((root, port))
}

/// The hotplug slot whose address (`dddd:bb:dd`) is `dev`'s: (slot name, its driver module
/// if the kernel names one).
fn hotplug_slot(dev: &PciDev) -> Option<(String, String)> {
    let want = dev.bdf.rsplit_once('.')?.0.to_string();
    for e in std::fs::read_dir("/sys/bus/pci/slots").ok()?.flatten() {
        let addr = std::fs::read_to_string(e.path().join("address")).unwrap_or_default();
        if addr.trim() == want {
            let module = std::fs::read_link(e.path().join("module"))
                .ok()
                .and_then(|l| l.file_name().map(|n| n.to_string_lossy().into_owned()))
                .unwrap_or_else(|| "?".into());
            return Some((e.file_name().to_string_lossy().into_owned(), module));
        }
    }
    None
}

/// Every hotplug slot as `name=address`, for the notes.
fn slots() -> String {
    let mut v: Vec<String> = std::fs::read_dir("/sys/bus/pci/slots")
        .map(|d| {
            d.flatten()
                .map(|e| {
                    let a = std::fs::read_to_string(e.path().join("address")).unwrap_or_default();
                    format!("{}={}", e.file_name().to_string_lossy(), a.trim())
                })
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(" ")
    }
}

/// Kernel log records (`/dev/kmsg`) that mention `words`, as `[seconds] text`.
fn kernel_lines(words: &[&str]) -> Vec<String> {
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")
    else {
        return vec![];
    };
    let mut out = Vec::new();
    let mut buf = vec![0u8; 8192];
    // One record per read; EAGAIN at the end (EPIPE when a record was overwritten: go on).
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                let rec = String::from_utf8_lossy(&buf[..n]);
                let Some((head, text)) = rec.split_once(';') else {
                    continue;
                };
                let text = text.lines().next().unwrap_or("").trim();
                if words.iter().any(|w| text.contains(w)) {
                    let us: u64 = head
                        .split(',')
                        .nth(2)
                        .and_then(|t| t.parse().ok())
                        .unwrap_or(0);
                    out.push(format!("[{:.3}] {text}", us as f64 / 1e6));
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(_) => break,
        }
    }
    out
}

/// Use the GPU a little and leave it in use: FILL a rectangle, READBACK it through the GTT
/// into scattered guest pages (which the device pins), FENCE; check the pixels. The GTT
/// stays mapped (the pins stay held) for the removal.
fn use_gpu(r: &mut Report, p: &str, g: &mut Gpu) -> Option<Surface> {
    let (w, h, stride) = SURF;
    let dst = r.ok(&format!("{p}.surface"), Surface::new(w, h, stride, 0xee))?;
    r.ok(&format!("{p}.gtt_map"), g.map(0, &dst, true))?;
    let cmds = [
        Command::FillRect {
            x: 0,
            y: 0,
            w,
            h,
            color: FILL_COLOR,
        },
        Command::Readback {
            src_x: 0,
            src_y: 0,
            w,
            h,
            gtt_index: 0,
            stride,
        },
    ];
    r.ok(&format!("{p}.fill_readback_fence"), g.run(&cmds))?;
    let (bad, first) = r.ok(&format!("{p}.readback_read"), dst.diff(|_, _| FILL_COLOR))?;
    r.check(
        &format!("{p}.readback_pixels"),
        bad == 0,
        format_args!(
            "{bad} wrong bytes in {} GTT-mapped pages{first}",
            dst.pages()
        ),
    )
    .then_some(dst)
}

/// The ccw instance serves: WRITE `CCW_LEN` bytes of the pattern of a seed at `block` from
/// contiguous memory, READ them back elsewhere, compare (checks `<ccw prefix>.<name>_*`).
/// The host checks the image file for the same bytes after the daemon stopped.
fn ccw_serves(r: &mut Report, c: &mut Ccw, name: &str, buf: &DmaBuf, block: u64) -> Option<()> {
    let pos = block * BLOCK_SIZE;
    let seed = block ^ 0x5eed;
    let mut data = vec![0u8; CCW_LEN];
    pattern::fill(seed, pos, &mut data);
    let (src, dst) = (0usize, 0x10000usize);
    r.ok(
        &c.n(&format!("{name}_prepare")),
        buf.write_at(src, &data)
            .and_then(|()| buf.fill(dst, CCW_LEN, 0)),
    )?;
    let write = [CcwWord::write(CCW_LEN as u16, buf.addr_of(src))];
    let d = c.run_checked(r, &format!("{name}_write"), &write, block)?;
    c.expect_ok(r, &format!("{name}_write"), &d, CCW_LEN as u64);
    r.image(name, pos, CCW_LEN as u64, seed);
    let read = [CcwWord::read(CCW_LEN as u16, buf.addr_of(dst))];
    let d = c.run_checked(r, &format!("{name}_read"), &read, block)?;
    c.expect_ok(r, &format!("{name}_read"), &d, CCW_LEN as u64);
    let mut back = vec![0u8; CCW_LEN];
    r.ok(&c.n(&format!("{name}_back")), buf.read_at(dst, &mut back))?;
    let bad = pattern::first_mismatch(seed, pos, &back);
    r.check(
        &c.n(&format!("{name}_readback")),
        bad.is_none(),
        match bad {
            None => format!("{CCW_LEN} bytes at block {block} read back"),
            Some(i) => format!("byte {i} of {CCW_LEN} at block {block} differs"),
        },
    )
    .then_some(())
}

/// The ccw instance and a contiguous buffer for [`ccw_serves`].
fn open_ccw(r: &mut Report, p: &'static str) -> Option<(Ccw, DmaBuf)> {
    let c = Ccw::open(r, p)?;
    let buf = r.ok(&format!("{p}.alloc"), DmaBuf::contiguous(2 << 20))?;
    Some((c, buf))
}

/// A removed by the host at the cue: the guest ejects it, the ccw instance keeps serving.
pub fn run(r: &mut Report) -> Option<()> {
    let (root, port) = r.ok("unplug.find_gpus", gpus())?;
    let other_before = root.as_ref().map(|d| d.bdf.clone());
    let Some(a) = port else {
        r.check(
            "unplug.gpu_behind_port",
            false,
            "no GPU on a bus behind a root port",
        );
        return None;
    };
    let bdf = a.bdf.clone();
    let sysfs = a.dir.clone();
    r.note(format_args!("GPU A at {bdf}; hotplug slots: {}", slots()));
    let slot = hotplug_slot(&a);
    let pciehp = Path::new("/sys/module/pciehp").exists();
    r.check(
        "unplug.hotplug_slot",
        slot.is_some(),
        format_args!(
            "slot for {bdf}: {}; pciehp {}",
            slot.as_ref()
                .map(|(n, m)| format!("{n} (driver {m})"))
                .unwrap_or_else(|| "none".into()),
            if pciehp { "built in" } else { "absent" }
        ),
    );
    let (mut ccw, buf) = open_ccw(r, "unplug.ccw")?;
    ccw_serves(r, &mut ccw, "before", &buf, CCW_BLOCK_UNPLUG)?;
    let mut g = gpu_kit::open_dev(r, "unplug.gpu", WINDOW, a)?;
    let surface = use_gpu(r, "unplug.gpu", &mut g)?;

    // In use: bound to uio_pci_generic with its file open, BARs mapped, GTT pins held.
    let t0 = Instant::now();
    r.ready("remove");
    let mut gone = None;
    while t0.elapsed() < WAIT {
        if !sysfs.exists() {
            gone = Some(t0.elapsed());
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for l in kernel_lines(&["pciehp", "acpiphp", "hotplug", &bdf]) {
        r.note(format_args!("kernel: {l}"));
    }
    let Some(took) = gone else {
        r.check(
            "unplug.gpu_gone",
            false,
            format_args!("{bdf} still in /sys/bus/pci/devices after {WAIT:?}"),
        );
        return None;
    };
    r.check(
        "unplug.gpu_gone",
        true,
        format_args!(
            "{bdf} left /sys/bus/pci/devices {:.2} s after the cue",
            took.as_secs_f64()
        ),
    );
    r.measure("cue_to_gpu_gone", took.as_secs_f64(), "s");
    // The guest's mappings of the gone BARs and its uio file go now.
    drop(g);
    drop(surface);
    let (root_after, port_after) = r.ok("unplug.find_gpus_after", gpus())?;
    r.check(
        "unplug.only_a_left",
        port_after.is_none() && root_after.map(|d| d.bdf) == other_before,
        "no GPU behind a port any more; the one on the root bus (if any) is still there",
    );
    ccw_serves(r, &mut ccw, "after", &buf, CCW_BLOCK_UNPLUG + 16)?;
    Some(())
}

/// B on the root bus: QEMU cannot unplug it, the host's removal is refused, then forced;
/// the guest then reads all-ones from the trapped BAR while B stays in its PCI tree.
pub fn run_busy(r: &mut Report) -> Option<()> {
    let (root, _) = r.ok("unplug_busy.find_gpus", gpus())?;
    let Some(b) = root else {
        r.check("unplug_busy.gpu_on_root_bus", false, "no GPU on bus 0");
        return None;
    };
    let bdf = b.bdf.clone();
    let sysfs = b.dir.clone();
    let slot = hotplug_slot(&b);
    r.check(
        "unplug_busy.no_hotplug_slot",
        slot.is_none(),
        format_args!(
            "{bdf} on the root bus has no hotplug slot ({})",
            slot.map(|(n, _)| n).unwrap_or_else(|| "none".into())
        ),
    );
    let (mut ccw, buf) = open_ccw(r, "unplug_busy.ccw")?;
    ccw_serves(r, &mut ccw, "before", &buf, CCW_BLOCK_BUSY)?;
    let mut g = gpu_kit::open_dev(r, "unplug_busy.gpu", WINDOW, b)?;
    let surface = use_gpu(r, "unplug_busy.gpu", &mut g)?;
    let fb_before = r.ok("unplug_busy.fb_read_before", g.fb.read32(0))?;

    let t0 = Instant::now();
    r.ready("remove");
    // Poll the trapped ID register until it stops answering the magic; B must stay in the
    // PCI tree meanwhile.
    let (mut reads, mut first_other, mut left_tree) = (0u64, None, false);
    while t0.elapsed() < WAIT {
        let v = g.drv.read(REG_ID).unwrap_or(0);
        reads += 1;
        if !sysfs.exists() {
            left_tree = true;
        }
        if v != ID_MAGIC {
            first_other = Some((t0.elapsed(), v));
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    r.check(
        "unplug_busy.gpu_stays_in_tree",
        !left_tree && sysfs.exists(),
        format_args!("{bdf} in /sys/bus/pci/devices throughout ({reads} ID reads)"),
    );
    let Some((took, v)) = first_other else {
        r.check(
            "unplug_busy.server_gone_all_ones",
            false,
            format_args!("ID still {ID_MAGIC:#x} after {WAIT:?} ({reads} reads)"),
        );
        return None;
    };
    r.measure("cue_to_all_ones", took.as_secs_f64(), "s");
    // What the next accesses get: another BAR0 register (trapped), config space (through
    // QEMU's emulation and the server), the framebuffer BAR (mapped from the server's fd).
    // Under QEMU 10.2.2 each trapped access to a device whose server is gone stalls the
    // vCPU for vfio-user-pci's x-msg-timeout (5 s): keep them few.
    let t = Instant::now();
    let version = g.drv.read(REG_VERSION).unwrap_or(0);
    r.measure("bar_read_after_server_gone", t.elapsed().as_secs_f64(), "s");
    let all_ones = v == u32::MAX && version == u32::MAX;
    r.check(
        "unplug_busy.server_gone_all_ones",
        all_ones,
        format_args!(
            "after {:.2} s: ID {v:#x}, then VERSION {version:#x}",
            took.as_secs_f64()
        ),
    );
    let t = Instant::now();
    let vendor = g.dev.config16(0).map(|x| format!("{x:#06x}"));
    let config_s = t.elapsed().as_secs_f64();
    let fb_after = g.fb.read32(0).map(|x| format!("{x:#010x}"));
    r.note(format_args!(
        "after the forced removal: config vendor ID {vendor:?} (read took {config_s:.2} s); \
         framebuffer word 0 {fb_after:?} (before: {fb_before:#010x})"
    ));
    r.measure("config_read_after_server_gone", config_s, "s");
    drop(surface);
    drop(g);
    ccw_serves(r, &mut ccw, "after", &buf, CCW_BLOCK_BUSY + 16)?;
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_bus_of_addresses_root_and_port_buses() {
        assert_eq!(bus_of("0000:00:03.0"), Some(0));
        assert_eq!(bus_of("0000:01:00.0"), Some(1));
        assert_eq!(bus_of("0000:1f:00.0"), Some(0x1f));
        assert_eq!(bus_of("garbage"), None);
    }
}
