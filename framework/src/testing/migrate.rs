//! A VMM-side live-migration driver: moves a running device from the server a source [`Vmm`]
//! is connected to, to the server a destination [`Vmm`] is connected to, together with the
//! guest RAM the device reaches, the way a VMM's live migration does it. QEMU's vfio-user
//! client does not migrate yet; this is the client half that `umdev demo migrate` and the
//! tests use, and what a device author runs to see a device move.
//!
//! **Preconditions.** Both VMMs are connected (with [`MIGRATION_CAPS`](super::MIGRATION_CAPS)
//! or any caps) and have their guest RAM ([`Vmm::with_ram`]) at the same guest address and
//! of the same size: the destination's is the RAM the guest continues with. The source
//! device runs (RUNNING, the guest set it up); the destination is a fresh device of the same
//! kind and configuration in RUNNING (the server's state after connect). Only one RAM
//! block is moved (the one `with_ram` added); fd-less memory is the VMM's own and not moved.
//!
//! **What it does**, in [`Migration`]'s steps (or all at once with [`migrate`]):
//! 1. [`Migration::start`]: checks MIGRATION on both sides, starts DMA logging on the source
//!    over guest RAM (DMA_LOGGING_START, 4 KiB pages) and the RAM's CPU dirty log (standing
//!    in for KVM's, [`GuestMemory::cpu_dirty_start`]), takes the destination RUNNING → STOP →
//!    RESUMING, puts the source in PRE_COPY (when the device offers it and
//!    [`MigrateOptions::pre_copy`]), and copies all guest RAM to the destination.
//! 2. [`Migration::round`], as often as the caller likes while the guest keeps running on
//!    the source ([`Migration::converged`] says when the options would stop): copies the
//!    RAM pages dirtied since the last pass (the device's DMA_LOGGING_REPORT ∪ the CPU
//!    log), then reads one PRE_COPY round (MIG_DATA_READ of the transfer size until a short
//!    read; the first round's data begins with the stream's `Start` frame) and writes it to
//!    the destination at once, so it is not part of the downtime.
//! 3. [`Migration::stop_copy`]: the source leaves RUNNING (→ STOP_COPY; the guest must not
//!    run from here on), the last RAM pass (everything dirtied since, now final), DMA
//!    logging stopped, the STOP_COPY data read and written, destination RESUMING → STOP
//!    (the destination loads the stream: a refusal is an error here).
//! 4. Between `stop_copy` and `resume_destination` the VMM re-attaches the guest's
//!    interrupts to the destination (below).
//! 5. [`Migration::resume_destination`]: destination RUNNING; the source is left in STOP
//!    (the source VMM then disconnects). The [`MigrationReport`] has per round bytes,
//!    RAM pages and time, STOP_COPY bytes and time, and the downtime proxy: from the
//!    source leaving RUNNING to the destination's RUNNING reply.
//!
//! **Interrupts are the VMM's.** An eventfd attached with SET_IRQS is the VMM's (KVM's irqfd
//! for the guest's vector) and is not in the stream; what is (MSI/MSI-X programming,
//! masks, pending bits, INTx level) is the framework's PCI state. So after the stream is
//! loaded and before the destination runs, the destination VMM attaches *the same*
//! eventfds to the same vectors: `dst.set_irq_eventfd(irq_index::MSI, 0, &efd)` (or MSIX,
//! INTx) — not `enable_msi`, since the destination's config space already holds the
//! guest's MSI programming. An interrupt pending at STOP is then delivered once, on the
//! eventfd the guest waits on.
//!
//! **Errors and abort.** Every step returns a typed [`MigrateError`] saying which side and
//! step failed. A failure after the source left RUNNING is not final: the driver aborts,
//! putting the source back to RUNNING (its device resumes; the guest continues there), stops
//! DMA logging and the CPU log, and resets the destination (DEVICE_RESET, which ends a
//! RESUMING session or ERROR) so it can take another attempt. Only
//! [`MigrateError::RollbackFailed`] means the source could not be put back
//! ([`MigrateError::source_running`]). After the destination runs nothing is rolled back.
//!
//! ```no_run
//! use umdev::testing::{migrate, MigrateOptions, Vmm, MIGRATION_CAPS};
//! # fn f(src_sock: &std::path::Path, dst_sock: &std::path::Path) -> Result<(), Box<dyn std::error::Error>> {
//! let mut src = Vmm::connect_with_caps(src_sock, MIGRATION_CAPS)?.with_ram(0, 16 << 20)?;
//! // ... the guest drives the source device ...
//! let mut dst = Vmm::connect_with_caps(dst_sock, MIGRATION_CAPS)?.with_ram(0, 16 << 20)?;
//! let report = migrate(
//!     &mut src,
//!     &mut dst,
//!     &MigrateOptions::default(),
//!     |_src, _round| Ok(()),  // the guest runs a little between rounds
//!     |_dst| Ok(()),          // re-attach the guest's interrupt eventfds here
//! )?;
//! println!("{report}");
//! # Ok(()) }
//! ```

use std::fmt;
use std::io;
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::VFIO_MIGRATION_PRE_COPY;

use crate::migration::MigState;

use super::guest_memory::GuestMemory;
use super::vmm::Vmm;

/// The page size of the dirty logs and the RAM copy.
pub const MIGRATION_PAGE: u64 = 4096;

/// How a [`Migration`] runs.
#[derive(Clone, Debug)]
pub struct MigrateOptions {
    /// Use PRE_COPY when the device offers it (else the device's state moves in STOP_COPY
    /// only; RAM is copied iteratively either way).
    pub pre_copy: bool,
    /// [`Migration::converged`] after this many rounds.
    pub max_rounds: usize,
    /// [`Migration::converged`] after a round that moved at most this many bytes (device
    /// data plus RAM pages).
    pub small_round_bytes: u64,
}

impl Default for MigrateOptions {
    fn default() -> Self {
        MigrateOptions {
            pre_copy: true,
            max_rounds: 8,
            small_round_bytes: 256 << 10,
        }
    }
}

/// One iteration while the guest runs on the source.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RoundReport {
    /// PRE_COPY bytes read from the source and written to the destination.
    pub device_bytes: u64,
    /// Guest RAM pages copied (dirtied since the last pass).
    pub ram_pages: u64,
    /// How long the round's RAM pass and transfer took.
    pub time: Duration,
}

impl RoundReport {
    /// Device bytes plus RAM bytes.
    pub fn bytes(&self) -> u64 {
        self.device_bytes + self.ram_pages * MIGRATION_PAGE
    }
}

/// What a migration moved and how long the guest was stopped.
#[derive(Clone, Debug, Default)]
pub struct MigrationReport {
    /// PRE_COPY was used (offered by the device and asked for).
    pub pre_copy: bool,
    /// Guest RAM pages of the first, whole copy.
    pub initial_ram_pages: u64,
    /// The rounds while the guest ran.
    pub rounds: Vec<RoundReport>,
    /// Guest RAM pages of the last pass (after the source stopped).
    pub stop_copy_ram_pages: u64,
    /// STOP_COPY bytes (the device's state, plus unread PRE_COPY data).
    pub stop_copy_bytes: u64,
    /// From the source leaving RUNNING until the destination had the STOP_COPY data
    /// loaded (last RAM pass, STOP_COPY read and written, RESUMING → STOP).
    pub stop_copy_time: Duration,
    /// The downtime proxy: from the source leaving RUNNING to the destination RUNNING.
    pub downtime: Duration,
    /// From [`Migration::start`] to the destination RUNNING.
    pub total: Duration,
}

impl fmt::Display for MigrationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "PRE_COPY {}; first RAM copy {} pages",
            if self.pre_copy { "on" } else { "off" },
            self.initial_ram_pages
        )?;
        for (i, r) in self.rounds.iter().enumerate() {
            writeln!(
                f,
                "round {i}: device {} bytes, RAM {} pages, {:.2} ms",
                r.device_bytes,
                r.ram_pages,
                ms(r.time)
            )?;
        }
        write!(
            f,
            "STOP_COPY {} bytes, RAM {} pages, {:.2} ms; downtime {:.2} ms",
            self.stop_copy_bytes,
            self.stop_copy_ram_pages,
            ms(self.stop_copy_time),
            ms(self.downtime)
        )
    }
}

/// Milliseconds, fractional.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Which VMM a failed step was talking to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The source VMM (its server and device).
    Source,
    /// The destination VMM.
    Destination,
}

impl fmt::Display for Side {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Side::Source => "source",
            Side::Destination => "destination",
        })
    }
}

/// Why a migration failed. Every variant but [`MigrateError::RollbackFailed`] leaves the
/// source RUNNING (see the module doc).
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// A device that does not migrate (MIGRATION is `ENOTSUP`).
    #[error("the {0} device does not migrate")]
    NotMigrating(Side, #[source] io::Error),
    /// The two VMMs' guest RAM differ (or one has none).
    #[error("guest RAM differs: source {src}, destination {dst}")]
    RamMismatch {
        /// The source's RAM (`base+size`, or "none").
        src: String,
        /// The destination's.
        dst: String,
    },
    /// A message to one side failed (its errno is in the source error).
    #[error("{side}: {step}")]
    Step {
        /// Which side.
        side: Side,
        /// What the driver was doing.
        step: &'static str,
        /// The reply's error.
        #[source]
        source: io::Error,
    },
    /// Copying guest RAM between the two VMMs' memory failed.
    #[error("copying guest RAM")]
    Ram(#[source] io::Error),
    /// The guest program (a [`migrate`] callback) failed; the migration was aborted.
    #[error("the guest program failed during the migration")]
    Guest(#[source] io::Error),
    /// A step called out of order (after the end or an abort, or twice).
    #[error("migration step {0} out of order")]
    OutOfOrder(&'static str),
    /// The migration failed and the source could not be put back to RUNNING either.
    #[error("could not put the source back to RUNNING after: {cause}")]
    RollbackFailed {
        /// The first failure.
        cause: Box<MigrateError>,
        /// Why the source stayed stopped.
        #[source]
        rollback: io::Error,
    },
}

impl MigrateError {
    /// Whether the source device runs after this error (all but `RollbackFailed`).
    pub fn source_running(&self) -> bool {
        !matches!(self, MigrateError::RollbackFailed { .. })
    }

    /// The side whose reply failed (a device that does not migrate, a failed step), if one
    /// did.
    pub fn side(&self) -> Option<Side> {
        match self {
            MigrateError::NotMigrating(side, _) | MigrateError::Step { side, .. } => Some(*side),
            MigrateError::RollbackFailed { cause, .. } => cause.side(),
            _ => None,
        }
    }

    /// The errno of the reply that failed, if a reply failed.
    pub fn errno(&self) -> Option<i32> {
        match self {
            MigrateError::NotMigrating(_, e)
            | MigrateError::Step { source: e, .. }
            | MigrateError::Ram(e)
            | MigrateError::Guest(e) => e.raw_os_error(),
            MigrateError::RollbackFailed { cause, .. } => cause.errno(),
            _ => None,
        }
    }
}

fn step(side: Side, step: &'static str) -> impl FnOnce(io::Error) -> MigrateError {
    move |source| MigrateError::Step { side, step, source }
}

/// Where a [`Migration`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The guest runs on the source; rounds may follow.
    Iterating,
    /// The source stopped, the destination loaded; waiting for `resume_destination`.
    Loaded,
    /// Over (done or aborted).
    Over,
}

/// A migration in progress (see the module doc for the steps). Every step takes the same
/// two VMMs.
#[derive(Debug)]
pub struct Migration {
    opts: MigrateOptions,
    src_ram: GuestMemory,
    dst_ram: GuestMemory,
    phase: Phase,
    report: MigrationReport,
    began: Instant,
    stopped_at: Option<Instant>,
}

fn ram_text(v: &Vmm) -> String {
    v.ram_opt().map_or_else(
        || "none".to_string(),
        |r| format!("{:#x}+{:#x}", r.base(), r.size()),
    )
}

impl Migration {
    /// Step 1: logging on, the destination RESUMING, the source in PRE_COPY (if used), all
    /// guest RAM copied. On failure nothing is left started (the source runs).
    pub fn start(
        src: &mut Vmm,
        dst: &mut Vmm,
        opts: &MigrateOptions,
    ) -> Result<Migration, MigrateError> {
        let began = Instant::now();
        let (src_ram, dst_ram) = match (src.ram_opt(), dst.ram_opt()) {
            (Some(s), Some(d)) if s.base() == d.base() && s.size() == d.size() => {
                (s.clone(), d.clone())
            }
            _ => {
                return Err(MigrateError::RamMismatch {
                    src: ram_text(src),
                    dst: ram_text(dst),
                })
            }
        };
        let flags = src
            .migration_flags()
            .map_err(|e| MigrateError::NotMigrating(Side::Source, e))?;
        dst.migration_flags()
            .map_err(|e| MigrateError::NotMigrating(Side::Destination, e))?;
        let pre_copy = opts.pre_copy && flags & u64::from(VFIO_MIGRATION_PRE_COPY) != 0;
        let mut m = Migration {
            opts: opts.clone(),
            src_ram,
            dst_ram,
            phase: Phase::Iterating,
            report: MigrationReport {
                pre_copy,
                ..MigrationReport::default()
            },
            began,
            stopped_at: None,
        };
        let (base, size) = (m.src_ram.base(), m.src_ram.size() as u64);
        src.dirty_start(MIGRATION_PAGE, &[(base, size)])
            .map_err(step(Side::Source, "DMA_LOGGING_START"))?;
        m.src_ram.cpu_dirty_start();
        let r = (|| {
            dst.set_mig_state(MigState::Resuming)
                .map_err(step(Side::Destination, "RUNNING -> RESUMING"))?;
            if pre_copy {
                src.set_mig_state(MigState::PreCopy)
                    .map_err(step(Side::Source, "RUNNING -> PRE_COPY"))?;
                // Nothing is read yet: the first round's first read carries the stream's
                // start and the device's first chunk.
            }
            m.report.initial_ram_pages = m.copy_all()?;
            Ok(())
        })();
        match r {
            Ok(()) => Ok(m),
            Err(e) => Err(m.abort_with(src, dst, e)),
        }
    }

    /// Step 2: one round while the guest runs (call it after the guest ran a while): the
    /// RAM dirtied since the last pass, then one PRE_COPY round (when used), written to the
    /// destination. Aborts on failure.
    pub fn round(&mut self, src: &mut Vmm, dst: &mut Vmm) -> Result<&RoundReport, MigrateError> {
        if self.phase != Phase::Iterating {
            return Err(MigrateError::OutOfOrder("round"));
        }
        let t = Instant::now();
        let r = (|| {
            let ram_pages = self.copy_dirty(src)?;
            let mut device_bytes = 0;
            if self.report.pre_copy {
                let data = src
                    .mig_read_all()
                    .map_err(step(Side::Source, "MIG_DATA_READ (PRE_COPY)"))?;
                dst.mig_write_all(&data)
                    .map_err(step(Side::Destination, "MIG_DATA_WRITE (PRE_COPY)"))?;
                device_bytes = data.len() as u64;
            }
            Ok(RoundReport {
                device_bytes,
                ram_pages,
                time: t.elapsed(),
            })
        })();
        match r {
            Ok(round) => {
                self.report.rounds.push(round);
                Ok(self.report.rounds.last().expect("just pushed"))
            }
            Err(e) => Err(self.abort_with(src, dst, e)),
        }
    }

    /// Whether the options say to stop iterating: `max_rounds` done, or the last round
    /// moved at most `small_round_bytes`.
    pub fn converged(&self) -> bool {
        self.report.rounds.len() >= self.opts.max_rounds
            || self
                .report
                .rounds
                .last()
                .is_some_and(|r| r.bytes() <= self.opts.small_round_bytes)
    }

    /// The report so far.
    pub fn report(&self) -> &MigrationReport {
        &self.report
    }

    /// Step 3: the source leaves RUNNING (the guest must not run from now on), the last RAM
    /// pass, logging stopped, STOP_COPY read and written, the destination loads the stream
    /// (RESUMING → STOP). Aborts on failure: the source runs again.
    pub fn stop_copy(&mut self, src: &mut Vmm, dst: &mut Vmm) -> Result<(), MigrateError> {
        if self.phase != Phase::Iterating {
            return Err(MigrateError::OutOfOrder("stop_copy"));
        }
        let t = Instant::now();
        self.stopped_at = Some(t);
        let r = (|| {
            src.set_mig_state(MigState::StopCopy)
                .map_err(step(Side::Source, "-> STOP_COPY"))?;
            self.report.stop_copy_ram_pages = self.copy_dirty(src)?;
            src.dirty_stop()
                .map_err(step(Side::Source, "DMA_LOGGING_STOP"))?;
            self.src_ram.cpu_dirty_stop();
            let data = src
                .mig_read_all()
                .map_err(step(Side::Source, "MIG_DATA_READ (STOP_COPY)"))?;
            dst.mig_write_all(&data)
                .map_err(step(Side::Destination, "MIG_DATA_WRITE (STOP_COPY)"))?;
            self.report.stop_copy_bytes = data.len() as u64;
            dst.set_mig_state(MigState::Stop)
                .map_err(step(Side::Destination, "RESUMING -> STOP (load)"))?;
            self.report.stop_copy_time = t.elapsed();
            Ok(())
        })();
        match r {
            Ok(()) => {
                self.phase = Phase::Loaded;
                Ok(())
            }
            Err(e) => Err(self.abort_with(src, dst, e)),
        }
    }

    /// Step 5: the destination RUNNING (re-attach interrupts before this), the source left
    /// in STOP; the report. Aborts if the destination cannot run.
    pub fn resume_destination(
        mut self,
        src: &mut Vmm,
        dst: &mut Vmm,
    ) -> Result<MigrationReport, MigrateError> {
        if self.phase != Phase::Loaded {
            return Err(MigrateError::OutOfOrder("resume_destination"));
        }
        if let Err(e) = dst.set_mig_state(MigState::Running) {
            let e = step(Side::Destination, "STOP -> RUNNING")(e);
            return Err(self.abort_with(src, dst, e));
        }
        let now = Instant::now();
        self.report.downtime = now - self.stopped_at.unwrap_or(now);
        self.report.total = now - self.began;
        self.phase = Phase::Over;
        // The destination runs: nothing is rolled back any more. The source ends its
        // saving session and stays stopped.
        if let Err(e) = src.set_mig_state(MigState::Stop) {
            tracing::warn!("migration: the source did not leave STOP_COPY: {e}");
        }
        Ok(std::mem::take(&mut self.report))
    }

    /// Give up: the source back to RUNNING, logging stopped, the destination reset (see
    /// the module doc). Also what every failing step does by itself. The error is why the
    /// source could not be put back.
    pub fn abort(mut self, src: &mut Vmm, dst: &mut Vmm) -> io::Result<()> {
        if self.phase == Phase::Over {
            return Ok(());
        }
        self.rollback(src, dst)
    }

    fn abort_with(&mut self, src: &mut Vmm, dst: &mut Vmm, cause: MigrateError) -> MigrateError {
        tracing::warn!("migration failed, aborting: {cause}");
        match self.rollback(src, dst) {
            Ok(()) => cause,
            Err(rollback) => MigrateError::RollbackFailed {
                cause: Box::new(cause),
                rollback,
            },
        }
    }

    fn rollback(&mut self, src: &mut Vmm, dst: &mut Vmm) -> io::Result<()> {
        self.phase = Phase::Over;
        self.src_ram.cpu_dirty_stop();
        // The destination first: a destination in RESUMING or ERROR is reset (best effort;
        // it may be gone).
        if let Err(e) = dst.reset() {
            tracing::warn!("migration abort: destination reset failed: {e}");
        }
        let running = src.set_mig_state(MigState::Running);
        if let Err(e) = src.dirty_stop() {
            tracing::warn!("migration abort: DMA_LOGGING_STOP failed: {e}");
        }
        running
    }

    /// Copy all guest RAM; the pages copied.
    fn copy_all(&mut self) -> Result<u64, MigrateError> {
        let pages = self.src_ram.size() as u64 / MIGRATION_PAGE;
        self.copy_pages(0, pages)?;
        Ok(pages)
    }

    /// Copy the pages dirtied since the last pass (the device's report ∪ the CPU log, both
    /// cleared as read, then the pages copied); the pages copied.
    fn copy_dirty(&mut self, src: &mut Vmm) -> Result<u64, MigrateError> {
        let (base, size) = (self.src_ram.base(), self.src_ram.size() as u64);
        let pages = size / MIGRATION_PAGE;
        let mut bits = self.src_ram.cpu_dirty_take();
        // One report per piece whose bitmap takes at most half the transfer size.
        let per_report = (u64::from(src.max_data_xfer_size()) / 2 * 8)
            .max(64)
            .min(pages.max(1));
        let mut first = 0;
        while first < pages {
            let n = per_report.min(pages - first);
            let words = src
                .dirty_report(
                    base + first * MIGRATION_PAGE,
                    n * MIGRATION_PAGE,
                    MIGRATION_PAGE,
                )
                .map_err(step(Side::Source, "DMA_LOGGING_REPORT"))?;
            for page in (0..n).filter(|p| words[(p / 64) as usize] >> (p % 64) & 1 != 0) {
                let at = first + page;
                if let Some(w) = bits.get_mut((at / 64) as usize) {
                    *w |= 1 << (at % 64);
                }
            }
            first += n;
        }
        // Copy runs of dirty pages.
        let mut copied = 0;
        let mut page = 0;
        let dirty = |p: u64| bits[(p / 64) as usize] >> (p % 64) & 1 != 0;
        while page < pages {
            if !dirty(page) {
                page += 1;
                continue;
            }
            let start = page;
            while page < pages && dirty(page) && page - start < 256 {
                page += 1;
            }
            self.copy_pages(start, page - start)?;
            copied += page - start;
        }
        Ok(copied)
    }

    /// Copy `count` pages from page `first` of the source RAM to the destination's.
    fn copy_pages(&self, first: u64, count: u64) -> Result<(), MigrateError> {
        const PIECE: u64 = 256;
        let mut buf = vec![0u8; (PIECE * MIGRATION_PAGE) as usize];
        let mut done = 0;
        while done < count {
            let n = PIECE.min(count - done);
            let gpa = self.src_ram.base() + (first + done) * MIGRATION_PAGE;
            let b = &mut buf[..(n * MIGRATION_PAGE) as usize];
            self.src_ram.read(gpa, b).map_err(MigrateError::Ram)?;
            self.dst_ram.write(gpa, b).map_err(MigrateError::Ram)?;
            done += n;
        }
        Ok(())
    }
}

/// All steps at once: start; while not [`Migration::converged`], let the guest run
/// (`guest(src, round)`) and do a round; one more guest turn (what it does after the last
/// round moves in STOP_COPY); stop_copy; `reattach(dst)` (the interrupt eventfds); resume
/// the destination. A failing callback aborts the migration ([`MigrateError::Guest`]).
pub fn migrate(
    src: &mut Vmm,
    dst: &mut Vmm,
    opts: &MigrateOptions,
    mut guest: impl FnMut(&mut Vmm, usize) -> io::Result<()>,
    reattach: impl FnOnce(&mut Vmm) -> io::Result<()>,
) -> Result<MigrationReport, MigrateError> {
    let mut m = Migration::start(src, dst, opts)?;
    let mut turn = 0;
    loop {
        if let Err(e) = guest(src, turn) {
            return Err(m.abort_with(src, dst, MigrateError::Guest(e)));
        }
        turn += 1;
        if m.converged() {
            break;
        }
        m.round(src, dst)?;
    }
    m.stop_copy(src, dst)?;
    if let Err(e) = reattach(dst) {
        return Err(m.abort_with(src, dst, MigrateError::Guest(e)));
    }
    m.resume_destination(src, dst)
}
