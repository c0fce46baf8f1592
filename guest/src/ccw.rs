//! ccw scenarios (devices/src/ccw, protocol-docs/devices/ccw.md).

use crate::report::Report;

/// Direct and IDAW-scattered writes and reads, data in the image, bad programs, INTx.
pub fn run(r: &mut Report) -> Option<()> {
    r.check("ccw.implemented", false, "scenario not written yet");
    None
}

/// A completion while Interrupt Disable is set is delivered when it is cleared.
pub fn run_intx(r: &mut Report) -> Option<()> {
    r.check("ccw_intx.implemented", false, "scenario not written yet");
    None
}

/// Bus Master cleared: no data moves, the program fails with its documented status.
pub fn run_bme(r: &mut Report) -> Option<()> {
    r.check("ccw_bme.implemented", false, "scenario not written yet");
    None
}

/// Plain RAM: programs whose data pages cannot be pinned fail with DataAddressInvalid.
pub fn run_plain(r: &mut Report) -> Option<()> {
    r.check("ccw_plain.implemented", false, "scenario not written yet");
    None
}
