//! CPU time used so far, from `getrusage`: the whole process, or the calling thread (user +
//! system, µs resolution; the kernel accounts it from the scheduler's runtime).

use std::time::Duration;

fn rusage(who: libc::c_int) -> Duration {
    // SAFETY: an all-zero rusage is a valid value for getrusage to fill.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a live rusage; `who` is RUSAGE_SELF or RUSAGE_THREAD.
    unsafe { libc::getrusage(who, &mut ru) };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// CPU time of the whole process (every thread, live or ended).
pub fn process() -> Duration {
    rusage(libc::RUSAGE_SELF)
}

/// CPU time of the calling thread.
pub fn thread() -> Duration {
    rusage(libc::RUSAGE_THREAD)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_busy_thread_cpu_grows_and_process_covers_it() {
        let (p0, t0) = (process(), thread());
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(30) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        std::hint::black_box(x);
        let (p1, t1) = (process(), thread());
        assert!(t1 > t0, "the thread's CPU time grew");
        assert!(p1 - p0 >= t1 - t0, "the process's covers the thread's");
    }
}
