//! A plain aligned text table for terminal reports.

/// Rows of cells under headers; numeric columns are right-aligned.
#[derive(Debug, Default)]
pub struct Table {
    headers: Vec<String>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with `headers`; a header starting with `>` marks a right-aligned column
    /// (the `>` is not shown).
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers
                .iter()
                .map(|h| h.trim_start_matches('>').to_string())
                .collect(),
            right: headers.iter().map(|h| h.starts_with('>')).collect(),
            rows: Vec::new(),
        }
    }

    /// Append a row (missing cells are blank, extra cells are dropped).
    pub fn row(&mut self, cells: Vec<String>) {
        let mut cells = cells;
        cells.resize(self.headers.len(), String::new());
        self.rows.push(cells);
    }

    /// The table as text, two spaces between columns, a dashed rule under the headers.
    pub fn render(&self) -> String {
        let width = |i: usize| {
            self.rows
                .iter()
                .map(|r| r[i].chars().count())
                .chain(std::iter::once(self.headers[i].chars().count()))
                .max()
                .unwrap_or(0)
        };
        let widths: Vec<usize> = (0..self.headers.len()).map(width).collect();
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                if i > 0 {
                    s.push_str("  ");
                }
                let pad = widths[i].saturating_sub(c.chars().count());
                if self.right[i] {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(c);
                } else {
                    s.push_str(c);
                    s.push_str(&" ".repeat(pad));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = line(&self.headers);
        out.push('\n');
        let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
        out.push_str(&line(&rule));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }
}

/// A nanosecond figure with precision that suits its magnitude.
pub fn fmt_ns(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v < 10.0 {
        format!("{v:.2}")
    } else if v < 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.0}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_table_render_aligns_columns() {
        let mut t = Table::new(&["name", ">n"]);
        t.row(vec!["a".into(), "1".into()]);
        t.row(vec!["long".into(), "100".into()]);
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "name    n");
        assert_eq!(lines[2], "a       1");
        assert_eq!(lines[3], "long  100");
    }

    #[test]
    fn test_fmt_ns_precision_by_magnitude() {
        assert_eq!(fmt_ns(1.234), "1.23");
        assert_eq!(fmt_ns(12.34), "12.3");
        assert_eq!(fmt_ns(1234.4), "1234");
        assert_eq!(fmt_ns(f64::NAN), "-");
    }
}
