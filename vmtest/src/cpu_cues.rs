//! Host CPU time per guest phase: a guest scenario frames each phase with
//! `UMDEV-READY <scenario> begin:<disk>:<load>` and `end:<disk>:<load>:<ios>` cues
//! (`guest/src/nvme_bench.rs`; the virtio-gpu bench's "I/Os" are frames); at each cue this samples the CPU time (user + system, all
//! threads) of QEMU and of the umdev servers, and at the end reports per `<disk>.<load>`:
//!
//! - `host_cpu_us_per_io`: QEMU's and the servers' CPU together per I/O — what the host
//!   pays for an I/O of that disk (under TCG QEMU's share includes emulating the guest);
//! - `umdev_cpu_us_per_io`: the servers' share alone;
//! - for a phase of 0 I/Os (`idle`): `umdev_cpu_pct` and `qemu_cpu_pct`, percent of one core.
//!
//! Samples come from `/proc/<pid>/stat` (clock ticks, 10 ms), so phases are seconds long.

use std::collections::BTreeMap;
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use crate::report::Measure;

/// CPU seconds (user + system, every thread, living and exited) of `pid`.
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3 (state);
    // utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(ticks as f64 / hz)
}

/// The QEMU process this harness started (a child whose name starts with `qemu-system`).
fn qemu_pid() -> Option<u32> {
    let me = std::process::id();
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let ppid = stat[close + 2..]
            .split_whitespace()
            .nth(1)
            .and_then(|p| p.parse::<u32>().ok());
        if comm.starts_with("qemu-system") && ppid == Some(me) {
            return Some(pid);
        }
    }
    None
}

#[derive(Clone, Copy)]
struct Sample {
    at: Instant,
    qemu: f64,
    servers: f64,
}

#[derive(Default)]
struct Sum {
    ios: u64,
    wall: f64,
    qemu: f64,
    servers: f64,
}

/// Collect the cues of every scenario from the console lines until the sender goes;
/// `servers` are the umdev server pids. Returns the measures described in the module doc,
/// each under the scenario whose cues framed it.
pub fn collect(rx: Receiver<(Duration, String)>, servers: &[u32]) -> Vec<Measure> {
    let mut qemu = None;
    let mut open: BTreeMap<(String, String), Sample> = BTreeMap::new();
    let mut sums: BTreeMap<(String, String), Sum> = BTreeMap::new();
    for (_, line) in rx {
        let Some(rest) = line.trim().strip_prefix("UMDEV-READY ") else {
            continue;
        };
        let Some((scenario, cue)) = rest.split_once(' ') else {
            continue;
        };
        if !cue.starts_with("begin:") && !cue.starts_with("end:") {
            continue;
        }
        if qemu.is_none() {
            qemu = qemu_pid();
        }
        let sample = Sample {
            at: Instant::now(),
            qemu: qemu.and_then(cpu_secs).unwrap_or(f64::NAN),
            servers: servers.iter().filter_map(|&p| cpu_secs(p)).sum(),
        };
        let parts: Vec<&str> = cue.split(':').collect();
        match parts.as_slice() {
            ["begin", disk, load] => {
                open.insert((scenario.to_string(), format!("{disk}.{load}")), sample);
            }
            ["end", disk, load, ios] => {
                let key = (scenario.to_string(), format!("{disk}.{load}"));
                let (Some(b), Ok(ios)) = (open.remove(&key), ios.parse::<u64>()) else {
                    continue;
                };
                let s = sums.entry(key).or_default();
                s.ios += ios;
                s.wall += sample.at.duration_since(b.at).as_secs_f64();
                s.qemu += sample.qemu - b.qemu;
                s.servers += sample.servers - b.servers;
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    for ((scenario, key), s) in &sums {
        let mut m = |name: String, value: f64, unit: &str| {
            out.push(Measure {
                scenario: scenario.clone(),
                name,
                value,
                unit: unit.to_string(),
            })
        };
        if s.ios == 0 {
            m(
                format!("{key}.umdev_cpu_pct"),
                100.0 * s.servers / s.wall.max(1e-9),
                "%core",
            );
            m(
                format!("{key}.qemu_cpu_pct"),
                100.0 * s.qemu / s.wall.max(1e-9),
                "%core",
            );
        } else {
            m(
                format!("{key}.host_cpu_us_per_io"),
                1e6 * (s.qemu + s.servers) / s.ios as f64,
                "us",
            );
            m(
                format!("{key}.umdev_cpu_us_per_io"),
                1e6 * s.servers / s.ios as f64,
                "us",
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_cpu_cues_pair_begin_and_end_and_sum_rounds() {
        let (tx, rx) = std::sync::mpsc::channel();
        let me = std::process::id();
        for line in [
            "UMDEV-READY b begin:umdev:seq",
            "noise",
            "UMDEV-READY b end:umdev:seq:10",
            "UMDEV-READY b begin:umdev:seq",
            "UMDEV-READY b end:umdev:seq:30",
            "UMDEV-READY b end:qemu:seq:5",
            "UMDEV-READY b begin:umdev:idle",
            "UMDEV-READY b end:umdev:idle:0",
            "UMDEV-READY other begin:x:y",
            "UMDEV-READY other end:x:y:4",
            "UMDEV-READY other kms-flipped",
        ] {
            tx.send((Duration::ZERO, line.to_string())).unwrap();
        }
        drop(tx);
        let got = collect(rx, &[me]);
        let names: Vec<(&str, &str)> = got
            .iter()
            .map(|m| (m.scenario.as_str(), m.name.as_str()))
            .collect();
        // An end without its begin (qemu.seq) is dropped; idle gets percentages; other
        // cues are not phases.
        assert_eq!(
            names,
            [
                ("b", "umdev.idle.umdev_cpu_pct"),
                ("b", "umdev.idle.qemu_cpu_pct"),
                ("b", "umdev.seq.host_cpu_us_per_io"),
                ("b", "umdev.seq.umdev_cpu_us_per_io"),
                ("other", "x.y.host_cpu_us_per_io"),
                ("other", "x.y.umdev_cpu_us_per_io"),
            ]
        );
        // This process's own CPU time is a real, non-negative number.
        assert!(got[3].value >= 0.0 && got[3].value.is_finite());
    }

    #[test]
    fn test_cpu_secs_of_this_process_grows() {
        let a = cpu_secs(std::process::id()).unwrap();
        let t = Instant::now();
        let mut x = 0u64;
        while t.elapsed() < Duration::from_millis(60) {
            x = x.wrapping_add(std::hint::black_box(1));
        }
        let b = cpu_secs(std::process::id()).unwrap();
        assert!(b > a, "{a} -> {b} ({x})");
        assert!(cpu_secs(u32::MAX).is_none());
    }
}
