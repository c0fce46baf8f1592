//! The instance registry: types and availability, creation checks, serving, concurrency.

mod instance_util;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use instance_util::*;
use umdev::instance::{InstanceError, InstanceType, Params, Parent, Resource, INSTANCES_RESOURCE};
use umdev::testing::{wait_until, DeviceAccess, Vmm};

#[test]
fn test_registry_available_instances_follow_creates_and_removes() {
    let (_dir, reg) = registry();
    let parent = Arc::new(ProbeParent::new("p", 4));
    let live = parent.live.clone();
    reg.add_parent(parent).unwrap();
    assert_eq!(available(&reg, "p", "probe"), 4);
    assert_eq!(available(&reg, "p", "probe-2"), 2);

    let one = reg.create("probe", None, &Params::new()).unwrap();
    assert_eq!(
        (
            available(&reg, "p", "probe"),
            available(&reg, "p", "probe-2")
        ),
        (3, 1)
    );
    let two = reg.create("p/probe-2", None, &Params::new()).unwrap();
    assert_eq!(
        (
            available(&reg, "p", "probe"),
            available(&reg, "p", "probe-2")
        ),
        (1, 0)
    );
    let usage = reg.resources();
    assert_eq!(usage.len(), 1);
    assert_eq!((usage[0].resource.total, usage[0].used), (4, 3));
    assert_eq!(reg.instances().len(), 2);
    assert_eq!(live.load(Ordering::SeqCst), 2);

    reg.remove(&one.uuid, false).unwrap();
    // The device is gone when remove returns, and its share is back.
    assert_eq!(live.load(Ordering::SeqCst), 1);
    assert_eq!(
        (
            available(&reg, "p", "probe"),
            available(&reg, "p", "probe-2")
        ),
        (2, 1)
    );
    reg.remove(&two.uuid, false).unwrap();
    assert_eq!(
        (
            available(&reg, "p", "probe"),
            available(&reg, "p", "probe-2")
        ),
        (4, 2)
    );
    assert_eq!(live.load(Ordering::SeqCst), 0);
    assert!(reg.instances().is_empty());
    assert!(matches!(
        reg.remove(&two.uuid, false),
        Err(InstanceError::NoSuchInstance(_))
    ));
}

#[test]
fn test_registry_create_beyond_resources_exhausted_names_resource() {
    let (_dir, reg) = registry_with(|c| c.max_instances = 3);
    reg.add_parent(Arc::new(ProbeParent::new("p", 3))).unwrap();
    reg.create("probe-2", None, &Params::new()).unwrap();
    match reg.create("probe-2", None, &Params::new()) {
        Err(e @ InstanceError::Exhausted { .. }) => {
            let InstanceError::Exhausted {
                ref type_name,
                ref resource,
                needed,
                left,
                ..
            } = e
            else {
                unreachable!()
            };
            assert_eq!(
                (type_name.as_str(), resource.as_str()),
                ("probe-2", "slots")
            );
            assert_eq!((needed, left), (2, 1));
            assert!(e.to_string().contains("slots"), "{e}");
        }
        other => panic!("expected Exhausted, got {other:?}"),
    }
    // The registry's own limit runs out as the resource "instances".
    reg.add_parent(Arc::new(ProbeParent::new("q", 8))).unwrap();
    reg.create("q/probe", None, &Params::new()).unwrap();
    assert_eq!(available(&reg, "q", "probe"), 1);
    reg.create("q/probe", None, &Params::new()).unwrap();
    assert_eq!(available(&reg, "q", "probe"), 0);
    match reg.create("q/probe", None, &Params::new()) {
        Err(InstanceError::Exhausted { resource, .. }) => assert_eq!(resource, INSTANCES_RESOURCE),
        other => panic!("expected Exhausted, got {other:?}"),
    }
}

#[test]
fn test_registry_create_uuid_given_canonical_reused_refused_bad_rejected() {
    let (_dir, reg) = registry();
    reg.add_parent(Arc::new(ProbeParent::new("p", 8))).unwrap();
    let given = "6D5E4C3B-2A19-4807-9F6E-5D4C3B2A1908";
    let a = reg.create("probe", Some(given), &Params::new()).unwrap();
    assert_eq!(a.uuid, given.to_lowercase());
    assert_eq!(
        a.socket.file_name().unwrap().to_str().unwrap(),
        format!("{}.sock", a.uuid)
    );
    // The same UUID in another spelling is the same instance.
    let simple = given.replace('-', "");
    assert!(matches!(
        reg.create("probe", Some(&simple), &Params::new()),
        Err(InstanceError::UuidInUse(u)) if u == a.uuid
    ));
    assert_eq!(reg.instance(&simple).unwrap().uuid, a.uuid);
    assert!(matches!(
        reg.create("probe", Some("not-a-uuid"), &Params::new()),
        Err(InstanceError::BadParam { name, .. }) if name == "uuid"
    ));
    let b = reg.create("probe", None, &Params::new()).unwrap();
    let parsed = uuid::Uuid::parse_str(&b.uuid).unwrap();
    assert_eq!(parsed.get_version_num(), 4);
    assert_eq!(parsed.hyphenated().to_string(), b.uuid);
    assert_eq!(available(&reg, "p", "probe"), 6);
}

/// A parent whose declarations are wrong in the way `why` says.
struct Broken(&'static str);

impl Parent for Broken {
    fn name(&self) -> &str {
        if self.0 == "slash" {
            "a/b"
        } else {
            "broken"
        }
    }
    fn resources(&self) -> Vec<Resource> {
        let r = Resource {
            name: "r".into(),
            unit: "u".into(),
            total: 1,
        };
        if self.0 == "twice" {
            vec![r.clone(), r]
        } else {
            vec![r]
        }
    }
    fn types(&self) -> Vec<InstanceType> {
        let need = if self.0 == "undeclared" { "other" } else { "r" };
        vec![InstanceType {
            name: "t".into(),
            description: String::new(),
            device_api: "vfio-pci".into(),
            needs: vec![(need.into(), 1)],
        }]
    }
    fn create(
        &self,
        _req: umdev::instance::CreateRequest<'_>,
    ) -> Result<Box<dyn umdev::device::Device>, InstanceError> {
        Err(InstanceError::UnknownType("t".into()))
    }
}

#[test]
fn test_registry_type_addressing_bare_ambiguous_qualified_unknown() {
    let (_dir, reg) = registry();
    reg.add_parent(Arc::new(ProbeParent::new("a", 2))).unwrap();
    reg.create("probe", None, &Params::new()).unwrap();
    reg.add_parent(Arc::new(ProbeParent::new("b", 2))).unwrap();
    match reg.create("probe", None, &Params::new()) {
        Err(InstanceError::AmbiguousType { name, parents }) => {
            assert_eq!(name, "probe");
            assert_eq!(parents, ["a", "b"]);
        }
        other => panic!("expected AmbiguousType, got {other:?}"),
    }
    let i = reg.create("b/probe", None, &Params::new()).unwrap();
    assert_eq!((i.parent.as_str(), i.type_name.as_str()), ("b", "probe"));
    for spec in ["c/probe", "a/nope", "nope", "a/", "/probe"] {
        assert!(
            matches!(reg.create(spec, None, &Params::new()), Err(InstanceError::UnknownType(s)) if s == spec),
            "{spec}"
        );
    }
    assert_eq!(reg.parent_names(), ["a", "b"]);
    for bad in [
        Arc::new(ProbeParent::new("a", 1)) as Arc<dyn Parent>,
        Arc::new(Broken("slash")),
        Arc::new(Broken("twice")),
        Arc::new(Broken("undeclared")),
    ] {
        let name = bad.name().to_owned();
        assert!(
            matches!(
                reg.add_parent(bad),
                Err(InstanceError::InvalidParent { .. })
            ),
            "{name}"
        );
    }
    assert_eq!(reg.parent_names(), ["a", "b"]);
}

#[test]
fn test_registry_failed_create_takes_nothing_and_leaves_no_socket() {
    let (dir, reg) = registry();
    let parent = Arc::new(ProbeParent::new("p", 2));
    let live = parent.live.clone();
    reg.add_parent(parent).unwrap();
    assert!(matches!(
        reg.create("probe", None, &params(&[("tag", "x")])),
        Err(InstanceError::BadParam { name, .. }) if name == "tag"
    ));
    // A panic in the parent is an error, not the caller's panic, and takes nothing.
    match reg.create("probe", None, &params(&[("panic", "")])) {
        Err(InstanceError::Device(e)) => {
            let why = format!("{:?}", e);
            assert!(why.contains("panicked"), "{why}");
        }
        other => panic!("expected Device, got {other:?}"),
    }
    // A socket path that cannot be bound (a directory is in the way).
    let uuid = "00000000-0000-4000-8000-000000000001";
    std::fs::create_dir(dir.path().join("sockets").join(format!("{uuid}.sock"))).unwrap();
    assert!(matches!(
        reg.create("probe", Some(uuid), &Params::new()),
        Err(InstanceError::Io { .. })
    ));
    assert_eq!(available(&reg, "p", "probe"), 2);
    assert!(reg.instances().is_empty());
    assert_eq!(
        live.load(Ordering::SeqCst),
        0,
        "the device of the failed create is dropped"
    );
    let sockets: Vec<_> = std::fs::read_dir(dir.path().join("sockets"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        sockets.len(),
        1,
        "only the directory in the way: {sockets:?}"
    );
    // And everything still works.
    let i = reg.create("probe", None, &params(&[("tag", "5")])).unwrap();
    assert_eq!(i.params, params(&[("tag", "5")]));
    assert_eq!(available(&reg, "p", "probe"), 1);
}

#[test]
fn test_registry_instance_serves_dma_reconnects_and_lists_client() {
    let (_dir, reg) = registry();
    reg.add_parent(Arc::new(ProbeParent::new("p", 2))).unwrap();
    let info = reg.create("probe", None, &params(&[("tag", "7")])).unwrap();
    assert!(info.socket.exists());
    assert!(!info.client_attached);
    for round in 0..2u64 {
        let mut vmm = Vmm::connect(&info.socket)
            .unwrap()
            .with_ram(1 << 30, 1 << 20)
            .unwrap();
        vmm.enable_device().unwrap();
        assert_eq!(vmm.read32(0, REG_ID).unwrap(), MAGIC);
        assert_eq!(vmm.read32(0, REG_TAG).unwrap(), 7);
        vmm.ram().write_u64(1 << 30, 40 + round).unwrap();
        vmm.write64(0, REG_ADDR, 1 << 30).unwrap();
        vmm.write32(0, REG_ADD, 2).unwrap();
        assert_eq!(vmm.ram().read_u64(1 << 30).unwrap(), 42 + round);
        let listed = reg.instance(&info.uuid).unwrap();
        assert!(listed.client_attached, "round {round}");
        assert_eq!(listed.dma.maps, 1);
        drop(vmm);
        assert!(wait_until(Duration::from_secs(5), || !reg
            .instance(&info.uuid)
            .unwrap()
            .client_attached));
        assert_eq!(reg.instance(&info.uuid).unwrap().dma.maps, 0);
    }
    let report = reg.remove(&info.uuid, false).unwrap();
    assert!(!report.client_was_attached && !report.forced);
    assert!(!info.socket.exists(), "the socket goes with the instance");
}

#[test]
fn test_registry_concurrent_creates_of_last_slot_exactly_one_wins() {
    const THREADS: usize = 6;
    const ROUNDS: usize = 30;
    let (_dir, reg) = registry();
    let parent = Arc::new(ProbeParent::new("p", 3));
    let live = parent.live.clone();
    reg.add_parent(parent).unwrap();
    // Two slots taken for good: the race is for the last one.
    reg.create("probe-2", None, &Params::new()).unwrap();
    let reg = Arc::new(reg);
    for round in 0..ROUNDS {
        let barrier = Arc::new(Barrier::new(THREADS));
        let results: Vec<_> = (0..THREADS)
            .map(|_| {
                let (reg, barrier) = (reg.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    reg.create("probe", None, &Params::new())
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        let won: Vec<_> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
        assert_eq!(won.len(), 1, "round {round}: {results:?}");
        for r in &results {
            if let Err(e) = r {
                assert!(
                    matches!(e, InstanceError::Exhausted { resource, .. } if resource == "slots"),
                    "round {round}: {e}"
                );
            }
        }
        assert_eq!(available(&reg, "p", "probe"), 0);
        assert_eq!(live.load(Ordering::SeqCst), 2);
        reg.remove(&won[0].uuid, false).unwrap();
    }
}

#[test]
fn test_registry_concurrent_creates_same_uuid_exactly_one_wins() {
    const THREADS: usize = 6;
    const ROUNDS: usize = 30;
    let (_dir, reg) = registry();
    reg.add_parent(Arc::new(ProbeParent::new("p", 64))).unwrap();
    let reg = Arc::new(reg);
    for round in 0..ROUNDS {
        let uuid = uuid::Uuid::new_v4().to_string();
        let barrier = Arc::new(Barrier::new(THREADS));
        let results: Vec<_> = (0..THREADS)
            .map(|_| {
                let (reg, barrier, uuid) = (reg.clone(), barrier.clone(), uuid.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    reg.create("probe", Some(&uuid), &Params::new())
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .collect();
        let won = results.iter().filter(|r| r.is_ok()).count();
        assert_eq!(won, 1, "round {round}: {results:?}");
        assert!(results
            .iter()
            .all(|r| r.is_ok() || matches!(r, Err(InstanceError::UuidInUse(u)) if *u == uuid)));
        assert_eq!(reg.instances().len(), 1);
        assert_eq!(available(&reg, "p", "probe"), 63);
        reg.remove(&uuid, false).unwrap();
    }
}

#[test]
fn test_registry_state_of_device_without_migration_refused_and_nothing_taken() {
    let (_dir, reg) = registry();
    reg.add_parent(Arc::new(ProbeParent::new("p", 4))).unwrap();
    let one = reg.create("probe", None, &Params::new()).unwrap();
    let e = reg.save_state(&one.uuid).unwrap_err();
    assert!(
        matches!(e, InstanceError::NotMigratable { .. }) && e.to_string().contains("p/probe"),
        "{e}"
    );
    assert!(reg.instance(&one.uuid).is_ok(), "still served");
    let uuid = "00000000-0000-4000-8000-000000000077";
    let e = reg
        .create_with_state("probe", uuid, &Params::new(), b"not a stream")
        .unwrap_err();
    assert!(matches!(e, InstanceError::NotMigratable { .. }), "{e}");
    assert_eq!(
        available(&reg, "p", "probe"),
        3,
        "the refused create took nothing"
    );
    assert!(reg.instance(uuid).is_err());
    assert!(!reg
        .config()
        .socket_dir
        .join(format!("{uuid}.sock"))
        .exists());
    assert!(matches!(
        reg.save_state(uuid),
        Err(InstanceError::NoSuchInstance(_))
    ));
}
