//! A small migrating device for the migration tests: a counter that a worker thread
//! increments and writes into guest memory through a pinned page, plus some registers and a
//! block of device memory that travels in PRE_COPY.
//!
//! BAR0 (4 KiB, MSI-X table at 0x800, PBA at 0xc00):
//!
//! | off | reg | |
//! |---|---|---|
//! | 0x00 | CTRL | bit 0: the worker counts |
//! | 0x08 | TARGET | u64 guest address of the counter (8-byte aligned) |
//! | 0x10 | COUNT | u64, read-only |
//! | 0x18 | SCRATCH | u32 |
//! | 0x20 | MEM_INDEX | u32 byte index into the device memory |
//! | 0x24 | MEM_DATA | u8 at MEM_INDEX (a write marks its 4 KiB piece dirty) |
//!
//! The worker takes the step lock for each increment-and-write; `stop` sets `paused` and
//! takes the lock once, so when it returns no write is in flight and none follows. The
//! `leaky` variant's `stop` does neither: it keeps writing after STOP, the bug the
//! poisoned-memory test must catch. Every [`Migrate`] call is logged.
//!
//! The tests' setup is here too: a counter server ([`server`]), a VMM with the guest RAM
//! ([`connect`]), the counter started ([`start_counting`]).
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use umdev::dma::{DmaHandle, Prot, PAGE_SIZE};
use umdev::irq::Interrupts;
use umdev::migration::{
    decode_state, encode_state, MigState, Migrate, MigrationCaps, MigrationError,
};
use umdev::pci::{BarKind, BarSpec, MsixSpec, PciAdapter, PciConfig, PciDevice, PciIds};
use umdev::testing::{wait_until, DeviceAccess, TestServer, Vmm, MIGRATION_CAPS};
use vm_memory::Bytes;

pub const CTRL: u64 = 0x00;
pub const TARGET: u64 = 0x08;
pub const COUNT: u64 = 0x10;
pub const SCRATCH: u64 = 0x18;
pub const MEM_INDEX: u64 = 0x20;
pub const MEM_DATA: u64 = 0x24;
/// Size of the device memory.
pub const MEM_SIZE: usize = 48 * 1024;
const PIECE: usize = 4096;
const FORMAT: &str = "umdev-test-counter";

/// The tests' guest RAM (at guest address 0).
pub const RAM: usize = 1 << 20;
/// Where the tests have the counter write (guest address).
pub const COUNTER_AT: u64 = 0x3008;

/// A server of a [`Counter`].
pub type Server = TestServer<PciAdapter<Counter>>;

/// A counter server (`Counter::new(pre_copy, leaky)`) with small transfers: the stream (48
/// KiB of device memory and more) takes many reads.
pub fn server(pre_copy: bool, leaky: bool) -> Server {
    TestServer::builder_pci(Counter::new(pre_copy, leaky))
        .unwrap()
        .configure(|c| c.max_data_xfer_size = 4096)
        .start()
        .unwrap()
}

/// A VMM on `s` that negotiates migration, with [`RAM`] bytes of guest RAM at 0.
pub fn connect(s: &Server) -> Vmm {
    Vmm::connect_with_caps(s.path(), MIGRATION_CAPS)
        .unwrap()
        .with_ram(0, RAM)
        .unwrap()
}

/// Assert that the counter, migrated to `vmm`'s device, goes on counting past `count` into
/// `vmm`'s RAM at [`COUNTER_AT`] (within 5 s).
pub fn assert_counts_on(vmm: &Vmm, count: u64) {
    assert!(
        wait_until(Duration::from_secs(5), || vmm
            .ram()
            .read_u64(COUNTER_AT)
            .unwrap()
            > count),
        "the destination did not go on counting"
    );
}

/// Start the counter (the device enabled) writing at [`COUNTER_AT`] and wait until it has
/// counted.
pub fn start_counting(vmm: &mut Vmm, s: &Server) {
    vmm.write64(0, TARGET, COUNTER_AT).unwrap();
    vmm.write32(0, CTRL, 1).unwrap();
    let shared = s.device().device().shared().clone();
    assert!(
        wait_until(Duration::from_secs(5), || shared.writes.load(SeqCst) > 3),
        "the counter never wrote"
    );
}

/// The pinned page the worker writes through.
#[derive(Default)]
struct Step {
    pin: Option<(u64, u64)>, // (pfn, host address)
}

/// What the worker thread and the connection thread share.
#[derive(Default)]
pub struct Shared {
    step: Mutex<Step>,
    pub counter: AtomicU64,
    target: AtomicU64,
    running: AtomicBool,
    paused: AtomicBool,
    quit: AtomicBool,
    pub dma_errors: AtomicU64,
    pub writes: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The device.
pub struct Counter {
    shared: Arc<Shared>,
    dma: Option<DmaHandle>,
    worker: Option<JoinHandle<()>>,
    scratch: u32,
    mem_index: u32,
    mem: Vec<u8>,
    dirty: Vec<bool>,
    pre_copy: bool,
    leaky: bool,
    /// Every Migrate call, in order.
    pub calls: Vec<&'static str>,
    /// Fail the next `load` (to drive a failing arc).
    pub fail_load: bool,
}

impl Counter {
    /// A counter device; `pre_copy` offers PRE_COPY, `leaky` keeps DMA-ing after STOP.
    pub fn new(pre_copy: bool, leaky: bool) -> Counter {
        Counter {
            shared: Arc::new(Shared::default()),
            dma: None,
            worker: None,
            scratch: 0,
            mem_index: 0,
            mem: vec![0; MEM_SIZE],
            dirty: vec![true; MEM_SIZE / PIECE],
            pre_copy,
            leaky,
            calls: Vec::new(),
            fail_load: false,
        }
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub fn mem(&self) -> &[u8] {
        &self.mem
    }

    pub fn take_calls(&mut self) -> Vec<&'static str> {
        std::mem::take(&mut self.calls)
    }

    fn unpin(&self, step: &mut Step) {
        if let (Some((pfn, _)), Some(dma)) = (step.pin.take(), &self.dma) {
            let _ = dma.unpin_pages(&[pfn]);
        }
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.shared.quit.store(true, SeqCst);
        if let Some(t) = self.worker.take() {
            let _ = t.join();
        }
    }
}

/// One step of the worker: count and write the counter through the pinned page.
fn work(shared: &Shared, dma: &DmaHandle) {
    let mut step = lock(&shared.step);
    if shared.paused.load(SeqCst) || !shared.running.load(SeqCst) {
        return;
    }
    let target = shared.target.load(SeqCst);
    let pfn = target / PAGE_SIZE;
    if step.pin.is_some_and(|(p, _)| p != pfn) {
        if let Some((p, _)) = step.pin.take() {
            let _ = dma.unpin_pages(&[p]);
        }
    }
    if step.pin.is_none() {
        let mut host = [0u64];
        match dma.pin_pages(&[pfn], Prot::RW, &mut host) {
            Ok(()) => step.pin = Some((pfn, host[0])),
            Err(_) => {
                shared.dma_errors.fetch_add(1, SeqCst);
                return;
            }
        }
    }
    let Some((_, host)) = step.pin else { return };
    let c = shared.counter.fetch_add(1, SeqCst) + 1;
    // SAFETY: the page is pinned (under the step lock, which the unmap notifier and reset
    // take before they unpin), and `target % PAGE_SIZE + 8 <= PAGE_SIZE` (8-byte aligned).
    let slice = unsafe { dma.pinned_slice(host + target % PAGE_SIZE, 8) };
    let _ = slice.write_obj(c, 0);
    shared.writes.fetch_add(1, SeqCst);
}

#[derive(Serialize, Deserialize)]
struct StateV1 {
    counter: u64,
    target: u64,
    running: bool,
    scratch: u32,
    mem_index: u32,
    mem: Vec<u8>,
}

/// PRE_COPY chunk: the dirty pieces (index, bytes).
#[derive(Serialize, Deserialize)]
struct Pieces(Vec<(u32, Vec<u8>)>);

impl Migrate for Counter {
    fn caps(&self) -> MigrationCaps {
        MigrationCaps {
            pre_copy: self.pre_copy,
        }
    }

    fn stop(&mut self) -> Result<(), MigrationError> {
        self.calls.push("stop");
        if !self.leaky {
            self.shared.paused.store(true, SeqCst);
            drop(lock(&self.shared.step));
        }
        Ok(())
    }

    fn resume(&mut self) -> Result<(), MigrationError> {
        self.calls.push("resume");
        self.shared.paused.store(false, SeqCst);
        Ok(())
    }

    fn save(&mut self) -> Result<Vec<u8>, MigrationError> {
        self.calls.push("save");
        let s = &self.shared;
        encode_state(
            FORMAT,
            1,
            &StateV1 {
                counter: s.counter.load(SeqCst),
                target: s.target.load(SeqCst),
                running: s.running.load(SeqCst),
                scratch: self.scratch,
                mem_index: self.mem_index,
                mem: self.mem.clone(),
            },
        )
    }

    fn load(&mut self, state: &[u8]) -> Result<(), MigrationError> {
        self.calls.push("load");
        if std::mem::take(&mut self.fail_load) {
            return Err(MigrationError::Device("told to fail".into()));
        }
        let (_, st): (u32, StateV1) = decode_state(FORMAT, 1, 1, state)?;
        if st.mem.len() != MEM_SIZE {
            return Err(MigrationError::Incompatible(format!(
                "{} bytes of device memory",
                st.mem.len()
            )));
        }
        let mut step = lock(&self.shared.step);
        self.unpin(&mut step);
        let s = &self.shared;
        s.counter.store(st.counter, SeqCst);
        s.target.store(st.target, SeqCst);
        s.running.store(st.running, SeqCst);
        self.scratch = st.scratch;
        self.mem_index = st.mem_index;
        self.mem = st.mem;
        Ok(())
    }

    fn precopy(&mut self) -> Result<Option<Vec<u8>>, MigrationError> {
        self.calls.push("precopy");
        let mut pieces = Vec::new();
        for (i, d) in self.dirty.iter_mut().enumerate() {
            if std::mem::take(d) {
                pieces.push((i as u32, self.mem[i * PIECE..(i + 1) * PIECE].to_vec()));
            }
        }
        if pieces.is_empty() {
            return Ok(None);
        }
        postcard::to_allocvec(&Pieces(pieces))
            .map(Some)
            .map_err(|e| MigrationError::Device(e.to_string()))
    }

    fn load_precopy(&mut self, chunk: &[u8]) -> Result<(), MigrationError> {
        self.calls.push("load_precopy");
        let Pieces(pieces) =
            postcard::from_bytes(chunk).map_err(|e| MigrationError::Malformed {
                format: FORMAT.into(),
                why: e.to_string(),
            })?;
        for (i, bytes) in pieces {
            let start = i as usize * PIECE;
            let dst = self
                .mem
                .get_mut(start..start + PIECE)
                .filter(|_| bytes.len() == PIECE)
                .ok_or_else(|| MigrationError::Incompatible(format!("piece {i}")))?;
            dst.copy_from_slice(&bytes);
        }
        Ok(())
    }
}

impl PciDevice for Counter {
    fn config(&self) -> PciConfig {
        PciConfig {
            ids: PciIds {
                vendor: 0x1b36,
                device: 0x11c0,
                ..Default::default()
            },
            bars: vec![BarSpec {
                index: 0,
                size: 4096,
                kind: BarKind::Mmio32,
                prefetchable: false,
                shared: None,
            }],
            intx: true,
            msi_vectors: 1,
            msix: Some(MsixSpec {
                vectors: 2,
                table_bar: 0,
                table_offset: 0x800,
                pba_bar: 0,
                pba_offset: 0xc00,
            }),
            registers: Vec::new(),
            vendor_capabilities: Vec::new(),
        }
    }

    fn attach(&mut self, dma: DmaHandle, _irq: Interrupts) {
        self.dma = Some(dma.clone());
        let shared = self.shared.clone();
        self.worker = Some(
            std::thread::Builder::new()
                .name("counter".into())
                .spawn(move || {
                    while !shared.quit.load(SeqCst) {
                        work(&shared, &dma);
                        std::thread::sleep(Duration::from_micros(200));
                    }
                })
                .expect("spawn the counter worker"),
        );
    }

    fn bar_read(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
        let s = &self.shared;
        let v: u64 = match offset {
            CTRL => u64::from(s.running.load(SeqCst)),
            TARGET => s.target.load(SeqCst),
            COUNT => s.counter.load(SeqCst),
            SCRATCH => u64::from(self.scratch),
            MEM_INDEX => u64::from(self.mem_index),
            MEM_DATA => u64::from(self.mem.get(self.mem_index as usize).copied().unwrap_or(0)),
            _ => 0,
        };
        let n = data.len().min(8);
        data.fill(0);
        data[..n].copy_from_slice(&v.to_le_bytes()[..n]);
    }

    fn bar_write(&mut self, _bar: usize, offset: u64, data: &[u8]) {
        let mut b = [0u8; 8];
        let n = data.len().min(8);
        b[..n].copy_from_slice(&data[..n]);
        let v = u64::from_le_bytes(b);
        let s = &self.shared;
        match offset {
            CTRL => s.running.store(v & 1 != 0, SeqCst),
            TARGET => s.target.store(v & !7, SeqCst),
            SCRATCH => self.scratch = v as u32,
            MEM_INDEX => self.mem_index = v as u32,
            MEM_DATA => {
                let i = self.mem_index as usize;
                if let Some(m) = self.mem.get_mut(i) {
                    *m = v as u8;
                    self.dirty[i / PIECE] = true;
                }
            }
            _ => {}
        }
    }

    fn reset(&mut self) {
        let mut step = lock(&self.shared.step);
        self.unpin(&mut step);
        let s = &self.shared;
        s.counter.store(0, SeqCst);
        s.target.store(0, SeqCst);
        s.running.store(false, SeqCst);
        self.scratch = 0;
        self.mem_index = 0;
        self.mem.fill(0);
        self.dirty.fill(true);
    }

    fn dma_unmap(&mut self, iova: u64, size: u64) {
        let mut step = lock(&self.shared.step);
        if let Some((pfn, _)) = step.pin {
            let a = pfn * PAGE_SIZE;
            if a >= iova && a - iova < size {
                self.unpin(&mut step);
            }
        }
    }

    fn migration(&mut self) -> Option<&mut dyn Migrate> {
        Some(self)
    }
}

/// The state a test walks from RUNNING to reach `s` (with the stream `stream` written in
/// RESUMING when the path passes through it).
pub fn state_name(s: MigState) -> &'static str {
    match s {
        MigState::Error => "ERROR",
        MigState::Stop => "STOP",
        MigState::Running => "RUNNING",
        MigState::StopCopy => "STOP_COPY",
        MigState::Resuming => "RESUMING",
        MigState::RunningP2p => "RUNNING_P2P",
        MigState::PreCopy => "PRE_COPY",
        MigState::PreCopyP2p => "PRE_COPY_P2P",
    }
}
