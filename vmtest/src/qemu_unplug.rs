//! What the QEMU under test does when a `vfio-user-pci` device is to go away: does it
//! survive freeing an unplugged device, and does it answer the device-request IRQ?
//!
//! **The fix.** QEMU 10.2.2 aborts while freeing an unplugged `vfio-user-pci` device that
//! has MSI-X (`memory_region_del_subregion: Assertion 'subregion->container == mr'` from
//! `vfio_user_msix_teardown`), and the `unplug` run unplugs one. The upstream fix
//! ("vfio-user: Do not delete the subregion", qemu-devel, October 2025) is not in 10.2.2,
//! and a version number cannot say whether a binary (a distribution's, a patched one) has
//! it. The QEMU that `scripts/qemu.sh` builds carries it and says so in its version line,
//! `QEMU emulator version 10.2.2 (umdev-unplug-fix)` ([`MARKER`]); for any other QEMU the
//! user declares it with `UMDEV_QEMU_UNPLUG_FIX=1` (or `=0` to skip the run with a QEMU that
//! has the marker). Without the fix the run is skipped, and the summary says why.
//!
//! **The request IRQ.** vfio-pci registers an eventfd for the device-request IRQ (index 4)
//! only when its `x-req` feature bit is set, and answers it with `qdev_unplug`. In QEMU
//! 10.2.2 `x-req` (default on) is a property of `vfio-pci` alone: `vfio-user-pci` does not
//! have it, its feature bit stays 0, and it never sends the SET_IRQS for index 4 (seen in
//! the server's debug log: only indexes 0 and 3). [`handles_request_irq`] asks the binary
//! (`-device vfio-user-pci,help`) instead of assuming either way.

use std::path::Path;
use std::process::Command;

/// What `scripts/qemu.sh` puts in its build's version (`--with-pkgversion`).
pub const MARKER: &str = "umdev-unplug-fix";

/// The variable (and option) that declares a QEMU fixed or not.
pub const ENV: &str = "UMDEV_QEMU_UNPLUG_FIX";

/// Ok(why it is taken as fixed) or Err(why not), from QEMU's `--version` line and what the
/// user declared.
pub fn verdict(version_line: &str, declared: Option<bool>) -> Result<String, String> {
    let line = version_line.trim();
    match declared {
        Some(true) => Ok(format!("declared fixed by {ENV}=1 ({line})")),
        Some(false) => Err(format!("declared not fixed by {ENV}=0 ({line})")),
        None if line.contains(&format!("({MARKER})")) => {
            Ok(format!("'{MARKER}' in its version line ({line})"))
        }
        None => Err(format!(
            "'{line}' has no '({MARKER})' marker: it lacks the upstream fix \"vfio-user: Do not \
             delete the subregion\" unless you say otherwise, and a stock QEMU aborts when the \
             guest ejects the device (use scripts/qemu.sh's build, or set {ENV}=1 for a QEMU \
             that has the fix)"
        )),
    }
}

/// [`verdict`] for the binary `qemu`.
pub fn fix(qemu: &Path, declared: Option<bool>) -> Result<String, String> {
    let out = Command::new(qemu)
        .arg("--version")
        .output()
        .map_err(|e| format!("{} --version: {e}", qemu.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    verdict(text.lines().next().unwrap_or(""), declared)
}

/// Does `qemu`'s `vfio-user-pci` answer the device-request IRQ (it has the `x-req`
/// property, whose default is on)?
pub fn handles_request_irq(qemu: &Path) -> Result<bool, String> {
    let out = Command::new(qemu)
        .args([
            "-nodefaults",
            "-machine",
            "none",
            "-device",
            "vfio-user-pci,help",
        ])
        .output()
        .map_err(|e| format!("{} -device vfio-user-pci,help: {e}", qemu.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !text.contains("socket=") {
        return Err(format!(
            "{} -device vfio-user-pci,help listed no 'socket' property: {}",
            qemu.display(),
            text.trim()
        ));
    }
    Ok(has_x_req_on(&text))
}

/// Whether a `-device ...,help` listing has `x-req` with its default on.
fn has_x_req_on(help: &str) -> bool {
    help.lines()
        .map(str::trim)
        .any(|l| l.starts_with("x-req=") && l.contains("(default: on)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_verdict_marker_or_declaration_decides() {
        let fixed = "QEMU emulator version 10.2.2 (umdev-unplug-fix)";
        let stock = "QEMU emulator version 10.2.2";
        let debian = "QEMU emulator version 10.2.2 (Debian 1:10.2.2+ds-1)";
        assert!(verdict(fixed, None).is_ok());
        assert!(verdict(stock, None).is_err());
        assert!(verdict(debian, None).is_err());
        // The marker must be the package version in parentheses, not any mention.
        assert!(verdict(
            "QEMU emulator version 10.2.2 (umdev-unplug-fixed-not)",
            None
        )
        .is_err());
        assert!(verdict(stock, Some(true)).is_ok());
        assert!(verdict(fixed, Some(false)).is_err());
        assert!(verdict(stock, None).unwrap_err().contains(ENV));
    }

    #[test]
    fn test_has_x_req_on_only_with_the_property_on() {
        let vfio_pci = "vfio-pci options:\n  x-req=<bool>           - Disable device request \
                        notification support (DEBUG) (default: on)\n  x-vga=<bool> (default: off)";
        let vfio_user = "vfio-user-pci options:\n  socket=<SocketAddress> - SocketAddress\n  \
                         x-send-queued=<bool>   - on/off (default: off)";
        assert!(has_x_req_on(vfio_pci));
        assert!(!has_x_req_on(vfio_user));
        assert!(!has_x_req_on("  x-req=<bool> - ... (default: off)"));
    }
}
