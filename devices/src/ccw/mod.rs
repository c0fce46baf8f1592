//! ccw-style channel block device (being written).
