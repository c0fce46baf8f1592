//! NVMe instances of one [`NvmeParent`]: built with `Parent::create` (and through a
//! `Registry`) and served on their own sockets; an image per instance with its type's
//! capacity and I/O queue count, the directory's budget, and the `image=` parameter with
//! its checks.

mod nvme_support;

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use nvme_support::*;
use umdev::device::Device;
use umdev::dma::DmaConfig;
use umdev::instance::{CreateRequest, InstanceError, Params, Parent, Registry, RegistryConfig};
use umdev::testing::{DeviceAccess, Vmm};
use umdev_devices::nvme::regs;
use umdev_devices::nvme::spec::Status;
use umdev_devices::nvme::{Nvme, NvmeParent, NvmeParentConfig, NvmeType};

fn params(kv: &[(&str, &str)]) -> Params {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A parent on `dir` with a `budget_mib` budget and types `nvme-4m` (4 MiB, 2 I/O queue
/// pairs) and `nvme-8m` (8 MiB, 4).
fn parent_in(dir: &Path, budget_mib: u64) -> NvmeParent {
    NvmeParent::new(NvmeParentConfig {
        dir: dir.to_owned(),
        budget_mib,
        types: vec![
            NvmeType::new("nvme-4m", 4, 2),
            NvmeType::new("nvme-8m", 8, 4),
        ],
        shadow_poll: umdev_devices::nvme::SHADOW_POLL,
    })
    .unwrap()
}

fn create_nvme(parent: &NvmeParent, uuid: &str, ty: &str, params: &Params) -> Nvme {
    parent
        .create_nvme(CreateRequest {
            uuid,
            type_name: ty,
            params,
        })
        .unwrap()
}

fn create(
    parent: &NvmeParent,
    uuid: &str,
    type_name: &str,
    params: &Params,
) -> Result<Box<dyn Device>, InstanceError> {
    parent.create(CreateRequest {
        uuid,
        type_name,
        params,
    })
}

fn bad_param(r: Result<Box<dyn Device>, InstanceError>) -> String {
    match r {
        Err(InstanceError::BadParam { why, .. }) => why,
        Err(e) => panic!("expected BadParam, got {e:?}"),
        Ok(_) => panic!("expected BadParam, got an instance"),
    }
}

/// Serve `nvme` (its image in `parent`'s directory) to a test guest.
fn guest(nvme: Nvme, parent: &NvmeParent, image: &str) -> Guest {
    let keep = tempfile::tempdir().unwrap();
    Guest::serve(
        nvme,
        keep,
        parent.image_path(image),
        false,
        DmaConfig::default(),
    )
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

#[test]
fn test_nvme_parent_instance_gets_own_image_capacity_and_queue_count() {
    let dir = tempfile::tempdir().unwrap();
    let parent = parent_in(dir.path(), 64);
    let none = Params::new();
    let a = create_nvme(&parent, "aaaa", "nvme-4m", &none);
    let b = create_nvme(&parent, "bbbb", "nvme-8m", &none);
    assert_eq!(a.blocks(), (4 << 20) / 512);
    assert_eq!(b.blocks(), (8 << 20) / 512);
    assert_eq!(file_len(&parent.image_path("aaaa.img")), 4 << 20);
    assert_eq!(file_len(&parent.image_path("bbbb.img")), 8 << 20);
    let mut ga = guest(a, &parent, "aaaa.img");
    let mut gb = guest(b, &parent, "bbbb.img");
    ga.enable();
    gb.enable();
    // Number of Queues grants the type's count.
    let granted = |g: &mut Guest| {
        let c = g.set_queues(64);
        assert!(c.status.is_success());
        (c.result & 0xffff) + 1
    };
    assert_eq!(granted(&mut ga), 2);
    assert_eq!(granted(&mut gb), 4);
    // The serial number is the UUID's.
    assert_eq!(ga.identify(1, 0, DATA), Status::SUCCESS);
    assert_eq!(&ga.mem_read(DATA + 4, 4), b"AAAA");
    // Each instance writes its own image.
    ga.create_pair(1, 16);
    gb.create_pair(1, 16);
    assert_eq!(ga.write_blocks(1, 8, DATA, &[0xa1; 512]), Status::SUCCESS);
    assert_eq!(gb.write_blocks(1, 8, DATA, &[0xb2; 512]), Status::SUCCESS);
    let mut byte = [0u8; 1];
    let img = std::fs::File::open(parent.image_path("aaaa.img")).unwrap();
    img.read_exact_at(&mut byte, 8 * 512).unwrap();
    assert_eq!(byte[0], 0xa1);
    let img = std::fs::File::open(parent.image_path("bbbb.img")).unwrap();
    img.read_exact_at(&mut byte, 8 * 512).unwrap();
    assert_eq!(byte[0], 0xb2);
    let infos = parent.instances();
    assert_eq!(infos.len(), 2);
    assert_eq!(
        (infos[0].image.as_str(), infos[0].capacity_mib),
        ("aaaa.img", 4)
    );
    assert_eq!(parent.budget_used_mib(), 12);
    drop(ga);
    assert_eq!(
        parent.budget_used_mib(),
        8,
        "a's share back with its controller"
    );

    // The same UUID again (a defined instance started after a restart): same image.
    let again = create_nvme(&parent, "aaaa", "nvme-4m", &none);
    let mut g = guest(again, &parent, "aaaa.img");
    g.bring_up(1, 16);
    let (s, data) = g.read_blocks(1, 8, DATA, 512);
    assert_eq!(s, Status::SUCCESS);
    assert_eq!(data, vec![0xa1; 512]);
}

#[test]
fn test_nvme_parent_budget_exhausted_names_resource_and_returns_on_drop() {
    let dir = tempfile::tempdir().unwrap();
    let parent = parent_in(dir.path(), 18);
    let none = Params::new();
    let big = create(&parent, "big", "nvme-8m", &none).unwrap();
    let _s1 = create(&parent, "s1", "nvme-4m", &none).unwrap();
    let _s2 = create(&parent, "s2", "nvme-4m", &none).unwrap();
    assert_eq!(parent.budget_used_mib(), 16);
    match create(&parent, "s3", "nvme-4m", &none) {
        Err(InstanceError::Exhausted {
            resource,
            needed,
            left,
            ..
        }) => assert_eq!((resource.as_str(), needed, left), ("storage", 4, 2)),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("a 4 MiB instance fit in 2 MiB"),
    }
    assert!(
        !parent.image_path("s3.img").exists(),
        "a refused instance creates no image"
    );
    assert!(matches!(
        create(&parent, "s1", "nvme-4m", &none),
        Err(InstanceError::UuidInUse(_))
    ));
    assert!(matches!(
        create(&parent, "x", "nvme-2g", &none),
        Err(InstanceError::UnknownType(_))
    ));
    drop(big);
    assert_eq!(parent.budget_used_mib(), 8);
    create(&parent, "s3", "nvme-4m", &none).unwrap();
}

#[test]
fn test_nvme_parent_image_param_checked_inside_dir_unused_regular() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let parent = parent_in(&images, 64);
    std::fs::write(images.join("disk.img"), vec![7u8; 4096]).unwrap();
    std::fs::write(dir.path().join("outside.img"), vec![9u8; 4096]).unwrap();
    std::os::unix::fs::symlink(dir.path().join("outside.img"), images.join("link.img")).unwrap();
    std::fs::create_dir(images.join("sub.img")).unwrap();
    let fifo = std::ffi::CString::new(
        images
            .join("fifo.img")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .unwrap();
    // SAFETY: mkfifo with a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);

    for (name, why_has) in [
        ("../outside.img", "'/'"),
        ("..", "'.'"),
        (".hidden", "'.'"),
        ("/etc/passwd", "'/'"),
        ("", "empty"),
        ("missing.img", "no image"),
        ("link.img", "symbolic link"),
        ("sub.img", "regular file"),
        ("fifo.img", "regular file"),
    ] {
        let why = bad_param(create(&parent, "u", "nvme-4m", &params(&[("image", name)])));
        assert!(why.contains(why_has), "image={name}: {why}");
    }
    let why = bad_param(create(&parent, "u", "nvme-4m", &params(&[("queues", "8")])));
    assert!(why.contains("unknown parameter"), "{why}");
    assert!(
        parent.instances().is_empty(),
        "refused creates take nothing"
    );

    // An existing image is used (grown to the type's capacity, its data kept) by one
    // instance at a time.
    let first = create(&parent, "u1", "nvme-4m", &params(&[("image", "disk.img")])).unwrap();
    assert_eq!(file_len(&images.join("disk.img")), 4 << 20);
    let mut byte = [0u8; 1];
    let img = std::fs::File::open(images.join("disk.img")).unwrap();
    img.read_exact_at(&mut byte, 4095).unwrap();
    assert_eq!(byte[0], 7);
    let why = bad_param(create(
        &parent,
        "u2",
        "nvme-4m",
        &params(&[("image", "disk.img")]),
    ));
    assert!(why.contains("used by instance u1"), "{why}");
    let _own = create(&parent, "u3", "nvme-4m", &Params::new()).unwrap();
    let why = bad_param(create(
        &parent,
        "u4",
        "nvme-4m",
        &params(&[("image", "u3.img")]),
    ));
    assert!(why.contains("used by instance u3"), "{why}");
    drop(first);
    create(&parent, "u2", "nvme-4m", &params(&[("image", "disk.img")])).unwrap();
    // The link's target was never touched.
    assert_eq!(file_len(&dir.path().join("outside.img")), 4096);
}

#[test]
fn test_nvme_parent_registry_create_serves_controller_remove_gives_budget_back() {
    umdev::testing::init_logs();
    let dir = tempfile::tempdir().unwrap();
    let parent = parent_in(&dir.path().join("images"), 12);
    let registry = Registry::new(RegistryConfig::new(dir.path().join("sockets"))).unwrap();
    registry.add_parent(Arc::new(parent.clone())).unwrap();
    let available = |ty: &str| {
        registry
            .types()
            .into_iter()
            .find(|t| t.parent == "nvme" && t.instance_type.name == ty)
            .unwrap()
            .available_instances
    };
    assert_eq!((available("nvme-4m"), available("nvme-8m")), (3, 1));

    let info = registry
        .create("nvme/nvme-8m", None, &Params::new())
        .unwrap();
    assert_eq!(
        (info.parent.as_str(), info.type_name.as_str()),
        ("nvme", "nvme-8m")
    );
    assert_eq!((available("nvme-4m"), available("nvme-8m")), (1, 0));
    let mut vmm = Vmm::connect(&info.socket).unwrap();
    let class = vmm.read32(7, 0x08).unwrap() >> 8;
    assert_eq!(class, 0x01_08_02, "an NVMe controller");
    assert_eq!(vmm.read32(0, regs::VS).unwrap(), 0x0001_0400);
    let cap = vmm.read64(0, regs::CAP_LO).unwrap();
    assert_eq!((cap >> 37) & 1, 1, "CSS NVM");
    assert!(matches!(
        registry.create("nvme-8m", None, &Params::new()),
        Err(InstanceError::Exhausted { .. })
    ));
    drop(vmm);

    registry.remove(&info.uuid, false).unwrap();
    assert_eq!(parent.budget_used_mib(), 0);
    assert_eq!((available("nvme-4m"), available("nvme-8m")), (3, 1));
    assert!(
        parent.image_path(&format!("{}.img", info.uuid)).exists(),
        "removing keeps the image"
    );
    assert!(!info.socket.exists());
}

#[test]
fn test_nvme_parent_instance_migrates_between_registries_on_the_shared_image() {
    umdev::testing::init_logs();
    let dir = tempfile::tempdir().unwrap();
    // Two registries (two daemons), their parents on one image directory (shared storage).
    let images = dir.path().join("images");
    let src_parent = parent_in(&images, 16);
    let dst_parent = parent_in(&images, 16);
    let src = Registry::new(RegistryConfig::new(dir.path().join("src-sockets"))).unwrap();
    let dst = Registry::new(RegistryConfig::new(dir.path().join("dst-sockets"))).unwrap();
    src.add_parent(Arc::new(src_parent.clone())).unwrap();
    dst.add_parent(Arc::new(dst_parent.clone())).unwrap();
    let info = src.create("nvme/nvme-8m", None, &Params::new()).unwrap();
    let image = src_parent.image_path(&format!("{}.img", info.uuid));
    let data = pattern(7, 4096);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&image)
        .unwrap()
        .write_all_at(&data, 8192)
        .unwrap();
    let stream = src.save_state(&info.uuid).expect("nvme instances migrate");

    // A type of another capacity and queue count refuses the state and takes nothing.
    let e = dst
        .create_with_state("nvme/nvme-4m", &info.uuid, &Params::new(), &stream)
        .unwrap_err();
    assert!(matches!(e, InstanceError::Migration { .. }), "{e}");
    assert_eq!(dst_parent.budget_used_mib(), 0);

    let moved = dst
        .create_with_state("nvme/nvme-8m", &info.uuid, &Params::new(), &stream)
        .unwrap();
    assert_eq!(dst_parent.budget_used_mib(), 8);
    assert_eq!(
        dst_parent.image_path(&dst_parent.instances()[0].image),
        image,
        "the destination opened the source's image"
    );
    let mut vmm = Vmm::connect(&moved.socket).unwrap();
    assert_eq!(vmm.read32(0, regs::VS).unwrap(), 0x0001_0400);
    assert_eq!(vmm.read32(0, regs::CSTS).unwrap() & regs::CSTS_RDY, 0);
    drop(vmm);
    src.remove(&info.uuid, false).unwrap();
    assert_eq!(image_bytes(&image, 8192, 4096).unwrap(), data);
    dst.remove(&moved.uuid, false).unwrap();
}
