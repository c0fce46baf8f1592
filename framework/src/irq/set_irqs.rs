//! Applying a SET_IRQS request to the interrupt state.
//!
//! | action  | DATA_NONE                       | DATA_BOOL           | DATA_EVENTFD            |
//! |---------|---------------------------------|---------------------|-------------------------|
//! | TRIGGER | fire each vector; count 0 = disable the index (detach its eventfds) | fire where true | attach (`Some`) / detach (`None`) per vector |
//! | MASK    | mask each vector                | mask where true     | EINVAL                  |
//! | UNMASK  | unmask each vector (fires a pending one) | unmask where true | INTx only: each signal of the fd unmasks (KVM irqfd resample) |
//!
//! MASK/UNMASK apply to INTx, MSI and MSI-X (a client mask separate from the guest's); ERR
//! and REQ accept TRIGGER only.

use std::sync::Arc;

use crate::device::{irq_index, DeviceError, IrqAction, IrqData, SetIrqs};

use super::eventfd_check::check_eventfd;
use super::state::IrqState;
use super::vector_set::MaskSource;
use super::IrqMode;

fn invalid(msg: String) -> DeviceError {
    tracing::warn!("SET_IRQS: {msg}");
    DeviceError::InvalidArgument(msg)
}

impl IrqState {
    /// Validate and apply one SET_IRQS request.
    pub(crate) fn set_irqs(self: &Arc<Self>, req: SetIrqs) -> Result<(), DeviceError> {
        let SetIrqs {
            index,
            start,
            count,
            action,
            data,
        } = req;
        let counts = self.counts();
        let max = *counts
            .get(index as usize)
            .ok_or_else(|| invalid(format!("IRQ index {index} does not exist")))?;
        let disable = count == 0 && action == IrqAction::Trigger && matches!(data, IrqData::None);
        if disable && start == 0 {
            tracing::debug!(index, "SET_IRQS: disable index");
            self.eventfds.clear_index(index);
            if index == irq_index::INTX {
                self.clear_intx_resample();
                self.intx.clear_mask();
            }
            return Ok(());
        }
        let end = start
            .checked_add(count)
            .filter(|&end| end <= max)
            .ok_or_else(|| {
                invalid(format!(
                    "IRQ index {index}: vectors {start}+{count} exceed its {max} vectors"
                ))
            })?;
        let data_len = match &data {
            IrqData::None => None,
            IrqData::Bool(flags) => Some(flags.len()),
            IrqData::Eventfd(fds) => Some(fds.len()),
        };
        if data_len.is_some_and(|n| n != count as usize) {
            return Err(invalid(format!(
                "IRQ index {index}: {} data entries for {count} vectors",
                data_len.unwrap_or(0)
            )));
        }
        if let IrqData::Eventfd(fds) = &data {
            // All-or-nothing: check every fd before attaching any.
            for fd in fds.iter().flatten() {
                check_eventfd(fd)?;
            }
        }
        let selected: Vec<u32> = match &data {
            IrqData::None => (start..end).collect(),
            IrqData::Bool(flags) => (start..end)
                .zip(flags.iter())
                .filter(|(_, &f)| f)
                .map(|(v, _)| v)
                .collect(),
            IrqData::Eventfd(_) => Vec::new(),
        };
        match (action, data) {
            (IrqAction::Trigger, IrqData::Eventfd(fds)) => {
                for (vector, fd) in (start..end).zip(fds) {
                    tracing::debug!(index, vector, attach = fd.is_some(), "SET_IRQS eventfd");
                    self.eventfds.set(index, vector, fd);
                }
                if index == irq_index::INTX && self.mode() == IrqMode::Intx {
                    // A trigger nobody heard is still pending (level semantics).
                    self.intx.retry(|| self.send_intx());
                }
                Ok(())
            }
            (IrqAction::Trigger, _) => {
                for v in selected {
                    self.eventfds.fire(index, v);
                }
                Ok(())
            }
            (IrqAction::Unmask, IrqData::Eventfd(fds)) if index == irq_index::INTX => {
                // count is 1 here (INTx has one vector and the length matched).
                let fd = fds.into_iter().next().flatten();
                tracing::debug!(attach = fd.is_some(), "SET_IRQS: INTx unmask eventfd");
                self.set_intx_resample(fd)
            }
            (IrqAction::Unmask, IrqData::Eventfd(_)) => Err(invalid(format!(
                "IRQ index {index}: unmask eventfds exist for INTx only"
            ))),
            (IrqAction::Mask, IrqData::Eventfd(_)) => Err(invalid(format!(
                "IRQ index {index}: MASK takes no eventfds"
            ))),
            (action, _) => {
                let masked = action == IrqAction::Mask;
                for v in selected {
                    self.set_client_mask(index, v, masked)?;
                }
                Ok(())
            }
        }
    }

    fn set_client_mask(&self, index: u32, vector: u32, masked: bool) -> Result<(), DeviceError> {
        match index {
            irq_index::INTX if masked => self.intx.mask(),
            irq_index::INTX => self.intx.unmask(|| self.send_intx()),
            irq_index::MSI => self
                .msi
                .set_mask(MaskSource::Client, vector, masked, |v| self.send_msi(v)),
            irq_index::MSIX => self
                .msix
                .set_mask(MaskSource::Client, vector, masked, |v| self.send_msix(v)),
            _ => {
                return Err(invalid(format!(
                    "IRQ index {index} can only be triggered, not masked"
                )))
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmm_sys_util::eventfd::EventFd;

    fn efd() -> EventFd {
        EventFd::new(libc::EFD_NONBLOCK).unwrap()
    }

    fn req(index: u32, start: u32, count: u32, action: IrqAction, data: IrqData) -> SetIrqs {
        SetIrqs {
            index,
            start,
            count,
            action,
            data,
        }
    }

    #[test]
    fn test_set_irqs_vectors_past_count_are_rejected() {
        let s = Arc::new(IrqState::new(true, 4, 8));
        let bad = [
            req(irq_index::MSI, 2, 3, IrqAction::Trigger, IrqData::None),
            req(
                irq_index::MSIX,
                u32::MAX,
                2,
                IrqAction::Trigger,
                IrqData::None,
            ),
            req(irq_index::ERR, 0, 2, IrqAction::Trigger, IrqData::None),
            req(7, 0, 1, IrqAction::Trigger, IrqData::None),
            req(
                irq_index::MSI,
                0,
                2,
                IrqAction::Trigger,
                IrqData::Bool(vec![true]),
            ),
        ];
        for r in bad {
            let e = s.set_irqs(r).unwrap_err();
            assert_eq!(e.errno(), libc::EINVAL);
        }
    }

    #[test]
    fn test_set_irqs_mask_on_err_index_is_rejected() {
        let s = Arc::new(IrqState::new(false, 0, 0));
        let e = s
            .set_irqs(req(irq_index::ERR, 0, 1, IrqAction::Mask, IrqData::None))
            .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
    }

    #[test]
    fn test_set_irqs_unmask_eventfd_on_msi_is_rejected() {
        let s = Arc::new(IrqState::new(true, 1, 0));
        let e = s
            .set_irqs(req(
                irq_index::MSI,
                0,
                1,
                IrqAction::Unmask,
                IrqData::Eventfd(vec![Some(efd())]),
            ))
            .unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
    }

    fn wait_readable(fd: &EventFd) -> bool {
        use std::os::fd::AsRawFd;
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd on the stack.
        unsafe { libc::poll(&mut p, 1, 5000) == 1 }
    }

    #[test]
    fn test_set_irqs_intx_resample_eventfd_unmasks_and_refires() {
        let s = Arc::new(IrqState::new(true, 0, 0));
        let trigger = efd();
        let resample = efd();
        s.set_irqs(req(
            irq_index::INTX,
            0,
            1,
            IrqAction::Trigger,
            IrqData::Eventfd(vec![Some(trigger.try_clone().unwrap())]),
        ))
        .unwrap();
        s.set_irqs(req(
            irq_index::INTX,
            0,
            1,
            IrqAction::Unmask,
            IrqData::Eventfd(vec![Some(resample.try_clone().unwrap())]),
        ))
        .unwrap();
        assert!(s.has_intx_resample());
        assert!(s.trigger(0));
        assert_eq!(trigger.read().unwrap(), 1);
        assert!(!s.trigger(0), "automasked: pending");
        resample.write(1).unwrap(); // the guest's EOI, via KVM
        assert!(
            wait_readable(&trigger),
            "pending INTx re-fired after resample"
        );
        assert_eq!(trigger.read().unwrap(), 1);
        s.set_irqs(req(
            irq_index::INTX,
            0,
            0,
            IrqAction::Trigger,
            IrqData::None,
        ))
        .unwrap();
        assert!(!s.has_intx_resample(), "disabling INTx stops the watcher");
    }

    #[test]
    fn test_set_irqs_bool_trigger_fires_selected_vectors_only() {
        let s = Arc::new(IrqState::new(false, 0, 4));
        let fds: Vec<EventFd> = (0..4).map(|_| efd()).collect();
        let attach = fds.iter().map(|f| Some(f.try_clone().unwrap())).collect();
        s.set_irqs(req(
            irq_index::MSIX,
            0,
            4,
            IrqAction::Trigger,
            IrqData::Eventfd(attach),
        ))
        .unwrap();
        s.set_irqs(req(
            irq_index::MSIX,
            1,
            3,
            IrqAction::Trigger,
            IrqData::Bool(vec![false, true, false]),
        ))
        .unwrap();
        let fired: Vec<bool> = fds.iter().map(|f| f.read().is_ok()).collect();
        assert_eq!(fired, vec![false, false, true, false]);
    }

    #[test]
    fn test_set_irqs_count_zero_trigger_disables_index() {
        let s = Arc::new(IrqState::new(false, 2, 0));
        s.set_irqs(req(
            irq_index::MSI,
            0,
            2,
            IrqAction::Trigger,
            IrqData::Eventfd(vec![Some(efd()), Some(efd())]),
        ))
        .unwrap();
        s.set_irqs(req(irq_index::MSI, 0, 0, IrqAction::Trigger, IrqData::None))
            .unwrap();
        assert!(!s.eventfds.is_attached(irq_index::MSI, 0));
        assert!(!s.eventfds.is_attached(irq_index::MSI, 1));
    }

    #[test]
    fn test_set_irqs_detach_with_none_entry() {
        let s = Arc::new(IrqState::new(false, 0, 0));
        s.set_irqs(req(
            irq_index::ERR,
            0,
            1,
            IrqAction::Trigger,
            IrqData::Eventfd(vec![Some(efd())]),
        ))
        .unwrap();
        assert!(s.eventfds.is_attached(irq_index::ERR, 0));
        s.set_irqs(req(
            irq_index::ERR,
            0,
            1,
            IrqAction::Trigger,
            IrqData::Eventfd(vec![None]),
        ))
        .unwrap();
        assert!(!s.eventfds.is_attached(irq_index::ERR, 0));
    }
}
