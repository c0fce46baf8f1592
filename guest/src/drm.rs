//! Just enough of Linux's DRM KMS uAPI (`include/uapi/drm/drm.h`, `drm_mode.h`) to drive a
//! display the way a compositor does, with no libdrm: the card's connector and CRTC, its
//! modes, dumb buffers mapped into this process, framebuffers, a mode set, page flips with
//! their completion event, and dirty-framebuffer flushes.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;

const fn iowr(nr: u32, size: usize) -> libc::c_ulong {
    // _IOC(_IOC_READ | _IOC_WRITE, 'd', nr, size)
    ((3u32 << 30) | ((size as u32) << 16) | ((b'd' as u32) << 8) | nr) as libc::c_ulong
}

const fn io(nr: u32) -> libc::c_ulong {
    (((b'd' as u32) << 8) | nr) as libc::c_ulong
}

/// `struct drm_mode_modeinfo`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ModeInfo {
    pub clock: u32,
    pub hdisplay: u16,
    pub hsync_start: u16,
    pub hsync_end: u16,
    pub htotal: u16,
    pub hskew: u16,
    pub vdisplay: u16,
    pub vsync_start: u16,
    pub vsync_end: u16,
    pub vtotal: u16,
    pub vscan: u16,
    pub vrefresh: u32,
    pub flags: u32,
    pub type_: u32,
    pub name: [u8; 32],
}

#[repr(C)]
#[derive(Default)]
struct CardRes {
    fb_id_ptr: u64,
    crtc_id_ptr: u64,
    connector_id_ptr: u64,
    encoder_id_ptr: u64,
    count_fbs: u32,
    count_crtcs: u32,
    count_connectors: u32,
    count_encoders: u32,
    min_width: u32,
    max_width: u32,
    min_height: u32,
    max_height: u32,
}

#[repr(C)]
#[derive(Default)]
struct GetConnector {
    encoders_ptr: u64,
    modes_ptr: u64,
    props_ptr: u64,
    prop_values_ptr: u64,
    count_modes: u32,
    count_props: u32,
    count_encoders: u32,
    encoder_id: u32,
    connector_id: u32,
    connector_type: u32,
    connector_type_id: u32,
    connection: u32,
    mm_width: u32,
    mm_height: u32,
    subpixel: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Default)]
struct Crtc {
    set_connectors_ptr: u64,
    count_connectors: u32,
    crtc_id: u32,
    fb_id: u32,
    x: u32,
    y: u32,
    gamma_size: u32,
    mode_valid: u32,
    mode: ModeInfo,
}

#[repr(C)]
#[derive(Default)]
struct CreateDumb {
    height: u32,
    width: u32,
    bpp: u32,
    flags: u32,
    handle: u32,
    pitch: u32,
    size: u64,
}

#[repr(C)]
#[derive(Default)]
struct MapDumb {
    handle: u32,
    pad: u32,
    offset: u64,
}

#[repr(C)]
#[derive(Default)]
struct FbCmd {
    fb_id: u32,
    width: u32,
    height: u32,
    pitch: u32,
    bpp: u32,
    depth: u32,
    handle: u32,
}

#[repr(C)]
#[derive(Default)]
struct PageFlip {
    crtc_id: u32,
    fb_id: u32,
    flags: u32,
    reserved: u32,
    user_data: u64,
}

#[repr(C)]
#[derive(Default)]
struct FbDirty {
    fb_id: u32,
    flags: u32,
    color: u32,
    num_clips: u32,
    clips_ptr: u64,
}

#[repr(C)]
struct ClipRect {
    x1: u16,
    y1: u16,
    x2: u16,
    y2: u16,
}

const GETRESOURCES: libc::c_ulong = iowr(0xa0, std::mem::size_of::<CardRes>());
const SETCRTC: libc::c_ulong = iowr(0xa2, std::mem::size_of::<Crtc>());
const GETCONNECTOR: libc::c_ulong = iowr(0xa7, std::mem::size_of::<GetConnector>());
const ADDFB: libc::c_ulong = iowr(0xae, std::mem::size_of::<FbCmd>());
const RMFB: libc::c_ulong = iowr(0xaf, 4);
const PAGE_FLIP: libc::c_ulong = iowr(0xb0, std::mem::size_of::<PageFlip>());
const DIRTYFB: libc::c_ulong = iowr(0xb1, std::mem::size_of::<FbDirty>());
const CREATE_DUMB: libc::c_ulong = iowr(0xb2, std::mem::size_of::<CreateDumb>());
const MAP_DUMB: libc::c_ulong = iowr(0xb3, std::mem::size_of::<MapDumb>());
const DESTROY_DUMB: libc::c_ulong = iowr(0xb4, 4);
const SET_MASTER: libc::c_ulong = io(0x1e);

const PAGE_FLIP_EVENT: u32 = 1;
const EVENT_FLIP_COMPLETE: u32 = 2;
const CONNECTED: u32 = 1;

/// An open DRM card.
pub struct Card {
    file: File,
}

/// A dumb buffer with its framebuffer, mapped into this process.
pub struct Dumb {
    handle: u32,
    pub fb_id: u32,
    pub width: u32,
    pub height: u32,
    pub pitch: u32,
    map: *mut u8,
    size: usize,
}

// SAFETY: the mapping is owned by the `Dumb` alone; nothing else aliases it in this process.
unsafe impl Send for Dumb {}

impl Dumb {
    /// The mapped pixels (`pitch * height` bytes, XRGB8888).
    pub fn pixels(&mut self) -> &mut [u8] {
        // SAFETY: `map` is a live shared mapping of `size` bytes made in `Card::dumb`,
        // unmapped only in `drop`; `&mut self` makes this the only reference. The device
        // reads it only when the guest flushes, and never writes it.
        unsafe { std::slice::from_raw_parts_mut(self.map, self.size) }
    }
}

impl Drop for Dumb {
    fn drop(&mut self) {
        // SAFETY: unmaps the mapping made in `Card::dumb`, used by nobody after this.
        unsafe { libc::munmap(self.map.cast(), self.size) };
    }
}

/// The connected connector's first CRTC setup.
pub struct Output {
    pub connector_id: u32,
    pub crtc_id: u32,
    pub modes: Vec<ModeInfo>,
}

impl Card {
    pub fn open(path: &str) -> io::Result<Card> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        Ok(Card { file })
    }

    fn ioctl<T>(&self, req: libc::c_ulong, arg: &mut T, what: &str) -> io::Result<()> {
        // SAFETY: `req` is the DRM ioctl whose argument is a `T` (the constants above are
        // built from each struct's size); `arg` is a live, exclusively borrowed `T`, and
        // any user pointers inside it point to live buffers sized by its counts.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), req, arg as *mut T) };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
        }
        Ok(())
    }

    /// Become DRM master (needed for mode setting while the fbdev emulation runs).
    pub fn set_master(&self) -> io::Result<()> {
        // SAFETY: SET_MASTER takes no argument.
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), SET_MASTER, 0) };
        if rc < 0 {
            return Err(io::Error::other(format!(
                "SET_MASTER: {}",
                io::Error::last_os_error()
            )));
        }
        Ok(())
    }

    /// The first connected connector, the first CRTC, and the connector's modes.
    pub fn output(&self) -> io::Result<Output> {
        let mut res = CardRes::default();
        self.ioctl(GETRESOURCES, &mut res, "GETRESOURCES (counts)")?;
        let mut crtcs = vec![0u32; res.count_crtcs as usize];
        let mut conns = vec![0u32; res.count_connectors as usize];
        let mut res2 = CardRes {
            crtc_id_ptr: crtcs.as_mut_ptr() as u64,
            connector_id_ptr: conns.as_mut_ptr() as u64,
            count_crtcs: res.count_crtcs,
            count_connectors: res.count_connectors,
            ..CardRes::default()
        };
        self.ioctl(GETRESOURCES, &mut res2, "GETRESOURCES")?;
        let crtc_id = *crtcs
            .first()
            .ok_or_else(|| io::Error::other("the card has no CRTC"))?;
        for &id in conns.iter().take(res2.count_connectors as usize) {
            let mut c = GetConnector {
                connector_id: id,
                ..GetConnector::default()
            };
            self.ioctl(GETCONNECTOR, &mut c, "GETCONNECTOR (counts)")?;
            if c.connection != CONNECTED || c.count_modes == 0 {
                continue;
            }
            let mut modes = vec![ModeInfo::default(); c.count_modes as usize];
            let mut c2 = GetConnector {
                connector_id: id,
                modes_ptr: modes.as_mut_ptr() as u64,
                count_modes: c.count_modes,
                ..GetConnector::default()
            };
            self.ioctl(GETCONNECTOR, &mut c2, "GETCONNECTOR")?;
            modes.truncate(c2.count_modes.min(c.count_modes) as usize);
            return Ok(Output {
                connector_id: id,
                crtc_id,
                modes,
            });
        }
        Err(io::Error::other("no connected connector with modes"))
    }

    /// A `width`×`height` XRGB8888 dumb buffer with a framebuffer, mapped.
    pub fn dumb(&self, width: u32, height: u32) -> io::Result<Dumb> {
        let mut c = CreateDumb {
            width,
            height,
            bpp: 32,
            ..CreateDumb::default()
        };
        self.ioctl(CREATE_DUMB, &mut c, "CREATE_DUMB")?;
        let mut fb = FbCmd {
            width,
            height,
            pitch: c.pitch,
            bpp: 32,
            depth: 24,
            handle: c.handle,
            ..FbCmd::default()
        };
        self.ioctl(ADDFB, &mut fb, "ADDFB")?;
        let mut m = MapDumb {
            handle: c.handle,
            ..MapDumb::default()
        };
        self.ioctl(MAP_DUMB, &mut m, "MAP_DUMB")?;
        let size = c.size as usize;
        // SAFETY: maps `size` bytes of the dumb buffer at the fake offset MAP_DUMB gave;
        // the result is checked before use.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                self.file.as_raw_fd(),
                m.offset as libc::off_t,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(io::Error::other(format!(
                "mmap of a dumb buffer: {}",
                io::Error::last_os_error()
            )));
        }
        Ok(Dumb {
            handle: c.handle,
            fb_id: fb.fb_id,
            width,
            height,
            pitch: c.pitch,
            map: map.cast(),
            size,
        })
    }

    /// Free a dumb buffer's framebuffer and buffer.
    pub fn destroy(&self, d: Dumb) -> io::Result<()> {
        let (mut fb, mut h) = (d.fb_id, d.handle);
        drop(d);
        self.ioctl(RMFB, &mut fb, "RMFB")?;
        self.ioctl(DESTROY_DUMB, &mut h, "DESTROY_DUMB")
    }

    /// Show `fb_id` on `out` with `mode`.
    pub fn set_crtc(&self, out: &Output, fb_id: u32, mode: &ModeInfo) -> io::Result<()> {
        let mut conn = out.connector_id;
        let mut c = Crtc {
            set_connectors_ptr: &mut conn as *mut u32 as u64,
            count_connectors: 1,
            crtc_id: out.crtc_id,
            fb_id,
            mode_valid: 1,
            mode: *mode,
            ..Crtc::default()
        };
        self.ioctl(SETCRTC, &mut c, "SETCRTC")
    }

    /// Flip `out`'s CRTC to `fb_id` and wait for the flip-complete event.
    pub fn page_flip(&mut self, out: &Output, fb_id: u32, cookie: u64) -> io::Result<()> {
        let mut f = PageFlip {
            crtc_id: out.crtc_id,
            fb_id,
            flags: PAGE_FLIP_EVENT,
            user_data: cookie,
            ..PageFlip::default()
        };
        self.ioctl(PAGE_FLIP, &mut f, "PAGE_FLIP")?;
        let mut ev = [0u8; 32];
        let n = self.file.read(&mut ev)?;
        let ty = u32::from_ne_bytes([ev[0], ev[1], ev[2], ev[3]]);
        let data = u64::from_ne_bytes(ev[8..16].try_into().unwrap_or_default());
        if n < 16 || ty != EVENT_FLIP_COMPLETE || data != cookie {
            return Err(io::Error::other(format!(
                "event of {n} bytes, type {ty}, cookie {data:#x} (want a flip-complete of {cookie:#x})"
            )));
        }
        Ok(())
    }

    /// Tell the driver `fb_id` changed everywhere (virtio-gpu: TRANSFER_TO_HOST_2D and
    /// RESOURCE_FLUSH of the whole buffer).
    pub fn dirty(&self, fb_id: u32, width: u32, height: u32) -> io::Result<()> {
        let mut clip = ClipRect {
            x1: 0,
            y1: 0,
            x2: width.min(u16::MAX as u32) as u16,
            y2: height.min(u16::MAX as u32) as u16,
        };
        let mut d = FbDirty {
            fb_id,
            num_clips: 1,
            clips_ptr: &mut clip as *mut ClipRect as u64,
            ..FbDirty::default()
        };
        self.ioctl(DIRTYFB, &mut d, "DIRTYFB")
    }
}

/// The mode `w`×`h` among `modes`.
pub fn find_mode(modes: &[ModeInfo], w: u32, h: u32) -> Option<ModeInfo> {
    modes
        .iter()
        .copied()
        .find(|m| u32::from(m.hdisplay) == w && u32::from(m.vdisplay) == h)
}
