//! Order statistics of a set of samples: median and spread (p10/p90, min/max).
//!
//! Medians rather than means: the machine is shared, and a sample disturbed by another
//! process shows up as an outlier that a median ignores and the spread reports.

/// Summary of samples (all values in the samples' unit, e.g. ns/page).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median (p50).
    pub median: f64,
    /// 10th percentile.
    pub p10: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 25th percentile.
    pub p25: f64,
    /// 75th percentile.
    pub p75: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

/// The `q`-quantile (0..=1) of sorted `v`, linear interpolation between closest ranks.
fn quantile_sorted(v: &[f64], q: f64) -> f64 {
    match v.len() {
        0 => f64::NAN,
        1 => v[0],
        len => {
            let pos = q.clamp(0.0, 1.0) * (len - 1) as f64;
            let lo = pos.floor() as usize;
            let hi = pos.ceil() as usize;
            let frac = pos - lo as f64;
            v[lo] + (v[hi] - v[lo]) * frac
        }
    }
}

/// The `q`-quantile (0..=1) of `samples` (NaN-free, any order); NaN for none.
pub fn quantile(samples: &[f64], q: f64) -> f64 {
    let mut v: Vec<f64> = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    quantile_sorted(&v, q)
}

/// Summarize `samples` (NaN-free); an empty input gives NaNs and `n == 0`.
pub fn summarize(samples: &[f64]) -> Summary {
    let mut v: Vec<f64> = samples.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    Summary {
        n: v.len(),
        median: quantile_sorted(&v, 0.5),
        p10: quantile_sorted(&v, 0.1),
        p90: quantile_sorted(&v, 0.9),
        p25: quantile_sorted(&v, 0.25),
        p75: quantile_sorted(&v, 0.75),
        min: v.first().copied().unwrap_or(f64::NAN),
        max: v.last().copied().unwrap_or(f64::NAN),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_summarize_odd_count_median_is_middle() {
        let s = summarize(&[5.0, 1.0, 3.0, 100.0, 2.0]);
        assert_eq!(s.n, 5);
        assert_eq!(s.median, 3.0);
        assert_eq!(s.min, 1.0);
        assert_eq!(s.max, 100.0);
        assert!(s.p10 > 1.0 && s.p10 < 2.0);
        assert!(s.p90 > 5.0 && s.p90 < 100.0);
    }

    #[test]
    fn test_summarize_even_count_median_interpolates() {
        let s = summarize(&[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(s.median, 2.5);
    }

    #[test]
    fn test_summarize_empty_gives_nan() {
        let s = summarize(&[]);
        assert_eq!(s.n, 0);
        assert!(s.median.is_nan());
    }
}
