//! Where a thread's time goes while it is runnable: `/proc/self/task/<tid>/schedstat`
//! (time on a CPU, time waiting on a run queue, times it got a CPU; all since the thread
//! started). The fairness part reads it for every thread of the process around its
//! blocks, so that a late FENCE can be split into "the scheduler above picked it late"
//! (the engine's wake-up delay) and "a thread on the path waited for a CPU".

use std::collections::BTreeMap;

/// One thread's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// ns on a CPU.
    pub run_ns: u64,
    /// ns runnable, waiting for a CPU.
    pub wait_ns: u64,
    /// Times it got a CPU.
    pub runs: u64,
}

/// Parse a `schedstat` line: `run_ns wait_ns runs`.
pub fn parse(text: &str) -> Option<Counters> {
    let mut it = text.split_whitespace().map(|f| f.parse::<u64>().ok());
    Some(Counters {
        run_ns: it.next()??,
        wait_ns: it.next()??,
        runs: it.next()??,
    })
}

/// Every thread of this process: tid → (name, counters).
pub fn threads() -> BTreeMap<i32, (String, Counters)> {
    let mut out = BTreeMap::new();
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<i32>().ok()) else {
            continue;
        };
        let p = e.path();
        let name = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if let Some(c) = std::fs::read_to_string(p.join("schedstat"))
            .ok()
            .as_deref()
            .and_then(parse)
        {
            out.insert(tid, (name.trim().to_owned(), c));
        }
    }
    out
}

/// The counters of `group`'s threads summed, between two [`threads`] snapshots (threads
/// present in both).
pub fn delta(
    a: &BTreeMap<i32, (String, Counters)>,
    b: &BTreeMap<i32, (String, Counters)>,
    group: impl Fn(i32, &str) -> bool,
) -> Counters {
    let mut sum = Counters::default();
    for (tid, (name, cb)) in b {
        if !group(*tid, name) {
            continue;
        }
        if let Some((_, ca)) = a.get(tid) {
            sum.run_ns += cb.run_ns.saturating_sub(ca.run_ns);
            sum.wait_ns += cb.wait_ns.saturating_sub(ca.wait_ns);
            sum.runs += cb.runs.saturating_sub(ca.runs);
        }
    }
    sum
}

impl Counters {
    /// Add `o`.
    pub fn add(&mut self, o: Counters) {
        self.run_ns += o.run_ns;
        self.wait_ns += o.wait_ns;
        self.runs += o.runs;
    }

    /// Mean run-queue wait per time on a CPU, µs (NaN if it never ran).
    pub fn wait_per_run_us(&self) -> f64 {
        if self.runs == 0 {
            f64::NAN
        } else {
            self.wait_ns as f64 / self.runs as f64 / 1e3
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_reads_three_numbers_and_refuses_less() {
        assert_eq!(
            parse("123 456 7\n"),
            Some(Counters {
                run_ns: 123,
                wait_ns: 456,
                runs: 7
            })
        );
        assert_eq!(parse("1 2"), None);
        assert_eq!(parse("a b c"), None);
    }

    #[test]
    fn test_threads_sees_this_thread_and_delta_sums_a_group() {
        // SAFETY: gettid has no arguments and cannot fail.
        let me = unsafe { libc::gettid() };
        let a = threads();
        assert!(a.contains_key(&me), "this thread in /proc/self/task");
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = std::hint::black_box(x ^ i);
        }
        let b = threads();
        let d = delta(&a, &b, |tid, _| tid == me);
        assert!(d.run_ns > 0, "{d:?}");
        assert_eq!(delta(&a, &b, |_, _| false), Counters::default());
        assert!(Counters::default().wait_per_run_us().is_nan());
    }
}
