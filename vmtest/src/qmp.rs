//! A minimal QMP client (QEMU's JSON monitor on a unix socket): the capabilities handshake,
//! one command at a time, and the events that arrive meanwhile (`DEVICE_DELETED`), each
//! with the time it was read.

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A connected, negotiated QMP session.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    /// Events read so far, with when they were read.
    pub events: Vec<(Instant, Value)>,
}

impl Qmp {
    /// Connect to `path` (waiting up to `wait` for QEMU to create it) and negotiate.
    pub fn connect(path: &Path, wait: Duration) -> io::Result<Qmp> {
        let deadline = Instant::now() + wait;
        let stream = loop {
            match UnixStream::connect(path) {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display())))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        let mut q = Qmp {
            reader: BufReader::new(stream.try_clone()?),
            writer: stream,
            events: Vec::new(),
        };
        let greeting = q.read(Duration::from_secs(10))?;
        if greeting.get("QMP").is_none() {
            return Err(io::Error::other(format!("not a QMP greeting: {greeting}")));
        }
        let reply = q.execute("qmp_capabilities", json!({}), Duration::from_secs(10))?;
        if reply.get("return").is_none() {
            return Err(io::Error::other(format!("qmp_capabilities: {reply}")));
        }
        Ok(q)
    }

    /// One JSON message, waiting at most `limit`.
    fn read(&mut self, limit: Duration) -> io::Result<Value> {
        self.reader.get_ref().set_read_timeout(Some(limit))?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "QMP closed"));
        }
        serde_json::from_str(&line)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, format!("{e}: {line}")))
    }

    /// Run `command` with `arguments`; its reply (`{"return": ...}` or `{"error": ...}`).
    /// Events that come first are kept in [`Qmp::events`].
    pub fn execute(
        &mut self,
        command: &str,
        arguments: Value,
        limit: Duration,
    ) -> io::Result<Value> {
        let msg = json!({ "execute": command, "arguments": arguments });
        self.writer.write_all(format!("{msg}\n").as_bytes())?;
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no reply to {command}"),
                ));
            }
            let v = self.read(left)?;
            if v.get("event").is_some() {
                self.events.push((Instant::now(), v));
            } else {
                return Ok(v);
            }
        }
    }

    /// Wait up to `limit` for the event `name` whose `data.device` is `device` (or one
    /// already read); when it was read.
    pub fn wait_event(&mut self, name: &str, device: &str, limit: Duration) -> io::Result<Instant> {
        let matches = |v: &Value| {
            v.get("event").and_then(Value::as_str) == Some(name)
                && v.pointer("/data/device").and_then(Value::as_str) == Some(device)
        };
        if let Some((t, _)) = self.events.iter().find(|(_, v)| matches(v)) {
            return Ok(*t);
        }
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no {name} for {device} within {limit:?}"),
                ));
            }
            let v = match self.read(left) {
                Ok(v) => v,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(e),
            };
            let now = Instant::now();
            let hit = matches(&v);
            self.events.push((now, v));
            if hit {
                return Ok(now);
            }
        }
    }
}
