//! GPU instances of one [`GpuParent`], built with `Parent::create` and each served on its
//! own socket: they share one render engine by weight, an idle instance's FENCE is not
//! queued behind the others' floods, a stuck client stalls only its own instance, and a
//! reset quiesces one instance while the engine keeps serving the others.
//!
//! Nothing here is timed: shares are counted in work units and the FENCE's wait in engine
//! units ([`EngineStats`]), so the checks hold on a loaded machine; the time limits only
//! turn a hang into a failure.

use std::time::{Duration, Instant};

use umdev::device::{region_index, Device};
use umdev::instance::{CreateRequest, Params, Parent};
use umdev::protocol::Command as Wire;
use umdev::testing::{DeviceAccess, DmaRequest, FdlessMemory, RawClient, TestServer, Vmm};
use umdev_devices::gpu::engine::EngineThreadHold;
use umdev_devices::gpu::regs::*;
use umdev_devices::gpu::{Command, EngineStats, GpuHandle, GpuParent, GpuParentConfig};

const BAR: u32 = region_index::BAR0;
const RAM_GPA: u64 = 0x1000_0000;
const RING_GPA: u64 = RAM_GPA;
/// The largest ring: the longest flood one fetch can queue.
const RING_SIZE: u32 = RING_SIZE_MAX;
const RAM_SIZE: usize = RING_SIZE as usize;
/// The mode every instance uses (fits the 4 MiB type).
const W: u32 = 256;
const H: u32 = 256;
/// Turns a hang into a failure; no check depends on it.
const HANG: Duration = Duration::from_secs(60);

/// One instance: served, connected, mode set, ring on.
struct Instance {
    uuid: String,
    _served: TestServer<Box<dyn Device>>,
    vmm: Vmm,
    gpu: GpuHandle,
}

fn parent() -> GpuParent {
    GpuParent::new(GpuParentConfig::default()).unwrap()
}

fn create(parent: &GpuParent, uuid: &str, type_name: &str) -> Box<dyn Device> {
    parent
        .create(CreateRequest {
            uuid,
            type_name,
            params: &Params::new(),
        })
        .unwrap()
}

/// What a guest driver does at probe: bus master, mode, ring.
fn init(vmm: &mut Vmm) {
    vmm.enable_device().unwrap();
    for (off, v) in [
        (REG_MODE_WIDTH, W),
        (REG_MODE_HEIGHT, H),
        (REG_MODE_STRIDE, W * 4),
        (REG_MODE_FORMAT, FORMAT_XRGB8888),
        (REG_MODE_CTRL, 1),
        (REG_RING_BASE_LO, RING_GPA as u32),
        (REG_RING_BASE_HI, (RING_GPA >> 32) as u32),
        (REG_RING_SIZE, RING_SIZE),
        (REG_RING_CTRL, 1),
    ] {
        vmm.write32(BAR, off, v).unwrap();
    }
    assert_eq!(vmm.read32(BAR, REG_RING_CTRL).unwrap(), 1, "ring rejected");
    assert_eq!(vmm.read32(BAR, REG_MODE_CTRL).unwrap(), 1, "mode rejected");
}

fn instance(parent: &GpuParent, uuid: &str, type_name: &str) -> Instance {
    let served = TestServer::start(create(parent, uuid, type_name)).unwrap();
    let mut vmm = served
        .connect()
        .unwrap()
        .with_ram(RAM_GPA, RAM_SIZE)
        .unwrap();
    init(&mut vmm);
    Instance {
        uuid: uuid.to_owned(),
        _served: served,
        vmm,
        gpu: parent.handle(uuid).unwrap(),
    }
}

/// As many `w`×`h` fills as fit the ring, in changing colors; the encoded ring and the
/// number of commands.
fn flood_ring(w: u32, h: u32) -> (Vec<u8>, u64) {
    let n = (RING_SIZE as usize - 4) / 24;
    let cmds: Vec<Command> = (0..n as u32)
        .map(|k| Command::FillRect {
            x: k % (W - w + 1),
            y: 0,
            w,
            h,
            color: 0x0010_0000 | k,
        })
        .collect();
    (Command::encode_bytes(&cmds), n as u64)
}

/// Write `bytes` at the ring's start and publish them.
fn publish(i: &mut Instance, bytes: &[u8]) {
    i.vmm.ram().write(RING_GPA, bytes).unwrap();
    i.vmm
        .write32(BAR, REG_RING_TAIL, bytes.len() as u32)
        .unwrap();
}

fn stats(instances: &[Instance]) -> Vec<EngineStats> {
    instances.iter().map(|i| i.gpu.engine_stats()).collect()
}

/// Poll until `done(stats)`; panics with `what` after [`HANG`].
fn wait_for(
    instances: &[Instance],
    what: &str,
    done: impl Fn(&[EngineStats]) -> bool,
) -> Vec<EngineStats> {
    let deadline = Instant::now() + HANG;
    loop {
        let s = stats(instances);
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: {s:?}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Stop an instance's flood: the ring goes off, the engine drops what is left of it.
fn stop_flood(i: &mut Instance) {
    i.vmm.write32(BAR, REG_RING_CTRL, 0).unwrap();
}

#[test]
fn test_gpu_parent_flooding_instances_share_engine_work_by_weight() {
    let parent = parent();
    // Weights 1, 1, 4; each floods with fills of its own size, so a count of commands
    // (round robin) would not give the weighted shares of work.
    let mut gpus = vec![
        instance(&parent, "a-4m", "gpu-4m"),
        instance(&parent, "b-4m", "gpu-4m"),
        instance(&parent, "c-16m", "gpu-16m"),
    ];
    let weights = [1.0, 1.0, 4.0];
    let rings = [flood_ring(16, 16), flood_ring(64, 8), flood_ring(32, 32)];
    let total: Vec<u64> = rings.iter().map(|r| r.1).collect();
    for (g, (ring, _)) in gpus.iter_mut().zip(&rings) {
        publish(g, ring);
    }
    let unfinished = |s: &[EngineStats]| s.iter().zip(&total).all(|(s, &n)| s.commands < n);

    // Every instance has its whole flood queued once it has executed one command.
    let start = wait_for(&gpus, "every instance starts", |s| {
        s.iter().all(|s| s.commands > 0) || !unfinished(s)
    });
    assert!(
        unfinished(&start),
        "an instance finished its {total:?} commands before every instance had run one: \
         the engine does not share ({start:?})"
    );
    // A window in which all three stay backlogged: the heaviest gets through a quarter
    // of its flood (the others, at a quarter of its rate, are far from their end).
    let end = wait_for(&gpus, "the 16m instance progresses", |s| {
        s[2].commands >= start[2].commands + total[2] / 4 || !unfinished(s)
    });
    assert!(
        unfinished(&end),
        "an instance ran dry inside the window: {end:?} of {total:?}"
    );
    let work: Vec<f64> = start
        .iter()
        .zip(&end)
        .map(|(a, b)| (b.work - a.work) as f64)
        .collect();
    let all: f64 = work.iter().sum();
    let sum_w: f64 = weights.iter().sum();
    for (k, (&got, &w)) in work.iter().zip(&weights).enumerate() {
        let expected = all * w / sum_w;
        let err = (got - expected).abs() / expected;
        assert!(
            err <= 0.10,
            "instance {k} (weight {w}): {got} of {all} work units, expected {expected:.0} \
             ({:.1} % off; shares {work:?})",
            err * 100.0
        );
    }
    for g in &mut gpus {
        stop_flood(g);
    }
    // The flood was really drawn: the last fill before the window's end is on screen.
    for g in &gpus {
        let px = g.gpu.pixel(0, 0).unwrap();
        assert_eq!(px & 0x00f0_0000, 0x0010_0000, "{}: pixel {px:#x}", g.uuid);
    }
}

#[test]
fn test_gpu_parent_idle_instance_fence_runs_after_one_command_per_flooder() {
    let parent = parent();
    let mut flooders = vec![
        instance(&parent, "f1", "gpu-4m"),
        instance(&parent, "f2", "gpu-4m"),
        instance(&parent, "f3", "gpu-16m"),
    ];
    let mut idle = instance(&parent, "idle", "gpu-4m");
    let (ring, n) = flood_ring(32, 32);
    for f in &mut flooders {
        publish(f, &ring);
    }
    wait_for(&flooders, "every flooder starts", |s| {
        s.iter().all(|s| s.commands > 0)
    });
    // The idle instance submits one FENCE while thousands of fills are queued.
    let fence = Command::encode_bytes(&[Command::Fence { value: 0xfe }]);
    publish(&mut idle, &fence);
    let deadline = Instant::now() + HANG;
    while idle.vmm.read32(BAR, REG_FENCE_VALUE).unwrap() != 0xfe {
        assert!(Instant::now() < deadline, "the FENCE never ran");
    }
    let flooded = stats(&flooders);
    for f in &mut flooders {
        stop_flood(f);
    }
    assert!(
        flooded.iter().all(|s| s.commands < n),
        "a flooder ran dry before the FENCE ran, so it was not under load: {flooded:?}"
    );
    // A lane that wakes at the front of the ready set has its first unit executed by its
    // own fetcher at once (engine.rs, "Who executes"): delay 0. None waits for more than
    // one unit of each other lane.
    assert!(
        flooded
            .iter()
            .all(|s| s.max_wakeup_delay <= flooders.len() as u64),
        "wake-up delays {flooded:?}"
    );
    let s = idle.gpu.engine_stats();
    assert_eq!((s.commands, s.wakeups), (1, 1), "{s:?}");
    assert!(
        s.max_wakeup_delay <= flooders.len() as u64,
        "the FENCE waited for {} commands of the flooders (at most one each expected)",
        s.max_wakeup_delay
    );
}

#[test]
fn test_gpu_parent_stuck_instance_silent_fdless_fetch_does_not_stall_others() {
    let parent = parent();
    let mut others = vec![
        instance(&parent, "a", "gpu-4m"),
        instance(&parent, "b", "gpu-16m"),
    ];
    // The stuck instance: its ring is fd-less memory, and its client never answers. Its
    // server waits for the client far longer than the rounds below take.
    let served = TestServer::builder(create(&parent, "stuck", "gpu-4m"))
        .configure(|c| c.remote_dma_timeout = Duration::from_secs(120))
        .start()
        .unwrap();
    let (c, _) = RawClient::negotiated(served.path(), umdev::testing::DEFAULT_CAPS);
    let mut stuck = Vmm::from_client(c).with_fdless(FdlessMemory::new(RING_GPA, 4096));
    let fences = Command::encode_bytes(&[Command::Fence { value: 7 }]);
    stuck.mem_mut()[..fences.len()].copy_from_slice(&fences);
    stuck.dma_map_fdless(RING_GPA, 4096).unwrap();
    stuck.enable_device().unwrap();
    for (off, v) in [
        (REG_RING_BASE_LO, RING_GPA as u32),
        (REG_RING_BASE_HI, (RING_GPA >> 32) as u32),
        (REG_RING_SIZE, 4096),
        (REG_RING_CTRL, 1),
    ] {
        stuck.write32(BAR, off, v).unwrap();
    }
    stuck
        .write32_posted(BAR, REG_RING_TAIL, fences.len() as u32)
        .unwrap();
    // The stuck instance's fetch is on the wire, and stays unanswered.
    let DmaRequest { command, iova, .. } = stuck.hold_request().unwrap();
    assert_eq!((command, iova), (Wire::DmaRead as u16, RING_GPA));

    // Meanwhile the others are served, round after round.
    for round in 1..=20u32 {
        for o in &mut others {
            let cmds = [
                Command::FillRect {
                    x: 0,
                    y: 0,
                    w: W,
                    h: H,
                    color: round,
                },
                Command::Fence { value: round },
            ];
            let bytes = Command::encode_bytes(&cmds);
            let at = ((round - 1) as usize * bytes.len()) as u64;
            o.vmm.ram().write(RING_GPA + at, &bytes).unwrap();
            o.vmm
                .write32(BAR, REG_RING_TAIL, (at as usize + bytes.len()) as u32)
                .unwrap();
        }
        for o in &mut others {
            let deadline = Instant::now() + Duration::from_secs(20);
            while o.vmm.read32(BAR, REG_FENCE_VALUE).unwrap() != round {
                assert!(
                    Instant::now() < deadline,
                    "round {round}: instance {} starved while another instance's fetch \
                     waits for its client",
                    o.uuid
                );
            }
            assert_eq!(o.gpu.pixel(W - 1, H - 1), Some(round), "{}", o.uuid);
        }
    }
    // The stuck instance executed nothing, and its fetch is still waiting.
    let stuck_gpu = parent.handle("stuck").unwrap();
    assert_eq!(stuck_gpu.engine_stats().commands, 0);
    assert_eq!(stuck_gpu.pins_held(), 0);
    // Its reset does not wait for the client either (the server cancels the fetch).
    let start = Instant::now();
    let m = stuck.call(Wire::DeviceReset, &[], &[]).unwrap();
    assert!(
        !m.header.is_error(),
        "DEVICE_RESET errno {}",
        m.header.error
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "reset waited for the client"
    );
    assert_eq!(stuck.read32(BAR, REG_FENCE_VALUE).unwrap(), 0);
}

/// An instance's long ring: FENCEs (values never 0) and full-screen fills.
fn long_ring() -> Vec<u8> {
    let mut cmds = Vec::new();
    let mut bytes = 0;
    for k in 1u32.. {
        let (cmd, len) = if k % 8 == 0 {
            let fill = Command::FillRect {
                x: 0,
                y: 0,
                w: W,
                h: H,
                color: 0x00ab_0000 | k,
            };
            (fill, 24)
        } else {
            (
                Command::Fence {
                    value: 0x1_0000 | k,
                },
                8,
            )
        };
        if bytes + len > 64 * 1024 - 4 {
            break;
        }
        bytes += len;
        cmds.push(cmd);
    }
    Command::encode_bytes(&cmds)
}

#[test]
fn test_gpu_parent_reset_quiesces_one_instance_while_others_flood() {
    const ROUNDS: u32 = 100;
    let parent = parent();
    let mut flooder = instance(&parent, "flooder", "gpu-16m");
    let (flood, _) = flood_ring(64, 64);
    let mut target = instance(&parent, "target", "gpu-4m");
    let ring = long_ring();
    target.vmm.ram().write(RING_GPA, &ring).unwrap();
    let (mut mid_ring, mut contended) = (0, 0);
    for round in 1..=ROUNDS {
        if round > 1 {
            init(&mut target.vmm);
        }
        // Keep the other instance flooding the engine (again, if it ran dry).
        if flooder.vmm.read32(BAR, REG_STATUS).unwrap() & STATUS_BUSY == 0 {
            stop_flood(&mut flooder);
            flooder.vmm.write32(BAR, REG_RING_CTRL, 1).unwrap();
            publish(&mut flooder, &flood);
        }
        target
            .vmm
            .write32(BAR, REG_RING_TAIL, ring.len() as u32)
            .unwrap();
        let deadline = Instant::now() + HANG;
        loop {
            let head = target.vmm.read32(BAR, REG_RING_HEAD).unwrap() as usize;
            if head != 0 {
                if head < ring.len() {
                    mid_ring += 1;
                }
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: the ring never started"
            );
        }
        let m = target.vmm.call(Wire::DeviceReset, &[], &[]).unwrap();
        assert!(
            !m.header.is_error(),
            "DEVICE_RESET errno {}",
            m.header.error
        );
        if flooder.vmm.read32(BAR, REG_STATUS).unwrap() & STATUS_BUSY != 0 {
            contended += 1;
        }
        // Nothing of the ring queued before the reset shows after its reply.
        let mut screen = vec![0u8; (W * H * 4) as usize];
        assert!(target.gpu.framebuffer().read(0, &mut screen));
        let executed = target.gpu.engine_stats().commands;
        for _ in 0..3 {
            for (reg, name) in [
                (REG_FENCE_VALUE, "FENCE_VALUE"),
                (REG_IRQ_STATUS, "IRQ_STATUS"),
                (REG_RING_HEAD, "RING_HEAD"),
            ] {
                let v = target.vmm.read32(BAR, reg).unwrap();
                assert_eq!(v, 0, "round {round}: {name} = {v:#x} after the reset reply");
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut after = vec![0u8; screen.len()];
        assert!(target.gpu.framebuffer().read(0, &mut after));
        assert!(
            after == screen,
            "round {round}: the framebuffer changed after the reset"
        );
        assert_eq!(
            target.gpu.engine_stats().commands,
            executed,
            "round {round}: the engine executed the instance's old work after its reset"
        );
    }
    assert!(
        mid_ring >= ROUNDS / 2,
        "only {mid_ring} of {ROUNDS} resets hit the ring mid-way"
    );
    stop_flood(&mut flooder);
    assert!(
        contended >= ROUNDS / 2,
        "the other instance flooded the engine during only {contended} of {ROUNDS} resets"
    );
}

#[test]
fn test_gpu_parent_instance_framebuffer_is_own_memory_of_type_size() {
    let parent = parent();
    let mut a = instance(&parent, "a", "gpu-4m");
    let mut b = instance(&parent, "b", "gpu-16m");
    let ra = a.vmm.region_info(2).unwrap();
    let rb = b.vmm.region_info(2).unwrap();
    assert_eq!((ra.size, rb.size), (4 << 20, 16 << 20));
    // The fd a client gets holds its framebuffer and nothing else: a client can mmap any
    // offset of an fd it has, so a slice of a shared pool would expose the other VMs'.
    for (info, size) in [(ra, 4u64 << 20), (rb, 16 << 20)] {
        assert_eq!(info.offset, 0);
        let file = std::fs::File::from(info.fd.expect("BAR2 is mmappable"));
        assert_eq!(file.metadata().unwrap().len(), size);
    }
    assert_eq!(a.vmm.read32(BAR, REG_FB_SIZE).unwrap(), 4 << 20);
    // Each client maps its own framebuffer; what one instance draws the other does not
    // see, through the device or through the mapping.
    let map_a = a.vmm.map_region(2).unwrap();
    let map_b = b.vmm.map_region(2).unwrap();
    let fill = |color| {
        Command::encode_bytes(&[
            Command::FillRect {
                x: 0,
                y: 0,
                w: W,
                h: H,
                color,
            },
            Command::Fence { value: color },
        ])
    };
    publish(&mut a, &fill(0xaa));
    let deadline = Instant::now() + HANG;
    while a.vmm.read32(BAR, REG_FENCE_VALUE).unwrap() != 0xaa {
        assert!(Instant::now() < deadline, "a's fill never ran");
    }
    let mut px = [0u8; 4];
    map_a.read(0, &mut px).unwrap();
    assert_eq!(u32::from_le_bytes(px), 0xaa);
    map_b.read(0, &mut px).unwrap();
    assert_eq!(
        u32::from_le_bytes(px),
        0,
        "b's framebuffer shows a's drawing"
    );
    assert_eq!(b.gpu.pixel(0, 0), Some(0));
    // Pool accounting follows the devices: 20 of 64 MiB, then 16 once a is gone.
    assert_eq!(parent.pool_used_mib(), 20);
    drop(map_a);
    drop(a);
    assert_eq!(parent.pool_used_mib(), 16);
    assert!(parent.handle("a").is_none());
    let infos = parent.instances();
    assert_eq!(infos.len(), 1);
    assert_eq!((infos[0].uuid.as_str(), infos[0].weight), ("b", 4));
}

/// The nice value of thread `tid` of this process (field 19 of its `stat`).
fn thread_nice(tid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
    // The command name is in parentheses and may hold anything: fields follow the last ')'.
    let after = &stat[stat.rfind(')').unwrap() + 1..];
    // Field 3 (state) is the first after it; nice is field 19.
    after
        .split_whitespace()
        .nth(19 - 3)
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn test_gpu_parent_engine_thread_keeps_process_nice_by_default_low_priority_when_configured() {
    // SAFETY: gettid has no arguments and cannot fail.
    let me = unsafe { libc::gettid() };
    let inherited = thread_nice(me);
    let main = thread_nice(std::process::id() as i32);
    for (engine_nice, want) in [
        (
            Some(umdev_devices::gpu::LOW_PRIORITY_ENGINE_NICE),
            19.max(inherited),
        ),
        (None, inherited),
        (GpuParentConfig::default().engine_nice, inherited),
    ] {
        let parent = GpuParent::new(GpuParentConfig {
            engine_nice,
            ..GpuParentConfig::default()
        })
        .unwrap();
        assert_eq!(
            parent.engine().thread_id(),
            None,
            "no engine before an attach"
        );
        let mut i = instance(&parent, "a", "gpu-4m");
        let tid = parent
            .engine()
            .thread_id()
            .expect("the attach started the engine");
        assert_ne!(tid, me);
        // Set before the first attach returned: no wait, no race.
        assert_eq!(thread_nice(tid), want, "engine_nice {engine_nice:?}");
        // The engine alone: the caller and the process's main thread keep theirs.
        assert_eq!(
            (thread_nice(me), thread_nice(std::process::id() as i32)),
            (inherited, main)
        );
        // And it executes.
        publish(
            &mut i,
            &Command::encode_bytes(&[Command::Fence { value: 7 }]),
        );
        let deadline = Instant::now() + HANG;
        while i.vmm.read32(BAR, REG_FENCE_VALUE).unwrap() != 7 {
            assert!(Instant::now() < deadline, "the fence never ran");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    assert!(matches!(
        GpuParent::new(GpuParentConfig {
            engine_nice: Some(20),
            ..GpuParentConfig::default()
        }),
        Err(umdev_devices::gpu::parent::GpuParentError::BadEngineNice(
            20
        ))
    ));
}

/// Publish one more FENCE of `value` on an instance whose ring holds only FENCEs (8 bytes
/// each, `value` 1, 2, … in order) and wait up to `within` for it to run.
fn fence_ran(i: &mut Instance, value: u32, within: Duration) -> bool {
    let at = 8 * (value - 1);
    let bytes = Command::encode_bytes(&[Command::Fence { value }]);
    i.vmm.ram().write(RING_GPA + u64::from(at), &bytes).unwrap();
    i.vmm.write32(BAR, REG_RING_TAIL, at + 8).unwrap();
    let deadline = Instant::now() + within;
    while i.vmm.read32(BAR, REG_FENCE_VALUE).unwrap() != value {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    true
}

/// A parent with the engine thread held and two `gpu-4m` instances: one flooding with 1×1
/// fills (the first of them executed, on its fetcher; the rest waiting for the engine) and
/// an idle one; and the flood's command count.
fn held_engine_beside_a_flood() -> (GpuParent, EngineThreadHold, Instance, Instance, u64) {
    let parent = parent();
    let mut flooder = instance(&parent, "f", "gpu-4m");
    let idle = instance(&parent, "idle", "gpu-4m");
    let hold = parent.engine().hold_thread();
    let (ring, n) = flood_ring(1, 1);
    publish(&mut flooder, &ring);
    wait_for(
        std::slice::from_ref(&flooder),
        "the flood's first unit",
        |s| s[0].commands == 1,
    );
    (parent, hold, flooder, idle, n)
}

/// The engine thread gets no CPU (held: the stand-in for a busy host, where it runs flat
/// out and waits ms for a CPU whenever it loses one). An idle instance's FENCEs still run,
/// each on its own fetcher right after the doorbell: when a flooder's unit is ahead of it
/// in the scheduler's order, the fetcher runs that unit first, so the order and the shares
/// stay the scheduler's. Before, such a FENCE waited for the engine thread.
#[test]
fn test_gpu_parent_fence_behind_a_flooder_runs_on_its_fetcher_while_the_engine_thread_waits() {
    // 1×1 fills (cost 65) against FENCEs (cost 64), equal weights: after two FENCEs the
    // idle instance's pass is ahead of the flooder's, and stays within a unit of it.
    let (_parent, hold, mut flooder, mut idle, n) = held_engine_beside_a_flood();
    const FENCES: u32 = 20;
    for value in 1..=FENCES {
        assert!(
            fence_ran(&mut idle, value, Duration::from_secs(10)),
            "FENCE {value} did not run while the engine thread was held: {:?}",
            idle.gpu.engine_stats()
        );
    }
    let (f, i) = (flooder.gpu.engine_stats(), idle.gpu.engine_stats());
    drop(hold);
    stop_flood(&mut flooder);
    assert_eq!(
        (i.commands, i.fetcher_units),
        (u64::from(FENCES), u64::from(FENCES))
    );
    assert!(i.helped_units > 0, "no unit was ahead of a FENCE: {i:?}");
    // With the engine thread held, every flood unit after the first ran on the idle
    // instance's fetcher.
    assert_eq!(f.commands, 1 + i.helped_units, "{f:?} {i:?}");
    assert!(f.commands < n);
    // Equal weights: work within one unit of each other (65 + 64), as the engine keeps it.
    assert!(
        f.work.abs_diff(i.work) <= 65 + 64,
        "flooder {} work units, idle instance {}",
        f.work,
        i.work
    );
}

/// A fetcher runs at most `HELP_LIMIT` units ahead of its own; the rest waits for the engine
/// thread. The idle instance's last unit was a whole-screen fill, so its FENCE is a
/// thousand 1×1 fills behind the flooder.
#[test]
fn test_gpu_parent_fetcher_helps_at_most_help_limit_units_then_leaves_them_to_the_engine() {
    use umdev_devices::gpu::engine::HELP_LIMIT;
    let (_parent, hold, mut flooder, mut idle, _) = held_engine_beside_a_flood();
    let fill = Command::encode_bytes(&[
        Command::FillRect {
            x: 0,
            y: 0,
            w: W,
            h: H,
            color: 0x00ab_cdef,
        },
        Command::Fence { value: 1 },
    ]);
    // The fill first (at the front: it runs on the fetcher), then the FENCE after it.
    idle.vmm.ram().write(RING_GPA, &fill).unwrap();
    idle.vmm.write32(BAR, REG_RING_TAIL, 24).unwrap();
    wait_for(std::slice::from_ref(&idle), "the fill", |s| {
        s[0].commands == 1
    });
    idle.vmm
        .write32(BAR, REG_RING_TAIL, fill.len() as u32)
        .unwrap();
    wait_for(std::slice::from_ref(&idle), "the help", |s| {
        s[0].helped_units == HELP_LIMIT
    });
    std::thread::sleep(Duration::from_millis(50));
    let (f, i) = (flooder.gpu.engine_stats(), idle.gpu.engine_stats());
    assert_eq!(i.helped_units, HELP_LIMIT, "helped past the limit: {i:?}");
    assert_eq!(f.commands, 1 + HELP_LIMIT, "{f:?}");
    assert_eq!(
        i.commands, 1,
        "the FENCE ran although it is far behind: {i:?}"
    );
    assert_eq!(idle.vmm.read32(BAR, REG_FENCE_VALUE).unwrap(), 0);
    // The engine thread serves the rest in the scheduler's order, the FENCE among it.
    drop(hold);
    wait_for(
        std::slice::from_ref(&idle),
        "the FENCE on the engine thread",
        |s| s[0].commands == 2,
    );
    stop_flood(&mut flooder);
    let i = idle.gpu.engine_stats();
    assert_eq!(idle.vmm.read32(BAR, REG_FENCE_VALUE).unwrap(), 1);
    assert_eq!((i.fetcher_units, i.helped_units), (1, HELP_LIMIT), "{i:?}");
    assert!(flooder.gpu.engine_stats().commands > 1 + HELP_LIMIT);
}
