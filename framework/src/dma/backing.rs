//! Which files an fd-backed DMA_MAP may map: memory whose page faults no client can stall.
//!
//! Device threads copy through DMA mappings and pins of them, and some of those threads
//! serve several instances (the GPU parent's one render engine). A page fault on a mapping
//! is answered by the file's filesystem. For shmem (memfd, tmpfs, `/dev/shm`) and hugetlbfs
//! that is the kernel's own memory, which answers at once. For anything else someone else
//! may answer, or never: a FUSE daemon that does not reply to READ stops the faulting
//! thread, and with it every instance that thread serves; NFS, a block device behind a slow
//! or hostile target, a device file's driver, likewise. So a mapping's fd must be a
//! **regular file on tmpfs or hugetlbfs** (`fstat` S_IFREG, `fstatfs` `TMPFS_MAGIC` or
//! `HUGETLBFS_MAGIC`; a memfd is such a file, also with `MFD_HUGETLB`). Anything else is
//! refused with [`DmaError::BackingRefused`] (EPERM: the request is well formed; the
//! server's policy does not permit it, and the same request succeeds with the opt-in
//! below), before it is mmap'd.
//!
//! QEMU's memory backends pass: `memory-backend-memfd`, `memory-backend-file` with
//! `mem-path` on `/dev/shm` or a hugetlbfs mount, `memory-backend-ram,share=on` (a memfd or
//! shm file). `memory-backend-file` on ext4/xfs (e.g. emulated persistent memory) and
//! libvfio-user's sample client (a file in `/tmp`, which is not tmpfs on every host) are
//! refused unless the server is configured with `allow_any_file_maps` — for clients that
//! are trusted not to stall their own page faults, on a server whose threads do not serve
//! other clients' instances.

use std::os::fd::{AsRawFd, BorrowedFd};

use super::DmaError;

/// A few filesystem magics by name, for the refusal message.
fn fs_name(magic: i64) -> &'static str {
    match magic {
        0xef53 => "ext2/3/4",
        0x5846_5342 => "xfs",
        0x9123_683e => "btrfs",
        0x6573_5546 => "FUSE",
        0x6969 => "NFS",
        0x794c_7630 => "overlayfs",
        0x5050_4552 => "pipefs",
        0x534f_434b => "sockfs",
        0x0904_1934 => "anon_inode",
        0x6265_6572 => "sysfs",
        0x9fa0 => "procfs",
        _ => "an unsupported filesystem",
    }
}

/// Refuse `fd` unless it is a regular file on tmpfs/hugetlbfs or `allow_any` is set.
pub(crate) fn check_backing(fd: BorrowedFd<'_>, allow_any: bool) -> Result<(), DmaError> {
    if allow_any {
        return Ok(());
    }
    // SAFETY: fstat/fstatfs write into the zeroed structs we pass; the fd is valid (borrowed).
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(DmaError::Mmap(std::io::Error::last_os_error()));
    }
    // SAFETY: as above.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut fs) } != 0 {
        return Err(DmaError::Mmap(std::io::Error::last_os_error()));
    }
    let memory = fs.f_type == libc::TMPFS_MAGIC || fs.f_type == libc::HUGETLBFS_MAGIC;
    let regular = st.st_mode & libc::S_IFMT == libc::S_IFREG;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    let magic = fs.f_type as i64;
    if regular && memory {
        return Ok(());
    }
    let what = if memory {
        "not a regular file"
    } else {
        fs_name(magic)
    };
    tracing::warn!(
        fs_magic = format_args!("{magic:#x}"),
        regular,
        "DMA_MAP fd refused: {what}"
    );
    Err(DmaError::BackingRefused { what, magic })
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, FromRawFd, OwnedFd};

    use super::*;

    fn memfd(flags: libc::c_uint) -> Option<OwnedFd> {
        // SAFETY: a NUL-terminated literal name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"umdev-backing-test".as_ptr(), flags) };
        // SAFETY: a fresh descriptor nobody else owns.
        (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
    }

    #[test]
    fn test_backing_memfd_and_shm_file_accepted() {
        let m = memfd(libc::MFD_CLOEXEC).unwrap();
        check_backing(m.as_fd(), false).unwrap();
        if let Some(h) = memfd(libc::MFD_CLOEXEC | libc::MFD_HUGETLB) {
            check_backing(h.as_fd(), false).unwrap();
        } else {
            eprintln!("SKIPPED hugetlb memfd: no huge pages here");
        }
        if let Ok(f) = tempfile::tempfile_in("/dev/shm") {
            check_backing(f.as_fd(), false).unwrap();
        }
    }

    #[test]
    fn test_backing_pipe_and_non_memory_file_refused_with_eperm_unless_allowed() {
        let mut p = [0; 2];
        // SAFETY: `p` has room for the two fds pipe writes.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        // SAFETY: fresh descriptors nobody else owns.
        let (r, _w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
        let e = check_backing(r.as_fd(), false).unwrap_err();
        assert_eq!(e.errno(), libc::EPERM);
        let msg = e.to_string();
        assert!(msg.contains("memfd") && msg.contains("hugetlbfs"), "{msg}");
        assert!(msg.contains("allow_any_file_maps"), "{msg}");
        check_backing(r.as_fd(), true).unwrap();
        // The crate's own directory lives on the build machine's disk, not on tmpfs.
        let f = tempfile::tempfile_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        // SAFETY: a zeroed struct fstatfs fills.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: valid fd and struct.
        assert_eq!(unsafe { libc::fstatfs(f.as_raw_fd(), &mut fs) }, 0);
        if fs.f_type == libc::TMPFS_MAGIC {
            eprintln!("SKIPPED disk-file part: the build directory is on tmpfs");
            return;
        }
        assert_eq!(
            check_backing(f.as_fd(), false).unwrap_err().errno(),
            libc::EPERM
        );
        check_backing(f.as_fd(), true).unwrap();
    }
}
