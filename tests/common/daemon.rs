//! A `umdev daemon` process for the CLI tests (`tests/daemon_cli.rs`,
//! `tests/daemon_migrate.rs`): state and socket directories in a temp dir, its log, and
//! `umdev ARGS` run against it through `UMDEV_CONTROL`.
#![allow(dead_code)]

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// The `umdev` binary under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_umdev");

/// A daemon process on a state and a socket directory in a temp dir.
pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub child: Option<Child>,
    pub extra: Vec<String>,
    /// Give the daemon its directories as paths relative to its working directory (`dir`).
    pub relative: bool,
    /// The daemon's RLIMIT_NOFILE, if set (before a start).
    pub nofile: Option<u64>,
    /// More environment for the daemon (before a start).
    pub env: Vec<(String, String)>,
    /// Give the daemon `JOURNAL_STREAM` naming its log file, as systemd names the journal's
    /// stream (before a start).
    pub journal: bool,
    starts: usize,
}

impl Daemon {
    /// Start a daemon with `extra` flags; returns once it answers requests.
    pub fn start(extra: &[&str]) -> Daemon {
        Daemon::start_with(extra, false)
    }

    /// [`Daemon::start`], the directories given relative to the daemon's working directory.
    pub fn start_relative(extra: &[&str]) -> Daemon {
        Daemon::start_with(extra, true)
    }

    fn start_with(extra: &[&str], relative: bool) -> Daemon {
        let mut d = Daemon::unstarted(extra);
        d.relative = relative;
        d.restart();
        d
    }

    /// A daemon not started yet: set its fields, then [`Daemon::restart`].
    pub fn unstarted(extra: &[&str]) -> Daemon {
        Daemon {
            dir: tempfile::tempdir().unwrap(),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            relative: false,
            nofile: None,
            env: Vec::new(),
            journal: false,
            starts: 0,
        }
    }

    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    pub fn sockets(&self) -> PathBuf {
        self.dir.path().join("sockets")
    }

    pub fn control(&self) -> PathBuf {
        self.sockets().join("control.sock")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("daemon-{}.log", self.starts))
    }

    /// What the current (or last) daemon process logged.
    pub fn log(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn command(&self) -> Command {
        let mut c = Command::new(BIN);
        let (state, sockets) = if self.relative {
            c.current_dir(self.dir.path());
            (PathBuf::from("state"), PathBuf::from("sockets"))
        } else {
            (self.state(), self.sockets())
        };
        c.arg("daemon")
            .arg("--state-dir")
            .arg(state)
            .arg("--socket-dir")
            .arg(sockets)
            .args(&self.extra)
            .env("RUST_LOG", "info")
            .env_remove("UMDEV_CONTROL")
            .env_remove("JOURNAL_STREAM")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(n) = self.nofile {
            use std::os::unix::process::CommandExt;
            let limit = libc::rlimit {
                rlim_cur: n,
                rlim_max: n,
            };
            // SAFETY: setrlimit is async-signal-safe and touches only the child's limits.
            unsafe {
                c.pre_exec(move || match libc::setrlimit(libc::RLIMIT_NOFILE, &limit) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                });
            }
        }
        c
    }

    /// Start the daemon (again, on the same directories).
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "a daemon is running");
        self.starts += 1;
        let log = fs::File::create(self.log_path()).unwrap();
        let mut command = self.command();
        if self.journal {
            use std::os::unix::fs::MetadataExt;
            let meta = log.metadata().unwrap();
            command.env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()));
        }
        let mut child = command.stderr(log).spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.log().contains("umdev daemon ready") {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the daemon exited ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "the daemon never got ready:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
    }

    /// Send `sig` to the running daemon.
    pub fn signal(&self, sig: i32) {
        let child = self.child.as_ref().expect("no daemon running");
        // SAFETY: signalling our own child process.
        assert_eq!(unsafe { libc::kill(child.id() as i32, sig) }, 0);
    }

    /// SIGTERM the daemon and wait for it; returns its log. It must exit successfully.
    pub fn stop(&mut self) -> String {
        self.signal(libc::SIGTERM);
        let mut child = self.child.take().expect("no daemon running");
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(Instant::now() < deadline, "the daemon did not stop");
            std::thread::sleep(Duration::from_millis(20));
        };
        let log = self.log();
        assert!(status.success(), "the daemon failed ({status}):\n{log}");
        log
    }

    /// Run `umdev ARGS` against this daemon (its control socket through UMDEV_CONTROL).
    pub fn umdev(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .env("UMDEV_CONTROL", self.control())
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// Run `umdev ARGS`; it must succeed. Returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.umdev(args);
        assert!(
            out.status.success(),
            "umdev {args:?} failed: {}\ndaemon log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            self.log()
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Run `umdev ARGS --json`; it must succeed. Returns the parsed output.
    pub fn json(&self, args: &[&str]) -> Value {
        let mut args = args.to_vec();
        args.push("--json");
        serde_json::from_str(&self.ok(&args)).unwrap()
    }

    /// Run `umdev ARGS`; it must fail with status 1. Returns stderr.
    pub fn fail(&self, args: &[&str]) -> String {
        let out = self.umdev(args);
        assert_eq!(
            out.status.code(),
            Some(1),
            "umdev {args:?} did not fail: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stderr).unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
