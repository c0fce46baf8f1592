//! Library side of the `umdev` command: the embedded VMM used by `umdev demo`, the
//! `hello` example and the end-to-end tests.
#![deny(missing_docs)]

pub mod signals;
pub mod vmm;
