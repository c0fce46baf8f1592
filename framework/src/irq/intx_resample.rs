//! The INTx unmask ("resample") eventfd: SET_IRQS UNMASK with DATA_EVENTFD on INTx.
//!
//! QEMU with KVM routes INTx through an irqfd with a resample fd: at the guest's EOI, KVM
//! signals that fd instead of QEMU sending SET_IRQS UNMASK. A small thread per device waits
//! on it and unmasks INTx (firing a pending trigger), as kernel VFIO does. The thread holds
//! only a weak reference to the interrupt state and stops when the watcher is dropped
//! (detach, index disable, disconnect, or the device going away).

use std::os::fd::AsRawFd;
use std::sync::Weak;
use std::thread::JoinHandle;

use vmm_sys_util::eventfd::EventFd;

use super::state::IrqState;

/// A running resample watcher; dropping it stops and joins the thread.
#[derive(Debug)]
pub(crate) struct ResampleWatcher {
    stop: EventFd,
    thread: Option<JoinHandle<()>>,
}

impl ResampleWatcher {
    /// Watch `resample`: each signal unmasks INTx of `state`.
    pub(crate) fn start(
        resample: EventFd,
        state: Weak<IrqState>,
    ) -> std::io::Result<ResampleWatcher> {
        let stop = EventFd::new(libc::EFD_NONBLOCK)?;
        let stop_thread = stop.try_clone()?;
        let thread = std::thread::Builder::new()
            .name("umdev-intx-resample".into())
            .spawn(move || watch(&resample, &stop_thread, &state))?;
        Ok(ResampleWatcher {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for ResampleWatcher {
    fn drop(&mut self) {
        if let Err(e) = self.stop.write(1) {
            tracing::warn!(error = %e, "cannot stop the INTx resample thread");
            return; // Leave it detached rather than block forever.
        }
        if let Some(t) = self.thread.take() {
            // The thread itself may drop the last reference to the state (and so us).
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

fn watch(resample: &EventFd, stop: &EventFd, state: &Weak<IrqState>) {
    let mut fds = [
        libc::pollfd {
            fd: resample.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: stop.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    loop {
        // SAFETY: `fds` is a valid array of two pollfd for the duration of the call, and
        // both fds stay open (owned by this thread's borrowers) until we return.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::warn!(error = %e, "INTx resample poll failed; watcher stops");
            return;
        }
        if fds[1].revents != 0 {
            return;
        }
        if fds[0].revents & libc::POLLIN != 0 {
            // A nonblocking fd may have been drained already; only the wake-up matters.
            let _ = resample.read();
            let Some(state) = state.upgrade() else {
                return;
            };
            tracing::trace!("INTx resample: unmask");
            state.intx.unmask(|| state.send_intx());
        } else if fds[0].revents != 0 {
            tracing::warn!("INTx resample fd error/hangup; watcher stops");
            return;
        }
    }
}
