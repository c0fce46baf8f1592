//! The time slice of latency-path threads.
//!
//! A connection thread is woken by every message and runs for microseconds: a trapped
//! register access of the guest waits for it. On a host whose CPUs are busy (guests,
//! other devices' work) a woken thread with the kernel's default slice (~3 ms) may wait
//! for a CPU-bound thread's slice to end before it runs; with Linux ≥ 6.12's EEVDF a
//! thread that asks for a *shorter* slice gets an earlier deadline and preempts such a
//! thread when it wakes. Its share of CPU time does not change (that is its weight, the
//! nice value), only its latency.
//!
//! Measured with `umdev bench instances --only fairness --busy-threads 2 --conn-slice-us
//! 0|100`, eight alternating pairs on an otherwise idle 2-core machine (docs/benchmarks.md,
//! "Busy host, the third part"): the idle GPU instance's FENCE latency beside four
//! flooders on the busy host, loaded ÷ unloaded p90 of the worst set, was 3.8–27× (median
//! 9.3×) without a slice and 1.5–9.4× (median 3.0×) with 100 µs; medians 1.0–1.5× either
//! way. An earlier six runs on a machine that was also compiling showed no consistent
//! difference (3.4–11× against 3.6–49×). So the connection and twin-reader threads ask for
//! [`DEFAULT_THREAD_SLICE`] by default
//! ([`ServerConfig::thread_slice`](super::ServerConfig::thread_slice); `None` turns it
//! off); the GPU's fetcher threads ask for the same (`umdev_devices::gpu::engine`,
//! "Priority").
//!
//! [`set_thread_slice`] asks for a slice for the calling thread (`sched_setattr`,
//! SCHED_OTHER with `sched_runtime` = the slice, the nice value kept; the kernel clamps it
//! to 0.1–100 ms; kernels before 6.12 accept and ignore it). No privilege is needed. The
//! server's connection and twin-reader threads ask for
//! [`ServerConfig::thread_slice`](super::ServerConfig::thread_slice) when they start.

use std::io;
use std::time::Duration;

/// A short slice: 100 µs, the shortest Linux accepts (the default of
/// [`ServerConfig::thread_slice`](super::ServerConfig::thread_slice) and of the GPU's
/// fetchers).
pub const DEFAULT_THREAD_SLICE: Duration = Duration::from_micros(100);

/// `struct sched_attr` of `sched_setattr(2)`, its first version (48 bytes).
#[repr(C)]
#[derive(Debug, Default)]
struct SchedAttr {
    size: u32,
    sched_policy: u32,
    sched_flags: u64,
    sched_nice: i32,
    sched_priority: u32,
    sched_runtime: u64,
    sched_deadline: u64,
    sched_period: u64,
}

/// Ask for a time slice of `slice` for the calling thread: SCHED_OTHER with its nice value
/// kept and `sched_runtime` = `slice`. The error of a refusal (e.g. EPERM under a real-time
/// policy the caller may not leave).
pub fn set_thread_slice(slice: Duration) -> io::Result<()> {
    // SAFETY: gettid has no arguments and cannot fail.
    let tid = unsafe { libc::gettid() };
    let who = libc::id_t::try_from(tid).unwrap_or(0);
    // SAFETY: errno is thread-local and ours to reset; getpriority of this thread touches
    // no memory. errno is reset first so that a nice value of -1 is told from an error.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, who)
    };
    if nice == -1 && io::Error::last_os_error().raw_os_error() != Some(0) {
        return Err(io::Error::last_os_error());
    }
    let attr = SchedAttr {
        size: std::mem::size_of::<SchedAttr>() as u32,
        sched_policy: libc::SCHED_OTHER as u32,
        sched_nice: nice,
        sched_runtime: u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX),
        ..SchedAttr::default()
    };
    // SAFETY: sched_setattr(0 = the calling thread, an attr of the size it states, flags
    // 0) only reads `attr`, which lives across the call.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The calling thread's requested slice (`sched_runtime` of `sched_getattr`); zero when it
/// asked for none.
pub fn thread_slice() -> io::Result<Duration> {
    let mut attr = SchedAttr::default();
    // SAFETY: sched_getattr(0 = the calling thread) writes at most `size` bytes into
    // `attr`, which lives across the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &mut attr as *mut SchedAttr,
            std::mem::size_of::<SchedAttr>() as u32,
            0,
        )
    };
    if r == 0 {
        Ok(Duration::from_nanos(attr.sched_runtime))
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Apply `slice` (if any) to the calling thread; a refusal is logged at debug level (the
/// thread works as before, only without the latency help).
pub(crate) fn apply(slice: Option<Duration>, thread: &str) {
    if let Some(slice) = slice {
        if let Err(e) = set_thread_slice(slice) {
            tracing::debug!(error = %e, ?slice, thread, "the thread's time slice was refused");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Linux (major, minor) from uname.
    fn kernel() -> (u32, u32) {
        let rel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut it = rel.trim().split(['.', '-']).map(|p| p.parse().unwrap_or(0));
        (it.next().unwrap_or(0), it.next().unwrap_or(0))
    }

    #[test]
    fn test_set_thread_slice_keeps_nice_and_sets_the_slice_on_linux_6_12() {
        std::thread::spawn(|| {
            // SAFETY: setpriority on this thread alone (0 = the caller); raising one's own
            // nice value needs no privilege.
            assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 5) }, 0);
            set_thread_slice(DEFAULT_THREAD_SLICE).expect("sched_setattr");
            // SAFETY: getpriority of this thread touches no memory.
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
            assert_eq!(nice, 5, "the nice value is kept");
            if kernel() >= (6, 12) {
                assert_eq!(thread_slice().unwrap(), DEFAULT_THREAD_SLICE);
            }
        })
        .join()
        .unwrap();
    }
}
