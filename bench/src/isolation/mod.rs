//! `umdev bench isolation`: one hostile client against seven victims in one process
//! (issue 17, "Done when"). For each attack ([`attack`]), **a process of its own** (this
//! binary, `umdev bench isolation --child ATTACK`, hidden) runs a [`Registry`] with the
//! daemon's GPU parent and eight `gpu-4m` instances: instance 0 gets the hostile client,
//! 1–7 a victim each ([`victim`]). In that process:
//!
//! 1. every victim samples for one block (**baseline**: the hostile client not yet
//!    connected);
//! 2. the victims pause, the attack is set up and left in place;
//! 3. every victim samples for one block (**attack**); then the results are written.
//!
//! The process is the daemon's stand-in: whether it **survived** is its exit status (a
//! signal, or no result within the time limit, is reported as such; the run goes on with
//! the next attack). Per victim and operation (region access, DMA_MAP+UNMAP, FENCE), the
//! p99 latency under attack over the baseline p99 is the ratio judged (target ≤ 2×);
//! every failed victim operation under attack is an error (target 0). The `idle` attack
//! (a client that does nothing) runs first: its ratios are what the machine's noise alone
//! gives.
//!
//! Attack sizes are capped (`--maps`, `--fd-messages`, and the child's RLIMIT_NOFILE,
//! `--nofile`), so a run against a server without budgets exhausts only the child
//! process, and the child runs with core dumps off. A child's log (stderr) goes to a file
//! of the run; the last line is quoted when the child did not survive.

pub mod attack;
pub mod victim;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use umdev::instance::{Params, Registry, RegistryConfig};
use umdev_devices::gpu::{GpuParent, GpuParentConfig};

use crate::machine::{self, MachineInfo};
use crate::progress::Progress;
use crate::report::{print_report, write_json};
use crate::stats::quantile;
use crate::table::Table;
use crate::{BenchError, OutputArgs};
use attack::{Attack, AttackOutcome, AttackSizes};
use victim::{PhaseCell, Victim, VictimSamples, OPS};

/// Version tag of the JSON layout.
pub const ISOLATION_SCHEMA: &str = "umdev-bench-isolation/1";
/// Instances in the process: one hostile, the rest victims.
pub const INSTANCES: usize = 8;
/// Victim p99 under attack / without.
pub const TARGET_P99_RATIO: f64 = 2.0;
/// Messages of the fd flood beyond what fills RLIMIT_NOFILE: the replies the server may
/// write before the client's unread socket is full (a few hundred; their fds are closed
/// when answered).
const FD_FLOOD_EXTRA: u64 = 1024;
/// How long the attack's requests get to arrive before the process's resources are read.
const SETTLE: Duration = Duration::from_millis(200);
/// How long the parent waits for a child beyond its two blocks.
const CHILD_SLACK: Duration = Duration::from_secs(90);

/// Arguments of `umdev bench isolation`.
#[derive(clap::Args, Debug, Default)]
pub struct IsolationArgs {
    /// Fast run: 1 s blocks, at most 2000 maps.
    #[arg(long)]
    pub quick: bool,
    /// The attacks to run, each in a process of its own [default: all].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub attacks: Option<Vec<Attack>>,
    /// Seconds of each block (baseline, attack) [default: 3; quick 1].
    #[arg(long)]
    pub seconds: Option<f64>,
    /// Most DMA maps of the map flood [default: 65535, all a server allows; quick 2000].
    #[arg(long)]
    pub maps: Option<u32>,
    /// Most messages of the fd flood, 16 fds each [default: enough to fill --nofile].
    #[arg(long)]
    pub fd_messages: Option<u32>,
    /// RLIMIT_NOFILE soft limit of each attack's process [default: 4096].
    #[arg(long, default_value_t = 4096)]
    pub nofile: u64,
    /// The servers' max_dma_maps [default: the server's].
    #[arg(long)]
    pub max_dma_maps: Option<u32>,
    /// A victim FENCE later than this many ms is an error [default: 2000].
    #[arg(long, default_value_t = 2000)]
    pub fence_timeout_ms: u64,
    /// Directory of the disk-file attack's file [default: $TMPDIR, /var/tmp or the
    /// current directory, the first on a disk filesystem].
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// Output options.
    #[command(flatten)]
    pub out: OutputArgs,
    /// Internal: run this attack's process with the plan in --child-plan.
    #[arg(long, hide = true, value_enum, requires_all = ["child_plan", "child_out"])]
    pub child: Option<Attack>,
    /// Internal: the plan of a --child process (JSON).
    #[arg(long, hide = true)]
    pub child_plan: Option<PathBuf>,
    /// Internal: where a --child process writes its result.
    #[arg(long, hide = true)]
    pub child_out: Option<PathBuf>,
}

/// What every attack's process is given.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Plan {
    /// Seconds per block.
    pub seconds: f64,
    /// Attack sizes.
    pub sizes: AttackSizes,
    /// RLIMIT_NOFILE soft limit of the process.
    pub nofile: u64,
    /// The servers' max_dma_maps (`None`: the server's default).
    pub max_dma_maps: Option<u32>,
    /// Victim FENCE timeout, ms.
    pub fence_timeout_ms: u64,
}

impl IsolationArgs {
    fn plan(&self) -> Plan {
        let seconds = self.seconds.unwrap_or(if self.quick { 1.0 } else { 3.0 });
        Plan {
            seconds: seconds.clamp(0.05, 600.0),
            sizes: AttackSizes {
                maps: self.maps.unwrap_or(if self.quick { 2000 } else { 65535 }),
                fd_messages: self.fd_messages.unwrap_or(
                    u32::try_from(self.nofile / 16 + FD_FLOOD_EXTRA).unwrap_or(u32::MAX),
                ),
                disk_dir: self.disk_dir.clone(),
            },
            nofile: self.nofile.max(64),
            max_dma_maps: self.max_dma_maps,
            fence_timeout_ms: self.fence_timeout_ms.max(1),
        }
    }
}

/// Process-wide resources at one moment.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Resources {
    /// Open fds.
    pub fds: usize,
    /// Lines of /proc/self/maps (VMAs).
    pub vmas: usize,
    /// Threads.
    pub threads: usize,
}

fn resources() -> Resources {
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    let vmas = std::fs::read_to_string("/proc/self/maps").map_or(0, |m| m.lines().count());
    Resources {
        fds: umdev::testing::open_fds(),
        vmas,
        threads,
    }
}

/// What an attack's process writes.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ChildResult {
    /// The attack.
    pub attack: Option<Attack>,
    /// What the attack did (`None`: it could not be set up, see `error`).
    pub outcome: Option<AttackOutcome>,
    /// The victims, instance 1..=7.
    pub victims: Vec<VictimSamples>,
    /// Resources before the attack, once it is in place, and at the end of its block.
    pub resources: [Resources; 3],
    /// Why the run stopped early.
    pub error: Option<String>,
}

/// One victim's ratio for one operation.
#[derive(Clone, Debug, serde::Serialize)]
pub struct OpResult {
    /// The operation.
    pub op: &'static str,
    /// Baseline samples, attack samples.
    pub n: (usize, usize),
    /// Baseline p99, µs.
    pub baseline_p99_us: f64,
    /// Attack p99, µs.
    pub attack_p99_us: f64,
    /// Attack / baseline.
    pub ratio: f64,
    /// Errors in the baseline and in the attack block.
    pub errors: (u64, u64),
}

/// The result of one attack.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AttackResult {
    /// The attack.
    pub attack: Attack,
    /// `exited 0`, `killed by signal N`, `no result within N s (killed)`, ...
    pub process: String,
    /// Whether the process ended by itself with status 0.
    pub survived: bool,
    /// What the process wrote (if it wrote anything).
    pub child: Option<ChildResult>,
    /// Per victim, per operation.
    pub victims: Vec<Vec<OpResult>>,
    /// The largest ratio over victims and operations, with where.
    pub worst_ratio: f64,
    /// Where the worst ratio is (`#victim op`).
    pub worst_at: String,
    /// Victim errors under attack.
    pub attack_errors: u64,
}

/// Everything `umdev bench isolation --json` writes.
#[derive(Clone, Debug, serde::Serialize)]
pub struct IsolationReport {
    /// [`ISOLATION_SCHEMA`].
    pub schema: &'static str,
    /// `isolation`.
    pub bench: &'static str,
    /// The command line.
    pub command: Vec<String>,
    /// The plan every attack ran with.
    pub plan: Plan,
    /// Machine and build.
    pub machine: MachineInfo,
    /// The attacks.
    pub attacks: Vec<AttackResult>,
    /// The targets with verdicts.
    pub targets: Vec<crate::instances::TargetRow>,
    /// Wall time, s.
    pub elapsed_s: f64,
}

fn set_limit(resource: libc::__rlimit_resource_t, soft: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer for the duration of the call.
    if unsafe { libc::getrlimit(resource, &mut lim) } != 0 {
        return;
    }
    lim.rlim_cur = soft.min(lim.rlim_max);
    // SAFETY: a valid rlimit with the soft limit at most the hard limit.
    unsafe { libc::setrlimit(resource, &lim) };
}

/// Run one attack in this process (the `--child` side).
pub fn run_child(attack: Attack, plan: &Plan) -> ChildResult {
    set_limit(libc::RLIMIT_CORE, 0);
    set_limit(libc::RLIMIT_NOFILE, plan.nofile);
    let mut out = ChildResult {
        attack: Some(attack),
        ..ChildResult::default()
    };
    if let Err(e) = child_body(attack, plan, &mut out) {
        out.error = Some(e);
    }
    out
}

fn child_body(attack: Attack, plan: &Plan, out: &mut ChildResult) -> Result<(), String> {
    let dir = tempfile::Builder::new()
        .prefix("umdev-bench-iso-")
        .tempdir()
        .map_err(|e| format!("tempdir: {e}"))?;
    let parent = GpuParent::new(GpuParentConfig::default()).map_err(|e| e.to_string())?;
    let mut config = RegistryConfig::new(dir.path().join("sockets"));
    if let Some(n) = plan.max_dma_maps {
        config.server.max_dma_maps = n;
    }
    let registry = Registry::new(config).map_err(|e| e.to_string())?;
    registry
        .add_parent(Arc::new(parent))
        .map_err(|e| e.to_string())?;
    let mut sockets = Vec::new();
    for _ in 0..INSTANCES {
        let info = registry
            .create("gpu-4m", None, &Params::new())
            .map_err(|e| format!("create: {e}"))?;
        sockets.push(info.socket);
    }
    let phase = PhaseCell::default();
    let timeout = Duration::from_millis(plan.fence_timeout_ms);
    let mut threads = Vec::new();
    for (i, s) in sockets.iter().enumerate().skip(1) {
        let v = Victim::connect(s, timeout).map_err(|e| format!("victim #{i}: {e}"))?;
        let p = phase.clone();
        threads.push(
            std::thread::Builder::new()
                .name(format!("victim-{i}"))
                .spawn(move || v.run(p, 0x150 + i as u64))
                .map_err(|e| format!("victim thread: {e}"))?,
        );
    }
    let block = Duration::from_secs_f64(plan.seconds);
    let result = (|| {
        phase.set(victim::Phase::Baseline);
        std::thread::sleep(block);
        phase.set(victim::Phase::Idle);
        out.resources[0] = resources();
        let (hostile, outcome) = attack::start(attack, &sockets[0], &plan.sizes)?;
        out.outcome = Some(outcome);
        std::thread::sleep(SETTLE);
        out.resources[1] = resources();
        phase.set(victim::Phase::Attack);
        std::thread::sleep(block);
        phase.set(victim::Phase::Idle);
        out.resources[2] = resources();
        Ok::<_, String>(hostile)
    })();
    phase.set(victim::Phase::Exit);
    for t in threads {
        out.victims.push(t.join().unwrap_or_else(|_| VictimSamples {
            gave_up: Some("victim thread panicked".into()),
            ..VictimSamples::default()
        }));
    }
    // The hostile client stays connected until every victim has finished.
    drop(result?);
    Ok(())
}

/// The ratios of one victim.
fn victim_ops(v: &VictimSamples) -> Vec<OpResult> {
    (0..OPS.len())
        .map(|i| {
            let (b, a) = (&v.baseline.us[i], &v.attack.us[i]);
            let (bp, ap) = (quantile(b, 0.99), quantile(a, 0.99));
            OpResult {
                op: OPS[i],
                n: (b.len(), a.len()),
                baseline_p99_us: bp,
                attack_p99_us: ap,
                ratio: ap / bp,
                errors: (v.baseline.errors[i], v.attack.errors[i]),
            }
        })
        .collect()
}

/// Judge one attack's process.
pub fn judge(
    attack: Attack,
    process: String,
    survived: bool,
    child: Option<ChildResult>,
) -> AttackResult {
    let victims: Vec<Vec<OpResult>> = child
        .as_ref()
        .map_or(Vec::new(), |c| c.victims.iter().map(victim_ops).collect());
    let mut worst_ratio = f64::NAN;
    let mut worst_at = "-".to_string();
    let mut attack_errors = 0;
    for (i, ops) in victims.iter().enumerate() {
        for o in ops {
            attack_errors += o.errors.1;
            // NaN (no samples) is worse than any number.
            let ratio = if o.ratio.is_nan() {
                f64::INFINITY
            } else {
                o.ratio
            };
            if worst_ratio.is_nan() || ratio > worst_ratio {
                worst_ratio = ratio;
                worst_at = format!("#{} {}", i + 1, o.op);
            }
        }
    }
    AttackResult {
        attack,
        process,
        survived,
        child,
        victims,
        worst_ratio,
        worst_at,
        attack_errors,
    }
}

fn wait_child(mut child: std::process::Child, limit: Duration) -> std::io::Result<(String, bool)> {
    use std::os::unix::process::ExitStatusExt;
    let deadline = Instant::now() + limit;
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(match (st.code(), st.signal()) {
                (Some(0), _) => ("exited 0".into(), true),
                (Some(c), _) => (format!("exited {c}"), false),
                (None, Some(s)) => (format!("killed by signal {s}"), false),
                (None, None) => (format!("{st}"), false),
            });
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok((
                format!("no exit within {} s (killed)", limit.as_secs()),
                false,
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn run_in_child(attack: Attack, plan: &Plan, dir: &Path) -> Result<AttackResult, BenchError> {
    let plan_path = dir.join(format!("{}.plan.json", attack.name()));
    let out_path = dir.join(format!("{}.json", attack.name()));
    let log_path = dir.join(format!("{}.log", attack.name()));
    write_json(&plan_path, plan)?;
    let child = std::process::Command::new(std::env::current_exe()?)
        .args(["bench", "isolation", "--quiet", "--child", attack.name()])
        .arg("--child-plan")
        .arg(&plan_path)
        .arg("--child-out")
        .arg(&out_path)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log_path)?)
        .spawn()?;
    let limit = Duration::from_secs_f64(2.0 * plan.seconds) + CHILD_SLACK;
    let (mut process, survived) = wait_child(child, limit)?;
    if !survived {
        let log = std::fs::read_to_string(&log_path).unwrap_or_default();
        if let Some(last) = log.lines().rev().find(|l| !l.trim().is_empty()) {
            process.push_str(&format!("; its last log line: {}", last.trim()));
        }
    }
    let result = std::fs::read_to_string(&out_path)
        .ok()
        .and_then(|t| serde_json::from_str::<ChildResult>(&t).ok());
    Ok(judge(attack, process, survived, result))
}

/// Entry point of `umdev bench isolation`.
pub fn run(args: IsolationArgs) -> Result<(), BenchError> {
    if let Some(attack) = args.child {
        let (Some(plan), Some(out)) = (&args.child_plan, &args.child_out) else {
            return Err(BenchError::Options(
                "--child needs --child-plan and --child-out".into(),
            ));
        };
        let text = std::fs::read_to_string(plan)?;
        let plan: Plan =
            serde_json::from_str(&text).map_err(|e| BenchError::Io(std::io::Error::other(e)))?;
        let result = run_child(attack, &plan);
        write_json(out, &result)?;
        return Ok(());
    }
    let started = Instant::now();
    let plan = args.plan();
    let attacks = args.attacks.clone().unwrap_or_else(|| Attack::ALL.to_vec());
    if attacks.is_empty() {
        return Err(BenchError::Options("--attacks is empty".into()));
    }
    let dir = tempfile::Builder::new()
        .prefix("umdev-bench-isolation-")
        .tempdir()?;
    let mut progress = Progress::for_run(args.out.quiet, attacks.len());
    let mut results = Vec::new();
    for &a in &attacks {
        progress.start_step(&format!("isolation: {}", a.name()));
        let r = run_in_child(a, &plan, dir.path())?;
        if !r.survived {
            progress.note(&format!("{}: the process {}", a.name(), r.process));
        }
        results.push(r);
        progress.finish_step();
    }
    progress.finish();
    let report = IsolationReport {
        schema: ISOLATION_SCHEMA,
        bench: "isolation",
        command: std::env::args().collect(),
        targets: targets(&results),
        plan,
        machine: machine::collect(),
        attacks: results,
        elapsed_s: started.elapsed().as_secs_f64(),
    };
    print_report(
        "isolation",
        &args.out,
        &report.machine,
        &render(&report),
        &report,
    )?;
    println!("{:.1} s", report.elapsed_s);
    Ok(())
}

fn verdict(ok: bool) -> String {
    if ok { "pass" } else { "MISS" }.into()
}

/// The targets, per attack (the `idle` control is judged too: a miss there is the
/// machine's noise, and says how far the other rows can be trusted).
pub fn targets(results: &[AttackResult]) -> Vec<crate::instances::TargetRow> {
    use crate::instances::TargetRow;
    let mut rows = Vec::new();
    for r in results {
        let name = r.attack.name();
        rows.push(TargetRow {
            target: format!("{name}: the process survives"),
            limit: "exits 0".into(),
            measured: r.process.clone(),
            verdict: verdict(r.survived),
        });
        let setup_failed = r.child.as_ref().and_then(|c| c.error.clone());
        rows.push(TargetRow {
            target: format!("{name}: victims' p99 under attack / without (worst)"),
            limit: format!("≤ {TARGET_P99_RATIO:.0}×"),
            measured: match &setup_failed {
                Some(e) => format!("not run: {e}"),
                None if r.victims.is_empty() => "no result".into(),
                None => format!("{:.2}× ({})", r.worst_ratio, r.worst_at),
            },
            verdict: verdict(
                setup_failed.is_none()
                    && !r.victims.is_empty()
                    && r.worst_ratio <= TARGET_P99_RATIO,
            ),
        });
        rows.push(TargetRow {
            target: format!("{name}: victim errors under attack"),
            limit: "0".into(),
            measured: if r.victims.is_empty() {
                "no result".into()
            } else {
                r.attack_errors.to_string()
            },
            verdict: verdict(!r.victims.is_empty() && r.attack_errors == 0),
        });
        if r.attack == Attack::DiskFile {
            let refused = r
                .child
                .as_ref()
                .and_then(|c| c.outcome.as_ref())
                .map(|o| o.accepted == 0);
            rows.push(TargetRow {
                target: "disk-file: DMA_MAP of a regular disk file".into(),
                limit: "refused".into(),
                measured: match refused {
                    Some(true) => "refused".into(),
                    Some(false) => "accepted".into(),
                    None => "no result".into(),
                },
                verdict: verdict(refused == Some(true)),
            });
        }
    }
    rows
}

fn f1(v: f64) -> String {
    if v.is_finite() {
        format!("{v:.1}")
    } else {
        "-".into()
    }
}

fn times(v: f64) -> String {
    if v.is_nan() {
        "-".into()
    } else {
        format!("{v:.2}×")
    }
}

/// The terminal report.
pub fn render(r: &IsolationReport) -> String {
    let mut out = format!(
        "\nisolation: {INSTANCES} gpu-4m instances in one process per attack: instance 0 \
         hostile, 1-{} victims; {:.1} s baseline block, then the attack, then {:.1} s under \
         attack\n",
        INSTANCES - 1,
        r.plan.seconds,
        r.plan.seconds
    );
    for a in &r.attacks {
        out.push_str(&format!("\n{}: process {}\n", a.attack.name(), a.process));
        if let Some(c) = &a.child {
            if let Some(o) = &c.outcome {
                out.push_str(&format!(
                    "  attack: {} ({:.2} s){}\n",
                    o.summary,
                    o.setup_s,
                    o.refused
                        .as_ref()
                        .map_or(String::new(), |e| format!("; first refusal: {e}"))
                ));
            }
            let [b, p, e] = &c.resources;
            out.push_str(&format!(
                "  process fds / VMAs / threads: before {} / {} / {}, attack in place {} / {} / \
                 {}, end {} / {} / {}\n",
                b.fds, b.vmas, b.threads, p.fds, p.vmas, p.threads, e.fds, e.vmas, e.threads
            ));
            if let Some(e) = &c.error {
                out.push_str(&format!("  stopped early: {e}\n"));
            }
        }
        if a.victims.is_empty() {
            continue;
        }
        let mut t = Table::new(&[
            "op",
            ">n base+attack",
            ">p99 base µs (median victim)",
            ">p99 attack µs (median victim)",
            ">ratio median victim",
            ">ratio worst victim",
            ">errors base",
            ">errors attack",
        ]);
        for (i, op) in OPS.iter().enumerate() {
            let col = |f: &dyn Fn(&OpResult) -> f64| -> Vec<f64> {
                a.victims.iter().map(|v| f(&v[i])).collect()
            };
            let ratios = col(&|o| o.ratio);
            let worst =
                ratios
                    .iter()
                    .copied()
                    .fold(f64::NAN, |m, x| if x > m || m.is_nan() { x } else { m });
            let (nb, na): (usize, usize) = a
                .victims
                .iter()
                .fold((0, 0), |(x, y), v| (x + v[i].n.0, y + v[i].n.1));
            let (eb, ea): (u64, u64) = a
                .victims
                .iter()
                .fold((0, 0), |(x, y), v| (x + v[i].errors.0, y + v[i].errors.1));
            t.row(vec![
                op.to_string(),
                format!("{nb}+{na}"),
                f1(quantile(&col(&|o| o.baseline_p99_us), 0.5)),
                f1(quantile(&col(&|o| o.attack_p99_us), 0.5)),
                times(quantile(&ratios, 0.5)),
                times(worst),
                eb.to_string(),
                ea.to_string(),
            ]);
        }
        out.push_str(&t.render());
        if let Some(c) = &a.child {
            for (i, v) in c.victims.iter().enumerate() {
                if let Some(e) = v.attack.first_error.as_ref().or(v.gave_up.as_ref()) {
                    out.push_str(&format!("  victim #{}: {e}\n", i + 1));
                }
            }
        }
    }
    out.push_str("\ntargets (issue 17)\n");
    let mut t = Table::new(&["target", "limit", "measured", "verdict"]);
    for row in &r.targets {
        t.row(vec![
            row.target.clone(),
            row.limit.clone(),
            row.measured.clone(),
            row.verdict.clone(),
        ]);
    }
    out.push_str(&t.render());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples(base: f64, attack: f64, errors: u64) -> VictimSamples {
        let mut v = VictimSamples::default();
        for i in 0..3 {
            v.baseline.us[i] = vec![base; 100];
            v.attack.us[i] = vec![attack; 100];
        }
        v.attack.errors[2] = errors;
        v
    }

    fn child(victims: Vec<VictimSamples>) -> ChildResult {
        ChildResult {
            attack: Some(Attack::DiskFile),
            outcome: Some(AttackOutcome {
                accepted: 1,
                ..AttackOutcome::default()
            }),
            victims,
            ..ChildResult::default()
        }
    }

    #[test]
    fn test_judge_takes_the_worst_victim_and_counts_attack_errors() {
        let r = judge(
            Attack::DiskFile,
            "exited 0".into(),
            true,
            Some(child(vec![samples(10.0, 12.0, 0), samples(10.0, 35.0, 2)])),
        );
        assert!((r.worst_ratio - 3.5).abs() < 1e-9, "{}", r.worst_ratio);
        assert_eq!(r.worst_at, "#2 region");
        assert_eq!(r.attack_errors, 2);
        let rows = targets(&[r]);
        let v: Vec<&str> = rows.iter().map(|r| r.verdict.as_str()).collect();
        // survived; ratio 3.5× misses; 2 errors miss; the disk file was accepted: miss.
        assert_eq!(v, ["pass", "MISS", "MISS", "MISS"], "{rows:?}");
    }

    #[test]
    fn test_targets_pass_only_with_results_and_a_live_process() {
        let good = judge(
            Attack::Idle,
            "exited 0".into(),
            true,
            Some(child(vec![samples(10.0, 11.0, 0)])),
        );
        assert!(targets(&[good]).iter().all(|r| r.verdict == "pass"));
        let dead = judge(Attack::MapFlood, "killed by signal 6".into(), false, None);
        let rows = targets(&[dead]);
        assert!(rows.iter().all(|r| r.verdict == "MISS"), "{rows:?}");
        assert_eq!(rows[1].measured, "no result");
    }

    #[test]
    fn test_a_victim_without_samples_is_the_worst() {
        let mut v = samples(10.0, 11.0, 0);
        v.attack.us[2].clear();
        let r = judge(Attack::Idle, "exited 0".into(), true, Some(child(vec![v])));
        assert!(r.worst_ratio.is_infinite(), "{}", r.worst_ratio);
        assert_eq!(r.worst_at, "#1 fence");
    }

    #[test]
    fn test_plan_quick_and_defaults() {
        let mut a = IsolationArgs {
            nofile: 4096,
            fence_timeout_ms: 2000,
            ..IsolationArgs::default()
        };
        let p = a.plan();
        assert_eq!(
            (p.seconds, p.sizes.maps, p.sizes.fd_messages),
            (3.0, 65535, 1280)
        );
        a.quick = true;
        assert_eq!(a.plan().seconds, 1.0);
        assert_eq!(a.plan().sizes.maps, 2000);
    }
}
