//! NVMe with Linux's stock driver: `nvme` binds umdev's controller (loaded by /init from
//! the initramfs), the namespace appears with the image's size, and O_DIRECT writes and
//! reads of pattern data at several offsets and sizes verify; the host then checks that
//! the image holds what the guest wrote (`UMDEV-IMAGE`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::time::{Duration, Instant};

use umdev_devices::ccw::driver::pattern;

use crate::report::Report;

/// The namespace size the host serves (`umdev run nvme --size 64M`).
pub const NS_BYTES: u64 = 64 << 20;
const DISK: &str = "/dev/nvme0n1";
/// Where the raw round trips start; the file system of `run_fs` lies below.
const RAW: u64 = NS_BYTES / 2;
/// The file system's size in KiB (the first half of the namespace).
const FS_KIB: u64 = RAW / 1024;

/// A 4096-aligned buffer for O_DIRECT.
pub(crate) struct Aligned {
    raw: Vec<u8>,
    off: usize,
    len: usize,
}

impl Aligned {
    /// `len` zero bytes at a page boundary.
    pub(crate) fn new(len: usize) -> Aligned {
        Aligned::filled(len, 0)
    }
    /// `len` bytes of `fill` at a page boundary.
    pub(crate) fn filled(len: usize, fill: u8) -> Aligned {
        let raw = vec![fill; len + 4096];
        let off = (4096 - raw.as_ptr() as usize % 4096) % 4096;
        Aligned { raw, off, len }
    }
    pub(crate) fn bytes(&mut self) -> &mut [u8] {
        &mut self.raw[self.off..self.off + self.len]
    }
    /// The address of the first byte (for an AIO request).
    pub(crate) fn addr(&mut self) -> u64 {
        self.bytes().as_mut_ptr() as u64
    }
}

fn sysfs(path: &str) -> io::Result<String> {
    Ok(std::fs::read_to_string(path)?.trim().to_string())
}

fn wait_disk(timeout: Duration) -> io::Result<()> {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if std::path::Path::new("/sys/block/nvme0n1/size").exists()
            && std::path::Path::new(DISK).exists()
        {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let why = std::fs::read_to_string("/proc/modules").unwrap_or_default();
    let loaded = if why.contains("nvme ") {
        "nvme is loaded"
    } else {
        "nvme is not loaded (no nvme.ko in the guest's modules: rebuild it with scripts/qemu.sh guest)"
    };
    Err(io::Error::other(format!(
        "no {DISK} after {timeout:?}; {loaded}"
    )))
}

fn open_direct() -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(DISK)
}

/// Write `len` bytes of pattern `seed` at byte `pos` with O_DIRECT, read them back with
/// O_DIRECT into a buffer that held something else, and compare.
fn round_trip(f: &File, pos: u64, len: usize, seed: u64) -> Result<(), String> {
    let mut out = Aligned::new(len);
    pattern::fill(seed, pos, out.bytes());
    f.write_all_at(out.bytes(), pos)
        .map_err(|e| format!("write {len} at {pos}: {e}"))?;
    let mut back = Aligned::new(len);
    back.bytes().fill(0xa5);
    f.read_exact_at(back.bytes(), pos)
        .map_err(|e| format!("read {len} at {pos}: {e}"))?;
    match pattern::first_mismatch(seed, pos, back.bytes()) {
        None => Ok(()),
        Some(at) => Err(format!("byte {at} of {len} at {pos} differs")),
    }
}

/// Run the scenario.
pub fn run(r: &mut Report) -> Option<()> {
    r.ok("nvme.bound", wait_disk(Duration::from_secs(30)))?;
    let sectors: u64 = r
        .ok("nvme.size_read", sysfs("/sys/block/nvme0n1/size"))?
        .parse()
        .ok()?;
    r.check(
        "nvme.size",
        sectors * 512 == NS_BYTES,
        format_args!("{sectors} sectors"),
    );
    let model = sysfs("/sys/class/nvme/nvme0/model").unwrap_or_default();
    r.check(
        "nvme.model",
        model.starts_with("umdev"),
        format_args!("model {model:?}"),
    );
    let queues = std::fs::read_dir("/sys/block/nvme0n1/mq")
        .map(|d| d.count())
        .unwrap_or(0);
    r.check(
        "nvme.io_queues",
        queues >= 1,
        format_args!("{queues} blk-mq hardware queues"),
    );
    let f = r.ok("nvme.open_direct", open_direct())?;
    // Sizes from one block to past MDTS (the block layer splits), offsets across the second
    // half of the namespace (the first holds nvme-fs's file system), up to its last bytes.
    let cases: [(u64, usize); 6] = [
        (RAW, 4096),
        (RAW + (64 << 10) + 512 * 7, 512),
        (RAW + (1 << 20), 128 << 10),
        (RAW + (5 << 20), 1 << 20),
        (RAW + (17 << 20), 12 << 10),
        (NS_BYTES - (256 << 10), 256 << 10),
    ];
    let start = Instant::now();
    let mut bytes = 0;
    for (i, &(pos, len)) in cases.iter().enumerate() {
        let seed = 0x4e56_0000 + i as u64;
        let res = round_trip(&f, pos, len, seed);
        let ok = r.check(
            &format!("nvme.direct_{i}"),
            res.is_ok(),
            res.err().unwrap_or_else(|| format!("{len} bytes at {pos}")),
        );
        if ok {
            r.image(&format!("direct_{i}"), pos, len as u64, seed);
            bytes += 2 * len;
        }
    }
    r.measure(
        "direct_round_trip",
        bytes as f64 / start.elapsed().as_secs_f64() / 1e6,
        "MB/s",
    );
    r.ok("nvme.fsync", f.sync_all())?;
    Some(())
}

fn sh(r: &mut Report, name: &str, prog: &str, args: &[&str]) -> Option<()> {
    let out = std::process::Command::new(prog).args(args).output();
    let out = r.ok(name, out)?;
    let ok = out.status.success();
    let detail = format!(
        "{prog} {}: {} {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    r.check(name, ok, detail).then_some(())
}

/// Pattern bytes of file `i` (its length and content are fixed by `i`).
fn file_bytes(i: u64) -> Vec<u8> {
    let mut v = vec![0u8; (1usize << (10 + 2 * i)) + 77 * i as usize];
    pattern::fill(0x4653_0000 + i, 0, &mut v);
    v
}

/// The file system scenario: mke2fs on the first half of the namespace, mounted with ext4,
/// files of 1 KiB to 1 MiB written and synced, unmounted, mounted again and read back.
pub fn run_fs(r: &mut Report) -> Option<()> {
    r.ok("nvme-fs.bound", wait_disk(Duration::from_secs(30)))?;
    let kib = FS_KIB.to_string();
    sh(r, "nvme-fs.mke2fs", "/bin/mke2fs", &["-q", DISK, &kib])?;
    r.ok("nvme-fs.mkdir", std::fs::create_dir_all("/mnt"))?;
    sh(
        r,
        "nvme-fs.mount",
        "/bin/mount",
        &["-t", "ext4", DISK, "/mnt"],
    )?;
    r.ok("nvme-fs.subdir", std::fs::create_dir_all("/mnt/d"))?;
    for i in 0..6u64 {
        let res = std::fs::write(format!("/mnt/d/f{i}"), file_bytes(i));
        r.ok(&format!("nvme-fs.write_{i}"), res)?;
    }
    sh(r, "nvme-fs.sync", "/bin/sync", &[])?;
    sh(r, "nvme-fs.umount", "/bin/umount", &["/mnt"])?;
    sh(
        r,
        "nvme-fs.remount",
        "/bin/mount",
        &["-t", "ext4", DISK, "/mnt"],
    )?;
    for i in 0..6u64 {
        let got = std::fs::read(format!("/mnt/d/f{i}"));
        let got = r.ok(&format!("nvme-fs.read_{i}"), got)?;
        let want = file_bytes(i);
        r.check(
            &format!("nvme-fs.verify_{i}"),
            got == want,
            format_args!("{} bytes, want {}", got.len(), want.len()),
        );
    }
    sh(r, "nvme-fs.umount_again", "/bin/umount", &["/mnt"])?;
    Some(())
}

/// Where `run_reboot` keeps its phase marker (a sector of the namespace itself).
const MARK_OFF: u64 = 40 << 20;
const MARK: &[u8; 8] = b"NVMEBOOT";

fn read_mark(f: &File) -> io::Result<bool> {
    let mut b = Aligned::new(4096);
    f.read_exact_at(b.bytes(), MARK_OFF)?;
    Ok(&b.bytes()[..8] == MARK)
}

fn write_mark(f: &File, set: bool) -> io::Result<()> {
    let mut b = Aligned::new(4096);
    if set {
        b.bytes()[..8].copy_from_slice(MARK);
    }
    f.write_all_at(b.bytes(), MARK_OFF)?;
    f.sync_all()
}

/// A guest reboot with I/O in flight. Phase 1 (no marker on the disk): writes the marker,
/// starts a thread writing 128 KiB O_DIRECT blocks in a loop, and reboots while they are in
/// flight (the kernel's shutdown path disables the controller, QEMU resets the device,
/// SeaBIOS and Linux probe it again). Phase 2 (the marker found): the driver bound again,
/// the marker is cleared, and a fresh O_DIRECT round trip verifies.
pub fn run_reboot(r: &mut Report) -> Option<()> {
    r.ok("nvme-reboot.bound", wait_disk(Duration::from_secs(30)))?;
    let f = r.ok("nvme-reboot.open_direct", open_direct())?;
    if r.ok("nvme-reboot.read_mark", read_mark(&f))? {
        r.note("phase 2: the controller came back after the reboot");
        r.ok("nvme-reboot.clear_mark", write_mark(&f, false))?;
        let res = round_trip(&f, 48 << 20, 256 << 10, 0x5242_0002);
        let ok = r.check(
            "nvme-reboot.after",
            res.is_ok(),
            res.err().unwrap_or_default(),
        );
        if ok {
            r.image("after_reboot", 48 << 20, 256 << 10, 0x5242_0002);
        }
        r.ok("nvme-reboot.fsync", f.sync_all())?;
        return Some(());
    }
    r.ok("nvme-reboot.set_mark", write_mark(&f, true))?;
    let writer = r.ok("nvme-reboot.open_writer", open_direct())?;
    std::thread::spawn(move || {
        let mut buf = Aligned::new(128 << 10);
        let mut i = 0u64;
        loop {
            pattern::fill(i, 0, buf.bytes());
            let _ = writer.write_all_at(buf.bytes(), (8 << 20) + (i % 128) * (128 << 10));
            i += 1;
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    r.note("phase 1: rebooting with writes in flight");
    // SAFETY: reboot(2) with RB_AUTOBOOT; it does not return on success.
    unsafe { libc::reboot(libc::RB_AUTOBOOT) };
    r.check("nvme-reboot.reboot", false, io::Error::last_os_error());
    None
}

/// Where `run_bme` does its I/O: in the raw half, clear of every range `run` writes.
const BME_OFF: u64 = RAW + (24 << 20);
const BME_LEN: usize = 64 << 10;
const SEED_BME_OLD: u64 = 0x4e42_0001;
const SEED_BME_AFTER: u64 = 0x4e42_0002;

/// Bus Master cleared under the stock driver. Data written first; then the guest clears
/// Bus Master in the command register (behind the driver's back, as a buggy or hostile
/// guest may) and reads that data into a buffer of 0xa5 bytes: the controller must not
/// touch guest memory — the buffer stays as it was and nothing completes — so the
/// driver's I/O timeout (`nvme_core.io_timeout` on this run's command line) finds the
/// controller fatal (CSTS.CFS) and resets it, which sets Bus Master again. The read then
/// ends (retried with the right data, or an error: both are the driver's choice), and a
/// fresh O_DIRECT round trip verifies.
pub fn run_bme(r: &mut Report) -> Option<()> {
    use crate::mem::DmaBuf;
    use crate::pci::{command, PciDev};
    use umdev_devices::nvme::identify::{DEVICE_ID, VENDOR_ID};

    r.ok("nvme-bme.bound", wait_disk(Duration::from_secs(30)))?;
    let dev = r.ok("nvme-bme.pci", PciDev::find(VENDOR_ID, DEVICE_ID))?;
    let f = r.ok("nvme-bme.open_direct", open_direct())?;
    let res = round_trip(&f, BME_OFF, BME_LEN, SEED_BME_OLD);
    r.check(
        "nvme-bme.before",
        res.is_ok(),
        res.err().unwrap_or_default(),
    )
    .then_some(())?;
    let buf = r.ok("nvme-bme.buffer", DmaBuf::new(BME_LEN / 4096))?;
    r.ok("nvme-bme.buffer_fill", buf.fill(0, BME_LEN, 0xa5))?;
    r.ok(
        "nvme-bme.clear_bus_master",
        dev.update_command(0, command::BUS_MASTER),
    )?;
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = r.ok("nvme-bme.open_reader", open_direct())?;
    let addr = buf.vaddr();
    std::thread::spawn(move || {
        use std::os::fd::AsRawFd;
        // SAFETY: `addr` is `buf`'s mapping of BME_LEN bytes, which the scenario keeps
        // alive until this thread has sent its result (it waits on `rx` before dropping
        // `buf`, or leaks it if the read never ends).
        let n = unsafe {
            libc::pread(
                reader.as_raw_fd(),
                addr as *mut libc::c_void,
                BME_LEN,
                BME_OFF as libc::off_t,
            )
        };
        let res = if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        };
        let _ = tx.send(res);
    });
    std::thread::sleep(Duration::from_secs(2));
    let early = rx.try_recv().ok();
    r.check(
        "nvme-bme.no_completion",
        early.is_none(),
        format_args!("the read completed while Bus Master was clear: {early:?}"),
    );
    let mut seen = vec![0u8; BME_LEN];
    r.ok("nvme-bme.buffer_read", buf.read_at(0, &mut seen))?;
    let touched = seen.iter().position(|&b| b != 0xa5);
    r.check(
        "nvme-bme.memory_untouched",
        touched.is_none(),
        format_args!("buffer byte {touched:?} changed while Bus Master was clear"),
    );
    // The driver's timeout and reset: up to io_timeout plus the reset.
    let Ok(done) = rx.recv_timeout(Duration::from_secs(90)) else {
        r.check(
            "nvme-bme.read_ended",
            false,
            "the read did not end within 90 s (the driver did not recover)",
        );
        std::mem::forget(buf);
        return None;
    };
    r.check("nvme-bme.read_ended", true, format_args!("{done:?}"));
    if let Ok(n) = done {
        let good = n == BME_LEN && {
            r.ok("nvme-bme.buffer_reread", buf.read_at(0, &mut seen))?;
            umdev_devices::ccw::driver::pattern::first_mismatch(SEED_BME_OLD, BME_OFF, &seen)
                .is_none()
        };
        r.check(
            "nvme-bme.read_data",
            good,
            format_args!("a read that succeeded after the reset returned {n} bytes"),
        );
    }
    let cmd = r.ok("nvme-bme.command_after", dev.command())?;
    r.check(
        "nvme-bme.bus_master_again",
        cmd & command::BUS_MASTER != 0,
        format_args!("command register {cmd:#06x} after the driver's reset"),
    );
    let res = round_trip(&f, BME_OFF, BME_LEN, SEED_BME_AFTER);
    let ok = r.check("nvme-bme.after", res.is_ok(), res.err().unwrap_or_default());
    if ok {
        r.image("bme_after", BME_OFF, BME_LEN as u64, SEED_BME_AFTER);
    }
    Some(())
}
