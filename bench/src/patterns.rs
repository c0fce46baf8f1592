//! The synthetic pin-array patterns of `umdev bench pin`, and the run count of an array.
//!
//! Each pattern models what a class of real device hands to `pin_pages` (seeds/01: the
//! maintainer asked which patterns real devices produce, so the bench shows all of them and
//! replays recorded ones with `--trace`):
//!
//! | pattern | array | who does this |
//! |---|---|---|
//! | `contiguous` | `b, b+1, …, b+n-1` | a large buffer in one go (best case for coalescing) |
//! | `scattered` | `b, b+2, b+4, …` (stride 2) | every page its own run (worst case) |
//! | `ccw-like` | runs of 1..=16 pages separated by gaps of 1..=16 pages | vfio-ccw IDAW lists |
//! | `gvt-like` | repeating: 8 single pages at random gaps, then one 2 MiB-aligned 512-page surface | GTT: ring/cursor pages and framebuffer surfaces |
//! | `random` | a random permutation of `b..b+n` | an allocator handing out pages in no order |
//!
//! Every pattern is a deterministic function of (pattern, size, seed).

use super::rng::SeededRng;

/// A synthetic pin-array pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Pattern {
    /// Consecutive pages: one run.
    Contiguous,
    /// Every other page: every page is its own run.
    Scattered,
    /// Runs of 1..=16 pages with gaps of 1..=16 pages (seeded).
    CcwLike,
    /// 8 single pages then one 512-page surface, repeated (seeded gaps).
    GvtLike,
    /// A random permutation of consecutive pages (seeded).
    Random,
}

impl Pattern {
    /// Every synthetic pattern, in report order.
    pub const ALL: [Pattern; 5] = [
        Pattern::Contiguous,
        Pattern::Scattered,
        Pattern::CcwLike,
        Pattern::GvtLike,
        Pattern::Random,
    ];

    /// The name used on the command line, in tables and in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Contiguous => "contiguous",
            Pattern::Scattered => "scattered",
            Pattern::CcwLike => "ccw-like",
            Pattern::GvtLike => "gvt-like",
            Pattern::Random => "random",
        }
    }

    fn salt(self) -> u64 {
        match self {
            Pattern::Contiguous => 1,
            Pattern::Scattered => 2,
            Pattern::CcwLike => 3,
            Pattern::GvtLike => 4,
            Pattern::Random => 5,
        }
    }
}

/// Pages in one gvt-like surface (a 2 MiB framebuffer-style surface).
pub const GVT_SURFACE_PAGES: u64 = 512;
/// Single pages between two gvt-like surfaces.
pub const GVT_SINGLES_PER_SURFACE: usize = 8;
/// Longest ccw-like run and largest ccw-like gap, in pages.
pub const CCW_MAX_RUN: u64 = 16;

/// The array of `size` IOVA page numbers of `pattern`, all `>= base_pfn`.
pub fn generate(pattern: Pattern, size: usize, base_pfn: u64, seed: u64) -> Vec<u64> {
    let mut rng = SeededRng::new(
        seed ^ pattern.salt().wrapping_mul(0x1000_0000_01b3) ^ (size as u64).rotate_left(32),
    );
    let mut out = Vec::with_capacity(size);
    match pattern {
        Pattern::Contiguous => out.extend((0..size as u64).map(|i| base_pfn + i)),
        Pattern::Scattered => out.extend((0..size as u64).map(|i| base_pfn + 2 * i)),
        Pattern::CcwLike => {
            let mut next = base_pfn;
            while out.len() < size {
                let run = rng.range_inclusive(1, CCW_MAX_RUN) as usize;
                let run = run.min(size - out.len());
                out.extend((0..run as u64).map(|i| next + i));
                next += run as u64 + rng.range_inclusive(1, CCW_MAX_RUN);
            }
        }
        Pattern::GvtLike => {
            let mut next = base_pfn;
            'outer: loop {
                for _ in 0..GVT_SINGLES_PER_SURFACE {
                    if out.len() == size {
                        break 'outer;
                    }
                    out.push(next);
                    next += 1 + rng.range_inclusive(1, CCW_MAX_RUN);
                }
                if out.len() == size {
                    break;
                }
                // Surfaces sit 2 MiB-aligned, as a huge-page backed framebuffer would.
                let start = next.div_ceil(GVT_SURFACE_PAGES) * GVT_SURFACE_PAGES;
                let len = (GVT_SURFACE_PAGES as usize).min(size - out.len());
                out.extend((0..len as u64).map(|i| start + i));
                next = start + GVT_SURFACE_PAGES + 1;
            }
        }
        Pattern::Random => {
            out.extend((0..size as u64).map(|i| base_pfn + i));
            rng.shuffle(&mut out);
        }
    }
    out
}

/// Number of maximal runs of consecutive page numbers (`pfn == previous + 1`) in `pfns`:
/// what a coalescing implementation needs at least, region boundaries aside.
pub fn runs(pfns: &[u64]) -> usize {
    if pfns.is_empty() {
        return 0;
    }
    1 + pfns
        .windows(2)
        .filter(|w| w[0].checked_add(1) != Some(w[1]))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_runs_example_from_review_gives_three() {
        assert_eq!(runs(&[1, 5, 6, 7, 9]), 3);
        assert_eq!(runs(&[]), 0);
        assert_eq!(runs(&[u64::MAX, 0]), 2);
    }

    #[test]
    fn test_generate_every_pattern_has_requested_size() {
        for p in Pattern::ALL {
            for n in [1usize, 8, 64, 512, 4096, 1000] {
                let a = generate(p, n, 100, 42);
                assert_eq!(a.len(), n, "{p:?} {n}");
                assert!(a.iter().all(|&x| x >= 100), "{p:?} {n}");
            }
        }
    }

    #[test]
    fn test_generate_contiguous_is_one_run_scattered_is_all_runs() {
        assert_eq!(runs(&generate(Pattern::Contiguous, 512, 0, 1)), 1);
        assert_eq!(runs(&generate(Pattern::Scattered, 512, 0, 1)), 512);
    }

    #[test]
    fn test_generate_ccw_like_runs_between_bounds() {
        let a = generate(Pattern::CcwLike, 4096, 0, 9);
        let r = runs(&a);
        assert!((4096 / 16..4096 / 3).contains(&r), "runs {r}");
        let mut sorted = a.clone();
        sorted.dedup();
        assert_eq!(sorted.len(), a.len(), "no duplicates");
    }

    #[test]
    fn test_generate_gvt_like_has_surfaces_and_singles() {
        let a = generate(Pattern::GvtLike, 4096, 0, 3);
        let r = runs(&a);
        // 7 full units of (8 singles + 1 surface), then 8 singles and a partial surface.
        assert_eq!(r, 7 * 9 + 9);
        let small = generate(Pattern::GvtLike, 8, 0, 3);
        assert_eq!(runs(&small), 8);
    }

    #[test]
    fn test_generate_random_is_permutation_and_seeded() {
        let a = generate(Pattern::Random, 512, 10, 5);
        let b = generate(Pattern::Random, 512, 10, 5);
        let c = generate(Pattern::Random, 512, 10, 6);
        assert_eq!(a, b);
        assert_ne!(a, c);
        let mut s = a.clone();
        s.sort_unstable();
        assert_eq!(s, (10..522).collect::<Vec<u64>>());
        assert!(runs(&a) > 400);
    }
}
