//! `umdev run virtio-gpu --control PATH`: a control socket for the one device of `run`, so
//! that `umdev screenshot --control PATH` and `umdev view --control PATH` work as they do
//! against a daemon. It speaks the daemon's control protocol, with its bounds
//! ([`umdev::daemon::Control`]: owner-only socket, deadlines, a connection limit), and
//! answers `screenshot` and `resize` without a UUID; every other request is refused as
//! unsupported.

use std::path::Path;
use std::sync::Arc;

use umdev::daemon::protocol::{
    ControlError, ErrorKind, Reply, Request, ResizedReply, ScreenshotReply,
};
use umdev::daemon::{Control, ControlConfig, ControlHandler, Payload};
use umdev::server::listener::SocketListener;
use umdev_devices::virtio_gpu::{ShotError, VirtioGpuHandle};

/// Answers `screenshot` from the display of `umdev run`'s device.
pub struct RunControl {
    display: VirtioGpuHandle,
}

impl RunControl {
    /// Serve the control socket `path` (mode 0600) for `display`.
    pub fn spawn(path: &Path, display: VirtioGpuHandle) -> Result<Control, String> {
        let listener = SocketListener::bind(path, 0o600)
            .map_err(|e| format!("cannot serve the control socket {}: {e}", path.display()))?;
        Control::spawn(
            listener,
            Arc::new(RunControl { display }),
            ControlConfig::default(),
        )
        .map_err(|e| format!("cannot serve the control socket {}: {e}", path.display()))
    }
}

/// The error for a request naming an instance: `umdev run` serves one device, no UUIDs.
fn no_instance(uuid: &str) -> ControlError {
    ControlError::new(
        ErrorKind::NoSuchInstance,
        format!("this is `umdev run`'s control socket: one device, no instance {uuid}"),
    )
}

impl ControlHandler for RunControl {
    fn handle(
        &self,
        request: Request,
        _payload: Vec<u8>,
    ) -> Result<(Reply, Payload), ControlError> {
        match request {
            Request::Screenshot { uuid: Some(u), .. } => Err(no_instance(&u)
                .hint("leave out the UUID (`umdev screenshot --control PATH -o FILE`)")),
            Request::Screenshot {
                uuid: None,
                scanout,
            } => {
                let shot = self.display.screenshot_png(scanout).map_err(|e| {
                    let kind = match e {
                        ShotError::Encode(_) => ErrorKind::Internal,
                        _ => ErrorKind::NothingShown,
                    };
                    let err = ControlError::new(kind, format!("scanout {scanout} {e}"));
                    match kind {
                        ErrorKind::NothingShown => err.hint(
                            "the guest's driver sets a scanout when it starts (the console or a \
                             desktop); try again once the guest has booted",
                        ),
                        _ => err,
                    }
                })?;
                let reply = ScreenshotReply {
                    uuid: None,
                    scanout,
                    width: shot.width,
                    height: shot.height,
                    png_len: shot.png.len() as u64,
                };
                Ok((Reply::Screenshot(reply), Arc::new(shot.png)))
            }
            Request::Resize { uuid: Some(u), .. } => Err(no_instance(&u)
                .hint("leave out the UUID (`umdev resize --control PATH --size WxH`)")),
            Request::Resize {
                uuid: None,
                scanout,
                width,
                height,
            } => {
                self.display
                    .resize(scanout as usize, width, height)
                    .map_err(|e| {
                        ControlError::new(ErrorKind::BadParam, format!("scanout {scanout}: {e}"))
                    })?;
                tracing::info!(scanout, width, height, "display resized from the host");
                let reply = ResizedReply {
                    uuid: None,
                    scanout,
                    width,
                    height,
                };
                Ok((Reply::Resized(reply), Payload::default()))
            }
            _ => Err(ControlError::new(
                ErrorKind::Unsupported,
                "this is `umdev run`'s control socket: it answers `umdev screenshot`, \
                 `umdev view` and `umdev resize` only",
            )
            .hint("the instance commands (`umdev list`, `create`, ...) are `umdev daemon`'s")),
        }
    }
}
