//! The GPU behind a virtual IOMMU, driven through the guest's VFIO type1 API.

use crate::report::Report;

/// Map, pin through the GTT, unmap while pinned, remap, churn, reboot with live mappings.
pub fn run(r: &mut Report) -> Option<()> {
    r.check("gpu_viommu.implemented", false, "scenario not written yet");
    None
}
