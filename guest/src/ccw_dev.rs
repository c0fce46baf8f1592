//! The ccw guest driver the scenarios share: the function bound to `uio_pci_generic`, BAR0,
//! one physically contiguous control area (operation block, status block, sense bytes,
//! channel program, IDAW lists), program submission and completion, and the checks of a
//! finished program against `protocol-docs/devices/ccw.md`.
//!
//! Every encoding comes from `umdev_devices::ccw::driver`; what is checked against (status
//! bits per fault, register values) is restated here from the doc, so a device that
//! disagrees with its own documentation fails.
//!
//! INTx accounting: every program the driver completes through [`Ccw::run`] waits for its
//! interrupt, acknowledges IRQ_STATUS (the device lowers its line) and then clears Interrupt
//! Disable, which the kernel's uio handler set (the order of a real driver: the line is low
//! before it is unmasked; the opposite order made no difference under QEMU 10.2 with TCG).
//! [`Ccw::programs`], [`Ccw::interrupts`] and [`Ccw::not_one`] let a scenario check one
//! interrupt per program.

use std::io;
use std::time::{Duration, Instant};

use umdev_devices::ccw::driver::{
    self, regs, CcwWord, Fault, OperationBlock, StatusBlock, STATUS_BLOCK_SIZE,
};
use umdev_devices::ccw::{PCI_DEVICE_ID, PCI_VENDOR_ID};

use crate::mem::DmaBuf;
use crate::pci::{command, Mmio, PciDev};
use crate::report::Report;
use crate::uio::Uio;

/// Control-area offsets (one 2 MiB huge page, so every structure may cross 4 KiB pages).
pub const OPB_OFF: usize = 0;
/// Status block.
pub const STATUS_OFF: usize = 0x40;
/// Where SENSE stores the sense bytes.
pub const SENSE_OFF: usize = 0x80;
/// The channel program (up to 1024 CCWs).
pub const PROG_OFF: usize = 0x1000;
/// IDAW lists, in slots of [`IDAW_SLOT`] bytes (256 entries).
pub const IDAW_OFF: usize = 0x8000;
/// Size of one IDAW-list slot.
pub const IDAW_SLOT: usize = 0x800;
/// What the status block area holds before a program (to tell "not stored").
pub const STATUS_FILL: u8 = 0xee;

/// Waiting for a completion gives up after this.
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(10);

/// (device status, channel status) of a program that ended with `f`, as the fault table of
/// `protocol-docs/devices/ccw.md` lists it.
pub fn documented_status(f: Fault) -> (u8, u8) {
    match f {
        Fault::None => (0x0c, 0),
        Fault::OutOfRange | Fault::ImageIo => (0x0e, 0),
        Fault::DataProtection => (0x0c, 0x10),
        Fault::PinFailed | Fault::Aborted | Fault::NotAttached => (0x0c, 0x04),
        Fault::IncorrectLength => (0x0c, 0x40),
        _ => (0x0c, 0x20),
    }
}

/// LAST_STATUS for (device status, channel status, fault code).
pub fn last_status(dstat: u8, cstat: u8, code: u16) -> u32 {
    u32::from(dstat) | u32::from(cstat) << 8 | u32::from(code) << 16
}

/// What a finished program left behind.
#[derive(Debug)]
pub struct Done {
    /// The status block area, decoded.
    pub status: StatusBlock,
    /// The status block area changed (it was filled with [`STATUS_FILL`] before START).
    pub stored: bool,
    /// LAST_STATUS.
    pub last: u32,
    /// IRQ_STATUS before the acknowledgement.
    pub irq_status: u32,
    /// COMPLETED after the program.
    pub completed: u32,
    /// COMPLETED before it (the program must add exactly one).
    pub completed_before: u32,
    /// uio interrupts counted for it.
    pub interrupts: u32,
}

impl std::fmt::Display for Done {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = &self.status;
        write!(
            f,
            "stored={} dstat={:#04x} cstat={:#04x} fault={} residual={} ccw={:#x} \
             transferred={} seq={} LAST_STATUS={:#010x} IRQ_STATUS={:#x} COMPLETED {}->{} \
             irqs={}",
            self.stored,
            s.device_status,
            s.channel_status,
            s.fault,
            s.residual,
            s.ccw_addr,
            s.transferred,
            s.sequence,
            self.last,
            self.irq_status,
            self.completed_before,
            self.completed,
            self.interrupts
        )
    }
}

/// The ccw function, driven through uio.
pub struct Ccw {
    /// Check-name prefix (the scenario).
    pub p: &'static str,
    /// The PCI function.
    pub dev: PciDev,
    /// Its uio device (INTx).
    pub uio: Uio,
    /// BAR0.
    pub bar: Mmio,
    /// Control area (contiguous).
    pub ctl: DmaBuf,
    /// Capacity in 512-byte blocks.
    pub capacity: u64,
    /// Last COMPLETED value seen.
    pub completed: u32,
    /// Programs completed through [`Ccw::run`].
    pub programs: u32,
    /// uio interrupts counted by [`Ccw::run`].
    pub interrupts: u32,
    /// Programs of [`Ccw::run`] not answered by exactly one interrupt.
    pub not_one: u32,
}

impl Ccw {
    /// Check name `<prefix>.<what>`.
    pub fn n(&self, what: &str) -> String {
        format!("{}.{what}", self.p)
    }

    /// Find 1234:0cc1, bind uio_pci_generic, enable memory and Bus Master (INTx enabled),
    /// map BAR0, check the ID, allocate the control area and point OPB_ADDR at it.
    pub fn open(r: &mut Report, p: &'static str) -> Option<Ccw> {
        let n = |w: &str| format!("{p}.{w}");
        let dev = r.ok(&n("find"), PciDev::find(PCI_VENDOR_ID, PCI_DEVICE_ID))?;
        let uio = r.ok(&n("uio_bind"), Uio::bind(&dev))?;
        r.ok(
            &n("enable"),
            dev.update_command(command::MEMORY | command::BUS_MASTER, command::INTX_DISABLE),
        )?;
        let bar = r.ok(&n("bar0"), dev.bar(0))?;
        let id = r.ok(&n("id_read"), bar.read32(regs::ID))?;
        if !r.check(&n("id"), id == regs::MAGIC, format_args!("{id:#x}")) {
            return None;
        }
        let regs3 = (|| {
            Ok::<_, io::Error>((
                bar.read32(regs::CAPACITY_LO)?,
                bar.read32(regs::CAPACITY_HI)?,
                bar.read32(regs::COMPLETED)?,
            ))
        })();
        let (lo, hi, completed) = r.ok(&n("regs_read"), regs3)?;
        let ctl = r.ok(&n("alloc_control"), DmaBuf::contiguous(2 << 20))?;
        let opb = ctl.addr_of(OPB_OFF);
        r.ok(
            &n("opb_addr"),
            bar.write32(regs::OPB_ADDR_LO, opb as u32)
                .and_then(|_| bar.write32(regs::OPB_ADDR_HI, (opb >> 32) as u32)),
        )?;
        Some(Ccw {
            p,
            dev,
            uio,
            bar,
            ctl,
            capacity: u64::from(lo) | u64::from(hi) << 32,
            completed,
            programs: 0,
            interrupts: 0,
            not_one: 0,
        })
    }

    /// Device address of a control-area offset.
    pub fn at(&self, off: usize) -> u64 {
        self.ctl.addr_of(off)
    }

    /// Address of the first CCW (what a failing first CCW's status names).
    pub fn prog(&self) -> u64 {
        self.at(PROG_OFF)
    }

    /// Address of CCW `i` of the program.
    pub fn ccw(&self, i: usize) -> u64 {
        self.at(PROG_OFF + i * 16)
    }

    /// Store an IDAW list in slot `slot`; returns its address.
    pub fn put_idaws(&self, slot: usize, idaws: &[u64]) -> io::Result<u64> {
        let bytes = driver::encode_idaws(idaws);
        if bytes.len() > IDAW_SLOT {
            return Err(io::Error::other("IDAW list longer than a slot"));
        }
        let off = IDAW_OFF + slot * IDAW_SLOT;
        self.ctl.write_at(off, &bytes)?;
        Ok(self.at(off))
    }

    /// Write the program and the operation block, clear the status block area and START.
    pub fn submit(&mut self, words: &[CcwWord], block: u64, flags: u32) -> io::Result<()> {
        let prog = driver::encode_program(words);
        if prog.len() > IDAW_OFF - PROG_OFF {
            return Err(io::Error::other("program longer than its area"));
        }
        self.ctl.write_at(PROG_OFF, &prog)?;
        let opb = OperationBlock {
            program: self.prog(),
            block,
            status: self.at(STATUS_OFF),
            flags,
            reserved: 0,
        };
        self.ctl.write_at(OPB_OFF, &opb.to_bytes())?;
        self.ctl.fill(STATUS_OFF, STATUS_BLOCK_SIZE, STATUS_FILL)?;
        self.bar.write32(regs::START, 1)
    }

    /// Poll COMPLETED until it moves past the last value seen (up to `timeout`).
    pub fn poll_completed(&self, timeout: Duration) -> io::Result<Option<u32>> {
        let deadline = Instant::now() + timeout;
        loop {
            let c = self.bar.read32(regs::COMPLETED)?;
            if c != self.completed {
                return Ok(Some(c));
            }
            if Instant::now() > deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Read what the finished program left (status block, LAST_STATUS, IRQ_STATUS) without
    /// acknowledging anything.
    pub fn collect(&mut self, completed: u32, interrupts: u32) -> io::Result<Done> {
        let mut b = [0u8; STATUS_BLOCK_SIZE];
        self.ctl.read_at(STATUS_OFF, &mut b)?;
        let done = Done {
            status: StatusBlock::from_bytes(&b),
            stored: b.iter().any(|&x| x != STATUS_FILL),
            last: self.bar.read32(regs::LAST_STATUS)?,
            irq_status: self.bar.read32(regs::IRQ_STATUS)?,
            completed,
            completed_before: self.completed,
            interrupts,
        };
        self.completed = completed;
        Ok(done)
    }

    /// Acknowledge IRQ_STATUS, then clear Interrupt Disable.
    pub fn ack(&self) -> io::Result<()> {
        self.bar.write32(regs::IRQ_STATUS, regs::IRQ_ALL)?;
        Uio::reenable(&self.dev)
    }

    /// Wait for the running program: its interrupt (up to 10 s), then COMPLETED (in case
    /// the interrupt never came); collect, acknowledge and re-enable INTx.
    pub fn wait_done(&mut self, t0: Instant) -> io::Result<Done> {
        let irqs = self.uio.wait(COMPLETION_TIMEOUT)?;
        let completed = match self.poll_completed(COMPLETION_TIMEOUT)? {
            Some(c) => c,
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no completion after {:?} ({irqs} interrupts)", t0.elapsed()),
                ))
            }
        };
        let done = self.collect(completed, irqs)?;
        self.ack()?;
        self.programs += 1;
        self.interrupts += irqs;
        if irqs != 1 {
            self.not_one += 1;
        }
        Ok(done)
    }

    /// Submit a program and wait for it.
    pub fn run(&mut self, words: &[CcwWord], block: u64) -> io::Result<Done> {
        let t0 = Instant::now();
        self.submit(words, block, 0)?;
        self.wait_done(t0)
    }

    /// Run a program as check `name`; `None` (reported) if it could not be run at all.
    pub fn run_checked(
        &mut self,
        r: &mut Report,
        name: &str,
        words: &[CcwWord],
        block: u64,
    ) -> Option<Done> {
        let res = self.run(words, block);
        match res {
            Ok(d) => Some(d),
            Err(e) => {
                r.check(
                    &self.n(name),
                    false,
                    format_args!("program did not complete: {e}"),
                );
                None
            }
        }
    }

    /// Check a successful program: stored status 0x0c/0/0, residual 0, `transferred`
    /// bytes, sequence = COMPLETED = previous + 1, LAST_STATUS 0x0c, IRQ_STATUS DONE.
    pub fn expect_ok(&self, r: &mut Report, name: &str, d: &Done, transferred: u64) -> bool {
        let s = &d.status;
        let ok = d.stored
            && s.device_status == 0x0c
            && s.channel_status == 0
            && s.fault == 0
            && s.residual == 0
            && s.transferred == transferred
            && s.sequence == d.completed
            && d.completed == d.completed_before.wrapping_add(1)
            && d.last == last_status(0x0c, 0, 0)
            && d.irq_status == regs::IRQ_DONE;
        r.check(
            &self.n(name),
            ok,
            format_args!("{d} (want success, {transferred} bytes)"),
        )
    }

    /// Check a program that failed with `fault` at CCW `ccw` with residual `residual`,
    /// nothing transferred: once in the stored status block, once in LAST_STATUS (and
    /// IRQ_STATUS DONE, COMPLETED + 1).
    pub fn expect_fault(
        &self,
        r: &mut Report,
        name: &str,
        d: &Done,
        fault: Fault,
        ccw: u64,
        residual: u16,
    ) -> bool {
        let (ds, cs) = documented_status(fault);
        let s = &d.status;
        let block_ok = d.stored
            && s.device_status == ds
            && s.channel_status == cs
            && s.fault == fault.code()
            && s.ccw_addr == ccw
            && s.residual == residual
            && s.transferred == 0
            && s.sequence == d.completed;
        let a = r.check(
            &self.n(&format!("{name}.status_block")),
            block_ok,
            format_args!(
                "{d} (want {fault:?}: dstat {ds:#04x} cstat {cs:#04x} fault {} ccw {ccw:#x} \
                 residual {residual}, nothing transferred)",
                fault.code()
            ),
        );
        let want = last_status(ds, cs, fault.code());
        let reg_ok = d.last == want
            && d.irq_status == regs::IRQ_DONE
            && d.completed == d.completed_before.wrapping_add(1);
        let b = r.check(
            &self.n(&format!("{name}.last_status")),
            reg_ok,
            format_args!(
                "LAST_STATUS {:#010x} want {want:#010x}, IRQ_STATUS {:#x}, COMPLETED {}->{}",
                d.last, d.irq_status, d.completed_before, d.completed
            ),
        );
        a && b
    }

    /// Run a program that must fail with `fault` at `ccw` with residual `residual`, check
    /// its status block and LAST_STATUS, then check that the device still runs a NOP.
    #[allow(clippy::too_many_arguments)]
    pub fn fault_case(
        &mut self,
        r: &mut Report,
        name: &str,
        words: &[CcwWord],
        block: u64,
        fault: Fault,
        ccw: u64,
        residual: u16,
    ) -> Option<Done> {
        let d = self.run_checked(r, name, words, block)?;
        self.expect_fault(r, name, &d, fault, ccw, residual);
        self.expect_nop_ok(r, &format!("{name}.then_nop"));
        Some(d)
    }

    /// A NOP program succeeds (the device works).
    pub fn expect_nop_ok(&mut self, r: &mut Report, name: &str) -> bool {
        match self.run_checked(r, name, &[CcwWord::nop()], 0) {
            Some(d) => self.expect_ok(r, name, &d, 0),
            None => false,
        }
    }

    /// After the last program: no interrupt is left over, and every program of
    /// [`Ccw::run`] got exactly one.
    pub fn expect_one_irq_each(&mut self, r: &mut Report) -> bool {
        let late = self
            .uio
            .wait(Duration::from_millis(500))
            .unwrap_or(u32::MAX);
        let total = self.interrupts.saturating_add(late);
        r.check(
            &self.n("intx_one_per_program"),
            self.not_one == 0 && late == 0 && total == self.programs,
            format_args!(
                "{total} uio interrupts for {} programs ({} not answered by exactly one, \
                 {late} late)",
                self.programs, self.not_one
            ),
        )
    }
}
