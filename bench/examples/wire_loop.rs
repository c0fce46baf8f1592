//! A fixed number of 4-byte REGION_READ (or REGION_WRITE) round trips against umdev's server
//! or the `vfio_user` crate's, in this process, for instruction counts under callgrind:
//!
//! ```text
//! cargo build --release -p umdev-bench --example wire_loop
//! valgrind --tool=callgrind --separate-threads=yes \
//!     target/release/examples/wire_loop umdev read 20000 off
//! ```
//!
//! The optional last argument is umdev's `--poll` mode (default: the server's default).
//!
//! The server's connection thread gets a `callgrind.out.PID-TID` file of its own; the
//! difference of its total `Ir` between two message counts, divided by the difference of
//! the counts, is the server's user-space instructions per message (setup cancels out).

use std::time::Instant;

use umdev::server::PollMode;
use umdev_bench::wire::{client, spawn_umdev, spawn_umdev_with, spawn_vfio_user, stop_umdev};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: wire_loop umdev|vfio-user|connect:PATH read|write N [off|auto|<N>us]";
    let (server, op, n, poll) = match args.as_slice() {
        [_, s, o, n] => (s.as_str(), o.as_str(), n.parse::<u64>().expect(usage), None),
        [_, s, o, n, p] => (
            s.as_str(),
            o.as_str(),
            n.parse::<u64>().expect(usage),
            Some(p.parse::<PollMode>().expect(usage)),
        ),
        _ => panic!("{usage}"),
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let mut path = dir.path().join("s.sock");
    let (umdev, vfio) = match server {
        "umdev" => {
            let s = match poll {
                Some(p) => spawn_umdev_with(&path, p),
                None => spawn_umdev(&path),
            };
            (Some(s.expect("umdev server")), None)
        }
        "vfio-user" => (
            None,
            Some(spawn_vfio_user(&path, 1).expect("vfio_user server")),
        ),
        other => match other.strip_prefix("connect:") {
            // A server already listening there (e.g. `umdev run gpu --socket PATH` under
            // callgrind): region 0, offset 0 is the GPU's ID register.
            Some(p) => {
                path = p.into();
                (None, None)
            }
            None => panic!("{usage}"),
        },
    };
    let mut c = client(&path).expect("connect");
    let mut buf = [0u8; 4];
    let start = Instant::now();
    for _ in 0..n {
        match op {
            "read" => c.region_read(0, 0, &mut buf).expect("REGION_READ"),
            "write" => c.region_write(0, 0, &[1, 2, 3, 4]).expect("REGION_WRITE"),
            _ => panic!("{usage}"),
        }
    }
    let el = start.elapsed();
    let _ = c.shutdown();
    drop(c);
    if let Some(u) = umdev {
        stop_umdev(u);
    }
    if let Some(v) = vfio {
        let _ = v.join();
    }
    eprintln!(
        "{n} {op}s in {:.3} s: {:.2} µs each",
        el.as_secs_f64(),
        el.as_secs_f64() * 1e6 / n.max(1) as f64
    );
}
