//! Results: the guest's `UMDEV-*` console lines (format in `guest/src/report.rs`) and the
//! host's own checks, per guest run.

use std::fmt;

/// One check, from the guest or the host.
#[derive(Clone, Debug)]
pub struct Check {
    /// `<scenario-or-device>.<what>`.
    pub name: String,
    /// Passed.
    pub ok: bool,
    /// What was seen.
    pub detail: String,
}

impl Check {
    /// A check.
    pub fn new(name: impl Into<String>, ok: bool, detail: impl fmt::Display) -> Check {
        Check {
            name: name.into(),
            ok,
            detail: detail.to_string(),
        }
    }
}

/// A measurement reported by the guest.
#[derive(Clone, Debug)]
pub struct Measure {
    /// Scenario that measured it.
    pub scenario: String,
    /// What.
    pub name: String,
    /// Value.
    pub value: f64,
    /// Unit.
    pub unit: String,
}

/// What the guest says the ccw image must hold after the run (`UMDEV-IMAGE`): image bytes
/// `offset..offset + len` are `umdev_devices::ccw::driver::pattern` of `seed`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageExpect {
    /// Scenario that wrote it.
    pub scenario: String,
    /// Its name for the check.
    pub name: String,
    /// First image byte.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// Pattern seed.
    pub seed: u64,
}

/// What the guest's console said.
#[derive(Debug, Default)]
pub struct GuestLog {
    /// Checks, in order.
    pub checks: Vec<Check>,
    /// Measurements.
    pub measures: Vec<Measure>,
    /// Image contents to check on the host.
    pub images: Vec<ImageExpect>,
    /// Scenarios that printed their END line.
    pub ended: Vec<String>,
    /// Number of boots (`UMDEV-BOOT` lines).
    pub boots: usize,
    /// Kernel or init trouble worth showing (panics, oopses, failed insmods).
    pub trouble: Vec<String>,
}

impl GuestLog {
    /// Parse console lines.
    pub fn parse<'a>(lines: impl IntoIterator<Item = &'a str>) -> GuestLog {
        let mut g = GuestLog::default();
        for line in lines {
            // The kernel may print on the same console; our lines start at column 0 but
            // can arrive after a partial kernel line, so look for the marker anywhere.
            let Some(at) = line.find("UMDEV-") else {
                if [
                    "Kernel panic",
                    "BUG:",
                    "Oops",
                    "umdev-init:",
                    "general protection",
                ]
                .iter()
                .any(|t| line.contains(t))
                {
                    g.trouble.push(line.trim().to_string());
                }
                continue;
            };
            let mut w = line[at..].split_whitespace();
            match w.next() {
                Some("UMDEV-CHECK") => {
                    let scenario = w.next().unwrap_or("?");
                    let name = w.next().unwrap_or("?");
                    let ok = w.next() == Some("PASS");
                    let detail: Vec<&str> = w.collect();
                    g.checks.push(Check::new(
                        format!("{scenario}/{name}"),
                        ok,
                        detail.join(" "),
                    ));
                }
                Some("UMDEV-MEASURE") => {
                    let scenario = w.next().unwrap_or("?").to_string();
                    let name = w.next().unwrap_or("?").to_string();
                    let value = w.next().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN);
                    let unit = w.next().unwrap_or("").to_string();
                    g.measures.push(Measure {
                        scenario,
                        name,
                        value,
                        unit,
                    });
                }
                Some("UMDEV-IMAGE") => {
                    let scenario = w.next().unwrap_or("?").to_string();
                    let name = w.next().unwrap_or("?").to_string();
                    let nums: Vec<Option<u64>> = w.map(|v| v.parse().ok()).collect();
                    match nums[..] {
                        [Some(offset), Some(len), Some(seed)] => g.images.push(ImageExpect {
                            scenario,
                            name,
                            offset,
                            len,
                            seed,
                        }),
                        // A garbled line must not pass silently.
                        _ => g.checks.push(Check::new(
                            format!("{scenario}/{name}.image_line"),
                            false,
                            line[at..].trim(),
                        )),
                    }
                }
                Some("UMDEV-END") => g.ended.push(w.next().unwrap_or("?").to_string()),
                Some("UMDEV-BOOT") => g.boots += 1,
                _ => {}
            }
        }
        g
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_parse_guest_lines_checks_measures_end_and_trouble() {
        let log = GuestLog::parse([
            "UMDEV-BOOT 1.23",
            "[    2.0] random kernel line",
            "UMDEV-CHECK gpu gpu.fill PASS ok",
            "junk before UMDEV-CHECK gpu gpu.readback FAIL got 0x0 want 0xff",
            "UMDEV-MEASURE gpu gpu.cmds_per_s 1234.500 cmd/s",
            "UMDEV-END gpu 2 1",
            "[    3.0] Kernel panic - not syncing",
            "UMDEV-IMAGE ccw direct 32768 65536 209",
            "UMDEV-IMAGE ccw broken 1 x 2",
        ]);
        assert_eq!(log.boots, 1);
        assert_eq!(log.checks.len(), 3);
        assert_eq!(
            log.images,
            vec![ImageExpect {
                scenario: "ccw".into(),
                name: "direct".into(),
                offset: 32768,
                len: 65536,
                seed: 209,
            }]
        );
        assert_eq!(log.checks[2].name, "ccw/broken.image_line");
        assert!(!log.checks[2].ok);
        assert!(log.checks[0].ok);
        assert_eq!(log.checks[1].name, "gpu/gpu.readback");
        assert!(!log.checks[1].ok);
        assert_eq!(log.checks[1].detail, "got 0x0 want 0xff");
        assert_eq!(log.measures[0].value, 1234.5);
        assert_eq!(log.ended, vec!["gpu".to_string()]);
        assert_eq!(log.trouble.len(), 1);
    }
}
