//! hello — the smallest complete umdev device, as a template for writing your own.
//!
//! One BAR with three registers, one DMA operation, one interrupt:
//! - `0x00 ID` (read-only): the magic `0x4845_4c4f` ("HELO").
//! - `0x08 ADDR` (64-bit): guest address of a little-endian u64 counter.
//! - `0x10 DOORBELL` (write): the device adds the written value to the counter in guest
//!   memory (a DMA read and a DMA write) and raises interrupt vector 0.
//!
//! The DMA runs on a worker thread, not in the register handler: with guest RAM that QEMU
//! maps without fds, DMA is a request to QEMU, which it cannot answer while it waits for
//! the server to reply to something else (see protocol-docs/server-dma.md).
//!
//! [`HelloParent`] makes it an mdev-style parent (`umdev::instance`): one type, `hello`, at
//! most four instances at once, each served on a socket of its own by a `Registry`.
//!
//! `cargo run --example hello` serves one instance and drives it with the embedded VMM
//! (standing in for QEMU and a guest driver). Pass `--serve PATH` to only serve the device,
//! e.g. for QEMU 10.1+ (see the README for the command line).
//!
//! `--daemon --state-dir DIR --socket-dir DIR [--control PATH]` serves the parent from a
//! daemon (`umdev::daemon`: definitions kept across restarts, a control socket, autostart,
//! migration, systemd) until Ctrl-C; `umdev`'s client commands drive it:
//! `UMDEV_CONTROL=<socket-dir>/control.sock umdev create --type hello --auto`, `umdev list`,
//! `umdev remove UUID`.
//!
//! The test at the end is how a device author tests a device with `umdev::testing`
//! (`[dev-dependencies] umdev = { ..., features = ["testing"] }`); it runs with
//! `cargo test --example hello` and with `cargo test --workspace`.
use std::{env, path::PathBuf, sync::Arc, time::Duration};

use crossbeam_channel::Sender;

use umdev::daemon::{Daemon, DaemonBuilder, DaemonConfig};
use umdev::device::Device;
use umdev::dma::{DmaConfig, DmaHandle, DmaSpace};
use umdev::instance::{
    CreateRequest, InstanceError, InstanceType, Params, Parent, Registry, RegistryConfig, Resource,
};
use umdev::irq::Interrupts;
use umdev::pci::{BarKind, BarSpec, PciAdapter, PciConfig, PciDevice, PciIds};
use umdev::server::{Server, ServerConfig, TerminationSignals};
use umdev::testing::{wait_eventfd, DeviceAccess, Vmm};

const REG_ID: u64 = 0x00;
const REG_ADDR: u64 = 0x08;
const REG_DOORBELL: u64 = 0x10;
const MAGIC: u32 = 0x4845_4c4f;

/// The device: its register, and its DMA worker (started at attach).
#[derive(Default)]
struct Hello {
    addr: u64,
    worker: Option<Worker>,
}

/// The worker thread and its queue of doorbells (counter address, value to add).
struct Worker {
    queue: Sender<(u64, u64)>,
    thread: std::thread::JoinHandle<()>,
    handles: (DmaHandle, Interrupts),
}

impl Worker {
    fn start(dma: DmaHandle, irq: Interrupts) -> Worker {
        let (queue, rx) = crossbeam_channel::unbounded();
        let (d, i) = (dma.clone(), irq.clone());
        // Ends when the queue's sender is dropped, after the work already queued.
        let thread = std::thread::spawn(move || {
            for (addr, add) in rx {
                add_to_counter(&d, &i, addr, add);
            }
        });
        Worker {
            queue,
            thread,
            handles: (dma, irq),
        }
    }

    /// Finish what was queued and stop: after this the old work does no more DMA and
    /// raises no interrupt. Returns the handles, to start again.
    fn finish(self) -> (DmaHandle, Interrupts) {
        drop(self.queue);
        let _ = self.thread.join();
        self.handles
    }
}

impl PciDevice for Hello {
    fn config(&self) -> PciConfig {
        PciConfig {
            ids: PciIds {
                vendor: 0x1af4,
                device: 0x10f0,
                class_code: 0xff_00_00,
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
            msix: None,
            registers: Vec::new(),
            vendor_capabilities: Vec::new(),
        }
    }

    fn attach(&mut self, dma: DmaHandle, irq: Interrupts) {
        self.worker = Some(Worker::start(dma, irq));
    }

    fn bar_read(&mut self, _bar: usize, offset: u64, data: &mut [u8]) {
        let value = match offset {
            REG_ID => u64::from(MAGIC),
            REG_ADDR => self.addr,
            _ => 0, // unimplemented registers read as zero
        };
        let n = data.len().min(8);
        data[..n].copy_from_slice(&value.to_le_bytes()[..n]);
    }

    fn bar_write(&mut self, _bar: usize, offset: u64, data: &[u8]) {
        let mut bytes = [0u8; 8];
        bytes[..data.len().min(8)].copy_from_slice(&data[..data.len().min(8)]);
        match (offset, u64::from_le_bytes(bytes)) {
            (REG_ADDR, value) => self.addr = value,
            (REG_DOORBELL, value) => {
                if let Some(w) = &self.worker {
                    let _ = w.queue.send((self.addr, value));
                }
            }
            _ => tracing::debug!("hello: write to unknown register {offset:#x} ignored"),
        }
    }

    /// Back to power-on state. A reset must leave no trace of earlier work after it
    /// returns (no DMA, no interrupt): the worker finishes its queue before a new one starts.
    fn reset(&mut self) {
        self.addr = 0;
        if let Some(w) = self.worker.take() {
            let (dma, irq) = w.finish();
            self.worker = Some(Worker::start(dma, irq));
        }
    }
}

/// The one DMA operation. The guest chose the address: any failure (unmapped, read-only,
/// Bus Master off, fd-less without a client) is logged, never a panic.
fn add_to_counter(dma: &DmaHandle, irq: &Interrupts, addr: u64, add: u64) {
    let result = dma
        .read_obj::<u64>(addr)
        .and_then(|v| dma.write_obj(addr, &v.wrapping_add(add)));
    match result {
        Ok(()) => {
            irq.trigger(0);
        }
        Err(e) => tracing::warn!("hello: DMA at {addr:#x} failed: {e}"),
    }
}

/// The hello device as a parent: one type, `hello`, and four slots, one per instance. The
/// default `check_params` takes no parameters.
struct HelloParent;

impl Parent for HelloParent {
    fn name(&self) -> &str {
        "hello"
    }

    fn resources(&self) -> Vec<Resource> {
        let slots = Resource {
            name: "slots".into(),
            unit: "slots".into(),
            total: 4,
        };
        vec![slots]
    }

    fn types(&self) -> Vec<InstanceType> {
        vec![InstanceType {
            name: "hello".into(),
            description: "the hello counter device".into(),
            device_api: "vfio-pci".into(),
            needs: vec![("slots".into(), 1)],
        }]
    }

    fn create(&self, _req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
        let device = PciAdapter::new(Hello::default()).map_err(InstanceError::Device)?;
        Ok(Box::new(device))
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args: Vec<String> = env::args().collect();
    if args.get(1).map(String::as_str) == Some("--daemon") {
        return Ok(daemon(daemon_config(&args[2..])?).run()?);
    }
    let serve_only = args.get(1).map(String::as_str) == Some("--serve");
    let dir = tempfile::tempdir()?;
    let socket = match args.get(2) {
        Some(p) if serve_only => PathBuf::from(p),
        _ => dir.path().join("hello.sock"),
    };

    if serve_only {
        // Before any thread starts, so that Ctrl-C/SIGTERM reach `serve_until_signal`.
        let signals = TerminationSignals::block();
        let device = PciAdapter::new(Hello::default())?;
        let dma = DmaSpace::new(DmaConfig::default());
        let server =
            Server::new(ServerConfig::new(&socket), Box::new(device), dma.clone()).spawn()?;
        println!("serving hello on {} (Ctrl-C to stop)", socket.display());
        return Ok(signals.serve_until_signal(server, &dma)?);
    }

    // One instance of the hello parent, as `umdev daemon` would serve it.
    let registry = Registry::new(RegistryConfig::new(dir.path()))?;
    registry.add_parent(Arc::new(HelloParent))?;
    let instance = registry.create("hello", None, &Params::new())?;
    println!(
        "instance {} on {}",
        instance.uuid,
        instance.socket.display()
    );

    // Play VMM and guest driver: 1 MiB of guest RAM at 1 GiB, counter at its start.
    let mut vmm = Vmm::connect(&instance.socket)?.with_ram(1 << 30, 1 << 20)?;
    vmm.enable_device()?;
    let msi = vmm.enable_msi()?;
    println!("ID register: {:#x}", vmm.read32(0, REG_ID)?);
    vmm.write32(0, REG_ADDR, 1 << 30)?;
    vmm.write32(0, REG_ADDR + 4, 0)?;
    for add in [1u32, 2, 39] {
        vmm.write32(0, REG_DOORBELL, add)?;
        let fired = wait_eventfd(&msi, Duration::from_secs(2)).is_some();
        let counter = vmm.ram().read_u64(1 << 30)?;
        println!("doorbell +{add}: counter = {counter}, MSI fired: {fired}");
    }
    drop(vmm);
    registry.remove(&instance.uuid, false)?;
    Ok(())
}

/// The hello parent served from a daemon: all it takes. Call it before any thread starts
/// (it blocks the signals the daemon waits for).
fn daemon(config: DaemonConfig) -> DaemonBuilder {
    Daemon::builder(config).parent(Arc::new(HelloParent))
}

/// The daemon's directories from `--state-dir DIR --socket-dir DIR [--control PATH]`.
fn daemon_config(flags: &[String]) -> Result<DaemonConfig, String> {
    let (mut state, mut sockets, mut control) = (None, None, None);
    let mut flags = flags.iter();
    while let Some(flag) = flags.next() {
        let value = flags.next().map(PathBuf::from);
        let slot = match flag.as_str() {
            "--state-dir" => &mut state,
            "--socket-dir" => &mut sockets,
            "--control" => &mut control,
            _ => return Err(format!("unknown flag {flag:?}")),
        };
        *slot = Some(value.ok_or_else(|| format!("{flag} needs a value"))?);
    }
    let (Some(state), Some(sockets)) = (state, sockets) else {
        return Err("--daemon needs --state-dir DIR and --socket-dir DIR".into());
    };
    let mut config = DaemonConfig::new(state, sockets);
    config.control = control;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;
    use umdev::daemon::client::{self, ClientError};
    use umdev::daemon::protocol::{Reply, Request};
    use umdev::testing::{FdlessMemory, TestServer};

    #[test]
    fn test_hello_doorbell_adds_to_guest_counter_and_raises_msi(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let server = TestServer::start_pci(Hello::default())?;
        let mut vmm = server.connect()?.with_ram(1 << 30, 1 << 20)?;
        vmm.enable_device()?;
        let msi = vmm.enable_msi()?;
        assert_eq!(vmm.read32(0, REG_ID)?, MAGIC);
        vmm.ram().write_u64(1 << 30, 40)?;
        vmm.write64(0, REG_ADDR, 1 << 30)?;
        vmm.write32(0, REG_DOORBELL, 2)?;
        assert!(
            wait_eventfd(&msi, Duration::from_secs(2)).is_some(),
            "no MSI"
        );
        assert_eq!(vmm.ram().read_u64(1 << 30)?, 42);
        // An address nothing maps: the DMA fails (logged), no interrupt, the device serves on.
        vmm.write64(0, REG_ADDR, 0x1000)?;
        vmm.write32(0, REG_DOORBELL, 1)?;
        assert_eq!(wait_eventfd(&msi, Duration::from_millis(50)), None);
        assert_eq!(vmm.read32(0, REG_ID)?, MAGIC);
        Ok(())
    }

    #[test]
    fn test_hello_reset_leaves_no_dma_of_earlier_doorbells_after_the_reply(
    ) -> Result<(), Box<dyn std::error::Error>> {
        // Guest RAM without fds, and a client that, like QEMU, answers the device's DMA only
        // after the reply it waits for: the reset must not leave queued work behind.
        let server = TestServer::start_pci(Hello::default())?;
        let mut vmm = server
            .connect()?
            .with_fdless(FdlessMemory::new(1 << 30, 4096))
            .qemu_like()?;
        vmm.dma_map_fdless(1 << 30, 4096)?;
        vmm.enable_device()?;
        vmm.write64(0, REG_ADDR, 1 << 30)?;
        for _ in 0..5 {
            vmm.write32_posted(0, REG_DOORBELL, 1)?;
        }
        vmm.hold_request()?; // the first doorbell's DMA_READ, not answered yet
        vmm.reset()?;
        let at_reply = vmm.requests();
        // The guest's driver sets Bus Master again (reset cleared it): still nothing.
        vmm.enable_device()?;
        vmm.serve_idle(Duration::from_millis(200), |_| false)?;
        assert_eq!(
            vmm.requests(),
            at_reply,
            "DMA after the reset reply: {:?}",
            &vmm.log()[at_reply..]
        );
        Ok(())
    }

    #[test]
    fn test_hello_parent_four_instances_each_counts_on_its_own(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let registry = Registry::new(RegistryConfig::new(dir.path()))?;
        registry.add_parent(Arc::new(HelloParent))?;
        let instances: Vec<_> = (0..4)
            .map(|_| registry.create("hello", None, &Params::new()))
            .collect::<Result<_, _>>()?;
        assert_eq!(registry.types()[0].available_instances, 0);
        assert!(matches!(
            registry.create("hello", None, &Params::new()),
            Err(InstanceError::Exhausted { .. })
        ));
        // Each instance is a device of its own: its own socket, guest memory and counter.
        for (i, instance) in instances.iter().enumerate() {
            let mut vmm = Vmm::connect(&instance.socket)?.with_ram(1 << 30, 1 << 20)?;
            vmm.enable_device()?;
            vmm.write64(0, REG_ADDR, 1 << 30)?;
            vmm.write32(0, REG_DOORBELL, i as u32 + 1)?;
            let counted = || vmm.ram().read_u64(1 << 30).ok() == Some(i as u64 + 1);
            assert!(umdev::testing::wait_until(Duration::from_secs(2), counted));
        }
        registry.remove(&instances[0].uuid, false)?;
        assert_eq!(registry.types()[0].available_instances, 1);
        Ok(())
    }

    /// `request` to the daemon on `control`, once it answers (it binds its socket first).
    fn call(control: &std::path::Path, request: &Request) -> Result<Reply, ClientError> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match client::call(control, request) {
                Err(ClientError::NoDaemon { .. }) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                result => return result,
            }
        }
    }

    #[test]
    fn test_hello_daemon_create_attach_remove_definition_survives_restart(
    ) -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = |p: &str| dir.path().join(p).to_string_lossy().into_owned();
        let flags = [
            "--state-dir".into(),
            path("state"),
            "--socket-dir".into(),
            path("sockets"),
        ];
        let control = dir.path().join("sockets/control.sock");
        // The daemon on a thread of its own, stopped through its handle (as by SIGTERM).
        let start = || {
            let builder = daemon(daemon_config(&flags).unwrap());
            let stop = builder.stop_handle();
            (stop, std::thread::spawn(move || builder.run()))
        };
        let (stop, served) = start();

        // A definition with autostart, started now: `umdev create --type hello --auto`.
        let create = Request::Create {
            type_spec: "hello".into(),
            uuid: None,
            params: Params::new(),
            auto: true,
        };
        let Reply::Started(started) = call(&control, &create)? else {
            panic!("create did not start an instance");
        };
        let uuid = started.instance.uuid.clone();
        assert!(started.definition.is_some());
        // The instance serves like any hello: a doorbell counts in guest memory.
        let mut vmm = Vmm::connect(&started.instance.socket)?.with_ram(1 << 30, 1 << 20)?;
        vmm.enable_device()?;
        vmm.write64(0, REG_ADDR, 1 << 30)?;
        vmm.write32(0, REG_DOORBELL, 42)?;
        let counted = || vmm.ram().read_u64(1 << 30).ok() == Some(42);
        assert!(umdev::testing::wait_until(Duration::from_secs(2), counted));
        drop(vmm);
        stop.stop();
        served.join().unwrap()?;

        // A new daemon on the same directories: the definition is back, started.
        let (stop, served) = start();
        let Reply::Instances(running) = call(&control, &Request::List { defined: false })? else {
            panic!("list did not list instances");
        };
        assert_eq!(running.instances.len(), 1);
        assert_eq!(running.instances[0].uuid, uuid);
        assert!(running.instances[0].autostart);
        let mut vmm = Vmm::connect(&running.instances[0].socket)?;
        assert_eq!(vmm.read32(0, REG_ID)?, MAGIC);
        drop(vmm);
        // `umdev remove UUID`: stopped, and its definition deleted.
        let remove = Request::Remove {
            uuid: uuid.clone(),
            force: false,
        };
        let Reply::Removed(removed) = call(&control, &remove)? else {
            panic!("remove did not remove");
        };
        assert!(removed.stopped.is_some() && removed.undefined.is_some());
        let Reply::Definitions(defs) = call(&control, &Request::List { defined: true })? else {
            panic!("list --defined did not list definitions");
        };
        assert!(defs.definitions.is_empty());
        stop.stop();
        served.join().unwrap()?;
        Ok(())
    }
}
