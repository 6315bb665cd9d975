//! Distributed execution: process groups and the collective ops they call
//! (`tessera::all_reduce`, `reduce_scatter`, `all_gather`, `broadcast`,
//! `reduce`:
//! IR ops like any other, traced, compiled and scheduled — see
//! `ir::custom::collective` — whose kernels ask the group's
//! [`Communicator`]).
//!
//! A [`ProcessGroup`] is one rank's handle on a group: its id in this
//! process, its rank and the group's size. On the CPU,
//! [`ProcessGroup::threads`] makes a group of N threads of this process
//! that meet in memory (tests of data-parallel code run that way); the
//! CUDA backend makes one of one process per GPU over NCCL
//! (`tessera_cuda::nccl`). A traced or compiled program refers to its
//! group by the attributes of its collective nodes.
//!
//! Also here, the two plans a data-parallel step makes of its parameters:
//! gradient buckets ([`buckets`]) and, for a sharded optimizer,
//! which rank owns which parameter's state ([`owners`], [`bucket_owners`]).

use std::sync::Arc;

use crate::error::{Result, SourceLoc};
use crate::tensor::custom;
use crate::tensor::Tensor;

pub use crate::ir::custom::collective::{Call, Kind, ReduceOp};
pub use crate::tensor::custom::collective::{
    communicator, dispatch, register_communicator, Communicator, ThreadGroup,
};

/// One rank's handle on a process group.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ProcessGroup {
    id: u64,
    rank: usize,
    world: usize,
}

impl ProcessGroup {
    /// The handle of rank `rank` on `comm`'s group, registering `comm`
    /// (a group of one process per device: each process makes its own).
    pub fn new(comm: Arc<dyn Communicator>, rank: usize) -> Result<ProcessGroup> {
        let world = comm.world();
        if rank >= world {
            return Err(crate::error::Error::op(
                crate::error::ErrorKind::Argument,
                "ProcessGroup::new",
                format!("rank {rank} is not in a group of {world}"),
            ));
        }
        let id = register_communicator(comm);
        Ok(ProcessGroup { id, rank, world })
    }

    /// A group of `world` threads of this process: one handle per rank,
    /// each for its own thread, on the CPU. Each rank's thread should run
    /// in a rayon pool of its own, as a process per rank would ([`spawn`]
    /// does both).
    pub fn threads(world: usize) -> Result<Vec<ProcessGroup>> {
        Ok(Self::thread_group(world)?.1)
    }

    fn thread_group(world: usize) -> Result<(Arc<ThreadGroup>, Vec<ProcessGroup>)> {
        let group = Arc::new(ThreadGroup::new(world)?);
        let id = register_communicator(group.clone());
        let handles = (0..world)
            .map(|rank| ProcessGroup { id, rank, world })
            .collect();
        Ok((group, handles))
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world(&self) -> usize {
        self.world
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Runs (or traces) the collective `kind` on `tensors`, one output per
    /// input, all in one group call. Calls of equal `tag` meet in order
    /// (the n-th of a tag on every rank); each rank must make the same
    /// calls, with tensors of the same types.
    #[track_caller]
    pub fn collective(&self, kind: Kind, tag: u64, tensors: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.collective_after(kind, tag, tensors, &[])
    }

    /// [`ProcessGroup::collective`], ordered after the ops that compute
    /// `after` (in a traced program: inputs that only order the call, so
    /// that every rank's schedule makes its calls in one order).
    #[track_caller]
    pub fn collective_after(
        &self,
        kind: Kind,
        tag: u64,
        tensors: &[&Tensor],
        after: &[&Tensor],
    ) -> Result<Vec<Tensor>> {
        let at = SourceLoc::caller();
        let call = Call {
            kind,
            group: self.id,
            rank: self.rank,
            world: self.world,
            tag,
            deps: after.len(),
        };
        let inputs: Vec<&Tensor> = tensors.iter().chain(after).copied().collect();
        custom::lookup(kind.name())
            .and_then(|op| op.call(call.attrs(), &inputs))
            .map_err(|e| e.at(at))
    }

    /// Each output the sum (mean) of its input over the ranks.
    #[track_caller]
    pub fn all_reduce(&self, tensors: &[&Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        self.collective(Kind::AllReduce(op), 0, tensors)
    }

    /// `[world·k, …]` → `[k, …]`: this rank's block of the reduction.
    #[track_caller]
    pub fn reduce_scatter(&self, tensors: &[&Tensor], op: ReduceOp) -> Result<Vec<Tensor>> {
        self.collective(Kind::ReduceScatter(op), 0, tensors)
    }

    /// `[k, …]` → `[world·k, …]`: the ranks' tensors in rank order.
    #[track_caller]
    pub fn all_gather(&self, tensors: &[&Tensor]) -> Result<Vec<Tensor>> {
        self.collective(Kind::AllGather, 0, tensors)
    }

    /// Every output the root's input.
    #[track_caller]
    pub fn broadcast(&self, tensors: &[&Tensor], root: usize) -> Result<Vec<Tensor>> {
        self.collective(Kind::Broadcast { root }, 0, tensors)
    }

    /// On `root` each output the sum (mean) of its input over the ranks;
    /// on the other ranks each output its own input.
    #[track_caller]
    pub fn reduce(&self, tensors: &[&Tensor], op: ReduceOp, root: usize) -> Result<Vec<Tensor>> {
        self.collective(Kind::Reduce { op, root }, 0, tensors)
    }
}

/// Runs `f` on `world` threads, rank r's with its handle on a new
/// [`ThreadGroup`] and in a rayon pool of its own of `threads_per_rank`
/// workers (a rank waiting for another runs its own pool's jobs only, so
/// it never buries another rank's work under its wait). A rank that
/// panics stops the group (the others' calls fail rather than wait for
/// it) and its panic passes on. The results in rank order.
pub fn spawn<R: Send>(
    world: usize,
    threads_per_rank: usize,
    f: impl Fn(ProcessGroup) -> R + Sync,
) -> Result<Vec<R>> {
    let (comm, handles) = ProcessGroup::thread_group(world)?;
    let pools = (0..world)
        .map(|r| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads_per_rank.max(1))
                .thread_name(move |i| format!("tessera-rank{r}-{i}"))
                .build()
                .map_err(|e| {
                    crate::error::Error::op(
                        crate::error::ErrorKind::Device,
                        "dist::spawn",
                        format!("cannot start rank {r}'s thread pool: {e}"),
                    )
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let results = std::thread::scope(|s| {
        let runs: Vec<_> = handles
            .into_iter()
            .zip(&pools)
            .map(|(group, pool)| {
                let (f, comm) = (&f, &comm);
                s.spawn(move || {
                    let rank = group.rank();
                    let run = std::panic::AssertUnwindSafe(|| pool.install(|| f(group)));
                    std::panic::catch_unwind(run).inspect_err(|_| {
                        comm.abort(&format!("rank {rank} panicked"));
                    })
                })
            })
            .collect();
        runs.into_iter()
            .map(|h| h.join().unwrap_or_else(Err))
            .collect::<Vec<_>>()
    });
    results
        .into_iter()
        .map(|r| r.unwrap_or_else(|p| std::panic::resume_unwind(p)))
        .map(Ok)
        .collect()
}

/// Gradient buckets as PyTorch's DDP makes them: the parameters in reverse
/// order (the backward produces the last layers' gradients first), cut
/// into runs of at most `cap_bytes` (a parameter bigger than the cap is a
/// bucket of its own). `sizes` are the parameters' sizes in bytes; each
/// bucket lists parameter indices.
pub fn buckets(sizes: &[usize], cap_bytes: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut filled = 0usize;
    for i in (0..sizes.len()).rev() {
        match out.last_mut() {
            Some(last) if filled.saturating_add(sizes[i]) <= cap_bytes => {
                last.push(i);
                filled += sizes[i];
            }
            _ => {
                out.push(vec![i]);
                filled = sizes[i];
            }
        }
    }
    out
}

/// Which rank owns each parameter's optimizer state, balanced by size as
/// PyTorch's `ZeroRedundancyOptimizer` does: the largest first, each to the
/// rank that owns the fewest bytes so far (the lowest rank on ties).
pub fn owners(sizes: &[usize], world: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let mut load = vec![0usize; world.max(1)];
    let mut owner = vec![0usize; sizes.len()];
    for i in order {
        let rank = (0..load.len())
            .min_by_key(|&r| (load[r], r))
            .expect("a rank");
        owner[i] = rank;
        load[rank] = load[rank].saturating_add(sizes[i]);
    }
    owner
}

/// [`owners`] by whole buckets ([`buckets`] of at most `cap_bytes`): each
/// bucket goes to the rank owning the fewest bytes so far, the largest
/// first, so that right after a bucket's reduction one rank updates all of
/// it and one broadcast sends its new values (data-parallel ZeRO-1: the
/// broadcasts pipeline with the backward as the reductions do). With fewer
/// buckets than ranks, by parameter ([`owners`]), so that every rank still
/// owns a share.
pub fn bucket_owners(sizes: &[usize], cap_bytes: usize, world: usize) -> Vec<usize> {
    let buckets = buckets(sizes, cap_bytes);
    if buckets.len() < world {
        return owners(sizes, world);
    }
    let bytes: Vec<usize> = buckets
        .iter()
        .map(|b| {
            b.iter()
                .fold(0usize, |sum, &i| sum.saturating_add(sizes[i]))
        })
        .collect();
    let of_bucket = owners(&bytes, world);
    let mut owner = vec![0usize; sizes.len()];
    for (bucket, rank) in buckets.iter().zip(of_bucket) {
        for &i in bucket {
            owner[i] = rank;
        }
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_run_backwards_under_the_cap() {
        assert_eq!(
            buckets(&[4, 4, 4, 10, 2], 8),
            vec![vec![4], vec![3], vec![2, 1], vec![0]]
        );
        assert_eq!(buckets(&[1, 1, 1], 100), vec![vec![2, 1, 0]]);
        assert!(buckets(&[], 8).is_empty());
    }

    #[test]
    fn owners_balance_bytes() {
        assert_eq!(owners(&[10, 1, 9, 2], 2), vec![0, 0, 1, 1]);
        assert_eq!(owners(&[3, 3], 1), vec![0, 0]);
    }

    #[test]
    fn bucket_owners_keep_each_bucket_on_one_rank() {
        // Buckets (reverse order, cap 8): [4], [3], [2, 1], [0] of 2, 10,
        // 8 and 4 bytes: the 10 to rank 0, the 8 and the 4 to rank 1, the
        // 2 to rank 0.
        assert_eq!(bucket_owners(&[4, 4, 4, 10, 2], 8, 2), vec![1, 1, 1, 0, 0]);
        // Fewer buckets than ranks: by parameter.
        assert_eq!(
            bucket_owners(&[10, 1, 9, 2], 100, 2),
            owners(&[10, 1, 9, 2], 2)
        );
    }
}
