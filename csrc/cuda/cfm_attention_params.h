// Host/device interface of the cfm_attention CUDA kernel: the launch parameters, the instantiated tile
// configs and one launch function per dtype (defined in cfm_attention_{f16,bf16,f32}.cu so the three
// compile in parallel). Plain C++: the torch binding (cfm_attention.cpp) includes it without nvcc.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace torch_cfm {
namespace cuda_attention {

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int32_t* key_lengths;  // nullptr: every key of k is valid
  const uint8_t* mask;         // nullptr: no mask; else bool (N, Q, K) viewed as bytes
  const int32_t* kv_rows;      // nullptr: k/v row n serves query row n
  int64_t q_sn, q_sh, q_sq;    // element strides (stride along D is 1)
  int64_t k_sn, k_sh, k_sk;
  int64_t v_sn, v_sh, v_sk;
  int64_t m_sn, m_sq, m_sk;
  int64_t o_sn, o_sh, o_sq;
  int n_heads, q_len, k_len, n_pool, q_tiles;  // q_tiles: 16·WQ-query tiles of Q
  float scale_log2;  // log2(e) / sqrt(D)
};

// Shared-memory geometry of one instantiation (ELEM: bytes per element). Plain C++, so the binding
// can report each config's shared memory without nvcc. Rows are padded by 16 bytes: with that,
// ldmatrix (16-bit) and the TF32 scalar fragment loads hit 8 / 32 distinct banks per instruction.
template <int ELEM, int D, int BK, int WQ, int WK, int NBUF, int C>
struct Geometry {
  static constexpr int kPad = 16 / ELEM;
  static constexpr int kRow = D + kPad;  // elements per shared row
  static constexpr int kQRows = WQ * 16;
  static constexpr int kThreads = WQ * WK * 32;
  static constexpr int kQBytes = kQRows * kRow * ELEM;
  static constexpr int kTileBytes = BK * kRow * ELEM;  // one K or V tile
  static constexpr int kKVBytes = NBUF * WK * 2 * kTileBytes;
  static constexpr int kRedRow = D + 4;  // fp32 partial O rows in the merge
  static constexpr int kRedBytes = WK * kQRows * kRedRow * 4;
  static constexpr int kStatBytes = WK * kQRows * 2 * 4;  // (m, l) per split and query
  static constexpr int kBarBytes = C > 1 ? WK * NBUF * 2 * 8 : 0;  // an mbarrier per (split, buffer, K|V)
  // The merge's partials get their own region where it fits next to the K/V buffers (227 KB per
  // CTA on SM90), so a split writes them as soon as its walk ends; else they overlay the buffers.
  static constexpr bool kOwnRed = kQBytes + kKVBytes + kRedBytes + kStatBytes + kBarBytes <= 227 * 1024;
  static constexpr int kMainBytes = kOwnRed ? kKVBytes + kRedBytes : (kKVBytes > kRedBytes ? kKVBytes : kRedBytes);
  static constexpr int kRedOffset = kOwnRed ? kKVBytes : 0;  // within the main region
  static constexpr int kSmemBytes = kQBytes + kMainBytes + kStatBytes + kBarBytes;
};

// Instantiated tile configs (BK keys per tile, WQ 16-query groups, WK key splits per CTA, NBUF tiles
// in flight per split, C consecutive query tiles per cluster sharing multicast K/V (C > 1 needs SM90),
// KVG copy groups per tile: 2 lands K before V so the score dot overlaps V's copy), D = 64.
// 16-bit: 512-thread configs use 32-key tiles (64-key ones spill at 128 registers). The 128-key
// (16-bit) and 64-key (fp32) configs give each split one whole tile at K <= 512.
#define TORCH_CFM_CONFIGS_16(X) \
  X(32, 4, 4, 2, 1, 1)          \
  X(32, 2, 8, 2, 1, 1)          \
  X(32, 2, 8, 1, 1, 1)          \
  X(64, 2, 4, 2, 1, 1)          \
  X(64, 4, 2, 2, 1, 1)          \
  X(64, 1, 8, 1, 1, 1)          \
  X(128, 2, 4, 1, 1, 1)         \
  X(64, 2, 4, 2, 1, 2)          \
  X(64, 1, 8, 1, 1, 2)          \
  X(128, 2, 4, 1, 1, 2)         \
  X(128, 2, 2, 2, 1, 2)         \
  X(128, 2, 4, 1, 2, 2)         \
  X(64, 2, 4, 2, 2, 2)
#define TORCH_CFM_CONFIGS_32(X) \
  X(16, 4, 4, 2, 1, 1)          \
  X(16, 2, 8, 2, 1, 1)          \
  X(32, 4, 4, 2, 1, 1)          \
  X(32, 2, 8, 1, 1, 1)          \
  X(32, 2, 4, 2, 1, 1)          \
  X(32, 4, 2, 2, 1, 1)          \
  X(64, 2, 4, 1, 1, 1)          \
  X(32, 2, 4, 2, 1, 2)          \
  X(64, 2, 4, 1, 1, 2)          \
  X(64, 2, 2, 2, 1, 2)          \
  X(64, 2, 4, 1, 2, 2)          \
  X(32, 2, 4, 2, 2, 2)

// Launch `blocks` work items, `cluster` CTAs (one cluster: `cluster` query tiles of one (row, head))
// each, on `stream`, with programmatic dependent launch when `pdl`; false when (bk, wq, wk, nbuf,
// cluster, kv_groups) is not instantiated.
bool launch_f16(const Params& p, int blocks, int bk, int wq, int wk, int nbuf, int cluster, int kv_groups,
               bool pdl, cudaStream_t stream);
bool launch_bf16(const Params& p, int blocks, int bk, int wq, int wk, int nbuf, int cluster, int kv_groups,
               bool pdl, cudaStream_t stream);
bool launch_f32(const Params& p, int blocks, int bk, int wq, int wk, int nbuf, int cluster, int kv_groups,
               bool pdl, cudaStream_t stream);

}  // namespace cuda_attention
}  // namespace torch_cfm
