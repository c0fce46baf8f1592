//! [`Server`]: owns the device and the DMA space, accepts one client at a time; and the
//! [`RunningServer`] / [`ShutdownHandle`] returned by [`Server::spawn`].

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use tracing::{error, info, info_span, warn};
use vmm_sys_util::eventfd::EventFd;

use super::channel::Channel;
use super::connection::Connection;
use super::listener::SocketListener;
use super::{ServerConfig, ServerError};
use crate::device::Device;
use crate::dma::DmaSpace;

/// A vfio-user server for one device.
pub struct Server {
    config: ServerConfig,
    device: Box<dyn Device>,
    dma: Arc<DmaSpace>,
}

#[derive(Debug)]
struct StopState {
    stop: AtomicBool,
    wake: EventFd,
    /// Weak: the connection's socket fds close as soon as its thread ends, not when
    /// the next client arrives.
    active: Mutex<Option<Weak<Channel>>>,
}

/// Stops a running server: closes the active connection and the listener.
#[derive(Clone, Debug)]
pub struct ShutdownHandle {
    state: Arc<StopState>,
}

impl ShutdownHandle {
    /// Ask the server to stop (returns at once; join the server to wait).
    pub fn shutdown(&self) {
        self.state.stop.store(true, Ordering::Release);
        let _ = self.state.wake.write(1);
        if let Some(c) = self
            .state
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(Weak::upgrade)
        {
            c.close();
        }
    }
}

/// A server running on its own thread. Dropping it shuts the server down and waits.
pub struct RunningServer {
    path: PathBuf,
    shutdown: ShutdownHandle,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
}

impl RunningServer {
    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A handle that stops the server from anywhere (e.g. a Ctrl-C handler).
    pub fn shutdown_handle(&self) -> ShutdownHandle {
        self.shutdown.clone()
    }

    /// Wait for the server thread to end (after a shutdown).
    pub fn join(mut self) -> Result<(), ServerError> {
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| ServerError::Panicked)?,
            None => Ok(()),
        }
    }

    /// Stop the server and wait for it.
    pub fn shutdown(self) -> Result<(), ServerError> {
        self.shutdown.shutdown();
        self.join()
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.shutdown.shutdown();
            let _ = t.join();
        }
    }
}

impl Server {
    /// A server for `device`, applying DMA to `dma` (which outlives client connections).
    ///
    /// The max_dma_maps offered in VERSION is the smaller of `config.max_dma_maps` and the
    /// DMA space's own limit, and the negotiated value is what the DMA space enforces.
    pub fn new(mut config: ServerConfig, device: Box<dyn Device>, dma: Arc<DmaSpace>) -> Server {
        config.max_dma_maps = config.max_dma_maps.min(dma.max_dma_maps());
        Server {
            config,
            device,
            dma,
        }
    }

    /// Bind the socket, attach the device to the DMA space, and serve on a new thread.
    pub fn spawn(self) -> Result<RunningServer, ServerError> {
        let listener = SocketListener::bind(&self.config.socket_path, self.config.socket_mode)?;
        listener
            .listener
            .set_nonblocking(true)
            .map_err(|e| ServerError::io("configuring the listener", e))?;
        let mut device = self.device;
        device.attach(self.dma.handle());
        let state = Arc::new(StopState {
            stop: AtomicBool::new(false),
            wake: EventFd::new(libc::EFD_CLOEXEC)
                .map_err(|e| ServerError::io("creating the shutdown eventfd", e))?,
            active: Mutex::new(None),
        });
        let path = listener.path().to_path_buf();
        info!(path = %path.display(), "listening");
        let st = state.clone();
        let config = self.config;
        let dma = self.dma;
        let thread = std::thread::Builder::new()
            .name("umdev-server".into())
            .spawn(move || accept_loop(listener, device, dma, config, st))
            .map_err(|e| ServerError::io("spawning the server thread", e))?;
        Ok(RunningServer {
            path,
            shutdown: ShutdownHandle { state },
            thread: Some(thread),
        })
    }

    /// Serve until the process ends, blocking the caller. Use [`Server::spawn`] to get a
    /// [`ShutdownHandle`] and stop the server cleanly.
    pub fn run(self) -> Result<(), ServerError> {
        self.spawn()?.join()
    }
}

fn poll_two(a: i32, b: i32) -> std::io::Result<(bool, bool)> {
    let mut fds = [
        libc::pollfd {
            fd: a,
            events: libc::POLLIN,
            revents: 0,
        },
        libc::pollfd {
            fd: b,
            events: libc::POLLIN,
            revents: 0,
        },
    ];
    // SAFETY: two valid pollfd entries.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == std::io::ErrorKind::Interrupted {
            return Ok((false, false));
        }
        return Err(e);
    }
    Ok((fds[0].revents != 0, fds[1].revents != 0))
}

fn accept_loop(
    listener: SocketListener,
    device: Box<dyn Device>,
    dma: Arc<DmaSpace>,
    config: ServerConfig,
    state: Arc<StopState>,
) -> Result<(), ServerError> {
    let span = info_span!("server", socket = %listener.path().display());
    let _enter = span.enter();
    let device = Arc::new(Mutex::new(device));
    let mut current: Option<(Weak<Channel>, JoinHandle<()>)> = None;
    let result = loop {
        if state.stop.load(Ordering::Acquire) {
            break Ok(());
        }
        let (incoming, _woken) =
            match poll_two(listener.listener.as_raw_fd(), state.wake.as_raw_fd()) {
                Ok(v) => v,
                Err(e) => break Err(ServerError::io("waiting for clients", e)),
            };
        if state.stop.load(Ordering::Acquire) {
            break Ok(());
        }
        if !incoming {
            continue;
        }
        let stream = match listener.listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                warn!(error = %e, "accept failed");
                continue;
            }
        };
        if let Some((chan, thread)) = current.take() {
            // A client that just hung up may not have been noticed yet: give its
            // connection a moment to wind down before calling the new one a second client.
            let mut waited = Duration::ZERO;
            let closed = |c: &Weak<Channel>| c.upgrade().is_none_or(|c| c.is_closed());
            while !thread.is_finished() && !closed(&chan) && waited < Duration::from_millis(100) {
                std::thread::sleep(Duration::from_millis(2));
                waited += Duration::from_millis(2);
            }
            if !thread.is_finished() && !closed(&chan) {
                super::refuse::refuse_busy(stream);
                current = Some((chan, thread));
                continue;
            }
            let _ = thread.join();
        }
        if let Err(e) = stream.set_nonblocking(false).and_then(|()| {
            let t = config.negotiation_timeout;
            stream.set_read_timeout((!t.is_zero()).then_some(t))
        }) {
            warn!(error = %e, "cannot configure the client socket");
            continue;
        }
        let chan = match Channel::new(
            stream,
            config.max_message_size(),
            config.offer().max_data_xfer_size,
            config.remote_dma_timeout,
        ) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                warn!(error = %e, "cannot set up the client socket");
                continue;
            }
        };
        *state.active.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::downgrade(&chan));
        let conn = Connection::new(chan.clone(), device.clone(), dma.clone(), config.clone());
        let span = span.clone();
        match std::thread::Builder::new()
            .name("umdev-conn".into())
            .spawn(move || {
                let _e = span.enter();
                conn.run()
            }) {
            Ok(t) => current = Some((Arc::downgrade(&chan), t)),
            Err(e) => error!(error = %e, "cannot spawn the connection thread"),
        }
    };
    if let Some((chan, thread)) = current.take() {
        if let Some(c) = chan.upgrade() {
            c.close();
        }
        let _ = thread.join();
    }
    *state.active.lock().unwrap_or_else(|p| p.into_inner()) = None;
    info!("server stopped");
    drop(listener);
    result
}
