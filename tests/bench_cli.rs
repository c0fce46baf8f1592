//! `umdev bench` end to end: the binary runs, and its JSON is well-formed and complete
//! (every size × pattern × policy present with samples). The numbers are not checked.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

const PATTERNS: [&str; 5] = ["contiguous", "scattered", "ccw-like", "gvt-like", "random"];
const POLICIES: [&str; 3] = ["translate", "lock", "populate"];
const SIZES: [u64; 5] = [1, 8, 64, 512, 4096];

fn umdev(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run umdev")
}

/// Run umdev and require success, showing its stderr otherwise.
fn umdev_ok(args: &[&str]) -> Output {
    let out = umdev(args);
    assert!(
        out.status.success(),
        "umdev {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).expect("JSON file written");
    serde_json::from_str(&text).expect("well-formed JSON")
}

fn assert_variant_complete(v: &Value, samples: usize, what: &str) {
    let s = v["samples_ns_per_page"]
        .as_array()
        .unwrap_or_else(|| panic!("{what}: no samples"));
    assert_eq!(s.len(), samples, "{what}: sample count");
    assert!(
        s.iter()
            .all(|x| x.as_f64().is_some_and(|x| x.is_finite() && x > 0.0)),
        "{what}: samples must be positive numbers"
    );
    for key in ["median", "p10", "p90", "min", "max"] {
        assert!(v["ns_per_page"][key].as_f64().is_some(), "{what}: {key}");
    }
    assert!(
        v["syscalls_per_array"].as_f64().is_some(),
        "{what}: syscalls"
    );
    assert!(v["iters_per_sample"].as_u64().is_some_and(|n| n >= 1));
}

#[test]
fn test_bench_pin_quick_json_has_every_size_pattern_policy() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("pin.json");
    let svg = dir.path().join("pin.svg");
    // The default sizes (1..4096) with --quick; 3 samples and the 4 KiB backing only keep
    // the test at a few seconds even in a debug build (`--quick` alone is the < 60 s run).
    let out = umdev_ok(&[
        "bench",
        "pin",
        "--quick",
        "--backings",
        "4k",
        "--samples",
        "3",
        "--json",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("coalesced") && stdout.contains("per-page"),
        "{stdout}"
    );

    let v = read_json(&json);
    assert_eq!(v["schema"], "umdev-bench-pin/1");
    assert!(v["machine"]["nproc"].as_u64().is_some_and(|n| n >= 1));
    assert!(v["machine"]["cpu_model"].is_string());
    let samples = v["config"]["plan"]["samples"].as_u64().unwrap() as usize;
    assert_eq!(samples, 3);
    let cells = v["cells"].as_array().expect("cells");
    assert_eq!(cells.len(), SIZES.len() * PATTERNS.len() * POLICIES.len());
    for policy in POLICIES {
        for pattern in PATTERNS {
            for size in SIZES {
                let what = format!("{policy} {pattern} {size}");
                let cell = cells
                    .iter()
                    .find(|c| {
                        c["backing"] == "4k"
                            && c["policy"] == policy
                            && c["pattern"] == pattern
                            && c["size"].as_u64() == Some(size)
                    })
                    .unwrap_or_else(|| panic!("missing cell {what}"));
                assert!(cell["error"].is_null(), "{what}: {}", cell["error"]);
                assert_variant_complete(&cell["coalesced"], samples, &what);
                assert_variant_complete(&cell["per_page"], samples, &what);
                assert!(cell["ratio"].as_f64().is_some_and(|r| r > 0.0), "{what}");
                assert!(cell["runs_per_array"].as_f64().is_some_and(|r| r >= 1.0));
            }
        }
    }
    let plot = std::fs::read_to_string(&svg).expect("SVG written");
    assert!(plot.starts_with("<svg") && plot.trim_end().ends_with("</svg>"));
    assert!(plot.contains("<polyline"), "plot has lines");
}

#[test]
fn test_bench_pin_trace_replay_reports_trace_cells() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("dev.jsonl");
    std::fs::write(
        &trace,
        "{\"prot\":\"rw\",\"pfns\":[100,101,102,103,200,201]}\n\
         {\"prot\":\"r\",\"pfns\":[7]}\n\
         {\"prot\":\"w\",\"pfns\":[5000,5002,5004,5001]}\n",
    )
    .unwrap();
    let json = dir.path().join("t.json");
    umdev_ok(&[
        "bench",
        "pin",
        "--quick",
        "--quiet",
        "--traces-only",
        "--trace",
        trace.to_str().unwrap(),
        "--sizes",
        "1,8",
        "--backings",
        "4k",
        "--policies",
        "translate,lock",
        "--samples",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = read_json(&json);
    let cells = v["cells"].as_array().unwrap();
    // Two buckets (size 1: one array; size 8: two arrays) × two policies.
    assert_eq!(cells.len(), 4);
    assert!(cells.iter().all(|c| c["pattern"] == "trace:dev"));
    let b8 = cells
        .iter()
        .find(|c| c["size"] == 8 && c["policy"] == "lock")
        .unwrap();
    assert_eq!(b8["arrays"], 2);
    // Runs: {100..=103}{200,201} = 2 and 5000|5002|5004|5001 = 4.
    assert_eq!(b8["runs_per_array"].as_f64(), Some(3.0));
    assert_variant_complete(&b8["coalesced"], 2, "trace");
    assert_eq!(v["config"]["traces"][0]["arrays"], 3);
}

#[test]
fn test_bench_pin_size_zero_fails_with_message() {
    let out = umdev(&["bench", "pin", "--quick", "--sizes", "0"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("out of range"));
}

#[test]
fn test_bench_pin_bad_trace_fails_with_line_number() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("bad.jsonl");
    std::fs::write(&trace, "{\"prot\":\"rw\",\"pfns\":[1]}\n{oops\n").unwrap();
    let out = umdev(&["bench", "pin", "--trace", trace.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("line 2"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn assert_pair_rows(v: &Value, groups: usize, per_group: usize) {
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), groups * per_group, "{v}");
    for r in rows {
        for side in ["a", "b"] {
            let s = r[side]["samples_ns"].as_array().expect("samples");
            assert!(!s.is_empty(), "{r}");
            assert!(s
                .iter()
                .all(|x| x.as_f64().is_some_and(|x| x.is_finite() && x > 0.0)));
        }
        assert!(r["ratio_a_over_b"].as_f64().is_some_and(|x| x > 0.0));
    }
    assert!(v["unavailable"].as_array().is_some_and(|u| u.is_empty()));
}

#[test]
fn test_bench_dma_quick_json_has_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("dma.json");
    umdev_ok(&[
        "bench",
        "dma",
        "--quick",
        "--quiet",
        "--samples",
        "3",
        "--sizes",
        "8,4096",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = read_json(&json);
    assert_eq!(v["bench"], "dma");
    // 5 comparisons (read, write, lookup, fd-less read, fd-less write) × 2 sizes.
    assert_pair_rows(&v, 5, 2);
}

#[test]
fn test_bench_wire_quick_json_has_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("wire.json");
    umdev_ok(&[
        "bench",
        "wire",
        "--quick",
        "--quiet",
        "--samples",
        "3",
        "--map-sizes",
        "4096,1073741824",
        "--rounds",
        "2",
        "--per-round",
        "200",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = read_json(&json);
    assert_eq!(v["bench"], "wire");
    // REGION_READ, REGION_WRITE, posted write, and DMA_MAP+UNMAP at two sizes.
    assert_pair_rows(&v, 1, 5);
    // The placement table: same core (and cross core on a machine with two CPUs), each
    // with the reference and umdev with polling off and auto.
    let rows = v["placement"]["rows"].as_array().expect("placement rows");
    let placements = v["placement"]["cpus"].as_array().expect("cpus").len();
    assert_eq!(rows.len(), 3 * placements, "{rows:?}");
    for r in rows {
        assert_eq!(r["n"], 400, "{r}");
        for key in ["median_ns", "p99_ns", "ratio_to_reference"] {
            assert!(r[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {r}");
        }
        let umdev = r["server"].as_str().unwrap().starts_with("umdev");
        assert_eq!(r["idle_cpu_pct"].is_number(), umdev, "{r}");
    }
}

#[test]
fn test_bench_wire_default_logging_keeps_server_info_lines_out_of_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("wire.json");
    let out = Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["bench", "wire", "--quick", "--samples", "3"])
        .args(["--map-sizes", "4096", "--json", json.to_str().unwrap()])
        .env_remove("RUST_LOG")
        .output()
        .expect("run umdev");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "umdev bench wire failed: {stderr}");
    // The servers connect and negotiate (info lines) for every row; none may show.
    assert!(
        !stderr.contains(" INFO "),
        "server info lines in the benchmark report: {stderr}"
    );
    assert!(!stderr.contains('\x1b'), "colour codes in a piped report");
}

#[test]
fn test_bench_record_both_devices_write_replayable_traces() {
    let dir = tempfile::tempdir().unwrap();
    for (device, min_arrays) in [("gpu", 4), ("ccw", 4)] {
        let trace = dir.path().join(format!("{device}.jsonl"));
        umdev_ok(&[
            "bench",
            "record",
            device,
            "--steps",
            "4",
            "--out",
            trace.to_str().unwrap(),
        ]);
        let text = std::fs::read_to_string(&trace).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("trace line is JSON"))
            .collect();
        assert!(
            lines.len() >= min_arrays,
            "{device}: {} arrays",
            lines.len()
        );
        assert!(lines
            .iter()
            .all(|l| l["pfns"].as_array().is_some_and(|a| !a.is_empty())));
        let json = dir.path().join(format!("{device}.json"));
        umdev_ok(&[
            "bench",
            "pin",
            "--quick",
            "--quiet",
            "--traces-only",
            "--trace",
            trace.to_str().unwrap(),
            "--backings",
            "4k",
            "--policies",
            "translate",
            "--samples",
            "2",
            "--json",
            json.to_str().unwrap(),
        ]);
        let v = read_json(&json);
        let cells = v["cells"].as_array().unwrap();
        assert!(!cells.is_empty());
        assert!(cells
            .iter()
            .all(|c| c["pattern"] == format!("trace:{device}") && c["error"].is_null()));
    }
}

#[test]
fn test_bench_pin_self_check_runs_coalesced_on_both_sides() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("aa.json");
    umdev_ok(&[
        "bench",
        "pin",
        "--quick",
        "--quiet",
        "--self-check",
        "--sizes",
        "64",
        "--patterns",
        "contiguous",
        "--backings",
        "4k",
        "--policies",
        "lock",
        "--samples",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = read_json(&json);
    assert_eq!(v["config"]["self_check"], true);
    let cell = &v["cells"][0];
    // Both sides took the coalesced path: one mlock + one munlock per array.
    assert_eq!(cell["coalesced"]["syscalls_per_array"].as_f64(), Some(2.0));
    assert_eq!(cell["per_page"]["syscalls_per_array"].as_f64(), Some(2.0));
}

/// A summary of samples: every order statistic a number.
fn assert_summary(s: &Value, n: usize, what: &str) {
    assert_eq!(s["n"].as_u64(), Some(n as u64), "{what}: count {s}");
    for key in ["median", "p10", "p90", "min", "max"] {
        assert!(
            s[key].as_f64().is_some_and(f64::is_finite),
            "{what}: {key} {s}"
        );
    }
}

fn as_f64s(v: &Value, what: &str) -> Vec<f64> {
    v.as_array()
        .unwrap_or_else(|| panic!("{what}: not an array"))
        .iter()
        .map(|x| x.as_f64().unwrap_or_else(|| panic!("{what}: {x}")))
        .collect()
}

#[test]
fn test_bench_instances_quick_json_has_every_row() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("instances.json");
    let out = umdev_ok(&[
        "bench",
        "instances",
        "--quick",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("targets (issue 12)") && stdout.contains("FENCE latency"),
        "{stdout}"
    );

    let v = read_json(&json);
    assert_eq!(v["schema"], "umdev-bench-instances/1");
    assert_eq!(v["bench"], "instances");
    assert!(v["machine"]["nproc"].as_u64().is_some_and(|n| n >= 1));
    // The quick counts, each point measured in a process of its own.
    let scale = v["scale"].as_array().expect("scale");
    let counts: Vec<u64> = scale
        .iter()
        .map(|p| p["instances"].as_u64().unwrap())
        .collect();
    assert_eq!(counts, [1, 16]);
    for p in scale {
        let n = p["instances"].as_u64().unwrap() as usize;
        let what = format!("scale point {n}");
        assert!(p["error"].is_null(), "{what}: {}", p["error"]);
        assert_eq!(p["isolation"], "process", "{what}");
        assert_eq!(p["created"].as_u64(), Some(n as u64), "{what}");
        let mix: u64 = p["mix"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["count"].as_u64().unwrap())
            .sum();
        assert_eq!(mix, n as u64, "{what}: mix {}", p["mix"]);
        let creates = as_f64s(&p["create_samples_ms"], &what);
        assert_eq!(creates.len(), n, "{what}: one create time per instance");
        assert!(creates.iter().all(|x| x.is_finite() && *x > 0.0), "{what}");
        assert_summary(&p["create_ms"], n, &what);
        let keys = [
            "rss_kib",
            "anon_kib",
            "file_kib",
            "shmem_kib",
            "threads",
            "fds",
            "smaps_rss_kib",
            "smaps_anon_kib",
            "smaps_shmem_kib",
        ];
        for sample in ["before", "idle", "serving"] {
            for key in keys {
                assert!(p[sample][key].as_u64().is_some(), "{what}: {sample}.{key}");
            }
        }
        for key in keys {
            assert!(
                p["idle_per_instance"][key].as_f64().is_some(),
                "{what}: idle_per_instance.{key}"
            );
        }
        // Every instance served its own client, all connected at once, output verified.
        assert_eq!(p["attached_at_release"].as_u64(), Some(n as u64), "{what}");
        assert_eq!(p["verified"].as_u64(), Some(n as u64), "{what}");
        assert_eq!(p["failures"].as_array().map(Vec::len), Some(0), "{what}");
        assert!(
            p["serve_wall_s"].as_f64().is_some_and(|s| s > 0.0),
            "{what}"
        );
        assert_summary(&p["serve_client_ms"], n, &what);
        assert_summary(&p["remove_ms"], n, &what);
    }
    // Both fairness sets, every flooder with its work and share, every FENCE sample.
    let sets = v["fairness"].as_array().expect("fairness");
    let names: Vec<&str> = sets.iter().map(|s| s["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["equal", "mixed"]);
    let plan = &v["config"]["fairness"];
    let samples =
        (plan["rounds"].as_u64().unwrap() * plan["samples_per_block"].as_u64().unwrap()) as usize;
    assert_eq!(samples, 20, "quick: 2 rounds of 10 samples");
    assert!(
        plan["engine_nice"].is_null(),
        "the GPU parent's default: inherit"
    );
    for (s, weights) in sets.iter().zip([[1, 1, 1, 1], [1, 1, 4, 4]]) {
        let what = format!("{} set", s["name"]);
        let flooders = s["flooders"].as_array().unwrap();
        let got: Vec<u64> = flooders
            .iter()
            .map(|f| f["weight"].as_u64().unwrap())
            .collect();
        assert_eq!(got, weights, "{what}");
        for f in flooders {
            assert!(f["commands"].as_u64().is_some_and(|c| c > 0), "{what}: {f}");
            assert!(f["work"].as_u64().is_some_and(|w| w > 0), "{what}: {f}");
            assert!(f["rel_error"].as_f64().is_some_and(f64::is_finite), "{f}");
            assert!(f["dry_polls"].as_u64().is_some(), "{f}");
        }
        let shares: f64 = flooders.iter().map(|f| f["share"].as_f64().unwrap()).sum();
        assert!(
            (shares - 1.0).abs() < 1e-9,
            "{what}: shares sum to {shares}"
        );
        assert!(
            s["jain"].as_f64().is_some_and(|j| j > 0.0 && j <= 1.0),
            "{what}"
        );
        assert!(s["engine_units"].as_u64().is_some_and(|u| u > 0), "{what}");
        // The GPU parent's default: the engine thread keeps the process's nice value (the
        // bench inherits this test's), as read back from /proc while the set ran.
        // SAFETY: getpriority reads this process's nice value; no memory is passed.
        let own = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        assert_eq!(s["engine_thread_nice"], own, "{what}");
        let fence = &s["fence"];
        for (key, sum) in [
            ("unloaded_us", "unloaded"),
            ("loaded_us", "loaded"),
            ("doorbell_unloaded_us", "doorbell_unloaded"),
            ("doorbell_loaded_us", "doorbell_loaded"),
        ] {
            let x = as_f64s(&fence[key], key);
            assert_eq!(x.len(), samples, "{what}: {key}");
            assert!(x.iter().all(|v| v.is_finite() && *v > 0.0), "{what}: {key}");
            assert_summary(&fence[sum], samples, &format!("{what} {sum}"));
        }
        for key in ["ratio_median", "ratio_p90"] {
            assert!(
                fence[key].as_f64().is_some_and(|r| r > 0.0),
                "{what}: {key}"
            );
        }
    }
    // Every target of the issue, each with a verdict; no 256 point in a quick run.
    let targets = v["targets"].as_array().expect("targets");
    assert_eq!(targets.len(), 8, "{targets:?}");
    for t in targets {
        let verdict = t["verdict"].as_str().unwrap();
        assert!(["pass", "MISS", "not measured"].contains(&verdict), "{t}");
        assert!(t["measured"].is_string() && t["limit"].is_string(), "{t}");
    }
    assert_eq!(targets[0]["verdict"], "not measured");
}

#[test]
fn test_bench_instances_bad_count_or_type_fails_with_message() {
    let out = umdev(&["bench", "instances", "--quick", "--counts", "0"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("out of range"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = umdev(&["bench", "instances", "--quick", "--types", "gpu-8m"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("unknown instance type \"gpu-8m\""),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for bad in ["20", "-21", "low"] {
        let out = umdev(&["bench", "instances", "--quick", "--engine-nice", bad]);
        assert!(!out.status.success(), "--engine-nice {bad}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("is not a nice value"),
            "--engine-nice {bad}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn test_bench_isolation_tiny_json_has_every_attack_with_victim_samples() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("isolation.json");
    let out = umdev_ok(&[
        "bench",
        "isolation",
        "--quiet",
        "--seconds",
        "0.3",
        "--maps",
        "64",
        "--fd-messages",
        "8",
        "--json",
        json.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("targets (issue 17)"), "{stdout}");
    let v = read_json(&json);
    assert_eq!(v["schema"], "umdev-bench-isolation/1");
    let attacks = v["attacks"].as_array().expect("attacks");
    let names: Vec<&str> = attacks
        .iter()
        .map(|a| a["attack"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["idle", "map-flood", "fd-flood", "disk-file"]);
    for a in attacks {
        let what = a["attack"].as_str().unwrap();
        assert_eq!(a["survived"], true, "{what}: {}", a["process"]);
        let child = &a["child"];
        assert!(child["error"].is_null(), "{what}: {}", child["error"]);
        assert!(child["outcome"]["summary"].is_string(), "{what}");
        let victims = a["victims"].as_array().expect("victims");
        assert_eq!(victims.len(), 7, "{what}: seven victims");
        for (i, ops) in victims.iter().enumerate() {
            let ops = ops.as_array().unwrap();
            let names: Vec<&str> = ops.iter().map(|o| o["op"].as_str().unwrap()).collect();
            assert_eq!(names, ["region", "map", "fence"], "{what} #{i}");
            for o in ops {
                let n = o["n"].as_array().unwrap();
                assert!(
                    n.iter().all(|x| x.as_u64().is_some_and(|k| k > 0)),
                    "{what} victim #{i} {}: no samples in a block: {n:?}",
                    o["op"]
                );
                assert!(
                    o["ratio"].as_f64().is_some_and(f64::is_finite),
                    "{what} {o}"
                );
            }
        }
    }
    let m = &attacks[1]["child"]["outcome"];
    assert_eq!(m["accepted"].as_u64(), Some(64), "map flood: {m}");
    let f = &attacks[2]["child"]["outcome"];
    assert_eq!(f["accepted"].as_u64(), Some(8), "fd flood: {f}");
    let targets = v["targets"].as_array().expect("targets");
    // Per attack: survival, p99 ratio, errors; the disk file's refusal once.
    assert_eq!(targets.len(), 4 * 3 + 1, "{targets:?}");
    assert!(targets
        .iter()
        .all(|t| matches!(t["verdict"].as_str(), Some("pass" | "MISS"))));
}

#[test]
fn test_bench_instances_busy_threads_runs_every_set_again_and_judges_it() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("busy.json");
    umdev_ok(&[
        "bench",
        "instances",
        "--only",
        "fairness",
        "--quick",
        "--quiet",
        "--busy-threads",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = read_json(&json);
    let sets = v["fairness"].as_array().expect("fairness");
    let runs: Vec<(String, u64)> = sets
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_owned(),
                s["busy_threads"].as_u64().unwrap(),
            )
        })
        .collect();
    let want = [("equal", 0), ("equal", 1), ("mixed", 0), ("mixed", 1)];
    assert_eq!(
        runs,
        want.map(|(n, b)| (n.to_owned(), b)),
        "each set on the machine as it is, then beside the busy threads"
    );
    for s in sets {
        let sched = s["sched"].as_array().expect("sched rows");
        let engine = sched.iter().find(|g| g["group"] == "engine").unwrap();
        assert!(
            engine["loaded_cpus"].as_f64().is_some_and(|c| c > 0.0),
            "the engine ran in the loaded blocks: {engine}"
        );
        let busy = sched.iter().find(|g| g["group"] == "busy threads").unwrap();
        let spun = busy["loaded_cpus"].as_f64().unwrap_or(0.0) > 0.0;
        assert_eq!(spun, s["busy_threads"] == 1, "{}: {busy}", s["name"]);
    }
    assert_eq!(v["config"]["fairness"]["fetcher_slice_us"], 100);
    let targets = v["targets"].as_array().unwrap();
    let busy_rows = targets
        .iter()
        .filter(|t| {
            t["target"]
                .as_str()
                .unwrap()
                .contains("busy host (1 spinning")
        })
        .count();
    assert_eq!(
        busy_rows, 4,
        "share, Jain, FENCE median and p90 for the busy host"
    );
}
