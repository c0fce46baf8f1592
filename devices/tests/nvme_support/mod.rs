//! The NVMe tests' guest driver: an `Nvme` served on a socket by umdev's harness, the
//! embedded VMM playing the guest, and a small driver that sets up queues in guest RAM the
//! way Linux's `nvme` driver does (admin queue, Identify, Number of Queues, I/O queue
//! pairs), submits commands and reaps completions by their phase tag.
#![allow(dead_code)]

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use umdev::dma::DmaConfig;
use umdev::pci::PciAdapter;
use umdev::testing::{DeviceAccess, FdlessMemory, TestServer, Vmm};
use umdev_devices::nvme::regs::{self, Doorbell};
use umdev_devices::nvme::spec::{admin_op, io_op, Command, Completion, Status, CQE_SIZE, SQE_SIZE};
use umdev_devices::nvme::{Nvme, NvmeConfig};

/// Guest RAM base.
pub const RAM: u64 = 0x10_0000;
/// Guest RAM size.
pub const RAM_SIZE: u64 = 8 << 20;
/// Admin SQ (64 entries).
pub const ASQ: u64 = RAM;
/// Admin CQ (64 entries).
pub const ACQ: u64 = RAM + 0x1000;
/// Admin queue entries.
pub const ADMIN_ENTRIES: u32 = 64;
/// PRP list area.
pub const PRP_LISTS: u64 = RAM + 0x8_0000;
/// Data area (7 MiB from here).
pub const DATA: u64 = RAM + 0x10_0000;
/// An address nothing maps.
pub const HOLE: u64 = 0x4000_0000;
/// Default namespace size.
pub const NS_BYTES: u64 = 4 << 20;
/// How long a completion may take.
pub const WAIT: Duration = Duration::from_secs(5);

/// The rings of I/O queue `qid`.
pub fn io_sq(qid: u16) -> u64 {
    RAM + 0x1_0000 * u64::from(qid)
}
/// The completion ring of I/O queue `qid`.
pub fn io_cq(qid: u16) -> u64 {
    io_sq(qid) + 0x8000
}

/// A queue pair as the driver sees it.
#[derive(Clone, Copy, Debug)]
pub struct Queue {
    pub qid: u16,
    pub sq: u64,
    pub cq: u64,
    pub size: u32,
    pub tail: u32,
    pub head: u32,
    pub phase: bool,
}

impl Queue {
    fn new(qid: u16, sq: u64, cq: u64, size: u32) -> Queue {
        Queue {
            qid,
            sq,
            cq,
            size,
            tail: 0,
            head: 0,
            phase: true,
        }
    }
}

/// The test guest.
pub struct Guest {
    pub server: TestServer<PciAdapter<Nvme>>,
    pub vmm: Vmm,
    pub image: PathBuf,
    pub fdless: bool,
    pub queues: Vec<Queue>,
    /// Shadow doorbell and EventIdx pages, once configured (I/O queues only, as Linux).
    pub dbbuf: Option<(u64, u64)>,
    /// Doorbell register writes (traps), by kind: (SQ tails, CQ heads).
    pub mmio_doorbells: (u64, u64),
    cid: u16,
    _dir: tempfile::TempDir,
}

/// Build a controller on a fresh image of `NS_BYTES`, tuned by `tune`.
pub fn controller(tune: impl FnOnce(&mut NvmeConfig)) -> (Nvme, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("ns.img");
    let mut cfg = NvmeConfig::new(&image).with_size(NS_BYTES);
    tune(&mut cfg);
    (Nvme::new(cfg).unwrap(), dir, image)
}

impl Guest {
    /// A guest with memfd RAM and the device enabled on the PCI side (memory, Bus Master).
    pub fn new() -> Guest {
        Guest::with(|_| {}, false)
    }

    /// A guest whose RAM is fd-less (QEMU's default RAM): DMA goes through DMA_READ/WRITE.
    pub fn fdless() -> Guest {
        Guest::with(|_| {}, true)
    }

    /// A guest on a controller tuned by `tune`.
    pub fn with(tune: impl FnOnce(&mut NvmeConfig), fdless: bool) -> Guest {
        Guest::with_dma(tune, fdless, DmaConfig::default())
    }

    /// A guest on a controller tuned by `tune`, served with the DMA configuration `dma`.
    pub fn with_dma(tune: impl FnOnce(&mut NvmeConfig), fdless: bool, dma: DmaConfig) -> Guest {
        let (dev, dir, image) = controller(tune);
        Guest::serve(dev, dir, image, fdless, dma)
    }

    /// A guest on controller `dev` (on `image`; `dir` is kept until the guest is dropped),
    /// served with the DMA configuration `dma`.
    pub fn serve(
        dev: Nvme,
        dir: tempfile::TempDir,
        image: PathBuf,
        fdless: bool,
        dma: DmaConfig,
    ) -> Guest {
        umdev::testing::init_logs();
        let server = TestServer::builder_pci(dev)
            .unwrap()
            .dma_config(dma)
            .start()
            .unwrap();
        let mut vmm = server.connect().unwrap();
        if fdless {
            vmm = vmm.with_fdless(FdlessMemory::new(RAM, RAM_SIZE as usize));
            vmm.dma_map_fdless(RAM, RAM_SIZE).unwrap();
        } else {
            vmm = vmm.with_ram(RAM, RAM_SIZE as usize).unwrap();
        }
        vmm.enable_device().unwrap();
        Guest {
            server,
            vmm,
            image,
            fdless,
            queues: Vec::new(),
            dbbuf: None,
            mmio_doorbells: (0, 0),
            cid: 0,
            _dir: dir,
        }
    }

    /// A guest on a controller on `image` (a fresh `NS_BYTES` image if `None`), tuned by
    /// `tune`, its VMM connected with migration capabilities and memfd RAM (what
    /// `umdev::testing::migrate` moves).
    pub fn migratable(image: Option<PathBuf>, tune: impl FnOnce(&mut NvmeConfig)) -> Guest {
        umdev::testing::init_logs();
        let (dev, dir, image) = match image {
            None => controller(tune),
            Some(image) => {
                let mut cfg = NvmeConfig::new(&image);
                tune(&mut cfg);
                (Nvme::new(cfg).unwrap(), tempfile::tempdir().unwrap(), image)
            }
        };
        let server = TestServer::builder_pci(dev).unwrap().start().unwrap();
        let mut vmm = Vmm::connect_with_caps(server.path(), umdev::testing::MIGRATION_CAPS)
            .unwrap()
            .with_ram(RAM, RAM_SIZE as usize)
            .unwrap();
        vmm.enable_device().unwrap();
        Guest {
            server,
            vmm,
            image,
            fdless: false,
            queues: Vec::new(),
            dbbuf: None,
            mmio_doorbells: (0, 0),
            cid: 0,
            _dir: dir,
        }
    }

    /// Take over the driver state of `src` (its queues' positions, the doorbell buffer,
    /// the next command id): the guest moved here.
    pub fn adopt_driver(&mut self, src: &Guest) {
        self.queues = src.queues.clone();
        self.dbbuf = src.dbbuf;
        self.cid = src.cid;
    }

    // --- guest memory ---

    pub fn mem_write(&mut self, gpa: u64, data: &[u8]) {
        if self.fdless {
            let at = (gpa - RAM) as usize;
            self.vmm.mem_mut()[at..at + data.len()].copy_from_slice(data);
        } else {
            self.vmm.ram().write(gpa, data).unwrap();
        }
    }

    pub fn mem_read(&self, gpa: u64, len: usize) -> Vec<u8> {
        read_mem(&self.vmm, self.fdless, gpa, len)
    }

    pub fn write_u64s(&mut self, gpa: u64, words: &[u64]) {
        let b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.mem_write(gpa, &b);
    }

    // --- registers ---

    pub fn reg32(&mut self, off: u64) -> u32 {
        self.vmm.read32(0, off).unwrap()
    }

    pub fn set_reg32(&mut self, off: u64, v: u32) {
        self.vmm.write32(0, off, v).unwrap();
    }

    pub fn csts(&mut self) -> u32 {
        self.reg32(regs::CSTS)
    }

    pub fn ring(&mut self, db: Doorbell, v: u32) {
        match db {
            Doorbell::SqTail(_) => self.mmio_doorbells.0 += 1,
            Doorbell::CqHead(_) => self.mmio_doorbells.1 += 1,
        }
        self.set_reg32(regs::doorbell_offset(db), v);
    }

    /// Publish a doorbell value as Linux does: through the shadow page when configured
    /// (I/O queues), trapping only if the EventIdx asks for it; else the register.
    pub fn publish(&mut self, db: Doorbell, v: u32) {
        let (qid, slot) = match db {
            Doorbell::SqTail(q) => (q, u64::from(q) * 8),
            Doorbell::CqHead(q) => (q, u64::from(q) * 8 + 4),
        };
        let Some((shadow, ei)) = self.dbbuf.filter(|_| qid != 0) else {
            return self.ring(db, v);
        };
        let old = u32::from_le_bytes(self.mem_read(shadow + slot, 4).try_into().unwrap());
        self.mem_write(shadow + slot, &v.to_le_bytes());
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        let event = u32::from_le_bytes(self.mem_read(ei + slot, 4).try_into().unwrap());
        // Linux's nvme_dbbuf_need_event, in 16-bit arithmetic.
        let (e, n, o) = (event as u16, v as u16, old as u16);
        if n.wrapping_sub(e).wrapping_sub(1) < n.wrapping_sub(o) {
            self.ring(db, v);
        }
    }

    /// Send Doorbell Buffer Config with the pages at `shadow` and `ei`; its status.
    pub fn config_dbbuf(&mut self, shadow: u64, ei: u64) -> Status {
        self.mem_write(shadow, &[0u8; 4096]);
        self.mem_write(ei, &[0u8; 4096]);
        let s = self.admin(Command {
            opcode: admin_op::DBBUF_CONFIG,
            prp1: shadow,
            prp2: ei,
            ..Default::default()
        });
        if s.is_success() {
            self.dbbuf = Some((shadow, ei));
        }
        s
    }

    /// Wait until `CSTS & mask == want`.
    pub fn wait_csts(&mut self, mask: u32, want: u32) -> bool {
        let deadline = std::time::Instant::now() + WAIT;
        while std::time::Instant::now() < deadline {
            if self.csts() & mask == want {
                return true;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        false
    }

    /// Disable, program the admin queue, enable with Linux's CC; wait for RDY.
    pub fn enable(&mut self) {
        self.try_enable(0x0046_0001);
        assert!(
            self.wait_csts(regs::CSTS_RDY, regs::CSTS_RDY),
            "CSTS.RDY never set: {:#x}",
            self.csts()
        );
    }

    /// Program the admin queue and write `cc`; no wait.
    pub fn try_enable(&mut self, cc: u32) {
        self.set_reg32(regs::CC, 0);
        assert!(self.wait_csts(regs::CSTS_RDY, 0));
        let n = ADMIN_ENTRIES - 1;
        self.set_reg32(regs::AQA, n | n << 16);
        self.vmm.write64(0, regs::ASQ_LO, ASQ).unwrap();
        self.vmm.write64(0, regs::ACQ_LO, ACQ).unwrap();
        self.queues = vec![Queue::new(0, ASQ, ACQ, ADMIN_ENTRIES)];
        self.dbbuf = None;
        self.mem_write(ACQ, &vec![0u8; (ADMIN_ENTRIES as u64 * CQE_SIZE) as usize]);
        self.set_reg32(regs::CC, cc);
    }

    /// Clear CC.EN and wait for RDY to clear.
    pub fn disable(&mut self) {
        self.set_reg32(regs::CC, 0);
        assert!(self.wait_csts(regs::CSTS_RDY, 0));
        self.queues.clear();
        self.dbbuf = None;
    }

    // --- commands ---

    fn queue_index(&self, qid: u16) -> usize {
        self.queues
            .iter()
            .position(|q| q.qid == qid)
            .expect("no such queue")
    }

    /// Write `cmd` (its cid replaced by a fresh one) into queue `qid`'s SQ, without ringing;
    /// returns the cid.
    pub fn push(&mut self, qid: u16, mut cmd: Command) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        cmd.cid = self.cid;
        let i = self.queue_index(qid);
        let q = self.queues[i];
        self.mem_write(q.sq + u64::from(q.tail) * SQE_SIZE, &cmd.encode());
        self.queues[i].tail = (q.tail + 1) % q.size;
        cmd.cid
    }

    /// Ring queue `qid`'s SQ tail doorbell with the driver's tail.
    pub fn kick(&mut self, qid: u16) {
        let t = self.queues[self.queue_index(qid)].tail;
        self.publish(Doorbell::SqTail(qid), t);
    }

    /// Submit one command on `qid`; its cid.
    pub fn submit(&mut self, qid: u16, cmd: Command) -> u16 {
        let cid = self.push(qid, cmd);
        self.kick(qid);
        cid
    }

    /// The next completion of `qid`'s CQ, if one arrives within `timeout`; consumes it
    /// and rings the CQ head doorbell.
    pub fn reap_within(&mut self, qid: u16, timeout: Duration) -> Option<Completion> {
        let i = self.queue_index(qid);
        let q = self.queues[i];
        let at = q.cq + u64::from(q.head) * CQE_SIZE;
        let fdless = self.fdless;
        let seen = self
            .vmm
            .serve_until(timeout, |v| {
                let b = read_mem(v, fdless, at, CQE_SIZE as usize);
                b[14] & 1 == u8::from(q.phase)
            })
            .unwrap();
        if !seen {
            return None;
        }
        let b: [u8; 16] = self.mem_read(at, 16).try_into().unwrap();
        let (c, _) = Completion::decode(&b);
        let head = (q.head + 1) % q.size;
        self.queues[i].head = head;
        if head == 0 {
            self.queues[i].phase = !q.phase;
        }
        self.publish(Doorbell::CqHead(qid), head);
        Some(c)
    }

    /// The next completion of `qid` (panics after [`WAIT`]).
    pub fn reap(&mut self, qid: u16) -> Completion {
        self.reap_within(qid, WAIT)
            .unwrap_or_else(|| panic!("no completion on queue {qid} within {WAIT:?}"))
    }

    /// Submit and wait for the completion.
    pub fn run(&mut self, qid: u16, cmd: Command) -> Completion {
        let cid = self.submit(qid, cmd);
        let c = self.reap(qid);
        assert_eq!(c.cid, cid, "completion of another command");
        c
    }

    /// Run an admin command; its status.
    pub fn admin(&mut self, cmd: Command) -> Status {
        self.run(0, cmd).status
    }

    /// Identify `cns` for `nsid` into guest `buf`; its status.
    pub fn identify(&mut self, cns: u32, nsid: u32, buf: u64) -> Status {
        self.admin(Command {
            opcode: admin_op::IDENTIFY,
            nsid,
            prp1: buf,
            cdw: [cns, 0, 0, 0, 0, 0],
            ..Default::default()
        })
    }

    /// Set Number of Queues; the completion.
    pub fn set_queues(&mut self, n: u16) -> Completion {
        let v = u32::from(n - 1);
        self.run(
            0,
            Command {
                opcode: admin_op::SET_FEATURES,
                cdw: [7, v | v << 16, 0, 0, 0, 0],
                ..Default::default()
            },
        )
    }

    /// Create CQ `qid` (`size` entries, vector `iv`, interrupts on) at `cq`.
    pub fn create_cq_at(&mut self, qid: u16, size: u32, iv: u16, cq: u64) -> Status {
        self.admin(Command {
            opcode: admin_op::CREATE_CQ,
            prp1: cq,
            cdw: [
                u32::from(qid) | (size - 1) << 16,
                0b11 | u32::from(iv) << 16,
                0,
                0,
                0,
                0,
            ],
            ..Default::default()
        })
    }

    /// Create SQ `qid` on CQ `cqid` at `sq`.
    pub fn create_sq_at(&mut self, qid: u16, size: u32, cqid: u16, sq: u64) -> Status {
        self.admin(Command {
            opcode: admin_op::CREATE_SQ,
            prp1: sq,
            cdw: [
                u32::from(qid) | (size - 1) << 16,
                1 | u32::from(cqid) << 16,
                0,
                0,
                0,
                0,
            ],
            ..Default::default()
        })
    }

    /// Create I/O queue pair `qid` with `size` entries at the standard places.
    pub fn create_pair(&mut self, qid: u16, size: u32) {
        let cq = io_cq(qid);
        self.mem_write(cq, &vec![0u8; (u64::from(size) * CQE_SIZE) as usize]);
        assert_eq!(self.create_cq_at(qid, size, qid, cq), Status::SUCCESS);
        assert_eq!(
            self.create_sq_at(qid, size, qid, io_sq(qid)),
            Status::SUCCESS
        );
        self.queues.push(Queue::new(qid, io_sq(qid), cq, size));
    }

    /// Enable, set the number of queues, create `n` I/O pairs of `size` entries.
    pub fn bring_up(&mut self, n: u16, size: u32) {
        self.enable();
        assert!(self.set_queues(n).status.is_success());
        for q in 1..=n {
            self.create_pair(q, size);
        }
    }

    /// A Read or Write of `nlb` blocks at `slba` with the given PRPs.
    pub fn rw(write: bool, slba: u64, nlb: u32, prp1: u64, prp2: u64) -> Command {
        Command {
            opcode: if write { io_op::WRITE } else { io_op::READ },
            nsid: 1,
            prp1,
            prp2,
            cdw: [slba as u32, (slba >> 32) as u32, nlb - 1, 0, 0, 0],
            ..Default::default()
        }
    }

    /// Write `data` (a multiple of 512 bytes) at block `slba` from guest `buf`, building a
    /// PRP list at `PRP_LISTS` if needed; the status.
    pub fn write_blocks(&mut self, qid: u16, slba: u64, buf: u64, data: &[u8]) -> Status {
        self.mem_write(buf, data);
        let (p1, p2) = self.prps(buf, data.len() as u64);
        self.run(
            qid,
            Guest::rw(true, slba, (data.len() / 512) as u32, p1, p2),
        )
        .status
    }

    /// Read `len` bytes at block `slba` into guest `buf`; the status and the data.
    pub fn read_blocks(&mut self, qid: u16, slba: u64, buf: u64, len: usize) -> (Status, Vec<u8>) {
        let (p1, p2) = self.prps(buf, len as u64);
        let s = self
            .run(qid, Guest::rw(false, slba, (len / 512) as u32, p1, p2))
            .status;
        (s, self.mem_read(buf, len))
    }

    /// PRP1/PRP2 for a contiguous guest buffer, with a list at `PRP_LISTS` for more than
    /// two pages.
    pub fn prps(&mut self, buf: u64, len: u64) -> (u64, u64) {
        let first = 4096 - buf % 4096;
        if len <= first {
            return (buf, 0);
        }
        let rest: Vec<u64> = (0..(len - first).div_ceil(4096))
            .map(|i| (buf - buf % 4096) + 4096 * (i + 1))
            .collect();
        if rest.len() == 1 {
            return (buf, rest[0]);
        }
        self.write_u64s(PRP_LISTS, &rest);
        (buf, PRP_LISTS)
    }

    /// Pages the controller holds pinned for command data and queue rings, and the DMA
    /// space's pinned pages.
    pub fn pins(&self) -> (u64, usize, u64) {
        let dev = self.server.device();
        let nvme = dev.device();
        (
            nvme.data_pins(),
            nvme.pinned_rings(),
            self.server.dma().stats().pinned_pages,
        )
    }

    /// No device panic was caught.
    pub fn assert_no_panics(&self) {
        assert!(
            self.server.device_panics().is_empty(),
            "{:?}",
            self.server.device_panics()
        );
    }
}

fn read_mem(v: &Vmm, fdless: bool, gpa: u64, len: usize) -> Vec<u8> {
    if fdless {
        let at = (gpa - RAM) as usize;
        v.mem()[at..at + len].to_vec()
    } else {
        v.ram().read_vec(gpa, len).unwrap()
    }
}

/// Deterministic pseudo-random bytes.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    umdev::testing::Rng::new(seed).bytes(len)
}

/// Read the host image.
pub fn image_bytes(path: &PathBuf, offset: u64, len: usize) -> io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, offset)?;
    Ok(b)
}
