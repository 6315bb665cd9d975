//! Guards: what a cached executable assumes about its inputs, and the
//! reason a call misses ("input 0, dim 0: expected 8, got 16").

use crate::ir::DType;
use crate::runtime::device::Device;
use crate::tensor::Tensor;

/// What one input must look like for an executable to serve it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InputGuard {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub contiguous: bool,
    pub requires_grad: bool,
    /// The device's name: an executable's memory plan is made for its
    /// inputs' device, so a call on another device recompiles.
    pub device: &'static str,
}

impl InputGuard {
    pub fn of(t: &Tensor) -> InputGuard {
        InputGuard {
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
            contiguous: t.is_contiguous(),
            requires_grad: t.requires_grad(),
            device: t.device().name(),
        }
    }

    /// Why `actual` fails this guard (input `index`), or `None` if it passes.
    pub fn mismatch(&self, index: usize, actual: &InputGuard) -> Option<String> {
        let at = format!("input {index}");
        if self.dtype != actual.dtype {
            return Some(format!(
                "{at}: expected dtype {}, got {}",
                self.dtype, actual.dtype
            ));
        }
        if self.shape.len() != actual.shape.len() {
            return Some(format!(
                "{at}: expected rank {}, got {}",
                self.shape.len(),
                actual.shape.len()
            ));
        }
        if let Some(d) = (0..self.shape.len()).find(|&d| self.shape[d] != actual.shape[d]) {
            return Some(format!(
                "{at}, dim {d}: expected {}, got {}",
                self.shape[d], actual.shape[d]
            ));
        }
        if self.contiguous != actual.contiguous {
            return Some(format!(
                "{at}: expected contiguous={}, got {}",
                self.contiguous, actual.contiguous
            ));
        }
        if self.requires_grad != actual.requires_grad {
            return Some(format!(
                "{at}: expected requires_grad={}, got {}",
                self.requires_grad, actual.requires_grad
            ));
        }
        if self.device != actual.device {
            return Some(format!(
                "{at}: expected device {}, got {}",
                self.device, actual.device
            ));
        }
        None
    }
}

/// The first reason `actual` misses `expected`, input by input.
pub fn miss_reason(expected: &[InputGuard], actual: &[InputGuard]) -> Option<String> {
    if expected.len() != actual.len() {
        return Some(format!(
            "expected {} inputs, got {}",
            expected.len(),
            actual.len()
        ));
    }
    expected
        .iter()
        .zip(actual)
        .enumerate()
        .find_map(|(i, (e, a))| e.mismatch(i, a))
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
