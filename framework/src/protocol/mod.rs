//! vfio-user wire types: encode/decode with validation. No I/O here.
//!
//! SKELETON — being written.
