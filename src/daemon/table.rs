//! Human tables for the client commands: a header and rows, each column as wide as its
//! widest cell (counted in characters), two spaces between columns, no trailing blanks.
//! The header is bold only when `bold` is asked for (the caller asks when stdout is a
//! terminal and `NO_COLOR` is not set): a pipe or a file gets plain text.

/// A table being built.
#[derive(Debug)]
pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these column headers.
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|h| (*h).to_owned()).collect(),
            rows: Vec::new(),
        }
    }

    /// Add a row (missing cells are empty; extra cells are dropped).
    pub fn row(&mut self, cells: Vec<String>) {
        let mut cells = cells;
        cells.resize(self.header.len(), String::new());
        self.rows.push(cells);
    }

    /// The table as lines of text, each ending in a newline.
    pub fn render(&self, bold: bool) -> String {
        let width = |s: &str| s.chars().count();
        let mut widths: Vec<usize> = self.header.iter().map(|h| width(h)).collect();
        for row in &self.rows {
            for (w, cell) in widths.iter_mut().zip(row) {
                *w = (*w).max(width(cell));
            }
        }
        let line = |cells: &[String], bold: bool| {
            let mut out = String::new();
            for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
                let last = i + 1 == cells.len();
                if bold {
                    out.push_str("\x1b[1m");
                }
                out.push_str(cell);
                if bold {
                    out.push_str("\x1b[0m");
                }
                if !last {
                    out.extend(std::iter::repeat_n(' ', w - width(cell) + 2));
                }
            }
            let trimmed = out.trim_end().len();
            out.truncate(trimmed);
            out.push('\n');
            out
        };
        let mut out = line(&self.header, bold);
        for row in &self.rows {
            out.push_str(&line(row, false));
        }
        out
    }
}

/// Whether stdout gets bold headers: a terminal, and `NO_COLOR` unset or empty.
pub fn stdout_bold() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_table_columns_aligned_by_characters_no_trailing_blanks() {
        let mut t = Table::new(&["UUID", "TYPE", "NOTE"]);
        t.row(vec!["a".into(), "gpu/gpu-16m".into(), String::new()]);
        t.row(vec!["bbbbbb".into(), "µ".into(), "x".into()]);
        let text = t.render(false);
        assert_eq!(
            text,
            "UUID    TYPE         NOTE\n\
             a       gpu/gpu-16m\n\
             bbbbbb  µ            x\n"
        );
        assert!(!text.contains('\x1b'));
        let bold = t.render(true);
        assert!(bold.starts_with("\x1b[1mUUID\x1b[0m"));
        // Bold codes do not shift the columns of the rows.
        assert_eq!(bold.lines().nth(1), text.lines().nth(1));
    }
}
