//! Isolation between instances: one instance broken in each way (its device panics, a
//! hostile client sends garbage or stalls mid-message, a client never answers the device's
//! fd-less DMA, the device is stuck in a call) and the other keeps answering, its DMA
//! works, and the registry keeps answering.

mod instance_util;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use instance_util::*;
use umdev::instance::{InstanceError, Params, Registry, RegistryConfig};
use umdev::protocol::{Command, Header};
use umdev::testing::{wait_until, Answer, DeviceAccess, RawClient, Vmm};

/// Run `f` on its own thread and fail if it takes longer than `limit` (a hang fails the
/// test instead of hanging the suite).
fn within<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("{what} did not finish within {limit:?}"))
}

struct Two {
    _dir: tempfile::TempDir,
    reg: Arc<Registry>,
    parent: Arc<ProbeParent>,
    a: umdev::instance::InstanceInfo,
    b: umdev::instance::InstanceInfo,
}

fn two(tune: impl FnOnce(&mut RegistryConfig)) -> Two {
    let (dir, reg) = registry_with(tune);
    let parent = Arc::new(ProbeParent::new("p", 8));
    reg.add_parent(parent.clone()).unwrap();
    let a = reg.create("probe", None, &params(&[("tag", "1")])).unwrap();
    let b = reg.create("probe", None, &params(&[("tag", "2")])).unwrap();
    Two {
        _dir: dir,
        reg: Arc::new(reg),
        parent,
        a,
        b,
    }
}

/// A guest on `socket`: 1 MiB of RAM at 1 GiB, device enabled, ADDR at the RAM's start.
fn guest(socket: &std::path::Path) -> Vmm {
    let mut vmm = Vmm::connect(socket)
        .unwrap()
        .with_ram(1 << 30, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    vmm.write64(0, REG_ADDR, 1 << 30).unwrap();
    vmm
}

/// The instance behind `vmm` answers (its tag is `tag`) and its DMA works.
fn assert_serves(vmm: &mut Vmm, tag: u32) {
    assert_eq!(vmm.read32(0, REG_ID).unwrap(), MAGIC);
    assert_eq!(vmm.read32(0, REG_TAG).unwrap(), tag);
    let before = vmm.ram().read_u64(1 << 30).unwrap();
    vmm.write32(0, REG_ADD, 3).unwrap();
    assert_eq!(vmm.ram().read_u64(1 << 30).unwrap(), before + 3, "DMA");
}

/// The registry answers: both instances listed, a third one created and removed.
fn assert_registry_answers(reg: &Registry, expect: usize) {
    assert_eq!(reg.instances().len(), expect);
    assert!(!reg.types().is_empty());
    let c = reg.create("probe", None, &Params::new()).unwrap();
    reg.remove(&c.uuid, false).unwrap();
}

#[test]
fn test_isolation_device_panic_other_instance_serves() {
    let t = two(|_| {});
    let mut a = guest(&t.a.socket);
    let mut b = guest(&t.b.socket);
    assert_serves(&mut b, 2);
    // A's device panics while handling a message: its client gets EIO and is dropped.
    let e = a.write32(0, REG_PANIC, 1).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    assert!(wait_until(Duration::from_secs(5), || !t
        .reg
        .instance(&t.a.uuid)
        .unwrap()
        .client_attached));
    assert_serves(&mut b, 2);
    assert_registry_answers(&t.reg, 2);
    // A itself serves its next client (its teardown ran: the same RAM maps again).
    drop(a);
    let mut a = guest(&t.a.socket);
    assert_serves(&mut a, 1);
    drop(a);
    t.reg.remove(&t.a.uuid, false).unwrap();
    assert_serves(&mut b, 2);
}

#[test]
fn test_isolation_hostile_client_garbage_and_stall_other_instance_serves() {
    let t = two(|_| {});
    let mut b = guest(&t.b.socket);
    // Garbage bytes instead of VERSION: A answers with errors or waits for the rest of what
    // the garbage announces; the client's hang-up ends that connection.
    let mut garbage = RawClient::connect(&t.a.socket);
    let noise: Vec<u8> = (0..256u32)
        .map(|i| (i.wrapping_mul(167) ^ 0x5a) as u8)
        .collect();
    garbage.send_raw(&noise, &[]);
    assert_serves(&mut b, 2);
    drop(garbage);
    assert!(wait_until(Duration::from_secs(5), || !t
        .reg
        .instance(&t.a.uuid)
        .unwrap()
        .client_attached));
    // A negotiated client that announces 4 KiB and sends 10 bytes, then nothing: A's
    // connection thread waits for the rest for as long as the client keeps the socket.
    let mut stall = RawClient::new_default(&t.a.socket);
    let hdr = Header {
        msg_id: 7,
        command: Command::RegionWrite as u16,
        msg_size: 16 + 4096,
        flags: 0,
        error: 0,
    };
    let mut bytes = hdr.encode().to_vec();
    bytes.extend_from_slice(&[0u8; 10]);
    stall.send_raw(&bytes, &[]);
    std::thread::sleep(Duration::from_millis(50));
    assert!(t.reg.instance(&t.a.uuid).unwrap().client_attached);
    let reg = t.reg.clone();
    let mut b = within(Duration::from_secs(10), "B and the registry", move || {
        assert_serves(&mut b, 2);
        assert_registry_answers(&reg, 2);
        b
    });
    // A recovers once the hostile client is gone.
    drop(stall);
    assert!(wait_until(Duration::from_secs(5), || !t
        .reg
        .instance(&t.a.uuid)
        .unwrap()
        .client_attached));
    let mut a = guest(&t.a.socket);
    assert_serves(&mut a, 1);
    assert_serves(&mut b, 2);
}

#[test]
fn test_isolation_stuck_fdless_dma_other_instance_serves() {
    let t = two(|c| c.server.remote_dma_timeout = Duration::from_secs(3));
    let mut b = guest(&t.b.socket);
    // A's client maps memory without an fd and never answers the device's DMA_READ: A's
    // device, doing that DMA in a posted register write, holds A's connection thread until
    // the remote DMA timeout.
    let mut a = Vmm::connect(&t.a.socket).unwrap();
    a.set_answer(Answer::Silent);
    a.dma_map_fdless(1 << 30, 1 << 20).unwrap();
    a.enable_device().unwrap();
    a.write64(0, REG_ADDR, 1 << 30).unwrap();
    a.write32_posted(0, REG_ADD, 1).unwrap();
    let request = a.hold_request().unwrap();
    assert_eq!((request.iova, request.count), (1 << 30, 8));
    let failures = t.parent.dma_failures.clone();
    let reg = t.reg.clone();
    let mut b = within(Duration::from_secs(10), "B and the registry", move || {
        for _ in 0..5 {
            assert_serves(&mut b, 2);
        }
        assert_registry_answers(&reg, 2);
        b
    });
    assert_eq!(
        failures.load(Ordering::SeqCst),
        0,
        "B was served while A's DMA was still waiting for its client"
    );
    // A's DMA times out; A then serves again.
    assert!(wait_until(Duration::from_secs(10), || failures
        .load(Ordering::SeqCst)
        == 1));
    assert_eq!(a.read32(0, REG_ID).unwrap(), MAGIC);
    assert_serves(&mut b, 2);
}

/// Opens a gate when dropped, so that a failing test does not leave a device stuck.
struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

#[test]
fn test_isolation_stuck_device_other_instance_serves_registry_answers() {
    let t = two(|c| {
        c.release_timeout = Duration::from_millis(200);
        c.teardown_timeout = Duration::from_millis(200);
    });
    let _open = OpenOnDrop(t.parent.gate.clone());
    let mut b = guest(&t.b.socket);
    let mut a = guest(&t.a.socket);
    // A's device blocks in a register write, holding A's connection thread and device.
    a.write32_posted(0, REG_STUCK, 1).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let reg = t.reg.clone();
    let a_uuid = t.a.uuid.clone();
    let mut b = within(Duration::from_secs(10), "B and the registry", move || {
        assert_serves(&mut b, 2);
        assert_registry_answers(&reg, 2);
        assert!(reg.instance(&a_uuid).unwrap().client_attached);
        // Removing A is bounded: Busy, then Stuck when forced; A stays registered.
        assert!(matches!(
            reg.remove(&a_uuid, false),
            Err(InstanceError::Busy(_))
        ));
        assert!(matches!(
            reg.remove(&a_uuid, true),
            Err(InstanceError::Stuck { .. })
        ));
        assert!(reg.instance(&a_uuid).is_ok());
        assert_serves(&mut b, 2);
        b
    });
    assert_eq!(available(&t.reg, "p", "probe"), 6, "A still holds its slot");
    // Once A's device comes back, A can be removed, and B is untouched.
    t.parent.gate.open();
    drop(a);
    let report = within(Duration::from_secs(10), "removing A", {
        let (reg, uuid) = (t.reg.clone(), t.a.uuid.clone());
        move || reg.remove(&uuid, true)
    })
    .unwrap();
    assert_eq!(report.dma.pinned_pages, 0);
    assert_eq!(available(&t.reg, "p", "probe"), 7);
    assert_serves(&mut b, 2);
}

#[test]
fn test_isolation_map_flood_one_instance_enomem_other_keeps_guarantee_serves() {
    // One pool of 100 fd-backed maps for a registry of at most 2 instances: each is
    // guaranteed 50 whatever the other's client does.
    let t = two(|c| {
        c.max_instances = 2;
        c.dma.map_pool = Some(umdev::dma::MapPool::with_capacity(100));
    });
    assert_eq!(t.a.map_share, (50, 100));
    assert_eq!(t.b.map_share, (50, 100));
    let mut attacker = RawClient::new_default(&t.a.socket);
    let mem = umdev::testing::memfd(120 * 4096).unwrap();
    let mut mapped = 0u64;
    let errno = loop {
        let p = umdev::protocol::dma_map::DmaMapRequest {
            flags: 3,
            offset: mapped * 4096,
            iova: (1 << 32) + mapped * 4096,
            size: 4096,
        }
        .encode();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&mem);
        match attacker
            .call(Command::DmaMap as u16, 0, &p, &[fd])
            .header
            .error
        {
            0 => mapped += 1,
            e => break e as i32,
        }
        assert!(mapped <= 100);
    };
    assert_eq!((mapped, errno), (50, libc::ENOMEM));
    let listed = t.reg.instances();
    let a = listed.iter().find(|i| i.uuid == t.a.uuid).unwrap();
    assert_eq!(a.dma.fd_maps, 50);
    // The other instance maps its guest's RAM and serves.
    let mut vmm = guest(&t.b.socket);
    assert_serves(&mut vmm, 2);
    drop(t.parent);
}
