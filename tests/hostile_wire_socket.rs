//! Socket security: file mode 0600 by default and configurable, one client at a time (a
//! second one gets EBUSY and the first session is untouched), a live socket is never
//! clobbered, a stale one is replaced, anything else at the path is left alone.

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};

use common::test_device::TestDevice;
use common::TestServer;
use hostile::*;
use umdev::dma::{DmaConfig, DmaSpace};
use umdev::protocol::dma_map::DmaMapRequest;
use umdev::protocol::Command;
use umdev::server::{Server, ServerConfig, ServerError};
use umdev::testing::{memfd, RawClient};

fn mode_of(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

fn spawn_at(path: &std::path::Path) -> Result<umdev::server::RunningServer, ServerError> {
    let (device, _state) = TestDevice::new();
    Server::new(
        ServerConfig::new(path),
        Box::new(device),
        DmaSpace::new(DmaConfig::default()),
    )
    .spawn()
}

#[test]
fn test_socket_default_mode_is_0600() {
    let _g = serial();
    let ts = TestServer::start();
    assert_eq!(mode_of(ts.path()), 0o600);
    assert_eq!(ServerConfig::new("/x").socket_mode, 0o600);
}

#[test]
fn test_socket_mode_option_applied() {
    let _g = serial();
    let ts = TestServer::start_with(|c| c.socket_mode = 0o660);
    assert_eq!(mode_of(ts.path()), 0o660);
    let mut c = RawClient::new_default(ts.path());
    assert_eq!(c.region_read(7, 0, 2), vec![0, 1]);
}

#[test]
fn test_socket_second_client_gets_ebusy_first_session_intact() {
    let _g = serial();
    let ts = TestServer::start();
    let mut first = RawClient::new_default(ts.path());
    let mem = memfd(0x4000).unwrap();
    let map = DmaMapRequest {
        flags: 3,
        offset: 0,
        iova: 0x10_0000,
        size: 0x4000,
    };
    let r = first.call(Command::DmaMap as u16, 0, &map.encode(), &[mem.as_raw_fd()]);
    assert!(!r.header.is_error());
    let baseline = open_fds();
    for _ in 0..3 {
        let mut p = vec![0, 0, 0, 0];
        p.extend_from_slice(b"{}\0");
        let mut second = RawClient::connect(ts.path());
        let id = second.send(Command::Version as u16, 0, &p, &[]);
        let m = second.recv();
        assert_eq!(m.header.msg_id, id);
        assert!(m.header.is_error(), "second client was served");
        assert_eq!(m.header.error, libc::EBUSY as u32);
        assert!(closed_by_peer(second.stream()), "second client kept open");
        // The first session still works and still owns its mapping.
        assert_eq!(first.region_read(7, 4, 4), vec![4, 5, 6, 7]);
        assert_eq!(ts.dma().stats().maps, 1);
    }
    // A second client that connects and says nothing is closed too.
    let silent = UnixStream::connect(ts.path()).unwrap();
    assert!(closed_by_peer(&silent));
    drop(silent);
    settle_fds(baseline, "after refusing second clients");
    assert_eq!(first.region_read(7, 8, 2), vec![8, 9]);
    assert_eq!(ts.state().disconnects, 0, "the first session was disturbed");
    // Once the first client leaves, the next one is served.
    drop(first);
    ts.wait_for("first client gone", |s| s.disconnects == 1);
    let mut next = RawClient::new_default(ts.path());
    assert_eq!(next.region_read(7, 0, 2), vec![0, 1]);
}

#[test]
fn test_socket_live_not_clobbered_stale_replaced() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev.sock");
    let live = spawn_at(&path).unwrap();
    assert!(matches!(spawn_at(&path), Err(ServerError::SocketInUse(_))));
    // The live server still answers.
    let mut c = RawClient::new_default(&path);
    assert_eq!(c.region_read(7, 0, 1), vec![0]);
    drop(c);
    live.shutdown().unwrap();
    assert!(!path.exists(), "socket left behind after shutdown");
    // A crashed server's socket: the file exists, nobody listens.
    drop(UnixListener::bind(&path).unwrap());
    assert!(path.exists());
    let s = spawn_at(&path).unwrap();
    let mut c = RawClient::new_default(&path);
    assert_eq!(c.region_read(7, 0, 1), vec![0]);
    assert_eq!(mode_of(&path), 0o600);
    drop(c);
    drop(s);
}

#[test]
fn test_socket_path_not_a_socket_left_alone() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"keep me").unwrap();
    assert!(matches!(spawn_at(&file), Err(ServerError::NotASocket(_))));
    assert_eq!(std::fs::read(&file).unwrap(), b"keep me");
    // A symlink to a stale socket is not followed or removed.
    let stale = dir.path().join("stale.sock");
    drop(UnixListener::bind(&stale).unwrap());
    let link = dir.path().join("link.sock");
    std::os::unix::fs::symlink(&stale, &link).unwrap();
    assert!(matches!(spawn_at(&link), Err(ServerError::NotASocket(_))));
    assert!(stale.exists() && link.exists());
}

#[test]
fn test_socket_client_not_reading_replies_shutdown_still_returns() {
    let _g = serial();
    let mut ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    // Ask for far more reply bytes than the socket buffers hold and never read them: the
    // connection thread ends up blocked in sendmsg.
    let a = umdev::protocol::region_access::RegionAccess {
        offset: 0,
        region: 2,
        count: 0x10000,
    };
    for _ in 0..64 {
        c.send(Command::RegionRead as u16, 0, &a.encode(), &[]);
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    let server = ts.take_running().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(server.shutdown());
    });
    let r = rx.recv_timeout(std::time::Duration::from_secs(5));
    assert!(
        r.is_ok(),
        "shutdown hangs while a client does not read its replies"
    );
    drop(c);
}

#[test]
fn test_socket_connection_storm_refusals_bounded_first_session_intact() {
    let _g = serial();
    let ts = TestServer::start();
    let mut first = RawClient::new_default(ts.path());
    let fds = open_fds();
    let threads = thread_count();
    // 12 clients connect at once and say nothing: at most 4 refusal threads run (each
    // refused connection costs the accept loop up to 100 ms, so the storm stays small).
    let storm: Vec<UnixStream> = (0..12)
        .map(|_| UnixStream::connect(ts.path()).unwrap())
        .collect();
    let mut peak = 0;
    for _ in 0..40 {
        peak = peak.max(thread_count());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(
        peak <= threads + 4,
        "{peak} threads during the storm (from {threads})"
    );
    assert_eq!(first.region_read(7, 0, 4), vec![0, 1, 2, 3]);
    for s in &storm {
        assert!(closed_by_peer(s), "a storm connection stayed open");
    }
    drop(storm);
    settle_fds(fds, "after the storm");
    assert_eq!(first.region_read(7, 4, 4), vec![4, 5, 6, 7]);
    assert_eq!(ts.state().disconnects, 0);
}

#[test]
fn test_socket_umdev_run_socket_mode_option_applied() {
    let _g = serial();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("gpu.sock");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_umdev"))
        .args(["run", "gpu", "--socket-mode", "640", "--socket"])
        .arg(&sock)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    // The file exists a moment before its mode is set (bind, then chmod): poll for both.
    let mut mode = None;
    while mode != Some(0o640) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
        mode = sock.exists().then(|| mode_of(&sock));
    }
    // SAFETY: sending SIGINT to our own child process.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let status = child.wait_with_output().unwrap().status;
    assert_eq!(
        mode,
        Some(0o640),
        "socket mode of umdev run --socket-mode 640"
    );
    assert!(status.success(), "umdev run exited with {status:?}");
}

#[test]
fn test_socket_silent_client_dropped_after_negotiation_timeout_negotiated_may_idle() {
    let _g = serial();
    let ts =
        TestServer::start_with(|c| c.negotiation_timeout = std::time::Duration::from_millis(200));
    // Connects and never says VERSION: disconnected, the slot is free again.
    let t0 = std::time::Instant::now();
    let silent = UnixStream::connect(ts.path()).unwrap();
    assert!(closed_by_peer(&silent), "silent client kept");
    let waited = t0.elapsed();
    assert!(
        waited < std::time::Duration::from_secs(2),
        "closed only after {waited:?}"
    );
    ts.wait_for("silent client torn down", |s| s.disconnects == 1);
    // Half a header, then nothing: same.
    let mut half = RawClient::connect(ts.path());
    half.send_raw(&raw_header(1, Command::Version as u16, 40, 0)[..8], &[]);
    assert!(closed_by_peer(half.stream()), "half-header client kept");
    ts.wait_for("half-header client torn down", |s| s.disconnects == 2);
    // A negotiated client may stay idle for longer than the timeout.
    let mut c = RawClient::new_default(ts.path());
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(c.region_read(7, 0, 2), vec![0, 1]);
    assert_eq!(ts.state().disconnects, 2);
}

#[test]
fn test_socket_bound_privately_no_leftovers_long_path_falls_back() {
    let _g = serial();
    umdev::testing::init_logs();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dev.sock");
    let s = spawn_at(&path).unwrap();
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        vec!["dev.sock".to_string()],
        "leftovers of the private bind"
    );
    assert_eq!(mode_of(&path), 0o600);
    let mut c = RawClient::new_default(&path);
    assert_eq!(c.region_read(7, 0, 1), vec![0]);
    drop(c);
    drop(s);
    // A directory so deep that the private bind path would not fit in sun_path (108
    // bytes) while the socket path itself does: plain bind + chmod.
    let room = 100 - dir.path().as_os_str().len();
    let deep = dir.path().join("d".repeat(room - 1));
    std::fs::create_dir(&deep).unwrap();
    let long = deep.join("s");
    assert!(long.as_os_str().len() < 108);
    let s = spawn_at(&long).unwrap();
    assert_eq!(mode_of(&long), 0o600);
    let mut c = RawClient::new_default(&long);
    assert_eq!(c.region_read(7, 0, 1), vec![0]);
    drop(c);
    drop(s);
    assert_eq!(std::fs::read_dir(&deep).unwrap().count(), 0, "leftovers");
    std::fs::remove_dir(&deep).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}
