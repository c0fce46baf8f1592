//! Interleaved A/B sampling: the two variants of a comparison alternate sample by sample in
//! the same run (A B, B A, A B, …), so drift on a shared machine (another process, CPU
//! frequency, cache state) hits both sides alike instead of biasing the ratio.
//!
//! Each sample runs a variant `iters` times back to back between two clock reads, with
//! `iters` calibrated during warm-up so that one sample lasts about `sample_target`.

use std::time::{Duration, Instant};

/// How much to sample.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct SamplePlan {
    /// Warm-up time spent alternating both variants before any sample is kept.
    #[serde(serialize_with = "ser_duration_ms")]
    pub warmup: Duration,
    /// Samples kept per variant.
    pub samples: usize,
    /// Target duration of one sample.
    #[serde(serialize_with = "ser_duration_ms")]
    pub sample_target: Duration,
    /// Cap on iterations per sample.
    pub max_iters: u64,
    /// Time budget for the kept samples of one comparison: slow comparisons keep fewer
    /// samples (never fewer than `min_samples`). `None`: always `samples`.
    #[serde(serialize_with = "ser_opt_duration_ms")]
    pub cell_budget: Option<Duration>,
    /// Fewest samples kept when the budget is tight.
    pub min_samples: usize,
}

fn ser_opt_duration_ms<S: serde::Serializer>(
    d: &Option<Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_f64(d.as_secs_f64() * 1e3),
        None => s.serialize_none(),
    }
}

fn ser_duration_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

/// The kept samples of one variant.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct VariantSamples {
    /// Iterations timed together in each sample.
    pub iters_per_sample: u64,
    /// Nanoseconds per iteration, one value per sample.
    pub ns_per_iter: Vec<f64>,
    /// Counter delta per iteration (e.g. residency syscalls), one value per sample.
    pub counter_per_iter: Vec<f64>,
}

/// One side of a comparison: an iteration to time.
pub type Iteration<'a, E> = &'a mut dyn FnMut() -> Result<(), E>;

fn iters_for(per_iter: Duration, plan: &SamplePlan) -> u64 {
    let per = per_iter.as_nanos().max(1);
    let want = plan.sample_target.as_nanos() / per;
    (want as u64).clamp(1, plan.max_iters.max(1))
}

/// Samples to keep when one A+B pair of samples takes `pair`.
fn samples_within_budget(plan: &SamplePlan, pair: Duration) -> usize {
    let samples = plan.samples.max(1);
    match plan.cell_budget {
        None => samples,
        Some(budget) => {
            let fit = budget.as_nanos() / pair.as_nanos().max(1);
            let fit = usize::try_from(fit).unwrap_or(usize::MAX);
            samples.min(fit.max(plan.min_samples.max(1)))
        }
    }
}

/// Sample `a` and `b` interleaved under `plan`; `counter` is read before and after every
/// sample (outside the timed section). Returns the samples of `a` and of `b`.
pub fn interleaved<E>(
    plan: &SamplePlan,
    a: Iteration<'_, E>,
    b: Iteration<'_, E>,
    counter: &mut dyn FnMut() -> u64,
) -> Result<(VariantSamples, VariantSamples), E> {
    // Calibration + warm-up: alternate single iterations, measuring each side's cost.
    let mut spent = [Duration::ZERO; 2];
    let mut done = [0u64; 2];
    let start = Instant::now();
    loop {
        for side in 0..2 {
            let t = Instant::now();
            if side == 0 {
                a()?;
            } else {
                b()?;
            }
            spent[side] += t.elapsed();
            done[side] += 1;
        }
        if start.elapsed() >= plan.warmup {
            break;
        }
    }
    let per_iter = [spent[0] / done[0] as u32, spent[1] / done[1] as u32];
    let iters = [iters_for(per_iter[0], plan), iters_for(per_iter[1], plan)];
    let samples = samples_within_budget(
        plan,
        per_iter[0] * iters[0] as u32 + per_iter[1] * iters[1] as u32,
    );
    let mut out = [
        VariantSamples {
            iters_per_sample: iters[0],
            ..Default::default()
        },
        VariantSamples {
            iters_per_sample: iters[1],
            ..Default::default()
        },
    ];
    for s in 0..samples {
        let order = if s % 2 == 0 { [0usize, 1] } else { [1, 0] };
        for side in order {
            let c0 = counter();
            let t = Instant::now();
            if side == 0 {
                for _ in 0..iters[0] {
                    a()?;
                }
            } else {
                for _ in 0..iters[1] {
                    b()?;
                }
            }
            let elapsed = t.elapsed();
            let c1 = counter();
            let n = iters[side] as f64;
            out[side].ns_per_iter.push(elapsed.as_nanos() as f64 / n);
            out[side]
                .counter_per_iter
                .push(c1.saturating_sub(c0) as f64 / n);
        }
    }
    let [oa, ob] = out;
    Ok((oa, ob))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> SamplePlan {
        SamplePlan {
            warmup: Duration::from_millis(1),
            samples: 4,
            sample_target: Duration::from_micros(200),
            max_iters: 1000,
            cell_budget: None,
            min_samples: 1,
        }
    }

    #[test]
    fn test_samples_within_budget_slow_pairs_keep_fewer() {
        let mut p = plan();
        p.samples = 40;
        p.cell_budget = Some(Duration::from_millis(100));
        p.min_samples = 5;
        assert_eq!(samples_within_budget(&p, Duration::from_micros(10)), 40);
        assert_eq!(samples_within_budget(&p, Duration::from_millis(10)), 10);
        assert_eq!(samples_within_budget(&p, Duration::from_secs(1)), 5);
        p.cell_budget = None;
        assert_eq!(samples_within_budget(&p, Duration::from_secs(1)), 40);
    }

    #[test]
    fn test_interleaved_slower_side_measures_slower() {
        let mut count = 0u64;
        let mut fast = || -> Result<(), ()> {
            std::hint::black_box(1 + 1);
            Ok(())
        };
        let mut slow = || -> Result<(), ()> {
            std::thread::sleep(Duration::from_micros(50));
            Ok(())
        };
        let (a, b) = interleaved(&plan(), &mut fast, &mut slow, &mut || {
            count += 1;
            count
        })
        .unwrap();
        assert_eq!(a.ns_per_iter.len(), 4);
        assert_eq!(b.ns_per_iter.len(), 4);
        assert!(a.iters_per_sample > b.iters_per_sample);
        let med = |v: &[f64]| crate::stats::summarize(v).median;
        assert!(med(&b.ns_per_iter) > 10.0 * med(&a.ns_per_iter));
    }

    #[test]
    fn test_interleaved_counter_delta_per_iteration() {
        let mut c = 0u64;
        let (a, _) = interleaved(
            &plan(),
            &mut || -> Result<(), ()> { Ok(()) },
            &mut || Ok(()),
            &mut || {
                c += 10;
                c
            },
        )
        .unwrap();
        // Each sample reads the counter twice: delta 10 over iters_per_sample iterations.
        let expect = 10.0 / a.iters_per_sample as f64;
        assert!(a
            .counter_per_iter
            .iter()
            .all(|&x| (x - expect).abs() < 1e-9));
    }

    #[test]
    fn test_interleaved_error_is_returned() {
        let mut n = 0;
        let r = interleaved(
            &plan(),
            &mut || -> Result<(), &'static str> {
                n += 1;
                if n > 3 {
                    Err("boom")
                } else {
                    Ok(())
                }
            },
            &mut || Ok(()),
            &mut || 0,
        );
        assert_eq!(r.err(), Some("boom"));
    }
}
