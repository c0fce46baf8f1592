//! The virtio-gpu parent through a [`Registry`]: types by resource memory and resolution, a
//! pool shared by the instances (refusal when it is used up, shares back at removal), and an
//! instance that serves a virtio-gpu a guest-side virtio driver probes and whose resource
//! budget is its type's share.
use std::sync::Arc;
use std::time::Duration;

use umdev::instance::{InstanceError, Params, Registry, RegistryConfig};
use umdev::testing::{DeviceAccess, VirtioDriver, Vmm};
use umdev::virtio::VIRTIO_F_VERSION_1;
use umdev_devices::virtio_gpu::protocol::{cmd, resp};
use umdev_devices::virtio_gpu::{VirtioGpuParent, VirtioGpuParentConfig, VirtioGpuType};

const RAM: u64 = 0x10_0000;
const CTRLQ: u64 = RAM;
const REQ: u64 = RAM + 0x8000;
const RESP: u64 = RAM + 0xa000;

fn parent(pool_mib: u64) -> Arc<VirtioGpuParent> {
    let config = VirtioGpuParentConfig {
        pool_mib,
        types: vec![
            "vgpu-small:4:640x480".parse().unwrap(),
            "vgpu-1080p:128:1920x1080".parse().unwrap(),
        ],
    };
    Arc::new(VirtioGpuParent::new(config).unwrap())
}

#[test]
fn test_virtio_gpu_parent_pool_refuses_beyond_and_frees_on_remove() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::new(RegistryConfig::new(dir.path())).unwrap();
    let gpus = parent(136);
    registry.add_parent(gpus.clone()).unwrap();
    let none = Params::new();
    let big = registry.create("vgpu-1080p", None, &none).unwrap();
    let small = registry
        .create("virtio-gpu/vgpu-small", None, &none)
        .unwrap();
    assert_eq!(gpus.pool_used_mib(), 132);
    let avail: Vec<(String, u64)> = registry
        .types()
        .iter()
        .map(|t| (t.instance_type.name.clone(), t.available_instances))
        .collect();
    assert_eq!(
        avail,
        [("vgpu-small".to_owned(), 1), ("vgpu-1080p".to_owned(), 0)]
    );
    match registry.create("vgpu-1080p", None, &none) {
        Err(InstanceError::Exhausted {
            resource,
            needed,
            left,
            ..
        }) => assert_eq!(
            (resource.as_str(), needed, left),
            ("resource-memory", 128, 4)
        ),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("a 128 MiB instance fit in 4 MiB"),
    }
    registry.remove(&big.uuid, false).unwrap();
    assert_eq!(
        gpus.pool_used_mib(),
        4,
        "the removed instance's share is back"
    );
    assert!(gpus.handle(&big.uuid).is_none());
    assert!(gpus.handle(&small.uuid).is_some());
    registry.create("vgpu-1080p", None, &none).unwrap();
    let mut bad = Params::new();
    bad.insert("width".into(), "800".into());
    assert!(matches!(
        registry.create("vgpu-small", None, &bad),
        Err(InstanceError::BadParam { .. })
    ));
}

#[test]
fn test_virtio_gpu_parent_types_parse_and_bad_types_are_refused() {
    let t: VirtioGpuType = "vgpu-1080p:128:1920x1080".parse().unwrap();
    assert_eq!(t, VirtioGpuType::new("vgpu-1080p", 128, 1920, 1080));
    for bad in [
        "vgpu",
        "vgpu:128",
        "vgpu:x:1x1",
        "vgpu:1:1920",
        "vgpu:1:ax1",
        "a:1:1x1:2",
    ] {
        assert!(bad.parse::<VirtioGpuType>().is_err(), "{bad}");
    }
    let with = |pool_mib, types: Vec<VirtioGpuType>| {
        VirtioGpuParent::new(VirtioGpuParentConfig { pool_mib, types }).map(|_| ())
    };
    let ok = VirtioGpuType::new("t", 8, 1280, 800);
    assert!(with(8, vec![ok.clone()]).is_ok());
    assert!(with(0, vec![ok.clone()]).is_err(), "empty pool");
    assert!(with(8, vec![]).is_err(), "no types");
    assert!(with(8, vec![ok.clone(), ok]).is_err(), "duplicate");
    for bad in [
        VirtioGpuType::new("", 8, 64, 64),
        VirtioGpuType::new("t", 0, 64, 64),
        VirtioGpuType::new("t", 16, 64, 64), // larger than the pool
        VirtioGpuType::new("t", 8, 0, 64),
        VirtioGpuType::new("t", 8, 64, 100_000),
        VirtioGpuType::new("t", 1, 1920, 1080), // one frame does not fit
    ] {
        assert!(with(8, vec![bad.clone()]).is_err(), "{bad:?}");
    }
}

#[test]
fn test_virtio_gpu_parent_instance_probes_and_budget_is_its_type_share() {
    let dir = tempfile::tempdir().unwrap();
    let registry = Registry::new(RegistryConfig::new(dir.path())).unwrap();
    let gpus = parent(136);
    registry.add_parent(gpus.clone()).unwrap();
    let inst = registry.create("vgpu-small", None, &Params::new()).unwrap();
    assert_eq!(gpus.handle(&inst.uuid).unwrap().mode(0), Some((640, 480)));

    let mut vmm = Vmm::connect(&inst.socket)
        .unwrap()
        .with_ram(RAM, 1 << 20)
        .unwrap();
    vmm.enable_device().unwrap();
    let mut drv = VirtioDriver::probe(&mut vmm).unwrap();
    assert!(drv.negotiate(&mut vmm, VIRTIO_F_VERSION_1).unwrap());
    drv.setup_queue(&mut vmm, 0, 256, CTRLQ, 0xffff).unwrap();
    drv.driver_ok(&mut vmm).unwrap();

    let mut create = |id: u32, w: u32, h: u32| {
        let mut req = Vec::new();
        for v in [cmd::RESOURCE_CREATE_2D, 0, 0, 0, 0, 0, id, 2, w, h] {
            req.extend_from_slice(&v.to_le_bytes());
        }
        vmm.ram().write(REQ, &req).unwrap();
        let bufs = [(REQ, req.len() as u32, false), (RESP, 24, true)];
        let head = drv.add_chain(&mut vmm, 0, &bufs).unwrap();
        drv.publish(&mut vmm, 0, head).unwrap();
        drv.kick(&mut vmm, 0).unwrap();
        drv.wait_used(&mut vmm, 0, Duration::from_secs(5))
            .unwrap()
            .expect("no response");
        let r = vmm.ram().read_vec(RESP, 4).unwrap();
        u32::from_le_bytes(r.try_into().unwrap())
    };
    // 4 MiB of the type: a 640×480 frame (1.2 MiB) fits three times, a fourth does not.
    assert_eq!(create(1, 640, 480), resp::OK_NODATA);
    assert_eq!(create(2, 640, 480), resp::OK_NODATA);
    assert_eq!(create(3, 640, 480), resp::OK_NODATA);
    assert_eq!(create(4, 640, 480), resp::ERR_OUT_OF_MEMORY);
    let gpu = gpus.handle(&inst.uuid).unwrap();
    assert_eq!(gpu.memory(), (3 * 640 * 480 * 4, 4 << 20));
}

#[test]
fn test_virtio_gpu_parent_instance_migrates_between_registries_of_its_type_only() {
    umdev::testing::init_logs();
    let dir = tempfile::tempdir().unwrap();
    let src = Registry::new(RegistryConfig::new(dir.path().join("src"))).unwrap();
    let dst = Registry::new(RegistryConfig::new(dir.path().join("dst"))).unwrap();
    let (src_gpus, dst_gpus) = (parent(136), parent(136));
    src.add_parent(src_gpus.clone()).unwrap();
    dst.add_parent(dst_gpus.clone()).unwrap();
    let none = Params::new();
    let info = src.create("virtio-gpu/vgpu-small", None, &none).unwrap();
    let stream = src
        .save_state(&info.uuid)
        .expect("virtio-gpu instances migrate");
    // Another resolution (and budget): refused, nothing taken from the pool.
    let e = dst
        .create_with_state("virtio-gpu/vgpu-1080p", &info.uuid, &none, &stream)
        .unwrap_err();
    assert!(matches!(e, InstanceError::Migration { .. }), "{e}");
    assert_eq!(dst_gpus.pool_used_mib(), 0);
    let moved = dst
        .create_with_state("virtio-gpu/vgpu-small", &info.uuid, &none, &stream)
        .unwrap();
    assert_eq!(dst_gpus.pool_used_mib(), 4);
    let handle = dst_gpus.handle(&moved.uuid).unwrap();
    assert_eq!(handle.mode(0), Some((640, 480)));
    assert_eq!(handle.memory(), (0, 4 << 20));
    src.remove(&info.uuid, false).unwrap();
    assert_eq!(src_gpus.pool_used_mib(), 0);
}
