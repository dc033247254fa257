// Host/device interface of the DiT GEMM kernel (dit_gemm_kernel.cuh): the launch parameters, the
// shared-memory geometry, the instantiated tile configs and one launch function per dtype. Plain C++: the binding
// (dit_gemm.cpp) includes it without nvcc.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace torch_cfm {
namespace cuda_gemm {

enum Epilogue : int { kBias = 0, kBiasGelu = 1, kPartial = 2, kNone = 3 };

struct GemmParams {
  const void* a;     // (M, K), unit stride along K
  const void* w;     // (N, K), unit stride along K
  const void* bias;  // (N,) in T; nullptr for kPartial / kNone
  void* out;         // (M, N) in T, or fp32 (K / KS, M, N) slices for kPartial
  int64_t a_sm, w_sn, o_sm, o_split;  // element strides
  int m, n, k;
};

// Shared-memory geometry (plain C++: the binding reports it without nvcc). Rows padded by 16 bytes
// so that the 8 row addresses of one ldmatrix hit distinct bank groups.
template <int ELEM, int BM, int BN, int KS, int BK>
struct GemmGeometry {
  static constexpr int kPad = 16 / ELEM;
  static constexpr int kWRow = KS + kPad;
  static constexpr int kARow = BK + kPad;
  static constexpr int kWBytes = BN * kWRow * ELEM;
  static constexpr int kABytes = (KS / BK) * BM * kARow * ELEM;  // the whole K slice of A
  static constexpr int kSmemBytes = kWBytes + kABytes;
};

// The K slice every config covers per CTA: K must be a multiple (K / 512 slices, split-K partials
// when K > 512).
constexpr int kSliceK = 512;

// (BM, BN, KS, BK, WM, WN): rows and columns per CTA, K slice, K chunk of A's copies, warps along
// M and N. One CTA per SM (160-210 KB of shared memory); at M = 400 each role's grid is 112 CTAs:
// qkv / conv 64 × 96, proj 64 × 32, fc1 and fc2 (4 split-K slices) 64 × 128.
#define TORCH_CFM_GEMM_CONFIGS(X) \
  X(64, 128, 512, 64, 2, 4)       \
  X(64, 96, 512, 64, 4, 2)        \
  X(64, 64, 512, 64, 2, 2)        \
  X(64, 32, 512, 64, 4, 2)

bool launch_gemm_f16(const GemmParams& p, int block_m, int block_n, int epilogue, bool pdl, cudaStream_t stream);
bool launch_gemm_bf16(const GemmParams& p, int block_m, int block_n, int epilogue, bool pdl, cudaStream_t stream);

}  // namespace cuda_gemm
}  // namespace torch_cfm
