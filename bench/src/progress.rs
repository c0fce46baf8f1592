//! Progress on stderr while a bench runs: an [`indicatif`] bar when stderr is a terminal,
//! plain lines otherwise (logs, CI), nothing with `--quiet`. Stdout holds only the report.
//!
//! The bar is drawn when a step starts and when the run ends, never in between: no ticker
//! thread redraws it while a sample is being timed (on a loaded 2-core machine that thread
//! would be measured too), so its clock and eta move from step to step.

use std::io::{IsTerminal, Write};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
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

/// The bar's look: `[=====>     ]    5/10 12s eta 30s  label`.
const BAR_TEMPLATE: &str = "[{bar:30}] {pos:>4}/{len} {elapsed} eta {eta}  {msg}";
/// The bar left on the terminal at the end: `[==========]   10/10 42s`.
const DONE_TEMPLATE: &str = "[{bar:30}] {pos:>4}/{len} {elapsed}";

fn bar_style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        // The templates are constants; a typo shows in the tests, not to a user.
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// Progress over a known number of steps.
pub struct Progress {
    mode: ProgressMode,
    total: usize,
    done: usize,
    /// The bar, in [`ProgressMode::Bar`] only.
    bar: Option<ProgressBar>,
}

impl Progress {
    /// Progress over `total` steps.
    pub fn new(mode: ProgressMode, total: usize) -> Progress {
        if mode == ProgressMode::Bar {
            return Progress::bar_on(ProgressDrawTarget::stderr(), total);
        }
        Progress {
            mode,
            total,
            done: 0,
            bar: None,
        }
    }

    /// Progress of a bench run over `total` steps: shown as [`ProgressMode::detect`] says,
    /// starting with a warning when this is a debug build (its numbers mean little).
    pub fn for_run(quiet: bool, total: usize) -> Progress {
        let mut progress = Progress::new(ProgressMode::detect(quiet), total);
        if crate::machine::is_debug_build() {
            progress
                .note("umdev bench: this is a debug build; build with --release for real numbers");
        }
        progress
    }

    /// A bar over `total` steps drawn to `target`.
    fn bar_on(target: ProgressDrawTarget, total: usize) -> Progress {
        let bar = ProgressBar::with_draw_target(Some(total as u64), target);
        bar.set_style(bar_style(BAR_TEMPLATE));
        Progress {
            mode: ProgressMode::Bar,
            total,
            done: 0,
            bar: Some(bar),
        }
    }

    /// A step named `label` is starting.
    pub fn start_step(&mut self, label: &str) {
        match (&self.bar, self.mode) {
            (Some(bar), _) => {
                bar.set_message(label.to_string());
                // Past indicatif's rate limit too: a slow step must show its own label.
                bar.force_draw();
            }
            (None, ProgressMode::Lines) => {
                let _ = writeln!(
                    std::io::stderr().lock(),
                    "[{}/{}] {label}",
                    self.done + 1,
                    self.total
                );
            }
            (None, _) => {}
        }
    }

    /// The current step finished.
    pub fn finish_step(&mut self) {
        self.done += 1;
        if let Some(bar) = &self.bar {
            bar.inc(1);
        }
    }

    /// A message that must not be lost in the bar (e.g. a skipped backing).
    pub fn note(&mut self, msg: &str) {
        match (&self.bar, self.mode) {
            (Some(bar), _) => bar.println(msg),
            (None, ProgressMode::Lines) => eprintln!("{msg}"),
            (None, _) => {}
        }
    }

    /// All steps done: leave the full bar with the total time.
    pub fn finish(&mut self) {
        if let Some(bar) = &self.bar {
            bar.set_style(bar_style(DONE_TEMPLATE));
            bar.finish();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::TermLike;
    use std::sync::{Arc, Mutex};

    /// A terminal that keeps every line and string drawn on it.
    #[derive(Clone, Debug, Default)]
    struct Screen(Arc<Mutex<Vec<String>>>);

    impl Screen {
        fn last(&self) -> String {
            let lines = self.0.lock().unwrap();
            lines
                .iter()
                .rev()
                .find(|l| !l.trim().is_empty())
                .cloned()
                .unwrap_or_default()
        }
        fn all(&self) -> String {
            self.0.lock().unwrap().join("\n")
        }
    }

    impl TermLike for Screen {
        fn width(&self) -> u16 {
            120
        }
        fn move_cursor_up(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_down(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_right(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn move_cursor_left(&self, _: usize) -> std::io::Result<()> {
            Ok(())
        }
        fn write_line(&self, s: &str) -> std::io::Result<()> {
            self.0.lock().unwrap().push(s.to_string());
            Ok(())
        }
        fn write_str(&self, s: &str) -> std::io::Result<()> {
            self.write_line(s)
        }
        fn clear_line(&self) -> std::io::Result<()> {
            Ok(())
        }
        fn flush(&self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A bar on a screen that, like stderr, takes at most one draw a second after a
    /// burst (indicatif's rate limit).
    fn bar_on_screen(total: usize) -> (Progress, Screen) {
        let screen = Screen::default();
        let target = ProgressDrawTarget::term_like_with_hz(Box::new(screen.clone()), 1);
        (Progress::bar_on(target, total), screen)
    }

    #[test]
    fn test_bar_each_step_draws_its_label_and_count() {
        let (mut p, screen) = bar_on_screen(60);
        // Steps that start back to back, far faster than the rate limit: each shows.
        for i in 0..30 {
            p.start_step(&format!("step {i}"));
            p.finish_step();
        }
        p.start_step("4k lock contiguous 64");
        let line = screen.last();
        assert!(line.contains("4k lock contiguous 64"), "{line}");
        assert!(line.contains("  30/60"), "{line}");
        assert_eq!(line.matches('=').count(), 15, "half of 30: {line}");
        assert!(line.contains("eta"), "{line}");
    }

    #[test]
    fn test_bar_finish_leaves_the_full_bar_without_label() {
        let (mut p, screen) = bar_on_screen(3);
        for _ in 0..3 {
            p.start_step("label");
            p.finish_step();
        }
        p.finish();
        let line = screen.last();
        assert!(line.contains("3/3"), "{line}");
        assert_eq!(line.matches('=').count(), 30, "{line}");
        assert!(!line.contains("label") && !line.contains("eta"), "{line}");
    }

    #[test]
    fn test_bar_note_is_printed_on_its_own_line() {
        let (mut p, screen) = bar_on_screen(2);
        p.start_step("a");
        p.note("skipping thp: shmem THP is off");
        assert!(
            screen
                .all()
                .lines()
                .any(|l| l == "skipping thp: shmem THP is off"),
            "{}",
            screen.all()
        );
    }

    #[test]
    fn test_progress_mode_quiet_wins() {
        assert_eq!(ProgressMode::detect(true), ProgressMode::Quiet);
    }

    #[test]
    fn test_progress_quiet_and_lines_have_no_bar() {
        assert!(Progress::new(ProgressMode::Quiet, 3).bar.is_none());
        assert!(Progress::new(ProgressMode::Lines, 3).bar.is_none());
    }
}
