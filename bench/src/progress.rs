//! Progress on stderr while a bench runs: a redrawn bar when stderr is a terminal, plain
//! lines otherwise (logs, CI), nothing with `--quiet`.

use std::io::{IsTerminal, Write};
use std::time::Instant;

/// How progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// A bar redrawn in place.
    Bar,
    /// One line per step.
    Lines,
    /// Nothing.
    Quiet,
}

impl ProgressMode {
    /// Bar on a terminal, lines otherwise; quiet if asked.
    pub fn detect(quiet: bool) -> ProgressMode {
        if quiet {
            ProgressMode::Quiet
        } else if std::io::stderr().is_terminal() {
            ProgressMode::Bar
        } else {
            ProgressMode::Lines
        }
    }
}

/// Progress over a known number of steps.
pub struct Progress {
    mode: ProgressMode,
    total: usize,
    done: usize,
    start: Instant,
}

const BAR_WIDTH: usize = 30;

/// The text of a bar at `done` of `total`, e.g. `[=====>     ]  5/10`.
pub fn bar_text(done: usize, total: usize) -> String {
    let total = total.max(1);
    let filled = (done.min(total) * BAR_WIDTH) / total;
    let mut s = String::with_capacity(BAR_WIDTH + 16);
    s.push('[');
    for i in 0..BAR_WIDTH {
        s.push(if i < filled {
            '='
        } else if i == filled {
            '>'
        } else {
            ' '
        });
    }
    s.push(']');
    s.push_str(&format!(" {done:>4}/{total}"));
    s
}

impl Progress {
    /// Progress over `total` steps.
    pub fn new(mode: ProgressMode, total: usize) -> Progress {
        Progress {
            mode,
            total,
            done: 0,
            start: Instant::now(),
        }
    }

    /// A step named `label` is starting.
    pub fn start_step(&mut self, label: &str) {
        let elapsed = self.start.elapsed().as_secs_f64();
        let eta = if self.done > 0 {
            format!(
                " eta {:.0}s",
                elapsed / self.done as f64 * (self.total - self.done.min(self.total)) as f64
            )
        } else {
            String::new()
        };
        let mut err = std::io::stderr().lock();
        match self.mode {
            ProgressMode::Bar => {
                let _ = write!(
                    err,
                    "\r\x1b[2K{} {elapsed:.0}s{eta}  {label}",
                    bar_text(self.done, self.total)
                );
                let _ = err.flush();
            }
            ProgressMode::Lines => {
                let _ = writeln!(err, "[{}/{}] {label}", self.done + 1, self.total);
            }
            ProgressMode::Quiet => {}
        }
    }

    /// The current step finished.
    pub fn finish_step(&mut self) {
        self.done += 1;
    }

    /// A message that must not be lost in the bar (e.g. a skipped backing).
    pub fn note(&mut self, msg: &str) {
        if self.mode == ProgressMode::Quiet {
            return;
        }
        let mut err = std::io::stderr().lock();
        if self.mode == ProgressMode::Bar {
            let _ = write!(err, "\r\x1b[2K");
        }
        let _ = writeln!(err, "{msg}");
    }

    /// All steps done: clear the bar.
    pub fn finish(&mut self) {
        if self.mode == ProgressMode::Bar {
            let mut err = std::io::stderr().lock();
            let _ = writeln!(
                err,
                "\r\x1b[2K{} {:.1}s",
                bar_text(self.done, self.total),
                self.start.elapsed().as_secs_f64()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_bar_text_half_done_is_half_filled() {
        let s = bar_text(5, 10);
        assert_eq!(s.matches('=').count(), BAR_WIDTH / 2);
        assert!(s.ends_with("5/10"));
    }

    #[test]
    fn test_bar_text_zero_total_does_not_divide_by_zero() {
        let s = bar_text(0, 0);
        assert!(s.starts_with("[>"));
    }

    #[test]
    fn test_progress_mode_quiet_wins() {
        assert_eq!(ProgressMode::detect(true), ProgressMode::Quiet);
    }
}
