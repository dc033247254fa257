// The DiT body's linear layers as a hand-written CUDA GEMM (mma.sync, SM80+) that loads its weights
// before it waits for the previous kernel: out (M, N) = A (M, K) · Wᵀ (W: (N, K), nn.Linear layout)
// with an epilogue (bias, bias + tanh GELU, or fp32 split-K partials).
//
// Why (bench/NOTES.md, session 14): at M = 400 token rows each cuBLAS GEMM of a block costs 4-6 µs,
// ≈ 1 µs of dependent launch plus the operand bytes each SM must take in (≈ 170 KB per CTA at
// 64 × 104 tiles: ≈ 3 µs at the ≈ 50 GB/s per SM that bench/sm_ingest.py measured with every SM
// copying). The weights never depend on the previous kernel, so under programmatic dependent launch
// (PDL) a CTA can copy its whole weight slab into shared memory while the kernel in front of it still
// runs, and take in only the activations once `griddepcontrol.wait` returns.
//
// One CTA computes a BM × BN tile over one K slice of KS columns (grid: N / BN, ⌈M / BM⌉, K / KS):
// * the W slab (BN rows × KS) is copied once, before the wait, and stays resident;
// * A's whole K slice is copied at once after the wait, in chunks of BK columns (one cp.async group
//   each), and the MMAs of a chunk start as soon as it has landed;
// * WM × WN warps, each a (BM / WM) × (BN / WN) tile of m16n8k16 MMAs with ldmatrix operands;
// * epilogue kBias / kBiasGelu: + bias (fp32), optional GELU (tanh), stored in T; kPartial: the fp32
//   sum of this K slice stored at out + slice · o_split (the consumer adds the slices and the bias).
// Rows past M read zeros and are not stored. N % BN == 0 and K % KS == 0 (checked by the binding).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "device_primitives.cuh"
#include "dit_gemm_params.h"

namespace torch_cfm {
namespace cuda_gemm {

using namespace torch_cfm::cuda_device;

// (torch builds with __CUDA_NO_HALF_CONVERSIONS__ / __CUDA_NO_BFLOAT16_CONVERSIONS__: explicit intrinsics)
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ float gelu_tanh(float x) {
  const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
  return 0.5f * x * (1.f + tanhf(inner));
}

// cp.async.wait_group with a run-time count (the PTX takes an immediate): at most n groups pending.
__device__ __forceinline__ void cp_async_wait_at_most(int n) {
  switch (n) {
    case 0: cp_async_wait<0>(); break;
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    default: cp_async_wait<7>(); break;
  }
}

template <typename T, int BM, int BN, int KS, int BK, int WM, int WN, int EPI>
__global__ void __launch_bounds__(WM * WN * 32) dit_gemm_kernel(const GemmParams p) {
  using G = GemmGeometry<sizeof(T), BM, BN, KS, BK>;
  constexpr int kThreads = WM * WN * 32;
  constexpr int kChunk = 8;  // 16-bit elements per 16-byte copy
  constexpr int kWarpM = BM / WM, kWarpN = BN / WN;
  constexpr int MT = kWarpM / 16, NT = kWarpN / 8;
  constexpr int kChunks = KS / BK;
  static_assert(sizeof(T) == 2, "16-bit operands (fp16 / bf16)");
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tiles of whole m16 and pairs of n8 MMA tiles");
  static_assert(KS % BK == 0 && BK % 16 == 0 && kChunks <= 8, "K slice of at most 8 chunks of whole k16 steps");

  extern __shared__ __align__(16) unsigned char smem[];
  T* w_s = reinterpret_cast<T*>(smem);
  T* a_s = reinterpret_cast<T*>(smem + G::kWBytes);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / WN, wn = warp % WN;
  const int g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM, k0 = blockIdx.z * KS;

  // The weight slab, before the wait: no kernel of the step writes weights.
  {
    const T* src = static_cast<const T*>(p.w) + n0 * p.w_sn + k0;
    constexpr int kPerRow = KS / kChunk;
#pragma unroll 4
    for (int c = tid; c < BN * kPerRow; c += kThreads) {
      const int r = c / kPerRow, col = (c % kPerRow) * kChunk;
      cp_async16(w_s + r * G::kWRow + col, src + r * p.w_sn + col, 16);
    }
    cp_async_commit();
  }
  float bias_r[NT][2];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    bias_r[j][0] = bias_r[j][1] = 0.f;
    if constexpr (EPI == kBias || EPI == kBiasGelu) {
      const T* b = static_cast<const T*>(p.bias) + n0 + wn * kWarpN + j * 8 + 2 * t;
      bias_r[j][0] = to_float(b[0]);
      bias_r[j][1] = to_float(b[1]);
    }
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // Programmatic dependent launch (no-ops without the launch attribute): A is the previous
  // kernel's output; once every CTA is past here the next kernel may be scheduled (its own wait
  // still waits for this grid to finish).
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" :::);
#endif

  // The whole A slice (BM rows × KS) in flight at once, one commit group per BK-column chunk: at
  // M ≈ 400 the time is the operand bytes each SM takes in, and a deeper queue of copies is what
  // raises that rate (bench/sm_ingest.py). Rows past M are zero-filled.
  {
    const T* a_base = static_cast<const T*>(p.a) + k0;
    constexpr int kPerRow = BK / kChunk;
#pragma unroll
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      T* dst = a_s + chunk * BM * G::kARow;
#pragma unroll
      for (int c = tid; c < BM * kPerRow; c += kThreads) {
        const int r = c / kPerRow, col = (c % kPerRow) * kChunk;
        const bool ok = m0 + r < p.m;
        const T* src = ok ? a_base + (m0 + r) * p.a_sm + chunk * BK + col : a_base;
        cp_async16(dst + r * G::kARow + col, src, ok ? 16 : 0);
      }
      cp_async_commit();
    }
  }

  float acc[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;

  // Commit groups: W, then A's chunks in order; chunk kc (and W) have landed once at most
  // kChunks - 1 - kc groups are pending. No buffer is reused, so one barrier per chunk suffices.
#pragma unroll 1
  for (int kc = 0; kc < kChunks; ++kc) {
    cp_async_wait_at_most(kChunks - 1 - kc);
    __syncthreads();  // every thread's copies of chunk kc visible to every warp
    const T* a_tile = a_s + kc * BM * G::kARow + (wm * kWarpM) * G::kARow;
    const T* w_tile = w_s + (wn * kWarpN) * G::kWRow + kc * BK;
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t af[MT][4];
#pragma unroll
      for (int i = 0; i < MT; ++i)
        ldmatrix_x4(af[i], a_tile + (i * 16 + lane % 16) * G::kARow + kk * 16 + (lane / 16) * 8);
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, w_tile + (j * 8 + (lane / 16) * 8 + lane % 8) * G::kWRow + kk * 16 + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          Mma<T>::run(acc[i][j], af[i], b[0], b[1]);
          Mma<T>::run(acc[i][j + 1], af[i], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: thread (g, t) holds rows g and g + 8 of each m16 tile, columns 2t, 2t + 1 of each n8.
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = m0 + wm * kWarpM + i * 16 + g + 8 * half;
      if (row >= p.m) continue;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const int col = n0 + wn * kWarpN + j * 8 + 2 * t;
        float x0 = acc[i][j][2 * half] + bias_r[j][0], x1 = acc[i][j][2 * half + 1] + bias_r[j][1];
        if constexpr (EPI == kPartial) {
          float* o = static_cast<float*>(p.out) + blockIdx.z * p.o_split + row * p.o_sm + col;
          *reinterpret_cast<float2*>(o) = make_float2(x0, x1);
        } else {
          if constexpr (EPI == kBiasGelu) {
            x0 = gelu_tanh(x0);
            x1 = gelu_tanh(x1);
          }
          T* o = static_cast<T*>(p.out) + row * p.o_sm + col;
          *reinterpret_cast<uint32_t*>(o) = pack2<T>(x0, x1);
        }
      }
    }
  }
}

}  // namespace cuda_gemm
}  // namespace torch_cfm
