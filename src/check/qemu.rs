//! A QEMU ≥ 10.1 with `vfio-user-pci`, looked for where `scripts/qemu.sh` looks: `$QEMU_BIN`
//! (or `--qemu`), `qemu-system-x86_64` on PATH, then its cache
//! (`$UMDEV_CACHE_DIR`, default `${XDG_CACHE_HOME:-~/.cache}/umdev`, `qemu-*/bin/`).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::{Finding, Status};

const BINARY: &str = "qemu-system-x86_64";
/// How long one QEMU invocation may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// The candidates, in lookup order, without duplicates.
fn candidates(explicit: Option<&Path>) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    if let Some(p) = explicit {
        out.push(p.to_path_buf());
    }
    if let Some(path) = std::env::var_os("PATH") {
        if let Some(p) = std::env::split_paths(&path)
            .map(|d| d.join(BINARY))
            .find(|p| p.is_file())
        {
            out.push(p);
        }
    }
    let cache = std::env::var_os("UMDEV_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("umdev")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/umdev")));
    if let Some(cache) = cache {
        let mut cached: Vec<PathBuf> = std::fs::read_dir(&cache)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("qemu-"))
            .map(|e| e.path().join("bin").join(BINARY))
            .filter(|p| p.is_file())
            .collect();
        cached.sort();
        out.extend(cached);
    }
    let mut seen = Vec::new();
    out.retain(|p| {
        let key = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
        let new = !seen.contains(&key);
        seen.push(key);
        new
    });
    out
}

/// Run `bin args`, its stdout if it exits successfully within [`TIMEOUT`].
fn output(bin: &Path, args: &[&str]) -> Result<String, String> {
    let mut child = Command::new(bin)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run it: {e}"))?;
    let mut stdout = child.stdout.take().ok_or("no stdout pipe")?;
    let reader = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = stdout.read_to_end(&mut s);
        s
    });
    let deadline = Instant::now() + TIMEOUT;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "`{}` did not finish in {} s",
                    args.join(" "),
                    TIMEOUT.as_secs()
                ));
            }
            Err(e) => return Err(format!("waiting for it: {e}")),
        }
    };
    let out = reader.join().unwrap_or_default();
    if !status.success() {
        return Err(format!("`{}` failed ({status})", args.join(" ")));
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// `(major, minor)` of "QEMU emulator version 10.2.2 (...)".
fn parse_version(text: &str) -> Option<(u32, u32)> {
    let rest = text
        .lines()
        .find_map(|l| l.strip_prefix("QEMU emulator version "))?;
    let mut it = rest.split(|c: char| !c.is_ascii_digit());
    let major = it.next()?.parse().ok()?;
    let minor = it.next()?.parse().ok()?;
    Some((major, minor))
}

/// Why `bin` is not usable, or its version.
fn probe(bin: &Path) -> Result<String, String> {
    let text = output(bin, &["--version"])?;
    let (major, minor) =
        parse_version(&text).ok_or_else(|| "no \"QEMU emulator version\" line".to_string())?;
    if (major, minor) < (10, 1) {
        return Err(format!("QEMU {major}.{minor} (< 10.1: no vfio-user-pci)"));
    }
    let devices = output(bin, &["-nodefaults", "-machine", "none", "-device", "help"])?;
    if !devices.contains("\"vfio-user-pci\"") {
        return Err(format!("QEMU {major}.{minor} built without vfio-user-pci"));
    }
    let first = text.lines().next().unwrap_or_default();
    Ok(first
        .strip_prefix("QEMU emulator version ")
        .unwrap_or(first)
        .to_string())
}

/// The first usable candidate, or why none is.
pub fn check(explicit: Option<&Path>) -> Finding {
    let mut refused = Vec::new();
    let mut tried = Vec::new();
    for bin in candidates(explicit) {
        tried.push(serde_json::Value::from(bin.display().to_string()));
        match probe(&bin) {
            Ok(version) => {
                let mut detail = format!("{} is QEMU {version} with vfio-user-pci", bin.display());
                if !refused.is_empty() {
                    detail.push_str(&format!(" (not used: {})", refused.join("; ")));
                }
                return Finding::new("qemu", true, Status::Ok, detail)
                    .value("path", bin.display().to_string())
                    .value("version", version)
                    .value("tried", tried);
            }
            Err(why) => refused.push(format!("{}: {why}", bin.display())),
        }
    }
    let detail = if refused.is_empty() {
        format!("no {BINARY} in $QEMU_BIN, PATH or ~/.cache/umdev/qemu-*/bin")
    } else {
        format!("none usable ({})", refused.join("; "))
    };
    Finding::new("qemu", true, Status::Missing, detail)
        .fix("`scripts/qemu.sh qemu` builds QEMU 10.2.2 into the cache, or set QEMU_BIN")
        .value("path", serde_json::Value::Null)
        .value("version", serde_json::Value::Null)
        .value("tried", tried)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_version_real_and_garbage() {
        let t = "QEMU emulator version 10.2.2 (umdev-unplug-fix)\nCopyright";
        assert_eq!(parse_version(t), Some((10, 2)));
        assert_eq!(
            parse_version("QEMU emulator version 8.2.2 (Debian)"),
            Some((8, 2))
        );
        assert_eq!(parse_version("nothing"), None);
        assert_eq!(parse_version("QEMU emulator version x"), None);
    }
}
