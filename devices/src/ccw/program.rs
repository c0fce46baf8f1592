//! Channel-program parsing and validation.
//!
//! [`parse`] walks a channel program in guest memory exactly once, following command and
//! data chaining and TICs, and either returns the list of [`Step`]s to execute or the first
//! [`ProgramError`]. Nothing is transferred before the whole program has been validated, so a
//! bad program never moves data. Every guest number is checked: addresses with checked
//! arithmetic, the walk bounded by a CCW limit and by loop detection.

use std::collections::HashSet;

use super::format::{
    cmd, flags, CcwWord, CCW_ALIGN, CCW_SIZE, IDAW_LIST_ALIGN, IDAW_SIZE, SENSE_SIZE,
};
use super::idal::{direct_extent, idaw_extents, Extent, MAX_IDAWS_PER_CCW};
use super::status::Fault;

/// Default limit on CCWs fetched (TICs included) per program.
pub const DEFAULT_MAX_CCWS: usize = 256;

/// Read access to guest memory for the parser (the device passes its `DmaHandle`; unit
/// tests pass a fake).
pub trait GuestRead {
    /// Fill `buf` from guest address `addr`; false if any byte is not readable.
    fn read_guest(&self, addr: u64, buf: &mut [u8]) -> bool;
}

/// What a step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Image → guest memory.
    Read,
    /// Guest memory → image.
    Write,
    /// Sense bytes → guest memory.
    Sense,
    /// Nothing.
    Nop,
}

/// One executable CCW (TICs are resolved away).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// Guest address of the CCW.
    pub ccw_addr: u64,
    /// The operation (for a data-chained CCW, the chain's command).
    pub op: Op,
    /// The CCW's count.
    pub count: u16,
    /// Guest memory the step transfers to or from, in order (empty for NOP and SKIP).
    pub extents: Vec<Extent>,
    /// Image byte offset of the step's first byte (READ/WRITE, including skipped READs).
    pub image_offset: u64,
    /// Bytes the step leaves untransferred when it completes normally.
    pub residual: u16,
}

impl Step {
    /// Bytes moved between the image/sense data and guest memory.
    pub fn transfer_len(&self) -> u64 {
        self.extents.iter().map(|e| u64::from(e.len)).sum()
    }
}

/// A validated program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Program {
    /// Steps in execution order.
    pub steps: Vec<Step>,
    /// The last step was a SENSE with a count other than 32 and no SLI: the program ends
    /// there with incorrect length.
    pub incorrect_length: bool,
}

/// Why a program is rejected, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgramError {
    /// The fault.
    pub fault: Fault,
    /// Address of the failing CCW (the program address for faults before the first CCW).
    pub ccw_addr: u64,
    /// Residual count to report (the failing CCW's count, 0 if none was decoded).
    pub residual: u16,
}

/// Parameters of one parse.
#[derive(Clone, Copy, Debug)]
pub struct ParseLimits {
    /// Maximum CCWs fetched (TICs included).
    pub max_ccws: usize,
    /// Image byte offset where the program starts (block × 512).
    pub start_offset: u64,
    /// Image capacity in bytes.
    pub capacity: u64,
}

fn err(fault: Fault, ccw_addr: u64, residual: u16) -> ProgramError {
    ProgramError {
        fault,
        ccw_addr,
        residual,
    }
}

/// Walk and validate the program starting at `program_addr`.
pub fn parse(
    mem: &dyn GuestRead,
    program_addr: u64,
    limits: &ParseLimits,
) -> Result<Program, ProgramError> {
    let mut steps = Vec::new();
    let mut visited = HashSet::new();
    let mut addr = program_addr;
    let mut prev_was_tic = false;
    let mut first = true;
    let mut chained_op: Option<Op> = None;
    let mut pos = limits.start_offset;
    if pos > limits.capacity {
        return Err(err(Fault::OutOfRange, program_addr, 0));
    }

    loop {
        if addr & (CCW_ALIGN - 1) != 0 {
            return Err(err(Fault::CcwUnaligned, addr, 0));
        }
        if visited.len() >= limits.max_ccws {
            return Err(err(Fault::ProgramTooLong, addr, 0));
        }
        if !visited.insert(addr) {
            return Err(err(Fault::Loop, addr, 0));
        }
        let word = fetch_ccw(mem, addr).ok_or(err(Fault::CcwUnreadable, addr, 0))?;

        if word.cmd == cmd::TIC {
            if first {
                return Err(err(Fault::TicFirst, addr, 0));
            }
            if prev_was_tic {
                return Err(err(Fault::TicToTic, addr, 0));
            }
            prev_was_tic = true;
            addr = word.addr;
            continue;
        }
        prev_was_tic = false;
        first = false;

        let fail = move |fault| err(fault, addr, word.count);
        let op = match chained_op {
            Some(op) => op,
            None => decode_op(word.cmd).ok_or(fail(Fault::InvalidCommand))?,
        };
        let step = decode_step(mem, addr, &word, op, &mut pos, limits).map_err(fail)?;
        steps.push(step);

        if op == Op::Sense && usize::from(word.count) != SENSE_SIZE && word.flags & flags::SLI == 0
        {
            return Ok(Program {
                steps,
                incorrect_length: true,
            });
        }
        let next = addr.checked_add(CCW_SIZE);
        if word.flags & flags::CD != 0 {
            chained_op = Some(op);
        } else if word.flags & flags::CC != 0 {
            chained_op = None;
        } else {
            return Ok(Program {
                steps,
                incorrect_length: false,
            });
        }
        addr = next.ok_or(fail(Fault::CcwUnreadable))?;
    }
}

fn fetch_ccw(mem: &dyn GuestRead, addr: u64) -> Option<CcwWord> {
    addr.checked_add(CCW_SIZE)?;
    let mut b = [0u8; CCW_SIZE as usize];
    mem.read_guest(addr, &mut b)
        .then(|| CcwWord::from_bytes(&b))
}

fn decode_op(code: u8) -> Option<Op> {
    match code {
        cmd::READ => Some(Op::Read),
        cmd::WRITE => Some(Op::Write),
        cmd::SENSE => Some(Op::Sense),
        cmd::NOP => Some(Op::Nop),
        _ => None,
    }
}

fn decode_step(
    mem: &dyn GuestRead,
    ccw_addr: u64,
    w: &CcwWord,
    op: Op,
    pos: &mut u64,
    limits: &ParseLimits,
) -> Result<Step, Fault> {
    let ida = w.flags & flags::IDA != 0;
    if w.flags & flags::RESERVED != 0 || (!ida && w.idaw_count != 0) {
        return Err(Fault::InvalidFlags);
    }
    if w.flags & flags::CD != 0 && matches!(op, Op::Sense | Op::Nop) {
        return Err(Fault::InvalidFlags);
    }
    let mut step = Step {
        ccw_addr,
        op,
        count: w.count,
        extents: Vec::new(),
        image_offset: 0,
        residual: 0,
    };
    if op == Op::Nop {
        return Ok(step);
    }
    if w.count == 0 {
        return Err(Fault::ZeroCount);
    }
    let count = u32::from(w.count);
    let len = match op {
        Op::Sense => {
            let n = count.min(SENSE_SIZE as u32);
            // count ≤ u16::MAX, so the residual fits.
            step.residual = (count - n) as u16;
            n
        }
        _ => count,
    };
    if matches!(op, Op::Read | Op::Write) {
        let end = pos
            .checked_add(u64::from(count))
            .filter(|&e| e <= limits.capacity)
            .ok_or(Fault::OutOfRange)?;
        step.image_offset = *pos;
        *pos = end;
    }
    let skip = w.flags & flags::SKIP != 0 && matches!(op, Op::Read | Op::Sense);
    if skip {
        return Ok(step);
    }
    step.extents = if ida {
        let idaws = fetch_idaws(mem, w)?;
        idaw_extents(&idaws, count, len)?
    } else {
        vec![direct_extent(w.addr, len)?]
    };
    Ok(step)
}

fn fetch_idaws(mem: &dyn GuestRead, w: &CcwWord) -> Result<Vec<u64>, Fault> {
    if w.idaw_count == 0 || w.idaw_count > MAX_IDAWS_PER_CCW {
        return Err(Fault::IdawCountInvalid);
    }
    if w.addr & (IDAW_LIST_ALIGN - 1) != 0 {
        return Err(Fault::IdawListUnaligned);
    }
    let bytes = u64::from(w.idaw_count) * IDAW_SIZE;
    w.addr.checked_add(bytes).ok_or(Fault::IdawListUnreadable)?;
    let mut buf = vec![0u8; bytes as usize];
    if !mem.read_guest(w.addr, &mut buf) {
        return Err(Fault::IdawListUnreadable);
    }
    Ok(buf
        .chunks_exact(IDAW_SIZE as usize)
        .map(|c| {
            let mut x = [0u8; 8];
            x.copy_from_slice(c);
            u64::from_le_bytes(x)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Sparse fake guest memory: readable bytes only where written.
    #[derive(Default)]
    struct FakeMem {
        bytes: BTreeMap<u64, u8>,
    }

    impl FakeMem {
        fn put(&mut self, addr: u64, data: &[u8]) {
            for (i, b) in data.iter().enumerate() {
                self.bytes.insert(addr + i as u64, *b);
            }
        }
        fn ccws(&mut self, addr: u64, words: &[CcwWord]) {
            for (i, w) in words.iter().enumerate() {
                self.put(addr + i as u64 * CCW_SIZE, &w.to_bytes());
            }
        }
        fn idaws(&mut self, addr: u64, list: &[u64]) {
            for (i, a) in list.iter().enumerate() {
                self.put(addr + i as u64 * 8, &a.to_le_bytes());
            }
        }
    }

    impl GuestRead for FakeMem {
        fn read_guest(&self, addr: u64, buf: &mut [u8]) -> bool {
            for (i, b) in buf.iter_mut().enumerate() {
                match self.bytes.get(&(addr + i as u64)) {
                    Some(v) => *b = *v,
                    None => return false,
                }
            }
            true
        }
    }

    const LIMITS: ParseLimits = ParseLimits {
        max_ccws: 16,
        start_offset: 0,
        capacity: 1 << 20,
    };

    fn w(cmd: u8, flags: u8, count: u16, addr: u64) -> CcwWord {
        CcwWord {
            cmd,
            flags,
            count,
            idaw_count: 0,
            addr,
        }
    }

    fn fault_of(mem: &FakeMem, at: u64) -> (Fault, u64) {
        let e = parse(mem, at, &LIMITS).unwrap_err();
        (e.fault, e.ccw_addr)
    }

    #[test]
    fn test_parse_single_read_direct_ok() {
        let mut m = FakeMem::default();
        m.ccws(0x1000, &[w(cmd::READ, 0, 512, 0x8000)]);
        let p = parse(&m, 0x1000, &LIMITS).unwrap();
        assert_eq!(p.steps.len(), 1);
        assert_eq!(p.steps[0].op, Op::Read);
        assert_eq!(
            p.steps[0].extents,
            vec![Extent {
                iova: 0x8000,
                len: 512
            }]
        );
        assert!(!p.incorrect_length);
    }

    #[test]
    fn test_parse_command_chain_advances_image_offset() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[
                w(cmd::WRITE, flags::CC, 1024, 0x8000),
                w(cmd::NOP, flags::CC, 0, 0),
                w(cmd::READ, 0, 512, 0x9000),
            ],
        );
        let limits = ParseLimits {
            start_offset: 4096,
            ..LIMITS
        };
        let p = parse(&m, 0x1000, &limits).unwrap();
        let offs: Vec<_> = p.steps.iter().map(|s| (s.op, s.image_offset)).collect();
        assert_eq!(
            offs,
            vec![(Op::Write, 4096), (Op::Nop, 0), (Op::Read, 5120)]
        );
    }

    #[test]
    fn test_parse_chain_data_inherits_command_and_ignores_code() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[
                w(cmd::READ, flags::CD, 100, 0x8000),
                w(0xff, 0, 412, 0x9000),
            ],
        );
        let p = parse(&m, 0x1000, &LIMITS).unwrap();
        assert_eq!(p.steps[1].op, Op::Read);
        assert_eq!(p.steps[1].image_offset, 100);
    }

    #[test]
    fn test_parse_tic_jumps_to_target() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[
                w(cmd::WRITE, flags::CC, 8, 0x8000),
                w(cmd::TIC, 0, 0, 0x3000),
            ],
        );
        m.ccws(0x3000, &[w(cmd::READ, 0, 8, 0x9000)]);
        let p = parse(&m, 0x1000, &LIMITS).unwrap();
        let addrs: Vec<_> = p.steps.iter().map(|s| s.ccw_addr).collect();
        assert_eq!(addrs, vec![0x1000, 0x3000]);
    }

    #[test]
    fn test_parse_tic_to_tic_program_check() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[w(cmd::NOP, flags::CC, 0, 0), w(cmd::TIC, 0, 0, 0x3000)],
        );
        m.ccws(0x3000, &[w(cmd::TIC, 0, 0, 0x4000)]);
        m.ccws(0x4000, &[w(cmd::NOP, 0, 0, 0)]);
        assert_eq!(fault_of(&m, 0x1000), (Fault::TicToTic, 0x3000));
        assert_eq!(
            Fault::TicToTic.status().1,
            super::super::status::cstat::PROGRAM_CHECK
        );
    }

    #[test]
    fn test_parse_tic_first_rejected() {
        let mut m = FakeMem::default();
        m.ccws(0x1000, &[w(cmd::TIC, 0, 0, 0x1010), w(cmd::NOP, 0, 0, 0)]);
        assert_eq!(fault_of(&m, 0x1000), (Fault::TicFirst, 0x1000));
    }

    #[test]
    fn test_parse_tic_loop_detected() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[w(cmd::NOP, flags::CC, 0, 0), w(cmd::TIC, 0, 0, 0x1000)],
        );
        assert_eq!(fault_of(&m, 0x1000), (Fault::Loop, 0x1000));
    }

    #[test]
    fn test_parse_long_program_too_long() {
        let mut m = FakeMem::default();
        let words: Vec<_> = (0..40).map(|_| w(cmd::NOP, flags::CC, 0, 0)).collect();
        m.ccws(0x1000, &words);
        assert_eq!(
            fault_of(&m, 0x1000),
            (Fault::ProgramTooLong, 0x1000 + 16 * 16)
        );
    }

    #[test]
    fn test_parse_unmapped_ccw_unreadable() {
        let m = FakeMem::default();
        assert_eq!(fault_of(&m, 0x1000), (Fault::CcwUnreadable, 0x1000));
        assert_eq!(
            fault_of(&m, u64::MAX - 7),
            (Fault::CcwUnreadable, u64::MAX - 7)
        );
    }

    #[test]
    fn test_parse_unaligned_program_address_rejected() {
        let mut m = FakeMem::default();
        m.ccws(0x1004, &[w(cmd::NOP, 0, 0, 0)]);
        assert_eq!(fault_of(&m, 0x1004), (Fault::CcwUnaligned, 0x1004));
    }

    #[test]
    fn test_parse_unaligned_tic_target_rejected() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[w(cmd::NOP, flags::CC, 0, 0), w(cmd::TIC, 0, 0, 0x2004)],
        );
        assert_eq!(fault_of(&m, 0x1000), (Fault::CcwUnaligned, 0x2004));
    }

    #[test]
    fn test_parse_zero_count_read_rejected() {
        let mut m = FakeMem::default();
        m.ccws(0x1000, &[w(cmd::READ, 0, 0, 0x8000)]);
        assert_eq!(fault_of(&m, 0x1000), (Fault::ZeroCount, 0x1000));
    }

    #[test]
    fn test_parse_invalid_command_and_flags_rejected() {
        let mut m = FakeMem::default();
        m.ccws(0x1000, &[w(0x77, 0, 1, 0x8000)]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::InvalidCommand);
        m.ccws(0x1000, &[w(cmd::READ, 0x01, 1, 0x8000)]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::InvalidFlags);
        m.ccws(0x1000, &[w(cmd::SENSE, flags::CD, 32, 0x8000)]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::InvalidFlags);
        let mut word = w(cmd::READ, 0, 1, 0x8000);
        word.idaw_count = 1;
        m.ccws(0x1000, &[word]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::InvalidFlags);
    }

    #[test]
    fn test_parse_ida_scattered_list_ok() {
        let mut m = FakeMem::default();
        let mut word = w(cmd::READ, flags::IDA, 8192, 0x2000);
        word.idaw_count = 3;
        m.ccws(0x1000, &[word]);
        m.idaws(0x2000, &[0x7800, 0x3000, 0x11000]);
        let p = parse(&m, 0x1000, &LIMITS).unwrap();
        let ext: Vec<_> = p.steps[0].extents.iter().map(|e| (e.iova, e.len)).collect();
        assert_eq!(
            ext,
            vec![
                (0x7800, 0x800),
                (0x3000, 4096),
                (0x11000, 8192 - 0x800 - 4096)
            ]
        );
    }

    #[test]
    fn test_parse_ida_count_past_list_rejected() {
        let mut m = FakeMem::default();
        let mut word = w(cmd::WRITE, flags::IDA, 8193, 0x2000);
        word.idaw_count = 2;
        m.ccws(0x1000, &[word]);
        m.idaws(0x2000, &[0x7000, 0x3000]);
        assert_eq!(fault_of(&m, 0x1000), (Fault::CountPastIdawList, 0x1000));
    }

    #[test]
    fn test_parse_ida_unaligned_list_rejected() {
        let mut m = FakeMem::default();
        let mut word = w(cmd::WRITE, flags::IDA, 100, 0x2004);
        word.idaw_count = 1;
        m.ccws(0x1000, &[word]);
        m.idaws(0x2004, &[0x7000]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::IdawListUnaligned);
        let mut word = w(cmd::WRITE, flags::IDA, 5000, 0x2000);
        word.idaw_count = 2;
        m.ccws(0x1000, &[word]);
        m.idaws(0x2000, &[0x7000, 0x8010]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::IdawUnaligned);
    }

    #[test]
    fn test_parse_ida_bad_list_count_or_address_rejected() {
        let mut m = FakeMem::default();
        let mut word = w(cmd::WRITE, flags::IDA, 100, 0x2000);
        word.idaw_count = 0;
        m.ccws(0x1000, &[word]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::IdawCountInvalid);
        word.idaw_count = MAX_IDAWS_PER_CCW + 1;
        m.ccws(0x1000, &[word]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::IdawCountInvalid);
        word.idaw_count = 1;
        word.addr = 0x6000; // unmapped list
        m.ccws(0x1000, &[word]);
        assert_eq!(fault_of(&m, 0x1000).0, Fault::IdawListUnreadable);
    }

    #[test]
    fn test_parse_past_capacity_out_of_range() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[
                w(cmd::READ, flags::CC, 512, 0x8000),
                w(cmd::READ, 0, 1024, 0x8000),
            ],
        );
        let limits = ParseLimits {
            capacity: 1024,
            ..LIMITS
        };
        let e = parse(&m, 0x1000, &limits).unwrap_err();
        assert_eq!(
            (e.fault, e.ccw_addr, e.residual),
            (Fault::OutOfRange, 0x1010, 1024)
        );
    }

    #[test]
    fn test_parse_sense_short_count_incorrect_length_ends_chain() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[
                w(cmd::SENSE, flags::CC, 8, 0x8000),
                w(cmd::READ, 0, 8, 0x8000),
            ],
        );
        let p = parse(&m, 0x1000, &LIMITS).unwrap();
        assert!(p.incorrect_length);
        assert_eq!(p.steps.len(), 1);
        m.ccws(
            0x1000,
            &[
                w(cmd::SENSE, flags::CC | flags::SLI, 64, 0x8000),
                w(cmd::READ, 0, 8, 0x8000),
            ],
        );
        let p = parse(&m, 0x1000, &LIMITS).unwrap();
        assert!(!p.incorrect_length);
        assert_eq!(p.steps[0].residual, 32);
        assert_eq!(p.steps[0].transfer_len(), 32);
    }

    #[test]
    fn test_parse_skip_read_transfers_nothing_but_advances() {
        let mut m = FakeMem::default();
        m.ccws(
            0x1000,
            &[
                w(cmd::READ, flags::CC | flags::SKIP, 512, 0xdead_0000),
                w(cmd::READ, 0, 512, 0x8000),
            ],
        );
        let p = parse(&m, 0x1000, &LIMITS).unwrap();
        assert!(p.steps[0].extents.is_empty());
        assert_eq!(p.steps[1].image_offset, 512);
    }

    #[test]
    fn test_parse_start_past_capacity_rejected() {
        let mut m = FakeMem::default();
        m.ccws(0x1000, &[w(cmd::NOP, 0, 0, 0)]);
        let limits = ParseLimits {
            start_offset: LIMITS.capacity + 1,
            ..LIMITS
        };
        assert_eq!(
            parse(&m, 0x1000, &limits).unwrap_err().fault,
            Fault::OutOfRange
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// Arbitrary bytes as a program never panic and either parse or fail cleanly.
        #[test]
        fn test_parse_random_memory_never_panics(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512),
            start in 0u64..64,
        ) {
            let mut m = FakeMem::default();
            m.put(0x1000, &bytes);
            if let Ok(p) = parse(&m, 0x1000 + start * 8, &LIMITS) {
                proptest::prop_assert!(p.steps.len() <= LIMITS.max_ccws);
            }
        }
    }
}
