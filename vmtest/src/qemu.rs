//! One QEMU run: the command line (q35, TCG or KVM, guest RAM as a shared memfd or plain,
//! optionally an intel-iommu in caching mode, one `vfio-user-pci` per server, on the root
//! bus or behind a hotplug-capable `pcie-root-port`), the serial console collected line by
//! line with timestamps (and passed on as it comes to whoever watches it), a timeout.

use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How guest RAM reaches the servers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ram {
    /// `memory-backend-memfd,share=on`: DMA_MAP carries fds; devices can pin.
    Memfd,
    /// Plain RAM: DMA_MAP without fds; DMA goes through DMA_READ/DMA_WRITE, pins are refused.
    Plain,
}

/// Accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    /// Software emulation.
    Tcg,
    /// Hardware virtualisation.
    Kvm,
}

impl Accel {
    fn arg(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }
}

/// Where a `vfio-user-pci` device sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// On q35's root bus `pcie.0`: no hotplug (QEMU refuses to unplug it).
    RootBus,
    /// Behind its own `pcie-root-port` (a hotplug slot; the guest ejects it when asked).
    RootPort,
}

/// One `vfio-user-pci` device.
#[derive(Clone, Debug)]
pub struct Attach {
    /// Its vfio-user socket.
    pub socket: PathBuf,
    /// Where it sits.
    pub slot: Slot,
    /// Its QEMU device id (for QMP's `device_del`), if it needs one.
    pub id: Option<String>,
}

impl Attach {
    /// A device on the root bus, without an id.
    pub fn root_bus(socket: PathBuf) -> Attach {
        Attach {
            socket,
            slot: Slot::RootBus,
            id: None,
        }
    }
}

/// Everything one run needs.
pub struct Vm<'a> {
    /// The QEMU binary.
    pub qemu: &'a Path,
    /// Accelerator.
    pub accel: Accel,
    /// Guest kernel.
    pub kernel: &'a Path,
    /// initramfs (None: kernel only, for the KVM probe).
    pub initrd: Option<&'a Path>,
    /// Guest RAM in MiB.
    pub mem_mib: u32,
    /// RAM mode.
    pub ram: Ram,
    /// Add `-device intel-iommu,caching-mode=on` (and `intel_iommu=on` for the guest).
    pub viommu: bool,
    /// Let the guest reboot (otherwise a reboot ends QEMU).
    pub allow_reboot: bool,
    /// The `vfio-user-pci` devices, in this order on the command line.
    pub devices: Vec<Attach>,
    /// QEMU's own devices to add (`-device` values, e.g. `edu`), after the vfio-user ones.
    pub builtin: Vec<String>,
    /// More QEMU arguments, before the devices (e.g. the `-drive` a built-in device uses).
    pub extra_args: Vec<String>,
    /// A QMP monitor on this unix socket (QEMU creates it).
    pub qmp: Option<PathBuf>,
    /// Extra kernel command line.
    pub append: String,
    /// Give up after this long.
    pub timeout: Duration,
    /// Echo the console to stderr as it comes.
    pub echo: bool,
    /// Where QEMU's own stderr goes.
    pub stderr_log: PathBuf,
    /// Stop as soon as a console line contains this (used by the KVM probe).
    pub stop_at: Option<&'static str>,
    /// Gets every console line as it comes, with its time (a guest run whose host side
    /// acts on the guest's cues). Sends that fail (nobody listening) are ignored.
    pub watch: Option<Sender<(Duration, String)>>,
}

/// What a run produced.
pub struct Run {
    /// Console lines with the time since QEMU started.
    pub console: Vec<(Duration, String)>,
    /// QEMU's exit status (None: killed at the timeout or at `stop_at`).
    pub exit: Option<ExitStatus>,
    /// The run hit its timeout.
    pub timed_out: bool,
    /// Wall time.
    pub elapsed: Duration,
    /// QEMU's stderr.
    pub stderr: String,
}

impl Run {
    /// Time from QEMU start to the first console line containing `marker`.
    pub fn time_to(&self, marker: &str) -> Option<Duration> {
        self.console
            .iter()
            .find(|(_, l)| l.contains(marker))
            .map(|(t, _)| *t)
    }

    /// Time from the kernel's "reboot: Restarting system" line to the next `UMDEV-BOOT`
    /// (a guest that rebooted itself; None if it did not).
    pub fn reboot_to_init(&self) -> Option<Duration> {
        let at = self
            .console
            .iter()
            .position(|(_, l)| l.contains("reboot: Restarting system"))?;
        let (t0, _) = self.console[at];
        self.console[at..]
            .iter()
            .find(|(_, l)| l.contains("UMDEV-BOOT"))
            .map(|(t, _)| t.saturating_sub(t0))
    }
}

/// Firmware directories of Debian's seabios, qemu-system-data and ipxe-qemu packages (the
/// QEMU built by `scripts/qemu.sh` is configured without its own blobs).
const FIRMWARE_DIRS: &[&str] = &[
    "/usr/share/seabios",
    "/usr/share/qemu",
    "/usr/lib/ipxe/qemu",
];

impl Vm<'_> {
    /// The QEMU command line.
    pub fn command(&self) -> Command {
        let mut c = Command::new(self.qemu);
        c.args(["-nodefaults", "-no-user-config", "-display", "none"]);
        c.args(["-accel", self.accel.arg(), "-smp", "1"]);
        c.args(["-m", &format!("{}M", self.mem_mib)]);
        match self.ram {
            Ram::Memfd => {
                c.args(["-machine", "q35,memory-backend=mem"]);
                c.args([
                    "-object",
                    &format!(
                        "memory-backend-memfd,id=mem,size={}M,share=on",
                        self.mem_mib
                    ),
                ]);
            }
            Ram::Plain => {
                c.args(["-machine", "q35"]);
            }
        }
        for d in FIRMWARE_DIRS {
            if Path::new(d).is_dir() {
                c.args(["-L", d]);
            }
        }
        c.arg("-kernel").arg(self.kernel);
        if let Some(initrd) = self.initrd {
            c.arg("-initrd").arg(initrd);
        }
        let mut append = String::from("console=ttyS0,115200 panic=-1 loglevel=4 ");
        if self.viommu {
            append.push_str("intel_iommu=on ");
            // Must come before the devices it translates for.
            c.args(["-device", "intel-iommu,caching-mode=on"]);
        }
        append.push_str(&self.append);
        c.args(["-append", append.trim()]);
        c.args(["-serial", "stdio"]);
        if !self.allow_reboot {
            c.arg("-no-reboot");
        }
        let mut ports = 0;
        for d in &self.devices {
            let bus = match d.slot {
                Slot::RootBus => String::new(),
                Slot::RootPort => {
                    ports += 1;
                    // One chassis, a slot number per port (two ports may not share both).
                    c.args([
                        "-device",
                        &format!("pcie-root-port,id=rp{ports},chassis=1,slot={ports}"),
                    ]);
                    format!(r#""bus":"rp{ports}","#)
                }
            };
            let id =
                d.id.as_ref()
                    .map(|id| format!(r#""id":"{id}","#))
                    .unwrap_or_default();
            c.args([
                "-device",
                &format!(
                    r#"{{"driver":"vfio-user-pci",{id}{bus}"socket":{{"type":"unix","path":"{}"}}}}"#,
                    d.socket.display()
                ),
            ]);
        }
        c.args(&self.extra_args);
        for b in &self.builtin {
            c.args(["-device", b]);
        }
        if let Some(q) = &self.qmp {
            c.arg("-qmp")
                .arg(format!("unix:{},server=on,wait=off", q.display()));
        }
        c
    }

    /// Run QEMU to completion (or the timeout).
    pub fn run(&self) -> io::Result<Run> {
        let mut cmd = self.command();
        let stderr = std::fs::File::create(&self.stderr_log)?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr);
        let start = Instant::now();
        let mut child = cmd.spawn().map_err(|e| {
            io::Error::new(e.kind(), format!("starting {}: {e}", self.qemu.display()))
        })?;
        let console = Arc::new(Mutex::new(Vec::<(Duration, String)>::new()));
        let stop_hit = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let reader = {
            let out = child.stdout.take().expect("piped stdout");
            let console = console.clone();
            let stop_hit = stop_hit.clone();
            let (echo, stop_at) = (self.echo, self.stop_at);
            let watch = self.watch.clone();
            std::thread::spawn(move || {
                let mut r = BufReader::new(out);
                let mut buf = Vec::new();
                while r.read_until(b'\n', &mut buf).is_ok_and(|n| n > 0) {
                    let line = String::from_utf8_lossy(&buf).trim_end().to_string();
                    buf.clear();
                    if echo {
                        eprintln!("  | {line}");
                    }
                    if stop_at.is_some_and(|m| line.contains(m)) {
                        stop_hit.store(true, std::sync::atomic::Ordering::Release);
                    }
                    let at = start.elapsed();
                    if let Some(w) = &watch {
                        let _ = w.send((at, line.clone()));
                    }
                    console
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((at, line));
                }
            })
        };
        let mut exit = None;
        let mut timed_out = false;
        loop {
            if let Some(st) = child.try_wait()? {
                exit = Some(st);
                break;
            }
            if stop_hit.load(std::sync::atomic::Ordering::Acquire) {
                break;
            }
            if start.elapsed() > self.timeout {
                timed_out = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if exit.is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = reader.join();
        let console = std::mem::take(&mut *console.lock().unwrap_or_else(|e| e.into_inner()));
        Ok(Run {
            console,
            exit,
            timed_out,
            elapsed: start.elapsed(),
            stderr: std::fs::read_to_string(&self.stderr_log).unwrap_or_default(),
        })
    }
}
