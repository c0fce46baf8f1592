//! ccw scenarios (devices/src/ccw, protocol-docs/devices/ccw.md): the guest drives
//! `umdev run ccw --image-size-mib 16` through uio_pci_generic with the device crate's own
//! encoders (`umdev_devices::ccw::driver`); the driver part they share is in `ccw_dev.rs`.
//!
//! Image layout (512-byte blocks), each region holding `driver::pattern` of its seed and
//! announced with `UMDEV-IMAGE` so the host checks the file after the server stopped:
//!
//! | blocks | what |
//! |---|---|
//! | 64..192 | direct WRITE from contiguous memory |
//! | 1000.. | IDAW WRITE from scattered pages, first IDAW mid-page (~20 KiB) |
//! | 8192..16384 | throughput: 4 MiB through IDAW programs |
//! | 20000..20032 | ccw-bme: 8 KiB written with Bus Master set, 8 KiB older data |
//! | last | the block an OutOfRange chain must leave alone |

#[path = "ccw_dev.rs"]
mod dev;

use std::time::{Duration, Instant};

use umdev_devices::ccw::driver::{pattern, regs, CcwWord, Fault, BLOCK_SIZE};

use crate::mem::{DmaBuf, PAGE};
use crate::pci::{command, STATUS_INTERRUPT};
use crate::report::Report;
use dev::{
    expect_pattern, expect_untouched, last_status, physical_breaks, Ccw, Done, Scatter, SENSE_OFF,
};

/// The harness starts the server with `--image-size-mib 16`.
const IMAGE_BLOCKS: u64 = (16 << 20) / BLOCK_SIZE;

const DIRECT_BLOCK: u64 = 64;
const DIRECT_LEN: usize = 65536;
const SEED_DIRECT: u64 = 0xd1;

const IDAW_BLOCK: u64 = 1000;
const SEED_IDAW: u64 = 0x1da;

const SEED_LAST: u64 = 0x1a57;
const SEED_REJECTED: u64 = 0xbad;

const THRU_BLOCK: u64 = 8192;
const THRU_PROGRAM: usize = 1 << 20;
const THRU_PROGRAMS: usize = 4;
/// One IDA CCW of a throughput program: 8 pages (the count is 16 bits).
const THRU_CCW_PAGES: usize = 8;
const SEED_THRU: u64 = 0x7e57;

const BME_BLOCK: u64 = 20000;
const SEED_BME_OLD: u64 = 0x01d;
const SEED_BME_NEW: u64 = 0x4e3;
/// Fault BusMasterOff of protocol-docs/devices/ccw.md on branch bme-intx (not in this
/// branch's `Fault` yet).
const FAULT_BUS_MASTER_OFF: u16 = 27;

/// Far beyond the guest's 512 MiB of RAM: no DMA mapping covers it.
const BEYOND_RAM: u64 = 64 << 30;

/// Direct and IDAW-scattered writes and reads, data in the image, bad programs, INTx,
/// throughput.
pub fn run(r: &mut Report) -> Option<()> {
    let mut c = Ccw::open(r, "ccw")?;
    registers(r, &c)?;
    let direct = r.ok("ccw.alloc_contiguous", DmaBuf::contiguous(2 << 20))?;
    direct_io(r, &mut c, &direct)?;
    let data = r.ok("ccw.alloc_scattered", DmaBuf::new(32))?;
    r.note(format_args!(
        "32 scattered pages: {} physical breaks",
        physical_breaks(&data)
    ));
    idaw_io(r, &mut c, &data, &direct)?;
    bad_programs(r, &mut c, &direct, &data)?;
    throughput(r, &mut c)?;
    c.expect_one_irq_each(r);
    Some(())
}

fn registers(r: &mut Report, c: &Ccw) -> Option<()> {
    let read = |off| c.bar.read32(off);
    let vals = (|| {
        Ok::<_, std::io::Error>((
            read(regs::VERSION)?,
            read(regs::BLOCK_SIZE_REG)?,
            read(regs::MAX_CCWS)?,
        ))
    })();
    let (version, block, max_ccws) = r.ok("ccw.regs", vals)?;
    r.check(
        "ccw.version",
        version == regs::VERSION_VALUE,
        format_args!("{version:#x}"),
    );
    r.check("ccw.block_size", block == 512, format_args!("{block}"));
    r.check(
        "ccw.capacity",
        c.capacity == IMAGE_BLOCKS,
        format_args!("{} blocks, want {IMAGE_BLOCKS}", c.capacity),
    );
    // The throughput programs chain THRU_PROGRAM / (THRU_CCW_PAGES pages) CCWs.
    let needed = (THRU_PROGRAM / (THRU_CCW_PAGES * PAGE)) as u32;
    r.check(
        "ccw.max_ccws",
        max_ccws >= needed,
        format_args!("{max_ccws} (need {needed})"),
    )
    .then_some(())
}

/// Direct WRITE from physically contiguous memory (two CCWs chained with CD, crossing
/// pages), READ back the same way into another place.
fn direct_io(r: &mut Report, c: &mut Ccw, direct: &DmaBuf) -> Option<()> {
    let pos = DIRECT_BLOCK * BLOCK_SIZE;
    let mut data = vec![0u8; DIRECT_LEN];
    pattern::fill(SEED_DIRECT, pos, &mut data);
    let src = 0x1234;
    r.ok("ccw.direct_fill", direct.write_at(src, &data))?;
    let a = direct.addr_of(src);
    let split = 40000u16;
    let rest = (DIRECT_LEN - usize::from(split)) as u16;
    let words = [
        CcwWord::write(split, a).chain_data(),
        CcwWord::write(rest, a + u64::from(split)),
    ];
    let d = c.run_checked(r, "direct_write", &words, DIRECT_BLOCK)?;
    c.expect_ok(r, "direct_write", &d, DIRECT_LEN as u64);
    r.image("direct", pos, DIRECT_LEN as u64, SEED_DIRECT);

    let dst = 0x10_0077;
    r.ok("ccw.direct_clear", direct.fill(dst, DIRECT_LEN, 0))?;
    let b = direct.addr_of(dst);
    let split = 30000u16;
    let rest = (DIRECT_LEN - usize::from(split)) as u16;
    let words = [
        CcwWord::read(split, b).chain_data(),
        CcwWord::read(rest, b + u64::from(split)),
    ];
    let d = c.run_checked(r, "direct_read", &words, DIRECT_BLOCK)?;
    c.expect_ok(r, "direct_read", &d, DIRECT_LEN as u64);
    let mut back = vec![0u8; DIRECT_LEN];
    r.ok("ccw.direct_back", direct.read_at(dst, &mut back))?;
    expect_pattern(r, "ccw.direct_readback", &back, SEED_DIRECT, pos);
    Some(())
}

/// IDAW WRITE from scattered pages in shuffled order with the first IDAW mid-page; READ back
/// into other pages (another order, another mid-page start) and check nothing around the
/// pieces was touched; READ the direct region through a direct + IDA chain.
fn idaw_io(r: &mut Report, c: &mut Ccw, data: &DmaBuf, direct: &DmaBuf) -> Option<()> {
    let pos = IDAW_BLOCK * BLOCK_SIZE;
    let len = (PAGE - 0x300) + 4 * PAGE + 0x234;
    let w = Scatter {
        buf: data,
        pages: vec![5, 2, 11, 0, 7, 9],
        first_off: 0x300,
        len,
    };
    r.ok("ccw.idaw_fill", w.fill_pattern(SEED_IDAW, pos))?;
    let idaws = r.ok("ccw.idaw_list", w.idaws())?;
    let list = r.ok("ccw.idaw_put", c.put_idaws(0, &idaws))?;
    let words = [CcwWord::write(len as u16, list).ida(idaws.len() as u32)];
    let d = c.run_checked(r, "idaw_write", &words, IDAW_BLOCK)?;
    c.expect_ok(r, "idaw_write", &d, len as u64);
    r.image("idaw", pos, len as u64, SEED_IDAW);

    // Pages 12..32 start as 0x5a; only the pieces of the READ may change.
    r.ok("ccw.idaw_clear", data.fill(12 * PAGE, 20 * PAGE, 0x5a))?;
    let rd = Scatter {
        buf: data,
        pages: vec![20, 14, 31, 17, 25, 12],
        first_off: 0x8a8,
        len,
    };
    let idaws = r.ok("ccw.idaw_read_list", rd.idaws())?;
    let list = r.ok("ccw.idaw_read_put", c.put_idaws(1, &idaws))?;
    let words = [CcwWord::read(len as u16, list).ida(idaws.len() as u32)];
    let d = c.run_checked(r, "idaw_read", &words, IDAW_BLOCK)?;
    c.expect_ok(r, "idaw_read", &d, len as u64);
    let back = r.ok("ccw.idaw_back", rd.read())?;
    expect_pattern(r, "ccw.idaw_readback", &back, SEED_IDAW, pos);
    // Bytes of the READ's pages outside its pieces: before the first, after the last.
    let pieces = r.ok("ccw.idaw_pieces", rd.pieces())?;
    let mut before = vec![0u8; 0x8a8];
    let _ = data.read_at(20 * PAGE, &mut before);
    let (last_off, last_len) = pieces[pieces.len() - 1];
    let mut after = vec![0u8; (PAGE - (last_off + last_len) % PAGE) % PAGE];
    let _ = data.read_at(last_off + last_len, &mut after);
    before.extend_from_slice(&after);
    expect_untouched(r, "ccw.idaw_read_no_overrun", &before, 0x5a);

    // The direct region again: 1000 bytes direct (CD) then the rest through IDAWs.
    let pos = DIRECT_BLOCK * BLOCK_SIZE;
    let head = 1000usize;
    let tail = Scatter {
        buf: data,
        pages: vec![30, 13, 24],
        first_off: 0x10,
        len: 3 * PAGE - 0x10 - 5,
    };
    let head_off = 0x1f_0000;
    r.ok("ccw.mixed_clear", direct.fill(head_off, head, 0))?;
    let idaws = r.ok("ccw.mixed_list", tail.idaws())?;
    let list = r.ok("ccw.mixed_put", c.put_idaws(2, &idaws))?;
    let words = [
        CcwWord::read(head as u16, direct.addr_of(head_off)).chain_data(),
        CcwWord::read(tail.len as u16, list).ida(idaws.len() as u32),
    ];
    let d = c.run_checked(r, "mixed_read", &words, DIRECT_BLOCK)?;
    c.expect_ok(r, "mixed_read", &d, (head + tail.len) as u64);
    let mut back = vec![0u8; head];
    let _ = direct.read_at(head_off, &mut back);
    back.extend(r.ok("ccw.mixed_back", tail.read())?);
    expect_pattern(r, "ccw.mixed_readback", &back, SEED_DIRECT, pos);
    Some(())
}

/// Run a program that must fail with `fault` at `ccw`, check status block and LAST_STATUS,
/// then check the device still runs a NOP.
#[allow(clippy::too_many_arguments)]
fn fault_case(
    r: &mut Report,
    c: &mut Ccw,
    name: &str,
    words: &[CcwWord],
    block: u64,
    fault: Fault,
    ccw: u64,
    residual: u16,
) -> Option<Done> {
    let d = c.run_checked(r, name, words, block)?;
    c.expect_fault(r, name, &d, fault, ccw, residual);
    c.expect_nop_ok(r, &format!("{name}.then_nop"));
    Some(d)
}

fn bad_programs(r: &mut Report, c: &mut Ccw, direct: &DmaBuf, data: &DmaBuf) -> Option<()> {
    let da = direct.addr_of(0);
    let prog = c.prog();

    let words = [CcwWord::new(0x55, 512, da)];
    fault_case(
        r,
        c,
        "invalid_command",
        &words,
        0,
        Fault::InvalidCommand,
        prog,
        512,
    )?;

    let list = r.ok(
        "ccw.unaligned_put",
        c.put_idaws(3, &[data.addr(0), data.addr(1) + 8]),
    )?;
    let words = [CcwWord::write(8192, list).ida(2)];
    fault_case(
        r,
        c,
        "idaw_unaligned",
        &words,
        0,
        Fault::IdawUnaligned,
        prog,
        8192,
    )?;

    let list = r.ok(
        "ccw.short_put",
        c.put_idaws(3, &[data.addr(0), data.addr(1)]),
    )?;
    let words = [CcwWord::read(3 * 4096, list).ida(2)];
    let f = Fault::CountPastIdawList;
    fault_case(r, c, "count_past_idaw_list", &words, 0, f, prog, 3 * 4096)?;

    // The second CCW's data is beyond guest RAM: found when pinning, nothing runs.
    let words = [CcwWord::nop().chain(), CcwWord::write(4096, BEYOND_RAM)];
    let (f, at) = (Fault::DataAddressInvalid, c.ccw(1));
    fault_case(r, c, "data_beyond_ram", &words, 0, f, at, 4096)?;

    // OutOfRange: 1024 bytes from the last block; then SENSE shows why.
    let last = c.capacity - 1;
    let words = [CcwWord::write(1024, da)];
    fault_case(
        r,
        c,
        "out_of_range",
        &words,
        last,
        Fault::OutOfRange,
        prog,
        1024,
    )?;
    sense_after_unit_check(r, c, last * BLOCK_SIZE)?;

    // OutOfRange in the second CCW of a chain: the first (in range) must not move either.
    let pos = last * BLOCK_SIZE;
    let mut block = vec![0u8; 512];
    pattern::fill(SEED_LAST, pos, &mut block);
    r.ok("ccw.last_fill", direct.write_at(0, &block))?;
    let d = c.run_checked(r, "last_write", &[CcwWord::write(512, da)], last)?;
    c.expect_ok(r, "last_write", &d, 512);
    r.image("last_block", pos, 512, SEED_LAST);
    let mut two = vec![0u8; 1024];
    pattern::fill(SEED_REJECTED, pos, &mut two);
    r.ok("ccw.rejected_fill", direct.write_at(0x2000, &two))?;
    let words = [
        CcwWord::write(512, da + 0x2000).chain(),
        CcwWord::write(512, da + 0x2200),
    ];
    let (f, at) = (Fault::OutOfRange, c.ccw(1));
    fault_case(r, c, "out_of_range_chain", &words, last, f, at, 512)?;
    r.ok("ccw.last_clear", direct.fill(0x3000, 512, 0))?;
    let d = c.run_checked(r, "last_read", &[CcwWord::read(512, da + 0x3000)], last)?;
    c.expect_ok(r, "last_read", &d, 512);
    let _ = direct.read_at(0x3000, &mut block);
    expect_pattern(r, "ccw.out_of_range_moved_nothing", &block, SEED_LAST, pos);
    Some(())
}

/// SENSE after an OutOfRange from image offset `offset`: command reject, the fault code,
/// the offset; a second SENSE finds the bytes cleared.
fn sense_after_unit_check(r: &mut Report, c: &mut Ccw, offset: u64) -> Option<()> {
    let mut want = [0u8; 32];
    want[0] = 0x80;
    want[1] = Fault::OutOfRange.code() as u8;
    want[8..16].copy_from_slice(&offset.to_le_bytes());
    for (name, want) in [("sense", want), ("sense_cleared", [0u8; 32])] {
        r.ok("ccw.sense_prepare", c.ctl.fill(SENSE_OFF, 32, 0xff))?;
        let words = [CcwWord::sense(32, c.at(SENSE_OFF))];
        let d = c.run_checked(r, name, &words, 0)?;
        c.expect_ok(r, name, &d, 32);
        let mut got = [0u8; 32];
        let _ = c.ctl.read_at(SENSE_OFF, &mut got);
        r.check(
            &format!("ccw.{name}_bytes"),
            got == want,
            format_args!("{got:02x?} want {want:02x?}"),
        );
    }
    Some(())
}

/// 4 MiB written and read back through IDAW programs of 1 MiB (32 CD-chained IDA CCWs of 8
/// scattered pages each); MB/s both ways; then the NOP round trip.
fn throughput(r: &mut Report, c: &mut Ccw) -> Option<()> {
    let pages_per = THRU_PROGRAM / PAGE;
    let buf = r.ok(
        "ccw.alloc_throughput",
        DmaBuf::new(THRU_PROGRAMS * pages_per),
    )?;
    r.note(format_args!(
        "{} throughput pages: {} physical breaks",
        buf.pages(),
        physical_breaks(&buf)
    ));
    let pos0 = THRU_BLOCK * BLOCK_SIZE;
    let total = THRU_PROGRAMS * THRU_PROGRAM;
    let mut data = vec![0u8; total];
    pattern::fill(SEED_THRU, pos0, &mut data);
    r.ok("ccw.throughput_fill", buf.write_at(0, &data))?;
    drop(data);
    let ccw_bytes = THRU_CCW_PAGES * PAGE;
    let ccws = THRU_PROGRAM / ccw_bytes;
    let mut programs = Vec::new();
    for k in 0..THRU_PROGRAMS {
        let addrs: Vec<u64> = (0..pages_per)
            .map(|i| buf.addr(k * pages_per + i))
            .collect();
        let list = r.ok("ccw.throughput_list", c.put_idaws(4 + k, &addrs))?;
        let mk = |read: bool| -> Vec<CcwWord> {
            (0..ccws)
                .map(|j| {
                    let at = list + (j * THRU_CCW_PAGES * 8) as u64;
                    let w = if read {
                        CcwWord::read(ccw_bytes as u16, at)
                    } else {
                        CcwWord::write(ccw_bytes as u16, at)
                    };
                    let w = w.ida(THRU_CCW_PAGES as u32);
                    if j + 1 < ccws {
                        w.chain_data()
                    } else {
                        w
                    }
                })
                .collect()
        };
        let block = THRU_BLOCK + (k * THRU_PROGRAM) as u64 / BLOCK_SIZE;
        programs.push((block, mk(false), mk(true)));
    }
    for read in [false, true] {
        let dir = if read { "read" } else { "write" };
        if read {
            r.ok("ccw.throughput_clear", buf.fill(0, total, 0))?;
        }
        let mut failed = Vec::new();
        let t0 = Instant::now();
        for (block, w, rd) in &programs {
            let d = c.run_checked(
                r,
                &format!("throughput_{dir}"),
                if read { rd } else { w },
                *block,
            )?;
            if !(d.status.is_ok() && d.status.transferred == THRU_PROGRAM as u64) {
                failed.push(d.to_string());
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        r.check(
            &format!("ccw.throughput_{dir}"),
            failed.is_empty(),
            format_args!(
                "{} programs of {THRU_PROGRAM} bytes in {secs:.3} s; failed: {failed:?}",
                programs.len()
            ),
        );
        r.measure(&format!("{dir}_mb_s"), total as f64 / secs / 1e6, "MB/s");
    }
    let mut back = vec![0u8; total];
    r.ok("ccw.throughput_back", buf.read_at(0, &mut back))?;
    expect_pattern(r, "ccw.throughput_readback", &back, SEED_THRU, pos0);
    r.image("throughput", pos0, total as u64, SEED_THRU);

    let n = 20;
    let t0 = Instant::now();
    for _ in 0..n {
        let d = c.run_checked(r, "nop_roundtrip", &[CcwWord::nop()], 0)?;
        if !d.status.is_ok() {
            c.expect_ok(r, "nop_roundtrip", &d, 0);
            return None;
        }
    }
    r.measure(
        "nop_roundtrip_us",
        t0.elapsed().as_secs_f64() * 1e6 / f64::from(n),
        "us",
    );
    Some(())
}

/// The PCI status register's Interrupt Status bit.
fn interrupt_status(r: &mut Report, c: &Ccw) -> Option<bool> {
    let st = r.ok(&c.n("status_read"), c.dev.status())?;
    Some(st & STATUS_INTERRUPT != 0)
}

/// A completion while Interrupt Disable is set: Interrupt Status reads 1, nothing is
/// delivered until the bit is cleared, then exactly one interrupt; acknowledged before
/// enabling: nothing at all.
pub fn run_intx(r: &mut Report) -> Option<()> {
    let mut c = Ccw::open(r, "ccw_intx")?;
    for acked_first in [false, true] {
        let case = if acked_first { "acked" } else { "held" };
        let n = |w: &str| format!("ccw_intx.{case}.{w}");
        r.ok(
            &n("disable"),
            c.dev.update_command(command::INTX_DISABLE, 0),
        )?;
        let t0 = Instant::now();
        r.ok(&n("submit"), c.submit(&[CcwWord::nop()], 0, 0))?;
        let completed = r.ok(&n("poll"), c.poll_completed(Duration::from_secs(10)))?;
        if !r.check(&n("completed"), completed.is_some(), "COMPLETED moved") {
            return None;
        }
        let d = r.ok(&n("collect"), c.collect(completed?, 0, t0.elapsed()))?;
        c.expect_ok(r, &format!("{case}.program"), &d, 0);
        let st = interrupt_status(r, &c)?;
        r.check(
            &n("interrupt_status_set"),
            st,
            format_args!("status bit 3 = {} with a completion pending", u8::from(st)),
        );
        let early = c.uio.wait(Duration::from_secs(1)).unwrap_or(u32::MAX);
        r.check(
            &n("nothing_while_disabled"),
            early == 0,
            format_args!("{early} interrupts with Interrupt Disable set"),
        );
        if acked_first {
            r.ok(&n("ack"), c.bar.write32(regs::IRQ_STATUS, regs::IRQ_ALL))?;
            let st = interrupt_status(r, &c)?;
            r.check(
                &n("line_lowered"),
                !st,
                format_args!("status bit 3 = {} after the ack", u8::from(st)),
            );
        }
        r.ok(&n("enable"), crate::uio::Uio::reenable(&c.dev))?;
        let got = c.uio.wait(Duration::from_secs(3)).unwrap_or(u32::MAX);
        // Acknowledge (QEMU's EOI) before re-enabling what the kernel's handler masked.
        r.ok(&n("ack_after"), c.ack())?;
        let extra = c.uio.wait(Duration::from_secs(1)).unwrap_or(u32::MAX);
        let want = u32::from(!acked_first);
        r.check(
            &n("delivered_on_enable"),
            got == want && extra == 0,
            format_args!("{got} interrupts on enable, {extra} after; want {want}"),
        );
        let st = interrupt_status(r, &c)?;
        r.check(
            &n("interrupt_status_clear"),
            !st,
            format_args!("status bit 3 = {} at the end", u8::from(st)),
        );
    }
    // INTx is not stuck either way: a program with INTx enabled gets exactly one.
    c.expect_nop_ok(r, "after");
    c.expect_one_irq_each(r);
    Some(())
}

/// Bus Master cleared: a WRITE + READ program moves nothing (guest memory, status block and
/// image unchanged) and ends with BusMasterOff in LAST_STATUS (status lost, interrupt
/// raised); Bus Master set again: the same program works.
pub fn run_bme(r: &mut Report) -> Option<()> {
    let mut c = Ccw::open(r, "ccw_bme")?;
    let buf = r.ok("ccw_bme.alloc", DmaBuf::new(12))?;
    let pos = BME_BLOCK * BLOCK_SIZE;
    let half = 8192usize;

    // 16 KiB of old data, written with Bus Master set.
    let old = Scatter {
        buf: &buf,
        pages: vec![0, 1, 2, 3],
        first_off: 0,
        len: 2 * half,
    };
    r.ok("ccw_bme.old_fill", old.fill_pattern(SEED_BME_OLD, pos))?;
    let idaws = r.ok("ccw_bme.old_list", old.idaws())?;
    let list = r.ok("ccw_bme.old_put", c.put_idaws(0, &idaws))?;
    let d = c.run_checked(
        r,
        "old_write",
        &[CcwWord::write(2 * half as u16, list).ida(4)],
        BME_BLOCK,
    )?;
    c.expect_ok(r, "old_write", &d, 2 * half as u64);

    // The program: WRITE 8 KiB of new data over the first half, READ the second half.
    let src = Scatter {
        buf: &buf,
        pages: vec![5, 4],
        first_off: 0,
        len: half,
    };
    let dst = Scatter {
        buf: &buf,
        pages: vec![7, 6],
        first_off: 0,
        len: half,
    };
    r.ok("ccw_bme.new_fill", src.fill_pattern(SEED_BME_NEW, pos))?;
    r.ok("ccw_bme.dst_fill", dst.fill(0x5a))?;
    let idaws = r.ok("ccw_bme.src_list", src.idaws())?;
    let ls = r.ok("ccw_bme.src_put", c.put_idaws(1, &idaws))?;
    let idaws = r.ok("ccw_bme.dst_list", dst.idaws())?;
    let ld = r.ok("ccw_bme.dst_put", c.put_idaws(2, &idaws))?;
    let words = [
        CcwWord::write(half as u16, ls).ida(2).chain(),
        CcwWord::read(half as u16, ld).ida(2),
    ];

    r.ok(
        "ccw_bme.clear_bus_master",
        c.dev.update_command(0, command::BUS_MASTER),
    )?;
    let t0 = Instant::now();
    r.ok("ccw_bme.off_submit", c.submit(&words, BME_BLOCK, 0))?;
    let d = r.ok("ccw_bme.off_done", c.wait_done(t0))?;
    let want = last_status(0x0c, 0x04, FAULT_BUS_MASTER_OFF);
    r.check(
        "ccw_bme.off_last_status",
        d.last == want,
        format_args!("{d} (want LAST_STATUS {want:#010x}: BusMasterOff, channel-control check)"),
    );
    r.check(
        "ccw_bme.off_status_lost",
        d.irq_status == regs::IRQ_DONE | regs::IRQ_STATUS_LOST && !d.stored,
        format_args!(
            "IRQ_STATUS {:#x} (want DONE|STATUS_LOST), status block stored: {}",
            d.irq_status, d.stored
        ),
    );
    r.check(
        "ccw_bme.off_completed_with_interrupt",
        d.completed == d.completed_before.wrapping_add(1) && d.interrupts == 1,
        format_args!(
            "COMPLETED {}->{}, {} interrupts",
            d.completed_before, d.completed, d.interrupts
        ),
    );
    let got = r.ok("ccw_bme.off_dst", dst.read())?;
    expect_untouched(r, "ccw_bme.off_memory_unchanged", &got, 0x5a);

    r.ok(
        "ccw_bme.set_bus_master",
        c.dev.update_command(command::BUS_MASTER, 0),
    )?;
    let chk = Scatter {
        buf: &buf,
        pages: vec![8, 9, 10, 11],
        first_off: 0,
        len: 2 * half,
    };
    r.ok("ccw_bme.check_fill", chk.fill(0))?;
    let idaws = r.ok("ccw_bme.check_list", chk.idaws())?;
    let list = r.ok("ccw_bme.check_put", c.put_idaws(3, &idaws))?;
    let d = c.run_checked(
        r,
        "check_read",
        &[CcwWord::read(2 * half as u16, list).ida(4)],
        BME_BLOCK,
    )?;
    c.expect_ok(r, "check_read", &d, 2 * half as u64);
    let got = r.ok("ccw_bme.check_back", chk.read())?;
    expect_pattern(r, "ccw_bme.off_image_unchanged", &got, SEED_BME_OLD, pos);

    // Bus Master set: the same program (same operation block) works.
    let d = c.run_checked(r, "on_program", &words, BME_BLOCK)?;
    c.expect_ok(r, "on_program", &d, 2 * half as u64);
    let got = r.ok("ccw_bme.on_dst", dst.read())?;
    expect_pattern(
        r,
        "ccw_bme.on_read_data",
        &got,
        SEED_BME_OLD,
        pos + half as u64,
    );
    r.ok("ccw_bme.check_fill2", chk.fill(0))?;
    let d = c.run_checked(
        r,
        "check_read2",
        &[CcwWord::read(2 * half as u16, list).ida(4)],
        BME_BLOCK,
    )?;
    c.expect_ok(r, "check_read2", &d, 2 * half as u64);
    let got = r.ok("ccw_bme.check_back2", chk.read())?;
    expect_pattern(
        r,
        "ccw_bme.on_image_written",
        &got[..half],
        SEED_BME_NEW,
        pos,
    );
    r.image("bme_new", pos, half as u64, SEED_BME_NEW);
    r.image("bme_old", pos + half as u64, half as u64, SEED_BME_OLD);
    c.expect_one_irq_each(r);
    Some(())
}

/// Plain RAM: operation block, CCWs and status block travel through DMA_READ/DMA_WRITE and
/// work; data pages cannot be pinned (DataAddressInvalid, memory untouched); the device
/// keeps working.
pub fn run_plain(r: &mut Report) -> Option<()> {
    let mut c = Ccw::open(r, "ccw_plain")?;
    c.expect_nop_ok(r, "nop");
    // A TIC over an invalid CCW: the walk follows it through DMA_READ.
    let words = [
        CcwWord::nop().chain(),
        CcwWord::tic(c.ccw(3)),
        CcwWord::new(0x55, 1, 0),
        CcwWord::nop(),
    ];
    let d = c.run_checked(r, "tic", &words, 0)?;
    c.expect_ok(r, "tic", &d, 0);
    r.check(
        "ccw_plain.tic_last_ccw",
        d.status.ccw_addr == c.ccw(3),
        format_args!("last CCW {:#x}, want {:#x}", d.status.ccw_addr, c.ccw(3)),
    );
    let words = [CcwWord::nop().chain(), CcwWord::new(0x55, 64, 0)];
    let (f, at) = (Fault::InvalidCommand, c.ccw(1));
    fault_case(r, &mut c, "invalid_command", &words, 0, f, at, 64)?;

    let data = r.ok("ccw_plain.alloc", DmaBuf::new(4))?;
    r.ok("ccw_plain.fill", data.fill(0, 4 * PAGE, 0x5a))?;
    let prog = c.prog();
    let words = [CcwWord::write(4096, data.addr(0))];
    fault_case(
        r,
        &mut c,
        "write",
        &words,
        0,
        Fault::DataAddressInvalid,
        prog,
        4096,
    )?;

    let rd = Scatter {
        buf: &data,
        pages: vec![3, 1],
        first_off: 0x200,
        len: PAGE,
    };
    let idaws = r.ok("ccw_plain.read_list", rd.idaws())?;
    let list = r.ok("ccw_plain.read_put", c.put_idaws(0, &idaws))?;
    let words = [CcwWord::read(PAGE as u16, list).ida(idaws.len() as u32)];
    let f = Fault::DataAddressInvalid;
    fault_case(r, &mut c, "idaw_read", &words, 0, f, prog, PAGE as u16)?;
    let mut all = vec![0u8; 4 * PAGE];
    let _ = data.read_at(0, &mut all);
    expect_untouched(r, "ccw_plain.read_memory_unchanged", &all, 0x5a);

    r.ok("ccw_plain.sense_fill", c.ctl.fill(SENSE_OFF, 32, 0x5a))?;
    let words = [CcwWord::sense(32, c.at(SENSE_OFF))];
    fault_case(r, &mut c, "sense", &words, 0, f, prog, 32)?;
    let mut sense = [0u8; 32];
    let _ = c.ctl.read_at(SENSE_OFF, &mut sense);
    expect_untouched(r, "ccw_plain.sense_memory_unchanged", &sense, 0x5a);

    c.expect_one_irq_each(r);
    Some(())
}
