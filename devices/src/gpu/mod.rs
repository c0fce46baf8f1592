//! gvt-style GPU (being written).
