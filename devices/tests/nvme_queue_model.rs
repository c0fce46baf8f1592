//! NVMe queues against a reference model: random sequences of writes and reads on two I/O
//! queue pairs of random sizes, doorbells rung at random points, completions reaped at
//! random points, with the doorbell registers or with shadow doorbells. The model is a plain byte array for the disk and, per queue, the list of
//! commands submitted and not yet reaped. Every command must complete exactly once (in any
//! order: the I/O pool overlaps a queue's commands), with success, and every read must
//! return the model's bytes (the driver first waits for an overlapping write, as a file
//! system does); at the end the image equals the model and nothing stays pinned.

mod nvme_support;

use std::collections::VecDeque;

use nvme_support::*;
use proptest::prelude::*;
use umdev_devices::nvme::spec::Status;

/// Blocks of each queue's private region (queues write disjoint regions, so the order
/// between queues does not matter).
const REGION: u64 = 32;

#[derive(Clone, Debug)]
enum Op {
    Write {
        q: u16,
        lba: u64,
        nlb: u32,
        seed: u64,
    },
    Read {
        q: u16,
        lba: u64,
        nlb: u32,
    },
    Kick {
        q: u16,
    },
    Reap {
        q: u16,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let q = 1u16..=2;
    prop_oneof![
        (q.clone(), 0..REGION, 1u32..=16, any::<u64>()).prop_map(|(q, lba, nlb, seed)| Op::Write {
            q,
            lba,
            nlb,
            seed
        }),
        (q.clone(), 0..REGION, 1u32..=16).prop_map(|(q, lba, nlb)| Op::Read { q, lba, nlb }),
        q.clone().prop_map(|q| Op::Kick { q }),
        q.prop_map(|q| Op::Reap { q }),
    ]
}

/// A command in flight, as the model sees it.
struct Flight {
    cid: u16,
    /// Blocks it covers.
    blocks: std::ops::Range<u64>,
    write: bool,
    /// For reads: the guest buffer and the bytes it must hold.
    read: Option<(u64, Vec<u8>)>,
}

#[derive(Default)]
struct QueueModel {
    size: u32,
    /// Submitted (maybe not yet rung), oldest first.
    flights: VecDeque<Flight>,
    /// How many of `flights` the doorbell has announced.
    rung: usize,
}

fn buffer(q: u16, sq_index: u32) -> u64 {
    DATA + u64::from(q) * 0x10_0000 + u64::from(sq_index) * 0x2000
}

/// Reap every rung command of queue `q`: each completes exactly once, in any order (the
/// I/O pool overlaps a queue's commands), with success; reads hold the model's bytes.
fn reap_all(g: &mut Guest, models: &mut [QueueModel; 3], q: u16) {
    let m = &mut models[q as usize];
    let mut rung: Vec<Flight> = m.flights.drain(..m.rung).collect();
    m.rung = 0;
    while !rung.is_empty() {
        let c = g.reap(q);
        let Some(i) = rung.iter().position(|f| f.cid == c.cid) else {
            panic!(
                "queue {q}: completion of cid {} not in flight (or twice)",
                c.cid
            );
        };
        let f = rung.swap_remove(i);
        assert_eq!(c.status, Status::SUCCESS);
        assert_eq!(c.sq_id, q);
        assert!(u32::from(c.sq_head) < m.size, "SQ head {}", c.sq_head);
        if let Some((buf, want)) = f.read {
            assert_eq!(g.mem_read(buf, want.len()), want, "queue {q}: read data");
        }
    }
}

fn kick(g: &mut Guest, models: &mut [QueueModel; 3], q: u16) {
    g.kick(q);
    models[q as usize].rung = models[q as usize].flights.len();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn test_queues_match_reference_model(sizes in (2u32..=12, 2u32..=12), shadow in any::<bool>(), pool in any::<bool>(), ops in proptest::collection::vec(op(), 1..80)) {
        // I/O in the pool (overlapping, out of order) or on the queue workers (in order).
        let mut g = Guest::with(|c| c.io_threads = if pool { 4 } else { 0 }, false);
        g.enable();
        assert!(g.set_queues(2).status.is_success());
        g.create_pair(1, sizes.0);
        g.create_pair(2, sizes.1);
        if shadow {
            // Shadow doorbells, configured after the queues exist as Linux does.
            assert_eq!(g.config_dbbuf(RAM + 0xa_0000, RAM + 0xa_1000), Status::SUCCESS);
        }
        let mut disk = vec![0u8; (3 * REGION * 512) as usize];
        let mut models: [QueueModel; 3] = Default::default();
        models[1].size = sizes.0;
        models[2].size = sizes.1;
        for op in ops {
            let q = match op { Op::Write { q, .. } | Op::Read { q, .. } | Op::Kick { q } | Op::Reap { q } => q };
            match op {
                Op::Kick { .. } => kick(&mut g, &mut models, q),
                Op::Reap { .. } => reap_all(&mut g, &mut models, q),
                Op::Write { .. } | Op::Read { .. } => {
                    let m = &models[q as usize];
                    if m.flights.len() as u32 + 1 >= m.size {
                        // The SQ is full from the driver's side: make room first.
                        kick(&mut g, &mut models, q);
                        reap_all(&mut g, &mut models, q);
                    }
                    let (write, lba, nlb, seed) = match op {
                        Op::Write { lba, nlb, seed, .. } => (true, lba, nlb, seed),
                        Op::Read { lba, nlb, .. } => (false, lba, nlb, 0),
                        _ => unreachable!(),
                    };
                    let nlb = nlb.min((REGION - lba) as u32);
                    let slba = u64::from(q) * REGION + lba;
                    let blocks = slba..slba + u64::from(nlb);
                    // NVMe orders nothing between commands in flight: like a file system,
                    // wait for an overlapping write before reading or rewriting its blocks.
                    let overlaps = models[q as usize].flights.iter().any(|f| {
                        (f.write || write) && f.blocks.start < blocks.end && blocks.start < f.blocks.end
                    });
                    if overlaps {
                        kick(&mut g, &mut models, q);
                        reap_all(&mut g, &mut models, q);
                    }
                    let sq_index = g.queues.iter().find(|x| x.qid == q).unwrap().tail;
                    let buf = buffer(q, sq_index);
                    let len = nlb as usize * 512;
                    let at = slba as usize * 512;
                    let (p1, p2) = if len > 4096 { (buf, buf + 4096) } else { (buf, 0) };
                    let read = if write {
                        let data = pattern(seed, len);
                        g.mem_write(buf, &data);
                        disk[at..at + len].copy_from_slice(&data);
                        None
                    } else {
                        g.mem_write(buf, &vec![0xee; len]);
                        Some((buf, disk[at..at + len].to_vec()))
                    };
                    let cid = g.push(q, Guest::rw(write, slba, nlb, p1, p2));
                    models[q as usize].flights.push_back(Flight { cid, blocks, write, read });
                }
            }
        }
        for q in 1..=2 {
            kick(&mut g, &mut models, q);
            reap_all(&mut g, &mut models, q);
        }
        let start = REGION as usize * 512;
        prop_assert_eq!(image_bytes(&g.image, start as u64, 2 * start).unwrap(), disk[start..].to_vec());
        prop_assert_eq!(g.pins().0, 0);
        g.assert_no_panics();
    }
}
