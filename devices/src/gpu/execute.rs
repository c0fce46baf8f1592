//! Executing one unit of an instance's fetched work on the render engine: one ring command
//! (decode, execute — pins, DMA, framebuffer writes — and its completion: `RING_HEAD`,
//! `FENCE_VALUE`, `IRQ_STATUS`, the error registers, the interrupt), or the `RING_FAULT` of
//! a fetch that failed.
//!
//! A unit is never cut in half: its register effects are committed under the register lock
//! together with the ring-generation check, so a command either completes as a whole or
//! leaves no trace in the registers; work fetched under an older generation (the ring was
//! reconfigured, or the device reset) is dropped without executing anything.
//!
//! Nothing here waits for the client: pin calls fail at once for fd-less memory, pixel
//! copies touch pinned pages and the framebuffer, and the ring was read by the instance's
//! fetcher (`worker.rs`) before the work reached the engine. That is what lets one engine
//! serve many instances: a unit's duration is bounded by the work it describes (at most the
//! instance's framebuffer size in bytes written), never by a client.
//!
//! **Cost.** Each unit reports what it cost, in *work units*: [`UNIT_BASE_COST`] for every
//! unit plus one per pixel written by a drawing command that succeeded. The scheduler
//! charges the instance that much (`sched.rs`), and the instance's [`EngineStats`]
//! (`work`) counts it: that is the "executed work" whose shares the weights govern.
//!
//! [`EngineStats`]: super::engine::EngineStats

use umdev::dma::DmaHandle;

use super::commands::{Command, DecodeError};
use super::error::{GpuError, ERR_RING_FAULT};
use super::gtt::lock;
use super::regs::IRQ_FENCE;
use super::render;
use super::state::Shared;

/// What every unit costs (a command's decode and completion, a FENCE, a failed command),
/// in work units; a drawing command adds the pixels it wrote.
pub const UNIT_BASE_COST: u64 = 64;

/// Commands fetched by one ring fetch, executed one per unit.
#[derive(Debug)]
pub(super) struct Batch {
    /// Ring generation the commands were fetched under.
    pub gen: u64,
    /// Ring byte offset of `dwords[0]` (`RING_HEAD` at the fetch).
    pub start: u32,
    /// `RING_SIZE - 1` at the fetch.
    pub mask: u32,
    /// The published dwords `[head, tail)`.
    pub dwords: Vec<u32>,
    /// Next dword to execute.
    pub pos: usize,
}

/// Work an instance's fetcher hands to the engine.
#[derive(Debug)]
pub(super) enum Work {
    /// Published commands.
    Batch(Batch),
    /// The fetch of `[at, tail)` failed: record `RING_FAULT` (info `at`) and drop the
    /// published commands (`RING_HEAD := tail`).
    Fault {
        /// Ring generation of the failed fetch.
        gen: u64,
        /// `RING_HEAD` at the fetch.
        at: u32,
        /// `RING_TAIL` at the fetch.
        tail: u32,
    },
}

/// What one unit did.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Outcome {
    /// Work units to charge (0 if nothing was executed).
    pub cost: u64,
    /// A command (or a fault) was executed and completed, as opposed to stale work dropped.
    pub executed: bool,
    /// Nothing of this work is left.
    pub done: bool,
}

/// What a successfully executed command asks the completion step to do.
#[derive(Debug, PartialEq, Eq)]
enum Effect {
    None,
    /// FENCE: store the value, set `IRQ_FENCE`.
    Fence(u32),
}

/// Execute the next unit of `work` for the instance whose state is `shared`.
pub(super) fn run_unit(shared: &Shared, dma: &DmaHandle, work: &mut Work) -> Outcome {
    match work {
        Work::Fault { gen, at, tail } => {
            let raise = {
                let mut regs = lock(&shared.regs);
                if regs.ring_gen != *gen {
                    return stale();
                }
                regs.ring.head = *tail;
                regs.record_error(ERR_RING_FAULT, *at)
            };
            shared.idle.notify_all();
            if raise {
                shared.raise();
            }
            Outcome {
                cost: UNIT_BASE_COST,
                executed: true,
                done: true,
            }
        }
        Work::Batch(b) => run_command(shared, dma, b),
    }
}

fn stale() -> Outcome {
    Outcome {
        cost: 0,
        executed: false,
        done: true,
    }
}

fn run_command(shared: &Shared, dma: &DmaHandle, b: &mut Batch) -> Outcome {
    if b.pos >= b.dwords.len() || lock(&shared.regs).ring_gen != b.gen {
        return stale();
    }
    let mask = b.mask as usize;
    let start = b.start as usize;
    let cmd_off = ((start + b.pos * 4) & mask) as u32;
    let (advance, result, pixels) = match Command::decode(&b.dwords[b.pos..]) {
        Ok((cmd, len)) => {
            tracing::trace!(?cmd, offset = cmd_off, "gpu: command");
            (len, execute(shared, dma, cmd), pixels(&cmd))
        }
        Err(DecodeError { error, skip }) => (skip.unwrap_or(b.dwords.len() - b.pos), Err(error), 0),
    };
    b.pos += advance;
    let cost = match result {
        Ok(_) => UNIT_BASE_COST.saturating_add(pixels),
        Err(_) => UNIT_BASE_COST,
    };
    // Completion: every register effect of the command, under one lock and only if the
    // ring is still the one the command came from.
    let raise = {
        let mut regs = lock(&shared.regs);
        if regs.ring_gen != b.gen {
            return Outcome {
                cost,
                executed: true,
                done: true,
            };
        }
        regs.ring.head = ((start + b.pos * 4) & mask) as u32;
        match result {
            Ok(Effect::None) => false,
            Ok(Effect::Fence(value)) => {
                regs.fence = value;
                regs.set_irq(IRQ_FENCE)
            }
            Err(e) => {
                tracing::warn!(error = e.report(), offset = cmd_off, "gpu: command failed");
                regs.record_error(e.code(), cmd_off)
            }
        }
    };
    shared.idle.notify_all();
    if raise {
        shared.raise();
    }
    Outcome {
        cost,
        executed: true,
        done: b.pos >= b.dwords.len(),
    }
}

/// Pixels a drawing command writes when it succeeds.
fn pixels(cmd: &Command) -> u64 {
    match *cmd {
        Command::Nop | Command::Fence { .. } => 0,
        Command::FillRect { w, h, .. }
        | Command::CopyRect { w, h, .. }
        | Command::Blit { w, h, .. }
        | Command::Readback { w, h, .. } => u64::from(w) * u64::from(h),
    }
}

/// Execute one command (its framebuffer and DMA work); register effects are returned for
/// the completion step.
fn execute(shared: &Shared, dma: &DmaHandle, cmd: Command) -> Result<Effect, GpuError> {
    let mode = lock(&shared.regs).mode;
    let fb = &shared.fb;
    match cmd {
        Command::Nop => return Ok(Effect::None),
        Command::Fence { value } => return Ok(Effect::Fence(value)),
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
                let src = shared.gtt.acquire(dma, gtt_index, pages, false)?;
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
                let dst = shared.gtt.acquire(dma, gtt_index, pages, true)?;
                render::readback(fb, &mode, (src_x, src_y), (w, h), &dst, stride)?;
            }
        }
    }
    Ok(Effect::None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_pixels_counts_only_drawing_commands() {
        assert_eq!(pixels(&Command::Fence { value: 1 }), 0);
        assert_eq!(pixels(&Command::Nop), 0);
        let fill = Command::FillRect {
            x: 0,
            y: 0,
            w: 30,
            h: 20,
            color: 0,
        };
        assert_eq!(pixels(&fill), 600);
        let huge = Command::Blit {
            gtt_index: 0,
            stride: 0,
            w: u32::MAX,
            h: u32::MAX,
            dst_x: 0,
            dst_y: 0,
        };
        assert_eq!(pixels(&huge), u64::from(u32::MAX) * u64::from(u32::MAX));
    }
}
