use proptest::prelude::*;

use super::*;
use crate::dma::{DmaConfig, DmaSpace};
use crate::testing::GuestMemory;

const RAM: u64 = 0x10_0000; // IOVA page 0x100
const RAM_PAGES: u64 = 32;

/// A space with RAM_PAGES pages of guest RAM at RAM (read/write) and one read-only page
/// after it; the RAM holds a byte pattern.
fn space() -> (Arc<DmaSpace>, GuestMemory, GuestMemory) {
    let space = DmaSpace::new(DmaConfig::default());
    let size = RAM_PAGES * PAGE_SIZE;
    let ram = GuestMemory::new(RAM, size as usize).unwrap();
    let pattern: Vec<u8> = (0..size).map(|i| (i * 7 + i / 4096) as u8).collect();
    ram.write(RAM, &pattern).unwrap();
    space
        .map(ram.dma_mapping(RAM, size, Prot::RW).unwrap())
        .unwrap();
    let ro_base = RAM + size;
    let ro = GuestMemory::new(ro_base, PAGE_SIZE as usize).unwrap();
    space
        .map(ro.dma_mapping(ro_base, PAGE_SIZE, Prot::READ).unwrap())
        .unwrap();
    (space, ram, ro)
}

use std::sync::Arc;

fn pfn(page: u64) -> u64 {
    (RAM >> crate::dma::PAGE_SHIFT) + page
}

/// The reference: byte `i` of the copy goes from the `src_offset + i`-th byte of the
/// concatenated source pages to the `dst_offset + i`-th of the destination's.
fn model(ram: &mut [u8], src: &[u64], src_offset: u64, dst: &[u64], dst_offset: u64, len: u64) {
    let at = |pages: &[u64], off: u64| {
        (pages[(off / PAGE_SIZE) as usize] * PAGE_SIZE + off % PAGE_SIZE) as usize
    };
    for i in 0..len {
        ram[at(dst, dst_offset + i)] = ram[at(src, src_offset + i)];
    }
}

#[test]
fn test_copy_segments_contiguous_arrays_are_one_segment() {
    let src = [0x1000, 0x2000, 0x3000];
    let dst = [0x9000, 0xa000, 0xb000];
    let segs = copy_segments(&src, 0x10, &dst, 0x10, 0x2000).unwrap();
    assert_eq!(segs, vec![(0x1010, 0x9010, 0x2000)]);
}

#[test]
fn test_copy_segments_different_offsets_split_at_both_sides_page_edges() {
    // Source starts 0x100 into scattered pages, destination 0xf00 into scattered pages.
    let src = [0x1000, 0x5000];
    let dst = [0x9000, 0x7000, 0x3000];
    let segs = copy_segments(&src, 0x100, &dst, 0xf00, 0x1000).unwrap();
    assert_eq!(
        segs,
        vec![
            (0x1100, 0x9f00, 0x100),
            (0x1200, 0x7000, 0xe00),
            (0x5000, 0x7e00, 0x100),
        ]
    );
}

#[test]
fn test_copy_segments_range_past_the_array_is_an_error() {
    let pages = [0x1000, 0x2000];
    assert!(matches!(
        copy_segments(&pages, 0x1001, &pages, 0, 0x1000),
        Err(DmaError::InvalidArgument(_))
    ));
    assert!(matches!(
        copy_segments(&pages, 0, &pages, u64::MAX, 2),
        Err(DmaError::Overflow { .. })
    ));
    assert_eq!(copy_segments(&[], 0, &[], 0, 0).unwrap(), vec![]);
    assert!(copy_segments(&pages, 0x2000, &pages, 0, 0)
        .unwrap()
        .is_empty());
}

#[test]
fn test_pinned_pages_copy_to_read_only_destination_is_refused() {
    let (space, ram, _ro) = space();
    let dma = space.handle();
    let src = PinnedPages::pin(&dma, &[pfn(0)], Prot::READ).unwrap();
    let ro_pfn = pfn(RAM_PAGES);
    let dst = PinnedPages::pin(&dma, &[ro_pfn], Prot::READ).unwrap();
    let err = src.copy_to(0, &dst, 0, 16).unwrap_err();
    assert!(matches!(err, DmaError::Permission { .. }), "{err}");
    // A source pinned write-only cannot be read either.
    let wo = PinnedPages::pin(&dma, &[pfn(1)], Prot::WRITE).unwrap();
    assert!(matches!(
        wo.copy_to(0, &wo, 8, 8),
        Err(DmaError::Permission { .. })
    ));
    assert!(matches!(
        wo.read(0, &mut [0; 4]),
        Err(DmaError::Permission { .. })
    ));
    drop((src, dst, wo));
    assert_eq!(space.stats().pinned_pages, 0);
    let _ = ram;
}

#[test]
fn test_pinned_pages_out_of_range_copy_copies_nothing() {
    let (space, ram, _ro) = space();
    let dma = space.handle();
    let before = ram.read_vec(RAM, (4 * PAGE_SIZE) as usize).unwrap();
    let src = PinnedPages::pin(&dma, &[pfn(0), pfn(1)], Prot::RW).unwrap();
    let dst = PinnedPages::pin(&dma, &[pfn(3)], Prot::RW).unwrap();
    let err = src.copy_to(0, &dst, 1, PAGE_SIZE).unwrap_err();
    assert!(matches!(err, DmaError::InvalidArgument(_)), "{err}");
    assert!(src.write(PAGE_SIZE * 2 - 1, &[1, 2]).is_err());
    assert_eq!(ram.read_vec(RAM, (4 * PAGE_SIZE) as usize).unwrap(), before);
}

#[test]
fn test_pinned_pages_drop_unpins_and_unpin_reports_a_page_taken_back() {
    let (space, _ram, _ro) = space();
    let dma = space.handle();
    let p = PinnedPages::pin(&dma, &[pfn(2), pfn(3), pfn(2)], Prot::RW).unwrap();
    assert_eq!(space.stats().pinned_pages, 2);
    assert_eq!(p.len(), 3 * PAGE_SIZE);
    drop(p);
    assert_eq!(space.stats().pinned_pages, 0);
    let p = PinnedPages::pin(&dma, &[pfn(2)], Prot::RW).unwrap();
    dma.unpin_pages(&[pfn(2)]).unwrap(); // someone else released it
    assert!(p.unpin().is_err());
}

#[test]
fn test_pinned_pages_copy_between_two_spaces_is_refused() {
    let (a, _ra, _roa) = space();
    let (b, _rb, _rob) = space();
    let src = PinnedPages::pin(&a.handle(), &[pfn(0)], Prot::RW).unwrap();
    let dst = PinnedPages::pin(&b.handle(), &[pfn(0)], Prot::RW).unwrap();
    assert!(matches!(
        src.copy_to(0, &dst, 0, 8),
        Err(DmaError::InvalidArgument(_))
    ));
}

/// Arrays of distinct RAM pages (source and destination disjoint), with runs of
/// consecutive pages so that coalesced segments occur, and a range inside both.
fn copy_case() -> impl Strategy<Value = (Vec<u64>, Vec<u64>, u64, u64, u64)> {
    (Just(()), any::<u64>(), 1usize..6, 1usize..6).prop_flat_map(|(_, seed, ns, nd)| {
        // A permutation of the pages from the seed, grouped in pairs so runs show up.
        let mut pages: Vec<u64> = (0..RAM_PAGES).collect();
        let mut s = seed | 1;
        for i in (1..pages.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            pages.swap(i, (s % (i as u64 + 1)) as usize);
        }
        let mut src: Vec<u64> = pages[..ns].to_vec();
        let dst: Vec<u64> = pages[16..16 + nd].to_vec();
        if seed % 3 == 0 {
            src.sort(); // often consecutive: one run
        }
        let (ss, ds) = (ns as u64 * PAGE_SIZE, nd as u64 * PAGE_SIZE);
        (Just(src), Just(dst), 0..ss, 0..ds).prop_flat_map(move |(src, dst, so, dof)| {
            let max = (ss - so).min(ds - dof);
            (Just(src), Just(dst), Just(so), Just(dof), 0..=max)
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Through real pins of real guest RAM: the pages hold exactly what the byte-by-byte
    /// model says, and nothing stays pinned.
    #[test]
    fn test_pinned_pages_copy_to_matches_byte_model((src, dst, so, dof, len) in copy_case()) {
        let (space, ram, _ro) = space();
        let dma = space.handle();
        let size = (RAM_PAGES * PAGE_SIZE) as usize;
        let mut expect = ram.read_vec(RAM, size).unwrap();
        model(&mut expect, &src, so, &dst, dof, len);

        let to_pfns = |p: &[u64]| p.iter().map(|&x| pfn(x)).collect::<Vec<_>>();
        let s = PinnedPages::pin(&dma, &to_pfns(&src), Prot::READ).unwrap();
        let d = PinnedPages::pin(&dma, &to_pfns(&dst), Prot::WRITE).unwrap();
        let segments = s.copy_to(so, &d, dof, len).unwrap();
        // Never more segments than page boundaries crossed on either side, plus one.
        prop_assert!(segments as u64 <= len / PAGE_SIZE * 2 + 3);
        prop_assert!(ram.read_vec(RAM, size).unwrap() == expect);

        // read/write through the guard agree with the same model.
        let mut back = vec![0u8; len as usize];
        s.read(so, &mut back).unwrap();
        let rd = PinnedPages::pin(&dma, &to_pfns(&dst), Prot::READ).unwrap();
        let mut out = vec![0u8; len as usize];
        rd.read(dof, &mut out).unwrap();
        prop_assert_eq!(&back, &out);
        drop((s, d, rd));
        prop_assert_eq!(space.stats().pinned_pages, 0);
    }

    /// The segments alone: every byte goes where the model says, in order, and no
    /// segment crosses a host discontinuity.
    #[test]
    fn test_copy_segments_cover_the_model_byte_for_byte((src, dst, so, dof, len) in copy_case()) {
        let host = |p: &[u64], off: u64| p[(off / PAGE_SIZE) as usize] * PAGE_SIZE + off % PAGE_SIZE;
        let sh: Vec<u64> = src.iter().map(|p| p * PAGE_SIZE).collect();
        let dh: Vec<u64> = dst.iter().map(|p| p * PAGE_SIZE).collect();
        let segs = copy_segments(&sh, so, &dh, dof, len).unwrap();
        let mut i = 0u64;
        for (sa, da, n) in segs {
            prop_assert!(n > 0);
            for k in 0..n {
                prop_assert_eq!(sa + k, host(&src, so + i + k));
                prop_assert_eq!(da + k, host(&dst, dof + i + k));
            }
            i += n;
        }
        prop_assert_eq!(i, len);
    }
}

/// A temporary file holding `len` bytes of a pattern.
fn pattern_file(len: usize) -> (std::fs::File, Vec<u8>) {
    use std::io::Write;
    let data: Vec<u8> = (0..len).map(|i| (i * 13 + i / 4096 + 5) as u8).collect();
    let mut f = tempfile_in_tmp();
    f.write_all(&data).unwrap();
    (f, data)
}

fn tempfile_in_tmp() -> std::fs::File {
    let path = std::env::temp_dir().join(format!(
        "umdev-pinned-io-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    f
}

#[test]
fn test_pinned_pages_file_io_refuses_wrong_permission_range_and_short_file() {
    let (space, ram, _ro) = space();
    let dma = space.handle();
    let (file, _) = pattern_file(3 * PAGE_SIZE as usize);
    let before = ram.read_vec(RAM, (4 * PAGE_SIZE) as usize).unwrap();
    let ro = PinnedPages::pin(&dma, &[pfn(0)], Prot::READ).unwrap();
    assert!(matches!(
        ro.read_from_file(&file, 0, 0, 16),
        Err(PinnedIoError::Dma(DmaError::Permission { .. }))
    ));
    let wo = PinnedPages::pin(&dma, &[pfn(1)], Prot::WRITE).unwrap();
    assert!(matches!(
        wo.write_to_file(&file, 0, 0, 16),
        Err(PinnedIoError::Dma(DmaError::Permission { .. }))
    ));
    assert!(matches!(
        wo.read_from_file(&file, 0, 1, PAGE_SIZE),
        Err(PinnedIoError::Dma(DmaError::InvalidArgument(_)))
    ));
    // The file ends 16 bytes into the request.
    let err = wo
        .read_from_file(&file, 3 * PAGE_SIZE - 16, 0, 64)
        .unwrap_err();
    assert!(
        matches!(&err, PinnedIoError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof),
        "{err}"
    );
    drop((ro, wo));
    // Only the 16 bytes the file had moved (into page 1).
    let after = ram.read_vec(RAM, (4 * PAGE_SIZE) as usize).unwrap();
    let p1 = PAGE_SIZE as usize;
    assert_eq!(after[..p1], before[..p1]);
    assert_eq!(after[p1 + 16..], before[p1 + 16..]);
    assert_eq!(space.stats().pinned_pages, 0);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// preadv into scattered pinned pages at any offset puts every file byte where the
    /// byte model says; pwritev from them writes back exactly those bytes.
    #[test]
    fn test_pinned_pages_file_io_matches_byte_model(
        (_src, dst, _so, dof, len) in copy_case(),
        file_off in 0u64..3 * PAGE_SIZE,
    ) {
        let (space, ram, _ro) = space();
        let dma = space.handle();
        let size = (RAM_PAGES * PAGE_SIZE) as usize;
        let (file, data) = pattern_file((file_off + len) as usize);
        let mut expect = ram.read_vec(RAM, size).unwrap();
        let at = |off: u64| (dst[(off / PAGE_SIZE) as usize] * PAGE_SIZE + off % PAGE_SIZE) as usize;
        for i in 0..len {
            expect[at(dof + i)] = data[(file_off + i) as usize];
        }
        let pfns: Vec<u64> = dst.iter().map(|&x| pfn(x)).collect();
        let p = PinnedPages::pin(&dma, &pfns, Prot::RW).unwrap();
        p.read_from_file(&file, file_off, dof, len).unwrap();
        prop_assert!(ram.read_vec(RAM, size).unwrap() == expect);
        let out = tempfile_in_tmp();
        p.write_to_file(&out, 7, dof, len).unwrap();
        let mut back = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&out, &mut back, 7).unwrap();
        prop_assert_eq!(&back[..], &data[file_off as usize..(file_off + len) as usize]);
        drop(p);
        prop_assert_eq!(space.stats().pinned_pages, 0);
    }
}
