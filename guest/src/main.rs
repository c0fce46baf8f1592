//! `umdev-guest`: runs inside the Linux guest of umdev's real-VMM suite (see `vmtest/`) and
//! drives the example devices the way a guest driver does: BARs through sysfs `resourceN`
//! mmaps, DMA addresses from `/proc/self/pagemap` of locked pages, INTx through
//! `uio_pci_generic`, and, behind a virtual IOMMU, the guest's own VFIO type1 API.
//!
//! Usage: `umdev-guest SCENARIO...`. Results go to stdout (the serial console) in the line
//! format of [`report`]; the exit status is 0 only if every check passed.

mod ccw;
mod drm;
mod gpu;
mod gpu_dma;
mod gpu_kit;
mod hello;
mod mem;
mod mmio;
mod nvme;
mod nvme_bench;
mod pci;
mod report;
mod uio;
mod unplug;
mod vfio;
mod viommu;
mod virtio_gpu;

use report::Report;

/// Every scenario.
/// A scenario: name, what it covers, entry point (None: stopped at a failed prerequisite).
type Scenario = (&'static str, &'static str, fn(&mut Report) -> Option<()>);

const SCENARIOS: &[Scenario] = &[
    (
        "hello",
        "the hello example's counter reaches 42, one INTx per doorbell",
        hello::run,
    ),
    (
        "mmio-latency",
        "timed reads/writes of a umdev register (hello) and of QEMU's built-in edu device",
        mmio::run,
    ),
    (
        "gpu",
        "GPU: mode, FILL, READBACK/BLIT through the GTT, errors, INTx, throughput",
        gpu::run,
    ),
    (
        "gpu-bme",
        "GPU with Bus Master cleared: no DMA, error reported",
        gpu::run_bme,
    ),
    (
        "gpu-plain",
        "GPU on plain RAM: ring via DMA_READ, GTT pins refused",
        gpu::run_plain,
    ),
    (
        "ccw",
        "ccw: direct and IDAW programs, image contents, bad programs, INTx",
        ccw::run,
    ),
    (
        "ccw-intx",
        "ccw: a completion while INTx is disabled arrives on enable",
        ccw::run_intx,
    ),
    (
        "ccw-bme",
        "ccw with Bus Master cleared: no data moves",
        ccw::run_bme,
    ),
    (
        "ccw-plain",
        "ccw on plain RAM: data pages cannot be pinned",
        ccw::run_plain,
    ),
    (
        "nvme",
        "NVMe with the stock nvme driver: namespace size, O_DIRECT round trips, image",
        nvme::run,
    ),
    (
        "nvme-fs",
        "NVMe: mke2fs, mount (ext4), files written, unmount, remount, files verified",
        nvme::run_fs,
    ),
    (
        "nvme-reboot",
        "NVMe: a guest reboot with O_DIRECT writes in flight; the driver binds again after it",
        nvme::run_reboot,
    ),
    (
        "nvme-bme",
        "NVMe: Bus Master cleared under the stock driver: no DMA, fatal status, the driver's reset recovers",
        nvme::run_bme,
    ),
    (
        "nvme-bench",
        "NVMe: umdev's controller and QEMU's -device nvme side by side (AIO, QD1/QD32, 128 KiB)",
        nvme_bench::run,
    ),
    (
        "unplug",
        "umdev remove of a GPU behind a root port: the guest ejects it, ccw keeps serving",
        unplug::run,
    ),
    (
        "unplug-busy",
        "umdev remove of a GPU on pcie.0: refused, forced; the guest then reads all-ones",
        unplug::run_busy,
    ),
    (
        "virtio-gpu",
        "umdev's virtio-gpu under the stock virtio_gpu driver: bound, fb0, a pattern written",
        virtio_gpu::run,
    ),
    (
        "virtio-gpu-kms",
        "virtio-gpu under the stock driver's KMS: dumb buffers, a mode set, a page flip",
        virtio_gpu::run_kms,
    ),
    (
        "virtio-gpu-resize",
        "virtio-gpu resized by the host twice: config interrupt, the driver lists the new mode",
        virtio_gpu::run_resize,
    ),
    (
        "virtio-gpu-bme",
        "virtio-gpu with Bus Master cleared: nothing drawn, DEVICE_NEEDS_RESET",
        virtio_gpu::run_bme,
    ),
    (
        "virtio-gpu-bench",
        "1080p frames/s via KMS: umdev's virtio-gpu against QEMU's virtio-gpu-pci",
        virtio_gpu::run_bench,
    ),
    (
        "gpu-viommu",
        "GPU behind intel-iommu via the guest's VFIO: map, pin, unmap, churn, reboot",
        viommu::run,
    ),
];

fn usage() -> String {
    let mut s = String::from("usage: umdev-guest SCENARIO...\nscenarios:\n");
    for (name, what, _) in SCENARIOS {
        s.push_str(&format!("  {name:<16} {what}\n"));
    }
    s
}

fn main() {
    let names: Vec<String> = std::env::args().skip(1).collect();
    if names.is_empty() || names.iter().any(|n| n == "-h" || n == "--help") {
        print!("{}", usage());
        std::process::exit(if names.is_empty() { 2 } else { 0 });
    }
    let mut all_ok = true;
    for name in &names {
        let Some((_, _, run)) = SCENARIOS.iter().find(|(n, _, _)| n == name) else {
            eprintln!("umdev-guest: unknown scenario '{name}'\n{}", usage());
            std::process::exit(2);
        };
        let mut r = Report::new(name);
        // A scenario stops at its first failed prerequisite (None); the checks it made so
        // far stand, and END reports them.
        let _ = run(&mut r);
        all_ok &= r.end();
    }
    std::process::exit(if all_ok { 0 } else { 1 });
}
