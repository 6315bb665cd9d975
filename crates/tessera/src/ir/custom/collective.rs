//! The signatures of the collective ops (their kernels are
//! `tensor::custom::collective`'s on the CPU and tessera-cuda's NCCL slot
//! on the GPU; `dist::ProcessGroup` calls them).
//!
//! Each op takes one or more tensors and gives one per input, all of one
//! group call (NCCL's `ncclGroupStart`/`ncclGroupEnd`): a gradient bucket
//! is one node, its tensors reduced together, with no copy into a flat
//! buffer. Attributes: `group` (the process group's id in this process),
//! `rank` and `world` (this rank and the group's size: the shape
//! functions need the size, the CPU rendezvous the rank), `tag` (which
//! calls of the ranks meet: the n-th call of a tag on one rank meets the
//! n-th of the same tag on every other), `deps` (optional: the number of
//! trailing inputs that only order the call after the ops computing them —
//! every rank must make its collective calls in one order, NCCL's rule,
//! and a rank's schedule follows its own graph, which differs between
//! ranks with a sharded optimizer; chaining the calls makes the order part
//! of the graph), and per op:
//!
//! - `tessera::all_reduce {op: "sum"|"avg"}`: each output the element-wise
//!   sum (mean) of that input over the ranks;
//! - `tessera::reduce_scatter {op}`: input `[world·k, …]` → `[k, …]`, this
//!   rank's block of the reduced tensor;
//! - `tessera::all_gather`: input `[k, …]` → `[world·k, …]`, the ranks'
//!   inputs in rank order;
//! - `tessera::broadcast {root}`: every output the root's input;
//! - `tessera::reduce {op, root}`: on the root each output the reduced
//!   input (as `all_reduce`), on every other rank its own input (NCCL's
//!   `ncclReduce` writes the root's only): what a sharded optimizer's
//!   owner needs of a gradient bucket, at half an all-reduce's traffic.

use std::sync::Arc;

use super::{Attrs, Signature};
use crate::error::{op_err, Result};
use crate::ir::{DType, Dim, Shape, TensorType};

/// The all-reduce op's registered name.
pub const ALL_REDUCE: &str = "tessera::all_reduce";
/// The reduce-scatter op's registered name.
pub const REDUCE_SCATTER: &str = "tessera::reduce_scatter";
/// The all-gather op's registered name.
pub const ALL_GATHER: &str = "tessera::all_gather";
/// The broadcast op's registered name.
pub const BROADCAST: &str = "tessera::broadcast";
/// The reduce (to one rank) op's registered name.
pub const REDUCE: &str = "tessera::reduce";

/// The five ops' names.
pub const NAMES: [&str; 5] = [ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, REDUCE];

/// How a reducing collective combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the group's size (float dtypes only).
    Avg,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
        }
    }
}

/// What one collective call does: the op, its group and rank, and the
/// op's own parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    AllReduce(ReduceOp),
    ReduceScatter(ReduceOp),
    AllGather,
    Broadcast { root: usize },
    Reduce { op: ReduceOp, root: usize },
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::AllReduce(_) => ALL_REDUCE,
            Kind::ReduceScatter(_) => REDUCE_SCATTER,
            Kind::AllGather => ALL_GATHER,
            Kind::Broadcast { .. } => BROADCAST,
            Kind::Reduce { .. } => REDUCE,
        }
    }
}

/// A collective call's attributes, decoded and checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Call {
    pub kind: Kind,
    pub group: u64,
    pub rank: usize,
    pub world: usize,
    pub tag: u64,
    /// Trailing inputs that only order the call (see the module docs).
    pub deps: usize,
}

impl Call {
    /// The attributes of this call (what [`Call::decode`] reads back).
    pub fn attrs(&self) -> Attrs {
        let mut a = Attrs::new();
        a.insert("group".into(), self.group.into());
        a.insert("rank".into(), self.rank.into());
        a.insert("world".into(), self.world.into());
        a.insert("tag".into(), self.tag.into());
        if self.deps > 0 {
            a.insert("deps".into(), self.deps.into());
        }
        match self.kind {
            Kind::AllReduce(op) | Kind::ReduceScatter(op) => {
                a.insert("op".into(), op.name().into());
            }
            Kind::AllGather => {}
            Kind::Broadcast { root } => {
                a.insert("root".into(), root.into());
            }
            Kind::Reduce { op, root } => {
                a.insert("op".into(), op.name().into());
                a.insert("root".into(), root.into());
            }
        }
        a
    }

    /// The call of op `name` with `attrs`, checked (rank and root below
    /// the world size, a known reduction).
    pub fn decode(name: &str, attrs: &Attrs) -> Result<Call> {
        let int = |key: &str| -> Result<u64> {
            attrs.get(key).and_then(|v| v.as_u64()).ok_or_else(|| {
                op_err!(
                    Argument,
                    name,
                    "needs a non-negative integer `{key}` attribute, got {:?}",
                    attrs.get(key)
                )
            })
        };
        let reduce = || -> Result<ReduceOp> {
            match attrs.get("op").and_then(|v| v.as_str()) {
                Some("sum") => Ok(ReduceOp::Sum),
                Some("avg") => Ok(ReduceOp::Avg),
                other => Err(op_err!(
                    Argument,
                    name,
                    "needs an `op` attribute \"sum\" or \"avg\", got {other:?}"
                )),
            }
        };
        let (world, rank) = (int("world")? as usize, int("rank")? as usize);
        if world == 0 || rank >= world {
            return Err(op_err!(
                Argument,
                name,
                "rank {rank} is not in a group of {world}"
            ));
        }
        let root = || -> Result<usize> {
            let root = int("root")? as usize;
            match root < world {
                true => Ok(root),
                false => Err(op_err!(
                    Argument,
                    name,
                    "root {root} is not in a group of {world}"
                )),
            }
        };
        let kind = match name {
            ALL_REDUCE => Kind::AllReduce(reduce()?),
            REDUCE_SCATTER => Kind::ReduceScatter(reduce()?),
            ALL_GATHER => Kind::AllGather,
            BROADCAST => Kind::Broadcast { root: root()? },
            REDUCE => Kind::Reduce {
                op: reduce()?,
                root: root()?,
            },
            _ => return Err(op_err!(Argument, name, "is not a collective op")),
        };
        Ok(Call {
            kind,
            group: int("group")?,
            rank,
            world,
            tag: int("tag")?,
            deps: match attrs.get("deps") {
                None => 0,
                Some(_) => int("deps")? as usize,
            },
        })
    }

    /// The inputs that carry data: all but the trailing `deps`.
    pub fn data<'a, T>(&self, inputs: &'a [T]) -> Result<&'a [T]> {
        match inputs.len().checked_sub(self.deps) {
            Some(n) if n > 0 => Ok(&inputs[..n]),
            _ => Err(op_err!(
                Argument,
                self.kind.name(),
                "takes at least one tensor besides its {} ordering inputs, got {} inputs",
                self.deps,
                inputs.len()
            )),
        }
    }

    /// The kind of the backward call of op `name`'s kind (`None`: a
    /// broadcast or a reduce, which have no backward).
    #[allow(clippy::type_complexity)]
    pub fn backward_kind_of(name: &str) -> Option<fn(Kind) -> Kind> {
        match name {
            ALL_REDUCE => Some(|k| k),
            REDUCE_SCATTER => Some(|_| Kind::AllGather),
            ALL_GATHER => Some(|_| Kind::ReduceScatter(ReduceOp::Sum)),
            _ => None,
        }
    }

    /// The type of each output for `inputs`.
    pub fn output_types(&self, inputs: &[TensorType]) -> Result<Vec<TensorType>> {
        let name = self.kind.name();
        if inputs.is_empty() {
            return Err(op_err!(Argument, name, "takes at least one tensor"));
        }
        inputs.iter().map(|t| self.output_type(t)).collect()
    }

    fn output_type(&self, t: &TensorType) -> Result<TensorType> {
        let name = self.kind.name();
        if !carried(t.dtype) {
            return Err(op_err!(
                DType,
                name,
                "has no kernel for {t} (float, i32 or bool tensors)"
            ));
        }
        let reduced = match self.kind {
            Kind::AllReduce(op) | Kind::ReduceScatter(op) | Kind::Reduce { op, .. } => Some(op),
            _ => None,
        };
        if reduced == Some(ReduceOp::Avg) && !t.dtype.is_float() {
            return Err(op_err!(DType, name, "averages float tensors only, got {t}"));
        }
        if reduced.is_some() && t.dtype == DType::Bool {
            return Err(op_err!(DType, name, "does not reduce bool tensors"));
        }
        let world = Dim::from(self.world);
        let first = |t: &TensorType| -> Result<Dim> {
            t.shape
                .0
                .first()
                .cloned()
                .ok_or_else(|| op_err!(Shape, name, "needs tensors of rank >= 1, got {t}"))
        };
        let with_first = |d: Dim| {
            let mut dims = t.shape.0.clone();
            dims[0] = d;
            TensorType::new(t.dtype, Shape(dims))
        };
        match self.kind {
            Kind::AllReduce(_) | Kind::Broadcast { .. } | Kind::Reduce { .. } => Ok(t.clone()),
            Kind::ReduceScatter(_) => {
                let d = first(t)?;
                d.div_exact(&world).map(with_first).ok_or_else(|| {
                    op_err!(
                        Shape,
                        name,
                        "needs a first dim divisible by the group's size {}, got {t}",
                        self.world
                    )
                })
            }
            Kind::AllGather => {
                let d = first(t)?;
                d.checked_mul(&world)
                    .map(with_first)
                    .ok_or_else(|| op_err!(Shape, name, "{t} times {} overflows", self.world))
            }
        }
    }
}

/// Whether the collectives carry `dtype` (every value exact in f64, what
/// the CPU rendezvous computes in; NCCL has no bool, which the CUDA slot
/// reports).
fn carried(dtype: DType) -> bool {
    dtype != DType::I64
}

/// The signatures of the five ops.
pub(super) fn signatures() -> Vec<Signature> {
    NAMES
        .iter()
        .map(|&name| {
            let shape = move |attrs: &Attrs, inputs: &[TensorType]| {
                let call = Call::decode(name, attrs)?;
                call.output_types(call.data(inputs)?)
            };
            Signature::new(name, Arc::new(shape)).expect("a valid built-in name")
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(kind: Kind) -> Call {
        Call {
            kind,
            group: 1,
            rank: 1,
            world: 2,
            tag: 7,
            deps: 0,
        }
    }

    #[test]
    fn attributes_round_trip() {
        for kind in [
            Kind::AllReduce(ReduceOp::Avg),
            Kind::ReduceScatter(ReduceOp::Sum),
            Kind::AllGather,
            Kind::Broadcast { root: 1 },
            Kind::Reduce {
                op: ReduceOp::Sum,
                root: 0,
            },
        ] {
            let c = call(kind);
            assert_eq!(Call::decode(kind.name(), &c.attrs()).unwrap(), c);
        }
        let mut bad = call(Kind::Broadcast { root: 0 }).attrs();
        bad.insert("root".into(), 2.into());
        let err = Call::decode(BROADCAST, &bad).unwrap_err();
        assert!(
            err.to_string().contains("root 2 is not in a group of 2"),
            "{err}"
        );
        let reduce = Kind::Reduce {
            op: ReduceOp::Avg,
            root: 1,
        };
        let mut no_op = call(reduce).attrs();
        no_op.remove("op");
        let err = Call::decode(REDUCE, &no_op).unwrap_err();
        assert!(err.to_string().contains("needs an `op` attribute"), "{err}");
    }

    #[test]
    fn shapes_follow_the_group_size() {
        let t = TensorType::new(DType::F32, vec![4usize, 3]);
        let scatter = call(Kind::ReduceScatter(ReduceOp::Sum));
        assert_eq!(
            scatter.output_types(std::slice::from_ref(&t)).unwrap()[0],
            TensorType::new(DType::F32, vec![2usize, 3])
        );
        let gather = call(Kind::AllGather).output_types(std::slice::from_ref(&t));
        assert_eq!(
            gather.unwrap()[0],
            TensorType::new(DType::F32, vec![8usize, 3])
        );
        let odd = TensorType::new(DType::F32, vec![3usize]);
        let err = scatter.output_types(&[odd]).unwrap_err();
        assert!(err.to_string().contains("divisible"), "{err}");
        let ints = TensorType::new(DType::I32, vec![2usize]);
        let err = call(Kind::AllReduce(ReduceOp::Avg))
            .output_types(&[ints])
            .unwrap_err();
        assert!(err.to_string().contains("float tensors only"), "{err}");
    }
}
