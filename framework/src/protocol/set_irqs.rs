//! DEVICE_SET_IRQS: action × data validation.

use vfio_bindings::bindings::vfio::{
    vfio_irq_set, VFIO_IRQ_SET_ACTION_MASK, VFIO_IRQ_SET_ACTION_TRIGGER,
    VFIO_IRQ_SET_ACTION_TYPE_MASK, VFIO_IRQ_SET_ACTION_UNMASK, VFIO_IRQ_SET_DATA_BOOL,
    VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE, VFIO_IRQ_SET_DATA_TYPE_MASK,
};

use super::wire::{Put, Reader};
use super::ProtocolError;
use crate::device::IrqAction;

/// Size of the fixed SET_IRQS payload (`struct vfio_irq_set` without data).
pub const SET_IRQS_SIZE: usize = std::mem::size_of::<vfio_irq_set>();

/// The data kind of a SET_IRQS request, before fds are attached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetIrqsData {
    /// DATA_NONE.
    None,
    /// DATA_BOOL, one flag per vector.
    Bool(Vec<bool>),
    /// DATA_EVENTFD with `nfds` fds attached (0 = de-assign the range, else = count).
    Eventfd {
        /// Number of fds attached to the message.
        nfds: usize,
    },
}

/// A validated SET_IRQS request (the eventfds travel separately).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetIrqsRequest {
    /// IRQ index.
    pub index: u32,
    /// First vector.
    pub start: u32,
    /// Number of vectors.
    pub count: u32,
    /// The action.
    pub action: IrqAction,
    /// The data.
    pub data: SetIrqsData,
}

impl SetIrqsRequest {
    /// Decode and validate: argsz equals the payload length; exactly one DATA and one
    /// ACTION bit and nothing else; `start + count` does not wrap; count 0 only with
    /// DATA_NONE + TRIGGER (disable the index); DATA_NONE carries nothing, DATA_BOOL
    /// carries `count` bytes, DATA_EVENTFD carries 0 or `count` fds (≤ `max_fds`).
    pub fn decode(payload: &[u8], nfds: usize, max_fds: u32) -> Result<Self, ProtocolError> {
        let mut r = Reader::new(payload, "DEVICE_SET_IRQS");
        let argsz = r.u32()?;
        let flags = r.u32()?;
        let index = r.u32()?;
        let start = r.u32()?;
        let count = r.u32()?;
        if argsz as usize != payload.len() {
            return Err(ProtocolError::invalid(
                "DEVICE_SET_IRQS argsz",
                format!("{argsz} differs from the payload size {}", payload.len()),
            ));
        }
        let known = VFIO_IRQ_SET_DATA_TYPE_MASK | VFIO_IRQ_SET_ACTION_TYPE_MASK;
        let data_bits = flags & VFIO_IRQ_SET_DATA_TYPE_MASK;
        let action_bits = flags & VFIO_IRQ_SET_ACTION_TYPE_MASK;
        if flags & !known != 0 || data_bits.count_ones() != 1 || action_bits.count_ones() != 1 {
            return Err(ProtocolError::BadFlags {
                what: "DEVICE_SET_IRQS",
                flags,
            });
        }
        let action = match action_bits {
            VFIO_IRQ_SET_ACTION_MASK => IrqAction::Mask,
            VFIO_IRQ_SET_ACTION_UNMASK => IrqAction::Unmask,
            _ => IrqAction::Trigger,
        };
        if start.checked_add(count).is_none() {
            return Err(ProtocolError::invalid(
                "DEVICE_SET_IRQS",
                format!("start {start} + count {count} wraps"),
            ));
        }
        if count == 0
            && (data_bits != VFIO_IRQ_SET_DATA_NONE || action_bits != VFIO_IRQ_SET_ACTION_TRIGGER)
        {
            return Err(ProtocolError::invalid(
                "DEVICE_SET_IRQS",
                "count 0 is only valid with DATA_NONE | ACTION_TRIGGER",
            ));
        }
        let data_len = payload.len() - SET_IRQS_SIZE;
        let data = match data_bits {
            VFIO_IRQ_SET_DATA_NONE => {
                if data_len != 0 {
                    return Err(ProtocolError::BadPayloadSize {
                        what: "DEVICE_SET_IRQS (DATA_NONE)",
                        expected: SET_IRQS_SIZE,
                        got: payload.len(),
                    });
                }
                if nfds != 0 {
                    return Err(ProtocolError::WrongFdCount {
                        what: "DEVICE_SET_IRQS (DATA_NONE)",
                        expected: "0",
                        got: nfds,
                    });
                }
                SetIrqsData::None
            }
            VFIO_IRQ_SET_DATA_BOOL => {
                if data_len != count as usize {
                    return Err(ProtocolError::BadPayloadSize {
                        what: "DEVICE_SET_IRQS (DATA_BOOL)",
                        expected: SET_IRQS_SIZE + count as usize,
                        got: payload.len(),
                    });
                }
                if nfds != 0 {
                    return Err(ProtocolError::WrongFdCount {
                        what: "DEVICE_SET_IRQS (DATA_BOOL)",
                        expected: "0",
                        got: nfds,
                    });
                }
                SetIrqsData::Bool(r.rest().iter().map(|&b| b != 0).collect())
            }
            _ => {
                debug_assert_eq!(data_bits, VFIO_IRQ_SET_DATA_EVENTFD);
                if data_len != 0 {
                    return Err(ProtocolError::BadPayloadSize {
                        what: "DEVICE_SET_IRQS (DATA_EVENTFD)",
                        expected: SET_IRQS_SIZE,
                        got: payload.len(),
                    });
                }
                if (nfds != 0 && nfds != count as usize) || nfds > max_fds as usize {
                    return Err(ProtocolError::WrongFdCount {
                        what: "DEVICE_SET_IRQS (DATA_EVENTFD)",
                        expected: "0 or count (≤ max_msg_fds)",
                        got: nfds,
                    });
                }
                SetIrqsData::Eventfd { nfds }
            }
        };
        Ok(SetIrqsRequest {
            index,
            start,
            count,
            action,
            data,
        })
    }
}

/// Encode a SET_IRQS payload (for test clients); `bools` is appended as data.
pub fn encode_set_irqs(flags: u32, index: u32, start: u32, count: u32, bools: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(SET_IRQS_SIZE + bools.len());
    v.put_u32((SET_IRQS_SIZE + bools.len()) as u32);
    v.put_u32(flags);
    v.put_u32(index);
    v.put_u32(start);
    v.put_u32(count);
    v.extend_from_slice(bools);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const EV_TRIG: u32 = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;

    #[test]
    fn test_set_irqs_eventfd_trigger_with_fds_ok() {
        let p = encode_set_irqs(EV_TRIG, 1, 0, 2, &[]);
        let r = SetIrqsRequest::decode(&p, 2, 16).unwrap();
        assert_eq!(r.action, IrqAction::Trigger);
        assert_eq!(r.data, SetIrqsData::Eventfd { nfds: 2 });
        assert!(
            SetIrqsRequest::decode(&p, 0, 16).is_ok(),
            "0 fds de-assigns"
        );
        assert!(SetIrqsRequest::decode(&p, 1, 16).is_err());
        assert!(SetIrqsRequest::decode(&p, 2, 1).is_err());
    }

    #[test]
    fn test_set_irqs_disable_count_zero_ok_other_count_zero_rejected() {
        let p = encode_set_irqs(
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
            0,
            0,
            0,
            &[],
        );
        assert!(SetIrqsRequest::decode(&p, 0, 16).is_ok());
        let p = encode_set_irqs(
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_MASK,
            0,
            0,
            0,
            &[],
        );
        assert!(SetIrqsRequest::decode(&p, 0, 16).is_err());
        let p = encode_set_irqs(EV_TRIG, 0, 0, 0, &[]);
        assert!(SetIrqsRequest::decode(&p, 0, 16).is_err());
    }

    #[test]
    fn test_set_irqs_bool_data_length_checked() {
        let f = VFIO_IRQ_SET_DATA_BOOL | VFIO_IRQ_SET_ACTION_UNMASK;
        let p = encode_set_irqs(f, 2, 1, 2, &[1, 0]);
        let r = SetIrqsRequest::decode(&p, 0, 16).unwrap();
        assert_eq!(r.data, SetIrqsData::Bool(vec![true, false]));
        let p = encode_set_irqs(f, 2, 1, 3, &[1, 0]);
        assert!(SetIrqsRequest::decode(&p, 0, 16).is_err());
    }

    #[test]
    fn test_set_irqs_bad_flags_rejected() {
        for flags in [0, 3 | 32, 1 | 8 | 16, 1 | 64, 1] {
            let p = encode_set_irqs(flags, 0, 0, 1, &[]);
            assert!(SetIrqsRequest::decode(&p, 0, 16).is_err(), "{flags:#x}");
        }
        let p = encode_set_irqs(EV_TRIG, 0, u32::MAX, 2, &[]);
        assert!(SetIrqsRequest::decode(&p, 0, 16).is_err());
        let mut p = encode_set_irqs(EV_TRIG, 0, 0, 1, &[]);
        p[0] = 24;
        assert!(SetIrqsRequest::decode(&p, 1, 16).is_err(), "argsz mismatch");
    }
}
