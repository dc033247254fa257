// The DiT block's K <= 512 GEMMs on Hopper (SM90a): wgmma from TMA-loaded, 128-byte-swizzled shared
// memory, with the weight tile loaded before the PDL wait.
//   out[M, N] = a[M, K] @ w[N, K]^T (+ bias[N]) (GELU)      fp16 or bf16 in and out, fp32 accumulation
//   split-K: partials[z, M, N] = a[:, zK':(z+1)K'] @ w[:, zK':(z+1)K']^T   fp32 out, K' = K / splits <= 512
//   QKV + cache: q | k | v = a @ w^T + bias; q, k LayerNorm per 64-wide head; q -> out, k and v of each
//   row's valid frames appended to the in-place attention-cache arena
//   TF32: out[M, N] = a[M, K] @ w[N, K]^T (+ bias) (GELU), fp32 in and out, operands rounded to TF32 (round
//   to nearest, as cuBLAS's TF32 GEMMs do) by the TMA unit as it loads them, fp32 accumulation
//   row-norm: y = a @ w^T + bias; h += gate * y (fp32 residual); out = LayerNorm(h) * scale + shift, the
//   body's row-norm kernel at the attention boundary, with each row's statistics summed over a cluster
//   of the N / BN column tiles through distributed shared memory
// Measured against cuBLAS in bench/wgmma_gemm.py (bench/NOTES.md, session 16); used by the body's
// variant "v9" (torch_cfm/kernels/dit_linear_cuda.py).
//
// Design: one warpgroup per CTA computes a 64 x BN tile. The whole K (<= 512) is resident in shared
// memory, so nothing is ever overwritten: one mbarrier per K stage (128 bytes of K: 64 16-bit or 32
// fp32 elements), no "empty" barriers. fp32 tiles of the whole K do not fit beside a wide weight tile
// (a alone is 128 KB), so in TF32 only the weight tile is resident and a streams through a ring of
// kARing stages, each refilled once the wgmma that read it has completed.
// Thread 0 issues every stage's TMA load of w first, then, after griddepcontrol.wait (a no-op
// without PDL), every stage's load of a; the warpgroup waits stage by stage and issues 4 wgmma
// m64nBNk16 per stage straight from shared memory. With kPartials, grid z splits a longer K (the
// body's fc2, K = 2048) into chunks of at most 512 and each CTA writes its fp32 partial sum, which
// the row-norm kernel behind it adds up (no bias, no GELU). With kQkvCache (the block's QKV GEMM on
// the in-place arena) the epilogue does the q/k-cache kernel's work: per-head LayerNorm of q and k
// over 4-lane shuffles, q to out, k and v into the arena. An optional cluster along x multicasts each
// weight stage to consecutive row tiles (measured slower at these sizes; kept for the bench).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "wgmma_ops.cuh"  // generated wgmma m64nNk16 wrappers

namespace torch_cfm {
namespace dit_linear {

constexpr int kBM = 64;         // rows per CTA (one wgmma m64)
constexpr int kBK = 64;         // K per stage of 16-bit operands: 64 x 2 bytes = one 128-byte swizzle row
constexpr int kMaxK = 512;      // the whole K of a CTA is resident (the weight tile, and a in 16 bits)
constexpr int kMaxStages = 16;  // K = 512 in fp32: 16 stages of 32
constexpr int kARing = 4;       // TF32: stages of a in flight
constexpr int kThreads = 128;   // one warpgroup

// K elements per stage: one 128-byte swizzle row of T
template <typename T>
__host__ __device__ constexpr int stage_k() { return 128 / static_cast<int>(sizeof(T)); }

// flags
constexpr int kTriggerEarly = 1;  // griddepcontrol.launch_dependents right after the loads are issued
constexpr int kGeluTanh = 2;      // GELU, tanh form (the body's fc1 and cuBLASLt's GELU epilogue)
constexpr int kNoBias = 4;        // bias is not read (may be null)
constexpr int kEarlyLoads = 8;    // kQkvCache: the rows' T_n / L_n loaded before the epilogue's first store

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Shared-memory matrix descriptor of a K-major tile whose rows are 128 bytes, 128-byte swizzle, tile
// base 1024-byte aligned: start >> 4 in bits 0-13, leading offset (unused by this mode) 1, stride
// offset 1024 B (8 rows) >> 4 in bits 32-45, swizzle mode 1 (128 B) in bits 62-63. Stepping K by 16
// elements inside the 128-byte row adds 32 bytes (2 in >> 4 units) to the start address.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  }
}

// One 2D TMA box (64 K-elements x box rows) into shared memory, completion counted on `bar`.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int k0, int row0, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k0), "r"(row0), "r"(smem_u32(bar))
      : "memory");
}

// The same box, written to the same shared-memory offset of every CTA in `mask` (cluster ranks), each
// destination's barrier at `bar`'s offset counting the bytes it receives.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, int k0, int row0, uint64_t* bar,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(k0), "r"(row0), "r"(smem_u32(bar)), "h"(mask)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t cluster_size() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
  return r;
}

__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

// The float at `p`'s offset in the shared memory of cluster CTA `rank` (distributed shared memory).
__device__ __forceinline__ float ld_cluster_f32(const float* p, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_u32(p)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// One 32-byte K step of a stage: k16 of 16-bit operands, k8 of tf32.
template <typename T, int BN>
__device__ __forceinline__ void wgmma_step(float* d, uint64_t da, uint64_t db, int scale_d) {
  if constexpr (std::is_same<T, float>::value) {
    static_assert(BN <= 96, "TF32 tiles are at most 96 wide");
    if constexpr (BN == 32) wgmma_m64n32k8_tf32(d, da, db, scale_d);
    else if constexpr (BN == 64) wgmma_m64n64k8_tf32(d, da, db, scale_d);
    else wgmma_m64n96k8_tf32(d, da, db, scale_d);
  } else if constexpr (std::is_same<T, __half>::value) {
    if constexpr (BN == 32) wgmma_m64n32k16_f16(d, da, db, scale_d);
    else if constexpr (BN == 64) wgmma_m64n64k16_f16(d, da, db, scale_d);
    else if constexpr (BN == 96) wgmma_m64n96k16_f16(d, da, db, scale_d);
    else wgmma_m64n128k16_f16(d, da, db, scale_d);
  } else {
    if constexpr (BN == 32) wgmma_m64n32k16_bf16(d, da, db, scale_d);
    else if constexpr (BN == 64) wgmma_m64n64k16_bf16(d, da, db, scale_d);
    else if constexpr (BN == 96) wgmma_m64n96k16_bf16(d, da, db, scale_d);
    else wgmma_m64n128k16_bf16(d, da, db, scale_d);
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }

// Two adjacent output columns (p 4-byte aligned for 16-bit T, 8-byte for fp32).
template <typename T>
__device__ __forceinline__ void store_pair(T* p, float x0, float x1) {
  if constexpr (std::is_same<T, float>::value) {
    *reinterpret_cast<float2*>(p) = make_float2(x0, x1);
  } else {
    T pair[2] = {from_float<T>(x0), from_float<T>(x1)};
    *reinterpret_cast<uint32_t*>(p) = *reinterpret_cast<uint32_t*>(pair);
  }
}

__device__ __forceinline__ float gelu_tanh(float x) {
  return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// 1 where this build carries the sm_90a code (the wgmma kernel is empty elsewhere).
__global__ void probe_kernel(int* flag) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *flag = 1;
#else
  *flag = 0;
#endif
}

// epilogue modes
constexpr int kOut = 0;       // out (M, ldo) in T
constexpr int kPartials = 1;  // split-K: fp32 partial sums (splits, M, ldo)
constexpr int kQkvCache = 2;  // the QKV GEMM of a block on the in-place cache arena (see QkvCacheArgs)
constexpr int kRowNorm = 3;   // the GEMM in front of a row-norm, the row-norm in its epilogue (see RowNormArgs)

// kQkvCache: the columns of w are q | k | v, each heads x 64 wide. Queries (every row) are LayerNormed
// per head and written to out (M, heads * 64); keys (LayerNormed) and values of row r = n * t_len + t
// go to frame cached[n] + valid[n] - 1 - t of the arena block (N, heads, P, 128) for t < valid[n]
// (keys at channels [0, 64), values at [64, 128)), the reversed key order of
// torch_cfm.kernels.dit_body's APPEND mode; nothing else is written.
template <typename T>
struct QkvCacheArgs {
  const T* qn_w = nullptr;  // (64,) q LayerNorm affine
  const T* qn_b = nullptr;
  const T* kn_w = nullptr;  // (64,) k LayerNorm affine
  const T* kn_b = nullptr;
  T* cache = nullptr;       // arena block (N, heads, P, 128), unit channel stride
  int64_t s_n = 0, s_h = 0, s_f = 0;  // its strides, elements
  const int* valid = nullptr;   // (N,) clamped T_n
  const int* cached = nullptr;  // (N,) clamped L_n
  int t_len = 1, heads = 1;
  float eps = 1e-6f;
};

// kRowNorm (the body's proj GEMM and the row-norm behind it, kernels/dit_body.py's `rownorm` with a gate,
// the residual, adaLN modulation and head frames): the launch is a cluster of the N / BN column tiles of
// each 64-row block (N = C <= 8 BN), so that the CTAs of a cluster hold whole rows. Row r = n t_len + t:
//   y = acc + bias;  h[r] += gate[n] * y (written back);  z = (h[r] - mean) * rstd * scale[n] + shift[n]
//   out row n out_t + out_off + t <- z; for t == 0 also out rows n out_t + {0, 1} <- the old conv cache
//   cnn[n, cbase + c, {0, 1}] (zeros without one)
// where gate / shift / scale are the table row of n (table + n * stride_tab) at the element offsets given
// (the table stores 1 + scale), mean and rstd fp32 over the C columns, summed across the cluster.
template <typename T>
struct RowNormArgs {
  float* h = nullptr;            // (M, C) fp32 residual stream, read and written
  const float* table = nullptr;  // modulation table rows
  int64_t stride_tab = 0;        // elements between the rows of sequences n, n + 1 (0: one row for all)
  int gate_off = 0, shift_off = 0, scale_off = 0;
  int out_t = 1, out_off = 0;    // out row of token (n, t): n * out_t + out_off + t
  const T* cnn = nullptr;        // (N, >= cbase + C, 2) old conv cache, or null (zeros) [head frames]
  int64_t cnn_s_n = 0, cnn_s_c = 0, cnn_s_j = 0;
  int cnn_cbase = 0;
  int head = 0;                  // 1: write the 2 head frames of each sequence
  int t_len = 1;
  float eps = 1e-6f;
};

// LayerNorm statistics of a cluster's rows (kRowNorm): this thread holds kV values of each of
// rows 16 warp + lane / 4 (+ 8) (x[0], x[1]); the 4 lanes of a row, then the cluster's CTAs (its columns,
// through distributed shared memory: red[pass] of every peer) add them up; c_all values per row. Two
// passes, mean then the squared deviations about it, in two arrays so that no CTA overwrites what a peer
// may still be reading. The caller keeps every CTA resident until its peers are done (a last cluster barrier).
template <int kV>
__device__ __forceinline__ void cluster_row_stats(const float (&x)[2][kV], float (&red)[2][kBM], int c_all, float eps,
                                                  float (&mean)[2], float (&rstd)[2]) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t tiles = cluster_size();
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < kV; ++i) {
        const float v = pass == 0 ? x[h][i] : x[h][i] - mean[h];
        s += pass == 0 ? v : v * v;
      }
      s += __shfl_xor_sync(0xffffffffu, s, 1);
      s += __shfl_xor_sync(0xffffffffu, s, 2);
      if (lane % 4 == 0) red[pass][16 * warp + lane / 4 + 8 * h] = s;
    }
    cluster_sync();  // every CTA's red[pass] is written (and visible cluster-wide)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float total = 0.f;
      for (uint32_t c = 0; c < tiles; ++c) total += ld_cluster_f32(&red[pass][16 * warp + lane / 4 + 8 * h], c);
      if (pass == 0) {
        mean[h] = total / c_all;
      } else {
        rstd[h] = rsqrtf(total / c_all + eps);
      }
    }
  }
}

// Dynamic shared memory for `stages` K stages: the weight tile's stages, a's (16-bit) or a's ring (fp32),
// + alignment slack for the 1024-byte swizzle atoms.
template <typename T, int BN>
constexpr int smem_bytes(int stages) {
  const int a_stages = std::is_same<T, float>::value ? (stages < kARing ? stages : kARing) : stages;
  return (stages * BN + a_stages * kBM) * 128 + 1024;
}

// grid (ceil(M / 64) rounded up to the cluster size, N / BN, splits), kThreads threads,
// smem_bytes<T, BN>(k / stage_k<T>()) dynamic shared memory; an optional cluster of 1-8 CTAs along x (16-bit
// only). k is the K of one CTA (the whole K, or one split's chunk): CTA z reads columns [z k, (z + 1) k)
// of a and w. T = float is the TF32 form (the tensor maps round to TF32 as they load).
// out: (M, ldo) in T (kOut; kQkvCache: the queries), or with kPartials (splits, M, ldo) in fp32, split z
// at z * M * ldo.
template <typename T, int BN, int kMode, bool kEarly = false>
__global__ void __launch_bounds__(kThreads) linear_kernel(const __grid_constant__ CUtensorMap map_a,
                                                              const __grid_constant__ CUtensorMap map_w,
                                                              const T* __restrict__ bias, void* __restrict__ out,
                                                              int m, int ldo, int k, int flags,
                                                              const QkvCacheArgs<T> qc, const RowNormArgs<T> rn) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma needs the sm_90a target
  constexpr bool kTf32 = std::is_same<T, float>::value;
  extern __shared__ unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t full[kMaxStages];
  __shared__ __align__(8) uint64_t a_full[kARing];  // TF32: a's ring
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~static_cast<uintptr_t>(1023));
  constexpr int kABytes = kBM * 128;  // one stage: 128 bytes of K per row
  constexpr int kWBytes = BN * 128;
  const int stages = k / stage_k<T>();
  unsigned char* sw = smem;                     // stages x (BN x 128 B), each 1024-aligned
  unsigned char* sa = smem + stages * kWBytes;  // stages (TF32: kARing slots) x (64 x 128 B)
  const int m0 = blockIdx.x * kBM;
  const int n0 = blockIdx.y * BN;
  const int k0 = blockIdx.z * k;
  const int tid = threadIdx.x;

  // A cluster (launch attribute, 1-8 CTAs along grid x = consecutive row tiles of one column tile)
  // shares the weight tile: CTA r loads the stages s with s % size == r and multicasts them to all.
  // (kRowNorm's clusters, along y, share row statistics instead: no multicast.)
  const uint32_t csize = kMode == kRowNorm ? 1 : cluster_size(), crank = kMode == kRowNorm ? 0 : cluster_rank();
  if (tid == 0) {
    for (int s = 0; s < stages; ++s) mbar_init(&full[s], 1);
    if constexpr (kTf32) {
      for (int r = 0; r < kARing; ++r) mbar_init(&a_full[r], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  if (csize > 1) {  // every peer's barriers exist before anyone multicasts into them
    cluster_arrive();
    cluster_wait();
  } else {
    __syncthreads();
  }
  if (tid == 0) {
    // Weights never depend on the kernel in front: they load before the PDL wait.
    for (int s = 0; s < stages; ++s) {
      mbar_expect_tx(&full[s], kTf32 ? kWBytes : kABytes + kWBytes);
      if (csize == 1) {
        tma_load_2d(sw + s * kWBytes, &map_w, k0 + s * stage_k<T>(), n0, &full[s]);
      } else if (s % csize == crank) {
        tma_load_2d_multicast(sw + s * kWBytes, &map_w, k0 + s * stage_k<T>(), n0, &full[s],
                              static_cast<uint16_t>((1u << csize) - 1));
      }
    }
  }
  const int warp = tid / 32, lane = tid % 32;
  const int col0 = n0 + 2 * (lane % 4);
  float bias_v[BN / 4];  // this thread's bias pairs: columns col0 + 8j + {0, 1}
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
    bias_v[2 * j] = (flags & kNoBias) ? 0.f : to_float(bias[col0 + 8 * j]);
    bias_v[2 * j + 1] = (flags & kNoBias) ? 0.f : to_float(bias[col0 + 8 * j + 1]);
  }
  // kQkvCache: this tile's kind (0 q, 1 k, 2 v; a tile never straddles two, heads * 64 % BN == 0), its
  // first head, and this thread's 16 LayerNorm weights (head columns 8jj + 2(lane%4) + {0,1})
  int kind = 0, head0 = 0;
  float norm_w[16], norm_b[16];
  if constexpr (kMode == kQkvCache) {
    static_assert(BN % 64 == 0, "kQkvCache tiles hold whole 64-wide heads");
    const int inner = qc.heads * 64;
    kind = n0 / inner;
    head0 = (n0 - kind * inner) / 64;
    const T* nw = kind == 0 ? qc.qn_w : qc.kn_w;
    const T* nb = kind == 0 ? qc.qn_b : qc.kn_b;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      const int c = 8 * (i / 2) + 2 * (lane % 4) + (i % 2);
      norm_w[i] = kind < 2 ? to_float(nw[c]) : 1.f;
      norm_b[i] = kind < 2 ? to_float(nb[c]) : 0.f;
    }
  }
  pdl_wait();  // a (and out, which the kernel in front may still read) only after this
  constexpr int kSk = stage_k<T>();
  if (tid == 0) {
    if constexpr (kTf32) {  // the first kARing stages of a; the rest as the ring's slots free up
      for (int s = 0; s < stages && s < kARing; ++s) {
        mbar_expect_tx(&a_full[s], kABytes);
        tma_load_2d(sa + s * kABytes, &map_a, k0 + s * kSk, m0, &a_full[s]);
      }
    } else {
      for (int s = 0; s < stages; ++s) tma_load_2d(sa + s * kABytes, &map_a, k0 + s * kSk, m0, &full[s]);
    }
  }
  if (flags & kTriggerEarly) pdl_trigger();

  float d[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) d[i] = 0.f;
  for (int s = 0; s < stages; ++s) {
    mbar_wait(&full[s], 0);
    const int slot = kTf32 ? s % kARing : s;
    if constexpr (kTf32) mbar_wait(&a_full[slot], (s / kARing) & 1);
    wgmma_fence();
    const uint64_t da = desc_sw128(smem_u32(sa + slot * kABytes));
    const uint64_t dw = desc_sw128(smem_u32(sw + s * kWBytes));
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_step<T, BN>(d, da + 2 * kk, dw + 2 * kk, 1);  // 4 x 32 bytes of K
    wgmma_commit();
    if constexpr (kTf32) {
      // Stage s - 1's wgmma has completed once at most one group (stage s's) is pending: every thread
      // has seen that before thread 0 loads stage s - 1 + kARing into its slot.
      if (s >= 1 && s - 1 + kARing < stages) {
        wgmma_wait_1();
        __syncthreads();
        if (tid == 0) {
          const int r = (s - 1) % kARing;
          mbar_expect_tx(&a_full[r], kABytes);
          tma_load_2d(sa + r * kABytes, &map_a, k0 + (s - 1 + kARing) * kSk, m0, &a_full[r]);
        }
      }
    }
  }
  wgmma_wait_all();
  if (!(flags & kTriggerEarly)) pdl_trigger();
  // Every multicast into this CTA has landed (all its stages completed); a CTA leaves only after its
  // peers have received what it issued to them.
  if (csize > 1) cluster_arrive();

  // Accumulator layout of m64nN: warp w holds rows 16w + lane/4 (+8); register 4j + {0,1} holds
  // columns 8j + 2(lane%4) + {0,1} of the first row, 4j + {2,3} the same columns of the second.
  const int r0 = m0 + 16 * warp + lane / 4;
  if constexpr (kMode == kQkvCache) {
    // kEarly (the host's kEarlyLoads flag): k/v tiles load the two rows' T_n and L_n here. Loaded where
    // they are used, after the previous head's stores, they cost a dependent round trip per head (no load
    // moves past a store that may alias it; see kRowNorm's epilogue below). A template parameter, so that
    // the default instantiation is the code measured before it existed.
    int valid_n[2] = {0, 0}, cached_n[2] = {0, 0};
    if (kEarly && kind > 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
        if (r < m) {
          valid_n[h] = qc.valid[r / qc.t_len];
          cached_n[h] = qc.cached[r / qc.t_len];
        }
      }
    }
#pragma unroll
    for (int hh = 0; hh < BN / 64; ++hh) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = r0 + 8 * h;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int j = 8 * hh + i / 2;
          x[i] = d[4 * j + 2 * h + (i % 2)] + bias_v[2 * j + (i % 2)];
        }
        if (kind < 2) {  // LayerNorm over the head's 64 columns: 16 here, the rest in lanes lane ^ 1, 2, 3
          float sum = 0.f;
#pragma unroll
          for (int i = 0; i < 16; ++i) sum += x[i];
          sum += __shfl_xor_sync(0xffffffffu, sum, 1);
          sum += __shfl_xor_sync(0xffffffffu, sum, 2);
          const float mean = sum * (1.f / 64.f);
          float sq = 0.f;
#pragma unroll
          for (int i = 0; i < 16; ++i) {
            x[i] -= mean;
            sq += x[i] * x[i];
          }
          sq += __shfl_xor_sync(0xffffffffu, sq, 1);
          sq += __shfl_xor_sync(0xffffffffu, sq, 2);
          const float rstd = rsqrtf(sq * (1.f / 64.f) + qc.eps);
#pragma unroll
          for (int i = 0; i < 16; ++i) x[i] = x[i] * rstd * norm_w[i] + norm_b[i];
        }
        if (r >= m) continue;
        T* dst;
        if (kind == 0) {
          dst = static_cast<T*>(out) + static_cast<int64_t>(r) * ldo + (head0 + hh) * 64;
        } else {
          const int n = r / qc.t_len, t = r - n * qc.t_len;
          const int tn = kEarly ? valid_n[h] : qc.valid[n];
          if (t >= tn) continue;  // padding frames are not cached
          const int64_t pos = (kEarly ? cached_n[h] : qc.cached[n]) + tn - 1 - t;
          dst = qc.cache + n * qc.s_n + (head0 + hh) * qc.s_h + pos * qc.s_f + (kind == 2 ? 64 : 0);
        }
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          store_pair(dst + 8 * jj + 2 * (lane % 4), x[2 * jj], x[2 * jj + 1]);
        }
      }
    }
  }
  if constexpr (kMode == kRowNorm) {
    // This thread's values of rows r0 and r0 + 8: columns col0 + 8j + {0, 1}, j < BN / 8. Row sums go
    // through shared memory to the cluster: red[0] the sums, red[1] the squared deviations (two arrays,
    // so that no CTA overwrites what a peer may still be reading).
    __shared__ float red[2][kBM];
    const int c_all = ldo;                  // C: the GEMM's N, the width of h and out
    // Every global load of a phase is issued before its first store: the compiler may not move a load
    // past a store that could alias it, so interleaved loads and stores would cost one dependent memory
    // round trip per column pair (session 19: 11.7 µs per call that way, against 3.6 + 2.0 for the GEMM
    // and the row-norm kernel it replaces).
    float x[2][BN / 4], gate[2][BN / 4];
    const float* tab[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      const int n = (r < m ? r : m - 1) / rn.t_len;
      tab[h] = rn.table + n * rn.stride_tab;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int col = col0 + 8 * j;
        gate[h][2 * j] = tab[h][rn.gate_off + col];
        gate[h][2 * j + 1] = tab[h][rn.gate_off + col + 1];
        float2 old = make_float2(0.f, 0.f);
        if (r < m) old = *reinterpret_cast<const float2*>(rn.h + static_cast<int64_t>(r) * c_all + col);
        x[h][2 * j] = old.x;
        x[h][2 * j + 1] = old.y;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        x[h][2 * j] += (d[4 * j + 2 * h] + bias_v[2 * j]) * gate[h][2 * j];
        x[h][2 * j + 1] += (d[4 * j + 2 * h + 1] + bias_v[2 * j + 1]) * gate[h][2 * j + 1];
      }
    }
    // the adaLN factors, loaded here so that they arrive during the statistics' cluster barriers
    float scale[2][BN / 4], shift[2][BN / 4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < BN / 4; ++i) {
        const int col = col0 + 8 * (i / 2) + (i % 2);
        scale[h][i] = tab[h][rn.scale_off + col];
        shift[h][i] = tab[h][rn.shift_off + col];
      }
    }
    float mean[2], rstd[2];
    cluster_row_stats<BN / 4>(x, red, c_all, rn.eps, mean, rstd);
    // h only now: the statistics' release barriers would otherwise wait for these stores to drain
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        if (r < m) store_pair(rn.h + static_cast<int64_t>(r) * c_all + col0 + 8 * j, x[h][2 * j], x[h][2 * j + 1]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      if (r >= m) continue;
      const int n = r / rn.t_len, t = r - n * rn.t_len;
      T* orow = static_cast<T*>(out) + (static_cast<int64_t>(n) * rn.out_t + rn.out_off + t) * c_all;
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const int i = 2 * j;
        store_pair(orow + col0 + 8 * j, (x[h][i] - mean[h]) * rstd[h] * scale[h][i] + shift[h][i],
                   (x[h][i + 1] - mean[h]) * rstd[h] * scale[h][i + 1] + shift[h][i + 1]);
      }
      if (rn.head && t == 0) {  // history frames 0, 1 of sequence n <- the old conv cache (zeros without)
        float frames[2][BN / 4];  // all loads, then all stores (see above)
#pragma unroll
        for (int f = 0; f < 2; ++f) {
#pragma unroll
          for (int i = 0; i < BN / 4; ++i) {
            const int col = col0 + 8 * (i / 2) + (i % 2);
            frames[f][i] = rn.cnn == nullptr ? 0.f
                           : to_float(rn.cnn[n * rn.cnn_s_n + (rn.cnn_cbase + col) * rn.cnn_s_c + f * rn.cnn_s_j]);
          }
        }
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          T* frow = static_cast<T*>(out) + (static_cast<int64_t>(n) * rn.out_t + f) * c_all;
#pragma unroll
          for (int j = 0; j < BN / 8; ++j) store_pair(frow + col0 + 8 * j, frames[f][2 * j], frames[f][2 * j + 1]);
        }
      }
    }
    // No CTA leaves while a peer may still read its red[1]. Relaxed: this barrier orders no memory (every
    // peer has consumed its remote loads before arriving), and a release would wait for the stores above.
    cluster_arrive_relaxed();
    cluster_wait();
  }
  float* part = kMode == kPartials ? static_cast<float*>(out) + static_cast<int64_t>(blockIdx.z) * m * ldo : nullptr;
#pragma unroll
  for (int j = 0; j < (kMode == kQkvCache || kMode == kRowNorm ? 0 : BN / 8); ++j) {
    const int col = col0 + 8 * j;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      float x0 = d[4 * j + 2 * h] + bias_v[2 * j], x1 = d[4 * j + 2 * h + 1] + bias_v[2 * j + 1];
      if (flags & kGeluTanh) {
        x0 = gelu_tanh(x0);
        x1 = gelu_tanh(x1);
      }
      if (r < m) {
        if constexpr (kMode == kPartials) {
          store_pair(part + static_cast<int64_t>(r) * ldo + col, x0, x1);
        } else {
          store_pair(static_cast<T*>(out) + static_cast<int64_t>(r) * ldo + col, x0, x1);
        }
      }
    }
  }
  if (csize > 1) cluster_wait();
#endif
}

}  // namespace dit_linear
}  // namespace torch_cfm
