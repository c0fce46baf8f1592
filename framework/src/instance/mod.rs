//! Parents, types and instances: the mdev model above [`crate::server`].
//!
//! In the kernel's mdev stack a *parent* (a physical GPU, a channel subsystem) registers
//! *types*; each type says how many more instances the parent can give
//! (`available_instances`, derived from what is left of the parent's resources); an admin
//! creates an instance of a type by UUID and removes it. umdev follows the same model:
//!
//! - a [`Parent`] declares the [`Resource`]s it shares among its instances (a framebuffer
//!   pool in MiB, a number of image slots, ...) and the [`InstanceType`]s it offers, each
//!   with what one instance of it takes ([`InstanceType::needs`]);
//! - the [`Registry`] keeps the live instances by UUID; availability is computed from the
//!   parent's totals minus what the live instances' types take, never kept in a counter of
//!   its own that could drift;
//! - an instance is a device built by [`Parent::create`] plus everything a device has when
//!   served alone: its own socket, [`crate::dma::DmaSpace`], server threads and reconnects.
//!   Removing an instance that a client holds asks the client to let go through the
//!   device-request IRQ, as VFIO does (see [`Registry`]'s module docs, and
//!   `protocol-docs/lifecycle.md`).
//!
//! Nothing below this module learns that instances exist: `server`, `dma`, `pci` and
//! `device` serve one device each, as before.
//!
//! The smallest parent: up to four register devices, one slot each.
//!
//! ```
//! use std::sync::Arc;
//! use umdev::device::Device;
//! use umdev::instance::{
//!     CreateRequest, InstanceError, InstanceType, Params, Parent, Registry, RegistryConfig,
//!     Resource,
//! };
//! use umdev::testing::{DeviceAccess, TrivialDevice, Vmm};
//!
//! struct Regs;
//!
//! impl Parent for Regs {
//!     fn name(&self) -> &str {
//!         "regs"
//!     }
//!     fn resources(&self) -> Vec<Resource> {
//!         vec![Resource { name: "slots".into(), unit: "slots".into(), total: 4 }]
//!     }
//!     fn types(&self) -> Vec<InstanceType> {
//!         let needs = vec![("slots".into(), 1)];
//!         let t = InstanceType { name: "regs".into(), description: "registers".into(), device_api: "vfio-pci".into(), needs };
//!         vec![t]
//!     }
//!     fn create(&self, _req: CreateRequest<'_>) -> Result<Box<dyn Device>, InstanceError> {
//!         Ok(Box::new(TrivialDevice::default()))
//!     }
//! }
//!
//! let dir = tempfile::tempdir()?;
//! let registry = Registry::new(RegistryConfig::new(dir.path()))?;
//! registry.add_parent(Arc::new(Regs))?;
//! let inst = registry.create("regs", None, &Params::new())?; // or "regs/regs"; a v4 UUID
//! assert_eq!(registry.types()[0].available_instances, 3);
//!
//! let mut vmm = Vmm::connect(&inst.socket)?; // what QEMU does with the socket
//! assert_eq!(vmm.read8(0, 0x10)?, 0x10);
//! drop(vmm);
//!
//! registry.remove(&inst.uuid, false)?;
//! assert_eq!(registry.types()[0].available_instances, 4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod availability;
mod info;
mod parent;
pub mod registry;

pub use info::{InstanceInfo, RemovalReport, ResourceUsage, TypeInfo};
pub use parent::{
    CreateRequest, InstanceError, InstanceType, Params, Parent, Resource, Screenshot,
};
pub use registry::{Registry, RegistryConfig, INSTANCES_RESOURCE};
