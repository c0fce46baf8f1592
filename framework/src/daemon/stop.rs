//! Stopping a daemon from inside its process, as SIGTERM stops it from outside: for a
//! program that runs the daemon on a thread of its own (a test, an embedding service).
//!
//! # How
//! [`DaemonBuilder::run`](super::DaemonBuilder::run) waits for its signals with `sigwait`
//! on the thread that runs it, which has them blocked ([`super::Daemon::builder`]).
//! [`StopHandle::stop`] sends SIGTERM to that thread alone (`pthread_kill`), never to the
//! process: another thread of the process, which may not block SIGTERM, never sees it.
//!
//! # Invariants
//! - One lock orders the waiting thread and the stoppers. The thread's id is published
//!   under it before the first wait and withdrawn under it before `run` goes on to stop
//!   the instances; a stopper signals only while the id is published, holding the lock, so
//!   the thread it signals is alive and still waiting for its signals.
//! - A stop asked for before the daemon waits (or before it runs at all) is remembered: the
//!   daemon stops as soon as it is ready, without waiting.
//! - The thread is signalled at most once; later stops do nothing (a second SIGTERM left
//!   pending on a thread that goes on with the signal blocked would be a trap).

use std::sync::{Arc, Mutex, MutexGuard};

/// Where the daemon is, as its stoppers see it.
#[derive(Debug, Default)]
enum State {
    /// Not waiting yet; no stop asked for.
    #[default]
    Starting,
    /// Waiting for its signals on this thread.
    Waiting(libc::pthread_t),
    /// A stop was asked for (and the waiting thread, if any, signalled).
    Stopping,
    /// Done waiting.
    Done,
}

/// Stops a daemon from another thread of its process as SIGTERM would
/// ([`DaemonBuilder::stop_handle`](super::DaemonBuilder::stop_handle)). Cloneable; a stop
/// asked for before the daemon is ready takes effect once it is.
#[derive(Clone, Debug, Default)]
pub struct StopHandle {
    state: Arc<Mutex<State>>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl StopHandle {
    /// Stop the daemon: it stops taking control requests and stops every instance, as on
    /// SIGTERM; its `run` then returns. Does not wait for that.
    pub fn stop(&self) {
        let mut state = lock(&self.state);
        match *state {
            State::Starting => *state = State::Stopping,
            State::Waiting(thread) => {
                // SAFETY: `thread` is published only while its thread waits in `run`, and
                // withdrawn under this lock (held here) before it goes on: it is a live
                // thread of this process. SIGTERM is a valid signal; that thread has it
                // blocked and takes it with sigwait.
                let rc = unsafe { libc::pthread_kill(thread, libc::SIGTERM) };
                if rc != 0 {
                    tracing::warn!(
                        "stopping the daemon: {}",
                        std::io::Error::from_raw_os_error(rc)
                    );
                }
                *state = State::Stopping;
            }
            State::Stopping | State::Done => {}
        }
    }

    /// Called by `run` on its thread before it waits: publish the thread, or `false` if a
    /// stop was asked for already (then it must not wait).
    pub(super) fn begin_wait(&self) -> bool {
        let mut state = lock(&self.state);
        match *state {
            State::Starting => {
                // SAFETY: pthread_self has no preconditions and cannot fail.
                *state = State::Waiting(unsafe { libc::pthread_self() });
                true
            }
            _ => false,
        }
    }

    /// Called by `run` on its thread once it waits no more.
    pub(super) fn end_wait(&self) {
        *lock(&self.state) = State::Done;
    }
}
