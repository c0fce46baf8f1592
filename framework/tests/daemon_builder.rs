//! `umdev::daemon` as a library user sees it: a daemon run on a thread and stopped through
//! its handle, a second daemon on the same state directory refused, a parent factory given
//! the checked directories, and its error returned as it is.

use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use umdev::daemon::client::{self, ClientError};
use umdev::daemon::protocol::{Reply, Request};
use umdev::daemon::{Daemon, DaemonConfig, DaemonError};
use umdev::device::Device;
use umdev::instance::{CreateRequest, InstanceError, InstanceType, Parent};
use umdev::testing::TrivialDevice;

/// One type, no resources.
struct Plain;

impl Parent for Plain {
    fn name(&self) -> &str {
        "plain"
    }
    fn types(&self) -> Vec<InstanceType> {
        vec![InstanceType {
            name: "plain".into(),
            description: "registers".into(),
            device_api: "vfio-pci".into(),
            needs: Vec::new(),
        }]
    }
    fn create(&self, _req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        Ok(Box::new(TrivialDevice::default()))
    }
}

fn config(dir: &tempfile::TempDir) -> DaemonConfig {
    DaemonConfig::new(dir.path().join("state"), dir.path().join("sockets"))
}

/// `request`, once the daemon on `control` answers.
fn call(control: &std::path::Path, request: &Request) -> Reply {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match client::call(control, request) {
            Err(ClientError::NoDaemon { .. }) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10))
            }
            result => return result.unwrap(),
        }
    }
}

#[test]
fn test_daemon_stop_before_run_serves_then_stops_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let builder = Daemon::builder(config(&dir)).parent(Arc::new(Plain));
    builder.stop_handle().stop();
    builder.run().unwrap();
    // It did start: its definitions directory is there, its control socket gone again.
    assert!(dir.path().join("state/definitions").is_dir());
    assert!(!dir.path().join("sockets/control.sock").exists());
}

#[test]
fn test_daemon_second_on_same_state_dir_refused_first_serves_on() {
    let dir = tempfile::tempdir().unwrap();
    let first = Daemon::builder(config(&dir)).parent(Arc::new(Plain));
    let stop = first.stop_handle();
    let served = std::thread::spawn(move || first.run());
    let control = dir.path().join("sockets/control.sock");
    call(&control, &Request::Types);

    let mut other = config(&dir);
    other.control = Some(dir.path().join("other.sock"));
    let e = Daemon::builder(other)
        .parent(Arc::new(Plain))
        .run()
        .unwrap_err();
    assert!(matches!(e, DaemonError::StateInUse { .. }), "{e:?}");
    let Reply::Types(types) = call(&control, &Request::Types) else {
        panic!("not a types reply");
    };
    assert_eq!(types.types[0].type_name, "plain");
    stop.stop();
    served.join().unwrap().unwrap();
}

#[test]
fn test_daemon_parent_factory_gets_checked_dirs_and_its_error_is_returned_as_is() {
    let dir = tempfile::tempdir().unwrap();
    let (tx, rx) = mpsc::channel::<PathBuf>();
    let e = Daemon::builder(config(&dir))
        .parent_with(move |dirs| {
            tx.send(dirs.state_dir.clone()).unwrap();
            Err("no such engine".into())
        })
        .run()
        .unwrap_err();
    assert!(matches!(e, DaemonError::Parent(_)), "{e:?}");
    assert_eq!(e.to_string(), "no such engine");
    let state = rx.recv().unwrap();
    assert!(state.is_absolute() && state.ends_with("state"), "{state:?}");
    // Nothing is left listening.
    assert!(!dir.path().join("sockets/control.sock").exists());
}
