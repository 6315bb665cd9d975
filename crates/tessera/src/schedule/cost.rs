//! Estimated times: what a kernel or a recomputation costs on a device and
//! what a copy between device and host memory costs, from a few constants
//! per device. The memory planner uses them to decide how far ahead of its
//! use a prefetch starts and how long an offload overlaps compute
//! ([`overlap_steps`]); the compiler uses them to choose, for each saved
//! activation of a graph over its memory budget, between offloading it and
//! recomputing it ([`Choice`], [`choose`]).
//!
//! The constants are estimates, not measurements of this machine; where
//! each comes from:
//!
//! - CUDA host bandwidth, 25 GB/s per direction: pinned `cudaMemcpyAsync`
//!   over PCIe. PCIe 4.0 x16 carries 32 GB/s per direction and PCIe 5.0
//!   x16 (H100/H200 SXM hosts) 64 GB/s; NVIDIA's `bandwidthTest` reports
//!   about 80 % of the link for pinned memory (≈ 25 GB/s on Gen4, ≈ 50
//!   GB/s on Gen5). We take the Gen4 figure: an offload chosen on it is
//!   never slower on a Gen5 host, and a host whose GPU shares its link
//!   gets less. `tessera bench gpt --offload` prints what a run moved and
//!   how long it took, to check it.
//! - CUDA FLOP/s: an H100 SXM's dense peak is 67 TFLOP/s in f32 (no
//!   tensor cores) and 989 TFLOP/s in bf16/f16; cuBLASLt reaches about 70 %
//!   and 60 % of them on large gemms: 45e12 and 600e12.
//! - CUDA memory bandwidth, 2.5e12 B/s: 3.35 TB/s of HBM3 on an H100 SXM
//!   (4.8 TB/s on an H200), about 75 % reached by elementwise kernels.
//! - CUDA launch: 4 µs per kernel, what a small kernel costs end to end
//!   when queued back to back.
//! - CPU: 198 GFLOP/s (the `gemm` crate in f32 on the 2-core dev machine,
//!   `docs/../shared/DESIGN.md`), 10 GB/s for memory and for a copy into
//!   the host pool (one core's `memcpy`), no launch cost.

use crate::fusion::{Kernel, Plan};
use crate::ir::{DType, Graph, NodeId, Op, TensorType};
use crate::runtime::device::Device;

/// What a device's time estimates are made of (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceCosts {
    /// FLOP/s of f32 (and f64) matmuls.
    pub flops_f32: f64,
    /// FLOP/s of bf16/f16 matmuls.
    pub flops_half: f64,
    /// Bytes/s that memory-bound kernels read and write.
    pub memory_bandwidth: f64,
    /// Bytes/s of a copy between device and host memory, each direction.
    pub host_bandwidth: f64,
    /// Seconds every kernel costs besides its work.
    pub launch_seconds: f64,
}

impl DeviceCosts {
    /// The estimates for `device`.
    pub fn of(device: Device) -> DeviceCosts {
        match device {
            Device::Cuda => DeviceCosts {
                flops_f32: 45e12,
                flops_half: 600e12,
                memory_bandwidth: 2.5e12,
                host_bandwidth: 25e9,
                launch_seconds: 4e-6,
            },
            Device::Cpu => DeviceCosts {
                flops_f32: 198e9,
                flops_half: 198e9,
                memory_bandwidth: 10e9,
                host_bandwidth: 10e9,
                launch_seconds: 0.0,
            },
        }
    }

    /// Seconds to move `bytes` one way between device and host memory.
    pub fn transfer_seconds(&self, bytes: usize) -> f64 {
        bytes as f64 / self.host_bandwidth
    }

    /// Seconds for `flops` of matmul in `dtype` and `bytes` of memory
    /// traffic: the slower of the two (a kernel is bound by one), plus
    /// the launch.
    pub fn compute_seconds(&self, flops: f64, dtype: DType, bytes: usize) -> f64 {
        let rate = match dtype {
            DType::BF16 | DType::F16 => self.flops_half,
            _ => self.flops_f32,
        };
        (flops / rate).max(bytes as f64 / self.memory_bandwidth) + self.launch_seconds
    }
}

fn bytes_of(ty: &TensorType) -> usize {
    ty.shape
        .as_concrete()
        .map_or(0, |s| s.iter().product::<usize>())
        * ty.dtype.size_bytes()
}

/// Matmul FLOPs of node `id` (2·m·n·k per product, batches included); 0
/// for every other op.
pub fn node_flops(graph: &Graph, id: NodeId) -> f64 {
    let node = graph.node(id);
    if !matches!(node.op, Op::MatMul | Op::MatMulT { .. }) {
        return 0.0;
    }
    let Some(out) = node.ty.shape.as_concrete() else {
        return 0.0;
    };
    // The contracted size: the first operand's dim that is not m.
    let a = &graph.node(node.inputs[0]).ty;
    let k = match (&node.op, a.shape.as_concrete()) {
        (Op::MatMulT { transpose_a, .. }, Some(s)) if s.len() >= 2 => {
            if *transpose_a {
                s[s.len() - 2]
            } else {
                s[s.len() - 1]
            }
        }
        (_, Some(s)) if !s.is_empty() => s[s.len() - 1],
        _ => 1,
    };
    2.0 * out.iter().product::<usize>() as f64 * k as f64
}

/// Seconds node `id` takes alone on a device with `costs`: its FLOPs, or
/// its inputs and output through memory, plus a launch.
pub fn node_seconds(graph: &Graph, id: NodeId, costs: &DeviceCosts) -> f64 {
    let node = graph.node(id);
    if matches!(node.op, Op::Input | Op::Constant(_)) {
        return 0.0;
    }
    let bytes: usize = node
        .inputs
        .iter()
        .map(|&i| bytes_of(&graph.node(i).ty))
        .sum::<usize>()
        + bytes_of(&node.ty);
    costs.compute_seconds(node_flops(graph, id), node.ty.dtype, bytes)
}

/// Seconds kernel `k` of `plan` takes: its members' FLOPs, or what it
/// reads and writes through memory (a fused kernel's intermediates never
/// reach it), plus one launch.
pub fn kernel_seconds(graph: &Graph, kernel: &Kernel, costs: &DeviceCosts) -> f64 {
    let flops: f64 = kernel.members().iter().map(|&m| node_flops(graph, m)).sum();
    let bytes: usize = kernel
        .reads(graph)
        .iter()
        .chain(&kernel.writes())
        .map(|&v| bytes_of(&graph.node(v).ty))
        .sum();
    let dtype = kernel
        .writes()
        .first()
        .map_or(DType::F32, |&w| graph.node(w).ty.dtype);
    costs.compute_seconds(flops, dtype, bytes)
}

/// Seconds each step of `steps` takes: its kernels one after another (a
/// lower bound on overlap is not assumed).
pub fn step_seconds(
    graph: &Graph,
    plan: &Plan,
    steps: &[Vec<usize>],
    costs: &DeviceCosts,
) -> Vec<f64> {
    steps
        .iter()
        .map(|step| {
            step.iter()
                .map(|&k| kernel_seconds(graph, &plan.kernels[k], costs))
                .sum()
        })
        .collect()
}

/// The most steps a copy overlaps: a prefetch starts at most this many
/// steps before its use, an offload is waited for at most this many steps
/// after it starts (each step it overlaps holds its device bytes).
pub const MAX_OVERLAP_STEPS: usize = 4;

/// How many steps a copy of `seconds` overlaps when the steps it may
/// overlap take `steps` seconds each, nearest first: the fewest whose time
/// covers the copy, at least 1 (the copy always runs beside one step), at
/// most [`MAX_OVERLAP_STEPS`] and at most `steps.len()`.
pub fn overlap_steps(seconds: f64, steps: impl IntoIterator<Item = f64>) -> usize {
    let mut covered = 0.0;
    let mut n = 0;
    for s in steps.into_iter().take(MAX_OVERLAP_STEPS) {
        n += 1;
        covered += s;
        if covered >= seconds {
            break;
        }
    }
    n
}

/// What becomes of a saved activation that the memory budget cannot keep
/// on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Moved to host memory and back (two copies).
    Offload,
    /// Recomputed in the backward from what is saved.
    Recompute,
}

/// Offload or recompute, whichever is estimated faster: two copies of
/// `bytes` (to the host and back) against `recompute_seconds`. Ties
/// offload (a copy overlaps compute; a recomputation is compute).
pub fn choose(bytes: usize, recompute_seconds: f64, costs: &DeviceCosts) -> Choice {
    match recompute_seconds < 2.0 * costs.transfer_seconds(bytes) {
        true => Choice::Recompute,
        false => Choice::Offload,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::text::parse;

    #[test]
    fn the_choice_flips_where_recompute_time_passes_two_copies() {
        let gpu = DeviceCosts::of(Device::Cuda);
        let mib = 1 << 20;
        // 1 MiB: two copies take 84 µs at 25 GB/s.
        let copies = 2.0 * mib as f64 / 25e9;
        assert_eq!(choose(mib, copies * 0.9, &gpu), Choice::Recompute);
        assert_eq!(choose(mib, copies * 1.1, &gpu), Choice::Offload);
        // A faster link makes offloading win where recomputing won.
        let fast = DeviceCosts {
            host_bandwidth: 100e9,
            ..gpu
        };
        assert_eq!(choose(mib, copies * 0.9, &fast), Choice::Offload);
        // More bytes for the same recomputation: recompute wins.
        assert_eq!(choose(4 * mib, copies * 1.1, &gpu), Choice::Recompute);
    }

    #[test]
    fn a_matmul_costs_its_flops_and_a_pointwise_op_its_bytes() {
        let g = parse(
            "graph g(%a, %b) {
              %a = input : f32[512,256]
              %b = input : f32[256,1024]
              %m = matmul(%a, %b) : f32[512,1024]
              %t = tanh(%m) : f32[512,1024]
              return %t as t
            }",
        )
        .unwrap();
        let m = g.node(g.outputs[0].node).inputs[0];
        assert_eq!(node_flops(&g, m), 2.0 * 512.0 * 1024.0 * 256.0);
        assert_eq!(node_flops(&g, g.outputs[0].node), 0.0);
        let gpu = DeviceCosts::of(Device::Cuda);
        let tanh = node_seconds(&g, g.outputs[0].node, &gpu);
        let bytes = 2.0 * 512.0 * 1024.0 * 4.0;
        assert!((tanh - (bytes / 2.5e12 + 4e-6)).abs() < 1e-12, "{tanh}");
        // The CPU's matmul: 268 MFLOP at 198 GFLOP/s.
        let cpu = DeviceCosts::of(Device::Cpu);
        let t = node_seconds(&g, m, &cpu);
        assert!(
            (t - 2.0 * 512.0 * 1024.0 * 256.0 / 198e9).abs() < 1e-9,
            "{t}"
        );
    }

    #[test]
    fn a_copy_overlaps_the_fewest_steps_that_cover_it() {
        assert_eq!(overlap_steps(1.0, [0.5, 0.4, 0.2, 9.0]), 3);
        assert_eq!(overlap_steps(0.1, [0.5, 0.4]), 1);
        // Capped: never more than the steps there are, nor the maximum.
        assert_eq!(overlap_steps(9.0, [1.0, 1.0]), 2);
        assert_eq!(overlap_steps(9.0, [1.0; 10]), MAX_OVERLAP_STEPS);
        assert_eq!(overlap_steps(1.0, []), 0);
    }
}
