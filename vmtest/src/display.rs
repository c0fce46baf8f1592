//! The host's side of the virtio-gpu scenarios: what the host does at a guest's cue, while
//! the guest waits (`UMDEV-READY <scenario> <cue>` on the console), and what it checks.
//!
//! - `virtio-gpu-kms kms-flipped`: `umdev screenshot --control` of the running server must
//!   be [`test_pattern_flipped`], every pixel (the page flip's buffer reached the device);
//! - `virtio-gpu fbcon-text`: the screenshot must show the text the guest wrote to
//!   `/dev/tty1` through fbcon: a row of full-block glyphs at the top left, text lines
//!   below it, black elsewhere. The picture is kept as `fbcon.png` in the run directory
//!   (docs/virtio-gpu-console.png is one);
//! - `virtio-gpu-resize resize:WxH`: `umdev resize --control --size WxH`; the guest then
//!   checks that its driver lists the new mode first.
//!
//! The server is `umdev run virtio-gpu --control` ([`control`]), so these go through the
//! same control socket and CLI a user has.

use std::path::{Path, PathBuf};
use std::process::Command;

use umdev_devices::virtio_gpu::test_pattern_flipped;

use crate::report::Check;

/// The control socket of the [`crate::server::Kind::VirtioGpu`] server in run directory `dir`.
pub fn control(dir: &Path) -> PathBuf {
    dir.join("virtio-gpu.ctl")
}

/// The cues the host acts on, by scenario: (scenario, cue).
const CUES: &[(&str, &str)] = &[
    ("virtio-gpu-kms", "kms-flipped"),
    ("virtio-gpu", "fbcon-text"),
    ("virtio-gpu-resize", "resize:1024x768"),
    ("virtio-gpu-resize", "resize:1280x800"),
];

/// What the host does at the guest's cues during one run.
pub struct Actions {
    umdev: PathBuf,
    control: PathBuf,
    dir: PathBuf,
    /// The cues still expected (their scenarios run in this plan).
    expected: Vec<(&'static str, &'static str)>,
    /// The checks so far.
    pub checks: Vec<Check>,
}

impl Actions {
    /// Actions for a run of `scenarios` whose server's control socket is [`control`]`(dir)`.
    pub fn new(umdev: &Path, dir: &Path, scenarios: &[&str]) -> Actions {
        Actions {
            umdev: umdev.to_path_buf(),
            control: control(dir),
            dir: dir.to_path_buf(),
            expected: CUES
                .iter()
                .copied()
                .filter(|(sc, _)| scenarios.contains(sc))
                .collect(),
            checks: Vec::new(),
        }
    }

    /// A console line: act on it if it is one of [`CUES`].
    pub fn on_line(&mut self, line: &str) {
        let Some(rest) = line.trim().strip_prefix("UMDEV-READY ") else {
            return;
        };
        let Some((scenario, cue)) = rest.split_once(' ') else {
            return;
        };
        let Some(at) = self
            .expected
            .iter()
            .position(|&(s, c)| s == scenario && c == cue)
        else {
            return;
        };
        self.expected.remove(at);
        let check = match (scenario, cue) {
            ("virtio-gpu-kms", _) => self.kms_flipped(),
            ("virtio-gpu", _) => self.fbcon_text(),
            (_, cue) => self.resize(cue.trim_start_matches("resize:")),
        };
        self.checks.push(check);
    }

    /// The checks, with a failed one for each cue that never came.
    pub fn finish(mut self) -> Vec<Check> {
        for (scenario, cue) in self.expected {
            self.checks.push(Check::new(
                format!("{scenario}.host_saw_{cue}"),
                false,
                "the guest never gave this cue",
            ));
        }
        self.checks
    }

    /// `umdev screenshot --control` into `name` in the run directory; the decoded picture.
    fn screenshot(&self, name: &str) -> Result<Rgb, String> {
        let path = self.dir.join(name);
        self.umdev(&["screenshot", "-o", path.to_str().unwrap_or_default()])?;
        Rgb::load(&path)
    }

    /// Run `umdev ARGS --control CONTROL`; its stdout, or why it failed.
    fn umdev(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(&self.umdev)
            .args(args)
            .arg("--control")
            .arg(&self.control)
            .env_remove("UMDEV_CONTROL")
            .output()
            .map_err(|e| format!("{}: {e}", self.umdev.display()))?;
        if !out.status.success() {
            return Err(format!(
                "umdev {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    }

    fn kms_flipped(&self) -> Check {
        let result = self
            .screenshot("kms-flipped.png")
            .and_then(|shot| shot.matches(1280, 800, test_pattern_flipped));
        outcome("virtio-gpu.kms_flip_on_host_screenshot", result)
    }

    /// fbcon's text reaches the device asynchronously: the guest's write to `/dev/tty1`
    /// returns once the glyphs are in the fbdev emulation's shadow buffer, and its damage
    /// worker copies and flushes them later, possibly in several flushes (a CI run behind
    /// intel-iommu caught the blocks and one line). So the host takes screenshots until one
    /// shows the text, for at most [`FBCON_DEADLINE`] (the guest waits longer before it
    /// draws anything else). A flush the device lost never shows up: the guest writes
    /// nothing more to the console, so that still fails.
    fn fbcon_text(&self) -> Check {
        let start = std::time::Instant::now();
        let (result, shots) = retry_until(FBCON_DEADLINE, FBCON_POLL, || {
            self.screenshot("fbcon.png")
                .and_then(|shot| shot.shows_text())
        });
        let waited = format!(
            "{shots} screenshot(s) in {:.1} s",
            start.elapsed().as_secs_f64()
        );
        let result = result
            .map(|detail| format!("{detail}; {waited}"))
            .map_err(|e| format!("{e}; {waited}"));
        outcome("virtio-gpu.fbcon_text_on_host_screenshot", result)
    }

    fn resize(&self, size: &str) -> Check {
        let result = self.umdev(&["resize", "--size", size]);
        outcome(format!("virtio-gpu-resize.host_resize_{size}"), result)
    }
}

/// `attempt` until it succeeds or `deadline` has passed since the first try, `every` apart;
/// the last result and the number of attempts.
fn retry_until<T>(
    deadline: std::time::Duration,
    every: std::time::Duration,
    mut attempt: impl FnMut() -> Result<T, String>,
) -> (Result<T, String>, u32) {
    let start = std::time::Instant::now();
    let mut tries = 0;
    loop {
        tries += 1;
        let result = attempt();
        if result.is_ok() || start.elapsed() >= deadline {
            return (result, tries);
        }
        std::thread::sleep(every);
    }
}

fn outcome(name: impl Into<String>, result: Result<String, String>) -> Check {
    match result {
        Ok(detail) => Check::new(name, true, detail),
        Err(e) => Check::new(name, false, e),
    }
}

/// A decoded RGB screenshot.
pub struct Rgb {
    path: PathBuf,
    width: u32,
    height: u32,
    px: Vec<u8>,
}

impl Rgb {
    /// Decode the PNG at `path` (RGB, as umdev writes them).
    pub fn load(path: &Path) -> Result<Rgb, String> {
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut reader = png::Decoder::new(std::io::BufReader::new(file))
            .read_info()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        let mut px = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut px).map_err(|e| e.to_string())?;
        if info.color_type != png::ColorType::Rgb {
            return Err(format!(
                "{}: {:?}, not RGB",
                path.display(),
                info.color_type
            ));
        }
        px.truncate(info.buffer_size());
        Ok(Rgb {
            path: path.to_path_buf(),
            width: info.width,
            height: info.height,
            px,
        })
    }

    fn pixel(&self, x: u32, y: u32) -> [u8; 3] {
        let at = ((y * self.width + x) * 3) as usize;
        [self.px[at], self.px[at + 1], self.px[at + 2]]
    }

    /// Every pixel is `pattern` (XRGB) at `width` × `height`.
    pub fn matches(
        &self,
        width: u32,
        height: u32,
        pattern: fn(u32, u32) -> u32,
    ) -> Result<String, String> {
        if (self.width, self.height) != (width, height) {
            return Err(format!(
                "{}: {}x{}, want {width}x{height}",
                self.path.display(),
                self.width,
                self.height
            ));
        }
        let mut wrong = 0u64;
        let mut first = None;
        for y in 0..height {
            for x in 0..width {
                let c = pattern(x, y);
                let want = [(c >> 16) as u8, (c >> 8) as u8, c as u8];
                let got = self.pixel(x, y);
                if got != want {
                    wrong += 1;
                    first.get_or_insert((x, y, got, want));
                }
            }
        }
        match first {
            None => Ok(format!(
                "{}: {width}x{height}, every pixel",
                self.path.display()
            )),
            Some((x, y, got, want)) => Err(format!(
                "{}: {wrong} pixels differ; first at {x},{y}: {got:02x?}, want {want:02x?}",
                self.path.display()
            )),
        }
    }

    /// The console the guest wrote (`guest/src/virtio_gpu.rs`, [`BLOCKS`] full blocks, then
    /// lines of text) is what fbcon drew: the blocks are one solid non-black rectangle of
    /// 8-pixel cells at the top left with black right of it, and at least [`TEXT_LINES`]
    /// of the following 16-pixel text rows hold both lit and black pixels (glyphs).
    pub fn shows_text(&self) -> Result<String, String> {
        let (cell_w, cell_h) = (8, 16);
        let blocks_w = BLOCKS * cell_w;
        if self.width < blocks_w * 2 || self.height < cell_h * (TEXT_LINES + 2) {
            return Err(format!(
                "{}: {}x{}",
                self.path.display(),
                self.width,
                self.height
            ));
        }
        let ink = self.pixel(0, 0);
        if ink == [0; 3] {
            return Err(format!(
                "{}: the top left cell is black: no block glyphs",
                self.path.display()
            ));
        }
        for y in 0..cell_h {
            for x in 0..blocks_w {
                if self.pixel(x, y) != ink {
                    return Err(format!(
                        "{}: block row not solid at {x},{y}: {:02x?}, want {ink:02x?}",
                        self.path.display(),
                        self.pixel(x, y)
                    ));
                }
            }
            for x in blocks_w..blocks_w * 2 {
                if self.pixel(x, y) != [0; 3] {
                    return Err(format!(
                        "{}: not black right of the blocks at {x},{y}: {:02x?}",
                        self.path.display(),
                        self.pixel(x, y)
                    ));
                }
            }
        }
        let mut lines = 0;
        for row in 1..self.height / cell_h {
            let (mut lit, mut dark) = (0u32, 0u32);
            for y in row * cell_h..(row + 1) * cell_h {
                for x in 0..self.width {
                    if self.pixel(x, y) == [0; 3] {
                        dark += 1;
                    } else {
                        lit += 1;
                    }
                }
            }
            // A line of text lights some of its cells' pixels, never most of them.
            if lit >= 20 && lit < dark {
                lines += 1;
            }
        }
        if lines < TEXT_LINES {
            return Err(format!(
                "{}: {lines} text rows with glyphs below the blocks, want at least {TEXT_LINES}",
                self.path.display()
            ));
        }
        Ok(format!(
            "{}: {BLOCKS} block glyphs ({ink:02x?}) and {lines} text rows",
            self.path.display()
        ))
    }
}

/// How long the host looks for fbcon's text after the guest's `fbcon-text` cue; the guest
/// (`guest/src/virtio_gpu.rs`) waits 7 s, longer than this and a last screenshot, before
/// it writes `/dev/fb0`.
pub const FBCON_DEADLINE: std::time::Duration = std::time::Duration::from_secs(4);
/// Between two screenshots while the text is not complete.
const FBCON_POLL: std::time::Duration = std::time::Duration::from_millis(250);

/// The full-block glyphs the guest writes at the top left of its console.
pub const BLOCKS: u32 = 16;
/// Text lines (below the blocks) the console must show at least.
pub const TEXT_LINES: u32 = 3;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn test_retry_until_returns_the_first_success_and_counts_the_attempts() {
        let mut calls = 0;
        let (result, tries) = retry_until(Duration::from_secs(5), Duration::ZERO, || {
            calls += 1;
            if calls < 3 {
                Err(format!("partial {calls}"))
            } else {
                Ok(calls)
            }
        });
        assert_eq!((result, tries), (Ok(3), 3));
    }

    #[test]
    fn test_retry_until_gives_up_after_the_deadline_with_the_last_error() {
        let mut calls = 0;
        let start = std::time::Instant::now();
        let (result, tries) = retry_until(
            Duration::from_millis(50),
            Duration::from_millis(10),
            || -> Result<(), String> {
                calls += 1;
                Err(format!("partial {calls}"))
            },
        );
        assert!(start.elapsed() >= Duration::from_millis(50));
        assert!(tries >= 2, "{tries}");
        assert_eq!(result, Err(format!("partial {tries}")));
    }

    /// A 320×160 black console; `blocks` solid grey cells at the top left and `lines`
    /// rows of "glyphs" (every other pixel of the first 40 columns lit) below.
    fn console(blocks: u32, lines: u32) -> Rgb {
        let (w, h) = (320, 160);
        let mut px = vec![0u8; (w * h * 3) as usize];
        let mut set = |x: u32, y: u32| {
            let at = ((y * w + x) * 3) as usize;
            px[at..at + 3].copy_from_slice(&[0xaa; 3]);
        };
        for y in 0..16 {
            for x in 0..blocks * 8 {
                set(x, y);
            }
        }
        for line in 1..=lines {
            for y in line * 16 + 3..line * 16 + 13 {
                for x in (0..40).step_by(2) {
                    set(x, y);
                }
            }
        }
        Rgb {
            path: PathBuf::from("test.png"),
            width: w,
            height: h,
            px,
        }
    }

    #[test]
    fn test_shows_text_finds_blocks_and_lines() {
        let ok = console(BLOCKS, 4).shows_text().unwrap();
        assert!(ok.contains("4 text rows"), "{ok}");
    }

    #[test]
    fn test_shows_text_refuses_black_short_blocks_and_no_lines() {
        let e = console(0, 4).shows_text().unwrap_err();
        assert!(e.contains("no block glyphs"), "{e}");
        let e = console(BLOCKS - 1, 4).shows_text().unwrap_err();
        assert!(e.contains("block row not solid"), "{e}");
        let e = console(BLOCKS + 1, 4).shows_text().unwrap_err();
        assert!(e.contains("not black right of the blocks"), "{e}");
        let e = console(BLOCKS, 2).shows_text().unwrap_err();
        assert!(e.contains("2 text rows"), "{e}");
    }

    #[test]
    fn test_matches_names_the_first_wrong_pixel() {
        let shot = console(BLOCKS, 0);
        let e = shot.matches(320, 160, |_, _| 0).unwrap_err();
        assert!(e.contains("first at 0,0: [aa, aa, aa]"), "{e}");
        assert!(shot
            .matches(640, 160, |_, _| 0)
            .unwrap_err()
            .contains("want 640x160"));
        let black = Rgb {
            px: vec![0; 320 * 160 * 3],
            ..console(0, 0)
        };
        assert!(black.matches(320, 160, |_, _| 0).is_ok());
    }
}
