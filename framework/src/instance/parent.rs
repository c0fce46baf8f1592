//! The [`Parent`] trait a device family implements to be served as instances.

use std::collections::BTreeMap;

use crate::device::{Device, DeviceError};

/// Instance parameters as the admin gave them (`umdev create ... key=value`), kept in the
/// instance's definition. A parent documents which keys it reads and rejects unknown ones.
pub type Params = BTreeMap<String, String>;

/// Something a parent shares among its instances, with its total amount.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    /// Name, unique within the parent (`"framebuffer"`, `"images"`).
    pub name: String,
    /// Unit, for humans (`"MiB"`, `"slots"`).
    pub unit: String,
    /// Total amount the parent has.
    pub total: u64,
}

impl Resource {
    /// The error for an instance of `type_name` that needs `needed` of this resource where
    /// only `left` remains.
    pub fn exhausted(&self, type_name: &str, needed: u64, left: u64) -> InstanceError {
        InstanceError::Exhausted {
            type_name: type_name.to_owned(),
            resource: self.name.clone(),
            unit: self.unit.clone(),
            needed,
            left,
        }
    }

    /// Whether one more instance of `type_name` needing `needed` fits beside `used`:
    /// [`InstanceError::Exhausted`] naming this resource if not.
    pub fn check_room(&self, type_name: &str, used: u64, needed: u64) -> Result<(), InstanceError> {
        let left = self.total.saturating_sub(used);
        if needed > left {
            return Err(self.exhausted(type_name, needed, left));
        }
        Ok(())
    }
}

/// A kind of instance a parent offers (the kernel's mdev type).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceType {
    /// Name, unique within the parent (`"gpu-4m"`); the CLI addresses types as
    /// `<parent>/<type>` or, when unambiguous, by this name alone.
    pub name: String,
    /// One line for humans.
    pub description: String,
    /// The VFIO device API the instance presents (`"vfio-pci"`).
    pub device_api: String,
    /// What one instance takes: `(resource name, amount)`. A type that needs nothing is
    /// limited only by the registry's own instance limit.
    pub needs: Vec<(String, u64)>,
}

/// What [`Parent::create`] is asked to build.
#[derive(Clone, Copy, Debug)]
pub struct CreateRequest<'a> {
    /// The instance's UUID (canonical lowercase hyphenated form).
    pub uuid: &'a str,
    /// One of the parent's [`InstanceType::name`]s.
    pub type_name: &'a str,
    /// The admin's parameters.
    pub params: &'a Params,
}

/// What a display shows, as [`Parent::screenshot`] gives it: a PNG image of its size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Screenshot {
    /// Width, pixels.
    pub width: u32,
    /// Height, pixels.
    pub height: u32,
    /// The PNG file.
    pub png: Vec<u8>,
}

/// Why an instance operation failed. Each variant names what the admin needs to know.
#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    /// No parent offers this type.
    #[error("unknown type {0:?}")]
    UnknownType(String),
    /// Not enough of a resource left for one more instance of the type.
    #[error(
        "no {type_name} instances available: it needs {needed} {unit} of {resource}, \
         {left} {unit} left"
    )]
    Exhausted {
        /// The type asked for.
        type_name: String,
        /// The resource that ran out.
        resource: String,
        /// Its unit.
        unit: String,
        /// What one instance needs.
        needed: u64,
        /// What is left.
        left: u64,
    },
    /// The UUID already names an instance.
    #[error("UUID {0} is in use")]
    UuidInUse(String),
    /// No instance has this UUID.
    #[error("no instance {0}")]
    NoSuchInstance(String),
    /// A parameter is unknown or has a bad value.
    #[error("parameter {name:?}: {why}")]
    BadParam {
        /// The key.
        name: String,
        /// What is wrong with it.
        why: String,
    },
    /// A client is attached and did not let go in time (removal without `force`).
    #[error("instance {0} is busy: a client is attached and did not release it")]
    Busy(String),
    /// Building the device failed.
    #[error("creating the device failed")]
    Device(#[source] DeviceError),
    /// A bare type name that several parents offer: address it as `<parent>/<type>`.
    #[error("type {name:?} is offered by several parents ({}): say <parent>/{name}", parents.join(", "))]
    AmbiguousType {
        /// The bare type name.
        name: String,
        /// The parents that offer it.
        parents: Vec<String>,
    },
    /// A parent that cannot be registered (duplicate name, inconsistent declarations).
    #[error("parent {parent:?} cannot be registered: {why}")]
    InvalidParent {
        /// The parent's name.
        parent: String,
        /// What is wrong.
        why: String,
    },
    /// The device did not finish its teardown in time (it is stuck in a call): the
    /// instance stays registered, with its resources, until a later removal succeeds.
    #[error("instance {uuid}: the device did not finish its teardown within {waited:?}")]
    Stuck {
        /// The instance.
        uuid: String,
        /// How long the registry waited.
        waited: std::time::Duration,
    },
    /// A client is attached: only the client (the VMM, which owns guest RAM and the
    /// interrupt eventfds) can migrate the device, over the vfio-user migration messages.
    #[error(
        "instance {0} has a client attached: only its VMM can migrate an attached device \
         (it owns the guest RAM and the interrupts)"
    )]
    Attached(String),
    /// The instance's device does not migrate ([`Device::migration`] is `None`).
    #[error("instance {uuid}: {type_name} devices do not support migration")]
    NotMigratable {
        /// The instance.
        uuid: String,
        /// Its type.
        type_name: String,
    },
    /// Saving or loading the instance's state failed (a refused stream says why).
    #[error("instance {uuid}: {what}")]
    Migration {
        /// The instance.
        uuid: String,
        /// What was being done.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: crate::migration::MigrationError,
    },
    /// The instance's device has no display ([`Parent::screenshot`] is `None`).
    #[error("instance {uuid} of type {type_name} has no display")]
    NoDisplay {
        /// The instance.
        uuid: String,
        /// Its type (`<parent>/<type>`).
        type_name: String,
    },
    /// The display shows nothing now (the guest has not set a scanout, or reset it), or the
    /// device has no such scanout.
    #[error("instance {uuid}: scanout {scanout} {why}")]
    NothingShown {
        /// The instance.
        uuid: String,
        /// The scanout asked for.
        scanout: u32,
        /// What is the matter (`"shows nothing yet: ..."`, `"does not exist (...)"`).
        why: String,
    },
    /// The display refused a host request (`resize` of a scanout it does not have, or to
    /// a size it cannot show).
    #[error("instance {uuid}: scanout {scanout}: {why}")]
    DisplayRefused {
        /// The instance.
        uuid: String,
        /// The scanout asked for.
        scanout: u32,
        /// Why.
        why: String,
    },
    /// An I/O error (sockets, files).
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// A device family served as instances. Implementations are shared by every thread of the
/// daemon (`Send + Sync`); the resources they share among instances (one render engine, an
/// image directory) live in the parent, and an instance's device holds what it borrowed
/// until it is dropped.
pub trait Parent: Send + Sync {
    /// Short name, unique among the parents of one registry (`"gpu"`, `"ccw"`, `"hello"`).
    fn name(&self) -> &str;

    /// What the parent shares among its instances, with totals.
    fn resources(&self) -> Vec<Resource> {
        Vec::new()
    }

    /// The types it offers.
    fn types(&self) -> Vec<InstanceType>;

    /// Check `params` for `type_name` without building anything (called before resources are
    /// taken, so a bad parameter never costs a slot). Default: no parameters accepted.
    fn check_params(&self, _type_name: &str, params: &Params) -> Result<(), InstanceError> {
        match params.keys().next() {
            None => Ok(()),
            Some(k) => Err(InstanceError::BadParam {
                name: k.clone(),
                why: format!("{} instances take no parameters", self.name()),
            }),
        }
    }

    /// Build the device of a new instance. The registry has checked that the type exists,
    /// that its resources are available, and that the parameters passed `check_params`.
    /// The device is dropped when the instance is removed; whatever it borrowed from the
    /// parent goes back then.
    fn create(&self, req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError>;

    /// What scanout `scanout` of live instance `uuid` shows now, as PNG (a cursor drawn
    /// in). `None`: the parent's devices have no display (the default), which the registry
    /// reports as [`InstanceError::NoDisplay`]; `Some(Err(`[`InstanceError::NothingShown`]`))`
    /// when the display shows nothing. Called from a control request thread, not under any
    /// lock of the registry: a parent takes its device's own lock only to copy the picture
    /// and encodes it outside that lock, so a screenshot does not stall the device.
    fn screenshot(&self, _uuid: &str, _scanout: u32) -> Option<Result<Screenshot, InstanceError>> {
        None
    }

    /// Change the mode of scanout `scanout` of live instance `uuid` to `width` × `height`,
    /// as a monitor's owner would (the device tells the guest's driver with its display
    /// event). `None`: the parent's devices have no display (the default, reported as
    /// [`InstanceError::NoDisplay`]); `Some(Err(`[`InstanceError::DisplayRefused`]`))` for a
    /// scanout the device does not have or a size it cannot show. Called from a control
    /// request thread, not under any lock of the registry.
    fn resize(
        &self,
        _uuid: &str,
        _scanout: u32,
        _width: u32,
        _height: u32,
    ) -> Option<Result<(), InstanceError>> {
        None
    }
}
