//! NVMe 1.4 wire formats the controller speaks: submission and completion queue entries,
//! opcodes, status codes.
//!
//! Everything here is plain data decoded from bytes the guest wrote; nothing is trusted
//! and nothing does I/O. Entries are little-endian; a submission queue entry is 64 bytes
//! ([`SQE_SIZE`]), a completion queue entry 16 ([`CQE_SIZE`]).

/// Bytes of a submission queue entry (CC.IOSQES = 6).
pub const SQE_SIZE: u64 = 64;
/// Bytes of a completion queue entry (CC.IOCQES = 4).
pub const CQE_SIZE: u64 = 16;

/// Admin command opcodes.
pub mod admin_op {
    /// Delete I/O Submission Queue.
    pub const DELETE_SQ: u8 = 0x00;
    /// Create I/O Submission Queue.
    pub const CREATE_SQ: u8 = 0x01;
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Delete I/O Completion Queue.
    pub const DELETE_CQ: u8 = 0x04;
    /// Create I/O Completion Queue.
    pub const CREATE_CQ: u8 = 0x05;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0a;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT: u8 = 0x0c;
    /// Keep Alive (no keep-alive timer here: completes at once).
    pub const KEEP_ALIVE: u8 = 0x18;
    /// Doorbell Buffer Config (shadow doorbells, OACS bit 8).
    pub const DBBUF_CONFIG: u8 = 0x7c;
}

/// NVM command set opcodes.
pub mod io_op {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
}

/// Feature identifiers of Get/Set Features.
pub mod feature {
    /// Arbitration.
    pub const ARBITRATION: u8 = 0x01;
    /// Power Management.
    pub const POWER_MGMT: u8 = 0x02;
    /// Temperature Threshold.
    pub const TEMP_THRESHOLD: u8 = 0x04;
    /// Error Recovery.
    pub const ERROR_RECOVERY: u8 = 0x05;
    /// Volatile Write Cache.
    pub const VOLATILE_WC: u8 = 0x06;
    /// Number of Queues.
    pub const NUM_QUEUES: u8 = 0x07;
    /// Interrupt Coalescing.
    pub const IRQ_COALESCING: u8 = 0x08;
    /// Interrupt Vector Configuration.
    pub const IRQ_VECTOR_CONFIG: u8 = 0x09;
    /// Write Atomicity Normal.
    pub const WRITE_ATOMICITY: u8 = 0x0a;
    /// Asynchronous Event Configuration.
    pub const ASYNC_EVENT_CONFIG: u8 = 0x0b;
    /// Timestamp (not supported: ONCS bit 6 clear).
    pub const TIMESTAMP: u8 = 0x0e;
}

/// Log page identifiers of Get Log Page.
pub mod log_page {
    /// Error Information.
    pub const ERROR: u8 = 0x01;
    /// SMART / Health Information.
    pub const SMART: u8 = 0x02;
    /// Firmware Slot Information.
    pub const FW_SLOT: u8 = 0x03;
}

/// A completion status: Status Code Type (bits 10:8 of the status field) and Status Code
/// (bits 7:0), plus Do Not Retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status {
    /// Status Code Type.
    pub sct: u8,
    /// Status Code.
    pub sc: u8,
    /// Do Not Retry.
    pub dnr: bool,
}

impl Status {
    /// Successful Completion.
    pub const SUCCESS: Status = Status::generic(0x00, false);
    /// Invalid Command Opcode.
    pub const INVALID_OPCODE: Status = Status::generic(0x01, true);
    /// Invalid Field in Command.
    pub const INVALID_FIELD: Status = Status::generic(0x02, true);
    /// Data Transfer Error (a PRP list or a data page the controller cannot reach).
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04, false);
    /// Internal Error (the image could not be read or written).
    pub const INTERNAL_ERROR: Status = Status::generic(0x06, false);
    /// Command Aborted due to SQ Deletion.
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08, false);
    /// Invalid Namespace or Format.
    pub const INVALID_NAMESPACE: Status = Status::generic(0x0b, true);
    /// PRP Offset Invalid.
    pub const PRP_OFFSET_INVALID: Status = Status::generic(0x13, true);
    /// LBA Out of Range.
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80, true);
    /// Completion Queue Invalid (Create I/O SQ naming a CQ that does not exist).
    pub const CQ_INVALID: Status = Status::specific(0x00, true);
    /// Invalid Queue Identifier.
    pub const INVALID_QID: Status = Status::specific(0x01, true);
    /// Invalid Queue Size.
    pub const INVALID_QUEUE_SIZE: Status = Status::specific(0x02, true);
    /// Abort Command Limit Exceeded.
    pub const ABORT_LIMIT: Status = Status::specific(0x03, false);
    /// Asynchronous Event Request Limit Exceeded.
    pub const AER_LIMIT: Status = Status::specific(0x05, false);
    /// Invalid Log Page.
    pub const INVALID_LOG_PAGE: Status = Status::specific(0x09, true);
    /// Invalid Interrupt Vector.
    pub const INVALID_VECTOR: Status = Status::specific(0x08, true);
    /// Invalid Queue Deletion (a CQ that still has SQs).
    pub const INVALID_QUEUE_DELETION: Status = Status::specific(0x0c, true);
    /// Feature Identifier Not Saveable.
    pub const FEATURE_NOT_SAVEABLE: Status = Status::specific(0x0d, true);
    /// Write Fault (media error type).
    pub const WRITE_FAULT: Status = Status::media(0x80, false);
    /// Unrecovered Read Error (media error type).
    pub const UNRECOVERED_READ: Status = Status::media(0x81, false);

    const fn generic(sc: u8, dnr: bool) -> Status {
        Status { sct: 0, sc, dnr }
    }

    const fn specific(sc: u8, dnr: bool) -> Status {
        Status { sct: 1, sc, dnr }
    }

    const fn media(sc: u8, dnr: bool) -> Status {
        Status { sct: 2, sc, dnr }
    }

    /// The 15-bit status field of a completion entry (bits 15:1 of DW3's upper half,
    /// without the phase tag): SC in 7:0, SCT in 10:8, DNR in 14.
    pub fn field(self) -> u16 {
        u16::from(self.sc) | u16::from(self.sct & 7) << 8 | u16::from(self.dnr) << 14
    }

    /// True for Successful Completion.
    pub fn is_success(self) -> bool {
        self.sct == 0 && self.sc == 0
    }
}

/// A submission queue entry, decoded (all fields as the guest wrote them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Command {
    /// Opcode (CDW0 bits 7:0).
    pub opcode: u8,
    /// Fused operation and PRP/SGL selection (CDW0 bits 15:8).
    pub flags: u8,
    /// Command identifier (CDW0 bits 31:16).
    pub cid: u16,
    /// Namespace identifier.
    pub nsid: u32,
    /// Metadata pointer.
    pub mptr: u64,
    /// PRP entry 1.
    pub prp1: u64,
    /// PRP entry 2.
    pub prp2: u64,
    /// Command dwords 10 to 15.
    pub cdw: [u32; 6],
}

impl Command {
    /// Decode a 64-byte entry.
    pub fn decode(b: &[u8; SQE_SIZE as usize]) -> Command {
        let d = |i: usize| u32::from_le_bytes([b[i * 4], b[i * 4 + 1], b[i * 4 + 2], b[i * 4 + 3]]);
        let q = |i: usize| u64::from(d(i)) | u64::from(d(i + 1)) << 32;
        Command {
            opcode: b[0],
            flags: b[1],
            cid: u16::from_le_bytes([b[2], b[3]]),
            nsid: d(1),
            mptr: q(4),
            prp1: q(6),
            prp2: q(8),
            cdw: [d(10), d(11), d(12), d(13), d(14), d(15)],
        }
    }

    /// Encode (what a guest driver writes; the tests use it).
    pub fn encode(&self) -> [u8; SQE_SIZE as usize] {
        let mut b = [0u8; SQE_SIZE as usize];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.cid.to_le_bytes());
        b[4..8].copy_from_slice(&self.nsid.to_le_bytes());
        b[16..24].copy_from_slice(&self.mptr.to_le_bytes());
        b[24..32].copy_from_slice(&self.prp1.to_le_bytes());
        b[32..40].copy_from_slice(&self.prp2.to_le_bytes());
        for (i, v) in self.cdw.iter().enumerate() {
            b[40 + i * 4..44 + i * 4].copy_from_slice(&v.to_le_bytes());
        }
        b
    }

    /// Command dword `n` (10..=15); 0 for any other `n`.
    pub fn dw(&self, n: usize) -> u32 {
        n.checked_sub(10)
            .and_then(|i| self.cdw.get(i))
            .copied()
            .unwrap_or(0)
    }

    /// PSDT (CDW0 bits 15:14): 0 = PRPs; anything else asks for SGLs, which this controller
    /// does not support (SGLS = 0).
    pub fn psdt(&self) -> u8 {
        self.flags >> 6
    }

    /// FUSE (CDW0 bits 9:8): fused operations are not supported.
    pub fn fuse(&self) -> u8 {
        self.flags & 3
    }
}

/// A completion queue entry before the phase tag is added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// Command specific result (DW0).
    pub result: u32,
    /// Submission queue head pointer after the command was consumed.
    pub sq_head: u16,
    /// Submission queue the command came from.
    pub sq_id: u16,
    /// The command's identifier.
    pub cid: u16,
    /// The status.
    pub status: Status,
}

impl Completion {
    /// The 16 bytes of the entry with phase tag `phase`.
    pub fn encode(&self, phase: bool) -> [u8; CQE_SIZE as usize] {
        let mut b = [0u8; CQE_SIZE as usize];
        b[0..4].copy_from_slice(&self.result.to_le_bytes());
        b[8..10].copy_from_slice(&self.sq_head.to_le_bytes());
        b[10..12].copy_from_slice(&self.sq_id.to_le_bytes());
        b[12..14].copy_from_slice(&self.cid.to_le_bytes());
        let sf = self.status.field() << 1 | u16::from(phase);
        b[14..16].copy_from_slice(&sf.to_le_bytes());
        b
    }

    /// Decode an entry: the completion and its phase tag (what a guest driver reads).
    pub fn decode(b: &[u8; CQE_SIZE as usize]) -> (Completion, bool) {
        let sf = u16::from_le_bytes([b[14], b[15]]);
        let status = Status {
            sc: (sf >> 1) as u8,
            sct: ((sf >> 9) & 7) as u8,
            dnr: sf & (1 << 15) != 0,
        };
        let c = Completion {
            result: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            sq_head: u16::from_le_bytes([b[8], b[9]]),
            sq_id: u16::from_le_bytes([b[10], b[11]]),
            cid: u16::from_le_bytes([b[12], b[13]]),
            status,
        };
        (c, sf & 1 != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_command_encode_decode_round_trips() {
        let c = Command {
            opcode: 2,
            flags: 0x40,
            cid: 0xbeef,
            nsid: 1,
            mptr: 7,
            prp1: 0x1234_5000,
            prp2: 0xffff_0000_0000_1000,
            cdw: [1, 2, 3, 4, 5, 6],
        };
        assert_eq!(Command::decode(&c.encode()), c);
        assert_eq!(c.dw(12), 3);
        assert_eq!(c.dw(9), 0);
        assert_eq!(c.dw(16), 0);
        assert_eq!(c.psdt(), 1);
    }

    #[test]
    fn test_completion_status_field_layout_matches_spec() {
        let c = Completion {
            result: 9,
            sq_head: 3,
            sq_id: 1,
            cid: 77,
            status: Status::INVALID_QID,
        };
        let b = c.encode(true);
        // SCT 1, SC 1, DNR: bits 15..1 of the upper half of DW3, phase in bit 0.
        assert_eq!(
            u16::from_le_bytes([b[14], b[15]]),
            (1 << 15) | (1 << 9) | (1 << 1) | 1
        );
        assert_eq!(Completion::decode(&b), (c, true));
    }
}
