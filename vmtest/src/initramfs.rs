//! The guest's initramfs, built from Debian's busybox-static, the kernel modules the suite
//! loads (their order in `modules/order`, written by `scripts/qemu.sh guest`), the
//! `umdev-guest` binary and an `/init` script that runs the scenarios named on the kernel
//! command line (`umdev.scenarios=a,b`) and powers off.

use std::io::{self, Cursor, Write};
use std::path::Path;

use cpio::newc::{Builder, ModeFileType};

/// `/init`: mount the pseudo file systems, load the modules, reserve huge pages for
/// physically contiguous DMA buffers, run the scenarios, power off. Every line it prints
/// that starts with `UMDEV-` is parsed by the host.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "UMDEV-BOOT $(cut -d' ' -f1 /proc/uptime)"
for m in $(cat /lib/modules/order); do
    # The module's parameters from the kernel command line (mod.param=value), as modprobe
    # would pass them: insmod does not read /proc/cmdline.
    params=$(tr ' ' '\n' < /proc/cmdline | sed -n "s/^$m\.//p")
    insmod /lib/modules/$m.ko $params || echo "umdev-init: insmod $m $params failed"
done
echo 32 > /proc/sys/vm/nr_hugepages
scenarios=$(sed -n 's/.*umdev\.scenarios=\([^ ]*\).*/\1/p' /proc/cmdline | tr , ' ')
/bin/umdev-guest $scenarios
echo "UMDEV-EXIT $?"
poweroff -f
"#;

/// What goes into the archive.
pub struct Contents<'a> {
    /// busybox-static.
    pub busybox: &'a Path,
    /// Directory with `order` and `<name>.ko` files.
    pub modules: &'a Path,
    /// The static `umdev-guest` binary.
    pub guest: &'a Path,
}

fn dir(name: &str) -> (Builder, Cursor<Vec<u8>>) {
    (
        Builder::new(name)
            .mode(0o755)
            .set_mode_file_type(ModeFileType::Directory)
            .nlink(2),
        Cursor::new(Vec::new()),
    )
}

fn file(name: &str, mode: u32, data: Vec<u8>) -> (Builder, Cursor<Vec<u8>>) {
    (
        Builder::new(name)
            .mode(mode)
            .set_mode_file_type(ModeFileType::Regular)
            .nlink(1),
        Cursor::new(data),
    )
}

fn read(path: &Path) -> io::Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

/// Write the initramfs (uncompressed newc cpio) to `out`.
pub fn build(c: &Contents<'_>, out: &Path) -> io::Result<()> {
    let mut entries = vec![
        dir("bin"),
        dir("dev"),
        // The kernel opens /dev/console for init's stdio before anything is mounted.
        (
            Builder::new("dev/console")
                .mode(0o600)
                .set_mode_file_type(ModeFileType::Char)
                .rdev_major(5)
                .rdev_minor(1)
                .nlink(1),
            Cursor::new(Vec::new()),
        ),
        dir("proc"),
        dir("sys"),
        dir("lib"),
        dir("lib/modules"),
        file("init", 0o755, INIT.as_bytes().to_vec()),
        file("bin/busybox", 0o755, read(c.busybox)?),
        file("bin/umdev-guest", 0o755, read(c.guest)?),
    ];
    let order = std::fs::read_to_string(c.modules.join("order"))
        .map_err(|e| io::Error::new(e.kind(), format!("{}/order: {e}", c.modules.display())))?;
    for name in order.lines().filter(|l| !l.is_empty()) {
        let ko = format!("{name}.ko");
        entries.push(file(
            &format!("lib/modules/{ko}"),
            0o644,
            read(&c.modules.join(&ko))?,
        ));
    }
    entries.push(file("lib/modules/order", 0o644, order.into_bytes()));
    let mut f = std::io::BufWriter::new(std::fs::File::create(out)?);
    cpio::write_cpio(entries.into_iter(), &mut f)?;
    f.flush()
}
