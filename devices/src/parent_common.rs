//! What the daemon's parents ([`crate::gpu::GpuParent`], [`crate::ccw::CcwParent`],
//! [`crate::nvme::NvmeParent`], [`crate::virtio_gpu::VirtioGpuParent`]) do the same way.
//!
//! Each parent offers named types that each take an amount (MiB) of its one [`Resource`],
//! keeps a table of its live instances by UUID from [`umdev::instance::Parent::create`]
//! until the device is dropped ([`Instances`], [`Lease`]), computes what is left from that
//! table, and serves its devices as `vfio-pci` through a [`PciAdapter`]. The ccw and NVMe
//! parents also share the rules of their `image=<name>` parameter and of their image
//! directory.
//!
//! What differs (a type's own checks, its device, how a device error becomes an
//! [`InstanceError`]) stays in each parent.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use umdev::device::Device;
use umdev::instance::{InstanceError, InstanceType, Params, Resource};
use umdev::pci::{PciAdapter, PciDevice};

/// The parameter that picks an existing image (ccw and NVMe parents).
pub(crate) const PARAM_IMAGE: &str = "image";

/// A type a parent offers, as the shared code sees it.
pub(crate) trait OfferedType {
    /// Its name, unique within the parent.
    fn type_name(&self) -> &str;
    /// How much of the parent's resource one instance takes, MiB.
    fn need_mib(&self) -> u64;
    /// One line for humans ([`InstanceType::description`]).
    fn description(&self) -> String;
}

/// A parent's configuration error, for the checks every type list passes. Implemented
/// with [`impl_type_list_error`] by the error enums that have the variants `NoTypes`,
/// `DuplicateType(String)` and `BadType { name, why }`.
pub(crate) trait TypeListError: Sized {
    /// No types.
    fn no_types() -> Self;
    /// Two types named `name`.
    fn duplicate_type(name: String) -> Self;
    /// Type `name` cannot be built, because `why`.
    fn bad_type(name: String, why: String) -> Self;

    /// Check `types`: at least one, unique non-empty names, and `check` (the parent's own
    /// rules, an `Err` saying why) passed by each, in order; the first failure is returned.
    fn check_types<T: OfferedType>(
        types: &[T],
        check: impl Fn(&T) -> Result<(), String>,
    ) -> Result<(), Self> {
        if types.is_empty() {
            return Err(Self::no_types());
        }
        for (i, t) in types.iter().enumerate() {
            let name = t.type_name();
            if types[..i].iter().any(|o| o.type_name() == name) {
                return Err(Self::duplicate_type(name.to_owned()));
            }
            if name.is_empty() {
                return Err(Self::bad_type(name.to_owned(), "empty name".to_owned()));
            }
            check(t).map_err(|why| Self::bad_type(name.to_owned(), why))?;
        }
        Ok(())
    }
}

/// `impl TypeListError for $err` with its variants `NoTypes`, `DuplicateType` and
/// `BadType`.
macro_rules! impl_type_list_error {
    ($err:ident) => {
        impl $crate::parent_common::TypeListError for $err {
            fn no_types() -> Self {
                $err::NoTypes
            }
            fn duplicate_type(name: String) -> Self {
                $err::DuplicateType(name)
            }
            fn bad_type(name: String, why: String) -> Self {
                $err::BadType { name, why }
            }
        }
    };
}
pub(crate) use impl_type_list_error;

/// The type named `name` among `types`, or [`InstanceError::UnknownType`].
pub(crate) fn find_type<'a, T: OfferedType>(
    types: &'a [T],
    name: &str,
) -> Result<&'a T, InstanceError> {
    types
        .iter()
        .find(|t| t.type_name() == name)
        .ok_or_else(|| InstanceError::UnknownType(name.to_owned()))
}

/// `types` as [`InstanceType`]s: `vfio-pci` devices, each needing its
/// [`OfferedType::need_mib`] of resource `resource`.
pub(crate) fn pci_types<T: OfferedType>(types: &[T], resource: &str) -> Vec<InstanceType> {
    types
        .iter()
        .map(|t| InstanceType {
            name: t.type_name().to_owned(),
            description: t.description(),
            device_api: "vfio-pci".to_owned(),
            needs: vec![(resource.to_owned(), t.need_mib())],
        })
        .collect()
}

/// A parent's resource `name` of `total` MiB.
pub(crate) fn mib_resource(name: &str, total: u64) -> Resource {
    Resource {
        name: name.to_owned(),
        unit: "MiB".to_owned(),
        total,
    }
}

/// `dev` served as a PCI device ([`umdev::instance::Parent::create`]'s result).
pub(crate) fn pci_device<D: PciDevice + 'static>(dev: D) -> Result<Box<dyn Device>, InstanceError> {
    Ok(Box::new(
        PciAdapter::new(dev).map_err(InstanceError::Device)?,
    ))
}

/// A live instance's entry in [`Instances`]: what it holds of the parent's resource.
pub(crate) trait Share {
    /// MiB of the resource it holds.
    fn share_mib(&self) -> u64;
}

/// Lock `m`, whether or not a holder panicked (a table stays consistent: every change to it
/// is one insert or one remove).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A parent's live instances by UUID: an entry from `create` until its [`Lease`] is
/// dropped with the device. What is left of the resource is computed from it.
pub(crate) struct Instances<V> {
    table: Mutex<BTreeMap<String, V>>,
}

impl<V: Share + Send + 'static> Instances<V> {
    /// An empty table.
    pub(crate) fn new() -> Arc<Instances<V>> {
        Arc::new(Instances {
            table: Mutex::new(BTreeMap::new()),
        })
    }

    /// The table, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, BTreeMap<String, V>> {
        lock(&self.table)
    }

    /// MiB of the resource held by live instances.
    pub(crate) fn used_mib(&self) -> u64 {
        used_mib(&self.lock())
    }

    /// The lease of instance `uuid` of `this`: its entry is removed when the lease is
    /// dropped (if the table still exists), and `released` is logged.
    pub(crate) fn lease(this: &Arc<Instances<V>>, uuid: &str, released: &'static str) -> Lease {
        let table: Weak<dyn Release> = Arc::downgrade(this) as Weak<dyn Release>;
        Lease {
            table,
            uuid: uuid.to_owned(),
            released,
        }
    }
}

/// MiB held by the instances of `table`.
pub(crate) fn used_mib<V: Share>(table: &BTreeMap<String, V>) -> u64 {
    table.values().map(Share::share_mib).sum()
}

/// Whether instance `uuid` of type `ty` may join `table` (locked by the caller, who
/// inserts it under the same lock): its UUID is free ([`InstanceError::UuidInUse`]) and
/// its share fits what is left of `resource` ([`InstanceError::Exhausted`]).
pub(crate) fn admit<V: Share, T: OfferedType>(
    table: &BTreeMap<String, V>,
    resource: &Resource,
    uuid: &str,
    ty: &T,
) -> Result<(), InstanceError> {
    if table.contains_key(uuid) {
        return Err(InstanceError::UuidInUse(uuid.to_owned()));
    }
    resource.check_room(ty.type_name(), used_mib(table), ty.need_mib())
}

/// What a [`Lease`] gives back to.
trait Release: Send + Sync {
    /// Remove instance `uuid`.
    fn release(&self, uuid: &str);
}

impl<V: Send> Release for Instances<V> {
    fn release(&self, uuid: &str) {
        lock(&self.table).remove(uuid);
    }
}

/// What an instance's device borrowed from its parent: its entry in the parent's
/// [`Instances`] (and so its share of the resource), removed when the device drops it.
pub(crate) struct Lease {
    table: Weak<dyn Release>,
    uuid: String,
    released: &'static str,
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(table) = self.table.upgrade() {
            table.release(&self.uuid);
            tracing::debug!(uuid = %self.uuid, "{}", self.released);
        }
    }
}

/// [`InstanceError::BadParam`] for parameter `name`.
pub(crate) fn bad_param(name: &str, why: impl Into<String>) -> InstanceError {
    InstanceError::BadParam {
        name: name.to_owned(),
        why: why.into(),
    }
}

/// Check an image file name: a plain file name in the image directory (no `/`, no NUL,
/// not starting with `.`, no `..`, 1 to 255 bytes).
pub(crate) fn check_image_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("empty image name".into());
    }
    if name.len() > 255 {
        return Err("image name longer than 255 bytes".into());
    }
    if name.contains('/') || name.contains('\0') {
        return Err(
            "an image is named by its file name in the image directory, \
                    without '/'"
                .into(),
        );
    }
    if name.starts_with('.') || name.contains("..") {
        return Err("an image name may not start with '.' or contain '..'".into());
    }
    Ok(())
}

/// Check the parameters of an instance of a `kind` parent (`"ccw"`) whose only parameter
/// is `image=<name>` ([`check_image_name`]).
pub(crate) fn check_image_params(kind: &str, params: &Params) -> Result<(), InstanceError> {
    for (k, v) in params {
        if k != PARAM_IMAGE {
            return Err(bad_param(
                k,
                format!("unknown parameter ({kind} instances take only {PARAM_IMAGE}=<name>)"),
            ));
        }
        check_image_name(v).map_err(|why| bad_param(k, why))?;
    }
    Ok(())
}

/// The image of instance `uuid` with `params` (checked by [`check_image_params`]) and
/// whether to create it: `image=<name>` if given (an existing image), else `<uuid>.img`.
pub(crate) fn image_of(uuid: &str, params: &Params) -> Result<(String, bool), InstanceError> {
    match params.get(PARAM_IMAGE) {
        Some(name) => Ok((name.clone(), false)),
        None => {
            let name = format!("{uuid}.img");
            check_image_name(&name).map_err(|why| bad_param("uuid", why))?;
            Ok((name, true))
        }
    }
}

/// Refuse image `name` if a live instance uses it; `images` yields each live instance's
/// UUID and image.
pub(crate) fn check_image_unused<'a>(
    name: &str,
    mut images: impl Iterator<Item = (&'a str, &'a str)>,
) -> Result<(), InstanceError> {
    match images.find(|(_, image)| *image == name) {
        Some((user, _)) => Err(bad_param(
            PARAM_IMAGE,
            format!("image {name:?} is used by instance {user}"),
        )),
        None => Ok(()),
    }
}

/// Create image directory `dir` if missing; `ENOTDIR` if it is not a directory.
pub(crate) fn ensure_dir(dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    if !std::fs::metadata(dir)?.is_dir() {
        return Err(io::Error::from_raw_os_error(libc::ENOTDIR));
    }
    Ok(())
}

/// Open image `name` (checked by [`check_image_name`]) in `dir` for an instance: an
/// existing regular file (or a new one when `create`), never through a symbolic link.
pub(crate) fn open_image_in(dir: &Path, name: &str, create: bool) -> Result<File, InstanceError> {
    let path = dir.join(name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        // No link is followed; opening a special file does not block (it is refused
        // below); O_NONBLOCK changes nothing for a regular file's pread/pwrite.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(&path);
    let file = match file {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
            return Err(bad_param(
                PARAM_IMAGE,
                format!("no image {name:?} in {}", dir.display()),
            ))
        }
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(bad_param(
                PARAM_IMAGE,
                format!("image {name:?} is a symbolic link"),
            ))
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::EISDIR | libc::ENXIO)) => {
            return Err(bad_param(
                PARAM_IMAGE,
                format!("image {name:?} is not a regular file"),
            ))
        }
        Err(source) => {
            return Err(InstanceError::Io {
                what: format!("opening image {}", path.display()),
                source,
            })
        }
    };
    let meta = file.metadata().map_err(|source| InstanceError::Io {
        what: format!("reading image {}", path.display()),
        source,
    })?;
    if !meta.is_file() {
        return Err(bad_param(
            PARAM_IMAGE,
            format!("image {name:?} is not a regular file"),
        ));
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq, Eq)]
    struct T {
        name: &'static str,
        mib: u64,
    }

    impl OfferedType for T {
        fn type_name(&self) -> &str {
            self.name
        }

        fn need_mib(&self) -> u64 {
            self.mib
        }

        fn description(&self) -> String {
            format!("{} MiB", self.mib)
        }
    }

    impl Share for T {
        fn share_mib(&self) -> u64 {
            self.mib
        }
    }

    fn t(name: &'static str, mib: u64) -> T {
        T { name, mib }
    }

    #[derive(Debug, PartialEq, Eq)]
    enum TestError {
        NoTypes,
        DuplicateType(String),
        BadType { name: String, why: String },
    }

    impl_type_list_error!(TestError);

    fn no_zero(t: &T) -> Result<(), String> {
        if t.mib == 0 {
            return Err("zero".into());
        }
        Ok(())
    }

    #[test]
    fn test_check_types_refuses_empty_duplicate_nameless_and_own_checks_in_order() {
        assert_eq!(
            TestError::check_types::<T>(&[], no_zero),
            Err(TestError::NoTypes)
        );
        assert_eq!(
            TestError::check_types(&[t("a", 1), t("b", 1), t("a", 0)], no_zero),
            Err(TestError::DuplicateType("a".into()))
        );
        assert_eq!(
            TestError::check_types(&[t("a", 1), t("", 1)], no_zero),
            Err(TestError::BadType {
                name: String::new(),
                why: "empty name".into()
            })
        );
        // The first type that fails is reported, with the parent's reason.
        assert_eq!(
            TestError::check_types(&[t("a", 1), t("b", 0), t("b", 1)], no_zero),
            Err(TestError::BadType {
                name: "b".into(),
                why: "zero".into()
            })
        );
        assert_eq!(
            TestError::check_types(&[t("a", 1), t("b", 2)], no_zero),
            Ok(())
        );
    }

    #[test]
    fn test_find_type_and_pci_types() {
        let types = [t("a", 1), t("b", 2)];
        assert_eq!(find_type(&types, "b").map(|t| t.mib).ok(), Some(2));
        assert!(matches!(
            find_type(&types, "c"),
            Err(InstanceError::UnknownType(n)) if n == "c"
        ));
        let listed = pci_types(&types, "pool");
        assert_eq!(listed.len(), 2);
        assert_eq!(listed[1].name, "b");
        assert_eq!(listed[1].description, "2 MiB");
        assert_eq!(listed[1].device_api, "vfio-pci");
        assert_eq!(listed[1].needs, vec![("pool".to_owned(), 2)]);
        let r = mib_resource("pool", 8);
        assert_eq!(
            (r.name.as_str(), r.unit.as_str(), r.total),
            ("pool", "MiB", 8)
        );
    }

    #[test]
    fn test_admit_checks_uuid_then_room_and_lease_gives_back() {
        let instances = Instances::<T>::new();
        let pool = mib_resource("pool", 8);
        let lease_a = {
            let mut table = instances.lock();
            admit(&table, &pool, "a", &t("x", 6)).unwrap();
            table.insert("a".into(), t("x", 6));
            Instances::lease(&instances, "a", "test: released")
        };
        assert_eq!(instances.used_mib(), 6);
        {
            let table = instances.lock();
            // A UUID in use is refused even when its type would not fit either.
            assert!(matches!(
                admit(&table, &pool, "a", &t("y", 4)),
                Err(InstanceError::UuidInUse(u)) if u == "a"
            ));
            match admit(&table, &pool, "b", &t("y", 4)) {
                Err(InstanceError::Exhausted {
                    resource,
                    needed,
                    left,
                    ..
                }) => assert_eq!((resource.as_str(), needed, left), ("pool", 4, 2)),
                other => panic!("{other:?}"),
            }
            assert!(admit(&table, &pool, "b", &t("y", 2)).is_ok());
        }
        drop(lease_a);
        assert_eq!(instances.used_mib(), 0);
        assert!(instances.lock().is_empty());
        // A lease that outlives its table gives back nothing, and does not panic.
        let orphan = Instances::lease(&instances, "c", "test: released");
        drop(instances);
        drop(orphan);
    }

    #[test]
    fn test_check_image_name_refuses_paths_and_dots() {
        for bad in [
            "",
            "..",
            ".",
            "../x",
            "a/b",
            "/etc/passwd",
            ".hidden",
            "a..b",
            "x\0y",
        ] {
            assert!(check_image_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(check_image_name(&"x".repeat(256)).is_err());
        for good in ["disk.img", "a-b_c.raw", "x"] {
            assert!(check_image_name(good).is_ok(), "{good:?} refused");
        }
    }

    fn params(pairs: &[(&str, &str)]) -> Params {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn test_check_image_params_names_kind_and_key() {
        assert!(check_image_params("ccw", &params(&[])).is_ok());
        assert!(check_image_params("ccw", &params(&[("image", "d.img")])).is_ok());
        match check_image_params("nvme", &params(&[("size", "1")])) {
            Err(InstanceError::BadParam { name, why }) => {
                assert_eq!(name, "size");
                assert_eq!(
                    why,
                    "unknown parameter (nvme instances take only image=<name>)"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            check_image_params("ccw", &params(&[("image", "../x")])),
            Err(InstanceError::BadParam { name, .. }) if name == "image"
        ));
    }

    #[test]
    fn test_image_of_param_or_uuid_and_check_image_unused() {
        assert_eq!(
            image_of("u1", &params(&[("image", "d.img")])).ok(),
            Some(("d.img".to_owned(), false))
        );
        assert_eq!(
            image_of("u1", &params(&[])).ok(),
            Some(("u1.img".to_owned(), true))
        );
        assert!(matches!(
            image_of("a/b", &params(&[])),
            Err(InstanceError::BadParam { name, .. }) if name == "uuid"
        ));
        let users = [("u1", "a.img"), ("u2", "b.img")];
        assert!(check_image_unused("c.img", users.iter().copied()).is_ok());
        match check_image_unused("b.img", users.iter().copied()) {
            Err(InstanceError::BadParam { name, why }) => {
                assert_eq!(name, "image");
                assert_eq!(why, "image \"b.img\" is used by instance u2");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn test_ensure_dir_creates_and_refuses_a_file_path() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("a").join("b");
        ensure_dir(&nested).unwrap();
        assert!(nested.is_dir());
        ensure_dir(&nested).unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        // Refused by create_dir_all itself (EEXIST); ENOTDIR covers what it lets through.
        assert!(ensure_dir(&file).is_err());
        assert!(ensure_dir(&file.join("below")).is_err());
    }

    #[test]
    fn test_open_image_in_refuses_missing_links_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        let why = |r: Result<File, InstanceError>| match r {
            Err(InstanceError::BadParam { name, why }) if name == PARAM_IMAGE => why,
            other => panic!("{other:?}"),
        };
        assert!(why(open_image_in(dir.path(), "none.img", false)).starts_with("no image"));
        assert!(open_image_in(dir.path(), "new.img", true).is_ok());
        assert!(dir.path().join("new.img").is_file());
        std::os::unix::fs::symlink("new.img", dir.path().join("link.img")).unwrap();
        assert!(why(open_image_in(dir.path(), "link.img", false)).contains("symbolic link"));
        std::fs::create_dir(dir.path().join("d.img")).unwrap();
        assert!(why(open_image_in(dir.path(), "d.img", false)).contains("not a regular file"));
    }
}
