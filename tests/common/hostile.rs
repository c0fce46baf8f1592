//! Helpers of the hostile-wire tests: counting fds and RSS of this process (the server runs
//! in-process), waiting for the server to settle, raw frames, and odd fds (pipes,
//! directories, read-only files) for clients that send the wrong thing.
#![allow(dead_code)]

use std::fs::File;
use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use umdev::dma::{DmaSpace, DmaStats};
use umdev::protocol::{Header, HEADER_SIZE};
pub use umdev::testing::open_fds;

/// Tests that count fds or RSS hold this lock so no other test of the same binary opens
/// or closes fds meanwhile.
pub static SERIAL: Mutex<()> = Mutex::new(());

/// Take [`SERIAL`] (a failed test does not poison the others).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn fd_list() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| {
            let target = std::fs::read_link(e.path())
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            format!("{}={}", e.file_name().to_string_lossy(), target)
        })
        .collect();
    v.sort();
    v
}

/// Wait (≤ 3 s) until the fd count is back to `baseline` (server threads close their fds
/// asynchronously after a disconnect); panic with the open fds if it is not.
pub fn settle_fds(baseline: usize, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let n = open_fds();
        if n == baseline {
            return;
        }
        if Instant::now() > deadline {
            panic!(
                "{what}: {n} fds open, expected {baseline}; open: {:?}",
                fd_list()
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Wait (≤ 3 s) until the DMA space holds `maps` mappings and no pin; return the stats.
pub fn settle_dma(dma: &DmaSpace, maps: u64, what: &str) -> DmaStats {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let s = dma.stats();
        if s.maps == maps && s.pinned_pages == 0 && s.locked_pages == 0 {
            return s;
        }
        if Instant::now() > deadline {
            panic!("{what}: DMA stats {s:?}, expected {maps} maps and no pins");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// VmRSS of this process in KiB.
pub fn rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

/// A 16-byte header with every field chosen by the caller (sizes may lie).
pub fn raw_header(msg_id: u16, command: u16, msg_size: u32, flags: u32) -> [u8; HEADER_SIZE] {
    Header {
        msg_id,
        command,
        msg_size,
        flags,
        error: 0,
    }
    .encode()
}

/// True if the peer closes `stream` within 3 s (reading and dropping whatever comes first).
pub fn closed_by_peer(stream: &UnixStream) -> bool {
    stream
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut s = stream;
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// Both ends of a pipe.
pub fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 writes two fds into the array on success (checked).
    let r = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) };
    assert_eq!(r, 0, "pipe2");
    // SAFETY: both fds are fresh and owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

/// A directory fd.
pub fn dir_fd(path: &std::path::Path) -> File {
    File::open(path).unwrap()
}

/// Threads of this process (from /proc/self/status).
pub fn thread_count() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("Threads in /proc/self/status")
}

/// Wait (≤ 3 s) until at most `n` threads run; return the count seen last.
pub fn settle_threads(n: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let t = thread_count();
        if t <= n || Instant::now() > deadline {
            return t;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}
