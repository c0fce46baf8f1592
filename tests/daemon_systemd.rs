//! `umdev daemon` under systemd, without a running systemd: the units checked by
//! `systemd-analyze verify`, socket activation by `systemd-socket-activate` (the real
//! LISTEN_FDS launcher of Debian's `systemd` package), sd_notify against a NOTIFY_SOCKET
//! the test binds, SIGHUP reloading the definitions, and the journal's log form.
//!
//! The systemd tools are required: a missing one fails its test with what to install
//! (`UMDEV_NO_SYSTEMD_TOOLS=1` skips those tests instead, for a machine without them).

use std::fs;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

#[path = "common/daemon.rs"]
mod daemon;

use daemon::{Daemon, BIN};

const ANALYZE: &str = "/usr/bin/systemd-analyze";
const ACTIVATE: &str = "/usr/bin/systemd-socket-activate";
const UUID: &str = "6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11";

/// Whether `tool` may be used: it must exist unless the skip variable is set.
fn tool(tool: &str) -> bool {
    if Path::new(tool).exists() {
        return true;
    }
    assert!(
        std::env::var_os("UMDEV_NO_SYSTEMD_TOOLS").is_some(),
        "{tool} is missing: install Debian's `systemd` package (or set \
         UMDEV_NO_SYSTEMD_TOOLS=1 to skip this test)"
    );
    eprintln!("skipped: {tool} is missing and UMDEV_NO_SYSTEMD_TOOLS is set");
    false
}

fn unit(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("systemd")
        .join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The value of `key=` in a unit's text (the last one, as systemd takes it).
fn setting<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .rev()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn test_units_verify_clean_and_match_daemon_defaults() {
    let service = unit("umdev.service");
    let socket = unit("umdev.socket");
    // The daemon's root defaults (umdev::daemon::paths) are what the units set up.
    assert_eq!(
        setting(&socket, "ListenStream"),
        Some("/run/umdev/control.sock")
    );
    assert_eq!(setting(&service, "StateDirectory"), Some("umdev"));
    assert_eq!(setting(&service, "RuntimeDirectory"), Some("umdev"));
    assert_eq!(setting(&service, "RuntimeDirectoryPreserve"), Some("yes"));
    assert_eq!(setting(&service, "Type"), Some("notify"));
    assert_eq!(
        setting(&service, "ExecReload"),
        Some("/bin/kill -HUP $MAINPID")
    );
    assert_eq!(
        setting(&service, "RestrictAddressFamilies"),
        Some("AF_UNIX")
    );
    let exec = setting(&service, "ExecStart").unwrap();
    assert!(exec.starts_with("/usr/bin/umdev daemon"), "{exec}");
    if !tool(ANALYZE) {
        return;
    }
    // verify wants ExecStart's binary to exist: a copy of the units runs the built one.
    let dir = tempfile::tempdir().unwrap();
    let copy = service.replace("/usr/bin/umdev", BIN);
    fs::write(dir.path().join("umdev.service"), copy).unwrap();
    fs::write(dir.path().join("umdev.socket"), &socket).unwrap();
    let out = Command::new(ANALYZE)
        .arg("verify")
        .arg(dir.path().join("umdev.service"))
        .arg(dir.path().join("umdev.socket"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "systemd-analyze verify failed:\n{stderr}"
    );
    // An unknown or misspelt key is only a warning: none is allowed.
    assert!(
        stderr.trim().is_empty(),
        "systemd-analyze verify warns:\n{stderr}"
    );
}

/// The parsed output of `umdev ARGS --json --control PATH`, or its stderr.
fn umdev_json(control: &Path, args: &[&str]) -> Result<Value, String> {
    let out = Command::new(BIN)
        .args(args)
        .arg("--json")
        .arg("--control")
        .arg(control)
        .env_remove("UMDEV_CONTROL")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    match out.status.success() {
        true => Ok(serde_json::from_slice(&out.stdout).unwrap()),
        false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
    }
}

#[test]
fn test_daemon_socket_activated_control_serves_types_and_socket_file_stays() {
    if !tool(ACTIVATE) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The activated socket is not where the daemon would bind its own
    // (<socket-dir>/control.sock): only the inherited fd can answer on it.
    let control = dir.path().join("activated.sock");
    let sockets = dir.path().join("sockets");
    let log_path = dir.path().join("daemon.log");
    let mut child = Command::new(ACTIVATE)
        .arg("-l")
        .arg(&control)
        .args(["-E", "RUST_LOG=info", BIN, "daemon", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--socket-dir")
        .arg(&sockets)
        .env_remove("UMDEV_CONTROL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let log = || fs::read_to_string(&log_path).unwrap_or_default();
    wait_until(
        "systemd-socket-activate to listen",
        Duration::from_secs(10),
        || control.exists(),
    );
    // The first connection starts the daemon (the launcher execs it with LISTEN_FDS=1).
    // The client would wait without a bound on a socket nobody accepts on: first make sure
    // the daemon took the inherited one.
    let trigger = std::os::unix::net::UnixStream::connect(&control).unwrap();
    wait_until("the daemon to be ready", Duration::from_secs(20), || {
        log().contains("umdev daemon ready")
    });
    let log_text = log();
    assert!(
        log_text.contains("control socket passed by the service manager"),
        "{log_text}"
    );
    drop(trigger);
    let types = umdev_json(&control, &["types"]).unwrap_or_else(|e| panic!("{e}\n{}", log()));
    assert_eq!(types["types"][0]["type"], "gpu-4m", "{types}");
    assert!(
        !sockets.join("control.sock").exists(),
        "the daemon bound a control socket of its own"
    );
    // A second request, and an instance, through the same socket.
    let started = umdev_json(&control, &["create", "--type", "gpu-4m"]).unwrap();
    assert!(started["instance"]["socket"]
        .as_str()
        .unwrap()
        .starts_with(sockets.to_str().unwrap()));
    // The launcher exec'd the daemon in its own process: SIGTERM goes to the daemon.
    // SAFETY: signalling our own child process.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}\n{}", log());
    assert!(log().contains("umdev daemon stopped"), "{}", log());
    // The socket file is the manager's: left in place for the next activation.
    assert!(
        control.exists(),
        "the daemon removed the inherited socket file"
    );
}

/// The datagrams on `sock` until one contains `want`; returns them all, in order.
fn notifications_until(sock: &UnixDatagram, want: &str, timeout: Duration) -> Vec<String> {
    let deadline = Instant::now() + timeout;
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(!left.is_zero(), "no {want:?} notification; got {got:?}");
        sock.set_read_timeout(Some(left)).unwrap();
        match sock.recv(&mut buf) {
            Ok(n) => {
                let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
                let done = msg.lines().any(|l| l == want);
                got.push(msg);
                if done {
                    return got;
                }
            }
            Err(e) => panic!("no {want:?} notification ({e}); got {got:?}"),
        }
    }
}

fn write_definition(d: &Daemon, uuid: &str, autostart: bool) -> PathBuf {
    let dir = d.state().join("definitions");
    fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{uuid}.json"));
    let def = serde_json::json!({
        "version": 1, "uuid": uuid, "parent": "gpu", "type": "gpu-4m",
        "params": {}, "autostart": autostart,
    });
    fs::write(&path, def.to_string()).unwrap();
    path
}

#[test]
fn test_daemon_notifies_ready_after_autostart_serves_reloading_and_stopping() {
    let notify_dir = tempfile::tempdir().unwrap();
    let notify_path = notify_dir.path().join("notify");
    let sock = UnixDatagram::bind(&notify_path).unwrap();
    let mut d = Daemon::unstarted(&[]);
    d.env
        .push(("NOTIFY_SOCKET".into(), notify_path.to_str().unwrap().into()));
    write_definition(&d, UUID, true);
    d.restart();
    let got = notifications_until(&sock, "READY=1", Duration::from_secs(20));
    // READY=1 comes once the autostart instance serves and the control socket answers.
    let ready = got.last().unwrap();
    assert!(
        ready.contains("STATUS=serving; instances running: 1;"),
        "{got:?}"
    );
    let socket = d.sockets().join(format!("{UUID}.sock"));
    assert!(
        socket.exists(),
        "READY=1 before the autostart instance serves"
    );
    assert_eq!(d.json(&["list"])["instances"][0]["uuid"], UUID);

    d.signal(libc::SIGHUP);
    let got = notifications_until(&sock, "READY=1", Duration::from_secs(20));
    assert!(got[0].lines().any(|l| l == "RELOADING=1"), "{got:?}");
    assert!(got[0].contains("MONOTONIC_USEC="), "{got:?}");
    assert!(
        got.last()
            .unwrap()
            .contains("STATUS=definitions reloaded (0 added, 0 changed, 0 removed, 0 started"),
        "{got:?}"
    );

    d.signal(libc::SIGTERM);
    let got = notifications_until(&sock, "STOPPING=1", Duration::from_secs(20));
    assert!(got.last().unwrap().contains("STATUS=stopping"), "{got:?}");
    // (A second SIGTERM, from stop, stays pending: the daemon waits for no more signals.)
    d.stop();
}

#[test]
fn test_daemon_sighup_starts_new_autostart_definition_keeps_running_instances() {
    let d = Daemon::start(&[]);
    // Defined and running; its file then goes (an admin's `rm`).
    let kept = "11111111-2222-4333-8444-555555555555";
    d.ok(&["create", "--type", "gpu-4m", "--uuid", kept, "--auto"]);
    fs::remove_file(d.state().join("definitions").join(format!("{kept}.json"))).unwrap();
    // New files: one autostart, one not.
    write_definition(&d, UUID, true);
    let idle = "aaaaaaaa-bbbb-4ccc-8ddd-eeeeeeeeeeee";
    write_definition(&d, idle, false);
    d.signal(libc::SIGHUP);
    wait_until("the reload", Duration::from_secs(20), || {
        d.log().contains("definitions reloaded")
    });
    let running: Vec<String> = d.json(&["list"])["instances"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["uuid"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        running.contains(&UUID.to_owned()),
        "not started: {running:?}"
    );
    assert!(
        running.contains(&kept.to_owned()),
        "stopped by the reload: {running:?}"
    );
    assert!(!running.contains(&idle.to_owned()), "{running:?}");
    let defined = d.json(&["list", "--defined"]);
    let uuids: Vec<&str> = defined["definitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["uuid"].as_str().unwrap())
        .collect();
    assert!(uuids.contains(&UUID) && uuids.contains(&idle), "{defined}");
    assert!(!uuids.contains(&kept), "its file is gone: {defined}");
    let log = d.log();
    assert!(log.contains("reload: autostart: started"), "{log}");
    // A second reload with nothing new starts nothing and changes nothing.
    d.signal(libc::SIGHUP);
    wait_until("the second reload", Duration::from_secs(20), || {
        d.log().matches("definitions reloaded").count() == 2
    });
    assert_eq!(d.json(&["list"])["instances"].as_array().unwrap().len(), 2);
    let log = d.log();
    let last = log
        .lines()
        .rfind(|l| l.contains("definitions reloaded"))
        .unwrap();
    assert!(last.contains("added=[] changed=[] removed=[]"), "{last}");
}

#[test]
fn test_daemon_log_to_journal_stream_has_priorities_no_timestamps() {
    let mut d = Daemon::unstarted(&[]);
    d.journal = true;
    d.restart();
    d.fail(&["create", "--type", "nosuchtype"]); // refused: logged at info
    let log = d.stop();
    let lines: Vec<&str> = log.lines().collect();
    assert!(!lines.is_empty());
    for line in &lines {
        let rest = ["<3>", "<4>", "<6>", "<7>"]
            .iter()
            .find_map(|p| line.strip_prefix(p))
            .unwrap_or_else(|| panic!("no priority prefix: {line:?}\n{log}"));
        // No RFC 3339 timestamp first: the level is.
        let level = rest.split_whitespace().next().unwrap_or_default();
        assert!(
            ["ERROR", "WARN", "INFO", "DEBUG", "TRACE"].contains(&level),
            "{line:?}"
        );
        assert!(!line.contains('\x1b'), "colour in the journal: {line:?}");
    }
    assert!(
        log.contains("<6> INFO umdev::daemon: umdev daemon ready"),
        "{log}"
    );
}

#[test]
fn test_daemon_log_with_journal_stream_of_another_file_keeps_timestamps() {
    let other = tempfile::NamedTempFile::new().unwrap();
    let meta = other.as_file().metadata().unwrap();
    use std::os::unix::fs::MetadataExt;
    let mut d = Daemon::unstarted(&[]);
    // A JOURNAL_STREAM inherited by a process whose stderr was redirected elsewhere.
    d.env.push((
        "JOURNAL_STREAM".into(),
        format!("{}:{}", meta.dev(), meta.ino()),
    ));
    d.restart();
    let log = d.stop();
    let first = log.lines().next().unwrap();
    assert!(!first.starts_with('<'), "{first}");
    assert!(
        first.starts_with("20") && first.contains('T'),
        "no timestamp: {first}"
    );
}
