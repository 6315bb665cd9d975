//! `--gpus N`: data parallel over N GPUs, one process per GPU, as
//! `torchrun` starts them. The launcher (the process the user started)
//! makes the NCCL id and starts N copies of itself, rank r's with
//! `CUDA_VISIBLE_DEVICES=r` and the id, rank and size in its environment
//! (`tessera_cuda::nccl::ENV_*`), waits for them all and fails if any
//! failed. Each copy joins the group ([`group`]) and runs the command as
//! one rank; only rank 0 prints the result on stdout.

use anyhow::{anyhow, bail, Result};
use tessera::dist::ProcessGroup;
use tessera_cuda::nccl::{self, NcclGroup};

/// What this process is in a `--gpus` run.
pub enum Role {
    /// Not one (`--gpus 1`): run the command here.
    Alone,
    /// The launcher: the ranks ran and finished.
    Launched,
    /// Rank `group.rank()` of the run.
    Rank(ProcessGroup),
}

/// Starts the ranks of a run over `gpus` GPUs (device `cuda` only), or
/// joins the group when this process is one of them.
pub fn role(gpus: usize, device: &str) -> Result<Role> {
    if std::env::var_os(nccl::ENV_RANK).is_some() {
        crate::device::open(device)?;
        let group = NcclGroup::from_env()
            .map_err(|e| anyhow!("--gpus: joining the group: {}", e.message))?
            .ok_or_else(|| anyhow!("--gpus: the launcher's environment is incomplete"))?;
        return Ok(Role::Rank(group));
    }
    match gpus {
        0 => bail!("--gpus must be at least 1"),
        1 => Ok(Role::Alone),
        _ if device != "cuda" => {
            bail!("--gpus {gpus} runs one process per GPU: needs --device cuda")
        }
        _ => launch(gpus).map(|()| Role::Launched),
    }
}

/// Runs `gpus` copies of this command, one per GPU, and waits for them.
fn launch(gpus: usize) -> Result<()> {
    let id = nccl::unique_id().map_err(|e| anyhow!("--gpus: {}", e.message))?;
    let exe = std::env::current_exe()?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    // Each rank an equal share of the cores for its rayon pool, as
    // torchrun sets OMP_NUM_THREADS: N processes with a pool of every core
    // each, whose idle workers poll for work, crowd each other's host
    // loops. (Not measured yet: G23 ran without it.)
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads =
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| (cores / gpus).max(1).to_string());
    let mut children = Vec::with_capacity(gpus);
    for rank in 0..gpus {
        let child = nccl::rank_command(&exe, rank, gpus, &id)
            .args(&args)
            .env("RAYON_NUM_THREADS", &threads)
            .spawn()
            .map_err(|e| anyhow!("--gpus: starting rank {rank}: {e}"))?;
        children.push(child);
    }
    // A rank that fails leaves the others waiting in NCCL for it: stop
    // them all at the first failure.
    loop {
        let mut running = false;
        for (rank, child) in children.iter_mut().enumerate() {
            match child.try_wait()? {
                Some(status) if !status.success() => {
                    for other in children.iter_mut() {
                        let _ = other.kill();
                        let _ = other.wait();
                    }
                    bail!("--gpus {gpus}: rank {rank} failed ({status})");
                }
                Some(_) => {}
                None => running = true,
            }
        }
        if !running {
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
