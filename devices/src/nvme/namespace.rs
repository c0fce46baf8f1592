//! The namespace: one raw image file, 512-byte logical blocks.
//!
//! Block `n` of namespace 1 is bytes `[512 n, 512 (n + 1))` of the image. Reads and writes
//! are `pread`/`pwrite` on a thread of the I/O pool (or on the submission queue's worker
//! without one), never on the connection thread; Flush is `fdatasync`; Write Zeroes and Dataset
//! Management's deallocate punch holes (`fallocate(PUNCH_HOLE)`), Write Zeroes falling
//! back to writing zeroes where the filesystem cannot punch. A host I/O error becomes an
//! NVMe status ([`io_status`]) and a log line at the caller.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::spec::Status;

/// Logical block size (LBA format 0: LBADS = 9).
pub const BLOCK_SIZE: u64 = 512;

/// Errors of opening the image.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The image could not be opened or created.
    #[error("cannot open image {path}")]
    Open {
        /// The image path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The image size could not be read or set.
    #[error("cannot size image {path}")]
    Size {
        /// The image path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
    /// The image (or the size asked for) holds less than one block.
    #[error("image {path} is smaller than one 512-byte block")]
    Empty {
        /// The image path.
        path: PathBuf,
    },
    /// The size asked for does not fit a file offset.
    #[error("image size {bytes} is too large")]
    TooLarge {
        /// The size asked for.
        bytes: u64,
    },
    /// O_DIRECT was asked for and the image's file system refuses it (tmpfs before
    /// Linux 6.6, for one).
    #[error(
        "image {path}: O_DIRECT is not supported by its file system (serve it without direct I/O)"
    )]
    Direct {
        /// The image path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Alignment of memory, file offset and length for a transfer through the O_DIRECT
/// descriptor (the strictest a host block device asks for); anything else goes through
/// the page cache.
pub const DIRECT_ALIGN: u64 = 4096;

/// The namespace's backing image.
#[derive(Debug)]
pub struct Namespace {
    file: File,
    /// The same image opened with O_DIRECT (`NvmeConfig::direct`).
    direct: Option<File>,
    blocks: u64,
}

impl Namespace {
    /// Open `path` (created if `size` is given and it does not exist). With `size`, a
    /// shorter image is grown sparsely to it and only its first `size` bytes are used;
    /// without, the namespace is the image's size in whole blocks.
    pub fn open(path: &Path, size: Option<u64>) -> Result<Namespace, ImageError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(size.is_some())
            .truncate(false)
            .open(path)
            .map_err(|source| ImageError::Open {
                path: path.to_owned(),
                source,
            })?;
        Namespace::from_file(file, path, size)
    }

    /// The namespace on `file`, already open for reading and writing (`path` only names
    /// it in errors); `size` as for [`Namespace::open`].
    pub fn from_file(file: File, path: &Path, size: Option<u64>) -> Result<Namespace, ImageError> {
        let size_err = |source| ImageError::Size {
            path: path.to_owned(),
            source,
        };
        let len = file.metadata().map_err(size_err)?.len();
        let bytes = match size {
            Some(b) => {
                if i64::try_from(b).is_err() {
                    return Err(ImageError::TooLarge { bytes: b });
                }
                if len < b {
                    file.set_len(b).map_err(size_err)?;
                }
                b
            }
            None => len,
        };
        let blocks = bytes / BLOCK_SIZE;
        if blocks == 0 {
            return Err(ImageError::Empty {
                path: path.to_owned(),
            });
        }
        Ok(Namespace {
            file,
            direct: None,
            blocks,
        })
    }

    /// Size in logical blocks.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The byte range of `nlb` blocks from `slba`, if it lies inside the namespace.
    pub fn range(&self, slba: u64, nlb: u64) -> Option<(u64, u64)> {
        let end = slba.checked_add(nlb)?;
        (end <= self.blocks).then_some((slba * BLOCK_SIZE, nlb * BLOCK_SIZE))
    }

    /// Read `buf.len()` bytes at byte `offset`.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    /// Write `data` at byte `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    /// Open the image a second time with O_DIRECT (through `/proc/self/fd`, so the very
    /// file already open, even if its path changed) for aligned transfers
    /// ([`Namespace::file_for`]); `path` names it in errors.
    pub fn enable_direct(&mut self, path: &Path) -> Result<(), ImageError> {
        let direct = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
            .map_err(|source| ImageError::Direct {
                path: path.to_owned(),
                source,
            })?;
        self.direct = Some(direct);
        Ok(())
    }

    /// True if aligned transfers bypass the host's page cache.
    pub fn is_direct(&self) -> bool {
        self.direct.is_some()
    }

    /// The descriptor for a transfer of `len` bytes at image byte `offset` whose guest
    /// buffer starts `mem_offset` bytes into its first page: the O_DIRECT one if it is
    /// enabled and all three are [`DIRECT_ALIGN`]ed (every later piece of a PRP transfer
    /// starts on a page), else the buffered one. Both are the same file: Linux keeps the
    /// page cache coherent with direct writes.
    pub fn file_for(&self, offset: u64, len: u64, mem_offset: u64) -> &File {
        match &self.direct {
            Some(d) if (offset | len | mem_offset).is_multiple_of(DIRECT_ALIGN) => d,
            _ => &self.file,
        }
    }

    /// Flush to stable storage.
    pub fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    /// Deallocate `[offset, offset + len)`: punch a hole (reads as zeroes afterwards).
    pub fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        let (Ok(off), Ok(n)) = (i64::try_from(offset), i64::try_from(len)) else {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        };
        // SAFETY: fallocate on a file descriptor this struct owns, with plain integer
        // arguments; it touches no memory of this process.
        let r = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                off,
                n,
            )
        };
        if r == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Zero `[offset, offset + len)`: a punched hole, or written zeroes where the
    /// filesystem cannot punch.
    pub fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.punch(offset, len).is_ok() {
            return Ok(());
        }
        const CHUNK: u64 = 128 << 10;
        let zeroes = vec![0u8; CHUNK.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = CHUNK.min(len - done);
            self.write(offset + done, &zeroes[..n as usize])?;
            done += n;
        }
        Ok(())
    }
}

/// The NVMe status of a failed host I/O: a read error is Unrecovered Read Error, a write
/// error Write Fault (both media errors the guest may retry), no space is Capacity
/// Exceeded, anything else Internal Error.
pub fn io_status(e: &io::Error, write: bool) -> Status {
    match e.raw_os_error() {
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Status {
            sct: 0,
            sc: 0x81,
            dnr: true,
        },
        Some(libc::EIO) if write => Status::WRITE_FAULT,
        Some(libc::EIO) => Status::UNRECOVERED_READ,
        _ if e.kind() == io::ErrorKind::UnexpectedEof => Status::UNRECOVERED_READ,
        _ => Status::INTERNAL_ERROR,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_open_creates_sparse_image_and_checks_ranges() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ns.img");
        let ns = Namespace::open(&p, Some(1 << 20)).unwrap();
        assert_eq!(ns.blocks(), 2048);
        assert_eq!(ns.range(2047, 1), Some((2047 * 512, 512)));
        assert_eq!(ns.range(2047, 2), None);
        assert_eq!(ns.range(u64::MAX, 2), None);
        ns.write(512, &[7; 512]).unwrap();
        ns.write_zeroes(512, 256).unwrap();
        let mut b = [1u8; 512];
        ns.read(512, &mut b).unwrap();
        assert_eq!(&b[..256], &[0; 256][..]);
        assert_eq!(&b[256..], &[7; 256][..]);
        assert!(matches!(
            Namespace::open(&dir.path().join("none"), None),
            Err(ImageError::Open { .. })
        ));
    }

    #[test]
    fn test_io_status_maps_errno() {
        let eio = io::Error::from_raw_os_error(libc::EIO);
        assert_eq!(io_status(&eio, false), Status::UNRECOVERED_READ);
        assert_eq!(io_status(&eio, true), Status::WRITE_FAULT);
        let enospc = io::Error::from_raw_os_error(libc::ENOSPC);
        assert_eq!(io_status(&enospc, true).sc, 0x81);
    }
}
