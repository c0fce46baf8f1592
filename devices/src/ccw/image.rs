//! The backing image file: opening, creating and sizing it.
//!
//! The image is a plain file; block `n` lives at byte `n * 512`. Writes go to the file with
//! `pwrite` as the program runs (so they survive a crash of umdev, but not of the host,
//! until flushed); `fdatasync` runs when an operation block sets FLUSH, on device reset and
//! when the device is dropped.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use super::format::BLOCK_SIZE;

/// Errors of the ccw device's setup.
#[derive(Debug, thiserror::Error)]
pub enum CcwError {
    /// The image could not be opened or created.
    #[error("cannot open image {path}")]
    Open {
        /// The image path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The image size could not be read or changed.
    #[error("cannot size image {path}")]
    Size {
        /// The image path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The image holds less than one block and no capacity was given.
    #[error("image {path} is smaller than one 512-byte block and no capacity was given")]
    Empty {
        /// The image path.
        path: PathBuf,
    },
    /// The requested capacity overflows a byte offset.
    #[error("capacity of {blocks} blocks is too large")]
    CapacityTooLarge {
        /// The requested capacity.
        blocks: u64,
    },
}

impl CcwError {
    /// The errno that best describes the error.
    pub fn errno(&self) -> i32 {
        match self {
            CcwError::Open { source, .. } | CcwError::Size { source, .. } => {
                source.raw_os_error().unwrap_or(libc::EIO)
            }
            CcwError::Empty { .. } | CcwError::CapacityTooLarge { .. } => libc::EINVAL,
        }
    }
}

/// Open (or create) the image and settle its capacity in blocks.
///
/// With `capacity_blocks = Some(n)`, the file is created if `create` is set and grown
/// (sparsely) to `n` blocks if shorter; a longer file is left as is and only its first `n`
/// blocks are used. With `None`, the capacity is the file size in whole blocks.
pub fn open_image(
    path: &Path,
    capacity_blocks: Option<u64>,
    create: bool,
) -> Result<(File, u64), CcwError> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .open(path)
        .map_err(|source| CcwError::Open {
            path: path.to_owned(),
            source,
        })?;
    let blocks = settle_capacity(&file, path, capacity_blocks)?;
    Ok((file, blocks))
}

/// Settle the capacity of an open image `file` (at `path`, for errors) as [`open_image`]
/// does: grown to `capacity_blocks` if given and shorter, else its size in whole blocks.
pub fn settle_capacity(
    file: &File,
    path: &Path,
    capacity_blocks: Option<u64>,
) -> Result<u64, CcwError> {
    let size_err = |source| CcwError::Size {
        path: path.to_owned(),
        source,
    };
    let len = file.metadata().map_err(size_err)?.len();
    let blocks = match capacity_blocks {
        Some(n) => {
            let bytes = n
                .checked_mul(BLOCK_SIZE)
                .filter(|&b| i64::try_from(b).is_ok())
                .ok_or(CcwError::CapacityTooLarge { blocks: n })?;
            if len < bytes {
                file.set_len(bytes).map_err(size_err)?;
            }
            n
        }
        None => len / BLOCK_SIZE,
    };
    if blocks == 0 {
        return Err(CcwError::Empty {
            path: path.to_owned(),
        });
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_open_image_creates_and_sizes_sparse_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk.img");
        let (_, blocks) = open_image(&p, Some(64), true).unwrap();
        assert_eq!(blocks, 64);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 64 * 512);
        let (_, blocks) = open_image(&p, None, false).unwrap();
        assert_eq!(blocks, 64);
    }

    #[test]
    fn test_open_image_missing_without_create_fails() {
        let dir = tempfile::tempdir().unwrap();
        let e = open_image(&dir.path().join("nope"), Some(1), false).unwrap_err();
        assert_eq!(e.errno(), libc::ENOENT);
    }

    #[test]
    fn test_open_image_empty_without_capacity_fails() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("empty");
        std::fs::write(&p, [0u8; 100]).unwrap();
        assert!(matches!(
            open_image(&p, None, false),
            Err(CcwError::Empty { .. })
        ));
        assert!(matches!(
            open_image(&p, Some(u64::MAX / 2), false),
            Err(CcwError::CapacityTooLarge { .. })
        ));
    }
}
