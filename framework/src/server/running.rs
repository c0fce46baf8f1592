//! [`Server`]: owns the device and the DMA space, accepts one client at a time; and the
//! [`RunningServer`] / [`ShutdownHandle`] returned by [`Server::spawn`].
//!
//! A client is *attached* from the moment its connection is accepted until that
//! connection's teardown has finished (DMA maps removed through the device's unmap
//! notifier, leftover pins force-released, IRQ fds dropped): [`RunningServer::client_attached`]
//! turns false only once nothing of the client is left. The flag is cleared by a guard
//! owned by the connection thread, so it is cleared however the thread ends (a panic
//! included). [`RunningServer::disconnect_client`] closes the client's socket the way
//! shutdown does, but the server keeps listening and serves the next client.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tracing::{error, info, info_span, warn};
use vmm_sys_util::eventfd::EventFd;

use super::channel::Channel;
use super::connection::Connection;
use super::listener::{AcceptBackoff, Accepted, SocketListener};
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
    /// True from accept until the connection's teardown has finished.
    attached: Mutex<bool>,
    /// Notified when `attached` turns false.
    detached: Condvar,
}

impl StopState {
    fn attached(&self) -> MutexGuard<'_, bool> {
        self.attached.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Close the active connection, if any; true if there was one to close.
    fn close_active(&self) -> bool {
        let chan = self
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(Weak::upgrade);
        match chan {
            Some(c) if !c.is_closed() => {
                c.close();
                true
            }
            _ => false,
        }
    }
}

/// Owned by a connection thread: marks the client detached when the thread ends, whether
/// it returns or unwinds.
struct AttachedGuard(Arc<StopState>);

impl Drop for AttachedGuard {
    fn drop(&mut self) {
        *self.0.attached() = false;
        self.0.detached.notify_all();
    }
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
        self.state.close_active();
    }
}

/// A server running on its own thread. Dropping it shuts the server down and waits.
pub struct RunningServer {
    path: PathBuf,
    shutdown: ShutdownHandle,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
    /// Weak: the device is dropped when the server thread ends, as it always was.
    device: Weak<Mutex<Box<dyn Device>>>,
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

    /// True once the server thread has ended (after a shutdown, or a fatal error); then
    /// [`RunningServer::join`] returns at once.
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// True while a client is attached: from its accept until its connection's teardown
    /// has finished (maps removed, pins released, IRQ fds dropped).
    pub fn client_attached(&self) -> bool {
        *self.shutdown.state.attached()
    }

    /// What the attached client's connection holds in its command backlog now (zero
    /// without a client; see `server::channel`).
    pub fn backlog(&self) -> super::BacklogUsage {
        self.shutdown
            .state
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .and_then(Weak::upgrade)
            .map(|c| c.backlog())
            .unwrap_or_default()
    }

    /// Wait up to `timeout` for the attached client (if any) to be gone, teardown done;
    /// true if no client is attached on return.
    pub fn wait_client_gone(&self, timeout: Duration) -> bool {
        let state = &self.shutdown.state;
        let deadline = Instant::now() + timeout;
        let mut attached = state.attached();
        while *attached {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            attached = state
                .detached
                .wait_timeout(attached, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// Close the attached client's connection without stopping the server: its
    /// connection thread finishes the message in hand, then runs the usual teardown
    /// (the device's unmap notifier, forced release of leftover pins, IRQ fds dropped),
    /// and the server accepts the next client. True if a connection was closed. Use
    /// [`RunningServer::wait_client_gone`] to wait for the teardown.
    pub fn disconnect_client(&self) -> bool {
        let closed = self.shutdown.state.close_active();
        if closed {
            info!(path = %self.path.display(), "disconnecting the client");
        }
        closed
    }

    /// Run `f` on the device, locked, as a connection's message handler would; the lock is
    /// waited for at most `within` (the connection thread holds it while it handles a
    /// message, and a stuck device holds it for ever). `None` if the server has ended or
    /// the device stayed busy. A client that connects meanwhile waits for the lock like any
    /// other caller: `f` never runs concurrently with a client's message.
    pub fn with_device<R>(
        &self,
        within: Duration,
        f: impl FnOnce(&mut dyn Device) -> R,
    ) -> Option<R> {
        let device = self.device.upgrade()?;
        let deadline = Instant::now() + within;
        loop {
            match device.try_lock() {
                Ok(mut d) => return Some(f(&mut **d)),
                Err(std::sync::TryLockError::Poisoned(p)) => return Some(f(&mut **p.into_inner())),
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => return None,
            }
        }
    }

    /// Ask the attached client to release the device ([`Device::request_release`]: the
    /// device-request IRQ for a PCI device). The device is locked for the call; the lock is
    /// waited for at most `within` (the connection thread holds it while it handles a
    /// message, and a stuck device holds it for ever). True if the request was signalled.
    pub fn request_release(&self, within: Duration) -> bool {
        let Some(device) = self.device.upgrade() else {
            return false;
        };
        let deadline = Instant::now() + within;
        loop {
            match device.try_lock() {
                Ok(mut d) => return d.request_release(),
                Err(std::sync::TryLockError::Poisoned(p)) => {
                    return p.into_inner().request_release()
                }
                Err(std::sync::TryLockError::WouldBlock) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(1));
                }
                Err(std::sync::TryLockError::WouldBlock) => {
                    warn!(
                        path = %self.path.display(),
                        "the device stayed busy: release request not signalled"
                    );
                    return false;
                }
            }
        }
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
        let device = Arc::new(Mutex::new(device));
        let state = Arc::new(StopState {
            stop: AtomicBool::new(false),
            wake: EventFd::new(libc::EFD_CLOEXEC)
                .map_err(|e| ServerError::io("creating the shutdown eventfd", e))?,
            active: Mutex::new(None),
            attached: Mutex::new(false),
            detached: Condvar::new(),
        });
        let path = listener.path().to_path_buf();
        info!(path = %path.display(), "listening");
        let st = state.clone();
        let config = self.config;
        let dma = self.dma;
        let weak_device = Arc::downgrade(&device);
        let thread = std::thread::Builder::new()
            .name("umdev-server".into())
            .spawn(move || accept_loop(listener, device, dma, config, st))
            .map_err(|e| ServerError::io("spawning the server thread", e))?;
        Ok(RunningServer {
            path,
            shutdown: ShutdownHandle { state },
            thread: Some(thread),
            device: weak_device,
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

/// Wait until `fd` is readable or `timeout` passes.
fn wait_readable_fd(fd: i32, timeout: Duration) -> std::io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n > 0)
}

fn accept_loop(
    listener: SocketListener,
    device: Arc<Mutex<Box<dyn Device>>>,
    dma: Arc<DmaSpace>,
    config: ServerConfig,
    state: Arc<StopState>,
) -> Result<(), ServerError> {
    let span = info_span!("server", socket = %listener.path().display());
    let _enter = span.enter();
    let mut current: Option<(Weak<Channel>, JoinHandle<()>)> = None;
    let mut backoff = AcceptBackoff::default();
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
        let stream = match listener.accept_with(&mut backoff, "device socket") {
            Accepted::Stream(s) => s,
            Accepted::Retry(w) => {
                if !w.is_zero() {
                    // Only a stop request ends the wait early.
                    let _ = wait_readable_fd(state.wake.as_raw_fd(), w);
                }
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
            stream.set_read_timeout((!t.is_zero()).then_some(t))?;
            let t = config.send_timeout;
            stream.set_write_timeout((!t.is_zero()).then_some(t))
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
            Ok(c) => Arc::new(c.with_limits(config.backlog, config.offer().max_msg_fds)),
            Err(e) => {
                warn!(error = %e, "cannot set up the client socket");
                continue;
            }
        };
        *state.active.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::downgrade(&chan));
        *state.attached() = true;
        // Dropped when the connection thread ends (or with the closure if it never starts).
        let attached = AttachedGuard(state.clone());
        let conn = Connection::new(chan.clone(), device.clone(), dma.clone(), config.clone());
        let span = span.clone();
        let slice = config.thread_slice;
        match std::thread::Builder::new()
            .name("umdev-conn".into())
            .spawn(move || {
                super::slice::apply(slice, "umdev-conn");
                let _attached = attached;
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
