//! `umdev check`: what this host has and lacks for umdev, one finding per line.
//!
//! Each check reads the host (limits, sysctls, `/proc`, `/sys`, the daemon's directories)
//! and never changes it: nothing is created, no limit is raised. The only side effects are
//! running candidate QEMU binaries (`--version`, `-device help`, each with a timeout),
//! connecting to a control socket, and a non-blocking shared `flock` on the state
//! directory's `daemon.lock` that is released at once.
//!
//! Files: `host` (memory: memlock, map count, huge pages, `/dev/shm`), `qemu` (a QEMU with
//! `vfio-user-pci`), `dirs` (the daemon's directories and a daemon already on them).

mod dirs;
mod host;
mod qemu;

use std::path::PathBuf;

use serde::Serialize;

use crate::CliResult;

/// Arguments of `umdev check`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Checks (name: what it looks at; [required] ones make the exit code 1 when missing):
  memlock        RLIMIT_MEMLOCK against what `umdev run --pin-policy lock` may lock
  max-map-count  vm.max_map_count: the pool of fd-backed DMA maps and per-instance guarantees
  hugepages      HugePages_Total/Free and transparent huge pages (optional)
  dev-shm        /dev/shm is tmpfs (guest RAM as a file there can be DMA-mapped)
  qemu           [required] a QEMU >= 10.1 with vfio-user-pci: $QEMU_BIN, PATH, then
                 the cache of scripts/qemu.sh (~/.cache/umdev/qemu-*/bin)
  state-dir      [required] the daemon's state directory: private (owner-only) or creatable
  socket-dir     [required] the daemon's socket directory: the same
  daemon         another daemon on the state directory, and whether its control socket answers

Status: ok, warn (works, with a limit worth knowing), missing (umdev cannot do it here).
Exit code: 0 when no required check is missing, 1 otherwise.
--json prints {\"ok\": bool, \"missing\": [names], \"checks\": [{\"name\", \"status\",
\"required\", \"detail\", \"fix\", \"values\"}]}.")]
pub struct CheckArgs {
    /// Print the findings as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The daemon's state directory to check [default: the daemon's].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// The daemon's socket directory to check [default: the daemon's].
    #[arg(long, value_name = "DIR")]
    pub socket_dir: Option<PathBuf>,
    /// The control socket to try [default: <socket-dir>/control.sock].
    #[arg(long, value_name = "PATH", env = umdev::daemon::paths::CONTROL_ENV)]
    pub control: Option<PathBuf>,
    /// The daemon's --max-instances the map budget is checked against.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub max_instances: usize,
    /// A QEMU binary to check first.
    #[arg(long, value_name = "PATH", env = "QEMU_BIN")]
    pub qemu: Option<PathBuf>,
}

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine for umdev.
    Ok,
    /// Works, with a limit or a risk worth knowing.
    Warn,
    /// umdev cannot do this here.
    Missing,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Missing => "missing",
        }
    }
}

/// One finding.
#[derive(Debug, Serialize)]
pub struct Finding {
    /// Stable name of the check.
    pub name: &'static str,
    /// The outcome.
    pub status: Status,
    /// Whether a `missing` makes the exit code 1.
    pub required: bool,
    /// What was found.
    pub detail: String,
    /// What to do, when not ok.
    pub fix: Option<String>,
    /// The numbers and paths behind it (names stable per check).
    pub values: serde_json::Map<String, serde_json::Value>,
}

impl Finding {
    fn new(name: &'static str, required: bool, status: Status, detail: impl Into<String>) -> Self {
        Finding {
            name,
            status,
            required,
            detail: detail.into(),
            fix: None,
            values: serde_json::Map::new(),
        }
    }

    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }

    fn value(mut self, key: &str, v: impl Into<serde_json::Value>) -> Self {
        self.values.insert(key.to_string(), v.into());
        self
    }
}

#[derive(Serialize)]
struct Report<'a> {
    ok: bool,
    missing: Vec<&'static str>,
    checks: &'a [Finding],
}

/// Entry point.
pub fn run(args: CheckArgs) -> CliResult {
    let findings = findings(&args);
    let missing: Vec<&'static str> = findings
        .iter()
        .filter(|f| f.required && f.status == Status::Missing)
        .map(|f| f.name)
        .collect();
    if args.json {
        let report = Report {
            ok: missing.is_empty(),
            missing: missing.clone(),
            checks: &findings,
        };
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        for f in &findings {
            let mut line = format!("{:<8}{:<15}{}", f.status.label(), f.name, f.detail);
            if let Some(fix) = &f.fix {
                line.push_str(" -> ");
                line.push_str(fix);
            }
            println!("{line}");
        }
        if missing.is_empty() {
            println!("nothing required is missing");
        } else {
            println!("missing (required): {}", missing.join(", "));
        }
    }
    if !missing.is_empty() {
        use std::io::Write;
        // exit() runs no destructors: what was printed must be out first.
        std::io::stdout().flush()?;
        std::process::exit(1);
    }
    Ok(())
}

fn findings(args: &CheckArgs) -> Vec<Finding> {
    let (state_dir, socket_dir, control) = dirs::resolve(args);
    vec![
        host::memlock(),
        host::max_map_count(args.max_instances),
        host::hugepages(),
        host::dev_shm(),
        qemu::check(args.qemu.as_deref()),
        dirs::private_dir("state-dir", &state_dir),
        dirs::private_dir("socket-dir", &socket_dir),
        dirs::other_daemon(&state_dir, &control),
    ]
}

/// `n` bytes for a human: KiB/MiB/GiB when exact enough.
fn bytes(n: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if n >= size && n.is_multiple_of((size / 16).max(1)) {
            let v = n as f64 / size as f64;
            return if n.is_multiple_of(size) {
                format!("{} {unit}", n / size)
            } else {
                format!("{v:.1} {unit}")
            };
        }
    }
    format!("{n} bytes")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_bytes_exact_units_and_fallback() {
        assert_eq!(bytes(8 << 20), "8 MiB");
        assert_eq!(bytes(64 << 10), "64 KiB");
        assert_eq!(bytes(3 << 29), "1.5 GiB");
        assert_eq!(bytes(1000), "1000 bytes");
    }
}
