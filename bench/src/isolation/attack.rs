//! The hostile clients of `bench isolation` (issue 17's findings 1–3), each against the
//! instance it is attached to, and the state each leaves in place while the victims
//! measure:
//!
//! - [`Attack::Idle`]: a client that connects and does nothing: the control run, whose
//!   ratios are the noise of the machine.
//! - [`Attack::MapFlood`]: as many fd-backed DMA maps as the server allows (one page of
//!   one memfd each, at every other page of the file, so the kernel cannot merge their
//!   VMAs), capped by `--maps`; the maps are held.
//! - [`Attack::FdFlood`]: guest RAM without an fd and a ring in it; the doorbell makes the
//!   GPU's fetcher send a DMA_READ that the client never answers; the client then stops
//!   reading and sends REGION_READs carrying 16 fds each, until a send would block for
//!   100 ms (back-pressure) or `--fd-messages` are sent.
//! - [`Attack::DiskFile`]: a DMA_MAP of a regular file on a disk filesystem (not tmpfs or
//!   hugetlbfs: memory whose faults the client's filesystem controls); accepted or
//!   refused is recorded, an accepted map is held.
//!
//! A migration frame or PRE_COPY flood (finding 4) is not an attack here: it needs a
//! migration driver on the hostile side; `tests/` covers it.

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use umdev::device::region_index;
use umdev::protocol::Command as Wire;
use umdev::testing::{DeviceAccess, FdlessMemory, RawClient, Vmm, DEFAULT_CAPS};
use umdev_devices::gpu::commands::Command;
use umdev_devices::gpu::regs::{
    REG_RING_BASE_HI, REG_RING_BASE_LO, REG_RING_CTRL, REG_RING_SIZE, REG_RING_TAIL,
};

/// The attacks (see the module doc).
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum Attack {
    /// A client that does nothing (the control: the machine's noise).
    Idle,
    /// Fd-backed DMA maps, as many as the server allows (capped by --maps).
    MapFlood,
    /// An unanswered DMA_READ, replies not read, commands with 16 fds each.
    FdFlood,
    /// A DMA_MAP of a regular file on a disk filesystem.
    DiskFile,
}

impl Attack {
    /// Every attack, the control first.
    pub const ALL: [Attack; 4] = [
        Attack::Idle,
        Attack::MapFlood,
        Attack::FdFlood,
        Attack::DiskFile,
    ];

    /// The name on the command line and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Attack::Idle => "idle",
            Attack::MapFlood => "map-flood",
            Attack::FdFlood => "fd-flood",
            Attack::DiskFile => "disk-file",
        }
    }
}

/// How big the attacks are.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct AttackSizes {
    /// Most DMA maps of the map flood (it stops earlier at the server's first refusal).
    pub maps: u32,
    /// Most messages of the fd flood (16 fds each).
    pub fd_messages: u32,
    /// Directory of the disk file (`None`: the first of $TMPDIR, /var/tmp and the
    /// current directory that is not tmpfs or hugetlbfs).
    pub disk_dir: Option<PathBuf>,
}

/// What an attack did.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct AttackOutcome {
    /// One line: what was sent and what the server did with it.
    pub summary: String,
    /// Requests the server accepted (maps made, messages sent).
    pub accepted: u64,
    /// The first refusal (errno and message), if any.
    pub refused: Option<String>,
    /// Time to set the attack up, s.
    pub setup_s: f64,
}

/// A running attack: the hostile client and what it holds, until dropped.
pub struct Hostile {
    _vmm: Option<Vmm>,
    _held: Vec<File>,
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// The filesystem type (`statfs` f_type) of `path`.
pub fn fs_type(path: &Path) -> std::io::Result<i64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: statfs is plain data; all-zero is a valid value.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-pointer for the call.
    if unsafe { libc::statfs(c.as_ptr(), &mut s) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)]
    Ok(s.f_type as i64)
}

/// Whether a filesystem type is memory whose faults no client controls.
pub fn is_memory_fs(f_type: i64) -> bool {
    f_type == TMPFS_MAGIC || f_type == HUGETLBFS_MAGIC
}

fn disk_dir(asked: Option<&Path>) -> Result<(PathBuf, i64), String> {
    if let Some(d) = asked {
        let t = fs_type(d).map_err(|e| format!("{}: {e}", d.display()))?;
        return Ok((d.to_owned(), t));
    }
    let mut tried = Vec::new();
    for d in [
        std::env::temp_dir(),
        PathBuf::from("/var/tmp"),
        std::env::current_dir().unwrap_or_default(),
    ] {
        match fs_type(&d) {
            Ok(t) if !is_memory_fs(t) => return Ok((d, t)),
            Ok(t) => tried.push(format!("{} (f_type {t:#x})", d.display())),
            Err(e) => tried.push(format!("{}: {e}", d.display())),
        }
    }
    Err(format!(
        "no disk filesystem among {}; pass --disk-dir",
        tried.join(", ")
    ))
}

/// Start `attack` against the instance at `socket`.
pub fn start(
    attack: Attack,
    socket: &Path,
    sizes: &AttackSizes,
) -> Result<(Hostile, AttackOutcome), String> {
    let t = Instant::now();
    let (h, mut o) = match attack {
        Attack::Idle => idle(socket),
        Attack::MapFlood => map_flood(socket, sizes.maps),
        Attack::FdFlood => fd_flood(socket, sizes.fd_messages),
        Attack::DiskFile => disk_file(socket, sizes.disk_dir.as_deref()),
    }?;
    o.setup_s = t.elapsed().as_secs_f64();
    Ok((h, o))
}

fn idle(socket: &Path) -> Result<(Hostile, AttackOutcome), String> {
    let vmm = Vmm::connect(socket).map_err(|e| format!("connect: {e}"))?;
    Ok((
        Hostile {
            _vmm: Some(vmm),
            _held: Vec::new(),
        },
        AttackOutcome {
            summary: "connected, nothing sent".into(),
            ..AttackOutcome::default()
        },
    ))
}

/// IOVA of the map flood's first map.
const FLOOD_IOVA: u64 = 1 << 40;

fn map_flood(socket: &Path, cap: u32) -> Result<(Hostile, AttackOutcome), String> {
    let mut vmm = Vmm::connect(socket).map_err(|e| format!("connect: {e}"))?;
    let allowed = vmm.server_caps().map_or(u32::MAX, |c| c.max_dma_maps);
    let n = cap.min(allowed);
    let mem = umdev::testing::memfd(2 * u64::from(n) * 4096).map_err(|e| format!("memfd: {e}"))?;
    let mut accepted = 0u64;
    let mut refused = None;
    for i in 0..u64::from(n) {
        match vmm.dma_map_fd(FLOOD_IOVA + i * 4096, 4096, mem.as_fd(), 2 * i * 4096) {
            Ok(()) => accepted += 1,
            Err(e) => {
                refused = Some(format!("map {i}: {e}"));
                break;
            }
        }
    }
    Ok((
        Hostile {
            _vmm: Some(vmm),
            _held: vec![mem],
        },
        AttackOutcome {
            summary: format!(
                "{accepted} of {n} one-page memfd maps accepted (server offers max_dma_maps \
                 {allowed}, --maps {cap}), held"
            ),
            accepted,
            refused,
            setup_s: 0.0,
        },
    ))
}

/// The fd flood's fd-less guest RAM and ring.
const FDLESS_GPA: u64 = 0x1000_0000;
const FDLESS_RING: u32 = 16 * 1024;
/// How long one send of the fd flood may block before it counts as back-pressure.
const SEND_BLOCK: Duration = Duration::from_millis(100);

fn fd_flood(socket: &Path, cap: u32) -> Result<(Hostile, AttackOutcome), String> {
    fn e(what: &'static str) -> impl Fn(std::io::Error) -> String {
        move |err| format!("{what}: {err}")
    }
    let (client, _) = RawClient::try_connect(socket)
        .and_then(|mut c| c.try_negotiate(DEFAULT_CAPS).map(|m| (c, m)))
        .map_err(e("connect"))?;
    let mut vmm =
        Vmm::from_client(client).with_fdless(FdlessMemory::new(FDLESS_GPA, FDLESS_RING as usize));
    let fences: Vec<Command> = (1..FDLESS_RING / 8)
        .map(|k| Command::Fence { value: k })
        .collect();
    let ring = Command::encode_bytes(&fences);
    vmm.mem_mut()[..ring.len()].copy_from_slice(&ring);
    vmm.dma_map_fdless(FDLESS_GPA, FDLESS_RING.into())
        .map_err(e("DMA_MAP fd-less"))?;
    vmm.enable_device().map_err(e("enable"))?;
    let bar = region_index::BAR0;
    for (off, v) in [
        (REG_RING_BASE_LO, FDLESS_GPA as u32),
        (REG_RING_BASE_HI, (FDLESS_GPA >> 32) as u32),
        (REG_RING_SIZE, FDLESS_RING),
        (REG_RING_CTRL, 1),
    ] {
        vmm.write32(bar, off, v).map_err(e("ring setup"))?;
    }
    vmm.write32_posted(bar, REG_RING_TAIL, ring.len() as u32)
        .map_err(e("doorbell"))?;
    let held = vmm.hold_request().map_err(e("the fetcher's DMA_READ"))?;
    // From here on nothing is read: the DMA_READ stays unanswered, replies pile up.
    let fd = umdev::testing::memfd(4096).map_err(e("memfd"))?;
    let fds: [RawFd; 16] = [fd.as_raw_fd(); 16];
    let mut payload = Vec::with_capacity(16);
    payload.extend_from_slice(&0u64.to_le_bytes());
    payload.extend_from_slice(&bar.to_le_bytes());
    payload.extend_from_slice(&4u32.to_le_bytes());
    vmm.client()
        .stream()
        .set_write_timeout(Some(SEND_BLOCK))
        .map_err(e("send timeout"))?;
    let mut sent = 0u64;
    let mut refused = None;
    for _ in 0..cap {
        match vmm
            .client()
            .try_send(Wire::RegionRead as u16, 0, &payload, &fds)
        {
            Ok(_) => sent += 1,
            Err(err) => {
                refused = Some(format!("send {sent}: {err}"));
                break;
            }
        }
    }
    Ok((
        Hostile {
            _vmm: Some(vmm),
            _held: vec![fd],
        },
        AttackOutcome {
            summary: format!(
                "DMA_READ of {} bytes at {:#x} held unanswered; {sent} REGION_READs with 16 \
                 fds each sent ({} fds), replies not read{}",
                held.count,
                held.iova,
                sent * 16,
                if refused.is_some() {
                    ", then a send blocked (back-pressure)"
                } else {
                    ""
                }
            ),
            accepted: sent,
            refused,
            setup_s: 0.0,
        },
    ))
}

/// The disk file's size and IOVA.
const DISK_FILE_BYTES: u64 = 64 << 10;
const DISK_IOVA: u64 = 1 << 41;

fn disk_file(socket: &Path, dir: Option<&Path>) -> Result<(Hostile, AttackOutcome), String> {
    let (dir, f_type) = disk_dir(dir)?;
    let file =
        tempfile::tempfile_in(&dir).map_err(|e| format!("file in {}: {e}", dir.display()))?;
    file.set_len(DISK_FILE_BYTES)
        .map_err(|e| format!("set_len: {e}"))?;
    let mut vmm = Vmm::connect(socket).map_err(|e| format!("connect: {e}"))?;
    let r = vmm.dma_map_fd(DISK_IOVA, DISK_FILE_BYTES, file.as_fd(), 0);
    let (accepted, refused) = match r {
        Ok(()) => (1, None),
        Err(e) => (0, Some(format!("DMA_MAP: {e}"))),
    };
    Ok((
        Hostile {
            _vmm: Some(vmm),
            _held: vec![file],
        },
        AttackOutcome {
            summary: format!(
                "DMA_MAP of a {} KiB regular file in {} (f_type {f_type:#x}): {}",
                DISK_FILE_BYTES >> 10,
                dir.display(),
                if accepted == 1 {
                    "accepted, held"
                } else {
                    "refused"
                }
            ),
            accepted,
            refused,
            setup_s: 0.0,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_fs_type_tells_tmpfs_from_a_disk() {
        assert!(is_memory_fs(TMPFS_MAGIC) && is_memory_fs(HUGETLBFS_MAGIC));
        assert!(!is_memory_fs(0xef53), "ext4 is a disk filesystem");
        assert!(fs_type(Path::new("/no/such/dir")).is_err());
    }

    #[test]
    fn test_attack_names_are_the_cli_names() {
        use clap::ValueEnum;
        for a in Attack::ALL {
            let v = a.to_possible_value().unwrap();
            assert_eq!(v.get_name(), a.name());
        }
    }
}
