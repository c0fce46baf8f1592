//! `umdev daemon` as a user runs it for many VMs (README, "Many VMs: one daemon"): one
//! process with its state directory, socket directory and control socket in a guest run's
//! directory, its log in a file, stopped with SIGTERM; and the client commands
//! (`umdev create/remove/list --json`) run against it with a bound on their time.

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use crate::server::terminate;

/// The control socket's environment variable (the client commands' `--control`).
const CONTROL_ENV: &str = "UMDEV_CONTROL";

/// A running `umdev daemon`.
pub struct Daemon {
    umdev: PathBuf,
    control: PathBuf,
    socket_dir: PathBuf,
    state_dir: PathBuf,
    log: PathBuf,
    child: Child,
}

/// One client command and what it did.
#[derive(Clone, Debug)]
pub struct Cli {
    /// The arguments after `umdev`.
    pub args: String,
    /// Exit code (None: killed at the time bound, or by a signal).
    pub code: Option<i32>,
    /// Its stdout (with `--json`: the reply, or `{"error": ...}`).
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
    /// Wall time.
    pub elapsed: Duration,
}

impl Cli {
    /// stdout as JSON (None if it is not).
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.stdout).ok()
    }

    /// One line for notes.
    pub fn summary(&self) -> String {
        let out: String = self.stdout.split_whitespace().collect::<Vec<_>>().join(" ");
        let err = self.stderr.trim().replace('\n', " | ");
        format!(
            "umdev {} -> exit {:?} in {:.2} s; stdout {out}{}",
            self.args,
            self.code,
            self.elapsed.as_secs_f64(),
            if err.is_empty() {
                String::new()
            } else {
                format!("; stderr {err}")
            }
        )
    }
}

/// How the daemon ended.
pub struct Stopped {
    /// Still running when the guest was done.
    pub alive_after_guest: bool,
    /// Exit status after SIGTERM (None: had to be killed).
    pub exit: Option<ExitStatus>,
    /// The whole log.
    pub log: String,
}

impl Daemon {
    /// Start `umdev daemon` with everything under `dir` (`state/`, `sock/`, `control.sock`,
    /// `daemon.log`), `--release-timeout` `release`, `RUST_LOG=rust_log`; wait for its
    /// control socket.
    pub fn start(
        umdev: &Path,
        dir: &Path,
        release: Duration,
        rust_log: &str,
    ) -> io::Result<Daemon> {
        let control = dir.join("control.sock");
        let socket_dir = dir.join("sock");
        let state_dir = dir.join("state");
        let log = dir.join("daemon.log");
        let out = File::create(&log)?;
        let mut child = Command::new(umdev)
            .arg("daemon")
            .arg("--state-dir")
            .arg(&state_dir)
            .arg("--socket-dir")
            .arg(&socket_dir)
            .arg("--control")
            .arg(&control)
            .arg("--release-timeout")
            .arg(format!("{}", release.as_secs_f64()))
            .env("RUST_LOG", rust_log)
            .env_remove(CONTROL_ENV)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("starting {}: {e}", umdev.display())))?;
        let deadline = Instant::now() + Duration::from_secs(20);
        while !control.exists() {
            if let Some(st) = child.try_wait()? {
                return Err(io::Error::other(format!(
                    "umdev daemon exited ({st}) before creating its control socket; log:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(io::Error::other(
                    "umdev daemon: no control socket after 20 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(Daemon {
            umdev: umdev.to_path_buf(),
            control,
            socket_dir,
            state_dir,
            log,
            child,
        })
    }

    /// The log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait up to `limit` for a log line that mentions `uuid` and one of `what`; the line.
    pub fn wait_log(&self, uuid: &str, what: &[&str], limit: Duration) -> Option<String> {
        let deadline = Instant::now() + limit;
        loop {
            let log = self.log_text();
            let hit = log
                .lines()
                .find(|l| l.contains(uuid) && what.iter().any(|w| l.contains(w)));
            if let Some(l) = hit {
                return Some(l.to_string());
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The vfio-user socket of instance `uuid`.
    pub fn socket(&self, uuid: &str) -> PathBuf {
        self.socket_dir.join(format!("{uuid}.sock"))
    }

    /// The image of ccw instance `uuid` (the ccw parent's image directory).
    pub fn ccw_image(&self, uuid: &str) -> PathBuf {
        self.state_dir
            .join("ccw-images")
            .join(format!("{uuid}.img"))
    }

    /// Run `umdev <args> --json` against this daemon; killed after `limit`.
    pub fn cli(&self, args: &[&str], limit: Duration) -> Cli {
        let start = Instant::now();
        let shown = args.join(" ");
        let fail = |e: io::Error| Cli {
            args: shown.clone(),
            code: None,
            stdout: String::new(),
            stderr: e.to_string(),
            elapsed: start.elapsed(),
        };
        let spawned = Command::new(&self.umdev)
            .args(args)
            .arg("--json")
            .env(CONTROL_ENV, &self.control)
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => return fail(e),
        };
        let drain = |r: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut s = String::new();
                if let Some(mut r) = r {
                    let _ = r.read_to_string(&mut s);
                }
                s
            })
        };
        let out = drain(
            child
                .stdout
                .take()
                .map(|o| Box::new(o) as Box<dyn Read + Send>),
        );
        let err = drain(
            child
                .stderr
                .take()
                .map(|e| Box::new(e) as Box<dyn Read + Send>),
        );
        let mut code = None;
        let mut timed_out = false;
        loop {
            match child.try_wait() {
                Ok(Some(st)) => {
                    code = st.code();
                    break;
                }
                Ok(None) if start.elapsed() > limit => {
                    timed_out = true;
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(e) => return fail(e),
            }
        }
        let mut stderr = err.join().unwrap_or_default();
        if timed_out {
            stderr.push_str(&format!("\n(killed after {limit:?})"));
        }
        Cli {
            args: shown,
            code,
            stdout: out.join().unwrap_or_default(),
            stderr,
            elapsed: start.elapsed(),
        }
    }

    /// SIGTERM it and wait (up to 30 s: it stops every instance first, then SIGKILL).
    pub fn stop(mut self) -> Stopped {
        let (alive_after_guest, exit) = terminate(&mut self.child, Duration::from_secs(30));
        Stopped {
            alive_after_guest,
            exit,
            log: std::fs::read_to_string(&self.log).unwrap_or_default(),
        }
    }
}
