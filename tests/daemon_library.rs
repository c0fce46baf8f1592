//! The daemon library (`umdev::daemon`) serving a parent that is neither the GPU nor the
//! ccw one, run on a thread of this test, and `umdev`'s client commands (the real binary)
//! driving it: they show the types the daemon reports, create, list and remove its
//! instances, and pass on what its migration check says.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use umdev::daemon::protocol::{ControlError, ErrorKind};
use umdev::daemon::{Daemon, DaemonConfig, DaemonError, StopHandle};
use umdev::device::Device;
use umdev::instance::{CreateRequest, InstanceError, InstanceType, Params, Parent, Resource};
use umdev::testing::{DeviceAccess, TrivialDevice, Vmm};

const BIN: &str = env!("CARGO_BIN_EXE_umdev");

/// Two slots of register devices; the parameter `stay` (any value) keeps an instance from
/// migrating (the daemon's migration check).
struct Regs;

impl Parent for Regs {
    fn name(&self) -> &str {
        "regs"
    }
    fn resources(&self) -> Vec<Resource> {
        vec![Resource {
            name: "slots".into(),
            unit: "slots".into(),
            total: 2,
        }]
    }
    fn types(&self) -> Vec<InstanceType> {
        vec![InstanceType {
            name: "regs-small".into(),
            description: "registers".into(),
            device_api: "vfio-pci".into(),
            needs: vec![("slots".into(), 1)],
        }]
    }
    fn check_params(&self, _type_name: &str, params: &Params) -> Result<(), InstanceError> {
        match params.keys().find(|k| *k != "stay") {
            None => Ok(()),
            Some(k) => Err(InstanceError::BadParam {
                name: k.clone(),
                why: "regs instances take only `stay`".into(),
            }),
        }
    }
    fn create(&self, _req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        Ok(Box::new(TrivialDevice::default()))
    }
}

/// A library daemon with the `regs` parent on a thread, its directories in a temp dir.
struct Served {
    dir: tempfile::TempDir,
    stop: StopHandle,
    thread: Option<JoinHandle<Result<(), DaemonError>>>,
}

impl Served {
    fn start() -> Served {
        let dir = tempfile::tempdir().unwrap();
        let config = DaemonConfig::new(dir.path().join("state"), dir.path().join("sockets"));
        let builder = Daemon::builder(config)
            .parent(Arc::new(Regs))
            .migration_check(|info| match info.params.get("stay") {
                Some(_) => Err(ControlError::new(
                    ErrorKind::NotMigratable,
                    format!("{} stays here", info.uuid),
                )
                .hint("drop the stay parameter")),
                None => Ok(()),
            });
        let stop = builder.stop_handle();
        let served = Served {
            stop,
            thread: Some(std::thread::spawn(move || builder.run())),
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !served.umdev(&["types"]).status.success() {
            assert!(Instant::now() < deadline, "the daemon never answered");
            std::thread::sleep(Duration::from_millis(20));
        }
        served
    }

    fn control(&self) -> PathBuf {
        self.dir.path().join("sockets/control.sock")
    }

    fn umdev(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .env("UMDEV_CONTROL", self.control())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    fn json(&self, args: &[&str]) -> Value {
        let mut args = args.to_vec();
        args.push("--json");
        let out = self.umdev(&args);
        assert!(
            out.status.success(),
            "umdev {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// Stop the daemon as SIGTERM would; it must stop cleanly.
    fn stop(&mut self) {
        self.stop.stop();
        let thread = self.thread.take().expect("stopped already");
        thread.join().unwrap().unwrap();
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.stop();
        }
    }
}

#[test]
fn test_library_daemon_umdev_commands_show_its_types_create_list_remove() {
    let mut d = Served::start();
    let types = d.json(&["types"]);
    let names: Vec<String> = types["types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| format!("{}/{}", t["parent"], t["type"]).replace('"', ""))
        .collect();
    assert_eq!(names, ["regs/regs-small"], "{types}");
    let table = String::from_utf8(d.umdev(&["types"]).stdout).unwrap();
    assert!(
        table.contains("regs-small") && !table.contains("gpu"),
        "{table}"
    );

    let created = d.json(&["create", "--type", "regs-small", "--auto"]);
    let uuid = created["instance"]["uuid"].as_str().unwrap().to_owned();
    let socket = PathBuf::from(created["instance"]["socket"].as_str().unwrap());
    assert!(socket.starts_with(d.dir.path().join("sockets")));
    let mut vmm = Vmm::connect(&socket).unwrap();
    assert_eq!(
        vmm.read8(0, 0x10).unwrap(),
        0x10,
        "BAR0 of the trivial device"
    );
    drop(vmm);
    let list = d.json(&["list"]);
    assert_eq!(list["instances"][0]["uuid"], uuid.as_str(), "{list}");
    assert_eq!(list["instances"][0]["type"], "regs-small", "{list}");
    let defined = d.dir.path().join(format!("state/definitions/{uuid}.json"));
    assert!(defined.is_file());

    let removed = d.json(&["remove", &uuid]);
    assert_eq!(removed["uuid"], uuid.as_str(), "{removed}");
    assert!(!defined.exists() && !socket.exists());
    assert_eq!(d.json(&["list"])["instances"], Value::Array(Vec::new()));
    d.stop();
    assert!(
        !d.control().exists(),
        "the control socket is removed at the stop"
    );
}

#[test]
fn test_library_daemon_migration_check_refuses_and_instance_serves_on() {
    let d = Served::start();
    let created = d.json(&["create", "--type", "regs/regs-small", "stay=yes"]);
    let uuid = created["instance"]["uuid"].as_str().unwrap().to_owned();
    // The destination is this daemon itself: the check refuses before anything moves.
    let to = d.control();
    let out = d.umdev(&["migrate", &uuid, "--to", to_str(&to)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{uuid} stays here")) && stderr.contains("hint: drop the stay"),
        "{stderr}"
    );
    let list = d.json(&["list"]);
    assert_eq!(list["instances"][0]["uuid"], uuid.as_str(), "{list}");
}

fn to_str(p: &Path) -> &str {
    p.to_str().unwrap()
}
