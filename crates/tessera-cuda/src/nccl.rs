//! The collective ops on the GPU: NCCL communicators, one process per GPU
//! (each sees its own GPU as device 0, `CUDA_VISIBLE_DEVICES=rank`), the
//! NCCL id made by a launcher and handed to every rank as NCCL's own
//! examples share it (there over MPI; here in the environment of the
//! processes it starts: [`ENV_ID`], [`ENV_RANK`], [`ENV_WORLD`]).
//!
//! [`NcclGroup`] is a `tessera::dist::Communicator`: a call's tensors go
//! to NCCL in one `ncclGroupStart`/`ncclGroupEnd`, on the stream of the
//! backend's current lane, so a collective placed on a stream by the
//! schedule (`{"stream": N}`) runs there, ordered by the executor's events
//! like any kernel. `register` (run by `tessera_cuda::register`) fills
//! the collective ops' CUDA slots with `dist::dispatch`, which finds the
//! call's group.

use std::sync::Arc;

use cudarc::nccl::{result, sys};
use tessera::custom_op::{self, Backend};
use tessera::dist::{self, Call, Communicator, Kind, ProcessGroup, ReduceOp};
use tessera::error::{Error, ErrorKind, Result};
use tessera::ir::custom::collective::NAMES;
use tessera::runtime::array::Array;
use tessera::{DType, Tensor};

use crate::CudaBackend;

/// The environment variable holding the NCCL id (hex) of a launched run.
pub const ENV_ID: &str = "TESSERA_NCCL_ID";
/// This process's rank in a launched run.
pub const ENV_RANK: &str = "TESSERA_DIST_RANK";
/// The number of processes of a launched run.
pub const ENV_WORLD: &str = "TESSERA_DIST_WORLD";

fn nccl_err(op: &str, e: impl std::fmt::Debug) -> Error {
    Error::op(ErrorKind::Device, op, format!("NCCL: {e:?}"))
}

/// An error unless libnccl can be loaded (cudarc would panic).
fn check_present() -> Result<()> {
    // SAFETY: only looks for the library.
    match unsafe { sys::is_culib_present() } {
        true => Ok(()),
        false => Err(Error::new(
            ErrorKind::Device,
            "NCCL was not found: put a folder with `libnccl.so` on LD_LIBRARY_PATH \
             (a link to libnccl.so.2, e.g. PyTorch's site-packages/nvidia/nccl/lib/libnccl.so.2)",
        )),
    }
}

/// A new NCCL id, as hex (what the launcher hands to every rank).
pub fn unique_id() -> Result<String> {
    check_present()?;
    let id = result::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    Ok(id
        .internal
        .iter()
        .map(|&b| format!("{:02x}", b as u8))
        .collect())
}

fn parse_id(hex: &str) -> Result<sys::ncclUniqueId> {
    let bad = || {
        Error::new(
            ErrorKind::Argument,
            format!(
                "{ENV_ID}: expected 256 hex digits, got {} characters",
                hex.len()
            ),
        )
    };
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    if hex.len() != 256 {
        return Err(bad());
    }
    for (i, byte) in id.internal.iter_mut().enumerate() {
        let b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        *byte = b as _;
    }
    Ok(id)
}

/// The command that starts rank `rank` of `world` as `program`: its GPU
/// alone visible (`CUDA_VISIBLE_DEVICES=rank`), the NCCL id, rank and size
/// in its environment ([`NcclGroup::from_env`] joins them), and NVLink
/// multicast off (`NCCL_NVLS_ENABLE=0`: on shared hosts it can take the
/// GPUs out of service). The caller adds the arguments.
pub fn rank_command(
    program: &std::path::Path,
    rank: usize,
    world: usize,
    id_hex: &str,
) -> std::process::Command {
    let mut cmd = std::process::Command::new(program);
    cmd.env("CUDA_VISIBLE_DEVICES", rank.to_string())
        .env("NCCL_NVLS_ENABLE", "0")
        .env(ENV_ID, id_hex)
        .env(ENV_RANK, rank.to_string())
        .env(ENV_WORLD, world.to_string());
    cmd
}

/// This process's communicator of a group of `world`, as rank `rank`,
/// on the CUDA backend's GPU (opened and registered as `Device::Cuda`).
pub struct NcclGroup {
    comm: Comm,
    rank: usize,
    world: usize,
    backend: Arc<CudaBackend>,
}

/// The raw communicator; NCCL's calls on it come from one thread at a time
/// (the executor's loop), as NCCL asks.
struct Comm(sys::ncclComm_t);
// SAFETY: a communicator is a handle NCCL lets any thread use, one at a time.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl NcclGroup {
    /// Joins the group of `world` ranks of NCCL id `id_hex` as `rank`
    /// (blocks until every rank joined) and returns this rank's handle.
    pub fn join(rank: usize, world: usize, id_hex: &str) -> Result<ProcessGroup> {
        check_present()?;
        let id = parse_id(id_hex)?;
        crate::register()?;
        let backend = crate::backend()?;
        backend.gpu.bind();
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is written by NCCL; the id came from
        // ncclGetUniqueId in the launcher.
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        let group = NcclGroup {
            comm: Comm(comm),
            rank,
            world,
            backend,
        };
        ProcessGroup::new(Arc::new(group), rank)
    }

    /// The group a launcher described in this process's environment
    /// (`None` when it is not set: a run of one process).
    pub fn from_env() -> Result<Option<ProcessGroup>> {
        let (Ok(id), Ok(rank), Ok(world)) = (
            std::env::var(ENV_ID),
            std::env::var(ENV_RANK),
            std::env::var(ENV_WORLD),
        ) else {
            return Ok(None);
        };
        let int = |name: &str, v: &str| {
            v.parse::<usize>().map_err(|_| {
                Error::new(ErrorKind::Argument, format!("{name}: not a number: {v:?}"))
            })
        };
        let (rank, world) = (int(ENV_RANK, &rank)?, int(ENV_WORLD, &world)?);
        NcclGroup::join(rank, world, &id).map(Some)
    }

    /// One tensor's NCCL call, queued on the current lane's stream.
    fn queue(&self, call: &Call, input: &Tensor, output: &Tensor) -> Result<()> {
        let name = call.kind.name();
        let dtype = nccl_dtype(name, input.dtype())?;
        let (send, recv) = (address(input), address(output));
        let stream = self.backend.gpu.stream() as sys::cudaStream_t;
        let comm = self.comm.0;
        let count = input.numel();
        let op = |op: ReduceOp| match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        };
        // SAFETY: both buffers are live device memory of `count` (the
        // output: of its type's) elements of `dtype` on this GPU, the
        // tensors held by the caller until the stream has run the call.
        let r = unsafe {
            match call.kind {
                Kind::AllReduce(o) => {
                    result::all_reduce(send, recv, count, dtype, op(o), comm, stream)
                }
                Kind::ReduceScatter(o) => {
                    result::reduce_scatter(send, recv, output.numel(), dtype, op(o), comm, stream)
                }
                Kind::AllGather => result::all_gather(send, recv, count, dtype, comm, stream),
                Kind::Broadcast { root } => {
                    result::broadcast(send, recv, count, dtype, root as i32, comm, stream)
                }
                Kind::Reduce { op: o, root } => {
                    // NCCL writes the root's output only; elsewhere the
                    // output is the rank's own input (the op's definition).
                    if call.rank != root {
                        let bytes = count.saturating_mul(input.dtype().size_bytes());
                        self.backend
                            .gpu
                            .copy(recv as u64, send as u64, bytes)
                            .map_err(|e| Error::op(ErrorKind::Device, name, e))?;
                    }
                    result::reduce(send, recv, count, dtype, op(o), root as i32, comm, stream)
                }
            }
        };
        r.map(|_| ()).map_err(|e| nccl_err(name, e))
    }
}

impl Communicator for NcclGroup {
    fn world(&self) -> usize {
        self.world
    }

    fn run(&self, call: &Call, inputs: &[&Tensor]) -> Result<Vec<Tensor>> {
        let name = call.kind.name();
        if call.rank != self.rank {
            return Err(Error::op(
                ErrorKind::Argument,
                name,
                format!(
                    "the call is rank {}'s, this process is rank {}",
                    call.rank, self.rank
                ),
            ));
        }
        let types = call.output_types(&inputs.iter().map(|t| t.ty()).collect::<Vec<_>>())?;
        let dense: Vec<Tensor> = inputs.iter().map(|t| dense(t)).collect::<Result<_>>()?;
        let mut outputs = Vec::with_capacity(types.len());
        for ty in &types {
            let shape = ty.shape.as_concrete().expect("concrete inputs");
            let storage = self.backend.empty(ty.dtype, shape.iter().product())?;
            outputs.push(Tensor::from_device_storage(storage, &shape));
        }
        self.backend.gpu.bind();
        // Only the profile reads the arrays (their shapes): no list per
        // collective when it is off.
        let arrays: Vec<&Array> = match crate::profile::enabled() {
            true => dense.iter().filter_map(Tensor::try_array).collect(),
            false => Vec::new(),
        };
        crate::profile::timed(
            &self.backend,
            || name.to_string(),
            &arrays,
            || {
                crate::profile::in_driver(crate::profile::Queued::Collective, || {
                    result::group_start().map_err(|e| nccl_err(name, e))?;
                    let queued = dense
                        .iter()
                        .zip(&outputs)
                        .try_for_each(|(i, o)| self.queue(call, i, o));
                    let ended = result::group_end().map_err(|e| nccl_err(name, e));
                    queued.and(ended)
                })
            },
        )?;
        Ok(outputs)
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        // SAFETY: the communicator is this group's alone.
        unsafe {
            let _ = result::comm_destroy(self.comm.0);
        }
    }
}

/// `t` on the GPU in one dense run of memory (what NCCL reads).
fn dense(t: &Tensor) -> Result<Tensor> {
    if t.device() != tessera::runtime::device::Device::Cuda {
        return Err(Error::op(
            ErrorKind::Argument,
            "nccl",
            format!("{} is on {}: NCCL reduces GPU tensors", t.ty(), t.device()),
        ));
    }
    match t.is_contiguous() {
        true => Ok(t.clone()),
        false => t.try_contiguous(),
    }
}

fn address(t: &Tensor) -> *mut std::ffi::c_void {
    crate::ops::first(t.array()) as *mut std::ffi::c_void
}

fn nccl_dtype(op: &str, dtype: DType) -> Result<sys::ncclDataType_t> {
    use sys::ncclDataType_t as N;
    Ok(match dtype {
        DType::F32 => N::ncclFloat32,
        DType::F64 => N::ncclFloat64,
        DType::F16 => N::ncclFloat16,
        DType::BF16 => N::ncclBfloat16,
        DType::I32 => N::ncclInt32,
        DType::I64 => N::ncclInt64,
        DType::I8 => N::ncclInt8,
        DType::U8 => N::ncclUint8,
        DType::U32 => N::ncclUint32,
        DType::U64 => N::ncclUint64,
        DType::Bool | DType::I16 | DType::U16 => {
            return Err(Error::op(
                ErrorKind::DType,
                op,
                format!("NCCL has no {dtype}: cast to i32 first"),
            ))
        }
    })
}

/// Fills the CUDA slots of the collective ops.
pub(crate) fn register() -> Result<()> {
    for name in NAMES {
        custom_op::lookup(name)?.set_kernel(Backend::Cuda, move |a, i| dist::dispatch(name, a, i));
    }
    Ok(())
}

/// GPUs the CUDA driver sees (all of them: before `CUDA_VISIBLE_DEVICES`
/// of a rank narrows it).
pub fn device_count() -> Result<usize> {
    use cudarc::driver::result as cu;
    // SAFETY: only looks for the library (cudarc panics without it).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Error::new(ErrorKind::Device, "no CUDA driver (libcuda.so)"));
    }
    cu::init().map_err(|e| nccl_err("cuInit", e))?;
    cu::device::get_count()
        .map(|n| n as usize)
        .map_err(|e| nccl_err("cuDeviceGetCount", e))
}
