//! The client side of the control socket: send one request to a daemon and read its
//! answer ([`call`], [`call_with_payload`]), and move an instance between two daemons
//! ([`migrate`]). `umdev`'s client commands (`umdev types`,
//! `list`, `create`, ..., `migrate`) are these calls with a command line and a table around
//! them; a program of its own talks to any daemon built on [`crate::daemon`] the same way.
//!
//! ```no_run
//! use umdev::daemon::client;
//! use umdev::daemon::protocol::{Reply, Request};
//!
//! let control = umdev::daemon::paths::default_control();
//! if let Reply::Types(types) = client::call(&control, &Request::Types)? {
//!     for t in &types.types {
//!         println!("{}/{}: {} more", t.parent, t.type_name, t.available_instances);
//!     }
//! }
//! # Ok::<(), client::ClientError>(())
//! ```

pub mod migrate;

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use super::paths;
use super::protocol::{self, ControlError, Reply, Request, RequestEnvelope, Response};

/// Why a request to a daemon failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No daemon listens on the control socket.
    #[error(
        "no umdev daemon is listening on {} ({why})\nhint: start one with `umdev daemon` \
         (it serves until Ctrl-C or SIGTERM), or point --control or {env} at the control socket \
         of a daemon started with --socket-dir or --control",
        path.display(),
        env = paths::CONTROL_ENV
    )]
    NoDaemon {
        /// The control socket.
        path: PathBuf,
        /// Why connecting failed (in the message: the hint comes last).
        why: std::io::Error,
    },
    /// Talking to the daemon failed.
    #[error("talking to the daemon on {}: {what}", path.display())]
    Io {
        /// The control socket.
        path: PathBuf,
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The daemon's answer could not be understood.
    #[error("the daemon on {} answered something this umdev cannot read: {why}", path.display())]
    Protocol {
        /// The control socket.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
    /// The daemon refused the request.
    #[error("{}{}", .0.message, .0.hint.as_ref().map(|h| format!("\nhint: {h}")).unwrap_or_default())]
    Daemon(ControlError),
}

/// Send `request` to the daemon on `path` and wait for its answer.
pub fn call(path: &std::path::Path, request: &Request) -> Result<Reply, ClientError> {
    call_with_payload(path, request, &[]).map(|(reply, _)| reply)
}

/// How long a call waits for the daemon without a byte moving (sending, or waiting for and
/// reading the answer) before it gives up: longer than anything a daemon legitimately
/// takes (a removal waits up to its 10 s release timeout; the largest migration state
/// moves within [`protocol::transfer_time`]), so only a stuck daemon reaches it.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(300);

/// Send `request` and the `payload` it announces ([`Request::payload_len`]) to the daemon
/// on `path`; returns its answer and the payload the reply announces. Gives up after
/// [`ANSWER_TIMEOUT`] without progress.
pub fn call_with_payload(
    path: &std::path::Path,
    request: &Request,
    payload: &[u8],
) -> Result<(Reply, Vec<u8>), ClientError> {
    call_within(path, request, payload, ANSWER_TIMEOUT)
}

/// [`call_with_payload`], giving up after `timeout` without progress (an error of kind
/// `TimedOut`/`WouldBlock` in [`ClientError::Io`]).
pub fn call_within(
    path: &std::path::Path,
    request: &Request,
    payload: &[u8],
    timeout: Duration,
) -> Result<(Reply, Vec<u8>), ClientError> {
    let io = |what: &str| {
        let what = what.to_owned();
        move |source: std::io::Error| {
            let what = match source.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => format!(
                    "{what}: nothing for {} s (the daemon may be stuck; its log says what \
                     it is doing)",
                    timeout.as_secs_f64()
                ),
                _ => what,
            };
            ClientError::Io {
                path: path.to_path_buf(),
                what,
                source,
            }
        }
    };
    let mut stream = UnixStream::connect(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::PermissionDenied => ClientError::Io {
            path: path.to_path_buf(),
            what: "connecting (the control socket serves only the daemon's user)".into(),
            source,
        },
        _ => ClientError::NoDaemon {
            path: path.to_path_buf(),
            why: source,
        },
    })?;
    stream
        .set_read_timeout(Some(timeout))
        .and_then(|()| stream.set_write_timeout(Some(timeout)))
        .map_err(io("setting the socket's timeouts"))?;
    let envelope = RequestEnvelope {
        version: protocol::PROTOCOL_VERSION,
        request,
    };
    stream
        .write_all(&protocol::encode(&envelope))
        .and_then(|()| stream.write_all(payload))
        .map_err(io("sending the request"))?;
    let mut reader = std::io::BufReader::new(&stream);
    let message = protocol::read_message(&mut reader).map_err(|e| match e {
        protocol::FrameError::Io(source) => io("reading the answer")(source),
        other => ClientError::Protocol {
            path: path.to_path_buf(),
            why: other.to_string(),
        },
    })?;
    let protocol_err = |why: String| ClientError::Protocol {
        path: path.to_path_buf(),
        why,
    };
    let value: serde_json::Value =
        serde_json::from_slice(&message).map_err(|e| protocol_err(e.to_string()))?;
    match value.get("version").and_then(serde_json::Value::as_u64) {
        Some(v) if v == u64::from(protocol::PROTOCOL_VERSION) => {}
        Some(v) => {
            return Err(ClientError::Daemon(
                ControlError::new(
                    protocol::ErrorKind::VersionMismatch,
                    format!(
                        "the daemon speaks control protocol version {v}, this umdev version {}",
                        protocol::PROTOCOL_VERSION
                    ),
                )
                .hint("use the umdev binary the daemon runs, or restart the daemon with this one"),
            ))
        }
        None => return Err(protocol_err("no protocol version in the answer".into())),
    }
    let response: Response =
        serde_json::from_value(value).map_err(|e| protocol_err(e.to_string()))?;
    match (response.ok, response.error) {
        (Some(reply), None) => {
            let payload =
                protocol::read_payload(&mut reader, reply.payload_len()).map_err(|e| match e {
                    protocol::FrameError::Io(source) | protocol::FrameError::PayloadIo(source) => {
                        io("reading the answer's payload")(source)
                    }
                    other => protocol_err(other.to_string()),
                })?;
            Ok((reply, payload))
        }
        (None, Some(error)) => Err(ClientError::Daemon(error)),
        _ => Err(protocol_err("neither a reply nor an error".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;
    use std::time::Instant;

    #[test]
    fn test_call_gives_up_on_a_daemon_that_never_answers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("control.sock");
        let listener = UnixListener::bind(&path).unwrap();
        // A "daemon" that accepts, reads nothing and never answers, holding the connection.
        let held = std::thread::spawn(move || listener.accept().map(|(s, _)| s));
        let start = Instant::now();
        let e = call_within(&path, &Request::Types, &[], Duration::from_millis(200))
            .expect_err("no answer must be an error");
        let took = start.elapsed();
        let _conn = held.join().unwrap().unwrap();
        match &e {
            ClientError::Io { what, source, .. } => {
                assert!(what.contains("nothing for 0.2 s"), "{e}");
                assert!(
                    matches!(
                        source.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ),
                    "{source:?}"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(took < Duration::from_secs(5), "took {took:?}");
    }
}
