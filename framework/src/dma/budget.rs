//! The process-wide budget of fd-backed DMA maps: what the servers of one process share of
//! the kernel's per-process memory-map limit and of the SIGBUS protection table.
//!
//! # What a map costs, and the pool
//! Every fd-backed DMA mapping is one VMA of this process, and `vm.max_map_count` (65 530
//! by default) bounds the VMAs of the *whole process*: once it is reached, every `mmap`
//! fails — another instance's DMA_MAP, a thread's stack, the allocator's next large block
//! (which aborts the process). A mapping can split into two VMAs when the SIGBUS handler
//! replaces the tail of a shrunken file (`sigbus`: at most one extra VMA per mapping), so
//! a map is counted as **2 VMAs**; it also takes one of the 65 536 slots of the SIGBUS
//! table. The pool's capacity, in maps, is therefore
//!
//! `min((max_map_count − reserve) / 2, SIGBUS slots)`, with
//! `reserve = min(max(max_map_count / 4, 8192), max_map_count / 2)`:
//!
//! a quarter of the limit (16 382 of 65 530), at least 8 192, is left for the rest of the
//! process: two VMAs per thread (stack and guard page; a daemon with 1 024 instances runs
//! about 3 000 threads), the allocator's arenas, the loaded libraries, eventfds' and
//! memfds' maps of the devices (a BAR's shared memory). With the default limit the pool is
//! 24 574 maps. A host that raises `vm.max_map_count` raises the pool, up to the SIGBUS
//! table's 65 536. Not counted: the VMAs `mlock` splits off under [`super::PinPolicy::Lock`]
//! (bounded by the locked-memory limit, one per locked run).
//!
//! # Shares: a guarantee and a cap per DMA space
//! Each [`super::DmaSpace`] (one per server, one per daemon instance) is an account of the
//! pool with a **guarantee** `g` (maps it can always get: reserved in the pool when the
//! space is created, whether it maps anything or not) and a **cap** `c` (most maps it may
//! hold). A space holding `u` maps takes `max(u, g)` of the pool; the sum over all spaces
//! never exceeds the capacity. So a client may map beyond its guarantee only into what is
//! neither held by others nor guaranteed to them: one client can exhaust neither the
//! process's VMAs nor another instance's guarantee. The defaults: `g` = 64 maps
//! ([`DEFAULT_MAP_GUARANTEE`]; QEMU without a vIOMMU maps a guest's RAM in a handful of
//! sections), lowered by the instance registry to capacity / `max_instances` so every
//! instance it may create gets its whole guarantee; `c` = the whole pool. A space created
//! when the pool cannot give its whole guarantee gets what is left (logged).
//!
//! A map refused by the budget fails with **ENOMEM** — what `mmap` itself answers when
//! the process is out of map count — before anything is mapped; ENOSPC stays the answer
//! to the client's own negotiated limits (`max_dma_maps`, mapped bytes). Fd-less maps cost
//! no VMA and are not counted. A map's charge is released when its memory is unmapped (a
//! mapping replaced by scratch memory after a device leaked pins stays mapped, and
//! charged, for the life of the space).
//!
//! # Cost
//! One uncontended mutex per DMA_MAP and per unmapped map (the connection thread's map
//! path); nothing on pins, `dma_rw` or region accesses.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

/// VMAs one fd-backed map is counted as (the mapping, and the split a SIGBUS replacement
/// may add).
pub const VMAS_PER_MAP: u64 = 2;
/// Default guarantee of a DMA space, in maps.
pub const DEFAULT_MAP_GUARANTEE: u64 = 64;

/// The kernel's default `vm.max_map_count`, used when `/proc/sys/vm/max_map_count` cannot
/// be read.
const DEFAULT_MAX_MAP_COUNT: u64 = 65530;

/// A pool of fd-backed DMA maps shared by the DMA spaces of a process (module doc).
#[derive(Debug)]
pub struct MapPool {
    capacity: u64,
    /// Σ max(used, guarantee) over the accounts.
    held: Mutex<u64>,
}

/// A pool's use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    /// Its capacity in maps.
    pub capacity: u64,
    /// What the accounts take of it (maps held, or their guarantee if larger).
    pub held: u64,
}

/// Why a map was refused by the budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetRefusal {
    /// Maps the space holds.
    pub used: u64,
    /// The limit that was reached: the space's cap, or what the pool left it.
    pub limit: u64,
    /// The pool was exhausted (rather than the space's cap).
    pub pool: bool,
}

/// The pool capacity for a given `vm.max_map_count` (module doc).
pub fn capacity_for(max_map_count: u64) -> u64 {
    let reserve = (max_map_count / 4).max(8192).min(max_map_count / 2);
    ((max_map_count - reserve) / VMAS_PER_MAP).min(super::sigbus::SLOTS as u64)
}

impl MapPool {
    /// A pool of `capacity` maps (tests; an embedding application that budgets on its own).
    /// A process should have one pool: spaces of different pools do not see each other.
    pub fn with_capacity(capacity: u64) -> Arc<MapPool> {
        Arc::new(MapPool {
            capacity,
            held: Mutex::new(0),
        })
    }

    /// The process's pool, sized from `/proc/sys/vm/max_map_count` when first used.
    pub fn process() -> Arc<MapPool> {
        static POOL: OnceLock<Arc<MapPool>> = OnceLock::new();
        POOL.get_or_init(|| {
            let count = std::fs::read_to_string("/proc/sys/vm/max_map_count")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .unwrap_or(DEFAULT_MAX_MAP_COUNT);
            let capacity = capacity_for(count);
            tracing::debug!(
                max_map_count = count,
                capacity,
                "process budget of fd-backed DMA maps"
            );
            MapPool::with_capacity(capacity)
        })
        .clone()
    }

    /// Capacity in maps.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Its use now.
    pub fn usage(&self) -> PoolUsage {
        PoolUsage {
            capacity: self.capacity,
            held: *self.lock(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, u64> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One DMA space's account in a pool.
#[derive(Debug)]
pub(crate) struct MapAccount {
    pool: Arc<MapPool>,
    /// What it was given of its guarantee.
    guarantee: u64,
    cap: u64,
    /// Maps held (changed under the pool's lock).
    used: AtomicU64,
}

impl MapAccount {
    /// Join `pool` with `guarantee` (reserved now, as much as the pool has left) and `cap`.
    pub(crate) fn join(pool: Arc<MapPool>, guarantee: u64, cap: u64) -> Arc<MapAccount> {
        let given = {
            let mut held = pool.lock();
            let given = guarantee.min(pool.capacity.saturating_sub(*held));
            *held += given;
            given
        };
        if given < guarantee {
            tracing::warn!(
                guarantee,
                given,
                capacity = pool.capacity,
                "the process's budget of fd-backed DMA maps cannot give this DMA space its \
                 whole guarantee (raise vm.max_map_count, or serve fewer instances)"
            );
        }
        Arc::new(MapAccount {
            pool,
            guarantee: given,
            cap,
            used: AtomicU64::new(0),
        })
    }

    /// What it was given of its guarantee.
    pub(crate) fn guarantee(&self) -> u64 {
        self.guarantee
    }

    /// Its cap.
    pub(crate) fn cap(&self) -> u64 {
        self.cap
    }

    /// Maps held.
    pub(crate) fn used(&self) -> u64 {
        self.used.load(Relaxed)
    }

    /// Take one map, before it is mapped.
    pub(crate) fn charge(self: &Arc<Self>) -> Result<MapCharge, BudgetRefusal> {
        let mut held = self.pool.lock();
        let used = self.used.load(Relaxed);
        if used >= self.cap {
            return Err(BudgetRefusal {
                used,
                limit: self.cap,
                pool: false,
            });
        }
        // Beyond the guarantee, one more map takes one more of the pool.
        let more = u64::from(used >= self.guarantee);
        if *held + more > self.pool.capacity {
            return Err(BudgetRefusal {
                used,
                limit: used,
                pool: true,
            });
        }
        *held += more;
        self.used.store(used + 1, Relaxed);
        Ok(MapCharge(self.clone()))
    }
}

impl Drop for MapAccount {
    fn drop(&mut self) {
        // No charge is left (each holds the account): give the guarantee back.
        let mut held = self.pool.lock();
        *held = held.saturating_sub(self.guarantee.max(self.used.load(Relaxed)));
    }
}

/// One map's share of the pool; released on drop.
#[derive(Debug)]
pub(crate) struct MapCharge(Arc<MapAccount>);

impl Drop for MapCharge {
    fn drop(&mut self) {
        let a = &self.0;
        let mut held = a.pool.lock();
        let used = a.used.load(Relaxed);
        if used > a.guarantee {
            *held = held.saturating_sub(1);
        }
        a.used.store(used.saturating_sub(1), Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_capacity_default_max_map_count_leaves_quarter_reserve() {
        assert_eq!(capacity_for(65530), (65530 - 16382) / 2);
        // A small limit keeps half for the process; a huge one is bounded by the SIGBUS table.
        assert_eq!(capacity_for(10000), (10000 - 5000) / 2);
        assert_eq!(capacity_for(1 << 24), super::super::sigbus::SLOTS as u64);
        assert_eq!(capacity_for(0), 0);
    }

    #[test]
    fn test_budget_attacker_beyond_share_refused_victim_guarantee_kept() {
        let pool = MapPool::with_capacity(100);
        let victim = MapAccount::join(pool.clone(), 10, 100);
        let attacker = MapAccount::join(pool.clone(), 10, 100);
        let mut held = Vec::new();
        while let Ok(c) = attacker.charge() {
            held.push(c);
        }
        // The attacker got everything but the victim's guarantee.
        assert_eq!(held.len(), 90);
        assert_eq!(
            attacker.charge().unwrap_err(),
            BudgetRefusal {
                used: 90,
                limit: 90,
                pool: true
            }
        );
        let v: Vec<_> = (0..10).map(|_| victim.charge().unwrap()).collect();
        assert!(victim.charge().unwrap_err().pool);
        assert_eq!(pool.usage().held, 100);
        // Released: the victim may borrow what the attacker gave back.
        held.truncate(80);
        assert!(victim.charge().is_ok());
        drop((v, held));
        assert_eq!(pool.usage().held, 20);
        drop((victim, attacker));
        assert_eq!(pool.usage().held, 0);
    }

    #[test]
    fn test_budget_cap_refuses_before_pool() {
        let pool = MapPool::with_capacity(100);
        let a = MapAccount::join(pool.clone(), 2, 5);
        let held: Vec<_> = (0..5).map(|_| a.charge().unwrap()).collect();
        assert_eq!(
            a.charge().unwrap_err(),
            BudgetRefusal {
                used: 5,
                limit: 5,
                pool: false
            }
        );
        assert_eq!(pool.usage().held, 5);
        drop(held);
        assert_eq!(pool.usage().held, 2);
        assert_eq!(a.used(), 0);
    }

    #[test]
    fn test_budget_join_full_pool_gets_what_is_left() {
        let pool = MapPool::with_capacity(10);
        let a = MapAccount::join(pool.clone(), 8, 10);
        let b = MapAccount::join(pool.clone(), 8, 10);
        assert_eq!((a.guarantee, b.guarantee), (8, 2));
        let c: Vec<_> = (0..2).map(|_| b.charge().unwrap()).collect();
        assert!(b.charge().unwrap_err().pool);
        drop((c, a, b));
        assert_eq!(pool.usage().held, 0);
    }
}
