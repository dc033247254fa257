// The DiT block's K <= 512 GEMMs on Hopper (SM90a): wgmma from TMA-loaded, 128-byte-swizzled shared
// memory, with the weight tile loaded before the PDL wait.
//   out[M, N] = a[M, K] @ w[N, K]^T (+ bias[N]) (GELU)      fp16 or bf16 in and out, fp32 accumulation
//   split-K: partials[z, M, N] = a[:, zK':(z+1)K'] @ w[:, zK':(z+1)K']^T   fp32 out, K' = K / splits <= 512
//   QKV + cache: q | k | v = a @ w^T + bias; q, k LayerNorm per 64-wide head; q -> out, k and v of each
//   row's valid frames appended to the in-place attention-cache arena
//   TF32: out[M, N] = a[M, K] @ w[N, K]^T (+ bias) (GELU), fp32 in and out, operands rounded to TF32 (round
//   to nearest, as cuBLAS's TF32 GEMMs do) by the TMA unit as it loads them, fp32 accumulation
// Used by the body's wgmma plans (torch_cfm/kernels/body_plans.py, via torch_cfm/kernels/dit_linear_cuda.py);
// bench/wgmma_gemm.py times it against cuBLAS.
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
// the row-norm kernel behind it adds up (no bias, no GELU). With kQkvCache (the block's 16-bit QKV GEMM
// on the in-place arena) the epilogue does the q/k-cache kernel's work: per-head LayerNorm of q and k
// over 4-lane shuffles, q to out, k and v into the arena. An optional cluster along x multicasts each
// weight stage to consecutive row tiles (slower at the body's sizes; the bench times it).
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
template <typename T, int BN, int kMode>
__global__ void __launch_bounds__(kThreads) linear_kernel(const __grid_constant__ CUtensorMap map_a,
                                                              const __grid_constant__ CUtensorMap map_w,
                                                              const T* __restrict__ bias, void* __restrict__ out,
                                                              int m, int ldo, int k, int flags,
                                                              const QkvCacheArgs<T> qc) {
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
  const uint32_t csize = cluster_size(), crank = cluster_rank();
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
    // k/v tiles load the two rows' T_n and L_n before the first store: loaded where they are used, after
    // the previous head's stores, they would cost a dependent round trip per head (no load moves past a
    // store that may alias it).
    int valid_n[2] = {0, 0}, cached_n[2] = {0, 0};
    if (kind > 0) {
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
          const int tn = valid_n[h];
          if (t >= tn) continue;  // padding frames are not cached
          const int64_t pos = cached_n[h] + tn - 1 - t;
          dst = qc.cache + n * qc.s_n + (head0 + hh) * qc.s_h + pos * qc.s_f + (kind == 2 ? 64 : 0);
        }
#pragma unroll
        for (int jj = 0; jj < 8; ++jj) {
          store_pair(dst + 8 * jj + 2 * (lane % 4), x[2 * jj], x[2 * jj + 1]);
        }
      }
    }
  }
  float* part = kMode == kPartials ? static_cast<float*>(out) + static_cast<int64_t>(blockIdx.z) * m * ldo : nullptr;
#pragma unroll
  for (int j = 0; j < (kMode == kQkvCache ? 0 : BN / 8); ++j) {
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
