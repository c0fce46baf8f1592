//! ccw instances of one [`CcwParent`], built with `Parent::create` and served on their own
//! sockets: an image per instance with its type's capacity, the directory's budget, and the
//! `image=` parameter with its checks.

use std::os::unix::fs::FileExt;
use std::path::Path;

use umdev::device::{region_index, Device};
use umdev::instance::{CreateRequest, InstanceError, Params, Parent};
use umdev::testing::{DeviceAccess, TestServer, Vmm};
use umdev_devices::ccw::driver::{regs, CcwWord};
use umdev_devices::ccw::{CcwParent, CcwParentConfig};
use umdev_devices::testing::run_ccw_program;

const RAM_GPA: u64 = 0x10_0000;
const RAM_SIZE: usize = 1 << 20;
/// Where the program's data buffer lives in guest RAM.
const DATA_GPA: u64 = RAM_GPA + 0x1_0000;

fn params(kv: &[(&str, &str)]) -> Params {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn create(
    parent: &CcwParent,
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

/// Serve `dev`, map guest RAM, enable it and MSI.
fn serve(
    dev: Box<dyn Device>,
) -> (
    TestServer<Box<dyn Device>>,
    Vmm,
    vmm_sys_util::eventfd::EventFd,
) {
    let served = TestServer::start(dev).unwrap();
    let mut vmm = served
        .connect()
        .unwrap()
        .with_ram(RAM_GPA, RAM_SIZE)
        .unwrap();
    vmm.enable_device().unwrap();
    let msi = vmm.enable_msi().unwrap();
    (served, vmm, msi)
}

fn capacity_blocks(vmm: &mut Vmm) -> u64 {
    let lo = vmm.read32(region_index::BAR0, regs::CAPACITY_LO).unwrap();
    let hi = vmm.read32(region_index::BAR0, regs::CAPACITY_HI).unwrap();
    u64::from(hi) << 32 | u64::from(lo)
}

/// Write 4 KiB of `byte` at `block` through the device (a channel program).
fn write_block(vmm: &mut Vmm, msi: &vmm_sys_util::eventfd::EventFd, block: u64, byte: u8) {
    let ram = vmm.ram().clone();
    ram.write(DATA_GPA, &[byte; 4096]).unwrap();
    let st = run_ccw_program(vmm, &ram, msi, &[CcwWord::write(4096, DATA_GPA)], block).unwrap();
    assert_eq!(st.fault, 0, "{st:?}");
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().len()
}

#[test]
fn test_ccw_parent_instance_gets_own_image_with_type_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let parent = CcwParent::new(CcwParentConfig::new(dir.path())).unwrap();
    let none = Params::new();
    let (_a, mut va, msi_a) = serve(create(&parent, "aaaa", "ccw-16m", &none).unwrap());
    let (_b, mut vb, msi_b) = serve(create(&parent, "bbbb", "ccw-64m", &none).unwrap());
    assert_eq!(file_len(&parent.image_path("aaaa.img")), 16 << 20);
    assert_eq!(file_len(&parent.image_path("bbbb.img")), 64 << 20);
    assert_eq!(capacity_blocks(&mut va), (16 << 20) / 512);
    assert_eq!(capacity_blocks(&mut vb), (64 << 20) / 512);
    // Each instance writes its own image.
    write_block(&mut va, &msi_a, 8, 0xa1);
    write_block(&mut vb, &msi_b, 8, 0xb2);
    let mut byte = [0u8; 1];
    let a_img = std::fs::File::open(parent.image_path("aaaa.img")).unwrap();
    a_img.read_exact_at(&mut byte, 8 * 512).unwrap();
    assert_eq!(byte[0], 0xa1);
    let b_img = std::fs::File::open(parent.image_path("bbbb.img")).unwrap();
    b_img.read_exact_at(&mut byte, 8 * 512).unwrap();
    assert_eq!(byte[0], 0xb2);
    let infos = parent.instances();
    assert_eq!(infos.len(), 2);
    assert_eq!(
        (infos[0].image.as_str(), infos[0].capacity_mib),
        ("aaaa.img", 16)
    );
}

#[test]
fn test_ccw_parent_recreated_instance_finds_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let parent = CcwParent::new(CcwParentConfig::new(dir.path())).unwrap();
    let none = Params::new();
    {
        let (served, mut vmm, msi) = serve(create(&parent, "u1", "ccw-16m", &none).unwrap());
        write_block(&mut vmm, &msi, 3, 0x5a);
        drop(vmm);
        drop(served);
    }
    assert!(
        parent.instances().is_empty(),
        "the instance is gone with its device"
    );
    // The same UUID again (a defined instance started after a restart): same image.
    let ccw = parent
        .create_ccw(CreateRequest {
            uuid: "u1",
            type_name: "ccw-16m",
            params: &none,
        })
        .unwrap();
    assert_eq!(ccw.capacity_blocks(), (16 << 20) / 512);
    let img = std::fs::File::open(parent.image_path("u1.img")).unwrap();
    let mut byte = [0u8; 1];
    img.read_exact_at(&mut byte, 3 * 512 + 100).unwrap();
    assert_eq!(byte[0], 0x5a);
}

#[test]
fn test_ccw_parent_budget_exhausted_names_resource_and_returns_on_drop() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = CcwParentConfig::new(dir.path());
    config.budget_mib = 100;
    let parent = CcwParent::new(config).unwrap();
    let none = Params::new();
    let big = create(&parent, "big", "ccw-64m", &none).unwrap();
    let _s1 = create(&parent, "s1", "ccw-16m", &none).unwrap();
    let _s2 = create(&parent, "s2", "ccw-16m", &none).unwrap();
    assert_eq!(parent.budget_used_mib(), 96);
    match create(&parent, "s3", "ccw-16m", &none) {
        Err(InstanceError::Exhausted {
            resource,
            needed,
            left,
            ..
        }) => assert_eq!((resource.as_str(), needed, left), ("storage", 16, 4)),
        Err(e) => panic!("{e:?}"),
        Ok(_) => panic!("a 16 MiB instance fit in 4 MiB"),
    }
    assert!(
        !parent.image_path("s3.img").exists(),
        "a refused instance creates no image"
    );
    drop(big);
    assert_eq!(parent.budget_used_mib(), 32);
    create(&parent, "s3", "ccw-16m", &none).unwrap();
}

#[test]
fn test_ccw_parent_image_param_checked_inside_dir_unused_regular() {
    let dir = tempfile::tempdir().unwrap();
    let images = dir.path().join("images");
    let parent = CcwParent::new(CcwParentConfig::new(&images)).unwrap();
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
        ("missing.img", "no image"),
        ("link.img", "symbolic link"),
        ("sub.img", "regular file"),
        ("fifo.img", "regular file"),
    ] {
        let why = bad_param(create(&parent, "u", "ccw-16m", &params(&[("image", name)])));
        assert!(why.contains(why_has), "image={name}: {why}");
    }
    let why = bad_param(create(&parent, "u", "ccw-16m", &params(&[("size", "1")])));
    assert!(why.contains("unknown parameter"), "{why}");
    assert!(
        parent.instances().is_empty(),
        "refused creates take nothing"
    );

    // An existing image is used (grown to the type's capacity, its data kept) by one
    // instance at a time.
    let first = create(&parent, "u1", "ccw-16m", &params(&[("image", "disk.img")])).unwrap();
    assert_eq!(file_len(&images.join("disk.img")), 16 << 20);
    let mut byte = [0u8; 1];
    let img = std::fs::File::open(images.join("disk.img")).unwrap();
    img.read_exact_at(&mut byte, 4095).unwrap();
    assert_eq!(byte[0], 7);
    let why = bad_param(create(
        &parent,
        "u2",
        "ccw-16m",
        &params(&[("image", "disk.img")]),
    ));
    assert!(why.contains("used by instance u1"), "{why}");
    // Nor may another instance take it by UUID-named default (u1's own image).
    let _own = create(&parent, "u3", "ccw-16m", &Params::new()).unwrap();
    let why = bad_param(create(
        &parent,
        "u4",
        "ccw-16m",
        &params(&[("image", "u3.img")]),
    ));
    assert!(why.contains("used by instance u3"), "{why}");
    drop(first);
    create(&parent, "u2", "ccw-16m", &params(&[("image", "disk.img")])).unwrap();
    // The link's target was never touched.
    assert_eq!(file_len(&dir.path().join("outside.img")), 4096);
}
