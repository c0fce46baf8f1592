//! Serving until SIGINT/SIGTERM, so that stopping a server is clean: the client is
//! disconnected, its maps released, the socket removed, and the final DMA counters logged.
//!
//! ```no_run
//! use umdev::dma::{DmaConfig, DmaSpace};
//! use umdev::server::{Server, ServerConfig, TerminationSignals};
//! use umdev::testing::TrivialDevice;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // First, before any thread starts (the server's included).
//! let signals = TerminationSignals::block();
//! let dma = DmaSpace::new(DmaConfig::default());
//! let device = TrivialDevice::default();
//! let server = Server::new(ServerConfig::new("/tmp/dev.sock"), Box::new(device), dma.clone())
//!     .spawn()?;
//! signals.serve_until_signal(server, &dma)?; // returns after Ctrl-C or SIGTERM
//! # Ok(())
//! # }
//! ```
//!
//! How it works: [`TerminationSignals::block`] blocks SIGINT and SIGTERM in the calling
//! thread with `pthread_sigmask`; threads spawned afterwards inherit the mask, so no thread
//! takes those signals asynchronously and [`TerminationSignals::wait`] receives them with
//! `sigwait`. A thread spawned *before* `block` still has them unblocked and the kernel may
//! deliver the signal there (the default action: the process ends without a clean stop), so
//! call it first in `main`.
//!
//! A service that reloads its configuration on SIGHUP (the `ExecReload=kill -HUP` of a
//! systemd unit) blocks it too with [`TerminationSignals::block_with_hangup`]; its
//! [`TerminationSignals::wait`] then returns `SIGHUP` as well, and the caller reloads and
//! waits again. Without it SIGHUP keeps its default action.

use crate::dma::DmaSpace;

use super::{RunningServer, ServerError};

/// SIGINT and SIGTERM (and SIGHUP, with [`TerminationSignals::block_with_hangup`]),
/// blocked in the calling thread and every thread it spawns afterwards.
pub struct TerminationSignals {
    set: libc::sigset_t,
    hangup: bool,
}

impl std::fmt::Debug for TerminationSignals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.hangup {
            false => f.write_str("TerminationSignals(SIGINT, SIGTERM)"),
            true => f.write_str("TerminationSignals(SIGINT, SIGTERM, SIGHUP)"),
        }
    }
}

impl TerminationSignals {
    /// Block SIGINT/SIGTERM. Call it before spawning any thread (the server's included), so
    /// that no thread takes them asynchronously and [`TerminationSignals::wait`] gets them.
    pub fn block() -> TerminationSignals {
        TerminationSignals::block_signals(false)
    }

    /// [`TerminationSignals::block`], and SIGHUP too: [`TerminationSignals::wait`] returns
    /// `libc::SIGHUP` when it arrives, for the caller to reload and wait again.
    pub fn block_with_hangup() -> TerminationSignals {
        TerminationSignals::block_signals(true)
    }

    fn block_signals(hangup: bool) -> TerminationSignals {
        // SAFETY: sigset_t is plain data (an array of words) for which all zeroes is a
        // valid value; sigemptyset initialises it below anyway.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid, exclusively borrowed sigset_t; SIGINT and SIGTERM are
        // valid signal numbers, so these calls cannot fail; pthread_sigmask with SIG_BLOCK
        // and a valid set only changes this thread's mask (a null old-set is allowed).
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            if hangup {
                libc::sigaddset(&mut set, libc::SIGHUP);
            }
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        TerminationSignals { set, hangup }
    }

    /// Wait for SIGINT or SIGTERM (or SIGHUP, if blocked); returns the signal number.
    pub fn wait(&self) -> i32 {
        loop {
            let mut sig = 0;
            // SAFETY: `self.set` is an initialised set of valid signals; sigwait only reads
            // it and writes the received signal into `sig`, a live local.
            let rc = unsafe { libc::sigwait(&self.set, &mut sig) };
            if rc == 0 {
                return sig;
            }
            tracing::warn!("sigwait failed: {}", std::io::Error::from_raw_os_error(rc));
        }
    }

    /// Wait for SIGINT or SIGTERM, shut `server` down, and log what the DMA space still holds (a
    /// clean stop shows 0 maps and 0 pinned pages).
    pub fn serve_until_signal(
        &self,
        server: RunningServer,
        dma: &DmaSpace,
    ) -> Result<(), ServerError> {
        let sig = loop {
            match self.wait() {
                libc::SIGHUP => tracing::info!("SIGHUP: nothing to reload"),
                sig => break sig,
            }
        };
        tracing::info!("signal {sig}: shutting down");
        server.shutdown()?;
        let stats = dma.stats();
        tracing::info!(
            "stopped: {} maps, {} pinned pages, {} leaked pins force-released",
            stats.maps,
            stats.pinned_pages,
            stats.leaked_pins_released
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_termination_signals_sigterm_to_this_thread_is_received_by_wait() {
        // Blocked in this thread only (the test harness's other threads keep their masks),
        // so the signal is sent to this thread, not to the process.
        let signals = TerminationSignals::block();
        // SAFETY: pthread_self is always valid; SIGTERM is blocked in this thread, so it
        // stays pending until the sigwait below instead of ending the process.
        let rc = unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGTERM) };
        assert_eq!(rc, 0);
        assert_eq!(signals.wait(), libc::SIGTERM);
    }

    #[test]
    fn test_termination_signals_with_hangup_wait_returns_sighup() {
        let signals = TerminationSignals::block_with_hangup();
        // SAFETY: as above; SIGHUP is blocked in this thread too.
        let rc = unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGHUP) };
        assert_eq!(rc, 0);
        assert_eq!(signals.wait(), libc::SIGHUP);
        assert!(format!("{signals:?}").contains("SIGHUP"));
    }
}
