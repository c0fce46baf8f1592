//! Serving until SIGINT/SIGTERM: what `umdev run` and the hello example's `--serve` mode do
//! so that stopping a server is clean (the client is disconnected, its maps released, the
//! socket removed) and the final DMA counters are logged.

use umdev::dma::DmaSpace;
use umdev::server::{RunningServer, ServerError};

/// SIGINT and SIGTERM, blocked in the calling thread and every thread it spawns afterwards.
pub struct TerminationSignals(libc::sigset_t);

impl TerminationSignals {
    /// Block SIGINT/SIGTERM. Call it before spawning any thread (the server's included), so
    /// that no thread takes them asynchronously and [`TerminationSignals::wait`] gets them.
    pub fn block() -> TerminationSignals {
        // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset_t; pthread_sigmask only changes this thread's mask.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGINT);
            libc::sigaddset(&mut set, libc::SIGTERM);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        }
        TerminationSignals(set)
    }

    /// Wait for SIGINT or SIGTERM; returns the signal number.
    pub fn wait(&self) -> i32 {
        let mut sig = 0;
        // SAFETY: the set holds signals blocked in every thread; sigwait writes `sig`.
        unsafe { libc::sigwait(&self.0, &mut sig) };
        sig
    }

    /// Wait for a signal, shut `server` down, and log what the DMA space still holds (a
    /// clean stop shows 0 maps and 0 pinned pages).
    pub fn serve_until_signal(
        &self,
        server: RunningServer,
        dma: &DmaSpace,
    ) -> Result<(), ServerError> {
        let sig = self.wait();
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
