//! GPU scenarios (devices/src/gpu, protocol-docs/devices/gpu.md).

use crate::report::Report;

/// Mode, FILL, READBACK through the GTT, BLIT, errors, INTx, throughput (memfd RAM).
pub fn run(r: &mut Report) -> Option<()> {
    r.check("gpu.implemented", false, "scenario not written yet");
    None
}

/// Bus Master cleared: no DMA reaches memory, the error is reported; set again: works.
pub fn run_bme(r: &mut Report) -> Option<()> {
    r.check("gpu_bme.implemented", false, "scenario not written yet");
    None
}

/// Plain RAM: the ring through DMA_READ works, GTT pins are refused with the documented error.
pub fn run_plain(r: &mut Report) -> Option<()> {
    r.check("gpu_plain.implemented", false, "scenario not written yet");
    None
}
