//! `Dropout` with inverted scaling and its own seeded generator.

use std::sync::Mutex;

use crate::runtime::device;
use crate::tensor::{Generator, Tensor};

/// Zeroes each element with probability `p` in training and scales the
/// survivors by `1 / (1 - p)`, so evaluation (the identity) needs no
/// rescaling. The masks come from a generator the module owns, seeded from
/// the constructor's: the same seed gives the same masks.
pub struct Dropout {
    p: f64,
    generator: Mutex<Generator>,
}

impl Dropout {
    /// Panics unless `0 <= p <= 1`.
    #[track_caller]
    pub fn new(p: f64, generator: &mut Generator) -> Dropout {
        assert!(
            (0.0..=1.0).contains(&p),
            "Dropout: p must be in [0, 1], got {p}"
        );
        Dropout {
            p,
            generator: Mutex::new(Generator::new(generator.next_seed())),
        }
    }

    pub fn p(&self) -> f64 {
        self.p
    }

    /// `x` with dropout applied when `train`; `x` itself otherwise.
    pub fn forward(&self, x: &Tensor, train: bool) -> Tensor {
        if !train || self.p == 0.0 {
            return x.clone();
        }
        if self.p == 1.0 {
            return x * 0.0;
        }
        // One seed per call: under `compile` a new value of the same graph
        // input (the mask is a `rand` op whose seed operand is lifted), so
        // the graph does not change from step to step. The mask is made
        // where `x` is (creation ops use the current device).
        let u = {
            let mut g = self.generator.lock().expect("dropout generator");
            device::with_device(x.device(), || Tensor::rand(x.shape(), x.dtype(), &mut g))
        };
        // u is uniform in [0, 1): u >= p keeps an element with probability 1 - p.
        let keep = u.ge(self.p).cast(x.dtype()) * (1.0 / (1.0 - self.p));
        x * &keep
    }
}
