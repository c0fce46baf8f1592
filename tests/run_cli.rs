//! `umdev run` as a user runs it: serves until SIGINT, socket mode 0600, logs connects.

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use umdev_cli::vmm::Vmm;

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

#[test]
fn test_run_gpu_serves_until_sigint_and_logs_connects() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("gpu.sock");
    let child = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["run", "gpu", "--socket"])
        .arg(&sock)
        .env("RUST_LOG", "info")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&sock);
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "default socket mode");

    let mut vmm = Vmm::connect(&sock, 1 << 30, 1 << 20).unwrap();
    assert_eq!(vmm.read32(0, 0).unwrap(), u32::from_le_bytes(*b"UGPU"));
    drop(vmm);

    // SAFETY: sending SIGINT to our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "umdev run exited with {:?}: {log}",
        out.status
    );
    assert!(log.contains("client connected"), "{log}");
    assert!(log.contains("client disconnected"), "{log}");
    assert!(!sock.exists(), "socket removed on shutdown");
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
