//! Medians and spreads.

use serde::{Deserialize, Serialize};

/// A value measured several times: its median, and the spread as the smallest and largest.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    /// How many values.
    pub n: usize,
}

impl Summary {
    /// `None` for no values.
    pub fn of(values: &[f64]) -> Option<Self> {
        let sorted = sorted(values);
        Some(Self {
            median: percentile(&sorted, 50.0)?,
            min: *sorted.first()?,
            max: *sorted.last()?,
            n: sorted.len(),
        })
    }
}

pub fn sorted(values: &[f64]) -> Vec<f64> {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted
}

/// Linear interpolation between closest ranks; `sorted` must be sorted.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = p / 100.0 * last as f64;
    let (low, high) = (rank.floor() as usize, rank.ceil() as usize);
    Some(sorted[low] + (sorted[high] - sorted[low]) * (rank - low as f64))
}

pub fn median(values: &[f64]) -> Option<f64> {
    percentile(&sorted(values), 50.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn medians_and_percentiles() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(&[]), None);
        let s = Summary::of(&[5.0, 1.0, 9.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (5.0, 1.0, 9.0, 3));
        assert_eq!(percentile(&[0.0, 10.0], 90.0), Some(9.0));
    }
}
