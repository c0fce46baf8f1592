//! Per-region pin state: one 32-bit word per 4 KiB page, in lazily allocated chunks.
//!
//! A chunk of [`CHUNK_PAGES`] words (4 KiB, covering 4 MiB) is allocated the first time one
//! of its pages is pinned; chunk slots are grouped in directories of [`DIR_CHUNKS`] slots (one
//! per 4 GiB), themselves allocated on first use. Up front a region owns only one empty
//! directory slot per 4 GiB: 16 slots for a 64 GiB mapping, 32 Ki for the largest possible
//! (128 TiB) one — a client cannot make the server allocate per-page state by mapping a huge
//! range. A page's word is found by array index (`page >> CHUNK_SHIFT` split into directory
//! and slot, `page & mask`), never by hashing.
//!
//! Word layout: bits 0..29 pin count, [`PINNED`] (page counted in the pinned-page totals),
//! [`LOCKED`] (page mlocked and counted against the limit), [`WRITABLE`] (pinned with write
//! access at least once since it was last unpinned to zero: reported dirty while pinned).
//!
//! Concurrency: every mutation happens with the space's pin lock held (like the kernel's
//! `iommu->lock` around `vfio_iommu_type1_pin_pages`), so the words are atomics only to make
//! the table `Sync` for lock-free readers (dirty report, invariant checks); `Relaxed` suffices.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::OnceLock;

/// log2 of the pages per chunk.
pub(crate) const CHUNK_SHIFT: u32 = 10;
/// Pages per chunk.
pub(crate) const CHUNK_PAGES: usize = 1 << CHUNK_SHIFT;
/// log2 of the chunk slots per directory.
const DIR_SHIFT: u32 = 10;
/// Chunk slots per directory.
pub(crate) const DIR_CHUNKS: usize = 1 << DIR_SHIFT;
/// Largest pin count of one page.
pub(crate) const COUNT_MASK: u32 = (1 << 29) - 1;
/// The page is pinned with write access (reported dirty while pinned).
pub(crate) const WRITABLE: u32 = 1 << 29;
/// The page is counted as pinned (set on 0→1, cleared when released).
pub(crate) const PINNED: u32 = 1 << 30;
/// The page is mlocked and counted against the limit.
pub(crate) const LOCKED: u32 = 1 << 31;

type Chunk = [AtomicU32; CHUNK_PAGES];
type Dir = [OnceLock<Box<Chunk>>; DIR_CHUNKS];

/// `a += x` for a counter only mutated with the pin lock held (a plain load and store: no
/// read-modify-write needed, readers just see a consistent value).
#[inline]
pub(crate) fn add_locked(a: &AtomicU64, x: u64) {
    if x != 0 {
        a.store(a.load(Relaxed).wrapping_add(x), Relaxed);
    }
}

/// `a -= x`, see [`add_locked`].
#[inline]
pub(crate) fn sub_locked(a: &AtomicU64, x: u64) {
    if x != 0 {
        a.store(a.load(Relaxed).wrapping_sub(x), Relaxed);
    }
}

/// Global page index of word `k` of chunk `ci`.
#[inline]
fn page_of(ci: usize, k: usize) -> u64 {
    ((ci as u64) << CHUNK_SHIFT) + k as u64
}

/// `[lo, hi)` split at chunk boundaries, as (chunk, first word, end word).
#[inline]
fn segments(lo: u64, hi: u64) -> impl Iterator<Item = (usize, usize, usize)> {
    let mut p = lo;
    std::iter::from_fn(move || {
        if p >= hi {
            return None;
        }
        let ci = (p >> CHUNK_SHIFT) as usize;
        let s = (p as usize) & (CHUNK_PAGES - 1);
        let chunk_base = p - s as u64;
        let e = (hi - chunk_base).min(CHUNK_PAGES as u64) as usize;
        p = chunk_base + e as u64;
        Some((ci, s, e))
    })
}

/// Pin words of one region.
pub(crate) struct PinTable {
    dirs: Box<[OnceLock<Box<Dir>>]>,
    npages: u64,
    /// Pages with [`PINNED`] set.
    pub(crate) pinned: AtomicU64,
    /// Pages with [`LOCKED`] set.
    pub(crate) locked: AtomicU64,
}

/// Outcome of a scan that releases pages whose count reached zero.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Released {
    /// Pages whose [`PINNED`] bit was cleared.
    pub(crate) pinned: u64,
    /// Pages whose [`LOCKED`] bit was cleared.
    pub(crate) locked: u64,
}

impl PinTable {
    /// An empty table for `npages` pages (allocates only the chunk slots).
    pub(crate) fn new(npages: u64) -> PinTable {
        let ndirs = npages.div_ceil((CHUNK_PAGES * DIR_CHUNKS) as u64) as usize;
        PinTable {
            dirs: (0..ndirs).map(|_| OnceLock::new()).collect(),
            npages,
            pinned: AtomicU64::new(0),
            locked: AtomicU64::new(0),
        }
    }

    /// The chunk `ci` if allocated.
    #[inline]
    fn chunk(&self, ci: usize) -> Option<&Chunk> {
        let dir = self.dirs.get(ci >> DIR_SHIFT)?.get()?;
        dir[ci & (DIR_CHUNKS - 1)].get().map(|b| &**b)
    }

    /// The chunk `ci`, allocating it. `ci` < number of chunks.
    #[inline]
    fn chunk_mut(&self, ci: usize) -> &Chunk {
        let dir = self.dirs[ci >> DIR_SHIFT]
            .get_or_init(|| Box::new(std::array::from_fn(|_| OnceLock::new())));
        dir[ci & (DIR_CHUNKS - 1)]
            .get_or_init(|| Box::new(std::array::from_fn(|_| AtomicU32::new(0))))
    }

    /// The word of `page` if its chunk exists.
    #[inline]
    fn word(&self, page: u64) -> Option<&AtomicU32> {
        self.chunk((page >> CHUNK_SHIFT) as usize)
            .map(|c| &c[(page as usize) & (CHUNK_PAGES - 1)])
    }

    /// The word of `page`, allocating its chunk. `page` < npages.
    #[inline]
    fn word_mut(&self, page: u64) -> &AtomicU32 {
        &self.chunk_mut((page >> CHUNK_SHIFT) as usize)[(page as usize) & (CHUNK_PAGES - 1)]
    }

    /// Current word of `page` (0 when never pinned).
    #[inline]
    pub(crate) fn get(&self, page: u64) -> u32 {
        self.chunk((page >> CHUNK_SHIFT) as usize)
            .map_or(0, |c| c[(page as usize) & (CHUNK_PAGES - 1)].load(Relaxed))
    }

    /// Count the pages of `[lo, hi)` with pin count 0 (the ones a pin would newly pin).
    /// Fails with the offending page if a count would overflow. Does not mutate.
    #[inline]
    pub(crate) fn count_new(&self, lo: u64, hi: u64) -> Result<u64, u64> {
        if hi == lo + 1 {
            // One page (every run of an all-scattered array): no segment iteration.
            return match self.get(lo) & COUNT_MASK {
                0 => Ok(1),
                COUNT_MASK => Err(lo),
                _ => Ok(0),
            };
        }
        let mut new = 0;
        for (ci, s, e) in segments(lo, hi) {
            let Some(c) = self.chunk(ci) else {
                new += (e - s) as u64;
                continue;
            };
            for (k, w) in c[s..e].iter().enumerate() {
                let count = w.load(Relaxed) & COUNT_MASK;
                if count == 0 {
                    new += 1;
                } else if count == COUNT_MASK {
                    return Err(page_of(ci, s + k));
                }
            }
        }
        Ok(new)
    }

    /// Increment the counts of `[lo, hi)` (validated by [`PinTable::count_new`]); pages
    /// going 0→1 get [`PINNED`] and, if `lock`, [`LOCKED`]; `write` sets [`WRITABLE`].
    /// Returns the number of pages that went 0→1.
    #[inline]
    pub(crate) fn commit_pin(&self, lo: u64, hi: u64, lock: bool, write: bool) -> u64 {
        let mut new = 0;
        let fresh = PINNED | if lock { LOCKED } else { 0 };
        let wflag = if write { WRITABLE } else { 0 };
        let mut bump = |w: &AtomicU32| {
            let v = w.load(Relaxed);
            let v = if v & COUNT_MASK == 0 {
                new += 1;
                fresh
            } else {
                v
            };
            w.store((v + 1) | wflag, Relaxed);
        };
        if hi == lo + 1 {
            bump(self.word_mut(lo));
        } else {
            for (ci, s, e) in segments(lo, hi) {
                self.chunk_mut(ci)[s..e].iter().for_each(&mut bump);
            }
        }
        add_locked(&self.pinned, new);
        if lock {
            add_locked(&self.locked, new);
        }
        new
    }

    /// Decrement the counts of `[lo, hi)` without releasing anything (flags stay). On a page
    /// with count 0 the pages already decremented are restored and that page is returned.
    #[inline]
    pub(crate) fn decrement(&self, lo: u64, hi: u64) -> Result<(), u64> {
        if hi == lo + 1 {
            let w = self.word(lo).ok_or(lo)?;
            let v = w.load(Relaxed);
            if v & COUNT_MASK == 0 {
                return Err(lo);
            }
            w.store(v - 1, Relaxed);
            return Ok(());
        }
        for (ci, s, e) in segments(lo, hi) {
            let Some(c) = self.chunk(ci) else {
                let bad = page_of(ci, s);
                self.increment_back(lo, bad);
                return Err(bad);
            };
            for (k, w) in c[s..e].iter().enumerate() {
                let v = w.load(Relaxed);
                if v & COUNT_MASK == 0 {
                    let bad = page_of(ci, s + k);
                    self.increment_back(lo, bad);
                    return Err(bad);
                }
                w.store(v - 1, Relaxed);
            }
        }
        Ok(())
    }

    /// Undo a successful [`PinTable::decrement`] of `[lo, hi)`.
    #[inline]
    pub(crate) fn increment_back(&self, lo: u64, hi: u64) {
        for (ci, s, e) in segments(lo, hi) {
            if let Some(c) = self.chunk(ci) {
                for w in &c[s..e] {
                    let v = w.load(Relaxed);
                    w.store(v + 1, Relaxed);
                }
            }
        }
    }

    /// Release the pages of `[lo, hi)` whose count is 0 but which still carry flags: clear
    /// the word, and call `unlock(first, end)` once per maximal sub-range of pages that were
    /// [`LOCKED`]. Updates this table's counters and returns what was released.
    #[inline]
    pub(crate) fn release_zeroed(
        &self,
        lo: u64,
        hi: u64,
        unlock: &mut dyn FnMut(u64, u64),
    ) -> Released {
        let mut rel = Released::default();
        if hi == lo + 1 {
            if let Some(w) = self.word(lo) {
                let v = w.load(Relaxed);
                if v & COUNT_MASK == 0 && v != 0 {
                    w.store(0, Relaxed);
                    rel.pinned = u64::from(v & PINNED != 0);
                    rel.locked = u64::from(v & LOCKED != 0);
                    if rel.locked != 0 {
                        unlock(lo, hi);
                    }
                    sub_locked(&self.pinned, rel.pinned);
                    sub_locked(&self.locked, rel.locked);
                }
            }
            return rel;
        }
        let mut run_start: Option<u64> = None;
        for (ci, s, e) in segments(lo, hi) {
            let Some(c) = self.chunk(ci) else {
                if let Some(st) = run_start.take() {
                    unlock(st, page_of(ci, s));
                }
                continue;
            };
            for (k, w) in c[s..e].iter().enumerate() {
                let v = w.load(Relaxed);
                let mut locked_here = false;
                if v & COUNT_MASK == 0 && v != 0 {
                    rel.pinned += u64::from(v & PINNED != 0);
                    if v & LOCKED != 0 {
                        rel.locked += 1;
                        locked_here = true;
                    }
                    w.store(0, Relaxed);
                }
                match (locked_here, run_start) {
                    (true, None) => run_start = Some(page_of(ci, s + k)),
                    (false, Some(st)) => {
                        unlock(st, page_of(ci, s + k));
                        run_start = None;
                    }
                    _ => {}
                }
            }
        }
        if let Some(st) = run_start {
            unlock(st, hi);
        }
        sub_locked(&self.pinned, rel.pinned);
        sub_locked(&self.locked, rel.locked);
        rel
    }

    /// Call `f(first, end)` for each maximal sub-range of `[lo, hi)` whose pages are not
    /// [`LOCKED`] (used to undo a partially failed mlock without unlocking pages that other
    /// pins hold locked).
    pub(crate) fn unlocked_subranges(&self, lo: u64, hi: u64, f: &mut dyn FnMut(u64, u64)) {
        let mut start: Option<u64> = None;
        for page in lo..hi {
            let unlocked = self.get(page) & LOCKED == 0;
            match (unlocked, start) {
                (true, None) => start = Some(page),
                (false, Some(st)) => {
                    f(st, page);
                    start = None;
                }
                _ => {}
            }
        }
        if let Some(st) = start {
            f(st, hi);
        }
    }

    /// Zero the count of every pinned page (leaving flags for [`PinTable::release_zeroed`])
    /// and return the number of pages that were pinned. Used by a forced release at unmap.
    pub(crate) fn zero_all_counts(&self) -> u64 {
        let mut pages = 0;
        let chunks = self.dirs.iter().filter_map(|d| d.get());
        for chunk in chunks.flat_map(|d| d.iter().filter_map(|c| c.get())) {
            for w in chunk.iter() {
                let v = w.load(Relaxed);
                if v & COUNT_MASK != 0 {
                    pages += 1;
                    w.store(v & !COUNT_MASK, Relaxed);
                }
            }
        }
        pages
    }

    /// Page ranges `[lo, hi)` of the allocated chunks (what a full scan must visit).
    pub(crate) fn allocated_ranges(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.dirs
            .iter()
            .enumerate()
            .filter_map(|(di, d)| d.get().map(|d| (di, d)))
            .flat_map(|(di, d)| {
                d.iter()
                    .enumerate()
                    .filter(|(_, c)| c.get().is_some())
                    .map(move |(k, _)| (di << DIR_SHIFT) + k)
            })
            .map(|ci| {
                let lo = (ci as u64) << CHUNK_SHIFT;
                (lo, (lo + CHUNK_PAGES as u64).min(self.npages))
            })
    }

    /// Recount flags by scanning: (pinned pages, locked pages, pages with count > 0).
    pub(crate) fn scan(&self) -> (u64, u64, u64) {
        let (mut p, mut l, mut c) = (0, 0, 0);
        for (lo, hi) in self.allocated_ranges() {
            for page in lo..hi {
                let v = self.get(page);
                p += u64::from(v & PINNED != 0);
                l += u64::from(v & LOCKED != 0);
                c += u64::from(v & COUNT_MASK != 0);
            }
        }
        (p, l, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_new_huge_region_allocates_no_chunk() {
        // 128 TiB of 4 KiB pages: 32 Ki directory slots, nothing else.
        let big = PinTable::new(1 << 35);
        assert_eq!(big.dirs.len(), 1 << 15);
        assert_eq!(big.commit_pin((1 << 35) - 1, 1 << 35, false, false), 1);
        assert_eq!(big.allocated_ranges().count(), 1);
        // 64 GiB of 4 KiB pages.
        let t = PinTable::new(16 << 20);
        assert_eq!(t.allocated_ranges().count(), 0);
        assert_eq!(t.get(12345), 0);
        assert_eq!(t.count_new(0, 16), Ok(16));
    }

    #[test]
    fn test_commit_then_release_restores_empty_state() {
        let t = PinTable::new(4096);
        assert_eq!(t.commit_pin(10, 20, true, false), 10);
        assert_eq!(t.commit_pin(15, 25, true, true), 5);
        assert_eq!(t.pinned.load(Relaxed), 15);
        assert_eq!(t.locked.load(Relaxed), 15);
        t.decrement(15, 20).unwrap();
        t.decrement(10, 25).unwrap();
        let mut unlocked = Vec::new();
        let rel = t.release_zeroed(10, 25, &mut |a, b| unlocked.push((a, b)));
        assert_eq!(
            rel,
            Released {
                pinned: 15,
                locked: 15
            }
        );
        assert_eq!(unlocked, vec![(10, 25)]);
        assert_eq!(t.scan(), (0, 0, 0));
    }

    #[test]
    fn test_ranges_across_chunk_boundaries() {
        let t = PinTable::new(3 * CHUNK_PAGES as u64);
        let (lo, hi) = (CHUNK_PAGES as u64 - 3, 2 * CHUNK_PAGES as u64 + 5);
        assert_eq!(t.count_new(lo, hi), Ok(hi - lo));
        assert_eq!(t.commit_pin(lo, hi, true, false), hi - lo);
        assert_eq!(t.count_new(lo - 2, hi + 2), Ok(4));
        assert_eq!(t.decrement(lo - 1, hi), Err(lo - 1));
        t.decrement(lo, hi).unwrap();
        let mut unlocked = Vec::new();
        t.release_zeroed(0, 3 * CHUNK_PAGES as u64, &mut |a, b| unlocked.push((a, b)));
        assert_eq!(unlocked, vec![(lo, hi)]);
        assert_eq!(t.scan(), (0, 0, 0));
        // A range starting in an unallocated chunk fails at its first page.
        let t = PinTable::new(3 * CHUNK_PAGES as u64);
        t.commit_pin(0, 4, false, false);
        assert_eq!(t.decrement(2, CHUNK_PAGES as u64 + 1), Err(4));
        assert_eq!(t.get(2) & COUNT_MASK, 1);
    }

    #[test]
    fn test_unlocked_subranges_skip_locked_pages() {
        let t = PinTable::new(64);
        t.commit_pin(3, 5, true, false);
        t.commit_pin(7, 8, true, false);
        let mut got = Vec::new();
        t.unlocked_subranges(0, 10, &mut |a, b| got.push((a, b)));
        assert_eq!(got, vec![(0, 3), (5, 7), (8, 10)]);
    }

    #[test]
    fn test_decrement_unpinned_page_restores_and_fails() {
        let t = PinTable::new(64);
        t.commit_pin(0, 3, false, false);
        assert_eq!(t.decrement(0, 5), Err(3));
        assert_eq!(t.get(0) & COUNT_MASK, 1);
        assert_eq!(t.get(2) & COUNT_MASK, 1);
    }

    #[test]
    fn test_release_zeroed_partial_unlock_splits_subranges() {
        let t = PinTable::new(64);
        t.commit_pin(0, 6, true, false);
        t.commit_pin(2, 3, true, false); // page 2 count 2
        t.decrement(0, 6).unwrap();
        let mut unlocked = Vec::new();
        let rel = t.release_zeroed(0, 6, &mut |a, b| unlocked.push((a, b)));
        assert_eq!(rel.locked, 5);
        assert_eq!(unlocked, vec![(0, 2), (3, 6)]);
        assert_eq!(t.scan(), (1, 1, 1));
    }
}
