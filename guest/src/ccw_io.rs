//! The `ccw` scenario: registers, a direct WRITE/READ from physically contiguous memory,
//! IDAW WRITE/READ over scattered pages (first IDAW mid-page), bad programs with their
//! documented status, INTx per program and throughput. Image regions: see `ccw.rs`.

use std::time::Instant;

use umdev_devices::ccw::driver::{pattern, regs, CcwWord, Fault, BLOCK_SIZE};

use super::data::{expect_pattern, expect_untouched, physical_breaks, Scatter};
use super::dev::{Ccw, SENSE_OFF};
use crate::mem::{DmaBuf, PAGE};
use crate::report::Report;

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

fn bad_programs(r: &mut Report, c: &mut Ccw, direct: &DmaBuf, data: &DmaBuf) -> Option<()> {
    let da = direct.addr_of(0);
    let prog = c.prog();

    let words = [CcwWord::new(0x55, 512, da)];
    c.fault_case(
        r,
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
    c.fault_case(
        r,
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
    c.fault_case(r, "count_past_idaw_list", &words, 0, f, prog, 3 * 4096)?;

    // The second CCW's data is beyond guest RAM: found when pinning, nothing runs.
    let words = [CcwWord::nop().chain(), CcwWord::write(4096, BEYOND_RAM)];
    let (f, at) = (Fault::DataAddressInvalid, c.ccw(1));
    c.fault_case(r, "data_beyond_ram", &words, 0, f, at, 4096)?;

    // OutOfRange: 1024 bytes from the last block; then SENSE shows why.
    let last = c.capacity - 1;
    let words = [CcwWord::write(1024, da)];
    c.fault_case(
        r,
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
    c.fault_case(r, "out_of_range_chain", &words, last, f, at, 512)?;
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
