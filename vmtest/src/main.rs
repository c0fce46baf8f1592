//! `umdev-vmtest`: umdev's real-VMM suite. Boots a Debian guest kernel in QEMU (≥ 10.1, with
//! `vfio-user-pci`) with umdev's example devices attached as separate server processes,
//! runs `umdev-guest` inside the guest to drive them like a guest driver would, and checks
//! both sides: the guest's own checks (console lines) and the servers' (alive after the
//! guest, disconnect logged with no pins left, clean SIGTERM, no panic).
//!
//! Run it through `scripts/vm-tests.sh`, which finds or builds QEMU and the guest kernel
//! and builds the binaries; `--help` lists the options.

mod image;
mod initramfs;
mod qemu;
mod report;
mod server;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};

use qemu::{Accel, Ram, Vm};
use report::{Check, GuestLog, Measure};
use server::{Bins, Kind, Server};

/// One guest run: which servers, which RAM mode, which guest scenarios.
struct Plan {
    name: &'static str,
    what: &'static str,
    ram: Ram,
    viommu: bool,
    allow_reboot: bool,
    devices: &'static [Kind],
    scenarios: &'static [&'static str],
}

/// Every guest run of the suite, in order.
const PLANS: &[Plan] = &[
    Plan {
        name: "memfd",
        what: "guest RAM as a shared memfd: devices pin guest pages",
        ram: Ram::Memfd,
        viommu: false,
        allow_reboot: false,
        devices: &[Kind::Hello, Kind::Gpu, Kind::Ccw],
        scenarios: &["hello", "gpu", "gpu-bme", "ccw", "ccw-intx", "ccw-bme"],
    },
    Plan {
        name: "plain",
        what: "plain guest RAM: DMA through DMA_READ/DMA_WRITE, pins refused",
        ram: Ram::Plain,
        viommu: false,
        allow_reboot: false,
        devices: &[Kind::Hello, Kind::Gpu, Kind::Ccw],
        scenarios: &["hello", "gpu-plain", "ccw-plain"],
    },
    Plan {
        name: "viommu",
        what: "the GPU behind intel-iommu (caching mode), driven through the guest's VFIO",
        ram: Ram::Memfd,
        viommu: true,
        allow_reboot: true,
        devices: &[Kind::Gpu],
        scenarios: &["gpu-viommu"],
    },
];

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
viommu   the GPU behind intel-iommu, through the guest's VFIO, with a guest reboot\n\
Exit status: 0 if every check passed, 1 if one failed, 2 on a setup error."
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
    /// Cache for the KVM verdict (default ~/.cache/umdev).
    #[arg(long, env = "UMDEV_CACHE_DIR", value_name = "DIR")]
    cache_dir: Option<PathBuf>,
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
        sockets: vec![],
        append: "earlyprintk=ttyS0".into(),
        timeout: Duration::from_secs(20),
        echo: false,
        stderr_log: work.join("kvm-probe.stderr"),
        stop_at: Some("Linux version"),
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
    let scenarios = selected(plan, args);
    let mut checks = Vec::new();
    let mut notes = Vec::new();
    let bins = Bins {
        umdev: args.umdev.clone(),
        hello: args.hello.clone(),
    };
    if let Err(e) = std::fs::create_dir_all(dir) {
        checks.push(Check::new(format!("{}.setup", plan.name), false, e));
        return Outcome {
            checks,
            measures: vec![],
            notes,
        };
    }
    let mut servers = Vec::new();
    for &k in plan.devices {
        match Server::start(k, &bins, dir) {
            Ok(s) => servers.push(s),
            Err(e) => checks.push(Check::new(format!("{}.server_start", k.name()), false, e)),
        }
    }
    let kernel = args.guest_dir.join("vmlinuz");
    let vm = Vm {
        qemu: &args.qemu,
        accel,
        kernel: &kernel,
        initrd: Some(initrd),
        mem_mib: 512,
        ram: plan.ram,
        viommu: plan.viommu,
        allow_reboot: plan.allow_reboot,
        sockets: servers.iter().map(|s| s.socket.clone()).collect(),
        append: format!("umdev.scenarios={}", scenarios.join(",")),
        timeout: Duration::from_secs(args.timeout),
        echo: args.verbose,
        stderr_log: dir.join("qemu.stderr"),
        stop_at: None,
    };
    let mut measures = Vec::new();
    let mut images = Vec::new();
    match vm.run() {
        Err(e) => checks.push(Check::new("qemu.start", false, e)),
        Ok(run) => {
            let _ = std::fs::write(
                dir.join("console.log"),
                run.console
                    .iter()
                    .map(|(t, l)| format!("{:8.3} {l}\n", t.as_secs_f64()))
                    .collect::<String>(),
            );
            let log = GuestLog::parse(run.console.iter().map(|(_, l)| l.as_str()));
            checks.push(Check::new(
                "qemu.exit",
                run.exit.is_some_and(|s| s.success()) && !run.timed_out,
                if run.timed_out {
                    format!("timed out after {:?}", run.elapsed)
                } else {
                    format!("{:?}", run.exit)
                },
            ));
            if let Some(t) = run.time_to("UMDEV-BOOT") {
                measures.push(Measure {
                    scenario: "boot".into(),
                    name: "boot_to_init".into(),
                    value: t.as_secs_f64(),
                    unit: "s".into(),
                });
            }
            for s in &scenarios {
                checks.push(Check::new(
                    format!("{s}.ended"),
                    log.ended.iter().any(|e| e == *s),
                    "the scenario printed its END line",
                ));
            }
            checks.extend(log.checks);
            measures.extend(log.measures);
            images = log.images;
            notes.extend(log.trouble.into_iter().map(|t| format!("guest: {t}")));
            notes.extend(
                run.stderr
                    .lines()
                    .filter(|l| !l.trim().is_empty())
                    .map(|l| format!("qemu: {l}")),
            );
        }
    }
    for s in servers {
        let out = s.stop();
        // The pin-refusal hint is logged only if a scenario of this device tried to pin.
        let pinned_fdless = plan.ram == Ram::Plain
            && scenarios.iter().any(|sc| sc.starts_with(out.kind.name()));
        checks.extend(out.checks(pinned_fdless));
    }
    // Only now: the ccw server has stopped and flushed its image.
    if !images.is_empty() {
        checks.extend(image::checks(&server::ccw_image(dir), &images));
    }
    Outcome {
        checks,
        measures,
        notes,
    }
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
    if failed > 0 {
        eprintln!("vmtest: logs kept in {}", work.display());
    } else if let Some(t) = temp {
        let _ = std::fs::remove_dir_all(t);
    }
    Ok(failed == 0)
}
