//! `umdev-vmtest`: umdev's real-VMM suite. Boots a Debian guest kernel in QEMU (≥ 10.1, with
//! `vfio-user-pci`) with umdev's example devices attached as separate server processes,
//! runs `umdev-guest` inside the guest to drive them like a guest driver would, and checks
//! both sides: the guest's own checks (console lines) and the servers' (alive after the
//! guest, disconnect logged with no pins left, clean SIGTERM, no panic).
//!
//! Run it through `scripts/vm-tests.sh`, which finds or builds QEMU and the guest kernel
//! and builds the binaries; `--help` lists the options.
//!
//! The `unplug` run serves its devices from one `umdev daemon` instead and removes
//! instances while the guest uses them (`unplug.rs`, QMP through `qmp.rs`); it needs a QEMU
//! with the vfio-user unplug fix and is skipped, with the reason, without one
//! (`qemu_unplug.rs`).

mod cpu_cues;
mod daemon;
mod display;
mod image;
mod initramfs;
mod qemu;
mod qemu_unplug;
mod qmp;
mod report;
mod server;
mod unplug;

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};

use qemu::{Accel, Attach, Ram, Run, Vm};
use report::{Check, GuestLog, Measure};
use server::{Bins, Kind, Server};

/// Who serves a guest run's devices.
#[derive(Clone, Copy, Debug)]
enum Servers {
    /// One process per device (`umdev run gpu|ccw`, `hello --serve`), each on the root bus.
    Processes(&'static [Kind]),
    /// One `umdev daemon` with the instances of [`unplug`], removed at the guest's cues.
    UnplugDaemon,
}

/// One guest run: which servers, which RAM mode, which guest scenarios.
struct Plan {
    name: &'static str,
    what: &'static str,
    ram: Ram,
    viommu: bool,
    allow_reboot: bool,
    servers: Servers,
    scenarios: &'static [&'static str],
    /// Host-side checks of this run beyond every server's own (None: none).
    host_checks: Option<HostChecks>,
    /// Needs a QEMU with the vfio-user unplug fix (`qemu_unplug.rs`); skipped without.
    needs_unplug_fix: bool,
    /// QEMU's own devices added to the guest (`-device` values), e.g. `edu` as the
    /// in-process anchor of the `mmio-latency` scenario.
    builtin: &'static [&'static str],
    /// Adds QEMU's own NVMe controller (`-device nvme`) on a 64 MiB image beside umdev's,
    /// and keeps the run's directory (both images) on the host's tmpfs: the anchor of
    /// `nvme-bench`.
    qemu_nvme: bool,
    /// Extra guest kernel command line (module parameters as `mod.param=value`).
    append: &'static str,
}

/// What a plan has unless it says otherwise (`..BASE`).
const BASE: Plan = Plan {
    name: "",
    what: "",
    ram: Ram::Memfd,
    viommu: false,
    allow_reboot: false,
    servers: Servers::Processes(&[]),
    scenarios: &[],
    host_checks: None,
    needs_unplug_fix: false,
    builtin: &[],
    qemu_nvme: false,
    append: "",
};

/// Host-side checks of a run, from the guest's console and the stopped servers.
type HostChecks = fn(&GuestLog, &[server::Outcome]) -> Vec<Check>;

/// Every guest run of the suite, in order.
const PLANS: &[Plan] = &[
    Plan {
        name: "memfd",
        what: "guest RAM as a shared memfd: devices pin guest pages",
        servers: Servers::Processes(&[Kind::Hello, Kind::Gpu, Kind::Ccw]),
        scenarios: &[
            "hello",
            "mmio-latency",
            "gpu",
            "gpu-bme",
            "ccw",
            "ccw-intx",
            "ccw-bme",
        ],
        builtin: &["edu"],
        ..BASE
    },
    Plan {
        name: "plain",
        what: "plain guest RAM: DMA through DMA_READ/DMA_WRITE, pins refused",
        ram: Ram::Plain,
        servers: Servers::Processes(&[Kind::Hello, Kind::Gpu, Kind::Ccw]),
        scenarios: &["hello", "gpu-plain", "ccw-plain"],
        ..BASE
    },
    Plan {
        name: "nvme",
        what: "NVMe with the guest's stock nvme driver, memfd RAM (pinned rings and PRP pages); \
               Bus Master cleared under it",
        servers: Servers::Processes(&[Kind::Nvme]),
        scenarios: &["nvme", "nvme-fs", "nvme-bme"],
        host_checks: Some(nvme_bme_checks),
        // nvme-bme waits for the driver's I/O timeout (30 s by default).
        append: "nvme_core.io_timeout=6",
        ..BASE
    },
    Plan {
        name: "nvme-plain",
        what: "NVMe with the stock driver on plain RAM: rings and data through DMA_READ/WRITE",
        ram: Ram::Plain,
        servers: Servers::Processes(&[Kind::Nvme]),
        scenarios: &["nvme", "nvme-fs"],
        ..BASE
    },
    Plan {
        name: "nvme-viommu",
        what: "NVMe with the stock driver behind intel-iommu: every I/O's pages mapped and \
               unmapped by the guest's IOMMU driver",
        viommu: true,
        servers: Servers::Processes(&[Kind::Nvme]),
        scenarios: &["nvme", "nvme-fs"],
        ..BASE
    },
    Plan {
        name: "nvme-reboot",
        what: "NVMe: the guest reboots with writes in flight, the stock driver binds again",
        allow_reboot: true,
        servers: Servers::Processes(&[Kind::Nvme]),
        scenarios: &["nvme-reboot"],
        host_checks: Some(booted_twice),
        ..BASE
    },
    Plan {
        name: "nvme-bench",
        what: "umdev's NVMe (shadow doorbells, and every doorbell trapped) beside QEMU's own \
               -device nvme in one guest (images on tmpfs): IOPS, MB/s, host CPU per I/O",
        servers: Servers::Processes(&[Kind::Nvme, Kind::NvmeTrapped]),
        scenarios: &["nvme-bench"],
        builtin: &["nvme,serial=qemu-nvme,drive=qnvme"],
        qemu_nvme: true,
        ..BASE
    },
    Plan {
        name: "viommu",
        what: "the GPU behind intel-iommu (caching mode), driven through the guest's VFIO",
        viommu: true,
        allow_reboot: true,
        servers: Servers::Processes(&[Kind::Gpu]),
        scenarios: &["gpu-viommu"],
        host_checks: Some(viommu_checks),
        ..BASE
    },
    Plan {
        name: "virtio-gpu",
        what: "umdev's virtio-gpu under the guest's stock virtio_gpu driver: two host \
               resizes, a KMS page flip and fbcon text in host screenshots taken at the guest's \
               cues, fb0 pixel for pixel, Bus Master cleared",
        servers: Servers::Processes(&[Kind::VirtioGpu]),
        scenarios: &[
            "virtio-gpu-resize",
            "virtio-gpu-kms",
            "virtio-gpu",
            "virtio-gpu-bme",
        ],
        host_checks: Some(virtio_gpu_checks),
        ..BASE
    },
    Plan {
        name: "virtio-gpu-viommu",
        what: "umdev's virtio-gpu behind intel-iommu: the driver's DMA API maps every \
               buffer it hands the device",
        viommu: true,
        servers: Servers::Processes(&[Kind::VirtioGpu]),
        scenarios: &["virtio-gpu-kms", "virtio-gpu"],
        host_checks: Some(virtio_gpu_checks),
        ..BASE
    },
    Plan {
        name: "virtio-gpu-bench",
        what: "1080p frames/s through KMS: umdev's virtio-gpu beside QEMU's own \
               virtio-gpu-pci in one guest, host CPU per frame",
        servers: Servers::Processes(&[Kind::VirtioGpuHd]),
        scenarios: &["virtio-gpu-bench"],
        builtin: &["virtio-gpu-pci,xres=1920,yres=1080"],
        ..BASE
    },
    Plan {
        name: "unplug",
        what: "umdev daemon instances removed while the guest uses them (hot-unplug, busy, \
               force)",
        servers: Servers::UnplugDaemon,
        scenarios: &["unplug", "unplug-busy"],
        needs_unplug_fix: true,
        ..BASE
    },
];

/// The Bus Master run (`nvme-bme`): the controller must have gone fatal when the guest
/// cleared Bus Master under it (its log says so), the proof that it stopped its DMA
/// rather than the guest merely not seeing it.
fn nvme_bme_checks(log: &GuestLog, servers: &[server::Outcome]) -> Vec<Check> {
    if !log.ended.iter().any(|e| e == "nvme-bme") {
        return vec![];
    }
    servers
        .iter()
        .filter(|s| s.kind == Kind::Nvme)
        .map(|s| {
            let fatal = s
                .log
                .lines()
                .find(|l| l.contains("controller fatal status"));
            Check::new(
                "nvme-bme.server_fatal_status",
                fatal.is_some(),
                fatal.unwrap_or("no 'controller fatal status' line in the server's log"),
            )
        })
        .collect()
}

/// The vIOMMU run reboots the guest with live VFIO mappings (`guest/src/viommu.rs`): the
/// guest must have booted exactly twice (phase 1, then phase 2 after the reboot), and the
/// GPU server must never have refused a DMA_MAP as overlapping. A server that keeps the
/// first boot's mappings through the reboot (unmap ranges it does not accept) refuses the
/// second boot's maps at the same IOVAs with EEXIST, which QEMU only logs: the guest sees
/// success while the device writes the old boot's pages.
fn viommu_checks(log: &GuestLog, servers: &[server::Outcome]) -> Vec<Check> {
    let mut v = vec![Check::new(
        "viommu.guest_booted_twice",
        log.boots == 2,
        format!(
            "{} UMDEV-BOOT lines (want 2: before and after the reboot)",
            log.boots
        ),
    )];
    for s in servers.iter().filter(|s| s.kind == Kind::Gpu) {
        let refused: Vec<&str> = s
            .log
            .lines()
            .filter(|l| l.contains("overlaps an existing mapping"))
            .collect();
        v.push(Check::new(
            "gpu.server_no_overlap_refusal",
            refused.is_empty(),
            match refused.first() {
                None => "no DMA_MAP refused as overlapping".to_string(),
                Some(first) => format!(
                    "{} DMA_MAPs refused as overlapping, first: {}",
                    refused.len(),
                    first.trim()
                ),
            },
        ));
    }
    v
}

/// A run whose guest reboots once on purpose must have booted exactly twice.
fn booted_twice(log: &GuestLog, _servers: &[server::Outcome]) -> Vec<Check> {
    vec![Check::new(
        "guest_booted_twice",
        log.boots == 2,
        format!(
            "{} UMDEV-BOOT lines (want 2: before and after the reboot)",
            log.boots
        ),
    )]
}

/// The virtio-gpu run: the screenshot the server wrote at SIGTERM (its path is in its log)
/// is the guest's pattern, every pixel of the 1280×800 scanout.
fn virtio_gpu_checks(_log: &GuestLog, servers: &[server::Outcome]) -> Vec<Check> {
    let Some(s) = servers.iter().find(|s| s.kind == Kind::VirtioGpu) else {
        return vec![];
    };
    let path = s.log.lines().find_map(|l| {
        l.split_once(" written to ")
            .map(|(_, p)| p.trim().to_string())
    });
    let result = path
        .ok_or_else(|| "no 'written to' line in the server log".to_string())
        .and_then(|p| display::Rgb::load(Path::new(&p)))
        .and_then(|shot| shot.matches(1280, 800, umdev_devices::virtio_gpu::test_pattern));
    let (ok, detail) = match result {
        Ok(detail) => (true, detail),
        Err(e) => (false, e),
    };
    vec![Check::new(
        "virtio-gpu.screenshot_is_the_guest_pattern",
        ok,
        detail,
    )]
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AccelArg {
    /// KVM if it boots a kernel here, else TCG (the verdict is cached).
    Auto,
    /// Software emulation (works everywhere; a boot takes ~15 s).
    Tcg,
    /// Hardware virtualisation.
    Kvm,
}

/// umdev's real-VMM suite: QEMU + a Linux guest driving umdev's example devices.
#[derive(Parser, Debug)]
#[command(
    name = "umdev-vmtest",
    after_help = "Usually run as scripts/vm-tests.sh, which supplies every path below.\n\
Guest runs:\n  memfd    guest RAM as a shared memfd (devices pin guest pages)\n  \
plain    plain guest RAM (DMA_READ/DMA_WRITE; pins refused with a hint)\n  \
nvme     the NVMe controller with the guest's stock nvme driver (memfd RAM)\n  \
nvme-plain  the same on plain RAM (DMA_READ/DMA_WRITE)\n  \
nvme-viommu the same behind intel-iommu\n  \
nvme-reboot a guest reboot with NVMe writes in flight\n  \
nvme-bench  umdev's NVMe beside QEMU's own -device nvme: IOPS, MB/s, host CPU per I/O\n  \
virtio-gpu-viommu  umdev's virtio-gpu behind intel-iommu\n  \
virtio-gpu-bench   1080p frames/s, umdev's virtio-gpu beside QEMU's virtio-gpu-pci\n  \
viommu   the GPU behind intel-iommu, through the guest's VFIO, with a guest reboot\n  \
virtio-gpu  umdev's virtio-gpu under the stock virtio_gpu driver: host resizes, KMS flip,\n           \
fbcon text and the /dev/fb0 pattern checked in host screenshots\n  \
unplug   umdev daemon instances removed while the guest uses them (needs a QEMU with the\n           \
vfio-user unplug fix: scripts/qemu.sh builds one; skipped otherwise)\n\
Exit status: 0 if every check passed (skipped runs included, unless --no-skip), 1 if one\n\
failed, 2 on a setup error."
)]
struct Args {
    /// qemu-system-x86_64 (>= 10.1 with vfio-user-pci).
    #[arg(long, env = "QEMU_BIN", value_name = "PATH")]
    qemu: PathBuf,
    /// Directory with the guest's vmlinuz, busybox and modules/ (scripts/qemu.sh guest).
    #[arg(long, env = "UMDEV_GUEST_DIR", value_name = "DIR")]
    guest_dir: PathBuf,
    /// The static umdev-guest binary.
    #[arg(long, value_name = "PATH")]
    guest_bin: PathBuf,
    /// The umdev binary.
    #[arg(long, value_name = "PATH")]
    umdev: PathBuf,
    /// The hello example binary.
    #[arg(long, value_name = "PATH")]
    hello: PathBuf,
    /// Run only these guest runs (by name; repeatable).
    #[arg(long, value_name = "NAME")]
    only: Vec<String>,
    /// Run only these guest scenarios (repeatable; guest runs without any are skipped).
    #[arg(long, value_name = "NAME")]
    scenario: Vec<String>,
    /// Accelerator.
    #[arg(long, value_enum, default_value_t = AccelArg::Auto)]
    accel: AccelArg,
    /// Keep logs, sockets and the initramfs here (default: a temporary directory, kept and
    /// printed when something fails).
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
    /// Per guest run timeout, seconds.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// Echo the guest console as it comes.
    #[arg(short, long)]
    verbose: bool,
    /// A guest run that would be skipped (a QEMU without the unplug fix) fails instead
    /// (CI: the suite fails, never skips).
    #[arg(long, env = "UMDEV_VMTEST_NO_SKIP")]
    no_skip: bool,
    /// RUST_LOG of the servers (e.g. `debug` shows every DMA_MAP/DMA_UNMAP).
    #[arg(
        long,
        env = "UMDEV_VMTEST_RUST_LOG",
        default_value = "info",
        value_name = "FILTER"
    )]
    server_log: String,
    /// Cache for the KVM verdict (default ~/.cache/umdev).
    #[arg(long, env = "UMDEV_CACHE_DIR", value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Whether QEMU has the vfio-user unplug fix the `unplug` run needs [default: it has if
    /// its version line carries the "(umdev-unplug-fix)" marker of scripts/qemu.sh's build].
    #[arg(
        long,
        env = qemu_unplug::ENV,
        value_name = "1|0",
        value_parser = clap::builder::BoolishValueParser::new()
    )]
    qemu_unplug_fix: Option<bool>,
}

fn cache_dir(args: &Args) -> PathBuf {
    args.cache_dir.clone().unwrap_or_else(|| {
        std::env::var_os("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from("/tmp"))
            .join("umdev")
    })
}

/// Does a KVM guest get as far as the kernel's first line? On these machines /dev/kvm
/// exists but a nested guest never leaves the decompressor, so try once and remember.
fn kvm_works(args: &Args, work: &Path) -> bool {
    if std::fs::File::options()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return false;
    }
    let kernel = args.guest_dir.join("vmlinuz");
    let key = format!("{} {}", args.qemu.display(), kernel.display());
    let verdict_file = cache_dir(args).join("kvm-verdict");
    if let Ok(s) = std::fs::read_to_string(&verdict_file) {
        if let Some((k, v)) = s.rsplit_once('\t') {
            if k == key {
                return v.trim() == "kvm";
            }
        }
    }
    eprintln!("vmtest: probing KVM (a guest kernel must print its first line within 20 s)");
    let vm = Vm {
        qemu: &args.qemu,
        accel: Accel::Kvm,
        kernel: &kernel,
        initrd: None,
        mem_mib: 256,
        ram: Ram::Plain,
        viommu: false,
        allow_reboot: false,
        devices: vec![],
        builtin: vec![],
        extra_args: vec![],
        append: "earlyprintk=ttyS0".into(),
        timeout: Duration::from_secs(20),
        echo: false,
        stderr_log: work.join("kvm-probe.stderr"),
        stop_at: Some("Linux version"),
        watch: None,
        qmp: None,
    };
    let ok = vm
        .run()
        .is_ok_and(|r| r.console.iter().any(|(_, l)| l.contains("Linux version")));
    let _ = std::fs::create_dir_all(cache_dir(args));
    let _ = std::fs::write(
        &verdict_file,
        format!("{key}\t{}\n", if ok { "kvm" } else { "tcg" }),
    );
    ok
}

/// What one guest run found.
struct Outcome {
    checks: Vec<Check>,
    measures: Vec<Measure>,
    notes: Vec<String>,
}

/// The plan's scenarios that `--scenario` selects (all without it).
fn selected<'a>(plan: &'a Plan, args: &Args) -> Vec<&'a str> {
    plan.scenarios
        .iter()
        .copied()
        .filter(|s| args.scenario.is_empty() || args.scenario.iter().any(|n| n == s))
        .collect()
}

fn run_plan(plan: &Plan, args: &Args, accel: Accel, initrd: &Path, dir: &Path) -> Outcome {
    // The side-by-side NVMe run keeps both images on tmpfs (the issue's "same image on
    // tmpfs"): its directory moves to /dev/shm, and goes once the run passed.
    let shm = Path::new("/dev/shm");
    if plan.qemu_nvme && shm.is_dir() {
        let moved = shm.join(format!("umdev-vmtest-{}-{}", std::process::id(), plan.name));
        eprintln!("  run directory (tmpfs): {}", moved.display());
        let out = run_plan_in(plan, args, accel, initrd, &moved);
        if out.checks.iter().all(|c| c.ok) {
            let _ = std::fs::remove_dir_all(&moved);
        }
        return out;
    }
    run_plan_in(plan, args, accel, initrd, dir)
}

fn run_plan_in(plan: &Plan, args: &Args, accel: Accel, initrd: &Path, dir: &Path) -> Outcome {
    if let Err(e) = std::fs::create_dir_all(dir) {
        return Outcome {
            checks: vec![Check::new(format!("{}.setup", plan.name), false, e)],
            measures: vec![],
            notes: vec![],
        };
    }
    match plan.servers {
        Servers::Processes(kinds) => run_processes(plan, kinds, args, accel, initrd, dir),
        Servers::UnplugDaemon => run_unplug(plan, args, accel, initrd, dir),
    }
}

/// The QEMU run of `plan` with these devices.
fn vm<'a>(
    plan: &Plan,
    args: &'a Args,
    accel: Accel,
    kernel: &'a Path,
    initrd: &'a Path,
    dir: &Path,
    devices: Vec<Attach>,
) -> Vm<'a> {
    Vm {
        qemu: &args.qemu,
        accel,
        kernel,
        initrd: Some(initrd),
        mem_mib: 512,
        ram: plan.ram,
        viommu: plan.viommu,
        allow_reboot: plan.allow_reboot,
        devices,
        builtin: plan.builtin.iter().map(|b| b.to_string()).collect(),
        extra_args: vec![],
        append: format!(
            "umdev.scenarios={} {}",
            selected(plan, args).join(","),
            plan.append
        )
        .trim_end()
        .to_string(),
        timeout: Duration::from_secs(args.timeout),
        echo: args.verbose,
        stderr_log: dir.join("qemu.stderr"),
        stop_at: None,
        watch: None,
        qmp: None,
    }
}

/// What the guest said and QEMU did, as checks, measures and notes; the parsed console.
fn guest_results(
    run: &std::io::Result<Run>,
    scenarios: &[&str],
    dir: &Path,
) -> (Outcome, Option<GuestLog>) {
    let mut out = Outcome {
        checks: vec![],
        measures: vec![],
        notes: vec![],
    };
    let run = match run {
        Err(e) => {
            out.checks.push(Check::new("qemu.start", false, e));
            return (out, None);
        }
        Ok(run) => run,
    };
    let _ = std::fs::write(
        dir.join("console.log"),
        run.console
            .iter()
            .map(|(t, l)| format!("{:8.3} {l}\n", t.as_secs_f64()))
            .collect::<String>(),
    );
    let log = GuestLog::parse(run.console.iter().map(|(_, l)| l.as_str()));
    out.checks.push(Check::new(
        "qemu.exit",
        run.exit.is_some_and(|s| s.success()) && !run.timed_out,
        if run.timed_out {
            format!("timed out after {:?}", run.elapsed)
        } else {
            format!("{:?}", run.exit)
        },
    ));
    if let Some(t) = run.time_to("UMDEV-BOOT") {
        out.measures.push(Measure {
            scenario: "boot".into(),
            name: "boot_to_init".into(),
            value: t.as_secs_f64(),
            unit: "s".into(),
        });
    }
    if let Some(t) = run.reboot_to_init() {
        out.measures.push(Measure {
            scenario: "boot".into(),
            name: "reboot_to_init".into(),
            value: t.as_secs_f64(),
            unit: "s".into(),
        });
    }
    for s in scenarios {
        out.checks.push(Check::new(
            format!("{s}.ended"),
            log.ended.iter().any(|e| e == *s),
            "the scenario printed its END line",
        ));
    }
    out.checks.extend(log.checks.iter().cloned());
    out.measures.extend(log.measures.iter().cloned());
    out.notes
        .extend(log.trouble.iter().map(|t| format!("guest: {t}")));
    out.notes.extend(
        run.stderr
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| format!("qemu: {l}")),
    );
    (out, Some(log))
}

/// A run with one server process per device.
fn run_processes(
    plan: &Plan,
    kinds: &[Kind],
    args: &Args,
    accel: Accel,
    initrd: &Path,
    dir: &Path,
) -> Outcome {
    let scenarios = selected(plan, args);
    let mut checks = Vec::new();
    let bins = Bins {
        umdev: args.umdev.clone(),
        hello: args.hello.clone(),
    };
    let mut servers = Vec::new();
    for &k in kinds {
        match Server::start(k, &bins, dir, &args.server_log) {
            Ok(s) => servers.push(s),
            Err(e) => checks.push(Check::new(format!("{}.server_start", k.name()), false, e)),
        }
    }
    let kernel = args.guest_dir.join("vmlinuz");
    let devices = servers
        .iter()
        .map(|s| Attach::root_bus(s.socket.clone()))
        .collect();
    let mut vm = vm(plan, args, accel, &kernel, initrd, dir, devices);
    if plan.qemu_nvme {
        let image = dir.join("qemu-nvme.img");
        let made = std::fs::File::create(&image).and_then(|f| f.set_len(64 << 20));
        if let Err(e) = made {
            checks.push(Check::new("qemu_nvme.image", false, e));
        }
        vm.extra_args = vec![
            "-drive".into(),
            format!(
                "file={},if=none,id=qnvme,format=raw,discard=unmap",
                image.display()
            ),
        ];
    }
    // While the VM runs: host CPU samples at the guest's begin/end cues (cpu_cues.rs), and
    // the host's actions at the virtio-gpu scenarios' cues (display.rs).
    let pids: Vec<u32> = servers.iter().map(Server::pid).collect();
    let mut actions = kinds
        .contains(&Kind::VirtioGpu)
        .then(|| display::Actions::new(&args.umdev, dir, &scenarios));
    let (tx, rx) = mpsc::channel();
    vm.watch = Some(tx);
    let (run, cpu) = std::thread::scope(|s| {
        let (cpu_tx, cpu_rx) = mpsc::channel();
        let sampler = s.spawn(|| cpu_cues::collect(cpu_rx, &pids));
        let actions = &mut actions;
        s.spawn(move || {
            for (at, line) in rx {
                if let Some(a) = actions.as_mut() {
                    a.on_line(&line);
                }
                let _ = cpu_tx.send((at, line));
            }
        });
        let run = vm.run();
        drop(vm);
        (run, sampler.join().unwrap_or_default())
    });
    let (mut out, guest_log) = guest_results(&run, &scenarios, dir);
    out.measures.extend(cpu);
    checks.append(&mut out.checks);
    if let Some(a) = actions {
        checks.extend(a.finish());
    }
    let stopped: Vec<server::Outcome> = servers.into_iter().map(Server::stop).collect();
    for s in &stopped {
        // The pin-refusal hint is logged only if a scenario of this device tried to pin.
        let pinned_fdless =
            plan.ram == Ram::Plain && scenarios.iter().any(|sc| sc.starts_with(s.kind.name()));
        checks.extend(s.checks(pinned_fdless));
    }
    // Only now: the ccw and NVMe servers have stopped and flushed their images.
    if let Some(log) = guest_log.as_ref().filter(|l| !l.images.is_empty()) {
        let (nvme, ccw): (Vec<_>, Vec<_>) = log
            .images
            .iter()
            .cloned()
            .partition(|e| e.scenario.starts_with("nvme"));
        if !ccw.is_empty() {
            checks.extend(image::checks(&server::ccw_image(dir), &ccw));
        }
        if !nvme.is_empty() {
            checks.extend(image::checks(&server::nvme_image(dir), &nvme));
        }
    }
    if let (Some(host_checks), Some(log)) = (plan.host_checks, &guest_log) {
        checks.extend(host_checks(log, &stopped));
    }
    Outcome {
        checks,
        measures: out.measures,
        notes: out.notes,
    }
}

/// The `unplug` run: a daemon, its instances, QEMU, and the removals at the guest's cues.
fn run_unplug(plan: &Plan, args: &Args, accel: Accel, initrd: &Path, dir: &Path) -> Outcome {
    let scenarios = selected(plan, args);
    let daemon = match daemon::Daemon::start(&args.umdev, dir, unplug::RELEASE, &args.server_log) {
        Ok(d) => d,
        Err(e) => {
            return Outcome {
                checks: vec![Check::new("daemon.start", false, e)],
                measures: vec![],
                notes: vec![],
            }
        }
    };
    let devices = match unplug::create(&daemon) {
        Ok(d) => d,
        Err(failed) => {
            let stopped = daemon.stop();
            return Outcome {
                checks: failed,
                measures: vec![],
                notes: stopped
                    .log
                    .lines()
                    .map(|l| format!("daemon: {l}"))
                    .collect(),
            };
        }
    };
    let qemu_side = match qemu_unplug::handles_request_irq(&args.qemu) {
        Ok(h) => unplug::QemuSide {
            handles_request_irq: h,
        },
        Err(e) => {
            let stopped = daemon.stop();
            return Outcome {
                checks: vec![Check::new("unplug.qemu_probe", false, e)],
                measures: vec![],
                notes: stopped
                    .log
                    .lines()
                    .map(|l| format!("daemon: {l}"))
                    .collect(),
            };
        }
    };
    eprintln!(
        "  QEMU's vfio-user-pci {} the device-request IRQ{}",
        if qemu_side.handles_request_irq {
            "answers"
        } else {
            "does not answer (no x-req)"
        },
        if qemu_side.handles_request_irq {
            ""
        } else {
            ": the harness unplugs with QMP device_del"
        }
    );
    let kernel = args.guest_dir.join("vmlinuz");
    let qmp = dir.join("qmp.sock");
    let (tx, rx) = mpsc::channel();
    let (run, steps) = std::thread::scope(|s| {
        let actor = s.spawn(|| unplug::act(rx, &daemon, &qmp, qemu_side));
        let mut vm = vm(plan, args, accel, &kernel, initrd, dir, devices);
        // The console goes to the actor as it comes; QMP is how it unplugs.
        vm.watch = Some(tx);
        vm.qmp = Some(qmp.clone());
        let run = vm.run();
        // The console's last sender goes with the VM: the actor sees the end and returns.
        drop(vm);
        (run, actor.join().unwrap_or_default())
    });
    let (mut out, guest_log) = guest_results(&run, &scenarios, dir);
    let image = daemon.ccw_image(unplug::CCW);
    let stopped = daemon.stop();
    let (checks, measures) =
        unplug::checks(&scenarios, &steps, run.as_ref().ok(), &stopped, qemu_side);
    out.checks.extend(checks);
    out.measures.extend(measures);
    out.notes.extend(unplug::notes(&steps, &stopped));
    // Only now: the daemon has stopped and the ccw image is flushed.
    if let Some(log) = guest_log.as_ref().filter(|l| !l.images.is_empty()) {
        out.checks.extend(image::checks(&image, &log.images));
    }
    out
}

fn main() {
    let args = Args::parse();
    std::process::exit(match run(&args) {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            eprintln!("umdev-vmtest: {e}");
            2
        }
    });
}

fn run(args: &Args) -> Result<bool, String> {
    if let Some(unknown) = args
        .scenario
        .iter()
        .find(|n| !PLANS.iter().any(|p| p.scenarios.contains(&n.as_str())))
    {
        return Err(format!("unknown scenario '{unknown}'"));
    }
    if let Some(unknown) = args
        .only
        .iter()
        .find(|n| !PLANS.iter().any(|p| p.name == *n))
    {
        let names: Vec<&str> = PLANS.iter().map(|p| p.name).collect();
        return Err(format!(
            "unknown guest run '{unknown}' (known: {})",
            names.join(", ")
        ));
    }
    let (work, temp) = match &args.work_dir {
        Some(d) => (d.clone(), None),
        None => {
            let t = std::env::temp_dir().join(format!("umdev-vmtest-{}", std::process::id()));
            (t.clone(), Some(t))
        }
    };
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let accel = match args.accel {
        AccelArg::Tcg => Accel::Tcg,
        AccelArg::Kvm => Accel::Kvm,
        AccelArg::Auto if kvm_works(args, &work) => Accel::Kvm,
        AccelArg::Auto => Accel::Tcg,
    };
    let initrd = work.join("initramfs.cpio");
    initramfs::build(
        &initramfs::Contents {
            busybox: &args.guest_dir.join("busybox"),
            modules: &args.guest_dir.join("modules"),
            guest: &args.guest_bin,
        },
        &initrd,
    )
    .map_err(|e| format!("building the initramfs: {e}"))?;
    eprintln!(
        "vmtest: QEMU {} ({accel:?}), kernel {}, work dir {}",
        args.qemu.display(),
        std::fs::read_to_string(args.guest_dir.join("kernel-version"))
            .unwrap_or_default()
            .trim(),
        work.display()
    );
    let t0 = Instant::now();
    let (mut total, mut failed) = (0usize, 0usize);
    let mut skipped = Vec::new();
    let mut all_measures = Vec::new();
    let plans = PLANS.iter().filter(|p| {
        (args.only.is_empty() || args.only.iter().any(|n| n == p.name))
            && !selected(p, args).is_empty()
    });
    for plan in plans {
        eprintln!(
            "\n== {}: {} (scenarios: {})",
            plan.name,
            plan.what,
            selected(plan, args).join(" ")
        );
        if plan.needs_unplug_fix {
            match qemu_unplug::fix(&args.qemu, args.qemu_unplug_fix) {
                Ok(why) => eprintln!("  QEMU has the vfio-user unplug fix: {why}"),
                Err(why) if args.no_skip => {
                    eprintln!("  FAIL: QEMU {}: {why} (--no-skip)", args.qemu.display());
                    total += 1;
                    failed += 1;
                    continue;
                }
                Err(why) => {
                    eprintln!("  SKIPPED: QEMU {}: {why}", args.qemu.display());
                    skipped.push(plan.name);
                    continue;
                }
            }
        }
        let started = Instant::now();
        let out = run_plan(plan, args, accel, &initrd, &work.join(plan.name));
        for c in &out.checks {
            total += 1;
            if !c.ok {
                failed += 1;
            }
            let mark = if c.ok { "ok  " } else { "FAIL" };
            if !c.ok || args.verbose {
                eprintln!("  {mark} {:<44} {}", c.name, c.detail);
            }
        }
        let bad = out.checks.iter().filter(|c| !c.ok).count();
        eprintln!(
            "  {} checks, {bad} failed, {:.1} s",
            out.checks.len(),
            started.elapsed().as_secs_f64()
        );
        if bad > 0 || args.verbose {
            for n in &out.notes {
                eprintln!("  note: {n}");
            }
        }
        all_measures.extend(out.measures.into_iter().map(|m| (plan.name, m)));
    }
    if !all_measures.is_empty() {
        eprintln!("\nmeasured (guest under {accel:?}):");
        for (plan, m) in &all_measures {
            eprintln!(
                "  {plan:<8} {:<10} {:<28} {:>12.3} {}",
                m.scenario, m.name, m.value, m.unit
            );
        }
    }
    eprintln!(
        "\nvmtest: {total} checks, {failed} failed, wall {:.0} s",
        t0.elapsed().as_secs_f64()
    );
    if !skipped.is_empty() {
        eprintln!(
            "vmtest: SKIPPED guest runs: {} (QEMU lacks the vfio-user unplug fix; see above)",
            skipped.join(", ")
        );
    }
    if failed > 0 {
        eprintln!("vmtest: logs kept in {}", work.display());
    } else if let Some(t) = temp {
        let _ = std::fs::remove_dir_all(t);
    }
    Ok(failed == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu_with_log(log: &str) -> server::Outcome {
        server::Outcome {
            kind: Kind::Gpu,
            alive_after_guest: true,
            exit: None,
            log: log.to_string(),
        }
    }

    #[test]
    fn test_viommu_checks_one_boot_or_overlap_refusal_fails() {
        let twice = GuestLog::parse(["UMDEV-BOOT 1.0", "UMDEV-BOOT 2.0"]);
        let once = GuestLog::parse(["UMDEV-BOOT 1.0"]);
        let clean = gpu_with_log("INFO client disconnected\n");
        let refused = gpu_with_log(
            "WARN DMA_MAP iova=0x110000000 size=0x1000 rejected: DMA mapping \
             [0x110000000, +0x1000) overlaps an existing mapping\n",
        );
        let ok = |log: &GuestLog, s: &server::Outcome| {
            viommu_checks(log, std::slice::from_ref(s))
                .iter()
                .map(|c| (c.name.clone(), c.ok))
                .collect::<Vec<_>>()
        };
        let names = |a: bool, b: bool| {
            vec![
                ("viommu.guest_booted_twice".to_string(), a),
                ("gpu.server_no_overlap_refusal".to_string(), b),
            ]
        };
        assert_eq!(ok(&twice, &clean), names(true, true));
        assert_eq!(ok(&once, &clean), names(false, true));
        assert_eq!(ok(&twice, &refused), names(true, false));
    }
}
