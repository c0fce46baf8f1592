//! Page backing of the bench region: 4 KiB pages, transparent huge pages, or hugetlbfs.
//!
//! The DMA layer maps the fd a client passes with DMA_MAP, so every backing is a memfd:
//! - `4k`: a plain memfd (shmem, 4 KiB pages).
//! - `thp`: a memfd whose pages are prefaulted as 2 MiB folios through a local mapping with
//!   `MADV_HUGEPAGE`; needs shmem THP (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`
//!   other than `never`/`deny`).
//! - `hugetlb`: a `MFD_HUGETLB | MFD_HUGE_2MB` memfd; needs enough free 2 MiB huge pages.
//!
//! A backing the machine does not offer is skipped with a message saying why and how to
//! enable it; it is never an error.

use std::fs;
use std::os::fd::OwnedFd;

use super::local_mapping::{memfd, LocalMapping};

/// 2 MiB, the huge page size used by `thp` and `hugetlb`.
pub const HUGE_PAGE: u64 = 2 << 20;

/// Page backing of the bench region.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backing {
    /// memfd with 4 KiB pages.
    #[value(name = "4k")]
    #[serde(rename = "4k")]
    Page4k,
    /// memfd prefaulted as transparent huge pages.
    Thp,
    /// memfd on hugetlbfs (2 MiB pages).
    Hugetlb,
}

impl Backing {
    /// Every backing, in report order.
    pub const ALL: [Backing; 3] = [Backing::Page4k, Backing::Thp, Backing::Hugetlb];

    /// The name used on the command line, in tables and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Backing::Page4k => "4k",
            Backing::Thp => "thp",
            Backing::Hugetlb => "hugetlb",
        }
    }
}

/// Result of preparing a backing.
pub enum Prepared {
    /// The fd to pass to `DmaSpace::map`, and a note on what was obtained.
    Ready(OwnedFd, String),
    /// Not offered by this machine: why.
    Skipped(String),
}

/// The bracketed choice of a sysfs setting like `always [madvise] never`.
pub fn sysfs_choice(path: &str) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    let start = text.find('[')?;
    let end = text[start..].find(']')? + start;
    Some(text[start + 1..end].to_string())
}

/// Shmem (memfd) THP setting.
pub const SHMEM_THP: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";
/// Free 2 MiB hugetlb pages.
pub const FREE_HUGEPAGES: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";

/// Free 2 MiB hugetlb pages, if the kernel reports them.
pub fn free_huge_pages() -> Option<u64> {
    fs::read_to_string(FREE_HUGEPAGES).ok()?.trim().parse().ok()
}

/// Prepare a region of `bytes` (a multiple of [`HUGE_PAGE`]) with `backing`.
pub fn prepare(backing: Backing, bytes: u64) -> std::io::Result<Prepared> {
    match backing {
        Backing::Page4k => Ok(Prepared::Ready(
            memfd("umdev-bench-4k", 0, bytes)?,
            "memfd, 4 KiB pages".into(),
        )),
        Backing::Thp => prepare_thp(bytes),
        Backing::Hugetlb => {
            let need = bytes.div_ceil(HUGE_PAGE);
            let free = free_huge_pages().unwrap_or(0);
            if free < need {
                return Ok(Prepared::Skipped(format!(
                    "hugetlb: {free} free 2 MiB pages, {need} needed \
                     (as root: echo {need} > /proc/sys/vm/nr_hugepages)"
                )));
            }
            match memfd(
                "umdev-bench-hugetlb",
                libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
                bytes,
            ) {
                Ok(fd) => Ok(Prepared::Ready(fd, "memfd MFD_HUGETLB, 2 MiB pages".into())),
                Err(e) => Ok(Prepared::Skipped(format!(
                    "hugetlb: memfd_create failed: {e}"
                ))),
            }
        }
    }
}

fn prepare_thp(bytes: u64) -> std::io::Result<Prepared> {
    let setting = sysfs_choice(SHMEM_THP);
    let setting = match setting.as_deref() {
        None => return Ok(Prepared::Skipped(format!("thp: {SHMEM_THP} not found"))),
        Some("never") | Some("deny") => {
            return Ok(Prepared::Skipped(format!(
                "thp: shmem THP is off ({SHMEM_THP} = {}; as root: echo advise > {SHMEM_THP})",
                setting.unwrap_or_default()
            )))
        }
        Some(s) => s.to_string(),
    };
    let fd = memfd("umdev-bench-thp", 0, bytes)?;
    let len = usize::try_from(bytes).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
    let local = LocalMapping::new(&fd, len)?;
    // Folios are allocated at fault time with the faulting mapping's advice; they stay in
    // the memfd's page cache after this mapping goes, so the DMA layer's mapping sees them.
    local.advise(libc::MADV_HUGEPAGE)?;
    local.touch(4096);
    let huge = shmem_huge_kib();
    drop(local);
    Ok(Prepared::Ready(
        fd,
        format!("memfd, shmem_enabled={setting}, ShmemHugePages now {huge} kB"),
    ))
}

/// `ShmemHugePages` of /proc/meminfo in kB (0 if unknown).
fn shmem_huge_kib() -> u64 {
    fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("ShmemHugePages:"))
                .and_then(|l| l.split_whitespace().nth(1).map(str::to_string))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_prepare_4k_is_always_ready() {
        assert!(matches!(
            prepare(Backing::Page4k, HUGE_PAGE).unwrap(),
            Prepared::Ready(..)
        ));
    }

    #[test]
    fn test_prepare_hugetlb_without_free_pages_is_skipped_with_reason() {
        // Ask for more huge pages than any test machine has free.
        match prepare(Backing::Hugetlb, HUGE_PAGE << 30).unwrap() {
            Prepared::Skipped(why) => assert!(why.contains("hugetlb"), "{why}"),
            Prepared::Ready(..) => panic!("2 PiB of huge pages cannot be free"),
        }
    }

    #[test]
    fn test_sysfs_choice_missing_file_is_none() {
        assert_eq!(sysfs_choice("/nonexistent/umdev"), None);
    }
}
