//! Speed-proportional batches for clusters of uneven devices: each rank's share of the global
//! batch follows its measured samples/s, so a slow card no longer sets the pace.
//!
//! * **Measurement.** Every step each rank reports its compute speed (its samples over its
//!   compute time); the speeds are gathered, so every rank sees the same numbers and computes
//!   the same shares. The first [`CALIBRATION_STEPS`] steps run equal shares (the calibration
//!   phase); afterwards an exponential moving average ([`EMA_ALPHA`]) tracks drift.
//! * **Split.** Integer shares proportional to the averaged speeds, at least one sample each,
//!   summing exactly to the global batch (largest remainders, ties to the lower rank).
//! * **Weighting.** The trainer weights each rank's gradient and loss by
//!   `share · world / global` ([`crate::engine::Trainer::set_sample_weight`]), so the update
//!   equals the single-process update on the same global batch.

/// Steps with equal shares before the speeds are trusted.
pub const CALIBRATION_STEPS: usize = 3;
/// Weight of a new measurement in the moving average.
pub const EMA_ALPHA: f64 = 0.3;

/// How the global batch is split over ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Balance {
    /// Equal shares (DistributedSampler).
    Equal,
    /// Shares follow measured speed.
    Speed,
    /// Fixed shares, one per rank (tests, or known hardware ratios).
    Fixed(Vec<usize>),
}

/// Integer shares of `global` proportional to `weights`, each at least 1, summing to
/// `global` (largest remainders; ties go to the lower rank). `global >= weights.len()`.
pub fn proportional(global: usize, weights: &[f64]) -> Vec<usize> {
    let n = weights.len();
    assert!(n > 0 && global >= n, "{global} samples for {n} ranks");
    let w: Vec<f64> = weights
        .iter()
        .map(|&x| if x.is_finite() && x > 0.0 { x } else { 0.0 })
        .collect();
    let total: f64 = w.iter().sum();
    if total <= 0.0 {
        return proportional(global, &vec![1.0; n]);
    }
    // One sample each first, the rest in proportion.
    let rest = (global - n) as f64;
    let exact: Vec<f64> = w.iter().map(|x| rest * x / total).collect();
    let mut shares: Vec<usize> = exact.iter().map(|x| 1 + x.floor() as usize).collect();
    let mut left = global - shares.iter().sum::<usize>();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&a, &b| {
        let (fa, fb) = (exact[a] - exact[a].floor(), exact[b] - exact[b].floor());
        fb.total_cmp(&fa).then(a.cmp(&b))
    });
    for &r in order.iter().cycle() {
        if left == 0 {
            break;
        }
        shares[r] += 1;
        left -= 1;
    }
    shares
}

/// The moving average of every rank's speed and the shares it implies.
#[derive(Debug, Clone)]
pub struct SpeedBalancer {
    global: usize,
    ema: Option<Vec<f64>>,
    seen: usize,
}

impl SpeedBalancer {
    /// A balancer for a global batch of `global` samples; equal shares until it has seen
    /// enough steps.
    pub fn new(global: usize) -> Self {
        Self {
            global,
            ema: None,
            seen: 0,
        }
    }

    /// Feeds one step's gathered speeds (samples/s per rank, the same on every rank).
    pub fn observe(&mut self, speeds: &[f32]) {
        self.seen += 1;
        let s: Vec<f64> = speeds.iter().map(|&x| f64::from(x)).collect();
        self.ema = Some(match self.ema.take() {
            None => s,
            Some(e) => e
                .iter()
                .zip(&s)
                .map(|(a, b)| {
                    if b.is_finite() && *b > 0.0 {
                        (1.0 - EMA_ALPHA) * a + EMA_ALPHA * b
                    } else {
                        *a
                    }
                })
                .collect(),
        });
    }

    /// The shares for the next step: equal during calibration, then proportional.
    pub fn shares(&self, world: usize) -> Vec<usize> {
        match &self.ema {
            Some(e) if self.seen >= CALIBRATION_STEPS => proportional(self.global, e),
            _ => proportional(self.global, &vec![1.0; world]),
        }
    }

    /// The averaged speeds (samples/s per rank), once measured.
    pub fn speeds(&self) -> Option<&[f64]> {
        self.ema.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_are_proportional_exact_and_at_least_one() {
        assert_eq!(proportional(32, &[1.0, 1.0]), vec![16, 16]);
        assert_eq!(proportional(30, &[2.0, 1.0]), vec![20, 10]);
        assert_eq!(proportional(7, &[1.0, 1.0, 1.0]), vec![3, 2, 2]);
        assert_eq!(proportional(4, &[1000.0, 1.0, 1.0, 1.0]), vec![1, 1, 1, 1]);
        assert_eq!(proportional(10, &[0.0, f64::NAN, 1.0]), vec![1, 1, 8]);
        assert_eq!(proportional(6, &[0.0, 0.0]), vec![3, 3]);
        for g in 3..200 {
            let s = proportional(g, &[3.3, 1.1, 0.7]);
            assert_eq!(s.iter().sum::<usize>(), g);
            assert!(s.iter().all(|&x| x >= 1));
            assert!(s[0] >= s[1] && s[1] >= s[2], "{s:?}");
        }
    }

    #[test]
    fn calibration_then_moving_average() {
        let mut b = SpeedBalancer::new(30);
        assert_eq!(b.shares(2), vec![15, 15]);
        b.observe(&[200.0, 100.0]);
        b.observe(&[200.0, 100.0]);
        assert_eq!(b.shares(2), vec![15, 15], "still calibrating");
        b.observe(&[200.0, 100.0]);
        assert_eq!(b.shares(2), vec![20, 10]);
        // A failed measurement (0 or NaN) keeps the average.
        b.observe(&[f32::NAN, 0.0]);
        assert_eq!(b.shares(2), vec![20, 10]);
    }
}
