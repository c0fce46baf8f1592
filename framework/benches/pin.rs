//! Pin benchmarks (being written).
fn main() {}
