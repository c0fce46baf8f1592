//! Example umdev devices: a gvt-style GPU and a ccw-style channel block device.
#![deny(missing_docs)]

pub mod ccw;
pub mod gpu;
#[cfg(feature = "testing")]
pub mod testing;
