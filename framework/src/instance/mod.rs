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
//! - the registry (in this module) keeps the live instances by UUID; availability is
//!   computed from the parent's totals minus what the live instances' types take, never
//!   kept in a counter of its own that could drift;
//! - an instance is a device built by [`Parent::create`] plus everything a device has when
//!   served alone: its own socket, [`crate::dma::DmaSpace`], server threads and reconnects.
//!
//! Nothing below this module learns that instances exist: `server`, `dma`, `pci` and
//! `device` serve one device each, as before.

mod parent;

pub use parent::{CreateRequest, InstanceError, InstanceType, Params, Parent, Resource};
