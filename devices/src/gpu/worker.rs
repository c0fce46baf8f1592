//! The worker thread: woken by the doorbell (a `RING_TAIL` write), it fetches the published
//! commands from the ring and executes them in order, so the connection thread never draws.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, Sender, TrySendError};
use umdev::dma::DmaHandle;

use super::commands::{Command, DecodeError};
use super::error::{GpuError, ERR_RING_FAULT};
use super::gtt::lock;
use super::regs::IRQ_FENCE;
use super::render;
use super::ring;
use super::state::Shared;

/// Handle to the worker thread; dropping it stops and joins the thread.
pub struct Worker {
    doorbell: Option<Sender<()>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Start the worker.
    pub fn spawn(shared: Arc<Shared>, dma: DmaHandle) -> std::io::Result<Worker> {
        // One pending doorbell is enough: the worker always reads the latest tail.
        let (tx, rx) = crossbeam_channel::bounded(1);
        let stop = Arc::new(AtomicBool::new(false));
        let ctx = Ctx {
            shared,
            dma,
            stop: stop.clone(),
        };
        let thread = std::thread::Builder::new()
            .name("umdev-gpu-worker".into())
            .spawn(move || ctx.run(rx))?;
        Ok(Worker {
            doorbell: Some(tx),
            stop,
            thread: Some(thread),
        })
    }

    /// Ring the doorbell (never blocks).
    pub fn doorbell(&self) {
        if let Some(tx) = &self.doorbell {
            match tx.try_send(()) {
                Ok(()) | Err(TrySendError::Full(())) => {}
                Err(TrySendError::Disconnected(())) => {
                    tracing::warn!("gpu: worker thread is gone")
                }
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.doorbell = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Ctx {
    shared: Arc<Shared>,
    dma: DmaHandle,
    stop: Arc<AtomicBool>,
}

impl Ctx {
    fn run(self, rx: Receiver<()>) {
        while rx.recv().is_ok() {
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            self.drain();
        }
        tracing::debug!("gpu: worker stopped");
    }

    /// Execute published commands until head == tail (or the ring is reconfigured).
    fn drain(&self) {
        let mut dwords = Vec::new();
        loop {
            let (ring, gen) = {
                let regs = lock(&self.shared.regs);
                if regs.idle() {
                    self.shared.idle.notify_all();
                    return;
                }
                (regs.ring, regs.ring_gen)
            };
            if let Err(e) = ring::fetch(&self.dma, &ring, &mut dwords) {
                tracing::warn!(error = %e, base = ring.base, "gpu: ring fetch failed");
                let raise = {
                    let mut regs = lock(&self.shared.regs);
                    if regs.ring_gen != gen {
                        continue;
                    }
                    regs.ring.head = ring.tail;
                    regs.record_error(ERR_RING_FAULT, ring.head)
                };
                self.shared.idle.notify_all();
                if raise {
                    self.shared.raise();
                }
                continue;
            }
            let mask = ring.size as usize - 1;
            let mut pos = 0usize;
            while pos < dwords.len() {
                if self.stop.load(Ordering::Acquire) {
                    return;
                }
                if lock(&self.shared.regs).ring_gen != gen {
                    break;
                }
                let cmd_off = ((ring.head as usize + pos * 4) & mask) as u32;
                let (advance, result) = match Command::decode(&dwords[pos..]) {
                    Ok((cmd, len)) => {
                        tracing::trace!(?cmd, offset = cmd_off, "gpu: command");
                        (len, self.execute(cmd))
                    }
                    Err(DecodeError { error, skip }) => {
                        (skip.unwrap_or(dwords.len() - pos), Err(error))
                    }
                };
                pos += advance;
                let raise = {
                    let mut regs = lock(&self.shared.regs);
                    if regs.ring_gen != gen {
                        break;
                    }
                    regs.ring.head = ((ring.head as usize + pos * 4) & mask) as u32;
                    match result {
                        Ok(raise) => raise,
                        Err(e) => {
                            tracing::warn!(
                                error = e.report(),
                                offset = cmd_off,
                                "gpu: command failed"
                            );
                            regs.record_error(e.code(), cmd_off)
                        }
                    }
                };
                self.shared.idle.notify_all();
                if raise {
                    self.shared.raise();
                }
            }
        }
    }

    /// Execute one command; Ok(true) if it asks for an interrupt.
    fn execute(&self, cmd: Command) -> Result<bool, GpuError> {
        let mode = lock(&self.shared.regs).mode;
        let fb = &self.shared.fb;
        match cmd {
            Command::Nop => return Ok(false),
            Command::Fence { value } => {
                let mut regs = lock(&self.shared.regs);
                regs.fence = value;
                return Ok(regs.set_irq(IRQ_FENCE));
            }
            _ if !mode.enabled => return Err(GpuError::ModeDisabled),
            Command::FillRect { x, y, w, h, color } => {
                render::fill_rect(fb, &mode, (x, y, w, h), color)?
            }
            Command::CopyRect {
                src_x,
                src_y,
                dst_x,
                dst_y,
                w,
                h,
            } => render::copy_rect(fb, &mode, (src_x, src_y), (dst_x, dst_y), (w, h))?,
            Command::Blit {
                gtt_index,
                stride,
                w,
                h,
                dst_x,
                dst_y,
            } => {
                render::check_rect(&mode, dst_x, dst_y, w, h)?;
                let pages = render::surface_pages(stride, w, h)?;
                if pages > 0 {
                    let src = self
                        .shared
                        .gtt
                        .acquire(&self.dma, gtt_index, pages, false)?;
                    render::blit(fb, &mode, &src, stride, (w, h), (dst_x, dst_y))?;
                }
            }
            Command::Readback {
                src_x,
                src_y,
                w,
                h,
                gtt_index,
                stride,
            } => {
                render::check_rect(&mode, src_x, src_y, w, h)?;
                let pages = render::surface_pages(stride, w, h)?;
                if pages > 0 {
                    let dst = self.shared.gtt.acquire(&self.dma, gtt_index, pages, true)?;
                    render::readback(fb, &mode, (src_x, src_y), (w, h), &dst, stride)?;
                }
            }
        }
        Ok(false)
    }
}
