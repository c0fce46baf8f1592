//! SIGBUS: a hostile client that shrinks its memfd after DMA_MAP must not kill the server
//! (it used to), whatever the device touches; and umdev's SIGBUS handler must not change what
//! happens to any other SIGBUS. Each scenario runs in a child process (this test binary,
//! re-executed with [`CHILD_ENV`] naming the test) so that a death is observed, not suffered.

mod dma_util;

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use umdev::dma::{DmaConfig, DmaHandle, DmaMapping, DmaSpace, Prot, PAGE_SIZE};

const CHILD_ENV: &str = "UMDEV_SIGBUS_CHILD";

/// True in the child process running test `name`'s scenario.
fn in_child(name: &str) -> bool {
    if std::env::var(CHILD_ENV).ok().as_deref() != Some(name) {
        return false;
    }
    // A child expected to die must not leave a core file behind.
    // SAFETY: prctl(PR_SET_DUMPABLE) takes plain integers.
    unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) };
    true
}

/// The command re-running test `name` alone in a child process.
fn child(name: &str) -> Command {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, name);
    cmd
}

/// Run test `name` in a child process and wait for it.
fn run_child(name: &str) -> Output {
    child(name).output().unwrap()
}

fn describe(out: &Output) -> String {
    format!(
        "{:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn assert_survived(out: &Output) {
    assert!(
        out.status.success(),
        "the server process died: {}",
        describe(out)
    );
}

fn assert_killed_by_sigbus(status: ExitStatus, what: &str) {
    assert_eq!(
        status.signal(),
        Some(libc::SIGBUS),
        "{what}: the process must die of SIGBUS, got {status:?}"
    );
}

/// Lines of /proc/self/maps (one per VMA).
fn vma_count() -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .count()
}

/// Lines of /proc/self/maps naming `what` (the memfd name of a mapping).
fn vmas_of(what: &str) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| l.contains(what))
        .count()
}

/// VMAs of /proc/self/maps that intersect `[lo, hi)`.
fn vmas_in(lo: u64, hi: u64) -> usize {
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .filter(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (a, b) = range.split_once('-').unwrap();
            let (a, b) = (
                u64::from_str_radix(a, 16).unwrap(),
                u64::from_str_radix(b, 16).unwrap(),
            );
            a < hi && lo < b
        })
        .count()
}

fn shrink(fd: &OwnedFd, len: u64) {
    // SAFETY: ftruncate on our own fd; this is the hostile client's move.
    let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) };
    assert_eq!(rc, 0, "ftruncate: {}", std::io::Error::last_os_error());
}

fn pwrite(fd: &OwnedFd, data: &[u8], off: u64) {
    // SAFETY: pwrite from a valid buffer into our own fd.
    let n = unsafe { libc::pwrite(fd.as_raw_fd(), data.as_ptr().cast(), data.len(), off as i64) };
    assert_eq!(n, data.len() as isize);
}

fn pread(fd: &OwnedFd, len: usize, off: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    // SAFETY: pread into a valid buffer of `len` bytes from our own fd.
    let n = unsafe { libc::pread(fd.as_raw_fd(), buf.as_mut_ptr().cast(), len, off as i64) };
    assert_eq!(n, len as isize);
    buf
}

/// A space with `fd` mapped RW at `iova` (`size` bytes from offset 0).
fn map(fd: &OwnedFd, iova: u64, size: u64) -> (Arc<DmaSpace>, DmaHandle) {
    let space = DmaSpace::new(DmaConfig::default());
    space
        .map(DmaMapping {
            iova,
            size,
            prot: Prot::RW,
            fd: Some(fd.try_clone().unwrap()),
            offset: 0,
        })
        .unwrap();
    let h = space.handle();
    (space, h)
}

/// Read a byte of pinned page `pfn`, then write `v` there (a device using its pin).
fn touch_through_pin(h: &DmaHandle, pfn: u64, v: u8) -> u8 {
    let mut host = [0u64];
    h.pin_pages(&[pfn], Prot::RW, &mut host).unwrap();
    // SAFETY: the page was pinned just above and is unpinned below.
    let slice = unsafe { h.pinned_slice(host[0], PAGE_SIZE as usize) };
    let old: u8 = vm_memory::Bytes::read_obj(&slice, 123).unwrap();
    vm_memory::Bytes::write_obj(&slice, v, 123).unwrap();
    h.unpin_pages(&[pfn]).unwrap();
    old
}

#[test]
fn test_sigbus_client_shrinks_mapped_memfd_server_survives() {
    const NAME: &str = "test_sigbus_client_shrinks_mapped_memfd_server_survives";
    if in_child(NAME) {
        let fd = dma_util::memfd(0x10000);
        let (space, h) = map(&fd, 0x10_0000, 0x10000);
        shrink(&fd, 0);
        let mut buf = [0xffu8; 16];
        // An error is fine; dying is not. (Today: the vanished page reads as zeros.)
        let _ = h.read(0x10_0000, &mut buf);
        assert!(buf == [0; 16] || buf == [0xff; 16], "{buf:?}");
        let _ = h.write(0x10_0000, &buf);
        // Pinned host addresses too (a device writing through its pin).
        let host = h.pin_range(0x100, 2, Prot::RW).unwrap();
        // SAFETY: pinned just above, unpinned below.
        let slice = unsafe { h.pinned_slice(host, 2 * 4096) };
        vm_memory::Bytes::write_obj(&slice, 0x55u8, 4096 + 7).unwrap();
        h.unpin_range(0x100, 2).unwrap();
        space.unmap(0x10_0000, 0x10000, &mut |_, _| {}).unwrap();
        space.check_invariants().unwrap();
        return;
    }
    assert_survived(&run_child(NAME));
}

/// The guest makes the device touch every other page of a 320 MiB mapping whose file shrank
/// to 64 KiB, top down (each fault lower than the last), by `dma_rw` and through pins. One
/// VMA per touched page would pass `vm.max_map_count` (65530) and kill the server.
#[test]
fn test_sigbus_every_other_page_of_shrunken_320mib_map_bounded_vmas_server_survives() {
    const NAME: &str =
        "test_sigbus_every_other_page_of_shrunken_320mib_map_bounded_vmas_server_survives";
    if in_child(NAME) {
        const SIZE: u64 = 320 << 20;
        const KEEP: u64 = 0x10000;
        const IOVA: u64 = 1 << 32;
        let fd = dma_util::memfd(SIZE);
        pwrite(&fd, b"guest", 0);
        let (space, h) = map(&fd, IOVA, SIZE);
        let before = vma_count();
        shrink(&fd, KEEP);
        let pages = SIZE / PAGE_SIZE;
        let mut touched = 0u64;
        let mut page = pages - 1;
        while page * PAGE_SIZE >= KEEP {
            let pfn = IOVA / PAGE_SIZE + page;
            if touched.is_multiple_of(2) {
                let mut buf = [0xffu8; 8];
                h.read(pfn * PAGE_SIZE + 8, &mut buf).unwrap();
                assert_eq!(buf, [0; 8], "page {page}");
            } else {
                assert_eq!(touch_through_pin(&h, pfn, 0x5a), 0, "page {page}");
            }
            touched += 1;
            page -= 2;
        }
        assert!(touched > 40_000, "{touched}");
        let after = vma_count();
        println!("{touched} faults: {before} -> {after} VMAs");
        assert!(
            after <= before + 2,
            "{touched} faults cost {} VMAs ({before} -> {after})",
            after as i64 - before as i64
        );
        // Below the file's end, the mapping is still the file.
        let mut buf = [0u8; 5];
        h.read(IOVA, &mut buf).unwrap();
        assert_eq!(&buf, b"guest");
        h.write(IOVA + 8, b"host").unwrap();
        assert_eq!(pread(&fd, 4, 8), b"host");
        space.unmap(IOVA, SIZE, &mut |_, _| {}).unwrap();
        space.check_invariants().unwrap();
        assert_eq!(
            vmas_of("umdev-dma-test"),
            0,
            "the unmap released the mapping"
        );
        return;
    }
    assert_survived(&run_child(NAME));
}

/// Four device threads read every other page of a shrunken 320 MiB mapping in scattered order
/// (faults on several threads at once, a lower one replacing what a higher one just
/// replaced), while the connection thread maps, shrinks, faults and unmaps small memfds
/// (registry slots reused under the handlers' scans). Repeated: 40 960 reads, 300 churns.
#[test]
fn test_sigbus_concurrent_faults_and_map_churn_bounded_vmas_server_survives() {
    const NAME: &str = "test_sigbus_concurrent_faults_and_map_churn_bounded_vmas_server_survives";
    if in_child(NAME) {
        const SIZE: u64 = 320 << 20;
        const IOVA: u64 = 1 << 32;
        const THREADS: u64 = 4;
        const PAGES: u64 = SIZE / PAGE_SIZE;
        let fd = dma_util::memfd(SIZE);
        let (space, h) = map(&fd, IOVA, SIZE);
        let start = Arc::new(std::sync::Barrier::new(THREADS as usize + 1));
        let done = Arc::new(std::sync::Barrier::new(THREADS as usize + 1));
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (h, start, done) = (h.clone(), start.clone(), done.clone());
                std::thread::spawn(move || {
                    start.wait();
                    for k in 0..PAGES / 2 / THREADS {
                        // 40 503 is coprime with 40 960: every even page once, scattered.
                        let page = 2 * (((k * THREADS + t) * 40_503) % (PAGES / 2));
                        let mut buf = [0xffu8; 8];
                        h.read(IOVA + page * PAGE_SIZE + 16, &mut buf).unwrap();
                        assert_eq!(buf, [0; 8], "page {page}");
                    }
                    done.wait();
                })
            })
            .collect();
        // Thread start-up maps memory of its own (stacks, malloc arenas): count the VMAs of
        // the DMA mapping's address range only.
        let host = h.pin_range(IOVA / PAGE_SIZE, 1, Prot::READ).unwrap();
        h.unpin_range(IOVA / PAGE_SIZE, 1).unwrap();
        assert_eq!(vmas_in(host, host + SIZE), 1);
        shrink(&fd, 0);
        start.wait();
        for i in 0..300u64 {
            let small = dma_util::memfd(8 * PAGE_SIZE);
            let iova = 0x1000_0000;
            space
                .map(DmaMapping {
                    iova,
                    size: 8 * PAGE_SIZE,
                    prot: Prot::RW,
                    fd: Some(small.try_clone().unwrap()),
                    offset: 0,
                })
                .unwrap();
            shrink(&small, (i % 8) * PAGE_SIZE);
            let mut buf = [0xffu8; 4];
            h.read(iova + 7 * PAGE_SIZE, &mut buf).unwrap();
            assert_eq!(buf, [0; 4]);
            space.unmap(iova, 8 * PAGE_SIZE, &mut |_, _| {}).unwrap();
        }
        done.wait();
        let after = vmas_in(host, host + SIZE);
        for w in workers {
            w.join().unwrap();
        }
        // One VMA if the last replacement was the lowest; a few more if a higher replacement
        // raced in after a lower one (never one per page: 40 960 separate pages were read).
        assert!(
            after <= 1 + THREADS as usize,
            "the mapping's range holds {after} VMAs"
        );
        space.unmap(IOVA, SIZE, &mut |_, _| {}).unwrap();
        space.check_invariants().unwrap();
        return;
    }
    assert_survived(&run_child(NAME));
}

const HUGE_PAGE: u64 = 2 << 20;
const FREE_HUGEPAGES: &str = "/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages";

/// A hugetlb memfd (QEMU's hugepage RAM) shrunk by one huge page: a 4 KiB replacement inside
/// a hugetlb VMA fails (EINVAL), so the replacement must cover whole huge pages. The mapping
/// is one 4 KiB page short of two huge pages: its VMA (and munmap) covers both.
#[test]
fn test_sigbus_hugetlb_memfd_shrunk_server_survives_and_unmaps() {
    const NAME: &str = "test_sigbus_hugetlb_memfd_shrunk_server_survives_and_unmaps";
    if in_child(NAME) {
        const SIZE: u64 = 2 * HUGE_PAGE - PAGE_SIZE;
        // SAFETY: memfd_create with a static NUL-terminated name; checked.
        let fd = unsafe {
            libc::memfd_create(
                c"umdev-sigbus-hugetlb".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_HUGETLB | libc::MFD_HUGE_2MB,
            )
        };
        assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
        // SAFETY: fresh fd we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        shrink(&fd, 2 * HUGE_PAGE); // (growing it)
        let (space, h) = map(&fd, 0x4000_0000, SIZE);
        h.write(0x4000_0000, b"guest").unwrap();
        shrink(&fd, HUGE_PAGE);
        let mut buf = [0xffu8; 8];
        h.read(0x4000_0000 + HUGE_PAGE + 0x3008, &mut buf).unwrap();
        assert_eq!(buf, [0; 8]);
        let last = (0x4000_0000 + SIZE) / PAGE_SIZE - 1;
        assert_eq!(touch_through_pin(&h, last, 1), 0);
        let mut buf = [0u8; 5];
        h.read(0x4000_0000, &mut buf).unwrap();
        assert_eq!(&buf, b"guest");
        space.unmap(0x4000_0000, SIZE, &mut |_, _| {}).unwrap();
        space.check_invariants().unwrap();
        assert_eq!(
            vmas_of("umdev-sigbus-hugetlb"),
            0,
            "the unmap released the whole VMA"
        );
        return;
    }
    let free: u64 = std::fs::read_to_string(FREE_HUGEPAGES)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    if free < 2 {
        println!(
            "SKIPPED {NAME}: {free} free 2 MiB huge pages, 2 needed \
             (as root: echo 2 > /proc/sys/vm/nr_hugepages)"
        );
        return;
    }
    assert_survived(&run_child(NAME));
}

/// `raise(SIGBUS)` in a process serving DMA: it must die of SIGBUS, as without umdev.
#[test]
fn test_sigbus_raised_signal_kills_process() {
    const NAME: &str = "test_sigbus_raised_signal_kills_process";
    if in_child(NAME) {
        let fd = dma_util::memfd(0x10000);
        let (_space, _h) = map(&fd, 0x10_0000, 0x10000);
        // SAFETY: raise has no memory-safety preconditions.
        unsafe { libc::raise(libc::SIGBUS) };
        println!("survived raise(SIGBUS)");
        return;
    }
    let out = run_child(NAME);
    assert_killed_by_sigbus(out.status, &describe(&out));
}

/// A hardware memory-error notice (`BUS_MCEERR_AO`, sent by the kernel's memory-failure
/// handling, not raised by an access) must kill the process as it would without umdev.
/// The notice is queued to this thread with that si_code (allowed to oneself).
#[test]
fn test_sigbus_memory_error_notice_kills_process() {
    const NAME: &str = "test_sigbus_memory_error_notice_kills_process";
    if in_child(NAME) {
        let fd = dma_util::memfd(0x10000);
        let (_space, _h) = map(&fd, 0x10_0000, 0x10000);
        // SAFETY: a zeroed siginfo_t is a valid value; we fill in signo and code.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        info.si_signo = libc::SIGBUS;
        info.si_code = libc::BUS_MCEERR_AO;
        // SAFETY: rt_tgsigqueueinfo to this thread with a valid siginfo the kernel copies.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_rt_tgsigqueueinfo,
                libc::getpid(),
                libc::syscall(libc::SYS_gettid),
                libc::SIGBUS,
                &info as *const libc::siginfo_t,
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        println!("survived BUS_MCEERR_AO");
        return;
    }
    let out = run_child(NAME);
    assert_killed_by_sigbus(out.status, &describe(&out));
}

/// `kill -BUS <server>` from another process: it must die of SIGBUS, as without umdev.
#[test]
fn test_sigbus_kill_from_other_process_kills_process() {
    const NAME: &str = "test_sigbus_kill_from_other_process_kills_process";
    if in_child(NAME) {
        let fd = dma_util::memfd(0x10000);
        let (_space, _h) = map(&fd, 0x10_0000, 0x10000);
        println!("ready");
        std::thread::sleep(Duration::from_secs(5));
        println!("survived kill -BUS");
        return;
    }
    let mut proc = child(NAME).stdout(Stdio::piped()).spawn().unwrap();
    let mut out = BufReader::new(proc.stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("ready") {
        line.clear();
        assert_ne!(out.read_line(&mut line).unwrap(), 0, "child exited early");
    }
    // SAFETY: kill of our own child (not yet waited for, so its pid is still its own).
    let rc = unsafe { libc::kill(proc.id() as libc::pid_t, libc::SIGBUS) };
    assert_eq!(rc, 0);
    let status = proc.wait().unwrap();
    assert_killed_by_sigbus(status, "kill -BUS");
}

/// SIGBUS ignored before umdev: a sent SIGBUS stays ignored, and umdev's handler stays
/// installed, so a later shrink fault in a DMA mapping is still recovered.
#[test]
fn test_sigbus_ignored_raised_signal_keeps_recovery_installed() {
    const NAME: &str = "test_sigbus_ignored_raised_signal_keeps_recovery_installed";
    if in_child(NAME) {
        // SAFETY: sets SIGBUS's disposition to SIG_IGN; no handler code involved.
        unsafe { libc::signal(libc::SIGBUS, libc::SIG_IGN) };
        let fd = dma_util::memfd(0x10000);
        let (_space, h) = map(&fd, 0x10_0000, 0x10000);
        // SAFETY: raise has no memory-safety preconditions.
        unsafe { libc::raise(libc::SIGBUS) };
        shrink(&fd, 0);
        let mut buf = [0xffu8; 8];
        h.read(0x10_0000 + 0x8000, &mut buf).unwrap();
        assert_eq!(buf, [0; 8]);
        return;
    }
    assert_survived(&run_child(NAME));
}

/// A SIGBUS from a mapping umdev did not make (here: right next to a DMA mapping that has
/// already recovered a fault) still kills the process.
#[test]
fn test_sigbus_fault_outside_registered_mapping_kills_process() {
    const NAME: &str = "test_sigbus_fault_outside_registered_mapping_kills_process";
    const SIZE: u64 = 0x10000;
    if in_child(NAME) {
        let fd = dma_util::memfd(SIZE);
        let (_space, h) = map(&fd, 0x10_0000, SIZE);
        shrink(&fd, 0);
        assert_eq!(touch_through_pin(&h, 0x100, 1), 0);
        let host = h.pin_range(0x100, SIZE / PAGE_SIZE, Prot::RW).unwrap() as usize;
        let own = dma_util::memfd(SIZE);
        // Just above the DMA mapping if that is free, else just below, else anywhere.
        let mut addr = libc::MAP_FAILED;
        for hint in [host + SIZE as usize, host - SIZE as usize, 0] {
            let fixed = if hint == 0 {
                0
            } else {
                libc::MAP_FIXED_NOREPLACE
            };
            // SAFETY: a new mapping that replaces nothing (MAP_FIXED_NOREPLACE or no hint).
            addr = unsafe {
                libc::mmap(
                    hint as *mut libc::c_void,
                    SIZE as usize,
                    libc::PROT_READ,
                    libc::MAP_SHARED | fixed,
                    own.as_raw_fd(),
                    0,
                )
            };
            if addr != libc::MAP_FAILED {
                break;
            }
        }
        assert_ne!(addr, libc::MAP_FAILED);
        println!("DMA mapping at {host:#x}, own mapping at {addr:?}");
        shrink(&own, 0);
        // SAFETY: a page of our own live mapping, past its file's end: SIGBUS.
        let v = unsafe { std::ptr::read_volatile(addr.cast::<u8>()) };
        println!("survived a SIGBUS outside DMA mappings (read {v})");
        return;
    }
    let out = run_child(NAME);
    assert_killed_by_sigbus(out.status, &describe(&out));
}
