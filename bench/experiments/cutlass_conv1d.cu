// Issue 41: the DiT block's causal convolutions as one implicit-GEMM conv each (experiment, compiled on a
// CPU box; not built into the library).
//
// Today a block's conv module runs each k = 3 causal conv as ONE GEMM over the [2 history ; T current]
// frames of every row against the tap-stacked weight (3C output channels), and the row-norm kernel
// behind it sums the three shifted taps (docs/design.md §4). At C = 512 that GEMM writes, and the row-norm
// reads back, 3C = 1536 channels a frame: about 20 MB each way at 6,400 rows (64 streams), for an
// output of 6.8 MB.
//
// Here the conv is CUTLASS's SM90 implicit-GEMM fprop (TMA im2col loads, warp-specialized, fp32
// accumulation): activation NWC = the body's history buffer (N rows, W = T + 2 frames, C channels, as
// the body lays it out), filter KSC (C_out, 3 taps, C_in), output NQK = (N, T, C_out) written once,
// fp16, no bias (the row-norm behind it adds it, in float32, as today). The taps are summed inside the
// GEMM's K loop (K = 3C), so the tap sum is rounded once instead of each tap's product.
//
// Build (registers and spills per kernel in the ptxas report):
//   nvcc -std=c++17 -O3 -DNDEBUG -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//     -Xcompiler -fPIC -shared -cudart static -I"$CUTLASS_INCLUDE" -Xptxas -v \
//     bench/experiments/cutlass_conv1d.cu -o build_conv1d/libconv1d.so
#include <cuda_runtime.h>

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/convolution.h"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"

namespace tcfm_experiment {

using namespace cute;

constexpr cutlass::conv::Operator kFprop = cutlass::conv::Operator::kFprop;
using Element = cutlass::half_t;
constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;
using Layout = cutlass::layout::TensorNWC;  // activation NWC, filter KSC, output NQK

template <class TileShape, int Stages>  // Stages 0: as many as shared memory holds (one CTA an SM)
struct Conv1d {
  using ClusterShape = Shape<_1, _1, _1>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, Layout, kAlign, Element, Layout, kAlign,
      cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
  using StageCount = cute::conditional_t<
      Stages == 0,
      cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::conv::collective::StageCount<Stages>>;
  using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, kFprop, Element, Layout, kAlign, Element, Layout, kAlign,
      float, TileShape, ClusterShape, StageCount, cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
  using Problem = cutlass::conv::ConvProblemShape<kFprop, Mainloop::DispatchPolicy::NumSpatialDimensions>;
  using Kernel = cutlass::conv::kernel::ConvUniversal<Problem, Mainloop, Epilogue>;
  using Adapter = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
};

// SM90 conv kernels are not persistent (CUTLASS 4.2: "Persistent schedules not support for conv yet"): the
// warp-specialized implicit-GEMM kernel, one CTA per output tile, one consumer warpgroup. config 0:
// 128 x 128 x 64 tiles, 3 stages (two CTAs an SM); 1: 64 x 128 x 64, 4 stages (twice the CTAs, two an
// SM); 2: 128 x 128 x 64 with as many stages as shared memory holds (one CTA an SM). 128 x 256 spills.
using Ws128 = Conv1d<Shape<_128, _128, Shape<_64>>, 3>;
using Ws64 = Conv1d<Shape<_64, _128, Shape<_64>>, 4>;
using Ws128Deep = Conv1d<Shape<_128, _128, Shape<_64>>, 0>;

template <class C>
typename C::Adapter::Arguments make_arguments(const void* act, const void* flt, void* out, int n, int w, int c,
                                              int k) {
  typename C::Problem problem(cutlass::conv::Mode::kCrossCorrelation, {n, w, c}, {k, 3, c}, {0}, {0}, {1}, {1}, 1);
  using StrideD = typename C::Kernel::StrideD;
  StrideD stride_d;
  cute::for_each(cute::make_seq<cute::rank<0>(StrideD{})>{}, [&](auto i) {
    cute::get<0, i>(stride_d) = problem.stride_C[C::Problem::RankT - 2 - i];
  });
  return typename C::Adapter::Arguments{
      problem,
      {static_cast<const Element*>(act), static_cast<const Element*>(flt)},
      {{1.0f, 0.0f}, nullptr, stride_d, static_cast<Element*>(out), stride_d}};
}

template <class C>
long long workspace(int n, int w, int c, int k) {
  return static_cast<long long>(C::Adapter::get_workspace_size(make_arguments<C>(nullptr, nullptr, nullptr, n, w, c, k)));
}

template <class C>
int run(const void* act, const void* flt, void* out, int n, int w, int c, int k, void* ws, cudaStream_t stream) {
  typename C::Adapter op;
  auto args = make_arguments<C>(act, flt, out, n, w, c, k);
  cutlass::Status status = op.can_implement(args);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  status = op.initialize(args, ws, stream);
  if (status != cutlass::Status::kSuccess) return static_cast<int>(status);
  status = op.run(stream);
  return static_cast<int>(status);
}

}  // namespace tcfm_experiment

using namespace tcfm_experiment;

// Bytes of workspace config `config` needs for the problem (activation (n, w, c), filter (k, 3, c)).
extern "C" long long tcfm_conv1d_f16_workspace(int n, int w, int c, int k, int config) {
  switch (config) {
    case 1: return workspace<Ws64>(n, w, c, k);
    case 2: return workspace<Ws128Deep>(n, w, c, k);
    default: return workspace<Ws128>(n, w, c, k);
  }
}

// out (n, w - 2, k) = causal conv of act (n, w, c) with flt (k, 3, c), fp16, fp32 accumulation, no padding
// (the first two frames of each row are its history). 0 = success, else a cutlass::Status.
extern "C" int tcfm_conv1d_f16(const void* act, const void* flt, void* out, int n, int w, int c, int k, int config,
                               void* ws, cudaStream_t stream) {
  switch (config) {
    case 1: return run<Ws64>(act, flt, out, n, w, c, k, ws, stream);
    case 2: return run<Ws128Deep>(act, flt, out, n, w, c, k, ws, stream);
    default: return run<Ws128>(act, flt, out, n, w, c, k, ws, stream);
  }
}
