//! One client connection: negotiation, the message loop, and teardown on disconnect.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use std::panic::{catch_unwind, AssertUnwindSafe};

use tracing::{debug, debug_span, error, info, warn};

use super::channel::{Channel, Incoming, RequestHold, SPARE_PAYLOAD_MAX};
use super::error::error_chain;
use super::remote_dma::ClientDma;
use super::{ServerConfig, ServerError};
use crate::device::{Device, DeviceInfo};
use crate::dma::DmaSpace;
use crate::migration::Machine;
use crate::protocol::dma_rw::DmaRwLayout;
use crate::protocol::version::{negotiate, Version};
use crate::protocol::{decode_request, Command, Header, Limits, Request, HEADER_SIZE};

/// A reply being built: the whole message buffer (16 header bytes reserved) and the fds
/// that go with it.
#[derive(Debug)]
pub struct Reply {
    buf: Vec<u8>,
    fds: Vec<Arc<OwnedFd>>,
}

impl Reply {
    /// An empty reply with room for `payload` bytes.
    pub fn with_capacity(payload: usize) -> Reply {
        let mut buf = Vec::with_capacity(HEADER_SIZE + payload);
        buf.resize(HEADER_SIZE, 0);
        Reply {
            buf,
            fds: Vec::new(),
        }
    }

    /// A reply carrying `payload`.
    pub fn from_payload(payload: &[u8]) -> Reply {
        let mut r = Reply::with_capacity(payload.len());
        r.buf.extend_from_slice(payload);
        r
    }

    /// A reply without payload.
    pub fn empty() -> Reply {
        Reply::with_capacity(0)
    }

    /// The buffer (payload appended after the reserved header).
    pub fn buf_mut(&mut self) -> &mut Vec<u8> {
        &mut self.buf
    }

    /// Attach an fd.
    pub fn attach(&mut self, fd: Arc<OwnedFd>) {
        self.fds.push(fd);
    }

    /// An empty reply built in `buf`'s storage (its capacity is reused).
    fn in_buffer(mut buf: Vec<u8>, payload: usize) -> Reply {
        buf.clear();
        buf.reserve(HEADER_SIZE + payload);
        buf.resize(HEADER_SIZE, 0);
        Reply {
            buf,
            fds: Vec::new(),
        }
    }

    fn finish(&mut self, request: &Header) -> &[u8] {
        let h = request.reply(self.buf.len() - HEADER_SIZE);
        self.buf[..HEADER_SIZE].copy_from_slice(&h.encode());
        &self.buf
    }
}

/// State of one connection, owned by its connection thread.
pub struct Connection {
    pub(super) chan: Arc<Channel>,
    pub(super) device: Arc<Mutex<Box<dyn Device>>>,
    pub(super) dma: Arc<DmaSpace>,
    pub(super) config: ServerConfig,
    pub(super) limits: Limits,
    pub(super) negotiated: bool,
    pub(super) info: DeviceInfo,
    /// Sum of the sizes of this client's live DMA maps.
    pub(super) mapped_bytes: u64,
    /// The migration state machine, if the device migrates (`migration.rs`).
    pub(super) migration: Option<Machine>,
    /// Server→client requests refused while the device is stopped for migration.
    pub(super) mig_hold: Option<RequestHold>,
    twin_thread: Option<JoinHandle<()>>,
    /// The last reply's buffer, reused by the next one (the payload buffer is reused by
    /// `run` the same way): no allocation per message on the hot path; at most
    /// [`SPARE_PAYLOAD_MAX`] bytes of payload are kept.
    spare_reply: Vec<u8>,
}

pub(super) fn lock_device(m: &Mutex<Box<dyn Device>>) -> MutexGuard<'_, Box<dyn Device>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Connection {
    /// A connection over `chan`.
    pub fn new(
        chan: Arc<Channel>,
        device: Arc<Mutex<Box<dyn Device>>>,
        dma: Arc<DmaSpace>,
        config: ServerConfig,
    ) -> Connection {
        let offer = config.offer();
        let limits = Limits {
            max_data_xfer_size: offer.max_data_xfer_size,
            max_msg_fds: offer.max_msg_fds,
            pgsize: config.pgsize,
            write_multiple: false,
        };
        let (info, migration) = {
            let mut dev = lock_device(&device);
            let migration = dev.migration().map(|m| Machine::new(m.caps()));
            (dev.info(), migration)
        };
        Connection {
            chan,
            device,
            dma,
            config,
            limits,
            negotiated: false,
            info,
            mapped_bytes: 0,
            migration,
            mig_hold: None,
            twin_thread: None,
            spare_reply: Vec::new(),
        }
    }

    /// An empty reply with room for `payload` bytes, in the previous reply's buffer.
    pub(super) fn reply(&mut self, payload: usize) -> Reply {
        Reply::in_buffer(std::mem::take(&mut self.spare_reply), payload)
    }

    /// Keep `buf` for the next reply if it is small.
    fn recycle_reply(&mut self, buf: Vec<u8>) {
        if buf.capacity() <= HEADER_SIZE + SPARE_PAYLOAD_MAX {
            self.spare_reply = buf;
        }
    }

    /// Serve until the client disconnects, then release its DMA maps and IRQ fds. A panic
    /// in the device while handling a message is answered with EIO and ends the connection
    /// (with the usual teardown), not the server.
    pub fn run(mut self) {
        info!("client connected");
        // Requests the device makes from this thread follow stricter rules (channel docs).
        self.chan.bind_connection_thread();
        self.chan.set_poll(self.config.poll);
        let mut spare = Vec::new();
        while let Some(mut m) = self.chan.next_command_reusing(&mut spare) {
            let payload = std::mem::take(&mut m.payload);
            self.handle(m, &payload);
            if payload.capacity() <= SPARE_PAYLOAD_MAX {
                spare = payload;
            }
        }
        self.teardown();
    }

    fn handle(&mut self, m: Incoming, payload: &[u8]) {
        let hdr = m.header;
        let name = Command::from_u16(hdr.command)
            .map(|c| c.name())
            .unwrap_or("UNKNOWN");
        let span = debug_span!(
            "msg",
            id = hdr.msg_id,
            cmd = name,
            size = hdr.msg_size,
            errno = tracing::field::Empty
        );
        let _enter = span.enter();
        let fds = m.fds;
        let fds_closed = m.fds_closed;
        // While the client waits for this message's reply it answers none of our requests
        // (QEMU): a request the device makes from this thread meanwhile fails fast.
        self.chan.set_client_waits(!hdr.no_reply());
        let result = catch_unwind(AssertUnwindSafe(|| {
            self.process(&hdr, payload, fds, fds_closed)
        }));
        self.chan.set_client_waits(false);
        let Ok(result) = result else {
            error!("the device panicked while handling {name}; closing the connection");
            span.record("errno", libc::EIO);
            self.chan.send_error(&hdr, libc::EIO);
            self.chan.close();
            return;
        };
        // Exactly one line per message at debug level (errors are logged at warn instead).
        match result {
            Ok(Some(mut reply)) => {
                if hdr.no_reply() {
                    debug!("done (no reply requested)");
                    return;
                }
                debug!(reply_size = reply.buf.len() - HEADER_SIZE, "done");
                let fds: Vec<RawFd> = reply.fds.iter().map(|f| f.as_raw_fd()).collect();
                if let Err(e) = self.chan.send(reply.finish(&hdr), &fds) {
                    debug!(error = %e, "failed to send a reply");
                }
                self.recycle_reply(reply.buf);
            }
            Ok(None) => debug!("done"),
            Err(e) => {
                let errno = e.errno();
                span.record("errno", errno);
                let mut why = error_chain(&e);
                if !why.starts_with(name) {
                    why = format!("{name}: {why}");
                }
                if hdr.no_reply() {
                    warn!("{why} (no reply requested)");
                } else {
                    warn!("{why}; answering errno {errno}");
                    self.chan.send_error(&hdr, errno);
                }
                if !self.negotiated {
                    // A refused VERSION, or a command before VERSION: nothing useful can
                    // follow on this connection, and it holds the single client slot.
                    warn!("negotiation failed; closing the connection");
                    self.chan.close();
                }
            }
        }
    }

    fn process(
        &mut self,
        hdr: &Header,
        payload: &[u8],
        fds: Vec<OwnedFd>,
        fds_closed: usize,
    ) -> Result<Option<Reply>, ServerError> {
        if !self.negotiated && hdr.command != Command::Version as u16 {
            return Err(ServerError::BadState("the first message must be VERSION"));
        }
        // Fds closed at receive (more than the command can use) still count: the command is
        // refused for its fd count, as if they were attached.
        let req = decode_request(hdr, payload, fds.len() + fds_closed, &self.limits)?;
        Ok(Some(match req {
            Request::Version(v) => return self.version(hdr, v),
            Request::DmaMap(m) => self.dma_map(m, fds)?,
            Request::DmaUnmap(u) => self.dma_unmap(u)?,
            Request::DeviceGetInfo => self.device_info(),
            Request::GetRegionInfo(r) => self.region_info(r)?,
            Request::GetRegionIoFds(r) => self.region_io_fds(r)?,
            Request::GetIrqInfo { index } => self.irq_info(index)?,
            Request::SetIrqs(s) => self.set_irqs(s, fds)?,
            Request::RegionRead(a) => self.region_read(a)?,
            Request::RegionWrite(a, data) => self.region_write(a, data)?,
            Request::RegionWriteMulti(ws) => self.region_write_multi(&ws)?,
            Request::DeviceReset => self.reset()?,
            Request::Feature(f) => self.feature(f, payload)?,
            Request::MigData(d) => self.mig_data(d)?,
        }))
    }

    fn version(&mut self, hdr: &Header, v: Version) -> Result<Option<Reply>, ServerError> {
        if self.negotiated {
            return Err(ServerError::BadState("VERSION was already negotiated"));
        }
        let mut offer = self.config.offer();
        offer.migration = self.migration.is_some();
        let n = negotiate(&v, &offer, hdr.msg_size as usize)?;
        if n.reply_longer_than_request {
            warn!(
                request_size = hdr.msg_size,
                "VERSION reply is longer than the request even without the keys that may be \
                 dropped; sent whole (a client whose reply buffer is its request's size refuses it)"
            );
        }
        self.limits.write_multiple = n.write_multiple;
        // The negotiated size bounds both directions: REGION_READ/WRITE counts, MIG_DATA
        // sizes and DMA logging bitmaps from the client, DMA_READ/WRITE pieces to it.
        self.limits.max_data_xfer_size = n.max_data_xfer_size;
        self.chan.set_max_xfer(n.max_data_xfer_size);
        let payload = n.reply.encode_payload();
        let mut reply = Reply::from_payload(&payload);
        let mut twin_client: Option<UnixStream> = None;
        if n.twin_socket {
            let (ours, theirs) =
                UnixStream::pair().map_err(|e| ServerError::io("creating the twin socket", e))?;
            let t = self.config.send_timeout;
            ours.set_write_timeout((!t.is_zero()).then_some(t))
                .map_err(|e| ServerError::io("setting the twin socket's send timeout", e))?;
            let reader = ours
                .try_clone()
                .map_err(|e| ServerError::io("cloning the twin socket", e))?;
            self.chan.set_twin(ours);
            let chan = self.chan.clone();
            let span = tracing::Span::current();
            let slice = self.config.thread_slice;
            self.twin_thread = Some(
                std::thread::Builder::new()
                    .name("umdev-twin".into())
                    .spawn(move || {
                        super::slice::apply(slice, "umdev-twin");
                        let _e = span.enter();
                        chan.run_twin_reader(reader)
                    })
                    .map_err(|e| ServerError::io("spawning the twin reader", e))?,
            );
            twin_client = Some(theirs);
        }
        let fds: Vec<RawFd> = twin_client.iter().map(|s| s.as_raw_fd()).collect();
        self.chan
            .send(reply.finish(hdr), &fds)
            .map_err(|e| ServerError::io("sending the VERSION reply", e))?;
        drop(twin_client);
        let layout =
            self.config
                .dma_rw_layout
                .unwrap_or(if v.caps.migration_max_bitmap_size.is_some() {
                    DmaRwLayout::Qemu
                } else {
                    DmaRwLayout::Spec
                });
        self.dma
            .set_remote(Some(Arc::new(ClientDma::new(self.chan.clone(), layout))));
        self.dma.set_max_dma_maps(n.max_dma_maps);
        self.dma
            .set_allow_any_file_maps(self.config.allow_any_file_maps);
        self.negotiated = true;
        if let Err(e) = self.chan.set_read_timeout(None) {
            warn!(error = %e, "cannot lift the negotiation timeout");
        }
        info!(
            client_minor = v.minor,
            max_data_xfer_size = n.max_data_xfer_size,
            max_dma_maps = n.max_dma_maps,
            write_multiple = n.write_multiple,
            twin_socket = n.twin_socket,
            dma_rw_layout = ?layout,
            "version negotiated"
        );
        Ok(None)
    }

    fn teardown(mut self) {
        self.chan.close();
        self.migration_teardown();
        if let Some(t) = self.twin_thread.take() {
            let _ = t.join();
        }
        if self.negotiated {
            let mut dev = lock_device(&self.device);
            let report = self
                .dma
                .unmap_all(&mut |iova, size| dev.dma_unmap(iova, size));
            self.dma.set_remote(None);
            dev.disconnected();
            if report.leftover_pins > 0 {
                warn!(
                    leftover_pins = report.leftover_pins,
                    "device left pins behind at disconnect; force-released"
                );
            }
            info!(
                dma_maps_released = report.maps_removed,
                "client disconnected"
            );
        } else {
            lock_device(&self.device).disconnected();
            info!("client disconnected before negotiating");
        }
    }
}
