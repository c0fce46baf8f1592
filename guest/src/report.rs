//! What the guest tells the host: one line per check or measurement on the serial console,
//! parsed by the host harness (`vmtest/src/report.rs`). The format is the contract:
//!
//! ```text
//! UMDEV-CHECK <scenario> <name> PASS|FAIL <detail...>
//! UMDEV-MEASURE <scenario> <name> <value> <unit>
//! UMDEV-END <scenario> <checks> <failures>
//! UMDEV-IMAGE <scenario> <name> <offset> <len> <seed>
//! UMDEV-READY <scenario> <cue>
//! ```
//!
//! `UMDEV-IMAGE` tells the host what the ccw server's image must hold after the run: image
//! bytes `offset..offset + len` are `umdev_devices::ccw::driver::pattern` of `seed`; the
//! host checks the file once the server has stopped.
//!
//! `UMDEV-READY` is a cue for the host to act now while the scenario waits (the `unplug`
//! guest run removes an instance when it sees one); the scenario bounds its wait and checks
//! the outcome itself.
//!
//! Names are single words (`[a-z0-9_.-]`). A scenario that panics or hangs never prints its
//! END line; the host counts that as a failure.

use std::fmt::Display;
use std::io::Write;

/// Collects the results of one scenario and prints them as they come.
pub struct Report {
    scenario: String,
    checks: u32,
    failures: u32,
}

impl Report {
    /// Start reporting for `scenario`.
    pub fn new(scenario: &str) -> Report {
        Report {
            scenario: scenario.to_string(),
            checks: 0,
            failures: 0,
        }
    }

    fn line(&self, text: std::fmt::Arguments<'_>) {
        // The console is the kernel's ttyS0: one write per line keeps lines whole even when
        // the kernel prints in between.
        let line = format!("{text}\n");
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(line.as_bytes());
        let _ = out.flush();
    }

    /// Record a check; returns `ok` so callers can stop early.
    pub fn check(&mut self, name: &str, ok: bool, detail: impl Display) -> bool {
        self.checks += 1;
        if !ok {
            self.failures += 1;
        }
        let verdict = if ok { "PASS" } else { "FAIL" };
        self.line(format_args!(
            "UMDEV-CHECK {} {name} {verdict} {detail}",
            self.scenario
        ));
        ok
    }

    /// Record a check whose outcome is a `Result`: Ok passes with `detail`, Err fails with
    /// the error. Returns the value on success.
    pub fn ok<T, E: Display>(&mut self, name: &str, r: Result<T, E>) -> Option<T> {
        match r {
            Ok(v) => {
                self.check(name, true, "ok");
                Some(v)
            }
            Err(e) => {
                self.check(name, false, e);
                None
            }
        }
    }

    /// Record a measurement.
    pub fn measure(&mut self, name: &str, value: f64, unit: &str) {
        self.line(format_args!(
            "UMDEV-MEASURE {} {name} {value:.3} {unit}",
            self.scenario
        ));
    }

    /// Announce that the ccw image must hold the pattern of `seed` at image bytes
    /// `offset..offset + len` (checked by the host after the server stopped).
    pub fn image(&mut self, name: &str, offset: u64, len: u64, seed: u64) {
        self.line(format_args!(
            "UMDEV-IMAGE {} {name} {offset} {len} {seed}",
            self.scenario
        ));
    }

    /// Tell the host that the scenario is ready for its action `cue` (it waits for the
    /// effect itself).
    pub fn ready(&self, cue: &str) {
        self.line(format_args!("UMDEV-READY {} {cue}", self.scenario));
    }

    /// A free-form progress line (not parsed).
    pub fn note(&self, text: impl Display) {
        self.line(format_args!("umdev-guest {}: {text}", self.scenario));
    }

    /// Print the END line; true if every check passed.
    pub fn end(self) -> bool {
        self.line(format_args!(
            "UMDEV-END {} {} {}",
            self.scenario, self.checks, self.failures
        ));
        self.failures == 0
    }
}
