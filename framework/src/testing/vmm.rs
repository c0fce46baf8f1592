//! The embedded VMM: what QEMU (and the guest kernel's PCI code) does for a device, built on
//! the [`RawClient`], so a test, an example or `umdev demo` can drive a device without
//! either.
//!
//! - Guest RAM as a memfd ([`GuestMemory`], [`Vmm::with_ram`]) DMA-mapped with its fd, and
//!   fd-less memory ([`FdlessMemory`]) that the device reaches only through server→client
//!   DMA_READ/DMA_WRITE, which the VMM answers from its buffer: honestly, with errors, or
//!   never ([`Answer`]), each request logged ([`Vmm::log`]).
//! - Region and config access through [`DeviceAccess`] (8/16/32/64-bit, byte slices, the
//!   PCI steps of a guest driver: enable, MSI, MSI-X, INTx), posted writes, DMA map/unmap,
//!   DEVICE_RESET, mapping an mmappable region as a VMM does.
//!
//! **When requests are answered.** While a call waits for its reply, requests from the
//! device arrive on the same socket. By default the VMM answers them as they come. Like
//! QEMU 10.x it can instead hold them until the reply has arrived ([`Vmm::qemu_like`]):
//! QEMU serves server requests in a main-loop bottom half, which cannot run while the
//! thread waiting for a reply holds the loop; between calls it answers as they come
//! ([`Vmm::serve_until`], [`Vmm::wait_irq_serving`]). [`Vmm::hold_request`] leaves one unanswered on purpose.
//!
//! Every method returns `io::Result`; an error reply from the server is an error carrying
//! its errno ([`io::Error::raw_os_error`]), except for [`Vmm::call`], which returns the
//! reply as it came.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::path::Path;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use vm_memory::{FileOffset, MmapRegion, VolatileMemory};
use vmm_sys_util::eventfd::EventFd;

use crate::protocol::dma_map::{
    DmaMapRequest, DmaUnmapRequest, DMA_MAP_FLAG_READ, DMA_MAP_FLAG_WRITE,
};
use crate::protocol::region_access::RegionAccess;
use crate::protocol::set_irqs::encode_set_irqs;
use crate::protocol::wire::Reader;
use crate::protocol::{Command, FLAGS_NO_REPLY};
use crate::server::socket_io::wait_readable;

use super::access::DeviceAccess;
use super::fdless::{Answer, DmaRequest, FdlessMemory};
use super::guest_memory::GuestMemory;
use super::raw_client::{Msg, RawClient, DEFAULT_CAPS};

/// How often [`Vmm::serve_until`] re-checks its condition while no request arrives.
pub const POLL: Duration = Duration::from_millis(1);

/// How long [`Vmm::connect`] retries while the server is not listening yet.
pub const CONNECT_RETRY: Duration = Duration::from_secs(5);

/// VFIO SET_IRQS flags: DATA_EVENTFD | ACTION_TRIGGER.
const SET_IRQS_EVENTFD_TRIGGER: u32 = (1 << 2) | (1 << 5);

/// The VMM side of one connection.
pub struct Vmm {
    client: RawClient,
    /// The transfer limit the server's VERSION reply gave (the spec default without one).
    max_xfer: u32,
    /// The capabilities of the server's VERSION reply (`None`: built on a client
    /// negotiated elsewhere).
    server_caps: Option<crate::protocol::version::Capabilities>,
    ram: Option<GuestMemory>,
    fdless: FdlessMemory,
    defer: bool,
    deferred: Vec<Msg>,
}

fn errno_of(m: &Msg) -> io::Result<()> {
    if m.header.is_error() {
        return Err(io::Error::from_raw_os_error(m.header.error as i32));
    }
    Ok(())
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

/// The access header of `len` bytes at `offset` of `region`.
fn region_access(region: u32, offset: u64, len: usize) -> io::Result<RegionAccess> {
    let count = u32::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    Ok(RegionAccess {
        offset,
        region,
        count,
    })
}

/// A REGION_WRITE payload: the access header, then `data`.
fn region_write_payload(region: u32, offset: u64, data: &[u8]) -> io::Result<Vec<u8>> {
    let mut p = region_access(region, offset, data.len())?.encode();
    p.extend_from_slice(data);
    Ok(p)
}

impl Vmm {
    /// Connect to `socket` (retrying for up to [`CONNECT_RETRY`] while the server starts)
    /// and negotiate [`DEFAULT_CAPS`].
    pub fn connect(socket: &Path) -> io::Result<Vmm> {
        Self::connect_with_caps(socket, DEFAULT_CAPS)
    }

    /// Connect to `socket` and negotiate the capabilities `caps` (JSON).
    pub fn connect_with_caps(socket: &Path, caps: &str) -> io::Result<Vmm> {
        let deadline = Instant::now() + CONNECT_RETRY;
        let mut client = loop {
            match RawClient::try_connect(socket) {
                Ok(c) => break c,
                Err(e) if Instant::now() < deadline => {
                    tracing::debug!("waiting for the server: {e}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => {
                    return Err(io::Error::new(
                        e.kind(),
                        format!("connect {}: {e}", socket.display()),
                    ))
                }
            }
        };
        let reply = client.try_negotiate(caps)?;
        let mut vmm = Self::from_client(client);
        if let Ok(v) = crate::protocol::version::Version::decode(&reply.payload) {
            vmm.max_xfer = v.caps.max_data_xfer_size;
            vmm.server_caps = Some(v.caps);
        }
        Ok(vmm)
    }

    /// A VMM on an already negotiated client.
    pub fn from_client(client: RawClient) -> Vmm {
        Vmm {
            client,
            max_xfer: crate::protocol::version::DEFAULT_MAX_DATA_XFER_SIZE,
            server_caps: None,
            ram: None,
            fdless: FdlessMemory::new(0, 0),
            defer: false,
            deferred: Vec::new(),
        }
    }

    /// Add `size` bytes of guest RAM at `base` (a memfd) and DMA_MAP it read/write.
    pub fn with_ram(mut self, base: u64, size: usize) -> io::Result<Vmm> {
        let ram = GuestMemory::new(base, size)?;
        self.dma_map_fd(base, size as u64, ram.fd(), 0)?;
        self.ram = Some(ram);
        Ok(self)
    }

    /// Like QEMU: requests that arrive while a call waits are answered after its reply.
    /// Receives wait up to 15 s, long enough to see a server that makes a reply wait for
    /// its 5 s remote DMA timeout.
    pub fn qemu_like(mut self) -> io::Result<Vmm> {
        self.defer = true;
        self.client
            .stream()
            .set_read_timeout(Some(Duration::from_secs(15)))?;
        Ok(self)
    }

    /// The capabilities the server's VERSION reply carried (with [`Vmm::connect`]).
    pub fn server_caps(&self) -> Option<&crate::protocol::version::Capabilities> {
        self.server_caps.as_ref()
    }

    /// The largest transfer negotiated (what the server's VERSION reply said).
    pub fn max_data_xfer_size(&self) -> u32 {
        self.max_xfer
    }

    /// The guest RAM added by [`Vmm::with_ram`].
    ///
    /// # Panics
    /// If there is none.
    pub fn ram(&self) -> &GuestMemory {
        self.ram
            .as_ref()
            .expect("this VMM has no guest RAM (Vmm::with_ram)")
    }

    /// The guest RAM added by [`Vmm::with_ram`], if any.
    pub fn ram_opt(&self) -> Option<&GuestMemory> {
        self.ram.as_ref()
    }

    /// The raw client underneath (for messages the VMM has no method for).
    pub fn client(&mut self) -> &mut RawClient {
        &mut self.client
    }

    /// This VMM with `mem` as its fd-less memory (see [`Vmm::set_fdless`]).
    pub fn with_fdless(mut self, mem: FdlessMemory) -> Vmm {
        self.fdless = mem;
        self
    }

    /// Use `mem` as the fd-less memory that DMA requests are served from (map it with
    /// [`Vmm::dma_map_fdless`]).
    pub fn set_fdless(&mut self, mem: FdlessMemory) {
        self.fdless = mem;
    }

    /// The fd-less memory, its policy and its log.
    pub fn fdless(&self) -> &FdlessMemory {
        &self.fdless
    }

    /// The fd-less memory, mutable.
    pub fn fdless_mut(&mut self) -> &mut FdlessMemory {
        &mut self.fdless
    }

    /// The fd-less memory's bytes.
    pub fn mem(&self) -> &[u8] {
        self.fdless.bytes()
    }

    /// The fd-less memory's bytes, to change them as the guest would.
    pub fn mem_mut(&mut self) -> &mut [u8] {
        self.fdless.bytes_mut()
    }

    /// How the device's requests are answered from now on.
    pub fn set_answer(&mut self, answer: Answer) {
        self.fdless.set_answer(answer);
    }

    /// Requests received from the device so far.
    pub fn requests(&self) -> usize {
        self.fdless.requests()
    }

    /// Every request received from the device, in arrival order.
    pub fn log(&self) -> &[DmaRequest] {
        self.fdless.log()
    }

    /// If `m` (received by hand through [`Vmm::client`]) is a DMA request, log it and
    /// answer it now; true if it was one.
    pub fn serve(&mut self, m: &Msg) -> io::Result<bool> {
        self.fdless.serve(self.client.stream(), m)
    }

    /// Send a command (its reply is read by [`Vmm::wait_reply`]); returns its id.
    pub fn send(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> io::Result<u16> {
        self.client.try_send(cmd as u16, 0, payload, fds)
    }

    /// Read messages until a reply arrives, answering the device's requests on the way (or
    /// holding them, [`Vmm::qemu_like`]); the reply as it came.
    pub fn wait_reply(&mut self) -> io::Result<Msg> {
        loop {
            let m = self.client.try_recv()?;
            if !m.is_request() {
                return Ok(m);
            }
            self.take_request(m)?;
        }
    }

    fn take_request(&mut self, m: Msg) -> io::Result<()> {
        if !FdlessMemory::is_dma_request(&m) {
            self.client.try_reply_error(&m.header, libc::ENOSYS)?;
            return Err(invalid(format!(
                "unexpected request {} from the server",
                m.header.command
            )));
        }
        self.fdless.note(&m);
        if self.defer {
            self.deferred.push(m);
            Ok(())
        } else {
            self.fdless.answer_on(self.client.stream(), &m)
        }
    }

    /// Send a command and return its reply as it came (an error reply is not an error
    /// here). Requests that arrive meanwhile are answered (after the reply when
    /// [`Vmm::qemu_like`]).
    pub fn call(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> io::Result<Msg> {
        let id = self.send(cmd, payload, fds)?;
        let m = self.wait_reply()?;
        RawClient::check_reply(&m, id, cmd as u16)?;
        if self.defer {
            self.answer_deferred()?;
        }
        Ok(m)
    }

    /// Send a command that must succeed; its reply.
    fn call_ok(&mut self, cmd: Command, payload: &[u8], fds: &[RawFd]) -> io::Result<Msg> {
        let m = self.call(cmd, payload, fds)?;
        errno_of(&m)?;
        Ok(m)
    }

    /// Receive the next message, which must be a request from the device, and leave it
    /// unanswered (until the next call's reply has arrived, or [`Vmm::answer_deferred`]).
    pub fn hold_request(&mut self) -> io::Result<DmaRequest> {
        let m = self.client.try_recv()?;
        if !FdlessMemory::is_dma_request(&m) {
            return Err(invalid(format!(
                "expected a DMA request from the device, got command {} id {} flags {:#x}",
                m.header.command, m.header.msg_id, m.header.flags
            )));
        }
        let r = self.fdless.note(&m);
        self.deferred.push(m);
        Ok(r)
    }

    /// Answer every held request, oldest first.
    pub fn answer_deferred(&mut self) -> io::Result<()> {
        for m in std::mem::take(&mut self.deferred) {
            self.fdless.answer_on(self.client.stream(), &m)?;
        }
        Ok(())
    }

    /// Idle main loop: answer requests as they arrive, for `d` or until `done` holds.
    /// Prefer [`Vmm::serve_until`], which says whether `done` held; this is it with the
    /// answer dropped.
    pub fn serve_idle(&mut self, d: Duration, done: impl FnMut(&Vmm) -> bool) -> io::Result<()> {
        self.serve_until(d, done).map(drop)
    }

    /// Idle main loop, as QEMU's between vCPU exits: answer the device's requests as they
    /// arrive until `cond` holds or `timeout` passes; whether `cond` held. `cond` is
    /// checked first, then at least every [`POLL`] and after every request answered, so a
    /// condition that comes true without a message (a register a worker set, guest
    /// memory, a counter) is seen within a millisecond. A request held by
    /// [`Vmm::qemu_like`] is answered first.
    pub fn serve_until(
        &mut self,
        timeout: Duration,
        mut cond: impl FnMut(&Vmm) -> bool,
    ) -> io::Result<bool> {
        self.answer_deferred()?;
        let deadline = Instant::now() + timeout;
        loop {
            if cond(self) {
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            self.serve_one(left.min(POLL))?;
        }
    }

    /// Wait for the interrupt `irq` (an eventfd from [`DeviceAccess::enable_msi`],
    /// [`DeviceAccess::enable_msix`] or [`DeviceAccess::enable_intx`]) for up to
    /// `timeout`, answering the device's DMA requests meanwhile (a device whose worker
    /// reads fd-less memory before it interrupts needs them answered); whether it fired.
    /// The eventfd's count is consumed, so the next wait sees only later interrupts.
    pub fn wait_irq_serving(&mut self, irq: &EventFd, timeout: Duration) -> io::Result<bool> {
        self.serve_until(timeout, |_| irq.read().is_ok())
    }

    /// Wait up to `d` for one message from the server, which must be a request, and answer
    /// it; nothing if none came.
    fn serve_one(&mut self, d: Duration) -> io::Result<()> {
        if !wait_readable(self.client.stream(), d)? {
            return Ok(());
        }
        let m = self.client.try_recv()?;
        if !m.is_request() {
            return Err(invalid(format!(
                "unexpected reply to {} while idle",
                m.header.msg_id
            )));
        }
        let defer = std::mem::replace(&mut self.defer, false);
        let r = self.take_request(m);
        self.defer = defer;
        r
    }

    /// DMA_MAP `[iova, iova + size)` read/write, backed by `fd` at `offset`.
    pub fn dma_map_fd(
        &mut self,
        iova: u64,
        size: u64,
        fd: BorrowedFd<'_>,
        offset: u64,
    ) -> io::Result<()> {
        let p = DmaMapRequest {
            flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE,
            offset,
            iova,
            size,
        }
        .encode();
        self.call_ok(Command::DmaMap, &p, &[fd.as_raw_fd()])
            .map(drop)
    }

    /// DMA_MAP `[iova, iova + size)` read/write without an fd: the device reaches it only
    /// through DMA_READ/DMA_WRITE, served from the fd-less memory.
    pub fn dma_map_fdless(&mut self, iova: u64, size: u64) -> io::Result<()> {
        let p = DmaMapRequest {
            flags: DMA_MAP_FLAG_READ | DMA_MAP_FLAG_WRITE,
            offset: 0,
            iova,
            size,
        }
        .encode();
        self.call_ok(Command::DmaMap, &p, &[]).map(drop)
    }

    /// DMA_UNMAP `[iova, iova + size)`; the bytes the server says it removed.
    pub fn dma_unmap(&mut self, iova: u64, size: u64) -> io::Result<u64> {
        let p = DmaUnmapRequest {
            argsz: 24,
            all: false,
            iova,
            size,
        }
        .encode();
        let m = self.call_ok(Command::DmaUnmap, &p, &[])?;
        let mut r = Reader::new(&m.payload, "DMA_UNMAP reply");
        let _argsz = r.u32();
        let _flags = r.u32();
        let _iova = r.u64();
        r.u64().map_err(|e| invalid(e.to_string()))
    }

    /// DEVICE_RESET.
    pub fn reset(&mut self) -> io::Result<()> {
        self.call_ok(Command::DeviceReset, &[], &[]).map(drop)
    }

    /// A posted REGION_WRITE (No_reply, as QEMU sends MMIO writes): nobody waits for it.
    pub fn posted_write(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        let p = region_write_payload(region, offset, data)?;
        self.client
            .try_send(Command::RegionWrite as u16, FLAGS_NO_REPLY, &p, &[])
            .map(drop)
    }

    /// A posted 32-bit write.
    pub fn write32_posted(&mut self, region: u32, offset: u64, v: u32) -> io::Result<()> {
        self.posted_write(region, offset, &v.to_le_bytes())
    }

    /// GET_REGION_INFO of `index`: its size, flags, mmap offset and (if mmappable) fd.
    pub fn region_info(&mut self, index: u32) -> io::Result<RegionInfo> {
        const ARGSZ: u32 = 4096;
        let mut p = Vec::with_capacity(32);
        p.extend_from_slice(&ARGSZ.to_ne_bytes());
        p.extend_from_slice(&0u32.to_ne_bytes());
        p.extend_from_slice(&index.to_ne_bytes());
        p.extend_from_slice(&[0; 20]);
        let mut m = self.call_ok(Command::DeviceGetRegionInfo, &p, &[])?;
        let mut r = Reader::new(&m.payload, "GET_REGION_INFO reply");
        let bad = |e: crate::protocol::ProtocolError| invalid(e.to_string());
        let _argsz = r.u32().map_err(bad)?;
        let flags = r.u32().map_err(bad)?;
        let _index = r.u32().map_err(bad)?;
        let _cap_offset = r.u32().map_err(bad)?;
        let size = r.u64().map_err(bad)?;
        let offset = r.u64().map_err(bad)?;
        Ok(RegionInfo {
            flags,
            size,
            offset,
            fd: m.fds.pop(),
        })
    }

    /// Map region `index` read-only through its fd, as a VMM maps an mmappable BAR.
    pub fn map_region(&mut self, index: u32) -> io::Result<MappedRegion> {
        let info = self.region_info(index)?;
        let fd = info
            .fd
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ENODEV))?;
        let len =
            usize::try_from(info.size).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        let region = MmapRegion::<()>::build(
            Some(FileOffset::new(std::fs::File::from(fd), info.offset)),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
        )
        .map_err(io::Error::other)?;
        Ok(MappedRegion { region })
    }

    /// Hand the connection to a thread that answers the device's DMA requests from the
    /// fd-less memory until [`DmaServer::stop`] (for code that only does device-side DMA
    /// meanwhile, such as a benchmark).
    pub fn serve_in_background(self) -> io::Result<DmaServer> {
        let control = self.client.stream().try_clone()?;
        let mut vmm = self;
        vmm.defer = false;
        let thread = std::thread::spawn(move || -> io::Result<u64> {
            vmm.client.stream().set_read_timeout(None)?;
            loop {
                let m = match vmm.client.try_recv() {
                    Ok(m) => m,
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                    Err(e) => return Err(e),
                };
                if !m.is_request() {
                    return Err(invalid(format!("unexpected reply to {}", m.header.msg_id)));
                }
                vmm.take_request(m)?;
            }
            Ok(vmm.fdless.requests() as u64)
        });
        Ok(DmaServer { control, thread })
    }
}

impl DeviceAccess for Vmm {
    fn read_bytes(&mut self, region: u32, offset: u64, data: &mut [u8]) -> io::Result<()> {
        let a = region_access(region, offset, data.len())?;
        let m = self.call_ok(Command::RegionRead, &a.encode(), &[])?;
        let body = m.payload.get(16..).unwrap_or_default();
        if body.len() != data.len() {
            return Err(invalid(format!(
                "REGION_READ reply of {} bytes for {}",
                body.len(),
                data.len()
            )));
        }
        data.copy_from_slice(body);
        Ok(())
    }

    fn write_bytes(&mut self, region: u32, offset: u64, data: &[u8]) -> io::Result<()> {
        let p = region_write_payload(region, offset, data)?;
        self.call_ok(Command::RegionWrite, &p, &[]).map(drop)
    }

    fn set_irq_eventfd(&mut self, index: u32, vector: u32, efd: &EventFd) -> io::Result<()> {
        let p = encode_set_irqs(SET_IRQS_EVENTFD_TRIGGER, index, vector, 1, &[]);
        self.call_ok(Command::DeviceSetIrqs, &p, &[efd.as_raw_fd()])
            .map(drop)
    }
}

/// What GET_REGION_INFO says about a region.
#[derive(Debug)]
pub struct RegionInfo {
    /// `REGION_FLAG_*` bits (and CAPS when a capability chain follows).
    pub flags: u32,
    /// Size in bytes.
    pub size: u64,
    /// Offset of the region in its fd.
    pub offset: u64,
    /// The fd to mmap, if the region is mmappable.
    pub fd: Option<std::os::fd::OwnedFd>,
}

/// A region mapped read-only through its fd. The device writes it concurrently: it is read
/// with volatile copies only, never as a slice.
pub struct MappedRegion {
    region: MmapRegion<()>,
}

impl MappedRegion {
    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// True if the region is empty.
    pub fn is_empty(&self) -> bool {
        self.region.len() == 0
    }

    /// Copy `buf.len()` bytes at `offset` out of the mapping.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> io::Result<()> {
        let s = self
            .region
            .get_slice(offset, buf.len())
            .map_err(|_| io::Error::from_raw_os_error(libc::EFAULT))?;
        s.copy_to(buf);
        Ok(())
    }
}

/// A thread answering the device's DMA requests for a [`Vmm`] (see
/// [`Vmm::serve_in_background`]).
pub struct DmaServer {
    control: std::os::unix::net::UnixStream,
    thread: JoinHandle<io::Result<u64>>,
}

impl DmaServer {
    /// Close the connection and return how many requests were served.
    pub fn stop(self) -> io::Result<u64> {
        let _ = self.control.shutdown(std::net::Shutdown::Both);
        self.thread
            .join()
            .map_err(|_| io::Error::other("DMA serving thread panicked"))?
    }
}

/// Wait until `efd` (non-blocking) has been signalled, or `timeout` passes; its counter.
pub fn wait_eventfd(efd: &EventFd, timeout: Duration) -> Option<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        match efd.read() {
            Ok(n) => return Some(n),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(1)),
            Err(_) => return None,
        }
    }
}
