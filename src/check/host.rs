//! The host's memory side: the locked-memory limit, the map count, huge pages, `/dev/shm`.

use std::ffi::CString;

use umdev::dma::{capacity_for, DEFAULT_MAP_GUARANTEE, PAGE_SIZE};

use super::{bytes, Finding, Status};

/// The most one device of `umdev run --pin-policy lock` keeps locked at once (GPU, ccw):
/// a GPU pins a page per GTT entry; a ccw program pins the data pages of up to
/// `DEFAULT_MAX_CCWS` CCWs, each a 16-bit byte count at the worst offset (17 pages, direct
/// or through an IDAW list; the CCW and IDAW lists themselves are read, not pinned).
pub fn lock_needed() -> (u64, u64) {
    use umdev_devices::ccw::program::DEFAULT_MAX_CCWS;
    let gpu = u64::from(umdev_devices::gpu::regs::GTT_ENTRIES) * PAGE_SIZE;
    let per_ccw = (PAGE_SIZE - 1 + u64::from(u16::MAX)).div_ceil(PAGE_SIZE);
    let ccw = DEFAULT_MAX_CCWS as u64 * per_ccw * PAGE_SIZE;
    (gpu, ccw)
}

/// RLIMIT_MEMLOCK against what the `lock` pin policy needs.
pub fn memlock() -> Finding {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct we pass.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    let (gpu, ccw) = lock_needed();
    let need = gpu.max(ccw);
    let f = |status, detail: String| {
        Finding::new("memlock", false, status, detail)
            .value("needed_bytes", need)
            .value("gpu_bytes", gpu)
            .value("ccw_bytes", ccw)
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return f(
            Status::Warn,
            format!("getrlimit(RLIMIT_MEMLOCK) failed: {e}"),
        )
        .fix("check `ulimit -l` by hand");
    }
    let soft = (rl.rlim_cur != libc::RLIM_INFINITY).then_some(rl.rlim_cur);
    let hard = (rl.rlim_max != libc::RLIM_INFINITY).then_some(rl.rlim_max);
    let show = |v: Option<u64>| v.map_or("unlimited".to_string(), bytes);
    let needs = format!(
        "`umdev run --pin-policy lock` locks up to {} (gpu {}, ccw {}); the daemon and the \
         default policy lock nothing",
        bytes(need),
        bytes(gpu),
        bytes(ccw)
    );
    let finding = match soft {
        Some(s) if s < need => f(
            Status::Warn,
            format!(
                "RLIMIT_MEMLOCK {} (hard {}): {needs}",
                show(soft),
                show(hard)
            ),
        )
        .fix(if has_ipc_lock() {
            format!(
                "with CAP_IPC_LOCK the kernel does not hold mlock to it, but umdev's lock \
                 limit defaults to it: `umdev run --pin-policy lock --lock-limit {need}`, or \
                 raise it (`ulimit -l {}`, LimitMEMLOCK= in a unit)",
                need.div_ceil(1024)
            )
        } else {
            format!(
                "raise it to {} or more: `ulimit -l {}`, LimitMEMLOCK= in a unit, or \
                 /etc/security/limits.conf",
                bytes(need),
                need.div_ceil(1024)
            )
        }),
        _ => f(
            Status::Ok,
            format!(
                "RLIMIT_MEMLOCK {} (hard {}): {needs}",
                show(soft),
                show(hard)
            ),
        ),
    };
    finding.value("soft_bytes", soft).value("hard_bytes", hard)
}

/// Whether this process has CAP_IPC_LOCK in its effective set (`CapEff` of
/// `/proc/self/status`, bit 14).
fn has_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let hex = s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))?
                .trim()
                .to_string();
            u64::from_str_radix(&hex, 16).ok()
        })
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The smallest `vm.max_map_count` whose pool holds `maps`, if any does.
fn map_count_for(maps: u64) -> Option<u64> {
    let top = 1u64 << 32;
    if capacity_for(top) < maps {
        return None;
    }
    let (mut lo, mut hi) = (0u64, top);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if capacity_for(mid) >= maps {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

/// `vm.max_map_count` against the daemon's instance budget (`umdev::dma::MapPool`).
pub fn max_map_count(max_instances: usize) -> Finding {
    let path = "/proc/sys/vm/max_map_count";
    let Some(count) = read_u64(path) else {
        return Finding::new(
            "max-map-count",
            false,
            Status::Warn,
            format!("cannot read {path}: the daemon assumes the kernel default 65530"),
        )
        .fix("check `sysctl vm.max_map_count` by hand (is /proc mounted?)");
    };
    let instances = max_instances.max(1) as u64;
    let capacity = capacity_for(count);
    let each = DEFAULT_MAP_GUARANTEE.min(capacity / instances);
    let full = capacity / DEFAULT_MAP_GUARANTEE;
    let detail = format!(
        "vm.max_map_count {count}: a pool of {capacity} fd-backed DMA maps; each of \
         {instances} instances is guaranteed {each} (default {DEFAULT_MAP_GUARANTEE}; \
         {full} instances fit with the full default)"
    );
    let f = Finding::new("max-map-count", false, Status::Ok, detail)
        .value("max_map_count", count)
        .value("pool_maps", capacity)
        .value("max_instances", instances)
        .value("guarantee_per_instance", each)
        .value("instances_with_default_guarantee", full);
    if each >= DEFAULT_MAP_GUARANTEE {
        return f;
    }
    let mut f = f;
    f.status = Status::Warn;
    match map_count_for(DEFAULT_MAP_GUARANTEE * instances) {
        Some(n) => f.fix(format!(
            "enough for QEMU without a vIOMMU (a handful of maps per guest); for \
             {DEFAULT_MAP_GUARANTEE} each: `sysctl -w vm.max_map_count={n}` (and in \
             /etc/sysctl.d/), or a lower --max-instances"
        )),
        None => f.fix(format!(
            "enough for QEMU without a vIOMMU (a handful of maps per guest); the pool \
             cannot exceed the SIGBUS table, so at most {} instances get {DEFAULT_MAP_GUARANTEE} \
             each: a lower --max-instances",
            capacity_for(1 << 32) / DEFAULT_MAP_GUARANTEE
        )),
    }
}

fn meminfo(field: &str, text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(field)?.strip_prefix(':')?;
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// The bracketed choice of a THP setting, e.g. `always [madvise] never` → `madvise`.
fn thp_choice(path: &str) -> Option<String> {
    let s = std::fs::read_to_string(path).ok()?;
    let start = s.find('[')? + 1;
    let end = start + s[start..].find(']')?;
    Some(s[start..end].to_string())
}

/// Reserved huge pages and transparent huge pages (both optional).
pub fn hugepages() -> Finding {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let total = meminfo("HugePages_Total", &text);
    let free = meminfo("HugePages_Free", &text);
    let size_kib = meminfo("Hugepagesize", &text);
    let thp = thp_choice("/sys/kernel/mm/transparent_hugepage/enabled");
    let shmem = thp_choice("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
    let thp_text = format!(
        "transparent huge pages {}, for shmem/memfd {}",
        thp.as_deref().unwrap_or("unknown"),
        shmem.as_deref().unwrap_or("unknown")
    );
    let mut f = match (total, free) {
        (Some(0), _) | (None, _) => Finding::new(
            "hugepages",
            false,
            Status::Ok,
            format!("no huge pages reserved (optional: only for hugetlbfs guest RAM); {thp_text}"),
        ),
        (Some(t), Some(0)) => Finding::new(
            "hugepages",
            false,
            Status::Warn,
            format!("{t} huge pages reserved, none free; {thp_text}"),
        )
        .fix("a guest with hugetlbfs RAM will not start: reserve more (sysctl vm.nr_hugepages)"),
        (Some(t), fr) => Finding::new(
            "hugepages",
            false,
            Status::Ok,
            format!(
                "{t} huge pages of {} reserved, {} free; {thp_text}",
                size_kib.map_or("?".to_string(), |k| bytes(k * 1024)),
                fr.map_or("?".to_string(), |v| v.to_string())
            ),
        ),
    };
    f = f
        .value("total", total)
        .value("free", free)
        .value("size_bytes", size_kib.map(|k| k * 1024))
        .value("thp", thp)
        .value("thp_shmem", shmem);
    f
}

/// `/dev/shm` is tmpfs: guest RAM as a file there is DMA-mappable (umdev maps only
/// memfd/tmpfs/hugetlbfs files by default).
pub fn dev_shm() -> Finding {
    let path = "/dev/shm";
    let c = CString::new(path).expect("no NUL in a literal");
    // SAFETY: an all-zero statfs is a valid value of the plain-data struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a struct statfs we own.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return Finding::new(
            "dev-shm",
            false,
            Status::Warn,
            format!("{path}: {e} (memory-backend-memfd needs no /dev/shm)"),
        )
        .fix("mount a tmpfs on /dev/shm if guests use memory-backend-file there");
    }
    // f_type's width differs between architectures (i64 here, u32 on some).
    #[allow(clippy::unnecessary_cast)]
    let tmpfs = st.f_type as i64 == libc::TMPFS_MAGIC as i64;
    let f = if tmpfs {
        Finding::new(
            "dev-shm",
            false,
            Status::Ok,
            format!("{path} is tmpfs (memory-backend-file there, or memfd, can be DMA-mapped)"),
        )
    } else {
        Finding::new(
            "dev-shm",
            false,
            Status::Warn,
            format!(
                "{path} is not tmpfs (f_type {:#x}): a guest's RAM file there is refused by \
                 DMA_MAP",
                st.f_type
            ),
        )
        .fix("use memory-backend-memfd (share=on), or mount tmpfs on /dev/shm")
    };
    f.value("tmpfs", tmpfs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_map_count_for_is_smallest_sufficient() {
        let n = map_count_for(65536).unwrap();
        assert!(capacity_for(n) >= 65536 && capacity_for(n - 1) < 65536);
        assert_eq!(map_count_for(0), Some(0));
        assert_eq!(map_count_for(u64::MAX), None);
    }

    #[test]
    fn test_meminfo_and_thp_parse() {
        let t = "MemTotal: 10 kB\nHugePages_Total:       4\nHugepagesize:    2048 kB\n";
        assert_eq!(meminfo("HugePages_Total", t), Some(4));
        assert_eq!(meminfo("Hugepagesize", t), Some(2048));
        assert_eq!(meminfo("HugePages_Free", t), None);
    }

    #[test]
    fn test_lock_needed_ccw_program_dominates() {
        let (gpu, ccw) = lock_needed();
        assert_eq!(gpu, 4 << 20);
        // 256 CCWs of 17 pages.
        assert_eq!(ccw, 17 << 20);
    }
}
