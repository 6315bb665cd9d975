//! The collective ops' implementation (their signatures and attributes are
//! `ir::custom::collective`'s): the communicators that run them, a
//! registry of them by group id, and the CPU one — a group of threads of
//! this process that meet in a [`ThreadGroup`].
//!
//! Every backend's kernel is [`dispatch`]: the call's group names a
//! [`Communicator`], which runs the call on the tensors of its device (the
//! CPU's here; tessera-cuda's NCCL communicator fills the CUDA slot with
//! the same dispatch). A call of rank r of a [`ThreadGroup`] hands its
//! inputs over, waits for the other ranks' inputs of the same call (the
//! n-th call of a tag on each rank), and computes its own outputs from all
//! of them, in f64 (exact for every dtype the ops carry; sums are rounded
//! once, to the output dtype). Calls may meet in any order: the compiled
//! CPU executor runs independent kernels concurrently, so two buckets'
//! all-reduces may start in different orders on two ranks; a rank waiting
//! on a rayon worker keeps running the pool's other jobs meanwhile.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::{Attrs, BackwardCtx, CustomOp};
use crate::error::{op_err, Result};
use crate::ir::custom::collective::{Call, Kind, ReduceOp, NAMES};
use crate::ir::{DType, TensorType};
use crate::runtime::cpu::Element;
use crate::runtime::device::Device;
use crate::tensor::Tensor;

/// What runs the collective calls of one process group in this process.
pub trait Communicator: Send + Sync {
    /// The group's size.
    fn world(&self) -> usize;

    /// Runs this process's part of `call` (its rank is `call.rank`) on
    /// `inputs`, of the types the op's shape function checked; one output
    /// per input.
    fn run(&self, call: &Call, inputs: &[&Tensor]) -> Result<Vec<Tensor>>;
}

static GROUPS: LazyLock<RwLock<HashMap<u64, Arc<dyn Communicator>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));
static NEXT_GROUP: AtomicU64 = AtomicU64::new(1);

/// Registers `comm` and returns its group id (unique in this process).
pub fn register_communicator(comm: Arc<dyn Communicator>) -> u64 {
    let id = NEXT_GROUP.fetch_add(1, Ordering::Relaxed);
    GROUPS.write().expect("process groups").insert(id, comm);
    id
}

/// The communicator of group `id`.
pub fn communicator(op: &str, id: u64) -> Result<Arc<dyn Communicator>> {
    GROUPS
        .read()
        .expect("process groups")
        .get(&id)
        .cloned()
        .ok_or_else(|| {
            op_err!(
                Argument,
                op,
                "no process group {id} in this process (a graph from another process?)"
            )
        })
}

/// Every backend's kernel of the collective ops: the group's communicator
/// runs the call.
pub fn dispatch(name: &str, attrs: &Attrs, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
    let call = Call::decode(name, attrs)?;
    let comm = communicator(name, call.group)?;
    if comm.world() != call.world {
        return Err(op_err!(
            Argument,
            name,
            "the call says {} ranks, group {} has {}",
            call.world,
            call.group,
            comm.world()
        ));
    }
    comm.run(&call, call.data(inputs)?)
}

/// The built-in custom ops this module implements (the CPU slots).
pub(super) fn builtins() -> Vec<Arc<CustomOp>> {
    NAMES
        .iter()
        .map(|&name| {
            let builder = CustomOp::builder(name).cpu(move |a, i| dispatch(name, a, i));
            let builder = match Call::backward_kind_of(name) {
                Some(_) => builder.backward(move |ctx| backward(name, ctx)),
                None => builder,
            };
            builder.implement_builtin().expect("a built-in signature")
        })
        .collect()
}

/// The backward of a call of op `name`: the gradient of an all-reduce's
/// `Σ_k x_k` (or mean) with respect to this rank's `x` is the same
/// reduction of every rank's output gradient; a reduce-scatter's is the
/// gathered gradients (divided by the world for a mean); an all-gather's
/// is this rank's block of the summed gradients. The backward calls keep
/// the forward's group, rank and tag: they meet as the forward's did.
fn backward(name: &str, ctx: &BackwardCtx<'_>) -> Result<Vec<Option<Tensor>>> {
    let call = Call::decode(name, ctx.attrs)?;
    let kind = Call::backward_kind_of(name)
        .map(|f| f(call.kind))
        .ok_or_else(|| op_err!(Unsupported, name, "has no backward"))?;
    let back = Call {
        kind,
        deps: 0,
        ..call
    };
    let args: Vec<&Tensor> = ctx.grads.iter().collect();
    let grads = super::lookup(kind.name())?.call(back.attrs(), &args)?;
    // The ordering inputs have no gradient.
    let deps = std::iter::repeat_n(Ok(None), call.deps);
    let scale = match call.kind {
        Kind::ReduceScatter(ReduceOp::Avg) => Some(1.0 / call.world as f64),
        _ => None,
    };
    grads
        .into_iter()
        .map(|g| match scale {
            Some(s) => g.try_mul(s).map(Some),
            None => Ok(Some(g)),
        })
        .chain(deps)
        .collect()
}

/// A group of `world` ranks in this process, one thread each, that meet
/// in memory: the CPU's communicator (and the reference semantics of the
/// collective ops, which tests of the NCCL ones compare with).
pub struct ThreadGroup {
    world: usize,
    state: Mutex<Meetings>,
    met: Condvar,
    /// How long a rank waits for the others before giving up.
    timeout: Duration,
}

#[derive(Default)]
struct Meetings {
    /// Per (rank, tag), the calls that rank has made.
    calls: HashMap<(usize, u64), u64>,
    /// Per (tag, call number), the meeting in progress.
    open: HashMap<(u64, u64), Meeting>,
    /// Why the group stopped (a rank failed): every call fails from then.
    aborted: Option<String>,
}

/// One call's meeting: what each rank brought.
struct Meeting {
    /// The call (rank 0's view) and input types every rank must bring.
    shape: (Kind, Vec<TensorType>),
    inputs: Vec<Option<Vec<Vec<f64>>>>,
    /// Every rank's inputs, once all came.
    all: Option<Arc<Vec<Vec<Vec<f64>>>>>,
    error: Option<String>,
    /// Ranks that took their outputs (the meeting closes at `world`).
    left: usize,
}

impl ThreadGroup {
    /// A group of `world` ranks (at least 1).
    pub fn new(world: usize) -> Result<ThreadGroup> {
        if world == 0 {
            return Err(op_err!(Argument, "ThreadGroup", "needs at least one rank"));
        }
        let secs = std::env::var("TESSERA_DIST_TIMEOUT_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(300);
        Ok(ThreadGroup {
            world,
            state: Mutex::new(Meetings::default()),
            met: Condvar::new(),
            timeout: Duration::from_secs(secs),
        })
    }

    /// Brings rank `call.rank`'s inputs to its meeting and waits until
    /// every rank's are there.
    fn meet(&self, call: &Call, inputs: &[&Tensor]) -> Result<Arc<Vec<Vec<Vec<f64>>>>> {
        let name = call.kind.name();
        let values: Vec<Vec<f64>> = inputs.iter().map(|t| t.to_f64_vec()).collect();
        let shape = (call.kind, inputs.iter().map(|t| t.ty()).collect::<Vec<_>>());
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &state.aborted {
            return Err(op_err!(Argument, name, "the group stopped: {why}"));
        }
        let number = state.calls.entry((call.rank, call.tag)).or_insert(0);
        let key = (call.tag, *number);
        *number += 1;
        let world = self.world;
        let meeting = state.open.entry(key).or_insert_with(|| Meeting {
            shape: shape.clone(),
            inputs: vec![None; world],
            all: None,
            error: None,
            left: 0,
        });
        if meeting.shape != shape {
            meeting.error = Some(format!(
                "rank {} called {name} on {:?}, another rank {} on {:?} (call {} of tag {})",
                call.rank,
                shape.1,
                meeting.shape.0.name(),
                meeting.shape.1,
                key.1,
                key.0
            ));
        }
        meeting.inputs[call.rank] = Some(values);
        if meeting.inputs.iter().all(Option::is_some) {
            let all = meeting
                .inputs
                .iter_mut()
                .map(|v| v.take().expect("all came"));
            meeting.all = Some(Arc::new(all.collect()));
            self.met.notify_all();
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let aborted = state.aborted.clone();
            let meeting = state.open.get_mut(&key).expect("open until all left");
            if let (None, None, Some(why)) = (&meeting.all, &meeting.error, aborted) {
                meeting.error = Some(format!("the group stopped: {why}"));
            }
            if meeting.all.is_some() || meeting.error.is_some() {
                meeting.left += 1;
                let (all, error) = (meeting.all.clone(), meeting.error.clone());
                if meeting.left == world {
                    state.open.remove(&key);
                }
                return match (error, all) {
                    (Some(e), _) => Err(op_err!(Argument, name, "{e}")),
                    (None, all) => Ok(all.expect("checked")),
                };
            }
            if Instant::now() > deadline {
                let missing: Vec<usize> = (0..world)
                    .filter(|&r| meeting.inputs[r].is_none())
                    .collect();
                meeting.error = Some(format!(
                    "rank {} waited {:?} for ranks {missing:?} (call {} of tag {})",
                    call.rank, self.timeout, key.1, key.0
                ));
                self.met.notify_all();
                continue;
            }
            state = self.wait(state);
        }
    }

    /// Stops the group: every call waiting or to come fails with `why`
    /// (a rank failed, so the others would wait for it forever).
    pub fn abort(&self, why: &str) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.aborted.get_or_insert_with(|| why.to_string());
        self.met.notify_all();
    }

    /// Waits a little for another rank; on a rayon worker, runs the
    /// pool's other jobs meanwhile (the rank that this one waits for may
    /// need them).
    fn wait<'a>(
        &'a self,
        state: std::sync::MutexGuard<'a, Meetings>,
    ) -> std::sync::MutexGuard<'a, Meetings> {
        if rayon::current_thread_index().is_some() {
            drop(state);
            if rayon::yield_now() != Some(rayon::Yield::Executed) {
                std::thread::sleep(Duration::from_micros(50));
            }
            return self.state.lock().unwrap_or_else(|e| e.into_inner());
        }
        let wait = self.met.wait_timeout(state, Duration::from_millis(5));
        wait.unwrap_or_else(|e| e.into_inner()).0
    }
}

impl Communicator for ThreadGroup {
    fn world(&self) -> usize {
        self.world
    }

    fn run(&self, call: &Call, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        if let Some(t) = inputs.iter().find(|t| t.device() != Device::Cpu) {
            return Err(op_err!(
                Argument,
                call.kind.name(),
                "a thread group runs on the CPU, got {} on {}",
                t.ty(),
                t.device()
            ));
        }
        let all = self.meet(call, inputs)?;
        let types = call.output_types(&inputs.iter().map(|t| t.ty()).collect::<Vec<_>>())?;
        (0..inputs.len())
            .map(|j| {
                let values = outputs_of(call, &all, j);
                let shape = types[j].shape.as_concrete().expect("concrete inputs");
                from_f64(&values, types[j].dtype, &shape)
            })
            .collect()
    }
}

/// Rank `call.rank`'s output `j` from every rank's inputs `all`.
fn outputs_of(call: &Call, all: &[Vec<Vec<f64>>], j: usize) -> Vec<f64> {
    let reduced = |op: ReduceOp| {
        let mut sum = all[0][j].clone();
        for rank in &all[1..] {
            sum.iter_mut().zip(&rank[j]).for_each(|(s, v)| *s += v);
        }
        if op == ReduceOp::Avg {
            sum.iter_mut().for_each(|s| *s /= call.world as f64);
        }
        sum
    };
    match call.kind {
        Kind::AllReduce(op) => reduced(op),
        Kind::ReduceScatter(op) => {
            let sum = reduced(op);
            let block = sum.len() / call.world;
            sum[call.rank * block..(call.rank + 1) * block].to_vec()
        }
        Kind::AllGather => all
            .iter()
            .flat_map(|rank| rank[j].iter().copied())
            .collect(),
        Kind::Broadcast { root } => all[root][j].clone(),
        Kind::Reduce { op, root } => match call.rank == root {
            true => reduced(op),
            false => all[call.rank][j].clone(),
        },
    }
}

/// A CPU tensor of `dtype` and `shape` holding `values`.
fn from_f64(values: &[f64], dtype: DType, shape: &[usize]) -> Result<Tensor> {
    crate::with_dtype!(dtype, T => {
        let data: Vec<T> = values.iter().map(|&v| <T as Element>::from_f64(v)).collect();
        Tensor::try_from_vec(data, shape)
    })
}
