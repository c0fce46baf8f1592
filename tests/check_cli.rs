//! `umdev check`, `umdev completions` and `umdev man` as an admin runs them: the real
//! binary, with a fake QEMU, temp directories and lowered limits that make each check come
//! out one way.

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

#[path = "common/daemon.rs"]
mod daemon;

const BIN: &str = env!("CARGO_BIN_EXE_umdev");

const NAMES: [&str; 8] = [
    "memlock",
    "max-map-count",
    "hugepages",
    "dev-shm",
    "qemu",
    "state-dir",
    "socket-dir",
    "daemon",
];

/// A temp dir with a private state and socket directory, an empty PATH and cache, so that
/// only the QEMU a test writes is found.
struct Host {
    dir: tempfile::TempDir,
}

impl Host {
    fn new() -> Host {
        let dir = tempfile::tempdir().unwrap();
        for d in ["state", "sockets", "path", "cache"] {
            fs::create_dir(dir.path().join(d)).unwrap();
            fs::set_permissions(dir.path().join(d), fs::Permissions::from_mode(0o700)).unwrap();
        }
        Host { dir }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// Write an executable shell script `name` in the temp dir.
    fn script(&self, name: &str, body: &str) -> PathBuf {
        let p = self.path(name);
        fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    /// A fake QEMU answering `--version` with `version` and `-device help` with `devices`.
    fn qemu(&self, version: &str, devices: &str) -> PathBuf {
        self.script(
            "qemu",
            &format!(
                "case \"$1\" in --version) echo 'QEMU emulator version {version}';; \
                 *) echo '{devices}';; esac"
            ),
        )
    }

    fn command(&self, qemu: Option<&Path>) -> Command {
        self.command_with_state(qemu, &self.path("state"))
    }

    fn command_with_state(&self, qemu: Option<&Path>, state: &Path) -> Command {
        let mut c = Command::new(BIN);
        c.arg("check")
            .arg("--state-dir")
            .arg(state)
            .arg("--socket-dir")
            .arg(self.path("sockets"))
            .env("PATH", self.path("path"))
            .env("UMDEV_CACHE_DIR", self.path("cache"))
            .env_remove("UMDEV_CONTROL")
            .env_remove("QEMU_BIN");
        if let Some(q) = qemu {
            c.env("QEMU_BIN", q);
        }
        c
    }
}

const GOOD_DEVICES: &str = "name \"vfio-user-pci\", bus PCI, desc \"VFIO over socket PCI\"";

fn json(mut c: Command) -> (Output, Value) {
    let out = c.arg("--json").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let v: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {stdout}\nstderr: {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (out, v)
}

fn find<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name} in {v}"))
}

#[test]
fn test_check_json_shape_stable_names_and_fields() {
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    let (out, v) = json(host.command(Some(&q)));
    let checks = v["checks"].as_array().unwrap();
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert_eq!(names, NAMES);
    for c in checks {
        let obj = c.as_object().unwrap();
        let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
        keys.sort();
        assert_eq!(
            keys,
            ["detail", "fix", "name", "required", "status", "values"],
            "{c}"
        );
        assert!(["ok", "warn", "missing"].contains(&c["status"].as_str().unwrap()));
        assert!(!c["detail"].as_str().unwrap().is_empty());
        // A fix exactly when something is not ok.
        assert_eq!(c["fix"].is_null(), c["status"] == "ok", "{c}");
        assert!(c["values"].is_object());
    }
    let required: Vec<&str> = checks
        .iter()
        .filter(|c| c["required"] == true)
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(required, ["qemu", "state-dir", "socket-dir"]);
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["missing"], serde_json::json!([]));
    assert_eq!(out.status.code(), Some(0));
    let mm = find(&v, "max-map-count")["values"].clone();
    assert!(mm["pool_maps"].as_u64().unwrap() > 0, "{mm}");
    assert_eq!(
        mm["pool_maps"].as_u64(),
        Some(umdev::dma::capacity_for(
            mm["max_map_count"].as_u64().unwrap()
        ))
    );
}

#[test]
fn test_check_good_fake_qemu_found_exit_0_text_one_line_each() {
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    let out = host.command(Some(&q)).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), NAMES.len() + 1, "{text}");
    for (line, name) in lines.iter().zip(NAMES) {
        let mut words = line.split_whitespace();
        let status = words.next().unwrap();
        assert!(["ok", "warn", "missing"].contains(&status), "{line}");
        assert_eq!(words.next(), Some(name), "{line}");
    }
    assert!(
        lines[4].starts_with("ok") && lines[4].contains("QEMU 10.1.0"),
        "{}",
        lines[4]
    );
    assert_eq!(lines[NAMES.len()], "nothing required is missing");
}

#[test]
fn test_check_old_qemu_missing_exit_1_names_it() {
    let host = Host::new();
    let q = host.qemu("8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)", GOOD_DEVICES);
    let (out, v) = json(host.command(Some(&q)));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(v["ok"], false);
    assert_eq!(v["missing"], serde_json::json!(["qemu"]));
    let qemu = find(&v, "qemu");
    assert_eq!(qemu["status"], "missing");
    let detail = qemu["detail"].as_str().unwrap();
    assert!(detail.contains("QEMU 8.2 (< 10.1"), "{detail}");
    assert!(qemu["fix"].as_str().unwrap().contains("QEMU_BIN"));
}

#[test]
fn test_check_new_qemu_without_vfio_user_pci_missing() {
    let host = Host::new();
    let q = host.qemu("10.2.0", "name \"vfio-pci\", bus PCI");
    let (out, v) = json(host.command(Some(&q)));
    assert_eq!(out.status.code(), Some(1));
    let detail = find(&v, "qemu")["detail"].as_str().unwrap().to_string();
    assert!(detail.contains("built without vfio-user-pci"), "{detail}");
}

#[test]
fn test_check_qemu_from_cache_dir_when_path_has_none() {
    let host = Host::new();
    let bin = host.path("cache/qemu-10.2.2/bin");
    fs::create_dir_all(&bin).unwrap();
    let q = host.qemu("10.2.2", GOOD_DEVICES);
    fs::rename(&q, bin.join("qemu-system-x86_64")).unwrap();
    let (out, v) = json(host.command(None));
    assert_eq!(out.status.code(), Some(0), "{v}");
    let qemu = find(&v, "qemu");
    assert_eq!(
        qemu["values"]["path"].as_str(),
        Some(bin.join("qemu-system-x86_64").to_str().unwrap())
    );
}

#[test]
fn test_check_bad_qemu_bin_falls_through_to_cache_and_says_so() {
    let host = Host::new();
    let bin = host.path("cache/qemu-10.2.2/bin");
    fs::create_dir_all(&bin).unwrap();
    let good = host.qemu("10.2.2", GOOD_DEVICES);
    fs::rename(&good, bin.join("qemu-system-x86_64")).unwrap();
    let old = host.script("old-qemu", "echo 'QEMU emulator version 9.2.0'");
    let (out, v) = json(host.command(Some(&old)));
    assert_eq!(out.status.code(), Some(0), "{v}");
    let qemu = find(&v, "qemu");
    let detail = qemu["detail"].as_str().unwrap();
    assert!(
        detail.contains("not used:") && detail.contains("QEMU 9.2"),
        "{detail}"
    );
    assert_eq!(qemu["values"]["tried"].as_array().unwrap().len(), 2);
}

#[test]
fn test_check_no_qemu_anywhere_missing() {
    let host = Host::new();
    let (out, v) = json(host.command(None));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(find(&v, "qemu")["values"]["tried"], serde_json::json!([]));
}

#[test]
fn test_check_hanging_qemu_times_out_not_hangs() {
    let host = Host::new();
    let q = host.script("qemu", "PATH=/usr/bin:/bin exec sleep 60");
    let start = std::time::Instant::now();
    let (out, v) = json(host.command(Some(&q)));
    assert!(start.elapsed() < std::time::Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(1));
    let detail = find(&v, "qemu")["detail"].as_str().unwrap().to_string();
    assert!(detail.contains("did not finish"), "{detail}");
}

#[test]
fn test_check_world_writable_state_dir_missing_with_chmod_fix() {
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    fs::set_permissions(host.path("state"), fs::Permissions::from_mode(0o777)).unwrap();
    let (out, v) = json(host.command(Some(&q)));
    assert_eq!(out.status.code(), Some(1), "{v}");
    assert_eq!(v["missing"], serde_json::json!(["state-dir"]));
    let s = find(&v, "state-dir");
    assert_eq!(s["status"], "missing");
    assert_eq!(s["values"]["mode"], "777");
    assert!(s["detail"].as_str().unwrap().contains("mode 777"));
    assert!(s["fix"].as_str().unwrap().contains("chmod 700"));
    // What the daemon says of the same directory: it refuses to start.
    let d = Command::new(BIN)
        .arg("daemon")
        .arg("--state-dir")
        .arg(host.path("state"))
        .arg("--socket-dir")
        .arg(host.path("sockets"))
        .output()
        .unwrap();
    assert!(!d.status.success());
    assert!(String::from_utf8_lossy(&d.stderr).contains("not private"));
}

#[test]
fn test_check_missing_dirs_ok_and_not_created() {
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    let state = host.path("new/state");
    let (out, v) = json(host.command_with_state(Some(&q), &state));
    assert_eq!(out.status.code(), Some(0), "{v}");
    let s = find(&v, "state-dir");
    assert_eq!(s["status"], "ok");
    assert_eq!(s["values"]["exists"], false);
    assert!(!host.path("new").exists(), "check created a directory");
}

#[test]
fn test_check_relative_dirs_taken_from_working_directory() {
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    let mut c = host.command_with_state(Some(&q), Path::new("state"));
    c.current_dir(host.dir.path());
    let (out, v) = json(c);
    assert_eq!(out.status.code(), Some(0), "{v}");
    let s = find(&v, "state-dir");
    assert_eq!(s["values"]["exists"], true, "{s}");
    assert_eq!(
        s["values"]["path"].as_str(),
        Some(host.path("state").to_str().unwrap())
    );
}

#[test]
fn test_check_dir_of_another_user_missing() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: chown to another user needs root");
        return;
    }
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    std::os::unix::fs::chown(host.path("sockets"), Some(65534), None).unwrap();
    let (out, v) = json(host.command(Some(&q)));
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(v["missing"], serde_json::json!(["socket-dir"]));
    let s = find(&v, "socket-dir");
    assert_eq!(s["values"]["owner_uid"], 65534);
    assert!(s["detail"]
        .as_str()
        .unwrap()
        .contains("belongs to uid 65534"));
}

/// Run the check with RLIMIT_MEMLOCK set to `bytes` (soft and hard) in the child; `None`
/// if the limit could not be set (raising it needs CAP_SYS_RESOURCE).
fn with_memlock(host: &Host, q: &Path, bytes: u64) -> Option<Value> {
    let mut c = host.command(Some(q));
    c.arg("--json");
    // SAFETY: the closure only calls setrlimit (async-signal-safe) between fork and exec.
    unsafe {
        c.pre_exec(move || {
            let rl = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &rl) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = c.output().ok()?;
    assert_eq!(out.status.code(), Some(0), "memlock is not required");
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

#[test]
fn test_check_low_memlock_warns_high_is_ok() {
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    let v = with_memlock(&host, &q, 64 << 10).expect("lowering a limit always works");
    let m = find(&v, "memlock");
    assert_eq!(m["status"], "warn", "{m}");
    assert_eq!(m["values"]["soft_bytes"], 64 << 10);
    assert_eq!(m["values"]["needed_bytes"], 17 << 20);
    assert!(m["fix"].as_str().unwrap().contains("ulimit -l 17408"));
    match with_memlock(&host, &q, 64 << 20) {
        Some(v) => assert_eq!(find(&v, "memlock")["status"], "ok"),
        None => eprintln!("skipped the ok half: cannot raise RLIMIT_MEMLOCK here"),
    }
}

#[test]
fn test_check_live_daemon_seen_on_its_state_dir() {
    let d = daemon::Daemon::start(&[]);
    let out = Command::new(BIN)
        .args(["check", "--json", "--state-dir"])
        .arg(d.state())
        .arg("--socket-dir")
        .arg(d.sockets())
        .env_remove("UMDEV_CONTROL")
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let c = find(&v, "daemon");
    assert_eq!(c["status"], "ok", "{c}");
    assert_eq!(c["values"]["lock_held"], true);
    assert_eq!(c["values"]["control_answers"], true);
    assert!(c["detail"].as_str().unwrap().contains("a daemon serves"));
}

#[test]
fn test_check_lock_held_control_dead_warns() {
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    let lock = fs::File::create(host.path("state/daemon.lock")).unwrap();
    // SAFETY: flock on a descriptor we own; it changes no memory.
    let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    assert_eq!(rc, 0);
    let (_, v) = json(host.command(Some(&q)));
    let c = find(&v, "daemon");
    assert_eq!(c["status"], "warn", "{c}");
    assert_eq!(c["values"]["lock_held"], true);
    assert_eq!(c["values"]["control_answers"], false);
    drop(lock);
    // Released: no daemon, and something listening on the control socket alone warns.
    let _listener =
        std::os::unix::net::UnixListener::bind(host.path("sockets/control.sock")).unwrap();
    let (_, v) = json(host.command(Some(&q)));
    let c = find(&v, "daemon");
    assert_eq!(c["status"], "warn", "{c}");
    assert_eq!(c["values"]["lock_held"], false);
    assert_eq!(c["values"]["control_answers"], true);
}

#[test]
fn test_check_no_daemon_ok() {
    let host = Host::new();
    let q = host.qemu("10.1.0", GOOD_DEVICES);
    let (_, v) = json(host.command(Some(&q)));
    let c = find(&v, "daemon");
    assert_eq!(c["status"], "ok", "{c}");
    assert_eq!(c["values"]["lock_held"], false);
    assert_eq!(c["values"]["control_answers"], false);
}

#[test]
fn test_check_help_says_which_checks_are_required() {
    let out = Command::new(BIN)
        .args(["check", "--help"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for name in NAMES {
        assert!(text.contains(name), "{name} not in --help");
    }
    let line = |name: &str| {
        text.lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no line for {name} in {text}"))
            .to_string()
    };
    for name in NAMES {
        let required = ["qemu", "state-dir", "socket-dir"].contains(&name);
        assert_eq!(
            line(name).contains("[required]"),
            required,
            "{}",
            line(name)
        );
    }
    assert!(text.contains("Exit code: 0 when no required check is missing, 1 otherwise"));
}

const SUBCOMMANDS: [&str; 8] = [
    "run",
    "daemon",
    "types",
    "create",
    "migrate",
    "check",
    "completions",
    "man",
];

#[test]
fn test_completions_every_shell_names_the_subcommands() {
    for shell in ["bash", "zsh", "fish", "elvish", "powershell"] {
        let out = Command::new(BIN)
            .args(["completions", shell])
            .output()
            .unwrap();
        assert!(out.status.success(), "{shell}");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.len() > 1000, "{shell}: {} bytes", text.len());
        for sub in SUBCOMMANDS {
            assert!(text.contains(sub), "{shell}: no {sub}");
        }
    }
    let bad = Command::new(BIN)
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("possible values"));
}

#[test]
fn test_completions_bash_script_is_valid_bash() {
    let out = Command::new(BIN)
        .args(["completions", "bash"])
        .output()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("umdev.bash");
    fs::write(&f, &out.stdout).unwrap();
    let check = Command::new("bash").arg("-n").arg(&f).output().unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
}

fn have_man() -> bool {
    Command::new("sh")
        .args(["-c", "command -v man"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `man -l FILE` renders it without an error (troff's line-breaking warnings at this
/// width, for long example lines, are not errors and man does not show them by default).
fn assert_man_parses(page: &Path) {
    let out = Command::new("man")
        .arg("-l")
        .arg(page)
        .env("MANPAGER", "cat")
        .env("MANWIDTH", "80")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {stderr}", page.display());
    let layout = |l: &str| l.contains("cannot adjust line") || l.contains("can't break line");
    assert!(stderr.lines().all(layout), "{}: {stderr}", page.display());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("NAME"), "{}: {text}", page.display());
}

#[test]
fn test_man_stdout_is_roff_listing_subcommands() {
    let out = Command::new(BIN).arg("man").output().unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with(".ie") || text.contains(".TH umdev 1"),
        "{text}"
    );
    for sub in SUBCOMMANDS {
        assert!(text.contains(&format!("umdev\\-{sub}")), "no umdev-{sub}");
    }
    if !have_man() {
        eprintln!("skipped rendering: no man here");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("umdev.1");
    fs::write(&page, &out.stdout).unwrap();
    assert_man_parses(&page);
}

#[test]
fn test_man_out_dir_one_page_per_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("man/man1");
    let out = Command::new(BIN)
        .args(["man", "--out-dir"])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(out.stdout.is_empty());
    let mut pages = vec!["umdev.1".to_string()];
    pages.extend(SUBCOMMANDS.iter().map(|s| format!("umdev-{s}.1")));
    for p in &pages {
        let path = out_dir.join(p);
        assert!(path.is_file(), "no {p}");
        if have_man() {
            assert_man_parses(&path);
        }
    }
    // A file where the directory should be: an error naming it, no panic.
    let blocker = dir.path().join("file");
    fs::write(&blocker, "x").unwrap();
    let out = Command::new(BIN)
        .args(["man", "--out-dir"])
        .arg(&blocker)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot write the man pages into"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}
