//! The display, for a person: `umdev screenshot` (a scanout with the cursor, as PNG) and
//! `umdev view` (a live view in a browser, [`http`]), of a virtio-gpu instance of a daemon
//! or of the one device of `umdev run virtio-gpu --control PATH` ([`run_control`]); `umdev
//! run --view` serves the same view from the `run` process itself.
//!
//! Both commands send the control request `screenshot` (protocol-docs/lifecycle.md) to the
//! control socket of `--control` (or `UMDEV_CONTROL`, or the daemon's default), as every
//! client command does: a daemon needs the instance's UUID, `umdev run` takes none.

pub mod http;
pub mod run_control;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use umdev::daemon::client::{call_with_payload, ClientError};
use umdev::daemon::paths;
use umdev::daemon::protocol::{Reply, Request, ScreenshotReply};

use crate::daemon::client::Common;
use crate::CliResult;

/// Where the live view listens by default: this host only.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// Arguments of `umdev screenshot`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  umdev screenshot 6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11 -o screen.png
                                   an instance of the daemon (`umdev list` shows the UUIDs)
  umdev run virtio-gpu --socket /tmp/vgpu.sock --control /tmp/vgpu.ctl
  umdev screenshot --control /tmp/vgpu.ctl -o screen.png
                                   the device of `umdev run` (no UUID)
  umdev screenshot UUID -o - | display     the PNG on stdout

The picture is what the scanout shows when the request arrives, with the cursor drawn in.
It fails (status 1) for an unknown UUID, an instance without a display (only virtio-gpu
instances have one), a scanout the guest has not set yet, or an output that cannot be
written.")]
pub struct ScreenshotArgs {
    /// The instance's UUID (a daemon's); leave it out for `umdev run --control`.
    pub uuid: Option<String>,
    /// Where to write the PNG (`-`: stdout).
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: PathBuf,
    /// Which scanout (display), from 0.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub scanout: u32,
    #[command(flatten)]
    pub common: Common,
}

/// Arguments of `umdev resize`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  umdev resize 6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11 --size 1920x1080
                                   an instance of the daemon
  umdev resize --control /tmp/vgpu.ctl --size 1024x768
                                   the device of `umdev run virtio-gpu --control`

As plugging in another monitor: the device raises its display event, the guest's driver
reads the new mode (GET_DISPLAY_INFO and the EDID, which lists it as preferred) and a
desktop or fbcon switches to it. The guest allocates the new framebuffer within the
instance's resource memory: a mode larger than that budget allows is refused by the device
when the guest asks (ERR_OUT_OF_MEMORY), not here. Fails (status 1) for an unknown UUID, an
instance without a display, a scanout the device does not have, or a side outside 1-4095.")]
pub struct ResizeArgs {
    /// The instance's UUID (a daemon's); leave it out for `umdev run --control`.
    pub uuid: Option<String>,
    /// The new mode, WIDTHxHEIGHT in pixels (e.g. 1920x1080).
    #[arg(long, value_name = "WxH", value_parser = parse_size)]
    pub size: (u32, u32),
    /// Which scanout (display), from 0.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub scanout: u32,
    #[command(flatten)]
    pub common: Common,
}

/// `1920x1080` as (1920, 1080).
fn parse_size(s: &str) -> Result<(u32, u32), String> {
    let bad = || format!("{s:?} is not WIDTHxHEIGHT (e.g. 1920x1080)");
    let (w, h) = s.split_once(['x', 'X']).ok_or_else(bad)?;
    Ok((w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?))
}

/// Entry point of `umdev resize`.
pub fn resize(args: ResizeArgs) -> CliResult {
    let control = args
        .common
        .control
        .clone()
        .unwrap_or_else(paths::default_control);
    let (width, height) = args.size;
    let request = Request::Resize {
        uuid: args.uuid.clone(),
        scanout: args.scanout,
        width,
        height,
    };
    let reply = match call_with_payload(&control, &request, &[]) {
        Ok((Reply::Resized(r), _)) => r,
        Ok((other, _)) => {
            return Err(ClientError::Protocol {
                path: control,
                why: format!("a {other:?} reply to a resize request"),
            }
            .into())
        }
        Err(e) => {
            if let (true, ClientError::Daemon(error)) = (args.common.json, &e) {
                println!("{:#}", serde_json::json!({ "error": error }));
            }
            return Err(e.into());
        }
    };
    if args.common.json {
        println!("{:#}", serde_json::json!({ "resized": reply }));
    } else {
        let of = reply
            .uuid
            .as_ref()
            .map(|u| format!(" of {u}"))
            .unwrap_or_default();
        println!(
            "scanout {}{of} is now {}x{}: the guest's driver was told (display event)",
            reply.scanout, reply.width, reply.height
        );
    }
    Ok(())
}

/// Arguments of `umdev view`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  umdev view 6f1a0c36-5a0e-4c8e-9d1b-3f2b6c0e8a11      then open http://127.0.0.1:8080/
  umdev view --control /tmp/vgpu.ctl --listen 127.0.0.1:0    `umdev run`'s device, any port
  ssh -L 8080:127.0.0.1:8080 host                     from another machine, through SSH

Serves until Ctrl-C: GET / is a page that shows the scanout and fetches it again after each
picture (--interval-ms); GET /screen.png is the picture alone. Any other path is 404, any
other method 405. At most 8 connections at once, each with a 5 s deadline for its request;
pictures are taken from the daemon at most once per --interval-ms, however many viewers.
The view has no password: it listens on this host only unless --listen says otherwise.
`umdev run virtio-gpu --view ADDR:PORT` serves the same view from the run process.")]
pub struct ViewArgs {
    /// The instance's UUID (a daemon's); leave it out for `umdev run --control`.
    pub uuid: Option<String>,
    /// The address and port to serve the view on (port 0: any free one; the URL is logged).
    #[arg(long, value_name = "ADDR:PORT", default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// Which scanout (display), from 0.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub scanout: u32,
    /// How long the page waits after a picture before it asks for the next, ms.
    #[arg(long, value_name = "MS", default_value_t = 200,
          value_parser = clap::value_parser!(u64).range(20..=60_000))]
    pub interval_ms: u64,
    /// The daemon's control socket, or `umdev run --control`'s [default:
    /// <socket-dir>/control.sock, the daemon's default].
    #[arg(long, value_name = "PATH", env = paths::CONTROL_ENV)]
    pub control: Option<PathBuf>,
}

/// Ask the control socket `control` for scanout `scanout` of `uuid`: the reply and the PNG.
pub fn fetch(
    control: &Path,
    uuid: Option<&str>,
    scanout: u32,
) -> Result<(ScreenshotReply, Vec<u8>), ClientError> {
    let request = Request::Screenshot {
        uuid: uuid.map(str::to_owned),
        scanout,
    };
    match call_with_payload(control, &request, &[])? {
        (Reply::Screenshot(r), png) => Ok((r, png)),
        (other, _) => Err(ClientError::Protocol {
            path: control.to_path_buf(),
            why: format!("a {other:?} reply to a screenshot request"),
        }),
    }
}

/// Entry point of `umdev screenshot`.
pub fn screenshot(args: ScreenshotArgs) -> CliResult {
    let control = args
        .common
        .control
        .clone()
        .unwrap_or_else(paths::default_control);
    let (reply, png) = match fetch(&control, args.uuid.as_deref(), args.scanout) {
        Ok(r) => r,
        Err(e) => {
            if let (true, ClientError::Daemon(error)) = (args.common.json, &e) {
                println!("{:#}", serde_json::json!({ "error": error }));
            }
            return Err(e.into());
        }
    };
    let to_stdout = args.output.as_os_str() == "-";
    let written = if to_stdout {
        std::io::stdout().lock().write_all(&png)
    } else {
        std::fs::write(&args.output, &png)
    };
    written.map_err(|e| format!("cannot write {}: {e}", args.output.display()))?;
    let what = match &reply.uuid {
        Some(u) => format!("scanout {} of {u}", reply.scanout),
        None => format!("scanout {}", reply.scanout),
    };
    if args.common.json && !to_stdout {
        let report = serde_json::json!({ "screenshot": {
            "uuid": reply.uuid,
            "scanout": reply.scanout,
            "width": reply.width,
            "height": reply.height,
            "png_bytes": reply.png_len,
            "path": args.output,
        }});
        println!("{report:#}");
    } else if !to_stdout {
        println!(
            "{what} ({}x{}) written to {}",
            reply.width,
            reply.height,
            args.output.display()
        );
    }
    Ok(())
}

/// Entry point of `umdev view`.
pub fn view(args: ViewArgs) -> CliResult {
    let control = args.control.clone().unwrap_or_else(paths::default_control);
    // Said now rather than in the browser: the daemon is there and has this display.
    let (first, _) = match fetch(&control, args.uuid.as_deref(), args.scanout) {
        Ok(r) => r,
        // A display that shows nothing yet may show something soon: serve anyway.
        Err(ClientError::Daemon(e))
            if e.kind == umdev::daemon::protocol::ErrorKind::NothingShown =>
        {
            tracing::warn!("{}", e.message);
            let reply = ScreenshotReply {
                uuid: args.uuid.clone(),
                scanout: args.scanout,
                width: 0,
                height: 0,
                png_len: 0,
            };
            (reply, Vec::new())
        }
        Err(e) => return Err(e.into()),
    };
    let title = match &first.uuid {
        Some(u) => format!("{u}, scanout {}", args.scanout),
        None => format!(
            "umdev run ({}), scanout {}",
            control.display(),
            args.scanout
        ),
    };
    let interval = Duration::from_millis(args.interval_ms);
    let (uuid, scanout) = (args.uuid.clone(), args.scanout);
    let source: http::FrameSource = Box::new(move || {
        fetch(&control, uuid.as_deref(), scanout)
            .map(|(_, png)| Arc::new(png))
            .map_err(|e| e.to_string())
    });
    let view = http::View::spawn(
        http::ViewConfig {
            listen: args.listen,
            title,
            interval,
        },
        Arc::new(http::FrameCache::new(source, interval)),
    )
    .map_err(|e| format!("cannot serve the view on {}: {e}", args.listen))?;
    tracing::info!("live view on {} (Ctrl-C to stop)", view.url());
    loop {
        std::thread::park();
    }
}
