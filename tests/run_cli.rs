//! `umdev run` as a user runs it: serves until SIGINT, socket mode 0600, logs connects.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umdev::testing::{DeviceAccess, Vmm};

fn wait_for(path: &std::path::Path) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "socket {} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Start `umdev run gpu` with `RUST_LOG=rust_log` and stderr on a pipe, read the GPU's ID
/// register through the embedded VMM, stop it with SIGINT; returns whether it exited
/// successfully and what it logged.
fn serve_read_id_and_interrupt(rust_log: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("gpu.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["run", "gpu", "--socket"])
        .arg(&sock)
        .env("RUST_LOG", rust_log)
        .env_remove("NO_COLOR")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&sock);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "default socket mode");

    let mut vmm = Vmm::connect(&sock)
        .and_then(|v| v.with_ram(1 << 30, 1 << 20))
        .unwrap();
    assert_eq!(vmm.read32(0, 0).unwrap(), u32::from_le_bytes(*b"UGPU"));
    drop(vmm);

    // SAFETY: sending SIGINT to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    assert!(!sock.exists(), "socket removed on shutdown");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn test_run_gpu_serves_until_sigint_and_logs_connects() {
    let (ok, log) = serve_read_id_and_interrupt("info");
    assert!(ok, "umdev run failed: {log}");
    assert!(log.contains("client connected"), "{log}");
    assert!(log.contains("client disconnected"), "{log}");
}

#[test]
fn test_run_log_to_pipe_has_no_colour_codes_and_debug_lists_region_reads() {
    let (ok, log) = serve_read_id_and_interrupt("debug");
    assert!(ok, "umdev run failed: {log}");
    assert!(
        !log.contains('\x1b'),
        "log written to a pipe carries ANSI escape codes: {log:?}"
    );
    // --help promises one line per vfio-user message at debug level, REGION_READ included.
    let reads = log
        .lines()
        .filter(|l| l.contains("cmd=\"REGION_READ\"") && l.contains("done"))
        .count();
    assert!(reads >= 1, "no debug line for a REGION_READ: {log}");
    let versions = log
        .lines()
        .filter(|l| l.contains("cmd=\"VERSION\"") && l.contains("done"))
        .count();
    assert_eq!(versions, 1, "one line for the one VERSION message: {log}");
}

#[test]
fn test_run_rejects_bad_socket_mode() {
    let out = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args([
            "run",
            "gpu",
            "--socket",
            "/tmp/x.sock",
            "--socket-mode",
            "999",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("octal"));
}

#[test]
fn test_run_nvme_creates_image_serves_nvme_class_and_stops_on_sigint() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nvme.sock");
    let image = dir.path().join("disk.img");
    let child = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["run", "nvme", "--size", "8M", "--io-queues", "2", "--image"])
        .arg(&image)
        .arg("--socket")
        .arg(&sock)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&sock);
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 8 << 20);
    let mut vmm = Vmm::connect(&sock).unwrap();
    assert_eq!(
        vmm.read32(7, 0x08).unwrap() >> 8,
        0x01_08_02,
        "NVMe class code"
    );
    assert_eq!(vmm.read32(0, 0x08).unwrap(), 0x0001_0400, "VS 1.4");
    drop(vmm);
    // SAFETY: sending SIGINT to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{log}");
}

#[test]
fn test_run_nvme_without_image_or_size_explains() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["run", "nvme", "--socket"])
        .arg(dir.path().join("s.sock"))
        .arg("--image")
        .arg(dir.path().join("missing.img"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--size"));
    let out = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["run", "nvme", "--socket", "/tmp/x.sock", "--size", "12Q"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("suffix"));
    let out = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["run", "nvme", "--socket", "/tmp/x.sock", "--size", "1M"])
        .args(["--serial", "has space"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("printable ASCII"));
}

/// Two controllers on two images log two serial numbers (a guest with both must never see
/// one subsystem), each stable for its image; `--serial` overrides.
#[test]
fn test_run_nvme_serial_differs_per_image_and_follows_flag() {
    let dir = tempfile::tempdir().unwrap();
    let serial_of = |image: &str, extra: &[&str]| {
        let sock = dir.path().join(format!("{image}.sock"));
        let child = Command::new(env!("CARGO_BIN_EXE_umdev"))
            .args(["run", "nvme", "--size", "1M", "--image"])
            .arg(dir.path().join(image))
            .arg("--socket")
            .arg(&sock)
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_for(&sock);
        // SAFETY: sending SIGINT to our own child process.
        assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
        let out = child.wait_with_output().unwrap();
        let log = String::from_utf8_lossy(&out.stderr).into_owned();
        let at = log.find("serial=").expect(&log) + "serial=".len();
        log[at..].split_whitespace().next().unwrap().to_string()
    };
    let a = serial_of("a.img", &[]);
    let b = serial_of("b.img", &[]);
    assert_ne!(a, b);
    assert!(a.starts_with("UMDEV"), "{a}");
    assert_eq!(serial_of("a.img", &[]), a);
    assert_eq!(serial_of("a.img", &["--serial", "MYDISK7"]), "MYDISK7");
}
