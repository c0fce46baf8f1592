//! Library side of the `umdev` command: termination-signal handling shared by `umdev run`
//! and the `hello` example. (The embedded VMM that `umdev demo`, the example and the tests
//! drive devices with is `umdev::testing::Vmm`.)
#![deny(missing_docs)]

pub mod signals;
