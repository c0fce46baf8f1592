//! Which files a client may DMA_MAP: only memory whose page faults no client can stall
//! (memfd, shmem/tmpfs, hugetlbfs); anything else is refused with EPERM unless the server is
//! configured with `allow_any_file_maps`. A file on a disk filesystem stands in for the
//! FUSE file whose never-answered READ would stall a device thread copying through it.

mod common;

use std::os::fd::AsRawFd;

use common::TestServer;
use umdev::protocol::dma_map::DmaMapRequest;
use umdev::protocol::Command;
use umdev::testing::{memfd, RawClient};

const EPERM: u32 = libc::EPERM as u32;

fn map(iova: u64) -> Vec<u8> {
    DmaMapRequest {
        flags: 3,
        offset: 0,
        iova,
        size: 0x10000,
    }
    .encode()
}

/// A 64 KiB file on the disk the build runs on (not tmpfs), or None if it is tmpfs here.
fn disk_file() -> Option<std::fs::File> {
    let f = tempfile::tempfile_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    f.set_len(0x10000).unwrap();
    // SAFETY: a zeroed struct fstatfs fills; the fd is valid.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fstatfs(f.as_raw_fd(), &mut fs) }, 0);
    if fs.f_type == libc::TMPFS_MAGIC {
        eprintln!("SKIPPED: the target directory is on tmpfs here");
        return None;
    }
    Some(f)
}

#[test]
fn test_dma_map_disk_file_refused_eperm_memfd_accepted() {
    let Some(disk) = disk_file() else { return };
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let cmd = Command::DmaMap as u16;
    assert_eq!(
        c.expect_error(cmd, &map(0x10_0000), &[disk.as_raw_fd()]),
        EPERM,
        "a file on a disk filesystem is refused"
    );
    assert_eq!(ts.dma().stats().maps, 0, "nothing was mapped");
    let mem = memfd(0x10000).unwrap();
    let r = c.call(cmd, 0, &map(0x10_0000), &[mem.as_raw_fd()]);
    assert!(
        !r.header.is_error(),
        "memfd accepted: errno {}",
        r.header.error
    );
    assert_eq!(ts.dma().stats().maps, 1);
    if let Ok(shm) = tempfile::tempfile_in("/dev/shm") {
        shm.set_len(0x10000).unwrap();
        let r = c.call(cmd, 0, &map(0x20_0000), &[shm.as_raw_fd()]);
        assert!(
            !r.header.is_error(),
            "/dev/shm file accepted: errno {}",
            r.header.error
        );
    }
}

#[test]
fn test_dma_map_disk_file_accepted_with_allow_any_file_maps() {
    let Some(disk) = disk_file() else { return };
    let ts = TestServer::start_with(|c| c.allow_any_file_maps = true);
    let mut c = RawClient::new_default(ts.path());
    let r = c.call(
        Command::DmaMap as u16,
        0,
        &map(0x10_0000),
        &[disk.as_raw_fd()],
    );
    assert!(!r.header.is_error(), "errno {}", r.header.error);
}
