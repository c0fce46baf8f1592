//! The GPU as the scenarios in [`crate::gpu`] drive it: the function bound to
//! `uio_pci_generic`, the device crate's own guest driver over BAR0, the framebuffer (BAR2)
//! read and written by the guest CPU, a ring in a physically contiguous huge page, and a
//! model of the framebuffer that every drawing step updates so that the screen can be
//! compared after each one.
//!
//! The comparison covers a *window* of the screen chosen at [`open`]: the whole screen
//! while BAR2 is mapped into the guest (a CPU access costs nanoseconds), a small window once
//! QEMU has trapped BAR2. QEMU 10.2's vfio-user-pci disables the BAR mmaps at the first
//! INTx and never re-enables them (it lacks vfio-pci's `x-intx-mmap-timeout-ms`, so the
//! re-enable timer is 0 = off): from then on every framebuffer access is a REGION_READ or
//! REGION_WRITE round trip to the server, tens of microseconds under TCG.

use std::io;
use std::time::{Duration, Instant};

use umdev_devices::gpu::commands::Command;
use umdev_devices::gpu::driver::Driver;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{DEVICE_ID, VENDOR_ID};

use crate::mem::{DmaBuf, Ram, PAGE};
use crate::pci::{command, Mmio, PciDev};
use crate::report::Report;
use crate::uio::Uio;

/// The mode the scenarios use: not the reset mode, and a stride with 128 bytes of padding
/// per row, so that a device ignoring MODE_STRIDE draws visibly wrong pixels.
pub const W: u32 = 800;
/// Mode height.
pub const H: u32 = 600;
/// Mode stride in bytes.
pub const STRIDE: u32 = W * 4 + 128;
/// Ring size (the largest the device accepts), at the start of a 2 MiB huge page.
pub const RING_SIZE: u32 = 1 << 20;
/// What the guest CPU writes into the stride padding; no command may touch it.
const PAD: u32 = 0xdead_beef;

/// A rectangle: x, y, width, height.
pub type Rect = (u32, u32, u32, u32);

/// The open GPU.
pub struct Gpu {
    /// The PCI function.
    pub dev: PciDev,
    /// Its uio device (INTx).
    pub uio: Uio,
    /// The device crate's guest driver over BAR0.
    pub drv: Driver<Mmio>,
    /// BAR2: the framebuffer, mapped into the guest.
    pub fb: Mmio,
    /// The ring's memory.
    pub ring: DmaBuf,
    /// What the framebuffer must hold: `W × H` pixels.
    pub model: Vec<u32>,
    /// The part of the screen the CPU initialises and [`Gpu::check_fb`] compares (with the
    /// stride padding of its rows if it spans the whole width).
    pub window: Rect,
    /// The last fence value submitted.
    pub fence: u32,
}

/// A unique pixel for (`x`, `y`) under `seed` (24 bits, as XRGB8888 with X = 0).
pub fn pattern(seed: u32, x: u32, y: u32) -> u32 {
    (((x & 0xfff) << 12) | (y & 0xfff)) ^ (seed & 0x00ff_ffff)
}

/// The whole screen as a window.
pub const FULL: Rect = (0, 0, W, H);

/// Open the GPU for scenario `p` (check-name prefix): find it, bind uio, enable Memory and
/// Bus Master, probe, set the mode, set up the ring, and start from a known state (GTT
/// invalid, interrupts off and acknowledged, `window` of the framebuffer written by the CPU).
pub fn open(r: &mut Report, p: &str, window: Rect) -> Option<Gpu> {
    let dev = r.ok(&format!("{p}.find"), PciDev::find(VENDOR_ID, DEVICE_ID))?;
    open_dev(r, p, window, dev)
}

/// [`open`] for a given function (a guest with several GPUs).
pub fn open_dev(r: &mut Report, p: &str, window: Rect, dev: PciDev) -> Option<Gpu> {
    let uio = r.ok(&format!("{p}.uio_bind"), Uio::bind(&dev))?;
    r.ok(
        &format!("{p}.enable"),
        dev.update_command(command::MEMORY | command::BUS_MASTER, command::INTX_DISABLE),
    )?;
    let bar0 = r.ok(&format!("{p}.bar0"), dev.bar(0))?;
    let mut drv = r.ok(&format!("{p}.probe"), Driver::probe(bar0))?;
    let fb = r.ok(&format!("{p}.bar2"), dev.bar(2))?;
    let ids = (|| -> io::Result<(u32, u32, u32)> {
        Ok((
            drv.read(REG_VERSION)?,
            drv.read(REG_FB_SIZE)?,
            drv.read(REG_GTT_ENTRIES)?,
        ))
    })();
    let (version, fb_size, gtt) = r.ok(&format!("{p}.id_regs"), ids)?;
    r.check(
        &format!("{p}.identity"),
        version == VERSION && fb_size as usize == fb.len() && gtt == GTT_ENTRIES,
        format_args!(
            "VERSION {version:#x}, FB_SIZE {fb_size:#x} (BAR2 {:#x} bytes), GTT_ENTRIES {gtt}",
            fb.len()
        ),
    );
    r.ok(&format!("{p}.mode"), drv.set_mode(W, H, STRIDE))?;
    let ring = r.ok(&format!("{p}.ring_alloc"), DmaBuf::contiguous(2 << 20))?;
    r.ok(
        &format!("{p}.ring"),
        drv.setup_ring(ring.addr(0), RING_SIZE),
    )?;
    let quiet = (|| -> io::Result<u32> {
        drv.enable_irqs(0)?;
        drv.clear_gtt(0, GTT_ENTRIES)?;
        drv.ack(IRQ_ALL)?;
        drv.read(REG_STATUS)
    })();
    let status = r.ok(&format!("{p}.quiet"), quiet)?;
    r.check(
        &format!("{p}.status"),
        status == STATUS_MODE_ENABLED | STATUS_RING_ENABLED,
        format_args!("STATUS {status:#x}"),
    );
    let fence = drv.read(REG_FENCE_VALUE).unwrap_or(0);
    let mut g = Gpu {
        dev,
        uio,
        drv,
        fb,
        ring,
        model: vec![0; (W * H) as usize],
        window,
        fence,
    };
    // Known contents: a pattern over the window and PAD in its stride padding, all written
    // by the CPU (framebuffer contents survive earlier scenarios and device resets). Outside
    // the window the model is unknown and never compared.
    let (wx, wy, ww, wh) = window;
    let init = (|| -> io::Result<()> {
        for y in wy..wy + wh {
            for x in wx..wx + ww {
                g.cpu_put(x, y, pattern(0x5a5a5a, x, y))?;
            }
            if ww == W {
                for off in (W * 4..STRIDE).step_by(4) {
                    g.fb.write32(u64::from(y * STRIDE + off), PAD)?;
                }
            }
        }
        Ok(())
    })();
    r.ok(&format!("{p}.fb_init"), init)?;
    Some(g)
}

impl Gpu {
    /// Write pixel (x, y) with the CPU through BAR2 (and into the model).
    pub fn cpu_put(&mut self, x: u32, y: u32, v: u32) -> io::Result<()> {
        self.model[(y * W + x) as usize] = v;
        self.fb.write32(u64::from(y * STRIDE + 4 * x), v)
    }

    /// Nanoseconds per CPU read of a framebuffer word, over `words` reads from the start.
    pub fn fb_read_ns(&self, words: u32) -> io::Result<f64> {
        let t = Instant::now();
        let mut sum = 0u32;
        for k in 0..words {
            sum = sum.wrapping_add(self.fb.read32(u64::from(k) * 4)?);
        }
        std::hint::black_box(sum);
        Ok(t.elapsed().as_nanos() as f64 / f64::from(words.max(1)))
    }

    /// Model: a FILL_RECT.
    pub fn model_fill(&mut self, (x, y, w, h): Rect, color: u32) {
        for yy in y..y + h {
            let row = (yy * W) as usize;
            self.model[row + x as usize..row + (x + w) as usize].fill(color);
        }
    }

    /// Compare the window of the framebuffer (pixels, and stride padding for a full-width
    /// window) with the model: the number of wrong pixels or padding words, and the first.
    pub fn fb_diff(&self) -> io::Result<(usize, String)> {
        let mut bad = 0;
        let mut first = String::new();
        let (wx, wy, ww, wh) = self.window;
        let right = if ww == W { STRIDE / 4 } else { wx + ww };
        for y in wy..wy + wh {
            for x in wx..right {
                let got = self.fb.read32(u64::from(y * STRIDE + 4 * x))?;
                let want = if x < W {
                    self.model[(y * W + x) as usize]
                } else {
                    PAD
                };
                if got != want {
                    if bad == 0 {
                        first = format!(", first at ({x}, {y}): {got:#010x}, want {want:#010x}");
                    }
                    bad += 1;
                }
            }
        }
        Ok((bad, first))
    }

    /// Check the framebuffer against the model.
    pub fn check_fb(&self, r: &mut Report, name: &str) -> bool {
        match self.fb_diff() {
            Ok((bad, first)) => r.check(
                name,
                bad == 0,
                format_args!(
                    "{bad} wrong words in the {}x{} window at ({}, {}), stride {STRIDE}{first}",
                    self.window.2, self.window.3, self.window.0, self.window.1
                ),
            ),
            Err(e) => r.check(name, false, e),
        }
    }

    /// Publish `cmds` with one doorbell (the driver writes the ring and RING_TAIL).
    pub fn submit(&mut self, cmds: &[Command]) -> io::Result<()> {
        self.drv.submit(&mut Ram(vec![&self.ring]), cmds)
    }

    /// Publish `cmds` followed by a new FENCE and wait for the fence; returns the ring
    /// offset where `cmds` start.
    pub fn run(&mut self, cmds: &[Command]) -> io::Result<u32> {
        let at = self.idle_head()?;
        self.fence = self.fence.wrapping_add(1);
        let mut all = cmds.to_vec();
        all.push(Command::Fence { value: self.fence });
        self.submit(&all)?;
        self.drv.wait_fence(self.fence)?;
        Ok(at)
    }

    /// RING_HEAD once the device has executed everything published (then it is also the
    /// offset of the next command the driver writes).
    pub fn idle_head(&mut self) -> io::Result<u32> {
        self.drv.wait_idle()?;
        self.drv.read(REG_RING_HEAD)
    }

    /// Publish raw dwords at ring offset 0 (commands the driver cannot encode: bad
    /// opcodes, truncated lengths), wait until RING_HEAD reaches the tail, and re-enable
    /// the ring so that the driver's idea of the tail (0) holds again.
    pub fn submit_raw(&mut self, dwords: &[u32]) -> io::Result<()> {
        self.drv.setup_ring(self.ring.addr(0), RING_SIZE)?;
        let bytes: Vec<u8> = dwords.iter().flat_map(|d| d.to_le_bytes()).collect();
        self.ring.write_at(0, &bytes)?;
        let tail = bytes.len() as u32;
        self.drv.write(REG_RING_TAIL, tail)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.drv.read(REG_RING_HEAD)? != tail {
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "RING_HEAD never reached the raw tail",
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        self.drv.setup_ring(self.ring.addr(0), RING_SIZE)
    }

    /// `(IRQ_STATUS, ERROR_CODE, ERROR_INFO, ERROR_COUNT)`.
    pub fn errors(&mut self) -> io::Result<(u32, u32, u32, u32)> {
        Ok((
            self.drv.read(REG_IRQ_STATUS)?,
            self.drv.read(REG_ERROR_CODE)?,
            self.drv.read(REG_ERROR_INFO)?,
            self.drv.read(REG_ERROR_COUNT)?,
        ))
    }

    /// Check that the error registers say `code` at `info`, with ERROR_COUNT = `count`
    /// and IRQ_STATUS.ERROR set.
    pub fn check_error(&mut self, r: &mut Report, name: &str, code: u32, info: u32, count: u32) {
        match self.errors() {
            Ok((st, c, i, n)) => {
                r.check(
                    name,
                    c == code && i == info && n == count && st & IRQ_ERROR != 0,
                    format_args!(
                        "ERROR_CODE {c} (want {code}), ERROR_INFO {i:#x} (want {info:#x}), \
                         ERROR_COUNT {n} (want {count}), IRQ_STATUS {st:#x}"
                    ),
                );
            }
            Err(e) => {
                r.check(name, false, e);
            }
        }
    }

    /// Acknowledge ERROR and check that ERROR_CODE/INFO and IRQ_STATUS.ERROR clear while
    /// ERROR_COUNT stays `count`.
    pub fn ack_error(&mut self, r: &mut Report, name: &str, count: u32) {
        let res = self.drv.ack(IRQ_ERROR).and_then(|()| self.errors());
        match res {
            Ok((st, c, i, n)) => {
                r.check(
                    name,
                    c == 0 && i == 0 && n == count && st & IRQ_ERROR == 0,
                    format_args!(
                        "after IRQ_ACK: ERROR_CODE {c}, ERROR_INFO {i:#x}, ERROR_COUNT {n} \
                         (want {count}), IRQ_STATUS {st:#x}"
                    ),
                );
            }
            Err(e) => {
                r.check(name, false, e);
            }
        }
    }

    /// Point GTT entries `first..` at the pages of `surface`.
    pub fn map(&mut self, first: u32, surface: &Surface, writable: bool) -> io::Result<()> {
        for k in 0..surface.pages() {
            self.drv
                .set_gtt(first + k as u32, surface.addr(k), writable)?;
        }
        Ok(())
    }

    /// Leave the device quiet for the next scenario: interrupts off and acknowledged, the
    /// GTT invalid (its pins released), so no entry points at memory this scenario frees.
    pub fn close(&mut self, r: &mut Report, p: &str) {
        let res = (|| -> io::Result<()> {
            self.drv.enable_irqs(0)?;
            self.drv.clear_gtt(0, GTT_ENTRIES)?;
            self.drv.ack(IRQ_ALL)
        })();
        r.ok(&format!("{p}.close"), res);
    }
}

/// A surface in guest pages behind consecutive GTT entries: `w × h` XRGB8888 pixels, rows
/// `stride` bytes apart. Surface page `k` is page `2k` of a fresh [`DmaBuf`], so neighbouring
/// GTT entries point at guest pages that are not physically consecutive whatever order the
/// guest kernel handed out the buffer's pages in. The pages in between are never given to
/// the device and must stay as the guest filled them, like every byte outside the pixels.
pub struct Surface {
    buf: DmaBuf,
    pages: usize,
    fill: u8,
    w: u32,
    h: u32,
    stride: u32,
}

impl Surface {
    /// A `w × h` surface with rows `stride` bytes apart, every byte `fill`.
    pub fn new(w: u32, h: u32, stride: u32, fill: u8) -> io::Result<Surface> {
        let span = (h as usize - 1) * stride as usize + 4 * w as usize;
        let pages = span.div_ceil(PAGE);
        let buf = DmaBuf::new(2 * pages)?;
        let s = Surface {
            buf,
            pages,
            fill,
            w,
            h,
            stride,
        };
        s.refill()?;
        Ok(s)
    }

    /// Number of GTT entries the surface needs.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Guest-physical address of surface page `k`.
    pub fn addr(&self, k: usize) -> u64 {
        self.buf.addr(2 * k)
    }

    /// Buffer offset of surface byte `off`.
    fn at(off: usize) -> usize {
        off / PAGE * 2 * PAGE + off % PAGE
    }

    /// Write pixel (x, y) with the CPU.
    pub fn put(&self, x: u32, y: u32, v: u32) -> io::Result<()> {
        let off = (y * self.stride + 4 * x) as usize;
        self.buf.write_at(Self::at(off), &v.to_le_bytes())
    }

    /// Every byte back to the fill byte.
    pub fn refill(&self) -> io::Result<()> {
        self.buf.fill(0, self.buf.len(), self.fill)
    }

    /// How many neighbouring surface pages are not physically consecutive.
    pub fn discontiguities(&self) -> usize {
        (1..self.pages)
            .filter(|&k| self.addr(k) != self.addr(k - 1) + PAGE as u64)
            .count()
    }

    /// Compare the pixels with `want(x, y)` and every other byte of the buffer (row
    /// padding, the tail of the last page, the pages in between) with the fill byte: the
    /// number of wrong bytes and the first one.
    pub fn diff(&self, want: impl Fn(u32, u32) -> u32) -> io::Result<(usize, String)> {
        let mut bytes = vec![0u8; self.buf.len()];
        self.buf.read_at(0, &mut bytes)?;
        let mut expect = vec![self.fill; self.buf.len()];
        for y in 0..self.h {
            for x in 0..self.w {
                let off = Self::at((y * self.stride + 4 * x) as usize);
                expect[off..off + 4].copy_from_slice(&want(x, y).to_le_bytes());
            }
        }
        let mut bad = 0;
        let mut first = String::new();
        for (off, (g, e)) in bytes.iter().zip(&expect).enumerate() {
            if g != e {
                if bad == 0 {
                    first = format!(", first at buffer byte {off:#x}: {g:#04x}, want {e:#04x}");
                }
                bad += 1;
            }
        }
        Ok((bad, first))
    }
}
