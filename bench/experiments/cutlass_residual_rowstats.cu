// Issue 41's producer epilogue (experiment, compiled on a CPU box; not built into the library, never run yet).
//
// The DiT block's residual GEMMs (attention proj, fc2) end a residual branch and feed the next
// LayerNorm. Today that boundary is three passes: the GEMM (+ bias), the gated residual add
// x + g * (A W^T + b), and the row-norm kernel reading x back for its mean and variance. This
// kernel does all of it in the GEMM's epilogue, as one epilogue-visitor DAG:
//
//   y  = x + g[l] * (acc + b)          the new residual stream, D (M, N) per batch l, rounded once
//   c  = y - mu_prev[m]                centred on the previous LayerNorm's row mean (no cancellation
//                                      in sum c^2 - (sum c)^2 / N; mu_prev is a (M,) column broadcast)
//   s1[m, j] = sum over tile j of c,  s2[m, j] = sum of c^2   (fp32 partial row sums, one per
//                                      CTA_N columns: N = 512 is 2-4 tiles; the consumer adds them
//                                      in a fixed order, so the result does not depend on timing)
//
// Batched over L = B (the GEMM's batch mode): A (T, K) and D, x (T, N) per batch, W (N, K) shared
// (L-stride 0), g a row broadcast with L-stride N (the adaLN gate of batch l), b a row broadcast.
//
// Build (registers and spills per kernel in the ptxas report):
//   nvcc -std=c++17 -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I"$CUTLASS_INCLUDE" -I csrc/cutlass -Xptxas -v -c bench/experiments/cutlass_residual_rowstats.cu -o /tmp/rs.o
#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"

namespace tcfm_experiment {

using namespace cutlass::epilogue::fusion;

// y = x + g * (acc + b), in fp32
template <class T>
struct GatedResidual;

template <int N>
struct GatedResidual<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& acc, cutlass::Array<float, N> const& bias,
                                                     cutlass::Array<float, N> const& gate,
                                                     cutlass::Array<float, N> const& x) const {
    cutlass::Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      out[i] = fmaf(gate[i], acc[i] + bias[i], x[i]);
    }
    return out;
  }
};

template <class T>
struct Square;

template <int N>
struct Square<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& c) const {
    cutlass::Array<float, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      out[i] = c[i] * c[i];
    }
    return out;
  }
};

// The DAG's output node: y (its first input); the reductions are its other inputs so they are visited.
template <class T>
struct First;

template <int N>
struct First<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& y, cutlass::Array<float, N> const&,
                                                     cutlass::Array<float, N> const&) const {
    return y;
  }
};

template <class Element, class TileShape, class ClusterShape>
struct Sm90ResidualRowStats {
  static constexpr int kAlign = 16 / sizeof(Element);
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using RC = cutlass::FloatRoundStyle;

  using RowStride = cute::Stride<cute::_0, cute::_1, int64_t>;   // (N,) per batch l: b (l-stride 0), g (l-stride N)
  using ColStride = cute::Stride<cute::_1, cute::_0, int64_t>;   // (M,) per batch l: mu_prev (l-stride T)
  using AuxStride = cute::Stride<int64_t, cute::_1, int64_t>;    // x (T, N) row-major per batch
  using PartialStride = cute::Stride<cute::_1, cute::_0, int64_t>;

  using Acc = Sm90AccFetch;
  using Bias = Sm90RowBroadcast<0, TileShape, Element, float, RowStride, kAlign>;
  using Gate = Sm90RowBroadcast<0, TileShape, Element, float, RowStride, kAlign>;
  using X = Sm90AuxLoad<0, decltype(cute::take<0, 2>(TileShape{})), Element, AuxStride, void, void, kAlign>;
  using Mu = Sm90ColBroadcast<0, TileShape, float, float, ColStride>;
  using Y = Sm90Compute<GatedResidual, float, float, RC::round_to_nearest>;
  using Centre = Sm90Compute<cutlass::minus, float, float, RC::round_to_nearest>;
  using Sum = Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape, float, float,
                               RC::round_to_nearest, PartialStride, 4, true, /*FinalReduction=*/false>;
  using Sq = Sm90Compute<Square, float, float, RC::round_to_nearest>;
  using SumSq = Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape, float, float,
                                 RC::round_to_nearest, PartialStride, 4, true, /*FinalReduction=*/false>;
  using Out = Sm90Compute<First, Element, float, RC::round_to_nearest>;

  // nodes in topological order: 0 acc, 1 b, 2 g, 3 x, 4 mu, 5 y, 6 c, 7 sum c, 8 c^2, 9 sum c^2, 10 out
  using Edges = cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<0, 1, 2, 3>,
                            cute::seq<5, 4>, cute::seq<6>, cute::seq<6>, cute::seq<8>, cute::seq<5, 7, 9>>;
  using Fusion = Sm90TopologicalVisitor<float, Edges, Acc, Bias, Gate, X, Mu, Y, Centre, Sum, Sq, SumSq, Out>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlign,
      Element, cutlass::layout::RowMajor, kAlign, EpilogueSchedule, Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace tcfm_experiment

namespace {
using G = tcfm_experiment::Sm90ResidualRowStats<cutlass::half_t, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                                cute::Shape<cute::_1, cute::_1, cute::_1>>;
using E = cutlass::half_t;

G::Adapter::Arguments make_arguments(const void* a, const void* w, const void* bias, const void* gate, const void* x,
                                     const float* mu_prev, void* d, float* s1, float* s2, int t, int b, int n, int k,
                                     int device, int sm_count) {
  const auto sa = cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(k) * t);
  const auto sb = cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(0));
  const auto sd = cute::make_stride(int64_t(n), cute::Int<1>{}, int64_t(n) * t);
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  G::Adapter::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                             {t, n, k, b},
                             {static_cast<const E*>(a), sa, static_cast<const E*>(w), sb},
                             {{}, nullptr, sd, static_cast<E*>(d), sd},
                             hw};
  // the partial sums' buffer: (round_up(T, CTA_M), N / CTA_N, B), m-major (Sm90ColReduction without its final pass)
  const int64_t partial_l = int64_t(n / 128) * ((t + 127) / 128 * 128);
  // DAG arguments: one per node, in topological order
  args.epilogue.thread = {
      {},                                                                                    // acc
      {static_cast<const E*>(bias), E(0), G::RowStride{cute::_0{}, cute::_1{}, 0}},          // b
      {static_cast<const E*>(gate), E(0), G::RowStride{cute::_0{}, cute::_1{}, n}},          // g
      {static_cast<const E*>(x), E(0), G::AuxStride{n, cute::_1{}, int64_t(n) * t}},        // x
      {mu_prev, 0.f, G::ColStride{cute::_1{}, cute::_0{}, t}},                               // mu_prev
      {},                                                                                    // y
      {},                                                                                    // c
      {s1, 0.f, G::PartialStride{cute::_1{}, cute::_0{}, partial_l}},                        // sum c
      {},                                                                                    // c^2
      {s2, 0.f, G::PartialStride{cute::_1{}, cute::_0{}, partial_l}},                        // sum c^2
      {}};                                                                                   // out
  return args;
}
}  // namespace

// One call: T rows per batch, B batches, N = C output channels, K input channels, fp16, all row-major:
// a (B, T, K), w (N, K), bias (N,), gate (B, N), x and d (B, T, N), mu_prev (B, T) fp32;
// s1, s2: (B, N / 128, round_up(T, 128)) fp32 partial row sums. Returns 0 on success, else a cutlass::Status.
extern "C" long long tcfm_residual_rowstats_f16_workspace(int t, int b, int n, int k) {
  const auto args = make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, t,
                                   b, n, k, 0, 1);
  return static_cast<long long>(G::Adapter::get_workspace_size(args));
}

extern "C" int tcfm_residual_rowstats_f16(const void* a, const void* w, const void* bias, const void* gate,
                                          const void* x, const float* mu_prev, void* d, float* s1, float* s2, int t,
                                          int b, int n, int k, int device, int sm_count, void* workspace,
                                          cudaStream_t stream) {
  const auto args = make_arguments(a, w, bias, gate, x, mu_prev, d, s1, s2, t, b, n, k, device, sm_count);
  G::Adapter gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st != cutlass::Status::kSuccess) return static_cast<int>(st);
  st = gemm.initialize(args, workspace, stream);
  if (st != cutlass::Status::kSuccess) return static_cast<int>(st);
  st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) return static_cast<int>(st);
  return cudaGetLastError() == cudaSuccess ? 0 : -1;
}
