// Flash attention forward and backward for tessera, compiled at run time by NVRTC.
//
// Semantics: PyTorch's F.scaled_dot_product_attention(q, k, v, is_causal, scale) on
// contiguous [B, H, N, D] tensors. q has nq rows per (batch, head), k and v have nk rows;
// nq and nk may differ and need not be multiples of any block size. Causal masking is
// top-left aligned like PyTorch's (query i sees keys 0..=i). The forward also writes the
// f32 logsumexp of each row (natural log), the residual the backward needs.
//
// Kernels (extern "C" entry points at the bottom; the launcher in src/flash.rs picks one
// by dtype, head dim and architecture):
//   flash_fwd_wg_<t>_d128_ring      sm_90a (Hopper): wgmma, 4 warpgroups x 64 query rows,
//                                   key tiles of 64 in a 4-stage shared-memory ring under
//                                   mbarriers (the default); S = Q K^T with both operands
//                                   read from shared memory, O += P V with P from
//                                   registers. _ring_t: the warpgroups also take turns
//                                   issuing S (named barriers).
//   flash_fwd_wg_<t>_d128_g4_c64    the same tiles with two K/V buffers and a block
//                                   barrier per key tile (1.57 vs 1.27 ms, docs/perf/cuda-flash.md).
//                                   max-autotune times the three.
//   flash_fwd_wg_split_<t>_d128     the same with each query block's key tiles split over
//   flash_fwd_combine_<t>_d128      blockIdx.z (for small batch x heads, which would
//                                   leave most SMs idle), then the merge of the partials.
//   flash_bwd_wg_<t>_d128           sm_90a: FlashAttention-2 backward on wgmma; a block
//                                   owns 128 keys (2 warpgroups x 64), keeps dK and dV in
//                                   registers and walks query tiles of 64 rows (a 3-stage
//                                   Q/dO ring under mbarriers, no block barrier per tile),
//                                   recomputing P from the logsumexp. The last
//                                   (batch x head, key block) items of a launch may be
//                                   split over several blocks by query tiles (all of
//                                   them for small batch x heads, the last wave's
//                                   worth otherwise); their dK and dV are summed in an
//                                   f32 workspace by the item's last block.
//   flash_bwd_post_wg_<t>           fragment-tiled f32 workspace -> dQ in T.
//   flash_fwd_<t>_d<D>_w<W>_c<BC>   sm_80+: mma.sync m16n8k16 (f32 accumulation), W warps
//                                   each own 16 query rows, key tiles of BC rows.
//   flash_bwd_<t>_d<D>_w<W>_r<BR>   sm_80+: the same backward on mma.sync, 16*W keys per
//                                   block, query tiles of BR rows.
//   flash_bwd_pre_<t>_d<D>          Delta_i = rowsum(dO * O) in f32, and zeroes the f32
//                                   workspace the backward adds into (bf16/f16 only).
//   flash_bwd_post_<t>              dQ = scale * workspace (row-major), for mma.sync.
//   flash_*_f32_d<D>                f32 on CUDA cores: one warp per row, the other
//                                   operand streamed through shared memory 32 rows at a
//                                   time (each lane owns one of those rows for the dot
//                                   products). D a multiple of 32 up to 256.
// dQ (bf16/f16) is accumulated in an f32 workspace with vector atomics (red.global.add
// .v2/.v4.f32) by every key block rather than by a separate dQ pass, which would
// recompute S and dP (two of the five products) a second time. The wgmma backward adds
// whole 512-byte runs per warp instruction (a fragment-tiled workspace, see bwd_wg):
// 4.04 ms instead of 4.5 ms at (8, 32, 2048, 128) on an H200 (docs/perf/cuda-flash.md, session 2).
//
// Only headers NVRTC ships are used; there is no host code here.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tessera_flash {

typedef unsigned int u32;

#define TF_LOG2E 1.4426950408889634f
#define TF_LN2 0.6931471805599453f
// NVRTC has no <cmath>/<math.h> macros; the bit pattern of +inf.
#define TF_INF __int_as_float(0x7f800000)

// ---------------------------------------------------------------------------------
// Small PTX wrappers
// ---------------------------------------------------------------------------------

__device__ __forceinline__ u32 smem_addr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy global -> shared; zero-fills when !valid (src-size 0), so
// rows past the end of a matrix read as zeros without touching memory.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  int src_size = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_size)
               : "memory");
}
// 4-byte variant for the per-row f32 vectors (lse, Delta); zero-fills when !valid.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  int src_size = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_size)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_one() {
  asm volatile("cp.async.wait_group 1;\n" ::: "memory");
}

// Four 8x8 b16 matrices from shared memory; lane L supplies the address of row L%8 of
// matrix L/8 and receives, for matrix j, the pair (row L/4, cols 2*(L%4), +1) in r[j].
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// The same with each 8x8 matrix transposed on the way.
__device__ __forceinline__ void ldsm_x4_t(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// D(16x8, f32) += A(16x16) * B(16x8).
// Fragments (g = lane/4, t = lane%4): A regs = {(g,2t..), (g+8,2t..), (g,2t+8..),
// (g+8,2t+8..)}; B regs = {(k=2t..,n=g), (k=2t+8..,n=g)}; C = {(g,2t), (g,2t+1),
// (g+8,2t), (g+8,2t+1)}.
template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4], u32 b0,
                                             u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(u32 x) {
    __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&x);
    return __bfloat1622float2(v);
  }
};
template <>
struct Mma<__half> {
  static __device__ __forceinline__ void run(float (&c)[4], const u32 (&a)[4], u32 b0,
                                             u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&v);
  }
  static __device__ __forceinline__ float2 unpack(u32 x) {
    __half2 v = *reinterpret_cast<__half2*>(&x);
    return __half22float2(v);
  }
};

// dQ workspace accumulation: two adjacent f32 in one vector reduction (sm_90).
__device__ __forceinline__ void red_add_v2(float* p, float a, float b) {
#if __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b)
               : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}



// 2^x on the special-function unit (flushes subnormal results to zero, which the
// softmax never needs: they are below 2^-126 of the row maximum).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Start copying rows [row0, row0 + ROWS) of a row-major [n_rows, D] matrix into a shared
// tile with row stride LD elements (D plus 16 bytes of padding, so that the eight rows an
// ldmatrix reads fall in distinct banks). Rows at or past n_rows become zeros.
template <typename T, int ROWS, int D, int LD, int THREADS>
__device__ __forceinline__ void load_tile_async(T* s, const T* g, int row0, int n_rows,
                                                int tid) {
  constexpr int CHUNKS = D / 8;  // 16-byte chunks per row
  constexpr int TOTAL = ROWS * CHUNKS;
  static_assert(TOTAL % THREADS == 0, "tile copy must divide evenly among threads");
#pragma unroll
  for (int it = 0; it < TOTAL / THREADS; ++it) {
    int i = it * THREADS + tid;
    int r = i / CHUNKS, c = i % CHUNKS;
    int gr = row0 + r;
    bool ok = gr < n_rows;
    const T* src = g + (size_t)(ok ? gr : 0) * D + c * 8;
    cp_async16(s + r * LD + c * 8, src, ok);
  }
}

// ---------------------------------------------------------------------------------
// Forward, tensor cores
// ---------------------------------------------------------------------------------

template <int D, int W, int BC>
struct FwdCfg {
  static constexpr int BR = 16 * W;
  static constexpr int THREADS = 32 * W;
  static constexpr int LD = D + 8;
  // Q tile, then K and V tiles, each double-buffered.
  static constexpr int SMEM_ELEMS = BR * LD + 4 * BC * LD;
};

template <typename T, int D, int W, int BC>
__device__ __forceinline__ void fwd_tc(const T* __restrict__ Q, const T* __restrict__ K,
                                       const T* __restrict__ V, T* __restrict__ O,
                                       float* __restrict__ LSE, int nq, int nk,
                                       float scale_log2, int causal) {
  typedef FwdCfg<D, W, BC> C;
  constexpr int BR = C::BR, LD = C::LD, THREADS = C::THREADS;
  static_assert(D % 16 == 0 && BC % 16 == 0, "tile shapes");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BR * LD;
  T* sV = sK + 2 * BC * LD;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // Heaviest query blocks first under causal masking (they see the most keys).
  const int qb = gridDim.x - 1 - blockIdx.x;
  const size_t bh = blockIdx.y;
  const int q0 = qb * BR;
  const T* Qb = Q + bh * nq * D;
  const T* Kb = K + bh * nk * D;
  const T* Vb = V + bh * nk * D;

  const int kv_end = causal ? min(nk, q0 + BR) : nk;
  const int n_tiles = (kv_end + BC - 1) / BC;

  load_tile_async<T, BR, D, LD, THREADS>(sQ, Qb, q0, nq, tid);
  cp_async_commit();
  if (n_tiles > 0) {
    load_tile_async<T, BC, D, LD, THREADS>(sK, Kb, 0, nk, tid);
    load_tile_async<T, BC, D, LD, THREADS>(sV, Vb, 0, nk, tid);
  }
  cp_async_commit();
  cp_async_wait_one();
  __syncthreads();

  // This warp's 16 query rows as A fragments, kept in registers for the whole loop.
  u32 qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldsm_x4(qf[kk], sQ + (warp * 16 + lane % 16) * LD + kk * 16 + (lane / 16) * 8);

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // Running max (log2 domain, scaled) and this thread's partial row sums, for rows
  // g and g + 8 of the warp's 16.
  float m_run[2] = {-TF_INF, -TF_INF};
  float l_run[2] = {0.f, 0.f};
  const int row_a = q0 + warp * 16 + lane / 4;

  for (int j = 0; j < n_tiles; ++j) {
    cp_async_wait_all();
    __syncthreads();  // tile j visible; everyone is done with the buffer loaded next
    if (j + 1 < n_tiles) {
      int nb = (j + 1) & 1;
      load_tile_async<T, BC, D, LD, THREADS>(sK + nb * BC * LD, Kb, (j + 1) * BC, nk, tid);
      load_tile_async<T, BC, D, LD, THREADS>(sV + nb * BC * LD, Vb, (j + 1) * BC, nk, tid);
    }
    cp_async_commit();
    const T* kt = sK + (j & 1) * BC * LD;
    const T* vt = sV + (j & 1) * BC * LD;

    // S = Q K^T for this warp's 16 rows x BC keys.
    float s[BC / 8][4];
#pragma unroll
    for (int i = 0; i < BC / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int nn = 0; nn < BC / 16; ++nn) {
        u32 b[4];
        ldsm_x4(b, kt + (nn * 16 + (lane % 8) + (lane / 16) * 8) * LD + kk * 16 +
                       ((lane / 8) % 2) * 8);
        Mma<T>::run(s[2 * nn], qf[kk], b[0], b[1]);
        Mma<T>::run(s[2 * nn + 1], qf[kk], b[2], b[3]);
      }
    }

    // Scale into the log2 domain; mask keys past the end and, under causal, keys after
    // the row (only tiles that reach those need the per-element test).
    const int key0 = j * BC;
    const bool need_mask = (key0 + BC > nk) || (causal && key0 + BC - 1 > q0);
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[nt][e] * scale_log2;
        if (need_mask) {
          int key = key0 + nt * 8 + 2 * (lane % 4) + (e & 1);
          int row = row_a + (e >> 1) * 8;
          if (key >= nk || (causal && key > row)) x = -TF_INF;
        }
        s[nt][e] = x;
      }
    }

    // Online softmax update.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -TF_INF;
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
      mx = quad_max(mx);
      float m_new = fmaxf(m_run[r], mx);
      // A row with every key masked so far keeps m = -inf; subtract 0 then (no NaN).
      float m_use = (m_new == -TF_INF) ? 0.f : m_new;
      float alpha = fast_exp2(m_run[r] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        float p0 = fast_exp2(s[nt][2 * r] - m_use);
        float p1 = fast_exp2(s[nt][2 * r + 1] - m_use);
        s[nt][2 * r] = p0;
        s[nt][2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l_run[r] = l_run[r] * alpha + sum;
      m_run[r] = m_new;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        o[dn][2 * r] *= alpha;
        o[dn][2 * r + 1] *= alpha;
      }
    }

    // O += P V; P goes from accumulator layout straight into A fragments.
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      u32 a[4];
      a[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      a[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      a[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        u32 b[4];
        ldsm_x4_t(b, vt + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LD + dn * 16 +
                         (lane / 16) * 8);
        Mma<T>::run(o[2 * dn], a, b[0], b[1]);
        Mma<T>::run(o[2 * dn + 1], a, b[2], b[3]);
      }
    }
  }

  // Normalise and store; lse in natural-log units.
  T* Ob = O + bh * nq * D;
  float* Lb = LSE + bh * nq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = quad_sum(l_run[r]);
    float inv = l > 0.f ? 1.f / l : 0.f;
    int row = row_a + r * 8;
    if (row < nq) {
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        u32 v = Mma<T>::pack(o[dn][2 * r] * inv, o[dn][2 * r + 1] * inv);
        *reinterpret_cast<u32*>(Ob + (size_t)row * D + dn * 8 + 2 * (lane % 4)) = v;
      }
      if (lane % 4 == 0) Lb[row] = l > 0.f ? (m_run[r] + log2f(l)) * TF_LN2 : -TF_INF;
    }
  }
}

// ---------------------------------------------------------------------------------
// Backward, tensor cores
// ---------------------------------------------------------------------------------

template <int D, int W, int BR>
struct BwdCfg {
  static constexpr int BC = 16 * W;  // keys per block, 16 per warp
  static constexpr int THREADS = 32 * W;
  static constexpr int LD = D + 8;
  static constexpr int LDS = BR + 8;  // dS^T tile row stride
  // K, V tiles; Q and dO tiles double-buffered; dS^T; then f32 lse and Delta (x2).
  static constexpr int SMEM_ELEMS = 2 * BC * LD + 4 * BR * LD + BC * LDS;
  static constexpr int SMEM_BYTES_TAIL = 4 * BR * 4;
};

// Delta_i = sum_d dO[i,d] * O[i,d] (f32); also zeroes the f32 workspace the backward
// adds into (acc_n4 float4s from acc; grid-stride, so any size). A block of PRE_THREADS
// takes PRE_ROWS rows; D/8 lanes share a row, 16 bytes each, and every thread issues all
// of its loads (PRE_ROWS * D * 2 * 2 / PRE_THREADS bytes: 128 at D = 128) before the
// zeroing stores and the reductions, so enough bytes are in flight to reach the memory's
// rate (one warp per row with 4-byte loads left 16 bytes per thread in flight).
constexpr int PRE_THREADS = 256;
template <typename T>
__device__ __forceinline__ float dot2(u32 x, u32 y) {
  const float2 u = Mma<T>::unpack(x), v = Mma<T>::unpack(y);
  return u.x * v.x + u.y * v.y;
}
constexpr int PRE_ROWS = 64;
template <typename T, int D>
__device__ __forceinline__ void bwd_pre(const T* __restrict__ O, const T* __restrict__ dO,
                                        float* __restrict__ Delta, float* __restrict__ acc,
                                        long long acc_n4, long long rows) {
  constexpr int L = D / 8;                  // lanes per row
  constexpr int PER_PASS = PRE_THREADS / L;  // rows per pass of the block
  constexpr int PASSES = PRE_ROWS / PER_PASS;
  static_assert(L <= 32 && PRE_ROWS % PER_PASS == 0, "bwd_pre geometry");
  const int tid = threadIdx.x, sub = tid % L;
  const long long row0 = (long long)blockIdx.x * PRE_ROWS + tid / L;
  uint4 a[PASSES], b[PASSES];
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {  // rows past the end re-read the last row (rows > 0)
    const long long row = min(row0 + p * PER_PASS, rows - 1);
    a[p] = __ldg(reinterpret_cast<const uint4*>(O + row * D) + sub);
    b[p] = __ldg(reinterpret_cast<const uint4*>(dO + row * D) + sub);
  }
  const long long nthreads = (long long)gridDim.x * PRE_THREADS;
  for (long long i = (long long)blockIdx.x * PRE_THREADS + tid; i < acc_n4; i += nthreads)
    reinterpret_cast<float4*>(acc)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int p = 0; p < PASSES; ++p) {
    float s = dot2<T>(a[p].x, b[p].x) + dot2<T>(a[p].y, b[p].y) + dot2<T>(a[p].z, b[p].z) +
              dot2<T>(a[p].w, b[p].w);
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    const long long row = row0 + p * PER_PASS;
    if (sub == 0 && row < rows) Delta[row] = s;
  }
}

template <typename T>
__device__ __forceinline__ void bwd_post(const float* __restrict__ dq_acc, T* __restrict__ dQ,
                                         long long n, float scale) {
  long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (i >= n) return;  // n is a multiple of 8 (D is)
  float4 v = *reinterpret_cast<const float4*>(dq_acc + i);
  u32 lo = Mma<T>::pack(v.x * scale, v.y * scale);
  u32 hi = Mma<T>::pack(v.z * scale, v.w * scale);
  *reinterpret_cast<uint2*>(dQ + i) = make_uint2(lo, hi);
}

// Fragment-tiled f32 accumulator (64-row tiles of 128 columns, see bwd_wg) -> row-major
// [bh][n_rows][128] of T, times scale. One block of POST_THREADS per 64 x 128 tile: each
// thread loads 8 of the tile's 2048 float4s (all issued before any is used: 32 KB in
// flight per block), the block transposes the tile through shared memory into row-major
// T, and each thread stores four 16-byte pieces of whole rows (a fragment float4 holds
// two 4-byte pieces of rows 8 apart, so storing it directly wrote 4-byte pieces).
constexpr int POST_THREADS = 256;
// A read-only 16-byte load the compiler keeps in program order (volatile asm with a
// memory clobber: no other memory access moves above it), so a thread's loads are all
// issued before its first shared-memory store.
__device__ __forceinline__ float4 ld_stream_f4(const float4* p) {
  float4 v;
  asm volatile("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
template <typename T>
__device__ __forceinline__ void bwd_post_wg(const float* __restrict__ acc, T* __restrict__ out,
                                            int n_rows, float scale) {
  constexpr int LDT = 128 + 8;  // row stride in T: rows r and r + 1 start 4 banks apart
  __shared__ __align__(16) T tile_s[64 * LDT];
  const int tid = threadIdx.x;
  const long long tile = blockIdx.x;
  const float4* src = reinterpret_cast<const float4*>(acc) + tile * 2048;
  float4 v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = ld_stream_f4(src + k * POST_THREADS + tid);
  const int lane = tid % 32;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    // float4 index k * 256 + tid = (16 warp + c8) * 32 + lane (frag_tile_f4's order)
    const int wc = k * (POST_THREADS / 32) + tid / 32;
    const int r = (wc / 16) * 16 + lane / 4, c = (wc % 16) * 8 + 2 * (lane % 4);
    *reinterpret_cast<u32*>(tile_s + r * LDT + c) = Mma<T>::pack(v[k].x * scale, v[k].y * scale);
    *reinterpret_cast<u32*>(tile_s + (r + 8) * LDT + c) =
        Mma<T>::pack(v[k].z * scale, v[k].w * scale);
  }
  __syncthreads();
  const int tiles = (n_rows + 63) / 64;
  const long long bh = tile / tiles;
  const int row0 = (int)(tile % tiles) * 64;
  T* ob = out + (bh * n_rows + row0) * 128;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const int j = k * POST_THREADS + tid, r = j / 16, c = (j % 16) * 8;
    if (row0 + r < n_rows)
      *reinterpret_cast<uint4*>(ob + (size_t)r * 128 + c) =
          *reinterpret_cast<const uint4*>(tile_s + r * LDT + c);
  }
}

template <typename T, int D, int W, int BR>
__device__ __forceinline__ void bwd_tc(const T* __restrict__ Q, const T* __restrict__ K,
                                       const T* __restrict__ V, const T* __restrict__ dO,
                                       const float* __restrict__ LSE,
                                       const float* __restrict__ Delta,
                                       float* __restrict__ dq_acc, T* __restrict__ dK,
                                       T* __restrict__ dV, int nq, int nk, float scale,
                                       float scale_log2, int causal) {
  typedef BwdCfg<D, W, BR> C;
  constexpr int BC = C::BC, LD = C::LD, LDS = C::LDS, THREADS = C::THREADS;
  // dQ tile (BR x D) split among the warps: RG row groups of 16, CG column groups.
  constexpr int RG = BR / 16;
  constexpr int CG = W / RG;
  constexpr int DC = D / CG;
  static_assert(W % RG == 0 && D % CG == 0 && DC % 16 == 0, "dQ warp split");
  static_assert(BR <= THREADS, "lse/Delta staging");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BC * LD;
  T* sQ = sV + BC * LD;      // [2][BR][LD]
  T* sdO = sQ + 2 * BR * LD;  // [2][BR][LD]
  T* sdS = sdO + 2 * BR * LD;  // [BC][LDS], dS^T
  float* sL = reinterpret_cast<float*>(sdS + BC * LDS);  // [2][BR], lse
  float* sDl = sL + 2 * BR;                              // [2][BR], Delta

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int k0 = blockIdx.x * BC;
  const size_t bh = blockIdx.y;
  const T* Qb = Q + bh * nq * D;
  const T* dOb = dO + bh * nq * D;
  const T* Kb = K + bh * nk * D;
  const T* Vb = V + bh * nk * D;
  const float* Lb = LSE + bh * nq;
  const float* Db = Delta + bh * nq;
  float* dqb = dq_acc + bh * nq * D;

  // Under causal masking queries before k0 see none of this block's keys.
  const int i_begin = causal ? (k0 / BR) : 0;
  const int i_end = (nq + BR - 1) / BR;

  load_tile_async<T, BC, D, LD, THREADS>(sK, Kb, k0, nk, tid);
  load_tile_async<T, BC, D, LD, THREADS>(sV, Vb, k0, nk, tid);
  cp_async_commit();

  auto stage_q = [&](int i, int buf) {
    load_tile_async<T, BR, D, LD, THREADS>(sQ + buf * BR * LD, Qb, i * BR, nq, tid);
    load_tile_async<T, BR, D, LD, THREADS>(sdO + buf * BR * LD, dOb, i * BR, nq, tid);
    if (tid < BR) {
      // Asynchronous like the tiles: a plain load here would stall the whole block on
      // L2 latency every iteration. Rows past the end read 0 and are masked below.
      const int q = i * BR + tid;
      cp_async4(sL + buf * BR + tid, Lb + (q < nq ? q : 0), q < nq);
      cp_async4(sDl + buf * BR + tid, Db + (q < nq ? q : 0), q < nq);
    }
  };
  if (i_begin < i_end) stage_q(i_begin, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;

  const int key_a = k0 + warp * 16 + lane / 4;  // this thread's keys: key_a, key_a + 8
  const T* kw = sK + warp * 16 * LD;
  const T* vw = sV + warp * 16 * LD;

  for (int i = i_begin; i < i_end; ++i) {
    const int buf = (i - i_begin) & 1;
    cp_async_wait_all();
    __syncthreads();
    if (i + 1 < i_end) stage_q(i + 1, buf ^ 1);
    cp_async_commit();
    const T* qt = sQ + buf * BR * LD;
    const T* gt = sdO + buf * BR * LD;
    const float* lt = sL + buf * BR;
    const float* dt = sDl + buf * BR;
    const int qrow0 = i * BR;

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x BR queries.
    float s[BR / 8][4], dp[BR / 8][4];
#pragma unroll
    for (int n = 0; n < BR / 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      u32 ak[4], av[4];
      ldsm_x4(ak, kw + (lane % 16) * LD + kk * 16 + (lane / 16) * 8);
      ldsm_x4(av, vw + (lane % 16) * LD + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int nn = 0; nn < BR / 16; ++nn) {
        const int off = (nn * 16 + (lane % 8) + (lane / 16) * 8) * LD + kk * 16 +
                        ((lane / 8) % 2) * 8;
        u32 bq[4], bg[4];
        ldsm_x4(bq, qt + off);
        ldsm_x4(bg, gt + off);
        Mma<T>::run(s[2 * nn], ak, bq[0], bq[1]);
        Mma<T>::run(s[2 * nn + 1], ak, bq[2], bq[3]);
        Mma<T>::run(dp[2 * nn], av, bg[0], bg[1]);
        Mma<T>::run(dp[2 * nn + 1], av, bg[2], bg[3]);
      }
    }

    // P^T = exp(scale * S^T - lse), dS^T = P^T * (dP^T - Delta) (the softmax scale of dS
    // is applied to dK and dQ at the end).
    const bool need_mask =
        (k0 + BC > nk) || (qrow0 + BR > nq) || (causal && k0 + BC - 1 > qrow0);
#pragma unroll
    for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * (lane % 4) + (e & 1);
        float p = fast_exp2(s[nt][e] * scale_log2 - lt[qc] * TF_LOG2E);
        if (need_mask) {
          int key = key_a + (e >> 1) * 8;
          if (key >= nk || qrow0 + qc >= nq || (causal && key > qrow0 + qc)) p = 0.f;
        }
        s[nt][e] = p;
        dp[nt][e] = p * (dp[nt][e] - dt[qc]);
      }
    }

    // dS^T to shared memory for the dQ product below.
#pragma unroll
    for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<u32*>(sdS + (warp * 16 + lane / 4 + 8 * h) * LDS + nt * 8 +
                                2 * (lane % 4)) = Mma<T>::pack(dp[nt][2 * h], dp[nt][2 * h + 1]);
      }
    }

    // dV += P^T dO and dK += dS^T Q, A operands straight from registers.
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) {
      u32 ap[4], as[4];
      ap[0] = Mma<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      ap[1] = Mma<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      ap[2] = Mma<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      ap[3] = Mma<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      as[0] = Mma<T>::pack(dp[2 * kk][0], dp[2 * kk][1]);
      as[1] = Mma<T>::pack(dp[2 * kk][2], dp[2 * kk][3]);
      as[2] = Mma<T>::pack(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      as[3] = Mma<T>::pack(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        const int off = (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LD + dn * 16 +
                        (lane / 16) * 8;
        u32 bg[4], bq[4];
        ldsm_x4_t(bg, gt + off);
        ldsm_x4_t(bq, qt + off);
        Mma<T>::run(dv[2 * dn], ap, bg[0], bg[1]);
        Mma<T>::run(dv[2 * dn + 1], ap, bg[2], bg[3]);
        Mma<T>::run(dk[2 * dn], as, bq[0], bq[1]);
        Mma<T>::run(dk[2 * dn + 1], as, bq[2], bq[3]);
      }
    }
    __syncthreads();  // dS^T complete

    // dQ_i += dS K over this block's BC keys; warp tile 16 queries x DC columns.
    {
      const int wr = warp % RG, wc = warp / RG;
      float dq[DC / 8][4];
#pragma unroll
      for (int n = 0; n < DC / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        u32 a[4];
        ldsm_x4_t(a, sdS + (kk * 16 + (lane % 8) + (lane / 16) * 8) * LDS + wr * 16 +
                         ((lane / 8) % 2) * 8);
#pragma unroll
        for (int dn = 0; dn < DC / 16; ++dn) {
          u32 b[4];
          ldsm_x4_t(b, sK + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LD + wc * DC +
                           dn * 16 + (lane / 16) * 8);
          Mma<T>::run(dq[2 * dn], a, b[0], b[1]);
          Mma<T>::run(dq[2 * dn + 1], a, b[2], b[3]);
        }
      }
      const int qa = qrow0 + wr * 16 + lane / 4;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int q = qa + 8 * h;
        if (q < nq) {
#pragma unroll
          for (int nt = 0; nt < DC / 8; ++nt)
            red_add_v2(dqb + (size_t)q * D + wc * DC + nt * 8 + 2 * (lane % 4),
                       dq[nt][2 * h], dq[nt][2 * h + 1]);
        }
      }
    }
  }

  // Store dK (times the softmax scale) and dV for this thread's two keys.
  T* dKb = dK + bh * nk * D;
  T* dVb = dV + bh * nk * D;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_a + 8 * h;
    if (key < nk) {
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        const size_t off = (size_t)key * D + dn * 8 + 2 * (lane % 4);
        *reinterpret_cast<u32*>(dKb + off) =
            Mma<T>::pack(dk[dn][2 * h] * scale, dk[dn][2 * h + 1] * scale);
        *reinterpret_cast<u32*>(dVb + off) = Mma<T>::pack(dv[dn][2 * h], dv[dn][2 * h + 1]);
      }
    }
  }
}


// ---------------------------------------------------------------------------------
// Hopper warpgroup MMA (wgmma, sm_90a only), head dim 128
// ---------------------------------------------------------------------------------
//
// A warpgroup (4 consecutive warps) multiplies a 64-row A by a B read straight from
// shared memory. Tiles are kept in shared memory in the "core matrix" layout the
// instruction reads without swizzling: 8 rows x 16 bytes stored contiguously (128 B),
// core matrix (row/8, col/8) of a [rows][C] tile at ((row/8) * (C/8) + col/8) * 128 B.
// A descriptor names the first core matrix, LBO = the byte step between core matrices
// along K and SBO = the step along M/N, for K-major and MN-major (transposed) operands
// alike. The accumulator fragment of warp w in the group covers rows 16w..16w+15 in the
// mma.sync C layout per 8 columns, and a register A operand has the mma.sync A layout,
// so the softmax code is shared with the kernels above.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define TF_HAVE_WGMMA 1

template <typename T>
struct Tag {};

__device__ __forceinline__ unsigned long long gmma_desc(const void* p, u32 lbo_bytes,
                                                        u32 sbo_bytes) {
  unsigned long long a = smem_addr(p);
  return ((a & 0x3FFFFull) >> 4) | ((unsigned long long)(lbo_bytes >> 4) << 16) |
         ((unsigned long long)(sbo_bytes >> 4) << 32);
}
__device__ __forceinline__ void red_add_v4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b),
               "f"(c), "f"(d)
               : "memory");
}
__device__ __forceinline__ void wg_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wg_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// Generic-proxy writes to shared memory (st.shared, cp.async) become visible to the
// tensor cores' async proxy only after this fence in the writing thread (then a barrier).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Named barriers 1.. order the warpgroups' MMA issues ("turns", FlashAttention-3's
// ping-pong): warpgroup w issues its products only after warpgroup w-1 issued its own,
// so the tensor cores finish them one warpgroup after another and each warpgroup's
// softmax can run while the next one's products are on the tensor cores. Used by the
// ring forward's _t variant; with a block barrier per tile (g4, the backward) turns
// were slower (docs/perf/cuda-flash.md). Barrier 0 is __syncthreads.
__device__ __forceinline__ void turn_wait(int wg) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory");
}
__device__ __forceinline__ void turn_pass(int next_wg) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + next_wg) : "memory");
}

// mbarriers in shared memory (the forward's K/V ring): init with an arrival count, one
// arrive per thread, wait for the completion of the phase of the given parity.
__device__ __forceinline__ void mbar_init(unsigned long long* b, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(b)), "r"(count)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, u32 parity) {
  asm volatile(
      "{\n.reg .pred P;\nTF_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P, [%0], %1;\n"
      "@!P bra TF_MBAR_WAIT;\n}\n" ::"r"(smem_addr(b)),
      "r"(parity)
      : "memory");
}

// Keep the accumulator registers from being reordered across the asynchronous MMA.
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int TA, int TB>
__device__ __forceinline__ void wg_ss_n64(Tag<__nv_bfloat16>, float (&d)[32], unsigned long long da,
                                          unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
template <int TA, int TB>
__device__ __forceinline__ void wg_ss_n128(Tag<__nv_bfloat16>, float (&d)[64], unsigned long long da,
                                          unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_rs_n128(Tag<__nv_bfloat16>, float (&d)[64], const u32 (&a)[4],
                                          unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}
template <int TA, int TB>
__device__ __forceinline__ void wg_ss_n64(Tag<__half>, float (&d)[32], unsigned long long da,
                                          unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
template <int TA, int TB>
__device__ __forceinline__ void wg_ss_n128(Tag<__half>, float (&d)[64], unsigned long long da,
                                          unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}
template <int TB>
__device__ __forceinline__ void wg_rs_n128(Tag<__half>, float (&d)[64], const u32 (&a)[4],
                                          unsigned long long db, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, %70;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d), "n"(TB));
}

// f32 partial results that several blocks produce (the backward's dQ always, the dK and
// dV of its split items, the forward's O when a launch splits the work over blockIdx.z)
// use a "fragment-tiled" layout instead of row-major:
// the rows are cut into tiles of 64, each tile is 64 x 128 f32 = 32 KB contiguous, and
// inside a tile the float4 of (warp w, 8-column group c8, lane) -- the four accumulator
// values a wgmma lane holds for rows 16w + lane/4 (+8) and columns 8 c8 + 2 (lane%4)
// (+1) -- sits at float4 index (16 w + c8) * 32 + lane. A warp's reduction then covers
// 512 contiguous bytes (four whole 128-byte lines) instead of 16 rows x 32 bytes, and a
// conversion back (flash_bwd_post_wg, flash_fwd_combine) reads it coalesced.
__device__ __forceinline__ size_t frag_tile_f4(int warp, int c8, int lane) {
  return ((size_t)(warp * 16 + c8) * 32 + lane) * 4;
}
__device__ __forceinline__ void red_add_f4(float* p, const float* v) {
  red_add_v4(p, v[0], v[1], v[2], v[3]);
}

// Copy rows [row0, row0 + ROWS) of a row-major [n_rows, C] matrix into a core-matrix
// tile (zeros past n_rows). Eight consecutive threads fill one 128-byte core matrix.
template <typename T, int ROWS, int C, int THREADS>
__device__ __forceinline__ void load_tile_cm(T* s, const T* g, int row0, int n_rows, int tid) {
  constexpr int CH = C / 8;
  constexpr int TOTAL = ROWS * CH;
#pragma unroll
  for (int it = 0; it < (TOTAL + THREADS - 1) / THREADS; ++it) {
    const int i = it * THREADS + tid;
    if (TOTAL % THREADS != 0 && i >= TOTAL) break;
    const int r8 = i & 7, rest = i >> 3;
    const int c8 = rest % CH, rg = rest / CH;
    const int r = rg * 8 + r8;
    const bool ok = row0 + r < n_rows;
    cp_async16(s + (rg * CH + c8) * 64 + r8 * 8, g + (size_t)(ok ? row0 + r : 0) * C + c8 * 8,
               ok);
  }
}

// One online-softmax step on a warpgroup accumulator tile S (BC keys starting at key0):
// scale into the log2 domain, mask, update the running max/sum, rescale O, and leave
// P in S. Shared by both wgmma forward variants.
template <int BC, int D>
__device__ __forceinline__ void wg_softmax_step(float (&s)[BC / 2], float (&o)[D / 2],
                                                float (&m_run)[2], float (&l_run)[2], int key0,
                                                int nk, int q0, int row_a, int lane,
                                                float scale_log2, int causal) {
    const bool need_mask = (key0 + BC > nk) || (causal && key0 + BC - 1 > q0);
#pragma unroll
    for (int nt = 0; nt < BC / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[4 * nt + e] * scale_log2;
        if (need_mask) {
          const int key = key0 + nt * 8 + 2 * (lane % 4) + (e & 1);
          const int row = row_a + (e >> 1) * 8;
          if (key >= nk || (causal && key > row)) x = -TF_INF;
        }
        s[4 * nt + e] = x;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -TF_INF;
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt)
        mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * r], s[4 * nt + 2 * r + 1]));
      mx = quad_max(mx);
      const float m_new = fmaxf(m_run[r], mx);
      const float m_use = (m_new == -TF_INF) ? 0.f : m_new;
      const float alpha = fast_exp2(m_run[r] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < BC / 8; ++nt) {
        const float p0 = fast_exp2(s[4 * nt + 2 * r] - m_use);
        const float p1 = fast_exp2(s[4 * nt + 2 * r + 1] - m_use);
        s[4 * nt + 2 * r] = p0;
        s[4 * nt + 2 * r + 1] = p1;
        sum += p0 + p1;
      }
      l_run[r] = l_run[r] * alpha + sum;
      m_run[r] = m_new;
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        o[4 * dn + 2 * r] *= alpha;
        o[4 * dn + 2 * r + 1] *= alpha;
      }
    }

}

// Forward: NWG warpgroups of 64 query rows each share K/V tiles of BC keys (D = 128).
// SPLIT: the z blocks of a query block split its key tiles, each writes unnormalised
// partial results, and flash_fwd_combine merges them (fills the GPU when batch x heads
// is small). A separate instantiation: the 128-register budget of the plain kernel has
// no room for the split's bookkeeping.
template <typename T, int NWG, int BC, bool SPLIT>
__device__ __forceinline__ void fwd_wg(const T* __restrict__ Q, const T* __restrict__ K,
                                       const T* __restrict__ V, T* __restrict__ O,
                                       float* __restrict__ LSE, float* __restrict__ o_part,
                                       float2* __restrict__ ml_part, int nq, int nk,
                                       float scale_log2, int causal) {
  constexpr int D = 128, BR = 64 * NWG, THREADS = 128 * NWG;
  constexpr u32 ROWG = (D / 8) * 128;  // bytes between 8-row groups of a [.][D] tile
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BR * D;
  T* sV = sK + 2 * BC * D;

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int qb = gridDim.x - 1 - blockIdx.x;
  const size_t bh = blockIdx.y;
  const int q0 = qb * BR;
  const T* Kb = K + bh * nk * D;
  const T* Vb = V + bh * nk * D;
  const int kv_end = causal ? min(nk, q0 + BR) : nk;
  // Key tiles [j_begin, j_end): all of them, or this z block's share.
  int j_begin = 0, j_end = (kv_end + BC - 1) / BC;
  if constexpr (SPLIT) {
    const int per = (j_end + gridDim.z - 1) / gridDim.z;
    j_begin = min(j_end, (int)blockIdx.z * per);
    j_end = min(j_end, j_begin + per);
  }

  load_tile_cm<T, BR, D, THREADS>(sQ, Q + bh * nq * D, q0, nq, tid);
  if (j_begin < j_end) {
    load_tile_cm<T, BC, D, THREADS>(sK, Kb, j_begin * BC, nk, tid);
    load_tile_cm<T, BC, D, THREADS>(sV, Vb, j_begin * BC, nk, tid);
  }
  cp_async_commit();

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-TF_INF, -TF_INF};
  float l_run[2] = {0.f, 0.f};
  const int row_a = q0 + wg * 64 + warp * 16 + lane / 4;
  const T* qw = sQ + wg * 64 * D;  // this warpgroup's 64 rows (8 row groups)

  for (int j = j_begin; j < j_end; ++j) {
    const int b = (j - j_begin) & 1;
    cp_async_wait_all();
    fence_proxy_async();
    __syncthreads();
    if (j + 1 < j_end) {
      load_tile_cm<T, BC, D, THREADS>(sK + (b ^ 1) * BC * D, Kb, (j + 1) * BC, nk, tid);
      load_tile_cm<T, BC, D, THREADS>(sV + (b ^ 1) * BC * D, Vb, (j + 1) * BC, nk, tid);
    }
    cp_async_commit();
    const T* kt = sK + b * BC * D;
    const T* vt = sV + b * BC * D;

    float s[BC / 2];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      // A = Q rows (K-major), B = K rows (K-major): next core matrix along K is +128 B.
      const unsigned long long da = gmma_desc(qw + kk * 128, 128, ROWG);
      const unsigned long long db = gmma_desc(kt + kk * 128, 128, ROWG);
      if constexpr (BC == 64) wg_ss_n64<0, 0>(Tag<T>(), s, da, db, kk);
      else wg_ss_n128<0, 0>(Tag<T>(), s, da, db, kk);
    }
    wg_commit();
    wg_wait_all();
    reg_fence(s);

    wg_softmax_step<BC, D>(s, o, m_run, l_run, j * BC, nk, q0, row_a, lane, scale_log2, causal);

    // O += P V: A = P from registers, B = V (k = key, n = d) read N-major.
    u32 pa[BC / 16][4];
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      pa[kk][0] = Mma<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = Mma<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = Mma<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = Mma<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
    }
    reg_fence(o);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      // Two key groups per k step: along K (keys) the step is a row group, along N (d)
      // it is one core matrix.
      const unsigned long long db = gmma_desc(vt + kk * 2 * (ROWG / 2), ROWG, 128);
      wg_rs_n128<1>(Tag<T>(), o, pa[kk], db, 1);
    }
    wg_commit();
    wg_wait_all();
    reg_fence(o);
  }

  if constexpr (SPLIT) {
    // This split's unnormalised O (fragment-tiled, per (split, bh) the 64-row tiles of
    // the query rows) and each row's running max (log2 domain) and sum.
    const int q_tiles = (nq + 63) / 64;
    if (q0 + wg * 64 >= nq) return;
    const size_t part = (size_t)blockIdx.z * gridDim.y + bh;
    float* op = o_part + (part * q_tiles + q0 / 64 + wg) * (64 * D);
#pragma unroll
    for (int c8 = 0; c8 < D / 8; ++c8)
      *reinterpret_cast<float4*>(op + frag_tile_f4(warp, c8, lane)) =
          make_float4(o[4 * c8], o[4 * c8 + 1], o[4 * c8 + 2], o[4 * c8 + 3]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_run[r]);
      const int row = row_a + r * 8;
      if (lane % 4 == 0 && row < nq) ml_part[part * nq + row] = make_float2(m_run[r], l);
    }
    return;
  }

  T* Ob = O + bh * nq * D;
  float* Lb = LSE + bh * nq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_run[r]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = row_a + r * 8;
    if (row < nq) {
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        const u32 v = Mma<T>::pack(o[4 * dn + 2 * r] * inv, o[4 * dn + 2 * r + 1] * inv);
        *reinterpret_cast<u32*>(Ob + (size_t)row * D + dn * 8 + 2 * (lane % 4)) = v;
      }
      if (lane % 4 == 0) Lb[row] = l > 0.f ? (m_run[r] + log2f(l)) * TF_LN2 : -TF_INF;
    }
  }
}


// Forward with a 4-stage K/V ring guarded by mbarriers instead of a block barrier per
// key tile (4 warpgroups x 64 query rows, key tiles of 64, D = 128): a warpgroup waits
// only for the tile it needs (full[stage]: every thread's copies landed) and a stage is
// refilled once every thread is done with it (empty[stage]), so warpgroups may drift up
// to two tiles apart and one's softmax overlaps another's products. TURNS adds the
// issue order of turn_wait on top. Every thread copies a share of every tile (cp.async),
// waits for its own share one tile ahead of use and then arrives on full.
template <typename T, bool TURNS>
__device__ __forceinline__ void fwd_wg_ring(const T* __restrict__ Q, const T* __restrict__ K,
                                            const T* __restrict__ V, T* __restrict__ O,
                                            float* __restrict__ LSE, int nq, int nk,
                                            float scale_log2, int causal) {
  constexpr int D = 128, NWG = 4, BC = 64, NS = 4, BR = 64 * NWG, THREADS = 128 * NWG;
  constexpr u32 ROWG = (D / 8) * 128;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BR * D;       // [NS][BC][D]
  T* sV = sK + NS * BC * D;  // [NS][BC][D]
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sV + NS * BC * D);
  unsigned long long* empty = full + NS;

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int qb = gridDim.x - 1 - blockIdx.x;
  const size_t bh = blockIdx.y;
  const int q0 = qb * BR;
  const T* Kb = K + bh * nk * D;
  const T* Vb = V + bh * nk * D;
  const int kv_end = causal ? min(nk, q0 + BR) : nk;
  const int n_tiles = (kv_end + BC - 1) / BC;
  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < NS; ++st) {
      mbar_init(full + st, THREADS);
      mbar_init(empty + st, THREADS);
    }
  }
  auto load_kv = [&](int t) {
    const int st = t % NS;
    load_tile_cm<T, BC, D, THREADS>(sK + st * BC * D, Kb, t * BC, nk, tid);
    load_tile_cm<T, BC, D, THREADS>(sV + st * BC * D, Vb, t * BC, nk, tid);
  };
  load_tile_cm<T, BR, D, THREADS>(sQ, Q + bh * nq * D, q0, nq, tid);
  if (n_tiles > 0) load_kv(0);
  cp_async_commit();
  if (n_tiles > 1) load_kv(1);
  cp_async_commit();
  __syncthreads();  // the barrier inits
  cp_async_wait_one();  // this thread's share of Q and tile 0
  fence_proxy_async();
  if (n_tiles > 0) mbar_arrive(full);

  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
  float m_run[2] = {-TF_INF, -TF_INF};
  float l_run[2] = {0.f, 0.f};
  const int row_a = q0 + wg * 64 + warp * 16 + lane / 4;
  const T* qw = sQ + wg * 64 * D;

  for (int j = 0; j < n_tiles; ++j) {
    const int st = j % NS;
    mbar_wait(full + st, (j / NS) & 1);
    const T* kt = sK + st * BC * D;
    const T* vt = sV + st * BC * D;

    float s[BC / 2];
    if (TURNS && !(wg == 0 && j == 0)) turn_wait(wg);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wg_ss_n64<0, 0>(Tag<T>(), s, gmma_desc(qw + kk * 128, 128, ROWG),
                      gmma_desc(kt + kk * 128, 128, ROWG), kk);
    wg_commit();
    if (TURNS && !(wg == NWG - 1 && j == n_tiles - 1)) turn_pass((wg + 1) % NWG);

    // While S is on the tensor cores: refill the stage tile j - 2 used with tile j + 2,
    // and publish this thread's share of tile j + 1 (copied since the last iteration).
    if (j + 2 < n_tiles) {
      if (j >= 2) mbar_wait(empty + (j + 2) % NS, ((j - 2) / NS) & 1);
      load_kv(j + 2);
    }
    cp_async_commit();
    cp_async_wait_one();
    fence_proxy_async();
    if (j + 1 < n_tiles) mbar_arrive(full + (j + 1) % NS);

    wg_wait_all();
    reg_fence(s);
    wg_softmax_step<BC, D>(s, o, m_run, l_run, j * BC, nk, q0, row_a, lane, scale_log2, causal);

    u32 pa[BC / 16][4];
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) {
      pa[kk][0] = Mma<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = Mma<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = Mma<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = Mma<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
    }
    reg_fence(o);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
      wg_rs_n128<1>(Tag<T>(), o, pa[kk], gmma_desc(vt + kk * 2 * (ROWG / 2), ROWG, 128), 1);
    wg_commit();
    wg_wait_all();
    reg_fence(o);
    mbar_arrive(empty + st);
  }

  T* Ob = O + bh * nq * D;
  float* Lb = LSE + bh * nq;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = quad_sum(l_run[r]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int row = row_a + r * 8;
    if (row < nq) {
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        const u32 v = Mma<T>::pack(o[4 * dn + 2 * r] * inv, o[4 * dn + 2 * r + 1] * inv);
        *reinterpret_cast<u32*>(Ob + (size_t)row * D + dn * 8 + 2 * (lane % 4)) = v;
      }
      if (lane % 4 == 0) Lb[row] = l > 0.f ? (m_run[r] + log2f(l)) * TF_LN2 : -TF_INF;
    }
  }
}

// Merges the split forward's partial results: per row M = max_z m_z,
// L = sum_z l_z 2^(m_z - M), O = sum_z O_z 2^(m_z - M) / L, lse = (M + log2 L) ln 2.
// One thread per float4 of the fragment-tiled partials (rows r and r + 8, two columns).
template <typename T>
__device__ __forceinline__ void fwd_combine(const float* __restrict__ o_part,
                                            const float2* __restrict__ ml_part,
                                            T* __restrict__ O, float* __restrict__ LSE,
                                            int splits, int bh_count, int nq) {
  constexpr int D = 128;
  const int q_tiles = (nq + 63) / 64;
  const long long n4 = (long long)bh_count * q_tiles * 2048;
  const long long f = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (f >= n4) return;
  const int lane = f % 32, c8 = (f / 32) % 16, warp = (f / 512) % 4;
  const long long tile = f / 2048;
  const long long bh = tile / q_tiles;
  const int r0 = (int)(tile % q_tiles) * 64 + warp * 16 + lane / 4;
  const int c = c8 * 8 + 2 * (lane % 4);
  const size_t plane4 = (size_t)bh_count * q_tiles * 2048;  // float4s per split
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    if (r >= nq) continue;
    float mx = -TF_INF;
    for (int z = 0; z < splits; ++z) mx = fmaxf(mx, ml_part[((size_t)z * bh_count + bh) * nq + r].x);
    const float m_use = mx == -TF_INF ? 0.f : mx;
    float l = 0.f, a = 0.f, b = 0.f;
    for (int z = 0; z < splits; ++z) {
      const float2 ml = ml_part[((size_t)z * bh_count + bh) * nq + r];
      const float w = fast_exp2(ml.x - m_use);
      const float4 v = reinterpret_cast<const float4*>(o_part)[z * plane4 + f];
      l += ml.y * w;
      a += (h ? v.z : v.x) * w;
      b += (h ? v.w : v.y) * w;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    *reinterpret_cast<u32*>(O + (bh * nq + r) * D + c) = Mma<T>::pack(a * inv, b * inv);
    if (c == 0) LSE[bh * nq + r] = l > 0.f ? (mx + log2f(l)) * TF_LN2 : -TF_INF;
  }
}

// The backward's epilogue: dK (times scale) and dV of this warpgroup's 64 keys, straight
// to T. A block that took one piece of a split item (slot >= 0, see bwd_wg) first adds
// its partial sums into the item's f32 fragment-tiled tiles in kv_acc (a warpgroup whose
// keys all lie past nk, or a piece with no query tile, adds nothing) and counts itself
// done; the last of the item's `splits` pieces reads the sums back and stores them, so
// a split needs no conversion launch. (The CUDA samples' threadFenceReduction pattern:
// every thread fences its reductions before the block's count, the last block fences
// before reading; kv_acc and the counters start zeroed by the pre-kernel.)
template <typename T>
__device__ __forceinline__ void bwd_wg_store_dkv(float (&dk)[64], float (&dv)[64],
                                                 T* __restrict__ dK, T* __restrict__ dV,
                                                 float* __restrict__ kv_acc,
                                                 int* __restrict__ counters, int slot,
                                                 int splits, size_t bh, int k0, int key_a,
                                                 int nk, int wg, int warp, int lane,
                                                 bool had_tiles, float scale) {
  constexpr int D = 128, TILE = 64 * D;
  if (slot >= 0) {
    __shared__ int last_piece;
    float* ka = kv_acc + ((size_t)slot * 4 + wg * 2) * TILE;
    float* va = ka + TILE;
    const bool keys = k0 + wg * 64 < nk;
    if (had_tiles && keys) {
#pragma unroll
      for (int c8 = 0; c8 < 16; ++c8) {
        red_add_f4(ka + frag_tile_f4(warp, c8, lane), &dk[4 * c8]);
        red_add_f4(va + frag_tile_f4(warp, c8, lane), &dv[4 * c8]);
      }
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last_piece = atomicAdd(counters + slot, 1) == splits - 1;
    __syncthreads();
    if (!last_piece || !keys) return;
    __threadfence();
#pragma unroll
    for (int c8 = 0; c8 < 16; ++c8) {
      const float4 a = __ldcg(reinterpret_cast<const float4*>(ka + frag_tile_f4(warp, c8, lane)));
      const float4 b = __ldcg(reinterpret_cast<const float4*>(va + frag_tile_f4(warp, c8, lane)));
      dk[4 * c8] = a.x, dk[4 * c8 + 1] = a.y, dk[4 * c8 + 2] = a.z, dk[4 * c8 + 3] = a.w;
      dv[4 * c8] = b.x, dv[4 * c8 + 1] = b.y, dv[4 * c8 + 2] = b.z, dv[4 * c8 + 3] = b.w;
    }
  }
  T* dKb = dK + bh * nk * D;
  T* dVb = dV + bh * nk * D;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = key_a + 8 * h;
    if (key < nk) {
#pragma unroll
      for (int dn = 0; dn < D / 8; ++dn) {
        const size_t off = (size_t)key * D + dn * 8 + 2 * (lane % 4);
        *reinterpret_cast<u32*>(dKb + off) =
            Mma<T>::pack(dk[4 * dn + 2 * h] * scale, dk[4 * dn + 2 * h + 1] * scale);
        *reinterpret_cast<u32*>(dVb + off) = Mma<T>::pack(dv[4 * dn + 2 * h], dv[4 * dn + 2 * h + 1]);
      }
    }
  }
}

// Backward (D = 128): 2 warpgroups x 64 keys per block, query tiles of 64 rows.
//
// Each query tile's dQ goes to the f32 workspace with red.global.add.v4.f32, fragment-
// tiled (above). Tried and slower (docs/perf/cuda-flash.md): row-major v2/v4 reductions
// (16 rows x 32 B per warp instruction), and staging the tile in shared memory for one
// cp.reduce.async.bulk per tile (4.17 vs 4.03 ms at (8, 32, 2048, 128)); issuing the dQ
// product before dV/dK and reducing while those run was no faster (4.04); issuing tile
// j's dQ product in iteration j + 1 (FlashAttention-3's order) spills (4.48 ms).
//
// The query-side operands (Q, dO, lse, Delta tiles) go through a 3-stage ring under
// mbarriers and dS^T is double-buffered, so that no block barrier is left in the loop
// (the forward's ring applied to the backward: 3.93-3.99 ms against 4.08-4.10 with
// two block barriers per query tile, docs/perf/cuda-flash.md session 4). Two kinds of mbarrier,
// THREADS arrivals each:
//   full[st]: every thread's cp.async share of the tile in stage st landed (a thread
//     publishes tile j+1 while S_j/dP_j are on the tensor cores);
//   ds[b]: both warpgroups stored their dS^T rows of tile j (b = j % 2), which the dQ
//     product reads whole (dQ sums over the block's 128 keys).
// Passing ds[b] at tile j also proves that the other warpgroup finished tile j-1 (its
// dQ/dK/dV products were waited before it stored dS^T of tile j), so the stage of tile
// j-1 may be refilled with tile j+2 and dS^T buffer b^1 rewritten at tile j+1: no
// "empty" barriers are needed, and the warpgroups drift at most one product apart.
template <typename T>
__device__ __forceinline__ void bwd_wg(const T* __restrict__ Q, const T* __restrict__ K,
                                       const T* __restrict__ V, const T* __restrict__ dO,
                                       const float* __restrict__ LSE,
                                       const float* __restrict__ Delta,
                                       float* __restrict__ dq_acc, T* __restrict__ dK,
                                       T* __restrict__ dV, float* __restrict__ kv_acc,
                                       int* __restrict__ counters, int nq, int nk, float scale,
                                       float scale_log2, int causal, int whole, int splits) {
  constexpr int D = 128, BC = 128, BR = 64, THREADS = 256, NS = 3;
  constexpr int TILE = BR * D;           // floats per fragment tile
  constexpr u32 ROWG = (D / 8) * 128;    // row-group step of a [.][D] tile, bytes
  constexpr u32 SROWG = (BR / 8) * 128;  // row-group step of the dS^T tile [BC][BR]
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BC * D;
  T* sQ = sV + BC * D;         // [NS][BR][D]
  T* sdO = sQ + NS * BR * D;   // [NS][BR][D]
  T* sdS = sdO + NS * BR * D;  // [2][BC][BR], dS^T
  float* sL = reinterpret_cast<float*>(sdS + 2 * BC * BR);  // [NS][BR]
  float* sDl = sL + NS * BR;                                // [NS][BR]
  unsigned long long* full = reinterpret_cast<unsigned long long*>(sDl + NS * BR);
  unsigned long long* ds_full = full + NS;

  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  // Work items are (batch x head, key block) pairs, batch x head major. Blocks
  // [0, whole) take one whole item each; every later block takes one of `splits` pieces
  // of an item's query tiles (item whole + (block - whole) / splits, slot item - whole
  // in kv_acc and counters). Blocks start in index order, so the pieces fill the last
  // wave (the launcher's BwdSplit says how many items split, and how finely).
  const int k_blocks = (nk + BC - 1) / BC;
  const int blk = blockIdx.x;
  const bool split = blk >= whole;
  const int item = split ? whole + (blk - whole) / splits : blk;
  const int piece = split ? (blk - whole) % splits : 0;
  const int k0 = (item % k_blocks) * BC;
  const size_t bh = item / k_blocks;
  const T* Qb = Q + bh * nq * D;
  const T* dOb = dO + bh * nq * D;
  const float* Lb = LSE + bh * nq;
  const float* Db = Delta + bh * nq;
  const int q_tiles = (nq + BR - 1) / BR;
  float* dqb = dq_acc + bh * q_tiles * TILE;
  int i_begin = causal ? (k0 / BR) : 0;
  int i_end = q_tiles;
  if (split) {
    const int per = (i_end - i_begin + splits - 1) / splits;
    i_begin = min(i_end, i_begin + piece * per);
    i_end = min(i_end, i_begin + per);
  }
  const int n_tiles = i_end - i_begin;
  if (tid == 0) {
#pragma unroll
    for (int st = 0; st < NS; ++st) mbar_init(full + st, THREADS);
    mbar_init(ds_full, THREADS);
    mbar_init(ds_full + 1, THREADS);
  }
  auto stage_q = [&](int j) {
    const int st = j % NS, i = i_begin + j;
    load_tile_cm<T, BR, D, THREADS>(sQ + st * BR * D, Qb, i * BR, nq, tid);
    load_tile_cm<T, BR, D, THREADS>(sdO + st * BR * D, dOb, i * BR, nq, tid);
    if (tid < BR) {
      const int q = i * BR + tid;
      cp_async4(sL + st * BR + tid, Lb + (q < nq ? q : 0), q < nq);
      cp_async4(sDl + st * BR + tid, Db + (q < nq ? q : 0), q < nq);
    }
  };
  load_tile_cm<T, BC, D, THREADS>(sK, K + bh * nk * D, k0, nk, tid);
  load_tile_cm<T, BC, D, THREADS>(sV, V + bh * nk * D, k0, nk, tid);
  if (n_tiles > 0) stage_q(0);
  cp_async_commit();
  if (n_tiles > 1) stage_q(1);
  cp_async_commit();
  __syncthreads();      // the barrier inits
  cp_async_wait_one();  // this thread's share of K, V and tile 0
  fence_proxy_async();
  if (n_tiles > 0) mbar_arrive(full);

  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) dk[i] = dv[i] = 0.f;
  const int key_a = k0 + wg * 64 + warp * 16 + lane / 4;
  const T* kw = sK + wg * 64 * D;
  const T* vw = sV + wg * 64 * D;

  for (int j = 0; j < n_tiles; ++j) {
    const int st = j % NS, b = j & 1, i = i_begin + j;
    mbar_wait(full + st, (j / NS) & 1);
    const T* qt = sQ + st * BR * D;
    const T* gt = sdO + st * BR * D;
    const float* lt = sL + st * BR;
    const float* dt = sDl + st * BR;
    T* dst_s = sdS + b * BC * BR;
    const int qrow0 = i * BR;

    // S^T = K Q^T, dP^T = V dO^T (this warpgroup's 64 keys x 64 queries).
    float s[BR / 2], dp[BR / 2];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      wg_ss_n64<0, 0>(Tag<T>(), s, gmma_desc(kw + kk * 128, 128, ROWG),
                      gmma_desc(qt + kk * 128, 128, ROWG), kk);
      wg_ss_n64<0, 0>(Tag<T>(), dp, gmma_desc(vw + kk * 128, 128, ROWG),
                      gmma_desc(gt + kk * 128, 128, ROWG), kk);
    }
    wg_commit();
    // While they run: publish this thread's share of tile j + 1 (copied since the
    // last iteration; it is the newest cp.async group).
    cp_async_wait_all();
    fence_proxy_async();
    if (j + 1 < n_tiles) mbar_arrive(full + (j + 1) % NS);

    const bool need_mask =
        (k0 + BC > nk) || (qrow0 + BR > nq) || (causal && k0 + BC - 1 > qrow0);
    wg_wait_all();
    reg_fence(s);
    reg_fence(dp);
#pragma unroll
    for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qc = nt * 8 + 2 * (lane % 4) + (e & 1);
        float p = fast_exp2(s[4 * nt + e] * scale_log2 - lt[qc] * TF_LOG2E);
        if (need_mask) {
          const int key = key_a + (e >> 1) * 8;
          if (key >= nk || qrow0 + qc >= nq || (causal && key > qrow0 + qc)) p = 0.f;
        }
        s[4 * nt + e] = p;
        dp[4 * nt + e] = p * (dp[4 * nt + e] - dt[qc]);
      }
    }

    // dS^T into its core-matrix tile (buffer b) for the dQ product.
    {
      const int kl = wg * 64 + warp * 16 + lane / 4;  // key row within the block
#pragma unroll
      for (int nt = 0; nt < BR / 8; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int kr = kl + 8 * h;
          *reinterpret_cast<u32*>(dst_s + ((kr >> 3) * (BR / 8) + nt) * 64 + (kr & 7) * 8 +
                                  2 * (lane % 4)) =
              Mma<T>::pack(dp[4 * nt + 2 * h], dp[4 * nt + 2 * h + 1]);
        }
    }

    // dV += P^T dO, dK += dS^T Q (A from registers, B N-major).
    u32 pa[BR / 16][4], sa[BR / 16][4];
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        pa[kk][x] = Mma<T>::pack(s[8 * kk + 2 * x], s[8 * kk + 2 * x + 1]);
        sa[kk][x] = Mma<T>::pack(dp[8 * kk + 2 * x], dp[8 * kk + 2 * x + 1]);
      }
    }
    reg_fence(dv);
    reg_fence(dk);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BR / 16; ++kk) {
      wg_rs_n128<1>(Tag<T>(), dv, pa[kk], gmma_desc(gt + kk * 2 * (ROWG / 2), ROWG, 128), 1);
      wg_rs_n128<1>(Tag<T>(), dk, sa[kk], gmma_desc(qt + kk * 2 * (ROWG / 2), ROWG, 128), 1);
    }
    wg_commit();
    fence_proxy_async();  // dS^T stores -> async proxy
    mbar_arrive(ds_full + b);
    mbar_wait(ds_full + b, (j >> 1) & 1);
    // Both warpgroups are past tile j - 1: refill its stage with tile j + 2.
    if (j + 2 < n_tiles) stage_q(j + 2);
    cp_async_commit();

    // dQ_i += dS K: warpgroup wg takes d columns [64 wg, 64 wg + 64). A = dS read
    // M-major from the dS^T tile, B = K (k = key, n = d) read N-major.
    float dq[32];
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk)
      wg_ss_n64<1, 1>(Tag<T>(), dq, gmma_desc(dst_s + kk * 2 * (SROWG / 2), SROWG, 128),
                      gmma_desc(sK + kk * 2 * (ROWG / 2) + wg * 8 * 64, ROWG, 128), kk);
    wg_commit();
    wg_wait_all();  // dV/dK too
    reg_fence(dq);
    reg_fence(dv);
    reg_fence(dk);
    float* dst = dqb + (size_t)i * TILE;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
      red_add_f4(dst + frag_tile_f4(warp, wg * 8 + nt, lane), &dq[4 * nt]);
  }
  cp_async_wait_all();  // K/V of a block with no query tile
  bwd_wg_store_dkv<T>(dk, dv, dK, dV, kv_acc, counters, split ? item - whole : -1, splits, bh,
                      k0, key_a, nk, wg, warp, lane, i_end > i_begin, scale);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

#if !defined(TF_SKIP_F32)
// ---------------------------------------------------------------------------------
// f32 on CUDA cores
// ---------------------------------------------------------------------------------
//
// One warp per "own" row (a query for the forward and dQ, a key for dK/dV); 8 warps per
// block share chunks of 32 "other" rows staged in shared memory. For a chunk, lane L
// computes the dot products against other row L (rows padded by one float so the 32
// lanes read 32 banks), then the warp accumulates the chunk's contribution to its own
// D-vector, lane L owning elements L, L+32, ...

constexpr int F32_WARPS = 8;
constexpr int F32_CHUNK = 32;

template <int D>
__device__ __forceinline__ float dot_row(const float* own, const float* other) {
  float acc = 0.f;
#pragma unroll 8
  for (int d = 0; d < D; ++d) acc = fmaf(own[d], other[d], acc);
  return acc;
}

// Copies rows [r0, r0 + 32) of a [n, D] matrix into a [32][D+1] tile (zeros past n).
template <int D>
__device__ __forceinline__ void stage_chunk(float* s, const float* g, int r0, int n) {
  for (int i = threadIdx.x; i < F32_CHUNK * D; i += blockDim.x) {
    int r = i / D, d = i % D;
    s[r * (D + 1) + d] = (r0 + r < n) ? g[(size_t)(r0 + r) * D + d] : 0.f;
  }
}

template <int D>
__device__ __forceinline__ void fwd_f32(const float* __restrict__ Q,
                                        const float* __restrict__ K,
                                        const float* __restrict__ V, float* __restrict__ O,
                                        float* __restrict__ LSE, int nq, int nk,
                                        float scale_log2, int causal) {
  constexpr int DPL = D / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sK = reinterpret_cast<float*>(smem_raw);  // [32][D+1]
  float* sV = sK + F32_CHUNK * (D + 1);            // [32][D+1]
  float* sQ = sV + F32_CHUNK * (D + 1);            // [8][D]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t bh = blockIdx.y;
  const int row0 = blockIdx.x * F32_WARPS;
  const int row = row0 + warp;
  const float* Kb = K + bh * nk * D;
  const float* Vb = V + bh * nk * D;
  for (int d = lane; d < D; d += 32)
    sQ[warp * D + d] = row < nq ? Q[(bh * nq + row) * D + d] : 0.f;

  float o[DPL];
#pragma unroll
  for (int r = 0; r < DPL; ++r) o[r] = 0.f;
  float m = -TF_INF, l = 0.f;
  const int kv_end = causal ? min(nk, row0 + F32_WARPS) : nk;
  for (int c0 = 0; c0 < kv_end; c0 += F32_CHUNK) {
    __syncthreads();
    stage_chunk<D>(sK, Kb, c0, nk);
    stage_chunk<D>(sV, Vb, c0, nk);
    __syncthreads();
    const int key = c0 + lane;
    float s = dot_row<D>(sQ + warp * D, sK + lane * (D + 1)) * scale_log2;
    if (key >= nk || (causal && key > row)) s = -TF_INF;
    const float m_new = fmaxf(m, warp_max(s));
    const float m_use = m_new == -TF_INF ? 0.f : m_new;
    const float alpha = exp2f(m - m_use);
    const float p = exp2f(s - m_use);
    l = l * alpha + warp_sum(p);
    m = m_new;
#pragma unroll
    for (int r = 0; r < DPL; ++r) o[r] *= alpha;
    for (int jj = 0; jj < F32_CHUNK; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
#pragma unroll
      for (int r = 0; r < DPL; ++r) o[r] = fmaf(pj, sV[jj * (D + 1) + lane + 32 * r], o[r]);
    }
  }
  if (row < nq) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
    for (int r = 0; r < DPL; ++r) O[(bh * nq + row) * D + lane + 32 * r] = o[r] * inv;
    if (lane == 0) LSE[bh * nq + row] = l > 0.f ? (m + log2f(l)) * TF_LN2 : -TF_INF;
  }
}

// dQ_i = scale * sum_j P_ij (dP_ij - Delta_i) k_j, one warp per query row.
template <int D>
__device__ __forceinline__ void bwd_dq_f32(const float* __restrict__ Q,
                                           const float* __restrict__ K,
                                           const float* __restrict__ V,
                                           const float* __restrict__ dO,
                                           const float* __restrict__ LSE,
                                           const float* __restrict__ Delta,
                                           float* __restrict__ dQ, int nq, int nk, float scale,
                                           float scale_log2, int causal) {
  constexpr int DPL = D / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sK = reinterpret_cast<float*>(smem_raw);
  float* sV = sK + F32_CHUNK * (D + 1);
  float* sQ = sV + F32_CHUNK * (D + 1);  // [8][D]
  float* sG = sQ + F32_WARPS * D;        // [8][D], dO
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t bh = blockIdx.y;
  const int row0 = blockIdx.x * F32_WARPS;
  const int row = row0 + warp;
  const float* Kb = K + bh * nk * D;
  const float* Vb = V + bh * nk * D;
  for (int d = lane; d < D; d += 32) {
    sQ[warp * D + d] = row < nq ? Q[(bh * nq + row) * D + d] : 0.f;
    sG[warp * D + d] = row < nq ? dO[(bh * nq + row) * D + d] : 0.f;
  }
  const float lse2 = row < nq ? LSE[bh * nq + row] * TF_LOG2E : TF_INF;
  const float delta = row < nq ? Delta[bh * nq + row] : 0.f;
  float acc[DPL];
#pragma unroll
  for (int r = 0; r < DPL; ++r) acc[r] = 0.f;
  const int kv_end = causal ? min(nk, row0 + F32_WARPS) : nk;
  for (int c0 = 0; c0 < kv_end; c0 += F32_CHUNK) {
    __syncthreads();
    stage_chunk<D>(sK, Kb, c0, nk);
    stage_chunk<D>(sV, Vb, c0, nk);
    __syncthreads();
    const int key = c0 + lane;
    const float s = dot_row<D>(sQ + warp * D, sK + lane * (D + 1));
    const float dpv = dot_row<D>(sG + warp * D, sV + lane * (D + 1));
    float p = exp2f(s * scale_log2 - lse2);
    if (key >= nk || (causal && key > row)) p = 0.f;
    const float ds = p * (dpv - delta);
    for (int jj = 0; jj < F32_CHUNK; ++jj) {
      const float dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
      for (int r = 0; r < DPL; ++r)
        acc[r] = fmaf(dsj, sK[jj * (D + 1) + lane + 32 * r], acc[r]);
    }
  }
  if (row < nq) {
#pragma unroll
    for (int r = 0; r < DPL; ++r) dQ[(bh * nq + row) * D + lane + 32 * r] = acc[r] * scale;
  }
}

// dV_j = sum_i P_ij dO_i and dK_j = scale * sum_i dS_ij q_i, one warp per key row.
template <int D>
__device__ __forceinline__ void bwd_dkv_f32(const float* __restrict__ Q,
                                            const float* __restrict__ K,
                                            const float* __restrict__ V,
                                            const float* __restrict__ dO,
                                            const float* __restrict__ LSE,
                                            const float* __restrict__ Delta,
                                            float* __restrict__ dK, float* __restrict__ dV,
                                            int nq, int nk, float scale, float scale_log2,
                                            int causal) {
  constexpr int DPL = D / 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* sQ = reinterpret_cast<float*>(smem_raw);  // [32][D+1]
  float* sG = sQ + F32_CHUNK * (D + 1);            // [32][D+1], dO
  float* sK = sG + F32_CHUNK * (D + 1);            // [8][D]
  float* sV = sK + F32_WARPS * D;                  // [8][D]
  float* sL = sV + F32_WARPS * D;                  // [32] lse * log2(e)
  float* sDl = sL + F32_CHUNK;                     // [32] Delta
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const size_t bh = blockIdx.y;
  const int key0 = blockIdx.x * F32_WARPS;
  const int key = key0 + warp;
  const float* Qb = Q + bh * nq * D;
  const float* Gb = dO + bh * nq * D;
  for (int d = lane; d < D; d += 32) {
    sK[warp * D + d] = key < nk ? K[(bh * nk + key) * D + d] : 0.f;
    sV[warp * D + d] = key < nk ? V[(bh * nk + key) * D + d] : 0.f;
  }
  float ak[DPL], av[DPL];
#pragma unroll
  for (int r = 0; r < DPL; ++r) ak[r] = av[r] = 0.f;
  const int q_begin = causal ? (key0 / F32_CHUNK) * F32_CHUNK : 0;
  for (int c0 = q_begin; c0 < nq; c0 += F32_CHUNK) {
    __syncthreads();
    stage_chunk<D>(sQ, Qb, c0, nq);
    stage_chunk<D>(sG, Gb, c0, nq);
    if (threadIdx.x < F32_CHUNK) {
      const int q = c0 + threadIdx.x;
      sL[threadIdx.x] = q < nq ? LSE[bh * nq + q] * TF_LOG2E : TF_INF;
      sDl[threadIdx.x] = q < nq ? Delta[bh * nq + q] : 0.f;
    }
    __syncthreads();
    const int q = c0 + lane;
    const float s = dot_row<D>(sK + warp * D, sQ + lane * (D + 1));
    const float dpv = dot_row<D>(sV + warp * D, sG + lane * (D + 1));
    float p = exp2f(s * scale_log2 - sL[lane]);
    if (q >= nq || key >= nk || (causal && key > q)) p = 0.f;
    const float ds = p * (dpv - sDl[lane]);
    for (int jj = 0; jj < F32_CHUNK; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const float dsj = __shfl_sync(0xffffffffu, ds, jj);
#pragma unroll
      for (int r = 0; r < DPL; ++r) {
        av[r] = fmaf(pj, sG[jj * (D + 1) + lane + 32 * r], av[r]);
        ak[r] = fmaf(dsj, sQ[jj * (D + 1) + lane + 32 * r], ak[r]);
      }
    }
  }
  if (key < nk) {
#pragma unroll
    for (int r = 0; r < DPL; ++r) {
      dK[(bh * nk + key) * D + lane + 32 * r] = ak[r] * scale;
      dV[(bh * nk + key) * D + lane + 32 * r] = av[r];
    }
  }
}

// Delta for f32 (no workspace to zero).
template <int D>
__device__ __forceinline__ void bwd_pre_f32(const float* __restrict__ O,
                                            const float* __restrict__ dO,
                                            float* __restrict__ Delta, long long rows) {
  long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float acc = 0.f;
  for (int d = lane; d < D; d += 32) acc += O[row * D + d] * dO[row * D + d];
  acc = warp_sum(acc);
  if (lane == 0) Delta[row] = acc;
}
#endif  // !TF_SKIP_F32

}  // namespace tessera_flash

// ---------------------------------------------------------------------------------
// Entry points. Shared memory sizes (bytes) the launcher must pass, per family:
//   fwd mma.sync:  (16W*(D+8) + 4*BC*(D+8)) * 2
//   bwd mma.sync:  (2*16W*(D+8) + 4*BR*(D+8) + 16W*(BR+8)) * 2 + 16*BR
//   fwd wgmma g4:  (256*128 + 4*64*128) * 2 = 131072 (split too)
//   bwd wgmma:     (2*128*128 + 6*64*128 + 2*128*64) * 2 + 6*64*4 + 5*8 = 198184
//   fwd f32:       (2*32*(D+1) + 8*D) * 4
//   dq f32:        (2*32*(D+1) + 16*D) * 4
//   dkv f32:       (2*32*(D+1) + 16*D + 64) * 4
// Grids: fwd (ceil(nq/rows per block), B*H) with 16W (mma.sync) or 256 (wgmma g4) rows,
// times the split count in z for the split forward; bwd mma.sync (ceil(nk/16W), B*H);
// bwd wgmma one-dimensional: whole + split items x splits (see bwd_wg); f32 (ceil(n/8), B*H), 256
// threads; pre: PRE_ROWS (64) rows per block of 256 (f32: one warp per row); post: 4
// elements per thread; post_wg: one 64 x 128 fragment tile per block of 256; combine:
// one float4 of a fragment tile per thread, 256 threads.
// ---------------------------------------------------------------------------------

#define TF_FWD_TC(TN, T, D, W, BC)                                                        \
  extern "C" __global__ void __launch_bounds__(32 * W)                                    \
      flash_fwd_##TN##_d##D##_w##W##_c##BC(const T* q, const T* k, const T* v, T* o,      \
                                           float* lse, int nq, int nk, float scale_log2,  \
                                           int causal) {                                  \
    tessera_flash::fwd_tc<T, D, W, BC>(q, k, v, o, lse, nq, nk, scale_log2, causal);      \
  }

#define TF_BWD_TC(TN, T, D, W, BR)                                                        \
  extern "C" __global__ void __launch_bounds__(32 * W)                                    \
      flash_bwd_##TN##_d##D##_w##W##_r##BR(                                               \
          const T* q, const T* k, const T* v, const T* d_o, const float* lse,             \
          const float* delta, float* dq_acc, T* dk, T* dv, int nq, int nk, float scale,   \
          float scale_log2, int causal) {                                                 \
    tessera_flash::bwd_tc<T, D, W, BR>(q, k, v, d_o, lse, delta, dq_acc, dk, dv, nq, nk,  \
                                       scale, scale_log2, causal);                        \
  }

#define TF_PRE(TN, T, D)                                                                  \
  extern "C" __global__ void __launch_bounds__(tessera_flash::PRE_THREADS)                \
      flash_bwd_pre_##TN##_d##D(                                                          \
      const T* o, const T* d_o, float* delta, float* acc, long long acc_n4,               \
      long long rows) {                                                                   \
    tessera_flash::bwd_pre<T, D>(o, d_o, delta, acc, acc_n4, rows);                       \
  }

#define TF_F32(D)                                                                         \
  extern "C" __global__ void __launch_bounds__(256)                                       \
      flash_fwd_f32_d##D(const float* q, const float* k, const float* v, float* o,        \
                         float* lse, int nq, int nk, float scale_log2, int causal) {      \
    tessera_flash::fwd_f32<D>(q, k, v, o, lse, nq, nk, scale_log2, causal);               \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(256) flash_bwd_dq_f32_d##D(                \
      const float* q, const float* k, const float* v, const float* d_o, const float* lse, \
      const float* delta, float* dq, int nq, int nk, float scale, float scale_log2,       \
      int causal) {                                                                       \
    tessera_flash::bwd_dq_f32<D>(q, k, v, d_o, lse, delta, dq, nq, nk, scale, scale_log2, \
                                 causal);                                                 \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(256) flash_bwd_dkv_f32_d##D(               \
      const float* q, const float* k, const float* v, const float* d_o, const float* lse, \
      const float* delta, float* dk, float* dv, int nq, int nk, float scale,              \
      float scale_log2, int causal) {                                                     \
    tessera_flash::bwd_dkv_f32<D>(q, k, v, d_o, lse, delta, dk, dv, nq, nk, scale,        \
                                  scale_log2, causal);                                    \
  }                                                                                       \
  extern "C" __global__ void flash_bwd_pre_f32_d##D(const float* o, const float* d_o,     \
                                                    float* delta, long long rows) {       \
    tessera_flash::bwd_pre_f32<D>(o, d_o, delta, rows);                                   \
  }

#define TF_TC_DTYPE(TN, T)                                                                \
  TF_FWD_TC(TN, T, 64, 4, 64)                                                             \
  TF_FWD_TC(TN, T, 128, 4, 64)                                                            \
  TF_BWD_TC(TN, T, 64, 8, 64)                                                             \
  TF_BWD_TC(TN, T, 128, 8, 32)                                                            \
  TF_PRE(TN, T, 64)                                                                       \
  TF_PRE(TN, T, 128)                                                                      \
  extern "C" __global__ void flash_bwd_post_##TN(const float* dq_acc, T* dq, long long n, \
                                                 float scale) {                           \
    tessera_flash::bwd_post<T>(dq_acc, dq, n, scale);                                     \
  }

// A module may be compiled for one dtype only (-DTF_SKIP_BF16 -DTF_SKIP_F16 ...), which
// keeps run-time compilation short.
#if !defined(TF_SKIP_BF16)
TF_TC_DTYPE(bf16, __nv_bfloat16)
#endif
#if !defined(TF_SKIP_F16)
TF_TC_DTYPE(f16, __half)
#endif

#if !defined(TF_SKIP_F32)
TF_F32(32)
TF_F32(64)
TF_F32(96)
TF_F32(128)
TF_F32(160)
TF_F32(192)
TF_F32(224)
TF_F32(256)
#endif

// wgmma kernels exist only in an sm_90a compilation.
#if defined(TF_HAVE_WGMMA)
#define TF_WG(TN, T)                                                                      \
  extern "C" __global__ void __launch_bounds__(512, 1)                                    \
      flash_fwd_wg_##TN##_d128_g4_c64(const T* q, const T* k, const T* v, T* o, float* lse, \
                                      int nq, int nk, float scale_log2, int causal) {     \
    tessera_flash::fwd_wg<T, 4, 64, false>(q, k, v, o, lse, nullptr, nullptr, nq, nk,     \
                                           scale_log2, causal);                           \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(512, 1) flash_fwd_wg_##TN##_d128_ring(     \
      const T* q, const T* k, const T* v, T* o, float* lse, int nq, int nk,               \
      float scale_log2, int causal) {                                                     \
    tessera_flash::fwd_wg_ring<T, false>(q, k, v, o, lse, nq, nk, scale_log2, causal);    \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(512, 1) flash_fwd_wg_##TN##_d128_ring_t(   \
      const T* q, const T* k, const T* v, T* o, float* lse, int nq, int nk,               \
      float scale_log2, int causal) {                                                     \
    tessera_flash::fwd_wg_ring<T, true>(q, k, v, o, lse, nq, nk, scale_log2, causal);     \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(512, 1) flash_fwd_wg_split_##TN##_d128(    \
      const T* q, const T* k, const T* v, float* o_part, float2* ml_part, int nq, int nk, \
      float scale_log2, int causal) {                                                     \
    tessera_flash::fwd_wg<T, 4, 64, true>(q, k, v, nullptr, nullptr, o_part, ml_part, nq, \
                                          nk, scale_log2, causal);                        \
  }                                                                                       \
  extern "C" __global__ void flash_fwd_combine_##TN##_d128(                               \
      const float* o_part, const float2* ml_part, T* o, float* lse, int splits,           \
      int bh_count, int nq) {                                                             \
    tessera_flash::fwd_combine<T>(o_part, ml_part, o, lse, splits, bh_count, nq);         \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(256) flash_bwd_wg_##TN##_d128(             \
      const T* q, const T* k, const T* v, const T* d_o, const float* lse,                 \
      const float* delta, float* dq_acc, T* dk, T* dv, float* kv_acc, int* counters,      \
      int nq, int nk, float scale, float scale_log2, int causal, int whole, int splits) { \
    tessera_flash::bwd_wg<T>(q, k, v, d_o, lse, delta, dq_acc, dk, dv, kv_acc, counters,  \
                             nq, nk, scale, scale_log2, causal, whole, splits);           \
  }                                                                                       \
  extern "C" __global__ void __launch_bounds__(tessera_flash::POST_THREADS)               \
      flash_bwd_post_wg_##TN(const float* acc, T* out, int n_rows, float scale) {          \
    tessera_flash::bwd_post_wg<T>(acc, out, n_rows, scale);                               \
  }
#if !defined(TF_SKIP_BF16)
TF_WG(bf16, __nv_bfloat16)
#endif
#if !defined(TF_SKIP_F16)
TF_WG(f16, __half)
#endif
#endif
