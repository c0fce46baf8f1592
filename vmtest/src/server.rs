//! umdev servers as a user runs them next to QEMU: `umdev run gpu|ccw|nvme` and the hello
//! example's `--serve` mode, each a separate process with its log in a file, stopped with
//! SIGTERM; and the host-side checks made on them after a guest run.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::report::Check;

/// Which device a server serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `umdev run gpu`.
    Gpu,
    /// `umdev run ccw` with a fresh 16 MiB image.
    Ccw,
    /// `examples/hello --serve`.
    Hello,
    /// `umdev run nvme` with a fresh 64 MiB image.
    Nvme,
    /// `umdev run nvme --no-shadow-doorbells --serial UMDEVTRAPPED` with a fresh 64 MiB
    /// image: every doorbell traps (the other doorbell mode, measured by `nvme-bench`).
    NvmeTrapped,
    /// `umdev run virtio-gpu --screenshot-on-exit <dir>/virtio-gpu.png`.
    VirtioGpu,
    /// `umdev run virtio-gpu --width 1920 --height 1080 --gpu-memory-mib 128` (the bench).
    VirtioGpuHd,
}

impl Kind {
    /// Short name (socket and log file names, check names).
    pub fn name(self) -> &'static str {
        match self {
            Kind::Gpu => "gpu",
            Kind::Ccw => "ccw",
            Kind::Hello => "hello",
            Kind::Nvme => "nvme",
            Kind::NvmeTrapped => "nvme-trapped",
            Kind::VirtioGpu => "virtio-gpu",
            Kind::VirtioGpuHd => "virtio-gpu-hd",
        }
    }
}

/// The ccw server's image in a guest run's directory.
pub fn ccw_image(dir: &Path) -> PathBuf {
    dir.join("ccw.img")
}

/// The serial of the [`Kind::NvmeTrapped`] controller (how the guest tells it apart).
pub const TRAPPED_SERIAL: &str = "UMDEVTRAPPED";

/// The NVMe server's image in a guest run's directory.
pub fn nvme_image(dir: &Path) -> PathBuf {
    dir.join("nvme.img")
}

/// Where the virtio-gpu server writes its screenshot when it stops.
pub fn screenshot(dir: &Path) -> PathBuf {
    dir.join("virtio-gpu.png")
}

/// The binaries under test.
pub struct Bins {
    /// The `umdev` binary.
    pub umdev: PathBuf,
    /// The hello example binary.
    pub hello: PathBuf,
}

/// A running server process.
pub struct Server {
    /// What it serves.
    pub kind: Kind,
    /// Its vfio-user socket.
    pub socket: PathBuf,
    /// Its log (stderr and stdout).
    pub log: PathBuf,
    child: Child,
}

/// How a server ended.
pub struct Outcome {
    /// What it served.
    pub kind: Kind,
    /// Still running when the guest was done (it must survive the client).
    pub alive_after_guest: bool,
    /// Exit status after SIGTERM (None: had to be killed).
    pub exit: Option<ExitStatus>,
    /// The whole log.
    pub log: String,
}

impl Server {
    /// Start the server for `kind` in `dir` with `RUST_LOG=rust_log` and wait for its socket.
    pub fn start(kind: Kind, bins: &Bins, dir: &Path, rust_log: &str) -> io::Result<Server> {
        let socket = dir.join(format!("{}.sock", kind.name()));
        let log = dir.join(format!("{}.log", kind.name()));
        let mut cmd = match kind {
            Kind::VirtioGpu => {
                let mut c = Command::new(&bins.umdev);
                c.args(["run", "virtio-gpu", "--socket"]).arg(&socket);
                c.arg("--screenshot-on-exit").arg(screenshot(dir));
                c.arg("--control").arg(crate::display::control(dir));
                c
            }
            Kind::VirtioGpuHd => {
                let mut c = Command::new(&bins.umdev);
                c.args(["run", "virtio-gpu", "--socket"]).arg(&socket);
                c.args([
                    "--width",
                    "1920",
                    "--height",
                    "1080",
                    "--gpu-memory-mib",
                    "128",
                ]);
                c
            }
            Kind::Gpu | Kind::Ccw => {
                let mut c = Command::new(&bins.umdev);
                c.arg("run").arg(kind.name()).arg("--socket").arg(&socket);
                if kind == Kind::Ccw {
                    c.arg("--image")
                        .arg(ccw_image(dir))
                        .args(["--image-size-mib", "16"]);
                }
                c
            }
            Kind::Nvme => {
                let mut c = Command::new(&bins.umdev);
                c.args(["run", "nvme", "--size", "64M", "--socket"])
                    .arg(&socket)
                    .arg("--image")
                    .arg(nvme_image(dir));
                c
            }
            Kind::NvmeTrapped => {
                let mut c = Command::new(&bins.umdev);
                c.args(["run", "nvme", "--size", "64M", "--socket"])
                    .arg(&socket)
                    .arg("--image")
                    .arg(dir.join("nvme-trapped.img"))
                    .args(["--no-shadow-doorbells", "--serial", TRAPPED_SERIAL]);
                c
            }
            Kind::Hello => {
                let mut c = Command::new(&bins.hello);
                c.arg("--serve").arg(&socket);
                c
            }
        };
        let out = File::create(&log)?;
        cmd.env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        let mut child = cmd.spawn().map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("starting {}: {e}", cmd.get_program().to_string_lossy()),
            )
        })?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket.exists() {
            if let Some(st) = child.try_wait()? {
                return Err(io::Error::other(format!(
                    "{} server exited ({st}) before creating its socket; log:\n{}",
                    kind.name(),
                    std::fs::read_to_string(&log).unwrap_or_default()
                )));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return Err(io::Error::other(format!(
                    "{} server: no socket after 20 s",
                    kind.name()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Server {
            kind,
            socket,
            log,
            child,
        })
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM it and wait (up to 15 s, then SIGKILL).
    pub fn stop(mut self) -> Outcome {
        let (alive_after_guest, exit) = terminate(&mut self.child, Duration::from_secs(15));
        Outcome {
            kind: self.kind,
            alive_after_guest,
            exit,
            log: std::fs::read_to_string(&self.log).unwrap_or_default(),
        }
    }
}

impl Outcome {
    /// The host-side checks: the server outlived the guest, logged the disconnect with no
    /// pins left behind, stopped cleanly on SIGTERM with nothing mapped or pinned, and never
    /// panicked. `fd_less` adds: pins were refused with the hint to use a memfd backend
    /// (the caller says whether a scenario of this device pinned fd-less memory).
    pub fn checks(&self, fd_less: bool) -> Vec<Check> {
        let dev = self.kind.name();
        let mut v = vec![
            Check::new(
                format!("{dev}.server_alive_after_guest"),
                self.alive_after_guest,
                "",
            ),
            Check::new(
                format!("{dev}.server_disconnect_logged"),
                self.log.contains("client disconnected"),
                "log line 'client disconnected'",
            ),
            Check::new(
                format!("{dev}.server_no_leftover_pins"),
                !self.log.contains("left pins behind"),
                "no 'left pins behind' in the log",
            ),
            Check::new(
                format!("{dev}.server_clean_sigterm"),
                self.exit.is_some_and(|s| s.success())
                    && self
                        .log
                        .contains("stopped: 0 maps, 0 pinned pages, 0 leaked pins"),
                format!("exit {:?}", self.exit),
            ),
            Check::new(
                format!("{dev}.server_no_panic"),
                !self.log.contains("panicked"),
                "",
            ),
            Check::new(
                format!("{dev}.server_log_plain_text"),
                !self.log.contains('\x1b'),
                "no ANSI colour codes in a log written to a file",
            ),
        ];
        if fd_less && self.kind != Kind::Hello {
            v.push(Check::new(
                format!("{dev}.server_fdless_pin_hint_logged"),
                self.log.contains("memory-backend-memfd"),
                "the pin refusal tells the user to add a shared memfd backend",
            ));
        }
        v
    }
}

/// Stop a child process the way a user stops a server: if it still runs, SIGTERM it and
/// wait up to `grace` for it to exit, then SIGKILL it (and reap it). Returns whether it was
/// still running when asked, and its exit status (None: it was killed, or it could not be
/// waited for).
pub fn terminate(child: &mut Child, grace: Duration) -> (bool, Option<ExitStatus>) {
    let alive = matches!(child.try_wait(), Ok(None));
    if !alive {
        return (false, child.try_wait().ok().flatten());
    }
    // SAFETY: signalling our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            return (true, Some(st));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    (true, None)
}
