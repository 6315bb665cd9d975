//! Creating tensors and reading their values back.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::panic::Location;

use rand::RngCore;
use rand::SeedableRng;

use super::{unwrap_or_panic, Tensor};
use crate::error::{Error, ErrorKind, Result};
use crate::ir::{DType, Literal, LiteralData, Op, Scalar, Shape};
use crate::runtime::cpu::{in_kernel as cpu_in_kernel, Element, Storage};
use crate::runtime::device::{Device, DeviceStorage};
use crate::with_dtype;

/// An explicit, seeded source of randomness. Each random op draws a fresh
/// seed from it, so a program that creates its generator with the same seed
/// gets the same tensors, eagerly or compiled. The seed is the random op's
/// operand, a host `i64[]` scalar made per draw: while tracing it is lifted
/// into an input of the graph, so a compiled function fed a new seed on
/// every call keeps one graph (and one executable).
pub struct Generator {
    rng: rand_chacha::ChaCha8Rng,
}

impl Generator {
    pub fn new(seed: u64) -> Generator {
        Generator {
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The seed for the next random op: drawn from this generator, or,
    /// while a [`replay_seeds`] runs, the next seed it replays (this
    /// generator then stays where it is).
    pub fn next_seed(&mut self) -> u64 {
        if let Some(seed) = SEED_TAPE.with(|t| match &mut *t.borrow_mut() {
            Some(SeedTape::Replay(seeds)) => seeds.pop_front(),
            _ => None,
        }) {
            return seed;
        }
        let seed = self.rng.next_u64();
        SEED_TAPE.with(|t| {
            if let Some(SeedTape::Record(seeds)) = &mut *t.borrow_mut() {
                seeds.push(seed);
            }
        });
        seed
    }

    /// The next seed as a random op's seed operand (what
    /// [`Tensor::rand_seeded`] takes): a host `i64[]` scalar holding its 64
    /// bits ([`Op::seed_value`]).
    pub fn next_seed_tensor(&mut self) -> Tensor {
        let value = Op::seed_value(self.next_seed());
        Tensor::from_storage(Storage::from_slice(&[value]), &[])
    }
}

/// The seeds random ops draw on this thread, recorded or replayed: a
/// compiled call that traces its function and then runs it eagerly (a
/// graph break with inputs that require grad, a graph that does not
/// compile) must draw from the generators once, as one eager call does,
/// so the eager run takes the seeds the trace drew.
enum SeedTape {
    Record(Vec<u64>),
    Replay(VecDeque<u64>),
}

thread_local! {
    static SEED_TAPE: RefCell<Option<SeedTape>> = const { RefCell::new(None) };
}

/// Puts the thread's previous tape back, also when `f` panics.
struct RestoreTape(Option<SeedTape>);

impl Drop for RestoreTape {
    fn drop(&mut self) {
        let previous = self.0.take();
        SEED_TAPE.with(|t| *t.borrow_mut() = previous);
    }
}

fn with_tape<R>(tape: SeedTape, f: impl FnOnce() -> R) -> (R, Option<SeedTape>) {
    let restore = RestoreTape(SEED_TAPE.with(|t| t.borrow_mut().replace(tape)));
    let result = f();
    let tape = SEED_TAPE.with(|t| t.borrow_mut().take());
    drop(restore);
    (result, tape)
}

/// Runs `f`, returning with its result the seeds every generator drew on
/// this thread meanwhile, in order.
pub fn record_seeds<R>(f: impl FnOnce() -> R) -> (R, Vec<u64>) {
    match with_tape(SeedTape::Record(Vec::new()), f) {
        (result, Some(SeedTape::Record(seeds))) => (result, seeds),
        (result, _) => (result, Vec::new()),
    }
}

/// Runs `f` with the generators on this thread handing out `seeds`, in
/// order, instead of drawing (past the last, they draw again).
pub fn replay_seeds<R>(seeds: Vec<u64>, f: impl FnOnce() -> R) -> R {
    with_tape(SeedTape::Replay(seeds.into()), f).0
}

impl Tensor {
    /// A contiguous tensor holding `data` with `shape`.
    #[track_caller]
    pub fn from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Tensor {
        unwrap_or_panic(Tensor::slice_at(&data, shape, Location::caller()))
    }

    /// [`Tensor::from_vec`], returning errors (a shape `data` does not fill,
    /// or past the size limit; no memory) instead of panicking.
    #[track_caller]
    pub fn try_from_vec<T: Element>(data: Vec<T>, shape: &[usize]) -> Result<Tensor> {
        Tensor::slice_at(&data, shape, Location::caller())
    }

    /// A contiguous tensor holding a copy of `data` with `shape`.
    #[track_caller]
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Tensor {
        unwrap_or_panic(Tensor::slice_at(data, shape, Location::caller()))
    }

    /// [`Tensor::from_slice`], returning errors instead of panicking.
    #[track_caller]
    pub fn try_from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Tensor> {
        Tensor::slice_at(data, shape, Location::caller())
    }

    fn slice_at<T: Element>(
        data: &[T],
        shape: &[usize],
        caller: &'static Location<'static>,
    ) -> Result<Tensor> {
        let at = |e: Error| e.at(crate::error::SourceLoc::from_location(caller));
        let numel = crate::limits::check("from_vec", T::DTYPE, shape).map_err(at)?;
        if numel != data.len() {
            return Err(at(Error::op(
                ErrorKind::Shape,
                "from_vec",
                format!(
                    "{} values do not fill shape {:?} ({numel} elements)",
                    data.len(),
                    shape
                ),
            )));
        }
        let storage = Storage::try_from_slice(data)
            .map_err(|e| at(cpu_error(e, "from_vec", T::DTYPE, shape)))?;
        Ok(Tensor::from_storage(storage, shape))
    }

    /// A 0-dim tensor holding `value` as `dtype`.
    #[track_caller]
    pub fn scalar(value: f64, dtype: DType) -> Tensor {
        Tensor::full(&[], value, dtype)
    }

    /// A tensor of `shape` filled with `value` (converted to `dtype`:
    /// truncated for an integer dtype, whose range it must be in).
    #[track_caller]
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Tensor {
        unwrap_or_panic(Tensor::full_at(shape, value, dtype, Location::caller()))
    }

    /// [`Tensor::full`], returning errors (a shape past the size limit, a
    /// value out of the dtype's range, no memory) instead of panicking.
    #[track_caller]
    pub fn try_full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        Tensor::full_at(shape, value, dtype, Location::caller())
    }

    fn full_at(
        shape: &[usize],
        value: f64,
        dtype: DType,
        caller: &'static Location<'static>,
    ) -> Result<Tensor> {
        let value = if dtype.is_float() {
            Scalar::Float(value)
        } else if dtype.is_int() {
            // -2^63 ..= 2^63 - 1 after truncation; `as` would saturate.
            let t = value.trunc();
            if !(t >= -(2f64.powi(63)) && t < 2f64.powi(63)) {
                return Err(Error::op(
                    ErrorKind::Argument,
                    "full",
                    format!("value {value} does not fit in {dtype}"),
                )
                .at(crate::error::SourceLoc::from_location(caller)));
            }
            Scalar::Int(t as i64)
        } else {
            Scalar::Bool(value != 0.0)
        };
        let op = Op::Full {
            value,
            shape: Shape::from_concrete(shape),
            dtype,
        };
        Tensor::apply(&op, &[], caller)
    }

    /// A tensor of no elements of `dtype` on `device`, made without an
    /// op: no kernel is queued and nothing allocated. What a value moved
    /// out leaves behind (a donated parameter, an optimizer state while a
    /// compiled step holds it), hundreds of times a step.
    pub(crate) fn no_elements(device: Device, dtype: DType) -> Tensor {
        match device {
            Device::Cpu => Tensor::from_storage(Storage::new(dtype, 0), &[0]),
            _ => Tensor::from_device_storage(DeviceStorage::no_elements(device, dtype), &[0]),
        }
    }

    #[track_caller]
    pub fn zeros(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::full(shape, 0.0, dtype)
    }

    /// [`Tensor::zeros`], returning errors instead of panicking.
    #[track_caller]
    pub fn try_zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full_at(shape, 0.0, dtype, Location::caller())
    }

    #[track_caller]
    pub fn ones(shape: &[usize], dtype: DType) -> Tensor {
        Tensor::full(shape, 1.0, dtype)
    }

    /// [`Tensor::ones`], returning errors instead of panicking.
    #[track_caller]
    pub fn try_ones(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full_at(shape, 1.0, dtype, Location::caller())
    }

    /// `start, start+step, …` below `end`, like `torch.arange`.
    #[track_caller]
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType) -> Tensor {
        unwrap_or_panic(Tensor::try_arange(start, end, step, dtype))
    }

    /// [`Tensor::arange`], returning errors (a bad range, more elements
    /// than the size limit, no memory) instead of panicking.
    #[track_caller]
    pub fn try_arange(start: f64, end: f64, step: f64, dtype: DType) -> Result<Tensor> {
        let op = Op::Arange {
            start,
            end,
            step,
            dtype,
        };
        Tensor::apply(&op, &[], Location::caller())
    }

    /// Uniform samples in [0, 1), with the next seed of `generator`.
    #[track_caller]
    pub fn rand(shape: &[usize], dtype: DType, generator: &mut Generator) -> Tensor {
        unwrap_or_panic(Tensor::try_rand(shape, dtype, generator))
    }

    /// [`Tensor::rand`], returning errors instead of panicking.
    #[track_caller]
    pub fn try_rand(shape: &[usize], dtype: DType, generator: &mut Generator) -> Result<Tensor> {
        let seed = generator.next_seed_tensor();
        Tensor::try_rand_seeded(&seed, shape, dtype)
    }

    /// Standard normal samples, with the next seed of `generator`.
    #[track_caller]
    pub fn randn(shape: &[usize], dtype: DType, generator: &mut Generator) -> Tensor {
        unwrap_or_panic(Tensor::try_randn(shape, dtype, generator))
    }

    /// [`Tensor::randn`], returning errors instead of panicking.
    #[track_caller]
    pub fn try_randn(shape: &[usize], dtype: DType, generator: &mut Generator) -> Result<Tensor> {
        let seed = generator.next_seed_tensor();
        Tensor::try_randn_seeded(&seed, shape, dtype)
    }

    /// Uniform samples in [0, 1) drawn from `seed`, an `i64[]` scalar (see
    /// [`Generator::next_seed_tensor`]): the same seed gives the same values, eagerly or
    /// compiled, on every device. Passed to a compiled function as an
    /// input, it draws new values per call from one executable.
    #[track_caller]
    pub fn rand_seeded(seed: &Tensor, shape: &[usize], dtype: DType) -> Tensor {
        unwrap_or_panic(Tensor::try_rand_seeded(seed, shape, dtype))
    }

    /// [`Tensor::rand_seeded`], returning errors (a seed that is not an
    /// `i64[]` scalar, a non-float dtype) instead of panicking.
    #[track_caller]
    pub fn try_rand_seeded(seed: &Tensor, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let op = Op::Rand {
            shape: Shape::from_concrete(shape),
            dtype,
        };
        Tensor::apply(&op, &[seed], Location::caller())
    }

    /// Standard normal samples drawn from `seed`, like [`Tensor::rand_seeded`].
    #[track_caller]
    pub fn randn_seeded(seed: &Tensor, shape: &[usize], dtype: DType) -> Tensor {
        unwrap_or_panic(Tensor::try_randn_seeded(seed, shape, dtype))
    }

    /// [`Tensor::randn_seeded`], returning errors instead of panicking.
    #[track_caller]
    pub fn try_randn_seeded(seed: &Tensor, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let op = Op::Randn {
            shape: Shape::from_concrete(shape),
            dtype,
        };
        Tensor::apply(&op, &[seed], Location::caller())
    }

    /// A constant tensor from a literal (the IR's `constant` op).
    #[track_caller]
    pub fn from_literal(lit: Literal) -> Tensor {
        unwrap_or_panic(Tensor::apply(&Op::Constant(lit), &[], Location::caller()))
    }

    /// The values as a literal (the inverse of [`Tensor::from_literal`]):
    /// floats as f64 (which holds every f32, f16 and bf16 value exactly),
    /// integers as i64 (a u64 as its bit pattern), bools as bools.
    #[track_caller]
    pub fn to_literal(&self) -> Result<Literal> {
        let data = match self.dtype() {
            DType::Bool => {
                LiteralData::Bool(self.to_vec::<u8>()?.into_iter().map(|b| b != 0).collect())
            }
            DType::I64 => LiteralData::Int(self.to_vec::<i64>()?),
            d if d.is_int() => LiteralData::Int(self.try_cast(DType::I64)?.to_vec::<i64>()?),
            _ => LiteralData::Float(self.to_f64_vec()),
        };
        Ok(Literal {
            dtype: self.dtype(),
            shape: self.shape().to_vec(),
            data,
        })
    }

    /// The elements in row-major order. Errors when `T` is not the dtype.
    /// While tracing with known inputs (compiled code) this is a graph
    /// break: the graph so far runs to produce the values.
    #[track_caller]
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        self.expect_dtype::<T>()?;
        if self.is_traced() {
            return super::trace::materialize(self, "to_vec", crate::error::SourceLoc::caller())?
                .to_vec();
        }
        if self.device() != crate::runtime::device::Device::Cpu {
            return self.to_host()?.to_vec();
        }
        let at = crate::error::SourceLoc::caller();
        self.array().to_vec().map_err(|e| e.at(at))
    }

    /// The elements converted to f64, in row-major order (bools as 0/1).
    #[track_caller]
    pub fn to_f64_vec(&self) -> Vec<f64> {
        with_dtype!(self.dtype(), T => {
            match self.to_vec::<T>() {
                Ok(v) => v.into_iter().map(|v| v.to_f64()).collect(),
                Err(e) => panic!("{e}"),
            }
        })
    }

    /// The single value of a one-element tensor, as f64.
    #[track_caller]
    pub fn item(&self) -> f64 {
        if self.numel() != 1 {
            panic!(
                "{}",
                Error::op(
                    ErrorKind::Shape,
                    "item",
                    format!("needs exactly one element, got {}", self.ty())
                )
                .at(crate::error::SourceLoc::caller())
            );
        }
        self.to_f64_vec()[0]
    }
}

/// An allocation error of `op` making `dtype`/`shape`, said about the op.
fn cpu_error(e: Error, op: &str, dtype: DType, shape: &[usize]) -> Error {
    cpu_in_kernel(e, op, &crate::ir::TensorType::new(dtype, shape).to_string())
}
