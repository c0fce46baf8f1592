//! The vfio-user server engine: sockets, connection loop, fd passing, server→client requests.
//!
//! SKELETON — being written.
