//! Round trips by CPU placement and polling (part of `umdev bench wire`): 4-byte
//! REGION_READs with the server's threads and the client on one CPU (*same core*) or on two
//! (*cross core*), against the `vfio_user` crate's server and umdev's with each `--poll`
//! mode, every round trip timed on its own (median and p99), with the server's CPU time per
//! message and the CPU an idle connection costs.
//!
//! Placement is set with `sched_setaffinity`: the bench thread pins itself to the server
//! CPU, starts the servers (their accept and connection threads inherit the mask), then
//! pins itself to the client CPU and connects. Variants are measured in interleaved rounds
//! (the order rotates every round), so drift on a shared machine hits all alike.
//!
//! CPU per message = (process CPU − client thread CPU) / round trips over a round, from
//! `getrusage` (`RUSAGE_SELF`, `RUSAGE_THREAD`): the servers of the other variants are
//! blocked meanwhile (an `auto` server may still finish one spin budget, ≤ 50 µs, after
//! its own round). Idle CPU = process CPU over an idle period after a burst on one
//! connection, in % of one core.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use umdev::server::PollMode;

use super::cputime;
use super::stats::quantile;
use super::table::Table;
use super::wire::{client, spawn_umdev_with, spawn_vfio_user, stop_umdev};
use crate::BenchError;

/// How many and how long.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct PlacementPlan {
    /// Interleaved rounds.
    pub rounds: usize,
    /// Round trips per variant per round.
    pub per_round: usize,
    /// Idle period measured per umdev variant, in ms.
    pub idle_ms: u64,
}

/// One variant's figures in one placement.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlacementRow {
    /// `same core` or `cross core`.
    pub placement: String,
    /// Which server, and its poll mode.
    pub server: String,
    /// Round trips timed.
    pub n: usize,
    /// Median round trip, ns.
    pub median_ns: f64,
    /// 99th percentile round trip, ns.
    pub p99_ns: f64,
    /// Server CPU per message (median over rounds), ns.
    pub cpu_per_msg_ns: f64,
    /// CPU of the whole process while the connection is idle, % of one core (umdev only).
    pub idle_cpu_pct: Option<f64>,
    /// Median round trip / the reference server's median in the same placement.
    pub ratio_to_reference: f64,
}

/// The placement part of the wire report.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PlacementReport {
    /// What was run.
    pub plan: PlacementPlan,
    /// CPUs used: (server, client) for same core and cross core.
    pub cpus: Vec<(usize, usize)>,
    /// One row per placement and variant.
    pub rows: Vec<PlacementRow>,
    /// Why a placement was not measured.
    pub skipped: Vec<String>,
}

/// CPUs the calling thread may run on.
pub(crate) fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live cpu_set_t of the size passed; pid 0 is the calling thread.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET reads the set in bounds (i < CPU_SETSIZE).
        .filter(|&i| unsafe { libc::CPU_ISSET(i, &set) })
        .collect())
}

/// Restrict the calling thread to `cpus`.
pub(crate) fn pin_to(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: an all-zero cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        if c < libc::CPU_SETSIZE as usize {
            // SAFETY: c < CPU_SETSIZE; `set` is a live set.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
    }
    // SAFETY: `set` is a live cpu_set_t of the size passed; pid 0 is the calling thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A server measured in one placement.
#[derive(Clone, Debug)]
enum Variant {
    /// The `vfio_user` crate's server (the reference of the ratios).
    VfioUser,
    /// umdev's server with this poll mode.
    Umdev(PollMode),
    /// libvfio-user's `gpio-pci-idio-16` sample, this binary, as a child process (BAR2).
    LibVfioUser(PathBuf),
    /// `<binary> run gpu` as a child process (its BAR0 ID register): another build of umdev
    /// (e.g. before a change) against this one, same device, same run.
    UmdevBinary(PathBuf),
}

impl Variant {
    fn name(&self) -> String {
        match self {
            Variant::VfioUser => "vfio_user::Server".into(),
            Variant::Umdev(m) => format!("umdev --poll {m}"),
            Variant::LibVfioUser(_) => "libvfio-user (gpio sample)".into(),
            Variant::UmdevBinary(b) => format!("{} run gpu", b.display()),
        }
    }

    /// The region the client reads.
    fn region(&self) -> u32 {
        match self {
            Variant::LibVfioUser(_) => 2,
            _ => 0,
        }
    }
}

/// A started server of one variant.
enum Started {
    Thread(std::thread::JoinHandle<()>),
    Umdev(umdev::server::RunningServer),
    Child(std::process::Child),
}

/// CPU time of process `pid`: the sum over its threads of `/proc/<pid>/task/*/schedstat`'s
/// first field (ns on CPU; precise, unlike the tick-based `stat` times).
fn child_cpu(pid: u32) -> Duration {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Duration::ZERO;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .sum()
}

/// Measure every placement the machine allows; with `libvfio_user`, libvfio-user's
/// `gpio-pci-idio-16` sample (that binary) as well, and `<binary> run gpu` for each of
/// `umdev_binaries`.
pub fn run(
    plan: PlacementPlan,
    dir: &Path,
    libvfio_user: Option<&Path>,
    umdev_binaries: &[PathBuf],
) -> Result<PlacementReport, BenchError> {
    let mut variants = vec![
        Variant::VfioUser,
        Variant::Umdev(PollMode::Off),
        Variant::Umdev(PollMode::Auto),
    ];
    if let Some(p) = libvfio_user {
        variants.push(Variant::LibVfioUser(p.to_path_buf()));
    }
    variants.extend(umdev_binaries.iter().cloned().map(Variant::UmdevBinary));
    let original = allowed_cpus()?;
    let mut report = PlacementReport {
        plan,
        cpus: Vec::new(),
        rows: Vec::new(),
        skipped: Vec::new(),
    };
    let Some(&first) = original.first() else {
        return Err(BenchError::Options(
            "no CPU in this thread's affinity".into(),
        ));
    };
    let mut placements = vec![("same core", first, first)];
    match original.get(1) {
        Some(&second) => placements.push(("cross core", first, second)),
        None => report
            .skipped
            .push("cross core: this thread may run on one CPU only".into()),
    }
    let result = (|| {
        for (i, &(name, server_cpu, client_cpu)) in placements.iter().enumerate() {
            report.cpus.push((server_cpu, client_cpu));
            let rows = placement(plan, dir, &variants, i, name, server_cpu, client_cpu)?;
            report.rows.extend(rows);
        }
        Ok::<_, BenchError>(())
    })();
    pin_to(&original)?;
    result?;
    Ok(report)
}

fn placement(
    plan: PlacementPlan,
    dir: &Path,
    variants: &[Variant],
    index: usize,
    name: &str,
    server_cpu: usize,
    client_cpu: usize,
) -> Result<Vec<PlacementRow>, BenchError> {
    pin_to(&[server_cpu])?;
    let mut started = Vec::new();
    let mut paths = Vec::new();
    for (v, variant) in variants.iter().enumerate() {
        let path = dir.join(format!("place-{index}-{v}.sock"));
        started.push(match variant {
            Variant::VfioUser => Started::Thread(spawn_vfio_user(&path, 1)?),
            Variant::Umdev(m) => Started::Umdev(spawn_umdev_with(&path, *m)?),
            Variant::LibVfioUser(_) | Variant::UmdevBinary(_) => {
                let mut cmd = match variant {
                    Variant::UmdevBinary(bin) => {
                        let mut c = std::process::Command::new(bin);
                        c.args(["run", "gpu", "--socket"])
                            .arg(&path)
                            .env("RUST_LOG", "warn")
                            .stderr(std::process::Stdio::null());
                        c
                    }
                    Variant::LibVfioUser(bin) => {
                        let mut c = std::process::Command::new(bin);
                        c.arg(&path);
                        c
                    }
                    _ => unreachable!("the arm matched a child variant"),
                };
                let child = cmd
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::null())
                    .spawn()?;
                let deadline = Instant::now() + Duration::from_secs(5);
                while !path.exists() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Started::Child(child)
            }
        });
        paths.push(path);
    }
    pin_to(&[client_cpu])?;
    let mut clients = paths
        .iter()
        .map(|p| client(p))
        .collect::<Result<Vec<_>, _>>()?;
    let io = |e: vfio_user::Error| BenchError::VfioUser(e.to_string());
    let mut buf = [0u8; 4];
    // Warm-up: every connection negotiated and hot.
    for (c, variant) in clients.iter_mut().zip(variants) {
        for _ in 0..plan.per_round.min(2000) {
            c.region_read(variant.region(), 0, &mut buf).map_err(io)?;
        }
    }
    // Server CPU: process CPU minus the client thread's for in-process servers; the
    // child process's own (all its threads) for the others.
    let server_cpu_time = |s: &Started| match s {
        Started::Child(c) => child_cpu(c.id()),
        _ => cputime::process().saturating_sub(cputime::thread()),
    };
    let n = variants.len();
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut cpu: Vec<Vec<f64>> = vec![Vec::new(); n];
    for round in 0..plan.rounds {
        for k in 0..n {
            let v = (k + round) % n;
            let (c, region) = (&mut clients[v], variants[v].region());
            let c0 = server_cpu_time(&started[v]);
            for _ in 0..plan.per_round {
                let s = Instant::now();
                c.region_read(region, 0, &mut buf).map_err(io)?;
                lat[v].push(s.elapsed().as_nanos() as f64);
            }
            let used = server_cpu_time(&started[v]).saturating_sub(c0);
            cpu[v].push(used.as_nanos() as f64 / plan.per_round as f64);
        }
    }
    // Idle: a burst, then nothing, on each umdev connection in turn.
    let mut idle = vec![None; n];
    for (v, variant) in variants.iter().enumerate() {
        if !matches!(variant, Variant::Umdev(_)) {
            continue;
        }
        for _ in 0..1000 {
            clients[v].region_read(0, 0, &mut buf).map_err(io)?;
        }
        let p0 = cputime::process();
        let w0 = Instant::now();
        std::thread::sleep(Duration::from_millis(plan.idle_ms));
        let used = cputime::process() - p0;
        idle[v] = Some(100.0 * used.as_secs_f64() / w0.elapsed().as_secs_f64());
    }
    for c in clients.iter_mut() {
        let _ = c.shutdown();
    }
    drop(clients);
    for s in started {
        match s {
            Started::Thread(t) => {
                let _ = t.join();
            }
            Started::Umdev(s) => stop_umdev(s),
            Started::Child(mut c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let reference = quantile(&lat[0], 0.5);
    Ok(variants
        .iter()
        .enumerate()
        .map(|(v, variant)| {
            let median = quantile(&lat[v], 0.5);
            PlacementRow {
                placement: name.into(),
                server: variant.name(),
                n: lat[v].len(),
                median_ns: median,
                p99_ns: quantile(&lat[v], 0.99),
                cpu_per_msg_ns: quantile(&cpu[v], 0.5),
                idle_cpu_pct: idle[v],
                ratio_to_reference: median / reference,
            }
        })
        .collect())
}

/// The placement table.
pub fn table(report: &PlacementReport) -> String {
    let mut t = Table::new(&[
        "placement",
        "server",
        ">median",
        ">p99",
        ">× ref",
        ">CPU/msg",
        ">idle CPU",
    ]);
    for r in &report.rows {
        t.row(vec![
            r.placement.clone(),
            r.server.clone(),
            format!("{:.2} µs", r.median_ns / 1e3),
            format!("{:.2} µs", r.p99_ns / 1e3),
            format!("{:.2}", r.ratio_to_reference),
            format!("{:.2} µs", r.cpu_per_msg_ns / 1e3),
            r.idle_cpu_pct
                .map(|p| format!("{p:.2} %"))
                .unwrap_or_else(|| "-".into()),
        ]);
    }
    let mut out = format!(
        "REGION_READ 4 B round trips by placement ({} interleaved rounds of {} per variant; \
         CPU/msg = server CPU time per message; idle CPU = process, {} ms after a burst)\n",
        report.plan.rounds, report.plan.per_round, report.plan.idle_ms
    );
    out.push_str(&t.render());
    for s in &report.skipped {
        out.push_str(&format!("not measured: {s}\n"));
    }
    out
}
