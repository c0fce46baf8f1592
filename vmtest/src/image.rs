//! The ccw (or NVMe) image after a guest run. The guest announces with `UMDEV-IMAGE` which image bytes
//! it left holding which pattern; once the server has stopped (every WRITE reached the file
//! with `pwrite`, SIGTERM flushed it) the host reads the file and regenerates the expected
//! bytes with the generator the guest filled its buffers from
//! (`umdev_devices::ccw::driver::pattern`), so the pattern is defined in one place.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use umdev_devices::ccw::driver::pattern;

use crate::report::{Check, ImageExpect};

/// One check per announced region: `<device>.image.<scenario>.<name>` (device `nvme` for
/// the nvme scenarios' regions, else `ccw`).
pub fn checks(image: &Path, expects: &[ImageExpect]) -> Vec<Check> {
    let file = File::open(image);
    expects
        .iter()
        .map(|e| {
            let dev = if e.scenario.starts_with("nvme") {
                "nvme"
            } else {
                "ccw"
            };
            let name = format!("{dev}.image.{}.{}", e.scenario, e.name);
            let file = match &file {
                Ok(f) => f,
                Err(err) => return Check::new(name, false, format!("{}: {err}", image.display())),
            };
            let Ok(len) = usize::try_from(e.len) else {
                return Check::new(name, false, format!("length {} too large", e.len));
            };
            let mut buf = vec![0u8; len];
            if let Err(err) = file.read_exact_at(&mut buf, e.offset) {
                let what = format!("reading {} bytes at {}: {err}", e.len, e.offset);
                return Check::new(name, false, what);
            }
            match pattern::first_mismatch(e.seed, e.offset, &buf) {
                None => Check::new(
                    name,
                    true,
                    format!(
                        "{} bytes at image offset {} match seed {}",
                        e.len, e.offset, e.seed
                    ),
                ),
                Some(i) => {
                    let at = e.offset + i as u64;
                    let want = pattern::byte(e.seed, at);
                    let what = format!("image byte {at} is {:#04x}, want {want:#04x}", buf[i]);
                    Check::new(name, false, what)
                }
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect(offset: u64, len: u64, seed: u64) -> ImageExpect {
        ImageExpect {
            scenario: "ccw".into(),
            name: "t".into(),
            offset,
            len,
            seed,
        }
    }

    #[test]
    fn test_image_checks_pattern_match_mismatch_and_short_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ccw.img");
        let mut img = vec![0u8; 8192];
        pattern::fill(7, 1000, &mut img[1000..3000]);
        img[2999] ^= 0x40;
        std::fs::write(&path, &img).unwrap();
        let c = checks(
            &path,
            &[
                expect(1000, 1999, 7),
                expect(1000, 2000, 7),
                expect(8000, 500, 7),
            ],
        );
        assert!(c[0].ok, "{}", c[0].detail);
        assert!(!c[1].ok);
        assert!(c[1].detail.contains("image byte 2999"), "{}", c[1].detail);
        assert!(!c[2].ok, "past the end of the file");
        let missing = checks(&dir.path().join("none.img"), &[expect(0, 1, 1)]);
        assert!(!missing[0].ok);
    }
}
