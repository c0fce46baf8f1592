//! Whose command the render engine executes next: **stride scheduling** (Waldspurger and
//! Weihl, "Stride Scheduling: Deterministic Proportional-Share Resource Management", MIT
//! TM-528, 1995), with non-unit quanta and the global-pass rule for clients that join.
//!
//! Each client (one GPU instance on the engine) has a *weight* `w` (its tickets) and a
//! *stride* `STRIDE1 / w`; the scheduler keeps a *pass* per client and a *virtual time*
//! `vtime`. The engine runs one unit at a time (one ring command of one instance, never
//! preempted; the engine thread runs a quantum of up to 16 commands of one instance as one
//! unit, engine.rs "Quantum", and the bounds below then hold with that quantum for a unit)
//! and charges the client for what the unit cost (`cost`, in work units: see
//! `execute.rs`):
//!
//! - [`StrideScheduler::pick`] takes the ready client with the smallest `(pass, seq)` and
//!   sets `vtime` to its pass; `seq` is the order in which clients became ready, so equal
//!   passes are served first come, first served.
//! - [`StrideScheduler::charge`] advances the client's pass by `cost × stride`: a unit that
//!   did twice the work moves the client twice as far (the "fraction of a quantum" rule of
//!   the paper, with the quantum being whatever one command costs).
//! - [`StrideScheduler::ready`] puts a client (back) in the ready set with
//!   `pass = max(pass, vtime)`: a client that was idle re-enters at the virtual time, so it
//!   cannot bank credit while idle (no burst that starves the others when it returns) and it
//!   loses none either (it is not behind the others when it returns).
//!
//! # Invariants
//!
//! 1. Every client in the ready set has `pass ≥ vtime`, and `vtime` never decreases (it is
//!    the pass of the client picked last, the minimum of the ready set at that moment;
//!    `ready` never inserts below it, `charge` only increases).
//! 2. **Proportional share**: between two moments at which clients `i` and `j` were both
//!    continuously ready, `|work_i / w_i − work_j / w_j| ≤ C_max · (1/w_i + 1/w_j)`, where
//!    `C_max` is the largest cost of one unit: each pass is within one unit's charge of
//!    every other ready pass, and a pass is the client's work divided by its weight (times
//!    `STRIDE1`).
//! 3. **Wake-up latency**: a client that was idle (its pass at most `vtime`) and becomes
//!    ready while `n` other clients have work is picked after at most `n` units of theirs,
//!    the one executing at that moment included: it enters at `vtime`, no ready pass is
//!    smaller, the client that was executing leaves its unit with a pass above `vtime`,
//!    and each other client tied at `vtime` (with an older `seq`) runs once before it.
//!    What the others have queued does not matter, which is the point: under FIFO an idle
//!    instance's FENCE would wait for every command the flooding instances published
//!    before it.
//! 4. A client is in the ready set at most once (the engine also never has it there while
//!    it executes one of its units: `pick` removes it, `ready` puts it back).
//!
//! Integer arithmetic: `STRIDE1 = 2^20`, weights are `1..=MAX_WEIGHT = 2^16` (so strides
//! are ≥ 16 and exact for power-of-two weights), costs are `u64`, passes `u128`: a pass
//! advances by at most `2^64 · 2^20` per unit, so it cannot overflow in any realistic
//! lifetime (2^44 units of the largest possible cost).

use std::collections::{BTreeMap, BTreeSet};

/// The stride of weight 1.
pub const STRIDE1: u128 = 1 << 20;
/// The largest weight (weights are clamped to `1..=MAX_WEIGHT`).
pub const MAX_WEIGHT: u32 = 1 << 16;

/// A client of the scheduler (the engine's lane id).
pub type ClientId = u64;

#[derive(Debug)]
struct Client {
    stride: u128,
    pass: u128,
    /// The key under which the client sits in the ready set.
    ready_key: Option<(u128, u64)>,
}

/// The stride scheduler (see the module doc).
#[derive(Debug, Default)]
pub struct StrideScheduler {
    clients: BTreeMap<ClientId, Client>,
    ready: BTreeSet<(u128, u64, ClientId)>,
    vtime: u128,
    seq: u64,
}

impl StrideScheduler {
    /// An empty scheduler.
    pub fn new() -> StrideScheduler {
        StrideScheduler::default()
    }

    /// Add client `id` with `weight` (clamped to `1..=MAX_WEIGHT`), not ready. Its pass
    /// starts at the virtual time: a new client neither owes nor is owed anything.
    pub fn add(&mut self, id: ClientId, weight: u32) {
        let weight = weight.clamp(1, MAX_WEIGHT);
        self.remove(id);
        self.clients.insert(
            id,
            Client {
                stride: STRIDE1 / u128::from(weight),
                pass: self.vtime,
                ready_key: None,
            },
        );
    }

    /// Forget client `id` (also takes it out of the ready set).
    pub fn remove(&mut self, id: ClientId) {
        self.unready(id);
        self.clients.remove(&id);
    }

    /// Client `id` has work: put it in the ready set (no-op if it is there already, or
    /// unknown), at `max(pass, vtime)`.
    pub fn ready(&mut self, id: ClientId) {
        let Some(c) = self.clients.get_mut(&id) else {
            return;
        };
        if c.ready_key.is_some() {
            return;
        }
        c.pass = c.pass.max(self.vtime);
        self.seq += 1;
        let key = (c.pass, self.seq);
        c.ready_key = Some(key);
        self.ready.insert((key.0, key.1, id));
    }

    /// Take client `id` out of the ready set (it keeps its pass).
    pub fn unready(&mut self, id: ClientId) {
        if let Some(c) = self.clients.get_mut(&id) {
            if let Some((pass, seq)) = c.ready_key.take() {
                self.ready.remove(&(pass, seq, id));
            }
        }
    }

    /// The ready client with the smallest pass, taken out of the ready set; `None` if no
    /// client is ready.
    pub fn pick(&mut self) -> Option<ClientId> {
        let (pass, _, id) = self.ready.pop_first()?;
        if let Some(c) = self.clients.get_mut(&id) {
            c.ready_key = None;
        }
        self.vtime = self.vtime.max(pass);
        Some(id)
    }

    /// True if client `id` is ready with the smallest pass of the ready set: [`pick`] takes
    /// it next, or, tied with clients that became ready before it, after them without any
    /// pass advancing in between. [`take`] may then take it out of turn.
    ///
    /// [`pick`]: Self::pick
    /// [`take`]: Self::take
    pub fn at_front(&self, id: ClientId) -> bool {
        let Some((pass, _)) = self.clients.get(&id).and_then(|c| c.ready_key) else {
            return false;
        };
        self.ready.first().is_some_and(|&(min, _, _)| min == pass)
    }

    /// Take client `id` out of the ready set as [`pick`](Self::pick) would (`vtime` moves
    /// to its pass). `false` if it is not ready.
    pub fn take(&mut self, id: ClientId) -> bool {
        let Some(c) = self.clients.get_mut(&id) else {
            return false;
        };
        let Some((pass, seq)) = c.ready_key.take() else {
            return false;
        };
        self.ready.remove(&(pass, seq, id));
        self.vtime = self.vtime.max(pass);
        true
    }

    /// Charge client `id` for a unit that cost `cost` work units.
    pub fn charge(&mut self, id: ClientId, cost: u64) {
        if let Some(c) = self.clients.get_mut(&id) {
            debug_assert!(c.ready_key.is_none(), "charging a client in the ready set");
            c.pass = c
                .pass
                .saturating_add(u128::from(cost).saturating_mul(c.stride));
        }
    }

    /// Number of ready clients.
    pub fn ready_len(&self) -> usize {
        self.ready.len()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, VecDeque};

    use super::*;

    /// What the engine needs from a scheduling policy; lets the same scenarios run against
    /// a FIFO reference, so that each check below is shown to tell the two apart.
    trait Policy {
        fn add(&mut self, id: ClientId, weight: u32);
        fn ready(&mut self, id: ClientId);
        fn pick(&mut self) -> Option<ClientId>;
        fn charge(&mut self, id: ClientId, cost: u64);
    }

    impl Policy for StrideScheduler {
        fn add(&mut self, id: ClientId, weight: u32) {
            StrideScheduler::add(self, id, weight)
        }
        fn ready(&mut self, id: ClientId) {
            StrideScheduler::ready(self, id)
        }
        fn pick(&mut self) -> Option<ClientId> {
            StrideScheduler::pick(self)
        }
        fn charge(&mut self, id: ClientId, cost: u64) {
            StrideScheduler::charge(self, id, cost)
        }
    }

    /// First come, first served: a client keeps the engine until its backlog is empty
    /// (what an engine that serves the rings in doorbell order does).
    #[derive(Default)]
    struct Fifo {
        order: VecDeque<ClientId>,
        running: Option<ClientId>,
    }

    impl Policy for Fifo {
        fn add(&mut self, _id: ClientId, _weight: u32) {}
        fn ready(&mut self, id: ClientId) {
            if self.running == Some(id) {
                // Still backlogged after its unit: it keeps its place at the front.
                self.order.push_front(id);
                self.running = None;
            } else if !self.order.contains(&id) {
                self.order.push_back(id);
            }
        }
        fn pick(&mut self) -> Option<ClientId> {
            self.running = self.order.pop_front();
            self.running
        }
        fn charge(&mut self, _id: ClientId, _cost: u64) {}
    }

    /// A simulated engine: each client has a backlog of unit costs.
    struct Sim<P> {
        policy: P,
        backlog: BTreeMap<ClientId, VecDeque<u64>>,
        work: BTreeMap<ClientId, u64>,
        units: u64,
    }

    impl<P: Policy> Sim<P> {
        fn new(policy: P, clients: &[(ClientId, u32)]) -> Sim<P> {
            let mut sim = Sim {
                policy,
                backlog: BTreeMap::new(),
                work: BTreeMap::new(),
                units: 0,
            };
            for &(id, w) in clients {
                sim.policy.add(id, w);
                sim.backlog.insert(id, VecDeque::new());
                sim.work.insert(id, 0);
            }
            sim
        }

        fn submit(&mut self, id: ClientId, costs: impl IntoIterator<Item = u64>) {
            let q = self.backlog.get_mut(&id).unwrap();
            let was_idle = q.is_empty();
            q.extend(costs);
            if was_idle {
                self.policy.ready(id);
            }
        }

        /// Run one unit; the client that ran.
        fn step(&mut self) -> Option<ClientId> {
            let id = self.policy.pick()?;
            let cost = self.backlog.get_mut(&id).unwrap().pop_front().unwrap();
            self.policy.charge(id, cost);
            *self.work.get_mut(&id).unwrap() += cost;
            self.units += 1;
            if !self.backlog[&id].is_empty() {
                self.policy.ready(id);
            }
            Some(id)
        }
    }

    /// Largest relative error of the work shares against the weights.
    fn share_error(work: &BTreeMap<ClientId, u64>, weights: &[(ClientId, u32)]) -> f64 {
        let total_w: u32 = weights.iter().map(|&(_, w)| w).sum();
        let total: u64 = work.values().sum();
        weights
            .iter()
            .map(|&(id, w)| {
                let expected = total as f64 * f64::from(w) / f64::from(total_w);
                (work[&id] as f64 - expected).abs() / expected
            })
            .fold(0.0, f64::max)
    }

    const WEIGHTS: [(ClientId, u32); 3] = [(1, 1), (2, 1), (3, 4)];

    /// Three flooders (weights 1, 1, 4) with different command costs; the work shares after
    /// `units` units (everyone still backlogged).
    fn flood<P: Policy>(policy: P, units: u64) -> f64 {
        let mut sim = Sim::new(policy, &WEIGHTS);
        sim.submit(1, std::iter::repeat_n(1_000, 100_000));
        sim.submit(2, (0..100_000).map(|i| 100 + (i % 7) * 900));
        sim.submit(3, std::iter::repeat_n(5_000, 100_000));
        for _ in 0..units {
            sim.step();
        }
        assert!(sim.backlog.values().all(|q| !q.is_empty()), "ran dry");
        share_error(&sim.work, &WEIGHTS)
    }

    #[test]
    fn test_stride_flooding_clients_get_work_in_proportion_to_weights() {
        let err = flood(StrideScheduler::new(), 20_000);
        assert!(err < 0.01, "share error {err}");
    }

    #[test]
    fn test_fifo_flooding_clients_fail_the_share_check() {
        // The same check against FIFO: it must fail, or it checks nothing.
        let err = flood(Fifo::default(), 20_000);
        assert!(err > 0.10, "FIFO passed the share check (error {err})");
    }

    /// Flooders 1..=3 are backlogged; client 4 was idle and submits one unit: the number of
    /// units of others executed before it.
    fn wake_delay<P: Policy>(policy: P) -> u64 {
        let mut clients = WEIGHTS.to_vec();
        clients.push((4, 1));
        let mut sim = Sim::new(policy, &clients);
        for id in 1..=3 {
            sim.submit(id, std::iter::repeat_n(10_000, 1_000));
        }
        for _ in 0..500 {
            sim.step();
        }
        sim.submit(4, [64]);
        let mut delay = 0;
        while sim.step() != Some(4) {
            delay += 1;
        }
        delay
    }

    #[test]
    fn test_stride_idle_client_runs_within_one_unit_per_other_client() {
        let delay = wake_delay(StrideScheduler::new());
        assert!(
            delay <= 3,
            "idle client waited {delay} units behind 3 flooders"
        );
    }

    #[test]
    fn test_fifo_idle_client_waits_for_the_flooders_backlog() {
        let delay = wake_delay(Fifo::default());
        assert!(delay > 100, "FIFO passed the wake-up check ({delay} units)");
    }

    #[test]
    fn test_stride_client_idle_for_long_banks_no_credit() {
        let clients = [(1, 1), (2, 1)];
        let mut sim = Sim::new(StrideScheduler::new(), &clients);
        sim.submit(1, std::iter::repeat_n(100, 20_000));
        for _ in 0..10_000 {
            sim.step();
        }
        // Client 2 returns after 10 000 units of client 1: from now on they alternate,
        // client 2 does not get 10 000 units in a row.
        sim.submit(2, std::iter::repeat_n(100, 20_000));
        let mut ran = BTreeMap::new();
        for _ in 0..1_000 {
            *ran.entry(sim.step().unwrap()).or_insert(0u32) += 1;
        }
        assert_eq!((ran[&1], ran[&2]), (500, 500));
    }

    #[test]
    fn test_stride_expensive_unit_is_paid_back_before_client_runs_again() {
        let clients = [(1, 1), (2, 1)];
        let mut sim = Sim::new(StrideScheduler::new(), &clients);
        sim.submit(1, [100_000, 100]);
        sim.submit(2, std::iter::repeat_n(100, 2_000));
        let order: Vec<_> = (0..1_002).filter_map(|_| sim.step()).collect();
        // After client 1's big unit, client 2 runs 1000 units (the same work) first.
        assert_eq!(order[0], 1);
        assert!(
            order[1..1001].iter().all(|&id| id == 2),
            "{:?}",
            &order[..8]
        );
        assert_eq!(order[1001], 1);
    }

    #[test]
    fn test_stride_woken_client_tied_at_the_front_is_at_front_and_take_moves_vtime() {
        let mut s = StrideScheduler::new();
        for id in 1..=3 {
            s.add(id, 1);
        }
        // 1 and 2 have equal passes (same costs); 1 is picked and charged; 2 stays ready
        // at the virtual time; 3 wakes there too, after 2.
        s.ready(1);
        s.ready(2);
        assert_eq!(s.pick(), Some(1));
        s.charge(1, 100);
        s.ready(1);
        s.ready(3);
        assert!(
            s.at_front(2) && s.at_front(3),
            "2 and 3 tie at the virtual time"
        );
        assert!(!s.at_front(1), "1 has been charged past them");
        assert!(s.take(3), "3 taken out of turn");
        assert!(!s.at_front(3) && !s.take(3), "no longer ready");
        s.charge(3, 100);
        // 2 still runs before 1 and 3, which now tie one unit later.
        assert_eq!(s.pick(), Some(2));
        s.ready(3);
        assert_eq!(s.pick(), Some(1));
        assert_eq!(s.pick(), Some(3));
        assert_eq!(s.pick(), None);
    }

    #[test]
    fn test_stride_remove_and_unready_leave_no_stale_entry() {
        let mut s = StrideScheduler::new();
        s.add(1, 1);
        s.add(2, 3);
        s.ready(1);
        s.ready(1);
        s.ready(2);
        assert_eq!(s.ready_len(), 2, "a client is ready at most once");
        s.unready(1);
        s.remove(2);
        assert_eq!((s.ready_len(), s.pick()), (0, None));
        s.ready(7);
        assert_eq!(s.pick(), None, "unknown clients are ignored");
        s.ready(1);
        assert_eq!(s.pick(), Some(1));
    }

    #[test]
    fn test_stride_weights_are_clamped() {
        let mut s = StrideScheduler::new();
        s.add(1, 0);
        s.add(2, u32::MAX);
        assert_eq!(s.clients[&1].stride, STRIDE1);
        assert_eq!(s.clients[&2].stride, STRIDE1 / u128::from(MAX_WEIGHT));
    }
}
