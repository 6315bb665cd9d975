//! The collective ops over NCCL on two GPUs, one process per GPU as
//! `--gpus` runs them: each test starts two copies of this test binary
//! (rank r with `CUDA_VISIBLE_DEVICES=r` and the NCCL id in its
//! environment), which run the same test as one rank each and check their
//! results; the test passes when both do. Checked: every collective
//! against its definition (the values are small integers, exact in every
//! dtype), and a data-parallel compiled training step on 2 GPUs with half
//! batches against 1 GPU with the whole batch, with and without ZeRO-1.
//! Runs only with `TESSERA_CUDA_TESTS=1` on a machine with 2 or more GPUs
//! (needs libnccl.so.2 on LD_LIBRARY_PATH); `NCCL_NVLS_ENABLE=0` is set for
//! the ranks (NVLink multicast stays off).

#![cfg(feature = "nccl")]

use tessera::compile::{train_step, DataParallel};
use tessera::dist::{bucket_owners, ProcessGroup, ReduceOp};
use tessera::nn::{cross_entropy, ParamStore, TransformerConfig, TransformerLM};
use tessera::optim::{AdamW, AdamWConfig, TraceableOptimizer};
use tessera::runtime::device::Device;
use tessera::tensor::Generator;
use tessera::{DType, Tensor};
use tessera_cuda::nccl::{self, NcclGroup};

const WORLD: usize = 2;

/// In a rank's process: its group. In the test's own: `None` after
/// running the test `name` on `WORLD` ranks (or skipping it).
fn ranks(name: &str) -> Option<ProcessGroup> {
    if std::env::var_os(nccl::ENV_RANK).is_some() {
        tessera_cuda::register().expect("a rank's GPU");
        return Some(NcclGroup::from_env().expect("joining").expect("a rank"));
    }
    if std::env::var("TESSERA_CUDA_TESTS").as_deref() != Ok("1") {
        eprintln!("TESSERA_CUDA_TESTS is not 1: the NCCL tests do not run here");
        return None;
    }
    let gpus = nccl::device_count().expect("the CUDA driver");
    if gpus < WORLD {
        eprintln!("{gpus} GPU(s): the NCCL tests need {WORLD}");
        return None;
    }
    let id = nccl::unique_id().expect("libnccl.so.2 on LD_LIBRARY_PATH");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..WORLD)
        .map(|rank| {
            nccl::rank_command(&exe, rank, WORLD, &id)
                .args([name, "--exact", "--nocapture", "--test-threads=1"])
                .spawn()
                .unwrap()
        })
        .collect();
    for (rank, mut child) in children.into_iter().enumerate() {
        assert!(child.wait().unwrap().success(), "rank {rank} failed");
    }
    None
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to(Device::Cpu).unwrap().to_f64_vec()
}

#[test]
fn nccl_collectives_compute_their_definitions() {
    let Some(g) = ranks("nccl_collectives_compute_their_definitions") else {
        return;
    };
    let r = g.rank();
    for dtype in [DType::F32, DType::BF16, DType::F64, DType::I32] {
        let v: Vec<f32> = (0..6).map(|i| (r * 10 + i) as f32).collect();
        let x = Tensor::from_vec(v, &[6])
            .cast(dtype)
            .to(Device::Cuda)
            .unwrap();
        let sum = g.all_reduce(&[&x, &x], ReduceOp::Sum).unwrap();
        let want: Vec<f64> = (0..6).map(|i| (10 + 2 * i) as f64).collect();
        assert_eq!(host(&sum[0]), want, "{dtype} all_reduce");
        assert_eq!(host(&sum[1]), want, "{dtype} all_reduce, second tensor");
        if dtype.is_float() {
            let avg = g.all_reduce(&[&x], ReduceOp::Avg).unwrap();
            let half: Vec<f64> = want.iter().map(|v| v / 2.0).collect();
            assert_eq!(host(&avg[0]), half, "{dtype} avg");
        }
        let scattered = g.reduce_scatter(&[&x], ReduceOp::Sum).unwrap();
        assert_eq!(
            host(&scattered[0]),
            want[3 * r..3 * r + 3].to_vec(),
            "{dtype}"
        );
        let gathered = g.all_gather(&[&x]).unwrap();
        let all: Vec<f64> = (0..2)
            .flat_map(|q| (0..6).map(move |i| (q * 10 + i) as f64))
            .collect();
        assert_eq!(host(&gathered[0]), all, "{dtype} all_gather");
        let root = g.broadcast(&[&x], 1).unwrap();
        let ones: Vec<f64> = (0..6).map(|i| (10 + i) as f64).collect();
        assert_eq!(host(&root[0]), ones, "{dtype} broadcast");
    }
}

fn config() -> TransformerConfig {
    TransformerConfig {
        vocab: 64,
        d_model: 64,
        n_heads: 2,
        n_layers: 2,
        d_ff: 256,
        max_len: 32,
        dropout: 0.0,
    }
}

/// The global batch of step `i`: 8 sequences.
fn global_batch(i: usize) -> (Tensor, Tensor) {
    let c = config();
    let ids = (Tensor::rand(
        &[8, c.max_len + 1],
        DType::F32,
        &mut Generator::new(50 + i as u64),
    ) * c.vocab as f64)
        .cast(DType::I64);
    (
        ids.narrow(1, 0, c.max_len).contiguous(),
        ids.narrow(1, 1, c.max_len).contiguous(),
    )
}

/// Small buckets: the test model's gradients make several.
const BUCKET_BYTES: usize = 64 << 10;

/// Losses, final parameters (host) and state sizes of 4 steps, on this
/// rank's share of each global batch (all of it without a group).
fn train(group: Option<ProcessGroup>, zero: bool) -> (Vec<f64>, Vec<Vec<f64>>, Vec<usize>) {
    let (rank, world) = group.as_ref().map_or((0, 1), |g| (g.rank(), g.world()));
    let c = config();
    let mut store = ParamStore::new();
    let lm = TransformerLM::new(&mut store, "", c.clone(), &mut Generator::new(rank as u64));
    for p in store.iter() {
        p.set(&p.get().to(Device::Cuda).unwrap());
    }
    let opt = AdamW::new(store.parameters(), AdamWConfig::default());
    let vocab = c.vocab as isize;
    let loss = |b: &[Tensor]| {
        let logits = lm.forward(&b[0], true).reshape(&[-1, vocab]);
        cross_entropy(&logits, &b[1].reshape(&[-1]), None)
    };
    let mut step = train_step(loss, opt);
    if let Some(g) = group {
        step = step.data_parallel(DataParallel::new(g).zero(zero).bucket_bytes(BUCKET_BYTES));
    }
    let share = 8 / world;
    let mut losses = Vec::new();
    for i in 0..4 {
        let (x, y) = global_batch(i);
        let part = |t: &Tensor| {
            t.narrow(0, rank * share, share)
                .contiguous()
                .to(Device::Cuda)
                .unwrap()
        };
        losses.push(step.step(&[part(&x), part(&y)]).item());
    }
    let params = store.parameters().iter().map(|p| host(&p.get())).collect();
    let opt = step.optimizer();
    let states = (0..opt.params().len())
        .map(|i| opt.state(i)[0].numel())
        .collect();
    (losses, params, states)
}

/// f32 on the GPU: the half batches' kernels sum in other orders than the
/// whole batch's (cuBLASLt, the reductions), so values agree to f32
/// rounding through 4 AdamW steps, not bit for bit.
const TOL: f64 = 2e-4;

fn two_gpus_train_as_one(name: &str, zero: bool) {
    let Some(g) = ranks(name) else {
        return;
    };
    let rank = g.rank();
    let (losses, params, _) = train(None, false);
    let (dp_losses, dp_params, states) = train(Some(g), zero);
    for (a, b) in dp_losses.iter().zip(&losses) {
        assert!(
            (a - b).abs() <= TOL * b.abs().max(1.0),
            "rank {rank}: loss {a} vs {b}"
        );
    }
    let sizes: Vec<usize> = params.iter().map(Vec::len).collect();
    // f32 parameters: the owners' plan counts bytes, by bucket.
    let bytes: Vec<usize> = sizes.iter().map(|n| n * 4).collect();
    let owner = bucket_owners(&bytes, BUCKET_BYTES, WORLD);
    for (j, (a, b)) in dp_params.iter().zip(&params).enumerate() {
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f64::max);
        assert!(worst <= TOL, "rank {rank}: parameter {j} off by {worst}");
        let want = if zero && owner[j] != rank {
            0
        } else {
            sizes[j]
        };
        assert_eq!(states[j], want, "rank {rank}: parameter {j}'s AdamW state");
    }
}

#[test]
fn two_gpus_with_half_batches_train_as_one_with_the_whole() {
    two_gpus_train_as_one(
        "two_gpus_with_half_batches_train_as_one_with_the_whole",
        false,
    );
}

#[test]
fn two_gpus_with_a_sharded_optimizer_train_as_one() {
    two_gpus_train_as_one("two_gpus_with_a_sharded_optimizer_train_as_one", true);
}
