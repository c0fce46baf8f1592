//! The queue worker: one thread from DRIVER_OK to reset, woken by notifications, that
//! takes every available chain of the control and cursor queues, executes it under the
//! state lock (so the unmap notifier and the screenshot see a command whole, never half),
//! writes the response, completes the chain and interrupts when the driver asks.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use umdev::dma::DmaHandle;
use umdev::virtio::{VirtioError, Virtqueue};

use super::commands::execute;
use super::state::GpuState;

pub(crate) fn lock(m: &Mutex<GpuState>) -> MutexGuard<'_, GpuState> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The running worker: its kick channel and thread.
pub(crate) struct Worker {
    kick: Sender<u16>,
    thread: JoinHandle<()>,
}

impl Worker {
    pub(crate) fn start(
        queues: Vec<Option<Virtqueue>>,
        dma: DmaHandle,
        state: Arc<Mutex<GpuState>>,
    ) -> Worker {
        let (kick, kicks) = channel();
        let thread = std::thread::spawn(move || run(queues, dma, state, kicks));
        Worker { kick, thread }
    }

    pub(crate) fn kick(&self, queue: u16) {
        let _ = self.kick.send(queue);
    }

    /// Stop after the current command and wait.
    pub(crate) fn stop(self) {
        drop(self.kick);
        let _ = self.thread.join();
    }
}

fn run(
    mut queues: Vec<Option<Virtqueue>>,
    dma: DmaHandle,
    state: Arc<Mutex<GpuState>>,
    kicks: Receiver<u16>,
) {
    while let Ok(index) = kicks.recv() {
        let Some(Some(q)) = queues.get_mut(usize::from(index)) else {
            continue;
        };
        if let Err(e) = drain(q, &dma, &state) {
            tracing::debug!("virtio-gpu: queue {index} stopped: {e}");
        }
    }
}

/// Execute everything available on `q`, then re-arm notifications.
fn drain(q: &mut Virtqueue, dma: &DmaHandle, state: &Mutex<GpuState>) -> Result<(), VirtioError> {
    loop {
        while let Some(chain) = q.pop()? {
            let mut st = lock(state);
            let pinned = match chain.pin(dma) {
                Ok(p) => p,
                Err(e) => return Err(q.fail(e.into())),
            };
            let request = pinned.read_all().map_err(|e| q.fail(e.into()))?;
            let response = execute(&mut st, dma, &request);
            let written = if response.len() as u64 <= pinned.writable_len() {
                pinned.write(0, &response).map_err(|e| q.fail(e.into()))?;
                response.len() as u32
            } else {
                if pinned.writable_len() > 0 {
                    tracing::debug!("virtio-gpu: response does not fit the chain: dropped");
                }
                0
            };
            drop(pinned);
            drop(st);
            q.add_used(chain.head(), written)?;
        }
        q.notify_if_needed()?;
        if !q.enable_notification()? {
            return Ok(());
        }
    }
}
