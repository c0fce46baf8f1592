//! The I/O pool: threads that run I/O commands, so that one queue's commands overlap.
//!
//! A queue's worker fetches commands and hands each I/O command to the pool; a pool thread
//! walks its PRPs, pins its pages, does the file I/O and sends the completion back to the
//! worker, which posts it (completions may come out of submission order, as NVMe allows).
//! The pool is shared by all queues of a controller; its threads end when the controller's
//! shared state, which holds the sender, is dropped.

use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender};

/// A unit of work.
pub type Job = Box<dyn FnOnce() + Send>;

/// Start `threads` pool threads; the sender feeds them, the handles join them once every
/// sender is gone.
pub fn start(threads: usize) -> (Sender<Job>, Vec<JoinHandle<()>>) {
    let (tx, rx): (Sender<Job>, Receiver<Job>) = crossbeam_channel::unbounded();
    let handles = (0..threads.max(1))
        .filter_map(|i| {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("nvme-io{i}"))
                .spawn(move || {
                    for job in rx {
                        job();
                    }
                })
                .map_err(|e| tracing::error!(error = %e, "nvme: cannot start an I/O thread"))
                .ok()
        })
        .collect();
    (tx, handles)
}
