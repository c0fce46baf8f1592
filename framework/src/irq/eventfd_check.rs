//! Checks on eventfds a client passes with SET_IRQS.
//!
//! The fd comes from an untrusted client. A pipe or a regular file in its place would make
//! our "signal" a write of 8 bytes somewhere, and a blocking eventfd whose counter the client
//! filled up would block the triggering thread forever. So an fd must be an eventfd, and it is
//! made non-blocking (kernel VFIO signals eventfds without ever blocking; QEMU creates its
//! eventfds non-blocking already, so this changes nothing for it).

use std::os::fd::AsRawFd;

use vmm_sys_util::eventfd::EventFd;

use crate::device::DeviceError;

/// What `/proc/self/fd/N` links to for an eventfd.
const EVENTFD_LINK: &str = "anon_inode:[eventfd]";

/// Accept `fd` only if it is an eventfd, and make it non-blocking.
pub(crate) fn check_eventfd(fd: &EventFd) -> Result<(), DeviceError> {
    let raw = fd.as_raw_fd();
    match std::fs::read_link(format!("/proc/self/fd/{raw}")) {
        Ok(target) if target.as_os_str() == EVENTFD_LINK => {}
        Ok(target) => {
            let msg = format!("fd is not an eventfd ({})", target.display());
            tracing::warn!("SET_IRQS: {msg}");
            return Err(DeviceError::InvalidArgument(msg));
        }
        // No /proc: cannot tell; the non-blocking flag below still bounds the damage.
        Err(e) => tracing::debug!(error = %e, "cannot inspect SET_IRQS fd"),
    }
    // SAFETY: F_GETFL on an fd we own; no memory is passed.
    let flags = unsafe { libc::fcntl(raw, libc::F_GETFL) };
    if flags < 0 {
        return Err(DeviceError::Io(std::io::Error::last_os_error()));
    }
    if flags & libc::O_NONBLOCK == 0 {
        // SAFETY: F_SETFL with the flags just read plus O_NONBLOCK, on an fd we own.
        if unsafe { libc::fcntl(raw, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
            return Err(DeviceError::Io(std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::{FromRawFd, IntoRawFd};

    #[test]
    fn test_check_eventfd_accepts_eventfd_and_makes_it_nonblocking() {
        let fd = EventFd::new(0).unwrap();
        check_eventfd(&fd).unwrap();
        // SAFETY: F_GETFL on a valid fd.
        let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        assert_ne!(flags & libc::O_NONBLOCK, 0);
        assert!(
            fd.read().is_err(),
            "reading an empty non-blocking eventfd fails"
        );
    }

    #[test]
    fn test_check_eventfd_rejects_a_regular_file() {
        let file = tempfile::tempfile().unwrap();
        // SAFETY: we own the file's fd and hand it to EventFd, which closes it.
        let fake = unsafe { EventFd::from_raw_fd(file.into_raw_fd()) };
        let e = check_eventfd(&fake).unwrap_err();
        assert_eq!(e.errno(), libc::EINVAL);
    }
}
