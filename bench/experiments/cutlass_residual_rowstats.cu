// Issue 41's producer epilogue (experiment, compiled on a CPU box; not built into the library).
//
// The DiT block's residual GEMMs (attention proj, fc2) end a residual branch and feed the next
// LayerNorm. Today that boundary is separate passes: the GEMM (+ bias), the gated residual add
// x + g * (A W^T + b), and the row-norm kernel reading x back for its mean and variance and writing
// the modulated input of the next GEMM. This kernel does the producer's half in the GEMM's epilogue,
// as one epilogue-visitor DAG over M = all rows (the modulation is the solve step's: one vector for
// every row):
//
//   y   = x + g * (acc + b)             the new residual stream, D (M, N), rounded once
//   c   = y - m[row]                    centred on the previous LayerNorm's row mean (a (M,) column
//                                       broadcast): no cancellation in the variance, and the folded
//                                       consumer keeps the shipped path's fidelity at any |mean| / sigma
//                                       (rownorm_fold_fidelity.py, fold_x_centred)
//   xc  = c * (1 + s)                   the next GEMM's input, fp16, an aux store ((1 + s): the next
//                                       boundary's modulation scale, a row broadcast)
//   s1[row, j] = sum over tile j of c,  s2 = of c^2   fp32 partial row sums, one per CTA_N columns (N = 512:
//                                       4 tiles); the consumer adds them in a fixed order
//
// The consumer GEMM then reads xc and finishes the LayerNorm in its epilogue:
// rstd * (xc W^T - (mu - m) * u) + v, u = (1 + s) W^T, v = sh W^T + b (per step and block).
//
// Build (registers and spills per kernel in the ptxas report):
//   nvcc -std=c++17 -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -I"$CUTLASS_INCLUDE" -Xptxas -v -c bench/experiments/cutlass_residual_rowstats.cu -o /tmp/rs.o
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

// The DAG's output node: y (its first input); the store and the reductions are its other inputs, so
// that they are visited.
template <class T>
struct First;

template <int N>
struct First<cutlass::Array<float, N>> {
  CUTLASS_DEVICE cutlass::Array<float, N> operator()(cutlass::Array<float, N> const& y, cutlass::Array<float, N> const&,
                                                     cutlass::Array<float, N> const&,
                                                     cutlass::Array<float, N> const&) const {
    return y;
  }
};

// kTma = false: x read and xc written by the epilogue threads straight from and to global memory
// (the register-direct Sm90AuxLoad / Sm90AuxStore forms, Stages = 0). kTma = true: x is the
// epilogue's source C, loaded by TMA into shared memory ahead of the epilogue (Sm90SrcFetch), and xc
// leaves through shared memory by a TMA store, pipelined like D (Sm90AuxStore with D's stages).
// kPingpong: the ping-pong schedule (two consumer warp groups on alternate tiles, one's epilogue under
// the other's mainloop) instead of the cooperative one (both on one tile).
// ElementRes: the residual stream's type, x read and y written (float: the body keeps h in float32);
// the GEMM operands and xc stay Element.
template <class Element, class TileShape, class ClusterShape, bool kTma, bool kPingpong = false,
          class ElementRes = Element>
struct Sm90ResidualRowStats {
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kAlignRes = 16 / sizeof(ElementRes);
  using MainloopSchedule = cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;
  using RC = cutlass::FloatRoundStyle;
  // what EpilogueTileAuto picks for a 128 x 128 tile: 128 x 32 cooperative, 64 x 32 ping-pong
  using EpiTile = cute::Shape<cute::conditional_t<kPingpong, cute::_64, cute::_128>, cute::_32>;
  using EpiTileType = cute::conditional_t<kTma, EpiTile, cutlass::epilogue::collective::EpilogueTileAuto>;
  using ElementC = cute::conditional_t<kTma, ElementRes, void>;
  using Policy = decltype(cutlass::epilogue::collective::detail::sm90_get_tma_dispatch_policy<
                          TileShape, EpiTile, ElementC, ElementRes, EpilogueSchedule>());

  using RowStride = cute::Stride<cute::_0, cute::_1, int64_t>;   // (N,) vectors: b, g, 1 + s
  using ColStride = cute::Stride<cute::_1, cute::_0, int64_t>;   // (M,) vectors: m
  using AuxStride = cute::Stride<int64_t, cute::_1, int64_t>;    // (M, N) row-major: x, xc
  using PartialStride = cute::Stride<cute::_1, cute::_0, int64_t>;

  using Acc = Sm90AccFetch;
  using Bias = Sm90RowBroadcast<0, TileShape, Element, float, RowStride, kAlign>;
  using Gate = Sm90RowBroadcast<0, TileShape, Element, float, RowStride, kAlign>;
  using X = cute::conditional_t<
      kTma, Sm90SrcFetch<ElementRes>,
      Sm90AuxLoad<0, decltype(cute::take<0, 2>(TileShape{})), ElementRes, AuxStride, void, void, kAlignRes>>;
  using Mean = Sm90ColBroadcast<0, TileShape, float, float, ColStride>;
  using Scale = Sm90RowBroadcast<0, TileShape, float, float, RowStride, 4>;
  using Y = Sm90Compute<GatedResidual, float, float, RC::round_to_nearest>;
  using Centre = Sm90Compute<cutlass::minus, float, float, RC::round_to_nearest>;
  using Modulate = Sm90Compute<cutlass::multiplies, float, float, RC::round_to_nearest>;
  using SmemAtomXc = decltype(cutlass::epilogue::collective::detail::sm90_get_epilogue_smem_swizzle_layout_atom<
                              AuxStride, Element, EpiTile>());
  using R2SXc = decltype(cutlass::epilogue::collective::detail::sm90_get_smem_store_op_for_accumulator<
                         AuxStride, Element, EpiTile>());
  using StoreXc = cute::conditional_t<
      kTma, Sm90AuxStore<Policy::StagesD, EpiTile, Element, RC::round_to_nearest, AuxStride, SmemAtomXc, R2SXc, kAlign>,
      Sm90AuxStore<0, void, Element, RC::round_to_nearest, AuxStride, void, void, kAlign>>;
  using Sum = Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape, float, float,
                               RC::round_to_nearest, PartialStride, 4, true, /*FinalReduction=*/false>;
  using Sq = Sm90Compute<Square, float, float, RC::round_to_nearest>;
  using SumSq = Sm90ColReduction<cutlass::plus, cutlass::plus, cutlass::plus, 0, TileShape, float, float,
                                 RC::round_to_nearest, PartialStride, 4, true, /*FinalReduction=*/false>;
  using Out = Sm90Compute<First, ElementRes, float, RC::round_to_nearest>;

  // nodes in topological order: 0 acc, 1 b, 2 g, 3 x, 4 m, 5 1+s, 6 y, 7 c, 8 xc, 9 store xc, 10 sum c,
  // 11 c^2, 12 sum c^2, 13 out = y
  using Edges = cute::tuple<cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>, cute::seq<>,
                            cute::seq<0, 1, 2, 3>, cute::seq<6, 4>, cute::seq<7, 5>, cute::seq<8>, cute::seq<7>,
                            cute::seq<7>, cute::seq<11>, cute::seq<6, 9, 10, 12>>;
  using Fusion = Sm90TopologicalVisitor<float, Edges, Acc, Bias, Gate, X, Mean, Scale, Y, Centre, Modulate, StoreXc,
                                        Sum, Sq, SumSq, Out>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpiTileType, float, float,
      ElementC, cutlass::layout::RowMajor, kAlignRes, ElementRes, cutlass::layout::RowMajor, kAlignRes,
      EpilogueSchedule, Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// The consumer's epilogue: the LayerNorm finished on the GEMM of the producer's xc,
//   out = rstd * (acc - mu_c * u) + v,   mu_c = S1 / C,  rstd = rsqrt(S2 / C - mu_c^2 + eps)
// with S1, S2 the producer's kPartials partial sums of c = y - m (so mu_c = mu - m), C = the
// residual width, u = (1 + s) W^T and v = sh W^T + b (fp32, per column); then GELU (tanh form) for fc1.
constexpr float kBlockLnEps = 1e-6f;  // BLOCK_LN_EPS (torch_cfm/config.py)

template <bool kGelu, int kWidth>
struct FinishLayerNorm {
  template <class T>
  struct Op;
  template <int N>
  struct Op<cutlass::Array<float, N>> {
    using A = cutlass::Array<float, N>;
    CUTLASS_DEVICE A operator()(A const& acc, A const& p0, A const& p1, A const& p2, A const& p3, A const& q0,
                                A const& q1, A const& q2, A const& q3, A const& u, A const& v) const {
      A out;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; ++i) {
        const float mean = ((p0[i] + p1[i]) + (p2[i] + p3[i])) * (1.0f / kWidth);
        const float var = fmaxf(((q0[i] + q1[i]) + (q2[i] + q3[i])) * (1.0f / kWidth) - mean * mean, 0.0f);
        float o = fmaf(rsqrtf(var + kBlockLnEps), fmaf(-mean, u[i], acc[i]), v[i]);
        if constexpr (kGelu) {
          constexpr float kC1 = -2.302208198144325f;   // as AddGeluTanh in csrc/cutlass/sm90_gemm.cuh
          constexpr float kC3 = -0.1029432395800235f;
          o = __fdividef(o, 1.0f + exp2f(o * fmaf(o * o, kC3, kC1)));
        }
        out[i] = o;
      }
      return out;
    }
  };
};

template <class Element, class TileShape, class ClusterShape, bool kGelu, bool kPingpong = false>
struct Sm90LayerNormConsumer {
  static constexpr int kAlign = 16 / sizeof(Element);
  static constexpr int kWidth = 512;  // the residual width C: 4 partials of 128 columns
  using RC = cutlass::FloatRoundStyle;
  using RowStride = cute::Stride<cute::_0, cute::_1, int64_t>;
  using ColStride = cute::Stride<cute::_1, cute::_0, int64_t>;
  using Part = Sm90ColBroadcast<0, TileShape, float, float, ColStride>;
  using Vec = Sm90RowBroadcast<0, TileShape, float, float, RowStride, 4>;
  template <class T>
  using Finish = typename FinishLayerNorm<kGelu, kWidth>::template Op<T>;
  using Fusion = Sm90EVT<Sm90Compute<Finish, Element, float, RC::round_to_nearest>, Sm90AccFetch, Part, Part, Part,
                         Part, Part, Part, Part, Part, Vec, Vec>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor, kAlign,
      Element, cutlass::layout::RowMajor, kAlign,
      cute::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized, cutlass::epilogue::TmaWarpSpecializedCooperative>,
      Fusion>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, kAlign, Element,
      cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cute::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                          cutlass::gemm::KernelTmaWarpSpecializedCooperative>>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Adapter = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

}  // namespace tcfm_experiment

namespace {
// can_implement, initialize, run: 0 on success, else the failing cutlass::Status (or -1 for a CUDA error)
template <class Adapter>
int run_gemm(typename Adapter::Arguments const& args, void* workspace, cudaStream_t stream) {
  Adapter gemm;
  cutlass::Status st = gemm.can_implement(args);
  if (st == cutlass::Status::kSuccess) st = gemm.initialize(args, workspace, stream);
  if (st == cutlass::Status::kSuccess) st = gemm.run(stream);
  if (st != cutlass::Status::kSuccess) return static_cast<int>(st);
  return cudaGetLastError() == cudaSuccess ? 0 : -1;
}

template <bool kTma, bool kPingpong = false, class ElementRes = cutlass::half_t>
using Producer = tcfm_experiment::Sm90ResidualRowStats<cutlass::half_t, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                                       cute::Shape<cute::_1, cute::_1, cute::_1>, kTma, kPingpong,
                                                       ElementRes>;
using E = cutlass::half_t;

// The arguments both GEMMs share: a (M, K) and w (N, K) K-major fp16, d (M, N) row-major, no source
// (the producer's TMA form sets ptr_C), a persistent grid over sm_count SMs; the epilogue's thread
// arguments are the caller's.
template <class Adapter>
typename Adapter::Arguments gemm_arguments(const void* a, const void* w, void* d, int m, int n, int k, int device,
                                           int sm_count) {
  const auto sk = cute::make_stride(int64_t(k), cute::Int<1>{}, int64_t(0));
  const auto sd = cute::make_stride(int64_t(n), cute::Int<1>{}, int64_t(0));
  cutlass::KernelHardwareInfo hw;
  hw.device_id = device;
  hw.sm_count = sm_count;
  using ED = typename Adapter::ElementD;
  return typename Adapter::Arguments{cutlass::gemm::GemmUniversalMode::kGemm,
                                     {m, n, k, 1},
                                     {static_cast<const E*>(a), sk, static_cast<const E*>(w), sk},
                                     {{}, nullptr, sd, static_cast<ED*>(d), sd},
                                     hw};
}

template <bool kTma, bool kPingpong = false, class ElementRes = E, class G = Producer<kTma, kPingpong, ElementRes>>
typename G::Adapter::Arguments make_arguments(const void* a, const void* w, const void* bias, const void* gate, const void* x,
                                     const float* mean, const float* scale, void* d, void* xc, float* s1, float* s2,
                                     int m, int n, int k, int device, int sm_count) {
  auto args = gemm_arguments<typename G::Adapter>(a, w, d, m, n, k, device, sm_count);
  const typename G::AuxStride aux{n, cute::_1{}, 0};
  // the partial sums: (round_up(M, CTA_M), N / CTA_N), m-major (Sm90ColReduction without its final pass)
  const typename G::PartialStride partial{cute::_1{}, cute::_0{}, 0};
  typename G::X::Arguments x_args{};
  if constexpr (kTma) {
    args.epilogue.ptr_C = static_cast<const ElementRes*>(x);  // x is the source C (TMA-loaded)
  } else {
    x_args = {static_cast<const ElementRes*>(x), ElementRes(0), aux};
  }
  // DAG arguments: one per node, in topological order
  args.epilogue.thread = {
      {},                                                                            // acc
      {static_cast<const E*>(bias), E(0), typename G::RowStride{}},                  // b
      {static_cast<const E*>(gate), E(0), typename G::RowStride{}},                  // g
      x_args,                                                                        // x
      {mean, 0.f, typename G::ColStride{}},                                          // m
      {scale, 1.f, typename G::RowStride{}},                                         // 1 + s
      {},                                                                            // y
      {},                                                                            // c
      {},                                                                            // xc
      {static_cast<E*>(xc), aux},                                                    // store xc
      {s1, 0.f, partial},                                                            // sum c
      {},                                                                            // c^2
      {s2, 0.f, partial},                                                            // sum c^2
      {}};                                                                           // out = y
  return args;
}
}  // namespace

// One call, fp16 operands, all row-major: a (M, K), w (N, K), bias, gate (N,), x, d, xc (M, N) (x and d
// float32 in forms 5 and 7), mean (M,) fp32, scale (N,) fp32 (= 1 + s); s1, s2: (N / 128,
// round_up(M, 128)) fp32 partial row sums.
// Returns 0 on success, else a cutlass::Status (or -1 for a CUDA error).
// form: 0 the register-direct form, 1 the TMA form (Sm90ResidualRowStats' kTma), 3 the TMA form on
// the ping-pong schedule; 5 and 7: forms 1 and 3 with a float32 residual stream (x and d float32).
namespace {
template <bool kTma, bool kPingpong, class ElementRes = E>
long long producer_workspace(int m, int n, int k) {
  return static_cast<long long>(Producer<kTma, kPingpong, ElementRes>::Adapter::get_workspace_size(
      make_arguments<kTma, kPingpong, ElementRes>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                  nullptr, nullptr, nullptr, nullptr, m, n, k, 0, 1)));
}
}  // namespace

extern "C" long long tcfm_residual_rowstats_f16_workspace(int m, int n, int k, int form) {
  switch (form) {
    case 1: return producer_workspace<true, false>(m, n, k);
    case 3: return producer_workspace<true, true>(m, n, k);
    case 5: return producer_workspace<true, false, float>(m, n, k);
    case 7: return producer_workspace<true, true, float>(m, n, k);
    default: return producer_workspace<false, false>(m, n, k);
  }
}

extern "C" int tcfm_residual_rowstats_f16(const void* a, const void* w, const void* bias, const void* gate,
                                          const void* x, const float* mean, const float* scale, void* d, void* xc,
                                          float* s1, float* s2, int m, int n, int k, int form, int device,
                                          int sm_count, void* workspace, cudaStream_t stream) {
  if (form == 5) {
    return run_gemm<typename Producer<true, false, float>::Adapter>(
        make_arguments<true, false, float>(a, w, bias, gate, x, mean, scale, d, xc, s1, s2, m, n, k, device, sm_count),
        workspace, stream);
  }
  if (form == 7) {
    return run_gemm<typename Producer<true, true, float>::Adapter>(
        make_arguments<true, true, float>(a, w, bias, gate, x, mean, scale, d, xc, s1, s2, m, n, k, device, sm_count),
        workspace, stream);
  }
  if (form == 3) {
    return run_gemm<typename Producer<true, true>::Adapter>(
        make_arguments<true, true>(a, w, bias, gate, x, mean, scale, d, xc, s1, s2, m, n, k, device, sm_count),
        workspace, stream);
  }
  if (form == 1) {
    return run_gemm<typename Producer<true>::Adapter>(
        make_arguments<true>(a, w, bias, gate, x, mean, scale, d, xc, s1, s2, m, n, k, device, sm_count), workspace,
        stream);
  }
  return run_gemm<typename Producer<false>::Adapter>(
      make_arguments<false>(a, w, bias, gate, x, mean, scale, d, xc, s1, s2, m, n, k, device, sm_count), workspace,
      stream);
}

namespace {
template <bool kGelu, bool kPingpong>
using Consumer = tcfm_experiment::Sm90LayerNormConsumer<cutlass::half_t, cute::Shape<cute::_128, cute::_128, cute::_64>,
                                                        cute::Shape<cute::_1, cute::_1, cute::_1>, kGelu, kPingpong>;

template <bool kGelu, bool kPingpong>
typename Consumer<kGelu, kPingpong>::Adapter::Arguments consumer_arguments(const void* xc, const void* w,
                                                                           const float* s1, const float* s2,
                                                                           const float* u, const float* v, void* d,
                                                                           int m, int n, int k, int device,
                                                                           int sm_count) {
  using C = Consumer<kGelu, kPingpong>;
  auto args = gemm_arguments<typename C::Adapter>(xc, w, d, m, n, k, device, sm_count);
  const int64_t mr = (m + 127) / 128 * 128;  // the producer's partials: (4, round_up(M, 128)) each
  auto part = [&](const float* p, int j) {
    return typename C::Part::Arguments{p == nullptr ? nullptr : p + j * mr, 0.f, typename C::ColStride{}};
  };
  args.epilogue.thread = {{}, part(s1, 0), part(s1, 1), part(s1, 2), part(s1, 3), part(s2, 0), part(s2, 1),
                          part(s2, 2), part(s2, 3), {u, 0.f, typename C::RowStride{}},
                          {v, 0.f, typename C::RowStride{}}, {}};
  return args;
}

template <bool kGelu, bool kPingpong>
long long consumer_workspace(int m, int n, int k) {
  return static_cast<long long>(Consumer<kGelu, kPingpong>::Adapter::get_workspace_size(
      consumer_arguments<kGelu, kPingpong>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, m, n, k, 0,
                                           1)));
}

template <bool kGelu, bool kPingpong>
int run_consumer(const void* xc, const void* w, const float* s1, const float* s2, const float* u, const float* v,
                 void* d, int m, int n, int k, int device, int sm_count, void* workspace, cudaStream_t stream) {
  return run_gemm<typename Consumer<kGelu, kPingpong>::Adapter>(
      consumer_arguments<kGelu, kPingpong>(xc, w, s1, s2, u, v, d, m, n, k, device, sm_count), workspace, stream);
}
}  // namespace

// The consumer GEMM: xc (M, K = 512) fp16 from the producer, w (N, K) fp16, s1 / s2 the producer's
// partials, u, v (N,) fp32; d (M, N) fp16 = rstd * (xc w^T - mu_c u) + v, then GELU when flags' bit 0
// is set; bit 1: the ping-pong schedule (else the cooperative one).
extern "C" long long tcfm_layernorm_consumer_f16_workspace(int m, int n, int k, int flags) {
  switch (flags & 3) {
    case 0: return consumer_workspace<false, false>(m, n, k);
    case 1: return consumer_workspace<true, false>(m, n, k);
    case 2: return consumer_workspace<false, true>(m, n, k);
    default: return consumer_workspace<true, true>(m, n, k);
  }
}

extern "C" int tcfm_layernorm_consumer_f16(const void* xc, const void* w, const float* s1, const float* s2,
                                           const float* u, const float* v, void* d, int m, int n, int k, int flags,
                                           int device, int sm_count, void* workspace, cudaStream_t stream) {
  if (k != 512) return static_cast<int>(cutlass::Status::kErrorInvalidProblem);  // the partials' width
  switch (flags & 3) {
    case 0: return run_consumer<false, false>(xc, w, s1, s2, u, v, d, m, n, k, device, sm_count, workspace, stream);
    case 1: return run_consumer<true, false>(xc, w, s1, s2, u, v, d, m, n, k, device, sm_count, workspace, stream);
    case 2: return run_consumer<false, true>(xc, w, s1, s2, u, v, d, m, n, k, device, sm_count, workspace, stream);
    default: return run_consumer<true, true>(xc, w, s1, s2, u, v, d, m, n, k, device, sm_count, workspace, stream);
  }
}
