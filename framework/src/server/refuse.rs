//! Refusing a second simultaneous client with a clear error instead of a silent hang-up:
//! its first command (normally VERSION) is answered with an EBUSY error reply, then the
//! socket is closed. The first client's session is not touched. At most a few refusals
//! run at once (each on a short-lived thread with a half-second budget); beyond that a
//! client is simply closed.

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tracing::warn;

use super::socket_io::{discard, header_of, recv_header, send_message};
use crate::protocol::{FLAGS_TYPE_COMMAND, FLAGS_TYPE_MASK, HEADER_SIZE};

static REFUSING: AtomicUsize = AtomicUsize::new(0);
const MAX_REFUSING: usize = 4;
const BUDGET: Duration = Duration::from_millis(500);
/// Largest payload read and dropped before answering (more is left unread).
const MAX_DISCARD: usize = 64 * 1024;

/// Answer `stream`'s first command with EBUSY and close it (on a helper thread).
pub(super) fn refuse_busy(stream: UnixStream) {
    warn!("refusing a second client with EBUSY: one client is already connected");
    if REFUSING.fetch_add(1, Ordering::AcqRel) >= MAX_REFUSING {
        REFUSING.fetch_sub(1, Ordering::AcqRel);
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("umdev-refuse".into())
        .spawn(move || {
            answer_busy(&stream);
            REFUSING.fetch_sub(1, Ordering::AcqRel);
        });
    if spawned.is_err() {
        REFUSING.fetch_sub(1, Ordering::AcqRel);
    }
}

fn answer_busy(stream: &UnixStream) {
    if stream.set_nonblocking(false).is_err()
        || stream.set_read_timeout(Some(BUDGET)).is_err()
        || stream.set_write_timeout(Some(BUDGET)).is_err()
    {
        return;
    }
    // Fds that came with the message are closed when `raw` drops.
    if let Ok(Some(raw)) = recv_header(stream) {
        let h = header_of(&raw);
        let payload = (h.msg_size as usize).saturating_sub(HEADER_SIZE);
        if payload <= MAX_DISCARD {
            let _ = discard(stream, payload);
        }
        if h.flags & FLAGS_TYPE_MASK == FLAGS_TYPE_COMMAND && !h.no_reply() {
            let _ = send_message(stream, &h.error_reply(libc::EBUSY).encode(), &[]);
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}
