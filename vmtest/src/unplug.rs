//! The `unplug` guest run: removing instances of a `umdev daemon` while the guest uses
//! them (issue 12, item 2: the QEMU side of removal with a client attached).
//!
//! The daemon serves GPU instance A behind a `pcie-root-port` (hotplug, QEMU id `gpu-a`),
//! GPU instance B on q35's root bus `pcie.0` (no hotplug, id `gpu-b`) and a ccw instance
//! behind a root port. The guest (`guest/src/unplug.rs`) uses each GPU, then prints a cue
//! and waits; at each cue this module does what an operator would:
//!
//! | cue | actions | what must happen |
//! |---|---|---|
//! | `UMDEV-READY unplug remove` | `umdev list`; `umdev remove A` (waits for the client); QMP `device_del gpu-a` unless QEMU answers the request IRQ itself; `umdev list` | A has a client and pinned pages before; the guest ejects A, QEMU frees it (no abort: the fix) and closes the socket, the removal succeeds without force, 0 pins left |
//! | `UMDEV-READY unplug-busy remove` | `umdev list`; `umdev remove B`; QMP `device_del gpu-b`; `umdev remove B --force`; `umdev list` | B has a client and pinned pages before; `busy` after the release timeout; QEMU refuses the unplug (no hotplug on `pcie.0`); `--force` disconnects QEMU, 0 pins left |
//!
//! Why `device_del`: QEMU 10.2.2's `vfio-user-pci` never registers the device-request IRQ
//! ([`crate::qemu_unplug`]), so the IRQ umdev signals reaches nobody and QEMU does not
//! start the unplug by itself; the operator's `device_del` is the same `qdev_unplug` call
//! QEMU's request handler would make. A QEMU that does answer the IRQ (its `vfio-user-pci`
//! has `x-req`) is left to unplug A itself, and the checks expect that instead.
//!
//! After the guest powered off, the checks here look at the commands' JSON replies, the QMP
//! replies and events, the daemon's log, QEMU's exit (no abort) and the daemon's SIGTERM;
//! the guest checks what it saw itself. The run needs a QEMU with the vfio-user unplug fix.

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::sync::mpsc::Receiver;
use std::time::Duration;

use serde_json::Value;

use crate::daemon::{Cli, Daemon, Stopped};
use crate::qemu::{Attach, Run, Slot};
use crate::qmp::Qmp;
use crate::report::{Check, Measure};

/// GPU instance A (behind a root port: QEMU can unplug it).
pub const GPU_A: &str = "0a000000-0000-4000-8000-00000000000a";
/// GPU instance B (on the root bus: QEMU cannot unplug it).
pub const GPU_B: &str = "0b000000-0000-4000-8000-00000000000b";
/// The ccw instance (behind a root port; must keep serving).
pub const CCW: &str = "0c000000-0000-4000-8000-00000000000c";
/// The daemon's `--release-timeout` (its default).
pub const RELEASE: Duration = Duration::from_secs(10);
/// Bound on one client command (a removal waits up to RELEASE, then a teardown).
const CLI_LIMIT: Duration = Duration::from_secs(60);

/// Bound on a QMP reply.
const QMP_LIMIT: Duration = Duration::from_secs(10);

/// The instances of the run: (UUID, type, where QEMU puts it, QEMU id), in command-line
/// order.
const INSTANCES: &[(&str, &str, Slot, &str)] = &[
    (GPU_A, "gpu-4m", Slot::RootPort, "gpu-a"),
    (CCW, "ccw-16m", Slot::RootPort, "ccw"),
    (GPU_B, "gpu-4m", Slot::RootBus, "gpu-b"),
];

/// What the QEMU under test does (see [`crate::qemu_unplug`]).
#[derive(Clone, Copy, Debug)]
pub struct QemuSide {
    /// Its `vfio-user-pci` answers the device-request IRQ with an unplug.
    pub handles_request_irq: bool,
}

/// One QMP exchange of a step.
#[derive(Clone, Debug, Default)]
pub struct QmpRecord {
    /// The device `device_del` was sent for (None: only waited for QEMU to unplug).
    pub device_del: Option<String>,
    /// QEMU's reply (`{"return": {}}` or `{"error": ...}`).
    pub reply: Option<Value>,
    /// From the cue to QEMU's `DEVICE_DELETED` for the device (None: not seen).
    pub deleted_after: Option<Duration>,
    /// What went wrong talking to QMP.
    pub error: Option<String>,
}

impl QmpRecord {
    fn summary(&self) -> String {
        format!(
            "QMP {}: reply {}, DEVICE_DELETED {}{}",
            self.device_del
                .as_deref()
                .map(|d| format!("device_del {d}"))
                .unwrap_or_else(|| "(no command)".into()),
            self.reply
                .as_ref()
                .map(|v| v.to_string())
                .unwrap_or_else(|| "-".into()),
            self.deleted_after
                .map(|d| format!("{:.2} s after the cue", d.as_secs_f64()))
                .unwrap_or_else(|| "not seen".into()),
            self.error
                .as_deref()
                .map(|e| format!(", error: {e}"))
                .unwrap_or_default()
        )
    }
}

/// What the harness did at one cue of the guest.
#[derive(Debug)]
pub struct Step {
    /// The scenario that gave the cue.
    pub scenario: String,
    /// The cue.
    pub cue: String,
    /// When the cue came (console time).
    pub at: Duration,
    /// The commands run, in order.
    pub cli: Vec<Cli>,
    /// The QMP exchanges, in order.
    pub qmp: Vec<QmpRecord>,
    /// The daemon's log line saying how the removal asked the client (request IRQ or not).
    pub request_line: Option<String>,
}

/// Create the instances; the devices for QEMU, or the failed creations as checks.
pub fn create(d: &Daemon) -> Result<Vec<Attach>, Vec<Check>> {
    let mut failed = Vec::new();
    for (uuid, ty, _, _) in INSTANCES {
        let c = d.cli(&["create", "--type", ty, "--uuid", uuid], CLI_LIMIT);
        let created = c.json().and_then(|v| {
            v.pointer("/instance/uuid")
                .and_then(Value::as_str)
                .map(|u| u == *uuid)
        });
        if c.code != Some(0) || created != Some(true) {
            failed.push(Check::new(
                format!("unplug.create_{ty}"),
                false,
                c.summary(),
            ));
        }
    }
    if !failed.is_empty() {
        return Err(failed);
    }
    Ok(INSTANCES
        .iter()
        .map(|&(uuid, _, slot, id)| Attach {
            socket: d.socket(uuid),
            slot,
            id: Some(id.to_string()),
        })
        .collect())
}

/// Is (`scenario`, `cue`) a cue this module acts on?
fn known(scenario: &str, cue: &str) -> bool {
    matches!((scenario, cue), ("unplug" | "unplug-busy", "remove"))
}

/// How the daemon logs a removal that found a client attached (with or without a request
/// IRQ to signal).
const REQUEST_LINES: [&str; 2] = [
    "device request IRQ signalled",
    "the client has no request IRQ registered",
];

/// Send `device_del` for `id` (if `del`), then wait up to `wait` for its `DEVICE_DELETED`.
fn unplug_via_qmp(
    qmp: &mut Option<Qmp>,
    path: &std::path::Path,
    id: &str,
    del: bool,
    wait: Duration,
    cue: std::time::Instant,
) -> QmpRecord {
    let mut rec = QmpRecord {
        device_del: del.then(|| id.to_string()),
        ..Default::default()
    };
    if qmp.is_none() {
        match Qmp::connect(path, Duration::from_secs(5)) {
            Ok(q) => *qmp = Some(q),
            Err(e) => {
                rec.error = Some(e.to_string());
                return rec;
            }
        }
    }
    let Some(q) = qmp.as_mut() else {
        return rec;
    };
    if del {
        match q.execute("device_del", serde_json::json!({ "id": id }), QMP_LIMIT) {
            Ok(v) => rec.reply = Some(v),
            Err(e) => {
                rec.error = Some(e.to_string());
                return rec;
            }
        }
        if rec.reply.as_ref().is_some_and(|v| v.get("error").is_some()) {
            return rec;
        }
    }
    match q.wait_event("DEVICE_DELETED", id, wait) {
        Ok(t) => rec.deleted_after = Some(t.saturating_duration_since(cue)),
        Err(e) => rec.error = Some(e.to_string()),
    }
    rec
}

/// Act on the guest's cues until the console ends. `qmp` is QEMU's QMP socket.
pub fn act(
    console: Receiver<(Duration, String)>,
    d: &Daemon,
    qmp_path: &std::path::Path,
    qemu: QemuSide,
) -> Vec<Step> {
    let mut steps = Vec::new();
    let mut qmp = None;
    for (at, line) in console {
        let Some(i) = line.find("UMDEV-READY") else {
            continue;
        };
        let mut w = line[i..].split_whitespace().skip(1);
        let (scenario, cue) = (w.next().unwrap_or("?"), w.next().unwrap_or("?"));
        eprintln!(
            "vmtest: guest cue '{scenario} {cue}' at {:.1} s",
            at.as_secs_f64()
        );
        let t0 = std::time::Instant::now();
        let mut step = Step {
            scenario: scenario.to_string(),
            cue: cue.to_string(),
            at,
            cli: vec![],
            qmp: vec![],
            request_line: None,
        };
        let run = |args: &[&str]| {
            let c = d.cli(args, CLI_LIMIT);
            eprintln!("vmtest:   {}", c.summary());
            c
        };
        match (scenario, cue) {
            ("unplug", "remove") => {
                // What A holds while the guest uses it (what the removal must release).
                step.cli.push(run(&["list"]));
                // The removal waits for the client; meanwhile QEMU must let go of A.
                let (remove, rec, line) = std::thread::scope(|s| {
                    let remove = s.spawn(|| run(&["remove", GPU_A]));
                    let line = d.wait_log(GPU_A, &REQUEST_LINES, Duration::from_secs(5));
                    let rec = unplug_via_qmp(
                        &mut qmp,
                        qmp_path,
                        "gpu-a",
                        !qemu.handles_request_irq,
                        RELEASE + Duration::from_secs(5),
                        t0,
                    );
                    (remove.join(), rec, line)
                });
                eprintln!("vmtest:   {}", rec.summary());
                step.request_line = line;
                step.cli.extend(remove.ok());
                step.qmp.push(rec);
                step.cli.push(run(&["list"]));
            }
            ("unplug-busy", "remove") => {
                step.cli.push(run(&["list"]));
                step.cli.push(run(&["remove", GPU_B]));
                step.request_line = d.wait_log(GPU_B, &REQUEST_LINES, Duration::ZERO);
                let rec = unplug_via_qmp(&mut qmp, qmp_path, "gpu-b", true, Duration::ZERO, t0);
                eprintln!("vmtest:   {}", rec.summary());
                step.qmp.push(rec);
                step.cli.push(run(&["remove", GPU_B, "--force"]));
                step.cli.push(run(&["list"]));
            }
            _ => {}
        }
        steps.push(step);
    }
    steps
}

/// `v` at JSON pointer `p` as text (for details), "-" if absent.
fn show(v: &Option<Value>, p: &str) -> String {
    v.as_ref()
        .and_then(|v| v.pointer(p))
        .map(|x| x.to_string())
        .unwrap_or_else(|| "-".into())
}

fn is(v: &Option<Value>, p: &str, want: Value) -> bool {
    v.as_ref().and_then(|v| v.pointer(p)) == Some(&want)
}

/// The UUIDs `umdev list --json` printed (None: not a list reply).
fn listed(c: &Cli) -> Option<BTreeSet<String>> {
    let v = c.json()?;
    let arr = v.pointer("/instances")?.as_array()?;
    Some(
        arr.iter()
            .filter_map(|i| i.pointer("/uuid").and_then(Value::as_str))
            .map(str::to_string)
            .collect(),
    )
}

/// `uuid` in a `umdev list --json` reply taken before its removal had a client attached and
/// pinned guest pages (so the removal's "0 pins left" means pins were released).
fn held_check(p: &str, c: &Cli, uuid: &str, v: &mut Vec<Check>) {
    let j = c.json();
    let entry = j
        .as_ref()
        .and_then(|v| v.pointer("/instances"))
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter()
                .find(|i| i.pointer("/uuid").and_then(Value::as_str) == Some(uuid))
        });
    let attached = entry.and_then(|e| e.pointer("/client_attached").and_then(Value::as_bool));
    let pinned = entry.and_then(|e| e.pointer("/dma/pinned_pages").and_then(Value::as_u64));
    v.push(Check::new(
        format!("{p}.held_before"),
        attached == Some(true) && pinned.is_some_and(|n| n > 0),
        format_args!("before the removal: client_attached {attached:?}, pinned_pages {pinned:?}"),
    ));
}

/// The daemon's log lines that mention `uuid` and contain `what`.
fn logged<'a>(log: &'a str, uuid: &str, what: &str) -> Vec<&'a str> {
    log.lines()
        .filter(|l| l.contains(uuid) && l.contains(what))
        .collect()
}

/// The checks of one removal reply: `forced` as expected, a client was attached, the
/// request IRQ signalled exactly if QEMU registered it, nothing mapped, pinned or locked
/// afterwards and no pin the device had to be relieved of.
fn removal_checks(p: &str, c: &Cli, forced: bool, requested: bool, v: &mut Vec<Check>) {
    let j = c.json();
    v.push(Check::new(
        format!("{p}.reply"),
        c.code == Some(0)
            && is(&j, "/stopped/forced", Value::Bool(forced))
            && is(&j, "/stopped/client_was_attached", Value::Bool(true))
            && is(&j, "/stopped/release_requested", Value::Bool(requested)),
        format_args!(
            "exit {:?} in {:.2} s; client_was_attached {}, release_requested {} (want \
             {requested}), forced {} (want {forced}), waited_ms {}",
            c.code,
            c.elapsed.as_secs_f64(),
            show(&j, "/stopped/client_was_attached"),
            show(&j, "/stopped/release_requested"),
            show(&j, "/stopped/forced"),
            show(&j, "/stopped/waited_ms"),
        ),
    ));
    let zero = Value::from(0u64);
    v.push(Check::new(
        format!("{p}.no_pins_left"),
        is(&j, "/stopped/dma/pinned_pages", zero.clone())
            && is(&j, "/stopped/dma/locked_pages", zero.clone())
            && is(&j, "/stopped/dma/leaked_pins_released", zero.clone())
            && is(&j, "/stopped/dma/maps", zero),
        format_args!(
            "after the teardown: maps {}, pinned_pages {}, locked_pages {}, \
             leaked_pins_released {}",
            show(&j, "/stopped/dma/maps"),
            show(&j, "/stopped/dma/pinned_pages"),
            show(&j, "/stopped/dma/locked_pages"),
            show(&j, "/stopped/dma/leaked_pins_released"),
        ),
    ));
}

/// The daemon logged the removal's request as QEMU's side makes it: the request IRQ
/// signalled, or "no request IRQ registered".
fn request_check(p: &str, s: &Step, qemu: QemuSide, v: &mut Vec<Check>) {
    let want = REQUEST_LINES[usize::from(!qemu.handles_request_irq)];
    v.push(Check::new(
        format!("{p}.daemon_request_logged"),
        s.request_line.as_deref().is_some_and(|l| l.contains(want)),
        format_args!(
            "want '{want}': {}",
            s.request_line
                .as_deref()
                .map(str::trim)
                .unwrap_or("no such line")
        ),
    ));
}

/// The step of a cue with its commands, or a failed check saying it never came.
fn step<'a>(
    steps: &'a [Step],
    scenario: &str,
    p: &str,
    cli: usize,
    v: &mut Vec<Check>,
) -> Option<&'a Step> {
    let s = steps
        .iter()
        .find(|s| s.scenario == scenario && s.cue == "remove");
    let complete = s.filter(|s| s.cli.len() == cli && s.qmp.len() == 1);
    v.push(Check::new(
        format!("{p}.cue_acted"),
        complete.is_some(),
        match s {
            Some(s) => format!(
                "cue at {:.1} s, {} commands, {} QMP exchanges",
                s.at.as_secs_f64(),
                s.cli.len(),
                s.qmp.len()
            ),
            None => "the guest never gave the cue".to_string(),
        },
    ));
    complete
}

/// Everything the host checks after the run (see the module docs), and the timings.
pub fn checks(
    scenarios: &[&str],
    steps: &[Step],
    run: Option<&Run>,
    daemon: &Stopped,
    qemu: QemuSide,
) -> (Vec<Check>, Vec<Measure>) {
    let mut v = Vec::new();
    let mut m = Vec::new();
    let mut measure = |scenario: &str, name: &str, d: Duration| {
        m.push(Measure {
            scenario: scenario.into(),
            name: name.into(),
            value: d.as_secs_f64(),
            unit: "s".into(),
        })
    };
    let log = daemon.log.as_str();
    for unknown in steps.iter().filter(|s| !known(&s.scenario, &s.cue)) {
        v.push(Check::new(
            "unplug.known_cues",
            false,
            format_args!("unknown cue '{} {}'", unknown.scenario, unknown.cue),
        ));
    }
    let mut expect_listed: BTreeSet<String> = [GPU_A, GPU_B, CCW].map(String::from).into();
    let requested = qemu.handles_request_irq;

    if scenarios.contains(&"unplug") {
        let p = "unplug.host";
        if let Some(s) = step(steps, "unplug", p, 3, &mut v) {
            let (before, remove, list, q) = (&s.cli[0], &s.cli[1], &s.cli[2], &s.qmp[0]);
            held_check(p, before, GPU_A, &mut v);
            measure("unplug", "remove_released", remove.elapsed);
            removal_checks(&format!("{p}.remove"), remove, false, requested, &mut v);
            request_check(p, s, qemu, &mut v);
            // QEMU unplugged A: by itself (request IRQ) or at the operator's device_del.
            let accepted = q.device_del.is_none()
                || q.reply.as_ref().is_some_and(|r| r.get("return").is_some());
            if let Some(t) = q.deleted_after {
                measure("unplug", "cue_to_device_deleted", t);
            }
            v.push(Check::new(
                format!("{p}.qemu_unplugged"),
                accepted && q.deleted_after.is_some() && q.error.is_none(),
                q.summary(),
            ));
            expect_listed.remove(GPU_A);
            let l = listed(list);
            v.push(Check::new(
                format!("{p}.list_after"),
                l.as_ref()
                    .is_some_and(|l| !l.contains(GPU_A) && l.contains(CCW)),
                format_args!("umdev list: {l:?}"),
            ));
        }
        let left = logged(log, GPU_A, "client disconnected");
        let left_pins = logged(log, GPU_A, "left pins behind");
        v.push(Check::new(
            format!("{p}.daemon_client_left_logged"),
            !left.is_empty() && left_pins.is_empty(),
            format_args!(
                "{}; {} 'left pins behind' lines",
                left.first()
                    .map(|l| l.trim())
                    .unwrap_or("no disconnect line"),
                left_pins.len()
            ),
        ));
    }

    if scenarios.contains(&"unplug-busy") {
        let p = "unplug_busy.host";
        if let Some(s) = step(steps, "unplug-busy", p, 4, &mut v) {
            let (before, refused, forced, list, q) =
                (&s.cli[0], &s.cli[1], &s.cli[2], &s.cli[3], &s.qmp[0]);
            held_check(p, before, GPU_B, &mut v);
            measure("unplug-busy", "remove_refused", refused.elapsed);
            measure("unplug-busy", "remove_forced", forced.elapsed);
            let j = refused.json();
            v.push(Check::new(
                format!("{p}.remove_busy"),
                refused.code == Some(1)
                    && is(&j, "/error/kind", Value::from("busy"))
                    && refused.elapsed + Duration::from_millis(500) >= RELEASE,
                format_args!(
                    "exit {:?} after {:.2} s (release timeout {RELEASE:?}), error kind {}",
                    refused.code,
                    refused.elapsed.as_secs_f64(),
                    show(&j, "/error/kind")
                ),
            ));
            request_check(p, s, qemu, &mut v);
            // QEMU cannot unplug a device on pcie.0, whoever asks.
            let why = q
                .reply
                .as_ref()
                .and_then(|r| r.pointer("/error/desc"))
                .and_then(Value::as_str);
            v.push(Check::new(
                format!("{p}.qemu_refused_unplug"),
                why.is_some_and(|w| w.contains("hotplug")) && q.deleted_after.is_none(),
                q.summary(),
            ));
            removal_checks(
                &format!("{p}.remove_force"),
                forced,
                true,
                requested,
                &mut v,
            );
            expect_listed.remove(GPU_B);
            let l = listed(list);
            v.push(Check::new(
                format!("{p}.list_after"),
                l.as_ref() == Some(&expect_listed),
                format_args!("umdev list: {l:?}, want {expect_listed:?}"),
            ));
        }
        let refused = logged(log, GPU_B, "removal refused");
        v.push(Check::new(
            format!("{p}.daemon_refusal_logged"),
            !refused.is_empty(),
            refused.first().map(|l| l.trim()).unwrap_or("no such line"),
        ));
        let forced = logged(log, GPU_B, "forced removal: the client was disconnected");
        v.push(Check::new(
            format!("{p}.daemon_forced_logged"),
            forced.first().is_some_and(|l| l.contains("pinned_pages=0")),
            forced.first().map(|l| l.trim()).unwrap_or("no such line"),
        ));
    }

    if let Some(r) = run {
        let aborted: Vec<&str> = r
            .stderr
            .lines()
            .filter(|l| l.contains("Assertion") || l.contains("Aborted"))
            .collect();
        let signal = r.exit.and_then(|s| s.signal());
        v.push(Check::new(
            "unplug.qemu_no_abort",
            aborted.is_empty() && signal.is_none() && !r.timed_out,
            format_args!(
                "exit {:?}{}",
                r.exit,
                aborted
                    .first()
                    .map(|l| format!(", stderr: {}", l.trim()))
                    .unwrap_or_default()
            ),
        ));
    }
    v.extend(daemon_checks(daemon));
    (v, m)
}

/// The daemon outlived the guest, stopped every instance cleanly on SIGTERM with nothing
/// pinned, never panicked, never had to release pins a device left, logged plain text.
fn daemon_checks(d: &Stopped) -> Vec<Check> {
    let summary = d
        .log
        .lines()
        .find(|l| l.contains("every instance stopped"))
        .unwrap_or("no 'every instance stopped' line");
    vec![
        Check::new("daemon.alive_after_guest", d.alive_after_guest, ""),
        Check::new(
            "daemon.clean_sigterm",
            d.exit.is_some_and(|s| s.success())
                && summary.contains("failed=0 pinned_pages=0 leaked_pins_released=0"),
            format_args!("exit {:?}; {}", d.exit, summary.trim()),
        ),
        Check::new(
            "daemon.no_leftover_pins",
            !d.log.contains("left pins behind"),
            "no 'left pins behind' in the log",
        ),
        Check::new("daemon.no_panic", !d.log.contains("panicked"), ""),
        Check::new(
            "daemon.log_plain_text",
            !d.log.contains('\x1b'),
            "no ANSI colour codes in a log written to a file",
        ),
    ]
}

/// The log lines about the removals, for the notes (timestamps show what took how long).
pub fn notes(steps: &[Step], daemon: &Stopped) -> Vec<String> {
    let mut n: Vec<String> = steps
        .iter()
        .flat_map(|s| {
            let head = format!(
                "cue '{} {}' at {:.1} s",
                s.scenario,
                s.cue,
                s.at.as_secs_f64()
            );
            let cli = s.cli.iter().map(|c| c.summary());
            let qmp = s.qmp.iter().map(QmpRecord::summary);
            cli.chain(qmp)
                .map(|x| format!("{head}: {x}"))
                .collect::<Vec<_>>()
        })
        .collect();
    let about = [GPU_A, GPU_B];
    n.extend(
        daemon
            .log
            .lines()
            .filter(|l| about.iter().any(|u| l.contains(u)) && !l.contains("listening"))
            .map(|l| format!("daemon: {}", l.trim())),
    );
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    const STOCK: QemuSide = QemuSide {
        handles_request_irq: false,
    };

    fn cli(code: i32, stdout: &str, secs: u64) -> Cli {
        Cli {
            args: String::new(),
            code: Some(code),
            stdout: stdout.into(),
            stderr: String::new(),
            elapsed: Duration::from_secs(secs),
        }
    }

    fn removed(forced: bool, requested: bool, pinned: u64, leaked: u64) -> String {
        format!(
            r#"{{"stopped":{{"client_was_attached":true,"release_requested":{requested},
            "forced":{forced},"waited_ms":5000,"dma":{{"maps":0,"pinned_pages":{pinned},
            "locked_pages":0,"leaked_pins_released":{leaked}}}}},"uuid":"x"}}"#
        )
    }

    fn oks(v: &[Check]) -> Vec<(&str, bool)> {
        v.iter().map(|c| (c.name.as_str(), c.ok)).collect()
    }

    fn named(v: &[Check], n: &str) -> Option<bool> {
        v.iter().find(|c| c.name == n).map(|c| c.ok)
    }

    #[test]
    fn test_removal_checks_forced_requested_or_pins_left_fail() {
        let run = |c: Cli, forced, requested| {
            let mut v = Vec::new();
            removal_checks("x", &c, forced, requested, &mut v);
            oks(&v).into_iter().map(|(_, ok)| ok).collect::<Vec<_>>()
        };
        assert_eq!(
            run(cli(0, &removed(false, false, 0, 0), 6), false, false),
            [true, true]
        );
        assert_eq!(
            run(cli(0, &removed(true, false, 0, 0), 6), false, false),
            [false, true]
        );
        assert_eq!(
            run(cli(0, &removed(false, false, 0, 0), 6), false, true),
            [false, true]
        );
        assert_eq!(
            run(cli(0, &removed(true, false, 3, 0), 6), true, false),
            [true, false]
        );
        assert_eq!(
            run(cli(0, &removed(true, false, 0, 2), 6), true, false),
            [true, false]
        );
        let busy = cli(1, r#"{"error":{"kind":"busy"}}"#, 10);
        assert_eq!(run(busy, false, false), [false, false]);
    }

    fn list(uuids: &[&str]) -> String {
        let items: Vec<String> = uuids
            .iter()
            .map(|u| format!(r#"{{"uuid":"{u}"}}"#))
            .collect();
        format!(r#"{{"instances":[{}]}}"#, items.join(","))
    }

    /// A list reply with `uuid` attached and holding `pinned` pages, beside the others.
    fn list_holding(uuid: &str, pinned: u64) -> String {
        format!(
            r#"{{"instances":[{{"uuid":"{CCW}","client_attached":true,"dma":{{"pinned_pages":0}}}},
            {{"uuid":"{uuid}","client_attached":true,"dma":{{"pinned_pages":{pinned}}}}}]}}"#
        )
    }

    fn busy_step(secs: u64, qemu_said: &str) -> Step {
        Step {
            scenario: "unplug-busy".into(),
            cue: "remove".into(),
            at: Duration::from_secs(30),
            cli: vec![
                cli(0, &list_holding(GPU_B, 2), 0),
                cli(1, r#"{"error":{"kind":"busy"}}"#, secs),
                cli(0, &removed(true, false, 0, 0), 1),
                cli(0, &list(&[GPU_A, CCW]), 0),
            ],
            qmp: vec![QmpRecord {
                device_del: Some("gpu-b".into()),
                reply: serde_json::from_str(qemu_said).ok(),
                ..Default::default()
            }],
            request_line: Some(format!(
                "WARN removal: the client has no request IRQ registered; waiting for it to \
                 leave uuid=\"{GPU_B}\""
            )),
        }
    }

    #[test]
    fn test_checks_busy_early_unpinned_or_qemu_unplugging_root_bus_fails() {
        let daemon = Stopped {
            alive_after_guest: true,
            exit: None,
            log: format!(
                "WARN removal refused: the client did not release the device uuid=\"{GPU_B}\"\n\
                 WARN forced removal: the client was disconnected uuid=\"{GPU_B}\" \
                 leaked_pins_released=0 pinned_pages=0\n"
            ),
        };
        let refused = r#"{"error":{"class":"GenericError","desc":"Bus 'pcie.0' does not support hotplugging"}}"#;
        let (v, m) = checks(
            &["unplug-busy"],
            &[busy_step(10, refused)],
            None,
            &daemon,
            STOCK,
        );
        for n in [
            "unplug_busy.host.cue_acted",
            "unplug_busy.host.held_before",
            "unplug_busy.host.remove_busy",
            "unplug_busy.host.daemon_request_logged",
            "unplug_busy.host.qemu_refused_unplug",
            "unplug_busy.host.remove_force.reply",
            "unplug_busy.host.list_after",
            "unplug_busy.host.daemon_forced_logged",
        ] {
            assert_eq!(named(&v, n), Some(true), "{n}");
        }
        assert_eq!(m.len(), 2);
        // Busy at once (no wait for the release timeout) is wrong.
        let (v, _) = checks(
            &["unplug-busy"],
            &[busy_step(1, refused)],
            None,
            &daemon,
            STOCK,
        );
        assert_eq!(named(&v, "unplug_busy.host.remove_busy"), Some(false));
        // A QEMU that accepts unplugging a device on pcie.0 is not what this run stages.
        let (v, _) = checks(
            &["unplug-busy"],
            &[busy_step(10, r#"{"return":{}}"#)],
            None,
            &daemon,
            STOCK,
        );
        assert_eq!(
            named(&v, "unplug_busy.host.qemu_refused_unplug"),
            Some(false)
        );
        // A QEMU expected to answer the request IRQ must have made the daemon signal it.
        let handles = QemuSide {
            handles_request_irq: true,
        };
        let (v, _) = checks(
            &["unplug-busy"],
            &[busy_step(10, refused)],
            None,
            &daemon,
            handles,
        );
        assert_eq!(
            named(&v, "unplug_busy.host.daemon_request_logged"),
            Some(false)
        );
        // Nothing pinned before the removal: "0 pins left" would prove nothing.
        let mut unpinned = busy_step(10, refused);
        unpinned.cli[0] = cli(0, &list_holding(GPU_B, 0), 0);
        let (v, _) = checks(&["unplug-busy"], &[unpinned], None, &daemon, STOCK);
        assert_eq!(named(&v, "unplug_busy.host.held_before"), Some(false));
        // A cue that never came fails.
        let (v, _) = checks(&["unplug-busy"], &[], None, &daemon, STOCK);
        assert_eq!(named(&v, "unplug_busy.host.cue_acted"), Some(false));
    }

    #[test]
    fn test_checks_unplug_without_device_deleted_fails() {
        let daemon = Stopped {
            alive_after_guest: true,
            exit: None,
            log: format!(
                "INFO server{{socket=/s/{GPU_A}.sock}}: client disconnected dma_maps_released=8\n"
            ),
        };
        let step = |deleted: Option<Duration>| Step {
            scenario: "unplug".into(),
            cue: "remove".into(),
            at: Duration::from_secs(20),
            cli: vec![
                cli(0, &list_holding(GPU_A, 2), 0),
                cli(0, &removed(false, false, 0, 0), 6),
                cli(0, &list(&[GPU_B, CCW]), 0),
            ],
            qmp: vec![QmpRecord {
                device_del: Some("gpu-a".into()),
                reply: serde_json::from_str(r#"{"return":{}}"#).ok(),
                deleted_after: deleted,
                error: None,
            }],
            request_line: Some(format!(
                "WARN removal: the client has no request IRQ registered uuid=\"{GPU_A}\""
            )),
        };
        let ok = step(Some(Duration::from_secs(6)));
        let (v, _) = checks(&["unplug"], &[ok], None, &daemon, STOCK);
        for n in [
            "unplug.host.held_before",
            "unplug.host.remove.reply",
            "unplug.host.remove.no_pins_left",
            "unplug.host.daemon_request_logged",
            "unplug.host.qemu_unplugged",
            "unplug.host.list_after",
            "unplug.host.daemon_client_left_logged",
        ] {
            assert_eq!(named(&v, n), Some(true), "{n}");
        }
        let (v, _) = checks(&["unplug"], &[step(None)], None, &daemon, STOCK);
        assert_eq!(named(&v, "unplug.host.qemu_unplugged"), Some(false));
    }

    #[test]
    fn test_listed_reads_uuids_or_none() {
        let c = cli(0, r#"{"instances":[{"uuid":"a"},{"uuid":"b"}]}"#, 0);
        assert_eq!(listed(&c), Some(["a", "b"].map(String::from).into()));
        assert_eq!(listed(&cli(1, "garbage", 0)), None);
    }
}
