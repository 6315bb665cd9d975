//! The learning-rate schedule: linear warmup, then a decay to a floor.

use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How the learning rate falls after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    /// Half a cosine from the peak to the floor.
    Cosine,
    /// A straight line from the peak to the floor.
    Linear,
    /// The peak until the end.
    Constant,
}

impl Decay {
    pub fn name(self) -> &'static str {
        match self {
            Decay::Cosine => "cosine",
            Decay::Linear => "linear",
            Decay::Constant => "constant",
        }
    }
}

impl std::fmt::Display for Decay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Decay {
    type Err = String;

    fn from_str(s: &str) -> Result<Decay, String> {
        [Decay::Cosine, Decay::Linear, Decay::Constant]
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown decay `{s}`: expected cosine, linear or constant"))
    }
}

/// The learning rate of every step of a run.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub peak: f64,
    /// The last step's rate is `peak * final_ratio`.
    pub final_ratio: f64,
    pub warmup: usize,
    pub steps: usize,
    pub decay: Decay,
}

impl LrSchedule {
    /// The rate of step `step` (0-based). Warmup rises linearly to the peak
    /// at step `warmup - 1`, so the first step is not wasted at rate 0.
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * (step + 1) as f64 / self.warmup as f64;
        }
        let floor = self.peak * self.final_ratio;
        let span = self.steps.saturating_sub(self.warmup + 1).max(1);
        let progress = ((step - self.warmup) as f64 / span as f64).min(1.0);
        let fraction = match self.decay {
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            Decay::Linear => 1.0 - progress,
            Decay::Constant => 1.0,
        };
        floor + (self.peak - floor) * fraction
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(decay: Decay) -> LrSchedule {
        LrSchedule {
            peak: 1.0,
            final_ratio: 0.1,
            warmup: 4,
            steps: 14,
            decay,
        }
    }

    #[test]
    fn warms_up_linearly_to_the_peak() {
        let s = schedule(Decay::Cosine);
        let rates: Vec<f64> = (0..4).map(|i| s.at(i)).collect();
        assert_eq!(rates, vec![0.25, 0.5, 0.75, 1.0]);
    }

    #[test]
    fn decays_to_the_floor_on_the_last_step() {
        for decay in [Decay::Cosine, Decay::Linear] {
            let s = schedule(decay);
            assert!((s.at(13) - 0.1).abs() < 1e-12, "{decay:?}: {}", s.at(13));
            let rates: Vec<f64> = (4..14).map(|i| s.at(i)).collect();
            assert!(
                rates.windows(2).all(|w| w[1] < w[0]),
                "{decay:?}: {rates:?}"
            );
        }
        // Halfway through the decay, cosine and linear agree on the midpoint.
        let mid = (schedule(Decay::Cosine).at(8) + schedule(Decay::Cosine).at(9)) / 2.0;
        assert!((mid - 0.55).abs() < 0.05, "{mid}");
        assert_eq!(schedule(Decay::Constant).at(13), 1.0);
    }

    #[test]
    fn parses_decay_names() {
        assert_eq!("linear".parse::<Decay>(), Ok(Decay::Linear));
        assert!("exp".parse::<Decay>().unwrap_err().contains("cosine"));
    }
}
