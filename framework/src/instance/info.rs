//! What the registry reports: types with their availability, resources with their use,
//! instances, and what a removal did. Plain data, built fresh on every query.

use std::path::PathBuf;
use std::time::Duration;

use crate::dma::DmaStats;
use crate::server::BacklogUsage;

use super::{InstanceType, Params, Resource};

/// A type as `umdev types` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypeInfo {
    /// The parent that offers it.
    pub parent: String,
    /// The type's declaration.
    pub instance_type: InstanceType,
    /// How many more instances of it can be created now: what is left of each resource
    /// it needs divided by what one instance needs (the smallest of these), and no more
    /// than the registry's instance limit leaves.
    pub available_instances: u64,
}

/// One resource of a parent and how much of it the parent's instances take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceUsage {
    /// The parent.
    pub parent: String,
    /// The resource with its total.
    pub resource: Resource,
    /// What the parent's instances (live and being created) take of it.
    pub used: u64,
}

/// One instance as `umdev list` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceInfo {
    /// UUID (canonical lowercase hyphenated form).
    pub uuid: String,
    /// Parent name.
    pub parent: String,
    /// Type name (within the parent).
    pub type_name: String,
    /// Parameters it was created with.
    pub params: Params,
    /// The socket a VMM connects to.
    pub socket: PathBuf,
    /// True while a client is connected (until its teardown has finished).
    pub client_attached: bool,
    /// The instance's DMA space counters.
    pub dma: DmaStats,
    /// Its share of the process's budget of fd-backed maps: (guarantee, cap), in maps
    /// (`dma.fd_maps` is what it holds).
    pub map_share: (u64, u64),
    /// What its client's connection holds in the command backlog.
    pub backlog: BacklogUsage,
}

/// What [`super::Registry::remove`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemovalReport {
    /// The instance removed.
    pub uuid: String,
    /// A client was attached when the removal started.
    pub client_was_attached: bool,
    /// The device-request IRQ was signalled (the client had attached an eventfd to it).
    pub release_requested: bool,
    /// How long the removal waited for the client to let go.
    pub waited: Duration,
    /// The client did not let go in time and was disconnected (removal with `force`).
    pub forced: bool,
    /// The DMA space's counters after the server's teardown: `pinned_pages` and
    /// `locked_pages` are 0; `leaked_pins_released` counts the pins the device had not
    /// dropped in its unmap notifier.
    pub dma: DmaStats,
}
