//! Guards: what a cached executable assumes about its inputs, and the
//! reason a call misses ("input 0, dim 0: expected 8, got 16").

use super::dynamic::DynamicDims;
use crate::ir::DType;
use crate::runtime::device::Device;
use crate::tensor::Tensor;

/// What one input must look like for an executable to serve it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InputGuard {
    pub dtype: DType,
    pub shape: Vec<usize>,
    /// `None` for a contiguous (row-major) tensor, else its strides: the
    /// kernels' index arithmetic is made for the layout they were built for.
    pub strides: Option<Vec<usize>>,
    pub requires_grad: bool,
    /// The device's name: an executable's memory plan is made for its
    /// inputs' device, so a call on another device recompiles.
    pub device: &'static str,
    /// The caller hands the tensor over ([`super::Compiled::try_call_donating`]):
    /// the memory plan may write an output over it, so a call that donates
    /// other inputs gets another executable.
    pub donated: bool,
    /// The output the donated tensor's next value is
    /// ([`super::Compiled::try_call_updating`]), which the memory plan
    /// writes over it and nowhere else.
    pub becomes: Option<usize>,
}

/// Whether a gradient flows to `t` in this call: it requires grad and grad
/// mode is on. Under `no_grad` a call compiles (and keys) an executable
/// without a backward, whatever its tensors require.
pub fn needs_grad(t: &Tensor) -> bool {
    t.requires_grad() && crate::autograd::is_grad_enabled()
}

impl InputGuard {
    pub fn of(t: &Tensor) -> InputGuard {
        InputGuard {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            strides: (!t.is_contiguous()).then(|| t.strides().to_vec()),
            requires_grad: needs_grad(t),
            device: t.device().name(),
            donated: false,
            becomes: None,
        }
    }

    /// The guard of an input the caller donates, its next value output
    /// `becomes` if given.
    pub fn donated(t: &Tensor, becomes: Option<usize>) -> InputGuard {
        InputGuard {
            donated: true,
            becomes,
            ..InputGuard::of(t)
        }
    }

    pub fn is_contiguous(&self) -> bool {
        self.strides.is_none()
    }

    /// How far `actual` is from passing this guard: 0 when it passes; a
    /// dtype, rank or device change counts more than a size, a layout or a
    /// `requires_grad` flag (the dims `dynamic` says are count nothing).
    pub fn distance(&self, actual: &InputGuard, dynamic: &dyn Fn(usize) -> bool) -> usize {
        if self.dtype != actual.dtype || self.shape.len() != actual.shape.len() {
            return 4 + usize::from(self.device != actual.device) * 2;
        }
        let sizes = (0..self.shape.len())
            .filter(|&d| self.shape[d] != actual.shape[d] && !dynamic(d))
            .count();
        sizes
            + usize::from(self.strides != actual.strides)
            + usize::from(self.requires_grad != actual.requires_grad)
            + usize::from((self.donated, self.becomes) != (actual.donated, actual.becomes))
            + usize::from(self.device != actual.device) * 2
    }

    /// Why `actual` fails this guard (`what`: "input 0"), or `None` if it
    /// passes; the sizes of the dims `dynamic` says are may differ.
    pub fn mismatch(
        &self,
        what: &str,
        actual: &InputGuard,
        dynamic: &dyn Fn(usize) -> bool,
    ) -> Option<String> {
        if self.dtype != actual.dtype {
            return Some(format!(
                "{what}: expected dtype {}, got {}",
                self.dtype, actual.dtype
            ));
        }
        if self.shape.len() != actual.shape.len() {
            return Some(format!(
                "{what}: expected rank {}, got {}",
                self.shape.len(),
                actual.shape.len()
            ));
        }
        let differs = |d: &usize| self.shape[*d] != actual.shape[*d] && !dynamic(*d);
        if let Some(d) = (0..self.shape.len()).find(differs) {
            return Some(format!(
                "{what}, dim {d}: expected {}, got {}",
                self.shape[d], actual.shape[d]
            ));
        }
        if self.strides != actual.strides {
            let describe = |s: &Option<Vec<usize>>| match s {
                None => "contiguous".to_string(),
                Some(s) => format!("strides {s:?}"),
            };
            return Some(format!(
                "{what}: expected {}, got {}",
                describe(&self.strides),
                describe(&actual.strides)
            ));
        }
        if self.requires_grad != actual.requires_grad {
            return Some(format!(
                "{what}: expected requires_grad={}, got {}",
                self.requires_grad, actual.requires_grad
            ));
        }
        if self.device != actual.device {
            return Some(format!(
                "{what}: expected device {}, got {}",
                self.device, actual.device
            ));
        }
        if (self.donated, self.becomes) != (actual.donated, actual.becomes) {
            let says = |g: &InputGuard| match (g.donated, g.becomes) {
                (false, _) => "not donated".to_string(),
                (true, None) => "donated".to_string(),
                (true, Some(o)) => format!("donated to become output {o}"),
            };
            return Some(format!(
                "{what}: expected {}, got {}",
                says(self),
                says(actual)
            ));
        }
        None
    }
}

/// The first reason `actual` misses `expected`, input by input (user
/// inputs; none of them dynamic).
pub fn miss_reason(expected: &[InputGuard], actual: &[InputGuard]) -> Option<String> {
    miss_reason_with(expected, actual, "input", &DynamicDims::new())
}

/// [`miss_reason`] naming inputs `{what} {i}`, with the `dynamic` (input,
/// dim) pairs free to differ.
pub(super) fn miss_reason_with(
    expected: &[InputGuard],
    actual: &[InputGuard],
    what: &str,
    dynamic: &DynamicDims,
) -> Option<String> {
    if expected.len() != actual.len() {
        return Some(format!(
            "expected {} {what}s, got {}",
            expected.len(),
            actual.len()
        ));
    }
    expected
        .iter()
        .zip(actual)
        .enumerate()
        .find_map(|(i, (e, a))| {
            e.mismatch(&format!("{what} {i}"), a, &|d| dynamic.contains(&(i, d)))
        })
}

/// The device the executable's kernels run on: its inputs' (as
/// `device::of_inputs` decides: 0-dim host tensors are scalars, read on any
/// device), the host when none says otherwise.
pub(super) fn guards_device(guards: &[InputGuard], lifted: &[Tensor]) -> Device {
    let user = guards
        .iter()
        .filter(|g| !(g.device == Device::Cpu.name() && g.shape.is_empty()))
        .map(|g| Device::parse(g.device).unwrap_or_default());
    let captured = lifted
        .iter()
        .filter(|t| !(t.device() == Device::Cpu && t.rank() == 0))
        .map(Tensor::device);
    user.chain(captured).next().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_name_the_input_and_dim() {
        let a = Tensor::zeros(&[8, 4], DType::F32);
        let b = Tensor::zeros(&[16, 4], DType::F32);
        let r = miss_reason(&[InputGuard::of(&a)], &[InputGuard::of(&b)]).unwrap();
        assert_eq!(r, "input 0, dim 0: expected 8, got 16");
        let c = Tensor::zeros(&[8, 4], DType::F64);
        let r = miss_reason(&[InputGuard::of(&a)], &[InputGuard::of(&c)]).unwrap();
        assert_eq!(r, "input 0: expected dtype f32, got f64");
        let t = a.t();
        let r = miss_reason(&[InputGuard::of(&a)], &[InputGuard::of(&t)]).unwrap();
        assert_eq!(r, "input 0, dim 0: expected 8, got 4");
        // Same shape, other strides: a column of a wider tensor.
        let wide = Tensor::zeros(&[8, 8], DType::F32).narrow(1, 0, 4);
        let r = miss_reason(&[InputGuard::of(&a)], &[InputGuard::of(&wide)]).unwrap();
        assert_eq!(r, "input 0: expected contiguous, got strides [8, 1]");
        let t2 = Tensor::zeros(&[4, 8], DType::F32).t();
        let r = miss_reason(&[InputGuard::of(&t2)], &[InputGuard::of(&wide)]).unwrap();
        assert_eq!(r, "input 0: expected strides [1, 8], got strides [8, 1]");
        // A dynamic dim may differ.
        let dynamic = DynamicDims::from([(0, 0)]);
        let b16 = [InputGuard::of(&b)];
        assert!(miss_reason_with(&[InputGuard::of(&a)], &b16, "input", &dynamic).is_none());
        assert!(miss_reason(&[InputGuard::of(&a)], &[InputGuard::of(&a.clone())]).is_none());
        let g = a.set_requires_grad(true);
        let r = miss_reason(&[InputGuard::of(&a)], &[InputGuard::of(&g)]).unwrap();
        assert_eq!(r, "input 0: expected requires_grad=false, got true");
        let on_gpu = InputGuard {
            device: Device::Cuda.name(),
            ..InputGuard::of(&a)
        };
        let r = miss_reason(&[InputGuard::of(&a)], &[on_gpu]).unwrap();
        assert_eq!(r, "input 0: expected device cpu, got cuda");
        let r = miss_reason(&[InputGuard::of(&a)], &[InputGuard::donated(&a, None)]).unwrap();
        assert_eq!(r, "input 0: expected not donated, got donated");
        let paired = InputGuard::donated(&a, Some(3));
        let r = miss_reason(&[InputGuard::donated(&a, None)], &[paired]).unwrap();
        assert_eq!(
            r,
            "input 0: expected donated, got donated to become output 3"
        );
        let r = miss_reason(
            &[InputGuard::of(&a)],
            &[InputGuard::of(&a), InputGuard::of(&a)],
        );
        assert_eq!(r.unwrap(), "expected 1 inputs, got 2");
    }

    #[test]
    fn the_first_input_other_than_a_host_scalar_picks_the_device() {
        let host = InputGuard::of(&Tensor::zeros(&[2], DType::F32));
        let scalar = InputGuard::of(&Tensor::zeros(&[], DType::F32));
        let gpu = |shape: Vec<usize>| InputGuard {
            device: Device::Cuda.name(),
            shape,
            ..host.clone()
        };
        assert_eq!(guards_device(&[], &[]), Device::Cpu);
        assert_eq!(
            guards_device(&[scalar.clone(), gpu(vec![2])], &[]),
            Device::Cuda
        );
        assert_eq!(
            guards_device(&[gpu(vec![]), host.clone()], &[]),
            Device::Cuda,
            "a device scalar counts"
        );
        assert_eq!(
            guards_device(&[host.clone(), gpu(vec![2])], &[]),
            Device::Cpu
        );
        // Lifted tensors decide only after the user inputs.
        let lifted = [Tensor::zeros(&[3], DType::F32)];
        assert_eq!(
            guards_device(&[scalar.clone(), gpu(vec![2])], &lifted),
            Device::Cuda
        );
        assert_eq!(guards_device(&[scalar], &lifted), Device::Cpu);
    }
}
