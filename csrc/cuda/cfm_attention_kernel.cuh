// cfm_attention forward as a hand-written CUDA kernel (mma.sync, SM80+), for the shapes where the
// Triton kernel is latency-bound: one CTA per (row, head, query tile) whose warps split the key
// walk among themselves and merge (m, l, O) through shared memory, so the serial chain per warp is
// 1-2 key tiles instead of the row's whole key range (docs/performance.md).
//
// Layout of one CTA: WQ query groups of 16 queries × WK key splits = WQ·WK warps. Key tiles of BK
// keys are dealt round-robin to the splits (split s walks tiles s, s + WK, ...). Each split's WQ
// warps load its own tiles with cp.async (NBUF in flight) and meet at a named barrier, so a split
// starts as soon as its first tile has landed. Each warp runs FlashAttention-2's online softmax
// over its tiles; then the splits merge: one max per query, rescale, sum.
//
// C > 1 (SM90): a cluster of C CTAs holds C consecutive query tiles of one (row, head), which read
// the same keys. Each K/V row is fetched from L2 once, by one CTA, as a bulk copy multicast into
// every CTA of the cluster (cp.async.bulk .multicast::cluster, completion on an mbarrier per tile):
// L2 reads drop C-fold. At docs/design.md §7's small shapes every SM's copies together are bound by L2's total
// read rate (docs/performance.md). A cluster walks its tiles in rounds of NBUF tiles per
// split, with a cluster barrier between rounds (one round at K <= WK·BK·NBUF).
//
// Semantics are docs/design.md §4 (the Triton kernel's): keys >= key_lengths[n] (clamped to [0, K]) are never
// read (cp.async zero-fills them; the bulk-copy path skips them and zeroes V's rows, K's are masked,
// so NaN padding cannot leak), masked keys get probability 0, and a query with no valid key gets
// exactly 0 (exponents are taken against 0 instead of -inf).
//
// Requirements checked by the Python side (kernels/cfm_attention_cuda.py::not_supported_reasons):
// D == 64 (the instantiated head dim), unit stride along D, 16-byte aligned base pointers and
// strides for q/k/v; out is the op's own contiguous (N, Q, H, D) buffer. No torch headers here, so
// the kernel compiles standalone with nvcc (register checks: nvcc -Xptxas -v).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "cfm_attention_params.h"

namespace torch_cfm {
namespace cuda_attention {


__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
// *p when p is not null, else `fallback`, without a branch (a branch would end the basic block
// and pull the value's first use, and its wait, in front of the copies issued after it).
__device__ __forceinline__ int load_or(const int32_t* p, int offset, int fallback) {
  int v = fallback;
  asm volatile(
      "{\n .reg .pred has;\n setp.ne.u64 has, %1, 0;\n @has ld.global.nc.b32 %0, [%2];\n}\n"
      : "+r"(v)
      : "l"(p), "l"(reinterpret_cast<uintptr_t>(p) + 4 * static_cast<int64_t>(offset)));
  return v;
}
// min(max(x, 0), hi) as volatile asm, so the compiler keeps it (and the wait for x) in program
// order behind the copies issued before it.
__device__ __forceinline__ int clamp_in_order(int x, int hi) {
  int y;
  asm volatile("{\n max.s32 %0, %1, 0;\n min.s32 %0, %0, %2;\n}\n" : "=r"(y) : "r"(x), "r"(hi));
  return y;
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// An fp32 value as a TF32 mma operand: the tensor core reads the top 19 bits (round toward zero),
// as Triton's TF32 dots do; a cvt.rna per operand cost more than the dots at these sizes.
__device__ __forceinline__ uint32_t tf32_operand(float x) { return __float_as_uint(x); }

// Per-dtype pieces: the m16n8kK MMA, the P conversion and the output store.

// c += a · b for one m16n8kK tile; SUFFIX is the PTX shape and types, e.g. "m16n8k16.row.col.f32.f16.f16.f32".
#define TORCH_CFM_MMA_SYNC(SUFFIX, c, a, b0, b1)                                                         \
  asm volatile("mma.sync.aligned." SUFFIX " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"    \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                           \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

// Two fp32 values as one register of two 16-bit values (round to nearest).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
struct Mma;

template <>
struct Mma<__half> {
  static constexpr int K = 16;
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    TORCH_CFM_MMA_SYNC("m16n8k16.row.col.f32.f16.f16.f32", c, a, b0, b1);
  }
};

template <>
struct Mma<__nv_bfloat16> {
  static constexpr int K = 16;
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    TORCH_CFM_MMA_SYNC("m16n8k16.row.col.f32.bf16.bf16.f32", c, a, b0, b1);
  }
};

template <>
struct Mma<float> {
  static constexpr int K = 8;
  __device__ __forceinline__ static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    TORCH_CFM_MMA_SYNC("m16n8k8.row.col.f32.tf32.tf32.f32", c, a, b0, b1);
  }
};
#undef TORCH_CFM_MMA_SYNC

// Four consecutive outputs (16-byte aligned for fp32, 8-byte for 16-bit).
template <typename T>
__device__ __forceinline__ void store4(T* dst, float a, float b, float c, float d) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(a, b, c, d);
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<T>(a, b), pack2<T>(c, d));
  }
}

// mbarrier and bulk-copy primitives of the C > 1 path (SM90 PTX). Older targets compile them as
// traps: the C > 1 instantiations exist there but the Python side never launches them (clusters
// need SM90).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TORCH_CFM_SM90_ONLY(...) __trap()
#else
#define TORCH_CFM_SM90_ONLY(...) __VA_ARGS__
#endif
__device__ __forceinline__ void mbarrier_init(uint32_t bar, int count) {
  TORCH_CFM_SM90_ONLY(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory"));
}
__device__ __forceinline__ void mbarrier_expect_tx(uint32_t bar, uint32_t bytes) {
  TORCH_CFM_SM90_ONLY(
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory"));
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  TORCH_CFM_SM90_ONLY(asm volatile(
      "{\n .reg .pred done;\n WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory"));
}
// `bytes` from global `src` to shared offset `dst` of every CTA in `cta_mask`, each completing on
// the mbarrier at offset `bar` of its own shared memory.
__device__ __forceinline__ void bulk_copy_multicast(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                                    uint16_t cta_mask) {
  TORCH_CFM_SM90_ONLY(asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1], %2, [%3], "
      "%4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(cta_mask)
      : "memory"));
}
__device__ __forceinline__ void fence_mbarrier_init() {
  TORCH_CFM_SM90_ONLY(asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"));
}
// Orders this thread's generic-proxy shared-memory writes before later bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  TORCH_CFM_SM90_ONLY(asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"));
}
__device__ __forceinline__ void cluster_sync_all() {
  TORCH_CFM_SM90_ONLY(
      asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory"));
}
#undef TORCH_CFM_SM90_ONLY

// KVG = 2 waits for each tile's K before its V (two cp.async groups, or two mbarriers), so a split's
// score dot and softmax run while its V tile is still landing; KVG = 1 waits for both at once.
template <typename T, int D, int BK, int WQ, int WK, int NBUF, int C, int KVG>
__global__ void __launch_bounds__(WQ * WK * 32, 1) cfm_attention_fwd_kernel(const Params p) {
  using G = Geometry<sizeof(T), D, BK, WQ, WK, NBUF, C>;
  static_assert(C == 1 || C == 2 || C == 4, "cluster of 1, 2 or 4 CTAs");
  static_assert(KVG == 1 || KVG == 2, "K and V in one or two copy groups per tile");
  static_assert(C == 1 || KVG == 2, "the multicast path waits for K and V separately");
  static_assert(BK % 16 == 0 && D % 16 == 0, "tiles are whole MMA steps");
  constexpr int kChunk = 16 / sizeof(T);  // elements per 16-byte copy
  constexpr int kMmaK = Mma<T>::K;
  constexpr bool kTf32 = sizeof(T) == 4;

  extern __shared__ __align__(16) unsigned char smem[];
  T* q_s = reinterpret_cast<T*>(smem);
  T* kv_s = reinterpret_cast<T*>(smem + G::kQBytes);
  float* red_s = reinterpret_cast<float*>(smem + G::kQBytes + G::kRedOffset);
  float* stat_s = reinterpret_cast<float*>(smem + G::kQBytes + G::kMainBytes);
  const uint32_t bar_s = smem_addr(smem + G::kQBytes + G::kMainBytes + G::kStatBytes);

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int wq = warp % WQ, split = warp / WQ;
  const int g = lane / 4, t = lane % 4;

  if constexpr (C > 1) {
    // Every CTA's mbarriers exist before any CTA of the cluster multicasts into them.
    if (tid < WK * NBUF * 2) mbarrier_init(bar_s + 8 * tid, 1);
    fence_mbarrier_init();
    cluster_sync_all();
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch (a no-op unless launched with the attribute): wait for the
  // previous kernel's writes before the first global read, and let the next kernel get scheduled.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif
  // C > 1: the cluster's CTA `rank` takes query tile C · (cluster's tile group) + rank; a tile past
  // the last holds no queries (it loads and stores nothing of its own, and still takes its share
  // of the copies).
  const int rank = C > 1 ? static_cast<int>(blockIdx.x % C) : 0;
  const int work = C > 1 ? static_cast<int>(blockIdx.x / C) : static_cast<int>(blockIdx.x);
  const int tile_groups = (p.q_tiles + C - 1) / C;
  const int q_tile = (work % tile_groups) * C + rank;
  const int row_head = work / tile_groups;
  const int n = row_head / p.n_heads, h = row_head % p.n_heads;
  const int q0 = q_tile * G::kQRows;

  // key_lengths[n] is loaded first and its value used only after the Q copies are issued, so its
  // round trip overlaps theirs.
  const int len_loaded = load_or(p.key_lengths, n, p.k_len);
  int kv_row = n;
  if (p.kv_rows != nullptr) kv_row = min(max(p.kv_rows[n], 0), p.n_pool - 1);

  const T* q_base = static_cast<const T*>(p.q) + n * p.q_sn + h * p.q_sh;
  const T* k_base = static_cast<const T*>(p.k) + kv_row * p.k_sn + h * p.k_sh;
  const T* v_base = static_cast<const T*>(p.v) + kv_row * p.v_sn + h * p.v_sh;

  // Q tile: queries past Q are zero-filled (their results are never stored).
  {
    constexpr int kChunksPerRow = D / kChunk;
    constexpr int kRowsPerPass = G::kThreads / kChunksPerRow;
    const int r0 = tid / kChunksPerRow, col0 = (tid % kChunksPerRow) * kChunk;
#pragma unroll
    for (int r = r0; r < G::kQRows; r += kRowsPerPass) {
      const bool ok = q0 + r < p.q_len;
      cp_async16(q_s + r * G::kRow + col0, ok ? q_base + (q0 + r) * p.q_sq + col0 : q_base, ok ? 16 : 0);
    }
  }
  cp_async_commit();  // the Q tile's group

  const int len = clamp_in_order(len_loaded, p.k_len);
  const int tiles = (len + BK - 1) / BK;
  // Split `split` walks tiles split, split + WK, ...: its own pipeline of NBUF buffers, loaded by
  // its own WQ warps and synchronised with a named barrier (C = 1) or its buffers' mbarriers
  // (C > 1), so a split starts on its first tile as soon as that tile has landed.
  const int my_tiles = split < tiles ? (tiles - split + WK - 1) / WK : 0;
  constexpr int kSplitThreads = WQ * 32;
  const int stid = tid - split * kSplitThreads;
  T* split_kv = kv_s + split * (NBUF * 2 * BK * G::kRow);

  // Copy geometry (C = 1): a split's threads cover kRowsPerPass rows of 16-byte chunks per pass, so
  // each thread copies the same column of rows r0, r0 + kRowsPerPass, ... in every tile; its global
  // addresses advance by constant steps (a few instructions per copy instead of index math).
  constexpr int kChunksPerRow = D / kChunk;
  constexpr int kRowsPerPass = kSplitThreads / kChunksPerRow;
  static_assert(kSplitThreads % kChunksPerRow == 0 && BK % kRowsPerPass == 0, "whole copy passes per tile");
  const int r0 = stid / kChunksPerRow, col0 = (stid % kChunksPerRow) * kChunk;

  // The split's i-th tile's K or V rows into buffer i % NBUF: rows at or past len are zero-filled.
  auto copy_rows = [&](int i, bool is_v) {
    const int key_first = (i * WK + split) * BK + r0;
    const T* base = is_v ? v_base : k_base;
    const int64_t stride = is_v ? p.v_sk : p.k_sk;
    const T* src = base + key_first * stride + col0;
    T* dst = split_kv + (i % NBUF) * (2 * BK * G::kRow) + (is_v ? BK : 0) * G::kRow + r0 * G::kRow + col0;
#pragma unroll
    for (int j = 0; j < BK / kRowsPerPass; ++j) {
      const bool ok = key_first + j * kRowsPerPass < len;
      cp_async16(dst + j * kRowsPerPass * G::kRow, ok ? src : base, ok ? 16 : 0);
      src += kRowsPerPass * stride;
    }
  };
  auto load_tile = [&](int i) {  // C = 1: the split's i-th tile (always KVG commit groups)
    const bool live = i < my_tiles;
    if (live) copy_rows(i, false);
    if constexpr (KVG == 2) cp_async_commit();
    if (live) copy_rows(i, true);
    cp_async_commit();
  };
  // C > 1: the split's tiles of one round (NBUF tiles per split) as multicast bulk copies, one row
  // each; this CTA issues rows rank, rank + C, ... of each tile and zeroes V's rows past len.
  auto issue_round = [&](int round) {
#pragma unroll
    for (int b = 0; b < NBUF; ++b) {
      const int i = round * NBUF + b;
      if (i >= my_tiles) break;
      const int key0 = (i * WK + split) * BK;
      const int valid = min(BK, len - key0);
      T* k_dst = split_kv + b * (2 * BK * G::kRow);
      T* v_dst = k_dst + BK * G::kRow;
      const uint32_t k_bar = bar_s + 8 * ((split * NBUF + b) * 2), v_bar = k_bar + 8;
      if (stid == 0) {
        mbarrier_expect_tx(k_bar, valid * D * sizeof(T));
        mbarrier_expect_tx(v_bar, valid * D * sizeof(T));
      }
      for (int r = rank + C * stid; r < valid; r += C * kSplitThreads) {
        bulk_copy_multicast(smem_addr(k_dst + r * G::kRow), k_base + (key0 + r) * p.k_sk, D * sizeof(T), k_bar,
                            (1u << C) - 1);
        bulk_copy_multicast(smem_addr(v_dst + r * G::kRow), v_base + (key0 + r) * p.v_sk, D * sizeof(T), v_bar,
                            (1u << C) - 1);
      }
      for (int c = stid; c < (BK - valid) * (D / kChunk); c += kSplitThreads) {
        const int r = valid + c / (D / kChunk);
        *reinterpret_cast<uint4*>(v_dst + r * G::kRow + (c % (D / kChunk)) * kChunk) = make_uint4(0, 0, 0, 0);
      }
    }
  };
  auto split_barrier = [&]() {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + split), "n"(kSplitThreads) : "memory");
  };

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  const int qi0 = q0 + wq * 16 + g, qi1 = qi0 + 8;  // this thread's two query rows
  const uint8_t* mask0 = nullptr;
  const uint8_t* mask1 = nullptr;
  if (p.mask != nullptr) {
    mask0 = p.mask + n * p.m_sn + min(qi0, p.q_len - 1) * p.m_sq;
    mask1 = p.mask + n * p.m_sn + min(qi1, p.q_len - 1) * p.m_sq;
  }

  // S = Q Kᵀ for this warp's 16 queries × the tile's BK keys from key0, masked, then the online
  // softmax update of (m, l, O); s keeps P for the P V step.
  auto scores_and_softmax = [&](int key0, const T* k_s, float (&s)[BK / 8][4]) {
    const T* qw_s = q_s + wq * 16 * G::kRow;
#pragma unroll
    for (int j = 0; j < BK / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / kMmaK; ++kk) {
      uint32_t a[4];
      if constexpr (kTf32) {
        const float* qf = reinterpret_cast<const float*>(qw_s);
        a[0] = tf32_operand(qf[g * G::kRow + kk * 8 + t]);
        a[1] = tf32_operand(qf[(g + 8) * G::kRow + kk * 8 + t]);
        a[2] = tf32_operand(qf[g * G::kRow + kk * 8 + t + 4]);
        a[3] = tf32_operand(qf[(g + 8) * G::kRow + kk * 8 + t + 4]);
#pragma unroll
        for (int j = 0; j < BK / 8; ++j) {
          const float* kf = reinterpret_cast<const float*>(k_s) + (j * 8 + g) * G::kRow + kk * 8 + t;
          Mma<T>::run(s[j], a, tf32_operand(kf[0]), tf32_operand(kf[4]));
        }
      } else {
        ldmatrix_x4(a, qw_s + (lane % 16) * G::kRow + kk * 16 + (lane / 16) * 8);
#pragma unroll
        for (int j = 0; j < BK / 8; j += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, k_s + (j * 8 + (lane / 16) * 8 + lane % 8) * G::kRow + kk * 16 + ((lane / 8) % 2) * 8);
          Mma<T>::run(s[j], a, b[0], b[1]);
          Mma<T>::run(s[j + 1], a, b[2], b[3]);
        }
      }
    }

    // Mask (tiles past the row's length or under a mask only), online softmax over the two rows
    // this thread holds. Scores stay unscaled until the exponent: p = 2^(s·scale − m), one FFMA.
    if (mask0 != nullptr) {
      // Every mask byte of the tile is loaded before any is used (independent loads, one round
      // trip); keys past the length read a clamped, valid address and are dropped by `ok`.
      uint8_t keep[BK / 8][4];
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = min(key0 + j * 8 + 2 * t + (e & 1), p.k_len - 1);
          keep[j][e] = __ldg((e < 2 ? mask0 : mask1) + key * p.m_sk);
        }
      }
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool ok = key0 + j * 8 + 2 * t + (e & 1) < len && keep[j][e] != 0;
          s[j][e] = ok ? s[j][e] : -INFINITY;
        }
      }
    } else if (key0 + BK > len) {
      // (K rows past len may hold anything, NaN included: their scores are replaced here.)
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (key0 + j * 8 + 2 * t + (e & 1) >= len) s[j][e] = -INFINITY;
        }
      }
    }
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < BK / 8; ++j) {
      mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
      mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off *= 2) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    const float new0 = fmaxf(m0, mx0 * p.scale_log2), new1 = fmaxf(m1, mx1 * p.scale_log2);
    const float ref0 = new0 == -INFINITY ? 0.f : new0, ref1 = new1 == -INFINITY ? 0.f : new1;
    const float alpha0 = fast_exp2(m0 - ref0), alpha1 = fast_exp2(m1 - ref1);
    m0 = new0;
    m1 = new1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < BK / 8; ++j) {
      s[j][0] = fast_exp2(fmaf(s[j][0], p.scale_log2, -ref0));
      s[j][1] = fast_exp2(fmaf(s[j][1], p.scale_log2, -ref0));
      s[j][2] = fast_exp2(fmaf(s[j][2], p.scale_log2, -ref1));
      s[j][3] = fast_exp2(fmaf(s[j][3], p.scale_log2, -ref1));
      sum0 += s[j][0] + s[j][1];
      sum1 += s[j][2] + s[j][3];
    }
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha0;
      o[i][1] *= alpha0;
      o[i][2] *= alpha1;
      o[i][3] *= alpha1;
    }
  };
  // O += P V for the tile's BK keys (V rows past len are zeros).
  auto add_pv = [&](const T* v_s, const float (&s)[BK / 8][4]) {
    if constexpr (kTf32) {
      // The S accumulator gives thread (g, t) keys 2t and 2t+1 of each 8-key tile; read them as
      // the A fragment's columns t and t+4 and take V's rows in the same order.
#pragma unroll
      for (int j = 0; j < BK / 8; ++j) {
        const uint32_t a[4] = {tf32_operand(s[j][0]), tf32_operand(s[j][2]), tf32_operand(s[j][1]), tf32_operand(s[j][3])};
        const float* vf = reinterpret_cast<const float*>(v_s) + (j * 8 + 2 * t) * G::kRow + g;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) Mma<T>::run(o[i], a, tf32_operand(vf[i * 8]), tf32_operand(vf[G::kRow + i * 8]));
      }
    } else {
#pragma unroll
      for (int j = 0; j < BK / 16; ++j) {
        const uint32_t a[4] = {pack2<T>(s[2 * j][0], s[2 * j][1]), pack2<T>(s[2 * j][2], s[2 * j][3]),
                               pack2<T>(s[2 * j + 1][0], s[2 * j + 1][1]), pack2<T>(s[2 * j + 1][2], s[2 * j + 1][3])};
#pragma unroll
        for (int i = 0; i < D / 8; i += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_s + (j * 16 + ((lane / 8) % 2) * 8 + lane % 8) * G::kRow + i * 8 + (lane / 16) * 8);
          Mma<T>::run(o[i], a, b[0], b[1]);
          Mma<T>::run(o[i + 1], a, b[2], b[3]);
        }
      }
    }
  };

  if constexpr (C == 1) {
#pragma unroll
    for (int i = 0; i < NBUF; ++i) load_tile(i);
    cp_async_wait<NBUF * KVG>();  // this thread's Q copies; every thread's after the barrier
    __syncthreads();

    for (int it = 0; it < my_tiles; ++it) {
      cp_async_wait<NBUF * KVG - 1>();
      split_barrier();  // tile `it`'s K (KVG = 2) or K and V (KVG = 1) of every thread of the split have landed
      const int key0 = (it * WK + split) * BK;
      const T* k_s = split_kv + (it % NBUF) * (2 * BK * G::kRow);
      float s[BK / 8][4];
      scores_and_softmax(key0, k_s, s);
      if constexpr (KVG == 2) {
        cp_async_wait<2 * NBUF - 2>();
        split_barrier();  // tile `it`'s V has landed
      }
      add_pv(k_s + BK * G::kRow, s);
      split_barrier();  // the split is done with this buffer before it is refilled
      load_tile(it + NBUF);
    }
    cp_async_wait<0>();
  } else {
    // Rounds of NBUF tiles per split; every CTA of the cluster runs the same rounds (one (row,
    // head), one len). A cluster barrier separates rounds: no CTA refills a buffer a peer still reads.
    const int rounds = (((tiles + WK - 1) / WK) + NBUF - 1) / NBUF;
    issue_round(0);
    cp_async_wait<0>();  // the Q tile, every thread's after the barrier
    __syncthreads();
    for (int round = 0; round < rounds; ++round) {
      if (round > 0) {
        // Generic-proxy writes (V's zeroed rows) before the next round's bulk copies overwrite them.
        fence_proxy_async();
        cluster_sync_all();
        issue_round(round);
      }
#pragma unroll
      for (int b = 0; b < NBUF; ++b) {
        const int it = round * NBUF + b;
        if (it >= my_tiles) break;
        const uint32_t k_bar = bar_s + 8 * ((split * NBUF + b) * 2);
        const T* k_s = split_kv + b * (2 * BK * G::kRow);
        mbarrier_wait(k_bar, round & 1);
        float s[BK / 8][4];
        scores_and_softmax((it * WK + split) * BK, k_s, s);
        mbarrier_wait(k_bar + 8, round & 1);
        split_barrier();  // the split's zeroed V rows are visible
        add_pv(k_s + BK * G::kRow, s);
      }
    }
  }

  // Merge the WK splits: each split's (m, l) per query and its unnormalised partial O go to shared
  // memory, then each output element takes the max, the weights 2^(m_s - max) and the weighted sum
  // of the partials, in split order. One CTA barrier where the partials have their own region.
#pragma unroll
  for (int off = 1; off < 4; off *= 2) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  if constexpr (!G::kOwnRed) __syncthreads();  // every split is done with the K/V buffers red_s overlays
  const int row0 = wq * 16 + g, row1 = row0 + 8;
  if (t == 0) {
    stat_s[(split * G::kQRows + row0) * 2 + 0] = m0;
    stat_s[(split * G::kQRows + row0) * 2 + 1] = l0;
    stat_s[(split * G::kQRows + row1) * 2 + 0] = m1;
    stat_s[(split * G::kQRows + row1) * 2 + 1] = l1;
  }
  float* red = red_s + split * G::kQRows * G::kRedRow;
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    *reinterpret_cast<float2*>(red + row0 * G::kRedRow + i * 8 + 2 * t) = make_float2(o[i][0], o[i][1]);
    *reinterpret_cast<float2*>(red + row1 * G::kRedRow + i * 8 + 2 * t) = make_float2(o[i][2], o[i][3]);
  }
  __syncthreads();

  T* out_base = static_cast<T*>(p.out) + n * p.o_sn + h * p.o_sh;
  for (int c = tid; c < G::kQRows * (D / 4); c += G::kThreads) {
    const int r = c / (D / 4), col = (c % (D / 4)) * 4;
    if (q0 + r >= p.q_len) continue;
    float m[WK], big = -INFINITY;
#pragma unroll
    for (int s2 = 0; s2 < WK; ++s2) {
      m[s2] = stat_s[(s2 * G::kQRows + r) * 2];
      big = fmaxf(big, m[s2]);
    }
    const float ref = big == -INFINITY ? 0.f : big;
    float total = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s2 = 0; s2 < WK; ++s2) {
      const float w = fast_exp2(m[s2] - ref);  // 0 for a split without valid keys (m = -inf, O = 0)
      total += stat_s[(s2 * G::kQRows + r) * 2 + 1] * w;
      const float4 x = *reinterpret_cast<const float4*>(red_s + (s2 * G::kQRows + r) * G::kRedRow + col);
      acc.x += x.x * w;
      acc.y += x.y * w;
      acc.z += x.z * w;
      acc.w += x.w * w;
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;  // a query with no valid key gets exactly 0
    store4<T>(out_base + (q0 + r) * p.o_sq + col, acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
  }
}

}  // namespace cuda_attention
}  // namespace torch_cfm
