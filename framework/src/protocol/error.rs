//! The one error type of the protocol layer and its errno mapping.

use super::Command;

/// Everything that can be wrong with a message from the peer. Each variant maps to exactly
/// one errno through [`ProtocolError::errno`], which is what goes into the error reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// A structure is shorter than its fixed layout.
    #[error("{what} truncated: need {need} bytes, have {got}")]
    Truncated {
        /// Which structure.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes present.
        got: usize,
    },
    /// The header's message size is below 16 bytes.
    #[error("message size {size} is smaller than the 16-byte header")]
    MessageTooSmall {
        /// Claimed size.
        size: u32,
    },
    /// The header's message size is above what we accept.
    #[error("message size {size} exceeds the limit of {max} bytes")]
    MessageTooLarge {
        /// Claimed size.
        size: u32,
        /// Limit.
        max: u32,
    },
    /// The message type bits are neither command nor reply, or unknown flag bits are set.
    #[error("bad header flags {flags:#x}")]
    BadHeaderFlags {
        /// The flags word.
        flags: u32,
    },
    /// A command number nobody defined.
    #[error("unknown command {0}")]
    UnknownCommand(u16),
    /// A defined command sent in the wrong direction (e.g. DMA_READ from the client).
    #[error("{0:?} is not a client-to-server command")]
    WrongDirection(Command),
    /// No_reply set on a command that must be answered.
    #[error("No_reply is not allowed on {0:?}")]
    NoReplyNotAllowed(Command),
    /// The payload size does not match the command's layout.
    #[error("{what}: payload is {got} bytes, expected {expected}")]
    BadPayloadSize {
        /// Which structure.
        what: &'static str,
        /// Expected size (or minimum).
        expected: usize,
        /// Actual size.
        got: usize,
    },
    /// `argsz` is smaller than the fixed part of the structure.
    #[error("{what}: argsz {argsz} is below the minimum {min}")]
    ArgszTooSmall {
        /// Which structure.
        what: &'static str,
        /// The argsz sent.
        argsz: u32,
        /// Minimum.
        min: u32,
    },
    /// Flag bits that are invalid for this command.
    #[error("{what}: invalid flags {flags:#x}")]
    BadFlags {
        /// Which structure.
        what: &'static str,
        /// The flags.
        flags: u32,
    },
    /// A well-formed request for something umdev does not implement.
    #[error("{0} is not supported")]
    Unsupported(&'static str),
    /// The message carries the wrong number of file descriptors.
    #[error("{what}: {got} file descriptors attached, expected {expected}")]
    WrongFdCount {
        /// Which command.
        what: &'static str,
        /// Expected (human readable, e.g. "0 or 1").
        expected: &'static str,
        /// Received.
        got: usize,
    },
    /// A field holds an invalid value (zero size, wrapped range, bad count, ...).
    #[error("{what}: {why}")]
    InvalidField {
        /// Which field.
        what: &'static str,
        /// Why it is invalid.
        why: String,
    },
    /// A data transfer above the negotiated max_data_xfer_size.
    #[error("transfer of {count} bytes exceeds max_data_xfer_size {max}")]
    TransferTooLarge {
        /// Requested count.
        count: u64,
        /// Limit.
        max: u64,
    },
    /// The VERSION capabilities are not valid JSON (or not NUL-terminated UTF-8).
    #[error("bad version capabilities: {0}")]
    BadCapabilities(String),
    /// The client proposed a major version other than 0.
    #[error("unsupported protocol major version {0}")]
    UnsupportedVersion(u16),
}

impl ProtocolError {
    /// The errno sent in the error reply for this error (never 0).
    pub fn errno(&self) -> i32 {
        use ProtocolError::*;
        match self {
            Truncated { .. }
            | MessageTooSmall { .. }
            | BadHeaderFlags { .. }
            | WrongDirection(_)
            | NoReplyNotAllowed(_)
            | BadPayloadSize { .. }
            | ArgszTooSmall { .. }
            | BadFlags { .. }
            | WrongFdCount { .. }
            | InvalidField { .. }
            | BadCapabilities(_) => libc::EINVAL,
            MessageTooLarge { .. } | TransferTooLarge { .. } => libc::E2BIG,
            UnknownCommand(_) => libc::ENOSYS,
            Unsupported(_) | UnsupportedVersion(_) => libc::ENOTSUP,
        }
    }

    pub(crate) fn invalid(what: &'static str, why: impl Into<String>) -> Self {
        ProtocolError::InvalidField {
            what,
            why: why.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_errno_every_variant_nonzero() {
        let all = [
            ProtocolError::Truncated {
                what: "x",
                need: 1,
                got: 0,
            },
            ProtocolError::MessageTooSmall { size: 3 },
            ProtocolError::MessageTooLarge { size: 9, max: 1 },
            ProtocolError::BadHeaderFlags { flags: 7 },
            ProtocolError::UnknownCommand(99),
            ProtocolError::WrongDirection(Command::DmaRead),
            ProtocolError::NoReplyNotAllowed(Command::Version),
            ProtocolError::Unsupported("x"),
            ProtocolError::TransferTooLarge { count: 2, max: 1 },
            ProtocolError::UnsupportedVersion(1),
        ];
        for e in all {
            assert!(e.errno() > 0, "{e}");
        }
        assert_eq!(ProtocolError::UnknownCommand(99).errno(), libc::ENOSYS);
        assert_eq!(
            ProtocolError::TransferTooLarge { count: 2, max: 1 }.errno(),
            libc::E2BIG
        );
    }
}
