//! A hostile client that shrinks its memfd after DMA_MAP: the next device access to the
//! vanished pages must not kill the server (it used to, with SIGBUS). The scenario runs in
//! a child process so that a regression is observed, not suffered.

mod dma_util;

use std::os::fd::AsRawFd;
use std::process::Command;

use umdev::dma::{DmaConfig, DmaMapping, DmaSpace, Prot};

const CHILD_ENV: &str = "UMDEV_SIGBUS_CHILD";

/// The scenario: map, shrink the file behind umdev's back, then copy from the range.
fn scenario() {
    let space = DmaSpace::new(DmaConfig::default());
    let fd = dma_util::memfd(0x10000);
    space
        .map(DmaMapping {
            iova: 0x10_0000,
            size: 0x10000,
            prot: Prot::RW,
            fd: Some(fd.try_clone().unwrap()),
            offset: 0,
        })
        .unwrap();
    // SAFETY: ftruncate on our own fd; this is the hostile client's move.
    assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), 0) }, 0);
    let mut buf = [0xffu8; 16];
    // An error is fine; dying is not. (Today: the vanished page reads as zeros.)
    let h = space.handle();
    let _ = h.read(0x10_0000, &mut buf);
    assert!(buf == [0; 16] || buf == [0xff; 16], "{buf:?}");
    let _ = h.write(0x10_0000, &buf);
    // Pinned host addresses too (a device writing through its pin).
    let host = h.pin_range(0x100, 2, Prot::RW).unwrap();
    // SAFETY: pinned just above, unpinned below.
    let slice = unsafe { h.pinned_slice(host, 2 * 4096) };
    vm_memory::Bytes::write_obj(&slice, 0x55u8, 4096 + 7).unwrap();
    h.unpin_range(0x100, 2).unwrap();
    space.unmap(0x10_0000, 0x10000, &mut |_, _| {}).unwrap();
    space.check_invariants().unwrap();
}

#[test]
fn test_sigbus_client_shrinks_mapped_memfd_server_survives() {
    if std::env::var_os(CHILD_ENV).is_some() {
        scenario();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args([
            "--exact",
            "test_sigbus_client_shrinks_mapped_memfd_server_survives",
            "--nocapture",
        ])
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "the server process died: {:?}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}
