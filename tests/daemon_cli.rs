//! `umdev daemon` and its client commands as an admin runs them: the real binary, a daemon
//! process per test in a temp dir, the embedded VMM as the QEMU that attaches instances.

use std::fs;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use umdev::device::irq_index;
use umdev::testing::{wait_eventfd, DeviceAccess, Vmm};
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::ID_MAGIC;
use umdev_devices::gpu::Command as GpuCmd;
use umdev_devices::testing::Bar0;

#[path = "common/daemon.rs"]
mod daemon;

use daemon::{Daemon, BIN};

const RAM_BASE: u64 = 1 << 30;

/// The running instances as `umdev list --json` gives them.
fn instances(d: &Daemon) -> Vec<Value> {
    d.json(&["list"])["instances"].as_array().unwrap().clone()
}

fn available(d: &Daemon, parent: &str, ty: &str) -> u64 {
    let types = d.json(&["types"]);
    types["types"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["parent"] == parent && t["type"] == ty)
        .unwrap_or_else(|| panic!("no type {parent}/{ty} in {types}"))["available_instances"]
        .as_u64()
        .unwrap()
}

/// Create an instance with `umdev create ARGS --json`; returns (uuid, socket).
fn create(d: &Daemon, args: &[&str]) -> (String, PathBuf) {
    let mut all = vec!["create"];
    all.extend_from_slice(args);
    let v = d.json(&all);
    let i = &v["instance"];
    (
        i["uuid"].as_str().unwrap().to_owned(),
        PathBuf::from(i["socket"].as_str().unwrap()),
    )
}

/// The column starts of a table line: where each cell begins after two or more blanks.
fn column_starts(line: &str) -> Vec<usize> {
    let b = line.as_bytes();
    let mut starts = vec![0];
    for i in 2..b.len() {
        if b[i] != b' ' && b[i - 1] == b' ' && b[i - 2] == b' ' {
            starts.push(i);
        }
    }
    starts
}

#[test]
fn test_daemon_types_table_aligned_and_json_follows_pool_flag() {
    let d = Daemon::start(&["--gpu-pool-mib", "32", "--ccw-budget-mib", "128"]);
    let text = d.ok(&["types"]);
    assert!(!text.contains('\x1b'), "colour codes on a pipe: {text:?}");
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("PARENT") && lines[0].contains("AVAILABLE"));
    // Six types, every line's columns where the header's are.
    let header = column_starts(lines[0]);
    assert_eq!(header.len(), 5, "{text}");
    for line in &lines[1..7] {
        assert_eq!(column_starts(line)[..4], header[..4], "{text}");
    }
    let gpu4 = lines.iter().find(|l| l.contains("gpu-4m")).unwrap();
    assert_eq!(
        gpu4[header[2]..].split_whitespace().next(),
        Some("8"),
        "32 MiB pool / 4 MiB: {text}"
    );
    assert!(text.contains("framebuffer"), "{text}");

    let v = d.json(&["types"]);
    let types = v["types"].as_array().unwrap();
    let names: Vec<String> = types
        .iter()
        .map(|t| {
            format!(
                "{}/{}",
                t["parent"].as_str().unwrap(),
                t["type"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        names,
        [
            "gpu/gpu-4m",
            "gpu/gpu-16m",
            "ccw/ccw-16m",
            "ccw/ccw-64m",
            "nvme/nvme-256m",
            "nvme/nvme-1g",
            "virtio-gpu/vgpu-720p",
            "virtio-gpu/vgpu-1080p"
        ]
    );
    assert_eq!(available(&d, "gpu", "gpu-16m"), 2);
    assert_eq!(available(&d, "ccw", "ccw-64m"), 2);
    assert_eq!(types[0]["device_api"], "vfio-pci");
    assert_eq!(types[1]["needs"][0]["resource"], "framebuffer");
    assert_eq!(types[1]["needs"][0]["amount"], 16);
    let fb = &v["resources"][0];
    assert_eq!(
        (fb["total"].as_u64(), fb["used"].as_u64()),
        (Some(32), Some(0))
    );
}

#[test]
fn test_daemon_create_list_remove_instance_serves_and_gives_share_back() {
    let d = Daemon::start(&[]);
    let text = d.ok(&["create", "--type", "gpu/gpu-16m"]);
    let uuid = text.split_whitespace().nth(1).unwrap().to_owned();
    let socket = d.sockets().join(format!("{uuid}.sock"));
    assert!(
        text.contains(&format!(
            r#"-device '{{"driver":"vfio-user-pci","socket":{{"type":"unix","path":"{}"}}}}'"#,
            socket.display()
        )),
        "{text}"
    );
    let (ccw, ccw_socket) = create(
        &d,
        &[
            "--type",
            "ccw-16m",
            "--uuid",
            "00000000-0000-4000-8000-00000000000A",
        ],
    );
    assert_eq!(
        ccw, "00000000-0000-4000-8000-00000000000a",
        "canonical form"
    );
    assert_eq!(available(&d, "gpu", "gpu-16m"), 3);

    let mut vmm = Vmm::connect(&socket).unwrap();
    assert_eq!(vmm.read32(0, 0).unwrap(), ID_MAGIC);
    let listed = instances(&d);
    assert_eq!(listed.len(), 2);
    let gpu = listed.iter().find(|i| i["uuid"] == uuid.as_str()).unwrap();
    assert_eq!(gpu["type"], "gpu-16m");
    assert_eq!(gpu["client_attached"], true);
    assert_eq!(gpu["defined"], false);
    // Its use of what the daemon's process shares.
    let budget = &gpu["budget"];
    let fd_maps = budget["fd_maps"].as_u64().unwrap();
    assert!(Some(fd_maps) <= gpu["dma"]["maps"].as_u64(), "{gpu}");
    assert!(budget["fd_maps_cap"].as_u64() > budget["fd_maps_guarantee"].as_u64());
    assert_eq!(budget["vmas"].as_u64(), Some(2 * fd_maps), "{gpu}");
    assert!(budget["fd_maps_guarantee"].as_u64().unwrap() > 0, "{gpu}");
    assert_eq!(budget["backlog_fds"], 0, "{gpu}");
    let table = d.ok(&["list"]);
    let row = table.lines().find(|l| l.starts_with(&uuid)).unwrap();
    assert!(
        row.contains("gpu/gpu-16m") && row.contains("attached"),
        "{table}"
    );
    assert_eq!(
        column_starts(table.lines().next().unwrap()),
        column_starts(row),
        "{table}"
    );
    drop(vmm);

    let out = d.ok(&["remove", &uuid]);
    assert!(out.starts_with(&format!("removed {uuid}")), "{out}");
    assert!(!socket.exists(), "socket removed");
    assert_eq!(available(&d, "gpu", "gpu-16m"), 4);
    d.ok(&["stop", &ccw]);
    assert!(!ccw_socket.exists());
    assert!(instances(&d).is_empty());
    assert!(d.ok(&["list"]).contains("no instances running"));
    // Transient instances leave no definition behind.
    assert!(d.json(&["list", "--defined"])["definitions"]
        .as_array()
        .unwrap()
        .is_empty());
    let e = d.fail(&["stop", &ccw]);
    assert!(e.contains("is not running"), "{e}");
}

#[test]
fn test_daemon_nvme_types_follow_flags_create_serves_controller() {
    let d = Daemon::start(&[
        "--nvme-type",
        "nvme-8m:8:2",
        "--nvme-type",
        "nvme-4m:4:1",
        "--nvme-budget-mib",
        "12",
    ]);
    let text = d.ok(&["types"]);
    let row = text.lines().find(|l| l.contains("nvme-8m")).unwrap();
    assert!(row.contains("NVMe controller"), "{text}");
    assert_eq!(available(&d, "nvme", "nvme-8m"), 1);
    assert_eq!(available(&d, "nvme", "nvme-4m"), 3);

    let (uuid, socket) = create(&d, &["--type", "nvme-8m"]);
    assert_eq!(available(&d, "nvme", "nvme-4m"), 1);
    let mut vmm = Vmm::connect(&socket).unwrap();
    assert_eq!(vmm.read32(7, 0x08).unwrap() >> 8, 0x01_08_02, "NVMe class");
    let cap = vmm.read64(0, 0x00).unwrap();
    assert_eq!((cap >> 37) & 1, 1, "CAP.CSS: NVM");
    assert_eq!(vmm.read32(0, 0x08).unwrap(), 0x0001_0400, "VS 1.4");
    drop(vmm);
    let image = d.state().join("nvme-images").join(format!("{uuid}.img"));
    assert_eq!(fs::metadata(&image).unwrap().len(), 8 << 20);
    let e = d.fail(&["create", "--type", "nvme-8m"]);
    assert!(e.contains("storage"), "{e}");
    d.ok(&["remove", &uuid]);
    assert_eq!(available(&d, "nvme", "nvme-8m"), 1);
    assert!(image.exists(), "removing keeps the image");
}

#[test]
fn test_daemon_create_exhausted_names_resource_unknown_type_says_so() {
    let d = Daemon::start(&["--gpu-pool-mib", "20"]);
    create(&d, &["--type", "gpu-16m"]);
    let e = d.fail(&["create", "--type", "gpu-16m"]);
    assert!(
        e.contains("no gpu-16m instances available")
            && e.contains("16 MiB of framebuffer, 4 MiB left"),
        "{e}"
    );
    assert!(e.contains("hint: `umdev types`"), "{e}");
    // --json: the error on stdout too, with its kind.
    let out = d.umdev(&["create", "--type", "gpu-16m", "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "exhausted");
    // What is left still fits a smaller type.
    create(&d, &["--type", "gpu-4m"]);
    assert_eq!(available(&d, "gpu", "gpu-4m"), 0);

    let e = d.fail(&["create", "--type", "gpu-3m"]);
    assert!(e.contains("unknown type \"gpu-3m\""), "{e}");
    let e = d.fail(&["create", "--type", "ccw-16m", "colour=red"]);
    assert!(e.contains("\"colour\""), "{e}");
    assert_eq!(instances(&d).len(), 2, "failed creates take nothing");
}

#[test]
fn test_daemon_uuid_in_use_refused_for_create_and_define() {
    let d = Daemon::start(&[]);
    let u = "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11";
    create(&d, &["--type", "gpu-4m", "--uuid", u]);
    let e = d.fail(&["create", "--type", "ccw-16m", "--uuid", u]);
    assert!(e.contains(&format!("UUID {u} is in use")), "{e}");
    let e = d.fail(&["define", "--type", "gpu-4m", "--uuid", &u.to_uppercase()]);
    assert!(e.contains(&format!("UUID {u} is in use")), "{e}");
    assert!(e.contains("without --type"), "{e}");

    let v = "7f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11";
    d.ok(&["define", "--type", "gpu-4m", "--uuid", v]);
    let e = d.fail(&["create", "--type", "gpu-4m", "--uuid", v]);
    assert!(
        e.contains(&format!("UUID {v} is in use: it has a definition")),
        "{e}"
    );
    assert!(e.contains(&format!("umdev start {v}")), "{e}");
    let e = d.fail(&["define", "--type", "gpu-4m", "--uuid", v]);
    assert!(e.contains("in use"), "{e}");
    let e = d.fail(&["create", "--type", "gpu-4m", "--uuid", "not-a-uuid"]);
    assert!(e.contains("is not a UUID"), "{e}");
    assert_eq!(instances(&d).len(), 1);
}

#[test]
fn test_daemon_restart_brings_definitions_back_autostart_serves() {
    let mut d = Daemon::start(&[]);
    let auto = "11111111-2222-4333-8444-555555555555";
    let manual = "21111111-2222-4333-8444-555555555555";
    let out = d.ok(&["define", "--type", "gpu-4m", "--uuid", auto, "--auto"]);
    assert!(out.contains("autostart: yes"), "{out}");
    d.ok(&["define", "--type", "ccw/ccw-16m", "--uuid", manual]);
    // A transient instance, and one created with --auto: only the latter comes back.
    let (transient, _) = create(&d, &["--type", "gpu-4m"]);
    let (created_auto, _) = create(&d, &["--type", "ccw-16m", "--auto"]);
    // A running transient instance defined as it runs (no --type): back, but not started.
    let (adopted, _) = create(&d, &["--type", "gpu-16m"]);
    let out = d.ok(&["define", "--uuid", &adopted]);
    assert!(out.contains("gpu/gpu-16m, autostart: no"), "{out}");
    assert_eq!(instances(&d).len(), 3, "define starts nothing");
    let file = d.state().join(format!("definitions/{auto}.json"));
    let def: Value = serde_json::from_str(&fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(
        (
            def["parent"].as_str(),
            def["type"].as_str(),
            def["autostart"].as_bool()
        ),
        (Some("gpu"), Some("gpu-4m"), Some(true))
    );

    let log = d.stop();
    assert!(log.contains("every instance stopped"), "{log}");
    let left: Vec<_> = fs::read_dir(d.sockets()).unwrap().collect();
    assert!(left.is_empty(), "sockets left behind: {left:?}");

    d.restart();
    let mut running: Vec<String> = instances(&d)
        .iter()
        .map(|i| i["uuid"].as_str().unwrap().to_owned())
        .collect();
    running.sort();
    let mut expected = vec![auto.to_owned(), created_auto.clone()];
    expected.sort();
    assert_eq!(
        running, expected,
        "transient {transient} must not come back"
    );
    let mut vmm = Vmm::connect(&d.sockets().join(format!("{auto}.sock"))).unwrap();
    assert_eq!(vmm.read32(0, 0).unwrap(), ID_MAGIC);
    drop(vmm);

    let defs = d.json(&["list", "--defined"]);
    let state = |u: &str| {
        defs["definitions"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["uuid"] == u)
            .unwrap_or_else(|| panic!("{u} not defined: {defs}"))["running"]
            .as_bool()
            .unwrap()
    };
    assert!(state(auto) && state(&created_auto) && !state(manual) && !state(&adopted));
    let table = d.ok(&["list", "--defined"]);
    let row = table.lines().find(|l| l.starts_with(manual)).unwrap();
    assert!(
        row.contains("stopped") && row.contains("ccw/ccw-16m"),
        "{table}"
    );
    d.ok(&["start", manual]);
    let e = d.fail(&["start", manual]);
    assert!(e.contains("running already"), "{e}");
    // stop keeps the definition; undefine keeps the instance; remove drops both.
    d.ok(&["stop", auto]);
    assert!(file.exists());
    d.ok(&["undefine", &created_auto]);
    assert!(instances(&d)
        .iter()
        .any(|i| i["uuid"] == created_auto.as_str()));
    d.ok(&["remove", manual]);
    assert!(!d
        .state()
        .join(format!("definitions/{manual}.json"))
        .exists());
    d.stop();
}

#[test]
fn test_daemon_malformed_definition_file_reported_daemon_starts() {
    let mut d = Daemon::start(&[]);
    let good = "31111111-2222-4333-8444-555555555555";
    d.ok(&["define", "--type", "gpu-4m", "--uuid", good, "--auto"]);
    d.stop();
    let bad = "41111111-2222-4333-8444-555555555555";
    let bad_file = d.state().join(format!("definitions/{bad}.json"));
    fs::write(&bad_file, "{\"version\": 1, \"uuid\": ").unwrap();

    d.restart();
    let log = d.log();
    assert!(
        log.contains("malformed definition file") && log.contains(&bad_file.display().to_string()),
        "{log}"
    );
    // The good definition autostarted regardless.
    assert_eq!(instances(&d).len(), 1);
    let table = d.ok(&["list", "--defined"]);
    let row = table.lines().find(|l| l.starts_with(bad)).unwrap();
    assert!(row.contains("broken"), "{table}");
    assert!(
        table.contains(&format!(
            "broken definition {}: not JSON",
            bad_file.display()
        )),
        "{table}"
    );
    let v = d.json(&["list", "--defined"]);
    assert_eq!(v["broken"][0]["uuid"], bad);
    let e = d.fail(&["start", bad]);
    assert!(e.contains("malformed"), "{e}");
    let e = d.fail(&["create", "--type", "gpu-4m", "--uuid", bad]);
    assert!(e.contains("malformed"), "{e}");
    d.ok(&["undefine", bad]);
    assert!(!bad_file.exists());
    assert!(d.json(&["list", "--defined"])["broken"]
        .as_array()
        .unwrap()
        .is_empty());
}

#[test]
fn test_daemon_autostart_failure_logged_and_reported_by_list_defined() {
    let mut d = Daemon::start(&[]);
    let u = "51111111-2222-4333-8444-555555555555";
    d.ok(&["define", "--type", "gpu-16m", "--uuid", u, "--auto"]);
    d.stop();
    // The daemon comes back without that type.
    d.extra = vec!["--gpu-type".into(), "gpu-4m:4:1".into()];
    d.restart();
    assert!(d.log().contains("autostart failed"), "{}", d.log());
    assert!(instances(&d).is_empty());
    let table = d.ok(&["list", "--defined"]);
    let row = table.lines().find(|l| l.starts_with(u)).unwrap();
    assert!(row.contains("start failed"), "{table}");
    assert!(
        table.contains(&format!(
            "{u}: autostart failed: unknown type \"gpu/gpu-16m\""
        )),
        "{table}"
    );
    let e = d.fail(&["start", u]);
    assert!(e.contains("unknown type"), "{e}");
}

#[test]
fn test_cli_without_daemon_says_how_to_start_one() {
    let dir = tempfile::tempdir().unwrap();
    let control = dir.path().join("control.sock");
    let out = Command::new(BIN)
        .args(["list", "--control"])
        .arg(&control)
        .env_remove("UMDEV_CONTROL")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains(&format!(
            "no umdev daemon is listening on {}",
            control.display()
        )) && e.contains("start one with `umdev daemon`"),
        "{e}"
    );
}

/// Make the GPU behind `vmm` pin a guest page: a blit from a surface mapped by GTT entry 0.
fn gpu_pin_a_page(vmm: &mut Vmm) {
    let mut ram = vmm.ram().clone();
    let mut drv = Driver::probe(Bar0(&mut *vmm)).unwrap();
    drv.set_mode(64, 64, 256).unwrap();
    drv.setup_ring(RAM_BASE, 64 * 1024).unwrap();
    drv.set_gtt(0, RAM_BASE + 0x8_0000, false).unwrap();
    let cmds = [
        GpuCmd::Blit {
            gtt_index: 0,
            stride: 64,
            w: 16,
            h: 4,
            dst_x: 0,
            dst_y: 0,
        },
        GpuCmd::Fence { value: 1 },
    ];
    drv.submit(&mut ram, &cmds).unwrap();
    drv.wait_fence(1).unwrap();
}

#[test]
fn test_daemon_remove_with_client_busy_then_force_leaves_zero_pins() {
    let d = Daemon::start(&["--release-timeout", "0.3"]);
    let (uuid, socket) = create(&d, &["--type", "gpu-4m"]);
    let mut vmm = Vmm::connect(&socket)
        .unwrap()
        .with_ram(RAM_BASE, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    let req = vmm.attach_eventfd(irq_index::REQ).unwrap();
    gpu_pin_a_page(&mut vmm);
    let pinned = instances(&d)[0]["dma"]["pinned_pages"].as_u64().unwrap();
    assert!(pinned >= 1, "the blit pinned nothing");

    let e = d.fail(&["remove", &uuid]);
    assert!(
        e.contains(&format!("instance {uuid} is busy"))
            && e.contains(&format!("umdev remove {uuid} --force")),
        "{e}"
    );
    assert_eq!(
        wait_eventfd(&req, Duration::from_secs(2)),
        Some(1),
        "the client never saw the request IRQ"
    );
    // Refused: still served, still attached, still defined in the listing.
    assert_eq!(vmm.read32(0, 0).unwrap(), ID_MAGIC);
    assert_eq!(instances(&d)[0]["client_attached"], true);
    let e = d.fail(&["stop", &uuid]);
    assert!(e.contains(&format!("umdev stop {uuid} --force")), "{e}");

    let v = d.json(&["remove", &uuid, "--force"]);
    let st = &v["stopped"];
    assert_eq!(st["forced"], true, "{v}");
    assert_eq!(st["release_requested"], true, "{v}");
    assert_eq!(st["dma"]["pinned_pages"], 0, "{v}");
    assert_eq!(st["dma"]["locked_pages"], 0, "{v}");
    assert_eq!(st["dma"]["maps"], 0, "{v}");
    assert!(vmm.read32(0, 0).is_err(), "the client was not disconnected");
    assert!(instances(&d).is_empty());
    assert!(d.log().contains("forced removal"), "{}", d.log());
}

#[test]
fn test_daemon_sigterm_disconnects_clients_without_request_irq_zero_pins() {
    let mut d = Daemon::start(&[]);
    let (uuid, socket) = create(&d, &["--type", "gpu-4m", "--auto"]);
    let mut vmm = Vmm::connect(&socket)
        .unwrap()
        .with_ram(RAM_BASE, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    let req = vmm.attach_eventfd(irq_index::REQ).unwrap();
    gpu_pin_a_page(&mut vmm);
    let log = d.stop();
    let line = log
        .lines()
        .find(|l| l.contains("instance stopped") && l.contains(&uuid))
        .unwrap_or_else(|| panic!("no stop line for {uuid}:\n{log}"));
    assert!(
        line.contains("client_disconnected=true") && line.contains("pinned_pages=0"),
        "{line}"
    );
    assert_eq!(wait_eventfd(&req, Duration::from_millis(50)), None);
    assert!(vmm.read32(0, 0).is_err());
}

#[test]
fn test_daemon_control_socket_owner_only_second_daemon_refused() {
    let d = Daemon::start(&[]);
    let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&d.control()), 0o600);
    assert_eq!(mode(&d.sockets()), 0o700);
    assert_eq!(mode(&d.state()), 0o700);
    let out = d.command().stderr(Stdio::piped()).output().unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("in use by another umdev daemon"), "{e}");
    // Another state directory, the same control socket: refused, the socket kept.
    let out = Command::new(BIN)
        .arg("daemon")
        .arg("--state-dir")
        .arg(d.dir.path().join("other-state"))
        .arg("--socket-dir")
        .arg(d.sockets())
        .env_remove("UMDEV_CONTROL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        e.contains(&format!(
            "another umdev daemon is running on {}",
            d.control().display()
        )),
        "{e}"
    );
    assert_eq!(mode(&d.control()), 0o600);
    // The first one still answers.
    d.ok(&["list"]);
}

#[test]
fn test_daemon_answers_other_protocol_version_with_clear_error() {
    let d = Daemon::start(&[]);
    let ask = |text: &str| {
        let mut s = UnixStream::connect(d.control()).unwrap();
        s.write_all(text.as_bytes()).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        serde_json::from_str::<Value>(answer.trim_end()).unwrap()
    };
    let v = ask("{\"version\":999,\"request\":{\"op\":\"frobnicate\",\"x\":[1]}}\n");
    assert_eq!(v["version"], 2);
    assert_eq!(v["error"]["kind"], "version_mismatch", "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("version 2") && msg.contains("999"), "{msg}");
    let v = ask("{\"version\":2,\"request\":{\"op\":\"frobnicate\"}}\n");
    assert_eq!(v["error"]["kind"], "bad_request", "{v}");
    let v = ask("not json\n");
    assert_eq!(v["error"]["kind"], "bad_request", "{v}");
    let v = ask("{\"version\":2,\"request\":{\"op\":\"list\"}}\n");
    assert!(v["ok"]["instances"].as_array().unwrap().is_empty(), "{v}");
}

/// `(comm, nice)` of every thread of process `pid` (fields 2 and 19 of its `stat`).
fn thread_nices(pid: u32) -> Vec<(String, i32)> {
    let mut out = Vec::new();
    for entry in fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let Ok(stat) = fs::read_to_string(entry.unwrap().path().join("stat")) else {
            continue; // gone since the listing
        };
        let (open, close) = (stat.find('(').unwrap(), stat.rfind(')').unwrap());
        let nice = stat[close + 1..].split_whitespace().nth(19 - 3).unwrap();
        out.push((stat[open + 1..close].to_owned(), nice.parse().unwrap()));
    }
    out
}

#[test]
fn test_daemon_gpu_engine_thread_keeps_daemons_nice_by_default_flag_lowers_it() {
    for (flags, want) in [
        (&[][..], 0),
        (&["--gpu-engine-nice", "19"][..], 19),
        (&["--gpu-engine-nice", "inherit"][..], 0),
    ] {
        let d = Daemon::start(flags);
        let pid = d.child.as_ref().unwrap().id();
        let daemon_nice = thread_nices(pid)
            .into_iter()
            .find(|(comm, _)| comm == "umdev")
            .expect("the daemon's main thread")
            .1;
        // Run as a plain test process, the daemon is at nice 0 unless the whole run is.
        let want = if want == 0 {
            daemon_nice
        } else {
            want.max(daemon_nice)
        };
        let (_, socket) = create(&d, &["--type", "gpu-4m"]);
        // The engine thread starts with the first client's attach.
        let mut vmm = Vmm::connect(&socket).unwrap();
        assert_eq!(vmm.read32(0, 0).unwrap(), ID_MAGIC);
        let deadline = Instant::now() + Duration::from_secs(30);
        let threads = loop {
            let t = thread_nices(pid);
            if t.iter().any(|(comm, _)| comm == "gpu-pool-engine") {
                break t;
            }
            assert!(Instant::now() < deadline, "no engine thread: {t:?}");
            std::thread::sleep(Duration::from_millis(10));
        };
        for (comm, nice) in &threads {
            let expect = if comm == "gpu-pool-engine" {
                want
            } else {
                daemon_nice
            };
            assert_eq!(*nice, expect, "{flags:?}: thread {comm}: {threads:?}");
        }
        drop(vmm);
    }
    let out = Command::new(BIN)
        .args(["daemon", "--gpu-engine-nice", "20"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("\"20\" is not a nice value"), "{e}");
}

#[test]
fn test_daemon_relative_socket_dir_qemu_line_and_paths_absolute() {
    let d = Daemon::start_relative(&[]);
    let sockets = fs::canonicalize(d.sockets()).unwrap();
    let text = d.ok(&["create", "--type", "gpu-4m"]);
    let uuid = text.split_whitespace().nth(1).unwrap().to_owned();
    let socket = sockets.join(format!("{uuid}.sock"));
    assert!(socket.is_absolute());
    assert!(
        text.contains(&format!(r#""path":"{}""#, socket.display())),
        "{text}"
    );
    let listed = instances(&d);
    assert_eq!(listed[0]["socket"], socket.to_str().unwrap(), "{listed:?}");
    let defined = d.json(&["define", "--type", "gpu-4m"]);
    let path = PathBuf::from(defined["definition"]["path"].as_str().unwrap());
    assert!(path.is_absolute(), "{defined}");
    assert!(path.starts_with(fs::canonicalize(d.state()).unwrap()));
    let log = d.log();
    assert!(
        log.contains(&format!(
            "control={}",
            sockets.join("control.sock").display()
        )),
        "{log}"
    );
}

/// Connect to the control socket and send `byte` every `every` from another thread until
/// the daemon closes; returns how long the daemon kept the connection and what it said.
fn trickle(d: &Daemon, byte: u8, every: Duration, at_most: Duration) -> (Duration, String) {
    let s = UnixStream::connect(d.control()).unwrap();
    let mut writer = s.try_clone().unwrap();
    let t0 = Instant::now();
    let feeder = std::thread::spawn(move || {
        while t0.elapsed() < at_most && writer.write_all(&[byte]).is_ok() {
            std::thread::sleep(every);
        }
    });
    let mut reader = s;
    reader.set_read_timeout(Some(at_most * 2)).unwrap();
    let mut answer = String::new();
    let _ = reader.read_to_string(&mut answer);
    let held = t0.elapsed();
    feeder.join().unwrap();
    (held, answer)
}

#[test]
fn test_daemon_control_trickling_peer_cut_off_at_request_deadline() {
    let d = Daemon::start(&["--control-timeout", "1"]);
    // A byte every 100 ms keeps every single read well within any per-read timeout.
    let (held, answer) = trickle(&d, b' ', Duration::from_millis(100), Duration::from_secs(4));
    assert!(
        held < Duration::from_millis(2500),
        "held {held:?}: {answer}"
    );
    assert!(
        held >= Duration::from_millis(900),
        "held {held:?}: {answer}"
    );
    let v: Value = serde_json::from_str(answer.trim_end()).unwrap();
    assert_eq!(v["error"]["kind"], "bad_request", "{v}");
    assert!(answer.contains("deadline"), "{answer}");
    // The slot is free: a request is answered.
    d.ok(&["list"]);
    // A migrate_load whose state trickles is cut off too (its payload has its own time).
    let s = UnixStream::connect(d.control()).unwrap();
    let mut w = &s;
    w.write_all(
        b"{\"version\":2,\"request\":{\"op\":\"migrate_load\",\"uuid\":\"00000000-0000-4000-8000-0000000000d1\",\"type\":\"gpu/gpu-4m\",\"state_len\":1000}}\n",
    )
    .unwrap();
    let t0 = Instant::now();
    let mut answer = String::new();
    let mut r = &s;
    r.read_to_string(&mut answer).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    assert!(
        answer.contains("reading the payload: the request's deadline passed"),
        "{answer}"
    );
}

#[test]
fn test_daemon_control_out_of_fds_accept_backs_off_then_recovers() {
    let mut d = Daemon::unstarted(&["--control-timeout", "2"]);
    // Room for the daemon's own files and a few connections, not for 80.
    d.nofile = Some(48);
    d.restart();
    let peers: Vec<UnixStream> = (0..80)
        .filter_map(|_| UnixStream::connect(d.control()).ok())
        .collect();
    assert!(peers.len() > 48, "{} peers connected", peers.len());
    std::thread::sleep(Duration::from_millis(1500));
    let failed = d.log().matches("accept failed").count();
    assert!(
        (1..=2).contains(&failed),
        "{failed} lines of accept failures in 1.5 s:\n{}",
        d.log()
    );
    drop(peers);
    // The slots and fds come back (the peers' connections end or time out).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = d.umdev(&["list"]);
        if out.status.success() {
            break;
        }
        assert!(Instant::now() < deadline, "the daemon never answered again");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn test_daemon_control_payload_budget_second_large_state_unavailable() {
    let d = Daemon::start(&["--control-timeout", "5"]);
    let largest = umdev::migration::stream::MAX_FRAME as u64 + 4096;
    let load = |uuid: &str| {
        let s = UnixStream::connect(d.control()).unwrap();
        let req = serde_json::json!({"version": 2, "request": {
            "op": "migrate_load", "uuid": uuid, "type": "gpu/gpu-4m", "state_len": largest}});
        (&s).write_all(format!("{req}\n").as_bytes()).unwrap();
        s
    };
    // The first announces the largest state and sends none of it: the budget is its.
    let first = load("00000000-0000-4000-8000-0000000000e1");
    std::thread::sleep(Duration::from_millis(200));
    let second = load("00000000-0000-4000-8000-0000000000e2");
    second
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let mut answer = String::new();
    (&second).read_to_string(&mut answer).unwrap();
    let v: Value = serde_json::from_str(answer.trim_end()).unwrap();
    assert_eq!(v["error"]["kind"], "unavailable", "{v}");
    assert!(answer.contains("receiving other states"), "{answer}");
    drop(first);
    // Given back when the first connection ends.
    std::thread::sleep(Duration::from_millis(300));
    let third = load("00000000-0000-4000-8000-0000000000e3");
    (&third).write_all(b"short").unwrap();
    third.shutdown(std::net::Shutdown::Write).unwrap();
    let mut answer = String::new();
    (&third).read_to_string(&mut answer).unwrap();
    assert!(answer.contains("cut short: 5 of"), "{answer}");
}

/// A file on the build machine's disk (the crate's target directory), or None where that
/// is tmpfs (then every file is acceptable and there is nothing to refuse).
fn disk_file() -> Option<std::fs::File> {
    let f = tempfile::tempfile_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    f.set_len(1 << 16).unwrap();
    // SAFETY: a zeroed struct that fstatfs fills.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
    // SAFETY: a valid fd and a struct of the size fstatfs writes.
    let r = unsafe { libc::fstatfs(fd, &mut fs) };
    assert_eq!(r, 0);
    (fs.f_type != libc::TMPFS_MAGIC && fs.f_type != libc::HUGETLBFS_MAGIC).then_some(f)
}

#[test]
fn test_daemon_refuses_disk_file_maps_unless_allow_any_file_maps() {
    use std::os::fd::AsFd;
    let Some(file) = disk_file() else {
        eprintln!("SKIPPED: the target directory is on tmpfs");
        return;
    };
    for (flags, allowed) in [(&[][..], false), (&["--allow-any-file-maps"][..], true)] {
        let d = Daemon::start(flags);
        let (_uuid, socket) = create(&d, &["--type", "gpu-4m"]);
        let mut vmm = Vmm::connect(&socket).unwrap();
        let r = vmm.dma_map_fd(0, 1 << 16, file.as_fd(), 0);
        if allowed {
            r.unwrap();
            assert!(
                d.log().contains("--allow-any-file-maps"),
                "the daemon warns at startup: {}",
                d.log()
            );
        } else {
            let e = r.unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
            // The memfd-backed guest RAM of the harness is still accepted.
            drop(vmm);
            let vmm = Vmm::connect(&socket).unwrap().with_ram(0, 1 << 16).unwrap();
            drop(vmm);
        }
    }
}
