//! Recorded pin arrays: the file format, the recorder `umdev run --record-pins FILE`
//! installs, and the reader `umdev bench pin --trace FILE` replays.
//!
//! # Format (JSON lines)
//!
//! One pin call per line, in the order the device issued them, exactly as passed to
//! `pin_pages` (IOVA page numbers, `iova >> 12`), with the requested permission:
//!
//! ```text
//! {"prot":"rw","pfns":[262144,262145,262146]}
//! {"prot":"r","pfns":[262400]}
//! ```
//!
//! `prot` is `"r"`, `"w"` or `"rw"`. Blank lines and lines starting with `#` are ignored.
//! A reader accepts at most [`MAX_ARRAY_LEN`] pages per line and [`MAX_TOTAL_PAGES`] in all.

use std::fs::File;
use std::io::{self, BufRead, BufReader, LineWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use umdev::dma::{PinRecorder, Prot};

/// Longest array a trace line may hold.
pub const MAX_ARRAY_LEN: usize = 1 << 20;
/// Most pages a whole trace may hold.
pub const MAX_TOTAL_PAGES: usize = 1 << 24;
/// Largest page number accepted (IOVAs are 64-bit, page numbers 52-bit).
pub const MAX_PFN: u64 = (1 << 52) - 1;

/// One recorded pin call.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TraceEntry {
    /// `"r"`, `"w"` or `"rw"`.
    pub prot: String,
    /// IOVA page numbers as passed to `pin_pages`.
    pub pfns: Vec<u64>,
}

impl TraceEntry {
    /// The permission of this entry.
    pub fn prot(&self) -> Prot {
        match self.prot.as_str() {
            "r" => Prot::READ,
            "w" => Prot::WRITE,
            _ => Prot::RW,
        }
    }
}

/// Errors reading a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be read.
    #[error("cannot read trace {path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Cause.
        #[source]
        source: io::Error,
    },
    /// A line is not a valid entry.
    #[error("trace {path} line {line}: {what}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        what: String,
    },
    /// The trace holds no pin call.
    #[error("trace {path} holds no pin array")]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

fn prot_name(prot: Prot) -> &'static str {
    match (prot.read, prot.write) {
        (true, false) => "r",
        (false, true) => "w",
        _ => "rw",
    }
}

/// Append one entry (one line) to `out`.
pub fn write_entry(out: &mut dyn Write, pfns: &[u64], prot: Prot) -> io::Result<()> {
    let entry = serde_json::json!({ "prot": prot_name(prot), "pfns": pfns });
    writeln!(out, "{entry}")
}

/// A pin recorder writing every pin call to `path` (created or truncated), one line per
/// call, flushed per line so a killed server leaves a complete file. Install it with
/// `DmaSpace::set_pin_recorder(Some(..))`. A write error is logged once and recording stops.
pub fn trace_recorder(path: &Path) -> io::Result<PinRecorder> {
    let file = File::create(path)?;
    let state = Mutex::new((LineWriter::new(file), false));
    let path = path.to_path_buf();
    Ok(Arc::new(move |pfns: &[u64], prot: Prot| {
        let mut guard = match state.lock() {
            Ok(g) => g,
            Err(poisoned) => poisoned.into_inner(),
        };
        let (writer, failed) = &mut *guard;
        if *failed {
            return;
        }
        if let Err(e) = write_entry(writer, pfns, prot) {
            *failed = true;
            tracing::warn!(path = %path.display(), error = %e, "pin trace: write failed, recording stopped");
        }
    }))
}

/// Read and validate a trace file.
pub fn read_trace(path: &Path) -> Result<Vec<TraceEntry>, TraceError> {
    let io_err = |source| TraceError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io_err)?;
    parse_trace(BufReader::new(file), path)
}

/// Parse a trace from `input` (`path` names it in errors).
pub fn parse_trace(input: impl BufRead, path: &Path) -> Result<Vec<TraceEntry>, TraceError> {
    let invalid = |line: usize, what: String| TraceError::Invalid {
        path: path.to_path_buf(),
        line,
        what,
    };
    let mut entries = Vec::new();
    let mut total = 0usize;
    for (i, line) in input.lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let text = line.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        let entry: TraceEntry =
            serde_json::from_str(text).map_err(|e| invalid(line_no, e.to_string()))?;
        if !matches!(entry.prot.as_str(), "r" | "w" | "rw") {
            return Err(invalid(
                line_no,
                format!("prot {:?} is not r, w or rw", entry.prot),
            ));
        }
        if entry.pfns.is_empty() {
            return Err(invalid(line_no, "empty pfns array".into()));
        }
        if entry.pfns.len() > MAX_ARRAY_LEN {
            return Err(invalid(
                line_no,
                format!("{} pages exceed {MAX_ARRAY_LEN}", entry.pfns.len()),
            ));
        }
        if let Some(bad) = entry.pfns.iter().find(|&&p| p > MAX_PFN) {
            return Err(invalid(
                line_no,
                format!("page number {bad:#x} out of range"),
            ));
        }
        total = total.saturating_add(entry.pfns.len());
        if total > MAX_TOTAL_PAGES {
            return Err(invalid(
                line_no,
                format!("trace exceeds {MAX_TOTAL_PAGES} pages in all"),
            ));
        }
        entries.push(entry);
    }
    if entries.is_empty() {
        return Err(TraceError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(entries)
}

/// Renumber the pages of `entries` into a compact range starting at `base_pfn`, keeping
/// exactly which pages are equal and which are consecutive (so runs, duplicates and order
/// are unchanged) while squeezing the gaps between runs to one page. Returns the renumbered
/// entries and the number of pages the range spans.
pub fn compact(entries: &[TraceEntry], base_pfn: u64) -> (Vec<TraceEntry>, u64) {
    let mut distinct: Vec<u64> = entries
        .iter()
        .flat_map(|e| e.pfns.iter().copied())
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    let mut renumbered = Vec::with_capacity(distinct.len());
    let mut next = base_pfn;
    for (i, &p) in distinct.iter().enumerate() {
        if i > 0 {
            next += if distinct[i - 1] + 1 == p { 1 } else { 2 };
        }
        renumbered.push(next);
    }
    let map = |p: u64| -> u64 {
        // `p` comes from `entries`, so it is in `distinct`.
        let idx = distinct.binary_search(&p).unwrap_or(0);
        renumbered[idx]
    };
    let out = entries
        .iter()
        .map(|e| TraceEntry {
            prot: e.prot.clone(),
            pfns: e.pfns.iter().map(|&p| map(p)).collect(),
        })
        .collect();
    let span = renumbered.last().map_or(0, |&l| l - base_pfn + 1);
    (out, span)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::patterns::runs;

    #[test]
    fn test_trace_recorder_writes_lines_parse_trace_reads_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.jsonl");
        let rec = trace_recorder(&path).unwrap();
        rec(&[1, 2, 3], Prot::RW);
        rec(&[9], Prot::READ);
        drop(rec);
        let got = read_trace(&path).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].pfns, vec![1, 2, 3]);
        assert_eq!(got[0].prot(), Prot::RW);
        assert_eq!(got[1].prot(), Prot::READ);
    }

    #[test]
    fn test_parse_trace_bad_line_reports_line_number() {
        let text = "# header\n{\"prot\":\"rw\",\"pfns\":[1]}\nnot json\n";
        let err = parse_trace(text.as_bytes(), Path::new("x")).unwrap_err();
        assert!(matches!(err, TraceError::Invalid { line: 3, .. }), "{err}");
    }

    #[test]
    fn test_parse_trace_rejects_bad_prot_empty_and_huge_pfn() {
        for text in [
            "{\"prot\":\"x\",\"pfns\":[1]}",
            "{\"prot\":\"r\",\"pfns\":[]}",
            "{\"prot\":\"r\",\"pfns\":[18446744073709551615]}",
        ] {
            assert!(
                parse_trace(text.as_bytes(), Path::new("x")).is_err(),
                "{text}"
            );
        }
        assert!(matches!(
            parse_trace("\n# only comments\n".as_bytes(), Path::new("x")),
            Err(TraceError::Empty { .. })
        ));
    }

    #[test]
    fn test_compact_keeps_runs_and_duplicates() {
        let entries = vec![
            TraceEntry {
                prot: "rw".into(),
                pfns: vec![1_000_000, 1_000_001, 5, 7, 6, 1_000_000],
            },
            TraceEntry {
                prot: "r".into(),
                pfns: vec![900, 5],
            },
        ];
        let (c, span) = compact(&entries, 100);
        assert_eq!(c[0].pfns.len(), 6);
        assert_eq!(c[0].pfns[0], c[0].pfns[5]);
        assert_eq!(runs(&c[0].pfns), runs(&entries[0].pfns));
        assert_eq!(runs(&c[1].pfns), 2);
        assert_eq!(c[1].pfns[1], c[0].pfns[2]);
        assert!(c
            .iter()
            .flat_map(|e| &e.pfns)
            .all(|&p| p >= 100 && p < 100 + span));
        assert!(span < 20);
    }
}
