//! Adaptive busy-polling of the connection thread ([`PollMode`], `--poll`).
//!
//! QEMU sends every trapped register access as a synchronous message, so the connection
//! thread spends most of its life blocked in `recvmsg` between two messages of one burst;
//! when the client runs on another CPU, waking the blocked thread (an IPI to an idle CPU,
//! a VM exit on a virtual machine) costs far more than handling the message. Polling
//! removes that wake-up: after a message, the connection thread tries non-blocking reads
//! for a bounded time before it blocks.
//!
//! # The algorithm (per connection)
//!
//! The *gap* is the time from the moment the connection thread is ready for the next
//! message (the previous reply sent) until that message's header is read. The *budget* is
//! how long the thread spins before it blocks; it starts at zero.
//!
//! - **Spin**: while the budget lasts, `recvmsg(MSG_DONTWAIT)` (the read itself: a hit
//!   costs no extra syscall) then `sched_yield()`, so a client that shares this CPU gets
//!   it at once instead of at the next scheduler tick.
//! - **Caught while spinning**: the budget stays.
//! - **Blocked, gap ≤ cap**: spinning a little longer would have caught it: the budget
//!   becomes `min(cap, max(2 × budget, gap + gap/4))` — one step learns the gap.
//! - **Blocked, gap > cap**: the client was idle (or slower than polling can help): the
//!   budget drops to zero. An idle client therefore costs at most one budget of spinning
//!   after its last message, then nothing: the thread blocks until the next message.
//!
//! `Fixed(d)` spins `d` after every message without adapting; `Off` never spins. On a
//! machine with one online CPU nothing spins (the client needs that CPU to send the message
//! the thread would spin for). A client that shares the server's CPU on a larger machine
//! gets it at every `sched_yield()`; `umdev bench wire` measures both placements.
//!
//! The state lives in the read side of the channel and changes only under its lock (the
//! connection thread is its only user while it waits for a command).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Cap of the adaptive budget ([`PollMode::Auto`]).
pub const AUTO_POLL_CAP: Duration = Duration::from_micros(50);

/// Longest budget `<N>us` accepts: a spinning thread holds a CPU for that long per message.
pub const MAX_FIXED_POLL: Duration = Duration::from_millis(10);

/// How the connection thread waits for the next message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PollMode {
    /// Block at once (no spinning).
    Off,
    /// Spin for a budget that adapts to the observed gaps between messages, at most
    /// [`AUTO_POLL_CAP`] (module doc).
    #[default]
    Auto,
    /// Spin this long after every message, then block.
    Fixed(Duration),
}

impl fmt::Display for PollMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PollMode::Off => f.write_str("off"),
            PollMode::Auto => f.write_str("auto"),
            PollMode::Fixed(d) => write!(f, "{}us", d.as_micros()),
        }
    }
}

/// A `--poll` value that is not `off`, `auto` or `<N>us`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("poll mode {0:?}: expected off, auto or <N>us (0 < N ≤ 10000)")]
pub struct PollModeError(String);

impl FromStr for PollMode {
    type Err = PollModeError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "off" => return Ok(PollMode::Off),
            "auto" => return Ok(PollMode::Auto),
            _ => {}
        }
        let us = s
            .strip_suffix("us")
            .and_then(|n| n.parse::<u64>().ok())
            .ok_or_else(|| PollModeError(s.into()))?;
        let d = Duration::from_micros(us);
        if us == 0 {
            return Ok(PollMode::Off);
        }
        if d > MAX_FIXED_POLL {
            return Err(PollModeError(s.into()));
        }
        Ok(PollMode::Fixed(d))
    }
}

/// One connection's polling state (module doc).
#[derive(Debug, Clone)]
pub(super) struct Poller {
    mode: PollMode,
    budget: Duration,
}

impl Poller {
    /// A poller for `mode`; it never spins on a machine with one online CPU.
    pub(super) fn new(mode: PollMode) -> Poller {
        let mode = if mode != PollMode::Off && online_cpus() <= 1 {
            PollMode::Off
        } else {
            mode
        };
        Poller {
            mode,
            budget: match mode {
                PollMode::Fixed(d) => d,
                _ => Duration::ZERO,
            },
        }
    }

    /// How long to spin before blocking for the next message.
    pub(super) fn budget(&self) -> Duration {
        self.budget
    }

    /// True if the budget follows the gaps (`auto`): [`Poller::observe`] needs them.
    pub(super) fn adapts(&self) -> bool {
        self.mode == PollMode::Auto
    }

    /// The next message came after `gap`; `caught` if spinning read it.
    pub(super) fn observe(&mut self, caught: bool, gap: Duration) {
        if self.mode != PollMode::Auto || caught {
            return;
        }
        self.budget = if gap > AUTO_POLL_CAP {
            Duration::ZERO
        } else {
            (self.budget * 2).max(gap + gap / 4).min(AUTO_POLL_CAP)
        };
    }
}

/// Online CPUs (1 if that cannot be read: never spin then).
fn online_cpus() -> usize {
    // SAFETY: sysconf only reads a system value.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn test_poll_mode_parse_accepts_off_auto_micros_rejects_others() {
        assert_eq!("off".parse::<PollMode>(), Ok(PollMode::Off));
        assert_eq!("auto".parse::<PollMode>(), Ok(PollMode::Auto));
        assert_eq!("20us".parse::<PollMode>(), Ok(PollMode::Fixed(us(20))));
        assert_eq!("0us".parse::<PollMode>(), Ok(PollMode::Off));
        for bad in ["", "20", "20ms", "-1us", "us", "20000us", "on"] {
            assert!(bad.parse::<PollMode>().is_err(), "{bad:?}");
        }
        assert_eq!(PollMode::Fixed(us(20)).to_string(), "20us");
    }

    /// A poller in `mode`, whatever this test thread's affinity.
    fn poller(mode: PollMode) -> Poller {
        Poller {
            mode,
            budget: match mode {
                PollMode::Fixed(d) => d,
                _ => Duration::ZERO,
            },
        }
    }

    #[test]
    fn test_auto_short_gap_grows_budget_to_cover_it() {
        let mut p = poller(PollMode::Auto);
        assert_eq!(p.budget(), Duration::ZERO, "no spinning before any gap");
        p.observe(false, us(8));
        assert_eq!(p.budget(), us(10));
        p.observe(true, us(9));
        assert_eq!(p.budget(), us(10), "a hit keeps the budget");
        p.observe(false, us(12));
        assert_eq!(p.budget(), us(20), "a miss at least doubles it");
        p.observe(false, us(45));
        assert_eq!(p.budget(), AUTO_POLL_CAP, "capped");
    }

    #[test]
    fn test_auto_idle_gap_zeroes_budget() {
        let mut p = poller(PollMode::Auto);
        p.observe(false, us(20));
        assert!(p.budget() > Duration::ZERO);
        p.observe(false, Duration::from_millis(5));
        assert_eq!(p.budget(), Duration::ZERO, "an idle client is not spun for");
    }

    #[test]
    fn test_fixed_and_off_never_adapt() {
        let mut p = poller(PollMode::Fixed(us(30)));
        p.observe(false, Duration::from_secs(1));
        assert_eq!(p.budget(), us(30));
        let mut p = poller(PollMode::Off);
        p.observe(false, us(5));
        assert_eq!(p.budget(), Duration::ZERO);
    }
}
