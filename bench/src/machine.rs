//! What the numbers were measured on: CPU, cores, kernel, page settings, build profile.

use std::fs;

use super::backing::{free_huge_pages, sysfs_choice, SHMEM_THP};

/// Description of the machine and build, recorded with every report.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct MachineInfo {
    /// CPU model name from /proc/cpuinfo.
    pub cpu_model: String,
    /// Logical CPUs available to this process (`nproc`).
    pub nproc: usize,
    /// Kernel release.
    pub kernel: String,
    /// Anonymous THP setting.
    pub thp_enabled: Option<String>,
    /// Shmem (memfd) THP setting.
    pub thp_shmem_enabled: Option<String>,
    /// Free 2 MiB hugetlb pages.
    pub free_huge_pages_2m: Option<u64>,
    /// RLIMIT_MEMLOCK soft limit in bytes (`None` = unlimited).
    pub memlock_limit_bytes: Option<u64>,
    /// Effective uid (root ignores RLIMIT_MEMLOCK for mlock).
    pub euid: u32,
    /// `release` or `debug` (numbers from a debug build are not meaningful).
    pub build_profile: String,
    /// umdev version.
    pub umdev_version: String,
    /// Seconds since the epoch when the run started.
    pub started_unix_s: u64,
}

fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn memlock_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-pointer for the duration of the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) } != 0
        || lim.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    Some(lim.rlim_cur)
}

/// True when this binary was built without optimizations.
pub fn is_debug_build() -> bool {
    cfg!(debug_assertions)
}

/// Collect the machine description.
pub fn collect() -> MachineInfo {
    MachineInfo {
        cpu_model: cpu_model(),
        nproc: std::thread::available_parallelism().map_or(1, |n| n.get()),
        kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into()),
        thp_enabled: sysfs_choice("/sys/kernel/mm/transparent_hugepage/enabled"),
        thp_shmem_enabled: sysfs_choice(SHMEM_THP),
        free_huge_pages_2m: free_huge_pages(),
        memlock_limit_bytes: memlock_limit(),
        // SAFETY: geteuid has no preconditions.
        euid: unsafe { libc::geteuid() },
        build_profile: if is_debug_build() { "debug" } else { "release" }.into(),
        umdev_version: env!("CARGO_PKG_VERSION").into(),
        started_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    }
}

impl MachineInfo {
    /// One line for the terminal.
    pub fn summary(&self) -> String {
        format!(
            "{} × {}, kernel {}, THP {}/shmem {}, {} build",
            self.nproc,
            self.cpu_model,
            self.kernel,
            self.thp_enabled.as_deref().unwrap_or("?"),
            self.thp_shmem_enabled.as_deref().unwrap_or("?"),
            self.build_profile
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_collect_reports_cpus_and_kernel() {
        let m = collect();
        assert!(m.nproc >= 1);
        assert_ne!(m.kernel, "");
        assert!(m.summary().contains(&m.kernel));
    }
}
