//! Hostile client, one malformed message at a time, over a raw socket: every command with
//! lying sizes, argsz, counts, offsets, flags and fds. Each case must get an error reply
//! with the documented errno (or, where the protocol forbids a reply, none), leave the
//! connection usable, leak no fd (/proc/self/fd counted before and after) and leave no pin
//! or extra mapping behind. Tests of this binary hold a lock so fd counts are exact.

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use std::os::fd::{AsRawFd, RawFd};
use std::time::Instant;

use common::TestServer;
use hostile::*;
use umdev::protocol::dma_map::DmaMapRequest;
use umdev::protocol::feature::encode_feature;
use umdev::protocol::region_access::{encode_write_multi, RegionAccess, WriteOne};
use umdev::protocol::set_irqs::encode_set_irqs;
use umdev::protocol::wire::Put;
use umdev::protocol::{Command, FLAGS_ERROR, FLAGS_NO_REPLY, FLAGS_TYPE_REPLY, HEADER_SIZE};
use umdev::testing::{memfd, RawClient};
use vfio_bindings::bindings::vfio::*;
use vmm_sys_util::eventfd::EventFd;

const EINVAL: u32 = libc::EINVAL as u32;
const ENOSYS: u32 = libc::ENOSYS as u32;
const ENOTSUP: u32 = libc::ENOTSUP as u32;
const E2BIG: u32 = libc::E2BIG as u32;
const EEXIST: u32 = libc::EEXIST as u32;
const EPERM: u32 = libc::EPERM as u32;
const EACCES: u32 = libc::EACCES as u32;

/// The mapping every case runs next to (so overlaps and partial unmaps have a target).
const MAP_IOVA: u64 = 0x10_0000;
const MAP_SIZE: u64 = 0x4000;

fn usable(c: &mut RawClient, what: &str) {
    let a = RegionAccess {
        offset: 0,
        region: 7,
        count: 4,
    };
    let m = c.call(Command::RegionRead as u16, 0, &a.encode(), &[]);
    assert!(
        !m.header.is_error(),
        "{what}: connection no longer usable (errno {})",
        m.header.error
    );
    assert_eq!(m.payload[16..], [0, 1, 2, 3], "{what}: wrong data after");
}

fn u32s(v: &[u32]) -> Vec<u8> {
    let mut p = Vec::new();
    for &x in v {
        p.put_u32(x);
    }
    p
}

fn map_req(flags: u32, offset: u64, iova: u64, size: u64) -> Vec<u8> {
    DmaMapRequest {
        flags,
        offset,
        iova,
        size,
    }
    .encode()
}

fn unmap_req(argsz: u32, flags: u32, iova: u64, size: u64) -> Vec<u8> {
    let mut p = Vec::new();
    p.put_u32(argsz);
    p.put_u32(flags);
    p.put_u64(iova);
    p.put_u64(size);
    p
}

fn access(region: u32, offset: u64, count: u32) -> Vec<u8> {
    RegionAccess {
        offset,
        region,
        count,
    }
    .encode()
}

fn write_one(region: u32, offset: u64, count: u32) -> WriteOne {
    WriteOne {
        access: RegionAccess {
            offset,
            region,
            count,
        },
        data: [0xaa; 8],
    }
}

/// One malformed command: what to send and which errno must come back (`None`: the
/// protocol forbids a reply, the next command must still be answered).
struct Case {
    name: &'static str,
    cmd: u16,
    flags: u32,
    payload: Vec<u8>,
    fds: Vec<RawFd>,
    errno: Option<u32>,
}

fn case(name: &'static str, cmd: Command, payload: Vec<u8>, fds: &[RawFd], errno: u32) -> Case {
    Case {
        name,
        cmd: cmd as u16,
        flags: 0,
        payload,
        fds: fds.to_vec(),
        errno: Some(errno),
    }
}

/// Odd fds the cases attach; all opened before the fd baseline is taken.
struct Fds {
    mem: std::fs::File,
    small: std::fs::File,
    ro: std::fs::File,
    pipe: (std::os::fd::OwnedFd, std::os::fd::OwnedFd),
    dir: std::fs::File,
    efds: Vec<EventFd>,
}

impl Fds {
    fn new() -> Fds {
        let mem = memfd(MAP_SIZE).unwrap();
        let ro = std::fs::File::open(format!("/proc/self/fd/{}", mem.as_raw_fd())).unwrap();
        Fds {
            small: memfd(0x1000).unwrap(),
            ro,
            mem,
            pipe: pipe(),
            dir: dir_fd(std::path::Path::new("/")),
            efds: (0..40)
                .map(|_| EventFd::new(libc::EFD_NONBLOCK).unwrap())
                .collect(),
        }
    }

    fn efd(&self, n: usize) -> Vec<RawFd> {
        self.efds[..n].iter().map(|e| e.as_raw_fd()).collect()
    }
}

fn cases(f: &Fds) -> Vec<Case> {
    use Command::*;
    let mem = f.mem.as_raw_fd();
    let eventfd_flags = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
    let none_flags = VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER;
    let bool_flags = VFIO_IRQ_SET_DATA_BOOL | VFIO_IRQ_SET_ACTION_TRIGGER;
    let logging = |flags: u32, data: &[u8]| encode_feature(8 + data.len() as u32, flags, data);
    let mut v = vec![
        // Header-level: unknown commands and flags, wrong direction, replies as commands.
        case("unknown command 0", Version, vec![], &[], ENOSYS),
        case("legacy DIRTY_PAGES", DirtyPages, vec![0; 16], &[], ENOTSUP),
        case(
            "DMA_READ from the client",
            DmaRead,
            vec![0; 16],
            &[],
            EINVAL,
        ),
        case(
            "DMA_WRITE from the client",
            DmaWrite,
            vec![0; 20],
            &[],
            EINVAL,
        ),
        case("second VERSION", Version, vec![0, 0, 0, 0], &[], EINVAL),
        // Well formed (argsz covers the reply), to a device without migration.
        case("MIG_DATA_READ", MigDataRead, u32s(&[24, 16]), &[], ENOTSUP),
        case(
            "MIG_DATA_READ argsz short",
            MigDataRead,
            u32s(&[8, 16]),
            &[],
            EINVAL,
        ),
        case(
            "MIG_DATA_WRITE short",
            MigDataWrite,
            u32s(&[8, 16]),
            &[],
            EINVAL,
        ),
        // DMA_MAP.
        case(
            "DMA_MAP short",
            DmaMap,
            map_req(3, 0, 0x20_0000, 0x1000)[..24].to_vec(),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP long",
            DmaMap,
            [map_req(3, 0, 0x20_0000, 0x1000), vec![0; 8]].concat(),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP argsz 0xffffffff",
            DmaMap,
            [
                u32s(&[u32::MAX]),
                map_req(3, 0, 0x20_0000, 0x1000)[4..].to_vec(),
            ]
            .concat(),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP flags 0",
            DmaMap,
            map_req(0, 0, 0x20_0000, 0x1000),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP unknown flag",
            DmaMap,
            map_req(7, 0, 0x20_0000, 0x1000),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP size 0",
            DmaMap,
            map_req(3, 0, 0x20_0000, 0),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP iova+size wraps",
            DmaMap,
            map_req(3, 0, u64::MAX - 0xfff, 0x2000),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP offset+size wraps",
            DmaMap,
            map_req(3, u64::MAX - 0xfff, 0x20_0000, 0x2000),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP offset past the file",
            DmaMap,
            map_req(3, MAP_SIZE, 0x20_0000, 0x1000),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP larger than the file",
            DmaMap,
            map_req(3, 0, 0x20_0000, 0x2000),
            &[f.small.as_raw_fd()],
            EINVAL,
        ),
        case(
            "DMA_MAP unaligned iova",
            DmaMap,
            map_req(3, 0, 0x20_0800, 0x1000),
            &[mem],
            EINVAL,
        ),
        case(
            "DMA_MAP overlaps the start",
            DmaMap,
            map_req(3, 0, MAP_IOVA - 0x1000, 0x2000),
            &[mem],
            EEXIST,
        ),
        case(
            "DMA_MAP inside an existing map",
            DmaMap,
            map_req(3, 0, MAP_IOVA + 0x1000, 0x1000),
            &[mem],
            EEXIST,
        ),
        case(
            "DMA_MAP same range again",
            DmaMap,
            map_req(3, 0, MAP_IOVA, MAP_SIZE),
            &[mem],
            EEXIST,
        ),
        case(
            "DMA_MAP covering an existing map",
            DmaMap,
            map_req(3, 0, 0, 0x100_0000),
            &[],
            EEXIST,
        ),
        case(
            "DMA_MAP two fds",
            DmaMap,
            map_req(3, 0, 0x20_0000, 0x1000),
            &[mem, mem],
            EINVAL,
        ),
        case(
            // Not a memfd/tmpfs/hugetlbfs file: refused before any mmap (dma_map_backing.rs).
            "DMA_MAP pipe fd",
            DmaMap,
            map_req(1, 0, 0x20_0000, 0x1000),
            &[f.pipe.0.as_raw_fd()],
            EPERM,
        ),
        case(
            "DMA_MAP directory fd",
            DmaMap,
            map_req(1, 0, 0x20_0000, 0x1000),
            &[f.dir.as_raw_fd()],
            EPERM,
        ),
        case(
            "DMA_MAP writable map of a read-only fd",
            DmaMap,
            map_req(3, 0, 0x20_0000, 0x1000),
            &[f.ro.as_raw_fd()],
            EACCES,
        ),
        // DMA_UNMAP (type1v2: a range covering no map, or covering the map whole, succeeds
        // and is tested in dma_unmap_sweep.rs; a range that splits the map is EINVAL).
        case(
            "DMA_UNMAP first half",
            DmaUnmap,
            unmap_req(24, 0, MAP_IOVA, 0x2000),
            &[],
            EINVAL,
        ),
        case(
            "DMA_UNMAP second half",
            DmaUnmap,
            unmap_req(24, 0, MAP_IOVA + 0x2000, 0x2000),
            &[],
            EINVAL,
        ),
        case(
            "DMA_UNMAP straddling the start",
            DmaUnmap,
            unmap_req(24, 0, MAP_IOVA - 0x1000, 0x2000),
            &[],
            EINVAL,
        ),
        case(
            "DMA_UNMAP wraps",
            DmaUnmap,
            unmap_req(24, 0, u64::MAX - 0xfff, 0x2000),
            &[],
            EINVAL,
        ),
        case(
            "DMA_UNMAP size 0",
            DmaUnmap,
            unmap_req(24, 0, MAP_IOVA, 0),
            &[],
            EINVAL,
        ),
        case(
            "DMA_UNMAP argsz 16",
            DmaUnmap,
            unmap_req(16, 0, MAP_IOVA, MAP_SIZE),
            &[],
            EINVAL,
        ),
        case(
            "DMA_UNMAP short",
            DmaUnmap,
            unmap_req(24, 0, MAP_IOVA, MAP_SIZE)[..20].to_vec(),
            &[],
            EINVAL,
        ),
        case(
            "DMA_UNMAP legacy UNMAP_ALL",
            DmaUnmap,
            unmap_req(24, 4, MAP_IOVA, MAP_SIZE),
            &[],
            ENOTSUP,
        ),
        case(
            "DMA_UNMAP unknown flag",
            DmaUnmap,
            unmap_req(24, 0x100, MAP_IOVA, MAP_SIZE),
            &[],
            EINVAL,
        ),
        case(
            "DMA_UNMAP with an fd",
            DmaUnmap,
            unmap_req(24, 0, MAP_IOVA, MAP_SIZE),
            &[mem],
            EINVAL,
        ),
        // DEVICE_GET_INFO / REGION_INFO / REGION_IO_FDS / IRQ_INFO.
        case(
            "GET_INFO argsz 8",
            DeviceGetInfo,
            u32s(&[8, 0, 0, 0]),
            &[],
            EINVAL,
        ),
        case("GET_INFO short", DeviceGetInfo, u32s(&[16, 0]), &[], EINVAL),
        case(
            "GET_INFO with an fd",
            DeviceGetInfo,
            u32s(&[16, 0, 0, 0]),
            &[mem],
            EINVAL,
        ),
        case(
            "GET_REGION_INFO index 99",
            DeviceGetRegionInfo,
            u32s(&[32, 0, 99, 0, 0, 0, 0, 0]),
            &[],
            EINVAL,
        ),
        case(
            "GET_REGION_INFO index u32::MAX",
            DeviceGetRegionInfo,
            u32s(&[32, 0, u32::MAX, 0, 0, 0, 0, 0]),
            &[],
            EINVAL,
        ),
        case(
            "GET_REGION_INFO argsz 16",
            DeviceGetRegionInfo,
            u32s(&[16, 0, 0, 0, 0, 0, 0, 0]),
            &[],
            EINVAL,
        ),
        case(
            "GET_REGION_INFO short",
            DeviceGetRegionInfo,
            u32s(&[32, 0, 0]),
            &[],
            EINVAL,
        ),
        case(
            "GET_REGION_INFO with an fd",
            DeviceGetRegionInfo,
            u32s(&[32, 0, 0, 0, 0, 0, 0, 0]),
            &[mem],
            EINVAL,
        ),
        case(
            "GET_REGION_IO_FDS index 99",
            DeviceGetRegionIoFds,
            u32s(&[16, 0, 99, 0]),
            &[],
            EINVAL,
        ),
        case(
            "GET_IRQ_INFO index 99",
            DeviceGetIrqInfo,
            u32s(&[16, 0, 99, 0]),
            &[],
            EINVAL,
        ),
        case(
            "GET_IRQ_INFO argsz 4",
            DeviceGetIrqInfo,
            u32s(&[4, 0, 0, 0]),
            &[],
            EINVAL,
        ),
        // SET_IRQS.
        case(
            "SET_IRQS index 99",
            DeviceSetIrqs,
            encode_set_irqs(none_flags, 99, 0, 1, &[]),
            &[],
            EINVAL,
        ),
        case(
            "SET_IRQS start+count wraps",
            DeviceSetIrqs,
            encode_set_irqs(none_flags, 1, u32::MAX, 2, &[]),
            &[],
            EINVAL,
        ),
        case(
            "SET_IRQS vectors past the index",
            DeviceSetIrqs,
            encode_set_irqs(none_flags, 0, 1, 1, &[]),
            &[],
            EINVAL,
        ),
        case(
            "SET_IRQS huge count, one fd",
            DeviceSetIrqs,
            encode_set_irqs(eventfd_flags, 1, 0, u32::MAX, &[]),
            &f.efd(1),
            EINVAL,
        ),
        case(
            "SET_IRQS two data bits",
            DeviceSetIrqs,
            encode_set_irqs(eventfd_flags | VFIO_IRQ_SET_DATA_BOOL, 1, 0, 1, &[]),
            &[],
            EINVAL,
        ),
        case(
            "SET_IRQS no action bit",
            DeviceSetIrqs,
            encode_set_irqs(VFIO_IRQ_SET_DATA_NONE, 1, 0, 1, &[]),
            &[],
            EINVAL,
        ),
        case(
            "SET_IRQS too few fds",
            DeviceSetIrqs,
            encode_set_irqs(eventfd_flags, 1, 0, 2, &[]),
            &f.efd(1),
            EINVAL,
        ),
        case(
            "SET_IRQS too many fds",
            DeviceSetIrqs,
            encode_set_irqs(eventfd_flags, 1, 0, 1, &[]),
            &f.efd(2),
            EINVAL,
        ),
        case(
            "SET_IRQS fds past the index",
            DeviceSetIrqs,
            encode_set_irqs(eventfd_flags, 1, 0, 3, &[]),
            &f.efd(3),
            EINVAL,
        ),
        case(
            "SET_IRQS 17 fds (> max_msg_fds)",
            DeviceSetIrqs,
            encode_set_irqs(eventfd_flags, 1, 0, 17, &[]),
            &f.efd(17),
            EINVAL,
        ),
        case(
            "SET_IRQS 40 fds (control data truncated)",
            DeviceSetIrqs,
            encode_set_irqs(eventfd_flags, 1, 0, 40, &[]),
            &f.efd(40),
            EINVAL,
        ),
        case(
            "SET_IRQS fds with DATA_NONE",
            DeviceSetIrqs,
            encode_set_irqs(none_flags, 1, 0, 1, &[]),
            &f.efd(1),
            EINVAL,
        ),
        case(
            "SET_IRQS bool data short",
            DeviceSetIrqs,
            encode_set_irqs(bool_flags, 1, 0, 2, &[1]),
            &[],
            EINVAL,
        ),
        case(
            "SET_IRQS argsz lies",
            DeviceSetIrqs,
            [
                u32s(&[64]),
                encode_set_irqs(none_flags, 1, 0, 1, &[])[4..].to_vec(),
            ]
            .concat(),
            &[],
            EINVAL,
        ),
        case(
            "SET_IRQS short",
            DeviceSetIrqs,
            u32s(&[12, none_flags, 1]),
            &[],
            EINVAL,
        ),
        // REGION_READ / REGION_WRITE / WRITE_MULTI.
        case(
            "REGION_READ region 99",
            RegionRead,
            access(99, 0, 4),
            &[],
            EINVAL,
        ),
        case(
            "REGION_READ empty region",
            RegionRead,
            access(1, 0, 4),
            &[],
            EINVAL,
        ),
        case(
            "REGION_READ offset at the end",
            RegionRead,
            access(0, 4096, 4),
            &[],
            EINVAL,
        ),
        case(
            "REGION_READ straddles the end",
            RegionRead,
            access(0, 4094, 4),
            &[],
            EINVAL,
        ),
        case(
            "REGION_READ offset+count wraps",
            RegionRead,
            access(0, u64::MAX - 1, 4),
            &[],
            EINVAL,
        ),
        case(
            "REGION_READ count 0",
            RegionRead,
            access(0, 0, 0),
            &[],
            EINVAL,
        ),
        case(
            "REGION_READ count over max_data_xfer_size",
            RegionRead,
            access(0, 0, 2 << 20),
            &[],
            E2BIG,
        ),
        case(
            "REGION_READ count u32::MAX",
            RegionRead,
            access(0, 0, u32::MAX),
            &[],
            E2BIG,
        ),
        case(
            "REGION_READ short",
            RegionRead,
            access(0, 0, 4)[..12].to_vec(),
            &[],
            EINVAL,
        ),
        case(
            "REGION_READ with an fd",
            RegionRead,
            access(0, 0, 4),
            &[mem],
            EINVAL,
        ),
        case(
            "REGION_WRITE data shorter than count",
            RegionWrite,
            [access(0, 0, 8), vec![1; 4]].concat(),
            &[],
            EINVAL,
        ),
        case(
            "REGION_WRITE data longer than count",
            RegionWrite,
            [access(0, 0, 4), vec![1; 8]].concat(),
            &[],
            EINVAL,
        ),
        case(
            "REGION_WRITE past the end",
            RegionWrite,
            [access(0, 4092, 8), vec![1; 8]].concat(),
            &[],
            EINVAL,
        ),
        case(
            "REGION_WRITE config past the end",
            RegionWrite,
            [access(7, 255, 2), vec![1; 2]].concat(),
            &[],
            EINVAL,
        ),
        case(
            "WRITE_MULTI count 0",
            RegionWriteMulti,
            0u64.to_ne_bytes().to_vec(),
            &[],
            EINVAL,
        ),
        case(
            "WRITE_MULTI count u64::MAX",
            RegionWriteMulti,
            [u64::MAX.to_ne_bytes().to_vec(), vec![0; 24]].concat(),
            &[],
            EINVAL,
        ),
        case(
            "WRITE_MULTI count lies",
            RegionWriteMulti,
            [
                2u64.to_ne_bytes().to_vec(),
                encode_write_multi(&[write_one(0, 0, 4)])[8..].to_vec(),
            ]
            .concat(),
            &[],
            EINVAL,
        ),
        case(
            "WRITE_MULTI entry past the region",
            RegionWriteMulti,
            encode_write_multi(&[write_one(0, 0, 4), write_one(0, 4092, 8)]),
            &[],
            EINVAL,
        ),
        case(
            "WRITE_MULTI entry count 9",
            RegionWriteMulti,
            encode_write_multi(&[write_one(0, 0, 9)]),
            &[],
            E2BIG,
        ),
        // DEVICE_RESET / DEVICE_FEATURE.
        case(
            "DEVICE_RESET with payload",
            DeviceReset,
            vec![0; 8],
            &[],
            EINVAL,
        ),
        case(
            "DEVICE_RESET with an fd",
            DeviceReset,
            vec![],
            &[mem],
            EINVAL,
        ),
        case(
            "FEATURE argsz 4",
            DeviceFeature,
            encode_feature(4, VFIO_DEVICE_FEATURE_PROBE | 6, &[]),
            &[],
            EINVAL,
        ),
        case(
            "FEATURE unknown feature",
            DeviceFeature,
            encode_feature(8, VFIO_DEVICE_FEATURE_GET | 0xffff, &[]),
            &[],
            ENOTSUP,
        ),
        case(
            "FEATURE no operation",
            DeviceFeature,
            encode_feature(8, 6, &[]),
            &[],
            EINVAL,
        ),
        case(
            "LOGGING_START num_ranges huge",
            DeviceFeature,
            logging(
                VFIO_DEVICE_FEATURE_SET | 6,
                &[4096u64.to_ne_bytes().to_vec(), u32s(&[u32::MAX, 0])].concat(),
            ),
            &[],
            EINVAL,
        ),
        case(
            "LOGGING_START range wraps",
            DeviceFeature,
            logging(
                VFIO_DEVICE_FEATURE_SET | 6,
                &[
                    4096u64.to_ne_bytes().to_vec(),
                    u32s(&[1, 0]),
                    (u64::MAX - 10).to_ne_bytes().to_vec(),
                    4096u64.to_ne_bytes().to_vec(),
                ]
                .concat(),
            ),
            &[],
            EINVAL,
        ),
        case(
            "LOGGING_REPORT bitmap over the limit",
            DeviceFeature,
            logging(
                VFIO_DEVICE_FEATURE_GET | 8,
                &[
                    0u64.to_ne_bytes(),
                    (1u64 << 62).to_ne_bytes(),
                    4096u64.to_ne_bytes(),
                ]
                .concat(),
            ),
            &[],
            E2BIG,
        ),
        case(
            "LOGGING_REPORT page size 3",
            DeviceFeature,
            logging(
                VFIO_DEVICE_FEATURE_GET | 8,
                &[
                    0u64.to_ne_bytes(),
                    4096u64.to_ne_bytes(),
                    3u64.to_ne_bytes(),
                ]
                .concat(),
            ),
            &[],
            EINVAL,
        ),
    ];
    v[0].cmd = 0;
    let raw = |name, cmd: u16, flags: u32, payload: Vec<u8>, errno| Case {
        name,
        cmd,
        flags,
        payload,
        fds: vec![],
        errno,
    };
    v.extend([
        raw("unknown command 19", 19, 0, vec![], Some(ENOSYS)),
        raw(
            "unknown command 0xffff",
            0xffff,
            0,
            vec![1; 64],
            Some(ENOSYS),
        ),
        raw(
            "unknown header flag bit",
            Command::DeviceReset as u16,
            1 << 9,
            vec![],
            Some(EINVAL),
        ),
        raw(
            "message type 2",
            Command::DeviceReset as u16,
            2,
            vec![],
            Some(EINVAL),
        ),
        raw(
            "message type 15",
            Command::DeviceReset as u16,
            15,
            vec![],
            Some(EINVAL),
        ),
        raw(
            "No_reply on GET_INFO",
            Command::DeviceGetInfo as u16,
            FLAGS_NO_REPLY,
            u32s(&[16, 0, 0, 0]),
            None,
        ),
        raw(
            "No_reply on a bad REGION_WRITE",
            Command::RegionWrite as u16,
            FLAGS_NO_REPLY,
            access(0, 4096, 0),
            None,
        ),
        raw(
            "unsolicited reply",
            Command::RegionRead as u16,
            FLAGS_TYPE_REPLY,
            vec![0; 20],
            None,
        ),
        raw(
            "unsolicited error reply",
            Command::DmaRead as u16,
            FLAGS_TYPE_REPLY | FLAGS_ERROR,
            vec![],
            None,
        ),
        raw(
            "unsolicited DMA_READ reply with data",
            Command::DmaRead as u16,
            FLAGS_TYPE_REPLY,
            vec![7; 4096],
            None,
        ),
    ]);
    v
}

#[test]
fn test_hostile_malformed_every_command_errno_usable_no_leak() {
    let _g = serial();
    let ts = TestServer::start_with(|c| c.write_multiple = true);
    let mut c = RawClient::new_default(ts.path());
    let f = Fds::new();
    let ok = c.call(
        Command::DmaMap as u16,
        0,
        &map_req(3, 0, MAP_IOVA, MAP_SIZE),
        &[f.mem.as_raw_fd()],
    );
    assert!(
        !ok.header.is_error(),
        "setup map: errno {}",
        ok.header.error
    );
    usable(&mut c, "setup");
    let baseline = open_fds();
    let t0 = Instant::now();
    let all = cases(&f);
    let n = all.len();
    for k in all {
        eprintln!("case: {}", k.name);
        let id = c.send(k.cmd, k.flags, &k.payload, &k.fds);
        if let Some(errno) = k.errno {
            let m = c.recv();
            assert_eq!(m.header.msg_id, id, "{}: reply id", k.name);
            assert_eq!(m.header.command, k.cmd, "{}: reply command", k.name);
            assert_eq!(
                m.header.flags & 0xf,
                FLAGS_TYPE_REPLY,
                "{}: reply type",
                k.name
            );
            assert!(m.header.is_error(), "{}: unexpectedly succeeded", k.name);
            assert_eq!(m.header.error, errno, "{}: errno", k.name);
            assert_eq!(m.header.msg_size as usize, HEADER_SIZE, "{}", k.name);
            assert!(m.fds.is_empty(), "{}: fds in an error reply", k.name);
        }
        usable(&mut c, k.name);
        settle_fds(baseline, k.name);
        settle_dma(ts.dma(), 1, k.name);
    }
    eprintln!("{n} malformed cases in {:?}", t0.elapsed());
    // Mappings made before still work: the device reads the mapped memory.
    let st = ts.state();
    assert_eq!(st.unmaps, vec![], "a rejected unmap reached the device");
}

/// Send `cmd` with a header whose size field says `msg_size`, followed by `body`.
fn send_lying(c: &mut RawClient, id: u16, cmd: u16, msg_size: u32, body: &[u8]) {
    let mut m = raw_header(id, cmd, msg_size, 0).to_vec();
    m.extend_from_slice(body);
    c.send_raw(&m, &[]);
}

fn expect_errno(c: &mut RawClient, id: u16, errno: u32, what: &str) {
    let m = c.recv();
    assert_eq!(m.header.msg_id, id, "{what}: reply id");
    assert!(m.header.is_error(), "{what}: no error");
    assert_eq!(m.header.error, errno, "{what}: errno");
}

#[test]
fn test_hostile_size_larger_than_payload_following_bytes_consumed_einval() {
    let _g = serial();
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let baseline = open_fds();
    // DMA_UNMAP claims 32 payload bytes but carries its 24; the server waits for the rest,
    // so the next 8 bytes the client sends belong to this message.
    let body = unmap_req(24, 0, MAP_IOVA, MAP_SIZE);
    send_lying(&mut c, 1, Command::DmaUnmap as u16, 16 + 32, &body);
    std::thread::sleep(std::time::Duration::from_millis(50));
    c.send_raw(&[0; 8], &[]);
    expect_errno(&mut c, 1, EINVAL, "32-byte DMA_UNMAP");
    usable(&mut c, "after a long size field");
    settle_fds(baseline, "size larger than payload");
    settle_dma(ts.dma(), 0, "size larger than payload");
}

#[test]
fn test_hostile_size_smaller_than_payload_rest_is_next_message() {
    let _g = serial();
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let baseline = open_fds();
    // REGION_READ says 8 payload bytes but 16 follow: the server reads exactly msg_size,
    // answers EINVAL, and takes the next 16 bytes as the next header. Here those bytes
    // (8 trailing + 8 more) happen to form an unknown command, answered with ENOSYS.
    let next = raw_header(2, 0x77, 16, 0);
    let mut body = access(7, 0, 4)[..8].to_vec();
    body.extend_from_slice(&next[..8]);
    send_lying(&mut c, 1, Command::RegionRead as u16, 16 + 8, &body);
    c.send_raw(&next[8..], &[]);
    expect_errno(&mut c, 1, EINVAL, "8-byte REGION_READ");
    expect_errno(&mut c, 2, ENOSYS, "the bytes after it");
    usable(&mut c, "after a short size field");
    settle_fds(baseline, "size smaller than payload");
}

#[test]
fn test_hostile_size_below_header_einval_then_closed_next_client_ok() {
    let _g = serial();
    let ts = TestServer::start();
    let baseline = open_fds();
    {
        let mut c = RawClient::new_default(ts.path());
        let mem = memfd(MAP_SIZE).unwrap();
        let r = c.call(
            Command::DmaMap as u16,
            0,
            &map_req(3, 0, MAP_IOVA, MAP_SIZE),
            &[mem.as_raw_fd()],
        );
        assert!(!r.header.is_error());
        // Framing is lost: the only safe answer is an error and a hang-up.
        send_lying(&mut c, 9, Command::DeviceGetInfo as u16, 8, &[]);
        expect_errno(&mut c, 9, EINVAL, "msg_size 8");
        assert!(
            closed_by_peer(c.stream()),
            "connection kept after lost framing"
        );
    }
    settle_dma(ts.dma(), 0, "after lost framing");
    settle_fds(baseline, "after lost framing");
    let mut c = RawClient::new_default(ts.path());
    usable(&mut c, "next client");
}

#[test]
fn test_hostile_header_split_across_writes_served() {
    let _g = serial();
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let a = access(7, 4, 4);
    let mut m = raw_header(5, Command::RegionRead as u16, 32, 0).to_vec();
    m.extend_from_slice(&a);
    for chunk in [&m[..3], &m[3..16], &m[16..20], &m[20..]] {
        c.send_raw(chunk, &[]);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let r = c.recv();
    assert_eq!(r.header.msg_id, 5);
    assert!(!r.header.is_error());
    assert_eq!(r.payload[16..], [4, 5, 6, 7]);
}

#[test]
fn test_hostile_one_gib_size_field_e2big_without_allocating() {
    let _g = serial();
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let rss0 = rss_kib();
    let size: u32 = 1 << 30;
    send_lying(
        &mut c,
        3,
        Command::RegionWrite as u16,
        size,
        &access(0, 0, 4),
    );
    // The server must not buffer 1 GiB: it skips the declared bytes as they arrive.
    let chunk = vec![0u8; 1 << 20];
    let mut left = size as usize - 16 - 16;
    let t0 = Instant::now();
    while left > 0 {
        let n = left.min(chunk.len());
        c.send_raw(&chunk[..n], &[]);
        left -= n;
    }
    expect_errno(&mut c, 3, E2BIG, "1 GiB message");
    let grown = rss_kib().saturating_sub(rss0);
    eprintln!(
        "1 GiB message skipped in {:?}, RSS grew {grown} KiB",
        t0.elapsed()
    );
    assert!(
        grown < 32 * 1024,
        "RSS grew {grown} KiB for a 1 GiB message"
    );
    usable(&mut c, "after the 1 GiB message");
}

#[test]
fn test_hostile_interleaved_ids_replies_in_order_with_their_ids() {
    let _g = serial();
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    // Sent back to back without waiting: duplicate, descending and wrapping ids, and an
    // unsolicited reply in the middle.
    // (id, command, flags, payload, expected errno)
    type Sent = (u16, u16, u32, Vec<u8>, Option<u32>);
    let msgs: [Sent; 6] = [
        (7, Command::RegionRead as u16, 0, access(7, 0, 4), None),
        (
            7,
            Command::RegionRead as u16,
            0,
            access(99, 0, 4),
            Some(EINVAL),
        ),
        (
            3,
            Command::DeviceGetInfo as u16,
            0,
            u32s(&[16, 0, 0, 0]),
            None,
        ),
        (
            0xffff,
            Command::DeviceGetInfo as u16,
            FLAGS_TYPE_REPLY,
            vec![],
            None,
        ),
        (0xffff, 0x55, 0, vec![], Some(ENOSYS)),
        (0, Command::RegionRead as u16, 0, access(7, 8, 4), None),
    ];
    let mut all = Vec::new();
    for (id, cmd, flags, p, _) in &msgs {
        let mut m = raw_header(*id, *cmd, (16 + p.len()) as u32, *flags).to_vec();
        m.extend_from_slice(p);
        all.extend_from_slice(&m);
    }
    c.send_raw(&all, &[]);
    for (id, cmd, flags, _, errno) in msgs.iter().filter(|m| m.2 != FLAGS_TYPE_REPLY) {
        let r = c.recv();
        assert_eq!((r.header.msg_id, r.header.command), (*id, *cmd), "{flags}");
        match errno {
            Some(e) => assert_eq!(r.header.error, *e, "id {id}"),
            None => assert!(!r.header.is_error(), "id {id}: errno {}", r.header.error),
        }
    }
    usable(&mut c, "after interleaved ids");
}

#[test]
fn test_hostile_fd_closed_by_client_after_map_mapping_still_valid() {
    let _g = serial();
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let baseline = open_fds();
    // A closed fd cannot even be sent: the client's own sendmsg fails with EBADF.
    let closed = {
        let f = memfd(4096).unwrap();
        f.as_raw_fd()
    };
    let h = raw_header(1, Command::DmaMap as u16, 48, 0);
    let mut m = h.to_vec();
    m.extend_from_slice(&map_req(3, 0, MAP_IOVA, MAP_SIZE));
    let err = umdev::server::socket_io::send_message(c.stream(), &m, &[closed]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EBADF));
    // An fd the client closes right after sending: the server holds its own reference.
    {
        use std::os::unix::fs::FileExt;
        let mem = memfd(MAP_SIZE).unwrap();
        mem.write_all_at(b"hostile!", 0x1000).unwrap();
        let r = c.call(Command::DmaMap as u16, 0, &m[16..], &[mem.as_raw_fd()]);
        assert!(!r.header.is_error(), "map: errno {}", r.header.error);
    }
    let dma = ts.state().dma.clone().unwrap();
    let mut buf = [0u8; 8];
    dma.read(MAP_IOVA + 0x1000, &mut buf).unwrap();
    assert_eq!(&buf, b"hostile!");
    // The server's reference is the only one now; unmapping releases it.
    let r = c.call(
        Command::DmaUnmap as u16,
        0,
        &unmap_req(24, 0, MAP_IOVA, MAP_SIZE),
        &[],
    );
    assert!(!r.header.is_error());
    settle_fds(baseline, "after unmap");
    settle_dma(ts.dma(), 0, "after unmap");
}

#[test]
fn test_hostile_maps_beyond_limit_enospc_then_usable() {
    let _g = serial();
    // The negotiated max_dma_maps (min of the client's and the server's) is enforced.
    let ts = TestServer::start_with(|c| c.max_dma_maps = 8);
    let mem = memfd(0x1000).unwrap();
    let baseline = open_fds();
    let mut c = RawClient::new_default(ts.path());
    let connected = open_fds();
    let map_at = |c: &mut RawClient, i: u64| {
        let fds = if i.is_multiple_of(2) {
            vec![mem.as_raw_fd()]
        } else {
            vec![]
        };
        c.call(
            Command::DmaMap as u16,
            0,
            &map_req(3, 0, 0x100_0000 + i * 0x1000, 0x1000),
            &fds,
        )
    };
    for i in 0..8 {
        let r = map_at(&mut c, i);
        assert!(!r.header.is_error(), "map {i}: errno {}", r.header.error);
    }
    for i in 8..12 {
        let r = map_at(&mut c, i);
        assert!(r.header.is_error(), "map {i} beyond the limit accepted");
        assert_eq!(r.header.error, libc::ENOSPC as u32);
    }
    assert_eq!(ts.dma().stats().maps, 8);
    usable(&mut c, "at the map limit");
    // Making room lets the next map in.
    let r = c.call(
        Command::DmaUnmap as u16,
        0,
        &unmap_req(24, 0, 0x100_0000, 0x1000),
        &[],
    );
    assert!(!r.header.is_error());
    assert!(!map_at(&mut c, 20).header.is_error());
    // Rejected maps kept no fd (a mapping keeps its memory, not the fd).
    settle_fds(connected, "at the map limit");
    drop(c);
    settle_dma(ts.dma(), 0, "after hang-up at the limit");
    settle_fds(baseline, "after hang-up at the limit");
}

/// Found by the `server_stream` fuzz target (artifact oom-100c440f…): an fd-less DMA_MAP of
/// 0x9000600004000 bytes made the DMA layer allocate pin-table slots for 2.5 PB of pages
/// (gigabytes) and the process ran out of memory. The server now bounds the bytes one
/// client may have mapped (`ServerConfig::max_dma_mapped_bytes`, ENOSPC beyond).
#[test]
fn test_hostile_huge_fdless_map_enospc_without_allocating() {
    let _g = serial();
    let ts = TestServer::start();
    let mut c = RawClient::new_default(ts.path());
    let rss0 = rss_kib();
    for size in [0x9000600004000u64, 1 << 62, 1 << 50] {
        let iova: u64 = 0x80_0000;
        let Some(_) = iova.checked_add(size) else {
            continue;
        };
        let r = c.call(Command::DmaMap as u16, 0, &map_req(3, 0, iova, size), &[]);
        assert!(r.header.is_error(), "map of {size:#x} accepted");
        assert_eq!(r.header.error, libc::ENOSPC as u32, "size {size:#x}");
    }
    let grown = rss_kib().saturating_sub(rss0);
    assert!(grown < 16 * 1024, "RSS grew {grown} KiB for refused maps");
    // A large map inside the budget still works (1 TiB, fd-less), and is released.
    let r = c.call(
        Command::DmaMap as u16,
        0,
        &map_req(3, 0, 1 << 40, 1 << 40),
        &[],
    );
    assert!(!r.header.is_error(), "1 TiB map: errno {}", r.header.error);
    let r = c.call(
        Command::DmaUnmap as u16,
        0,
        &unmap_req(24, 0, 1 << 40, 1 << 40),
        &[],
    );
    assert!(!r.header.is_error());
    usable(&mut c, "after huge maps");
    settle_dma(ts.dma(), 0, "after huge maps");
}

#[test]
fn test_hostile_mapped_bytes_budget_configurable_freed_by_unmap() {
    let _g = serial();
    let ts = TestServer::start_with(|c| c.max_dma_mapped_bytes = 1 << 30);
    let mut c = RawClient::new_default(ts.path());
    let half = 1u64 << 29;
    for i in 0..2 {
        let r = c.call(
            Command::DmaMap as u16,
            0,
            &map_req(3, 0, i * half, half),
            &[],
        );
        assert!(!r.header.is_error(), "map {i}: errno {}", r.header.error);
    }
    let r = c.call(
        Command::DmaMap as u16,
        0,
        &map_req(3, 0, 2 * half, 0x1000),
        &[],
    );
    assert_eq!(r.header.error, libc::ENOSPC as u32, "over the budget");
    let r = c.call(Command::DmaUnmap as u16, 0, &unmap_req(24, 0, 0, half), &[]);
    assert!(!r.header.is_error());
    let r = c.call(
        Command::DmaMap as u16,
        0,
        &map_req(3, 0, 2 * half, half),
        &[],
    );
    assert!(!r.header.is_error(), "budget not freed by the unmap");
    // A new client starts from zero.
    drop(c);
    settle_dma(ts.dma(), 0, "after hang-up");
    let mut c = RawClient::new_default(ts.path());
    let r = c.call(Command::DmaMap as u16, 0, &map_req(3, 0, 0, 1 << 30), &[]);
    assert!(!r.header.is_error(), "budget kept across clients");
}
