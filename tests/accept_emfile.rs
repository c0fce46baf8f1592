//! The accept loop with a full fd table: a pending connection the server cannot accept
//! (EMFILE) must not make it spin (one core, a log line per attempt); once fds are free
//! again the client is served. Alone in its file: it lowers RLIMIT_NOFILE for the process.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use umdev::protocol::{encode_message, Command, Header, MessageType};
use umdev::server::channel::{read_one, ReadResult};
use umdev::server::socket_io::send_message;
use umdev::testing::{RawClient, TestServer, TrivialDevice, DEFAULT_CAPS};

/// CPU time (user + system) of the whole process so far.
fn cpu_time() -> Duration {
    // SAFETY: getrusage writes into the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) }, 0);
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

#[test]
fn test_accept_loop_emfile_backs_off_no_spin_then_serves_client() {
    let served = TestServer::start(TrivialDevice::default()).unwrap();
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into `lim`.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    let saved = lim;
    lim.rlim_cur = 256.min(saved.rlim_cur);
    // SAFETY: lowers our own soft limit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    // Fill the fd table, keep one slot for the client's socket.
    let null = std::fs::File::open("/dev/null").unwrap();
    let mut hog: Vec<OwnedFd> = Vec::new();
    while let Ok(fd) = null.try_clone() {
        hog.push(fd.into());
    }
    hog.pop();
    let stream = std::os::unix::net::UnixStream::connect(served.path()).unwrap();
    // The server now fails to accept it with EMFILE, again and again.
    let cpu0 = cpu_time();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    let busy = cpu_time() - cpu0;
    let wall = t0.elapsed();
    drop(hog);
    // SAFETY: restores our own soft limit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &saved) }, 0);
    assert!(
        busy < wall / 5,
        "the accept loop spun: {busy:?} CPU in {wall:?} while accept failed with EMFILE"
    );
    // Fds free again: the pending client is accepted within the longest backoff.
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut payload = vec![0u8; 4];
    payload.extend_from_slice(DEFAULT_CAPS.as_bytes());
    payload.push(0);
    let h = Header::command(1, Command::Version, payload.len());
    send_message(&stream, &encode_message(&h, &payload), &[]).unwrap();
    match read_one(&stream, 1 << 20) {
        ReadResult::Message(m, MessageType::Reply) => {
            assert!(!m.header.is_error(), "VERSION refused: {}", m.header.error)
        }
        other => panic!("no VERSION reply after the fd table drained: {other:?}"),
    }
    // And the server goes on accepting.
    drop(stream);
    drop(RawClient::new_default(served.path()));
}
